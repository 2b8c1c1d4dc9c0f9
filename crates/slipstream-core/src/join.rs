//! Joins over candidate stages: a group of alternative stages with the
//! same parents whose answers are combined into one before the stages
//! after them run. Which candidates run for a request, when to stop
//! waiting for stragglers and how answers combine is a [`JoinPolicy`]'s
//! (model selection, in `slipstream-select`); one request's progress
//! through a join (which candidates ran, what has arrived, whether its
//! cutoff passed) is a [`JoinRun`], plain data kept in the request's state
//! and driven by the request (`request.rs`), like every other join of the
//! DAG.
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
    pub(crate) fn position(&self, stage: usize) -> Option<usize> {
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

/// What a candidate's answer (or failure) means for its join.
#[derive(Debug)]
pub(crate) enum Settled {
    /// Keep waiting.
    Wait,
    /// Combine what arrived and answer.
    Answer,
    /// None of the chosen answered: the request fails with this.
    Fail(NodeError),
}

impl JoinRun {
    /// The plan, once made.
    pub(crate) fn plan(&self) -> Option<&JoinPlan> {
        self.plan.as_ref()
    }

    /// The request's rows.
    pub(crate) fn rows(&self) -> u64 {
        self.rows
    }

    /// Start with `plan` for a request of `rows` rows; true when more than
    /// one candidate runs (an ensemble: its cutoff needs a timer).
    pub(crate) fn start(&mut self, plan: JoinPlan, rows: u64) -> bool {
        self.rows = rows;
        self.waiting = plan.chosen.iter().filter(|c| **c).count();
        self.arrived = vec![None; plan.chosen.len()];
        self.plan = Some(plan);
        self.waiting > 1
    }

    /// The cutoff passed: true to answer now (something arrived); else the
    /// first answer to come will answer.
    pub(crate) fn cut(&mut self) -> bool {
        self.cut = true;
        self.arrived.iter().any(Option::is_some)
    }

    /// Candidate `pos` answered (`Ok`) or failed. A failed candidate counts
    /// as one that did not answer: the others still can.
    pub(crate) fn settle(&mut self, pos: usize, result: Result<Tensors, NodeError>) -> Settled {
        let failed = match result {
            Ok(outputs) => {
                self.arrived[pos] = Some(outputs);
                None
            }
            Err(e) => Some(e),
        };
        self.waiting = self.waiting.saturating_sub(1);
        let any = self.arrived.iter().any(Option::is_some);
        match (any && (self.waiting == 0 || self.cut), self.waiting, failed) {
            (true, _, _) => Settled::Answer,
            (false, 0, Some(e)) => Settled::Fail(e),
            _ => Settled::Wait,
        }
    }

    /// The plan and what arrived, for the policy to combine (once).
    pub(crate) fn take(&mut self) -> (JoinPlan, Vec<Option<Tensors>>) {
        (self.plan.take().expect("planned before any answer"), std::mem::take(&mut self.arrived))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(chosen: &[bool]) -> JoinPlan {
        JoinPlan { chosen: chosen.to_vec(), weights: vec![1.0; chosen.len()], context: None }
    }

    #[test]
    fn an_ensemble_answers_when_all_arrived_or_at_its_cutoff() {
        let mut r = JoinRun::default();
        assert!(r.start(plan(&[true, true, true]), 2), "an ensemble");
        assert!(matches!(r.settle(0, Ok(Vec::new())), Settled::Wait));
        assert!(r.cut(), "something arrived: answer at the cutoff");
        let mut r = JoinRun::default();
        r.start(plan(&[true, true]), 1);
        assert!(!r.cut(), "nothing yet: the first to come answers");
        assert!(matches!(r.settle(1, Ok(Vec::new())), Settled::Answer));
        let (p, arrived) = r.take();
        assert_eq!((p.chosen.len(), arrived.iter().flatten().count()), (2, 1));
    }

    #[test]
    fn a_failed_candidate_counts_as_one_that_did_not_answer() {
        let mut r = JoinRun::default();
        r.start(plan(&[true, true]), 1);
        assert!(matches!(r.settle(0, Err(NodeError::Cancelled)), Settled::Wait), "the other still can");
        assert!(matches!(r.settle(1, Ok(Vec::new())), Settled::Answer));
        let mut r = JoinRun::default();
        assert!(!r.start(plan(&[false, true]), 1), "one chosen: no cutoff");
        assert!(matches!(r.settle(1, Err(NodeError::Cancelled)), Settled::Fail(NodeError::Cancelled)));
    }
}
