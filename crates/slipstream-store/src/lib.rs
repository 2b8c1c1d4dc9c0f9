//! The node's object store: path-like keys, immutable versions, reads by
//! version or by time, a change feed, retention. Models, indices and
//! documents live here; see `docs/design/store.md` for the contract.
//!
//! Layout on disk (one directory):
//! - `meta.redb`: a redb database (copy-on-write B-trees, one writer, many
//!   readers, each commit atomic and fsynced) holding per key its latest
//!   version number, per version its record (timestamp, size, content type,
//!   where the value is), small values themselves, and the change feed.
//! - `blobs/<id>`: one file per large value, written in full, fsynced and
//!   renamed into place *before* the version that names it commits, never
//!   written again, unlinked by garbage collection.
//!
//! Durability: a put is acknowledged after its redb commit, which is
//! fsynced; a large value's file (and the directory entry) was fsynced
//! before that. So an acknowledged put survives a crash of the process or
//! the machine, and a version is visible only complete: a crash before the
//! commit leaves at most an unnamed blob file, which [`Store::open`] sweeps.
//!
//! Writes go through one committer thread that takes every put waiting and
//! commits them in one transaction (group commit): one fsync for many
//! concurrent writers, and a total order in which conditional puts
//! (`if_version`) are decided.

mod blob;
mod check;

pub use blob::StagedBlob;
pub use check::{
    check_client_write, check_key, check_prefix, check_tensors, check_tensors_head, MAX_KEY_BYTES, RESERVED_PREFIX,
    TENSORS_CONTENT_TYPE, TENSORS_MAGIC,
};

use parking_lot::Mutex;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// key -> its latest version number (kept after every version is gone, so
/// numbers are never reused).
const HEADS: TableDefinition<&str, u64> = TableDefinition::new("heads");
/// (key, version) -> [`Record`] as JSON.
const VERSIONS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("versions");
/// (key, version) -> the value, for values stored inline.
const INLINE: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("inline");
/// sequence number -> [`Change`] as JSON.
const FEED: TableDefinition<u64, &[u8]> = TableDefinition::new("feed");
/// Counters of the store's own: `blob_next` (blob ids are never reused), the trigger cursor.
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("version conflict on {key}: expected version {expected}, the key is at {current}")]
    Conflict { key: String, expected: u64, current: u64 },
    #[error("the value is {size} bytes, over the store's limit of {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("the change feed no longer holds changes after {since} (it starts at {first}); start from the current sequence number")]
    Gone { since: u64, first: u64 },
    #[error("the store at {0} is in use by another process")]
    InUse(PathBuf),
    #[error("store I/O: {0}")]
    Io(String),
    #[error("the store is closed")]
    Closed,
}

impl StoreError {
    /// The error kind clients see (`kind` in the node's JSON errors).
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::BadRequest(_) => "bad_request",
            StoreError::NotFound(_) => "not_found",
            StoreError::Conflict { .. } => "conflict",
            StoreError::TooLarge { .. } => "payload_too_large",
            StoreError::Gone { .. } => "gone",
            StoreError::InUse(_) => "store_in_use",
            StoreError::Io(_) | StoreError::Closed => "store_unavailable",
        }
    }
}

fn io(e: impl std::fmt::Display) -> StoreError {
    StoreError::Io(e.to_string())
}

/// A key prefix with its own retention and affinity.
#[derive(Clone, Debug)]
pub struct Pool {
    pub prefix: String,
    /// Versions kept per key (the latest always is).
    pub keep_versions: u64,
    /// Versions older than this are removed (the latest live one is kept).
    pub keep_age: Option<Duration>,
    /// Maps a key to its affinity key (capture group 1).
    pub affinity: Option<Regex>,
}

