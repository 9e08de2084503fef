//! Registered memory: memory regions, the provider's own slabs, the pool's registrar, and
//! exposed rendezvous regions with their memory windows.

use super::device::{err, err_knob, os_err, Device, Pd};
use crate::memlock::memlock_advice;
use parking_lot::Mutex;
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::accounting;
use rdma_shuffle_fabric::memory::pool::{PoolError, RegionKeys, Registrar};
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_wire::Knob;
use rdma_sys::*;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

// ------------------------------------------------------------------------------ memory

/// A registered memory region.
pub(crate) struct Mr {
    pub(super) raw: *mut ibv_mr,
    pub(super) _pd: Arc<Pd>,
}
// SAFETY: an MR is a kernel handle; using its keys from any thread is fine.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}
impl Mr {
    /// # Safety
    /// `[addr, addr + len)` must stay mapped until the returned `Mr` is dropped.
    pub(super) unsafe fn register(pd: &Arc<Pd>, addr: *mut u8, len: usize, access: ibv_access_flags) -> io::Result<Mr> {
        // SAFETY: per the contract the range is mapped for the MR's life.
        let mr = unsafe { ibv_reg_mr(pd.raw, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Mr { raw: mr, _pd: pd.clone() })
    }
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: valid MR.
        unsafe { (*self.raw).lkey }
    }
    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: valid MR.
        unsafe { (*self.raw).rkey }
    }
}
impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the region is still mapped (owners drop the Mr before unmapping), and every
        // window bound to it is gone (windows hold an Arc of what they are bound to).
        let rc = unsafe { ibv_dereg_mr(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dereg_mr failed");
        }
    }
}

/// A private mapping (anonymous, or copy-on-write of a file), unmapped on drop. Counted as the
/// provider's native memory while it lives ([`accounting`]): receive and send buffers, and the
/// pages of blocks exposed for RDMA READ (registration pins them).
pub(super) struct Mapping {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}
// SAFETY: plain memory owned by this value; access is coordinated by its owner.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}
impl Mapping {
    pub(super) fn anon(len: usize) -> io::Result<Mapping> {
        // SAFETY: an anonymous private mapping; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        accounting::charge(accounting::Kind::Provider, len as u64);
        Ok(Mapping { ptr: p.cast(), len })
    }
    pub(super) fn file(fd: RawFd, offset: u64, len: usize) -> io::Result<Mapping> {
        // SAFETY: a private read-write mapping of an open file; checked for MAP_FAILED. Writes
        // (there are none) would stay private to this mapping.
        let p = unsafe {
            libc::mmap(null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd, offset as libc::off_t)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        accounting::charge(accounting::Kind::Provider, len as u64);
        Ok(Mapping { ptr: p.cast(), len })
    }
}
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its MR (a sibling field declared first) is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
        accounting::credit(accounting::Kind::Provider, self.len as u64);
    }
}

/// Registered memory this provider allocated itself. Field order: the MR is deregistered
/// before the mapping goes.
pub(super) struct Slab {
    pub(super) mr: Mr,
    pub(super) map: Mapping,
}

impl Slab {
    pub(super) fn new(pd: &Arc<Pd>, len: usize, what: &str) -> Result<Slab, FabricError> {
        let map = Mapping::anon(len).map_err(|e| err(format!("mmap of {len} bytes for {what}: {e}")))?;
        // SAFETY: `map` lives as long as the slab, and the MR is dropped first.
        let mr = unsafe { Mr::register(pd, map.ptr, len, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE) }.map_err(|e| {
            err_knob(format!("registering {len} bytes of {what}: {e}; {}", memlock_advice(len as u64)), Knob::RecvBuffers)
        })?;
        Ok(Slab { mr, map })
    }
}

/// Maps and registers `bytes` in one region on `dev`, then releases it: whether the pool's
/// memory can be registered here, and how long it took (the preflight, [`crate::probe`]).
pub(crate) fn register_for_probe(dev: &Device, bytes: usize) -> Result<std::time::Duration, FabricError> {
    let t0 = std::time::Instant::now();
    let slab = Slab::new(&dev.pd, bytes, "the memory pool")?;
    let took = t0.elapsed();
    drop(slab);
    Ok(took)
}

