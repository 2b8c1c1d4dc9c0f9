//! The answering side: accept authenticated connections and run a handler
//! per Call.

use crate::frame::{encode, encode_error, Incoming, Kind, Limits, OutTensor, Outgoing};
use crate::handshake::{check_node_id, establish, Established, ReadHalf, Role};
use crate::io::{writer_loop, FrameReader, Job, QUEUE_DEPTH};
use crate::{alloc_checked, Allocator, ClusterKey, CounterSnapshot, Counters, PeerConfig, PeerError};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

/// What a running server shares with its handle.
#[derive(Debug, Default)]
struct ServerState {
    refused: AtomicU64,
    open: AtomicUsize,
    merge_threshold: AtomicUsize,
    counters: Arc<Counters>,
}

struct Shared<A, H> {
    key: ClusterKey,
    node_id: String,
    alloc: Arc<A>,
    config: PeerConfig,
    handler: H,
    state: Arc<ServerState>,
}

/// A running server (see [`serve`]). Dropping it, or [`ServerHandle::shutdown`],
/// stops accepting and closes every connection: calls in flight on them fail
/// on their callers' side with [`PeerError::Disconnected`], and handlers
/// still running for them are cancelled (dropped).
pub struct ServerHandle {
    task: Option<JoinHandle<()>>,
    local_addr: Option<SocketAddr>,
    state: Arc<ServerState>,
}

/// A server's counters, readable after the handle moved elsewhere (cheap to
/// clone; keeps nothing of the server alive but its counters).
#[derive(Clone, Debug)]
pub struct ServerStats(Arc<ServerState>);

impl ServerStats {
    /// Handshakes that failed (see [`ServerHandle::refused`]).
    pub fn refused(&self) -> u64 {
        self.0.refused.load(Relaxed)
    }

    /// Authenticated connections open now.
    pub fn connections(&self) -> usize {
        self.0.open.load(Relaxed)
    }

    /// What the server sent (replies) and received (calls).
    pub fn counters(&self) -> CounterSnapshot {
        self.0.counters.snapshot()
    }
}

impl ServerHandle {
    /// Its counters, as a handle of their own.
    pub fn stats(&self) -> ServerStats {
        ServerStats(self.state.clone())
    }

    /// Handshakes that failed (wrong token, another protocol, too slow).
    pub fn refused(&self) -> u64 {
        self.state.refused.load(Relaxed)
    }

    /// Authenticated connections open now.
    pub fn connections(&self) -> usize {
        self.state.open.load(Relaxed)
    }

