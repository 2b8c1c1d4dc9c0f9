//! Batches of variable-length inputs (strings, token lists): which queued
//! requests share a batch, and what a batch's length does to its latency.
//!
//! A component that pads every row of a batch to the batch's longest input
//! (a transformer over a batch of sentences) pays for `rows x longest`
//! positions, however short most rows are: on the RAG example's 1,000 real
//! queries a random batch of 8 pads to 1.47x the tokens its rows hold, a
//! batch of 32 to 1.75x. The former therefore, for a stage that names its
//! length input:
//!
//! 1. **Groups similar lengths.** When more requests are queued than one
//!    batch takes, the most urgent request (the head) always goes, so do the
//!    ones that could not wait for another batch; the remaining places go to
//!    the requests whose length is closest to the head's (a short head
//!    gathers short requests, a long one long requests), not simply to the
//!    next in deadline order. Nothing is reordered while everything queued
//!    fits in one batch.
//! 2. **Bounds a batch by its padded length** when a budget is declared
//!    (`max_batch_tokens`, as text-embeddings-inference bounds its batches
//!    by `max_batch_tokens`): `rows x longest <= budget`, and always at
//!    least the head.
//! 3. **Predicts a batch's latency from its length**: the profile gives the
//!    mean latency of a batch of `n` at the padded length such batches had
//!    (learned here per `n`); a batch `x` times as long is predicted `x`
//!    times as slow (bounded to 0.5x-4x), which sizes batches to the head's
//!    deadline and is what the replica publishes as its expected finish.
//!
//! A request's length is its rows and its longest element (bytes of a
//! string: a proxy for tokens that needs no tokenizer in the node).

use std::collections::BTreeMap;

/// One request's size at a stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Length {
    /// Its rows (most requests have one).
    pub rows: u64,
    /// Its longest element, in the length input's units (bytes of a string).
    pub longest: u64,
}

/// The padded size of a batch built so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchLength {
    /// Rows in the batch.
    pub rows: u64,
    /// Its longest element.
    pub longest: u64,
}

impl BatchLength {
    /// With one more request.
    pub fn with(self, l: Length) -> BatchLength {
        BatchLength { rows: self.rows.saturating_add(l.rows), longest: self.longest.max(l.longest) }
    }

    /// Positions the component computes: every row padded to the longest.
    pub fn padded(self) -> u64 {
        self.rows.saturating_mul(self.longest)
    }
}

/// Weight of a new batch in the padded-length estimates.
const ALPHA: f64 = 0.1;

/// How far a batch's length may scale its predicted latency.
const SCALE: (f64, f64) = (0.5, 4.0);

/// A stage's length-aware batching state.
#[derive(Clone, Debug, Default)]
pub struct LengthModel {
    /// Most padded positions per batch (None: no bound, grouping only).
    pub max_tokens: Option<u64>,
    /// Mean padded length of the batches of each size seen (what the
    /// profile's latency at that size was learned at).
    seen: BTreeMap<u32, f64>,
}

impl LengthModel {
    /// Grouping by length, with `max_tokens` bounding a batch's padded length.
    pub fn new(max_tokens: Option<u64>) -> LengthModel {
        LengthModel { max_tokens: max_tokens.filter(|&t| t > 0), seen: BTreeMap::new() }
    }

    /// Whether a batch this long is within the budget.
    pub fn fits(&self, b: BatchLength) -> bool {
        self.max_tokens.is_none_or(|t| b.padded() <= t)
    }

    /// A batch of `n` with `padded` positions ran: learn the lengths such batches have.
    pub fn observe(&mut self, n: u32, padded: u64) {
        if n == 0 || padded == 0 {
            return;
        }
        let e = self.seen.entry(n).or_insert(padded as f64);
        *e += ALPHA * (padded as f64 - *e);
    }

    /// How much slower than the profile's mean a batch of `n` with
    /// `padded` positions is expected to be (1 while nothing is known).
    pub fn scale(&self, n: u32, padded: u64) -> f64 {
        let typical = match (self.seen.range(..=n).next_back(), self.seen.range(n..).next()) {
            (Some((&b, &v)), _) if b == n => v,
            // Between known sizes: the padded length grows about with the rows.
            (Some((&b0, &v0)), _) => v0 * n as f64 / b0 as f64,
            (None, Some((&b1, &v1))) => v1 * n as f64 / b1 as f64,
            (None, None) => return 1.0,
        };
        if typical <= 0.0 || padded == 0 {
            return 1.0;
        }
        (padded as f64 / typical).clamp(SCALE.0, SCALE.1)
    }
}

