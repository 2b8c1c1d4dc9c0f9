//! The calling side: one kept-open connection per peer address.

use crate::frame::{encode, Head, Incoming, Kind, Outgoing};
use crate::handshake::{check_node_id, establish, Established, ReadHalf, Role};
use crate::io::{writer_loop, FrameReader, Job, QUEUE_DEPTH};
use crate::{alloc_checked, Allocator, ClusterKey, CounterSnapshot, Counters, PeerConfig, PeerError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

type Reply<B> = Result<Incoming<B>, PeerError>;
type Waiter<B> = oneshot::Sender<Reply<B>>;
/// Where a call's partial replies go ([`Peers::call_with_parts`]).
pub type PartsTx<B> = mpsc::UnboundedSender<Incoming<B>>;

/// A call waiting for its reply, and for its parts if it asked for them.
struct Pending<B> {
    waiter: Waiter<B>,
    parts: Option<PartsTx<B>>,
}
type ConnectResult<A> = Option<Result<Arc<Conn<A>>, ConnectError>>;

/// Client side of the data plane: calls to other nodes.
///
/// One connection per peer address, opened on the first call (connect and
/// handshake in a task of its own; concurrent callers wait for the same
/// one) and kept open. Each connection has a writer task fed by a queue
/// (frames go out whole, in order, several per `writev` when they queue
/// up) and a reader task that hands each reply to the caller waiting on its
/// id. When a connection breaks, every call in flight on it fails at once
/// with [`PeerError::Disconnected`] and the next call opens a new one.
///
/// Cloning gives another handle on the same connections. When the last
/// handle is dropped, the connections are closed.
pub struct Peers<A: Allocator> {
    inner: Arc<Inner<A>>,
}

impl<A: Allocator> Clone for Peers<A> {
    fn clone(&self) -> Self {
        Peers { inner: self.inner.clone() }
    }
}

struct Inner<A: Allocator> {
    key: ClusterKey,
    node_id: String,
    alloc: Arc<A>,
    config: PeerConfig,
    merge_threshold: AtomicUsize,
    next_id: AtomicU64,
    counters: Arc<Counters>,
    conns: Mutex<HashMap<SocketAddr, Slot<A>>>,
}

enum Slot<A: Allocator> {
    Connecting(Arc<Connecting<A>>),
    Ready(Arc<Conn<A>>),
}

struct Connecting<A: Allocator> {
    done: watch::Sender<ConnectResult<A>>,
}

/// Why a connection could not be opened, shareable among its waiters.
#[derive(Clone, Debug)]
enum ConnectError {
    Refused,
    Untrusted(String),
    Io(std::io::ErrorKind, String),
    Abandoned(String),
}

impl From<ConnectError> for PeerError {
    fn from(e: ConnectError) -> PeerError {
        match e {
            ConnectError::Refused => PeerError::Refused,
            ConnectError::Untrusted(why) => PeerError::Untrusted(why),
            ConnectError::Io(kind, msg) => PeerError::Io(std::io::Error::new(kind, msg)),
            ConnectError::Abandoned(why) => PeerError::Disconnected(why),
        }
    }
}

struct Conn<A: Allocator> {
    addr: SocketAddr,
    peer_id: String,
    tx: mpsc::Sender<Job>,
    state: Mutex<ConnState<A::Buf>>,
    owner: Weak<Inner<A>>,
}

struct ConnState<B> {
    pending: HashMap<u64, Pending<B>>,
    /// Set once, when the connection is closed: why.
    closed: Option<String>,
    tasks: Vec<AbortHandle>,
}

impl<A: Allocator> Conn<A> {
    fn is_closed(&self) -> bool {
        self.state.lock().closed.is_some()
    }

    fn reason(&self) -> String {
        self.state.lock().closed.clone().unwrap_or_else(|| "connection closed".into())
    }

    fn take_waiter(&self, id: u64) -> Option<Waiter<A::Buf>> {
        self.state.lock().pending.remove(&id).map(|p| p.waiter)
    }

    /// Where call `id`'s parts go, if it waits and asked for them.
    fn parts_of(&self, id: u64) -> Option<PartsTx<A::Buf>> {
        self.state.lock().pending.get(&id).and_then(|p| p.parts.clone())
    }

    /// Close the connection: fail every call waiting on it, stop its tasks,
    /// and take it out of its [`Peers`] (so the next call reconnects).
    fn fail(self: &Arc<Self>, reason: String) {
        let (waiters, tasks) = {
            let mut st = self.state.lock();
            if st.closed.is_some() {
                return;
            }
            st.closed = Some(reason.clone());
            (std::mem::take(&mut st.pending), std::mem::take(&mut st.tasks))
        };
        // Out of the map first, so that a caller who sees the failure and
        // calls again gets a new connection.
        if let Some(inner) = self.owner.upgrade() {
            let mut map = inner.conns.lock();
            if matches!(map.get(&self.addr), Some(Slot::Ready(c)) if Arc::ptr_eq(c, self)) {
                map.remove(&self.addr);
            }
        }
        for (_, p) in waiters {
            let _ = p.waiter.send(Err(PeerError::Disconnected(reason.clone())));
        }
        for t in tasks {
            t.abort();
        }
    }
}

/// Removes a call's entry when the call ends, however it ends (a timed-out
/// call's late reply then finds no one and is discarded).
struct PendingGuard<'a, A: Allocator> {
    conn: &'a Conn<A>,
    id: u64,
}

