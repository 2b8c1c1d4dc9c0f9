//! A small etcd v3 client: leases, keys, compare-and-swap, watches. The
//! control plane keeps its membership and placement here.
//!
//! It speaks etcd's JSON gateway (grpc-gateway: `POST /v3/kv/range` and so
//! on, HTTP/1.1, JSON bodies) rather than gRPC. The gRPC client (tonic and
//! the etcd protos) needs `protoc` at build time, which the machines we
//! build on lack; the gateway is part of every etcd server (3.4 here:
//! Debian's `etcd-server`), and the control plane's traffic (a few
//! keep-alives and puts a second, a handful of watches) is far too small
//! for JSON's cost to matter.
//!
//! On the wire (`wire.rs`): keys and values are base64, 64-bit integers are
//! JSON strings, fields at their zero value are left out; errors are a
//! non-2xx status with `{"error","message","code"}`, or inside a streamed
//! answer an `{"error":{...}}` line. Watches and keep-alives are gRPC
//! streams, which the gateway turns into a chunked answer of one JSON
//! object per line: a keep-alive is one request and its one answer; a watch
//! is an answer that never ends (see `watch.rs`).
//!
//! Endpoints (`transport.rs`): requests go to the endpoint that answered
//! last and move on to the next when it cannot be reached (or answers that
//! the cluster has no leader). A request that was sent and got no answer
//! is sent again elsewhere only if repeating it is harmless; a
//! compare-and-swap is not, and reports [`EtcdError::Unreachable`] saying
//! it may have been applied.

mod transport;
mod watch;
mod wire;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use transport::{Retry, Transport};
use wire::{b64, is_lease_not_found, prefix_range};

