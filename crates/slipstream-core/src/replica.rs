//! A stage replica: its scheduling state, with one owner.
//!
//! Everything the scheduler knows about a replica (its lifecycle phase, its
//! EDF queue, its batch former with profile and AIMD limit, the batch in
//! flight, the recent queue wait) lives in one private struct behind one
//! lock, changed only by the methods of [`Replica`]. Each method leaves the
//! state consistent and publishes a fresh [`ReplicaLoad`] snapshot, which
//! routing and admission read without the lock. Counts such as "requests
//! outstanding" are derived from the state (queued + running), never kept
//! balanced by hand at call sites.
//!
//! Lifecycle ([`Phase`]):
//!
//! ```text
//!   Starting --worker ready--> Ready --worker died--> Down --restarted--> Ready
//!      |    \                   |                      |
//!      |     +--(standby)--> Standby --promote()--> Ready
//!      |                         |                      |
//!      +-------------------------+---- drain() ---------+--> Draining --> Stopped
//! ```
//!
//! A replica started as a standby (the autoscaler's anticipatory
//! preloading) constructs its component and runs its warm-up batch like any
//! other, then waits in `Standby`, warm, until it is promoted; a standby
//! whose worker dies comes back as a standby. Only a `Ready` replica
//! accepts new work from routing. A `Starting` or
//! `Down` replica still takes requests when its stage has nowhere better to
//! put them (they wait for the worker); a `Draining` one takes nothing new
//! and finishes its queue; a `Stopped` one is gone.
//!
//! What a replica queues is a [`Job`]: a request as its queue and its task
//! see it (its deadline, its inputs to the stage, where its outputs go),
//! so that this module knows nothing of the request's walk through its
//! DAG. The task that drives a replica is [`crate::drive`]'s; what runs
//! its batches is a [`crate::drive::Backend`].

use crate::arena::Tensors;
use crate::error::NodeError;
use parking_lot::Mutex;
use slipstream_sched::{take_batch, BatchFormer, EdfQueue, Length, ReplicaLoad, Taken};
use slipstream_shm::Pool;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Notify;

/// Where a replica is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Its worker is being started (and warmed up).
    Starting = 0,
    /// Its worker serves; routing sends it work.
    Ready = 1,
    /// Its worker died; it is being restarted.
    Down = 2,
    /// Being removed: takes no new work, finishes its queue, then stops.
    Draining = 3,
    /// Gone.
    Stopped = 4,
    /// Warm (component constructed, warm-up batch run) and held back from
    /// routing until promoted.
    Standby = 5,
}

impl Phase {
    fn from_u8(v: u8) -> Phase {
        match v {
            0 => Phase::Starting,
            1 => Phase::Ready,
            2 => Phase::Down,
            3 => Phase::Draining,
            5 => Phase::Standby,
            _ => Phase::Stopped,
        }
    }

    /// Its name in status and events.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Ready => "ready",
            Phase::Down => "down",
            Phase::Draining => "draining",
            Phase::Stopped => "stopped",
            Phase::Standby => "standby",
        }
    }

    /// Whether the replica will serve what it is given (now, after a
    /// restart, or once promoted).
    pub fn will_serve(self) -> bool {
        matches!(self, Phase::Starting | Phase::Ready | Phase::Down | Phase::Standby)
    }
}

