//! The seam between the driver and the providers: what a provider builds per driver loop (a
//! [`ProviderEngine`]), what it builds per connection (a [`Link`]) and per listening socket
//! (a [`Listener`]), and the values that cross the seam ([`Incoming`], [`OutPayload`],
//! [`Placement`]).
//!
//! The driver holds connections as `Box<dyn Link>` and the loop's engine as
//! `Box<dyn ProviderEngine>` and never asks which provider it runs: a new provider implements
//! these traits in its own crate (`crates/providers/<name>`) and is registered once, by name,
//! in `rdma-shuffle-providers`. Dispatch is one virtual call per message or per loop turn,
//! never per byte: a stream link reads and writes whole buffers behind one call.
//!
//! # The core and the capabilities
//!
//! Every link implements the core of [`Link`]: its [`Capabilities`], registration with the
//! loop, connect completion, [`authenticated`](Link::authenticated), `send`, `next`,
//! payload placement, and closing. What only some providers can do is a **capability**: a
//! trait of its own that a link answers for through an accessor (`None`: it has not got it),
//! and that the protocols and the policy ask for:
//!
//! | capability | accessor | who has it |
//! |---|---|---|
//! | one-sided read and exposure | [`Link::one_sided`] → [`OneSided`] | verbs, sim (one-sided) |
//! | receive credits against a queue the engine shares | [`Link::receive_credits`] → [`ReceiveCredits`] | verbs (SRQ) |
//! | memory-polled progress | [`Link::memory_polled`] → [`MemoryPolled`] | shm (rings) |
//! | reduce-on-receive | [`Capabilities::folds`] and [`Placement::Fold`] | tcp, shm |
//! | coalesced sends | [`Link::coalescing`] → [`Coalescing`] | tcp (one `writev`) |
//! | sends written from the caller's memory after `send` | [`Link::send_progress`] → [`SendProgress`] | tcp, shm |
//!
//! A data plane attached after authentication (verbs' queue pairs) is no capability the
//! protocols drive: the loop tells a link that its peer authenticated
//! ([`Loop::authenticated`](crate::driver::Loop::authenticated) →
//! [`Link::authenticated`]) and the link does the rest itself. Its bootstrap record
//! travels in the protocol's frame for it ([`Codec::attach_frame`]); the link reports
//! [`Incoming::Attached`] once messages flow.
//!
//! A link that needs its engine's state (verbs: the shared receive queue, the send buffers)
//! holds it, typed, from the engine that made it: nothing crosses the seam as `Any`.

use crate::error::FabricError;
use crate::memory::pool::Lease;
use crate::providers::codec::Codec;
use crate::providers::Source;
use mio::{Registry, Token};
use rdma_shuffle_wire::Descriptor;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Something a provider wakes when a message or connection arrives outside the loop's poll
/// (the sim network): the owning driver loop, with the key it gave the endpoint.
pub trait Notify: Send + Sync {
    /// `key` has something to read.
    fn notify(&self, key: u64);
}

/// What follows a frame: nothing, bytes, part of a [`Source`], or part of a file.
pub enum OutPayload {
    /// Nothing.
    None,
    /// These bytes.
    Bytes(Vec<u8>),
    /// `len` bytes of `source` from `offset`. A stream link turns a file-backed source into
    /// [`OutPayload::File`] (sendfile) or [`OutPayload::Bytes`] (pread); only memory sources
    /// are written from as they are.
    Source {
        /// Where the bytes are.
        source: Arc<dyn Source>,
        /// Offset in the source.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// `len` bytes of an open file from `offset`, sent with sendfile(2) where it can.
    File {
        /// The file (kept open until sent).
        file: Arc<std::fs::File>,
        /// Offset in the file.
        offset: u64,
        /// Length.
        len: u64,
    },
}

impl OutPayload {
    /// Bytes of payload.
    pub fn len(&self) -> u64 {
        match self {
            OutPayload::None => 0,
            OutPayload::Bytes(b) => b.len() as u64,
            OutPayload::Source { len, .. } | OutPayload::File { len, .. } => *len,
        }
    }

