//! Pipelines at run time: stages and their replica sets, ingress routing,
//! admission, and placing a request's work on a replica's queue.
//!
//! A stage's replica set changes at run time (the `scale` admin route,
//! replicas leaving when they are removed). It is a copy-on-write list:
//! readers take a snapshot (`Arc<Vec<..>>`), writers replace it. A request
//! holds `Arc`s to the replicas of its route, so a replica removed while a
//! request is bound for it is still a valid object: it refuses new work
//! once draining, and [`StageRt::place`] then puts the work on another
//! replica of the stage. Fan-in parts still meet, because the join
//! lives in the request, not in a replica.
//!
//! Routing and admission read each replica's published load only; the
//! predictions are [`slipstream_sched`]'s, shared with the simulator.

use crate::arena::{Arena, HeapTensors, Tensors};
use crate::error::NodeError;
use crate::ext::StageHook;
use crate::join::{Join, JoinPolicy, JoinTiming};
use crate::metrics::{PipelineMetrics, PipelineTotals, StageMetrics};
use crate::replica::{Job, Phase, RemoteAt, Replica};
use crate::spec::{AppSpec, PipelineSpec, SpecError, StageSpec};
use parking_lot::{Mutex, RwLock};
use serde_json::{json, Value};
use slipstream_sched::{
    choose_replica, AdmissionGate, BatchFormer, BatchPolicy, Dag, LatencyProfile, LengthModel, Priority, ReplicaLoad,
};
use slipstream_shm::Pool;
use slipstream_types::TensorSpec;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A stage's replicas, in order of creation.
pub type ReplicaSet = Arc<Vec<Arc<Replica>>>;

/// One request's inputs to a stage, copied to the heap, to warm up a new
/// replica's worker before it takes traffic. Kept off the arena so that an
/// idle node's arena is empty; copied in only for the warm-up batch.
pub(crate) struct Sample {
    pub(crate) inputs: HeapTensors,
    pub(crate) taken: Instant,
}

impl Sample {
    pub(crate) fn of(inputs: &Tensors) -> Sample {
        Sample { inputs: HeapTensors::of(inputs), taken: Instant::now() }
    }
}

/// A stage at run time: its replica set, metrics and hook.
pub struct StageRt {
    /// Its place in the pipeline's stages.
    pub index: usize,
    /// Its name in the pipeline.
    pub name: String,
    /// The component its workers run.
    pub component: String,
    /// The largest batch it runs.
    pub max_batch: usize,
    /// Batches a replica's worker may run at once (async components).
    pub concurrency: usize,
    /// Threads each replica may use.
    pub threads: usize,
    /// Autoscaling bounds (equal when not autoscaled).
    pub bounds: (usize, usize),
    /// The input whose elements' length batches are grouped by (see
    /// [`crate::spec::StageSpec::length_input`]).
    pub length_input: Option<String>,
    /// Its workers' own environment (see [`crate::spec::StageSpec::env`]).
    pub(crate) env: BTreeMap<String, String>,
    /// The device its replicas run on (a GPU each, for a GPU stage).
    pub(crate) device: crate::gpu::Want,
    /// The devices its replicas on this node may take (a plan's binding;
    /// empty: all of this machine's). A cluster node's comes from the
    /// cluster's plan record ([`StageRt::bind`]).
    bound: RwLock<Vec<usize>>,
    /// Held while a replica chooses its device, so that two starting at
    /// once see each other's choice.
    choosing: Mutex<()>,
    /// How long a worker took from spawn to warm (moving average, ms; 0
    /// until one has started): the lead time a standby needs.
    start_ms: AtomicU32,
    replicas: RwLock<ReplicaSet>,
    next_id: AtomicU32,
    /// The batch former a replica starts with when no sibling has learned more.
    template: BatchFormer,
    /// Inputs of a request this stage ran successfully (see [`Sample`]).
    pub(crate) sample: Mutex<Option<Sample>>,
    /// Its counters and histograms.
    pub metrics: StageMetrics,
    /// The string input naming the store object a request reads, when the
    /// stage routes by affinity group.
    affinity: Option<String>,
    /// Affinity group -> the replica that was given it (it holds the group).
    sticky: Mutex<std::collections::HashMap<String, u32>>,
    /// What runs beside it on the request path (the prediction cache).
    pub(crate) hook: Option<Arc<dyn StageHook>>,
    /// Serving replicas whoever scales the stage last asked for (0: none
    /// asked), for the dashboard.
    wanted: AtomicU32,
}

