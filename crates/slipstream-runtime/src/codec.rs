//! Tensors in and out of HTTP bodies.
//!
//! Two wire forms are spoken:
//! - the pipeline API (`/v1/pipelines/{name}/infer`): `{"inputs": {"x": [[3, 4]]}}`
//!   with nested JSON arrays whose nesting gives the shape, converted to the
//!   dtype the pipeline declares; answers `{"outputs": {"y": [[0.6, 0.8]]}}`;
//! - the Open Inference Protocol (KServe v2), JSON and its binary-tensor
//!   extension (`Inference-Header-Content-Length`), so that existing clients
//!   (tritonclient, KServe SDK) work unchanged.
//!
//! Decoding validates against the pipeline's declared inputs (missing,
//! extra, dtype, shape, rows) and writes each request's tensors into ONE
//! ingress block: the only payload write at ingress. Encoding reads straight
//! from the arena; binary v2 outputs are handed to the socket as `Bytes` that
//! borrow the arena block, so egress copies nothing.

use crate::arena::{Arena, CopyCounters, TensorRef, Tensors};
use crate::error::NodeError;
use bytes::Bytes;
use serde_json::{Map, Value};
use slipstream_types::{numel, DType, TensorSpec};
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
    pub fn new(parts: Vec<Bytes>) -> BodyParts {
        let len = parts.iter().map(|p| p.len()).sum();
        BodyParts { parts, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `[start, end)` as one slice: borrowed when they lie in one chunk,
    /// else joined (and counted as a `body_join` copy when `count` is set).
    fn contiguous(&self, start: usize, end: usize, arena: &Arena, count: bool) -> std::borrow::Cow<'_, [u8]> {
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

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
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
    /// Leaves of a (possibly nested) JSON array in row-major order.
    Json(&'a Value),
    /// Raw bytes `[at, at + len)` of the body (v2 binary extension); for
    /// variable-size dtypes already in the length-prefixed layout.
    Raw { at: usize, len: usize },
}

fn bad(msg: impl Into<String>) -> NodeError {
    NodeError::BadInput(msg.into())
}

/// Infer the shape of a nested JSON array; error if ragged.
fn json_shape(v: &Value, name: &str) -> Result<Vec<u64>, NodeError> {
    let mut shape = Vec::new();
    let mut cur = v;
    while let Value::Array(a) = cur {
        shape.push(a.len() as u64);
        match a.first() {
            Some(first) => cur = first,
            None => break,
        }
    }
    check_rectangular(v, &shape, name)?;
    Ok(shape)
}

fn check_rectangular(v: &Value, shape: &[u64], name: &str) -> Result<(), NodeError> {
    match (v, shape.split_first()) {
        (Value::Array(a), Some((&n, rest))) => {
            if a.len() as u64 != n {
                return Err(bad(format!("input '{name}' is ragged: rows of different lengths")));
            }
            a.iter().try_for_each(|x| check_rectangular(x, rest, name))
        }
        (Value::Array(_), None) => Err(bad(format!("input '{name}' is ragged: nesting depth varies"))),
        (_, Some(_)) => Err(bad(format!("input '{name}' is ragged: nesting depth varies"))),
        (_, None) => Ok(()),
    }
}

/// Visit the leaves of a nested array in row-major order.
fn for_each_leaf<'v>(v: &'v Value, f: &mut dyn FnMut(&'v Value) -> Result<(), NodeError>) -> Result<(), NodeError> {
    match v {
        Value::Array(a) => a.iter().try_for_each(|x| for_each_leaf(x, f)),
        leaf => f(leaf),
    }
}

/// Write one JSON number/bool as `dtype` into `out` (exactly `dtype.size()` bytes).
fn write_scalar(v: &Value, dtype: DType, out: &mut [u8], name: &str) -> Result<(), NodeError> {
    let wrong = || bad(format!("input '{name}' expects {dtype} values, got {v}"));
    macro_rules! int {
        ($t:ty) => {{
            let x: $t = if let Some(i) = v.as_i64() {
                <$t>::try_from(i).map_err(|_| wrong())?
            } else if let Some(u) = v.as_u64() {
                <$t>::try_from(u).map_err(|_| wrong())?
            } else {
                return Err(wrong());
            };
            out.copy_from_slice(&x.to_le_bytes());
        }};
    }
    match dtype {
        DType::Bool => out[0] = v.as_bool().ok_or_else(wrong)? as u8,
        DType::Float32 => out.copy_from_slice(&(v.as_f64().ok_or_else(wrong)? as f32).to_le_bytes()),
        DType::Float64 => out.copy_from_slice(&v.as_f64().ok_or_else(wrong)?.to_le_bytes()),
        DType::Float16 => out.copy_from_slice(&half::f16::from_f64(v.as_f64().ok_or_else(wrong)?).to_le_bytes()),
        DType::Uint8 => int!(u8),
        DType::Uint16 => int!(u16),
        DType::Uint32 => int!(u32),
        DType::Uint64 => int!(u64),
        DType::Int8 => int!(i8),
        DType::Int16 => int!(i16),
        DType::Int32 => int!(i32),
        DType::Int64 => int!(i64),
        DType::String | DType::Bytes => {
            unreachable!("variable-size elements are written by write_var")
        }
    }
    Ok(())
}

/// The bytes of one variable-size JSON element: (length, how to get them).
fn var_len(v: &Value, dtype: DType, base64_bytes: bool, name: &str) -> Result<usize, NodeError> {
    let s = v.as_str().ok_or_else(|| bad(format!("input '{name}' expects {dtype} values (JSON strings), got {v}")))?;
    if dtype == DType::Bytes && base64_bytes {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map(|b| b.len())
            .map_err(|e| bad(format!("input '{name}' expects base64 strings: {e}")))
    } else {
        Ok(s.len())
    }
}

/// Write one variable-size JSON element (length prefix + bytes) at `out`.
fn write_var(v: &Value, dtype: DType, base64_bytes: bool, out: &mut [u8]) -> usize {
    let s = v.as_str().expect("checked by var_len");
    let body = &mut out[4..];
    let n = if dtype == DType::Bytes && base64_bytes {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.decode_slice(s, body).expect("checked by var_len")
    } else {
        body[..s.len()].copy_from_slice(s.as_bytes());
        s.len()
    };
    out[..4].copy_from_slice(&(n as u32).to_le_bytes());
    4 + n
}

/// Bytes a parsed input takes in the arena.
fn stored_size(p: &Parsed<'_>, body: &BodyParts, arena: &Arena) -> Result<usize, NodeError> {
    match (&p.source, p.dtype.is_variable()) {
        (Source::Raw { len, .. }, false) => Ok(*len),
        (Source::Json(_), false) => Ok(numel(&p.shape) as usize * p.dtype.size()),
        (Source::Raw { at, len }, true) => {
            let raw = body.contiguous(*at, at + len, arena, false);
            let elems = slipstream_types::var::elements(&raw)
                .ok_or_else(|| bad(format!("input '{}': malformed BYTES data", p.name)))?;
            if elems.len() as u64 != numel(&p.shape) {
                return Err(bad(format!(
                    "input '{}' has {} elements but shape {:?} needs {}",
                    p.name,
                    elems.len(),
                    p.shape,
                    numel(&p.shape)
                )));
            }
            if p.dtype == DType::String && elems.iter().any(|e| std::str::from_utf8(e).is_err()) {
                return Err(bad(format!("input '{}' is a string tensor but holds invalid UTF-8", p.name)));
            }
            Ok(*len)
        }
        (Source::Json(v), true) => {
            let mut total = 0usize;
            for_each_leaf(v, &mut |leaf| {
                total += 4 + var_len(leaf, p.dtype, p.base64_bytes, &p.name)?;
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
        let r = p.shape[0];
        if r == 0 {
            return Err(bad(format!("input '{}' has no rows", p.name)));
        }
        match rows {
            None => rows = Some((r, p.name.clone())),
            Some((r0, ref n0)) if r0 != r => {
                return Err(bad(format!("inputs '{n0}' and '{}' have different row counts ({r0} and {r})", p.name)))
            }
            _ => {}
        }
    }
    parsed.sort_by(|a, b| a.name.cmp(&b.name));
    let sizes: Vec<usize> = parsed.iter().map(|p| stored_size(p, body, arena)).collect::<Result<_, _>>()?;
    let total: usize = sizes.iter().map(|&s| align(s)).sum();
    let block = arena.ingress_block(total)?;
    let buf = block.as_mut_slice();
    let mut at = 0usize;
    let mut out = Vec::with_capacity(parsed.len());
    for (p, &size) in parsed.into_iter().zip(&sizes) {
        let dst = &mut buf[at..at + size];
        match p.source {
            Source::Raw { at, .. } => body.copy_out(at, dst),
            Source::Json(v) if p.dtype.is_variable() => {
                let mut i = 0;
                for_each_leaf(v, &mut |leaf| {
                    i += write_var(leaf, p.dtype, p.base64_bytes, &mut dst[i..]);
                    Ok(())
                })?;
            }
            Source::Json(v) => {
                let w = p.dtype.size();
                let mut i = 0;
                for_each_leaf(v, &mut |leaf| {
                    write_scalar(leaf, p.dtype, &mut dst[i..i + w], &p.name)?;
                    i += w;
                    Ok(())
                })?;
            }
        }
        out.push((
            p.name,
            TensorRef {
                block: block.clone(),
                offset: block.offset() + at as u64,
                nbytes: size as u64,
                dtype: p.dtype,
                shape: p.shape,
            },
        ));
        at += align(size);
    }
    Ok(out)
}

fn parse_json(body: &[u8]) -> Result<Value, NodeError> {
    serde_json::from_slice(body).map_err(|e| NodeError::BadRequest(format!("body is not valid JSON: {e}")))
}

/// Decode a pipeline-API request body: `{"inputs": {"x": [[...]]}}`.
pub fn decode_v1(
    body: &BodyParts,
    declared: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
) -> Result<Tensors, NodeError> {
    let v = parse_json(&body.contiguous(0, body.len(), arena, true))?;
    let inputs = v
        .get("inputs")
        .and_then(Value::as_object)
        .ok_or_else(|| NodeError::BadRequest("body must be an object with an \"inputs\" object".into()))?;
    let mut parsed = Vec::with_capacity(inputs.len());
    for (name, val) in inputs {
        let Some(spec) = declared.get(name) else {
            parsed.push(Parsed {
                base64_bytes: true,
                name: name.clone(),
                dtype: DType::Float32,
                shape: vec![],
                source: Source::Json(val),
            });
            continue;
        };
        if !val.is_array() {
            return Err(bad(format!("input '{name}' must be a (nested) array")));
        }
        let shape = json_shape(val, name)?;
        parsed.push(Parsed {
            base64_bytes: true,
            name: name.clone(),
            dtype: spec.dtype,
            shape,
            source: Source::Json(val),
        });
    }
    validate_and_store(parsed, declared, arena, body)
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

/// What a v2 request asked of its outputs.
#[derive(Debug, Default)]
pub struct V2Request {
    pub id: Option<Value>,
    /// Names asked for, in order; empty means all.
    pub outputs: Vec<String>,
    /// Output names to be returned as binary (extension), or all if `binary_all`.
    pub binary: Vec<String>,
    pub binary_all: bool,
}

fn param_bool(v: &Value, key: &str) -> bool {
    v.get("parameters").and_then(|p| p.get(key)).and_then(Value::as_bool).unwrap_or(false)
}

/// Decode an Open Inference Protocol request (JSON, or JSON header plus
/// binary tensors when `header_len` is given).
pub fn decode_v2(
    body: &BodyParts,
    header_len: Option<usize>,
    declared: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
) -> Result<(Tensors, V2Request), NodeError> {
    let json_len = match header_len {
        Some(n) if n > body.len() => {
            return Err(NodeError::BadRequest(format!(
                "Inference-Header-Content-Length {n} exceeds the body ({} bytes)",
                body.len()
            )))
        }
        Some(n) => n,
        None => body.len(),
    };
    // The JSON header may be joined; tensor bytes never are: they are copied
    // from the body's chunks straight into the arena.
    let v = parse_json(&body.contiguous(0, json_len, arena, header_len.is_none()))?;
    let mut binary_at = json_len;
    let inputs = v
        .get("inputs")
        .and_then(Value::as_array)
        .ok_or_else(|| NodeError::BadRequest("body must have an \"inputs\" array".into()))?;
    let mut parsed = Vec::with_capacity(inputs.len());
    for inp in inputs {
        let name = inp.get("name").and_then(Value::as_str).ok_or_else(|| bad("every input needs a \"name\""))?;
        let dt = inp
            .get("datatype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("input '{name}' needs a \"datatype\"")))?;
        let dtype = DType::from_v2(dt).ok_or_else(|| bad(format!("input '{name}': unsupported datatype '{dt}'")))?;
        let shape: Vec<u64> = inp
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| bad(format!("input '{name}' needs a \"shape\" of non-negative integers")))?;
        let n = numel(&shape);
        let binary_size = inp.get("parameters").and_then(|p| p.get("binary_data_size")).and_then(Value::as_u64);
        let source = if let Some(size) = binary_size {
            let want = n * dtype.size() as u64;
            if !dtype.is_variable() && size != want {
                return Err(bad(format!(
                    "input '{name}': binary_data_size {size} does not match shape {shape:?} of {dt} ({want} bytes)"
                )));
            }
            if binary_at + size as usize > body.len() {
                return Err(bad(format!("input '{name}': binary data is shorter than binary_data_size")));
            }
            binary_at += size as usize;
            Source::Raw { at: binary_at - size as usize, len: size as usize }
        } else {
            let data = inp
                .get("data")
                .ok_or_else(|| bad(format!("input '{name}' has neither \"data\" nor binary_data_size")))?;
            let mut count = 0u64;
            for_each_leaf(data, &mut |_| {
                count += 1;
                Ok(())
            })?;
            if count != n {
                return Err(bad(format!("input '{name}' has {count} values but shape {shape:?} needs {n}")));
            }
            Source::Json(data)
        };
        parsed.push(Parsed { base64_bytes: false, name: name.to_string(), dtype, shape, source });
    }
    if binary_at != body.len() {
        return Err(bad(format!("{} bytes of binary data belong to no input", body.len() - binary_at)));
    }
    let mut req =
        V2Request { id: v.get("id").cloned(), binary_all: param_bool(&v, "binary_data_output"), ..Default::default() };
    if let Some(outs) = v.get("outputs").and_then(Value::as_array) {
        for o in outs {
            let name =
                o.get("name").and_then(Value::as_str).ok_or_else(|| bad("every requested output needs a \"name\""))?;
            req.outputs.push(name.to_string());
            if param_bool(o, "binary_data") {
                req.binary.push(name.to_string());
            }
        }
    }
    let tensors = validate_and_store(parsed, declared, arena, body)?;
    Ok((tensors, req))
}

/// Append the elements of `t` as JSON numbers, nested by its shape.
fn write_json_tensor(out: &mut Vec<u8>, t: &TensorRef, nested: bool) {
    let bytes = t.bytes();
    let w = t.dtype.size();
    let elems: Vec<&[u8]> = if t.dtype.is_variable() {
        // Validated when the tensor entered the node (ingress or worker reply).
        slipstream_types::var::elements(bytes).unwrap_or_default()
    } else {
        bytes.chunks_exact(w).collect()
    };
    let mut fbuf = ryu::Buffer::new();
    let mut ibuf = itoa::Buffer::new();
    let mut write_elem = |out: &mut Vec<u8>, e: &[u8]| {
        macro_rules! int {
            ($t:ty) => {
                out.extend_from_slice(ibuf.format(<$t>::from_le_bytes(e.try_into().unwrap())).as_bytes())
            };
        }
        let mut float = |out: &mut Vec<u8>, x: f64, single: bool| {
            if x.is_finite() {
                let s = if single { fbuf.format_finite(x as f32) } else { fbuf.format_finite(x) };
                out.extend_from_slice(s.as_bytes())
            } else {
                out.extend_from_slice(b"null")
            }
        };
        match t.dtype {
            DType::Bool => out.extend_from_slice(if e[0] != 0 { b"true" } else { b"false" }),
            DType::Float32 => float(out, f32::from_le_bytes(e.try_into().unwrap()) as f64, true),
            DType::Float64 => float(out, f64::from_le_bytes(e.try_into().unwrap()), false),
            DType::Float16 => float(out, half::f16::from_le_bytes(e.try_into().unwrap()).to_f64(), true),
            DType::Uint8 => int!(u8),
            DType::Uint16 => int!(u16),
            DType::Uint32 => int!(u32),
            DType::Uint64 => int!(u64),
            DType::Int8 => int!(i8),
            DType::Int16 => int!(i16),
            DType::Int32 => int!(i32),
            DType::Int64 => int!(i64),
            DType::String => serde_json::to_writer(&mut *out, &String::from_utf8_lossy(e)).expect("string serialises"),
            DType::Bytes => {
                use base64::Engine;
                out.push(b'"');
                out.extend_from_slice(base64::engine::general_purpose::STANDARD.encode(e).as_bytes());
                out.push(b'"');
            }
        }
    };
    let shape: &[u64] = if nested { &t.shape } else { &[] };
    let n = numel(&t.shape) as usize;
    if shape.is_empty() {
        out.push(b'[');
        for (i, e) in elems.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_elem(out, e);
        }
        out.push(b']');
        return;
    }
    // Nested: open/close brackets at dimension boundaries.
    let strides: Vec<usize> = (0..shape.len()).map(|d| shape[d + 1..].iter().product::<u64>() as usize).collect();
    for _ in 0..shape.len() {
        out.push(b'[');
    }
    for (i, e) in elems.iter().enumerate().take(n) {
        if i > 0 {
            let closes = strides.iter().filter(|&&s| s > 0 && i % s == 0).count() - 1;
            for _ in 0..closes {
                out.push(b']');
            }
            out.push(b',');
            for _ in 0..closes {
                out.push(b'[');
            }
        }
        write_elem(out, e);
    }
    for _ in 0..shape.len() {
        out.push(b']');
    }
}

/// `{"outputs": {"y": [[...]]}}`
pub fn encode_v1(outputs: &Tensors) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + outputs.iter().map(|(_, t)| t.nbytes as usize * 3).sum::<usize>());
    out.extend_from_slice(b"{\"outputs\":{");
    for (i, (name, t)) in outputs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, name).expect("string serialises");
        out.push(b':');
        write_json_tensor(&mut out, t, true);
    }
    out.extend_from_slice(b"}}");
    out
}

