//! Stages handing work to each other directly: a chain a -> b -> c whose
//! stages run on nodes A, B and C, entered at ingress I, crosses
//! I -> A -> B -> C -> I, each link once, instead of returning to I after
//! every stage (six crossings, hub and spoke).
//!
//! - **At the ingress** ([`crate::remote`]): a request whose next stages
//!   form a chain routed to other nodes ([`Job::chain_after`]) is sent to
//!   A's batch with the rest of its route (`then`) and a token, under
//!   which the ingress keeps it in its table of requests handed on
//!   ([`Handoffs`]). Its EDF queue, batching and deadline stay the
//!   ingress's for the first stage: A's answer to the batch comes when A
//!   has run it, as for any batch.
//! - **A** runs the stage, answers the ingress's batch "handed" for it, and
//!   hands the outputs straight to B (one call per request, answered as
//!   soon as B has queued it). A request B refuses (no replica, the node
//!   leaving, unreachable) A delivers to the ingress with its own outputs,
//!   and the ingress goes on from there hub and spoke.
//! - **B** queues it by its deadline with its own work (EDF and drop-late
//!   hold on every node: each hop carries the time left), runs it, hands
//!   it on to C the same way; **C**, the chain's last, delivers the
//!   outputs to the ingress (a call naming the token). A node whose next
//!   hop refuses delivers its own outputs instead, and the ingress goes
//!   on from there; a stage that fails delivers its error.
//! - **The ingress** takes the token out of its table and settles the
//!   chain's stages at once ([`Job::finish_chain`]). Whoever takes a token
//!   settles the request: a delivery, or the batch's reply when A answered
//!   it there (a node that does not chain); a batch that failed or was
//!   retried closes its tokens, and a request whose chain loses a node
//!   (suspected here, or its lease gone) runs its first stage again hub and
//!   spoke, so a late delivery is dropped, never settled twice.
//!
//! What hub and spoke has and a chain does not: a node lost while it
//! holds a handed-on request is noticed when the ingress suspects it or
//! its lease runs out (a batch in flight is retried at once hub and
//! spoke), so a short deadline may pass first (504); and the ingress's
//! replicas of the chain's later stages learn no latency from it, only
//! the load each node reports with the delivery. Streaming requests, joins and stages with
//! a hook (a cache) are never chained. `--via-ingress` turns chains off.