impl Pool {
    pub fn new(
        prefix: &str,
        keep_versions: u64,
        keep_age_s: Option<f64>,
        affinity: Option<&str>,
    ) -> Result<Pool, StoreError> {
        check_prefix(prefix)?;
        if keep_versions == 0 {
            return Err(StoreError::BadRequest(format!("pool {prefix}: keep_versions must be at least 1")));
        }
        let keep_age = match keep_age_s {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
            Some(s) => return Err(StoreError::BadRequest(format!("pool {prefix}: keep_age_s must be > 0, got {s}"))),
        };
        let affinity = match affinity {
            None => None,
            Some(r) => {
                let re =
                    Regex::new(r).map_err(|e| StoreError::BadRequest(format!("pool {prefix}: affinity regex: {e}")))?;
                if re.captures_len() < 2 {
                    return Err(StoreError::BadRequest(format!(
                        "pool {prefix}: the affinity regex needs a capture group (the affinity key)"
                    )));
                }
                Some(re)
            }
        };
        Ok(Pool { prefix: prefix.to_string(), keep_versions, keep_age, affinity })
    }

    fn root() -> Pool {
        Pool { prefix: "/".into(), keep_versions: 16, keep_age: None, affinity: None }
    }
}

#[derive(Clone, Debug)]
pub struct StoreOptions {
    pub dir: PathBuf,
    /// Values up to this size live in the database; larger ones in blob files.
    pub inline_max: usize,
    /// The largest value a put may carry.
    pub max_value: u64,
    pub pools: Vec<Pool>,
    /// Changes the feed keeps for watchers that fall behind.
    pub feed_keep: u64,
    /// How long asking for a blob's path keeps it from collection.
    pub pin_for: Duration,
    /// How often age-based retention runs.
    pub gc_every: Duration,
}

impl StoreOptions {
    pub fn new(dir: impl Into<PathBuf>) -> StoreOptions {
        StoreOptions {
            dir: dir.into(),
            inline_max: 64 << 10,
            max_value: 1 << 30,
            pools: Vec::new(),
            feed_keep: 100_000,
            pin_for: Duration::from_secs(60),
            gc_every: Duration::from_secs(5),
        }
    }
}

/// How a version is stored (the value of [`VERSIONS`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    ts: u64,
    size: u64,
    ct: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    blob: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    deleted: bool,
}

impl Record {
    fn decode(b: &[u8]) -> Result<Record, StoreError> {
        serde_json::from_slice(b).map_err(|e| io(format!("corrupt version record: {e}")))
    }
}

/// What a reader learns about one version.
#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    pub key: String,
    pub version: u64,
    /// Unix time in seconds.
    pub timestamp: f64,
    pub size: u64,
    pub content_type: String,
    pub deleted: bool,
    /// The blob file holding the value, when it is one.
    pub path: Option<PathBuf>,
}

/// One entry of the change feed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Change {
    pub seq: u64,
    pub key: String,
    pub version: u64,
    /// Unix time in seconds.
    pub timestamp: f64,
    pub deleted: bool,
}

/// Which version a read wants.
#[derive(Clone, Copy, Debug)]
pub enum Select {
    Latest,
    Version(u64),
    /// The version current at this unix time (microseconds).
    AsOf(u64),
}

/// A value read from the store: in memory (small) or mapped (a blob file).
pub enum Body {
    Inline(Vec<u8>),
    Mapped(memmap2::Mmap),
}

impl AsRef<[u8]> for Body {
    fn as_ref(&self) -> &[u8] {
        match self {
            Body::Inline(v) => v,
            Body::Mapped(m) => m,
        }
    }
}

/// A value ready to commit: staged by [`Store::stage`].
pub enum Staged {
    Inline(Vec<u8>),
    Blob(StagedBlob),
}

impl Staged {
    pub fn size(&self) -> u64 {
        match self {
            Staged::Inline(v) => v.len() as u64,
            Staged::Blob(b) => b.size(),
        }
    }
}

/// One write: a put (`value` Some) or a delete (a tombstone).
pub struct Write {
    pub key: String,
    pub value: Option<Staged>,
    pub content_type: String,
    /// Only if the key's latest version is this (0: never written).
    pub if_version: Option<u64>,
}

/// An acknowledged write.
#[derive(Clone, Debug, Serialize)]
pub struct Committed {
    #[serde(flatten)]
    pub meta: Meta,
    pub seq: u64,
}

type Reply = SyncSender<Result<Committed, StoreError>>;

struct Inner {
    db: Database,
    opts: StoreOptions,
    blobs: blob::Blobs,
    seq: tokio::sync::watch::Sender<u64>,
    /// The oldest sequence number the feed still holds (seq + 1 when empty).
    feed_first: AtomicU64,
}

