//! The object store over HTTP: `/v1/store/...` (the contract is in
//! `docs/design/store.md`).
//!
//! Writes (put, delete, trigger) are authorised like the admin routes: the
//! node's token when it has one, and refused on a non-loopback listener
//! without one. Keys, selectors and sizes are checked before a byte is
//! written; a put is answered only once it is durable. Large values are
//! answered straight from their memory-mapped blob file (no copy into the
//! node's memory).

use crate::error::NodeError;
use crate::http::{authorise_admin, json_resp, read_chunks, Chunks, Resp};
use crate::node::Node;
use crate::triggers::Item;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};
use serde_json::json;
use slipstream_store::{check_key, check_prefix, Body, Select, Write, TENSORS_CONTENT_TYPE};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Longest `timeout_ms` a watch may ask for.
const MAX_WATCH_MS: u64 = 300_000;
/// Most keys one listing returns.
const MAX_LIST: usize = 100_000;

pub async fn route(node: &Arc<Node>, admin_open: bool, req: hyper::Request<Incoming>) -> Result<Resp, NodeError> {
    let path = req.uri().path().to_string();
    let query = parse_query(req.uri().query().unwrap_or(""))?;
    let method = req.method().clone();
    let rest = path.strip_prefix("/v1/store").unwrap_or("");
    let wrong = || NodeError::MethodNotAllowed(method.to_string());
    let (op, key) = match rest.trim_start_matches('/').split_once('/') {
        Some((op, k)) => (op.to_string(), Some(percent_decode(&format!("/{k}"))?)),
        None => (rest.trim_start_matches('/').to_string(), None),
    };
    match (op.as_str(), key) {
        ("objects", Some(key)) => match method {
            Method::GET => get(node, &key, &query),
            Method::PUT => {
                authorise_admin(node, admin_open, &req)?;
                put(node, key, &query, req).await
            }
            Method::DELETE => {
                authorise_admin(node, admin_open, &req)?;
                check_key(&key)?;
                let if_version = u64_param(&query, "if_version")?;
                let store = node.store.clone();
                let c = blocking(move || store.delete(&key, if_version)).await?;
                Ok(json_resp(200, &serde_json::to_value(&c).expect("serialises")))
            }
            _ => Err(wrong()),
        },
        ("versions", Some(key)) if method == Method::GET => {
            let versions = node.store.versions(&key)?;
            Ok(json_resp(200, &json!({"key": key, "versions": versions})))
        }
        ("trigger", Some(key)) if method == Method::POST => {
            authorise_admin(node, admin_open, &req)?;
            check_key(&key)?;
            let parts = read_chunks(req, node.store.options().max_value as usize).await?;
            let value: Bytes = parts.concat().into();
            let fired = node.triggers.offer(node, &Item { seq: 0, key, version: 0, op: "trigger", value: Some(value) });
            Ok(json_resp(202, &json!({"fired": fired})))
        }
        ("keys", None) if method == Method::GET => {
            let prefix = query.get("prefix").map_or("/", |s| s.as_str());
            let limit = u64_param(&query, "limit")?.map_or(1000, |n| n as usize);
            if limit == 0 || limit > MAX_LIST {
                return Err(NodeError::BadRequest(format!("limit must be in 1..={MAX_LIST}")));
            }
            let (keys, truncated) = node.store.keys(prefix, limit)?;
            Ok(json_resp(200, &json!({"keys": keys, "truncated": truncated})))
        }
        ("watch", None) if method == Method::GET => watch(node, &query).await,
        ("", None) if method == Method::GET => stats(node),
        ("objects" | "versions" | "trigger" | "keys" | "watch" | "", _) => Err(wrong()),
        _ => Err(NodeError::NotFound(format!("{method} {path}"))),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, slipstream_store::StoreError> + Send + 'static,
) -> Result<T, NodeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| NodeError::Internal(format!("store task: {e}")))?
        .map_err(Into::into)
}

fn select(query: &HashMap<String, String>) -> Result<Select, NodeError> {
    match (u64_param(query, "version")?, query.get("as_of")) {
        (Some(_), Some(_)) => Err(NodeError::BadRequest("give version or as_of, not both".into())),
        (Some(v), None) => Ok(Select::Version(v)),
        (None, Some(t)) => {
            let secs: f64 = t
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s < 1e11)
                .ok_or_else(|| NodeError::BadRequest(format!("as_of must be unix seconds, got {t:?}")))?;
            Ok(Select::AsOf((secs * 1e6) as u64))
        }
        (None, None) => Ok(Select::Latest),
    }
}

fn get(node: &Node, key: &str, query: &HashMap<String, String>) -> Result<Resp, NodeError> {
    let sel = select(query)?;
    if query.contains_key("meta") {
        let meta = node.store.meta(key, sel, true)?;
        return Ok(json_resp(200, &serde_json::to_value(&meta).expect("serialises")));
    }
    let (meta, body) = node.store.get(key, sel)?;
    let bytes = match body {
        Body::Inline(v) => Bytes::from(v),
        Body::Mapped(m) => Bytes::from_owner(m),
    };
    let mut r = Response::new(Chunks::new(vec![bytes]));
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_str(&meta.content_type).unwrap_or(HeaderValue::from_static("application/octet-stream")),
    );
    h.insert("x-slipstream-version", HeaderValue::from(meta.version));
    h.insert(
        "x-slipstream-timestamp",
        HeaderValue::from_str(&format!("{:.6}", meta.timestamp)).expect("a number is a valid header"),
    );
    Ok(r)
}

