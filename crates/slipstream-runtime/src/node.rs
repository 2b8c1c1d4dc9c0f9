//! The node's state and its request path: admit a request, run it through
//! its pipeline, answer (or answer with the declared fallback); and the
//! run-time changes an operator asks for (scale a stage).
//!
//! Start-up and shutdown live in [`crate::lifecycle`], routes in
//! [`crate::http`], status and Prometheus rendering in [`crate::report`];
//! none of them is needed to understand what happens to a request.

use crate::arena::{Arena, Tensors};
use crate::autoscale::Autoscaler;
use crate::codec;
use crate::error::NodeError;
use crate::events::Events;
use crate::pipeline::{PipelineRt, StageRt, Ticket};
use crate::replica::task::{self, ReplicaCtx};
use crate::replica::worker::Launch;
use crate::replica::{Phase, Replica};
use crate::request::{request_rows, Admitted};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinHandle;

/// Replicas one stage may be scaled to.
pub const MAX_REPLICAS: usize = 64;

/// How long a replica the cluster placed elsewhere keeps serving before it
/// drains (other nodes apply the new placement within this).
const PLACEMENT_GRACE: Duration = Duration::from_secs(2);

/// Node settings. Defaults suit one machine; the CLI overrides them.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub host: String,
    pub port: u16,
    /// The Open Inference Protocol over gRPC on this port (0: any free
    /// port); None: no gRPC listener.
    pub grpc_port: Option<u16>,
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
    /// Bearer token the admin routes require. Without one they are open on
    /// a loopback listener and refused on any other.
    pub admin_token: Option<String>,
    /// Print start-up, shutdown and replica events on stderr.
    pub log: bool,
    /// How autoscaled stages (declared with replica bounds) follow the load.
    pub autoscale: crate::autoscale::Options,
    /// The object store's directory; None: a temporary one, removed at exit.
    pub store_dir: Option<PathBuf>,
    /// The largest value a store put may carry.
    pub store_max_value: u64,
    /// Join a cluster on etcd (`docs/design/cluster.md`); None: one machine.
    pub cluster: Option<crate::cluster::ClusterOptions>,
}

impl Default for NodeOptions {
    /// The defaults of [`crate::config::NodeConfig`], where each is declared.
    fn default() -> Self {
        crate::config::NodeConfig::default().node_options().expect("the default configuration is valid")
    }
}

/// Which replicas of a stage go first when it shrinks: those not serving,
/// then the least loaded, then the newest.
fn removal_order(live: &mut [Arc<Replica>]) {
    live.sort_by_key(|r| (r.phase() == Phase::Ready, r.load().outstanding, std::cmp::Reverse(r.id)));
}

/// Starts and tracks replica tasks (at start-up and when a stage is scaled).
pub struct Supervisor {
    pub launch: Arc<Launch>,
    pub stop: watch::Receiver<bool>,
    pub tasks: Mutex<Vec<JoinHandle<()>>>,
}

pub struct Node {
    pub pipelines: BTreeMap<String, Arc<PipelineRt>>,
    pub arena: Arc<Arena>,
    pub opts: NodeOptions,
    pub events: Arc<Events>,
    /// The last ten minutes, second by second (the dashboard's data).
    pub history: crate::history::History,
    pub started: Instant,
    /// Refuse requests predicted to miss their deadline (429).
    pub admission: bool,
    pub supervisor: Supervisor,
    pub autoscaler: Autoscaler,
    /// Models, indices and documents (see `docs/design/store.md`).
    pub store: Arc<slipstream_store::Store>,
    pub triggers: crate::triggers::Triggers,
    /// The cluster side, when the node is part of one (set once at start-up).
    cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
    /// The HTTP port it listens on (known once bound).
    port: std::sync::atomic::AtomicU16,
    /// Start-up finished: every first worker reported ready.
    serving: AtomicBool,
    draining: AtomicBool,
    /// Wakes long waits (store watches) when draining starts, so that they
    /// answer at once instead of holding the graceful shutdown.
    drain_signal: tokio::sync::watch::Sender<bool>,
    inflight: AtomicUsize,
    idle: Notify,
    next_id: AtomicU64,
    /// One scale operation at a time.
    scaling: Mutex<()>,
}

