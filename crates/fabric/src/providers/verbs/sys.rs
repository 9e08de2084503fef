//! Every `unsafe` of the verbs provider: RAII wrappers over the ibverbs objects, each owning
//! `Arc`s of its parents so teardown runs in the order the kernel requires (a QP before its
//! CQ and SRQ — `ibv_destroy_cq` fails with `EBUSY` while a QP uses it; memory windows before
//! the memory region they are bound to; every MR and QP before the protection domain; the
//! domain before the device context). `Drop` logs failures, never panics: this runs inside
//! an executor JVM.
//!
//! Memory the device may write (receive buffers, READ targets) or read (send buffers, exposed
//! regions) is owned here for as long as work posted on it is outstanding:
//!
//! * receive and send buffers are slabs owned by [`Srq`] and [`SendBuffers`]; a slot is
//!   writable by the caller only while it is not posted;
//! * a READ takes its target [`Lease`] by value and keeps it in the queue pair's table of
//!   posted work until the completion (success or flush) comes back — so no code path can
//!   return the buffer to the pool while the NIC may still write into it;
//! * a bind keeps its window alive until its completion.
//!
//! Posting needs a [`Poster`], which only a queue pair in the ready-to-send state hands out:
//! after [`Qp::enter_error_state`] nothing more can be posted, and every posted request completes
//! (flushed) before the queue pair may be destroyed.

use crate::driver::conn::FailedRead;
use crate::error::FabricError;
use crate::memory::pool::{Lease, PoolError, RegionKeys, Registrar};
use crate::providers::verbs::bootstrap::AttachRecord;
use crate::providers::verbs::memlock::memlock_advice;
use parking_lot::Mutex;
use rdma_shuffle_wire::{Descriptor, Knob};
use rdma_sys::*;
use std::collections::HashMap;
use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const PROVIDER: &str = "verbs";

pub(crate) fn err(message: impl Into<String>) -> FabricError {
    FabricError::Provider { provider: PROVIDER, message: message.into(), knob: None }
}

fn err_knob(message: impl Into<String>, knob: Knob) -> FabricError {
    FabricError::Provider { provider: PROVIDER, message: message.into(), knob: Some(knob) }
}

fn os_err(what: &str) -> FabricError {
    err(format!("{what}: {}", io::Error::last_os_error()))
}

/// Verbs return a positive errno, or -1 with errno set.
fn rc_err(what: &str, rc: i32) -> FabricError {
    let code = if rc < 0 { io::Error::last_os_error().raw_os_error().unwrap_or(0) } else { rc };
    err(format!("{what}: {}", io::Error::from_raw_os_error(code)))
}

/// Work-request id bit of receive buffers (the rest is the slot).
pub(crate) const WR_RECV: u64 = 1 << 63;
/// Work-request id bit of sends (the rest is the send slot).
pub(crate) const WR_SEND: u64 = 1 << 62;

// ------------------------------------------------------------------------------ device

struct Context {
    raw: *mut ibv_context,
    name: String,
}
// SAFETY: ibverbs contexts are thread-safe (rdma-core documents the verbs as MT-safe).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}
impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: last owner; every child object holds an Arc<Context> and is gone.
        let rc = unsafe { ibv_close_device(self.raw) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    raw: *mut ibv_pd,
    ctx: Arc<Context>,
}
// SAFETY: a PD is a kernel handle; the verbs taking it are MT-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}
impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR, MW, SRQ and QP holds an Arc<Pd>, so none is left.
        let rc = unsafe { ibv_dealloc_pd(self.raw) };
        if rc != 0 {
            tracing::warn!(device = %self.ctx.name, rc, "ibv_dealloc_pd failed");
        }
    }
}

/// An opened RDMA device, port and GID, and its protection domain.
pub(crate) struct Device {
    pub(crate) pd: Arc<Pd>,
    pub(crate) port: u8,
    pub(crate) active_mtu: u32,
    pub(crate) gid: [u8; 16],
    pub(crate) gid_index: u8,
    pub(crate) rd_atomic: u8,
    pub(crate) max_mw: u32,
}

fn is_ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff
}

