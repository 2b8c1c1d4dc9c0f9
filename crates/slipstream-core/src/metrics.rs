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
use std::collections::BTreeMap;
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

    /// Reset the status view (see the module doc).
    pub fn reset(&self) {
        self.base.store(self.total.load(Relaxed), Relaxed);
    }
}

/// Counts by kind (errors), with the same two views as [`Counter`].
#[derive(Default)]
pub struct KindCounts(Mutex<BTreeMap<&'static str, (u64, u64)>>);

impl KindCounts {
    /// Count one of `kind`.
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

    /// Reset the status view (see the module doc).
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
    /// The finite buckets' upper bounds.
    pub bounds: Vec<u64>,
    /// Cumulative counts: `cumulative[i]` observations <= `bounds[i]`; the
    /// last entry (one more than `bounds`) is `+Inf`, the total count.
    pub cumulative: Vec<u64>,
    /// The sum of the observations.
    pub sum: u64,
}

/// A histogram's status view, in the unit asked for.
#[derive(Serialize, Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    /// Observations.
    pub count: u64,
    /// Their mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
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

    /// Record one observation.
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

/// A stage's counters and histograms.
pub struct StageMetrics {
    /// Requests dropped from this stage's queue because their deadline passed.
    pub dropped_late: Counter,
    /// Deadline slack of the most urgent request when a batch is dispatched,
    /// µs, when it is not late yet (see [`StageMetrics::record_dispatch`]).
    pub slack_us: Hist,
    /// How late the most urgent request was when its batch was dispatched,
    /// µs, when it was late.
    pub late_us: Hist,
    /// Batches run.
    pub batches: Counter,
    /// Requests run.
    pub requests: Counter,
    /// Time replicas were busy with batches (node -> worker -> node), µs.
    pub busy_us: Counter,
    /// Requests its component failed.
    pub errors: Counter,
    /// Requests retried after their executor was lost.
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

/// A pipeline's counters and histograms.
pub struct PipelineMetrics {
    /// Answered successfully.
    pub ok: Counter,
    /// Requests let in by admission control.
    pub admitted: Counter,
    /// Requests refused at ingress (429): predicted to miss their deadline.
    pub shed: Counter,
    /// Answered within the SLO (goodput) / answered late.
    pub slo_met: Counter,
    /// Answered after their deadline.
    pub slo_missed: Counter,
    /// Answered with the declared fallback instead of an error.
    pub fallback: Counter,
    /// Admitted, then abandoned by their client before the answer.
    pub cancelled: Counter,
    /// Failed or refused, by error kind.
    pub errors: KindCounts,
    /// End-to-end latency inside the node (body read to response ready), µs.
    pub latency_us: Hist,
    /// The same latencies since a sampler last took them (the dashboard's
    /// sliding window; see [`LatencyWindow`]).
    pub latency_window: LatencyWindow,
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

    /// Count a request that failed with an error of `kind`.
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

/// A histogram of µs latencies at 2 significant digits (quantiles within
/// 1%): small enough (25 kB) to keep one per second of a sliding window.
pub fn window_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 2).expect("valid bounds")
}

/// Latencies (µs) of the requests answered since a sampler last took them
/// (the dashboard's sliding window). The request path records here next to
/// the cumulative [`PipelineMetrics::latency_us`]; the sampler swaps the
/// histogram out (a pointer swap under the lock), so recording never waits
/// behind a quantile computation.
pub struct LatencyWindow(Mutex<Histogram<u64>>);

impl Default for LatencyWindow {
    fn default() -> Self {
        LatencyWindow(Mutex::new(window_histogram()))
    }
}

impl LatencyWindow {
    /// Record one answer's latency.
    pub fn record(&self, us: u64) {
        self.0.lock().saturating_record(us.max(1));
    }

    /// Hand over what was recorded in exchange for `empty` (reset here).
    pub fn swap(&self, empty: &mut Histogram<u64>) {
        empty.reset();
        std::mem::swap(&mut *self.0.lock(), empty);
    }
}

/// A stage's counters at one instant, since the process started.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageTotals {
    /// Batches run.
    pub batches: u64,
    /// Requests run.
    pub requests: u64,
    /// Replica busy time, µs.
    pub busy_us: u64,
    /// Requests dropped from its queues after their deadline.
    pub dropped_late: u64,
}

