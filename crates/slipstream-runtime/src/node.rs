//! The node: builds pipelines from the spec, starts one task per worker
//! replica, serves HTTP, and shuts down gracefully.
//!
//! Start-up: pools and replica tasks first, then the listener (so `/healthz`
//! answers while models load), then `/readyz` turns ready when every
//! replica's first worker has reported ready. A component that cannot start
//! (import error, constructor raised) fails start-up with its message.
//!
//! Shutdown (SIGINT/SIGTERM, or the `shutdown` future): stop accepting, let
//! in-flight requests finish (bounded by `drain_timeout`), close idle
//! connections, tell workers to exit, remove shared-memory files.

use crate::arena::Arena;
use crate::error::NodeError;
use crate::http;
use crate::metrics::{PipelineMetrics, PromText, StageMetrics};
use crate::pipeline::{PipelineRt, Replica, StageRt};
use crate::replica::{self, Launch, ReplicaCtx};
use crate::spec::AppSpec;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::{json, Value};
use slipstream_sched::{BatchFormer, LatencyProfile, Policy};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch, Notify};

/// Node settings. Defaults suit one machine; the CLI overrides them.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub host: String,
    pub port: u16,
    /// Tokio worker threads for the node.
    pub threads: usize,
    pub max_body_bytes: usize,
    /// Longest a request may take before it is answered 504 and its state
    /// (including half-joined fan-in parts) is released.
    pub request_timeout: Duration,
    pub drain_timeout: Duration,
    pub worker_start_timeout: Duration,
    pub ingress_pool_bytes: usize,
    pub replica_pool_bytes: usize,
    pub shm_dir: PathBuf,
    /// Print start-up and shutdown lines on stderr.
    pub log: bool,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            host: "127.0.0.1".into(),
            port: 8000,
            threads: std::thread::available_parallelism().map(|n| n.get().min(4)).unwrap_or(2),
            max_body_bytes: 64 << 20,
            request_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(30),
            worker_start_timeout: Duration::from_secs(300),
            ingress_pool_bytes: 1 << 30,
            replica_pool_bytes: 256 << 20,
            shm_dir: slipstream_shm::default_dir(),
            log: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("component {stage} failed to start: {message}")]
    WorkerStart { stage: String, message: String },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

impl RunError {
    pub fn kind(&self) -> &'static str {
        match self {
            RunError::Spec(_) => "invalid_spec",
            RunError::Bind { .. } => "bind",
            RunError::WorkerStart { .. } => "worker_start",
            RunError::Node(e) => e.kind(),
            RunError::Io(_) => "io",
        }
    }
}

pub struct Node {
    pub pipelines: BTreeMap<String, Arc<PipelineRt>>,
    pub arena: Arc<Arena>,
    pub opts: NodeOptions,
    pub ready: AtomicBool,
    pub draining: AtomicBool,
    pub inflight: AtomicUsize,
    pub idle: Notify,
    pub next_id: AtomicU64,
    pub started: Instant,
    /// Refuse requests predicted to miss their deadline (429).
    pub admission: bool,
}

