//! The background task behind [`Etcd::watch_prefix`].
//!
//! A watch is one `POST /v3/watch` whose answer never ends: newline-separated
//! JSON objects, a `created` one first, then one per batch of events (all the
//! events of one revision come in one batch). The task remembers `next`, the
//! revision after the last one it delivered, and when the stream breaks it
//! opens a new one from `next` (on the next endpoint, backing off from 50 ms
//! up to 1 s while none answers), so the receiver sees every event once, in
//! order. When `next` is no longer in etcd's history (compacted) it learns
//! the current revision R, sends [`WatchEvent::Resync`] and goes on from R+1:
//! the receiver's reload happens after R, so nothing is missed, though a few
//! events after the Resync may already be in the reload (they carry their
//! `mod_revision` to tell).

use crate::transport::request;
use crate::wire::{b64, prefix_range, snippet, StreamLine, WatchResponse};
use crate::{Etcd, EtcdError, WatchEvent, MAX_ANSWER_BYTES};
use bytes::Bytes;
use http_body_util::BodyExt;
use std::time::Duration;
use tokio::sync::mpsc::Sender;
use tokio::time::{timeout_at, Instant};

const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// How one watch stream ended.
enum End {
    /// The receiver is gone: the task ends.
    Closed,
    /// `next` is older than etcd's history.
    Compacted,
    /// The connection failed or broke (or etcd cancelled the watch);
    /// `created`: it had worked.
    Broken { created: bool },
}

pub(crate) struct Watcher {
    pub etcd: Etcd,
    pub key: Vec<u8>,
    pub range_end: Vec<u8>,
    pub tx: Sender<WatchEvent>,
}

impl Watcher {
    pub fn new(etcd: Etcd, prefix: &str, tx: Sender<WatchEvent>) -> Watcher {
        let (key, range_end) = prefix_range(prefix);
        Watcher { etcd, key, range_end, tx }
    }

    pub async fn run(self, from_revision: i64) {
        let n = self.etcd.transport.endpoints.len();
        let mut ep = self.etcd.transport.preferred();
        let mut backoff = MIN_BACKOFF;
        // "From now" is pinned to a revision, so that a reconnection before
        // the first event still starts where the caller asked.
        let mut next = from_revision;
        if next <= 0 {
            match self.current_revision().await {
                Some(r) => next = r + 1,
                None => return,
            }
        }
        loop {
            match self.stream(ep, &mut next).await {
                End::Closed => return,
                End::Compacted => {
                    let Some(r) = self.current_revision().await else { return };
                    if self.tx.send(WatchEvent::Resync).await.is_err() {
                        return;
                    }
                    next = r + 1;
                    backoff = MIN_BACKOFF;
                }
                End::Broken { created } => {
                    // A stream that had worked is reopened after a short
                    // pause; failures in a row wait longer each time.
                    if created {
                        backoff = MIN_BACKOFF;
                    }
                    ep = (ep + 1) % n;
                    if !self.pause(backoff).await {
                        return;
                    }
                    if !created {
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
        }
    }

    /// Sleeps, unless the receiver goes first (false).
    async fn pause(&self, d: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = self.tx.closed() => false,
        }
    }

    /// The store's revision now, asked until an endpoint answers (None: the
    /// receiver went away meanwhile).
    async fn current_revision(&self) -> Option<i64> {
        let mut backoff = MIN_BACKOFF;
        loop {
            if let Ok(r) = self.etcd.revision_of_range(&self.key, &self.range_end).await {
                return Some(r);
            }
            if !self.pause(backoff).await {
                return None;
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One watch stream on endpoint `ep`, from `next`, until it ends.
    async fn stream(&self, ep: usize, next: &mut i64) -> End {
        let broken = End::Broken { created: false };
        let authority = &self.etcd.transport.endpoints[ep];
        let deadline = Instant::now() + self.etcd.timeout;
        let (mut sender, conn) = match timeout_at(deadline, self.etcd.transport.connect(authority)).await {
            Err(_) | Ok(Err(_)) => return broken,
            Ok(Ok(c)) => c,
        };
        let _conn = AbortOnDrop(conn);
        let body = serde_json::json!({
            "create_request": {
                "key": b64(&self.key),
                "range_end": b64(&self.range_end),
                "start_revision": next.to_string(),
                "progress_notify": true,
            }
        });
        let Ok(mut req) = request(authority, "/v3/watch", Bytes::from(body.to_string())) else {
            return broken;
        };
        // clientv3's WithRequireLeader: a member cut off from the leader
        // cancels the watch instead of going silent, and we move on.
        req.headers_mut().insert("grpc-metadata-hasleader", hyper::header::HeaderValue::from_static("true"));
        let resp = match timeout_at(deadline, sender.send_request(req)).await {
            Err(_) | Ok(Err(_)) => return broken,
            Ok(Ok(r)) => r,
        };
        if resp.status() != hyper::StatusCode::OK {
            return broken;
        }
        self.etcd.transport.set_preferred(ep);

        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        let mut scanned = 0;
        let mut created = false;
        loop {
            let frame = tokio::select! {
                f = body.frame() => f,
                _ = self.tx.closed() => return End::Closed,
            };
            let data = match frame {
                None | Some(Err(_)) => return End::Broken { created },
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue, // trailers
                },
            };
            if buf.len() + data.len() > MAX_ANSWER_BYTES {
                return End::Broken { created };
            }
            buf.extend_from_slice(&data);
            // Complete lines only; a JSON object may span frames.
            while let Some(at) = buf[scanned..].iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..scanned + at + 1).collect();
                scanned = 0;
                match self.handle_line(&line, next, &mut created).await {
                    Ok(None) => {}
                    Ok(Some(end)) => return end,
                    Err(_) => return End::Broken { created },
                }
            }
            scanned = buf.len();
        }
    }

    /// One line of the stream: events are delivered and `next` advanced.
    async fn handle_line(&self, line: &[u8], next: &mut i64, created: &mut bool) -> Result<Option<End>, EtcdError> {
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        let parsed: StreamLine<WatchResponse> =
            serde_json::from_slice(line).map_err(|e| EtcdError::Protocol(format!("{e} in {:?}", snippet(line))))?;
        let w = parsed.into_result()?;
        if w.compact_revision > 0 {
            return Ok(Some(End::Compacted));
        }
        if w.canceled {
            // E.g. the member lost its leader: go elsewhere.
            return Ok(Some(End::Broken { created: *created }));
        }
        if w.created {
            *created = true;
            return Ok(None);
        }
        if w.events.is_empty() {
            // A progress notification: everything up to this revision has
            // been sent.
            *next = (*next).max(w.header.revision + 1);
            return Ok(None);
        }
        // All decoded before any is sent, so that a batch is delivered whole
        // or not at all. Events below `next` were delivered before (never
        // expected from etcd, but cheap to be sure of).
        let mut events = Vec::with_capacity(w.events.len());
        let mut last = 0;
        for ev in w.events {
            let rev = ev.kv.mod_revision;
            if rev < *next {
                continue;
            }
            last = last.max(rev);
            events.push(if ev.kind == "DELETE" {
                WatchEvent::Delete { key: ev.kv.key()?, mod_revision: rev }
            } else {
                WatchEvent::Put(ev.kv.into_kv()?)
            });
        }
        for event in events {
            if self.tx.send(event).await.is_err() {
                return Ok(Some(End::Closed));
            }
        }
        *next = (*next).max(last + 1);
        Ok(None)
    }
}

/// Ends the connection's task with the stream.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
