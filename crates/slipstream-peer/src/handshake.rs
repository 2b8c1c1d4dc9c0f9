//! Mutual challenge-response on a fresh connection.
//!
//! Both sides send `Hello { b"SSPR", version u16 LE, id_len u8, node id,
//! nonce [u8; 32] }` (the nonce fresh from the OS-seeded CSPRNG); then each
//! sends `HMAC(key, its role label, client hello, server hello)` and checks
//! the other's under the other label. Labels differ, so one side's proof is
//! never a valid answer for the other; each proof covers the other side's
//! fresh nonce, so a recorded proof is worth nothing later. Any failure,
//! including a timeout, is [`PeerError::Refused`].
//!
//! With TLS configured ([`crate::PeerConfig::tls`]), [`establish`] runs the
//! TLS handshake first (both sides show a certificate of the cluster's CA)
//! and this exchange inside it, then checks that the peer's certificate is
//! issued for the node id its hello gave: a failure there is
//! [`PeerError::Untrusted`], saying why.

use crate::{ClusterKey, PeerConfig, PeerError};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The reading half of an established connection.
pub(crate) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// The writing half of an established connection.
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// An authenticated connection: the peer's node id and the two halves.
pub(crate) struct Established {
    pub peer_id: String,
    pub rd: ReadHalf,
    pub wr: WriteHalf,
}

/// Make `stream` an authenticated connection (TLS when configured, then
/// the token handshake), all within the config's handshake timeout.
pub(crate) async fn establish(
    stream: TcpStream,
    peer_addr: SocketAddr,
    key: &ClusterKey,
    node_id: &str,
    role: Role,
    config: &PeerConfig,
) -> Result<Established, PeerError> {
    let _ = stream.set_nodelay(true);
    let limit = config.handshake_timeout;
    let work = async {
        let Some(tls) = &config.tls else {
            let mut stream = stream;
            let peer_id = handshake(&mut stream, key, node_id, role, limit).await?;
            let (rd, wr) = stream.into_split();
            return Ok(Established { peer_id, rd: Box::new(rd), wr: Box::new(wr) });
        };
        let untrusted = |e: std::io::Error| PeerError::Untrusted(e.to_string());
        let mut stream: tokio_rustls::TlsStream<TcpStream> = match role {
            // The name is not what is checked: see `slipstream_tls`.
            Role::Client => tls
                .peer_connector()
                .connect(rustls::pki_types::ServerName::IpAddress(peer_addr.ip().into()), stream)
                .await
                .map_err(untrusted)?
                .into(),
            Role::Server => tls.peer_acceptor().accept(stream).await.map_err(untrusted)?.into(),
        };
        let peer_id = handshake(&mut stream, key, node_id, role, limit).await?;
        slipstream_tls::check_peer_name(stream.get_ref().1.peer_certificates(), &peer_id)
            .map_err(PeerError::Untrusted)?;
        let (rd, wr) = tokio::io::split(stream);
        Ok(Established { peer_id, rd: Box::new(rd), wr: Box::new(wr) })
    };
    match tokio::time::timeout(limit, work).await {
        Ok(r) => r,
        Err(_) => Err(PeerError::Refused),
    }
}

pub(crate) const MAGIC: &[u8; 4] = b"SSPR";
pub(crate) const VERSION: u16 = 1;
/// Longest node id a hello can carry.
pub const MAX_NODE_ID: usize = 255;
const CLIENT_LABEL: &[u8] = b"slipstream-peer/1 client proof";
const SERVER_LABEL: &[u8] = b"slipstream-peer/1 server proof";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Client,
    Server,
}

fn hello(node_id: &str, nonce: &[u8; 32]) -> Vec<u8> {
    let mut h = Vec::with_capacity(4 + 2 + 1 + node_id.len() + 32);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.push(node_id.len() as u8);
    h.extend_from_slice(node_id.as_bytes());
    h.extend_from_slice(nonce);
    h
}

/// The peer's hello, as bytes, and its node id; `None` if it is not one of ours.
async fn read_hello<S: AsyncRead + Unpin>(s: &mut S) -> Option<(Vec<u8>, String)> {
    let mut fixed = [0u8; 7];
    s.read_exact(&mut fixed).await.ok()?;
    if &fixed[..4] != MAGIC || u16::from_le_bytes([fixed[4], fixed[5]]) != VERSION {
        return None;
    }
    let id_len = fixed[6] as usize;
    let mut bytes = vec![0u8; 7 + id_len + 32];
    bytes[..7].copy_from_slice(&fixed);
    s.read_exact(&mut bytes[7..]).await.ok()?;
    let id = std::str::from_utf8(&bytes[7..7 + id_len]).ok()?.to_string();
    Some((bytes, id))
}

