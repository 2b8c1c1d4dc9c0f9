//! Admission control's last word: how much of a request's deadline budget
//! the predicted finish may use before the request is refused.
//!
//! The node predicts a new request's finish from the queues ahead of it on
//! its route and the latency profiles. That prediction is an *expected*
//! value, and the SLO is on the tail, so refusing only requests whose
//! expected finish overshoots lets through requests that then miss (in
//! overload most admitted requests sit right at the edge). The gate keeps a
//! headroom factor `h` and admits while `predicted <= h * budget`. It learns
//! `h` from outcomes, AIMD over control intervals (as Clipper sizes batches,
//! and as Breakwater sizes its credits from measured delay): every interval
//! (100 ms and at least 20 finished requests) folds its miss rate among
//! admitted requests into a moving average. An interval that misses more
//! than the target (half the SLO's allowed rate) while the average is above
//! it too cuts `h` by 15%; while the average is at or under half the target,
//! each interval raises `h` by 0.02, or by a fifth of the way to 1 if that
//! is more. Counting per interval and averaging matters: misses come in
//! bursts (a stall delays everything queued), and a per-request rule swings
//! `h` from its floor to 1 and back within a fraction of a second, settling
//! at a miss rate well above the target.
//!
//! A cut needs the misses to be the queue's doing. Each outcome comes with
//! the share of its budget its prediction used at admission; requests
//! admitted with at most half the headroom ("far" from the limit) should
//! not miss because of the queue. When they miss at least half as often as
//! the interval as a whole (and there are enough of them to tell), the
//! misses come from somewhere admission cannot reach, such as the CPU taken
//! by a storm of requests the node is refusing, and a cut would only refuse
//! more: on the no-op chain at 1.5x its capacity the gate cut to its floor
//! and the goodput fell from 15,000 to 2,200 a second while the misses went
//! on. Such intervals neither cut nor raise.
//!
//! Recovery after a load spike is asymmetric on purpose. The average rises
//! with weight 0.25 (about the last half second) but falls with weight 0.5,
//! a clean interval never cuts, and the raise is proportional to the gap:
//! a 1 s burst of misses drives `h` to its floor, and the rule brings it
//! back to 0.8 about 1.3 s after the burst ends (about 0.8 s to forget,
//! 0.5 s to climb). With a symmetric average and a fixed +0.02, clean intervals
//! kept cutting for a second after the burst and the climb took 4 s: the
//! fault soak measured a steady load's goodput 8% below its level 2 s after
//! a burst.
//!
//! The gate also keeps its own, model-free estimate of the time a new
//! request will spend in the pipeline, by Little's law: the requests
//! admitted and not yet finished, over the rate at which the pipeline
//! finishes requests *while it is saturated*: completions per unit of busy
//! time, over windows in which most admitted requests found requests
//! waiting in a queue on their route. The per-stage model (queues times
//! profiled batch latency) misses what the profile does not know, such as
//! replicas slowed down by CPU contention with each other and with the
//! node; this estimate sees it, because it is measured. While the gate is
//! holding back (its headroom cut by misses) admission uses the larger of
//! the two; while admitted requests meet their deadlines, the model alone.
//! A saturated window is a weak test at the knee of a pipeline of slow
//! stages (two busy replicas make one queued request), where the rate it
//! measures is the load, not the capacity, and the estimate then refused
//! requests that would all have met their deadline (see `measured_ns`).
//!
//! A pipeline with an elastic stage (see [`crate::BatchFormer::within`])
//! has no such estimate: its elastic stage spends whatever time its
//! requests have left, so their time in the pipeline sits near the
//! deadline at any load, and Little's law would read the deadline as a
//! queue and refuse the load the stage absorbs.
//!
//! Only saturated windows count because below capacity the completion rate
//! is not the pipeline's capacity: with a few requests in flight at a time
//! it is about their number over their latency, and a pipeline that
//! batches and runs stages in parallel serves many times that when a burst
//! arrives. Counting every busy window, the echo chain at 6,000 requests/s
//! (18,000 possible) measured 140-900 completions/s, and refused most of a
//! burst of 200 requests sent at once (8 in flight read as 57 ms) that,
//! all admitted, finished within 41 ms. Until a saturated window has been
//! seen the estimate is unknown and admission uses the model alone.
//!
//! Priority classes (DAGOR's business priority, as a request header): under
//! overload the low class is shed first. A `Low` request must fit within
//! half the headroom, a `High` one within the headroom raised halfway to
//! 1, a `Normal` one within the headroom itself. Admission is decided once,
//! at ingress, for the whole DAG (stages on other nodes do not admit
//! again), so a request's class is honoured consistently along its graph.
//!
//! Pure logic: the caller reports admissions and outcomes, with its clock.

