//! The algorithms, and the per-call context they run in.
//!
//! # Tags
//!
//! A collective message's tag is `seq (31 bits) | step (12 bits) | segment (20 bits)`: `seq`
//! numbers the calls of a communicator (all ranks call collectives in the same order), `step`
//! is the algorithm's step, `segment` the piece of a block. Bit 63 is set for point-to-point
//! messages (see `comm`). The per-call header goes under the reserved step [`STEP_HEADER`]
//! with `seq` 0, so headers queue in call order whatever the ranks' `seq` numbers are.
//!
//! # Memory
//!
//! Algorithms work in place on raw byte ranges of the caller's buffers: a range sent from is
//! read by the transport until the send completes (one-sided rendezvous: until the peer has
//! read it). [`Ctx::fence`] waits for every pending send overlapping a range before the
//! range is written, so no algorithm overwrites bytes a peer is still reading, whatever its
//! order of steps.

pub(crate) mod exchange;
pub(crate) mod hier;
pub(crate) mod reducing;
pub(crate) mod rooted;

use crate::dtype::{reduce_into, DType, ReduceOp};
use crate::error::CollectiveError;
use crate::header::Header;
use crate::policy::Policy;
use crate::transport::{Proto, Tag, Transport, TransportError};
use std::collections::HashMap;
use std::time::Instant;

/// Step number reserved for the per-call header.
pub(crate) const STEP_HEADER: u32 = 0xFFF;
/// Largest step an algorithm may use.
pub(crate) const MAX_STEP: u32 = STEP_HEADER - 1;
/// Segments per block are numbered in 20 bits.
pub(crate) const MAX_SEGMENTS: usize = 1 << 20;
/// Bytes a ring keeps in flight per link at its start before it waits for its first receive.
const RING_WINDOW: usize = 8 << 20;

/// The tag of a collective message.
pub(crate) fn tag(seq: u32, step: u32, seg: u32) -> Tag {
    ((seq as u64 & 0x7FFF_FFFF) << 32) | ((step as u64 & 0xFFF) << 20) | (seg as u64 & 0xF_FFFF)
}

/// Splits `count` elements into `n` blocks (the first `count % n` one element longer), as
/// `(byte offset, byte length)`.
pub(crate) fn blocks(count: usize, n: usize, elem: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (count / n, count % n);
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for i in 0..n {
        let len = (base + usize::from(i < extra)) * elem;
        out.push((at, len));
        at += len;
    }
    out
}

/// The byte span covering blocks `[a, b)`.
pub(crate) fn span(blocks: &[(usize, usize)], (a, b): (usize, usize)) -> (usize, usize) {
    if a >= b {
        return (blocks.get(a).map(|x| x.0).unwrap_or(0), 0);
    }
    let start = blocks[a].0;
    (start, blocks[b - 1].0 + blocks[b - 1].1 - start)
}

pub(crate) fn log2_floor(p: usize) -> usize {
    (usize::BITS - 1 - p.leading_zeros()) as usize
}

struct Pending<'t, T: Transport + 't> {
    ticket: T::Ticket<'t>,
    start: usize,
    end: usize,
}

/// Everything one call needs. Field order is drop order: pending sends are waited for
/// (tickets wait in their drop) before scratch memory and registrations go.
pub(crate) struct Ctx<'t, T: Transport> {
    /// Receives posted ahead of their turn, by `(real peer, tag)`; they point into caller
    /// buffers or scratch, so they go first.
    posted: HashMap<(usize, Tag), T::Posted>,
    pending: Vec<Pending<'t, T>>,
    scratch: Vec<Vec<u8>>,
    regs: Vec<(usize, usize, T::Reg)>,
    t: &'t T,
    /// This rank in the current view (see [`Ctx::view`]); the real rank outside one.
    pub rank: usize,
    /// Ranks in the current view.
    pub world: usize,
    /// The real rank and world (the header goes around the real ring).
    me: usize,
    size: usize,
    /// The view's ranks (view rank → real rank); empty: every rank, unmapped.
    members: Vec<usize>,
    /// Added to every step number, so phases of a call in different views never share tags.
    step_base: u32,
    /// The leaders' algorithm of a hierarchical call.
    pub inner: Option<crate::policy::Algo>,
    pub seq: u32,
    pub deadline: Instant,
    pub dtype: DType,
    /// The pairwise operation (`Avg` already turned into `Sum`).
    pub op: ReduceOp,
    pub seg: usize,
    policy: &'t Policy,
    /// The header expected from the left neighbour, until it has been checked.
    header: Option<Header>,
    label: CallLabel,
    op_name: &'static str,
}

