//! The edge's plumbing, shared by every route: response bodies (ready
//! chunks, or a live stream), JSON and error responses (the one place an
//! error becomes a status, a body and its headers), reading request bodies
//! within their limit, and the deadline a request asks for.
//!
//! Error bodies: on the pipeline API, `{"error": {"kind": ..., "message":
//! ...}}`; on KServe v2 routes, the protocol's own `{"error": "<message>"}`
//! so that its clients parse it. Both carry the stable kind in the
//! `x-slipstream-error-kind` header, and the status from
//! [`NodeError::http_status`].

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use slipstream_core::codec::BodyParts;
use slipstream_core::{Arrival, NodeError};
use slipstream_sched::Priority;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

/// A response body made of ready chunks (a JSON header and, for binary v2
/// outputs, arena-backed tensor bytes). Its exact size is known, so hyper
/// sends a Content-Length.
pub(crate) struct Chunks {
    chunks: VecDeque<Bytes>,
    len: u64,
    /// A body whose parts are not ready yet (a streamed answer, see
    /// [`crate::stream`]); sent chunked, after `chunks`.
    live: Option<Pin<Box<dyn Body<Data = Bytes, Error = Infallible> + Send>>>,
}

impl Chunks {
    pub(crate) fn new(chunks: Vec<Bytes>) -> Chunks {
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        Chunks { chunks: chunks.into(), len, live: None }
    }

    /// A body produced as it goes (no Content-Length).
    pub(crate) fn live(body: impl Body<Data = Bytes, Error = Infallible> + Send + 'static) -> Chunks {
        Chunks { chunks: VecDeque::new(), len: 0, live: Some(Box::pin(body)) }
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(c) = self.chunks.pop_front() {
            self.len -= c.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(c))));
        }
        match self.live.as_mut() {
            Some(live) => live.as_mut().poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty() && self.live.as_ref().is_none_or(|l| l.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match &self.live {
            None => SizeHint::with_exact(self.len),
            Some(l) => {
                let mut h = SizeHint::new();
                h.set_lower(self.len + l.size_hint().lower());
                h
            }
        }
    }
}

pub(crate) type Resp = Response<Chunks>;

