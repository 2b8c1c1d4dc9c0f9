//! Calibration helper: `loadgen URL RATE [DURATION_S] [WARMUP_S]` runs one
//! rate (POST `{"x":1}`) and prints the JSON report on stdout; progress goes
//! to stderr.

use slipstream_loadgen::{run, BenchConfig};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: loadgen URL RATE [DURATION_S] [WARMUP_S]");
        std::process::exit(2);
    }
    let num = |i: usize, default: f64| -> f64 {
        args.get(i).map_or(default, |s| s.parse().unwrap_or_else(|_| panic!("not a number: {s}")))
    };
    let cfg = BenchConfig {
        url: args[1].clone(),
        body: br#"{"x":1}"#.to_vec(),
        rates: vec![num(2, 1000.0)],
        duration_s: num(3, 5.0),
        warmup_s: num(4, 1.0),
        ..BenchConfig::default()
    };
    match run(&cfg, &mut |line| eprintln!("{line}")) {
        Ok(reports) => println!("{}", serde_json::to_string_pretty(&reports).expect("report serializes")),
        Err(e) => {
            eprintln!("error ({}): {e}", e.kind());
            std::process::exit(1);
        }
    }
}
