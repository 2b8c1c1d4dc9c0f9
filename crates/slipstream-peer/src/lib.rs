//! The data plane between nodes: a node hands the tensors of a request to
//! the node that runs the next pipeline stage, over direct TCP.
//!
//! Connections are kept open, one per peer and direction, and carry many
//! requests at once: each frame has an id, replies come back in whatever
//! order they finish, and a reader task matches them to waiting callers.
//! A call may be answered in parts (a streaming stage's chunks): partial
//! replies under the call's id, each before its reply ([`Parts`]).
//! One writer task per connection writes whole frames in queue order, and
//! takes every frame queued behind the first into the same write.
//!
//! A frame is a small header (fixed prefix, the runtime's own metadata, a
//! table of tensors) followed by the payload. The choices, and why:
//! - **Vectored writes.** The sender does not assemble a frame in one
//!   buffer: it hands the kernel a list of segments (header, then each large
//!   tensor's own memory, shared-memory slices wrapped as `Bytes`) in one
//!   `writev`. A 6 MB tensor is copied once, by the kernel into the socket,
//!   never by us.
//! - **The payload layout is the receive layout.** Each tensor sits at a
//!   64-byte-aligned offset of the payload, in table order, with zero padding
//!   between. The receiver validates the table, allocates `payload_len` bytes
//!   (in the runtime, a block of its shared-memory arena) and reads the whole
//!   payload with one `read_exact` straight into it; the tensors are then
//!   usable in place, already aligned. Only the part of the payload that
//!   arrived in the same socket read as the header (at most the 64 KiB read
//!   buffer) is copied from that buffer.
//! - **Small tensors are merged.** A segment costs the kernel a fixed amount
//!   per `iovec` entry, which for a 64-byte tensor is far more than copying
//!   it. So a run of consecutive tensors below `merge_threshold` bytes is
//!   copied into one buffer (the first run into the header's own buffer),
//!   with the padding inside it: the Zero paper's dynamic tensor merging. The
//!   threshold comes from [`measure_costs`] at start-up: the size at which a
//!   copy costs as much as a segment on this machine.
//! - **Mutual HMAC handshake.** Nodes share a cluster token. On connect both
//!   sides send a hello with a fresh random nonce, then each proves it holds
//!   the key by sending an HMAC over both hellos under its own role label, and
//!   checks the other's proof. The token never crosses the wire, a recorded
//!   handshake cannot be replayed (the other side's nonce is new), and a
//!   process without the token cannot get as far as sending a frame. The
//!   token alone keeps strangers out; it does not hide or protect the
//!   frames from someone on the path.
//! - **Mutual TLS, optional** ([`PeerConfig::tls`], rustls, TLS 1.3): both
//!   sides show a certificate of the cluster's CA, the token handshake runs
//!   inside the encrypted channel, and each side then checks that the
//!   other's certificate is issued for the node id it gave. Frames are then
//!   encrypted and authenticated. The cost: rustls encrypts into its own
//!   buffer, so the send is no longer zero-copy (a copy on each side), and
//!   the two halves of a connection share one lock. Off, a trusted network
//!   keeps the zero-copy path.
//!
//! Every frame read is checked with checked arithmetic against fixed limits
//! before anything is allocated for it (see [`frame`]); a malformed frame
//! closes the connection, because its sender is broken or hostile. A
//! receive buffer that cannot be allocated only fails that one frame: its
//! payload is read and dropped and the connection stays usable.
//!
//! Client side: [`Peers`]. Server side: [`serve`]. Both count what they send
//! in [`Counters`].

mod auth;
mod client;
mod costs;
pub mod frame;
mod handshake;
mod io;
mod server;

pub use auth::ClusterKey;
pub use client::{PartsTx, Peers};
pub use costs::{measure_costs, Costs, MAX_MERGE_THRESHOLD, MIN_MERGE_THRESHOLD};
pub use frame::{InTensor, Incoming, Kind, OutTensor, Outgoing};
pub use handshake::MAX_NODE_ID;
pub use server::{serve, serve_with_config, Parts, ServerHandle, ServerStats};

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Merge threshold used when nothing was measured (see [`measure_costs`]).
pub const DEFAULT_MERGE_THRESHOLD: usize = 1024;

/// How long connect plus handshake may take by default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The handshake failed: the other side has another cluster token or
    /// protocol version, sent something else, or did not finish in time.
    #[error("the peer handshake was refused (different cluster token or protocol version, or timed out)")]
    Refused,
    /// TLS with the peer failed: its certificate is not of the cluster's
    /// CA or not issued for the node id it gave, or it speaks no TLS.
    #[error("the peer is not trusted: {0}")]
    Untrusted(String),
    /// The connection broke (or was closed) while the call was in flight.
    #[error("peer connection lost: {0}")]
    Disconnected(String),
    /// The call did not complete within its timeout.
    #[error("peer call timed out")]
    Timeout,
    /// A malformed frame arrived (the connection is closed), or an outgoing
    /// message breaks the frame limits (`not sent: ...`; nothing was sent
    /// and the connection is unaffected).
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// No receive buffer for the reply; the connection stays usable.
    #[error("cannot allocate a receive buffer: {0}")]
    Alloc(String),
    #[error("peer i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer answered with an Error frame; its metadata, as text.
    #[error("the peer answered with an error: {0}")]
    Remote(String),
}

