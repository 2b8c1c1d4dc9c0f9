//! Where a deployment's replicas run: a balanced placement that moves as
//! little as it can when nodes come and go.
//!
//! Each stage declares its replica count for the whole cluster. The
//! placement keeps what the previous one had on nodes that are still
//! members, takes replicas off nodes that left (or the fullest nodes, when
//! a count shrank), gives missing ones to the nodes with the fewest of that
//! stage (then the fewest replicas overall), and finally moves one replica
//! at a time from a stage's fullest node to its emptiest while they differ
//! by more than one; then the same over the nodes' totals (moving a stage
//! the fullest node holds more of). A node that joins or rejoins therefore
//! gets work, and a
//! healthy cluster's placement does not churn. This is the simple balanced
//! placement the cluster starts with; the planner's cost model
//! (`docs/design/planner.md`) can replace the counts later. A stage that
//! one node's loss would empty gets a warm standby on another node
//! ([`standbys`]), which becomes its replica when that node is lost
//! ([`adopt_standbys`]). The record the cluster stores in etcd (epoch,
//! deployment, writer) is the cluster's.

use std::cmp::Reverse;
use std::collections::BTreeMap;

/// Per stage ("pipeline/stage"), replicas per node.
pub type Assignment = BTreeMap<String, BTreeMap<String, u32>>;

/// Place `want` (stage -> replicas in the cluster) on `nodes` (the live
/// members), starting from `prev`.
pub fn place(want: &BTreeMap<String, u32>, nodes: &[String], prev: Option<&Assignment>) -> Assignment {
    let mut out = Assignment::new();
    if nodes.is_empty() {
        return out;
    }
    // Replicas per node over all stages, for spreading ties.
    let mut total: BTreeMap<&str, u32> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
    let mut per_stage: Vec<(&String, BTreeMap<&str, u32>)> = Vec::new();
    for (stage, &n) in want {
        let mut counts: BTreeMap<&str, u32> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
        if let Some(p) = prev.and_then(|p| p.get(stage)) {
            for (node, &c) in p {
                if let Some(slot) = counts.get_mut(node.as_str()) {
                    *slot = c;
                }
            }
        }
        // Too many (count lowered): off the fullest nodes.
        while counts.values().sum::<u32>() > n {
            let fullest =
                *counts.iter().max_by_key(|(id, &c)| (c, std::cmp::Reverse(*id))).map(|(id, _)| id).expect("nodes");
            *counts.get_mut(fullest).expect("present") -= 1;
        }
        for (id, c) in &counts {
            *total.get_mut(id).expect("present") += c;
        }
        per_stage.push((stage, counts));
    }
    for (stage, counts) in &mut per_stage {
        let n = want[*stage];
        // Missing ones (new stage, nodes left): to the emptiest nodes.
        while counts.values().sum::<u32>() < n {
            let emptiest = *counts.iter().min_by_key(|(id, &c)| (c, total[*id], *id)).map(|(id, _)| id).expect("nodes");
            *counts.get_mut(emptiest).expect("present") += 1;
            *total.get_mut(emptiest).expect("present") += 1;
        }
        // Balance: one move at a time while two nodes differ by more than one.
        loop {
            let (&hi, &hc) = counts.iter().max_by_key(|(id, &c)| (c, std::cmp::Reverse(total[*id]))).expect("nodes");
            let (&lo, &lc) = counts.iter().min_by_key(|(id, &c)| (c, total[*id], *id)).expect("nodes");
            if hc <= lc + 1 {
                break;
            }
            *counts.get_mut(hi).expect("present") -= 1;
            *counts.get_mut(lo).expect("present") += 1;
            *total.get_mut(hi).expect("present") -= 1;
            *total.get_mut(lo).expect("present") += 1;
        }
    }
    // Balance the nodes' totals too (a node that joins a balanced cluster
    // gets work): move a replica from the fullest node to the emptiest, of
    // a stage the fullest holds more of (so no stage gets less balanced),
    // while their totals differ by more than one.
    loop {
        let (&hi, &ht) = total.iter().max_by_key(|(id, &t)| (t, std::cmp::Reverse(*id))).expect("nodes");
        let (&lo, &lt) = total.iter().min_by_key(|(id, &t)| (t, *id)).expect("nodes");
        if ht <= lt + 1 {
            break;
        }
        let movable = per_stage
            .iter_mut()
            .filter(|(_, c)| c[hi] > c[lo])
            .max_by_key(|(stage, c)| (c[hi] - c[lo], std::cmp::Reverse(*stage)));
        let Some((_, counts)) = movable else { break };
        *counts.get_mut(hi).expect("present") -= 1;
        *counts.get_mut(lo).expect("present") += 1;
        *total.get_mut(hi).expect("present") -= 1;
        *total.get_mut(lo).expect("present") += 1;
    }
    for (stage, counts) in per_stage {
        out.insert(stage.clone(), counts.iter().filter(|(_, &c)| c > 0).map(|(id, &c)| (id.to_string(), c)).collect());
    }
    out
}

