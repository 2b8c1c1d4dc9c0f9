//! The Slipstream node: one process per machine that serves pipelines.
//!
//! - [`spec`]: the application description handed over by the Python front end;
//! - [`codec`]: tensors in and out of HTTP bodies (pipeline API and KServe v2);
//! - [`arena`]: shared-memory pools, tensor references, copy accounting;
//! - [`pipeline`]: stages and their replica sets, routing, admission;
//! - [`request`]: a request's walk through the DAG, and the guard that
//!   settles it in the pipeline's books exactly once;
//! - [`replica`]: a replica's scheduling state with its one owner; the task
//!   that drives its worker ([`replica::task`]) and the worker process
//!   ([`replica::worker`]);
//! - [`node`]: the node's state and request path (admit, infer, answer), scaling;
//! - [`autoscale`]: replica counts that follow the load trend, with warm standbys;
//! - [`lifecycle`]: start-up, serving and graceful shutdown;
//! - [`http`]: routes, admin authorisation and the error-to-status mapping;
//! - [`metrics`], [`report`]: counters and histograms; status and Prometheus text;
//! - [`events`]: recent replica lifecycle events;
//! - [`store_http`]: the object store's routes; [`triggers`]: puts that invoke pipelines;
//! - [`cluster`]: membership and placement on etcd, and the data plane between nodes.

pub mod arena;
pub mod autoscale;
pub mod cluster;
pub mod codec;
pub mod error;
pub mod events;
pub mod http;
pub mod lifecycle;
pub mod metrics;
pub mod node;
pub mod pipeline;
pub mod replica;
pub mod report;
pub mod request;
pub mod spec;
pub mod store_http;
pub mod triggers;

pub use error::NodeError;
pub use lifecycle::{run, run_blocking, RunError};
pub use node::NodeOptions;
pub use spec::AppSpec;
