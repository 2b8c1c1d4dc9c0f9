//! Counters and latency histograms for stages and pipelines.
//!
//! Recording is cheap (an atomic add, or an uncontended mutex around a
//! histogram) because it happens on the request path. [`crate::report`]
//! reads them into `/v1/status` (summarised by `slipstream status`) and the
//! Prometheus text on `/metrics`, written with [`PromText`].
//!
//! ## Why Prometheus histograms, not summaries
//! A p99 computed on one node cannot be combined with another node's p99
//! (the mean of two p99s is not the p99 of the union), nor narrowed to a
//! time window. Histogram buckets are counters: they add up across replicas,
//! nodes and pipelines (`sum by (le)`) and subtract across time
//! (`rate`/`increase`), and `histogram_quantile` then estimates any quantile
//! of the combined observations. So every latency is exported as a
//! histogram in seconds (`_bucket{le}`, `_sum`, `_count`).
//!
//! ## Bucket boundaries
//! `histogram_quantile` interpolates linearly inside the bucket that holds
//! the quantile, so its error is bounded by that bucket's width.
//! [`LATENCY_BOUNDS_US`] runs from 100 µs to 10 s with ten boundaries per
//! decade between 1 ms and 1 s (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 7.5 × 10^k):
//! neighbours are at most 1.33× apart where interactive SLOs live, coarser
//! below 1 ms and above 1 s. To that ladder every pipeline's SLO target (of
//! the whole app, rounded to the µs) is added, in every pipeline's latency
//! histogram: the bucket `le=<target>` then counts exactly the answers that
//! met the target (attainment needs no interpolation), and whether the p99 is
//! above or below the target is decided exactly. The boundaries are the same
//! for all pipelines of the app, and so on every node that serves it, so
//! sums over pipelines and nodes stay well-formed. Latencies are recorded
//! rounded up to the µs, so an answer that took even a nanosecond more than
//! the target is outside that bucket, exactly as the node's `slo_met` counts
//! it (`done <= arrival + target`). The per-batch hop (node -> worker ->
//! node) is tens to hundreds of µs and has its own ladder
//! ([`HOP_BOUNDS_US`], 10 µs .. 1 s); batch sizes use powers of two.
//!
//! ## Slack, which can be negative
//! The slack of the most urgent request when its batch is dispatched is
//! negative when that request is already late (a pipeline with
//! `drop_late=False` keeps such requests). A Prometheus histogram's `_sum`
//! must only grow (`rate` reads any decrease as a counter reset), so negative
//! observations cannot go in. The slack is split instead: non-negative slack
//! goes to `slack_us` (`slipstream_stage_slack_seconds`), lateness to
//! `late_us` (`slipstream_stage_dispatch_lateness_seconds`, how late, > 0);
//! the two counts add up to the batches dispatched.
//!
//! ## Two views: status since the last reset, Prometheus since start
//! One owner records each observation: [`Hist::record`] writes it, under one
//! lock, into an HdrHistogram (exact count, 3 significant digits: the
//! quantiles of `/v1/status`) and into the bucket counts and sum that
//! `/metrics` exports, so the buckets count exactly the observations the
//! HdrHistogram holds. `POST /v1/admin/reset-metrics` (`slipstream bench`,
//! and start-up after priming) resets only the status view. The
//! Prometheus view is never reset while the process lives: a counter that
//! drops is read by Prometheus as a reset, but one that was reset and grew
//! past its old value between two scrapes looks like plain growth, and
//! `increase` would silently lose what was counted before the reset. So
//! [`Counter`] keeps a total (exported) and a baseline (subtracted for
//! status), and [`Hist::reset`] clears only the HdrHistogram.

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering, Ordering::Relaxed};
use std::time::Duration;

