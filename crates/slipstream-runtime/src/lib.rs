//! The Slipstream node: one process per machine that serves pipelines.
//!
//! - [`spec`]: the application description handed over by the Python front end;
//! - [`config`]: the node's settings, each declared once (defaults, help, checks);
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
//!   [`stream`]: streamed answers (server-sent events);
//! - [`grpc`]: the Open Inference Protocol over gRPC (its own port), and errors as gRPC codes;
//! - [`metrics`], [`report`]: counters and histograms; status and Prometheus text;
//! - [`events`]: recent replica lifecycle events;
//! - [`history`]: the last ten minutes, second by second, and the dashboard page;
//! - [`store_http`]: the object store's routes; [`triggers`]: puts that invoke pipelines;
//! - [`cluster`]: membership and placement on etcd, and the data plane between nodes.
//! - [`gpu`]: this machine's GPUs (`nvidia-smi -L`) and the one each replica of a GPU stage gets.

pub mod arena;
pub mod autoscale;
pub mod cache;
pub mod cluster;
pub mod codec;
pub mod config;
pub mod error;
pub mod events;
pub mod gpu;
pub mod grpc;
pub mod history;
pub mod http;
pub mod lifecycle;
pub mod metrics;
pub mod node;
pub mod pipeline;
pub mod replica;
pub mod report;
pub mod request;
pub mod select;
pub mod spec;
pub mod store_http;
pub mod stream;
pub mod triggers;

pub use config::NodeConfig;
pub use error::NodeError;
pub use lifecycle::{run, run_blocking, RunError};
pub use node::NodeOptions;
pub use spec::AppSpec;
