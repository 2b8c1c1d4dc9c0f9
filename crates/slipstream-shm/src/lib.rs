//! The shared-memory arena of Slipstream.
//!
//! Tensors move between the node process and its Python workers without
//! being copied: the payload is written once into shared memory and from
//! then on only a small descriptor (pool id, byte offset, length) travels
//! over the control channel. This crate owns that memory. It is the only
//! crate in the workspace allowed to use `unsafe`, and it keeps the unsafe
//! surface small: turning a mapping plus an offset into a slice, and viewing
//! the bitmap words as atomics.
//!
//! # Pools
//!
//! A [`Pool`] is one file (normally under `/dev/shm`, see [`default_dir`])
//! mapped read-write and shared by every process that opens it. It holds a
//! fixed 4 KiB header, an allocation bitmap with one bit per page, and the
//! data region. Pages are 64 bytes (a cache line) by default, and the data
//! region is aligned so every block is page-aligned, which is what numpy and
//! SIMD kernels want. Offsets handed out are byte offsets from the *start of
//! the mapping*, so a reader needs only its own mapping base plus the offset;
//! nothing in the file contains a pointer.
//!
//! # Who may do what
//!
//! * **One allocator per pool.** Exactly one process (the pool's owner)
//!   allocates from a pool. Inside it, several threads may allocate: they
//!   serialise on an in-process mutex guarding the next-fit cursor.
//! * **Anyone frees.** Any process that maps the pool may free a range, with
//!   no lock at all: the node frees blocks a worker produced, a worker frees
//!   blocks the node handed it, and so on.
//!
//! This works without cross-process locks because the two operations touch
//! the bitmap in opposite directions: allocation only *sets* bits that are
//! clear (atomic `fetch_or` on the `u64` words in the shared mapping), free
//! only *clears* bits that are set (atomic `fetch_and`). A free can only make
//! the allocator's view more pessimistic for a moment, never wrong. As a
//! belt-and-braces measure a claim checks the previous word value and backs
//! out on conflict, so even two processes allocating at once cannot hand
//! out the same page. There is no lock to hold, so a process that dies
//! cannot wedge the others; at worst it leaks the pages it had allocated.
//!
//! # Invariants
//!
//! * A set bit means "this page belongs to exactly one live block"; every
//!   block is a run of whole pages, at least one even for zero bytes, so
//!   live blocks have distinct offsets and never overlap.
//! * Offsets returned by [`Pool::alloc`] lie in the data region and are
//!   multiples of the page size from the data start (and of 64 from the
//!   mapping start).
//! * Once a block's descriptor is published its bytes are immutable; the
//!   only writer is whoever allocated it, before publishing. This protocol,
//!   not the type system, is what makes the shared slices race-free.
//! * The file is never resized after creation; truncating it under a live
//!   mapping would fault every process that touches the lost pages.
//!
//! # Why next-fit
//!
//! Requests in a serving pipeline are short-lived and roughly FIFO, so
//! allocating just past the previous block finds free space immediately in
//! the common case, spreads wear over the pool instead of hammering its
//! start, and keeps the search cursor process-local (no shared state beyond
//! the bitmap). The scan works a `u64` word at a time: a zero word is 64
//! free pages, a word of ones is skipped in one step.
//!
//! [`BlockMut`] wraps a fresh allocation as an owned, writable value; once
//! filled it is frozen into a read-only [`Block`], which frees itself on
//! drop and which the node shares through `Arc`. Safe code can write pool
//! bytes only through a `BlockMut`, so "a published block is immutable" is
//! kept by the types, not by convention.

#![allow(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod bitmap;
mod block;
mod error;
mod owner;
mod pool;

#[cfg(test)]
mod test_util;

use std::path::{Path, PathBuf};

pub use block::{Block, BlockMut};
pub use error::ShmError;
pub use owner::{sweep_orphans, OwnerLock};
pub use pool::{Pool, DEFAULT_PAGE_SIZE, HEADER_SIZE, MAGIC, VERSION};

/// Map a file that no one will modify again, read-only, without a copy.
///
/// The object store's blob files are written in full, fsynced and renamed
/// into place before any version names them, and are never written after
/// that (they are only unlinked, which leaves an existing map intact). This
/// is the one promise a read-only map of a file needs, and this crate is the
/// one in the workspace where `unsafe` lives, so the map is made here.
pub fn map_immutable_file(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the caller's file is immutable for as long as the map lives
    // (see above); a truncation by another process would make reads fault,
    // which is the same failure any reader of a file has.
    unsafe { memmap2::Mmap::map(file) }
}

/// Directory pools should live in: `/dev/shm` if it exists and is a
/// directory (memory-backed on Linux), else [`std::env::temp_dir`].
pub fn default_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn default_dir_is_a_directory() {
        let d = super::default_dir();
        assert!(d.is_dir(), "{}", d.display());
    }
}