/// A pipeline's counters at one instant, since the process started: what
/// every sampler of the node's rates (the autoscaler's trend, the
/// dashboard's history) takes, so that each keeps only its previous
/// [`PipelineTotals`] and derives its rates with [`PipelineTotals::since`].
/// Totals never go back (a metrics reset changes only the status view), so
/// a difference is always the count in between.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineTotals {
    /// Answered successfully.
    pub ok: u64,
    /// Let in by admission control.
    pub admitted: u64,
    /// Refused at ingress.
    pub shed: u64,
    /// Answered within their deadline.
    pub slo_met: u64,
    /// Answered after it.
    pub slo_missed: u64,
    /// Answered with the declared fallback.
    pub fallback: u64,
    /// Abandoned by their client.
    pub cancelled: u64,
    /// Failed or refused, by error kind.
    pub errors: BTreeMap<&'static str, u64>,
    /// Per stage, in the pipeline's order.
    pub stages: Vec<StageTotals>,
}

impl PipelineTotals {
    /// What was counted between `prev` and `self` (both taken of the same pipeline).
    pub fn since(&self, prev: &PipelineTotals) -> PipelineTotals {
        let d = |now: u64, then: u64| now.saturating_sub(then);
        PipelineTotals {
            ok: d(self.ok, prev.ok),
            admitted: d(self.admitted, prev.admitted),
            shed: d(self.shed, prev.shed),
            slo_met: d(self.slo_met, prev.slo_met),
            slo_missed: d(self.slo_missed, prev.slo_missed),
            fallback: d(self.fallback, prev.fallback),
            cancelled: d(self.cancelled, prev.cancelled),
            errors: self.errors.iter().map(|(k, n)| (*k, d(*n, prev.errors.get(k).copied().unwrap_or(0)))).collect(),
            stages: self
                .stages
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let p = prev.stages.get(i).cloned().unwrap_or_default();
                    StageTotals {
                        batches: d(s.batches, p.batches),
                        requests: d(s.requests, p.requests),
                        busy_us: d(s.busy_us, p.busy_us),
                        dropped_late: d(s.dropped_late, p.dropped_late),
                    }
                })
                .collect(),
        }
    }

    /// Requests that arrived: admitted or refused at ingress.
    pub fn offered(&self) -> u64 {
        self.admitted + self.shed
    }

    /// Requests that missed: refused, answered late, or dropped late.
    pub fn missed(&self) -> u64 {
        self.shed + self.slo_missed + self.stages.iter().map(|s| s.dropped_late).sum::<u64>()
    }
}

impl StageMetrics {
    /// The counters as they are now (see [`PipelineTotals`]).
    pub fn totals(&self) -> StageTotals {
        StageTotals {
            batches: self.batches.total(),
            requests: self.requests.total(),
            busy_us: self.busy_us.total(),
            dropped_late: self.dropped_late.total(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::BTreeMap;

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
    fn totals_subtract_to_the_counts_in_between() {
        let m = PipelineMetrics::default();
        let st = StageMetrics::default();
        let take = |m: &PipelineMetrics, st: &StageMetrics| PipelineTotals {
            admitted: m.admitted.total(),
            shed: m.shed.total(),
            errors: m.errors.totals(),
            stages: vec![st.totals()],
            ..Default::default()
        };
        m.admitted.fetch_add(3, Relaxed);
        let before = take(&m, &st);
        m.admitted.fetch_add(2, Relaxed);
        m.shed.fetch_add(1, Relaxed);
        m.reset(); // the status view only: totals keep counting
        m.error("timeout");
        st.dropped_late.fetch_add(4, Relaxed);
        let d = take(&m, &st).since(&before);
        assert_eq!((d.admitted, d.offered(), d.missed()), (2, 3, 5));
        assert_eq!(d.errors, BTreeMap::from([("timeout", 1)]));
    }
}
