//! The HTTP edge: routes, body limits, and the mapping of errors to
//! responses (`{"error": {"kind": ..., "message": ...}}` with the status from
//! [`NodeError::http_status`]).
//!
//! Routes:
//! - pipeline API: `POST /v1/pipelines/{name}/infer`, `GET /v1/pipelines`,
//!   `GET /v1/pipelines/{name}`, `GET /v1/status`, `POST /v1/admin/reset-metrics`
//! - Open Inference Protocol (KServe v2): `POST /v2/models/{name}[/versions/{v}]/infer`,
//!   `GET /v2/models/{name}`, `GET /v2/models/{name}/ready`, `GET /v2`,
//!   `GET /v2/health/live`, `GET /v2/health/ready`
//! - operations: `GET /healthz`, `GET /readyz`, `GET /metrics` (Prometheus)

use crate::arena::Tensors;
use crate::codec::{self, BodyParts};
use crate::error::NodeError;
use crate::node::Node;
use crate::pipeline::{PipelineRt, Request, Ticket};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};
use serde_json::{json, Value};
use slipstream_sched::AdmissionGate;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

/// A response body made of ready chunks (a JSON header and, for binary v2
/// outputs, arena-backed tensor bytes). Its exact size is known, so hyper
/// sends a Content-Length.
pub struct Chunks {
    chunks: VecDeque<Bytes>,
    len: u64,
}

impl Chunks {
    pub fn new(chunks: Vec<Bytes>) -> Chunks {
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        Chunks { chunks: chunks.into(), len }
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let next = self.chunks.pop_front();
        if let Some(c) = &next {
            self.len -= c.len() as u64;
        }
        Poll::Ready(next.map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len)
    }
}

type Resp = Response<Chunks>;

fn respond(status: u16, content_type: &'static str, chunks: Vec<Bytes>) -> Resp {
    let mut r = Response::new(Chunks::new(chunks));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_resp(status: u16, v: &Value) -> Resp {
    respond(status, "application/json", vec![Bytes::from(serde_json::to_vec(v).expect("serialises"))])
}

pub fn error_resp(e: &NodeError) -> Resp {
    let mut r = json_resp(e.http_status(), &json!({"error": {"kind": e.kind(), "message": e.to_string()}}));
    if let Some(s) = e.retry_after_s() {
        r.headers_mut().insert("retry-after", HeaderValue::from(s));
    }
    r
}

/// Entry point for every HTTP request.
pub async fn handle(node: Arc<Node>, req: hyper::Request<Incoming>) -> Result<Resp, Infallible> {
    let result = route(&node, req).await;
    Ok(result.unwrap_or_else(|e| error_resp(&e)))
}

async fn route(node: &Arc<Node>, req: hyper::Request<Incoming>) -> Result<Resp, NodeError> {
    let arrival = arrival_of(&req)?;
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let method = req.method().clone();
    let get = method == Method::GET;
    let post = method == Method::POST;
    let wrong_method = || NodeError::MethodNotAllowed(method.to_string());
    match parts.as_slice() {
        ["v1", "pipelines", name, "infer"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(node, req).await?;
            let ticket = admit(node, &pipe, arrival)?;
            let tensors = codec::decode_v1(&body, &pipe.spec.inputs, &node.arena)?;
            let ans = answer(node, &pipe, tensors, ticket).await?;
            let mut r = respond(200, "application/json", vec![Bytes::from(codec::encode_v1(&ans.outputs))]);
            mark_fallback(&mut r, ans.fallback);
            Ok(r)
        }
        ["v2", "models", name, "infer"] | ["v2", "models", name, "versions", _, "infer"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let header_len = match req.headers().get("inference-header-content-length") {
                None => None,
                Some(v) => Some(v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()).ok_or_else(|| {
                    NodeError::BadRequest("Inference-Header-Content-Length must be an integer".into())
                })?),
            };
            let body = read_body(node, req).await?;
            let ticket = admit(node, &pipe, arrival)?;
            let (tensors, v2req) = codec::decode_v2(&body, header_len, &pipe.spec.inputs, &node.arena)?;
            let ans = answer(node, &pipe, tensors, ticket).await?;
            let enc = codec::encode_v2(pipe.name(), &v2req, &ans.outputs)?;
            let binary = enc.header_len.is_some();
            let mut r = respond(200, if binary { "application/octet-stream" } else { "application/json" }, enc.chunks);
            if let Some(n) = enc.header_len {
                r.headers_mut().insert("inference-header-content-length", HeaderValue::from(n));
            }
            mark_fallback(&mut r, ans.fallback);
            Ok(r)
        }
        _ if !(get || post && parts == ["v1", "admin", "reset-metrics"]) => {
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
            json_resp(503, &json!({"status": "not ready", "draining": node.draining.load(Relaxed)}))
        }),
        ["v1", "pipelines"] => {
            Ok(json_resp(200, &json!({"pipelines": node.pipelines.values().map(|p| describe(p)).collect::<Vec<_>>()})))
        }
        ["v1", "pipelines", name] => Ok(json_resp(200, &describe(node.pipeline(name)?.as_ref()))),
        ["v1", "status"] => Ok(json_resp(200, &node.status())),
        ["v1", "admin", "reset-metrics"] => {
            node.reset_metrics();
            Ok(json_resp(200, &json!({"reset": true})))
        }
        ["metrics"] => Ok(respond(200, "text/plain; version=0.0.4", vec![Bytes::from(node.prometheus())])),
        ["v2"] => Ok(json_resp(
            200,
            &json!({"name": "slipstream", "version": env!("CARGO_PKG_VERSION"), "extensions": ["binary_tensor_data"]}),
        )),
        ["v2", "models", name] | ["v2", "models", name, "versions", _] => {
            Ok(json_resp(200, &v2_metadata(node.pipeline(name)?.as_ref())))
        }
        ["v2", "models", name, "ready"] | ["v2", "models", name, "versions", _, "ready"] => {
            node.pipeline(name)?;
            Ok(if node.is_ready() {
                json_resp(200, &json!({"ready": true}))
            } else {
                json_resp(503, &json!({"ready": false}))
            })
        }
        _ => Err(NodeError::NotFound(format!("{method} {path}"))),
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
            | ["v1", "status"]
            | ["v2", ..]
    )
}

