//! Tests for [`Pool`], against real files in a temporary directory.

use super::*;
use crate::test_util::{TempDir, XorShift};
use crate::{Block, BlockMut};
use std::process::Command;
use std::sync::Arc;

const PS: usize = DEFAULT_PAGE_SIZE;

fn page_of(pool: &Pool, offset: u64) -> usize {
    ((offset - pool.data_offset()) as usize) / pool.page_size()
}

#[test]
fn alloc_free_round_trip() {
    let dir = TempDir::new("round-trip");
    let path = dir.path().join("pool");
    let pool = Pool::create(&path, 42, 1000).unwrap();
    assert_eq!(pool.id(), 42);
    assert_eq!(pool.path(), path.as_path());
    assert_eq!(pool.page_size(), 64);
    assert_eq!(pool.capacity_bytes(), 1024, "rounded up to 16 pages");
    assert_eq!(pool.data_offset() % 64, 0);
    assert!(pool.data_offset() >= HEADER_SIZE as u64);
    assert_eq!(pool.len() as u64, pool.data_offset() + 1024);
    assert!(!pool.is_empty());
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, pool.len());
    assert!(!pool.base_ptr().is_null());
    assert_eq!(pool.used_pages(), 0);

    let mut blocks = Vec::new();
    for n in [0usize, 1, 63, 64, 65, 200] {
        let off = pool.alloc(n).unwrap();
        assert_eq!(off % 64, 0);
        assert!(off >= pool.data_offset());
        assert!(off as usize + n.max(1) <= pool.len());
        pool.write(off, &vec![n as u8; n]).unwrap();
        blocks.push((off, n));
    }
    // 1 + 1 + 1 + 1 + 2 + 4 pages; a zero-byte block still takes one.
    assert_eq!(pool.used_pages(), 10);
    let mut offsets: Vec<_> = blocks.iter().map(|b| b.0).collect();
    offsets.dedup();
    assert_eq!(offsets.len(), blocks.len(), "distinct offsets");
    for &(off, n) in &blocks {
        assert_eq!(pool.slice(off, n).unwrap(), vec![n as u8; n].as_slice());
        pool.free(off, n);
    }
    assert_eq!(pool.used_pages(), 0);

    // Reopening reads the same header back.
    let again = Pool::open(&path).unwrap();
    assert_eq!(again.id(), 42);
    assert_eq!(again.page_size(), 64);
    assert_eq!(again.capacity_bytes(), 1024);
    assert_eq!(again.data_offset(), pool.data_offset());
    assert_eq!(again.len(), pool.len());
}

#[test]
fn zero_capacity_gets_one_page() {
    let dir = TempDir::new("zero-cap");
    let pool = Pool::create(&dir.path().join("p"), 0, 0).unwrap();
    assert_eq!(pool.capacity_bytes(), 64);
    let off = pool.alloc(0).unwrap();
    assert!(matches!(pool.alloc(0), Err(ShmError::Full { .. })));
    pool.free(off, 0);
    assert_eq!(pool.alloc(64).unwrap(), off);
}

#[test]
fn larger_page_size_aligns_blocks() {
    let dir = TempDir::new("page-size");
    let path = dir.path().join("p");
    let pool = Pool::create_with_page_size(&path, 3, 10 * 4096, 4096).unwrap();
    assert_eq!(pool.page_size(), 4096);
    assert_eq!(pool.data_offset() % 4096, 0);
    let a = pool.alloc(1).unwrap();
    let b = pool.alloc(5000).unwrap();
    assert_eq!(a % 4096, 0);
    assert_eq!(b, a + 4096);
    assert_eq!(pool.used_pages(), 3);
    assert_eq!(Pool::open(&path).unwrap().page_size(), 4096);

    for bad in [0, 32, 100, 65] {
        let err = Pool::create_with_page_size(&dir.path().join("q"), 0, 64, bad).unwrap_err();
        assert_eq!(err.kind(), "io", "page size {bad}");
    }
}