/// Registers pool slabs with the device's protection domain (local write: READ targets and
/// receive copies only; nothing in the pool is ever exposed to a peer).
pub(crate) struct PoolRegistrar {
    pub(super) pd: Arc<Pd>,
    pub(super) name: String,
    pub(super) registered: Arc<AtomicU64>,
    pub(super) mrs: Mutex<HashMap<u64, (Mr, usize)>>,
    pub(super) next: AtomicU64,
}

impl PoolRegistrar {
    pub(crate) fn new(dev: &Device, registered: Arc<AtomicU64>) -> Self {
        PoolRegistrar {
            pd: dev.pd.clone(),
            name: dev.name().to_string(),
            registered,
            mrs: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }
}

impl Registrar for PoolRegistrar {
    fn register(&self, addr: *mut u8, len: usize) -> Result<RegionKeys, PoolError> {
        // SAFETY: the Registrar contract: the pool keeps the region mapped until the matching
        // `deregister`, which drops the Mr first.
        let mr = unsafe { Mr::register(&self.pd, addr, len, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE) }.map_err(|e| {
            let advice =
                if e.raw_os_error() == Some(libc::ENOMEM) { format!("; {}", memlock_advice(len as u64)) } else { String::new() };
            PoolError::Registration { bytes: len, source: format!("ibv_reg_mr on {}: {e}{advice}", self.name).into() }
        })?;
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        let keys = RegionKeys { lkey: mr.lkey(), rkey: mr.rkey(), handle };
        self.mrs.lock().insert(handle, (mr, len));
        self.registered.fetch_add(len as u64, Ordering::Relaxed);
        Ok(keys)
    }

    fn deregister(&self, keys: &RegionKeys) {
        if let Some((_mr, len)) = self.mrs.lock().remove(&keys.handle) {
            self.registered.fetch_sub(len as u64, Ordering::Relaxed);
        }
    }
}

// ------------------------------------------------------------------------------ exposure

/// A memory window (type 2): bound by its queue pair, usable only through that queue pair.
pub(super) struct Window {
    pub(super) raw: *mut ibv_mw,
    pub(super) _pd: Arc<Pd>,
}
// SAFETY: a kernel handle.
unsafe impl Send for Window {}
// SAFETY: as above.
unsafe impl Sync for Window {}
impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: no bind of it is outstanding (a bind keeps the Exposure alive until its
        // completion). Deallocating a bound window invalidates it: its key stops working.
        let rc = unsafe { ibv_dealloc_mw(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_mw failed");
        }
    }
}

/// A rendezvous region exposed to one peer: a private mapping of the bytes, registered for
/// window binding only (its own key grants no remote access), and a type-2 window bound to
/// one queue pair with remote read. Dropping it deallocates the window (reads of its key
/// fail from then on), deregisters, unmaps — in that order (field order).
pub(crate) struct Exposure {
    pub(super) window: Window,
    pub(super) mr: Arc<Mr>,
    pub(super) map: Mapping,
    /// Virtual address of the region's first byte (inside `map`).
    pub(super) addr: u64,
    pub(super) len: u64,
}

impl Exposure {
    /// Maps and registers `len` bytes at `offset` of the source's file (or copies them with
    /// [`Source::read_at`] when it has none), and allocates the window. Nothing is readable
    /// until bound.
    ///
    /// A file region past the file's current end is refused before it is mapped: the kernel
    /// could not pin those pages, and the CPU must never touch a mapping past EOF.
    pub(crate) fn new(dev: &Device, source: &dyn Source, offset: u64, len: u64) -> Result<Exposure, FabricError> {
        const PAGE: u64 = 4096;
        let end = offset
            .checked_add(len)
            .filter(|end| *end <= source.len())
            .ok_or_else(|| err(format!("region {offset}+{len} outside its {}-byte source", source.len())))?;
        let file = source.file().map_err(|e| err(format!("cannot open the source of a {len}-byte exposure: {e}")))?;
        let (map, addr) = match file {
            Some(file) => {
                let now = file.metadata().map_err(|e| err(format!("cannot stat the source file: {e}")))?.len();
                if now < end {
                    return Err(err(format!(
                        "data file truncated: it is {now} bytes now, the region {offset}+{len} needs {end}"
                    )));
                }
                let start = offset - offset % PAGE;
                let span = (offset - start + len) as usize;
                let map = Mapping::file(file.as_raw_fd(), start, span)
                    .map_err(|e| err(format!("mapping {len} bytes for exposure: {e}")))?;
                let addr = map.ptr as u64 + (offset - start);
                (map, addr)
            }
            None => {
                let map = Mapping::anon(len.max(1) as usize).map_err(|e| err(format!("mapping {len} bytes: {e}")))?;
                // SAFETY: a fresh private mapping of at least `len` bytes, not yet shared.
                let dst = unsafe { std::slice::from_raw_parts_mut(map.ptr, len as usize) };
                source.read_at(offset, dst).map_err(|e| err(format!("cannot read the {len}-byte region: {e}")))?;
                let addr = map.ptr as u64;
                (map, addr)
            }
        };
        // Window binding needs a writable pin (the kernel treats MW_BIND as write access), which
        // a shared read-only file mapping refuses: the private mapping is copied on pin, so the
        // region costs its length in memory while exposed, and Spark's file is never touched.
        // SAFETY: `map` outlives the MR (field order of Exposure, and the Arc<Mr> kept by
        // binds is dropped with the Exposure they keep alive).
        let mr = unsafe { Mr::register(&dev.pd, map.ptr, map.len, ibv_access_flags::IBV_ACCESS_MW_BIND) }.map_err(|e| {
            let advice =
                if e.raw_os_error() == Some(libc::ENOMEM) { format!("; {}", memlock_advice(len)) } else { String::new() };
            err(format!("registering a {len}-byte rendezvous region: {e}{advice}"))
        })?;
        // SAFETY: a live PD; the result is checked.
        let raw = unsafe { ibv_alloc_mw(dev.pd.raw, ibv_mw_type::IBV_MW_TYPE_2) }
            .ok_or_else(|| err("this device has no memory windows (ibv_alloc_mw is not supported)"))?;
        if raw.is_null() {
            return Err(os_err("ibv_alloc_mw"));
        }
        Ok(Exposure { window: Window { raw, _pd: dev.pd.clone() }, mr: Arc::new(mr), map, addr, len })
    }

