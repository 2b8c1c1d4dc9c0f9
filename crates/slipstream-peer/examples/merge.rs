//! What merging small tensors into one buffer buys, on loopback TCP.
//!
//! ```text
//! cargo run --release -p slipstream-peer --example merge -- [--json PATH] [--secs S]
//! ```
//!
//! An echo server (`serve`, the handler sends the call's tensors back from
//! the received buffer, without a copy) and a client (`Peers`) share one
//! `ClusterKey` and one Tokio runtime in this process. A request is
//! recsys-style: 128 sparse features of 64 bytes each (int64 ids, shape
//! `[8]`) and one dense tensor of 13 float32. Modes, each with its own
//! server and connection:
//!
//! - `merged`: one frame per request, merge threshold from `measure_costs()`
//!   (on both sides, so the echo is merged too);
//! - `unmerged`: one frame per request, threshold 0 (each tensor its own
//!   iovec entry, both ways);
//! - `one_by_one`: one frame per tensor, the 129 calls issued at once (one
//!   task each, in a `JoinSet`) and awaited together;
//! - `one_by_one_seq`: one frame per tensor, one call after the other.
//!
//! Each mode is measured with 1 request in flight (latency) and with 16
//! (throughput), for `--secs` seconds each after a short warm-up. Then, for
//! context, a single 6.4 MB and a single 1 KB tensor round trip with the
//! merged configuration, 1 in flight. The whole set is run 3 times with
//! the modes in a rotated order each time, and the median of the 3 runs is
//! reported for every figure. Latency is from just before the request is
//! handed to `Peers::call` to the last reply; throughput counts requests
//! completed over the wall time of the run (including requests started
//! before the deadline and finished after it).
//!
//! Client and server share the machine: on loopback every figure includes
//! both ends' CPU, and on a small machine the two contend for cores.

use bytes::Bytes;
use serde_json::{json, Value};
use slipstream_peer::{measure_costs, serve, ClusterKey, CounterSnapshot, OutTensor, Outgoing, Peers, VecAlloc};
use slipstream_types::DType;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

const SPARSE: usize = 128;
const SPARSE_ELEMS: u64 = 8; // int64: 64 bytes
const DENSE_ELEMS: u64 = 13; // float32: 52 bytes
const LARGE_ELEMS: u64 = 1_600_000; // float32: 6.4 MB
const SMALL_ELEMS: u64 = 256; // float32: 1 KiB
const REPS: usize = 3;
const LATENCY_INFLIGHT: usize = 1;
const THROUGHPUT_INFLIGHT: usize = 16;
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
const META: &[u8] = b"{\"stage\":1}";

type Res<T> = Result<T, String>;

/// How a workload goes over the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    /// All tensors in one frame.
    OneFrame,
    /// One frame per tensor, all calls at once.
    PerTensorConcurrent,
    /// One frame per tensor, one call after the other.
    PerTensorSequential,
}

struct Mode {
    name: &'static str,
    threshold: usize,
    send: Wire,
}

/// One server and the client connected to it.
struct Setup {
    peers: Peers<VecAlloc>,
    addr: SocketAddr,
    _server: slipstream_peer::ServerHandle,
}

async fn setup(key: &ClusterKey, threshold: usize) -> Res<Setup> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server =
        serve(listener, key.clone(), "bench-server".into(), Arc::new(VecAlloc), threshold, |_, call, _| async {
            Outgoing::echo(call)
        });
    let peers = Peers::new(key.clone(), "bench-client".into(), Arc::new(VecAlloc), threshold);
    Ok(Setup { peers, addr, _server: server })
}

fn pattern(seed: u64, n: usize) -> Bytes {
    (0..n).map(|i| (i as u64).wrapping_mul(131).wrapping_add(seed.wrapping_mul(7919)) as u8).collect::<Vec<u8>>().into()
}

fn tensor(name: String, dtype: DType, elems: u64, seed: u64) -> OutTensor {
    let n = elems as usize * if dtype == DType::Int64 { 8 } else { 4 };
    OutTensor { name, dtype, shape: vec![elems], data: pattern(seed, n) }
}

fn request() -> Vec<OutTensor> {
    let mut t: Vec<OutTensor> =
        (0..SPARSE).map(|i| tensor(format!("sparse_{i:03}"), DType::Int64, SPARSE_ELEMS, i as u64)).collect();
    t.push(tensor("dense".into(), DType::Float32, DENSE_ELEMS, 1000));
    t
}

