//! The autoscaler: replica counts that follow the load, within the bounds a
//! stage declares (`replicas=(1, 4)`) and the node's cores.
//!
//! The policy (the load's trend, a stage's capacity, how many replicas it
//! should serve with, when to keep a warm standby) is pure and lives in
//! [`slipstream_sched::scale`], where it is unit-tested and the simulator
//! can run it. This crate is the service around it: every tick it takes
//! each pipeline's counters (one [`PipelineTotals`] per tick, the same
//! sampling the dashboard's history uses), feeds the trend, builds each
//! autoscaled stage's view (its replicas by role, its profiled and observed
//! capacity, a replica's start time), asks the policy, and hands its steps
//! to the node's one owner of replica sets ([`Node::change`]), which
//! re-checks each under its lock: an operator's `slipstream scale` in
//! between is never overshot.
//!
//! Decisions, with their reasons, go to the event log (`autoscale`
//! events), to `slipstream_autoscale_decisions_total` in `/metrics`, and
//! each stage's model (level, slope, capacity, need) to its `autoscale`
//! block in `/v1/status`.

use parking_lot::Mutex;
use serde_json::{json, Value};
use slipstream_core::events::EventKind;
use slipstream_core::ext::{Service, StatusDoc};
use slipstream_core::metrics::PipelineTotals;
use slipstream_core::prom::PromText;
use slipstream_core::replica::Phase;
use slipstream_core::scaling::{Change, Changed};
use slipstream_core::spec::AutoscaleSpec;
use slipstream_core::{Node, PipelineRt, StageRt};
use slipstream_sched::scale::{
    decide, replica_capacity, Observed, ScaleAction, ScaleModel, ScaleOptions, ScalePolicy, ScaleStep, StageMemory,
    StageView, Trend,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The policy's settings: the defaults, the machine's cores, and what the
/// app's spec says (`slipstream serve --autoscale ...`). Err names a bad one.
pub fn options(spec: Option<&AutoscaleSpec>) -> Result<ScaleOptions, String> {
    let mut o = ScaleOptions {
        cores: std::thread::available_parallelism().map_or(2.0, |n| n.get() as f64),
        ..Default::default()
    };
    let Some(spec) = spec else { return Ok(o) };
    if let Some(p) = &spec.policy {
        o.policy = ScalePolicy::parse(p)
            .ok_or_else(|| format!("unknown autoscale policy '{p}' (use anticipatory, reactive or off)"))?;
    }
    let share = |name: &str, v: f64| {
        if v > 0.0 && v <= 1.0 {
            Ok(v)
        } else {
            Err(format!("autoscale {name} must be in (0, 1], got {v}"))
        }
    };
    if let Some(c) = spec.cores {
        if !(c.is_finite() && c > 0.0) {
            return Err(format!("autoscale cores must be > 0, got {c}"));
        }
        o.cores = c;
    }
    if let Some(v) = spec.standby_at {
        o.standby_at = share("standby_at", v)?;
    }
    if let Some(v) = spec.utilization {
        o.utilization = share("utilization", v)?;
    }
    if let Some(v) = spec.down_after_s {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("autoscale down_after_s must be >= 0, got {v}"));
        }
        o.down_after_ns = Duration::try_from_secs_f64(v).map_or(u64::MAX, |d| d.as_nanos() as u64);
    }
    Ok(o)
}

struct PipeState {
    trend: Trend,
    prev: PipelineTotals,
}

#[derive(Default)]
struct StageState {
    observed: Observed,
    memory: StageMemory,
    /// What the model said last tick (for status).
    model: Option<ScaleModel>,
    last: Option<(Instant, String)>,
    counts: BTreeMap<&'static str, u64>,
}

/// The autoscaler's state: its tick task changes it; status and metrics read it.
pub struct Autoscaler {
    opts: ScaleOptions,
    /// (pipeline, stage, min, max) of every autoscaled stage.
    autoscaled: Vec<(String, String, usize, usize)>,
    /// The reference instant of the policy's ns clock.
    epoch: Instant,
    pipes: Mutex<BTreeMap<String, PipeState>>,
    stages: Mutex<BTreeMap<(String, String), StageState>>,
}

