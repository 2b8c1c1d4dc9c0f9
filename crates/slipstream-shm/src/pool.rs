//! [`Pool`]: one shared-memory file, its on-disk layout and its allocator.
//!
//! Layout (all integers little-endian, all offsets from the start of the file):
//!
//! ```text
//! 0                      HEADER_SIZE            data_offset                 len
//! | header (4 KiB)       | bitmap (1 bit/page)  | data: num_pages * page_size |
//! ```
//!
//! Header fields:
//!
//! | offset | type     | field                                   |
//! |--------|----------|-----------------------------------------|
//! | 0      | [u8; 8]  | magic `b"SLIPSHM1"`                     |
//! | 8      | u32      | layout version ([`VERSION`])            |
//! | 12     | u32      | page size in bytes (power of two, ≥ 64) |
//! | 16     | u64      | number of data pages                    |
//! | 24     | u32      | pool id                                 |
//! | 28     | u32      | header size ([`HEADER_SIZE`])           |
//! | 32     | u64      | bitmap offset                           |
//! | 40     | u64      | data offset                             |
//! | 48     | u64      | total file length                       |

use std::fmt;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;

use crate::bitmap::Bitmap;
use crate::error::ShmError;

/// The eight bytes every pool file starts with.
pub const MAGIC: [u8; 8] = *b"SLIPSHM1";
/// Version of the layout described in this module.
pub const VERSION: u32 = 1;
/// Bytes reserved for the header; the bitmap starts here.
pub const HEADER_SIZE: usize = 4096;
/// Allocation unit used by [`Pool::create`]: one cache line.
pub const DEFAULT_PAGE_SIZE: usize = 64;

/// Largest page size [`Pool::open`] accepts (guards against absurd headers).
const MAX_PAGE_SIZE: usize = 1 << 30;
/// Alignment of the bitmap's end and of the data region (at least).
const ALIGN: usize = 64;

/// Where the parts of a pool file lie, derived from page size and count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    page_size: usize,
    num_pages: usize,
    bitmap_words: usize,
    data_offset: usize,
    file_len: usize,
}

impl Layout {
    /// `None` if the sizes overflow.
    fn new(page_size: usize, num_pages: usize) -> Option<Layout> {
        let bitmap_words = num_pages.div_ceil(64);
        let bitmap_bytes = bitmap_words.checked_mul(8)?.checked_next_multiple_of(ALIGN)?;
        // Align data to the page size too, so every block is page-aligned.
        let data_offset = HEADER_SIZE.checked_add(bitmap_bytes)?.checked_next_multiple_of(page_size.max(ALIGN))?;
        let file_len = data_offset.checked_add(num_pages.checked_mul(page_size)?)?;
        // Offsets travel as u64 and are checked against isize-sized slices.
        if file_len > isize::MAX as usize {
            return None;
        }
        Some(Layout { page_size, num_pages, bitmap_words, data_offset, file_len })
    }
}

/// One shared-memory pool file, mapped read-write.
///
/// Any number of processes may map the same pool and [`free`](Pool::free)
/// into it; one process at a time (its owner) may [`alloc`](Pool::alloc) from
/// it. Within a process a `Pool` is `Send + Sync` and is usually shared
/// through an `Arc`.
pub struct Pool {
    map: MmapRaw,
    path: PathBuf,
    id: u32,
    layout: Layout,
    /// Serialises this process's allocating threads (allocation is first
    /// fit; see `alloc`). Process-local: it never crosses processes.
    alloc_lock: Mutex<()>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("path", &self.path)
            .field("id", &self.id)
            .field("len", &self.len())
            .field("page_size", &self.layout.page_size)
            .field("num_pages", &self.layout.num_pages)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Create (or truncate) the file at `path` with room for `capacity` data
    /// bytes, initialise header and bitmap.
    ///
    /// The capacity is rounded up to whole pages (at least one). The file is
    /// sized with `set_len`, so on tmpfs the untouched data pages cost no
    /// memory until written.
    pub fn create(path: &Path, id: u32, capacity: usize) -> Result<Pool, ShmError> {
        Pool::create_with_page_size(path, id, capacity, DEFAULT_PAGE_SIZE)
    }

