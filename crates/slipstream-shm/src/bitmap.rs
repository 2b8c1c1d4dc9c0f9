//! The page-allocation bitmap: one bit per page, `1` = allocated.
//!
//! The words live in the shared mapping, so several processes touch them at
//! once. Every mutation is a single atomic read-modify-write on one `u64`:
//! claiming ORs bits in, releasing ANDs them out. A claim checks the previous
//! value and backs out if any bit it wanted was already set, so even two
//! allocators racing on the same pool cannot hand out the same page; in
//! practice the pool has one allocating process (its owner) and the check
//! never fires. Releases never conflict with anything.
//!
//! This module knows nothing about the mapping; it works over any
//! `&[AtomicU64]`, which keeps it testable on the heap.

use std::sync::atomic::{AtomicU64, Ordering};

const BITS: usize = u64::BITS as usize;

/// A view of `pages` bits stored in `words` (bit `i % 64` of word `i / 64`).
pub(crate) struct Bitmap<'a> {
    words: &'a [AtomicU64],
    pages: usize,
}

/// The `(word index, mask)` pairs covering pages `start .. start + len`.
fn word_masks(start: usize, len: usize) -> impl Iterator<Item = (usize, u64)> {
    let end = start + len;
    let mut i = start;
    std::iter::from_fn(move || {
        if i >= end {
            return None;
        }
        let bit = i % BITS;
        let n = (BITS - bit).min(end - i);
        let mask = if n == BITS { u64::MAX } else { ((1u64 << n) - 1) << bit };
        let word = i / BITS;
        i += n;
        Some((word, mask))
    })
}

impl<'a> Bitmap<'a> {
    pub(crate) fn new(words: &'a [AtomicU64], pages: usize) -> Self {
        assert!(words.len() * BITS >= pages, "bitmap too small for {pages} pages");
        Bitmap { words, pages }
    }

    /// Next-fit search: the first run of `k` clear bits starting at or after
    /// `cursor`, else (wrapping once) the first one starting before it.
    pub(crate) fn find_next_fit(&self, cursor: usize, k: usize) -> Option<usize> {
        if k == 0 || k > self.pages {
            return None;
        }
        let cursor = if cursor >= self.pages { 0 } else { cursor };
        // A run found by the second scan starts before `cursor` (otherwise
        // the first scan would have found it) but may extend past it.
        self.find_run(cursor, self.pages, k).or_else(|| self.find_run(0, (cursor + k - 1).min(self.pages), k))
    }

    /// First index `p` with `from <= p` and `p + k <= to` such that pages
    /// `p .. p + k` are all clear, scanning a word at a time.
    pub(crate) fn find_run(&self, from: usize, to: usize, k: usize) -> Option<usize> {
        debug_assert!(to <= self.pages && k > 0);
        if from >= to || to - from < k {
            return None;
        }
        let mut run_start = from;
        let mut run_len = 0usize;
        let mut i = from;
        while i < to {
            // Bit j of `bits` is page i + j; bits above the word are zero.
            let bit = i % BITS;
            let bits = self.words[i / BITS].load(Ordering::Relaxed) >> bit;
            let span = (BITS - bit).min(to - i);
            let window = if span == BITS { bits } else { bits & ((1u64 << span) - 1) };
            if window == 0 {
                // `span` free pages at once (a whole word when aligned).
                run_len += span;
                if run_len >= k {
                    return Some(run_start);
                }
                i += span;
                continue;
            }
            let free = window.trailing_zeros() as usize;
            if run_len + free >= k {
                return Some(run_start);
            }
            // Skip the block of set bits that ends this run; a full word of
            // ones is skipped in one step.
            let used = (!(bits >> free)).trailing_zeros() as usize;
            i += free + used;
            run_start = i;
            run_len = 0;
            if to.saturating_sub(i) < k {
                return None;
            }
        }
        None
    }

    /// Sets pages `start .. start + len`. Fails, leaving the bitmap as it
    /// was, if any of them was already set; the error is the first such page.
    pub(crate) fn try_claim(&self, start: usize, len: usize) -> Result<(), usize> {
        debug_assert!(start + len <= self.pages);
        for (word, mask) in word_masks(start, len) {
            // Acquire pairs with the Release of whoever freed these pages, so
            // their last reads of the data happen before our writes to it.
            let prev = self.words[word].fetch_or(mask, Ordering::AcqRel);
            let clash = prev & mask;
            if clash != 0 {
                // Undo only what this call set: the bits of this word that
                // were clear, and every earlier word in full.
                let ours = mask & !prev;
                if ours != 0 {
                    self.words[word].fetch_and(!ours, Ordering::Release);
                }
                for (w, m) in word_masks(start, len).take_while(|&(w, _)| w < word) {
                    self.words[w].fetch_and(!m, Ordering::Release);
                }
                return Err(word * BITS + clash.trailing_zeros() as usize);
            }
        }
        Ok(())
    }

