//! One object store across the cluster (`docs/design/store.md`, "Across
//! the cluster"): the nodes that run the stages are the store, etcd orders
//! its versions, bytes stay on the nodes.
//!
//! - **etcd holds metadata only**, under `/slipstream/<cluster>/store/`:
//!   `head<key>` (the key's latest version's record, the thing a commit
//!   compares) and `ver<key>@<version>` (every version's record, which
//!   every node follows). A record names the version, its commit
//!   timestamp, size, media type, SHA-256 digest and the nodes holding its
//!   bytes; it is signed with the cluster key like every other record.
//! - **A put** through any node: the node (the coordinator) hashes the
//!   value, reads the key's head, sends the bytes to the replica set
//!   (rendezvous hashing of the key, or of its affinity group, over the
//!   live members: RF nodes), each of which checks the digest and holds
//!   them durably ([`slipstream_store::Store::hold`]); once W have, one
//!   etcd transaction compares the head's revision with the one read and
//!   writes the new head and version record. That transaction is the
//!   order of versions; the put is answered after it (and after this node
//!   applied it). A put that loses the compare is tried again
//!   (unconditional) or refused as a conflict (conditional).
//! - **Every node applies every committed version, in order** (the
//!   follower: a load of `ver` then a watch from the revision after it):
//!   its own store is a mirror of the cluster's, so reads by version or by
//!   time, listings, the change feed, the cache's invalidation and triggers
//!   work on it unchanged. A holder's version takes its held bytes; on
//!   the others the version's record says where the bytes are, and the
//!   first read fetches them from a holder over the data plane, checks the
//!   digest and keeps them.
//! - **Reads see acknowledged writes**: a latest read first asks etcd for
//!   the key's head and waits until this node applied it (a few ms after
//!   the commit on a healthy cluster).
//!
//! The node's reserved keys (`/_slipstream/...`) stay local to each node.

mod repair;

use crate::{open, seal, Cluster};
use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use slipstream_core::ext::{GroupHome, SharedStore, SharedWrite, StoreFuture};
use slipstream_core::prom::PromText;
use slipstream_etcd::{Etcd, EtcdError, Kv, WatchEvent};
use slipstream_peer::{Incoming, OutTensor, Outgoing, PeerError};
use slipstream_store::{Committed, Replicated, Select, Store, StoreError, Write};
use slipstream_types::DType;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// The record kind objects are sealed as.
const KIND: &str = "object";
/// The record kind of the triggers' settled revision.
const TRIGGERS_KIND: &str = "triggers-settled";
/// How long a read waits for this node to apply a commit it learned of.
const SYNC_PATIENCE: Duration = Duration::from_secs(5);
/// How long a joining node keeps trying to load the store's records.
const LOAD_PATIENCE: Duration = Duration::from_secs(60);
/// Commits a put tries before it gives up on a key others keep changing.
const MAX_ATTEMPTS: u32 = 32;
/// How often the placement's count of group bytes per node is redone.
const GROUP_BYTES_EVERY: Duration = Duration::from_secs(5);
/// Keys per pool that count is bounded to (a sample beyond it).
const GROUP_BYTES_KEYS: usize = 100_000;
/// The tag every store call's meta starts with (see [`is_store_call`]).
const CALL_TAG: &[u8] = b"{\"store\":";

/// One version as etcd records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct ObjectRecord {
    pub(crate) key: String,
    pub(crate) version: u64,
    /// Commit timestamp, unix µs (monotonic per key).
    pub(crate) ts_us: u64,
    pub(crate) size: u64,
    pub(crate) ct: String,
    /// SHA-256 of the value, hex.
    pub(crate) digest: String,
    /// The nodes that held the bytes durably when it committed.
    pub(crate) holders: Vec<String>,
    pub(crate) deleted: bool,
}

/// A store call on the data plane.
#[derive(Serialize, Deserialize)]
#[serde(tag = "store", rename_all = "lowercase")]
enum StoreCall {
    /// Hold the value (the frame's tensors, in order) for this version.
    Hold { key: String, version: u64, digest: String },
    /// Answer the value of this version, if held here.
    Read { key: String, version: u64, digest: String },
}

/// Whether a data-plane call's meta is a store call (the batch calls'
/// meta never starts with this tag).
pub(crate) fn is_store_call(meta: &[u8]) -> bool {
    meta.starts_with(CALL_TAG)
}

#[derive(Default)]
struct Counters {
    puts: AtomicU64,
    conflicts_retried: AtomicU64,
    applied: AtomicU64,
    fetches: AtomicU64,
    fetched_bytes: AtomicU64,
    holds_served: AtomicU64,
    reads_served: AtomicU64,
    refused_records: AtomicU64,
}

