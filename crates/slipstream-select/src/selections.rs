//! Every pipeline's selections, as the node's edge and reports see them:
//! feedback on answers (`POST /v1/pipelines/{name}/feedback`), the
//! policies' state (`GET /v1/pipelines/{name}/select`, `/v1/status`) and
//! their counters in `/metrics`.

use crate::{parse_feedback, FeedbackError, Selector, MAX_HELD};
use serde_json::{json, Value};
use slipstream_core::ext::{Service, StatusDoc};
use slipstream_core::join::JoinPolicy;
use slipstream_core::prom::PromText;
use slipstream_core::NodeError;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Each pipeline's selectors (none for a pipeline without selections).
#[derive(Default)]
pub struct Selections {
    by_pipeline: BTreeMap<String, Vec<Arc<Selector>>>,
}

impl Selections {
    /// Add pipeline `pipeline` with its `selectors`.
    pub fn add(&mut self, pipeline: &str, selectors: Vec<Arc<Selector>>) {
        self.by_pipeline.insert(pipeline.to_string(), selectors);
    }

    fn of(&self, pipeline: &str) -> &[Arc<Selector>] {
        self.by_pipeline.get(pipeline).map_or(&[], Vec::as_slice)
    }

    /// The policies' state of `pipeline`'s selections (in `context`, or
    /// the default one).
    pub fn report(&self, pipeline: &str, context: Option<&str>) -> Value {
        json!({"selects": self.of(pipeline).iter().map(|s| s.report(context)).collect::<Vec<_>>()})
    }

    /// Apply a feedback body to `pipeline`'s selections. One item: Err if
    /// it is invalid or its request unknown; a batch (`{"feedback": [..]}`):
    /// counts of what was applied, unknown and invalid.
    pub fn feedback(&self, pipeline: &str, body: &[u8]) -> Result<Value, NodeError> {
        let selects = self.of(pipeline);
        if selects.is_empty() {
            return Err(NodeError::BadRequest(format!(
                "pipeline '{pipeline}' has no model selection (ss.Select) to take feedback"
            )));
        }
        let (items, batch) = parse_feedback(body).map_err(NodeError::BadRequest)?;
        if let Some(name) =
            items.iter().filter_map(|f| f.select.as_deref()).find(|n| !selects.iter().any(|s| s.name() == *n))
        {
            return Err(NodeError::BadRequest(format!("pipeline '{pipeline}' has no selection '{name}'")));
        }
        let (mut applied, mut unknown, mut invalid) = (0u64, 0u64, Vec::new());
        for f in &items {
            let mut outcome = Err(FeedbackError::Unknown);
            for sel in selects.iter().filter(|s| f.select.as_ref().is_none_or(|n| *n == s.name())) {
                match sel.feedback(f.request_id, &f.truth) {
                    Err(FeedbackError::Unknown) => {}
                    other => outcome = other,
                }
            }
            match outcome {
                Ok(()) => applied += 1,
                Err(FeedbackError::Unknown) => unknown += 1,
                Err(FeedbackError::Invalid(why)) => invalid.push(format!("request {}: {why}", f.request_id)),
            }
        }
        if !batch {
            if let Some(why) = invalid.pop() {
                return Err(NodeError::BadRequest(why));
            }
            if unknown > 0 {
                return Err(NodeError::NotFound(format!(
                    "no prediction of request {} is held: it was never made, already has feedback, or is older than \
                     the last {MAX_HELD} predictions",
                    items[0].request_id
                )));
            }
        }
        Ok(json!({"applied": applied, "unknown": unknown, "invalid": invalid.len(), "errors": invalid}))
    }
}

impl Service for Selections {
    fn status(&self, doc: &mut StatusDoc) {
        for (p, selects) in &self.by_pipeline {
            doc.set_pipeline(p, "selects", json!(selects.iter().map(|s| s.report(None)).collect::<Vec<_>>()));
        }
    }

    fn metrics(&self, t: &mut PromText) {
        for (p, selects) in &self.by_pipeline {
            for sel in selects {
                let l = [("pipeline", p.as_str()), ("select", sel.name())];
                for (name, help, v) in [
                    ("slipstream_select_feedback_total", "Feedback applied to the selection's policy.", &sel.feedback),
                    (
                        "slipstream_select_unknown_feedback_total",
                        "Feedback on requests whose predictions are not held.",
                        &sel.unknown_feedback,
                    ),
                    (
                        "slipstream_select_cut_short_total",
                        "Ensembles answered at their straggler cutoff with some candidates missing.",
                        &sel.cut_short,
                    ),
                    (
                        "slipstream_select_late_total",
                        "Candidate answers that came after their ensemble answered.",
                        &sel.late,
                    ),
                ] {
                    t.counter(name, help, &l, v.load(Relaxed));
                }
                for ((cand, w), picks) in sel.spec.candidates.iter().zip(sel.weights()).zip(&sel.picks) {
                    let lc = [l[0], l[1], ("candidate", cand.as_str())];
                    let help = "The policy's weight of each candidate (default context).";
                    t.gauge("slipstream_select_weight", help, &lc, w);
                    t.counter(
                        "slipstream_select_picks_total",
                        "Requests each candidate ran for.",
                        &lc,
                        picks.load(Relaxed),
                    );
                }
            }
        }
    }
}
