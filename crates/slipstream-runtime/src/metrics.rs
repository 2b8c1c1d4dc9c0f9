//! Counters and latency histograms for stages and pipelines.
//!
//! Recording is cheap (an atomic add, or an uncontended mutex around an
//! HdrHistogram) because it happens on the request path. [`crate::report`]
//! reads them into `/v1/status` (summarised by `slipstream status`) and the
//! Prometheus text on `/metrics`, written with [`PromText`].

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A histogram of microsecond values (1 µs .. 10 min, 3 significant digits).
pub struct Hist(Mutex<Histogram<u64>>);

impl Default for Hist {
    fn default() -> Self {
        Hist(Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")))
    }
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
    pub fn record(&self, v: u64) {
        self.0.lock().saturating_record(v.max(1));
    }

    pub fn reset(&self) {
        self.0.lock().reset();
    }

    /// Summary in the recorded unit divided by `scale` (1000.0 for µs -> ms).
    pub fn summary(&self, scale: f64) -> Summary {
        let h = self.0.lock();
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
}

#[derive(Default)]
pub struct StageMetrics {
    /// Requests dropped from this stage's queue because their deadline passed.
    pub dropped_late: AtomicU64,
    /// Deadline slack of the most urgent request when a batch is dispatched, µs.
    pub slack_us: Hist,
    pub batches: AtomicU64,
    pub requests: AtomicU64,
    /// Time replicas were busy with batches (node -> worker -> node), µs.
    pub busy_us: AtomicU64,
    pub errors: AtomicU64,
    pub retries: AtomicU64,
    pub restarts: AtomicU64,
    /// Requests per batch.
    pub batch_size: Hist,
    /// Time from enqueue to dispatch, µs.
    pub queue_wait_us: Hist,
    /// Time the component itself ran, per batch, µs (reported by the worker).
    pub compute_us: Hist,
    /// Node -> worker -> node overhead per batch: round trip minus compute, µs.
    pub hop_us: Hist,
}

#[derive(Default)]
pub struct PipelineMetrics {
    pub ok: AtomicU64,
    /// Requests let in by admission control.
    pub admitted: AtomicU64,
    /// Requests refused at ingress (429): predicted to miss their deadline.
    pub shed: AtomicU64,
    /// Answered within the SLO (goodput) / answered late.
    pub slo_met: AtomicU64,
    pub slo_missed: AtomicU64,
    /// Answered with the declared fallback instead of an error.
    pub fallback: AtomicU64,
    /// Admitted, then abandoned by their client before the answer.
    pub cancelled: AtomicU64,
    pub errors: Mutex<BTreeMap<&'static str, u64>>,
    /// End-to-end latency inside the node (body read to response ready), µs.
    pub latency_us: Hist,
}

impl PipelineMetrics {
    pub fn error(&self, kind: &'static str) {
        *self.errors.lock().entry(kind).or_default() += 1;
    }
}

impl StageMetrics {
    pub fn reset(&self) {
        self.slack_us.reset();
        for c in [&self.batches, &self.requests, &self.busy_us, &self.errors, &self.retries, &self.dropped_late] {
            c.store(0, Relaxed);
        }
        for h in [&self.batch_size, &self.queue_wait_us, &self.compute_us, &self.hop_us] {
            h.reset();
        }
    }
}

impl PipelineMetrics {
    pub fn reset(&self) {
        for c in
            [&self.ok, &self.admitted, &self.shed, &self.slo_met, &self.slo_missed, &self.fallback, &self.cancelled]
        {
            c.store(0, Relaxed);
        }
        self.errors.lock().clear();
        self.latency_us.reset();
    }
}

/// Prometheus text exposition: a small writer that keeps HELP/TYPE lines
/// once per metric family.
#[derive(Default)]
pub struct PromText {
    out: String,
    declared: std::collections::HashSet<String>,
}

impl PromText {
    fn declare(&mut self, name: &str, kind: &str, help: &str) {
        if self.declared.insert(name.to_string()) {
            let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        }
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: u64) {
        self.declare(name, "counter", help);
        let _ = writeln!(self.out, "{name}{} {v}", fmt_labels(labels));
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        self.declare(name, "gauge", help);
        let _ = writeln!(self.out, "{name}{} {v}", fmt_labels(labels));
    }

    /// A summary in seconds from a µs histogram.
    pub fn summary(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Hist) {
        self.declare(name, "summary", help);
        let s = h.summary(1e6);
        for (q, v) in [("0.5", s.p50), ("0.9", s.p90), ("0.99", s.p99), ("0.999", s.p999)] {
            let mut l = labels.to_vec();
            l.push(("quantile", q));
            let _ = writeln!(self.out, "{name}{} {v}", fmt_labels(&l));
        }
        let _ = writeln!(self.out, "{name}_sum{} {}", fmt_labels(labels), s.mean * s.count as f64);
        let _ = writeln!(self.out, "{name}_count{} {}", fmt_labels(labels), s.count);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn fmt_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let parts: Vec<String> =
        labels.iter().map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))).collect();
    format!("{{{}}}", parts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_summary_in_ms() {
        let h = Hist::default();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let s = h.summary(1000.0);
        assert_eq!(s.count, 1000);
        assert!((s.p50 - 500.0).abs() < 2.0, "{s:?}");
        assert!((s.p99 - 990.0).abs() < 2.0, "{s:?}");
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
}
