//! Model selection with feedback (Clipper's selection layer, Crankshaw et
//! al., NSDI 2017): a selection over candidate stages that answer the same
//! question (each outputs `label`, and optionally `proba`).
//!
//! - **Exp3** (Auer et al., the adversarial bandit) picks one candidate per
//!   request; feedback tells how the chosen one did. The update is the
//!   loss form, `lw[j] -= eta * loss / p[j]`, which never gives a large
//!   positive jump to a rarely chosen candidate; choice probabilities mix
//!   in `gamma / K` of uniform exploration.
//! - **Exp4-style ensembles** run every candidate and combine their
//!   answers with learned weights (a weighted vote over `proba`, or over
//!   one-hot labels); feedback updates every candidate whose prediction is
//!   known, `lw[i] -= eta * loss_i` (Hedge, with full information).
//! - **Bounded memory of the past:** log-weights are kept within
//!   [`SPREAD`] of the best (as Exp3.S / fixed-share do), so a candidate
//!   that goes bad loses its lead within about `SPREAD / eta` feedback
//!   events, however long it was the best.
//! - **Stragglers:** an ensemble answers at its cutoff with the candidates
//!   that have arrived (see [`Selector::cutoff`]); `contributors` says how
//!   many, and `confidence` (the weighted share of the whole ensemble
//!   agreeing with the answer) is lower when some are missing.
//! - **Feedback joins predictions** through a bounded log, request id →
//!   each candidate's labels (Clipper joins them through its prediction
//!   cache); a straggler's late prediction still lands in the log, so a slow
//!   model is still judged.
//! - **Contexts:** with `context`, each value of that string input (a user,
//!   a session) has its own weights (Clipper's contextualization), uniform
//!   until its first feedback; at most [`MAX_CONTEXTS`] are kept (counted
//!   once they have had feedback), the oldest forgotten first.
//!
//! It plugs into the core as a [`JoinPolicy`]: the request's side (which
//! candidates run, answering at the cutoff with what has arrived) is the
//! core's `join` module. [`Selections`] holds every pipeline's selectors
//! for the feedback route, the status and `/metrics`.

mod feedback;
mod selections;

pub use feedback::{parse_feedback, Feedback};
pub use selections::Selections;

use parking_lot::Mutex;
use serde_json::{json, Value};
use slipstream_core::arena::{HeapTensors, TensorRef, Tensors};
use slipstream_core::join::{JoinPlan, JoinPolicy, JoinTiming};
use slipstream_core::spec::{SelectPolicy as Policy, SelectSpec};
use slipstream_types::DType;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How far (in log-weight) a candidate may fall behind the best.
pub const SPREAD: f64 = 6.907_755_278_982_137; // ln(1000)
/// Context keys with their own weights, at most.
pub const MAX_CONTEXTS: usize = 10_000;
/// Predictions kept for feedback, at most (the oldest go first).
pub const MAX_HELD: usize = 200_000;
/// The most classes a combined answer may have.
pub(crate) const MAX_CLASSES: i64 = 1 << 16;

/// Feedback on one request: the true labels (one per row), or a reward in [0, 1].
#[derive(Clone, Debug, PartialEq)]
pub enum Truth {
    Labels(Vec<i64>),
    Reward(f64),
}

#[derive(Debug, PartialEq)]
pub enum FeedbackError {
    /// No prediction of this request is held (never made, or forgotten).
    Unknown,
    Invalid(String),
}

struct Held {
    context: Option<String>,
    probs: Vec<f64>,
    chosen: Vec<bool>,
    /// Each candidate's predicted labels, once it has answered.
    labels: Vec<Option<Vec<i64>>>,
}

#[derive(Default)]
struct Log {
    held: HashMap<u64, Held>,
    order: VecDeque<u64>,
}

struct Weights {
    global: Vec<f64>,
    contexts: HashMap<String, Vec<f64>>,
    order: VecDeque<String>,
}

