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

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use memmap2::{MmapMut, MmapRaw};
use parking_lot::{Condvar, Mutex, MutexGuard};
use tracing::{debug, trace, warn};

/// Name of the user-facing setting that sets [`PoolConfig::cap_bytes`]; quoted in errors so
/// a user knows what to change.
pub const CAP_BYTES_SETTING: &str = "spark.shuffle.rdma.pool.capBytes";

/// Smallest alignment of a slab. Slabs are mmapped, so they are aligned to the system page,
/// which is never smaller than this on the platforms we run on.
pub const SLAB_ALIGN: usize = 4096;

/// Most tiers a pool may have; more would only make tier selection and reclaim slower.
pub const MAX_TIERS: usize = 64;

/// Errors of the memory pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The [`PoolConfig`] is unusable; the message names the field and the limit.
    #[error("invalid memory pool configuration: {0}")]
    Config(String),
    /// The deadline passed while the pool was at its cap and no buffer came back.
    #[error(
        "timed out waiting for {requested} bytes of pool memory: {in_use} of {cap} bytes are \
         leased; raise {setting} or fetch fewer blocks at once",
        setting = CAP_BYTES_SETTING
    )]
    Timeout {
        /// Bytes the caller asked for.
        requested: usize,
        /// The pool's cap in bytes.
        cap: u64,
        /// Bytes leased out when the deadline passed.
        in_use: u64,
    },
    /// The request can never be served: it is larger than the whole pool.
    #[error(
        "a request for {requested} bytes exceeds the memory pool cap of {cap} bytes; \
         raise {setting} above {requested}",
        setting = CAP_BYTES_SETTING
    )]
    ExceedsCap {
        /// Bytes the caller asked for.
        requested: usize,
        /// The pool's cap in bytes.
        cap: u64,
    },
    /// The [`Registrar`] refused to register a region (for verbs, typically `ENOMEM` from
    /// `ibv_reg_mr` because the memlock limit is too low).
    #[error("registering {bytes} bytes of pool memory failed: {source}")]
    Registration {
        /// Length of the region that could not be registered.
        bytes: usize,
        /// Why the provider refused.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// Mapping memory for a slab or an oversize buffer failed.
    #[error("mapping {bytes} bytes of pool memory failed: {source}")]
    Alloc {
        /// Length of the mapping that failed.
        bytes: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// [`Lease::set_len`] was asked for more than the buffer holds.
    #[error("length {requested} exceeds the lease capacity of {capacity} bytes")]
    LenExceedsCapacity {
        /// The length asked for.
        requested: usize,
        /// The buffer's capacity.
        capacity: usize,
    },
}

/// Keys of a registered memory region, as the provider needs them to post work on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RegionKeys {
    /// Local key (verbs `lkey`), used in scatter/gather entries of local work requests.
    pub lkey: u32,
    /// Remote key (verbs `rkey`), handed to a peer so it can RDMA into or out of the region.
    pub rkey: u32,
    /// Provider-private handle of the registration (for verbs, the `ibv_mr` pointer), so
    /// [`Registrar::deregister`] can find it again.
    pub handle: u64,
}

/// Registers pool memory with a provider. Called once per slab (and once per oversize
/// buffer), never on the acquire hot path.
pub trait Registrar: Send + Sync {
    /// Registers `len` bytes at `addr` (page-aligned, mapped, readable and writable, and
    /// valid until the matching [`deregister`](Registrar::deregister) returns).
    ///
    /// Failure must be reported as an error (usually [`PoolError::Registration`]); the pool
    /// unmaps the region and passes the error to the caller of `acquire`.
    fn register(&self, addr: *mut u8, len: usize) -> Result<RegionKeys, PoolError>;

    /// Deregisters a region registered by [`register`](Registrar::register). Called exactly
    /// once per successful registration, before the memory is unmapped. Must not panic: it
    /// runs inside `Drop`; log failures instead.
    fn deregister(&self, keys: &RegionKeys);
}

/// [`Registrar`] for providers that need no registration (TCP, simulation): every region
/// gets all-zero keys.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRegistration;

impl Registrar for NoRegistration {
    fn register(&self, _addr: *mut u8, _len: usize) -> Result<RegionKeys, PoolError> {
        Ok(RegionKeys::default())
    }

    fn deregister(&self, _keys: &RegionKeys) {}
}

/// Shape and limits of a [`TieredPool`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Buffer sizes in bytes, strictly increasing and non-zero. A request is served by the
    /// smallest tier that fits it; requests above the largest tier get a one-off buffer.
    pub tiers: Vec<usize>,
    /// Bytes mapped at a time when a tier grows. A slab holds `slab_bytes / tier` buffers,
    /// but always at least one. Near the cap a slab is cut down to what still fits.
    pub slab_bytes: usize,
    /// Hard cap on bytes mapped by the pool (slabs and oversize buffers, each rounded up to
    /// whole pages). Set by [`CAP_BYTES_SETTING`].
    pub cap_bytes: u64,
    /// Map and register one full slab of every tier when the pool is created, so the first
    /// fetches do not pay for registration.
    pub prealloc: bool,
}

/// The default size classes: x4 steps from 4 KiB to 1 MiB, then x2 steps to 16 MiB.
///
/// A block takes the smallest tier that holds it, and the fetch budget is charged at that
/// size, so the ratio between neighbouring tiers bounds the waste. Shuffle blocks of a few MiB
/// are the common case for large jobs (13 M records over 32 x 32 partitions are 1.4 MB each):
/// with a 1 MiB → 16 MiB jump each of them held 16 MiB of registered memory and of the
/// in-flight budget. Below 1 MiB the absolute waste is small, so fewer, coarser tiers keep the
/// number of partly used slabs (each a memory registration) down.
pub const DEFAULT_TIERS: [usize; 9] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20];

