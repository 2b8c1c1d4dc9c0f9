//! Feedback on an answer, accepted by any node.
//!
//! Model selection keeps each prediction (which candidates ran, what they
//! said) on the node whose ingress answered the request, until feedback on
//! it comes (`POST /v1/pipelines/{p}/feedback` with the answer's request
//! id). Behind a load balancer the feedback may reach another node, so a
//! request id names the node that answered it: at join each node claims a
//! *tag* in etcd (the lowest free number under `tags/`, created only if
//! absent, under the node's lease), its request ids are `tag << 40 |
//! counter` (the counter from a random start, so a tag claimed again later
//! does not repeat ids), and feedback naming another node's tag is
//! forwarded to it over the data plane, where the installed handler (the
//! composition root's: model selection's) applies it. A batch of feedback
//! is split by node and the counts are summed. Ids stay below 2^53, so
//! JSON readers that use doubles keep them exact.

use crate::{Cluster, Member};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use slipstream_core::NodeError;
use slipstream_etcd::{Etcd, EtcdError};
use slipstream_peer::{Incoming, Outgoing, PeerError};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// Request ids carry the answering node's tag above this bit.
pub const TAG_SHIFT: u32 = 40;

/// Tags are 1..=MAX_TAG (12 bits: ids stay below 2^52).
const MAX_TAG: u32 = 4095;

/// How long a forwarded feedback call may take.
const PATIENCE: Duration = Duration::from_secs(5);

/// A feedback call's meta starts with this (batch and store calls' never do).
const CALL_TAG: &[u8] = b"{\"feedback\":";

/// Applies a feedback body to a pipeline's selections on this node
/// (installed by the composition root).
pub type FeedbackFn = Arc<dyn Fn(&str, &[u8]) -> Result<Value, NodeError> + Send + Sync>;

#[derive(Serialize, Deserialize)]
struct FeedbackCall {
    /// The pipeline.
    feedback: String,
    body: Value,
}

/// What a node answered to feedback (forwarded or not).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Feedback {
    /// Applied (the selections' answer: one item's, or a batch's counts).
    Ok(Value),
    /// Refused by the node that answered the request, as its edge would
    /// answer: the HTTP status, the error's kind and message.
    Refused {
        /// HTTP status.
        status: u16,
        /// The error's stable kind.
        kind: String,
        /// Why.
        message: String,
    },
}

impl Feedback {
    fn of(r: Result<Value, NodeError>) -> Feedback {
        match r {
            Ok(v) => Feedback::Ok(v),
            Err(e) => Feedback::Refused { status: e.http_status(), kind: e.kind().to_string(), message: e.to_string() },
        }
    }
}

/// Whether a data-plane call's meta is a feedback call.
pub(crate) fn is_feedback_call(meta: &[u8]) -> bool {
    meta.starts_with(CALL_TAG)
}

/// Claim the lowest free tag for this node, under `lease`; its request ids
/// start in the tag's range. Err: etcd failed, or every tag is taken.
pub(crate) async fn claim_tag(etcd: &Etcd, cluster: &Cluster, lease: i64) -> Result<u32, EtcdError> {
    let prefix = format!("{}tags/", cluster.opts.root());
    for _ in 0..8 {
        let (taken, _) = etcd.get_prefix(&prefix).await?;
        let taken: std::collections::BTreeSet<u32> =
            taken.iter().filter_map(|kv| kv.key.strip_prefix(&prefix)?.parse().ok()).collect();
        let Some(tag) = (1..=MAX_TAG).find(|t| !taken.contains(t)) else {
            return Err(EtcdError::Protocol(format!("all {MAX_TAG} request-id tags are taken")));
        };
        if etcd.put_if(&format!("{prefix}{tag}"), cluster.me().as_bytes(), 0, Some(lease)).await?.is_ok() {
            cluster.tag.store(tag, Relaxed);
            return Ok(tag);
        }
        // Another node took it meanwhile: look again.
    }
    Err(EtcdError::Protocol("could not claim a request-id tag (other nodes kept taking them)".into()))
}

/// The first request id of a node with tag `tag`.
pub(crate) fn first_id(tag: u32) -> u64 {
    ((tag as u64) << TAG_SHIFT) | rand::random::<u32>() as u64
}

impl Cluster {
    /// Install what applies feedback here (model selection's).
    pub fn set_feedback_handler(&self, f: FeedbackFn) {
        let _ = self.feedback.set(f);
    }

