//! One shm connection: whole messages through the segment's rings, large ones by single copy
//! (process_vm_readv) or in fragments, doorbells, and the liveness of the peer.

use super::config::ShmConfig;
use super::ring::{Consumer, Producer};
use super::segment::{Segment, Side};
use super::sys;
use rdma_shuffle_fabric::error::FabricError;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A whole message.
const KIND_MSG: u32 = 1;
/// A fragment of a message; more follow.
const KIND_FRAG: u32 = 2;
/// The last fragment of a message.
const KIND_FRAG_END: u32 = 3;
/// A message left in the sender's memory: `{id, addr, len}`; the receiver copies it with
/// process_vm_readv and answers [`KIND_ACK`].
const KIND_REF: u32 = 4;
/// `{id}`: the message sent by reference was copied; the sender may free it.
const KIND_ACK: u32 = 5;
/// A message whose head travels in the record and whose body was left in the sender's
/// memory: `{id, addr, len, head...}`. The receiver copies the body with process_vm_readv
/// behind the head and answers [`KIND_ACK`]. The body is the sender's caller's own buffer
/// ([`ShmConn::send_borrowed`]), so a large message is copied once in all, not first into a
/// message of the sender's.
const KIND_REF_HEAD: u32 = 6;
/// A message whole in one record, `{head_len: u64, head, body}`, whose body the receiver
/// copies (or reduces) straight out of the ring to where it belongs, leaving the record in
/// the ring until then ([`ShmConn::send_through_ring`]). Two copies in all, the sender's into
/// the ring and the receiver's out of it: cheaper than one `process_vm_readv` where the
/// kernel pins the source page by page (3.6 memcpys a byte here; the example `cma_copy`).
const KIND_HEAD_BODY: u32 = 7;

pub use super::ring::RING_HEAD_ROOM;

/// Flag bit: the side sleeps until a record arrives for it.
const WANT_DATA: u32 = 1;
/// Flag bit: the side sleeps until its outgoing ring has room.
const WANT_SPACE: u32 = 2;

/// A message whose body is still in the peer's memory (it was sent with
/// [`ShmConn::send_borrowed`]): its head, and where the body is. Give it to
/// [`ShmConn::copy_body`]; until then the peer keeps its buffer.
#[derive(Debug)]
pub struct LentBody {
    id: u64,
    /// In the peer's memory; or, `in_ring`, in this side's receiving ring (a pointer into
    /// the mapping, valid until the record is released).
    addr: u64,
    len: u64,
    in_ring: bool,
    /// The bytes that came before the body.
    pub head: Vec<u8>,
}

impl LentBody {
    /// Bytes of the body.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the body has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What [`ShmConn::try_recv_parts`] gives.
#[derive(Debug)]
pub enum Received {
    /// A whole message.
    Msg(Vec<u8>),
    /// A head whose body waits in the peer's memory.
    Lent(LentBody),
}

/// How large messages travel on a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LargeMessages {
    /// The receiver copies them straight out of the sender's memory (process_vm_readv).
    SingleCopy,
    /// In fragments through the ring (copy in, copy out): the peer may not read this
    /// process's memory (no ptrace permission, or single copy turned off).
    CopyThroughSegment,
}

struct Out {
    /// The message; for a borrowed one, its head.
    msg: Vec<u8>,
    /// Bytes already pushed (fragments).
    sent: usize,
    /// A body left in the caller's memory: `(id, addr, len)` (see [`ShmConn::send_borrowed`]).
    borrowed: Option<(u64, u64, usize)>,
    /// The borrowed body goes into the ring with its head, not by reference.
    by_ring: bool,
}