/// The store. Cheap to share behind an `Arc`; closes (and stops its
/// threads) when dropped.
pub struct Store {
    inner: Arc<Inner>,
    writes: Mutex<Option<SyncSender<(Write, Reply)>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

impl Store {
    /// Open (or create) the store in `opts.dir`: recover, sweep blob files
    /// no version names (a crash between writing one and committing), and
    /// start the committer and the collector.
    pub fn open(opts: StoreOptions) -> Result<Store, StoreError> {
        std::fs::create_dir_all(&opts.dir).map_err(|e| io(format!("cannot create {}: {e}", opts.dir.display())))?;
        let db = match Database::create(opts.dir.join("meta.redb")) {
            Ok(db) => db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => return Err(StoreError::InUse(opts.dir.clone())),
            Err(e) => return Err(io(format!("cannot open {}: {e}", opts.dir.join("meta.redb").display()))),
        };
        let txn = db.begin_write().map_err(io)?;
        let (seq, feed_first, referenced, blob_next) = {
            txn.open_table(HEADS).map_err(io)?;
            txn.open_table(INLINE).map_err(io)?;
            let versions = txn.open_table(VERSIONS).map_err(io)?;
            let feed = txn.open_table(FEED).map_err(io)?;
            let counters = txn.open_table(COUNTERS).map_err(io)?;
            let seq = last_seq(&feed)?;
            let blob_next = counters.get("blob_next").map_err(io)?.map(|v| v.value()).unwrap_or(0);
            let first = feed.first().map_err(io)?.map(|(k, _)| k.value()).unwrap_or(seq + 1);
            let mut referenced = std::collections::HashSet::new();
            for row in versions.iter().map_err(io)? {
                let (_, v) = row.map_err(io)?;
                if let Some(b) = Record::decode(v.value())?.blob {
                    referenced.insert(b);
                }
            }
            (seq, first, referenced, blob_next)
        };
        txn.commit().map_err(io)?;
        let blobs = blob::Blobs::open(&opts.dir, &referenced, blob_next, opts.pin_for)?;
        let (seq_tx, _) = tokio::sync::watch::channel(seq);
        let inner = Arc::new(Inner { db, opts, blobs, seq: seq_tx, feed_first: AtomicU64::new(feed_first) });
        let (tx, rx) = sync_channel::<(Write, Reply)>(1024);
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let committer = {
            let inner = inner.clone();
            std::thread::Builder::new().name("store-commit".into()).spawn(move || inner.commit_loop(rx)).map_err(io)?
        };
        let collector = {
            let (inner, stop) = (inner.clone(), stop.clone());
            std::thread::Builder::new()
                .name("store-gc".into())
                .spawn(move || {
                    let (lock, cv) = &*stop;
                    let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                    while !*stopped {
                        let (g, _) = cv.wait_timeout(stopped, inner.opts.gc_every).unwrap_or_else(|e| e.into_inner());
                        stopped = g;
                        if !*stopped {
                            if let Err(e) = inner.collect_aged() {
                                tracing::warn!("store retention failed: {e}");
                            }
                        }
                    }
                })
                .map_err(io)?
        };
        Ok(Store { inner, writes: Mutex::new(Some(tx)), threads: Mutex::new(vec![committer, collector]), stop })
    }

    pub fn dir(&self) -> &Path {
        &self.inner.opts.dir
    }

    pub fn options(&self) -> &StoreOptions {
        &self.inner.opts
    }

    /// Put the value's bytes where a commit can name them: in memory when
    /// small, else in a new blob file, written and fsynced (blocking I/O).
    pub fn stage<B: AsRef<[u8]>>(&self, parts: &[B]) -> Result<Staged, StoreError> {
        let size = parts.iter().try_fold(0u64, |acc, p| acc.checked_add(p.as_ref().len() as u64));
        let size = size.ok_or(StoreError::TooLarge { size: u64::MAX, limit: self.inner.opts.max_value })?;
        if size > self.inner.opts.max_value {
            return Err(StoreError::TooLarge { size, limit: self.inner.opts.max_value });
        }
        if size <= self.inner.opts.inline_max as u64 {
            return Ok(Staged::Inline(parts.iter().flat_map(|p| p.as_ref().iter().copied()).collect()));
        }
        Ok(Staged::Blob(self.inner.blobs.stage(parts, size)?))
    }