impl Default for PoolConfig {
    /// [`DEFAULT_TIERS`] (4 KiB … 16 MiB); 4 MiB slabs; a 256 MiB cap; no preallocation.
    fn default() -> Self {
        Self { tiers: DEFAULT_TIERS.to_vec(), slab_bytes: 4 << 20, cap_bytes: 256 << 20, prealloc: false }
    }
}

impl PoolConfig {
    /// Checks the configuration; the error names the field that is wrong and why.
    pub fn validate(&self) -> Result<(), PoolError> {
        self.tier_specs().map(|_| ())
    }

    /// Validates and derives the per-tier layout.
    fn tier_specs(&self) -> Result<Vec<TierSpec>, PoolError> {
        let bad = |msg: String| Err(PoolError::Config(msg));
        if self.tiers.is_empty() {
            return bad("`tiers` is empty; the pool needs at least one buffer size".into());
        }
        if self.tiers.len() > MAX_TIERS {
            return bad(format!("`tiers` has {} sizes; at most {MAX_TIERS} are supported", self.tiers.len()));
        }
        if self.tiers[0] == 0 {
            return bad("`tiers` contains a zero buffer size".into());
        }
        if let Some(w) = self.tiers.windows(2).find(|w| w[0] >= w[1]) {
            return bad(format!("`tiers` must be strictly increasing, but {} is followed by {}", w[0], w[1]));
        }
        if self.slab_bytes == 0 {
            return bad("`slab_bytes` is 0; a slab must hold at least one buffer".into());
        }
        let page = page_size();
        let largest = *self.tiers.last().unwrap_or(&0);
        let largest_mapped =
            round_up(largest, page).ok_or_else(|| PoolError::Config(format!("tier size {largest} is too large to map")))?;
        if (largest_mapped as u64) > self.cap_bytes {
            return bad(format!(
                "`cap_bytes` ({}, set by {CAP_BYTES_SETTING}) is smaller than one buffer of the \
                 largest tier ({largest_mapped} bytes once rounded up to whole pages); raise \
                 the cap or drop the tier",
                self.cap_bytes
            ));
        }
        let mut specs = Vec::with_capacity(self.tiers.len());
        let mut prealloc_total: u64 = 0;
        for &size in &self.tiers {
            let per_slab = (self.slab_bytes / size).max(1);
            let per_slab = u32::try_from(per_slab).map_err(|_| {
                PoolError::Config(format!(
                    "`slab_bytes` ({}) would put {per_slab} buffers of {size} bytes in one \
                     slab; at most {} are supported",
                    self.slab_bytes,
                    u32::MAX
                ))
            })?;
            let slab_mapped = (per_slab as usize)
                .checked_mul(size)
                .and_then(|b| round_up(b, page))
                .ok_or_else(|| PoolError::Config(format!("`slab_bytes` ({}) is too large to map", self.slab_bytes)))?;
            prealloc_total = prealloc_total.saturating_add(slab_mapped as u64);
            specs.push(TierSpec { size, per_slab });
        }
        if self.prealloc && prealloc_total > self.cap_bytes {
            return bad(format!(
                "`prealloc` needs one slab per tier ({prealloc_total} bytes) but `cap_bytes` \
                 ({}, set by {CAP_BYTES_SETTING}) is smaller; lower `slab_bytes`, raise the \
                 cap or turn `prealloc` off",
                self.cap_bytes
            ));
        }
        Ok(specs)
    }
}

/// Snapshot of the pool's counters, all taken under one lock so they are consistent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes mapped (or being mapped) by the pool; never above the cap.
    pub bytes_allocated: u64,
    /// Bytes of buffers currently leased (each lease counts its full capacity).
    pub bytes_in_use: u64,
    /// Highest `bytes_in_use` ever seen (exact: updated under the same lock).
    pub peak_bytes_in_use: u64,
    /// Leases handed out.
    pub acquires: u64,
    /// Leases served from a free list (of the right or a larger tier), without mapping.
    pub hits: u64,
    /// Slabs mapped and registered, including preallocated ones.
    pub grows: u64,
    /// Acquires that had to wait for memory to come back (counted once per acquire).
    pub waits: u64,
    /// Acquires that failed with [`PoolError::Timeout`].
    pub timeouts: u64,
    /// Idle slabs unmapped to make room for another tier or an oversize buffer.
    pub reclaims: u64,
    /// One-off buffers handed out for requests above the largest tier.
    pub oversize: u64,
}

impl PoolStats {
    /// Counts one lease of `bytes` (its full capacity) and keeps the peak exact.
    fn note_lease(&mut self, bytes: u64) {
        self.bytes_in_use += bytes;
        self.peak_bytes_in_use = self.peak_bytes_in_use.max(self.bytes_in_use);
        self.acquires += 1;
    }
}

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

// ---------------------------------------------------------------------------------------
// Internals

/// Everything a pool handle or a lease shares.
struct Shared {
    config: PoolConfig,
    tiers: Vec<TierSpec>,
    cap: u64,
    page: usize,
    registrar: Arc<dyn Registrar>,
    state: Mutex<State>,
    /// Signalled when memory comes back or a slab is installed. All waiters are woken: a
    /// returned buffer of one tier may let a waiter of another tier reclaim a slab.
    cond: Condvar,
}

struct TierSpec {
    size: usize,
    per_slab: u32,
}

struct State {
    tiers: Vec<TierState>,
    stats: PoolStats,
    /// Threads blocked on `cond`; lets the release path skip the notify when nobody waits.
    waiters: usize,
}

