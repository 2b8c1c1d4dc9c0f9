//! The autoscaler: replica counts that follow the load, within the bounds a
//! stage declares (`replicas=(1, 4)`) and the node's cores.
//!
//! Every tick it reads each pipeline's offered load (admitted + refused
//! requests) and keeps its trend with Holt's linear smoothing (a level and
//! a slope, so a rising load is seen rising, not only high). Each stage's
//! capacity per replica is the lower of two estimates: the latency profile
//! the batch former plans with (measured by `slipstream profile`, refined
//! online) at the best batch size the AIMD limit allows, which knows the
//! component alone; and what the replicas actually did lately (requests
//! per second of replica busy time, node -> worker -> node), which also
//! knows the hops and the cores the stage shares with the node, the other
//! stages and any load generator on the machine. From those:
//!
//! - **anticipatory** (the default; Vortex's anticipatory preloading): a
//!   stage keeps one *standby* replica warm (its component constructed and a
//!   warm-up batch run, but no traffic) once the forecast over the time a
//!   replica takes to start reaches `standby_at` of the serving capacity;
//!   a standby is *promoted* into routing, which takes one tick, when the
//!   near forecast needs it, and more replicas start directly when even
//!   that is not enough. Load that falls first demotes a serving replica
//!   back to standby, then retires standbys, each only after the load has
//!   stayed low for a while (hysteresis), so a flapping load does not
//!   flap the replica set.
//! - **reactive** (for comparison; what a queue-length autoscaler does):
//!   start a replica only once requests already miss (refused, dropped or
//!   late), one at a time, and retire with the same hysteresis.
//! - **off**: replica counts change only by `slipstream scale`.
//!
//! Decisions, with their reasons, go to the replica event log (the node's
//! stderr and `slipstream status`) and to counters in `/metrics`; each
//! stage's model (level, slope, capacity, need) is in the status JSON.

use crate::metrics::Delta;
use crate::node::Node;
use crate::pipeline::{PipelineRt, StageRt};
use crate::replica::Phase;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How replica counts follow the load (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Off,
    Reactive,
    Anticipatory,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "off" => Some(Policy::Off),
            "reactive" => Some(Policy::Reactive),
            "anticipatory" => Some(Policy::Anticipatory),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Off => "off",
            Policy::Reactive => "reactive",
            Policy::Anticipatory => "anticipatory",
        }
    }
}

/// Autoscaler settings (defaults suit one machine; see the module docs).
#[derive(Clone, Debug)]
pub struct Options {
    pub policy: Policy,
    pub tick: Duration,
    /// Plan serving replicas to run at most this busy (queueing headroom
    /// for the tail).
    pub utilization: f64,
    /// Keep a warm standby once the lead-time forecast reaches this share
    /// of the serving capacity.
    pub standby_at: f64,
    /// Scale down only after the load needed fewer replicas (at
    /// `down_utilization`) for this long.
    pub down_after: Duration,
    pub down_utilization: f64,
    /// Retire an unused standby after the load stayed below `standby_at`
    /// this long.
    pub standby_keep: Duration,
    /// Cores the node's replicas may use (replicas x threads per stage).
    pub cores: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            policy: Policy::Anticipatory,
            tick: Duration::from_millis(250),
            utilization: 0.75,
            standby_at: 0.35,
            down_after: Duration::from_secs(10),
            down_utilization: 0.5,
            standby_keep: Duration::from_secs(60),
            cores: std::thread::available_parallelism().map_or(2.0, |n| n.get() as f64),
        }
    }
}

/// Holt's linear (double exponential) smoothing of a rate: level and slope.
#[derive(Clone, Copy, Debug, Default)]
pub struct Trend {
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

#[derive(Default)]
struct PipeState {
    trend: Trend,
    offered: Delta,
    missed: Delta,
    /// Misses in the last tick (reactive policy).
    last_missed: u64,
}

/// Recent requests per second of replica busy time (decaying sums).
#[derive(Default)]
struct Observed {
    requests: Delta,
    busy_us: Delta,
    req_sum: f64,
    busy_s_sum: f64,
}

impl Observed {
    /// Weight of the past per tick (~2.5 s memory at 250 ms ticks).
    const KEEP: f64 = 0.9;
    /// Requests the sums must hold before they are trusted.
    const ENOUGH: f64 = 20.0;

