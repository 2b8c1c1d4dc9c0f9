//! The cluster key: what every node of a cluster derives from the shared
//! token, and signs with.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

/// Separates this key from any other use of the same token.
const DOMAIN: &[u8] = b"slipstream-cluster-v1\0";

/// A key derived from the cluster token: `SHA-256("slipstream-cluster-v1\0" + token)`,
/// and the keys of other tokens it accepts while a token is rotated.
///
/// It signs with HMAC-SHA256 under the token's own key only, and accepts a
/// tag made under that key or any accepted one. Rotating a token without
/// downtime is three rolling restarts (docs/design/cluster.md): accept the
/// new token, then sign with it while accepting the old, re-sign what etcd
/// holds (`slipstream reseal`), then drop the old. Its `Debug` output never
/// shows a key.
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
    accepted: Vec<[u8; 32]>,
}

fn derive(token: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update(token.as_bytes());
    h.finalize().into()
}

/// HMAC over `parts` under `key`, each part preceded by its length (u64
/// LE), so that `["ab", "c"]` and `["a", "bc"]` sign differently.
fn mac(key: &[u8; 32], parts: &[&[u8]]) -> HmacSha256 {
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length");
    for p in parts {
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac
}

impl ClusterKey {
    pub fn from_token(token: &str) -> ClusterKey {
        ClusterKey { key: derive(token), accepted: Vec::new() }
    }

    /// Signs with `token`; accepts tags of `token` and of each of `also`.
    pub fn with_accepted(token: &str, also: &[String]) -> ClusterKey {
        let key = derive(token);
        let accepted = also.iter().map(|t| derive(t)).filter(|k| *k != key).collect();
        ClusterKey { key, accepted }
    }

    /// The tag of `parts` under the token's own key (see [`ClusterKey::verify`]).
    pub fn sign(&self, parts: &[&[u8]]) -> [u8; 32] {
        let tag = mac(&self.key, parts).finalize().into_bytes();
        let mut out = [0u8; 32];
        out.copy_from_slice(&tag);
        out
    }

    /// Whether `tag` is the tag of `parts` under the token's key or an
    /// accepted one, each compared in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        std::iter::once(&self.key).chain(&self.accepted).any(|k| mac(k, parts).verify_slice(tag).is_ok())
    }

    /// [`ClusterKey::sign`] as lowercase hex, for records stored elsewhere (etcd).
    pub fn sign_hex(&self, parts: &[&[u8]]) -> String {
        self.sign(parts).iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `tag_hex` (as [`ClusterKey::sign_hex`] writes it, any case)
    /// is the tag of `parts`. Malformed hex is simply not a valid tag.
    pub fn verify_hex(&self, parts: &[&[u8]], tag_hex: &str) -> bool {
        match decode_hex(tag_hex) {
            Some(tag) => self.verify(parts, &tag),
            None => false,
        }
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if s.len() & 1 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.chunks_exact(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_and_verify() {
        let k = ClusterKey::from_token("secret");
        let tag = k.sign(&[b"a", b"bc"]);
        assert!(k.verify(&[b"a", b"bc"], &tag));
        assert!(!k.verify(&[b"ab", b"c"], &tag), "part boundaries are signed");
        assert!(!k.verify(&[b"abc"], &tag));
        assert!(!k.verify(&[b"a", b"bc"], &tag[..31]), "a truncated tag");
        let other = ClusterKey::from_token("secret2");
        assert!(!other.verify(&[b"a", b"bc"], &tag));
        assert_eq!(ClusterKey::from_token("secret").sign(&[b"a", b"bc"]), tag, "deterministic");
    }

    #[test]
    fn hex_round_trip() {
        let k = ClusterKey::from_token("t");
        let hex = k.sign_hex(&[b"record", b"{\"node\":1}"]);
        assert_eq!(hex.len(), 64);
        assert!(k.verify_hex(&[b"record", b"{\"node\":1}"], &hex));
        assert!(k.verify_hex(&[b"record", b"{\"node\":1}"], &hex.to_uppercase()));
        assert!(!k.verify_hex(&[b"record", b"{\"node\":2}"], &hex));
        assert!(!k.verify_hex(&[b"record", b"{\"node\":1}"], &hex[1..]));
        assert!(!k.verify_hex(&[b"record", b"{\"node\":1}"], "zz"));
        assert!(!k.verify_hex(&[b"record", b"{\"node\":1}"], ""));
    }

    #[test]
    fn accepted_tokens_verify_and_never_sign() {
        let old = ClusterKey::from_token("old");
        let new = ClusterKey::from_token("new");
        // Phase 1: sign old, accept new. Phase 2: sign new, accept old.
        let p1 = ClusterKey::with_accepted("old", &["new".into()]);
        let p2 = ClusterKey::with_accepted("new", &["old".into()]);
        let parts: &[&[u8]] = &[b"member", b"{}"];
        assert_eq!(p1.sign(parts), old.sign(parts), "signs with its own token only");
        assert_eq!(p2.sign(parts), new.sign(parts));
        for (a, b) in [(&old, &p1), (&p1, &p2), (&p2, &new), (&p2, &p1), (&p1, &old)] {
            assert!(b.verify(parts, &a.sign(parts)), "neighbouring phases accept each other");
        }
        assert!(!new.verify(parts, &old.sign(parts)), "the last phase accepts the old token no more");
        assert!(!old.verify(parts, &p2.sign(parts)));
        assert!(!p1.verify(parts, &ClusterKey::from_token("other").sign(parts)));
        assert!(ClusterKey::with_accepted("t", &["t".into()]).accepted.is_empty());
    }

    #[test]
    fn debug_hides_the_key() {
        let k = ClusterKey::from_token("t");
        let shown = format!("{k:?}");
        let hex: String = k.key.iter().map(|b| format!("{b:02x}")).collect();
        assert!(!shown.contains(&hex[..8]));
        assert_eq!(shown, "ClusterKey(..)");
    }
}
