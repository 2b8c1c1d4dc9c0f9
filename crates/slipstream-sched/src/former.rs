//! The batch former: when a replica frees up, how many of its queued
//! requests to run now, whether to wait for more, and which requests can no
//! longer make their deadline.
//!
//! Deadline-aware policy (the default):
//! 1. Requests at the head of the (EDF) queue whose deadline has passed are
//!    *expired*: the caller drops them rather than spend compute on a miss.
//! 2. Take the largest batch `n` (up to the AIMD limit) whose predicted
//!    finish, `now + L(n) + rest`, still meets the most urgent deadline,
//!    where `rest` is the predicted remaining critical path after this stage.
//! 3. Delayed batching (Clipper): if everything queued fits, the queue is
//!    short of the limit, more work is arriving, and a larger batch would be
//!    cheaper per request, wait, but only as long as the most urgent
//!    request's slack allows and at most `max_wait`.
//! 4. AIMD on the batch limit (Clipper): when a batch runs past the slack
//!    its most urgent request had (so it caused a miss), cut the limit
//!    multiplicatively; when a batch at the limit fits, grow it by one.
//!    Every batch also refines the profile.
//!
//! For a stage with variable-length inputs, the batch is chosen by length
//! (see [`crate::length`]): similar lengths grouped, the padded length
//! bounded, latency predicted from it.
//!
//! An elastic stage (an anytime computation: a re-rank under a time
//! budget, an iterative search) does less with less time: it answers
//! `elastic_floor_ns` before its batch's budget (the time its most urgent
//! request has left), keeping that much for what does not shrink (its fixed
//! work, its answer's way back), and takes at least that much
//! ([`BatchFormer::within`]). A larger batch does not make a request late,
//! so it runs whatever is queued up to the limit, and AIMD does not cut.
//!
//! Fixed policy (the Triton / Ray Serve baseline, for comparison): run when
//! `max_batch` requests are queued or the oldest has waited `fixed_wait`;
//! no deadlines, no expiry, no AIMD.
//!
//! Times are `u64` nanoseconds from the caller's clock; nothing here reads a
//! clock, so every decision is unit-testable.

use crate::length::{choose, BatchLength, Length, LengthModel};
use crate::profile::LatencyProfile;
use crate::queue::EdfQueue;

/// How a stage forms its batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchPolicy {
    /// The largest batch whose predicted finish still meets the most urgent
    /// deadline, waiting for more only when slack allows (the default).
    DeadlineAware,
    /// A full batch, or whatever is queued once the oldest request has
    /// waited `wait_ns` (the Triton / Ray Serve policy, for comparison).
    Fixed { wait_ns: u64 },
}

