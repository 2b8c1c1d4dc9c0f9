//! End-to-end: `run` against a tiny in-process hyper server.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use slipstream_loadgen::{run, run_one, Arrival, BenchConfig, RetryConfig, RetryMode};

/// Starts a server on 127.0.0.1:0 in its own thread and runtime; replies
/// `status` with the request body echoed back. Lives until the test exits.
fn start_server(status: StatusCode) -> SocketAddr {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                stream.set_nodelay(true).unwrap();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| async move {
                        let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        let mut resp = Response::new(Full::new(body));
                        *resp.status_mut() = status;
                        if status == StatusCode::TOO_MANY_REQUESTS {
                            resp.headers_mut().insert("x-slipstream-retry-after-ms", "30".parse().unwrap());
                        }
                        Ok::<_, Infallible>(resp)
                    });
                    let _ =
                        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap()
}

fn config(addr: SocketAddr, rate: f64) -> BenchConfig {
    BenchConfig {
        url: format!("http://{addr}/v1/pipelines/demo/infer"),
        body: Bytes::from_static(br#"{"x":[1,2,3]}"#).to_vec(),
        rates: vec![rate],
        duration_s: 1.0,
        warmup_s: 0.2,
        timeout_s: 2.0,
        seed: 7,
        ..BenchConfig::default()
    }
}

#[test]
fn echo_at_2000_rps_is_all_ok() {
    let addr = start_server(StatusCode::OK);
    let mut lines = Vec::new();
    let reports = run(&config(addr, 2000.0), &mut |l| lines.push(l.to_string())).unwrap();
    assert_eq!(reports.len(), 1);
    let r = &reports[0];
    eprintln!("{}", serde_json::to_string_pretty(r).unwrap());
    assert!(r.sent > 1700 && r.sent < 2300, "sent {}", r.sent);
    assert_eq!(r.errors, 0, "{:?}", r.errors_by_kind);
    assert_eq!(r.ok, r.sent);
    assert!((r.achieved_rps / 2000.0 - 1.0).abs() < 0.10, "achieved {}", r.achieved_rps);
    assert!(r.latency_ms.p50 > 0.0 && r.latency_ms.p50 <= r.latency_ms.p99);
    assert!(r.latency_ms.p99 <= r.latency_ms.max);
    assert!(r.max_connections_used >= 1 && r.max_connections_used <= 512);
    assert!(!lines.is_empty(), "progress was never called");
}

#[test]
fn status_503_is_counted_by_kind() {
    let addr = start_server(StatusCode::SERVICE_UNAVAILABLE);
    let cfg = BenchConfig { arrival: Arrival::Uniform, ..config(addr, 500.0) };
    let r = run_one(&cfg, 500.0, &mut |_| {}).unwrap();
    assert_eq!(r.ok, 0);
    assert_eq!(r.errors, r.sent);
    assert_eq!(r.sent, 500);
    assert_eq!(r.errors_by_kind.get("status_503"), Some(&r.sent));
    assert_eq!(r.achieved_rps, 0.0);
}

#[test]
fn refused_arrivals_are_retried_as_the_policy_says() {
    let addr = start_server(StatusCode::TOO_MANY_REQUESTS);
    let with = |mode, attempts| BenchConfig {
        arrival: Arrival::Uniform,
        retry: RetryConfig { mode, attempts, ..RetryConfig::default() },
        ..config(addr, 200.0)
    };
    // At once, up to three sends each: two retries per arrival.
    let r = run_one(&with(RetryMode::Now, 3), 200.0, &mut |_| {}).unwrap();
    assert_eq!(r.ok, 0);
    assert_eq!(r.errors_by_kind.get("status_429"), Some(&r.sent), "one outcome per arrival: {:?}", r.errors_by_kind);
    assert_eq!(r.retries, 2 * r.sent);
    // Honouring the 30 ms the server asks for, within a budget of a tenth.
    let r = run_one(&with(RetryMode::Honor, 3), 200.0, &mut |_| {}).unwrap();
    assert_eq!(r.errors_by_kind.get("status_429"), Some(&r.sent));
    assert!(r.retries >= 1 && r.retries <= r.sent / 10 + 40, "{} retries of {} arrivals", r.retries, r.sent);
    // Retried or not, a refusal's latency is not an OK latency.
    let r = run_one(&with(RetryMode::None, 3), 200.0, &mut |_| {}).unwrap();
    assert_eq!(r.retries, 0);
}

#[test]
fn sweep_runs_each_rate_in_order_multithreaded() {
    let addr = start_server(StatusCode::OK);
    let cfg = BenchConfig {
        rates: vec![300.0, 600.0],
        duration_s: 0.5,
        warmup_s: 0.0,
        arrival: Arrival::Bursty { burst: 5 },
        method: "GET".into(),
        body: Vec::new(),
        threads: 2,
        ..config(addr, 0.0)
    };
    let rs = run(&cfg, &mut |_| {}).unwrap();
    assert_eq!(rs.len(), 2);
    assert_eq!(rs[0].offered_rps, 300.0);
    assert_eq!(rs[1].offered_rps, 600.0);
    for r in &rs {
        assert_eq!(r.errors, 0, "{:?}", r.errors_by_kind);
        assert_eq!(r.ok, r.sent);
    }
}

#[test]
fn unreachable_url_fails_with_connect() {
    // Bind then drop to get a port that is (almost certainly) closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = BenchConfig { url: format!("http://127.0.0.1:{port}/"), ..BenchConfig::default() };
    let e = run(&cfg, &mut |_| {}).unwrap_err();
    assert_eq!(e.kind(), "connect", "{e}");
    assert!(e.to_string().contains("cannot connect"), "{e}");
}

#[test]
fn slow_server_requests_time_out() {
    // Accepts but never answers after the preflight: every request times out.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        tx.send(l.local_addr().unwrap()).unwrap();
        let mut held = Vec::new();
        // First connection: the preflight; answer it properly.
        if let Ok((mut s, _)) = l.accept() {
            use std::io::{Read, Write};
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
        while let Ok((s, _)) = l.accept() {
            held.push(s);
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let cfg = BenchConfig { duration_s: 0.3, warmup_s: 0.0, timeout_s: 0.2, max_connections: 4, ..config(addr, 100.0) };
    let r = run_one(&cfg, 100.0, &mut |_| {}).unwrap();
    assert!(r.sent > 10, "sent {}", r.sent);
    assert_eq!(r.ok, 0);
    assert_eq!(r.errors, r.sent);
    assert_eq!(r.errors_by_kind.get("timeout"), Some(&r.sent));
    assert!(r.max_connections_used <= 4);
}

#[test]
fn schedule_steps_the_rate_within_one_run() {
    let addr = start_server(StatusCode::OK);
    let cfg = BenchConfig {
        schedule: vec![(0.0, 200.0), (0.5, 1000.0), (1.0, 200.0)],
        duration_s: 1.5,
        warmup_s: 0.2,
        timeline_ms: 100.0,
        ..config(addr, 1.0)
    };
    let mut lines = Vec::new();
    let rs = run(&cfg, &mut |l| lines.push(l.to_string())).unwrap();
    assert_eq!(rs.len(), 1, "a schedule is one run, whatever `rates` says");
    let r = &rs[0];
    assert_eq!(r.schedule, cfg.schedule);
    assert!((r.offered_rps - 1400.0 / 3.0).abs() < 1e-6, "mean offered {}", r.offered_rps);
    assert_eq!(r.errors, 0, "{:?}", r.errors_by_kind);
    assert_eq!(r.ok, r.sent);
    assert_eq!(r.timeline.len(), 15, "the timeline covers the whole window");
    let sent = |from: usize, to: usize| r.timeline[from..to].iter().map(|b| b.ok).sum::<u64>() as f64;
    // Poisson counts (mean = variance): 100, 500, 100 expected; 4.5 sigma.
    for (got, want) in [(sent(0, 5), 100.0), (sent(5, 10), 500.0), (sent(10, 15), 100.0)] {
        assert!((got - want).abs() <= 4.5 * f64::sqrt(want), "{got} vs {want}: {:?}", r.timeline);
    }
    // Progress names the rate offered at the time, not the mean.
    let live = lines.iter().filter(|l| l.contains(" t="));
    assert!(
        live.clone().count() >= 1 && live.clone().all(|l| l.starts_with("rate 200/s") || l.starts_with("rate 1000/s")),
        "{lines:?}"
    );
}
