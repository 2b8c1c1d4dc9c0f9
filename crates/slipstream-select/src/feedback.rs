//! Feedback bodies: `POST /v1/pipelines/{name}/feedback` parsed and
//! checked before any item is applied.

use crate::{Truth, MAX_CLASSES};
use serde_json::Value;

/// One feedback item of `POST /v1/pipelines/{name}/feedback`.
#[derive(Clone, Debug, PartialEq)]
pub struct Feedback {
    pub request_id: u64,
    /// The selection it is for (any that holds the request, when absent).
    pub select: Option<String>,
    pub truth: Truth,
}

/// The body: `{"request_id": N, "label": L | [L, ..] | "reward": R}`, or
/// `{"feedback": [item, ..]}`. Every item is checked before any is applied.
pub fn parse_feedback(body: &[u8]) -> Result<(Vec<Feedback>, bool), String> {
    const FORM: &str =
        "feedback is {\"request_id\": N, \"label\": L or [L, ...]} or {\"request_id\": N, \"reward\": R in \
                        [0, 1]}, or {\"feedback\": [those, ...]}";
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("{FORM}: {e}"))?;
    let (items, batch) = match v.get("feedback") {
        Some(Value::Array(items)) => (items.clone(), true),
        Some(_) => return Err(format!("{FORM}: 'feedback' must be a list")),
        None => (vec![v], false),
    };
    let one = |i: usize, item: &Value| -> Result<Feedback, String> {
        let at = if batch { format!("feedback[{i}]: ") } else { String::new() };
        let obj = item.as_object().ok_or_else(|| format!("{at}{FORM}"))?;
        if let Some(k) = obj.keys().find(|k| !["request_id", "label", "reward", "select"].contains(&k.as_str())) {
            return Err(format!("{at}unknown field '{k}': {FORM}"));
        }
        let request_id = obj.get("request_id").and_then(Value::as_u64).ok_or_else(|| {
            format!("{at}'request_id' must be the request's id (a non-negative integer, the x-slipstream-request-id header)")
        })?;
        let select = match obj.get("select") {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(format!("{at}'select' must be a selection's name")),
        };
        let label = |v: &Value| v.as_i64().filter(|l| (0..MAX_CLASSES).contains(l));
        let truth = match (obj.get("label"), obj.get("reward")) {
            (Some(l), None) => Truth::Labels(match l {
                Value::Array(ls) if !ls.is_empty() => ls
                    .iter()
                    .map(|v| label(v).ok_or_else(|| format!("{at}labels are integers in [0, {MAX_CLASSES})")))
                    .collect::<Result<_, _>>()?,
                v => vec![label(v)
                    .ok_or_else(|| format!("{at}'label' is an integer in [0, {MAX_CLASSES}) or a list of them"))?],
            }),
            (None, Some(r)) => Truth::Reward(
                r.as_f64()
                    .filter(|r| (0.0..=1.0).contains(r))
                    .ok_or_else(|| format!("{at}'reward' is a number in [0, 1]"))?,
            ),
            _ => return Err(format!("{at}give one of 'label' and 'reward': {FORM}")),
        };
        Ok(Feedback { request_id, select, truth })
    };
    let parsed = items.iter().enumerate().map(|(i, item)| one(i, item)).collect::<Result<Vec<_>, _>>()?;
    Ok((parsed, batch))
}
