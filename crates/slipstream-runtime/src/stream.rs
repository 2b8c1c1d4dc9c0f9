//! Streamed answers: a streaming component's chunks sent to the client as
//! server-sent events while the request is still running.
//!
//! A component streams by yielding dicts of outputs instead of returning
//! one (see `worker.py`); its worker sends each as a `chunk` frame, and the
//! replica's task hands every request its rows.
//! Chunks from the pipeline's sink stages reach a streaming request's
//! channel; this module turns that channel and the request's final answer
//! into one response body:
//!
//! ```text
//! event: chunk
//! data: {"model_name": ..., "outputs": [...]}     (one per chunk, as it comes)
//!
//! event: done
//! data: {"chunks": N, "model_name": ..., "outputs": [...]}   (the final answer)
//! ```
//!
//! Each event's data is a KServe v2 JSON answer (typed, flat `data`; bytes
//! in base64), so a client decodes chunks with the code it has for answers.
//!
//! or `event: error` with `{"error": {"kind", "message"}}` if the request
//! fails after the stream began (errors before it, such as a refusal or a
//! malformed body, are ordinary error responses). The request's future
//! lives inside the body: a client that goes away drops the body, and the
//! request is settled as cancelled like any other.

use crate::respond::{Chunks, Resp};
use bytes::Bytes;
use hyper::body::{Body, Frame};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::Response;
use serde_json::json;
use slipstream_core::arena::Tensors;
use slipstream_core::codec::{self, V2Request};
use slipstream_core::{Accepted, Answer, Node, NodeError};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

type Outcome = Pin<Box<dyn Future<Output = Result<Answer, NodeError>> + Send>>;

/// The streamed response of one accepted request of pipeline `model`. (A
/// refusal is an ordinary error response before the stream begins, unless
/// the pipeline answers refusals with its fallback: then the stream
/// carries the fallback as its answer.)
pub(crate) fn respond(node: Arc<Node>, model: &str, accepted: Accepted) -> Resp {
    let (tx, rx) = mpsc::unbounded_channel();
    let outcome: Outcome = Box::pin(async move { node.answer(accepted, Some(tx)).await });
    let model = model.to_string();
    let mut r = Response::new(Chunks::live(EventStream { model, rx, outcome, result: None, sent: 0, ended: false }));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// One server-sent event.
fn event(name: &str, data: &[u8]) -> Frame<Bytes> {
    let mut out = Vec::with_capacity(data.len() + name.len() + 16);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data); // one line: JSON has no raw newlines
    out.extend_from_slice(b"\n\n");
    Frame::data(Bytes::from(out))
}

struct EventStream {
    model: String,
    rx: mpsc::UnboundedReceiver<Tensors>,
    outcome: Outcome,
    result: Option<Result<Answer, NodeError>>,
    sent: usize,
    ended: bool,
}

impl EventStream {
    /// `outputs` as a v2 JSON answer.
    fn v2_json(&self, outputs: &Tensors) -> Vec<u8> {
        match codec::encode_v2(&self.model, &V2Request::default(), outputs) {
            Ok(enc) => enc.chunks.concat(),
            Err(e) => json!({"error": e.to_string()}).to_string().into_bytes(),
        }
    }

    fn chunk(&mut self, t: &Tensors) -> Frame<Bytes> {
        self.sent += 1;
        event("chunk", &self.v2_json(t))
    }
}

impl Body for EventStream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.result.is_none() {
            if let Poll::Ready(Some(t)) = self.rx.poll_recv(cx) {
                let f = self.chunk(&t);
                return Poll::Ready(Some(Ok(f)));
            }
            match self.outcome.as_mut().poll(cx) {
                Poll::Ready(r) => self.result = Some(r),
                Poll::Pending => return Poll::Pending,
            }
        }
        // The answer is in: chunks sent before it still go first.
        if let Ok(t) = self.rx.try_recv() {
            let f = self.chunk(&t);
            return Poll::Ready(Some(Ok(f)));
        }
        self.ended = true;
        let frame = match self.result.take().expect("set above") {
            Ok(ans) => {
                // The v2 answer with the chunk count in front.
                let body = self.v2_json(&ans.outputs);
                let mut data = format!("{{\"chunks\":{},", self.sent).into_bytes();
                data.extend_from_slice(&body[1..]);
                event("done", &data)
            }
            Err(e) => {
                event("error", json!({"error": {"kind": e.kind(), "message": e.to_string()}}).to_string().as_bytes())
            }
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}
