//! Who owns a set of pool files, so that a process started later can remove
//! the files of one that died without removing them (a SIGKILL, the OOM
//! killer): pool files are memory, and a machine whose nodes are killed now
//! and then would otherwise fill `/dev/shm` until nothing can start.
//!
//! The owner of the files `{prefix}-*` holds an exclusive lock on
//! `{prefix}.lock` for as long as it lives ([`OwnerLock`]); the kernel
//! releases the lock with the process, however it ends. A sweeper that can
//! take the lock knows the owner is gone ([`sweep_orphans`]). Locks on a
//! file, not process ids: `/dev/shm` may be shared between PID namespaces
//! (containers), where another container's live node has a pid that looks
//! dead here, and a dead node's pid may have been reused.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// The lock that says "the files `{prefix}-*` are in use". Dropping it (or
/// the process ending) releases the lock; [`OwnerLock::release`] also
/// removes the lock file, after the owner removed its pool files.
#[derive(Debug)]
pub struct OwnerLock {
    _file: File,
    path: PathBuf,
}

impl OwnerLock {
    /// Lock `{dir}/{prefix}.lock`. The file is created and locked under a
    /// temporary name, then renamed into place (the lock stays with the
    /// file), so a sweeper never finds it unlocked while its owner lives.
    pub fn acquire(dir: &Path, prefix: &str) -> io::Result<OwnerLock> {
        let tmp = dir.join(format!(".{prefix}.lock.{}", std::process::id()));
        let file = OpenOptions::new().create(true).truncate(true).write(true).open(&tmp)?;
        file.lock()?;
        let path = dir.join(format!("{prefix}.lock"));
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(OwnerLock { _file: file, path })
    }

    /// Remove the lock file (the owner has removed its pool files).
    pub fn release(&self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Remove the files of every owner in `dir` whose name starts with
/// `family` and that no longer lives: `{prefix}-*` and `{prefix}.lock` for
/// each `{prefix}.lock` whose lock can be taken. Returns how many files
/// were removed. Errors (a file gone meanwhile, another sweeper) skip that
/// file: a sweep is housekeeping and never fails its caller.
pub fn sweep_orphans(dir: &Path, family: &str) -> usize {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    let names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    let mut removed = 0;
    for lock_name in names.iter().filter(|n| n.starts_with(family) && n.ends_with(".lock")) {
        let prefix = &lock_name[..lock_name.len() - ".lock".len()];
        let Ok(file) = File::open(dir.join(lock_name)) else { continue };
        if file.try_lock().is_err() {
            continue; // its owner lives (or the lock cannot be known): keep its files
        }
        let owned = format!("{prefix}-");
        for name in names.iter().filter(|n| n.starts_with(&owned)) {
            if fs::remove_file(dir.join(name)).is_ok() {
                removed += 1;
            }
        }
        if fs::remove_file(dir.join(lock_name)).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_live_owner_keeps_its_files_and_a_dead_one_loses_them() {
        let tmp = crate::test_util::TempDir::new("owner");
        let dir = tmp.path();
        let live = OwnerLock::acquire(dir, "fam-1-a").unwrap();
        let dead = OwnerLock::acquire(dir, "fam-2-b").unwrap();
        for f in ["fam-1-a-0", "fam-1-a-1", "fam-2-b-0", "fam-2-b-3", "fam-20-c-0", "other-0"] {
            fs::write(dir.join(f), b"x").unwrap();
        }
        assert_eq!(sweep_orphans(dir, "fam-"), 0, "both owners hold their locks");
        drop(dead); // as when the process ends: the kernel releases the lock
        assert_eq!(sweep_orphans(dir, "fam-"), 3);
        // "fam-20-c-0" has no lock file (not an owner this scheme knows): kept.
        assert_eq!(names(dir), ["fam-1-a-0", "fam-1-a-1", "fam-1-a.lock", "fam-20-c-0", "other-0"]);
        live.release();
        assert!(!dir.join("fam-1-a.lock").exists());
    }
}