/// What the connection keeps of a message until the peer acknowledged its copy.
enum Lent {
    /// The message itself, sent by reference.
    Owned(#[allow(dead_code)] Vec<u8>),
    /// The owner of a caller's buffer the peer reads the body (of this many bytes) from.
    Borrowed(#[allow(dead_code)] Arc<dyn Send + Sync>, usize),
}

impl Lent {
    fn len(&self) -> usize {
        match self {
            Lent::Owned(m) => m.len(),
            Lent::Borrowed(_, len) => *len,
        }
    }
}

/// Counters of one connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmConnStats {
    /// Messages sent inline (one record).
    pub inline: u64,
    /// Messages sent by reference (the peer copied them out of our memory).
    pub single_copy: u64,
    /// Messages sent in fragments through the ring.
    pub fragmented: u64,
    /// Messages whose head and body went into one record from the caller's buffer
    /// ([`ShmConn::send_through_ring`]).
    pub through_ring: u64,
    /// Times the peer's doorbell was rung.
    pub doorbells: u64,
}

/// An established shm connection.
pub struct ShmConn {
    peer: String,
    sock: OwnedFd,
    side: Side,
    tx: Producer,
    rx: Consumer,
    /// Our doorbell (we sleep on it) and the peer's (we ring it).
    bell: OwnedFd,
    peer_bell: OwnedFd,
    peer_pid: libc::pid_t,
    large: LargeMessages,
    single_copy_min: usize,
    max_message: usize,
    spin: Duration,
    out: VecDeque<Out>,
    /// Acknowledgements waiting for room in the ring (they go before messages).
    acks: VecDeque<u64>,
    /// Messages sent by reference (and owners of borrowed bodies, from the send on), kept
    /// until the peer acknowledges them.
    lent: HashMap<u64, Lent>,
    next_id: u64,
    /// A message arriving in fragments.
    partial: Option<Vec<u8>>,
    /// Where the body of the [`KIND_HEAD_BODY`] record held in the receiving ring lies
    /// (`addr`, `len`), until [`copy_body`](Self::copy_body) or
    /// [`fold_body`](Self::fold_body) takes it and releases the record.
    held_body: Option<(u64, u64)>,
    peer_gone: bool,
    stats: ShmConnStats,
    // Last: the rings point into it.
    seg: Segment,
}

impl std::fmt::Debug for ShmConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmConn").field("peer", &self.peer).field("large", &self.large).field("stats", &self.stats).finish()
    }
}

/// What the handshake hands over to build a connection.
pub(crate) struct Parts {
    pub(crate) peer: String,
    pub(crate) sock: OwnedFd,
    pub(crate) side: Side,
    pub(crate) seg: Segment,
    pub(crate) bell: OwnedFd,
    pub(crate) peer_bell: OwnedFd,
    pub(crate) peer_pid: libc::pid_t,
    /// Whether the peer proved it can read our memory (and single copy is on here).
    pub(crate) peer_reads_us: bool,
}

impl ShmConn {
    pub(crate) fn new(p: Parts, cfg: &ShmConfig) -> ShmConn {
        // SAFETY: the rings point into `seg`, which the connection owns and drops last; this
        // side is the only producer of its tx ring and the only consumer of its rx ring.
        let (tx, rx) = unsafe { (Producer::new(p.seg.tx(p.side)), Consumer::new(p.seg.rx(p.side))) };
        let large =
            if p.peer_reads_us && cfg.single_copy { LargeMessages::SingleCopy } else { LargeMessages::CopyThroughSegment };
        ShmConn {
            peer: p.peer,
            sock: p.sock,
            side: p.side,
            tx,
            rx,
            bell: p.bell,
            peer_bell: p.peer_bell,
            peer_pid: p.peer_pid,
            large,
            single_copy_min: cfg.single_copy_min,
            max_message: cfg.max_message,
            spin: cfg.spin,
            out: VecDeque::new(),
            acks: VecDeque::new(),
            lent: HashMap::new(),
            next_id: 1,
            partial: None,
            held_body: None,
            peer_gone: false,
            stats: ShmConnStats::default(),
            seg: p.seg,
        }
    }

    /// The peer's name (`shm:<address>` or `shm:pid <n>`).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// How this side sends large messages.
    pub fn large_messages(&self) -> LargeMessages {
        self.large
    }

    /// The segment's memfd name (`/memfd:<name> (deleted)` in `/proc/<pid>/maps` while mapped).
    pub fn segment_name(&self) -> &str {
        self.seg.name()
    }

    /// Counters.
    pub fn stats(&self) -> ShmConnStats {
        self.stats
    }

    /// The descriptors to poll: the doorbell (readable when the peer rang) and the control
    /// socket (readable or hung up when the peer closed or died).
    pub fn poll_fds(&self) -> [RawFd; 2] {
        [self.bell.as_raw_fd(), self.sock.as_raw_fd()]
    }

    /// Bytes of messages queued and not yet in the ring, plus those lent by reference and
    /// not yet copied by the peer.
    pub fn queued_bytes(&self) -> usize {
        self.out.iter().map(|o| o.msg.len() - o.sent).sum::<usize>() + self.lent.values().map(|v| v.len()).sum::<usize>()
    }

    fn closed(&self) -> FabricError {
        FabricError::Closed { peer: self.peer.clone() }
    }

    fn corrupt(&self, what: String) -> FabricError {
        FabricError::Provider {
            provider: "shm",
            message: format!("peer {} broke the shared segment: {what}", self.peer),
            knob: None,
        }
    }

