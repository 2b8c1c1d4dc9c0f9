//! The SLO contract's queueing model: a discrete-event simulation of a
//! pipeline served by this crate's own policies.
//!
//! Requests arrive (Poisson or bursty), are routed join-shortest-queue at
//! ingress, pass admission control, wait in per-replica EDF queues and are
//! batched by the same [`BatchFormer`] the node runs. Routing, the
//! predictors behind admission, the admission step and the batch step are
//! the node's own functions ([`choose_replica`], [`Dag::predict`],
//! [`AdmissionGate::decide`], [`take_batch`]) over the same published
//! [`ReplicaLoad`]; a batch of `n` takes a
//! time drawn from the stage's [`LatencyProfile`] (mean and deviation at
//! `n`) plus a fixed hop latency. Replicas share `cores` CPU cores: a batch
//! whose replica is free but finds no free core waits for one, which is what
//! bounds a 2-core machine; a batch holds its core for its service time plus
//! the framing CPU, and its replica for the service time plus the hop. The node's own per-request work (HTTP, decode,
//! encode) is charged as a fixed latency and as CPU taken from the cores.
//!
//! The output is what `slipstream slo` prints: p50/p99 latency of answered
//! requests, the share refused / dropped / late, and goodput, per offered
//! load. Deterministic for a given seed.

use crate::admission::AdmissionGate;
use crate::former::{take_batch, BatchFormer, BatchPolicy};
use crate::predict::{found_queue, Dag, ReplicaLoad};
use crate::profile::LatencyProfile;
use crate::queue::EdfQueue;
use crate::router::choose_replica;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

#[derive(Clone, Debug)]
pub struct SimStage {
    pub parents: Vec<usize>,
    pub replicas: usize,
    pub max_batch: u32,
    pub profile: LatencyProfile,
    /// An elastic stage's floor, ns ([`BatchFormer::elastic_floor_ns`]):
    /// its batches answer that long before their budget ends, clipped as
    /// the component clips its own work. None: a plain stage.
    pub elastic_floor_ns: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub stages: Vec<SimStage>,
    /// Deadline budget per request (the SLO target), ns.
    pub slo_ns: u64,
    pub rate: f64,
    /// Arrivals per burst (1 = Poisson).
    pub burst: u32,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub cores: f64,
    /// Node -> worker -> node latency per batch beyond the component's own
    /// time (wake-ups, framing), ns. The replica is busy for it.
    pub hop_ns: u64,
    /// CPU that framing takes per batch (held on a core), ns; part of `hop_ns`.
    pub batch_cpu_ns: u64,
    /// Fixed latency the node adds to every request (ingress + egress), ns.
    pub ingress_ns: u64,
    /// CPU the node and the load generator spend per request, ns.
    pub cpu_per_request_ns: u64,
    /// Latency outside the pipeline's stages that varies from request to
    /// request (the client and the kernel scheduling the node, the load
    /// generator and the workers on shared cores), as quantiles
    /// `(q, ns)`, increasing in both, measured at a light load; each answer
    /// draws one, linearly between quantiles. Empty: none.
    pub external_ns: Vec<(f64, u64)>,
    /// Allowed SLO miss rate (the admission gate aims at half of it).
    pub max_miss_rate: f64,
    /// How CPU contention stretches work (0: smoothly, by the
    /// processor-sharing slowdown). Otherwise a piece of work is preempted
    /// as a Poisson process and each preemption lasts an exponential time
    /// with this mean, the scheduler's time slice: the same mean stretch,
    /// but the long tail a shared machine shows (most batches run
    /// unhurt, a few wait out other threads' slices). Hops and the node's
    /// own per-request work (`cpu_per_request_ns`) are stretched the same way.
    pub preempt_slice_ns: u64,
    pub policy: BatchPolicy,
    pub max_wait_ns: u64,
    pub admission: bool,
    pub seed: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimResult {
    pub offered_rps: f64,
    pub arrivals: u64,
    pub answered: u64,
    pub refused: u64,
    pub dropped: u64,
    pub late: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    /// (refused + dropped + late) / arrivals.
    pub miss_rate: f64,
    /// Answered within the SLO, per second.
    pub goodput_rps: f64,
}

/// A small deterministic PRNG (xorshift64*), so results do not depend on a crate.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }
    /// A draw from a distribution given by increasing quantiles `(q, v)`,
    /// linear between them (and from 0 below the first).
    fn quantile(&mut self, qs: &[(f64, u64)]) -> u64 {
        let u = self.next_f64();
        let mut prev = (0.0, 0u64);
        for &(q, v) in qs {
            if u <= q {
                let f = if q > prev.0 { (u - prev.0) / (q - prev.0) } else { 1.0 };
                return prev.1 + (f * v.saturating_sub(prev.1) as f64) as u64;
            }
            prev = (q, v);
        }
        prev.1
    }
    /// Extra time that `work_ns` of CPU work spends preempted, when
    /// contention slows work down by `slowdown` on average: preemptions
    /// arrive at rate `(slowdown - 1) / slice` per ns of work and each lasts
    /// Exp(slice).
    fn preempted(&mut self, work_ns: f64, slowdown: f64, slice_ns: f64) -> f64 {
        if slowdown <= 1.0 || slice_ns <= 0.0 || work_ns <= 0.0 {
            return 0.0;
        }
        let gap = slice_ns / (slowdown - 1.0);
        let (mut t, mut extra) = (self.exp(gap), 0.0);
        while t < work_ns {
            extra += self.exp(slice_ns);
            t += self.exp(gap);
        }
        extra
    }
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.next_f64().max(1e-12), self.next_f64());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival,
    Enter(usize),
    BatchDone { stage: usize, replica: usize },
    CoreFree,
    Wake { stage: usize, replica: usize },
}

