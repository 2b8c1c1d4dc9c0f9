//! The node: its pipelines, shared memory, store and replica tasks, and the
//! request path every entry point goes through (accept, answer).
//!
//! [`Node`] is a facade with private state. Entry points (HTTP, gRPC, store
//! triggers, priming, another node's batches) call [`Node::accept`] (admit
//! before decoding, so a refusal is cheap, then decode) and
//! [`Node::answer`]; the cluster runs one stage's work with
//! [`Node::run_stage`]. Replica sets change only through
//! [`Node::change`] (`scaling.rs`). Start-up and shutdown are the
//! composition root's; status and Prometheus text are `report.rs`'s.

use crate::arena::{request_rows, Arena, Tensors};
use crate::codec;
use crate::config::NodeOptions;
use crate::drive::{FirstStart, Launcher, ReplicaCtx};
use crate::error::NodeError;
use crate::events::Events;
use crate::ext::Service;
use crate::pipeline::{PipelineRt, Ticket};
use crate::replica::{Job, Phase, Replica};
use crate::request::{Admitted, Chunks, Reply, Request};
use parking_lot::Mutex;
use slipstream_sched::Priority;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinHandle;

/// What a node is made of (see [`Node::new`]).
pub struct NodeParts {
    /// Its pipelines, by name.
    pub pipelines: Vec<Arc<PipelineRt>>,
    /// Its shared memory.
    pub arena: Arc<Arena>,
    /// Models, indices and documents (see `docs/design/store.md`).
    pub store: Arc<slipstream_store::Store>,
    /// The core's settings.
    pub opts: NodeOptions,
    /// Refuse requests predicted to miss their deadline (429).
    pub admission: bool,
    /// What drives replicas on this machine.
    pub local: Arc<dyn Launcher>,
    /// Becomes true when the node has drained and replicas should stop.
    pub stop: watch::Receiver<bool>,
}

/// The node (see the module docs).
pub struct Node {
    pipelines: BTreeMap<String, Arc<PipelineRt>>,
    arena: Arc<Arena>,
    store: Arc<slipstream_store::Store>,
    opts: NodeOptions,
    events: Arc<Events>,
    started: Instant,
    admission: bool,
    local: Arc<dyn Launcher>,
    /// What drives replicas on other nodes (set once, by the cluster).
    remote: OnceLock<Arc<dyn Launcher>>,
    shared: OnceLock<Arc<dyn crate::ext::SharedStore>>,
    stop: watch::Receiver<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The features that report in status and metrics.
    services: Mutex<Vec<Arc<dyn Service>>>,
    /// The HTTP port it listens on (known once bound).
    port: AtomicU16,
    /// Start-up finished: every first worker reported ready.
    serving: AtomicBool,
    draining: AtomicBool,
    /// Wakes long waits (store watches) when draining starts, so that they
    /// answer at once instead of holding the graceful shutdown.
    drain_signal: watch::Sender<bool>,
    inflight: AtomicUsize,
    idle: Notify,
    next_id: AtomicU64,
    /// Replica sets change one change at a time (see `scaling.rs`).
    pub(crate) scaling: Mutex<()>,
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

/// When a request arrived and the deadline budget it asked for.
#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    /// When it arrived.
    pub at: Instant,
    /// The budget it asked for (the SLO's target bounds it).
    pub budget: Option<Duration>,
    /// Its class for admission (`x-slipstream-priority`).
    pub priority: Priority,
}

impl Arrival {
    /// A request arriving now.
    pub fn now(budget: Option<Duration>) -> Arrival {
        Arrival { at: Instant::now(), budget, priority: Priority::Normal }
    }
}

/// A pipeline's answer: its outputs, or the declared fallback (and why).
pub struct Answer {
    /// The outputs.
    pub outputs: Tensors,
    /// The kind of the error the fallback answers instead of, if it does.
    pub fallback: Option<&'static str>,
    /// The request's id (for feedback on it), unless it was refused.
    pub id: Option<u64>,
}

/// A request let into its pipeline and decoded, not yet run (see
/// [`Node::accept`]). A refused request of a pipeline that declares a
/// fallback is accepted too: its answer is the fallback.
pub struct Accepted {
    pipe: Arc<PipelineRt>,
    tensors: Tensors,
    ticket: Result<Ticket, NodeError>,
}

