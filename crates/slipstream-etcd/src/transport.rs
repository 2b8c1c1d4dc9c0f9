//! HTTP/1.1 to the gateway: connections, the endpoint to use, answers read
//! in full under a size limit.
//!
//! Each endpoint keeps at most one idle connection, reused by the next
//! request to it; concurrent requests open more and the extras close after
//! use. A request goes to the endpoint that answered last; when it cannot be
//! reached the others are tried in turn. Whether a request may be sent again
//! elsewhere depends on what happened to it: one that never left (the
//! connection was refused, or timed out) always may; one that was sent and
//! got no answer may have been applied, so only requests that are harmless
//! to repeat ([`Retry::Yes`]) are sent again.

use crate::wire::snippet;
use crate::{EtcdError, MAX_ANSWER_BYTES};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::{timeout_at, Instant};

pub(crate) type Sender = SendRequest<Full<Bytes>>;

/// How long a request waits for an idle connection to be ready.
const IDLE_SETTLE: Duration = Duration::from_millis(50);

/// Whether a request may be sent again after it went out without an answer.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Retry {
    /// Repeating it leaves the same state (reads, puts, deletes, keep-alives).
    Yes,
    /// Repeating it could decide differently (compare-and-swap).
    No,
}

/// Why one attempt on one endpoint failed.
enum Failure {
    /// The request never left: safe to send elsewhere.
    NotSent(String),
    /// It was sent and no complete answer came: it may have been applied.
    Lost(String),
    /// An answer came that we will not take (over the size limit).
    Fatal(EtcdError),
}

pub(crate) struct Transport {
    /// `host:port` each.
    pub endpoints: Vec<String>,
    /// TLS to every endpoint (an `https://` URL), with a client certificate.
    tls: Option<slipstream_tls::TlsConnector>,
    /// The endpoint that answered last.
    preferred: AtomicUsize,
    /// One idle connection per endpoint, at most.
    idle: Mutex<Vec<Option<Sender>>>,
}

impl Transport {
    pub fn new(endpoints: Vec<String>, tls: Option<slipstream_tls::TlsConnector>) -> Transport {
        let idle = Mutex::new(endpoints.iter().map(|_| None).collect());
        Transport { endpoints, tls, preferred: AtomicUsize::new(0), idle }
    }

    /// A new HTTP/1.1 connection (over TLS when configured); the task
    /// driving it is returned so that a long-lived user (a watch) can end it.
    pub async fn connect(&self, authority: &str) -> Result<(Sender, JoinHandle<()>), String> {
        let tcp = TcpStream::connect(authority).await.map_err(|e| format!("connect: {e}"))?;
        // Small requests: send them now, not when the last one is acknowledged.
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else { return drive(tcp).await };
        let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
        let name = slipstream_tls::server_name(host).map_err(|e| e.to_string())?;
        let stream = tls.connect(name, tcp).await.map_err(|e| format!("TLS with {authority}: {e}"))?;
        drive(stream).await
    }

    pub fn preferred(&self) -> usize {
        self.preferred.load(Relaxed) % self.endpoints.len()
    }

    pub fn set_preferred(&self, ep: usize) {
        self.preferred.store(ep, Relaxed);
    }

    /// POSTs `body` to `path`, to the endpoints in turn from the preferred
    /// one, each attempt within `timeout`. The answer is (status, body);
    /// a 503 or 504 (no leader, the cluster timed out) moves on to the next
    /// endpoint when the request is [`Retry::Yes`] and one is left.
    pub async fn post(
        &self,
        path: &str,
        body: Bytes,
        timeout: Duration,
        retry: Retry,
    ) -> Result<(u16, Bytes), EtcdError> {
        let n = self.endpoints.len();
        let first = self.preferred();
        let mut last = String::new();
        for k in 0..n {
            let ep = (first + k) % n;
            let name = &self.endpoints[ep];
            let deadline = Instant::now() + timeout;
            match self.exchange(ep, path, body.clone(), deadline).await {
                Ok((status, answer)) => {
                    if retry == Retry::Yes && (status == 503 || status == 504) && k + 1 < n {
                        last = format!("{name} answered {status}: {}", snippet(&answer));
                        continue;
                    }
                    self.set_preferred(ep);
                    return Ok((status, answer));
                }
                Err(Failure::NotSent(e)) => last = format!("{name}: {e}"),
                Err(Failure::Lost(e)) if retry == Retry::Yes => last = format!("{name}: {e}"),
                Err(Failure::Lost(e)) => {
                    return Err(EtcdError::Unreachable(format!(
                        "{name}: {e} (the request was sent; it may or may not have been applied)"
                    )))
                }
                Err(Failure::Fatal(e)) => return Err(e),
            }
        }
        Err(EtcdError::Unreachable(format!(
            "no etcd endpoint answered ({}); last error: {last}",
            self.endpoints.join(", ")
        )))
    }