/// A request as a replica's queue and task see it: one stage's work.
pub trait Job: Send + Sync {
    /// The request's id (unique in the node; routing's tie-breaker).
    fn id(&self) -> u64;
    /// When it is due.
    fn deadline(&self) -> Instant;
    /// When it is due, in ns since its pipeline's epoch (the queues' key).
    fn deadline_ns(&self) -> u64;
    /// Whether its work at stage `stage` is no longer needed (it finished,
    /// or a join answered without this candidate): skipped if queued.
    fn skips(&self, stage: usize) -> bool;
    /// Its inputs to stage `stage`.
    fn inputs(&self, stage: usize) -> Result<Tensors, NodeError>;
    /// Its size at stage `stage`, for a stage that batches by length (None
    /// otherwise, or when its length input is missing or malformed).
    fn length(&self, stage: usize) -> Option<Length>;
    /// Stage `stage` answered it: its request moves on.
    fn finish(self: Arc<Self>, stage: usize, outputs: Tensors);
    /// Stage `stage` failed for it.
    fn fail_stage(self: Arc<Self>, stage: usize, err: NodeError);
    /// Finish its whole request with `err` (the first finish wins).
    fn fail(&self, err: NodeError);
    /// A streaming component's chunk of its outputs at stage `stage`.
    fn chunk(&self, stage: usize, outputs: Tensors);
    /// Whether its chunks at stage `stage` go anywhere (a backend that
    /// forwards them asks, so as not to carry chunks nobody reads).
    fn wants_chunks(&self, stage: usize) -> bool;
    /// The memo of stage `stage`'s hook, if its lookup missed.
    fn memo(&self, stage: usize) -> Option<u128>;
    /// Mark its work at stage `stage` retried after the executor running it
    /// was lost: false if it already was (each stage's work is retried
    /// once; parallel branches lost together, to one node's loss, are each
    /// retried).
    fn mark_retried(&self, stage: usize) -> bool;
    /// The stages after `stage` that other nodes can run in turn, each
    /// handing the request straight to the next, without this node (see
    /// [`crate::request::Request::chain_after`]), with the replica routed
    /// for each: empty when stage `stage`'s answer must come back here.
    fn chain_after(&self, stage: usize) -> Vec<(usize, Arc<Replica>)>;
    /// A chain of stages (the one it was handed on from first, then stages
    /// of its [`Job::chain_after`], in order) finished elsewhere:
    /// `outputs` are the last one's, and the request moves on from there.
    fn finish_chain(self: Arc<Self>, stages: &[usize], outputs: Tensors);
    /// Run stage `stage` for it again, from its inputs here (a chain it
    /// was handed on along was lost with a node): its outputs were never
    /// settled here. A no-op once it has finished.
    fn rerun(self: Arc<Self>, stage: usize);
    /// Its executor handed it on from stage `stage` to the stages after it
    /// ([`Job::chain_after`]): what it waits for now, when asked.
    fn handed_on(&self, stage: usize);
}

/// One queued unit of work: a request waiting for this replica.
pub struct Work {
    /// The request.
    pub req: Arc<dyn Job>,
    /// When it was queued here.
    pub enqueued: Instant,
    /// Its size here, for a stage that batches by length (computed when it
    /// is queued, before the replica's lock is taken).
    pub length: Option<Length>,
}

struct State {
    phase: Phase,
    /// Held back from routing once warm (until promoted).
    standby: bool,
    queue: EdfQueue<Work>,
    former: BatchFormer,
    /// The batch in flight: (size, expected end in ns since the epoch).
    running: Option<(usize, u64)>,
    /// Recent queue wait of dispatched requests (moving average), ns.
    wait_ns: u64,
    last_batch: usize,
}

/// The published snapshot: plain atomics, written only by the owner (under
/// its lock), read by anyone. Fields may be a moment apart from each other;
/// every reader uses them as estimates.
#[derive(Default)]
struct LoadCell {
    accepting: AtomicBool,
    outstanding: AtomicU32,
    queued: AtomicU32,
    busy_until_ns: AtomicU64,
    queue_ns: AtomicU64,
    wait_ns: AtomicU64,
    single_ns: AtomicU64,
    typical_ns: AtomicU64,
}

impl LoadCell {
    fn store(&self, l: &ReplicaLoad) {
        self.accepting.store(l.accepting, Relaxed);
        self.outstanding.store(l.outstanding, Relaxed);
        self.queued.store(l.queued, Relaxed);
        self.busy_until_ns.store(l.busy_until_ns, Relaxed);
        self.queue_ns.store(l.queue_ns, Relaxed);
        self.wait_ns.store(l.wait_ns, Relaxed);
        self.single_ns.store(l.single_ns, Relaxed);
        self.typical_ns.store(l.typical_ns, Relaxed);
    }

    /// Store only the fields [`ReplicaLoad::set_queue`] changes.
    fn store_queue(&self, l: &ReplicaLoad) {
        self.outstanding.store(l.outstanding, Relaxed);
        self.queued.store(l.queued, Relaxed);
        self.busy_until_ns.store(l.busy_until_ns, Relaxed);
        self.queue_ns.store(l.queue_ns, Relaxed);
    }

