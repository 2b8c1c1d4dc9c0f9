//! A replica's worker process: the [`Backend`] of every local replica.
//!
//! The node listens on a Unix socket per worker, starts the worker command
//! with the replica's coordinates, and waits for the worker to connect and
//! say `Ready` (its component constructed, models loaded) or `Fatal` (with
//! the reason, which fails start-up loudly). A new worker then runs one
//! warm-up batch (a copy of a request its stage served, see
//! [`crate::pipeline::Sample`]) before it is routed to. One frame of
//! descriptors goes each way per batch (see `slipstream-transport`): a
//! batch's inputs are views of shared memory (adjacent request tensors
//! span one descriptor; others are gathered into one block), and its
//! outputs are blocks of the replica's own pool, split per request here.
//!
//! A worker runs one batch at a time, except an `async` component's
//! (`concurrency` > 1): its connection is split, and a reader task hands
//! its frames over a channel, so that waiting for them can be raced
//! against new work without losing a half-read frame.
//!
//! The node reads a worker's frames through a buffer: a frame is a length
//! and a body, and reading them unbuffered took a `recv` each (and a third
//! that found nothing yet), for every batch.

use crate::arena::{request_rows, Arena, CopyCounters, TensorRef, Tensors};
use crate::drive::{
    drive, next_batch_id, Backend, Batch, FirstStart, Launcher, Outcome, ReplicaCtx, ReplicaTask, Reply, Running,
    Started,
};
use crate::error::NodeError;
use crate::events::EventKind;
use slipstream_shm::{Block, Pool};
use slipstream_transport::{read_frame, write_frame, FrameError, FromWorker, OutputDesc, OutputOrigin, ToWorker};
use slipstream_types::{checked_nbytes, TensorDesc};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// How to start workers; shared by all replicas.
#[derive(Clone, Debug)]
pub struct WorkerCommand {
    /// The command; the node appends each replica's coordinates.
    pub argv: Vec<String>,
    /// The workers' environment (a stage's own goes over it).
    pub env: BTreeMap<String, String>,
    /// Where the workers' sockets are made.
    pub socket_dir: PathBuf,
    /// How long a worker may take to become ready (load its models).
    pub start_timeout: Duration,
}

/// The core's [`Launcher`]: every replica's batches run in a worker
/// process on this machine.
pub struct WorkerLauncher(Arc<WorkerCommand>);

impl WorkerLauncher {
    /// Workers started with `command`.
    pub fn new(command: WorkerCommand) -> WorkerLauncher {
        WorkerLauncher(Arc::new(command))
    }
}

impl Launcher for WorkerLauncher {
    fn launch(&self, ctx: ReplicaCtx, first_start: Option<FirstStart>) -> ReplicaTask {
        Box::pin(drive(ctx, LocalWorker::new(self.0.clone()), first_start))
    }
}

/// The connection to a worker: whole while it runs one batch at a time;
/// split, with a reader task, while it runs several.
enum Conn {
    Whole {
        conn: BufReader<UnixStream>,
        buf: Vec<u8>,
    },
    Split {
        wr: OwnedWriteHalf,
        rx: mpsc::UnboundedReceiver<Result<FromWorker, FrameError>>,
        reader: tokio::task::JoinHandle<()>,
    },
}

/// A running worker process and its connection.
struct Worker {
    child: Child,
    conn: Conn,
}

fn describe_exit(status: std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    }
}

/// Why the worker is gone, from a failed read or write and its exit status.
async fn gone(child: &mut Child, e: impl std::fmt::Display) -> String {
    match tokio::time::timeout(Duration::from_secs(1), child.wait()).await {
        Ok(s) => format!("{} ({e})", describe_exit(s)),
        Err(_) => e.to_string(),
    }
}

