//! The Open Inference Protocol (KServe v2) over gRPC, as a crate of its own:
//! the protocol's messages and the `inference.GRPCInferenceService`
//! service, generated at build time from `proto/grpc_predict_v2.proto` by
//! tonic and prost, plus the little of gRPC's HTTP/2 mapping a server needs
//! beyond them (reading the `grpc-timeout` header).
//!
//! It knows nothing of Slipstream's node: the runtime implements
//! [`inference::grpc_inference_service_server::GrpcInferenceService`]
//! against its pipelines (`slipstream-runtime`'s `grpc` module). Keeping
//! the generated code here means the runtime's own build does not run
//! `protoc`, and the protocol can be used by a client without the node.

use std::time::Duration;

/// The generated protocol: messages, the service trait and its server, and
/// a client.
#[allow(missing_docs, clippy::all)]
pub mod inference {
    tonic::include_proto!("inference");
}

pub use inference::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};

/// The fully qualified service name, as clients address it.
pub const SERVICE: &str = "inference.GRPCInferenceService";

/// The header in which a gRPC client sends the time it will wait for the
/// call (its deadline, relative to when it sent the call).
pub const TIMEOUT_HEADER: &str = "grpc-timeout";

/// Parse a `grpc-timeout` value: at most 8 ASCII digits then a unit, `H`
/// (hours), `M` (minutes), `S` (seconds), `m` (milliseconds), `u`
/// (microseconds) or `n` (nanoseconds), as gRPC's HTTP/2 protocol
/// specifies. `None` for anything else.
pub fn parse_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at_checked(v.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_in_every_unit() {
        assert_eq!(parse_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_timeout("99999999u"), Some(Duration::from_micros(99_999_999)));
        assert_eq!(parse_timeout("7n"), Some(Duration::from_nanos(7)));
        // The largest value of the largest unit does not overflow.
        assert_eq!(parse_timeout("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
    }

    #[test]
    fn malformed_timeouts_are_none() {
        for v in ["", "S", "5", "5s", "123456789S", "-5S", "+5S", " 5S", "5 S", "1.5S", "5é", "é"] {
            assert_eq!(parse_timeout(v), None, "{v:?}");
        }
    }

    /// The field numbers that standard clients rely on, checked on the
    /// encoded bytes: a renumbered field would break them silently.
    #[test]
    fn wire_field_numbers() {
        use inference::*;
        use prost::Message;
        let req = ModelInferRequest {
            model_name: "m".into(),
            raw_input_contents: vec![prost::bytes::Bytes::from_static(b"\x01")],
            ..Default::default()
        };
        // field 1 (model_name, length-delimited): tag 0x0a; field 7 (raw_input_contents): tag 0x3a.
        assert_eq!(req.encode_to_vec(), b"\x0a\x01m\x3a\x01\x01");
        let resp = ModelStreamInferResponse { error_message: "e".into(), infer_response: None };
        assert_eq!(resp.encode_to_vec(), b"\x0a\x01e");
        let c = InferTensorContents { fp32_contents: vec![1.0], ..Default::default() };
        // field 6, packed: tag 0x32, 4 bytes of 1.0f32.
        assert_eq!(c.encode_to_vec(), b"\x32\x04\x00\x00\x80\x3f");
    }
}
