//! Repair: versions that lost a holder get their copies back.
//!
//! The repairer is the member with the smallest name (the same rule that
//! elects the placement's leader: every node computes it from the same
//! membership, and two nodes that briefly both believe they lead cannot
//! both update a record: the update is a compare-and-swap). It runs when a
//! member leaves (its lease expired, or it left) and every 30 s: it reads
//! every version record, and for each live version with fewer live holders
//! than its copies should be (`--store-replicas`, at most the live
//! members) it brings the bytes here (fetched from a surviving holder,
//! checked by digest), sends them to the nodes the replica set now names,
//! and records the new holders with a compare on the record. Versions
//! whose every holder is gone are counted as lost (they come back if a
//! holder does). One version at a time: the copies are bounded by one
//! transfer's bandwidth, not a storm. A node that comes back keeps its
//! copies (the records it applies say who holds what; its bytes are
//! checked by digest whenever they are read by another node).

use super::{unavailable, ClusterStore, ObjectRecord, KIND};
use crate::seal;
use slipstream_core::prom::PromText;
use slipstream_store::StoreError;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often the repairer looks even when no member left.
const EVERY: Duration = Duration::from_secs(30);
/// How old bytes held for an uncommitted version must be before the sweep
/// may drop them: far longer than any put takes from its first copy to its
/// commit (a few etcd round trips and one transfer, each bounded).
const HELD_GRACE: Duration = Duration::from_secs(600);

#[derive(Default)]
pub(crate) struct RepairCounters {
    passes: AtomicU64,
    repaired: AtomicU64,
    repaired_bytes: AtomicU64,
    /// Under-replicated as the last pass left them (versions, bytes):
    /// what it found, less what it repaired.
    under: AtomicU64,
    under_bytes: AtomicU64,
    /// Versions no live node holds (last pass).
    lost: AtomicU64,
    /// The last pass that repaired something: how long it took, ms.
    last_repair_ms: AtomicU64,
    /// Versions whose held bytes the sweep dropped (their put never committed).
    swept: AtomicU64,
}

impl RepairCounters {
    pub(crate) fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "passes": self.passes.load(Relaxed),
            "repaired_versions": self.repaired.load(Relaxed),
            "repaired_bytes": self.repaired_bytes.load(Relaxed),
            "under_replicated_versions": self.under.load(Relaxed),
            "under_replicated_bytes": self.under_bytes.load(Relaxed),
            "lost_versions": self.lost.load(Relaxed),
            "last_repair_ms": self.last_repair_ms.load(Relaxed),
            "swept_uncommitted_versions": self.swept.load(Relaxed),
        })
    }

    pub(crate) fn metrics(&self, t: &mut PromText) {
        t.gauge(
            "slipstream_cluster_store_under_replicated_bytes",
            "Bytes of live versions with fewer holders than their copies (as the last repair pass left them).",
            &[],
            self.under_bytes.load(Relaxed) as f64,
        );
        t.gauge(
            "slipstream_cluster_store_lost_versions",
            "Live versions no live node holds (last repair pass).",
            &[],
            self.lost.load(Relaxed) as f64,
        );
        t.counter(
            "slipstream_cluster_store_repaired_bytes_total",
            "Bytes copied to new holders by repair.",
            &[],
            self.repaired_bytes.load(Relaxed),
        );
        t.gauge(
            "slipstream_cluster_store_last_repair_seconds",
            "How long the last repair pass that copied something took.",
            &[],
            self.last_repair_ms.load(Relaxed) as f64 / 1e3,
        );
    }
}

