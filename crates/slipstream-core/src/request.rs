//! The life of a request through a pipeline's DAG, and the guard that keeps
//! the pipeline's books.
//!
//! A [`Request`] is a small state machine owned by the node. Its route (one
//! replica per stage) is fixed at ingress, so the parts of a fan-in are bound
//! for one replica by construction; the join itself happens here, in the
//! request's state: a stage is enqueued when its last parent has finished.
//! A request finishes exactly once, with its answer or an error (the first
//! to come wins); after that its queued work is skipped and its tensors are
//! released, which is also how half-joined parts are cleaned up when a
//! request times out or its client goes away.
//!
//! [`Admitted`] is the one owner of an admitted request's place in the
//! pipeline's books (the admission gate's in-flight count and outcomes, the
//! answered / failed / cancelled counters): it is created when the request
//! enters the pipeline and settles it exactly once, by construction:
//! [`Admitted::outcome`] settles it with the answer, and dropping it
//! unsettled (the client went away and the connection task dropped the
//! future, whatever await it was at) settles it as cancelled. No path out
//! of the node can forget to report a request.
//!
//! A replica sees a request as a [`Job`] (its deadline, its inputs to a
//! stage, where its outputs go); joins over candidate stages keep their
//! progress in a [`JoinRun`] per join, driven from here.

use crate::arena::{request_rows, TensorRef, Tensors};
use crate::error::NodeError;
use crate::ext::Lookup;
use crate::join::{JoinRun, Settled};
use crate::pipeline::{PipelineRt, Ticket};
use crate::replica::{Job, Phase, Replica};
use parking_lot::Mutex;
use slipstream_sched::{AdmissionGate, Length};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// A request's answer: its outputs, or why it failed.
pub(crate) type Reply = Result<Tensors, NodeError>;

struct State {
    inputs: Tensors,
    outputs: Vec<Option<Tensors>>,
    pending_parents: Vec<usize>,
    sinks_left: usize,
    reply: Option<oneshot::Sender<Reply>>,
    /// Where a streaming request's chunks go (its sink stages' partial
    /// outputs, as they come); dropped with the request's other state.
    chunks: Option<Chunks>,
    /// Per join of the pipeline: its plan and what has arrived.
    joins: Vec<JoinRun>,
    /// Per stage, the memo of a stage hook's lookup that missed (the
    /// cache's key, so the result is kept under it without hashing the
    /// inputs again); empty when no stage has a hook.
    memos: Vec<Option<u128>>,
    /// The stage it was handed on from, along a chain on other nodes.
    handed_on: Option<usize>,
}

/// The sending end of a streaming request's chunks.
pub type Chunks = mpsc::UnboundedSender<Tensors>;

/// One request's walk through its pipeline (see the module docs).
pub struct Request {
    pub(crate) id: u64,
    pub(crate) pipe: Arc<PipelineRt>,
    pub(crate) arrival: Instant,
    pub(crate) deadline: Instant,
    /// The deadline in ns since the pipeline's epoch (the queues' key).
    pub(crate) deadline_ns: u64,
    /// One replica per stage, chosen at ingress.
    pub(crate) route: Vec<Arc<Replica>>,
    /// The share of its budget its predicted time used at admission.
    pub(crate) share: f64,
    /// The stages whose work was already retried after a worker died (bit
    /// `stage`; stages past 63 share the last bit).
    pub(crate) retried: AtomicU64,
    /// Set for one stage's work run on behalf of another node (see
    /// [`Request::for_stage`]): only that stage runs, and its outputs are the answer.
    pub(crate) only: Option<usize>,
    done: AtomicBool,
    /// Bit k: join k has answered (later answers are only logged, and its
    /// stragglers' queued work is skipped).
    joins_done: AtomicU64,
    state: Mutex<State>,
}

impl Request {
    /// A new request with the deadline and route of its ticket.
    fn new(
        pipe: Arc<PipelineRt>,
        inputs: Tensors,
        ticket: Ticket,
        chunks: Option<Chunks>,
    ) -> (Arc<Request>, oneshot::Receiver<Reply>) {
        Self::build(pipe, inputs, ticket, None, chunks)
    }

