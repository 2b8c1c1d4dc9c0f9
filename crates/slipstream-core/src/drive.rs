//! The task that drives one replica, wherever its batches run.
//!
//! A replica's scheduling is the node's, whatever executes its batches: its
//! queue (EDF), the batch step (most urgent first, sized by the batch
//! former), the accounting of each batch (latency profile, AIMD, metrics),
//! and what happens to each request afterwards (its outputs move it on
//! through its DAG; a request's work at a stage is retried once elsewhere
//! when its executor was lost). [`drive`] is that loop, once, for every replica. What
//! executes the batches is a [`Backend`]: a worker process on this machine
//! ([`crate::worker::WorkerLauncher`]), or another node (the cluster's remote
//! replicas). A backend starts its executor, sends it batches, and reports
//! what comes back; it never touches a request's state.
//!
//! The loop is sequential for a backend that runs one batch at a time (a
//! Python worker is one process): wait for work, take a batch, send it,
//! read until its answer, settle, repeat; while the executor computes, new
//! requests pile up in the queue and form the next batch. A backend with
//! room for several batches ([`Backend::capacity`] > 1: an `async`
//! component) is kept that full, and its answers are matched to batches by
//! id in whatever order they come.
//!
//! Supervision: a replica is `Ready` only once its backend has started
//! (for a worker: the component constructed and a warm-up batch run). When
//! the executor is lost, the requests of its batches in flight are retried
//! once on another replica of the stage or fail with 503, queued requests
//! move to accepting replicas, and the backend is started again (it backs
//! off as it sees fit). A replica that is drained (scaled away) finishes
//! its queue, stops its executor and leaves its stage; a local replica's
//! pool goes back to the arena for the next replica.

use crate::arena::{request_rows, Arena, Tensors};
use crate::error::NodeError;
use crate::events::{EventKind, Events};
use crate::ext::Versions;
use crate::pipeline::{PipelineRt, Sample, StageRt};
use crate::replica::{Job, Phase, Replica, Work};
use slipstream_shm::Block;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

/// A warm-up sample is refreshed at most this often.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// The future that drives one replica until it leaves its stage.
pub type ReplicaTask = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Tells the node whether a replica it starts with came up (Err: why not).
pub type FirstStart = oneshot::Sender<Result<(), String>>;

/// What drives replicas: the core's [`crate::worker::WorkerLauncher`] for a
/// worker process on this machine, the cluster's for a replica on another
/// node; both run [`drive`] over their own [`Backend`].
pub trait Launcher: Send + Sync {
    /// The task of the replica `ctx` names; `first_start` (a replica the
    /// node starts with) learns whether it came up.
    fn launch(&self, ctx: ReplicaCtx, first_start: Option<FirstStart>) -> ReplicaTask;
}

/// What a replica's task works with: its pipeline, stage and replica, the
/// node's arena and event log, and the node's stop signal.
pub struct ReplicaCtx {
    pub(crate) pipe: Arc<PipelineRt>,
    pub(crate) stage: usize,
    pub(crate) me: Arc<Replica>,
    pub(crate) arena: Arc<Arena>,
    pub(crate) events: Arc<Events>,
    /// Becomes true when the node has drained and executors should stop.
    pub(crate) stop: watch::Receiver<bool>,
}

impl ReplicaCtx {
    /// The pipeline the replica serves.
    pub fn pipeline(&self) -> &Arc<PipelineRt> {
        &self.pipe
    }

    /// Its stage.
    pub fn stage(&self) -> &StageRt {
        &self.pipe.stages[self.stage]
    }

    /// The stage's index in its pipeline.
    pub fn stage_index(&self) -> usize {
        self.stage
    }

    /// The replica.
    pub fn replica(&self) -> &Arc<Replica> {
        &self.me
    }

    /// The node's shared memory.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// Record an event about this replica.
    pub fn event(&self, what: EventKind, detail: String) {
        self.events.record(self.pipe.name(), &self.stage().name, Some(self.me.id), what, detail);
    }

    /// Whether the node is stopping.
    pub fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// The node's stop signal (becomes true when it stops).
    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.clone()
    }
}

static BATCH_IDS: AtomicU64 = AtomicU64::new(1);

/// A fresh batch id (unique in the node).
pub(crate) fn next_batch_id() -> u64 {
    BATCH_IDS.fetch_add(1, Relaxed)
}