/// Latency bucket boundaries, µs (see the module doc).
pub const LATENCY_BOUNDS_US: &[u64] = &[
    100, 250, 500, 750, //
    1_000, 1_250, 1_500, 2_000, 2_500, 3_000, 4_000, 5_000, 6_000, 7_500, //
    10_000, 12_500, 15_000, 20_000, 25_000, 30_000, 40_000, 50_000, 60_000, 75_000, //
    100_000, 125_000, 150_000, 200_000, 250_000, 300_000, 400_000, 500_000, 600_000, 750_000, //
    1_000_000, 1_500_000, 2_500_000, 5_000_000, 10_000_000,
];

/// Hop (node -> worker -> node overhead per batch) bucket boundaries, µs.
pub const HOP_BOUNDS_US: &[u64] =
    &[10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1_000, 2_000, 5_000, 10_000, 25_000, 100_000, 1_000_000];

/// Batch size bucket boundaries, requests.
pub const BATCH_BOUNDS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

/// The latency bucket boundary (µs) for an SLO target of `p99_ms`.
pub fn slo_bound_us(p99_ms: f64) -> u64 {
    ((p99_ms * 1e3).round() as u64).max(1)
}

/// A bucket boundary as its `le` label value: `bound / scale`, written the
/// shortest way that reads back as the same number (`0.037`, `10`).
pub fn le_label(bound: u64, scale: f64) -> String {
    (bound as f64 / scale).to_string()
}

/// A counter with two views: [`Counter::total`] since the process started
/// (exported to Prometheus, never goes down) and [`Counter::load`] since
/// the last [`Counter::reset`] (for `/v1/status`). `fetch_add`/`load` keep
/// the signatures of `AtomicU64`, which it replaced at the recording sites.
#[derive(Default)]
pub struct Counter {
    total: AtomicU64,
    base: AtomicU64,
}

impl Counter {
    /// Add `n`; returns the status view's previous value.
    pub fn fetch_add(&self, n: u64, order: Ordering) -> u64 {
        self.total.fetch_add(n, order).saturating_sub(self.base.load(Relaxed))
    }

    /// Count since the last reset.
    pub fn load(&self, order: Ordering) -> u64 {
        self.total.load(order).saturating_sub(self.base.load(order))
    }

    /// Count since the process started.
    pub fn total(&self) -> u64 {
        self.total.load(Relaxed)
    }

    pub fn reset(&self) {
        self.base.store(self.total.load(Relaxed), Relaxed);
    }
}

/// Counts by kind (errors), with the same two views as [`Counter`].
#[derive(Default)]
pub struct KindCounts(Mutex<BTreeMap<&'static str, (u64, u64)>>);

impl KindCounts {
    pub fn add(&self, kind: &'static str) {
        self.0.lock().entry(kind).or_default().0 += 1;
    }

    /// Since the last reset (kinds seen since then only).
    pub fn since_reset(&self) -> BTreeMap<&'static str, u64> {
        self.0.lock().iter().filter(|(_, (t, b))| t > b).map(|(k, (t, b))| (*k, t - b)).collect()
    }

    /// Since the process started.
    pub fn totals(&self) -> BTreeMap<&'static str, u64> {
        self.0.lock().iter().map(|(k, (t, _))| (*k, *t)).collect()
    }

    pub fn reset(&self) {
        self.0.lock().values_mut().for_each(|(t, b)| *b = *t);
    }
}

/// A histogram of non-negative integer observations (µs, or requests) with
/// two views (see the module doc): an HdrHistogram for the status
/// quantiles, reset with the status view, and cumulative bucket counts for
/// Prometheus, never reset.
pub struct Hist {
    /// Upper bounds (inclusive, ascending) of the finite buckets.
    bounds: Box<[u64]>,
    inner: Mutex<HistInner>,
}

struct HistInner {
    hdr: Histogram<u64>,
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    buckets: Vec<u64>,
    sum: u64,
}

/// The Prometheus view of a [`Hist`], read under its lock (consistent).
#[derive(Debug, Clone, PartialEq)]
pub struct Buckets {
    pub bounds: Vec<u64>,
    /// Cumulative counts: `cumulative[i]` observations <= `bounds[i]`; the
    /// last entry (one more than `bounds`) is `+Inf`, the total count.
    pub cumulative: Vec<u64>,
    pub sum: u64,
}