    /// Clears pages `start .. start + len`; returns whether all were set.
    pub(crate) fn release(&self, start: usize, len: usize) -> bool {
        debug_assert!(start + len <= self.pages);
        let mut all_set = true;
        for (word, mask) in word_masks(start, len) {
            let prev = self.words[word].fetch_and(!mask, Ordering::Release);
            all_set &= prev & mask == mask;
        }
        all_set
    }

    /// Whether pages `start .. start + len` are all set right now.
    #[cfg(test)]
    pub(crate) fn all_set(&self, start: usize, len: usize) -> bool {
        word_masks(start, len).all(|(w, m)| self.words[w].load(Ordering::Relaxed) & m == m)
    }

    /// Number of set bits among the `pages` pages (a racy snapshot).
    pub(crate) fn count_set(&self) -> usize {
        word_masks(0, self.pages).map(|(w, m)| (self.words[w].load(Ordering::Relaxed) & m).count_ones() as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    /// Reference implementation: bit-by-bit.
    fn naive_run(bm: &Bitmap<'_>, from: usize, to: usize, k: usize) -> Option<usize> {
        (from..to.saturating_sub(k - 1))
            .find(|&p| (p..p + k).all(|q| bm.words[q / BITS].load(Ordering::Relaxed) & (1 << (q % BITS)) == 0))
    }

    #[test]
    fn word_masks_cover_exactly() {
        let v: Vec<_> = word_masks(60, 70).collect();
        assert_eq!(v, vec![(0, 0xF << 60), (1, u64::MAX), (2, 0x3)]);
        assert_eq!(word_masks(64, 64).collect::<Vec<_>>(), vec![(1, u64::MAX)]);
        assert_eq!(word_masks(3, 0).count(), 0);
    }

    #[test]
    fn claim_release_count() {
        let w = words(4);
        let bm = Bitmap::new(&w, 200);
        assert_eq!(bm.count_set(), 0);
        bm.try_claim(10, 130).unwrap();
        assert_eq!(bm.count_set(), 130);
        assert!(bm.all_set(10, 130));
        assert!(bm.release(10, 130));
        assert_eq!(bm.count_set(), 0);
        assert!(!bm.release(10, 1), "double release reports it");
    }

    #[test]
    fn conflicting_claim_backs_out() {
        let w = words(4);
        let bm = Bitmap::new(&w, 256);
        bm.try_claim(150, 1).unwrap();
        // Spans words 0..=2, conflicts in word 2: words 0 and 1 and the clear
        // bits of word 2 must be rolled back, bit 150 must stay set.
        assert_eq!(bm.try_claim(5, 160), Err(150));
        assert_eq!(bm.count_set(), 1);
        assert!(bm.all_set(150, 1));
    }

    #[test]
    fn find_run_matches_naive() {
        // xorshift over random bitmaps and queries.
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for round in 0..300 {
            let pages = 1 + (next() % 400) as usize;
            let w = words(pages.div_ceil(BITS));
            // Vary the density: sparse, dense, and long runs.
            let density = round % 3;
            for (i, word) in w.iter().enumerate() {
                let r = match density {
                    0 => next() & next() & next(),
                    1 => next() | next(),
                    _ => {
                        if next() % 2 == 0 {
                            0
                        } else {
                            u64::MAX << (next() % 64)
                        }
                    }
                };
                let valid = pages - i * BITS;
                let r = if valid >= BITS { r } else { r & ((1 << valid) - 1) };
                word.store(r, Ordering::Relaxed);
            }
            let bm = Bitmap::new(&w, pages);
            for _ in 0..20 {
                let from = (next() as usize) % (pages + 1);
                let to = from + (next() as usize) % (pages - from + 1);
                let k = 1 + (next() as usize) % 100;
                assert_eq!(
                    bm.find_run(from, to, k),
                    naive_run(&bm, from, to, k),
                    "pages={pages} from={from} to={to} k={k}"
                );
            }
        }
    }

    #[test]
    fn next_fit_wraps_once() {
        let w = words(1);
        let bm = Bitmap::new(&w, 10);
        bm.try_claim(0, 2).unwrap();
        bm.try_claim(6, 4).unwrap();
        // From cursor 6: nothing after, wrap finds 2.
        assert_eq!(bm.find_next_fit(6, 3), Some(2));
        // A run straddling the cursor is found on the wrap.
        assert_eq!(bm.find_next_fit(4, 4), Some(2));
        assert_eq!(bm.find_next_fit(4, 5), None);
        assert_eq!(bm.find_next_fit(100, 1), Some(2), "cursor past end restarts at 0");
        assert_eq!(bm.find_next_fit(0, 11), None);
    }
}
