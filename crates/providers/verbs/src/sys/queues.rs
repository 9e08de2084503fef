//! Completions (channel, queue, work completions), the shared receive queue and the send
//! buffers.

use super::device::{os_err, rc_err, Context, Device, Pd, WR_RECV, WR_SEND};
use super::memory::Slab;
use rdma_shuffle_fabric::error::FabricError;
use rdma_sys::*;
use std::ffi::CStr;
use std::os::fd::RawFd;
use std::ptr::null_mut;
use std::sync::Arc;

// ------------------------------------------------------------------------------ completions

/// The completion channel: its file descriptor goes into the driver's poll.
pub(crate) struct CompChannel {
    pub(super) raw: *mut ibv_comp_channel,
    pub(super) _ctx: Arc<Context>,
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
    pub(super) raw: *mut ibv_cq,
    pub(super) channel: Arc<CompChannel>,
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

pub(super) struct SrqHandle {
    pub(super) raw: *mut ibv_srq,
    pub(super) _pd: Arc<Pd>,
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
    pub(super) handle: Arc<SrqHandle>,
    // Dropped after `handle`: the SRQ (and with it every posted receive) goes first.
    pub(super) slab: Slab,
    pub(super) slot_size: usize,
    pub(super) posted: Vec<bool>,
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
    pub(super) slab: Slab,
    pub(super) slot_size: usize,
    pub(super) free: Vec<u32>,
    pub(super) posted: Vec<bool>,
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