/// One selection's policy state (see the crate docs).
pub struct Selector {
    spec: SelectSpec,
    eta: f64,
    gamma: f64,
    weights: Mutex<Weights>,
    log: Mutex<Log>,
    picks: Vec<AtomicU64>,
    feedback: AtomicU64,
    unknown_feedback: AtomicU64,
    /// Ensembles answered at their cutoff with some candidates missing.
    cut_short: AtomicU64,
    /// Predictions that arrived after their ensemble had answered.
    late: AtomicU64,
    rng: AtomicU64,
}

impl Selector {
    /// The selector `spec` declares.
    pub fn new(spec: &SelectSpec) -> Selector {
        let k = spec.candidates.len();
        Selector {
            eta: spec.eta.unwrap_or(match spec.policy {
                Policy::Exp3 => 0.1,
                Policy::Exp4 => 0.2,
            }),
            gamma: spec.gamma.unwrap_or(0.05),
            spec: spec.clone(),
            weights: Mutex::new(Weights { global: vec![0.0; k], contexts: HashMap::new(), order: VecDeque::new() }),
            log: Mutex::new(Log::default()),
            picks: (0..k).map(|_| AtomicU64::new(0)).collect(),
            feedback: AtomicU64::new(0),
            unknown_feedback: AtomicU64::new(0),
            cut_short: AtomicU64::new(0),
            late: AtomicU64::new(0),
            rng: AtomicU64::new(clock_seed()),
        }
    }

    fn probabilities(&self, lw: &[f64]) -> Vec<f64> {
        let w = softmax(lw);
        match self.spec.policy {
            Policy::Exp4 => w,
            Policy::Exp3 => {
                let k = w.len() as f64;
                w.iter().map(|p| (1.0 - self.gamma) * p + self.gamma / k).collect()
            }
        }
    }

    /// The log-weights a request in `context` is planned with: the
    /// context's own, uniform for a context that has had no feedback yet
    /// (as its state will start), the default context's without one.
    fn log_weights(&self, context: Option<&str>) -> Vec<f64> {
        let w = self.weights.lock();
        match context {
            None => w.global.clone(),
            Some(c) => w.contexts.get(c).cloned().unwrap_or_else(|| vec![0.0; w.global.len()]),
        }
    }

    /// Decide which candidates run for one request (in `context`).
    fn plan_for(&self, context: Option<String>) -> JoinPlan {
        let probs = self.probabilities(&self.log_weights(context.as_deref()));
        let chosen = match self.spec.policy {
            Policy::Exp4 => vec![true; probs.len()],
            Policy::Exp3 => {
                let u = unit(splitmix(self.rng.fetch_add(0x9e37_79b9_7f4a_7c15, Relaxed)));
                let mut acc = 0.0;
                let pick = probs.iter().position(|p| {
                    acc += p;
                    u < acc
                });
                let pick = pick.unwrap_or(probs.len() - 1);
                (0..probs.len()).map(|i| i == pick).collect()
            }
        };
        for (i, c) in chosen.iter().enumerate() {
            if *c {
                self.picks[i].fetch_add(1, Relaxed);
            }
        }
        JoinPlan { chosen, weights: probs, context }
    }

    /// When an ensemble stops waiting for stragglers: `wait_ms` after its
    /// candidates were dispatched, and no later than the request's deadline
    /// less the time the rest of the pipeline is expected to take (and 1 ms
    /// to answer). A plan with one candidate waits for it.
    fn cutoff_at(&self, dispatched: Instant, deadline: Instant, rest: Duration) -> Instant {
        let by_deadline = deadline.checked_sub(rest + Duration::from_millis(1)).unwrap_or(dispatched);
        match self.spec.wait_ms {
            Some(ms) => by_deadline.min(dispatched + Duration::from_secs_f64(ms / 1e3)),
            None => by_deadline,
        }
    }

