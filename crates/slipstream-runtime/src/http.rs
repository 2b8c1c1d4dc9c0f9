//! The HTTP edge: routes, body limits, admin authorisation, and the mapping
//! of errors to responses, all in one place.
//!
//! Error bodies: on the pipeline API, `{"error": {"kind": ..., "message":
//! ...}}`; on KServe v2 routes, the protocol's own `{"error": "<message>"}`
//! so that its clients parse it. Both carry the stable kind in the
//! `x-slipstream-error-kind` header, and the status from
//! [`NodeError::http_status`].
//!
//! Routes:
//! - pipeline API: `POST /v1/pipelines/{name}/infer`, `POST
//!   /v1/pipelines/{name}/stream` (server-sent events: a streaming
//!   component's chunks as they come, see [`crate::stream`]; v2 bodies at
//!   `POST /v2/models/{name}/infer_stream`), `GET /v1/pipelines`,
//!   `GET /v1/pipelines/{name}`, `GET /v1/status`; every answer carries
//!   `x-slipstream-request-id`
//! - model selection (see [`crate::select`]): `POST
//!   /v1/pipelines/{name}/feedback` (a request id and its true label or a
//!   reward; or a batch of them), `GET /v1/pipelines/{name}/select[?context=KEY]`
//! - admin (a bearer token is required unless the node listens on loopback
//!   only and has no token set): `POST /v1/admin/reset-metrics`,
//!   `POST /v1/admin/scale` with `{"pipeline", "stage", "replicas"}`
//! - Open Inference Protocol (KServe v2): `POST /v2/models/{name}[/versions/{v}]/infer`,
//!   `GET /v2/models/{name}`, `GET /v2/models/{name}/ready`, `GET /v2`,
//!   `GET /v2/health/live`, `GET /v2/health/ready`
//! - object store: `/v1/store/...` (see [`crate::store_http`])
//! - operations: `GET /healthz`, `GET /readyz` (ready while every stage of
//!   every pipeline has a serving replica), `GET /metrics` (Prometheus)
//! - the dashboard: `GET /dashboard` (one HTML page) and the history it
//!   polls, `GET /v1/history?since=SEQ` (see [`crate::history`])

use crate::codec::{self, BodyParts};
use crate::error::NodeError;
use crate::node::{Arrival, Node};
use crate::pipeline::PipelineRt;
use crate::report;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

/// A response body made of ready chunks (a JSON header and, for binary v2
/// outputs, arena-backed tensor bytes). Its exact size is known, so hyper
/// sends a Content-Length.
pub struct Chunks {
    chunks: VecDeque<Bytes>,
    len: u64,
    /// A body whose parts are not ready yet (a streamed answer, see
    /// [`crate::stream`]); sent chunked, after `chunks`.
    live: Option<Pin<Box<dyn Body<Data = Bytes, Error = Infallible> + Send>>>,
}

impl Chunks {
    pub fn new(chunks: Vec<Bytes>) -> Chunks {
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        Chunks { chunks: chunks.into(), len, live: None }
    }