#[derive(Default)]
struct TierState {
    /// Slots of live slabs; `None` once reclaimed (the slot is reused by the next slab), so
    /// the indices held by leases and free-list entries stay stable.
    slabs: Vec<Option<Slab>>,
    /// Free buffers, used as a stack: the most recently returned buffer is handed out first
    /// (warm in cache), which also lets slabs at the bottom drain and become reclaimable.
    /// Its capacity is kept at `total_buffers`, so returning a buffer never allocates.
    free: Vec<BufRef>,
    total_buffers: usize,
    /// Spare buffers (all but the grower's own) of slabs being mapped right now. While
    /// non-zero, other requesters wait for them instead of growing a second slab.
    inflight_spare: usize,
}

#[derive(Debug, Clone, Copy)]
struct BufRef {
    slab: u32,
    index: u32,
}

struct Slab {
    region: Region,
    bytes: usize,
    nbuf: u32,
    /// Buffers of this slab currently leased; the slab may be reclaimed only at zero.
    busy: u32,
}

/// A mapped, registered memory region. Dropping it deregisters, then unmaps.
struct Region {
    map: MmapRaw,
    base: NonNull<u8>,
    keys: RegionKeys,
    registrar: Arc<dyn Registrar>,
}

// SAFETY: `base` points into `map`, which `Region` owns; the pointer is not tied to a
// thread, and access to the memory is arbitrated by the pool (one lease per buffer).
unsafe impl Send for Region {}
// SAFETY: `Region` exposes no interior mutability of its own.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        self.registrar.deregister(&self.keys);
        trace!(bytes = self.map.len(), handle = self.keys.handle, "pool region deregistered");
        // `map` is unmapped when the fields drop, after deregistration.
    }
}

enum Origin {
    Tier {
        tier: usize,
        buf: BufRef,
    },
    /// `Option` only so `Drop` can unmap before updating the counters.
    Oversize(Option<Region>),
}

/// A buffer taken from a free list.
struct Taken {
    ptr: NonNull<u8>,
    capacity: usize,
    keys: RegionKeys,
    origin: Origin,
}

#[derive(Clone, Copy)]
enum Class {
    Tier(usize),
    /// Page-rounded bytes of a one-off buffer.
    Oversize(u64),
}

enum Step<'a> {
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
struct Reservation<'a> {
    shared: &'a Shared,
    bytes: u64,
    /// `(tier, spare buffers)` added to that tier's `inflight_spare`.
    inflight: Option<(usize, usize)>,
    /// Idle slabs taken out to make room; unmapped before the new mapping is made.
    reclaimed: Vec<Slab>,
    committed: bool,
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
    fn tier_for(&self, len: usize) -> Option<usize> {
        let t = self.tiers.partition_point(|spec| spec.size < len);
        (t < self.tiers.len()).then_some(t)
    }

    fn classify(&self, len: usize) -> Result<Class, PoolError> {
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
    fn slab_bytes(&self, tier: usize, nbuf: u32) -> usize {
        let raw = nbuf as usize * self.tiers[tier].size;
        raw.div_ceil(self.page) * self.page
    }

    /// Largest slab of `tier` (up to a full one) that fits in `room` bytes.
    fn slab_fit(&self, tier: usize, room: u64) -> Option<(u32, usize)> {
        // A rounded-up size fits in `room` iff the raw size fits in `room` rounded down.
        let usable = room - room % self.page as u64;
        let fit = usable / self.tiers[tier].size as u64;
        let nbuf = fit.min(u64::from(self.tiers[tier].per_slab)) as u32;
        (nbuf > 0).then(|| (nbuf, self.slab_bytes(tier, nbuf)))
    }

    fn plan_tier<'a>(&'a self, st: &mut State, tier: usize) -> Step<'a> {
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

    fn plan_oversize<'a>(&'a self, st: &mut State, bytes: u64) -> Step<'a> {
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

    fn reserve_slab<'a>(&'a self, st: &mut State, tier: usize, nbuf: u32, bytes: usize, reclaimed: Vec<Slab>) -> Step<'a> {
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
    fn reclaim(&self, st: &mut State, need: u64) -> Option<Vec<Slab>> {
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
    fn take_free(&self, st: &mut State, tier: usize) -> Option<Taken> {
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
    fn install_slab(&self, st: &mut State, tier: usize, region: Region, bytes: usize, nbuf: u32, lease_first: bool) -> u32 {
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

    fn release_buffer(&self, tier: usize, buf: BufRef) {
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
    }

    fn release_oversize(&self, bytes: u64) {
        let mut st = self.state.lock();
        st.stats.bytes_in_use -= bytes;
        st.stats.bytes_allocated -= bytes;
        if st.waiters > 0 {
            self.cond.notify_all();
        }
    }

    /// Maps and registers the memory reserved in `res`, then commits the reservation under
    /// the state lock, which it returns held. Reclaimed slabs are unmapped first, so mapped
    /// memory stays under the cap even in between; on error `res` (dropped by the caller)
    /// gives the reservation back.
    fn map_reserved(&self, res: &mut Reservation<'_>) -> Result<(Region, MutexGuard<'_, State>), PoolError> {
        drop(std::mem::take(&mut res.reclaimed));
        let region = self.map_region(res.bytes as usize)?;
        let st = self.state.lock();
        res.committed = true;
        Ok((region, st))
    }

    /// Maps `bytes` (a page multiple) of anonymous memory and registers it. Runs without
    /// the pool lock.
    fn map_region(&self, bytes: usize) -> Result<Region, PoolError> {
        let map: MmapRaw = MmapMut::map_anon(bytes).map_err(|source| PoolError::Alloc { bytes, source })?.into();
        let base = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| PoolError::Alloc { bytes, source: io::Error::other("mmap returned a null address") })?;
        match self.registrar.register(base.as_ptr(), bytes) {
            Ok(keys) => Ok(Region { map, base, keys, registrar: Arc::clone(&self.registrar) }),
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

fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page).unwrap_or(SLAB_ALIGN).max(SLAB_ALIGN)
    })
}

