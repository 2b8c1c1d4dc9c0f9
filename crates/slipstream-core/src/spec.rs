//! The application spec: what the Python front end hands the node.
//!
//! `slipstream serve app.py` imports the user's module in Python, turns its
//! `Pipeline` objects into this JSON-shaped description, and passes it to
//! the node. Everything here is checked once, at start-up, so the
//! request path can rely on it: stage names unique, parents known, the graph
//! acyclic, at least one stage, batch sizes and replica counts positive.

use serde::Deserialize;
use slipstream_types::TensorSpec;
use std::collections::{BTreeMap, HashMap};

/// The app: its pipelines and how the node runs them.
#[derive(Clone, Debug, Deserialize)]
pub struct AppSpec {
    /// Its pipelines.
    pub pipelines: Vec<PipelineSpec>,
    /// Command that starts one worker; the node appends per-replica flags.
    pub worker_argv: Vec<String>,
    /// Environment of every worker.
    #[serde(default)]
    pub worker_env: BTreeMap<String, String>,
    /// Latency profiles from `slipstream profile`, by pipeline.
    #[serde(default)]
    pub profiles: Vec<ProfileSpec>,
    /// How stages form batches and admission refuses.
    #[serde(default)]
    pub batching: BatchingSpec,
    /// How autoscaled stages follow the load (node defaults when absent).
    #[serde(default)]
    pub autoscale: Option<AutoscaleSpec>,
    /// The object store's pools and the objects put at start-up.
    #[serde(default)]
    pub store: StoreSpec,
}

/// The app's view of the object store (see `docs/design/store.md`).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StoreSpec {
    /// Key prefixes with their retention and affinity.
    #[serde(default)]
    pub pools: Vec<PoolSpec>,
    /// Files put at start-up.
    #[serde(default)]
    pub seed: Vec<SeedSpec>,
}

/// A key prefix with its retention and affinity.
#[derive(Clone, Debug, Deserialize)]
pub struct PoolSpec {
    /// The keys it holds.
    pub prefix: String,
    /// Versions kept per key.
    #[serde(default = "default_keep")]
    pub keep_versions: u64,
    /// Versions older than this are removed (keeping the latest).
    #[serde(default)]
    pub keep_age_s: Option<f64>,
    /// A regex whose first capture group names a key's affinity group.
    #[serde(default)]
    pub affinity: Option<String>,
    /// In a cluster: nodes holding each value (None: the node's setting).
    #[serde(default)]
    pub copies: Option<u32>,
    /// In a cluster: copies durable before a put is acknowledged (None: all).
    #[serde(default)]
    pub write_copies: Option<u32>,
}

fn default_keep() -> u64 {
    16
}

impl PoolSpec {
    /// The store's pool (Err: why the declaration is invalid).
    pub fn to_pool(&self) -> Result<slipstream_store::Pool, String> {
        slipstream_store::Pool::new(&self.prefix, self.keep_versions, self.keep_age_s, self.affinity.as_deref())
            .and_then(|p| p.with_copies(self.copies, self.write_copies))
            .map_err(|e| e.to_string())
    }
}

/// A file put under `key` at start-up unless the key has a live version.
#[derive(Clone, Debug, Deserialize)]
pub struct SeedSpec {
    /// The key.
    pub key: String,
    /// The file.
    pub path: std::path::PathBuf,
    /// Its content type.
    #[serde(default = "octet_stream")]
    pub content_type: String,
}

fn octet_stream() -> String {
    "application/octet-stream".into()
}

/// The inputs a trigger can carry, by name (see [`StageSpec::watch`]).
pub const TRIGGER_INPUTS: [(&str, slipstream_types::DType); 4] = [
    ("key", slipstream_types::DType::String),
    ("version", slipstream_types::DType::Int64),
    ("op", slipstream_types::DType::String),
    ("value", slipstream_types::DType::Bytes),
];