    /// One stage's work for a request that entered the cluster at another
    /// node (its ingress keeps the request's state and joins; this node
    /// runs stage `stage` on `replica`'s queue, alongside its own requests,
    /// ordered by the same deadline). The answer is the stage's outputs.
    pub(crate) fn for_stage(
        pipe: Arc<PipelineRt>,
        stage: usize,
        inputs: Tensors,
        ticket: Ticket,
        chunks: Option<Chunks>,
    ) -> (Arc<Request>, oneshot::Receiver<Reply>) {
        let (req, rx) = Self::build(pipe, inputs, ticket, Some(stage), chunks);
        req.enqueue(stage);
        (req, rx)
    }

    fn build(
        pipe: Arc<PipelineRt>,
        inputs: Tensors,
        ticket: Ticket,
        only: Option<usize>,
        chunks: Option<Chunks>,
    ) -> (Arc<Request>, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let Ticket { id, arrival, deadline, route, share, .. } = ticket;
        let n = pipe.stages.len();
        let state = State {
            inputs,
            outputs: vec![None; n],
            pending_parents: pipe.dag.parents.iter().map(|p| p.len()).collect(),
            sinks_left: pipe.dag.sinks.len(),
            reply: Some(tx),
            chunks,
            joins: pipe.joins.iter().map(|_| JoinRun::default()).collect(),
            memos: if pipe.stages.iter().any(|s| s.hook.is_some()) { vec![None; n] } else { Vec::new() },
            handed_on: None,
        };
        let deadline_ns = pipe.ns_at(deadline);
        let req = Arc::new(Request {
            id,
            pipe,
            arrival,
            deadline,
            deadline_ns,
            route,
            share,
            retried: AtomicU64::new(0),
            only,
            done: AtomicBool::new(false),
            joins_done: AtomicU64::new(0),
            state: Mutex::new(state),
        });
        (req, rx)
    }

    /// Send the request into the pipeline's root stages.
    fn start(self: &Arc<Self>) {
        self.dispatch(&self.pipe.dag.roots);
    }

    /// Send stages whose parents have all finished on their way: onto a
    /// replica's queue, or for a join's candidates, as its plan says.
    pub(crate) fn dispatch(self: &Arc<Self>, stages: &[usize]) {
        for &s in stages {
            match self.pipe.join_of[s] {
                Some(k) if !self.plan_runs(k, s) => {}
                _ => self.enqueue(s),
            }
        }
    }

    /// Stage `stage` failed for this request (see [`Request::candidate_settled`]
    /// for a join's candidates).
    pub(crate) fn fail_stage(self: &Arc<Self>, stage: usize, err: NodeError) {
        match self.pipe.join_of[stage].filter(|_| self.only.is_none()) {
            Some(k) => self.candidate_settled(k, stage, Err(err)),
            None => self.fail(err),
        }
    }

    /// Put this request's work for stage `stage` on its routed replica, or
    /// another one if that one no longer takes work. Fails the request
    /// (503) when no replica of the stage will serve it. A stage hook's hit
    /// skips the queue.
    fn enqueue(self: &Arc<Self>, stage: usize) {
        let s = &self.pipe.stages[stage];
        if let Some(hook) = &s.hook {
            if let Ok(inputs) = self.stage_inputs(stage) {
                match hook.lookup(&inputs) {
                    Lookup::Hit(h) => {
                        if let Ok(outs) = h.to_arena(&self.pipe.arena) {
                            self.finish_stage(stage, outs);
                            return;
                        }
                    }
                    Lookup::Miss(memo) => self.set_memo(stage, memo),
                    Lookup::Pass => {}
                }
            }
        }
        let routed = self.route[stage].clone();
        let job: Arc<dyn Job> = self.clone();
        if self.is_stage_only() {
            // Another node's work stays on this node's replicas.
            let target = if routed.phase() == Phase::Ready { Some(routed) } else { s.local_target(self.id) };
            let refused = match target {
                Some(r) => r.push(job).err(),
                None => Some(job),
            };
            if refused.is_some() {
                self.fail(NodeError::Unavailable { stage: s.name.clone(), reason: "no replica here takes it".into() });
            }
            return;
        }
        if s.place(job, Some(&routed), None).is_err() {
            self.fail(NodeError::Unavailable { stage: s.name.clone(), reason: "it has no live replica".into() });
        }
    }