#[derive(Serialize, Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Hist {
    /// Buckets at `bounds` plus `extra` (sorted and deduplicated together).
    pub fn new(bounds: &[u64], extra: impl IntoIterator<Item = u64>) -> Hist {
        let mut b: Vec<u64> = bounds.iter().copied().chain(extra).collect();
        b.sort_unstable();
        b.dedup();
        let n = b.len();
        Hist {
            bounds: b.into_boxed_slice(),
            inner: Mutex::new(HistInner {
                hdr: Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"),
                buckets: vec![0; n + 1],
                sum: 0,
            }),
        }
    }

    /// A latency histogram (µs) on [`LATENCY_BOUNDS_US`].
    pub fn latency() -> Hist {
        Hist::new(LATENCY_BOUNDS_US, [])
    }

    pub fn record(&self, v: u64) {
        let i = self.bounds.partition_point(|&b| b < v);
        let mut h = self.inner.lock();
        h.hdr.saturating_record(v.max(1));
        h.buckets[i] += 1;
        h.sum = h.sum.saturating_add(v);
    }

    /// Record a duration in µs, rounded up (see the module doc).
    pub fn record_duration(&self, d: Duration) {
        self.record(d.as_nanos().div_ceil(1_000).min(u128::from(u64::MAX)) as u64);
    }

    /// Reset the status view (the HdrHistogram); the buckets keep counting.
    pub fn reset(&self) {
        self.inner.lock().hdr.reset();
    }

    /// Status view: summary in the recorded unit divided by `scale` (1000.0 for µs -> ms).
    pub fn summary(&self, scale: f64) -> Summary {
        let h = &self.inner.lock().hdr;
        if h.is_empty() {
            return Summary::default();
        }
        let q = |p: f64| h.value_at_quantile(p) as f64 / scale;
        Summary {
            count: h.len(),
            mean: h.mean() / scale,
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            p999: q(0.999),
            max: h.max() as f64 / scale,
        }
    }

    /// Prometheus view: cumulative bucket counts since the process started.
    pub fn buckets(&self) -> Buckets {
        let h = self.inner.lock();
        let cumulative = h
            .buckets
            .iter()
            .scan(0u64, |acc, n| {
                *acc += n;
                Some(*acc)
            })
            .collect();
        Buckets { bounds: self.bounds.to_vec(), cumulative, sum: h.sum }
    }
}

pub struct StageMetrics {
    /// Requests dropped from this stage's queue because their deadline passed.
    pub dropped_late: Counter,
    /// Deadline slack of the most urgent request when a batch is dispatched,
    /// µs, when it is not late yet (see [`StageMetrics::record_dispatch`]).
    pub slack_us: Hist,
    /// How late the most urgent request was when its batch was dispatched,
    /// µs, when it was late.
    pub late_us: Hist,
    pub batches: Counter,
    pub requests: Counter,
    /// Time replicas were busy with batches (node -> worker -> node), µs.
    pub busy_us: Counter,
    pub errors: Counter,
    pub retries: Counter,
    /// Worker restarts (not reset with the status view: a stage's history).
    pub restarts: Counter,
    /// Requests per batch.
    pub batch_size: Hist,
    /// Time from enqueue to dispatch, µs.
    pub queue_wait_us: Hist,
    /// Time the component itself ran, per batch, µs (reported by the worker).
    pub compute_us: Hist,
    /// Node -> worker -> node overhead per batch: round trip minus compute, µs.
    pub hop_us: Hist,
}

impl Default for StageMetrics {
    fn default() -> Self {
        StageMetrics {
            dropped_late: Counter::default(),
            slack_us: Hist::latency(),
            late_us: Hist::latency(),
            batches: Counter::default(),
            requests: Counter::default(),
            busy_us: Counter::default(),
            errors: Counter::default(),
            retries: Counter::default(),
            restarts: Counter::default(),
            batch_size: Hist::new(BATCH_BOUNDS, []),
            queue_wait_us: Hist::latency(),
            compute_us: Hist::latency(),
            hop_us: Hist::new(HOP_BOUNDS_US, []),
        }
    }
}

