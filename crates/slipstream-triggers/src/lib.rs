//! Triggers: a put or delete under a watched prefix invokes the pipeline
//! whose root stage watches it, as a request like any other (admission,
//! queues, batching, deadlines), with the inputs the pipeline declares
//! among `key`, `version`, `op` and `value` (`TRIGGER_INPUTS` of the app spec).
//!
//! One follower task reads the store's change feed and appends each change
//! to a queue per (pipeline, key); one task per non-empty queue delivers its
//! items one at a time, so triggers for a key fire in version order while
//! different keys run in parallel (bounded by a semaphore, so that a burst
//! of puts waits here rather than being refused at admission).
//!
//! A delivery refused for load (429, 503, 504) is retried with backoff for
//! up to [`LOAD_PATIENCE`]; one that fails in the component is retried
//! [`ATTEMPTS`] times. A trigger that still fails is recorded under
//! `/_slipstream/failed-triggers/<pipeline>/...`, counted and logged: never
//! dropped silently. The follower's cursor (the oldest change not yet
//! settled) is persisted about once a second, so after a crash the
//! changes after it fire again (at least once).
//!
//! In a cluster every node applies every committed change to its store, so
//! one node fires them: the trigger leader (the cluster store says which).
//! It records in etcd, at most every 100 ms, the commit (etcd revision)
//! up to which its triggers settled; a node that becomes the leader (the last
//! one died or left) fires again every change after that revision: at
//! least once across the loss of the firing node, in version order per key.
//!
//! A service of the node: it reaches the request path through the node's
//! public API only ([`Node::accept`], [`Node::answer`]) and reports under
//! `store.triggers` in `/v1/status` and as `slipstream_store_triggers_*`.

use parking_lot::Mutex;
use serde_json::json;
use slipstream_core::arena::HeapTensors;
use slipstream_core::events::EventKind;
use slipstream_core::ext::{Service, StatusDoc};
use slipstream_core::prom::PromText;
use slipstream_core::spec::TRIGGER_INPUTS;
use slipstream_core::{Arrival, Node, NodeError, PipelineRt};
use slipstream_store::{Select, StoreError};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};

/// Tries of a trigger whose component fails.
pub const ATTEMPTS: u32 = 5;
/// How long a trigger refused for load keeps being retried.
pub const LOAD_PATIENCE: Duration = Duration::from_secs(300);
/// Values up to this size ride in the trigger's `value` input.
pub const VALUE_INLINE_MAX: u64 = 1 << 20;
/// Where failed triggers are recorded.
pub const FAILED_PREFIX: &str = "/_slipstream/failed-triggers/";
/// How often the cluster's trigger leader records its progress in etcd.
const SETTLE_EVERY: Duration = Duration::from_millis(100);
/// Trigger requests in flight at once, node-wide.
const IN_FLIGHT: usize = 64;

/// One invocation to deliver.
#[derive(Clone, Debug)]
pub struct Item {
    /// The change's sequence number (0 for `trigger_put`, which stores nothing).
    pub seq: u64,
    pub key: String,
    pub version: u64,
    pub op: &'static str,
    /// The value, when the caller holds it (`trigger_put`).
    pub value: Option<bytes::Bytes>,
}

struct Watcher {
    prefix: String,
    pipeline: String,
}

/// Triggers by outcome.
#[derive(Default)]
struct TriggerMetrics {
    fired: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
}

/// The node's store triggers (see the crate docs).
pub struct Triggers {
    watchers: Vec<Watcher>,
    /// Pending items per (pipeline, key); the front one is being delivered.
    queues: Mutex<HashMap<(String, String), VecDeque<Item>>>,
    permits: Semaphore,
    metrics: TriggerMetrics,
}

