//! The data plane's two ends in the node.
//!
//! **Sending** (a remote replica's task, [`run_remote`]): a replica on
//! another node is a [`Replica`] here like any other. Its queue is this
//! node's (EDF, the batch step), so a batch for it forms exactly as for a
//! local worker; instead of a frame of descriptors to a worker process,
//! the batch goes out as one data-plane frame: each request's inputs in
//! order, the small ones merged into one buffer, the large ones sent
//! straight from shared memory with vectored writes. The reply's tensors
//! land in one block of this node's arena, and each request moves on
//! through its DAG here (the ingress keeps every request's state, so the
//! parts of a fan-in meet by construction). The replica learns its batch
//! latency including the network, which is what routing and admission
//! predict with.
//!
//! **Serving** ([`serve_call`]): a batch from another node is written
//! straight into this node's arena by the receiver; each request in it
//! becomes one stage's work ([`Request::for_stage`]) on this node's
//! replicas, queued by the same deadline as local work, and the answers go
//! back in one frame with this stage's load.
//!
//! A remote node that fails (connection lost, refused, or a reply that
//! does not come) takes its replica here down: the requests of the batch in
//! flight are retried once on another replica of the stage if one serves
//! (else they fail with 503), queued ones move to serving siblings, and the
//! replica comes back when the node reports ready again.

use super::{Cluster, View};
use crate::arena::{Arena, TensorRef, Tensors};
use crate::error::NodeError;
use crate::node::Node;
use crate::pipeline::Ticket;
use crate::replica::task::{
    done_serving, fail_all, leave, members_of, move_queue_elsewhere, next_step, retry_or_fail, sleep_until_opt, Next,
    ReplicaCtx,
};
use crate::replica::{Phase, Work};
use crate::request::{request_rows, Request};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use slipstream_peer::{InTensor, Incoming, OutTensor, Outgoing, PeerError};
use slipstream_shm::{Block, BlockMut};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Receive buffers are blocks of the node's arena (ingress pool).
pub struct ArenaAlloc(pub Arc<Arena>);

/// A block being filled by the data plane.
pub struct ArenaBuf(BlockMut);

impl AsMut<[u8]> for ArenaBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

impl slipstream_peer::Allocator for ArenaAlloc {
    type Buf = ArenaBuf;
    fn alloc(&self, nbytes: usize) -> Result<ArenaBuf, String> {
        // Counted as the ingress write it is (the one copy a network receive makes).
        self.0.ingress_block(nbytes.max(1)).map(ArenaBuf).map_err(|e| e.to_string())
    }
}

/// A tensor in shared memory, lent to the socket without a copy.
struct Lent(TensorRef);

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

fn lend(name: &str, t: &TensorRef) -> OutTensor {
    OutTensor {
        name: name.to_string(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        data: Bytes::from_owner(Lent(t.clone())),
    }
}

/// One request of a batch on the wire.
#[derive(Serialize, Deserialize)]
struct CallReq {
    /// Tensors of this request (the next `n` in the frame's table).
    n: u32,
    /// Time left to its deadline when sent, µs.
    budget_us: u64,
}

#[derive(Serialize, Deserialize)]
struct CallMeta {
    pipeline: String,
    stage: u32,
    reqs: Vec<CallReq>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "ok")]
enum ReqResult {
    /// Its outputs: the next `n` tensors of the reply.
    #[serde(rename = "true")]
    Ok { n: u32 },
    #[serde(rename = "false")]
    Err { kind: String, message: String },
}

#[derive(Serialize, Deserialize, Default)]
struct ReplyMeta {
    results: Vec<ReqResult>,
    /// Requests queued at or running on the stage's replicas there when the
    /// batch was answered, per replica: the load report routing and
    /// admission at the sender add to the remote replica's own queue.
    #[serde(default)]
    outstanding: u32,
}

/// The tensors of an incoming frame, split per request (`counts[i]` each),
/// as references into the one block they were received in.
fn split_incoming(
    block: Arc<Block>,
    tensors: Vec<InTensor>,
    counts: impl Iterator<Item = u32>,
) -> Result<Vec<Tensors>, String> {
    let mut it = tensors.into_iter();
    let mut out = Vec::new();
    for n in counts {
        let mut one = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let t = it.next().ok_or("the frame holds fewer tensors than its requests name")?;
            let offset = block.offset().checked_add(t.offset).ok_or("tensor offset overflows")?;
            one.push((
                t.name,
                TensorRef { block: block.clone(), offset, nbytes: t.nbytes, dtype: t.dtype, shape: t.shape },
            ));
        }
        out.push(one);
    }
    if it.next().is_some() {
        return Err("the frame holds more tensors than its requests name".into());
    }
    Ok(out)
}