/// `n` rounded up to a multiple of `to`, and at least `to`: a mapping is never empty.
fn round_up(n: usize, to: usize) -> Option<usize> {
    Some((n.checked_add(to - 1)? / to * to).max(to))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::thread;
    use std::time::Duration;

    const KIB: usize = 1024;
    const MIB: usize = 1024 * 1024;

    fn cfg(tiers: &[usize], slab_bytes: usize, cap_bytes: usize) -> PoolConfig {
        PoolConfig { tiers: tiers.to_vec(), slab_bytes, cap_bytes: cap_bytes as u64, prealloc: false }
    }

    /// Registrar that records every region, checks alignment and overlap, and can be told to
    /// fail like `ibv_reg_mr` does when the memlock limit is hit.
    #[derive(Default)]
    struct CountingRegistrar {
        live: Mutex<HashMap<u64, (usize, usize)>>,
        next: AtomicU64,
        registers: AtomicUsize,
        deregisters: AtomicUsize,
        /// Deregistrations of unknown handles, misaligned or overlapping registrations.
        violations: AtomicUsize,
        fail: AtomicBool,
    }

    impl CountingRegistrar {
        fn live(&self) -> usize {
            self.live.lock().len()
        }
        fn region(&self, handle: u64) -> Option<(usize, usize)> {
            self.live.lock().get(&handle).copied()
        }
    }

    impl Registrar for CountingRegistrar {
        fn register(&self, addr: *mut u8, len: usize) -> Result<RegionKeys, PoolError> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(PoolError::Registration {
                    bytes: len,
                    source: "Cannot allocate memory (simulated memlock limit)".into(),
                });
            }
            let addr = addr as usize;
            let mut live = self.live.lock();
            let overlaps = live.values().any(|&(a, l)| addr < a + l && a < addr + len);
            if overlaps || (addr | len) & (SLAB_ALIGN - 1) != 0 {
                self.violations.fetch_add(1, Ordering::SeqCst);
            }
            let handle = self.next.fetch_add(1, Ordering::SeqCst) + 1;
            live.insert(handle, (addr, len));
            self.registers.fetch_add(1, Ordering::SeqCst);
            Ok(RegionKeys { lkey: handle as u32, rkey: handle as u32 + 1000, handle })
        }

        fn deregister(&self, keys: &RegionKeys) {
            if self.live.lock().remove(&keys.handle).is_none() {
                self.violations.fetch_add(1, Ordering::SeqCst);
            }
            self.deregisters.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counted(config: PoolConfig) -> (TieredPool, Arc<CountingRegistrar>) {
        let reg = Arc::new(CountingRegistrar::default());
        let pool = TieredPool::new(config, reg.clone()).expect("valid config");
        (pool, reg)
    }

    /// The lease lies inside the region registered under its keys.
    fn assert_inside_its_region(lease: &Lease, reg: &CountingRegistrar) {
        let (addr, len) = reg.region(lease.keys().handle).expect("lease keys name a live region");
        let p = lease.as_ptr() as usize;
        assert!(p >= addr && p + lease.capacity() <= addr + len, "{lease:?} outside {addr:#x}+{len}");
        assert_eq!(lease.keys().lkey as u64, lease.keys().handle);
        assert_eq!(lease.keys().rkey as u64, lease.keys().handle + 1000);
    }

    /// Polls `cond` for up to 10 s (tests must not hang if the pool misbehaves).
    fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < end, "timed out waiting for: {what}");
            thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn default_config_is_valid() {
        let c = PoolConfig::default();
        assert_eq!(c.tiers, DEFAULT_TIERS.to_vec());
        assert_eq!(c.cap_bytes, 256 * MIB as u64);
        c.validate().unwrap();
    }

    #[test]
    fn config_validation_names_the_problem() {
        let cases: Vec<(PoolConfig, &str)> = vec![
            (cfg(&[], MIB, MIB), "empty"),
            (cfg(&[0, 4 * KIB], MIB, MIB), "zero"),
            (cfg(&[64 * KIB, 4 * KIB], MIB, MIB), "strictly increasing"),
            (cfg(&[4 * KIB, 4 * KIB], MIB, MIB), "strictly increasing"),
            (cfg(&[4 * KIB], 0, MIB), "slab_bytes"),
            (cfg(&[4 * KIB, MIB], MIB, 512 * KIB), CAP_BYTES_SETTING),
            (PoolConfig { prealloc: true, ..cfg(&[4 * KIB, 64 * KIB], MIB, MIB) }, "prealloc"),
        ];
        for (config, needle) in cases {
            match config.validate() {
                Err(PoolError::Config(msg)) => {
                    assert!(msg.contains(needle), "{config:?}: message {msg:?} lacks {needle:?}")
                }
                other => panic!("{config:?} should be rejected, got {other:?}"),
            }
            assert!(matches!(TieredPool::unregistered(config), Err(PoolError::Config(_))));
        }
        // Exactly at the limits is fine.
        cfg(&[4 * KIB, MIB], MIB, MIB).validate().unwrap();
        PoolConfig { prealloc: true, ..cfg(&[4 * KIB, 64 * KIB], 64 * KIB, 128 * KIB) }.validate().unwrap();
    }

    #[test]
    fn default_tiers_bound_the_waste_of_rounding_up() {
        // Any request from 1 byte to the largest tier gets a buffer at most 4x its size, and
        // at most 2x from 1 MiB up (where the bytes matter).
        let pool = TieredPool::unregistered(PoolConfig::default()).unwrap();
        let mut len = 4 * KIB + 1;
        while len <= 16 * MIB {
            let cap = pool.tier_capacity_for(len).unwrap();
            let bound = if len > MIB { 2 } else { 4 };
            assert!(cap >= len && cap < bound * len, "len {len} gets {cap}");
            len = len * 5 / 4 + 1;
        }
        // A 1.4 MB block (13 M records over 32 x 32 partitions) takes 2 MiB, not 16 MiB.
        assert_eq!(pool.tier_capacity_for(1_400_000), Some(2 * MIB));
    }

    #[test]
    fn tier_selection_is_exact() {
        let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB, MIB, 16 * MIB], 4 * MIB, 256 * MIB)).unwrap();
        let cases = [
            (0, 4 * KIB),
            (1, 4 * KIB),
            (4 * KIB, 4 * KIB),
            (4 * KIB + 1, 64 * KIB),
            (64 * KIB, 64 * KIB),
            (64 * KIB + 1, MIB),
            (MIB, MIB),
            (MIB + 1, 16 * MIB),
            (16 * MIB, 16 * MIB),
        ];
        for (len, capacity) in cases {
            assert_eq!(pool.tier_capacity_for(len), Some(capacity), "len {len}");
            let lease = pool.acquire(len, None).unwrap();
            assert_eq!((lease.len(), lease.capacity()), (len, capacity), "len {len}");
            assert!(!lease.is_oversize());
            assert_eq!(lease.as_slice().len(), len);
        }
        assert_eq!(pool.tier_capacity_for(16 * MIB + 1), None);
        let big = pool.acquire(16 * MIB + 1, None).unwrap();
        assert!(big.is_oversize());
        assert_eq!(big.capacity(), round_up(16 * MIB + 1, page_size()).unwrap());
    }

    #[test]
    fn grows_by_slabs_then_reuses_buffers() {
        // 4 buffers per slab.
        let pool = TieredPool::unregistered(cfg(&[4 * KIB], 16 * KIB, MIB)).unwrap();
        let first = pool.acquire(100, None).unwrap();
        let addr = first.as_ptr();
        assert_eq!(addr as usize % SLAB_ALIGN, 0, "slabs are page-aligned");
        let s = pool.stats();
        assert_eq!((s.grows, s.hits, s.acquires, s.bytes_allocated), (1, 0, 1, 16 * KIB as u64));
        drop(first);
        let again = pool.acquire(4 * KIB, None).unwrap();
        assert_eq!(again.as_ptr(), addr, "the returned buffer is reused");
        let s = pool.stats();
        assert_eq!((s.grows, s.hits, s.acquires), (1, 1, 2));

        let mut leases = vec![again];
        for _ in 0..3 {
            leases.push(pool.acquire(4 * KIB, None).unwrap());
        }
        assert_eq!(pool.stats().grows, 1, "one slab holds four buffers");
        let mut addrs: Vec<usize> = leases.iter().map(|l| l.as_ptr() as usize).collect();
        addrs.sort_unstable();
        assert!(addrs.windows(2).all(|w| w[1] - w[0] == 4 * KIB), "buffers tile the slab");
        leases.push(pool.acquire(1, None).unwrap());
        let s = pool.stats();
        assert_eq!((s.grows, s.bytes_allocated, s.bytes_in_use), (2, 32 * KIB as u64, 20 * KIB as u64));
        drop(leases);
        let s = pool.stats();
        assert_eq!((s.bytes_in_use, s.peak_bytes_in_use, s.bytes_allocated), (0, 20 * KIB as u64, 32 * KIB as u64));
        // A new peak reached through free-list hits alone is recorded too.
        let hits_before = s.hits;
        let six: Vec<Lease> = (0..6).map(|_| pool.acquire(1, None).unwrap()).collect();
        let s = pool.stats();
        assert_eq!((s.hits - hits_before, s.grows, s.peak_bytes_in_use), (6, 2, 24 * KIB as u64));
        drop(six);
    }

    #[test]
    fn falls_back_to_a_free_larger_buffer_at_the_cap() {
        let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, 128 * KIB)).unwrap();
        drop((pool.acquire(64 * KIB, None).unwrap(), pool.acquire(64 * KIB, None).unwrap()));
        assert_eq!(pool.stats().bytes_allocated, 128 * KIB as u64);
        let small = pool.acquire(10, None).unwrap();
        assert_eq!((small.len(), small.capacity()), (10, 64 * KIB));
        let s = pool.stats();
        assert_eq!((s.grows, s.hits, s.reclaims), (2, 1, 0));
    }

    #[test]
    fn cap_holds_and_a_waiter_wakes_when_a_lease_returns() {
        let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, 128 * KIB)).unwrap();
        let a = pool.acquire(64 * KIB, None).unwrap();
        let b = pool.acquire(64 * KIB, None).unwrap();
        assert!(pool.try_acquire(64 * KIB).unwrap().is_none());
        assert!(pool.try_acquire(1).unwrap().is_none(), "no room, no free buffer, no idle slab");
        assert_eq!(pool.stats().waits, 0, "try_acquire never waits");

        let waiter = {
            let pool = pool.clone();
            // A deadline so a lost wake-up fails the test instead of hanging it.
            thread::spawn(move || pool.acquire(60 * KIB, Some(Instant::now() + Duration::from_secs(20))))
        };
        eventually("the waiter blocks", || pool.stats().waits == 1);
        thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "must wait, not grow past the cap");
        assert_eq!(pool.stats().bytes_allocated, 128 * KIB as u64);
        let b_addr = b.as_ptr();
        let returned = Instant::now();
        drop(b);
        let got = waiter.join().unwrap().unwrap();
        // Well before its 20 s deadline: woken by the return, not by the deadline's retry.
        assert!(returned.elapsed() < Duration::from_secs(5), "{:?}", returned.elapsed());
        assert_eq!(got.as_ptr(), b_addr);
        let s = pool.stats();
        assert_eq!((s.grows, s.bytes_allocated, s.bytes_in_use), (2, 128 * KIB as u64, 128 * KIB as u64));
        assert!(s.peak_bytes_in_use <= 128 * KIB as u64);
        drop((a, got));
    }

    #[test]
    fn deadline_gives_a_timeout_error_with_the_numbers() {
        let pool = TieredPool::unregistered(cfg(&[4 * KIB], 4 * KIB, 8 * KIB)).unwrap();
        let held = (pool.acquire(1, None).unwrap(), pool.acquire(1, None).unwrap());
        let start = Instant::now();
        let err = pool.acquire(100, Some(start + Duration::from_millis(50))).unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(50));
        match &err {
            PoolError::Timeout { requested, cap, in_use } => {
                assert_eq!((*requested, *cap, *in_use), (100, 8 * KIB as u64, 8 * KIB as u64))
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(err.to_string().contains(CAP_BYTES_SETTING), "{err}");
        // A deadline already past still fails cleanly.
        assert!(matches!(pool.acquire(1, Some(Instant::now())), Err(PoolError::Timeout { .. })));
        let s = pool.stats();
        assert_eq!((s.timeouts, s.waits, s.bytes_allocated), (2, 2, 8 * KIB as u64));

        // A lease coming back before the deadline satisfies the waiter.
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(30));
            drop(held);
        });
        let start = Instant::now();
        let got = pool.acquire(100, Some(start + Duration::from_secs(20))).unwrap();
        assert!(start.elapsed() < Duration::from_secs(5), "woken by the return: {:?}", start.elapsed());
        assert_eq!(got.capacity(), 4 * KIB);
        releaser.join().unwrap();
        assert_eq!(pool.stats().timeouts, 2);
    }

    #[test]
    fn oversize_requests_get_a_registered_one_off_buffer() {
        let (pool, reg) = counted(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB));
        let mut big = pool.acquire(100_000, None).unwrap();
        let mapped = round_up(100_000, page_size()).unwrap();
        assert!(big.is_oversize());
        assert_eq!((big.len(), big.capacity()), (100_000, mapped));
        assert_inside_its_region(&big, &reg);
        assert_eq!(reg.region(big.keys().handle), Some((big.as_ptr() as usize, mapped)));
        big.fill(0xab);
        assert!(big.iter().all(|&b| b == 0xab));
        let s = pool.stats();
        assert_eq!((s.oversize, s.grows, s.bytes_allocated, s.bytes_in_use), (1, 0, mapped as u64, mapped as u64));
        drop(big);
        let s = pool.stats();
        assert_eq!((s.bytes_allocated, s.bytes_in_use, s.peak_bytes_in_use), (0, 0, mapped as u64));
        assert_eq!((reg.live(), reg.registers.load(Ordering::SeqCst), reg.deregisters.load(Ordering::SeqCst)), (0, 1, 1));
    }

    #[test]
    fn requests_above_the_cap_fail_at_once() {
        let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB)).unwrap();
        let _hold = pool.acquire(64 * KIB, None).unwrap();
        for len in [MIB + 1, usize::MAX] {
            // No deadline: it must not wait.
            match pool.acquire(len, None) {
                Err(PoolError::ExceedsCap { requested, cap }) => {
                    assert_eq!((requested, cap), (len, MIB as u64))
                }
                other => panic!("expected ExceedsCap, got {other:?}"),
            }
            let err = pool.try_acquire(len).unwrap_err();
            assert!(err.to_string().contains(CAP_BYTES_SETTING), "{err}");
        }
        // Exactly the cap is servable once the memory is free.
        assert!(pool.try_acquire(MIB).unwrap().is_none(), "64 KiB are held");
        drop(_hold);
        let whole = pool.acquire(MIB, None).unwrap();
        assert_eq!(whole.capacity(), MIB);
        let s = pool.stats();
        assert_eq!((s.reclaims, s.bytes_allocated, s.waits), (1, MIB as u64, 0));
    }

    #[test]
    fn idle_slabs_of_other_tiers_are_reclaimed_to_make_room() {
        let (pool, reg) = counted(cfg(&[4 * KIB, 512 * KIB], 512 * KIB, MIB));
        // 128 small buffers per slab: 129 leases fill two slabs and the whole cap.
        let mut small: Vec<Lease> = (0..129).map(|_| pool.acquire(4 * KIB, None).unwrap()).collect();
        assert_eq!((pool.stats().grows, pool.stats().bytes_allocated), (2, MIB as u64));
        for (i, l) in small.iter_mut().enumerate() {
            l.fill(i as u8);
        }
        assert!(pool.try_acquire(512 * KIB).unwrap().is_none(), "both slabs are busy");

        let last = small.pop().unwrap();
        let idle_handle = last.keys().handle;
        drop(last);
        let large = pool.try_acquire(512 * KIB).unwrap().expect("idle slab reclaimed");
        assert_eq!(large.capacity(), 512 * KIB);
        let s = pool.stats();
        assert_eq!((s.reclaims, s.grows, s.bytes_allocated), (1, 3, MIB as u64));
        assert_eq!(reg.region(idle_handle), None, "the reclaimed slab was deregistered");
        assert_eq!(reg.deregisters.load(Ordering::SeqCst), 1);
        assert_inside_its_region(&large, &reg);
        for (i, l) in small.iter().enumerate() {
            assert!(l.iter().all(|&b| b == i as u8), "busy slab untouched");
            assert_inside_its_region(l, &reg);
        }

        // An oversize request reclaims as many idle slabs as it needs, largest first.
        drop((small, large));
        let huge = pool.acquire(600 * KIB, None).unwrap();
        assert!(huge.is_oversize());
        let s = pool.stats();
        assert_eq!((s.reclaims, s.bytes_allocated), (3, round_up(600 * KIB, page_size()).unwrap() as u64));
        assert_eq!(reg.live(), 1);
        assert_eq!(reg.violations.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn reclaim_waits_for_a_slab_to_become_idle() {
        let pool = TieredPool::unregistered(cfg(&[4 * KIB, 512 * KIB], 512 * KIB, MIB)).unwrap();
        let a = pool.acquire(1, None).unwrap();
        let mut rest: Vec<Lease> = (0..128).map(|_| pool.acquire(1, None).unwrap()).collect();
        let waiter = {
            let pool = pool.clone();
            thread::spawn(move || pool.acquire(512 * KIB, Some(Instant::now() + Duration::from_secs(20))))
        };
        eventually("the large request waits", || pool.stats().waits == 1);
        // The 129th lease sits alone in the second slab; returning it makes that slab idle.
        drop(rest.pop());
        let large = waiter.join().unwrap().unwrap();
        assert_eq!(large.capacity(), 512 * KIB);
        assert_eq!(pool.stats().reclaims, 1);
        drop((a, rest, large));
    }

    #[test]
    fn failed_registration_is_a_typed_error_and_leaks_nothing() {
        let (pool, reg) = counted(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB));
        reg.fail.store(true, Ordering::SeqCst);
        for len in [100, 200 * KIB] {
            match pool.acquire(len, None) {
                Err(PoolError::Registration { bytes, source }) => {
                    assert_eq!(bytes, round_up(len.max(64 * KIB), page_size()).unwrap());
                    assert!(source.to_string().contains("memlock"));
                }
                other => panic!("expected Registration error, got {other:?}"),
            }
        }
        let s = pool.stats();
        assert_eq!((s.bytes_allocated, s.bytes_in_use, s.grows, s.acquires), (0, 0, 0, 0));
        assert_eq!((reg.live(), reg.deregisters.load(Ordering::SeqCst)), (0, 0));

        reg.fail.store(false, Ordering::SeqCst);
        let ok = pool.acquire(100, None).unwrap();
        assert_inside_its_region(&ok, &reg);
        assert_eq!(pool.stats().bytes_allocated, 64 * KIB as u64, "the failed reservations were returned");

        // Preallocation surfaces the failure from the constructor.
        let failing = Arc::new(CountingRegistrar::default());
        failing.fail.store(true, Ordering::SeqCst);
        let config = PoolConfig { prealloc: true, ..cfg(&[4 * KIB], 64 * KIB, MIB) };
        assert!(matches!(TieredPool::new(config, failing.clone()), Err(PoolError::Registration { .. })));
        assert_eq!(failing.live(), 0);
    }

    #[test]
    fn each_slab_is_registered_once_and_deregistered_when_the_last_user_goes() {
        let config = PoolConfig { prealloc: true, ..cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB) };
        let (pool, reg) = counted(config);
        assert_eq!((reg.registers.load(Ordering::SeqCst), pool.stats().grows), (2, 2));
        assert_eq!(pool.stats().bytes_allocated, 128 * KIB as u64);

        // 16 small buffers per slab, 1 large: 20 small + 3 large need 2 + 3 slabs.
        let mut leases: Vec<Lease> = (0..20).map(|_| pool.acquire(4 * KIB, None).unwrap()).collect();
        leases.extend((0..3).map(|_| pool.acquire(64 * KIB, None).unwrap()));
        assert_eq!((reg.registers.load(Ordering::SeqCst), pool.stats().grows), (5, 5));
        for l in &leases {
            assert_inside_its_region(l, &reg);
        }
        drop(leases);
        for _ in 0..100 {
            let x = pool.acquire(4 * KIB, None).unwrap();
            let y = pool.acquire(64 * KIB, None).unwrap();
            drop((x, y));
        }
        assert_eq!(reg.registers.load(Ordering::SeqCst), 5, "reuse never registers again");
        assert_eq!(reg.deregisters.load(Ordering::SeqCst), 0);

        // Dropping the pool with a lease outstanding keeps its memory alive.
        let mut survivor = pool.acquire(64 * KIB, None).unwrap();
        let other_handle = pool.clone();
        drop(pool);
        drop(other_handle);
        assert_eq!(reg.live(), 5);
        survivor.fill(7);
        assert!(survivor.iter().all(|&b| b == 7));
        drop(survivor);
        assert_eq!(reg.live(), 0);
        assert_eq!(reg.deregisters.load(Ordering::SeqCst), 5);
        assert_eq!(reg.violations.load(Ordering::SeqCst), 0);
    }

    /// Registrar whose first registration blocks until the test opens the gate.
    #[derive(Default)]
    struct GateRegistrar {
        calls: AtomicUsize,
        open: Mutex<bool>,
        opened: Condvar,
    }

    impl Registrar for GateRegistrar {
        fn register(&self, _addr: *mut u8, _len: usize) -> Result<RegionKeys, PoolError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let mut open = self.open.lock();
            while !*open {
                self.opened.wait(&mut open);
            }
            Ok(RegionKeys::default())
        }
        fn deregister(&self, _keys: &RegionKeys) {}
    }

    #[test]
    fn concurrent_requests_share_one_growing_slab() {
        let reg = Arc::new(GateRegistrar::default());
        let pool = TieredPool::new(cfg(&[4 * KIB], 64 * KIB, MIB), reg.clone()).unwrap();
        let spawn = |pool: &TieredPool| {
            let pool = pool.clone();
            thread::spawn(move || pool.acquire(1, Some(Instant::now() + Duration::from_secs(20))))
        };
        let first = spawn(&pool);
        eventually("the first acquire is registering", || reg.calls.load(Ordering::SeqCst) == 1);
        // Registration runs outside the lock: the pool still answers.
        assert_eq!(pool.stats().bytes_allocated, 64 * KIB as u64, "the slab is reserved");
        let second = spawn(&pool);
        thread::sleep(Duration::from_millis(100));
        assert_eq!(reg.calls.load(Ordering::SeqCst), 1, "the second request waits for the slab in flight");
        *reg.open.lock() = true;
        reg.opened.notify_all();
        let (a, b) = (first.join().unwrap().unwrap(), second.join().unwrap().unwrap());
        assert_ne!(a.as_ptr(), b.as_ptr());
        let s = pool.stats();
        assert_eq!((s.grows, s.bytes_allocated, s.waits, s.hits), (1, 64 * KIB as u64, 0, 1));
    }

    #[test]
    fn lease_accessors_and_raw_round_trip() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Lease>();
        send_sync::<TieredPool>();

        let pool = TieredPool::unregistered(cfg(&[4 * KIB], 4 * KIB, MIB)).unwrap();
        let mut lease = pool.acquire(10, None).unwrap();
        assert_eq!((lease.len(), lease.capacity(), lease.is_empty()), (10, 4 * KIB, false));
        assert_eq!(lease.keys(), RegionKeys::default());
        lease.copy_from_slice(b"0123456789");
        lease.set_len(4 * KIB).unwrap();
        assert_eq!(&lease[..10], b"0123456789");
        match lease.set_len(4 * KIB + 1) {
            Err(PoolError::LenExceedsCapacity { requested, capacity }) => {
                assert_eq!((requested, capacity), (4 * KIB + 1, 4 * KIB))
            }
            other => panic!("expected LenExceedsCapacity, got {other:?}"),
        }
        assert_eq!(lease.len(), 4 * KIB, "a failed set_len changes nothing");
        lease.set_len(3).unwrap();
        assert_eq!(lease.as_ref(), b"012");

        // As a JNI layer would: the handle crosses to another thread as a jlong.
        let addr = lease.as_ptr() as usize;
        let handle = lease.into_raw() as usize as i64;
        assert_eq!(pool.stats().bytes_in_use, 4 * KIB as u64, "still leased while raw");
        thread::spawn(move || {
            // SAFETY: `handle` came from `into_raw` and is released exactly once.
            let back = unsafe { Lease::from_raw(handle as usize as *mut Lease) };
            assert_eq!((back.as_ptr() as usize, back.as_slice()), (addr, &b"012"[..]));
        })
        .join()
        .unwrap();
        assert_eq!(pool.stats().bytes_in_use, 0);
    }

    #[test]
    fn stress_many_threads_never_exceed_the_cap() {
        const THREADS: usize = 64;
        const ROUNDS: usize = 150;
        let cap = 512 * KIB;
        let (pool, reg) = counted(cfg(&[4 * KIB, 16 * KIB, 64 * KIB], 64 * KIB, cap));
        let sizes = [1, 3000, 4 * KIB, 9000, 16 * KIB, 40_000, 64 * KIB, 90_000];
        let done = Arc::new(AtomicBool::new(false));

        let monitor = {
            let (pool, done) = (pool.clone(), done.clone());
            thread::spawn(move || {
                let mut samples = 0u64;
                while !done.load(Ordering::SeqCst) {
                    let s = pool.stats();
                    assert!(s.bytes_allocated <= cap as u64, "{s:?}");
                    assert!(s.bytes_in_use <= s.bytes_allocated, "{s:?}");
                    assert!(s.peak_bytes_in_use <= cap as u64, "{s:?}");
                    samples += 1;
                    thread::yield_now();
                }
                samples
            })
        };
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let mut rng = StdRng::seed_from_u64(t as u64);
                    for round in 0..ROUNDS {
                        let len = sizes[rng.gen_range(0..sizes.len())];
                        let deadline = Instant::now() + Duration::from_secs(60);
                        let mut lease = if rng.gen_bool(0.2) {
                            match pool.try_acquire(len).unwrap() {
                                Some(l) => l,
                                None => pool.acquire(len, Some(deadline)).unwrap(),
                            }
                        } else {
                            pool.acquire(len, Some(deadline)).unwrap()
                        };
                        assert!(lease.capacity() >= len && lease.len() == len);
                        let tag = (t * 7 + round) as u8;
                        lease.fill(tag);
                        if round % 4 == 0 {
                            thread::yield_now();
                        }
                        // Another holder writing into this buffer would show here.
                        let n = lease.len();
                        for i in (0..n).step_by(509).chain([n / 2, n - 1]) {
                            assert_eq!(lease[i], tag, "buffer shared between two leases");
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::SeqCst);
        assert!(monitor.join().unwrap() > 0);

        let s = pool.stats();
        assert_eq!(s.bytes_in_use, 0);
        assert_eq!(s.acquires, (THREADS * ROUNDS) as u64);
        assert_eq!(s.timeouts, 0);
        assert!(s.peak_bytes_in_use <= cap as u64 && s.bytes_allocated <= cap as u64, "{s:?}");
        assert!(s.waits > 0, "a cap this small must have pushed back: {s:?}");
        drop(pool);
        assert_eq!(reg.live(), 0);
        assert_eq!(reg.registers.load(Ordering::SeqCst), reg.deregisters.load(Ordering::SeqCst));
        assert_eq!(reg.violations.load(Ordering::SeqCst), 0);
    }
}
