//! The open-loop engine for one offered rate: a pacer task that releases
//! arrivals on schedule, a shared job queue, and a self-growing pool of
//! keep-alive connection tasks that drain it. See the crate docs for why it
//! is shaped this way.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::arrival::{ArrivalGen, RateSchedule};
use crate::h1::{Conn, Reply};
use crate::retry::Retrier;
use crate::stats::{ErrKind, Percentiles, WindowStats};
use crate::target::Target;
use crate::timer::PreciseTimer;
use crate::{LoadgenError, RunReport};

/// A send that starts more than this after its scheduled time is "late".
const LATE: Duration = Duration::from_millis(1);
/// Lead time between building the schedule and its first arrival.
const START_DELAY: Duration = Duration::from_millis(20);

/// One scheduled arrival. The latency clock runs from `at`.
#[derive(Clone, Copy, Debug)]
struct Job {
    at: Instant,
    /// Scheduled inside the measured window (after warmup).
    measured: bool,
    /// Sends before this one (retries of a refused arrival).
    attempt: u32,
    /// The arrival's number in its run (picks its body from a mix).
    seq: u64,
}

/// Outcome of one request, as recorded.
type Outcome = Result<(), ErrKind>;

/// State shared by the pacer task, the connection tasks and the control
/// loop of one rate run.
struct Shared {
    target: Arc<Target>,
    handle: tokio::runtime::Handle,
    max_conns: usize,
    timeout: Duration,
    /// Released arrivals not yet picked up by a connection.
    queue: Mutex<VecDeque<Job>>,
    /// Wakes idle connection tasks when jobs are queued (or on close).
    notify: Notify,
    /// Connection tasks parked waiting for a job.
    idle: AtomicUsize,
    /// Connection tasks still connecting (will soon want a job).
    connecting: AtomicUsize,
    /// Live connection tasks (connecting + open); capped by `max_conns`.
    conns: AtomicUsize,
    /// Open (connected) connections, and their peak.
    open: AtomicUsize,
    peak_open: AtomicUsize,
    closed: AtomicBool,
    pacer_done: AtomicBool,
    /// Measured arrivals released so far.
    sent: AtomicU64,
    /// Start of the measured window (timeline offsets count from here).
    warm_end: Instant,
    stats: Mutex<WindowStats>,
    retrier: Retrier,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not turn into a second panic here.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Decrements a counter when dropped (keeps counts right under cancellation).
struct CountGuard<'a>(&'a AtomicUsize);

impl<'a> CountGuard<'a> {
    fn enter(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::SeqCst);
        Self(c)
    }
}

