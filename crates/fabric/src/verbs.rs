//! The verbs provider: RDMA over ibverbs (InfiniBand, RoCE; SoftRoCE in the test VM).
//!
//! * Control plane: a tcp socket per connection exchanges queue-pair numbers, PSNs, GIDs and
//!   receive-buffer sizes, then stays open as the liveness channel — RC queue pairs have no
//!   keepalive, so a peer process that dies is noticed by the socket's end of stream.
//! * Data plane: frames travel as SEND/RECV messages from per-connection registered buffers;
//!   rendezvous blocks are pulled with one-sided RDMA READ straight from the server's
//!   registered (memory-mapped) data file into a pool buffer registered once per slab.
//! * One progress thread per provider waits on a shared completion channel and dispatches
//!   every work completion to the connection that posted it.
//!
//! Objects own `Arc`s of their parents (a queue pair its CQ and PD, an MR its PD, a PD its
//! context), so teardown always runs in the order the kernel requires (`ibv_destroy_cq`
//! fails with EBUSY while a QP is attached; a PD cannot go while MRs exist). Teardown
//! failures are logged, never panicked on: this code runs inside an executor JVM.

use crate::error::FabricError;
use crate::link::{Link, Listener, Payload, Placement, Provider, Received, Source, SourceKeys};
use crate::pool::{Lease, PoolError, RegionKeys, Registrar};
use crate::sock::{self, SocketListener};
use crossbeam_channel::{select, unbounded, Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use rdma_shuffle_wire::{Descriptor, Frame, Limits};
use rdma_sys::*;
use std::collections::HashMap;
use std::ffi::CStr;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

const PROVIDER: &str = "verbs";

fn err(message: impl Into<String>) -> FabricError {
    FabricError::Provider { provider: PROVIDER, message: message.into() }
}

fn os_err(what: &str) -> FabricError {
    let e = io::Error::last_os_error();
    err(format!("{what}: {e}"))
}

/// Verbs return a positive errno, or -1 with errno set.
fn rc_err(what: &str, rc: i32) -> FabricError {
    let code = if rc < 0 { io::Error::last_os_error().raw_os_error().unwrap_or(0) } else { rc };
    err(format!("{what}: {}", io::Error::from_raw_os_error(code)))
}

/// The locked-memory limit of this process, in bytes (`None` = unlimited).
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Whether this thread may lock memory beyond the limit (CAP_IPC_LOCK, e.g. root).
pub fn can_lock_unlimited() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:").map(|v| v.trim().to_string())))
        .and_then(|hex| u64::from_str_radix(&hex, 16).ok())
        .map(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
        .unwrap_or(false)
}

/// Checks that `need` bytes can be registered under `limit` (None = unlimited), unless the
/// process may exceed the limit. The error names the limit, the need, and what to change.
pub fn check_memlock(limit: Option<u64>, privileged: bool, need: u64) -> Result<(), String> {
    match limit {
        Some(l) if !privileged && l < need => Err(format!(
            "cannot register the {need}-byte pool: the locked-memory limit is {l} bytes and RDMA needs at least {need}: \
             raise it (`ulimit -l unlimited`, LimitMEMLOCK=infinity for systemd units, or memlock in \
             /etc/security/limits.conf), or lower spark.shuffle.rdma.pool.capBytes"
        )),
        _ => Ok(()),
    }
}

fn memlock_advice(bytes: u64) -> String {
    match memlock_limit() {
        Some(l) => format!(
            "the locked-memory limit is {l} bytes and RDMA needs at least {bytes}: raise it (`ulimit -l unlimited`, \
             LimitMEMLOCK=infinity for systemd units, or memlock in /etc/security/limits.conf), or lower \
             spark.shuffle.rdma.pool.capBytes"
        ),
        None => "the locked-memory limit is unlimited, so the device itself is out of memory".into(),
    }
}

/// Settings of the verbs provider.
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// Device name (`mlx5_0`, `rxe0`); `None` takes the first device with an active port.
    pub device: Option<String>,
    /// Port number (1-based).
    pub port: u8,
    /// GID index; `None` picks the first RoCEv2 IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub gid_index: Option<u8>,
    /// Receive buffers posted per connection (bounds frames in flight towards us).
    pub recv_depth: u32,
    /// Send buffers per connection.
    pub send_depth: u32,
    /// Largest message (frame + eager payload) a connection accepts; both sides exchange it.
    pub max_message: u32,
    /// Bytes the pool may register, checked against the memlock limit when opening.
    pub pool_bytes: u64,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: 1,
            gid_index: None,
            recv_depth: 256,
            send_depth: 128,
            max_message: 64 * 1024 + 4096,
            pool_bytes: 0,
        }
    }
}