    /// Combine the candidates' answers for one request of `rows` rows into
    /// the selection's outputs, and hold the predictions for feedback.
    fn combine_answers(
        &self,
        id: u64,
        plan: &JoinPlan,
        arrived: &[Option<Tensors>],
        rows: u64,
    ) -> Result<HeapTensors, String> {
        let names: Vec<&str> = self.spec.candidates.iter().map(String::as_str).collect();
        let mut labels: Vec<Option<Vec<i64>>> = vec![None; arrived.len()];
        let mut probas: Vec<Option<(usize, Vec<f32>)>> = vec![None; arrived.len()];
        for (i, out) in arrived.iter().enumerate() {
            let Some(out) = out else { continue };
            labels[i] = Some(read_labels(out, rows).map_err(|e| format!("candidate '{}': {e}", names[i]))?);
            probas[i] = read_proba(out, rows).map_err(|e| format!("candidate '{}': {e}", names[i]))?;
        }
        let Some(first) = labels.iter().position(Option::is_some) else {
            return Err("no candidate answered".into());
        };
        let contributors = labels.iter().flatten().count();
        if contributors < plan.chosen.iter().filter(|c| **c).count() {
            self.cut_short.fetch_add(1, Relaxed);
        }
        let rows_n = rows as usize;
        let mut out_label = Vec::with_capacity(rows_n);
        let mut out_conf = Vec::with_capacity(rows_n);
        let mut classes = probas.iter().flatten().map(|(c, _)| *c).max().unwrap_or(0);
        for l in labels.iter().flatten() {
            classes = classes.max(l.iter().map(|&v| v as usize + 1).max().unwrap_or(0));
        }
        let mut scores = vec![0f64; classes];
        for r in 0..rows_n {
            scores.iter_mut().for_each(|s| *s = 0.0);
            for (i, l) in labels.iter().enumerate() {
                let Some(l) = l else { continue };
                let w = match self.spec.policy {
                    Policy::Exp4 => plan.weights[i],
                    Policy::Exp3 => 1.0,
                };
                match &probas[i] {
                    Some((c, p)) => {
                        for (k, v) in p[r * c..(r + 1) * c].iter().enumerate() {
                            scores[k] += w * *v as f64;
                        }
                    }
                    None => scores[l[r] as usize] += w,
                }
            }
            let (label, conf) = match self.spec.policy {
                Policy::Exp4 => {
                    let best = argmax(&scores);
                    (best as i64, scores[best])
                }
                // One model's answer: its own probability for its label if
                // it gives probabilities, else how sure the policy was in
                // choosing it.
                Policy::Exp3 => {
                    let label = labels[first].as_ref().expect("answered")[r];
                    (label, if probas[first].is_some() { scores[label as usize] } else { plan.weights[first] })
                }
            };
            out_label.push(label);
            out_conf.push(conf as f32);
        }
        let model = match self.spec.policy {
            Policy::Exp4 => "ensemble",
            Policy::Exp3 => names[first],
        };
        let mut model_bytes = Vec::new();
        for _ in 0..rows_n {
            slipstream_types::var::push(&mut model_bytes, model.as_bytes());
        }
        self.hold(
            id,
            Held { context: plan.context.clone(), probs: plan.weights.clone(), chosen: plan.chosen.clone(), labels },
        );
        Ok(HeapTensors(vec![
            ("label".into(), DType::Int64, vec![rows], out_label.iter().flat_map(|v| v.to_le_bytes()).collect()),
            ("confidence".into(), DType::Float32, vec![rows], out_conf.iter().flat_map(|v| v.to_le_bytes()).collect()),
            (
                "contributors".into(),
                DType::Int32,
                vec![rows],
                std::iter::repeat_n(contributors as i32, rows_n).flat_map(|v| v.to_le_bytes()).collect(),
            ),
            ("model".into(), DType::String, vec![rows], model_bytes),
        ]))
    }

    fn hold(&self, id: u64, h: Held) {
        let mut log = self.log.lock();
        if log.held.insert(id, h).is_none() {
            log.order.push_back(id);
        }
        while log.order.len() > MAX_HELD {
            if let Some(old) = log.order.pop_front() {
                log.held.remove(&old);
            }
        }
    }

    /// A candidate's answer that came after its ensemble had answered: kept
    /// for feedback only.
    fn late_answer(&self, id: u64, position: usize, out: &Tensors, rows: u64) {
        self.late.fetch_add(1, Relaxed);
        let Ok(labels) = read_labels(out, rows) else { return };
        if let Some(h) = self.log.lock().held.get_mut(&id) {
            h.labels[position] = Some(labels);
        }
    }

