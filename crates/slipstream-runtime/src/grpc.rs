//! The gRPC edge: the Open Inference Protocol (KServe v2) over HTTP/2, on
//! the HTTP port and on a port of its own where one is set (see
//! [`crate::conn`]), so that `tritonclient.grpc` and the KServe SDK's
//! `InferenceGRPCClient` work unchanged. The protocol's messages and service
//! trait come from `slipstream-kserve`; this module answers them with the
//! same [`Node`] calls as the HTTP edge's v2 routes ([`crate::http`]):
//! `pipeline` → [`Node::accept`] (admission before decoding, so a refusal
//! is cheap; then [`codec::decode_grpc`]) → [`Node::answer`] →
//! [`codec::encode_grpc`].
//!
//! Connections are served by hyper's HTTP/2 server directly rather than
//! tonic's transport, for two reasons: they join the HTTP listener's
//! graceful shutdown (one drain for both), and the call's deadline is the
//! node's to enforce. tonic's transport would cancel a call whose
//! `grpc-timeout` passed on its own; here the timeout becomes the request's
//! deadline budget like HTTP's `x-slipstream-deadline-ms` (the tighter of
//! the two wins, and the SLO bounds both), so a late request is dropped by
//! the scheduler and answered `DEADLINE_EXCEEDED` with its kind, and its
//! work is released wherever it waits.
//!
//! Errors: [`code_of`] maps each [`NodeError`] to a gRPC status code (the
//! gRPC counterpart of [`NodeError::http_status`]); every error status
//! carries the stable kind in the `x-slipstream-error-kind` trailer, and
//! `retry-after` where HTTP sends it. In `ModelStreamInfer` an error answers
//! that one request (`error_message`, with its id and kind in the
//! `infer_response` beside it) and the stream goes on. An answer that is a
//! pipeline's declared fallback says so in the response parameter
//! `x-slipstream-fallback` (and, for unary calls, in the response metadata).
//!
//! Streaming components (see [`crate::stream`]) answer `ModelStreamInfer`
//! requests the way Triton's decoupled models do: one response per chunk as
//! it comes (parameter `slipstream_chunk`), then the final answer; every
//! response says whether it is the request's last in
//! `triton_final_response`. `ModelInfer` returns the final answer only.
//!
//! A message larger than the node's `max_body_bytes` is refused by tonic's
//! decoder from its length prefix, before it is buffered whole and before
//! any handler runs: `OUT_OF_RANGE` ("decoded message length too large"),
//! without the kind trailer.

use crate::access::Access;
use crate::app::App;
use crate::pacing::{ConnMemory, RefusalPacer};
use crate::respond::{
    deadline_budget, priority_of, DEADLINE_HEADER, ERROR_KIND_HEADER, PRIORITY_HEADER, RETRY_AFTER_MS_HEADER,
};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::Watcher;
use hyper_util::service::TowerToHyperService;
use slipstream_core::arena::Tensors;
use slipstream_core::codec;
use slipstream_core::{Arrival, Chunks, Node, NodeError};
use slipstream_kserve::inference::infer_parameter::ParameterChoice;
use slipstream_kserve::inference::model_metadata_response::TensorMetadata;
use slipstream_kserve::inference::*;
use slipstream_kserve::{GrpcInferenceService, GrpcInferenceServiceServer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status, Streaming};

/// The response parameter (and unary response metadata) naming why an
/// answer is the pipeline's declared fallback.
pub(crate) const FALLBACK_KEY: &str = "x-slipstream-fallback";
/// The response parameter naming the node's id of the request.
pub(crate) const REQUEST_ID_KEY: &str = "slipstream_request_id";

/// Requests of one `ModelStreamInfer` call in the node at once; the stream
/// is read no further until one finishes (HTTP/2 flow control then holds
/// the client back).
const STREAM_INFLIGHT: usize = 1024;

/// HTTP/2 streams (concurrent calls) one connection may open. Load
/// generators and clients multiplex many calls on one connection.
const MAX_STREAMS: u32 = 4096;

