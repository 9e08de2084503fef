//! The pool's internals: tiers of slabs, free lists, reservations under the cap, reclaim.

use super::config::{round_up, PoolConfig, PoolError, PoolStats, TierSpec};
use crate::memory::accounting;
use crate::memory::registration::{RegionKeys, Registrar};
use memmap2::{MmapMut, MmapRaw};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};
use tracing::{debug, trace, warn};

/// Something to tell when pool memory comes back.
pub trait ReleaseHook: Send + Sync {
    /// A lease went back to the pool. Runs on the thread that dropped it, with no pool lock
    /// held; must be quick and must not block.
    fn released(&self);
}

/// Everything a pool handle or a lease shares.
pub(super) struct Shared {
    pub(super) config: PoolConfig,
    pub(super) tiers: Vec<TierSpec>,
    pub(super) cap: u64,
    pub(super) page: usize,
    pub(super) registrar: Arc<dyn Registrar>,
    pub(super) state: Mutex<State>,
    /// Signalled when memory comes back or a slab is installed. All waiters are woken: a
    /// returned buffer of one tier may let a waiter of another tier reclaim a slab.
    pub(super) cond: Condvar,
    /// Told (outside the state lock) whenever a lease comes back: lets an event loop that
    /// never blocks on the pool retry its `try_acquire`s.
    pub(super) hooks: Mutex<Vec<Weak<dyn ReleaseHook>>>,
}

pub(super) struct State {
    pub(super) tiers: Vec<TierState>,
    pub(super) stats: PoolStats,
    /// Threads blocked on `cond`; lets the release path skip the notify when nobody waits.
    pub(super) waiters: usize,
}

#[derive(Default)]
pub(super) struct TierState {
    /// Slots of live slabs; `None` once reclaimed (the slot is reused by the next slab), so
    /// the indices held by leases and free-list entries stay stable.
    pub(super) slabs: Vec<Option<Slab>>,
    /// Free buffers, used as a stack: the most recently returned buffer is handed out first
    /// (warm in cache), which also lets slabs at the bottom drain and become reclaimable.
    /// Its capacity is kept at `total_buffers`, so returning a buffer never allocates.
    pub(super) free: Vec<BufRef>,
    pub(super) total_buffers: usize,
    /// Spare buffers (all but the grower's own) of slabs being mapped right now. While
    /// non-zero, other requesters wait for them instead of growing a second slab.
    pub(super) inflight_spare: usize,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct BufRef {
    pub(super) slab: u32,
    pub(super) index: u32,
}

pub(super) struct Slab {
    pub(super) region: Region,
    pub(super) bytes: usize,
    pub(super) nbuf: u32,
    /// Buffers of this slab currently leased; the slab may be reclaimed only at zero.
    pub(super) busy: u32,
}

/// A mapped, registered memory region. Dropping it deregisters, then unmaps.
pub(super) struct Region {
    pub(super) map: MmapRaw,
    pub(super) base: NonNull<u8>,
    pub(super) keys: RegionKeys,
    pub(super) registrar: Arc<dyn Registrar>,
}

// SAFETY: `base` points into `map`, which `Region` owns; the pointer is not tied to a
// thread, and access to the memory is arbitrated by the pool (one lease per buffer).
unsafe impl Send for Region {}
// SAFETY: `Region` exposes no interior mutability of its own.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        accounting::credit(accounting::Kind::Pool, self.map.len() as u64);
        self.registrar.deregister(&self.keys);
        trace!(bytes = self.map.len(), handle = self.keys.handle, "pool region deregistered");
        // `map` is unmapped when the fields drop, after deregistration.
    }
}

pub(super) enum Origin {
    Tier {
        tier: usize,
        buf: BufRef,
    },
    /// `Option` only so `Drop` can unmap before updating the counters.
    Oversize(Option<Region>),
}

/// A buffer taken from a free list.
pub(super) struct Taken {
    pub(super) ptr: NonNull<u8>,
    pub(super) capacity: usize,
    pub(super) keys: RegionKeys,
    pub(super) origin: Origin,
}

