//! Reading frames from, and writing frames to, one connection.

use crate::frame::{Encoded, Head, HeadDecoder, Limits, SendStats};
use crate::{Counters, PeerError};
use bytes::{Buf, Bytes};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Size of a connection's read buffer (headers go through it).
pub(crate) const READ_BUF: usize = 64 << 10;
/// Frames queued for a connection's writer before senders wait.
pub(crate) const QUEUE_DEPTH: usize = 1024;
/// The writer gathers queued frames into one write up to these sizes.
const GATHER_SEGMENTS: usize = 512;
const GATHER_BYTES: u64 = 8 << 20;
/// Segments handed to one `writev` (Linux takes at most 1024).
const MAX_IOV: usize = 1024;

/// One frame for a writer.
pub(crate) struct Job {
    pub segments: Vec<Bytes>,
    pub stats: SendStats,
}

impl From<Encoded> for Job {
    fn from(e: Encoded) -> Job {
        Job { segments: e.segments, stats: e.stats }
    }
}

/// Reads frames: the header through a buffer, the payload straight into
/// the caller's memory.
pub(crate) struct FrameReader<R> {
    rd: R,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    limits: Limits,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(rd: R, limits: Limits) -> Self {
        FrameReader { rd, buf: vec![0; READ_BUF], start: 0, end: 0, limits }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Make `n` bytes available at `buf[start..]`. `Ok(false)` on a clean
    /// end of stream (`clean_eof_ok` and nothing buffered).
    async fn ensure(&mut self, n: usize, clean_eof_ok: bool) -> io::Result<bool> {
        if self.buffered() >= n {
            return Ok(true);
        }
        if self.start == self.end {
            // Empty: read into the whole buffer, not just what is left of it.
            self.start = 0;
            self.end = 0;
        }
        if self.buf.len() - self.start < n {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.buf.len() < n {
                self.buf.resize(n, 0);
            }
        }
        while self.buffered() < n {
            let got = self.rd.read(&mut self.buf[self.end..]).await?;
            if got == 0 {
                if clean_eof_ok && self.buffered() == 0 {
                    return Ok(false);
                }
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a frame"));
            }
            self.end += got;
        }
        Ok(true)
    }

    /// The next frame's header; `None` on a clean end of stream between frames.
    pub async fn read_head(&mut self) -> Result<Option<Head>, PeerError> {
        if self.buf.len() > READ_BUF && self.buffered() <= READ_BUF {
            // A large meta grew the buffer; give the memory back.
            let mut small = vec![0; READ_BUF];
            small[..self.buffered()].copy_from_slice(&self.buf[self.start..self.end]);
            self.end = self.buffered();
            self.start = 0;
            self.buf = small;
        }
        let mut dec = HeadDecoder::new(self.limits);
        let mut first = true;
        while !dec.is_done() {
            // The decoder takes every complete part buffered, then says how
            // much the next part needs; gather that much and go on.
            if !self.ensure(dec.need(), first).await? {
                return Ok(None);
            }
            first = false;
            let used = dec.feed(&self.buf[self.start..self.end]).map_err(PeerError::BadFrame)?;
            self.start += used;
        }
        Ok(dec.finish())
    }

    /// Fill `dst` with the next `dst.len()` bytes: what came in with the
    /// header is copied from the read buffer, the rest is read from the
    /// socket directly into `dst`, in one `read_exact`.
    pub async fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let k = self.buffered().min(dst.len());
        dst[..k].copy_from_slice(&self.buf[self.start..self.start + k]);
        self.start += k;
        if k < dst.len() {
            self.rd.read_exact(&mut dst[k..]).await?;
        }
        Ok(())
    }

    /// Consume `n` bytes without keeping them, reading nothing past them.
    pub async fn skip_payload(&mut self, n: u64) -> io::Result<()> {
        let k = (self.buffered() as u64).min(n);
        self.start += k as usize;
        let mut left = n - k;
        while left > 0 {
            // The buffer is empty here (or `left` would be 0).
            let want = (left.min(self.buf.len() as u64)) as usize;
            let got = self.rd.read(&mut self.buf[..want]).await?;
            if got == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a frame"));
            }
            left -= got as u64;
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(())
    }
}