    /// One request on endpoint `ep`: on its idle connection when there is
    /// one, on a new one when not (or when the idle one turns out closed
    /// before the request left).
    async fn exchange(&self, ep: usize, path: &str, body: Bytes, deadline: Instant) -> Result<(u16, Bytes), Failure> {
        let authority = &self.endpoints[ep];
        let mut req = request(authority, path, body).map_err(Failure::Fatal)?;
        if let Some(mut sender) = self.take_idle(ep) {
            // It may still be finishing the last answer (a chunked one's
            // end); a moment is enough, else a new connection is cheaper.
            let settle = deadline.min(Instant::now() + IDLE_SETTLE);
            let _ = timeout_at(settle, sender.ready()).await;
            match timeout_at(deadline, sender.try_send_request(req)).await {
                Err(_) => return Err(Failure::Lost("timed out".into())),
                Ok(Ok(resp)) => return self.finish(ep, sender, resp, deadline).await,
                Ok(Err(mut e)) => match e.take_message() {
                    Some(back) => req = back,
                    None => return Err(Failure::Lost(e.into_error().to_string())),
                },
            }
        }
        let (mut sender, _conn) = match timeout_at(deadline, self.connect(authority)).await {
            Err(_) => return Err(Failure::NotSent("connecting timed out".into())),
            Ok(Err(e)) => return Err(Failure::NotSent(e)),
            Ok(Ok(c)) => c,
        };
        match timeout_at(deadline, sender.send_request(req)).await {
            Err(_) => Err(Failure::Lost("timed out".into())),
            Ok(Err(e)) => Err(Failure::Lost(e.to_string())),
            Ok(Ok(resp)) => self.finish(ep, sender, resp, deadline).await,
        }
    }

    /// Reads the answer in full, then keeps the connection for the next request.
    async fn finish(
        &self,
        ep: usize,
        sender: Sender,
        resp: Response<Incoming>,
        deadline: Instant,
    ) -> Result<(u16, Bytes), Failure> {
        let status = resp.status().as_u16();
        let body = match timeout_at(deadline, read_all(resp.into_body())).await {
            Err(_) => return Err(Failure::Lost("timed out reading the answer".into())),
            Ok(Err(ReadError::Io(e))) => return Err(Failure::Lost(e)),
            Ok(Err(ReadError::TooLarge)) => return Err(Failure::Fatal(too_large())),
            Ok(Ok(b)) => b,
        };
        if !sender.is_closed() {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(slot @ None) = idle.get_mut(ep) {
                *slot = Some(sender);
            }
        }
        Ok((status, body))
    }

    fn take_idle(&self, ep: usize) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.get_mut(ep).and_then(Option::take).filter(|s| !s.is_closed())
    }
}

pub(crate) fn too_large() -> EtcdError {
    EtcdError::Protocol(format!("etcd's answer is over {} MiB; refusing to buffer it", MAX_ANSWER_BYTES >> 20))
}

/// A POST of JSON to the gateway.
pub(crate) fn request(authority: &str, path: &str, body: Bytes) -> Result<Request<Full<Bytes>>, EtcdError> {
    Request::post(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| EtcdError::BadUrl(format!("{authority}{path}: {e}")))
}

/// HTTP/1.1 on an open connection, driven by a task of its own.
async fn drive<S>(io: S) -> Result<(Sender, JoinHandle<()>), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = http1::handshake(TokioIo::new(io)).await.map_err(|e| format!("handshake: {e}"))?;
    let task = tokio::spawn(async move {
        // Its errors reach the request that was in flight.
        let _ = conn.await;
    });
    Ok((sender, task))
}

pub(crate) enum ReadError {
    Io(String),
    TooLarge,
}

/// The whole body, at most [`MAX_ANSWER_BYTES`].
pub(crate) async fn read_all(mut body: Incoming) -> Result<Bytes, ReadError> {
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Io(format!("reading the answer: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > MAX_ANSWER_BYTES {
                return Err(ReadError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(buf))
}
