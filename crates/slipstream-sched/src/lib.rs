//! Scheduling policy as plain data structures: no I/O, no runtime, no clock
//! of their own. Time enters as `u64` nanoseconds from whatever clock the
//! caller owns, so every decision here is unit-testable with a fake clock.
//!
//! What lives here today:
//! - [`EdfQueue`]: a stage replica's queue, ordered by deadline (earliest
//!   first), FIFO among equal deadlines.
//! - [`take_batch`]: opportunistic batching: when a replica frees up, take
//!   what is waiting, most urgent first, up to the component's max batch.
//! - [`choose_replica`]: the ingress router's choice for one stage:
//!   join-shortest-queue among healthy replicas.

mod queue;
mod router;

pub use queue::{take_batch, EdfQueue};
pub use router::{choose_replica, ReplicaLoad};
