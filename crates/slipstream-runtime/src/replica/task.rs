//! The task that drives one replica: it owns the replica's worker process
//! and feeds it batches.
//!
//! The loop is deliberately sequential: a worker runs one batch at a time
//! (it is one Python process), so the task waits for work, takes a batch
//! from the replica's queue (the batch step: most urgent first, sized by the
//! batch former), sends one frame of descriptors, reads one frame back, and
//! hands each request its outputs. While the worker computes, new requests
//! pile up in the queue and form the next batch. The one exception is a
//! stage whose component is `async` (`concurrency` > 1): its worker runs
//! several batches at once on an event loop, so the task keeps up to that
//! many in flight and matches answers to batches by id
//! ([`serve_concurrent`]).
//!
//! Supervision lives here too: a worker is warmed up with a sample request
//! before the replica is marked ready; if the worker dies, the requests of
//! its in-flight batch are retried once on another replica of the stage or
//! fail with 503, queued requests move to accepting replicas, and the worker
//! is restarted with exponential back-off. A replica that is drained (scaled
//! away) finishes its queue, stops its worker and leaves its stage; its pool
//! goes back to the arena for the next replica.

use super::worker::{describe_exit, next_batch_id, Coordinates, Launch, Worker};
use super::{Phase, Replica, Work};
use crate::arena::{Arena, CopyCounters, TensorRef, Tensors};
use crate::error::NodeError;
use crate::events::Events;
use crate::pipeline::{PipelineRt, Sample, StageRt};
use crate::request::{request_rows, Request};
use slipstream_shm::Block;
use slipstream_transport::{read_frame, write_frame, FromWorker, OutputOrigin, ToWorker};
use slipstream_types::{checked_nbytes, TensorDesc};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

/// A warm-up sample is refreshed at most this often.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Everything a replica task needs.
pub struct ReplicaCtx {
    pub pipe: Arc<PipelineRt>,
    pub stage: usize,
    pub me: Arc<Replica>,
    pub arena: Arc<Arena>,
    pub launch: Arc<Launch>,
    pub events: Arc<Events>,
    /// Becomes true when the node has drained and workers should exit.
    pub stop: watch::Receiver<bool>,
}

enum Ended {
    /// The node is stopping, or the replica was drained: its queue is empty.
    Stopped,
    Died(String),
}

impl ReplicaCtx {
    pub(crate) fn stage(&self) -> &StageRt {
        &self.pipe.stages[self.stage]
    }

    pub(crate) fn event(&self, what: &'static str, detail: String) {
        self.events.record(self.pipe.name(), &self.stage().name, Some(self.me.id), what, detail);
    }

    pub(crate) fn stopping(&self) -> bool {
        *self.stop.borrow()
    }
}