/// Fraction of `h` cut after an interval with too many misses.
const DECREASE: f64 = 0.15;
/// Raise of `h` after an interval with few misses: at least this, or this
/// share of the way to 1.
const INCREASE: f64 = 0.02;
const RECOVER: f64 = 0.2;
/// Weights of an interval's miss rate in the average when it is above the
/// average, and when it is below (a burst is forgotten faster than learned).
const LEARN: f64 = 0.25;
const FORGET: f64 = 0.5;
/// Control interval, ns, and the fewest outcomes that make one.
const INTERVAL_NS: u64 = 100_000_000;
const INTERVAL_MIN: u64 = 20;
/// The lowest headroom: never refuse what is predicted to finish within
/// this fraction of its budget.
pub const MIN_HEADROOM: f64 = 0.25;
/// Share of its budget an answered request must finish within to count as
/// met: the gate aims a little inside the deadline, because the client also
/// sees time the node does not (before the node reads the request, after it
/// writes the answer), and that grows when the machine is overloaded.
const MET_SHARE: f64 = 0.95;

/// The fewest misses that cut, counted since the last cut while the
/// average stays above the target. A slow pipeline's interval is its 20
/// outcomes (about a second of multimodal at 23 req/s), so one answer in
/// its tail is 5%, ten times the target, at any load: cut on it, the
/// headroom fell to 0.85 twice a minute at 24 req/s (81% of the limit),
/// and the gate refused 4% of the requests there while, ungated, 0.7%
/// missed. Two misses in a row of such intervals are a trend; a fast
/// pipeline's bad interval has many.
const CUT_MIN_MISSES: u64 = 2;

/// Outcomes admitted with at most this share of the headroom are "far"
/// from the limit; the fewest far outcomes that tell whether misses are
/// the queue's doing.
const FAR_SHARE: f64 = 0.5;
const FAR_MIN: u64 = 10;

/// A request's class for admission (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    /// From its name (`high`, `normal`, `low`), as requests give it.
    pub fn parse(name: &str) -> Option<Priority> {
        match name.trim().to_ascii_lowercase().as_str() {
            "high" => Some(Priority::High),
            "normal" => Some(Priority::Normal),
            "low" => Some(Priority::Low),
            _ => None,
        }
    }

    /// The share of the budget a request of this class may be predicted
    /// to use, given the gate's headroom `h`.
    fn headroom(self, h: f64) -> f64 {
        match self {
            Priority::High => h + (1.0 - h) / 2.0,
            Priority::Normal => h,
            Priority::Low => h / 2.0,
        }
    }
}

/// Busy time over which a completion rate is measured, ns.
const WINDOW_NS: u64 = 20_000_000;

#[derive(Clone, Debug)]
pub struct AdmissionGate {
    headroom: f64,
    /// Miss rate among admitted requests to aim for.
    target: f64,
    /// Moving average of the intervals' miss rates.
    miss_avg: f64,
    interval_start: u64,
    interval_done: u64,
    interval_missed: u64,
    interval_far_done: u64,
    interval_far_missed: u64,
    /// Misses since the last cut, while the average stays above the
    /// target (see [`CUT_MIN_MISSES`]).
    recent_misses: u64,
    /// Admitted and not finished.
    inflight: u64,
    /// Completions per ns of busy time while saturated (EWMA over windows);
    /// 0 while unknown.
    rate: f64,
    window_busy: u64,
    window_done: u64,
    /// Admissions in the current window, and those that found a queue.
    window_admitted: u64,
    window_queued: u64,
    last_event: u64,
    /// Keeps the Little's-law estimate (off for a pipeline with an elastic stage).
    sojourn: bool,
}

