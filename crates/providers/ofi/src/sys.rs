//! Everything `unsafe` in this crate: libfabric's objects behind owners that close them in
//! the order libfabric requires, and the bookkeeping that keeps each buffer alive while the
//! provider may touch it.
//!
//! Ownership and teardown (libfabric refuses to close an object others are bound to, with
//! `-FI_EBUSY`, and a closed endpoint must not be left with buffers freed under it):
//!
//! ```text
//! Fabric <- Domain <- { CompletionQueue, AddressVector, MemoryRegion } <- Endpoint
//! ```
//!
//! Each child holds an `Arc` of its parents, so a parent is closed only after its last child.
//! [`Endpoint`] holds its libfabric endpoint in its first field and the buffers of operations
//! in flight (posted receives, sends, reads) after it: fields drop in declaration order, so
//! the endpoint is closed — libfabric drops its outstanding operations — before any buffer it
//! could still write into is freed, and a buffer's registration is closed before the domain.
//!
//! Threading: the domain is opened `FI_THREAD_SAFE`, so a [`Domain`] and a [`MemoryRegion`]
//! may be used from any thread (the pool's registrar runs on callers' threads). An
//! [`Endpoint`] is driven by one owner at a time (`&mut self`).

use std::ffi::{c_void, CStr, CString};
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;

use ofi_libfabric_sys::bindgen as fi;

use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::memory::registration::{RegionKeys, Registrar};
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_fabric::PoolError;

use crate::config::{EndpointInfo, OfiConfig, PeerAddr, RemoteRegion};
use crate::error::OfiError;

/// The API version this crate is written against (`FI_VERSION(2, 1)` as the headers define).
fn api_version() -> u32 {
    (fi::FI_MAJOR_VERSION << 16) | fi::FI_MINOR_VERSION
}

/// `FI_ADDR_NOTAVAIL` (a macro, so not in the bindings): the sender is not in the AV.
const FI_ADDR_NOTAVAIL: u64 = u64::MAX;

/// libfabric's text for a positive error number.
pub(crate) fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string for any
    // integer (unknown codes get a generic text); it is never freed.
    unsafe { CStr::from_ptr(fi::fi_strerror(code)) }.to_string_lossy().into_owned()
}

/// Whether a completion's error number says the target refused the access: a key it does
/// not know (never registered, or closed since) or a range outside the registration.
pub(crate) fn is_access_error(code: i32) -> bool {
    [fi::FI_EACCES, fi::FI_EKEYREJECTED, fi::FI_ENOKEY, fi::FI_EINVAL, fi::FI_EREMOTEIO].contains(&(code as u32))
}

/// Turns a libfabric return code (negative on error) into a typed error naming `call`.
fn check(call: &'static str, rc: i64) -> Result<i64, OfiError> {
    if rc >= 0 {
        Ok(rc)
    } else {
        let code = (-rc) as i32;
        Err(OfiError::Call { call, code, message: strerror(code) })
    }
}

/// The version of the libfabric library loaded at run time, as "major.minor".
pub fn runtime_version() -> String {
    // SAFETY: fi_version takes no arguments and only returns a number.
    let v = unsafe { fi::fi_version() };
    format!("{}.{}", v >> 16, v & 0xffff)
}

// ------------------------------------------------------------------------------ fi_info

/// An `fi_info` list owned by this crate (freed with `fi_freeinfo`).
struct InfoList(*mut fi::fi_info);

// SAFETY: the list is plain data owned by this value; libfabric keeps no reference to it
// after fi_getinfo/fi_dupinfo returned, and it is only read after construction.
unsafe impl Send for InfoList {}
unsafe impl Sync for InfoList {}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the pointer came from fi_getinfo or fi_allocinfo and is freed once.
            unsafe { fi::fi_freeinfo(self.0) };
        }
    }
}

/// Copies a C string owned by libfabric, or "" for null.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string valid for the duration of the call.
unsafe fn c_string(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: the caller's contract.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Capability sets tried in order: the best first, then without what the provider may lack.
fn wanted_caps(cfg: &OfiConfig) -> Vec<(u64, &'static str)> {
    let msg = fi::FI_MSG as u64;
    let rma = (fi::FI_RMA | fi::FI_READ | fi::FI_REMOTE_READ) as u64;
    let src = fi::FI_SOURCE;
    let mut sets = Vec::new();
    if cfg.rma {
        sets.push((msg | rma | src, "FI_MSG|FI_RMA|FI_SOURCE"));
        sets.push((msg | rma, "FI_MSG|FI_RMA"));
    }
    sets.push((msg | src, "FI_MSG|FI_SOURCE"));
    sets.push((msg, "FI_MSG"));
    sets
}

/// Memory-registration modes this layer handles: it registers local buffers when asked
/// (LOCAL), sends virtual addresses or offsets as the provider says (VIRT_ADDR), registers
/// only allocated memory (ALLOCATED), uses the provider's keys (PROV_KEY), and binds the
/// registrations a peer reads to the endpoint that serves them (ENDPOINT, as cxi requires).
/// A provider that wants both ENDPOINT and LOCAL is refused when the domain opens: the pool's
/// slabs are registered before any endpoint exists.
const MR_MODES: u32 = fi::FI_MR_LOCAL | fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_PROV_KEY | fi::FI_MR_ENDPOINT;

/// Has ofi_rxm share one receive context among its connections (`FI_OFI_RXM_USE_SRX=1`)
/// unless the environment says otherwise. libfabric 2.1's default is a shared context over
/// tcp but receive buffers per connection over verbs, and there a peer that vanished could
/// leave buffers that rxm reposted to the closed connection's endpoint later: a NULL call in
/// `rxm_post_recv` that killed the process (1 run in 18 of the conformance suite's
/// vanishing-server case over `verbs;ofi_rxm` in the SoftRoCE VM; 0 in 60 with a shared
/// context). A shared context outlives its connections, and its buffers do not grow with the
/// number of peers. rxm reads the variable whenever `fi_getinfo` translates an rxm request,
/// so it is set before the first one; only when unset (an operator's choice stands).
fn share_rxm_receive_context() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("FI_OFI_RXM_USE_SRX").is_none() {
            std::env::set_var("FI_OFI_RXM_USE_SRX", "1");
            tracing::debug!("FI_OFI_RXM_USE_SRX=1: ofi_rxm shares one receive context among its connections");
        }
    });
}

fn getinfo(cfg: &OfiConfig) -> Result<InfoList, OfiError> {
    share_rxm_receive_context();
    let prov = CString::new(cfg.provider.as_str())
        .map_err(|_| OfiError::Invalid { what: "provider name", detail: "contains a NUL byte".into() })?;
    let node = cfg
        .node
        .as_deref()
        .map(CString::new)
        .transpose()
        .map_err(|_| OfiError::Invalid { what: "node", detail: "contains a NUL byte".into() })?;
    let service = cfg
        .service
        .as_deref()
        .map(CString::new)
        .transpose()
        .map_err(|_| OfiError::Invalid { what: "service", detail: "contains a NUL byte".into() })?;
    let domain = cfg
        .domain
        .as_deref()
        .map(CString::new)
        .transpose()
        .map_err(|_| OfiError::Invalid { what: "domain", detail: "contains a NUL byte".into() })?;
    let flags = if node.is_some() || service.is_some() { fi::FI_SOURCE } else { 0 };
    let mut last = (fi::FI_ENODATA as i32, "FI_MSG");
    for (caps, caps_name) in wanted_caps(cfg) {
        // SAFETY: fi_allocinfo returns a zeroed fi_info with its attribute structs allocated
        // (or null); every field written below belongs to it, prov_name is set to a malloc'd
        // copy that fi_freeinfo frees with the rest.
        let hints = InfoList(unsafe { fi::fi_allocinfo() });
        if hints.0.is_null() {
            return Err(OfiError::Call {
                call: "fi_allocinfo",
                code: fi::FI_ENOMEM as i32,
                message: strerror(fi::FI_ENOMEM as i32),
            });
        }
        let mut info: *mut fi::fi_info = ptr::null_mut();
        // SAFETY: hints.0 and its attribute pointers are valid (allocated above); the strings
        // passed to fi_getinfo outlive the call; `info` receives a list this code owns.
        let rc = unsafe {
            let h = &mut *hints.0;
            h.caps = caps;
            h.mode = 0; // no FI_CONTEXT: completions carry this layer's own context values
            (*h.ep_attr).type_ = fi::fi_ep_type_FI_EP_RDM;
            (*h.domain_attr).threading = fi::fi_threading_FI_THREAD_SAFE;
            (*h.domain_attr).mr_mode = MR_MODES as i32;
            // Sends between two endpoints arrive in the order they were posted.
            (*h.tx_attr).msg_order = fi::FI_ORDER_SAS as u64;
            (*h.rx_attr).msg_order = fi::FI_ORDER_SAS as u64;
            (*h.fabric_attr).prov_name = libc::strdup(prov.as_ptr());
            if let Some(d) = &domain {
                (*h.domain_attr).name = libc::strdup(d.as_ptr());
            }
            fi::fi_getinfo(
                api_version(),
                node.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
                service.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
                flags,
                hints.0,
                &mut info,
            )
        };
        if rc == 0 && !info.is_null() {
            return Ok(InfoList(info));
        }
        last = ((-rc) as i32, caps_name);
        if rc != -(fi::FI_ENODATA as i32) {
            break; // a real failure, not "no such provider with these caps"
        }
    }
    let (code, caps_name) = last;
    if code == fi::FI_ENODATA as i32 {
        Err(OfiError::NoProvider {
            provider: cfg.provider.clone(),
            wanted: format!(
                "FI_EP_RDM with {caps_name}, FI_ORDER_SAS, FI_THREAD_SAFE{}",
                cfg.domain.as_deref().map(|d| format!(" on domain {d}")).unwrap_or_default()
            ),
            message: strerror(code),
        })
    } else {
        Err(OfiError::Call { call: "fi_getinfo", code, message: strerror(code) })
    }
}