/// Counts a request as in flight for as long as it lives (graceful drain).
struct InFlight<'a>(&'a Node);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Relaxed) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// When the request arrived and the deadline budget it asked for.
pub struct Arrival {
    pub at: Instant,
    pub budget: Option<Duration>,
}

/// A pipeline's answer: its outputs, or the declared fallback (and why).
pub struct Answer {
    pub outputs: Tensors,
    pub fallback: Option<&'static str>,
    /// The request's id (for feedback on it), unless it was refused.
    pub id: Option<u64>,
}

impl Node {
    pub fn new(
        pipelines: BTreeMap<String, Arc<PipelineRt>>,
        arena: Arc<Arena>,
        opts: NodeOptions,
        admission: bool,
        supervisor: Supervisor,
        store: Arc<slipstream_store::Store>,
    ) -> Node {
        Node {
            triggers: crate::triggers::Triggers::new(pipelines.values()),
            store,
            pipelines,
            arena,
            events: Arc::new(Events::new(opts.log)),
            history: Default::default(),
            autoscaler: Autoscaler::new(opts.autoscale.clone()),
            opts,
            started: Instant::now(),
            admission,
            supervisor,
            cluster: std::sync::OnceLock::new(),
            port: std::sync::atomic::AtomicU16::new(0),
            serving: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            drain_signal: tokio::sync::watch::channel(false).0,
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            next_id: AtomicU64::new(1),
            scaling: Mutex::new(()),
        }
    }

    /// The cluster this node belongs to, if any.
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::Cluster>> {
        self.cluster.get()
    }

    pub fn join_cluster(&self, c: Arc<crate::cluster::Cluster>) {
        let _ = self.cluster.set(c);
    }

    pub fn set_listen_port(&self, port: u16) {
        self.port.store(port, Relaxed);
    }

    pub fn listen_port(&self) -> u16 {
        self.port.load(Relaxed)
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    pub fn pipeline(&self, name: &str) -> Result<Arc<PipelineRt>, NodeError> {
        self.pipelines.get(name).cloned().ok_or_else(|| NodeError::UnknownPipeline(name.to_string()))
    }

    /// Ready for traffic: started, not draining, and every stage of every
    /// pipeline has a replica whose worker serves.
    pub fn is_ready(&self) -> bool {
        self.serves() && self.pipelines.values().all(|p| p.is_ready())
    }

    /// Ready for one pipeline's traffic.
    pub fn pipeline_ready(&self, p: &PipelineRt) -> bool {
        self.serves() && p.is_ready()
    }

    fn serves(&self) -> bool {
        self.serving.load(Relaxed) && !self.draining.load(Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Relaxed)
    }

    /// Requests inside the node now.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Relaxed)
    }

    pub fn mark_serving(&self) {
        self.serving.store(true, Relaxed);
    }

    /// Refuse new work from now on; returns the requests still in flight.
    pub fn start_draining(&self) -> usize {
        self.draining.store(true, Relaxed);
        self.drain_signal.send_replace(true);
        self.inflight()
    }

    /// Changes when draining starts.
    pub fn on_drain(&self) -> tokio::sync::watch::Receiver<bool> {
        self.drain_signal.subscribe()
    }