/// Held while a version's bytes are fetched (one fetch per version at a time).
type FetchLock = Arc<tokio::sync::Mutex<()>>;

/// The cluster's shared store on this node.
pub(crate) struct ClusterStore {
    cluster: Arc<Cluster>,
    etcd: Etcd,
    store: Arc<Store>,
    /// `/slipstream/<cluster>/store/`.
    root: String,
    /// Copies of each value (the replica set's size).
    replicas: usize,
    /// The etcd revision this node's store has applied.
    applied: watch::Sender<i64>,
    /// One fetch per version at a time.
    fetching: Mutex<HashMap<(String, u64), FetchLock>>,
    counters: Counters,
    repair: repair::RepairCounters,
    /// [`ClusterStore::group_bytes`]'s last answer, and when.
    group_bytes: Mutex<Option<(Instant, BTreeMap<String, u64>)>>,
    /// Itself, for the futures the [`SharedStore`] calls return.
    me: std::sync::Weak<ClusterStore>,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Io(format!("cluster store: {e}"))
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// The rendezvous key of pool `pool`'s affinity group `group`.
fn group_key(pool: &str, group: &str) -> String {
    format!("{pool}\0{group}")
}

/// A store that took writes outside a cluster cannot join one: its
/// versions are not in etcd (no other node could read them) and the
/// cluster's versions of the same keys would skip the numbers it has.
/// (A cluster's versions carry their digest; a single node's writes do not.)
fn refuse_outside_writes(store: &Store) -> Result<(), String> {
    let (metas, more) = store.keys("/", 1_000_000).map_err(|e| format!("cannot read the node's store: {e}"))?;
    let outside: Vec<&str> = metas
        .iter()
        .filter(|m| !m.key.starts_with(slipstream_store::RESERVED_PREFIX) && m.digest.is_none())
        .map(|m| m.key.as_str())
        .collect();
    let Some(first) = outside.first() else { return Ok(()) };
    Err(format!(
        "the store at {} holds {}{} key(s) written outside a cluster (e.g. {first}); a cluster node needs a store \
         of its own: start it with another --store directory (or none, for a temporary one) and put those keys \
         through the cluster",
        store.dir().display(),
        outside.len(),
        if more { "+" } else { "" },
    ))
}

/// SHA-256 of the parts, hex.
pub(crate) fn digest_of<B: AsRef<[u8]>>(parts: &[B]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_ref());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The rendezvous (highest random weight) order of `members` for `group`:
/// a member's rank for a group does not depend on the others, so a member
/// joining or leaving moves only the groups it ranks first in.
pub(crate) fn rendezvous<'a>(group: &str, members: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut scored: Vec<([u8; 8], &str)> = members
        .map(|m| {
            let mut h = Sha256::new();
            h.update(group.as_bytes());
            h.update([0]);
            h.update(m.as_bytes());
            let d = h.finalize();
            (d[..8].try_into().expect("8 bytes"), m)
        })
        .collect();
    scored.sort_by(|a, b| b.cmp(a));
    scored.into_iter().map(|(_, m)| m.to_string()).collect()
}