impl StageRt {
    fn new(spec: &StageSpec, index: usize, template: BatchFormer) -> StageRt {
        StageRt {
            index,
            name: spec.name.clone(),
            component: spec.component.clone(),
            max_batch: spec.max_batch_size,
            concurrency: spec.concurrency,
            threads: spec.threads,
            bounds: spec.bounds(),
            length_input: spec.length_input.clone(),
            env: spec.env.clone(),
            device: crate::gpu::Want::parse(spec.device.as_deref()).unwrap_or_default(), // checked by validate
            bound: RwLock::new(spec.devices.clone()),
            choosing: Mutex::new(()),
            start_ms: AtomicU32::new(0),
            replicas: RwLock::new(Arc::new(Vec::new())),
            next_id: AtomicU32::new(0),
            template,
            sample: Mutex::new(None),
            metrics: StageMetrics::default(),
            affinity: spec.affinity.clone(),
            sticky: Mutex::new(std::collections::HashMap::new()),
            hook: None,
            wanted: AtomicU32::new(0),
        }
    }

    /// Its hook's status block, under the hook's name.
    pub fn hook_status(&self) -> Option<(&'static str, Value)> {
        self.hook.as_ref().map(|h| (h.name(), h.status()))
    }

    /// Its hook's samples for `/metrics`.
    pub fn hook_metrics(&self, t: &mut crate::prom::PromText, labels: &[(&str, &str)]) {
        if let Some(h) = &self.hook {
            h.metrics(t, labels);
        }
    }

    /// Serving replicas last asked for by whoever scales the stage (None: nobody has).
    pub fn wanted(&self) -> Option<u32> {
        Some(self.wanted.load(Relaxed)).filter(|&n| n > 0)
    }

    /// Record how many serving replicas the stage's scaler wants now.
    pub fn set_wanted(&self, n: usize) {
        self.wanted.store(n.min(u32::MAX as usize) as u32, Relaxed);
    }

    /// The replica for a request of affinity group `group`: the one that was
    /// given the group before, while it serves and its queue is short (at
    /// most two full batches), else the shortest queue, which then holds it.
    /// Only replicas `at_home` are candidates while one of them accepts.
    fn sticky(&self, group: &str, tiebreak: u64, at_home: &dyn Fn(&Replica) -> bool) -> Option<Arc<Replica>> {
        let set = self.replicas();
        let mut map = self.sticky.lock();
        if let Some(r) = map.get(group).and_then(|id| set.iter().find(|r| r.id == *id)) {
            if r.phase() == Phase::Ready && r.load().accepting && r.queue_len() <= 2 * self.max_batch && at_home(r) {
                return Some(r.clone());
            }
        }
        let r = self.choose_among(&set, tiebreak, at_home).or_else(|| self.choose(tiebreak, None))?;
        if map.len() >= 100_000 {
            map.clear(); // a bound on memory; groups re-stick on their next request
        }
        map.insert(group.to_string(), r.id);
        Some(r)
    }

    /// The current replicas (a snapshot).
    pub fn replicas(&self) -> ReplicaSet {
        self.replicas.read().clone()
    }

    /// Bind the stage's replicas to `devices` (places in this machine's
    /// list; empty: any). Returns whether that changed the binding; the
    /// replicas on devices it leaves out are the caller's to replace
    /// ([`StageRt::misbound`]).
    pub(crate) fn bind(&self, devices: &[usize]) -> bool {
        let mut bound = self.bound.write();
        let changed = *bound != devices;
        if changed {
            *bound = devices.to_vec();
        }
        changed
    }

    /// This node's replicas whose worker runs on a device the binding does
    /// not name.
    pub(crate) fn misbound(&self) -> Vec<Arc<Replica>> {
        let bound = self.bound.read();
        if bound.is_empty() {
            return Vec::new();
        }
        let set = self.replicas();
        set.iter().filter(|r| r.is_local() && r.device().is_some_and(|d| !bound.contains(&d))).cloned().collect()
    }

