//! Refusals that do not turn into storms.
//!
//! A 429 is cheap, but a closed-loop client that comes straight back turns
//! each one into another request: with 128 such clients the node answered
//! 33,000 refusals a second and served 300 requests, because refusing (and
//! the client's own resending) took the CPU the workers needed. `Retry-After`
//! only helps clients that read it, so the edge remembers, per connection,
//! until when it told the client to wait. A refusal on a connection in good
//! standing (the first, or one after the client waited as told, and at
//! least 20 ms) is answered at once; a refusal on a connection that came
//! back early is *held*: its answer waits for a slot of a node-wide refusal
//! rate ([`RefusalPacer`], a GCRA schedule: one slot every `1/rate` s, a
//! connection waits at most [`MAX_HOLD`]). Holding costs a parked future, not
//! CPU, and it turns a client that ignores `Retry-After` into one that waits
//! anyway: the population that ignores it is paced to the refusal rate
//! however large it is, and the CPU goes to the requests that are admitted.
//! (Google SRE's "Handling Overload" makes the same point from the client
//! side; Breakwater holds excess demand off the server with credits; here
//! the connection is the credit.)
//!
//! gRPC connections carry many calls at once; the memory is per connection
//! there too (a multiplexing client is one client).

use parking_lot::Mutex;
use slipstream_core::ext::{Service, StatusDoc};
use slipstream_core::prom::PromText;
use slipstream_core::NodeError;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The longest a refusal is held.
pub(crate) const MAX_HOLD: Duration = Duration::from_secs(1);
/// How long a connection is remembered as refused: a refusal within this
/// of the last one's answer (or within the `Retry-After` it was given, if
/// longer) is held. Long enough to catch a client that resends at once
/// however busy the machine; short enough that a pooled client sending
/// other users' requests on the connection stays in good standing (at
/// 250 ms, a pool offered 4x an off-CPU pipeline's capacity, honouring
/// `Retry-After`, was held behind its own connections and kept 39% of the
/// peak goodput; at 20 ms, 94%: bench/results/overload.md).
const MEMORY: Duration = Duration::from_millis(20);

/// The node-wide schedule of held refusals, and its counts.
#[derive(Debug)]
pub(crate) struct RefusalPacer {
    epoch: Instant,
    /// Held refusals answered a second (0: never hold).
    rate: u32,
    max_hold_ns: u64,
    /// When the next held refusal may be answered, ns since `epoch`.
    next_ns: Mutex<u64>,
    held: AtomicU64,
    held_ns: AtomicU64,
}

/// What one connection was told: a refusal before `told_until_ns` (ns since
/// the pacer's epoch) came back early and is held; each refusal moves it.
#[derive(Debug, Default)]
pub(crate) struct ConnMemory {
    told_until_ns: AtomicU64,
}