/// One call carrying `tensors`; checks the echo's shape (and, if `verify`,
/// its bytes).
async fn call(s: &Setup, tensors: Vec<OutTensor>, verify: bool) -> Res<()> {
    let want: Vec<OutTensor> = if verify { tensors.clone() } else { Vec::new() };
    let (n, bytes) = (tensors.len(), tensors.iter().map(|t| t.data.len() as u64).sum::<u64>());
    let mut reply = s
        .peers
        .call(s.addr, Outgoing::call(META.to_vec(), tensors), CALL_TIMEOUT)
        .await
        .map_err(|e| format!("call: {e}"))?;
    let got: u64 = reply.tensors.iter().map(|t| t.nbytes).sum();
    if reply.tensors.len() != n || got != bytes {
        return Err(format!("echo of {n} tensors / {bytes} B came back as {} / {got} B", reply.tensors.len()));
    }
    for (i, w) in want.iter().enumerate() {
        if reply.tensor_data(i) != Some(&w.data[..]) || reply.tensors[i].name != w.name {
            return Err(format!("echo of tensor {} differs", w.name));
        }
    }
    Ok(())
}

/// One request of `tensors`, sent as `send` says.
async fn request_once(s: &Arc<Setup>, tensors: &Arc<Vec<OutTensor>>, send: Wire, verify: bool) -> Res<()> {
    match send {
        Wire::OneFrame => call(s, tensors.to_vec(), verify).await,
        Wire::PerTensorSequential => {
            for t in tensors.iter() {
                call(s, vec![t.clone()], verify).await?;
            }
            Ok(())
        }
        Wire::PerTensorConcurrent => {
            let mut set = JoinSet::new();
            for t in tensors.iter() {
                let (s, t) = (s.clone(), t.clone());
                set.spawn(async move { call(&s, vec![t], verify).await });
            }
            while let Some(r) = set.join_next().await {
                r.map_err(|e| format!("task: {e}"))??;
            }
            Ok(())
        }
    }
}

struct Run {
    requests: u64,
    secs: f64,
    latencies_ns: Vec<u64>,
    counters: CounterSnapshot,
}

/// `inflight` workers sending requests back to back until `dur` is over.
async fn run_load(
    s: &Arc<Setup>,
    tensors: &Arc<Vec<OutTensor>>,
    send: Wire,
    inflight: usize,
    dur: Duration,
) -> Res<Run> {
    let before = s.peers.counters();
    let start = Instant::now();
    let deadline = start + dur;
    let mut workers = JoinSet::new();
    for _ in 0..inflight {
        let (s, tensors) = (s.clone(), tensors.clone());
        workers.spawn(async move {
            let mut lat = Vec::with_capacity(1 << 14);
            while Instant::now() < deadline {
                let t0 = Instant::now();
                request_once(&s, &tensors, send, false).await?;
                lat.push(t0.elapsed().as_nanos() as u64);
            }
            Res::Ok(lat)
        });
    }
    let mut latencies_ns = Vec::new();
    while let Some(r) = workers.join_next().await {
        latencies_ns.extend(r.map_err(|e| format!("worker: {e}"))??);
    }
    let secs = start.elapsed().as_secs_f64();
    let after = s.peers.counters();
    latencies_ns.sort_unstable();
    Ok(Run { requests: latencies_ns.len() as u64, secs, latencies_ns, counters: delta(&before, &after) })
}

fn delta(a: &CounterSnapshot, b: &CounterSnapshot) -> CounterSnapshot {
    CounterSnapshot {
        frames_sent: b.frames_sent - a.frames_sent,
        tensors_sent: b.tensors_sent - a.tensors_sent,
        bytes_sent: b.bytes_sent - a.bytes_sent,
        merge_copied_bytes: b.merge_copied_bytes - a.merge_copied_bytes,
        merged_runs: b.merged_runs - a.merged_runs,
        merged_tensors: b.merged_tensors - a.merged_tensors,
        zero_copy_tensors: b.zero_copy_tensors - a.zero_copy_tensors,
        frames_received: b.frames_received - a.frames_received,
        bytes_received: b.bytes_received - a.bytes_received,
        alloc_failures: b.alloc_failures - a.alloc_failures,
    }
}