    /// The environment of `me`'s worker: the stage's, and for a GPU stage
    /// `CUDA_VISIBLE_DEVICES` naming its one device (see
    /// [`crate::gpu::assign`]), which `me` keeps for the status and its
    /// next start. Err: it wants a GPU this machine does not have.
    pub(crate) fn worker_env(&self, me: &Replica) -> Result<BTreeMap<String, String>, String> {
        let mut env = self.env.clone();
        let _one_at_a_time = self.choosing.lock();
        let set = self.replicas();
        let others = |i: usize| set.iter().filter(|r| r.is_local() && r.id != me.id && r.device() == Some(i)).count();
        let gpu = crate::gpu::assign(self.device, me.device(), &self.bound.read(), crate::gpu::devices(), others)?;
        me.set_device(gpu.map(|g| g.index));
        if let Some(gpu) = gpu {
            env.insert("CUDA_VISIBLE_DEVICES".into(), gpu.uuid.clone());
        }
        Ok(env)
    }

    /// Where a local replica runs, for the status: `"cpu"`, or `"cuda:N"`
    /// (N: its place in this machine's list) with the GPU's UUID and name;
    /// as declared while its worker has not started on one.
    pub fn device_of(&self, r: &Replica) -> (String, Option<serde_json::Value>) {
        if !self.device.is_gpu() {
            return ("cpu".into(), None);
        }
        match r.device().and_then(|i| crate::gpu::devices().get(i)) {
            Some(g) => (format!("cuda:{}", g.index), Some(serde_json::json!({"uuid": g.uuid, "name": g.name}))),
            None => (self.device.label(), None),
        }
    }

    /// A worker of this stage took `d` from spawn to warm.
    pub(crate) fn note_start(&self, d: Duration) {
        let ms = d.as_millis().min(u32::MAX as u128) as u32;
        let old = self.start_ms.load(Relaxed);
        self.start_ms.store(if old == 0 { ms.max(1) } else { (old + ms) / 2 }, Relaxed);
    }

    /// How long a new replica takes to become warm (learned; `None` until one has).
    pub fn start_time(&self) -> Option<Duration> {
        let ms = self.start_ms.load(Relaxed);
        (ms > 0).then(|| Duration::from_millis(ms as u64))
    }

    /// A new replica (starting; not routed to until its worker is ready, or,
    /// as a `standby`, until it is promoted), with its sibling's learned
    /// profile when there is one.
    pub(crate) fn add_replica(&self, pool: Arc<Pool>, epoch: Instant, standby: bool) -> Arc<Replica> {
        let r =
            Replica::new(self.next_id.fetch_add(1, Relaxed), self.index, pool, self.learned_former(), epoch, standby);
        self.insert(Arc::new(r))
    }

    /// A new replica standing for one on another node (starting until that
    /// node reports its replicas ready), or for a standby there; replies
    /// arrive in `pool`.
    pub(crate) fn add_remote(&self, at: RemoteAt, pool: Arc<Pool>, epoch: Instant, standby: bool) -> Arc<Replica> {
        let r =
            Replica::new(self.next_id.fetch_add(1, Relaxed), self.index, pool, self.learned_former(), epoch, standby);
        self.insert(Arc::new(r.on_node(at)))
    }

    /// The batch former a new replica starts with: a serving sibling's
    /// profile (a local one first: a remote one's includes the network), else the template.
    fn learned_former(&self) -> BatchFormer {
        let set = self.replicas();
        let ready = set.iter().filter(|r| r.phase() == Phase::Ready);
        ready.clone().find(|r| r.is_local()).or(ready.clone().next()).map_or(self.template.clone(), |r| {
            let mut f = r.former();
            f.limit = f.max_batch;
            f
        })
    }

    fn insert(&self, r: Arc<Replica>) -> Arc<Replica> {
        let mut set = self.replicas.write();
        let mut next = (**set).clone();
        next.push(r.clone());
        *set = Arc::new(next);
        r
    }

    /// Take a stopped replica out of the set.
    pub(crate) fn remove_replica(&self, id: u32) {
        let mut set = self.replicas.write();
        let next: Vec<_> = set.iter().filter(|r| r.id != id).cloned().collect();
        *set = Arc::new(next);
    }

    /// This node's standbys (held back from routing), warm ones first.
    pub(crate) fn standbys_warm_first(&self) -> Vec<Arc<Replica>> {
        let mut standbys: Vec<_> = self.replicas().iter().filter(|r| r.is_local() && r.is_standby()).cloned().collect();
        standbys.sort_by_key(|r| r.phase() != Phase::Standby);
        standbys
    }