impl<A: Allocator> Drop for PendingGuard<'_, A> {
    fn drop(&mut self) {
        self.conn.state.lock().pending.remove(&self.id);
    }
}

impl<A: Allocator> Drop for Inner<A> {
    fn drop(&mut self) {
        let slots: Vec<Slot<A>> = self.conns.get_mut().drain().map(|(_, s)| s).collect();
        for slot in slots {
            if let Slot::Ready(conn) = slot {
                conn.fail("the peer set was dropped".into());
            }
        }
    }
}

impl<A: Allocator> Peers<A> {
    /// `node_id` is what peers see (at most 255 bytes; longer panics).
    /// Tensors under `merge_threshold` bytes are merged (see
    /// [`crate::measure_costs`]); 0 disables merging.
    pub fn new(key: ClusterKey, node_id: String, alloc: Arc<A>, merge_threshold: usize) -> Peers<A> {
        Peers::with_config(key, node_id, alloc, PeerConfig { merge_threshold, ..PeerConfig::default() })
    }

    pub fn with_config(key: ClusterKey, node_id: String, alloc: Arc<A>, config: PeerConfig) -> Peers<A> {
        check_node_id(&node_id);
        Peers {
            inner: Arc::new(Inner {
                key,
                node_id,
                alloc,
                merge_threshold: AtomicUsize::new(config.merge_threshold),
                config,
                next_id: AtomicU64::new(1),
                counters: Arc::new(Counters::default()),
                conns: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn set_merge_threshold(&self, n: usize) {
        self.inner.merge_threshold.store(n, Relaxed);
    }

    pub fn merge_threshold(&self) -> usize {
        self.inner.merge_threshold.load(Relaxed)
    }

    pub fn counters(&self) -> CounterSnapshot {
        self.inner.counters.snapshot()
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.inner.conns.lock().values().filter(|s| matches!(s, Slot::Ready(_))).count()
    }

    /// The node id the peer at `addr` gave in its handshake, if connected.
    pub fn peer_id(&self, addr: SocketAddr) -> Option<String> {
        match self.inner.conns.lock().get(&addr) {
            Some(Slot::Ready(c)) => Some(c.peer_id.clone()),
            _ => None,
        }
    }

    /// Close the connection to `addr` (a node left). Calls in flight on it
    /// fail with [`PeerError::Disconnected`]; a later call reconnects.
    pub fn forget(&self, addr: SocketAddr) {
        let slot = self.inner.conns.lock().remove(&addr);
        if let Some(Slot::Ready(conn)) = slot {
            conn.fail("the connection was closed by forget()".into());
        }
        // A connect in progress notices it was forgotten when it finishes.
    }

    /// Send `msg` as a Call (its kind and id are set here) and wait for the
    /// reply, connecting first if needed; `timeout` bounds all of it.
    ///
    /// An Error reply is [`PeerError::Remote`]; a reply whose payload could
    /// not be allocated is [`PeerError::Alloc`] (the connection stays up).
    pub async fn call(
        &self,
        addr: SocketAddr,
        msg: Outgoing,
        timeout: Duration,
    ) -> Result<Incoming<A::Buf>, PeerError> {
        match tokio::time::timeout(timeout, self.call_inner(addr, msg, None)).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout),
        }
    }

    /// [`Peers::call`] for a call answered in parts: each partial reply
    /// ([`crate::Parts`]) goes to `parts` as it arrives, all of them before
    /// this returns the reply. Parts that arrive after the call ended (it
    /// timed out, say) are dropped.
    pub async fn call_with_parts(
        &self,
        addr: SocketAddr,
        msg: Outgoing,
        timeout: Duration,
        parts: PartsTx<A::Buf>,
    ) -> Result<Incoming<A::Buf>, PeerError> {
        match tokio::time::timeout(timeout, self.call_inner(addr, msg, Some(parts))).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout),
        }
    }

