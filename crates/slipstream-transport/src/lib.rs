//! Messages between the node and its worker processes, and their framing.
//!
//! Each message is one frame: a little-endian `u32` byte length followed by
//! that many bytes of JSON. Only descriptors travel here (which pool, which
//! offset, dtype and shape); tensor payloads stay in shared memory. Frames are
//! per batch, not per request, so the cost of JSON is spread over the batch
//! and the format stays easy to read from Python (`struct` + `json`) and to
//! debug. The Python side of this protocol lives in
//! `python/slipstream/_internal/protocol.py`; keep the two in step.

use serde::{Deserialize, Serialize};
use slipstream_types::TensorDesc;
use std::collections::BTreeMap;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Frames larger than this are refused: they can only come from a bug or a
/// corrupted stream, since payloads never travel in frames.
pub const MAX_FRAME: usize = 16 << 20;

/// Node -> worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToWorker {
    /// Run the component on one batch. `rows[i]` is the number of rows that
    /// request `i` contributes; every input's first dimension is `sum(rows)`.
    /// `left_us[i]`, when given, is the time request `i` had left before its
    /// deadline when the batch was sent, in µs (a time left, not an instant,
    /// so that no two processes need to share a clock); components read it as
    /// `batch.time_left()`.
    Batch {
        id: u64,
        rows: Vec<u32>,
        inputs: BTreeMap<String, TensorDesc>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        left_us: Vec<u64>,
    },
    /// Finish and exit.
    Shutdown,
}

/// How a worker produced an output tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OutputOrigin {
    /// Copied once from the component's array into the worker's own pool; the
    /// node takes ownership of the block and frees it.
    #[default]
    Copied,
    /// The component returned (a contiguous slice of) one of its inputs; the
    /// descriptor points into memory the node already owns. Nothing copied.
    Borrowed,
}

/// One output tensor of a batch. (Read through [`wire::OutputFields`]:
/// serde's `flatten` buffers every field first.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "wire::OutputFields")]
pub struct OutputDesc {
    #[serde(flatten)]
    pub desc: TensorDesc,
    #[serde(default)]
    pub origin: OutputOrigin,
}

/// Worker -> node. (Read through [`wire::FromWorkerFields`]: an
/// internally tagged enum buffers the whole message before it looks at
/// the tag, which made reading a worker's reply the node's largest cost
/// per batch after the socket itself.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", try_from = "wire::FromWorkerFields")]
pub enum FromWorker {
    /// The component is constructed and the worker serves batches.
    Ready { pid: u32 },
    /// A batch finished. `compute_us` is the time spent in the component
    /// itself, so the node can tell its own overhead from the model's.
    Result {
        id: u64,
        outputs: BTreeMap<String, OutputDesc>,
        compute_us: u64,
        /// The store versions the serving instance was built from, by
        /// argument name, for a component with `needs` (the prediction
        /// cache keeps only the newest model's results).
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        versions: BTreeMap<String, u64>,
    },
    /// A streaming component yielded a chunk of this batch's outputs (each
    /// output with the batch's rows); its `Result` follows the last chunk.
    Chunk { id: u64, outputs: BTreeMap<String, OutputDesc> },
    /// The component raised on this batch; the worker keeps serving.
    Error { id: u64, kind: String, message: String },
    /// The worker cannot start (import error, constructor raised, bad config).
    Fatal { message: String },
}

/// The flat shapes worker messages are read through, in one pass.
pub mod wire {
    use super::{FromWorker, OutputDesc, OutputOrigin};
    use serde::Deserialize;
    use slipstream_types::{DType, TensorDesc};
    use std::collections::BTreeMap;

    /// An [`OutputDesc`] as written: the descriptor's fields and the origin.
    #[derive(Deserialize)]
    pub struct OutputFields {
        pool: u32,
        offset: u64,
        nbytes: u64,
        dtype: DType,
        shape: Vec<u64>,
        #[serde(default)]
        origin: OutputOrigin,
    }

    impl From<OutputFields> for OutputDesc {
        fn from(f: OutputFields) -> OutputDesc {
            let desc = TensorDesc { pool: f.pool, offset: f.offset, nbytes: f.nbytes, dtype: f.dtype, shape: f.shape };
            OutputDesc { desc, origin: f.origin }
        }
    }

    #[derive(Clone, Copy, Debug, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Op {
        Ready,
        Result,
        Chunk,
        Error,
        Fatal,
    }

    /// Every field any [`FromWorker`] message has; `op` says which must be there.
    #[derive(Deserialize)]
    pub struct FromWorkerFields {
        op: Op,
        pid: Option<u32>,
        id: Option<u64>,
        outputs: Option<BTreeMap<String, OutputDesc>>,
        compute_us: Option<u64>,
        #[serde(default)]
        versions: BTreeMap<String, u64>,
        kind: Option<String>,
        message: Option<String>,
    }

    impl TryFrom<FromWorkerFields> for FromWorker {
        type Error = String;

        fn try_from(f: FromWorkerFields) -> Result<FromWorker, String> {
            fn need<T>(v: Option<T>, op: Op, field: &str) -> Result<T, String> {
                v.ok_or_else(|| format!("missing field `{field}` in a `{op:?}` message"))
            }
            let op = f.op;
            Ok(match op {
                Op::Ready => FromWorker::Ready { pid: need(f.pid, op, "pid")? },
                Op::Result => FromWorker::Result {
                    id: need(f.id, op, "id")?,
                    outputs: need(f.outputs, op, "outputs")?,
                    compute_us: need(f.compute_us, op, "compute_us")?,
                    versions: f.versions,
                },
                Op::Chunk => FromWorker::Chunk { id: need(f.id, op, "id")?, outputs: need(f.outputs, op, "outputs")? },
                Op::Error => FromWorker::Error {
                    id: need(f.id, op, "id")?,
                    kind: need(f.kind, op, "kind")?,
                    message: need(f.message, op, "message")?,
                },
                Op::Fatal => FromWorker::Fatal { message: need(f.message, op, "message")? },
            })
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME} byte limit")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(#[from] serde_json::Error),
}

