//! Vocabulary shared by every Slipstream crate: tensor element types, the
//! declared shape of a pipeline input, and the descriptor that names a tensor
//! living in a shared-memory pool.
//!
//! Nothing here does I/O. The descriptor is the only thing that crosses
//! between the node and its workers for a tensor; the payload itself stays
//! in shared memory (see `slipstream-shm`).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Element type of a tensor.
///
/// The canonical spelling is numpy's (`float32`), which is what workers see;
/// the Open Inference Protocol spelling (`FP32`) is accepted and produced at
/// the v2 edge through [`DType::v2_name`] and [`DType::from_v2`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Float16,
    Float32,
    Float64,
    /// UTF-8 text, one string per element (variable size).
    String,
    /// Raw bytes, one byte string per element (variable size).
    Bytes,
}

/// Every dtype, in a stable order.
pub const ALL_DTYPES: [DType; 14] = [
    DType::Bool,
    DType::Uint8,
    DType::Uint16,
    DType::Uint32,
    DType::Uint64,
    DType::Int8,
    DType::Int16,
    DType::Int32,
    DType::Int64,
    DType::Float16,
    DType::Float32,
    DType::Float64,
    DType::String,
    DType::Bytes,
];

impl DType {
    /// Bytes per element; 0 for the variable-size types (see [`var`]).
    pub fn size(self) -> usize {
        match self {
            DType::String | DType::Bytes => 0,
            DType::Bool | DType::Uint8 | DType::Int8 => 1,
            DType::Uint16 | DType::Int16 | DType::Float16 => 2,
            DType::Uint32 | DType::Int32 | DType::Float32 => 4,
            DType::Uint64 | DType::Int64 | DType::Float64 => 8,
        }
    }

    /// numpy spelling, e.g. `float32`.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::Uint8 => "uint8",
            DType::Uint16 => "uint16",
            DType::Uint32 => "uint32",
            DType::Uint64 => "uint64",
            DType::Int8 => "int8",
            DType::Int16 => "int16",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::Float16 => "float16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::String => "string",
            DType::Bytes => "bytes",
        }
    }

    /// Whether elements have a variable size (stored as [`var`] encodes them).
    pub fn is_variable(self) -> bool {
        matches!(self, DType::String | DType::Bytes)
    }

    /// Open Inference Protocol (KServe v2) spelling, e.g. `FP32`.
    pub fn v2_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::Uint8 => "UINT8",
            DType::Uint16 => "UINT16",
            DType::Uint32 => "UINT32",
            DType::Uint64 => "UINT64",
            DType::Int8 => "INT8",
            DType::Int16 => "INT16",
            DType::Int32 => "INT32",
            DType::Int64 => "INT64",
            DType::Float16 => "FP16",
            DType::Float32 => "FP32",
            DType::Float64 => "FP64",
            DType::String | DType::Bytes => "BYTES",
        }
    }

    /// Parse the Open Inference Protocol spelling (`BYTES` reads as [`DType::Bytes`]).
    pub fn from_v2(s: &str) -> Option<DType> {
        if s == "BYTES" {
            return Some(DType::Bytes);
        }
        ALL_DTYPES.into_iter().find(|d| d.v2_name() == s)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::Float16 | DType::Float32 | DType::Float64)
    }

    pub fn is_signed(self) -> bool {
        matches!(self, DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown dtype '{0}'")]
pub struct UnknownDType(pub String);

impl FromStr for DType {
    type Err = UnknownDType;
    /// Accepts numpy spellings (`float32`, also `f4`-free long names only)
    /// and Open Inference Protocol spellings (`FP32`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ALL_DTYPES
            .into_iter()
            .find(|d| d.name() == s)
            .or_else(|| DType::from_v2(s))
            .ok_or_else(|| UnknownDType(s.to_string()))
    }
}

/// The declared type and shape of a named tensor.
///
/// A dimension of `-1` accepts any length. By convention the first dimension
/// is the row dimension: a request may carry several rows, a batch is the
/// concatenation of its requests' rows, and a component returns outputs
/// whose first dimension equals the batch's total rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub dtype: DType,
    pub shape: Vec<i64>,
}

impl TensorSpec {
    /// Whether `shape` matches this spec (rank equal, fixed dims equal).
    pub fn accepts_shape(&self, shape: &[u64]) -> bool {
        self.shape.len() == shape.len()
            && self.shape.iter().zip(shape).all(|(&want, &got)| want < 0 || want as u64 == got)
    }

    pub fn shape_string(&self) -> String {
        let dims: Vec<String> =
            self.shape.iter().map(|d| if *d < 0 { "-1".to_string() } else { d.to_string() }).collect();
        format!("[{}]", dims.join(", "))
    }
}

/// Where a tensor's bytes live: a range of a shared-memory pool.
///
/// This is the whole of what crosses the node/worker boundary for a tensor.
/// Invariant: `nbytes == dtype.size() * product(shape)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub pool: u32,
    pub offset: u64,
    pub nbytes: u64,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

/// The layout of variable-size elements in memory and on the wire: each
/// element is a little-endian `u32` byte length followed by its bytes, with
/// no padding. This is the Open Inference Protocol's binary BYTES layout, so
/// binary v2 tensors are stored as they arrive.
pub mod var {
    /// Append one element.
    pub fn push(out: &mut Vec<u8>, elem: &[u8]) {
        out.extend_from_slice(&(elem.len() as u32).to_le_bytes());
        out.extend_from_slice(elem);
    }