    /// Queues one whole message and puts as much of the queue into the ring as fits.
    pub fn send(&mut self, msg: Vec<u8>) -> Result<(), FabricError> {
        if self.peer_gone {
            return Err(self.closed());
        }
        if msg.len() > self.max_message {
            return Err(FabricError::Unsupported(format!(
                "{}: message of {} bytes is larger than the shm provider's limit of {} bytes",
                self.peer,
                msg.len(),
                self.max_message
            )));
        }
        self.out.push_back(Out { msg, sent: 0, borrowed: None, by_ring: false });
        self.flush()
    }

    /// Puts one whole message, the concatenation of `parts`, into the ring at once if nothing
    /// is queued before it and it fits a record (and is below the single-copy size): no
    /// vector, no queue. `Ok(false)`: not taken (send it with [`send`](Self::send)).
    pub fn send_parts(&mut self, parts: &[&[u8]]) -> Result<bool, FabricError> {
        if self.peer_gone {
            return Err(self.closed());
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if !self.out.is_empty() || !self.acks.is_empty() || len >= self.inline_below() || len > self.max_message {
            return Ok(false);
        }
        if !self.tx.push(KIND_MSG, parts) {
            return Ok(false);
        }
        self.stats.inline += 1;
        self.wake_peer(WANT_DATA)?;
        Ok(true)
    }

    /// Queues a message of `head` followed by `len` bytes at `addr` in this process, which
    /// the peer copies straight from there (no copy on this side): for a large message of a
    /// caller's own buffer. `owner` keeps the buffer's owner alive until the peer's
    /// acknowledgement; answers the message's id, [`lent`](Self::lent) until then.
    ///
    /// Only where [`large_messages`](Self::large_messages) is
    /// [`SingleCopy`](LargeMessages::SingleCopy), and `head` must fit a record.
    ///
    /// # Safety
    ///
    /// The `len` bytes at `addr` must stay unchanged and mapped until the id is no longer
    /// lent (or the connection is dropped): the peer reads them at a time of its choosing. (A
    /// buffer that is not is a wrong message for the peer, never a fault here: this process
    /// only lends, the peer's kernel reads.)
    pub unsafe fn send_borrowed(
        &mut self,
        head: Vec<u8>,
        addr: u64,
        len: usize,
        owner: Arc<dyn Send + Sync>,
    ) -> Result<u64, FabricError> {
        if self.large != LargeMessages::SingleCopy {
            return Err(FabricError::Unsupported(format!("{}: the peer may not read this process's memory", self.peer)));
        }
        if head.len() + 24 > self.tx.max_record() {
            return Err(self.too_large(head.len(), len));
        }
        // SAFETY: the caller's contract is this one's.
        unsafe { self.lend(head, addr, len, owner, false) }
    }

    /// Whether a message of a head of at most [`RING_HEAD_ROOM`] − 8 bytes and a body of
    /// `len` bytes goes by [`send_through_ring`](Self::send_through_ring): a body of at least
    /// the single-copy size (smaller ones go whole, [`send`](Self::send)) that fits one record
    /// with that room. Decided by the length alone, so the receiving side can tell from a
    /// frame's length how its body will come.
    pub fn ring_takes(&self, len: usize) -> bool {
        len >= self.single_copy_min && len.saturating_add(RING_HEAD_ROOM) <= self.tx.max_record()
    }

    /// The body lengths [`ring_takes`](Self::ring_takes), as an inclusive range (empty when
    /// none fits).
    pub fn ring_body_range(&self) -> (u64, u64) {
        (self.single_copy_min as u64, self.tx.max_record().saturating_sub(RING_HEAD_ROOM) as u64)
    }

    /// Whether [`send_through_ring`](Self::send_through_ring) takes a message of a `head`-byte
    /// head and a `len`-byte body: the body [`ring_takes`](Self::ring_takes), and the head
    /// and its length fit [`RING_HEAD_ROOM`].
    pub fn ring_takes_message(&self, head: usize, len: usize) -> bool {
        head + 8 <= RING_HEAD_ROOM && self.ring_takes(len)
    }

    /// Queues a message of `head` followed by the `len` bytes at `addr` in this process, copied
    /// from there into the ring in one record once it has room (no copy before that). The
    /// peer copies the body out of the ring straight to where it belongs. `owner` keeps the
    /// buffer's owner alive until then; answers the message's id, [`lent`](Self::lent) until
    /// the record is in the ring. For bodies [`ring_takes`](Self::ring_takes), with a head of
    /// at most [`RING_HEAD_ROOM`] − 8 bytes; needs no permission to read the peer's memory.
    ///
    /// # Safety
    ///
    /// The `len` bytes at `addr` must stay unchanged, mapped and readable until the id is no
    /// longer lent (or the connection is dropped): this side reads them when the ring has room.
    pub unsafe fn send_through_ring(
        &mut self,
        head: Vec<u8>,
        addr: u64,
        len: usize,
        owner: Arc<dyn Send + Sync>,
    ) -> Result<u64, FabricError> {
        if !self.ring_takes_message(head.len(), len) {
            return Err(self.too_large(head.len(), len));
        }
        // SAFETY: the caller's contract is this one's.
        unsafe { self.lend(head, addr, len, owner, true) }
    }

    fn too_large(&self, head: usize, len: usize) -> FabricError {
        FabricError::Unsupported(format!(
            "{}: a message of {head} + {len} bytes does not go this way (limit {} bytes, records of {})",
            self.peer,
            self.max_message,
            self.tx.max_record()
        ))
    }

    /// Queues a borrowed body (see the two callers for the contract).
    unsafe fn lend(
        &mut self,
        head: Vec<u8>,
        addr: u64,
        len: usize,
        owner: Arc<dyn Send + Sync>,
        by_ring: bool,
    ) -> Result<u64, FabricError> {
        if self.peer_gone {
            return Err(self.closed());
        }
        if head.len() + len > self.max_message {
            return Err(self.too_large(head.len(), len));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.lent.insert(id, Lent::Borrowed(owner, len));
        self.out.push_back(Out { msg: head, sent: 0, borrowed: Some((id, addr, len)), by_ring });
        self.flush()?;
        Ok(id)
    }

    /// Whether message `id` (of [`send_borrowed`](Self::send_borrowed)) waits for the peer's
    /// acknowledgement: until then its buffer must stay as it is.
    pub fn lent(&self, id: u64) -> bool {
        self.lent.contains_key(&id)
    }

    /// The smallest message sent by reference (below it, messages are copied into the ring).
    pub fn single_copy_min(&self) -> usize {
        self.single_copy_min
    }

    /// Moves queued acknowledgements and messages into the ring while it has room, and rings
    /// the peer's doorbell if it sleeps waiting for data.
    pub fn flush(&mut self) -> Result<(), FabricError> {
        let mut pushed = false;
        loop {
            let progressed = self.flush_once();
            pushed |= progressed;
            if self.acks.is_empty() && self.out.is_empty() {
                break;
            }
            if !progressed {
                // Full: ask the peer to ring us when it frees space, then look once more (it
                // may have freed space before it could see the flag).
                self.seg.sleep_flag(self.side).fetch_or(WANT_SPACE, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                if !self.flush_once() {
                    break;
                }
                pushed = true;
            }
        }
        if pushed {
            self.wake_peer(WANT_DATA)?;
        }
        Ok(())
    }

    /// Messages shorter than this travel whole in one ring record: they fit one, and they are
    /// below the single-copy size (unless single copy is off). The rule of both
    /// [`send_parts`](Self::send_parts) and the queue's [`flush_once`](Self::flush_once).
    fn inline_below(&self) -> usize {
        let fits = self.tx.max_record() + 1;
        match self.large {
            LargeMessages::CopyThroughSegment => fits,
            LargeMessages::SingleCopy => fits.min(self.single_copy_min),
        }
    }

    /// One pass of pushes; whether anything went into the ring.
    fn flush_once(&mut self) -> bool {
        let mut any = false;
        while let Some(&id) = self.acks.front() {
            if !self.tx.push(KIND_ACK, &[&id.to_le_bytes()]) {
                return any;
            }
            self.acks.pop_front();
            any = true;
        }
        let max = self.tx.max_record();
        let inline_below = self.inline_below();
        while let Some(o) = self.out.front_mut() {
            let len = o.msg.len();
            if let (Some((id, addr, body)), true) = (o.borrowed, o.by_ring) {
                // SAFETY: the caller of `send_through_ring` keeps these bytes unchanged and
                // mapped until the id stops being lent, which it does only below.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, body) };
                if !self.tx.push(KIND_HEAD_BODY, &[&(o.msg.len() as u64).to_le_bytes(), &o.msg, bytes]) {
                    return any;
                }
                self.lent.remove(&id);
                self.stats.through_ring += 1;
                self.out.pop_front();
                any = true;
                continue;
            }
            if let Some((id, addr, body)) = o.borrowed {
                let (id, addr, body) = (id.to_le_bytes(), addr.to_le_bytes(), (body as u64).to_le_bytes());
                if !self.tx.push(KIND_REF_HEAD, &[&id, &addr, &body, &o.msg]) {
                    return any;
                }
                self.stats.single_copy += 1;
                self.out.pop_front();
                any = true;
                continue;
            }
            if o.sent == 0 && len < inline_below {
                if !self.tx.push(KIND_MSG, &[&o.msg]) {
                    return any;
                }
                self.stats.inline += 1;
            } else if o.sent == 0 && self.large == LargeMessages::SingleCopy {
                let id = self.next_id;
                let mut rec = [0u8; 24];
                rec[..8].copy_from_slice(&id.to_le_bytes());
                rec[8..16].copy_from_slice(&(o.msg.as_ptr() as u64).to_le_bytes());
                rec[16..].copy_from_slice(&(len as u64).to_le_bytes());
                if !self.tx.push(KIND_REF, &[&rec]) {
                    return any;
                }
                self.next_id += 1;
                self.stats.single_copy += 1;
                // The vector's heap buffer does not move with the vector: the address stays
                // valid until the peer's acknowledgement frees it.
                let Some(o) = self.out.pop_front() else { return true };
                self.lent.insert(id, Lent::Owned(o.msg));
                any = true;
                continue;
            } else {
                let n = (len - o.sent).min(max);
                let last = o.sent + n == len;
                if !self.tx.push(if last { KIND_FRAG_END } else { KIND_FRAG }, &[&o.msg[o.sent..o.sent + n]]) {
                    return any;
                }
                any = true;
                o.sent += n;
                if !last {
                    continue;
                }
                self.stats.fragmented += 1;
            }
            self.out.pop_front();
            any = true;
        }
        any
    }

    /// Rings the peer's doorbell if it sleeps for `what` (clearing that wish).
    fn wake_peer(&mut self, what: u32) -> Result<(), FabricError> {
        // Pairs with the fence the sleeper runs between setting its flag and looking at the
        // ring once more: either it sees what we just did, or we see its flag.
        fence(Ordering::SeqCst);
        let flag = self.seg.sleep_flag(self.side.other());
        if flag.load(Ordering::Relaxed) & what != 0 && flag.fetch_and(!what, Ordering::SeqCst) & what != 0 {
            self.stats.doorbells += 1;
            sys::eventfd_ring(self.peer_bell.as_raw_fd()).map_err(|e| FabricError::io(&self.peer, "ring the doorbell of", e))?;
        }
        Ok(())
    }

    /// The next whole message, if one has arrived. `Ok(None)` leaves the doorbell armed: the
    /// descriptors of [`poll_fds`](Self::poll_fds) become readable when something arrives.
    /// Once the peer is gone and everything it sent was read: [`FabricError::Closed`].
    pub fn recv(&mut self) -> Result<Option<Vec<u8>>, FabricError> {
        self.recv_inner(true)
    }

    /// Like [`recv`](Self::recv), but an empty ring does not arm the doorbell: for a caller
    /// that polls the ring in memory and calls [`arm`](Self::arm) only before it sleeps, so a
    /// busy peer pushes without a system call.
    pub fn try_recv(&mut self) -> Result<Option<Vec<u8>>, FabricError> {
        self.recv_inner(false)
    }

    /// Whether a record waits in the ring (a message, part of one, or an acknowledgement).
    pub fn has_input(&self) -> bool {
        self.rx.has_data()
    }

    /// Asks the peer to ring the doorbell when it pushes the next record; `true` if a record
    /// is there already (then do not sleep). The flag and the look at the ring are ordered as
    /// in [`recv`](Self::recv), so no wake-up is lost.
    pub fn arm(&self) -> bool {
        self.seg.sleep_flag(self.side).fetch_or(WANT_DATA, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.rx.has_data()
    }

    fn recv_inner(&mut self, arm: bool) -> Result<Option<Vec<u8>>, FabricError> {
        match self.recv_parts(arm)? {
            None => Ok(None),
            Some(Received::Msg(m)) => Ok(Some(m)),
            Some(Received::Lent(b)) => {
                // The whole message, head then body, in one vector (calloc: a large buffer
                // comes zeroed from the kernel, with no memset here).
                let at = b.head.len();
                let mut buf = vec![0u8; at + b.len as usize];
                buf[..at].copy_from_slice(&b.head);
                self.copy_body(b, Some(&mut buf[at..]))?;
                Ok(Some(buf))
            }
        }
    }

    /// Like [`try_recv`](Self::try_recv), but a message whose body waits in the peer's memory
    /// comes as its head ([`Received::Lent`]): the caller chooses where the body goes
    /// ([`copy_body`](Self::copy_body)) — a buffer of its own, with no copy in between.
    pub fn try_recv_parts(&mut self) -> Result<Option<Received>, FabricError> {
        self.recv_parts(false)
    }

    /// Copies the body of `b` from the peer into `dst` (exactly its length), or drops it
    /// (`None`), and acknowledges it: the peer may reuse its buffer. A body in the ring is
    /// copied out of it, and its record freed.
    pub fn copy_body(&mut self, b: LentBody, dst: Option<&mut [u8]>) -> Result<(), FabricError> {
        if let Some(dst) = dst {
            if dst.len() as u64 != b.len {
                return Err(FabricError::Unsupported(format!(
                    "{}: a body of {} bytes does not go into {} bytes",
                    self.peer,
                    b.len,
                    dst.len()
                )));
            }
            if b.in_ring {
                dst.copy_from_slice(self.ring_body(&b)?);
            } else {
                self.vm_read(b.addr, dst)?;
            }
        }
        self.settle(b)
    }

    /// The body of `b` in the receiving ring: the record held now, or an error.
    fn ring_body(&self, b: &LentBody) -> Result<&[u8], FabricError> {
        if self.held_body != Some((b.addr, b.len)) {
            return Err(FabricError::Unsupported(format!("{}: a body that is not the one this ring holds", self.peer)));
        }
        // SAFETY: the record lies in this side's receiving ring (checked by the consumer when
        // it was popped) and stays there, unreleased, until `settle`.
        Ok(unsafe { std::slice::from_raw_parts(b.addr as *const u8, b.len as usize) })
    }

    /// Done with the body of `b`: a record in the ring is freed (and a producer waiting for
    /// room woken); a body in the peer's memory is acknowledged, so the peer may reuse it.
    fn settle(&mut self, b: LentBody) -> Result<(), FabricError> {
        if b.in_ring {
            // Dropped or copied, it must be this ring's: another connection's body would free
            // a record this side still holds.
            self.ring_body(&b)?;
            self.held_body = None;
            self.rx.release_held();
            self.wake_peer(WANT_SPACE)?;
            return Ok(());
        }
        self.acks.push_back(b.id);
        self.flush()
    }

    /// Reduces the body of `b` from the peer into `dst` (exactly its length) and acknowledges
    /// it. The body is copied a piece at a time into `scratch` (small enough to stay in the
    /// core's cache) and each piece folded into `dst` at its offset with `fold(dst, piece)`:
    /// the bytes are read once from the peer and once from cache, instead of being written
    /// to a staging buffer in memory and read back from it. Pieces are `scratch.len()` bytes
    /// but the last; the caller makes that a multiple of an element's size. A body in the
    /// ring ([`send_through_ring`](Self::send_through_ring)) is folded out of the ring in the
    /// same pieces, and its record freed instead of acknowledged.
    pub fn fold_body(
        &mut self,
        b: LentBody,
        dst: &mut [u8],
        scratch: &mut [u8],
        mut fold: impl FnMut(&mut [u8], &[u8]),
    ) -> Result<(), FabricError> {
        if dst.len() as u64 != b.len || scratch.is_empty() {
            return Err(FabricError::Unsupported(format!(
                "{}: a body of {} bytes is not folded into {} bytes in pieces of {}",
                self.peer,
                b.len,
                dst.len(),
                scratch.len()
            )));
        }
        let step = scratch.len();
        if b.in_ring {
            // Reduced straight out of the ring, in the same pieces: no copy at all here.
            let src = self.ring_body(&b)?;
            for (d, piece) in dst.chunks_mut(step).zip(src.chunks(step)) {
                fold(d, piece);
            }
        } else {
            for (i, d) in dst.chunks_mut(step).enumerate() {
                let piece = &mut scratch[..d.len()];
                self.vm_read(b.addr + (i * step) as u64, piece)?;
                fold(d, piece);
            }
        }
        self.settle(b)
    }

    fn vm_read(&self, addr: u64, dst: &mut [u8]) -> Result<(), FabricError> {
        sys::vm_read(self.peer_pid, addr, dst).map_err(|e| match e.raw_os_error() {
            // The process is gone (its socket's hangup may not have been seen yet).
            Some(libc::ESRCH) => self.closed(),
            _ => FabricError::io(&self.peer, "copy a message (process_vm_readv) from", e),
        })
    }

    fn recv_parts(&mut self, arm: bool) -> Result<Option<Received>, FabricError> {
        self.flush()?;
        let mut freed = false;
        let got = loop {
            match self.pop()? {
                Popped::Msg(m) => break Some(Received::Msg(m)),
                Popped::Lent(b) => break Some(Received::Lent(b)),
                Popped::Freed => freed = true,
                Popped::Empty => {
                    if arm && self.arm() {
                        continue;
                    }
                    break None;
                }
            }
        };
        if freed || got.is_some() {
            // We consumed records: a producer waiting for room may go on.
            self.wake_peer(WANT_SPACE)?;
        }
        if !self.acks.is_empty() {
            self.flush()?;
        }
        match got {
            None if self.peer_gone => Err(self.closed()),
            g => Ok(g),
        }
    }

    fn pop(&mut self) -> Result<Popped, FabricError> {
        let max = self.max_message;
        let partial = &mut self.partial;
        let r = self.rx.pop_keep(|kind, bytes| -> (Result<Record, String>, bool) {
            if kind == KIND_HEAD_BODY {
                // Kept in the ring: the body is copied out of it where it belongs.
                return match head_body(bytes, max) {
                    Ok(b) => (Ok(Record::RingBody(b)), true),
                    Err(e) => (Err(e), false),
                };
            }
            let mut record = || match kind {
                KIND_MSG => Ok(Record::Msg(bytes.to_vec())),
                KIND_FRAG | KIND_FRAG_END => {
                    let p = partial.get_or_insert_with(Vec::new);
                    if p.len() + bytes.len() > max {
                        return Err(format!("a fragmented message grows past the {max}-byte limit"));
                    }
                    p.extend_from_slice(bytes);
                    if kind == KIND_FRAG_END {
                        Ok(Record::Msg(partial.take().unwrap_or_default()))
                    } else {
                        Ok(Record::Freed)
                    }
                }
                KIND_REF if bytes.len() == 24 => Ok(Record::Ref(le(&bytes[..8]), le(&bytes[8..16]), le(&bytes[16..]))),
                KIND_REF_HEAD if bytes.len() >= 24 => {
                    let (len, head) = (le(&bytes[16..24]), &bytes[24..]);
                    if len.saturating_add(head.len() as u64) > max as u64 {
                        return Err(format!("a message of {} + {len} bytes by reference, past the {max}-byte limit", head.len()));
                    }
                    Ok(Record::RefHead(LentBody {
                        id: le(&bytes[..8]),
                        addr: le(&bytes[8..16]),
                        len,
                        in_ring: false,
                        head: head.to_vec(),
                    }))
                }
                KIND_ACK if bytes.len() == 8 => Ok(Record::Ack(le(bytes))),
                k => Err(format!("record of kind {k} and {} bytes", bytes.len())),
            };
            (record(), false)
        });
        match r {
            Err(what) => Err(self.corrupt(what)),
            Ok(None) => Ok(Popped::Empty),
            Ok(Some(Err(what))) => Err(self.corrupt(what)),
            Ok(Some(Ok(Record::RefHead(b)))) => Ok(Popped::Lent(b)),
            Ok(Some(Ok(Record::RingBody(b)))) => {
                self.held_body = Some((b.addr, b.len));
                Ok(Popped::Lent(b))
            }
            Ok(Some(Ok(Record::Ref(id, addr, len)))) => {
                if len > max as u64 {
                    return Err(self.corrupt(format!("a message of {len} bytes by reference, past the {max}-byte limit")));
                }
                let mut buf = vec![0u8; len as usize];
                self.vm_read(addr, &mut buf)?;
                self.acks.push_back(id);
                Ok(Popped::Msg(buf))
            }
            Ok(Some(Ok(Record::Ack(id)))) => {
                if self.lent.remove(&id).is_none() {
                    return Err(self.corrupt(format!("acknowledgement of message {id}, which was never lent")));
                }
                Ok(Popped::Freed)
            }
            Ok(Some(Ok(Record::Msg(m)))) => Ok(Popped::Msg(m)),
            Ok(Some(Ok(Record::Freed))) => Ok(Popped::Freed),
        }
    }

    /// Whether the peer is still there: reads the control socket, on which a live peer never
    /// sends anything after the handshake. Call it when that socket polls readable.
    pub fn check_peer(&mut self) -> Result<(), FabricError> {
        match sys::recv_msg(&self.sock, 64) {
            Ok(sys::Recv::Empty) => Ok(()),
            Ok(sys::Recv::Closed) => {
                self.peer_gone = true;
                Ok(())
            }
            Ok(sys::Recv::Msg(..)) => {
                Err(FabricError::Unsupported(format!("{} sent bytes on its shm control socket after the handshake", self.peer)))
            }
            Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {
                self.peer_gone = true;
                Ok(())
            }
            Err(e) => Err(FabricError::io(&self.peer, "read from", e)),
        }
    }

    /// Whether the peer's end is known to be closed.
    pub fn peer_gone(&self) -> bool {
        self.peer_gone
    }

    /// Resets the doorbell after a wakeup (level-triggered polls would wake at once again).
    pub fn drain_doorbell(&self) {
        sys::eventfd_drain(self.bell.as_raw_fd());
    }

    /// Waits for the next message up to `timeout`: spins for the configured time, then sleeps
    /// on the doorbell and the control socket. A dead peer is an error (Closed), not a hang.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Vec<u8>, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.recv()? {
                return Ok(m);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FabricError::io(
                    &self.peer,
                    "receive from",
                    io::Error::new(io::ErrorKind::TimedOut, format!("no message within {timeout:?}")),
                ));
            }
            self.wait(deadline - now)?;
        }
    }

