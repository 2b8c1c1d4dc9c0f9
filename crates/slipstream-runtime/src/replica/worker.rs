//! A replica's worker process: starting it, talking to it, warming it up,
//! stopping it.
//!
//! The node listens on a Unix socket per worker, starts the worker command
//! with the replica's coordinates, and waits for the worker to connect and
//! say `Ready` (its component constructed, models loaded) or `Fatal` (with
//! the reason, which fails start-up loudly). One frame of descriptors goes
//! each way per batch (see `slipstream-transport`).

use crate::arena::{Arena, Tensors};
use slipstream_shm::{Block, Pool};
use slipstream_transport::{read_frame, write_frame, FrameError, FromWorker, OutputDesc, OutputOrigin, ToWorker};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};

/// How to start workers; shared by all replicas.
pub struct Launch {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub socket_dir: PathBuf,
    pub start_timeout: Duration,
}

/// Which replica a worker runs.
pub struct Coordinates<'a> {
    pub pipeline: &'a str,
    pub stage: &'a str,
    pub replica: u32,
    /// The stage's own environment (its thread budget), over the node's.
    pub env: &'a BTreeMap<String, String>,
}

static BATCH_IDS: AtomicU64 = AtomicU64::new(1);

/// A fresh batch id (unique in the node).
pub fn next_batch_id() -> u64 {
    BATCH_IDS.fetch_add(1, Relaxed)
}

/// A running worker process and its connection.
pub struct Worker {
    pub child: Child,
    pub conn: UnixStream,
    pub buf: Vec<u8>,
}

pub fn describe_exit(status: std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    }
}

impl Worker {
    /// Start a worker for `at` and wait until it is ready (or fails).
    pub async fn spawn(launch: &Launch, at: &Coordinates<'_>, arena: &Arena, pool: &Pool) -> Result<Worker, String> {
        let sock = launch.socket_dir.join(format!("{}-{}-{}.sock", at.pipeline, at.stage, at.replica));
        let _ = std::fs::remove_file(&sock);
        let listener = UnixListener::bind(&sock).map_err(|e| format!("cannot bind {}: {e}", sock.display()))?;
        let (exe, args) = launch.argv.split_first().ok_or("empty worker command")?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .arg("--pipeline")
            .arg(at.pipeline)
            .arg("--stage")
            .arg(at.stage)
            .arg("--replica")
            .arg(at.replica.to_string())
            .arg("--connect")
            .arg(&sock)
            .arg("--pool-prefix")
            .arg(arena.path_prefix())
            .arg("--pool")
            .arg(pool.id().to_string())
            .envs(&launch.env)
            .envs(at.env)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("cannot start worker `{exe}`: {e}"))?;
        let deadline = tokio::time::Instant::now() + launch.start_timeout;
        let conn = tokio::select! {
            r = tokio::time::timeout_at(deadline, listener.accept()) => match r {
                Ok(Ok((conn, _))) => conn,
                Ok(Err(e)) => return Err(format!("accept failed: {e}")),
                Err(_) => return Err(format!("worker did not connect within {:?}", launch.start_timeout)),
            },
            status = child.wait() => return Err(format!("worker exited before connecting ({})", describe_exit(status))),
        };
        let _ = std::fs::remove_file(&sock);
        let mut w = Worker { child, conn, buf: Vec::new() };
        let hello = tokio::select! {
            r = tokio::time::timeout_at(deadline, read_frame::<_, FromWorker>(&mut w.conn, &mut w.buf)) => r,
            status = w.child.wait() => return Err(format!("worker exited while starting ({})", describe_exit(status))),
        };
        match hello {
            Ok(Ok(FromWorker::Ready { .. })) => Ok(w),
            Ok(Ok(FromWorker::Fatal { message })) => {
                let _ = w.child.wait().await;
                Err(message)
            }
            Ok(Ok(other)) => Err(format!("worker sent {other:?} before ready")),
            Ok(Err(e)) => {
                let status = tokio::time::timeout(Duration::from_secs(2), w.child.wait()).await;
                Err(format!("worker failed while starting: {e} ({})", status.map(describe_exit).unwrap_or_default()))
            }
            Err(_) => Err(format!("worker was not ready within {:?}", launch.start_timeout)),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// Send one batch and read its reply; a streaming component's chunks
    /// (which come before it) go to `on_chunk`.
    pub async fn run(
        &mut self,
        msg: &ToWorker,
        mut on_chunk: impl FnMut(BTreeMap<String, OutputDesc>),
    ) -> Result<FromWorker, FrameError> {
        write_frame(&mut self.conn, msg).await?;
        loop {
            match read_frame::<_, FromWorker>(&mut self.conn, &mut self.buf).await? {
                FromWorker::Chunk { outputs, .. } => on_chunk(outputs),
                other => return Ok(other),
            }
        }
    }

    /// Run one batch of `sample` (one request's inputs) and throw the
    /// outputs away: the first call of a component is often much slower
    /// (lazy initialisation, JIT, caches), and a new replica should pay for
    /// it before it takes traffic. Err: the worker is gone. A component
    /// error is not fatal (logged by the caller).
    pub async fn warm_up(
        &mut self,
        sample: &Tensors,
        pool: &Arc<Pool>,
        timeout: Duration,
    ) -> Result<Option<String>, String> {
        let rows = crate::request::request_rows(sample) as u32;
        let inputs = sample.iter().map(|(n, t)| (n.clone(), t.desc())).collect();
        let msg = ToWorker::Batch { id: next_batch_id(), rows: vec![rows], inputs };
        // Free what the worker wrote (blocks adopted and dropped).
        let discard = |outputs: BTreeMap<String, OutputDesc>| {
            for out in outputs.values() {
                if out.origin == OutputOrigin::Copied && out.desc.pool == pool.id() {
                    if let Ok(n) = usize::try_from(out.desc.nbytes) {
                        drop(Block::adopt(pool, out.desc.offset, n));
                    }
                }
            }
        };
        match tokio::time::timeout(timeout, self.run(&msg, discard)).await {
            Err(_) => Err(format!("warm-up batch did not finish within {timeout:?}")),
            Ok(Err(e)) => Err(format!("worker failed during warm-up: {e}")),
            Ok(Ok(FromWorker::Result { outputs, .. })) => {
                discard(outputs);
                Ok(None)
            }
            Ok(Ok(FromWorker::Error { message, .. })) => Ok(Some(message)),
            Ok(Ok(other)) => Err(format!("protocol violation during warm-up: unexpected {other:?}")),
        }
    }

    /// Ask the worker to exit; kill it if it does not within 5 s.
    pub async fn shutdown(mut self) {
        let _ = write_frame(&mut self.conn, &ToWorker::Shutdown).await;
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}
