//! The node's recent past, second by second: what the dashboard
//! (`GET /dashboard`, [`DASHBOARD_HTML`]) draws, served as JSON on
//! `GET /v1/history?since=SEQ` for anyone who wants the last ten minutes
//! without running Prometheus.
//!
//! Why the node keeps it: its counters (`slipstream_core::metrics`) are cumulative,
//! and "p99 over the last seconds" cannot be recovered from the cumulative
//! latency histogram that `/v1/status` summarises. So one sampler task
//! ([`run`], started with the node, stopping with it) takes,
//! once per second, the deltas of the counters the node already keeps
//! (answered, within the SLO, failed by kind, batches, busy time), the
//! replica sets and queues, and the quantiles of a [`LatencyWindow`] that
//! the request path feeds next to the cumulative histogram, and appends one
//! [`Sample`] to a ring of the last [`KEEP`] (ten minutes).
//!
//! One owner: the sampler's own state (the previous counter values, the
//! per-second histograms of the sliding latency window) is a local of that
//! task. The ring is the only thing it shares, and only it writes there;
//! readers copy out `Arc`s of the samples they want under the lock and
//! serialise after. Deltas are taken of the counters' totals since the
//! process started (what Prometheus reads too), which a metrics reset
//! (`POST /v1/admin/reset-metrics`) does not touch.

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{json, Value};
use slipstream_core::events::Event;
use slipstream_core::metrics::{window_histogram, PipelineTotals, StageTotals};
use slipstream_core::replica::Phase;
use slipstream_core::{Node, NodeError, PipelineRt, StageRt};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The dashboard page: one self-contained file (inline CSS and JS, no
/// external resources), compiled into the binary.
pub const DASHBOARD_HTML: &str = include_str!("../assets/dashboard.html");

/// Time between samples.
pub const INTERVAL: Duration = Duration::from_secs(1);
/// Samples kept: ten minutes at one per second.
pub const KEEP: usize = 600;
/// Seconds of answers behind each sample's latency quantiles: one second
/// alone holds too few requests at low rates for a p99 to mean anything.
pub const WINDOW_S: usize = 5;

/// Replicas of a stage by role.
#[derive(Serialize, Debug, Default, Clone, PartialEq)]
pub struct Replicas {
    /// Serving.
    pub ready: u32,
    /// Worker starting or warming up (to serve, or as a standby).
    pub starting: u32,
    /// Warm, held back from routing until the autoscaler promotes it.
    pub standby: u32,
    /// Worker died; restarting.
    pub down: u32,
    /// Draining, or placed on another node and about to drain.
    pub leaving: u32,
}

#[derive(Serialize, Debug, Clone)]
pub struct StageSample {
    pub name: String,
    /// Requests waiting in the stage's queues now.
    pub queue: u64,
    /// Requests per batch over the last second (None: no batch ran).
    pub batch_mean: Option<f64>,
    /// Requests the stage ran per second.
    pub rps: f64,
    /// Replica-seconds busy per second (node -> worker -> node): 1.5 is one
    /// and a half replicas' worth of work.
    pub busy: f64,
    pub replicas: Replicas,
    /// Serving replicas its scaler last asked for (the autoscaler's model,
    /// or an operator; None: nobody has).
    pub target: Option<u64>,
}

#[derive(Serialize, Debug, Clone)]
pub struct PipelineSample {
    /// The SLO's latency target (None: the pipeline declares no SLO; its
    /// deadline is then the request timeout).
    pub slo_ms: Option<f64>,
    /// Latency of the requests answered in the last [`WINDOW_S`] seconds,
    /// inside the node (None: none answered).
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
    /// Requests that arrived (admitted or refused at ingress), per second.
    pub offered_rps: f64,
    /// Answered successfully, per second.
    pub answered_rps: f64,
    /// Answered within their deadline, per second.
    pub goodput_rps: f64,
    /// Share of the requests finished in the last second (answered, refused
    /// or failed) that were answered within their deadline (None: none
    /// finished).
    pub attainment: Option<f64>,
    /// Refused or failed per second, by error kind (`overloaded` is the
    /// 429 of admission control, `deadline_exceeded` a 504, ...).
    pub failed_rps: BTreeMap<&'static str, f64>,
    /// Answered with the declared fallback instead, per second.
    pub fallback_rps: f64,
    /// Abandoned by their client, per second.
    pub cancelled_rps: f64,
    /// Admitted and not finished, now.
    pub inflight: u64,
    pub stages: Vec<StageSample>,
}

/// One second of the node.
#[derive(Serialize, Debug, Clone)]
pub struct Sample {
    /// Increases by one per sample, from 1.
    pub seq: u64,
    /// Wall-clock time, ms since the Unix epoch.
    pub unix_ms: u64,
    pub uptime_s: f64,
    /// Seconds since the previous sample (the rates' denominator).
    pub dt_s: f64,
    /// The newest replica event's seq when this sample was taken.
    pub events_seq: u64,
    pub pipelines: BTreeMap<String, PipelineSample>,
}

/// What a reader gets: the samples after its `since`, oldest first.
struct After {
    samples: Vec<Arc<Sample>>,
    /// Send the replica events after this seq (that of sample `since`, when
    /// still kept; 0 otherwise: all events kept).
    events_after: u64,
    /// ... up to this one, the newest sample's: an event newer than the
    /// newest sample goes out with the next one, so that a reader that
    /// asks from this sample on is not sent it twice.
    events_upto: u64,
    /// The newest sample's seq (0 before the first).
    newest: u64,
    /// `samples` is everything kept: the reader replaces what it has.
    reset: bool,
}

/// The ring of recent samples (written by the sampler only).
#[derive(Default)]
pub struct History {
    ring: Mutex<VecDeque<Arc<Sample>>>,
}

impl History {
    fn push(&self, s: Sample) {
        let mut ring = self.ring.lock();
        if ring.len() == KEEP {
            ring.pop_front();
        }
        ring.push_back(Arc::new(s));
    }

    /// The samples newer than `since`. A `since` beyond the newest sample
    /// (the reader saw another node, or this one before a restart) is
    /// taken as 0: everything.
    fn after(&self, since: u64) -> After {
        let ring = self.ring.lock();
        let newest = ring.back().map_or(0, |s| s.seq);
        let since = if since > newest { 0 } else { since };
        let events_after = ring.iter().find(|s| s.seq == since).map_or(0, |s| s.events_seq);
        After {
            samples: ring.iter().filter(|s| s.seq > since).cloned().collect(),
            events_after,
            events_upto: ring.back().map_or(u64::MAX, |s| s.events_seq),
            newest,
            reset: since == 0,
        }
    }

    /// `GET /v1/history?since=SEQ`: the samples after `since`, the replica
    /// and autoscaler events since then, and what the reader needs to draw
    /// them (pipelines, stages, SLOs, which error kinds map to which status).
    pub fn since(&self, node: &Node, since: u64) -> Value {
        let a = self.after(since);
        let events: Vec<Event> =
            node.events().recent().into_iter().filter(|e| e.seq > a.events_after && e.seq <= a.events_upto).collect();
        let samples: Vec<&Sample> = a.samples.iter().map(|s| &**s).collect();
        json!({
            "seq": a.newest,
            "reset": a.reset,
            "interval_s": INTERVAL.as_secs_f64(),
            "window_s": WINDOW_S,
            "keep": KEEP,
            "pid": std::process::id(),
            "status_of": status_of_kinds(),
            // Without the example request: the page never shows it, and it is
            // polled every second (a spoken example is ~0.5 MB of samples).
            "pipelines": node.pipelines().values().map(|p| {
                let mut d = p.describe();
                if let Some(o) = d.as_object_mut() {
                    o.remove("example");
                }
                d
            }).collect::<Vec<_>>(),
            "samples": samples,
            "events": events,
        })
    }
}

/// HTTP status of the error kinds a pipeline's requests end with, taken
/// from [`NodeError::http_status`] so that the page's legend cannot drift.
fn status_of_kinds() -> BTreeMap<&'static str, u16> {
    let s = String::new;
    [
        NodeError::Overloaded { budget_ms: 0, over_ms: 0 },
        NodeError::Unavailable { stage: s(), reason: s() },
        NodeError::ShuttingDown,
        NodeError::DeadlineExceeded { stage: s() },
        NodeError::Timeout { ms: 0 },
        NodeError::Component { stage: s(), message: s() },
        NodeError::Internal(s()),
        NodeError::Arena(slipstream_shm::ShmError::Full { requested: 0, capacity: 0 }),
    ]
    .iter()
    .map(|e| (e.kind(), e.http_status()))
    .collect()
}