    fn load(&self) -> ReplicaLoad {
        ReplicaLoad {
            accepting: self.accepting.load(Relaxed),
            outstanding: self.outstanding.load(Relaxed),
            queued: self.queued.load(Relaxed),
            busy_until_ns: self.busy_until_ns.load(Relaxed),
            queue_ns: self.queue_ns.load(Relaxed),
            wait_ns: self.wait_ns.load(Relaxed),
            single_ns: self.single_ns.load(Relaxed),
            typical_ns: self.typical_ns.load(Relaxed),
        }
    }
}

/// What [`Replica::take_batch`] handed the replica task.
pub type Step = Taken<Work>;

/// A replica that runs on another node of the cluster: this node keeps its
/// queue (EDF, batching) and sends each batch over the data plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteAt {
    /// The node's name in the cluster.
    pub node: String,
    /// Its data-plane address.
    pub addr: std::net::SocketAddr,
}

/// [`Replica::device`]'s "none".
const NO_DEVICE: u32 = u32::MAX;

/// A worker replica of a stage, as the scheduler sees it.
pub struct Replica {
    /// Unique within its stage for the node's lifetime (names the worker).
    pub id: u32,
    /// Its stage's place in the pipeline.
    stage: usize,
    /// The place in this machine's device list its worker was last
    /// started on ([`NO_DEVICE`]: none, or not started yet).
    device: AtomicU32,
    /// Its former has a length model: queued requests are measured.
    batches_by_length: bool,
    /// The pool its worker allocates outputs in (for a remote replica: the
    /// ingress pool, where the replies are received).
    pub pool: Arc<Pool>,
    /// Set for a replica on another node (see [`RemoteAt`]).
    pub remote: Option<RemoteAt>,
    /// The cluster placed it elsewhere: it serves until it drains (a
    /// moment later), and no longer counts towards this node's share.
    leaving: AtomicBool,
    /// For a remote replica: requests other nodes have queued at it, as its
    /// node last reported (counted as queued here, so that routing and
    /// admission see the whole queue, not only this node's part of it).
    backlog: AtomicU32,
    /// Reference instant of the pipeline's ns clock.
    epoch: Instant,
    state: Mutex<State>,
    load: LoadCell,
    phase: AtomicU8,
    pid: AtomicU32,
    /// Wakes the replica task: new work, or a phase change it must act on.
    wake: Notify,
}

impl Replica {
    /// A new replica, starting; with `standby` it waits warm, outside
    /// routing, once its worker is ready (see [`Replica::promote`]).
    pub fn new(id: u32, stage: usize, pool: Arc<Pool>, former: BatchFormer, epoch: Instant, standby: bool) -> Replica {
        let r = Replica {
            id,
            stage,
            device: AtomicU32::new(NO_DEVICE),
            batches_by_length: former.length.is_some(),
            pool,
            remote: None,
            leaving: AtomicBool::new(false),
            backlog: AtomicU32::new(0),
            epoch,
            state: Mutex::new(State {
                phase: Phase::Starting,
                standby,
                queue: EdfQueue::new(),
                former,
                running: None,
                wait_ns: 0,
                last_batch: 1,
            }),
            load: LoadCell::default(),
            phase: AtomicU8::new(Phase::Starting as u8),
            pid: AtomicU32::new(0),
            wake: Notify::new(),
        };
        r.publish(&r.state.lock());
        r
    }

    /// Its worker was started on device `index` of this machine's list.
    pub fn set_device(&self, index: Option<usize>) {
        self.device.store(index.map_or(NO_DEVICE, |i| i.min(NO_DEVICE as usize - 1) as u32), Relaxed);
    }

    /// The device its worker was last started on, if any.
    pub fn device(&self) -> Option<usize> {
        let d = self.device.load(Relaxed);
        (d != NO_DEVICE).then_some(d as usize)
    }

    /// The same replica, standing for one on another node.
    pub fn on_node(mut self, at: RemoteAt) -> Replica {
        self.remote = Some(at);
        self
    }