    /// Whether there is no payload byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A read that could not be posted: its buffer and why.
pub type FailedRead = Box<(Lease, FabricError)>;

/// A whole received message (message links hand over whole frames): its bytes and where
/// its payload starts (the end of the fixed part its codec described).
pub struct MsgPayload {
    buf: Vec<u8>,
    at: usize,
}

impl MsgPayload {
    /// A received message `buf` whose payload starts at `at` (the end of its fixed part, as
    /// [`message_head`](super::codec::message_head) found it).
    pub fn new(buf: Vec<u8>, at: usize) -> Self {
        MsgPayload { buf, at }
    }

    /// The frame's fixed part, header included: what the protocol decodes.
    pub fn head(&self) -> &[u8] {
        &self.buf[..self.at]
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.at..]
    }

    /// The whole received buffer and where the payload starts in it (kept without a copy).
    pub fn into_parts(self) -> (Vec<u8>, usize) {
        (self.buf, self.at)
    }
}

/// Something that arrived on a connection.
pub enum Incoming {
    /// (stream) A frame's fixed part, header included, for the protocol to decode; a
    /// payload, if its [shape](super::codec::FrameShape) has one, awaits placement.
    Frame(Vec<u8>),
    /// (messages) A whole frame: its fixed part and its payload.
    Message(MsgPayload),
    /// (stream) The placed payload is complete.
    Payload(Option<Lease>),
    /// (stream) The payload placed into a vector is complete.
    PayloadVec(Vec<u8>),
    /// A one-sided read finished (or was flushed): the buffer comes back either way.
    ReadDone {
        /// The tag the read was started with.
        tag: u64,
        /// The buffer read into.
        lease: Lease,
        /// Whether the read succeeded.
        result: Result<(), FabricError>,
    },
    /// A one-sided read into user memory ([`OneSided::start_read_user`]) finished, or was
    /// flushed: the memory is the caller's again either way.
    UserReadDone {
        /// The tag the read was started with.
        tag: u64,
        /// Bytes read.
        len: u64,
        /// Whether the read succeeded.
        result: Result<(), FabricError>,
    },
    /// The data plane a link attaches after authentication is up: messages flow (only
    /// after [`Link::authenticated`] answered `false`).
    Attached,
}

/// Where a payload goes, as the role decides once it saw the frame.
pub enum Placement {
    /// Read and drop it.
    Discard,
    /// Into `lease` from byte `at`.
    Into {
        /// Destination.
        lease: Lease,
        /// Offset in it.
        at: usize,
    },
    /// Into a new vector (raw channels).
    Vec,
    /// Straight into the caller's memory (a posted receive); the link answers
    /// [`Incoming::Payload`]`(None)` once the payload is complete.
    User(UserBuf),
    /// Reduced into the caller's memory as it arrives (a posted receive of a reducing
    /// collective), by links that [fold](Capabilities::folds): the link reads the payload in pieces
    /// small enough to stay in cache (tcp: its 64 KiB read buffer) and folds each into `dst`
    /// at its offset, so the bytes are touched once on their way in instead of being written
    /// to a buffer and read back. Answered like [`User`](Placement::User).
    Fold {
        /// The memory reduced into; exactly the payload's length.
        dst: UserBuf,
        /// How a piece is reduced into it.
        fold: Fold,
    },
}

/// The reduction of one piece of a payload into memory: `(dst, src)`, same lengths.
pub type FoldFn = dyn Fn(&mut [u8], &[u8]) + Send + Sync;

/// How received bytes are reduced into memory ([`Placement::Fold`]): `apply(dst, src)`
/// combines `src` into `dst` (same length), called on consecutive pieces of the payload
/// whose lengths are multiples of `align` (an element's size), in order.
#[derive(Clone)]
pub struct Fold {
    /// Bytes every piece is a multiple of.
    pub align: usize,
    /// The reduction of one piece.
    pub apply: Arc<FoldFn>,
}

/// Memory of a caller that a payload is placed into (a posted receive of the mesh). The
/// link writes it only while the payload is being read: once it answered the payload, or
/// once the connection started closing (no link reads a closing connection), it never
/// touches it again.
pub struct UserBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is the caller's, handed to the loop thread for the placement alone (see
// `UserBuf::new`); nothing else reads or writes it meanwhile.
unsafe impl Send for UserBuf {}

impl UserBuf {
    /// # Safety
    /// `ptr..ptr + len` must be writable, and nothing else may read or write it until the
    /// placement ended: the payload was answered, or the connection started closing.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        UserBuf { ptr, len }
    }
}

