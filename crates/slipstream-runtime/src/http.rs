//! The HTTP edge: routes and admin authorisation. Every inference route
//! goes through the node's one ingress sequence ([`Node::accept`]: admit
//! before the body is decoded, then decode; [`Node::answer`]); responses,
//! errors and bodies are [`crate::respond`]'s; query parameters
//! [`crate::query`]'s.
//!
//! Routes:
//! - pipeline API: `POST /v1/pipelines/{name}/infer`, `POST
//!   /v1/pipelines/{name}/stream` (server-sent events: a streaming
//!   component's chunks as they come, see [`crate::stream`]; v2 bodies at
//!   `POST /v2/models/{name}/infer_stream`), `GET /v1/pipelines`,
//!   `GET /v1/pipelines/{name}`, `GET /v1/status`; every answer carries
//!   `x-slipstream-request-id`
//! - model selection (`slipstream-select`): `POST
//!   /v1/pipelines/{name}/feedback` (a request id and its true label or a
//!   reward; or a batch of them), `GET /v1/pipelines/{name}/select[?context=KEY]`
//! - admin (a bearer token is required unless the node listens on loopback
//!   only and has no token set): `POST /v1/admin/reset-metrics`,
//!   `POST /v1/admin/scale` with `{"pipeline", "stage", "replicas"}`
//! - Open Inference Protocol (KServe v2): `POST /v2/models/{name}[/versions/{v}]/infer`,
//!   `GET /v2/models/{name}`, `GET /v2/models/{name}/ready`, `GET /v2`,
//!   `GET /v2/health/live`, `GET /v2/health/ready`; Triton's extensions
//!   `GET /v2/models/{name}/config` and `GET /v2/models[/{name}]/stats`
//!   ([`crate::triton`])
//! - object store: `/v1/store/...` (see [`crate::store_http`])
//! - operations: `GET /healthz`, `GET /readyz` (ready while every stage of
//!   every pipeline has a serving replica), `GET /metrics` (Prometheus)
//! - the dashboard: `GET /dashboard` (one HTML page) and the history it
//!   polls, `GET /v1/history?since=SEQ` (`slipstream-history`)

use crate::app::App;
use crate::pacing::ConnMemory;
use crate::query::Query;
use crate::respond::{arrival_of, error_resp, json_resp, read_body, relayed_error_resp, respond, Resp};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::Method;
use serde_json::{json, Value};
use slipstream_cluster::Feedback;
use slipstream_core::codec::{self, BodyParts};
use slipstream_core::{Answer, Node, NodeError, PipelineRt};
use std::convert::Infallible;
use std::sync::Arc;

/// Entry point for every HTTP request. `admin_open`: the listener is on
/// loopback, so admin routes need a token only if one is set. `conn`: what
/// the request's connection was told (a refusal to a connection that did
/// not wait as told is held, see [`crate::pacing`]).
pub(crate) async fn handle(
    app: Arc<App>,
    admin_open: bool,
    conn: Arc<ConnMemory>,
    req: hyper::Request<Incoming>,
) -> Result<Resp, Infallible> {
    let v2 = req.uri().path().starts_with("/v2");
    Ok(match route(&app, admin_open, req).await {
        Ok(r) => r,
        Err(e) => error_resp(&app.pacer.pace(&conn, e).await, v2),
    })
}

