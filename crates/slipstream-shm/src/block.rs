//! [`Block`]: an owned allocation that frees itself on drop.

use std::fmt;
use std::sync::Arc;

use crate::error::ShmError;
use crate::pool::Pool;

/// An owned allocation in a [`Pool`]: frees its pages on drop.
///
/// The node wraps blocks in `Arc` to count references from in-flight
/// requests; when the last one goes, the pages return to the pool. A block
/// may own pages of a pool another process allocates from (see
/// [`Block::adopt`]): freeing is safe from any process.
pub struct Block {
    pool: Arc<Pool>,
    offset: u64,
    len: usize,
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("pool", &self.pool.id())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Block {
    /// Allocate `nbytes` from `pool` (see [`Pool::alloc`]).
    pub fn alloc(pool: &Arc<Pool>, nbytes: usize) -> Result<Block, ShmError> {
        let offset = pool.alloc(nbytes)?;
        Ok(Block { pool: Arc::clone(pool), offset, len: nbytes })
    }

    /// Adopt a block allocated by another process (e.g. a worker wrote its
    /// output into its own pool and sent us the offset); the `Block` frees
    /// it on drop.
    ///
    /// Returns [`ShmError::OutOfBounds`] unless `offset` is a page boundary
    /// of the data region and `len` bytes from it fit in the pool. Whether
    /// the pages are really allocated cannot be checked reliably from here;
    /// adopting a block twice leads to a double free.
    pub fn adopt(pool: &Arc<Pool>, offset: u64, len: usize) -> Result<Block, ShmError> {
        pool.page_range(offset, len)?;
        Ok(Block { pool: Arc::clone(pool), offset, len })
    }

    /// The pool this block lives in.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Byte offset of the block from the start of the pool mapping.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Usable length in bytes (as requested, not rounded to pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block holds zero usable bytes (it still takes a page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block's bytes.
    ///
    /// Once a block's descriptor is published it is immutable by protocol,
    /// so shared reads are race-free.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `alloc`/`adopt` checked that `offset .. offset + len` lies
        // in the data region of the mapping, which `self.pool` keeps alive.
        // The pages are ours until drop; writers follow the contract of
        // `as_mut_slice`.
        unsafe { std::slice::from_raw_parts(self.pool.base_ptr().add(self.offset as usize), self.len) }
    }

    /// Mutable access for filling a freshly allocated block.
    ///
    /// Takes `&self` because the memory is shared with other processes
    /// anyway. Contract: the caller must be the only reader or writer of the
    /// block while the returned slice lives. In practice this is called right
    /// after [`Block::alloc`], before the block's descriptor is published or
    /// the block is shared (e.g. wrapped in `Arc` and cloned), and never again
    /// afterwards. Violating it is a data race on the payload bytes (the
    /// allocator's bookkeeping is unaffected).
    #[allow(clippy::mut_from_ref)]
    pub fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the range is in bounds of the live mapping (checked at
        // construction, kept alive by `self.pool`); exclusivity of access is
        // the caller's documented obligation.
        unsafe { std::slice::from_raw_parts_mut(self.pool.base_ptr().add(self.offset as usize), self.len) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        self.pool.free(self.offset, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    #[test]
    fn drop_frees() {
        let dir = TempDir::new("block-drop");
        let pool = Arc::new(Pool::create(&dir.path().join("p"), 1, 64 * 16).unwrap());
        let b = Block::alloc(&pool, 100).unwrap();
        assert_eq!(pool.used_pages(), 2);
        assert_eq!(b.len(), 100);
        assert!(!b.is_empty());
        b.as_mut_slice().copy_from_slice(&[7u8; 100]);
        assert_eq!(pool.slice(b.offset(), 100).unwrap(), &[7u8; 100][..]);
        assert_eq!(b.as_slice(), &[7u8; 100][..]);
        assert!(Arc::ptr_eq(b.pool(), &pool));
        drop(b);
        assert_eq!(pool.used_pages(), 0);

        let shared = Arc::new(Block::alloc(&pool, 0).unwrap());
        assert!(shared.is_empty());
        let other = Arc::clone(&shared);
        assert_eq!(pool.used_pages(), 1);
        drop(shared);
        assert_eq!(pool.used_pages(), 1, "still referenced");
        drop(other);
        assert_eq!(pool.used_pages(), 0);
    }

    #[test]
    fn adopt_is_bounds_checked() {
        let dir = TempDir::new("block-adopt");
        let pool = Arc::new(Pool::create(&dir.path().join("p"), 2, 64 * 8).unwrap());
        let data = pool.data_offset();
        let end = pool.len() as u64;
        for (offset, len) in [
            (0, 8),              // header
            (data - 64, 8),      // bitmap
            (data + 1, 8),       // not a page boundary
            (end, 0),            // past the last page
            (data + 7 * 64, 65), // runs off the end
            (data, 64 * 8 + 1),  // larger than the pool
            (u64::MAX, 1),       // absurd
            (data, usize::MAX),  // absurd
        ] {
            let err = Block::adopt(&pool, offset, len).unwrap_err();
            assert_eq!(err.kind(), "out_of_bounds", "offset {offset} len {len}");
        }

        // A block "another process" allocated: adopt frees it on drop.
        let offset = pool.alloc(130).unwrap();
        pool.write(offset, b"hello").unwrap();
        let b = Block::adopt(&pool, offset, 130).unwrap();
        assert_eq!(&b.as_slice()[..5], b"hello");
        assert_eq!(pool.used_pages(), 3);
        drop(b);
        assert_eq!(pool.used_pages(), 0);
        // The last page is adoptable.
        let last = data + 7 * 64;
        let b = Block::adopt(&pool, last, 64).unwrap();
        std::mem::forget(b); // never allocated: do not free it
    }

    #[test]
    fn blocks_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Block>();
        check::<Pool>();
        check::<Arc<Block>>();
    }
}
