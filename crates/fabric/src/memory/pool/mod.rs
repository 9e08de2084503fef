//! Tiered pool of registered memory that fetched shuffle blocks land in.
//!
//! Buffers come in a few fixed sizes ("tiers", e.g. 4 KiB … 16 MiB). Each tier grows by
//! *slabs*: page-aligned anonymous mappings holding several buffers of that tier, registered
//! with the provider exactly once (for verbs, one `ibv_reg_mr` per slab, so the hot path never
//! registers memory). A [`Lease`] owns one buffer and returns it on drop.
//!
//! The total mapped size never exceeds [`PoolConfig::cap_bytes`]. When a request cannot be
//! served within the cap the pool tries, in order: a free buffer of the right tier, growing
//! that tier, a free buffer of a larger tier, reclaiming fully idle slabs of other tiers; and
//! only then makes the caller wait for a lease to come back. Waiting is the backpressure that
//! keeps a burst of fetches from growing native memory without bound.
//!
//! Waiting is not first-come-first-served: a waiter for a large buffer can be overtaken by
//! smaller requests that keep slabs busy. Pass a deadline to bound the wait.
//!
//! Slow work (mapping, registering, deregistering, unmapping) happens outside the pool lock:
//! `ibv_reg_mr` of a 16 MiB slab pins 4096 pages and must not stall every other acquire. The
//! bytes are *reserved* under the lock first, so the cap holds while the lock is released.

// Visible to `memory::registration`, whose errors are the pool's: it imports them from this leaf,
// not through the pool (which imports registration), so the two do not import each other.
pub(in crate::memory) mod config;
mod slabs;
#[cfg(test)]
mod tests;

pub use super::registration::{NoRegistration, RegionKeys, Registrar};
pub use config::{PoolConfig, PoolError, PoolStats, CAP_KNOB, DEFAULT_TIERS, MAX_TIERS, SLAB_ALIGN};

use config::page_size;
#[cfg(test)]
use config::round_up;
pub use slabs::ReleaseHook;
use slabs::{BufRef, Class, Origin, Reservation, Shared, State, Step, Taken, TierState};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use tracing::{debug, trace};

/// A pool of registered buffers in size tiers under a hard byte cap.
///
/// Cheap to clone (an `Arc` inside); all clones share one pool. Leases keep the pool's
/// memory alive, so the pool may be dropped while leases are outstanding: each slab is
/// deregistered and unmapped when the last handle or lease referring to the pool goes.
#[derive(Clone)]
pub struct TieredPool {
    shared: Arc<Shared>,
}

/// One leased buffer. Derefs to `[u8]` of [`len`](Lease::len) bytes; the buffer goes back
/// to the pool (waking any waiter) when the lease is dropped.
///
/// A reused buffer still holds the bytes of its previous lease; it is never uninitialised.
pub struct Lease {
    shared: Arc<Shared>,
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    keys: RegionKeys,
    origin: Origin,
}

// SAFETY: a lease has exclusive access to its buffer (the pool hands each buffer to one
// lease at a time) and the buffer lives as long as the lease (it holds the `Arc<Shared>`
// that owns the slab, or owns its oversize region). Nothing in it is tied to a thread.
unsafe impl Send for Lease {}
// SAFETY: `&Lease` only gives read access to the buffer (`&[u8]`, `*const u8`).
unsafe impl Sync for Lease {}

impl TieredPool {
    /// Creates a pool; with [`PoolConfig::prealloc`] it maps and registers one slab per tier
    /// right away (so a registration failure shows up here).
    pub fn new(config: PoolConfig, registrar: Arc<dyn Registrar>) -> Result<Self, PoolError> {
        let specs = config.tier_specs()?;
        let shared = Arc::new(Shared {
            cap: config.cap_bytes,
            page: page_size(),
            state: Mutex::new(State {
                tiers: specs.iter().map(|_| TierState::default()).collect(),
                stats: PoolStats::default(),
                waiters: 0,
            }),
            cond: Condvar::new(),
            hooks: Mutex::new(Vec::new()),
            tiers: specs,
            registrar,
            config,
        });
        if shared.config.prealloc {
            for tier in 0..shared.tiers.len() {
                let nbuf = shared.tiers[tier].per_slab;
                let bytes = shared.slab_bytes(tier, nbuf);
                let region = shared.map_region(bytes)?;
                let mut st = shared.state.lock();
                st.stats.bytes_allocated += bytes as u64;
                st.stats.grows += 1;
                shared.install_slab(&mut st, tier, region, bytes, nbuf, false);
            }
        }
        debug!(tiers = ?shared.config.tiers, cap = shared.cap, "memory pool created");
        Ok(Self { shared })
    }