/// Rebuild an error that crossed the data plane.
fn error_from(kind: &str, message: String, stage: &str) -> NodeError {
    let stage = stage.to_string();
    match kind {
        "deadline_exceeded" => NodeError::DeadlineExceeded { stage },
        "component_error" => NodeError::Component { stage, message },
        "bad_input" => NodeError::BadInput(message),
        _ => NodeError::Unavailable { stage, reason: message },
    }
}

/// Fails a stage request that is still running when its caller goes away.
struct StageCall(Arc<Request>);

impl Drop for StageCall {
    fn drop(&mut self) {
        self.0.fail(NodeError::Cancelled);
    }
}

/// Run a batch another node sent: every request as one stage's work here.
pub async fn serve_call(node: Arc<Node>, from: String, inc: Incoming<ArenaBuf>) -> Outgoing {
    let meta: CallMeta = match serde_json::from_slice(&inc.meta) {
        Ok(m) => m,
        Err(e) => return Outgoing::error(format!("malformed call from {from}: {e}")),
    };
    let Ok(pipe) = node.pipeline(&meta.pipeline) else {
        return Outgoing::error(format!("no pipeline '{}' here", meta.pipeline));
    };
    let Some(stage) = pipe.stages.get(meta.stage as usize) else {
        return Outgoing::error(format!("pipeline '{}' has no stage {}", meta.pipeline, meta.stage));
    };
    if node.is_draining() {
        return Outgoing::error("the node is shutting down");
    }
    let block = Arc::new(inc.payload.0.freeze());
    let per_req = match split_incoming(block, inc.tensors, meta.reqs.iter().map(|r| r.n)) {
        Ok(p) => p,
        Err(e) => return Outgoing::error(e),
    };
    if let Some(c) = node.cluster() {
        c.counters.served_batches.fetch_add(1, Relaxed);
    }
    let now = Instant::now();
    let mut waits = Vec::with_capacity(per_req.len());
    for (r, inputs) in meta.reqs.iter().zip(per_req) {
        let rid = node.next_request_id();
        let Some(first) = stage.local_target(rid) else {
            waits.push(Err(NodeError::Unavailable { stage: stage.name.clone(), reason: "no replica here".into() }));
            continue;
        };
        let deadline = now + Duration::from_micros(r.budget_us.min(3_600_000_000));
        let ticket = Ticket { id: rid, arrival: now, deadline, route: vec![first; pipe.stages.len()] };
        let (req, rx) = Request::for_stage(pipe.clone(), stage.index, inputs, ticket);
        waits.push(Ok((StageCall(req), rx, deadline)));
    }
    let mut results = Vec::with_capacity(waits.len());
    let mut tensors = Vec::new();
    for w in waits {
        let outcome = match w {
            Err(e) => Err(e),
            Ok((call, rx, deadline)) => {
                let give_up = deadline.max(now + pipe.timeout.min(Duration::from_secs(3600)));
                let r = match tokio::time::timeout_at(give_up.into(), rx).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => Err(NodeError::Internal("the stage dropped the request".into())),
                    Err(_) => Err(NodeError::DeadlineExceeded { stage: stage.name.clone() }),
                };
                drop(call); // releases the request if it is still queued
                r
            }
        };
        match outcome {
            Ok(outs) => {
                results.push(ReqResult::Ok { n: outs.len() as u32 });
                tensors.extend(outs.iter().map(|(n, t)| lend(n, t)));
            }
            Err(e) => results.push(ReqResult::Err { kind: e.kind().to_string(), message: e.to_string() }),
        }
    }
    let set = stage.replicas();
    let local = set.iter().filter(|r| r.is_local());
    let live = local.clone().filter(|r| r.phase() == Phase::Ready).count().max(1);
    let outstanding: u32 = local.map(|r| r.load().outstanding).sum();
    let meta = ReplyMeta { results, outstanding: outstanding / live as u32 };
    Outgoing::reply(serde_json::to_vec(&meta).expect("serialises"), tensors)
}

/// The shortest wait for a remote batch before its node counts as failed.
const MIN_PATIENCE: Duration = Duration::from_millis(250);