impl ClusterStore {
    /// Load every committed version into this node's store, then follow
    /// new ones (in a task, until `stop`).
    pub(crate) async fn start(
        cluster: Arc<Cluster>,
        etcd: Etcd,
        store: Arc<Store>,
        replicas: usize,
        stop: watch::Receiver<bool>,
    ) -> Result<Arc<ClusterStore>, String> {
        refuse_outside_writes(&store)?;
        let root = format!("{}store/", cluster.opts.root());
        let me = Arc::new_cyclic(|me| ClusterStore {
            cluster,
            etcd,
            store,
            root,
            replicas: replicas.max(1),
            applied: watch::channel(0).0,
            fetching: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            repair: repair::RepairCounters::default(),
            group_bytes: Mutex::new(None),
            me: me.clone(),
        });
        // etcd may be slow for a moment on a busy machine: try for a while
        // before giving up on joining.
        let mut wait = Duration::from_millis(100);
        let until = Instant::now() + LOAD_PATIENCE;
        let rev = loop {
            match me.load().await {
                Ok(rev) => break rev,
                Err(e) if Instant::now() < until => {
                    tracing::warn!("{e}; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        };
        tokio::spawn(me.clone().follow(rev, stop.clone()));
        tokio::spawn(repair::run(me.clone(), stop));
        Ok(me)
    }

    /// Where the trigger leader records up to which commit (etcd revision)
    /// the cluster's triggers have settled.
    fn triggers_key(&self) -> String {
        format!("{}triggers-settled", self.root)
    }

    fn head_key(&self, key: &str) -> String {
        format!("{}head{key}", self.root)
    }

    fn ver_key(&self, key: &str, version: u64) -> String {
        format!("{}ver{key}@{version:020}", self.root)
    }

    fn decode(&self, kv: &Kv) -> Option<ObjectRecord> {
        match open::<ObjectRecord>(&self.cluster.key, KIND, &kv.value) {
            Ok(r) => Some(r),
            Err(why) => {
                self.counters.refused_records.fetch_add(1, Relaxed);
                tracing::warn!("cluster store: ignoring the record at {}: {why}", kv.key);
                None
            }
        }
    }

    /// Apply every version record under `ver` (as of now); its revision.
    async fn load(&self) -> Result<i64, String> {
        let (kvs, rev) = self
            .etcd
            .get_prefix(&format!("{}ver", self.root))
            .await
            .map_err(|e| format!("cannot read the cluster store's records: {e}"))?;
        let records: Vec<(ObjectRecord, i64)> =
            kvs.iter().filter_map(|kv| self.decode(kv).map(|r| (r, kv.mod_revision))).collect();
        let n = records.len();
        self.apply(records).await.map_err(|e| format!("cannot apply the cluster store's records: {e}"))?;
        self.applied.send_replace(rev);
        if n > 0 {
            tracing::info!("cluster store: {n} version(s) loaded as of etcd revision {rev}");
        }
        Ok(rev)
    }

    /// Follow the version records from after `rev`, applying them in order.
    async fn follow(self: Arc<Self>, rev: i64, mut stop: watch::Receiver<bool>) {
        let mut events = self.etcd.watch_prefix(&format!("{}ver", self.root), rev + 1);
        loop {
            let first = tokio::select! {
                e = events.recv() => e,
                _ = stop.wait_for(|s| *s) => return,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            while batch.len() < 256 {
                match events.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) => break,
                }
            }
            let mut records = Vec::new();
            let mut upto = 0;
            let mut resync = false;
            for e in batch {
                match e {
                    WatchEvent::Put(kv) => {
                        upto = upto.max(kv.mod_revision);
                        records.extend(self.decode(&kv).map(|r| (r, kv.mod_revision)));
                    }
                    // Old versions' records leave etcd with retention; the
                    // node's own retention removes them here.
                    WatchEvent::Delete { mod_revision, .. } => upto = upto.max(mod_revision),
                    WatchEvent::Resync => resync = true,
                }
            }
            // Retried until it applies: a version is never skipped.
            let mut wait = Duration::from_millis(50);
            loop {
                let done = match self.apply(records.clone()).await {
                    Ok(()) if resync => self.load().await.map(|_| ()),
                    r => r.map_err(|e| e.to_string()),
                };
                match done {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!("cluster store: applying committed versions failed ({e}); retrying");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(2));
                    }
                }
            }
            self.prefetch(&records);
            self.applied.send_if_modified(|r| {
                let moved = upto > *r;
                *r = (*r).max(upto);
                moved
            });
        }
    }

    /// Apply `records` (each with the etcd revision that wrote it) to this
    /// node's store, in order, in one group commit.
    async fn apply(&self, records: Vec<(ObjectRecord, i64)>) -> Result<(), StoreError> {
        if records.is_empty() {
            return Ok(());
        }
        let n = records.len() as u64;
        let writes: Vec<Write> = records
            .into_iter()
            .map(|(r, rev)| Write {
                replicated: Some(Replicated {
                    version: r.version,
                    ts_us: r.ts_us,
                    size: r.size,
                    rev: rev.max(0) as u64,
                    digest: r.digest,
                    holders: r.holders,
                    deleted: r.deleted,
                }),
                key: r.key,
                value: None,
                content_type: r.ct,
                if_version: None,
            })
            .collect();
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.write_all(writes))
            .await
            .map_err(unavailable)?
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        self.counters.applied.fetch_add(n, Relaxed);
        Ok(())
    }

    /// Wait until this node applied etcd revision `rev`.
    async fn applied_to(&self, rev: i64) -> Result<(), StoreError> {
        let mut rx = self.applied.subscribe();
        let reached = matches!(tokio::time::timeout(SYNC_PATIENCE, rx.wait_for(|r| *r >= rev)).await, Ok(Ok(_)));
        match reached {
            true => Ok(()),
            false => Err(unavailable(format!(
                "this node has not applied the cluster's commit at etcd revision {rev} after {SYNC_PATIENCE:?}"
            ))),
        }
    }

    /// The replica set for `key`: RF live members (its pool's copies) by
    /// rendezvous order of its affinity group (or the key itself).
    fn replica_set(&self, key: &str) -> Result<Vec<String>, StoreError> {
        let group = slipstream_store::affinity_of(&self.store.options().pools, key)
            .map_or_else(|| key.to_string(), |(pool, g)| group_key(&pool, &g));
        self.replica_set_of(&group, self.copies(key).0)
    }

