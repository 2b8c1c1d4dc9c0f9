//! A node whose replicas run in-process (a fake [`Backend`]), for tests of
//! the request path and of the features that plug into it: no worker
//! processes, no listeners, real pipelines, queues, batches, joins and
//! replica sets.
//!
//! ```ignore
//! let t = TestNode::new(APP_JSON, Fake::echo());
//! let out = t.infer("p", &[("x", &[1.0, 2.0])]).await?;
//! ```

use crate::arena::{Arena, HeapTensors, Tensors};
use crate::config::NodeOptions;
use crate::drive::{
    drive, Backend, Batch, FirstStart, Launcher, Outcome, ReplicaCtx, ReplicaTask, Reply, Running, Started,
};
use crate::error::NodeError;
use crate::node::{Answer, Arrival, Node, NodeParts};
use crate::pipeline::{BuildContext, PipelineBuilder};
use crate::spec::AppSpec;
use parking_lot::Mutex;
use slipstream_types::DType;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What a fake replica makes of one request's inputs at stage `stage`:
/// its outputs, or the message the component "raises".
pub type Compute = dyn Fn(&str, &Tensors) -> Result<HeapTensors, String> + Send + Sync;

/// How fake replicas behave.
#[derive(Clone)]
pub struct Fake {
    compute: Arc<Compute>,
    /// Time each batch takes, per stage name (default: none).
    delays: Arc<Mutex<Vec<(String, Duration)>>>,
    /// Batches that lose their executor (each lost batch is one taken off
    /// the front), per stage name.
    lose: Arc<Mutex<VecDeque<String>>>,
    /// Replica starts that end with the replica removed meanwhile (as a
    /// placement change does), per stage name, one each.
    removed_at_start: Arc<Mutex<VecDeque<String>>>,
    /// How long a replica's start takes from now on: (serving, standby).
    start_delays: Arc<Mutex<(Duration, Duration)>>,
    /// Batches run, over all replicas.
    pub batches: Arc<AtomicUsize>,
}

impl Fake {
    /// Replicas that compute with `f`.
    pub fn new(f: impl Fn(&str, &Tensors) -> Result<HeapTensors, String> + Send + Sync + 'static) -> Fake {
        Fake {
            compute: Arc::new(f),
            delays: Arc::default(),
            lose: Arc::default(),
            removed_at_start: Arc::default(),
            start_delays: Arc::default(),
            batches: Arc::default(),
        }
    }

    /// Replicas that answer with their inputs.
    pub fn echo() -> Fake {
        Fake::new(|_, inputs| Ok(HeapTensors::of(inputs)))
    }

    /// Batches of stage `stage` take `d`.
    pub fn delay(self, stage: &str, d: Duration) -> Fake {
        self.delays.lock().push((stage.to_string(), d));
        self
    }

    /// The next batch of stage `stage` loses its executor (as if its
    /// worker died while running it).
    pub fn lose_next(&self, stage: &str) {
        self.lose.lock().push_back(stage.to_string());
    }

    /// The next replica of stage `stage` to start is removed while it
    /// starts (its start ends without an executor, as a remote replica's
    /// does when the placement moves it away).
    pub fn remove_next_start(self, stage: &str) -> Fake {
        self.removed_at_start.lock().push_back(stage.to_string());
        self
    }

    /// Replica starts take `serving`, and standbys' `standby`, from now
    /// on (as a cold worker's on a busy machine).
    pub fn slow_starts(&self, serving: Duration, standby: Duration) {
        *self.start_delays.lock() = (serving, standby);
    }

    fn delay_of(&self, stage: &str) -> Duration {
        self.delays.lock().iter().find(|(s, _)| s == stage).map_or(Duration::ZERO, |(_, d)| *d)
    }
}

struct FakeBackend {
    fake: Fake,
    /// Batches sent and their answers, with when they are due.
    pending: VecDeque<(u64, Instant, Outcome)>,
}

impl Backend for FakeBackend {
    async fn start(&mut self, ctx: &ReplicaCtx) -> Result<Started, String> {
        {
            let mut removed = self.fake.removed_at_start.lock();
            if let Some(i) = removed.iter().position(|s| *s == ctx.stage().name) {
                removed.remove(i);
                ctx.me.drain();
                return Err("stopped".into());
            }
        }
        let (serving, standby) = *self.fake.start_delays.lock();
        tokio::time::sleep(if ctx.me.is_standby() { standby } else { serving }).await;
        Ok(Started { pid: 0, detail: "in-process".into() })
    }

    fn capacity(&self, ctx: &ReplicaCtx) -> usize {
        ctx.stage().concurrency
    }

    async fn send(&mut self, ctx: &ReplicaCtx, batch: &mut Batch) -> Result<Option<Outcome>, String> {
        let stage = ctx.stage().name.clone();
        {
            let mut lose = self.fake.lose.lock();
            if let Some(i) = lose.iter().position(|s| *s == stage) {
                lose.remove(i);
                return Err("the fake executor was lost".into());
            }
        }
        self.fake.batches.fetch_add(1, Relaxed);
        let mut outputs = Vec::with_capacity(batch.members.len());
        let mut failed = None;
        for (_, inputs) in &batch.members {
            match (self.fake.compute)(&stage, inputs) {
                Ok(h) => match h.to_arena(ctx.arena()) {
                    Ok(t) => outputs.push(t),
                    Err(e) => failed = Some(e),
                },
                Err(message) => failed = Some(NodeError::Component { stage: stage.clone(), message }),
            }
        }
        let outcome = match failed {
            Some(e) => Outcome::Failed(e),
            None => Outcome::Outputs { outputs, compute_us: None, versions: Default::default() },
        };
        self.pending.push_back((batch.id, Instant::now() + self.fake.delay_of(&stage), outcome));
        Ok(None)
    }