    /// Apply feedback on request `id` to the weights of its context.
    pub fn feedback(&self, id: u64, truth: &Truth) -> Result<(), FeedbackError> {
        let held = {
            let mut log = self.log.lock();
            let Some(h) = log.held.get(&id) else {
                drop(log);
                self.unknown_feedback.fetch_add(1, Relaxed);
                return Err(FeedbackError::Unknown);
            };
            // Check before taking it, so bad feedback leaves the prediction held.
            check_truth(self.spec.policy, h, truth)?;
            log.held.remove(&id).expect("present")
        };
        let mut losses = vec![None; held.labels.len()];
        for (i, l) in held.labels.iter().enumerate() {
            let Some(l) = l else { continue };
            losses[i] = Some(match truth {
                Truth::Reward(r) => 1.0 - r,
                Truth::Labels(t) => l.iter().zip(t).filter(|(a, b)| a != b).count() as f64 / t.len().max(1) as f64,
            });
        }
        let mut w = self.weights.lock();
        let lw = match &held.context {
            None => &mut w.global,
            Some(c) => context_weights(&mut w, c),
        };
        for (i, loss) in losses.iter().enumerate() {
            let Some(loss) = loss else { continue };
            match self.spec.policy {
                Policy::Exp3 if held.chosen[i] => lw[i] -= self.eta * loss / held.probs[i].max(1e-9),
                Policy::Exp3 => {}
                Policy::Exp4 => lw[i] -= self.eta * loss,
            }
        }
        let best = lw.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        for v in lw.iter_mut() {
            *v = (*v - best).max(-SPREAD);
        }
        drop(w);
        self.feedback.fetch_add(1, Relaxed);
        Ok(())
    }

    /// The policy's state, for `/v1/status` (the default context, or `context`'s).
    pub fn report(&self, context: Option<&str>) -> Value {
        let weights = self.log_weights(context);
        let contexts = self.weights.lock().contexts.len();
        json!({
            "name": self.spec.name,
            "policy": self.spec.policy,
            "candidates": self.spec.candidates,
            "context": context,
            "weights": softmax(&weights),
            "probabilities": self.probabilities(&weights),
            "eta": self.eta,
            "gamma": if self.spec.policy == Policy::Exp3 { Some(self.gamma) } else { None },
            "wait_ms": self.spec.wait_ms,
            "contexts": contexts,
            "picks": self.picks.iter().map(|p| p.load(Relaxed)).collect::<Vec<_>>(),
            "feedback": self.feedback.load(Relaxed),
            "unknown_feedback": self.unknown_feedback.load(Relaxed),
            "cut_short": self.cut_short.load(Relaxed),
            "late": self.late.load(Relaxed),
            "held": self.log.lock().held.len(),
        })
    }

    /// Weights of the default context (for `/metrics`).
    pub fn weights(&self) -> Vec<f64> {
        softmax(&self.weights.lock().global)
    }
}

impl JoinPolicy for Selector {
    fn name(&self) -> &str {
        &self.spec.name
    }

    fn candidates(&self) -> &[String] {
        &self.spec.candidates
    }

    fn context_input(&self) -> Option<&str> {
        self.spec.context.as_deref()
    }

    fn plan(&self, context: Option<String>) -> JoinPlan {
        self.plan_for(context)
    }

    fn cutoff(&self, dispatched: Instant, deadline: Instant, rest: Duration) -> Instant {
        self.cutoff_at(dispatched, deadline, rest)
    }

    fn combine(&self, id: u64, plan: &JoinPlan, arrived: &[Option<Tensors>], rows: u64) -> Result<HeapTensors, String> {
        self.combine_answers(id, plan, arrived, rows)
    }

    fn late(&self, id: u64, position: usize, out: &Tensors, rows: u64) {
        self.late_answer(id, position, out, rows)
    }

    fn timing(&self) -> JoinTiming {
        // An ensemble answers at its straggler cutoff with what has
        // arrived; one chosen model is waited for.
        match self.spec.policy {
            Policy::Exp4 => JoinTiming::Fastest,
            Policy::Exp3 => JoinTiming::Slowest,
        }
    }
}