    /// Copies of `key`'s values (RF) and copies a put needs durable (W):
    /// its pool's, else this node's setting (W = RF).
    pub(crate) fn copies(&self, key: &str) -> (usize, usize) {
        let pool = slipstream_store::pool_of(&self.store.options().pools, key);
        let rf = pool.and_then(|p| p.copies).map_or(self.replicas, |c| c as usize).max(1);
        let w = pool.and_then(|p| p.write_copies).map_or(rf, |c| c as usize).clamp(1, rf);
        (rf, w)
    }

    /// The first `rf` live members in the rendezvous order of `group` (a
    /// group's key, or a key).
    fn replica_set_of(&self, group: &str, rf: usize) -> Result<Vec<String>, StoreError> {
        let view = self.cluster.view();
        let live = view.placeable().filter(|m| !view.suspects.contains(*m));
        let mut set = rendezvous(group, live);
        set.truncate(rf);
        if set.is_empty() {
            return Err(unavailable("no live member to hold the value"));
        }
        Ok(set)
    }

    /// Commit one write for the cluster (see the module docs).
    async fn commit(self: Arc<Self>, w: SharedWrite) -> Result<Committed, StoreError> {
        slipstream_store::check_key(&w.key)?;
        let key = w.key.clone();
        let value: Option<Arc<Vec<Bytes>>> = w.value.map(Arc::new);
        let (digest, size) = match &value {
            Some(parts) => {
                let p = parts.clone();
                let d = tokio::task::spawn_blocking(move || digest_of(&p)).await.map_err(unavailable)?;
                (d, parts.iter().map(|b| b.len() as u64).sum())
            }
            None => (String::new(), 0),
        };
        let head_key = self.head_key(&key);
        let mut wait = Duration::from_millis(2);
        for _ in 0..MAX_ATTEMPTS {
            let head = self.etcd.get(&head_key).await.map_err(unavailable)?;
            let (mod_rev, prev) = match &head {
                Some(kv) => (
                    kv.mod_revision,
                    Some(self.decode(kv).ok_or_else(|| unavailable(format!("{key}: its head record is not signed")))?),
                ),
                None => (0, None),
            };
            let latest = prev.as_ref().map_or(0, |p| p.version);
            if let Some(expected) = w.if_version {
                if expected != latest {
                    return Err(StoreError::Conflict { key, expected, current: latest });
                }
            }
            if value.is_none() && prev.as_ref().is_none_or(|p| p.deleted) {
                return Err(StoreError::NotFound(format!("no live value to delete at {key}")));
            }
            let version = latest + 1;
            let set = self.replica_set(&key)?;
            let holders = match &value {
                Some(parts) => match self.replicate(&key, version, &digest, parts, &set).await {
                    Ok(h) => h,
                    // A node of the set is unreachable (dead, its lease not yet
                    // expired): it is suspected now, and the next try's set
                    // goes around it.
                    Err((e, true)) => {
                        tracing::debug!("{e}; trying another replica set");
                        back_off(&mut wait).await;
                        continue;
                    }
                    Err((e, false)) => return Err(e),
                },
                None => set,
            };
            let rec = ObjectRecord {
                key: key.clone(),
                version,
                ts_us: now_us().max(prev.as_ref().map_or(0, |p| p.ts_us + 1)),
                size,
                ct: if value.is_some() { w.content_type.clone() } else { String::new() },
                digest: digest.clone(),
                holders,
                deleted: value.is_none(),
            };
            let sealed = seal(&self.cluster.key, KIND, &rec);
            let ver_key = self.ver_key(&key, version);
            let keep = self.pool_keep(&key);
            let old = (version > keep).then(|| self.ver_key(&key, version - keep));
            let deletes: Vec<&str> = old.iter().map(String::as_str).collect();
            let puts = [(head_key.as_str(), sealed.as_slice()), (ver_key.as_str(), sealed.as_slice())];
            match self.etcd.txn_if(&head_key, mod_rev, &puts, &deletes, None).await {
                Ok(Ok(rev)) => {
                    self.counters.puts.fetch_add(1, Relaxed);
                    // Committed: the answer says so even if this node is slow
                    // to apply it (a read here then waits for it).
                    if let Err(e) = self.applied_to(rev).await {
                        tracing::warn!("{key} v{version} committed; {e}");
                        return Ok(Committed { meta: self.meta_of(&rec), seq: 0 });
                    }
                    let store = self.store.clone();
                    let meta = tokio::task::spawn_blocking(move || store.meta(&key, Select::Version(version), false))
                        .await
                        .map_err(unavailable)??;
                    return Ok(Committed { meta, seq: self.store.seq() });
                }
                Ok(Err(current)) => {
                    if let Some(expected) = w.if_version {
                        let current = current.as_ref().and_then(|kv| self.decode(kv)).map_or(0, |r| r.version);
                        return Err(StoreError::Conflict { key, expected, current });
                    }
                    self.counters.conflicts_retried.fetch_add(1, Relaxed);
                    back_off(&mut wait).await;
                }
                Err(EtcdError::Unreachable(why)) => {
                    return Err(unavailable(format!(
                        "etcd did not answer the commit of {key} ({why}); it may or may not have happened"
                    )))
                }
                Err(e) => return Err(unavailable(e)),
            }
        }
        Err(unavailable(format!("{key}: gave up after {MAX_ATTEMPTS} commits lost to concurrent writers")))
    }

