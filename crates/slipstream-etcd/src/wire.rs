//! The JSON gateway's shapes: what we send and what we read back.
//!
//! The gateway writes protobuf messages as JSON (jsonpb): `bytes` fields are
//! base64, 64-bit integers are strings (we also take numbers), fields at
//! their zero value are left out (so everything here defaults), enums are
//! names (`"DELETE"`; `PUT` is 0 and so never appears).

use crate::{EtcdError, Kv};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde::de::{DeserializeOwned, Deserializer, Error as _};
use serde::Deserialize;

pub(crate) fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

fn unb64(field: &str, s: &str) -> Result<Vec<u8>, EtcdError> {
    B64.decode(s).map_err(|e| EtcdError::Protocol(format!("{field} is not base64: {e}")))
}

/// The `[key, range_end)` that selects every key starting with `prefix`:
/// the prefix with its last byte below 0xff incremented (and what follows
/// dropped). A prefix with no such byte (empty, or all 0xff) runs to the end
/// of the keyspace, which etcd spells `"\0"`; an empty key is spelled `"\0"`
/// too (etcd refuses empty keys).
pub(crate) fn prefix_range(prefix: &str) -> (Vec<u8>, Vec<u8>) {
    let key = if prefix.is_empty() { vec![0] } else { prefix.as_bytes().to_vec() };
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return (key, end);
        }
    }
    (key, vec![0])
}

/// An int64 the gateway wrote as a string (its usual way) or a number.
fn int64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int {
        Text(String),
        Number(i64),
    }
    match Option::<Int>::deserialize(d)? {
        None => Ok(0),
        Some(Int::Number(n)) => Ok(n),
        Some(Int::Text(s)) => s.parse().map_err(|_| D::Error::custom(format!("{s:?} is not an int64"))),
    }
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "int64")]
    pub revision: i64,
}

/// `mvccpb.KeyValue`.
#[derive(Deserialize, Default, Debug)]
pub(crate) struct RawKv {
    #[serde(default)]
    pub key: String,
    #[serde(default)]
    pub value: String,
    #[serde(default, deserialize_with = "int64")]
    pub create_revision: i64,
    #[serde(default, deserialize_with = "int64")]
    pub mod_revision: i64,
    #[serde(default, deserialize_with = "int64")]
    pub version: i64,
    #[serde(default, deserialize_with = "int64")]
    pub lease: i64,
}

impl RawKv {
    /// Keys are decoded lossily: a key someone else wrote that is not UTF-8
    /// must not make a whole listing fail.
    pub fn key(&self) -> Result<String, EtcdError> {
        Ok(String::from_utf8_lossy(&unb64("key", &self.key)?).into_owned())
    }