    /// Ready while at least one replica's worker serves.
    pub fn is_ready(&self) -> bool {
        self.replicas().iter().any(|r| r.phase() == Phase::Ready)
    }

    /// Replicas that are not being removed.
    pub fn live_replicas(&self) -> usize {
        self.replicas().iter().filter(|r| r.phase().will_serve()).count()
    }

    /// Expected latency of one batch here, at the size it usually runs.
    fn typical_ns(&self) -> u64 {
        let set = self.replicas();
        set.iter().find(|r| r.phase() == Phase::Ready).or(set.first()).map_or(0, |r| r.load().typical_ns)
    }

    /// Join-shortest-queue among accepting replicas, except `not`; when
    /// none accepts, a warm standby stands in (see [`StageRt::stand_in`]).
    pub(crate) fn choose(&self, tiebreak: u64, not: Option<&Replica>) -> Option<Arc<Replica>> {
        self.choose_or_stand_in(&self.replicas(), tiebreak, &|r| !is(not, r))
    }

    /// Whether work on `r` could go elsewhere now (another replica accepts,
    /// or a warm standby stands in): what a retry of it would find.
    pub fn has_alternative_to(&self, r: &Replica) -> bool {
        self.choose(0, Some(r)).is_some()
    }

    /// Whether a replica that is not leaving accepts work: what a replica
    /// the cluster placed elsewhere waits for before it drains.
    pub fn served_without_leaving(&self) -> bool {
        self.choose_among(&self.replicas(), 0, &|r| !r.leaving()).is_some()
    }

    /// Join-shortest-queue among the accepting `eligible` replicas of
    /// `set`, else a warm standby among them ([`stand_in`]).
    fn choose_or_stand_in(
        &self,
        set: &ReplicaSet,
        tiebreak: u64,
        eligible: &dyn Fn(&Replica) -> bool,
    ) -> Option<Arc<Replica>> {
        self.choose_among(set, tiebreak, eligible).or_else(|| stand_in(set, eligible))
    }

    /// Join-shortest-queue among the accepting replicas of `set` that are `eligible`.
    fn choose_among(
        &self,
        set: &ReplicaSet,
        tiebreak: u64,
        eligible: &dyn Fn(&Replica) -> bool,
    ) -> Option<Arc<Replica>> {
        let loads: Vec<ReplicaLoad> = set
            .iter()
            .map(|r| {
                let mut l = r.load();
                l.accepting &= eligible(r);
                l
            })
            .collect();
        choose_replica(&loads, tiebreak).map(|i| set[i].clone())
    }

    /// Where new work for this stage goes, among the `eligible` replicas:
    /// the shortest accepting queue, else (none accepts) a warm standby
    /// ([`stand_in`]), else one that will serve it once its worker is
    /// (re)started, a serving replica before a standby still warming up
    /// (which only stands in when nothing else serves: a request queued on
    /// it waited there for its deadline while the serving replica it
    /// could have waited for came back); `None` if none ever will.
    fn target_among(&self, tiebreak: u64, eligible: &dyn Fn(&Replica) -> bool) -> Option<Arc<Replica>> {
        let set = self.replicas();
        self.choose_or_stand_in(&set, tiebreak, eligible).or_else(|| {
            let waiting: Vec<&Arc<Replica>> = set.iter().filter(|r| r.phase().will_serve() && eligible(r)).collect();
            let serving: Vec<&Arc<Replica>> = waiting.iter().copied().filter(|r| !r.is_standby()).collect();
            let pool = if serving.is_empty() { &waiting } else { &serving };
            (!pool.is_empty()).then(|| pool[(tiebreak as usize) % pool.len()].clone())
        })
    }

    /// Where new work for this stage goes, except to `not` (see [`StageRt::target_among`]).
    fn target(&self, tiebreak: u64, not: Option<&Replica>) -> Option<Arc<Replica>> {
        self.target_among(tiebreak, &|r| !is(not, r))
    }

    /// Where work another node sent goes: among this node's own replicas
    /// (see [`StageRt::target_among`]).
    pub(crate) fn local_target(&self, tiebreak: u64) -> Option<Arc<Replica>> {
        self.target_among(tiebreak, &Replica::is_local)
    }