    /// What a reader learns of the version `rec` records (before this node applied it).
    fn meta_of(&self, rec: &ObjectRecord) -> slipstream_store::Meta {
        slipstream_store::Meta {
            key: rec.key.clone(),
            version: rec.version,
            timestamp: rec.ts_us as f64 / 1e6,
            size: rec.size,
            content_type: rec.ct.clone(),
            deleted: rec.deleted,
            path: None,
            digest: Some(rec.digest.clone()),
            holders: rec.holders.clone(),
            local: rec.holders.iter().any(|h| h == self.cluster.me()),
        }
    }

    /// Versions of `key` etcd keeps (its pool's `keep_versions`).
    fn pool_keep(&self, key: &str) -> u64 {
        slipstream_store::pool_of(&self.store.options().pools, key).map_or(16, |p| p.keep_versions)
    }

    /// Send the value to every node of `set`; the nodes that hold it
    /// durably (at least the key's W of them, or the put fails). Err(_,
    /// true): too few, and a node could not be reached and is suspected
    /// now (try another set).
    async fn replicate(
        self: &Arc<Self>,
        key: &str,
        version: u64,
        digest: &str,
        parts: &Arc<Vec<Bytes>>,
        set: &[String],
    ) -> Result<Vec<String>, (StoreError, bool)> {
        let size: u64 = parts.iter().map(|b| b.len() as u64).sum();
        let patience = transfer_patience(size);
        let view = self.cluster.view();
        let mut tasks = Vec::with_capacity(set.len());
        for node in set {
            let (me, parts, view, node) = (self.clone(), parts.clone(), view.clone(), node.clone());
            let (key, digest) = (key.to_string(), digest.to_string());
            tasks.push(tokio::spawn(async move {
                let r = if node == me.cluster.me() {
                    let store = me.store.clone();
                    tokio::task::spawn_blocking(move || {
                        store.stage(&parts).and_then(|v| store.hold(&key, version, &digest, v))
                    })
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| e.to_string()))
                } else {
                    match view.members.get(&node) {
                        None => Err("not a member".to_string()),
                        Some(m) => {
                            let msg = hold_call(key, version, digest, parts.iter().cloned());
                            match me.cluster.peers.call(m.data, msg, patience).await {
                                Ok(_) => Ok(()),
                                Err(e @ (PeerError::Disconnected(_) | PeerError::Refused | PeerError::Timeout)) => {
                                    me.cluster.suspect(&node, &format!("store copy failed: {e}"));
                                    Err(format!("{e} (suspected)"))
                                }
                                Err(e) => Err(e.to_string()),
                            }
                        }
                    }
                };
                (node, r)
            }));
        }
        let mut results = Vec::with_capacity(tasks.len());
        for t in tasks {
            results.push(t.await.map_err(|e| (unavailable(e), false))?);
        }
        let mut held = Vec::new();
        let mut failed = Vec::new();
        for (node, r) in results {
            match r {
                Ok(()) => held.push(node),
                Err(e) => failed.push(format!("{node}: {e}")),
            }
        }
        let need = self.copies(key).1.min(set.len());
        if held.len() < need {
            let retry = failed.iter().any(|f| f.ends_with("(suspected)"));
            let e = unavailable(format!(
                "{key}: {} of {} replica node(s) took the value, {need} must ({}); not committed",
                held.len(),
                set.len(),
                failed.join("; ")
            ));
            return Err((e, retry));
        }
        Ok(held)
    }

    /// Fetch a version's bytes from a holder and keep them here.
    async fn fetch_one(self: Arc<Self>, key: String, version: u64) -> Result<(), StoreError> {
        let lock = self.fetching.lock().entry((key.clone(), version)).or_default().clone();
        let _one = lock.lock().await;
        let result = self.clone().fetch_locked(&key, version).await;
        if result.is_ok() && self.hosting(&key).contains(self.cluster.me()) {
            // A model update's first phase: this node, which runs a stage
            // that needs the key, holds the version now (see `rollout_waits`).
            if let Err(e) = self.register_holder(&key, version).await {
                tracing::warn!("cluster store: cannot record this node as holding {key} v{version}: {e}");
            }
        }
        self.fetching.lock().remove(&(key, version));
        result
    }

    /// Bytes of affinity groups (the latest versions of keys in pools with
    /// an affinity rule) each node holds, for the placement: recounted
    /// from this node's mirror at most every [`GROUP_BYTES_EVERY`].
    pub(crate) fn group_bytes(&self) -> BTreeMap<String, u64> {
        let mut cached = self.group_bytes.lock();
        if let Some((at, bytes)) = cached.as_ref() {
            if at.elapsed() < GROUP_BYTES_EVERY {
                return bytes.clone();
            }
        }
        let mut out = BTreeMap::new();
        for pool in self.store.options().pools.iter().filter(|p| p.affinity.is_some()) {
            let Ok((metas, _)) = self.store.keys(&pool.prefix, GROUP_BYTES_KEYS) else { continue };
            for m in metas {
                for h in m.holders {
                    *out.entry(h).or_insert(0) += m.size;
                }
            }
        }
        *cached = Some((Instant::now(), out.clone()));
        out
    }

    /// The live members placed to run a stage that `needs` `key`.
    fn hosting(&self, key: &str) -> BTreeSet<String> {
        let view = self.cluster.view();
        let Some(placement) = &view.placement else { return BTreeSet::new() };
        let mut out = BTreeSet::new();
        for p in &self.cluster.pipelines {
            for (i, _) in p.spec.stages.iter().enumerate().filter(|(_, s)| s.needs.values().any(|k| k == key)) {
                let Some(nodes) = placement.stages.get(&p.stage_key(i)) else { continue };
                let live = nodes.iter().filter(|(n, c)| **c > 0 && view.members.contains_key(n.as_str()));
                out.extend(live.map(|(n, _)| n.clone()));
            }
        }
        out
    }

    /// Fetch the newest versions just committed of keys that a stage
    /// placed here needs (a model update's first phase starts on every
    /// hosting node at once, not when its replicas next read).
    fn prefetch(self: &Arc<Self>, records: &[(ObjectRecord, i64)]) {
        let me = self.cluster.me();
        for (r, _) in records {
            if r.deleted || r.holders.iter().any(|h| h == me) || !self.hosting(&r.key).contains(me) {
                continue;
            }
            let newest = self.store.meta(&r.key, Select::Latest, false).is_ok_and(|m| m.version == r.version);
            if newest {
                let (me, key, version) = (self.clone(), r.key.clone(), r.version);
                tokio::spawn(async move {
                    if let Err(e) = me.fetch_one(key.clone(), version).await {
                        tracing::warn!("cluster store: cannot prefetch {key} v{version}: {e}");
                    }
                });
            }
        }
    }

    /// Add this node to the holders of `key`'s version `version`.
    async fn register_holder(&self, key: &str, version: u64) -> Result<(), StoreError> {
        let me = self.cluster.me().to_string();
        let ver_key = self.ver_key(key, version);
        for _ in 0..MAX_ATTEMPTS {
            // Gone (retention dropped it) or not decodable: nothing to add to.
            let Some(kv) = self.etcd.get(&ver_key).await.map_err(unavailable)? else { return Ok(()) };
            let Some(rec) = self.decode(&kv) else { return Ok(()) };
            if rec.deleted || rec.holders.contains(&me) {
                return Ok(());
            }
            let mut holders = rec.holders.clone();
            holders.push(me.clone());
            if self.record_holders(&rec, kv.mod_revision, holders).await? {
                return Ok(());
            }
        }
        Err(unavailable(format!("its record kept changing ({MAX_ATTEMPTS} tries)")))
    }

    async fn fetch_locked(self: Arc<Self>, key: &str, version: u64) -> Result<(), StoreError> {
        let store = self.store.clone();
        let k = key.to_string();
        let meta = tokio::task::spawn_blocking(move || store.meta(&k, Select::Version(version), false))
            .await
            .map_err(unavailable)??;
        if meta.local || meta.deleted {
            return Ok(());
        }
        let digest = meta.digest.clone().ok_or_else(|| unavailable(format!("{key} v{version} has no digest")))?;
        let view = self.cluster.view();
        let mut errors = Vec::new();
        // Holders this node does not suspect first.
        let mut holders: Vec<&String> = meta.holders.iter().filter(|h| h.as_str() != self.cluster.me()).collect();
        holders.sort_by_key(|h| view.suspects.contains(h.as_str()));
        let started = Instant::now();
        for h in holders {
            let Some(m) = view.members.get(h.as_str()) else {
                errors.push(format!("{h}: not a live member"));
                continue;
            };
            let call = StoreCall::Read { key: key.to_string(), version, digest: digest.clone() };
            let msg = Outgoing::call(serde_json::to_vec(&call).expect("serialises"), vec![]);
            let mut inc = match self.cluster.peers.call(m.data, msg, transfer_patience(meta.size)).await {
                Ok(inc) => inc,
                Err(e) => {
                    errors.push(format!("{h}: {e}"));
                    continue;
                }
            };
            let Some(bytes) = inc.tensor_data(0).map(<[u8]>::to_vec) else {
                errors.push(format!("{h}: an answer without the value"));
                continue;
            };
            let (store, k, d) = (self.store.clone(), key.to_string(), digest.clone());
            let rep = Replicated {
                version,
                ts_us: (meta.timestamp * 1e6).round() as u64,
                size: meta.size,
                digest: digest.clone(),
                holders: Vec::new(),
                deleted: false,
                rev: 0,
            };
            let ct = meta.content_type.clone();
            let filled = tokio::task::spawn_blocking(move || {
                if digest_of(&[&bytes]) != d {
                    return Err(StoreError::Io("the bytes do not match the version's digest".into()));
                }
                let value = store.stage(&[&bytes])?;
                store.write(Write {
                    key: k,
                    value: Some(value),
                    content_type: ct,
                    if_version: None,
                    replicated: Some(rep),
                })
            })
            .await
            .map_err(unavailable)?;
            match filled {
                Ok(_) => {
                    self.counters.fetches.fetch_add(1, Relaxed);
                    self.counters.fetched_bytes.fetch_add(meta.size, Relaxed);
                    tracing::debug!(
                        "fetched {key} v{version} ({} bytes) from {h} in {:?}",
                        meta.size,
                        started.elapsed()
                    );
                    return Ok(());
                }
                Err(e) => errors.push(format!("{h}: {e}")),
            }
        }
        Err(unavailable(format!("no holder of {key} v{version} gave its bytes ({})", errors.join("; "))))
    }

    /// Answer a store call from another node.
    pub(crate) async fn serve(self: Arc<Self>, from: &str, mut inc: Incoming<crate::wire::ArenaBuf>) -> Outgoing {
        let call: StoreCall = match serde_json::from_slice(&inc.meta) {
            Ok(c) => c,
            Err(e) => return Outgoing::error(format!("malformed store call from {from}: {e}")),
        };
        match call {
            StoreCall::Hold { key, version, digest } => {
                let mut parts = Vec::with_capacity(inc.tensors.len());
                for i in 0..inc.tensors.len() {
                    parts.push(inc.tensor_data(i).map(<[u8]>::to_vec).unwrap_or_default());
                }
                let store = self.store.clone();
                let held = tokio::task::spawn_blocking(move || {
                    if digest_of(&parts) != digest {
                        return Err(StoreError::BadRequest("the bytes do not match their digest".into()));
                    }
                    store.stage(&parts).and_then(|v| store.hold(&key, version, &digest, v))
                })
                .await;
                match held {
                    Ok(Ok(())) => {
                        self.counters.holds_served.fetch_add(1, Relaxed);
                        Outgoing::reply(b"{}".to_vec(), vec![])
                    }
                    Ok(Err(e)) => Outgoing::error(e.to_string()),
                    Err(e) => Outgoing::error(e.to_string()),
                }
            }
            StoreCall::Read { key, version, digest } => {
                let store = self.store.clone();
                match tokio::task::spawn_blocking(move || store.value_of(&key, version, &digest)).await {
                    Ok(Ok(Some(body))) => {
                        self.counters.reads_served.fetch_add(1, Relaxed);
                        Outgoing::reply(b"{}".to_vec(), vec![raw_tensor(Bytes::from_owner(body))])
                    }
                    Ok(Ok(None)) => Outgoing::error("not held here"),
                    Ok(Err(e)) => Outgoing::error(e.to_string()),
                    Err(e) => Outgoing::error(e.to_string()),
                }
            }
        }
    }

    /// The status block (`cluster.store`).
    pub(crate) fn status(&self) -> serde_json::Value {
        let c = &self.counters;
        serde_json::json!({
            "replicas": self.replicas,
            "applied_revision": *self.applied.borrow(),
            "puts": c.puts.load(Relaxed),
            "conflicts_retried": c.conflicts_retried.load(Relaxed),
            "versions_applied": c.applied.load(Relaxed),
            "fetches": c.fetches.load(Relaxed),
            "fetched_bytes": c.fetched_bytes.load(Relaxed),
            "holds_served": c.holds_served.load(Relaxed),
            "reads_served": c.reads_served.load(Relaxed),
            "refused_records": c.refused_records.load(Relaxed),
            "repair": self.repair.status(),
        })
    }

    pub(crate) fn metrics(&self, t: &mut PromText) {
        let c = &self.counters;
        for (name, help, v) in [
            ("slipstream_cluster_store_puts_total", "Writes this node committed for the cluster.", &c.puts),
            ("slipstream_cluster_store_fetches_total", "Values fetched from another node.", &c.fetches),
            ("slipstream_cluster_store_fetched_bytes_total", "Bytes fetched from other nodes.", &c.fetched_bytes),
            ("slipstream_cluster_store_applied_total", "Committed versions applied to this node's store.", &c.applied),
        ] {
            t.counter(name, help, &[], v.load(Relaxed));
        }
        self.repair.metrics(t);
    }
}

