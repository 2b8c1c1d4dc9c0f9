//! The autoscaler's policy: how many replicas a stage should serve with,
//! decided from the load's trend and the stage's capacity, as plain data.
//!
//! The offered load (admitted + refused requests per second) is smoothed
//! with Holt's linear method ([`Trend`]: a level and a slope, so a rising
//! load is seen rising, not only high). A stage's capacity per replica is
//! the lower of two estimates: the latency profile its batch former plans
//! with at the best batch size the AIMD limit allows
//! ([`replica_capacity`]: the component alone), and what its replicas
//! actually did lately ([`Observed`]: requests per second of replica busy
//! time, node -> worker -> node, which also knows the hops and the cores
//! the stage shares). From those, [`decide`]:
//!
//! - **anticipatory** (the default; Vortex's anticipatory preloading): keep
//!   one *standby* replica warm (constructed, warmed up, not routed to)
//!   once the forecast over a replica's start time reaches `standby_at` of
//!   the serving capacity; promote standbys, then start more, when the near
//!   forecast needs them (two ticks in a row, so one noisy sample of a
//!   Poisson load does not flip the set). Load that falls first demotes a
//!   serving replica back to standby, then retires the standby, each only
//!   after the load has stayed low for a while (hysteresis).
//! - **reactive** (for comparison; what a queue-length autoscaler does):
//!   start one replica only once requests already miss, and retire with the
//!   same hysteresis.
//! - **off**: counts change only when an operator scales.
//!
//! Nothing here touches a replica: [`decide`] returns [`ScaleStep`]s, and
//! the node's one owner of replica sets applies them (re-checked under its
//! lock, so a step computed from a census an operator has since changed
//! cannot overshoot what either of them asked for). Time is `u64` ns from
//! the caller's clock.

use crate::former::BatchFormer;

/// How replica counts follow the load (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalePolicy {
    /// Counts change only when an operator scales.
    Off,
    /// One more replica once requests miss.
    Reactive,
    /// Warm standbys on the load trend (the default).
    Anticipatory,
}

impl ScalePolicy {
    /// The policy of this name (`off`, `reactive`, `anticipatory`).
    pub fn parse(s: &str) -> Option<ScalePolicy> {
        match s {
            "off" => Some(ScalePolicy::Off),
            "reactive" => Some(ScalePolicy::Reactive),
            "anticipatory" => Some(ScalePolicy::Anticipatory),
            _ => None,
        }
    }

    /// Its name, as [`ScalePolicy::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            ScalePolicy::Off => "off",
            ScalePolicy::Reactive => "reactive",
            ScalePolicy::Anticipatory => "anticipatory",
        }
    }
}

/// The policy's settings (defaults suit one machine).
#[derive(Clone, Debug)]
pub struct ScaleOptions {
    /// Which policy.
    pub policy: ScalePolicy,
    /// Time between decisions, ns.
    pub tick_ns: u64,
    /// Plan serving replicas to run at most this busy (queueing headroom
    /// for the tail).
    pub utilization: f64,
    /// Keep a warm standby once the lead-time forecast reaches this share
    /// of the serving capacity.
    pub standby_at: f64,
    /// Scale down only after the load needed fewer replicas (at
    /// `down_utilization`) for this long, ns.
    pub down_after_ns: u64,
    /// The utilisation the level must fit at before a replica is retired.
    pub down_utilization: f64,
    /// Retire an unused standby after the load stayed below `standby_at`
    /// this long, ns.
    pub standby_keep_ns: u64,
    /// Cores the node's replicas may use (replicas x threads per stage).
    pub cores: f64,
}

impl Default for ScaleOptions {
    fn default() -> Self {
        ScaleOptions {
            policy: ScalePolicy::Anticipatory,
            tick_ns: 250_000_000,
            utilization: 0.75,
            standby_at: 0.35,
            down_after_ns: 10_000_000_000,
            down_utilization: 0.5,
            standby_keep_ns: 60_000_000_000,
            cores: 2.0,
        }
    }
}

