//! Queue pairs and the guard that posting requires.

use super::device::{err, os_err, rc_err, Device, Pd, WR_RECV, WR_SEND};
use super::memory::Exposure;
use super::queues::{Cq, SendBuffers, Srq, SrqHandle, Wc};
use crate::bootstrap::AttachRecord;
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::providers::link::{FailedRead, UserBuf};
use rdma_shuffle_wire::Descriptor;
use rdma_sys::*;
use std::collections::HashMap;
use std::ptr::null_mut;
use std::sync::Arc;

// ------------------------------------------------------------------------------ queue pairs

/// Work posted on a queue pair and not completed yet.
enum Posted {
    Send,
    Read { tag: u64, lease: Lease },
    ReadUser { tag: u64, len: u64 },
    Bind { _exposure: Arc<Exposure> },
}

/// What a completion gave back.
pub(crate) enum Completed {
    /// A send's completion (its slot is freed by [`SendBuffers::completed`]).
    Send,
    /// A READ's completion, with its buffer.
    Read { tag: u64, lease: Lease },
    /// A READ into user memory completed.
    ReadUser { tag: u64, len: u64 },
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
            Posted::ReadUser { tag, len } => Completed::ReadUser { tag, len },
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
        let addr = lease.as_mut_ptr() as u64;
        match self.post_read(desc, addr, lkey) {
            Ok(wr_id) => {
                self.qp.posted.insert(wr_id, Posted::Read { tag, lease });
                Ok(())
            }
            Err(e) => Err(Box::new((lease, e))),
        }
    }

    /// Posts an RDMA READ of `desc` into the user memory `dst` (registered, `lkey`). The
    /// caller keeps `dst` alive and untouched until the completion.
    pub(crate) fn read_user(&mut self, tag: u64, desc: &Descriptor, mut dst: UserBuf, lkey: u32) -> Result<(), FabricError> {
        if (dst.len() as u64) < desc.len {
            return Err(err(format!("user buffer of {} bytes for a {}-byte READ", dst.len(), desc.len)));
        }
        let wr_id = self.post_read(desc, dst.as_mut_ptr() as u64, lkey)?;
        self.qp.posted.insert(wr_id, Posted::ReadUser { tag, len: desc.len });
        Ok(())
    }

    /// Posts a signaled RDMA READ of `desc` into `desc.len` bytes at `addr` (local key
    /// `lkey`); the work request's id, for the caller to file what the completion returns.
    fn post_read(&mut self, desc: &Descriptor, addr: u64, lkey: u32) -> Result<u64, FabricError> {
        let mut sge = ibv_sge { addr, length: desc.len as u32, lkey };
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
        self.qp.post(&mut wr)?;
        Ok(wr_id)
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