impl std::ops::Deref for UserBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: valid and exclusively ours for the placement (`UserBuf::new`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for UserBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Counters a provider's data plane keeps (verbs: sends, receives, reads, queue pairs...);
/// zero where a provider has none. Shared between a driver's stats and its engine.
#[derive(Debug, Default)]
pub struct ProviderCounters {
    /// Messages sent.
    pub sends: AtomicU64,
    /// Bytes of messages sent.
    pub send_bytes: AtomicU64,
    /// Messages received.
    pub recvs: AtomicU64,
    /// One-sided reads completed.
    pub reads: AtomicU64,
    /// Bytes read one-sidedly.
    pub read_bytes: AtomicU64,
    /// Queue pairs ever created.
    pub qps_created: AtomicU64,
    /// Queue pairs open now.
    pub qps_open: AtomicU64,
    /// Completions flushed by a queue pair in the error state.
    pub flushed_completions: AtomicU64,
    /// Memory windows bound (regions exposed).
    pub windows_bound: AtomicU64,
    /// Memory windows revoked.
    pub windows_revoked: AtomicU64,
    /// Receiver-not-ready errors (a peer overran the receive queue).
    pub rnr_errors: AtomicU64,
}

/// What a provider gets to build a driver loop's engine.
pub struct EngineCtx<'a> {
    /// The driver's name, for logs.
    pub name: &'a str,
    /// The loop's poll, to register the engine's own descriptors (a completion channel).
    pub registry: &'a Registry,
    /// The token the loop routes to [`ProviderEngine::poll_completions`].
    pub token: Token,
    /// Wakes the loop for a connection or listener key (providers outside the poll).
    pub notify: Arc<dyn Notify>,
    /// The driver's provider counters.
    pub counters: Arc<ProviderCounters>,
}

/// A provider's state in one driver loop (verbs: completion queue, shared receive queue,
/// send buffers). Owned and called by the loop thread only; its links hold what they need of
/// it themselves.
pub trait ProviderEngine: Send {
    /// A new outgoing connection to `addr` (it may still be connecting: the link reports
    /// that through [`Link::is_connected`] and [`Link::on_writable`]).
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError>;

    /// Listens on `addr`. A listener with a socket registers it under `token`; one outside
    /// the poll wakes the loop through the context's notifier with `notify_key`.
    fn listen(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
        notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError>;

    /// Collects device completions; answers the connection keys that have something to
    /// handle. Called on the engine's token and once every loop turn (a busy queue is
    /// drained before the loop sleeps). Nothing to do without a device.
    fn poll_completions(&mut self) -> Vec<u64> {
        Vec::new()
    }

    /// Bytes this engine and its links registered with a device or exposed to peers
    /// (buffers, exposed regions).
    fn registered_bytes(&self) -> u64 {
        0
    }
}

/// A listening endpoint of a provider.
pub trait Listener: Send {
    /// The next accepted connection and its peer's name, or `None` when none waits now.
    fn accept(&mut self) -> Option<(String, Box<dyn Link>)>;
    /// Stops listening (deregisters the socket, or leaves the in-memory network).
    fn close(&mut self, registry: &Registry);
}

/// What a link is, as far as the protocols above it ask (a link that sets itself up after
/// its connection, shm, may answer more once it is up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Rendezvous regions are read one-sidedly over this link ([`Link::one_sided`] answers
    /// `Some`); otherwise the receiver pulls them over the connection.
    pub one_sided: bool,
    /// Largest eager payload one message of this link holds (`u32::MAX` for streams).
    pub max_eager: u32,
    /// Payload lengths [`Placement::Fold`] may be asked for (reduce-on-receive: the link
    /// reduces a payload into the caller's memory as it arrives). A protocol asks only for
    /// lengths in it, and places into its own buffer otherwise.
    pub folds: Folds,
}

