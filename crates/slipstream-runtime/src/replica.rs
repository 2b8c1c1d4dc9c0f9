//! One task per stage replica: it owns the replica's worker process and feeds
//! it batches.
//!
//! The loop is deliberately sequential: a worker runs one batch at a time
//! (it is one Python process), so the task waits for work, forms a batch
//! from the replica's queue (opportunistic batching: take what is waiting,
//! most urgent first, up to the stage's max batch size), sends one frame of
//! descriptors, reads one frame back, and hands each request its outputs.
//! While the worker computes, new requests pile up in the queue and form the
//! next batch.
//!
//! Supervision lives here too: if the worker dies, the requests of its
//! in-flight batch are retried once on another healthy replica of the stage
//! or fail with 503; queued requests move to healthy replicas; the worker is
//! restarted with exponential back-off.

use crate::arena::{Arena, CopyCounters, TensorRef, Tensors};
use crate::error::NodeError;
use crate::pipeline::{request_rows, PipelineRt, Replica, Request, Work};
use slipstream_sched::{choose_replica, Decision, Policy};
use slipstream_shm::Block;
use slipstream_transport::{read_frame, write_frame, FromWorker, OutputOrigin, ToWorker};
use slipstream_types::{numel, TensorDesc};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};
use tokio::sync::{oneshot, watch};

/// How to start workers; shared by all replicas.
pub struct Launch {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub socket_dir: PathBuf,
    pub start_timeout: Duration,
}

/// Everything a replica task needs.
pub struct ReplicaCtx {
    pub pipe: Arc<PipelineRt>,
    pub stage: usize,
    pub replica: usize,
    pub arena: Arc<Arena>,
    pub launch: Arc<Launch>,
    /// Becomes true when the node has drained and workers should exit.
    pub stop: watch::Receiver<bool>,
}

static BATCH_IDS: AtomicU64 = AtomicU64::new(1);

struct Worker {
    child: Child,
    conn: UnixStream,
    buf: Vec<u8>,
}

enum Ended {
    Stopped,
    Died(String),
}

impl ReplicaCtx {
    fn me(&self) -> &Arc<Replica> {
        &self.pipe.stages[self.stage].replicas[self.replica]
    }

    fn stage_name(&self) -> &str {
        &self.pipe.stages[self.stage].name
    }

    fn label(&self) -> String {
        format!("{}/{}[{}]", self.pipe.name(), self.stage_name(), self.replica)
    }
}

