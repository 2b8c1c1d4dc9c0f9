//! `slipstream._core`: the compiled core, as a thin PyO3 boundary.
//!
//! Three things cross it: `serve` (run a node until SIGINT/SIGTERM, with the
//! GIL released), `bench` (the open-loop load generator), and `Pool` (a
//! worker's handle on its shared-memory pool, for allocating output blocks).
//! Arguments arrive as JSON strings or plain scalars so that the Python side
//! owns all user-facing validation and messages; errors come back as
//! `CoreError(kind, message)`.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use slipstream_runtime::{AppSpec, NodeOptions};
use slipstream_shm::Pool as ShmPool;
use std::path::PathBuf;
use std::time::Duration;

create_exception!(_core, CoreError, PyRuntimeError, "An error from the compiled core: args are (kind, message).");

fn core_err(kind: &str, message: impl ToString) -> PyErr {
    CoreError::new_err((kind.to_string(), message.to_string()))
}

/// Serve the app described by `spec_json` until SIGINT/SIGTERM.
#[pyfunction]
#[pyo3(signature = (spec_json, host="127.0.0.1", port=8000, threads=0, max_body_bytes=0, request_timeout_s=0.0, drain_timeout_s=0.0, worker_start_timeout_s=0.0, pool_mb=0, log=true))]
#[allow(clippy::too_many_arguments)]
fn serve(
    py: Python<'_>,
    spec_json: &str,
    host: &str,
    port: u16,
    threads: usize,
    max_body_bytes: usize,
    request_timeout_s: f64,
    drain_timeout_s: f64,
    worker_start_timeout_s: f64,
    pool_mb: usize,
    log: bool,
) -> PyResult<()> {
    let spec: AppSpec = serde_json::from_str(spec_json).map_err(|e| core_err("invalid_spec", e))?;
    let mut opts = NodeOptions { host: host.to_string(), port, log, ..NodeOptions::default() };
    if threads > 0 {
        opts.threads = threads;
    }
    if max_body_bytes > 0 {
        opts.max_body_bytes = max_body_bytes;
    }
    if request_timeout_s > 0.0 {
        opts.request_timeout = Duration::from_secs_f64(request_timeout_s);
    }
    if drain_timeout_s > 0.0 {
        opts.drain_timeout = Duration::from_secs_f64(drain_timeout_s);
    }
    if worker_start_timeout_s > 0.0 {
        opts.worker_start_timeout = Duration::from_secs_f64(worker_start_timeout_s);
    }
    if pool_mb > 0 {
        opts.replica_pool_bytes = pool_mb << 20;
        opts.ingress_pool_bytes = (pool_mb << 20).max(opts.ingress_pool_bytes);
    }
    py.detach(|| slipstream_runtime::run_blocking(spec, opts, |_| {})).map_err(|e| core_err(e.kind(), e))
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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(run_bench, m)?)?;
    m.add_class::<Pool>()?;
    m.add("CoreError", m.py().get_type::<CoreError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