struct Replica {
    queue: EdfQueue<(usize, u64)>, // (request, enqueued)
    former: BatchFormer,
    /// Batch running or waiting for a core.
    batch: Option<Vec<usize>>,
    started: u64,
    /// Expected latency of the running batch (for its expected end).
    predicted: u64,
    /// Slack of the running batch's most urgent request at dispatch.
    budget: u64,
    last_batch: usize,
    wake_at: Option<u64>,
    wait_ewma: u64,
}

struct Req {
    arrival: u64,
    deadline: u64,
    route: Vec<usize>,
    pending: Vec<usize>,
    sinks_left: usize,
    done: bool,
    measured: bool,
    /// The share of its budget its prediction used at admission.
    share: f64,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    now: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    rng: Rng,
    reps: Vec<Vec<Replica>>,
    dag: Dag,
    reqs: Vec<Req>,
    free_cores: f64,
    /// Service-time stretch when the node and load generator leave a
    /// fraction of a core: whole core slots, each running slower.
    slowdown: f64,
    core_wait: VecDeque<(usize, usize)>,
    gate: AdmissionGate,
    latencies: Vec<u64>,
    res: SimResult,
}

impl Sim<'_> {
    fn at(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, e)));
    }

    /// The load replica `r` of `stage` would publish now (as the node's
    /// replica owner does after every change).
    fn load(&self, stage: usize, r: usize) -> ReplicaLoad {
        let rep = &self.reps[stage][r];
        let running = rep.batch.as_ref().map(|b| (b.len(), rep.started + rep.predicted));
        ReplicaLoad::of(&rep.former, true, rep.queue.len(), running, rep.wait_ewma, rep.last_batch, self.cfg.hop_ns)
    }

    fn rest_ns(&self, stage: usize) -> u64 {
        self.dag.rest_ns(stage, &|c| self.load(c, 0).typical_ns)
    }

    fn arrive(&mut self) {
        let id = self.reqs.len();
        let t = self.now;
        let route: Vec<usize> = (0..self.reps.len())
            .map(|s| {
                let loads: Vec<ReplicaLoad> = (0..self.reps[s].len()).map(|r| self.load(s, r)).collect();
                choose_replica(&loads, id as u64).unwrap_or(0)
            })
            .collect();
        let measured = t as f64 >= self.cfg.warmup_s * 1e9;
        let deadline = t + self.cfg.slo_ns;
        self.reqs.push(Req {
            arrival: t,
            deadline,
            route: route.clone(),
            pending: self.dag.parents.iter().map(|p| p.len()).collect(),
            sinks_left: self.dag.sinks.len(),
            done: false,
            measured,
            share: 1.0,
        });
        if measured {
            self.res.arrivals += 1;
        }
        let loads: Vec<ReplicaLoad> = route.iter().enumerate().map(|(s, &r)| self.load(s, r)).collect();
        if self.cfg.admission {
            match self.gate.decide(self.dag.predict(&loads, t), self.cfg.slo_ns) {
                Ok(share) => self.reqs[id].share = share,
                Err(_) => {
                    self.reqs[id].done = true;
                    if measured {
                        self.res.refused += 1;
                    }
                    return;
                }
            }
        }
        self.gate.on_admit(self.now, found_queue(&loads));
        self.at(t + self.cfg.ingress_ns / 2, Event::Enter(id));
    }

    /// An admitted request left: answered at `end`, or dropped (`None`).
    fn finished(&mut self, id: usize, end: Option<u64>) {
        let q = &self.reqs[id];
        let met = end.is_some_and(|e| AdmissionGate::counts_as_met(e - q.arrival, q.deadline - q.arrival));
        let share = q.share;
        self.gate.on_finish_with(self.now, Some(met), share);
    }

    /// Extra time `work_ns` of CPU work spends preempted under this load's
    /// contention (see `SimConfig::preempt_slice_ns`).
    fn preempted(&mut self, work_ns: f64) -> f64 {
        self.rng.preempted(work_ns, self.slowdown, self.cfg.preempt_slice_ns as f64)
    }

    fn enqueue(&mut self, id: usize, stage: usize) {
        let r = self.reqs[id].route[stage];
        let d = self.reqs[id].deadline;
        let now = self.now;
        let rep = &mut self.reps[stage][r];
        rep.former.on_arrival(now);
        rep.queue.push(d, (id, now));
        self.try_dispatch(stage, r);
    }

    fn try_dispatch(&mut self, stage: usize, r: usize) {
        if self.reps[stage][r].batch.is_some() {
            return;
        }
        let rest = self.rest_ns(stage);
        let now = self.now;
        let reqs = &self.reqs;
        let rep = &mut self.reps[stage][r];
        let taken = take_batch(&mut rep.queue, &rep.former, now, rest, |(id, _)| reqs[*id].done, |(_, e)| *e, |_| None);
        let (expired, live, wake) = (taken.expired.len(), taken.batch, taken.wait_until);
        for (id, _) in taken.expired {
            if !self.reqs[id].done {
                self.reqs[id].done = true;
                if self.reqs[id].measured {
                    self.res.dropped += 1;
                }
                self.finished(id, None);
            }
        }
        let rep = &mut self.reps[stage][r];
        if let Some(at) = wake {
            if rep.wake_at.is_none_or(|w| w > at) {
                rep.wake_at = Some(at);
                self.at(at, Event::Wake { stage, replica: r });
            }
            return;
        }
        if live.is_empty() {
            if expired > 0 {
                // More may wait behind the expired ones.
                self.try_dispatch(stage, r);
            }
            return;
        }
        rep.budget = live[0].0.saturating_sub(now + rest);
        // The batch's clock starts now, as the node's does: time spent
        // waiting for a core counts, as CPU contention does on a real machine.
        rep.started = now;
        let wait = live.iter().map(|(_, (_, e))| now - e).sum::<u64>() / live.len() as u64;
        rep.wait_ewma = if rep.wait_ewma == 0 {
            wait
        } else {
            (rep.wait_ewma as f64 + 0.2 * (wait as f64 - rep.wait_ewma as f64)) as u64
        };
        rep.batch = Some(live.into_iter().map(|(_, (id, _))| id).collect());
        let n = rep.batch.as_ref().map_or(1, |b| b.len());
        rep.predicted = rep.former.within(rep.former.mean_ns(n), rep.budget) + self.cfg.hop_ns;
        self.core_wait.push_back((stage, r));
        self.start_on_cores();
    }

    fn start_on_cores(&mut self) {
        while self.free_cores >= 1.0 {
            let Some((stage, r)) = self.core_wait.pop_front() else { return };
            self.free_cores -= 1.0;
            let n = self.reps[stage][r].batch.as_ref().map_or(1, |b| b.len());
            // Service times come from the measured profile, never from the
            // former's copy, which learns from them (that loop would run away).
            let (mean, dev) = {
                let truth = &self.cfg.stages[stage].profile;
                let mean = truth.mean(n as u32);
                (mean, (truth.predict(n as u32) - mean) / truth.k.max(1e-9))
            };
            let work = (mean + dev * self.rng.normal()).max(0.3 * mean) * 1e3;
            let service =
                if self.cfg.preempt_slice_ns > 0 { work + self.preempted(work) } else { work * self.slowdown };
            // An elastic stage answers by its batch's budget (from dispatch;
            // the wait for a core counts against it), never under its floor.
            let rep = &self.reps[stage][r];
            let left = (rep.started + rep.budget).saturating_sub(self.now);
            let (service, now) = (rep.former.within(service as u64, left), self.now);
            // The hop is wake-ups and framing on both sides: under contention
            // it waits for cores too.
            let hop = self.cfg.hop_ns.max(self.cfg.batch_cpu_ns);
            let hop = hop + self.preempted(hop as f64) as u64;
            self.at(now + service + self.cfg.batch_cpu_ns, Event::CoreFree);
            self.at(now + service + hop, Event::BatchDone { stage, replica: r });
        }
    }

    fn batch_done(&mut self, stage: usize, r: usize) {
        let now = self.now;
        let batch = self.reps[stage][r].batch.take().unwrap_or_default();
        let n = batch.len();
        {
            let rep = &mut self.reps[stage][r];
            rep.last_batch = n;
            let took = now - rep.started;
            let budget = rep.budget;
            rep.former.on_batch_done(n, took, budget);
        }
        for id in batch {
            if self.reqs[id].done {
                continue;
            }
            for c in self.dag.children[stage].clone() {
                self.reqs[id].pending[c] -= 1;
                if self.reqs[id].pending[c] == 0 {
                    self.enqueue(id, c);
                }
            }
            if self.dag.sinks.contains(&stage) {
                self.reqs[id].sinks_left -= 1;
                if self.reqs[id].sinks_left == 0 {
                    let stretch = self.preempted(self.cfg.cpu_per_request_ns as f64) as u64;
                    let end = now + self.cfg.ingress_ns / 2 + self.rng.quantile(&self.cfg.external_ns) + stretch;
                    self.finished(id, Some(end));
                    let q = &mut self.reqs[id];
                    q.done = true;
                    if q.measured {
                        self.res.answered += 1;
                        self.latencies.push(end - q.arrival);
                        if end > q.deadline {
                            self.res.late += 1;
                        }
                    }
                }
            }
        }
        self.start_on_cores();
        self.try_dispatch(stage, r);
    }
}