/// A batch on its way to a replica's executor.
pub struct Batch {
    /// Unique in the node.
    pub id: u64,
    /// Each request with its inputs to the stage, in batch order; every
    /// request's inputs have the same names, dtypes and trailing shapes.
    pub members: Vec<(Arc<dyn Job>, Tensors)>,
    /// Memory the executor reads that must live until it answers (inputs
    /// the backend gathered into one block, say).
    pub keep: Vec<Arc<Block>>,
    /// The batch's expected latency (the replica's profile), ns.
    pub expected_ns: u64,
    /// Slack of the most urgent request when it was taken, ns.
    budget_ns: u64,
    /// Its padded length, for a stage that batches by length.
    padded: Option<u64>,
    sent: Instant,
}

impl Batch {
    /// Rows of each request, in batch order.
    pub fn rows(&self) -> Vec<u64> {
        self.members.iter().map(|(_, inputs)| request_rows(inputs)).collect()
    }

    /// When each request is due, in batch order.
    pub fn deadlines(&self) -> impl Iterator<Item = Instant> + '_ {
        self.members.iter().map(|(r, _)| r.deadline())
    }
}

/// The batches a backend is running, by id.
pub type Running = HashMap<u64, Batch>;

/// How a batch ended.
pub enum Outcome {
    /// Each request's outputs, in batch order; `compute_us` is the time the
    /// component itself took (when the executor says), `versions` the
    /// store objects its instance was built from.
    Outputs {
        /// One entry per request of the batch.
        outputs: Vec<Tensors>,
        /// The component's own time, µs.
        compute_us: Option<u64>,
        /// The versions of the objects the component needs.
        versions: Versions,
    },
    /// Each request's own outcome, in batch order. A request that failed
    /// with [`NodeError::Unavailable`] or [`NodeError::ShuttingDown`] (no
    /// replica there any more) is retried once on another replica.
    /// `Ok(None)`: the executor handed the request on to the stages after
    /// this one, which answer it another way ([`Job::finish_chain`]).
    Each(Vec<Result<Option<Tensors>, NodeError>>),
    /// The whole batch failed (the component raised, or its answer is unusable).
    Failed(NodeError),
}

/// What an executor reports.
pub enum Reply {
    /// A streaming component's chunk of batch `id`: each request's rows of
    /// it, in batch order.
    Chunk {
        /// The batch.
        id: u64,
        /// One entry per request of the batch.
        per_request: Vec<Tensors>,
    },
    /// Batch `id` ended.
    Done {
        /// The batch.
        id: u64,
        /// How.
        outcome: Outcome,
    },
}

/// A backend's executor is up.
pub struct Started {
    /// Its process id (0: not a process here).
    pub pid: u32,
    /// Where it runs, for the event log.
    pub detail: String,
}

/// What executes a replica's batches (see the module docs). Every `Err`
/// but [`Backend::start`]'s means the executor is lost: its batches in
/// flight are retried or failed by [`drive`], and the backend is started
/// again.
pub trait Backend: Send {
    /// Bring the executor up (spawn and warm up a worker; wait until a
    /// node serves the stage). Err: it could not start; `drive` tries again
    /// (or fails the node's start-up, for a replica the node starts with).
    fn start(&mut self, ctx: &ReplicaCtx) -> impl Future<Output = Result<Started, String>> + Send;
    /// After a failed [`Backend::start`]: the backend gave up for good (it
    /// drained its replica itself: a retry cannot fix what failed), as
    /// opposed to a start that ended because the replica was removed.
    fn gave_up(&self) -> bool {
        false
    }
    /// Batches the executor may run at once.
    fn capacity(&self, ctx: &ReplicaCtx) -> usize;
    /// Send a batch (it may add to `batch.keep`). `Some(outcome)`: the
    /// batch ended without reaching the executor (its inputs could not be
    /// laid out, say); the executor is fine.
    fn send(
        &mut self,
        ctx: &ReplicaCtx,
        batch: &mut Batch,
    ) -> impl Future<Output = Result<Option<Outcome>, String>> + Send;
    /// The executor's next report about one of the `running` batches. When
    /// [`Backend::capacity`] is above 1 this must be cancel-safe (it is
    /// raced against new work), and must resolve with Err when the
    /// executor is lost.
    fn recv(&mut self, ctx: &ReplicaCtx, running: &Running) -> impl Future<Output = Result<Reply, String>> + Send;
    /// Resolves (with why) when the executor is lost while nothing runs.
    /// Cancel-safe: raced against new work.
    fn lost(&mut self, ctx: &ReplicaCtx) -> impl Future<Output = String> + Send;
    /// Stop the executor: asked to finish (`graceful`), or gone for good.
    fn stop(&mut self, graceful: bool) -> impl Future<Output = ()> + Send;
}