    fn update(&mut self, st: &StageRt) -> Option<f64> {
        let m = &st.metrics;
        let dr = self.requests.take(m.requests.load(Relaxed)) as f64;
        let db = self.busy_us.take(m.busy_us.load(Relaxed)) as f64 / 1e6;
        self.req_sum = self.req_sum * Self::KEEP + dr;
        self.busy_s_sum = self.busy_s_sum * Self::KEEP + db;
        (self.req_sum >= Self::ENOUGH && self.busy_s_sum > 0.0).then(|| self.req_sum / self.busy_s_sum)
    }
}

#[derive(Default)]
struct StageState {
    observed: Observed,
    /// Ticks in a row the near forecast needed more serving replicas.
    short_ticks: u32,
    /// Since when fewer replicas would do (scale-down hysteresis).
    low_since: Option<Instant>,
    /// Since when a standby has not been needed.
    idle_standby_since: Option<Instant>,
    /// What the model said last tick (for status).
    model: Value,
    last: Option<(Instant, String)>,
    counts: BTreeMap<&'static str, u64>,
}

/// The autoscaler's state: one owner (the tick task) changes it; status
/// and metrics read it.
pub struct Autoscaler {
    pub opts: Options,
    pipes: Mutex<BTreeMap<String, PipeState>>,
    stages: Mutex<BTreeMap<(String, String), StageState>>,
}

/// One stage's replicas, by role.
struct Census {
    /// Serving or about to (ready, starting to serve, restarting).
    active: usize,
    standby: usize,
    /// Standbys whose worker is warm (promotion is instant).
    warm_standby: usize,
}

fn census(st: &StageRt) -> Census {
    let mut c = Census { active: 0, standby: 0, warm_standby: 0 };
    for r in st.replicas().iter() {
        let p = r.phase();
        if !p.will_serve() {
            continue;
        }
        if r.is_standby() {
            c.standby += 1;
            c.warm_standby += usize::from(p == Phase::Standby);
        } else {
            c.active += 1;
        }
    }
    c
}

/// Requests per second one replica of `st` sustains at the best batch size
/// its batch former allows (from the stage's latency profile), looking no
/// further than twice the largest batch size the profile knows (`None`
/// while it knows nothing: no profile file and no batch run yet).
pub fn replica_capacity(st: &StageRt) -> Option<f64> {
    let set = st.replicas();
    let r = set.iter().find(|r| r.phase() == Phase::Ready).or(set.first())?;
    let f = r.former();
    let known = f.profile.largest_known();
    if known == 0 {
        return None;
    }
    (1..=f.limit.min(known.saturating_mul(2)).max(1) as usize)
        .map(|b| b as f64 * 1e9 / f.mean_ns(b).max(1) as f64)
        .max_by(f64::total_cmp)
        .filter(|c| c.is_finite() && *c > 0.0)
}

impl Autoscaler {
    pub fn new(opts: Options) -> Autoscaler {
        Autoscaler { opts, pipes: Mutex::new(BTreeMap::new()), stages: Mutex::new(BTreeMap::new()) }
    }

    /// Whether any stage of `pipes` is autoscaled (has bounds to move in).
    pub fn applies(&self, node: &Node) -> bool {
        self.opts.policy != Policy::Off
            && node.pipelines.values().any(|p| p.stages.iter().any(|s| s.bounds.0 < s.bounds.1))
    }

    /// One tick: update each pipeline's trend, then decide per stage.
    pub fn tick(&self, node: &Node, dt: f64) {
        for pipe in node.pipelines.values() {
            let (trend, missed) = self.observe(pipe, dt);
            for st in pipe.stages.iter().filter(|s| s.bounds.0 < s.bounds.1) {
                self.decide(node, pipe, st, trend, missed);
            }
        }
    }

    fn observe(&self, pipe: &PipelineRt, dt: f64) -> (Trend, u64) {
        let m = &pipe.metrics;
        let mut pipes = self.pipes.lock();
        let ps = pipes.entry(pipe.name().to_string()).or_default();
        let offered = ps.offered.take(m.admitted.load(Relaxed) + m.shed.load(Relaxed));
        let dropped: u64 = pipe.stages.iter().map(|s| s.metrics.dropped_late.load(Relaxed)).sum();
        ps.last_missed = ps.missed.take(m.shed.load(Relaxed) + m.slo_missed.load(Relaxed) + dropped);
        ps.trend.observe(offered as f64 / dt, dt);
        (ps.trend, ps.last_missed)
    }

