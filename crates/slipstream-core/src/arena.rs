//! The node's view of shared memory: the pools it created, references to
//! tensors inside them, and the count of every payload copy it makes.
//!
//! Pool 0 is the ingress pool: the node writes request tensors there (the one
//! copy at ingress) and gathers batch inputs there when a batch's tensors are
//! not already adjacent. Every other pool belongs to one worker replica,
//! which allocates its outputs in it; the node frees those blocks when the
//! last request referencing them is done.
//!
//! A [`TensorRef`] holds an `Arc<Block>`, so a block lives exactly as long as
//! some request still needs a tensor in it.
//!
//! Replicas come and go at run time; a removed replica's pool goes back to a
//! spare list and the next replica reuses it (pool ids index a list that
//! only grows, and workers open pools by id). Reuse is safe once the old
//! worker has exited: blocks it wrote that requests still hold keep their
//! pages marked in the pool's bitmap, so the new worker allocates around
//! them, and there is again exactly one allocator.

use crate::error::NodeError;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use slipstream_shm::{sweep_orphans, Block, BlockMut, OwnerLock, Pool};
use slipstream_types::{checked_numel, DType, TensorDesc};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Tensors of one request at one point of the pipeline, by name.
pub type Tensors = Vec<(String, TensorRef)>;

/// A tensor inside a pool block.
#[derive(Clone, Debug)]
pub struct TensorRef {
    /// The block that holds it (kept alive by this reference).
    pub block: Arc<Block>,
    /// Absolute byte offset in the pool (inside `block`).
    pub offset: u64,
    /// Its size, bytes.
    pub nbytes: u64,
    /// Its element type.
    pub dtype: DType,
    /// Its shape; the first dimension is rows.
    pub shape: Vec<u64>,
}

impl TensorRef {
    /// Its bytes (in shared memory).
    pub fn bytes(&self) -> &[u8] {
        let start = (self.offset - self.block.offset()) as usize;
        &self.block.as_slice()[start..start + self.nbytes as usize]
    }

    /// Its descriptor, as workers and frames name it.
    pub fn desc(&self) -> TensorDesc {
        TensorDesc {
            pool: self.block.pool().id(),
            offset: self.offset,
            nbytes: self.nbytes,
            dtype: self.dtype,
            shape: self.shape.clone(),
        }
    }

    /// The first element of a string tensor (None for other dtypes, or
    /// when it is not UTF-8).
    pub fn first_string(&self) -> Option<String> {
        if self.dtype != DType::String {
            return None;
        }
        let elems = slipstream_types::var::elements(self.bytes())?;
        String::from_utf8(elems.first()?.to_vec()).ok()
    }

    /// Its longest element's size: bytes for variable-length elements
    /// (strings, bytes), else the elements of one row. None if malformed.
    pub fn longest_element(&self) -> Option<u64> {
        if self.dtype.is_variable() {
            let elems = slipstream_types::var::elements(self.bytes())?;
            Some(elems.iter().map(|e| e.len() as u64).max().unwrap_or(0))
        } else {
            self.row_elems()
        }
    }

    /// Rows in the first dimension.
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Elements in one row (the product of the trailing dimensions), or
    /// `None` if that overflows.
    fn row_elems(&self) -> Option<u64> {
        checked_numel(self.shape.get(1..).unwrap_or(&[]))
    }

