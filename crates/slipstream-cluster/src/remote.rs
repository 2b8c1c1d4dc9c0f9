//! Replicas on other nodes, driven from here: a replica placed on another
//! node is a [`slipstream_core::replica::Replica`] on this node like any
//! other. Its queue is this node's (EDF, the batch step, the same
//! [`drive`] loop as a local worker's), so a batch for it forms exactly as
//! for a local worker; its [`Backend`] sends the batch as one data-plane
//! frame instead of a frame of descriptors to a worker process. The
//! reply's tensors land in one block of this node's arena, and each request
//! moves on through its DAG here (the ingress keeps every request's state,
//! so the parts of a fan-in meet by construction). The replica learns its
//! batch latency including the network, which is what routing and
//! admission predict with.
//!
//! A remote node that fails (connection lost, refused, or a reply that
//! does not come while another replica could take the batch) takes its
//! replica here down: the requests of the batch in flight are retried once
//! on another replica of the stage if one serves (else they fail with
//! 503), queued ones move to serving siblings, and the replica comes back
//! when the node reports ready again (or answers a probe).
//!
//! A standby on another node is a remote standby here: held back from
//! routing like a local one, it stands in when no replica of the stage
//! serves (its node's only one was lost, say), and the other node runs
//! the work on its warm standby worker. So losing the node of a stage's
//! only replica costs the batch in flight a retry, not seconds of 503s
//! until the lease expires and a replica starts elsewhere.

use crate::handoff::Opened;
use crate::wire::{
    error_from, lend_all, split_incoming, ArenaBuf, CallMeta, CallReq, Hop, Ingress, PartMeta, ReplyMeta, ReqResult,
};
use crate::{Cluster, View};
use slipstream_core::drive::{drive, Backend, Batch, Outcome, ReplicaCtx, Reply, Running, Started};
use slipstream_core::drive::{FirstStart, Launcher, ReplicaTask};
use slipstream_core::replica::{Job, Phase, RemoteAt};
use slipstream_core::NodeError;
use slipstream_peer::{Incoming, Outgoing, PeerError};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// The shortest wait for a remote batch before its node counts as failed.
const MIN_PATIENCE: Duration = Duration::from_millis(250);

/// A node that failed here is probed again after this long.
const PROBE_AFTER: Duration = Duration::from_millis(500);

/// Drives the replicas that stand for ones on other nodes.
pub(crate) struct RemoteLauncher(pub(crate) Arc<Cluster>);

impl Launcher for RemoteLauncher {
    fn launch(&self, ctx: ReplicaCtx, first_start: Option<FirstStart>) -> ReplicaTask {
        let at = ctx.replica().remote.clone().expect("a remote replica");
        let backend = RemoteNode {
            cluster: self.0.clone(),
            key: ctx.pipeline().stage_key(ctx.stage_index()),
            view: self.0.view.subscribe(),
            at,
            answered: None,
            backoff: None,
        };
        Box::pin(drive(ctx, backend, first_start))
    }
}

/// One remote replica's backend.
struct RemoteNode {
    cluster: Arc<Cluster>,
    at: RemoteAt,
    /// The stage's key in the cluster ("pipeline/stage").
    key: String,
    view: watch::Receiver<Arc<View>>,
    /// The batch sent and its answer (a call is one round trip).
    answered: Option<(u64, Outcome)>,
    /// How long to wait before trying the node again after it failed here.
    backoff: Option<Duration>,
}

/// Whether `at` answers an empty call for the stage within a moment.
async fn probe(cluster: &Cluster, at: &RemoteAt, pipeline: &str, stage: usize) -> bool {
    let meta = CallMeta { pipeline: pipeline.to_string(), stage: stage as u32, reqs: Vec::new() };
    let msg = Outgoing::call(serde_json::to_vec(&meta).expect("serialises"), Vec::new());
    cluster.peers.call(at.addr, msg, PROBE_AFTER).await.is_ok()
}

/// A chunk the other node sent for one request of `batch`: on to the
/// request (and so to its client). A malformed one is dropped: the answer
/// that follows still settles the request.
fn pass_on(ctx: &ReplicaCtx, batch: &Batch, part: Incoming<ArenaBuf>) {
    let Ok(PartMeta { req }) = serde_json::from_slice(&part.meta) else { return };
    let Some((job, _)) = batch.members.get(req as usize) else { return };
    let n = part.tensors.len() as u32;
    if let Ok(mut one) = split_incoming(Arc::new(part.payload.0.freeze()), part.tensors, std::iter::once(n)) {
        job.chunk(ctx.stage_index(), one.pop().unwrap_or_default());
    }
}