/// A body over the limit is still read (and dropped) up to this many extra
/// bytes, so that the client gets its 413 instead of a reset connection.
const DISCARD_CAP: usize = 16 << 20;

async fn read_body(node: &Node, req: hyper::Request<Incoming>) -> Result<BodyParts, NodeError> {
    let limit = node.opts.max_body_bytes;
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
    Ok(BodyParts::new(kept))
}

/// Counts a request as in flight for as long as it lives (graceful drain).
struct InFlight<'a>(&'a Node);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Relaxed) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// When the request arrived and the deadline budget it asked for.
pub struct Arrival {
    pub at: Instant,
    pub budget: Option<std::time::Duration>,
}

/// Header by which a client asks for a deadline tighter than the SLO, in ms from arrival.
pub const DEADLINE_HEADER: &str = "x-slipstream-deadline-ms";

fn arrival_of(req: &hyper::Request<Incoming>) -> Result<Arrival, NodeError> {
    let budget = match req.headers().get(DEADLINE_HEADER) {
        None => None,
        Some(v) => {
            let ms =
                v.to_str().ok().and_then(|s| s.trim().parse::<f64>().ok()).filter(|ms| *ms > 0.0 && ms.is_finite());
            Some(std::time::Duration::from_secs_f64(
                ms.ok_or_else(|| {
                    NodeError::BadRequest(format!("{DEADLINE_HEADER} must be a positive number of milliseconds"))
                })? / 1e3,
            ))
        }
    };
    Ok(Arrival { at: Instant::now(), budget })
}

/// Admission control, decided before the body is decoded, so that refusing
/// a request costs as little CPU as possible when the node is overloaded.
/// Ok(Err(..)): refused, but the pipeline declares a fallback answer, which
/// needs the decoded request (its row count); Err: refused outright.
fn admit(node: &Node, pipe: &PipelineRt, arrival: Arrival) -> Result<Result<Ticket, NodeError>, NodeError> {
    if node.draining.load(Relaxed) {
        return Err(NodeError::ShuttingDown);
    }
    let ticket = pipe.ticket(node.next_id.fetch_add(1, Relaxed), arrival.at, arrival.budget);
    if !node.admission {
        return Ok(Ok(ticket));
    }
    match pipe.admit(&ticket) {
        Ok(()) => Ok(Ok(ticket)),
        Err(over) => {
            let m = &pipe.metrics;
            m.shed.fetch_add(1, Relaxed);
            let e = NodeError::Overloaded {
                budget_ms: ticket.deadline.saturating_duration_since(arrival.at).as_millis() as u64,
                over_ms: over.as_millis() as u64,
            };
            m.error(e.kind());
            if pipe.spec.fallback.is_some() {
                Ok(Err(e))
            } else {
                Err(e)
            }
        }
    }
}