fn context_weights<'a>(w: &'a mut Weights, c: &str) -> &'a mut Vec<f64> {
    if !w.contexts.contains_key(c) {
        while w.contexts.len() >= MAX_CONTEXTS {
            match w.order.pop_front() {
                Some(old) => {
                    w.contexts.remove(&old);
                }
                None => break,
            }
        }
        w.order.push_back(c.to_string());
        let k = w.global.len();
        w.contexts.insert(c.to_string(), vec![0.0; k]);
    }
    w.contexts.get_mut(c).expect("inserted")
}

fn check_truth(policy: Policy, h: &Held, truth: &Truth) -> Result<(), FeedbackError> {
    match truth {
        Truth::Reward(r) if !(0.0..=1.0).contains(r) => {
            Err(FeedbackError::Invalid(format!("reward {r} is outside [0, 1]")))
        }
        Truth::Reward(_) if policy == Policy::Exp4 => Err(FeedbackError::Invalid(
            "an exp4 ensemble learns from each model's error: give the true label, not a reward".into(),
        )),
        Truth::Reward(_) => Ok(()),
        Truth::Labels(t) => {
            let rows = h.labels.iter().flatten().map(Vec::len).next().unwrap_or(t.len());
            if t.len() != rows {
                Err(FeedbackError::Invalid(format!(
                    "the request had {rows} row(s); feedback gives {} label(s)",
                    t.len()
                )))
            } else {
                Ok(())
            }
        }
    }
}

/// A candidate's `label` output: int64 or int32, shape (rows,) or (rows, 1).
fn read_labels(out: &Tensors, rows: u64) -> Result<Vec<i64>, String> {
    let (_, t) = out.iter().find(|(n, _)| n == "label").ok_or("it has no 'label' output")?;
    let per_row = t.shape.iter().skip(1).product::<u64>();
    if t.rows() != rows || per_row != 1 {
        return Err(format!("'label' must have shape ({rows},) or ({rows}, 1), not {:?}", t.shape));
    }
    let vals: Vec<i64> = match t.dtype {
        DType::Int64 => t.bytes().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect(),
        DType::Int32 => {
            t.bytes().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4")) as i64).collect()
        }
        other => return Err(format!("'label' must be int64 or int32, not {}", other.name())),
    };
    if let Some(bad) = vals.iter().find(|v| !(0..MAX_CLASSES).contains(*v)) {
        return Err(format!("label {bad} is outside [0, {MAX_CLASSES})"));
    }
    Ok(vals)
}

/// A candidate's optional `proba` output: float32 (rows, classes).
fn read_proba(out: &Tensors, rows: u64) -> Result<Option<(usize, Vec<f32>)>, String> {
    let Some((_, t)) = out.iter().find(|(n, _)| n == "proba") else { return Ok(None) };
    let t: &TensorRef = t;
    if t.dtype != DType::Float32 || t.shape.len() != 2 || t.rows() != rows {
        return Err(format!(
            "'proba' must be float32 of shape ({rows}, classes), not {} {:?}",
            t.dtype.name(),
            t.shape
        ));
    }
    let classes = t.shape[1];
    if classes == 0 || classes > MAX_CLASSES as u64 {
        return Err(format!("'proba' has {classes} classes"));
    }
    let vals: Vec<f32> = t
        .bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
        .map(|v| if v.is_finite() { v } else { 0.0 })
        .collect();
    Ok(Some((classes as usize, vals)))
}