    /// Split into consecutive pieces of `rows[i]` rows each, sharing the block.
    /// `None` if the rows do not add up, or variable-size elements are malformed.
    pub fn split_rows(&self, rows: &[u64]) -> Option<Vec<TensorRef>> {
        let total = rows.iter().try_fold(0u64, |a, &r| a.checked_add(r))?;
        if self.shape.first() != Some(&total) {
            return None;
        }
        // Byte offset of every row start, plus the end.
        let row_at: Vec<u64> = if self.dtype.is_variable() {
            let per_row = usize::try_from(self.row_elems()?).ok()?;
            slipstream_types::var::group_offsets(self.bytes(), per_row, usize::try_from(total).ok()?)?
                .into_iter()
                .map(|o| o as u64)
                .collect()
        } else {
            let rb = self.row_elems()?.checked_mul(self.dtype.size() as u64)?;
            if rb.checked_mul(total)? != self.nbytes {
                return None;
            }
            (0..=total).map(|r| r * rb).collect()
        };
        let mut out = Vec::with_capacity(rows.len());
        let mut row = 0usize;
        for &n in rows {
            let (lo, hi) = (row_at[row], row_at[row + n as usize]);
            let mut shape = self.shape.clone();
            shape[0] = n;
            out.push(TensorRef {
                block: self.block.clone(),
                offset: self.offset + lo,
                nbytes: hi - lo,
                dtype: self.dtype,
                shape,
            });
            row += n as usize;
        }
        Some(out)
    }
}

/// Rows a request contributes to a batch: the first dimension of its inputs.
pub fn request_rows(inputs: &[(String, TensorRef)]) -> u64 {
    inputs.first().map(|(_, t)| t.rows()).unwrap_or(1)
}

/// Payload copies made on the request path, by where they happen.
#[derive(Default)]
pub struct CopyCounters {
    /// A request body that arrived in several socket reads, joined into one buffer.
    pub body_join: AtomicU64,
    /// Bytes of those.
    pub body_join_bytes: AtomicU64,
    /// Request tensors written into the ingress pool (the one copy at ingress).
    pub ingress: AtomicU64,
    /// Bytes of those.
    pub ingress_bytes: AtomicU64,
    /// Batch inputs gathered into one block (requests' tensors not adjacent).
    pub gather: AtomicU64,
    /// Bytes of those.
    pub gather_bytes: AtomicU64,
    /// Outputs a worker copied into its pool.
    pub worker: AtomicU64,
    /// Bytes of those.
    pub worker_bytes: AtomicU64,
    /// Answers copied when encoded (JSON bodies).
    pub egress: AtomicU64,
    /// Bytes of those.
    pub egress_bytes: AtomicU64,
}

/// The copy counters at one instant (see [`CopyCounters`]).
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySnapshot {
    /// Bodies joined.
    pub body_join: u64,
    /// Bytes of those.
    pub body_join_bytes: u64,
    /// Ingress writes.
    pub ingress: u64,
    /// Bytes of those.
    pub ingress_bytes: u64,
    /// Gathered batch inputs.
    pub gather: u64,
    /// Bytes of those.
    pub gather_bytes: u64,
    /// Worker output copies.
    pub worker: u64,
    /// Bytes of those.
    pub worker_bytes: u64,
    /// Egress copies.
    pub egress: u64,
    /// Bytes of those.
    pub egress_bytes: u64,
    /// All copies.
    pub total: u64,
}

