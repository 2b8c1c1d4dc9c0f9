//! A sub-millisecond async sleep for the pacer.
//!
//! tokio's timer wheel rounds deadlines up to whole milliseconds, which would
//! make every send up to 1 ms late (and that lateness is charged to latency).
//! On Linux a `timerfd` registered with tokio's reactor wakes the runtime
//! thread itself within the kernel's timer slack (~50 µs), with no helper
//! thread and no cross-thread wake-up. Elsewhere, or if the timerfd cannot be
//! created, it falls back to `tokio::time::sleep_until`.

use std::time::Instant;

pub(crate) struct PreciseTimer {
    #[cfg(target_os = "linux")]
    fd: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
}

impl PreciseTimer {
    /// Must be called inside a tokio runtime with I/O enabled.
    pub(crate) fn new() -> Self {
        #[cfg(target_os = "linux")]
        {
            use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
            let fd = timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC)
                .ok()
                .and_then(|fd| register(fd).ok());
            Self { fd }
        }
        #[cfg(not(target_os = "linux"))]
        Self {}
    }

    /// Whether sleeps are sub-millisecond precise (timerfd in use).
    #[cfg(test)]
    pub(crate) fn is_precise(&self) -> bool {
        #[cfg(target_os = "linux")]
        return self.fd.is_some();
        #[cfg(not(target_os = "linux"))]
        false
    }

    /// Sleeps until `deadline` (returns at once if it has passed).
    pub(crate) async fn sleep_until(&mut self, deadline: Instant) {
        let now = Instant::now();
        if deadline <= now {
            return;
        }
        #[cfg(target_os = "linux")]
        if let Some(fd) = &self.fd {
            if timerfd_sleep(fd, deadline - now).await.is_ok() {
                return;
            }
            // Fall through on any timerfd failure: coarse but correct.
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// Registers the timerfd with the reactor. `AsyncFd::new` is deprecated in
/// favour of the `unsafe fn register` because a generic `T: AsRawFd` could
/// close or swap its descriptor while registered; an `OwnedFd` moved into the
/// `AsyncFd` can do neither (nothing else can reach it), so the safe
/// constructor is sound here and keeps this crate free of `unsafe`.
#[cfg(target_os = "linux")]
#[allow(deprecated)]
fn register(fd: std::os::fd::OwnedFd) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    tokio::io::unix::AsyncFd::new(fd)
}

#[cfg(target_os = "linux")]
async fn timerfd_sleep(
    fd: &tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
    after: std::time::Duration,
) -> std::io::Result<()> {
    use rustix::time::{timerfd_settime, Itimerspec, TimerfdTimerFlags, Timespec};
    // A zero it_value disarms the timer, so never ask for less than 1 µs.
    let after = after.max(std::time::Duration::from_micros(1));
    let spec = Itimerspec {
        it_interval: Timespec { tv_sec: 0, tv_nsec: 0 },
        it_value: Timespec {
            tv_sec: i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: after.subsec_nanos().into(),
        },
    };
    timerfd_settime(fd.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
    loop {
        let mut guard = fd.readable().await?;
        let mut expirations = [0u8; 8];
        match guard.try_io(|inner| Ok(rustix::io::read(inner.get_ref(), &mut expirations)?)) {
            Ok(res) => {
                // The one-shot timer is drained; forget the readiness now so
                // the next sleep does not wake at once, read, and get EAGAIN.
                guard.clear_ready();
                return res.map(drop);
            }
            Err(_would_block) => continue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn sleeps_are_precise_and_never_early() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let mut t = PreciseTimer::new();
            let mut late = Vec::new();
            for _ in 0..50 {
                let deadline = Instant::now() + Duration::from_micros(300);
                t.sleep_until(deadline).await;
                let now = Instant::now();
                assert!(now >= deadline, "woke early");
                late.push(now - deadline);
            }
            // Past deadlines return immediately.
            t.sleep_until(Instant::now() - Duration::from_millis(1)).await;
            late.sort();
            let median = late[late.len() / 2];
            eprintln!("precise={} median lateness {median:?} max {:?}", t.is_precise(), late[late.len() - 1]);
            if t.is_precise() {
                // Generous: shared CI machines; tokio's wheel would be ~700 µs.
                assert!(median < Duration::from_micros(500), "median lateness {median:?}");
            }
        });
    }
}