enum Ended {
    /// The node is stopping, or the replica was drained: its queue is empty.
    Stopped,
    Lost(String),
}

/// Run a replica until the node stops or the replica is drained.
/// `first_start` (the replicas the node starts with) learns whether the
/// backend came up the first time, so that start-up fails loudly on a
/// broken component.
pub async fn drive<B: Backend>(ctx: ReplicaCtx, mut backend: B, mut first_start: Option<FirstStart>) {
    let mut stop = ctx.stop.clone();
    let mut backoff = Duration::from_millis(100);
    while ctx.me.phase().will_serve() && !ctx.stopping() {
        let started = match backend.start(&ctx).await {
            Ok(s) => s,
            Err(e) => {
                let ended = !ctx.me.phase().will_serve() || ctx.stopping();
                if let Some(tx) = first_start.take() {
                    if ended && !backend.gave_up() {
                        // Removed while it started (placed elsewhere, its
                        // node lost): nothing failed, and start-up has no
                        // replica to wait for.
                        let _ = tx.send(Ok(()));
                        break;
                    }
                    let _ = tx.send(Err(e));
                    ctx.me.stop();
                    return;
                }
                if ended {
                    break;
                }
                ctx.event(EventKind::StartFailed, format!("{e}; retrying in {backoff:?}"));
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => {}
                    _ = ctx.me.woken() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        match ctx.me.worker_ready(started.pid) {
            Some(Phase::Standby) => ctx.event(EventKind::Standby, format!("{}, warm", started.detail)),
            Some(_) => {
                ctx.event(EventKind::Ready, started.detail);
                take_over_waiting(&ctx);
            }
            None => {}
        }
        if let Some(tx) = first_start.take() {
            let _ = tx.send(Ok(()));
        }
        let capacity = backend.capacity(&ctx).max(1);
        let ended = if capacity > 1 {
            serve_many(&ctx, &mut stop, &mut backend, capacity).await
        } else {
            serve_one(&ctx, &mut stop, &mut backend).await
        };
        match ended {
            Ended::Stopped => {
                backend.stop(true).await;
                break;
            }
            Ended::Lost(why) => {
                backend.stop(false).await;
                ctx.me.worker_died();
                ctx.stage().metrics.restarts.fetch_add(1, Relaxed);
                ctx.event(EventKind::Died, format!("{why}; restarting"));
                move_queue_elsewhere(&ctx);
            }
        }
    }
    leave(&ctx);
}

/// The replica stops for good: what is still queued goes to its siblings
/// (or fails), and it leaves its stage; a local replica's pool is free for
/// the next one (a remote one's replies land in the ingress pool, which stays).
fn leave(ctx: &ReplicaCtx) {
    let stage = ctx.stage();
    for w in ctx.me.stop() {
        if let Err(req) = stage.place(w.req, None, Some(&ctx.me)) {
            req.fail(NodeError::Unavailable { stage: stage.name.clone(), reason: "its replica stopped".into() });
        }
    }
    if !ctx.stopping() {
        stage.remove_replica(ctx.me.id);
        match &ctx.me.remote {
            None => {
                ctx.arena.release_pool(ctx.me.pool.clone());
                ctx.event(EventKind::Removed, String::new());
            }
            Some(at) => ctx.event(EventKind::Removed, format!("node {}", at.node)),
        }
    }
}

/// What the batch step says the task should do next.
enum Next {
    /// Run this batch (already formed; none left when all were deferred or failed).
    Run(Option<Batch>),
    /// Some requests expired (and were failed): look again at once.
    Again,
    /// Nothing to run: wait for new work, or until this instant.
    Wait(Option<Instant>),
}

/// The batch step: fail what expired (counted as dropped late), and form
/// the batch to run.
fn next_step(ctx: &ReplicaCtx) -> Next {
    let rest = ctx.pipe.rest_ns(ctx.stage);
    let step = ctx.me.take_batch(rest);
    let dropped = !step.expired.is_empty();
    if dropped {
        let stage = ctx.stage();
        stage.metrics.dropped_late.fetch_add(step.expired.len() as u64, Relaxed);
        for w in step.expired {
            w.req.fail(NodeError::DeadlineExceeded { stage: stage.name.clone() });
        }
    }
    if let Some((head, _)) = step.batch.first() {
        let now = ctx.pipe.now_ns();
        ctx.stage().metrics.record_dispatch(*head, now);
        let budget_ns = head.saturating_sub(now + rest);
        return Next::Run(form(ctx, step.batch.into_iter().map(|(_, w)| w).collect(), budget_ns, step.padded));
    }
    if dropped {
        return Next::Again; // more may be queued behind the expired ones
    }
    Next::Wait(step.wait_until.map(|at| ctx.pipe.epoch + Duration::from_nanos(at)))
}

/// The tail shape and dtype of every input: requests can share a batch only
/// when these agree.
fn signature(inputs: &Tensors) -> Vec<(&str, slipstream_types::DType, &[u64])> {
    inputs.iter().map(|(n, t)| (n.as_str(), t.dtype, &t.shape[1..])).collect()
}

/// The batch of the requests taken: each with its inputs to this stage;
/// requests whose inputs do not match the first one's shapes go back to
/// the queue for the next batch. The replica's batch begins here.
fn form(ctx: &ReplicaCtx, works: Vec<Work>, budget_ns: u64, padded: Option<u64>) -> Option<Batch> {
    let stage = ctx.stage();
    let now = Instant::now();
    let mut members: Vec<(Arc<dyn Job>, Tensors)> = Vec::with_capacity(works.len());
    let mut deferred = Vec::new();
    let waits: u64 = works.iter().map(|w| now.duration_since(w.enqueued).as_nanos() as u64).sum();
    let mean_wait = waits / works.len().max(1) as u64;
    for work in works {
        stage.metrics.queue_wait_us.record(now.duration_since(work.enqueued).as_micros() as u64);
        match work.req.inputs(ctx.stage) {
            Ok(inputs) => {
                if let Some((_, first)) = members.first() {
                    if signature(first) != signature(&inputs) {
                        deferred.push(work);
                        continue;
                    }
                }
                members.push((work.req, inputs));
            }
            Err(e) => work.req.fail(e),
        }
    }
    ctx.me.requeue(deferred);
    if members.is_empty() {
        return None;
    }
    let expected_ns = ctx.me.begin_batch(members.len(), mean_wait, padded, budget_ns);
    Some(Batch { id: next_batch_id(), members, keep: Vec::new(), expected_ns, budget_ns, padded, sent: Instant::now() })
}

/// Whether a replica that is stopping or draining has finished its queue.
fn done_serving(ctx: &ReplicaCtx) -> bool {
    // Its own queue: a remote replica's last reported backlog is the other
    // node's work, and would keep a drained one (its node gone) forever.
    (ctx.stopping() || ctx.me.phase() == Phase::Draining) && ctx.me.own_queue_len() == 0
}

/// Whether something outside the task reported the executor lost (the
/// cluster suspecting a node).
fn reported_lost(ctx: &ReplicaCtx) -> bool {
    ctx.me.phase() == Phase::Down
}

/// Feed a backend that runs one batch at a time until the node stops, the
/// replica is drained, or the executor is lost.
async fn serve_one<B: Backend>(ctx: &ReplicaCtx, stop: &mut watch::Receiver<bool>, backend: &mut B) -> Ended {
    let mut running = Running::new();
    loop {
        let wake = match next_step(ctx) {
            Next::Run(Some(mut batch)) => {
                let id = batch.id;
                match backend.send(ctx, &mut batch).await {
                    Ok(None) => {}
                    Ok(Some(outcome)) => {
                        settle(ctx, batch, outcome);
                        continue;
                    }
                    Err(why) => {
                        retry_or_fail(ctx, batch.members, &why);
                        return Ended::Lost(why);
                    }
                }
                running.insert(id, batch);
                while running.contains_key(&id) {
                    match backend.recv(ctx, &running).await {
                        Ok(reply) => {
                            if let Err(why) = take_reply(ctx, &mut running, reply) {
                                return lose_all(ctx, &mut running, why);
                            }
                        }
                        Err(why) => return lose_all(ctx, &mut running, why),
                    }
                }
                continue;
            }
            Next::Run(None) | Next::Again => continue,
            Next::Wait(wake) => wake,
        };
        if done_serving(ctx) {
            return Ended::Stopped;
        }
        if reported_lost(ctx) {
            return Ended::Lost("its executor was reported lost".into());
        }
        tokio::select! {
            _ = ctx.me.woken() => {}
            _ = stop.changed() => {}
            _ = sleep_until_opt(wake) => {}
            why = backend.lost(ctx) => return Ended::Lost(why),
        }
    }
}

/// Feed a backend that runs up to `capacity` batches at once (an async
/// component): batches go out as soon as the batch step forms them and
/// there is room, and answers are matched to them by id.
async fn serve_many<B: Backend>(
    ctx: &ReplicaCtx,
    stop: &mut watch::Receiver<bool>,
    backend: &mut B,
    capacity: usize,
) -> Ended {
    let mut running = Running::new();
    loop {
        let mut wake = None;
        while running.len() < capacity {
            match next_step(ctx) {
                Next::Run(Some(mut batch)) => match backend.send(ctx, &mut batch).await {
                    Ok(None) => {
                        running.insert(batch.id, batch);
                    }
                    Ok(Some(outcome)) => settle(ctx, batch, outcome),
                    Err(why) => {
                        retry_or_fail(ctx, batch.members, &why);
                        return lose_all(ctx, &mut running, why);
                    }
                },
                Next::Run(None) | Next::Again => continue,
                Next::Wait(at) => {
                    wake = at;
                    break;
                }
            }
        }
        if running.is_empty() && done_serving(ctx) {
            return Ended::Stopped;
        }
        if reported_lost(ctx) {
            return lose_all(ctx, &mut running, "its executor was reported lost".into());
        }
        let room = running.len() < capacity;
        tokio::select! {
            reply = backend.recv(ctx, &running) => match reply {
                Ok(reply) => {
                    if let Err(why) = take_reply(ctx, &mut running, reply) {
                        return lose_all(ctx, &mut running, why);
                    }
                }
                Err(why) => return lose_all(ctx, &mut running, why),
            },
            _ = ctx.me.woken(), if room => {}
            _ = stop.changed() => {}
            _ = sleep_until_opt(wake), if room => {}
        }
    }
}

/// The executor is lost with `running` in flight: retry or fail them.
fn lose_all(ctx: &ReplicaCtx, running: &mut Running, why: String) -> Ended {
    for (_, b) in running.drain() {
        retry_or_fail(ctx, b.members, &why);
    }
    Ended::Lost(why)
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Act on one report. Err: it names no batch in flight (a protocol violation).
fn take_reply(ctx: &ReplicaCtx, running: &mut Running, reply: Reply) -> Result<(), String> {
    match reply {
        Reply::Chunk { id, per_request } => {
            let b = running.get(&id).ok_or_else(|| format!("protocol violation: a chunk of unknown batch {id}"))?;
            for ((req, _), outs) in b.members.iter().zip(per_request) {
                req.chunk(ctx.stage, outs);
            }
            Ok(())
        }
        Reply::Done { id, outcome } => {
            let b =
                running.remove(&id).ok_or_else(|| format!("protocol violation: an answer to unknown batch {id}"))?;
            settle(ctx, b, outcome);
            Ok(())
        }
    }
}

/// Account a batch's round trip and hand each request its outputs (or its error).
fn settle(ctx: &ReplicaCtx, b: Batch, outcome: Outcome) {
    let stage = ctx.stage();
    let m = &stage.metrics;
    let n = b.members.len();
    let rtt = b.sent.elapsed();
    let rtt_us = rtt.as_micros() as u64;
    ctx.me.end_batch(n, rtt.as_nanos() as u64, b.budget_ns, b.padded);
    m.batches.fetch_add(1, Relaxed);
    m.requests.fetch_add(n as u64, Relaxed);
    m.busy_us.fetch_add(rtt_us, Relaxed);
    m.batch_size.record(n as u64);
    match outcome {
        Outcome::Outputs { outputs, compute_us, versions } => {
            match compute_us {
                Some(c) => {
                    m.compute_us.record(c);
                    m.hop_us.record(rtt_us.saturating_sub(c));
                }
                None => m.hop_us.record(rtt_us),
            }
            if ctx.me.is_local() {
                maybe_sample(ctx, &b.members[0].1);
            }
            for ((req, _), outs) in b.members.into_iter().zip(outputs) {
                if let (Some(hook), Some(memo)) = (&stage.hook, req.memo(ctx.stage)) {
                    hook.store(memo, &outs, &versions);
                }
                req.finish(ctx.stage, outs);
            }
        }
        Outcome::Each(results) => {
            m.hop_us.record(rtt_us);
            for ((req, _), result) in b.members.into_iter().zip(results) {
                match result {
                    Ok(Some(outs)) => req.finish(ctx.stage, outs),
                    Ok(None) => req.handed_on(ctx.stage), // settled when its chain answers
                    Err(e) => {
                        if matches!(e, NodeError::Component { .. }) {
                            m.errors.fetch_add(1, Relaxed);
                        }
                        // No replica there any more (the placement moved it): once elsewhere.
                        let elsewhere = matches!(e, NodeError::Unavailable { .. } | NodeError::ShuttingDown)
                            && req.mark_retried(ctx.stage);
                        match elsewhere.then(|| stage.choose(req.id(), Some(&ctx.me))).flatten() {
                            Some(r) => {
                                if let Err(req) = r.push(req) {
                                    req.fail_stage(ctx.stage, e);
                                }
                            }
                            None => req.fail_stage(ctx.stage, e),
                        }
                    }
                }
            }
        }
        Outcome::Failed(e) => {
            if matches!(e, NodeError::Component { .. }) {
                m.errors.fetch_add(n as u64, Relaxed);
            }
            for (req, _) in b.members {
                req.fail_stage(ctx.stage, e.duplicate());
            }
        }
    }
}

/// Keep a copy of one request's inputs as the stage's warm-up sample, at
/// most every [`SAMPLE_EVERY`] (off the request path: after its batch).
fn maybe_sample(ctx: &ReplicaCtx, inputs: &Tensors) {
    let mut sample = ctx.stage().sample.lock();
    if sample.as_ref().is_none_or(|s| s.taken.elapsed() >= SAMPLE_EVERY) {
        *sample = Some(Sample::of(inputs));
    }
}

/// Move what waited for a lost executor to accepting replicas, if any (else
/// it waits here for the restart).
fn move_queue_elsewhere(ctx: &ReplicaCtx) {
    if ctx.stage().choose(0, Some(&ctx.me)).is_some() {
        move_queue(ctx.stage(), &ctx.me);
    }
}

/// This replica serves now: what waits on siblings that do not (a worker
/// still starting, or restarting after a loss) is placed again, among the
/// replicas that serve. Work queues on a replica that does not serve only
/// when none served as it arrived, and would otherwise wait for that one
/// however long its start takes: in a rolling restart under CI load, work
/// queued on a replica whose cold worker took 6 s to start waited there
/// for its deadline (504s) while a sibling came back within a second.
fn take_over_waiting(ctx: &ReplicaCtx) {
    let stage = ctx.stage();
    for other in stage.replicas().iter().filter(|r| !Arc::ptr_eq(r, &ctx.me) && !r.load().accepting) {
        move_queue(stage, other);
    }
}

/// Place everything queued on `from` again, on the stage's other replicas
/// (what finds no place stays).
fn move_queue(stage: &StageRt, from: &Replica) {
    let mut stay = Vec::new();
    for w in from.take_queue() {
        let (enqueued, length) = (w.enqueued, w.length);
        if let Err(req) = stage.place(w.req, None, Some(from)) {
            stay.push(Work { req, enqueued, length });
        }
    }
    from.requeue(stay);
}

/// The executor was lost with this batch in flight: retry each request once
/// on another replica of the stage, else fail it with 503.
fn retry_or_fail(ctx: &ReplicaCtx, members: Vec<(Arc<dyn Job>, Tensors)>, why: &str) {
    let stage = ctx.stage();
    ctx.me.worker_died();
    let fail = |req: Arc<dyn Job>| {
        req.fail_stage(
            ctx.stage,
            NodeError::Unavailable {
                stage: stage.name.clone(),
                reason: format!("its worker died while running the request ({why})"),
            },
        )
    };
    for (req, _) in members {
        if !req.mark_retried(ctx.stage) {
            fail(req);
            continue;
        }
        // Only to a replica that serves now: waiting for a restart would
        // rarely fit the deadline, and a clear 503 lets the client decide.
        match stage.choose(req.id(), Some(&ctx.me)) {
            Some(r) => match r.push(req) {
                Ok(()) => {
                    stage.metrics.retries.fetch_add(1, Relaxed);
                }
                Err(req) => fail(req),
            },
            None => fail(req),
        }
    }
}