use crate::wire::{
    error_from, lend_all, load_here, split_incoming, ArenaBuf, CallMeta, CallReq, Hop, Ingress, Load, ReplyMeta,
    ReqResult,
};
use crate::Cluster;
use serde::{Deserialize, Serialize};
use slipstream_core::arena::{request_rows, Tensors};
use slipstream_core::node::StageRun;
use slipstream_core::replica::Job;
use slipstream_core::{Node, NodeError, PipelineRt};
use slipstream_peer::{Incoming, Outgoing};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long a node waits for the next to accept a request handed on (it
/// answers once it has queued it): a request not accepted in time is
/// delivered to its ingress as far as it got, and the ingress goes on hub
/// and spoke (should the next node have accepted it after all, its
/// delivery finds the token taken and is dropped).
const ACCEPT_WAIT: Duration = Duration::from_secs(1);

/// How long a node waits for a request's ingress to take a delivery
/// (answered at once; a delivery that fails loses the answer, and the
/// request is answered at its deadline).
const DELIVER_WAIT: Duration = Duration::from_secs(2);

/// The ingress's table of requests handed on, by token.
#[derive(Default)]
pub(crate) struct Handoffs {
    open: parking_lot::Mutex<HashMap<u64, Open>>,
    next: AtomicU64,
    /// Chains started here (as the ingress), requests this node handed on
    /// to the next stage's node, and chains settled here by a delivery.
    pub(crate) chains: AtomicU64,
    pub(crate) handed_on: AtomicU64,
    pub(crate) delivered: AtomicU64,
    /// Requests whose chain was lost with a node.
    pub(crate) rerun: AtomicU64,
}

/// One request handed on: what its delivery settles.
pub(crate) struct Open {
    job: Weak<dyn Job>,
    /// The stage it was sent to run first, then its chain.
    stages: Vec<usize>,
    /// The nodes of its chain, the first stage's first: losing one loses the request.
    nodes: Vec<String>,
    /// The first node answered that it ran the first stage and handed the
    /// request on: from here on only the delivery (or a node's loss)
    /// settles it; before, the batch in flight does (and its retry).
    handed: bool,
    pipe: Arc<PipelineRt>,
}

/// Sweep settled requests out of the table once every this many tokens.
const SWEEP_EVERY: u64 = 1024;

impl Handoffs {
    /// Keep `job`, sent to run `stages` in turn elsewhere; its token.
    pub(crate) fn open(
        &self,
        job: &Arc<dyn Job>,
        stages: Vec<usize>,
        nodes: Vec<String>,
        pipe: &Arc<PipelineRt>,
    ) -> u64 {
        let token = self.next.fetch_add(1, Relaxed) + 1;
        self.chains.fetch_add(1, Relaxed);
        let mut open = self.open.lock();
        if token.is_multiple_of(SWEEP_EVERY) {
            // Requests answered some other way (their deadline passed while a
            // node held them, say) leave no entry behind.
            open.retain(|_, o| o.job.upgrade().is_some_and(|j| !j.skips(o.stages[0])));
        }
        open.insert(token, Open { job: Arc::downgrade(job), stages, nodes, handed: false, pipe: pipe.clone() });
        token
    }

    /// The first node handed `token`'s request on (see [`Open::handed`]).
    fn handed(&self, token: u64) {
        if let Some(o) = self.open.lock().get_mut(&token) {
            o.handed = true;
        }
    }

    /// Take `token` out: whoever does settles its request.
    pub(crate) fn take(&self, token: u64) -> Option<Open> {
        self.open.lock().remove(&token)
    }

    /// Nodes `gone` were lost: the requests handed on along them will not
    /// be delivered. Each runs its first stage again, hub and spoke (once;
    /// a second loss fails it with 503), before its deadline answers it.
    pub(crate) fn lost(&self, gone: impl Fn(&str) -> bool) {
        let lost: Vec<Open> = {
            let mut open = self.open.lock();
            let lost = |o: &Open| o.handed && o.nodes.iter().any(|n| gone(n));
            let tokens: Vec<u64> = open.iter().filter(|(_, o)| lost(o)).map(|(t, _)| *t).collect();
            tokens.into_iter().filter_map(|t| open.remove(&t)).collect()
        };
        for o in lost {
            let Some(job) = o.job.upgrade() else { continue };
            let first = o.stages[0];
            self.rerun.fetch_add(1, Relaxed);
            match job.mark_retried(first) {
                true => job.rerun(first),
                false => {
                    let stage = o.pipe.stages[first].name.clone();
                    job.fail_stage(
                        first,
                        NodeError::Unavailable { stage, reason: "its chain was lost with a node".into() },
                    )
                }
            }
        }
    }

    /// Requests handed on and not yet delivered.
    pub(crate) fn pending(&self) -> usize {
        self.open.lock().len()
    }
}

/// The tokens one batch opened (0: none for that request): closed when
/// this is dropped, except those [`Opened::keep`] hands to their delivery.
pub(crate) struct Opened<'a> {
    table: &'a Handoffs,
    tokens: Vec<u64>,
}

impl<'a> Opened<'a> {
    pub(crate) fn new(table: &'a Handoffs) -> Opened<'a> {
        Opened { table, tokens: Vec::new() }
    }

    pub(crate) fn push(&mut self, token: u64) {
        self.tokens.push(token);
    }

    /// Request `i` was handed on: its delivery settles it.
    pub(crate) fn keep(&mut self, i: usize) -> bool {
        match std::mem::take(&mut self.tokens[i]) {
            0 => false,
            t => {
                self.table.handed(t);
                true
            }
        }
    }

    /// Request `i` came back in the reply: whether it is still this
    /// batch's to settle (not if its chain was delivered meanwhile).
    pub(crate) fn settles(&mut self, i: usize) -> bool {
        match std::mem::take(&mut self.tokens[i]) {
            0 => true,
            t => self.table.take(t).is_some(),
        }
    }
}

impl Drop for Opened<'_> {
    fn drop(&mut self) {
        for &t in self.tokens.iter().filter(|&&t| t != 0) {
            self.table.take(t);
        }
    }
}

/// A request on its way along a chain, as a node running one of its
/// stages holds it.
pub(crate) struct Onward {
    /// The stage run here.
    stage: usize,
    /// The stages after it, each with its node.
    then: Vec<Hop>,
    ingress: Ingress,
    deadline: Instant,
    /// The loads of the nodes it passed so far, for its ingress.
    loads: Vec<Load>,
}