impl AdmissionGate {
    /// A gate aiming for an admitted-request miss rate of about
    /// `max_miss_rate / 2` (e.g. 0.005 for an SLO allowing 1%).
    pub fn new(max_miss_rate: f64) -> AdmissionGate {
        AdmissionGate {
            headroom: 1.0,
            target: (max_miss_rate / 2.0).clamp(1e-4, 0.25),
            miss_avg: 0.0,
            interval_start: 0,
            interval_done: 0,
            interval_missed: 0,
            interval_far_done: 0,
            interval_far_missed: 0,
            recent_misses: 0,
            inflight: 0,
            rate: 0.0,
            window_busy: 0,
            window_done: 0,
            window_admitted: 0,
            window_queued: 0,
            last_event: 0,
            sojourn: true,
        }
    }

    /// The gate of a pipeline with an elastic stage (`elastic`): no
    /// Little's-law estimate (see the module doc); otherwise as is.
    pub fn with_elastic(mut self, elastic: bool) -> AdmissionGate {
        self.sojourn = !elastic;
        self
    }

    /// Count the time since the last admission or finish as busy if
    /// anything was in flight.
    fn advance(&mut self, now: u64) {
        if self.inflight > 0 {
            self.window_busy += now.saturating_sub(self.last_event);
        }
        self.last_event = self.last_event.max(now);
    }

    /// A request was admitted at `now`; `found_queue`: requests were
    /// waiting in a queue on its route (not only a batch running), the
    /// sign of a saturated pipeline.
    pub fn on_admit(&mut self, now: u64, found_queue: bool) {
        self.advance(now);
        self.inflight += 1;
        self.window_admitted += 1;
        self.window_queued += u64::from(found_queue);
    }

    /// An admitted request left the pipeline at `now`: answered within its
    /// deadline (`Some(true)`), missed it (`Some(false)`: answered late,
    /// dropped late or timed out), or failed for another reason (`None`).
    /// Counted as admitted near the limit (see [`Self::on_finish_with`]).
    pub fn on_finish(&mut self, now: u64, met: Option<bool>) {
        self.on_finish_with(now, met, 1.0);
    }

    /// As [`Self::on_finish`], for a request whose prediction used `share`
    /// of its budget at admission ([`Self::decide`]'s `Ok`).
    pub fn on_finish_with(&mut self, now: u64, met: Option<bool>, share: f64) {
        self.advance(now);
        self.inflight = self.inflight.saturating_sub(1);
        if let Some(met) = met {
            self.on_outcome(now, met, share);
        }
        self.window_done += 1;
        if self.window_busy >= WINDOW_NS {
            // A window in which most admissions found a queue measured
            // what the pipeline can serve; any other, what it was asked.
            if self.window_admitted > 0 && 2 * self.window_queued >= self.window_admitted {
                let seen = self.window_done as f64 / self.window_busy as f64;
                self.rate = if self.rate == 0.0 { seen } else { self.rate + 0.3 * (seen - self.rate) };
            }
            self.window_busy = 0;
            self.window_done = 0;
            self.window_admitted = 0;
            self.window_queued = 0;
        }
    }

    /// Whether an answer that took `took_ns` of its `budget_ns` counts as
    /// met for the gate (see `on_finish`).
    pub fn counts_as_met(took_ns: u64, budget_ns: u64) -> bool {
        took_ns as f64 <= MET_SHARE * budget_ns as f64
    }

    /// Little's law: expected time in the pipeline for a request admitted
    /// now (ns); 0 until a completion rate is known.
    pub fn sojourn_ns(&self) -> u64 {
        if self.rate <= 0.0 || !self.sojourn {
            0
        } else {
            (self.inflight as f64 / self.rate) as u64
        }
    }

    /// The Little's-law estimate as admission uses it: only while the gate
    /// is holding back (headroom under 1, after admitted requests missed).
    /// At the knee of a pipeline of slow stages, windows in which most
    /// admissions found a queue are common well below capacity (two
    /// replicas both busy is enough), and their completion rate is the
    /// load, not the capacity: multimodal offered 23 req/s (78% of its
    /// limit) read 22 completions a second where its two VisionEncoder
    /// replicas serve 30, took 11 requests in flight for 504 ms, and
    /// refused 1.8% of the requests while nothing missed; without the
    /// gate the same load met every deadline. The model's prediction
    /// stands alone until misses say it falls short.
    fn measured_ns(&self) -> u64 {
        if self.headroom < 1.0 {
            self.sojourn_ns()
        } else {
            0
        }
    }

    pub fn headroom(&self) -> f64 {
        self.headroom
    }

