//! [`BlockMut`] and [`Block`]: owned allocations that free themselves on drop.
//!
//! The write rule of shared memory is a type: a freshly allocated block is a
//! [`BlockMut`], the only value through which safe code can write pool bytes,
//! and it is never shared (it is neither `Clone` nor handed to another
//! process). Once filled it is frozen into a [`Block`], which is read-only:
//! from then on its descriptor may be published and the block shared through
//! `Arc`, and no safe function hands out `&mut [u8]` over it again.

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

/// A freshly allocated block, writable once by its only owner, then frozen
/// into a read-only [`Block`]. Dropping it unfrozen frees its pages.
pub struct BlockMut {
    block: Block,
}

impl fmt::Debug for BlockMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BlockMut").field(&self.block).finish()
    }
}

impl BlockMut {
    /// Allocate `nbytes` from `pool` (see [`Pool::alloc`]).
    pub fn alloc(pool: &Arc<Pool>, nbytes: usize) -> Result<BlockMut, ShmError> {
        let offset = pool.alloc(nbytes)?;
        Ok(BlockMut { block: Block { pool: Arc::clone(pool), offset, len: nbytes } })
    }

    /// The block's bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let b = &self.block;
        // SAFETY: `alloc` returned these pages to us alone: no descriptor of
        // them has been published and `BlockMut` is neither `Clone` nor
        // shared, so nothing else reads or writes them while the returned
        // borrow (tied to `&mut self`) lives. The range lies in the data
        // region of the mapping, which `b.pool` keeps alive.
        unsafe { std::slice::from_raw_parts_mut(b.pool.base_ptr().add(b.offset as usize), b.len) }
    }

    /// Byte offset of the block from the start of the pool mapping.
    pub fn offset(&self) -> u64 {
        self.block.offset
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.block.len
    }

    /// Whether the block holds zero usable bytes.
    pub fn is_empty(&self) -> bool {
        self.block.len == 0
    }

    /// The pool this block lives in.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.block.pool
    }

    /// Done writing: the block becomes read-only and may be shared.
    pub fn freeze(self) -> Block {
        self.block
    }
}

impl Block {
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
    /// A `Block` is only ever made by freezing a [`BlockMut`] or by adopting
    /// what another process wrote and published, so it is immutable and
    /// shared reads are race-free.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `alloc`/`adopt` checked that `offset .. offset + len` lies
        // in the data region of the mapping, which `self.pool` keeps alive.
        // The pages are ours until drop, and nothing writes them any more:
        // the only safe writer was the `BlockMut` this was frozen from.
        unsafe { std::slice::from_raw_parts(self.pool.base_ptr().add(self.offset as usize), self.len) }
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
        let mut b = BlockMut::alloc(&pool, 100).unwrap();
        assert_eq!(pool.used_pages(), 2);
        assert_eq!(b.len(), 100);
        assert!(!b.is_empty());
        b.as_mut_slice().copy_from_slice(&[7u8; 100]);
        let b = b.freeze();
        assert_eq!(pool.slice(b.offset(), 100).unwrap(), &[7u8; 100][..]);
        assert_eq!(b.as_slice(), &[7u8; 100][..]);
        assert!(Arc::ptr_eq(b.pool(), &pool));
        drop(b);
        assert_eq!(pool.used_pages(), 0);

        drop(BlockMut::alloc(&pool, 8).unwrap());
        assert_eq!(pool.used_pages(), 0, "an unfrozen block frees on drop too");
        let shared = Arc::new(BlockMut::alloc(&pool, 0).unwrap().freeze());
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
        check::<BlockMut>();
    }
}