/// What the sampler remembers of one pipeline between samples.
struct PipelinePrev {
    /// The counters at the previous sample.
    totals: PipelineTotals,
    /// Every error kind seen since the node started (each stays in the
    /// samples, at zero when none this second, so readers' series end at zero).
    kinds: std::collections::BTreeSet<&'static str>,
    /// The last [`WINDOW_S`] seconds of latencies, one histogram per second
    /// (a ring: `next` is overwritten next), and their sum.
    seconds: Vec<Histogram<u64>>,
    next: usize,
    merged: Histogram<u64>,
}

impl PipelinePrev {
    fn new(p: &PipelineRt) -> PipelinePrev {
        let mut prev = PipelinePrev {
            totals: PipelineTotals::default(),
            kinds: Default::default(),
            seconds: (0..WINDOW_S).map(|_| window_histogram()).collect(),
            next: 0,
            merged: window_histogram(),
        };
        // Start from the counters as they are: the first sample's rates
        // are of its own second, not of everything before it.
        prev.sample(p, 1.0);
        prev
    }

    fn sample(&mut self, p: &PipelineRt, dt: f64) -> PipelineSample {
        let m = &p.metrics;
        let rate = |n: u64| n as f64 / dt;
        let now = p.totals();
        let d = now.since(&self.totals);
        self.totals = now;
        self.kinds.extend(d.errors.keys());
        let failed: BTreeMap<&'static str, f64> =
            self.kinds.iter().map(|k| (*k, rate(d.errors.get(k).copied().unwrap_or(0)))).collect();
        let failed_n: u64 = d.errors.values().sum();

        self.seconds[self.next].reset();
        m.latency_window.swap(&mut self.seconds[self.next]);
        self.next = (self.next + 1) % self.seconds.len();
        self.merged.reset();
        for h in &self.seconds {
            // Same bounds: adding cannot fail.
            let _ = self.merged.add(h);
        }
        let q = |h: &Histogram<u64>, p: f64| (!h.is_empty()).then(|| h.value_at_quantile(p) as f64 / 1e3);
        let finished = d.ok + failed_n;
        let stages = p.stages.iter().zip(&d.stages).map(|(s, sd)| stage_sample(s, sd, dt)).collect();
        PipelineSample {
            slo_ms: p.spec.slo.map(|s| s.p99_ms),
            p50_ms: q(&self.merged, 0.5),
            p99_ms: q(&self.merged, 0.99),
            max_ms: (!self.merged.is_empty()).then(|| self.merged.max() as f64 / 1e3),
            offered_rps: rate(d.offered()),
            answered_rps: rate(d.ok),
            goodput_rps: rate(d.slo_met),
            attainment: (finished > 0).then(|| d.slo_met.min(finished) as f64 / finished as f64),
            failed_rps: failed,
            fallback_rps: rate(d.fallback),
            cancelled_rps: rate(d.cancelled),
            inflight: p.inflight(),
            stages,
        }
    }
}