    /// Admit a (normal) request predicted to finish `predicted_ns` from now
    /// with `budget_ns` left before its deadline?
    pub fn admits(&self, predicted_ns: u64, budget_ns: u64) -> bool {
        predicted_ns as f64 <= self.limit(budget_ns, Priority::Normal)
    }

    /// How much of `budget_ns` a request of class `class` may be predicted
    /// to take, ns.
    fn limit(&self, budget_ns: u64, class: Priority) -> f64 {
        class.headroom(self.headroom) * budget_ns as f64
    }

    /// The admission step, shared by the node and the simulator: admit a
    /// request whose route predicts `p`, with `budget_ns` left before its
    /// deadline? Its predicted time in the pipeline is the larger of the
    /// route's (queues times profiled latency) and the gate's own measured
    /// one (Little's law), and must fit within the headroom share of the
    /// budget; a request whose route is idle is always admitted. `Ok`
    /// carries the share of the budget the prediction uses (for
    /// [`Self::on_finish_with`]), `Err` the predicted overshoot, ns.
    pub fn decide(&self, p: crate::Prediction, budget_ns: u64) -> Result<f64, u64> {
        self.decide_for(p, budget_ns, Priority::Normal)
    }

    /// [`Self::decide`] for a request of class `class`.
    pub fn decide_for(&self, p: crate::Prediction, budget_ns: u64, class: Priority) -> Result<f64, u64> {
        let predicted = p.ns.max(self.measured_ns());
        let limit = self.limit(budget_ns, class);
        if !p.queued || predicted as f64 <= limit {
            Ok(if budget_ns == 0 { 1.0 } else { predicted as f64 / budget_ns as f64 })
        } else {
            Err(predicted.saturating_sub(limit as u64))
        }
    }

    /// Admitted requests not finished yet.
    pub fn inflight(&self) -> u64 {
        self.inflight
    }

