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
/// (key, version, digest) -> [`Held`] as JSON: bytes held durably for a
/// version a cluster commit has not named yet (see [`Store::hold`]).
const HELD: TableDefinition<(&str, u64, &str), &[u8]> = TableDefinition::new("held");
/// (key, version, digest) -> a held value stored inline.
const HELD_INLINE: TableDefinition<(&str, u64, &str), &[u8]> = TableDefinition::new("held_inline");

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
    #[error("version {version} of {key} is held on other nodes ({holders:?}), not here")]
    Elsewhere { key: String, version: u64, digest: String, holders: Vec<String> },
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
            StoreError::Io(_) | StoreError::Closed | StoreError::Elsewhere { .. } => "store_unavailable",
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
    /// In a cluster: nodes holding each value (None: the node's setting).
    pub copies: Option<u32>,
    /// In a cluster: copies durable before a put is acknowledged (None: all).
    pub write_copies: Option<u32>,
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
        Ok(Pool { prefix: prefix.to_string(), keep_versions, keep_age, affinity, copies: None, write_copies: None })
    }

    /// The pool with its copies in a cluster set (see [`Pool::copies`]).
    pub fn with_copies(self, copies: Option<u32>, write_copies: Option<u32>) -> Result<Pool, StoreError> {
        let bad = |what: &str| StoreError::BadRequest(format!("pool {}: {what}", self.prefix));
        if copies.is_some_and(|c| !(1..=64).contains(&c)) || write_copies.is_some_and(|c| !(1..=64).contains(&c)) {
            return Err(bad("copies and write_copies are in 1..=64"));
        }
        if let (Some(c), Some(w)) = (copies, write_copies) {
            if w > c {
                return Err(bad("write_copies cannot exceed copies"));
            }
        }
        Ok(Pool { copies, write_copies, ..self })
    }

    fn root() -> Pool {
        Pool { prefix: "/".into(), keep_versions: 16, keep_age: None, affinity: None, copies: None, write_copies: None }
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
    /// The value's digest (versions committed through a cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    digest: Option<String>,
    /// The nodes the cluster commit named as holding the value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    holders: Vec<String>,
    /// The value is not on this node (a replicated record whose bytes are
    /// held elsewhere until fetched).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    absent: bool,
}

/// Bytes held for an uncommitted cluster version (the value of [`HELD`]).
#[derive(Serialize, Deserialize)]
struct Held {
    size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    blob: Option<u64>,
    /// When it was held, unix µs (0 in rows written before it was kept).
    #[serde(default)]
    at_us: u64,
}

/// Bytes this node holds for a cluster version it has not applied (see
/// [`Store::held`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HeldVersion {
    pub key: String,
    pub version: u64,
    pub digest: String,
    /// How long ago they were held.
    pub age: Duration,
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
    /// The value's digest (SHA-256, hex), for versions committed through a cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The nodes holding the value (a cluster's versions); empty on one node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<String>,
    /// Whether the value's bytes are on this node (false: held elsewhere,
    /// fetched on first read).
    #[serde(skip_serializing_if = "is_true")]
    pub local: bool,
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
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
    /// For a version a cluster committed, the etcd revision of its commit
    /// (0: a change of this node's own).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rev: u64,
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
    /// A version a cluster committed, applied here as it was decided there
    /// (`if_version` is then ignored); None: this store decides.
    pub replicated: Option<Replicated>,
}

impl Write {
    /// A put this store decides (the version after the latest).
    pub fn put(key: String, value: Staged, content_type: String, if_version: Option<u64>) -> Write {
        Write { key, value: Some(value), content_type, if_version, replicated: None }
    }
}

