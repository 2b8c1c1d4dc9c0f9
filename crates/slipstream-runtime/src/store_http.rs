//! The object store over HTTP: `/v1/store/...` (the contract is in
//! `docs/design/store.md`).
//!
//! Writes (put, delete, trigger) are authorised like the admin routes: the
//! node's token when it has one, and refused on a non-loopback listener
//! without one. Keys under `/_slipstream/` are the node's own records
//! (failed triggers): clients read and delete them, never put them or fire
//! a trigger with them. Keys, selectors and sizes are checked before a byte is
//! written; a put is answered only once it is durable. Large values are
//! answered straight from their memory-mapped blob file (no copy into the
//! node's memory).

use crate::app::App;
use crate::query::{self, Query};
use crate::respond::{json_resp, read_chunks, Chunks, Resp};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};
use serde_json::json;
use slipstream_core::ext::{SharedStore, SharedWrite};
use slipstream_core::{Node, NodeError};
use slipstream_store::{
    check_client_write, check_key, check_prefix, Body, Select, StoreError, Write, RESERVED_PREFIX, TENSORS_CONTENT_TYPE,
};
use slipstream_triggers::Item;
use std::time::Duration;

/// Longest `timeout_ms` a watch may ask for.
const MAX_WATCH_MS: u64 = 300_000;
/// Most keys one listing returns.
const MAX_LIST: usize = 100_000;