/// Per stage that reads affinity groups, the bytes of those groups each
/// node holds (node -> bytes).
pub type DataAt = BTreeMap<String, BTreeMap<String, u64>>;

/// [`place`], then data first: a stage that reads affinity groups gets a
/// replica on the nodes holding its groups. While a node holding some of
/// its data has none of its replicas, one moves there from the node where
/// it is least missed: one with two or more (the least data first), else
/// one holding under half as much data. Each move covers more of the data
/// with a replica, so it ends; and the factor of two keeps the placement
/// from flapping while the amounts held change a little.
pub fn place_near(
    want: &BTreeMap<String, u32>,
    nodes: &[String],
    prev: Option<&Assignment>,
    data: &DataAt,
) -> Assignment {
    let mut out = place(want, nodes, prev);
    for (stage, held) in data {
        let at = |n: &str| held.get(n).copied().unwrap_or(0);
        while let Some(counts) = out.get(stage) {
            let count = |n: &str| counts.get(n).copied().unwrap_or(0);
            let uncovered = nodes.iter().filter(|n| at(n) > 0 && count(n) == 0).max_by_key(|n| (at(n), Reverse(*n)));
            let Some(home) = uncovered else { break };
            let donor = nodes
                .iter()
                .filter(|n| count(n) >= 2 || (count(n) == 1 && at(n).saturating_mul(2) < at(home)))
                .min_by_key(|n| (count(n) < 2, at(n), *n));
            let Some(donor) = donor else { break };
            let (home, donor) = (home.clone(), donor.clone());
            move_one(&mut out, stage, &donor, &home);
            // Keep the nodes' totals as `place` balances them (else the next
            // placement would move this replica back): a replica of another
            // stage the new home holds more of goes the other way, never
            // one that is the last near its own data.
            let total = |a: &Assignment, n: &str| a.values().map(|c| c.get(n).copied().unwrap_or(0)).sum::<u32>();
            if total(&out, &home) > total(&out, &donor) + 1 {
                let c = |a: &Assignment, t: &str, n: &str| a.get(t).and_then(|m| m.get(n)).copied().unwrap_or(0);
                let back = out
                    .keys()
                    .filter(|t| *t != stage && c(&out, t, &home) > c(&out, t, &donor))
                    .filter(|t| {
                        c(&out, t, &home) > 1 || data.get(*t).and_then(|d| d.get(&home)).copied().unwrap_or(0) == 0
                    })
                    .max_by_key(|t| (c(&out, t, &home) - c(&out, t, &donor), Reverse(*t)))
                    .cloned();
                if let Some(t) = back {
                    move_one(&mut out, &t, &home, &donor);
                }
            }
        }
    }
    out
}