// ------------------------------------------------------------------------------ objects

/// Closes a libfabric object, logging (never panicking) on failure: runs inside `Drop`.
///
/// # Safety
/// `fid` is an open libfabric object that nothing uses after this call.
unsafe fn close(what: &'static str, fid: *mut fi::fid) {
    // SAFETY: the caller's contract.
    let rc = unsafe { fi::fi_close(fid) };
    if rc != 0 {
        tracing::warn!(object = what, error = %strerror(-rc), "fi_close failed");
    }
}

struct Fabric(*mut fi::fid_fabric);

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: opened by fi_fabric; every domain holds an Arc<Fabric>, so none is left.
        unsafe { close("fabric", &mut (*self.0).fid) }
    }
}

/// A libfabric domain (a NIC, or the provider's stand-in for one). Memory is registered here.
pub(crate) struct DomainInner {
    fid: *mut fi::fid_domain,
    info: InfoList,
    /// What the provider granted (`wait_fd` is an endpoint's: false here).
    summary: EndpointInfo,
    /// The provider chooses keys (FI_MR_PROV_KEY); else this layer requests them.
    prov_key: bool,
    _fabric: Arc<Fabric>,
}

impl Drop for DomainInner {
    fn drop(&mut self) {
        // SAFETY: opened by fi_domain; every CQ, AV, endpoint and registration holds an
        // Arc<DomainInner>, so all were closed before this runs.
        unsafe { close("domain", &mut (*self.fid).fid) }
    }
}

// SAFETY: the domain is opened FI_THREAD_SAFE (requested in the hints, which providers must
// honour or not match), so libfabric serialises concurrent calls on it and its children.
unsafe impl Send for Fabric {}
unsafe impl Sync for Fabric {}
unsafe impl Send for DomainInner {}
unsafe impl Sync for DomainInner {}

/// A shared handle on a domain: memory is registered with it from any thread, and endpoints
/// are opened in it ([`Endpoint::open_in`]), so pool memory its registrar registered is valid
/// for every endpoint of the domain.
#[derive(Clone)]
pub struct Domain(Arc<DomainInner>);

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").field("info", &self.0.summary).finish()
    }
}

/// Access a registration grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Local use only: the source of sends, the target of receives and reads.
    Local,
    /// Local use and one-sided read by a peer that holds the key.
    RemoteRead,
}

impl Domain {
    /// Opens the fabric and domain of the first provider `fi_getinfo` offers for `cfg`
    /// (its provider name, domain, node and capabilities).
    pub fn open(cfg: &OfiConfig) -> Result<Domain, OfiError> {
        let info = getinfo(cfg)?;
        // SAFETY: `info` is a non-empty list from fi_getinfo; its first entry is read as the
        // provider answered it. The fabric and domain opened are owned at once by values whose
        // Drop closes them.
        unsafe {
            let i = &*info.0;
            let caps = i.caps;
            let mr_mode = (*i.domain_attr).mr_mode as u32;
            let prov_key = mr_mode & fi::FI_MR_PROV_KEY != 0;
            let summary = EndpointInfo {
                provider: c_string((*i.fabric_attr).prov_name),
                fabric: c_string((*i.fabric_attr).name),
                domain: c_string((*i.domain_attr).name),
                rma: caps & fi::FI_RMA as u64 != 0,
                source: caps & fi::FI_SOURCE != 0,
                mr_local: mr_mode & fi::FI_MR_LOCAL != 0,
                mr_virt_addr: mr_mode & fi::FI_MR_VIRT_ADDR != 0,
                inject_size: (*i.tx_attr).inject_size,
                max_msg_size: (*i.ep_attr).max_msg_size,
                wait_fd: false,
                key_bytes: if prov_key { 0 } else { (*i.domain_attr).mr_key_size },
                mr_endpoint: mr_mode & fi::FI_MR_ENDPOINT != 0,
                sockaddr: i.addr_format == fi::FI_SOCKADDR_IN || i.addr_format == fi::FI_SOCKADDR_IN6,
            };
            if summary.mr_endpoint && summary.mr_local {
                return Err(OfiError::NoProvider {
                    provider: cfg.provider.clone(),
                    wanted: "memory registration without both FI_MR_ENDPOINT and FI_MR_LOCAL".into(),
                    message: format!(
                        "{} on {} binds local registrations to endpoints, and the pool registers its memory before any endpoint exists",
                        summary.provider, summary.domain
                    ),
                });
            }
            if summary.rma && !prov_key && summary.key_bytes < 4 {
                return Err(OfiError::NoProvider {
                    provider: cfg.provider.clone(),
                    wanted: "memory keys of at least 4 bytes".into(),
                    message: format!("{} takes {}-byte keys", summary.provider, summary.key_bytes),
                });
            }
            let mut fabric: *mut fi::fid_fabric = ptr::null_mut();
            check("fi_fabric", fi::fi_fabric(i.fabric_attr, &mut fabric, ptr::null_mut()) as i64)?;
            let fabric = Arc::new(Fabric(fabric));
            let mut domain: *mut fi::fid_domain = ptr::null_mut();
            check("fi_domain", fi::fi_domain(fabric.0, info.0, &mut domain, ptr::null_mut()) as i64)?;
            Ok(Domain(Arc::new(DomainInner { fid: domain, info, summary, prov_key, _fabric: fabric })))
        }
    }

    /// What the provider granted for this domain.
    pub fn info(&self) -> &EndpointInfo {
        &self.0.summary
    }

    /// The IP address endpoints of this domain bind, for providers whose addresses are
    /// socket addresses (tcp); `None` for others.
    pub fn source_ip(&self) -> Option<std::net::IpAddr> {
        // SAFETY: the info list lives as long as the domain; src_addr holds src_addrlen bytes
        // of the info's address format, read only for the socket formats.
        unsafe {
            let i = &*self.0.info.0;
            if i.src_addr.is_null() {
                return None;
            }
            if i.addr_format == fi::FI_SOCKADDR_IN && i.src_addrlen >= std::mem::size_of::<libc::sockaddr_in>() {
                let a = &*(i.src_addr as *const libc::sockaddr_in);
                return Some(std::net::IpAddr::from(u32::from_be(a.sin_addr.s_addr).to_be_bytes()));
            }
            if i.addr_format == fi::FI_SOCKADDR_IN6 && i.src_addrlen >= std::mem::size_of::<libc::sockaddr_in6>() {
                let a = &*(i.src_addr as *const libc::sockaddr_in6);
                return Some(std::net::IpAddr::from(a.sin6_addr.s6_addr));
            }
            None
        }
    }

    /// A new nonzero key for a registration where the application chooses keys: random over
    /// every byte the domain takes (tcp and shm take 8), so a peer cannot guess another
    /// region's key from its own.
    fn new_key(&self) -> u64 {
        match self.0.summary.key_bytes {
            0 => 0,
            n if n >= 8 => rand::random::<u64>().max(1),
            n => (rand::random::<u64>() & ((1u64 << (8 * n)) - 1)).max(1),
        }
    }

