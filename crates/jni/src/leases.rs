//! Lease handles given to Java: keys into a table of live leases, never pointers.
//!
//! Java gets a `jlong` for every fetched block and gives it back through `releaseLease`. When
//! that `jlong` was a raw `Box<Lease>` pointer, any second release (a callback that released
//! and then threw, so the bridge released again; a Java bug releasing twice) freed the box
//! twice and put one pool buffer on the free list twice: two later blocks then shared memory.
//!
//! Here a handle is `generation << 32 | (slot + 1)`. Taking a lease out of its slot bumps the
//! slot's generation, so a stale handle (released already, or from an earlier occupant of the
//! slot) no longer matches and taking it again finds nothing: a double or unknown release is
//! a no-op, reported once by the caller, never a double free. Generations are 31 bits, so
//! handles are positive and never 0 (0 stays "no buffer", the handle of an empty block); a
//! stale handle could only alias after 2^31 reuses of its one slot.

use std::sync::Mutex;

/// Generations live in bits 32..63 of a handle and stay below 2^31 so handles are positive.
const GENERATION_MASK: u32 = 0x7fff_ffff;

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

struct Inner<T> {
    slots: Vec<Slot<T>>,
    /// Indices of empty slots, reused before the table grows.
    free: Vec<u32>,
    live: usize,
}

/// A table of values (leases) handed out by `jlong` key.
pub struct LeaseTable<T> {
    inner: Mutex<Inner<T>>,
}

impl<T> Default for LeaseTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> LeaseTable<T> {
    /// An empty table (usable in a `static`).
    pub const fn new() -> Self {
        Self { inner: Mutex::new(Inner { slots: Vec::new(), free: Vec::new(), live: 0 }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        // A panic while the lock was held leaves the table consistent (every mutation is a
        // single step), so a poisoned lock is still usable: never panic across JNI for it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `value` and returns its handle (never 0, always positive).
    pub fn insert(&self, value: T) -> i64 {
        let mut t = self.lock();
        let index = match t.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(t.slots.len()).expect("fewer than 2^32 live leases");
                t.slots.push(Slot { generation: 1, value: None });
                i
            }
        };
        let slot = &mut t.slots[index as usize];
        slot.value = Some(value);
        let generation = slot.generation;
        t.live += 1;
        (i64::from(generation) << 32) | (i64::from(index) + 1)
    }

    /// Takes the value of `handle` out of the table; `None` when the handle is 0, unknown, or
    /// was taken already. The caller drops the value outside the table's lock.
    pub fn take(&self, handle: i64) -> Option<T> {
        if handle <= 0 {
            return None;
        }
        let low = (handle & 0xffff_ffff) as u32;
        let generation = (handle >> 32) as u32;
        let index = low.checked_sub(1)? as usize;
        let mut t = self.lock();
        let slot = t.slots.get_mut(index)?;
        if slot.generation != generation || slot.value.is_none() {
            return None;
        }
        let value = slot.value.take();
        // Wrap within 31 bits and skip 0, so a new handle is never 0 or negative.
        slot.generation = match (slot.generation + 1) & GENERATION_MASK {
            0 => 1,
            g => g,
        };
        t.free.push(index as u32);
        t.live -= 1;
        value
    }

    /// Number of values in the table now.
    pub fn live(&self) -> usize {
        self.lock().live
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_shuffle_fabric::{Lease, PoolConfig, TieredPool};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Counts its drops, to prove a value is dropped exactly once.
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_handle_releases_once_then_is_unknown() {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = LeaseTable::new();
        let h = table.insert(Counted(drops.clone()));
        assert!(h > 0, "handles are positive: {h}");
        assert_eq!(table.live(), 1);
        drop(table.take(h).expect("first release finds the lease"));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert!(table.take(h).is_none(), "second release of {h} must be a no-op");
        assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped twice");
        assert_eq!(table.live(), 0);
    }

    #[test]
    fn a_stale_handle_never_aliases_the_slots_next_lease() {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = LeaseTable::new();
        let old = table.insert(Counted(drops.clone()));
        drop(table.take(old));
        let new = table.insert(Counted(drops.clone()));
        assert_ne!(old, new, "the reused slot must get a new handle");
        assert_eq!(old & 0xffff_ffff, new & 0xffff_ffff, "same slot reused");
        assert!(table.take(old).is_none(), "the stale handle took the new lease");
        assert_eq!(table.live(), 1);
        assert!(table.take(new).is_some());
    }

    #[test]
    fn unknown_zero_and_negative_handles_find_nothing() {
        let table: LeaseTable<u8> = LeaseTable::new();
        let h = table.insert(7);
        for bogus in [0, -1, i64::MIN, h + 1, h + (1 << 32), 1 << 40, i64::MAX] {
            assert!(table.take(bogus).is_none(), "handle {bogus} found something");
        }
        assert_eq!(table.take(h), Some(7));
    }

    /// The bug this table fixes, on a real pool: with pointer handles a second release put the
    /// buffer on the free list twice, so two later leases shared memory.
    #[test]
    fn double_release_of_a_pool_lease_keeps_the_free_list_sound() {
        let cfg = PoolConfig { tiers: vec![4096], slab_bytes: 4 * 4096, cap_bytes: 4 * 4096, prealloc: false };
        let pool = TieredPool::unregistered(cfg).expect("pool");
        let table = LeaseTable::new();
        let h = table.insert(pool.acquire(100, None).expect("acquire"));
        drop(table.take(h));
        assert!(table.take(h).is_none());
        assert_eq!(pool.stats().bytes_in_use, 0);
        // Every buffer of the tier at once: all distinct.
        let held: Vec<Lease> = (0..4).map(|_| pool.try_acquire(4096).expect("acquire").expect("a free buffer")).collect();
        let mut ptrs: Vec<_> = held.iter().map(|l| l.as_ptr() as usize).collect();
        ptrs.sort_unstable();
        ptrs.dedup();
        assert_eq!(ptrs.len(), 4, "two leases share one buffer");
        assert!(pool.try_acquire(4096).expect("acquire").is_none(), "the pool handed out more buffers than it has");
    }

    #[test]
    fn many_threads_insert_and_take_without_losing_or_doubling() {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = Arc::new(LeaseTable::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (table, drops) = (table.clone(), drops.clone());
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        let h = table.insert(Counted(drops.clone()));
                        assert!(table.take(h).is_some());
                        assert!(table.take(h).is_none());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(drops.load(Ordering::SeqCst), 4000);
        assert_eq!(table.live(), 0);
    }
}