    /// The member that answered request `id`, when it is another node.
    fn answered_by(&self, id: u64) -> Option<Member> {
        let tag = (id >> TAG_SHIFT) as u32;
        if tag == 0 || tag == self.tag.load(Relaxed) {
            return None;
        }
        self.view().members.values().find(|m| m.tag == tag).cloned()
    }

    /// Feedback on this node's own answers, with the installed handler.
    fn apply_here(&self, pipeline: &str, body: &[u8]) -> Feedback {
        Feedback::of(match self.feedback.get() {
            Some(apply) => apply(pipeline, body),
            None => Err(NodeError::Unavailable {
                stage: "feedback".into(),
                reason: "this node is still joining the cluster".into(),
            }),
        })
    }

    /// Apply a feedback body (one item or `{"feedback": [...]}`) for
    /// `pipeline`: items on requests this node answered here (with the
    /// handler installed by [`Cluster::set_feedback_handler`]), the others
    /// on the nodes that answered them. Err: the forwarding failed.
    pub async fn feedback(&self, pipeline: &str, body: &[u8]) -> Result<Feedback, NodeError> {
        let local = |b: &[u8]| self.apply_here(pipeline, b);
        // Not JSON, or no other node's ids: the local handler answers (and
        // says what is wrong, if anything is).
        let Ok(doc) = serde_json::from_slice::<Value>(body) else { return Ok(local(body)) };
        let (items, batch) = match doc.get("feedback") {
            Some(Value::Array(a)) => (a.clone(), true),
            _ => (vec![doc.clone()], false),
        };
        let home = |item: &Value| item.get("request_id").and_then(Value::as_u64).and_then(|id| self.answered_by(id));
        if items.iter().all(|i| home(i).is_none()) {
            return Ok(local(body));
        }
        if !batch {
            let m = home(&items[0]).expect("checked above");
            return self.forward(&m, pipeline, doc).await;
        }
        let mut groups: BTreeMap<Option<String>, (Option<Member>, Vec<Value>)> = BTreeMap::new();
        for item in items {
            let m = home(&item);
            groups.entry(m.as_ref().map(|m| m.node.clone())).or_insert((m, Vec::new())).1.push(item);
        }
        let (mut applied, mut unknown, mut invalid, mut errors) = (0, 0, 0, Vec::new());
        for (_, (m, items)) in groups {
            let part = json!({ "feedback": items });
            let answer = match m {
                None => local(part.to_string().as_bytes()),
                Some(m) => self.forward(&m, pipeline, part).await?,
            };
            let v = match answer {
                Feedback::Ok(v) => v,
                refused => return Ok(refused),
            };
            applied += v["applied"].as_u64().unwrap_or(0);
            unknown += v["unknown"].as_u64().unwrap_or(0);
            invalid += v["invalid"].as_u64().unwrap_or(0);
            errors.extend(v["errors"].as_array().cloned().unwrap_or_default());
        }
        Ok(Feedback::Ok(json!({"applied": applied, "unknown": unknown, "invalid": invalid, "errors": errors})))
    }

    /// Feedback to node `m` over the data plane: what it answered.
    async fn forward(&self, m: &Member, pipeline: &str, body: Value) -> Result<Feedback, NodeError> {
        let call = FeedbackCall { feedback: pipeline.to_string(), body };
        let msg = Outgoing::call(serde_json::to_vec(&call).expect("serialises"), Vec::new());
        let unavailable = |why: String| NodeError::Unavailable {
            stage: "feedback".into(),
            reason: format!("node {} answered the request; forwarding the feedback to it failed: {why}", m.node),
        };
        let inc = match self.peers.call(m.data, msg, PATIENCE).await {
            Ok(inc) => inc,
            Err(PeerError::Remote(why)) => return Err(unavailable(why)),
            Err(e) => return Err(unavailable(e.to_string())),
        };
        serde_json::from_slice::<Feedback>(&inc.meta)
            .map_err(|e| NodeError::Internal(format!("node {} sent a malformed feedback reply: {e}", m.node)))
    }

    /// Serve a feedback call another node forwarded.
    pub(crate) fn serve_feedback<B>(&self, from: &str, inc: &Incoming<B>) -> Outgoing {
        let call: FeedbackCall = match serde_json::from_slice(&inc.meta) {
            Ok(c) => c,
            Err(e) => return Outgoing::error(format!("malformed feedback call from {from}: {e}")),
        };
        let reply = self.apply_here(&call.feedback, call.body.to_string().as_bytes());
        Outgoing::reply(serde_json::to_vec(&reply).expect("serialises"), Vec::new())
    }
}