struct Context {
    ctx: *mut ibv_context,
    name: String,
}
// SAFETY: ibverbs contexts are thread-safe (rdma-core documents the verbs as MT-safe).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}
impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: last owner; every child object holds an Arc<Context> and is gone.
        let rc = unsafe { ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

struct Pd {
    pd: *mut ibv_pd,
    ctx: Arc<Context>,
}
// SAFETY: as above.
unsafe impl Send for Pd {}
unsafe impl Sync for Pd {}
impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc<Pd>, so none is left.
        let rc = unsafe { ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!(device = %self.ctx.name, rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A registered memory region.
struct Mr {
    mr: *mut ibv_mr,
    _pd: Arc<Pd>,
}
// SAFETY: an MR is a kernel handle; using its keys from any thread is fine.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}
impl Mr {
    fn register(pd: &Arc<Pd>, addr: *mut u8, len: usize, access: ibv_access_flags) -> Result<Mr, io::Error> {
        // SAFETY: the caller keeps [addr, addr+len) mapped until the Mr is dropped.
        let mr = unsafe { ibv_reg_mr(pd.pd, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Mr { mr, _pd: pd.clone() })
    }
    fn lkey(&self) -> u32 {
        // SAFETY: valid MR.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: valid MR.
        unsafe { (*self.mr).rkey }
    }
}
impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the region is still mapped (owners drop the Mr before unmapping).
        let rc = unsafe { ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dereg_mr failed");
        }
    }
}

struct Cq {
    cq: *mut ibv_cq,
    progress: Arc<Progress>,
}
// SAFETY: CQ polling is serialized by the progress thread's dispatch lock.
unsafe impl Send for Cq {}
unsafe impl Sync for Cq {}
impl Drop for Cq {
    fn drop(&mut self) {
        // Unhook from the progress thread first, under its lock, so it never polls a CQ that
        // is being destroyed; the QP using it is already gone (it holds an Arc<Cq>).
        self.progress.routes.lock().remove(&(self.cq as usize));
        // Not under the routes lock: ibv_destroy_cq waits until every completion event it has
        // reported is acked, and the progress thread acks an event it already took before it
        // takes that lock. Holding it here deadlocked both (seen in the VM: destroy_cq in
        // pthread_cond_wait, the progress thread waiting for the lock).
        // SAFETY: no QP is attached; the CQ is no longer routed, so nothing polls it.
        let rc = unsafe { ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}

struct Qp {
    qp: *mut ibv_qp,
    _cq: Arc<Cq>,
    _pd: Arc<Pd>,
}
// SAFETY: posting to a QP is thread-safe in libibverbs.
unsafe impl Send for Qp {}
unsafe impl Sync for Qp {}
impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: nothing posts to it any more (its Conn is being dropped).
        let rc = unsafe { ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_qp failed");
        }
    }
}

/// A page-aligned anonymous mapping, registered.
struct Slab {
    ptr: *mut u8,
    len: usize,
    mr: Option<Mr>,
}
// SAFETY: plain memory; access is coordinated by the owning connection.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}
impl Slab {
    fn new(pd: &Arc<Pd>, len: usize) -> Result<Slab, FabricError> {
        // SAFETY: anonymous private mapping; checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err(&format!("mmap of {len} bytes for connection buffers")));
        }
        let mut slab = Slab { ptr: ptr.cast(), len, mr: None };
        let mr = Mr::register(pd, slab.ptr, len, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE)
            .map_err(|e| err(format!("registering {len} bytes of connection buffers: {e}; {}", memlock_advice(len as u64))))?;
        slab.mr = Some(mr);
        Ok(slab)
    }
    fn lkey(&self) -> u32 {
        self.mr.as_ref().map(Mr::lkey).unwrap_or(0)
    }
}
impl Drop for Slab {
    fn drop(&mut self) {
        self.mr.take();
        // SAFETY: our own mapping, deregistered above.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Work-request ids: kind in the top byte, an index or token below.
const WR_RECV: u64 = 1 << 56;
const WR_SEND: u64 = 2 << 56;
const WR_READ: u64 = 3 << 56;
const WR_KIND: u64 = 0xff << 56;

/// Completions routed to one connection.
type Route = Weak<ConnShared>;

struct Progress {
    channel: *mut ibv_comp_channel,
    routes: Mutex<HashMap<usize, Route>>,
    stop: AtomicBool,
    wake: [i32; 2],
    _ctx: Arc<Context>,
}
// SAFETY: the channel is only read by the progress thread; routes are locked.
unsafe impl Send for Progress {}
unsafe impl Sync for Progress {}

impl Progress {
    fn run(self: Arc<Self>) {
        loop {
            let mut fds = [
                libc::pollfd { fd: unsafe { (*self.channel).fd }, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.wake[0], events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: two valid pollfds.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if r <= 0 || fds[0].revents & libc::POLLIN == 0 {
                continue;
            }
            let mut cq = null_mut();
            let mut ctx = null_mut();
            // SAFETY: the channel fd is readable, so this does not block.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } != 0 {
                continue;
            }
            // SAFETY: `cq` came from the event, and it stays alive until this ack (destroy_cq
            // waits for it). Ack before taking the routes lock: see Cq::drop.
            unsafe { ibv_ack_cq_events(cq, 1) };
            let routes = self.routes.lock();
            let Some(conn) = routes.get(&(cq as usize)).and_then(Weak::upgrade) else { continue };
            // Re-arm before draining so no completion is missed between the two.
            // SAFETY: the CQ is alive: it is in `routes`, and Cq::drop removes it under this lock.
            unsafe { ibv_req_notify_cq(cq, 0) };
            // SAFETY: as above.
            unsafe { poll_all(cq, &conn) };
        }
    }

    /// Dispatches every completion already in `cq`, serialized with the progress thread by
    /// the routes lock (so completions still reach their connection in order).
    fn drain(&self, cq: *mut ibv_cq) {
        let routes = self.routes.lock();
        if let Some(conn) = routes.get(&(cq as usize)).and_then(Weak::upgrade) {
            // SAFETY: the CQ is in `routes`, so it is alive (Cq::drop removes it under this lock).
            unsafe { poll_all(cq, &conn) };
        }
    }
}

/// Polls `cq` until it is empty, handing each completion to `conn`.
///
/// # Safety
/// `cq` must be alive, and the caller must hold the progress routes lock.
unsafe fn poll_all(cq: *mut ibv_cq, conn: &ConnShared) {
    let mut wcs: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: per the contract; wcs has room for 32 entries.
        let n = unsafe { ibv_poll_cq(cq, 32, wcs.as_mut_ptr()) };
        if n <= 0 {
            break;
        }
        for wc in &wcs[..n as usize] {
            conn.complete(wc);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel is gone (each holds an Arc<Progress>).
        unsafe {
            ibv_destroy_comp_channel(self.channel);
            libc::close(self.wake[0]);
            libc::close(self.wake[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_check_names_the_limit_the_need_and_the_fix() {
        assert!(check_memlock(None, false, 1 << 40).is_ok());
        assert!(check_memlock(Some(8 << 20), true, 1 << 30).is_ok(), "CAP_IPC_LOCK is not limited");
        assert!(check_memlock(Some(1 << 30), false, 1 << 20).is_ok());
        let e = check_memlock(Some(8 << 20), false, 512 << 20).unwrap_err();
        assert!(
            e.contains("8388608")
                && e.contains("536870912")
                && e.contains("ulimit -l")
                && e.contains("spark.shuffle.rdma.pool.capBytes"),
            "{e}"
        );
    }
}

fn status_text(wc: &ibv_wc) -> String {
    // SAFETY: returns a static string for any status value.
    let s = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }.to_string_lossy();
    let hint = match wc.status {
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => " (work request flushed: the queue pair is in error, the connection is down)",
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => " (transport retry counter exceeded: the peer is unreachable)",
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => " (receiver not ready: the peer posted no receive buffer)",
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => {
            " (remote access error: the region was deregistered — shuffle unregistered? — or the key is wrong)"
        }
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => " (local protection error: buffer not registered with this device)",
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => " (message longer than the receive buffer)",
        _ => "",
    };
    format!("{s}{hint} (status {}, vendor error {})", wc.status, wc.vendor_err)
}

/// State of one connection shared with the progress thread.
struct ConnShared {
    peer: String,
    qp: Mutex<Option<Qp>>,
    qp_ptr: *mut ibv_qp,
    recv: Slab,
    send: Slab,
    msg: usize,
    peer_msg: usize,
    recv_tx: Sender<Result<(u32, u32), String>>,
    free_send: Mutex<Vec<u32>>,
    send_depth: usize,
    send_cv: Condvar,
    reads: Mutex<HashMap<u64, Sender<Result<(), String>>>>,
    next_read: AtomicU64,
    failed: Mutex<Option<String>>,
    control: TcpStream,
    counters: Arc<Counters>,
}
// SAFETY: the raw QP pointer is only used while `qp` holds the object; verbs are MT-safe.
unsafe impl Send for ConnShared {}
unsafe impl Sync for ConnShared {}

impl ConnShared {
    fn fail(&self, why: String) {
        let mut f = self.failed.lock();
        if f.is_some() {
            return;
        }
        tracing::debug!(peer = %self.peer, %why, "verbs connection failed");
        *f = Some(why.clone());
        drop(f);
        let _ = self.recv_tx.send(Err(why.clone()));
        for (_, tx) in self.reads.lock().drain() {
            let _ = tx.send(Err(why.clone()));
        }
        self.send_cv.notify_all();
        // Flush whatever is still posted; the completions come back as WR_FLUSH_ERR.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        if self.qp.lock().is_some() {
            // SAFETY: the QP is alive (held in `qp`).
            unsafe { ibv_modify_qp(self.qp_ptr, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) };
        }
        let _ = self.control.shutdown(Shutdown::Both);
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().clone()
    }

    fn complete(&self, wc: &ibv_wc) {
        let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
        let idx = wc.wr_id & !WR_KIND;
        match wc.wr_id & WR_KIND {
            WR_RECV => {
                if ok {
                    let _ = self.recv_tx.send(Ok((idx as u32, wc.byte_len)));
                } else if self.failure().is_none() {
                    self.fail(format!("receive from {} failed: {}", self.peer, status_text(wc)));
                }
            }
            WR_SEND => {
                self.free_send.lock().push(idx as u32);
                self.send_cv.notify_all();
                if !ok && self.failure().is_none() {
                    self.fail(format!("send to {} failed: {}", self.peer, status_text(wc)));
                }
            }
            WR_READ => {
                let tx = self.reads.lock().remove(&idx);
                let r = if ok { Ok(()) } else { Err(format!("RDMA READ from {} failed: {}", self.peer, status_text(wc))) };
                if let Some(tx) = tx {
                    let _ = tx.send(r.clone());
                }
                if let Err(e) = r {
                    self.fail(e);
                }
            }
            _ => {}
        }
    }

    fn post_recv(&self, idx: u32) -> Result<(), FabricError> {
        let mut sge = ibv_sge {
            addr: self.recv.ptr as u64 + idx as u64 * self.msg as u64,
            length: self.msg as u32,
            lkey: self.recv.lkey(),
        };
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_RECV | idx as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = null_mut();
        if self.qp.lock().is_none() {
            return Err(FabricError::Closed { peer: self.peer.clone() });
        }
        // SAFETY: the buffer is registered and owned by this connection until its completion.
        let rc = unsafe { ibv_post_recv(self.qp_ptr, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(rc_err(&format!("post receive to {}", self.peer), rc));
        }
        Ok(())
    }

    fn post_send(&self, wr: &mut ibv_send_wr) -> Result<(), FabricError> {
        if let Some(why) = self.failure() {
            return Err(err(why));
        }
        let mut bad = null_mut();
        let _guard = self.qp.lock();
        if _guard.is_none() {
            return Err(FabricError::Closed { peer: self.peer.clone() });
        }
        // SAFETY: the buffers named by `wr` are registered and stay valid until completion.
        let rc = unsafe { ibv_post_send(self.qp_ptr, wr, &mut bad) };
        if rc != 0 {
            return Err(rc_err(&format!("post send to {}", self.peer), rc));
        }
        Ok(())
    }
}

#[derive(Default, Debug)]
struct Counters {
    sends: AtomicU64,
    send_bytes: AtomicU64,
    recvs: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
}

/// A verbs connection.
struct VerbsLink {
    shared: Arc<ConnShared>,
    recv_rx: Receiver<Result<(u32, u32), String>>,
    stop_rx: Receiver<()>,
    stop_tx: Sender<()>,
    watcher: Mutex<Option<std::thread::JoinHandle<()>>>,
    _cq: Arc<Cq>,
}

impl VerbsLink {
    fn closed(&self) -> FabricError {
        match self.shared.failure() {
            Some(why) if !why.contains("closed by") => err(why),
            _ => FabricError::Closed { peer: self.shared.peer.clone() },
        }
    }

    fn send_bytes(&self, parts: &[&[u8]]) -> Result<(), FabricError> {
        let s = &self.shared;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > s.peer_msg || total > s.msg {
            return Err(err(format!(
                "message of {total} bytes to {} exceeds its receive buffers of {} bytes (spark.shuffle.rdma.eagerThreshold must match on every executor)",
                s.peer, s.peer_msg
            )));
        }
        let slot = {
            let mut free = s.free_send.lock();
            loop {
                if let Some(why) = s.failure() {
                    return Err(err(why));
                }
                if let Some(i) = free.pop() {
                    break i;
                }
                s.send_cv.wait_for(&mut free, Duration::from_millis(500));
            }
        };
        let base = s.send.ptr as usize + slot as usize * s.msg;
        let mut at = 0;
        for p in parts {
            // SAFETY: the slot (`msg` bytes) is ours until its completion, and `total` fits it:
            // it is at most the peer's buffer size, which never exceeds ours' bound below.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), (base + at) as *mut u8, p.len()) };
            at += p.len();
        }
        let mut sge = ibv_sge { addr: base as u64, length: total as u32, lkey: s.send.lkey() };
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_SEND | slot as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        if let Err(e) = s.post_send(&mut wr) {
            s.free_send.lock().push(slot);
            return Err(e);
        }
        s.counters.sends.fetch_add(1, Ordering::Relaxed);
        s.counters.send_bytes.fetch_add(total as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl Link for VerbsLink {
    fn peer(&self) -> &str {
        &self.shared.peer
    }

    fn send(&self, frame: &Frame, payload: Payload<'_>) -> Result<(), FabricError> {
        let head = frame.to_vec();
        match payload {
            Payload::None => self.send_bytes(&[&head]),
            Payload::Bytes(b) => self.send_bytes(&[&head, b]),
            Payload::Source { source, offset, len } => {
                let bytes = source.as_bytes();
                let body = bytes
                    .get(offset as usize..(offset + len) as usize)
                    .ok_or_else(|| err(format!("{}: payload range outside its source", self.shared.peer)))?;
                self.send_bytes(&[&head, body])
            }
        }
    }

    fn recv(&self, limits: &Limits, place: &mut dyn FnMut(&Frame) -> Placement) -> Result<Received, FabricError> {
        let (idx, len) = select! {
            recv(self.recv_rx) -> m => match m {
                Ok(Ok(v)) => v,
                _ => return Err(self.closed()),
            },
            recv(self.stop_rx) -> _ => return Err(self.closed()),
        };
        let s = &self.shared;
        s.counters.recvs.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the completion handed this buffer to us; `len` ≤ msg (the HCA enforces it).
        let msg = unsafe {
            std::slice::from_raw_parts((s.recv.ptr as usize + idx as usize * s.msg) as *const u8, (len as usize).min(s.msg))
        };
        let decoded = Frame::decode_message(msg, limits).map_err(|e| FabricError::Frame { peer: s.peer.clone(), source: e });
        let result = match decoded {
            Err(e) => Err(e),
            Ok((frame, _)) if frame.kind().payload_offset().is_none() => Ok(Received { frame, payload: None }),
            Ok((frame, off)) => {
                let body = &msg[off..];
                match place(&frame) {
                    Placement::Into { mut lease, at } => match lease.get_mut(at..at + body.len()) {
                        Some(dst) => {
                            dst.copy_from_slice(body);
                            Ok(Received { frame, payload: Some(lease) })
                        }
                        None => Err(err(format!("{}: payload of {} bytes does not fit its buffer", s.peer, body.len()))),
                    },
                    Placement::Discard => Ok(Received { frame, payload: None }),
                    Placement::Abort(e) => Err(e),
                }
            }
        };
        // The message has been consumed (copied or dropped): give the buffer back to the HCA.
        if let Err(e) = s.post_recv(idx) {
            s.fail(e.to_string());
        }
        result
    }

    fn one_sided_read(&self) -> bool {
        true
    }

    fn read_remote(&self, desc: &Descriptor, dst: &mut Lease) -> Result<(), FabricError> {
        let s = &self.shared;
        if (dst.len() as u64) < desc.len {
            return Err(err(format!("local buffer of {} bytes for a {}-byte READ", dst.len(), desc.len)));
        }
        if desc.len == 0 {
            return Ok(());
        }
        let lkey = dst.keys().lkey;
        if lkey == 0 {
            return Err(err("pool buffer is not registered with the device (pool built without the verbs registrar)"));
        }
        let token = s.next_read.fetch_add(1, Ordering::Relaxed) & !WR_KIND;
        let (tx, rx) = crossbeam_channel::bounded(1);
        s.reads.lock().insert(token, tx);
        let mut sge = ibv_sge { addr: dst.as_mut_ptr() as u64, length: desc.len as u32, lkey };
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_READ | token;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = rdma_t { remote_addr: desc.addr, rkey: desc.rkey };
        if let Err(e) = s.post_send(&mut wr) {
            s.reads.lock().remove(&token);
            return Err(e);
        }
        // The buffer must not be released before the completion: wait for it (or for the
        // connection's failure, which flushes the READ and completes it with an error).
        match rx.recv() {
            Ok(Ok(())) => {
                s.counters.reads.fetch_add(1, Ordering::Relaxed);
                s.counters.read_bytes.fetch_add(desc.len, Ordering::Relaxed);
                Ok(())
            }
            Ok(Err(why)) => Err(err(why)),
            Err(_) => Err(self.closed()),
        }
    }

    fn send_raw(&self, bytes: &[u8]) -> Result<(), FabricError> {
        self.send_bytes(&[bytes])
    }

    fn flush_sends(&self, limit: Duration) {
        let s = &self.shared;
        let deadline = std::time::Instant::now() + limit;
        let mut free = s.free_send.lock();
        // Every slot back on the free list means every SEND completed.
        while free.len() < s.send_depth && s.failure().is_none() {
            if s.send_cv.wait_until(&mut free, deadline).timed_out() {
                return;
            }
        }
    }

    fn shutdown(&self) {
        let _ = self.stop_tx.try_send(());
        self.shared.fail(format!("connection to {} closed by shutdown", self.shared.peer));
    }
}

impl Drop for VerbsLink {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(w) = self.watcher.lock().take() {
            let _ = w.join();
        }
        // Destroy the QP before its buffers' MRs and its CQ (ConnShared and _cq drop after).
        self.shared.qp.lock().take();
    }
}

/// Bootstrap record exchanged over the control socket.
#[derive(Clone, Copy, Debug)]
struct PeerInfo {
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    mtu: u32,
    max_message: u32,
}

const INFO_MAGIC: &[u8; 4] = b"RDV1";
const INFO_LEN: usize = 4 + 4 + 4 + 16 + 4 + 4;

impl PeerInfo {
    fn encode(&self) -> [u8; INFO_LEN] {
        let mut b = [0u8; INFO_LEN];
        b[0..4].copy_from_slice(INFO_MAGIC);
        b[4..8].copy_from_slice(&self.qpn.to_be_bytes());
        b[8..12].copy_from_slice(&self.psn.to_be_bytes());
        b[12..28].copy_from_slice(&self.gid);
        b[28..32].copy_from_slice(&self.mtu.to_be_bytes());
        b[32..36].copy_from_slice(&self.max_message.to_be_bytes());
        b
    }
    fn decode(b: &[u8; INFO_LEN], peer: &str) -> Result<Self, FabricError> {
        if &b[0..4] != INFO_MAGIC {
            return Err(err(format!("{peer} is not a verbs rdma-shuffle endpoint (bad bootstrap magic)")));
        }
        let u = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[12..28]);
        let max_message = u(32);
        if !(1024..=(64 << 20)).contains(&max_message) {
            return Err(err(format!("{peer} announced a receive buffer of {max_message} bytes (allowed 1 KiB..64 MiB)")));
        }
        Ok(PeerInfo { qpn: u(4) & 0xff_ffff, psn: u(8) & 0xff_ffff, gid, mtu: u(28), max_message })
    }
}

struct Inner {
    config: VerbsConfig,
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    port_attr: ibv_port_attr,
    rd_atomic: u8,
    gid: [u8; 16],
    gid_index: u8,
    progress: Arc<Progress>,
    progress_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    sources: Mutex<HashMap<u64, SourceReg>>,
    next_source: AtomicU64,
    counters: Arc<Counters>,
    psn_seed: AtomicU32,
}
// SAFETY: all raw pointers inside are verbs handles used under the rules above.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        self.progress.stop.store(true, Ordering::Release);
        // SAFETY: writing one byte to our own pipe wakes the progress thread's poll.
        unsafe { libc::write(self.progress.wake[1], [1u8].as_ptr().cast(), 1) };
        if let Some(t) = self.progress_thread.lock().take() {
            let _ = t.join();
        }
        self.sources.lock().clear();
    }
}

/// The verbs provider. Cheap to clone.
#[derive(Clone)]
pub struct VerbsProvider {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for VerbsProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VerbsProvider({}, gid index {})", self.inner.ctx.name, self.inner.gid_index)
    }
}

fn is_ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff
}

impl VerbsProvider {
    /// Opens the device. Fails with a typed error naming what is missing: no device, no
    /// active port, no usable GID, a memlock limit below `config.pool_bytes`.
    pub fn open(config: VerbsConfig) -> Result<Self, FabricError> {
        check_memlock(memlock_limit(), can_lock_unlimited(), config.pool_bytes).map_err(err)?;
        // SAFETY: plain verbs calls; every pointer is checked before use.
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
                let wanted = config.device.as_deref().map(|w| w == name).unwrap_or(true);
                if wanted && chosen.is_none() {
                    let ctx = ibv_open_device(d);
                    if !ctx.is_null() {
                        let mut pa: ibv_port_attr = std::mem::zeroed();
                        let active =
                            ___ibv_query_port(ctx, config.port, &mut pa) == 0 && pa.state == ibv_port_state::IBV_PORT_ACTIVE;
                        if active || config.device.is_some() {
                            chosen = Some((Context { ctx, name: name.clone() }, pa, active));
                        } else {
                            ibv_close_device(ctx);
                        }
                    }
                }
                names.push(name);
            }
            ibv_free_device_list(list);
            let (ctx, port_attr, active) = chosen.ok_or_else(|| match &config.device {
                Some(d) => err(format!(
                    "RDMA device {d} not found or cannot be opened (devices: {names:?}); check spark.shuffle.rdma.device"
                )),
                None => err(format!("no RDMA device has an active port {} (devices: {names:?})", config.port)),
            })?;
            if !active {
                return Err(err(format!("port {} of {} is not active", config.port, ctx.name)));
            }
            let ctx = Arc::new(ctx);
            let mut dev_attr: ibv_device_attr = std::mem::zeroed();
            let rc = ibv_query_device(ctx.ctx, &mut dev_attr);
            if rc != 0 {
                return Err(rc_err("ibv_query_device", rc));
            }
            let (gid_index, gid) = match config.gid_index {
                Some(i) => {
                    let mut g: ibv_gid = std::mem::zeroed();
                    let rc = ibv_query_gid(ctx.ctx, config.port, i as i32, &mut g);
                    if rc != 0 {
                        return Err(rc_err(&format!("ibv_query_gid index {i} (spark.shuffle.rdma.gidIndex)"), rc));
                    }
                    (i, g.raw)
                }
                None => {
                    let mut found = None;
                    for i in 0..port_attr.gid_tbl_len.min(256) {
                        let mut g: ibv_gid = std::mem::zeroed();
                        if ibv_query_gid(ctx.ctx, config.port, i, &mut g) == 0 && is_ipv4_mapped(&g.raw) {
                            found = Some((i as u8, g.raw));
                            break;
                        }
                    }
                    found.ok_or_else(|| {
                        err(format!(
                            "{} port {} has no IPv4-mapped (RoCEv2) GID; set spark.shuffle.rdma.gidIndex",
                            ctx.name, config.port
                        ))
                    })?
                }
            };
            let pd = ibv_alloc_pd(ctx.ctx);
            if pd.is_null() {
                return Err(os_err("ibv_alloc_pd"));
            }
            let pd = Arc::new(Pd { pd, ctx: ctx.clone() });
            let channel = ibv_create_comp_channel(ctx.ctx);
            if channel.is_null() {
                return Err(os_err("ibv_create_comp_channel"));
            }
            let mut wake = [0i32; 2];
            if libc::pipe2(wake.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
                ibv_destroy_comp_channel(channel);
                return Err(os_err("pipe for the progress thread"));
            }
            let progress = Arc::new(Progress {
                channel,
                routes: Mutex::new(HashMap::new()),
                stop: AtomicBool::new(false),
                wake,
                _ctx: ctx.clone(),
            });
            let p = progress.clone();
            let thread = std::thread::Builder::new()
                .name(format!("rdma-shuffle-verbs-{}", ctx.name))
                .spawn(move || p.run())
                .map_err(|e| err(format!("progress thread: {e}")))?;
            tracing::info!(device = %ctx.name, gid_index, mtu = port_attr.active_mtu, "verbs provider ready");
            Ok(VerbsProvider {
                inner: Arc::new(Inner {
                    rd_atomic: dev_attr.max_qp_rd_atom.clamp(1, 16) as u8,
                    config,
                    pd,
                    port_attr,
                    gid,
                    gid_index,
                    progress,
                    progress_thread: Mutex::new(Some(thread)),
                    sources: Mutex::new(HashMap::new()),
                    next_source: AtomicU64::new(1),
                    counters: Arc::new(Counters::default()),
                    psn_seed: AtomicU32::new(std::process::id().wrapping_mul(2654435761)),
                    ctx,
                }),
            })
        }
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.inner.ctx.name
    }

    /// Builds the QP, buffers and CQ of a connection, exchanges bootstrap records over
    /// `control`, brings the QP to RTS with receives posted, and synchronizes with the peer.
    fn establish(&self, mut control: TcpStream, peer: String) -> Result<Box<dyn Link>, FabricError> {
        let i = &self.inner;
        let c = &i.config;
        let _ = control.set_nodelay(true);
        let _ = control.set_read_timeout(Some(Duration::from_secs(30)));
        let msg = c.max_message.max(4096) as usize;
        let depth = c.recv_depth.max(4) as usize;
        let sdepth = c.send_depth.max(4) as usize;
        // SAFETY: verbs calls on live objects; results checked.
        let cq = unsafe { ibv_create_cq(i.ctx.ctx, (depth + sdepth * 2 + 16) as i32, null_mut(), i.progress.channel, 0) };
        if cq.is_null() {
            return Err(os_err("ibv_create_cq"));
        }
        let cq = Arc::new(Cq { cq, progress: i.progress.clone() });
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = (sdepth * 2) as u32;
        init.cap.max_recv_wr = depth as u32;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: as above.
        let qp = unsafe { ibv_create_qp(i.pd.pd, &mut init) };
        if qp.is_null() {
            return Err(os_err("ibv_create_qp"));
        }
        let qp = Qp { qp, _cq: cq.clone(), _pd: i.pd.clone() };
        let qp_ptr = qp.qp;
        let recv = Slab::new(&i.pd, msg * depth)?;
        let send = Slab::new(&i.pd, msg * sdepth)?;
        let psn = i.psn_seed.fetch_add(0x9e37, Ordering::Relaxed) & 0xff_ffff;
        let mine =
            PeerInfo { qpn: unsafe { (*qp_ptr).qp_num }, psn, gid: i.gid, mtu: i.port_attr.active_mtu, max_message: msg as u32 };
        control.write_all(&mine.encode()).map_err(|e| FabricError::io(&peer, "bootstrap with", e))?;
        let mut b = [0u8; INFO_LEN];
        control.read_exact(&mut b).map_err(|e| FabricError::io(&peer, "bootstrap with", e))?;
        let remote = PeerInfo::decode(&b, &peer)?;
        self.to_rts(qp_ptr, psn, &remote)?;
        let (recv_tx, recv_rx) = unbounded();
        let shared = Arc::new(ConnShared {
            peer: peer.clone(),
            qp: Mutex::new(Some(qp)),
            qp_ptr,
            recv,
            send,
            msg,
            peer_msg: remote.max_message as usize,
            recv_tx,
            free_send: Mutex::new((0..sdepth as u32).collect()),
            send_depth: sdepth,
            send_cv: Condvar::new(),
            reads: Mutex::new(HashMap::new()),
            next_read: AtomicU64::new(1),
            failed: Mutex::new(None),
            control: control.try_clone().map_err(|e| FabricError::io(&peer, "bootstrap with", e))?,
            counters: i.counters.clone(),
        });
        i.progress.routes.lock().insert(cq.cq as usize, Arc::downgrade(&shared));
        // SAFETY: arm the CQ once; the progress thread re-arms after each event.
        unsafe { ibv_req_notify_cq(cq.cq, 0) };
        for idx in 0..depth as u32 {
            shared.post_recv(idx)?;
        }
        // Both sides have receives posted before either sends a frame.
        control.write_all(&[1]).map_err(|e| FabricError::io(&peer, "bootstrap with", e))?;
        let mut one = [0u8; 1];
        control.read_exact(&mut one).map_err(|e| FabricError::io(&peer, "bootstrap with", e))?;
        let _ = control.set_read_timeout(None);
        // Liveness: the peer's end of the control socket means the peer is gone.
        let s = shared.clone();
        let watch_cq = cq.clone();
        let watcher = std::thread::Builder::new()
            .name("rdma-shuffle-verbs-watch".into())
            .spawn(move || {
                let mut buf = [0u8; 1];
                let _ = control.read(&mut buf);
                // A peer that closes right after its last SEND (an Error frame refusing auth,
                // say) waits for that SEND's completion first, and an RC send completes only
                // once the receiver has its completion queued. Dispatch what is queued before
                // failing, so that last frame is read instead of lost to a race with this EOF.
                watch_cq.progress.drain(watch_cq.cq);
                drop(watch_cq);
                s.fail(format!("connection to {} closed by the peer", s.peer));
            })
            .map_err(|e| err(format!("watcher thread: {e}")))?;
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        Ok(Box::new(VerbsLink { shared, recv_rx, stop_rx, stop_tx, watcher: Mutex::new(Some(watcher)), _cq: cq }))
    }

    fn to_rts(&self, qp: *mut ibv_qp, psn: u32, remote: &PeerInfo) -> Result<(), FabricError> {
        let i = &self.inner;
        // SAFETY: modify_qp on our own QP with zero-initialized attribute structs.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_INIT;
            a.port_num = i.config.port;
            a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_READ).0;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            let rc = ibv_modify_qp(qp, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(rc_err("modify QP to INIT", rc));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = i.port_attr.active_mtu.min(remote.mtu);
            a.dest_qp_num = remote.qpn;
            a.rq_psn = remote.psn;
            a.max_dest_rd_atomic = i.rd_atomic;
            a.min_rnr_timer = 12;
            a.ah_attr.is_global = 1;
            a.ah_attr.port_num = i.config.port;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.sgid_index = i.gid_index;
            a.ah_attr.grh.hop_limit = 64;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            let rc = ibv_modify_qp(qp, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(rc_err("modify QP to RTR (is the peer's GID reachable from this device?)", rc));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = psn;
            // 4.096 µs × 2^16 ≈ 268 ms per try: generous, emulated links stall for 100 ms.
            a.timeout = 16;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.max_rd_atomic = i.rd_atomic;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            let rc = ibv_modify_qp(qp, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(rc_err("modify QP to RTS", rc));
            }
        }
        Ok(())
    }
}

/// Connections bootstrapping at once on their own threads. Beyond this the acceptor sets the
/// next one up itself: a connection flood gets back-pressure instead of unbounded threads.
const MAX_PARALLEL_SETUPS: usize = 64;

/// Accepts control connections on its own thread and bootstraps each QP on a thread of its
/// own, so one slow or silent peer (up to the 30 s bootstrap timeout) never delays the
/// connections behind it. [`Listener::accept`] hands out links whose QPs are ready.
struct VerbsListener {
    shared: Arc<ListenerShared>,
    ready: Receiver<Box<dyn Link>>,
    stop_tx: Mutex<Option<Sender<()>>>,
    stop_rx: Receiver<()>,
    acceptor: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct ListenerShared {
    socket: SocketListener,
    provider: VerbsProvider,
    /// Control sockets of connections still bootstrapping, so shutdown can abort them.
    pending: Mutex<HashMap<u64, TcpStream>>,
}

impl VerbsListener {
    fn start(socket: SocketListener, provider: VerbsProvider) -> Result<Self, FabricError> {
        let addr = socket.local_addr();
        let shared = Arc::new(ListenerShared { socket, provider, pending: Mutex::new(HashMap::new()) });
        let (ready_tx, ready) = unbounded();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("rdma-shuffle-verbs-accept-{}", addr.port()))
            .spawn(move || accept_control(&s, &ready_tx))
            .map_err(|e| FabricError::io(&addr.to_string(), "start the verbs acceptor for", e))?;
        Ok(VerbsListener { shared, ready, stop_tx: Mutex::new(Some(stop_tx)), stop_rx, acceptor: Mutex::new(Some(acceptor)) })
    }
}

/// The acceptor thread: control connections in, bootstrap threads out, until shutdown.
fn accept_control(shared: &Arc<ListenerShared>, ready: &Sender<Box<dyn Link>>) {
    let mut next_id = 0u64;
    loop {
        let (control, peer) = match shared.socket.accept() {
            Ok(c) => c,
            Err(FabricError::Shutdown) => return,
            Err(e) => {
                sock::pause_after_failed_accept(&format!("verbs control {}", shared.socket.local_addr()), &e);
                continue;
            }
        };
        next_id += 1;
        let id = next_id;
        let parallel = {
            let mut pending = shared.pending.lock();
            if let Ok(c) = control.try_clone() {
                pending.insert(id, c);
            }
            pending.len() <= MAX_PARALLEL_SETUPS
        };
        // Shutdown sets `closed` before it aborts the pending sockets: either it saw this
        // one, or this sees `closed`.
        if shared.socket.is_closed() {
            shared.pending.lock().remove(&id);
            return;
        }
        let setup = {
            let (shared, ready) = (shared.clone(), ready.clone());
            move || {
                let result = shared.provider.establish(control, peer.to_string());
                shared.pending.lock().remove(&id);
                match result {
                    // A closed listener dropped the receiver; dropping the link closes it.
                    Ok(link) => drop(ready.send(link)),
                    Err(e) if shared.socket.is_closed() => {
                        tracing::debug!(%peer, error = %e, "verbs connection setup aborted by shutdown")
                    }
                    // One peer's failed bootstrap must not stop the listener.
                    Err(e) => tracing::warn!(%peer, error = %e, "verbs connection setup failed"),
                }
            }
        };
        if !parallel {
            setup();
            continue;
        }
        if let Err(e) = std::thread::Builder::new().name("rdma-shuffle-verbs-setup".into()).spawn(setup) {
            // The closure (and with it the connection) is dropped: the peer sees a reset.
            shared.pending.lock().remove(&id);
            tracing::warn!(%peer, error = %e, "cannot start a verbs setup thread; dropping the connection");
        }
    }
}

impl Listener for VerbsListener {
    fn local_addr(&self) -> SocketAddr {
        self.shared.socket.local_addr()
    }

    fn accept(&self) -> Result<Box<dyn Link>, FabricError> {
        select! {
            recv(self.ready) -> link => link.map_err(|_| FabricError::Shutdown),
            recv(self.stop_rx) -> _ => Err(FabricError::Shutdown),
        }
    }

    fn shutdown(&self) {
        self.shared.socket.shutdown();
        // Wakes accept(): the stop channel disconnects.
        drop(self.stop_tx.lock().take());
        // Peers still bootstrapping fail now instead of at their 30 s timeout.
        for control in self.shared.pending.lock().values() {
            let _ = control.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.acceptor.lock().take() {
            let _ = h.join();
        }
    }
}

impl Drop for VerbsListener {
    fn drop(&mut self) {
        Listener::shutdown(self);
    }
}

/// A registered data file: its MR, and the private mapping it covers when the shared one
/// could not be pinned. Field order matters: the MR is deregistered before the unmap.
struct SourceReg {
    _mr: Mr,
    _private: Option<PrivateMap>,
}

/// A private read-only mapping of a file.
struct PrivateMap {
    ptr: *mut u8,
    len: usize,
}
// SAFETY: read-only memory owned by this value.
unsafe impl Send for PrivateMap {}
unsafe impl Sync for PrivateMap {}

impl PrivateMap {
    fn new(fd: i32, len: usize) -> io::Result<PrivateMap> {
        // SAFETY: mapping `len` bytes of an open file; checked for MAP_FAILED.
        let ptr = unsafe { libc::mmap(null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(PrivateMap { ptr: ptr.cast(), len })
    }
}

impl Drop for PrivateMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its MR was dropped first (SourceReg field order).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Registers pool slabs with the provider's protection domain.
struct VerbsRegistrar {
    inner: Arc<Inner>,
    mrs: Mutex<HashMap<u64, Mr>>,
    next: AtomicU64,
}

impl Registrar for VerbsRegistrar {
    fn register(&self, addr: *mut u8, len: usize) -> Result<RegionKeys, PoolError> {
        let mr = Mr::register(&self.inner.pd, addr, len, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE).map_err(|e| {
            let advice =
                if e.raw_os_error() == Some(libc::ENOMEM) { format!("; {}", memlock_advice(len as u64)) } else { String::new() };
            PoolError::Registration { bytes: len, source: format!("ibv_reg_mr on {}: {e}{advice}", self.inner.ctx.name).into() }
        })?;
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        let keys = RegionKeys { lkey: mr.lkey(), rkey: mr.rkey(), handle };
        self.mrs.lock().insert(handle, mr);
        Ok(keys)
    }

    fn deregister(&self, keys: &RegionKeys) {
        self.mrs.lock().remove(&keys.handle);
    }
}

impl Provider for VerbsProvider {
    fn name(&self) -> &'static str {
        PROVIDER
    }

    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, FabricError> {
        Ok(Box::new(VerbsListener::start(SocketListener::bind(addr)?, self.clone())?))
    }

    fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Box<dyn Link>, FabricError> {
        self.establish(sock::connect(addr, timeout)?, addr.to_string())
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(VerbsRegistrar { inner: self.inner.clone(), mrs: Mutex::new(HashMap::new()), next: AtomicU64::new(1) })
    }

    fn register_source(&self, source: &Arc<dyn Source>) -> Result<SourceKeys, FabricError> {
        let bytes = source.as_bytes();
        if bytes.is_empty() {
            return Ok(SourceKeys::default());
        }
        let fail = |e: io::Error, what: &str| {
            let advice = if e.raw_os_error() == Some(libc::ENOMEM) {
                format!("; {}", memlock_advice(bytes.len() as u64))
            } else {
                String::new()
            };
            err(format!("registering a {}-byte shuffle data file{what} on {}: {e}{advice}", bytes.len(), self.inner.ctx.name))
        };
        // Remote READ only: peers may read the mapped data file, never write it.
        let (mr, private) = match Mr::register(
            &self.inner.pd,
            bytes.as_ptr() as *mut u8,
            bytes.len(),
            ibv_access_flags::IBV_ACCESS_REMOTE_READ,
        ) {
            Ok(mr) => (mr, None),
            // Kernels before 6.2 pin read-only regions with FOLL_FORCE|FOLL_WRITE, which a
            // read-only shared file mapping refuses (EFAULT). A private mapping of the same
            // file can be pinned that way (the kernel copies its pages), at the cost of memory
            // equal to the file's size.
            Err(e) if e.raw_os_error() == Some(libc::EFAULT) && source.raw_fd().is_some() => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    tracing::warn!("this kernel cannot pin read-only shared file mappings (before 6.2); registering private copies of shuffle data files");
                });
                let map =
                    PrivateMap::new(source.raw_fd().unwrap_or(-1), bytes.len()).map_err(|e| fail(e, " (private mapping)"))?;
                let mr = Mr::register(&self.inner.pd, map.ptr, map.len, ibv_access_flags::IBV_ACCESS_REMOTE_READ)
                    .map_err(|e| fail(e, " (private mapping)"))?;
                (mr, Some(map))
            }
            Err(e) => return Err(fail(e, "")),
        };
        let handle = self.inner.next_source.fetch_add(1, Ordering::Relaxed);
        let base = private.as_ref().map(|m| m.ptr as u64).unwrap_or(bytes.as_ptr() as u64);
        let keys = SourceKeys { addr: base, rkey: mr.rkey(), handle };
        self.inner.sources.lock().insert(handle, SourceReg { _mr: mr, _private: private });
        Ok(keys)
    }

    fn deregister_source(&self, keys: &SourceKeys) {
        self.inner.sources.lock().remove(&keys.handle);
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let c = &self.inner.counters;
        vec![
            ("verbs_sends", c.sends.load(Ordering::Relaxed)),
            ("verbs_send_bytes", c.send_bytes.load(Ordering::Relaxed)),
            ("verbs_recvs", c.recvs.load(Ordering::Relaxed)),
            ("rdma_reads", c.reads.load(Ordering::Relaxed)),
            ("rdma_read_bytes", c.read_bytes.load(Ordering::Relaxed)),
        ]
    }
}
