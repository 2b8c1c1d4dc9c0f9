//! A component's latency as a function of batch size.
//!
//! Starts from the points `slipstream profile` measured (or from nothing) and
//! is refined online from real batches: each batch size keeps an
//! exponentially weighted mean and mean absolute deviation of what was
//! observed, and predictions interpolate linearly between known sizes
//! (extrapolating from the last two beyond the largest). A prediction is
//! `mean + k * deviation`, so a noisy component is given a safety margin.

use std::collections::BTreeMap;

/// Weight of a new observation in the running estimates.
const ALPHA: f64 = 0.1;

#[derive(Clone, Copy, Debug, PartialEq)]
struct Point {
    mean_us: f64,
    dev_us: f64,
    /// Batches that shaped this point (measured points count as many).
    seen: u32,
}

/// Observations a batch size needs before its own estimate is trusted over
/// its neighbours' (one stall at a rarely seen size must not stick).
const TRUSTED: u32 = 5;

#[derive(Clone, Debug)]
pub struct LatencyProfile {
    points: BTreeMap<u32, Point>,
    /// The points seen at least `TRUSTED` times (kept alongside, so that a
    /// prediction, asked for many times per batch, allocates nothing).
    trusted: BTreeMap<u32, Point>,
    /// Deviations added to the mean in a prediction.
    pub k: f64,
    /// Used while nothing at all is known: a fixed cost per batch.
    pub default_us: f64,
}

impl Default for LatencyProfile {
    fn default() -> Self {
        LatencyProfile { points: BTreeMap::new(), trusted: BTreeMap::new(), k: 1.0, default_us: 1000.0 }
    }
}

impl LatencyProfile {
    /// From measured `(batch size, mean µs, p99 µs)` points.
    pub fn from_measurements(points: &[(u32, f64, f64)]) -> LatencyProfile {
        let mut p = LatencyProfile::default();
        for &(b, mean, p99) in points {
            if b > 0 && mean.is_finite() && mean >= 0.0 {
                // Treat the p99 excess as ~2.3 deviations of a normal tail.
                let dev = ((p99 - mean) / 2.3).max(0.0);
                p.insert(b, Point { mean_us: mean, dev_us: dev, seen: 1000 });
            }
        }
        p
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The largest batch size measured or observed (0 if none).
    pub fn largest_known(&self) -> u32 {
        self.points.keys().next_back().copied().unwrap_or(0)
    }

    /// Fold in one observed batch.
    pub fn observe(&mut self, batch: u32, observed_us: f64) {
        if batch == 0 || !observed_us.is_finite() {
            return;
        }
        let prior = self.points.get(&batch).copied();
        let p = match prior {
            Some(p) => {
                // A single outlier (a stall, a page-fault storm) moves the
                // estimate by a bounded step.
                let err = (observed_us - p.mean_us).clamp(-p.mean_us, 3.0 * p.mean_us.max(100.0));
                Point {
                    mean_us: p.mean_us + ALPHA * err,
                    dev_us: p.dev_us + ALPHA * (err.abs() - p.dev_us),
                    seen: p.seen.saturating_add(1),
                }
            }
            None => {
                // First sight of this size: start from the interpolated prediction.
                let guess = if self.points.is_empty() { observed_us } else { self.mean(batch) };
                let err = observed_us - guess;
                Point { mean_us: guess + 0.5 * err, dev_us: err.abs() * 0.5, seen: 1 }
            }
        };
        self.insert(batch, p);
    }

    fn insert(&mut self, batch: u32, p: Point) {
        if p.seen >= TRUSTED {
            self.trusted.insert(batch, p);
        }
        self.points.insert(batch, p);
    }

    /// Expected latency of a batch of `batch` (mean only).
    pub fn mean(&self, batch: u32) -> f64 {
        self.interpolate(batch, |p| p.mean_us)
    }

    /// Latency to plan with for a batch of `batch`: mean + k * deviation.
    pub fn predict(&self, batch: u32) -> f64 {
        self.interpolate(batch, |p| p.mean_us + self.k * p.dev_us)
    }

    fn interpolate(&self, batch: u32, f: impl Fn(&Point) -> f64) -> f64 {
        let b = batch.max(1);
        if self.points.is_empty() {
            return self.default_us;
        }
        // Sizes seen only a few times are ignored while better-known ones exist.
        let pts = if self.trusted.is_empty() { &self.points } else { &self.trusted };
        if let Some(p) = pts.get(&b) {
            return f(p);
        }
        let below = pts.range(..b).next_back();
        let above = pts.range(b..).next();
        let line = |(b0, y0): (u32, f64), (b1, y1): (u32, f64)| {
            if b1 == b0 {
                y0
            } else {
                y0 + (y1 - y0) * (b as f64 - b0 as f64) / (b1 as f64 - b0 as f64)
            }
        };
        let v = match (below, above) {
            (Some((&b0, p0)), Some((&b1, p1))) => line((b0, f(p0)), (b1, f(p1))),
            // Below the smallest known size: no cheaper than it, scaled down at most linearly.
            (None, Some((&b1, p1))) => f(p1) * (0.5 + 0.5 * b as f64 / b1 as f64),
            // Beyond the largest: extend the last segment (or grow linearly per item).
            (Some((&b1, p1)), None) => match pts.range(..b1).next_back() {
                Some((&b0, p0)) => line((b0, f(p0)), (b1, f(p1))).max(f(p1)),
                None => f(p1) * b as f64 / b1 as f64,
            },
            (None, None) => self.default_us,
        };
        v.max(0.0)
    }

    /// The measured/learned points: `(batch, mean µs, deviation µs)`.
    pub fn points(&self) -> Vec<(u32, f64, f64)> {
        self.points.iter().map(|(&b, p)| (b, p.mean_us, p.dev_us)).collect()
    }
}

#[cfg(test)]
mod robustness_tests {
    use super::*;