/// Run a replica until the node stops. `first_start` learns whether the
/// first worker came up (so start-up can fail loudly on a broken component).
pub async fn run(mut ctx: ReplicaCtx, first_start: oneshot::Sender<Result<(), String>>) {
    let mut first_start = Some(first_start);
    let mut backoff = Duration::from_millis(100);
    loop {
        let started = spawn_worker(&ctx).await;
        let mut worker = match started {
            Ok(w) => {
                if let Some(tx) = first_start.take() {
                    let _ = tx.send(Ok(()));
                }
                backoff = Duration::from_millis(100);
                w
            }
            Err(e) => {
                if let Some(tx) = first_start.take() {
                    let _ = tx.send(Err(e));
                    return;
                }
                eprintln!("slipstream: {} failed to restart: {e}", ctx.label());
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = ctx.stop.changed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        let me = ctx.me().clone();
        me.pid.store(worker.child.id().unwrap_or(0) as usize, Relaxed);
        me.healthy.store(true, Relaxed);
        let ended = serve(&mut ctx, &mut worker).await;
        me.healthy.store(false, Relaxed);
        match ended {
            Ended::Stopped => {
                let _ = write_frame(&mut worker.conn, &ToWorker::Shutdown).await;
                if tokio::time::timeout(Duration::from_secs(5), worker.child.wait()).await.is_err() {
                    let _ = worker.child.kill().await;
                }
                return;
            }
            Ended::Died(why) => {
                let _ = worker.child.kill().await;
                eprintln!("slipstream: worker {} died ({why}); restarting", ctx.label());
                ctx.pipe.stages[ctx.stage].metrics.restarts.fetch_add(1, Relaxed);
                move_queue_elsewhere(&ctx);
            }
        }
    }
}

fn describe_exit(status: std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    }
}

async fn spawn_worker(ctx: &ReplicaCtx) -> Result<Worker, String> {
    let launch = &ctx.launch;
    let me = ctx.me();
    let sock = launch.socket_dir.join(format!("{}-{}-{}.sock", ctx.pipe.name(), ctx.stage, ctx.replica));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(|e| format!("cannot bind {}: {e}", sock.display()))?;
    let (exe, args) = launch.argv.split_first().ok_or("empty worker command")?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .arg("--pipeline")
        .arg(ctx.pipe.name())
        .arg("--stage")
        .arg(ctx.stage_name())
        .arg("--replica")
        .arg(ctx.replica.to_string())
        .arg("--connect")
        .arg(&sock)
        .arg("--pool-prefix")
        .arg(ctx.arena.path_prefix())
        .arg("--pool")
        .arg(me.pool.id().to_string())
        .envs(&launch.env)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| format!("cannot start worker `{exe}`: {e}"))?;
    let deadline = tokio::time::Instant::now() + launch.start_timeout;
    let conn = tokio::select! {
        r = tokio::time::timeout_at(deadline, listener.accept()) => match r {
            Ok(Ok((conn, _))) => conn,
            Ok(Err(e)) => return Err(format!("accept failed: {e}")),
            Err(_) => return Err(format!("worker did not connect within {:?}", launch.start_timeout)),
        },
        status = child.wait() => return Err(format!("worker exited before connecting ({})", describe_exit(status))),
    };
    let _ = std::fs::remove_file(&sock);
    let mut w = Worker { child, conn, buf: Vec::new() };
    let hello = tokio::select! {
        r = tokio::time::timeout_at(deadline, read_frame::<_, FromWorker>(&mut w.conn, &mut w.buf)) => r,
        status = w.child.wait() => return Err(format!("worker exited while starting ({})", describe_exit(status))),
    };
    match hello {
        Ok(Ok(FromWorker::Ready { .. })) => Ok(w),
        Ok(Ok(FromWorker::Fatal { message })) => {
            let _ = w.child.wait().await;
            Err(message)
        }
        Ok(Ok(other)) => Err(format!("worker sent {other:?} before ready")),
        Ok(Err(e)) => {
            let status = tokio::time::timeout(Duration::from_secs(2), w.child.wait()).await;
            Err(format!("worker failed while starting: {e} ({})", status.map(describe_exit).unwrap_or_default()))
        }
        Err(_) => Err(format!("worker was not ready within {:?}", launch.start_timeout)),
    }
}

