//! The one owner of replica sets: every change to a stage's replicas (an
//! operator's `scale`, an autoscaler's step, the cluster's placement) goes
//! through [`Node::change`], one change at a time, counted under that one
//! lock.
//!
//! Why one owner: a change is computed from a count (how many serve now)
//! and then acts on it. Two changers that count apart and act apart can
//! both add replicas for the same shortfall (an operator scaling to 3 while
//! an autoscaler tick, which had counted 1, adds 1 more: 4, which nobody
//! asked for). Here every change counts the set itself, under the lock,
//! and states what it wants as a target (`Set(3)`, `Grow { to: 2 }`), not a
//! delta, so whatever order changes come in, the count after each is one
//! that a changer asked for.
//!
//! What counts as serving: replicas on this node that will serve (ready,
//! starting, restarting), not standbys (warm, held back from routing), and
//! not those the cluster placed elsewhere (leaving after a grace period).
//! New replicas start (and warm up) before they take traffic; surplus ones
//! stop taking work, finish their queue and exit (crashed or starting ones
//! first, then the least loaded, then the newest).

use crate::error::NodeError;
use crate::events::EventKind;
use crate::node::{removal_order, Node};
use crate::pipeline::{PipelineRt, StageRt};
use crate::replica::{Phase, RemoteAt, Replica};
use crate::spec::MAX_REPLICAS;
use serde::Serialize;
use slipstream_sched::scale::ScaleAction;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a replica the cluster placed elsewhere keeps serving once
/// another replica of its stage accepts work, before it drains (other
/// nodes see that replica ready within this).
const PLACEMENT_GRACE: Duration = Duration::from_secs(2);

/// The longest a replica placed elsewhere waits for another replica of its
/// stage to accept work (its replacement failing to start, say).
const LEAVING_LIMIT: Duration = Duration::from_secs(30);

/// How often a leaving replica looks for one that replaces it.
const LEAVING_POLL: Duration = Duration::from_millis(50);

/// A change to one stage's replicas.
#[derive(Clone, Copy, Debug)]
pub enum Change<'a> {
    /// `n` serving replicas on this node (an operator's `scale`): standbys
    /// are promoted first, then new replicas start; surplus ones drain.
    Set(usize),
    /// The cluster's placement gives this node `n` (0 allowed): like
    /// [`Change::Set`], but surplus replicas serve a grace period first,
    /// for nodes still routing here by the old placement.
    Place(usize),
    /// The cluster's placement gives this node `n` warm standbys of the
    /// stage (started as standbys; extra ones drain).
    Stand(usize),
    /// What other nodes run of the stage (node -> [`Elsewhere`]): one
    /// remote replica here per replica placed there, and one remote
    /// standby per standby there.
    Remote(&'a BTreeMap<String, Elsewhere>),
    /// An autoscaler's step.
    Scale(ScaleAction),
    /// Bind the stage's replicas on this node to these devices (places in
    /// its list; empty: any): a cluster plan's binding for this node. A
    /// replica on a device it leaves out is replaced, make before break.
    Bind(&'a [usize]),
}

/// What another node runs of a stage, as the placement says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Elsewhere {
    /// Its data plane.
    pub addr: SocketAddr,
    /// Replicas placed there.
    pub serving: usize,
    /// Standbys placed there.
    pub standby: usize,
}

/// What a change did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Changed {
    /// Serving replicas before.
    pub from: usize,
    /// Serving replicas after (starting ones included).
    pub to: usize,
    /// Replicas started (their ids).
    pub added: Vec<u32>,
    /// Standbys promoted into routing.
    pub promoted: usize,
    /// Of those, warm ones (serving at once).
    pub warm: usize,
    /// Replicas taken out of routing to drain (their ids).
    pub draining: Vec<u32>,
    /// Serving replicas sent back to standby.
    pub to_standby: usize,
}

/// A stage's replicas on this node, by role.
struct Census {
    /// Serving or about to (see the module docs).
    serving: Vec<Arc<Replica>>,
    standby: usize,
}

fn census(st: &StageRt) -> Census {
    let set = st.replicas();
    let serving: Vec<Arc<Replica>> = set
        .iter()
        .filter(|r| r.is_local() && r.phase().will_serve() && !r.leaving() && !r.is_standby())
        .cloned()
        .collect();
    let standby = set.iter().filter(|r| r.is_local() && r.is_standby()).count();
    Census { serving, standby }
}