impl Node {
    /// A node over `parts`. Its replica tasks start with [`Node::start_replicas`].
    pub fn new(parts: NodeParts) -> Result<Node, NodeError> {
        let mut pipelines = BTreeMap::new();
        for p in parts.pipelines {
            let name = p.name().to_string();
            if pipelines.insert(name.clone(), p).is_some() {
                return Err(NodeError::BadInput(format!("two pipelines are named '{name}'")));
            }
        }
        Ok(Node {
            pipelines,
            arena: parts.arena,
            store: parts.store,
            opts: parts.opts,
            events: Arc::new(Events::default()),
            started: Instant::now(),
            admission: parts.admission,
            local: parts.local,
            remote: OnceLock::new(),
            shared: OnceLock::new(),
            stop: parts.stop,
            tasks: Mutex::new(Vec::new()),
            services: Mutex::new(Vec::new()),
            port: AtomicU16::new(0),
            serving: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            drain_signal: watch::channel(false).0,
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            next_id: AtomicU64::new(1),
            scaling: Mutex::new(()),
        })
    }

    /// Its pipelines, by name.
    pub fn pipelines(&self) -> &BTreeMap<String, Arc<PipelineRt>> {
        &self.pipelines
    }

    /// The pipeline named `name`, or why there is none.
    pub fn pipeline(&self, name: &str) -> Result<Arc<PipelineRt>, NodeError> {
        self.pipelines.get(name).cloned().ok_or_else(|| NodeError::UnknownPipeline(name.to_string()))
    }

    /// Its shared memory.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// Its object store.
    pub fn store(&self) -> &Arc<slipstream_store::Store> {
        &self.store
    }

    /// Its event log.
    pub fn events(&self) -> &Arc<Events> {
        &self.events
    }

    /// Its settings.
    pub fn opts(&self) -> &NodeOptions {
        &self.opts
    }

    /// Time since the node was made.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Report `service`'s status and metrics with the node's.
    pub fn register(&self, service: Arc<dyn Service>) {
        self.services.lock().push(service);
    }

    pub(crate) fn services(&self) -> Vec<Arc<dyn Service>> {
        self.services.lock().clone()
    }

    /// Drive replicas on other nodes with `launcher` (once; later calls are ignored).
    pub fn set_remote_launcher(&self, launcher: Arc<dyn Launcher>) {
        let _ = self.remote.set(launcher);
    }

    /// Share the store through `shared` (a cluster's; once, later calls
    /// are ignored): writes commit there, reads sync with it first.
    pub fn set_shared_store(&self, shared: Arc<dyn crate::ext::SharedStore>) {
        let _ = self.shared.set(shared);
    }

    /// The cluster's shared store, if the node is in one.
    pub fn shared_store(&self) -> Option<&Arc<dyn crate::ext::SharedStore>> {
        self.shared.get()
    }

