//! The Open Inference Protocol (KServe v2) over gRPC: a `ModelInferRequest`
//! in, a `ModelInferResponse` out (the messages of `slipstream-kserve`).
//!
//! An input's elements come either as typed protobuf values
//! (`contents.fp32_contents`, ...) or as raw little-endian bytes in
//! `raw_input_contents`, one entry per input in input order (what
//! tritonclient sends); a request uses one or the other. Raw entries are
//! slices of the received message, so they are checked and copied once,
//! into the arena, by the same code as the HTTP binary extension: this
//! decoder only lays them out as a [`BodyParts`] of one chunk per input.
//! Typed values are first written out in that same layout (one copy; it is
//! the slow path, and keeps one validator for both). The per-input checks
//! (unique names, known datatypes, element counts that do not overflow,
//! raw sizes that match the shape exactly) are [`super::v2`]'s; the checks
//! against the declared inputs are [`super::validate_and_store`]'s.
//!
//! Outputs go back as `raw_output_contents` (tritonclient's default), in
//! the order the request named them (all when it named none); each is a
//! `Bytes` over its arena block, so building the response copies nothing.

use super::v2::{check_input, check_raw_len, select_outputs, ArenaBytes};
use super::{bad, validate_and_store, BodyParts, Parsed, Source};
use crate::arena::{Arena, Tensors};
use crate::error::NodeError;
use bytes::Bytes;
use slipstream_kserve::inference::model_infer_response::InferOutputTensor;
use slipstream_kserve::inference::{InferTensorContents, ModelInferRequest, ModelInferResponse};
use slipstream_types::{DType, TensorSpec};
use std::collections::BTreeMap;

/// What a gRPC request asked of its response.
#[derive(Debug, Default)]
pub struct GrpcRequest {
    /// Echoed in the response.
    pub id: String,
    /// Output names asked for, in order; empty means all.
    pub outputs: Vec<String>,
}

/// Decode a `ModelInferRequest` against the pipeline's declared inputs.
pub fn decode_grpc(
    req: ModelInferRequest,
    declared: &BTreeMap<String, TensorSpec>,
    arena: &Arena,
) -> Result<(Tensors, GrpcRequest), NodeError> {
    let raw = req.raw_input_contents;
    if !raw.is_empty() && raw.len() != req.inputs.len() {
        return Err(bad(format!(
            "raw_input_contents has {} entries for {} inputs (one per input, in input order)",
            raw.len(),
            req.inputs.len()
        )));
    }
    let mut heads = Vec::with_capacity(req.inputs.len());
    let mut chunks: Vec<Bytes> = Vec::with_capacity(req.inputs.len());
    let mut parsed: Vec<Parsed<'_>> = Vec::with_capacity(req.inputs.len());
    for (i, inp) in req.inputs.into_iter().enumerate() {
        let name = inp.name;
        let shape: Vec<u64> = inp
            .shape
            .iter()
            .map(|&d| u64::try_from(d).ok())
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("input '{name}' has a negative dimension in shape {:?}", inp.shape)))?;
        let (dtype, n) = check_input(&name, &inp.datatype, &shape, &parsed)?;
        let data = match raw.get(i) {
            Some(r) => {
                if inp.contents.as_ref().is_some_and(|c| !filled(c).is_empty()) {
                    return Err(bad(format!(
                        "input '{name}' has both contents and raw_input_contents (a request uses one or the other)"
                    )));
                }
                check_raw_len(&name, dtype, &shape, r.len() as u64, "raw_input_contents of")?;
                r.clone()
            }
            None => typed_to_raw(&name, dtype, &shape, n, inp.contents.unwrap_or_default())?,
        };
        heads.push(data.len());
        chunks.push(data);
        // Placeholder source: offsets are set below, once every chunk is known.
        parsed.push(Parsed { base64_bytes: false, name, dtype, shape, source: Source::Raw { at: 0, len: 0 } });
    }
    let mut at = 0usize;
    for (p, len) in parsed.iter_mut().zip(heads) {
        p.source = Source::Raw { at, len };
        at = at.checked_add(len).ok_or_else(|| bad("the request's tensors are larger than any request can hold"))?;
    }
    let body = BodyParts::new(chunks);
    let tensors = validate_and_store(parsed, declared, arena, &body)?;
    let outputs = req.outputs.into_iter().map(|o| o.name).collect();
    Ok((tensors, GrpcRequest { id: req.id, outputs }))
}