fn stage_sample(s: &StageRt, d: &StageTotals, dt: f64) -> StageSample {
    let mut replicas = Replicas::default();
    let mut queue = 0u64;
    for r in s.replicas().iter() {
        queue += r.load().queued as u64;
        let slot = match r.phase() {
            Phase::Draining => &mut replicas.leaving,
            _ if r.leaving() => &mut replicas.leaving,
            Phase::Ready => &mut replicas.ready,
            Phase::Starting => &mut replicas.starting,
            Phase::Standby => &mut replicas.standby,
            Phase::Down => &mut replicas.down,
            Phase::Stopped => continue,
        };
        *slot += 1;
    }
    StageSample {
        name: s.name.clone(),
        queue,
        batch_mean: (d.batches > 0).then(|| d.requests as f64 / d.batches as f64),
        rps: d.requests as f64 / dt,
        busy: d.busy_us as f64 / 1e6 / dt,
        replicas,
        target: s.wanted().map(u64::from),
    }
}

/// The sampler's state: owned by the task in [`run`].
struct Sampler {
    seq: u64,
    last: Instant,
    pipelines: Vec<(String, PipelinePrev)>,
}

impl Sampler {
    fn new(node: &Node) -> Sampler {
        Sampler {
            seq: 0,
            last: Instant::now(),
            pipelines: node.pipelines().values().map(|p| (p.name().to_string(), PipelinePrev::new(p))).collect(),
        }
    }

    fn sample(&mut self, node: &Node) -> Sample {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64().max(1e-3);
        self.last = now;
        self.seq += 1;
        let pipelines = self
            .pipelines
            .iter_mut()
            .filter_map(|(name, prev)| {
                let p = node.pipelines().get(name)?;
                Some((name.clone(), prev.sample(p, dt)))
            })
            .collect();
        Sample {
            seq: self.seq,
            unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            uptime_s: node.uptime().as_secs_f64(),
            dt_s: dt,
            events_seq: node.events().last_seq(),
            pipelines,
        }
    }
}

