//! The loop's timers: one heap of deadlines, keyed by connection.
//!
//! A connection arms the earliest deadline it cares about (its session's `poll_timeout`, a
//! connect or attach limit, its idle limit). Entries are never removed: when one fires, the
//! loop asks the connection what is due now and re-arms it, so a deadline that moved later
//! costs one spurious wake-up, and one that moved earlier is pushed again.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

#[derive(Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
}

impl Timers {
    /// Arms `key` at `at`, unless `armed` (what the key last armed and has not fired) is
    /// already earlier or equal. Updates `armed`.
    pub(crate) fn arm(&mut self, key: u64, at: Instant, armed: &mut Option<Instant>) {
        if armed.is_some_and(|a| a <= at) {
            return;
        }
        *armed = Some(at);
        self.heap.push(Reverse((at, key)));
    }

    /// The earliest deadline.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    /// Pops an entry due at `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, u64)> {
        match self.heap.peek() {
            Some(Reverse((t, _))) if *t <= now => self.heap.pop().map(|Reverse(e)| e),
            _ => None,
        }
    }
}