    /// Commit one write (blocking until it is durable); see [`Write`].
    pub fn write(&self, w: Write) -> Result<Committed, StoreError> {
        check_key(&w.key)?;
        let tx = self.writes.lock().clone().ok_or(StoreError::Closed)?;
        let (reply_tx, reply_rx) = sync_channel(1);
        tx.send((w, reply_tx)).map_err(|_| StoreError::Closed)?;
        reply_rx.recv().map_err(|_| StoreError::Closed)?
    }

    /// Stage and commit a put of `value` (convenience for callers that hold
    /// the whole value).
    pub fn put(
        &self,
        key: &str,
        value: &[u8],
        content_type: &str,
        if_version: Option<u64>,
    ) -> Result<Committed, StoreError> {
        check_key(key)?;
        if content_type.split(';').next().unwrap_or("").trim().eq_ignore_ascii_case(TENSORS_CONTENT_TYPE) {
            check_tensors(value)?;
        }
        let staged = self.stage(&[value])?;
        self.write(Write { key: key.into(), value: Some(staged), content_type: content_type.into(), if_version })
    }

    /// Write a tombstone version.
    pub fn delete(&self, key: &str, if_version: Option<u64>) -> Result<Committed, StoreError> {
        self.write(Write { key: key.into(), value: None, content_type: String::new(), if_version })
    }

    /// The metadata of the selected version; `pin`: keep its blob file
    /// from collection for a while (a reader is about to map it).
    pub fn meta(&self, key: &str, select: Select, pin: bool) -> Result<Meta, StoreError> {
        self.read(key, select, |_, meta, rec| {
            if let (true, Some(id)) = (pin, rec.blob) {
                // Pinned before it is checked: collection cannot take it now.
                self.inner.blobs.pin(id);
                if !self.inner.blobs.path(id).exists() {
                    return Ok(None); // collected just before the pin: look again
                }
            }
            Ok(Some(meta))
        })
    }

    /// The selected version's metadata and value (a tombstone is NotFound).
    pub fn get(&self, key: &str, select: Select) -> Result<(Meta, Body), StoreError> {
        self.read(key, select, |txn, meta, rec| {
            if meta.deleted {
                return Err(StoreError::NotFound(format!("{key} was deleted at version {}", meta.version)));
            }
            let body = match rec.blob {
                Some(id) => match self.inner.blobs.map(id, rec.size) {
                    Ok(m) => Body::Mapped(m),
                    Err(_) if !self.inner.blobs.path(id).exists() => return Ok(None),
                    Err(e) => return Err(e),
                },
                None => {
                    // The same snapshot as the lookup: retention cannot take it in between.
                    let t = txn.open_table(INLINE).map_err(io)?;
                    let v = t.get((key, meta.version)).map_err(io)?;
                    Body::Inline(
                        v.ok_or_else(|| io(format!("{key} version {} has no value", meta.version)))?.value().to_vec(),
                    )
                }
            };
            Ok(Some((meta, body)))
        })
    }

    /// Look `key` up and hand the version to `f` within one read
    /// snapshot. `f` returns None when the version's blob file was
    /// collected after the snapshot was taken (a put that dropped the
    /// version committed meanwhile): then look again, in a newer snapshot,
    /// where the latest is the newer version and an old one is NotFound.
    fn read<T>(
        &self,
        key: &str,
        select: Select,
        f: impl Fn(&redb::ReadTransaction, Meta, Record) -> Result<Option<T>, StoreError>,
    ) -> Result<T, StoreError> {
        for _ in 0..8 {
            let txn = self.inner.db.begin_read().map_err(io)?;
            let (meta, rec) = self.inner.find(&txn, key, select)?;
            if let Some(out) = f(&txn, meta, rec)? {
                return Ok(out);
            }
        }
        Err(io(format!("{key}: its blob kept being collected under the read")))
    }

