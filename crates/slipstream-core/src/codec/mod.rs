//! Tensors in and out of HTTP bodies.
//!
//! Two wire forms are spoken:
//! - the pipeline API ([`v1`], `/v1/pipelines/{name}/infer`):
//!   `{"inputs": {"x": [[3, 4]]}}` with nested JSON arrays whose nesting
//!   gives the shape, converted to the dtype the pipeline declares; answers
//!   `{"outputs": {"y": [[0.6, 0.8]]}}`;
//! - the Open Inference Protocol ([`v2`], KServe v2), JSON and its
//!   binary-tensor extension (`Inference-Header-Content-Length`), so that
//!   existing clients (tritonclient, KServe SDK) work unchanged;
//! - the same protocol over gRPC ([`grpc`]: `ModelInferRequest` with typed
//!   or raw contents), sharing v2's per-input checks and the validator below.
//!
//! Decoding validates against the pipeline's declared inputs (missing,
//! extra, duplicate, dtype, shape, rows) and writes each request's tensors
//! into ONE ingress block: the only payload write at ingress. Encoding
//! reads straight from the arena; binary v2 outputs are handed to the socket
//! as `Bytes` that borrow the arena block, so egress copies nothing.
//!
//! Hostile input: every size a client states (shapes, element counts,
//! `binary_data_size`, header lengths) is checked arithmetic against what
//! the body really holds, so no stated size can wrap, allocate more than the
//! body justifies, or reach a worker with a tensor whose bytes do not match
//! its shape. Every failure is a 4xx [`NodeError`]; the fuzz test
//! (`tests/fuzz_codec.rs`) holds both decoders to that.

mod grpc;
mod json;
mod v1;
mod v2;

pub use grpc::{decode_grpc, encode_grpc, GrpcRequest};
pub use v1::{decode_v1, encode_v1};
pub use v2::{decode_v2, encode_v2, v2_tensor_meta, V2Request, V2Response};

use crate::arena::{Arena, CopyCounters, TensorRef, Tensors};
use crate::error::NodeError;
use bytes::Bytes;
use serde_json::Value;
use slipstream_types::{checked_nbytes, checked_numel, DType, TensorSpec};
use std::collections::BTreeMap;

const ALIGN: usize = 64;

/// A request body as hyper delivered it: one or more chunks, never joined
/// unless a contiguous view is needed (JSON text spanning chunks).
#[derive(Default)]
pub struct BodyParts {
    parts: Vec<Bytes>,
    len: usize,
}

impl BodyParts {
    /// A body of these chunks.
    pub fn new(parts: Vec<Bytes>) -> BodyParts {
        let len = parts.iter().map(|p| p.len()).sum();
        BodyParts { parts, len }
    }

    /// Its length, bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole body as one buffer (for small bodies: admin requests).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        self.copy_out(0, &mut out);
        out
    }

    /// Bytes `[start, end)` as one slice: borrowed when they lie in one chunk,
    /// else joined (and counted as a `body_join` copy when `count` is set).
    /// The caller guarantees `start <= end <= self.len()`.
    fn contiguous(&self, start: usize, end: usize, arena: &Arena, count: bool) -> std::borrow::Cow<'_, [u8]> {
        debug_assert!(start <= end && end <= self.len);
        let mut at = 0;
        for p in &self.parts {
            if start >= at && end <= at + p.len() {
                return std::borrow::Cow::Borrowed(&p[start - at..end - at]);
            }
            at += p.len();
        }
        let mut joined = vec![0u8; end - start];
        self.copy_out(start, &mut joined);
        if count {
            let c = &arena.copies;
            CopyCounters::add(&c.body_join, &c.body_join_bytes, joined.len() as u64);
        }
        std::borrow::Cow::Owned(joined)
    }

    /// Copy bytes starting at `start` into `dst` (straight from the chunks).
    fn copy_out(&self, start: usize, dst: &mut [u8]) {
        let (mut at, mut done) = (0usize, 0usize);
        for p in &self.parts {
            let (lo, hi) = (at, at + p.len());
            at = hi;
            let want_lo = start + done;
            if done == dst.len() {
                break;
            }
            if want_lo >= hi {
                continue;
            }
            let from = want_lo - lo;
            let n = (p.len() - from).min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&p[from..from + n]);
            done += n;
        }
    }
}

/// `n` rounded up to the tensor alignment, or `None` on overflow.
fn align(n: usize) -> Option<usize> {
    n.checked_next_multiple_of(ALIGN)
}

/// One input as parsed, before it is written to the arena.
struct Parsed<'a> {
    /// Bytes elements written as JSON strings are base64 (pipeline API) or
    /// the string's own bytes (v2 JSON, as the protocol specifies).
    base64_bytes: bool,
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    source: Source<'a>,
}

