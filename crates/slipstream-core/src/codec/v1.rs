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
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use slipstream_types::{DType, TensorSpec};
use std::collections::BTreeMap;
use std::fmt;

/// One entry of a body's `inputs`: read straight into bytes when the
/// pipeline declares it with a fixed-size dtype, else kept as JSON.
enum Entry {
    Dense(json::Dense),
    Json(Value),
}

/// A body's `inputs`: its entries in order, names unique; `None` when it is
/// not an object.
struct Inputs(Option<Vec<(String, Entry)>>);

const DUPLICATE: &str = "is given more than once";

/// Reads a body's `inputs` object, each declared fixed-size input with a
/// [`json::DenseSeed`].
struct InputsSeed<'d>(&'d BTreeMap<String, TensorSpec>);

impl<'de> DeserializeSeed<'de> for InputsSeed<'_> {
    type Value = Inputs;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Inputs, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for InputsSeed<'_> {
    type Value = Inputs;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of named inputs")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Inputs, A::Error> {
        let mut out: Vec<(String, Entry)> = Vec::new();
        while let Some(k) = m.next_key::<String>()? {
            if out.iter().any(|(n, _)| *n == k) {
                return Err(de::Error::custom(format!("input '{k}' {DUPLICATE}")));
            }
            let entry = match self.0.get(&k) {
                Some(spec) if !spec.dtype.is_variable() => {
                    Entry::Dense(m.next_value_seed(json::DenseSeed { dtype: spec.dtype, name: &k })?)
                }
                _ => Entry::Json(m.next_value()?),
            };
            out.push((k, entry));
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

/// Reads a body: its `inputs` (given once) and nothing else.
struct BodySeed<'d>(&'d BTreeMap<String, TensorSpec>);

impl<'de> DeserializeSeed<'de> for BodySeed<'_> {
    type Value = Option<Inputs>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Inputs>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed<'_> {
    type Value = Option<Inputs>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with an \"inputs\" object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Option<Inputs>, A::Error> {
        let mut inputs = None;
        while let Some(k) = m.next_key::<std::borrow::Cow<'de, str>>()? {
            if k != "inputs" {
                m.next_value::<de::IgnoredAny>()?;
            } else if inputs.is_some() {
                return Err(de::Error::duplicate_field("inputs"));
            } else {
                inputs = Some(m.next_value_seed(InputsSeed(self.0))?);
            }
        }
        Ok(inputs)
    }
}

fn not_an_object() -> NodeError {
    NodeError::BadRequest("body must be an object with an \"inputs\" object".into())
}

/// The `inputs` of a pipeline-API body, names unique. An error about one
/// input (its text starts `input '`) is bad input; any other wrong shape of
/// well-formed JSON is a bad request.
fn parse_inputs(text: &[u8], declared: &BTreeMap<String, TensorSpec>) -> Result<Vec<(String, Entry)>, NodeError> {
    let mut de = serde_json::Deserializer::from_slice(text);
    let parsed = BodySeed(declared).deserialize(&mut de).and_then(|b| de.end().map(|()| b));
    match parsed {
        Ok(Some(Inputs(Some(entries)))) => Ok(entries),
        Ok(_) => Err(not_an_object()),
        Err(e) if e.is_data() && e.to_string().starts_with("input '") => {
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
    let inputs = parse_inputs(&body.contiguous(0, body.len(), arena, true), declared)?;
    let mut parsed = Vec::with_capacity(inputs.len());
    for (name, entry) in &inputs {
        let (dtype, shape, source) = match entry {
            Entry::Dense(d) => (declared[name].dtype, d.shape.clone(), Source::Dense(&d.bytes)),
            Entry::Json(val) => match declared.get(name) {
                // Not taken: reported with the other unexpected names.
                None => (DType::Float32, vec![], Source::Json(val)),
                Some(_) if !val.is_array() => return Err(super::bad(json::not_an_array(name))),
                Some(spec) => (spec.dtype, json::json_shape(val, name)?, Source::Json(val)),
            },
        };
        parsed.push(Parsed { base64_bytes: true, name: name.clone(), dtype, shape, source });
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