impl FrameError {
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::Closed => "closed",
            FrameError::Io(_) => "io",
            FrameError::TooLarge(_) => "frame_too_large",
            FrameError::Malformed(_) => "malformed_frame",
        }
    }
}

/// Encode `msg` as one frame (length prefix included).
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut buf = vec![0u8; 4];
    serde_json::to_writer(&mut buf, msg).expect("protocol messages always serialise");
    let len = (buf.len() - 4) as u32;
    buf[..4].copy_from_slice(&len.to_le_bytes());
    buf
}

/// Write one frame.
pub async fn write_frame<W, T>(w: &mut W, msg: &T) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    w.write_all(&encode(msg)).await?;
    Ok(())
}

/// Read one frame; `Closed` on a clean end of stream before a frame starts.
pub async fn read_frame<R, T>(r: &mut R, buf: &mut Vec<u8>) -> Result<T, FrameError>
where
    R: AsyncRead + Unpin,
    T: for<'de> Deserialize<'de>,
{
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    Ok(serde_json::from_slice(buf)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_types::DType;

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "x".to_string(),
            TensorDesc { pool: 0, offset: 4096, nbytes: 8, dtype: DType::Float32, shape: vec![1, 2] },
        );
        let msg = ToWorker::Batch { id: 7, rows: vec![1], inputs, left_us: vec![1500] };
        write_frame(&mut a, &msg).await.unwrap();
        write_frame(&mut a, &ToWorker::Shutdown).await.unwrap();
        drop(a);
        let mut buf = Vec::new();
        let got: ToWorker = read_frame(&mut b, &mut buf).await.unwrap();
        assert_eq!(got, msg);
        let got: ToWorker = read_frame(&mut b, &mut buf).await.unwrap();
        assert_eq!(got, ToWorker::Shutdown);
        let end = read_frame::<_, ToWorker>(&mut b, &mut buf).await.unwrap_err();
        assert_eq!(end.kind(), "closed");
    }

    #[test]
    fn worker_messages_parse_from_python_spelling() {
        let s = r#"{"op":"result","id":3,"compute_us":12,"outputs":{"y":{"pool":2,"offset":64,"nbytes":8,"dtype":"float32","shape":[1,2],"origin":"borrowed"}}}"#;
        let m: FromWorker = serde_json::from_str(s).unwrap();
        match m {
            FromWorker::Result { id, outputs, .. } => {
                assert_eq!(id, 3);
                assert_eq!(outputs["y"].origin, OutputOrigin::Borrowed);
                assert_eq!(outputs["y"].desc.shape, vec![1, 2]);
            }
            other => panic!("unexpected {other:?}"),
        }
        let e: FromWorker =
            serde_json::from_str(r#"{"op":"error","id":1,"kind":"component_error","message":"boom"}"#).unwrap();
        assert!(matches!(e, FromWorker::Error { id: 1, .. }));
        let no_origin =
            r#"{"op":"chunk","id":4,"outputs":{"y":{"pool":1,"offset":0,"nbytes":4,"dtype":"int32","shape":[1]}}}"#;
        match serde_json::from_str::<FromWorker>(no_origin).unwrap() {
            FromWorker::Chunk { outputs, .. } => assert_eq!(outputs["y"].origin, OutputOrigin::Copied),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn every_worker_message_round_trips_and_a_missing_field_is_named() {
        let out = OutputDesc {
            desc: TensorDesc { pool: 1, offset: 8, nbytes: 4, dtype: DType::Float32, shape: vec![1] },
            origin: OutputOrigin::Borrowed,
        };
        let outputs: BTreeMap<String, OutputDesc> = [("y".to_string(), out)].into();
        let versions: BTreeMap<String, u64> = [("m".to_string(), 3)].into();
        let all = [
            FromWorker::Ready { pid: 9 },
            FromWorker::Result { id: 1, outputs: outputs.clone(), compute_us: 5, versions },
            FromWorker::Result { id: 2, outputs: outputs.clone(), compute_us: 5, versions: BTreeMap::new() },
            FromWorker::Chunk { id: 3, outputs },
            FromWorker::Error { id: 4, kind: "component_error".into(), message: "boom".into() },
            FromWorker::Fatal { message: "no model".into() },
        ];
        for m in all {
            let text = serde_json::to_string(&m).unwrap();
            assert_eq!(serde_json::from_str::<FromWorker>(&text).unwrap(), m, "{text}");
        }
        let err = serde_json::from_str::<FromWorker>(r#"{"op":"result","id":1,"outputs":{}}"#).unwrap_err();
        assert!(err.to_string().contains("missing field `compute_us`"), "{err}");
        let err = serde_json::from_str::<FromWorker>(r#"{"op":"teleport","id":1}"#).unwrap_err();
        assert!(err.to_string().contains("unknown variant `teleport`"), "{err}");
    }

    #[tokio::test]
    async fn oversized_frame_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::spawn(async move {
            let _ = a.write_all(&((MAX_FRAME as u32) + 1).to_le_bytes()).await;
        });
        let mut buf = Vec::new();
        let err = read_frame::<_, FromWorker>(&mut b, &mut buf).await.unwrap_err();
        assert_eq!(err.kind(), "frame_too_large");
    }
}