    /// Registers `len` bytes at `addr` with the domain.
    ///
    /// # Safety
    /// `addr..addr+len` is allocated, readable and writable memory that stays valid (not
    /// freed, not unmapped) until the returned [`MemoryRegion`] is dropped, and no endpoint
    /// operation on it is in flight when it is dropped.
    pub unsafe fn register_raw(&self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion, OfiError> {
        if len == 0 {
            return Err(OfiError::Invalid { what: "registration", detail: "zero length".into() });
        }
        let rma = self.0.summary.rma;
        let mut acs = (fi::FI_SEND | fi::FI_RECV) as u64;
        if rma {
            acs |= fi::FI_READ as u64;
        }
        if access == Access::RemoteRead {
            if !rma {
                return Err(OfiError::NoRma { provider: self.0.summary.provider.clone() });
            }
            acs |= fi::FI_REMOTE_READ as u64;
        }
        let mut mr: *mut fi::fid_mr = ptr::null_mut();
        // SAFETY: the memory is valid as the caller promises; the domain is open; the
        // registration is owned at once by a MemoryRegion holding the domain.
        unsafe {
            // Where the application chooses keys (tcp, shm: no FI_MR_PROV_KEY), every
            // registration needs its own: drawn at random (`new_key`), again on the rare
            // collision (FI_ENOKEY).
            let mut attempts = 0;
            loop {
                let key = self.new_key();
                let rc = fi::fi_mr_reg(self.0.fid, addr as *const c_void, len, acs, 0, key, 0, &mut mr, ptr::null_mut());
                attempts += 1;
                if rc == -(fi::FI_ENOKEY as i32) && !self.0.prov_key && attempts < 16 {
                    continue;
                }
                check("fi_mr_reg", rc as i64)?;
                break;
            }
            let region = MemoryRegion {
                desc: fi::fi_mr_desc(mr),
                key: fi::fi_mr_key(mr),
                base: if self.0.summary.mr_virt_addr { addr as u64 } else { 0 },
                len,
                fid: mr,
                _domain: self.0.clone(),
            };
            Ok(region)
        }
    }

    /// A buffer of `len` bytes, registered when the provider needs local registration
    /// (`FI_MR_LOCAL`) or when `access` exposes it for one-sided read.
    pub fn alloc(&self, len: usize, access: Access) -> Result<Buffer, OfiError> {
        if len == 0 {
            return Err(OfiError::Invalid { what: "buffer", detail: "zero length".into() });
        }
        let mut data = vec![0u8; len].into_boxed_slice();
        let mr = if self.0.summary.mr_local || access == Access::RemoteRead {
            // SAFETY: `data` is allocated, and the Buffer that owns it holds the registration
            // (its field `mr`), which is dropped before it; operations in flight keep the
            // Buffer in the endpoint's `ops` until their completion or the endpoint's close.
            Some(unsafe { self.register_raw(data.as_mut_ptr(), len, access)? })
        } else {
            None
        };
        Ok(Buffer { mr, data: Storage::Owned(data) })
    }

    /// Exposes the first `len` bytes of `data` for one-sided read by peers that hold the
    /// key: a registration of that range alone with remote read, bound to `endpoint` where
    /// the provider wants that (`FI_MR_ENDPOINT`). On failure the memory comes back.
    pub fn expose_copy(&self, mut data: Box<[u8]>, len: usize, endpoint: &Endpoint) -> Result<Exposure, (Box<[u8]>, OfiError)> {
        if len == 0 || len > data.len() {
            let e = OfiError::OutOfRange { what: "exposed range", offset: 0, len: len as u64, region: data.len() as u64 };
            return Err((data, e));
        }
        // SAFETY: `data` is a heap allocation that the Exposure owns after the registration
        // (field `backing`, dropped after `mr`); moving the Box does not move its memory.
        let mr = match unsafe { self.register_raw(data.as_mut_ptr(), len, Access::RemoteRead) } {
            Ok(mr) => mr,
            Err(e) => return Err((data, e)),
        };
        if let Err(e) = self.bind_to(&mr, endpoint) {
            drop(mr);
            return Err((data, e));
        }
        let remote = RemoteRegion { addr: mr.base, len: len as u64, key: mr.key };
        Ok(Exposure { mr, remote, backing: Backing::Copy(data) })
    }

    /// Exposes `len` bytes of a memory source (`Source::memory`, a caller's buffer) from
    /// `offset` for one-sided read, without a copy: the exposure holds the source, and its
    /// registration is closed before the source is let go of.
    pub fn expose_source(
        &self,
        source: Arc<dyn Source>,
        offset: u64,
        len: u64,
        endpoint: &Endpoint,
    ) -> Result<Exposure, OfiError> {
        let Some(bytes) = source.memory() else {
            return Err(OfiError::Invalid { what: "exposed source", detail: "not memory (a file is exposed by a copy)".into() });
        };
        let range = usize::try_from(offset)
            .ok()
            .zip(usize::try_from(len).ok())
            .and_then(|(o, l)| Some((o, o.checked_add(l)?)))
            .filter(|(_, end)| *end <= bytes.len() && len > 0);
        let Some((from, _)) = range else {
            return Err(OfiError::OutOfRange { what: "exposed range", offset, len, region: bytes.len() as u64 });
        };
        // SAFETY: `Source::memory` promises the bytes stay valid while the source lives; the
        // Exposure holds the source (field `backing`, dropped after `mr`). The provider only
        // reads the region (remote read); nothing writes through this pointer.
        let mr = unsafe { self.register_raw(bytes[from..].as_ptr() as *mut u8, len as usize, Access::RemoteRead)? };
        self.bind_to(&mr, endpoint)?;
        let remote = RemoteRegion { addr: mr.base, len, key: mr.key };
        Ok(Exposure { mr, remote, backing: Backing::Source(source) })
    }

    /// Binds a registration to `endpoint` and enables it, where the provider wants that
    /// (`FI_MR_ENDPOINT`); nothing to do elsewhere.
    fn bind_to(&self, mr: &MemoryRegion, endpoint: &Endpoint) -> Result<(), OfiError> {
        if !self.0.summary.mr_endpoint {
            return Ok(());
        }
        // SAFETY: both objects are open; the endpoint outlives the registration (exposures
        // are closed before their engine's endpoint, see the engine's field order).
        unsafe {
            check("fi_mr_bind", fi::fi_mr_bind(mr.fid, &mut (*endpoint.ep.fid).fid, 0) as i64)?;
            check("fi_mr_enable", fi::fi_mr_enable(mr.fid) as i64)?;
        }
        Ok(())
    }
}

/// Memory a peer may read one-sidedly (`fi_read`) with the exposure's key: its registration
/// and what backs it. Dropping it closes the registration first: later reads with the key
/// fail at the target (or, with libfabric 2.1's shm, never complete: the reader bounds them).
pub struct Exposure {
    // Declaration order is drop order: the registration closes before its memory goes.
    mr: MemoryRegion,
    remote: RemoteRegion,
    backing: Backing,
}

enum Backing {
    Copy(Box<[u8]>),
    // Held, never read: it keeps the exposed memory alive.
    #[allow(dead_code)]
    Source(Arc<dyn Source>),
}

impl std::fmt::Debug for Exposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposure").field("len", &self.remote.len).finish()
    }
}

impl Exposure {
    /// The region as a peer reads it: address, length and key.
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// Closes the registration and hands back the copy it exposed, if it was one (for
    /// reuse), or lets go of the source.
    pub fn close(self) -> Option<Box<[u8]>> {
        let Exposure { mr, backing, .. } = self;
        drop(mr);
        match backing {
            Backing::Copy(b) => Some(b),
            Backing::Source(_) => None,
        }
    }
}

/// A registration of memory with a domain. Closed on drop.
pub struct MemoryRegion {
    fid: *mut fi::fid_mr,
    desc: *mut c_void,
    key: u64,
    base: u64,
    len: usize,
    _domain: Arc<DomainInner>,
}

// SAFETY: the registration belongs to an FI_THREAD_SAFE domain; desc is an opaque value
// the provider reads, never dereferenced here.
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("len", &self.len).field("key", &self.key).finish()
    }
}

impl MemoryRegion {
    /// The key a peer reads with.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The region as a peer addresses it, from `offset` for `len` bytes.
    pub fn remote(&self, offset: usize, len: usize) -> Result<RemoteRegion, OfiError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(OfiError::OutOfRange {
                what: "exposed range",
                offset: offset as u64,
                len: len as u64,
                region: self.len as u64,
            });
        }
        Ok(RemoteRegion { addr: self.base + offset as u64, len: len as u64, key: self.key })
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: opened by fi_mr_reg; dropped once; the domain outlives it (Arc).
        unsafe { close("memory region", &mut (*self.fid).fid) }
    }
}

