//! The core's extension points: the few narrow traits through which
//! features plug into the node without the core knowing them.
//!
//! - [`StageHook`]: something per stage on the request path, which may
//!   answer a stage's work without running it and sees every result (the
//!   prediction cache);
//! - [`crate::join::JoinPolicy`]: a join over candidate stages, which
//!   decides which of them run for a request and combines their answers
//!   into one (model selection);
//! - [`Service`]: a background service's part of the node's status and
//!   metrics (the autoscaler, store triggers, the model follower, the
//!   cluster agent, the dashboard's sampler); each runs its own task, with
//!   the node's public API as its only handle;
//! - [`SharedStore`]: the store a cluster shares (its writes committed
//!   through etcd, its values held on other nodes); one node has none and
//!   its store is the node's own;
//! - [`crate::drive::Launcher`]: what drives a replica: the core's own for
//!   a worker process on this machine ([`crate::worker::WorkerLauncher`]),
//!   the cluster's for a replica on another node; both run the same loop
//!   ([`crate::drive::drive`]) over their own [`crate::drive::Backend`].
//!
//! A feature depends on the core only, never on another feature; the
//! composition root (`slipstream-runtime`) is the one place that names
//! them all and installs each here.

use crate::arena::{HeapTensors, Tensors};
use crate::prom::PromText;
use serde_json::{Map, Value};
use slipstream_store::{Committed, StoreError};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Versions of the store objects a component's instance was built from,
/// by argument name (reported by its worker with every batch).
pub type Versions = BTreeMap<String, u64>;

/// What a [`StageHook`] says about a request's work for its stage, before
/// it is queued.
pub enum Lookup {
    /// The stage's outputs for this request: it finishes here, without a
    /// queue, a batch or a worker.
    Hit(Arc<HeapTensors>),
    /// Run it; `memo` comes back to [`StageHook::store`] with its result
    /// (the cache's key, so the inputs are not hashed twice).
    Miss(u128),
    /// Run it; its result is of no interest to the hook.
    Pass,
}

/// Something per stage on the request path (see the module docs).
pub trait StageHook: Send + Sync {
    /// Its name: the key of its block in the stage's status.
    fn name(&self) -> &'static str;
    /// Consulted before a request's work for the stage is queued, with the
    /// request's inputs to the stage.
    fn lookup(&self, inputs: &Tensors) -> Lookup;
    /// A request that [`Lookup::Miss`]ed ran: its outputs, computed by an
    /// instance built from `versions`.
    fn store(&self, memo: u128, outputs: &Tensors, versions: &Versions);
    /// Its status block.
    fn status(&self) -> Value;
    /// Its samples in `/metrics`, labelled with the stage's `labels`.
    fn metrics(&self, t: &mut PromText, labels: &[(&str, &str)]);
}

/// A store call's answer, later.
pub type StoreFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send>>;

/// A write through the shared store: a put (`value` Some: its parts) or a
/// delete.
pub struct SharedWrite {
    /// The key written.
    pub key: String,
    /// The value's parts (None: a delete, which writes a tombstone).
    pub value: Option<Vec<bytes::Bytes>>,
    /// The value's media type.
    pub content_type: String,
    /// Only if the key's latest version is this (0: never written).
    pub if_version: Option<u64>,
}

/// The store a cluster shares (see the module docs). The node's own
/// [`slipstream_store::Store`] stays the place reads are served from: the
/// shared store keeps it current (every committed version applied in
/// order) and fills in values held elsewhere on demand.
pub trait SharedStore: Send + Sync {
    /// Commit a write for the whole cluster; answered once it is
    /// committed and applied to this node's store.
    fn write(&self, w: SharedWrite) -> StoreFuture<Committed>;
    /// Bring this node's store up to the cluster's latest commit of `key`
    /// (a read after an acknowledged write through any node sees it).
    /// Ok(false): the cluster could not be asked (etcd unreachable from
    /// here), so this node's view, possibly stale, is all there is.
    fn sync(&self, key: &str) -> StoreFuture<bool>;
    /// Fetch the value of `key`'s version `version` from a node holding
    /// it and keep it here (the record said [`StoreError::Elsewhere`]).
    fn fetch(&self, key: &str, version: u64) -> StoreFuture<()>;
    /// Whether this node fires the cluster's store triggers now (one node
    /// does: every node applies every change, so each would fire it).
    fn fires_triggers(&self) -> bool;
    /// The etcd revision up to which the cluster's triggers have settled
    /// (as the node firing them last recorded it).
    fn triggers_settled(&self) -> StoreFuture<u64>;
    /// Record that the cluster's triggers have settled up to `rev`.
    fn settle_triggers(&self, rev: u64) -> StoreFuture<()>;
    /// Where the affinity group `group` of pool `pool` lives: whether this
    /// node holds it, and which other nodes do (by name). Requests that
    /// read the group are routed to a replica on one of them.
    fn group_home(&self, pool: &str, group: &str) -> GroupHome;
    /// The first phase of a model update: the nodes placed to run a stage
    /// that `needs` `key` which do not hold its version `version` yet.
    /// A replica switches to a new version only once this is empty (every
    /// hosting node holds it), so no node serves it while another still
    /// cannot. Err(NotFound): this node has no such version.
    fn rollout_waits(&self, key: &str, version: u64) -> Result<Vec<String>, StoreError>;
}