async fn put(
    node: &Arc<Node>,
    key: String,
    query: &HashMap<String, String>,
    req: hyper::Request<Incoming>,
) -> Result<Resp, NodeError> {
    check_key(&key)?;
    let if_version = u64_param(query, "if_version")?;
    let content_type = match req.headers().get(CONTENT_TYPE) {
        None => "application/octet-stream".to_string(),
        Some(v) => v
            .to_str()
            .ok()
            .filter(|s| s.len() <= 200)
            .ok_or_else(|| NodeError::BadRequest("Content-Type must be printable ASCII, at most 200 bytes".into()))?
            .to_string(),
    };
    let parts = read_chunks(req, node.store.options().max_value as usize).await?;
    // Media types compare without parameters and case-insensitively.
    let media = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if media == TENSORS_CONTENT_TYPE {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        slipstream_store::check_tensors_head(&head_bytes(&parts), total as u64)?;
    }
    let store = node.store.clone();
    let c = blocking(move || {
        let staged = store.stage(&parts)?;
        store.write(Write { key, value: Some(staged), content_type, if_version })
    })
    .await?;
    Ok(json_resp(201, &serde_json::to_value(&c).expect("serialises")))
}

/// The first bytes of a body, enough to hold a named-tensors header.
fn head_bytes(parts: &[Bytes]) -> Vec<u8> {
    let first: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).take(16).collect();
    let header = first.get(8..16).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let want = usize::try_from(header).unwrap_or(usize::MAX).saturating_add(16).min(64 << 20);
    parts.iter().flat_map(|p| p.iter().copied()).take(want).collect()
}

async fn watch(node: &Arc<Node>, query: &HashMap<String, String>) -> Result<Resp, NodeError> {
    let prefix = query.get("prefix").map_or("/", |s| s.as_str()).to_string();
    check_prefix(&prefix)?;
    let Some(since) = u64_param(query, "since")? else {
        return Ok(json_resp(200, &json!({"seq": node.store.seq(), "changes": []})));
    };
    let timeout = u64_param(query, "timeout_ms")?.unwrap_or(30_000);
    if timeout > MAX_WATCH_MS {
        return Err(NodeError::BadRequest(format!("timeout_ms must be at most {MAX_WATCH_MS}")));
    }
    let until = tokio::time::Instant::now() + Duration::from_millis(timeout);
    let mut changed = node.store.subscribe();
    let mut stop = node.supervisor.stop.clone();
    let mut draining = node.on_drain();
    let mut since = since;
    loop {
        changed.mark_unchanged();
        let (changes, seq) = node.store.changes(&prefix, since, 1000)?;
        if !changes.is_empty() || tokio::time::Instant::now() >= until || node.is_draining() {
            return Ok(json_resp(200, &json!({"seq": seq, "changes": changes})));
        }
        since = seq;
        tokio::select! {
            _ = changed.changed() => {}
            _ = tokio::time::sleep_until(until) => {}
            _ = stop.changed() => {}
            _ = draining.changed() => {}
        }
    }
}

fn stats(node: &Node) -> Result<Resp, NodeError> {
    let s = &node.store;
    let (keys, versions, bytes) = s.totals()?;
    let pools: Vec<_> = s
        .options()
        .pools
        .iter()
        .map(|p| {
            json!({"prefix": p.prefix, "keep_versions": p.keep_versions,
                   "keep_age_s": p.keep_age.map(|a| a.as_secs_f64()),
                   "affinity": p.affinity.as_ref().map(|r| r.as_str())})
        })
        .collect();
    let t = &node.triggers;
    let watching: Vec<_> =
        t.watched().into_iter().map(|(prefix, pipeline)| json!({"prefix": prefix, "pipeline": pipeline})).collect();
    use std::sync::atomic::Ordering::Relaxed;
    Ok(json_resp(
        200,
        &json!({"path": s.dir(), "keys": keys, "versions": versions, "bytes": bytes, "seq": s.seq(),
                "pools": pools,
                "triggers": {"watching": watching, "pending": t.pending(),
                             "fired": t.metrics.fired.load(Relaxed), "retried": t.metrics.retried.load(Relaxed),
                             "failed": t.metrics.failed.load(Relaxed)}}),
    ))
}

fn u64_param(query: &HashMap<String, String>, name: &str) -> Result<Option<u64>, NodeError> {
    query
        .get(name)
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| NodeError::BadRequest(format!("{name} must be a non-negative integer, got {v:?}")))
        })
        .transpose()
}

fn parse_query(q: &str) -> Result<HashMap<String, String>, NodeError> {
    let mut out = HashMap::new();
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(percent_decode(k)?, percent_decode(v)?);
    }
    Ok(out)
}

/// `%XX` escapes (and `+` in query values is left as is: keys may hold it).
fn percent_decode(s: &str) -> Result<String, NodeError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let byte = hex
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| NodeError::BadRequest(format!("bad %-escape in {s:?}")))?;
            out.push(byte);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| NodeError::BadRequest(format!("{s:?} is not UTF-8 once decoded")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding() {
        assert_eq!(percent_decode("/docs/a%20b").unwrap(), "/docs/a b");
        assert!(percent_decode("%zz").is_err());
        assert!(percent_decode("%ff").is_err());
        let q = parse_query("prefix=%2Fdocs%2F&limit=5&meta").unwrap();
        assert_eq!(q["prefix"], "/docs/");
        assert_eq!(q["limit"], "5");
        assert!(q.contains_key("meta"));
        assert!(u64_param(&q, "prefix").is_err());
        assert!(select(&parse_query("version=1&as_of=2").unwrap()).is_err());
        assert!(select(&parse_query("as_of=nan").unwrap()).is_err());
    }
}