impl Node {
    /// Set `pipeline`'s stage `stage` to `n` serving replicas (the admin
    /// route and `slipstream scale`).
    pub fn scale(&self, pipeline: &str, stage: &str, n: usize) -> Result<Changed, NodeError> {
        if !(1..=MAX_REPLICAS).contains(&n) {
            return Err(NodeError::BadInput(format!("replicas must be between 1 and {MAX_REPLICAS}, got {n}")));
        }
        if self.is_draining() {
            return Err(NodeError::ShuttingDown);
        }
        let pipe = self.pipeline(pipeline)?;
        let index = pipe.stage(stage)?.index;
        Ok(self.change(&pipe, index, Change::Set(n)))
    }

    /// How many replicas of stage `stage` serve and stand by on this node
    /// (as [`Changed`] counts them), read under the owner's lock: a count
    /// that no change is halfway through.
    pub fn census(&self, pipe: &PipelineRt, stage: usize) -> (usize, usize) {
        let _one_at_a_time = self.scaling.lock();
        let c = census(&pipe.stages[stage]);
        (c.serving.len(), c.standby)
    }

    /// Apply `change` to stage `stage` of `pipe` (see the module docs).
    pub fn change(&self, pipe: &Arc<PipelineRt>, stage: usize, change: Change<'_>) -> Changed {
        let _one_at_a_time = self.scaling.lock();
        let st = &pipe.stages[stage];
        match change {
            Change::Set(n) => {
                st.set_wanted(n);
                let c = self.set_serving(pipe, st, n, false);
                if c.to != c.from {
                    self.record(pipe, st, None, EventKind::Scaled, format!("{} -> {} replicas", c.from, c.to));
                }
                c
            }
            Change::Place(n) => {
                let c = self.set_serving(pipe, st, n, true);
                if c.to != c.from {
                    self.record(pipe, st, None, EventKind::Placed, format!("{} -> {} replicas here", c.from, c.to));
                }
                c
            }
            Change::Stand(n) => self.set_standbys(pipe, st, n),
            Change::Bind(devices) => self.rebind(pipe, st, devices),
            Change::Remote(nodes) => self.set_remote(pipe, st, nodes),
            Change::Scale(ScaleAction::Grow { to, max }) => {
                let to = to.min(max);
                st.set_wanted(to);
                let from = census(st).serving.len();
                if to > from {
                    self.set_serving(pipe, st, to, false)
                } else {
                    Changed { from, to: from, ..Changed::default() }
                }
            }
            Change::Scale(ScaleAction::AddStandby { max }) => {
                let c = census(st);
                let mut out = Changed { from: c.serving.len(), to: c.serving.len(), ..Changed::default() };
                if c.standby == 0 && c.serving.len() < max {
                    out.added = self.add(pipe, st, 1, true);
                }
                out
            }
            Change::Scale(ScaleAction::Retire { to_standby, min }) => self.retire_one(pipe, st, to_standby, min),
            Change::Scale(ScaleAction::DrainStandby) => {
                let c = census(st);
                let mut out = Changed { from: c.serving.len(), to: c.serving.len(), ..Changed::default() };
                if let Some(r) = st.standbys_warm_first().pop() {
                    if r.drain() {
                        self.record(pipe, st, Some(r.id), EventKind::Draining, "standby not needed".into());
                        out.draining.push(r.id);
                    }
                }
                out
            }
        }
    }

    /// `n` serving replicas: promote standbys, then start more; or take the
    /// surplus out of routing (after a grace period, when `placed`).
    fn set_serving(&self, pipe: &Arc<PipelineRt>, st: &StageRt, n: usize, placed: bool) -> Changed {
        let Census { mut serving, .. } = census(st);
        let from = serving.len();
        let mut out = Changed { from, to: from, ..Changed::default() };
        if n > from {
            for r in st.standbys_warm_first().into_iter().take(n - from) {
                let was_warm = r.phase() == Phase::Standby;
                if r.promote() {
                    out.promoted += 1;
                    out.warm += usize::from(was_warm);
                    let how = if was_warm { "warm" } else { "still starting" };
                    self.record(pipe, st, Some(r.id), EventKind::Promoted, how.into());
                }
            }
            out.added = self.add(pipe, st, n - from - out.promoted, false);
        } else if n < from {
            removal_order(&mut serving);
            for r in serving.into_iter().take(from - n) {
                if placed {
                    out.draining.push(r.id);
                    let why = "the placement moved it off this node".to_string();
                    self.leave_when_replaced(pipe, st, r, None, PLACEMENT_GRACE, why);
                } else if r.drain() {
                    self.record(pipe, st, Some(r.id), EventKind::Draining, "scaled down".into());
                    out.draining.push(r.id);
                }
            }
        }
        out.to = census(st).serving.len();
        out
    }

