//! The Slipstream node as it runs: the composition root that installs
//! every feature on the core, and the edge that serves it.
//!
//! - [`compose`]: the one place that names every feature (prediction
//!   cache, model selection, autoscaler, store triggers, history, cluster);
//! - [`lifecycle`]: start-up, serving and graceful shutdown;
//! - the edge: [`conn`] (which protocol a connection speaks), [`http`] (routes), [`grpc`] (the Open Inference Protocol
//!   over gRPC), [`stream`] (server-sent events), [`store_http`] (the
//!   object store's routes), [`triton`] (Triton's configuration and
//!   statistics extensions), over one plumbing module ([`respond`]: bodies,
//!   responses, errors) and one decoder of query strings and paths
//!   ([`query`]); [`app`]: what the edge serves from, and the node's
//!   settings; [`access`]: the admin and API tokens; [`logging`]: the log.
//!
//! The request path itself is `slipstream-core`'s: every entry point calls
//! `Node::accept` and `Node::answer`.

mod access;
mod app;
mod compose;
mod conn;
mod grpc;
mod http;
mod lifecycle;
mod logging;
mod pacing;
mod query;
mod respond;
mod store_http;
mod stream;
mod triton;

pub use access::Access;
pub use app::{EdgeOptions, LogFormat, RunOptions};
pub use lifecycle::{run, run_blocking, RunError};
pub use slipstream_cluster::ClusterOptions;
pub use slipstream_core::config::{settings, NodeConfig};
pub use slipstream_core::AppSpec;