pub struct PipelineMetrics {
    pub ok: Counter,
    /// Requests let in by admission control.
    pub admitted: Counter,
    /// Requests refused at ingress (429): predicted to miss their deadline.
    pub shed: Counter,
    /// Answered within the SLO (goodput) / answered late.
    pub slo_met: Counter,
    pub slo_missed: Counter,
    /// Answered with the declared fallback instead of an error.
    pub fallback: Counter,
    /// Admitted, then abandoned by their client before the answer.
    pub cancelled: Counter,
    pub errors: KindCounts,
    /// End-to-end latency inside the node (body read to response ready), µs.
    pub latency_us: Hist,
    /// The same latencies since the history sampler last looked (the
    /// dashboard's sliding window; see [`crate::history`]).
    pub latency_window: crate::history::LatencyWindow,
}

impl Default for PipelineMetrics {
    fn default() -> Self {
        PipelineMetrics::new(&[])
    }
}

impl PipelineMetrics {
    /// Metrics whose latency buckets include `slo_targets_ms` (every
    /// pipeline's SLO target in the app; see the module doc).
    pub fn new(slo_targets_ms: &[f64]) -> Self {
        let extra = slo_targets_ms.iter().filter(|t| t.is_finite() && **t > 0.0).map(|t| slo_bound_us(*t));
        PipelineMetrics {
            ok: Counter::default(),
            admitted: Counter::default(),
            shed: Counter::default(),
            slo_met: Counter::default(),
            slo_missed: Counter::default(),
            fallback: Counter::default(),
            cancelled: Counter::default(),
            errors: KindCounts::default(),
            latency_us: Hist::new(LATENCY_BOUNDS_US, extra),
            latency_window: Default::default(),
        }
    }

    pub fn error(&self, kind: &'static str) {
        self.errors.add(kind);
    }

    /// Reset the status view (see the module doc).
    pub fn reset(&self) {
        for c in
            [&self.ok, &self.admitted, &self.shed, &self.slo_met, &self.slo_missed, &self.fallback, &self.cancelled]
        {
            c.reset();
        }
        self.errors.reset();
        self.latency_us.reset();
    }
}

impl StageMetrics {
    /// A batch is dispatched with its most urgent request due at
    /// `deadline_ns` (ns since the pipeline's epoch) at `now_ns`: record its
    /// slack, or its lateness when it is late.
    pub fn record_dispatch(&self, deadline_ns: u64, now_ns: u64) {
        match deadline_ns.checked_sub(now_ns) {
            Some(slack) => self.slack_us.record(slack / 1_000),
            None => self.late_us.record((now_ns - deadline_ns).div_ceil(1_000)),
        }
    }

    /// Reset the status view (see the module doc).
    pub fn reset(&self) {
        for c in [&self.batches, &self.requests, &self.busy_us, &self.errors, &self.retries, &self.dropped_late] {
            c.reset();
        }
        for h in [&self.slack_us, &self.late_us, &self.batch_size, &self.queue_wait_us, &self.compute_us, &self.hop_us]
        {
            h.reset();
        }
    }
}

