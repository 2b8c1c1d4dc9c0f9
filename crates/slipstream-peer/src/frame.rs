//! The frame format, its encoder, and a decoder for its header.
//!
//! All integers little-endian:
//!
//! ```text
//! prefix (32 bytes): magic u32 ("SSPF") | kind u8 (Call=1, Reply=2, Error=3, Part=4) | 3 zero bytes
//!                    | id u64 | meta_len u32 | ntensors u32 | payload_len u64
//! meta:              meta_len bytes, opaque to this crate (the runtime's JSON)
//! tensor table:      per tensor: name_len u16 | name (UTF-8) | dtype_len u8 | dtype name
//!                    (numpy spelling, `float32`) | ndim u8 | shape u64 * ndim | nbytes u64 | offset u64
//! payload:           payload_len bytes; tensor i at `offset` (a multiple of 64), in table
//!                    order, zero padding between
//! ```
//!
//! `slipstream-types` gives dtypes no numeric code, so the table spells them
//! out (at most 7 bytes). The payload is laid out exactly as the receiver
//! wants it in memory, so the receiver reads it in one piece into a buffer
//! of `payload_len` bytes.
//!
//! The decoder ([`HeadDecoder`]) consumes the header part by part (prefix,
//! meta, one table entry at a time) from whatever bytes are at hand, checks
//! each length against its limit as soon as it sees it and before anything
//! is sized by it, and stops at the end of the header: it never looks at
//! the payload. The limits are the constants below and
//! [`Limits::max_payload`]. Multi-byte fields are read from byte slices of
//! checked length; sums are checked; nothing panics on any input.

use bytes::Bytes;
use slipstream_types::{checked_nbytes, DType, ALL_DTYPES};
use std::ops::Range;

pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"SSPF");
/// Bytes of the fixed prefix.
pub const PREFIX_LEN: usize = 32;
/// Tensor offsets in the payload are multiples of this.
pub const ALIGN: u64 = 64;
pub const MAX_META: u32 = 1 << 20;
pub const MAX_TENSORS: u32 = 65536;
pub const MAX_NAME: usize = 1024;
pub const MAX_NDIM: usize = 32;
/// Longest dtype spelling accepted in a table.
pub const MAX_DTYPE_NAME: usize = 16;
pub const DEFAULT_MAX_PAYLOAD: u64 = 4 << 30;

static ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    Call = 1,
    Reply = 2,
    /// A reply saying the call failed; `meta` is the reason, as text.
    Error = 3,
    /// A partial reply: the call stays open, and its Reply (or Error)
    /// follows every Part of it on the same connection.
    Part = 4,
}

impl Kind {
    pub fn from_u8(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::Call),
            2 => Some(Kind::Reply),
            3 => Some(Kind::Error),
            4 => Some(Kind::Part),
            _ => None,
        }
    }
}

/// Limits that are configurable (the others are the constants of this module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_payload: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_payload: DEFAULT_MAX_PAYLOAD }
    }
}

/// A tensor to send. `data` is not copied unless the tensor is merged
/// (wrap shared memory with `Bytes::from_owner`).
#[derive(Clone, Debug, PartialEq)]
pub struct OutTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Bytes,
}

/// A frame to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Outgoing {
    pub kind: Kind,
    /// Set by whoever sends it: [`crate::Peers::call`] assigns call ids, a
    /// server replies under the call's id.
    pub id: u64,
    pub meta: Vec<u8>,
    pub tensors: Vec<OutTensor>,
}

impl Outgoing {
    pub fn call(meta: Vec<u8>, tensors: Vec<OutTensor>) -> Outgoing {
        Outgoing { kind: Kind::Call, id: 0, meta, tensors }
    }