/// Run the model at one offered load.
pub fn simulate(cfg: &SimConfig) -> SimResult {
    let dag = Dag::new(cfg.stages.iter().map(|s| s.parents.clone()).collect());
    let reps = cfg
        .stages
        .iter()
        .map(|st| {
            (0..st.replicas.max(1))
                .map(|_| {
                    let mut former = BatchFormer::new(cfg.policy, st.max_batch, st.profile.clone());
                    former.max_wait_ns = cfg.max_wait_ns;
                    former.elastic_floor_ns = st.elastic_floor_ns;
                    Replica {
                        queue: EdfQueue::new(),
                        former,
                        batch: None,
                        started: 0,
                        predicted: 0,
                        budget: u64::MAX,
                        last_batch: 1,
                        wake_at: None,
                        wait_ewma: 0,
                    }
                })
                .collect()
        })
        .collect();
    // The node's and the load generator's CPU come off the top; what is left
    // is shared by the replicas as whole core slots that run proportionally
    // slower (processor sharing), e.g. 0.4 of a core = 1 slot at 2.5x.
    let effective = (cfg.cores - cfg.rate * cfg.cpu_per_request_ns as f64 / 1e9).max(0.05);
    let free_cores = effective.ceil();
    let slowdown = free_cores / effective;
    let mut sim = Sim {
        cfg,
        now: 0,
        events: BinaryHeap::new(),
        seq: 0,
        rng: Rng(cfg.seed.max(1)),
        reps,
        dag,
        reqs: Vec::new(),
        free_cores,
        slowdown,
        core_wait: VecDeque::new(),
        gate: AdmissionGate::new(cfg.max_miss_rate)
            .with_elastic(cfg.stages.iter().any(|s| s.elastic_floor_ns.is_some())),
        latencies: Vec::new(),
        res: SimResult { offered_rps: cfg.rate, ..Default::default() },
    };
    let end = ((cfg.warmup_s + cfg.duration_s) * 1e9) as u64;
    let burst = cfg.burst.max(1) as f64;
    let mut t = 0.0f64;
    // Arrivals are generated lazily: one pending Arrival event at a time.
    let mut pending_in_burst = 0u32;
    sim.at(0, Event::Arrival);
    while let Some(Reverse((time, _, ev))) = sim.events.pop() {
        sim.now = time;
        match ev {
            Event::Arrival => {
                if time >= end {
                    continue;
                }
                sim.arrive();
                if pending_in_burst == 0 {
                    pending_in_burst = burst as u32 - 1;
                    t += sim.rng.exp(burst / cfg.rate) * 1e9;
                } else {
                    pending_in_burst -= 1;
                }
                let next = if pending_in_burst > 0 { time } else { t as u64 };
                sim.at(next.max(time), Event::Arrival);
            }
            Event::Enter(id) => {
                if !sim.reqs[id].done {
                    for s in sim.dag.roots.clone() {
                        sim.enqueue(id, s);
                    }
                }
            }
            Event::BatchDone { stage, replica } => sim.batch_done(stage, replica),
            Event::CoreFree => {
                sim.free_cores += 1.0;
                sim.start_on_cores();
            }
            Event::Wake { stage, replica } => {
                if sim.reps[stage][replica].wake_at == Some(time) {
                    sim.reps[stage][replica].wake_at = None;
                    sim.try_dispatch(stage, replica);
                }
            }
        }
    }
    let mut res = sim.res;
    let mut lat = sim.latencies;
    lat.sort_unstable();
    let q = |p: f64| if lat.is_empty() { 0.0 } else { lat[((lat.len() - 1) as f64 * p).round() as usize] as f64 / 1e6 };
    res.p50_ms = q(0.5);
    res.p90_ms = q(0.9);
    res.p99_ms = q(0.99);
    res.p999_ms = q(0.999);
    if res.arrivals > 0 {
        res.miss_rate = (res.refused + res.dropped + res.late) as f64 / res.arrivals as f64;
    }
    res.goodput_rps = (res.answered - res.late) as f64 / cfg.duration_s;
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ms_per_batch: f64, per_item: f64) -> SimConfig {
        let profile = LatencyProfile::from_measurements(&[
            (1, ms_per_batch * 1e3 + per_item * 1e3, ms_per_batch * 1e3 + per_item * 1e3),
            (64, ms_per_batch * 1e3 + 64.0 * per_item * 1e3, ms_per_batch * 1e3 + 64.0 * per_item * 1e3),
        ]);
        SimConfig {
            stages: vec![SimStage { parents: vec![], replicas: 1, max_batch: 64, profile, elastic_floor_ns: None }],
            slo_ns: 50_000_000,
            rate: 100.0,
            burst: 1,
            duration_s: 20.0,
            warmup_s: 2.0,
            cores: 2.0,
            hop_ns: 0,
            batch_cpu_ns: 0,
            ingress_ns: 0,
            cpu_per_request_ns: 0,
            external_ns: vec![],
            max_miss_rate: 0.01,
            preempt_slice_ns: 0,
            policy: BatchPolicy::DeadlineAware,
            max_wait_ns: 0,
            admission: true,
            seed: 7,
        }
    }

    #[test]
    fn light_load_latency_is_the_service_time() {
        let r = simulate(&chain(1.0, 0.1));
        assert!(r.answered > 1500, "{r:?}");
        assert_eq!(r.refused + r.dropped + r.late, 0);
        assert!(r.p50_ms >= 1.0 && r.p50_ms < 3.5, "{r:?}");
    }

    #[test]
    fn batching_carries_load_beyond_one_at_a_time_capacity() {
        // One at a time: 1.1 ms -> ~900/s. With batching, 3000/s fits.
        let mut c = chain(1.0, 0.1);
        c.rate = 3000.0;
        let r = simulate(&c);
        assert!(r.miss_rate < 0.01, "{r:?}");
        assert!(r.p99_ms < 50.0);
    }

    #[test]
    fn overload_is_refused_not_queued() {
        // Capacity ~ 64 / 7.4 ms ~ 8,600/s; offer 3x.
        let mut c = chain(1.0, 0.1);
        c.rate = 26_000.0;
        c.duration_s = 5.0;
        let r = simulate(&c);
        assert!(r.refused > r.arrivals / 3, "{r:?}");
        assert!(r.p99_ms <= 55.0, "admitted requests still meet the SLO: {r:?}");
    }

    #[test]
    fn past_capacity_the_fixed_policy_collapses_and_deadlines_hold() {
        // Capacity ~8,600/s; offer ~1.4x with a 10 ms SLO.
        let mut c = chain(1.0, 0.1);
        c.rate = 12_000.0;
        c.duration_s = 5.0;
        c.slo_ns = 10_000_000;
        let deadline = simulate(&c);
        c.policy = BatchPolicy::Fixed { wait_ns: 2_000_000 };
        c.admission = false;
        let fixed = simulate(&c);
        assert!(deadline.goodput_rps > 1.5 * fixed.goodput_rps, "{deadline:?} vs {fixed:?}");
        assert!(deadline.p99_ms <= 10.0, "{deadline:?}");
    }

    #[test]
    fn an_elastic_stage_answers_by_its_budget() {
        // a (2 ms + 1 ms a request) -> b, which spends 40 ms on any batch
        // unless its deadline is nearer (a re-rank under a time budget),
        // with a 60 ms SLO: as a plain stage, b's queue and a's shrinking
        // room make requests miss; elastic, b answers by each deadline.
        let lin = |fixed: f64, per: f64| {
            LatencyProfile::from_measurements(&[
                (1, (fixed + per) * 1e3, (fixed + per) * 1e3),
                (32, (fixed + 32.0 * per) * 1e3, (fixed + 32.0 * per) * 1e3),
            ])
        };
        let mut c = chain(1.0, 0.1);
        c.stages = vec![
            SimStage { parents: vec![], replicas: 1, max_batch: 32, profile: lin(2.0, 1.0), elastic_floor_ns: None },
            SimStage { parents: vec![0], replicas: 1, max_batch: 32, profile: lin(40.0, 0.0), elastic_floor_ns: None },
        ];
        c.rate = 200.0;
        c.duration_s = 10.0;
        c.slo_ns = 60_000_000;
        let plain = simulate(&c);
        c.stages[1].elastic_floor_ns = Some(5_000_000);
        let elastic = simulate(&c);
        assert!(elastic.miss_rate < 0.01, "{elastic:?}");
        assert!(elastic.p99_ms <= 60.0, "{elastic:?}");
        assert!(plain.miss_rate > 5.0 * elastic.miss_rate.max(0.002), "{plain:?} vs {elastic:?}");
        // Past capacity (a: ~940 a second at batch 32; b: 32 per batch of at
        // most 40 ms) the gate still refuses what the queues cannot serve.
        c.rate = 2_000.0;
        c.duration_s = 5.0;
        let over = simulate(&c);
        assert!(over.refused > over.arrivals / 4, "{over:?}");
        // (5% of the admitted miss here, against 1.5% with b a plain 5 ms
        // stage: b's long batches leave a's queue less room to be read.)
        assert!((over.late + over.dropped) as f64 <= 0.08 * over.answered as f64, "{over:?}");
        assert!(over.goodput_rps > 500.0, "{over:?}");
    }

    #[test]
    fn external_latency_is_drawn_from_its_quantiles() {
        let mut c = chain(1.0, 0.1);
        let base = simulate(&c);
        c.external_ns = vec![(0.5, 1_000_000), (0.99, 5_000_000), (1.0, 10_000_000)];
        let r = simulate(&c);
        assert!((r.p50_ms - base.p50_ms - 1.0).abs() < 0.5, "{base:?} {r:?}");
        assert!(r.p99_ms > base.p99_ms + 4.0 && r.p99_ms < base.p99_ms + 6.5, "{base:?} {r:?}");
    }

    #[test]
    fn preemption_keeps_the_mean_stretch_and_lengthens_the_tail() {
        let mut rng = Rng(3);
        let (work, slowdown, slice) = (1_000_000.0, 1.5, 1_500_000.0);
        let draws: Vec<f64> = (0..200_000).map(|_| rng.preempted(work, slowdown, slice)).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - work * (slowdown - 1.0)).abs() < 0.02 * work, "mean extra {mean}");
        let unhurt = draws.iter().filter(|&&d| d == 0.0).count() as f64 / draws.len() as f64;
        assert!(unhurt > 0.65 && unhurt < 0.75, "P(no preemption) = e^-(1/3): {unhurt}");
        let mut sorted = draws.clone();
        sorted.sort_by(f64::total_cmp);
        assert!(sorted[(0.99 * sorted.len() as f64) as usize] > 4.0 * work * (slowdown - 1.0));
        assert_eq!(rng.preempted(work, 1.0, slice), 0.0, "no contention, no preemption");
    }

    #[test]
    fn deterministic_for_a_seed() {
        let c = chain(1.0, 0.1);
        assert_eq!(simulate(&c), simulate(&c));
    }
}