    /// A body produced as it goes (no Content-Length).
    pub fn live(body: impl Body<Data = Bytes, Error = Infallible> + Send + 'static) -> Chunks {
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
pub const ERROR_KIND_HEADER: &str = "x-slipstream-error-kind";

/// The error response: the pipeline API's body, or KServe v2's (`v2`).
pub fn error_resp(e: &NodeError, v2: bool) -> Resp {
    let body = if v2 {
        json!({"error": e.to_string()})
    } else if let NodeError::Store(slipstream_store::StoreError::Conflict { current, .. }) = e {
        json!({"error": {"kind": e.kind(), "message": e.to_string(), "current": current}})
    } else {
        json!({"error": {"kind": e.kind(), "message": e.to_string()}})
    };
    let mut r = json_resp(e.http_status(), &body);
    r.headers_mut().insert(ERROR_KIND_HEADER, HeaderValue::from_static(e.kind()));
    if let Some(s) = e.retry_after_s() {
        r.headers_mut().insert("retry-after", HeaderValue::from(s));
    }
    r
}

/// Entry point for every HTTP request. `admin_open`: the listener is on
/// loopback, so admin routes need a token only if one is set.
pub async fn handle(node: Arc<Node>, admin_open: bool, req: hyper::Request<Incoming>) -> Result<Resp, Infallible> {
    let v2 = req.uri().path().starts_with("/v2");
    let result = route(&node, admin_open, req).await;
    Ok(result.unwrap_or_else(|e| error_resp(&e, v2)))
}

/// Admin routes change the node: they need the node's bearer token when it
/// has one, and are refused outright on a non-loopback listener without one.
pub(crate) fn authorise_admin(node: &Node, admin_open: bool, req: &hyper::Request<Incoming>) -> Result<(), NodeError> {
    let Some(token) = node.opts.admin_token.as_deref() else {
        return if admin_open {
            Ok(())
        } else {
            Err(NodeError::Forbidden(format!(
                "admin routes are disabled: the node listens on {} without an admin token \
                 (start it with --admin-token or SLIPSTREAM_ADMIN_TOKEN)",
                node.opts.host
            )))
        };
    };
    let given = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if constant_time_eq(g.trim().as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(NodeError::Unauthorized("wrong admin token".into())),
        None => Err(NodeError::Unauthorized("admin routes need 'Authorization: Bearer <admin token>'".into())),
    }
}

/// Compare without an early exit, so timing does not reveal a prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn route(node: &Arc<Node>, admin_open: bool, req: hyper::Request<Incoming>) -> Result<Resp, NodeError> {
    let arrival = arrival_of(&req)?;
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let method = req.method().clone();
    let get = method == Method::GET;
    let post = method == Method::POST;
    let wrong_method = || NodeError::MethodNotAllowed(method.to_string());
    match parts.as_slice() {
        ["v1", "store", ..] => crate::store_http::route(node, admin_open, req).await,
        ["v1", "pipelines", name, "infer"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(node, req).await?;
            let ticket = node.admit(&pipe, arrival)?;
            let tensors = codec::decode_v1(&body, &pipe.spec.inputs, &node.arena)?;
            let ans = node.answer(&pipe, tensors, ticket).await?;
            let mut r = respond(200, "application/json", vec![Bytes::from(codec::encode_v1(&ans.outputs))]);
            mark_answer(&mut r, &ans);
            Ok(r)
        }
        ["v1", "pipelines", name, "feedback"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(node, req).await?;
            feedback(&pipe, &body.to_vec())
        }
        ["v1", "pipelines", name, "stream"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(node, req).await?;
            let ticket = crate::stream::admit(node, &pipe, arrival)?;
            let tensors = codec::decode_v1(&body, &pipe.spec.inputs, &node.arena)?;
            Ok(crate::stream::respond(node.clone(), pipe, tensors, ticket))
        }
        ["v2", "models", name, "infer_stream"] | ["v2", "models", name, "versions", _, "infer_stream"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let header_len = inference_header_len(&req)?;
            let body = read_body(node, req).await?;
            let ticket = crate::stream::admit(node, &pipe, arrival)?;
            let (tensors, _) = codec::decode_v2(&body, header_len, &pipe.spec.inputs, &node.arena)?;
            Ok(crate::stream::respond(node.clone(), pipe, tensors, ticket))
        }
        ["v2", "models", name, "infer"] | ["v2", "models", name, "versions", _, "infer"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let header_len = inference_header_len(&req)?;
            let body = read_body(node, req).await?;
            let ticket = node.admit(&pipe, arrival)?;
            let (tensors, v2req) = codec::decode_v2(&body, header_len, &pipe.spec.inputs, &node.arena)?;
            let ans = node.answer(&pipe, tensors, ticket).await?;
            let enc = codec::encode_v2(pipe.name(), &v2req, &ans.outputs)?;
            let binary = enc.header_len.is_some();
            let mut r = respond(200, if binary { "application/octet-stream" } else { "application/json" }, enc.chunks);
            if let Some(n) = enc.header_len {
                r.headers_mut().insert("inference-header-content-length", HeaderValue::from(n));
            }
            mark_answer(&mut r, &ans);
            Ok(r)
        }
        ["v1", "admin", action] => {
            if !post {
                return Err(wrong_method());
            }
            authorise_admin(node, admin_open, &req)?;
            match *action {
                "reset-metrics" => {
                    node.reset_metrics();
                    Ok(json_resp(200, &json!({"reset": true})))
                }
                "scale" => {
                    let body = read_body(node, req).await?;
                    let ask = parse_scale(&body)?;
                    Ok(json_resp(200, &node.scale(&ask.pipeline, &ask.stage, ask.replicas)?))
                }
                _ => Err(NodeError::NotFound(format!("{method} {path}"))),
            }
        }
        _ if !get => {
            if known_get_route(&parts) {
                Err(wrong_method())
            } else {
                Err(NodeError::NotFound(format!("{method} {path}")))
            }
        }
        ["healthz"] | ["v2", "health", "live"] => Ok(json_resp(200, &json!({"status": "live"}))),
        ["readyz"] | ["v2", "health", "ready"] => Ok(if node.is_ready() {
            json_resp(200, &json!({"status": "ready"}))
        } else {
            json_resp(503, &json!({"status": "not ready", "draining": node.is_draining(), "stages": not_ready(node)}))
        }),
        ["v1", "pipelines"] => {
            Ok(json_resp(200, &json!({"pipelines": node.pipelines.values().map(|p| describe(p)).collect::<Vec<_>>()})))
        }
        ["v1", "pipelines", name] => Ok(json_resp(200, &describe(node.pipeline(name)?.as_ref()))),
        ["v1", "pipelines", name, "select"] => {
            let pipe = node.pipeline(name)?;
            let context = crate::select::query_value(req.uri().query(), "context");
            Ok(json_resp(
                200,
                &json!({"selects": pipe.selects.iter().map(|s| s.report(context.as_deref())).collect::<Vec<_>>()}),
            ))
        }
        ["v1", "status"] => Ok(json_resp(200, &report::status(node))),
        ["v1", "history"] => {
            let since = crate::history::since_param(req.uri().query())?;
            Ok(json_resp(200, &node.history.since(node, since)))
        }
        ["dashboard"] => Ok(respond(
            200,
            "text/html; charset=utf-8",
            vec![Bytes::from_static(crate::history::DASHBOARD_HTML.as_bytes())],
        )),
        ["metrics"] => Ok(respond(200, "text/plain; version=0.0.4", vec![Bytes::from(report::prometheus(node))])),
        ["v2"] => Ok(json_resp(
            200,
            &json!({"name": "slipstream", "version": env!("CARGO_PKG_VERSION"), "extensions": ["binary_tensor_data"]}),
        )),
        ["v2", "models", name] | ["v2", "models", name, "versions", _] => {
            Ok(json_resp(200, &v2_metadata(node.pipeline(name)?.as_ref())))
        }
        ["v2", "models", name, "ready"] | ["v2", "models", name, "versions", _, "ready"] => {
            let pipe = node.pipeline(name)?;
            Ok(if node.pipeline_ready(&pipe) {
                json_resp(200, &json!({"ready": true}))
            } else {
                json_resp(503, &json!({"ready": false}))
            })
        }
        _ => Err(NodeError::NotFound(format!("{method} {path}"))),
    }
}

/// The binary extension's `Inference-Header-Content-Length`, if given.
fn inference_header_len(req: &hyper::Request<Incoming>) -> Result<Option<usize>, NodeError> {
    match req.headers().get("inference-header-content-length") {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .map(Some)
            .ok_or_else(|| NodeError::BadRequest("Inference-Header-Content-Length must be an integer".into())),
    }
}

fn known_get_route(parts: &[&str]) -> bool {
    matches!(
        parts,
        ["healthz"]
            | ["readyz"]
            | ["metrics"]
            | ["v1", "pipelines"]
            | ["v1", "pipelines", _]
            | ["v1", "pipelines", _, "select"]
            | ["v1", "status"]
            | ["v1", "history"]
            | ["dashboard"]
            | ["v2", ..]
    )
}

/// A body over the limit is still read (and dropped) up to this many extra
/// bytes, so that the client gets its 413 instead of a reset connection.
const DISCARD_CAP: usize = 16 << 20;

async fn read_body(node: &Node, req: hyper::Request<Incoming>) -> Result<BodyParts, NodeError> {
    Ok(BodyParts::new(read_chunks(req, node.opts.max_body_bytes).await?))
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
pub const DEADLINE_HEADER: &str = "x-slipstream-deadline-ms";

fn arrival_of(req: &hyper::Request<Incoming>) -> Result<Arrival, NodeError> {
    let budget = deadline_budget(req.headers().get(DEADLINE_HEADER).map(|v| v.as_bytes()))?;
    Ok(Arrival { at: Instant::now(), budget })
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

/// The answer's headers: its request id (for feedback), and why a
/// fallback answered, if one did.
fn mark_answer(r: &mut Resp, ans: &crate::node::Answer) {
    if let Some(kind) = ans.fallback {
        r.headers_mut().insert("x-slipstream-fallback", HeaderValue::from_static(kind));
    }
    if let Some(id) = ans.id {
        r.headers_mut().insert("x-slipstream-request-id", HeaderValue::from(id));
    }
}

/// `POST /v1/pipelines/{name}/feedback`: feedback on earlier answers, for
/// the pipeline's model selections (see [`crate::select`]).
fn feedback(pipe: &crate::pipeline::PipelineRt, body: &[u8]) -> Result<Resp, NodeError> {
    use crate::select::FeedbackError;
    if pipe.selects.is_empty() {
        return Err(NodeError::BadRequest(format!(
            "pipeline '{}' has no model selection (ss.Select) to take feedback",
            pipe.name()
        )));
    }
    let (items, batch) = crate::select::parse_feedback(body).map_err(NodeError::BadRequest)?;
    if let Some(name) =
        items.iter().filter_map(|f| f.select.as_deref()).find(|n| !pipe.selects.iter().any(|s| s.spec.name == *n))
    {
        return Err(NodeError::BadRequest(format!("pipeline '{}' has no selection '{name}'", pipe.name())));
    }
    let (mut applied, mut unknown, mut invalid) = (0u64, 0u64, Vec::new());
    for f in &items {
        let mut outcome = Err(FeedbackError::Unknown);
        for sel in pipe.selects.iter().filter(|s| f.select.as_ref().is_none_or(|n| *n == s.spec.name)) {
            match sel.feedback(f.request_id, &f.truth) {
                Err(FeedbackError::Unknown) => {}
                other => outcome = other,
            }
        }
        match outcome {
            Ok(()) => applied += 1,
            Err(FeedbackError::Unknown) => unknown += 1,
            Err(FeedbackError::Invalid(why)) => invalid.push(format!("request {}: {why}", f.request_id)),
        }
    }
    if !batch {
        if let Some(why) = invalid.pop() {
            return Err(NodeError::BadRequest(why));
        }
        if unknown > 0 {
            return Err(NodeError::NotFound(format!(
                "no prediction of request {} is held: it was never made, already has feedback, or is older than the \
                 last {} predictions",
                items[0].request_id,
                crate::select::MAX_HELD
            )));
        }
    }
    Ok(json_resp(200, &json!({"applied": applied, "unknown": unknown, "invalid": invalid.len(), "errors": invalid})))
}

/// `GET /v1/pipelines/{name}`: stages, inputs with dtypes and shapes, SLO.
pub fn describe(p: &PipelineRt) -> Value {
    let tensors = |m: &std::collections::BTreeMap<String, slipstream_types::TensorSpec>| -> Value {
        m.iter()
            .map(|(k, s)| (k.clone(), json!({"dtype": s.dtype, "shape": s.shape})))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    json!({
        "name": p.name(),
        "inputs": tensors(&p.spec.inputs),
        "outputs": p.outputs().map_or(json!({}), tensors),
        "slo": p.spec.slo.map(|s| json!({"p99_ms": s.p99_ms, "max_miss_rate": s.max_miss_rate})),
        "timeout_ms": p.timeout.as_millis() as u64,
        "example": p.spec.example,
        "fallback": p.spec.fallback,
        "stages": p.stages.iter().map(|s| json!({
            "name": s.name,
            "component": s.component,
            "parents": p.dag.parents[s.index].iter().map(|&i| p.stages[i].name.clone()).collect::<Vec<_>>(),
            "replicas": s.live_replicas(),
            "max_batch_size": s.max_batch,
        })).collect::<Vec<_>>(),
    })
}

fn v2_metadata(p: &PipelineRt) -> Value {
    json!({
        "name": p.name(),
        "versions": ["1"],
        "platform": "slipstream",
        "inputs": p.spec.inputs.iter().map(|(n, s)| codec::v2_tensor_meta(n, s)).collect::<Vec<_>>(),
        "outputs": p.outputs().map_or(vec![], |o| o.iter().map(|(n, s)| codec::v2_tensor_meta(n, s)).collect()),
    })
}

/// Stages that have no serving replica, as `pipeline/stage`.
fn not_ready(node: &Node) -> Vec<String> {
    node.pipelines
        .values()
        .flat_map(|p| p.stages.iter().filter(|s| !s.is_ready()).map(move |s| p.stage_key(s.index)))
        .collect()
}

/// A scale request: `{"pipeline": "p", "stage": "s", "replicas": 3}`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ScaleRequest {
    pipeline: String,
    stage: String,
    replicas: usize,
}

fn parse_scale(body: &BodyParts) -> Result<ScaleRequest, NodeError> {
    serde_json::from_slice(&body.to_vec()).map_err(|e| {
        NodeError::BadRequest(format!("scale takes {{\"pipeline\": NAME, \"stage\": NAME, \"replicas\": N}}: {e}"))
    })
}