/// A version decided by the cluster's commit (etcd), applied to this
/// node's store: its number and timestamp are the commit's, and its value
/// is here (given with the write, or held beforehand by [`Store::hold`]) or
/// on `holders` (an absent record, fetched on first read and filled in by
/// applying it again with the value).
#[derive(Clone, Debug)]
pub struct Replicated {
    pub version: u64,
    /// Unix time in microseconds.
    pub ts_us: u64,
    pub size: u64,
    pub digest: String,
    /// (Empty when filling in a value: the holders recorded stay.)
    pub holders: Vec<String>,
    pub deleted: bool,
    /// The etcd revision that committed it (noted in its change).
    pub rev: u64,
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
            txn.open_table(HELD_INLINE).map_err(io)?;
            for row in txn.open_table(HELD).map_err(io)?.iter().map_err(io)? {
                let (_, v) = row.map_err(io)?;
                let h: Held = serde_json::from_slice(v.value()).map_err(io)?;
                referenced.extend(h.blob);
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

    /// Commit `writes` in their order (one group commit when they arrive
    /// together), blocking until each is decided; their outcomes in order.
    pub fn write_all(&self, writes: Vec<Write>) -> Vec<Result<Committed, StoreError>> {
        let Some(tx) = self.writes.lock().clone() else {
            return writes.iter().map(|_| Err(StoreError::Closed)).collect();
        };
        let mut waits = Vec::with_capacity(writes.len());
        for w in writes {
            if let Err(e) = check_key(&w.key) {
                waits.push(Err(e));
                continue;
            }
            let (reply_tx, reply_rx) = sync_channel(1);
            waits.push(match tx.send((w, reply_tx)) {
                Ok(()) => Ok(reply_rx),
                Err(_) => Err(StoreError::Closed),
            });
        }
        waits.into_iter().map(|w| w.and_then(|rx| rx.recv().map_err(|_| StoreError::Closed)?)).collect()
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
        self.write(Write::put(key.into(), staged, content_type.into(), if_version))
    }

    /// Write a tombstone version.
    pub fn delete(&self, key: &str, if_version: Option<u64>) -> Result<Committed, StoreError> {
        self.write(Write { key: key.into(), value: None, content_type: String::new(), if_version, replicated: None })
    }

    /// Hold `value` durably for version `version` of `key`, which a
    /// cluster commit (elsewhere) may name next, under `digest` (the
    /// caller has checked it). Applying that version ([`Replicated`])
    /// then takes these bytes; if the version is already applied here
    /// without its value, it is filled in now.
    pub fn hold(&self, key: &str, version: u64, digest: &str, value: Staged) -> Result<(), StoreError> {
        check_key(key)?;
        let txn = self.inner.db.begin_write().map_err(io)?;
        let mut kept = None;
        {
            let mut versions = txn.open_table(VERSIONS).map_err(io)?;
            let mut inline = txn.open_table(INLINE).map_err(io)?;
            let existing = versions.get((key, version)).map_err(io)?.map(|r| Record::decode(r.value()));
            match existing.transpose()? {
                Some(rec) if !rec.absent || rec.digest.as_deref() != Some(digest) => return Ok(()),
                Some(mut rec) => {
                    kept = place_value(&mut inline, key, version, value, &mut rec)?;
                    rec.absent = false;
                    versions.insert((key, version), serde_json::to_vec(&rec).map_err(io)?.as_slice()).map_err(io)?;
                }
                None => {
                    let size = value.size();
                    let blob = match value {
                        Staged::Inline(bytes) => {
                            txn.open_table(HELD_INLINE)
                                .map_err(io)?
                                .insert((key, version, digest), bytes.as_slice())
                                .map_err(io)?;
                            None
                        }
                        Staged::Blob(b) => {
                            let id = b.id();
                            kept = Some(b);
                            Some(id)
                        }
                    };
                    let h = serde_json::to_vec(&Held { size, blob, at_us: now_us() }).map_err(io)?;
                    txn.open_table(HELD).map_err(io)?.insert((key, version, digest), h.as_slice()).map_err(io)?;
                }
            }
            if let Some(b) = &kept {
                let mut counters = txn.open_table(COUNTERS).map_err(io)?;
                if b.id() + 1 > counters.get("blob_next").map_err(io)?.map_or(0, |v| v.value()) {
                    counters.insert("blob_next", b.id() + 1).map_err(io)?;
                }
            }
        }
        txn.commit().map_err(io)?;
        if let Some(b) = kept {
            b.keep();
        }
        Ok(())
    }

    /// Every version this node holds bytes for that it has not applied:
    /// a put still committing, or one whose coordinator died before its
    /// commit (the cluster sweeps those, see [`Store::drop_held`]).
    pub fn held(&self) -> Result<Vec<HeldVersion>, StoreError> {
        let txn = self.inner.db.begin_read().map_err(io)?;
        let now = now_us();
        let mut out = Vec::new();
        for row in txn.open_table(HELD).map_err(io)?.iter().map_err(io)? {
            let (k, v) = row.map_err(io)?;
            let (key, version, digest) = k.value();
            let h: Held = serde_json::from_slice(v.value()).map_err(io)?;
            let age = Duration::from_micros(now.saturating_sub(h.at_us));
            out.push(HeldVersion { key: key.to_string(), version, digest: digest.to_string(), age });
        }
        Ok(out)
    }

    /// Drop the bytes held for (key, version, digest); false if none were.
    pub fn drop_held(&self, key: &str, version: u64, digest: &str) -> Result<bool, StoreError> {
        let txn = self.inner.db.begin_write().map_err(io)?;
        let mut garbage = Vec::new();
        let dropped = {
            let mut held = txn.open_table(HELD).map_err(io)?;
            let Some(h) = held.remove((key, version, digest)).map_err(io)? else { return Ok(false) };
            let h: Held = serde_json::from_slice(h.value()).map_err(io)?;
            garbage.extend(h.blob);
            txn.open_table(HELD_INLINE).map_err(io)?.remove((key, version, digest)).map_err(io)?;
            true
        };
        txn.commit().map_err(io)?;
        self.inner.blobs.doom(garbage);
        Ok(dropped)
    }

    /// The bytes of version `version` of `key` if they are on this node
    /// and their digest is `digest`: committed here, or held for it.
    pub fn value_of(&self, key: &str, version: u64, digest: &str) -> Result<Option<Body>, StoreError> {
        match self.get(key, Select::Version(version)) {
            Ok((meta, body)) if meta.digest.as_deref() == Some(digest) => return Ok(Some(body)),
            Ok(_) | Err(StoreError::NotFound(_)) | Err(StoreError::Elsewhere { .. }) => {}
            Err(e) => return Err(e),
        }
        let txn = self.inner.db.begin_read().map_err(io)?;
        let Some(h) = txn.open_table(HELD).map_err(io)?.get((key, version, digest)).map_err(io)? else {
            return Ok(None);
        };
        let h: Held = serde_json::from_slice(h.value()).map_err(io)?;
        match h.blob {
            Some(id) => self.inner.blobs.map(id, h.size).map(|m| Some(Body::Mapped(m))),
            None => {
                let t = txn.open_table(HELD_INLINE).map_err(io)?;
                Ok(t.get((key, version, digest)).map_err(io)?.map(|v| Body::Inline(v.value().to_vec())))
            }
        }
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
            if rec.absent {
                return Err(StoreError::Elsewhere {
                    key: key.to_string(),
                    version: meta.version,
                    digest: rec.digest.unwrap_or_default(),
                    holders: rec.holders,
                });
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

/// The pool `key` belongs to among `pools` (the longest matching prefix), if any.
pub fn pool_of<'a>(pools: &'a [Pool], key: &str) -> Option<&'a Pool> {
    pools.iter().filter(|p| key.starts_with(&p.prefix)).max_by_key(|p| p.prefix.len())
}

/// `(pool prefix, affinity key)` of `key` among `pools` (see [`Store::affinity_of`]).
pub fn affinity_of(pools: &[Pool], key: &str) -> Option<(String, String)> {
    let pool = pool_of(pools, key)?;
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

/// The tables a replicated write touches.
struct Tables<'a, 't> {
    blobs: &'a blob::Blobs,
    versions: &'a mut VersionsTable<'t>,
    inline: &'a mut VersionsTable<'t>,
    held: &'a mut HeldTable<'t>,
    held_inline: &'a mut HeldTable<'t>,
}

type HeldTable<'t> = redb::Table<'t, (&'static str, u64, &'static str), &'static [u8]>;

/// What applying a replicated version did (its record, number, and the
/// blob file a commit must keep).
enum Applied {
    New(Record, u64, Option<StagedBlob>),
    Filled(Record, u64, Option<StagedBlob>),
    Exists(Record, u64, Option<StagedBlob>),
}

impl Record {
    fn new(ts: u64, ct: String) -> Record {
        Record { ts, size: 0, ct, blob: None, deleted: false, digest: None, holders: Vec::new(), absent: false }
    }
}

/// Put `value` where `rec` can name it: inline in the table, or its blob
/// file (returned: the commit keeps it).
fn place_value(
    inline: &mut VersionsTable<'_>,
    key: &str,
    version: u64,
    value: Staged,
    rec: &mut Record,
) -> Result<Option<StagedBlob>, StoreError> {
    rec.size = value.size();
    match value {
        Staged::Inline(bytes) => {
            inline.insert((key, version), bytes.as_slice()).map_err(io)?;
            Ok(None)
        }
        Staged::Blob(b) => {
            rec.blob = Some(b.id());
            Ok(Some(b))
        }
    }
}

/// Write `rec` as version `version` of `key`, make it the latest, and note
/// the change in the feed at `seq`.
#[allow(clippy::too_many_arguments)]
fn name_version(
    heads: &mut redb::Table<'_, &'static str, u64>,
    versions: &mut VersionsTable<'_>,
    feed: &mut redb::Table<'_, u64, &'static [u8]>,
    key: &str,
    version: u64,
    rec: &Record,
    seq: u64,
    rev: u64,
) -> Result<(), StoreError> {
    versions.insert((key, version), serde_json::to_vec(rec).map_err(io)?.as_slice()).map_err(io)?;
    heads.insert(key, version).map_err(io)?;
    let change = Change { seq, key: key.to_string(), version, timestamp: secs(rec.ts), deleted: rec.deleted, rev };
    feed.insert(seq, serde_json::to_vec(&change).map_err(io)?.as_slice()).map_err(io)?;
    Ok(())
}

/// The value held for (key, version, digest), taken out of the held tables.
fn take_held(t: &mut Tables<'_, '_>, key: &str, version: u64, digest: &str) -> Result<Option<Staged>, StoreError> {
    let Some(h) = t.held.remove((key, version, digest)).map_err(io)? else { return Ok(None) };
    let h: Held = serde_json::from_slice(h.value()).map_err(io)?;
    let inline = t.held_inline.remove((key, version, digest)).map_err(io)?.map(|v| v.value().to_vec());
    Ok(match (h.blob, inline) {
        // The file stays where it is; the version names it now. (Should
        // the commit fail, the file is unlinked while the rolled-back held
        // row still names it: that version is then fetched from a holder.)
        (Some(id), _) => Some(Staged::Blob(t.blobs.adopt(id, h.size))),
        (None, Some(bytes)) => Some(Staged::Inline(bytes)),
        (None, None) => None,
    })
}

/// Drop what is held for versions of `key` up to `version` (puts that lost
/// their commit to another, or were applied already).
fn drop_held_below(t: &mut Tables<'_, '_>, key: &str, version: u64, garbage: &mut Vec<u64>) -> Result<(), StoreError> {
    let stale: Vec<(u64, String)> = t
        .held
        .range((key, 0, "")..=(key, version, "\u{10ffff}"))
        .map_err(io)?
        .map(|row| row.map(|(k, _)| (k.value().1, k.value().2.to_string())).map_err(io))
        .collect::<Result<_, _>>()?;
    for (v, d) in stale {
        if let Some(h) = t.held.remove((key, v, d.as_str())).map_err(io)? {
            let h: Held = serde_json::from_slice(h.value()).map_err(io)?;
            garbage.extend(h.blob);
        }
        t.held_inline.remove((key, v, d.as_str())).map_err(io)?;
    }
    Ok(())
}

impl Inner {
    fn pool_of(&self, key: &str) -> &Pool {
        static ROOT: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
        pool_of(&self.opts.pools, key).unwrap_or_else(|| ROOT.get_or_init(Pool::root))
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
            digest: r.digest.clone(),
            holders: r.holders.clone(),
            local: !r.absent,
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
            let mut held = txn.open_table(HELD).map_err(io)?;
            let mut held_inline = txn.open_table(HELD_INLINE).map_err(io)?;
            for mut w in writes {
                let key = w.key.as_str();
                let latest = heads.get(key).map_err(io)?.map(|v| v.value()).unwrap_or(0);
                let prev = match versions.get((key, latest)).map_err(io)? {
                    Some(r) => Some(Record::decode(r.value())?),
                    None => None,
                };
                if let Some(rep) = w.replicated.take() {
                    let rep_rev = rep.rev;
                    let mut tables = Tables {
                        blobs: &self.blobs,
                        versions: &mut versions,
                        inline: &mut inline,
                        held: &mut held,
                        held_inline: &mut held_inline,
                    };
                    let out =
                        self.apply_replicated(&mut tables, &w.key, rep, w.value, w.content_type, latest, &mut garbage)?;
                    let rev = rep_rev;
                    let (rec, version, blob) = match out {
                        Applied::Filled(rec, version, blob) | Applied::Exists(rec, version, blob) => {
                            let meta = self.meta_of(key, version, &rec);
                            outcomes.push(Outcome::Done(Committed { meta, seq }, blob));
                            continue;
                        }
                        Applied::New(rec, version, blob) => (rec, version, blob),
                    };
                    blob_next = blob_next.max(blob.as_ref().map_or(0, |b| b.id() + 1));
                    seq += 1;
                    name_version(&mut heads, &mut versions, &mut feed, key, version, &rec, seq, rev)?;
                    self.retain_count(&mut versions, &mut inline, key, version, &mut garbage)?;
                    let meta = self.meta_of(key, version, &rec);
                    outcomes.push(Outcome::Done(Committed { meta, seq }, blob));
                    continue;
                }
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
                let mut rec = Record::new(ts, w.content_type);
                let blob = match w.value {
                    None => {
                        rec.deleted = true;
                        rec.ct = String::new();
                        None
                    }
                    Some(v) => {
                        let b = place_value(&mut inline, key, version, v, &mut rec)?;
                        blob_next = blob_next.max(b.as_ref().map_or(0, |b| b.id() + 1));
                        b
                    }
                };
                seq += 1;
                name_version(&mut heads, &mut versions, &mut feed, key, version, &rec, seq, 0)?;
                self.retain_count(&mut versions, &mut inline, key, version, &mut garbage)?;
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

    /// Retention by count for `key` after `version` committed, in the
    /// same transaction.
    fn retain_count(
        &self,
        versions: &mut VersionsTable<'_>,
        inline: &mut VersionsTable<'_>,
        key: &str,
        version: u64,
        garbage: &mut Vec<u64>,
    ) -> Result<(), StoreError> {
        let keep = self.pool_of(key).keep_versions;
        if version > keep {
            for (v, r) in records(versions, key, version - keep)? {
                remove_version(versions, inline, key, v, &r, garbage)?;
            }
        }
        Ok(())
    }

    /// Apply a version the cluster committed (see [`Replicated`]): a new
    /// record when it is past the latest; the value filled in when the
    /// record exists without it; nothing when it is already here (a
    /// replay after a restart, or a version retention already removed).
    /// Its value comes with the write, or from bytes held for it, which
    /// are consumed; bytes held for earlier versions of the key are
    /// dropped (puts that lost their commit).
    #[allow(clippy::too_many_arguments)]
    fn apply_replicated(
        &self,
        t: &mut Tables<'_, '_>,
        key: &str,
        rep: Replicated,
        value: Option<Staged>,
        content_type: String,
        latest: u64,
        garbage: &mut Vec<u64>,
    ) -> Result<Applied, StoreError> {
        let mut value = value;
        if value.is_none() && !rep.deleted {
            value = take_held(t, key, rep.version, &rep.digest)?;
        }
        drop_held_below(t, key, rep.version, garbage)?;
        if rep.version <= latest {
            let existing = t.versions.get((key, rep.version)).map_err(io)?.map(|r| Record::decode(r.value()));
            let Some(mut rec) = existing.transpose()? else {
                // Removed by retention already: nothing to do (a value
                // given or held drops here, its blob file unlinked).
                let rec = Record { absent: true, ..Record::new(rep.ts_us, content_type) };
                return Ok(Applied::Exists(rec, rep.version, None));
            };
            let same = rec.digest.as_deref() == Some(rep.digest.as_str());
            // The cluster's repair moved the version to other holders.
            // (A fill, which does not know, says none.)
            let moved = same && !rep.holders.is_empty() && rec.holders != rep.holders;
            if moved {
                rec.holders = rep.holders;
            }
            let (blob, filled) = match value {
                Some(v) if rec.absent && same => {
                    let blob = place_value(t.inline, key, rep.version, v, &mut rec)?;
                    rec.absent = false;
                    (blob, true)
                }
                // The blob, if any, drops unkept (unlinked).
                _ => (None, false),
            };
            if filled || moved {
                t.versions.insert((key, rep.version), serde_json::to_vec(&rec).map_err(io)?.as_slice()).map_err(io)?;
            }
            match filled {
                true => Ok(Applied::Filled(rec, rep.version, blob)),
                false => Ok(Applied::Exists(rec, rep.version, None)),
            }
        } else {
            let mut rec = Record::new(rep.ts_us, content_type);
            rec.digest = Some(rep.digest);
            rec.holders = rep.holders;
            let blob = if rep.deleted {
                rec.deleted = true;
                rec.ct = String::new();
                None
            } else {
                rec.size = rep.size;
                match value {
                    Some(v) => place_value(t.inline, key, rep.version, v, &mut rec)?,
                    None => {
                        rec.absent = true;
                        None
                    }
                }
            };
            Ok(Applied::New(rec, rep.version, blob))
        }
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
