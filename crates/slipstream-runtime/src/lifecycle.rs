//! The node's life: build it (through the composition root), start one
//! task per replica, serve HTTP and gRPC, and shut down gracefully.
//!
//! Start-up: pools and replica tasks first, then the listener (so `/healthz`
//! answers while models load), then the node turns ready when every
//! replica's first worker has reported ready. A component that cannot start
//! (import error, constructor raised) fails start-up with its message.
//!
//! Shutdown (SIGINT/SIGTERM, or the `shutdown` future): stop accepting (on
//! the HTTP and the gRPC listener), in a cluster hand this node's stages
//! over to the others and leave, let in-flight requests finish (bounded
//! by `drain_timeout`), close idle connections of both, tell workers to
//! exit, remove shared-memory files.

use crate::app::RunOptions;
use crate::compose::{self, ComposeError};
use hyper_util::server::graceful::GracefulShutdown;
use slipstream_core::arena::Arena;
use slipstream_core::codec::{self, BodyParts};
use slipstream_core::events::EventKind;
use slipstream_core::spec::SpecError;
use slipstream_core::worker::{WorkerCommand, WorkerLauncher};
use slipstream_core::{AppSpec, Arrival, Node, NodeError, NodeOptions, NodeParts};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The longest a stopping cluster member waits for what it serves to be
/// ready on the others before it leaves (slipstream-cluster's
/// `handover.rs`): a warm standby's promotion takes well under a second; a
/// stage started cold elsewhere may not make it, and the node then leaves
/// as it would have without handing over.
const HANDOVER_LIMIT: Duration = Duration::from_secs(10);

/// Why a node could not run (or stopped).
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)]
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

impl From<ComposeError> for RunError {
    fn from(e: ComposeError) -> RunError {
        match e {
            ComposeError::Spec(e) => RunError::Spec(e),
            ComposeError::Build(slipstream_core::pipeline::BuildError::Spec(e)) => RunError::Spec(e),
            ComposeError::Build(slipstream_core::pipeline::BuildError::Node(e)) => RunError::Node(e),
        }
    }
}