enum Source<'a> {
    /// Leaves of a (possibly nested) JSON array in row-major order; their
    /// count has been checked against the shape.
    Json(&'a Value),
    /// Elements already converted to the dtype (a fixed-size pipeline-API
    /// input read by `json::DenseSeed`); their count matches the shape.
    Dense(&'a [u8]),
    /// Raw bytes `[at, at + len)` of the body (v2 binary extension), within
    /// the body; for variable-size dtypes in the length-prefixed layout.
    Raw { at: usize, len: usize },
}

fn bad(msg: impl Into<String>) -> NodeError {
    NodeError::BadInput(msg.into())
}

fn too_large(name: &str, shape: &[u64]) -> NodeError {
    bad(format!("input '{name}': shape {shape:?} is larger than any request can hold"))
}

/// Bytes a parsed input takes in the arena.
fn stored_size(p: &Parsed<'_>, body: &BodyParts, arena: &Arena) -> Result<usize, NodeError> {
    match (&p.source, p.dtype.is_variable()) {
        (Source::Raw { len, .. }, false) => Ok(*len),
        (Source::Dense(b), false) => Ok(b.len()),
        (Source::Dense(_), true) => unreachable!("only fixed-size inputs are read dense"),
        (Source::Json(_), false) => checked_nbytes(p.dtype, &p.shape)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| too_large(&p.name, &p.shape)),
        (Source::Raw { at, len }, true) => {
            let raw = body.contiguous(*at, at + len, arena, false);
            let utf8 = p.dtype == DType::String;
            let elems = slipstream_types::var::scan(&raw, |e| !utf8 || std::str::from_utf8(e).is_ok());
            let want = checked_numel(&p.shape).ok_or_else(|| too_large(&p.name, &p.shape))?;
            match elems {
                None if utf8 && slipstream_types::var::scan(&raw, |_| true).is_some() => {
                    Err(bad(format!("input '{}' is a string tensor but holds invalid UTF-8", p.name)))
                }
                None => Err(bad(format!("input '{}': malformed BYTES data", p.name))),
                Some(n) if n != want => {
                    Err(bad(format!("input '{}' has {n} elements but shape {:?} needs {want}", p.name, p.shape)))
                }
                Some(_) => Ok(*len),
            }
        }
        (Source::Json(v), true) => {
            let mut total = 0usize;
            json::for_each_leaf(v, &mut |leaf| {
                total += 4 + json::var_len(leaf, p.dtype, p.base64_bytes, &p.name)?;
                Ok(())
            })?;
            Ok(total)
        }
    }
}

/// Check parsed inputs against the declared ones; write them into one block.
fn validate_and_store(
    mut parsed: Vec<Parsed<'_>>,
    declared: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
    body: &BodyParts,
) -> Result<Tensors, NodeError> {
    let missing: Vec<&str> =
        declared.keys().filter(|k| !parsed.iter().any(|p| &p.name == *k)).map(|s| s.as_str()).collect();
    if !missing.is_empty() {
        return Err(bad(format!("missing input(s): {}", missing.join(", "))));
    }
    let extra: Vec<&str> = parsed.iter().filter(|p| !declared.contains_key(&p.name)).map(|p| p.name.as_str()).collect();
    if !extra.is_empty() {
        let known: Vec<&str> = declared.keys().map(|s| s.as_str()).collect();
        return Err(bad(format!(
            "unexpected input(s): {} (this pipeline takes: {})",
            extra.join(", "),
            known.join(", ")
        )));
    }
    parsed.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = parsed.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(bad(format!("input '{}' is given more than once", w[0].name)));
    }
    let mut rows = None;
    for p in &mut parsed {
        let spec = &declared[&p.name];
        if p.dtype == DType::Bytes && spec.dtype.is_variable() {
            p.dtype = spec.dtype; // v2 says BYTES for both string and bytes tensors
        }
        if p.dtype != spec.dtype {
            return Err(bad(format!(
                "input '{}' must be {} ({}), got {}",
                p.name,
                spec.dtype,
                spec.dtype.v2_name(),
                p.dtype.v2_name()
            )));
        }
        if !spec.accepts_shape(&p.shape) {
            return Err(bad(format!("input '{}' must have shape {}, got {:?}", p.name, spec.shape_string(), p.shape)));
        }
        let r = match p.shape.first() {
            Some(&r) if r > 0 => r,
            _ => return Err(bad(format!("input '{}' has no rows", p.name))),
        };
        match rows {
            None => rows = Some((r, p.name.clone())),
            Some((r0, ref n0)) if r0 != r => {
                return Err(bad(format!("inputs '{n0}' and '{}' have different row counts ({r0} and {r})", p.name)))
            }
            _ => {}
        }
    }
    let sizes: Vec<usize> = parsed.iter().map(|p| stored_size(p, body, arena)).collect::<Result<_, _>>()?;
    let total = sizes
        .iter()
        .try_fold(0usize, |acc, &s| acc.checked_add(align(s)?))
        .ok_or_else(|| bad("the request's tensors are larger than any request can hold"))?;
    let mut block = arena.ingress_block(total)?;
    let buf = block.as_mut_slice();
    let mut at = 0usize;
    let mut placed = Vec::with_capacity(parsed.len());
    for (p, &size) in parsed.into_iter().zip(&sizes) {
        let dst = &mut buf[at..at + size];
        match p.source {
            Source::Raw { at, .. } => body.copy_out(at, dst),
            Source::Dense(b) => dst.copy_from_slice(b),
            Source::Json(v) if p.dtype.is_variable() => {
                let mut i = 0;
                json::for_each_leaf(v, &mut |leaf| {
                    i += json::write_var(leaf, p.dtype, p.base64_bytes, &mut dst[i..]);
                    Ok(())
                })?;
            }
            Source::Json(v) => {
                let w = p.dtype.size();
                let mut i = 0;
                json::for_each_leaf(v, &mut |leaf| {
                    json::write_scalar(leaf, p.dtype, &mut dst[i..i + w], &p.name)?;
                    i += w;
                    Ok(())
                })?;
            }
        }
        placed.push((p.name, at, size, p.dtype, p.shape));
        at += align(size).expect("checked in the total");
    }
    let block = std::sync::Arc::new(block.freeze());
    Ok(placed
        .into_iter()
        .map(|(name, at, size, dtype, shape)| {
            let offset = block.offset() + at as u64;
            (name, TensorRef { block: block.clone(), offset, nbytes: size as u64, dtype, shape })
        })
        .collect())
}