    /// Blocks until the peer rang, the control socket has news, or `max` passed (a bounded
    /// spin on the ring first).
    pub fn wait(&mut self, max: Duration) -> Result<(), FabricError> {
        let spin_until = Instant::now() + self.spin.min(max);
        while Instant::now() < spin_until {
            if self.rx.has_data() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let ev = sys::poll_in(&self.poll_fds(), max.saturating_sub(self.spin))
            .map_err(|e| FabricError::io(&self.peer, "wait for", e))?;
        if ev[0] != 0 {
            self.drain_doorbell();
        }
        if ev[1] != 0 {
            self.check_peer()?;
        }
        Ok(())
    }

    /// Sends everything queued, waiting (up to `timeout`) while the ring is full and until the
    /// peer has copied every message lent to it by reference; also takes in what arrives
    /// meanwhile, returning it, so two sides that both send cannot deadlock.
    pub fn send_all(&mut self, timeout: Duration) -> Result<Vec<Vec<u8>>, FabricError> {
        self.send_until(timeout, true)
    }

    /// Like [`send_all`](Self::send_all), but returns once every queued message is in the
    /// ring: messages lent by reference may still wait for the peer's copy (the connection
    /// keeps them), so a sender of many large messages keeps several in flight.
    pub fn push_all(&mut self, timeout: Duration) -> Result<Vec<Vec<u8>>, FabricError> {
        self.send_until(timeout, false)
    }

    fn send_until(&mut self, timeout: Duration, lent_too: bool) -> Result<Vec<Vec<u8>>, FabricError> {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        let busy = |c: &ShmConn| !c.out.is_empty() || (lent_too && !c.lent.is_empty());
        while busy(self) {
            if let Some(m) = self.recv()? {
                got.push(m);
                continue;
            }
            self.flush()?;
            if !busy(self) {
                break;
            }
            if self.peer_gone {
                return Err(self.closed());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FabricError::io(
                    &self.peer,
                    "send to",
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("{} bytes still queued after {timeout:?}", self.queued_bytes()),
                    ),
                ));
            }
            self.wait(deadline - now)?;
        }
        Ok(got)
    }
}

