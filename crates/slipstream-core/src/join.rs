//! Joins over candidate stages: a group of alternative stages with the
//! same parents whose answers are combined into one before the stages
//! after them run. Which candidates run for a request, when to stop
//! waiting for stragglers and how answers combine is a [`JoinPolicy`]'s
//! (model selection, in `slipstream-select`); the request's side of it
//! (which candidates ran, what has arrived, answering at the cutoff) is
//! here, in the request's state, like every other join of the DAG.
//!
//! A request's join plan is made when its first candidate is ready (they
//! share their parents, so all are ready together). The join answers when
//! every chosen candidate has answered, or at the policy's cutoff with
//! what has arrived (the first answer, if none had arrived by then); a
//! failed candidate counts as one that did not answer, so the request
//! fails only when none of the chosen answered. The combined outputs move
//! the request on as if every candidate had finished: the first carries
//! them, the others none, so the stages after the join see one answer.
//! Work the join no longer needs (a straggler's queued work) is skipped.

use crate::arena::{HeapTensors, Tensors};
use crate::error::NodeError;
use crate::request::{request_rows, Request, State};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which candidates run for one request, and what the policy planned with.
#[derive(Clone, Debug)]
pub struct JoinPlan {
    /// Per candidate: whether it runs.
    pub chosen: Vec<bool>,
    /// Per candidate: its weight (or choice probability) in this plan.
    pub weights: Vec<f64>,
    /// The request's context (the policy's state is kept per context).
    pub context: Option<String>,
}

/// How admission predicts a join's time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JoinTiming {
    /// As long as its slowest candidate (every candidate's queue counts).
    Slowest,
    /// As long as its fastest candidate: it answers at its cutoff with
    /// what has arrived, so a straggler's backlog is skipped, not waited on.
    Fastest,
}

/// A join's policy (see the module docs).
pub trait JoinPolicy: Send + Sync {
    /// The join's name (unique among the pipeline's stages and joins).
    fn name(&self) -> &str;
    /// The candidates' stage names.
    fn candidates(&self) -> &[String];
    /// The string input whose first element is a request's context, if the
    /// policy keeps state per context.
    fn context_input(&self) -> Option<&str>;
    /// Which candidates run for a request in `context`.
    fn plan(&self, context: Option<String>) -> JoinPlan;
    /// When a request whose candidates were dispatched at `dispatched`
    /// stops waiting for stragglers: at the latest its `deadline` less
    /// `rest`, the time the pipeline is expected to take after the join.
    fn cutoff(&self, dispatched: Instant, deadline: Instant, rest: Duration) -> Instant;
    /// The join's one answer for request `id` (of `rows` rows) from what
    /// `arrived` (per candidate).
    fn combine(&self, id: u64, plan: &JoinPlan, arrived: &[Option<Tensors>], rows: u64) -> Result<HeapTensors, String>;
    /// Candidate `position`'s answer came after the join had answered.
    fn late(&self, id: u64, position: usize, out: &Tensors, rows: u64);
    /// How admission predicts the join's time.
    fn timing(&self) -> JoinTiming;
}

/// A join of a pipeline: its policy and its candidates' stage indices.
pub(crate) struct Join {
    pub(crate) policy: Arc<dyn JoinPolicy>,
    pub(crate) candidates: Vec<usize>,
}

impl Join {
    /// Position of stage `stage` among the candidates.
    fn position(&self, stage: usize) -> Option<usize> {
        self.candidates.iter().position(|&c| c == stage)
    }
}

/// One request's progress through one join.
#[derive(Default)]
pub(crate) struct JoinRun {
    plan: Option<JoinPlan>,
    arrived: Vec<Option<Tensors>>,
    /// Chosen candidates that have not answered yet.
    waiting: usize,
    /// The cutoff passed before any answer: the first answers.
    cut: bool,
    /// The request's rows (its inputs are released when it answers).
    rows: u64,
}