    /// The elements of `buf`, or `None` if it is not a whole number of them.
    pub fn elements(buf: &[u8]) -> Option<Vec<&[u8]>> {
        let mut out = Vec::new();
        let mut at = 0usize;
        while at < buf.len() {
            let len = u32::from_le_bytes(buf.get(at..at + 4)?.try_into().ok()?) as usize;
            out.push(buf.get(at + 4..at + 4 + len)?);
            at += 4 + len;
        }
        Some(out)
    }

    /// Walk the elements of `buf` without collecting them: `Some(count)` if
    /// it is a whole number of elements and `keep` accepted every one,
    /// `None` otherwise. Memory use does not grow with the element count.
    pub fn scan(buf: &[u8], mut keep: impl FnMut(&[u8]) -> bool) -> Option<u64> {
        let (mut at, mut count) = (0usize, 0u64);
        while at < buf.len() {
            let len = u32::from_le_bytes(buf.get(at..at.checked_add(4)?)?.try_into().ok()?) as usize;
            let end = at.checked_add(4)?.checked_add(len)?;
            if !keep(buf.get(at + 4..end)?) {
                return None;
            }
            at = end;
            count += 1;
        }
        Some(count)
    }

    /// Byte offsets where each group of `per_group` elements starts, plus the
    /// end: `groups + 1` offsets. `None` if `buf` holds a different count.
    pub fn group_offsets(buf: &[u8], per_group: usize, groups: usize) -> Option<Vec<usize>> {
        let mut offsets = Vec::with_capacity(groups + 1);
        let mut at = 0usize;
        for _ in 0..groups {
            offsets.push(at);
            for _ in 0..per_group {
                let len = u32::from_le_bytes(buf.get(at..at + 4)?.try_into().ok()?) as usize;
                at = at.checked_add(4 + len)?;
                if at > buf.len() {
                    return None;
                }
            }
        }
        (at == buf.len()).then(|| {
            offsets.push(at);
            offsets
        })
    }
}

/// Number of elements of a shape (1 for a scalar). Only for shapes already
/// known to fit (see [`checked_numel`] for anything a client or a component
/// sized).
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Number of elements of a shape, or `None` if it overflows `u64`.
pub fn checked_numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// Bytes a fixed-size tensor of `dtype` and `shape` takes, or `None` if
/// that overflows `u64` (or `dtype` is variable-size).
pub fn checked_nbytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    if dtype.is_variable() {
        return None;
    }
    checked_numel(shape)?.checked_mul(dtype.size() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_spellings_round_trip() {
        for d in ALL_DTYPES {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            if d != DType::String {
                assert_eq!(d.v2_name().parse::<DType>().unwrap(), d);
            }
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
        }
        assert!("complex64".parse::<DType>().is_err());
    }

    #[test]
    fn variable_elements_round_trip_and_group() {
        let mut buf = Vec::new();
        for e in ["a", "", "xyz", "hello"] {
            var::push(&mut buf, e.as_bytes());
        }
        let els = var::elements(&buf).unwrap();
        assert_eq!(els, vec![&b"a"[..], b"", b"xyz", b"hello"]);
        assert_eq!(var::group_offsets(&buf, 2, 2).unwrap(), vec![0, 9, buf.len()]);
        assert!(var::group_offsets(&buf, 3, 2).is_none(), "4 elements are not 2 groups of 3");
        assert!(var::elements(&buf[..buf.len() - 1]).is_none(), "truncated");
        assert_eq!(var::scan(&buf, |_| true), Some(4));
        assert_eq!(var::scan(&buf, |e| !e.is_empty()), None, "rejected by the caller");
        assert_eq!(var::scan(&buf[..buf.len() - 1], |_| true), None);
        assert_eq!(var::scan(&[255, 255, 255, 255], |_| true), None, "a length past the end");
        assert_eq!(DType::from_v2("BYTES"), Some(DType::Bytes));
        assert_eq!(DType::String.v2_name(), "BYTES");
    }

    #[test]
    fn sizes_that_overflow_are_none() {
        assert_eq!(checked_numel(&[]), Some(1));
        assert_eq!(checked_numel(&[3, 4]), Some(12));
        assert_eq!(checked_numel(&[4611686018427387904, 4]), None, "2^62 * 4 wraps to 0 unchecked");
        assert_eq!(checked_nbytes(DType::Float32, &[2, 3]), Some(24));
        assert_eq!(checked_nbytes(DType::Float32, &[1 << 62]), None);
        assert_eq!(checked_nbytes(DType::Bytes, &[2]), None);
        assert_eq!(checked_numel(&[u64::MAX, 0]), Some(0));
    }

    #[test]
    fn spec_shape_matching() {
        let spec = TensorSpec { dtype: DType::Float32, shape: vec![-1, 2] };
        assert!(spec.accepts_shape(&[1, 2]));
        assert!(spec.accepts_shape(&[7, 2]));
        assert!(!spec.accepts_shape(&[1, 3]));
        assert!(!spec.accepts_shape(&[2]));
        assert_eq!(spec.shape_string(), "[-1, 2]");
    }
}
