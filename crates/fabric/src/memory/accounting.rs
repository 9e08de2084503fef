//! The native memory this process's engines hold, by kind, with the exact peak of the total.
//!
//! Spark sizes an executor's container as heap + `memoryOverhead` (+ off-heap and PySpark
//! memory); everything an engine maps or allocates outside the JVM heap must fit in the share
//! of the overhead it is given, and an operator must be able to see how much it holds and held
//! at most. Three kinds make up that memory, each counted where it is mapped or allocated:
//!
//! * [`Kind::Heap`]: the Rust heap of the library the JVM loads (its global allocator calls
//!   [`charge`] / [`credit`]; crates/jni). Connection state, frames, tables.
//! * [`Kind::Pool`]: the mapped slabs of every [`TieredPool`](crate::pool::TieredPool) (fetched
//!   blocks, RDMA READ targets, stream buffers).
//! * [`Kind::Provider`]: memory a provider maps for itself: verbs receive and send buffers, and
//!   the mappings of blocks exposed for RDMA READ.
//!
//! The counters are process-wide (one executor runs one engine). Updates are relaxed atomic
//! adds; the peak is exact because every total a thread produces is compared with the peak by
//! that thread.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a charge is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The library's Rust heap.
    Heap = 0,
    /// Slabs of the tiered pools.
    Pool = 1,
    /// Buffers and mappings a provider makes itself (verbs).
    Provider = 2,
}

static BY_KIND: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static TOTAL: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// Counts `bytes` of `kind` as held from now on.
#[inline]
pub fn charge(kind: Kind, bytes: u64) {
    BY_KIND[kind as usize].fetch_add(bytes, Ordering::Relaxed);
    let total = TOTAL.fetch_add(bytes, Ordering::Relaxed) + bytes;
    // A load first: the peak is written only while the total climbs past it, so the common
    // case is one shared-cache read, not a second write to a contended line.
    if total > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(total, Ordering::Relaxed);
    }
}

/// Counts `bytes` of `kind`, charged before, as given back.
#[inline]
pub fn credit(kind: Kind, bytes: u64) {
    BY_KIND[kind as usize].fetch_sub(bytes, Ordering::Relaxed);
    TOTAL.fetch_sub(bytes, Ordering::Relaxed);
}

/// The counters at one moment (each read on its own: the parts may not add up exactly to
/// `total` while other threads allocate).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NativeMemory {
    /// The library's Rust heap.
    pub heap: u64,
    /// Pool slabs.
    pub pool: u64,
    /// Provider buffers and exposure mappings.
    pub provider: u64,
    /// All of it.
    pub total: u64,
    /// The highest `total` since the process started.
    pub peak: u64,
}

/// The counters now.
pub fn snapshot() -> NativeMemory {
    let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
    NativeMemory {
        heap: r(&BY_KIND[Kind::Heap as usize]),
        pool: r(&BY_KIND[Kind::Pool as usize]),
        provider: r(&BY_KIND[Kind::Provider as usize]),
        total: r(&TOTAL),
        peak: r(&PEAK),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_add_up_and_the_peak_stays_at_the_highest_total() {
        // Other tests of this binary map pool slabs concurrently: only relations that hold
        // whatever they do are checked, with amounts far above theirs.
        const BIG: u64 = 1 << 40;
        let before = snapshot();
        charge(Kind::Provider, BIG);
        let held = snapshot();
        assert!(held.provider >= BIG && held.total >= BIG, "{held:?}");
        assert!(held.peak >= held.total.min(before.total + BIG), "{held:?}");
        credit(Kind::Provider, BIG);
        let after = snapshot();
        assert!(after.total < BIG && after.provider < BIG, "{after:?}");
        assert!(after.peak >= BIG, "the peak keeps the highest total: {after:?}");
    }
}
