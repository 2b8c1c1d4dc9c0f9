//! The autoscaler of a cluster: the leader runs the same policy a single
//! node runs ([`slipstream_sched::scale::decide`]: Holt's trend of the
//! offered load, anticipatory standbys, growth on the near forecast,
//! retirement with hysteresis) on the load offered to the whole cluster,
//! and its decisions become the placement's counts.
//!
//! - **Load in the heartbeats**: every node puts its offered and missed
//!   requests per second per pipeline (at its own ingress, over the last
//!   half second) into its member record ([`Report`]), so the leader sees
//!   all traffic, not only what crosses it. The leader decides every 250
//!   ms on the latest reports.
//! - **Decisions as counts**: a stage declared with bounds
//!   (`replicas=(1, 4)`) is sized for the cluster: serving replicas and
//!   standbys wanted, within its bounds and the members' cores. The leader
//!   places those counts ([`slipstream_sched::placement`]): a standby on a
//!   node with room, preloaded (a warm worker), becomes the stage's next
//!   replica there when the stage grows; a shrink takes replicas off the
//!   fullest nodes, which drain after the placement's grace period.
//! - **A new leader** starts from the placement it inherits (the counts
//!   the previous leader chose), with a fresh trend; so does a node that
//!   leads again after another led.
//!
//! Stages without bounds keep their declared count; the policy `off`
//! (`slipstream deploy --autoscale off`) keeps every count.

