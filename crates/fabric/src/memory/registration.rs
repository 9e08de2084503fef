//! Registration of memory with a provider's device.
//!
//! The pool calls a [`Registrar`] once per slab, never on the acquire hot path. The tcp and
//! sim providers register nothing ([`NoRegistration`]); the verbs provider registers each slab
//! with its protection domain.

use super::pool::config::PoolError;

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
