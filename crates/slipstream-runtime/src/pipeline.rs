//! Pipelines at run time: stages, replicas' queues, and the life of a request
//! through the DAG.
//!
//! A request is a small state machine owned by the node. Its route (one
//! replica per stage) is fixed at ingress by the router, so the parts of a
//! fan-in are bound for one replica by construction; the join itself happens
//! here, in the request's state: a stage is enqueued when its last parent has
//! finished. A request finishes exactly once, with its answer or an error
//! (the first to come wins); after that its queued work is skipped and its
//! tensors are released, which is also how half-joined parts are cleaned up
//! when a request times out.

use crate::arena::{TensorRef, Tensors};
use crate::error::NodeError;
use crate::metrics::{PipelineMetrics, StageMetrics};
use crate::spec::PipelineSpec;
use parking_lot::Mutex;
use slipstream_sched::{choose_replica, AdmissionGate, BatchFormer, EdfQueue, ReplicaLoad};
use slipstream_shm::Pool;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{oneshot, Notify};

pub type Reply = Result<Tensors, NodeError>;

/// One queued unit of work: a request waiting for a stage replica.
pub struct Work {
    pub req: Arc<Request>,
    pub enqueued: Instant,
}

/// A worker replica of a stage, as the scheduler sees it.
pub struct Replica {
    pub index: usize,
    pub pool: Arc<Pool>,
    pub queue: Mutex<EdfQueue<Work>>,
    pub notify: Notify,
    pub healthy: AtomicBool,
    /// Requests queued at or running on this replica.
    pub outstanding: AtomicUsize,
    pub last_batch: AtomicUsize,
    pub pid: AtomicUsize,
    /// Batch sizing policy and this replica's latency profile.
    pub former: Mutex<BatchFormer>,
    /// When the batch now running was sent (ns since the pipeline epoch; 0 = idle),
    /// and how long it was predicted to take: for admission control.
    pub busy_since_ns: AtomicU64,
    pub busy_predicted_ns: AtomicU64,
    /// Recent queue wait of dispatched requests (EWMA, ns): catches what the
    /// backlog model misses, such as replicas of other stages taking the cores.
    pub wait_ewma_ns: AtomicU64,
}

impl Replica {
    pub fn new(index: usize, pool: Arc<Pool>, former: BatchFormer) -> Replica {
        Replica {
            index,
            pool,
            former: Mutex::new(former),
            busy_since_ns: AtomicU64::new(0),
            busy_predicted_ns: AtomicU64::new(0),
            wait_ewma_ns: AtomicU64::new(0),
            queue: Mutex::new(EdfQueue::new()),
            notify: Notify::new(),
            healthy: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            last_batch: AtomicUsize::new(0),
            pid: AtomicUsize::new(0),
        }
    }

    pub fn push(&self, req: Arc<Request>, epoch: Instant) {
        let deadline_ns = req.deadline.saturating_duration_since(epoch).as_nanos() as u64;
        self.former.lock().on_arrival(epoch.elapsed().as_nanos() as u64);
        self.outstanding.fetch_add(1, Relaxed);
        self.queue.lock().push(deadline_ns, Work { req, enqueued: Instant::now() });
        self.notify.notify_one();
    }