/// Feed the worker until the node stops or the worker dies.
async fn serve(ctx: &mut ReplicaCtx, w: &mut Worker) -> Ended {
    let me = ctx.me().clone();
    loop {
        let step = form_batch(ctx, &me);
        if !step.batch.is_empty() {
            if let Err(why) = dispatch(ctx, w, step.batch, step.budget_ns).await {
                return Ended::Died(why);
            }
            continue;
        }
        if step.dropped {
            continue; // more may be queued behind the expired ones
        }
        if *ctx.stop.borrow() && me.queue_len() == 0 {
            return Ended::Stopped;
        }
        let wake = step.wait_until.map(|at| ctx.pipe.epoch + Duration::from_nanos(at));
        tokio::select! {
            _ = me.notify.notified() => {}
            _ = ctx.stop.changed() => {}
            _ = sleep_until_opt(wake) => {}
            status = w.child.wait() => return Ended::Died(describe_exit(status)),
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// What the batch former decided: a batch to run now (possibly empty), and
/// when to look again if it chose to wait.
struct Step {
    batch: Vec<Work>,
    wait_until: Option<u64>,
    /// Expired requests were dropped: look at the queue again at once.
    dropped: bool,
    /// Slack of the batch's most urgent request (for AIMD).
    budget_ns: u64,
}

/// Ask the batch former what to run, drop the requests it found expired,
/// and put back what waits.
fn form_batch(ctx: &ReplicaCtx, me: &Replica) -> Step {
    let pipe = &ctx.pipe;
    let stage = &pipe.stages[ctx.stage];
    let now = pipe.now_ns();
    let rest = pipe.rest_ns(ctx.stage);
    let (expired, batch, wait_until) = {
        let mut q = me.queue.lock();
        let former = me.former.lock();
        let limit = match former.policy {
            Policy::Fixed { .. } => former.max_batch,
            Policy::DeadlineAware => former.limit,
        } as usize;
        let mut cand: Vec<(u64, Work)> = Vec::with_capacity(limit.min(q.len()));
        let mut skipped = 0;
        while cand.len() < limit {
            match q.pop() {
                Some((_, w)) if w.req.is_done() => skipped += 1,
                Some(x) => cand.push(x),
                None => break,
            }
        }
        me.release(skipped);
        let deadlines: Vec<u64> = cand.iter().map(|(d, _)| *d).collect();
        let oldest = cand.iter().map(|(_, w)| w.enqueued.saturating_duration_since(pipe.epoch).as_nanos() as u64).min();
        let (expired, n, wait_until) = match former.decide(now, &deadlines, oldest.unwrap_or(now), rest) {
            Decision::Dispatch { expired, n } => (expired, n, None),
            Decision::WaitUntil { expired, at } => (expired, 0, Some(at)),
        };
        let mut rest_of = cand.split_off(expired);
        let waiting = rest_of.split_off(n.min(rest_of.len()));
        for (d, w) in waiting {
            q.push(d, w);
        }
        (cand, rest_of, wait_until)
    };
    let dropped = !expired.is_empty();
    if dropped {
        me.release(expired.len());
        stage.metrics.dropped_late.fetch_add(expired.len() as u64, Relaxed);
        for (_, w) in expired {
            w.req.fail(NodeError::DeadlineExceeded { stage: stage.name.clone() });
        }
    }
    let budget_ns = batch.first().map_or(u64::MAX, |(d, _)| d.saturating_sub(now + rest));
    if let Some((d, _)) = batch.first() {
        stage.metrics.slack_us.record(d.saturating_sub(now) / 1_000);
    }
    Step { batch: batch.into_iter().map(|(_, w)| w).collect(), wait_until, dropped, budget_ns }
}

/// Requeue what waited for a dead worker onto healthy replicas, if any.
fn move_queue_elsewhere(ctx: &ReplicaCtx) {
    let stage = &ctx.pipe.stages[ctx.stage];
    if !stage.replicas.iter().any(|r| r.healthy.load(Relaxed)) {
        return; // nowhere better: they wait for the restart
    }
    let drained = ctx.me().queue.lock().drain();
    ctx.me().release(drained.len());
    for (_, work) in drained {
        if let Some(r) = choose_replica(&stage.loads(), work.req.id) {
            stage.replicas[r].push(work.req, ctx.pipe.epoch);
        }
    }
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
    let block = Arc::new(Block::alloc(&arena.ingress(), nbytes as usize)?);
    let dst = block.as_mut_slice();
    let mut at = 0;
    for t in parts {
        dst[at..at + t.nbytes as usize].copy_from_slice(t.bytes());
        at += t.nbytes as usize;
    }
    CopyCounters::add(&arena.copies.gather, &arena.copies.gather_bytes, nbytes);
    let desc = TensorDesc { pool: block.pool().id(), offset: block.offset(), nbytes, dtype: first.dtype, shape };
    keep.push(block);
    Ok(desc)
}

/// The tail shape and dtype of every input: requests can share a batch only
/// when these agree.
fn signature(inputs: &Tensors) -> Vec<(&str, slipstream_types::DType, &[u64])> {
    inputs.iter().map(|(n, t)| (n.as_str(), t.dtype, &t.shape[1..])).collect()
}

/// Run one batch on the worker. Err means the worker is gone.
async fn dispatch(ctx: &ReplicaCtx, w: &mut Worker, batch: Vec<Work>, budget_ns: u64) -> Result<(), String> {
    let stage = &ctx.pipe.stages[ctx.stage];
    let me = ctx.me();
    let now = Instant::now();
    // Gather each request's inputs; requests whose inputs do not match the
    // first one's shapes go back to the queue for the next batch.
    let mut members: Vec<(Arc<Request>, Tensors)> = Vec::with_capacity(batch.len());
    let mut deferred = Vec::new();
    let waits: u64 = batch.iter().map(|w| now.duration_since(w.enqueued).as_nanos() as u64).sum();
    me.observe_wait(waits / batch.len().max(1) as u64);
    for work in batch {
        stage.metrics.queue_wait_us.record(now.duration_since(work.enqueued).as_micros() as u64);
        match work.req.stage_inputs(ctx.stage) {
            Ok(inputs) => {
                if let Some((_, first)) = members.first() {
                    if signature(first) != signature(&inputs) {
                        deferred.push(work.req);
                        continue;
                    }
                }
                members.push((work.req, inputs));
            }
            Err(e) => {
                me.release(1);
                work.req.fail(e);
            }
        }
    }
    for req in deferred {
        me.release(1);
        me.push(req, ctx.pipe.epoch);
    }
    if members.is_empty() {
        return Ok(());
    }
    let n = members.len();
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
                finish_all(me, members, |_| NodeError::Unavailable { stage: stage.name.clone(), reason: msg.clone() });
                return Ok(());
            }
        }
    }
    let id = BATCH_IDS.fetch_add(1, Relaxed);
    let sent = Instant::now();
    me.busy_predicted_ns.store(me.former.lock().mean_ns(n), Relaxed);
    me.busy_since_ns.store(ctx.pipe.now_ns().max(1), Relaxed);
    let msg = ToWorker::Batch { id, rows: rows.clone(), inputs };
    let reply = match write_frame(&mut w.conn, &msg).await {
        Ok(()) => read_frame::<_, FromWorker>(&mut w.conn, &mut w.buf).await,
        Err(e) => Err(e),
    };
    let rtt = sent.elapsed();
    me.busy_since_ns.store(0, Relaxed);
    me.former.lock().on_batch_done(n, rtt.as_nanos() as u64, budget_ns);
    me.last_batch.store(n, Relaxed);
    stage.metrics.batches.fetch_add(1, Relaxed);
    stage.metrics.requests.fetch_add(n as u64, Relaxed);
    stage.metrics.batch_size.record(n as u64);
    match reply {
        Ok(FromWorker::Result { id: rid, outputs, compute_us }) if rid == id => {
            stage.metrics.compute_us.record(compute_us);
            stage.metrics.hop_us.record((rtt.as_micros() as u64).saturating_sub(compute_us));
            let worker_copies: Vec<u64> =
                outputs.values().filter(|o| o.origin == OutputOrigin::Copied).map(|o| o.desc.nbytes).collect();
            match split_outputs(ctx, &members, &keep, outputs, total_rows) {
                Ok(per_request) => {
                    for b in worker_copies {
                        CopyCounters::add(&ctx.arena.copies.worker, &ctx.arena.copies.worker_bytes, b);
                    }
                    me.release(n);
                    for ((req, _), outs) in members.into_iter().zip(per_request) {
                        req.finish_stage(ctx.stage, outs);
                    }
                }
                Err(e) => {
                    stage.metrics.errors.fetch_add(n as u64, Relaxed);
                    let msg = e.to_string();
                    finish_all(me, members, |_| NodeError::Component {
                        stage: stage.name.clone(),
                        message: msg.clone(),
                    });
                }
            }
            Ok(())
        }
        Ok(FromWorker::Error { id: rid, message, .. }) if rid == id => {
            stage.metrics.errors.fetch_add(n as u64, Relaxed);
            finish_all(me, members, |_| NodeError::Component { stage: stage.name.clone(), message: message.clone() });
            Ok(())
        }
        Ok(other) => {
            let why = format!("protocol violation: unexpected {other:?}");
            retry_or_fail(ctx, members, &why);
            Err(why)
        }
        Err(e) => {
            let status = tokio::time::timeout(Duration::from_secs(1), w.child.wait()).await;
            let why = match status {
                Ok(s) => format!("{} ({e})", describe_exit(s)),
                Err(_) => e.to_string(),
            };
            retry_or_fail(ctx, members, &why);
            Err(why)
        }
    }
}