/// The typed field that carries `dtype` (None: FP16, which has none).
fn field_of(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "bool_contents",
        DType::Int8 | DType::Int16 | DType::Int32 => "int_contents",
        DType::Int64 => "int64_contents",
        DType::Uint8 | DType::Uint16 | DType::Uint32 => "uint_contents",
        DType::Uint64 => "uint64_contents",
        DType::Float32 => "fp32_contents",
        DType::Float64 => "fp64_contents",
        DType::String | DType::Bytes => "bytes_contents",
        DType::Float16 => return None,
    })
}

/// The non-empty typed fields of `c`, by name.
fn filled(c: &InferTensorContents) -> Vec<&'static str> {
    [
        ("bool_contents", c.bool_contents.len()),
        ("int_contents", c.int_contents.len()),
        ("int64_contents", c.int64_contents.len()),
        ("uint_contents", c.uint_contents.len()),
        ("uint64_contents", c.uint64_contents.len()),
        ("fp32_contents", c.fp32_contents.len()),
        ("fp64_contents", c.fp64_contents.len()),
        ("bytes_contents", c.bytes_contents.len()),
    ]
    .into_iter()
    .filter(|(_, n)| *n > 0)
    .map(|(f, _)| f)
    .collect()
}

/// Typed values written out as raw little-endian bytes (variable-size
/// elements length-prefixed), after checking that they sit in the field
/// their datatype names, that there are as many as the shape needs, and
/// that each fits the datatype (an INT8 of 300 is refused, never wrapped).
fn typed_to_raw(name: &str, dtype: DType, shape: &[u64], n: u64, c: InferTensorContents) -> Result<Bytes, NodeError> {
    let v2 = dtype.v2_name();
    let Some(field) = field_of(dtype) else {
        return Err(bad(format!(
            "input '{name}' is {v2}, which has no typed contents field: send it in raw_input_contents"
        )));
    };
    let stray: Vec<&str> = filled(&c).into_iter().filter(|f| *f != field).collect();
    if !stray.is_empty() {
        return Err(bad(format!("input '{name}' is {v2}: its values belong in {field}, not {}", stray.join(", "))));
    }
    let count_ok = |count: usize| {
        if count as u64 == n {
            Ok(())
        } else if count == 0 {
            Err(bad(format!("input '{name}' has no data: neither contents.{field} nor raw_input_contents")))
        } else {
            Err(bad(format!("input '{name}' has {count} values in {field} but shape {shape:?} needs {n}")))
        }
    };
    let out_of_range = |v: &dyn std::fmt::Display| bad(format!("input '{name}' expects {dtype} values, got {v}"));
    macro_rules! narrow {
        ($values:expr, $t:ty) => {{
            count_ok($values.len())?;
            let mut out = Vec::with_capacity($values.len() * std::mem::size_of::<$t>());
            for &v in &$values {
                out.extend_from_slice(&<$t>::try_from(v).map_err(|_| out_of_range(&v))?.to_le_bytes());
            }
            out
        }};
    }
    macro_rules! exact {
        ($values:expr) => {{
            count_ok($values.len())?;
            $values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()
        }};
    }
    let out = match dtype {
        DType::Bool => {
            count_ok(c.bool_contents.len())?;
            c.bool_contents.iter().map(|&b| u8::from(b)).collect()
        }
        DType::Int8 => narrow!(c.int_contents, i8),
        DType::Int16 => narrow!(c.int_contents, i16),
        DType::Int32 => exact!(c.int_contents),
        DType::Int64 => exact!(c.int64_contents),
        DType::Uint8 => narrow!(c.uint_contents, u8),
        DType::Uint16 => narrow!(c.uint_contents, u16),
        DType::Uint32 => exact!(c.uint_contents),
        DType::Uint64 => exact!(c.uint64_contents),
        DType::Float32 => exact!(c.fp32_contents),
        DType::Float64 => exact!(c.fp64_contents),
        DType::String | DType::Bytes => {
            count_ok(c.bytes_contents.len())?;
            let mut out = Vec::new();
            for e in &c.bytes_contents {
                if u32::try_from(e.len()).is_err() {
                    return Err(bad(format!("input '{name}' has an element over 4 GiB")));
                }
                slipstream_types::var::push(&mut out, e);
            }
            out
        }
        DType::Float16 => unreachable!("no typed field: refused above"),
    };
    Ok(Bytes::from(out))
}

