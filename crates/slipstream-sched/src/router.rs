//! The ingress router's per-stage choice.
//!
//! Routing is decided once, at ingress, for every stage of a request's route,
//! so the parts of a fan-in are bound for the same replica by construction.
//! The choice is join-shortest-queue: the accepting replica with the fewest
//! outstanding requests; ties are broken by a caller-supplied rotating value
//! so that idle replicas share load instead of the first one taking all.

use crate::predict::ReplicaLoad;

/// Index of the replica to use, or `None` when no replica accepts work.
pub fn choose_replica(loads: &[ReplicaLoad], tiebreak: u64) -> Option<usize> {
    let n = loads.len();
    if n == 0 {
        return None;
    }
    let start = (tiebreak % n as u64) as usize;
    let mut best: Option<(usize, u32)> = None;
    for k in 0..n {
        let i = (start + k) % n;
        let l = loads[i];
        if !l.accepting {
            continue;
        }
        if best.is_none_or(|(_, o)| l.outstanding < o) {
            best = Some((i, l.outstanding));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(accepting: bool, outstanding: u32) -> ReplicaLoad {
        ReplicaLoad { accepting, outstanding, ..Default::default() }
    }

    #[test]
    fn picks_shortest_healthy_queue() {
        let loads = [l(true, 5), l(false, 0), l(true, 2), l(true, 3)];
        for t in 0..8 {
            assert_eq!(choose_replica(&loads, t), Some(2));
        }
    }

    #[test]
    fn ties_rotate() {
        let loads = [l(true, 0), l(true, 0), l(true, 0)];
        let picks: Vec<_> = (0..3).map(|t| choose_replica(&loads, t).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2]);
    }

    #[test]
    fn none_when_all_down() {
        assert_eq!(choose_replica(&[l(false, 0)], 0), None);
        assert_eq!(choose_replica(&[], 0), None);
    }
}