struct Cq {
    fid: *mut fi::fid_cq,
    wait_fd: Option<RawFd>,
    _domain: Arc<DomainInner>,
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: opened by fi_cq_open; the endpoint bound to it holds an Arc<Cq> and is
        // closed first.
        unsafe { close("completion queue", &mut (*self.fid).fid) }
    }
}

struct Av {
    fid: *mut fi::fid_av,
    _domain: Arc<DomainInner>,
}

impl Drop for Av {
    fn drop(&mut self) {
        // SAFETY: opened by fi_av_open; the endpoint bound to it is closed first.
        unsafe { close("address vector", &mut (*self.fid).fid) }
    }
}

struct Ep {
    fid: *mut fi::fid_ep,
    _cq: Arc<Cq>,
    _av: Arc<Av>,
    _domain: Arc<DomainInner>,
}

impl Drop for Ep {
    fn drop(&mut self) {
        // SAFETY: opened by fi_endpoint; after fi_close returns the provider has dropped every
        // operation posted on it, so the buffers Endpoint frees next are no longer used.
        unsafe { close("endpoint", &mut (*self.fid).fid) }
    }
}

// SAFETY: objects of an FI_THREAD_SAFE domain; the raw pointers are handles owned here.
unsafe impl Send for Cq {}
unsafe impl Sync for Cq {}
unsafe impl Send for Av {}
unsafe impl Sync for Av {}
unsafe impl Send for Ep {}

// ------------------------------------------------------------------------------ buffers

/// Memory for sends, receives and reads: owned by this layer (registered when the provider
/// needs local registration or when it is exposed for one-sided read), or a pool lease lent
/// for the time of one operation and given back with its completion.
pub struct Buffer {
    // Declaration order is drop order: a registration closes before its memory goes.
    mr: Option<MemoryRegion>,
    data: Storage,
}

enum Storage {
    // Boxed: the address handed to libfabric stays put when the Buffer moves.
    Owned(Box<[u8]>),
    // A pool lease: its slab stays mapped (and registered, where the pool's registrar
    // registers) while the lease lives, and the lease moves without moving its memory.
    Lease { ptr: *mut u8, lease: Box<Lease> },
}

// SAFETY: owned storage is a Box; a lease is the pool's handle on its memory (Send), and the
// pointer is the lease's own memory, used only while the Buffer holds the lease.
unsafe impl Send for Storage {}

/// The local descriptor of registered memory (`fi_mr_desc`), as [`PoolRegistrar`] hands it
/// out through a region's keys; [`LocalDesc::NONE`] where the provider needs none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalDesc(u64);

impl LocalDesc {
    /// No descriptor (the provider needs no local registration).
    pub const NONE: LocalDesc = LocalDesc(0);

    /// The descriptor of pool memory whose slab [`PoolRegistrar`] registered: read from the
    /// slab's keys (`Lease::keys`).
    pub fn of(keys: &RegionKeys) -> LocalDesc {
        LocalDesc(keys.handle)
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer").field("len", &self.len()).field("registered", &self.mr.is_some()).finish()
    }
}

impl Buffer {
    /// A buffer over a pool lease, for one operation: sends from its bytes, reads land in
    /// them. Its slab's registration (where the pool's registrar is a [`PoolRegistrar`] of
    /// the endpoint's domain) describes it to the provider. The lease comes back with the
    /// operation's completion ([`into_lease`](Self::into_lease)).
    pub fn from_lease(mut lease: Lease) -> Buffer {
        let ptr = lease.as_mut_ptr();
        Buffer { mr: None, data: Storage::Lease { ptr, lease: Box::new(lease) } }
    }

    /// Memory this layer owns, unregistered: the source of a send where the provider needs
    /// no local registration.
    pub fn owned(data: Box<[u8]>) -> Buffer {
        Buffer { mr: None, data: Storage::Owned(data) }
    }

    /// The lease back, if the buffer was one.
    pub fn into_lease(self) -> Option<Lease> {
        match self.data {
            Storage::Owned(_) => None,
            Storage::Lease { lease, .. } => Some(*lease),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.data {
            Storage::Owned(b) => b,
            Storage::Lease { lease, .. } => lease.as_slice(),
        }
    }

    /// The bytes, writable (no operation is in flight on a Buffer the caller holds).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.data {
            Storage::Owned(b) => b,
            Storage::Lease { lease, .. } => lease.as_mut_slice(),
        }
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        match &self.data {
            Storage::Owned(b) => b.len(),
            Storage::Lease { lease, .. } => lease.len(),
        }
    }

    /// Never true (zero-length buffers are refused); for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The registration, if this buffer has one of its own.
    pub fn region(&self) -> Option<&MemoryRegion> {
        self.mr.as_ref()
    }

    fn ptr(&self) -> *mut c_void {
        match &self.data {
            Storage::Owned(b) => b.as_ptr() as *mut c_void,
            Storage::Lease { ptr, .. } => *ptr as *mut c_void,
        }
    }

    fn desc(&self) -> *mut c_void {
        match (&self.data, &self.mr) {
            (Storage::Lease { lease, .. }, _) => LocalDesc::of(&lease.keys()).0 as *mut c_void,
            (Storage::Owned(_), mr) => mr.as_ref().map_or(ptr::null_mut(), |m| m.desc),
        }
    }
}

// ------------------------------------------------------------------------------ pool registrar

/// Registers the tiered pool's slabs with a domain, where the provider needs local buffers
/// registered (`FI_MR_LOCAL`: verbs); elsewhere (tcp, shm) it registers nothing, as the tcp
/// provider's pool does. Slabs are registered for local use only: a peer reads a block through
/// a registration of that block's range alone, made when it is exposed and closed when it is
/// revoked, so no key reaches memory beyond what was exposed to it.
pub struct PoolRegistrar {
    domain: Domain,
    needed: bool,
    regions: std::sync::Mutex<std::collections::HashMap<u32, MemoryRegion>>,
    next: std::sync::atomic::AtomicU32,
    bytes: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for PoolRegistrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolRegistrar").field("needed", &self.needed).field("bytes", &self.registered_bytes()).finish()
    }
}

impl PoolRegistrar {
    /// A registrar for `domain`: the endpoints opened in it
    /// ([`Endpoint::open_in`]) read into and send from the memory it registers.
    pub fn new(domain: &Domain) -> Self {
        PoolRegistrar {
            domain: domain.clone(),
            needed: domain.info().mr_local,
            regions: Default::default(),
            next: std::sync::atomic::AtomicU32::new(1),
            bytes: Default::default(),
        }
    }