/// Holt's linear (double exponential) smoothing of a rate: level and slope.
#[derive(Clone, Copy, Debug, Default)]
pub struct Trend {
    /// The smoothed rate.
    pub level: f64,
    /// Change of the level per second.
    pub slope: f64,
    primed: bool,
}

impl Trend {
    const ALPHA: f64 = 0.3;
    const BETA: f64 = 0.15;

    /// A new rate sample, `dt` seconds after the previous one.
    pub fn observe(&mut self, rate: f64, dt: f64) {
        if !self.primed {
            *self = Trend { level: rate, slope: 0.0, primed: true };
            return;
        }
        let prev = self.level;
        self.level = (Self::ALPHA * rate + (1.0 - Self::ALPHA) * (self.level + self.slope * dt)).max(0.0);
        self.slope = Self::BETA * (self.level - prev) / dt + (1.0 - Self::BETA) * self.slope;
    }

    /// The rate expected `h` seconds ahead (a falling trend is not
    /// extrapolated: scaling down waits for the level itself).
    pub fn forecast(&self, h: f64) -> f64 {
        (self.level + self.slope.max(0.0) * h).max(0.0)
    }
}

/// Requests per second one replica sustains at the best batch size its
/// batch former allows (from its latency profile), looking no further than
/// twice the largest batch size the profile knows (`None` while it knows
/// nothing: no profile file and no batch run yet).
pub fn replica_capacity(f: &BatchFormer) -> Option<f64> {
    let known = f.profile.largest_known();
    if known == 0 {
        return None;
    }
    (1..=f.limit.min(known.saturating_mul(2)).max(1) as usize)
        .map(|b| b as f64 * 1e9 / f.mean_ns(b).max(1) as f64)
        .max_by(f64::total_cmp)
        .filter(|c| c.is_finite() && *c > 0.0)
}

/// Recent requests per second of replica busy time (decaying sums).
#[derive(Clone, Debug, Default)]
pub struct Observed {
    req_sum: f64,
    busy_s_sum: f64,
}

impl Observed {
    /// Weight of the past per tick (~2.5 s memory at 250 ms ticks).
    const KEEP: f64 = 0.9;
    /// Requests the sums must hold before they are trusted.
    const ENOUGH: f64 = 20.0;

    /// Add a tick's `requests` run in `busy_s` replica-seconds; the
    /// capacity they show, once there is enough to go on.
    pub fn update(&mut self, requests: u64, busy_s: f64) -> Option<f64> {
        self.req_sum = self.req_sum * Self::KEEP + requests as f64;
        self.busy_s_sum = self.busy_s_sum * Self::KEEP + busy_s;
        (self.req_sum >= Self::ENOUGH && self.busy_s_sum > 0.0).then(|| self.req_sum / self.busy_s_sum)
    }
}

/// What the policy knows of one stage at a tick.
#[derive(Clone, Debug, Default)]
pub struct StageView {
    /// The stage's declared bounds.
    pub lo: usize,
    /// See `lo`.
    pub hi: usize,
    /// Threads each replica uses.
    pub threads: usize,
    /// Replicas serving or about to (ready, starting to serve, restarting).
    pub active: usize,
    /// Standbys (held back from routing).
    pub standby: usize,
    /// Standbys whose worker is warm (promotion is instant).
    pub warm_standby: usize,
    /// A replica is starting (the reactive policy adds one at a time).
    pub starting: bool,
    /// Capacity per replica from the profile ([`replica_capacity`]).
    pub profiled: Option<f64>,
    /// Capacity per replica observed lately ([`Observed`]).
    pub observed: Option<f64>,
    /// How long a new replica takes to become warm, s (learned).
    pub lead_s: Option<f64>,
}