    pub fn into_kv(self) -> Result<Kv, EtcdError> {
        Ok(Kv {
            key: self.key()?,
            value: unb64("value", &self.value)?,
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            lease: self.lease,
        })
    }
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct RangeResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub kvs: Vec<RawKv>,
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct HeaderOnly {
    #[serde(default)]
    pub header: Header,
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct ResponseOp {
    #[serde(default)]
    pub response_range: Option<RangeResponse>,
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct TxnResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub succeeded: bool,
    #[serde(default)]
    pub responses: Vec<ResponseOp>,
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct LeaseGrantResponse {
    #[serde(default, rename = "ID", deserialize_with = "int64")]
    pub id: i64,
    #[serde(default)]
    pub error: String,
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct LeaseKeepAliveResponse {
    #[serde(default, rename = "TTL", deserialize_with = "int64")]
    pub ttl: i64,
}

/// One event of a watch response.
#[derive(Deserialize, Default, Debug)]
pub(crate) struct RawEvent {
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub kv: RawKv,
}

#[derive(Deserialize, Default, Debug)]
pub(crate) struct WatchResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub created: bool,
    #[serde(default)]
    pub canceled: bool,
    #[serde(default, deserialize_with = "int64")]
    pub compact_revision: i64,
    #[serde(default)]
    pub events: Vec<RawEvent>,
}

/// An error inside a streamed answer (the HTTP status was already 200).
#[derive(Deserialize, Default, Debug)]
pub(crate) struct StreamError {
    #[serde(default)]
    pub http_code: u16,
    #[serde(default)]
    pub message: String,
}

/// One line of a streamed answer (`/v3/watch`, `/v3/lease/keepalive`).
#[derive(Deserialize, Debug)]
#[serde(bound = "T: DeserializeOwned")]
pub(crate) struct StreamLine<T> {
    #[serde(default)]
    pub result: Option<T>,
    #[serde(default)]
    pub error: Option<StreamError>,
}

impl<T: DeserializeOwned> StreamLine<T> {
    /// The line's result, or its error as [`EtcdError::Server`].
    pub fn into_result(self) -> Result<T, EtcdError> {
        if let Some(e) = self.error {
            let status = if e.http_code == 0 { 500 } else { e.http_code };
            return Err(EtcdError::Server { status, message: e.message });
        }
        self.result.ok_or_else(|| EtcdError::Protocol("a streamed answer with neither result nor error".into()))
    }
}

/// The start of a body, for error messages.
pub(crate) fn snippet(body: &[u8]) -> String {
    const MAX: usize = 200;
    let text = String::from_utf8_lossy(&body[..body.len().min(MAX)]).into_owned();
    if body.len() > MAX {
        format!("{text}...")
    } else {
        text
    }
}

/// An answer's body as `T`, or the gateway's error (`{"error","message","code"}`)
/// when the status is not a success.
pub(crate) fn decode<T: DeserializeOwned>(status: u16, body: &[u8]) -> Result<T, EtcdError> {
    if !(200..300).contains(&status) {
        return Err(server_error(status, body));
    }
    serde_json::from_slice(body).map_err(|e| EtcdError::Protocol(format!("{e} in {:?}", snippet(body))))
}

/// The first non-empty line of a streamed answer.
pub(crate) fn decode_first_line<T: DeserializeOwned>(status: u16, body: &[u8]) -> Result<T, EtcdError> {
    if !(200..300).contains(&status) {
        return Err(server_error(status, body));
    }
    let line = body
        .split(|&b| b == b'\n')
        .find(|l| !l.iter().all(u8::is_ascii_whitespace))
        .ok_or_else(|| EtcdError::Protocol("an empty streamed answer".into()))?;
    decode::<StreamLine<T>>(status, line)?.into_result()
}

pub(crate) fn server_error(status: u16, body: &[u8]) -> EtcdError {
    #[derive(Deserialize)]
    struct GatewayError {
        #[serde(default)]
        error: String,
        #[serde(default)]
        message: String,
    }
    let message = match serde_json::from_slice::<GatewayError>(body) {
        Ok(e) if !e.message.is_empty() => e.message,
        Ok(e) if !e.error.is_empty() => e.error,
        _ => snippet(body),
    };
    EtcdError::Server { status, message }
}

/// Whether a server error says the lease does not exist (any more).
pub(crate) fn is_lease_not_found(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Server { message, .. } if message.contains("lease not found"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges() {
        assert_eq!(prefix_range("a/"), (b"a/".to_vec(), b"a0".to_vec()));
        assert_eq!(prefix_range(""), (vec![0], vec![0]));
        let p = String::from_utf8(vec![b'a', 0x7f]).unwrap();
        assert_eq!(prefix_range(&p), (vec![b'a', 0x7f], vec![b'a', 0x80]));
        // "é" is [0xc3, 0xa9]: the last byte is incremented.
        assert_eq!(prefix_range("é").1, vec![0xc3, 0xaa]);
    }

    #[test]
    fn int64_as_text_or_number() {
        let h: Header = serde_json::from_str(r#"{"revision":"42"}"#).unwrap();
        assert_eq!(h.revision, 42);
        let h: Header = serde_json::from_str(r#"{"revision":7}"#).unwrap();
        assert_eq!(h.revision, 7);
        let h: Header = serde_json::from_str(r#"{"revision":null}"#).unwrap();
        assert_eq!(h.revision, 0);
        let h: Header = serde_json::from_str(r#"{}"#).unwrap();
        assert_eq!(h.revision, 0);
        assert!(serde_json::from_str::<Header>(r#"{"revision":"x"}"#).is_err());
    }

    #[test]
    fn kvs_and_events() {
        let r: RangeResponse = serde_json::from_str(
            r#"{"header":{"revision":"3"},"kvs":[{"key":"Zm9v","create_revision":"2","mod_revision":"3","version":"2"}],"count":"1"}"#,
        )
        .unwrap();
        let kv = r.kvs.into_iter().next().unwrap().into_kv().unwrap();
        assert_eq!(
            kv,
            Kv { key: "foo".into(), value: vec![], create_revision: 2, mod_revision: 3, version: 2, lease: 0 }
        );
        let line: StreamLine<WatchResponse> = serde_json::from_str(
            r#"{"result":{"header":{"revision":"6"},"events":[{"kv":{"key":"Zm9v","mod_revision":"4","value":"YmFy"}},{"type":"DELETE","kv":{"key":"Zm9v","mod_revision":"5"}}]}}"#,
        )
        .unwrap();
        let w = line.into_result().unwrap();
        assert_eq!(w.events.len(), 2);
        assert_eq!(w.events[0].kind, "");
        assert_eq!(w.events[1].kind, "DELETE");
        let line: StreamLine<WatchResponse> =
            serde_json::from_str(r#"{"error":{"grpc_code":14,"http_code":503,"message":"no leader"}}"#).unwrap();
        assert!(matches!(line.into_result(), Err(EtcdError::Server { status: 503, .. })));
    }

    #[test]
    fn gateway_errors() {
        let e = server_error(404, br#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#);
        assert!(is_lease_not_found(&e));
        let e = server_error(502, b"Bad Gateway");
        assert!(matches!(e, EtcdError::Server { status: 502, ref message } if message == "Bad Gateway"));
        assert!(matches!(decode::<Header>(200, b"{nope"), Err(EtcdError::Protocol(_))));
    }
}