    /// `n` requests left this replica (done, failed, moved or skipped).
    pub fn release(&self, n: usize) {
        let _ = self.outstanding.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(n)));
    }

    pub fn queue_len(&self) -> usize {
        self.queue.lock().len()
    }

    /// Fold the mean queue wait of a dispatched batch into the running estimate.
    pub fn observe_wait(&self, wait_ns: u64) {
        let old = self.wait_ewma_ns.load(Relaxed);
        let new = if old == 0 { wait_ns } else { (old as f64 + 0.2 * (wait_ns as f64 - old as f64)) as u64 };
        self.wait_ewma_ns.store(new, Relaxed);
    }

    /// Expected time until this replica could start a request that joins
    /// its queue now: what is left of the running batch, plus the queued
    /// work in batches of the current limit (or the recent observed wait,
    /// if longer). Expected, not worst case:
    /// admission refuses only requests that are likely to miss.
    pub fn backlog_ns(&self, now_ns: u64) -> u64 {
        let queued = self.queue_len();
        let former = self.former.lock();
        let running = match self.busy_since_ns.load(Relaxed) {
            0 => 0,
            since => (since + self.busy_predicted_ns.load(Relaxed)).saturating_sub(now_ns),
        };
        if queued == 0 {
            return running;
        }
        let per = former.limit.max(1) as usize;
        let batches = queued.div_ceil(per) as u64;
        (running + batches * former.mean_ns(queued.min(per))).max(self.wait_ewma_ns.load(Relaxed))
    }
}

pub struct StageRt {
    pub index: usize,
    pub name: String,
    pub component: String,
    pub max_batch: usize,
    pub parents: Vec<usize>,
    pub children: Vec<usize>,
    pub replicas: Vec<Arc<Replica>>,
    pub metrics: StageMetrics,
}

impl StageRt {
    pub fn loads(&self) -> Vec<ReplicaLoad> {
        self.replicas
            .iter()
            .map(|r| ReplicaLoad { healthy: r.healthy.load(Relaxed), outstanding: r.outstanding.load(Relaxed) })
            .collect()
    }
}

pub struct PipelineRt {
    pub spec: PipelineSpec,
    pub stages: Vec<StageRt>,
    pub sinks: Vec<usize>,
    pub roots: Vec<usize>,
    pub metrics: PipelineMetrics,
    /// Time every request gets to finish; its deadline for EDF ordering is
    /// the SLO target when one is declared.
    pub timeout: std::time::Duration,
    /// Reference instant for deadlines expressed as nanoseconds.
    pub epoch: Instant,
    /// How much of its budget an admitted request's predicted finish may
    /// use, learned from admitted requests' outcomes.
    pub gate: Mutex<AdmissionGate>,
}

/// What ingress decides about a request before its body is decoded: its id,
/// deadline and route (one replica per stage).
pub struct Ticket {
    pub id: u64,
    pub arrival: Instant,
    pub deadline: Instant,
    pub route: Vec<usize>,
}

impl PipelineRt {
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Time a request has from arrival: the SLO target, or the timeout.
    pub fn slo_budget(&self) -> std::time::Duration {
        self.spec.slo.map(|s| std::time::Duration::from_secs_f64(s.p99_ms / 1e3)).unwrap_or(self.timeout)
    }

    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Expected time from the end of `stage` to the end of the request:
    /// the longest path through its descendants, each at the batch size it
    /// last ran.
    pub fn rest_ns(&self, stage: usize) -> u64 {
        self.stages[stage]
            .children
            .iter()
            .map(|&c| {
                let r = &self.stages[c].replicas[0];
                let typical = r.last_batch.load(Relaxed).max(1);
                r.former.lock().mean_ns(typical) + self.rest_ns(c)
            })
            .max()
            .unwrap_or(0)
    }

    /// Expected time from the end of `stage` to the end of a request routed
    /// as `route`: through each downstream stage, the queue ahead of it on
    /// its routed replica plus one batch, along the longest path.
    pub fn path_ns(&self, stage: usize, route: &[usize], now: u64) -> u64 {
        self.stages[stage]
            .children
            .iter()
            .map(|&c| {
                let r = &self.stages[c].replicas[route[c]];
                let typical = r.last_batch.load(Relaxed).max(1);
                r.backlog_ns(now) + r.former.lock().mean_ns(typical) + self.path_ns(c, route, now)
            })
            .max()
            .unwrap_or(0)
    }

