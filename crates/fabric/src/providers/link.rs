//! The seam between the driver and the providers: what a provider builds per driver loop (a
//! [`ProviderEngine`]), what it builds per connection (a [`Link`]) and per listening socket
//! (a [`Listener`]), and the values that cross the seam ([`Incoming`], [`OutPayload`],
//! [`Placement`]).
//!
//! The driver holds connections as `Box<dyn Link>` and the loop's engine as
//! `Box<dyn ProviderEngine>` and never asks which provider it runs: a new provider implements
//! these three traits in its own folder under `providers/` and is listed once, in
//! [`open_provider`](super::open_provider). Dispatch is one virtual call per message or per
//! loop turn, never per byte: a stream link reads and writes whole buffers behind one call.
//!
//! The hooks a provider with a separate data plane needs (verbs: attach queue pairs after the
//! handshake authenticated the peer, credits against a shared receive queue) are methods with
//! neutral defaults, so the connection roles call them unconditionally and a provider without
//! a data plane (tcp, sim) ignores them.

use crate::error::FabricError;
use crate::memory::pool::Lease;
use crate::providers::codec::Codec;
use crate::providers::Source;
use mio::{Registry, Token};
use rdma_shuffle_wire::Descriptor;
use std::any::Any;
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
    /// A one-sided read into user memory ([`Link::start_read_user`]) finished, or was
    /// flushed: the memory is the caller's again either way.
    UserReadDone {
        /// The tag the read was started with.
        tag: u64,
        /// Bytes read.
        len: u64,
        /// Whether the read succeeded.
        result: Result<(), FabricError>,
    },
    /// (links with a data plane) The peer's data-plane bootstrap record: the role passes it
    /// to [`Link::complete_attach`] or [`Link::accept_attach`].
    Attach(Vec<u8>),
    /// (links with a data plane) The data plane is up (our attach was answered).
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
    /// collective), by links that [fold](Link::folds): the link reads the payload in pieces
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

/// Per-loop provider state: the engine the provider built for this driver, and the bytes
/// exposed by links whose provider keeps no count of its own.
pub struct Net {
    /// Bytes exposed to peers now by links that count them here (sim).
    pub exposed_bytes: u64,
    /// The provider's per-loop engine.
    pub(crate) engine: Box<dyn ProviderEngine>,
}

impl Net {
    /// The engine as its concrete type, for the provider's own links (`None`: another
    /// provider's engine, which a link of this provider never meets).
    pub fn engine_mut<E: ProviderEngine>(&mut self) -> Option<&mut E> {
        let any: &mut dyn Any = &mut *self.engine;
        any.downcast_mut::<E>()
    }

    /// [`engine_mut`](Net::engine_mut), shared.
    pub fn engine_ref<E: ProviderEngine>(&self) -> Option<&E> {
        let any: &dyn Any = &*self.engine;
        any.downcast_ref::<E>()
    }

    /// Bytes registered for this loop: the engine's and the exposures counted here.
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.exposed_bytes + self.engine.registered_bytes()
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
/// send buffers). Owned and called by the loop thread only.
pub trait ProviderEngine: Any + Send {
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

    /// Bytes this engine registered with a device (buffers, exposed regions).
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

/// One connection of a provider: frames and payloads out, [`Incoming`] items in, and
/// one-sided reads of regions the peer exposed. Methods with defaults are the hooks of
/// providers with a separate data plane or one-sided reads; tcp-like links keep them.
pub trait Link: Send {
    /// Whether frames travel as a byte stream now (payloads are placed while reading).
    fn is_stream(&self) -> bool;

    /// Whether rendezvous regions are read one-sidedly over this link.
    fn one_sided(&self) -> bool {
        false
    }

    /// Whether the connect completed (a link that needs no connect says `true`).
    fn is_connected(&self) -> bool {
        true
    }

    /// Registers the link's socket with the loop's poll under `token`, or its notifier under
    /// `key` (links outside the poll). Answers whether a socket was registered (to be
    /// deregistered at removal).
    fn register(&mut self, registry: &Registry, token: Token, key: u64) -> std::io::Result<bool>;

    /// Deregisters what [`register`](Link::register) registered.
    fn deregister(&mut self, registry: &Registry) -> std::io::Result<()> {
        let _ = registry;
        Ok(())
    }