/// Run a replica until the node stops or the replica is drained.
/// `first_start` (the replicas the node starts with) learns whether the
/// first worker came up, so start-up can fail loudly on a broken component.
pub async fn run(mut ctx: ReplicaCtx, mut first_start: Option<oneshot::Sender<Result<(), String>>>) {
    let mut backoff = Duration::from_millis(100);
    let (pipeline, stage) = (ctx.pipe.name().to_string(), ctx.stage().name.clone());
    // The stage's environment, and a GPU stage's device for this replica.
    let env = match ctx.stage().worker_env(ctx.me.id) {
        Ok(env) => env,
        Err(e) => {
            ctx.event("start_failed", e.clone());
            if let Some(tx) = first_start.take() {
                let _ = tx.send(Err(e));
                ctx.me.stop();
                return;
            }
            leave(&ctx);
            return;
        }
    };
    let at = Coordinates { pipeline: &pipeline, stage: &stage, replica: ctx.me.id, env: &env };
    while ctx.me.phase().will_serve() && !ctx.stopping() {
        let started = Instant::now();
        let mut worker = match Worker::spawn(&ctx.launch, &at, &ctx.arena, &ctx.me.pool).await {
            Ok(w) => w,
            Err(e) => {
                if let Some(tx) = first_start.take() {
                    let _ = tx.send(Err(e));
                    ctx.me.stop();
                    return;
                }
                ctx.event("start_failed", format!("{e}; retrying in {backoff:?}"));
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = ctx.stop.changed() => {}
                    _ = ctx.me.woken() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        let ended = match warm_up(&ctx, &mut worker).await {
            Err(why) => Ended::Died(why),
            Ok(()) => {
                ctx.stage().note_start(started.elapsed());
                match ctx.me.worker_ready(worker.pid()) {
                    Some(Phase::Standby) => ctx.event("standby", format!("worker pid {}, warm", worker.pid())),
                    Some(_) => ctx.event("ready", format!("worker pid {}", worker.pid())),
                    None => {}
                }
                if let Some(tx) = first_start.take() {
                    let _ = tx.send(Ok(()));
                }
                backoff = Duration::from_millis(100);
                serve(&mut ctx, &mut worker).await
            }
        };
        match ended {
            Ended::Stopped => {
                worker.shutdown().await;
                break;
            }
            Ended::Died(why) => {
                let _ = worker.child.kill().await;
                ctx.me.worker_died();
                ctx.stage().metrics.restarts.fetch_add(1, Relaxed);
                ctx.event("died", format!("{why}; restarting"));
                move_queue_elsewhere(&ctx);
            }
        }
    }
    leave(&ctx);
}

/// The replica stops for good: what is still queued goes to its siblings
/// (or fails), and it leaves its stage; a local replica's pool is free for
/// the next one (a remote one's replies land in the ingress pool, which stays).
pub(crate) fn leave(ctx: &ReplicaCtx) {
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
                ctx.event("removed", String::new());
            }
            Some(at) => ctx.event("removed", format!("node {}", at.node)),
        }
    }
}