impl Request {
    /// Whether join `k`'s plan runs candidate `stage`; plans on the first
    /// call, with a timer for an ensemble's cutoff.
    pub(crate) fn plan_runs(self: &Arc<Self>, k: usize, stage: usize) -> bool {
        let join = &self.pipe.joins[k];
        let pos = join.position(stage).expect("a candidate of its join");
        let mut st = self.state.lock();
        if st.reply.is_none() {
            return false;
        }
        if let Some(plan) = &st.joins[k].plan {
            return plan.chosen[pos];
        }
        let context = join.policy.context_input().and_then(|name| {
            st.inputs.iter().find(|(n, _)| n == name).and_then(|(_, t)| t.first_string())
        });
        let plan = join.policy.plan(context);
        let rows = request_rows(&st.inputs);
        let run = &mut st.joins[k];
        run.rows = rows;
        run.waiting = plan.chosen.iter().filter(|c| **c).count();
        run.arrived = vec![None; plan.chosen.len()];
        let runs = plan.chosen[pos];
        let ensemble = run.waiting > 1;
        run.plan = Some(plan);
        drop(st);
        if ensemble {
            let rest = Duration::from_nanos(self.pipe.rest_ns(stage));
            let at = join.policy.cutoff(Instant::now(), self.deadline, rest);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let me = Arc::downgrade(self);
                rt.spawn(async move {
                    tokio::time::sleep_until(at.into()).await;
                    if let Some(req) = me.upgrade() {
                        req.cut_join(k);
                    }
                });
            }
        }
        runs
    }

    /// Join `k`'s cutoff: answer with what has arrived, or with the first
    /// answer if none has yet.
    fn cut_join(self: &Arc<Self>, k: usize) {
        let mut st = self.state.lock();
        if st.reply.is_none() || self.join_answered(k) {
            return;
        }
        let run = &mut st.joins[k];
        if run.arrived.iter().all(Option::is_none) {
            run.cut = true;
            return;
        }
        self.answer_join(st, k);
    }

    /// A candidate of join `k` answered (`Ok`) or failed (`Err`); after the
    /// join has answered, a straggler's answer only goes to the policy.
    pub(crate) fn candidate_settled(self: &Arc<Self>, k: usize, stage: usize, result: Result<Tensors, NodeError>) {
        let join = &self.pipe.joins[k];
        let pos = join.position(stage).expect("a candidate of its join");
        let mut st = self.state.lock();
        if self.join_answered(k) {
            if let Ok(outputs) = result {
                let rows = st.joins[k].rows;
                drop(st);
                join.policy.late(self.id, pos, &outputs, rows);
            }
            return;
        }
        if st.reply.is_none() {
            return;
        }
        let run = &mut st.joins[k];
        let failed = match result {
            Ok(outputs) => {
                run.arrived[pos] = Some(outputs);
                None
            }
            Err(e) => Some(e),
        };
        run.waiting = run.waiting.saturating_sub(1);
        let any = run.arrived.iter().any(Option::is_some);
        if any && (run.waiting == 0 || run.cut) {
            self.answer_join(st, k);
        } else if let (0, Some(e)) = (run.waiting, failed) {
            drop(st);
            self.fail(e);
        }
    }

    /// Whether join `k` has answered (set under the state lock, read
    /// without it by [`Request::skips`]).
    pub(crate) fn join_answered(&self, k: usize) -> bool {
        self.joins_done.load(Relaxed) & (1 << k) != 0
    }

    /// Combine join `k`'s answers and move the request on, as if every
    /// candidate had finished.
    fn answer_join(self: &Arc<Self>, mut st: parking_lot::MutexGuard<'_, State>, k: usize) {
        let pipe = &self.pipe;
        let join = &pipe.joins[k];
        self.joins_done.fetch_or(1 << k, Relaxed);
        let run = &mut st.joins[k];
        let plan = run.plan.take().expect("planned before any answer");
        let arrived = std::mem::take(&mut run.arrived);
        let rows = run.rows;
        let combined = join
            .policy
            .combine(self.id, &plan, &arrived, rows)
            .and_then(|h| h.to_arena(&pipe.arena).map_err(|e| e.to_string()));
        let outs = match combined {
            Ok(outs) => outs,
            Err(message) => {
                drop(st);
                self.fail(NodeError::Component { stage: join.policy.name().to_string(), message });
                return;
            }
        };
        let mut ready = Vec::new();
        let mut answer = None;
        let mut carried = Some(outs);
        for &c in &join.candidates {
            let outputs = carried.take().unwrap_or_default();
            if let Some(a) = self.settle_stage(&mut st, c, outputs, &mut ready) {
                answer = Some(a);
            }
        }
        drop(st);
        self.go_on(answer, &ready);
    }
}