    /// Put `req` on this stage: on `first` if it takes it, else on the
    /// shortest accepting queue, else on a replica that is coming back.
    /// Err: no replica of the stage will ever serve it.
    pub(crate) fn place(
        &self,
        mut req: Arc<dyn Job>,
        first: Option<&Arc<Replica>>,
        not: Option<&Replica>,
    ) -> Result<(), Arc<dyn Job>> {
        if let Some(r) = first {
            if r.phase() == Phase::Ready && !is(not, r) {
                match r.push(req) {
                    Ok(()) => return Ok(()),
                    Err(back) => req = back,
                }
            }
        }
        for _ in 0..4 {
            let Some(r) = self.target(req.id(), not) else { break };
            match r.push(req) {
                Ok(()) => return Ok(()),
                Err(back) => req = back, // it started draining meanwhile: look again
            }
        }
        Err(req)
    }
}

/// A warm standby that takes a stage's work while no serving replica can
/// (all down, or on a node the cluster suspects): the least loaded of the
/// `eligible` ones. A standby is kept for exactly this moment: its worker
/// is up and warm, so standing in costs no start-up, and it stays a
/// standby (whoever owns the replica set promotes it, or not).
fn stand_in(set: &ReplicaSet, eligible: &dyn Fn(&Replica) -> bool) -> Option<Arc<Replica>> {
    set.iter().filter(|r| r.phase() == Phase::Standby && eligible(r)).min_by_key(|r| r.load().outstanding).cloned()
}

/// Whether `r` is the replica `not` names.
fn is(not: Option<&Replica>, r: &Replica) -> bool {
    not.is_some_and(|n| std::ptr::eq(n, r))
}

/// A pipeline at run time: its stages, DAG, admission gate and metrics.
pub struct PipelineRt {
    /// Its spec, as the app declared it.
    pub spec: PipelineSpec,
    /// Its stages, in the spec's order.
    pub stages: Vec<StageRt>,
    pub(crate) dag: Dag,
    /// Its counters and histograms.
    pub metrics: PipelineMetrics,
    /// Time every request gets to finish; its deadline for EDF ordering is
    /// the SLO target when one is declared.
    pub(crate) timeout: Duration,
    /// Reference instant for deadlines expressed as nanoseconds.
    pub(crate) epoch: Instant,
    /// How much of its budget an admitted request's predicted finish may
    /// use, learned from admitted requests' outcomes.
    pub(crate) gate: Mutex<AdmissionGate>,
    /// The outputs of the first answer (names, dtypes, trailing shapes),
    /// for model metadata when the app does not declare them.
    seen_outputs: std::sync::OnceLock<BTreeMap<String, TensorSpec>>,
    /// The pipeline's joins over candidate stages, and which one each stage
    /// is a candidate of.
    pub(crate) joins: Vec<Join>,
    pub(crate) join_of: Vec<Option<usize>>,
    /// Where stage hooks' hits and joins' answers are written.
    pub(crate) arena: Arc<Arena>,
}

/// What ingress decides about a request before its body is decoded: its id,
/// deadline and route (one replica per stage).
pub(crate) struct Ticket {
    pub(crate) id: u64,
    pub(crate) arrival: Instant,
    pub(crate) deadline: Instant,
    pub(crate) route: Vec<Arc<Replica>>,
    /// The share of its budget its predicted time used at admission (1
    /// without admission control), for the gate's books.
    pub(crate) share: f64,
    /// Requests were waiting in a queue on its route at admission (the
    /// gate learns the pipeline's capacity only while most requests find
    /// one).
    pub(crate) found_queue: bool,
}

impl Ticket {
    /// A ticket not yet through admission (its books as without admission
    /// control: the whole budget, no queue seen).
    pub(crate) fn new(id: u64, arrival: Instant, deadline: Instant, route: Vec<Arc<Replica>>) -> Ticket {
        Ticket { id, arrival, deadline, route, share: 1.0, found_queue: false }
    }
}

/// Why a pipeline could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Its spec is inconsistent.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Its replicas' shared memory could not be set up.
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// What every pipeline of a node is built with.
pub struct BuildContext<'a> {
    /// The app the pipelines belong to (batching options, profiles).
    pub app: &'a AppSpec,
    /// Where their tensors live.
    pub arena: &'a Arc<Arena>,
    /// Each replica's pool size.
    pub replica_pool_bytes: usize,
    /// The request timeout.
    pub request_timeout: Duration,
    /// The reference instant of every pipeline's ns clock.
    pub epoch: Instant,
    /// Start each stage's declared replicas (a cluster's placement decides
    /// them instead).
    pub start_replicas: bool,
}