    /// `devices` bound: each replica whose worker runs on a device they
    /// leave out is replaced by one on a device they name (a standby by a
    /// standby), and serves until its replacement is ready. (Two stages
    /// swapping slices may briefly hold one slice together; a worker that
    /// finds no room retries until the other has drained.)
    fn rebind(&self, pipe: &Arc<PipelineRt>, st: &StageRt, devices: &[usize]) -> Changed {
        let n = census(st).serving.len();
        let mut out = Changed { from: n, to: n, ..Changed::default() };
        if !st.bind(devices) {
            return out;
        }
        let why = "its device is not in the plan's binding now";
        for r in st.misbound().into_iter().filter(|r| r.phase().will_serve() && !r.leaving()) {
            if r.is_standby() {
                if r.drain() {
                    self.record(pipe, st, Some(r.id), EventKind::Draining, why.into());
                    out.draining.push(r.id);
                }
                out.added.extend(self.add(pipe, st, 1, true));
            } else {
                let added = self.add(pipe, st, 1, false);
                let by = added.first().and_then(|id| st.replicas().iter().find(|x| x.id == *id).cloned());
                out.added.extend(added);
                out.draining.push(r.id);
                self.leave_when_replaced(pipe, st, r, by, Duration::ZERO, why.into());
            }
        }
        out
    }

    /// Make before break: `r`, which the cluster placed elsewhere, keeps
    /// serving until another replica of its stage (not leaving) accepts
    /// work (with `by`, until that one is ready, or has given up), then
    /// `grace` longer, and then drains; at most [`LEAVING_LIMIT`] in all.
    /// A placement that moves a replica (a node joined, say) would
    /// otherwise leave the stage with nothing serving while the new one's
    /// worker starts: seconds under load, and every request meanwhile
    /// waits at the stage until its deadline.
    fn leave_when_replaced(
        &self,
        pipe: &Arc<PipelineRt>,
        st: &StageRt,
        r: Arc<Replica>,
        by: Option<Arc<Replica>>,
        grace: Duration,
        why: String,
    ) {
        r.mark_leaving();
        self.record(pipe, st, Some(r.id), EventKind::Leaving, why.clone());
        let (events, pipe, index) = (self.events().clone(), pipe.clone(), st.index);
        tokio::spawn(async move {
            let st = &pipe.stages[index];
            let give_up = Instant::now() + LEAVING_LIMIT;
            let replaced = || match &by {
                Some(b) => b.phase() == Phase::Ready || !b.phase().will_serve(),
                None => st.served_without_leaving(),
            };
            while r.phase().will_serve() && !replaced() && Instant::now() < give_up {
                tokio::time::sleep(LEAVING_POLL).await;
            }
            tokio::time::sleep(grace.min(give_up.saturating_duration_since(Instant::now()))).await;
            if r.drain() {
                events.record(pipe.name(), &st.name, Some(r.id), EventKind::Draining, why);
            }
        });
    }