/// Answer a `/v1/store/...` request.
pub(crate) async fn route(app: &App, admin_open: bool, req: hyper::Request<Incoming>) -> Result<Resp, NodeError> {
    let node = &app.node;
    let path = req.uri().path().to_string();
    let query = Query::parse(req.uri().query())?;
    let method = req.method().clone();
    let rest = path.strip_prefix("/v1/store").unwrap_or("");
    let wrong = || NodeError::MethodNotAllowed(method.to_string());
    let (op, key) = match rest.trim_start_matches('/').split_once('/') {
        Some((op, k)) => (op.to_string(), Some(query::path(&format!("/{k}"))?)),
        None => (rest.trim_start_matches('/').to_string(), None),
    };
    match (op.as_str(), key) {
        ("objects", Some(key)) => match method {
            Method::GET => get(node, &key, &query).await,
            Method::PUT => {
                app.authorise_admin(admin_open, &req)?;
                put(node, key, &query, req).await
            }
            Method::DELETE => {
                app.authorise_admin(admin_open, &req)?;
                check_key(&key)?;
                let if_version = query.u64("if_version")?;
                let c = match shared_for(node, &key) {
                    Some(shared) => {
                        let w = SharedWrite { key, value: None, content_type: String::new(), if_version };
                        shared.write(w).await?
                    }
                    None => {
                        let store = node.store().clone();
                        blocking(move || store.delete(&key, if_version)).await?
                    }
                };
                Ok(json_resp(200, &serde_json::to_value(&c).expect("serialises")))
            }
            _ => Err(wrong()),
        },
        ("versions", Some(key)) if method == Method::GET => {
            sync(node, &key, &query).await?;
            let versions = node.store().versions(&key)?;
            Ok(json_resp(200, &json!({"key": key, "versions": versions})))
        }
        ("trigger", Some(key)) if method == Method::POST => {
            app.authorise_admin(admin_open, &req)?;
            check_client_write(&key)?;
            let parts = read_chunks(req, node.store().options().max_value as usize).await?;
            let value: Bytes = parts.concat().into();
            let fired = app.triggers.offer(node, &Item { seq: 0, key, version: 0, op: "trigger", value: Some(value) });
            Ok(json_resp(202, &json!({"fired": fired})))
        }
        ("keys", None) if method == Method::GET => {
            let prefix = query.get("prefix").unwrap_or("/");
            let limit = query.u64("limit")?.map_or(1000, |n| n as usize);
            if limit == 0 || limit > MAX_LIST {
                return Err(NodeError::BadRequest(format!("limit must be in 1..={MAX_LIST}")));
            }
            let (keys, truncated) = node.store().keys(prefix, limit)?;
            Ok(json_resp(200, &json!({"keys": keys, "truncated": truncated})))
        }
        ("watch", None) if method == Method::GET => watch(node, &query).await,
        ("rollout", Some(key)) if method == Method::GET => rollout(node, key, &query).await,
        ("", None) if method == Method::GET => stats(app),
        ("objects" | "versions" | "trigger" | "keys" | "watch" | "rollout" | "", _) => Err(wrong()),
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

fn select(query: &Query) -> Result<Select, NodeError> {
    match (query.u64("version")?, query.get("as_of")) {
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

/// The cluster's shared store, for `key` (the node's reserved keys stay
/// its own).
fn shared_for<'a>(node: &'a Node, key: &str) -> Option<&'a std::sync::Arc<dyn SharedStore>> {
    node.shared_store().filter(|_| !key.starts_with(RESERVED_PREFIX))
}

/// In a cluster, bring this node's store up to the cluster's latest commit
/// of `key` first, unless the caller accepts a possibly stale answer
/// (`stale=1`: this node's own view, which follows the cluster within
/// milliseconds while it is connected). Ok(false): etcd could not be
/// asked, so the answer is this node's view and may be stale.
async fn sync(node: &Node, key: &str, query: &Query) -> Result<bool, NodeError> {
    match shared_for(node, key) {
        Some(shared) if !query.has("stale") => Ok(shared.sync(key).await?),
        _ => Ok(true),
    }
}

/// Mark an answer served from this node's view while etcd was unreachable.
fn mark_stale(mut r: Resp, current: bool) -> Resp {
    if !current {
        r.headers_mut().insert("x-slipstream-stale", HeaderValue::from_static("etcd unreachable from this node"));
    }
    r
}

async fn get(node: &Node, key: &str, query: &Query) -> Result<Resp, NodeError> {
    let sel = select(query)?;
    let current = sync(node, key, query).await?;
    if query.has("meta") {
        // The caller is about to map the blob file: it must be here.
        let k = key.to_string();
        let meta = node
            .read_store(key, move |s| {
                let m = s.meta(&k, sel, true)?;
                if m.local || m.deleted {
                    return Ok(m);
                }
                Err(StoreError::Elsewhere { key: m.key, version: m.version, digest: String::new(), holders: vec![] })
            })
            .await?;
        return Ok(mark_stale(json_resp(200, &serde_json::to_value(&meta).expect("serialises")), current));
    }
    let k = key.to_string();
    let (meta, body) = node.read_store(key, move |s| s.get(&k, sel)).await?;
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
    Ok(mark_stale(r, current))
}

async fn put(node: &Node, key: String, query: &Query, req: hyper::Request<Incoming>) -> Result<Resp, NodeError> {
    check_client_write(&key)?;
    let if_version = query.u64("if_version")?;
    let content_type = match req.headers().get(CONTENT_TYPE) {
        None => "application/octet-stream".to_string(),
        Some(v) => v
            .to_str()
            .ok()
            .filter(|s| s.len() <= 200)
            .ok_or_else(|| NodeError::BadRequest("Content-Type must be printable ASCII, at most 200 bytes".into()))?
            .to_string(),
    };
    let parts = read_chunks(req, node.store().options().max_value as usize).await?;
    // Media types compare without parameters and case-insensitively.
    let media = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if media == TENSORS_CONTENT_TYPE {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        slipstream_store::check_tensors_head(&head_bytes(&parts), total as u64)?;
    }
    let c = match shared_for(node, &key) {
        Some(shared) => shared.write(SharedWrite { key, value: Some(parts), content_type, if_version }).await?,
        None => {
            let store = node.store().clone();
            blocking(move || {
                let staged = store.stage(&parts)?;
                store.write(Write::put(key, staged, content_type, if_version))
            })
            .await?
        }
    };
    Ok(json_resp(201, &serde_json::to_value(&c).expect("serialises")))
}

/// The first bytes of a body, enough to hold a named-tensors header.
fn head_bytes(parts: &[Bytes]) -> Vec<u8> {
    let first: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).take(16).collect();
    let header = first.get(8..16).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let want = usize::try_from(header).unwrap_or(usize::MAX).saturating_add(16).min(64 << 20);
    parts.iter().flat_map(|p| p.iter().copied()).take(want).collect()
}

async fn watch(node: &Node, query: &Query) -> Result<Resp, NodeError> {
    let prefix = query.get("prefix").unwrap_or("/").to_string();
    check_prefix(&prefix)?;
    let Some(since) = query.u64("since")? else {
        return Ok(json_resp(200, &json!({"seq": node.store().seq(), "changes": []})));
    };
    let mut poll = LongPoll::new(node, query, 30_000)?;
    let mut since = since;
    loop {
        poll.mark();
        let (changes, seq) = node.store().changes(&prefix, since, 1000)?;
        if !changes.is_empty() || poll.over() {
            return Ok(json_resp(200, &json!({"seq": seq, "changes": changes})));
        }
        since = seq;
        poll.wait(None).await;
    }
}

/// A long poll's clock: answer once there is something to say, or when
/// `timeout_ms` passed, or when the node drains; between two looks, wait
/// for a change to the store (or the stop, or `tick`).
struct LongPoll<'a> {
    node: &'a Node,
    until: tokio::time::Instant,
    changed: tokio::sync::watch::Receiver<u64>,
    stop: tokio::sync::watch::Receiver<bool>,
    draining: tokio::sync::watch::Receiver<bool>,
}