    /// Every version retention has kept, oldest first.
    pub fn versions(&self, key: &str) -> Result<Vec<Meta>, StoreError> {
        check_key(key)?;
        let txn = self.inner.db.begin_read().map_err(io)?;
        let t = txn.open_table(VERSIONS).map_err(io)?;
        let mut out = Vec::new();
        for row in t.range((key, 0)..=(key, u64::MAX)).map_err(io)? {
            let (k, v) = row.map_err(io)?;
            out.push(self.inner.meta_of(key, k.value().1, &Record::decode(v.value())?));
        }
        if out.is_empty() {
            return Err(StoreError::NotFound(format!("no such key: {key}")));
        }
        Ok(out)
    }

    /// Live keys under `prefix` in key order (their latest versions), and
    /// whether more were left out.
    pub fn keys(&self, prefix: &str, limit: usize) -> Result<(Vec<Meta>, bool), StoreError> {
        check_prefix(prefix)?;
        let txn = self.inner.db.begin_read().map_err(io)?;
        let heads = txn.open_table(HEADS).map_err(io)?;
        let versions = txn.open_table(VERSIONS).map_err(io)?;
        let mut out = Vec::new();
        for row in heads.range(prefix..).map_err(io)? {
            let (k, v) = row.map_err(io)?;
            let key = k.value();
            if !key.starts_with(prefix) {
                break;
            }
            let Some(rec) = versions.get((key, v.value())).map_err(io)? else { continue };
            let rec = Record::decode(rec.value())?;
            if rec.deleted {
                continue;
            }
            if out.len() == limit {
                return Ok((out, true));
            }
            out.push(self.inner.meta_of(key, v.value(), &rec));
        }
        Ok((out, false))
    }

    /// Changes under `prefix` after `since` (at most `max`), and the feed's
    /// sequence number they were read at.
    pub fn changes(&self, prefix: &str, since: u64, max: usize) -> Result<(Vec<Change>, u64), StoreError> {
        let first = self.inner.feed_first.load(Relaxed);
        if since + 1 < first {
            return Err(StoreError::Gone { since, first });
        }
        let txn = self.inner.db.begin_read().map_err(io)?;
        let feed = txn.open_table(FEED).map_err(io)?;
        let seq = last_seq(&feed)?;
        let mut out = Vec::new();
        let mut read_to = seq;
        for row in feed.range(since.saturating_add(1)..).map_err(io)? {
            let (k, v) = row.map_err(io)?;
            let c: Change = serde_json::from_slice(v.value()).map_err(io)?;
            if c.key.starts_with(prefix) {
                if out.len() == max {
                    read_to = k.value() - 1;
                    break;
                }
                out.push(c);
            }
        }
        Ok((out, read_to))
    }

    /// The sequence number of the last committed change.
    pub fn seq(&self) -> u64 {
        *self.inner.seq.borrow()
    }

    /// Wakes whenever a commit advances the sequence number.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.seq.subscribe()
    }

    /// Totals for `GET /v1/store`: (live keys, versions, bytes held).
    pub fn totals(&self) -> Result<(u64, u64, u64), StoreError> {
        let txn = self.inner.db.begin_read().map_err(io)?;
        let versions = txn.open_table(VERSIONS).map_err(io)?;
        let heads = txn.open_table(HEADS).map_err(io)?;
        let (mut n, mut bytes, mut live) = (0u64, 0u64, 0u64);
        for row in versions.iter().map_err(io)? {
            let (_, v) = row.map_err(io)?;
            let r = Record::decode(v.value())?;
            n += 1;
            bytes = bytes.saturating_add(r.size);
        }
        for row in heads.iter().map_err(io)? {
            let (k, v) = row.map_err(io)?;
            if let Some(r) = versions.get((k.value(), v.value())).map_err(io)? {
                live += u64::from(!Record::decode(r.value())?.deleted);
            }
        }
        Ok((live, n, bytes))
    }

    /// Run age-based retention now (it also runs every `gc_every`).
    pub fn collect(&self) -> Result<usize, StoreError> {
        self.inner.collect_aged()
    }

    /// A named counter of the node's own (e.g. the trigger cursor).
    pub fn counter(&self, name: &str) -> Result<Option<u64>, StoreError> {
        let txn = self.inner.db.begin_read().map_err(io)?;
        let t = txn.open_table(COUNTERS).map_err(io)?;
        Ok(t.get(format!("node/{name}").as_str()).map_err(io)?.map(|v| v.value()))
    }