/// Prometheus text exposition (format 0.0.4). Samples are collected per
/// metric family and written family by family, each after its one `# HELP`
/// and `# TYPE`, as the format requires: callers loop over pipelines and
/// stages and would otherwise interleave families. Families are written in
/// the order they were first named.
#[derive(Default)]
pub struct PromText {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

struct Family {
    name: String,
    kind: &'static str,
    help: String,
    samples: String,
}

impl PromText {
    /// Declare a family (its HELP and TYPE are written even if it gets no
    /// samples, so the set of exported names does not depend on traffic);
    /// returns its sample buffer.
    pub fn declare(&mut self, name: &str, kind: &'static str, help: &str) -> &mut String {
        let i = *self.index.entry(name.to_string()).or_insert_with(|| {
            self.families.push(Family { name: name.to_string(), kind, help: help.to_string(), samples: String::new() });
            self.families.len() - 1
        });
        let f = &mut self.families[i];
        debug_assert_eq!(f.kind, kind, "metric family {name} declared with two types");
        &mut f.samples
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: u64) {
        let out = self.declare(name, "counter", help);
        let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels));
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        let out = self.declare(name, "gauge", help);
        let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels));
    }

    /// A histogram from `h`'s cumulative buckets, bounds and sum divided by
    /// `scale` (1e6 for µs -> s, 1.0 for plain counts).
    pub fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Hist, scale: f64) {
        let b = h.buckets();
        let out = self.declare(name, "histogram", help);
        let les = b.bounds.iter().map(|&x| le_label(x, scale)).chain(std::iter::once("+Inf".to_string()));
        for (le, n) in les.zip(&b.cumulative) {
            let mut l = labels.to_vec();
            l.push(("le", &le));
            let _ = writeln!(out, "{name}_bucket{} {n}", fmt_labels(&l));
        }
        let count = b.cumulative.last().copied().unwrap_or(0);
        let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(labels), b.sum as f64 / scale);
        let _ = writeln!(out, "{name}_count{} {count}", fmt_labels(labels));
    }

    pub fn finish(self) -> String {
        let mut out = String::new();
        for f in self.families {
            let help = f.help.replace('\\', "\\\\").replace('\n', "\\n");
            let _ = writeln!(out, "# HELP {} {help}\n# TYPE {} {}", f.name, f.name, f.kind);
            out.push_str(&f.samples);
        }
        out
    }
}

fn fmt_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")))
        .collect();
    format!("{{{}}}", parts.join(","))
}

/// A counter's increase since the last look (the autoscaler's and the
/// history's per-tick rates); a counter that went back (a metrics reset)
/// counts from zero.
#[derive(Default)]
pub(crate) struct Delta(u64);

impl Delta {
    pub(crate) fn take(&mut self, now: u64) -> u64 {
        let d = if now >= self.0 { now - self.0 } else { now };
        self.0 = now;
        d
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashSet};

    #[test]
    fn histogram_summary_in_ms() {
        let h = Hist::latency();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let s = h.summary(1000.0);
        assert_eq!(s.count, 1000);
        assert!((s.p50 - 500.0).abs() < 2.0, "{s:?}");
        assert!((s.p99 - 990.0).abs() < 2.0, "{s:?}");
    }

    #[test]
    fn buckets_count_exactly_what_was_recorded() {
        let h = Hist::new(&[10, 20, 30], [25, 20]);
        for v in [0, 10, 11, 20, 21, 25, 26, 30, 31, 1_000_000] {
            h.record(v);
        }
        let b = h.buckets();
        assert_eq!(b.bounds, vec![10, 20, 25, 30]);
        assert_eq!(b.cumulative, vec![2, 4, 6, 8, 10], "le is inclusive; the last is +Inf");
        assert_eq!(b.sum, 10 + 11 + 20 + 21 + 25 + 26 + 30 + 31 + 1_000_000);
        assert_eq!(h.summary(1.0).count, 10, "both views hold the same observations");
    }

    #[test]
    fn durations_round_up_to_the_microsecond() {
        let h = Hist::new(&[50_000], []);
        h.record_duration(Duration::from_micros(50_000));
        h.record_duration(Duration::from_nanos(50_000_001));
        assert_eq!(h.buckets().cumulative, vec![1, 2], "1 ns over the target is outside le=target");
    }

