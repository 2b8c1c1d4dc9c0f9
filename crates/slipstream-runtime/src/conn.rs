//! Accepted connections: which protocol a connection speaks, and serving it.
//!
//! The HTTP port serves gRPC too: gRPC clients speak HTTP/2 with prior
//! knowledge, so their connection opens with HTTP/2's preface (`PRI *
//! HTTP/2.0...`), and no HTTP/1.1 request line starts with `PRI`. The first
//! bytes are peeked (not read) and the connection goes whole to the HTTP/1.1
//! server or the gRPC one. One port per node is what lets several nodes
//! share a machine with `--port` alone; gRPC's own listener (Triton's 8001)
//! is there when the default layout or `--grpc-port` asks for it.

use crate::app::App;
use crate::pacing::ConnMemory;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

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

/// Serve a connection accepted on the HTTP port: gRPC when it opens with
/// HTTP/2's preface and the node serves gRPC, else HTTP/1.1. `admin_open`:
/// the listener is on loopback (see [`crate::http::handle`]).
pub(crate) fn spawn_http_port(app: &Arc<App>, admin_open: bool, stream: TcpStream, graceful: &GracefulShutdown) {
    let _ = stream.set_nodelay(true);
    let app = app.clone();
    let watcher = graceful.watcher();
    tokio::spawn(async move {
        if app.edge.grpc && opens_http2(&stream).await {
            return crate::grpc::serve_connection(&app, stream, watcher).await;
        }
        let a = app.clone();
        let told = Arc::new(ConnMemory::default());
        let conn = http1::Builder::new().keep_alive(true).serve_connection(
            TokioIo::new(stream),
            service_fn(move |req| crate::http::handle(a.clone(), admin_open, told.clone(), req)),
        );
        let _ = watcher.watch(conn).await;
    });
}

/// Serve a connection accepted on gRPC's own port.
pub(crate) fn spawn_grpc_port(app: &Arc<App>, stream: TcpStream, graceful: &GracefulShutdown) {
    let _ = stream.set_nodelay(true);
    let (app, watcher) = (app.clone(), graceful.watcher());
    tokio::spawn(async move { crate::grpc::serve_connection(&app, stream, watcher).await });
}