    /// Start `n` replicas of `st` (as standbys: held back until promoted).
    /// Returns their ids (fewer if the arena has no room for another pool).
    fn add(&self, pipe: &Arc<PipelineRt>, st: &StageRt, n: usize, standby: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let pool = match self.arena().replica_pool(self.opts().replica_pool_bytes) {
                Ok(p) => p,
                Err(e) => {
                    self.record(pipe, st, None, EventKind::AddFailed, e.to_string());
                    break;
                }
            };
            let r = st.add_replica(pool, pipe.epoch, standby);
            ids.push(r.id);
            let what = if standby { EventKind::AddedStandby } else { EventKind::Added };
            self.record(pipe, st, Some(r.id), what, String::new());
            self.spawn_replica(pipe, st.index, r, None);
        }
        ids
    }

    /// Take one serving replica out of routing (the least loaded), while
    /// more than `min` serve: back to standby, or drained away.
    fn retire_one(&self, pipe: &PipelineRt, st: &StageRt, to_standby: bool, min: usize) -> Changed {
        let c = census(st);
        let mut out = Changed { from: c.serving.len(), to: c.serving.len(), ..Changed::default() };
        if c.serving.len() <= min {
            return out;
        }
        let set = st.replicas();
        let Some(r) = set
            .iter()
            .filter(|r| r.is_local() && r.phase() == Phase::Ready)
            .min_by_key(|r| (r.load().outstanding, std::cmp::Reverse(r.id)))
        else {
            return out;
        };
        if to_standby && r.demote() {
            self.record(pipe, st, Some(r.id), EventKind::Standby, "load fell".into());
            out.to_standby = 1;
        } else if !to_standby && r.drain() {
            self.record(pipe, st, Some(r.id), EventKind::Draining, "load fell".into());
            out.draining.push(r.id);
        }
        out.to = census(st).serving.len();
        out
    }

    /// `n` local standbys: start missing ones as standbys; drain extra ones
    /// (those still starting first).
    fn set_standbys(&self, pipe: &Arc<PipelineRt>, st: &StageRt, n: usize) -> Changed {
        let c = census(st);
        let mut out = Changed { from: c.serving.len(), to: c.serving.len(), ..Changed::default() };
        if c.standby < n {
            out.added = self.add(pipe, st, n - c.standby, true);
        } else {
            for r in st.standbys_warm_first().into_iter().rev().take(c.standby - n) {
                if r.drain() {
                    self.record(pipe, st, Some(r.id), EventKind::Draining, "standby placed elsewhere".into());
                    out.draining.push(r.id);
                }
            }
        }
        out
    }

    /// Keep one remote replica here per replica placed on each other node,
    /// and one remote standby per standby there; a remote standby whose
    /// node now serves the stage is promoted (its standby became the
    /// replica); drain those of nodes that left or lost them.
    fn set_remote(&self, pipe: &Arc<PipelineRt>, st: &StageRt, nodes: &BTreeMap<String, Elsewhere>) -> Changed {
        let set = st.replicas();
        let mut out = Changed::default();
        // (node, is a standby) -> kept
        let mut have: BTreeMap<(&str, bool), usize> = BTreeMap::new();
        let live = set.iter().filter(|r| r.phase().will_serve());
        let (standbys, serving): (Vec<_>, Vec<_>) = live.filter(|r| r.remote.is_some()).partition(|r| r.is_standby());
        for r in serving.into_iter().chain(standbys) {
            let at = r.remote.as_ref().expect("filtered");
            let there = nodes.get(&at.node).filter(|e| e.addr == at.addr);
            // One placed elsewhere serves on until replaced (see
            // `leave_when_replaced`), unless its node is gone.
            if r.leaving() {
                if there.is_none() && r.drain() {
                    let why = format!("node {} left", at.node);
                    self.record(pipe, st, Some(r.id), EventKind::Draining, why);
                    out.draining.push(r.id);
                }
                continue;
            }
            let kept = |standby: bool| have.get(&(at.node.as_str(), standby)).copied().unwrap_or(0);
            let wants = |standby: bool| there.map_or(0, |e| if standby { e.standby } else { e.serving });
            let role = if !r.is_standby() {
                (kept(false) < wants(false)).then_some(false)
            } else if kept(false) < wants(false) && r.promote() {
                self.record(
                    pipe,
                    st,
                    Some(r.id),
                    EventKind::Promoted,
                    format!("node {} serves the stage now", at.node),
                );
                Some(false)
            } else {
                (kept(true) < wants(true)).then_some(true)
            };
            match role {
                Some(standby) => *have.entry((at.node.as_str(), standby)).or_default() += 1,
                // Still on a node that is a member: the placement moved it.
                None if there.is_some() && !r.is_standby() => {
                    out.draining.push(r.id);
                    let why = format!("the placement moved it off node {}", at.node);
                    self.leave_when_replaced(pipe, st, r.clone(), None, Duration::ZERO, why);
                }
                None => {
                    if r.drain() {
                        let why = format!("node {} left or lost it", at.node);
                        self.record(pipe, st, Some(r.id), EventKind::Draining, why);
                        out.draining.push(r.id);
                    }
                }
            }
        }
        out.from = have.iter().filter(|((_, standby), _)| !standby).map(|(_, n)| n).sum();
        for (name, e) in nodes {
            for standby in [false, true] {
                let want = if standby { e.standby } else { e.serving };
                for _ in have.get(&(name.as_str(), standby)).copied().unwrap_or(0)..want {
                    let at = RemoteAt { node: name.clone(), addr: e.addr };
                    let r = st.add_remote(at, self.arena().ingress(), pipe.epoch, standby);
                    let what = if standby { EventKind::AddedStandby } else { EventKind::Added };
                    self.record(pipe, st, Some(r.id), what, format!("on node {name}"));
                    out.added.push(r.id);
                    self.spawn_replica(pipe, st.index, r, None);
                }
            }
        }
        out.to = nodes.values().map(|e| e.serving).sum();
        out
    }

    fn record(&self, pipe: &PipelineRt, st: &StageRt, replica: Option<u32>, what: EventKind, detail: String) {
        self.events().record(pipe.name(), &st.name, replica, what, detail);
    }
}