    /// What the server sent (replies) and received (calls).
    pub fn counters(&self) -> CounterSnapshot {
        self.state.counters.snapshot()
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// For replies encoded from now on.
    pub fn set_merge_threshold(&self, n: usize) {
        self.state.merge_threshold.store(n, Relaxed);
    }

    /// Stop at once (as dropping does), and wait until the listening socket
    /// is closed, so that the port can be bound again.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// [`serve_with_config`] with the default limits and timeouts.
pub fn serve<A, H, F>(
    listener: TcpListener,
    key: ClusterKey,
    node_id: String,
    alloc: Arc<A>,
    merge_threshold: usize,
    handler: H,
) -> ServerHandle
where
    A: Allocator,
    H: Fn(String, Incoming<A::Buf>, Parts) -> F + Send + Sync + 'static,
    F: Future<Output = Outgoing> + Send + 'static,
{
    serve_with_config(listener, key, node_id, alloc, PeerConfig { merge_threshold, ..PeerConfig::default() }, handler)
}

/// Serve calls on `listener`, in tasks spawned on the current Tokio runtime
/// (call it from inside one); returns at once.
///
/// Each connection is authenticated first (a failure is counted in
/// [`ServerHandle::refused`] and closes it, and nothing else happens: no
/// handler runs, nothing is logged). Then every Call runs
/// `handler(peer node id, call, parts)` in a task of its own (`parts`
/// sends partial replies before the answer: [`Parts`]); the Outgoing it
/// returns goes back on the same connection under the call's id, in
/// whatever order handlers finish. Its kind is kept if Reply or Error (a
/// Call becomes a Reply); a reply that breaks the frame limits is replaced
/// by an Error. A call whose payload cannot be allocated gets an Error
/// reply saying why, without running the handler.
///
/// `node_id` must be at most 255 bytes (longer panics).
pub fn serve_with_config<A, H, F>(
    listener: TcpListener,
    key: ClusterKey,
    node_id: String,
    alloc: Arc<A>,
    config: PeerConfig,
    handler: H,
) -> ServerHandle
where
    A: Allocator,
    H: Fn(String, Incoming<A::Buf>, Parts) -> F + Send + Sync + 'static,
    F: Future<Output = Outgoing> + Send + 'static,
{
    check_node_id(&node_id);
    let state =
        Arc::new(ServerState { merge_threshold: AtomicUsize::new(config.merge_threshold), ..Default::default() });
    let local_addr = listener.local_addr().ok();
    let shared = Arc::new(Shared { key, node_id, alloc, config, handler, state: state.clone() });
    let task = tokio::spawn(accept_loop(listener, shared));
    ServerHandle { task: Some(task), local_addr, state }
}

async fn accept_loop<A, H, F>(listener: TcpListener, shared: Arc<Shared<A, H>>)
where
    A: Allocator,
    H: Fn(String, Incoming<A::Buf>, Parts) -> F + Send + Sync + 'static,
    F: Future<Output = Outgoing> + Send + 'static,
{
    // Owned here, so that stopping this task (dropping the set) stops them all.
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, from)) => {
                    conns.spawn(serve_conn(stream, from, shared.clone()));
                }
                // Out of file descriptors and the like: wait, then go on.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Decrements the open-connection count however the connection ends.
struct OpenGuard(Arc<ServerState>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve_conn<A, H, F>(stream: TcpStream, from: SocketAddr, shared: Arc<Shared<A, H>>)
where
    A: Allocator,
    H: Fn(String, Incoming<A::Buf>, Parts) -> F + Send + Sync + 'static,
    F: Future<Output = Outgoing> + Send + 'static,
{
    let hs = establish(stream, from, &shared.key, &shared.node_id, Role::Server, &shared.config).await;
    let Established { peer_id: peer, rd, wr } = match hs {
        Ok(e) => e,
        Err(_) => {
            shared.state.refused.fetch_add(1, Relaxed);
            return;
        }
    };
    shared.state.open.fetch_add(1, Relaxed);
    let _open = OpenGuard(shared.state.clone());
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let mut writer = tokio::spawn(writer_loop(wr, rx, shared.state.counters.clone()));
    let _stop_writer = AbortOnDrop(writer.abort_handle());
    let mut reader = FrameReader::new(rd, shared.config.limits());
    loop {
        tokio::select! {
            more = serve_one(&mut reader, &shared, &peer, &tx) => match more {
                Ok(true) => {}
                // End of stream, an I/O error or a bad frame: close.
                _ => break,
            },
            // The writer failed (or cannot go on): close.
            _ = &mut writer => break,
        }
    }
    // Dropping the writer (via the guard) and the reader closes the socket;
    // handlers still running see the queue close and stop.
}

/// Read one Call and start its handler. `Ok(false)` at end of stream.
async fn serve_one<A, H, F>(
    reader: &mut FrameReader<ReadHalf>,
    shared: &Arc<Shared<A, H>>,
    peer: &str,
    tx: &mpsc::Sender<Job>,
) -> Result<bool, PeerError>
where
    A: Allocator,
    H: Fn(String, Incoming<A::Buf>, Parts) -> F + Send + Sync + 'static,
    F: Future<Output = Outgoing> + Send + 'static,
{
    let Some(head) = reader.read_head().await? else { return Ok(false) };
    shared.state.counters.received(&head);
    if head.kind != Kind::Call {
        return Err(PeerError::BadFrame(format!("a {:?} frame on a server connection", head.kind)));
    }
    let id = head.id;
    let buf =
        usize::try_from(head.payload_len).map_err(|e| e.to_string()).and_then(|n| alloc_checked(&*shared.alloc, n));
    let mut buf = match buf {
        Ok(buf) => buf,
        Err(why) => {
            shared.state.counters.alloc_failed();
            reader.skip_payload(head.payload_len).await?;
            let job = encode_error(id, &format!("cannot allocate {} bytes for the call: {why}", head.payload_len));
            return Ok(tx.send(job.into()).await.is_ok());
        }
    };
    reader.read_payload(&mut buf.as_mut()[..head.payload_len as usize]).await?;
    let call = Incoming { kind: head.kind, id, meta: head.meta, tensors: head.tensors, payload: buf };
    let shared = shared.clone();
    let peer = peer.to_string();
    let tx = tx.clone();
    let threshold = shared.state.merge_threshold.load(Relaxed);
    let parts = Parts { tx: tx.clone(), id, limits: shared.config.limits(), threshold };
    tokio::spawn(async move {
        let mut guard = PanicReply { tx: Some(tx.clone()), id };
        let fut = (shared.handler)(peer, call, parts);
        let out = tokio::select! {
            out = fut => out,
            // The connection closed: nobody to answer.
            _ = tx.closed() => return,
        };
        guard.tx = None;
        let job = reply_job(out, id, &shared.config, shared.state.merge_threshold.load(Relaxed));
        let _ = tx.send(job).await;
    });
    Ok(true)
}

/// A handler's way to answer its call in parts: each [`Parts::send`] goes
/// out as a [`Kind::Part`] frame under the call's id, in the order sent,
/// and all of them before the call's reply (one queue carries them all).
/// The caller receives them with [`crate::Peers::call_with_parts`]; a
/// caller that did not ask for parts has them dropped on arrival.
#[derive(Clone)]
pub struct Parts {
    tx: mpsc::Sender<Job>,
    id: u64,
    limits: Limits,
    threshold: usize,
}

impl Parts {
    /// Send one partial reply (waiting while the connection's queue is
    /// full). False if it could not go: the connection closed, or the part
    /// breaks the frame limits.
    pub async fn send(&self, meta: Vec<u8>, tensors: Vec<OutTensor>) -> bool {
        let msg = Outgoing { kind: Kind::Part, id: self.id, meta, tensors };
        match encode(&msg, self.threshold, &self.limits) {
            Ok(e) => self.tx.send(e.into()).await.is_ok(),
            Err(_) => false,
        }
    }
}

/// If a handler panics, its task unwinds through this, and the caller gets
/// an Error reply at once instead of waiting out its timeout.
struct PanicReply {
    tx: Option<mpsc::Sender<Job>>,
    id: u64,
}

impl Drop for PanicReply {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.try_send(encode_error(self.id, "the handler panicked").into());
        }
    }
}