/// Encode a pipeline's outputs as a `ModelInferResponse` with raw contents.
pub fn encode_grpc(model: &str, req: &GrpcRequest, outputs: &Tensors) -> Result<ModelInferResponse, NodeError> {
    let selected = select_outputs(&req.outputs, outputs)?;
    let mut resp = ModelInferResponse {
        model_name: model.to_string(),
        model_version: "1".into(),
        id: req.id.clone(),
        ..Default::default()
    };
    for (name, t) in selected {
        let shape = t
            .shape
            .iter()
            .map(|&d| i64::try_from(d))
            .collect::<Result<Vec<i64>, _>>()
            .map_err(|_| NodeError::Internal(format!("output '{name}' has a shape {:?} past i64", t.shape)))?;
        resp.outputs.push(InferOutputTensor {
            name: name.clone(),
            datatype: t.dtype.v2_name().into(),
            shape,
            ..Default::default()
        });
        resp.raw_output_contents.push(Bytes::from_owner(ArenaBytes(t.clone())));
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;
    use slipstream_kserve::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};

    fn input(name: &str, dt: &str, shape: &[i64], contents: Option<InferTensorContents>) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: dt.into(),
            shape: shape.to_vec(),
            contents,
            ..Default::default()
        }
    }

    fn raw_req(inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> ModelInferRequest {
        ModelInferRequest {
            inputs,
            raw_input_contents: raw.into_iter().map(Bytes::from).collect(),
            ..Default::default()
        }
    }

    fn f32s(xs: &[f32]) -> Vec<u8> {
        xs.iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    fn err(r: Result<(Tensors, GrpcRequest), NodeError>) -> String {
        let Err(e) = r else { panic!("accepted") };
        assert_eq!(e.kind(), "bad_input", "{e}");
        e.to_string()
    }

    #[test]
    fn raw_inputs_round_trip_to_raw_outputs() {
        let (a, _d) = arena();
        let data = f32s(&[1.5, -2.0, 3.0, 4.0]);
        let mut req = raw_req(vec![input("x", "FP32", &[2, 2], None)], vec![data.clone()]);
        req.id = "r1".into();
        req.outputs = vec![InferRequestedOutputTensor { name: "x".into(), ..Default::default() }];
        let (t, g) = decode_grpc(req, &declared(DType::Float32, &[-1, 2]), &a).unwrap();
        assert_eq!((t[0].0.as_str(), t[0].1.shape.as_slice(), t[0].1.bytes()), ("x", &[2u64, 2][..], &data[..]));
        let resp = encode_grpc("m", &g, &t).unwrap();
        assert_eq!((resp.id.as_str(), resp.model_name.as_str()), ("r1", "m"));
        assert_eq!(resp.outputs[0].datatype, "FP32");
        assert_eq!(resp.outputs[0].shape, vec![2, 2]);
        assert_eq!(&resp.raw_output_contents[0][..], &data[..]);
    }

    #[test]
    fn typed_contents_of_every_field() {
        let (a, _d) = arena();
        let cases: Vec<(DType, &str, InferTensorContents, Vec<u8>)> = vec![
            (
                DType::Float32,
                "FP32",
                InferTensorContents { fp32_contents: vec![1.0, 2.5], ..Default::default() },
                f32s(&[1.0, 2.5]),
            ),
            (
                DType::Int8,
                "INT8",
                InferTensorContents { int_contents: vec![-3, 127], ..Default::default() },
                vec![0xfd, 0x7f],
            ),
            (
                DType::Int64,
                "INT64",
                InferTensorContents { int64_contents: vec![-1, 2], ..Default::default() },
                [(-1i64).to_le_bytes(), 2i64.to_le_bytes()].concat(),
            ),
            (
                DType::Uint16,
                "UINT16",
                InferTensorContents { uint_contents: vec![65535, 1], ..Default::default() },
                vec![0xff, 0xff, 1, 0],
            ),
            (
                DType::Bool,
                "BOOL",
                InferTensorContents { bool_contents: vec![true, false], ..Default::default() },
                vec![1, 0],
            ),
            (
                DType::Float64,
                "FP64",
                InferTensorContents { fp64_contents: vec![0.5, -0.25], ..Default::default() },
                [0.5f64.to_le_bytes(), (-0.25f64).to_le_bytes()].concat(),
            ),
            (
                DType::String,
                "BYTES",
                InferTensorContents {
                    bytes_contents: vec![Bytes::from_static(b"hi"), Bytes::from_static(b"")],
                    ..Default::default()
                },
                vec![2, 0, 0, 0, b'h', b'i', 0, 0, 0, 0],
            ),
        ];
        for (dtype, dt, contents, want) in cases {
            let req = raw_req(vec![input("x", dt, &[1, 2], Some(contents))], vec![]);
            let (t, _) = decode_grpc(req, &declared(dtype, &[-1, 2]), &a).unwrap_or_else(|e| panic!("{dt}: {e}"));
            assert_eq!(t[0].1.bytes(), &want[..], "{dt}");
            assert_eq!(t[0].1.dtype, dtype, "{dt}");
        }
    }

    #[test]
    fn typed_contents_are_checked() {
        let (a, _d) = arena();
        let d = declared(DType::Int8, &[-1]);
        let typed = |dt: &str, c: InferTensorContents| raw_req(vec![input("x", dt, &[2], Some(c))], vec![]);
        let ints = |v: Vec<i32>| InferTensorContents { int_contents: v, ..Default::default() };
        let msg = err(decode_grpc(typed("INT8", ints(vec![1, 300])), &d, &a));
        assert_eq!(msg, "input 'x' expects int8 values, got 300");
        let msg = err(decode_grpc(typed("INT8", ints(vec![1, 2, 3])), &d, &a));
        assert_eq!(msg, "input 'x' has 3 values in int_contents but shape [2] needs 2");
        let wrong_field = InferTensorContents { fp32_contents: vec![1.0, 2.0], ..Default::default() };
        let msg = err(decode_grpc(typed("INT8", wrong_field), &d, &a));
        assert_eq!(msg, "input 'x' is INT8: its values belong in int_contents, not fp32_contents");
        let msg = err(decode_grpc(raw_req(vec![input("x", "INT8", &[2], None)], vec![]), &d, &a));
        assert!(msg.contains("has no data"), "{msg}");
        let msg = err(decode_grpc(typed("FP16", ints(vec![1, 2])), &declared(DType::Float16, &[-1]), &a));
        assert!(msg.contains("no typed contents field"), "{msg}");
        // A declared-dtype mismatch is the shared validator's message.
        let msg = err(decode_grpc(typed("INT16", ints(vec![1, 2])), &d, &a));
        assert_eq!(msg, "input 'x' must be int8 (INT8), got INT16");
    }

    #[test]
    fn raw_sizes_and_counts_are_exact() {
        let (a, _d) = arena();
        let d = declared(DType::Float32, &[-1, 2]);
        let one = |shape: &[i64], raw: Vec<u8>| raw_req(vec![input("x", "FP32", shape, None)], vec![raw]);
        let msg = err(decode_grpc(one(&[1, 2], f32s(&[1.0])), &d, &a));
        assert_eq!(msg, "input 'x': raw_input_contents of 4 does not match shape [1, 2] of FP32 (8 bytes)");
        // 2^62 rows of 2 FP32 wrap to 0 bytes unchecked.
        let msg = err(decode_grpc(one(&[1 << 62, 2], vec![]), &d, &a));
        assert!(msg.contains("larger than any request"), "{msg}");
        let msg = err(decode_grpc(one(&[-1, 2], vec![]), &d, &a));
        assert!(msg.contains("negative dimension"), "{msg}");
        let msg = err(decode_grpc(one(&[1, 3], f32s(&[1.0, 2.0, 3.0])), &d, &a));
        assert_eq!(msg, "input 'x' must have shape [-1, 2], got [1, 3]");
        let two = raw_req(vec![input("x", "FP32", &[1, 2], None)], vec![f32s(&[1.0, 2.0]), vec![]]);
        assert!(err(decode_grpc(two, &d, &a)).contains("2 entries for 1 inputs"));
        let twice = raw_req(
            vec![input("x", "FP32", &[1, 2], None), input("x", "FP32", &[1, 2], None)],
            vec![f32s(&[1.0, 2.0]), f32s(&[1.0, 2.0])],
        );
        assert_eq!(err(decode_grpc(twice, &d, &a)), "input 'x' is given more than once");
        let both = raw_req(
            vec![input(
                "x",
                "FP32",
                &[1, 2],
                Some(InferTensorContents { fp32_contents: vec![1.0, 2.0], ..Default::default() }),
            )],
            vec![f32s(&[1.0, 2.0])],
        );
        assert!(err(decode_grpc(both, &d, &a)).contains("both contents and raw_input_contents"));
        let unknown = raw_req(vec![input("x", "FP8", &[1, 2], None)], vec![vec![0; 2]]);
        assert_eq!(err(decode_grpc(unknown, &d, &a)), "input 'x': unsupported datatype 'FP8'");
        let extra = raw_req(
            vec![input("x", "FP32", &[1, 2], None), input("z", "FP32", &[1, 2], None)],
            vec![f32s(&[1.0, 2.0]), f32s(&[1.0, 2.0])],
        );
        assert!(err(decode_grpc(extra, &d, &a)).starts_with("unexpected input(s): z"));
    }

    #[test]
    fn raw_bytes_elements_are_scanned() {
        let (a, _d) = arena();
        let d = declared(DType::String, &[-1]);
        let one = |raw: Vec<u8>| raw_req(vec![input("x", "BYTES", &[1], None)], vec![raw]);
        let (t, _) = decode_grpc(one(vec![3, 0, 0, 0, b'a', b'b', b'c']), &d, &a).unwrap();
        assert_eq!(t[0].1.dtype, DType::String);
        assert!(err(decode_grpc(one(vec![9, 0, 0, 0, b'a']), &d, &a)).contains("malformed BYTES"));
        assert!(err(decode_grpc(one(vec![1, 0, 0, 0, 0xff]), &d, &a)).contains("invalid UTF-8"));
        // A length prefix near u32::MAX must not wrap the scan.
        assert!(err(decode_grpc(one(vec![0xff, 0xff, 0xff, 0xff, 0]), &d, &a)).contains("malformed BYTES"));
    }

    /// Random requests, many of them hostile (shapes near 2^63, raw
    /// lengths off by a little, contents in the wrong field, values out of
    /// range, names repeated): never a panic, and every refusal a client
    /// error. Debug builds keep overflow checks on, so unchecked arithmetic
    /// on a stated size would panic here.
    #[test]
    fn random_requests_never_panic() {
        let (a, _d) = arena();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            seed.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        let dims = [0i64, 1, 2, 3, -1, 1 << 31, 1 << 62, i64::MAX, 4_611_686_018_427_387_904];
        let dts = ["FP32", "FP16", "INT8", "INT64", "UINT16", "BOOL", "BYTES", "FP64", "nope", ""];
        let specs = [
            declared(DType::Float32, &[-1, 2]),
            declared(DType::Int8, &[-1]),
            declared(DType::String, &[-1]),
            declared(DType::Bool, &[-1, 1]),
        ];
        for _ in 0..4000 {
            let n_inputs = (next() % 3) as usize;
            let raw_mode = next() % 2 == 0;
            let mut req = ModelInferRequest::default();
            for _ in 0..n_inputs {
                let rank = (next() % 3) as usize;
                let shape: Vec<i64> = (0..rank).map(|_| dims[(next() % dims.len() as u64) as usize]).collect();
                let name = if next() % 4 == 0 { "z" } else { "x" };
                let dt = dts[(next() % dts.len() as u64) as usize];
                let k = (next() % 6) as usize;
                let contents = (!raw_mode).then(|| match next() % 4 {
                    0 => InferTensorContents { fp32_contents: vec![1.5; k], ..Default::default() },
                    1 => InferTensorContents { int_contents: vec![300; k], ..Default::default() },
                    2 => InferTensorContents {
                        bytes_contents: vec![Bytes::from_static(b"\xffab"); k],
                        ..Default::default()
                    },
                    _ => InferTensorContents { bool_contents: vec![true; k], ..Default::default() },
                });
                req.inputs.push(input(name, dt, &shape, contents));
                if raw_mode {
                    let len = (next() % 24) as usize;
                    let mut raw: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                    if next() % 3 == 0 && len >= 4 {
                        raw[..4].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
                    }
                    req.raw_input_contents.push(Bytes::from(raw));
                }
            }
            if next() % 10 == 0 {
                req.raw_input_contents.push(Bytes::from_static(b"extra"));
            }
            let spec = &specs[(next() % specs.len() as u64) as usize];
            match decode_grpc(req, spec, &a) {
                Ok((t, _)) => {
                    for (name, tensor) in &t {
                        assert!(spec.contains_key(name));
                        if let Some(n) = slipstream_types::checked_nbytes(tensor.dtype, &tensor.shape) {
                            assert_eq!(n, tensor.nbytes);
                        }
                    }
                }
                Err(e) => assert!(matches!(e.kind(), "bad_input" | "bad_request" | "arena_full"), "{e}"),
            }
        }
    }

    #[test]
    fn unknown_requested_output_is_refused() {
        let (a, _d) = arena();
        let req = raw_req(vec![input("x", "FP32", &[1, 2], None)], vec![f32s(&[1.0, 2.0])]);
        let (t, mut g) = decode_grpc(req, &declared(DType::Float32, &[-1, 2]), &a).unwrap();
        g.outputs = vec!["nope".into()];
        let e = encode_grpc("m", &g, &t).unwrap_err();
        assert_eq!(e.to_string(), "unknown output 'nope' requested (outputs: x)");
    }
}