/// The planner's placement (`slipstream plan --nodes`, deployed with
/// `--plan`) for the stages it names, over what [`place_near`] chose: a
/// planned stage runs its planned count on each planned node that is a
/// member, as many as `want` allows (fewer when the count was lowered:
/// off the nodes with the most), and replicas planned on nodes that are
/// not members go where `prev` had more of the stage than the plan (a
/// standby adopted there, say), else to the live nodes with the fewest of
/// it, then the fewest replicas. The plan weighs each node's cores, so the
/// replica-count balancing must not undo it; stages the plan does not name
/// keep the balanced placement.
pub fn follow_plan(
    mut placed: Assignment,
    want: &BTreeMap<String, u32>,
    nodes: &[String],
    prev: Option<&Assignment>,
    planned: &Assignment,
) -> Assignment {
    if nodes.is_empty() {
        return placed;
    }
    for (stage, plan) in planned {
        let Some(&n) = want.get(stage) else { continue };
        let mut counts: BTreeMap<&str, u32> = nodes.iter().map(|k| (k.as_str(), 0)).collect();
        for (node, &c) in plan {
            if let Some(slot) = counts.get_mut(node.as_str()) {
                *slot = c;
            }
        }
        while counts.values().sum::<u32>() > n {
            let fullest = *counts.iter().max_by_key(|(k, &c)| (c, Reverse(*k))).map(|(k, _)| k).expect("nodes");
            *counts.get_mut(fullest).expect("present") -= 1;
        }
        let before = |k: &str| prev.and_then(|p| p.get(stage)).and_then(|m| m.get(k)).copied().unwrap_or(0);
        let total = |k: &str| placed.values().map(|m| m.get(k).copied().unwrap_or(0)).sum::<u32>();
        while counts.values().sum::<u32>() < n {
            let to =
                *counts.iter().min_by_key(|(k, &c)| (before(k) <= c, c, total(k), *k)).map(|(k, _)| k).expect("nodes");
            *counts.get_mut(to).expect("present") += 1;
        }
        let counts = counts.into_iter().filter(|(_, c)| *c > 0).map(|(k, c)| (k.to_string(), c)).collect();
        placed.insert(stage.clone(), counts);
    }
    placed
}

/// A standby that stood in becomes the replica it stood in for: where a
/// stage's replicas in `prev` were on nodes that are gone, the missing
/// ones are given first to the live nodes that held its warm standbys in
/// `standby` (each standby becomes one replica), so that [`place`] keeps
/// them there and the node promotes a warm worker instead of starting a
/// cold one elsewhere.
pub fn adopt_standbys(
    want: &BTreeMap<String, u32>,
    nodes: &[String],
    prev: Option<&Assignment>,
    standby: &Assignment,
) -> Assignment {
    let mut out = prev.cloned().unwrap_or_default();
    for (stage, &n) in want {
        let live: u32 =
            out.get(stage).map_or(0, |m| m.iter().filter(|(k, _)| nodes.contains(k)).map(|(_, c)| *c).sum());
        let mut missing = n.saturating_sub(live);
        for (node, &c) in standby.get(stage).into_iter().flatten() {
            if missing == 0 || !nodes.contains(node) {
                continue;
            }
            let take = c.min(missing);
            *out.entry(stage.clone()).or_default().entry(node.clone()).or_insert(0) += take;
            missing -= take;
        }
    }
    out
}

/// Warm standbys, so that losing one node never empties a stage, and
/// those an autoscaler asks for (`extra`: stage -> standbys). A stage
/// whose replicas all sit on one node (a singleton, most often) gets one
/// standby on another live node; a stage in `extra` gets that many (at
/// least), on distinct nodes. Nodes are chosen by: not holding the stage's
/// replicas (required for the failover standby), then keeping where
/// `prev` had them (no churn), then the fewest replicas and standbys
/// placed, then the smallest name. A standby is a worker started and
/// warmed up but held back from routing; it takes work only when no
/// serving replica of its stage can (see the core's routing), and it
/// becomes the stage's next replica ([`adopt_standbys`]): when a node with
/// one is lost, or when the stage grows. None where there is no room (no
/// other node). Without `failover`, only the ones in `extra`.
pub fn standbys(
    serving: &Assignment,
    nodes: &[String],
    prev: Option<&Assignment>,
    extra: &BTreeMap<String, u32>,
    failover: bool,
) -> Assignment {
    let mut load: BTreeMap<&str, u32> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
    for counts in serving.values() {
        for (node, c) in counts {
            if let Some(l) = load.get_mut(node.as_str()) {
                *l += c;
            }
        }
    }
    let empty = BTreeMap::new();
    let stages: std::collections::BTreeSet<&String> = serving.keys().chain(extra.keys()).collect();
    let mut out = Assignment::new();
    for stage in stages {
        let counts = serving.get(stage).unwrap_or(&empty);
        let hosts = |n: &str| counts.get(n).copied().unwrap_or(0) > 0;
        let lone = failover && counts.values().filter(|&&c| c > 0).count() == 1;
        let asked = extra.get(stage).copied().unwrap_or(0) as usize;
        let kept = |n: &str| prev.and_then(|p| p.get(stage)).is_some_and(|m| m.contains_key(n));
        let mut candidates: Vec<&str> = load.keys().copied().collect();
        candidates.sort_by_key(|n| (hosts(n), !kept(n), load[n], *n));
        let mut chosen: Vec<&str> = Vec::new();
        if lone {
            chosen.extend(candidates.iter().copied().filter(|n| !hosts(n)).take(1));
        }
        for n in candidates {
            if chosen.len() >= asked {
                break;
            }
            if !chosen.contains(&n) {
                chosen.push(n);
            }
        }
        if chosen.is_empty() {
            continue;
        }
        let m = out.entry(stage.clone()).or_default();
        for n in chosen {
            *load.get_mut(n).expect("a live node") += 1;
            m.insert(n.to_string(), 1);
        }
    }
    out
}

