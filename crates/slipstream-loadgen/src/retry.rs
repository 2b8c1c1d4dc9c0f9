//! What a generated client does with a refusal (429) or an unavailable
//! server (503): give up (`none`, the default: every arrival is sent once),
//! send it again at once (`now`: the clients that turn overload into a
//! retry storm), or wait as the server asks (`honor`: the policy of the
//! project's own client, `slipstream._internal.retry`: no shorter than the
//! server's `x-slipstream-retry-after-ms` / `Retry-After`, full-jitter
//! exponential backoff, and a retry budget: a token bucket that earns
//! `budget_ratio` of a token per first attempt, so retries stay a small
//! share of the requests however long the overload lasts, as in gRPC's
//! retry throttling). Either way a retry is sent only while the arrival's
//! timeout has not run out, and at most `attempts` sends in all.

use std::sync::Mutex;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// How an arrival that was refused is retried.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RetryMode {
    /// Never.
    #[default]
    None,
    /// At once, on the same connection.
    Now,
    /// After the server's wait or a jittered backoff, within a budget.
    Honor,
}

/// The retry policy of a run (see the module docs).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default)]
pub struct RetryConfig {
    pub mode: RetryMode,
    /// Most sends of one arrival, the first included.
    pub attempts: u32,
    /// First backoff ceiling, ms (doubles per retry, up to `max_ms`).
    pub base_ms: f64,
    pub max_ms: f64,
    /// Tokens earned per first attempt (`honor` only), and the most kept.
    pub budget_ratio: f64,
    pub budget_burst: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        // The project client's defaults.
        RetryConfig {
            mode: RetryMode::None,
            attempts: 3,
            base_ms: 5.0,
            max_ms: 1000.0,
            budget_ratio: 0.1,
            budget_burst: 10.0,
        }
    }
}

impl RetryConfig {
    pub(crate) fn check(&self) -> Result<(), String> {
        let finite = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("retry.{name} must be finite and >= 0, got {v}"))
            }
        };
        finite("base_ms", self.base_ms)?;
        finite("max_ms", self.max_ms)?;
        finite("budget_ratio", self.budget_ratio)?;
        finite("budget_burst", self.budget_burst)?;
        if self.attempts == 0 {
            return Err("retry.attempts must be >= 1".into());
        }
        Ok(())
    }
}

/// A run's retry state: the policy, the budget's tokens, the jitter's
/// random stream.
pub(crate) struct Retrier {
    cfg: RetryConfig,
    tokens: Mutex<f64>,
    rng: Mutex<StdRng>,
}

impl Retrier {
    pub(crate) fn new(cfg: RetryConfig, seed: u64) -> Retrier {
        let tokens = Mutex::new(cfg.budget_burst);
        Retrier { cfg, tokens, rng: Mutex::new(StdRng::seed_from_u64(seed)) }
    }

    /// A first attempt was sent: it earns the budget its share.
    pub(crate) fn on_first_attempt(&self) {
        if self.cfg.mode == RetryMode::Honor {
            let mut t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
            *t = (*t + self.cfg.budget_ratio).min(self.cfg.budget_burst);
        }
    }

    /// Whether send number `attempt` (0: the first) of an arrival that got
    /// a retryable `status`, with `left` before its timeout and the
    /// server's `retry_after_ms`, is sent again, and after how long.
    pub(crate) fn next(
        &self,
        status: u16,
        attempt: u32,
        left: Duration,
        retry_after_ms: Option<u64>,
    ) -> Option<Duration> {
        if !matches!(status, 429 | 503) || attempt + 1 >= self.cfg.attempts {
            return None;
        }
        let wait = match self.cfg.mode {
            RetryMode::None => return None,
            RetryMode::Now => Duration::ZERO,
            RetryMode::Honor => {
                let ceiling = (self.cfg.base_ms * 2f64.powi(attempt.min(30) as i32)).min(self.cfg.max_ms);
                let unit: f64 = self.rng.lock().unwrap_or_else(|e| e.into_inner()).random();
                let backoff = Duration::from_secs_f64(ceiling * unit / 1e3);
                backoff.max(Duration::from_millis(retry_after_ms.unwrap_or(0)))
            }
        };
        if wait >= left {
            return None;
        }
        if self.cfg.mode == RetryMode::Honor {
            let mut t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
            if *t < 1.0 {
                return None;
            }
            *t -= 1.0;
        }
        Some(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    fn retrier(mode: RetryMode) -> Retrier {
        Retrier::new(RetryConfig { mode, ..RetryConfig::default() }, 7)
    }

    #[test]
    fn none_never_retries_and_now_retries_at_once() {
        assert_eq!(retrier(RetryMode::None).next(429, 0, LONG, None), None);
        let now = retrier(RetryMode::Now);
        assert_eq!(now.next(429, 0, LONG, Some(500)), Some(Duration::ZERO));
        assert_eq!(now.next(500, 0, LONG, None), None, "only 429 and 503 are retried");
        assert_eq!(now.next(429, 2, LONG, None), None, "three sends at most");
    }

    #[test]
    fn honor_waits_at_least_what_the_server_asks_and_never_past_the_timeout() {
        let r = retrier(RetryMode::Honor);
        let w = r.next(429, 0, LONG, Some(40)).expect("retried");
        assert!(w >= Duration::from_millis(40));
        assert!(
            r.next(429, 1, LONG, None).expect("retried") <= Duration::from_millis(10),
            "full jitter under 2 x 5 ms"
        );
        assert_eq!(r.next(429, 0, Duration::from_millis(30), Some(40)), None, "would land past the timeout");
    }

    #[test]
    fn the_budget_keeps_retries_near_a_tenth_of_first_attempts() {
        let r = retrier(RetryMode::Honor);
        let mut retries = 0;
        for _ in 0..1000 {
            r.on_first_attempt();
            retries += u32::from(r.next(429, 0, LONG, None).is_some());
        }
        // The burst of 10, then one per ten first attempts.
        assert!((100..=111).contains(&retries), "{retries}");
    }
}