/// Write all of `segs` with vectored writes, however the kernel splits them.
pub(crate) async fn write_segments<W: AsyncWrite + Unpin>(w: &mut W, segs: &mut VecDeque<Bytes>) -> io::Result<()> {
    while !segs.is_empty() {
        let n = {
            let slices: Vec<IoSlice<'_>> = segs.iter().take(MAX_IOV).map(|b| IoSlice::new(b)).collect();
            w.write_vectored(&slices).await?
        };
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes"));
        }
        advance(segs, n);
    }
    Ok(())
}

/// Drop the first `n` bytes of `segs`.
fn advance(segs: &mut VecDeque<Bytes>, mut n: usize) {
    while n > 0 {
        let Some(front) = segs.front_mut() else { return };
        if front.len() <= n {
            n -= front.len();
            segs.pop_front();
        } else {
            front.advance(n);
            n = 0;
        }
    }
}

/// A connection's writer: frames in queue order, each written whole, all
/// frames already queued behind the first gathered into the same writes.
/// Returns when every sender is gone, or on the first write error.
pub(crate) async fn writer_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
) -> io::Result<()> {
    let mut segs = VecDeque::new();
    let mut stats = Vec::new();
    while let Some(job) = rx.recv().await {
        let mut bytes = job.stats.bytes;
        segs.extend(job.segments);
        stats.push(job.stats);
        while segs.len() < GATHER_SEGMENTS && bytes < GATHER_BYTES {
            let Ok(job) = rx.try_recv() else { break };
            bytes += job.stats.bytes;
            segs.extend(job.segments);
            stats.push(job.stats);
        }
        write_segments(&mut w, &mut segs).await?;
        // A no-op on a socket; TLS may hold the end of a record back.
        w.flush().await?;
        for s in stats.drain(..) {
            counters.sent(&s);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{encode, Kind, OutTensor, Outgoing, ALIGN, MAX_META};
    use crate::{alloc_checked, Allocator};
    use parking_lot::Mutex;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use slipstream_types::DType;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// Takes at most `max` bytes per write, to exercise partial writes.
    struct Trickle {
        out: Vec<u8>,
        max: usize,
        calls: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let n = buf.len().min(self.max);
            self.out.extend_from_slice(&buf[..n]);
            self.calls += 1;
            Poll::Ready(Ok(n))
        }
        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let mut left = self.max;
            let mut n = 0;
            for b in bufs {
                let k = b.len().min(left);
                self.out.extend_from_slice(&b[..k]);
                left -= k;
                n += k;
                if left == 0 {
                    break;
                }
            }
            self.calls += 1;
            Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn partial_vectored_writes_keep_every_byte_in_order() {
        let segs: Vec<Bytes> = (0..50u8).map(|i| Bytes::from(vec![i; (i as usize * 37) % 300 + 1])).collect();
        let want: Vec<u8> = segs.iter().flat_map(|s| s.iter().copied()).collect();
        for max in [1, 7, 64, 1000, 1 << 20] {
            let mut w = Trickle { out: Vec::new(), max, calls: 0 };
            let mut q: VecDeque<Bytes> = segs.iter().cloned().collect();
            write_segments(&mut w, &mut q).await.unwrap();
            assert_eq!(w.out, want, "max {max}");
            assert!(q.is_empty());
            if max == 1 << 20 {
                assert_eq!(w.calls, 1, "one writev when the socket takes everything");
            }
        }
    }

    struct Recording {
        max: usize,
        asked: Mutex<Vec<usize>>,
    }

    impl Allocator for Recording {
        type Buf = Vec<u8>;
        fn alloc(&self, n: usize) -> Result<Vec<u8>, String> {
            self.asked.lock().push(n);
            if n > self.max {
                return Err("over the test's limit".into());
            }
            Ok(vec![0; n])
        }
    }

    fn sample(rng: &mut StdRng) -> Vec<u8> {
        let n = rng.random_range(0..6);
        let dtypes = [DType::Float32, DType::Uint8, DType::Int64, DType::Bytes, DType::Float16];
        let tensors = (0..n)
            .map(|i| {
                let dtype = dtypes[rng.random_range(0..dtypes.len())];
                let shape: Vec<u64> = (0..rng.random_range(0..3)).map(|_| rng.random_range(0..9)).collect();
                let len = if dtype.is_variable() {
                    rng.random_range(0..40)
                } else {
                    slipstream_types::checked_nbytes(dtype, &shape).unwrap() as usize
                };
                OutTensor { name: format!("t{i}"), dtype, shape, data: Bytes::from(vec![i as u8; len]) }
            })
            .collect();
        let meta = vec![b'm'; rng.random_range(0..20)];
        let msg = Outgoing { kind: Kind::Reply, id: rng.random(), meta, tensors };
        let e = encode(&msg, rng.random_range(0..128), &Limits::default()).unwrap();
        e.segments.iter().flat_map(|s| s.iter().copied()).collect()
    }

    fn mutate(rng: &mut StdRng, mut f: Vec<u8>) -> Vec<u8> {
        match rng.random_range(0..6) {
            0 => {
                for _ in 0..rng.random_range(1..4) {
                    if !f.is_empty() {
                        let i = rng.random_range(0..f.len());
                        f[i] = rng.random();
                    }
                }
            }
            1 => {
                let cut = rng.random_range(0..=f.len());
                f.truncate(cut);
            }
            2 => {
                // A size field set to something extreme.
                let at = [16usize, 20, 24][rng.random_range(0..3)];
                let v: u64 = [u64::MAX, u32::MAX as u64, 1 << 40, MAX_META as u64 + 1][rng.random_range(0..4)];
                let w = if at == 24 { 8 } else { 4 };
                if f.len() >= at + w {
                    f[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
                }
            }
            3 => {
                let at = rng.random_range(0..=f.len());
                let junk: Vec<u8> = (0..rng.random_range(1..16)).map(|_| rng.random()).collect();
                f.splice(at..at, junk);
            }
            4 => {
                // A u64 somewhere in the table set to something extreme.
                if f.len() > 40 {
                    let at = rng.random_range(32..f.len() - 8);
                    f[at..at + 8].copy_from_slice(&[u64::MAX, 1 << 63, 64, 0][rng.random_range(0..4)].to_le_bytes());
                }
            }
            _ => f = (0..rng.random_range(0..200)).map(|_| rng.random()).collect(),
        }
        f
    }

    /// The live read path (decoder + allocation + payload read) over random
    /// and mutated frames: no panics, nothing allocated past the limit, and
    /// whatever is accepted is consistent.
    #[tokio::test]
    async fn fuzzed_frames_never_panic_or_overallocate() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        let limits = Limits { max_payload: 1 << 16 };
        let alloc = Recording { max: usize::MAX, asked: Mutex::new(Vec::new()) };
        let (mut accepted, mut refused) = (0, 0);
        for case in 0..4000 {
            let valid = sample(&mut rng);
            let bytes = if case % 4 == 0 { valid } else { mutate(&mut rng, valid) };
            let mut r = FrameReader::new(&bytes[..], limits);
            // Tiny read buffer sometimes, so headers straddle reads.
            if case % 3 == 0 {
                r.buf = vec![0; 8];
            }
            loop {
                match r.read_head().await {
                    Ok(Some(head)) => {
                        assert!(head.payload_len <= limits.max_payload);
                        assert!(head.meta.len() <= MAX_META as usize);
                        let mut prev = 0;
                        for t in &head.tensors {
                            assert_eq!(t.offset % ALIGN, 0);
                            assert!(t.offset >= prev && t.offset + t.nbytes <= head.payload_len);
                            prev = t.offset + t.nbytes;
                            if let Some(n) = slipstream_types::checked_nbytes(t.dtype, &t.shape) {
                                assert_eq!(n, t.nbytes);
                            }
                        }
                        let mut buf = alloc_checked(&alloc, head.payload_len as usize).unwrap();
                        if r.read_payload(&mut buf[..head.payload_len as usize]).await.is_err() {
                            break;
                        }
                        accepted += 1;
                    }
                    Ok(None) => break,
                    Err(_) => {
                        refused += 1;
                        break;
                    }
                }
            }
        }
        assert!(accepted > 1000 && refused > 500, "accepted {accepted}, refused {refused}");
        assert!(alloc.asked.lock().iter().all(|&n| n as u64 <= limits.max_payload));
    }

    #[tokio::test]
    async fn skipping_a_payload_leaves_the_next_frame_intact() {
        let mut rng = StdRng::seed_from_u64(1);
        let a = sample(&mut rng);
        let b = sample(&mut rng);
        let both: Vec<u8> = a.iter().chain(&b).copied().collect();
        let mut r = FrameReader::new(&both[..], Limits::default());
        let h = r.read_head().await.unwrap().unwrap();
        r.skip_payload(h.payload_len).await.unwrap();
        let h2 = r.read_head().await.unwrap().unwrap();
        assert_eq!(Some(h2), crate::frame::decode_head(&b, &Limits::default()).unwrap());
    }
}
