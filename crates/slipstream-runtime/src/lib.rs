//! The Slipstream node: one process per machine that serves pipelines.
//!
//! - [`spec`]: the application description handed over by the Python front end;
//! - [`codec`]: tensors in and out of HTTP bodies (pipeline API and KServe v2);
//! - [`arena`]: shared-memory pools, tensor references, copy accounting;
//! - [`pipeline`]: stages, replica queues, and a request's walk through the DAG;
//! - [`replica`]: one task per worker replica: batching, dispatch, supervision;
//! - [`http`]: routes and the error-to-status mapping;
//! - [`metrics`]: counters, histograms, Prometheus text;
//! - [`node`]: start-up, serving and graceful shutdown.

pub mod arena;
pub mod codec;
pub mod error;
pub mod http;
pub mod metrics;
pub mod node;
pub mod pipeline;
pub mod replica;
pub mod spec;

pub use error::NodeError;
pub use node::{run, run_blocking, NodeOptions, RunError};
pub use spec::AppSpec;