impl Default for Capabilities {
    /// Two-sided, unbounded eager payloads, no reduce-on-receive.
    fn default() -> Self {
        Capabilities { one_sided: false, max_eager: u32::MAX, folds: Folds::NONE }
    }
}

/// The payload lengths a link reduces on receive ([`Capabilities::folds`]): those in
/// `range` (inclusive) and, if set, those from `from` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Folds {
    /// Lengths from `range.0` to `range.1` fold.
    pub range: (u64, u64),
    /// Lengths from this one on fold too.
    pub from: Option<u64>,
}

impl Folds {
    /// No length folds.
    pub const NONE: Folds = Folds { range: (1, 0), from: None };
    /// Every length folds.
    pub const ALL: Folds = Folds { range: (0, u64::MAX), from: None };

    /// Whether a payload of `len` bytes may be folded.
    pub fn admits(&self, len: u64) -> bool {
        (self.range.0 <= len && len <= self.range.1) || self.from.is_some_and(|f| len >= f)
    }
}

/// What the loop tells a link whose peer authenticated ([`Link::authenticated`]).
pub struct Authenticated<'a> {
    /// The protocol's framing: a record the link sends its peer travels in the protocol's
    /// frame for it ([`Codec::attach_frame`]).
    pub codec: &'a dyn Codec,
    /// Whether this side exposes regions for the peer to read one-sidedly (a block server,
    /// both sides of a mesh link; a block client only reads): only then may the peer's
    /// one-sided reads reach memory through this link.
    pub exposes: bool,
}

/// One connection of a provider, as the driver and the protocols see it: frames and
/// payloads out, [`Incoming`] items in. What only some providers can do is reached through
/// the capability accessors at the end, each `None` unless the link has it.
pub trait Link: Send {
    /// What this link is: one-sided or not, its largest eager payload, what it folds.
    fn capabilities(&self) -> Capabilities;

    /// Registers the link's socket with the loop's poll under `token`, or its notifier under
    /// `key` (links outside the poll); `key` is the connection's for good (completions are
    /// routed by it). Answers whether a socket was registered (to be deregistered at
    /// removal).
    fn register(&mut self, registry: &Registry, token: Token, key: u64) -> std::io::Result<bool>;

    /// Deregisters what [`register`](Link::register) registered.
    fn deregister(&mut self, registry: &Registry) -> std::io::Result<()> {
        let _ = registry;
        Ok(())
    }

    /// Whether the connect completed (a link that needs no connect says `true`).
    fn is_connected(&self) -> bool {
        true
    }

    /// The socket became writable: completes a pending connect (`Ok(true)` the first time)
    /// and writes what is queued.
    fn on_writable(&mut self) -> Result<bool, FabricError> {
        Ok(false)
    }

    /// The poll reported the socket readable (`hung_up`: or closed by the peer, or in
    /// error), just before the link is driven for it. A link that learns this way when a
    /// read can find bytes may skip reads that cannot (tcp: after a read found the socket
    /// empty, until the next event). The driver reports every such event of a registered
    /// socket; a link driven without events never hears of any.
    fn on_readable(&mut self, hung_up: bool) {
        let _ = hung_up;
    }

    /// The peer proved the protocol's secret (or none is required): only now may the link
    /// create, register or expose anything for it. `Ok(true)`: messages flow as before;
    /// `Ok(false)`: the link attaches a data plane first (verbs: queue pairs, its record in
    /// the protocol's frame) and reports [`Incoming::Attached`] once it is up; what is sent
    /// meanwhile waits. Called once, by
    /// [`Loop::authenticated`](crate::driver::Loop::authenticated).
    fn authenticated(&mut self, peer: &Authenticated<'_>) -> Result<bool, FabricError> {
        let _ = peer;
        Ok(true)
    }

    /// Sends a frame: its fixed part `head`, encoded by the protocol, and its payload
    /// (queued where the link must wait).
    fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError>;

