//! A graceful stop hands this node's stages over before it leaves.
//!
//! Revoking the lease at once (what a stop did first) makes the others
//! stop routing here at once, but the leader then has to place what ran
//! here elsewhere, and until that replica is ready a stage this node held
//! alone has nothing serving it: a warm standby stands in, unless the
//! rolling restart that is stopping this node has just restarted the
//! standby's node too, or a call in flight here times out as this node
//! drains and its retry finds no other replica (both seen as single 503s
//! in rolling restarts under load).
//!
//! So a stop first takes this node out of what the leader places: a
//! [`Cordon`] record under its own lease (it goes with the lease, so it
//! never outlives this incarnation). The leader places the stages
//! elsewhere (a warm standby is promoted where it is), and this node keeps
//! serving everything sent to it meanwhile. Once every stage that had a
//! replica here (placed, or still serving after a move: [`serving_here`])
//! is reported ready by another member, or after a bounded wait, the node
//! leaves as before. This is the path a placement change
//! under load already takes (tests/integration/test_cluster.py), started
//! by the node itself instead of by a scale-down.

use crate::{seal, Cluster, Cordon, View};

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// The stages (`pipeline/stage`) with a serving replica on `me` in the
/// placement of `deploy`: what another member must serve before `me` leaves.
pub(crate) fn held(view: &View, me: &str, deploy: &str) -> BTreeSet<String> {
    let Some(p) = view.placement.as_ref().filter(|p| p.deploy == deploy) else {
        return BTreeSet::new();
    };
    p.stages.keys().filter(|k| p.count(k, me) > 0).cloned().collect()
}

/// What `me` must hand over: the stages placed on it ([`held`]) and those
/// it still serves (its own record's ready replicas), which include a
/// replica a move left serving here until its replacement is ready (the
/// make-before-break of `slipstream_core::scaling`). Without the second,
/// a node stopping just after the leader moved a stage away left before
/// the stage's new replica had started, and the requests at that stage
/// waited for their deadline (seen in a CI run of the image test).
pub(crate) fn serving_here(view: &View, me: &str, deploy: &str) -> BTreeSet<String> {
    let mut out = held(view, me, deploy);
    if let Some(m) = view.members.get(me) {
        out.extend(m.ready.iter().filter(|(_, &n)| n > 0).map(|(k, _)| k.clone()));
    }
    out
}

/// What `me` still waits for before it can leave without emptying one of
/// the stages it was `holding` (see [`held`]); `None` when nothing (or
/// when nowhere else could take them: every member is cordoned, all
/// stopping together).
pub(crate) fn waiting_for(view: &View, me: &str, deploy: &str, holding: &BTreeSet<String>) -> Option<String> {
    if view.members.keys().all(|m| view.cordoned.contains(m)) {
        return None;
    }
    if !view.cordoned.contains(me) {
        return Some("the cordon to come back through the watch".into());
    }
    if let Some(key) = held(view, me, deploy).first() {
        return Some(format!("a placement without {key} here"));
    }
    let elsewhere = |key: &str| {
        view.members
            .iter()
            .any(|(n, m)| n != me && m.ready.get(key).copied().unwrap_or(0) > 0 && !view.suspects.contains(n))
    };
    holding.iter().find(|k| !elsewhere(k)).map(|k| format!("{k} to be ready on another member"))
}