impl Onward {
    /// The way on of a request of a batch (None: it is answered in the reply).
    pub(crate) fn of(r: &CallReq, stage: usize, now: Instant) -> Option<Onward> {
        if r.then.is_empty() && !r.accept {
            return None;
        }
        let deadline = now + Duration::from_micros(r.budget_us.min(3_600_000_000));
        Some(Onward { stage, then: r.then.clone(), ingress: r.ingress?, deadline, loads: r.loads.clone() })
    }
}

/// Stage `hop.stage` has run here for a request handed along a chain
/// (`outs`): hand it on to the next stage, or deliver it as far as it got.
pub(crate) fn hand_on(node: Arc<Node>, cluster: Arc<Cluster>, pipe: Arc<PipelineRt>, hop: Onward, outs: Tensors) {
    tokio::spawn(async move { go_on(&node, &cluster, &pipe, hop, Ok(outs)).await });
}

/// Hand one request's outputs of `hop.stage` to the next stage: whether
/// it was accepted there (queued on that node, or on this one).
async fn pass(node: &Arc<Node>, cluster: &Arc<Cluster>, pipe: &Arc<PipelineRt>, hop: Onward, outs: Tensors) -> bool {
    let Some((next, rest)) = hop.then.split_first() else { return false };
    let mut loads = hop.loads;
    loads.push(load_of(cluster, pipe, hop.stage));
    let onward =
        Onward { stage: next.stage as usize, then: rest.to_vec(), ingress: hop.ingress, deadline: hop.deadline, loads };
    if next.addr == cluster.data_addr {
        // The next stage runs on this node too.
        return match node.run_stage(pipe, onward.stage, outs, hop.deadline, None) {
            Ok(run) => {
                carry_on(node.clone(), cluster.clone(), pipe.clone(), run, onward);
                true
            }
            Err(_) => false,
        };
    }
    let req = CallReq {
        n: outs.len() as u32,
        budget_us: hop.deadline.saturating_duration_since(Instant::now()).as_micros() as u64,
        chunks: false,
        then: onward.then,
        ingress: Some(hop.ingress),
        accept: true,
        loads: onward.loads,
    };
    let meta = CallMeta { pipeline: pipe.name().to_string(), stage: next.stage, reqs: vec![req] };
    let tensors = lend_all(&outs).collect();
    let msg = Outgoing::call(serde_json::to_vec(&meta).expect("serialises"), tensors);
    let Ok(inc) = cluster.peers.call(next.addr, msg, ACCEPT_WAIT).await else { return false };
    let accepted = serde_json::from_slice::<ReplyMeta>(&inc.meta)
        .is_ok_and(|m| matches!(m.results.as_slice(), [ReqResult::Handed]));
    if accepted {
        cluster.handoffs.handed_on.fetch_add(1, Relaxed);
    }
    accepted
}

/// A request handed on to this node is queued here (`run`): when it has
/// run, hand it on, or deliver its outputs (or error) to its ingress.
pub(crate) fn carry_on(node: Arc<Node>, cluster: Arc<Cluster>, pipe: Arc<PipelineRt>, run: StageRun, hop: Onward) {
    tokio::spawn(async move {
        let outcome = run.outcome().await;
        go_on(&node, &cluster, &pipe, hop, outcome).await;
    });
}

/// After `hop.stage` ran here with `outcome`: on to the next stage's node
/// if there is one and it accepts; else to the ingress, the outputs (it
/// goes on from this stage hub and spoke) or the error.
async fn go_on(
    node: &Arc<Node>,
    cluster: &Arc<Cluster>,
    pipe: &Arc<PipelineRt>,
    hop: Onward,
    outcome: Result<Tensors, NodeError>,
) {
    let (stage, ingress) = (hop.stage, hop.ingress);
    let mut loads = hop.loads.clone();
    let outcome = match outcome {
        Ok(outs) if !hop.then.is_empty() => {
            if pass(node, cluster, pipe, hop, outs.clone()).await {
                return;
            }
            Ok(outs)
        }
        other => other,
    };
    loads.push(load_of(cluster, pipe, stage));
    deliver(cluster, pipe, ingress, stage, outcome, loads).await;
}