    /// The next thing that arrived, if any; frames are cut with the connection's `codec`.
    fn next(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError>;

    /// Places the payload of the frame just returned (stream links; message links hand the
    /// payload over with the frame).
    fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        let _ = placement;
        Ok(())
    }

    /// Whether everything sent has left (stream: written to the socket; verbs: completed).
    fn sends_done(&self) -> bool;

    /// Stops the connection: sockets shut down, exposures revoked, a queue pair moved to the
    /// error state (its posted work then completes as flushed). Idempotent. What the link
    /// holds of its engine goes back when it is dropped.
    fn shutdown(&mut self);

    /// Whether work posted to a device is still outstanding (the connection cannot be torn
    /// down, nor its buffers reused, until it completes).
    fn busy(&self) -> bool {
        false
    }

    // ------------------------------------------------------------------ capabilities

    /// One-sided read and exposure, where this link has them.
    fn one_sided(&mut self) -> Option<&mut dyn OneSided> {
        None
    }

    /// Credits against a receive queue the engine shares among its links, where answers and
    /// requests take room in one.
    fn receive_credits(&mut self) -> Option<&mut dyn ReceiveCredits> {
        None
    }

    /// Memory-polled progress, where messages arrive in memory the loop can look at
    /// without a system call.
    fn memory_polled(&mut self) -> Option<&mut dyn MemoryPolled> {
        None
    }

    /// Coalesced sends, where many small frames can leave together.
    fn coalescing(&mut self) -> Option<&mut dyn Coalescing> {
        None
    }

    /// How far sends went out, where a link writes from the caller's memory after `send`
    /// returned (the caller keeps the memory until then).
    fn send_progress(&self) -> Option<&dyn SendProgress> {
        None
    }
}

