//! Validation of what clients send: keys and named-tensor values.
//!
//! Everything here runs before anything is written, so a bad key or a
//! malformed value is refused with a reason and leaves the store unchanged.
//! Sizes come from clients: all arithmetic on them is checked.

use crate::StoreError;
use slipstream_types::DType;
use std::collections::BTreeMap;

/// Longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// Content type of a named-tensors value (see `docs/design/store.md`).
pub const TENSORS_CONTENT_TYPE: &str = "application/x-slipstream-tensors";

/// Magic bytes that open a named-tensors value.
pub const TENSORS_MAGIC: &[u8; 4] = b"SSTN";

/// The node's own records (failed triggers and the like) live under this
/// prefix: clients may read and delete them, never write them.
pub const RESERVED_PREFIX: &str = "/_slipstream/";

/// A key a client may write (put, or fire a trigger with): a valid key
/// outside [`RESERVED_PREFIX`]. The node writes its own records with
/// [`crate::Store::put`] directly.
pub fn check_client_write(key: &str) -> Result<(), StoreError> {
    check_key(key)?;
    if format!("{key}/").starts_with(RESERVED_PREFIX) {
        return Err(StoreError::BadRequest(format!(
            "invalid key {key:?}: keys under {RESERVED_PREFIX} are the node's own records"
        )));
    }
    Ok(())
}

/// Keys are paths: `/`, then non-empty segments joined by `/`; no `.` or
/// `..` segment, no control characters, no trailing `/`.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    let bad = |why: &str| Err(StoreError::BadRequest(format!("invalid key {key:?}: {why}")));
    if key.len() > MAX_KEY_BYTES {
        return bad(&format!("longer than {MAX_KEY_BYTES} bytes"));
    }
    let Some(rest) = key.strip_prefix('/') else {
        return bad("a key starts with '/'");
    };
    if rest.is_empty() {
        return bad("a key names something below '/'");
    }
    if key.chars().any(|c| c.is_control()) {
        return bad("control characters are not allowed");
    }
    for seg in rest.split('/') {
        match seg {
            "" => return bad("empty segment (a doubled or trailing '/')"),
            "." | ".." => return bad("'.' and '..' segments are not allowed"),
            _ => {}
        }
    }
    Ok(())
}

/// A prefix to list or watch: `/` or a key-like path ending in `/`, or a
/// whole key (a watch on one key).
pub fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix == "/" {
        return Ok(());
    }
    check_key(prefix.strip_suffix('/').unwrap_or(prefix)).map_err(|_| {
        StoreError::BadRequest(format!(
            "invalid prefix {prefix:?}: a prefix is '/' or a key, with or without a trailing '/'"
        ))
    })
}

/// One tensor of a named-tensors value, as its header declares it.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct TensorEntry {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub nbytes: u64,
}

/// Check a named-tensors value: magic, format version, a JSON header that
/// fits, and every tensor inside the data with `nbytes = prod(shape) * itemsize`.
pub fn check_tensors(value: &[u8]) -> Result<BTreeMap<String, TensorEntry>, StoreError> {
    check_tensors_head(value, value.len() as u64)
}

