//! Deadline-ordered queue of a stage replica.
//!
//! Invariant: `pop` returns the item with the smallest deadline; among equal
//! deadlines, the one pushed first. With one SLO per pipeline, deadline order
//! is arrival order, so a pipeline alone sees FIFO.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Entry<T> {
    deadline_ns: u64,
    seq: u64,
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.deadline_ns == other.deadline_ns && self.seq == other.seq
    }
}
impl<T> Eq for Entry<T> {}
impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Entry<T> {
    // BinaryHeap is a max-heap: reverse so the earliest deadline is on top.
    fn cmp(&self, other: &Self) -> Ordering {
        other.deadline_ns.cmp(&self.deadline_ns).then_with(|| other.seq.cmp(&self.seq))
    }
}

/// Earliest-deadline-first queue.
pub struct EdfQueue<T> {
    heap: BinaryHeap<Entry<T>>,
    seq: u64,
}

impl<T> Default for EdfQueue<T> {
    fn default() -> Self {
        Self { heap: BinaryHeap::new(), seq: 0 }
    }
}

impl<T> EdfQueue<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, deadline_ns: u64, item: T) {
        self.seq += 1;
        self.heap.push(Entry { deadline_ns, seq: self.seq, item });
    }

    pub fn pop(&mut self) -> Option<(u64, T)> {
        self.heap.pop().map(|e| (e.deadline_ns, e.item))
    }

    /// Deadline of the most urgent item.
    pub fn peek_deadline(&self) -> Option<u64> {
        self.heap.peek().map(|e| e.deadline_ns)
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Remove and return everything, most urgent first.
    pub fn drain(&mut self) -> Vec<(u64, T)> {
        let mut out = Vec::with_capacity(self.heap.len());
        while let Some(x) = self.pop() {
            out.push(x);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_deadline_first_then_fifo() {
        let mut q = EdfQueue::new();
        q.push(30, "c");
        q.push(10, "a1");
        q.push(20, "b");
        q.push(10, "a2");
        assert_eq!(q.peek_deadline(), Some(10));
        let order: Vec<_> = q.drain().into_iter().map(|(_, x)| x).collect();
        assert_eq!(order, vec!["a1", "a2", "b", "c"]);
    }
}