    /// A reply carrying `call`'s metadata and tensors back, sliced from the
    /// received payload without a copy (for echo servers: tests, benchmarks).
    pub fn echo(call: Incoming<Vec<u8>>) -> Outgoing {
        let payload = bytes::Bytes::from(call.payload);
        let tensors = call
            .tensors
            .iter()
            .map(|t| OutTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: payload.slice(t.range()),
            })
            .collect();
        Outgoing::reply(call.meta, tensors)
    }

    pub fn reply(meta: Vec<u8>, tensors: Vec<OutTensor>) -> Outgoing {
        Outgoing { kind: Kind::Reply, id: 0, meta, tensors }
    }

    /// An Error reply; the caller gets [`crate::PeerError::Remote`] with `message`.
    pub fn error(message: impl Into<String>) -> Outgoing {
        Outgoing { kind: Kind::Error, id: 0, meta: message.into().into_bytes(), tensors: Vec::new() }
    }
}

/// A tensor of a received frame: `payload[offset..offset + nbytes]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    /// Into the payload; a multiple of [`ALIGN`].
    pub offset: u64,
}

impl InTensor {
    /// The tensor's bytes within the payload buffer.
    pub fn range(&self) -> Range<usize> {
        // Both fit: the decoder checked offset + nbytes <= payload_len, and
        // the payload was allocated, so payload_len fits a usize.
        self.offset as usize..(self.offset + self.nbytes) as usize
    }
}

/// A received frame; `payload` came from the receiver's [`crate::Allocator`].
#[derive(Debug)]
pub struct Incoming<B> {
    pub kind: Kind,
    pub id: u64,
    pub meta: Vec<u8>,
    pub tensors: Vec<InTensor>,
    pub payload: B,
}

impl<B: AsMut<[u8]>> Incoming<B> {
    /// The bytes of tensor `i`.
    pub fn tensor_data(&mut self, i: usize) -> Option<&[u8]> {
        let range = self.tensors.get(i)?.range();
        let payload: &[u8] = self.payload.as_mut();
        payload.get(range)
    }
}

/// What encoding one frame did, for [`crate::Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Whole frame: prefix, meta, table, payload.
    pub bytes: u64,
    pub tensors: u64,
    pub copied_bytes: u64,
    pub merged_runs: u64,
    pub merged_tensors: u64,
    pub zero_copy_tensors: u64,
}

/// A frame ready for a vectored write.
#[derive(Clone, Debug)]
pub struct Encoded {
    /// In order; none empty. Large tensors are their own segment (a clone
    /// of their `Bytes`, same memory); padding between them is static.
    pub segments: Vec<Bytes>,
    pub stats: SendStats,
}

/// `x` rounded up to a multiple of [`ALIGN`].
pub fn align_up(x: u64) -> Option<u64> {
    Some(x.checked_add(ALIGN - 1)? & !(ALIGN - 1))
}