fn parse_json(body: &[u8]) -> Result<Value, NodeError> {
    serde_json::from_slice(body).map_err(|e| NodeError::BadRequest(format!("body is not valid JSON: {e}")))
}

/// The declared fallback answer (one row per output name) repeated for a
/// request of `rows` rows, written into the arena like any output.
pub fn fallback_outputs(
    fallback: &Value,
    rows: u64,
    outputs: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
) -> Result<Tensors, NodeError> {
    let obj = fallback.as_object().ok_or_else(|| NodeError::Internal("fallback must be an object".into()))?;
    let repeated: serde_json::Map<String, Value> =
        obj.iter().map(|(k, row)| (k.clone(), Value::Array(vec![row.clone(); rows as usize]))).collect();
    let body = serde_json::to_vec(&serde_json::json!({ "inputs": repeated })).expect("serialises");
    decode_v1(&BodyParts::new(vec![Bytes::from(body)]), outputs, arena)
        .map_err(|e| NodeError::Internal(format!("the pipeline's fallback does not match its outputs: {e}")))
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;

    /// A throwaway directory removed on drop.
    pub(crate) struct Dir(pub(crate) std::path::PathBuf);
    impl Dir {
        pub(crate) fn new() -> Dir {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "ss-codec-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub(crate) fn arena() -> (Arena, Dir) {
        let dir = Dir::new();
        (Arena::new(dir.0.clone(), 1 << 20).unwrap(), dir)
    }

    pub(crate) fn declared(dtype: DType, shape: &[i64]) -> BTreeMap<String, TensorSpec> {
        BTreeMap::from([("x".to_string(), TensorSpec { dtype, shape: shape.to_vec() })])
    }

    pub(crate) fn body(parts: &[&[u8]]) -> BodyParts {
        BodyParts::new(parts.iter().map(|p| Bytes::copy_from_slice(p)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::*;

    #[test]
    fn body_parts_copy_across_chunks() {
        let (a, _d) = arena();
        let b = body(&[b"hello ", b"wor", b"ld"]);
        let mut out = [0u8; 7];
        b.copy_out(4, &mut out);
        assert_eq!(&out, b"o world");
        assert_eq!(&*b.contiguous(0, 5, &a, true), b"hello");
        assert_eq!(a.copies.snapshot().body_join, 0, "inside one chunk: borrowed");
        assert_eq!(&*b.contiguous(3, 9, &a, true), b"lo wor");
        assert_eq!(a.copies.snapshot().body_join, 1);
    }

    #[test]
    fn alignment_overflow_is_none() {
        assert_eq!(super::align(1), Some(64));
        assert_eq!(super::align(128), Some(128));
        assert_eq!(super::align(usize::MAX), None);
    }
}