async fn exchange<S>(s: &mut S, key: &ClusterKey, node_id: &str, role: Role) -> Option<String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let nonce: [u8; 32] = rand::random();
    let mine = hello(node_id, &nonce);
    s.write_all(&mine).await.ok()?;
    let (theirs, peer_id) = read_hello(s).await?;
    if theirs[theirs.len() - 32..] == nonce {
        return None; // our own hello reflected back
    }
    let (client, server, my_label, their_label) = match role {
        Role::Client => (&mine, &theirs, CLIENT_LABEL, SERVER_LABEL),
        Role::Server => (&theirs, &mine, SERVER_LABEL, CLIENT_LABEL),
    };
    let proof = key.sign(&[my_label, client, server]);
    s.write_all(&proof).await.ok()?;
    let mut their_proof = [0u8; 32];
    s.read_exact(&mut their_proof).await.ok()?;
    key.verify(&[their_label, client, server], &their_proof).then_some(peer_id)
}

/// Run the handshake; the peer's node id on success.
///
/// `node_id` must be at most [`MAX_NODE_ID`] bytes (checked by the callers
/// when they are built).
pub(crate) async fn handshake<S>(
    s: &mut S,
    key: &ClusterKey,
    node_id: &str,
    role: Role,
    timeout: Duration,
) -> Result<String, PeerError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match tokio::time::timeout(timeout, exchange(s, key, node_id, role)).await {
        Ok(Some(peer)) => Ok(peer),
        _ => Err(PeerError::Refused),
    }
}

/// Panic with a clear message on a node id no hello can carry.
pub(crate) fn check_node_id(node_id: &str) {
    assert!(
        node_id.len() <= MAX_NODE_ID,
        "slipstream-peer: node id is {} bytes, the limit is {MAX_NODE_ID}",
        node_id.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    async fn pair(a: ClusterKey, b: ClusterKey) -> (Result<String, PeerError>, Result<String, PeerError>) {
        let (mut c, mut s) = tokio::io::duplex(4096);
        let t = Duration::from_secs(2);
        tokio::join!(
            handshake(&mut c, &a, "client-node", Role::Client, t),
            handshake(&mut s, &b, "server-node", Role::Server, t)
        )
    }

    #[tokio::test]
    async fn same_key_authenticates_both_ways() {
        let (c, s) = pair(ClusterKey::from_token("k"), ClusterKey::from_token("k")).await;
        assert_eq!(c.unwrap(), "server-node");
        assert_eq!(s.unwrap(), "client-node");
    }

    #[tokio::test]
    async fn different_keys_are_refused_on_both_sides() {
        let (c, s) = pair(ClusterKey::from_token("k"), ClusterKey::from_token("other")).await;
        assert!(matches!(c, Err(PeerError::Refused)));
        assert!(matches!(s, Err(PeerError::Refused)));
    }

    #[tokio::test]
    async fn nodes_on_neighbouring_phases_of_a_token_rotation_connect() {
        let p1 = ClusterKey::with_accepted("old", &["new".into()]);
        let p2 = ClusterKey::with_accepted("new", &["old".into()]);
        let (c, s) = pair(p1.clone(), p2.clone()).await;
        assert!(c.is_ok() && s.is_ok());
        let (c, s) = pair(p2, ClusterKey::from_token("new")).await;
        assert!(c.is_ok() && s.is_ok());
        let (c, s) = pair(ClusterKey::from_token("old"), ClusterKey::from_token("new")).await;
        assert!(c.is_err() && s.is_err(), "a node that skipped a phase is refused");
    }

    #[tokio::test]
    async fn a_silent_peer_times_out_as_refused() {
        let (_c, mut s) = tokio::io::duplex(4096);
        let start = Instant::now();
        let r = handshake(&mut s, &ClusterKey::from_token("k"), "n", Role::Server, Duration::from_millis(100)).await;
        assert!(matches!(r, Err(PeerError::Refused)));
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_reflected_hello_is_refused() {
        // A "peer" that echoes everything back: it answers our hello with
        // our own, and our proof with our own proof.
        let (mut c, s) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(s);
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
        let r = handshake(&mut c, &ClusterKey::from_token("k"), "n", Role::Client, Duration::from_secs(1)).await;
        assert!(matches!(r, Err(PeerError::Refused)));
    }

    #[tokio::test]
    async fn another_protocol_is_refused() {
        let (mut c, mut s) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
            let mut sink = [0u8; 256];
            while s.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
        });
        let r = handshake(&mut c, &ClusterKey::from_token("k"), "n", Role::Client, Duration::from_secs(1)).await;
        assert!(matches!(r, Err(PeerError::Refused)));
    }
}
