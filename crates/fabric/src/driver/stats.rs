//! The driver's counters and gauges.

use crate::providers::link::ProviderCounters;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Counters and gauges of a driver, summed over its endpoints.
#[derive(Debug, Default)]
pub struct DriverStats {
    /// Connections open now (every role).
    pub connections_open: AtomicU64,
    /// Unauthenticated connections (any protocol's) closed at their handshake limit.
    pub handshake_timeouts: AtomicU64,
    /// Unauthenticated connections (any protocol's) evicted for newer ones at the
    /// protocol's cap.
    pub handshake_evictions: AtomicU64,
    /// Memory this driver registered with the device now: receive and send buffers and
    /// exposed regions (sim counts exposed regions too). Pool slabs are the provider's.
    pub registered_bytes: AtomicU64,
    /// Memory ever registered for a peer before it authenticated. Stays 0: the counter is
    /// the proof.
    pub preauth_registered_bytes: AtomicU64,
    /// Connections closed after their idle timeout.
    pub idle_closes: AtomicU64,
    /// One-sided reads posted and not yet completed, now.
    pub reads_in_flight: AtomicU64,
    /// The most one-sided reads ever in flight at once.
    pub peak_reads_in_flight: AtomicU64,
    /// Connections removed with device work still posted after the close limit (their
    /// buffers are leaked, never reused). Stays 0 when every flush completion came back.
    pub unflushed_closes: AtomicU64,
    /// Loop turns run by the loop's own thread.
    pub loop_turns: AtomicU64,
    /// Loop turns run by callers driving progress themselves (a Mobius call waiting for a
    /// message, a send picked up at once): each is a turn with no thread hand-off.
    pub caller_turns: AtomicU64,
    /// Provider-specific counters (verbs: sends, receives, reads, queue pairs...), shared
    /// with the provider's engine in the loop.
    pub(crate) provider: Arc<ProviderCounters>,
}

impl DriverStats {
    /// Counts `delta` one-sided reads started (positive) or finished (negative).
    pub fn note_reads(&self, delta: i64) {
        let now = if delta >= 0 {
            self.reads_in_flight.fetch_add(delta as u64, Ordering::Relaxed) + delta as u64
        } else {
            self.reads_in_flight.fetch_sub((-delta) as u64, Ordering::Relaxed) - (-delta) as u64
        };
        self.peak_reads_in_flight.fetch_max(now, Ordering::Relaxed);
    }
}