/// Sample `node` into `history` once per [`INTERVAL`] until it stops.
pub async fn run(history: Arc<History>, node: Arc<Node>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut sampler = Sampler::new(&node);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + INTERVAL, INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let s = sampler.sample(&node);
        history.push(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_core::pipeline::{BuildContext, PipelineBuilder};
    use slipstream_core::testing::{temp_arena, TempDir};
    use slipstream_core::AppSpec;
    use std::sync::atomic::Ordering::Relaxed;

    /// A real two-stage pipeline with three replicas a stage whose tasks
    /// never start: its counters, histograms and replica sets are what the
    /// sampler reads.
    fn pipeline() -> (Arc<PipelineRt>, TempDir) {
        let app: AppSpec = serde_json::from_str(
            r#"{"worker_argv": [], "pipelines": [{"name": "p", "inputs": {"x": {"dtype": "float32", "shape": [-1, 2]}},
                "slo": {"p99_ms": 50},
                "stages": [{"name": "a", "component": "A", "replicas": 3},
                           {"name": "b", "component": "B", "parents": ["a"], "replicas": 3}]}]}"#,
        )
        .unwrap();
        let (arena, dir) = temp_arena();
        let arena = Arc::new(arena);
        let cx = BuildContext {
            app: &app,
            arena: &arena,
            replica_pool_bytes: 1 << 16,
            request_timeout: Duration::from_secs(30),
            epoch: Instant::now(),
            start_replicas: true,
        };
        (PipelineBuilder::new(&app.pipelines[0], &cx).unwrap().build(), dir)
    }

    #[test]
    fn rates_attainment_and_failures_are_per_second_deltas() {
        let (p, _dir) = pipeline();
        let m = &p.metrics;
        m.ok.fetch_add(7, Relaxed); // before the sampler started: not in its rates
        let mut prev = PipelinePrev::new(&p);
        m.admitted.fetch_add(10, Relaxed);
        m.shed.fetch_add(2, Relaxed);
        m.ok.fetch_add(8, Relaxed);
        m.slo_met.fetch_add(6, Relaxed);
        m.slo_missed.fetch_add(2, Relaxed);
        m.error("overloaded");
        m.error("overloaded");
        p.stages[0].metrics.batches.fetch_add(2, Relaxed);
        p.stages[0].metrics.requests.fetch_add(10, Relaxed);
        p.stages[0].metrics.busy_us.fetch_add(500_000, Relaxed);
        let s = prev.sample(&p, 2.0);
        assert_eq!(s.slo_ms, Some(50.0));
        assert_eq!((s.offered_rps, s.answered_rps, s.goodput_rps), (6.0, 4.0, 3.0));
        // 6 within the deadline of 10 finished (8 answered, 2 refused).
        assert_eq!(s.attainment, Some(0.6));
        assert_eq!(s.failed_rps.get("overloaded"), Some(&1.0));
        assert_eq!(s.stages[0].batch_mean, Some(5.0));
        assert_eq!((s.stages[0].rps, s.stages[0].busy), (5.0, 0.25));
        assert_eq!(s.stages[1].batch_mean, None, "no batch ran");

        // A metrics reset (status view) does not disturb the deltas, and a
        // kind seen before stays in the map at zero.
        m.reset();
        m.ok.fetch_add(1, Relaxed);
        m.slo_met.fetch_add(1, Relaxed);
        let s = prev.sample(&p, 1.0);
        assert_eq!((s.answered_rps, s.goodput_rps, s.attainment), (1.0, 1.0, Some(1.0)));
        assert_eq!(s.failed_rps.get("overloaded"), Some(&0.0));
        let s = prev.sample(&p, 1.0);
        assert_eq!(s.attainment, None, "nothing finished");
    }

    #[test]
    fn latency_quantiles_slide_over_the_window() {
        let (p, _dir) = pipeline();
        let mut prev = PipelinePrev::new(&p);
        for ms in 1..=100u64 {
            p.metrics.latency_window.record(ms * 1000);
        }
        let s = prev.sample(&p, 1.0);
        let (p50, p99) = (s.p50_ms.unwrap(), s.p99_ms.unwrap());
        assert!((p50 - 50.0).abs() <= 1.0, "{p50}");
        assert!((p99 - 99.0).abs() <= 1.0, "{p99}");
        assert!((s.max_ms.unwrap() - 100.0).abs() <= 1.0);
        // One slow second later, the window holds both seconds.
        for _ in 0..100 {
            p.metrics.latency_window.record(400_000);
        }
        let s = prev.sample(&p, 1.0);
        assert!((s.p50_ms.unwrap() - 100.0).abs() <= 1.0, "{:?}", s.p50_ms);
        assert!((s.p99_ms.unwrap() - 400.0).abs() <= 4.0, "{:?}", s.p99_ms);
        // Quiet seconds push both out of the window.
        for i in 2..WINDOW_S {
            assert!(prev.sample(&p, 1.0).p99_ms.is_some(), "second {i} is still in the window");
        }
        assert!(prev.sample(&p, 1.0).p99_ms.is_some());
        let s = prev.sample(&p, 1.0);
        assert_eq!((s.p50_ms, s.p99_ms, s.max_ms), (None, None, None));
    }

    #[test]
    fn replicas_are_counted_by_role() {
        let (p, _dir) = pipeline();
        let set = p.stages[0].replicas();
        set[0].worker_ready(11);
        set[1].worker_ready(12);
        assert!(set[1].drain());
        let mut prev = PipelinePrev::new(&p);
        let s = prev.sample(&p, 1.0);
        let want = Replicas { ready: 1, starting: 1, leaving: 1, ..Default::default() };
        assert_eq!(s.stages[0].replicas, want);
        assert_eq!(s.stages[1].replicas, Replicas { starting: 3, ..Default::default() });
        assert_eq!(s.stages[0].queue, 0);
        assert_eq!(s.stages[0].target, None);
    }

    fn sample(seq: u64, events_seq: u64) -> Sample {
        Sample { seq, unix_ms: 0, uptime_s: 0.0, dt_s: 1.0, events_seq, pipelines: BTreeMap::new() }
    }

    #[test]
    fn the_ring_keeps_ten_minutes_and_answers_incrementally() {
        let h = History::default();
        let a = h.after(0);
        assert!(a.samples.is_empty() && a.reset && a.newest == 0);
        for seq in 1..=(KEEP as u64 + 5) {
            h.push(sample(seq, seq / 10));
        }
        let all = h.after(0);
        assert_eq!(all.samples.len(), KEEP);
        assert_eq!((all.samples[0].seq, all.newest, all.events_after, all.reset), (6, KEEP as u64 + 5, 0, true));
        let tail = h.after(KEEP as u64 + 2);
        assert_eq!(
            tail.samples.iter().map(|s| s.seq).collect::<Vec<_>>(),
            [KEEP as u64 + 3, KEEP as u64 + 4, KEEP as u64 + 5]
        );
        assert_eq!((tail.events_after, tail.reset), ((KEEP as u64 + 2) / 10, false));
        // Events up to the newest sample's: a later one comes with the next
        // sample, not now and again then.
        assert_eq!((all.events_upto, tail.events_upto), ((KEEP as u64 + 5) / 10, (KEEP as u64 + 5) / 10));
        assert_eq!(History::default().after(0).events_upto, u64::MAX, "no sample yet: every event");
        assert!(h.after(KEEP as u64 + 5).samples.is_empty());
        // A reader that saw a later seq (another node, or this one before a
        // restart) gets everything, marked as a reset.
        let other = h.after(10_000);
        assert_eq!((other.samples.len(), other.reset), (KEEP, true));
    }

    #[test]
    fn failure_kinds_carry_their_http_status() {
        let s = status_of_kinds();
        assert_eq!(s["overloaded"], 429);
        assert_eq!(s["deadline_exceeded"], 504);
        assert_eq!(s["timeout"], 504);
        assert_eq!(s["unavailable"], 503);
        assert_eq!(s["component_error"], 500);
    }

    #[test]
    fn the_dashboard_is_self_contained() {
        let page = DASHBOARD_HTML;
        assert!(page.starts_with("<!doctype html>"));
        assert!(page.contains("/v1/history?since="));
        for external in ["http://", "https://", "src=\"", "<link"] {
            let hits: Vec<_> = page.match_indices(external).map(|(i, _)| &page[i..(i + 60).min(page.len())]).collect();
            // The SVG namespace URI is a name, not a resource.
            assert!(hits.iter().all(|h| h.starts_with("http://www.w3.org/2000/svg")), "{external}: {hits:?}");
        }
    }
}
