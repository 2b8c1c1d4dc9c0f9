//! The one decoder of what clients put in a URL: query strings and path
//! segments, `%XX`-decoded to UTF-8 with a 400 for a malformed escape.
//!
//! `+` in a query means a space (the form encoding that browsers,
//! `urllib.parse.urlencode` and most clients produce; they send a literal
//! `+` as `%2B`); in a path it is a `+` (store keys may hold one). Every
//! route reads its parameters through [`Query`], so a value means the same
//! whichever route it is given to.

use slipstream_core::NodeError;
use std::collections::HashMap;

/// A decoded query string.
#[derive(Debug, Default)]
pub(crate) struct Query(HashMap<String, String>);

impl Query {
    /// Decode `raw` (the part after `?`). A key given twice keeps its last value.
    pub(crate) fn parse(raw: Option<&str>) -> Result<Query, NodeError> {
        let mut out = HashMap::new();
        for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            out.insert(decode(k, true)?, decode(v, true)?);
        }
        Ok(Query(out))
    }

    /// The value of `key`, if given.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Whether `key` was given (with or without a value).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// The value of `key` as a non-negative integer, if given.
    pub(crate) fn u64(&self, key: &str) -> Result<Option<u64>, NodeError> {
        self.get(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| NodeError::BadRequest(format!("{key} must be a non-negative integer, got {v:?}")))
            })
            .transpose()
    }
}

/// A path segment (or the rest of a path), decoded: `+` stays `+`.
pub(crate) fn path(s: &str) -> Result<String, NodeError> {
    decode(s, false)
}

fn decode(s: &str, plus_is_space: bool) -> Result<String, NodeError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
                let byte = hex
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| NodeError::BadRequest(format!("bad %-escape in {s:?}")))?;
                out.push(byte);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| NodeError::BadRequest(format!("{s:?} is not UTF-8 once decoded")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_escapes_and_plus_as_space() {
        let q = Query::parse(Some("prefix=%2Fdocs%2F&limit=5&meta&context=a+b%2Bc&x=1&x=2")).unwrap();
        assert_eq!(q.get("prefix"), Some("/docs/"));
        assert_eq!(q.u64("limit").unwrap(), Some(5));
        assert!(q.has("meta") && q.get("meta") == Some(""));
        assert_eq!(q.get("context"), Some("a b+c"));
        assert_eq!(q.get("x"), Some("2"));
        assert_eq!(q.get("since"), None);
        assert!(q.u64("prefix").is_err());
        assert!(Query::parse(None).unwrap().get("x").is_none());
    }

    #[test]
    fn paths_keep_plus_and_bad_escapes_are_refused() {
        assert_eq!(path("/docs/a%20b+c").unwrap(), "/docs/a b+c");
        for bad in ["%zz", "%ff", "50%", "%2"] {
            assert!(matches!(path(bad), Err(NodeError::BadRequest(_))), "{bad}");
            assert!(Query::parse(Some(&format!("k={bad}"))).is_err(), "{bad}");
        }
        assert!(matches!(Query::parse(Some("since=-1")).unwrap().u64("since"), Err(NodeError::BadRequest(_))));
    }
}