impl CopyCounters {
    /// Count one copy of `bytes` in `counter` and `bytes_counter`.
    pub fn add(counter: &AtomicU64, bytes_counter: &AtomicU64, bytes: u64) {
        counter.fetch_add(1, Relaxed);
        bytes_counter.fetch_add(bytes, Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> CopySnapshot {
        let l = |a: &AtomicU64| a.load(Relaxed);
        let (j, i, g, w, e) = (l(&self.body_join), l(&self.ingress), l(&self.gather), l(&self.worker), l(&self.egress));
        CopySnapshot {
            body_join: j,
            body_join_bytes: l(&self.body_join_bytes),
            ingress: i,
            ingress_bytes: l(&self.ingress_bytes),
            gather: g,
            gather_bytes: l(&self.gather_bytes),
            worker: w,
            worker_bytes: l(&self.worker_bytes),
            egress: e,
            egress_bytes: l(&self.egress_bytes),
            total: j + i + g + w + e,
        }
    }
}

/// All pools of this node, indexed by pool id.
pub struct Arena {
    dir: PathBuf,
    prefix: String,
    pools: RwLock<Vec<Arc<Pool>>>,
    /// Pools of removed replicas, free for the next replica.
    spare: Mutex<Vec<Arc<Pool>>>,
    /// Every payload copy the node makes, by site.
    pub copies: CopyCounters,
    /// Set by [`Arena::unlink_all`]: no pool file is created after it (a
    /// replica restarted while the node stops would leave one behind).
    closed: std::sync::atomic::AtomicBool,
    /// Says the pool files are in use while this node lives, so that a
    /// node started after it was killed can remove them.
    owner: OwnerLock,
}

/// What every node's pool files are named after: `slipstream-{pid}-{hex}-{id}`.
const FILE_FAMILY: &str = "slipstream-";

impl Arena {
    /// Create the ingress pool (id 0) under `dir`.
    pub fn new(dir: PathBuf, ingress_bytes: usize) -> Result<Arena, NodeError> {
        let prefix = format!("{FILE_FAMILY}{}-{:x}", std::process::id(), rand_suffix());
        let swept = sweep_orphans(&dir, FILE_FAMILY);
        if swept > 0 {
            tracing::info!("removed {swept} shared-memory file(s) of nodes that ended without removing them");
        }
        let owner = OwnerLock::acquire(&dir, &prefix)
            .map_err(|e| NodeError::Internal(format!("cannot lock {}/{prefix}.lock: {e}", dir.display())))?;
        let arena = Arena {
            dir,
            prefix,
            pools: RwLock::new(Vec::new()),
            spare: Mutex::new(Vec::new()),
            copies: CopyCounters::default(),
            closed: std::sync::atomic::AtomicBool::new(false),
            owner,
        };
        arena.create_pool(ingress_bytes)?;
        Ok(arena)
    }

    /// Path of pool `id`; workers open pools by this path.
    pub fn pool_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{}-{id}", self.prefix))
    }

    /// Path prefix handed to workers: pool `id` is at `{prefix}-{id}`.
    pub fn path_prefix(&self) -> PathBuf {
        self.dir.join(&self.prefix)
    }

    /// A pool of at least `capacity` bytes for a new replica: a spare one
    /// if there is one, else a new file.
    pub fn replica_pool(&self, capacity: usize) -> Result<Arc<Pool>, NodeError> {
        let mut spare = self.spare.lock();
        if let Some(i) = spare.iter().position(|p| p.capacity_bytes() >= capacity) {
            return Ok(spare.swap_remove(i));
        }
        drop(spare);
        self.create_pool(capacity)
    }

    /// A removed replica's pool, once its worker has exited.
    pub fn release_pool(&self, pool: Arc<Pool>) {
        self.spare.lock().push(pool);
    }

    fn create_pool(&self, capacity: usize) -> Result<Arc<Pool>, NodeError> {
        let mut pools = self.pools.write();
        // Checked under the lock that `unlink_all` takes: a pool is either
        // listed before the unlink (and unlinked by it) or never created.
        if self.closed.load(Relaxed) {
            return Err(NodeError::ShuttingDown);
        }
        let id = pools.len() as u32;
        let pool = Arc::new(Pool::create(&self.pool_path(id), id, capacity)?);
        pools.push(pool.clone());
        Ok(pool)
    }

    /// The ingress pool (requests are decoded into it).
    pub fn ingress(&self) -> Arc<Pool> {
        self.pools.read()[0].clone()
    }

    /// The pool with this id, if it exists.
    pub fn pool(&self, id: u32) -> Option<Arc<Pool>> {
        self.pools.read().get(id as usize).cloned()
    }

    /// Bytes in use per pool (pool 0 is the ingress pool).
    pub fn usage(&self) -> Vec<serde_json::Value> {
        self.pools
            .read()
            .iter()
            .map(|p| {
                serde_json::json!({
                    "pool": p.id(),
                    "used_bytes": p.used_pages() * p.page_size(),
                    "capacity_bytes": p.capacity_bytes(),
                })
            })
            .collect()
    }

    /// Remove every pool file (mappings stay valid until dropped).
    pub fn unlink_all(&self) {
        let pools = self.pools.write();
        self.closed.store(true, Relaxed);
        for p in pools.iter() {
            let _ = p.unlink();
        }
        self.owner.release();
    }

    /// Allocate an ingress block and count the write that will fill it.
    pub fn ingress_block(&self, nbytes: usize) -> Result<BlockMut, NodeError> {
        CopyCounters::add(&self.copies.ingress, &self.copies.ingress_bytes, nbytes as u64);
        Ok(BlockMut::alloc(&self.ingress(), nbytes)?)
    }

    /// Allocate a block in the ingress pool for the node's own use (batch
    /// gathers, warm-up samples); the caller counts the copy.
    pub fn scratch_block(&self, nbytes: usize) -> Result<BlockMut, NodeError> {
        Ok(BlockMut::alloc(&self.ingress(), nbytes)?)
    }

    /// Bytes in use over all pools.
    pub fn used_bytes(&self) -> usize {
        self.pools.read().iter().map(|p| p.used_pages() * p.page_size()).sum()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.unlink_all();
    }
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    (t as u64) ^ ((t >> 64) as u64)
}

/// Tensors copied off the arena to the heap (name, dtype, shape, bytes):
/// what outlives the blocks it came from without holding them (a warm-up
/// sample, a cached result). [`HeapTensors::to_arena`] copies them back
/// into one new block.
#[derive(Clone, Debug, Default)]
pub struct HeapTensors(pub Vec<(String, DType, Vec<u64>, Vec<u8>)>);

impl HeapTensors {
    /// A copy of `tensors` on the heap.
    pub fn of(tensors: &Tensors) -> HeapTensors {
        HeapTensors(tensors.iter().map(|(n, t)| (n.clone(), t.dtype, t.shape.clone(), t.bytes().to_vec())).collect())
    }

