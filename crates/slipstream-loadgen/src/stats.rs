//! Measured-window accounting: latency histogram, outcome counters, and the
//! percentile extraction used by [`crate::RunReport`].

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest latency the histogram tracks exactly (60 s, in µs); larger values
/// saturate to it.
const MAX_LATENCY_US: u64 = 60_000_000;

/// Latency summary in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Percentiles {
    /// Summary of a histogram recorded in microseconds (all zero if empty).
    pub fn from_histogram_us(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            mean: h.mean() / 1000.0,
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

/// Why a request failed; rendered as the `errors_by_kind` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ErrKind {
    /// Could not open a TCP connection.
    Connect,
    /// Transport or protocol failure after connecting.
    Io,
    /// No complete response within `timeout_s` of the scheduled time.
    Timeout,
    /// A complete response with a non-2xx status.
    Status(u16),
}

impl ErrKind {
    pub(crate) fn key(self) -> String {
        match self {
            Self::Connect => "connect".into(),
            Self::Io => "io".into(),
            Self::Timeout => "timeout".into(),
            Self::Status(code) => format!("status_{code}"),
        }
    }
}

/// One bucket of a run's timeline: the requests scheduled in it and what
/// became of them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Bucket {
    /// Start of the bucket, seconds from the start of the measured window.
    pub t_s: f64,
    pub ok: u64,
    /// OK responses slower than `slo_ms` (0 when it is unset).
    pub slower_than_slo: u64,
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Latency of OK responses, ms.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Every OK latency in the bucket, ms, sorted (only when
    /// `BenchConfig::timeline_latencies` is set): exact percentiles over
    /// any window of buckets.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub latencies_ms: Vec<f32>,
    /// Slowest error response by kind, ms from when the request was sent
    /// (not scheduled): how promptly the server answered with the error,
    /// whatever the generator's own lag.
    pub max_error_ms: BTreeMap<String, f64>,
}

/// Raw per-bucket records, summarised into [`Bucket`]s at the end.
#[derive(Default)]
pub(crate) struct RawBucket {
    ok_us: Vec<u32>,
    by_kind: BTreeMap<ErrKind, (u64, u64)>,
}

/// Counters and histogram for the requests scheduled inside the measured
/// window. Guarded by one mutex in `engine::Shared`; each completion takes it
/// once (uncontended on the single-threaded runtime).
pub(crate) struct WindowStats {
    pub(crate) hist: Histogram<u64>,
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) by_kind: BTreeMap<ErrKind, u64>,
    pub(crate) late_sends: u64,
    pub(crate) retries: u64,
    /// Bucket width (µs) and buckets, when a timeline is asked for.
    pub(crate) timeline: Option<(u64, Vec<RawBucket>)>,
}

impl WindowStats {
    pub(crate) fn new() -> Self {
        Self {
            hist: Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("static histogram bounds are valid"),
            ok: 0,
            errors: 0,
            by_kind: BTreeMap::new(),
            late_sends: 0,
            retries: 0,
            timeline: None,
        }
    }

    /// Also keep a timeline of buckets `width_us` wide.
    pub(crate) fn with_timeline(mut self, width_us: Option<u64>) -> Self {
        self.timeline = width_us.map(|w| (w.max(1), Vec::new()));
        self
    }

    fn bucket(&mut self, offset_us: u64) -> Option<&mut RawBucket> {
        let (width, buckets) = self.timeline.as_mut()?;
        let i = usize::try_from(offset_us / *width).ok()?.min(1 << 20);
        if buckets.len() <= i {
            buckets.resize_with(i + 1, RawBucket::default);
        }
        Some(&mut buckets[i])
    }

    /// Record one outcome in the timeline, `offset_us` after the window
    /// start: its latency from the scheduled time, and from the send.
    pub(crate) fn record_in_timeline(
        &mut self,
        offset_us: u64,
        latency_us: u64,
        since_send_us: u64,
        outcome: Result<(), ErrKind>,
    ) {
        if let Some(b) = self.bucket(offset_us) {
            match outcome {
                Ok(()) => b.ok_us.push(u32::try_from(latency_us).unwrap_or(u32::MAX)),
                Err(kind) => {
                    let (n, max_us) = b.by_kind.entry(kind).or_insert((0, 0));
                    *n += 1;
                    *max_us = (*max_us).max(since_send_us);
                }
            }
        }
    }

