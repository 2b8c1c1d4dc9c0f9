//! The node's life: build pipelines from the spec, start one task per
//! worker replica, serve HTTP, and shut down gracefully.
//!
//! Start-up: pools and replica tasks first, then the listener (so `/healthz`
//! answers while models load), then the node turns ready when every
//! replica's first worker has reported ready. A component that cannot start
//! (import error, constructor raised) fails start-up with its message.
//!
//! Shutdown (SIGINT/SIGTERM, or the `shutdown` future): stop accepting (on
//! the HTTP and the gRPC listener), let in-flight requests finish (bounded
//! by `drain_timeout`), close idle connections of both, tell workers to
//! exit, remove shared-memory files.

use crate::arena::Arena;
use crate::error::NodeError;
use crate::http;
use crate::metrics::PipelineMetrics;
use crate::node::{Node, NodeOptions, Supervisor};
use crate::pipeline::{PipelineRt, StageRt};
use crate::replica::worker::Launch;
use crate::spec::{AppSpec, SpecError, StageSpec};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use slipstream_sched::{BatchFormer, Dag, LatencyProfile, Policy};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("component {stage} failed to start: {message}")]
    WorkerStart { stage: String, message: String },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("object store: {0}")]
    Store(#[from] slipstream_store::StoreError),
    #[error("cluster: {0}")]
    Cluster(String),
    #[error("a new deployment replaced this one; the node stopped to run it")]
    Redeploy,
}

impl RunError {
    pub fn kind(&self) -> &'static str {
        match self {
            RunError::Spec(_) => "invalid_spec",
            RunError::Bind { .. } => "bind",
            RunError::WorkerStart { .. } => "worker_start",
            RunError::Node(e) => e.kind(),
            RunError::Io(_) => "io",
            RunError::Store(e) => e.kind(),
            RunError::Cluster(_) => "cluster",
            RunError::Redeploy => "redeploy",
        }
    }
}