    async fn call_inner(
        &self,
        addr: SocketAddr,
        mut msg: Outgoing,
        parts: Option<PartsTx<A::Buf>>,
    ) -> Result<Incoming<A::Buf>, PeerError> {
        msg.kind = Kind::Call;
        msg.id = self.inner.next_id.fetch_add(1, Relaxed);
        let id = msg.id;
        let threshold = self.inner.merge_threshold.load(Relaxed);
        let job: Job = encode(&msg, threshold, &self.inner.config.limits())
            .map_err(|e| PeerError::BadFrame(format!("not sent: {e}")))?
            .into();
        drop(msg);
        let conn = self.connection(addr).await?;
        let (wtx, wrx) = oneshot::channel();
        {
            let mut st = conn.state.lock();
            if let Some(why) = &st.closed {
                return Err(PeerError::Disconnected(why.clone()));
            }
            st.pending.insert(id, Pending { waiter: wtx, parts });
        }
        let _guard = PendingGuard { conn: &conn, id };
        if conn.tx.send(job).await.is_err() {
            return Err(PeerError::Disconnected(conn.reason()));
        }
        match wrx.await {
            Ok(reply) => reply,
            Err(_) => Err(PeerError::Disconnected(conn.reason())),
        }
    }

    /// The open connection to `addr`, or the result of opening one.
    async fn connection(&self, addr: SocketAddr) -> Result<Arc<Conn<A>>, PeerError> {
        let mut rx = {
            let mut map = self.inner.conns.lock();
            match map.get(&addr) {
                Some(Slot::Ready(c)) if !c.is_closed() => return Ok(c.clone()),
                Some(Slot::Connecting(c)) => c.done.subscribe(),
                _ => {
                    let (done, rx) = watch::channel(None);
                    let connecting = Arc::new(Connecting { done });
                    map.insert(addr, Slot::Connecting(connecting.clone()));
                    tokio::spawn(connect_task(self.inner.clone(), addr, connecting));
                    rx
                }
            }
        };
        let result = match rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            Err(_) => return Err(PeerError::Disconnected("the connect task ended".into())),
        };
        match result {
            Some(Ok(conn)) => Ok(conn),
            Some(Err(e)) => Err(e.into()),
            None => Err(PeerError::Disconnected("the connect task ended".into())),
        }
    }
}

/// Open a connection and publish it (or why it failed) to every waiter.
async fn connect_task<A: Allocator>(inner: Arc<Inner<A>>, addr: SocketAddr, me: Arc<Connecting<A>>) {
    let opened = open(&inner, addr).await;
    let mut map = inner.conns.lock();
    let ours = matches!(map.get(&addr), Some(Slot::Connecting(c)) if Arc::ptr_eq(c, &me));
    let result = match (opened, ours) {
        (Ok(conn), true) => {
            map.insert(addr, Slot::Ready(conn.clone()));
            Ok(conn)
        }
        (Ok(conn), false) => {
            drop(map);
            conn.fail("forgotten while connecting".into());
            Err(ConnectError::Abandoned("forgotten while connecting".into()))
        }
        (Err(e), ours) => {
            if ours {
                map.remove(&addr);
            }
            Err(e)
        }
    };
    me.done.send_replace(Some(result));
}

async fn open<A: Allocator>(inner: &Arc<Inner<A>>, addr: SocketAddr) -> Result<Arc<Conn<A>>, ConnectError> {
    let limit = inner.config.handshake_timeout;
    let stream = match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(ConnectError::Io(e.kind(), format!("connect to {addr}: {e}"))),
        Err(_) => return Err(ConnectError::Io(std::io::ErrorKind::TimedOut, format!("connect to {addr} timed out"))),
    };
    let Established { peer_id, rd, wr } =
        establish(stream, addr, &inner.key, &inner.node_id, Role::Client, &inner.config).await.map_err(
            |e| match e {
                PeerError::Untrusted(why) => ConnectError::Untrusted(why),
                _ => ConnectError::Refused,
            },
        )?;
    let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
    let conn = Arc::new(Conn {
        addr,
        peer_id,
        tx,
        state: Mutex::new(ConnState { pending: HashMap::new(), closed: None, tasks: Vec::new() }),
        owner: Arc::downgrade(inner),
    });
    let writer = tokio::spawn({
        let conn = conn.clone();
        let counters = inner.counters.clone();
        async move {
            let why = match writer_loop(wr, rx, counters).await {
                Ok(()) => "the writer stopped".to_string(),
                Err(e) => format!("write failed: {e}"),
            };
            conn.fail(why);
        }
    });
    let reader =
        tokio::spawn(reader_task(conn.clone(), rd, inner.alloc.clone(), inner.counters.clone(), inner.config.limits()));
    let handles = [writer.abort_handle(), reader.abort_handle()];
    let mut st = conn.state.lock();
    if st.closed.is_some() {
        // Failed already (before it could record its tasks): stop them here.
        handles.iter().for_each(AbortHandle::abort);
    } else {
        st.tasks.extend(handles);
    }
    drop(st);
    Ok(conn)
}

