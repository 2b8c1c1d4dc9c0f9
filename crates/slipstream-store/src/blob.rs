//! Blob files: large values, one file each, immutable once named.
//!
//! A value is staged by writing `tmp/<id>`, fsyncing it, renaming it to
//! `blobs/<id>` and fsyncing the directory, all before the version that
//! names it commits. A [`StagedBlob`] that is dropped without being kept
//! (its write was refused, or the commit failed) unlinks its file: the
//! guard, not each error path, settles it.
//!
//! Collection: when retention removes a version, its file is *doomed*, and
//! unlinked once no pin holds it. A reader that asked for the file's path
//! (to map it itself) holds a pin for `pin_for`; a reader that has mapped
//! or opened the file keeps its data however long it likes (an unlinked
//! file lives until its last map closes).

use crate::{io, StoreError};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

pub(crate) struct Blobs {
    dir: PathBuf,
    tmp: PathBuf,
    next: AtomicU64,
    pin_for: Duration,
    pins: Mutex<HashMap<u64, Instant>>,
    doomed: Mutex<Vec<u64>>,
}

/// A value's blob file, written and durable, not yet named by a version.
pub struct StagedBlob {
    id: u64,
    size: u64,
    path: PathBuf,
    kept: bool,
}

impl StagedBlob {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// A committed version names this file now: keep it.
    pub(crate) fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for StagedBlob {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn name(id: u64) -> String {
    format!("{id:016x}")
}

fn fsync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(format!("fsync {}: {e}", dir.display())))
}

impl Blobs {
    /// Open the blob directory: clear half-written files, unlink files no
    /// version names (a crash between staging and committing), and start
    /// numbering after the highest id seen or committed (`next`).
    pub(crate) fn open(
        root: &Path,
        referenced: &HashSet<u64>,
        next: u64,
        pin_for: Duration,
    ) -> Result<Blobs, StoreError> {
        let dir = root.join("blobs");
        let tmp = root.join("tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        for d in [&dir, &tmp] {
            std::fs::create_dir_all(d).map_err(|e| io(format!("cannot create {}: {e}", d.display())))?;
        }
        let mut max = referenced.iter().copied().max().unwrap_or(0).max(next.saturating_sub(1));
        let mut swept = 0;
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let fname = entry.file_name();
            let Some(id) = fname.to_str().and_then(|s| u64::from_str_radix(s, 16).ok()) else { continue };
            max = max.max(id);
            if !referenced.contains(&id) {
                std::fs::remove_file(entry.path()).map_err(io)?;
                swept += 1;
            }
        }
        if swept > 0 {
            fsync_dir(&dir)?;
        }
        Ok(Blobs {
            dir,
            tmp,
            next: AtomicU64::new(max + 1),
            pin_for,
            pins: Mutex::new(HashMap::new()),
            doomed: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn path(&self, id: u64) -> PathBuf {
        self.dir.join(name(id))
    }

    /// Write `parts` (`size` bytes in all) to a new durable blob file.
    pub(crate) fn stage<B: AsRef<[u8]>>(&self, parts: &[B], size: u64) -> Result<StagedBlob, StoreError> {
        let id = self.next.fetch_add(1, Relaxed);
        let tmp = self.tmp.join(name(id));
        let path = self.path(id);
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            for p in parts {
                f.write_all(p.as_ref())?;
            }
            f.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(format!("cannot write {}: {e}", tmp.display())));
        }
        if let Err(e) = std::fs::rename(&tmp, &path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(format!("cannot move {} into place: {e}", tmp.display())));
        }
        let staged = StagedBlob { id, size, path, kept: false };
        fsync_dir(&self.dir)?;
        Ok(staged)
    }

    /// The durable blob file `id` (held for a version not yet named), to
    /// be named by a commit: kept if it commits, unlinked if not.
    pub(crate) fn adopt(&self, id: u64, size: u64) -> StagedBlob {
        StagedBlob { id, size, path: self.path(id), kept: false }
    }

    /// Map blob `id`, checking it holds the `size` bytes its version says.
    pub(crate) fn map(&self, id: u64, size: u64) -> Result<memmap2::Mmap, StoreError> {
        let path = self.path(id);
        let f = File::open(&path).map_err(|e| io(format!("cannot open {}: {e}", path.display())))?;
        let len = f.metadata().map_err(io)?.len();
        if len != size {
            return Err(io(format!("{} holds {len} bytes, its version says {size}", path.display())));
        }
        slipstream_shm::map_immutable_file(&f).map_err(|e| io(format!("cannot map {}: {e}", path.display())))
    }

    pub(crate) fn pin(&self, id: u64) {
        self.pins.lock().insert(id, Instant::now() + self.pin_for);
    }

    /// Files whose versions are gone: unlink now, or when their pins lapse.
    pub(crate) fn doom(&self, ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        self.doomed.lock().extend(ids);
        self.unlink_unpinned();
    }

    pub(crate) fn unlink_unpinned(&self) {
        let now = Instant::now();
        let mut pins = self.pins.lock();
        pins.retain(|_, until| *until > now);
        let mut doomed = self.doomed.lock();
        doomed.retain(|id| {
            if pins.contains_key(id) {
                return true;
            }
            let _ = std::fs::remove_file(self.path(*id));
            false
        });
    }

    pub(crate) fn doomed_len(&self) -> usize {
        self.doomed.lock().len()
    }
}