/// What the policy remembers of a stage between ticks.
#[derive(Clone, Debug, Default)]
pub struct StageMemory {
    /// Ticks in a row the near forecast needed more serving replicas.
    short_ticks: u32,
    /// Since when fewer replicas would do (scale-down hysteresis), ns.
    low_since: Option<u64>,
    /// Since when a standby has not been needed, ns.
    idle_standby_since: Option<u64>,
}

/// A change to a stage's replicas, as the owner of replica sets applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleAction {
    /// At least `to` serving: promote standbys (warm first), then start more, up to `max`.
    Grow {
        /// Serving replicas wanted.
        to: usize,
        /// The most the stage may have.
        max: usize,
    },
    /// Start one standby (unless one exists), while fewer than `max` serve.
    AddStandby {
        /// The most serving replicas the stage may have.
        max: usize,
    },
    /// One serving replica fewer (the least loaded), while more than `min` serve.
    Retire {
        /// Back to standby (warm, for the next surge) rather than drained.
        to_standby: bool,
        /// The fewest serving replicas the stage may have.
        min: usize,
    },
    /// Drain one standby.
    DrainStandby,
}

/// One decision of a tick, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleStep {
    /// The change.
    pub action: ScaleAction,
    /// Its name in events and counters (`standby`, `grow`, `to_standby`,
    /// `scale_down`, `retire_standby`).
    pub what: &'static str,
    /// The reason, for the event log.
    pub why: String,
}

/// The policy's model of a stage at a tick (for status).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScaleModel {
    /// The load's smoothed rate, req/s.
    pub level_rps: f64,
    /// Its slope, req/s per s.
    pub slope_rps_per_s: f64,
    /// The rate forecast one replica start time ahead.
    pub forecast_rps: f64,
    /// A replica's start time, s.
    pub lead_s: f64,
    /// Capacity per replica planned with.
    pub replica_capacity_rps: f64,
    /// From the profile.
    pub profiled_capacity_rps: Option<f64>,
    /// Observed lately.
    pub observed_capacity_rps: Option<f64>,
    /// Serving replicas the load needs now.
    pub need: usize,
    /// The most replicas the stage may use (bounds and cores).
    pub max_usable: usize,
    /// Serving replicas the load needs within the stage's declared bounds
    /// only, as if cores were unlimited: above `max_usable` when the
    /// machines, not the bounds, hold the stage back (what a loop that adds
    /// machines acts on).
    pub need_uncapped: usize,
    /// Serving now.
    pub active: usize,
    /// Standbys now.
    pub standby: usize,
}

/// A replica's start time assumed before one has been measured, s.
const DEFAULT_LEAD_S: f64 = 5.0;

