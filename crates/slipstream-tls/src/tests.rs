use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Cluster {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Cluster {
    fn new() -> Cluster {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_owned();
        make_ca(&root.join("ca"), 30).unwrap();
        Cluster { _tmp: tmp, root }
    }

    fn node(&self, names: &[&str]) -> NodeTls {
        let out = self.root.join(names[0]);
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        issue(&self.root.join("ca"), &out, &names, 7).unwrap();
        NodeTls::load(&out).unwrap()
    }
}

/// A TLS session between `client` (dialling as `name`) and `server`; the
/// certificates each side saw, or the first side's error.
async fn session(
    client: TlsConnector,
    server: TlsAcceptor,
    name: &str,
) -> Result<(Vec<CertificateDer<'static>>, Vec<CertificateDer<'static>>), String> {
    let (c, s) = tokio::io::duplex(64 << 10);
    let name = server_name(name).unwrap();
    let (c, s) = tokio::join!(client.connect(name, c), server.accept(s));
    let (mut c, mut s) = (c.map_err(|e| format!("client: {e}"))?, s.map_err(|e| format!("server: {e}"))?);
    c.write_all(b"ping").await.unwrap();
    c.flush().await.unwrap();
    let mut got = [0u8; 4];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ping");
    let seen_by_client = c.get_ref().1.peer_certificates().unwrap().to_vec();
    let seen_by_server = s.get_ref().1.peer_certificates().unwrap().to_vec();
    Ok((seen_by_client, seen_by_server))
}

#[tokio::test]
async fn members_of_one_ca_talk_and_are_bound_to_their_names() {
    let cl = Cluster::new();
    let (a, b) = (cl.node(&["node-a"]), cl.node(&["node-b", "10.0.0.2"]));
    // The dialled name is not what is checked (nodes dial IPs).
    let (server_cert, client_cert) = session(a.peer_connector(), b.peer_acceptor(), "198.51.100.7").await.unwrap();
    check_peer_name(Some(&server_cert), "node-b").unwrap();
    check_peer_name(Some(&client_cert), "node-a").unwrap();
    let e = check_peer_name(Some(&client_cert), "node-b").unwrap_err();
    assert!(e.contains("not issued for that name"), "{e}");
    assert!(check_peer_name(None, "node-a").unwrap_err().contains("no certificate"));
    assert!(check_peer_name(Some(&client_cert), "not a name!").unwrap_err().contains("not a DNS name"));
    a.check_own_name("node-a").unwrap();
    let e = a.check_own_name("node-b").unwrap_err().to_string();
    assert!(e.contains("not issued for this node's name \"node-b\""), "{e}");
}

#[tokio::test]
async fn a_certificate_of_another_ca_is_refused_both_ways() {
    let (ours, theirs) = (Cluster::new(), Cluster::new());
    let (a, stranger) = (ours.node(&["node-a"]), theirs.node(&["node-x"]));
    let e = session(stranger.peer_connector(), a.peer_acceptor(), "node-a").await.unwrap_err();
    assert!(e.contains("client"), "the stranger cannot verify our server either: {e}");
    let e = session(a.peer_connector(), stranger.peer_acceptor(), "node-x").await.unwrap_err();
    assert!(e.contains("client: "), "{e}");
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let cl = Cluster::new();
    let a = cl.node(&["node-a"]);
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(cl.root.join("ca").join(CA_FILE)).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let anonymous = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let (c, s) = tokio::io::duplex(64 << 10);
    let connector = TlsConnector::from(Arc::new(anonymous));
    let (_c, s) = tokio::join!(connector.connect(server_name("node-a").unwrap(), c), a.peer_acceptor().accept(s));
    assert!(s.is_err(), "the server must demand a client certificate");
}

#[tokio::test]
async fn etcd_is_checked_by_the_host_dialled() {
    let cl = Cluster::new();
    let (node, etcd) = (cl.node(&["node-a"]), cl.node(&["etcd-0", "127.0.0.1"]));
    session(node.etcd_connector(), etcd.peer_acceptor(), "127.0.0.1").await.unwrap();
    session(node.etcd_connector(), etcd.peer_acceptor(), "etcd-0").await.unwrap();
    let e = session(node.etcd_connector(), etcd.peer_acceptor(), "localhost").await.unwrap_err();
    assert!(e.contains("client"), "{e}");
}

#[test]
fn nothing_is_overwritten_and_a_mismatched_ca_key_is_caught() {
    let (one, two) = (Cluster::new(), Cluster::new());
    let e = make_ca(&one.root.join("ca"), 30).unwrap_err().to_string();
    assert!(e.contains("exists already"), "{e}");
    one.node(&["node-a"]);
    let e = issue(&one.root.join("ca"), &one.root.join("node-a"), &["node-a".into()], 7).unwrap_err().to_string();
    assert!(e.contains("tls.crt: exists already"), "{e}");
    // ca.crt of one CA with ca.key of another.
    std::fs::copy(two.root.join("ca").join(CA_KEY_FILE), one.root.join("mixed.key")).unwrap();
    let mixed = one.root.join("mixed");
    std::fs::create_dir(&mixed).unwrap();
    std::fs::copy(one.root.join("ca").join(CA_FILE), mixed.join(CA_FILE)).unwrap();
    std::fs::copy(one.root.join("mixed.key"), mixed.join(CA_KEY_FILE)).unwrap();
    let e = issue(&mixed, &one.root.join("n"), &["n".into()], 7).unwrap_err().to_string();
    assert!(e.contains("does not match ca.key"), "{e}");
    // Keys are the owner's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(one.root.join("node-a").join(KEY_FILE)).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "tls.key is readable by others: {mode:o}");
}

#[test]
fn bad_inputs_are_named() {
    let cl = Cluster::new();
    let ca = cl.root.join("ca");
    assert!(issue(&ca, &cl.root.join("x"), &[], 7).unwrap_err().to_string().contains("at least one name"));
    let e = issue(&ca, &cl.root.join("x"), &["a b".into()], 7).unwrap_err().to_string();
    assert!(e.contains("neither a DNS name"), "{e}");
    assert!(issue(&ca, &cl.root.join("x"), &["x".into()], 0).unwrap_err().to_string().contains("one day"));
    let e = NodeTls::load(&cl.root.join("missing")).unwrap_err().to_string();
    assert!(e.contains("missing/ca.crt"), "{e}");
    let d = cl.root.join("garbage");
    std::fs::create_dir(&d).unwrap();
    std::fs::copy(ca.join(CA_FILE), d.join(CA_FILE)).unwrap();
    std::fs::write(d.join(CERT_FILE), "hello").unwrap();
    std::fs::write(d.join(KEY_FILE), "hello").unwrap();
    let e = NodeTls::load(&d).unwrap_err().to_string();
    assert!(e.contains("tls.crt: holds no certificate"), "{e}");
    // A key that is not the certificate's.
    let a = cl.root.join("a");
    issue(&ca, &a, &["a".into()], 7).unwrap();
    let b = cl.root.join("b");
    issue(&ca, &b, &["b".into()], 7).unwrap();
    std::fs::remove_file(a.join(KEY_FILE)).unwrap();
    std::fs::copy(b.join(KEY_FILE), a.join(KEY_FILE)).unwrap();
    assert!(NodeTls::load(&a).is_err(), "a key that does not match its certificate");
}