/// What one record of the ring is.
enum Record {
    Msg(Vec<u8>),
    /// A fragment that completes no message yet.
    Freed,
    /// `{id, addr, len}` of a message to copy out of the peer.
    Ref(u64, u64, u64),
    /// A head, and `{id, addr, len}` of the body behind it in the peer's memory.
    RefHead(LentBody),
    /// A head, and its body in the record, which stays in the ring.
    RingBody(LentBody),
    /// The peer copied the message lent under this id.
    Ack(u64),
}

/// What one step of reading gave.
enum Popped {
    Msg(Vec<u8>),
    Lent(LentBody),
    /// A record that frees something (fragment, acknowledgement) but no message yet.
    Freed,
    Empty,
}

/// The head and body of a [`KIND_HEAD_BODY`] record's payload, within `max` bytes.
pub(super) fn head_body(bytes: &[u8], max: usize) -> Result<LentBody, String> {
    let hl = bytes.get(..8).map(le).ok_or_else(|| format!("a head-and-body record of {} bytes", bytes.len()))?;
    let at = usize::try_from(hl)
        .ok()
        .and_then(|h| h.checked_add(8))
        .filter(|&a| a <= bytes.len())
        .ok_or_else(|| format!("a head of {hl} bytes in a head-and-body record of {}", bytes.len()))?;
    let (head, body) = bytes[8..].split_at(at - 8);
    if bytes.len() - 8 > max {
        return Err(format!("a message of {} + {} bytes in the ring, past the {max}-byte limit", head.len(), body.len()));
    }
    Ok(LentBody { id: 0, addr: body.as_ptr() as u64, len: body.len() as u64, in_ring: true, head: head.to_vec() })
}

fn le(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}