async fn reader_task<A: Allocator>(
    conn: Arc<Conn<A>>,
    rd: ReadHalf,
    alloc: Arc<A>,
    counters: Arc<Counters>,
    limits: crate::frame::Limits,
) {
    let mut reader = FrameReader::new(rd, limits);
    let why = loop {
        match read_reply(&conn, &mut reader, &*alloc, &counters).await {
            Ok(true) => {}
            Ok(false) => break "closed by the peer".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    conn.fail(why);
}

/// Read one frame and hand it to its caller. `Ok(false)` at end of stream.
async fn read_reply<A: Allocator>(
    conn: &Conn<A>,
    reader: &mut FrameReader<ReadHalf>,
    alloc: &A,
    counters: &Counters,
) -> Result<bool, PeerError> {
    let Some(head) = reader.read_head().await? else { return Ok(false) };
    counters.received(&head);
    if head.kind == Kind::Call {
        return Err(PeerError::BadFrame("a Call frame on a client connection".into()));
    }
    if head.kind == Kind::Part {
        return read_part(conn, reader, alloc, counters, head).await;
    }
    let Head { kind, id, meta, tensors, payload_len, .. } = head;
    let Some(waiter) = conn.take_waiter(id) else {
        // A late reply (its call timed out) or an id we never sent.
        reader.skip_payload(payload_len).await?;
        return Ok(true);
    };
    if kind == Kind::Error {
        if let Err(e) = reader.skip_payload(payload_len).await {
            let _ = waiter.send(Err(PeerError::Disconnected(e.to_string())));
            return Err(e.into());
        }
        let _ = waiter.send(Err(PeerError::Remote(String::from_utf8_lossy(&meta).into_owned())));
        return Ok(true);
    }
    match read_into(reader, alloc, counters, payload_len).await {
        // If the caller gave up meanwhile, this drops the buffer.
        Ok(Ok(buf)) => {
            let _ = waiter.send(Ok(Incoming { kind, id, meta, tensors, payload: buf }));
        }
        Ok(Err(why)) => {
            let _ = waiter.send(Err(PeerError::Alloc(why)));
        }
        Err(e) => {
            let _ = waiter.send(Err(PeerError::Disconnected(e.to_string())));
            return Err(e.into());
        }
    }
    Ok(true)
}

/// A frame's payload, read into a buffer of `alloc`'s. `Ok(Err(why))`:
/// no buffer could be had, so the payload was read and dropped (the
/// connection stays usable); Err: the connection failed.
async fn read_into<A: Allocator>(
    reader: &mut FrameReader<ReadHalf>,
    alloc: &A,
    counters: &Counters,
    payload_len: u64,
) -> std::io::Result<Result<A::Buf, String>> {
    let buf = usize::try_from(payload_len).map_err(|e| e.to_string()).and_then(|n| alloc_checked(alloc, n));
    match buf {
        Ok(mut buf) => {
            reader.read_payload(&mut buf.as_mut()[..payload_len as usize]).await?;
            Ok(Ok(buf))
        }
        Err(why) => {
            counters.alloc_failed();
            reader.skip_payload(payload_len).await?;
            Ok(Err(why))
        }
    }
}

/// Read a partial reply and hand it to its call's parts. A part that
/// cannot be received (no room for its payload) fails its call, since
/// the answer would be incomplete without it.
async fn read_part<A: Allocator>(
    conn: &Conn<A>,
    reader: &mut FrameReader<ReadHalf>,
    alloc: &A,
    counters: &Counters,
    head: Head,
) -> Result<bool, PeerError> {
    let Head { kind, id, meta, tensors, payload_len, .. } = head;
    let Some(parts) = conn.parts_of(id) else {
        // Its call ended, or never asked for parts.
        reader.skip_payload(payload_len).await?;
        return Ok(true);
    };
    match read_into(reader, alloc, counters, payload_len).await? {
        Ok(buf) => {
            let _ = parts.send(Incoming { kind, id, meta, tensors, payload: buf });
        }
        Err(why) => {
            if let Some(waiter) = conn.take_waiter(id) {
                let _ = waiter.send(Err(PeerError::Alloc(format!("a partial reply: {why}"))));
            }
        }
    }
    Ok(true)
}