/// Cordon this node and wait (at most `limit`) until every stage it serves
/// is ready elsewhere. Returns what it did, for the log.
pub(crate) async fn hand_over(etcd: &slipstream_etcd::Etcd, cluster: &Cluster, limit: Duration) -> String {
    let started = Instant::now();
    let me = cluster.me().to_string();
    let deploy = cluster.opts.deploy.clone();
    let view = cluster.view();
    let held = serving_here(&view, &me, &deploy);
    if held.is_empty() {
        return "nothing placed here to hand over".into();
    }
    let Some(lease) = view.members.get(&me).map(|m| m.lease).filter(|l| *l != 0) else {
        return "not a member any more: nothing to hand over".into();
    };
    if view.placeable().all(|m| m == me) {
        return "no other member to hand over to".into();
    }
    let key = format!("{}cordon/{me}", cluster.opts.root());
    let record = seal(&cluster.key, "cordon", &Cordon { node: me.clone(), lease });
    match tokio::time::timeout(limit, etcd.put(&key, &record, Some(lease))).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return format!("could not cordon itself ({e}); leaving at once"),
        Err(_) => return "etcd did not take the cordon in time; leaving at once".into(),
    }
    let mut views = cluster.view.subscribe();
    let until = tokio::time::Instant::now() + limit.saturating_sub(started.elapsed());
    loop {
        let why = waiting_for(&views.borrow_and_update(), &me, &deploy, &held);
        let Some(why) = why else {
            return format!("handed {} stage(s) over in {:.2} s", held.len(), started.elapsed().as_secs_f64());
        };
        tokio::select! {
            changed = views.changed() => if changed.is_err() {
                return "the cluster view closed; leaving".into();
            },
            _ = tokio::time::sleep_until(until) => {
                return format!("handing over timed out after {:.1} s waiting for {why}; leaving anyway", limit.as_secs_f64());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{member_for_tests as member, Assignment, Member, Placement};

    fn view(placed: &[(&str, &str, u32)], members: &[Member]) -> View {
        let mut stages = Assignment::new();
        for (k, n, c) in placed {
            stages.entry(k.to_string()).or_default().insert(n.to_string(), *c);
        }
        View {
            members: members.iter().map(|m| (m.node.clone(), m.clone())).collect(),
            placement: Some(Placement {
                deploy: "d".into(),
                epoch: 1,
                stages,
                standby: Default::default(),
                by: "a".into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_node_leaves_once_what_it_held_is_ready_elsewhere() {
        let mut v = view(&[("p/s", "a", 1), ("p/t", "a", 1), ("p/t", "b", 1)], &[member("a", &[]), member("b", &[])]);
        let holding = held(&v, "a", "d");
        assert_eq!(holding, ["p/s".to_string(), "p/t".to_string()].into());
        assert!(held(&v, "a", "other").is_empty(), "another deployment's placement");
        assert!(waiting_for(&v, "a", "d", &holding).unwrap().contains("cordon"));
        v.cordoned.insert("a".into());
        assert!(waiting_for(&v, "a", "d", &holding).unwrap().contains("placement without p/s"));
        // The leader's new placement: everything on b, not ready there yet.
        v = View {
            cordoned: v.cordoned.clone(),
            ..view(&[("p/s", "b", 1), ("p/t", "b", 2)], &[member("a", &[]), member("b", &[("p/t", 1)])])
        };
        assert!(waiting_for(&v, "a", "d", &holding).unwrap().contains("p/s to be ready"));
        v.members.get_mut("b").unwrap().ready.insert("p/s".into(), 1);
        v.suspects.insert("b".into());
        assert!(waiting_for(&v, "a", "d", &holding).is_some(), "a member this node cannot reach does not count");
        v.suspects.clear();
        assert_eq!(waiting_for(&v, "a", "d", &holding), None);
    }

    #[test]
    fn a_stage_moved_away_but_still_served_here_is_handed_over_too() {
        // p/s was moved from a to b; a still serves it until b's is ready.
        let mut v = view(&[("p/s", "b", 1)], &[member("a", &[("p/s", 1)]), member("b", &[])]);
        v.cordoned.insert("a".into());
        let holding = serving_here(&v, "a", "d");
        assert_eq!(holding, ["p/s".to_string()].into());
        assert!(waiting_for(&v, "a", "d", &holding).unwrap().contains("p/s to be ready"));
        v.members.get_mut("b").unwrap().ready.insert("p/s".into(), 1);
        assert_eq!(waiting_for(&v, "a", "d", &holding), None);
    }

    #[test]
    fn nodes_stopping_together_do_not_wait_for_each_other() {
        let mut v = view(&[("p/s", "a", 1), ("p/s", "b", 1)], &[member("a", &[]), member("b", &[])]);
        let holding = held(&v, "a", "d");
        v.cordoned.extend(["a".to_string(), "b".to_string()]);
        assert_eq!(waiting_for(&v, "a", "d", &holding), None);
    }
}
