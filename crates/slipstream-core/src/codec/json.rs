//! JSON tensors: nested arrays in, nested arrays out.
//!
//! The nesting of a JSON array gives its shape; leaves are converted to the
//! declared dtype with range checks (an integer that does not fit is a bad
//! input, never a silent wrap). Variable-size elements (strings, bytes) are
//! written in the length-prefixed layout of [`slipstream_types::var`].
//! Recursion depth is bounded by the JSON parser's own nesting limit.
//!
//! Inputs of a fixed-size dtype are read by [`DenseSeed`] straight from the
//! JSON text into their bytes; the rest (strings, bytes, names the pipeline
//! does not take) go through a [`Value`].

use super::bad;
use crate::arena::TensorRef;
use crate::error::NodeError;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde_json::Value;
use slipstream_types::{numel, DType};
use std::fmt;

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
                return Err(bad(ragged_rows(name)));
            }
            a.iter().try_for_each(|x| check_rectangular(x, rest, name))
        }
        (Value::Array(_), None) | (_, Some(_)) => Err(bad(depth_varies(name))),
        (_, None) => Ok(()),
    }
}

// The messages of the checks below, one place for the tree path and the
// one-pass reader (a unit test holds the two to the same answers).

pub(super) fn not_an_array(name: &str) -> String {
    format!("input '{name}' must be a (nested) array")
}

fn ragged_rows(name: &str) -> String {
    format!("input '{name}' is ragged: rows of different lengths")
}

fn depth_varies(name: &str) -> String {
    format!("input '{name}' is ragged: nesting depth varies")
}

fn not_a_value(name: &str, dtype: DType, got: impl fmt::Display) -> String {
    format!("input '{name}' expects {dtype} values, got {got}")
}

/// A fixed-size-dtype input read straight from the JSON text: its shape and
/// its elements converted to the dtype, little-endian, row-major.
pub(super) struct Dense {
    pub(super) shape: Vec<u64>,
    pub(super) bytes: Vec<u8>,
}

/// Reads one input of a fixed-size dtype as it is parsed, with no [`Value`]
/// tree: a 224 x 224 RGB image as nested arrays is 150,528 leaves in 50,400
/// arrays, each of which a tree allocates, then walks twice (shape, then
/// leaves) and frees; that was most of the node's CPU for the multimodal
/// example (22 ms a request). The same checks as [`json_shape`] and
/// [`write_scalar`], in one pass. Its errors are serde custom errors whose
/// text starts with `input '` (the caller makes them 400 bad input).
pub(super) struct DenseSeed<'n> {
    pub(super) dtype: DType,
    pub(super) name: &'n str,
}

/// What one pass has learned: each depth's length (from the first array
/// seen at that depth; every other must match), the depth the numbers sit
/// at, and the bytes so far.
struct DenseState<'n> {
    dtype: DType,
    name: &'n str,
    dims: Vec<Option<u64>>,
    leaf_depth: Option<usize>,
    bytes: Vec<u8>,
}