/// [`check_tensors`] given the value's first bytes (at least its header)
/// and its total length.
pub fn check_tensors_head(value: &[u8], total: u64) -> Result<BTreeMap<String, TensorEntry>, StoreError> {
    let bad = |why: String| StoreError::BadRequest(format!("invalid named-tensors value: {why}"));
    if value.len() < 16 || &value[..4] != TENSORS_MAGIC {
        return Err(bad("it does not start with the SSTN header".into()));
    }
    let format = u32::from_le_bytes(value[4..8].try_into().expect("4 bytes"));
    if format != 1 {
        return Err(bad(format!("format version {format} is not 1")));
    }
    let header_len = u64::from_le_bytes(value[8..16].try_into().expect("8 bytes"));
    let header_end = usize::try_from(header_len)
        .ok()
        .and_then(|h| h.checked_add(16))
        .filter(|&e| e <= value.len())
        .ok_or_else(|| bad(format!("a header of {header_len} bytes does not fit in {total} bytes")))?;
    let header: BTreeMap<String, TensorEntry> =
        serde_json::from_slice(&value[16..header_end]).map_err(|e| bad(format!("header: {e}")))?;
    let data_start = header_end.next_multiple_of(64);
    let data_len = total.saturating_sub(data_start as u64);
    for (name, t) in &header {
        let dtype: DType =
            t.dtype.parse().map_err(|_| bad(format!("tensor {name:?} has unknown dtype {:?}", t.dtype)))?;
        if dtype.size() == 0 {
            return Err(bad(format!("tensor {name:?}: {} tensors cannot be stored as named tensors", t.dtype)));
        }
        let expect = t
            .shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor {name:?}: its shape overflows")))?;
        if expect != t.nbytes {
            return Err(bad(format!(
                "tensor {name:?}: shape {:?} of {} needs {expect} bytes, header says {}",
                t.shape, t.dtype, t.nbytes
            )));
        }
        if t.offset % 64 != 0 {
            return Err(bad(format!("tensor {name:?}: offset {} is not a multiple of 64", t.offset)));
        }
        let end = t.offset.checked_add(t.nbytes).ok_or_else(|| bad(format!("tensor {name:?}: offset overflows")))?;
        if end > data_len {
            return Err(bad(format!("tensor {name:?} ends at {end}, past the {data_len} bytes of data")));
        }
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for good in ["/a", "/models/minilm", "/docs/debian/xattr", "/a b/ü"] {
            check_key(good).unwrap();
        }
        for bad in ["", "/", "a", "/a/", "//a", "/a//b", "/./a", "/a/..", "/a\nb"] {
            assert!(check_key(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_key(&format!("/{}", "x".repeat(MAX_KEY_BYTES))).is_err());
        check_prefix("/").unwrap();
        check_prefix("/docs/").unwrap();
        check_prefix("/docs").unwrap();
        assert!(check_prefix("docs/").is_err());
    }

    fn tensors(header: &str, data: &[u8]) -> Vec<u8> {
        let mut v = b"SSTN".to_vec();
        v.extend(1u32.to_le_bytes());
        v.extend((header.len() as u64).to_le_bytes());
        v.extend(header.as_bytes());
        v.resize(v.len().next_multiple_of(64), 0);
        v.extend(data);
        v
    }

    #[test]
    fn named_tensors() {
        let ok = tensors(r#"{"x":{"dtype":"float32","shape":[2,2],"offset":0,"nbytes":16}}"#, &[0; 16]);
        assert_eq!(check_tensors(&ok).unwrap()["x"].nbytes, 16);
        let cases = [
            tensors(r#"{"x":{"dtype":"float32","shape":[2,2],"offset":0,"nbytes":12}}"#, &[0; 16]),
            tensors(r#"{"x":{"dtype":"float32","shape":[2,4],"offset":0,"nbytes":32}}"#, &[0; 16]),
            tensors(r#"{"x":{"dtype":"float32","shape":[2,2],"offset":8,"nbytes":16}}"#, &[0; 32]),
            tensors(r#"{"x":{"dtype":"float32","shape":[4611686018427387904,4],"offset":0,"nbytes":0}}"#, &[]),
            tensors(r#"{"x":{"dtype":"float32","shape":[1],"offset":18446744073709551552,"nbytes":4}}"#, &[]),
            tensors(r#"{"x":{"dtype":"nope","shape":[1],"offset":0,"nbytes":4}}"#, &[0; 4]),
            tensors(r#"{"x":{"dtype":"string","shape":[1],"offset":0,"nbytes":0}}"#, &[]),
            tensors("not json", &[]),
            b"SSTN\x01\0\0\0\xff\xff\xff\xff\xff\xff\xff\xff".to_vec(),
            b"nope".to_vec(),
        ];
        for c in cases {
            assert!(check_tensors(&c).is_err());
        }
    }

    /// Mutated named-tensors values and random keys: never a panic, and
    /// whatever is accepted keeps every tensor inside the value.
    #[test]
    fn mutations_never_panic_and_accepted_values_are_in_bounds() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        let header = r#"{"a":{"dtype":"float32","shape":[2,3],"offset":0,"nbytes":24},"b":{"dtype":"int64","shape":[4],"offset":64,"nbytes":32}}"#;
        let seed = tensors(header, &[1u8; 96]);
        let edges = [0u64, 1, 63, 64, 1 << 31, 1 << 62, u64::MAX, u64::MAX - 63];
        let mut accepted = 0;
        for _ in 0..50_000 {
            let mut v = seed.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % v.len();
                match next() % 5 {
                    0 => v[at] ^= 1 << (next() % 8),
                    1 => v.truncate(at),
                    2 if at + 8 <= v.len() => {
                        v[at..at + 8].copy_from_slice(&edges[(next() % 8) as usize].to_le_bytes())
                    }
                    3 => {
                        let alphabet = b"0123456789,:{}[]\"-";
                        v.insert(at, alphabet[(next() as usize) % alphabet.len()])
                    }
                    _ => v.extend(std::iter::repeat_n(0u8, (next() % 200) as usize)),
                }
                if v.is_empty() {
                    break;
                }
            }
            if let Ok(h) = check_tensors(&v) {
                accepted += 1;
                let header_len = u64::from_le_bytes(v[8..16].try_into().unwrap()) as usize;
                let data = (16 + header_len).next_multiple_of(64) as u64;
                for t in h.values() {
                    assert!(data + t.offset + t.nbytes <= v.len() as u64, "{t:?} outside a {}-byte value", v.len());
                }
            }
            let key: String =
                (0..next() % 12).map(|_| ['/', 'a', '.', ' ', '\n', 'é'][(next() % 6) as usize]).collect();
            if check_key(&key).is_ok() {
                assert!(key.starts_with('/') && !key.ends_with('/') && !key.contains("//") && !key.contains('\n'));
            }
        }
        assert!(accepted > 0, "some mutations keep the value valid");
    }
}