/// Run the repairer on this node until `stop` (it acts only while this
/// node leads).
pub(crate) async fn run(store: Arc<ClusterStore>, mut stop: watch::Receiver<bool>) {
    let mut views = store.cluster.view.subscribe();
    let mut known: BTreeSet<String> = BTreeSet::new();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let timed = tokio::select! {
            _ = views.changed() => false,
            _ = tick.tick() => true,
            _ = stop.wait_for(|s| *s) => return,
        };
        let view = store.cluster.view();
        // A member that left or was cordoned: its copies are made elsewhere.
        let members: BTreeSet<String> = view.placeable().map(str::to_string).collect();
        let lost_member = known.difference(&members).next().is_some();
        known = members;
        if timed {
            // Every node sweeps its own held bytes.
            if let Err(e) = store.sweep_held().await {
                tracing::warn!("cluster store: sweeping held bytes failed: {e}");
            }
        }
        let leads = view.members.keys().next().map(String::as_str) == Some(store.cluster.me());
        if !leads || !(lost_member || timed) {
            continue;
        }
        if let Err(e) = store.repair_pass().await {
            tracing::warn!("cluster store: repair pass failed: {e}");
        }
    }
}

impl ClusterStore {
    /// One pass over every version record (see the module docs).
    pub(crate) async fn repair_pass(self: &Arc<Self>) -> Result<(), StoreError> {
        let started = Instant::now();
        let c = &self.repair;
        c.passes.fetch_add(1, Relaxed);
        let view = self.cluster.view();
        let live: BTreeSet<&str> = view.placeable().collect();
        let (kvs, _) = self.etcd.get_prefix(&format!("{}ver", self.root)).await.map_err(unavailable)?;
        let mut under = Vec::new();
        for kv in &kvs {
            let Some(rec) = self.decode(kv) else { continue };
            let have = rec.holders.iter().filter(|h| live.contains(h.as_str())).count();
            let target = self.copies(&rec.key).0.min(live.len());
            if !rec.deleted && have < target {
                under.push((kv.mod_revision, target, rec));
            }
        }
        // What this pass leaves short: counted down as it repairs.
        let (mut short, mut short_bytes) = (under.len() as u64, under.iter().map(|(_, _, r)| r.size).sum::<u64>());
        c.under.store(short, Relaxed);
        c.under_bytes.store(short_bytes, Relaxed);
        let mut lost = 0;
        let mut repaired = 0;
        for (mod_rev, target, rec) in under {
            // Counted: copies on placeable members; fetched from: any member's
            // (a cordoned member's copy is read until it leaves).
            if !rec.holders.iter().any(|h| view.members.contains_key(h)) {
                lost += 1;
                continue;
            }
            let have: Vec<String> = rec.holders.iter().filter(|h| live.contains(h.as_str())).cloned().collect();
            match self.repair_one(&rec, mod_rev, have, target).await {
                Ok(true) => {
                    repaired += 1;
                    c.repaired.fetch_add(1, Relaxed);
                    c.repaired_bytes.fetch_add(rec.size, Relaxed);
                    short -= 1;
                    short_bytes -= rec.size;
                    c.under.store(short, Relaxed);
                    c.under_bytes.store(short_bytes, Relaxed);
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("cluster store: cannot repair {} v{}: {e}", rec.key, rec.version),
            }
        }
        c.lost.store(lost, Relaxed);
        if repaired > 0 {
            let took = started.elapsed();
            c.last_repair_ms.store(took.as_millis() as u64, Relaxed);
            tracing::info!("cluster store: repaired {repaired} version(s) in {took:?} ({lost} with no live holder)");
        }
        Ok(())
    }

    /// Drop bytes held here for a put whose coordinator died before its
    /// commit: held longer than [`HELD_GRACE`] and no record of that
    /// version with that digest in etcd (a version committed and since
    /// dropped by retention has none either: its bytes go too).
    pub(crate) async fn sweep_held(self: &Arc<Self>) -> Result<(), StoreError> {
        let store = self.store.clone();
        let held = tokio::task::spawn_blocking(move || store.held()).await.map_err(unavailable)??;
        for h in held.into_iter().filter(|h| h.age >= HELD_GRACE) {
            let kv = self.etcd.get(&self.ver_key(&h.key, h.version)).await.map_err(unavailable)?;
            if kv.as_ref().and_then(|kv| self.decode(kv)).is_some_and(|r| r.digest == h.digest) {
                continue; // committed: the follower takes the bytes when it applies it
            }
            let store = self.store.clone();
            let (key, version, digest) = (h.key.clone(), h.version, h.digest.clone());
            let dropped = tokio::task::spawn_blocking(move || store.drop_held(&key, version, &digest))
                .await
                .map_err(unavailable)??;
            if dropped {
                self.repair.swept.fetch_add(1, Relaxed);
                tracing::info!(
                    "cluster store: dropped bytes held {:?} for {} v{}, never committed",
                    h.age,
                    h.key,
                    h.version
                );
            }
        }
        Ok(())
    }

    /// Copy one version to the nodes its replica set now names and record
    /// them; false when another writer changed the record first.
    async fn repair_one(
        self: &Arc<Self>,
        rec: &ObjectRecord,
        mod_rev: i64,
        have: Vec<String>,
        target: usize,
    ) -> Result<bool, StoreError> {
        // The bytes, here (fetched from a holder when they are not).
        self.clone().fetch_one(rec.key.clone(), rec.version).await?;
        let (store, key, digest) = (self.store.clone(), rec.key.clone(), rec.digest.clone());
        let version = rec.version;
        let body = tokio::task::spawn_blocking(move || store.value_of(&key, version, &digest))
            .await
            .map_err(unavailable)??
            .ok_or_else(|| unavailable(format!("{} v{}: its bytes are not here after the fetch", rec.key, version)))?;
        let body = bytes::Bytes::from_owner(body);
        let view = self.cluster.view();
        let wanted: Vec<String> =
            self.replica_set(&rec.key)?.into_iter().filter(|n| !have.contains(n)).take(target - have.len()).collect();
        let mut holders = have;
        let before = holders.len();
        for node in wanted {
            if node == self.cluster.me() {
                holders.push(node); // the fetched copy is durable here
                continue;
            }
            let Some(m) = view.members.get(&node) else { continue };
            let msg = super::hold_call(rec.key.clone(), version, rec.digest.clone(), std::iter::once(body.clone()));
            match self.cluster.peers.call(m.data, msg, super::transfer_patience(rec.size)).await {
                Ok(_) => holders.push(node),
                Err(e) => tracing::warn!("cluster store: repair of {} v{version} to {node} failed: {e}", rec.key),
            }
        }
        if holders.len() == before {
            return Ok(false); // no node took a copy
        }
        self.record_holders(rec, mod_rev, holders).await
    }

    /// Record `holders` as the nodes holding `rec`'s version (whose record
    /// etcd holds at `mod_rev`); false when another writer changed the
    /// record first.
    pub(crate) async fn record_holders(
        &self,
        rec: &ObjectRecord,
        mod_rev: i64,
        holders: Vec<String>,
    ) -> Result<bool, StoreError> {
        let fixed = ObjectRecord { holders, ..rec.clone() };
        let sealed = seal(&self.cluster.key, KIND, &fixed);
        let ver_key = self.ver_key(&rec.key, rec.version);
        let head_key = self.head_key(&rec.key);
        // The head holds the latest version's record too: update both when
        // this is it (compared on the head), else the version's alone.
        let head = self.etcd.get(&head_key).await.map_err(unavailable)?;
        let latest = head.as_ref().and_then(|kv| self.decode(kv)).is_some_and(|h| h.version == rec.version);
        let outcome = match (latest, head) {
            (true, Some(h)) => {
                let puts = [(head_key.as_str(), sealed.as_slice()), (ver_key.as_str(), sealed.as_slice())];
                self.etcd.txn_if(&head_key, h.mod_revision, &puts, &[], None).await
            }
            _ => self.etcd.txn_if(&ver_key, mod_rev, &[(ver_key.as_str(), sealed.as_slice())], &[], None).await,
        };
        Ok(outcome.map_err(unavailable)?.is_ok())
    }
}