#[test]
fn randomized_no_overlap_and_accounting() {
    let dir = TempDir::new("random");
    let pages = 512;
    let pool = Pool::create(&dir.path().join("p"), 7, pages * PS).unwrap();
    let mut rng = XorShift::new(0x5EED_1234);
    let mut shadow = vec![false; pages];
    let mut live: Vec<(u64, usize, u8)> = Vec::new();
    let mut fulls = 0;

    for step in 0..20_000u32 {
        let do_alloc = live.is_empty() || rng.below(100) < 55;
        if do_alloc {
            let n = match rng.below(10) {
                0 => 0,
                1..=6 => rng.below(4 * PS),
                7 | 8 => rng.below(20 * PS),
                _ => rng.below(120 * PS),
            };
            let k = n.div_ceil(PS).max(1);
            match pool.alloc(n) {
                Ok(off) => {
                    assert_eq!(off % 64, 0);
                    assert!(off >= pool.data_offset());
                    let first = page_of(&pool, off);
                    assert!(first + k <= pages);
                    for (p, used) in shadow[first..first + k].iter_mut().enumerate() {
                        assert!(!*used, "page {} handed out twice", first + p);
                        *used = true;
                    }
                    let tag = (step % 251) as u8;
                    pool.write(off, &vec![tag; n]).unwrap();
                    live.push((off, n, tag));
                }
                Err(ShmError::Full { requested, capacity }) => {
                    assert_eq!((requested, capacity), (n, pages * PS));
                    // Full must mean no run of k free pages exists at all.
                    let longest = shadow.split(|&u| u).map(<[bool]>::len).max().unwrap_or(0);
                    assert!(longest < k, "Full for {k} pages with a free run of {longest}");
                    fulls += 1;
                }
                Err(e) => panic!("unexpected {e}"),
            }
        } else {
            let (off, n, tag) = live.swap_remove(rng.below(live.len()));
            assert!(pool.slice(off, n).unwrap().iter().all(|&b| b == tag), "block at {off} was overwritten");
            let first = page_of(&pool, off);
            for used in &mut shadow[first..first + n.div_ceil(PS).max(1)] {
                *used = false;
            }
            pool.free(off, n);
        }
        if step % 97 == 0 {
            assert_eq!(pool.used_pages(), shadow.iter().filter(|&&u| u).count());
        }
    }
    assert!(fulls > 0, "workload should hit Full sometimes");
    for (off, n, _) in live.drain(..) {
        pool.free(off, n);
    }
    assert_eq!(pool.used_pages(), 0);
}