pub(crate) fn prefix(kind: Kind, id: u64, meta_len: u32, ntensors: u32, payload_len: u64) -> [u8; PREFIX_LEN] {
    let mut p = [0u8; PREFIX_LEN];
    p[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    p[4] = kind as u8;
    p[8..16].copy_from_slice(&id.to_le_bytes());
    p[16..20].copy_from_slice(&meta_len.to_le_bytes());
    p[20..24].copy_from_slice(&ntensors.to_le_bytes());
    p[24..32].copy_from_slice(&payload_len.to_le_bytes());
    p
}

/// An Error frame carrying `message` (cut to 4 KiB). Cannot fail.
pub fn encode_error(id: u64, message: &str) -> Encoded {
    let mut end = message.len().min(4096);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let meta = &message.as_bytes()[..end];
    let mut buf = Vec::with_capacity(PREFIX_LEN + meta.len());
    buf.extend_from_slice(&prefix(Kind::Error, id, meta.len() as u32, 0, 0));
    buf.extend_from_slice(meta);
    let stats = SendStats { bytes: buf.len() as u64, ..SendStats::default() };
    Encoded { segments: vec![Bytes::from(buf)], stats }
}

/// Lay out `msg` as a frame.
///
/// Walking the tensors in order, each tensor smaller than `merge_threshold`
/// bytes is copied (with the padding before it) into the current copy
/// buffer, which starts as the header's own buffer; each other tensor closes
/// that buffer (the padding before the tensor goes at its end) and becomes
/// its own segment, after a static padding segment if there was no buffer
/// to close. So a run of consecutive small tensors is one segment, and the
/// first run shares the header's. `merge_threshold == 0` merges nothing.
///
/// Fails, sending nothing, if `msg` breaks a limit the receiver enforces.
pub fn encode(msg: &Outgoing, merge_threshold: usize, limits: &Limits) -> Result<Encoded, String> {
    if msg.meta.len() > MAX_META as usize {
        return Err(format!("meta is {} bytes, the limit is {MAX_META}", msg.meta.len()));
    }
    if msg.tensors.len() > MAX_TENSORS as usize {
        return Err(format!("{} tensors, the limit is {MAX_TENSORS}", msg.tensors.len()));
    }
    let small = |t: &OutTensor| t.data.len() < merge_threshold;
    let mut offsets = Vec::with_capacity(msg.tensors.len());
    let mut end = 0u64;
    let mut table_len = 0usize;
    let mut first_run = 0usize;
    let mut in_first_run = true;
    for t in &msg.tensors {
        if t.name.len() > MAX_NAME {
            return Err(format!("tensor name of {} bytes, the limit is {MAX_NAME}", t.name.len()));
        }
        if t.shape.len() > MAX_NDIM {
            return Err(format!("tensor '{}' has {} dimensions, the limit is {MAX_NDIM}", t.name, t.shape.len()));
        }
        let n = t.data.len() as u64;
        if !t.dtype.is_variable() && checked_nbytes(t.dtype, &t.shape) != Some(n) {
            return Err(format!("tensor '{}': {n} bytes of data for {} {:?}", t.name, t.dtype, t.shape));
        }
        let off = align_up(end).ok_or("payload size overflows")?;
        end = off.checked_add(n).ok_or("payload size overflows")?;
        offsets.push(off);
        table_len += 2 + t.name.len() + 1 + t.dtype.name().len() + 1 + 8 * t.shape.len() + 16;
        in_first_run &= small(t);
        if in_first_run {
            first_run += t.data.len() + ALIGN as usize;
        }
    }
    if end > limits.max_payload {
        return Err(format!("payload of {end} bytes, the limit is {}", limits.max_payload));
    }
    let payload_len = end;

    let mut open = Vec::with_capacity(PREFIX_LEN + msg.meta.len() + table_len + first_run);
    open.extend_from_slice(&prefix(msg.kind, msg.id, msg.meta.len() as u32, msg.tensors.len() as u32, payload_len));
    open.extend_from_slice(&msg.meta);
    for (t, off) in msg.tensors.iter().zip(&offsets) {
        open.extend_from_slice(&(t.name.len() as u16).to_le_bytes());
        open.extend_from_slice(t.name.as_bytes());
        let dtype = t.dtype.name().as_bytes();
        open.push(dtype.len() as u8);
        open.extend_from_slice(dtype);
        open.push(t.shape.len() as u8);
        for d in &t.shape {
            open.extend_from_slice(&d.to_le_bytes());
        }
        open.extend_from_slice(&(t.data.len() as u64).to_le_bytes());
        open.extend_from_slice(&off.to_le_bytes());
    }
    let head_len = open.len() as u64;

    let mut stats = SendStats { tensors: msg.tensors.len() as u64, ..SendStats::default() };
    let mut segments = Vec::new();
    let mut pos = 0u64;
    let mut in_run = false;
    for (i, (t, &off)) in msg.tensors.iter().zip(&offsets).enumerate() {
        let pad = &ZEROS[..(off - pos) as usize];
        if small(t) {
            if !in_run {
                in_run = true;
                stats.merged_runs += 1;
                if open.capacity() == 0 {
                    let run: usize =
                        msg.tensors[i..].iter().take_while(|t| small(t)).map(|t| t.data.len() + ALIGN as usize).sum();
                    open.reserve(run);
                }
            }
            open.extend_from_slice(pad);
            open.extend_from_slice(&t.data);
            stats.merged_tensors += 1;
            stats.copied_bytes += t.data.len() as u64;
        } else {
            in_run = false;
            if !open.is_empty() {
                // The padding rides at the end of the copy buffer.
                open.extend_from_slice(pad);
                segments.push(Bytes::from(std::mem::take(&mut open)));
            } else if !pad.is_empty() {
                segments.push(Bytes::from_static(pad));
            }
            if !t.data.is_empty() {
                segments.push(t.data.clone());
            }
            stats.zero_copy_tensors += 1;
        }
        pos = off + t.data.len() as u64;
    }
    if !open.is_empty() {
        segments.push(Bytes::from(open));
    }
    stats.bytes = head_len + payload_len;
    Ok(Encoded { segments, stats })
}

/// A decoded header: everything but the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub kind: Kind,
    pub id: u64,
    pub meta: Vec<u8>,
    pub tensors: Vec<InTensor>,
    /// Checked against [`Limits::max_payload`]; every tensor lies inside.
    pub payload_len: u64,
    /// Bytes of prefix, meta and table.
    pub head_len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Prefix,
    Meta,
    Table,
    Done,
}