impl RemoteNode {
    /// The chain `req` takes from here, if the stages after this one run
    /// on other nodes ([`Job::chain_after`]): its hops, and its way back
    /// here under a token this node's table keeps it by.
    fn chain(&self, ctx: &ReplicaCtx, req: &Arc<dyn Job>) -> (Vec<Hop>, Option<Ingress>) {
        let chain = req.chain_after(ctx.stage_index());
        let hops: Option<Vec<Hop>> = chain
            .iter()
            .map(|(s, r)| r.remote.as_ref().map(|at| Hop { stage: *s as u32, node: at.node.clone(), addr: at.addr }))
            .collect();
        match hops {
            Some(hops) if !hops.is_empty() => {
                let stages = std::iter::once(ctx.stage_index()).chain(chain.iter().map(|(s, _)| *s)).collect();
                let nodes = std::iter::once(&self.at.node).chain(hops.iter().map(|h| &h.node)).cloned().collect();
                let token = self.cluster.handoffs.open(req, stages, nodes, ctx.pipeline());
                (hops, Some(Ingress { addr: self.cluster.data_addr, token }))
            }
            _ => (Vec::new(), None),
        }
    }
}

impl Backend for RemoteNode {
    /// Wait until the node serves the stage (probing it, if it failed here).
    async fn start(&mut self, ctx: &ReplicaCtx) -> Result<Started, String> {
        let mut stop = ctx.stop_signal();
        if let Some(d) = self.backoff {
            tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = stop.changed() => {}
            }
        }
        loop {
            if !ctx.replica().phase().will_serve() || ctx.stopping() {
                return Err("stopped".into());
            }
            if self.view.borrow_and_update().serves(&self.at.node, &self.key) {
                return Ok(Started { pid: 0, detail: format!("on node {} ({})", self.at.node, self.at.addr) });
            }
            if self.cluster.suspected_since(&self.at.node).is_some_and(|t| t.elapsed() >= PROBE_AFTER)
                && probe(&self.cluster, &self.at, ctx.pipeline().name(), ctx.stage_index()).await
            {
                self.cluster.clear_suspect(&self.at.node);
                continue;
            }
            tokio::select! {
                _ = self.view.changed() => {}
                _ = stop.changed() => {}
                _ = ctx.replica().woken() => {}
                _ = tokio::time::sleep(PROBE_AFTER) => {}
            }
        }
    }

    fn capacity(&self, _: &ReplicaCtx) -> usize {
        1
    }

    /// One batch to the remote node and back (the answer is kept for `recv`).
    async fn send(&mut self, ctx: &ReplicaCtx, batch: &mut Batch) -> Result<Option<Outcome>, String> {
        let stage = ctx.stage();
        let now = Instant::now();
        let n = batch.members.len();
        let mut tensors = Vec::new();
        let mut reqs = Vec::with_capacity(n);
        let mut latest = now;
        let mut opened = Opened::new(&self.cluster.handoffs);
        for ((req, inputs), deadline) in batch.members.iter().zip(batch.deadlines()) {
            let chunks = req.wants_chunks(ctx.stage_index());
            let (then, ingress) = match self.cluster.opts.direct && !chunks {
                true => self.chain(ctx, req),
                false => (Vec::new(), None),
            };
            opened.push(ingress.map_or(0, |i| i.token));
            reqs.push(CallReq {
                n: inputs.len() as u32,
                budget_us: deadline.saturating_duration_since(now).as_micros() as u64,
                chunks,
                then,
                ingress,
                accept: false,
                loads: Vec::new(),
            });
            latest = latest.max(deadline);
            tensors.extend(lend_all(inputs));
        }
        let streams = reqs.iter().any(|r| r.chunks);
        let meta = CallMeta { pipeline: ctx.pipeline().name().to_string(), stage: ctx.stage_index() as u32, reqs };
        let msg = Outgoing::call(serde_json::to_vec(&meta).expect("serialises"), tensors);
        // Give the node until the last deadline (or the request timeout) plus
        // a margin to answer; it answers late requests itself.
        let wait = latest.saturating_duration_since(now).max(Duration::from_millis(1)).min(ctx.pipeline().timeout())
            + Duration::from_secs(2);
        let c = &self.cluster.counters;
        c.sent_batches.fetch_add(1, Relaxed);
        c.sent_requests.fetch_add(n as u64, Relaxed);
        // A node that does not answer within a few times the batch's expected
        // latency is taken for partitioned: its requests are retried elsewhere
        // rather than left to wait for their deadline. But only when there
        // is an elsewhere: a slow node (a loaded machine, one draining) is
        // still the requests' best chance when no other replica or warm
        // standby of the stage would take them, so then the call is waited
        // for until the deadline's margin, as a retry would have failed
        // them at once (seen as 503s in rolling restarts under CI load).
        let expected = Duration::from_nanos(batch.expected_ns);
        let patience = (expected * 4 + Duration::from_millis(100)).max(MIN_PATIENCE).min(wait);
        let at = &self.at;
        let call = async {
            if !streams {
                return self.cluster.peers.call(at.addr, msg, wait).await;
            }
            // Chunks for the requests that stream come as partial replies,
            // each passed on to its request at once, all before the answer.
            let (tx, mut parts) = mpsc::unbounded_channel();
            let call = self.cluster.peers.call_with_parts(at.addr, msg, wait, tx);
            tokio::pin!(call);
            loop {
                tokio::select! {
                    Some(part) = parts.recv() => pass_on(ctx, batch, part),
                    answer = &mut call => {
                        while let Ok(part) = parts.try_recv() {
                            pass_on(ctx, batch, part);
                        }
                        break answer;
                    }
                }
            }
        };
        tokio::pin!(call);
        let answer = tokio::select! {
            answer = &mut call => answer,
            _ = tokio::time::sleep(patience) => match stage.has_alternative_to(ctx.replica()) {
                true => Err(PeerError::Timeout),
                false => {
                    c.patient_calls.fetch_add(1, Relaxed);
                    call.await
                }
            },
        };
        let inc = match answer {
            Ok(inc) => inc,
            // The node refused the whole batch (shutting down, say): elsewhere.
            Err(PeerError::Remote(why)) => return Err(format!("node {}: {why}", at.node)),
            Err(PeerError::Alloc(reason)) => {
                return Ok(Some(Outcome::Failed(NodeError::Unavailable { stage: stage.name.clone(), reason })))
            }
            Err(e) => {
                self.cluster.suspect(&at.node, &e.to_string());
                c.retried.fetch_add(n as u64, Relaxed);
                return Err(format!("node {} failed: {e}", at.node));
            }
        };
        let internal = |why: String| Ok(Some(Outcome::Failed(NodeError::Internal(why))));
        let meta: ReplyMeta = match serde_json::from_slice(&inc.meta) {
            Ok(m) => m,
            Err(e) => return internal(format!("node {} sent a malformed reply: {e}", at.node)),
        };
        ctx.replica().set_backlog(meta.outstanding);
        if meta.results.len() != n {
            return internal(format!("node {} answered {} of {n} requests", at.node, meta.results.len()));
        }
        let counts = meta.results.iter().map(ReqResult::count);
        let block = Arc::new(inc.payload.0.freeze());
        let outs = match split_incoming(block, inc.tensors, counts) {
            Ok(o) => o,
            Err(e) => return internal(e),
        };
        let rows = batch.rows();
        let each = meta
            .results
            .into_iter()
            .zip(outs)
            .zip(rows)
            .enumerate()
            .map(|(i, ((result, outputs), rows))| match result {
                // Its chain's last node delivers its answer.
                ReqResult::Handed if opened.keep(i) => Ok(None),
                ReqResult::Handed => Err(NodeError::Internal(format!(
                    "node {} handed on a request it was not given a chain for",
                    at.node
                ))),
                ReqResult::Ok { .. } if outputs.iter().any(|(_, t)| t.rows() != rows) => {
                    Err(NodeError::Internal("a remote output's rows do not match its request".into()))
                }
                ReqResult::Ok { .. } => Ok(opened.settles(i).then_some(outputs)),
                ReqResult::Err { kind, message } => Err(error_from(&kind, message, &stage.name)),
            })
            .collect();
        self.answered = Some((batch.id, Outcome::Each(each)));
        Ok(None)
    }

    async fn recv(&mut self, _: &ReplicaCtx, _: &Running) -> Result<Reply, String> {
        let (id, outcome) = self.answered.take().ok_or("no batch in flight")?;
        Ok(Reply::Done { id, outcome })
    }

    /// The node stops reporting the stage ready.
    async fn lost(&mut self, ctx: &ReplicaCtx) -> String {
        loop {
            if self.view.changed().await.is_err() {
                return std::future::pending().await;
            }
            let up = matches!(ctx.replica().phase(), Phase::Ready | Phase::Standby);
            if !self.view.borrow().serves(&self.at.node, &self.key) && up {
                return "its node no longer reports the stage ready".into();
            }
        }
    }

    async fn stop(&mut self, graceful: bool) {
        self.answered = None;
        if !graceful {
            let next = self.backoff.map_or(Duration::from_millis(100), |d| (d * 2).min(Duration::from_secs(2)));
            self.backoff = Some(next);
        }
    }
}