/// A node that failed here is probed again after this long.
const PROBE_AFTER: Duration = Duration::from_millis(500);

/// Whether `at` answers an empty call for the stage within a moment.
async fn probe(cluster: &Cluster, at: &crate::replica::RemoteAt, pipeline: &str, stage: usize) -> bool {
    let meta = CallMeta { pipeline: pipeline.to_string(), stage: stage as u32, reqs: Vec::new() };
    let msg = Outgoing::call(serde_json::to_vec(&meta).expect("serialises"), Vec::new());
    cluster.peers.call(at.addr, msg, PROBE_AFTER).await.is_ok()
}

/// Drive a replica that lives on another node until it is drained or the
/// node stops (see the module docs).
pub async fn run_remote(mut ctx: ReplicaCtx, cluster: Arc<Cluster>) {
    let at = ctx.me.remote.clone().expect("a remote replica");
    let key = ctx.pipe.stage_key(ctx.stage);
    let mut view = cluster.view.subscribe();
    let mut backoff = Duration::from_millis(100);
    loop {
        if !ctx.me.phase().will_serve() || ctx.stopping() {
            break;
        }
        // Wait until its node serves the stage (probing it, if it failed here).
        if !view.borrow_and_update().serves(&at.node, &key) {
            if cluster.suspected_since(&at.node).is_some_and(|t| t.elapsed() >= PROBE_AFTER)
                && probe(&cluster, &at, ctx.pipe.name(), ctx.stage).await
            {
                cluster.clear_suspect(&at.node);
                continue;
            }
            tokio::select! {
                _ = view.changed() => {}
                _ = ctx.stop.changed() => {}
                _ = ctx.me.woken() => {}
                _ = tokio::time::sleep(PROBE_AFTER) => {}
            }
            continue;
        }
        if ctx.me.worker_ready(0) == Some(Phase::Ready) {
            ctx.event("ready", format!("on node {} ({})", at.node, at.addr));
        }
        match serve_remote(&mut ctx, &cluster, &mut view, &key).await {
            Ok(()) => break,
            Err(why) => {
                ctx.me.worker_died();
                ctx.event("died", format!("node {}: {why}", at.node));
                move_queue_elsewhere(&ctx);
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = ctx.stop.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
    leave(&ctx);
}

/// Send batches until drained (Ok) or the remote node fails (Err), or
/// stops reporting stage `key` ready in the cluster's `view`.
async fn serve_remote(
    ctx: &mut ReplicaCtx,
    cluster: &Cluster,
    view: &mut watch::Receiver<Arc<View>>,
    key: &str,
) -> Result<(), String> {
    let at = ctx.me.remote.clone().expect("remote");
    loop {
        let wake = match next_step(ctx) {
            Next::Run(batch, budget_ns) => {
                send_batch(ctx, cluster, batch, budget_ns).await?;
                continue;
            }
            Next::Again => continue,
            Next::Wait(wake) => wake,
        };
        if done_serving(ctx) {
            return Ok(());
        }
        if ctx.me.phase() == Phase::Down {
            return Err("its node stopped serving the stage".into());
        }
        tokio::select! {
            _ = ctx.me.woken() => {}
            _ = ctx.stop.changed() => {}
            _ = sleep_until_opt(wake) => {}
            _ = view.changed() => {
                if !view.borrow().serves(&at.node, key) && ctx.me.phase() == Phase::Ready {
                    return Err("its node no longer reports the stage ready".into());
                }
            }
        }
    }
}

/// One batch to the remote replica and back. Err: the node failed (the
/// batch's requests were retried or failed).
async fn send_batch(ctx: &ReplicaCtx, cluster: &Cluster, batch: Vec<Work>, budget_ns: u64) -> Result<(), String> {
    let stage = ctx.stage();
    let now = Instant::now();
    let (members, mean_wait) = members_of(ctx, batch);
    if members.is_empty() {
        return Ok(());
    }
    let n = members.len();
    let mut tensors = Vec::new();
    let mut reqs = Vec::with_capacity(n);
    let mut latest = now;
    for (req, inputs) in &members {
        reqs.push(CallReq {
            n: inputs.len() as u32,
            budget_us: req.deadline.saturating_duration_since(now).as_micros() as u64,
        });
        latest = latest.max(req.deadline);
        tensors.extend(inputs.iter().map(|(name, t)| lend(name, t)));
    }
    let meta = CallMeta { pipeline: ctx.pipe.name().to_string(), stage: ctx.stage as u32, reqs };
    let msg = Outgoing::call(serde_json::to_vec(&meta).expect("serialises"), tensors);
    let at = ctx.me.remote.clone().expect("remote");
    // Give the node until the last deadline (or the request timeout) plus
    // a margin to answer; it answers late requests itself.
    let wait = latest.saturating_duration_since(now).max(Duration::from_millis(1)).min(ctx.pipe.timeout)
        + Duration::from_secs(2);
    cluster.counters.sent_batches.fetch_add(1, Relaxed);
    cluster.counters.sent_requests.fetch_add(n as u64, Relaxed);
    let expected = Duration::from_nanos(ctx.me.begin_batch(n, mean_wait));
    // A node that does not answer within a few times the batch's expected
    // latency is taken for partitioned: its requests are retried elsewhere
    // rather than left to wait for their deadline.
    let patience = (expected * 4 + Duration::from_millis(100)).max(MIN_PATIENCE).min(wait);
    let sent = Instant::now();
    let reply = cluster.peers.call(at.addr, msg, patience).await;
    let rtt = sent.elapsed();
    ctx.me.end_batch(n, rtt.as_nanos() as u64, budget_ns);
    stage.metrics.batches.fetch_add(1, Relaxed);
    stage.metrics.requests.fetch_add(n as u64, Relaxed);
    stage.metrics.batch_size.record(n as u64);
    let inc = match reply {
        Ok(inc) => inc,
        Err(PeerError::Remote(why)) => {
            // The node refused the whole batch (shutting down, say): elsewhere.
            let why = format!("node {}: {why}", at.node);
            retry_or_fail(ctx, members, &why);
            return Err(why);
        }
        Err(PeerError::Alloc(why)) => {
            fail_all(ctx.stage, members, |_| NodeError::Unavailable { stage: stage.name.clone(), reason: why.clone() });
            return Ok(());
        }
        Err(e) => {
            let why = format!("node {} failed: {e}", at.node);
            cluster.suspect(&at.node, &e.to_string());
            cluster.counters.retried.fetch_add(n as u64, Relaxed);
            retry_or_fail(ctx, members, &why);
            return Err(why);
        }
    };
    stage.metrics.hop_us.record(rtt.as_micros() as u64);
    let meta: ReplyMeta = match serde_json::from_slice(&inc.meta) {
        Ok(m) => m,
        Err(e) => {
            let why = format!("node {} sent a malformed reply: {e}", at.node);
            fail_all(ctx.stage, members, |_| NodeError::Internal(why.clone()));
            return Ok(());
        }
    };
    ctx.me.set_backlog(meta.outstanding);
    if meta.results.len() != n {
        let why = format!("node {} answered {} of {n} requests", at.node, meta.results.len());
        fail_all(ctx.stage, members, |_| NodeError::Internal(why.clone()));
        return Ok(());
    }
    let counts = meta.results.iter().map(|r| match r {
        ReqResult::Ok { n } => *n,
        ReqResult::Err { .. } => 0,
    });
    let block = Arc::new(inc.payload.0.freeze());
    let outs = match split_incoming(block, inc.tensors, counts) {
        Ok(o) => o,
        Err(e) => {
            fail_all(ctx.stage, members, |_| NodeError::Internal(e.clone()));
            return Ok(());
        }
    };
    for (((req, inputs), result), outputs) in members.into_iter().zip(meta.results).zip(outs) {
        match result {
            ReqResult::Ok { .. } => {
                if outputs.iter().any(|(_, t)| t.rows() != request_rows(&inputs)) {
                    req.fail(NodeError::Internal("a remote output's rows do not match its request".into()));
                } else {
                    req.finish_stage(ctx.stage, outputs);
                }
            }
            ReqResult::Err { kind, message } => {
                if kind == "component_error" {
                    stage.metrics.errors.fetch_add(1, Relaxed);
                }
                // No replica there any more (the placement moved it): once elsewhere.
                let elsewhere =
                    matches!(kind.as_str(), "unavailable" | "shutting_down") && !req.retried.swap(true, Relaxed);
                match elsewhere.then(|| stage.choose(req.id, Some(&ctx.me))).flatten() {
                    Some(r) => {
                        if let Err(req) = r.push(req) {
                            req.fail(error_from(&kind, message, &stage.name));
                        }
                    }
                    None => req.fail(error_from(&kind, message, &stage.name)),
                }
            }
        }
    }
    Ok(())
}
