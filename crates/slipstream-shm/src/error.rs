//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong when creating, mapping or addressing a pool.
///
/// Callers that need to report the failure across a process or language
/// boundary should use [`ShmError::kind`], whose strings are stable.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// Creating, sizing, opening, mapping or unlinking the backing file failed.
    #[error("shared-memory I/O error on {}: {source}", .path.display())]
    Io {
        /// The pool file involved.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },

    /// The file is not a pool this version understands (wrong magic or
    /// version, inconsistent layout, or shorter than its header says).
    #[error("bad shared-memory pool header: {0}")]
    BadHeader(String),

    /// No run of free pages large enough for the request exists.
    #[error("shared-memory arena full: requested {requested} bytes, capacity {capacity} bytes")]
    Full {
        /// Bytes asked for (before rounding up to pages).
        requested: usize,
        /// Total data capacity of the pool in bytes.
        capacity: usize,
    },

    /// A byte range does not lie inside the pool's data region (or, for
    /// whole-block operations such as [`crate::Block::adopt`], does not start
    /// on a page boundary of it).
    #[error("out of bounds: offset {offset} with length {len} is outside the data region of a {size}-byte pool")]
    OutOfBounds {
        /// Byte offset from the start of the mapping.
        offset: u64,
        /// Length of the range in bytes.
        len: usize,
        /// Length of the whole mapping in bytes.
        size: usize,
    },
}

impl ShmError {
    /// A short, stable, machine-readable name for the error variant:
    /// `"io"`, `"bad_header"`, `"arena_full"` or `"out_of_bounds"`.
    pub fn kind(&self) -> &'static str {
        match self {
            ShmError::Io { .. } => "io",
            ShmError::BadHeader(_) => "bad_header",
            ShmError::Full { .. } => "arena_full",
            ShmError::OutOfBounds { .. } => "out_of_bounds",
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ShmError::Io { path: path.into(), source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_stable() {
        let io = ShmError::io("/x", std::io::Error::other("boom"));
        assert_eq!(io.kind(), "io");
        assert!(io.to_string().contains("/x"));
        assert_eq!(ShmError::BadHeader("m".into()).kind(), "bad_header");
        let full = ShmError::Full { requested: 10, capacity: 5 };
        assert_eq!(full.kind(), "arena_full");
        assert!(full.to_string().contains("requested 10"));
        let oob = ShmError::OutOfBounds { offset: 1, len: 2, size: 3 };
        assert_eq!(oob.kind(), "out_of_bounds");
    }
}