fn reply_job(mut out: Outgoing, id: u64, config: &PeerConfig, threshold: usize) -> Job {
    out.id = id;
    if matches!(out.kind, Kind::Call | Kind::Part) {
        out.kind = Kind::Reply;
    }
    match encode(&out, threshold, &config.limits()) {
        Ok(e) => e.into(),
        Err(why) => encode_error(id, &format!("the handler's reply cannot be sent: {why}")).into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{prefix, OutTensor};
    use crate::handshake::handshake;
    use crate::{Peers, VecAlloc};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that holds the token but sends a malformed frame loses its
    /// connection; the server goes on serving others.
    #[tokio::test]
    async fn a_bad_frame_after_the_handshake_closes_the_connection() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let key = ClusterKey::from_token("t");
        let server = serve(l, key.clone(), "s".into(), Arc::new(VecAlloc), 64, |_, call, _| async move {
            Outgoing::reply(call.meta, vec![])
        });
        for bad in [
            b"definitely not a frame header, 32+".to_vec(),
            prefix(Kind::Call, 1, 0, 0, u64::MAX).to_vec(),
            prefix(Kind::Reply, 1, 0, 0, 0).to_vec(),
        ] {
            let mut s = TcpStream::connect(addr).await.unwrap();
            handshake(&mut s, &key, "raw", Role::Client, Duration::from_secs(2)).await.unwrap();
            s.write_all(&bad).await.unwrap();
            let mut buf = [0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await.unwrap();
            assert!(matches!(n, Ok(0) | Err(_)), "the connection stays open after {bad:?}");
        }
        assert_eq!(server.refused(), 0);
        let peers = Peers::new(key, "c".into(), Arc::new(VecAlloc), 64);
        let msg = Outgoing::call(
            b"ok".to_vec(),
            vec![OutTensor {
                name: "x".into(),
                dtype: slipstream_types::DType::Uint8,
                shape: vec![1],
                data: bytes::Bytes::from_static(b"z"),
            }],
        );
        let reply = peers.call(addr, msg, Duration::from_secs(5)).await.unwrap();
        assert_eq!(reply.meta, b"ok");
    }
}