    /// A pool whose memory is not registered anywhere (TCP and simulation providers).
    pub fn unregistered(config: PoolConfig) -> Result<Self, PoolError> {
        Self::new(config, Arc::new(NoRegistration))
    }

    /// Leases a buffer of at least `len` bytes, waiting (without a deadline: forever) while
    /// the pool is at its cap.
    ///
    /// Errors: [`PoolError::ExceedsCap`] at once when `len` can never fit;
    /// [`PoolError::Timeout`] when `deadline` passes; [`PoolError::Registration`] /
    /// [`PoolError::Alloc`] when growing the pool fails.
    pub fn acquire(&self, len: usize, deadline: Option<Instant>) -> Result<Lease, PoolError> {
        match self.acquire_inner(len, Some(deadline))? {
            Some(lease) => Ok(lease),
            // `acquire_inner` only answers `None` when it may not block.
            None => Err(PoolError::Timeout { requested: len, cap: self.shared.cap, in_use: self.stats().bytes_in_use }),
        }
    }

    /// Like [`acquire`](Self::acquire) but never blocks: `Ok(None)` when the request would
    /// have to wait (the pool is at its cap, or another thread is growing this tier).
    /// It may still map and register a slab.
    pub fn try_acquire(&self, len: usize) -> Result<Option<Lease>, PoolError> {
        self.acquire_inner(len, None)
    }

    /// Registers `hook` to be told whenever a lease comes back (until the hook is dropped).
    pub fn add_release_hook(&self, hook: std::sync::Weak<dyn ReleaseHook>) {
        self.shared.hooks.lock().push(hook);
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        self.shared.state.lock().stats
    }

    /// The configuration the pool was built with.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.config
    }

    /// Capacity of the tier buffer that would serve `len` bytes, or `None` if `len` is
    /// above the largest tier (it would get a one-off buffer).
    pub fn tier_capacity_for(&self, len: usize) -> Option<usize> {
        self.shared.tier_for(len).map(|t| self.shared.tiers[t].size)
    }

    /// `wait`: `None` = never block; `Some(deadline)` = block until the deadline (if any).
    fn acquire_inner(&self, len: usize, wait: Option<Option<Instant>>) -> Result<Option<Lease>, PoolError> {
        let shared = &*self.shared;
        let class = shared.classify(len)?;
        let mut st = shared.state.lock();
        let mut counted_wait = false;
        let mut expired = false;
        loop {
            let step = match class {
                Class::Tier(tier) => shared.plan_tier(&mut st, tier),
                Class::Oversize(bytes) => shared.plan_oversize(&mut st, bytes),
            };
            // Every arm that carries a reservation drops the lock first: the reservation's
            // `Drop` (on failure) takes the lock again.
            let backpressure = match step {
                Step::Leased(taken) => {
                    drop(st);
                    return Ok(Some(self.lease(taken, len)));
                }
                Step::Grow { res, tier, nbuf } => {
                    drop(st);
                    return self.grow(res, tier, nbuf, len).map(Some);
                }
                Step::Oversize(res) => {
                    drop(st);
                    return self.oversize(res, len).map(Some);
                }
                Step::Wait { backpressure } => backpressure,
            };
            let Some(deadline) = wait else {
                return Ok(None);
            };
            if expired {
                st.stats.timeouts += 1;
                let in_use = st.stats.bytes_in_use;
                drop(st);
                debug!(requested = len, in_use, cap = shared.cap, "pool acquire timed out");
                return Err(PoolError::Timeout { requested: len, cap: shared.cap, in_use });
            }
            if backpressure && !counted_wait {
                counted_wait = true;
                st.stats.waits += 1;
                trace!(requested = len, in_use = st.stats.bytes_in_use, "pool at cap, waiting");
            }
            st.waiters += 1;
            match deadline {
                // After a timeout, loop once more: a buffer may have come back just in time.
                Some(d) => expired = shared.cond.wait_until(&mut st, d).timed_out(),
                None => shared.cond.wait(&mut st),
            }
            st.waiters -= 1;
        }
    }

    fn lease(&self, taken: Taken, len: usize) -> Lease {
        Lease {
            shared: Arc::clone(&self.shared),
            ptr: taken.ptr,
            len,
            capacity: taken.capacity,
            keys: taken.keys,
            origin: taken.origin,
        }
    }

    /// Maps and registers the slab reserved in `res` (outside the lock), installs it and
    /// leases its first buffer.
    fn grow(&self, mut res: Reservation<'_>, tier: usize, nbuf: u32, len: usize) -> Result<Lease, PoolError> {
        let shared = &*self.shared;
        let bytes = res.bytes as usize;
        let (region, mut st) = shared.map_reserved(&mut res)?;
        st.tiers[tier].inflight_spare -= nbuf as usize - 1;
        let size = shared.tiers[tier].size;
        let (base, keys) = (region.base, region.keys);
        let slot = shared.install_slab(&mut st, tier, region, bytes, nbuf, true);
        st.stats.grows += 1;
        st.stats.note_lease(size as u64);
        // Others may be waiting for this slab's spare buffers.
        if st.waiters > 0 {
            shared.cond.notify_all();
        }
        drop(st);
        debug!(tier = size, buffers = nbuf, bytes, "pool tier grew");
        Ok(self.lease(
            Taken { ptr: base, capacity: size, keys, origin: Origin::Tier { tier, buf: BufRef { slab: slot, index: 0 } } },
            len,
        ))
    }

    /// Maps and registers the one-off buffer reserved in `res` and leases it.
    fn oversize(&self, mut res: Reservation<'_>, len: usize) -> Result<Lease, PoolError> {
        let shared = &*self.shared;
        let bytes = res.bytes as usize;
        let (region, mut st) = shared.map_reserved(&mut res)?;
        st.stats.oversize += 1;
        st.stats.note_lease(bytes as u64);
        drop(st);
        debug!(requested = len, bytes, "pool leased an oversize buffer");
        Ok(Lease {
            shared: Arc::clone(&self.shared),
            ptr: region.base,
            len,
            capacity: bytes,
            keys: region.keys,
            origin: Origin::Oversize(Some(region)),
        })
    }
}

