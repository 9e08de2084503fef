//! The pool's configuration, errors and counters, and the layout the configuration gives
//! (tier sizes, page rounding). A leaf: it imports nothing else of the pool.

use rdma_shuffle_wire::Knob;
use std::error::Error as StdError;
use std::io;
use std::sync::OnceLock;

/// One tier's layout: buffer size and buffers per slab.
pub(super) struct TierSpec {
    pub(super) size: usize,
    pub(super) per_slab: u32,
}

/// The system page size (at least [`SLAB_ALIGN`]).
pub(super) fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page).unwrap_or(SLAB_ALIGN).max(SLAB_ALIGN)
    })
}

/// `n` rounded up to a multiple of `to`, and at least `to`: a mapping is never empty.
pub(super) fn round_up(n: usize, to: usize) -> Option<usize> {
    Some((n.checked_add(to - 1)? / to * to).max(to))
}

/// What names [`PoolConfig::cap_bytes`] in errors: the layer that owns the settings renders
/// the key a user sets it with.
pub const CAP_KNOB: Knob = Knob::PoolCapBytes;

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
        setting = CAP_KNOB
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
        setting = CAP_KNOB
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
    /// whole pages). Named by [`CAP_KNOB`] in errors.
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

impl PoolError {
    /// The setting that cures this error, where there is one.
    pub fn knob(&self) -> Option<Knob> {
        match self {
            PoolError::Timeout { .. } | PoolError::ExceedsCap { .. } | PoolError::Registration { .. } => Some(CAP_KNOB),
            PoolError::Config(_) => Some(CAP_KNOB),
            _ => None,
        }
    }
}

impl PoolConfig {
    /// Checks the configuration; the error names the field that is wrong and why.
    pub fn validate(&self) -> Result<(), PoolError> {
        self.tier_specs().map(|_| ())
    }

    /// Validates and derives the per-tier layout.
    pub(super) fn tier_specs(&self) -> Result<Vec<TierSpec>, PoolError> {
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
                "`cap_bytes` ({}, {CAP_KNOB}) is smaller than one buffer of the \
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
                 ({}, {CAP_KNOB}) is smaller; lower `slab_bytes`, raise the \
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
    pub(super) fn note_lease(&mut self, bytes: u64) {
        self.bytes_in_use += bytes;
        self.peak_bytes_in_use = self.peak_bytes_in_use.max(self.bytes_in_use);
        self.acquires += 1;
    }
}
