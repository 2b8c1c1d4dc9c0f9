//! What happened to the node's replicas, and why: a bounded ring of recent
//! events (a replica started, became ready, died, was restarted, drained,
//! removed; a stage was scaled), shown by `/v1/status` and `slipstream
//! status`, and echoed to the log. Operators and the fault soak read the
//! times here to line up what they see in latency with what the node did.

use parking_lot::Mutex;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

/// Events kept; older ones are dropped.
const KEEP: usize = 256;

#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Increases by one per event, for readers that poll.
    pub seq: u64,
    /// Wall-clock time, ms since the Unix epoch.
    pub unix_ms: u64,
    pub pipeline: String,
    pub stage: String,
    /// The replica's id within its stage, when the event is about one.
    pub replica: Option<u32>,
    pub what: &'static str,
    pub detail: String,
}

pub struct Events {
    ring: Mutex<(u64, VecDeque<Event>)>,
    log: bool,
}

impl Events {
    /// `log`: echo each event to stderr.
    pub fn new(log: bool) -> Events {
        Events { ring: Mutex::new((0, VecDeque::with_capacity(KEEP))), log }
    }

    pub fn record(&self, pipeline: &str, stage: &str, replica: Option<u32>, what: &'static str, detail: String) {
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        if self.log {
            let who = replica.map_or(String::new(), |r| format!("[{r}]"));
            let sep = if detail.is_empty() { "" } else { ": " };
            eprintln!("slipstream: {pipeline}/{stage}{who} {what}{sep}{detail}");
        }
        let mut ring = self.ring.lock();
        ring.0 += 1;
        let seq = ring.0;
        if ring.1.len() == KEEP {
            ring.1.pop_front();
        }
        ring.1.push_back(Event { seq, unix_ms, pipeline: pipeline.into(), stage: stage.into(), replica, what, detail });
    }

    /// The events kept, oldest first.
    pub fn recent(&self) -> Vec<Event> {
        self.ring.lock().1.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_recent_in_order() {
        let e = Events::new(false);
        for i in 0..(KEEP + 10) {
            e.record("p", "s", Some(1), "ready", format!("{i}"));
        }
        let r = e.recent();
        assert_eq!(r.len(), KEEP);
        assert_eq!(r[0].seq, 11);
        assert_eq!(r.last().unwrap().detail, format!("{}", KEEP + 9));
    }
}