/// A value's bytes as a data-plane tensor.
fn raw_tensor(data: Bytes) -> OutTensor {
    OutTensor { name: String::new(), dtype: DType::Uint8, shape: vec![data.len() as u64], data }
}

/// How long moving `size` bytes between nodes may take (10 s, plus 20 ms per MB).
fn transfer_patience(size: u64) -> Duration {
    Duration::from_secs(10) + Duration::from_millis(size / 50_000)
}

/// Sleep a jittered `wait` (half to all of it), then double it, up to 100 ms:
/// the back-off between a put's tries.
async fn back_off(wait: &mut Duration) {
    tokio::time::sleep(wait.mul_f64(rand::random_range(0.5..1.0))).await;
    *wait = (*wait * 2).min(Duration::from_millis(100));
}

/// The call that asks a node to hold a version's value (its `parts`).
fn hold_call(key: String, version: u64, digest: String, parts: impl Iterator<Item = Bytes>) -> Outgoing {
    let call = StoreCall::Hold { key, version, digest };
    Outgoing::call(serde_json::to_vec(&call).expect("serialises"), parts.map(raw_tensor).collect())
}

impl ClusterStore {
    fn arc(&self) -> Arc<ClusterStore> {
        self.me.upgrade().expect("the cluster store is alive while it is called")
    }
}