/// Whether a stage is autoscaled (has bounds to move in).
fn autoscaled(st: &StageRt) -> bool {
    st.bounds.0 < st.bounds.1
}

/// What the policy sees of `st` now (capacities not included).
fn view(st: &StageRt) -> StageView {
    let mut v = StageView { lo: st.bounds.0, hi: st.bounds.1, threads: st.threads, ..StageView::default() };
    for r in st.replicas().iter().filter(|r| r.is_local()) {
        let p = r.phase();
        v.starting |= p == Phase::Starting;
        if !p.will_serve() || r.leaving() {
            continue;
        }
        if r.is_standby() {
            v.standby += 1;
            v.warm_standby += usize::from(p == Phase::Standby);
        } else {
            v.active += 1;
        }
    }
    let set = st.replicas();
    v.profiled =
        set.iter().find(|r| r.phase() == Phase::Ready).or(set.first()).and_then(|r| replica_capacity(&r.former()));
    v.lead_s = st.start_time().map(|d| d.as_secs_f64());
    v
}

impl Autoscaler {
    /// An autoscaler with these settings for the stages of `pipelines`
    /// that declare bounds.
    pub fn new<'a>(opts: ScaleOptions, pipelines: impl IntoIterator<Item = &'a Arc<PipelineRt>>) -> Autoscaler {
        let autoscaled = pipelines
            .into_iter()
            .flat_map(|p| {
                p.stages
                    .iter()
                    .filter(|s| autoscaled(s))
                    .map(|s| (p.name().to_string(), s.name.clone(), s.bounds.0, s.bounds.1))
            })
            .collect();
        Autoscaler { opts, autoscaled, epoch: Instant::now(), pipes: Mutex::default(), stages: Mutex::default() }
    }

    /// Its settings.
    pub fn options(&self) -> &ScaleOptions {
        &self.opts
    }

    /// Whether any stage is autoscaled and the policy is not off.
    pub fn applies(&self) -> bool {
        self.opts.policy != ScalePolicy::Off && !self.autoscaled.is_empty()
    }

    /// One tick, `dt` seconds after the previous one: update each
    /// pipeline's trend, then decide and act per autoscaled stage.
    pub fn tick(&self, node: &Node, dt: f64) {
        for pipe in node.pipelines().values() {
            let (trend, missed, delta) = self.observe(pipe, dt);
            for st in pipe.stages.iter().filter(|s| autoscaled(s)) {
                self.decide(node, pipe, st, trend, missed, &delta, dt);
            }
        }
    }

    fn observe(&self, pipe: &PipelineRt, dt: f64) -> (Trend, u64, PipelineTotals) {
        let now = pipe.totals();
        let mut pipes = self.pipes.lock();
        let ps = pipes
            .entry(pipe.name().to_string())
            .or_insert_with(|| PipeState { trend: Trend::default(), prev: now.clone() });
        let delta = now.since(&ps.prev);
        ps.prev = now;
        ps.trend.observe(delta.offered() as f64 / dt, dt);
        (ps.trend, delta.missed(), delta)
    }

    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        node: &Node,
        pipe: &Arc<PipelineRt>,
        st: &StageRt,
        trend: Trend,
        missed: u64,
        delta: &PipelineTotals,
        _dt: f64,
    ) {
        let mut v = view(st);
        let key = (pipe.name().to_string(), st.name.clone());
        let mut stages = self.stages.lock();
        let ss = stages.entry(key).or_default();
        let d = delta.stages.get(st.index).cloned().unwrap_or_default();
        v.observed = ss.observed.update(d.requests, d.busy_us as f64 / 1e6);
        let now_ns = self.epoch.elapsed().as_nanos() as u64;
        let Some((model, steps)) = decide(&self.opts, trend, missed, &v, &mut ss.memory, now_ns) else { return };
        st.set_wanted(model.need);
        ss.model = Some(model);
        for step in steps {
            let done = node.change(pipe, st.index, Change::Scale(step.action));
            self.record(node, pipe, st, ss, &step, &done);
        }
    }

    /// Count and log what a step did (nothing, when the owner found it no
    /// longer needed).
    fn record(&self, node: &Node, pipe: &PipelineRt, st: &StageRt, ss: &mut StageState, step: &ScaleStep, c: &Changed) {
        let why = &step.why;
        let mut done: Vec<(&'static str, String)> = Vec::new();
        match step.action {
            ScaleAction::Grow { .. } => {
                if c.promoted > 0 {
                    let cold = c.promoted - c.warm;
                    let how = if cold == 0 {
                        format!("{} warm standby -> serving", c.promoted)
                    } else {
                        format!("{} standby -> serving ({cold} still starting: serves once warm)", c.promoted)
                    };
                    done.push(("promote", format!("{how}: {why}")));
                }
                if !c.added.is_empty() {
                    let detail = match self.opts.policy {
                        ScalePolicy::Reactive => why.clone(),
                        _ => format!("starting {}: {why}", c.added.len()),
                    };
                    done.push(("scale_up", detail));
                }
            }
            ScaleAction::AddStandby { .. } if !c.added.is_empty() => done.push(("standby", why.clone())),
            ScaleAction::Retire { .. } if c.to_standby > 0 || !c.draining.is_empty() => {
                done.push((step.what, why.clone()))
            }
            ScaleAction::DrainStandby if !c.draining.is_empty() => done.push(("retire_standby", why.clone())),
            _ => {}
        }
        for (what, detail) in done {
            *ss.counts.entry(what).or_default() += 1;
            ss.last = Some((Instant::now(), format!("{what}: {detail}")));
            node.events().record(pipe.name(), &st.name, None, EventKind::Autoscale, format!("{what}: {detail}"));
        }
    }
}