impl Drop for CountGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    fn pop(&self) -> Option<Job> {
        lock(&self.queue).pop_front()
    }

    /// Queues a batch of released arrivals, wakes idle connections, and grows
    /// the pool if the backlog exceeds what idle/connecting tasks will absorb.
    fn dispatch(self: &Arc<Self>, batch: &mut Vec<Job>, measured: u64) {
        let n = batch.len();
        lock(&self.queue).extend(batch.drain(..));
        self.sent.fetch_add(measured, Ordering::Relaxed);
        for _ in 0..n {
            self.notify.notify_one();
        }
        self.grow();
    }

    /// Spawns connection tasks while the backlog exceeds the tasks that are
    /// idle or connecting, up to `max_conns`.
    fn grow(self: &Arc<Self>) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let backlog = lock(&self.queue).len();
        loop {
            let available = self.idle.load(Ordering::SeqCst) + self.connecting.load(Ordering::SeqCst);
            if backlog <= available {
                return;
            }
            let c = self.conns.load(Ordering::SeqCst);
            if c >= self.max_conns {
                return;
            }
            if self.conns.compare_exchange(c, c + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                self.connecting.fetch_add(1, Ordering::SeqCst);
                self.handle.spawn(connection_task(Arc::clone(self)));
            }
        }
    }

    /// Waits for the next job; `None` once the run is closed.
    async fn next_job(&self) -> Option<Job> {
        loop {
            if let Some(job) = self.pop() {
                return Some(job);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // `enable()` before re-checking: a job queued after the re-check
            // notifies this `Notified`, so no wake-up is lost. Counting as
            // idle first keeps `grow()` from opening a connection for a job
            // we are about to take.
            let _idle = CountGuard::enter(&self.idle);
            if let Some(job) = self.pop() {
                return Some(job);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            notified.await;
        }
    }

    /// Record a job's outcome. `sent_at`: when its request was written (for
    /// a job never sent, when it was given up).
    fn finish(&self, job: &Job, late: bool, outcome: Outcome, sent_at: Instant, done_at: Instant) {
        if !job.measured {
            return;
        }
        let mut s = lock(&self.stats);
        s.late_sends += u64::from(late);
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let us = micros(done_at.saturating_duration_since(job.at));
        if s.timeline.is_some() {
            let offset = micros(job.at.saturating_duration_since(self.warm_end));
            s.record_in_timeline(offset, us, micros(done_at.saturating_duration_since(sent_at)), outcome);
        }
        match outcome {
            Ok(()) => s.record_ok(us),
            Err(kind) => s.record_err(kind),
        }
    }

    /// Send `job` again after `wait` if the retry policy says so (its
    /// outcome is then recorded when the last send ends); false: record it.
    fn retry(self: &Arc<Self>, job: &Job, reply: &Reply, now: Instant) -> bool {
        let left = (job.at + self.timeout).saturating_duration_since(now);
        let Some(wait) = self.retrier.next(reply.status, job.attempt, left, reply.retry_after_ms) else {
            return false;
        };
        if job.measured {
            lock(&self.stats).retries += 1;
        }
        let again = Job { attempt: job.attempt + 1, ..*job };
        let sh = Arc::clone(self);
        let requeue = move || {
            lock(&sh.queue).push_back(again);
            sh.notify.notify_one();
            sh.grow();
        };
        if wait.is_zero() {
            requeue();
        } else {
            self.handle.spawn(async move {
                tokio::time::sleep(wait).await;
                requeue();
            });
        }
        true
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

/// Lives as long as one keep-alive connection: connect, then loop taking
/// jobs from the queue until the connection fails, times out, is closed by
/// the server, or the run ends.
async fn connection_task(sh: Arc<Shared>) {
    serve_connection(&sh).await;
    sh.conns.fetch_sub(1, Ordering::SeqCst);
    sh.grow();
}

async fn serve_connection(sh: &Arc<Shared>) {
    let connected = tokio::time::timeout(sh.timeout, TcpStream::connect(sh.target.addr)).await;
    sh.connecting.fetch_sub(1, Ordering::SeqCst);
    let Ok(Ok(stream)) = connected else {
        // Charge the failure to one waiting arrival so a dead server shows
        // up as errors (bounded by the arrival rate, never a spin).
        if let Some(job) = sh.pop() {
            let now = Instant::now();
            sh.finish(&job, false, Err(ErrKind::Connect), now, now);
        }
        return;
    };
    let mut conn = Conn::new(stream);
    let _open = CountGuard::enter(&sh.open);
    sh.peak_open.fetch_max(sh.open.load(Ordering::SeqCst), Ordering::SeqCst);

    loop {
        // Idle: wait for a job, noticing a server-side close meanwhile.
        let job = tokio::select! {
            biased;
            () = conn.closed_while_idle() => return,
            job = sh.next_job() => match job {
                Some(job) => job,
                None => return,
            },
        };
        let now = Instant::now();
        // A retry is sent when its wait ends, not on the schedule.
        let late = job.attempt == 0 && now.saturating_duration_since(job.at) > LATE;
        let deadline = job.at + sh.timeout;
        if now >= deadline {
            // Waited in the queue past its timeout: never sent.
            sh.finish(&job, late, Err(ErrKind::Timeout), now, now);
            continue;
        }
        if job.attempt == 0 {
            sh.retrier.on_first_attempt();
        }
        let res =
            tokio::time::timeout_at(deadline.into(), conn.exchange(sh.target.request(job.seq), sh.target.head_request))
                .await;
        let done_at = Instant::now();
        let (outcome, keep) = match res {
            Ok(Ok(reply)) if (200..300).contains(&reply.status) => (Ok(()), reply.keep_alive),
            Ok(Ok(reply)) if sh.retry(&job, &reply, done_at) => {
                if !reply.keep_alive {
                    return;
                }
                continue;
            }
            Ok(Ok(reply)) => (Err(ErrKind::Status(reply.status)), reply.keep_alive),
            Ok(Err(_)) => (Err(ErrKind::Io), false),
            // A timed-out HTTP/1.1 connection still owes a response: drop it
            // rather than read a stale response later.
            Err(_elapsed) => (Err(ErrKind::Timeout), false),
        };
        sh.finish(&job, late, outcome, now, done_at);
        if !keep {
            return;
        }
    }
}

/// Releases arrivals on schedule. Runs as a task on the generator's own
/// runtime, sleeping on a [`PreciseTimer`] (timerfd) until the next arrival;
/// on each wake it releases *every* arrival already due as one batch, so the
/// wake count is bounded by the timer granularity, not the request rate.
async fn pace(sh: Arc<Shared>, mut gen: ArrivalGen, start: Instant, warm_end: Instant, end: Instant) {
    let mut timer = PreciseTimer::new();
    let at = |off: f64| start + Duration::from_secs_f64(off);
    let mut next = at(gen.next_offset());
    let mut batch: Vec<Job> = Vec::with_capacity(256);
    let mut seq = 0u64;
    while next < end && !sh.closed.load(Ordering::Acquire) {
        let now = Instant::now();
        if next > now {
            timer.sleep_until(next).await;
            continue;
        }
        let mut measured = 0;
        while next <= now && next < end {
            let m = next >= warm_end;
            measured += u64::from(m);
            batch.push(Job { at: next, measured: m, attempt: 0, seq });
            seq += 1;
            next = at(gen.next_offset());
        }
        sh.dispatch(&mut batch, measured);
    }
    sh.pacer_done.store(true, Ordering::Release);
}

/// Parameters of one rate run, already validated.
pub(crate) struct RateRun<'a> {
    pub(crate) target: &'a Arc<Target>,
    pub(crate) arrival: crate::Arrival,
    pub(crate) rate: f64,
    /// A changing rate for this run (then `rate` is its mean).
    pub(crate) schedule: Option<RateSchedule>,
    pub(crate) seed: u64,
    pub(crate) duration: Duration,
    pub(crate) warmup: Duration,
    pub(crate) timeout: Duration,
    pub(crate) max_conns: usize,
    pub(crate) threads: usize,
    /// Count OK responses slower than this (µs), if set.
    pub(crate) slo_us: Option<u64>,
    /// Timeline bucket width (µs), if a timeline is asked for.
    pub(crate) timeline_us: Option<u64>,
    /// Keep every OK latency in the timeline's buckets.
    pub(crate) timeline_latencies: bool,
    /// What a refused arrival does.
    pub(crate) retry: crate::RetryConfig,
}

pub(crate) fn build_runtime(threads: usize) -> Result<tokio::runtime::Runtime, LoadgenError> {
    let rt = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("slipstream-loadgen")
            .enable_all()
            .build()
    };
    rt.map_err(|e| LoadgenError::Runtime(format!("cannot build tokio runtime: {e}")))
}

/// Runs one offered rate: warmup, measured window, drain. Blocks.
pub(crate) fn run_rate(p: &RateRun<'_>, progress: &mut dyn FnMut(&str)) -> Result<RunReport, LoadgenError> {
    let rt = build_runtime(p.threads)?;
    let start = Instant::now() + START_DELAY;
    let warm_end = start + p.warmup;
    let end = warm_end + p.duration;
    let sh = Arc::new(Shared {
        target: Arc::clone(p.target),
        handle: rt.handle().clone(),
        max_conns: p.max_conns,
        timeout: p.timeout,
        queue: Mutex::new(VecDeque::with_capacity(1024)),
        notify: Notify::new(),
        idle: AtomicUsize::new(0),
        connecting: AtomicUsize::new(0),
        conns: AtomicUsize::new(0),
        open: AtomicUsize::new(0),
        peak_open: AtomicUsize::new(0),
        closed: AtomicBool::new(false),
        pacer_done: AtomicBool::new(false),
        sent: AtomicU64::new(0),
        warm_end,
        stats: Mutex::new(WindowStats::new().with_timeline(p.timeline_us)),
        retrier: Retrier::new(p.retry.clone(), p.seed),
    });
    let gen = match &p.schedule {
        Some(s) => ArrivalGen::scheduled(p.arrival, s.clone(), p.seed),
        None => ArrivalGen::new(p.arrival, p.rate, p.seed),
    };
    let rate_at = |t: f64| p.schedule.as_ref().map_or(p.rate, |s| s.rate_at(t));

    rt.spawn(pace(Arc::clone(&sh), gen, start, warm_end, end));
    rt.block_on(control(&sh, &rate_at, start, warm_end, end, progress));
    sh.close();
    let report = make_report(&sh, p);
    // Drop whatever is still in flight (timed-out exchanges, idle sockets).
    rt.shutdown_timeout(Duration::from_millis(200));
    Ok(report)
}

/// Progress lines once a second while the schedule runs, then the drain:
/// wait for every measured request to finish, at most `timeout` past the
/// window (each request's own deadline is scheduled time + timeout).
async fn control(
    sh: &Arc<Shared>,
    rate_at: &dyn Fn(f64) -> f64,
    start: Instant,
    warm_end: Instant,
    end: Instant,
    progress: &mut dyn FnMut(&str),
) {
    let mut next_line = start + Duration::from_secs(1);
    while !sh.pacer_done.load(Ordering::Acquire) {
        let now = Instant::now();
        if now >= next_line {
            let rate = rate_at(now.saturating_duration_since(start).as_secs_f64());
            progress(&progress_line(sh, rate, now, start, warm_end));
            next_line += Duration::from_secs(1);
        }
        let wake = next_line.min(end + Duration::from_millis(1));
        let wake = wake.max(now + Duration::from_millis(5));
        tokio::time::sleep_until(wake.into()).await;
    }
    let drain_deadline = end.max(Instant::now()) + sh.timeout + Duration::from_millis(50);
    loop {
        let done = {
            let s = lock(&sh.stats);
            s.ok + s.errors
        };
        if done >= sh.sent.load(Ordering::Relaxed) || Instant::now() >= drain_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn progress_line(sh: &Shared, rate: f64, now: Instant, start: Instant, warm_end: Instant) -> String {
    let conns = sh.open.load(Ordering::Relaxed);
    if now < warm_end {
        let t = now.saturating_duration_since(start).as_secs_f64();
        let w = warm_end.saturating_duration_since(start).as_secs_f64();
        return format!("rate {rate:.0}/s  warmup t={t:.0}/{w:.0}s  conns={conns}");
    }
    let t = now.saturating_duration_since(warm_end).as_secs_f64();
    let sent = sh.sent.load(Ordering::Relaxed);
    let s = lock(&sh.stats);
    let p99 = if s.hist.is_empty() { 0.0 } else { s.hist.value_at_quantile(0.99) as f64 / 1000.0 };
    format!("rate {rate:.0}/s  t={t:.0}s  sent={sent} ok={} err={} p99={p99:.1}ms  conns={conns}", s.ok, s.errors)
}

fn make_report(sh: &Shared, p: &RateRun<'_>) -> RunReport {
    let sent = sh.sent.load(Ordering::Relaxed);
    let mut s = lock(&sh.stats);
    // Anything neither answered nor failed by the drain deadline is a timeout.
    let unfinished = sent.saturating_sub(s.ok + s.errors);
    for _ in 0..unfinished {
        s.record_err(ErrKind::Timeout);
    }
    let duration_s = p.duration.as_secs_f64();
    RunReport {
        offered_rps: p.rate,
        schedule: Vec::new(),
        achieved_rps: s.ok as f64 / duration_s,
        duration_s,
        sent,
        ok: s.ok,
        errors: s.errors,
        errors_by_kind: s.errors_by_kind(),
        latency_ms: Percentiles::from_histogram_us(&s.hist),
        slower_than_slo: match p.slo_us {
            Some(slo) if !s.hist.is_empty() => s.hist.count_between(slo + 1, s.hist.max().max(slo + 1)),
            _ => 0,
        },
        late_sends: s.late_sends,
        retries: s.retries,
        max_connections_used: sh.peak_open.load(Ordering::Relaxed),
        timeline: s.buckets(p.slo_us, p.timeline_latencies),
    }
}

/// One request on a fresh connection: proves the target answers HTTP before
/// a sweep starts. Any status counts as reachable.
pub(crate) fn preflight(target: &Target, timeout: Duration) -> Result<u16, LoadgenError> {
    let rt = build_runtime(1)?;
    let addr = target.authority.clone();
    rt.block_on(async {
        let attempt = async {
            let stream = TcpStream::connect(target.addr)
                .await
                .map_err(|e| LoadgenError::Connect { addr: addr.clone(), reason: e.to_string() })?;
            let reply = Conn::new(stream).exchange(target.request(0), target.head_request).await.map_err(|e| {
                LoadgenError::Io {
                    addr: addr.clone(),
                    reason: if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        "connection closed without a complete HTTP response".into()
                    } else {
                        e.to_string()
                    },
                }
            })?;
            Ok(reply.status)
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(res) => res,
            Err(_) => Err(LoadgenError::Timeout { addr: addr.clone(), secs: timeout.as_secs_f64() }),
        }
    })
}