impl Device {
    /// Opens `device` (or the first device with an active `port`), picks the GID, allocates
    /// the protection domain. Errors say what is missing and which knob picks another.
    pub(crate) fn open(device: Option<&str>, port: u8, gid_index: Option<u8>) -> Result<Device, FabricError> {
        // SAFETY: plain verbs calls; every pointer is checked before use, and the device list
        // is freed after the chosen device was opened (opening keeps its own reference).
        unsafe {
            let mut n = 0i32;
            let list = ibv_get_device_list(&mut n);
            if list.is_null() || n == 0 {
                let e = io::Error::last_os_error();
                if !list.is_null() {
                    ibv_free_device_list(list);
                }
                return Err(err(format!(
                    "no RDMA device found (ibv_get_device_list: {e}; no /dev/infiniband or no rdma driver loaded)"
                )));
            }
            let mut names = Vec::new();
            let mut chosen = None;
            for i in 0..n as usize {
                let d = *list.add(i);
                let name = CStr::from_ptr(ibv_get_device_name(d)).to_string_lossy().into_owned();
                let wanted = device.map(|w| w == name).unwrap_or(true);
                if wanted && chosen.is_none() {
                    let ctx = ibv_open_device(d);
                    if !ctx.is_null() {
                        let mut pa: ibv_port_attr = std::mem::zeroed();
                        let active = ___ibv_query_port(ctx, port, &mut pa) == 0 && pa.state == ibv_port_state::IBV_PORT_ACTIVE;
                        if active || device.is_some() {
                            chosen = Some((Context { raw: ctx, name: name.clone() }, pa, active));
                        } else {
                            ibv_close_device(ctx);
                        }
                    }
                }
                names.push(name);
            }
            ibv_free_device_list(list);
            let (ctx, port_attr, active) = chosen.ok_or_else(|| match device {
                Some(d) => err_knob(format!("RDMA device {d} not found or cannot be opened (devices: {names:?})"), Knob::Device),
                None => err(format!("no RDMA device has an active port {port} (devices: {names:?})")),
            })?;
            if !active {
                return Err(err_knob(format!("port {port} of {} is not active", ctx.name), Knob::Device));
            }
            let ctx = Arc::new(ctx);
            let mut dev_attr: ibv_device_attr = std::mem::zeroed();
            let rc = ibv_query_device(ctx.raw, &mut dev_attr);
            if rc != 0 {
                return Err(rc_err("ibv_query_device", rc));
            }
            let (gid_index, gid) = match gid_index {
                Some(i) => {
                    let mut g: ibv_gid = std::mem::zeroed();
                    let rc = ibv_query_gid(ctx.raw, port, i as i32, &mut g);
                    if rc != 0 {
                        let e = rc_err(&format!("ibv_query_gid index {i}"), rc);
                        return Err(err_knob(e.to_string(), Knob::GidIndex));
                    }
                    (i, g.raw)
                }
                None => {
                    let mut found = None;
                    for i in 0..port_attr.gid_tbl_len.min(256) {
                        let mut g: ibv_gid = std::mem::zeroed();
                        if ibv_query_gid(ctx.raw, port, i, &mut g) == 0 && is_ipv4_mapped(&g.raw) {
                            found = Some((i as u8, g.raw));
                            break;
                        }
                    }
                    found.ok_or_else(|| {
                        err_knob(format!("{} port {port} has no IPv4-mapped (RoCEv2) GID", ctx.name), Knob::GidIndex)
                    })?
                }
            };
            let pd = ibv_alloc_pd(ctx.raw);
            if pd.is_null() {
                return Err(os_err("ibv_alloc_pd"));
            }
            Ok(Device {
                pd: Arc::new(Pd { raw: pd, ctx }),
                port,
                active_mtu: port_attr.active_mtu,
                gid,
                gid_index,
                rd_atomic: dev_attr.max_qp_rd_atom.clamp(1, 16) as u8,
                max_mw: dev_attr.max_mw.max(0) as u32,
            })
        }
    }

    /// The device's name.
    pub(crate) fn name(&self) -> &str {
        &self.pd.ctx.name
    }
}

// ------------------------------------------------------------------------------ memory