use crate::Member;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use slipstream_core::events::EventKind;
use slipstream_core::metrics::PipelineTotals;
use slipstream_core::replica::Phase;
use slipstream_core::{Node, PipelineRt, StageRt};
use slipstream_sched::placement::Assignment;
use slipstream_sched::scale::{
    decide, replica_capacity, ScaleAction, ScaleModel, ScaleOptions, ScalePolicy, StageMemory, StageView, Trend,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How often a node reports its load (an etcd write per node, only while
/// the load changes).
pub(crate) const REPORT_EVERY: Duration = Duration::from_millis(500);

/// How often the leader decides (the single-node autoscaler's tick: the
/// policy's smoothing and its "two ticks in a row" are tuned to it), on the
/// latest reports.
const TICK: Duration = Duration::from_millis(250);

/// A leader that has not decided for this long starts afresh.
const LAPSED: Duration = Duration::from_secs(3);

/// What a node reports of its ingress's load, per pipeline.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Requests offered (admitted + refused) per second over the last report.
    #[serde(default)]
    pub offered: BTreeMap<String, f64>,
    /// Requests missed (refused, late, dropped late) per second.
    #[serde(default)]
    pub missed: BTreeMap<String, f64>,
}

impl Report {
    pub(crate) fn is_empty(&self) -> bool {
        self.offered.values().chain(self.missed.values()).all(|v| *v == 0.0)
    }
}

/// Measures this node's [`Report`] from its pipelines' counters.
pub(crate) struct Meter {
    prev: BTreeMap<String, PipelineTotals>,
    at: Instant,
}

impl Meter {
    pub(crate) fn new(node: &Node) -> Meter {
        let prev = node.pipelines().values().map(|p| (p.name().to_string(), p.totals())).collect();
        Meter { prev, at: Instant::now() }
    }

    /// The rates since the last call (rounded to 0.1 req/s, so an idle
    /// node's record does not change).
    pub(crate) fn report(&mut self, node: &Node) -> Report {
        let dt = self.at.elapsed().as_secs_f64().max(1e-3);
        self.at = Instant::now();
        let mut r = Report::default();
        for p in node.pipelines().values() {
            let now = p.totals();
            if let Some(prev) = self.prev.get(p.name()) {
                let d = now.since(prev);
                let round = |v: u64| (v as f64 / dt * 10.0).round() / 10.0;
                r.offered.insert(p.name().to_string(), round(d.offered()));
                r.missed.insert(p.name().to_string(), round(d.missed()));
            }
            self.prev.insert(p.name().to_string(), now);
        }
        r
    }
}

/// One stage's part of the cluster's autoscaler.
#[derive(Default)]
struct StageScale {
    /// Serving replicas and standbys wanted.
    serving: u32,
    standby: u32,
    memory: StageMemory,
    model: Option<ScaleModel>,
    counts: BTreeMap<&'static str, u64>,
    last: Option<(Instant, String)>,
}

#[derive(Default)]
struct State {
    last_tick: Option<Instant>,
    trends: BTreeMap<String, Trend>,
    stages: BTreeMap<String, StageScale>,
}

/// The cluster's autoscaler (see the module docs); decides only on the leader.
pub(crate) struct ClusterScaler {
    opts: ScaleOptions,
    epoch: Instant,
    state: Mutex<State>,
}

/// What the placement is asked to place.
pub(crate) struct Wanted {
    /// Serving replicas per stage ("pipeline/stage") in the cluster.
    pub(crate) serving: BTreeMap<String, u32>,
    /// Standbys per stage the autoscaler keeps.
    pub(crate) standby: BTreeMap<String, u32>,
}

/// Whether a stage is autoscaled (has bounds to move in).
fn bounded(st: &StageRt) -> bool {
    st.bounds.0 < st.bounds.1
}

impl ClusterScaler {
    pub(crate) fn new(opts: ScaleOptions) -> ClusterScaler {
        ClusterScaler { opts, epoch: Instant::now(), state: Mutex::default() }
    }

    /// The counts to place: declared ones, and for autoscaled stages what
    /// the policy decides (a tick when one is due; the leader calls this).
    /// `prev`: the placement in force (a new leader's starting counts).
    pub(crate) fn wanted(&self, node: &Node, members: &BTreeMap<String, Member>, prev: Option<&Assignment>) -> Wanted {
        let mut st = self.state.lock();
        if st.last_tick.is_some_and(|t| t.elapsed() >= LAPSED) {
            // Leading again after a while (another led meanwhile): start
            // from the placement in force, not from what was decided then.
            *st = State::default();
        }
        let due = st.last_tick.is_none_or(|t| t.elapsed() >= TICK);
        let dt = st.last_tick.map_or(TICK.as_secs_f64(), |t| t.elapsed().as_secs_f64());
        if due {
            st.last_tick = Some(Instant::now());
        }
        let sum = |f: fn(&Member) -> &BTreeMap<String, f64>, pipe: &str| -> f64 {
            members.values().filter_map(|m| f(m).get(pipe)).sum()
        };
        let cores: f64 = members.values().map(|m| m.cores as f64).sum::<f64>().max(1.0);
        let mut out = Wanted { serving: BTreeMap::new(), standby: BTreeMap::new() };
        for pipe in node.pipelines().values() {
            let offered = sum(|m| &m.load.offered, pipe.name());
            let missed = (sum(|m| &m.load.missed, pipe.name()) * dt).round() as u64;
            let trend = {
                let t = st.trends.entry(pipe.name().to_string()).or_default();
                if due {
                    t.observe(offered, dt);
                }
                *t
            };
            for stage in &pipe.stages {
                let key = pipe.stage_key(stage.index);
                let declared = pipe.spec.stages[stage.index].replicas as u32;
                if !bounded(stage) || self.opts.policy == ScalePolicy::Off {
                    out.serving.insert(key, declared);
                    continue;
                }
                let ss = st.stages.entry(key.clone()).or_insert_with(|| {
                    let placed = prev.and_then(|p| p.get(&key)).map(|m| m.values().sum::<u32>());
                    let (lo, hi) = (stage.bounds.0 as u32, stage.bounds.1 as u32);
                    StageScale { serving: placed.unwrap_or(declared).clamp(lo, hi), ..StageScale::default() }
                });
                if due {
                    self.decide(node, pipe, stage, &key, ss, trend, missed, members, cores);
                }
                out.serving.insert(key.clone(), ss.serving);
                if ss.standby > 0 {
                    out.standby.insert(key, ss.standby);
                }
            }
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        node: &Node,
        pipe: &PipelineRt,
        stage: &StageRt,
        key: &str,
        ss: &mut StageScale,
        trend: Trend,
        missed: u64,
        members: &BTreeMap<String, Member>,
        cores: f64,
    ) {
        let serving = ss.serving;
        let ready: u32 = members.values().filter_map(|m| m.ready.get(key)).sum();
        let warm: u32 = members.values().filter_map(|m| m.standby.get(key)).sum();
        // The component's own capacity: the best any replica's profile
        // gives (a remote replica's latency here includes the network and
        // its node's queue).
        let set = stage.replicas();
        let up = set.iter().filter(|r| r.phase() == Phase::Ready);
        let best = up.filter_map(|r| replica_capacity(&r.former())).reduce(f64::max);
        let profiled = best.or_else(|| set.first().and_then(|r| replica_capacity(&r.former())));
        let v = StageView {
            lo: stage.bounds.0,
            hi: stage.bounds.1,
            threads: stage.threads,
            active: serving as usize,
            standby: ss.standby as usize,
            warm_standby: warm.min(ss.standby) as usize,
            starting: ready < serving,
            profiled,
            observed: None,
            lead_s: stage.start_time().map(|d| d.as_secs_f64()),
        };
        let opts = ScaleOptions { cores, tick_ns: TICK.as_nanos() as u64, ..self.opts.clone() };
        let now_ns = self.epoch.elapsed().as_nanos() as u64;
        let Some((model, steps)) = decide(&opts, trend, missed, &v, &mut ss.memory, now_ns) else { return };
        stage.set_wanted(model.need);
        ss.model = Some(model);
        for step in steps {
            let (mut n, mut sb) = (ss.serving, ss.standby);
            let what = match step.action {
                ScaleAction::Grow { to, max } if (to.min(max) as u32) > n => {
                    let to = to.min(max) as u32;
                    let promoted = sb.min(to - n);
                    sb -= promoted;
                    n = to;
                    if promoted > 0 {
                        "promote"
                    } else {
                        "scale_up"
                    }
                }
                ScaleAction::AddStandby { max } if sb == 0 && (n as usize) < max => {
                    sb = 1;
                    "standby"
                }
                ScaleAction::Retire { to_standby, min } if n as usize > min => {
                    n -= 1;
                    if to_standby {
                        sb += 1;
                    }
                    step.what
                }
                ScaleAction::DrainStandby if sb > 0 => {
                    sb -= 1;
                    "retire_standby"
                }
                _ => continue,
            };
            ss.serving = n;
            ss.standby = sb;
            *ss.counts.entry(what).or_default() += 1;
            let detail = format!("{what}: {} serving, {sb} standby: {}", n, step.why);
            node.events().record(pipe.name(), &stage.name, None, EventKind::Autoscale, detail.clone());
            ss.last = Some((Instant::now(), detail));
        }
    }

    /// The status block: per autoscaled stage, its model and decisions.
    pub(crate) fn status(&self) -> Value {
        let st = self.state.lock();
        let stages: serde_json::Map<String, Value> = st
            .stages
            .iter()
            .map(|(key, s)| {
                let model = s.model.as_ref().map_or(Value::Null, |m| {
                    json!({"level_rps": m.level_rps, "slope_rps_per_s": m.slope_rps_per_s,
                           "forecast_rps": m.forecast_rps, "lead_s": m.lead_s,
                           "replica_capacity_rps": m.replica_capacity_rps, "need": m.need,
                           "max_usable": m.max_usable, "need_uncapped": m.need_uncapped})
                });
                let last = s.last.as_ref().map(|(at, what)| json!({"ago_s": at.elapsed().as_secs_f64(), "what": what}));
                (
                    key.clone(),
                    json!({"serving": s.serving, "standby": s.standby, "model": model,
                                     "decisions": s.counts, "last": last}),
                )
            })
            .collect();
        json!({"policy": self.opts.policy.name(), "stages": stages})
    }
}
