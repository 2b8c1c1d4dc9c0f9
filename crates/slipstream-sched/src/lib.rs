//! Scheduling policy as plain data structures: no I/O, no runtime, no clock
//! of their own. Time enters as `u64` nanoseconds from whatever clock the
//! caller owns, so every decision here is unit-testable with a fake clock.
//!
//! - [`EdfQueue`]: a stage replica's queue, ordered by deadline (earliest
//!   first), FIFO among equal deadlines.
//! - [`LatencyProfile`]: a component's latency as a function of batch size,
//!   from measurements, refined online.
//! - [`BatchFormer`]: deadline-aware batch sizing, delayed batching, expiry
//!   and AIMD; or the fixed max-batch + timeout baseline. (With no profile
//!   and no deadline pressure it degenerates to opportunistic batching: take
//!   what is queued, up to the limit.)
//! - [`LengthModel`]: for variable-length inputs, batches of similar
//!   length, bounded by their padded length, with latency predicted from it.
//! - [`AdmissionGate`]: how much of a request's budget its predicted finish
//!   may use, learned from admitted requests' outcomes.
//! - [`ReplicaLoad`], [`Dag`]: the predictors: a replica's backlog from its
//!   published load, a request's time in the pipeline along its route.
//! - [`take_batch`]: the batch step (queue + former -> batch, expired, wait).
//! - [`choose_replica`]: the ingress router's choice for one stage:
//!   join-shortest-queue among accepting replicas.
//! - [`simulate`]: the SLO contract's queueing model: the same predictors,
//!   batch step, admission step and router as the node, driven by a
//!   discrete-event simulation over the measured profiles.
//! - [`scale`]: the autoscaler's policy (load trend, capacity, the replica
//!   counts a stage should serve with).
//! - [`placement`]: where a cluster's replicas run (a balanced placement
//!   that moves little when nodes come and go).

mod admission;
mod former;
mod length;
pub mod placement;
mod predict;
mod profile;
mod queue;
mod router;
pub mod scale;
mod sim;

pub use admission::{AdmissionGate, Priority, MIN_HEADROOM};
pub use former::{take_batch, BatchDecision, BatchFormer, BatchPolicy, Taken};
pub use length::{Length, LengthModel};
pub use predict::{found_queue, Dag, Prediction, ReplicaLoad};
pub use profile::LatencyProfile;
pub use queue::EdfQueue;
pub use router::choose_replica;
pub use sim::{simulate, SimConfig, SimResult, SimStage};