    /// [`Pool::create`] with an explicit allocation unit; `page_size` must be
    /// a power of two of at least 64 bytes.
    pub fn create_with_page_size(path: &Path, id: u32, capacity: usize, page_size: usize) -> Result<Pool, ShmError> {
        if !page_size.is_power_of_two() || !(ALIGN..=MAX_PAGE_SIZE).contains(&page_size) {
            return Err(ShmError::io(
                path,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("page size {page_size} is not a power of two in 64..=2^30"),
                ),
            ));
        }
        let num_pages = capacity.div_ceil(page_size).max(1);
        let layout = Layout::new(page_size, num_pages).ok_or_else(|| {
            ShmError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("capacity {capacity} is too large")),
            )
        })?;

        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| ShmError::io(path, e))?;
        // Truncation zeroed everything: the bitmap starts all-free.
        file.set_len(layout.file_len as u64).map_err(|e| ShmError::io(path, e))?;
        let map = MmapOptions::new().len(layout.file_len).map_raw(&file).map_err(|e| ShmError::io(path, e))?;

        let mut header = [0u8; 56];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(page_size as u32).to_le_bytes());
        header[16..24].copy_from_slice(&(num_pages as u64).to_le_bytes());
        header[24..28].copy_from_slice(&id.to_le_bytes());
        header[28..32].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
        header[32..40].copy_from_slice(&(HEADER_SIZE as u64).to_le_bytes());
        header[40..48].copy_from_slice(&(layout.data_offset as u64).to_le_bytes());
        header[48..56].copy_from_slice(&(layout.file_len as u64).to_le_bytes());
        // Write the magic last so a concurrent `open` sees either no pool or
        // a complete header (best effort: the header is plain memory).
        // SAFETY: the mapping is `file_len >= HEADER_SIZE > 56` bytes long and
        // nobody else holds a reference into it yet (the file was just
        // truncated; a foreign process reading it sees plain bytes).
        unsafe {
            let base = map.as_mut_ptr();
            std::ptr::copy_nonoverlapping(header.as_ptr().add(8), base.add(8), header.len() - 8);
            fence(Ordering::Release);
            std::ptr::copy_nonoverlapping(header.as_ptr(), base, 8);
        }

        Ok(Pool { map, path: path.to_path_buf(), id, layout, alloc_lock: Mutex::new(()) })
    }

    /// Map an existing pool created by [`Pool::create`] (any process).
    ///
    /// Validates every header field against the file and returns
    /// [`ShmError::BadHeader`] on any mismatch.
    pub fn open(path: &Path) -> Result<Pool, ShmError> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| ShmError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| ShmError::io(path, e))?.len();
        if file_len < HEADER_SIZE as u64 {
            return Err(ShmError::BadHeader(format!(
                "file is {file_len} bytes, shorter than the {HEADER_SIZE}-byte header"
            )));
        }
        let file_len = usize::try_from(file_len)
            .map_err(|_| ShmError::BadHeader(format!("file length {file_len} exceeds usize")))?;
        let map = MmapOptions::new().len(file_len).map_raw(&file).map_err(|e| ShmError::io(path, e))?;

        let mut header = [0u8; 56];
        // SAFETY: the mapping is at least HEADER_SIZE > 56 bytes long; we copy
        // out plain bytes.
        unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), header.as_mut_ptr(), header.len()) };
        fence(Ordering::Acquire);
        let u32_at = |o: usize| u32::from_le_bytes(header[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(header[o..o + 8].try_into().expect("8 bytes"));
        let bad = |msg: String| Err(ShmError::BadHeader(msg));

        if header[..8] != MAGIC {
            return bad(format!("magic is {:?}, expected {:?}", &header[..8], MAGIC));
        }
        let version = u32_at(8);
        if version != VERSION {
            return bad(format!("layout version {version}, expected {VERSION}"));
        }
        let page_size = u32_at(12) as usize;
        if !page_size.is_power_of_two() || !(ALIGN..=MAX_PAGE_SIZE).contains(&page_size) {
            return bad(format!("page size {page_size} is not a power of two in 64..=2^30"));
        }
        let num_pages =
            usize::try_from(u64_at(16)).map_err(|_| ShmError::BadHeader("page count exceeds usize".into()))?;
        if num_pages == 0 {
            return bad("pool has zero pages".into());
        }
        let id = u32_at(24);
        let header_size = u32_at(28) as usize;
        if header_size != HEADER_SIZE {
            return bad(format!("header size {header_size}, expected {HEADER_SIZE}"));
        }
        let layout = Layout::new(page_size, num_pages)
            .ok_or_else(|| ShmError::BadHeader(format!("{num_pages} pages of {page_size} bytes overflow")))?;
        let bitmap_offset = u64_at(32);
        if bitmap_offset != HEADER_SIZE as u64 {
            return bad(format!("bitmap offset {bitmap_offset}, expected {HEADER_SIZE}"));
        }
        let data_offset = u64_at(40);
        if data_offset != layout.data_offset as u64 {
            return bad(format!("data offset {data_offset}, expected {}", layout.data_offset));
        }
        let declared_len = u64_at(48);
        if declared_len != layout.file_len as u64 {
            return bad(format!("declared length {declared_len}, expected {}", layout.file_len));
        }
        if file_len < layout.file_len {
            return bad(format!("file is {file_len} bytes but the header needs {} (truncated?)", layout.file_len));
        }

        Ok(Pool { map, path: path.to_path_buf(), id, layout, alloc_lock: Mutex::new(()) })
    }

    /// The id written into the header at creation.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The file this pool was created or opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length of the whole mapping in bytes (header + bitmap + data).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always `false`: a pool has at least a header and one page.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Start of the mapping. Offsets returned by [`Pool::alloc`] are relative
    /// to this address.
    pub fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Byte offset (from the mapping start) of the first data page.
    pub fn data_offset(&self) -> u64 {
        self.layout.data_offset as u64
    }

    /// The allocation unit in bytes.
    pub fn page_size(&self) -> usize {
        self.layout.page_size
    }

    /// Bytes available for allocation (number of pages × page size).
    pub fn capacity_bytes(&self) -> usize {
        self.layout.num_pages * self.layout.page_size
    }

    /// Pages currently allocated, counted from the shared bitmap. A snapshot:
    /// other processes may free concurrently.
    pub fn used_pages(&self) -> usize {
        self.bitmap().count_set()
    }

    /// Reserve at least `nbytes`; returns the byte offset (from mapping
    /// start) of the block.
    ///
    /// The block is a run of whole pages (a zero-byte request takes one), so
    /// it is aligned to the page size. Only the pool's owner should allocate,
    /// but a second allocator cannot corrupt the bitmap: claims that race are
    /// detected and retried.
    pub fn alloc(&self, nbytes: usize) -> Result<u64, ShmError> {
        let pages = self.pages_for(nbytes);
        let full = || ShmError::Full { requested: nbytes, capacity: self.capacity_bytes() };
        if pages > self.layout.num_pages {
            return Err(full());
        }
        // First fit from the start of the pool: the lowest free pages are the
        // ones most recently freed, so they are already faulted in. (A
        // next-fit cursor walked the whole pool and page-faulted every page
        // once per lap: ~1 ms per MB on a VM.)
        let _one_allocator = self.alloc_lock.lock();
        let bitmap = self.bitmap();
        loop {
            let start = bitmap.find_next_fit(0, pages).ok_or_else(full)?;
            // A conflict means another process allocated these pages between
            // our scan and our claim; scan again (it now sees them set).
            if bitmap.try_claim(start, pages).is_ok() {
                return Ok(self.offset_of_page(start));
            }
        }
    }

    /// Release a block previously returned by [`Pool::alloc`] (by any
    /// process). `nbytes` as passed to alloc.
    ///
    /// # Panics
    ///
    /// In debug builds, if the range is not a block of this pool's data
    /// region or any of its pages was already free (a double free). Release
    /// builds ignore an invalid range and clear a partly free one.
    pub fn free(&self, offset: u64, nbytes: usize) {
        match self.page_range(offset, nbytes) {
            Ok((start, pages)) => {
                let all_set = self.bitmap().release(start, pages);
                debug_assert!(all_set, "double free of offset {offset} ({nbytes} bytes) in pool {}", self.id);
            }
            Err(e) => {
                if cfg!(debug_assertions) {
                    panic!("free of an invalid block in pool {}: {e}", self.id);
                }
            }
        }
    }

    /// Bounds-checked shared view of `len` bytes at `offset`.
    ///
    /// Returns [`ShmError::OutOfBounds`] if the range precedes the data region
    /// or runs past the mapping. The bytes are shared memory: the caller must
    /// not read a range another process may be writing (the descriptor
    /// protocol guarantees a block is immutable once published).
    pub fn slice(&self, offset: u64, len: usize) -> Result<&[u8], ShmError> {
        let start = self.check_range(offset, len)?;
        // SAFETY: `check_range` proved `start + len <= self.len()`, so the
        // range lies in the live mapping, which outlives `&self`. Writers are
        // excluded by the protocol documented above.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(start), len) })
    }

    /// Write bytes at an offset (tests only: outside them, the only safe
    /// writer of pool bytes is a [`crate::BlockMut`]). Bounds-checked like
    /// [`Pool::slice`].
    #[cfg(test)]
    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<(), ShmError> {
        let start = self.check_range(offset, data.len())?;
        // SAFETY: the destination is in bounds of the live mapping (checked
        // above); `ptr::copy` tolerates overlap with `data`. The caller owns
        // the block being written (alloc contract), so no one else reads or
        // writes it concurrently.
        unsafe {
            std::ptr::copy(data.as_ptr(), self.map.as_mut_ptr().add(start), data.len());
        }
        Ok(())
    }

    /// Remove the backing file. The mapping (and every other process's)
    /// stays valid until dropped; new `open`s fail.
    pub fn unlink(&self) -> Result<(), ShmError> {
        std::fs::remove_file(&self.path).map_err(|e| ShmError::io(&self.path, e))
    }

    // ----- internals -------------------------------------------------------

    fn bitmap(&self) -> Bitmap<'_> {
        // SAFETY: the bitmap lies at HEADER_SIZE (8-byte aligned, the mapping
        // is page-aligned) and spans `bitmap_words * 8 <= data_offset -
        // HEADER_SIZE` bytes, all inside the mapping, which lives as long as
        // `&self`. The words are only ever accessed atomically, by this and
        // every other process, so viewing them as `AtomicU64` is sound.
        let words = unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(HEADER_SIZE).cast::<AtomicU64>(), self.layout.bitmap_words)
        };
        Bitmap::new(words, self.layout.num_pages)
    }

    /// Pages taken by an `nbytes` allocation: whole pages, at least one.
    fn pages_for(&self, nbytes: usize) -> usize {
        nbytes.div_ceil(self.layout.page_size).max(1)
    }

    fn offset_of_page(&self, page: usize) -> u64 {
        (self.layout.data_offset + page * self.layout.page_size) as u64
    }

    /// Checks `offset .. offset + len` lies in the data region; returns the
    /// start as `usize`.
    fn check_range(&self, offset: u64, len: usize) -> Result<usize, ShmError> {
        let oob = || ShmError::OutOfBounds { offset, len, size: self.len() };
        let start = usize::try_from(offset).map_err(|_| oob())?;
        let end = start.checked_add(len).ok_or_else(oob)?;
        if start < self.layout.data_offset || end > self.len() {
            return Err(oob());
        }
        Ok(start)
    }

    /// The pages of the block of `nbytes` at `offset`: the offset must be a
    /// page boundary of the data region and the pages must exist.
    pub(crate) fn page_range(&self, offset: u64, nbytes: usize) -> Result<(usize, usize), ShmError> {
        let oob = || ShmError::OutOfBounds { offset, len: nbytes, size: self.len() };
        let start = usize::try_from(offset).map_err(|_| oob())?;
        let rel = start.checked_sub(self.layout.data_offset).ok_or_else(oob)?;
        if rel % self.layout.page_size != 0 {
            return Err(oob());
        }
        let first = rel / self.layout.page_size;
        let pages = self.pages_for(nbytes);
        match first.checked_add(pages) {
            Some(end) if end <= self.layout.num_pages => Ok((first, pages)),
            _ => Err(oob()),
        }
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