/// An arena slice that outlives the request: lets egress hand tensor bytes
/// to the socket without copying them.
struct ArenaBytes(TensorRef);

impl AsRef<[u8]> for ArenaBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Encoded v2 response: body chunks, and the JSON header length when the
/// binary extension is used.
pub struct V2Response {
    pub chunks: Vec<Bytes>,
    pub header_len: Option<usize>,
}

pub fn encode_v2(model: &str, req: &V2Request, outputs: &Tensors) -> Result<V2Response, NodeError> {
    let selected: Vec<&(String, TensorRef)> = if req.outputs.is_empty() {
        outputs.iter().collect()
    } else {
        req.outputs
            .iter()
            .map(|n| {
                outputs.iter().find(|(k, _)| k == n).ok_or_else(|| {
                    let known: Vec<&str> = outputs.iter().map(|(k, _)| k.as_str()).collect();
                    bad(format!("unknown output '{n}' requested (outputs: {})", known.join(", ")))
                })
            })
            .collect::<Result<_, _>>()?
    };
    let mut head = Map::new();
    head.insert("model_name".into(), Value::String(model.into()));
    head.insert("model_version".into(), Value::String("1".into()));
    if let Some(id) = &req.id {
        head.insert("id".into(), id.clone());
    }
    let mut json = serde_json::to_vec(&Value::Object(head)).expect("serialises");
    json.pop(); // reopen the object to append "outputs" without a Value per element
    json.extend_from_slice(b",\"outputs\":[");
    let mut blobs = Vec::new();
    for (i, (name, t)) in selected.into_iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        json.extend_from_slice(b"{\"name\":");
        serde_json::to_writer(&mut json, name).expect("serialises");
        json.extend_from_slice(
            format!(",\"datatype\":\"{}\",\"shape\":{:?}", t.dtype.v2_name(), t.shape).replace(' ', "").as_bytes(),
        );
        if req.binary_all || req.binary.iter().any(|b| b == name) {
            json.extend_from_slice(format!(",\"parameters\":{{\"binary_data_size\":{}}}}}", t.nbytes).as_bytes());
            blobs.push(Bytes::from_owner(ArenaBytes(t.clone())));
        } else {
            json.extend_from_slice(b",\"data\":");
            write_json_tensor(&mut json, t, false);
            json.push(b'}');
        }
    }
    json.extend_from_slice(b"]}");
    let header_len = (!blobs.is_empty()).then_some(json.len());
    let mut chunks = vec![Bytes::from(json)];
    chunks.extend(blobs);
    Ok(V2Response { chunks, header_len })
}

