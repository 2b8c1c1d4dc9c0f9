//! Serving other nodes' batches: a batch from another node is written
//! straight into this node's arena by the receiver; each request in it
//! becomes one stage's work on this node's replicas ([`Node::run_stage`]),
//! queued by the same deadline as local work, and the answers go back in
//! one frame with this stage's load (requests queued or running per ready
//! replica here), which the sender adds to its own view of the queue.
//! For a request that streams, each chunk a streaming component yields
//! goes back at once as a partial reply, all of them before the answer.

use crate::handoff::{self, Onward};
use crate::wire::{lend_all, load_here, split_incoming, ArenaBuf, CallMeta, PartMeta, ReplyMeta, ReqResult};
use crate::Cluster;
use slipstream_core::arena::Tensors;
use slipstream_core::{Node, NodeError};
use slipstream_peer::{Incoming, Outgoing, Parts};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Run a batch node `from` sent: every request as one stage's work here.
pub(crate) async fn serve_call(
    node: Arc<Node>,
    cluster: Arc<Cluster>,
    from: String,
    inc: Incoming<ArenaBuf>,
    parts: Parts,
) -> Outgoing {
    if crate::store::is_store_call(&inc.meta) {
        return match cluster.store.get() {
            Some(s) => s.clone().serve(&from, inc).await,
            None => Outgoing::error("the cluster store is not loaded yet here"),
        };
    }
    if crate::feedback::is_feedback_call(&inc.meta) {
        return cluster.serve_feedback(&from, &inc);
    }
    if handoff::is_delivery(&inc.meta) {
        return handoff::take_delivery(&cluster, &from, inc);
    }
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
    cluster.counters.served_batches.fetch_add(1, Relaxed);
    let now = Instant::now();
    // Every request is queued before any is awaited: they batch together here.
    let mut forwards = Vec::new();
    let runs: Vec<_> = meta
        .reqs
        .iter()
        .zip(per_req)
        .enumerate()
        .map(|(i, (r, inputs))| {
            let deadline = now + Duration::from_micros(r.budget_us.min(3_600_000_000));
            let chunks = r.chunks.then(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                forwards.push(forward_chunks(i as u32, rx, parts.clone()));
                tx
            });
            node.run_stage(&pipe, stage.index, inputs, deadline, chunks)
        })
        .collect();
    // Each request's answer; None: handed on (its answer goes to its ingress).
    let mut answers: Vec<Option<Result<Tensors, NodeError>>> = Vec::with_capacity(runs.len());
    for (r, run) in meta.reqs.iter().zip(runs) {
        let hop = Onward::of(r, stage.index, now);
        let run = match run {
            Ok(run) => run,
            Err(e) => {
                answers.push(Some(Err(e)));
                continue;
            }
        };
        match hop {
            // Handed on to this node: queued here, the rest is this node's.
            Some(hop) if r.accept => {
                handoff::carry_on(node.clone(), cluster.clone(), pipe.clone(), run, hop);
                answers.push(None);
            }
            // Run here, then on along its chain (not waited for).
            hop => match (run.outcome().await, hop) {
                (Ok(outs), Some(hop)) => {
                    handoff::hand_on(node.clone(), cluster.clone(), pipe.clone(), hop, outs);
                    answers.push(None);
                }
                (outcome, _) => answers.push(Some(outcome)),
            },
        }
    }
    let mut tensors = Vec::new();
    let results = answers
        .into_iter()
        .map(|a| match a {
            Some(outcome) => ReqResult::of(outcome, &mut tensors),
            None => ReqResult::Handed,
        })
        .collect();
    // Every chunk goes out before the answer (each request's chunk channel
    // closed when its request ended).
    for f in forwards {
        let _ = f.await;
    }
    let meta = ReplyMeta { results, outstanding: load_here(stage) };
    Outgoing::reply(serde_json::to_vec(&meta).expect("serialises"), tensors)
}

/// Send request `req`'s chunks back as partial replies as they come, until
/// its request ends.
fn forward_chunks(req: u32, mut rx: mpsc::UnboundedReceiver<Tensors>, parts: Parts) -> JoinHandle<()> {
    tokio::spawn(async move {
        let meta = serde_json::to_vec(&PartMeta { req }).expect("serialises");
        while let Some(chunk) = rx.recv().await {
            if !parts.send(meta.clone(), lend_all(&chunk).collect()).await {
                return; // the caller is gone
            }
        }
    })
}