#[derive(Clone, Copy)]
pub(super) enum Class {
    Tier(usize),
    /// Page-rounded bytes of a one-off buffer.
    Oversize(u64),
}

pub(super) enum Step<'a> {
    Leased(Taken),
    Grow {
        res: Reservation<'a>,
        tier: usize,
        nbuf: u32,
    },
    Oversize(Reservation<'a>),
    /// `backpressure`: waiting because of the cap (counted in `waits`), not merely for
    /// another thread's growth of the same tier.
    Wait {
        backpressure: bool,
    },
}

/// Bytes counted in `bytes_allocated` before they are mapped. If mapping or registration
/// fails (or panics), dropping the reservation gives the bytes back and wakes waiters.
/// Must not be dropped while the pool lock is held.
pub(super) struct Reservation<'a> {
    pub(super) shared: &'a Shared,
    pub(super) bytes: u64,
    /// `(tier, spare buffers)` added to that tier's `inflight_spare`.
    pub(super) inflight: Option<(usize, usize)>,
    /// Idle slabs taken out to make room; unmapped before the new mapping is made.
    pub(super) reclaimed: Vec<Slab>,
    pub(super) committed: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        drop(std::mem::take(&mut self.reclaimed));
        if self.committed {
            return;
        }
        let mut st = self.shared.state.lock();
        st.stats.bytes_allocated -= self.bytes;
        if let Some((tier, spare)) = self.inflight {
            st.tiers[tier].inflight_spare -= spare;
        }
        if st.waiters > 0 {
            self.shared.cond.notify_all();
        }
    }
}

impl Shared {
    pub(super) fn tier_for(&self, len: usize) -> Option<usize> {
        let t = self.tiers.partition_point(|spec| spec.size < len);
        (t < self.tiers.len()).then_some(t)
    }

    pub(super) fn classify(&self, len: usize) -> Result<Class, PoolError> {
        if let Some(tier) = self.tier_for(len) {
            return Ok(Class::Tier(tier));
        }
        match round_up(len, self.page) {
            Some(bytes) if bytes as u64 <= self.cap => Ok(Class::Oversize(bytes as u64)),
            _ => Err(PoolError::ExceedsCap { requested: len, cap: self.cap }),
        }
    }

    /// Mapped size of a slab of `nbuf` buffers of `tier`. Cannot overflow: validation
    /// checked the full slab, and `nbuf` is never above `per_slab`.
    pub(super) fn slab_bytes(&self, tier: usize, nbuf: u32) -> usize {
        let raw = nbuf as usize * self.tiers[tier].size;
        raw.div_ceil(self.page) * self.page
    }

    /// Largest slab of `tier` (up to a full one) that fits in `room` bytes.
    pub(super) fn slab_fit(&self, tier: usize, room: u64) -> Option<(u32, usize)> {
        // A rounded-up size fits in `room` iff the raw size fits in `room` rounded down.
        let usable = room - room % self.page as u64;
        let fit = usable / self.tiers[tier].size as u64;
        let nbuf = fit.min(u64::from(self.tiers[tier].per_slab)) as u32;
        (nbuf > 0).then(|| (nbuf, self.slab_bytes(tier, nbuf)))
    }