fn softmax(lw: &[f64]) -> Vec<f64> {
    let m = lw.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = lw.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// A seed from the wall clock, so that each node start draws differently.
fn clock_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    splitmix((t as u64) ^ ((t >> 64) as u64))
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform number in [0, 1).
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_core::arena::Arena;
    use slipstream_core::testing::temp_arena as arena;

    fn spec(policy: Policy) -> SelectSpec {
        SelectSpec {
            name: "sel".into(),
            candidates: vec!["a".into(), "b".into(), "c".into()],
            policy,
            context: None,
            wait_ms: None,
            eta: None,
            gamma: None,
        }
    }

    fn labels(arena: &Arena, ls: &[i64], proba: Option<(usize, &[f32])>) -> Tensors {
        let mut h = vec![(
            "label".to_string(),
            DType::Int64,
            vec![ls.len() as u64],
            ls.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )];
        if let Some((c, p)) = proba {
            h.push((
                "proba".into(),
                DType::Float32,
                vec![ls.len() as u64, c as u64],
                p.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
        }
        HeapTensors(h).to_arena(arena).unwrap()
    }

    fn out_i64(h: &HeapTensors, name: &str) -> Vec<i64> {
        let (_, _, _, b) = h.0.iter().find(|(n, ..)| n == name).unwrap();
        b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn out_f32(h: &HeapTensors, name: &str) -> Vec<f32> {
        let (_, _, _, b) = h.0.iter().find(|(n, ..)| n == name).unwrap();
        b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn exp4_votes_by_weight_and_missing_models_lower_confidence() {
        let (a, _d) = arena();
        let s = Selector::new(&spec(Policy::Exp4));
        let plan = s.plan(None);
        assert_eq!(plan.chosen, vec![true; 3]);
        let all = [Some(labels(&a, &[1, 2], None)), Some(labels(&a, &[1, 0], None)), Some(labels(&a, &[0, 0], None))];
        let out = s.combine(7, &plan, &all, 2).unwrap();
        assert_eq!(out_i64(&out, "label"), vec![1, 0]);
        let conf = out_f32(&out, "confidence");
        assert!((conf[0] - 2.0 / 3.0).abs() < 1e-6 && (conf[1] - 2.0 / 3.0).abs() < 1e-6, "{conf:?}");
        // A straggler missing: the others decide, with less confidence.
        let some = [Some(labels(&a, &[3, 3], None)), None, None];
        let out = s.combine(8, &plan, &some, 2).unwrap();
        assert_eq!(out_i64(&out, "label"), vec![3, 3]);
        assert!((out_f32(&out, "confidence")[0] - 1.0 / 3.0).abs() < 1e-6);
        let (_, _, _, c) = out.0.iter().find(|(n, ..)| n == "contributors").unwrap();
        assert_eq!(i32::from_le_bytes(c[..4].try_into().unwrap()), 1);
        assert_eq!(s.cut_short.load(Relaxed), 1);
        // Probabilities are averaged when given.
        let p = [
            Some(labels(&a, &[0], Some((2, &[0.6, 0.4])))),
            Some(labels(&a, &[0], Some((2, &[0.55, 0.45])))),
            Some(labels(&a, &[1], Some((2, &[0.0, 1.0])))),
        ];
        let out = s.combine(9, &plan, &p, 1).unwrap();
        assert_eq!(out_i64(&out, "label"), vec![1], "0.383 for class 0 < 0.617 for class 1");
    }

    #[test]
    fn exp4_feedback_moves_weight_off_a_wrong_model_within_a_bounded_number_of_events() {
        let (a, _d) = arena();
        let s = Selector::new(&spec(Policy::Exp4));
        let mut id = 0;
        let mut step = |s: &Selector, wrong: usize| {
            id += 1;
            let plan = s.plan(None);
            let outs: Vec<_> = (0..3).map(|i| Some(labels(&a, &[if i == wrong { 1 } else { 0 }], None))).collect();
            s.combine(id, &plan, &outs, 1).unwrap();
            s.feedback(id, &Truth::Labels(vec![0])).unwrap();
        };
        for _ in 0..500 {
            step(&s, 2); // model c is always wrong
        }
        let w = s.weights();
        assert!(w[2] < 0.001 && w[0] > 0.45, "{w:?}");
        // Now model a goes bad: bounded memory means it loses its weight fast.
        let mut n = 0;
        while s.weights()[0] > 1.0 / 3.0 {
            step(&s, 0);
            n += 1;
            assert!(n < 50, "still {:?} after {n} events", s.weights());
        }
        assert!(s.feedback(id, &Truth::Labels(vec![0])).is_err(), "feedback is applied once");
        assert_eq!(s.feedback(99_999, &Truth::Labels(vec![0])), Err(FeedbackError::Unknown));
    }

    #[test]
    fn exp3_converges_to_the_best_candidate() {
        let (a, _d) = arena();
        let s = Selector::new(&spec(Policy::Exp3));
        let accuracy = [0.6, 0.9, 0.75];
        let mut rng = 1u64;
        for id in 0..3000u64 {
            let plan = s.plan(None);
            assert_eq!(plan.chosen.iter().filter(|c| **c).count(), 1);
            let i = plan.chosen.iter().position(|c| *c).unwrap();
            rng = splitmix(rng);
            let right = unit(rng) < accuracy[i];
            let mut outs = vec![None, None, None];
            outs[i] = Some(labels(&a, &[if right { 5 } else { 4 }], None));
            let out = s.combine(id, &plan, &outs, 1).unwrap();
            assert_eq!(out_i64(&out, "label"), vec![if right { 5 } else { 4 }]);
            s.feedback(id, &Truth::Labels(vec![5])).unwrap();
        }
        let p =
            s.report(None)["probabilities"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect::<Vec<_>>();
        assert!(p[1] > 0.8, "{p:?}");
    }

    #[test]
    fn bad_feedback_is_refused_and_changes_nothing() {
        let (a, _d) = arena();
        let s = Selector::new(&spec(Policy::Exp4));
        let plan = s.plan(None);
        let outs: Vec<_> = (0..3).map(|_| Some(labels(&a, &[0, 1], None))).collect();
        s.combine(1, &plan, &outs, 2).unwrap();
        assert!(matches!(s.feedback(1, &Truth::Labels(vec![0])), Err(FeedbackError::Invalid(_))));
        assert!(matches!(s.feedback(1, &Truth::Reward(1.0)), Err(FeedbackError::Invalid(_))));
        assert_eq!(s.report(None)["held"], 1, "still held after refused feedback");
        s.feedback(1, &Truth::Labels(vec![0, 1])).unwrap();
        // Bad candidate outputs fail the combine with a clear message.
        let bad = [Some(labels(&a, &[-1], None)), None, None];
        assert!(s.combine(2, &plan, &bad, 1).unwrap_err().contains("outside"));
    }

    #[test]
    fn contexts_learn_apart() {
        let (a, _d) = arena();
        let s = Selector::new(&spec(Policy::Exp4));
        for id in 0..200u64 {
            let ctx = if id % 2 == 0 { "alice" } else { "bob" };
            let plan = s.plan(Some(ctx.into()));
            let outs: Vec<_> = (0..3).map(|i| Some(labels(&a, &[i as i64], None))).collect();
            s.combine(id, &plan, &outs, 1).unwrap();
            // alice's truth is what model a says, bob's what model c says.
            s.feedback(id, &Truth::Labels(vec![if ctx == "alice" { 0 } else { 2 }])).unwrap();
        }
        let w = |c: &str| {
            s.report(Some(c))["weights"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect::<Vec<_>>()
        };
        assert!(w("alice")[0] > 0.9 && w("bob")[2] > 0.9, "{:?} {:?}", w("alice"), w("bob"));
        assert_eq!(s.report(None)["contexts"], 2);
    }

    #[test]
    fn feedback_bodies_parse_or_say_why_not() {
        let (f, batch) = parse_feedback(br#"{"request_id": 3, "label": 2}"#).unwrap();
        assert!(!batch);
        assert_eq!(f[0], Feedback { request_id: 3, select: None, truth: Truth::Labels(vec![2]) });
        let (f, batch) = parse_feedback(
            br#"{"feedback": [{"request_id": 1, "reward": 0.5}, {"request_id": 2, "label": [1, 2], "select": "s"}]}"#,
        )
        .unwrap();
        assert!(batch && f.len() == 2 && f[1].select.as_deref() == Some("s"));
        for bad in [
            &br#"{"request_id": 3}"#[..],
            br#"{"request_id": -1, "label": 2}"#,
            br#"{"request_id": 3, "label": 2, "reward": 1}"#,
            br#"{"request_id": 3, "reward": 1.5}"#,
            br#"{"request_id": 3, "label": "cat"}"#,
            br#"{"request_id": 3, "label": 2, "extra": 1}"#,
            br#"{"feedback": [{"request_id": 1, "label": 1}, {"label": 2}]}"#,
            br#"[1, 2]"#,
            br#"not json"#,
        ] {
            assert!(parse_feedback(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