impl RunError {
    /// The stable name of the error's kind.
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
    for pipe in node.pipelines().values() {
        let Some(example) = &pipe.spec.example else { continue };
        let body = serde_json::json!({ "inputs": example }).to_string();
        let parts = BodyParts::new(vec![bytes::Bytes::from(body)]);
        let mut outcome = String::from("not run");
        for _ in 0..3 {
            let accepted = node.accept(pipe, Arrival::now(None), |arena| {
                Ok((codec::decode_v1(&parts, &pipe.spec.inputs, arena)?, ()))
            });
            let accepted = match accepted {
                Ok((a, ())) => a,
                Err(e @ (NodeError::BadRequest(_) | NodeError::BadInput(_))) => {
                    outcome = format!("the declared example does not decode: {e}");
                    break;
                }
                Err(e) => {
                    outcome = e.to_string();
                    break;
                }
            };
            primed = true;
            match node.answer(accepted, None).await {
                Ok(_) => {
                    outcome = "answered".into();
                    break;
                }
                Err(e) => outcome = e.to_string(),
            }
        }
        node.events().record(pipe.name(), "-", None, EventKind::Primed, format!("with its example request: {outcome}"));
    }
    if primed {
        node.reset_metrics();
    }
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

/// Put each seed file whose key has no live version: into the cluster's
/// shared store when the node is in one (the first node to seed a key
/// wins; the others find it there), else into the node's own.
async fn seed_store(spec: &AppSpec, node: &Node) -> Result<(), RunError> {
    let store = node.store();
    for seed in &spec.store.seed {
        if let Some(shared) = node.shared_store() {
            shared.sync(&seed.key).await?;
        }
        match store.meta(&seed.key, slipstream_store::Select::Latest, false) {
            Ok(_) => continue,
            Err(slipstream_store::StoreError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let data = match (std::fs::read(&seed.path), node.shared_store()) {
            (Ok(data), _) => data,
            // In a cluster a node without the file (a deployment carries
            // small seeds only) waits for a node that has it to seed it.
            (Err(e), Some(shared)) if e.kind() == std::io::ErrorKind::NotFound => {
                wait_for_seed(node, shared, &seed.key, &seed.path).await?;
                continue;
            }
            (Err(e), _) => {
                return Err(SpecError {
                    pipeline: "-".into(),
                    reason: format!("store seed {}: cannot read {}: {e}", seed.key, seed.path.display()),
                }
                .into())
            }
        };
        let c = match node.shared_store() {
            Some(shared) => {
                let w = slipstream_core::ext::SharedWrite {
                    key: seed.key.clone(),
                    value: Some(vec![data.clone().into()]),
                    content_type: seed.content_type.clone(),
                    if_version: Some(0),
                };
                match shared.write(w).await {
                    Err(slipstream_store::StoreError::Conflict { .. }) => continue, // another node seeded it
                    r => r?,
                }
            }
            None => store.put(&seed.key, &data, &seed.content_type, None)?,
        };
        tracing::info!(
            "store: put {} version {} ({} bytes) from {}",
            seed.key,
            c.meta.version,
            data.len(),
            seed.path.display()
        );
    }
    Ok(())
}

/// How long a cluster node waits for another to seed a key whose file it lacks.
const SEED_PATIENCE: Duration = Duration::from_secs(600);

/// Wait until the cluster's store has a live version of `key` (seeded by a
/// node that has its file).
async fn wait_for_seed(
    node: &Node,
    shared: &Arc<dyn slipstream_core::ext::SharedStore>,
    key: &str,
    path: &std::path::Path,
) -> Result<(), RunError> {
    tracing::info!(
        "store seed {key}: {} is not on this machine; waiting for a node that has it to seed it",
        path.display()
    );
    let until = tokio::time::Instant::now() + SEED_PATIENCE;
    loop {
        shared.sync(key).await?;
        match node.store().meta(key, slipstream_store::Select::Latest, false) {
            Ok(_) => return Ok(()),
            Err(slipstream_store::StoreError::NotFound(_)) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(slipstream_store::StoreError::NotFound(_)) => {
                return Err(SpecError {
                    pipeline: "-".into(),
                    reason: format!(
                        "store seed {key}: {} is not on this machine and no node seeded it within {SEED_PATIENCE:?}",
                        path.display()
                    ),
                }
                .into())
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Where the node listens, for its status (`listen`: the HTTP address and
/// every address gRPC is served on, its own port first).
struct Listeners {
    http: SocketAddr,
    grpc: Vec<SocketAddr>,
}

impl slipstream_core::ext::Service for Listeners {
    fn status(&self, doc: &mut slipstream_core::ext::StatusDoc) {
        let grpc: Vec<String> = self.grpc.iter().map(|a| a.to_string()).collect();
        doc.set(&["listen"], serde_json::json!({"http": self.http.to_string(), "grpc": grpc}));
    }

    fn metrics(&self, _: &mut slipstream_core::prom::PromText) {}
}

/// Run a node until SIGINT/SIGTERM. Builds its own tokio runtime.
pub fn run_blocking(
    spec: AppSpec,
    opts: RunOptions,
    on_listen: impl FnOnce(SocketAddr) + Send,
) -> Result<(), RunError> {
    crate::logging::init(opts.log);
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(opts.edge.threads.max(1)).enable_all().build()?;
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
    opts: RunOptions,
    on_listen: impl FnOnce(SocketAddr) + Send,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    if spec.pipelines.is_empty() {
        return Err(SpecError { pipeline: "-".into(), reason: "the app defines no pipeline".into() }.into());
    }
    let RunOptions { node: node_opts, edge, cluster, .. } = opts;
    let arena = Arc::new(Arena::new(node_opts.shm_dir.clone(), node_opts.ingress_pool_bytes)?);
    let built = compose::pipelines(&spec, &node_opts, &arena, cluster.is_none())?;
    let store = open_store(&spec, &node_opts)?;

    // Listen before the workers start: they read their objects from the
    // store through this node while they load.
    let addr = format!("{}:{}", edge.host, edge.port);
    let listener = match TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(source) => return Err(RunError::Bind { addr, source }),
    };
    let local = listener.local_addr()?;
    let admin_open = local.ip().is_loopback();
    // gRPC's own listener, where there is one (gRPC is served on the HTTP
    // port too: see conn.rs).
    let grpc_listener = match edge.grpc_port {
        Some(port) => match crate::grpc::bind(&edge.host, port).await {
            Ok(l) => Some(l),
            Err(source) => return Err(RunError::Bind { addr: format!("{}:{port} (gRPC)", edge.host), source }),
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
    if let Some(c) = &cluster {
        worker_env.insert("SLIPSTREAM_NODE_NAME".into(), c.name.clone());
    }
    if let Some(t) = edge.access.worker_token() {
        worker_env.insert("SLIPSTREAM_STORE_TOKEN".into(), t.to_string());
    }
    let command = WorkerCommand {
        argv: spec.worker_argv.clone(),
        env: worker_env,
        socket_dir: socket_dir.clone(),
        start_timeout: node_opts.worker_start_timeout,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let node = Arc::new(Node::new(NodeParts {
        pipelines: built.pipelines.clone(),
        arena: arena.clone(),
        store: store.store.clone(),
        opts: node_opts,
        admission: spec.batching.admission,
        local: Arc::new(WorkerLauncher::new(command)),
        stop: stop_rx.clone(),
    })?);
    node.set_listen_port(local.port());
    let grpc_addrs: Vec<SocketAddr> = match grpc_listener.as_ref().and_then(|l| l.local_addr().ok()) {
        Some(g) => vec![g, local],
        None if edge.grpc => vec![local],
        None => vec![],
    };
    node.register(Arc::new(Listeners { http: local, grpc: grpc_addrs.clone() }));
    let drain_timeout = edge.drain_timeout;
    let http_addr = format!("{}:{}", edge.host, local.port());
    let installed = compose::install(&node, built, edge, &stop_rx);
    let app = installed.app.clone();
    let in_cluster = cluster.is_some();
    let mut joined = match cluster {
        Some(c) => {
            let scale = installed.autoscaler.options().clone();
            let joined = slipstream_cluster::start(&node, c, http_addr, scale).await.map_err(RunError::Cluster)?;
            compose::join_cluster(&installed, &joined.cluster);
            Some(joined)
        }
        None => None,
    };
    // Triggers fire for changes from here on: in a cluster, after the
    // versions committed before this node joined were loaded.
    let feed_start = store.store.seq();
    seed_store(&spec, &node).await?;
    let mut redeploy = joined.as_ref().map(|j| j.redeploy.clone());
    let first_starts = node.start_replicas();
    let scheme = if app.edge.tls.is_some() { "https" } else { "http" };
    tracing::info!("listening on {scheme}://{local}{}", if app.edge.grpc { " (HTTP and gRPC)" } else { "" });
    if let Some(g) = grpc_addrs.first() {
        tracing::info!("gRPC listening on {g}");
    }
    tracing::info!(
        "object store in {}{}",
        store.store.dir().display(),
        if store.ephemeral { " (temporary: removed at exit; keep one with --store DIR)" } else { "" }
    );
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
        if !in_cluster {
            prime(&node).await;
        }
        node.mark_serving();
        compose::start_serving(&installed, in_cluster, feed_start, &stop_rx);
        let names: Vec<&str> = node.pipelines().keys().map(|s| s.as_str()).collect();
        tracing::info!("ready, serving {} on {scheme}://{local}", names.join(", "));
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
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                crate::conn::spawn_http_port(&app, admin_open, stream, &graceful);
            }
            conn = crate::grpc::accept(grpc_listener.as_ref()) => match conn {
                Ok((stream, _)) => crate::conn::spawn_grpc_port(&app, stream, &graceful),
                Err(e) => {
                    tracing::warn!("gRPC accept failed: {e}");
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
        // Not for a redeploy: every node restarts onto the new deployment.
        if outcome.is_ok() {
            let done = j.hand_over(HANDOVER_LIMIT.min(drain_timeout)).await;
            tracing::info!("cluster: {done}");
        }
        j.leave().await;
    }

    // Drain: refuse new work, wait for in-flight requests.
    let inflight = node.start_draining();
    if outcome.is_ok() {
        tracing::info!("shutting down; draining {inflight} in-flight request(s)");
    }
    if tokio::time::timeout(drain_timeout, node.idle()).await.is_err() {
        tracing::warn!("drain timed out with {} request(s) in flight", node.inflight());
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    let _ = stop_tx.send(true);
    // One deadline for all the replica tasks, not ten seconds each: a
    // remote replica's task can wait on the data plane, which closes only
    // below, and three of them held a cluster node's exit past the 30 s
    // its supervisor waits. What has not ended by then is aborted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for t in node.take_tasks() {
        let abort = t.abort_handle();
        if tokio::time::timeout_at(deadline, t).await.is_err() {
            abort.abort();
        }
    }
    drop(joined); // the data plane served other nodes' work until now
    arena.unlink_all();
    let _ = std::fs::remove_dir_all(&socket_dir);
    if outcome.is_ok() {
        tracing::info!("stopped");
    }
    outcome
}