impl DenseState<'_> {
    fn depth_varies<E: de::Error>(&self) -> E {
        E::custom(depth_varies(self.name))
    }

    /// One number or bool at `depth`, converted to the dtype.
    fn leaf<E: de::Error>(&mut self, depth: usize, x: Scalar) -> Result<(), E> {
        self.at_leaf_depth(depth)?;
        let at = self.bytes.len();
        self.bytes.resize(at + self.dtype.size(), 0);
        write_number(x, self.dtype, &mut self.bytes[at..])
            .ok_or_else(|| E::custom(not_a_value(self.name, self.dtype, x)))
    }

    /// Anything else where a number belongs (`what`: "a string", ...).
    fn not_a_number<E: de::Error>(&mut self, depth: usize, what: &str) -> Result<(), E> {
        self.at_leaf_depth(depth)?;
        Err(E::custom(not_a_value(self.name, self.dtype, what)))
    }

    /// Check that a leaf at `depth` sits where every other leaf does.
    fn at_leaf_depth<E: de::Error>(&mut self, depth: usize) -> Result<(), E> {
        if depth == 0 {
            return Err(E::custom(not_an_array(self.name)));
        }
        match self.leaf_depth {
            None if self.dims.get(depth).is_some_and(Option::is_some) => Err(self.depth_varies()),
            None => {
                self.leaf_depth = Some(depth);
                Ok(())
            }
            Some(d) if d != depth => Err(self.depth_varies()),
            Some(_) => Ok(()),
        }
    }

    /// An array of `n` elements ended at `depth`.
    fn array<E: de::Error>(&mut self, depth: usize, n: u64) -> Result<(), E> {
        if self.dims.len() <= depth {
            self.dims.resize(depth + 1, None);
        }
        match self.dims[depth] {
            None => self.dims[depth] = Some(n),
            Some(m) if m != n => return Err(E::custom(ragged_rows(self.name))),
            Some(_) => {}
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for DenseSeed<'_> {
    type Value = Dense;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Dense, D::Error> {
        let mut st =
            DenseState { dtype: self.dtype, name: self.name, dims: Vec::new(), leaf_depth: None, bytes: Vec::new() };
        d.deserialize_any(Level { st: &mut st, depth: 0 })?;
        // Every depth's first array set its length; an array in progress
        // cannot leave a gap, so all are known.
        let shape: Vec<u64> = st.dims.iter().map(|d| d.unwrap_or(0)).collect();
        if slipstream_types::checked_nbytes(self.dtype, &shape) != Some(st.bytes.len() as u64) {
            return Err(st.depth_varies()); // unreachable: every leaf sat at the one depth, every row matched
        }
        Ok(Dense { shape, bytes: st.bytes })
    }
}

/// The visitor at one nesting depth.
struct Level<'s, 'n> {
    st: &'s mut DenseState<'n>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Level<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Level<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} values", self.st.dtype)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if self.st.leaf_depth.is_some_and(|d| self.depth >= d) {
            return Err(self.st.depth_varies());
        }
        let mut n = 0u64;
        while seq.next_element_seed(Level { st: &mut *self.st, depth: self.depth + 1 })?.is_some() {
            n += 1;
        }
        self.st.array(self.depth, n)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.st.leaf(self.depth, Scalar::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.st.leaf(self.depth, Scalar::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.st.leaf(self.depth, Scalar::Uint(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.st.leaf(self.depth, Scalar::Float(v))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.st.not_a_number(self.depth, "a string")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.st.not_a_number(self.depth, "null")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.st.not_a_number(self.depth, "an object")
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

/// A JSON number or bool, as the parser read it.
#[derive(Clone, Copy)]
pub(super) enum Scalar {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Bool(b) => write!(f, "{b}"),
            Scalar::Int(i) => write!(f, "{i}"),
            Scalar::Uint(u) => write!(f, "{u}"),
            Scalar::Float(x) => write!(f, "{x}"),
        }
    }
}

/// Write one JSON number/bool as `dtype` into `out` (exactly `dtype.size()`
/// bytes); `None` when it is not a `dtype` value (a bool for a number or the
/// reverse, a fraction for an integer, an integer out of range).
fn write_number(x: Scalar, dtype: DType, out: &mut [u8]) -> Option<()> {
    macro_rules! int {
        ($t:ty) => {{
            let v: $t = match x {
                Scalar::Int(i) => <$t>::try_from(i).ok()?,
                Scalar::Uint(u) => <$t>::try_from(u).ok()?,
                _ => return None,
            };
            out.copy_from_slice(&v.to_le_bytes());
        }};
    }
    let float = || match x {
        Scalar::Int(i) => Some(i as f64),
        Scalar::Uint(u) => Some(u as f64),
        Scalar::Float(f) => Some(f),
        Scalar::Bool(_) => None,
    };
    match dtype {
        DType::Bool => match x {
            Scalar::Bool(b) => out[0] = b as u8,
            _ => return None,
        },
        DType::Float32 => out.copy_from_slice(&(float()? as f32).to_le_bytes()),
        DType::Float64 => out.copy_from_slice(&float()?.to_le_bytes()),
        DType::Float16 => out.copy_from_slice(&half::f16::from_f64(float()?).to_le_bytes()),
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
    Some(())
}

/// Write one JSON number/bool as `dtype` into `out` (exactly `dtype.size()` bytes).
pub(super) fn write_scalar(v: &Value, dtype: DType, out: &mut [u8], name: &str) -> Result<(), NodeError> {
    let x = match v {
        Value::Bool(b) => Some(Scalar::Bool(*b)),
        Value::Number(n) => {
            n.as_u64().map(Scalar::Uint).or(n.as_i64().map(Scalar::Int)).or(n.as_f64().map(Scalar::Float))
        }
        _ => None,
    };
    x.and_then(|x| write_number(x, dtype, out)).ok_or_else(|| bad(not_a_value(name, dtype, v)))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree path: `json_shape`, then `write_scalar` on each leaf.
    fn via_tree(text: &str, dtype: DType) -> Result<(Vec<u64>, Vec<u8>), String> {
        let v: Value = serde_json::from_str(text).unwrap();
        if !v.is_array() {
            return Err("input 'x' must be a (nested) array".into());
        }
        let shape = json_shape(&v, "x").map_err(|e| e.to_string())?;
        let mut bytes = Vec::new();
        for_each_leaf(&v, &mut |leaf| {
            let at = bytes.len();
            bytes.resize(at + dtype.size(), 0);
            write_scalar(leaf, dtype, &mut bytes[at..], "x")
        })
        .map_err(|e| e.to_string())?;
        Ok((shape, bytes))
    }

    fn via_seed(text: &str, dtype: DType) -> Result<(Vec<u64>, Vec<u8>), String> {
        let mut de = serde_json::Deserializer::from_str(text);
        DenseSeed { dtype, name: "x" }
            .deserialize(&mut de)
            .map(|d| (d.shape, d.bytes))
            .map_err(|e| e.to_string().split(" at line").next().unwrap().to_string())
    }

    #[test]
    fn the_one_pass_reader_agrees_with_the_tree() {
        let cases = [
            "[1, 2, 3]",
            "[[1, 2.5], [3, -4]]",
            "[[[1, 2], [3, 4]], [[5, 6], [7, 8]]]",
            "[]",
            "[[], []]",
            "[[[]], [[]]]",
            "[[1, 2], [3]]",
            "[[1], []]",
            "[[], [1]]",
            "[[], 1]",
            "[1, [2]]",
            "[[1, [2]]]",
            "[[[1]], 2]",
            "[[[], 1]]",
            "[[[1]], []]",
            "[300]",
            "[-1]",
            "[1.5]",
            "[true, false]",
            "[null]",
            "[\"a\"]",
            "[{}]",
            "[18446744073709551615]",
            "[-9223372036854775808]",
            "3",
        ];
        for dtype in [DType::Float32, DType::Float64, DType::Uint8, DType::Int64, DType::Uint64, DType::Bool] {
            for text in cases {
                let (tree, seed) = (via_tree(text, dtype), via_seed(text, dtype));
                match (&tree, &seed) {
                    (Ok(a), Ok(b)) => assert_eq!(a, b, "{text} as {dtype}"),
                    (Err(_), Err(e)) => assert!(e.starts_with("input 'x'"), "{text} as {dtype}: {e}"),
                    _ => panic!("{text} as {dtype}: tree {tree:?}, one pass {seed:?}"),
                }
            }
        }
        assert_eq!(via_seed("[[1], []]", DType::Uint8).unwrap_err(), "input 'x' is ragged: rows of different lengths");
        assert_eq!(via_seed("[[1], 2]", DType::Uint8).unwrap_err(), "input 'x' is ragged: nesting depth varies");
        assert_eq!(via_seed("[300]", DType::Uint8).unwrap_err(), "input 'x' expects uint8 values, got 300");
        assert_eq!(via_seed("[{}]", DType::Uint8).unwrap_err(), "input 'x' expects uint8 values, got an object");
    }
}
