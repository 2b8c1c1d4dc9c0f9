//! Choosing the merge threshold from what this machine measures.

use serde::Serialize;
use std::hint::black_box;
use std::io::{self, IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Segments per write in the many-segment case, and bytes per segment.
const SEGMENTS: usize = 32;
const SEGMENT_BYTES: usize = 16;
/// Writes per timed batch, and batches per case (the fastest batch counts).
const WRITES: usize = 128;
const BATCHES: usize = 10;
/// Bytes copied per memcpy sample.
const COPY_BYTES: usize = 4 << 20;
const COPIES: usize = 8;

pub const MIN_MERGE_THRESHOLD: usize = 64;
pub const MAX_MERGE_THRESHOLD: usize = 65536;

/// Costs of sending a tensor as its own segment versus copying it into a
/// merge buffer, and the threshold they imply.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Costs {
    /// What one more `iovec` entry adds to a vectored socket write.
    pub per_segment_ns: f64,
    /// What copying one more byte costs.
    pub per_byte_ns: f64,
    /// `per_segment_ns / per_byte_ns`, clamped to [64, 65536].
    pub merge_threshold: usize,
}

/// Measure [`Costs`] on this machine (about 10-30 ms; it blocks, so call it
/// at start-up, before or outside the async runtime's hot path).
///
/// The model: sending a tensor of `b` bytes as its own segment costs
/// `per_segment_ns` (the kernel walks and maps one more `iovec` entry; the
/// bytes themselves are copied into the socket either way), while merging
/// it into a neighbour's buffer costs `b * per_byte_ns` (one memcpy). So
/// merging pays for tensors under `per_segment_ns / per_byte_ns` bytes.
///
/// `per_segment_ns` is the difference, divided by 31, between writing 512
/// bytes as 32 segments of 16 and as 1 segment, on a loopback TCP pair with
/// a thread draining the other end (the fastest of several batches of 200
/// writes each, to shed scheduler noise). `per_byte_ns` is the fastest of a
/// few 4 MiB copies. Both are floored at small positive values so the ratio
/// is defined when noise swamps a measurement; if no loopback socket can be
/// made, typical values (30 ns, 0.05 ns) stand in.
pub fn measure_costs() -> Costs {
    let per_segment_ns = measure_segment_ns().unwrap_or(30.0).max(0.5);
    let per_byte_ns = measure_byte_ns().max(0.001);
    Costs { per_segment_ns, per_byte_ns, merge_threshold: threshold(per_segment_ns, per_byte_ns) }
}

fn threshold(per_segment_ns: f64, per_byte_ns: f64) -> usize {
    let t = per_segment_ns / per_byte_ns;
    if t.is_finite() {
        (t as usize).clamp(MIN_MERGE_THRESHOLD, MAX_MERGE_THRESHOLD)
    } else {
        MAX_MERGE_THRESHOLD
    }
}

fn write_all_vectored(w: &mut TcpStream, slices: &[IoSlice<'_>]) -> io::Result<()> {
    // A copy of the list, since a partial write advances it (rare at these sizes).
    let mut owned: Vec<IoSlice<'_>> = slices.to_vec();
    let mut bufs = &mut owned[..];
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Mean ns per write of `slices`, over one batch.
fn time_batch(w: &mut TcpStream, slices: &[IoSlice<'_>]) -> io::Result<f64> {
    let start = Instant::now();
    for _ in 0..WRITES {
        write_all_vectored(w, slices)?;
    }
    Ok(start.elapsed().as_nanos() as f64 / WRITES as f64)
}

fn measure_segment_ns() -> io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut tx = TcpStream::connect(listener.local_addr()?)?;
    let (mut rx, _) = listener.accept()?;
    tx.set_nodelay(true)?;
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while matches!(rx.read(&mut buf), Ok(n) if n > 0) {}
    });
    let data = vec![0x5au8; SEGMENTS * SEGMENT_BYTES];
    let many: Vec<IoSlice<'_>> = data.chunks(SEGMENT_BYTES).map(IoSlice::new).collect();
    let one = [IoSlice::new(&data)];
    let (mut best_one, mut best_many) = (f64::MAX, f64::MAX);
    let mut result = Ok(());
    for _ in 0..BATCHES {
        match (time_batch(&mut tx, &one), time_batch(&mut tx, &many)) {
            (Ok(a), Ok(b)) => {
                best_one = best_one.min(a);
                best_many = best_many.min(b);
            }
            (Err(e), _) | (_, Err(e)) => {
                result = Err(e);
                break;
            }
        }
    }
    drop(tx);
    let _ = drain.join();
    result?;
    Ok((best_many - best_one) / (SEGMENTS - 1) as f64)
}

fn measure_byte_ns() -> f64 {
    let src = vec![1u8; COPY_BYTES];
    let mut dst = vec![0u8; COPY_BYTES];
    dst.copy_from_slice(&src); // fault the pages in
    let mut best = f64::MAX;
    for i in 0..COPIES {
        let start = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        best = best.min(start.elapsed().as_nanos() as f64);
        dst[i] = 0;
    }
    best / COPY_BYTES as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_clamped() {
        assert_eq!(threshold(30.0, 0.05), 600);
        assert_eq!(threshold(1.0, 1.0), MIN_MERGE_THRESHOLD);
        assert_eq!(threshold(1e9, 0.001), MAX_MERGE_THRESHOLD);
        assert_eq!(threshold(f64::INFINITY, 1.0), MAX_MERGE_THRESHOLD);
    }
}