    /// A new request's ticket: deadline `arrival + SLO target` (or the
    /// request timeout without an SLO), or `budget` from arrival if that is
    /// tighter; route chosen now.
    pub fn ticket(&self, id: u64, arrival: Instant, budget: Option<std::time::Duration>) -> Ticket {
        let slo = self.slo_budget();
        Ticket { id, arrival, deadline: arrival + budget.map_or(slo, |b| b.min(slo)), route: self.route(id) }
    }

    /// Admission control: can a request with this ticket, arriving now,
    /// finish by its deadline? Its predicted time in the pipeline is the
    /// larger of two estimates: the queues ahead of it at every stage of its
    /// route, each at its profiled batch latency; and the gate's measured
    /// one (Little's law). It must fit within the gate's headroom share of
    /// the time the request has left. Err carries the predicted overshoot.
    /// A request whose whole route is idle is always admitted: only queueing
    /// can make us refuse, and an idle stage keeps refreshing its profile.
    pub fn admit(&self, t: &Ticket) -> Result<(), std::time::Duration> {
        let now = self.now_ns();
        let deadline_ns = t.deadline.saturating_duration_since(self.epoch).as_nanos() as u64;
        let mut finish = now;
        let mut queued = false;
        for &s in &self.roots {
            let r = &self.stages[s].replicas[t.route[s]];
            let backlog = r.backlog_ns(now);
            let downstream = self.path_ns(s, &t.route, now);
            queued |= backlog > 0 || downstream > self.rest_ns(s);
            finish = finish.max(now + backlog + r.former.lock().mean_ns(1) + downstream);
        }
        let gate = self.gate.lock();
        let predicted = (finish - now).max(gate.sojourn_ns());
        let budget = deadline_ns.saturating_sub(now);
        if !queued || gate.admits(predicted, budget) {
            Ok(())
        } else {
            let allowed = (gate.headroom() * budget as f64) as u64;
            Err(std::time::Duration::from_nanos(predicted.saturating_sub(allowed)))
        }
    }

    /// An admitted request entered the pipeline.
    pub fn on_start(&self) {
        self.gate.lock().on_admit(self.now_ns());
    }

    /// An admitted request left the pipeline: within its deadline, not
    /// (`Some(false)`), or failed otherwise (`None`).
    pub fn on_finish(&self, met: Option<bool>) {
        self.gate.lock().on_finish(self.now_ns(), met);
    }

    /// Pick one replica per stage for a new request (ingress routing).
    pub fn route(&self, tiebreak: u64) -> Vec<usize> {
        self.stages
            .iter()
            .map(|s| choose_replica(&s.loads(), tiebreak).unwrap_or((tiebreak as usize) % s.replicas.len()))
            .collect()
    }

    /// Put `req` on stage `stage`'s queue: its routed replica, or another
    /// healthy one if that replica is down.
    pub fn enqueue(&self, req: Arc<Request>, stage: usize) {
        let s = &self.stages[stage];
        let mut r = req.route[stage];
        if !s.replicas[r].healthy.load(Relaxed) {
            if let Some(other) = choose_replica(&s.loads(), req.id) {
                r = other;
            }
        }
        s.replicas[r].push(req, self.epoch);
    }
}

struct State {
    inputs: Tensors,
    outputs: Vec<Option<Tensors>>,
    pending_parents: Vec<usize>,
    sinks_left: usize,
    reply: Option<oneshot::Sender<Reply>>,
}

pub struct Request {
    pub id: u64,
    pub pipe: Arc<PipelineRt>,
    pub arrival: Instant,
    pub deadline: Instant,
    pub route: Vec<usize>,
    /// Whether this request was already retried after a worker died.
    pub retried: AtomicBool,
    done: AtomicBool,
    state: Mutex<State>,
}