fn finish_all(me: &Replica, members: Vec<(Arc<Request>, Tensors)>, err: impl Fn(&Request) -> NodeError) {
    me.release(members.len());
    for (req, _) in members {
        let e = err(&req);
        req.fail(e);
    }
}

/// The worker died with this batch in flight: retry each request once on
/// another healthy replica of the stage, else fail it with 503.
fn retry_or_fail(ctx: &ReplicaCtx, members: Vec<(Arc<Request>, Tensors)>, why: &str) {
    let stage = &ctx.pipe.stages[ctx.stage];
    let me = ctx.me();
    me.healthy.store(false, Relaxed);
    me.release(members.len());
    for (req, _) in members {
        let target = choose_replica(&stage.loads(), req.id).filter(|&r| r != ctx.replica);
        match target {
            Some(r) if !req.retried.swap(true, Relaxed) => {
                stage.metrics.retries.fetch_add(1, Relaxed);
                stage.replicas[r].push(req, ctx.pipe.epoch);
            }
            _ => req.fail(NodeError::Unavailable {
                stage: stage.name.clone(),
                reason: format!("its worker died while running the request ({why})"),
            }),
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
    let me = ctx.me();
    // Take ownership of every block the worker wrote before checking anything,
    // so that a rejected batch still frees them.
    let mut owned = Vec::with_capacity(outputs.len());
    for (name, out) in outputs {
        let block = match out.origin {
            OutputOrigin::Copied if out.desc.pool == me.pool.id() => {
                Some(Arc::new(Block::adopt(&me.pool, out.desc.offset, out.desc.nbytes as usize)?))
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
        let expect = numel(&d.shape) * d.dtype.size() as u64;
        if !d.dtype.is_variable() && d.nbytes != expect {
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