    #[test]
    fn slo_targets_are_bucket_boundaries() {
        let m = PipelineMetrics::new(&[37.0, 12.3456, 50.0]);
        let b = m.latency_us.buckets();
        for t in [37_000, 12_346, 50_000] {
            assert!(b.bounds.contains(&t), "{t}");
        }
        assert!(b.bounds.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn negative_slack_goes_to_lateness() {
        let m = StageMetrics::default();
        m.record_dispatch(5_000_000, 1_000_000);
        m.record_dispatch(1_000_000, 1_000_500);
        assert_eq!((m.slack_us.buckets().sum, m.slack_us.summary(1.0).count), (4_000, 1));
        assert_eq!((m.late_us.buckets().sum, m.late_us.summary(1.0).count), (1, 1));
    }

    #[test]
    fn reset_clears_the_status_view_only() {
        let c = Counter::default();
        c.fetch_add(5, Relaxed);
        c.reset();
        c.fetch_add(2, Relaxed);
        assert_eq!((c.load(Relaxed), c.total()), (2, 7));
        let m = PipelineMetrics::default();
        m.error("timeout");
        m.latency_us.record(1_000);
        m.reset();
        m.error("bad_input");
        assert_eq!(m.errors.since_reset(), BTreeMap::from([("bad_input", 1)]));
        assert_eq!(m.errors.totals(), BTreeMap::from([("bad_input", 1), ("timeout", 1)]));
        assert_eq!(m.latency_us.summary(1.0).count, 0);
        assert_eq!(m.latency_us.buckets().cumulative.last(), Some(&1));
    }

    #[test]
    fn prometheus_text_declares_once() {
        let mut p = PromText::default();
        p.counter("x_total", "things", &[("stage", "a")], 3);
        p.counter("x_total", "things", &[("stage", "b\"q")], 4);
        let t = p.finish();
        assert_eq!(t.matches("# TYPE x_total counter").count(), 1);
        assert!(t.contains("x_total{stage=\"a\"} 3"));
        assert!(t.contains("x_total{stage=\"b\\\"q\"} 4"));
    }

    /// Check `text` the way a strict exposition-format parser does, and
    /// return the histogram series found (family -> label sets). Panics on:
    /// a sample before its family's TYPE, a family declared twice or whose
    /// samples are not contiguous, a sample name that does not belong to
    /// its family, a malformed line, histogram buckets out of order or not
    /// cumulative, no `+Inf` bucket, `+Inf` != `_count`, a missing `_sum`.
    pub(crate) fn check_exposition(text: &str) -> BTreeMap<String, Vec<String>> {
        let mut declared: HashSet<String> = HashSet::new();
        // (family, type) of the family being read.
        let mut current: Option<(String, String)> = None;
        // (family, labels without le) -> (buckets [(le, n)], sum, count).
        type Series = (Vec<(f64, f64)>, Option<f64>, Option<f64>);
        let mut hist: BTreeMap<(String, String), Series> = BTreeMap::new();
        let mut pending_help: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap().to_string();
                assert!(pending_help.is_none(), "HELP without TYPE before {line}");
                pending_help = Some(name);
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split(' ');
                let (name, kind) = (it.next().unwrap().to_string(), it.next().unwrap().to_string());
                assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind.as_str()), "{line}");
                assert_eq!(pending_help.take().as_deref(), Some(name.as_str()), "HELP and TYPE name differ: {line}");
                assert!(declared.insert(name.clone()), "family {name} declared twice");
                current = Some((name, kind));
                continue;
            }
            assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
            };
            let (name, labels) = match series.find('{') {
                Some(i) => {
                    assert!(series.ends_with('}'), "{line}");
                    (&series[..i], &series[i + 1..series.len() - 1])
                }
                None => (series, ""),
            };
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'), "{line}");
            let pairs = parse_labels(labels).unwrap_or_else(|| panic!("bad labels in {line}"));
            let (family, kind) = current.clone().unwrap_or_else(|| panic!("sample before any TYPE: {line}"));
            if kind == "histogram" {
                let suffix = name.strip_prefix(family.as_str()).unwrap_or_else(|| panic!("{name} not in {family}"));
                let rest: Vec<String> =
                    pairs.iter().filter(|(k, _)| k != "le").map(|(k, v)| format!("{k}={v}")).collect();
                let e = hist.entry((family.clone(), rest.join(","))).or_default();
                match suffix {
                    "_bucket" => {
                        let le = pairs.iter().find(|(k, _)| k == "le").expect("bucket has le").1.clone();
                        let le = if le == "+Inf" { f64::INFINITY } else { le.parse().expect("numeric le") };
                        assert!(e.1.is_none() && e.2.is_none(), "bucket after _sum/_count: {line}");
                        e.0.push((le, value));
                    }
                    "_sum" => e.1 = Some(value),
                    "_count" => e.2 = Some(value),
                    _ => panic!("{name} is not a histogram sample of {family}"),
                }
            } else {
                assert_eq!(name, family, "sample {name} inside family {family}");
            }
        }
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for ((family, labels), (buckets, sum, count)) in hist {
            assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0), "{family}{{{labels}}}: le not increasing");
            assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{family}{{{labels}}}: buckets not cumulative");
            let last = buckets.last().unwrap_or_else(|| panic!("{family}{{{labels}}}: no buckets"));
            assert!(last.0.is_infinite(), "{family}{{{labels}}}: no +Inf bucket");
            assert_eq!(Some(last.1), count, "{family}{{{labels}}}: +Inf != _count");
            assert!(sum.is_some(), "{family}{{{labels}}}: no _sum");
            out.entry(family).or_default().push(labels);
        }
        out
    }

    /// `k="v",k2="v2"` with escapes, or None when malformed.
    fn parse_labels(s: &str) -> Option<Vec<(String, String)>> {
        let mut out = Vec::new();
        let mut chars = s.chars().peekable();
        while chars.peek().is_some() {
            let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
            if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            if chars.next()? != '"' {
                return None;
            }
            let mut v = String::new();
            loop {
                match chars.next()? {
                    '\\' => match chars.next()? {
                        'n' => v.push('\n'),
                        c @ ('\\' | '"') => v.push(c),
                        _ => return None,
                    },
                    '"' => break,
                    c => v.push(c),
                }
            }
            out.push((key, v));
            match chars.next() {
                None => break,
                Some(',') => continue,
                Some(_) => return None,
            }
        }
        Some(out)
    }

    #[test]
    fn families_are_grouped_and_histograms_well_formed() {
        let hists: Vec<Hist> = (0..2).map(|_| Hist::new(LATENCY_BOUNDS_US, [37_000])).collect();
        for (i, h) in hists.iter().enumerate() {
            for v in [0, 90, 37_000, 37_001, 2_000_000, 20_000_000] {
                h.record(v * (i as u64 + 1));
            }
        }
        let mut p = PromText::default();
        p.declare("never_seen_total", "counter", "Declared without samples.");
        // Interleaved as report.rs loops: per pipeline, a counter then a histogram then a gauge.
        for (i, h) in hists.iter().enumerate() {
            let name = format!("p{i}");
            let l = [("pipeline", name.as_str())];
            p.counter("ok_total", "ok", &l, i as u64);
            p.histogram("latency_seconds", "lat", &l, h, 1e6);
            p.gauge("ready", "ready", &l, 1.0);
        }
        let text = p.finish();
        let hist = check_exposition(&text);
        assert_eq!(hist["latency_seconds"].len(), 2);
        assert!(text.contains("latency_seconds_bucket{pipeline=\"p0\",le=\"0.037\"} 3\n"), "{text}");
        assert!(text.contains("latency_seconds_bucket{pipeline=\"p0\",le=\"+Inf\"} 6\n"), "{text}");
        assert!(text.contains("latency_seconds_count{pipeline=\"p1\"} 6\n"), "{text}");
        assert!(text.contains("latency_seconds_sum{pipeline=\"p0\"} 22.074091\n"), "{text}");
        assert!(text.starts_with(
            "# HELP never_seen_total Declared without samples.\n# TYPE never_seen_total counter\n# HELP ok_total"
        ));
    }

    #[test]
    #[should_panic(expected = "declared twice")]
    fn the_checker_rejects_interleaved_families() {
        check_exposition(
            "# HELP a a\n# TYPE a counter\na 1\n# HELP b b\n# TYPE b gauge\nb 1\n# HELP a a\n# TYPE a counter\na 2\n",
        );
    }

    #[test]
    #[should_panic(expected = "not cumulative")]
    fn the_checker_rejects_decreasing_buckets() {
        check_exposition(
            "# HELP h h\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"2\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",
        );
    }
}