/// Autoscaler settings from `slipstream serve` (applied by the autoscaler).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct AutoscaleSpec {
    /// `"anticipatory"` (default), `"reactive"` or `"off"`.
    #[serde(default)]
    pub policy: Option<String>,
    /// Cores the replicas may use (default: the machine's).
    #[serde(default)]
    pub cores: Option<f64>,
    /// Keep a warm standby from this share of the serving capacity.
    #[serde(default)]
    pub standby_at: Option<f64>,
    /// Plan serving replicas to run at most this busy.
    #[serde(default)]
    pub utilization: Option<f64>,
    /// Scale down after the load needed fewer replicas this long.
    #[serde(default)]
    pub down_after_s: Option<f64>,
}

/// How stages form batches.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BatchingSpec {
    /// `"deadline"` (deadline-aware, the default) or `"fixed"` (max batch
    /// size + fixed wait: the Triton / Ray Serve policy, for comparison).
    #[serde(default = "deadline_policy")]
    pub policy: String,
    /// The fixed policy's wait for a full batch.
    #[serde(default = "default_fixed_wait")]
    pub fixed_wait_ms: f64,
    /// The deadline-aware policy's longest delayed-batching wait.
    #[serde(default = "default_max_wait")]
    pub max_wait_ms: f64,
    /// Refuse requests at ingress that are predicted to miss their deadline.
    #[serde(default = "yes")]
    pub admission: bool,
    /// Stages that name a length input batch requests of similar length
    /// together (off: by deadline order only, for comparison).
    #[serde(default = "yes")]
    pub by_length: bool,
}

impl Default for BatchingSpec {
    fn default() -> Self {
        BatchingSpec {
            policy: deadline_policy(),
            fixed_wait_ms: default_fixed_wait(),
            max_wait_ms: default_max_wait(),
            admission: true,
            by_length: true,
        }
    }
}

fn deadline_policy() -> String {
    "deadline".into()
}
fn default_fixed_wait() -> f64 {
    2.0
}
/// Off: the batcher is work-conserving unless a deployment asks it to wait
/// (docs/design/scheduling.md, "Why delayed batching is off by default":
/// a 2 ms wait halved the no-op chain's capacity and made its closed-loop
/// throughput swing between runs).
fn default_max_wait() -> f64 {
    0.0
}
fn yes() -> bool {
    true
}

/// A pipeline's measured profile: for each stage, latency by batch size.
#[derive(Clone, Debug, Deserialize)]
pub struct ProfileSpec {
    /// The pipeline.
    pub pipeline: String,
    /// Each stage's profile, by name.
    pub stages: BTreeMap<String, StageProfileSpec>,
}

/// One stage's profile.
#[derive(Clone, Debug, Deserialize)]
pub struct StageProfileSpec {
    /// Latency at each batch size measured.
    pub points: Vec<ProfilePointSpec>,
}

/// Latency at one batch size.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct ProfilePointSpec {
    /// The batch size.
    pub batch: u32,
    /// Mean latency, ms.
    pub mean_ms: f64,
    /// p99 latency, ms.
    pub p99_ms: f64,
}

/// One pipeline: its inputs, outputs, SLO and DAG of stages.
#[derive(Clone, Debug, Deserialize)]
pub struct PipelineSpec {
    /// Its name.
    pub name: String,
    /// Its inputs (dtype and shape; the first dimension is rows).
    pub inputs: BTreeMap<String, TensorSpec>,
    /// Its outputs, when declared (else learned from the first answer).
    #[serde(default)]
    pub outputs: BTreeMap<String, TensorSpec>,
    /// Its latency objective.
    #[serde(default)]
    pub slo: Option<SloSpec>,
    /// One realistic request's inputs, as the pipeline API's JSON `inputs`.
    #[serde(default)]
    pub example: Option<serde_json::Value>,
    /// The answer for one row, per declared output, returned (with the
    /// header `x-slipstream-fallback`) instead of a 429 / 504 (Clipper's
    /// default output).
    #[serde(default)]
    pub fallback: Option<serde_json::Value>,
    /// In any order; `parents` name other stages of this pipeline. Stages
    /// without parents receive the pipeline's inputs.
    pub stages: Vec<StageSpec>,
    /// Model selection over candidate stages (see [`crate::join`]).
    #[serde(default)]
    pub selects: Vec<SelectSpec>,
    /// How its stages were sized and why (the serving command's plan, in
    /// words), shown by `status`.
    #[serde(default)]
    pub sizing: Vec<String>,
}

