//! What happened to the node, and why: a bounded ring of recent events (a
//! replica started, became ready, died, was restarted, drained, removed; a
//! stage was scaled or placed; the cluster saw a node fail), shown by
//! `/v1/status` and `slipstream status`, and logged through `tracing`.
//! Operators and the fault soak read the times here to line up what they
//! see in latency with what the node did.
//!
//! Each event has a kind from one enum ([`EventKind`]), so the set of
//! things the node reports is written down once and a reader matches on
//! stable names (`"ready"`, `"died"`, ...), not on free text; the free text
//! is the `detail`.

use parking_lot::Mutex;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

/// Events kept; older ones are dropped.
const KEEP: usize = 256;

/// What an event reports. Serialised (and logged) as its snake_case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A replica joined its stage's set (starting).
    Added,
    /// A replica joined as a standby (warmed up, then held back from routing).
    AddedStandby,
    /// A replica could not be added (no room for its shared-memory pool).
    AddFailed,
    /// A replica's worker could not be started.
    StartFailed,
    /// A replica's warm-up batch ran.
    WarmedUp,
    /// A replica started without a warm-up (its sample could not be copied in).
    WarmUpSkipped,
    /// A replica's warm-up batch raised (the replica serves anyway).
    WarmUpFailed,
    /// A replica serves.
    Ready,
    /// A replica is warm and held back from routing (a standby).
    Standby,
    /// A standby was promoted into routing.
    Promoted,
    /// A replica's worker (or the node it runs on) was lost.
    Died,
    /// A replica takes no new work, finishes its queue and stops.
    Draining,
    /// A replica placed on another node serves a grace period, then drains.
    Leaving,
    /// A replica left its stage's set.
    Removed,
    /// A streaming component sent a chunk that does not fit its batch.
    BadChunk,
    /// An operator changed a stage's replica count.
    Scaled,
    /// The cluster's placement changed this node's replicas of a stage (or
    /// the leader wrote a placement).
    Placed,
    /// A pipeline ran its example request before the node reported ready.
    Primed,
    /// The autoscaler changed a stage's replicas.
    Autoscale,
    /// A store trigger failed for good (recorded in the store).
    TriggerFailed,
    /// Store changes left the change feed before their triggers fired.
    TriggersSkipped,
    /// etcd could not be reached.
    EtcdUnreachable,
    /// The node's membership lease had expired and it joined again.
    Rejoined,
    /// A new deployment replaces the one this node runs.
    Redeploy,
    /// A cluster record was ignored (bad signature or content).
    RecordRefused,
    /// A node's data plane failed here: its replicas are out of routing.
    NodeSuspected,
}

impl EventKind {
    /// The kind's stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Added => "added",
            EventKind::AddedStandby => "added_standby",
            EventKind::AddFailed => "add_failed",
            EventKind::StartFailed => "start_failed",
            EventKind::WarmedUp => "warmed_up",
            EventKind::WarmUpSkipped => "warm_up_skipped",
            EventKind::WarmUpFailed => "warm_up_failed",
            EventKind::Ready => "ready",
            EventKind::Standby => "standby",
            EventKind::Promoted => "promoted",
            EventKind::Died => "died",
            EventKind::Draining => "draining",
            EventKind::Leaving => "leaving",
            EventKind::Removed => "removed",
            EventKind::BadChunk => "bad_chunk",
            EventKind::Scaled => "scaled",
            EventKind::Placed => "placed",
            EventKind::Primed => "primed",
            EventKind::Autoscale => "autoscale",
            EventKind::TriggerFailed => "trigger_failed",
            EventKind::TriggersSkipped => "triggers_skipped",
            EventKind::EtcdUnreachable => "etcd_unreachable",
            EventKind::Rejoined => "rejoined",
            EventKind::Redeploy => "redeploy",
            EventKind::RecordRefused => "record_refused",
            EventKind::NodeSuspected => "node_suspected",
        }
    }
}

/// One event.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Increases by one per event, for readers that poll.
    pub seq: u64,
    /// Wall-clock time, ms since the Unix epoch.
    pub unix_ms: u64,
    /// The pipeline it concerns (`-`: the node).
    pub pipeline: String,
    /// The stage it concerns (`-`: none).
    pub stage: String,
    /// The replica's id within its stage, when the event is about one.
    pub replica: Option<u32>,
    /// What happened.
    pub what: EventKind,
    /// Why, or the details.
    pub detail: String,
}

/// The ring of recent events.
pub struct Events {
    ring: Mutex<(u64, VecDeque<Event>)>,
}

impl Default for Events {
    fn default() -> Self {
        Events { ring: Mutex::new((0, VecDeque::with_capacity(KEEP))) }
    }
}

impl Events {
    /// Record (and log) an event about `pipeline`/`stage` (`-` for none)
    /// and, when it concerns one, `replica`.
    pub fn record(&self, pipeline: &str, stage: &str, replica: Option<u32>, what: EventKind, detail: String) {
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let who = replica.map_or(String::new(), |r| format!("[{r}]"));
        let sep = if detail.is_empty() { "" } else { ": " };
        tracing::info!(
            target: "slipstream::events",
            pipeline,
            stage,
            replica,
            what = what.as_str(),
            "{pipeline}/{stage}{who} {}{sep}{detail}",
            what.as_str()
        );
        let mut ring = self.ring.lock();
        ring.0 += 1;
        let seq = ring.0;
        if ring.1.len() == KEEP {
            ring.1.pop_front();
        }
        ring.1.push_back(Event { seq, unix_ms, pipeline: pipeline.into(), stage: stage.into(), replica, what, detail });
    }

    /// An event about the node as a whole.
    pub fn node(&self, what: EventKind, detail: String) {
        self.record("-", "-", None, what, detail);
    }

    /// The events kept, oldest first.
    pub fn recent(&self) -> Vec<Event> {
        self.ring.lock().1.iter().cloned().collect()
    }

    /// The newest event's seq (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.ring.lock().0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_recent_in_order() {
        let e = Events::default();
        for i in 0..(KEEP + 10) {
            e.record("p", "s", Some(1), EventKind::Ready, format!("{i}"));
        }
        let r = e.recent();
        assert_eq!(r.len(), KEEP);
        assert_eq!(r[0].seq, 11);
        assert_eq!(r.last().unwrap().detail, format!("{}", KEEP + 9));
        assert_eq!(e.last_seq(), KEEP as u64 + 10);
    }

    #[test]
    fn kinds_serialise_as_their_names() {
        for k in [EventKind::AddedStandby, EventKind::Ready, EventKind::NodeSuspected, EventKind::TriggerFailed] {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
        }
    }
}