/// The v2 metadata of one declared tensor.
pub fn v2_tensor_meta(name: &str, spec: &TensorSpec) -> Value {
    serde_json::json!({ "name": name, "datatype": spec.dtype.v2_name(), "shape": spec.shape })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena() -> (Arena, tempdir::Dir) {
        let dir = tempdir::Dir::new();
        (Arena::new(dir.0.clone(), 1 << 20).unwrap(), dir)
    }

    /// A throwaway directory removed on drop.
    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
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
    }

    fn declared(dtype: DType, shape: &[i64]) -> BTreeMap<String, TensorSpec> {
        BTreeMap::from([("x".to_string(), TensorSpec { dtype, shape: shape.to_vec() })])
    }

    fn body(parts: &[&[u8]]) -> BodyParts {
        BodyParts::new(parts.iter().map(|p| Bytes::copy_from_slice(p)).collect())
    }

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
    fn v1_decodes_converts_and_round_trips() {
        let (a, _d) = arena();
        let t =
            decode_v1(&body(&[br#"{"inputs": {"x": [[1, 2.5], [3, -4]]}}"#]), &declared(DType::Float32, &[-1, 2]), &a)
                .unwrap();
        assert_eq!(t[0].1.shape, vec![2, 2]);
        let json = String::from_utf8(encode_v1(&t)).unwrap();
        assert_eq!(json, r#"{"outputs":{"x":[[1.0,2.5],[3.0,-4.0]]}}"#);
        assert_eq!(a.copies.snapshot().ingress, 1);
    }

    #[test]
    fn v1_integer_range_and_type_errors() {
        let (a, _d) = arena();
        let d = declared(DType::Uint8, &[-1]);
        let e = decode_v1(&body(&[br#"{"inputs": {"x": [300]}}"#]), &d, &a).unwrap_err();
        assert!(e.to_string().contains("expects uint8"), "{e}");
        let e = decode_v1(&body(&[br#"{"inputs": {"x": [1.5]}}"#]), &d, &a).unwrap_err();
        assert_eq!(e.kind(), "bad_input");
        let ok = decode_v1(&body(&[br#"{"inputs": {"x": [0, 255]}}"#]), &d, &a).unwrap();
        assert_eq!(ok[0].1.bytes(), &[0u8, 255]);
    }

    #[test]
    fn v2_binary_input_split_across_chunks() {
        let (a, _d) = arena();
        let head = br#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}],"outputs":[{"name":"x","parameters":{"binary_data":true}}]}"#;
        let data: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        let b = body(&[head, &data[..3], &data[3..]]);
        let (t, req) = decode_v2(&b, Some(head.len()), &declared(DType::Float32, &[-1, 2]), &a).unwrap();
        assert_eq!(t[0].1.bytes(), &data[..]);
        assert_eq!(a.copies.snapshot().body_join, 0, "binary tensors are never joined");
        let resp = encode_v2("m", &req, &t).unwrap();
        assert_eq!(resp.chunks.len(), 2);
        assert_eq!(&resp.chunks[1][..], &data[..]);
        let meta: Value = serde_json::from_slice(&resp.chunks[0]).unwrap();
        assert_eq!(meta["outputs"][0]["parameters"]["binary_data_size"], 8);
        assert_eq!(resp.header_len, Some(resp.chunks[0].len()));
    }

    #[test]
    fn v2_rejects_leftover_or_short_binary() {
        let (a, _d) = arena();
        let head = br#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        let d = declared(DType::Float32, &[-1]);
        let short = body(&[head, &[0u8; 4]]);
        assert!(decode_v2(&short, Some(head.len()), &d, &a).unwrap_err().to_string().contains("shorter"));
        let long = body(&[head, &[0u8; 12]]);
        assert!(decode_v2(&long, Some(head.len()), &d, &a).unwrap_err().to_string().contains("belong to no input"));
    }

    #[test]
    fn nested_json_for_3d_tensor() {
        let (a, _d) = arena();
        let t = decode_v1(
            &body(&[br#"{"inputs": {"x": [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]}}"#]),
            &declared(DType::Int64, &[-1, 2, 2]),
            &a,
        )
        .unwrap();
        assert_eq!(String::from_utf8(encode_v1(&t)).unwrap(), r#"{"outputs":{"x":[[[1,2],[3,4]],[[5,6],[7,8]]]}}"#);
    }
}