    /// A remote replica's node reported `n` requests queued or running
    /// there besides this node's (a load report with each answer).
    pub fn set_backlog(&self, n: u32) {
        if self.backlog.swap(n, Relaxed) != n {
            self.publish_queue(&self.state.lock());
        }
    }

    /// The cluster placed it elsewhere: it serves a grace period, then drains.
    pub fn mark_leaving(&self) {
        self.leaving.store(true, Relaxed);
    }

    /// Whether the cluster placed it elsewhere.
    pub fn leaving(&self) -> bool {
        self.leaving.load(Relaxed)
    }

    /// Runs on this node (it has a worker process here).
    pub fn is_local(&self) -> bool {
        self.remote.is_none()
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The last published load (no lock).
    pub fn load(&self) -> ReplicaLoad {
        self.load.load()
    }

    /// Where it is in its life.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Relaxed))
    }

    /// Pid of the current worker process (0 while none).
    pub fn pid(&self) -> u32 {
        self.pid.load(Relaxed)
    }

    /// The current AIMD batch limit.
    pub fn batch_limit(&self) -> u32 {
        self.state.lock().former.limit
    }

    /// A copy of the batch former (profile and limit as learned so far), to
    /// seed a new replica of the same stage.
    pub fn former(&self) -> BatchFormer {
        self.state.lock().former.clone()
    }