/// A pipeline's answer: its outputs, or the declared fallback (and why).
pub struct Answer {
    pub outputs: Tensors,
    pub fallback: Option<&'static str>,
}

/// Run one admitted request; answer with the pipeline's declared fallback
/// (Clipper's default output) instead of an error when it was refused or
/// ran out of time.
async fn answer(
    node: &Node,
    pipe: &Arc<PipelineRt>,
    tensors: Tensors,
    ticket: Result<Ticket, NodeError>,
) -> Result<Answer, NodeError> {
    let rows = crate::pipeline::request_rows(&tensors);
    let result = match ticket {
        Ok(t) => infer(node, pipe, tensors, t).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(outputs) => Ok(Answer { outputs, fallback: None }),
        Err(e @ (NodeError::Overloaded { .. } | NodeError::DeadlineExceeded { .. } | NodeError::Timeout { .. }))
            if pipe.spec.fallback.is_some() =>
        {
            let outputs = codec::fallback_outputs(
                pipe.spec.fallback.as_ref().expect("checked"),
                rows,
                &pipe.spec.outputs,
                &node.arena,
            )?;
            pipe.metrics.fallback.fetch_add(1, Relaxed);
            Ok(Answer { outputs, fallback: Some(e.kind()) })
        }
        Err(e) => Err(e),
    }
}

fn mark_fallback(r: &mut Resp, why: Option<&'static str>) {
    if let Some(kind) = why {
        r.headers_mut().insert("x-slipstream-fallback", HeaderValue::from_static(kind));
    }
}

/// Run one admitted request through its pipeline's DAG. Its outcome (in
/// time or not) feeds the admission gate.
async fn infer(node: &Node, pipe: &Arc<PipelineRt>, tensors: Tensors, ticket: Ticket) -> Result<Tensors, NodeError> {
    node.inflight.fetch_add(1, Relaxed);
    let _guard = InFlight(node);
    let arrival = ticket.arrival;
    let (req, rx) = Request::new(pipe.clone(), tensors, ticket);
    let m = &pipe.metrics;
    m.admitted.fetch_add(1, Relaxed);
    pipe.on_start();
    req.start();
    let result = match tokio::time::timeout(pipe.timeout, rx).await {
        Ok(Ok(reply)) => reply,
        Ok(Err(_)) => Err(NodeError::Internal("request was dropped without an answer".into())),
        Err(_) => {
            let ms = pipe.timeout.as_millis() as u64;
            req.fail(NodeError::Timeout { ms });
            Err(NodeError::Timeout { ms })
        }
    };
    match &result {
        Ok(_) => {
            let done = Instant::now();
            m.ok.fetch_add(1, Relaxed);
            m.latency_us.record(done.duration_since(arrival).as_micros() as u64);
            if done <= req.deadline {
                m.slo_met.fetch_add(1, Relaxed);
            } else {
                m.slo_missed.fetch_add(1, Relaxed);
            }
            let took = done.duration_since(arrival).as_nanos() as u64;
            let budget = req.deadline.saturating_duration_since(arrival).as_nanos() as u64;
            pipe.on_finish(Some(AdmissionGate::counts_as_met(took, budget)));
        }
        Err(e) => {
            let late = matches!(e, NodeError::DeadlineExceeded { .. } | NodeError::Timeout { .. });
            pipe.on_finish(if late { Some(false) } else { None });
            m.error(e.kind());
        }
    }
    result
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
        "outputs": tensors(&p.spec.outputs),
        "slo": p.spec.slo.map(|s| json!({"p99_ms": s.p99_ms, "max_miss_rate": s.max_miss_rate})),
        "timeout_ms": p.timeout.as_millis() as u64,
        "example": p.spec.example,
        "fallback": p.spec.fallback,
        "stages": p.stages.iter().map(|s| json!({
            "name": s.name,
            "component": s.component,
            "parents": s.parents.iter().map(|&i| p.stages[i].name.clone()).collect::<Vec<_>>(),
            "replicas": s.replicas.len(),
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
        "outputs": p.spec.outputs.iter().map(|(n, s)| codec::v2_tensor_meta(n, s)).collect::<Vec<_>>(),
    })
}