    /// Bytes this exposure holds registered.
    pub(crate) fn bytes(&self) -> u64 {
        self.map.len as u64
    }
}

// ------------------------------------------------------------------------------ user memory

/// A caller's buffer registered for mesh rendezvous: readable by the peers' queue pairs
/// (remote read — only authenticated mesh peers have queue pairs in this protection domain)
/// and, when the pages are writable, a target of this side's READs (local write).
pub(crate) struct UserRegion {
    mr: Mr,
    /// Registered for local write too (a READ may land in it); read-only pages are not.
    writable: bool,
}

impl UserRegion {
    /// Registers `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The range must stay mapped until the region is dropped.
    pub(crate) unsafe fn new(dev: &Device, ptr: *const u8, len: usize) -> Result<UserRegion, FabricError> {
        let both = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        // SAFETY: the caller keeps the range mapped for the region's life.
        match unsafe { Mr::register(&dev.pd, ptr as *mut u8, len, both) } {
            Ok(mr) => Ok(UserRegion { mr, writable: true }),
            Err(first) => {
                // Read-only pages (a numpy array over `bytes`) refuse a writable pin: such a
                // buffer can still be sent from.
                // SAFETY: as above.
                let mr = unsafe { Mr::register(&dev.pd, ptr as *mut u8, len, ibv_access_flags::IBV_ACCESS_REMOTE_READ) }
                    .map_err(|e| {
                        let advice = if e.raw_os_error() == Some(libc::ENOMEM) {
                            format!("; {}", memlock_advice(len as u64))
                        } else {
                            String::new()
                        };
                        err(format!("registering a {len}-byte user buffer: {first} (read-only: {e}){advice}"))
                    })?;
                Ok(UserRegion { mr, writable: false })
            }
        }
    }

    /// The key peers read it with.
    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The key this process's READs write it with, if the pages took a writable pin.
    pub(crate) fn write_lkey(&self) -> Option<u32> {
        self.writable.then(|| self.mr.lkey())
    }
}
