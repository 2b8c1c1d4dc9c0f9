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
use std::time::Duration;

/// How long a replica the cluster placed elsewhere keeps serving before it
/// drains (other nodes apply the new placement within this).
const PLACEMENT_GRACE: Duration = Duration::from_secs(2);

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
    /// The replicas other nodes run (node -> (its data plane, replicas
    /// placed there)): one remote replica here per replica placed there.
    Remote(&'a BTreeMap<String, (SocketAddr, usize)>),
    /// An autoscaler's step.
    Scale(ScaleAction),
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
                    r.mark_leaving();
                    self.record(pipe, st, Some(r.id), EventKind::Leaving, "placed elsewhere".into());
                    let events = self.events().clone();
                    let (pipe, stage) = (pipe.name().to_string(), st.name.clone());
                    out.draining.push(r.id);
                    tokio::spawn(async move {
                        tokio::time::sleep(PLACEMENT_GRACE).await;
                        if r.drain() {
                            events.record(&pipe, &stage, Some(r.id), EventKind::Draining, "placed elsewhere".into());
                        }
                    });
                } else if r.drain() {
                    self.record(pipe, st, Some(r.id), EventKind::Draining, "scaled down".into());
                    out.draining.push(r.id);
                }
            }
        }
        out.to = census(st).serving.len();
        out
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

    /// Keep one remote replica here per replica placed on each other node;
    /// drain those of nodes that left or lost them.
    fn set_remote(
        &self,
        pipe: &Arc<PipelineRt>,
        st: &StageRt,
        nodes: &BTreeMap<String, (SocketAddr, usize)>,
    ) -> Changed {
        let set = st.replicas();
        let mut out = Changed::default();
        let mut have: BTreeMap<&str, usize> = BTreeMap::new();
        for r in set.iter().filter(|r| r.phase().will_serve()) {
            let Some(at) = &r.remote else { continue };
            let keep = nodes
                .get(&at.node)
                .is_some_and(|(addr, n)| *addr == at.addr && have.get(at.node.as_str()).copied().unwrap_or(0) < *n);
            if keep {
                *have.entry(at.node.as_str()).or_default() += 1;
            } else if r.drain() {
                let why = format!("node {} left or lost it", at.node);
                self.record(pipe, st, Some(r.id), EventKind::Draining, why);
                out.draining.push(r.id);
            }
        }
        out.from = have.values().sum();
        for (name, (addr, n)) in nodes {
            for _ in have.get(name.as_str()).copied().unwrap_or(0)..*n {
                let at = RemoteAt { node: name.clone(), addr: *addr };
                let r = st.add_remote(at, self.arena().ingress(), pipe.epoch);
                self.record(pipe, st, Some(r.id), EventKind::Added, format!("on node {name}"));
                out.added.push(r.id);
                self.spawn_replica(pipe, st.index, r, None);
            }
        }
        out.to = nodes.values().map(|(_, n)| n).sum();
        out
    }

    fn record(&self, pipe: &PipelineRt, st: &StageRt, replica: Option<u32>, what: EventKind, detail: String) {
        self.events().record(pipe.name(), &st.name, replica, what, detail);
    }
}
