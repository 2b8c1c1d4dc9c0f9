//! The control plane at N nodes, against one real etcd: N simulated
//! members each do what a node's agent does (a lease renewed every third
//! of its TTL, a signed member record under it, re-put when its ready
//! replicas change, one watch on the cluster's prefix), and the leader
//! computes the placement for all N with the cluster's own
//! `placement::place` and writes it. Measured: etcd requests per second
//! per member (counted here), how long a change takes to reach every
//! member's watch, and the placement's solve time.
//!
//! `cargo run --release --example control_plane -- ETCD_URL MEMBERS SECONDS`
//! prints one JSON object (`bench/control_plane.py` runs it and writes the
//! results).

use slipstream_cluster::{seal, Member};
use slipstream_etcd::{Etcd, WatchEvent};
use slipstream_peer::ClusterKey;
use slipstream_sched::placement::place;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const TTL_S: i64 = 2;
/// A deployment of this many pipelines of this many stages (the placement's size).
const PIPELINES: usize = 10;
const STAGES: usize = 5;

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

fn record(name: &str, ready: u32) -> Member {
    Member {
        node: name.to_string(),
        http: format!("10.0.0.{}:8000", name.len()),
        data: "10.0.0.1:9000".parse().expect("an address"),
        cores: 16,
        memory_bytes: 128 << 30,
        gpus: vec![],
        store_keys: 0,
        ready: (0..PIPELINES * STAGES).map(|i| (format!("p{}/s{}", i / STAGES, i % STAGES), ready)).collect(),
        standby: Default::default(),
        load: Default::default(),
        tag: 0,
        deploy: "sim".into(),
        lease: 0,
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (url, n, secs) = match args.as_slice() {
        [_, url, n, secs] => (url.clone(), n.parse::<usize>().expect("MEMBERS"), secs.parse::<u64>().expect("SECONDS")),
        _ => {
            eprintln!("usage: control_plane ETCD_URL MEMBERS SECONDS");
            std::process::exit(2);
        }
    };
    let key = Arc::new(ClusterKey::from_token("sim"));
    let root = "/slipstream/sim/".to_string();
    let ops = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(parking_lot::Mutex::new(Vec::<f64>::new()));
    let deadline = Instant::now() + Duration::from_secs(secs);

    // Join: every member grants a lease and puts its record, as a node does.
    let join_started = Instant::now();
    let mut members = Vec::new();
    for i in 0..n {
        let etcd = Etcd::new(&url).expect("an etcd URL");
        let name = format!("m{i:03}");
        let lease = etcd.grant(TTL_S).await.expect("a lease");
        etcd.put(&format!("{root}members/{name}"), &seal(&key, "member", &record(&name, 0)), Some(lease))
            .await
            .expect("a member record");
        ops.fetch_add(2, Relaxed);
        members.push((etcd, name, lease));
    }
    let join_s = join_started.elapsed().as_secs_f64();

    let mut tasks = Vec::new();
    for (i, (etcd, name, lease)) in members.into_iter().enumerate() {
        let (key, root, ops, latencies) = (key.clone(), root.clone(), ops.clone(), latencies.clone());
        // The watch: every member follows the whole prefix.
        let mut events = etcd.watch_prefix(&root, 0);
        let lat = latencies.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                if let WatchEvent::Put(kv) = ev {
                    if kv.key.ends_with("/probe") {
                        if let Ok(sent) = std::str::from_utf8(&kv.value).unwrap_or("").parse::<u64>() {
                            lat.lock().push(now_us().saturating_sub(sent) as f64 / 1e3);
                        }
                    }
                }
            }
        }));
        // The keep-alive, and a record re-put now and then (a replica became ready).
        tasks.push(tokio::spawn(async move {
            let renew = Duration::from_millis(TTL_S as u64 * 1000 / 3);
            let mut tick = tokio::time::interval(renew);
            let mut k = 0u32;
            while Instant::now() < deadline {
                tick.tick().await;
                if etcd.keep_alive(lease).await.is_ok() {
                    ops.fetch_add(1, Relaxed);
                }
                k += 1;
                // Each member's ready replicas change about every 10 s.
                if (k as usize + i).is_multiple_of(15) {
                    let rec = seal(&key, "member", &record(&name, k % 3));
                    if etcd.put(&format!("{root}members/{name}"), &rec, Some(lease)).await.is_ok() {
                        ops.fetch_add(1, Relaxed);
                    }
                }
            }
            let _ = etcd.revoke(lease).await;
        }));
    }

    // The leader: place the deployment over all members, write it; and a
    // probe every 200 ms whose arrival at every watch is the latency.
    let etcd = Etcd::new(&url).expect("an etcd URL");
    let names: Vec<String> = (0..n).map(|i| format!("m{i:03}")).collect();
    let want: BTreeMap<String, u32> = (0..PIPELINES * STAGES)
        .map(|i| (format!("p{}/s{}", i / STAGES, i % STAGES), (n / 10).max(1) as u32 * 3))
        .collect();
    let mut solve = Vec::new();
    let t0 = Instant::now();
    let mut placement = place(&want, &names, None);
    solve.push(t0.elapsed().as_secs_f64() * 1e3);
    // A member leaves and comes back: re-placements from the previous one.
    for k in 0..20 {
        let mut some: Vec<String> = names.clone();
        some.remove(k % n);
        let t0 = Instant::now();
        let p = place(&want, &some, Some(&placement));
        solve.push(t0.elapsed().as_secs_f64() * 1e3);
        let t0 = Instant::now();
        placement = place(&want, &names, Some(&p));
        solve.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let sealed = seal(&key, "placement", &placement);
    let t0 = Instant::now();
    etcd.put(&format!("{root}placement"), &sealed, None).await.expect("the placement");
    let write_ms = t0.elapsed().as_secs_f64() * 1e3;
    ops.fetch_add(1, Relaxed);
    let measure_from = Instant::now();
    let ops_before = ops.load(Relaxed);
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = etcd.put(&format!("{root}probe"), now_us().to_string().as_bytes(), None).await;
    }
    let window = measure_from.elapsed().as_secs_f64();
    let member_ops = ops.load(Relaxed) - ops_before;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut lat = latencies.lock().clone();
    let probes = lat.len() as f64 / n as f64;
    let out = serde_json::json!({
        "members": n,
        "seconds": window,
        "join_s": join_s,
        "member_ops_per_s": member_ops as f64 / window,
        "ops_per_s_per_member": member_ops as f64 / window / n as f64,
        "watch_deliveries": lat.len(),
        "probes_seen_per_member": probes,
        "watch_latency_ms_p50": percentile(&mut lat, 0.5),
        "watch_latency_ms_p99": percentile(&mut lat, 0.99),
        "watch_latency_ms_max": lat.last().copied().unwrap_or(f64::NAN),
        "placement_stages": want.len(),
        "placement_replicas": want.values().sum::<u32>(),
        "placement_solve_ms_p50": percentile(&mut solve.clone(), 0.5),
        "placement_solve_ms_max": percentile(&mut solve, 1.0),
        "placement_record_bytes": sealed.len(),
        "placement_write_ms": write_ms,
    });
    println!("{out}");
    for t in tasks {
        t.abort();
    }
}