/// One-sided read and exposure ([`Link::one_sided`]): regions exposed to the peer, and reads
/// of the regions it exposed.
pub trait OneSided {
    /// Exposes a region to the peer for one-sided reads; answers `(addr, rkey)`.
    fn expose(&mut self, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError>;

    /// Revokes an exposure; later reads of it fail.
    fn revoke(&mut self, rkey: u32);

    /// Whether a one-sided read may be posted now (verbs caps reads per queue pair and per
    /// engine).
    fn can_read(&self) -> bool {
        true
    }

    /// Starts a one-sided read of `desc` into `lease`; its completion comes back through
    /// [`Link::next`] as [`Incoming::ReadDone`] with `tag`. On `Err` nothing was posted.
    fn start_read(&mut self, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead>;

    /// Starts reading `desc` from the peer straight into the caller's memory `dst`,
    /// registered with this provider (`lkey`:
    /// [`UserRegion::write_lkey`](super::UserRegion::write_lkey)). It completes through
    /// [`Link::next`] as [`Incoming::UserReadDone`] with `tag`; until then `dst` is the
    /// device's. On `Err` nothing was posted.
    fn start_read_user(&mut self, tag: u64, desc: &Descriptor, dst: UserBuf, lkey: u32) -> Result<(), FabricError> {
        let _ = (tag, desc, dst, lkey);
        Err(FabricError::Unsupported("this provider has no one-sided read into user memory".into()))
    }
}

/// Credits against a receive queue the engine shares among its links
/// ([`Link::receive_credits`]; verbs: one shared receive queue per driver). Answers to this
/// link's requests take room in it, so requests go out only as far as
/// [`answer_room`](ReceiveCredits::answer_room) allows; a server grants its peer credits out
/// of it.
pub trait ReceiveCredits {
    /// Room for answers that may be requested now; `None` until the data plane is up.
    fn answer_room(&mut self) -> Option<u32>;

    /// `sent` requests went out within [`answer_room`](ReceiveCredits::answer_room); with
    /// `starved`, more wait, and this connection is driven again when room comes back.
    fn answers_requested(&mut self, sent: u32, starved: bool);

    /// One answer arrived: its room is free again. Answers the connections to drive again.
    fn answer_arrived(&mut self) -> Vec<u64>;

    /// (server side) Credits a session may grant its peer, at most `max`.
    fn grant_credits(&mut self, max: u32) -> u32;

    /// (server side) The credits the session granted (given back when the link goes).
    fn credits_granted(&mut self, n: u32);
}

/// Memory-polled progress ([`Link::memory_polled`]; shm rings): the loop looks at the link
/// on every turn in which it spins, event or not, and asks to be woken only before it
/// sleeps.
pub trait MemoryPolled {
    /// Whether a look would find something, without a system call: the spin turn drives
    /// only links that say so.
    fn ready(&self) -> bool;

    /// [`Link::next`] for a look with no event behind it (a spin turn): checks that cost a
    /// system call may wait for an event.
    fn next_polled(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError>;

    /// The loop is about to sleep: make the next arrival an event on this link's
    /// descriptors. `true` when something is there already (the loop must not sleep).
    fn arm(&mut self) -> bool;

    /// Sends a small frame, `head` then `body`, straight from the caller's bytes if it can
    /// go out at once with no copy in between (into the ring, when nothing is queued before
    /// it). `Ok(false)`: not taken, nothing was sent; use [`Link::send`].
    fn send_now(&mut self, head: &[u8], body: &[u8]) -> Result<bool, FabricError>;
}

/// Coalesced sends ([`Link::coalescing`]; tcp: one `writev` for many small frames).
pub trait Coalescing {
    /// Holds what is sent from now on until [`uncork`](Coalescing::uncork), which sends it
    /// together.
    fn cork(&mut self);

    /// Ends [`cork`](Coalescing::cork) and writes what was held.
    fn uncork(&mut self) -> Result<(), FabricError>;
}

/// How far sends went out ([`Link::send_progress`]), for links that write from the caller's
/// memory after [`Link::send`] returned.
pub trait SendProgress {
    /// `(bytes ever queued, bytes ever written)`: a frame queued when the first was `n` is
    /// out once the second reaches `n`.
    fn write_progress(&self) -> (u64, u64);
}

impl dyn Link + '_ {
    /// Cork the link's sends where it coalesces them (a no-op elsewhere).
    pub fn cork(&mut self) {
        if let Some(c) = self.coalescing() {
            c.cork();
        }
    }

    /// Uncork what [`cork`](Self::cork) held (a no-op where the link does not coalesce).
    pub fn uncork(&mut self) -> Result<(), FabricError> {
        match self.coalescing() {
            Some(c) => c.uncork(),
            None => Ok(()),
        }
    }

    /// Exposes a region for the peer to read: one-sided links bind it and answer
    /// `(addr, rkey)`; the others expose nothing and answer `(offset, 0)` (the peer pulls
    /// the region over the connection).
    pub fn expose_or_offer(&mut self, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError> {
        match self.one_sided() {
            Some(o) => o.expose(source, offset, len),
            None => Ok((offset, 0)),
        }
    }

    /// Revokes an exposure of a one-sided link (nothing to do elsewhere).
    pub fn revoke(&mut self, rkey: u32) {
        if let Some(o) = self.one_sided() {
            o.revoke(rkey);
        }
    }
}

/// A frame's fixed part and its payload as one message.
pub fn encode_message(head: Vec<u8>, payload: OutPayload) -> Result<Vec<u8>, FabricError> {
    let mut msg = head;
    msg.reserve(payload.len() as usize);
    match payload {
        OutPayload::None => {}
        OutPayload::Bytes(b) => msg.extend_from_slice(&b),
        OutPayload::Source { source, offset, len } => {
            let have = source.len();
            if offset.checked_add(len).is_none_or(|end| end > have) {
                return Err(FabricError::Unsupported(format!("payload {offset}+{len} outside its {have}-byte source")));
            }
            let at = msg.len();
            msg.resize(at + len as usize, 0);
            source.read_at(offset, &mut msg[at..]).map_err(|e| FabricError::io("local", "read the payload for", e))?;
        }
        OutPayload::File { file, offset, len } => {
            let at = msg.len();
            msg.resize(at + len as usize, 0);
            std::os::unix::fs::FileExt::read_exact_at(&*file, &mut msg[at..], offset)
                .map_err(|e| FabricError::io("local", "read the payload for", e))?;
        }
    }
    Ok(msg)
}