    #[test]
    fn one_stall_at_a_rare_size_does_not_stick() {
        let mut p = LatencyProfile::from_measurements(&[(1, 100.0, 100.0), (64, 6400.0, 6400.0)]);
        p.observe(16, 60_000.0); // a 60 ms stall, the only batch of 16 ever seen
        assert!(p.mean(16) < 2000.0, "interpolated from trusted points: {}", p.mean(16));
        // A known size moves by a bounded step.
        p.observe(64, 600_000.0);
        assert!(p.mean(64) < 6400.0 * 1.4, "{}", p.mean(64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_and_extrapolates() {
        let p = LatencyProfile::from_measurements(&[(1, 100.0, 100.0), (8, 400.0, 400.0), (32, 1000.0, 1000.0)]);
        assert_eq!(p.predict(1), 100.0);
        assert!((p.predict(4) - (100.0 + 300.0 * 3.0 / 7.0)).abs() < 1e-9);
        assert_eq!(p.predict(20), 700.0);
        assert_eq!(p.predict(64), 1800.0, "extends the last segment");
    }

    #[test]
    fn online_observations_move_the_estimate_and_add_margin() {
        let mut p = LatencyProfile::from_measurements(&[(4, 200.0, 200.0)]);
        for _ in 0..200 {
            p.observe(4, 300.0);
        }
        assert!((p.mean(4) - 300.0).abs() < 1.0);
        let mut noisy = LatencyProfile::default();
        for i in 0..400 {
            noisy.observe(2, if i % 2 == 0 { 100.0 } else { 300.0 });
        }
        assert!(noisy.predict(2) > noisy.mean(2) + 100.0, "deviation widens the plan");
    }

    #[test]
    fn empty_profile_uses_default() {
        let p = LatencyProfile::default();
        assert_eq!(p.predict(8), p.default_us);
    }
}
