//! TLS for a cluster: the rustls settings of the data plane between nodes
//! and of the clients of etcd, and the small certificate authority that
//! `slipstream cluster ca` and `slipstream cluster cert` run.
//!
//! A node's TLS material is one directory with three PEM files, named as a
//! Kubernetes `kubernetes.io/tls` Secret (and cert-manager) name them, so
//! that such a Secret mounted as a volume is a directory this crate reads:
//!
//! - `ca.crt`: the certificates a peer's chain must end at (one or more);
//! - `tls.crt`: this node's certificate (then any intermediates);
//! - `tls.key`: its private key (PKCS#8, SEC1 or PKCS#1).
//!
//! Why it is built the way it is:
//!
//! - **Mutual, and bound to node ids.** On the data plane both sides show a
//!   certificate that must chain to `ca.crt`. A chain alone says "some
//!   member of this cluster", so after the peer handshake names the node,
//!   [`check_peer_name`] requires the peer's certificate to carry that node
//!   id as a DNS name: a node whose certificate was issued for `node-a`
//!   cannot pass itself off as `node-b`. That is why the client side does
//!   not check a server name during the TLS handshake (nodes dial IP
//!   addresses learned from etcd, which certificates need not list): the
//!   name is checked one step later against the id the peer claims.
//! - **etcd is checked the ordinary way**: its certificate must chain to
//!   `ca.crt` and name the host in the etcd URL (a DNS name or an IP
//!   address); the node shows its own certificate as a client certificate
//!   (etcd's `--client-cert-auth`).
//! - **TLS 1.3 only, on ring**: both ends are ours or etcd's (Go speaks
//!   1.3), and ring builds with a C compiler alone.
//! - **Encryption costs the zero-copy send.** rustls encrypts into its own
//!   buffer, so a tensor is copied once more on each side. The plain data
//!   plane stays the default for a trusted network; `docs/design/cluster.md`
//!   gives the measured cost.

mod ca;

pub use ca::{issue, make_ca, Issued, CA_KEY_FILE};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use tokio_rustls::server::TlsStream as ServerTlsStream;
pub use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The certificates a peer's chain must end at.
pub const CA_FILE: &str = "ca.crt";
/// This node's certificate chain.
pub const CERT_FILE: &str = "tls.crt";
/// This node's private key.
pub const KEY_FILE: &str = "tls.key";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {why}", path.display())]
    File { path: PathBuf, why: String },
    #[error("{0}")]
    Bad(String),
}

fn bad(why: impl std::fmt::Display) -> TlsError {
    TlsError::Bad(why.to_string())
}

/// The process-wide crypto provider: ring's.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A node's TLS settings: the data plane's both sides, and etcd's client.
#[derive(Clone)]
pub struct NodeTls {
    dir: PathBuf,
    /// This node's own certificate (the first of `tls.crt`).
    own: CertificateDer<'static>,
    peer_client: Arc<ClientConfig>,
    peer_server: Arc<ServerConfig>,
    etcd_client: Arc<ClientConfig>,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeTls({})", self.dir.display())
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::File { path: path.to_owned(), why: e.to_string() })
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |why: String| TlsError::File { path: path.to_owned(), why };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(file("holds no certificate (expected PEM `BEGIN CERTIFICATE` blocks)".into()));
    }
    Ok(certs)
}

/// `tls.crt` and `tls.key` of `dir`.
fn own_pair(dir: &Path) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let (cert, key) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
    let chain = certs(&cert, &read(&cert)?)?;
    let key_der = PrivateKeyDer::from_pem_slice(&read(&key)?)
        .map_err(|e| TlsError::File { path: key.clone(), why: format!("not a PEM private key: {e}") })?;
    Ok((chain, key_der))
}

/// The HTTP and gRPC ingress's TLS: the certificate and key in a directory
/// (`tls.crt`, `tls.key`: a Kubernetes TLS Secret's layout; a `ca.crt`
/// beside them is not needed), no client certificates, TLS 1.3 (curl,
/// browsers, Python, gRPC and Triton's clients all speak it), HTTP/2 (gRPC)
/// and HTTP/1.1 offered by ALPN.
#[derive(Clone)]
pub struct IngressTls {
    dir: PathBuf,
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for IngressTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IngressTls({})", self.dir.display())
    }
}