/// A pipeline being assembled: the core's parts from the spec, then the
/// hooks and joins the composition root adds ([`PipelineBuilder::hook`],
/// [`PipelineBuilder::join`]).
pub struct PipelineBuilder {
    rt: PipelineRt,
}

impl PipelineBuilder {
    /// The pipeline `spec` of `cx.app`, checked, with its stages' initial
    /// replicas (starting; their tasks are spawned by the node).
    pub fn new(spec: &PipelineSpec, cx: &BuildContext<'_>) -> Result<PipelineBuilder, BuildError> {
        spec.validate()?;
        let index: BTreeMap<&str, usize> = spec.stages.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let dag = Dag::new(spec.stages.iter().map(|s| s.parents.iter().map(|n| index[n.as_str()]).collect()).collect());
        // Every pipeline's latency buckets include every SLO target (see metrics.rs).
        let slo_targets: Vec<f64> = cx.app.pipelines.iter().filter_map(|p| p.slo.map(|s| s.p99_ms)).collect();
        let mut stages = Vec::with_capacity(spec.stages.len());
        for (i, s) in spec.stages.iter().enumerate() {
            let stage = StageRt::new(s, i, former_for(cx.app, spec, s)?);
            if cx.start_replicas {
                for _ in 0..s.replicas {
                    stage.add_replica(cx.arena.replica_pool(cx.replica_pool_bytes)?, cx.epoch, false);
                }
            }
            stages.push(stage);
        }
        let n = stages.len();
        Ok(PipelineBuilder {
            rt: PipelineRt {
                spec: spec.clone(),
                stages,
                dag,
                metrics: PipelineMetrics::new(&slo_targets),
                timeout: cx.request_timeout,
                epoch: cx.epoch,
                gate: Mutex::new(
                    AdmissionGate::new(spec.slo.map_or(0.01, |s| s.max_miss_rate))
                        .with_elastic(spec.stages.iter().any(|s| s.elastic_ms.is_some())),
                ),
                seen_outputs: std::sync::OnceLock::new(),
                joins: Vec::new(),
                join_of: vec![None; n],
                arena: cx.arena.clone(),
            },
        })
    }

    /// The pipeline's spec.
    pub fn spec(&self) -> &PipelineSpec {
        &self.rt.spec
    }

    /// Run `hook` beside stage `stage` (by name) on the request path.
    pub fn hook(&mut self, stage: &str, hook: Arc<dyn StageHook>) -> Result<(), String> {
        let s = self.rt.stages.iter_mut().find(|s| s.name == stage).ok_or(format!("no stage '{stage}'"))?;
        s.hook = Some(hook);
        Ok(())
    }

    /// Join the candidates `policy` names (stages of this pipeline with the
    /// same parents, in no other join) under `policy`.
    pub fn join(&mut self, policy: Arc<dyn JoinPolicy>) -> Result<(), String> {
        let k = self.rt.joins.len();
        if k >= 64 {
            return Err("a pipeline has at most 64 joins".into());
        }
        let mut candidates = Vec::new();
        for name in policy.candidates() {
            let i = self.rt.stages.iter().position(|s| &s.name == name).ok_or(format!("no stage '{name}'"))?;
            if self.rt.join_of[i].replace(k).is_some() {
                return Err(format!("stage '{name}' is a candidate of two joins"));
            }
            candidates.push(i);
        }
        self.rt.joins.push(Join { policy, candidates });
        Ok(())
    }

    /// The pipeline, ready to serve.
    pub fn build(self) -> Arc<PipelineRt> {
        Arc::new(self.rt)
    }
}