impl<'a> LongPoll<'a> {
    fn new(node: &'a Node, query: &Query, default_ms: u64) -> Result<LongPoll<'a>, NodeError> {
        let timeout = query.u64("timeout_ms")?.unwrap_or(default_ms);
        if timeout > MAX_WATCH_MS {
            return Err(NodeError::BadRequest(format!("timeout_ms must be at most {MAX_WATCH_MS}")));
        }
        Ok(LongPoll {
            node,
            until: tokio::time::Instant::now() + Duration::from_millis(timeout),
            changed: node.store().subscribe(),
            stop: node.stop_signal(),
            draining: node.on_drain(),
        })
    }

    /// Before a look: a change from now on ends the next wait.
    fn mark(&mut self) {
        self.changed.mark_unchanged();
    }

    /// Time to answer whatever there is.
    fn over(&self) -> bool {
        tokio::time::Instant::now() >= self.until || self.node.is_draining()
    }

    async fn wait(&mut self, tick: Option<Duration>) {
        let tick = tick.map_or(self.until, |t| self.until.min(tokio::time::Instant::now() + t));
        tokio::select! {
            _ = self.changed.changed() => {}
            _ = tokio::time::sleep_until(tick) => {}
            _ = self.stop.changed() => {}
            _ = self.draining.changed() => {}
        }
    }
}

/// `GET /v1/store/rollout/<key>?version=N[&timeout_ms=T]`: a model
/// update's gate. Answers once every node placed to run a stage that needs
/// `key` holds version N (`"held_everywhere": true`), or when `timeout_ms`
/// passes (false, with the nodes still `waiting_for` it). On one machine
/// the node holds every version it has: the answer is at once.
async fn rollout(node: &Node, key: String, query: &Query) -> Result<Resp, NodeError> {
    check_key(&key)?;
    let version = query.u64("version")?.ok_or_else(|| NodeError::BadRequest("give ?version=N".into()))?;
    let mut poll = LongPoll::new(node, query, 0)?;
    loop {
        poll.mark();
        let (store, shared, k) = (node.store().clone(), shared_for(node, &key).cloned(), key.clone());
        let waiting = blocking(move || match shared {
            Some(shared) => shared.rollout_waits(&k, version),
            None => store.meta(&k, Select::Version(version), false).map(|_| Vec::new()),
        })
        .await?;
        if waiting.is_empty() || poll.over() {
            let body = json!({"key": key, "version": version, "held_everywhere": waiting.is_empty(),
                              "waiting_for": waiting});
            return Ok(json_resp(200, &body));
        }
        // A holder joins through the record this node applies (a store
        // change); membership and placement change without one.
        poll.wait(Some(Duration::from_millis(100))).await;
    }
}

fn stats(app: &App) -> Result<Resp, NodeError> {
    let s = app.node.store();
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
    Ok(json_resp(
        200,
        &json!({"path": s.dir(), "keys": keys, "versions": versions, "bytes": bytes, "seq": s.seq(),
                "pools": pools, "triggers": app.triggers.report()}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_are_checked() {
        assert!(select(&Query::parse(Some("version=1&as_of=2")).unwrap()).is_err());
        assert!(select(&Query::parse(Some("as_of=nan")).unwrap()).is_err());
        assert!(matches!(select(&Query::parse(Some("version=3")).unwrap()), Ok(Select::Version(3))));
        assert!(matches!(select(&Query::parse(None).unwrap()), Ok(Select::Latest)));
    }
}
