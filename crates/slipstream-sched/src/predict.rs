//! The scheduling model's predictors: what a replica's load says about the
//! time a new request will wait, and what a route through the DAG says about
//! the time it will spend in the pipeline.
//!
//! Both the node and the simulator ([`crate::simulate`]) call these, so "the
//! model runs the node's own policies" holds by construction: a replica's
//! owner publishes a [`ReplicaLoad`] after every change of its state (built
//! by [`ReplicaLoad::of`] from its queue length, running batch and batch
//! former), and routing, admission and the batch former's `rest` read only
//! these snapshots through the functions here.
//!
//! Predictions are expected values (profile means), not worst cases:
//! admission refuses only requests that are likely to miss, and learns its
//! margin from outcomes (see [`crate::AdmissionGate`]).

use crate::former::BatchFormer;

/// A replica as routing and admission see it: a snapshot its owner
/// publishes after every change. Times are ns on the owner's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaLoad {
    /// Takes new work: its worker is ready and it is not draining.
    pub accepting: bool,
    /// Requests queued at or running on the replica.
    pub outstanding: u32,
    /// Requests queued (not running).
    pub queued: u32,
    /// When the running batch is expected to end; 0 when idle.
    pub busy_until_ns: u64,
    /// Expected time to run what is queued, in batches of the current limit.
    pub queue_ns: u64,
    /// Recent observed queue wait (a moving average): catches what the
    /// backlog model misses, such as replicas of other stages taking the cores.
    pub wait_ns: u64,
    /// Expected latency of a batch of one (an elastic stage's: at most its
    /// floor, [`BatchFormer::path_ns`]).
    pub single_ns: u64,
    /// Expected latency of a batch of the size this replica last ran (the
    /// same way).
    pub typical_ns: u64,
}

impl ReplicaLoad {
    /// The batch step's view of a replica: `queued` requests waiting,
    /// `running` = (size, expected end) of the batch in flight, `wait_ns`
    /// the recent observed queue wait, `last_batch` the size it last ran.
    /// `hop_ns` is added to every batch's latency (the simulator's modelled
    /// node-worker round trip; the node's profiles already include it).
    pub fn of(
        former: &BatchFormer,
        accepting: bool,
        queued: usize,
        running: Option<(usize, u64)>,
        wait_ns: u64,
        last_batch: usize,
        hop_ns: u64,
    ) -> ReplicaLoad {
        let mut load = ReplicaLoad {
            accepting,
            wait_ns,
            single_ns: former.path_ns(1) + hop_ns,
            typical_ns: former.path_ns(last_batch.max(1)) + hop_ns,
            ..ReplicaLoad::default()
        };
        load.set_queue(former, queued, running, hop_ns);
        load
    }

    /// Update the counts and the queue estimate only (what a push or a
    /// batch taken changes), keeping the batch latencies, which change only
    /// when a batch ends and the profile learns.
    pub fn set_queue(&mut self, former: &BatchFormer, queued: usize, running: Option<(usize, u64)>, hop_ns: u64) {
        let per = former.limit.max(1) as usize;
        // An elastic stage runs whatever is queued up to its limit, and a
        // request that joins the next batch ends with it, by its own
        // deadline: only the full batches before it count.
        let batches = if former.elastic_floor_ns.is_some() { queued / per } else { queued.div_ceil(per) };
        self.queue_ns =
            if batches == 0 { 0 } else { (batches as u64).saturating_mul(former.mean_ns(queued.min(per)) + hop_ns) };
        let running_n = running.map_or(0, |(n, _)| n);
        self.outstanding = (queued + running_n).min(u32::MAX as usize) as u32;
        self.queued = queued.min(u32::MAX as usize) as u32;
        self.busy_until_ns = running.map_or(0, |(_, until)| until.max(1));
    }

    /// Expected time until this replica could start a request that joins
    /// its queue at `now`: what is left of the running batch, plus the
    /// queued work (or the recent observed wait, if longer).
    pub fn backlog_ns(&self, now: u64) -> u64 {
        let running = match self.busy_until_ns {
            0 => 0,
            until => until.saturating_sub(now),
        };
        if self.queued == 0 {
            running
        } else {
            running.saturating_add(self.queue_ns).max(self.wait_ns)
        }
    }
}

/// Whether requests wait in a queue on `route` (not only a batch running):
/// the sign of a saturated pipeline that the admission gate learns its
/// capacity from ([`crate::AdmissionGate::on_admit`]).
pub fn found_queue(route: &[ReplicaLoad]) -> bool {
    route.iter().any(|l| l.queued > 0)
}

/// A pipeline's stage graph: for each stage its parents and children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dag {
    pub parents: Vec<Vec<usize>>,
    pub children: Vec<Vec<usize>>,
    /// Stages without parents (they receive the pipeline's inputs).
    pub roots: Vec<usize>,
    /// Stages without children (their outputs are the answer).
    pub sinks: Vec<usize>,
}

/// What admission needs to know about a new request's route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prediction {
    /// Expected time from now until the request's last stage finishes.
    pub ns: u64,
    /// Whether any replica on its route has work ahead of it. A request
    /// whose whole route is idle is always admitted: only queueing can make
    /// a request miss that a lone run would meet, and an idle stage keeps
    /// refreshing its profile.
    pub queued: bool,
}

