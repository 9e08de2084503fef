//! Registrations of user memory: [`Mesh::register`] and its cache, the [`Registration`]
//! handle, and the [`UserMemory`] handed to the loop.

use super::regcache::RegCache;
use super::shared::bump;
use super::{Mesh, MeshError};
use parking_lot::Mutex;
use rdma_shuffle_fabric::providers::{Source, UserRegion};
use std::fmt;
use std::sync::{Arc, Weak};

/// A registration of user memory with the provider.
#[derive(Clone)]
pub(crate) enum UserReg {
    /// Nothing to register (sim exposes each message; tcp streams).
    Plain,
    /// A provider's registration of the user's pages (verbs: a memory region).
    Region(Arc<dyn UserRegion>),
}

pub(super) struct Regs {
    pub(super) cache: Mutex<RegCache<UserReg>>,
}

impl Mesh {
    /// Makes `len` bytes at `ptr` readable by peers for rendezvous sends out of them (and, on
    /// verbs, writable by READs this rank posts into them). A no-op handle on tcp.
    /// Registrations are cached by `(ptr, len)` while in use: a buffer sent from many times
    /// (every step of a ring) is registered once per call; with
    /// [`MeshConfig::cache_registrations`] also across calls (see `regcache` for why that is
    /// opt-in).
    ///
    /// # Safety
    ///
    /// The memory must stay valid (mapped, not freed) while the returned [`Registration`]
    /// lives. With `cache_registrations`, a cached registration outlives the handle: the
    /// caller must call [`invalidate`](Mesh::invalidate) before the memory is freed, or a
    /// later registration of new memory at the same address would reuse a stale one.
    pub unsafe fn register(&self, ptr: *const u8, len: usize) -> Result<Registration, MeshError> {
        if !self.one_sided || len == 0 {
            return Ok(Registration { ptr: ptr as usize, len, reg: UserReg::Plain, owner: None });
        }
        let key = (ptr as usize, len);
        if let Some((id, reg)) = self.regs.cache.lock().hit(key) {
            bump(&self.shared.counters.registration_hits, 1);
            return Ok(Registration { ptr: key.0, len, reg, owner: Some((Arc::downgrade(&self.regs), id)) });
        }
        let reg = self.provider_register(ptr, len)?;
        bump(&self.shared.counters.registrations, 1);
        let (id, evicted) = self.regs.cache.lock().insert(key, reg.clone());
        drop(evicted);
        Ok(Registration { ptr: key.0, len, reg, owner: Some((Arc::downgrade(&self.regs), id)) })
    }

    fn provider_register(&self, ptr: *const u8, len: usize) -> Result<UserReg, MeshError> {
        // SAFETY: forwarded contract of `register`: the memory stays mapped while the
        // registration lives.
        let r = unsafe { self.driver.provider().register_user(ptr, len) }.map_err(|e| MeshError::Memory {
            rank: self.shared.rank,
            message: format!("registering a {len}-byte user buffer: {e}"),
        })?;
        Ok(r.map(UserReg::Region).unwrap_or(UserReg::Plain))
    }

    /// Drops cached registrations overlapping `[ptr, ptr + len)` (the memory is about to be
    /// freed). Registrations still in use are dropped when their last handle goes.
    pub fn invalidate(&self, ptr: *const u8, len: usize) {
        let dropped = self.regs.cache.lock().invalidate(ptr as usize, len);
        drop(dropped);
    }
}

/// User memory handed to the loop (written to a socket, exposed to sim reads). The mesh
/// only hands it over while a ticket or registration promises the bytes are alive, and
/// takes it back ([`PendingSend::release`](super::ticket::PendingSend::release)) before such a promise ends early.
#[derive(Debug)]
pub(crate) struct UserMemory {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
}

impl Source for UserMemory {
    fn len(&self) -> u64 {
        self.len as u64
    }
    fn read_at(&self, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        rdma_shuffle_fabric::providers::copy_from_memory(self.memory().unwrap_or(&[]), offset, dst)
    }
    fn memory(&self) -> Option<&[u8]> {
        // SAFETY: the holder's promise above: the memory is valid while the loop has it.
        Some(unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) })
    }
}

/// A user buffer registered for rendezvous (see [`Mesh::register`]). Dropping it releases
/// the registration, or leaves it in the cache.
pub struct Registration {
    pub(super) ptr: usize,
    pub(super) len: usize,
    pub(super) reg: UserReg,
    /// The cache entry it came from; `None` when nothing was registered.
    owner: Option<(Weak<Regs>, u64)>,
}

impl Registration {
    pub(super) fn covers(&self, data: &[u8]) -> bool {
        let (a, n) = (data.as_ptr() as usize, data.len());
        a >= self.ptr && a + n <= self.ptr + self.len
    }

    fn rkey(&self) -> u32 {
        match &self.reg {
            UserReg::Plain => 0,
            UserReg::Region(r) => r.rkey(),
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({:#x}+{}, rkey {})", self.ptr, self.len, self.rkey())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some((owner, id)) = self.owner.take() else { return };
        // A mesh already closed has released everything.
        let Some(regs) = owner.upgrade() else { return };
        let released = regs.cache.lock().release(id);
        drop(released);
    }
}
