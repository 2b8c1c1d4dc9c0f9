//! The pipeline API's JSON: `{"inputs": {"x": [[3, 4]]}}` in,
//! `{"outputs": {"y": [[0.6, 0.8]]}}` out.
//!
//! The `inputs` object is read with a visitor that refuses a name given
//! twice: a generic JSON map keeps the last of duplicate keys silently,
//! which would let two readers of one body (a proxy and the node) disagree
//! about what was asked.

use super::{json, validate_and_store, BodyParts, Parsed, Source};
use crate::arena::{Arena, Tensors};
use crate::error::NodeError;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use slipstream_types::{DType, TensorSpec};
use std::collections::BTreeMap;
use std::fmt;

/// A body's `inputs`: its entries in order, names unique; `None` when it is
/// not an object.
struct Inputs(Option<Vec<(String, Value)>>);

const DUPLICATE: &str = "is given more than once";

impl<'de> Deserialize<'de> for Inputs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Inputs, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Inputs;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of named inputs")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Inputs, A::Error> {
                let mut out: Vec<(String, Value)> = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, Value>()? {
                    if out.iter().any(|(n, _)| *n == k) {
                        return Err(de::Error::custom(format!("input '{k}' {DUPLICATE}")));
                    }
                    out.push((k, v));
                }
                Ok(Inputs(Some(out)))
            }
            // Anything else is well-formed JSON of the wrong shape.
            fn visit_bool<E>(self, _: bool) -> Result<Inputs, E> {
                Ok(Inputs(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Inputs, E> {
                Ok(Inputs(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Inputs, E> {
                Ok(Inputs(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Inputs, E> {
                Ok(Inputs(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Inputs, E> {
                Ok(Inputs(None))
            }
            fn visit_unit<E>(self) -> Result<Inputs, E> {
                Ok(Inputs(None))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut s: A) -> Result<Inputs, A::Error> {
                while s.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Inputs(None))
            }
        }
        d.deserialize_any(Entries)
    }
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    inputs: Option<Inputs>,
}

fn not_an_object() -> NodeError {
    NodeError::BadRequest("body must be an object with an \"inputs\" object".into())
}

/// The `inputs` of a pipeline-API body, names unique.
fn parse_inputs(text: &[u8]) -> Result<Vec<(String, Value)>, NodeError> {
    match serde_json::from_slice::<Body>(text) {
        Ok(Body { inputs: Some(Inputs(Some(entries))) }) => Ok(entries),
        Ok(_) => Err(not_an_object()),
        Err(e) if e.is_data() && e.to_string().contains(DUPLICATE) => {
            let msg = e.to_string();
            Err(NodeError::BadInput(msg.split(" at line").next().unwrap_or(&msg).to_string()))
        }
        Err(e) if e.is_data() => Err(not_an_object()),
        Err(e) => Err(NodeError::BadRequest(format!("body is not valid JSON: {e}"))),
    }
}

/// Decode a pipeline-API request body: `{"inputs": {"x": [[...]]}}`.
pub fn decode_v1(
    body: &BodyParts,
    declared: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
) -> Result<Tensors, NodeError> {
    let inputs = parse_inputs(&body.contiguous(0, body.len(), arena, true))?;
    let mut parsed = Vec::with_capacity(inputs.len());
    for (name, val) in &inputs {
        let Some(spec) = declared.get(name) else {
            parsed.push(Parsed {
                base64_bytes: true,
                name: name.clone(),
                dtype: DType::Float32,
                shape: vec![],
                source: Source::Json(val),
            });
            continue;
        };
        if !val.is_array() {
            return Err(super::bad(format!("input '{name}' must be a (nested) array")));
        }
        let shape = json::json_shape(val, name)?;
        parsed.push(Parsed {
            base64_bytes: true,
            name: name.clone(),
            dtype: spec.dtype,
            shape,
            source: Source::Json(val),
        });
    }
    validate_and_store(parsed, declared, arena, body)
}

/// `{"outputs": {"y": [[...]]}}`
pub fn encode_v1(outputs: &Tensors) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + outputs.iter().map(|(_, t)| t.nbytes as usize * 3).sum::<usize>());
    out.extend_from_slice(b"{\"outputs\":{");
    for (i, (name, t)) in outputs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, name).expect("string serialises");
        out.push(b':');
        json::write_json_tensor(&mut out, t, true);
    }
    out.extend_from_slice(b"}}");
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    #[test]
    fn decodes_converts_and_round_trips() {
        let (a, _d) = arena();
        let t =
            decode_v1(&body(&[br#"{"inputs": {"x": [[1, 2.5], [3, -4]]}}"#]), &declared(DType::Float32, &[-1, 2]), &a)
                .unwrap();
        assert_eq!(t[0].1.shape, vec![2, 2]);
        let json = String::from_utf8(encode_v1(&t)).unwrap();
        assert_eq!(json, r#"{"outputs":{"x":[[1.0,2.5],[3.0,-4.0]]}}"#);
        assert_eq!(a.copies.snapshot().ingress, 1);
    }

    #[test]
    fn integer_range_and_type_errors() {
        let (a, _d) = arena();
        let d = declared(DType::Uint8, &[-1]);
        let e = decode_v1(&body(&[br#"{"inputs": {"x": [300]}}"#]), &d, &a).unwrap_err();
        assert!(e.to_string().contains("expects uint8"), "{e}");
        let e = decode_v1(&body(&[br#"{"inputs": {"x": [1.5]}}"#]), &d, &a).unwrap_err();
        assert_eq!(e.kind(), "bad_input");
        let ok = decode_v1(&body(&[br#"{"inputs": {"x": [0, 255]}}"#]), &d, &a).unwrap();
        assert_eq!(ok[0].1.bytes(), &[0u8, 255]);
    }

    #[test]
    fn nested_json_for_3d_tensor() {
        let (a, _d) = arena();
        let t = decode_v1(
            &body(&[br#"{"inputs": {"x": [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]}}"#]),
            &declared(DType::Int64, &[-1, 2, 2]),
            &a,
        )
        .unwrap();
        assert_eq!(String::from_utf8(encode_v1(&t)).unwrap(), r#"{"outputs":{"x":[[[1,2],[3,4]],[[5,6],[7,8]]]}}"#);
    }

    #[test]
    fn a_name_given_twice_is_refused() {
        let (a, _d) = arena();
        let d = declared(DType::Float32, &[-1]);
        let e = decode_v1(&body(&[br#"{"inputs": {"x": [1], "x": [2, 3]}}"#]), &d, &a).unwrap_err();
        assert_eq!((e.kind(), e.to_string().as_str()), ("bad_input", "input 'x' is given more than once"));
    }

    #[test]
    fn body_shape_errors_are_bad_requests() {
        let (a, _d) = arena();
        let d = declared(DType::Float32, &[-1]);
        for raw in [&b"{not json"[..], b"[1, 2]", b"{}", br#"{"inputs": [1]}"#, br#"{"inputs": 3}"#, b""] {
            let e = decode_v1(&body(&[raw]), &d, &a).unwrap_err();
            assert_eq!(e.kind(), "bad_request", "{}: {e}", String::from_utf8_lossy(raw));
        }
        let e = decode_v1(&body(&[b"{\"inputs\": {\"x\": [1]"]), &d, &a).unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        // Scalars where arrays belong, and zero rows, are bad inputs.
        let e = decode_v1(&body(&[br#"{"inputs": {"x": 5}}"#]), &d, &a).unwrap_err();
        assert_eq!(e.kind(), "bad_input");
        let e = decode_v1(&body(&[br#"{"inputs": {"x": []}}"#]), &d, &a).unwrap_err();
        assert!(e.to_string().contains("no rows"), "{e}");
        assert_eq!(a.ingress().used_pages(), 0, "nothing stays allocated");
    }
}
