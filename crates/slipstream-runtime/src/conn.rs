//! Accepted connections: which protocol a connection speaks, and serving it.
//!
//! The HTTP port serves gRPC too: gRPC clients speak HTTP/2 with prior
//! knowledge, so their connection opens with HTTP/2's preface (`PRI *
//! HTTP/2.0...`), and no HTTP/1.1 request line starts with `PRI`. The first
//! bytes are peeked (not read) and the connection goes whole to the HTTP/1.1
//! server or the gRPC one. One port per node is what lets several nodes
//! share a machine with `--port` alone; gRPC's own listener (Triton's 8001)
//! is there when the default layout or `--grpc-port` asks for it.
//!
//! With `ingress_tls`, both ports speak TLS: a connection whose first byte
//! is a TLS handshake record (0x16) is accepted with the node's certificate,
//! and ALPN decides between gRPC (`h2`) and HTTP/1.1. A plain connection is
//! still served when it comes from this machine (the node's own workers
//! read the store through it, and local tools need no certificate); from
//! anywhere else it is answered 400 "this port speaks TLS" and closed, so
//! nothing crosses the network in the clear.

use crate::app::App;
use crate::pacing::ConnMemory;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::server::graceful::Watcher;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The first byte of a TLS connection: a handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// How long a TLS handshake may take.
const TLS_PATIENCE: Duration = Duration::from_secs(10);

/// How an HTTP/2 connection opens; three bytes tell it from HTTP/1.1.
const H2_PREFACE: &[u8] = b"PRI";

/// How long a connection may take to send its first three bytes before it
/// is taken for HTTP/1.1 (whose server then applies its own patience).
const SNIFF_PATIENCE: Duration = Duration::from_millis(200);

/// Whether the connection opens with HTTP/2's preface. A peer that sends
/// fewer bytes than that at first is waited for briefly, a millisecond at a
/// time (clients send the preface in one write, so this is rare).
async fn opens_http2(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 3];
    let start = tokio::time::Instant::now();
    loop {
        let n = match stream.peek(&mut buf).await {
            Ok(n) => n,
            Err(_) => return false,
        };
        if n == 0 || buf[..n] != H2_PREFACE[..n] {
            return false;
        }
        if n == H2_PREFACE.len() {
            return true;
        }
        if start.elapsed() > SNIFF_PATIENCE {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// HTTP/1.1 on a connection, until it closes or the graceful shutdown ends it.
async fn serve_http1<S>(app: Arc<App>, admin_open: bool, io: S, watcher: Watcher)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let told = Arc::new(ConnMemory::default());
    let conn = http1::Builder::new().keep_alive(true).serve_connection(
        TokioIo::new(io),
        service_fn(move |req| crate::http::handle(app.clone(), admin_open, told.clone(), req)),
    );
    let _ = watcher.watch(conn).await;
}

/// What a connection to a TLS port turned out to be.
enum Secured {
    /// The handshake finished: the stream (boxed: a TLS session is large),
    /// and whether ALPN chose HTTP/2.
    Tls(Box<slipstream_tls::ServerTlsStream<TcpStream>>, bool),
    /// Plain, from this machine: served as on a plain port.
    Local(TcpStream),
    /// Neither: answered (or dropped) already.
    Refused,
}

/// Take a connection on a TLS port (see the module docs).
async fn secure(tls: &slipstream_tls::IngressTls, mut stream: TcpStream) -> Secured {
    let mut first = [0u8; 1];
    let tls_hello = matches!(
        tokio::time::timeout(TLS_PATIENCE, stream.peek(&mut first)).await,
        Ok(Ok(1)) if first[0] == TLS_HANDSHAKE
    );
    if !tls_hello {
        if stream.peer_addr().is_ok_and(|a| a.ip().is_loopback()) {
            return Secured::Local(stream);
        }
        let body = "this port speaks TLS: use https:// (or gRPC with TLS)\n";
        let answer = format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        // Read the request first: closing over unread bytes would reset the
        // connection before the client reads the answer.
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let mut sink = [0u8; 8192];
            let _ = stream.read(&mut sink).await;
            stream.write_all(answer.as_bytes()).await?;
            stream.shutdown().await
        })
        .await;
        return Secured::Refused;
    }
    match tokio::time::timeout(TLS_PATIENCE, tls.acceptor().accept(stream)).await {
        Ok(Ok(s)) => {
            let h2 = s.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
            Secured::Tls(Box::new(s), h2)
        }
        // A failed or slow handshake: the client learns from TLS itself.
        _ => Secured::Refused,
    }
}

/// Serve a connection accepted on the HTTP port: gRPC when it opens with
/// HTTP/2's preface (or, over TLS, chose `h2`) and the node serves gRPC,
/// else HTTP/1.1. `admin_open`: the listener is on loopback (see
/// [`crate::http::handle`]).
pub(crate) fn spawn_http_port(app: &Arc<App>, admin_open: bool, stream: TcpStream, graceful: &GracefulShutdown) {
    let _ = stream.set_nodelay(true);
    let app = app.clone();
    let watcher = graceful.watcher();
    tokio::spawn(async move {
        let stream = match &app.edge.tls {
            None => stream,
            Some(tls) => match secure(tls, stream).await {
                Secured::Tls(s, true) if app.edge.grpc => return crate::grpc::serve_connection(&app, s, watcher).await,
                Secured::Tls(s, _) => return serve_http1(app, admin_open, s, watcher).await,
                Secured::Local(s) => s,
                Secured::Refused => return,
            },
        };
        if app.edge.grpc && opens_http2(&stream).await {
            return crate::grpc::serve_connection(&app, stream, watcher).await;
        }
        serve_http1(app, admin_open, stream, watcher).await
    });
}

/// Serve a connection accepted on gRPC's own port.
pub(crate) fn spawn_grpc_port(app: &Arc<App>, stream: TcpStream, graceful: &GracefulShutdown) {
    let _ = stream.set_nodelay(true);
    let (app, watcher) = (app.clone(), graceful.watcher());
    tokio::spawn(async move {
        match &app.edge.tls {
            None => crate::grpc::serve_connection(&app, stream, watcher).await,
            Some(tls) => match secure(tls, stream).await {
                Secured::Tls(s, _) => crate::grpc::serve_connection(&app, s, watcher).await,
                Secured::Local(s) => crate::grpc::serve_connection(&app, s, watcher).await,
                Secured::Refused => {}
            },
        }
    });
}