    pub(super) fn plan_tier<'a>(&'a self, st: &mut State, tier: usize) -> Step<'a> {
        if let Some(taken) = self.take_free(st, tier) {
            return Step::Leased(taken);
        }
        if st.tiers[tier].inflight_spare > 0 {
            return Step::Wait { backpressure: false };
        }
        let room = self.cap - st.stats.bytes_allocated;
        if let Some((nbuf, bytes)) = self.slab_fit(tier, room) {
            return self.reserve_slab(st, tier, nbuf, bytes, Vec::new());
        }
        for larger in tier + 1..self.tiers.len() {
            if let Some(taken) = self.take_free(st, larger) {
                return Step::Leased(taken);
            }
        }
        let need = self.slab_bytes(tier, 1) as u64;
        if let Some(reclaimed) = self.reclaim(st, need) {
            let room = self.cap - st.stats.bytes_allocated;
            // `reclaim` made at least `need` (whole pages) of room, so one buffer fits.
            if let Some((nbuf, bytes)) = self.slab_fit(tier, room) {
                return self.reserve_slab(st, tier, nbuf, bytes, reclaimed);
            }
        }
        Step::Wait { backpressure: true }
    }

    pub(super) fn plan_oversize<'a>(&'a self, st: &mut State, bytes: u64) -> Step<'a> {
        let reclaimed = if self.cap - st.stats.bytes_allocated >= bytes {
            Vec::new()
        } else if let Some(reclaimed) = self.reclaim(st, bytes) {
            reclaimed
        } else {
            return Step::Wait { backpressure: true };
        };
        st.stats.bytes_allocated += bytes;
        Step::Oversize(Reservation { shared: self, bytes, inflight: None, reclaimed, committed: false })
    }

    pub(super) fn reserve_slab<'a>(
        &'a self,
        st: &mut State,
        tier: usize,
        nbuf: u32,
        bytes: usize,
        reclaimed: Vec<Slab>,
    ) -> Step<'a> {
        let spare = nbuf as usize - 1;
        st.stats.bytes_allocated += bytes as u64;
        st.tiers[tier].inflight_spare += spare;
        Step::Grow {
            res: Reservation { shared: self, bytes: bytes as u64, inflight: Some((tier, spare)), reclaimed, committed: false },
            tier,
            nbuf,
        }
    }

    /// Takes fully idle slabs out of the pool until `need` bytes fit under the cap. Does
    /// nothing (and answers `None`) if even all idle slabs would not make enough room, so
    /// registrations are not thrown away for nothing.
    pub(super) fn reclaim(&self, st: &mut State, need: u64) -> Option<Vec<Slab>> {
        let mut room = self.cap - st.stats.bytes_allocated;
        let idle: u64 =
            st.tiers.iter().flat_map(|t| t.slabs.iter().flatten()).filter(|s| s.busy == 0).map(|s| s.bytes as u64).sum();
        if room + idle < need {
            return None;
        }
        let mut out = Vec::new();
        // Largest tiers first: fewer slabs to unmap (and to register again later).
        for ts in st.tiers.iter_mut().rev() {
            if room >= need {
                break;
            }
            let TierState { slabs, free, total_buffers, .. } = ts;
            let before = out.len();
            for slot in slabs.iter_mut() {
                if room >= need {
                    break;
                }
                if slot.as_ref().is_some_and(|s| s.busy == 0) {
                    if let Some(slab) = slot.take() {
                        room += slab.bytes as u64;
                        *total_buffers -= slab.nbuf as usize;
                        out.push(slab);
                    }
                }
            }
            if out.len() > before {
                free.retain(|b| slabs[b.slab as usize].is_some());
            }
        }
        let freed: u64 = out.iter().map(|s| s.bytes as u64).sum();
        st.stats.bytes_allocated -= freed;
        st.stats.reclaims += out.len() as u64;
        debug!(slabs = out.len(), bytes = freed, need, "pool reclaimed idle slabs");
        Some(out)
    }

    /// Pops a free buffer of `tier` and leases it (counters only; the `Lease` is built by the
    /// caller after the lock is released).
    pub(super) fn take_free(&self, st: &mut State, tier: usize) -> Option<Taken> {
        let size = self.tiers[tier].size;
        let ts = &mut st.tiers[tier];
        let buf = ts.free.pop()?;
        // Free-list entries always name live slabs (reclaim removes them with the slab).
        let slab = ts.slabs.get_mut(buf.slab as usize)?.as_mut()?;
        slab.busy += 1;
        // SAFETY: `index < nbuf`, so the offset stays inside the slab's mapping.
        let ptr = unsafe { slab.region.base.add(buf.index as usize * size) };
        let keys = slab.region.keys;
        st.stats.hits += 1;
        st.stats.note_lease(size as u64);
        Some(Taken { ptr, capacity: size, keys, origin: Origin::Tier { tier, buf } })
    }

    /// Puts a new slab into `tier` (its bytes are already counted as allocated) and answers
    /// its slot. With `lease_first`, buffer 0 stays out of the free list and counts as busy:
    /// the caller leases it.
    pub(super) fn install_slab(
        &self,
        st: &mut State,
        tier: usize,
        region: Region,
        bytes: usize,
        nbuf: u32,
        lease_first: bool,
    ) -> u32 {
        let ts = &mut st.tiers[tier];
        let slot = match ts.slabs.iter().position(Option::is_none) {
            Some(slot) => slot,
            None => {
                ts.slabs.push(None);
                ts.slabs.len() - 1
            }
        } as u32;
        ts.total_buffers += nbuf as usize;
        let missing = ts.total_buffers - ts.free.len();
        ts.free.reserve(missing);
        let first = u32::from(lease_first);
        // Pushed in reverse so the stack hands out ascending addresses.
        for index in (first..nbuf).rev() {
            ts.free.push(BufRef { slab: slot, index });
        }
        ts.slabs[slot as usize] = Some(Slab { region, bytes, nbuf, busy: first });
        slot
    }

    pub(super) fn release_buffer(&self, tier: usize, buf: BufRef) {
        let size = self.tiers[tier].size;
        let mut st = self.state.lock();
        let ts = &mut st.tiers[tier];
        match ts.slabs.get_mut(buf.slab as usize).and_then(Option::as_mut) {
            Some(slab) => {
                slab.busy -= 1;
                ts.free.push(buf);
            }
            // A leased buffer's slab is never reclaimed (busy > 0); log rather than panic
            // inside Drop, which may run under the JVM.
            None => warn!(tier = size, slab = buf.slab, "pool: lease returned to a missing slab"),
        }
        st.stats.bytes_in_use -= size as u64;
        if st.waiters > 0 {
            self.cond.notify_all();
        }
        drop(st);
        self.run_hooks();
    }

    pub(super) fn release_oversize(&self, bytes: u64) {
        let mut st = self.state.lock();
        st.stats.bytes_in_use -= bytes;
        st.stats.bytes_allocated -= bytes;
        if st.waiters > 0 {
            self.cond.notify_all();
        }
        drop(st);
        self.run_hooks();
    }

    fn run_hooks(&self) {
        let mut hooks = self.hooks.lock();
        if hooks.is_empty() {
            return;
        }
        hooks.retain(|h| match h.upgrade() {
            Some(h) => {
                h.released();
                true
            }
            None => false,
        });
    }

    /// Maps and registers the memory reserved in `res`, then commits the reservation under
    /// the state lock, which it returns held. Reclaimed slabs are unmapped first, so mapped
    /// memory stays under the cap even in between; on error `res` (dropped by the caller)
    /// gives the reservation back.
    pub(super) fn map_reserved(&self, res: &mut Reservation<'_>) -> Result<(Region, MutexGuard<'_, State>), PoolError> {
        drop(std::mem::take(&mut res.reclaimed));
        let region = self.map_region(res.bytes as usize)?;
        let st = self.state.lock();
        res.committed = true;
        Ok((region, st))
    }

    /// Maps `bytes` (a page multiple) of anonymous memory and registers it. Runs without
    /// the pool lock.
    pub(super) fn map_region(&self, bytes: usize) -> Result<Region, PoolError> {
        let map: MmapRaw = MmapMut::map_anon(bytes).map_err(|source| PoolError::Alloc { bytes, source })?.into();
        let base = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| PoolError::Alloc { bytes, source: io::Error::other("mmap returned a null address") })?;
        match self.registrar.register(base.as_ptr(), bytes) {
            Ok(keys) => {
                // Counted from here until the region drops (it unmaps then).
                accounting::charge(accounting::Kind::Pool, bytes as u64);
                Ok(Region { map, base, keys, registrar: Arc::clone(&self.registrar) })
            }
            Err(e) => {
                // `map` is unmapped on return; nothing was registered.
                warn!(bytes, error = %e, "pool memory registration failed");
                Err(e)
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Runs when the last pool handle and the last lease are gone; the slabs (and their
        // registrations) are released as `state` drops.
        let st = self.state.get_mut();
        debug!(bytes = st.stats.bytes_allocated, peak_in_use = st.stats.peak_bytes_in_use, "memory pool released");
    }
}