    /// The timeline's buckets, summarised (empty without a timeline);
    /// `with_latencies`: with every OK latency too.
    pub(crate) fn buckets(&mut self, slo_us: Option<u64>, with_latencies: bool) -> Vec<Bucket> {
        let Some((width, raw)) = self.timeline.as_mut() else { return Vec::new() };
        let width = *width;
        raw.iter_mut()
            .enumerate()
            .map(|(i, b)| {
                b.ok_us.sort_unstable();
                let q = |p: f64| {
                    if b.ok_us.is_empty() {
                        0.0
                    } else {
                        b.ok_us[((b.ok_us.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
                    }
                };
                Bucket {
                    t_s: (i as u64 * width) as f64 / 1e6,
                    ok: b.ok_us.len() as u64,
                    slower_than_slo: slo_us
                        .map_or(0, |s| b.ok_us.iter().filter(|&&us| u64::from(us) > s).count() as u64),
                    errors_by_kind: b.by_kind.iter().map(|(k, (n, _))| (k.key(), *n)).collect(),
                    p50_ms: q(0.5),
                    p99_ms: q(0.99),
                    max_ms: q(1.0),
                    latencies_ms: if with_latencies {
                        b.ok_us.iter().map(|&us| us as f32 / 1000.0).collect()
                    } else {
                        Vec::new()
                    },
                    max_error_ms: b.by_kind.iter().map(|(k, (_, us))| (k.key(), *us as f64 / 1000.0)).collect(),
                }
            })
            .collect()
    }

    pub(crate) fn record_ok(&mut self, latency_us: u64) {
        self.ok += 1;
        self.hist.saturating_record(latency_us.max(1));
    }

    pub(crate) fn record_err(&mut self, kind: ErrKind) {
        self.errors += 1;
        *self.by_kind.entry(kind).or_insert(0) += 1;
    }

    pub(crate) fn errors_by_kind(&self) -> BTreeMap<String, u64> {
        self.by_kind.iter().map(|(k, v)| (k.key(), *v)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_uniform_1_to_10000_us() {
        let mut s = WindowStats::new();
        for us in 1..=10_000 {
            s.record_ok(us);
        }
        let p = Percentiles::from_histogram_us(&s.hist);
        let close = |got: f64, want: f64| (got - want).abs() <= want * 0.002 + 0.001;
        assert!(close(p.mean, 5.0005), "mean {}", p.mean);
        assert!(close(p.p50, 5.0), "p50 {}", p.p50);
        assert!(close(p.p90, 9.0), "p90 {}", p.p90);
        assert!(close(p.p99, 9.9), "p99 {}", p.p99);
        assert!(close(p.p999, 9.99), "p999 {}", p.p999);
        assert!(close(p.max, 10.0), "max {}", p.max);
        assert_eq!(s.ok, 10_000);
    }

    #[test]
    fn empty_histogram_is_all_zero() {
        let s = WindowStats::new();
        assert_eq!(Percentiles::from_histogram_us(&s.hist), Percentiles::default());
    }

    #[test]
    fn huge_latency_saturates_and_zero_is_clamped() {
        let mut s = WindowStats::new();
        s.record_ok(0);
        s.record_ok(u64::MAX);
        let p = Percentiles::from_histogram_us(&s.hist);
        assert!(p.max >= 59_900.0 && p.max <= 60_100.0, "max {}", p.max);
        assert!(p.p50 <= 0.002, "p50 {}", p.p50);
    }

    #[test]
    fn timeline_buckets_by_scheduled_time() {
        let mut s = WindowStats::new().with_timeline(Some(100_000));
        for i in 0..100u64 {
            s.record_in_timeline(i * 1000, 1000 + i, 1000, Ok(()));
        }
        s.record_in_timeline(250_000, 40_000, 40_000, Ok(()));
        s.record_in_timeline(250_000, 9_000, 7_000, Err(ErrKind::Status(503)));
        let b = s.buckets(Some(20_000), true);
        assert_eq!(b.len(), 3);
        assert_eq!((b[0].t_s, b[0].ok, b[0].slower_than_slo), (0.0, 100, 0));
        assert!((b[0].p99_ms - 1.098).abs() < 1e-9, "{}", b[0].p99_ms);
        assert_eq!((b[1].ok, b[1].p99_ms), (0, 0.0), "an empty bucket");
        assert_eq!((b[2].ok, b[2].slower_than_slo, b[2].errors_by_kind["status_503"]), (1, 1, 1));
        assert_eq!(b[2].max_error_ms["status_503"], 7.0);
        assert_eq!(b[2].latencies_ms, vec![40.0]);
        assert!(s.buckets(None, false)[0].latencies_ms.is_empty());
        assert!(WindowStats::new().buckets(None, true).is_empty());
    }

    #[test]
    fn error_keys() {
        let mut s = WindowStats::new();
        s.record_err(ErrKind::Status(503));
        s.record_err(ErrKind::Status(503));
        s.record_err(ErrKind::Timeout);
        s.record_err(ErrKind::Connect);
        s.record_err(ErrKind::Io);
        let m = s.errors_by_kind();
        assert_eq!(m["status_503"], 2);
        assert_eq!(m["timeout"], 1);
        assert_eq!(m["connect"], 1);
        assert_eq!(m["io"], 1);
        assert_eq!(s.errors, 5);
    }
}