impl Dag {
    /// The graph of stages whose parents are `parents[i]` (indices into the
    /// same list); the caller has checked that it is acyclic.
    pub fn new(parents: Vec<Vec<usize>>) -> Dag {
        let n = parents.len();
        let children: Vec<Vec<usize>> = (0..n).map(|s| (0..n).filter(|&c| parents[c].contains(&s)).collect()).collect();
        let roots = (0..n).filter(|&s| parents[s].is_empty()).collect();
        let sinks = (0..n).filter(|&s| children[s].is_empty()).collect();
        Dag { parents, children, roots, sinks }
    }

    pub fn len(&self) -> usize {
        self.parents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }

    /// Expected time from the end of `stage` to the end of the request: the
    /// longest path through its descendants, each at `typical(stage)`.
    pub fn rest_ns(&self, stage: usize, typical: &dyn Fn(usize) -> u64) -> u64 {
        self.children[stage].iter().map(|&c| typical(c) + self.rest_ns(c, typical)).max().unwrap_or(0)
    }

    /// Expected time from the end of `stage` to the end of a request routed
    /// on `route` (one replica's load per stage): through each downstream
    /// stage, the backlog of its routed replica plus one typical batch,
    /// along the longest path.
    pub fn path_ns(&self, stage: usize, route: &[ReplicaLoad], now: u64) -> u64 {
        self.children[stage]
            .iter()
            .map(|&c| route[c].backlog_ns(now) + route[c].typical_ns + self.path_ns(c, route, now))
            .max()
            .unwrap_or(0)
    }

    /// Expected time in the pipeline of a request arriving at `now` and
    /// routed on `route`: through every root, the backlog ahead of it, a
    /// batch of one, and the longest routed path after it.
    pub fn predict(&self, route: &[ReplicaLoad], now: u64) -> Prediction {
        let ns = self
            .roots
            .iter()
            .map(|&s| route[s].backlog_ns(now) + route[s].single_ns + self.path_ns(s, route, now))
            .max()
            .unwrap_or(0);
        let queued = route.iter().any(|l| l.backlog_ns(now) > 0);
        Prediction { ns, queued }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::former::BatchPolicy;
    use crate::profile::LatencyProfile;

    const MS: u64 = 1_000_000;

    fn former() -> BatchFormer {
        // 1 ms + 0.1 ms per request.
        let p = LatencyProfile::from_measurements(&[(1, 1100.0, 1100.0), (64, 7400.0, 7400.0)]);
        let mut f = BatchFormer::new(BatchPolicy::DeadlineAware, 64, p);
        f.limit = 8;
        f
    }

    #[test]
    fn load_of_a_replica() {
        let f = former();
        let idle = ReplicaLoad::of(&f, true, 0, None, 0, 1, 0);
        assert_eq!(idle.backlog_ns(5 * MS), 0);
        assert_eq!(idle.single_ns, 1_100_000);
        // 20 queued in batches of 8: 3 batches at the mean of 8; a batch of 4 ends at 10 ms.
        let busy = ReplicaLoad::of(&f, true, 20, Some((4, 10 * MS)), 0, 4, 0);
        assert_eq!(busy.outstanding, 24);
        assert_eq!(busy.queue_ns, 3 * f.mean_ns(8));
        assert_eq!(busy.backlog_ns(6 * MS), 4 * MS + 3 * f.mean_ns(8));
        assert_eq!(busy.backlog_ns(20 * MS), 3 * f.mean_ns(8), "an overrunning batch counts as ending now");
        // The observed wait wins when it is longer; a hop adds to every batch.
        let mut moved = busy;
        moved.set_queue(&f, 0, None, 0);
        assert_eq!((moved.outstanding, moved.queue_ns, moved.busy_until_ns), (0, 0, 0));
        assert_eq!(moved.typical_ns, busy.typical_ns, "latencies are kept");
        let slow = ReplicaLoad::of(&f, true, 1, None, 50 * MS, 1, 0);
        assert_eq!(slow.backlog_ns(0), 50 * MS);
        let hop = ReplicaLoad::of(&f, true, 1, None, 0, 1, 200_000);
        assert_eq!(hop.single_ns, 1_300_000);
        assert_eq!(hop.backlog_ns(0), 1_300_000);
    }

    #[test]
    fn predicts_along_the_longest_routed_path() {
        // 0 -> {1, 2} -> 3
        let dag = Dag::new(vec![vec![], vec![0], vec![0], vec![1, 2]]);
        assert_eq!((dag.roots.clone(), dag.sinks.clone()), (vec![0], vec![3]));
        assert_eq!(dag.children[0], vec![1, 2]);
        let f = former();
        let idle = ReplicaLoad::of(&f, true, 0, None, 0, 1, 0);
        let mut route = vec![idle; 4];
        let one = f.mean_ns(1);
        let p = dag.predict(&route, 0);
        assert_eq!(p, Prediction { ns: 3 * one, queued: false });
        assert_eq!(dag.rest_ns(0, &|_| one), 2 * one);
        // A queue on branch 2 lengthens that path only, and makes the route queued.
        route[2] = ReplicaLoad::of(&f, true, 8, None, 0, 1, 0);
        let p = dag.predict(&route, 0);
        assert_eq!(p, Prediction { ns: 3 * one + f.mean_ns(8), queued: true });
    }
}
