//! The bytes the engine's own Rust code holds on the native heap, counted at the allocator.
//!
//! RSS cannot say whether the engine leaks: inside an executor JVM it also holds the JIT's
//! code, the collector's structures, thread stacks and whatever glibc keeps of memory already
//! freed. This library's allocations all go through [`CountingAlloc`] (its global allocator),
//! so [`live_bytes`] is exactly what the engine holds now — the `native_heap_bytes` gauge that
//! `scripts/soak.sh` checks over an application's life. The count is the heap part of the
//! engine's native memory ([`accounting`]), whose total and peak the engine reports against
//! the bound Spark's settings give it.
use rdma_shuffle_fabric::memory::accounting::{self, Kind};
use std::alloc::{GlobalAlloc, Layout, System};

/// The system allocator plus a count of live bytes.
pub struct CountingAlloc;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the count
// is a side effect that touches no allocation.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            accounting::charge(Kind::Heap, layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            accounting::charge(Kind::Heap, layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        accounting::credit(Kind::Heap, layout.size() as u64);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        // On failure the old block is untouched and still counted.
        if !p.is_null() {
            if new_size >= layout.size() {
                accounting::charge(Kind::Heap, (new_size - layout.size()) as u64);
            } else {
                accounting::credit(Kind::Heap, (layout.size() - new_size) as u64);
            }
        }
        p
    }
}

/// Bytes this library's Rust code holds on the heap now (over every engine of the process).
pub fn live_bytes() -> usize {
    accounting::snapshot().heap as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIG: usize = 64 << 20;
    /// The two tests below each hold 64 MiB; run together, one would see the other's.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn counts_an_allocation_while_it_lives() {
        // Other tests allocate and free concurrently, so only "at least" holds while ours
        // lives; 64 MiB is far above anything they hold.
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let before = live_bytes();
        let v = vec![1u8; BIG];
        assert!(live_bytes() >= BIG, "live {} with {BIG} bytes held", live_bytes());
        drop(v);
        assert!(live_bytes() < before + BIG, "64 MiB freed but still counted: {}", live_bytes());
    }

    #[test]
    fn counts_growth_by_realloc_and_zeroed_allocations() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<u8> = Vec::with_capacity(16);
        v.resize(BIG, 7); // grows by realloc
        assert!(live_bytes() >= BIG, "live {} after growing to {BIG}", live_bytes());
        v.truncate(1);
        v.shrink_to_fit(); // shrinks by realloc
        let z = vec![0u64; BIG / 8]; // alloc_zeroed
        assert!(live_bytes() >= BIG, "live {} with {BIG} zeroed bytes held", live_bytes());
        drop((v, z));
    }
}
