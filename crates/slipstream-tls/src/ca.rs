//! A cluster's own certificate authority: one self-signed CA key pair
//! (`slipstream cluster ca`) that issues each node's and each etcd
//! member's certificate (`slipstream cluster cert`).
//!
//! Keys are ECDSA P-256; certificates carry both TLS usages (a node both
//! dials and answers); the CA may sign end certificates only (path length
//! 0). Keys are written readable by their owner alone, and no file is
//! overwritten: a CA replaced by mistake would cut every node off.

use crate::{bad, TlsError, CA_FILE, CERT_FILE, KEY_FILE};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use time::OffsetDateTime;

/// The CA's private key, beside its certificate (`ca.crt`).
pub const CA_KEY_FILE: &str = "ca.key";
/// Every CA this module makes has this subject; issuing rebuilds it.
const CA_NAME: &str = "Slipstream cluster CA";
/// Clocks of different machines disagree: certificates start this early.
const SKEW: Duration = Duration::from_secs(3600);

/// What [`issue`] wrote.
#[derive(Debug)]
pub struct Issued {
    pub files: Vec<PathBuf>,
    pub not_after: String,
}

fn validity(params: &mut CertificateParams, days: u32) -> Result<(), TlsError> {
    if days == 0 {
        return Err(bad("a certificate must be valid for at least one day"));
    }
    let now = OffsetDateTime::now_utc();
    params.not_before = now - SKEW;
    params.not_after = now
        .checked_add(time::Duration::days(i64::from(days)))
        .ok_or_else(|| bad(format!("{days} days from now is past what a certificate can say")))?;
    let mut serial: [u8; 16] = rand::random();
    serial[0] &= 0x7f; // a positive number
    params.serial_number = Some(SerialNumber::from_slice(&serial));
    Ok(())
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p
}

/// Write `contents` to a new file (never over an existing one).
fn create(path: &Path, contents: &str, mode: u32) -> Result<(), TlsError> {
    let file = |why: String| TlsError::File { path: path.to_owned(), why };
    let mut f =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => file("exists already; not overwritten (remove it first)".into()),
            _ => file(e.to_string()),
        })?;
    f.write_all(contents.as_bytes()).map_err(|e| file(e.to_string()))
}

/// A certificate and its key, neither written unless both can be: the key
/// readable by its owner alone.
fn write_pair(crt: &Path, crt_pem: &str, key: &Path, key_pem: &str) -> Result<(), TlsError> {
    for p in [crt, key] {
        if p.exists() {
            return Err(TlsError::File {
                path: p.to_owned(),
                why: "exists already; not overwritten (remove it first)".into(),
            });
        }
    }
    create(key, key_pem, 0o600)?;
    create(crt, crt_pem, 0o644)
}

fn mkdir(dir: &Path) -> Result<(), TlsError> {
    std::fs::create_dir_all(dir).map_err(|e| TlsError::File { path: dir.to_owned(), why: e.to_string() })
}

/// Make a new CA in `dir` (`ca.crt` and `ca.key`), valid for `days`.
pub fn make_ca(dir: &Path, days: u32) -> Result<Vec<PathBuf>, TlsError> {
    mkdir(dir)?;
    let mut params = ca_params();
    validity(&mut params, days)?;
    let key = KeyPair::generate().map_err(bad)?;
    let cert = params.self_signed(&key).map_err(bad)?;
    let (crt, k) = (dir.join(CA_FILE), dir.join(CA_KEY_FILE));
    write_pair(&crt, &cert.pem(), &k, &key.serialize_pem())?;
    Ok(vec![crt, k])
}

/// Issue a certificate for `names` (DNS names or IP addresses; the first
/// is a node's id) with the CA in `ca_dir`, into `out` as `tls.crt` and
/// `tls.key`, with a copy of `ca.crt` beside them: a directory a node
/// (`--tls`) or etcd reads as it is.
pub fn issue(ca_dir: &Path, out: &Path, names: &[String], days: u32) -> Result<Issued, TlsError> {
    if names.is_empty() {
        return Err(bad("a certificate needs at least one name (the node's id, or etcd's host)"));
    }
    for n in names {
        rustls::pki_types::ServerName::try_from(n.as_str())
            .map_err(|_| bad(format!("{n:?} is neither a DNS name nor an IP address")))?;
    }
    let ca_crt_path = ca_dir.join(CA_FILE);
    let ca_pem = crate::read(&ca_crt_path)?;
    let ca_key_path = ca_dir.join(CA_KEY_FILE);
    let ca_key_pem = String::from_utf8(crate::read(&ca_key_path)?)
        .map_err(|_| TlsError::File { path: ca_key_path.clone(), why: "not a PEM file".into() })?;
    let ca_key = KeyPair::from_pem(&ca_key_pem)
        .map_err(|e| TlsError::File { path: ca_key_path.clone(), why: format!("not a usable CA key: {e}") })?;
    let issuer = Issuer::new(ca_params(), ca_key);

    let mut params = CertificateParams::new(names.to_vec())
        .map_err(|e| bad(format!("names {names:?}: {e} (expected DNS names or IP addresses)")))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, names[0].as_str());
    params.distinguished_name = dn;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    validity(&mut params, days)?;
    let key = KeyPair::generate().map_err(bad)?;
    let cert = params.signed_by(&key, &issuer).map_err(bad)?;
    check_issued_by(cert.der(), &ca_pem, &ca_crt_path)?;

    mkdir(out)?;
    let (crt, k, ca) = (out.join(CERT_FILE), out.join(KEY_FILE), out.join(CA_FILE));
    write_pair(&crt, &cert.pem(), &k, &key.serialize_pem())?;
    let mut files = vec![crt, k];
    match std::fs::read(&ca) {
        Ok(existing) if existing == ca_pem => {}
        Ok(_) => {
            return Err(TlsError::File { path: ca, why: "holds another CA than the one that issued tls.crt".into() })
        }
        Err(_) => {
            let text = String::from_utf8(ca_pem).map_err(|_| bad("ca.crt is not text"))?;
            create(&ca, &text, 0o644)?;
            files.push(ca);
        }
    }
    Ok(Issued { files, not_after: params.not_after.date().to_string() })
}

/// The CA rebuilt from `ca.key` must be the one `ca.crt` holds: a key from
/// another CA would issue certificates no member accepts.
fn check_issued_by(cert: &CertificateDer<'_>, ca_pem: &[u8], ca_path: &Path) -> Result<(), TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem) {
        let c = c.map_err(|e| TlsError::File { path: ca_path.to_owned(), why: format!("not PEM: {e}") })?;
        roots.add(c).map_err(|e| TlsError::File { path: ca_path.to_owned(), why: e.to_string() })?;
    }
    let parsed = rustls::server::ParsedCertificate::try_from(cert).map_err(bad)?;
    let algs = crate::provider().signature_verification_algorithms.all;
    rustls::client::verify_server_cert_signed_by_trust_anchor(&parsed, &roots, &[], UnixTime::now(), algs).map_err(
        |e| TlsError::File {
            path: ca_path.to_owned(),
            why: format!("does not match ca.key (not made by `slipstream cluster ca`?): {e}"),
        },
    )
}