    /// Bytes of pool memory registered now.
    pub fn registered_bytes(&self) -> u64 {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Registrar for PoolRegistrar {
    /// `lkey` numbers the registration (for `deregister`); `handle` is its local descriptor
    /// ([`LocalDesc::of`]); `rkey` stays 0: slabs are never exposed whole.
    // The trait fixes a safe signature; the pointer's validity is `Registrar::register`'s
    // documented contract, which the pool keeps.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    fn register(&self, addr: *mut u8, len: usize) -> Result<RegionKeys, PoolError> {
        if !self.needed {
            return Ok(RegionKeys::default());
        }
        // SAFETY: the pool's contract (`Registrar::register`): the slab stays mapped until
        // `deregister` returns, which drops the registration first.
        let mr = unsafe { self.domain.register_raw(addr, len, Access::Local) }
            .map_err(|e| PoolError::Registration { bytes: len, source: Box::new(e) })?;
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let keys = RegionKeys { lkey: id, rkey: 0, handle: mr.desc as u64 };
        self.regions.lock().unwrap_or_else(|p| p.into_inner()).insert(id, mr);
        self.bytes.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(keys)
    }

    fn deregister(&self, keys: &RegionKeys) {
        if !self.needed {
            return;
        }
        match self.regions.lock().unwrap_or_else(|p| p.into_inner()).remove(&keys.lkey) {
            Some(mr) => {
                self.bytes.fetch_sub(mr.len as u64, std::sync::atomic::Ordering::Relaxed);
                drop(mr);
            }
            None => tracing::warn!(id = keys.lkey, "deregister of a region this registrar does not hold"),
        }
    }
}

/// What a completion reports.
#[derive(Debug)]
pub enum Completion {
    /// A send finished; its buffer comes back.
    Sent {
        /// The caller's token.
        token: u64,
        /// The buffer sent from.
        buf: Buffer,
    },
    /// A message arrived (copied out; the receive buffer is posted again).
    Received {
        /// The sender, when the provider reports sources and the sender is in the AV.
        peer: Option<PeerAddr>,
        /// The message.
        data: Vec<u8>,
    },
    /// A one-sided read finished: `len` bytes of the peer's region are in `buf`.
    Read {
        /// The caller's token.
        token: u64,
        /// The buffer read into.
        buf: Buffer,
        /// Bytes read.
        len: usize,
    },
    /// An operation failed.
    Failed {
        /// The caller's token (None for a posted receive).
        token: Option<u64>,
        /// The error, from the completion queue's error entry.
        error: OfiError,
        /// The buffer of a send or read (a receive buffer is posted again).
        buf: Option<Buffer>,
    },
}

/// Refused post: the error and the caller's buffer back.
#[derive(Debug)]
pub struct PostError {
    /// Why (boxed: refusals are rare and the Result stays small).
    pub error: Box<OfiError>,
    /// The buffer, unchanged.
    pub buf: Buffer,
}

impl PostError {
    fn new(error: OfiError, buf: Buffer) -> Self {
        PostError { error: Box::new(error), buf }
    }
}

enum Op {
    Send { token: u64, buf: Buffer, len: usize },
    Recv { buf: Buffer },
    Read { token: u64, buf: Buffer, len: usize },
}

/// Operations in flight, indexed by the context value libfabric hands back (slot + 1, so no
/// context is null).
#[derive(Default)]
struct Ops {
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
}

impl Ops {
    fn insert(&mut self, op: Op) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(op);
                i
            }
            None => {
                self.slots.push(Some(op));
                self.slots.len() - 1
            }
        }
    }

    fn take(&mut self, i: usize) -> Option<Op> {
        let op = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        Some(op)
    }

    fn context(i: usize) -> *mut c_void {
        (i + 1) as *mut c_void
    }

    fn slot(ctx: *mut c_void) -> Option<usize> {
        (ctx as usize).checked_sub(1)
    }
}

// ------------------------------------------------------------------------------ endpoint

/// A reliable-datagram endpoint (`FI_EP_RDM`) with its completion queue and address vector:
/// one per process talks to every peer (peers are entries of the address vector, not
/// connections), so threads and memory do not grow with the number of peers.
pub struct Endpoint {
    // Declaration order is drop order: the endpoint closes before `ops` frees the buffers
    // of operations still posted on it.
    ep: Ep,
    ops: Ops,
    cq: Arc<Cq>,
    av: Arc<Av>,
    domain: Domain,
    info: EndpointInfo,
    max_msg: usize,
    unposted: Vec<Buffer>,
    backlog: std::collections::VecDeque<Pending>,
    counters: Counters,
}

/// What went through an endpoint, counted at completion (injects when libfabric took them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Sends completed.
    pub sends: u64,
    /// Bytes of completed sends.
    pub send_bytes: u64,
    /// Injected messages.
    pub injects: u64,
    /// Messages received.
    pub recvs: u64,
    /// Bytes received.
    pub recv_bytes: u64,
    /// One-sided reads completed (`fi_read`).
    pub reads: u64,
    /// Bytes of completed reads.
    pub read_bytes: u64,
    /// Operations that completed with an error.
    pub errors: u64,
}

impl Counters {
    /// Named values, as the engine's provider counters list them.
    pub fn named(&self) -> [(&'static str, u64); 8] {
        [
            ("ofi_sends", self.sends),
            ("ofi_send_bytes", self.send_bytes),
            ("ofi_injects", self.injects),
            ("ofi_recvs", self.recvs),
            ("ofi_recv_bytes", self.recv_bytes),
            ("ofi_reads", self.reads),
            ("ofi_read_bytes", self.read_bytes),
            ("ofi_errors", self.errors),
        ]
    }
}

/// A post libfabric could not take yet (`FI_EAGAIN`), kept with its buffer.
enum Pending {
    Send { peer: PeerAddr, buf: Buffer, len: usize, token: u64, delivered: bool },
    Inject { peer: PeerAddr, data: Vec<u8> },
    Read { peer: PeerAddr, buf: Buffer, len: usize, addr: u64, key: u64, token: u64 },
}

impl Pending {
    fn peer(&self) -> PeerAddr {
        match self {
            Pending::Send { peer, .. } | Pending::Inject { peer, .. } | Pending::Read { peer, .. } => *peer,
        }
    }
}

enum Posted {
    Yes,
    Again(Buffer),
    Failed(PostError),
}

enum Retry {
    Again(Box<Pending>),
    Failed(u64, PostError),
    InjectFailed(OfiError),
}

impl Retry {
    /// For send and read: `submit` never returns `Again` (it queues), nor `InjectFailed`.
    fn into_post_error(self) -> PostError {
        match self {
            Retry::Failed(_, e) => e,
            Retry::Again(_) | Retry::InjectFailed(_) => unreachable!("submit queues Again; send and read never inject"),
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("info", &self.info).finish()
    }
}

/// Runs `f` (opening an endpoint) and puts back the process's SIGSEGV and SIGBUS handlers as
/// they were before it. libfabric's shm (also the shm inside efa) installs its own for both when
/// it opens its first endpoint in a process, to unlink its /dev/shm regions on a crash, then
/// hands the signal to the handler it replaced. A JVM takes SIGSEGV in normal running (implicit
/// null checks, safepoint polls): in a Spark executor the first one unlinked the regions while
/// the executor lived on, so a peer executor could no longer map this one's region, libfabric
/// 2.1 dropped its connection request, and its first message here was never received. A
/// process that really crashes now leaves its regions in /dev/shm, as a killed one always did.
fn keeping_fault_handlers<T>(f: impl FnOnce() -> T) -> T {
    const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];
    // SAFETY: sigaction with a null new action only writes the current one into `old`, a
    // plain C struct for which all-zero bytes are a valid value.
    let saved = SIGNALS.map(|sig| unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, ptr::null(), &mut old) == 0).then_some(old)
    });
    let out = f();
    for (sig, old) in SIGNALS.into_iter().zip(saved) {
        if let Some(old) = old {
            // SAFETY: `old` is the action sigaction returned for this signal: putting it back
            // installs what was installed before (the JVM's handler, or the default).
            unsafe { libc::sigaction(sig, &old, ptr::null_mut()) };
        }
    }
    out
}

impl Endpoint {
    /// Opens fabric, domain, completion queue, address vector and endpoint for
    /// `cfg.provider`, and posts `cfg.rx_depth` receive buffers of `cfg.max_msg` bytes.
    pub fn open(cfg: &OfiConfig) -> Result<Self, OfiError> {
        Endpoint::open_in(&Domain::open(cfg)?, cfg)
    }