/// Where received payloads go. The runtime's implementation hands out
/// blocks of its shared-memory arena; [`VecAlloc`] uses the heap.
///
/// `alloc` is called once per received frame, after the frame's header was
/// validated (so `nbytes` is at most the configured payload limit), and may
/// be called with 0. The buffer returned must be at least `nbytes` long; the
/// payload is read into its first `nbytes` bytes.
pub trait Allocator: Send + Sync + 'static {
    type Buf: AsMut<[u8]> + Send + 'static;
    fn alloc(&self, nbytes: usize) -> Result<Self::Buf, String>;
}

/// Heap buffers (`Vec<u8>`, zero-filled), failing instead of aborting when
/// the memory is not there.
#[derive(Clone, Copy, Debug, Default)]
pub struct VecAlloc;

impl Allocator for VecAlloc {
    type Buf = Vec<u8>;
    fn alloc(&self, nbytes: usize) -> Result<Vec<u8>, String> {
        let mut v = Vec::new();
        v.try_reserve_exact(nbytes).map_err(|e| e.to_string())?;
        v.resize(nbytes, 0);
        Ok(v)
    }
}

/// Settings shared by [`Peers`] and [`serve`].
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// Tensors smaller than this many bytes are merged; 0 disables merging.
    pub merge_threshold: usize,
    /// Largest payload accepted in a received frame (and sent).
    pub max_payload: u64,
    /// Bound on TCP connect and on the whole handshake.
    pub handshake_timeout: Duration,
    /// Mutual TLS on every connection (both sides must have it).
    pub tls: Option<slipstream_tls::NodeTls>,
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig {
            merge_threshold: DEFAULT_MERGE_THRESHOLD,
            max_payload: frame::DEFAULT_MAX_PAYLOAD,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            tls: None,
        }
    }
}

impl PeerConfig {
    fn limits(&self) -> frame::Limits {
        frame::Limits { max_payload: self.max_payload }
    }
}

/// What a set of connections (one [`Peers`], or one server) sent and received.
#[derive(Debug, Default)]
pub struct Counters {
    frames_sent: AtomicU64,
    tensors_sent: AtomicU64,
    bytes_sent: AtomicU64,
    merge_copied_bytes: AtomicU64,
    merged_runs: AtomicU64,
    merged_tensors: AtomicU64,
    zero_copy_tensors: AtomicU64,
    frames_received: AtomicU64,
    bytes_received: AtomicU64,
    alloc_failures: AtomicU64,
}

/// A copy of [`Counters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CounterSnapshot {
    /// Frames written to a socket (all kinds).
    pub frames_sent: u64,
    pub tensors_sent: u64,
    /// Frame bytes written: headers, padding and payloads.
    pub bytes_sent: u64,
    /// Tensor bytes copied into merge buffers.
    pub merge_copied_bytes: u64,
    /// Runs of consecutive small tensors merged into one buffer.
    pub merged_runs: u64,
    /// Tensors sent by copying them into a merge buffer.
    pub merged_tensors: u64,
    /// Tensors handed to the connection from their own memory, without a
    /// copy (over TLS, encryption then copies them once).
    pub zero_copy_tensors: u64,
    pub frames_received: u64,
    /// Frame bytes read: headers and payloads.
    pub bytes_received: u64,
    /// Received frames whose payload could not be allocated.
    pub alloc_failures: u64,
}

impl Counters {
    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            frames_sent: self.frames_sent.load(Relaxed),
            tensors_sent: self.tensors_sent.load(Relaxed),
            bytes_sent: self.bytes_sent.load(Relaxed),
            merge_copied_bytes: self.merge_copied_bytes.load(Relaxed),
            merged_runs: self.merged_runs.load(Relaxed),
            merged_tensors: self.merged_tensors.load(Relaxed),
            zero_copy_tensors: self.zero_copy_tensors.load(Relaxed),
            frames_received: self.frames_received.load(Relaxed),
            bytes_received: self.bytes_received.load(Relaxed),
            alloc_failures: self.alloc_failures.load(Relaxed),
        }
    }

    pub(crate) fn sent(&self, s: &frame::SendStats) {
        self.frames_sent.fetch_add(1, Relaxed);
        self.tensors_sent.fetch_add(s.tensors, Relaxed);
        self.bytes_sent.fetch_add(s.bytes, Relaxed);
        self.merge_copied_bytes.fetch_add(s.copied_bytes, Relaxed);
        self.merged_runs.fetch_add(s.merged_runs, Relaxed);
        self.merged_tensors.fetch_add(s.merged_tensors, Relaxed);
        self.zero_copy_tensors.fetch_add(s.zero_copy_tensors, Relaxed);
    }

    pub(crate) fn received(&self, head: &frame::Head) {
        self.frames_received.fetch_add(1, Relaxed);
        self.bytes_received.fetch_add(head.head_len.saturating_add(head.payload_len), Relaxed);
    }

    pub(crate) fn alloc_failed(&self) {
        self.alloc_failures.fetch_add(1, Relaxed);
    }
}

/// Allocate `n` bytes and check that the allocator kept its promise.
pub(crate) fn alloc_checked<A: Allocator>(alloc: &A, n: usize) -> Result<A::Buf, String> {
    let mut buf = alloc.alloc(n)?;
    let got = buf.as_mut().len();
    if got < n {
        return Err(format!("the allocator returned {got} bytes for a request of {n}"));
    }
    Ok(buf)
}
