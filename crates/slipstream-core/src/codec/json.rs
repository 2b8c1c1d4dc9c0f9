//! JSON tensors: nested arrays in, nested arrays out.
//!
//! The nesting of a JSON array gives its shape; leaves are converted to the
//! declared dtype with range checks (an integer that does not fit is a bad
//! input, never a silent wrap). Variable-size elements (strings, bytes) are
//! written in the length-prefixed layout of [`slipstream_types::var`].
//! Recursion depth is bounded by the JSON parser's own nesting limit.

use super::bad;
use crate::arena::TensorRef;
use crate::error::NodeError;
use serde_json::Value;
use slipstream_types::{numel, DType};

/// Infer the shape of a nested JSON array; error if ragged.
pub(super) fn json_shape(v: &Value, name: &str) -> Result<Vec<u64>, NodeError> {
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
pub(super) fn for_each_leaf<'v>(
    v: &'v Value,
    f: &mut dyn FnMut(&'v Value) -> Result<(), NodeError>,
) -> Result<(), NodeError> {
    match v {
        Value::Array(a) => a.iter().try_for_each(|x| for_each_leaf(x, f)),
        leaf => f(leaf),
    }
}

/// Write one JSON number/bool as `dtype` into `out` (exactly `dtype.size()` bytes).
pub(super) fn write_scalar(v: &Value, dtype: DType, out: &mut [u8], name: &str) -> Result<(), NodeError> {
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
pub(super) fn var_len(v: &Value, dtype: DType, base64_bytes: bool, name: &str) -> Result<usize, NodeError> {
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
pub(super) fn write_var(v: &Value, dtype: DType, base64_bytes: bool, out: &mut [u8]) -> usize {
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

/// Append the elements of `t` as JSON numbers, nested by its shape.
pub(super) fn write_json_tensor(out: &mut Vec<u8>, t: &TensorRef, nested: bool) {
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