    /// Wait for new work or a phase change.
    pub fn woken(&self) -> tokio::sync::futures::Notified<'_> {
        self.wake.notified()
    }

    /// Publish the whole load (after a phase change or a finished batch).
    fn publish(&self, st: &State) {
        let load = ReplicaLoad::of(
            &st.former,
            st.phase == Phase::Ready,
            st.queue.len() + self.backlog.load(Relaxed) as usize,
            st.running,
            st.wait_ns,
            st.last_batch,
            0,
        );
        self.load.store(&load);
        self.phase.store(st.phase as u8, Relaxed);
    }

    /// Publish what a push or a batch taken changes: the counts and the
    /// queue estimate (the batch latencies stay as published).
    fn publish_queue(&self, st: &State) {
        let mut load = self.load.load();
        load.set_queue(&st.former, st.queue.len() + self.backlog.load(Relaxed) as usize, st.running, 0);
        self.load.store_queue(&load);
    }

    /// Queue a request. Refused (handed back) unless the replica will serve
    /// it: draining and stopped replicas take nothing new.
    pub fn push(&self, req: Arc<dyn Job>) -> Result<(), Arc<dyn Job>> {
        let length = self.batches_by_length.then(|| req.length(self.stage)).flatten();
        let now = self.now_ns();
        let mut st = self.state.lock();
        if !st.phase.will_serve() {
            return Err(req);
        }
        st.former.on_arrival(now);
        st.queue.push(req.deadline_ns(), Work { req, enqueued: Instant::now(), length });
        self.publish_queue(&st);
        drop(st);
        self.wake.notify_one();
        Ok(())
    }

    /// Put back requests taken for a batch that could not run with it.
    pub fn requeue(&self, works: Vec<Work>) {
        if works.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for w in works {
            st.queue.push(w.req.deadline_ns(), w);
        }
        self.publish_queue(&st);
        drop(st);
        self.wake.notify_one();
    }

    /// The batch step: what to run now, what expired, when to look again.
    /// `rest_ns` is the predicted rest of the critical path after its stage
    /// (work its request no longer needs is skipped).
    pub fn take_batch(&self, rest_ns: u64) -> Step {
        let now = self.now_ns();
        let (epoch, stage) = (self.epoch, self.stage);
        let mut st = self.state.lock();
        let State { queue, former, .. } = &mut *st;
        let taken = take_batch(
            queue,
            former,
            now,
            rest_ns,
            |w| w.req.skips(stage),
            |w| w.enqueued.saturating_duration_since(epoch).as_nanos() as u64,
            |w| w.length,
        );
        if taken.skipped > 0 || !taken.expired.is_empty() || !taken.batch.is_empty() {
            self.publish_queue(&st);
        }
        taken
    }

    /// A batch of `n` is being sent to the worker, after its requests
    /// waited `mean_wait_ns` on average; `padded` is its padded length, for
    /// a stage that batches by length; `budget_ns` the time its most urgent
    /// request has before it would miss (an elastic stage answers within
    /// it: `BatchFormer::within`, as the SLO model counts it). Returns its
    /// expected latency.
    pub fn begin_batch(&self, n: usize, mean_wait_ns: u64, padded: Option<u64>, budget_ns: u64) -> u64 {
        let now = self.now_ns();
        let mut st = self.state.lock();
        let expected = st.former.within(st.former.expected_ns(n, padded), budget_ns);
        st.running = Some((n, now + expected));
        st.wait_ns = if st.wait_ns == 0 {
            mean_wait_ns
        } else {
            (st.wait_ns as f64 + 0.2 * (mean_wait_ns as f64 - st.wait_ns as f64)) as u64
        };
        self.publish(&st);
        expected
    }

    /// The batch of `n` (`padded` long, see [`Replica::begin_batch`]) came
    /// back after `observed_ns`; its most urgent request had `budget_ns` of
    /// slack (AIMD, the profile and the length model learn from it).
    pub fn end_batch(&self, n: usize, observed_ns: u64, budget_ns: u64, padded: Option<u64>) {
        let mut st = self.state.lock();
        st.running = None;
        st.former.on_batch_done(n, observed_ns, budget_ns);
        if let Some(p) = padded {
            st.former.on_batch_length(n, p);
        }
        st.last_batch = n;
        self.publish(&st);
    }

    /// The worker (pid) is up and warm: ready for traffic (or standing by,
    /// for a standby), unless the replica is being removed meanwhile.
    /// Returns the phase it entered, if it changed.
    pub fn worker_ready(&self, pid: u32) -> Option<Phase> {
        self.pid.store(pid, Relaxed);
        let mut st = self.state.lock();
        let entered = matches!(st.phase, Phase::Starting | Phase::Down).then(|| {
            st.phase = if st.standby { Phase::Standby } else { Phase::Ready };
            st.phase
        });
        self.publish(&st);
        entered
    }

    /// Let a standby take traffic: at once if it is warm, else as soon as
    /// its worker is. Returns false if it was not a standby.
    pub fn promote(&self) -> bool {
        let mut st = self.state.lock();
        if !st.standby || !st.phase.will_serve() {
            return false;
        }
        st.standby = false;
        if st.phase == Phase::Standby {
            st.phase = Phase::Ready;
        }
        self.publish(&st);
        drop(st);
        self.wake.notify_one();
        true
    }

    /// Take a serving replica out of routing, warm: it finishes what it has
    /// queued and waits as a standby. Returns false unless it was serving.
    pub fn demote(&self) -> bool {
        let mut st = self.state.lock();
        if st.phase != Phase::Ready {
            return false;
        }
        st.standby = true;
        st.phase = Phase::Standby;
        self.publish(&st);
        true
    }

    /// Held back from routing (warm or still starting).
    pub fn is_standby(&self) -> bool {
        let st = self.state.lock();
        st.standby && st.phase.will_serve()
    }

    /// The worker (or the node it runs on) is lost, with any batch in
    /// flight: the replica is down until a restart, unless it was being
    /// removed. Its task is woken to act on it.
    pub fn worker_died(&self) {
        self.pid.store(0, Relaxed);
        let mut st = self.state.lock();
        st.running = None;
        if matches!(st.phase, Phase::Starting | Phase::Ready | Phase::Standby) {
            st.phase = Phase::Down;
        }
        self.publish(&st);
        drop(st);
        self.wake.notify_one();
    }

    /// Everything queued, most urgent first (to move to other replicas).
    pub fn take_queue(&self) -> Vec<Work> {
        let mut st = self.state.lock();
        let drained = st.queue.drain().into_iter().map(|(_, w)| w).collect();
        self.publish_queue(&st);
        drained
    }

    /// Stop taking new work; finish the queue, then stop. Returns false if
    /// the replica was already draining or stopped.
    pub fn drain(&self) -> bool {
        let mut st = self.state.lock();
        let changed = st.phase.will_serve();
        if changed {
            st.phase = Phase::Draining;
        }
        self.publish(&st);
        drop(st);
        self.wake.notify_one();
        changed
    }

    /// Gone for good; returns what was still queued (for the caller to
    /// place elsewhere or fail).
    pub fn stop(&self) -> Vec<Work> {
        self.pid.store(0, Relaxed);
        let mut st = self.state.lock();
        st.phase = Phase::Stopped;
        st.running = None;
        let left = st.queue.drain().into_iter().map(|(_, w)| w).collect();
        self.publish(&st);
        left
    }

    /// Requests queued (as last published).
    pub fn queue_len(&self) -> usize {
        self.load().queued as usize
    }

    /// Requests in this replica's own queue (not counting the backlog its
    /// remote node last reported): what it must finish before it stops.
    pub fn own_queue_len(&self) -> usize {
        self.state.lock().queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_sched::{BatchPolicy, LatencyProfile};

    fn replica() -> (Replica, crate::codec::test_util::Dir) {
        let dir = crate::codec::test_util::Dir::new();
        let pool = Arc::new(Pool::create(&dir.0.join("p"), 1, 1 << 16).unwrap());
        let p = LatencyProfile::from_measurements(&[(1, 1000.0, 1000.0), (8, 2000.0, 2000.0)]);
        (Replica::new(1, 0, pool, BatchFormer::new(BatchPolicy::DeadlineAware, 8, p), Instant::now(), false), dir)
    }

    #[test]
    fn lifecycle_decides_what_it_accepts_and_publishes() {
        let (r, _d) = replica();
        assert_eq!(r.phase(), Phase::Starting);
        assert!(!r.load().accepting, "a starting replica is not routed to");
        assert_eq!(r.worker_ready(42), Some(Phase::Ready));
        assert_eq!((r.phase(), r.pid(), r.load().accepting), (Phase::Ready, 42, true));
        assert!(!r.promote(), "not a standby");
        r.worker_died();
        assert_eq!((r.phase(), r.pid(), r.load().accepting), (Phase::Down, 0, false));
        assert_eq!(r.worker_ready(43), Some(Phase::Ready));
        assert!(r.drain());
        assert!(!r.drain(), "once");
        assert_eq!(r.worker_ready(44), None, "a draining replica stays draining");
        assert_eq!(r.phase(), Phase::Draining);
        assert!(r.stop().is_empty());
        assert_eq!(r.phase(), Phase::Stopped);
    }

    #[test]
    fn a_standby_waits_warm_outside_routing_until_promoted() {
        let (r, _d) = replica();
        let pool = r.pool.clone();
        let s = Replica::new(2, 0, pool, r.former(), Instant::now(), true);
        assert_eq!(s.worker_ready(7), Some(Phase::Standby));
        assert!(s.is_standby() && !s.load().accepting, "warm but not routed to");
        s.worker_died();
        assert_eq!(s.worker_ready(8), Some(Phase::Standby), "a restarted standby stays one");
        assert!(s.promote());
        assert_eq!((s.phase(), s.load().accepting, s.is_standby()), (Phase::Ready, true, false));
        assert!(!s.promote(), "once");
        assert!(s.demote());
        assert_eq!((s.phase(), s.load().accepting, s.is_standby()), (Phase::Standby, false, true));
        assert!(s.promote());
        // Promoted while still starting: ready as soon as its worker is.
        let t = Replica::new(3, 0, r.pool.clone(), r.former(), Instant::now(), true);
        assert!(t.promote());
        assert_eq!(t.worker_ready(9), Some(Phase::Ready));
    }

    #[test]
    fn batches_keep_the_outstanding_count_by_construction() {
        let (r, _d) = replica();
        r.begin_batch(3, 1000, None, u64::MAX);
        assert_eq!(r.load().outstanding, 3);
        assert!(r.load().busy_until_ns > 0);
        r.end_batch(3, 1_000_000, u64::MAX, None);
        let l = r.load();
        assert_eq!((l.outstanding, l.busy_until_ns), (0, 0));
        // A dead worker loses its batch: nothing stays counted.
        r.begin_batch(2, 0, None, u64::MAX);
        r.worker_died();
        assert_eq!(r.load().outstanding, 0);
    }
}