impl Triggers {
    /// The watchers the stages of `pipelines` declare.
    pub fn new<'a>(pipelines: impl Iterator<Item = &'a Arc<PipelineRt>>) -> Triggers {
        let watchers = pipelines
            .flat_map(|p| {
                p.spec
                    .stages
                    .iter()
                    .filter_map(|s| s.watch.clone())
                    .map(|prefix| Watcher { prefix, pipeline: p.name().to_string() })
            })
            .collect();
        Triggers {
            watchers,
            queues: Mutex::new(HashMap::new()),
            permits: Semaphore::new(IN_FLIGHT),
            metrics: TriggerMetrics::default(),
        }
    }

    /// Whether no stage watches the store.
    pub fn is_empty(&self) -> bool {
        self.watchers.is_empty()
    }

    /// `(prefix, pipeline)` of every watcher.
    pub fn watched(&self) -> Vec<(String, String)> {
        self.watchers.iter().map(|w| (w.prefix.clone(), w.pipeline.clone())).collect()
    }

    /// Items waiting or being delivered.
    pub fn pending(&self) -> usize {
        self.queues.lock().values().map(|q| q.len()).sum()
    }

    /// Queue `item` for every pipeline watching its key; returns how many.
    pub fn offer(self: &Arc<Self>, node: &Arc<Node>, item: &Item) -> usize {
        if item.key.starts_with(slipstream_store::RESERVED_PREFIX) {
            return 0; // the node's own records fire no triggers
        }
        let mut n = 0;
        for w in self.watchers.iter().filter(|w| item.key.starts_with(&w.prefix)) {
            n += 1;
            let k = (w.pipeline.clone(), item.key.clone());
            let mut queues = self.queues.lock();
            let q = queues.entry(k.clone()).or_default();
            q.push_back(item.clone());
            if q.len() == 1 {
                tokio::spawn(drain(node.clone(), self.clone(), k));
            }
        }
        n
    }

    /// The oldest store change not yet settled, minus one (or `cursor`).
    fn watermark(&self, cursor: u64) -> u64 {
        let queues = self.queues.lock();
        queues
            .values()
            .filter_map(|q| q.iter().find(|i| i.seq > 0))
            .map(|i| i.seq - 1)
            .min()
            .unwrap_or(cursor)
            .min(cursor)
    }
}

/// Deliver the queue of (pipeline, key) front to back; the task ends when
/// the queue is empty (and removes it, under the lock that `offer` takes).
async fn drain(node: Arc<Node>, triggers: Arc<Triggers>, k: (String, String)) {
    loop {
        let item = {
            let queues = triggers.queues.lock();
            match queues.get(&k).and_then(|q| q.front().cloned()) {
                Some(i) => i,
                None => return,
            }
        };
        if let Ok(pipe) = node.pipeline(&k.0) {
            if !deliver(&node, &triggers, &pipe, &item).await {
                return; // shutting down: left queued, so the saved cursor stays before it
            }
        }
        let mut queues = triggers.queues.lock();
        let Some(q) = queues.get_mut(&k) else { return };
        q.pop_front();
        if q.is_empty() {
            queues.remove(&k);
            return;
        }
    }
}

fn is_load(e: &NodeError) -> bool {
    matches!(
        e,
        NodeError::Overloaded { .. }
            | NodeError::DeadlineExceeded { .. }
            | NodeError::Timeout { .. }
            | NodeError::Unavailable { .. }
    ) || e.http_status() == 503
}

