//! Arrival processes: the offered-load schedule, generated lazily from a
//! seeded RNG so a sweep is reproducible and costs O(1) memory however long
//! it runs.

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
}

impl ArrivalGen {
    /// `rate` must be finite and > 0 (validated by the caller).
    pub(crate) fn new(kind: Arrival, rate: f64, seed: u64) -> Self {
        Self { kind, rate, rng: StdRng::seed_from_u64(seed), t: 0.0, n: 0, burst_left: 0 }
    }

    /// Exponential variate with the given mean; `1 - U` keeps `ln` finite.
    fn exp(&mut self, mean: f64) -> f64 {
        let u: f64 = self.rng.random();
        -(1.0 - u).ln() * mean
    }

    /// Offset (seconds) of the next arrival.
    pub(crate) fn next_offset(&mut self) -> f64 {
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