/// A registered memory region.
pub(crate) struct Mr {
    raw: *mut ibv_mr,
    _pd: Arc<Pd>,
}
// SAFETY: an MR is a kernel handle; using its keys from any thread is fine.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}
impl Mr {
    /// # Safety
    /// `[addr, addr + len)` must stay mapped until the returned `Mr` is dropped.
    unsafe fn register(pd: &Arc<Pd>, addr: *mut u8, len: usize, access: ibv_access_flags) -> io::Result<Mr> {
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
    fn rkey(&self) -> u32 {
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

/// A private mapping (anonymous, or copy-on-write of a file), unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}
// SAFETY: plain memory owned by this value; access is coordinated by its owner.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}
impl Mapping {
    fn anon(len: usize) -> io::Result<Mapping> {
        // SAFETY: an anonymous private mapping; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
    fn file(fd: RawFd, offset: u64, len: usize) -> io::Result<Mapping> {
        // SAFETY: a private read-write mapping of an open file; checked for MAP_FAILED. Writes
        // (there are none) would stay private to this mapping.
        let p = unsafe {
            libc::mmap(null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd, offset as libc::off_t)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
}
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its MR (a sibling field declared first) is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Registered memory this provider allocated itself. Field order: the MR is deregistered
/// before the mapping goes.
struct Slab {
    mr: Mr,
    map: Mapping,
}

impl Slab {
    fn new(pd: &Arc<Pd>, len: usize, what: &str) -> Result<Slab, FabricError> {
        let map = Mapping::anon(len).map_err(|e| err(format!("mmap of {len} bytes for {what}: {e}")))?;
        // SAFETY: `map` lives as long as the slab, and the MR is dropped first.
        let mr = unsafe { Mr::register(pd, map.ptr, len, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE) }.map_err(|e| {
            err_knob(format!("registering {len} bytes of {what}: {e}; {}", memlock_advice(len as u64)), Knob::RecvBuffers)
        })?;
        Ok(Slab { mr, map })
    }
}

/// Registers pool slabs with the device's protection domain (local write: READ targets and
/// receive copies only; nothing in the pool is ever exposed to a peer).
pub(crate) struct PoolRegistrar {
    pd: Arc<Pd>,
    name: String,
    registered: Arc<AtomicU64>,
    mrs: Mutex<HashMap<u64, (Mr, usize)>>,
    next: AtomicU64,
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

// ------------------------------------------------------------------------------ completions

/// The completion channel: its file descriptor goes into the driver's poll.
pub(crate) struct CompChannel {
    raw: *mut ibv_comp_channel,
    _ctx: Arc<Context>,
}
// SAFETY: only the loop thread reads the channel; the handle itself may move between threads.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub(crate) fn new(dev: &Device) -> Result<CompChannel, FabricError> {
        let ctx = dev.pd.ctx.clone();
        // SAFETY: a live context; the result is checked.
        let raw = unsafe { ibv_create_comp_channel(ctx.raw) };
        if raw.is_null() {
            return Err(os_err("ibv_create_comp_channel"));
        }
        let ch = CompChannel { raw, _ctx: ctx };
        let fd = ch.fd();
        // SAFETY: fcntl on the channel's own descriptor: the loop never blocks on it.
        let r = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        if r != 0 {
            return Err(os_err("fcntl O_NONBLOCK on the completion channel"));
        }
        Ok(ch)
    }

    /// The descriptor to poll for readability.
    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: a live channel.
        unsafe { (*self.raw).fd }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel is gone (each holds an Arc<CompChannel>).
        let rc = unsafe { ibv_destroy_comp_channel(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_comp_channel failed");
        }
    }
}

/// One work completion, as plain data.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wc {
    pub(crate) wr_id: u64,
    pub(crate) status: u32,
    pub(crate) byte_len: u32,
    pub(crate) qp_num: u32,
    pub(crate) vendor_err: u32,
}

impl Wc {
    pub(crate) fn ok(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }
    pub(crate) fn flushed(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }
    pub(crate) fn rnr(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR
    }
    pub(crate) fn remote_access(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }
    /// The status, named, with what it usually means here.
    pub(crate) fn status_text(&self) -> String {
        // SAFETY: returns a static string for any status value.
        let s = unsafe { CStr::from_ptr(ibv_wc_status_str(self.status)) }.to_string_lossy();
        let hint = match self.status {
            ibv_wc_status::IBV_WC_WR_FLUSH_ERR => " (work request flushed: the queue pair is in error, the connection is down)",
            ibv_wc_status::IBV_WC_RETRY_EXC_ERR => " (transport retry counter exceeded: the peer is unreachable)",
            ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => {
                " (receiver not ready: the peer's shared receive queue stayed empty past the RNR retries)"
            }
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR => {
                " (remote access error: no window of this peer for this connection has that key and range — never exposed, released, or another peer's)"
            }
            ibv_wc_status::IBV_WC_LOC_PROT_ERR => " (local protection error: buffer not registered with this device)",
            ibv_wc_status::IBV_WC_LOC_LEN_ERR => " (message longer than the receive buffer)",
            _ => "",
        };
        format!("{s}{hint} (status {}, vendor error {})", self.status, self.vendor_err)
    }
}

/// The completion queue every queue pair of a driver shares.
pub(crate) struct Cq {
    raw: *mut ibv_cq,
    channel: Arc<CompChannel>,
}
// SAFETY: polled by the loop thread only; the handle may move between threads.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(dev: &Device, channel: &Arc<CompChannel>, size: usize) -> Result<Cq, FabricError> {
        // SAFETY: a live context and channel; the result is checked.
        let raw = unsafe { ibv_create_cq(dev.pd.ctx.raw, size as i32, null_mut(), channel.raw, 0) };
        if raw.is_null() {
            return Err(os_err(&format!("ibv_create_cq of {size} entries")));
        }
        let cq = Cq { raw, channel: channel.clone() };
        cq.arm()?;
        Ok(cq)
    }

    /// Asks for an event on the channel at the next completion.
    pub(crate) fn arm(&self) -> Result<(), FabricError> {
        // SAFETY: a live CQ.
        let rc = unsafe { ibv_req_notify_cq(self.raw, 0) };
        if rc != 0 {
            return Err(rc_err("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Takes the channel's pending events (nonblocking) and acknowledges them; answers how
    /// many there were. The caller re-arms, then polls.
    pub(crate) fn take_events(&self) -> u32 {
        let mut n = 0;
        loop {
            let mut cq = null_mut();
            let mut ctx = null_mut();
            // SAFETY: the channel is nonblocking; on success `cq` is our CQ (the only one on
            // this channel), which is alive.
            if unsafe { ibv_get_cq_event(self.channel.raw, &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges exactly the events taken above.
            unsafe { ibv_ack_cq_events(self.raw, n) };
        }
        n
    }

    /// Appends every completion waiting in the queue to `out`.
    pub(crate) fn poll(&self, out: &mut Vec<Wc>) {
        // SAFETY: a zeroed ibv_wc array is a valid output buffer.
        let mut wcs: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: a live CQ; `wcs` has room for 32 entries.
            let n = unsafe { ibv_poll_cq(self.raw, 32, wcs.as_mut_ptr()) };
            if n <= 0 {
                return;
            }
            for w in &wcs[..n as usize] {
                out.push(Wc {
                    wr_id: w.wr_id,
                    status: w.status,
                    byte_len: w.byte_len,
                    qp_num: w.qp_num,
                    vendor_err: w.vendor_err,
                });
            }
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: no QP uses it (each holds an Arc<Cq>); all events were acknowledged by
        // `take_events`.
        let rc = unsafe { ibv_destroy_cq(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}

// ------------------------------------------------------------------------------ receive

struct SrqHandle {
    raw: *mut ibv_srq,
    _pd: Arc<Pd>,
}
// SAFETY: posting to an SRQ is thread-safe; used by the loop thread only anyway.
unsafe impl Send for SrqHandle {}
// SAFETY: as above.
unsafe impl Sync for SrqHandle {}
impl Drop for SrqHandle {
    fn drop(&mut self) {
        // SAFETY: every QP attached to it is gone (each holds an Arc<SrqHandle>).
        let rc = unsafe { ibv_destroy_srq(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_srq failed");
        }
    }
}

/// The shared receive queue of a driver and its registered buffers: `depth` slots of
/// `slot_size` bytes, every one posted except while the loop reads a received message out.
pub(crate) struct Srq {
    handle: Arc<SrqHandle>,
    // Dropped after `handle`: the SRQ (and with it every posted receive) goes first.
    slab: Slab,
    slot_size: usize,
    posted: Vec<bool>,
}

impl Srq {
    pub(crate) fn new(dev: &Device, depth: u32, slot_size: usize) -> Result<Srq, FabricError> {
        let slab = Slab::new(&dev.pd, depth as usize * slot_size, "the shared receive queue")?;
        // SAFETY: a zeroed init attr with the fields set below is valid.
        let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = depth;
        attr.attr.max_sge = 1;
        // SAFETY: a live PD; the result is checked.
        let raw = unsafe { ibv_create_srq(dev.pd.raw, &mut attr) };
        if raw.is_null() {
            return Err(os_err(&format!("ibv_create_srq of {depth} buffers")));
        }
        let mut srq = Srq {
            handle: Arc::new(SrqHandle { raw, _pd: dev.pd.clone() }),
            slab,
            slot_size,
            posted: vec![false; depth as usize],
        };
        for slot in 0..depth {
            srq.post(slot)?;
        }
        Ok(srq)
    }

    /// Registered bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.slab.map.len
    }

    /// (Re)posts receive buffer `slot`.
    pub(crate) fn post(&mut self, slot: u32) -> Result<(), FabricError> {
        let Some(p) = self.posted.get_mut(slot as usize) else { return Ok(()) };
        if *p {
            return Ok(());
        }
        let mut sge = ibv_sge {
            addr: self.slab.map.ptr as u64 + slot as u64 * self.slot_size as u64,
            length: self.slot_size as u32,
            lkey: self.slab.mr.lkey(),
        };
        // SAFETY: a zeroed recv WR with the fields set below is valid.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_RECV | slot as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = null_mut();
        // SAFETY: the slot is inside the registered slab, which outlives the SRQ (field
        // order), and is not posted (checked above), so nobody reads it while the HCA writes.
        let rc = unsafe { ibv_post_srq_recv(self.handle.raw, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(rc_err("post a receive buffer", rc));
        }
        *p = true;
        Ok(())
    }

    /// The bytes of a completed receive (`wr_id` from its completion), then the slot is
    /// posted again: the caller copies what it needs inside `f`.
    pub(crate) fn take<R>(&mut self, wr_id: u64, len: u32, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>, FabricError> {
        let slot = (wr_id & !WR_RECV) as usize;
        let Some(p) = self.posted.get_mut(slot) else { return Ok(None) };
        if !*p {
            return Ok(None);
        }
        *p = false;
        let len = (len as usize).min(self.slot_size);
        // SAFETY: the slot's receive completed, so the HCA no longer writes it; it is inside
        // the slab; it is reposted only below, after `f` returned.
        let bytes = unsafe { std::slice::from_raw_parts(self.slab.map.ptr.add(slot * self.slot_size), len) };
        let r = f(bytes);
        self.post(slot as u32)?;
        Ok(Some(r))
    }
}

// ------------------------------------------------------------------------------ send

/// Registered send buffers of a driver: a slot is filled by the caller while free, posted,
/// and free again only when its completion came back.
pub(crate) struct SendBuffers {
    slab: Slab,
    slot_size: usize,
    free: Vec<u32>,
    posted: Vec<bool>,
}

impl SendBuffers {
    pub(crate) fn new(dev: &Device, slots: u32, slot_size: usize) -> Result<SendBuffers, FabricError> {
        let slab = Slab::new(&dev.pd, slots as usize * slot_size, "send buffers")?;
        Ok(SendBuffers { slab, slot_size, free: (0..slots).rev().collect(), posted: vec![false; slots as usize] })
    }

    /// Registered bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.slab.map.len
    }

    /// A free slot, filled with `parts` (at most a slot's size in all).
    pub(crate) fn fill(&mut self, parts: &[&[u8]]) -> Option<(u32, u32)> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.slot_size {
            return None;
        }
        let slot = self.free.pop()?;
        // SAFETY: the slot is free (not posted), inside the slab, and `total` fits it.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.slab.map.ptr.add(slot as usize * self.slot_size), total) };
        let mut at = 0;
        for p in parts {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Some((slot, total as u32))
    }

    /// A filled slot that could not be posted goes back.
    pub(crate) fn unfill(&mut self, slot: u32) {
        if self.posted.get(slot as usize) == Some(&false) {
            self.free.push(slot);
        }
    }

    /// The completion of the send of `wr_id` came back: its slot is free.
    pub(crate) fn completed(&mut self, wr_id: u64) {
        let slot = (wr_id & !WR_SEND) as usize;
        if let Some(p) = self.posted.get_mut(slot) {
            if *p {
                *p = false;
                self.free.push(slot as u32);
            }
        }
    }
}

// ------------------------------------------------------------------------------ exposure

/// A memory window (type 2): bound by its queue pair, usable only through that queue pair.
struct Window {
    raw: *mut ibv_mw,
    _pd: Arc<Pd>,
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
    window: Window,
    mr: Arc<Mr>,
    map: Mapping,
    /// Virtual address of the region's first byte (inside `map`).
    addr: u64,
    len: u64,
}

impl Exposure {
    /// Maps and registers `len` bytes at `offset` of the file `fd` (or copies `bytes` when
    /// there is no file), and allocates the window. Nothing is readable until bound.
    pub(crate) fn new(dev: &Device, fd: Option<RawFd>, bytes: &[u8], offset: u64, len: u64) -> Result<Exposure, FabricError> {
        const PAGE: u64 = 4096;
        let (map, addr) = match fd {
            Some(fd) => {
                let start = offset - offset % PAGE;
                let span = (offset - start + len) as usize;
                let map = Mapping::file(fd, start, span).map_err(|e| err(format!("mapping {len} bytes for exposure: {e}")))?;
                let addr = map.ptr as u64 + (offset - start);
                (map, addr)
            }
            None => {
                let src = offset
                    .checked_add(len)
                    .and_then(|end| bytes.get(offset as usize..end as usize))
                    .ok_or_else(|| err(format!("region {offset}+{len} outside its {}-byte source", bytes.len())))?;
                let map = Mapping::anon(len.max(1) as usize).map_err(|e| err(format!("mapping {len} bytes: {e}")))?;
                // SAFETY: a fresh private mapping of at least `len` bytes, not yet shared.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), map.ptr, src.len()) };
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

// ------------------------------------------------------------------------------ queue pairs

/// Work posted on a queue pair and not completed yet.
enum Posted {
    Send,
    Read { tag: u64, lease: Lease },
    Bind { _exposure: Arc<Exposure> },
}

/// What a completion gave back.
pub(crate) enum Completed {
    /// A send's completion (its slot is freed by [`SendBuffers::completed`]).
    Send,
    /// A READ's completion, with its buffer.
    Read { tag: u64, lease: Lease },
    /// A window bind's completion.
    Bind,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum QpState {
    Reset,
    Rts,
    Error,
}

/// Transport timers of a queue pair.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpTimers {
    /// Encoded RNR NAK timer this side asks senders to wait (IB encoding: 0 = 655 ms,
    /// 1..=31 from 0.01 ms up).
    pub(crate) min_rnr_timer: u8,
    /// Retries after an RNR NAK before failing (7 = forever; never used here).
    pub(crate) rnr_retry: u8,
    /// Local ACK timeout exponent (4.096 µs × 2^n).
    pub(crate) timeout: u8,
    /// Transport retries.
    pub(crate) retry_cnt: u8,
}

/// An RC queue pair attached to the driver's CQ and SRQ.
pub(crate) struct Qp {
    raw: *mut ibv_qp,
    state: QpState,
    posted: HashMap<u64, Posted>,
    next_wr: u64,
    sq_depth: usize,
    // Parents, dropped after the QP (ibv_destroy_qp runs in Drop first).
    _cq: Arc<Cq>,
    _srq: Arc<SrqHandle>,
    _pd: Arc<Pd>,
}
// SAFETY: owned and used by the loop thread; verbs on it are MT-safe anyway.
unsafe impl Send for Qp {}

impl Qp {
    /// A queue pair in the RESET state with room for `sq_depth` posted sends, reads and binds.
    pub(crate) fn new(dev: &Device, cq: &Arc<Cq>, srq: &Srq, sq_depth: u32) -> Result<Qp, FabricError> {
        // SAFETY: a zeroed init attr with the fields set below is valid.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw;
        init.recv_cq = cq.raw;
        init.srq = srq.handle.raw;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = sq_depth;
        init.cap.max_recv_wr = 0;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: a live PD, CQ and SRQ; the result is checked.
        let raw = unsafe { ibv_create_qp(dev.pd.raw, &mut init) };
        if raw.is_null() {
            return Err(os_err("ibv_create_qp"));
        }
        Ok(Qp {
            raw,
            state: QpState::Reset,
            posted: HashMap::new(),
            next_wr: 1,
            sq_depth: sq_depth as usize,
            _cq: cq.clone(),
            _srq: srq.handle.clone(),
            _pd: dev.pd.clone(),
        })
    }

    /// The queue pair number.
    pub(crate) fn num(&self) -> u32 {
        // SAFETY: a live QP.
        unsafe { (*self.raw).qp_num }
    }

    /// Work posted and not completed.
    pub(crate) fn outstanding(&self) -> usize {
        self.posted.len()
    }

    /// Whether another request fits the send queue.
    pub(crate) fn has_room(&self) -> bool {
        self.posted.len() < self.sq_depth
    }

    /// INIT, RTR to `remote`, RTS. `remote_read`: peers may read windows bound on this queue
    /// pair — granted only on a queue pair created after its peer authenticated.
    pub(crate) fn connect(
        &mut self,
        dev: &Device,
        psn: u32,
        remote: &AttachRecord,
        remote_read: bool,
        t: QpTimers,
    ) -> Result<(), FabricError> {
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_read {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        }
        // SAFETY: modify_qp on our own QP with zero-initialized attribute structs.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_INIT;
            a.port_num = dev.port;
            a.qp_access_flags = access.0;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            let rc = ibv_modify_qp(self.raw, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(rc_err("modify QP to INIT", rc));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = dev.active_mtu.min(remote.mtu);
            a.dest_qp_num = remote.qpn;
            a.rq_psn = remote.psn;
            a.max_dest_rd_atomic = dev.rd_atomic;
            a.min_rnr_timer = t.min_rnr_timer;
            a.ah_attr.is_global = 1;
            a.ah_attr.port_num = dev.port;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.sgid_index = dev.gid_index;
            a.ah_attr.grh.hop_limit = 64;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            let rc = ibv_modify_qp(self.raw, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(rc_err("modify QP to RTR (is the peer's GID reachable from this device?)", rc));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = psn;
            a.timeout = t.timeout;
            a.retry_cnt = t.retry_cnt;
            a.rnr_retry = t.rnr_retry.min(6);
            a.max_rd_atomic = dev.rd_atomic;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            let rc = ibv_modify_qp(self.raw, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(rc_err("modify QP to RTS", rc));
            }
        }
        self.state = QpState::Rts;
        Ok(())
    }

    /// Moves the queue pair to the error state: nothing more can be posted, and everything
    /// posted completes (flushed). Idempotent.
    pub(crate) fn enter_error_state(&mut self) {
        if self.state == QpState::Error {
            return;
        }
        if self.state == QpState::Reset {
            // Nothing was ever posted; the QP is simply destroyed later.
            self.state = QpState::Error;
            return;
        }
        // SAFETY: a zeroed attr with the state set is valid for modify_qp on our QP.
        let rc = unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_ERR;
            ibv_modify_qp(self.raw, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32)
        };
        if rc != 0 {
            tracing::warn!(rc, "modify QP to ERR failed");
        }
        self.state = QpState::Error;
    }

    /// The guard that posting requires: only a queue pair that is ready to send has one.
    pub(crate) fn poster(&mut self) -> Result<Poster<'_>, FabricError> {
        match self.state {
            QpState::Rts if self.has_room() => Ok(Poster { qp: self }),
            QpState::Rts => Err(err("the send queue is full")),
            _ => Err(err("the queue pair is not connected (or already failed)")),
        }
    }

    /// What completion `wc` (of this queue pair's send queue) gives back.
    pub(crate) fn complete(&mut self, wc: &Wc) -> Option<Completed> {
        Some(match self.posted.remove(&wc.wr_id)? {
            Posted::Send => Completed::Send,
            Posted::Read { tag, lease } => Completed::Read { tag, lease },
            Posted::Bind { .. } => Completed::Bind,
        })
    }

    fn post(&mut self, wr: &mut ibv_send_wr) -> Result<(), FabricError> {
        let mut bad = null_mut();
        // SAFETY: the buffers named by `wr` stay valid until completion: send slots stay
        // posted in their SendBuffers, READ leases and bound windows are kept in `posted`.
        let rc = unsafe { ibv_post_send(self.raw, wr, &mut bad) };
        if rc != 0 {
            return Err(rc_err("ibv_post_send", rc));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if !self.posted.is_empty() {
            // The driver waits for every completion before dropping a QP, up to its limit;
            // past it, the device may still write these buffers: never give them back.
            tracing::warn!(outstanding = self.posted.len(), "queue pair destroyed with work outstanding; its buffers are leaked");
            for (_, p) in self.posted.drain() {
                std::mem::forget(p);
            }
        }
        // SAFETY: nothing posts to it any more (it is being dropped).
        let rc = unsafe { ibv_destroy_qp(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_qp failed");
        }
    }
}

/// Proof that the queue pair may be posted to (connected, not failed, room in its send
/// queue). Every post goes through it.
pub(crate) struct Poster<'a> {
    qp: &'a mut Qp,
}

impl Poster<'_> {
    /// Sends the `len` bytes of send slot `slot` (filled with [`SendBuffers::fill`]).
    pub(crate) fn send(&mut self, bufs: &mut SendBuffers, slot: u32, len: u32) -> Result<(), FabricError> {
        let i = slot as usize;
        if bufs.posted.get(i) != Some(&false) {
            return Err(err(format!("send slot {slot} is not filled")));
        }
        let mut sge = ibv_sge {
            addr: bufs.slab.map.ptr as u64 + (i * bufs.slot_size) as u64,
            length: len.min(bufs.slot_size as u32),
            lkey: bufs.slab.mr.lkey(),
        };
        // SAFETY: a zeroed send WR with the fields set below is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_SEND | slot as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        self.qp.post(&mut wr)?;
        bufs.posted[i] = true;
        self.qp.posted.insert(wr.wr_id, Posted::Send);
        Ok(())
    }

    /// Reads `desc.len` bytes of the peer's window into `lease`. The lease stays here until
    /// the completion; on `Err` it comes back at once.
    pub(crate) fn read(&mut self, tag: u64, desc: &Descriptor, mut lease: Lease) -> Result<(), FailedRead> {
        if (lease.len() as u64) < desc.len {
            let e = err(format!("local buffer of {} bytes for a {}-byte READ", lease.len(), desc.len));
            return Err(Box::new((lease, e)));
        }
        let lkey = lease.keys().lkey;
        if lkey == 0 {
            let e = err("pool buffer is not registered with the device (pool built without the verbs registrar)");
            return Err(Box::new((lease, e)));
        }
        let mut sge = ibv_sge { addr: lease.as_mut_ptr() as u64, length: desc.len as u32, lkey };
        let wr_id = self.qp.next_wr;
        self.qp.next_wr = (self.qp.next_wr + 1) & !(WR_RECV | WR_SEND);
        // SAFETY: a zeroed send WR with the fields set below is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = rdma_t { remote_addr: desc.addr, rkey: desc.rkey };
        if let Err(e) = self.qp.post(&mut wr) {
            return Err(Box::new((lease, e)));
        }
        self.qp.posted.insert(wr_id, Posted::Read { tag, lease });
        Ok(())
    }

    /// Binds `exposure`'s window to this queue pair with remote read over its region.
    /// Returns the window's new key. The exposure stays alive until the bind completes.
    pub(crate) fn bind(&mut self, exposure: &Arc<Exposure>) -> Result<(u64, u32), FabricError> {
        // SAFETY: reading the key of a live window.
        let rkey = unsafe { ibv_inc_rkey((*exposure.window.raw).rkey) };
        let wr_id = self.qp.next_wr;
        self.qp.next_wr = (self.qp.next_wr + 1) & !(WR_RECV | WR_SEND);
        // SAFETY: a zeroed send WR with the fields set below is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: exposure.window.raw,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr: exposure.mr.raw,
                addr: exposure.addr,
                length: exposure.len,
                mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            },
        };
        self.qp.post(&mut wr)?;
        self.qp.posted.insert(wr_id, Posted::Bind { _exposure: exposure.clone() });
        Ok((exposure.addr, rkey))
    }
}