/// The batch former for a replica of `stage`, from the batching options and
/// the stage's measured profile (if any).
fn former_for(app: &AppSpec, pipe: &PipelineSpec, stage: &StageSpec) -> Result<BatchFormer, SpecError> {
    let b = &app.batching;
    let policy = BatchPolicy::parse(&b.policy, b.fixed_wait_ms).ok_or_else(|| SpecError {
        pipeline: pipe.name.clone(),
        reason: format!("unknown batching policy '{}' (use 'deadline' or 'fixed')", b.policy),
    })?;
    let points: Vec<(u32, f64, f64)> = app
        .profiles
        .iter()
        .filter(|p| p.pipeline == pipe.name)
        .filter_map(|p| p.stages.get(&stage.name))
        .flat_map(|s| s.points.iter().map(|pt| (pt.batch, pt.mean_ms * 1e3, pt.p99_ms * 1e3)))
        .collect();
    let mut f = BatchFormer::new(policy, stage.max_batch_size as u32, LatencyProfile::from_measurements(&points));
    f.max_wait_ns = (b.max_wait_ms * 1e6) as u64;
    f.drop_late = pipe.slo.is_none_or(|s| s.drop_late);
    if stage.length_input.is_some() && b.by_length {
        f.length = Some(LengthModel::new(stage.max_batch_tokens));
    }
    f.elastic_floor_ns = stage.elastic_ms.map(|ms| (ms * 1e6) as u64);
    Ok(f)
}

impl PipelineRt {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Time a request has from arrival: the SLO target, or the timeout.
    pub fn slo_budget(&self) -> Duration {
        self.spec.slo.map(|s| Duration::from_secs_f64(s.p99_ms / 1e3)).unwrap_or(self.timeout)
    }

    /// The longest a request may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// `t` in ns since the epoch.
    pub(crate) fn ns_at(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// How a stage is named across the node and the cluster: "pipeline/stage".
    pub fn stage_key(&self, stage: usize) -> String {
        format!("{}/{}", self.name(), self.stages[stage].name)
    }

    /// The stage named `name`, or why there is none.
    pub fn stage(&self, name: &str) -> Result<&StageRt, NodeError> {
        self.stages.iter().find(|s| s.name == name).ok_or_else(|| NodeError::UnknownStage {
            pipeline: self.name().to_string(),
            stage: name.to_string(),
            known: self.stages.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", "),
        })
    }

    /// The pipeline's outputs: as declared, else as first seen.
    pub fn outputs(&self) -> Option<&BTreeMap<String, TensorSpec>> {
        if self.spec.outputs.is_empty() {
            self.seen_outputs.get()
        } else {
            Some(&self.spec.outputs)
        }
    }

    /// Remember the outputs of an answer, once.
    pub(crate) fn learn_outputs(&self, outputs: &Tensors) {
        if self.seen_outputs.get().is_none() {
            let spec = outputs
                .iter()
                .map(|(n, t)| {
                    let shape = std::iter::once(-1).chain(t.shape.iter().skip(1).map(|&d| d as i64)).collect();
                    (n.clone(), TensorSpec { dtype: t.dtype, shape })
                })
                .collect();
            let _ = self.seen_outputs.set(spec);
        }
    }

    /// Ready while every stage has a replica whose worker serves.
    pub fn is_ready(&self) -> bool {
        self.stages.iter().all(|s| s.is_ready())
    }

    /// Admitted requests not finished yet.
    pub fn inflight(&self) -> u64 {
        self.gate.lock().inflight()
    }

    /// The counters as they are now (see [`PipelineTotals`]).
    pub fn totals(&self) -> PipelineTotals {
        let m = &self.metrics;
        PipelineTotals {
            ok: m.ok.total(),
            admitted: m.admitted.total(),
            shed: m.shed.total(),
            slo_met: m.slo_met.total(),
            slo_missed: m.slo_missed.total(),
            fallback: m.fallback.total(),
            cancelled: m.cancelled.total(),
            errors: m.errors.totals(),
            stages: self.stages.iter().map(|s| s.metrics.totals()).collect(),
        }
    }

