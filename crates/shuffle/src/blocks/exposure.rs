//! The engine-wide budget of exposed rendezvous regions.
//!
//! On a one-sided transport (verbs, and sim with one-sided reads) every block offered by
//! rendezvous is a region mapped, registered with the device and readable by one peer until
//! that peer releases it. Without a bound, the bytes exposed at once grow with the number of
//! clients (each may hold up to its credits of regions). The loop keeps their sum within
//! [`ServerEndpointConfig::max_bytes_exposed`](super::ServerEndpointConfig): a region that does not fit waits
//! in its connection's queue (in the session's order) until releases make room. No peer
//! starves: waiting connections are served one region each in turn, and a connection with
//! nothing exposed goes first (every peer gets at least one region in turn, whatever the
//! others hold). A single region larger than the whole budget is exposed when nothing else is.
//! tcp streams regions from the file and exposes nothing: the budget does not apply to it.

use rdma_shuffle_fabric::driver::ConnKey;
use std::collections::VecDeque;

/// Bytes a region of `len` bytes at `offset` holds registered while exposed (verbs maps it
/// from the page that holds its first byte).
pub(crate) fn charge(offset: u64, len: u64) -> u64 {
    offset % 4096 + len
}

/// The budget and the connections waiting for it.
#[derive(Debug)]
pub(crate) struct ExposureBudget {
    limit: u64,
    used: u64,
    /// Server connections with regions waiting, in arrival order (each at most once).
    waiters: VecDeque<ConnKey>,
    /// Room was freed since the waiters were last served (a service pass is due).
    pub(crate) dirty: bool,
}

impl Default for ExposureBudget {
    /// No limit until the first server sets its own ([`ExposureBudget::lower_limit`]).
    fn default() -> Self {
        ExposureBudget::new(u64::MAX)
    }
}

impl ExposureBudget {
    pub(crate) fn new(limit: u64) -> Self {
        ExposureBudget { limit: limit.max(1), used: 0, waiters: VecDeque::new(), dirty: false }
    }

    /// Lowers the limit to a server's `max_bytes_exposed` (servers on one loop share the
    /// budget: the smallest of their limits holds).
    pub(crate) fn lower_limit(&mut self, limit: u64) {
        self.limit = self.limit.min(limit.max(1));
    }

    /// Bytes exposed now.
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// Whether a region of `need` bytes may be exposed now, to a connection holding `held`
    /// bytes exposed. Regions queue behind waiting connections, except a connection's first.
    pub(crate) fn admits(&self, need: u64, held: u64) -> bool {
        (self.waiters.is_empty() || held == 0) && self.fits(need)
    }

    /// Whether `need` more bytes fit (or nothing is exposed at all).
    pub(crate) fn fits(&self, need: u64) -> bool {
        self.used == 0 || self.used.saturating_add(need) <= self.limit
    }

    pub(crate) fn take(&mut self, bytes: u64) {
        self.used += bytes;
    }

    /// Gives `bytes` back; whether waiters should now be served (and were not due already).
    pub(crate) fn give(&mut self, bytes: u64) -> bool {
        self.used = self.used.saturating_sub(bytes);
        if bytes > 0 && !self.waiters.is_empty() && !self.dirty {
            self.dirty = true;
            return true;
        }
        false
    }

    /// `key` has regions waiting.
    pub(crate) fn wait(&mut self, key: ConnKey) {
        if !self.waiters.contains(&key) {
            self.waiters.push_back(key);
        }
    }

    /// The waiting connections, for one service pass (they queue again if still waiting).
    pub(crate) fn drain_waiters(&mut self) -> Vec<ConnKey> {
        self.waiters.drain(..).collect()
    }

    /// Puts back, at the head and in order, connections a pass did not get to.
    pub(crate) fn requeue_front(&mut self, keys: impl DoubleEndedIterator<Item = ConnKey>) {
        for k in keys.rev() {
            if !self.waiters.contains(&k) {
                self.waiters.push_front(k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_within_the_limit_a_first_region_ahead_of_waiters_and_an_oversized_region_alone() {
        let mut b = ExposureBudget::new(100);
        assert!(b.admits(150, 0), "a region larger than the budget goes when nothing is exposed");
        b.take(60);
        assert!(b.admits(40, 60) && !b.admits(41, 60));
        b.wait(ConnKey::from_u64(1 << 32 | 1));
        assert!(!b.admits(10, 60), "queues behind a waiting connection");
        assert!(b.admits(10, 0), "a connection's first region goes ahead of the waiters");
        b.take(40);
        assert_eq!(b.used(), 100);
        assert!(b.give(100), "room freed with a waiter: a pass is due");
        assert!(!b.give(0), "once");
        assert!(b.dirty && b.used() == 0);
        assert_eq!(charge(4095, 10), 4105);
    }
}
