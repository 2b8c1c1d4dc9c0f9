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
}

const ALL: [DType; 12] = [
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
];

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
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
        }
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
        }
    }

    /// Parse the Open Inference Protocol spelling.
    pub fn from_v2(s: &str) -> Option<DType> {
        ALL.into_iter().find(|d| d.v2_name() == s)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::Float16 | DType::Float32 | DType::Float64)
    }

    pub fn is_signed(self) -> bool {
        matches!(
            self,
            DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64
        )
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
        ALL.into_iter()
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
            && self
                .shape
                .iter()
                .zip(shape)
                .all(|(&want, &got)| want < 0 || want as u64 == got)
    }

    pub fn shape_string(&self) -> String {
        let dims: Vec<String> = self
            .shape
            .iter()
            .map(|d| {
                if *d < 0 {
                    "-1".to_string()
                } else {
                    d.to_string()
                }
            })
            .collect();
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

/// Number of elements of a shape (1 for a scalar).
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_spellings_round_trip() {
        for d in ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(d.v2_name().parse::<DType>().unwrap(), d);
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
        }
        assert!("complex64".parse::<DType>().is_err());
    }

    #[test]
    fn spec_shape_matching() {
        let spec = TensorSpec {
            dtype: DType::Float32,
            shape: vec![-1, 2],
        };
        assert!(spec.accepts_shape(&[1, 2]));
        assert!(spec.accepts_shape(&[7, 2]));
        assert!(!spec.accepts_shape(&[1, 3]));
        assert!(!spec.accepts_shape(&[2]));
        assert_eq!(spec.shape_string(), "[-1, 2]");
    }
}