    /// An admitted request finished at `now`: within its deadline or not
    /// (dropped late and timed out count as not).
    fn on_outcome(&mut self, now: u64, met: bool, share: f64) {
        self.interval_done += 1;
        self.interval_missed += u64::from(!met);
        self.recent_misses += u64::from(!met);
        if share <= FAR_SHARE * self.headroom {
            self.interval_far_done += 1;
            self.interval_far_missed += u64::from(!met);
        }
        if now.saturating_sub(self.interval_start) < INTERVAL_NS || self.interval_done < INTERVAL_MIN {
            return;
        }
        let rate = self.interval_missed as f64 / self.interval_done as f64;
        let weight = if rate > self.miss_avg { LEARN } else { FORGET };
        self.miss_avg += weight * (rate - self.miss_avg);
        let far_rate = self.interval_far_missed as f64 / self.interval_far_done.max(1) as f64;
        let unexplained = self.interval_far_done >= FAR_MIN && far_rate >= 0.5 * rate;
        if rate > self.target && self.miss_avg > self.target {
            if !unexplained && self.recent_misses >= CUT_MIN_MISSES {
                self.headroom = (self.headroom * (1.0 - DECREASE)).max(MIN_HEADROOM);
                self.recent_misses = 0;
            }
        } else if self.miss_avg <= self.target / 2.0 {
            self.headroom = (self.headroom + INCREASE.max(RECOVER * (1.0 - self.headroom))).min(1.0);
        }
        if self.miss_avg <= self.target {
            self.recent_misses = 0;
        }
        self.interval_start = now;
        self.interval_done = 0;
        self.interval_missed = 0;
        self.interval_far_done = 0;
        self.interval_far_missed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_counts_as_met_a_little_inside_its_deadline() {
        assert!(AdmissionGate::counts_as_met(95, 100));
        assert!(!AdmissionGate::counts_as_met(96, 100));
    }

    /// 40 requests in flight while one finishes (and one arrives) every ms for 200 ms.
    fn forty_in_flight_one_per_ms(g: &mut AdmissionGate) {
        let ms = 1_000_000;
        for _ in 0..40 {
            g.on_admit(0, true);
        }
        for t in 1..=200u64 {
            g.on_admit(t * ms, true);
            g.on_finish(t * ms, Some(true));
        }
    }

    #[test]
    fn decides_on_the_larger_estimate_and_always_admits_an_idle_route() {
        use crate::Prediction;
        let mut g = AdmissionGate::new(0.01);
        assert_eq!(g.decide(Prediction { ns: 40, queued: true }, 50), Ok(0.8));
        assert_eq!(g.decide(Prediction { ns: 60, queued: true }, 50), Err(10));
        assert_eq!(g.decide(Prediction { ns: 60, queued: false }, 50), Ok(1.2));
        // Little's law: 40 in flight, finishing 1 per ms -> ~40 ms, above the route's 10 ms.
        let ms = 1_000_000;
        forty_in_flight_one_per_ms(&mut g);
        assert_eq!(g.inflight(), 40);
        g.headroom = 0.99; // holding back, after misses (the_measured_estimate_waits_for_misses)
        assert!(g.decide(Prediction { ns: 10 * ms, queued: true }, 30 * ms).is_err());
        assert!(g.decide(Prediction { ns: 10 * ms, queued: true }, 50 * ms).is_ok());
    }

    #[test]
    fn the_measured_estimate_waits_for_misses() {
        use crate::Prediction;
        // The same 40 in flight at 1 per ms, every request meeting its
        // deadline: the gate is not holding back, so the route's 10 ms
        // prediction decides (the completion rate may be the load).
        let mut g = AdmissionGate::new(0.01);
        forty_in_flight_one_per_ms(&mut g);
        assert!(g.sojourn_ns() > 30 * MS, "still measured and reported");
        assert!(g.decide(Prediction { ns: 10 * MS, queued: true }, 30 * MS).is_ok());
        // Misses cut the headroom; from then on the estimate counts.
        for t in 0..40u64 {
            g.on_admit(300 * MS + t * MS, true);
            g.on_finish(300 * MS + t * 5 * MS, Some(t % 4 != 0));
        }
        assert!(g.headroom() < 1.0);
        assert!(g.decide(Prediction { ns: 10 * MS, queued: true }, 30 * MS).is_err());
    }

    #[test]
    fn the_rate_is_learned_only_while_saturated() {
        use crate::Prediction;
        // The same 40 in flight finishing 1 per ms, but nothing ever queued:
        // that is the load, not the capacity, and teaches nothing.
        let mut g = AdmissionGate::new(0.01);
        for _ in 0..40 {
            g.on_admit(0, false);
        }
        for t in 1..=200u64 {
            g.on_admit(t * MS, false);
            g.on_finish(t * MS, Some(true));
        }
        assert_eq!(g.sojourn_ns(), 0, "unknown");
        assert!(g.decide(Prediction { ns: 10 * MS, queued: true }, 30 * MS).is_ok());
        // Saturated windows teach it: the same pattern, every request
        // finding a queue (80 in flight now, finishing 1 per ms).
        for t in 201..=400u64 {
            g.on_admit(t * MS, true);
            g.on_finish(t * MS, Some(true));
        }
        g.headroom = 0.99;
        assert!(g.sojourn_ns() > 30 * MS);
        assert!(g.decide(Prediction { ns: 10 * MS, queued: true }, 30 * MS).is_err());
    }

    #[test]
    fn starts_at_the_full_budget() {
        let g = AdmissionGate::new(0.01);
        assert!(g.admits(50, 50));
        assert!(!g.admits(51, 50));
    }

    const MS: u64 = 1_000_000;

    /// One control interval of `n` outcomes, `missed` of them misses, ending at `end_ms`.
    fn interval(g: &mut AdmissionGate, end_ms: u64, n: u64, missed: u64) {
        for i in 0..n {
            let at = if i + 1 == n { end_ms * MS } else { (end_ms - 50) * MS };
            g.on_admit(at, true);
            g.on_finish(at, Some(i >= missed));
        }
    }

    #[test]
    fn bad_intervals_tighten_and_good_ones_loosen() {
        let mut g = AdmissionGate::new(0.01);
        interval(&mut g, 100, 100, 4); // 4%: average 1% > 0.5%
        assert!((g.headroom() - 0.85).abs() < 1e-12);
        assert!(!g.admits(90, 100) && g.admits(85, 100));
        interval(&mut g, 200, 100, 2); // 2%, average 1.25%: still too many
        assert!((g.headroom() - 0.85 * 0.85).abs() < 1e-12);
        interval(&mut g, 300, 1000, 0); // a clean interval never cuts (average 0.63%)
        assert!((g.headroom() - 0.85 * 0.85).abs() < 1e-12);
        interval(&mut g, 400, 1000, 0); // 0.31%: between half the target and the target
        assert!((g.headroom() - 0.85 * 0.85).abs() < 1e-12);
        interval(&mut g, 500, 1000, 0); // 0.16%: raise by a fifth of the gap
        let h = 0.85 * 0.85;
        assert!((g.headroom() - (h + 0.2 * (1.0 - h))).abs() < 1e-12);
        for k in 6..40 {
            interval(&mut g, k * 100, 100, 0);
        }
        assert_eq!(g.headroom(), 1.0);
    }

    #[test]
    fn one_miss_does_not_cut_two_do() {
        // A slow pipeline: intervals of 20 outcomes, one of which misses.
        let mut g = AdmissionGate::new(0.01);
        interval(&mut g, 100, 20, 1);
        assert_eq!(g.headroom(), 1.0, "one answer in the tail is not a trend");
        interval(&mut g, 200, 20, 1);
        assert!((g.headroom() - 0.85).abs() < 1e-12, "a second while the average is up: {}", g.headroom());
        // Misses far apart (the average back under the target between them) never add up.
        let mut g = AdmissionGate::new(0.01);
        for k in 0..20 {
            interval(&mut g, 1000 * k + 100, 20, 1);
            for j in 2..=9 {
                interval(&mut g, 1000 * k + 100 * j, 20, 0);
            }
        }
        assert_eq!(g.headroom(), 1.0);
    }

    #[test]
    fn one_bad_interval_cuts_once() {
        let mut g = AdmissionGate::new(0.01);
        interval(&mut g, 100, 500, 200); // 40%: one cut per interval, not one per miss
        assert!((g.headroom() - 0.85).abs() < 1e-12, "{}", g.headroom());
        for k in 2..=10 {
            interval(&mut g, k * 100, 500, 0);
        }
        assert!(g.headroom() > 0.85, "clean intervals after it only raise: {}", g.headroom());
    }

    /// A 1 s burst of misses drives the headroom to its floor; it is back
    /// near 1 within 1.5 s of clean intervals, not 4 s.
    #[test]
    fn recovers_within_a_second_and_a_half_of_a_burst() {
        let mut g = AdmissionGate::new(0.01);
        for k in 1..=10 {
            interval(&mut g, k * 100, 500, 200);
        }
        assert_eq!(g.headroom(), MIN_HEADROOM);
        let mut t = 10;
        while g.headroom() < 0.8 {
            t += 1;
            interval(&mut g, t * 100, 500, 0);
            assert!(t < 100);
        }
        let took = (t - 10) as f64 / 10.0;
        assert!((0.8..=1.5).contains(&took), "back to 0.8 after {took} s");
    }

    #[test]
    fn short_or_sparse_intervals_wait_for_more_outcomes() {
        let mut g = AdmissionGate::new(0.01);
        for i in 0..10 {
            g.on_finish(i * 30 * MS, Some(false)); // 10 outcomes over 270 ms: too few
        }
        assert_eq!(g.headroom(), 1.0);
    }

    #[test]
    fn littles_law_estimate_of_the_time_in_the_pipeline() {
        let mut g = AdmissionGate::new(0.01);
        assert_eq!(g.sojourn_ns(), 0, "unknown until requests finish");
        // 1 request per ms finishing, 40 in flight: a new one takes ~40 ms.
        let ms = 1_000_000;
        forty_in_flight_one_per_ms(&mut g);
        let est = g.sojourn_ns() as f64 / ms as f64;
        assert!((est - 40.0).abs() < 2.0, "{est} ms");
        // Other failures leave the headroom alone but still leave the pipeline.
        let h = g.headroom();
        g.on_finish(201 * ms, None);
        assert_eq!(g.headroom(), h);
    }

    /// Bursts of 8 every 300 ms, each served in 40 ms: between bursts the
    /// pipeline is idle, and that must not make it look slow.
    #[test]
    fn idle_gaps_do_not_count_against_the_rate() {
        let mut g = AdmissionGate::new(0.01);
        let ms = 1_000_000;
        for burst in 0..20u64 {
            let t0 = burst * 300 * ms;
            for _ in 0..8 {
                g.on_admit(t0, true);
            }
            for k in 1..=8u64 {
                g.on_finish(t0 + 5 * k * ms, Some(true));
            }
        }
        // The next burst: 8 in flight at 8 per 40 ms of busy time -> ~40 ms, not the ~300 ms the
        // completion rate over wall time (8 per 300 ms) would say.
        for _ in 0..8 {
            g.on_admit(20 * 300 * ms, true);
        }
        let est = g.sojourn_ns() as f64 / ms as f64;
        assert!(est > 30.0 && est < 50.0, "{est} ms");
    }

    #[test]
    fn misses_that_the_queue_does_not_explain_do_not_cut() {
        // Every interval misses 10%, far from the limit as often as near it.
        let mut g = AdmissionGate::new(0.01);
        for k in 1..=20u64 {
            for i in 0..40u64 {
                let share = if i % 2 == 0 { 0.1 } else { 0.9 };
                g.on_finish_with((k * 100 + i) * MS / 10 + (k - 1) * 100 * MS, Some(i % 10 != 0), share);
            }
        }
        assert_eq!(g.headroom(), 1.0, "cutting would refuse more and miss as much");
        // The same misses, all near the limit: the queue's doing, so it cuts.
        let mut g = AdmissionGate::new(0.01);
        for k in 1..=20u64 {
            for i in 0..40u64 {
                let (share, met) = if i % 5 == 0 { (0.9, false) } else { (0.1, true) };
                g.on_finish_with((k * 100 + i) * MS / 10 + (k - 1) * 100 * MS, Some(met), share);
            }
        }
        assert!(g.headroom() < 0.5, "{}", g.headroom());
    }

    #[test]
    fn the_low_class_is_shed_first_and_the_high_class_last() {
        use crate::Prediction;
        let mut g = AdmissionGate::new(0.01);
        let p = |ns| Prediction { ns, queued: true };
        assert_eq!(g.decide_for(p(40), 100, Priority::Low), Ok(0.4));
        assert!(g.decide_for(p(51), 100, Priority::Low).is_err());
        assert!(g.decide_for(p(100), 100, Priority::Normal).is_ok());
        // Cut the headroom to 0.6 (interval after interval of misses near the limit).
        for k in 1..=3u64 {
            for i in 0..40u64 {
                g.on_finish_with((k * 100 + i) * MS / 10 + (k - 1) * 100 * MS, Some(i % 4 != 0), 0.9);
            }
        }
        let h = g.headroom();
        assert!(h < 0.9, "{h}");
        let at = |share: f64| p((share * 100.0) as u64);
        assert!(g.decide_for(at(h * 0.9), 100, Priority::Normal).is_ok());
        assert!(g.decide_for(at(h * 0.9), 100, Priority::Low).is_err());
        assert!(g.decide_for(at(h * 1.05), 100, Priority::Normal).is_err());
        assert!(g.decide_for(at(h * 1.05), 100, Priority::High).is_ok());
        assert!(
            g.decide_for(Prediction { ns: 500, queued: false }, 100, Priority::Low).is_ok(),
            "an idle route admits"
        );
        assert_eq!(Priority::parse(" LOW "), Some(Priority::Low));
        assert_eq!(Priority::parse("urgent"), None);
    }

    #[test]
    fn never_below_the_floor() {
        let mut g = AdmissionGate::new(0.01);
        for k in 1..100 {
            interval(&mut g, k * 100, 50, 50);
        }
        assert_eq!(g.headroom(), MIN_HEADROOM);
        assert!(g.admits(25, 100));
    }

    /// Each admitted request misses with a probability that rises with the
    /// headroom (the more we let in, the more miss); the gate settles where
    /// the miss rate is near the target.
    #[test]
    fn settles_near_the_target_miss_rate() {
        let mut g = AdmissionGate::new(0.01);
        let mut x: u64 = 12345;
        let (mut admitted, mut missed) = (0u64, 0u64);
        // 5,000 requests/s for 200 s.
        for i in 0..1_000_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            // Miss probability 0 below h = 0.5, growing to 5% at h = 1.
            let p_miss = ((g.headroom() - 0.5) / 0.5).max(0.0) * 0.05;
            let met = u >= p_miss;
            if i >= 200_000 {
                admitted += 1;
                missed += u64::from(!met);
            }
            g.on_admit(i * 200_000, true);
            g.on_finish(i * 200_000, Some(met));
        }
        let rate = missed as f64 / admitted as f64;
        assert!(rate > 0.001 && rate < 0.01, "miss rate {rate}");
    }
}