    /// Opens a completion queue, an address vector and an endpoint in `domain` (with the
    /// provider's answer the domain was opened from), and posts `cfg.rx_depth` receive
    /// buffers of `cfg.max_msg` bytes.
    pub fn open_in(domain: &Domain, cfg: &OfiConfig) -> Result<Self, OfiError> {
        if cfg.max_msg == 0 || cfg.rx_depth == 0 || cfg.cq_size == 0 {
            return Err(OfiError::Invalid {
                what: "configuration",
                detail: "max_msg, rx_depth and cq_size must be positive".into(),
            });
        }
        let summary = domain.info().clone();
        if cfg.max_msg > summary.max_msg_size {
            return Err(OfiError::MessageTooLarge { len: cfg.max_msg, max: summary.max_msg_size });
        }
        let dom = &domain.0;
        // SAFETY: the domain is open (its Arc is held by every object opened here) and its
        // info entry is the provider's answer it was opened from. Each object opened is owned
        // at once by a value whose Drop closes it, holding Arcs of what it was opened from.
        unsafe {
            let cq = Endpoint::open_cq(dom, cfg)?;
            let mut av_attr = fi::fi_av_attr { type_: fi::fi_av_type_FI_AV_TABLE, ..Default::default() };
            let mut av: *mut fi::fid_av = ptr::null_mut();
            check("fi_av_open", fi::fi_av_open(dom.fid, &mut av_attr, &mut av, ptr::null_mut()) as i64)?;
            let av = Arc::new(Av { fid: av, _domain: dom.clone() });

            let mut ep: *mut fi::fid_ep = ptr::null_mut();
            let rc = keeping_fault_handlers(|| fi::fi_endpoint(dom.fid, dom.info.0, &mut ep, ptr::null_mut()));
            check("fi_endpoint", rc as i64)?;
            let ep = Ep { fid: ep, _cq: cq.clone(), _av: av.clone(), _domain: dom.clone() };
            check("fi_ep_bind(av)", fi::fi_ep_bind(ep.fid, &mut (*av.fid).fid, 0) as i64)?;
            check("fi_ep_bind(cq)", fi::fi_ep_bind(ep.fid, &mut (*cq.fid).fid, (fi::FI_TRANSMIT | fi::FI_RECV) as u64) as i64)?;
            check("fi_enable", fi::fi_enable(ep.fid) as i64).map_err(|e| match e {
                // ofi_rxm sizes the core provider's completion queues for FI_UNIVERSE_SIZE
                // peers (default 256): more entries than a small device has (rxe: 32767)
                // fails here with EINVAL, which alone says nothing useful.
                OfiError::Call { call, code, message }
                    if code == fi::FI_EINVAL as i32 && summary.provider.contains("ofi_rxm") =>
                {
                    OfiError::Call {
                        call,
                        code,
                        message: format!(
                            "{message}; ofi_rxm sizes its completion queues for FI_UNIVERSE_SIZE peers \
                             (default 256), more than some devices hold (rxe: 32767 entries): set \
                             FI_UNIVERSE_SIZE lower, e.g. 64, in the environment"
                        ),
                    }
                }
                other => other,
            })?;

            let mut me = Endpoint {
                ep,
                ops: Ops::default(),
                info: EndpointInfo { wait_fd: cq.wait_fd.is_some(), ..summary },
                cq,
                av,
                domain: domain.clone(),
                max_msg: cfg.max_msg,
                unposted: Vec::new(),
                backlog: std::collections::VecDeque::new(),
                counters: Counters::default(),
            };
            for _ in 0..cfg.rx_depth {
                let buf = me.alloc(cfg.max_msg, Access::Local)?;
                me.post_recv(buf).map_err(|e| *e.error)?;
            }
            tracing::debug!(provider = %me.info.provider, fabric = %me.info.fabric, domain = %me.info.domain,
                rma = me.info.rma, wait_fd = me.info.wait_fd, "libfabric endpoint open");
            Ok(me)
        }
    }

    /// Opens the completion queue, with a wait fd when asked and offered.
    fn open_cq(domain: &Arc<DomainInner>, cfg: &OfiConfig) -> Result<Arc<Cq>, OfiError> {
        let waits: &[fi::fi_wait_obj] = if cfg.wait_fd {
            &[fi::fi_wait_obj_FI_WAIT_FD, fi::fi_wait_obj_FI_WAIT_NONE]
        } else {
            &[fi::fi_wait_obj_FI_WAIT_NONE]
        };
        let mut last = None;
        for &wait_obj in waits {
            let mut attr =
                fi::fi_cq_attr { size: cfg.cq_size, format: fi::fi_cq_format_FI_CQ_FORMAT_DATA, wait_obj, ..Default::default() };
            let mut cq: *mut fi::fid_cq = ptr::null_mut();
            // SAFETY: a DomainInner is an open domain until its last Arc drops; the queue is
            // owned at once by a Cq holding the domain.
            let rc = unsafe { fi::fi_cq_open(domain.fid, &mut attr, &mut cq, ptr::null_mut()) };
            if rc != 0 {
                last = Some(check("fi_cq_open", rc as i64).unwrap_err());
                continue;
            }
            let mut cq = Cq { fid: cq, wait_fd: None, _domain: domain.clone() };
            if wait_obj == fi::fi_wait_obj_FI_WAIT_FD {
                let mut fd: std::os::raw::c_int = -1;
                // SAFETY: FI_GETWAIT on a FI_WAIT_FD queue writes one int.
                let rc = unsafe { fi::fi_control(&mut (*cq.fid).fid, fi::FI_GETWAIT as i32, &mut fd as *mut _ as *mut c_void) };
                if rc != 0 || fd < 0 {
                    last = Some(check("fi_control(FI_GETWAIT)", rc.min(-1) as i64).unwrap_err());
                    continue; // drop closes this queue; try the next kind
                }
                cq.wait_fd = Some(fd);
            }
            return Ok(Arc::new(cq));
        }
        Err(last.expect("at least one kind of completion queue was tried"))
    }

    /// What the provider granted.
    pub fn info(&self) -> &EndpointInfo {
        &self.info
    }

    /// A handle on the domain, for registering memory (e.g. a pool's registrar).
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// The largest message a peer with the same configuration receives.
    pub fn max_msg(&self) -> usize {
        self.max_msg
    }

    /// This endpoint's address, for peers to insert (`fi_getname`).
    pub fn address(&self) -> Result<Vec<u8>, OfiError> {
        let mut len: usize = 0;
        // SAFETY: with a zero length libfabric writes nothing and reports the size needed
        // (-FI_ETOOSMALL); the second call writes at most `len` bytes into `buf`.
        unsafe {
            let fid = &mut (*self.ep.fid).fid as *mut fi::fid;
            let rc = fi::fi_getname(fid, ptr::null_mut(), &mut len);
            if rc != -(fi::FI_ETOOSMALL as i32) && rc != 0 {
                check("fi_getname", rc as i64)?;
            }
            let mut buf = vec![0u8; len];
            check("fi_getname", fi::fi_getname(fid, buf.as_mut_ptr() as *mut c_void, &mut len) as i64)?;
            buf.truncate(len);
            Ok(buf)
        }
    }

    /// Checks that `addr` is a whole address of this provider's format, so libfabric never
    /// reads past the bytes a peer sent.
    fn validate_address(&self, addr: &[u8]) -> Result<(), OfiError> {
        // SAFETY: the info list lives as long as the domain.
        let format = unsafe { (*self.domain.0.info.0).addr_format };
        let bad = |detail: String| Err(OfiError::Invalid { what: "peer address", detail });
        match format {
            f if f == fi::FI_ADDR_STR => {
                if !addr.contains(&0) {
                    return bad("a string address without its NUL terminator".into());
                }
            }
            f if f == fi::FI_SOCKADDR_IN => {
                if addr.len() < std::mem::size_of::<libc::sockaddr_in>() {
                    return bad(format!("{} bytes, a sockaddr_in needs 16", addr.len()));
                }
            }
            f if f == fi::FI_SOCKADDR_IN6 => {
                if addr.len() < std::mem::size_of::<libc::sockaddr_in6>() {
                    return bad(format!("{} bytes, a sockaddr_in6 needs 28", addr.len()));
                }
            }
            _ => {
                let own = self.address()?.len();
                if addr.len() != own {
                    return bad(format!("{} bytes, this provider's addresses have {own}", addr.len()));
                }
            }
        }
        Ok(())
    }

    /// Inserts a peer's address (from its [`address`](Self::address)) into the address vector.
    pub fn insert_peer(&mut self, addr: &[u8]) -> Result<PeerAddr, OfiError> {
        self.validate_address(addr)?;
        let mut out: fi::fi_addr_t = FI_ADDR_NOTAVAIL;
        // SAFETY: `addr` holds one whole address of the provider's format (checked above);
        // libfabric copies it and writes one fi_addr_t to `out`.
        let rc = unsafe { fi::fi_av_insert(self.av.fid, addr.as_ptr() as *const c_void, 1, &mut out, 0, ptr::null_mut()) };
        check("fi_av_insert", rc as i64)?;
        if rc != 1 || out == FI_ADDR_NOTAVAIL {
            return Err(OfiError::Invalid { what: "peer address", detail: "fi_av_insert inserted nothing".into() });
        }
        Ok(PeerAddr(out))
    }

    /// A buffer of `len` bytes from this endpoint's domain ([`Domain::alloc`]).
    pub fn alloc(&self, len: usize, access: Access) -> Result<Buffer, OfiError> {
        self.domain.alloc(len, access)
    }

    fn post_recv(&mut self, buf: Buffer) -> Result<(), PostError> {
        let ptr = buf.ptr();
        let (len, desc) = (buf.len(), buf.desc());
        let slot = self.ops.insert(Op::Recv { buf });
        // SAFETY: the buffer (and its registration) is owned by `ops` until the completion or
        // until the endpoint is closed; the Box does not move its heap memory.
        let rc = unsafe { fi::fi_recv(self.ep.fid, ptr, len, desc, FI_ADDR_NOTAVAIL, Ops::context(slot)) };
        match self.after_post("fi_recv", rc as i64, slot) {
            Posted::Yes => Ok(()),
            Posted::Again(buf) => Err(PostError::new(
                OfiError::Call { call: "fi_recv", code: fi::FI_EAGAIN as i32, message: strerror(fi::FI_EAGAIN as i32) },
                buf,
            )),
            Posted::Failed(e) => Err(e),
        }
    }