    /// The socket became writable: completes a pending connect (`Ok(true)` the first time)
    /// and writes what is queued.
    fn on_writable(&mut self) -> Result<bool, FabricError> {
        Ok(false)
    }

    /// Sends a frame: its fixed part `head`, encoded by the protocol, and its payload
    /// (queued where the link must wait).
    fn send(&mut self, net: &mut Net, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError>;

    /// Sends a small frame, `head` then `body`, straight from the caller's bytes if this link
    /// can put it out at once with no copy of its own in between (shm: into the ring, when
    /// nothing is queued before it). `Ok(false)`: not taken, nothing was sent; use
    /// [`send`](Link::send). The default takes nothing.
    fn send_now(&mut self, _net: &mut Net, _head: &[u8], _body: &[u8]) -> Result<bool, FabricError> {
        Ok(false)
    }

    /// Holds what is sent from now on until [`uncork`](Link::uncork), which sends it
    /// together (tcp: one `writev` for many small frames). A no-op where each send is one
    /// message.
    fn cork(&mut self) {}

    /// Ends [`cork`](Link::cork) and writes what was held.
    fn uncork(&mut self) -> Result<(), FabricError> {
        Ok(())
    }

    /// Sends raw bytes as one write or message (tests of a peer's decoder).
    fn send_raw(&mut self, net: &mut Net, bytes: Vec<u8>) -> Result<(), FabricError>;

    /// For links that write from the caller's memory after [`send`](Link::send) returned:
    /// `(bytes ever queued, bytes ever written)`; a frame queued when the first was `n` is
    /// out once the second reaches `n`. `None` where sends copy the bytes.
    fn write_progress(&self) -> Option<(u64, u64)> {
        None
    }

    /// The next thing that arrived, if any; frames are cut with the connection's `codec`.
    fn next(&mut self, net: &mut Net, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError>;

    /// Whether the loop looks at this link on every turn in which it spins, event or not: a
    /// link whose messages arrive in memory (shm rings) is read there without a system call,
    /// and asks to be woken ([`arm`](Link::arm)) only before the loop sleeps.
    fn polled(&self) -> bool {
        false
    }

    /// [`next`](Link::next) for a look with no event behind it (a polled link, on a spin
    /// turn): checks that cost a system call may wait for an event.
    fn next_polled(&mut self, net: &mut Net, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        self.next(net, codec)
    }

    /// (polled links) Whether a look would find something, without a system call: the spin
    /// turn drives only links that say so.
    fn ready(&self) -> bool {
        true
    }

    /// (polled links) The loop is about to sleep: make the next arrival an event on this
    /// link's descriptors. `true` when something is there already (the loop must not sleep).
    fn arm(&mut self) -> bool {
        false
    }

    /// Whether [`Placement::Fold`] may be asked of this link for a payload of `len` bytes
    /// (tcp: it reduces a payload out of its read buffer as it arrives; shm: large bodies).
    /// A protocol asks only links that say so, and places into its own buffer elsewhere.
    fn folds(&self, len: u64) -> bool {
        let _ = len;
        false
    }

    /// Places the payload of the frame just returned (stream links).
    fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        let _ = placement;
        Ok(())
    }

    /// Exposes a region to the peer for one-sided reads; answers `(addr, rkey)`. Links
    /// without one-sided reads answer `(offset, 0)` (the peer pulls the region).
    fn expose(&mut self, net: &mut Net, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError> {
        let _ = (net, source, len);
        Ok((offset, 0))
    }

    /// Revokes an exposure; later reads of it fail.
    fn revoke(&mut self, net: &mut Net, rkey: u32) {
        let _ = (net, rkey);
    }

    /// Whether a one-sided read may be posted now (verbs caps reads per queue pair and per
    /// engine).
    fn can_read(&self, net: &Net) -> bool {
        let _ = net;
        true
    }

    /// Starts a one-sided read of `desc` into `lease`; its completion comes back through
    /// [`next`](Link::next) as [`Incoming::ReadDone`] with `tag`. On `Err` nothing was
    /// posted.
    fn start_read(&mut self, net: &mut Net, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        let _ = (net, tag, desc);
        Err(Box::new((lease, FabricError::Unsupported("this provider has no one-sided read".into()))))
    }

    /// (one-sided) Starts reading `desc` from the peer straight into the caller's memory
    /// `dst`, registered with this provider (`lkey`:
    /// [`UserRegion::write_lkey`](super::UserRegion::write_lkey)). It completes through
    /// [`next`](Link::next) as [`Incoming::UserReadDone`] with `tag`; until then `dst` is
    /// the device's. On `Err` nothing was posted.
    fn start_read_user(
        &mut self,
        net: &mut Net,
        tag: u64,
        desc: &Descriptor,
        dst: UserBuf,
        lkey: u32,
    ) -> Result<(), FabricError> {
        let _ = (net, tag, desc, dst, lkey);
        Err(FabricError::Unsupported("this provider has no one-sided read into user memory".into()))
    }

    /// Whether everything sent has left (stream: written to the socket; verbs: completed).
    fn sends_done(&self) -> bool;

    /// Whether work posted to a device is still outstanding (the connection cannot be torn
    /// down, nor its buffers reused, until it completes).
    fn busy(&self) -> bool {
        false
    }

    /// Stops the connection: sockets shut down, exposures revoked, a queue pair moved to the
    /// error state (its posted work then completes as flushed). Idempotent.
    fn shutdown(&mut self, net: &mut Net);

    /// The connection is removed: what it held in the engine goes back.
    fn destroy(&mut self, net: &mut Net) {
        let _ = net;
    }

    // ------------------------------------------------------------ data plane (verbs)

    /// Largest eager payload this link's receive buffers hold (unbounded for streams).
    fn max_eager(&self) -> u32 {
        u32::MAX
    }

    /// Whether, once the handshake authenticated the peer, a data plane must be attached
    /// ([`begin_attach`](Link::begin_attach) / [`accept_attach`](Link::accept_attach))
    /// before messages flow.
    fn needs_attach(&self) -> bool {
        false
    }

    /// (connecting side, after the handshake) Lets the authenticated peer read memory
    /// registered for it through this link (both sides expose rendezvous buffers).
    fn allow_remote_read(&mut self) {}

    /// (connecting side, after the handshake) Starts attaching the data plane; its record
    /// travels in the protocol's frame for it ([`Codec::attach_frame`]).
    fn begin_attach(&mut self, net: &mut Net, key: u64, codec: &dyn Codec) -> Result<(), FabricError> {
        let _ = (net, key, codec);
        Ok(())
    }

    /// (accepting side) Waits for the peer's attach record and reports
    /// [`Incoming::Attached`] once it answered it.
    fn expect_attach(&mut self) -> Result<(), FabricError> {
        Ok(())
    }

    /// (connecting side) The peer's attach record arrived: the data plane is up.
    fn complete_attach(&mut self, net: &mut Net, data: &[u8]) -> Result<(), FabricError> {
        let _ = (net, data);
        Err(FabricError::Unsupported("an attach record on a connection without a data plane".into()))
    }

    /// (accepting side) The authenticated peer's attach record arrived: attach and answer
    /// (in the protocol's frame, [`Codec::attach_frame`]).
    fn accept_attach(&mut self, net: &mut Net, key: u64, data: &[u8], codec: &dyn Codec) -> Result<(), FabricError> {
        let _ = (net, key, data, codec);
        Err(FabricError::Unsupported("an attach record on a connection without a data plane".into()))
    }

    /// Whether answers to this link's requests take room in a receive queue shared by the
    /// engine, so requests go out only as far as [`answer_room`](Link::answer_room) allows.
    fn bounded_answers(&self) -> bool {
        false
    }

    /// Room for answers that may be requested now; `None` when unbounded (or the data plane
    /// is not up yet).
    fn answer_room(&mut self, net: &mut Net) -> Option<u32> {
        let _ = net;
        None
    }

    /// `sent` requests went out within [`answer_room`](Link::answer_room); with `starved`,
    /// more wait, and connection `key` is driven again when room comes back.
    fn answers_requested(&mut self, net: &mut Net, sent: u32, starved: bool, key: u64) {
        let _ = (net, sent, starved, key);
    }

    /// One answer arrived: its room is free again. Answers connections to drive again.
    fn answer_arrived(&mut self, net: &mut Net) -> Vec<u64> {
        let _ = net;
        Vec::new()
    }

    /// (server side) Credits a session may grant its peer, at most `max`.
    fn grant_credits(&mut self, net: &mut Net, max: u32) -> u32 {
        let _ = net;
        max
    }

    /// (server side) The credits the session granted (given back at removal).
    fn credits_granted(&mut self, n: u32) {
        let _ = n;
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
