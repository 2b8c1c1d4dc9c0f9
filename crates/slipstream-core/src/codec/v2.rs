//! The Open Inference Protocol (KServe v2) over HTTP: JSON tensors, and
//! the binary-tensor extension (a JSON header of
//! `Inference-Header-Content-Length` bytes, then each tensor's raw bytes in
//! input order, sized by its `binary_data_size`).
//!
//! Every stated size is checked against the body before it is used: the
//! element count of a shape may not overflow, a fixed-size tensor's
//! `binary_data_size` must equal its shape's bytes exactly, and each binary
//! slice must lie inside what is left of the body. Input names are unique.

use super::{bad, json, parse_json, too_large, validate_and_store, BodyParts, Parsed, Source};
use crate::arena::{Arena, TensorRef, Tensors};
use crate::error::NodeError;
use bytes::Bytes;
use serde_json::{Map, Value};
use slipstream_types::{checked_nbytes, checked_numel, DType, TensorSpec};
use std::collections::BTreeMap;

/// What a v2 request asked of its outputs.
#[derive(Debug, Default)]
pub struct V2Request {
    /// The request's id, echoed in the answer.
    pub id: Option<Value>,
    /// Names asked for, in order; empty means all.
    pub outputs: Vec<String>,
    /// Output names to be returned as binary (extension), or all if `binary_all`.
    pub binary: Vec<String>,
    /// Every output as binary data (`binary_data_output`).
    pub binary_all: bool,
}

fn param_bool(v: &Value, key: &str) -> bool {
    v.get("parameters").and_then(|p| p.get(key)).and_then(Value::as_bool).unwrap_or(false)
}

/// What every v2 input must satisfy, whichever wire form carries it (JSON
/// over HTTP, protobuf over gRPC): a name not given before, a datatype the
/// protocol knows, a shape whose element count does not overflow. Returns
/// the dtype and the element count.
pub(super) fn check_input(
    name: &str,
    datatype: &str,
    shape: &[u64],
    earlier: &[Parsed<'_>],
) -> Result<(DType, u64), NodeError> {
    if earlier.iter().any(|p| p.name == name) {
        return Err(bad(format!("input '{name}' is given more than once")));
    }
    let dtype =
        DType::from_v2(datatype).ok_or_else(|| bad(format!("input '{name}': unsupported datatype '{datatype}'")))?;
    let n = checked_numel(shape).ok_or_else(|| too_large(name, shape))?;
    Ok((dtype, n))
}

/// A fixed-size input sent as raw bytes must be exactly its shape's size
/// (`field` names where the client stated the size, for the message).
/// Variable-size inputs are checked element by element when stored.
pub(super) fn check_raw_len(name: &str, dtype: DType, shape: &[u64], len: u64, field: &str) -> Result<(), NodeError> {
    if dtype.is_variable() {
        return Ok(());
    }
    let want = checked_nbytes(dtype, shape).ok_or_else(|| too_large(name, shape))?;
    if len != want {
        return Err(bad(format!(
            "input '{name}': {field} {len} does not match shape {shape:?} of {} ({want} bytes)",
            dtype.v2_name()
        )));
    }
    Ok(())
}

/// The outputs a v2 request asked for (`requested`, in its order; all when
/// empty), each of which must exist.
pub(super) fn select_outputs<'a>(
    requested: &[String],
    outputs: &'a Tensors,
) -> Result<Vec<&'a (String, TensorRef)>, NodeError> {
    if requested.is_empty() {
        return Ok(outputs.iter().collect());
    }
    requested
        .iter()
        .map(|n| {
            outputs.iter().find(|(k, _)| k == n).ok_or_else(|| {
                let known: Vec<&str> = outputs.iter().map(|(k, _)| k.as_str()).collect();
                bad(format!("unknown output '{n}' requested (outputs: {})", known.join(", ")))
            })
        })
        .collect()
}