fn model_json(m: &ScaleModel) -> Value {
    json!({
        "level_rps": m.level_rps, "slope_rps_per_s": m.slope_rps_per_s, "forecast_rps": m.forecast_rps,
        "lead_s": m.lead_s, "replica_capacity_rps": m.replica_capacity_rps,
        "profiled_capacity_rps": m.profiled_capacity_rps, "observed_capacity_rps": m.observed_capacity_rps,
        "need": m.need, "max_usable": m.max_usable, "active": m.active, "standby": m.standby,
    })
}

impl Service for Autoscaler {
    fn status(&self, doc: &mut StatusDoc) {
        let stages = self.stages.lock();
        // Every autoscaled stage has a block (its model once it has one).
        for (p, s, lo, hi) in &self.autoscaled {
            let ss = stages.get(&(p.clone(), s.clone()));
            doc.set_stage(
                p,
                s,
                "autoscale",
                json!({
                    "policy": self.opts.policy.name(),
                    "min": lo,
                    "max": hi,
                    "model": ss.and_then(|s| s.model.as_ref()).map_or(Value::Null, model_json),
                    "decisions": ss.map_or(json!({}), |s| json!(s.counts)),
                    "last": ss.and_then(|s| s.last.as_ref()).map(|(at, what)| json!({
                        "ago_s": at.elapsed().as_secs_f64(), "what": what,
                    })),
                }),
            );
        }
    }

    fn metrics(&self, t: &mut PromText) {
        let family = (
            "slipstream_autoscale_decisions_total",
            "Autoscaler decisions by action (standby, promote, scale_up, to_standby, scale_down, retire_standby).",
        );
        t.declare(family.0, "counter", family.1);
        let stages = self.stages.lock();
        for ((p, s), ss) in stages.iter() {
            for (action, n) in &ss.counts {
                t.counter(family.0, family.1, &[("pipeline", p), ("stage", s), ("action", action)], *n);
            }
        }
    }
}

/// Run `auto` on `node` until it stops (nothing to do when no stage is
/// autoscaled or the policy is off).
pub async fn run(auto: Arc<Autoscaler>, node: Arc<Node>, mut stop: tokio::sync::watch::Receiver<bool>) {
    if !auto.applies() {
        return;
    }
    let tick = Duration::from_nanos(auto.opts.tick_ns);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
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