/// Run one trigger to completion: answered, or recorded as failed (true);
/// false if the node is shutting down first.
async fn deliver(node: &Arc<Node>, triggers: &Triggers, pipe: &Arc<PipelineRt>, item: &Item) -> bool {
    let m = &triggers.metrics;
    let Ok(_permit) = triggers.permits.acquire().await else { return false };
    let started = Instant::now();
    let mut attempts = 0u32;
    let mut backoff = Duration::from_millis(50);
    loop {
        let outcome = async {
            let tensors = inputs(node, pipe, item).await?;
            let (accepted, ()) = node.accept(pipe, Arrival::now(None), |arena| Ok((tensors.to_arena(arena)?, ())))?;
            node.answer(accepted, None).await
        }
        .await;
        let err = match outcome {
            Ok(_) => {
                m.fired.fetch_add(1, Relaxed);
                return true;
            }
            Err(NodeError::ShuttingDown) => return false, // fires again after restart (the cursor)
            Err(e) => e,
        };
        let retry = if is_load(&err) {
            started.elapsed() < LOAD_PATIENCE
        } else {
            attempts += 1;
            attempts < ATTEMPTS
        };
        if !retry {
            record_failure(node, triggers, pipe, item, &err, attempts).await;
            return true;
        }
        m.retried.fetch_add(1, Relaxed);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn record_failure(
    node: &Arc<Node>,
    triggers: &Triggers,
    pipe: &PipelineRt,
    item: &Item,
    err: &NodeError,
    attempts: u32,
) {
    triggers.metrics.failed.fetch_add(1, Relaxed);
    let stage = pipe.spec.stages.iter().find(|s| s.watch.is_some()).map_or("-", |s| s.name.as_str());
    let detail = format!("{} {} v{}: {} (after {attempts} component failure(s))", item.op, item.key, item.version, err);
    node.events().record(pipe.name(), stage, None, EventKind::TriggerFailed, detail);
    let key = format!(
        "{FAILED_PREFIX}{}/{}",
        pipe.name(),
        if item.seq > 0 { format!("seq-{}", item.seq) } else { format!("put-{}", node.next_request_id()) }
    );
    let record = json!({"pipeline": pipe.name(), "key": item.key, "version": item.version, "op": item.op,
                        "seq": item.seq, "error": {"kind": err.kind(), "message": err.to_string()},
                        "component_failures": attempts});
    let store = node.store().clone();
    let body = serde_json::to_vec(&record).expect("serialises");
    let put = tokio::task::spawn_blocking(move || store.put(&key, &body, "application/json", None)).await;
    if !matches!(put, Ok(Ok(_))) {
        tracing::warn!("could not record a failed trigger: {record}");
    }
}

/// One variable-size element (the layout of string and bytes tensors).
fn one_element(elem: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + elem.len());
    slipstream_types::var::push(&mut out, elem);
    out
}

/// The trigger's inputs, those the pipeline declares (on the heap, until
/// the request is accepted).
async fn inputs(node: &Arc<Node>, pipe: &PipelineRt, item: &Item) -> Result<HeapTensors, NodeError> {
    let wants = |n: &str| pipe.spec.inputs.contains_key(n);
    let value: Vec<u8> = match (&item.value, wants("value")) {
        (_, false) => Vec::new(),
        (Some(v), true) => v.to_vec(),
        (None, true) if item.op != "put" => Vec::new(),
        (None, true) => {
            let (key, version) = (item.key.clone(), item.version);
            let read =
                node.read_store(&item.key, move |store| match store.meta(&key, Select::Version(version), false) {
                    Ok(m) if m.size <= VALUE_INLINE_MAX => {
                        store.get(&key, Select::Version(version)).map(|(_, b)| b.as_ref().to_vec())
                    }
                    Ok(_) => Ok(Vec::new()),
                    // Retention already removed that version: the component reads the latest.
                    Err(StoreError::NotFound(_)) => Ok(Vec::new()),
                    Err(e) => Err(e),
                });
            read.await.map_err(|e| NodeError::Internal(format!("store read: {e}")))?
        }
    };
    let mut tensors = HeapTensors::default();
    for (name, dtype) in TRIGGER_INPUTS {
        if !wants(name) {
            continue;
        }
        let bytes = match name {
            "key" => one_element(item.key.as_bytes()),
            "version" => (item.version as i64).to_le_bytes().to_vec(),
            "op" => one_element(item.op.as_bytes()),
            _ => one_element(&value),
        };
        tensors.0.push((name.to_string(), dtype, vec![1], bytes));
    }
    Ok(tensors)
}

/// Follow the change feed from `start` (or the saved cursor) and offer
/// each change to the watchers, until `stop`.
pub async fn follow(node: Arc<Node>, triggers: Arc<Triggers>, mut stop: watch::Receiver<bool>, start: u64) {
    let store = node.store().clone();
    let mut cursor = match store.counter("trigger-cursor") {
        Ok(Some(c)) => c,
        _ => start,
    };
    let first = store.feed_first();
    if cursor + 1 < first {
        node.events().node(
            EventKind::TriggersSkipped,
            format!(
                "changes {}..{} left the feed before they could fire (the node was down too long)",
                cursor + 1,
                first - 1
            ),
        );
        cursor = first - 1;
    }
    let mut changed = store.subscribe();
    let mut saved = cursor;
    let mut last_save = Instant::now();
    // In a cluster every node applies every change; the one node that
    // fires them (the trigger leader) records in etcd up to which commit
    // they settled, and a node that takes over fires again what came after.
    let shared = node.shared_store().cloned();
    let mut leading = false;
    let mut revs: BTreeMap<u64, u64> = BTreeMap::new(); // seq -> etcd revision, offered, not yet recorded
    let mut settled_rev = 0;
    loop {
        if let Some(sh) = &shared {
            match (sh.fires_triggers(), leading) {
                (true, false) => match sh.triggers_settled().await {
                    Ok(upto) => {
                        cursor = seq_after_rev(&store, upto).await.unwrap_or(cursor);
                        (leading, settled_rev) = (true, upto);
                        tracing::info!("firing the cluster's store triggers from etcd revision {upto} on");
                    }
                    Err(e) => tracing::warn!("cannot take over the cluster's triggers yet: {e}"),
                },
                (false, true) => {
                    leading = false;
                    revs.clear();
                }
                _ => {}
            }
        }
        let batch = {
            let store = store.clone();
            tokio::task::spawn_blocking(move || store.changes("/", cursor, 1000)).await
        };
        let full = match batch {
            Ok(Ok((changes, read_to))) => {
                let full = changes.len() == 1000;
                for c in changes.into_iter().filter(|_| shared.is_none() || leading) {
                    if c.rev > 0 {
                        revs.insert(c.seq, c.rev);
                    }
                    let op = if c.deleted { "delete" } else { "put" };
                    triggers.offer(&node, &Item { seq: c.seq, key: c.key, version: c.version, op, value: None });
                }
                cursor = read_to;
                full
            }
            Ok(Err(StoreError::Gone { first, .. })) => {
                cursor = first - 1;
                true
            }
            Ok(Err(e)) => {
                tracing::warn!("reading the change feed: {e}");
                false
            }
            Err(_) => false,
        };
        let mark = triggers.watermark(cursor);
        if mark != saved && last_save.elapsed() >= Duration::from_secs(1) {
            let store = store.clone();
            if matches!(
                tokio::task::spawn_blocking(move || store.set_counter("trigger-cursor", mark)).await,
                Ok(Ok(()))
            ) {
                saved = mark;
            }
            last_save = Instant::now();
        }
        // The cluster's progress is recorded more often (an etcd put at
        // most every SETTLE_EVERY): a takeover fires again only what
        // settled since.
        if let (Some(sh), true) = (&shared, leading) {
            let settled = revs.range(..=mark).next_back().map(|(_, r)| *r);
            if let Some(rev) = settled.filter(|r| *r > settled_rev) {
                match sh.settle_triggers(rev).await {
                    Ok(()) => {
                        settled_rev = rev;
                        revs.retain(|seq, _| *seq > mark);
                    }
                    Err(e) => tracing::warn!("cannot record the triggers' progress in etcd: {e}"),
                }
            }
        }
        if full {
            continue;
        }
        let idle = if leading { SETTLE_EVERY } else { Duration::from_secs(1) };
        tokio::select! {
            _ = changed.changed() => {}
            _ = tokio::time::sleep(idle) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The sequence number just before the first change in this node's feed
/// that a commit after etcd revision `rev` made (the feed's end when there
/// is none yet); None if the feed cannot be read.
async fn seq_after_rev(store: &Arc<slipstream_store::Store>, rev: u64) -> Option<u64> {
    let mut since = store.feed_first().saturating_sub(1);
    loop {
        let s = store.clone();
        let (changes, read_to) = tokio::task::spawn_blocking(move || s.changes("/", since, 1000)).await.ok()?.ok()?;
        if let Some(c) = changes.iter().find(|c| c.rev > rev) {
            return Some(c.seq - 1);
        }
        if changes.len() < 1000 {
            return Some(read_to);
        }
        since = read_to;
    }
}

impl Triggers {
    /// Watchers and outcomes (`store.triggers` in `/v1/status` and `GET /v1/store`).
    pub fn report(&self) -> serde_json::Value {
        let watching: Vec<_> = self
            .watched()
            .into_iter()
            .map(|(prefix, pipeline)| json!({"prefix": prefix, "pipeline": pipeline}))
            .collect();
        json!({"watching": watching, "pending": self.pending(), "fired": self.metrics.fired.load(Relaxed),
               "retried": self.metrics.retried.load(Relaxed), "failed": self.metrics.failed.load(Relaxed)})
    }
}

impl Service for Triggers {
    fn status(&self, doc: &mut StatusDoc) {
        doc.set(&["store", "triggers"], self.report());
    }

    fn metrics(&self, t: &mut PromText) {
        let tm = &self.metrics;
        for (outcome, n) in [("fired", &tm.fired), ("retried", &tm.retried), ("failed", &tm.failed)] {
            t.counter(
                "slipstream_store_triggers_total",
                "Store triggers by outcome (fired: answered; retried: another try; failed: recorded under /_slipstream/failed-triggers/).",
                &[("outcome", outcome)],
                n.load(Relaxed),
            );
        }
        t.gauge(
            "slipstream_store_triggers_pending",
            "Store triggers queued or being delivered.",
            &[],
            self.pending() as f64,
        );
    }
}