impl SharedStore for ClusterStore {
    fn write(&self, w: SharedWrite) -> StoreFuture<Committed> {
        let me = self.arc();
        Box::pin(me.commit(w))
    }

    fn sync(&self, key: &str) -> StoreFuture<bool> {
        let me = self.arc();
        let head_key = self.head_key(key);
        Box::pin(async move {
            match me.etcd.get(&head_key).await {
                Ok(Some(kv)) => me.applied_to(kv.mod_revision).await.map(|()| true),
                Ok(None) => Ok(true),
                Err(e) => {
                    tracing::debug!("cluster store: serving {head_key} from this node's view: {e}");
                    Ok(false)
                }
            }
        })
    }

    fn fetch(&self, key: &str, version: u64) -> StoreFuture<()> {
        let me = self.arc();
        Box::pin(me.fetch_one(key.to_string(), version))
    }

    fn fires_triggers(&self) -> bool {
        self.cluster.view().members.keys().next().map(String::as_str) == Some(self.cluster.me())
    }

    fn triggers_settled(&self) -> StoreFuture<u64> {
        let me = self.arc();
        Box::pin(async move {
            let Some(kv) = me.etcd.get(&me.triggers_key()).await.map_err(unavailable)? else { return Ok(0) };
            open::<u64>(&me.cluster.key, TRIGGERS_KIND, &kv.value).map_err(unavailable)
        })
    }

    fn settle_triggers(&self, rev: u64) -> StoreFuture<()> {
        let me = self.arc();
        Box::pin(async move {
            let sealed = seal(&me.cluster.key, TRIGGERS_KIND, &rev);
            me.etcd.put(&me.triggers_key(), &sealed, None).await.map(|_| ()).map_err(unavailable)
        })
    }

    fn rollout_waits(&self, key: &str, version: u64) -> Result<Vec<String>, StoreError> {
        let meta = self.store.meta(key, Select::Version(version), false)?;
        if meta.deleted {
            return Ok(Vec::new());
        }
        Ok(self.hosting(key).into_iter().filter(|n| !meta.holders.contains(n)).collect())
    }

    fn group_home(&self, pool: &str, group: &str) -> GroupHome {
        let key = group_key(pool, group);
        let set = self.replica_set_of(&key, self.copies(pool).0).unwrap_or_default();
        let me = self.cluster.me();
        GroupHome { here: set.iter().any(|n| n == me), elsewhere: set.into_iter().filter(|n| n != me).collect() }
    }
}