/// The gRPC status code of a node error (see the module docs).
pub(crate) fn code_of(e: &NodeError) -> Code {
    use slipstream_shm::ShmError;
    match e {
        NodeError::BadRequest(_) | NodeError::BadInput(_) => Code::InvalidArgument,
        NodeError::UnknownPipeline(_) | NodeError::NotFound(_) | NodeError::UnknownStage { .. } => Code::NotFound,
        NodeError::MethodNotAllowed(_) => Code::Unimplemented,
        NodeError::PayloadTooLarge { .. } => Code::ResourceExhausted,
        // Refused at admission: the pipeline is at capacity for this deadline.
        NodeError::Overloaded { .. } => Code::ResourceExhausted,
        NodeError::Timeout { .. } | NodeError::DeadlineExceeded { .. } => Code::DeadlineExceeded,
        NodeError::Unavailable { .. } | NodeError::ShuttingDown => Code::Unavailable,
        // The shared-memory pools are full for now: retry, as with HTTP's 503.
        NodeError::Arena(ShmError::Full { .. }) => Code::Unavailable,
        NodeError::Component { .. } | NodeError::Internal(_) | NodeError::Arena(_) => Code::Internal,
        NodeError::Cancelled => Code::Cancelled,
        NodeError::Unauthorized(_) => Code::Unauthenticated,
        NodeError::Forbidden(_) => Code::PermissionDenied,
        // Not reached by inference, but the mapping stays total.
        NodeError::Store(_) => match e.http_status() {
            400 => Code::InvalidArgument,
            404 | 410 => Code::NotFound,
            409 => Code::Aborted,
            413 => Code::ResourceExhausted,
            503 => Code::Unavailable,
            _ => Code::Internal,
        },
    }
}

/// The status a node error is answered with: its code, its message, and
/// its kind (and `retry-after`) as trailers.
pub(crate) fn status_of(e: &NodeError) -> Status {
    let mut md = MetadataMap::new();
    md.insert(ERROR_KIND_HEADER, MetadataValue::from_static(e.kind()));
    if let (Some(s), Some(ms)) = (e.retry_after_s(), e.retry_after_ms()) {
        md.insert("retry-after", MetadataValue::from(s));
        // gRPC's own pushback (its retry design, A6): clients that retry
        // wait this long, and none retries when it is absent.
        md.insert("grpc-retry-pushback-ms", MetadataValue::from(ms));
        md.insert(RETRY_AFTER_MS_HEADER, MetadataValue::from(ms));
    }
    Status::with_metadata(code_of(e), e.to_string(), md)
}

/// When the call arrived, the budget it asked for (the tighter of its
/// `grpc-timeout`, the client's deadline, and `x-slipstream-deadline-ms`)
/// and its class (`x-slipstream-priority`).
fn arrival_of(md: &MetadataMap) -> Result<Arrival, NodeError> {
    let at = Instant::now();
    let timeout = call_timeout(md)?;
    let asked = deadline_budget(md.get(DEADLINE_HEADER).map(|v| v.as_encoded_bytes()))?;
    let budget = match (timeout, asked) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    Ok(Arrival { at, budget, priority: priority_of(md.get(PRIORITY_HEADER).map(|v| v.as_encoded_bytes()))? })
}

fn call_timeout(md: &MetadataMap) -> Result<Option<Duration>, NodeError> {
    let Some(v) = md.get(slipstream_kserve::TIMEOUT_HEADER) else { return Ok(None) };
    let parsed = v.to_str().ok().and_then(slipstream_kserve::parse_timeout);
    parsed.map(Some).ok_or_else(|| {
        NodeError::BadRequest(format!(
            "{} must be up to 8 digits and a unit (H, M, S, m, u, n), got {v:?}",
            slipstream_kserve::TIMEOUT_HEADER
        ))
    })
}

fn string_param(s: &str) -> InferParameter {
    InferParameter { parameter_choice: Some(ParameterChoice::StringParam(s.to_string())) }
}

fn tensor_meta(m: &std::collections::BTreeMap<String, slipstream_types::TensorSpec>) -> Vec<TensorMetadata> {
    // The same fields as HTTP's `codec::v2_tensor_meta`.
    m.iter()
        .map(|(n, s)| TensorMetadata { name: n.clone(), datatype: s.dtype.v2_name().into(), shape: s.shape.clone() })
        .collect()
}

/// One inference, as both `ModelInfer` and each message of
/// `ModelStreamInfer` run it. Returns the response and why it is a
/// fallback, if it is. `chunks`: where a streaming component's chunks go.
async fn infer(
    node: &Node,
    req: ModelInferRequest,
    arrival: Arrival,
    chunks: Option<Chunks>,
) -> Result<(ModelInferResponse, Option<&'static str>), NodeError> {
    let pipe = node.pipeline(&req.model_name)?;
    let (accepted, asked) = node.accept(&pipe, arrival, |arena| codec::decode_grpc(req, &pipe.spec.inputs, arena))?;
    let ans = node.answer(accepted, chunks).await?;
    let mut resp = codec::encode_grpc(pipe.name(), &asked, &ans.outputs)?;
    if let Some(why) = ans.fallback {
        resp.parameters.insert(FALLBACK_KEY.into(), string_param(why));
    }
    if let Some(id) = ans.id {
        // For feedback on this answer (POST /v1/pipelines/{name}/feedback).
        let id = InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(id as i64)) };
        resp.parameters.insert(REQUEST_ID_KEY.into(), id);
    }
    Ok((resp, ans.fallback))
}