impl IngressTls {
    /// `http2`: offer HTTP/2 by ALPN (the node serves gRPC).
    pub fn load(dir: &Path, http2: bool) -> Result<IngressTls, TlsError> {
        let (chain, key) = own_pair(dir)?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(bad)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| bad(format!("{}: {CERT_FILE} and {KEY_FILE}: {e}", dir.display())))?;
        config.alpn_protocols = if http2 { vec![b"h2".to_vec()] } else { Vec::new() };
        config.alpn_protocols.push(b"http/1.1".to_vec());
        Ok(IngressTls { dir: dir.to_owned(), acceptor: TlsAcceptor::from(Arc::new(config)) })
    }

    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl NodeTls {
    /// Read `ca.crt`, `tls.crt` and `tls.key` from `dir`.
    pub fn load(dir: &Path) -> Result<NodeTls, TlsError> {
        let ca = dir.join(CA_FILE);
        let roots = certs(&ca, &read(&ca)?)?;
        let (chain, key) = own_pair(dir)?;
        NodeTls::new(dir.to_owned(), roots, chain, key)
    }

    fn new(
        dir: PathBuf,
        roots: Vec<CertificateDer<'static>>,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<NodeTls, TlsError> {
        let mut store = RootCertStore::empty();
        for c in roots {
            store.add(c).map_err(|e| bad(format!("{}: a certificate it holds is not usable: {e}", CA_FILE)))?;
        }
        let store = Arc::new(store);
        let provider = provider();
        let tls13 = &[&rustls::version::TLS13];
        let own = chain[0].clone();
        let check = |e: rustls::Error| bad(format!("{CERT_FILE} and {KEY_FILE}: {e}"));
        let members = Arc::new(MemberVerifier { roots: store.clone(), provider: provider.clone() });
        let peer_client = ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(bad)?
            .dangerous()
            .with_custom_certificate_verifier(members)
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(check)?;
        let clients = WebPkiClientVerifier::builder_with_provider(store.clone(), provider.clone())
            .build()
            .map_err(|e| bad(format!("{CA_FILE}: {e}")))?;
        let peer_server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(bad)?
            .with_client_cert_verifier(clients)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(check)?;
        let etcd_client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(tls13)
            .map_err(bad)?
            .with_root_certificates(store)
            .with_client_auth_cert(chain, key)
            .map_err(check)?;
        Ok(NodeTls {
            dir,
            own,
            peer_client: Arc::new(peer_client),
            peer_server: Arc::new(peer_server),
            etcd_client: Arc::new(etcd_client),
        })
    }

    /// Whether this node's certificate names `node_id`, as its peers will
    /// require (see [`check_peer_name`]): a node started with another
    /// node's certificate learns it at once, not from every peer refusing it.
    pub fn check_own_name(&self, node_id: &str) -> Result<(), TlsError> {
        check_peer_name(Some(std::slice::from_ref(&self.own)), node_id).map_err(|_| {
            bad(format!(
                "{}: {CERT_FILE} is not issued for this node's name {node_id:?} (its peers would refuse it; \
                 issue one with `slipstream tls cert --ca CA_DIR --out DIR {node_id}`)",
                self.dir.display()
            ))
        })
    }

    /// The directory the material came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The data plane's calling side. The server name given to `connect`
    /// is not checked (see the module docs); [`check_peer_name`] is.
    pub fn peer_connector(&self) -> TlsConnector {
        TlsConnector::from(self.peer_client.clone())
    }

    /// The data plane's answering side: a client certificate is required.
    pub fn peer_acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.peer_server.clone())
    }

    /// A client of etcd: etcd's certificate must name the host dialled.
    pub fn etcd_connector(&self) -> TlsConnector {
        TlsConnector::from(self.etcd_client.clone())
    }
}

/// The server name to dial `host` (a DNS name or an IP address) by.
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|e| bad(format!("{host:?} is not a host name TLS can check: {e}")))
}

/// Whether the peer's certificate (the first of `certs`, as the TLS session
/// reports them) names `node_id`. The chain was checked by the handshake.
pub fn check_peer_name(certs: Option<&[CertificateDer<'_>]>, node_id: &str) -> Result<(), String> {
    let Some(end) = certs.and_then(|c| c.first()) else {
        return Err("the peer showed no certificate".into());
    };
    let cert = ParsedCertificate::try_from(end).map_err(|e| format!("the peer's certificate: {e}"))?;
    let name = ServerName::try_from(node_id)
        .map_err(|_| format!("node id {node_id:?} cannot be named in a certificate (not a DNS name)"))?;
    verify_server_name(&cert, &name)
        .map_err(|_| format!("the peer says it is {node_id:?}, and its certificate is not issued for that name"))
}

/// Checks that a peer's certificate chains to the cluster's CA, not which
/// name it carries (that is [`check_peer_name`]'s, after the peer says who
/// it is).
#[derive(Debug)]
struct MemberVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for MemberVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        let algs = self.provider.signature_verification_algorithms.all;
        verify_server_cert_signed_by_trust_anchor(&cert, &self.roots, intermediates, now, algs)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests;