/// Decode an Open Inference Protocol request (JSON, or JSON header plus
/// binary tensors when `header_len` is given).
pub fn decode_v2(
    body: &BodyParts,
    header_len: Option<usize>,
    declared: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
) -> Result<(Tensors, V2Request), NodeError> {
    let json_len = match header_len {
        Some(n) if n > body.len() => {
            return Err(NodeError::BadRequest(format!(
                "Inference-Header-Content-Length {n} exceeds the body ({} bytes)",
                body.len()
            )))
        }
        Some(n) => n,
        None => body.len(),
    };
    // The JSON header may be joined; tensor bytes never are: they are copied
    // from the body's chunks straight into the arena.
    let v = parse_json(&body.contiguous(0, json_len, arena, header_len.is_none()))?;
    let mut binary_at = json_len;
    let inputs = v
        .get("inputs")
        .and_then(Value::as_array)
        .ok_or_else(|| NodeError::BadRequest("body must have an \"inputs\" array".into()))?;
    let mut parsed: Vec<Parsed<'_>> = Vec::with_capacity(inputs.len());
    for inp in inputs {
        let name = inp.get("name").and_then(Value::as_str).ok_or_else(|| bad("every input needs a \"name\""))?;
        let dt = inp
            .get("datatype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("input '{name}' needs a \"datatype\"")))?;
        let shape: Vec<u64> = inp
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| bad(format!("input '{name}' needs a \"shape\" of non-negative integers")))?;
        let (dtype, n) = check_input(name, dt, &shape, &parsed)?;
        let binary_size = match inp.get("parameters").and_then(|p| p.get("binary_data_size")) {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                bad(format!("input '{name}': binary_data_size must be a non-negative integer, got {v}"))
            })?),
        };
        let source = if let Some(size) = binary_size {
            let left = body.len() - binary_at;
            check_raw_len(name, dtype, &shape, size, "binary_data_size")?;
            let len = usize::try_from(size).ok().filter(|&s| s <= left).ok_or_else(|| {
                bad(format!(
                    "input '{name}': binary data is shorter than binary_data_size ({size} bytes stated, {left} left)"
                ))
            })?;
            binary_at += len;
            Source::Raw { at: binary_at - len, len }
        } else {
            let data = inp
                .get("data")
                .ok_or_else(|| bad(format!("input '{name}' has neither \"data\" nor binary_data_size")))?;
            let mut count = 0u64;
            json::for_each_leaf(data, &mut |_| {
                count += 1;
                Ok(())
            })?;
            if count != n {
                return Err(bad(format!("input '{name}' has {count} values but shape {shape:?} needs {n}")));
            }
            Source::Json(data)
        };
        parsed.push(Parsed { base64_bytes: false, name: name.to_string(), dtype, shape, source });
    }
    if binary_at != body.len() {
        return Err(bad(format!("{} bytes of binary data belong to no input", body.len() - binary_at)));
    }
    let mut req =
        V2Request { id: v.get("id").cloned(), binary_all: param_bool(&v, "binary_data_output"), ..Default::default() };
    if let Some(outs) = v.get("outputs").and_then(Value::as_array) {
        for o in outs {
            let name =
                o.get("name").and_then(Value::as_str).ok_or_else(|| bad("every requested output needs a \"name\""))?;
            req.outputs.push(name.to_string());
            if param_bool(o, "binary_data") {
                req.binary.push(name.to_string());
            }
        }
    }
    let tensors = validate_and_store(parsed, declared, arena, body)?;
    Ok((tensors, req))
}

/// An arena slice that outlives the request: lets egress hand tensor bytes
/// to the socket without copying them.
pub(super) struct ArenaBytes(pub(super) TensorRef);

impl AsRef<[u8]> for ArenaBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Encoded v2 response: body chunks, and the JSON header length when the
/// binary extension is used.
pub struct V2Response {
    /// The body, as chunks (tensor bytes borrowed from the arena).
    pub chunks: Vec<Bytes>,
    /// The JSON header's length, when binary data follows it.
    pub header_len: Option<usize>,
}

/// Encode `outputs` as the answer to `req` (JSON, or JSON and binary data as it asked).
pub fn encode_v2(model: &str, req: &V2Request, outputs: &Tensors) -> Result<V2Response, NodeError> {
    let selected = select_outputs(&req.outputs, outputs)?;
    let mut head = Map::new();
    head.insert("model_name".into(), Value::String(model.into()));
    head.insert("model_version".into(), Value::String("1".into()));
    if let Some(id) = &req.id {
        head.insert("id".into(), id.clone());
    }
    let mut json = serde_json::to_vec(&Value::Object(head)).expect("serialises");
    json.pop(); // reopen the object to append "outputs" without a Value per element
    json.extend_from_slice(b",\"outputs\":[");
    let mut blobs = Vec::new();
    for (i, (name, t)) in selected.into_iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        json.extend_from_slice(b"{\"name\":");
        serde_json::to_writer(&mut json, name).expect("serialises");
        json.extend_from_slice(
            format!(",\"datatype\":\"{}\",\"shape\":{:?}", t.dtype.v2_name(), t.shape).replace(' ', "").as_bytes(),
        );
        if req.binary_all || req.binary.iter().any(|b| b == name) {
            json.extend_from_slice(format!(",\"parameters\":{{\"binary_data_size\":{}}}}}", t.nbytes).as_bytes());
            blobs.push(Bytes::from_owner(ArenaBytes(t.clone())));
        } else {
            json.extend_from_slice(b",\"data\":");
            json::write_json_tensor(&mut json, t, false);
            json.push(b'}');
        }
    }
    json.extend_from_slice(b"]}");
    let header_len = (!blobs.is_empty()).then_some(json.len());
    let mut chunks = vec![Bytes::from(json)];
    chunks.extend(blobs);
    Ok(V2Response { chunks, header_len })
}