    /// Whether join `k`'s plan runs candidate `stage`; plans on the first
    /// call (its candidates share their parents, so all are ready
    /// together), with a timer for an ensemble's cutoff.
    fn plan_runs(self: &Arc<Self>, k: usize, stage: usize) -> bool {
        let join = &self.pipe.joins[k];
        let pos = join.position(stage).expect("a candidate of its join");
        let mut st = self.state.lock();
        if st.reply.is_none() {
            return false;
        }
        if let Some(plan) = st.joins[k].plan() {
            return plan.chosen[pos];
        }
        let context = join
            .policy
            .context_input()
            .and_then(|name| st.inputs.iter().find(|(n, _)| n == name).and_then(|(_, t)| t.first_string()));
        let plan = join.policy.plan(context);
        let runs = plan.chosen[pos];
        let rows = request_rows(&st.inputs);
        let ensemble = st.joins[k].start(plan, rows);
        drop(st);
        if ensemble {
            let rest = std::time::Duration::from_nanos(self.pipe.rest_ns(stage));
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
        if st.joins[k].cut() {
            self.answer_join(st, k);
        }
    }

    /// A candidate of join `k` answered (`Ok`) or failed (`Err`); after the
    /// join has answered, a straggler's answer only goes to the policy.
    fn candidate_settled(self: &Arc<Self>, k: usize, stage: usize, result: Result<Tensors, NodeError>) {
        let join = &self.pipe.joins[k];
        let pos = join.position(stage).expect("a candidate of its join");
        let mut st = self.state.lock();
        if self.join_answered(k) {
            if let Ok(outputs) = result {
                let rows = st.joins[k].rows();
                drop(st);
                join.policy.late(self.id, pos, &outputs, rows);
            }
            return;
        }
        if st.reply.is_none() {
            return;
        }
        match st.joins[k].settle(pos, result) {
            Settled::Wait => {}
            Settled::Answer => self.answer_join(st, k),
            Settled::Fail(e) => {
                drop(st);
                self.fail(e);
            }
        }
    }

    /// Whether join `k` has answered (set under the state lock, read
    /// without it by [`Request::skips`]).
    fn join_answered(&self, k: usize) -> bool {
        self.joins_done.load(Relaxed) & (1 << k) != 0
    }

    /// Combine join `k`'s answers and move the request on, as if every
    /// candidate had finished: the first carries the combined outputs, the
    /// others none, so the stages after the join see one answer.
    fn answer_join(self: &Arc<Self>, mut st: parking_lot::MutexGuard<'_, State>, k: usize) {
        let pipe = &self.pipe;
        let join = &pipe.joins[k];
        self.joins_done.fetch_or(1 << k, Relaxed);
        let rows = st.joins[k].rows();
        let (plan, arrived) = st.joins[k].take();
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

    /// One stage's work run for another node ([`Request::for_stage`]): it
    /// stays on this node's replicas.
    pub fn is_stage_only(&self) -> bool {
        self.only.is_some()
    }

    /// Whether it has finished (answered or failed).
    pub fn is_done(&self) -> bool {
        self.done.load(Relaxed)
    }

    /// Whether stage `stage`'s queued work for this request is no longer
    /// needed: the request is done, or the stage is a candidate of a
    /// selection that has answered without it (a straggler).
    pub(crate) fn skips(&self, stage: usize) -> bool {
        self.is_done() || (self.only.is_none() && self.pipe.join_of[stage].is_some_and(|k| self.join_answered(k)))
    }

    /// Remember the memo of stage `stage`'s hook lookup.
    pub(crate) fn set_memo(&self, stage: usize, memo: u128) {
        if let Some(m) = self.state.lock().memos.get_mut(stage) {
            *m = Some(memo);
        }
    }

    /// The memo of stage `stage`'s hook lookup, if it missed.
    pub(crate) fn memo(&self, stage: usize) -> Option<u128> {
        self.state.lock().memos.get(stage).copied().flatten()
    }

    /// The tensors stage `stage` consumes: the pipeline inputs for a root
    /// stage, otherwise the union of its parents' outputs.
    pub fn stage_inputs(&self, stage: usize) -> Result<Tensors, NodeError> {
        let st = self.state.lock();
        let parents = &self.pipe.dag.parents[stage];
        if parents.is_empty() || self.only == Some(stage) {
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

    /// `f` of stage `stage`'s input `name` (None when it has none by that
    /// name), read in place: the stage's other inputs are not copied, as
    /// [`Request::stage_inputs`] copies them for a batch.
    fn with_stage_input<R>(&self, stage: usize, name: &str, f: impl FnOnce(&TensorRef) -> R) -> Option<R> {
        let st = self.state.lock();
        let parents = &self.pipe.dag.parents[stage];
        let found = if parents.is_empty() || self.only == Some(stage) {
            st.inputs.iter().find(|(n, _)| n == name)
        } else {
            parents.iter().filter_map(|&p| st.outputs[p].as_ref()).flatten().find(|(n, _)| n == name)
        };
        found.map(|(_, t)| f(t))
    }

    /// Record stage `stage`'s outputs and move the request on: enqueue the
    /// children whose parents are now all done, and answer when every sink
    /// has finished.
    pub fn finish_stage(self: &Arc<Self>, stage: usize, outputs: Tensors) {
        if self.only.is_none() {
            if let Some(k) = self.pipe.join_of[stage] {
                return self.candidate_settled(k, stage, Ok(outputs));
            }
        }
        let mut ready = Vec::new();
        let answer = {
            let mut st = self.state.lock();
            if st.reply.is_none() {
                return;
            }
            if self.only == Some(stage) {
                let tx = st.reply.take();
                self.release(&mut st);
                drop(st);
                if let Some(tx) = tx {
                    let _ = tx.send(Ok(outputs));
                }
                return;
            }
            self.settle_stage(&mut st, stage, outputs, &mut ready)
        };
        self.go_on(answer, &ready);
    }

    /// Record `stage`'s outputs in the request's state: children whose
    /// parents are now all done go to `ready`; the answer (its channel and
    /// the sinks' merged outputs) when this was the last sink.
    fn settle_stage(
        &self,
        st: &mut State,
        stage: usize,
        outputs: Tensors,
        ready: &mut Vec<usize>,
    ) -> Option<(oneshot::Sender<Reply>, Tensors)> {
        let pipe = &self.pipe;
        st.outputs[stage] = Some(outputs);
        for &c in &pipe.dag.children[stage] {
            st.pending_parents[c] -= 1;
            if st.pending_parents[c] == 0 {
                ready.push(c);
            }
        }
        if !pipe.dag.sinks.contains(&stage) {
            return None;
        }
        st.sinks_left -= 1;
        if st.sinks_left > 0 {
            return None;
        }
        let mut merged: Tensors = Vec::new();
        for &s in &pipe.dag.sinks {
            for (name, t) in st.outputs[s].take().unwrap_or_default() {
                if !merged.iter().any(|(n, _)| *n == name) {
                    merged.push((name, t));
                }
            }
        }
        let answer = st.reply.take().map(|tx| (tx, merged));
        self.release(st);
        answer
    }

    /// The stages after `stage` that other nodes can run in turn, each
    /// handing the request straight to the next (a chain: each has one
    /// parent and one child before it, is not a candidate of a join and has
    /// no hook here), as far as its route stays on other nodes, with the
    /// replica routed for each. Empty for one stage's work run for another
    /// node and for a streaming request (its chunks come back with its
    /// calls).
    pub fn chain_after(&self, stage: usize) -> Vec<(usize, Arc<Replica>)> {
        let pipe = &self.pipe;
        // A stage run again after its chain was lost goes hub and spoke.
        let rerun = self.retried.load(Relaxed) & retry_bit(stage) != 0;
        if rerun || self.only.is_some() || pipe.join_of[stage].is_some() || self.state.lock().chunks.is_some() {
            return Vec::new();
        }
        let chained = |s: usize| {
            let r = &self.route[s];
            pipe.join_of[s].is_none() && pipe.stages[s].hook.is_none() && r.phase() == Phase::Ready && !r.leaving()
        };
        self.chain_walk(stage, chained).into_iter().map(|s| (s, self.route[s].clone())).collect()
    }

    /// The stages after `stage`, each the only child of the one before and
    /// its only parent, routed to other nodes and passing `also`, up to the
    /// first that is not: a chain ([`Request::chain_after`]), or, for an
    /// error, the one a request was handed along.
    fn chain_walk(&self, stage: usize, also: impl Fn(usize) -> bool) -> Vec<usize> {
        let dag = &self.pipe.dag;
        let mut out = Vec::new();
        let mut at = stage;
        while let [next] = dag.children[at][..] {
            if dag.parents[next].len() != 1 || self.route[next].is_local() || !also(next) {
                break;
            }
            out.push(next);
            at = next;
        }
        out
    }

    /// A chain of stages finished on other nodes (see [`Job::finish_chain`]):
    /// the stages before the last settle with no outputs here (theirs went
    /// straight to the next node), the last with `outputs`, and the request
    /// moves on from it.
    pub fn finish_chain(self: &Arc<Self>, stages: &[usize], outputs: Tensors) {
        let Some((&last, before)) = stages.split_last() else { return };
        let mut ready = Vec::new();
        let answer = {
            let mut st = self.state.lock();
            if st.reply.is_none() {
                return;
            }
            for &s in before {
                self.settle_stage(&mut st, s, Vec::new(), &mut ready);
            }
            ready.clear(); // the chain's own stages, already run
            self.settle_stage(&mut st, last, outputs, &mut ready)
        };
        self.go_on(answer, &ready);
    }

    /// After the state is unlocked: answer, or send the ready stages on.
    fn go_on(self: &Arc<Self>, answer: Option<(oneshot::Sender<Reply>, Tensors)>, ready: &[usize]) {
        if let Some((tx, merged)) = answer {
            let _ = tx.send(Ok(merged));
            return;
        }
        self.dispatch(ready);
    }

    /// Whether chunks of stage `stage`'s outputs go anywhere: to a
    /// streaming request's client if `stage` is a sink (other stages'
    /// chunks stay inside the pipeline: their children get the stage's
    /// final output; a join's candidates answer through the join, never in
    /// chunks), or, for one stage's work run for another node, to that
    /// node when its request streams.
    pub fn wants_chunks(&self, stage: usize) -> bool {
        self.passes_chunks_on(stage) && self.state.lock().chunks.is_some()
    }

    /// Whether stage `stage`'s chunks would be passed on (given a chunk
    /// channel): see [`Request::wants_chunks`].
    fn passes_chunks_on(&self, stage: usize) -> bool {
        match self.only {
            Some(only) => only == stage,
            None => self.pipe.dag.sinks.contains(&stage) && self.pipe.join_of[stage].is_none(),
        }
    }

    /// A chunk of stage `stage`'s outputs from a streaming component,
    /// passed on where [`Request::wants_chunks`] says. Once one is passed
    /// on, the stage's work for this request is not retried if its
    /// executor is lost (it fails with 503 instead): a retry would stream
    /// the chunks again from the first, and the client would see them
    /// twice.
    pub fn push_chunk(&self, stage: usize, outputs: Tensors) {
        if !self.passes_chunks_on(stage) {
            return;
        }
        let sent = self.state.lock().chunks.as_ref().is_some_and(|tx| tx.send(outputs).is_ok());
        if sent {
            Job::mark_retried(self, stage); // from here on, a lost executor fails it
        }
    }

    /// The stage the request waits at or runs in now (the first whose
    /// parents are all done and whose own output is not in yet), by name;
    /// "-" when none.
    pub fn stage_now(&self) -> String {
        self.at_now().map_or_else(|| "-".into(), |(_, name)| name)
    }

    /// The stage the request waits at or runs in now, and its name as an
    /// error says it: a request handed on from it along a chain on other
    /// nodes names the stages it was handed to.
    fn at_now(&self) -> Option<(usize, String)> {
        if let Some(s) = self.only {
            return Some((s, self.pipe.stages[s].name.clone()));
        }
        let st = self.state.lock();
        let at = (0..self.pipe.stages.len()).find(|&s| st.pending_parents[s] == 0 && st.outputs[s].is_none())?;
        let name = |s: usize| self.pipe.stages[s].name.clone();
        if st.handed_on != Some(at) {
            return Some((at, name(at)));
        }
        let chain: Vec<String> = self.chain_walk(at, |_| true).into_iter().map(name).collect();
        Some((at, format!("{} (handed on to {})", name(at), chain.join(", "))))
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
        st.chunks = None;
        st.inputs.clear();
        st.outputs.iter_mut().for_each(|o| *o = None);
    }
}

impl Job for Request {
    fn id(&self) -> u64 {
        self.id
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }

    fn deadline_ns(&self) -> u64 {
        self.deadline_ns
    }

    fn skips(&self, stage: usize) -> bool {
        Request::skips(self, stage)
    }

    fn inputs(&self, stage: usize) -> Result<Tensors, NodeError> {
        self.stage_inputs(stage)
    }

    fn length(&self, stage: usize) -> Option<Length> {
        let name = self.pipe.stages[stage].length_input.as_deref()?;
        self.with_stage_input(stage, name, |t| Some(Length { rows: t.rows(), longest: t.longest_element()? }))?
    }

    fn finish(self: Arc<Self>, stage: usize, outputs: Tensors) {
        self.finish_stage(stage, outputs);
    }

    fn fail_stage(self: Arc<Self>, stage: usize, err: NodeError) {
        Request::fail_stage(&self, stage, err);
    }

    fn fail(&self, err: NodeError) {
        Request::fail(self, err);
    }

    fn chunk(&self, stage: usize, outputs: Tensors) {
        self.push_chunk(stage, outputs);
    }

    fn wants_chunks(&self, stage: usize) -> bool {
        Request::wants_chunks(self, stage)
    }

    fn memo(&self, stage: usize) -> Option<u128> {
        Request::memo(self, stage)
    }

    fn mark_retried(&self, stage: usize) -> bool {
        let bit = retry_bit(stage);
        self.retried.fetch_or(bit, Relaxed) & bit == 0
    }

    fn chain_after(&self, stage: usize) -> Vec<(usize, Arc<Replica>)> {
        Request::chain_after(self, stage)
    }

    fn finish_chain(self: Arc<Self>, stages: &[usize], outputs: Tensors) {
        Request::finish_chain(&self, stages, outputs);
    }

    fn rerun(self: Arc<Self>, stage: usize) {
        if !self.is_done() {
            self.state.lock().handed_on = None;
            self.enqueue(stage);
        }
    }

    fn handed_on(&self, stage: usize) {
        self.state.lock().handed_on = Some(stage);
    }
}

/// Stage `stage`'s bit in [`Request::retried`] (stages past 63 share the last).
fn retry_bit(stage: usize) -> u64 {
    1u64 << stage.min(63)
}

/// An admitted request inside its pipeline: settled exactly once, with its
/// outcome or, if dropped first, as cancelled (see the module docs).
pub(crate) struct Admitted {
    req: Arc<Request>,
    rx: Option<oneshot::Receiver<Reply>>,
    settled: bool,
}

impl Admitted {
    /// Enter the pipeline: count the request in the gate and send it to its
    /// root stages.
    /// `chunks`: a streaming request's chunk channel.
    pub(crate) fn enter(pipe: &Arc<PipelineRt>, inputs: Tensors, ticket: Ticket, chunks: Option<Chunks>) -> Admitted {
        let found_queue = ticket.found_queue;
        let (req, rx) = Request::new(pipe.clone(), inputs, ticket, chunks);
        pipe.metrics.admitted.fetch_add(1, Relaxed);
        pipe.gate.lock().on_admit(pipe.now_ns(), found_queue);
        let admitted = Admitted { req: req.clone(), rx: Some(rx), settled: false };
        req.start();
        admitted
    }

    /// Wait for the answer and settle. A pipeline that drops late requests
    /// (the default) answers 504 when the deadline passes, wherever the
    /// request is: the client learns at once, not when a busy replica next
    /// looks at its queue. Otherwise the request timeout bounds the wait.
    pub(crate) async fn outcome(mut self) -> Reply {
        let pipe = self.req.pipe.clone();
        let rx = self.rx.take().expect("outcome is awaited once");
        let timeout_at = self.req.arrival + pipe.timeout;
        let drop_late = pipe.spec.slo.is_none_or(|s| s.drop_late) && self.req.deadline < timeout_at;
        let give_up = if drop_late { self.req.deadline } else { timeout_at };
        let result = match tokio::time::timeout_at(give_up.into(), rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(NodeError::Internal("request was dropped without an answer".into())),
            Err(_) if drop_late => {
                let (at, stage) = self.req.at_now().unzip();
                if let Some(s) = at {
                    pipe.stages[s].metrics.dropped_late.fetch_add(1, Relaxed);
                }
                let stage = stage.unwrap_or_else(|| "-".into());
                self.req.fail(NodeError::DeadlineExceeded { stage: stage.clone() });
                Err(NodeError::DeadlineExceeded { stage })
            }
            Err(_) => {
                let ms = pipe.timeout.as_millis() as u64;
                self.req.fail(NodeError::Timeout { ms });
                Err(NodeError::Timeout { ms })
            }
        };
        self.settle(&result);
        result
    }

    fn settle(&mut self, result: &Reply) {
        self.settled = true;
        let (req, pipe) = (&self.req, &self.req.pipe);
        let m = &pipe.metrics;
        let done = Instant::now();
        let met = match result {
            Ok(_) => {
                m.ok.fetch_add(1, Relaxed);
                m.latency_us.record_duration(done.duration_since(req.arrival));
                m.latency_window.record(done.duration_since(req.arrival).as_micros() as u64);
                if done <= req.deadline {
                    m.slo_met.fetch_add(1, Relaxed);
                } else {
                    m.slo_missed.fetch_add(1, Relaxed);
                }
                let took = done.duration_since(req.arrival).as_nanos() as u64;
                let budget = req.deadline.saturating_duration_since(req.arrival).as_nanos() as u64;
                Some(AdmissionGate::counts_as_met(took, budget))
            }
            Err(e) => {
                m.error(e.kind());
                matches!(e, NodeError::DeadlineExceeded { .. } | NodeError::Timeout { .. }).then_some(false)
            }
        };
        pipe.gate.lock().on_finish_with(pipe.now_ns(), met, req.share);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // The client went away: stop the request's work (its queued parts
        // are skipped, its tensors released) and take it off the books.
        // Past its deadline it counts as a miss; before, as no outcome.
        self.req.fail(NodeError::Cancelled);
        let pipe = &self.req.pipe;
        pipe.metrics.cancelled.fetch_add(1, Relaxed);
        let late = Instant::now() > self.req.deadline;
        pipe.gate.lock().on_finish_with(pipe.now_ns(), late.then_some(false), self.req.share);
    }
}