/// The largest answer (or watch line) buffered; beyond it a request fails
/// with [`EtcdError::Protocol`].
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The per-request time limit unless [`Etcd::with_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The events of a watch channel holds before the watch waits for its reader.
const WATCH_BUFFER: usize = 1024;

/// A client of one etcd cluster. Cheap to clone (clones share connections
/// and the endpoint in use).
#[derive(Clone)]
pub struct Etcd {
    transport: Arc<Transport>,
    timeout: Duration,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.transport.endpoints)
            .field("current", &self.current_endpoint())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// One key and its value, as etcd keeps them.
#[derive(Clone, Debug, PartialEq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision that created the key (since it last did not exist).
    pub create_revision: i64,
    /// The revision of its last change.
    pub mod_revision: i64,
    /// Changes since it was created (1 after the creating put).
    pub version: i64,
    /// The lease it is attached to, 0 if none.
    pub lease: i64,
}

/// What a watch reports, in revision order.
#[derive(Clone, Debug, PartialEq)]
pub enum WatchEvent {
    Put(Kv),
    Delete {
        key: String,
        mod_revision: i64,
    },
    /// The watch lost history (compaction) or reconnected after a gap it
    /// cannot fill: reload with [`Etcd::get_prefix`]. Events that follow may
    /// already be in the reload (their `mod_revision` is at most the
    /// reload's revision); applying them again is harmless.
    Resync,
}

#[derive(thiserror::Error, Debug)]
pub enum EtcdError {
    /// No endpoint answered: names them and the last error.
    #[error("etcd unreachable: {0}")]
    Unreachable(String),
    /// etcd refused the request: the HTTP status it gave the error and its
    /// message.
    #[error("etcd answered {status}: {message}")]
    Server { status: u16, message: String },
    /// An answer we cannot parse.
    #[error("etcd protocol: {0}")]
    Protocol(String),
    #[error("bad etcd URL: {0}")]
    BadUrl(String),
    /// The lease (its id) is gone: it expired or was revoked.
    #[error("etcd lease {0:x} has expired (or never existed)")]
    LeaseExpired(i64),
}

impl Etcd {
    /// `etcd://h1:p1,h2:p2` or `http://h:p` (comma-separated endpoints in
    /// both; each may repeat the scheme; the port defaults to 2379; IPv6
    /// hosts in brackets). Connects to nothing yet.
    pub fn new(url: &str) -> Result<Etcd, EtcdError> {
        Etcd::with_tls(url, None)
    }

    /// As [`Etcd::new`]; an `https://` (or `etcds://`) URL is spoken over
    /// TLS with `tls`'s CA and client certificate, and needs it. An
    /// `http://` URL stays plain whatever `tls` is.
    pub fn with_tls(url: &str, tls: Option<&slipstream_tls::NodeTls>) -> Result<Etcd, EtcdError> {
        let (endpoints, secure) = parse_url(url)?;
        let tls = match (secure, tls) {
            (false, _) => None,
            (true, Some(t)) => Some(t.etcd_connector()),
            (true, None) => {
                return Err(EtcdError::BadUrl(format!(
                    "{url:?}: TLS to etcd needs a CA and a client certificate (the node's --tls directory)"
                )))
            }
        };
        Ok(Etcd { transport: Arc::new(Transport::new(endpoints, tls)), timeout: DEFAULT_TIMEOUT })
    }

    /// The time limit of each request on each endpoint (default 2 s), so a
    /// call that tries every endpoint may take that many times as long. A
    /// watch uses it to connect; its stream has none.
    pub fn with_timeout(self, d: Duration) -> Etcd {
        Etcd { timeout: d, ..self }
    }

    /// The endpoints, as `host:port`.
    pub fn endpoints(&self) -> &[String] {
        &self.transport.endpoints
    }

    /// The endpoint requests go to first: the one that answered last.
    pub fn current_endpoint(&self) -> &str {
        &self.transport.endpoints[self.transport.preferred()]
    }

    async fn call<T: DeserializeOwned>(&self, path: &str, body: Value, retry: Retry) -> Result<T, EtcdError> {
        let (status, answer) = self.post(path, body, retry).await?;
        wire::decode(status, &answer)
    }

    async fn post(&self, path: &str, body: Value, retry: Retry) -> Result<(u16, Bytes), EtcdError> {
        self.transport.post(path, Bytes::from(body.to_string()), self.timeout, retry).await
    }

    /// A new lease of `ttl_s` seconds (etcd may raise it to its minimum);
    /// its id.
    pub async fn grant(&self, ttl_s: i64) -> Result<i64, EtcdError> {
        // Granted twice after a lost answer, the extra lease just expires.
        let r: wire::LeaseGrantResponse = self.call("/v3/lease/grant", json!({ "TTL": ttl_s }), Retry::Yes).await?;
        if !r.error.is_empty() {
            return Err(EtcdError::Server { status: 200, message: r.error });
        }
        if r.id == 0 {
            return Err(EtcdError::Protocol("a lease grant without a lease id".into()));
        }
        Ok(r.id)
    }

    /// One keep-alive; Ok(the seconds the lease has left); Err(LeaseExpired)
    /// when the lease is gone.
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        let (status, answer) = self.post("/v3/lease/keepalive", json!({ "ID": lease.to_string() }), Retry::Yes).await?;
        let r: wire::LeaseKeepAliveResponse = match wire::decode_first_line(status, &answer) {
            Err(e) if is_lease_not_found(&e) => return Err(EtcdError::LeaseExpired(lease)),
            r => r?,
        };
        if r.ttl <= 0 {
            return Err(EtcdError::LeaseExpired(lease));
        }
        Ok(r.ttl)
    }

    /// Ends a lease now, deleting its keys. A lease already gone is not an
    /// error.
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        match self.call::<wire::HeaderOnly>("/v3/lease/revoke", json!({ "ID": lease.to_string() }), Retry::Yes).await {
            Err(e) if is_lease_not_found(&e) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Sets `key` (attached to `lease` if given); the revision of the change.
    pub async fn put(&self, key: &str, value: &[u8], lease: Option<i64>) -> Result<i64, EtcdError> {
        let r: Result<wire::HeaderOnly, _> = self.call("/v3/kv/put", put_request(key, value, lease), Retry::Yes).await;
        match (r, lease) {
            (Err(e), Some(l)) if is_lease_not_found(&e) => Err(EtcdError::LeaseExpired(l)),
            (r, _) => Ok(r?.header.revision),
        }
    }

    pub async fn get(&self, key: &str) -> Result<Option<Kv>, EtcdError> {
        let r: wire::RangeResponse =
            self.call("/v3/kv/range", json!({ "key": b64(key.as_bytes()) }), Retry::Yes).await?;
        r.kvs.into_iter().next().map(wire::RawKv::into_kv).transpose()
    }

    /// Every key starting with `prefix` (in key order), and the revision
    /// they are as of: a watch from the revision after it misses nothing.
    pub async fn get_prefix(&self, prefix: &str) -> Result<(Vec<Kv>, i64), EtcdError> {
        let (key, end) = prefix_range(prefix);
        let body = json!({ "key": b64(&key), "range_end": b64(&end) });
        let r: wire::RangeResponse = self.call("/v3/kv/range", body, Retry::Yes).await?;
        let kvs = r.kvs.into_iter().map(wire::RawKv::into_kv).collect::<Result<Vec<_>, _>>()?;
        Ok((kvs, r.header.revision))
    }

    /// The current revision, read with a count over `[key, range_end)`.
    async fn revision_of_range(&self, key: &[u8], range_end: &[u8]) -> Result<i64, EtcdError> {
        let body = json!({ "key": b64(key), "range_end": b64(range_end), "count_only": true });
        let r: wire::RangeResponse = self.call("/v3/kv/range", body, Retry::Yes).await?;
        Ok(r.header.revision)
    }

    /// Deletes `key`; deleting a key that does not exist is not an error.
    pub async fn delete(&self, key: &str) -> Result<(), EtcdError> {
        let body = json!({ "key": b64(key.as_bytes()) });
        self.call::<wire::HeaderOnly>("/v3/kv/deleterange", body, Retry::Yes).await.map(|_| ())
    }

    /// Compare-and-swap: put only if the key's mod_revision is `expected` (0: the key must not exist).
    /// Ok(Ok(new revision)) on success; Ok(Err(current kv or None)) when the comparison failed.
    ///
    /// Never sent twice: when an endpoint takes the request and does not
    /// answer, this fails with [`EtcdError::Unreachable`] (the put may have
    /// happened; read the key to know).
    pub async fn put_if(
        &self,
        key: &str,
        value: &[u8],
        expected_mod_revision: i64,
        lease: Option<i64>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        self.txn_if(key, expected_mod_revision, &[(key, value)], &[], lease).await
    }

    /// One transaction: if `key`'s mod_revision is `expected` (0: the key
    /// must not exist), put every `(key, value)` of `puts` (attached to
    /// `lease` if given) and delete every key of `deletes`, atomically.
    /// Ok(Ok(revision)) on success; Ok(Err(`key`'s current kv or None))
    /// when the comparison failed. Never sent twice (see [`Etcd::put_if`]).
    pub async fn txn_if(
        &self,
        key: &str,
        expected_mod_revision: i64,
        puts: &[(&str, &[u8])],
        deletes: &[&str],
        lease: Option<i64>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        let k = b64(key.as_bytes());
        let mut success: Vec<Value> =
            puts.iter().map(|(pk, v)| json!({ "request_put": put_request(pk, v, lease) })).collect();
        success.extend(deletes.iter().map(|d| json!({ "request_delete_range": { "key": b64(d.as_bytes()) } })));
        let body = json!({
            "compare": [{
                "key": k,
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": expected_mod_revision.to_string(),
            }],
            "success": success,
            "failure": [{ "request_range": { "key": k } }],
        });
        let r: wire::TxnResponse = match (self.call("/v3/kv/txn", body, Retry::No).await, lease) {
            (Err(e), Some(l)) if is_lease_not_found(&e) => return Err(EtcdError::LeaseExpired(l)),
            (r, _) => r?,
        };
        if r.succeeded {
            return Ok(Ok(r.header.revision));
        }
        let current = r
            .responses
            .into_iter()
            .next()
            .and_then(|op| op.response_range)
            .ok_or_else(|| EtcdError::Protocol("a failed transaction without its range answer".into()))?
            .kvs
            .into_iter()
            .next()
            .map(wire::RawKv::into_kv)
            .transpose()?;
        Ok(Err(current))
    }

    /// Events for keys under `prefix` from `from_revision` (inclusive; 0 or
    /// less: from now) on, in order, delivered on the channel.
    ///
    /// A background task keeps the watch: on a broken connection it
    /// reconnects (trying each endpoint, backing off up to 1 s) from the
    /// revision after the last one it delivered, so no event is lost or
    /// repeated; on compaction it sends [`WatchEvent::Resync`] and continues
    /// from the current revision. It ends when the receiver is dropped.
    ///
    /// Must be called within a tokio runtime (the task is spawned on it).
    pub fn watch_prefix(&self, prefix: &str, from_revision: i64) -> tokio::sync::mpsc::Receiver<WatchEvent> {
        let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BUFFER);
        let watcher = watch::Watcher::new(self.clone(), prefix, tx);
        tokio::spawn(watcher.run(from_revision));
        rx
    }
}