/// What a collective call's errors name (`allreduce (call #7, ring, 4096 bytes of f32)`),
/// kept as its parts and formatted only when an error needs it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallLabel {
    pub op: crate::policy::Op,
    pub call: u64,
    pub algo: crate::policy::Algo,
    pub bytes: usize,
    pub dtype: DType,
}

impl std::fmt::Display for CallLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (call #{}, {}, {} bytes of {})", self.op, self.call, self.algo, self.bytes, self.dtype)
    }
}

impl<'t, T: Transport> Ctx<'t, T> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        t: &'t T,
        policy: &'t Policy,
        seq: u32,
        deadline: Instant,
        dtype: DType,
        op: ReduceOp,
        seg: usize,
        header: Option<Header>,
        label: CallLabel,
        op_name: &'static str,
    ) -> Self {
        Ctx {
            posted: HashMap::new(),
            pending: Vec::new(),
            scratch: Vec::new(),
            regs: Vec::new(),
            t,
            rank: t.rank(),
            world: t.world(),
            me: t.rank(),
            size: t.world(),
            members: Vec::new(),
            step_base: 0,
            inner: None,
            seq,
            deadline,
            dtype,
            op: op.combining(),
            seg,
            policy,
            header,
            label,
            op_name,
        }
    }

    pub(crate) fn elem(&self) -> usize {
        self.dtype.size()
    }

    /// Runs what follows among `members` only (real ranks, this one included): `rank` and
    /// `world` become this rank's position and the count in `members`, peers are positions,
    /// and steps are numbered from `step_base`. The algorithms run unchanged in a view.
    pub(crate) fn view(&mut self, members: &[usize], step_base: u32) {
        self.rank = members.iter().position(|&r| r == self.me).unwrap_or(0);
        self.world = members.len();
        self.members = members.to_vec();
        self.step_base = step_base;
    }

    /// The real rank of view rank `v`.
    fn real(&self, v: usize) -> usize {
        self.members.get(v).copied().unwrap_or(v)
    }

    /// The real left neighbour, whose header this rank checks.
    fn left(&self) -> usize {
        (self.me + self.size - 1) % self.size
    }

    fn err(&self, source: TransportError) -> CollectiveError {
        CollectiveError::Transport { rank: self.me, op: self.label.to_string(), source }
    }

    /// A zeroed scratch buffer owned by the call (freed only after every send from it).
    pub(crate) fn scratch(&mut self, len: usize) -> *mut u8 {
        self.scratch.push(vec![0u8; len]);
        self.scratch.last_mut().map(|v| v.as_mut_ptr()).unwrap_or(std::ptr::null_mut())
    }

    /// Registers `[ptr, ptr + len)` for zero-copy sends, when this call can send rendezvous
    /// messages on a one-sided transport (a no-op otherwise).
    pub(crate) fn register(&mut self, ptr: *const u8, len: usize) -> Result<(), CollectiveError> {
        if len == 0 || !self.t.one_sided() || self.policy.proto(self.seg.min(len)) == Proto::Eager {
            return Ok(());
        }
        // SAFETY: the ranges registered are the caller's buffers (alive for the whole call) or
        // scratch owned by this context; registrations drop after the pending sends and
        // before the scratch (field order).
        let reg = unsafe { self.t.register(ptr, len) }.map_err(|e| self.err(e))?;
        self.regs.push((ptr as usize, len, reg));
        Ok(())
    }

    /// Segments of a `len`-byte block: `(index, offset, length)`.
    pub(crate) fn segs(&self, len: usize) -> impl Iterator<Item = (u32, usize, usize)> {
        let seg = self.seg;
        (0..len.div_ceil(seg)).map(move |j| (j as u32, j * seg, seg.min(len - j * seg)))
    }

    /// Sends `len` bytes at `ptr` to `peer`.
    pub(crate) fn send(&mut self, peer: usize, step: u32, seg: u32, ptr: *const u8, len: usize) -> Result<(), CollectiveError> {
        // SAFETY: `ptr..ptr+len` lies in a caller buffer or scratch that outlives the pending
        // send (see the type's field order), and is not written before `fence` waits for it.
        let data: &'t [u8] = unsafe { std::slice::from_raw_parts(ptr, len) };
        let proto = self.policy.proto(len);
        let (start, end) = (ptr as usize, ptr as usize + len);
        let reg = self.regs.iter().find(|(p, l, _)| start >= *p && end <= p + l).map(|(_, _, r)| r);
        let (real, t) = self.key(peer, step, seg);
        let ticket = self.t.send(real, t, data, proto, reg).map_err(|e| self.err(e))?;
        if !T::is_complete(&ticket) {
            self.pending.push(Pending { ticket, start, end });
        }
        Ok(())
    }

    /// Sends every segment of `[ptr, ptr + len)`.
    pub(crate) fn send_all(&mut self, peer: usize, step: u32, ptr: *const u8, len: usize) -> Result<(), CollectiveError> {
        let segs: Vec<_> = self.segs(len).collect();
        for (j, off, l) in segs {
            // SAFETY: in bounds of the range.
            self.send(peer, step, j, unsafe { ptr.add(off) }, l)?;
        }
        Ok(())
    }

    /// Waits for pending sends that read any byte of `[ptr, ptr + len)`.
    pub(crate) fn fence(&mut self, ptr: *const u8, len: usize) -> Result<(), CollectiveError> {
        let (start, end) = (ptr as usize, ptr as usize + len);
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            if p.start < end && start < p.end {
                let p = self.pending.swap_remove(i);
                self.t.wait(p.ticket, self.deadline).map_err(|e| self.err(e))?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// [`fence`](Ctx::fence) without waiting: takes back the pending sends reading any byte of
    /// `[ptr, ptr + len)` that have completed by now; whether none is left.
    fn fenced_now(&mut self, ptr: *const u8, len: usize) -> Result<bool, CollectiveError> {
        let (start, end) = (ptr as usize, ptr as usize + len);
        let mut clear = true;
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            if p.start < end && start < p.end {
                if self.t.is_done(&p.ticket) {
                    let p = self.pending.swap_remove(i);
                    self.t.wait(p.ticket, self.deadline).map_err(|e| self.err(e))?;
                    continue;
                }
                clear = false;
            }
            i += 1;
        }
        Ok(clear)
    }

    /// Posts the reducing receive of segment `seg` of `step` from `peer` into `dst` if no
    /// send still reads it (see [`exchange`](Ctx::exchange)); else it is posted at its turn.
    fn post_reduce_if_free(&mut self, peer: usize, step: u32, seg: u32, dst: *mut u8, len: usize) -> Result<(), CollectiveError> {
        if self.posted.contains_key(&self.key(peer, step, seg)) || !self.fenced_now(dst, len)? {
            return Ok(());
        }
        if let Some(p) = self.post_reduce(peer, step, seg, dst, len)? {
            self.posted.insert(self.key(peer, step, seg), p);
        }
        Ok(())
    }

    /// Receives one message, checking the left neighbour's header when it comes first.
    fn recv(&mut self, peer: usize, step: u32, seg: u32, expect: usize) -> Result<T::Buf, CollectiveError> {
        let (peer, want) = self.key(peer, step, seg);
        loop {
            let also = self.header.as_ref().map(|_| (self.left(), tag(0, STEP_HEADER, 0)));
            let (which, msg) = self.t.recv(peer, want, also, self.deadline).map_err(|e| self.err(e))?;
            if which == 1 {
                self.check_header(&msg)?;
                continue;
            }
            if msg.len() != expect {
                return Err(self.mismatch(peer, step, seg, expect, msg.len()));
            }
            return Ok(msg);
        }
    }

    /// The error for a message of `got` bytes where `expect` were due.
    fn mismatch(&mut self, peer: usize, step: u32, seg: u32, expect: usize, got: usize) -> CollectiveError {
        // Differing buffers usually mean differing arguments: if the left neighbour's
        // header is still due, its comparison names the argument.
        if let Some(mine) = self.header.take() {
            let left = self.left();
            let soon = self.deadline.min(Instant::now() + std::time::Duration::from_secs(2));
            if let Ok((_, h)) = self.t.recv(left, tag(0, STEP_HEADER, 0), None, soon) {
                if let Err(e) = mine.compare(&h, self.me, left) {
                    return e;
                }
            }
        }
        CollectiveError::Mismatch {
            rank: self.me,
            op: self.op_name,
            peer,
            message: format!(
                "received {got} bytes where {expect} were expected (step {step}, segment {seg}); the ranks' buffers differ"
            ),
        }
    }

    fn check_header(&mut self, msg: &[u8]) -> Result<(), CollectiveError> {
        let left = self.left();
        if let Some(mine) = self.header.take() {
            mine.compare(msg, self.me, left)?;
        }
        Ok(())
    }

    /// Receives `len` bytes from `peer` into `dst`.
    pub(crate) fn recv_copy(
        &mut self,
        peer: usize,
        step: u32,
        seg: u32,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), CollectiveError> {
        let posted = match self.posted.remove(&self.key(peer, step, seg)) {
            Some(p) => p,
            None => {
                self.fence(dst, len)?;
                self.post(peer, step, seg, dst, len)?
            }
        };
        self.wait_into(posted, peer, step, seg, dst, len, false)
    }

    /// Posts the receive of segment `seg` of `step` from `peer` into `dst`: a message that
    /// comes after this is read straight there (tcp, shm) instead of into a pool buffer that
    /// [`wait_copy`](Ctx::wait_copy) copies out of. The caller fenced `dst`.
    fn post(&mut self, peer: usize, step: u32, seg: u32, dst: *mut u8, len: usize) -> Result<T::Posted, CollectiveError> {
        let (real, want) = self.key(peer, step, seg);
        // SAFETY: `dst..dst+len` is in a caller buffer or scratch that outlives the posted
        // receive (a local of the caller, dropped before the call returns), and no pending
        // send reads it (fenced).
        // A registration of the caller's buffer (made for rendezvous sends out of it) lets a
        // one-sided transport READ the message straight into it.
        let (start, end) = (dst as usize, dst as usize + len);
        let reg = self.regs.iter().find(|(p, l, _)| start >= *p && end <= p + l).map(|(_, _, r)| r);
        unsafe { self.t.post_recv(real, want, dst, len, reg) }.map_err(|e| self.err(e))
    }

    /// The real rank of view rank `peer`, and the tag of segment `seg` of `step` with it.
    fn key(&self, peer: usize, step: u32, seg: u32) -> (usize, Tag) {
        (self.real(peer), tag(self.seq, self.step_base + step, seg))
    }

    /// Posts the receives of every segment of `[dst, dst + len)` not posted yet (see
    /// [`post`](Ctx::post)), so segments that arrive while earlier ones are handled land in
    /// place too; [`recv_copy`](Ctx::recv_copy) waits for them. Fences the range first
    /// unless `unfenced` (see `reducing::allreduce_ring` for when that is sound).
    pub(crate) fn post_all(
        &mut self,
        peer: usize,
        step: u32,
        dst: *mut u8,
        len: usize,
        unfenced: bool,
    ) -> Result<(), CollectiveError> {
        self.post_segments(peer, step, dst, len, unfenced, false)
    }

    /// Posts the reducing receives of every segment of `[dst, dst + len)` not posted yet:
    /// segments that arrive from now on are reduced into `dst` on their way in (see
    /// [`Transport::post_recv_reduce`]); [`recv_reduce`](Ctx::recv_reduce) waits for them.
    /// Nothing is posted where the transport cannot reduce on the way.
    pub(crate) fn post_reduce_all(&mut self, peer: usize, step: u32, dst: *mut u8, len: usize) -> Result<(), CollectiveError> {
        self.post_segments(peer, step, dst, len, false, true)
    }

    /// [`post_all`](Ctx::post_all), or with `reduce` [`post_reduce_all`](Ctx::post_reduce_all).
    fn post_segments(
        &mut self,
        peer: usize,
        step: u32,
        dst: *mut u8,
        len: usize,
        unfenced: bool,
        reduce: bool,
    ) -> Result<(), CollectiveError> {
        let segs: Vec<_> = self.segs(len).filter(|(j, _, _)| !self.posted.contains_key(&self.key(peer, step, *j))).collect();
        if segs.is_empty() {
            return Ok(());
        }
        if !unfenced {
            self.fence(dst, len)?;
        }
        for (j, off, l) in segs {
            // SAFETY: the segment lies inside the range.
            let at = unsafe { dst.add(off) };
            let p = if reduce {
                match self.post_reduce(peer, step, j, at, l)? {
                    Some(p) => p,
                    None => return Ok(()),
                }
            } else {
                self.post(peer, step, j, at, l)?
            };
            self.posted.insert(self.key(peer, step, j), p);
        }
        Ok(())
    }

    /// Posts the reducing receive of segment `seg` of `step` from `peer` into `dst` (`None`:
    /// the transport cannot reduce on the way). The caller fenced `dst`.
    fn post_reduce(
        &mut self,
        peer: usize,
        step: u32,
        seg: u32,
        dst: *mut u8,
        len: usize,
    ) -> Result<Option<T::Posted>, CollectiveError> {
        let (real, want) = self.key(peer, step, seg);
        // SAFETY: as in `post`: `dst..dst+len` outlives the posted receive and no pending
        // send reads it; it holds this rank's partial result, which the message is reduced
        // into.
        unsafe { self.t.post_recv_reduce(real, want, dst, len, self.dtype, self.op) }.map_err(|e| self.err(e))
    }

    /// Waits for a posted receive (checking the left neighbour's header when it comes
    /// first); copies the message into `dst` (reduces it into `dst`, for a reducing
    /// receive) when it came in a buffer instead.
    #[allow(clippy::too_many_arguments)]
    fn wait_into(
        &mut self,
        mut posted: T::Posted,
        peer: usize,
        step: u32,
        seg: u32,
        dst: *mut u8,
        len: usize,
        reduce: bool,
    ) -> Result<(), CollectiveError> {
        loop {
            let also = self.header.as_ref().map(|_| (self.left(), tag(0, STEP_HEADER, 0)));
            let (which, msg) = self.t.wait_posted(&mut posted, also, self.deadline).map_err(|e| self.err(e))?;
            match (which, msg) {
                (1, Some(h)) => self.check_header(&h)?,
                (_, None) => return Ok(()),
                (_, Some(msg)) => {
                    drop(posted);
                    if msg.len() != len {
                        return Err(self.mismatch(self.real(peer), step, seg, len, msg.len()));
                    }
                    // SAFETY: `dst..dst+len` is in a caller buffer or scratch, no pending send
                    // reads it, and its posted receive is gone.
                    if reduce {
                        let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                        reduce_into(self.dtype, self.op, d, &msg);
                    } else {
                        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), dst, len) };
                    }
                    return Ok(());
                }
            }
        }
    }

    /// Receives `len` bytes from `peer` and reduces them into `dst`.
    pub(crate) fn recv_reduce(
        &mut self,
        peer: usize,
        step: u32,
        seg: u32,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), CollectiveError> {
        // A reducing receive, posted ahead or now, takes a segment that arrives from here on
        // straight into `dst`; one that came earlier, or a transport that cannot, is reduced
        // out of the transport's buffer.
        let posted = match self.posted.remove(&self.key(peer, step, seg)) {
            Some(p) => Some(p),
            None => {
                self.fence(dst, len)?;
                self.post_reduce(peer, step, seg, dst, len)?
            }
        };
        if let Some(posted) = posted {
            return self.wait_into(posted, peer, step, seg, dst, len, true);
        }
        let msg = self.recv(peer, step, seg, len)?;
        // SAFETY: as in `recv_copy`.
        let d = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        reduce_into(self.dtype, self.op, d, &msg);
        Ok(())
    }

    /// `recv_copy` over every segment of a range, every receive posted first.
    pub(crate) fn recv_copy_all(&mut self, peer: usize, step: u32, dst: *mut u8, len: usize) -> Result<(), CollectiveError> {
        let segs: Vec<_> = self.segs(len).collect();
        self.post_all(peer, step, dst, len, false)?;
        for (j, off, l) in segs {
            // SAFETY: in bounds of the range.
            self.recv_copy(peer, step, j, unsafe { dst.add(off) }, l)?;
        }
        Ok(())
    }

    /// `recv_reduce` over every segment of a range.
    pub(crate) fn recv_reduce_all(&mut self, peer: usize, step: u32, dst: *mut u8, len: usize) -> Result<(), CollectiveError> {
        let segs: Vec<_> = self.segs(len).collect();
        for (j, off, l) in segs {
            // SAFETY: in bounds of the range.
            self.recv_reduce(peer, step, j, unsafe { dst.add(off) }, l)?;
        }
        Ok(())
    }

    /// Sends `[src, src + slen)` to `to` while receiving `rlen` bytes from `from` into `dst`
    /// (reducing them into it when `reduce`), segment by segment: a window of segments goes
    /// out first, then one more after each segment received. Peers in flight to this rank
    /// hold at most a window of its receive pool, and a received segment is reduced while the
    /// next ones travel, instead of every segment of a half-buffer being staged in pool
    /// memory before the first is touched.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn exchange(
        &mut self,
        to: usize,
        from: usize,
        step: u32,
        src: *const u8,
        slen: usize,
        dst: *mut u8,
        rlen: usize,
        reduce: bool,
    ) -> Result<(), CollectiveError> {
        let window = (RING_WINDOW / self.seg).max(1);
        let sends: Vec<_> = self.segs(slen).collect();
        let recvs: Vec<_> = self.segs(rlen).collect();
        let mut sent = 0;
        let (s0, d0) = (src as usize, dst as usize);
        let disjoint = s0 + slen <= d0 || d0 + rlen <= s0;
        // Where nothing sent here reads the destination, the receives are posted before the
        // first window goes out: the peer's segments, sent as soon as it sees ours, then find
        // their receive posted and land in place (reduced on the way in, tcp and shm) instead
        // of being staged in pool buffers.
        if disjoint {
            if reduce {
                self.post_reduce_all(from, step, dst, rlen)?;
            } else {
                self.post_all(from, step, dst, rlen, false)?;
            }
        }
        // Sending and reducing the same range (recursive doubling): segment `j`'s reducing
        // receive is posted as soon as its own send has completed (tcp: written, usually
        // before `send` returns), so the peer's segment `j`, which leaves at about the same
        // moment, is reduced out of the socket on its way in. Posted only at its turn, after
        // the whole window went out, it had mostly arrived and was staged in a pool buffer
        // and reduced from there: at 1 MiB over tcp on 2 ranks, 200 of 210 MB per 200 calls
        // took that extra pass through memory (`stats()`: staged against folded).
        let same = s0 == d0 && slen == rlen && reduce;
        // SAFETY (every `add`): segment offsets lie inside their ranges.
        while sent < sends.len() && sent < window {
            let (j, off, l) = sends[sent];
            self.send(to, step, j, unsafe { src.add(off) }, l)?;
            sent += 1;
            if same {
                self.post_reduce_if_free(from, step, j, unsafe { dst.add(off) }, l)?;
            }
        }
        // Overlapping ranges: a reducing receive is posted at its turn (recursive doubling
        // sends and reduces the same buffer: each segment once its own send went out and was
        // fenced); a copying one after the window, the fence waiting for sends that read it.
        if !disjoint && !reduce {
            self.post_all(from, step, dst, rlen, false)?;
        }
        for (j, off, l) in recvs {
            if reduce {
                self.recv_reduce(from, step, j, unsafe { dst.add(off) }, l)?;
            } else {
                self.recv_copy(from, step, j, unsafe { dst.add(off) }, l)?;
            }
            if sent < sends.len() {
                let (j, off, l) = sends[sent];
                self.send(to, step, j, unsafe { src.add(off) }, l)?;
                sent += 1;
                if same {
                    self.post_reduce_if_free(from, step, j, unsafe { dst.add(off) }, l)?;
                }
            }
        }
        while sent < sends.len() {
            let (j, off, l) = sends[sent];
            self.send(to, step, j, unsafe { src.add(off) }, l)?;
            sent += 1;
        }
        Ok(())
    }

    /// Ends the call: waits for every send and checks the left neighbour's header if no
    /// receive has done so yet.
    pub(crate) fn finish(&mut self) -> Result<(), CollectiveError> {
        while let Some(p) = self.pending.pop() {
            self.t.wait(p.ticket, self.deadline).map_err(|e| self.err(e))?;
        }
        if self.header.is_some() {
            let left = self.left();
            let (_, msg) = self.t.recv(left, tag(0, STEP_HEADER, 0), None, self.deadline).map_err(|e| self.err(e))?;
            self.check_header(&msg)?;
        }
        Ok(())
    }

    /// A ring pass over `blocks` of `buf` (see the module docs of `reducing`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ring_pass(
        &mut self,
        buf: *mut u8,
        blocks: &[(usize, usize)],
        first: usize,
        step_base: u32,
        reduce: bool,
        send_first: bool,
        forward_last: bool,
    ) -> Result<(), CollectiveError> {
        let p = self.world;
        let (right, left) = ((self.rank + 1) % p, (self.rank + p - 1) % p);
        let nsteps = p - 1;
        let window = (RING_WINDOW / self.seg).max(1);
        let (f_off, f_len) = blocks[first];
        let first_segs: Vec<_> = self.segs(f_len).collect();
        let mut sent = 0;
        // SAFETY (every `buf.add`): offsets come from `blocks`, which partition `buf`.
        // The first step's receives are posted before the first window goes out: the peer
        // answers with its own first segments as soon as it sees ours, and a segment that
        // finds its reducing receive posted is reduced on its way in (tcp, shm) rather than
        // staged in a pool buffer and reduced from there.
        let (c0_off, c0_len) = blocks[(first + 2 * p - 1) % p];
        self.post_segments(left, step_base, unsafe { buf.add(c0_off) }, c0_len, false, reduce)?;
        if send_first {
            while sent < first_segs.len() && sent < window {
                let (j, off, l) = first_segs[sent];
                self.send(right, step_base, j, unsafe { buf.add(f_off + off) }, l)?;
                sent += 1;
            }
        }
        for k in 0..nsteps {
            let c = (first + 2 * p - k - 1) % p;
            let (b_off, b_len) = blocks[c];
            let segs: Vec<_> = self.segs(b_len).collect();
            let step = step_base + k as u32;
            // Every receive of the step posted first, so a segment that arrives while an
            // earlier one is handled lands in place (reduced into it, for a reducing pass:
            // nothing reads block `c` until its segments are reduced and forwarded).
            self.post_segments(left, step, unsafe { buf.add(b_off) }, b_len, false, reduce)?;
            for (j, off, l) in segs {
                let dst = unsafe { buf.add(b_off + off) };
                if reduce {
                    self.recv_reduce(left, step, j, dst, l)?;
                } else {
                    self.recv_copy(left, step, j, dst, l)?;
                }
                if k + 1 < nsteps || forward_last {
                    self.send(right, step + 1, j, dst, l)?;
                }
                if k == 0 && send_first && sent < first_segs.len() {
                    let (j, off, l) = first_segs[sent];
                    self.send(right, step_base, j, unsafe { buf.add(f_off + off) }, l)?;
                    sent += 1;
                }
            }
            while k == 0 && send_first && sent < first_segs.len() {
                let (j, off, l) = first_segs[sent];
                self.send(right, step_base, j, unsafe { buf.add(f_off + off) }, l)?;
                sent += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_partition_every_element_once() {
        for count in [0usize, 1, 5, 7, 64, 1001] {
            for n in 1..6 {
                let b = blocks(count, n, 4);
                assert_eq!(b.len(), n);
                assert_eq!(b.iter().map(|x| x.1).sum::<usize>(), count * 4);
                for w in b.windows(2) {
                    assert_eq!(w[0].0 + w[0].1, w[1].0, "contiguous");
                    assert!(w[0].1 >= w[1].1, "longer blocks first");
                }
                assert_eq!(span(&b, (0, n)), (0, count * 4));
            }
        }
    }

    #[test]
    fn tags_keep_fields_apart() {
        let t = tag(5, 3, 7);
        assert_eq!((t >> 32, (t >> 20) & 0xFFF, t & 0xFFFFF), (5, 3, 7));
        assert_ne!(tag(0, STEP_HEADER, 0), tag(0, MAX_STEP, 0));
        assert_eq!(t >> 63, 0, "bit 63 is reserved for point-to-point");
    }
}