pub(crate) fn respond(status: u16, content_type: &'static str, chunks: Vec<Bytes>) -> Resp {
    let mut r = Response::new(Chunks::new(chunks));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub(crate) fn json_resp(status: u16, v: &Value) -> Resp {
    respond(status, "application/json", vec![Bytes::from(serde_json::to_vec(v).expect("serialises"))])
}

/// Header carrying an error's stable kind on every error response.
pub(crate) const ERROR_KIND_HEADER: &str = "x-slipstream-error-kind";

/// Header carrying a 429's or 503's wait in milliseconds beside HTTP's
/// `Retry-After` (whole seconds, rounded up): a refusal under a 10 ms SLO
/// asks for a wait of milliseconds, not a second.
pub(crate) const RETRY_AFTER_MS_HEADER: &str = "x-slipstream-retry-after-ms";

/// The error response: the pipeline API's body, or KServe v2's (`v2`).
pub(crate) fn error_resp(e: &NodeError, v2: bool) -> Resp {
    let body = if v2 {
        json!({"error": e.to_string()})
    } else if let NodeError::Store(slipstream_store::StoreError::Conflict { current, .. }) = e {
        json!({"error": {"kind": e.kind(), "message": e.to_string(), "current": current}})
    } else {
        json!({"error": {"kind": e.kind(), "message": e.to_string()}})
    };
    let mut r = json_resp(e.http_status(), &body);
    r.headers_mut().insert(ERROR_KIND_HEADER, HeaderValue::from_static(e.kind()));
    if let (Some(s), Some(ms)) = (e.retry_after_s(), e.retry_after_ms()) {
        r.headers_mut().insert("retry-after", HeaderValue::from(s));
        r.headers_mut().insert(RETRY_AFTER_MS_HEADER, HeaderValue::from(ms));
    }
    r
}

/// The pipeline API's error response for an error another node gave (its
/// status, kind and message), as [`error_resp`] writes one for ours.
pub(crate) fn relayed_error_resp(status: u16, kind: &str, message: &str) -> Resp {
    let mut r = json_resp(status, &json!({"error": {"kind": kind, "message": message}}));
    if let Ok(k) = HeaderValue::from_str(kind) {
        r.headers_mut().insert(ERROR_KIND_HEADER, k);
    }
    r
}

/// A body over the limit is still read (and dropped) up to this many extra
/// bytes, so that the client gets its 413 instead of a reset connection.
const DISCARD_CAP: usize = 16 << 20;

/// The body as the codecs read it, at most `limit` bytes (413 beyond).
pub(crate) async fn read_body(req: hyper::Request<Incoming>, limit: usize) -> Result<BodyParts, NodeError> {
    Ok(BodyParts::new(read_chunks(req, limit).await?))
}

/// The body's chunks as they came, at most `limit` bytes in all (413 beyond).
pub(crate) async fn read_chunks(req: hyper::Request<Incoming>, limit: usize) -> Result<Vec<Bytes>, NodeError> {
    let declared =
        req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<usize>().ok());
    let mut body = req.into_body();
    let mut kept: Vec<Bytes> = Vec::new();
    let mut seen = 0usize;
    let over = declared.is_some_and(|n| n > limit);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| NodeError::BadRequest(format!("could not read the body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            seen += data.len();
            if seen > limit + DISCARD_CAP {
                break;
            }
            if !over && seen <= limit {
                kept.push(data);
            }
        }
    }
    if over || seen > limit {
        return Err(NodeError::PayloadTooLarge { limit });
    }
    Ok(kept)
}

/// Header by which a client asks for a deadline tighter than the SLO, in ms from arrival.
pub(crate) const DEADLINE_HEADER: &str = "x-slipstream-deadline-ms";

/// Header by which a client gives its request's class for admission:
/// `high`, `normal` (the default) or `low` (shed first under overload).
pub(crate) const PRIORITY_HEADER: &str = "x-slipstream-priority";

/// When an HTTP request arrived, the budget it asked for and its class.
pub(crate) fn arrival_of(req: &hyper::Request<Incoming>) -> Result<Arrival, NodeError> {
    let budget = deadline_budget(req.headers().get(DEADLINE_HEADER).map(|v| v.as_bytes()))?;
    let priority = priority_of(req.headers().get(PRIORITY_HEADER).map(|v| v.as_bytes()))?;
    Ok(Arrival { at: Instant::now(), budget, priority })
}

/// The class a request gives in [`PRIORITY_HEADER`] (an HTTP header, or
/// gRPC metadata of the same name); `normal` when it gives none.
pub(crate) fn priority_of(value: Option<&[u8]>) -> Result<Priority, NodeError> {
    let Some(v) = value else { return Ok(Priority::Normal) };
    std::str::from_utf8(v)
        .ok()
        .and_then(Priority::parse)
        .ok_or_else(|| NodeError::BadRequest(format!("{PRIORITY_HEADER} must be high, normal or low")))
}

/// The budget a request asks for in [`DEADLINE_HEADER`] (an HTTP header, or
/// gRPC metadata of the same name), if it gave one. A budget too large to
/// represent saturates (the SLO bounds it anyway).
pub(crate) fn deadline_budget(value: Option<&[u8]>) -> Result<Option<std::time::Duration>, NodeError> {
    let Some(v) = value else { return Ok(None) };
    let ms = std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|ms| *ms > 0.0 && ms.is_finite())
        .ok_or_else(|| NodeError::BadRequest(format!("{DEADLINE_HEADER} must be a positive number of milliseconds")))?;
    Ok(Some(std::time::Duration::try_from_secs_f64(ms / 1e3).unwrap_or(std::time::Duration::MAX)))
}