    /// Read `key` from the node's store with `f` (on a blocking thread); in
    /// a cluster, a version held on other nodes ([`StoreError::Elsewhere`])
    /// is fetched from one of them and kept here first, then read again.
    pub async fn read_store<T: Send + 'static>(
        &self,
        key: &str,
        f: impl Fn(&slipstream_store::Store) -> Result<T, slipstream_store::StoreError> + Send + Sync + 'static,
    ) -> Result<T, slipstream_store::StoreError> {
        let f = Arc::new(f);
        for _ in 0..3 {
            let (store, f) = (self.store.clone(), f.clone());
            let read = tokio::task::spawn_blocking(move || f(&store))
                .await
                .map_err(|e| slipstream_store::StoreError::Io(format!("store task: {e}")))?;
            match (read, self.shared_store()) {
                (Err(slipstream_store::StoreError::Elsewhere { version, .. }), Some(shared)) => {
                    shared.fetch(key, version).await?
                }
                (read, _) => return read,
            }
        }
        Err(slipstream_store::StoreError::Io(format!("{key}: its value could not be brought to this node")))
    }

    /// The node's stop signal (true once it has drained).
    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.clone()
    }

    /// Note the HTTP port the node listens on.
    pub fn set_listen_port(&self, port: u16) {
        self.port.store(port, Relaxed);
    }

    /// The HTTP port it listens on (0 before it is bound).
    pub fn listen_port(&self) -> u16 {
        self.port.load(Relaxed)
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    /// Request ids from here on start at `first` (a cluster gives each
    /// node a range of its own, so that an id names the node that answered).
    pub fn set_request_ids(&self, first: u64) {
        self.next_id.store(first, Relaxed);
    }

    /// Ready for traffic: started, not draining, and every stage of every
    /// pipeline has a replica whose worker serves.
    pub fn is_ready(&self) -> bool {
        self.serves() && self.pipelines.values().all(|p| p.is_ready()) && self.gates_open()
    }

    /// Ready for one pipeline's traffic.
    pub fn pipeline_ready(&self, p: &PipelineRt) -> bool {
        self.serves() && p.is_ready() && self.gates_open()
    }

    /// Why the registered services hold readiness back (empty: none does).
    pub fn held_back(&self) -> Vec<String> {
        self.services().iter().filter_map(|s| s.unready()).collect()
    }

    fn gates_open(&self) -> bool {
        self.held_back().is_empty()
    }

    fn serves(&self) -> bool {
        self.serving.load(Relaxed) && !self.draining.load(Relaxed)
    }

    /// Whether it refuses new work.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Relaxed)
    }

    /// Requests inside the node now.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Relaxed)
    }

    /// Start-up is over: the node may report ready.
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
    pub fn on_drain(&self) -> watch::Receiver<bool> {
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

    /// Reset the status view of every counter (see `metrics.rs`).
    pub fn reset_metrics(&self) {
        for p in self.pipelines.values() {
            p.metrics.reset();
            p.stages.iter().for_each(|s| s.metrics.reset());
        }
    }

    /// Start the task of every replica the pipelines were built with;
    /// returns, per replica ("pipeline/stage"), whether its first start
    /// worked.
    pub fn start_replicas(&self) -> Vec<(String, oneshot::Receiver<Result<(), String>>)> {
        let mut first = Vec::new();
        for p in self.pipelines.values() {
            for s in &p.stages {
                for r in s.replicas().iter() {
                    let (tx, rx) = oneshot::channel();
                    first.push((p.stage_key(s.index), rx));
                    self.spawn_replica(p, s.index, r.clone(), Some(tx));
                }
            }
        }
        first
    }

    /// The replica tasks still running (to wait for at shutdown).
    pub fn take_tasks(&self) -> Vec<JoinHandle<()>> {
        std::mem::take(&mut *self.tasks.lock())
    }

    /// Start the task that drives `replica` of `pipe`'s stage `stage`.
    pub(crate) fn spawn_replica(
        &self,
        pipe: &Arc<PipelineRt>,
        stage: usize,
        replica: Arc<Replica>,
        first_start: Option<FirstStart>,
    ) {
        let launcher = match (replica.is_local(), self.remote.get()) {
            (false, Some(remote)) => remote.clone(),
            _ => self.local.clone(),
        };
        let ctx = ReplicaCtx {
            pipe: pipe.clone(),
            stage,
            me: replica,
            arena: self.arena.clone(),
            events: self.events.clone(),
            stop: self.stop.clone(),
        };
        let run = tokio::spawn(launcher.launch(ctx, first_start));
        let mut tasks = self.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(run);
    }

    /// Let a request into `pipe` and decode it: admission first (before
    /// the body is decoded, so that refusing costs as little CPU as
    /// possible when the node is overloaded), then `decode` into the arena.
    /// Err: refused (429, or 503 while draining), or malformed. A refused
    /// request of a pipeline that declares a fallback is accepted: its
    /// answer is the fallback, which needs the decoded request's rows.
    pub fn accept<T>(
        &self,
        pipe: &Arc<PipelineRt>,
        arrival: Arrival,
        decode: impl FnOnce(&Arena) -> Result<(Tensors, T), NodeError>,
    ) -> Result<(Accepted, T), NodeError> {
        let ticket = self.admit(pipe, arrival)?;
        let (tensors, extra) = decode(&self.arena)?;
        Ok((Accepted { pipe: pipe.clone(), tensors, ticket }, extra))
    }

    fn admit(&self, pipe: &PipelineRt, arrival: Arrival) -> Result<Result<Ticket, NodeError>, NodeError> {
        if self.is_draining() {
            return Err(NodeError::ShuttingDown);
        }
        let mut ticket = pipe.ticket(self.next_request_id(), arrival.at, arrival.budget)?;
        if !self.admission {
            return Ok(Ok(ticket));
        }
        match pipe.admit(&ticket, arrival.priority) {
            Ok((share, found_queue)) => {
                (ticket.share, ticket.found_queue) = (share, found_queue);
                Ok(Ok(ticket))
            }
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

    /// Run an accepted request through its pipeline; a streaming
    /// component's chunks from the pipeline's sinks go to `chunks` as they
    /// come. Answers with the pipeline's declared fallback (Clipper's
    /// default output) instead of an error when the request was refused or
    /// ran out of time. If this future is dropped first (the client went
    /// away), the request is settled as cancelled.
    pub async fn answer(&self, accepted: Accepted, chunks: Option<Chunks>) -> Result<Answer, NodeError> {
        let Accepted { pipe, tensors, ticket } = accepted;
        let rows = request_rows(&tensors);
        let id = ticket.as_ref().ok().map(|t| t.id);
        let result = match ticket {
            Ok(t) => self.infer(&pipe, tensors, t, chunks).await,
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
    /// is dropped first, the guards settle the request as cancelled and
    /// take it off the drain count.
    async fn infer(
        &self,
        pipe: &Arc<PipelineRt>,
        tensors: Tensors,
        mut ticket: Ticket,
        chunks: Option<Chunks>,
    ) -> Result<Tensors, NodeError> {
        pipe.route_by_affinity(&mut ticket, &tensors, &self.store.options().pools, self.shared_store());
        self.inflight.fetch_add(1, Relaxed);
        let _inflight = InFlight(self);
        let result = Admitted::enter(pipe, tensors, ticket, chunks).outcome().await;
        if let Ok(outputs) = &result {
            pipe.learn_outputs(outputs);
        }
        result
    }

    /// Run stage `stage` of `pipe` on this node's replicas for a request
    /// that entered the cluster at another node (whose ingress keeps the
    /// request's state and joins): queued by `deadline` alongside this
    /// node's own work. `chunks`: where a streaming component's chunks go,
    /// when that request streams. Err: no replica here serves the stage.
    pub fn run_stage(
        &self,
        pipe: &Arc<PipelineRt>,
        stage: usize,
        inputs: Tensors,
        deadline: Instant,
        chunks: Option<Chunks>,
    ) -> Result<StageRun, NodeError> {
        let st = pipe.stages.get(stage).ok_or_else(|| NodeError::BadRequest(format!("no stage {stage}")))?;
        let id = self.next_request_id();
        let Some(first) = st.local_target(id) else {
            return Err(NodeError::Unavailable { stage: st.name.clone(), reason: "no replica here".into() });
        };
        let now = Instant::now();
        let ticket = Ticket::new(id, now, deadline, vec![first; pipe.stages.len()]);
        let (req, rx) = Request::for_stage(pipe.clone(), stage, inputs, ticket, chunks);
        let give_up = deadline.max(now + pipe.timeout.min(Duration::from_secs(3600)));
        Ok(StageRun { req, rx: Some(rx), give_up })
    }
}

/// One stage's work run for another node (see [`Node::run_stage`]);
/// dropped before its outcome, the work is cancelled.
pub struct StageRun {
    req: Arc<Request>,
    rx: Option<oneshot::Receiver<Reply>>,
    give_up: Instant,
}

impl StageRun {
    /// The stage's outputs, or why it failed (504 past the deadline).
    pub async fn outcome(mut self) -> Result<Tensors, NodeError> {
        let rx = self.rx.take().expect("awaited once");
        match tokio::time::timeout_at(self.give_up.into(), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(NodeError::Internal("the stage dropped the request".into())),
            Err(_) => Err(NodeError::DeadlineExceeded { stage: self.req.stage_now() }),
        }
    }
}

impl Drop for StageRun {
    fn drop(&mut self) {
        // Releases the request if it is still queued (a no-op once answered).
        Job::fail(&*self.req, NodeError::Cancelled);
    }
}

/// Which replicas of a stage go first when it shrinks: those not serving,
/// then the least loaded, then the newest.
pub(crate) fn removal_order(live: &mut [Arc<Replica>]) {
    live.sort_by_key(|r| (r.phase() == Phase::Ready, r.load().outstanding, std::cmp::Reverse(r.id)));
}