    fn decide(&self, node: &Node, pipe: &Arc<PipelineRt>, st: &StageRt, trend: Trend, missed: u64) {
        let o = &self.opts;
        let (lo, hi) = st.bounds;
        // A stage cannot use more cores than the node has.
        let hi = hi.min(((o.cores / st.threads as f64).floor() as usize).max(lo));
        let c = census(st);
        let now = Instant::now();
        let key = (pipe.name().to_string(), st.name.clone());
        let mut stages = self.stages.lock();
        let ss = stages.entry(key).or_default();
        let observed = ss.observed.update(st);
        let profiled = replica_capacity(st);
        let Some(cap) = (match (profiled, observed) {
            (Some(p), Some(o)) => Some(p.min(o)),
            (p, o) => p.or(o),
        }) else {
            return;
        };
        let lead = st.start_time().unwrap_or(Duration::from_secs(5)).as_secs_f64();
        let near = trend.forecast(o.tick.as_secs_f64() * 4.0);
        let ahead = trend.forecast(lead);
        let need = |rate: f64, util: f64| ((rate / (util * cap)).ceil() as usize).clamp(lo, hi);
        // More serving replicas are needed when the level alone says so, or
        // the near forecast has said so two ticks in a row (one noisy
        // sample of a Poisson load must not flip the replica set).
        ss.short_ticks = if need(near, o.utilization) > c.active { ss.short_ticks + 1 } else { 0 };
        let need_now = if ss.short_ticks >= 2 { need(near, o.utilization) } else { need(trend.level, o.utilization) };
        ss.model = json!({
            "level_rps": trend.level, "slope_rps_per_s": trend.slope, "forecast_rps": ahead,
            "lead_s": lead, "replica_capacity_rps": cap, "profiled_capacity_rps": profiled,
            "observed_capacity_rps": observed, "need": need_now, "max_usable": hi,
            "active": c.active, "standby": c.standby,
        });
        let fmt = |rate: f64| format!("{rate:.0} req/s");
        let why_cap = format!("{} per replica at {:.0}% busy", fmt(cap), o.utilization * 100.0);
        match o.policy {
            Policy::Off => return,
            Policy::Anticipatory => {
                if need_now > c.active {
                    let (mut promoted, mut warm) = (0, 0);
                    if c.standby > 0 {
                        (promoted, warm) = node.promote_standbys(pipe, st, need_now - c.active);
                    }
                    let rest = need_now - c.active - promoted;
                    let why = format!("forecast {} needs {need_now} replicas ({why_cap})", fmt(near));
                    if promoted > 0 {
                        let cold = promoted - warm;
                        let how = if cold == 0 {
                            format!("{promoted} warm standby -> serving")
                        } else {
                            format!("{promoted} standby -> serving ({cold} still starting: serves once warm)")
                        };
                        self.record(node, pipe, st, ss, "promote", format!("{how}: {why}"));
                    }
                    if rest > 0 && c.active + promoted + rest <= hi {
                        node.add_replicas(pipe, st, rest, false);
                        self.record(node, pipe, st, ss, "scale_up", format!("starting {rest}: {why}"));
                    }
                    ss.low_since = None;
                } else if c.standby == 0
                    && c.active < hi
                    && (ahead >= o.standby_at * cap * c.active as f64 || need(ahead, o.utilization) > c.active)
                {
                    node.add_replicas(pipe, st, 1, true);
                    self.record(
                        node,
                        pipe,
                        st,
                        ss,
                        "standby",
                        format!(
                            "preloading a standby: forecast {} in {lead:.1} s is {:.0}% of serving capacity {}",
                            fmt(ahead),
                            100.0 * ahead / (cap * c.active as f64),
                            fmt(cap * c.active as f64)
                        ),
                    );
                }
            }
            Policy::Reactive => {
                let starting = st.replicas().iter().any(|r| r.phase() == Phase::Starting);
                if missed > 0 && !starting && c.active < hi {
                    node.add_replicas(pipe, st, 1, false);
                    self.record(node, pipe, st, ss, "scale_up", format!("{missed} requests missed in the last tick"));
                    ss.low_since = None;
                }
            }
        }
        // Down, with hysteresis: the level (not the forecast) has needed
        // fewer replicas, at a lower utilisation, for `down_after`. Judged
        // on the profiled capacity: what the replicas did lately was at the
        // small batches a spread-out load forms, and fewer replicas form
        // larger, cheaper ones; the lower utilisation is the margin.
        let down_cap = profiled.unwrap_or(cap);
        let need_down = ((trend.level / (o.down_utilization * down_cap)).ceil() as usize).clamp(lo, hi);
        let fewer = need_down < c.active && need_now < c.active;
        if fewer && c.active > lo {
            let since = *ss.low_since.get_or_insert(now);
            if now.duration_since(since) >= o.down_after {
                ss.low_since = None;
                let to_standby = o.policy == Policy::Anticipatory && c.standby == 0;
                if node.retire_one(pipe, st, to_standby) {
                    let what = if to_standby { "to_standby" } else { "scale_down" };
                    let why = format!(
                        "load {} for {:.0} s needs {need_down} replicas at {:.0}% busy ({} per replica, profiled)",
                        fmt(trend.level),
                        o.down_after.as_secs_f64(),
                        o.down_utilization * 100.0,
                        fmt(down_cap)
                    );
                    self.record(node, pipe, st, ss, what, why);
                }
            }
        } else {
            ss.low_since = None;
        }
        // An unused standby goes after `standby_keep` of low load.
        let idle = c.standby > 0 && ahead < o.standby_at * cap * c.active.saturating_sub(1).max(1) as f64;
        if idle {
            let since = *ss.idle_standby_since.get_or_insert(now);
            if now.duration_since(since) >= o.standby_keep {
                ss.idle_standby_since = None;
                if node.drain_standby(pipe, st) {
                    let why = format!("unused for {:.0} s (forecast {})", o.standby_keep.as_secs_f64(), fmt(ahead));
                    self.record(node, pipe, st, ss, "retire_standby", why);
                }
            }
        } else {
            ss.idle_standby_since = None;
        }
    }

