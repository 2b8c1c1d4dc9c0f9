//! The data plane's frames between nodes: a batch of one stage's requests
//! (each request's tensors, small ones merged into one buffer, large ones
//! sent straight from shared memory with vectored writes), the chunks a
//! streaming stage yields for the requests that stream (partial replies,
//! one per chunk), and the answer with each request's outputs or error and
//! the stage's load there.
//! Received tensors land in one block of the receiver's arena.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use slipstream_core::arena::{Arena, TensorRef, Tensors};
use slipstream_core::NodeError;
use slipstream_peer::{InTensor, OutTensor};
use slipstream_shm::{Block, BlockMut};
use std::sync::Arc;

/// Receive buffers are blocks of the node's arena (ingress pool).
pub(crate) struct ArenaAlloc(pub(crate) Arc<Arena>);

/// A block being filled by the data plane.
pub(crate) struct ArenaBuf(pub(crate) BlockMut);

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

/// `tensors`, each lent to the socket without a copy.
pub(crate) fn lend_all(tensors: &Tensors) -> impl Iterator<Item = OutTensor> + '_ {
    tensors.iter().map(|(name, t)| lend(name, t))
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
pub(crate) struct CallReq {
    /// Tensors of this request (the next `n` in the frame's table).
    pub(crate) n: u32,
    /// Time left to its deadline when sent, µs.
    pub(crate) budget_us: u64,
    /// Its request streams: a streaming stage's chunks for it are sent
    /// back as they come ([`PartMeta`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) chunks: bool,
    /// The stages after this one, each on its node, that run it next
    /// without its ingress: this stage's outputs go straight to the first
    /// (see `handoff.rs`); empty: they come back in the reply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) then: Vec<Hop>,
    /// With `then` or `accept`: the ingress's name for the request, and
    /// where its answer (or the outputs of the last stage run, when a
    /// handoff is refused) is delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ingress: Option<Ingress>,
    /// Handed on from the stage before: answer at once that it is queued
    /// here, then run it and hand it on or deliver it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) accept: bool,
    /// The load of each node the request was handed along so far, for
    /// its ingress (which hears from those nodes no other way).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) loads: Vec<Load>,
}

/// A node's load at one stage: requests queued or running per ready
/// replica of it there (as [`ReplyMeta::outstanding`]).
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct Load {
    pub(crate) stage: u32,
    pub(crate) node: String,
    pub(crate) outstanding: u32,
}

/// One stage of a handoff chain and the node that runs it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct Hop {
    pub(crate) stage: u32,
    pub(crate) node: String,
    pub(crate) addr: std::net::SocketAddr,
}

/// A handed-on request's way back: its ingress's data plane and its token
/// there.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub(crate) struct Ingress {
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) token: u64,
}

/// A partial reply: one chunk of a streaming stage's outputs for one
/// request of the batch (its tensors are the frame's).
#[derive(Serialize, Deserialize)]
pub(crate) struct PartMeta {
    /// The request's index in the batch.
    pub(crate) req: u32,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct CallMeta {
    pub(crate) pipeline: String,
    pub(crate) stage: u32,
    pub(crate) reqs: Vec<CallReq>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "ok")]
pub(crate) enum ReqResult {
    /// Its outputs: the next `n` tensors of the reply.
    #[serde(rename = "true")]
    Ok { n: u32 },
    #[serde(rename = "false")]
    Err { kind: String, message: String },
    /// Handed on to the next stage's node (or accepted here, for a request
    /// handed on to this node): its answer is delivered to its ingress.
    #[serde(rename = "handed")]
    Handed,
}

impl ReqResult {
    /// The result of `outcome`, with its outputs appended to `tensors`.
    pub(crate) fn of(outcome: Result<Tensors, NodeError>, tensors: &mut Vec<OutTensor>) -> ReqResult {
        match outcome {
            Ok(outs) => {
                tensors.extend(lend_all(&outs));
                ReqResult::Ok { n: outs.len() as u32 }
            }
            Err(e) => ReqResult::Err { kind: e.kind().to_string(), message: e.to_string() },
        }
    }

    /// How many of the frame's tensors it names.
    pub(crate) fn count(&self) -> u32 {
        match self {
            ReqResult::Ok { n } => *n,
            _ => 0,
        }
    }
}

#[derive(Serialize, Deserialize, Default)]
pub(crate) struct ReplyMeta {
    pub(crate) results: Vec<ReqResult>,
    /// Requests queued at or running on the stage's replicas there when the
    /// batch was answered, per replica: the load report routing and
    /// admission at the sender add to the remote replica's own queue.
    #[serde(default)]
    pub(crate) outstanding: u32,
}

/// The tensors of an incoming frame, split per request (`counts[i]` each),
/// as references into the one block they were received in.
pub(crate) fn split_incoming(
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
pub(crate) fn error_from(kind: &str, message: String, stage: &str) -> NodeError {
    let stage = stage.to_string();
    match kind {
        "deadline_exceeded" => NodeError::DeadlineExceeded { stage },
        "component_error" => NodeError::Component { stage, message },
        "bad_input" => NodeError::BadInput(message),
        "unavailable" => NodeError::Unavailable { stage, reason: message },
        "shutting_down" => NodeError::ShuttingDown,
        _ => NodeError::Internal(message),
    }
}

/// Requests queued or running per ready replica of `stage` on this node:
/// the load report that goes back with answers.
pub(crate) fn load_here(stage: &slipstream_core::StageRt) -> u32 {
    let set = stage.replicas();
    let local = set.iter().filter(|r| r.is_local());
    let live = local.clone().filter(|r| r.phase() == slipstream_core::replica::Phase::Ready).count().max(1);
    let outstanding: u32 = local.map(|r| r.load().outstanding).sum();
    outstanding / live as u32
}