    /// Bytes held (the tensors' data).
    pub fn nbytes(&self) -> usize {
        self.0.iter().map(|(_, _, _, b)| b.len()).sum()
    }

    /// The tensors, written into one new block of the arena.
    pub fn to_arena(&self, arena: &Arena) -> Result<Tensors, NodeError> {
        let at: Vec<usize> = self
            .0
            .iter()
            .scan(0usize, |next, (_, _, _, b)| {
                let here = *next;
                *next += b.len().next_multiple_of(64);
                Some(here)
            })
            .collect();
        let total = self.0.iter().map(|(_, _, _, b)| b.len().next_multiple_of(64)).sum::<usize>().max(64);
        let mut block = arena.scratch_block(total)?;
        let dst = block.as_mut_slice();
        for ((_, _, _, b), &o) in self.0.iter().zip(&at) {
            dst[o..o + b.len()].copy_from_slice(b);
        }
        let block = Arc::new(block.freeze());
        Ok(self
            .0
            .iter()
            .zip(at)
            .map(|((name, dtype, shape, b), o)| {
                let t = TensorRef {
                    block: block.clone(),
                    offset: block.offset() + o as u64,
                    nbytes: b.len() as u64,
                    dtype: *dtype,
                    shape: shape.clone(),
                };
                (name.clone(), t)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_pool_file_outlives_the_final_unlink() {
        let dir = std::env::temp_dir().join(format!("slipstream-arena-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = || std::fs::read_dir(&dir).unwrap().count();
        let arena = Arena::new(dir.clone(), 1 << 16).unwrap();
        let pool = arena.replica_pool(1 << 16).unwrap();
        assert_eq!(files(), 3, "the ingress pool, a replica's and the owner's lock");
        arena.release_pool(pool);
        arena.unlink_all();
        assert_eq!(files(), 0);
        // A replica restarted while the node stops gets no new file...
        assert!(matches!(arena.replica_pool(1 << 20), Err(NodeError::ShuttingDown)));
        assert_eq!(files(), 0);
        // ...and a spare (already unlinked) pool creates none either.
        assert!(arena.replica_pool(1 << 16).is_ok());
        assert_eq!(files(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
