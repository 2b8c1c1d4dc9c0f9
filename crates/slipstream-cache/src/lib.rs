//! A stage's prediction cache (Clipper's, Crankshaw et al. NSDI 2017):
//! results kept by a hash of the request's inputs to the stage, so a
//! repeated query is answered without queueing for a replica or waking a
//! worker.
//!
//! - **Key:** xxh3-128 over the name, dtype, shape and bytes of each key
//!   input (all of the stage's inputs, or the ones the component names).
//!   Only the hash is kept: two different inputs would have to collide in
//!   128 bits to share an entry.
//! - **Value:** the request's outputs, copied off the worker's pool to the
//!   heap ([`HeapTensors`]), so an entry never pins a replica's shared
//!   memory; a hit copies them back into one arena block.
//! - **Bound:** `max_bytes` of tensor data (plus a fixed per-entry
//!   overhead), evicted by CLOCK (second chance): a hit sets an entry's
//!   reference bit, the hand clears bits until it finds an unreferenced
//!   entry. One lock, held for a map lookup or an insert, never across I/O.
//! - **Model versions:** a component that `needs` store objects reports,
//!   with each batch, the versions its serving instance was built from.
//!   The cache remembers the newest versions it has seen: a result from a
//!   newer model clears every entry (they came from an older one), and a
//!   result from an older model (a replica that has not switched yet) is
//!   not kept. And [`follow_models`] watches the store: once a needed key
//!   has a version newer than the cache's, lookups miss (the requests go to
//!   the replicas, which switch to the new model) until a result from it
//!   arrives. So no hit answers with a model older than the newest put.
//!   (If the new model fails to load, its replicas keep the old one and
//!   the cache keeps missing, correct but cold, until a newer version.)
//!
//! It plugs into the core as a [`StageHook`]: the core asks it before a
//! request's work for the stage is queued, and hands it each result.

use parking_lot::Mutex;
use serde::Serialize;
use slipstream_core::arena::{HeapTensors, TensorRef, Tensors};
use slipstream_core::ext::{Lookup, StageHook, Versions};
use slipstream_core::prom::PromText;
use slipstream_core::spec::CacheSpec;
use slipstream_core::Node;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use xxhash_rust::xxh3::Xxh3;

/// Bytes an entry costs beyond its tensor data (map slot, names, shapes).
const ENTRY_OVERHEAD: u64 = 128;

struct Slot {
    key: u128,
    value: Arc<HeapTensors>,
    bytes: u64,
    referenced: bool,
}

#[derive(Default)]
struct Inner {
    map: HashMap<u128, usize>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    hand: usize,
    bytes: u64,
    newest: Versions,
    /// The store's latest versions of the needed keys (by argument name).
    wanted: Versions,
}

/// One stage's prediction cache (see the crate docs).
pub struct PredictionCache {
    key: Option<Vec<String>>,
    /// The store keys the component needs, by argument name.
    needs: BTreeMap<String, String>,
    max_bytes: u64,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    invalidations: AtomicU64,
    /// Requests without a key input, or results too large to keep.
    uncacheable: AtomicU64,
}

/// Counters and sizes for `/v1/status` and `/metrics`.
#[derive(Clone, Debug, Default, Serialize)]
#[allow(missing_docs)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
    pub entries: u64,
    pub bytes: u64,
    pub max_bytes: u64,
    pub evictions: u64,
    pub invalidations: u64,
    pub uncacheable: u64,
}