/// How a selection stage chooses among its candidates.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SelectPolicy {
    /// One candidate per request, by Exp3 (a bandit: feedback on the one chosen).
    Exp3,
    /// All candidates, combined with learned weights (Exp4-style experts).
    Exp4,
}

/// Clipper's model selection: the candidates are ordinary stages sharing
/// their parents; the stages after the selection take all of them as
/// parents and see one combined answer.
#[derive(Clone, Debug, Deserialize)]
pub struct SelectSpec {
    /// Its name.
    pub name: String,
    /// The candidate stages.
    pub candidates: Vec<String>,
    /// How it chooses.
    pub policy: SelectPolicy,
    /// A string input of the pipeline whose first element keys the policy
    /// state (a user or session: Clipper's contextualization).
    #[serde(default)]
    pub context: Option<String>,
    /// The straggler bound: an ensemble answers this long after its
    /// candidates were dispatched with what has arrived (capped by the
    /// request's deadline less the rest of the pipeline).
    #[serde(default)]
    pub wait_ms: Option<f64>,
    /// Learning rate (default 0.1 for exp3, 0.2 for exp4).
    #[serde(default)]
    pub eta: Option<f64>,
    /// Exp3's share of uniform exploration (default 0.05).
    #[serde(default)]
    pub gamma: Option<f64>,
}

/// A stage's prediction cache (a [`crate::ext::StageHook`]).
#[derive(Clone, Debug, Deserialize)]
pub struct CacheSpec {
    /// The inputs that make the key (all of the stage's inputs when absent).
    #[serde(default)]
    pub key: Option<Vec<String>>,
    /// Bytes of results kept (plus a fixed overhead per entry).
    #[serde(default = "default_cache_bytes")]
    pub max_bytes: u64,
}

fn default_cache_bytes() -> u64 {
    64 << 20
}

/// A pipeline's latency objective.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
pub struct SloSpec {
    /// p99 latency, ms.
    pub p99_ms: f64,
    /// Share of requests allowed to miss it.
    #[serde(default = "default_miss")]
    pub max_miss_rate: f64,
    /// Drop requests whose deadline passed inside the pipeline (default);
    /// off, they are still served, late.
    #[serde(default = "yes")]
    pub drop_late: bool,
}

fn default_miss() -> f64 {
    0.01
}

/// One stage of a pipeline.
#[derive(Clone, Debug, Deserialize)]
pub struct StageSpec {
    /// Its name.
    pub name: String,
    /// Import path the worker uses to find the component (e.g. `Normalize`).
    pub component: String,
    /// The stages whose outputs it takes (none: the pipeline's inputs).
    #[serde(default)]
    pub parents: Vec<String>,
    /// Replicas to start with.
    #[serde(default = "one")]
    pub replicas: usize,
    /// Autoscaling bounds (0: the starting count, i.e. not autoscaled).
    #[serde(default)]
    pub min_replicas: usize,
    /// See `min_replicas`.
    #[serde(default)]
    pub max_replicas: usize,
    /// Threads (cores' worth of work) each replica may use.
    #[serde(default = "one")]
    pub threads: usize,
    /// The largest batch it runs.
    #[serde(default = "one")]
    pub max_batch_size: usize,
    /// An input of variable-length elements (strings, bytes) that the
    /// component pads to the batch's longest: batches group requests of
    /// similar length (see `slipstream_sched::LengthModel`).
    #[serde(default)]
    pub length_input: Option<String>,
    /// With `length_input`: the most padded positions (rows x longest
    /// element) one batch may hold; none: no bound.
    #[serde(default)]
    pub max_batch_tokens: Option<u64>,
    /// An elastic stage (it answers by its batch's deadline, doing less
    /// with less time): the time a batch keeps back from its deadline, and
    /// the least it takes, ms. None: a plain stage (see
    /// `slipstream_sched::BatchFormer::elastic_floor_ns`).
    #[serde(default)]
    pub elastic_ms: Option<f64>,
    /// Batches a replica's worker may run at once: 1 for a plain
    /// component; more for an `async def __call__` that waits on I/O.
    #[serde(default = "one")]
    pub concurrency: usize,
    /// Environment of this stage's workers, over the node-wide one.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Store objects its workers load before they are ready (by argument name).
    #[serde(default)]
    pub needs: BTreeMap<String, String>,
    /// A key prefix: a put or delete under it invokes this (root) stage's
    /// pipeline, with the [`TRIGGER_INPUTS`] the pipeline declares.
    #[serde(default)]
    pub watch: Option<String>,
    /// A string input naming the store object each request reads: the
    /// request goes to the replica that holds the object's affinity group.
    #[serde(default)]
    pub affinity: Option<String>,
    /// `"cpu"` (default), `"cuda"` (each replica on one GPU, round-robin)
    /// or `"cuda:N"`: see [`crate::gpu`].
    #[serde(default)]
    pub device: Option<String>,
    /// With `device: "cuda"`: the devices (places in this machine's list,
    /// as `cuda:N` names them) its replicas take instead of all of them,
    /// each the one with the fewest of them on it (see [`crate::gpu`]): a
    /// GPU plan's binding of each replica to its planned GPU or MIG slice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<usize>,
    /// Cache this stage's results by a hash of its inputs.
    #[serde(default)]
    pub cache: Option<CacheSpec>,
}