impl Node {
    pub fn pipeline(&self, name: &str) -> Result<Arc<PipelineRt>, NodeError> {
        self.pipelines.get(name).cloned().ok_or_else(|| NodeError::UnknownPipeline(name.to_string()))
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Relaxed) && !self.draining.load(Relaxed)
    }

    pub fn reset_metrics(&self) {
        for p in self.pipelines.values() {
            p.metrics.reset();
            p.stages.iter().for_each(|s| s.metrics.reset());
        }
    }

    /// `GET /v1/status`: what `slipstream status` prints.
    pub fn status(&self) -> Value {
        let ms = 1000.0;
        let pipelines: Vec<Value> = self
            .pipelines
            .values()
            .map(|p| {
                let stages: Vec<Value> = p
                    .stages
                    .iter()
                    .map(|s| {
                        let m = &s.metrics;
                        json!({
                            "name": s.name,
                            "component": s.component,
                            "max_batch_size": s.max_batch,
                            "replicas": s.replicas.iter().map(|r| json!({
                                "index": r.index,
                                "pid": r.pid.load(Relaxed),
                                "healthy": r.healthy.load(Relaxed),
                                "queue": r.queue_len(),
                                "outstanding": r.outstanding.load(Relaxed),
                                "last_batch": r.last_batch.load(Relaxed),
                            })).collect::<Vec<_>>(),
                            "batches": m.batches.load(Relaxed),
                            "requests": m.requests.load(Relaxed),
                            "errors": m.errors.load(Relaxed),
                            "retries": m.retries.load(Relaxed),
                            "dropped_late": m.dropped_late.load(Relaxed),
                            "slack_ms": m.slack_us.summary(ms),
                            "batch_limit": s.replicas.iter().map(|r| r.former.lock().limit).max().unwrap_or(0),
                            "restarts": m.restarts.load(Relaxed),
                            "batch_size": m.batch_size.summary(1.0),
                            "queue_wait_ms": m.queue_wait_us.summary(ms),
                            "compute_ms": m.compute_us.summary(ms),
                            "hop_ms": m.hop_us.summary(ms),
                        })
                    })
                    .collect();
                json!({
                    "name": p.name(),
                    "slo": p.spec.slo.map(|s| json!({"p99_ms": s.p99_ms, "max_miss_rate": s.max_miss_rate})),
                    "ok": p.metrics.ok.load(Relaxed),
                    "admitted": p.metrics.admitted.load(Relaxed),
                    "shed": p.metrics.shed.load(Relaxed),
                    "admission_headroom": p.gate.lock().headroom(),
                    "slo_met": p.metrics.slo_met.load(Relaxed),
                    "slo_missed": p.metrics.slo_missed.load(Relaxed),
                    "fallback": p.metrics.fallback.load(Relaxed),
                    "errors": *p.metrics.errors.lock(),
                    "latency_ms": p.metrics.latency_us.summary(ms),
                    "stages": stages,
                })
            })
            .collect();
        json!({
            "pid": std::process::id(),
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "ready": self.is_ready(),
            "draining": self.draining.load(Relaxed),
            "inflight": self.inflight.load(Relaxed),
            "copies": self.arena.copies.snapshot(),
            "arena": self.arena.usage(),
            "pipelines": pipelines,
        })
    }

    /// `GET /metrics` in Prometheus text format.
    pub fn prometheus(&self) -> String {
        let mut t = PromText::default();
        for p in self.pipelines.values() {
            let pl = [("pipeline", p.name())];
            let m = &p.metrics;
            for (name, help, v) in [
                ("slipstream_requests_ok_total", "Requests answered successfully.", &m.ok),
                ("slipstream_requests_admitted_total", "Requests let in by admission control.", &m.admitted),
                (
                    "slipstream_requests_shed_total",
                    "Requests refused at ingress (429): predicted to miss the SLO.",
                    &m.shed,
                ),
                ("slipstream_slo_met_total", "Requests answered within their deadline (goodput).", &m.slo_met),
                ("slipstream_slo_missed_total", "Requests answered after their deadline.", &m.slo_missed),
                ("slipstream_fallback_total", "Requests answered with the declared fallback.", &m.fallback),
            ] {
                t.counter(name, help, &pl, v.load(Relaxed));
            }
            for (kind, n) in m.errors.lock().iter() {
                t.counter(
                    "slipstream_requests_failed_total",
                    "Requests answered with an error, by kind.",
                    &[pl[0], ("kind", kind)],
                    *n,
                );
            }
            t.summary("slipstream_request_latency_seconds", "Latency inside the node.", &pl, &m.latency_us);
            t.gauge(
                "slipstream_admission_headroom",
                "Share of its deadline budget a new request's predicted finish may use (learned).",
                &pl,
                p.gate.lock().headroom(),
            );
            for s in &p.stages {
                let l = [("pipeline", p.name()), ("stage", s.name.as_str())];
                let m = &s.metrics;
                for (name, help, v) in [
                    ("slipstream_stage_batches_total", "Batches run.", &m.batches),
                    ("slipstream_stage_requests_total", "Requests run.", &m.requests),
                    ("slipstream_stage_errors_total", "Requests failed by the component.", &m.errors),
                    ("slipstream_stage_retries_total", "Requests retried after a worker died.", &m.retries),
                    ("slipstream_stage_restarts_total", "Worker restarts.", &m.restarts),
                    (
                        "slipstream_stage_dropped_late_total",
                        "Requests dropped after their deadline passed.",
                        &m.dropped_late,
                    ),
                ] {
                    t.counter(name, help, &l, v.load(Relaxed));
                }
                let depth: usize = s.replicas.iter().map(|r| r.queue_len()).sum();
                t.gauge("slipstream_stage_queue_depth", "Requests waiting.", &l, depth as f64);
                t.gauge(
                    "slipstream_stage_batch_size_mean",
                    "Mean requests per batch.",
                    &l,
                    m.batch_size.summary(1.0).mean,
                );
                for (name, help, h) in [
                    ("slipstream_stage_queue_wait_seconds", "Time from enqueue to dispatch.", &m.queue_wait_us),
                    ("slipstream_stage_compute_seconds", "Component time per batch.", &m.compute_us),
                    ("slipstream_stage_hop_seconds", "Node-worker-node overhead per batch.", &m.hop_us),
                    (
                        "slipstream_stage_slack_seconds",
                        "Deadline slack of the most urgent request at dispatch.",
                        &m.slack_us,
                    ),
                ] {
                    t.summary(name, help, &l, h);
                }
            }
        }
        let c = self.arena.copies.snapshot();
        for (site, n, b) in [
            ("body_join", c.body_join, c.body_join_bytes),
            ("ingress", c.ingress, c.ingress_bytes),
            ("gather", c.gather, c.gather_bytes),
            ("worker", c.worker, c.worker_bytes),
            ("egress", c.egress, c.egress_bytes),
        ] {
            t.counter("slipstream_payload_copies_total", "Payload copies by site.", &[("site", site)], n);
            t.counter("slipstream_payload_copied_bytes_total", "Payload bytes copied by site.", &[("site", site)], b);
        }
        t.finish()
    }
}