#[test]
fn concurrent_threads_never_share_pages() {
    let dir = TempDir::new("threads");
    let pool = Arc::new(Pool::create(&dir.path().join("p"), 8, 256 * PS).unwrap());
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let mut rng = XorShift::new(0xABCD + t);
                let mut mine: Vec<Block> = Vec::new();
                for _ in 0..3000 {
                    if mine.len() < 8 && rng.below(2) == 0 {
                        if let Ok(mut b) = BlockMut::alloc(&pool, rng.below(6 * PS)) {
                            b.as_mut_slice().fill(t as u8 + 1);
                            mine.push(b.freeze());
                        }
                    } else if !mine.is_empty() {
                        let b = mine.swap_remove(rng.below(mine.len()));
                        assert!(b.as_slice().iter().all(|&x| x == t as u8 + 1));
                    }
                }
                for b in &mine {
                    assert!(b.as_slice().iter().all(|&x| x == t as u8 + 1));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(pool.used_pages(), 0);
}

#[test]
fn full_and_recovery() {
    let dir = TempDir::new("full");
    let pool = Pool::create(&dir.path().join("p"), 1, 10 * PS).unwrap();
    assert!(matches!(
        pool.alloc(10 * PS + 1),
        Err(ShmError::Full { requested, capacity }) if requested == 10 * PS + 1 && capacity == 10 * PS
    ));
    let offs: Vec<u64> = (0..10).map(|_| pool.alloc(PS).unwrap()).collect();
    let err = pool.alloc(1).unwrap_err();
    assert_eq!(err.kind(), "arena_full");
    assert_eq!(pool.used_pages(), 10);

    pool.free(offs[4], PS);
    assert_eq!(pool.alloc(PS).unwrap(), offs[4]);
    assert!(pool.alloc(2 * PS).is_err());

    pool.free(offs[2], PS);
    pool.free(offs[3], PS);
    assert_eq!(pool.alloc(2 * PS).unwrap(), offs[2]);

    // Three free pages, none adjacent: a 2-page request fails, 1-page works.
    for i in [0, 5, 9] {
        pool.free(offs[i], PS);
    }
    assert!(pool.alloc(2 * PS).is_err());
    assert!(pool.alloc(PS).is_ok());
    assert_eq!(pool.used_pages(), 8);
}

#[test]
fn first_fit_reuses_the_lowest_free_pages() {
    let dir = TempDir::new("first-fit");
    let pool = Pool::create(&dir.path().join("p"), 1, 8 * PS).unwrap();
    let a = pool.alloc(3 * PS).unwrap();
    let b = pool.alloc(3 * PS).unwrap();
    assert_eq!((page_of(&pool, a), page_of(&pool, b)), (0, 3));
    pool.free(a, 3 * PS);
    // The hole at 0 (warm pages) is reused before the untouched pages 6..8.
    let c = pool.alloc(PS).unwrap();
    assert_eq!(page_of(&pool, c), 0);
    // A run that does not fit the rest of the hole (pages 1-2) goes past b.
    let d = pool.alloc(2 * PS).unwrap();
    assert_eq!(page_of(&pool, d), 1);
    let e = pool.alloc(2 * PS).unwrap();
    assert_eq!(page_of(&pool, e), 6);
    assert!(pool.alloc(1).is_err());
    assert_eq!(pool.used_pages(), 8);
}

#[test]
fn second_mapping_shares_bytes_and_bitmap() {
    let dir = TempDir::new("two-maps");
    let path = dir.path().join("p");
    let owner = Pool::create(&path, 5, 4 * PS).unwrap();
    let other = Pool::open(&path).unwrap();
    assert_ne!(owner.base_ptr(), other.base_ptr(), "distinct mappings");
    assert_eq!(other.id(), 5);

    let off = owner.alloc(4 * PS).unwrap();
    owner.write(off, b"written by the owner").unwrap();
    assert_eq!(other.slice(off, 20).unwrap(), b"written by the owner");
    other.write(off + 64, b"reply").unwrap();
    assert_eq!(owner.slice(off + 64, 5).unwrap(), b"reply");
    assert_eq!(other.used_pages(), 4);
    assert!(owner.alloc(1).is_err());

    // The other mapping frees; the owner can reuse the pages.
    other.free(off, 4 * PS);
    assert_eq!(owner.used_pages(), 0);
    assert_eq!(owner.alloc(4 * PS).unwrap(), off);
    assert_eq!(other.used_pages(), 4);
}

const CHILD_ENV: &str = "SLIPSTREAM_SHM_TEST_CHILD";
const CHILD_MARKER: &str = "SLIPSTREAM_SHM_CHILD_OFFSET=";

/// Runs in two roles. Normally it is the parent: it creates a pool, then
/// re-executes this test binary filtered to this very test with
/// [`CHILD_ENV`] set, so the child process maps the pool independently.
#[test]
fn two_processes_share_a_pool() {
    if let Ok(args) = std::env::var(CHILD_ENV) {
        child_role(&args);
        return;
    }
    let dir = TempDir::new("two-proc");
    let node_path = dir.path().join("node");
    let worker_path = dir.path().join("worker");
    let node = Pool::create(&node_path, 1, 64 * PS).unwrap();
    let to_fill = node.alloc(300).unwrap();
    let to_free = node.alloc(1000).unwrap();
    let to_read = node.alloc(64).unwrap();
    node.write(to_read, b"from the parent").unwrap();
    assert_eq!(node.used_pages(), 5 + 16 + 1);

    let test_name = concat!(module_path!(), "::two_processes_share_a_pool").split_once("::").expect("crate prefix").1;
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{}|{}|{to_fill}|{to_free}|{to_read}", node_path.display(), worker_path.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "child did not run the test:\n{stdout}");

    // The child's writes are visible and its free released the pages.
    let expected: Vec<u8> = (0..300).map(|i| (i % 256) as u8).collect();
    assert_eq!(node.slice(to_fill, 300).unwrap(), expected.as_slice());
    assert_eq!(node.used_pages(), 5 + 1);
    node.free(to_fill, 300);
    node.free(to_read, 64);
    assert_eq!(node.used_pages(), 0);

    // The child allocated in its own pool and exited; adopt its output.
    let worker_offset: u64 = stdout
        .lines()
        // libtest prints "test <name> ... " on the same line first.
        .find_map(|l| l.split_once(CHILD_MARKER))
        .map(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next().unwrap_or(""))
        .and_then(|digits| digits.parse().ok())
        .unwrap_or_else(|| panic!("child printed no offset:\n{stdout}"));
    let worker = Arc::new(Pool::open(&worker_path).unwrap());
    assert_eq!(worker.id(), 9);
    assert_eq!(worker.used_pages(), 8);
    let block = Block::adopt(&worker, worker_offset, 500).unwrap();
    assert!(block.as_slice().iter().all(|&b| b == 0xA5));
    drop(block);
    assert_eq!(worker.used_pages(), 0);
}

fn child_role(args: &str) {
    let parts: Vec<&str> = args.split('|').collect();
    let [node_path, worker_path, to_fill, to_free, to_read] = parts[..] else {
        panic!("bad {CHILD_ENV}: {args}");
    };
    let num = |s: &str| s.parse::<u64>().unwrap();
    let node = Pool::open(Path::new(node_path)).unwrap();
    assert_eq!(node.id(), 1);
    assert_eq!(node.slice(num(to_read), 15).unwrap(), b"from the parent");
    let data: Vec<u8> = (0..300).map(|i| (i % 256) as u8).collect();
    node.write(num(to_fill), &data).unwrap();
    node.free(num(to_free), 1000);

    // Act as a worker: own a pool, write an output, hand over the offset.
    let worker = Pool::create(Path::new(worker_path), 9, 32 * PS).unwrap();
    let out = worker.alloc(500).unwrap();
    worker.write(out, &[0xA5; 500]).unwrap();
    println!("{CHILD_MARKER}{out}");
}

#[test]
fn open_rejects_bad_files() {
    let dir = TempDir::new("bad-open");
    let missing = Pool::open(&dir.path().join("missing")).unwrap_err();
    assert_eq!(missing.kind(), "io");

    let short = dir.path().join("short");
    std::fs::write(&short, [0u8; 100]).unwrap();
    assert_eq!(Pool::open(&short).unwrap_err().kind(), "bad_header");
    std::fs::write(&short, []).unwrap();
    assert_eq!(Pool::open(&short).unwrap_err().kind(), "bad_header");

    let path = dir.path().join("good");
    let len = Pool::create(&path, 1, 16 * PS).unwrap().len();
    let good = std::fs::read(&path).unwrap();
    assert!(Pool::open(&path).is_ok());

    let reject = |name: &str, patch: &dyn Fn(&mut Vec<u8>), what: &str| {
        let p = dir.path().join(name);
        let mut bytes = good.clone();
        patch(&mut bytes);
        std::fs::write(&p, &bytes).unwrap();
        match Pool::open(&p) {
            Err(ShmError::BadHeader(msg)) => {
                assert!(msg.contains(what), "{name}: {msg:?} lacks {what:?}")
            }
            other => panic!("{name}: expected BadHeader, got {other:?}"),
        }
    };
    reject("magic", &|b| b[..8].copy_from_slice(b"NOTSHM!!"), "magic");
    reject("zeros", &|b| b.fill(0), "magic");
    reject("version", &|b| b[8] = 2, "version");
    reject("page", &|b| b[12..16].copy_from_slice(&100u32.to_le_bytes()), "page size");
    reject("pages0", &|b| b[16..24].fill(0), "zero pages");
    reject("huge", &|b| b[16..24].copy_from_slice(&u64::MAX.to_le_bytes()), "overflow");
    reject("hdr", &|b| b[28] ^= 1, "header size");
    reject("bitmap", &|b| b[32] ^= 8, "bitmap offset");
    reject("data", &|b| b[40] ^= 64, "data offset");
    reject("declared", &|b| b[48] ^= 64, "declared length");
    reject("truncated", &|b| b.truncate(len - 64), "truncated");
    reject(
        "more pages",
        &|b| {
            // Consistent header claiming 64 more pages than the file holds.
            b[16] += 64;
            b[48..56].copy_from_slice(&((len + 64 * PS) as u64).to_le_bytes());
        },
        "truncated",
    );
}

#[test]
fn slice_and_write_are_bounds_checked() {
    let dir = TempDir::new("bounds");
    let pool = Pool::create(&dir.path().join("p"), 1, 4 * PS).unwrap();
    let data = pool.data_offset();
    let end = pool.len() as u64;
    assert!(pool.slice(data, 4 * PS).is_ok());
    assert!(pool.slice(end, 0).unwrap().is_empty());
    for (offset, len) in [(0, 1), (data - 1, 1), (end - 1, 2), (end + 1, 0), (u64::MAX, 1), (data, usize::MAX)] {
        let err = pool.slice(offset, len).unwrap_err();
        assert!(
            matches!(err, ShmError::OutOfBounds { offset: o, len: l, size } if o == offset && l == len && size == pool.len()),
            "{err:?}"
        );
    }
    assert_eq!(pool.write(end - 3, b"four").unwrap_err().kind(), "out_of_bounds");
    assert_eq!(pool.write(8, b"x").unwrap_err().kind(), "out_of_bounds");
    pool.write(end - 4, b"four").unwrap();
    assert_eq!(pool.slice(end - 4, 4).unwrap(), b"four");
    // The header was not touched by the rejected write.
    assert!(Pool::open(pool.path()).is_ok());
}

#[test]
fn unlink_keeps_mapping_alive() {
    let dir = TempDir::new("unlink");
    let path = dir.path().join("p");
    let pool = Pool::create(&path, 1, 4 * PS).unwrap();
    let off = pool.alloc(10).unwrap();
    pool.unlink().unwrap();
    assert!(!path.exists());
    pool.write(off, b"still here").unwrap();
    assert_eq!(pool.slice(off, 10).unwrap(), b"still here");
    assert_eq!(Pool::open(&path).unwrap_err().kind(), "io");
    assert_eq!(pool.unlink().unwrap_err().kind(), "io");
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "double free")]
fn double_free_panics_in_debug() {
    let dir = TempDir::new("double-free");
    let pool = Pool::create(&dir.path().join("p"), 1, 4 * PS).unwrap();
    let off = pool.alloc(10).unwrap();
    pool.free(off, 10);
    pool.free(off, 10);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "invalid block")]
fn free_of_foreign_range_panics_in_debug() {
    let dir = TempDir::new("bad-free");
    let pool = Pool::create(&dir.path().join("p"), 1, 4 * PS).unwrap();
    pool.free(pool.data_offset() + 1, 10);
}