impl RefusalPacer {
    /// `rate`: held refusals answered a second (0: answer every refusal at once).
    pub(crate) fn new(rate: u32, max_hold: Duration) -> RefusalPacer {
        RefusalPacer {
            epoch: Instant::now(),
            rate,
            max_hold_ns: max_hold.as_nanos() as u64,
            next_ns: Mutex::new(0),
            held: AtomicU64::new(0),
            held_ns: AtomicU64::new(0),
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// How long to hold a refusal `e` on connection `conn` before answering
    /// it: None for errors other than a 429 and for a connection in good
    /// standing, else the wait for its slot on the schedule (zero when the
    /// schedule is free). Remembers what the connection is told.
    pub(crate) fn hold_for(&self, conn: &ConnMemory, e: &NodeError) -> Option<Duration> {
        if !matches!(e, NodeError::Overloaded { .. }) {
            return None;
        }
        let now = self.now_ns();
        let told_ns = e.retry_after_ms().unwrap_or(1) * 1_000_000;
        let early = now < conn.told_until_ns.load(Relaxed);
        let wait_ns = if early { self.slot(now) } else { 0 };
        // Remembered from when the client gets the answer, for at least
        // MEMORY: a refusal says "a few ms" when the queue is short, and a
        // busy client takes that long to come back anyway.
        conn.told_until_ns.store(now + wait_ns + told_ns.max(MEMORY.as_nanos() as u64), Relaxed);
        if wait_ns > 0 {
            self.held.fetch_add(1, Relaxed);
            self.held_ns.fetch_add(wait_ns, Relaxed);
        }
        early.then(|| Duration::from_nanos(wait_ns))
    }

    /// The next slot of the held refusals' schedule, as a wait from `now`.
    fn slot(&self, now: u64) -> u64 {
        let Some(interval_ns) = 1_000_000_000u64.checked_div(u64::from(self.rate)) else { return 0 };
        let mut next = self.next_ns.lock();
        let at = (*next).max(now).min(now + self.max_hold_ns);
        *next = at + interval_ns;
        at - now
    }

    /// Hold a refusal as [`Self::hold_for`] says, then hand it back.
    pub(crate) async fn pace(&self, conn: &ConnMemory, e: NodeError) -> NodeError {
        if let Some(wait) = self.hold_for(conn, &e).filter(|w| !w.is_zero()) {
            tokio::time::sleep(wait).await;
        }
        e
    }
}

impl Service for RefusalPacer {
    fn status(&self, doc: &mut StatusDoc) {
        doc.set(
            &["overload"],
            serde_json::json!({
                "held_refusals": self.held.load(Relaxed),
                "held_refusal_seconds": self.held_ns.load(Relaxed) as f64 / 1e9,
                "refusal_rate": self.rate,
            }),
        );
    }

    fn metrics(&self, out: &mut PromText) {
        out.counter(
            "slipstream_refusals_held_total",
            "Refusals answered late because the connection came back before its Retry-After.",
            &[],
            self.held.load(Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overloaded(over_ms: u64) -> NodeError {
        NodeError::Overloaded { budget_ms: 10, over_ms }
    }

    #[test]
    fn a_connection_in_good_standing_is_answered_at_once() {
        let p = RefusalPacer::new(1000, MAX_HOLD);
        let (a, b) = (ConnMemory::default(), ConnMemory::default());
        assert_eq!(p.hold_for(&a, &overloaded(50)), None);
        assert_eq!(p.hold_for(&b, &overloaded(50)), None, "another connection is another client");
        assert_eq!(p.hold_for(&a, &NodeError::Cancelled), None, "only 429s are held");
    }

    #[test]
    fn coming_back_early_is_held_on_the_node_wide_schedule() {
        let p = RefusalPacer::new(1000, MAX_HOLD);
        let conns: Vec<ConnMemory> = (0..10).map(|_| ConnMemory::default()).collect();
        conns.iter().for_each(|c| assert_eq!(p.hold_for(c, &overloaded(50)), None));
        // Each came back at once: held one millisecond apart, in turn.
        let waits: Vec<Duration> = conns.iter().map(|c| p.hold_for(c, &overloaded(50)).expect("held")).collect();
        for w in waits.windows(2) {
            let gap = w[1].saturating_sub(w[0]);
            assert!(gap > Duration::from_micros(900) && gap <= Duration::from_millis(1), "{waits:?}");
        }
        // The schedule was idle: the first came back to a free slot.
        assert_eq!(waits[0], Duration::ZERO);
        assert_eq!(p.held.load(Relaxed), 9);
    }

    #[test]
    fn a_hold_never_exceeds_the_limit_and_rate_zero_never_holds() {
        let p = RefusalPacer::new(10, Duration::from_millis(200));
        let c = ConnMemory::default();
        p.hold_for(&c, &overloaded(1000));
        for _ in 0..20 {
            assert!(p.hold_for(&c, &overloaded(1000)).expect("held") <= Duration::from_millis(200));
        }
        let off = RefusalPacer::new(0, MAX_HOLD);
        off.hold_for(&c, &overloaded(1000));
        assert_eq!(off.hold_for(&c, &overloaded(1000)), Some(Duration::ZERO));
    }

    #[test]
    fn a_client_that_waited_as_told_is_in_good_standing_again() {
        let p = RefusalPacer::new(1000, MAX_HOLD);
        let c = ConnMemory::default();
        assert_eq!(p.hold_for(&c, &overloaded(1)), None);
        // Told 1 ms, but remembered for MEMORY: coming back after 3 ms is early.
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(p.hold_for(&c, &overloaded(1)), Some(Duration::ZERO), "held, on a free schedule");
        std::thread::sleep(MEMORY + Duration::from_millis(10));
        assert_eq!(p.hold_for(&c, &overloaded(1)), None);
        // A Retry-After longer than MEMORY is what counts.
        let d = ConnMemory::default();
        p.hold_for(&d, &overloaded(MEMORY.as_millis() as u64 + 200));
        std::thread::sleep(MEMORY + Duration::from_millis(10));
        assert!(p.hold_for(&d, &overloaded(1)).is_some());
    }
}