impl Request {
    /// A new request with the deadline and route of its ticket.
    pub fn new(pipe: Arc<PipelineRt>, inputs: Tensors, ticket: Ticket) -> (Arc<Request>, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let Ticket { id, arrival, deadline, route } = ticket;
        let n = pipe.stages.len();
        let state = State {
            inputs,
            outputs: vec![None; n],
            pending_parents: pipe.stages.iter().map(|s| s.parents.len()).collect(),
            sinks_left: pipe.sinks.len(),
            reply: Some(tx),
        };
        let req = Arc::new(Request {
            id,
            pipe,
            arrival,
            deadline,
            route,
            retried: AtomicBool::new(false),
            done: AtomicBool::new(false),
            state: Mutex::new(state),
        });
        (req, rx)
    }

    /// Send the request into the pipeline's root stages.
    pub fn start(self: &Arc<Self>) {
        for &s in &self.pipe.roots {
            self.pipe.enqueue(self.clone(), s);
        }
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Relaxed)
    }

    /// The tensors stage `stage` consumes: the pipeline inputs for a root
    /// stage, otherwise the union of its parents' outputs.
    pub fn stage_inputs(&self, stage: usize) -> Result<Tensors, NodeError> {
        let st = self.state.lock();
        let parents = &self.pipe.stages[stage].parents;
        if parents.is_empty() {
            return Ok(st.inputs.clone());
        }
        let mut merged: Tensors = Vec::new();
        for &p in parents {
            let outs = st.outputs[p].as_ref().ok_or_else(|| NodeError::Internal("parent output missing".into()))?;
            for (name, t) in outs {
                if merged.iter().any(|(n, _)| n == name) {
                    return Err(NodeError::Internal(format!(
                        "stage '{}' receives output '{name}' from two parents; rename one of them",
                        self.pipe.stages[stage].name
                    )));
                }
                merged.push((name.clone(), t.clone()));
            }
        }
        Ok(merged)
    }

    /// Record stage `stage`'s outputs and move the request on: enqueue the
    /// children whose parents are now all done, and answer when every sink
    /// has finished.
    pub fn finish_stage(self: &Arc<Self>, stage: usize, outputs: Tensors) {
        let pipe = &self.pipe;
        let mut ready = Vec::new();
        let mut answer = None;
        {
            let mut st = self.state.lock();
            if st.reply.is_none() {
                return;
            }
            st.outputs[stage] = Some(outputs);
            for &c in &pipe.stages[stage].children {
                st.pending_parents[c] -= 1;
                if st.pending_parents[c] == 0 {
                    ready.push(c);
                }
            }
            if pipe.sinks.contains(&stage) {
                st.sinks_left -= 1;
                if st.sinks_left == 0 {
                    let mut merged: Tensors = Vec::new();
                    for &s in &pipe.sinks {
                        for (name, t) in st.outputs[s].take().unwrap_or_default() {
                            if !merged.iter().any(|(n, _)| *n == name) {
                                merged.push((name, t));
                            }
                        }
                    }
                    answer = st.reply.take().map(|tx| (tx, merged));
                    self.release(&mut st);
                }
            }
        }
        if let Some((tx, merged)) = answer {
            let _ = tx.send(Ok(merged));
            return;
        }
        for c in ready {
            pipe.enqueue(self.clone(), c);
        }
    }

    /// Finish with an error (the first finish wins; later ones are ignored).
    pub fn fail(&self, err: NodeError) {
        let tx = {
            let mut st = self.state.lock();
            let tx = st.reply.take();
            self.release(&mut st);
            tx
        };
        if let Some(tx) = tx {
            let _ = tx.send(Err(err));
        }
    }

    fn release(&self, st: &mut State) {
        self.done.store(true, Relaxed);
        st.inputs.clear();
        st.outputs.iter_mut().for_each(|o| *o = None);
    }
}

/// Rows a request contributes to a batch: the first dimension of its inputs.
pub fn request_rows(inputs: &[(String, TensorRef)]) -> u64 {
    inputs.first().map(|(_, t)| t.rows()).unwrap_or(1)
}