/// Which of `cand` (most urgent first; `None`: no length known) join the
/// batch, given that at most `limit` do: the first always; then, in order,
/// every one that `urgent` says cannot wait for another batch; then the
/// others closest in length to the first. A request that would take the
/// batch past `model`'s budget stays out (and ends the batch if it cannot
/// wait). Returns the chosen indices in deadline order.
pub fn choose(
    cand: &[Option<Length>],
    limit: usize,
    model: &LengthModel,
    urgent: impl Fn(usize) -> bool,
) -> (Vec<usize>, BatchLength) {
    let mut chosen = Vec::with_capacity(limit.min(cand.len()));
    let Some(head) = cand.first() else { return (chosen, BatchLength::default()) };
    let mut size = BatchLength::default().with(head.unwrap_or_default());
    chosen.push(0);
    let mut flexible = Vec::new();
    for (i, l) in cand.iter().enumerate().skip(1) {
        if chosen.len() >= limit {
            break;
        }
        let l = l.unwrap_or_default();
        if urgent(i) {
            let grown = size.with(l);
            if !model.fits(grown) {
                break; // it heads the next batch
            }
            size = grown;
            chosen.push(i);
        } else {
            flexible.push((i, l));
        }
    }
    let target = head.unwrap_or_default().longest;
    flexible.sort_by_key(|&(i, l)| (l.longest.abs_diff(target), i));
    for (i, l) in flexible {
        if chosen.len() >= limit {
            break;
        }
        let grown = size.with(l);
        if model.fits(grown) {
            size = grown;
            chosen.push(i);
        }
    }
    chosen.sort_unstable();
    (chosen, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(v: &[u64]) -> Vec<Option<Length>> {
        v.iter().map(|&l| Some(Length { rows: 1, longest: l })).collect()
    }

    #[test]
    fn groups_requests_of_similar_length_with_the_head() {
        let cand = lens(&[10, 100, 12, 90, 11, 95, 9, 100]);
        let (c, size) = choose(&cand, 4, &LengthModel::new(None), |_| false);
        assert_eq!(c, vec![0, 2, 4, 6], "the short head takes the short ones");
        assert_eq!(size, BatchLength { rows: 4, longest: 12 });
        // A long head gathers the long ones.
        let cand = lens(&[100, 10, 95, 12, 90, 11]);
        let (c, _) = choose(&cand, 3, &LengthModel::new(None), |_| false);
        assert_eq!(c, vec![0, 2, 4]);
    }

    #[test]
    fn requests_that_cannot_wait_go_first_whatever_their_length() {
        let cand = lens(&[10, 100, 12, 11]);
        let (c, _) = choose(&cand, 3, &LengthModel::new(None), |i| i == 1);
        assert_eq!(c, vec![0, 1, 3], "then the closest to the head's 10");
    }

    #[test]
    fn everything_goes_when_it_fits_in_one_batch() {
        let cand = lens(&[10, 100, 12]);
        let (c, size) = choose(&cand, 8, &LengthModel::new(None), |_| false);
        assert_eq!(c, vec![0, 1, 2]);
        assert_eq!(size.padded(), 300);
    }

    #[test]
    fn a_budget_bounds_the_padded_length() {
        let model = LengthModel::new(Some(40));
        // 10 + 12 + 11 padded to 12: 36 <= 40; the 100 never fits beside them.
        let (c, size) = choose(&lens(&[10, 100, 12, 11, 13]), 8, &model, |_| false);
        assert_eq!(c, vec![0, 2, 3]);
        assert!(size.padded() <= 40);
        // The head goes alone even past the budget.
        let (c, _) = choose(&lens(&[100, 10]), 8, &model, |_| false);
        assert_eq!(c, vec![0]);
        // A request that cannot wait and does not fit ends the batch.
        let (c, _) = choose(&lens(&[10, 100, 12]), 8, &model, |i| i == 1);
        assert_eq!(c, vec![0]);
        // Rows count: a 3-row request of 10 is 30 positions.
        let cand = vec![Some(Length { rows: 1, longest: 10 }), Some(Length { rows: 3, longest: 10 })];
        let (c, _) = choose(&cand, 8, &model, |_| false);
        assert_eq!(c, vec![0, 1]);
    }

    #[test]
    fn latency_scales_with_padded_length_within_bounds() {
        let mut m = LengthModel::new(None);
        assert_eq!(m.scale(8, 1000), 1.0, "nothing known yet");
        for _ in 0..50 {
            m.observe(8, 400);
        }
        assert!((m.scale(8, 800) - 2.0).abs() < 1e-6);
        assert!((m.scale(8, 200) - 0.5).abs() < 1e-6);
        assert_eq!(m.scale(8, 100_000), 4.0);
        // Another size: scaled from the nearest known one by rows.
        assert!((m.scale(4, 400) - 2.0).abs() < 0.01);
    }
}