impl BatchPolicy {
    /// The policy named `name` (`"deadline"` or `"fixed"`, the latter
    /// waiting `fixed_wait_ms` for a full batch); None for another name.
    pub fn parse(name: &str, fixed_wait_ms: f64) -> Option<BatchPolicy> {
        match name {
            "deadline" => Some(BatchPolicy::DeadlineAware),
            "fixed" => Some(BatchPolicy::Fixed { wait_ns: (fixed_wait_ms.max(0.0) * 1e6) as u64 }),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchDecision {
    /// Drop the first `expired` queued requests (they cannot make their
    /// deadline), then run the next `n` as one batch (`n` may be 0).
    Dispatch { expired: usize, n: usize },
    /// Drop the first `expired`, then look again at `at` (or when work arrives).
    WaitUntil { expired: usize, at: u64 },
}

#[derive(Clone, Debug)]
pub struct BatchFormer {
    pub policy: BatchPolicy,
    pub max_batch: u32,
    /// AIMD limit on the batch size, `1..=max_batch`.
    pub limit: u32,
    pub profile: LatencyProfile,
    /// Longest delayed-batching wait.
    pub max_wait_ns: u64,
    /// Multiplicative cut of the limit on overrun.
    pub decrease: f64,
    /// Drop requests whose deadline passed (the default). Off, they still
    /// run (late), e.g. when most of their cost was already spent upstream.
    pub drop_late: bool,
    /// For variable-length inputs: batches by length (None: by count only).
    pub length: Option<LengthModel>,
    /// For an elastic stage, the time a batch keeps back from its budget,
    /// and the least it takes, ns (see the module doc); None: a batch takes
    /// what its profile says, whatever its budget.
    pub elastic_floor_ns: Option<u64>,
    /// Mean gap between arrivals (EWMA), ns; 0 when unknown.
    gap_ns: f64,
    last_arrival: Option<u64>,
}

const US: f64 = 1_000.0;

impl BatchFormer {
    pub fn new(policy: BatchPolicy, max_batch: u32, profile: LatencyProfile) -> BatchFormer {
        let max_batch = max_batch.max(1);
        BatchFormer {
            policy,
            max_batch,
            limit: max_batch,
            profile,
            max_wait_ns: 2_000_000,
            decrease: 0.75,
            drop_late: true,
            length: None,
            elastic_floor_ns: None,
            gap_ns: 0.0,
            last_arrival: None,
        }
    }

    /// Note a request joining the queue (feeds the arrival-rate estimate).
    pub fn on_arrival(&mut self, now: u64) {
        if let Some(prev) = self.last_arrival {
            let gap = now.saturating_sub(prev) as f64;
            self.gap_ns = if self.gap_ns == 0.0 { gap } else { self.gap_ns + 0.05 * (gap - self.gap_ns) };
        }
        self.last_arrival = Some(now);
    }

    /// Expected latency (ns) of a batch of `n` at this stage, without margin.
    pub fn mean_ns(&self, n: usize) -> u64 {
        (self.profile.mean(n as u32) * US) as u64
    }

    /// How long a batch expected to take `ns` takes when it has `budget_ns`
    /// before its most urgent request would miss: `ns` for a plain stage;
    /// for an elastic one at most the budget less its floor, and never
    /// under the floor.
    pub fn within(&self, ns: u64, budget_ns: u64) -> u64 {
        match self.elastic_floor_ns {
            Some(floor) => ns.min(budget_ns.saturating_sub(floor).max(floor)),
            None => ns,
        }
    }

    /// What a batch of `n` at this stage adds to a request's path, as the
    /// predictors count it: its expected latency, or for an elastic stage
    /// at most its floor (it answers by the deadline; the floor is what it
    /// needs of the time left).
    pub fn path_ns(&self, n: usize) -> u64 {
        let mean = self.mean_ns(n);
        self.elastic_floor_ns.map_or(mean, |floor| mean.min(floor))
    }

    /// Latency (ns) to plan a batch of `n` with: expected plus margin.
    pub fn predict_ns(&self, n: usize) -> u64 {
        (self.profile.predict(n as u32) * US) as u64
    }

    /// How much a batch of `n` with `padded` positions is expected to take
    /// over the profile's (1 without a length model or a length).
    fn length_scale(&self, n: usize, padded: Option<u64>) -> f64 {
        match (&self.length, padded) {
            (Some(m), Some(p)) => m.scale(n as u32, p),
            _ => 1.0,
        }
    }

    /// Expected latency (ns) of a batch of `n` whose padded length is
    /// `padded` (when known: see [`crate::length`]).
    pub fn expected_ns(&self, n: usize, padded: Option<u64>) -> u64 {
        (self.mean_ns(n) as f64 * self.length_scale(n, padded)) as u64
    }

    /// [`Self::predict_ns`] for the first `n` of a batch whose prefixes have
    /// `padded` positions (`padded[i]`: the first `i + 1`; beyond its end,
    /// grown with the rows).
    fn predict_prefix_ns(&self, n: usize, padded: &[u64]) -> u64 {
        let p = match padded.len() {
            0 => None,
            k if n <= k => Some(padded[n.max(1) - 1]),
            k => Some(padded[k - 1].saturating_mul(n as u64) / k as u64),
        };
        (self.predict_ns(n) as f64 * self.length_scale(n, p)) as u64
    }

    /// Decide what to do with a queue whose deadlines are `deadlines` (most
    /// urgent first). `oldest_enqueued` is when the head joined the queue
    /// (for the fixed policy's wait); `rest_ns` the predicted remaining
    /// critical path after this stage.
    pub fn decide(&self, now: u64, deadlines: &[u64], oldest_enqueued: u64, rest_ns: u64) -> BatchDecision {
        self.decide_padded(now, deadlines, oldest_enqueued, rest_ns, &[])
    }

    /// [`Self::decide`] for requests whose padded lengths are known:
    /// `padded[i]` is the padded length of the first `i + 1` requests that
    /// have not expired (see [`crate::length`]).
    pub fn decide_padded(
        &self,
        now: u64,
        deadlines: &[u64],
        oldest_enqueued: u64,
        rest_ns: u64,
        padded: &[u64],
    ) -> BatchDecision {
        if deadlines.is_empty() {
            return BatchDecision::Dispatch { expired: 0, n: 0 };
        }
        match self.policy {
            BatchPolicy::Fixed { wait_ns } => {
                let n = deadlines.len().min(self.max_batch as usize);
                if n == self.max_batch as usize || now >= oldest_enqueued.saturating_add(wait_ns) {
                    BatchDecision::Dispatch { expired: 0, n }
                } else {
                    BatchDecision::WaitUntil { expired: 0, at: oldest_enqueued + wait_ns }
                }
            }
            BatchPolicy::DeadlineAware => self.decide_deadline_aware(now, deadlines, oldest_enqueued, rest_ns, padded),
        }
    }

    fn decide_deadline_aware(
        &self,
        now: u64,
        deadlines: &[u64],
        oldest_enqueued: u64,
        rest_ns: u64,
        padded: &[u64],
    ) -> BatchDecision {
        // Only requests whose deadline has already passed expire. Predicted
        // misses are refused at admission instead, where an idle replica
        // always admits: expiring on a prediction could starve a stage whose
        // profile is stale (nothing runs, so nothing corrects it).
        let passed = deadlines.iter().take_while(|&&d| d <= now).count();
        let expired = if self.drop_late { passed } else { 0 };
        let live = &deadlines[expired..];
        if live.is_empty() {
            return BatchDecision::Dispatch { expired, n: 0 };
        }
        // The most urgent request that can still make it governs the size
        // (late ones kept by `drop_late = false` ride along).
        let head = deadlines.get(passed).copied().unwrap_or(u64::MAX);
        let cap = live.len().min(self.limit as usize).max(1);
        // Largest n <= cap that still meets the head's deadline; latency
        // grows with n, so scan down from the cap.
        let mut n = cap;
        let budget = head.saturating_sub(now.saturating_add(rest_ns));
        while n > 1 && now + self.within(self.predict_prefix_ns(n, padded), budget) + rest_ns > head {
            n -= 1;
        }
        // No evidence that batching pays (no profile) or no arrivals to wait for.
        let waited = now.saturating_sub(oldest_enqueued);
        if n < live.len()
            || live.len() >= self.limit as usize
            || self.gap_ns <= 0.0
            || self.profile.is_empty()
            || waited >= self.max_wait_ns
        {
            return BatchDecision::Dispatch { expired, n };
        }
        // Delayed batching: everything queued fits and the limit is not reached.
        let target = self.limit as usize;
        let per_item_now = self.predict_prefix_ns(n, padded) as f64 / n as f64;
        let want_wait = ((target - n) as f64 * self.gap_ns) as u64;
        // The head waits at most max_wait in total, however often we look again.
        let mut wait = want_wait.min(self.max_wait_ns - waited);
        // How many are expected by then, and does that batch still make it?
        loop {
            let m = (n + (wait as f64 / self.gap_ns) as usize).min(target);
            if m <= n {
                return BatchDecision::Dispatch { expired, n };
            }
            let per_item_then = self.predict_prefix_ns(m, padded) as f64 / m as f64;
            let left = head.saturating_sub(now + wait + rest_ns);
            let fits = now + wait + self.within(self.predict_prefix_ns(m, padded), left) + rest_ns <= head;
            if fits && per_item_then < 0.9 * per_item_now {
                return BatchDecision::WaitUntil { expired, at: now + wait };
            }
            if !fits && wait > 50_000 {
                wait /= 2;
                continue;
            }
            return BatchDecision::Dispatch { expired, n };
        }
    }

    /// A batch of `n` took `observed_ns`; it had `budget_ns` before its most
    /// urgent request would miss (deadline - dispatch time - rest of the
    /// path). Refine the profile; AIMD on the limit (Clipper): a batch that
    /// blew its budget cuts the limit multiplicatively, one that fit and was
    /// at the limit raises it by one. An elastic stage's batch size does
    /// not make it late, so its limit is not cut.
    pub fn on_batch_done(&mut self, n: usize, observed_ns: u64, budget_ns: u64) {
        if let BatchPolicy::DeadlineAware = self.policy {
            if observed_ns > budget_ns && self.elastic_floor_ns.is_none() {
                self.limit = ((self.limit as f64 * self.decrease) as u32).max(1);
            } else if n as u32 >= self.limit && self.limit < self.max_batch {
                self.limit += 1;
            }
        }
        self.profile.observe(n as u32, observed_ns as f64 / US);
    }

    /// The batch of `n` that just ran had `padded` positions (a stage with
    /// a length model learns the lengths its batches have).
    pub fn on_batch_length(&mut self, n: usize, padded: u64) {
        if let Some(m) = &mut self.length {
            m.observe(n as u32, padded);
        }
    }
}

/// How many more requests than one batch a length-aware batch step looks
/// at, to find ones of similar length.
const LOOKAHEAD: usize = 4;

/// What one batch step took from a queue (see [`take_batch`]).
#[derive(Debug)]
pub struct Taken<T> {
    /// Requests whose deadline passed: the caller fails them.
    pub expired: Vec<T>,
    /// The batch to run now, most urgent first, with each deadline.
    pub batch: Vec<(u64, T)>,
    /// Look again at this time (delayed batching) if nothing arrives first.
    pub wait_until: Option<u64>,
    /// Entries skipped because their request had already finished.
    pub skipped: usize,
    /// The batch's padded length, for a stage with a length model.
    pub padded: Option<u64>,
}

/// The batch step, shared by the node and the simulator: pop up to the
/// former's limit from `queue` (skipping entries for which `finished` says
/// their request already left), ask the former what to do, and put back
/// what waits. `enqueued_ns` tells when an entry joined the queue (for the
/// fixed policy's wait and delayed batching); `rest_ns` is the predicted
/// rest of the critical path after this stage; `length` an entry's size,
/// for a former with a length model (which then looks [`LOOKAHEAD`] batches
/// deep for requests of similar length: see [`crate::length`]).
pub fn take_batch<T>(
    queue: &mut EdfQueue<T>,
    former: &BatchFormer,
    now: u64,
    rest_ns: u64,
    finished: impl Fn(&T) -> bool,
    enqueued_ns: impl Fn(&T) -> u64,
    length: impl Fn(&T) -> Option<Length>,
) -> Taken<T> {
    let limit = match former.policy {
        BatchPolicy::Fixed { .. } => former.max_batch,
        BatchPolicy::DeadlineAware => former.limit,
    } as usize;
    let model = match former.policy {
        BatchPolicy::DeadlineAware => former.length.as_ref(),
        BatchPolicy::Fixed { .. } => None,
    };
    let window = if model.is_some() { limit.saturating_mul(LOOKAHEAD) } else { limit };
    let mut cand: Vec<(u64, T)> = Vec::with_capacity(window.min(queue.len()));
    let mut skipped = 0;
    while cand.len() < window {
        match queue.pop() {
            Some((_, item)) if finished(&item) => skipped += 1,
            Some(x) => cand.push(x),
            None => break,
        }
    }
    // With a length model: of the requests that have not expired, the ones
    // chosen by length, in deadline order; the others wait.
    let mut padded = Vec::new();
    let mut waiting = Vec::new();
    if let Some(model) = model {
        let passed = if former.drop_late { cand.iter().take_while(|(d, _)| *d <= now).count() } else { 0 };
        let live = cand.split_off(passed);
        let lengths: Vec<Option<Length>> = live.iter().map(|(_, x)| length(x)).collect();
        // Can wait for one more batch after this one.
        let patient = now.saturating_add(rest_ns).saturating_add(2 * former.predict_ns(limit));
        let (chosen, _) = choose(&lengths, limit, model, |i| live[i].0 < patient);
        let mut size = BatchLength::default();
        let mut keep = chosen.into_iter().peekable();
        for (i, x) in live.into_iter().enumerate() {
            if keep.peek() == Some(&i) {
                keep.next();
                size = size.with(lengths[i].unwrap_or_default());
                padded.push(size.padded());
                cand.push(x);
            } else {
                waiting.push(x);
            }
        }
    }
    let deadlines: Vec<u64> = cand.iter().map(|(d, _)| *d).collect();
    let oldest = cand.iter().chain(&waiting).map(|(_, x)| enqueued_ns(x)).min().unwrap_or(now);
    let (expired, n, wait_until) = match former.decide_padded(now, &deadlines, oldest, rest_ns, &padded) {
        BatchDecision::Dispatch { expired, n } => (expired, n, None),
        // Requests left out by length are queued: nothing to wait for.
        BatchDecision::WaitUntil { expired, .. } if !waiting.is_empty() => (expired, deadlines.len() - expired, None),
        BatchDecision::WaitUntil { expired, at } => (expired, 0, Some(at)),
    };
    let mut batch = cand.split_off(expired.min(cand.len()));
    for (d, x) in batch.split_off(n.min(batch.len())).into_iter().chain(waiting) {
        queue.push(d, x);
    }
    let padded = (model.is_some() && !batch.is_empty()).then(|| padded.get(batch.len() - 1).copied().unwrap_or(0));
    Taken { expired: cand.into_iter().map(|(_, x)| x).collect(), batch, wait_until, skipped, padded }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::length::{Length, LengthModel};

    const MS: u64 = 1_000_000;

    #[test]
    fn batch_step_skips_finished_expires_late_and_puts_back_the_rest() {
        let mut f = former();
        f.limit = 3;
        let mut q = EdfQueue::new();
        // (id, enqueued): 1 has finished, 2 is late at 10 ms, the rest are live.
        for (d, id) in [(5 * MS, 1u32), (8 * MS, 2), (100 * MS, 3), (100 * MS, 4), (100 * MS, 5), (100 * MS, 6)] {
            q.push(d, id);
        }
        let t = take_batch(&mut q, &f, 10 * MS, 0, |&id| id == 1, |_| 0, |_| None);
        assert_eq!(t.skipped, 1);
        assert_eq!(t.expired, vec![2]);
        assert_eq!(t.batch.iter().map(|(_, id)| *id).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(t.wait_until, None);
        assert_eq!(q.len(), 2, "beyond the limit stays queued");
        let t = take_batch(&mut q, &f, 10 * MS, 0, |_| false, |_| 0, |_| None);
        assert_eq!(t.batch.len(), 2);
        assert!(q.is_empty());
    }

    #[test]
    fn a_length_aware_step_groups_similar_lengths_and_keeps_the_rest_queued() {
        let mut f = former();
        f.limit = 3;
        f.length = Some(LengthModel::new(None));
        let mut q = EdfQueue::new();
        // (id, length): deadlines in id order, all with ample slack.
        for (id, len) in [(1u32, 10u64), (2, 100), (3, 12), (4, 90), (5, 11), (6, 95)] {
            q.push(1_000 * MS + id as u64, (id, len));
        }
        let length = |&(_, len): &(u32, u64)| Some(Length { rows: 1, longest: len });
        let t = take_batch(&mut q, &f, 0, 0, |_| false, |_| 0, length);
        assert_eq!(t.batch.iter().map(|(_, (id, _))| *id).collect::<Vec<_>>(), vec![1, 3, 5]);
        assert_eq!(t.padded, Some(36));
        let t = take_batch(&mut q, &f, 0, 0, |_| false, |_| 0, length);
        assert_eq!(t.batch.iter().map(|(_, (id, _))| *id).collect::<Vec<_>>(), vec![2, 4, 6]);
        assert_eq!(t.padded, Some(300));
        assert!(q.is_empty());
        // A request that cannot wait for another batch goes now, whatever its length.
        for (id, d) in [(1u32, 1_000 * MS), (2, 3 * MS), (3, 1_000 * MS), (4, 1_000 * MS)] {
            q.push(d, (id, if id == 2 { 100 } else { 10 }));
        }
        let t = take_batch(&mut q, &f, 0, 0, |_| false, |_| 0, length);
        assert_eq!(t.batch.first().map(|(_, (id, _))| *id), Some(2), "most urgent first");
        assert_eq!(t.batch.len(), 3);
        // A budget that leaves requests out never delays the batch for more.
        let mut g = former();
        g.length = Some(LengthModel::new(Some(25)));
        for t in 0..100u64 {
            g.on_arrival(t * 50_000);
        }
        let mut q = EdfQueue::new();
        for (id, len) in [(1u32, 10u64), (2, 30)] {
            q.push(1_000 * MS + id as u64, (id, len));
        }
        let t = take_batch(&mut q, &g, 0, 0, |_| false, |_| 0, length);
        assert_eq!((t.batch.len(), t.wait_until), (1, None));
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn a_longer_batch_is_predicted_slower() {
        let mut f = former();
        f.length = Some(LengthModel::new(None));
        for _ in 0..20 {
            f.on_batch_length(4, 100);
        }
        assert_eq!(f.expected_ns(4, None), f.mean_ns(4));
        assert_eq!(f.expected_ns(4, Some(200)), 2 * f.mean_ns(4));
        // Sizing to the head's deadline sees the length: the same deadline
        // allows fewer long requests than short ones.
        let deadlines = vec![2 * MS; 10];
        let short: Vec<u64> = (1..=10).map(|n| n * 10).collect();
        let long: Vec<u64> = (1..=10).map(|n| n * 100).collect();
        let n = |padded: &[u64]| match f.decide_padded(0, &deadlines, 0, 0, padded) {
            BatchDecision::Dispatch { n, .. } => n,
            d => panic!("{d:?}"),
        };
        assert!(n(&long) < n(&short), "{} vs {}", n(&long), n(&short));
    }

    /// 1 ms + 0.1 ms per request: batching pays.
    fn linear() -> LatencyProfile {
        LatencyProfile::from_measurements(&[(1, 1100.0, 1100.0), (64, 7400.0, 7400.0)])
    }

    fn former() -> BatchFormer {
        BatchFormer::new(BatchPolicy::DeadlineAware, 64, linear())
    }

    #[test]
    fn takes_everything_when_slack_allows() {
        let f = former();
        let deadlines = vec![100 * MS; 10];
        assert_eq!(f.decide(0, &deadlines, 0, 0), BatchDecision::Dispatch { expired: 0, n: 10 });
    }

    #[test]
    fn sizes_the_batch_to_the_most_urgent_deadline() {
        let f = former();
        // Head must finish by 3 ms with 1 ms of downstream work: L(n) <= 2 ms -> n <= 10.
        let mut deadlines = vec![3 * MS];
        deadlines.extend(std::iter::repeat_n(100 * MS, 40));
        match f.decide(0, &deadlines, 0, MS) {
            BatchDecision::Dispatch { expired: 0, n } => {
                assert_eq!(n, 10);
                assert!(f.predict_ns(n) + MS <= 3 * MS && f.predict_ns(n + 1) + MS > 3 * MS);
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn an_elastic_stage_runs_the_whole_queue_and_keeps_its_limit() {
        // Profiled at 1 ms + 0.1 ms a request, but it answers by its budget.
        let mut f = former();
        f.elastic_floor_ns = Some(MS);
        let mut deadlines = vec![3 * MS];
        deadlines.extend(std::iter::repeat_n(100 * MS, 40));
        // A plain stage runs 10 of them (see above); an elastic one all 41:
        // the batch ends by the head's deadline whatever its size.
        assert_eq!(f.decide(0, &deadlines, 0, MS), BatchDecision::Dispatch { expired: 0, n: 41 });
        assert_eq!(f.within(5 * MS, 3 * MS), 2 * MS, "clipped to the budget less the floor");
        assert_eq!(f.within(5 * MS, MS / 2), MS, "never under the floor");
        assert_eq!(f.within(MS / 2, 3 * MS), MS / 2, "a short batch keeps its time");
        // Less time than its floor: a batch of one, as a plain stage would.
        assert_eq!(f.decide(0, &deadlines, 0, 2_500_000), BatchDecision::Dispatch { expired: 0, n: 1 });
        // What the predictors count: at most the floor.
        assert_eq!(f.path_ns(64), MS);
        assert_eq!(former().path_ns(64), former().mean_ns(64));
        // An overrun does not cut an elastic stage's limit; it does a plain one's.
        f.limit = 32;
        f.on_batch_done(16, 5 * MS, 2 * MS);
        assert_eq!(f.limit, 32);
        let mut plain = former();
        plain.limit = 32;
        plain.on_batch_done(16, 5 * MS, 2 * MS);
        assert_eq!(plain.limit, 24);
    }

    #[test]
    fn expires_requests_whose_deadline_passed() {
        let f = former();
        let deadlines = [4 * MS, 5 * MS, 50 * MS];
        assert_eq!(f.decide(5 * MS, &deadlines, 0, 0), BatchDecision::Dispatch { expired: 2, n: 1 });
        assert_eq!(f.decide(60 * MS, &deadlines, 0, 0), BatchDecision::Dispatch { expired: 3, n: 0 });
        // A request that can no longer make it but has not passed its deadline runs.
        assert_eq!(f.decide(5 * MS, &[5_500_000], 0, 0), BatchDecision::Dispatch { expired: 0, n: 1 });
    }

    #[test]
    fn late_requests_run_when_dropping_is_off() {
        let mut f = former();
        f.drop_late = false;
        let deadlines = [4 * MS, 5 * MS, 50 * MS];
        // Nothing dropped; the 50 ms deadline sizes the batch, so all three go.
        assert_eq!(f.decide(6 * MS, &deadlines, 0, 0), BatchDecision::Dispatch { expired: 0, n: 3 });
        assert_eq!(f.decide(60 * MS, &deadlines, 0, 0), BatchDecision::Dispatch { expired: 0, n: 3 });
    }

    #[test]
    fn delays_only_when_slack_allows_and_batching_pays() {
        let mut f = former();
        for t in 0..100u64 {
            f.on_arrival(t * 50_000); // one arrival every 50 µs
        }
        // Two queued, deadline far away: wait for more (bounded by max_wait).
        match f.decide(0, &[100 * MS, 100 * MS], 0, 0) {
            BatchDecision::WaitUntil { expired: 0, at } => assert!(at > 0 && at <= f.max_wait_ns),
            d => panic!("expected a wait, got {d:?}"),
        }
        // Looking again later never extends the head's total wait past max_wait.
        match f.decide(MS, &[100 * MS, 100 * MS], 0, 0) {
            BatchDecision::WaitUntil { expired: 0, at } => assert!(at <= f.max_wait_ns),
            d => panic!("expected a wait, got {d:?}"),
        }
        assert_eq!(f.decide(f.max_wait_ns, &[100 * MS; 2], 0, 0), BatchDecision::Dispatch { expired: 0, n: 2 });
        // No profile: no evidence that batching pays, so no wait.
        let mut blind = BatchFormer::new(BatchPolicy::DeadlineAware, 64, LatencyProfile::default());
        blind.on_arrival(0);
        blind.on_arrival(50_000);
        assert_eq!(blind.decide(0, &[100 * MS; 2], 0, 0), BatchDecision::Dispatch { expired: 0, n: 2 });
        // Tight deadline: no slack to wait, dispatch now.
        assert_eq!(f.decide(0, &[1_150_000, 100 * MS], 0, 0), BatchDecision::Dispatch { expired: 0, n: 1 });
        assert_eq!(f.decide(0, &[1_200_000, 100 * MS], 0, 0), BatchDecision::Dispatch { expired: 0, n: 2 });
        // Flat profile (batching does not pay): no wait.
        let mut flat = BatchFormer::new(
            BatchPolicy::DeadlineAware,
            64,
            LatencyProfile::from_measurements(&[(1, 100.0, 100.0), (64, 6400.0, 6400.0)]),
        );
        for t in 0..100u64 {
            flat.on_arrival(t * 50_000);
        }
        assert_eq!(flat.decide(0, &[100 * MS, 100 * MS], 0, 0), BatchDecision::Dispatch { expired: 0, n: 2 });
        // Unknown arrival rate: no wait.
        assert_eq!(former().decide(0, &[100 * MS; 2], 0, 0), BatchDecision::Dispatch { expired: 0, n: 2 });
    }

    #[test]
    fn aimd_backs_off_when_a_batch_blows_its_budget_and_recovers() {
        let mut f = former();
        assert_eq!(f.limit, 64);
        f.on_batch_done(64, 30 * MS, 10 * MS); // 30 ms against 10 ms of slack: a miss
        assert_eq!(f.limit, 48);
        f.on_batch_done(48, 60 * MS, 10 * MS);
        assert_eq!(f.limit, 36);
        // Within budget at the limit: additive increase; below the limit: unchanged.
        f.on_batch_done(36, 5 * MS, 10 * MS);
        assert_eq!(f.limit, 37);
        f.on_batch_done(3, 5 * MS, 10 * MS);
        assert_eq!(f.limit, 37);
        // The limit caps what one decision takes.
        let d = f.decide(0, &vec![1_000 * MS; 200], 0, 0);
        assert_eq!(d, BatchDecision::Dispatch { expired: 0, n: 37 });
    }

    #[test]
    fn fixed_policy_waits_for_a_full_batch_or_the_timeout() {
        let f = BatchFormer::new(BatchPolicy::Fixed { wait_ns: 2 * MS }, 8, linear());
        assert_eq!(f.decide(MS, &[0; 3], 0, 0), BatchDecision::WaitUntil { expired: 0, at: 2 * MS });
        assert_eq!(f.decide(2 * MS, &[0; 3], 0, 0), BatchDecision::Dispatch { expired: 0, n: 3 });
        assert_eq!(f.decide(0, &[0; 20], 0, 0), BatchDecision::Dispatch { expired: 0, n: 8 });
    }
}