/// The v2 metadata of one declared tensor.
pub fn v2_tensor_meta(name: &str, spec: &TensorSpec) -> Value {
    serde_json::json!({ "name": name, "datatype": spec.dtype.v2_name(), "shape": spec.shape })
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    fn v2(head: &str, binary: &[u8]) -> Result<(Tensors, V2Request), NodeError> {
        let (a, _d) = arena();
        let b = body(&[head.as_bytes(), binary]);
        decode_v2(&b, Some(head.len()), &declared(DType::Float32, &[-1, 4]), &a)
    }

    #[test]
    fn binary_input_split_across_chunks() {
        let (a, _d) = arena();
        let head = br#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}],"outputs":[{"name":"x","parameters":{"binary_data":true}}]}"#;
        let data: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        let b = body(&[head, &data[..3], &data[3..]]);
        let (t, req) = decode_v2(&b, Some(head.len()), &declared(DType::Float32, &[-1, 2]), &a).unwrap();
        assert_eq!(t[0].1.bytes(), &data[..]);
        assert_eq!(a.copies.snapshot().body_join, 0, "binary tensors are never joined");
        let resp = encode_v2("m", &req, &t).unwrap();
        assert_eq!(resp.chunks.len(), 2);
        assert_eq!(&resp.chunks[1][..], &data[..]);
        let meta: Value = serde_json::from_slice(&resp.chunks[0]).unwrap();
        assert_eq!(meta["outputs"][0]["parameters"]["binary_data_size"], 8);
        assert_eq!(resp.header_len, Some(resp.chunks[0].len()));
    }

    #[test]
    fn rejects_leftover_or_short_binary() {
        let (a, _d) = arena();
        let head = br#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        let d = declared(DType::Float32, &[-1]);
        let short = body(&[head, &[0u8; 4]]);
        assert!(decode_v2(&short, Some(head.len()), &d, &a).unwrap_err().to_string().contains("shorter"));
        let long = body(&[head, &[0u8; 12]]);
        assert!(decode_v2(&long, Some(head.len()), &d, &a).unwrap_err().to_string().contains("belong to no input"));
    }

    /// Finding 2 of the robustness issue: 2^62 rows of 4 FP32 wrap to 0
    /// bytes unchecked, so `binary_data_size: 0` passed and the request
    /// reached the component.
    #[test]
    fn a_shape_whose_size_wraps_is_refused() {
        let head = r#"{"inputs":[{"name":"x","shape":[4611686018427387904,4],"datatype":"FP32","parameters":{"binary_data_size":0}}]}"#;
        let e = v2(head, b"").unwrap_err();
        assert_eq!(e.kind(), "bad_input", "{e}");
        assert!(e.to_string().contains("larger than any request"), "{e}");
        // The same shape with JSON data (zero values for "zero" elements).
        let head = r#"{"inputs":[{"name":"x","shape":[4611686018427387904,4],"datatype":"FP32","data":[]}]}"#;
        assert_eq!(v2(head, b"").unwrap_err().kind(), "bad_input");
        let head = r#"{"inputs":[{"name":"x","shape":[18446744073709551615,18446744073709551615],"datatype":"FP32","data":[]}]}"#;
        assert_eq!(v2(head, b"").unwrap_err().kind(), "bad_input");
    }

    /// Two BYTES inputs sized u64::MAX and 1: the sum wrapped, and the first
    /// slice ran past the body.
    #[test]
    fn binary_sizes_past_the_body_are_refused() {
        let (a, _d) = arena();
        let d = BTreeMap::from([
            ("a".to_string(), TensorSpec { dtype: DType::Bytes, shape: vec![-1] }),
            ("b".to_string(), TensorSpec { dtype: DType::Bytes, shape: vec![-1] }),
        ]);
        let head = r#"{"inputs":[{"name":"a","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":18446744073709551615}},{"name":"b","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":1}}]}"#;
        for tail in [&b""[..], b"\x01", &[0u8; 64]] {
            let b = body(&[head.as_bytes(), tail]);
            let e = decode_v2(&b, Some(head.len()), &d, &a).unwrap_err();
            assert_eq!(e.kind(), "bad_input", "{e}");
        }
        let head = r#"{"inputs":[{"name":"a","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":-1}}]}"#;
        let b = body(&[head.as_bytes()]);
        assert_eq!(decode_v2(&b, Some(head.len()), &d, &a).unwrap_err().kind(), "bad_input");
    }

    #[test]
    fn a_name_given_twice_is_refused() {
        let head = r#"{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]},{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}"#;
        let e = v2(head, b"").unwrap_err();
        assert_eq!((e.kind(), e.to_string().as_str()), ("bad_input", "input 'x' is given more than once"));
    }

    #[test]
    fn a_header_length_past_the_body_is_refused() {
        let (a, _d) = arena();
        let b = body(&[b"{}"]);
        let d = declared(DType::Float32, &[-1, 4]);
        assert_eq!(decode_v2(&b, Some(usize::MAX), &d, &a).unwrap_err().kind(), "bad_request");
    }
}