/// Move one replica of `stage` from node `from` to node `to`.
fn move_one(a: &mut Assignment, stage: &str, from: &str, to: &str) {
    let counts = a.entry(stage.to_string()).or_default();
    if let Some(left) = counts.get_mut(from) {
        *left -= 1;
        if *left == 0 {
            counts.remove(from);
        }
        *counts.entry(to.to_string()).or_insert(0) += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(v: &[(&str, u32)]) -> BTreeMap<String, u32> {
        v.iter().map(|(s, n)| (s.to_string(), *n)).collect()
    }

    fn nodes(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn sum(a: &Assignment, stage: &str) -> u32 {
        a[stage].values().sum()
    }

    fn data(stage: &str, v: &[(&str, u64)]) -> DataAt {
        [(stage.to_string(), v.iter().map(|(n, b)| (n.to_string(), *b)).collect())].into()
    }

    #[test]
    fn a_stage_that_reads_groups_goes_where_they_are_and_stays() {
        let w = want(&[("p/a", 1), ("p/b", 2)]);
        let all = nodes(&["n1", "n2", "n3"]);
        let plain = place(&w, &all, None);
        let home = all.iter().find(|n| !plain["p/a"].contains_key(*n)).unwrap().clone();
        // The groups live on a node without the replica: it moves there.
        let near = place_near(&w, &all, Some(&plain), &data("p/a", &[(&home, 1000)]));
        assert_eq!(near["p/a"], [(home.clone(), 1)].into(), "{near:?}");
        assert_eq!(sum(&near, "p/b"), 2);
        // Placed again from there, nothing moves (no flapping)...
        assert_eq!(place_near(&w, &all, Some(&near), &data("p/a", &[(&home, 1000)])), near);
        // ...nor when another node holds a little more than half as much.
        let other = all.iter().find(|n| **n != home).unwrap();
        let close = data("p/a", &[(&home, 1000), (other, 1500)]);
        assert_eq!(place_near(&w, &all, Some(&near), &close)["p/a"], near["p/a"]);
        // Twice as much elsewhere: it follows the data.
        let far = data("p/a", &[(&home, 1000), (other, 2500)]);
        assert_eq!(place_near(&w, &all, Some(&near), &far)["p/a"], [(other.clone(), 1)].into());
    }

    #[test]
    fn replicas_spread_over_the_nodes_holding_data_before_doubling_up() {
        let w = want(&[("p/a", 2)]);
        let all = nodes(&["n1", "n2", "n3"]);
        let prev: Assignment = [("p/a".to_string(), [("n1".to_string(), 2)].into())].into();
        let held = data("p/a", &[("n2", 10), ("n3", 20)]);
        let a = place_near(&w, &all, Some(&prev), &held);
        assert_eq!(sum(&a, "p/a"), 2);
        assert!(a["p/a"].contains_key("n3"), "{a:?}");
        // No data anywhere: the plain placement.
        assert_eq!(place_near(&w, &all, Some(&prev), &DataAt::new()), place(&w, &all, Some(&prev)));
    }

    #[test]
    fn a_singleton_stage_gets_a_standby_elsewhere_and_it_takes_over() {
        let w = want(&[("p/a", 1), ("p/b", 3)]);
        let all = nodes(&["n1", "n2", "n3"]);
        let a = place(&w, &all, None);
        let none = BTreeMap::new();
        let sb = standbys(&a, &all, None, &none, true);
        assert!(!sb.contains_key("p/b"), "a spread stage needs none: {sb:?}");
        let home = a["p/a"].keys().next().unwrap().clone();
        let spare = sb["p/a"].keys().next().unwrap().clone();
        assert_ne!(home, spare);
        assert_eq!(standbys(&a, &all, Some(&sb), &none, true), sb, "stable");
        // The home node is lost: the standby's node gets the replica...
        let rest: Vec<String> = all.iter().filter(|n| **n != home).cloned().collect();
        let prev = adopt_standbys(&w, &rest, Some(&a), &sb);
        let b = place(&w, &rest, Some(&prev));
        assert_eq!(b["p/a"], [(spare.clone(), 1)].into(), "{b:?}");
        // ...and a new standby goes to the other survivor.
        let sb2 = standbys(&b, &rest, Some(&sb), &none, true);
        let other = rest.iter().find(|n| **n != spare).unwrap();
        assert_eq!(sb2["p/a"], [(other.clone(), 1)].into());
        // One node: nowhere to stand by.
        assert!(standbys(&place(&w, &nodes(&["n1"]), None), &nodes(&["n1"]), None, &none, true).is_empty());
        // Nothing lost: adopting changes nothing.
        assert_eq!(adopt_standbys(&w, &all, Some(&a), &sb), a);
    }

    #[test]
    fn an_autoscaler_s_standby_goes_first_to_a_node_without_the_stage_and_becomes_its_next_replica() {
        let w = want(&[("p/a", 2), ("p/b", 1)]);
        let all = nodes(&["n1", "n2", "n3"]);
        let a = place(&w, &all, None);
        let extra: BTreeMap<String, u32> = [("p/a".to_string(), 1)].into();
        let sb = standbys(&a, &all, None, &extra, true);
        let spare = sb["p/a"].keys().next().unwrap().clone();
        assert!(!a["p/a"].contains_key(&spare), "{a:?} {sb:?}");
        assert_eq!(sb["p/b"].len(), 1, "the singleton keeps its own");
        // The stage grows by one: the new replica goes where the standby was.
        let grown = want(&[("p/a", 3), ("p/b", 1)]);
        let b = place(&grown, &all, Some(&adopt_standbys(&grown, &all, Some(&a), &sb)));
        assert_eq!(b["p/a"].get(&spare), Some(&1), "{b:?}");
        // Two asked, one node left without the stage: the other is doubled up.
        let two: BTreeMap<String, u32> = [("p/a".to_string(), 2)].into();
        assert_eq!(standbys(&a, &all, None, &two, true)["p/a"].len(), 2);
    }

    #[test]
    fn spreads_evenly_and_keeps_counts() {
        let a = place(&want(&[("p/a", 3), ("p/b", 1), ("p/c", 1), ("p/d", 1)]), &nodes(&["n1", "n2", "n3"]), None);
        assert_eq!(a["p/a"].values().copied().collect::<Vec<_>>(), vec![1, 1, 1]);
        for s in ["p/b", "p/c", "p/d"] {
            assert_eq!(sum(&a, s), 1);
        }
        // The single-replica stages land on different nodes.
        let homes: std::collections::BTreeSet<&String> =
            ["p/b", "p/c", "p/d"].iter().flat_map(|s| a[*s].keys()).collect();
        assert_eq!(homes.len(), 3, "{a:?}");
    }

    #[test]
    fn a_lost_node_s_replicas_move_and_a_rejoin_takes_work_back() {
        let w = want(&[("p/a", 3), ("p/b", 2)]);
        let all = nodes(&["n1", "n2", "n3"]);
        let a = place(&w, &all, None);
        let b = place(&w, &nodes(&["n1", "n3"]), Some(&a));
        assert_eq!(sum(&b, "p/a"), 3);
        assert_eq!(sum(&b, "p/b"), 2);
        assert!(b.values().all(|m| !m.contains_key("n2")));
        // What survived stays where it was.
        for (stage, m) in &a {
            for (node, &c) in m {
                if node != "n2" {
                    assert!(b[stage].get(node).copied().unwrap_or(0) >= c, "{stage} moved off {node}: {a:?} -> {b:?}");
                }
            }
        }
        let c = place(&w, &all, Some(&b));
        assert_eq!(c["p/a"].get("n2"), Some(&1), "the rejoined node gets a replica back: {c:?}");
        // Stable: placing again changes nothing.
        assert_eq!(place(&w, &all, Some(&c)), c);
    }

    #[test]
    fn a_node_that_joins_a_balanced_cluster_gets_work() {
        let w = want(&[("p/a", 3), ("p/b", 2), ("p/c", 2), ("p/d", 3)]);
        let three = place(&w, &nodes(&["n1", "n2", "n3"]), None);
        let four = place(&w, &nodes(&["n1", "n2", "n3", "n4"]), Some(&three));
        let on = |a: &Assignment, n: &str| a.values().map(|m| m.get(n).copied().unwrap_or(0)).sum::<u32>();
        let totals: Vec<u32> = ["n1", "n2", "n3", "n4"].iter().map(|n| on(&four, n)).collect();
        assert!(totals.iter().max().unwrap() - totals.iter().min().unwrap() <= 1, "{totals:?} {four:?}");
        for (stage, &n) in &w {
            assert_eq!(sum(&four, stage), n);
            let c: Vec<u32> =
                ["n1", "n2", "n3", "n4"].iter().map(|x| four[stage].get(*x).copied().unwrap_or(0)).collect();
            assert!(c.iter().max().unwrap() - c.iter().min().unwrap() <= 1, "{stage}: {c:?}");
        }
        assert_eq!(place(&w, &nodes(&["n1", "n2", "n3", "n4"]), Some(&four)), four, "stable");
    }

    #[test]
    fn a_planned_stage_follows_the_plan_on_its_live_nodes_and_the_rest_stay_balanced() {
        let planned: Assignment =
            [("p/A".to_string(), [("big".to_string(), 3), ("small".to_string(), 1)].into_iter().collect())]
                .into_iter()
                .collect();
        let wanted = want(&[("p/A", 4), ("p/B", 2)]);
        let all = nodes(&["big", "small"]);
        let placed = place(&wanted, &all, None);
        let a = follow_plan(placed, &wanted, &all, None, &planned);
        assert_eq!(a["p/A"], [("big".to_string(), 3), ("small".to_string(), 1)].into_iter().collect());
        assert_eq!(sum(&a, "p/B"), 2, "an unplanned stage keeps its count");
        // A count lowered (the autoscaler's): off the fullest planned node.
        let fewer = want(&[("p/A", 2), ("p/B", 2)]);
        let a = follow_plan(place(&fewer, &all, None), &fewer, &all, None, &planned);
        assert_eq!(a["p/A"], [("big".to_string(), 1), ("small".to_string(), 1)].into_iter().collect());
        // "big" lost: its 3 go to the live nodes, first where the previous
        // placement had more than the plan (an adopted standby).
        let live = nodes(&["small", "spare"]);
        let prev: Assignment =
            [("p/A".to_string(), [("small".to_string(), 1), ("spare".to_string(), 1)].into_iter().collect())]
                .into_iter()
                .collect();
        let a = follow_plan(place(&wanted, &live, Some(&prev)), &wanted, &live, Some(&prev), &planned);
        assert_eq!(sum(&a, "p/A"), 4);
        assert!(a["p/A"]["spare"] >= 1 && !a["p/A"].contains_key("big"));
        assert!(follow_plan(Assignment::new(), &wanted, &[], None, &planned).is_empty());
    }

    #[test]
    fn shrinking_takes_from_the_fullest_and_no_nodes_places_nothing() {
        let w = want(&[("p/a", 4)]);
        let two = nodes(&["n1", "n2"]);
        let a = place(&w, &two, None);
        let b = place(&want(&[("p/a", 1)]), &two, Some(&a));
        assert_eq!(sum(&b, "p/a"), 1);
        assert!(place(&w, &[], Some(&a)).is_empty());
    }
}