    /// The pipeline as clients and the dashboard see it (`GET
    /// /v1/pipelines/{name}`, `/v1/history`): inputs, outputs, SLO,
    /// stages with their parents, replicas, batch limits and bounds.
    pub fn describe(&self) -> Value {
        let tensors = |m: &BTreeMap<String, TensorSpec>| -> Value {
            m.iter()
                .map(|(k, s)| (k.clone(), json!({"dtype": s.dtype, "shape": s.shape})))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        json!({
            "name": self.name(),
            "inputs": tensors(&self.spec.inputs),
            "outputs": self.outputs().map_or(json!({}), tensors),
            "slo": self.spec.slo.map(|s| json!({"p99_ms": s.p99_ms, "max_miss_rate": s.max_miss_rate})),
            "timeout_ms": self.timeout.as_millis() as u64,
            "example": self.spec.example,
            "fallback": self.spec.fallback,
            "stages": self.stages.iter().map(|s| json!({
                "name": s.name,
                "component": s.component,
                "parents": self.dag.parents[s.index].iter().map(|&i| self.stages[i].name.clone()).collect::<Vec<_>>(),
                "replicas": s.live_replicas(),
                "max_batch_size": s.max_batch,
                "min_replicas": s.bounds.0,
                "max_replicas": s.bounds.1,
            })).collect::<Vec<_>>(),
        })
    }

    /// Expected time from the end of `stage` to the end of the request:
    /// the longest path through its descendants, each at its typical batch.
    pub(crate) fn rest_ns(&self, stage: usize) -> u64 {
        self.dag.rest_ns(stage, &|c| self.stages[c].typical_ns())
    }

    /// A new request's ticket: deadline `arrival + SLO target` (or the
    /// request timeout without an SLO), or `budget` from arrival if that is
    /// tighter; route chosen now (join-shortest-queue per stage).
    pub(crate) fn ticket(&self, id: u64, arrival: Instant, budget: Option<Duration>) -> Result<Ticket, NodeError> {
        let slo = self.slo_budget();
        let route = self
            .stages
            .iter()
            .map(|s| {
                s.target(id, None)
                    .ok_or_else(|| NodeError::Unavailable { stage: s.name.clone(), reason: "it has no replica".into() })
            })
            .collect::<Result<_, _>>()?;
        Ok(Ticket::new(id, arrival, arrival + budget.map_or(slo, |b| b.min(slo)), route))
    }

    /// Admission control: can a request with this ticket, arriving now,
    /// finish by its deadline? (See [`AdmissionGate::decide`].) Ok: the
    /// share of its budget the prediction uses, and whether requests were
    /// waiting in a queue on its route. Err: by how much it is predicted to
    /// miss.
    pub(crate) fn admit(&self, t: &Ticket, class: Priority) -> Result<(f64, bool), Duration> {
        let now = self.now_ns();
        let mut loads: Vec<ReplicaLoad> = t.route.iter().map(|r| r.load()).collect();
        for join in self.joins.iter().filter(|j| j.policy.timing() == JoinTiming::Fastest) {
            // A join that answers at its cutoff with what has arrived takes
            // as long as its fastest candidate: a straggler's backlog is
            // skipped, not waited on.
            let eta = |c: usize| loads[c].backlog_ns(now) + loads[c].single_ns;
            if let Some(fast) = join.candidates.iter().copied().min_by_key(|&c| eta(c)) {
                let l = loads[fast];
                join.candidates.iter().for_each(|&c| loads[c] = l);
            }
        }
        let prediction = self.dag.predict(&loads, now);
        let budget = self.ns_at(t.deadline).saturating_sub(now);
        let share = self.gate.lock().decide_for(prediction, budget, class).map_err(Duration::from_nanos)?;
        Ok((share, slipstream_sched::found_queue(&loads)))
    }

    /// Route the stages that declare affinity to the replica holding the
    /// affinity group of the object their input names (see [`StageRt::sticky`]).
    /// In a cluster, only replicas on nodes holding the group are candidates
    /// (any replica when none of them serves the stage).
    pub(crate) fn route_by_affinity(
        &self,
        t: &mut Ticket,
        inputs: &Tensors,
        pools: &[slipstream_store::Pool],
        shared: Option<&Arc<dyn crate::ext::SharedStore>>,
    ) {
        for s in self.stages.iter().filter(|s| s.affinity.is_some()) {
            let name = s.affinity.as_deref().expect("filtered");
            let Some(key) = inputs.iter().find(|(n, _)| n == name).and_then(|(_, t)| t.first_string()) else {
                continue;
            };
            let Some((pool, group)) = slipstream_store::affinity_of(pools, &key) else { continue };
            let home = shared.map(|sh| sh.group_home(&pool, &group));
            let at_home = |r: &Replica| match (&home, &r.remote) {
                (None, _) => true,
                (Some(h), None) => h.here,
                (Some(h), Some(at)) => h.elsewhere.contains(&at.node),
            };
            if let Some(r) = s.sticky(&format!("{pool}{group}"), t.id, &at_home) {
                t.route[s.index] = r;
            }
        }
    }
}