    /// Wait until no request is in flight.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.inflight() == 0 {
                return;
            }
            notified.await;
        }
    }

    pub fn reset_metrics(&self) {
        for p in self.pipelines.values() {
            p.metrics.reset();
            p.stages.iter().for_each(|s| s.metrics.reset());
        }
    }

    /// Start the task that drives `replica` of `pipe`'s stage `stage`.
    pub fn spawn_replica(
        &self,
        pipe: &Arc<PipelineRt>,
        stage: usize,
        replica: Arc<Replica>,
        first_start: Option<oneshot::Sender<Result<(), String>>>,
    ) {
        let ctx = ReplicaCtx {
            pipe: pipe.clone(),
            stage,
            me: replica,
            arena: self.arena.clone(),
            launch: self.supervisor.launch.clone(),
            events: self.events.clone(),
            stop: self.supervisor.stop.clone(),
        };
        let run = match (ctx.me.is_local(), self.cluster()) {
            (false, Some(c)) => tokio::spawn(crate::cluster::dataplane::run_remote(ctx, c.clone())),
            _ => tokio::spawn(task::run(ctx, first_start)),
        };
        let mut tasks = self.supervisor.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(run);
    }

    /// Admission control, decided before the body is decoded, so that
    /// refusing a request costs as little CPU as possible when the node is
    /// overloaded. Ok(Err(..)): refused, but the pipeline declares a
    /// fallback answer, which needs the decoded request (its row count);
    /// Err: refused outright.
    pub fn admit(&self, pipe: &PipelineRt, arrival: Arrival) -> Result<Result<Ticket, NodeError>, NodeError> {
        if self.is_draining() {
            return Err(NodeError::ShuttingDown);
        }
        let ticket = pipe.ticket(self.next_request_id(), arrival.at, arrival.budget)?;
        if !self.admission {
            return Ok(Ok(ticket));
        }
        match pipe.admit(&ticket) {
            Ok(()) => Ok(Ok(ticket)),
            Err(over) => {
                let m = &pipe.metrics;
                m.shed.fetch_add(1, Relaxed);
                let e = NodeError::Overloaded {
                    budget_ms: ticket.deadline.saturating_duration_since(arrival.at).as_millis() as u64,
                    over_ms: over.as_millis() as u64,
                };
                m.error(e.kind());
                if pipe.spec.fallback.is_some() {
                    Ok(Err(e))
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Run one request admitted by [`Node::admit`]; answer with the
    /// pipeline's declared fallback (Clipper's default output) instead of an
    /// error when it was refused or ran out of time.
    pub async fn answer(
        &self,
        pipe: &Arc<PipelineRt>,
        tensors: Tensors,
        ticket: Result<Ticket, NodeError>,
    ) -> Result<Answer, NodeError> {
        self.answer_streaming(pipe, tensors, ticket, None).await
    }

    /// [`Node::answer`], and a streaming component's chunks from the
    /// pipeline's sinks go to `chunks` as they come (before the answer).
    pub async fn answer_streaming(
        &self,
        pipe: &Arc<PipelineRt>,
        tensors: Tensors,
        ticket: Result<Ticket, NodeError>,
        chunks: Option<crate::request::Chunks>,
    ) -> Result<Answer, NodeError> {
        let rows = request_rows(&tensors);
        let id = ticket.as_ref().ok().map(|t| t.id);
        let result = match ticket {
            Ok(t) => self.infer(pipe, tensors, t, chunks).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(outputs) => Ok(Answer { outputs, fallback: None, id }),
            Err(
                e @ (NodeError::Overloaded { .. } | NodeError::DeadlineExceeded { .. } | NodeError::Timeout { .. }),
            ) if pipe.spec.fallback.is_some() => {
                let outputs = codec::fallback_outputs(
                    pipe.spec.fallback.as_ref().expect("checked"),
                    rows,
                    &pipe.spec.outputs,
                    &self.arena,
                )?;
                pipe.metrics.fallback.fetch_add(1, Relaxed);
                Ok(Answer { outputs, fallback: Some(e.kind()), id })
            }
            Err(e) => Err(e),
        }
    }

    /// Run one admitted request through its pipeline's DAG. If this future
    /// is dropped first (the client went away), the guards settle the
    /// request as cancelled and take it off the drain count.
    async fn infer(
        &self,
        pipe: &Arc<PipelineRt>,
        tensors: Tensors,
        mut ticket: Ticket,
        chunks: Option<crate::request::Chunks>,
    ) -> Result<Tensors, NodeError> {
        pipe.route_by_affinity(&mut ticket, &tensors, &self.store.options().pools);
        self.inflight.fetch_add(1, Relaxed);
        let _inflight = InFlight(self);
        let result = Admitted::enter(pipe, tensors, ticket, chunks).outcome().await;
        if let Ok(outputs) = &result {
            pipe.learn_outputs(outputs);
        }
        result
    }

    /// Set the number of replicas of `pipeline`'s stage `stage` to `n`: new
    /// replicas start (and warm up) before they take traffic; surplus ones
    /// stop taking work, finish their queue and exit (crashed or starting
    /// ones go first, then the least loaded).
    pub fn scale(&self, pipeline: &str, stage: &str, n: usize) -> Result<Value, NodeError> {
        if !(1..=MAX_REPLICAS).contains(&n) {
            return Err(NodeError::BadInput(format!("replicas must be between 1 and {MAX_REPLICAS}, got {n}")));
        }
        if self.is_draining() {
            return Err(NodeError::ShuttingDown);
        }
        let _one_at_a_time = self.scaling.lock();
        let pipe = self.pipeline(pipeline)?;
        let st = pipe.stage(stage)?;
        let mut live: Vec<Arc<Replica>> =
            st.replicas().iter().filter(|r| r.is_local() && r.phase().will_serve()).cloned().collect();
        let from = live.len();
        let (mut added, mut draining) = (Vec::new(), Vec::new());
        if n > from {
            added = self.add_replicas(&pipe, st, n - from, false);
        } else if n < from {
            removal_order(&mut live);
            for r in live.iter().take(from - n) {
                if r.drain() {
                    draining.push(r.id);
                    self.events.record(pipe.name(), stage, Some(r.id), "draining", "scaled down".into());
                }
            }
        }
        if n != from {
            self.events.record(pipe.name(), stage, None, "scaled", format!("{from} -> {n} replicas"));
        }
        Ok(json!({
            "pipeline": pipeline,
            "stage": stage,
            "from": from,
            "replicas": n,
            "added": added,
            "draining": draining,
        }))
    }

    /// The cluster's placement gives this node `n` replicas of `st` (0
    /// allowed): start the missing ones; drain the surplus after a grace
    /// period, during which nodes still routing here by the old placement
    /// are served (they apply the new one within moments).
    pub fn set_local_replicas(self: &Arc<Self>, pipe: &Arc<PipelineRt>, st: &StageRt, n: usize) {
        let _one_at_a_time = self.scaling.lock();
        let mut live: Vec<Arc<Replica>> =
            st.replicas().iter().filter(|r| r.is_local() && r.phase().will_serve() && !r.leaving()).cloned().collect();
        let from = live.len();
        if n > from {
            self.add_replicas(pipe, st, n - from, false);
        } else if n < from {
            removal_order(&mut live);
            for r in live.into_iter().take(from - n) {
                r.mark_leaving();
                self.events.record(pipe.name(), &st.name, Some(r.id), "leaving", "placed elsewhere".into());
                let events = self.events.clone();
                let (pipe, stage) = (pipe.name().to_string(), st.name.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(PLACEMENT_GRACE).await;
                    if r.drain() {
                        events.record(&pipe, &stage, Some(r.id), "draining", "placed elsewhere".into());
                    }
                });
            }
        }
        if n != from {
            self.events.record(pipe.name(), &st.name, None, "placed", format!("{from} -> {n} replicas here"));
        }
    }

    /// The cluster's placement gives node `name` `count` replicas of `st`
    /// (for every member but this one): keep one remote replica here per
    /// replica placed there; drain those of nodes that left or lost them.
    pub fn set_remote_replicas(
        &self,
        pipe: &Arc<PipelineRt>,
        st: &StageRt,
        nodes: &BTreeMap<String, (std::net::SocketAddr, usize)>,
    ) {
        let _one_at_a_time = self.scaling.lock();
        let set = st.replicas();
        let mut have: BTreeMap<&str, usize> = BTreeMap::new();
        for r in set.iter().filter(|r| r.phase().will_serve()) {
            let Some(at) = &r.remote else { continue };
            let keep = nodes
                .get(&at.node)
                .is_some_and(|(addr, n)| *addr == at.addr && have.get(at.node.as_str()).copied().unwrap_or(0) < *n);
            if keep {
                *have.entry(at.node.as_str()).or_default() += 1;
            } else if r.drain() {
                self.events.record(
                    pipe.name(),
                    &st.name,
                    Some(r.id),
                    "draining",
                    format!("node {} left or lost it", at.node),
                );
            }
        }
        for (name, (addr, n)) in nodes {
            for _ in have.get(name.as_str()).copied().unwrap_or(0)..*n {
                let at = crate::replica::RemoteAt { node: name.clone(), addr: *addr };
                let r = st.add_remote(at, self.arena.ingress(), pipe.epoch);
                self.events.record(pipe.name(), &st.name, Some(r.id), "added", format!("on node {name}"));
                self.spawn_replica(pipe, st.index, r, None);
            }
        }
    }

    /// Start `n` replicas of `st` (warm-up before traffic; as standbys,
    /// held back until promoted). Returns their ids (fewer if the arena has
    /// no room for another replica pool).
    pub fn add_replicas(&self, pipe: &Arc<PipelineRt>, st: &StageRt, n: usize, standby: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let pool = match self.arena.replica_pool(self.opts.replica_pool_bytes) {
                Ok(p) => p,
                Err(e) => {
                    self.events.record(pipe.name(), &st.name, None, "add_failed", e.to_string());
                    break;
                }
            };
            let r = st.add_replica(pool, pipe.epoch, standby);
            ids.push(r.id);
            let what = if standby { "added_standby" } else { "added" };
            self.events.record(pipe.name(), &st.name, Some(r.id), what, String::new());
            self.spawn_replica(pipe, st.index, r, None);
        }
        ids
    }

    /// Promote up to `k` standbys of `st` into routing, warm ones first.
    /// Returns (promoted, of which warm: serving at once).
    pub fn promote_standbys(&self, pipe: &PipelineRt, st: &StageRt, k: usize) -> (usize, usize) {
        let (mut done, mut warm) = (0, 0);
        for r in st.standbys_warm_first().into_iter().take(k) {
            let was_warm = r.phase() == Phase::Standby;
            if r.promote() {
                done += 1;
                warm += usize::from(was_warm);
                let how = if was_warm { "warm" } else { "still starting" };
                self.events.record(pipe.name(), &st.name, Some(r.id), "promoted", how.into());
            }
        }
        (done, warm)
    }

    /// Take one serving replica of `st` out of routing (the least loaded):
    /// back to standby (warm, for the next surge) or drained away.
    pub fn retire_one(&self, pipe: &PipelineRt, st: &StageRt, to_standby: bool) -> bool {
        let _one_at_a_time = self.scaling.lock();
        let set = st.replicas();
        let Some(r) = set
            .iter()
            .filter(|r| r.phase() == Phase::Ready)
            .min_by_key(|r| (r.load().outstanding, std::cmp::Reverse(r.id)))
        else {
            return false;
        };
        let done = if to_standby { r.demote() } else { r.drain() };
        if done {
            let what = if to_standby { "standby" } else { "draining" };
            self.events.record(pipe.name(), &st.name, Some(r.id), what, "load fell".into());
        }
        done
    }

    /// Drain one standby of `st` (a starting one first).
    pub fn drain_standby(&self, pipe: &PipelineRt, st: &StageRt) -> bool {
        let _one_at_a_time = self.scaling.lock();
        let Some(r) = st.standbys_warm_first().pop() else { return false };
        let done = r.drain();
        if done {
            self.events.record(pipe.name(), &st.name, Some(r.id), "draining", "standby not needed".into());
        }
        done
    }
}