/// The nodes holding an affinity group (see [`SharedStore::group_home`]).
pub struct GroupHome {
    /// This node is one of them.
    pub here: bool,
    /// The others, by name.
    pub elsewhere: Vec<String>,
}

/// A background service's reporting (see the module docs).
pub trait Service: Send + Sync {
    /// Add its part to the node's status document.
    fn status(&self, doc: &mut StatusDoc);
    /// Add its samples to `/metrics`.
    fn metrics(&self, t: &mut PromText);
    /// Why the node must not be reported ready (routable) now, if so: a
    /// readiness gate (the cluster's: its lease held, its replicas known to
    /// the others). Liveness never asks.
    fn unready(&self) -> Option<String> {
        None
    }
}

/// The node's status document (`GET /v1/status`) while it is assembled:
/// the core's part, to which each feature adds its blocks where readers
/// expect them.
pub struct StatusDoc(Value);

impl StatusDoc {
    pub(crate) fn new(doc: Value) -> StatusDoc {
        StatusDoc(doc)
    }

    pub(crate) fn into_value(self) -> Value {
        self.0
    }

    /// Set the value at `path` (objects are created along it).
    pub fn set(&mut self, path: &[&str], v: Value) {
        let Some((last, parents)) = path.split_last() else { return };
        let mut at = &mut self.0;
        for key in parents {
            at = object(at).entry(key.to_string()).or_insert_with(|| Value::Object(Map::new()));
        }
        object(at).insert(last.to_string(), v);
    }

    /// Set `key` in pipeline `pipeline`'s block.
    pub fn set_pipeline(&mut self, pipeline: &str, key: &str, v: Value) {
        if let Some(p) = self.pipeline_mut(pipeline) {
            object(p).insert(key.to_string(), v);
        }
    }

    /// Set `key` in the block of `pipeline`'s stage `stage`.
    pub fn set_stage(&mut self, pipeline: &str, stage: &str, key: &str, v: Value) {
        let Some(p) = self.pipeline_mut(pipeline) else { return };
        let Some(Value::Array(stages)) = p.get_mut("stages") else { return };
        if let Some(s) = stages.iter_mut().find(|s| s["name"] == stage) {
            object(s).insert(key.to_string(), v);
        }
    }

    fn pipeline_mut(&mut self, name: &str) -> Option<&mut Value> {
        match self.0.get_mut("pipelines") {
            Some(Value::Array(ps)) => ps.iter_mut().find(|p| p["name"] == name),
            _ => None,
        }
    }
}

/// `v` as an object (replacing a non-object).
fn object(v: &mut Value) -> &mut Map<String, Value> {
    if !v.is_object() {
        *v = Value::Object(Map::new());
    }
    match v {
        Value::Object(m) => m,
        _ => unreachable!("made an object above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn blocks_land_where_readers_expect_them() {
        let mut d = StatusDoc::new(json!({"pipelines": [{"name": "p", "stages": [{"name": "s"}]}], "store": {}}));
        d.set(&["store", "triggers"], json!({"fired": 1}));
        d.set(&["cluster"], json!(null));
        d.set_pipeline("p", "selects", json!([]));
        d.set_stage("p", "s", "cache", json!({"hits": 2}));
        d.set_stage("p", "nope", "cache", json!(1));
        d.set_pipeline("q", "x", json!(1));
        assert_eq!(
            d.into_value(),
            json!({"pipelines": [{"name": "p", "selects": [], "stages": [{"name": "s", "cache": {"hits": 2}}]}],
                   "store": {"triggers": {"fired": 1}}, "cluster": null})
        );
    }
}
