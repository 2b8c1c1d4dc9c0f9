//! What mutual TLS costs the data plane, on loopback TCP.
//!
//! ```text
//! cargo run --release -p slipstream-peer --example tls_cost -- [--json PATH] [--secs S]
//! ```
//!
//! An echo server and a client in this process, once with the plain data
//! plane and once with mutual TLS (certificates from a throwaway cluster CA,
//! `slipstream_tls`). For tensors of 1 KiB, 64 KiB and 6.4 MB: the round
//! trip with one call in flight (p50 and p99 over `--secs` seconds), and
//! for 6.4 MB the bytes moved per second with 4 calls in flight (both
//! directions counted). Plain and TLS alternate, three rounds, and every
//! figure is the median of the three. Both ends share the machine's cores,
//! so each figure includes both sides' CPU (encryption on one side and
//! decryption on the other, twice per round trip).

use bytes::Bytes;
use serde_json::{json, Value};
use slipstream_peer::{serve_with_config, ClusterKey, OutTensor, Outgoing, PeerConfig, Peers, ServerHandle, VecAlloc};
use slipstream_types::DType;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

const SIZES: [(&str, usize); 3] = [("1KiB", 1 << 10), ("64KiB", 64 << 10), ("6.4MB", 6_400_000)];
const ROUNDS: usize = 3;
const INFLIGHT: usize = 4;

struct Setup {
    peers: Peers<VecAlloc>,
    addr: SocketAddr,
    _server: ServerHandle,
}

async fn setup(tls: Option<(slipstream_tls::NodeTls, slipstream_tls::NodeTls)>) -> Setup {
    let key = ClusterKey::from_token("tls-cost");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (server_tls, client_tls) = match tls {
        Some((s, c)) => (Some(s), Some(c)),
        None => (None, None),
    };
    let cfg = |tls| PeerConfig { tls, ..PeerConfig::default() };
    let server = serve_with_config(
        listener,
        key.clone(),
        "server".into(),
        Arc::new(VecAlloc),
        cfg(server_tls),
        |_, c, _| async { Outgoing::echo(c) },
    );
    let peers = Peers::with_config(key, "client".into(), Arc::new(VecAlloc), cfg(client_tls));
    Setup { peers, addr, _server: server }
}

fn tensor(n: usize) -> Vec<OutTensor> {
    let data: Bytes = (0..n).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>().into();
    vec![OutTensor { name: "x".into(), dtype: DType::Uint8, shape: vec![n as u64], data }]
}

async fn one(s: &Setup, t: &[OutTensor]) {
    let reply =
        s.peers.call(s.addr, Outgoing::call(Vec::new(), t.to_vec()), Duration::from_secs(60)).await.expect("call");
    assert_eq!(reply.tensors[0].nbytes as usize, t[0].data.len());
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// p50 and p99 of the round trip, in ms.
async fn latency(s: &Setup, n: usize, secs: f64) -> (f64, f64) {
    let t = tensor(n);
    for _ in 0..20 {
        one(s, &t).await;
    }
    let mut lat = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        let t0 = Instant::now();
        one(s, &t).await;
        lat.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    lat.sort_by(f64::total_cmp);
    (pct(&lat, 0.5), pct(&lat, 0.99))
}

/// MB/s moved (both directions) with `INFLIGHT` calls of `n` bytes.
async fn throughput(s: &Arc<Setup>, n: usize, secs: f64) -> f64 {
    let t = Arc::new(tensor(n));
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..INFLIGHT {
        let (s, t) = (s.clone(), t.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while Instant::now() < end {
                one(&s, &t).await;
                done += 1;
            }
            done
        }));
    }
    let mut calls = 0;
    for t in tasks {
        calls += t.await.expect("task");
    }
    (calls * 2 * n as u64) as f64 / start.elapsed().as_secs_f64() / 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let secs: f64 = arg("--secs").map_or(2.0, |s| s.parse().expect("--secs"));
    let tmp = std::env::temp_dir().join(format!("slipstream-tls-cost-{}", std::process::id()));
    slipstream_tls::make_ca(&tmp.join("ca"), 1).expect("CA");
    let load = |name: &str| {
        slipstream_tls::issue(&tmp.join("ca"), &tmp.join(name), &[name.to_string()], 1).expect("issue");
        slipstream_tls::NodeTls::load(&tmp.join(name)).expect("load")
    };
    let pair = (load("server"), load("client"));
    let plain = Arc::new(setup(None).await);
    let tls = Arc::new(setup(Some(pair)).await);
    let mut rows: Vec<Value> = Vec::new();
    for (label, n) in SIZES {
        let mut r: [Vec<f64>; 4] = Default::default();
        for _ in 0..ROUNDS {
            for (i, s) in [&plain, &tls].into_iter().enumerate() {
                let (p50, p99) = latency(s, n, secs).await;
                r[i * 2].push(p50);
                r[i * 2 + 1].push(p99);
            }
        }
        let [pp50, pp99, tp50, tp99] = r.map(median);
        println!(
            "{label:>6}: plain p50 {pp50:.3} ms p99 {pp99:.3} ms | TLS p50 {tp50:.3} ms p99 {tp99:.3} ms | p50 x{:.2}",
            tp50 / pp50
        );
        rows.push(json!({"size": label, "bytes": n, "plain_p50_ms": pp50, "plain_p99_ms": pp99, "tls_p50_ms": tp50, "tls_p99_ms": tp99}));
    }
    let (mut p, mut t) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        p.push(throughput(&plain, 6_400_000, secs).await);
        t.push(throughput(&tls, 6_400_000, secs).await);
    }
    let (p, t) = (median(p), median(t));
    println!("6.4MB x{INFLIGHT} in flight: plain {p:.0} MB/s | TLS {t:.0} MB/s | x{:.2}", t / p);
    let _ = std::fs::remove_dir_all(&tmp);
    let out = json!({"latency": rows, "throughput_6_4MB_MBps": {"plain": p, "tls": t, "inflight": INFLIGHT}, "secs": secs, "rounds": ROUNDS});
    if let Some(path) = arg("--json") {
        std::fs::write(&path, serde_json::to_string_pretty(&out).expect("json")).expect("write --json");
        println!("wrote {path}");
    }
}
