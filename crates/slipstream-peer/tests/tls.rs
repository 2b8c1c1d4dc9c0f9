//! The data plane with mutual TLS, over real TCP on loopback.

use bytes::Bytes;
use parking_lot::Mutex;
use slipstream_peer::ClusterKey;
use slipstream_peer::{serve_with_config, OutTensor, Outgoing, PeerConfig, PeerError, Peers, ServerHandle, VecAlloc};
use slipstream_tls::{issue, make_ca, NodeTls};
use slipstream_types::DType;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LONG: Duration = Duration::from_secs(20);

fn key() -> ClusterKey {
    ClusterKey::from_token("tls-test-token")
}

/// A CA in `root/<ca>` and a certificate for `name` from it.
fn node(root: &Path, ca: &str, name: &str) -> NodeTls {
    let ca_dir = root.join(ca);
    if !ca_dir.exists() {
        make_ca(&ca_dir, 3).unwrap();
    }
    let out = root.join(format!("{ca}-{name}"));
    issue(&ca_dir, &out, &[name.to_string()], 1).unwrap();
    NodeTls::load(&out).unwrap()
}

fn config(tls: Option<NodeTls>) -> PeerConfig {
    PeerConfig { tls, handshake_timeout: Duration::from_secs(3), ..PeerConfig::default() }
}

/// A tensor whose bytes repeat a marker no encryption would leave in place.
fn marked(n: usize) -> OutTensor {
    let marker = b"SLIPSTREAM-PLAINTEXT-MARKER-0123456789abcdef";
    let data: Vec<u8> = marker.iter().copied().cycle().take(n).collect();
    OutTensor { name: "x".into(), dtype: DType::Uint8, shape: vec![n as u64], data: Bytes::from(data) }
}

struct Server {
    handle: ServerHandle,
    addr: SocketAddr,
    handled: Arc<AtomicUsize>,
}

async fn server(tls: Option<NodeTls>) -> Server {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let count = handled.clone();
    let handle = serve_with_config(l, key(), "server".into(), Arc::new(VecAlloc), config(tls), move |_, call, _| {
        count.fetch_add(1, SeqCst);
        async move { Outgoing::echo(call) }
    });
    Server { handle, addr, handled }
}

/// A relay between a client and `to` that keeps every byte it passes.
async fn tap(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((a, _)) = l.accept().await {
            let b = TcpStream::connect(to).await.unwrap();
            let (ar, aw) = a.into_split();
            let (br, bw) = b.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(ar) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(bw) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                ),
                (Box::new(br), Box::new(aw)),
            ] {
                let log = log.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = r.read(&mut buf).await {
                        if n == 0 || w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        log.lock().extend_from_slice(&buf[..n]);
                    }
                    let _ = w.shutdown().await;
                });
            }
        }
    });
    (at, seen)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_cross_encrypted_and_come_back_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let s = server(Some(node(tmp.path(), "ca", "server"))).await;
    let (via, seen) = tap(s.addr).await;
    let peers =
        Peers::with_config(key(), "client".into(), Arc::new(VecAlloc), config(Some(node(tmp.path(), "ca", "client"))));
    let big = marked(6_400_000);
    let msg = Outgoing::call(b"meta-SECRET".to_vec(), vec![marked(100), big.clone()]);
    let mut reply = peers.call(via, msg, LONG).await.unwrap();
    assert_eq!(reply.meta, b"meta-SECRET");
    assert_eq!(reply.tensor_data(1).unwrap(), &big.data[..]);
    assert_eq!(peers.peer_id(via).as_deref(), Some("server"));
    let seen = seen.lock();
    assert!(seen.len() > 2 * 6_400_000, "both directions passed the tap: {} bytes", seen.len());
    assert!(!contains(&seen, b"PLAINTEXT-MARKER"), "tensor bytes crossed the wire in the clear");
    assert!(!contains(&seen, b"meta-SECRET"), "metadata crossed the wire in the clear");
}

/// The same tap sees the marker when TLS is off: the check above can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tls_the_tap_sees_the_tensor() {
    let s = server(None).await;
    let (via, seen) = tap(s.addr).await;
    let peers = Peers::with_config(key(), "client".into(), Arc::new(VecAlloc), config(None));
    peers.call(via, Outgoing::call(vec![], vec![marked(4096)]), LONG).await.unwrap();
    assert!(contains(&seen.lock(), b"PLAINTEXT-MARKER"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_ca_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let s = server(Some(node(tmp.path(), "ca", "server"))).await;
    let stranger = Peers::with_config(
        key(),
        "client".into(),
        Arc::new(VecAlloc),
        config(Some(node(tmp.path(), "other", "client"))),
    );
    let err = stranger.call(s.addr, Outgoing::call(vec![], vec![marked(10)]), LONG).await.unwrap_err();
    assert!(matches!(err, PeerError::Untrusted(ref why) if why.contains("certificate")), "{err:?}");
    assert_eq!(stranger.connections(), 0);
    wait_for(|| s.handle.refused() == 1).await;
    assert_eq!(s.handled.load(SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_pass_itself_off_as_another_node() {
    let tmp = tempfile::tempdir().unwrap();
    let s = server(Some(node(tmp.path(), "ca", "server"))).await;
    // A real member's certificate (for "worker-1"), and a hello saying "leader".
    let liar = Peers::with_config(
        key(),
        "leader".into(),
        Arc::new(VecAlloc),
        config(Some(node(tmp.path(), "ca", "worker-1"))),
    );
    let r = liar.call(s.addr, Outgoing::call(vec![], vec![marked(10)]), LONG).await;
    assert!(r.is_err(), "the server answered a node whose certificate names another");
    wait_for(|| s.handle.refused() == 1).await;
    assert_eq!(s.handled.load(SeqCst), 0);

    // And the other way: a server whose certificate names another node.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let _impostor = serve_with_config(
        l,
        key(),
        "server".into(),
        Arc::new(VecAlloc),
        config(Some(node(tmp.path(), "ca", "worker-2"))),
        |_, c, _| async move { Outgoing::echo(c) },
    );
    let honest =
        Peers::with_config(key(), "client".into(), Arc::new(VecAlloc), config(Some(node(tmp.path(), "ca", "client"))));
    let err = honest.call(addr, Outgoing::call(vec![], vec![marked(10)]), LONG).await.unwrap_err();
    assert!(matches!(err, PeerError::Untrusted(ref why) if why.contains("not issued for that name")), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_tls_do_not_mix() {
    let tmp = tempfile::tempdir().unwrap();
    let tls = server(Some(node(tmp.path(), "ca", "server"))).await;
    let plain_client = Peers::with_config(key(), "client".into(), Arc::new(VecAlloc), config(None));
    assert!(plain_client.call(tls.addr, Outgoing::call(vec![], vec![marked(10)]), LONG).await.is_err());
    wait_for(|| tls.handle.refused() == 1).await;

    let plain = server(None).await;
    let tls_client =
        Peers::with_config(key(), "client".into(), Arc::new(VecAlloc), config(Some(node(tmp.path(), "ca", "client"))));
    let err = tls_client.call(plain.addr, Outgoing::call(vec![], vec![marked(10)]), LONG).await.unwrap_err();
    assert!(matches!(err, PeerError::Untrusted(_) | PeerError::Refused), "{err:?}");
    assert_eq!(tls.handled.load(SeqCst) + plain.handled.load(SeqCst), 0);
}

async fn wait_for(mut ok: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !ok() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