impl StageSpec {
    /// The autoscaling bounds, `(min, max)`: the starting count when none are declared.
    pub fn bounds(&self) -> (usize, usize) {
        let or_start = |v: usize| if v == 0 { self.replicas } else { v };
        (or_start(self.min_replicas), or_start(self.max_replicas))
    }
}

fn one() -> usize {
    1
}

/// Replicas one stage may be scaled to.
pub const MAX_REPLICAS: usize = 64;

/// The most model selections one pipeline may have (see [`crate::join`]).
pub const MAX_SELECTS: usize = 64;

/// The most batches one worker may have in flight.
pub const MAX_CONCURRENCY: usize = 1024;

/// Why an app's description is invalid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid pipeline '{pipeline}': {reason}")]
pub struct SpecError {
    /// The pipeline.
    pub pipeline: String,
    /// Why.
    pub reason: String,
}

impl PipelineSpec {
    /// A stage's `needs`, `watch` and `affinity` fit the store and the pipeline.
    fn check_store_fields(&self, s: &StageSpec) -> Result<(), String> {
        for (arg, key) in &s.needs {
            slipstream_store::check_key(key).map_err(|e| format!("stage '{}' needs {arg}: {e}", s.name))?;
        }
        if let Some(prefix) = &s.watch {
            slipstream_store::check_prefix(prefix).map_err(|e| format!("stage '{}' watches {e}", s.name))?;
            if !s.parents.is_empty() {
                return Err(format!("stage '{}' watches {prefix} but has parents: a watching stage is a root", s.name));
            }
            for (name, spec) in &self.inputs {
                match TRIGGER_INPUTS.iter().find(|(n, _)| n == name) {
                    Some((_, dtype)) if *dtype == spec.dtype => {}
                    _ => {
                        return Err(format!(
                            "stage '{}' watches {prefix}, so the pipeline's inputs must be among key (string), \
                             version (int64), op (string) and value (bytes); '{name}' is not",
                            s.name
                        ))
                    }
                }
            }
        }
        if let Some(input) = &s.affinity {
            match self.inputs.get(input) {
                Some(spec) if spec.dtype == slipstream_types::DType::String => {}
                _ => {
                    return Err(format!(
                    "stage '{}' routes by affinity on input '{input}', which must be a string input of the pipeline",
                    s.name
                ))
                }
            }
        }
        Ok(())
    }

