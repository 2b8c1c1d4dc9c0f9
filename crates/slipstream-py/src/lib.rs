//! `slipstream._core`: the compiled core, as a thin PyO3 boundary.
//!
//! What crosses it: `serve` (run a node until SIGINT/SIGTERM, with the GIL
//! released), `node_settings`/`check_config` (the node's settings table and
//! its checks, so the front end declares no setting of its own), `bench`
//! (the open-loop load generator), `Pool` (a worker's handle on its
//! shared-memory pool, for allocating output blocks), and the cluster's
//! certificates (`tls_make_ca`, `tls_issue`, `tls_check`).
//! Arguments arrive as JSON strings or plain scalars so that the Python side
//! owns all user-facing validation and messages; errors come back as
//! `CoreError(kind, message)`.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use slipstream_runtime::{AppSpec, LogFormat, NodeConfig, RunOptions};
use slipstream_shm::Pool as ShmPool;
use std::path::PathBuf;

create_exception!(_core, CoreError, PyRuntimeError, "An error from the compiled core: args are (kind, message).");

fn core_err(kind: &str, message: impl ToString) -> PyErr {
    CoreError::new_err((kind.to_string(), message.to_string()))
}

/// Serve the app described by `spec_json` until SIGINT/SIGTERM, with the
/// node configured by `config_json` (a `NodeConfig`: the front end's
/// resolved settings; absent keys take their defaults).
#[pyfunction]
#[pyo3(signature = (spec_json, config_json="{}", log=true, cluster_json=None))]
fn serve(py: Python<'_>, spec_json: &str, config_json: &str, log: bool, cluster_json: Option<String>) -> PyResult<()> {
    let spec: AppSpec = serde_json::from_str(spec_json).map_err(|e| core_err("invalid_spec", e))?;
    let mut opts = run_options(config_json)?;
    if !log {
        opts.log = LogFormat::Off;
    }
    if let Some(c) = cluster_json.filter(|c| !c.is_empty()) {
        opts.cluster = Some(serde_json::from_str(&c).map_err(|e| core_err("invalid_option", format!("cluster: {e}")))?);
    }
    py.detach(|| slipstream_runtime::run_blocking(spec, opts, |_| {})).map_err(|e| core_err(e.kind(), e))
}

fn run_options(config_json: &str) -> PyResult<RunOptions> {
    NodeConfig::from_json(config_json)
        .and_then(|c| RunOptions::from_config(&c))
        .map_err(|e| core_err("invalid_option", e))
}

/// The node's settings table as JSON: `[{name, kind, optional, choices,
/// default, help, flag}]` (see `slipstream_core::config`).
#[pyfunction]
fn node_settings() -> PyResult<String> {
    serde_json::to_string(&slipstream_runtime::settings()).map_err(|e| core_err("internal", e))
}

/// Check a configuration without serving: Ok, or `CoreError("invalid_option", why)`.
#[pyfunction]
fn check_config(config_json: &str) -> PyResult<()> {
    run_options(config_json).map(|_| ())
}

/// Run the open-loop load generator; `config_json` is a `BenchConfig`.
/// Returns the list of per-rate reports as JSON. Progress lines go to stderr.
#[pyfunction]
#[pyo3(name = "bench", signature = (config_json, quiet=false))]
fn run_bench(py: Python<'_>, config_json: &str, quiet: bool) -> PyResult<String> {
    let cfg: slipstream_loadgen::BenchConfig =
        serde_json::from_str(config_json).map_err(|e| core_err("invalid_config", e))?;
    let reports = py
        .detach(|| {
            slipstream_loadgen::run(&cfg, &mut |line: &str| {
                if !quiet {
                    eprintln!("{line}");
                }
            })
        })
        .map_err(|e| core_err(e.kind(), e))?;
    serde_json::to_string(&reports).map_err(|e| core_err("internal", e))
}

/// One offered load for the SLO model (see `slipstream_sched::simulate`).
#[derive(serde::Deserialize)]
struct SimRequest {
    stages: Vec<SimStageRequest>,
    slo_ms: f64,
    rate: f64,
    #[serde(default = "one")]
    burst: u32,
    duration_s: f64,
    warmup_s: f64,
    cores: f64,
    hop_us: f64,
    #[serde(default = "default_batch_cpu")]
    batch_cpu_us: f64,
    ingress_us: f64,
    cpu_per_request_us: f64,
    /// `[q, µs]` quantiles of latency outside the stages (see SimConfig).
    #[serde(default)]
    external_us: Vec<(f64, f64)>,
    #[serde(default = "default_miss_rate")]
    max_miss_rate: f64,
    #[serde(default)]
    preempt_slice_us: f64,
    policy: String,
    #[serde(default)]
    fixed_wait_ms: f64,
    max_wait_ms: f64,
    admission: bool,
    seed: u64,
}

fn one() -> u32 {
    1
}

fn default_batch_cpu() -> f64 {
    60.0
}

fn default_miss_rate() -> f64 {
    0.01
}

#[derive(serde::Deserialize)]
struct SimStageRequest {
    parents: Vec<usize>,
    replicas: usize,
    max_batch: u32,
    /// `[batch, mean µs, p99 µs]`
    points: Vec<(u32, f64, f64)>,
    /// An elastic stage's floor, ms (none: a plain stage).
    #[serde(default)]
    elastic_ms: Option<f64>,
}