/// Marks a streamed chunk's response (a streaming component's partial
/// outputs); the request's last response carries `triton_final_response`,
/// as Triton's decoupled models do.
pub(crate) const CHUNK_KEY: &str = "slipstream_chunk";
const FINAL_KEY: &str = "triton_final_response";

fn bool_param(b: bool) -> InferParameter {
    InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(b)) }
}

type Outbox = mpsc::Sender<Result<ModelStreamInferResponse, Status>>;

/// One request of a `ModelStreamInfer` call: each chunk a streaming
/// component yields goes out as its own response as it comes (marked
/// [`CHUNK_KEY`]), then the final answer (or error) is returned.
async fn stream_answer(node: &Node, req: ModelInferRequest, arrival: Arrival, out: Outbox) -> ModelStreamInferResponse {
    let (model_name, id) = (req.model_name.clone(), req.id.clone());
    let (chunk_tx, mut chunk_rx) = mpsc::unbounded_channel::<Tensors>();
    let send_chunk = |t: Tensors| {
        let out = out.clone();
        let (model_name, id) = (model_name.clone(), id.clone());
        async move {
            let asked = codec::GrpcRequest { id, outputs: Vec::new() };
            let msg = match codec::encode_grpc(&model_name, &asked, &t) {
                Ok(mut resp) => {
                    resp.parameters.insert(CHUNK_KEY.into(), bool_param(true));
                    resp.parameters.insert(FINAL_KEY.into(), bool_param(false));
                    ModelStreamInferResponse { error_message: String::new(), infer_response: Some(resp) }
                }
                Err(e) => ModelStreamInferResponse { error_message: e.to_string(), infer_response: None },
            };
            let _ = out.send(Ok(msg)).await;
        }
    };
    let run = infer(node, req, arrival, Some(chunk_tx));
    tokio::pin!(run);
    let result = loop {
        tokio::select! {
            biased;
            Some(t) = chunk_rx.recv() => send_chunk(t).await,
            r = &mut run => break r,
        }
    };
    while let Ok(t) = chunk_rx.try_recv() {
        send_chunk(t).await;
    }
    match result {
        Ok((mut resp, _)) => {
            resp.parameters.insert(FINAL_KEY.into(), bool_param(true));
            ModelStreamInferResponse { error_message: String::new(), infer_response: Some(resp) }
        }
        Err(e) => {
            let mut resp = ModelInferResponse { model_name, id, ..Default::default() };
            resp.parameters.insert(ERROR_KIND_HEADER.into(), string_param(e.kind()));
            resp.parameters.insert(FINAL_KEY.into(), bool_param(true));
            ModelStreamInferResponse { error_message: e.to_string(), infer_response: Some(resp) }
        }
    }
}

/// The service, answering from one node.
pub(crate) struct InferenceService {
    node: Arc<Node>,
    /// Who may call (the inference calls need the API token, if any).
    access: Access,
    /// Refusals to a connection that did not wait as told are held
    /// ([`crate::pacing`]); one service per connection, so `told` is the
    /// connection's.
    pacer: Arc<RefusalPacer>,
    told: ConnMemory,
}

impl InferenceService {
    /// An inference call may run (the API token, see [`crate::access`]).
    fn authorise(&self, md: &MetadataMap) -> Result<(), Status> {
        let given = md.get("authorization").and_then(|v| v.to_str().ok());
        self.access.api(given).map_err(|e| status_of(&e))
    }

    /// The status an inference error is answered with, once any hold is over.
    async fn refusal(&self, e: NodeError) -> Status {
        status_of(&self.pacer.pace(&self.told, e).await)
    }
}

/// The service for one connection as a tower service over HTTP/2
/// requests, with the node's body limit as its largest message.
fn service(app: &App) -> GrpcInferenceServiceServer<InferenceService> {
    let svc = InferenceService {
        node: app.node.clone(),
        access: app.edge.access.clone(),
        pacer: app.pacer.clone(),
        told: ConnMemory::default(),
    };
    GrpcInferenceServiceServer::new(svc).max_decoding_message_size(app.edge.max_body_bytes)
}

/// Bind the gRPC listener on the node's host (`port` 0: any free port).
pub(crate) async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind((host, port)).await
}