impl PredictionCache {
    /// A cache as `spec` declares it, for a component that needs `needs`.
    pub fn new(spec: &CacheSpec, needs: &BTreeMap<String, String>) -> PredictionCache {
        PredictionCache {
            key: spec.key.clone(),
            needs: needs.clone(),
            max_bytes: spec.max_bytes,
            inner: Mutex::new(Inner::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            invalidations: AtomicU64::new(0),
            uncacheable: AtomicU64::new(0),
        }
    }

    /// The key of a request's inputs to the stage; None (counted as
    /// uncacheable) when one of the key's inputs is missing.
    pub fn key(&self, inputs: &Tensors) -> Option<u128> {
        let key = self.key_of(inputs);
        if key.is_none() {
            self.uncacheable.fetch_add(1, Relaxed);
        }
        key
    }

    fn key_of(&self, inputs: &Tensors) -> Option<u128> {
        let mut h = Xxh3::new();
        let mut add = |name: &str, t: &TensorRef| {
            h.update(&(name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(t.dtype.name().as_bytes());
            h.update(&(t.shape.len() as u64).to_le_bytes());
            for d in &t.shape {
                h.update(&d.to_le_bytes());
            }
            h.update(t.bytes());
        };
        match &self.key {
            None => {
                // Tensors arrive in a stable order (the pipeline's or the parents').
                for (name, t) in inputs {
                    add(name, t);
                }
            }
            Some(names) => {
                for name in names {
                    let (_, t) = inputs.iter().find(|(n, _)| n == name)?;
                    add(name, t);
                }
            }
        }
        Some(h.digest128())
    }

    /// The cached outputs for `key`, if any (counted as a hit or a miss).
    pub fn get(&self, key: u128) -> Option<Arc<HeapTensors>> {
        let mut inner = self.inner.lock();
        let stale = matches!(compare(&inner.wanted, &inner.newest), Age::Newer);
        let found = if stale { None } else { inner.map.get(&key).copied() };
        let value = found.and_then(|i| {
            let slot = inner.slots[i].as_mut()?;
            slot.referenced = true;
            Some(slot.value.clone())
        });
        drop(inner);
        if value.is_some() { &self.hits } else { &self.misses }.fetch_add(1, Relaxed);
        value
    }

    /// Keep `outputs` under `key`, computed by a model with `versions`.
    pub fn put(&self, key: u128, outputs: &Tensors, versions: &Versions) {
        let mut inner = self.inner.lock();
        match compare(versions, &inner.newest) {
            Age::Older => return,
            Age::Newer => {
                for (k, v) in versions {
                    let e = inner.newest.entry(k.clone()).or_insert(0);
                    *e = (*e).max(*v);
                }
                if !inner.map.is_empty() {
                    self.invalidations.fetch_add(1, Relaxed);
                }
                let newest = std::mem::take(&mut inner.newest);
                let wanted = std::mem::take(&mut inner.wanted);
                *inner = Inner { newest, wanted, ..Inner::default() };
            }
            Age::Same => {}
        }
        if inner.map.contains_key(&key) {
            return;
        }
        let value = HeapTensors::of(outputs);
        let bytes = value.nbytes() as u64 + ENTRY_OVERHEAD;
        if bytes > self.max_bytes {
            self.uncacheable.fetch_add(1, Relaxed);
            return;
        }
        while inner.bytes + bytes > self.max_bytes && self.evict_one(&mut inner) {}
        let slot = Slot { key, value: Arc::new(value), bytes, referenced: false };
        let i = match inner.free.pop() {
            Some(i) => {
                inner.slots[i] = Some(slot);
                i
            }
            None => {
                inner.slots.push(Some(slot));
                inner.slots.len() - 1
            }
        };
        inner.map.insert(key, i);
        inner.bytes += bytes;
    }

    /// The store's latest versions of the needed keys: until a result from
    /// a model this new arrives, lookups miss.
    pub fn want(&self, versions: &Versions) {
        let mut inner = self.inner.lock();
        for (k, v) in versions {
            let e = inner.wanted.entry(k.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
    }

    /// CLOCK: advance the hand, giving referenced entries a second chance,
    /// and evict the first unreferenced one. False when the cache is empty.
    fn evict_one(&self, inner: &mut Inner) -> bool {
        if inner.map.is_empty() {
            return false;
        }
        let n = inner.slots.len();
        loop {
            let i = inner.hand % n;
            inner.hand = (i + 1) % n;
            let Some(slot) = inner.slots[i].as_mut() else { continue };
            if slot.referenced {
                slot.referenced = false;
                continue;
            }
            let slot = inner.slots[i].take().expect("present");
            inner.map.remove(&slot.key);
            inner.bytes -= slot.bytes;
            inner.free.push(i);
            self.evictions.fetch_add(1, Relaxed);
            return true;
        }
    }

    /// Its counters and sizes.
    pub fn stats(&self) -> CacheStats {
        let (entries, bytes) = {
            let inner = self.inner.lock();
            (inner.map.len() as u64, inner.bytes)
        };
        let (hits, misses) = (self.hits.load(Relaxed), self.misses.load(Relaxed));
        CacheStats {
            hits,
            misses,
            hit_rate: if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
            entries,
            bytes,
            max_bytes: self.max_bytes,
            evictions: self.evictions.load(Relaxed),
            invalidations: self.invalidations.load(Relaxed),
            uncacheable: self.uncacheable.load(Relaxed),
        }
    }
}

impl StageHook for PredictionCache {
    fn name(&self) -> &'static str {
        "cache"
    }

    fn lookup(&self, inputs: &Tensors) -> Lookup {
        let Some(key) = self.key(inputs) else { return Lookup::Pass };
        match self.get(key) {
            Some(h) => Lookup::Hit(h),
            None => Lookup::Miss(key),
        }
    }

    fn store(&self, memo: u128, outputs: &Tensors, versions: &Versions) {
        self.put(memo, outputs, versions);
    }

    fn status(&self) -> serde_json::Value {
        serde_json::to_value(self.stats()).expect("serialises")
    }

    fn metrics(&self, t: &mut PromText, l: &[(&str, &str)]) {
        let c = self.stats();
        for (name, help, v) in [
            ("slipstream_cache_hits_total", "Requests answered from the stage's prediction cache.", c.hits),
            ("slipstream_cache_misses_total", "Cache lookups that found nothing (the request ran).", c.misses),
            ("slipstream_cache_evictions_total", "Entries evicted (CLOCK) to stay within max_bytes.", c.evictions),
            ("slipstream_cache_invalidations_total", "Times a newer model version emptied the cache.", c.invalidations),
        ] {
            t.counter(name, help, l, v);
        }
        t.gauge("slipstream_cache_bytes", "Bytes held by the prediction cache.", l, c.bytes as f64);
        t.gauge("slipstream_cache_entries", "Entries held by the prediction cache.", l, c.entries as f64);
    }
}

/// Follow the store until `stop`: whenever it commits, tell each cache of a
/// component that needs store objects the latest versions of its keys.
pub async fn follow_models(
    node: Arc<Node>,
    caches: Vec<Arc<PredictionCache>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let caches: Vec<_> = caches.into_iter().filter(|c| !c.needs.is_empty()).collect();
    if caches.is_empty() {
        return;
    }
    let mut changed = node.store().subscribe();
    loop {
        for cache in &caches {
            let store = node.store().clone();
            let needs = cache.needs.clone();
            let latest = tokio::task::spawn_blocking(move || {
                needs
                    .iter()
                    .filter_map(|(arg, key)| {
                        store.meta(key, slipstream_store::Select::Latest, false).ok().map(|m| (arg.clone(), m.version))
                    })
                    .collect::<Versions>()
            })
            .await;
            if let Ok(latest) = latest {
                cache.want(&latest);
            }
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
}

enum Age {
    Older,
    Same,
    Newer,
}

/// How a result's model compares with the newest one seen: newer if any
/// of its versions is newer, older if any is older (and none newer).
fn compare(versions: &Versions, newest: &Versions) -> Age {
    let newer = versions.iter().any(|(k, v)| newest.get(k).is_none_or(|n| v > n));
    if newer {
        return Age::Newer;
    }
    if versions.iter().any(|(k, v)| newest.get(k).is_some_and(|n| v < n)) || versions.len() < newest.len() {
        return Age::Older;
    }
    Age::Same
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_core::arena::Arena;
    use slipstream_core::testing::temp_arena as arena;

    fn tensors(arena: &Arena, name: &str, vals: &[f32]) -> Tensors {
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let h = HeapTensors(vec![(name.into(), slipstream_types::DType::Float32, vec![1, vals.len() as u64], bytes)]);
        h.to_arena(arena).unwrap()
    }

    fn first(t: &Tensors) -> Vec<u8> {
        let r: &TensorRef = &t[0].1;
        r.bytes().to_vec()
    }

    fn cache(max_bytes: u64, key: Option<Vec<String>>) -> PredictionCache {
        PredictionCache::new(&CacheSpec { key, max_bytes }, &BTreeMap::new())
    }

    #[test]
    fn hits_return_what_was_put_and_keys_tell_inputs_apart() {
        let (a, _d) = arena();
        let c = cache(1 << 20, None);
        let x1 = tensors(&a, "x", &[1.0, 2.0]);
        let x2 = tensors(&a, "x", &[1.0, 3.0]);
        let y = tensors(&a, "y", &[9.0]);
        let (k1, k2) = (c.key_of(&x1).unwrap(), c.key_of(&x2).unwrap());
        assert_ne!(k1, k2);
        assert_eq!(k1, c.key_of(&tensors(&a, "x", &[1.0, 2.0])).unwrap(), "same bytes, same key");
        assert_ne!(k1, c.key_of(&tensors(&a, "z", &[1.0, 2.0])).unwrap(), "the name is part of the key");
        assert!(c.get(k1).is_none());
        c.put(k1, &y, &Versions::new());
        let hit = c.get(k1).unwrap().to_arena(&a).unwrap();
        assert_eq!(first(&hit), first(&y));
        assert!(c.get(k2).is_none());
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries), (1, 2, 1));
    }

    #[test]
    fn named_key_ignores_other_inputs_and_missing_inputs_are_uncacheable() {
        let (a, _d) = arena();
        let c = cache(1 << 20, Some(vec!["x".into()]));
        let mut t1 = tensors(&a, "x", &[1.0]);
        t1.extend(tensors(&a, "noise", &[5.0]));
        let mut t2 = tensors(&a, "x", &[1.0]);
        t2.extend(tensors(&a, "noise", &[6.0]));
        assert_eq!(c.key_of(&t1), c.key_of(&t2));
        assert!(c.key(&tensors(&a, "other", &[1.0])).is_none());
        assert_eq!(c.stats().uncacheable, 1);
    }

    #[test]
    fn clock_keeps_referenced_entries_and_stays_within_its_bound() {
        let (a, _d) = arena();
        let y = tensors(&a, "y", &[0.0; 16]); // 64 bytes + overhead = 192 per entry
        let c = cache(192 * 3, None);
        for k in 0..3u128 {
            c.put(k, &y, &Versions::new());
        }
        assert!(c.get(0).is_some()); // referenced: survives the next eviction
        c.put(3, &y, &Versions::new());
        let s = c.stats();
        assert_eq!((s.entries, s.evictions), (3, 1));
        assert!(s.bytes <= s.max_bytes);
        assert!(c.get(0).is_some() && c.get(1).is_none(), "the unreferenced oldest went first");
        for k in 10..100u128 {
            c.put(k, &y, &Versions::new());
            assert!(c.stats().bytes <= 192 * 3);
        }
        // Larger than the whole cache: not kept.
        c.put(1000, &tensors(&a, "big", &[0.0; 200]), &Versions::new());
        assert!(c.get(1000).is_none());
    }

    #[test]
    fn a_newer_model_clears_entries_and_an_older_ones_results_are_not_kept() {
        let (a, _d) = arena();
        let c = cache(1 << 20, None);
        let y = tensors(&a, "y", &[1.0]);
        let v = |n: u64| Versions::from([("model".to_string(), n)]);
        c.put(1, &y, &v(1));
        c.put(2, &y, &v(1));
        assert!(c.get(1).is_some());
        c.put(3, &y, &v(2)); // a replica switched to model v2
        assert!(c.get(1).is_none() && c.get(2).is_none(), "v1's entries are gone");
        assert!(c.get(3).is_some());
        c.put(4, &y, &v(1)); // a replica still on v1
        assert!(c.get(4).is_none(), "an older model's result is not kept");
        assert_eq!(c.stats().invalidations, 1);
        // The store has v3: no hits until a v3 result arrives.
        c.want(&v(3));
        assert!(c.get(3).is_none(), "v2's entry is not served once v3 is put");
        c.put(5, &y, &v(3));
        assert!(c.get(5).is_some() && c.get(3).is_none());
    }
}