    /// Set a named counter (its own durable commit).
    pub fn set_counter(&self, name: &str, value: u64) -> Result<(), StoreError> {
        let txn = self.inner.db.begin_write().map_err(io)?;
        txn.open_table(COUNTERS).map_err(io)?.insert(format!("node/{name}").as_str(), value).map_err(io)?;
        txn.commit().map_err(io)
    }

    /// The oldest change the feed still holds.
    pub fn feed_first(&self) -> u64 {
        self.inner.feed_first.load(Relaxed)
    }

    /// Blob files waiting for their pins to lapse before they are unlinked.
    pub fn blobs_held(&self) -> usize {
        self.inner.blobs.doomed_len()
    }
}

/// `(pool prefix, affinity key)` of `key` among `pools` (see [`Store::affinity_of`]).
pub fn affinity_of(pools: &[Pool], key: &str) -> Option<(String, String)> {
    let pool = pools.iter().filter(|p| key.starts_with(&p.prefix)).max_by_key(|p| p.prefix.len())?;
    let caps = pool.affinity.as_ref()?.captures(key)?;
    Some((pool.prefix.clone(), caps.get(1)?.as_str().to_string()))
}

impl Drop for Store {
    fn drop(&mut self) {
        self.writes.lock().take();
        {
            let (lock, cv) = &*self.stop;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_all();
        }
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

/// The sequence number of the last change: the feed's last key (the feed
/// always keeps its newest entries), 0 before the first.
fn last_seq(feed: &impl ReadableTable<u64, &'static [u8]>) -> Result<u64, StoreError> {
    Ok(feed.last().map_err(io)?.map_or(0, |(k, _)| k.value()))
}

type VersionsTable<'t> = redb::Table<'t, (&'static str, u64), &'static [u8]>;

/// The records of `key`'s versions 1..=`upto` that retention has kept.
fn records(versions: &VersionsTable<'_>, key: &str, upto: u64) -> Result<Vec<(u64, Record)>, StoreError> {
    versions
        .range((key, 0)..=(key, upto))
        .map_err(io)?
        .map(|row| {
            let (k, v) = row.map_err(io)?;
            Ok((k.value().1, Record::decode(v.value())?))
        })
        .collect()
}

/// Remove one version (its record and inline value); its blob file, if
/// any, goes to `garbage`, to be unlinked once the removal has committed.
fn remove_version(
    versions: &mut VersionsTable<'_>,
    inline: &mut VersionsTable<'_>,
    key: &str,
    version: u64,
    r: &Record,
    garbage: &mut Vec<u64>,
) -> Result<(), StoreError> {
    versions.remove((key, version)).map_err(io)?;
    inline.remove((key, version)).map_err(io)?;
    garbage.extend(r.blob);
    Ok(())
}

/// What one write in a group commit came to, before the commit.
enum Outcome {
    Done(Committed, Option<StagedBlob>),
    Refused(StoreError),
}

impl Inner {
    fn pool_of(&self, key: &str) -> &Pool {
        static ROOT: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
        self.opts
            .pools
            .iter()
            .filter(|p| key.starts_with(&p.prefix))
            .max_by_key(|p| p.prefix.len())
            .unwrap_or_else(|| ROOT.get_or_init(Pool::root))
    }

    fn meta_of(&self, key: &str, version: u64, r: &Record) -> Meta {
        Meta {
            key: key.to_string(),
            version,
            timestamp: secs(r.ts),
            size: r.size,
            content_type: r.ct.clone(),
            deleted: r.deleted,
            path: r.blob.map(|id| self.blobs.path(id)),
        }
    }

    fn find(&self, txn: &redb::ReadTransaction, key: &str, select: Select) -> Result<(Meta, Record), StoreError> {
        check_key(key)?;
        let heads = txn.open_table(HEADS).map_err(io)?;
        let versions = txn.open_table(VERSIONS).map_err(io)?;
        let latest = heads.get(key).map_err(io)?.map(|v| v.value()).unwrap_or(0);
        if latest == 0 {
            return Err(StoreError::NotFound(format!("no such key: {key}")));
        }
        let (version, rec) = match select {
            Select::Latest | Select::Version(_) => {
                let v = if let Select::Version(v) = select { v } else { latest };
                if v == 0 || v > latest {
                    return Err(StoreError::NotFound(format!("{key} has no version {v} (latest is {latest})")));
                }
                let rec = versions
                    .get((key, v))
                    .map_err(io)?
                    .ok_or_else(|| StoreError::NotFound(format!("version {v} of {key} was removed by retention")))?;
                (v, Record::decode(rec.value())?)
            }
            Select::AsOf(t) => {
                let mut found = None;
                for row in versions.range((key, 0)..=(key, latest)).map_err(io)?.rev() {
                    let (k, v) = row.map_err(io)?;
                    let rec = Record::decode(v.value())?;
                    if rec.ts <= t {
                        found = Some((k.value().1, rec));
                        break;
                    }
                }
                found.ok_or_else(|| {
                    StoreError::NotFound(format!("{key} had no version (that retention kept) at {:.6}", secs(t)))
                })?
            }
        };
        if rec.deleted && !matches!(select, Select::Version(_)) {
            return Err(StoreError::NotFound(format!("{key} was deleted at version {version}")));
        }
        Ok((self.meta_of(key, version, &rec), rec))
    }

    fn commit_loop(self: Arc<Self>, rx: Receiver<(Write, Reply)>) {
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            while jobs.len() < 512 {
                match rx.try_recv() {
                    Ok(j) => jobs.push(j),
                    Err(_) => break,
                }
            }
            let (writes, replies): (Vec<Write>, Vec<Reply>) = jobs.into_iter().unzip();
            match self.commit_group(writes) {
                Ok(outcomes) => {
                    for (o, reply) in outcomes.into_iter().zip(replies) {
                        let _ = reply.send(match o {
                            Outcome::Done(c, blob) => {
                                if let Some(b) = blob {
                                    b.keep();
                                }
                                Ok(c)
                            }
                            Outcome::Refused(e) => Err(e),
                        });
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(io(format!("commit failed: {e}"))));
                    }
                }
            }
        }
    }

    /// Apply `writes` in order in one transaction and commit it (fsync).
    /// Blob files of refused or failed writes are unlinked when the
    /// outcomes drop; those of committed ones are kept by the caller.
    fn commit_group(&self, writes: Vec<Write>) -> Result<Vec<Outcome>, StoreError> {
        let txn = self.db.begin_write().map_err(io)?;
        let mut outcomes = Vec::with_capacity(writes.len());
        let mut garbage = Vec::new();
        let seq = {
            let mut heads = txn.open_table(HEADS).map_err(io)?;
            let mut versions = txn.open_table(VERSIONS).map_err(io)?;
            let mut inline = txn.open_table(INLINE).map_err(io)?;
            let mut feed = txn.open_table(FEED).map_err(io)?;
            let mut counters = txn.open_table(COUNTERS).map_err(io)?;
            let mut seq = last_seq(&feed)?;
            let mut blob_next = 0u64;
            for w in writes {
                let key = w.key.as_str();
                let latest = heads.get(key).map_err(io)?.map(|v| v.value()).unwrap_or(0);
                let prev = match versions.get((key, latest)).map_err(io)? {
                    Some(r) => Some(Record::decode(r.value())?),
                    None => None,
                };
                if let Some(expected) = w.if_version {
                    if expected != latest {
                        outcomes.push(Outcome::Refused(StoreError::Conflict { key: w.key, expected, current: latest }));
                        continue;
                    }
                }
                if w.value.is_none() && prev.as_ref().is_none_or(|p| p.deleted) {
                    outcomes.push(Outcome::Refused(StoreError::NotFound(format!("no live value to delete at {key}"))));
                    continue;
                }
                let version = latest + 1;
                let ts = now_us().max(prev.as_ref().map_or(0, |p| p.ts + 1));
                let (rec, blob) = match w.value {
                    None => (Record { ts, size: 0, ct: String::new(), blob: None, deleted: true }, None),
                    Some(Staged::Inline(bytes)) => {
                        inline.insert((key, version), bytes.as_slice()).map_err(io)?;
                        (Record { ts, size: bytes.len() as u64, ct: w.content_type, blob: None, deleted: false }, None)
                    }
                    Some(Staged::Blob(b)) => {
                        blob_next = blob_next.max(b.id() + 1);
                        (Record { ts, size: b.size(), ct: w.content_type, blob: Some(b.id()), deleted: false }, Some(b))
                    }
                };
                versions.insert((key, version), serde_json::to_vec(&rec).map_err(io)?.as_slice()).map_err(io)?;
                heads.insert(key, version).map_err(io)?;
                seq += 1;
                let change = Change { seq, key: key.to_string(), version, timestamp: secs(ts), deleted: rec.deleted };
                feed.insert(seq, serde_json::to_vec(&change).map_err(io)?.as_slice()).map_err(io)?;
                // Retention by count, now, in the same transaction.
                let keep = self.pool_of(key).keep_versions;
                if version > keep {
                    let cut = version - keep;
                    for (v, r) in records(&versions, key, cut)? {
                        remove_version(&mut versions, &mut inline, key, v, &r, &mut garbage)?;
                    }
                }
                let meta = self.meta_of(key, version, &rec);
                outcomes.push(Outcome::Done(Committed { meta, seq }, blob));
            }
            // Blob ids are never reused, even for files already collected
            // (a path once handed out never names other bytes).
            if blob_next > counters.get("blob_next").map_err(io)?.map_or(0, |v| v.value()) {
                counters.insert("blob_next", blob_next).map_err(io)?;
            }
            // Trim the feed to its last `feed_keep` changes.
            let first = self.feed_first.load(Relaxed);
            if seq > self.opts.feed_keep && seq - self.opts.feed_keep > first {
                let upto = seq - self.opts.feed_keep;
                for s in first..upto {
                    feed.remove(s).map_err(io)?;
                }
            }
            seq
        };
        if !outcomes.iter().any(|o| matches!(o, Outcome::Done(..))) {
            // Every write was refused: nothing to make durable.
            txn.abort().map_err(io)?;
            return Ok(outcomes);
        }
        txn.commit().map_err(io)?;
        if seq > self.opts.feed_keep {
            self.feed_first.fetch_max(seq - self.opts.feed_keep, Relaxed);
        }
        self.blobs.doom(garbage);
        self.seq.send_replace(seq);
        Ok(outcomes)
    }

    /// Age-based retention: in pools with `keep_age`, remove versions older
    /// than it, except each key's latest live one.
    fn collect_aged(&self) -> Result<usize, StoreError> {
        self.blobs.unlink_unpinned();
        let aged: Vec<&Pool> = self.opts.pools.iter().filter(|p| p.keep_age.is_some()).collect();
        if aged.is_empty() {
            return Ok(0);
        }
        let now = now_us();
        let txn = self.db.begin_write().map_err(io)?;
        let mut garbage = Vec::new();
        let mut removed = 0;
        {
            let heads = txn.open_table(HEADS).map_err(io)?;
            let mut versions = txn.open_table(VERSIONS).map_err(io)?;
            let mut inline = txn.open_table(INLINE).map_err(io)?;
            for pool in aged {
                let cutoff = now.saturating_sub(pool.keep_age.map_or(0, |a| a.as_micros() as u64));
                let keys: Vec<(String, u64)> = heads
                    .range(pool.prefix.as_str()..)
                    .map_err(io)?
                    .map(|row| row.map(|(k, v)| (k.value().to_string(), v.value())).map_err(io))
                    .take_while(|r| r.as_ref().map_or(true, |(k, _)| k.starts_with(&pool.prefix)))
                    .collect::<Result<_, _>>()?;
                for (key, latest) in keys {
                    // Only keys this pool governs (not a longer pool's).
                    if self.pool_of(&key).prefix != pool.prefix {
                        continue;
                    }
                    for (v, r) in records(&versions, &key, latest)? {
                        let is_latest_live = v == latest && !r.deleted;
                        if r.ts < cutoff && !is_latest_live {
                            remove_version(&mut versions, &mut inline, &key, v, &r, &mut garbage)?;
                            removed += 1;
                        }
                    }
                }
            }
        }
        txn.commit().map_err(io)?;
        self.blobs.doom(garbage);
        Ok(removed)
    }
}

#[cfg(test)]
mod tests;