    /// Check the pipeline and return its stages in topological order
    /// (indices into `self.stages`).
    pub fn validate(&self) -> Result<Vec<usize>, SpecError> {
        let err = |reason: String| SpecError { pipeline: self.name.clone(), reason };
        if self.name.is_empty() || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(err("names may use letters, digits, '-', '_' and '.' only".into()));
        }
        if self.stages.is_empty() {
            return Err(err("it has no stages".into()));
        }
        if self.inputs.is_empty() {
            return Err(err("it declares no inputs".into()));
        }
        for (name, spec) in &self.inputs {
            if spec.shape.is_empty() {
                return Err(err(format!(
                    "input '{name}' must have at least one dimension (the first is the row dimension)"
                )));
            }
        }
        if let Some(slo) = self.slo {
            if slo.p99_ms.is_nan() || slo.p99_ms <= 0.0 || !(0.0..1.0).contains(&slo.max_miss_rate) {
                return Err(err("the SLO needs p99_ms > 0 and 0 <= max_miss_rate < 1".into()));
            }
        }
        let mut index = HashMap::new();
        for (i, s) in self.stages.iter().enumerate() {
            if index.insert(s.name.as_str(), i).is_some() {
                return Err(err(format!("stage name '{}' is used twice", s.name)));
            }
            if s.concurrency == 0 || s.concurrency > MAX_CONCURRENCY {
                return Err(err(format!("stage '{}' needs 1 <= concurrency <= {MAX_CONCURRENCY}", s.name)));
            }
            if s.replicas == 0 || s.max_batch_size == 0 || s.threads == 0 {
                return Err(err(format!(
                    "stage '{}' needs replicas >= 1, threads >= 1 and max_batch_size >= 1",
                    s.name
                )));
            }
            if s.elastic_ms.is_some_and(|ms| !(ms.is_finite() && ms > 0.0)) {
                return Err(err(format!("stage '{}': elastic_ms must be a number of ms > 0", s.name)));
            }
            let (lo, hi) = s.bounds();
            if !(lo..=hi).contains(&s.replicas) || hi > MAX_REPLICAS {
                return Err(err(format!(
                    "stage '{}': replicas {} must lie within its bounds ({lo}, {hi}), at most {}",
                    s.name, s.replicas, MAX_REPLICAS
                )));
            }
        }
        for s in &self.stages {
            self.check_store_fields(s).map_err(err)?;
            self.check_length(s).map_err(err)?;
            let want =
                crate::gpu::Want::parse(s.device.as_deref()).map_err(|e| err(format!("stage '{}': {e}", s.name)))?;
            if !s.devices.is_empty() && want != crate::gpu::Want::AnyGpu {
                return Err(err(format!("stage '{}': devices (a plan's binding) needs device=\"cuda\"", s.name)));
            }
        }
        let mut indegree = vec![0usize; self.stages.len()];
        for (i, s) in self.stages.iter().enumerate() {
            for p in &s.parents {
                if !index.contains_key(p.as_str()) {
                    return Err(err(format!("stage '{}' names unknown parent '{p}'", s.name)));
                }
                if p == &s.name {
                    return Err(err(format!("stage '{}' is its own parent", s.name)));
                }
                indegree[i] += 1;
            }
        }
        // Kahn's algorithm; stable in declaration order.
        let mut order = Vec::with_capacity(self.stages.len());
        let mut ready: Vec<usize> = (0..self.stages.len()).filter(|&i| indegree[i] == 0).collect();
        ready.reverse();
        while let Some(i) = ready.pop() {
            order.push(i);
            for (j, s) in self.stages.iter().enumerate() {
                let edges = s.parents.iter().filter(|p| p.as_str() == self.stages[i].name).count();
                if edges > 0 {
                    indegree[j] -= edges;
                    if indegree[j] == 0 {
                        ready.insert(0, j);
                    }
                }
            }
        }
        if order.len() != self.stages.len() {
            return Err(err("its stages form a cycle".into()));
        }
        self.check_selects(&index).map_err(err)?;
        for s in &self.stages {
            self.check_cache(s).map_err(err)?;
        }
        Ok(order)
    }

    /// A length input is one of variable-length elements, and a token
    /// budget needs one.
    fn check_length(&self, s: &StageSpec) -> Result<(), String> {
        match (&s.length_input, s.max_batch_tokens) {
            (None, Some(_)) => Err(format!("stage '{}': max_batch_tokens needs a length input", s.name)),
            (Some(_), Some(0)) => Err(format!("stage '{}': max_batch_tokens must be >= 1", s.name)),
            (Some(input), _) if s.parents.is_empty() => match self.inputs.get(input) {
                Some(spec) if spec.dtype.is_variable() => Ok(()),
                Some(_) => Err(format!(
                    "stage '{}': length input '{input}' must hold strings or bytes (variable-length elements)",
                    s.name
                )),
                None => Err(format!("stage '{}': length input '{input}' is not an input of the pipeline", s.name)),
            },
            _ => Ok(()),
        }
    }

    fn check_cache(&self, s: &StageSpec) -> Result<(), String> {
        let Some(c) = &s.cache else { return Ok(()) };
        if s.watch.is_some() {
            return Err(format!("stage '{}' watches the store, so its results cannot be cached", s.name));
        }
        if c.max_bytes == 0 {
            return Err(format!("stage '{}': the cache needs max_bytes >= 1", s.name));
        }
        if let Some(key) = &c.key {
            if key.is_empty() {
                return Err(format!("stage '{}': a cache key names at least one input", s.name));
            }
            if s.parents.is_empty() {
                if let Some(k) = key.iter().find(|k| !self.inputs.contains_key(k.as_str())) {
                    return Err(format!("stage '{}': cache key input '{k}' is not an input of the pipeline", s.name));
                }
            }
        }
        Ok(())
    }

    /// Each selection's candidates are distinct stages of this pipeline,
    /// in no other selection, with the same parents; a stage after a
    /// candidate comes after all of them (it sees the one combined answer).
    fn check_selects(&self, index: &HashMap<&str, usize>) -> Result<(), String> {
        let mut taken: HashMap<&str, &str> = HashMap::new();
        if self.selects.len() > MAX_SELECTS {
            return Err(format!("a pipeline has at most {MAX_SELECTS} selections"));
        }
        for sel in &self.selects {
            let name = &sel.name;
            if index.contains_key(name.as_str()) || self.selects.iter().filter(|o| &o.name == name).count() > 1 {
                return Err(format!("selection name '{name}' is used twice"));
            }
            if sel.candidates.len() < 2 {
                return Err(format!("selection '{name}' needs at least two candidates"));
            }
            let mut parents: Option<Vec<&str>> = None;
            for c in &sel.candidates {
                let Some(&i) = index.get(c.as_str()) else {
                    return Err(format!("selection '{name}' names unknown candidate '{c}'"));
                };
                if let Some(other) = taken.insert(c.as_str(), name.as_str()) {
                    return Err(format!("stage '{c}' is a candidate of both '{other}' and '{name}'"));
                }
                let st = &self.stages[i];
                if st.watch.is_some() {
                    return Err(format!("selection '{name}': candidate '{c}' watches the store"));
                }
                let mut ps: Vec<&str> = st.parents.iter().map(String::as_str).collect();
                ps.sort_unstable();
                match &parents {
                    None => parents = Some(ps),
                    Some(first) if *first != ps => {
                        return Err(format!("selection '{name}': its candidates must have the same parents"));
                    }
                    _ => {}
                }
            }
            for s in &self.stages {
                let after = s.parents.iter().filter(|p| sel.candidates.contains(p)).count();
                if after > 0 && after < sel.candidates.len() {
                    return Err(format!(
                        "stage '{}' follows some candidates of selection '{name}' but not all: it must take the \
                         selection's one answer",
                        s.name
                    ));
                }
            }
            if let Some(ctx) = &sel.context {
                match self.inputs.get(ctx) {
                    Some(t) if t.dtype == slipstream_types::DType::String => {}
                    _ => {
                        return Err(format!(
                            "selection '{name}': context '{ctx}' must be a string input of the pipeline"
                        ))
                    }
                }
            }
            let positive = |v: Option<f64>| v.is_none_or(|v| v.is_finite() && v > 0.0);
            if !positive(sel.wait_ms) || !positive(sel.eta) {
                return Err(format!("selection '{name}': wait_ms and eta must be positive numbers"));
            }
            if !sel.gamma.is_none_or(|g| g.is_finite() && g > 0.0 && g <= 1.0) {
                return Err(format!("selection '{name}': gamma must lie in (0, 1]"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe(stages: &str) -> PipelineSpec {
        serde_json::from_str(&format!(
            r#"{{"name":"p","inputs":{{"x":{{"dtype":"float32","shape":[-1,2]}}}},"stages":{stages}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn a_length_input_is_a_variable_length_input_of_the_pipeline() {
        let with = |stage: &str| -> PipelineSpec {
            serde_json::from_str(&format!(
                r#"{{"name":"p","inputs":{{"x":{{"dtype":"float32","shape":[-1,2]}},
                    "q":{{"dtype":"string","shape":[-1]}}}},"stages":[{stage}]}}"#
            ))
            .unwrap()
        };
        let ok = with(r#"{"name":"a","component":"A","length_input":"q","max_batch_tokens":512}"#);
        assert!(ok.validate().is_ok());
        assert!(with(r#"{"name":"a","component":"A","device":"cuda","devices":[2,0]}"#).validate().is_ok());
        for (stage, why) in [
            (r#"{"name":"a","component":"A","length_input":"x"}"#, "strings or bytes"),
            (r#"{"name":"a","component":"A","length_input":"zz"}"#, "not an input"),
            (r#"{"name":"a","component":"A","max_batch_tokens":5}"#, "needs a length input"),
            (r#"{"name":"a","component":"A","length_input":"q","max_batch_tokens":0}"#, ">= 1"),
            (r#"{"name":"a","component":"A","elastic_ms":0}"#, "elastic_ms"),
            (r#"{"name":"a","component":"A","elastic_ms":-3.5}"#, "elastic_ms"),
            (r#"{"name":"a","component":"A","devices":[0,1]}"#, "needs device=\"cuda\""),
            (r#"{"name":"a","component":"A","device":"cuda:1","devices":[0]}"#, "needs device=\"cuda\""),
        ] {
            let reason = with(stage).validate().unwrap_err().reason;
            assert!(reason.contains(why), "{stage}: {reason}");
        }
    }

    #[test]
    fn diamond_orders_topologically() {
        let p = pipe(
            r#"[{"name":"d","component":"D","parents":["b","c"]},
                {"name":"b","component":"B","parents":["a"]},
                {"name":"a","component":"A"},
                {"name":"c","component":"C","parents":["a"]}]"#,
        );
        let order = p.validate().unwrap();
        let names: Vec<_> = order.iter().map(|&i| p.stages[i].name.as_str()).collect();
        assert_eq!(names[0], "a");
        assert_eq!(names[3], "d");
    }

    #[test]
    fn rejects_cycles_unknown_parents_and_duplicates() {
        let cyc =
            pipe(r#"[{"name":"a","component":"A","parents":["b"]},{"name":"b","component":"B","parents":["a"]}]"#);
        assert!(cyc.validate().unwrap_err().reason.contains("cycle"));
        let unk = pipe(r#"[{"name":"a","component":"A","parents":["zz"]}]"#);
        assert!(unk.validate().unwrap_err().reason.contains("unknown parent"));
        let dup = pipe(r#"[{"name":"a","component":"A"},{"name":"a","component":"A"}]"#);
        assert!(dup.validate().unwrap_err().reason.contains("twice"));
        let zero = pipe(r#"[{"name":"a","component":"A","replicas":0}]"#);
        assert!(zero.validate().is_err());
        let outside = pipe(r#"[{"name":"a","component":"A","replicas":5,"min_replicas":1,"max_replicas":4}]"#);
        assert!(outside.validate().unwrap_err().reason.contains("bounds"));
        let gpu = pipe(r#"[{"name":"a","component":"A","device":"gpu0"}]"#);
        assert!(gpu.validate().unwrap_err().reason.contains("\"cuda:N\""));
        let ok = pipe(r#"[{"name":"a","component":"A","replicas":1,"min_replicas":1,"max_replicas":4}]"#);
        assert_eq!(ok.stages[0].bounds(), (1, 4));
        assert!(ok.validate().is_ok());
    }
}