/// Run the SLO model at one offered load; returns the result as JSON.
#[pyfunction]
fn simulate(py: Python<'_>, config_json: &str) -> PyResult<String> {
    use slipstream_sched::{BatchPolicy, LatencyProfile, SimConfig, SimStage};
    let r: SimRequest = serde_json::from_str(config_json).map_err(|e| core_err("invalid_config", e))?;
    let policy = BatchPolicy::parse(&r.policy, r.fixed_wait_ms)
        .ok_or_else(|| core_err("invalid_config", format!("unknown policy '{}'", r.policy)))?;
    let cfg = SimConfig {
        stages: r
            .stages
            .into_iter()
            .map(|s| SimStage {
                parents: s.parents,
                replicas: s.replicas,
                max_batch: s.max_batch,
                profile: LatencyProfile::from_measurements(&s.points),
                elastic_floor_ns: s.elastic_ms.map(|ms| (ms.max(0.0) * 1e6) as u64),
            })
            .collect(),
        slo_ns: (r.slo_ms * 1e6) as u64,
        rate: r.rate,
        burst: r.burst,
        duration_s: r.duration_s,
        warmup_s: r.warmup_s,
        cores: r.cores,
        hop_ns: (r.hop_us * 1e3) as u64,
        batch_cpu_ns: (r.batch_cpu_us * 1e3) as u64,
        ingress_ns: (r.ingress_us * 1e3) as u64,
        cpu_per_request_ns: (r.cpu_per_request_us * 1e3) as u64,
        external_ns: r.external_us.iter().map(|&(q, us)| (q, (us.max(0.0) * 1e3) as u64)).collect(),
        max_miss_rate: r.max_miss_rate,
        preempt_slice_ns: (r.preempt_slice_us.max(0.0) * 1e3) as u64,
        policy,
        max_wait_ns: (r.max_wait_ms * 1e6) as u64,
        admission: r.admission,
        seed: r.seed,
    };
    let res = py.detach(|| slipstream_sched::simulate(&cfg));
    Ok(serde_json::json!({
        "offered_rps": res.offered_rps,
        "arrivals": res.arrivals,
        "answered": res.answered,
        "refused": res.refused,
        "dropped": res.dropped,
        "late": res.late,
        "p50_ms": res.p50_ms,
        "p90_ms": res.p90_ms,
        "p99_ms": res.p99_ms,
        "p999_ms": res.p999_ms,
        "miss_rate": res.miss_rate,
        "goodput_rps": res.goodput_rps,
    })
    .to_string())
}

/// A worker's handle on a shared-memory pool it allocates from.
#[pyclass(frozen)]
struct Pool {
    inner: ShmPool,
}

#[pymethods]
impl Pool {
    /// Create a new pool file (the node does this; tests use it too).
    #[staticmethod]
    fn create(path: PathBuf, id: u32, capacity: usize) -> PyResult<Pool> {
        ShmPool::create(&path, id, capacity).map(|inner| Pool { inner }).map_err(|e| core_err(e.kind(), e))
    }

    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Pool> {
        ShmPool::open(&path).map(|inner| Pool { inner }).map_err(|e| core_err(e.kind(), e))
    }

    /// Reserve `nbytes`; returns the block's byte offset in the pool file.
    fn alloc(&self, nbytes: usize) -> PyResult<u64> {
        self.inner.alloc(nbytes).map_err(|e| core_err(e.kind(), e))
    }

    /// Release a block (used when a batch fails after allocating).
    fn free(&self, offset: u64, nbytes: usize) {
        self.inner.free(offset, nbytes)
    }

    #[getter]
    fn id(&self) -> u32 {
        self.inner.id()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn used_bytes(&self) -> usize {
        self.inner.used_pages() * self.inner.page_size()
    }

    /// Remove the pool file (mappings stay valid).
    fn unlink(&self) -> PyResult<()> {
        self.inner.unlink().map_err(|e| core_err(e.kind(), e))
    }
}

/// Make a cluster CA in `dir` (`ca.crt`, `ca.key`); the files written.
#[pyfunction]
fn tls_make_ca(dir: PathBuf, days: u32) -> PyResult<Vec<PathBuf>> {
    slipstream_tls::make_ca(&dir, days).map_err(|e| core_err("invalid_option", e))
}

/// Issue a certificate for `names` with the CA in `ca_dir` into `out`; the
/// files written and the last day it is valid.
#[pyfunction]
fn tls_issue(ca_dir: PathBuf, out: PathBuf, names: Vec<String>, days: u32) -> PyResult<(Vec<PathBuf>, String)> {
    let issued = slipstream_tls::issue(&ca_dir, &out, &names, days).map_err(|e| core_err("invalid_option", e))?;
    Ok((issued.files, issued.not_after))
}

/// Load a node's TLS directory as the node named `name` will: Ok, or why not.
#[pyfunction]
fn tls_check(dir: PathBuf, name: &str) -> PyResult<()> {
    slipstream_tls::NodeTls::load(&dir).and_then(|t| t.check_own_name(name)).map_err(|e| core_err("invalid_option", e))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(tls_make_ca, m)?)?;
    m.add_function(wrap_pyfunction!(tls_issue, m)?)?;
    m.add_function(wrap_pyfunction!(tls_check, m)?)?;
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(node_settings, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(run_bench, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_class::<Pool>()?;
    m.add("CoreError", m.py().get_type::<CoreError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