async fn route(app: &App, admin_open: bool, req: hyper::Request<Incoming>) -> Result<Resp, NodeError> {
    let node = &app.node;
    let arrival = arrival_of(&req)?;
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let method = req.method().clone();
    let get = method == Method::GET;
    let post = method == Method::POST;
    let wrong_method = || NodeError::MethodNotAllowed(method.to_string());
    let limit = app.edge.max_body_bytes;
    // Routes that run work (and the store's, which read data): the API token.
    if matches!(
        parts.as_slice(),
        ["v1", "store", ..]
            | ["v1", "pipelines", _, "infer" | "stream" | "feedback"]
            | ["v2", "models", _, "infer" | "infer_stream"]
            | ["v2", "models", _, "versions", _, "infer" | "infer_stream"]
    ) {
        app.authorise_api(&req)?;
    }
    match parts.as_slice() {
        ["v1", "store", ..] => crate::store_http::route(app, admin_open, req).await,
        ["v1", "pipelines", name, "infer"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(req, limit).await?;
            let (accepted, ()) =
                node.accept(&pipe, arrival, |arena| Ok((codec::decode_v1(&body, &pipe.spec.inputs, arena)?, ())))?;
            let ans = node.answer(accepted, None).await?;
            let mut r = respond(200, "application/json", vec![Bytes::from(codec::encode_v1(&ans.outputs))]);
            mark_answer(&mut r, &ans);
            Ok(r)
        }
        ["v1", "pipelines", name, "feedback"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(req, limit).await?.to_vec();
            let Some(cluster) = app.cluster.get() else {
                return Ok(json_resp(200, &app.selections.feedback(pipe.name(), &body)?));
            };
            // In a cluster, feedback on another node's answer goes to it.
            match cluster.feedback(pipe.name(), &body).await? {
                Feedback::Ok(v) => Ok(json_resp(200, &v)),
                Feedback::Refused { status, kind, message } => Ok(relayed_error_resp(status, &kind, &message)),
            }
        }
        ["v1", "pipelines", name, "stream"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let body = read_body(req, limit).await?;
            let (accepted, ()) =
                node.accept(&pipe, arrival, |arena| Ok((codec::decode_v1(&body, &pipe.spec.inputs, arena)?, ())))?;
            Ok(crate::stream::respond(node.clone(), pipe.name(), accepted))
        }
        ["v2", "models", name, "infer_stream"] | ["v2", "models", name, "versions", _, "infer_stream"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let header_len = inference_header_len(&req)?;
            let body = read_body(req, limit).await?;
            let (accepted, _) =
                node.accept(&pipe, arrival, |arena| codec::decode_v2(&body, header_len, &pipe.spec.inputs, arena))?;
            Ok(crate::stream::respond(node.clone(), pipe.name(), accepted))
        }
        ["v2", "models", name, "infer"] | ["v2", "models", name, "versions", _, "infer"] => {
            if !post {
                return Err(wrong_method());
            }
            let pipe = node.pipeline(name)?;
            let header_len = inference_header_len(&req)?;
            let body = read_body(req, limit).await?;
            let (accepted, v2req) =
                node.accept(&pipe, arrival, |arena| codec::decode_v2(&body, header_len, &pipe.spec.inputs, arena))?;
            let ans = node.answer(accepted, None).await?;
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
            app.authorise_admin(admin_open, &req)?;
            match *action {
                "reset-metrics" => {
                    node.reset_metrics();
                    Ok(json_resp(200, &json!({"reset": true})))
                }
                "scale" => {
                    let body = read_body(req, limit).await?;
                    let ask = parse_scale(&body)?;
                    let c = node.scale(&ask.pipeline, &ask.stage, ask.replicas)?;
                    Ok(json_resp(
                        200,
                        &json!({"pipeline": ask.pipeline, "stage": ask.stage, "from": c.from, "replicas": ask.replicas,
                                "added": c.added, "promoted": c.promoted, "draining": c.draining}),
                    ))
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
            json_resp(
                503,
                &json!({"status": "not ready", "draining": node.is_draining(), "stages": not_ready(node),
                        "held_back": node.held_back()}),
            )
        }),
        ["v1", "pipelines"] => Ok(json_resp(
            200,
            &json!({"pipelines": node.pipelines().values().map(|p| p.describe()).collect::<Vec<_>>()}),
        )),
        ["v1", "pipelines", name] => Ok(json_resp(200, &node.pipeline(name)?.describe())),
        ["v1", "pipelines", name, "select"] => {
            let pipe = node.pipeline(name)?;
            let query = Query::parse(req.uri().query())?;
            Ok(json_resp(200, &app.selections.report(pipe.name(), query.get("context"))))
        }
        ["v1", "status"] => Ok(json_resp(200, &node.status())),
        ["v1", "history"] => {
            let since = Query::parse(req.uri().query())?
                .u64("since")
                .map_err(|_| NodeError::BadRequest("since must be a sample number".into()))?
                .unwrap_or(0);
            Ok(json_resp(200, &app.history.since(node, since)))
        }
        ["dashboard"] => Ok(respond(
            200,
            "text/html; charset=utf-8",
            vec![Bytes::from_static(slipstream_history::DASHBOARD_HTML.as_bytes())],
        )),
        ["metrics"] => Ok(respond(200, "text/plain; version=0.0.4", vec![Bytes::from(node.prometheus())])),
        ["v2"] => Ok(json_resp(
            200,
            &json!({"name": "slipstream", "version": env!("CARGO_PKG_VERSION"), "extensions": crate::triton::EXTENSIONS}),
        )),
        // Triton's statistics and configuration extensions (crate::triton);
        // as in Triton, `/v2/models/stats` is every model's statistics.
        ["v2", "models", "stats"] if get => {
            Ok(json_resp(200, &crate::triton::stats_json(&crate::triton::model_stats(node, None)?)))
        }
        ["v2", "models", name, "stats"] | ["v2", "models", name, "versions", _, "stats"] if get => {
            Ok(json_resp(200, &crate::triton::stats_json(&crate::triton::model_stats(node, Some(name))?)))
        }
        ["v2", "models", name, "config"] | ["v2", "models", name, "versions", _, "config"] if get => {
            let config = crate::triton::model_config(node.pipeline(name)?.as_ref());
            Ok(json_resp(200, &crate::triton::config_json(&config)))
        }
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

/// The answer's headers: its request id (for feedback), and why a
/// fallback answered, if one did.
pub(crate) fn mark_answer(r: &mut Resp, ans: &Answer) {
    if let Some(kind) = ans.fallback {
        r.headers_mut().insert("x-slipstream-fallback", HeaderValue::from_static(kind));
    }
    if let Some(id) = ans.id {
        r.headers_mut().insert("x-slipstream-request-id", HeaderValue::from(id));
    }
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
    node.pipelines()
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