/// Decodes a frame header from a byte stream.
///
/// [`HeadDecoder::feed`] takes whatever bytes are at hand and consumes the
/// complete parts of the header among them (the prefix, the meta, whole
/// table entries), never anything past the header; [`HeadDecoder::need`]
/// says how many bytes, from the first unconsumed one, the next part needs,
/// as far as the decoder can tell (so a reader gathers that many and feeds
/// again). Every length is checked against its limit as soon as it is
/// seen, before anything is sized by it: no part is over 1 MiB (the meta)
/// and a table entry is at most about 1.3 KiB.
#[derive(Debug)]
pub struct HeadDecoder {
    limits: Limits,
    state: State,
    kind: Kind,
    id: u64,
    meta_len: usize,
    ntensors: usize,
    payload_len: u64,
    meta: Vec<u8>,
    tensors: Vec<InTensor>,
    /// In the table: bytes the current entry needs, as far as seen.
    want: usize,
    prev_end: u64,
    consumed: u64,
}

/// The dtype a table spells `b` (`DType::name`).
fn dtype_from_wire(b: &[u8]) -> Option<DType> {
    ALL_DTYPES.into_iter().find(|d| d.name().as_bytes() == b)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

impl HeadDecoder {
    pub fn new(limits: Limits) -> HeadDecoder {
        HeadDecoder {
            limits,
            state: State::Prefix,
            kind: Kind::Call,
            id: 0,
            meta_len: 0,
            ntensors: 0,
            payload_len: 0,
            meta: Vec::new(),
            tensors: Vec::new(),
            want: 0,
            prev_end: 0,
            consumed: 0,
        }
    }

    /// Bytes the next part of the header needs (counted from the first
    /// byte not yet consumed); 0 once the header is complete.
    pub fn need(&self) -> usize {
        match self.state {
            State::Prefix => PREFIX_LEN,
            State::Meta => self.meta_len,
            State::Table => self.want,
            State::Done => 0,
        }
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consume the complete parts of the header at the start of `buf`;
    /// returns how many bytes that was. Stops at the end of the header.
    pub fn feed(&mut self, buf: &[u8]) -> Result<usize, String> {
        let mut at = 0usize;
        loop {
            let rest = &buf[at..];
            match self.state {
                State::Done => break,
                State::Prefix => {
                    let Some(p) = rest.get(..PREFIX_LEN) else { break };
                    self.prefix(p)?;
                    at += PREFIX_LEN;
                }
                State::Meta => {
                    let Some(m) = rest.get(..self.meta_len) else { break };
                    self.meta = m.to_vec();
                    at += self.meta_len;
                    self.next_tensor();
                }
                State::Table => match self.entry(rest)? {
                    Some(n) => at += n,
                    None => break,
                },
            }
        }
        self.consumed += at as u64;
        Ok(at)
    }

    /// The header, once [`HeadDecoder::is_done`].
    pub fn finish(self) -> Option<Head> {
        self.is_done().then_some(Head {
            kind: self.kind,
            id: self.id,
            meta: self.meta,
            tensors: self.tensors,
            payload_len: self.payload_len,
            head_len: self.consumed,
        })
    }

    fn next_tensor(&mut self) {
        self.want = 2;
        self.state = if self.tensors.len() == self.ntensors { State::Done } else { State::Table };
    }

    fn prefix(&mut self, b: &[u8]) -> Result<(), String> {
        if u32_at(b, 0) != FRAME_MAGIC {
            return Err(format!("bad magic {:#010x}", u32_at(b, 0)));
        }
        self.kind = Kind::from_u8(b[4]).ok_or_else(|| format!("unknown frame kind {}", b[4]))?;
        if b[5..8] != [0, 0, 0] {
            return Err("reserved bytes are not zero".into());
        }
        self.id = u64_at(b, 8);
        let meta_len = u32_at(b, 16);
        let ntensors = u32_at(b, 20);
        let payload_len = u64_at(b, 24);
        if meta_len > MAX_META {
            return Err(format!("meta of {meta_len} bytes, the limit is {MAX_META}"));
        }
        if ntensors > MAX_TENSORS {
            return Err(format!("{ntensors} tensors, the limit is {MAX_TENSORS}"));
        }
        if payload_len > self.limits.max_payload {
            return Err(format!("payload of {payload_len} bytes, the limit is {}", self.limits.max_payload));
        }
        self.meta_len = meta_len as usize;
        self.ntensors = ntensors as usize;
        self.payload_len = payload_len;
        self.tensors = Vec::with_capacity(self.ntensors.min(1024));
        self.state = State::Meta;
        Ok(())
    }

    /// One table entry from the start of `b`: its length once it is all
    /// there (and checked), `None` (with `want` raised) until then.
    fn entry(&mut self, b: &[u8]) -> Result<Option<usize>, String> {
        let index = self.tensors.len();
        if b.len() < 2 {
            self.want = 2;
            return Ok(None);
        }
        let name_len = u16::from_le_bytes([b[0], b[1]]) as usize;
        if name_len > MAX_NAME {
            return Err(format!("tensor {index}: name of {name_len} bytes, the limit is {MAX_NAME}"));
        }
        let mut at = 2 + name_len;
        if b.len() < at + 1 {
            self.want = at + 1;
            return Ok(None);
        }
        let dtype_len = b[at] as usize;
        if dtype_len > MAX_DTYPE_NAME {
            return Err(format!("tensor {index}: dtype name of {dtype_len} bytes"));
        }
        at += 1;
        if b.len() < at + dtype_len + 1 {
            self.want = at + dtype_len + 1;
            return Ok(None);
        }
        let dtype_at = at;
        at += dtype_len;
        let ndim = b[at] as usize;
        if ndim > MAX_NDIM {
            return Err(format!("tensor {index}: {ndim} dimensions, the limit is {MAX_NDIM}"));
        }
        at += 1;
        let total = at + 8 * ndim + 16;
        if b.len() < total {
            self.want = total;
            return Ok(None);
        }

        let name =
            std::str::from_utf8(&b[2..2 + name_len]).map_err(|_| format!("tensor {index}: name is not UTF-8"))?;
        let dtype_bytes = &b[dtype_at..dtype_at + dtype_len];
        let dtype = dtype_from_wire(dtype_bytes)
            .ok_or_else(|| format!("tensor '{name}': unknown dtype {:?}", String::from_utf8_lossy(dtype_bytes)))?;
        let shape: Vec<u64> = (0..ndim).map(|i| u64_at(b, at + 8 * i)).collect();
        at += 8 * ndim;
        let nbytes = u64_at(b, at);
        let offset = u64_at(b, at + 8);
        if !dtype.is_variable() && checked_nbytes(dtype, &shape) != Some(nbytes) {
            return Err(format!("tensor '{name}': {nbytes} bytes for {dtype} {shape:?}"));
        }
        if offset & (ALIGN - 1) != 0 {
            return Err(format!("tensor '{name}': offset {offset} is not a multiple of {ALIGN}"));
        }
        if offset < self.prev_end {
            return Err(format!(
                "tensor '{name}': offset {offset} overlaps the tensor before (ends at {})",
                self.prev_end
            ));
        }
        let end = match offset.checked_add(nbytes) {
            Some(end) if end <= self.payload_len => end,
            _ => {
                return Err(format!(
                    "tensor '{name}': {nbytes} bytes at {offset} do not fit a payload of {}",
                    self.payload_len
                ))
            }
        };
        self.prev_end = end;
        self.tensors.push(InTensor { name: name.to_owned(), dtype, shape, nbytes, offset });
        self.next_tensor();
        Ok(Some(total))
    }
}

/// Decode the header at the start of `buf`: `Ok(None)` if `buf` ends first.
pub fn decode_head(buf: &[u8], limits: &Limits) -> Result<Option<Head>, String> {
    let mut dec = HeadDecoder::new(*limits);
    dec.feed(buf)?;
    Ok(dec.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, dtype: DType, shape: Vec<u64>, fill: u8) -> OutTensor {
        let n = checked_nbytes(dtype, &shape).unwrap() as usize;
        OutTensor { name: name.into(), dtype, shape, data: Bytes::from(vec![fill; n]) }
    }

    fn flat(e: &Encoded) -> Vec<u8> {
        e.segments.iter().flat_map(|s| s.iter().copied()).collect()
    }

    #[test]
    fn round_trip_layout_and_merging() {
        let big = t("big", DType::Float32, vec![1024], 7);
        let big_ptr = big.data.as_ptr();
        let msg = Outgoing {
            kind: Kind::Call,
            id: 42,
            meta: b"{\"stage\":1}".to_vec(),
            tensors: vec![
                t("a", DType::Int64, vec![3], 1),
                t("b", DType::Uint8, vec![5], 2),
                big,
                t("c", DType::Float16, vec![2, 3], 3),
                t("d", DType::Bool, vec![0], 4),
                OutTensor {
                    name: "s".into(),
                    dtype: DType::Bytes,
                    shape: vec![1],
                    data: Bytes::from_static(b"\x02\0\0\0hi"),
                },
            ],
        };
        let e = encode(&msg, 1024, &Limits::default()).unwrap();
        // header+a+b | big | c+d+s
        assert_eq!(e.segments.len(), 3, "{:?}", e.segments.iter().map(|s| s.len()).collect::<Vec<_>>());
        assert_eq!(e.segments[1].as_ptr(), big_ptr, "the large tensor is its own memory, not a copy");
        assert_eq!(e.stats.merged_runs, 2);
        assert_eq!(e.stats.merged_tensors, 5);
        assert_eq!(e.stats.zero_copy_tensors, 1);
        assert_eq!(e.stats.copied_bytes, 24 + 5 + 12 + 6);
        let bytes = flat(&e);
        assert_eq!(e.stats.bytes, bytes.len() as u64);
        let head = decode_head(&bytes, &Limits::default()).unwrap().unwrap();
        assert_eq!((head.kind, head.id, &head.meta[..]), (Kind::Call, 42, &b"{\"stage\":1}"[..]));
        assert_eq!(head.head_len + head.payload_len, bytes.len() as u64);
        let payload = &bytes[head.head_len as usize..];
        for (got, want) in head.tensors.iter().zip(&msg.tensors) {
            assert_eq!(got.offset % ALIGN, 0);
            assert_eq!((&got.name, got.dtype, &got.shape), (&want.name, want.dtype, &want.shape));
            assert_eq!(&payload[got.range()], &want.data[..]);
        }
        // Padding is zero.
        assert!(payload[24..64].iter().all(|&b| b == 0));

        let plain = encode(&msg, 0, &Limits::default()).unwrap();
        assert_eq!(plain.stats.copied_bytes, 0);
        assert_eq!(plain.stats.merged_runs, 0);
        assert_eq!(plain.stats.zero_copy_tensors, 6);
        assert_eq!(flat(&plain), bytes, "merging changes the segments, not the bytes");
        assert!(plain.segments.iter().all(|s| !s.is_empty()));
    }

    #[test]
    fn every_dtype_round_trips() {
        let tensors: Vec<OutTensor> = ALL_DTYPES
            .iter()
            .map(|&d| {
                let n = if d.is_variable() { 6 } else { d.size() * 3 };
                OutTensor { name: d.name().into(), dtype: d, shape: vec![3], data: Bytes::from(vec![1; n]) }
            })
            .collect();
        let msg = Outgoing::reply(vec![], tensors);
        let head =
            decode_head(&flat(&encode(&msg, 0, &Limits::default()).unwrap()), &Limits::default()).unwrap().unwrap();
        let got: Vec<DType> = head.tensors.iter().map(|t| t.dtype).collect();
        assert_eq!(got, ALL_DTYPES);
        for d in ALL_DTYPES {
            assert_eq!(dtype_from_wire(d.name().as_bytes()), Some(d));
        }
        assert_eq!(dtype_from_wire(b"FP32"), None, "only the numpy spelling");
        let names: std::collections::HashSet<&str> = ALL_DTYPES.iter().map(|d| d.name()).collect();
        assert_eq!(names.len(), ALL_DTYPES.len());
        assert!(names.iter().all(|n| n.len() <= MAX_DTYPE_NAME));
    }

    #[test]
    fn incomplete_and_limits() {
        let msg = Outgoing::reply(vec![], vec![t("x", DType::Float64, vec![2], 9)]);
        let bytes = flat(&encode(&msg, 64, &Limits::default()).unwrap());
        let head_len = decode_head(&bytes, &Limits::default()).unwrap().unwrap().head_len as usize;
        for cut in 0..head_len {
            assert_eq!(decode_head(&bytes[..cut], &Limits::default()), Ok(None), "cut at {cut}");
        }
        assert!(decode_head(&bytes, &Limits { max_payload: 8 }).is_err());
        assert!(encode(&msg, 64, &Limits { max_payload: 8 }).is_err());
        let bad =
            Outgoing::reply(vec![], vec![OutTensor { data: Bytes::from_static(b"abc"), ..msg.tensors[0].clone() }]);
        assert!(encode(&bad, 64, &Limits::default()).is_err(), "data length must match dtype and shape");
        let e = encode_error(5, &"é".repeat(5000));
        let head = decode_head(&flat(&e), &Limits::default()).unwrap().unwrap();
        assert_eq!((head.kind, head.id, head.payload_len), (Kind::Error, 5, 0));
        assert!(std::str::from_utf8(&head.meta).is_ok() && head.meta.len() <= 4096);
    }

    #[test]
    fn hostile_sizes_are_refused_before_allocating() {
        let mut p = prefix(Kind::Call, 1, u32::MAX, 0, 0).to_vec();
        assert!(decode_head(&p, &Limits::default()).unwrap_err().contains("meta"));
        p = prefix(Kind::Call, 1, 0, u32::MAX, 0).to_vec();
        assert!(decode_head(&p, &Limits::default()).unwrap_err().contains("tensors"));
        p = prefix(Kind::Call, 1, 0, 0, u64::MAX).to_vec();
        assert!(decode_head(&p, &Limits::default()).unwrap_err().contains("payload"));
        // One tensor claiming u64::MAX bytes at an offset near the end.
        p = prefix(Kind::Call, 1, 0, 1, 1 << 20).to_vec();
        p.extend_from_slice(&1u16.to_le_bytes());
        p.push(b'x');
        p.push(5);
        p.extend_from_slice(b"bytes");
        p.push(0);
        p.extend_from_slice(&u64::MAX.to_le_bytes());
        p.extend_from_slice(&64u64.to_le_bytes());
        assert!(decode_head(&p, &Limits::default()).unwrap_err().contains("do not fit"));
    }
}
