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

/// Counters and histogram for the requests scheduled inside the measured
/// window. Guarded by one mutex in `engine::Shared`; each completion takes it
/// once (uncontended on the single-threaded runtime).
pub(crate) struct WindowStats {
    pub(crate) hist: Histogram<u64>,
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) by_kind: BTreeMap<ErrKind, u64>,
    pub(crate) late_sends: u64,
}

impl WindowStats {
    pub(crate) fn new() -> Self {
        Self {
            hist: Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("static histogram bounds are valid"),
            ok: 0,
            errors: 0,
            by_kind: BTreeMap::new(),
            late_sends: 0,
        }
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