    fn record(
        &self,
        node: &Node,
        pipe: &PipelineRt,
        st: &StageRt,
        ss: &mut StageState,
        what: &'static str,
        why: String,
    ) {
        *ss.counts.entry(what).or_default() += 1;
        ss.last = Some((Instant::now(), format!("{what}: {why}")));
        node.events.record(pipe.name(), &st.name, None, "autoscale", format!("{what}: {why}"));
    }

    /// The stage's autoscaling state for the status JSON (`None`: not autoscaled).
    pub fn stage_status(&self, pipe: &str, st: &StageRt) -> Option<Value> {
        if st.bounds.0 == st.bounds.1 {
            return None;
        }
        let stages = self.stages.lock();
        let ss = stages.get(&(pipe.to_string(), st.name.clone()));
        Some(json!({
            "policy": self.opts.policy.name(),
            "min": st.bounds.0,
            "max": st.bounds.1,
            "model": ss.map_or(Value::Null, |s| s.model.clone()),
            "decisions": ss.map_or(json!({}), |s| json!(s.counts)),
            "last": ss.and_then(|s| s.last.as_ref()).map(|(at, what)| json!({
                "ago_s": at.elapsed().as_secs_f64(), "what": what,
            })),
        }))
    }

    /// Decision counts per (pipeline, stage, action), for `/metrics`.
    pub fn decision_counts(&self) -> Vec<(String, String, &'static str, u64)> {
        let stages = self.stages.lock();
        stages
            .iter()
            .flat_map(|((p, s), ss)| ss.counts.iter().map(move |(a, n)| (p.clone(), s.clone(), *a, *n)))
            .collect()
    }
}

/// Run the autoscaler until the node stops.
pub async fn run(node: Arc<Node>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let auto = &node.autoscaler;
    if !auto.applies(&node) {
        return;
    }
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(auto.opts.tick) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() || node.is_draining() {
            return;
        }
        let now = Instant::now();
        auto.tick(&node, now.duration_since(last).as_secs_f64().max(1e-3));
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn deltas_survive_a_metrics_reset() {
        let mut d = Delta::default();
        assert_eq!(d.take(10), 10);
        assert_eq!(d.take(15), 5);
        assert_eq!(d.take(3), 3, "reset to 0, then 3 more");
    }

    #[test]
    fn policies_parse() {
        for p in [Policy::Off, Policy::Reactive, Policy::Anticipatory] {
            assert_eq!(Policy::parse(p.name()), Some(p));
        }
        assert_eq!(Policy::parse("eager"), None);
    }
}
