//! Arrival processes: the offered-load schedule, generated lazily from a
//! seeded RNG so a sweep is reproducible and costs O(1) memory however long
//! it runs.
//!
//! A rate that changes over the run ([`RateSchedule`], piecewise constant)
//! is the same process run on a warped clock: arrivals are generated at
//! rate 1 in "operational time" `u` and each is placed at the wall offset
//! `t` where the cumulative rate `Λ(t) = ∫ rate` reaches `u` (time
//! rescaling). Poisson arrivals so become a non-homogeneous Poisson process
//! with exactly that rate; uniform and bursty arrivals keep their shape
//! within each segment.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// How request arrival times are spaced.
///
/// Serialized internally tagged, snake case: `{"kind": "poisson"}`,
/// `{"kind": "uniform"}`, `{"kind": "bursty", "burst": 8}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Arrival {
    /// Exponential inter-arrival gaps (memoryless, the usual open-loop model).
    #[default]
    Poisson,
    /// Evenly spaced arrivals, exactly `1/rate` apart.
    Uniform,
    /// Bursts of `burst` back-to-back arrivals (same instant); bursts arrive
    /// as a Poisson process with mean gap `burst/rate`, keeping the mean rate.
    Bursty {
        /// Arrivals per burst (0 is treated as 1).
        burst: u32,
    },
}

/// A piecewise-constant offered rate: `rates[i]` from `starts[i]` (seconds
/// from the start of the run) until the next start; the first segment starts
/// at 0 and the last lasts forever. Built from validated input (increasing
/// starts, finite rates > 0; see `check_schedule` in the crate root).
#[derive(Clone, Debug)]
pub(crate) struct RateSchedule {
    starts: Vec<f64>,
    rates: Vec<f64>,
    /// `Λ(starts[i])`: arrivals expected before segment `i`.
    cum: Vec<f64>,
}

impl RateSchedule {
    /// `segments`: `(from_s, rate)` in the measured window's time, the first
    /// from 0; `shift`: the warm-up before that window, run at the first rate.
    pub(crate) fn new(segments: &[(f64, f64)], shift: f64) -> Self {
        let starts: Vec<f64> =
            segments.iter().enumerate().map(|(i, &(from, _))| if i == 0 { 0.0 } else { from + shift }).collect();
        let rates: Vec<f64> = segments.iter().map(|&(_, r)| r).collect();
        let mut cum = Vec::with_capacity(starts.len());
        let mut acc = 0.0;
        for i in 0..starts.len() {
            if i > 0 {
                acc += (starts[i] - starts[i - 1]) * rates[i - 1];
            }
            cum.push(acc);
        }
        Self { starts, rates, cum }
    }

    /// The segment holding wall offset `t`.
    fn segment_at(&self, t: f64) -> usize {
        self.starts.partition_point(|&s| s <= t).saturating_sub(1)
    }

    /// The offered rate at wall offset `t`.
    pub(crate) fn rate_at(&self, t: f64) -> f64 {
        self.rates[self.segment_at(t)]
    }

    /// `Λ(t)`: arrivals expected in `[0, t)`.
    pub(crate) fn expected_before(&self, t: f64) -> f64 {
        let i = self.segment_at(t);
        self.cum[i] + (t - self.starts[i]) * self.rates[i]
    }

    /// `Λ⁻¹(u)`: the wall offset where `u` arrivals are expected.
    fn wall_offset(&self, u: f64) -> f64 {
        let i = self.cum.partition_point(|&c| c <= u).saturating_sub(1);
        self.starts[i] + (u - self.cum[i]) / self.rates[i]
    }
}

/// Lazily yields arrival offsets, in seconds from the start of the schedule,
/// in non-decreasing order.
pub(crate) struct ArrivalGen {
    kind: Arrival,
    rate: f64,
    rng: StdRng,
    /// Offset of the last emitted arrival (Poisson/Bursty accumulate gaps).
    t: f64,
    /// Arrivals emitted so far (Uniform multiplies instead of accumulating,
    /// so it never drifts).
    n: u64,
    /// Arrivals left in the current burst.
    burst_left: u32,
    /// A changing rate: `rate` is then 1 and offsets are warped through it.
    schedule: Option<RateSchedule>,
}