    /// Undoes the bookkeeping of a post that libfabric refused; hands back the buffer.
    fn after_post(&mut self, call: &'static str, rc: i64, slot: usize) -> Posted {
        if rc == 0 {
            return Posted::Yes;
        }
        let buf = match self.ops.take(slot).expect("the slot just inserted") {
            Op::Send { buf, .. } | Op::Recv { buf } | Op::Read { buf, .. } => buf,
        };
        if rc == -(fi::FI_EAGAIN as i64) {
            Posted::Again(buf)
        } else {
            Posted::Failed(PostError::new(check(call, rc).unwrap_err(), buf))
        }
    }

    /// Posts one operation to libfabric; `Again` when its queue is full for now (libfabric's
    /// `FI_EAGAIN`, e.g. while `ofi_rxm` sets up a connection or `shm` maps a peer).
    fn post(&mut self, p: Pending) -> Result<(), Retry> {
        match p {
            Pending::Send { peer, buf, len, token, delivered } => {
                let (ptr, desc) = (buf.ptr(), buf.desc());
                let slot = self.ops.insert(Op::Send { token, buf, len });
                // SAFETY: as in post_recv: `ops` owns the buffer until its completion or the
                // close. The iovec and descriptor array are read by fi_sendmsg before it
                // returns.
                let rc = unsafe {
                    if delivered {
                        let iov = libc::iovec { iov_base: ptr, iov_len: len };
                        let mut d = [desc];
                        let msg = fi::fi_msg {
                            msg_iov: &iov as *const libc::iovec,
                            desc: d.as_mut_ptr(),
                            iov_count: 1,
                            addr: peer.0,
                            context: Ops::context(slot),
                            data: 0,
                        };
                        let rc = fi::fi_sendmsg(self.ep.fid, &msg, fi::FI_DELIVERY_COMPLETE as u64 | fi::FI_COMPLETION as u64);
                        if rc == -(fi::FI_EBADFLAGS as isize) {
                            // A provider without delivery completion: a plain send.
                            fi::fi_send(self.ep.fid, ptr, len, desc, peer.0, Ops::context(slot))
                        } else {
                            rc
                        }
                    } else {
                        fi::fi_send(self.ep.fid, ptr, len, desc, peer.0, Ops::context(slot))
                    }
                };
                match self.after_post("fi_send", rc as i64, slot) {
                    Posted::Yes => Ok(()),
                    Posted::Again(buf) => Err(Retry::Again(Box::new(Pending::Send { peer, buf, len, token, delivered }))),
                    Posted::Failed(e) => Err(Retry::Failed(token, e)),
                }
            }
            Pending::Read { peer, buf, len, addr, key, token } => {
                let (ptr, desc) = (buf.ptr(), buf.desc());
                let slot = self.ops.insert(Op::Read { token, buf, len });
                // SAFETY: as in post_recv; the remote address and key are the peer's business
                // (the provider checks them and reports a completion error).
                let rc = unsafe { fi::fi_read(self.ep.fid, ptr, len, desc, peer.0, addr, key, Ops::context(slot)) };
                match self.after_post("fi_read", rc as i64, slot) {
                    Posted::Yes => Ok(()),
                    Posted::Again(buf) => Err(Retry::Again(Box::new(Pending::Read { peer, buf, len, addr, key, token }))),
                    Posted::Failed(e) => Err(Retry::Failed(token, e)),
                }
            }
            Pending::Inject { peer, data } => {
                // SAFETY: fi_inject copies `data` before returning and reports no completion.
                let rc = unsafe { fi::fi_inject(self.ep.fid, data.as_ptr() as *const c_void, data.len(), peer.0) };
                if rc == -(fi::FI_EAGAIN as isize) {
                    Err(Retry::Again(Box::new(Pending::Inject { peer, data })))
                } else {
                    check("fi_inject", rc as i64).map_err(Retry::InjectFailed)?;
                    self.counters.injects += 1;
                    Ok(())
                }
            }
        }
    }

    /// Posts `p` now, or queues it behind earlier posts to the same peer libfabric could not
    /// take yet (so a peer's messages leave in the order they were made, and a peer that
    /// takes nothing holds up no other).
    fn submit(&mut self, p: Pending) -> Result<(), Retry> {
        let to = p.peer();
        if self.backlog.iter().any(|q| q.peer() == to) {
            self.backlog.push_back(p);
            return Ok(());
        }
        match self.post(p) {
            Err(Retry::Again(p)) => {
                self.backlog.push_back(*p);
                Ok(())
            }
            other => other,
        }
    }

    /// Posts what the backlog holds, each peer's in order, until libfabric says again for
    /// that peer; failures become completions.
    fn flush(&mut self, out: &mut Vec<Completion>) {
        if self.backlog.is_empty() {
            return;
        }
        let mut blocked: Vec<PeerAddr> = Vec::new();
        let mut kept = std::collections::VecDeque::with_capacity(self.backlog.len());
        while let Some(p) = self.backlog.pop_front() {
            if blocked.contains(&p.peer()) {
                kept.push_back(p);
                continue;
            }
            match self.post(p) {
                Ok(()) => {}
                Err(Retry::Again(p)) => {
                    blocked.push(p.peer());
                    kept.push_back(*p);
                }
                Err(Retry::Failed(token, e)) => {
                    out.push(Completion::Failed { token: Some(token), error: *e.error, buf: Some(e.buf) })
                }
                Err(Retry::InjectFailed(error)) => out.push(Completion::Failed { token: None, error, buf: None }),
            }
        }
        self.backlog = kept;
    }

    /// Drops the posts to `peer` libfabric has not taken yet (its last connection went; a
    /// peer that went away may refuse them for ever): they come back as failed completions,
    /// with their buffers.
    pub fn forget_peer(&mut self, peer: PeerAddr) -> Vec<Completion> {
        let mut dropped = Vec::new();
        let mut kept = std::collections::VecDeque::with_capacity(self.backlog.len());
        for p in self.backlog.drain(..) {
            let gone = || OfiError::Invalid { what: "post", detail: "its peer went before libfabric took it".into() };
            match p {
                Pending::Send { peer: to, buf, token, .. } | Pending::Read { peer: to, buf, token, .. } if to == peer => {
                    dropped.push(Completion::Failed { token: Some(token), error: gone(), buf: Some(buf) })
                }
                Pending::Inject { peer: to, .. } if to == peer => {}
                other => kept.push_back(other),
            }
        }
        self.backlog = kept;
        dropped
    }

    /// Sends the first `len` bytes of `buf` to `peer`. The buffer comes back in
    /// [`Completion::Sent`] with `token`. A post libfabric cannot take yet is queued and
    /// posted by [`poll`](Self::poll), in order.
    pub fn send(&mut self, peer: PeerAddr, buf: Buffer, len: usize, token: u64) -> Result<(), PostError> {
        self.send_with(peer, buf, len, token, false)
    }

    /// [`send`](Self::send) whose completion says the message reached the peer's endpoint
    /// (`FI_DELIVERY_COMPLETE`, where the provider has it), not only that it left: what goes
    /// before a connection's close, so the peer has every message before it sees the close.
    pub fn send_delivered(&mut self, peer: PeerAddr, buf: Buffer, len: usize, token: u64) -> Result<(), PostError> {
        self.send_with(peer, buf, len, token, true)
    }

    fn send_with(&mut self, peer: PeerAddr, buf: Buffer, len: usize, token: u64, delivered: bool) -> Result<(), PostError> {
        if len > buf.len() || len > self.max_msg {
            let error = if len > buf.len() {
                OfiError::OutOfRange { what: "send", offset: 0, len: len as u64, region: buf.len() as u64 }
            } else {
                OfiError::MessageTooLarge { len, max: self.max_msg }
            };
            return Err(PostError::new(error, buf));
        }
        self.submit(Pending::Send { peer, buf, len, token, delivered }).map_err(Retry::into_post_error)
    }

    /// Sends a small message without a completion (`fi_inject`): `data` is copied (by
    /// libfabric, or into the backlog when it cannot take it yet). At most
    /// [`EndpointInfo::inject_size`] bytes.
    pub fn inject(&mut self, peer: PeerAddr, data: &[u8]) -> Result<(), OfiError> {
        if data.len() > self.info.inject_size || data.len() > self.max_msg {
            return Err(OfiError::MessageTooLarge { len: data.len(), max: self.info.inject_size.min(self.max_msg) });
        }
        self.submit(Pending::Inject { peer, data: data.to_vec() }).map_err(|r| match r {
            Retry::InjectFailed(e) => e,
            other => *other.into_post_error().error,
        })
    }