/// The batch former for a replica of `stage`, from the batching options and
/// the stage's measured profile (if any).
fn former_for(spec: &AppSpec, pipeline: &str, stage: &StageSpec) -> Result<BatchFormer, RunError> {
    let b = &spec.batching;
    let policy = match b.policy.as_str() {
        "deadline" => Policy::DeadlineAware,
        "fixed" => Policy::Fixed { wait_ns: (b.fixed_wait_ms * 1e6) as u64 },
        other => {
            return Err(SpecError {
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

/// Before the node reports ready, send each pipeline that declares an
/// example request through itself (up to three times, until one is
/// answered), so that every stage's first replica has made its cold first
/// call (tables paged in, a runtime's first run) on it rather than on a
/// client's first request, which might miss a tight SLO; the stages also
/// keep it as the warm-up sample for replicas added later. Pipelines
/// without an example start cold, as before: a made-up input could crash
/// a worker. The priming requests are then taken off the metrics.
async fn prime(node: &Arc<Node>) {
    let mut primed = false;
    for pipe in node.pipelines.values() {
        let Some(example) = &pipe.spec.example else { continue };
        let body = serde_json::json!({ "inputs": example }).to_string();
        let parts = crate::codec::BodyParts::new(vec![bytes::Bytes::from(body)]);
        let mut outcome = String::from("not run");
        for _ in 0..3 {
            let tensors = match crate::codec::decode_v1(&parts, &pipe.spec.inputs, &node.arena) {
                Ok(t) => t,
                Err(e) => {
                    outcome = format!("the declared example does not decode: {e}");
                    break;
                }
            };
            let ticket = match pipe.ticket(0, Instant::now(), None) {
                Ok(t) => t,
                Err(e) => {
                    outcome = e.to_string();
                    break;
                }
            };
            primed = true;
            match node.answer(pipe, tensors, Ok(ticket)).await {
                Ok(_) => {
                    outcome = "answered".into();
                    break;
                }
                Err(e) => outcome = e.to_string(),
            }
        }
        node.events.record(pipe.name(), "-", None, "primed", format!("with its example request: {outcome}"));
    }
    if primed {
        node.reset_metrics();
    }
}

/// Pipelines with their initial replicas (starting; no tasks yet).
fn build_pipelines(
    spec: &AppSpec,
    opts: &NodeOptions,
    arena: &Arc<Arena>,
) -> Result<BTreeMap<String, Arc<PipelineRt>>, RunError> {
    let mut out = BTreeMap::new();
    let epoch = Instant::now();
    // Every pipeline's latency buckets include every SLO target (see metrics.rs).
    let slo_targets: Vec<f64> = spec.pipelines.iter().filter_map(|p| p.slo.map(|s| s.p99_ms)).collect();
    for p in &spec.pipelines {
        p.validate()?;
        if out.contains_key(&p.name) {
            return Err(SpecError { pipeline: p.name.clone(), reason: "two pipelines share this name".into() }.into());
        }
        let index: BTreeMap<&str, usize> = p.stages.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let dag = Dag::new(p.stages.iter().map(|s| s.parents.iter().map(|n| index[n.as_str()]).collect()).collect());
        let mut stages = Vec::with_capacity(p.stages.len());
        for (i, s) in p.stages.iter().enumerate() {
            let stage = StageRt::new(s, i, former_for(spec, &p.name, s)?);
            // In a cluster, the placement says how many run here.
            let replicas = if opts.cluster.is_some() { 0 } else { s.replicas };
            for _ in 0..replicas {
                stage.add_replica(arena.replica_pool(opts.replica_pool_bytes)?, epoch, false);
            }
            stages.push(stage);
        }
        let (selects, select_of) = PipelineRt::selections(p);
        out.insert(
            p.name.clone(),
            Arc::new(PipelineRt {
                spec: p.clone(),
                stages,
                dag,
                metrics: PipelineMetrics::new(&slo_targets),
                timeout: opts.request_timeout,
                epoch,
                gate: parking_lot::Mutex::new(slipstream_sched::AdmissionGate::new(
                    p.slo.map_or(0.01, |s| s.max_miss_rate),
                )),
                seen_outputs: std::sync::OnceLock::new(),
                selects,
                select_of,
                arena: arena.clone(),
            }),
        );
    }
    Ok(out)
}

/// The node's store, and whether it lives in a temporary directory that
/// goes when this drops.
struct OpenStore {
    store: Arc<slipstream_store::Store>,
    ephemeral: bool,
}

impl Drop for OpenStore {
    fn drop(&mut self) {
        if self.ephemeral {
            let dir = self.store.dir().to_path_buf();
            // Other holders (tasks still unwinding) keep it open; remove the
            // files anyway: the process is ending.
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn open_store(spec: &AppSpec, opts: &NodeOptions) -> Result<OpenStore, RunError> {
    let spec_err = |reason: String| SpecError { pipeline: "-".into(), reason };
    let (dir, ephemeral) = match &opts.store_dir {
        Some(d) => (d.clone(), false),
        None => (std::env::temp_dir().join(format!("slipstream-store-{}", std::process::id())), true),
    };
    if ephemeral {
        let _ = std::fs::remove_dir_all(&dir); // a previous process with this pid
        sweep_dead_ephemeral_stores();
    }
    let mut so = slipstream_store::StoreOptions::new(dir);
    so.max_value = opts.store_max_value;
    let mut seen = std::collections::BTreeSet::new();
    for p in &spec.store.pools {
        if !seen.insert(p.prefix.clone()) {
            return Err(spec_err(format!("store pool {} is declared twice", p.prefix)).into());
        }
        so.pools.push(p.to_pool().map_err(spec_err)?);
    }
    Ok(OpenStore { store: Arc::new(slipstream_store::Store::open(so)?), ephemeral })
}

/// Remove the temporary stores of nodes that died without cleaning up
/// (killed): `slipstream-store-<pid>` whose process is gone (Linux: no
/// `/proc/<pid>`).
fn sweep_dead_ephemeral_stores() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    if !std::path::Path::new("/proc/self").exists() {
        return; // no way to tell a dead pid here
    }
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("slipstream-store-")) else { continue };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Put each seed file whose key has no live version.
fn seed_store(spec: &AppSpec, store: &slipstream_store::Store, log: bool) -> Result<(), RunError> {
    for seed in &spec.store.seed {
        match store.meta(&seed.key, slipstream_store::Select::Latest, false) {
            Ok(_) => continue,
            Err(slipstream_store::StoreError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let data = std::fs::read(&seed.path).map_err(|e| SpecError {
            pipeline: "-".into(),
            reason: format!("store seed {}: cannot read {}: {e}", seed.key, seed.path.display()),
        })?;
        let c = store.put(&seed.key, &data, &seed.content_type, None)?;
        if log {
            eprintln!(
                "slipstream: store: put {} version {} ({} bytes) from {}",
                seed.key,
                c.meta.version,
                data.len(),
                seed.path.display()
            );
        }
    }
    Ok(())
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

/// Resolves when the cluster agent saw a new deployment (never without a cluster).
async fn redeployed(rx: Option<&mut watch::Receiver<bool>>) {
    if let Some(rx) = rx {
        while rx.changed().await.is_ok() {
            if *rx.borrow() {
                return;
            }
        }
    }
    std::future::pending().await
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
        return Err(SpecError { pipeline: "-".into(), reason: "the app defines no pipeline".into() }.into());
    }
    let mut opts = opts;
    if let Some(a) = &spec.autoscale {
        opts.autoscale = a.apply(opts.autoscale).map_err(|reason| SpecError { pipeline: "-".into(), reason })?;
    }
    let arena = Arc::new(Arena::new(opts.shm_dir.clone(), opts.ingress_pool_bytes)?);
    let pipelines = build_pipelines(&spec, &opts, &arena)?;
    let store = open_store(&spec, &opts)?;
    let feed_start = store.store.seq();
    seed_store(&spec, &store.store, opts.log)?;

    // Listen before the workers start: they read their objects from the
    // store through this node while they load.
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = match TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(source) => return Err(RunError::Bind { addr, source }),
    };
    let local = listener.local_addr()?;
    let admin_open = local.ip().is_loopback();
    // The Open Inference Protocol over gRPC, on the same host (see grpc.rs).
    let grpc_listener = match opts.grpc_port {
        Some(port) => match crate::grpc::bind(&opts.host, port).await {
            Ok(l) => Some(l),
            Err(source) => return Err(RunError::Bind { addr: format!("{}:{port} (gRPC)", opts.host), source }),
        },
        None => None,
    };
    let socket_dir = std::env::temp_dir().join(format!("slipstream-{}", std::process::id()));
    std::fs::create_dir_all(&socket_dir)?;
    let mut worker_env = spec.worker_env.clone();
    let loopback = if local.ip().is_unspecified() || local.ip().is_loopback() {
        std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), local.port())
    } else {
        local
    };
    worker_env.insert("SLIPSTREAM_NODE_URL".into(), format!("http://{loopback}"));
    if let Some(c) = &opts.cluster {
        worker_env.insert("SLIPSTREAM_NODE_NAME".into(), c.name.clone());
    }
    if let Some(t) = &opts.admin_token {
        worker_env.insert("SLIPSTREAM_STORE_TOKEN".into(), t.clone());
    }
    let launch = Arc::new(Launch {
        argv: spec.worker_argv.clone(),
        env: worker_env,
        socket_dir: socket_dir.clone(),
        start_timeout: opts.worker_start_timeout,
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let supervisor = Supervisor { launch, stop: stop_rx, tasks: Default::default() };
    let node = Arc::new(Node::new(
        pipelines,
        arena.clone(),
        opts.clone(),
        spec.batching.admission,
        supervisor,
        store.store.clone(),
    ));

    node.set_listen_port(local.port());
    // The dashboard's history, from the start: replicas starting and
    // models loading show on it too.
    tokio::spawn(crate::history::run(node.clone(), node.supervisor.stop.clone()));
    tokio::spawn(crate::cache::follow_models(node.clone(), node.supervisor.stop.clone()));
    let mut joined = match opts.cluster.clone() {
        Some(c) => Some(crate::cluster::start(&node, c).await.map_err(RunError::Cluster)?),
        None => None,
    };
    let mut redeploy = joined.as_ref().map(|j| j.redeploy.clone());
    let mut first_starts = Vec::new();
    for p in node.pipelines.values() {
        for s in &p.stages {
            for r in s.replicas().iter() {
                let (tx, rx) = oneshot::channel();
                first_starts.push((p.stage_key(s.index), rx));
                node.spawn_replica(p, s.index, r.clone(), Some(tx));
            }
        }
    }
    if opts.log {
        eprintln!("slipstream: listening on http://{local}");
        if let Some(g) = grpc_listener.as_ref().and_then(|l| l.local_addr().ok()) {
            eprintln!("slipstream: gRPC listening on {g}");
        }
        eprintln!(
            "slipstream: object store in {}{}",
            store.store.dir().display(),
            if store.ephemeral { " (temporary: removed at exit; keep one with --store DIR)" } else { "" }
        );
    }
    on_listen(local);

    let graceful = GracefulShutdown::new();
    let startup = async {
        for (stage, rx) in first_starts {
            match rx.await {
                Ok(Ok(())) => {}
                Ok(Err(message)) => return Err(RunError::WorkerStart { stage, message }),
                Err(_) => return Err(RunError::WorkerStart { stage, message: "replica task ended".into() }),
            }
        }
        if node.cluster().is_none() {
            prime(&node).await;
        }
        node.mark_serving();
        if node.cluster().is_none() {
            // In a cluster the placement sets replica counts.
            tokio::spawn(crate::autoscale::run(node.clone(), node.supervisor.stop.clone()));
        }
        if !node.triggers.is_empty() {
            tokio::spawn(crate::triggers::follow(node.clone(), node.supervisor.stop.clone(), feed_start));
        }
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
                let n = node.clone();
                let conn = http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(
                        TokioIo::new(stream),
                        service_fn(move |req| http::handle(n.clone(), admin_open, req)),
                    );
                let watched = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = watched.await;
                });
            }
            conn = crate::grpc::accept(grpc_listener.as_ref()) => match conn {
                Ok((stream, _)) => crate::grpc::spawn_connection(&node, stream, &graceful),
                Err(e) => {
                    eprintln!("slipstream: gRPC accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = &mut shutdown => break,
            _ = redeployed(redeploy.as_mut()) => {
                outcome = Err(RunError::Redeploy);
                break;
            }
        }
    }
    drop(listener);
    drop(grpc_listener);
    if let Some(j) = &mut joined {
        j.leave().await;
    }

    // Drain: refuse new work, wait for in-flight requests.
    let inflight = node.start_draining();
    if opts.log && outcome.is_ok() {
        eprintln!("slipstream: shutting down; draining {inflight} in-flight request(s)");
    }
    if tokio::time::timeout(opts.drain_timeout, node.idle()).await.is_err() && opts.log {
        eprintln!("slipstream: drain timed out with {} request(s) in flight", node.inflight());
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    let _ = stop_tx.send(true);
    let tasks = std::mem::take(&mut *node.supervisor.tasks.lock());
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    drop(joined); // the data plane served other nodes' work until now
    arena.unlink_all();
    let _ = std::fs::remove_dir_all(&socket_dir);
    if opts.log && outcome.is_ok() {
        eprintln!("slipstream: stopped");
    }
    outcome
}