/// This node's load at stage `stage`.
fn load_of(cluster: &Cluster, pipe: &PipelineRt, stage: usize) -> Load {
    Load { stage: stage as u32, node: cluster.me().to_string(), outstanding: load_here(&pipe.stages[stage]) }
}

/// A chain's answer (or the outputs of its last stage run) for the
/// ingress, under its token.
#[derive(Serialize, Deserialize)]
struct Delivery {
    /// The token (first, so that the meta's first bytes name the call).
    deliver: u64,
    pipeline: String,
    /// The last stage run.
    through: u32,
    result: ReqResult,
    /// The loads of the nodes it was handed along.
    #[serde(default)]
    loads: Vec<Load>,
}

/// A delivery's meta starts with this (batch, store and feedback calls' never do).
const DELIVERY_TAG: &[u8] = b"{\"deliver\":";

/// Whether a data-plane call's meta is a delivery.
pub(crate) fn is_delivery(meta: &[u8]) -> bool {
    meta.starts_with(DELIVERY_TAG)
}

async fn deliver(
    cluster: &Cluster,
    pipe: &PipelineRt,
    ingress: Ingress,
    through: usize,
    outcome: Result<Tensors, NodeError>,
    loads: Vec<Load>,
) {
    let mut tensors = Vec::new();
    let result = ReqResult::of(outcome, &mut tensors);
    let pipeline = pipe.name().to_string();
    let meta = Delivery { deliver: ingress.token, pipeline, through: through as u32, result, loads };
    let msg = Outgoing::call(serde_json::to_vec(&meta).expect("serialises"), tensors);
    // An ingress that cannot be reached has lost its request with it.
    if let Err(e) = cluster.peers.call(ingress.addr, msg, DELIVER_WAIT).await {
        tracing::debug!("a delivery to {} failed: {e}", ingress.addr);
    }
}

/// At the ingress: settle the request a delivery names. Answered at once;
/// a token no longer open (the request was answered or retried
/// meanwhile) is dropped.
pub(crate) fn take_delivery(cluster: &Cluster, from: &str, inc: Incoming<ArenaBuf>) -> Outgoing {
    let d: Delivery = match serde_json::from_slice(&inc.meta) {
        Ok(d) => d,
        Err(e) => return Outgoing::error(format!("malformed delivery from {from}: {e}")),
    };
    let done = Outgoing::reply(b"{}".to_vec(), Vec::new());
    let Some(open) = cluster.handoffs.take(d.deliver) else { return done };
    let Some(job) = open.job.upgrade() else { return done };
    let through = d.through as usize;
    let Some(at) = open.stages.iter().position(|&s| s == through).filter(|_| open.pipe.name() == d.pipeline) else {
        job.fail(NodeError::Internal(format!("node {from} delivered stage {through}, not one of the request's chain")));
        return done;
    };
    cluster.handoffs.delivered.fetch_add(1, Relaxed);
    // What the nodes it passed reported: routing and admission here see
    // their queues as if their answers had come back here.
    for l in &d.loads {
        let Some(stage) = open.pipe.stages.get(l.stage as usize) else { continue };
        for r in stage.replicas().iter().filter(|r| r.remote.as_ref().is_some_and(|at| at.node == l.node)) {
            r.set_backlog(l.outstanding);
        }
    }
    match d.result {
        ReqResult::Ok { n } => {
            let rows = job.inputs(open.stages[0]).map(|i| request_rows(&i));
            match split_incoming(Arc::new(inc.payload.0.freeze()), inc.tensors, std::iter::once(n)) {
                Ok(mut outs) => {
                    let outs = outs.pop().unwrap_or_default();
                    match rows {
                        Ok(rows) if outs.iter().all(|(_, t)| t.rows() == rows) => {
                            job.finish_chain(&open.stages[..=at], outs)
                        }
                        _ => job.fail(NodeError::Internal(format!(
                            "node {from} delivered outputs whose rows do not match the request's"
                        ))),
                    }
                }
                Err(e) => job.fail(NodeError::Internal(format!("node {from} delivered a malformed answer: {e}"))),
            }
        }
        ReqResult::Err { kind, message } => {
            let name = &open.pipe.stages[through].name;
            job.fail_stage(through, error_from(&kind, message, name));
        }
        ReqResult::Handed => job.fail(NodeError::Internal(format!("node {from} delivered no answer"))),
    }
    done
}