    async fn recv(&mut self, _: &ReplicaCtx, _: &Running) -> Result<Reply, String> {
        let Some((_, due, _)) = self.pending.front() else { return std::future::pending().await };
        tokio::time::sleep_until((*due).into()).await;
        let (id, _, outcome) = self.pending.pop_front().expect("present");
        Ok(Reply::Done { id, outcome })
    }

    async fn lost(&mut self, _: &ReplicaCtx) -> String {
        std::future::pending().await
    }

    async fn stop(&mut self, _: bool) {
        self.pending.clear();
    }
}

/// Launches fake replicas.
struct FakeLauncher(Fake);

impl Launcher for FakeLauncher {
    fn launch(&self, ctx: ReplicaCtx, first_start: Option<FirstStart>) -> ReplicaTask {
        Box::pin(drive(ctx, FakeBackend { fake: self.0.clone(), pending: VecDeque::new() }, first_start))
    }
}

/// A temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new, empty directory.
    pub fn new() -> TempDir {
        use std::hash::{BuildHasher, RandomState};
        let d =
            std::env::temp_dir().join(format!("ss-test-{}-{:x}", std::process::id(), RandomState::new().hash_one(1u8)));
        std::fs::create_dir_all(&d).expect("temporary directory");
        TempDir(d)
    }
}

impl Default for TempDir {
    fn default() -> Self {
        TempDir::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An arena (a 1 MiB ingress pool) in a temporary directory.
pub fn temp_arena() -> (Arena, TempDir) {
    let dir = TempDir::new();
    (Arena::new(dir.0.clone(), 1 << 20).expect("arena"), dir)
}

/// A node over fake replicas, in temporary directories removed on drop.
pub struct TestNode {
    /// The node.
    pub node: Arc<Node>,
    stop: watch::Sender<bool>,
    _dir: TempDir,
}

impl Drop for TestNode {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl TestNode {
    /// The app `app_json` (an [`AppSpec`]; `worker_argv` may be omitted) on
    /// fake replicas, with `edit` adding hooks and joins to each pipeline.
    /// Its replicas are started and ready when this returns. Call from
    /// inside a tokio runtime.
    pub async fn with(app_json: &str, fake: Fake, mut edit: impl FnMut(&mut PipelineBuilder)) -> TestNode {
        let mut v: serde_json::Value = serde_json::from_str(app_json).expect("app JSON");
        if v.get("worker_argv").is_none() {
            v["worker_argv"] = serde_json::json!([]);
        }
        let app: AppSpec = serde_json::from_value(v).expect("an app spec");
        let dir = TempDir::new();
        let opts = NodeOptions {
            shm_dir: dir.0.join("shm"),
            ingress_pool_bytes: 64 << 20,
            replica_pool_bytes: 8 << 20,
            ..NodeOptions::default()
        };
        std::fs::create_dir_all(&opts.shm_dir).expect("shm dir");
        let arena = Arc::new(Arena::new(opts.shm_dir.clone(), opts.ingress_pool_bytes).expect("arena"));
        let cx = BuildContext {
            app: &app,
            arena: &arena,
            replica_pool_bytes: opts.replica_pool_bytes,
            request_timeout: opts.request_timeout,
            epoch: Instant::now(),
            start_replicas: true,
        };
        let pipelines = app
            .pipelines
            .iter()
            .map(|p| {
                let mut b = PipelineBuilder::new(p, &cx).expect("a valid pipeline");
                edit(&mut b);
                b.build()
            })
            .collect();
        let store =
            slipstream_store::Store::open(slipstream_store::StoreOptions::new(dir.0.join("store"))).expect("store");
        let (stop, stop_rx) = watch::channel(false);
        let node = Node::new(NodeParts {
            pipelines,
            arena,
            store: Arc::new(store),
            opts,
            admission: app.batching.admission,
            local: Arc::new(FakeLauncher(fake)),
            stop: stop_rx,
        })
        .expect("a node");
        let node = Arc::new(node);
        for (stage, rx) in node.start_replicas() {
            rx.await.expect("replica task").unwrap_or_else(|e| panic!("{stage} did not start: {e}"));
        }
        node.mark_serving();
        TestNode { node, stop, _dir: dir }
    }

    /// [`TestNode::with`] without hooks or joins.
    pub async fn new(app_json: &str, fake: Fake) -> TestNode {
        TestNode::with(app_json, fake, |_| {}).await
    }

    /// Run one request of float32 inputs (`(name, values)`, one row each)
    /// through `pipeline`, asking for `budget` as its deadline.
    pub async fn infer_within(
        &self,
        pipeline: &str,
        inputs: &[(&str, &[f32])],
        budget: Option<Duration>,
    ) -> Result<Answer, NodeError> {
        let pipe = self.node.pipeline(pipeline)?;
        let heap = HeapTensors(
            inputs
                .iter()
                .map(|(n, v)| {
                    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    (n.to_string(), DType::Float32, vec![1, v.len() as u64], bytes)
                })
                .collect(),
        );
        let (accepted, ()) = self.node.accept(&pipe, Arrival::now(budget), |arena| Ok((heap.to_arena(arena)?, ())))?;
        self.node.answer(accepted, None).await
    }

    /// [`TestNode::infer_within`] with the pipeline's own deadline.
    pub async fn infer(&self, pipeline: &str, inputs: &[(&str, &[f32])]) -> Result<Answer, NodeError> {
        self.infer_within(pipeline, inputs, None).await
    }
}

/// The float32 values of output `name`.
pub fn floats(t: &Tensors, name: &str) -> Vec<f32> {
    let (_, t) = t.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no output '{name}'"));
    t.bytes().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
}
