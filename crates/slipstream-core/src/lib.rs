//! The Slipstream node's core: the request path, and the extension points
//! features plug into. It knows no feature.
//!
//! A request's life: an entry point (HTTP, gRPC, a store trigger, another
//! node) calls [`Node::accept`] (admission before decoding, then the
//! body's tensors written once into shared memory) and [`Node::answer`]: the
//! request walks its pipeline's DAG ([`request`]), queued by deadline on
//! one replica per stage chosen at ingress ([`pipeline`]); each replica's
//! task ([`drive`]) forms batches and runs them on its [`drive::Backend`]
//! (a worker process here, [`worker`], or another node); the answer is
//! encoded straight from shared memory ([`codec`]).
//!
//! - [`spec`], [`config`]: the app as the front end describes it; the
//!   node's settings, each declared once;
//! - [`arena`], [`codec`]: shared-memory pools and tensors; request and
//!   response bodies;
//! - [`pipeline`], [`replica`]: stages and replica sets, routing and
//!   admission; a replica's state, with one owner, and its queue of
//!   [`replica::Job`]s;
//! - `request`, [`join`]: a request's walk through its DAG and the guard
//!   that settles it once; joins over candidate stages;
//! - [`drive`], [`worker`]: the task that drives a replica over its
//!   backend; the worker process, the backend of a local replica;
//! - [`node`], [`scaling`]: the facade every entry point calls; the one
//!   owner of replica sets;
//! - [`error`], [`events`], [`metrics`], [`prom`], [`report`]: error
//!   kinds; the event log; counters and histograms; status and Prometheus;
//! - [`ext`]: the extension points (stage hooks, services; joins are
//!   [`join`]'s, launchers [`drive`]'s); [`gpu`]: this machine's GPUs and
//!   which replica gets which.
//!
//! Dependencies inside the crate point one way (`make lint` checks it),
//! from the facade down: `node` (with `scaling` and `report`) uses
//! `request`, `worker` and `drive`; `request` and `drive` use `pipeline`;
//! `pipeline` uses `replica`, `join` and `ext`; all of them use the leaves
//! (`arena`, `codec`, `metrics`, `prom`, `events`, `spec`, `config`,
//! `error`, `gpu`).
#![warn(unreachable_pub, missing_docs)]

pub mod arena;
pub mod codec;
pub mod config;
pub mod drive;
pub mod error;
pub mod events;
pub mod ext;
pub mod gpu;
pub mod join;
pub mod metrics;
pub mod node;
pub mod pipeline;
pub mod prom;
pub mod replica;
mod report;
mod request;
#[cfg(test)]
mod request_tests;
pub mod scaling;
pub mod spec;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod worker;

pub use config::{NodeConfig, NodeOptions};
pub use error::NodeError;
pub use node::{Accepted, Answer, Arrival, Node, NodeParts};
pub use pipeline::{PipelineRt, StageRt};
pub use request::{Chunks, Request};
pub use spec::AppSpec;