impl ArrivalGen {
    /// `rate` must be finite and > 0 (validated by the caller).
    pub(crate) fn new(kind: Arrival, rate: f64, seed: u64) -> Self {
        Self { kind, rate, rng: StdRng::seed_from_u64(seed), t: 0.0, n: 0, burst_left: 0, schedule: None }
    }

    /// Arrivals whose rate follows `schedule` instead of a constant.
    pub(crate) fn scheduled(kind: Arrival, schedule: RateSchedule, seed: u64) -> Self {
        Self { schedule: Some(schedule), ..Self::new(kind, 1.0, seed) }
    }

    /// Exponential variate with the given mean; `1 - U` keeps `ln` finite.
    fn exp(&mut self, mean: f64) -> f64 {
        let u: f64 = self.rng.random();
        -(1.0 - u).ln() * mean
    }

    /// Offset (seconds) of the next arrival.
    pub(crate) fn next_offset(&mut self) -> f64 {
        let u = self.next_at_rate();
        match &self.schedule {
            Some(s) => s.wall_offset(u),
            None => u,
        }
    }

    /// The next offset of the constant-rate process.
    fn next_at_rate(&mut self) -> f64 {
        self.n += 1;
        match self.kind {
            Arrival::Poisson => {
                self.t += self.exp(1.0 / self.rate);
                self.t
            }
            Arrival::Uniform => self.n as f64 / self.rate,
            Arrival::Bursty { burst } => {
                if self.burst_left == 0 {
                    let b = burst.max(1);
                    self.t += self.exp(f64::from(b) / self.rate);
                    self.burst_left = b;
                }
                self.burst_left -= 1;
                self.t
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mean rate over `n` arrivals.
    fn mean_rate(kind: Arrival, rate: f64, n: u64, seed: u64) -> f64 {
        let mut g = ArrivalGen::new(kind, rate, seed);
        let mut last = 0.0;
        let mut prev = 0.0;
        for _ in 0..n {
            last = g.next_offset();
            assert!(last >= prev, "offsets must be non-decreasing");
            prev = last;
        }
        n as f64 / last
    }

    #[test]
    fn poisson_mean_rate_within_two_percent() {
        for seed in [1, 2, 42] {
            let r = mean_rate(Arrival::Poisson, 20_000.0, 200_000, seed);
            assert!((r / 20_000.0 - 1.0).abs() < 0.02, "seed {seed}: rate {r}");
        }
    }

    #[test]
    fn poisson_gaps_are_exponential() {
        // Coefficient of variation of exponential gaps is 1.
        let mut g = ArrivalGen::new(Arrival::Poisson, 1000.0, 7);
        let mut prev = 0.0;
        let (mut s, mut s2) = (0.0, 0.0);
        let n = 100_000;
        for _ in 0..n {
            let t = g.next_offset();
            let d = t - prev;
            prev = t;
            s += d;
            s2 += d * d;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        let cv = var.sqrt() / mean;
        assert!((cv - 1.0).abs() < 0.03, "cv {cv}");
    }

    #[test]
    fn uniform_is_exact() {
        let mut g = ArrivalGen::new(Arrival::Uniform, 400.0, 0);
        for i in 1..=1000u32 {
            let t = g.next_offset();
            assert!((t - f64::from(i) / 400.0).abs() < 1e-12);
        }
    }

    #[test]
    fn bursty_keeps_mean_rate_and_bursts() {
        let r = mean_rate(Arrival::Bursty { burst: 10 }, 5_000.0, 500_000, 3);
        assert!((r / 5_000.0 - 1.0).abs() < 0.03, "rate {r}");
        let mut g = ArrivalGen::new(Arrival::Bursty { burst: 4 }, 100.0, 9);
        for _ in 0..50 {
            let first = g.next_offset();
            for _ in 1..4 {
                assert_eq!(g.next_offset(), first, "a burst shares one instant");
            }
        }
        // burst 0 behaves like Poisson (burst of 1).
        let r0 = mean_rate(Arrival::Bursty { burst: 0 }, 1_000.0, 100_000, 5);
        assert!((r0 / 1_000.0 - 1.0).abs() < 0.03, "rate {r0}");
    }

    /// Arrivals of `g` counted per window `[edges[i], edges[i + 1])`.
    fn counts(g: &mut ArrivalGen, edges: &[f64]) -> Vec<u64> {
        let mut out = vec![0; edges.len() - 1];
        let mut prev = 0.0;
        loop {
            let t = g.next_offset();
            assert!(t >= prev, "offsets must be non-decreasing");
            prev = t;
            if t >= edges[edges.len() - 1] {
                return out;
            }
            if let Some(i) = (0..out.len()).find(|&i| edges[i] <= t && t < edges[i + 1]) {
                out[i] += 1;
            }
        }
    }

    #[test]
    fn scheduled_poisson_counts_per_segment() {
        // 40% -> 150% -> 40% of a 250/s replica, the surge benchmark's shape,
        // after a 2 s warm-up at the first rate.
        let segs = [(0.0, 100.0), (5.0, 375.0), (15.0, 100.0)];
        for seed in [1, 2, 3, 42] {
            let mut g = ArrivalGen::scheduled(Arrival::Poisson, RateSchedule::new(&segs, 2.0), seed);
            let got = counts(&mut g, &[0.0, 2.0, 7.0, 17.0, 27.0]);
            for (n, want) in got.into_iter().zip([200.0, 500.0, 3750.0, 1000.0]) {
                // A Poisson count: mean = variance = want; 4.5 sigma.
                assert!((n as f64 - want).abs() <= 4.5 * f64::sqrt(want), "seed {seed}: {n} vs {want}");
            }
        }
    }

    #[test]
    fn scheduled_poisson_gaps_are_exponential_within_a_segment() {
        let segs = [(0.0, 50.0), (10.0, 2000.0)];
        let mut g = ArrivalGen::scheduled(Arrival::Poisson, RateSchedule::new(&segs, 0.0), 5);
        let mut prev = 0.0;
        let mut gaps = Vec::new();
        loop {
            let t = g.next_offset();
            if t >= 60.0 {
                break;
            }
            if prev >= 10.0 {
                gaps.push(t - prev);
            }
            prev = t;
        }
        let n = gaps.len() as f64;
        let mean = gaps.iter().sum::<f64>() / n;
        let cv = (gaps.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / n).sqrt() / mean;
        assert!((mean * 2000.0 - 1.0).abs() < 0.02, "mean gap {mean}");
        assert!((cv - 1.0).abs() < 0.03, "cv {cv}");
    }

    #[test]
    fn scheduled_uniform_is_even_per_segment() {
        let s = RateSchedule::new(&[(0.0, 10.0), (1.0, 100.0)], 0.0);
        assert_eq!((s.rate_at(0.5), s.rate_at(1.0), s.rate_at(1e6)), (10.0, 100.0, 100.0));
        assert!((s.expected_before(1.5) - 60.0).abs() < 1e-9);
        let mut g = ArrivalGen::scheduled(Arrival::Uniform, s, 0);
        let got: Vec<f64> = (0..12).map(|_| g.next_offset()).collect();
        let want = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.01, 1.02];
        for (t, w) in got.iter().zip(want) {
            assert!((t - w).abs() < 1e-9, "{got:?}");
        }
    }

    #[test]
    fn one_segment_schedule_is_the_constant_rate() {
        let mut a = ArrivalGen::new(Arrival::Poisson, 300.0, 11);
        let mut b = ArrivalGen::scheduled(Arrival::Poisson, RateSchedule::new(&[(0.0, 300.0)], 1.0), 11);
        for _ in 0..1000 {
            let (x, y) = (a.next_offset(), b.next_offset());
            assert!((x - y).abs() < 1e-9 * x.max(1.0), "{x} vs {y}");
        }
    }

    #[test]
    fn same_seed_same_schedule() {
        let mut a = ArrivalGen::new(Arrival::Poisson, 100.0, 11);
        let mut b = ArrivalGen::new(Arrival::Poisson, 100.0, 11);
        let mut c = ArrivalGen::new(Arrival::Poisson, 100.0, 12);
        let va: Vec<f64> = (0..100).map(|_| a.next_offset()).collect();
        let vb: Vec<f64> = (0..100).map(|_| b.next_offset()).collect();
        let vc: Vec<f64> = (0..100).map(|_| c.next_offset()).collect();
        assert_eq!(va, vb);
        assert_ne!(va, vc);
    }
}