fn put_request(key: &str, value: &[u8], lease: Option<i64>) -> Value {
    let mut put = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
    if let Some(l) = lease {
        put["lease"] = Value::String(l.to_string());
    }
    put
}

/// The endpoints of an `etcd://`, `http://`, `etcds://` or `https://` URL,
/// as `host:port`, and whether they speak TLS.
fn parse_url(url: &str) -> Result<(Vec<String>, bool), EtcdError> {
    let url = url.trim();
    let bad = |why: &str| Err(EtcdError::BadUrl(format!("{url:?}: {why}")));
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (s.to_ascii_lowercase(), r),
        None => return bad("expected etcd://host:port[,host:port...] or http://host:port[,...]"),
    };
    let secure = match scheme.as_str() {
        "etcd" | "http" => false,
        "https" | "etcds" => true,
        _ => return bad(&format!("unknown scheme {scheme:?}; expected etcd://, http://, etcds:// or https://")),
    };
    let mut endpoints = Vec::new();
    for item in rest.split(',') {
        let mut item = item.trim();
        if let Some((s, r)) = item.split_once("://") {
            if !s.eq_ignore_ascii_case(&scheme) {
                return bad(&format!("endpoint {item:?} has another scheme than {scheme}://"));
            }
            item = r;
        }
        let item = item.strip_suffix('/').unwrap_or(item);
        if item.is_empty() {
            return bad("an empty endpoint");
        }
        if item.contains(['/', '?', '#', '@']) || item.chars().any(char::is_whitespace) {
            return bad(&format!("endpoint {item:?} must be host or host:port (no path, query or user)"));
        }
        match parse_authority(item) {
            Ok(ep) => endpoints.push(ep),
            Err(why) => return bad(&format!("endpoint {item:?}: {why}")),
        }
    }
    Ok((endpoints, secure))
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`, as `host:port` (port 2379 by default).
fn parse_authority(item: &str) -> Result<String, String> {
    let (host, port) = if let Some(v6) = item.strip_prefix('[') {
        let (addr, after) = v6.split_once(']').ok_or("an unclosed [")?;
        if addr.is_empty() {
            return Err("an empty host".into());
        }
        match after {
            "" => (format!("[{addr}]"), None),
            p => (format!("[{addr}]"), Some(p.strip_prefix(':').ok_or("expected :port after ]")?)),
        }
    } else {
        match item.split_once(':') {
            None => (item.to_string(), None),
            Some((_, p)) if p.contains(':') => return Err("an IPv6 address must be in brackets".into()),
            Some((h, p)) => (h.to_string(), Some(p)),
        }
    };
    if host.is_empty() {
        return Err("an empty host".into());
    }
    let port = match port {
        None => 2379,
        Some(p) => p.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| format!("bad port {p:?}"))?,
    };
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(url: &str) -> Vec<String> {
        Etcd::new(url).unwrap().endpoints().to_vec()
    }

    #[test]
    fn urls() {
        assert_eq!(eps("etcd://h1:1,h2:2"), ["h1:1", "h2:2"]);
        assert_eq!(eps("http://127.0.0.1:2379"), ["127.0.0.1:2379"]);
        assert_eq!(eps("http://a:1, http://b:2/"), ["a:1", "b:2"]);
        assert_eq!(eps("etcd://localhost"), ["localhost:2379"]);
        assert_eq!(eps("ETCD://[::1]:23,[fe80::1]"), ["[::1]:23", "[fe80::1]:2379"]);
        for bad in [
            "",
            "h:1",
            "ftp://h:1",
            "etcd://",
            "etcd://h:1,",
            "etcd://h:x",
            "etcd://h:0",
            "etcd://h:70000",
            "http://h:1/v3",
            "http://u@h:1",
            "etcd://::1",
            "etcd://[::1",
            "etcd://h:1,http://g:2",
        ] {
            let e = Etcd::new(bad).unwrap_err();
            assert!(matches!(e, EtcdError::BadUrl(_)), "{bad}: {e}");
        }
        let e = Etcd::new("https://h:1").unwrap_err().to_string();
        assert!(e.contains("needs a CA and a client certificate"), "{e}");
    }

    #[test]
    fn defaults() {
        let etcd = Etcd::new("etcd://a:1,b:2").unwrap();
        assert_eq!(etcd.timeout, DEFAULT_TIMEOUT);
        assert_eq!(etcd.current_endpoint(), "a:1");
        let etcd = etcd.with_timeout(Duration::from_millis(300));
        assert_eq!(etcd.timeout, Duration::from_millis(300));
    }

    #[tokio::test]
    async fn unreachable_names_the_endpoints() {
        // Port 1 on loopback: refused at once.
        let etcd = Etcd::new("etcd://127.0.0.1:1,127.0.0.1:2").unwrap();
        let e = etcd.get("k").await.unwrap_err();
        let EtcdError::Unreachable(msg) = &e else { panic!("{e}") };
        assert!(msg.contains("127.0.0.1:1") && msg.contains("127.0.0.1:2"), "{msg}");
    }
}