/// The batch former for a replica of `stage`, from the batching options and
/// the stage's measured profile (if any).
fn former_for(spec: &AppSpec, pipeline: &str, stage: &crate::spec::StageSpec) -> Result<BatchFormer, RunError> {
    let b = &spec.batching;
    let policy = match b.policy.as_str() {
        "deadline" => Policy::DeadlineAware,
        "fixed" => Policy::Fixed { wait_ns: (b.fixed_wait_ms * 1e6) as u64 },
        other => {
            return Err(crate::spec::SpecError {
                pipeline: pipeline.into(),
                reason: format!("unknown batching policy '{other}' (use 'deadline' or 'fixed')"),
            }
            .into())
        }
    };
    let points: Vec<(u32, f64, f64)> = spec
        .profiles
        .iter()
        .filter(|p| p.pipeline == pipeline)
        .filter_map(|p| p.stages.get(&stage.name))
        .flat_map(|s| s.points.iter().map(|pt| (pt.batch, pt.mean_ms * 1e3, pt.p99_ms * 1e3)))
        .collect();
    let mut f = BatchFormer::new(policy, stage.max_batch_size as u32, LatencyProfile::from_measurements(&points));
    f.max_wait_ns = (b.max_wait_ms * 1e6) as u64;
    f.drop_late = spec.pipelines.iter().find(|p| p.name == pipeline).and_then(|p| p.slo).is_none_or(|s| s.drop_late);
    Ok(f)
}

fn build_pipelines(
    spec: &AppSpec,
    opts: &NodeOptions,
    arena: &Arena,
) -> Result<BTreeMap<String, Arc<PipelineRt>>, RunError> {
    let mut out = BTreeMap::new();
    let epoch = Instant::now();
    for p in &spec.pipelines {
        let order = p.validate()?;
        if out.contains_key(&p.name) {
            return Err(crate::spec::SpecError {
                pipeline: p.name.clone(),
                reason: "two pipelines share this name".into(),
            }
            .into());
        }
        let index: BTreeMap<&str, usize> = p.stages.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let mut stages = Vec::with_capacity(p.stages.len());
        for (i, s) in p.stages.iter().enumerate() {
            let mut replicas = Vec::with_capacity(s.replicas);
            for r in 0..s.replicas {
                let pool = arena.create_pool(opts.replica_pool_bytes)?;
                replicas.push(Arc::new(Replica::new(r, pool, former_for(spec, &p.name, s)?)));
            }
            stages.push(StageRt {
                index: i,
                name: s.name.clone(),
                component: s.component.clone(),
                max_batch: s.max_batch_size,
                parents: s.parents.iter().map(|n| index[n.as_str()]).collect(),
                children: p
                    .stages
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.parents.contains(&s.name))
                    .map(|(j, _)| j)
                    .collect(),
                replicas,
                metrics: StageMetrics::default(),
            });
        }
        let roots = order.iter().copied().filter(|&i| stages[i].parents.is_empty()).collect();
        let sinks = order.iter().copied().filter(|&i| stages[i].children.is_empty()).collect();
        out.insert(
            p.name.clone(),
            Arc::new(PipelineRt {
                spec: p.clone(),
                stages,
                sinks,
                roots,
                metrics: PipelineMetrics::default(),
                timeout: opts.request_timeout,
                epoch,
                gate: parking_lot::Mutex::new(slipstream_sched::AdmissionGate::new(
                    p.slo.map_or(0.01, |s| s.max_miss_rate),
                )),
            }),
        );
    }
    Ok(out)
}