impl fmt::Debug for TieredPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TieredPool").field("config", &self.shared.config).field("stats", &self.stats()).finish()
    }
}

impl Lease {
    /// The length asked for (or last set with [`set_len`](Self::set_len)).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether [`len`](Self::len) is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the underlying buffer (the tier size, or the page-rounded size of a one-off
    /// buffer); never less than `len`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the visible length, e.g. to the number of bytes actually received.
    pub fn set_len(&mut self, len: usize) -> Result<(), PoolError> {
        if len > self.capacity {
            return Err(PoolError::LenExceedsCapacity { requested: len, capacity: self.capacity });
        }
        self.len = len;
        Ok(())
    }

    /// The first `len` bytes of the buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer is `capacity >= len` bytes of mapped, initialised memory (anonymous
        // mappings start zeroed) owned by this lease alone until it is dropped.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The first `len` bytes of the buffer, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Address of the buffer, e.g. for a scatter/gather entry or a direct `ByteBuffer`.
    /// Valid for `capacity()` bytes while the lease lives.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Writable address of the buffer (for a receive or an RDMA READ into it). Valid for
    /// `capacity()` bytes while the lease lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Registration keys of the region holding this buffer.
    pub fn keys(&self) -> RegionKeys {
        self.keys
    }

    /// Whether this is a one-off buffer for a request above the largest tier.
    pub fn is_oversize(&self) -> bool {
        matches!(self.origin, Origin::Oversize(_))
    }

    /// Turns the lease into a raw pointer that can cross an FFI boundary (e.g. as a JNI
    /// `jlong`). The buffer stays leased (and `as_ptr()` stays valid) until the pointer is
    /// passed back to [`from_raw`](Self::from_raw) and the resulting lease is dropped.
    /// Costs one small heap allocation.
    pub fn into_raw(self) -> *mut Lease {
        Box::into_raw(Box::new(self))
    }

    /// Takes back a lease given away with [`into_raw`](Self::into_raw).
    ///
    /// # Safety
    ///
    /// `raw` must come from [`Lease::into_raw`] and this must be the only call with it:
    /// calling it twice (a double release from Java) frees the lease twice. Nothing may use
    /// the buffer (for instance a Java `ByteBuffer` wrapping `as_ptr()`) after the returned
    /// lease is dropped. Any thread may make the call.
    pub unsafe fn from_raw(raw: *mut Lease) -> Lease {
        // SAFETY: per the contract, `raw` is a live `Box<Lease>` pointer owned by the caller.
        *unsafe { Box::from_raw(raw) }
    }
}

impl Deref for Lease {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsMut<[u8]> for Lease {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("keys", &self.keys)
            .field("oversize", &self.is_oversize())
            .finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        match &mut self.origin {
            Origin::Tier { tier, buf } => self.shared.release_buffer(*tier, *buf),
            Origin::Oversize(region) => {
                // Deregister and unmap first, then give the bytes back, so mapped memory
                // never exceeds what the counters say.
                drop(region.take());
                self.shared.release_oversize(self.capacity as u64);
            }
        }
    }
}