/// One tick's decisions for a stage whose pipeline's load follows `trend`,
/// with `missed` requests missed in the last tick (refused, dropped or
/// late). `None` (no decision, no model) while the stage's capacity is
/// unknown.
pub fn decide(
    o: &ScaleOptions,
    trend: Trend,
    missed: u64,
    v: &StageView,
    mem: &mut StageMemory,
    now_ns: u64,
) -> Option<(ScaleModel, Vec<ScaleStep>)> {
    let lo = v.lo;
    // A stage cannot use more cores than the node has.
    let hi = v.hi.min(((o.cores / v.threads.max(1) as f64).floor() as usize).max(lo));
    let cap = match (v.profiled, v.observed) {
        (Some(p), Some(o)) => p.min(o),
        (p, o) => p.or(o)?,
    };
    let lead = v.lead_s.unwrap_or(DEFAULT_LEAD_S);
    let near = trend.forecast(o.tick_ns as f64 / 1e9 * 4.0);
    let ahead = trend.forecast(lead);
    let need_within = |rate: f64, util: f64, top: usize| ((rate / (util * cap)).ceil() as usize).clamp(lo, top);
    let need = |rate: f64, util: f64| need_within(rate, util, hi);
    // More serving replicas are needed when the level alone says so, or
    // the near forecast has said so two ticks in a row.
    mem.short_ticks = if need(near, o.utilization) > v.active { mem.short_ticks + 1 } else { 0 };
    let need_now = if mem.short_ticks >= 2 { need(near, o.utilization) } else { need(trend.level, o.utilization) };
    let model = ScaleModel {
        level_rps: trend.level,
        slope_rps_per_s: trend.slope,
        forecast_rps: ahead,
        lead_s: lead,
        replica_capacity_rps: cap,
        profiled_capacity_rps: v.profiled,
        observed_capacity_rps: v.observed,
        need: need_now,
        max_usable: hi,
        need_uncapped: need_within(trend.level, o.utilization, v.hi.max(lo)),
        active: v.active,
        standby: v.standby,
    };
    let mut steps = Vec::new();
    let fmt = |rate: f64| format!("{rate:.0} req/s");
    let why_cap = format!("{} per replica at {:.0}% busy", fmt(cap), o.utilization * 100.0);
    match o.policy {
        ScalePolicy::Off => return Some((model, steps)),
        ScalePolicy::Anticipatory => {
            if need_now > v.active {
                steps.push(ScaleStep {
                    action: ScaleAction::Grow { to: need_now, max: hi },
                    what: "grow",
                    why: format!("forecast {} needs {need_now} replicas ({why_cap})", fmt(near)),
                });
                mem.low_since = None;
            } else if v.standby == 0
                && v.active < hi
                && (ahead >= o.standby_at * cap * v.active as f64 || need(ahead, o.utilization) > v.active)
            {
                steps.push(ScaleStep {
                    action: ScaleAction::AddStandby { max: hi },
                    what: "standby",
                    why: format!(
                        "preloading a standby: forecast {} in {lead:.1} s is {:.0}% of serving capacity {}",
                        fmt(ahead),
                        100.0 * ahead / (cap * v.active as f64),
                        fmt(cap * v.active as f64)
                    ),
                });
            }
        }
        ScalePolicy::Reactive => {
            if missed > 0 && !v.starting && v.active < hi {
                steps.push(ScaleStep {
                    action: ScaleAction::Grow { to: v.active + 1, max: hi },
                    what: "grow",
                    why: format!("{missed} requests missed in the last tick"),
                });
                mem.low_since = None;
            }
        }
    }
    // Down, with hysteresis: the level (not the forecast) has needed fewer
    // replicas, at a lower utilisation, for `down_after`. Judged on the
    // profiled capacity: what the replicas did lately was at the small
    // batches a spread-out load forms, and fewer replicas form larger,
    // cheaper ones; the lower utilisation is the margin.
    let down_cap = v.profiled.unwrap_or(cap);
    let need_down = ((trend.level / (o.down_utilization * down_cap)).ceil() as usize).clamp(lo, hi);
    if need_down < v.active && need_now < v.active && v.active > lo {
        let since = *mem.low_since.get_or_insert(now_ns);
        if now_ns.saturating_sub(since) >= o.down_after_ns {
            mem.low_since = None;
            let to_standby = o.policy == ScalePolicy::Anticipatory && v.standby == 0;
            steps.push(ScaleStep {
                action: ScaleAction::Retire { to_standby, min: lo },
                what: if to_standby { "to_standby" } else { "scale_down" },
                why: format!(
                    "load {} for {:.0} s needs {need_down} replicas at {:.0}% busy ({} per replica, profiled)",
                    fmt(trend.level),
                    o.down_after_ns as f64 / 1e9,
                    o.down_utilization * 100.0,
                    fmt(down_cap)
                ),
            });
        }
    } else {
        mem.low_since = None;
    }
    // An unused standby goes after `standby_keep` of low load.
    let idle = v.standby > 0 && ahead < o.standby_at * cap * v.active.saturating_sub(1).max(1) as f64;
    if idle {
        let since = *mem.idle_standby_since.get_or_insert(now_ns);
        if now_ns.saturating_sub(since) >= o.standby_keep_ns {
            mem.idle_standby_since = None;
            steps.push(ScaleStep {
                action: ScaleAction::DrainStandby,
                what: "retire_standby",
                why: format!("unused for {:.0} s (forecast {})", o.standby_keep_ns as f64 / 1e9, fmt(ahead)),
            });
        }
    } else {
        mem.idle_standby_since = None;
    }
    Some((model, steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_trend_sees_a_rising_load_rising() {
        let mut t = Trend::default();
        for _ in 0..40 {
            t.observe(100.0, 0.25);
        }
        assert!((t.level - 100.0).abs() < 1.0 && t.slope.abs() < 1.0, "{t:?}");
        // A ramp of +40 req/s per second.
        let mut rate = 100.0;
        for _ in 0..20 {
            rate += 10.0;
            t.observe(rate, 0.25);
        }
        assert!(t.slope > 25.0, "slope {:.1}", t.slope);
        assert!(t.forecast(2.0) > t.level + 50.0, "a forecast looks ahead");
        // Falling: the forecast does not extrapolate down.
        for _ in 0..10 {
            rate -= 20.0;
            t.observe(rate, 0.25);
        }
        assert!(t.slope < 0.0);
        assert_eq!(t.forecast(5.0), t.level.max(0.0));
    }

    #[test]
    fn policies_parse() {
        for p in [ScalePolicy::Off, ScalePolicy::Reactive, ScalePolicy::Anticipatory] {
            assert_eq!(ScalePolicy::parse(p.name()), Some(p));
        }
        assert_eq!(ScalePolicy::parse("eager"), None);
    }

    fn steady(rate: f64) -> Trend {
        let mut t = Trend::default();
        for _ in 0..40 {
            t.observe(rate, 0.25);
        }
        t
    }

    fn view(active: usize, standby: usize) -> StageView {
        StageView {
            lo: 1,
            hi: 4,
            threads: 1,
            active,
            standby,
            warm_standby: standby,
            profiled: Some(100.0),
            observed: None,
            lead_s: Some(2.0),
            ..StageView::default()
        }
    }

    fn opts() -> ScaleOptions {
        ScaleOptions { cores: 8.0, ..ScaleOptions::default() }
    }

    #[test]
    fn nothing_is_decided_without_a_capacity() {
        let v = StageView { profiled: None, ..view(1, 0) };
        assert!(decide(&opts(), steady(500.0), 0, &v, &mut StageMemory::default(), 0).is_none());
    }

    #[test]
    fn a_load_over_capacity_grows_to_what_it_needs_within_the_cores() {
        let (model, steps) = decide(&opts(), steady(200.0), 0, &view(1, 0), &mut StageMemory::default(), 0).unwrap();
        // 200 req/s at 75% of 100 per replica: 3 replicas.
        assert_eq!(model.need, 3);
        assert_eq!(steps[0].action, ScaleAction::Grow { to: 3, max: 4 });
        // Two cores and two threads per replica: one replica at most.
        let o = ScaleOptions { cores: 2.0, ..opts() };
        let v = StageView { threads: 2, ..view(1, 0) };
        let (model, steps) = decide(&o, steady(200.0), 0, &v, &mut StageMemory::default(), 0).unwrap();
        assert_eq!((model.max_usable, model.need), (1, 1));
        assert!(steps.is_empty(), "{steps:?}");
    }

    #[test]
    fn the_load_s_need_beyond_the_cores_is_reported() {
        // 200 req/s on replicas of 100 at 70%: 3 needed; 2 cores of 2
        // threads allow 1, the bounds 4.
        let o = ScaleOptions { cores: 2.0, ..opts() };
        let v = StageView { threads: 2, ..view(1, 0) };
        let (model, _) = decide(&o, steady(200.0), 0, &v, &mut StageMemory::default(), 0).unwrap();
        assert_eq!((model.max_usable, model.need, model.need_uncapped), (1, 1, 3));
        // With cores enough, the two agree.
        let o = ScaleOptions { cores: 16.0, ..opts() };
        let (model, _) = decide(&o, steady(200.0), 0, &v, &mut StageMemory::default(), 0).unwrap();
        assert_eq!((model.need, model.need_uncapped), (3, 3));
    }

    #[test]
    fn a_standby_is_preloaded_before_the_load_needs_it() {
        // 45 req/s on one replica of 100: above standby_at (35%), below need.
        let (_, steps) = decide(&opts(), steady(45.0), 0, &view(1, 0), &mut StageMemory::default(), 0).unwrap();
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].action, ScaleAction::AddStandby { max: 4 });
        // With one already there, nothing more.
        let (_, steps) = decide(&opts(), steady(45.0), 0, &view(1, 1), &mut StageMemory::default(), 0).unwrap();
        assert!(steps.is_empty(), "{steps:?}");
    }

    #[test]
    fn scaling_down_waits_for_the_load_to_stay_low() {
        let o = opts();
        let mut mem = StageMemory::default();
        let low = steady(10.0);
        let (_, steps) = decide(&o, low, 0, &view(3, 1), &mut mem, 0).unwrap();
        assert!(steps.is_empty(), "not before down_after: {steps:?}");
        let (_, steps) = decide(&o, low, 0, &view(3, 1), &mut mem, o.down_after_ns - 1).unwrap();
        assert!(steps.is_empty());
        let (_, steps) = decide(&o, low, 0, &view(3, 1), &mut mem, o.down_after_ns).unwrap();
        assert_eq!(steps[0].action, ScaleAction::Retire { to_standby: false, min: 1 });
        assert_eq!(steps[0].what, "scale_down");
        // Without a standby, the retired replica waits warm as one.
        let mut mem = StageMemory::default();
        decide(&o, low, 0, &view(3, 0), &mut mem, 0).unwrap();
        let (_, steps) = decide(&o, low, 0, &view(3, 0), &mut mem, 11 * S).unwrap();
        assert_eq!(steps[0].action, ScaleAction::Retire { to_standby: true, min: 1 });
        // A load that comes back in between resets the wait.
        let mut mem = StageMemory::default();
        decide(&o, low, 0, &view(3, 1), &mut mem, 0).unwrap();
        decide(&o, steady(250.0), 0, &view(3, 1), &mut mem, 5 * S).unwrap();
        let (_, steps) = decide(&o, low, 0, &view(3, 1), &mut mem, 11 * S).unwrap();
        assert!(steps.iter().all(|s| !matches!(s.action, ScaleAction::Retire { .. })), "{steps:?}");
    }

    #[test]
    fn reactive_adds_one_replica_only_once_requests_miss() {
        let o = ScaleOptions { policy: ScalePolicy::Reactive, ..opts() };
        let (_, steps) = decide(&o, steady(200.0), 0, &view(1, 0), &mut StageMemory::default(), 0).unwrap();
        assert!(steps.is_empty(), "{steps:?}");
        let (_, steps) = decide(&o, steady(200.0), 7, &view(1, 0), &mut StageMemory::default(), 0).unwrap();
        assert_eq!(steps[0].action, ScaleAction::Grow { to: 2, max: 4 });
        let starting = StageView { starting: true, ..view(1, 0) };
        let (_, steps) = decide(&o, steady(200.0), 7, &starting, &mut StageMemory::default(), 0).unwrap();
        assert!(steps.is_empty(), "one at a time");
    }

    #[test]
    fn observed_capacity_needs_enough_requests_and_decays() {
        let mut obs = Observed::default();
        assert_eq!(obs.update(5, 0.05), None);
        let c = obs.update(50, 0.5).unwrap();
        assert!((c - 100.0).abs() < 1e-9, "{c}");
    }
}