    /// Reads `len` bytes at `offset` of a peer's exposed `remote` region into `buf`
    /// (`fi_read`). The buffer comes back in [`Completion::Read`] with `token`.
    pub fn read(
        &mut self,
        peer: PeerAddr,
        buf: Buffer,
        len: usize,
        remote: RemoteRegion,
        offset: u64,
        token: u64,
    ) -> Result<(), PostError> {
        let fail = |error, buf| Err(PostError::new(error, buf));
        if !self.info.rma {
            return fail(OfiError::NoRma { provider: self.info.provider.clone() }, buf);
        }
        if offset.checked_add(len as u64).is_none_or(|end| end > remote.len) {
            return fail(
                OfiError::OutOfRange { what: "read of the peer's region", offset, len: len as u64, region: remote.len },
                buf,
            );
        }
        if len > buf.len() {
            return fail(OfiError::OutOfRange { what: "read target", offset: 0, len: len as u64, region: buf.len() as u64 }, buf);
        }
        self.submit(Pending::Read { peer, buf, len, addr: remote.addr + offset, key: remote.key, token })
            .map_err(Retry::into_post_error)
    }

    /// Drives progress and appends what completed to `out`; returns how many. Reads at most
    /// `max` completions so one turn of a loop stays bounded.
    pub fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, OfiError> {
        // Receive buffers a refused repost left over go back first, then queued posts.
        while let Some(buf) = self.unposted.pop() {
            if let Err(e) = self.post_recv(buf) {
                self.unposted.push(e.buf);
                break;
            }
        }
        let before = out.len();
        self.flush(out);
        const BATCH: usize = 16;
        let mut entries = [fi::fi_cq_data_entry::default(); BATCH];
        let mut srcs = [FI_ADDR_NOTAVAIL; BATCH];
        let mut done = out.len() - before;
        while done < max {
            let want = BATCH.min(max - done);
            // SAFETY: `entries` and `srcs` have room for `want` entries each.
            let n = unsafe {
                if self.info.source {
                    fi::fi_cq_readfrom(self.cq.fid, entries.as_mut_ptr() as *mut c_void, want, srcs.as_mut_ptr())
                } else {
                    fi::fi_cq_read(self.cq.fid, entries.as_mut_ptr() as *mut c_void, want)
                }
            };
            if n == -(fi::FI_EAGAIN as isize) {
                break;
            }
            if n == -(fi::FI_EAVAIL as isize) {
                out.push(self.read_error()?);
                done += 1;
                continue;
            }
            let n = check("fi_cq_read", n as i64)? as usize;
            for k in 0..n {
                let e = &entries[k];
                let Some(op) = Ops::slot(e.op_context).and_then(|s| self.ops.take(s)) else {
                    tracing::warn!(context = e.op_context as usize, "completion for no operation in flight");
                    continue;
                };
                out.push(match op {
                    Op::Send { token, buf, len } => {
                        self.counters.sends += 1;
                        self.counters.send_bytes += len as u64;
                        Completion::Sent { token, buf }
                    }
                    Op::Read { token, buf, len } => {
                        self.counters.reads += 1;
                        self.counters.read_bytes += len as u64;
                        Completion::Read { token, buf, len }
                    }
                    Op::Recv { buf } => {
                        let len = e.len.min(buf.len());
                        self.counters.recvs += 1;
                        self.counters.recv_bytes += len as u64;
                        let data = buf.as_slice()[..len].to_vec();
                        let peer = (self.info.source && srcs[k] != FI_ADDR_NOTAVAIL).then_some(PeerAddr(srcs[k]));
                        self.repost(buf);
                        Completion::Received { peer, data }
                    }
                });
            }
            done += n;
            if n < want {
                break;
            }
        }
        // Completions made room: post what waits.
        self.flush(out);
        Ok(out.len() - before)
    }

    fn repost(&mut self, buf: Buffer) {
        if let Err(e) = self.post_recv(buf) {
            tracing::debug!(error = %e.error, "receive buffer not posted again yet");
            self.unposted.push(e.buf);
        }
    }

    /// Reads one error entry of the completion queue.
    fn read_error(&mut self) -> Result<Completion, OfiError> {
        let mut err = fi::fi_cq_err_entry::default();
        // SAFETY: `err` is a zeroed entry with no provider-data buffer (err_data_size 0), so
        // the provider keeps err_data in its own storage, valid until the next read of the
        // queue; it is used (fi_cq_strerror) before that.
        let (op, code, prov_errno, text) = unsafe {
            let n = fi::fi_cq_readerr(self.cq.fid, &mut err, 0);
            check("fi_cq_readerr", n as i64)?;
            let mut msg = [0 as std::os::raw::c_char; 256];
            let p = fi::fi_cq_strerror(self.cq.fid, err.prov_errno, err.err_data, msg.as_mut_ptr(), msg.len());
            (Ops::slot(err.op_context).and_then(|s| self.ops.take(s)), err.err, err.prov_errno, c_string(p))
        };
        self.counters.errors += 1;
        let message = format!("{}; provider: {}", strerror(code), text);
        let error = |op| OfiError::Completion { op, code, prov_errno, message: message.clone() };
        Ok(match op {
            Some(Op::Send { token, buf, .. }) => Completion::Failed { token: Some(token), error: error("send"), buf: Some(buf) },
            Some(Op::Read { token, buf, .. }) => Completion::Failed { token: Some(token), error: error("read"), buf: Some(buf) },
            Some(Op::Recv { buf }) => {
                self.repost(buf);
                Completion::Failed { token: None, error: error("recv"), buf: None }
            }
            None => Completion::Failed { token: None, error: error("unknown operation"), buf: None },
        })
    }

    /// The completion queue's file descriptor, when it has one: readable when completions
    /// may be waiting. Call [`trywait`](Self::trywait) before sleeping on it.
    pub fn wait_fd(&self) -> Option<RawFd> {
        self.cq.wait_fd
    }

    /// Whether the caller may now sleep on [`wait_fd`](Self::wait_fd) (`fi_trywait`): false
    /// when completions are already queued or the provider needs a poll first.
    pub fn trywait(&self) -> bool {
        if self.cq.wait_fd.is_none() {
            return false;
        }
        let mut fid = [unsafe_cq_fid(&self.cq)];
        // SAFETY: one valid fid in the array; the fabric is the one the CQ was opened on.
        let rc = unsafe { fi::fi_trywait(self.domain.0._fabric.0, fid.as_mut_ptr(), 1) };
        rc == 0
    }

    /// Whether a loop whose poll holds [`wait_fd`](Self::wait_fd) edge-triggered (mio) may
    /// sleep now: the provider allows it ([`trywait`](Self::trywait)) and the descriptor is
    /// not readable already (an edge that came before the last poll of the queue would not
    /// come again; ofi_rxm's descriptor stays readable while a connection is being set up).
    pub fn can_sleep(&self) -> bool {
        let Some(fd) = self.cq.wait_fd else { return false };
        if !self.trywait() {
            return false;
        }
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call; a zero timeout never blocks.
        unsafe { libc::poll(&mut pfd, 1, 0) == 0 }
    }

    /// Sleeps until the completion queue's fd is readable or `timeout` passes, when the
    /// provider allows sleeping now ([`trywait`](Self::trywait)); returns at once otherwise.
    /// Returns whether it slept until woken (not timed out). For loops without their own
    /// poll set; the engine's driver puts [`wait_fd`](Self::wait_fd) in its own.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        let Some(fd) = self.cq.wait_fd else { return false };
        if !self.trywait() {
            return false;
        }
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, ms) > 0 }
    }

    /// Operations posted and not yet completed (receive buffers included).
    pub fn in_flight(&self) -> usize {
        self.ops.slots.len() - self.ops.free.len()
    }

    /// What went through this endpoint.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Posts queued because libfabric could not take them yet; [`poll`](Self::poll) posts them.
    pub fn queued(&self) -> usize {
        self.backlog.len()
    }
}

fn unsafe_cq_fid(cq: &Cq) -> *mut fi::fid {
    // SAFETY: `cq.fid` is an open CQ; taking the address of its embedded fid reads nothing.
    unsafe { &mut (*cq.fid).fid as *mut fi::fid }
}