/// Warm a new worker up with the stage's sample request, if it has one.
async fn warm_up(ctx: &ReplicaCtx, w: &mut Worker) -> Result<(), String> {
    let sample = ctx.stage().sample.lock().as_ref().map(|s| s.to_arena(&ctx.arena));
    let inputs = match sample {
        None => return Ok(()),
        Some(Ok(inputs)) => inputs,
        Some(Err(e)) => {
            ctx.event("warm_up_skipped", e.to_string());
            return Ok(());
        }
    };
    let t0 = Instant::now();
    match w.warm_up(&inputs, &ctx.me.pool, ctx.launch.start_timeout).await? {
        None => ctx.event("warmed_up", format!("one batch in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3)),
        Some(msg) => ctx.event("warm_up_failed", format!("the component raised: {msg}")),
    }
    Ok(())
}

/// What the batch step says a replica task should do next.
pub(crate) enum Next {
    /// Run this batch; its most urgent request has this much slack (ns).
    Run(Vec<Work>, u64),
    /// Some requests expired (and were failed): look again at once.
    Again,
    /// Nothing to run: wait for new work, or until this instant.
    Wait(Option<Instant>),
}

/// The batch step for `ctx`'s replica (local worker or remote node alike):
/// fail what expired (counted as dropped late), and say what to run.
pub(crate) fn next_step(ctx: &ReplicaCtx) -> Next {
    let rest = ctx.pipe.rest_ns(ctx.stage);
    let step = ctx.me.take_batch(ctx.stage, rest);
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
        return Next::Run(step.batch.into_iter().map(|(_, w)| w).collect(), budget_ns);
    }
    if dropped {
        return Next::Again; // more may be queued behind the expired ones
    }
    Next::Wait(step.wait_until.map(|at| ctx.pipe.epoch + Duration::from_nanos(at)))
}

/// Whether a replica that is stopping or draining has finished its queue.
pub(crate) fn done_serving(ctx: &ReplicaCtx) -> bool {
    (ctx.stopping() || ctx.me.phase() == Phase::Draining) && ctx.me.queue_len() == 0
}

/// Feed the worker until the node stops, the replica is drained, or the
/// worker dies.
async fn serve(ctx: &mut ReplicaCtx, w: &mut Worker) -> Ended {
    let limit = ctx.stage().concurrency;
    if limit > 1 {
        return serve_concurrent(ctx, w, limit).await;
    }
    loop {
        let wake = match next_step(ctx) {
            Next::Run(batch, budget_ns) => {
                if let Err(why) = dispatch(ctx, w, batch, budget_ns).await {
                    return Ended::Died(why);
                }
                continue;
            }
            Next::Again => continue,
            Next::Wait(wake) => wake,
        };
        if done_serving(ctx) {
            return Ended::Stopped;
        }
        tokio::select! {
            _ = ctx.me.woken() => {}
            _ = ctx.stop.changed() => {}
            _ = sleep_until_opt(wake) => {}
            status = w.child.wait() => return Ended::Died(describe_exit(status)),
        }
    }
}

pub(crate) async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Move what waited for a dead worker to accepting replicas, if any (else
/// it waits here for the restart).
pub(crate) fn move_queue_elsewhere(ctx: &ReplicaCtx) {
    let stage = ctx.stage();
    if stage.choose(0, Some(&ctx.me)).is_none() {
        return;
    }
    let mut stay = Vec::new();
    for w in ctx.me.take_queue() {
        let enqueued = w.enqueued;
        if let Err(req) = stage.place(w.req, None, Some(&ctx.me)) {
            stay.push(Work { req, enqueued });
        }
    }
    ctx.me.requeue(stay);
}

/// A batch input: either a span of adjacent request tensors, or a gathered copy.
fn batch_input(arena: &Arena, parts: &[&TensorRef], keep: &mut Vec<Arc<Block>>) -> Result<TensorDesc, NodeError> {
    let first = parts[0];
    let rows: u64 = parts.iter().map(|t| t.rows()).sum();
    let mut shape = first.shape.clone();
    shape[0] = rows;
    let nbytes: u64 = parts.iter().map(|t| t.nbytes).sum();
    let adjacent = parts
        .windows(2)
        .all(|w| Arc::ptr_eq(w[0].block.pool(), w[1].block.pool()) && w[0].offset + w[0].nbytes == w[1].offset);
    if adjacent {
        return Ok(TensorDesc {
            pool: first.block.pool().id(),
            offset: first.offset,
            nbytes,
            dtype: first.dtype,
            shape,
        });
    }
    let mut block = arena.scratch_block(nbytes as usize)?;
    let dst = block.as_mut_slice();
    let mut at = 0;
    for t in parts {
        dst[at..at + t.nbytes as usize].copy_from_slice(t.bytes());
        at += t.nbytes as usize;
    }
    let block = Arc::new(block.freeze());
    CopyCounters::add(&arena.copies.gather, &arena.copies.gather_bytes, nbytes);
    let desc = TensorDesc { pool: block.pool().id(), offset: block.offset(), nbytes, dtype: first.dtype, shape };
    keep.push(block);
    Ok(desc)
}

/// Keep a copy of one request's inputs as the stage's warm-up sample, at
/// most every [`SAMPLE_EVERY`] (off the request path: after its batch).
fn maybe_sample(ctx: &ReplicaCtx, inputs: &Tensors) {
    let mut sample = ctx.stage().sample.lock();
    if sample.as_ref().is_none_or(|s| s.taken.elapsed() >= SAMPLE_EVERY) {
        *sample = Some(Sample::of(inputs));
    }
}

/// The tail shape and dtype of every input: requests can share a batch only
/// when these agree.
pub(crate) fn signature(inputs: &Tensors) -> Vec<(&str, slipstream_types::DType, &[u64])> {
    inputs.iter().map(|(n, t)| (n.as_str(), t.dtype, &t.shape[1..])).collect()
}

/// Each request's inputs to this stage, for the batch taken; requests
/// whose inputs do not match the first one's shapes go back to the queue
/// for the next batch. Also returns the batch's mean queue wait (ns).
pub(crate) fn members_of(ctx: &ReplicaCtx, batch: Vec<Work>) -> (Vec<(Arc<Request>, Tensors)>, u64) {
    let stage = ctx.stage();
    let now = Instant::now();
    let mut members: Vec<(Arc<Request>, Tensors)> = Vec::with_capacity(batch.len());
    let mut deferred = Vec::new();
    let waits: u64 = batch.iter().map(|w| now.duration_since(w.enqueued).as_nanos() as u64).sum();
    let mean_wait = waits / batch.len().max(1) as u64;
    for work in batch {
        stage.metrics.queue_wait_us.record(now.duration_since(work.enqueued).as_micros() as u64);
        match work.req.stage_inputs(ctx.stage) {
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
    (members, mean_wait)
}

/// A batch sent to the worker and not yet answered.
struct InFlight {
    id: u64,
    members: Vec<(Arc<Request>, Tensors)>,
    /// Gathered input copies, alive until the worker has answered.
    keep: Vec<Arc<Block>>,
    total_rows: u64,
    sent: Instant,
    budget_ns: u64,
}

/// Turn a batch taken from the queue into a frame for the worker; None if
/// no request is left to run (all failed or deferred).
fn prepare(ctx: &ReplicaCtx, batch: Vec<Work>, budget_ns: u64) -> Option<(ToWorker, InFlight)> {
    let stage = ctx.stage();
    let (members, mean_wait) = members_of(ctx, batch);
    if members.is_empty() {
        return None;
    }
    let rows: Vec<u32> = members.iter().map(|(_, i)| request_rows(i) as u32).collect();
    let total_rows: u64 = rows.iter().map(|&r| r as u64).sum();
    let mut keep = Vec::new();
    let mut inputs = BTreeMap::new();
    let names: Vec<String> = members[0].1.iter().map(|(n, _)| n.clone()).collect();
    for (k, name) in names.iter().enumerate() {
        let parts: Vec<&TensorRef> = members.iter().map(|(_, i)| &i[k].1).collect();
        match batch_input(&ctx.arena, &parts, &mut keep) {
            Ok(desc) => {
                inputs.insert(name.clone(), desc);
            }
            Err(e) => {
                let msg = e.to_string();
                fail_all(ctx.stage, members, |_| NodeError::Unavailable {
                    stage: stage.name.clone(),
                    reason: msg.clone(),
                });
                return None;
            }
        }
    }
    let id = next_batch_id();
    ctx.me.begin_batch(members.len(), mean_wait);
    let msg = ToWorker::Batch { id, rows, inputs };
    Some((msg, InFlight { id, members, keep, total_rows, sent: Instant::now(), budget_ns }))
}

/// Account a batch's round trip and hand each request its outputs (or its
/// error). A reply that is not this batch's answer is a protocol violation:
/// Err, and the caller treats the worker as gone.
fn settle(ctx: &ReplicaCtx, b: InFlight, reply: FromWorker) -> Result<(), String> {
    let stage = ctx.stage();
    let n = b.members.len();
    let rtt = b.sent.elapsed();
    ctx.me.end_batch(n, rtt.as_nanos() as u64, b.budget_ns);
    stage.metrics.batches.fetch_add(1, Relaxed);
    stage.metrics.requests.fetch_add(n as u64, Relaxed);
    stage.metrics.busy_us.fetch_add(rtt.as_micros() as u64, Relaxed);
    stage.metrics.batch_size.record(n as u64);
    match reply {
        FromWorker::Result { id: rid, outputs, compute_us, versions } if rid == b.id => {
            stage.metrics.compute_us.record(compute_us);
            stage.metrics.hop_us.record((rtt.as_micros() as u64).saturating_sub(compute_us));
            let worker_copies: Vec<u64> =
                outputs.values().filter(|o| o.origin == OutputOrigin::Copied).map(|o| o.desc.nbytes).collect();
            match split_outputs(ctx, &b.members, &b.keep, outputs, b.total_rows) {
                Ok(per_request) => {
                    for bytes in worker_copies {
                        CopyCounters::add(&ctx.arena.copies.worker, &ctx.arena.copies.worker_bytes, bytes);
                    }
                    maybe_sample(ctx, &b.members[0].1);
                    for ((req, _), outs) in b.members.into_iter().zip(per_request) {
                        if let (Some(cache), Some(key)) = (&stage.cache, req.cache_key(ctx.stage)) {
                            cache.put(key, &outs, &versions);
                        }
                        req.finish_stage(ctx.stage, outs);
                    }
                }
                Err(e) => {
                    stage.metrics.errors.fetch_add(n as u64, Relaxed);
                    let msg = e.to_string();
                    fail_all(ctx.stage, b.members, |_| NodeError::Component {
                        stage: stage.name.clone(),
                        message: msg.clone(),
                    });
                }
            }
            Ok(())
        }
        FromWorker::Error { id: rid, message, .. } if rid == b.id => {
            stage.metrics.errors.fetch_add(n as u64, Relaxed);
            fail_all(ctx.stage, b.members, |_| NodeError::Component {
                stage: stage.name.clone(),
                message: message.clone(),
            });
            Ok(())
        }
        other => {
            let why = format!("protocol violation: unexpected {other:?}");
            retry_or_fail(ctx, b.members, &why);
            Err(why)
        }
    }
}

/// A streaming component's chunk of a batch in flight: each request gets
/// its rows (see [`Request::push_chunk`]). A chunk that does not fit the
/// batch is dropped with its blocks (the batch's final result still
/// settles each request).
fn pass_chunk(ctx: &ReplicaCtx, b: &InFlight, outputs: BTreeMap<String, slipstream_transport::OutputDesc>) {
    match split_outputs(ctx, &b.members, &b.keep, outputs, b.total_rows) {
        Ok(per_request) => {
            for ((req, _), outs) in b.members.iter().zip(per_request) {
                req.push_chunk(ctx.stage, outs);
            }
        }
        Err(e) => ctx.event("bad_chunk", e.to_string()),
    }
}

/// Why the worker is gone, from a failed read or write and its exit status.
async fn gone(child: &mut tokio::process::Child, e: impl std::fmt::Display) -> String {
    match tokio::time::timeout(Duration::from_secs(1), child.wait()).await {
        Ok(s) => format!("{} ({e})", describe_exit(s)),
        Err(_) => e.to_string(),
    }
}

/// Run one batch on the worker. Err means the worker is gone.
async fn dispatch(ctx: &ReplicaCtx, w: &mut Worker, batch: Vec<Work>, budget_ns: u64) -> Result<(), String> {
    let Some((msg, b)) = prepare(ctx, batch, budget_ns) else {
        return Ok(());
    };
    match w.run(&msg, |outputs| pass_chunk(ctx, &b, outputs)).await {
        Ok(reply) => settle(ctx, b, reply),
        Err(e) => {
            let why = gone(&mut w.child, e).await;
            retry_or_fail(ctx, b.members, &why);
            Err(why)
        }
    }
}

/// Feed a worker that runs up to `limit` batches at once (an async
/// component): batches are written as soon as the batch step forms them
/// and there is room, and answers are matched to them by id, in whatever
/// order they come. Reading stays in one future for the whole loop, so a
/// half-read frame is never abandoned.
async fn serve_concurrent(ctx: &mut ReplicaCtx, w: &mut Worker, limit: usize) -> Ended {
    use std::collections::HashMap;
    let Worker { child, conn, buf } = w;
    let (mut rd, mut wr) = tokio::io::split(conn);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reader = async move {
        loop {
            let frame = read_frame::<_, FromWorker>(&mut rd, buf).await;
            let failed = frame.is_err();
            if tx.send(frame).is_err() || failed {
                return;
            }
        }
    };
    tokio::pin!(reader);
    let mut reader_done = false;
    let mut pending: HashMap<u64, InFlight> = HashMap::new();
    let died = |ctx: &ReplicaCtx, pending: &mut HashMap<u64, InFlight>, why: String| {
        for (_, b) in pending.drain() {
            retry_or_fail(ctx, b.members, &why);
        }
        Ended::Died(why)
    };
    loop {
        let mut wake = None;
        while pending.len() < limit {
            match next_step(ctx) {
                Next::Run(batch, budget_ns) => {
                    let Some((msg, b)) = prepare(ctx, batch, budget_ns) else { continue };
                    if let Err(e) = write_frame(&mut wr, &msg).await {
                        let why = gone(child, e).await;
                        retry_or_fail(ctx, b.members, &why);
                        return died(ctx, &mut pending, why);
                    }
                    pending.insert(b.id, b);
                }
                Next::Again => continue,
                Next::Wait(at) => {
                    wake = at;
                    break;
                }
            }
        }
        if pending.is_empty() && done_serving(ctx) {
            return Ended::Stopped;
        }
        let room = pending.len() < limit;
        tokio::select! {
            reply = rx.recv() => match reply {
                Some(Ok(FromWorker::Chunk { id, outputs })) => match pending.get(&id) {
                    Some(b) => pass_chunk(ctx, b, outputs),
                    None => return died(ctx, &mut pending, format!("protocol violation: a chunk of unknown batch {id}")),
                },
                Some(Ok(reply)) => {
                    let id = match &reply {
                        FromWorker::Result { id, .. } | FromWorker::Error { id, .. } => Some(*id),
                        _ => None,
                    };
                    match id.and_then(|id| pending.remove(&id)) {
                        Some(b) => {
                            if let Err(why) = settle(ctx, b, reply) {
                                return died(ctx, &mut pending, why);
                            }
                        }
                        None => return died(ctx, &mut pending, format!("protocol violation: unexpected {reply:?}")),
                    }
                }
                Some(Err(e)) => {
                    let why = gone(child, e).await;
                    return died(ctx, &mut pending, why);
                }
                None => return died(ctx, &mut pending, "the worker's connection closed".into()),
            },
            _ = &mut reader, if !reader_done => reader_done = true,
            _ = ctx.me.woken(), if room => {}
            _ = ctx.stop.changed() => {}
            _ = sleep_until_opt(wake), if room => {}
            status = child.wait() => {
                let why = describe_exit(status);
                return died(ctx, &mut pending, why);
            }
        }
    }
}

/// Fail this stage's work for each member (see [`Request::fail_stage`]).
pub(crate) fn fail_all(stage: usize, members: Vec<(Arc<Request>, Tensors)>, err: impl Fn(&Request) -> NodeError) {
    for (req, _) in members {
        let e = err(&req);
        req.fail_stage(stage, e);
    }
}

/// The worker died with this batch in flight: retry each request once on
/// another replica of the stage, else fail it with 503.
pub(crate) fn retry_or_fail(ctx: &ReplicaCtx, members: Vec<(Arc<Request>, Tensors)>, why: &str) {
    let stage = ctx.stage();
    ctx.me.worker_died();
    let fail = |req: Arc<Request>| {
        req.fail_stage(
            ctx.stage,
            NodeError::Unavailable {
                stage: stage.name.clone(),
                reason: format!("its worker died while running the request ({why})"),
            },
        )
    };
    for (req, _) in members {
        if req.retried.swap(true, Relaxed) {
            fail(req);
            continue;
        }
        // Only to a replica that serves now: waiting for a restart would
        // rarely fit the deadline, and a clear 503 lets the client decide.
        match stage.choose(req.id, Some(&ctx.me)) {
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

/// Turn the worker's batch outputs into per-request tensors.
fn split_outputs(
    ctx: &ReplicaCtx,
    members: &[(Arc<Request>, Tensors)],
    gathered: &[Arc<Block>],
    outputs: BTreeMap<String, slipstream_transport::OutputDesc>,
    total_rows: u64,
) -> Result<Vec<Tensors>, NodeError> {
    let me = &ctx.me;
    // Take ownership of every block the worker wrote before checking anything,
    // so that a rejected batch still frees them.
    let mut owned = Vec::with_capacity(outputs.len());
    for (name, out) in outputs {
        let block = match out.origin {
            OutputOrigin::Copied if out.desc.pool == me.pool.id() => {
                let len = usize::try_from(out.desc.nbytes)
                    .map_err(|_| NodeError::Internal(format!("output '{name}' claims {} bytes", out.desc.nbytes)))?;
                Some(Arc::new(Block::adopt(&me.pool, out.desc.offset, len)?))
            }
            OutputOrigin::Copied => {
                return Err(NodeError::Internal(format!("worker wrote output '{name}' outside its pool")))
            }
            OutputOrigin::Borrowed => None,
        };
        owned.push((name, out.desc, block));
    }
    // (name, whole-batch tensor, the pool it borrows from if it is an input's memory)
    let mut whole = Vec::with_capacity(owned.len());
    for (name, d, block) in owned {
        if !d.dtype.is_variable() && checked_nbytes(d.dtype, &d.shape) != Some(d.nbytes) {
            return Err(NodeError::Internal(format!(
                "output '{name}': {} bytes do not match shape {:?}",
                d.nbytes, d.shape
            )));
        }
        if d.shape.first() != Some(&total_rows) {
            return Err(NodeError::BadInput(format!(
                "output '{name}' has shape {:?}, but its first dimension must equal the batch's {total_rows} rows",
                d.shape
            )));
        }
        let (block, borrowed) = match block {
            Some(b) => (b, None),
            // Placeholder owner; each request's slice finds its real owner below.
            None => (members[0].1[0].1.block.clone(), Some(d.pool)),
        };
        whole.push((
            name,
            TensorRef { block, offset: d.offset, nbytes: d.nbytes, dtype: d.dtype, shape: d.shape },
            borrowed,
        ));
    }
    let rows: Vec<u64> = members.iter().map(|(_, inputs)| request_rows(inputs)).collect();
    let mut per_request: Vec<Tensors> = (0..members.len()).map(|_| Vec::with_capacity(whole.len())).collect();
    for (name, t, borrowed) in &whole {
        let parts = t.split_rows(&rows).ok_or_else(|| {
            NodeError::Internal(format!(
                "output '{name}' of {} bytes does not hold {:?} {} elements",
                t.nbytes, t.shape, t.dtype
            ))
        })?;
        for (i, mut part) in parts.into_iter().enumerate() {
            if let Some(pool) = *borrowed {
                part.block = find_owner(members, gathered, pool, &part).ok_or_else(|| {
                    NodeError::Internal(format!("output '{name}' borrows memory that is not an input of this batch"))
                })?;
            }
            per_request[i].push((name.clone(), part));
        }
    }
    Ok(per_request)
}

/// The block, among this batch's inputs, that holds `t`'s bytes entirely.
fn find_owner(
    members: &[(Arc<Request>, Tensors)],
    gathered: &[Arc<Block>],
    pool: u32,
    t: &TensorRef,
) -> Option<Arc<Block>> {
    let holds = |b: &Arc<Block>| {
        b.pool().id() == pool && b.offset() <= t.offset && t.offset + t.nbytes <= b.offset() + b.len() as u64
    };
    gathered
        .iter()
        .find(|b| holds(b))
        .cloned()
        .or_else(|| members.iter().flat_map(|(_, i)| i.iter()).map(|(_, x)| &x.block).find(|b| holds(b)).cloned())
}