/// Run a node until SIGINT/SIGTERM. Builds its own tokio runtime.
pub fn run_blocking(
    spec: AppSpec,
    opts: NodeOptions,
    on_listen: impl FnOnce(SocketAddr) + Send,
) -> Result<(), RunError> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(opts.threads.max(1)).enable_all().build()?;
    rt.block_on(run(spec, opts, on_listen, shutdown_signal()))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Run a node until `shutdown` completes.
pub async fn run(
    spec: AppSpec,
    opts: NodeOptions,
    on_listen: impl FnOnce(SocketAddr) + Send,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    if spec.pipelines.is_empty() {
        return Err(
            crate::spec::SpecError { pipeline: "-".into(), reason: "the app defines no pipeline".into() }.into()
        );
    }
    let arena = Arc::new(Arena::new(opts.shm_dir.clone(), opts.ingress_pool_bytes)?);
    let pipelines = build_pipelines(&spec, &opts, &arena)?;
    let socket_dir = std::env::temp_dir().join(format!("slipstream-{}", std::process::id()));
    std::fs::create_dir_all(&socket_dir)?;
    let launch = Arc::new(Launch {
        argv: spec.worker_argv.clone(),
        env: spec.worker_env.clone(),
        socket_dir: socket_dir.clone(),
        start_timeout: opts.worker_start_timeout,
    });
    let node = Arc::new(Node {
        pipelines,
        arena: arena.clone(),
        opts: opts.clone(),
        ready: AtomicBool::new(false),
        draining: AtomicBool::new(false),
        inflight: AtomicUsize::new(0),
        idle: Notify::new(),
        next_id: AtomicU64::new(1),
        started: Instant::now(),
        admission: spec.batching.admission,
    });

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut first_starts = Vec::new();
    for p in node.pipelines.values() {
        for s in &p.stages {
            for r in 0..s.replicas.len() {
                let (tx, rx) = oneshot::channel();
                first_starts.push((format!("{}/{}", p.name(), s.name), rx));
                let ctx = ReplicaCtx {
                    pipe: p.clone(),
                    stage: s.index,
                    replica: r,
                    arena: arena.clone(),
                    launch: launch.clone(),
                    stop: stop_rx.clone(),
                };
                tasks.push(tokio::spawn(replica::run(ctx, tx)));
            }
        }
    }

    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = match TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(source) => {
            let _ = stop_tx.send(true);
            return Err(RunError::Bind { addr, source });
        }
    };
    let local = listener.local_addr()?;
    if opts.log {
        eprintln!("slipstream: listening on http://{local}");
    }
    on_listen(local);

    let graceful = GracefulShutdown::new();
    let accept_node = node.clone();
    let startup = async {
        for (stage, rx) in first_starts {
            match rx.await {
                Ok(Ok(())) => {}
                Ok(Err(message)) => return Err(RunError::WorkerStart { stage, message }),
                Err(_) => return Err(RunError::WorkerStart { stage, message: "replica task ended".into() }),
            }
        }
        node.ready.store(true, Relaxed);
        if opts.log {
            let names: Vec<&str> = node.pipelines.keys().map(|s| s.as_str()).collect();
            eprintln!("slipstream: ready, serving {} on http://{local}", names.join(", "));
        }
        Ok(())
    };
    tokio::pin!(startup);
    tokio::pin!(shutdown);
    let mut started = false;
    let mut outcome = Ok(());
    loop {
        tokio::select! {
            res = &mut startup, if !started => {
                started = true;
                if let Err(e) = res {
                    outcome = Err(e);
                    break;
                }
            }
            conn = listener.accept() => {
                let (stream, _) = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: back off briefly.
                        eprintln!("slipstream: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let n = accept_node.clone();
                let conn = http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), service_fn(move |req| http::handle(n.clone(), req)));
                let watched = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = watched.await;
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);

    // Drain: refuse new work, wait for in-flight requests.
    node.draining.store(true, Relaxed);
    let inflight = node.inflight.load(Relaxed);
    if opts.log && outcome.is_ok() {
        eprintln!("slipstream: shutting down; draining {inflight} in-flight request(s)");
    }
    let drained = async {
        loop {
            let notified = node.idle.notified();
            if node.inflight.load(Relaxed) == 0 {
                break;
            }
            notified.await;
        }
    };
    if tokio::time::timeout(opts.drain_timeout, drained).await.is_err() && opts.log {
        eprintln!("slipstream: drain timed out with {} request(s) in flight", node.inflight.load(Relaxed));
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    arena.unlink_all();
    let _ = std::fs::remove_dir_all(&socket_dir);
    if opts.log && outcome.is_ok() {
        eprintln!("slipstream: stopped");
    }
    outcome
}