/// Nearest-rank percentile of sorted values, in microseconds.
fn pct_us(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// The figures of one run.
#[derive(Clone, Copy)]
struct Fig {
    p50_us: f64,
    p99_us: f64,
    rps: f64,
    requests: u64,
}

impl Fig {
    fn of(r: &Run) -> Fig {
        Fig {
            p50_us: pct_us(&r.latencies_ns, 0.50),
            p99_us: pct_us(&r.latencies_ns, 0.99),
            rps: r.requests as f64 / r.secs,
            requests: r.requests,
        }
    }

    fn json(&self) -> Value {
        json!({ "p50_us": self.p50_us, "p99_us": self.p99_us, "rps": self.rps, "requests": self.requests })
    }
}

/// Every rep of one (workload, in-flight) cell, and its medians.
#[derive(Default)]
struct Cell {
    reps: Vec<Fig>,
    /// Client counters per request, from the last rep.
    per_request: Option<Value>,
}

impl Cell {
    fn med(&self) -> Fig {
        let m = |f: fn(&Fig) -> f64| median(self.reps.iter().map(f).collect());
        Fig {
            p50_us: m(|f| f.p50_us),
            p99_us: m(|f| f.p99_us),
            rps: m(|f| f.rps),
            requests: self.reps.iter().map(|f| f.requests).sum(),
        }
    }

    fn json(&self) -> Value {
        let med = self.med();
        json!({
            "median": { "p50_us": med.p50_us, "p99_us": med.p99_us, "rps": med.rps },
            "total_requests": med.requests,
            "reps": self.reps.iter().map(Fig::json).collect::<Vec<_>>(),
            "client_counters_per_request": self.per_request,
        })
    }

    fn record(&mut self, r: &Run) {
        self.reps.push(Fig::of(r));
        let n = r.requests.max(1) as f64;
        let c = &r.counters;
        self.per_request = Some(json!({
            "frames_sent": c.frames_sent as f64 / n,
            "tensors_sent": c.tensors_sent as f64 / n,
            "bytes_sent": c.bytes_sent as f64 / n,
            "merged_tensors": c.merged_tensors as f64 / n,
            "merged_runs": c.merged_runs as f64 / n,
            "zero_copy_tensors": c.zero_copy_tensors as f64 / n,
            "merge_copied_bytes": c.merge_copied_bytes as f64 / n,
        }));
    }
}

fn loadavg() -> Value {
    match std::fs::read_to_string("/proc/loadavg") {
        Ok(s) => {
            let f: Vec<f64> = s.split_whitespace().take(3).filter_map(|x| x.parse().ok()).collect();
            json!({ "raw": s.trim(), "1m": f.first(), "5m": f.get(1), "15m": f.get(2) })
        }
        Err(e) => json!({ "error": e.to_string() }),
    }
}

struct Args {
    json: Option<String>,
    secs: f64,
}

fn args() -> Res<Args> {
    let mut a = Args { json: None, secs: 3.0 };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--json" => a.json = Some(it.next().ok_or("--json needs a path")?),
            "--secs" => {
                let v = it.next().ok_or("--secs needs a number")?;
                a.secs = v.parse().map_err(|_| format!("--secs {v}: not a number"))?;
                if !(a.secs.is_finite() && a.secs > 0.0) {
                    return Err(format!("--secs {v}: must be positive"));
                }
            }
            "-h" | "--help" => {
                println!("usage: merge [--json PATH] [--secs S]   (S: seconds per measurement, default 3)");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (try --help)")),
        }
    }
    Ok(a)
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("merge: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Res<()> {
    let args = args()?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let load_before = loadavg();
    // Blocking; before the runtime starts, as the runtime does it.
    let costs = measure_costs();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let out = rt.block_on(bench(&args, costs.merge_threshold))?;
    let load_after = loadavg();

    print_report(&args, cores, &costs, &out, &load_before, &load_after);

    if let Some(path) = &args.json {
        let doc = json!({
            "benchmark": "slipstream-peer merge",
            "config": {
                "secs": args.secs,
                "warmup_secs": warmup(args.secs).as_secs_f64(),
                "reps": REPS,
                "statistic": "median over reps of each figure",
                "latency_inflight": LATENCY_INFLIGHT,
                "throughput_inflight": THROUGHPUT_INFLIGHT,
                "request": {
                    "sparse_tensors": SPARSE, "sparse_dtype": "int64", "sparse_shape": [SPARSE_ELEMS],
                    "sparse_bytes": SPARSE_ELEMS * 8,
                    "dense_dtype": "float32", "dense_shape": [DENSE_ELEMS], "dense_bytes": DENSE_ELEMS * 4,
                },
                "server": "echo (reply tensors sliced from the received buffer), same process and runtime",
                "runtime_workers": cores,
            },
            "machine": { "cores": cores, "loadavg_before": load_before, "loadavg_after": load_after },
            "measure_costs": costs,
            "modes": out.modes.iter().map(|(m, lat, thr)| (m.name.to_string(), json!({
                "merge_threshold": m.threshold,
                "frames_per_request": if m.send == Wire::OneFrame { 1 } else { SPARSE + 1 },
                "latency": lat.json(),
                "throughput": thr.json(),
            }))).collect::<serde_json::Map<_, _>>(),
            "single_tensor": {
                "merge_threshold": costs.merge_threshold,
                "inflight": LATENCY_INFLIGHT,
                "float32_6.4MB": out.large.json(),
                "float32_1KiB": out.small.json(),
            },
            "ratios": ratios(&out),
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("write {path}: {e}"))?;
        println!("\nwrote {path}");
    }
    Ok(())
}

struct Out {
    /// Per mode: latency cell, throughput cell.
    modes: Vec<(Mode, Cell, Cell)>,
    large: Cell,
    small: Cell,
}

fn warmup(secs: f64) -> Duration {
    Duration::from_secs_f64((secs / 10.0).clamp(0.1, 0.5))
}

async fn bench(args: &Args, threshold: usize) -> Res<Out> {
    let key = ClusterKey::from_token("merge-bench-token");
    let modes = [
        Mode { name: "merged", threshold, send: Wire::OneFrame },
        Mode { name: "unmerged", threshold: 0, send: Wire::OneFrame },
        Mode { name: "one_by_one", threshold, send: Wire::PerTensorConcurrent },
        Mode { name: "one_by_one_seq", threshold, send: Wire::PerTensorSequential },
    ];
    let mut setups = Vec::new();
    for m in &modes {
        setups.push(Arc::new(setup(&key, m.threshold).await?));
    }
    let req = Arc::new(request());
    let large = Arc::new(vec![tensor("dense_6m4".into(), DType::Float32, LARGE_ELEMS, 7)]);
    let small = Arc::new(vec![tensor("dense_1k".into(), DType::Float32, SMALL_ELEMS, 8)]);
    // Connect, and check every echo byte once.
    for (m, s) in modes.iter().zip(&setups) {
        request_once(s, &req, m.send, true).await.map_err(|e| format!("{}: {e}", m.name))?;
    }
    request_once(&setups[0], &large, Wire::OneFrame, true).await?;
    request_once(&setups[0], &small, Wire::OneFrame, true).await?;

    let dur = Duration::from_secs_f64(args.secs);
    let warm = warmup(args.secs);
    let cells = modes.len() * 2 + 2;
    eprintln!(
        "merge threshold {threshold} B; {REPS} reps x {cells} runs of {:.1} s (+{:.1} s warm-up each): about {:.0} s",
        args.secs,
        warm.as_secs_f64(),
        (REPS * cells) as f64 * (args.secs + warm.as_secs_f64())
    );

    let mut out: Vec<(Cell, Cell)> = modes.iter().map(|_| Default::default()).collect();
    let (mut large_cell, mut small_cell) = (Cell::default(), Cell::default());
    for rep in 0..REPS {
        // Rotate the order so that no mode always runs first (or right after
        // another one's load).
        for k in 0..modes.len() {
            let i = (k + rep) % modes.len();
            let (m, s) = (&modes[i], &setups[i]);
            let (lat, thr) = &mut out[i];
            for (inflight, cell) in [(LATENCY_INFLIGHT, lat), (THROUGHPUT_INFLIGHT, thr)] {
                run_load(s, &req, m.send, inflight, warm).await?;
                let r = run_load(s, &req, m.send, inflight, dur).await.map_err(|e| format!("{}: {e}", m.name))?;
                eprintln!(
                    "rep {} {:<15} {:>2} in flight: {:>8} req, p50 {:>9.1} us, {:>9.0} req/s",
                    rep + 1,
                    m.name,
                    inflight,
                    r.requests,
                    pct_us(&r.latencies_ns, 0.5),
                    r.requests as f64 / r.secs
                );
                cell.record(&r);
            }
        }
        for (name, w, cell) in [("6.4 MB", &large, &mut large_cell), ("1 KiB", &small, &mut small_cell)] {
            run_load(&setups[0], w, Wire::OneFrame, LATENCY_INFLIGHT, warm).await?;
            let r = run_load(&setups[0], w, Wire::OneFrame, LATENCY_INFLIGHT, dur).await?;
            eprintln!(
                "rep {} single {:<8} 1 in flight: {:>8} req, p50 {:>9.1} us",
                rep + 1,
                name,
                r.requests,
                pct_us(&r.latencies_ns, 0.5)
            );
            cell.record(&r);
        }
    }
    Ok(Out {
        modes: modes.into_iter().zip(out).map(|(m, (l, t))| (m, l, t)).collect(),
        large: large_cell,
        small: small_cell,
    })
}

/// Merged against another mode: both ratios above 1 mean merged is better.
fn ratio(out: &Out, other: &str) -> Option<Value> {
    let find = |n: &str| out.modes.iter().find(|(m, _, _)| m.name == n);
    let (_, ml, mt) = find("merged")?;
    let (_, ol, ot) = find(other)?;
    let (ml, mt, ol, ot) = (ml.med(), mt.med(), ol.med(), ot.med());
    Some(json!({
        "throughput_merged_over_other": mt.rps / ot.rps,
        "p50_other_over_merged": ol.p50_us / ml.p50_us,
        "p99_other_over_merged": ol.p99_us / ml.p99_us,
        "p50_other_over_merged_at_throughput_inflight": ot.p50_us / mt.p50_us,
    }))
}

fn ratios(out: &Out) -> Value {
    json!({
        "merged_vs_unmerged": ratio(out, "unmerged"),
        "merged_vs_one_by_one": ratio(out, "one_by_one"),
        "merged_vs_one_by_one_seq": ratio(out, "one_by_one_seq"),
    })
}

fn print_report(args: &Args, cores: usize, costs: &slipstream_peer::Costs, out: &Out, before: &Value, after: &Value) {
    println!(
        "slipstream-peer merge benchmark: {cores} cores, loadavg before {} / after {}, {} s per run, median of {REPS}",
        before["raw"].as_str().unwrap_or("?"),
        after["raw"].as_str().unwrap_or("?"),
        args.secs
    );
    println!(
        "measure_costs: per_segment {:.2} ns, per_byte {:.4} ns -> merge_threshold {} B",
        costs.per_segment_ns, costs.per_byte_ns, costs.merge_threshold
    );
    println!(
        "request: {SPARSE} x int64[{SPARSE_ELEMS}] ({} B each) + float32[{DENSE_ELEMS}]; echo server on loopback",
        SPARSE_ELEMS * 8
    );
    println!();
    println!(
        "{:<15} {:>9} {:>11} {:>11} {:>11} | {:>11} {:>11} {:>11}",
        "mode", "threshold", "p50 us @1", "p99 us @1", "req/s @1", "p50 us @16", "p99 us @16", "req/s @16"
    );
    for (m, lat, thr) in &out.modes {
        let (l, t) = (lat.med(), thr.med());
        println!(
            "{:<15} {:>9} {:>11.1} {:>11.1} {:>11.0} | {:>11.1} {:>11.1} {:>11.0}",
            m.name, m.threshold, l.p50_us, l.p99_us, l.rps, t.p50_us, t.p99_us, t.rps
        );
    }
    println!();
    println!("merged tensors per request (client side, last rep):");
    for (m, _, thr) in &out.modes {
        let pr = thr.per_request.as_ref();
        let get = |k: &str| pr.and_then(|v| v[k].as_f64()).unwrap_or(f64::NAN);
        println!(
            "  {:<15} frames {:>6.1}  merged {:>6.1}  zero-copy {:>6.1}",
            m.name,
            get("frames_sent"),
            get("merged_tensors"),
            get("zero_copy_tensors")
        );
    }
    println!();
    for (other, label) in [("unmerged", "unmerged"), ("one_by_one", "one_by_one"), ("one_by_one_seq", "one_by_one_seq")]
    {
        if let Some(r) = ratio(out, other) {
            println!(
                "merged vs {label:<15} throughput x{:.2} (merged/other @16), p50 x{:.2} (other/merged @1)",
                r["throughput_merged_over_other"].as_f64().unwrap_or(f64::NAN),
                r["p50_other_over_merged"].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    println!();
    println!("single tensor, merged config (threshold {} B), 1 in flight:", costs.merge_threshold);
    for (name, cell) in [("float32 6.4 MB", &out.large), ("float32 1 KiB", &out.small)] {
        let f = cell.med();
        println!("  {name:<15} p50 {:>9.1} us  p99 {:>9.1} us  {:>9.0} req/s", f.p50_us, f.p99_us, f.rps);
    }
}