/// A worker's listening socket's path, removed when the spawn is done with
/// it (connected, failed or abandoned).
struct SocketFile(std::path::PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Worker {
    /// Start the worker of `ctx`'s replica and wait until it is ready (or fails).
    async fn spawn(launch: &WorkerCommand, ctx: &ReplicaCtx, env: &BTreeMap<String, String>) -> Result<Worker, String> {
        let (pipeline, stage, replica) = (ctx.pipe.name(), &ctx.stage().name, ctx.me.id);
        // One path per spawn: two spawns of one replica can overlap (a
        // start abandoned while the next begins), and a shared path let the
        // second's unlink-and-bind pull the socket from under the first's
        // worker as it connected (seen as ENOENT when a cluster node
        // restarted into a placement that was still moving).
        static SPAWNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SPAWNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sock = SocketFile(launch.socket_dir.join(format!("{pipeline}-{stage}-{replica}-{n}.sock")));
        let listener = UnixListener::bind(&sock.0).map_err(|e| format!("cannot bind {}: {e}", sock.0.display()))?;
        let (exe, args) = launch.argv.split_first().ok_or("empty worker command")?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .arg("--pipeline")
            .arg(pipeline)
            .arg("--stage")
            .arg(stage)
            .arg("--replica")
            .arg(replica.to_string())
            .arg("--connect")
            .arg(&sock.0)
            .arg("--pool-prefix")
            .arg(ctx.arena.path_prefix())
            .arg("--pool")
            .arg(ctx.me.pool.id().to_string())
            .envs(&launch.env)
            .envs(env)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("cannot start worker `{exe}`: {e}"))?;
        let deadline = tokio::time::Instant::now() + launch.start_timeout;
        let mut conn = tokio::select! {
            r = tokio::time::timeout_at(deadline, listener.accept()) => match r {
                Ok(Ok((conn, _))) => BufReader::new(conn),
                Ok(Err(e)) => return Err(format!("accept failed: {e}")),
                Err(_) => return Err(format!("worker did not connect within {:?}", launch.start_timeout)),
            },
            status = child.wait() => return Err(format!("worker exited before connecting ({})", describe_exit(status))),
        };
        drop(sock);
        let mut buf = Vec::new();
        let hello = tokio::select! {
            r = tokio::time::timeout_at(deadline, read_frame::<_, FromWorker>(&mut conn, &mut buf)) => r,
            status = child.wait() => return Err(format!("worker exited while starting ({})", describe_exit(status))),
        };
        match hello {
            Ok(Ok(FromWorker::Ready { .. })) => Ok(Worker { child, conn: Conn::Whole { conn, buf } }),
            Ok(Ok(FromWorker::Fatal { message })) => {
                let _ = child.wait().await;
                Err(message)
            }
            Ok(Ok(other)) => Err(format!("worker sent {other:?} before ready")),
            Ok(Err(e)) => {
                let status = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
                Err(format!("worker failed while starting: {e} ({})", status.map(describe_exit).unwrap_or_default()))
            }
            Err(_) => Err(format!("worker was not ready within {:?}", launch.start_timeout)),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    async fn write(&mut self, msg: &ToWorker) -> Result<(), FrameError> {
        match &mut self.conn {
            Conn::Whole { conn, .. } => write_frame(conn, msg).await,
            Conn::Split { wr, .. } => write_frame(wr, msg).await,
        }
    }

    /// The next frame. Cancel-safe only on a split connection.
    async fn read(&mut self) -> Result<FromWorker, String> {
        match &mut self.conn {
            Conn::Whole { conn, buf } => match read_frame::<_, FromWorker>(conn, buf).await {
                Ok(f) => Ok(f),
                Err(e) => Err(gone(&mut self.child, e).await),
            },
            Conn::Split { rx, .. } => tokio::select! {
                frame = rx.recv() => match frame {
                    Some(Ok(f)) => Ok(f),
                    Some(Err(e)) => Err(gone(&mut self.child, e).await),
                    None => Err("the worker's connection closed".into()),
                },
                status = self.child.wait() => Err(describe_exit(status)),
            },
        }
    }

    /// Read frames on a task of their own from now on (see the module docs).
    fn split(self) -> Worker {
        let Worker { child, conn } = self;
        let conn = match conn {
            Conn::Whole { conn, mut buf } => {
                // What the buffer holds already is read first.
                let held = std::io::Cursor::new(conn.buffer().to_vec());
                let (rd, wr) = conn.into_inner().into_split();
                let mut rd = held.chain(BufReader::new(rd));
                let (tx, rx) = mpsc::unbounded_channel();
                let reader = tokio::spawn(async move {
                    loop {
                        let frame = read_frame::<_, FromWorker>(&mut rd, &mut buf).await;
                        let failed = frame.is_err();
                        if tx.send(frame).is_err() || failed {
                            return;
                        }
                    }
                });
                Conn::Split { wr, rx, reader }
            }
            split => split,
        };
        Worker { child, conn }
    }

    /// Run one batch of `sample` (one request's inputs) and throw the
    /// outputs away: the first call of a component is often much slower
    /// (lazy initialisation, JIT, caches), and a new replica should pay for
    /// it before it takes traffic. Err: the worker is gone. A component
    /// error is not fatal (returned for the event log).
    async fn warm_up(
        &mut self,
        sample: &Tensors,
        pool: &Arc<Pool>,
        timeout: Duration,
    ) -> Result<Option<String>, String> {
        let rows = request_rows(sample) as u32;
        let inputs = sample.iter().map(|(n, t)| (n.clone(), t.desc())).collect();
        let msg = ToWorker::Batch { id: next_batch_id(), rows: vec![rows], inputs, left_us: Vec::new() };
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
        let run = async {
            self.write(&msg).await.map_err(|e| e.to_string())?;
            loop {
                match self.read().await? {
                    FromWorker::Chunk { outputs, .. } => discard(outputs),
                    other => return Ok::<_, String>(other),
                }
            }
        };
        match tokio::time::timeout(timeout, run).await {
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
    async fn shutdown(mut self) {
        let _ = self.write(&ToWorker::Shutdown).await;
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
        if let Conn::Split { reader, .. } = self.conn {
            reader.abort();
        }
    }

    async fn kill(mut self) {
        let _ = self.child.kill().await;
        if let Conn::Split { reader, .. } = self.conn {
            reader.abort();
        }
    }
}

/// A local replica's backend: its worker process (see the module docs).
struct LocalWorker {
    launch: Arc<WorkerCommand>,
    worker: Option<Worker>,
    /// Its start failed for good (see [`Backend::gave_up`]).
    gave_up: bool,
}

impl LocalWorker {
    fn new(launch: Arc<WorkerCommand>) -> LocalWorker {
        LocalWorker { launch, worker: None, gave_up: false }
    }

    fn worker(&mut self) -> Result<&mut Worker, String> {
        self.worker.as_mut().ok_or_else(|| "no worker".to_string())
    }
}

/// Warm a new worker up with the stage's sample request, if it has one.
async fn warm_up(ctx: &ReplicaCtx, w: &mut Worker, timeout: Duration) -> Result<(), String> {
    let sample = ctx.stage().sample.lock().as_ref().map(|s| s.inputs.to_arena(&ctx.arena));
    let inputs = match sample {
        None => return Ok(()),
        Some(Ok(inputs)) => inputs,
        Some(Err(e)) => {
            ctx.event(EventKind::WarmUpSkipped, e.to_string());
            return Ok(());
        }
    };
    let t0 = Instant::now();
    match w.warm_up(&inputs, &ctx.me.pool, timeout).await? {
        None => ctx.event(EventKind::WarmedUp, format!("one batch in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3)),
        Some(msg) => ctx.event(EventKind::WarmUpFailed, format!("the component raised: {msg}")),
    }
    Ok(())
}

impl Backend for LocalWorker {
    async fn start(&mut self, ctx: &ReplicaCtx) -> Result<Started, String> {
        // The stage's environment, and a GPU stage's device for this replica.
        let env = match ctx.stage().worker_env(&ctx.me) {
            Ok(env) => env,
            Err(e) => {
                // Not something a retry fixes: the replica leaves its stage.
                ctx.event(EventKind::StartFailed, e.clone());
                self.gave_up = true;
                ctx.me.drain();
                return Err(e);
            }
        };
        let started = Instant::now();
        let mut w = Worker::spawn(&self.launch, ctx, &env).await?;
        warm_up(ctx, &mut w, self.launch.start_timeout).await?;
        ctx.stage().note_start(started.elapsed());
        let pid = w.pid();
        self.worker = Some(if ctx.stage().concurrency > 1 { w.split() } else { w });
        Ok(Started { pid, detail: format!("worker pid {pid}") })
    }

    fn gave_up(&self) -> bool {
        self.gave_up
    }

    fn capacity(&self, ctx: &ReplicaCtx) -> usize {
        ctx.stage().concurrency
    }

    async fn send(&mut self, ctx: &ReplicaCtx, batch: &mut Batch) -> Result<Option<Outcome>, String> {
        let rows: Vec<u32> = batch.members.iter().map(|(_, i)| request_rows(i) as u32).collect();
        let mut inputs = BTreeMap::new();
        let names: Vec<String> = batch.members[0].1.iter().map(|(n, _)| n.clone()).collect();
        for (k, name) in names.iter().enumerate() {
            let parts: Vec<&TensorRef> = batch.members.iter().map(|(_, i)| &i[k].1).collect();
            match batch_input(&ctx.arena, &parts, &mut batch.keep) {
                Ok(desc) => {
                    inputs.insert(name.clone(), desc);
                }
                // No room to gather: this batch fails; the worker is fine.
                Err(e) => {
                    let reason = e.to_string();
                    return Ok(Some(Outcome::Failed(NodeError::Unavailable {
                        stage: ctx.stage().name.clone(),
                        reason,
                    })));
                }
            }
        }
        let now = Instant::now();
        let left_us = batch
            .members
            .iter()
            .map(|(job, _)| {
                u64::try_from(job.deadline().saturating_duration_since(now).as_micros()).unwrap_or(u64::MAX)
            })
            .collect();
        let w = self.worker()?;
        match w.write(&ToWorker::Batch { id: batch.id, rows, inputs, left_us }).await {
            Ok(()) => Ok(None),
            Err(e) => Err(gone(&mut w.child, e).await),
        }
    }

    async fn recv(&mut self, ctx: &ReplicaCtx, running: &Running) -> Result<Reply, String> {
        let stage = &ctx.stage().name;
        loop {
            let frame = self.worker()?.read().await?;
            match frame {
                FromWorker::Chunk { id, outputs } => {
                    let b =
                        running.get(&id).ok_or_else(|| format!("protocol violation: a chunk of unknown batch {id}"))?;
                    match split_outputs(ctx, b, outputs) {
                        Ok(per_request) => return Ok(Reply::Chunk { id, per_request }),
                        // A chunk that does not fit the batch is dropped with
                        // its blocks (the batch's result still settles it).
                        Err(e) => ctx.event(EventKind::BadChunk, e.to_string()),
                    }
                }
                FromWorker::Result { id, outputs, compute_us, versions } if running.contains_key(&id) => {
                    let b = &running[&id];
                    let worker_copies: Vec<u64> =
                        outputs.values().filter(|o| o.origin == OutputOrigin::Copied).map(|o| o.desc.nbytes).collect();
                    let outcome = match split_outputs(ctx, b, outputs) {
                        Ok(outputs) => {
                            for bytes in worker_copies {
                                CopyCounters::add(&ctx.arena.copies.worker, &ctx.arena.copies.worker_bytes, bytes);
                            }
                            Outcome::Outputs { outputs, compute_us: Some(compute_us), versions }
                        }
                        Err(e) => {
                            Outcome::Failed(NodeError::Component { stage: stage.clone(), message: e.to_string() })
                        }
                    };
                    return Ok(Reply::Done { id, outcome });
                }
                FromWorker::Error { id, message, .. } if running.contains_key(&id) => {
                    let outcome = Outcome::Failed(NodeError::Component { stage: stage.clone(), message });
                    return Ok(Reply::Done { id, outcome });
                }
                other => return Err(format!("protocol violation: unexpected {other:?}")),
            }
        }
    }

    async fn lost(&mut self, _: &ReplicaCtx) -> String {
        match self.worker.as_mut() {
            Some(w) => describe_exit(w.child.wait().await),
            None => std::future::pending().await,
        }
    }

    async fn stop(&mut self, graceful: bool) {
        if let Some(w) = self.worker.take() {
            if graceful {
                w.shutdown().await;
            } else {
                w.kill().await;
            }
        }
    }
}

/// A batch input: either a span of adjacent request tensors, or a gathered copy.
fn batch_input(arena: &Arena, parts: &[&TensorRef], keep: &mut Vec<Arc<Block>>) -> Result<TensorDesc, NodeError> {
    let first = parts[0];
    let rows: u64 = parts.iter().map(|t| t.rows()).sum();
    let mut shape = first.shape.clone();
    shape[0] = rows;
    let nbytes: u64 = parts.iter().map(|t| t.nbytes).sum();
    let adjacent = parts
        .windows(2)
        .all(|w| Arc::ptr_eq(w[0].block.pool(), w[1].block.pool()) && w[0].offset + w[0].nbytes == w[1].offset);
    if adjacent {
        return Ok(TensorDesc {
            pool: first.block.pool().id(),
            offset: first.offset,
            nbytes,
            dtype: first.dtype,
            shape,
        });
    }
    let mut block = arena.scratch_block(nbytes as usize)?;
    let dst = block.as_mut_slice();
    let mut at = 0;
    for t in parts {
        dst[at..at + t.nbytes as usize].copy_from_slice(t.bytes());
        at += t.nbytes as usize;
    }
    let block = Arc::new(block.freeze());
    CopyCounters::add(&arena.copies.gather, &arena.copies.gather_bytes, nbytes);
    let desc = TensorDesc { pool: block.pool().id(), offset: block.offset(), nbytes, dtype: first.dtype, shape };
    keep.push(block);
    Ok(desc)
}

/// Turn the worker's batch outputs into per-request tensors.
fn split_outputs(
    ctx: &ReplicaCtx,
    b: &Batch,
    outputs: BTreeMap<String, OutputDesc>,
) -> Result<Vec<Tensors>, NodeError> {
    let me = &ctx.me;
    let members = &b.members;
    let rows = b.rows();
    let total_rows: u64 = rows.iter().sum();
    // Take ownership of every block the worker wrote before checking anything,
    // so that a rejected batch still frees them.
    let mut owned = Vec::with_capacity(outputs.len());
    for (name, out) in outputs {
        let block = match out.origin {
            OutputOrigin::Copied if out.desc.pool == me.pool.id() => {
                let len = usize::try_from(out.desc.nbytes)
                    .map_err(|_| NodeError::Internal(format!("output '{name}' claims {} bytes", out.desc.nbytes)))?;
                Some(Arc::new(Block::adopt(&me.pool, out.desc.offset, len)?))
            }
            OutputOrigin::Copied => {
                return Err(NodeError::Internal(format!("worker wrote output '{name}' outside its pool")))
            }
            OutputOrigin::Borrowed => None,
        };
        owned.push((name, out.desc, block));
    }
    // (name, whole-batch tensor, the pool it borrows from if it is an input's memory)
    let mut whole = Vec::with_capacity(owned.len());
    for (name, d, block) in owned {
        if !d.dtype.is_variable() && checked_nbytes(d.dtype, &d.shape) != Some(d.nbytes) {
            return Err(NodeError::Internal(format!(
                "output '{name}': {} bytes do not match shape {:?}",
                d.nbytes, d.shape
            )));
        }
        if d.shape.first() != Some(&total_rows) {
            return Err(NodeError::BadInput(format!(
                "output '{name}' has shape {:?}, but its first dimension must equal the batch's {total_rows} rows",
                d.shape
            )));
        }
        let (block, borrowed) = match block {
            Some(b) => (b, None),
            // Placeholder owner; each request's slice finds its real owner below.
            None => (members[0].1[0].1.block.clone(), Some(d.pool)),
        };
        whole.push((
            name,
            TensorRef { block, offset: d.offset, nbytes: d.nbytes, dtype: d.dtype, shape: d.shape },
            borrowed,
        ));
    }
    let mut per_request: Vec<Tensors> = (0..members.len()).map(|_| Vec::with_capacity(whole.len())).collect();
    for (name, t, borrowed) in &whole {
        let parts = t.split_rows(&rows).ok_or_else(|| {
            NodeError::Internal(format!(
                "output '{name}' of {} bytes does not hold {:?} {} elements",
                t.nbytes, t.shape, t.dtype
            ))
        })?;
        for (i, mut part) in parts.into_iter().enumerate() {
            if let Some(pool) = *borrowed {
                part.block = find_owner(b, pool, &part).ok_or_else(|| {
                    NodeError::Internal(format!("output '{name}' borrows memory that is not an input of this batch"))
                })?;
            }
            per_request[i].push((name.clone(), part));
        }
    }
    Ok(per_request)
}

/// The block, among the batch's inputs, that holds `t`'s bytes entirely.
fn find_owner(b: &Batch, pool: u32, t: &TensorRef) -> Option<Arc<Block>> {
    let holds = |b: &Arc<Block>| {
        b.pool().id() == pool && b.offset() <= t.offset && t.offset + t.nbytes <= b.offset() + b.len() as u64
    };
    b.keep
        .iter()
        .find(|b| holds(b))
        .cloned()
        .or_else(|| b.members.iter().flat_map(|(_, i)| i.iter()).map(|(_, x)| &x.block).find(|b| holds(b)).cloned())
}