/// Accept on gRPC's own listener, or never when there is none.
pub(crate) async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Serve one connection (HTTP/2 with prior knowledge, as gRPC clients
/// speak it) until it closes or the graceful shutdown `watcher` belongs to
/// ends it. Connections come from gRPC's own port or from the HTTP port
/// ([`crate::conn`]).
pub(crate) async fn serve_connection<S>(app: &App, stream: S, watcher: Watcher)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = TowerToHyperService::new(service(app));
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .adaptive_window(true)
        .serve_connection(TokioIo::new(stream), svc);
    let _ = watcher.watch(conn).await;
}

#[tonic::async_trait]
impl GrpcInferenceService for InferenceService {
    async fn server_live(&self, _: Request<ServerLiveRequest>) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<ServerReadyRequest>) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse { ready: self.node.is_ready() }))
    }

    async fn model_ready(&self, req: Request<ModelReadyRequest>) -> Result<Response<ModelReadyResponse>, Status> {
        let pipe = self.node.pipeline(&req.get_ref().name).map_err(|e| status_of(&e))?;
        Ok(Response::new(ModelReadyResponse { ready: self.node.pipeline_ready(&pipe) }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "slipstream".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: crate::triton::EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let p = self.node.pipeline(&req.get_ref().name).map_err(|e| status_of(&e))?;
        Ok(Response::new(ModelMetadataResponse {
            name: p.name().to_string(),
            versions: vec!["1".into()],
            platform: "slipstream".into(),
            inputs: tensor_meta(&p.spec.inputs),
            outputs: p.outputs().map_or(vec![], tensor_meta),
        }))
    }

    async fn model_config(&self, req: Request<ModelConfigRequest>) -> Result<Response<ModelConfigResponse>, Status> {
        let p = self.node.pipeline(&req.get_ref().name).map_err(|e| status_of(&e))?;
        Ok(Response::new(ModelConfigResponse { config: Some(crate::triton::model_config(&p)) }))
    }

    async fn model_statistics(
        &self,
        req: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        let stats = crate::triton::model_stats(&self.node, Some(&req.get_ref().name)).map_err(|e| status_of(&e))?;
        Ok(Response::new(ModelStatisticsResponse { model_stats: stats }))
    }

    async fn model_infer(&self, req: Request<ModelInferRequest>) -> Result<Response<ModelInferResponse>, Status> {
        self.authorise(req.metadata())?;
        let arrival = arrival_of(req.metadata()).map_err(|e| status_of(&e))?;
        let (resp, fallback) = match infer(&self.node, req.into_inner(), arrival, None).await {
            Ok(r) => r,
            Err(e) => return Err(self.refusal(e).await),
        };
        let mut r = Response::new(resp);
        if let Some(why) = fallback {
            r.metadata_mut().insert(FALLBACK_KEY, MetadataValue::from_static(why));
        }
        Ok(r)
    }

    type ModelStreamInferStream = ReceiverStream<Result<ModelStreamInferResponse, Status>>;

    /// Each request of the stream runs as it arrives (up to
    /// [`STREAM_INFLIGHT`] at once) and is answered when it finishes, so
    /// answers come in completion order: clients match them by `id`. The
    /// call's `grpc-timeout` bounds every request in it; a request's
    /// `x-slipstream-deadline-ms` (call metadata) is a budget for each.
    /// When the client goes away, what is still running is cancelled.
    async fn model_stream_infer(
        &self,
        req: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        self.authorise(req.metadata())?;
        let call_deadline = call_timeout(req.metadata()).map_err(|e| status_of(&e))?.map(|t| Instant::now() + t);
        let each = deadline_budget(req.metadata().get(DEADLINE_HEADER).map(|v| v.as_encoded_bytes()))
            .map_err(|e| status_of(&e))?;
        let priority = priority_of(req.metadata().get(PRIORITY_HEADER).map(|v| v.as_encoded_bytes()))
            .map_err(|e| status_of(&e))?;
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let node = self.node.clone();
        tokio::spawn(async move {
            // Dropping the set (client gone, or done) aborts what still runs.
            let mut running: JoinSet<ModelStreamInferResponse> = JoinSet::new();
            let mut open = true;
            let mut broken: Option<Status> = None;
            while open || !running.is_empty() {
                tokio::select! {
                    msg = inbound.message(), if open && running.len() < STREAM_INFLIGHT => match msg {
                        Ok(Some(r)) => {
                            let at = Instant::now();
                            let left = call_deadline.map(|d| d.saturating_duration_since(at));
                            let budget = match (left, each) {
                                (Some(a), Some(b)) => Some(a.min(b)),
                                (a, b) => a.or(b),
                            };
                            let (node, out) = (node.clone(), tx.clone());
                            running.spawn(async move { stream_answer(&node, r, Arrival { at, budget, priority }, out).await });
                        }
                        Ok(None) => open = false,
                        // A message that could not be decoded (too large,
                        // malformed): nothing more can be read.
                        Err(s) => {
                            open = false;
                            broken = Some(s);
                        }
                    },
                    Some(done) = running.join_next(), if !running.is_empty() => {
                        let msg = done.unwrap_or_else(|e| ModelStreamInferResponse {
                            error_message: format!("internal error: {e}"),
                            infer_response: None,
                        });
                        if tx.send(Ok(msg)).await.is_err() {
                            return;
                        }
                    }
                    _ = tx.closed() => return,
                }
            }
            if let Some(s) = broken {
                let _ = tx.send(Err(s)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_shm::ShmError;

    #[test]
    fn every_error_kind_has_a_fitting_code() {
        let cases: Vec<(NodeError, Code)> = vec![
            (NodeError::BadRequest("x".into()), Code::InvalidArgument),
            (NodeError::BadInput("x".into()), Code::InvalidArgument),
            (NodeError::UnknownPipeline("p".into()), Code::NotFound),
            (NodeError::PayloadTooLarge { limit: 1 }, Code::ResourceExhausted),
            (NodeError::Overloaded { budget_ms: 10, over_ms: 5 }, Code::ResourceExhausted),
            (NodeError::DeadlineExceeded { stage: "s".into() }, Code::DeadlineExceeded),
            (NodeError::Timeout { ms: 5 }, Code::DeadlineExceeded),
            (NodeError::ShuttingDown, Code::Unavailable),
            (NodeError::Unavailable { stage: "s".into(), reason: "r".into() }, Code::Unavailable),
            (NodeError::Arena(ShmError::Full { requested: 1, capacity: 0 }), Code::Unavailable),
            (NodeError::Component { stage: "s".into(), message: "m".into() }, Code::Internal),
            (NodeError::Internal("x".into()), Code::Internal),
            (NodeError::Cancelled, Code::Cancelled),
            (NodeError::Unauthorized("x".into()), Code::Unauthenticated),
            (NodeError::Forbidden("x".into()), Code::PermissionDenied),
            (NodeError::Store(slipstream_store::StoreError::NotFound("k".into())), Code::NotFound),
        ];
        for (e, code) in cases {
            let s = status_of(&e);
            assert_eq!(s.code(), code, "{e}");
            assert_eq!(s.message(), e.to_string());
            let kind = s.metadata().get(ERROR_KIND_HEADER).and_then(|v| v.to_str().ok());
            assert_eq!(kind, Some(e.kind()), "{e}");
        }
        let s = status_of(&NodeError::Overloaded { budget_ms: 10, over_ms: 2500 });
        assert_eq!(s.metadata().get("retry-after").and_then(|v| v.to_str().ok()), Some("3"));
    }

    fn md(pairs: &[(&'static str, &'static str)]) -> MetadataMap {
        let mut m = MetadataMap::new();
        for (k, v) in pairs {
            m.insert(*k, MetadataValue::from_static(v));
        }
        m
    }

    #[test]
    fn the_tighter_of_grpc_timeout_and_the_deadline_header_is_the_budget() {
        assert_eq!(arrival_of(&md(&[])).unwrap().budget, None);
        assert_eq!(arrival_of(&md(&[("grpc-timeout", "250m")])).unwrap().budget, Some(Duration::from_millis(250)));
        let both = md(&[("grpc-timeout", "2S"), (DEADLINE_HEADER, "40")]);
        assert_eq!(arrival_of(&both).unwrap().budget, Some(Duration::from_millis(40)));
        let both = md(&[("grpc-timeout", "10000u"), (DEADLINE_HEADER, "40")]);
        assert_eq!(arrival_of(&both).unwrap().budget, Some(Duration::from_millis(10)));
        let Err(e) = arrival_of(&md(&[("grpc-timeout", "soon")])) else { panic!("accepted") };
        assert_eq!(code_of(&e), Code::InvalidArgument);
        assert!(e.to_string().contains("grpc-timeout"), "{e}");
        let Err(e) = arrival_of(&md(&[(DEADLINE_HEADER, "-3")])) else { panic!("accepted") };
        assert_eq!(code_of(&e), Code::InvalidArgument);
        // A budget too large for a Duration saturates instead of panicking.
        let huge = md(&[(DEADLINE_HEADER, "1e300")]);
        assert_eq!(arrival_of(&huge).unwrap().budget, Some(Duration::MAX));
    }
}
