//! What the collective algorithms need from a network: tagged, ordered, full-duplex messages
//! between ranks, in two protocols, with deadlines. [`MeshTransport`](crate::MeshTransport)
//! implements it over the fabric's mesh; the algorithms know nothing else about providers.

use rdma_shuffle_fabric::ProviderCapabilities;
use std::fmt;
use std::ops::Deref;
use std::time::Instant;

/// Message tag (see `algo` for the layout collectives use).
pub type Tag = u64;

/// How one message moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    /// Copied through pre-registered buffers; bounded by [`Transport::eager_limit`].
    Eager,
    /// Zero-copy from the sender's buffer (RDMA READ on verbs, one streamed write on tcp).
    Rendezvous,
}

impl Proto {
    /// `eager` or `rendezvous`.
    pub fn name(self) -> &'static str {
        match self {
            Proto::Eager => "eager",
            Proto::Rendezvous => "rendezvous",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a transport operation failed. The message already names this rank and the peer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct TransportError {
    /// The kind, for callers that react differently.
    pub kind: TransportErrorKind,
    /// Human-readable cause, naming ranks and the setting to change where there is one.
    pub message: String,
}

/// Kinds of [`TransportError`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportErrorKind {
    /// The link to `peer` failed (process died, connection reset).
    PeerFailed {
        /// The peer.
        peer: usize,
    },
    /// `peer` closed its communicator.
    PeerLeft {
        /// The peer.
        peer: usize,
    },
    /// Rank `by` aborted and told everyone.
    Aborted {
        /// The rank that aborted.
        by: usize,
        /// The rank whose failure caused it, when known.
        culprit: Option<usize>,
    },
    /// Nothing came from `peer` before the deadline.
    Timeout {
        /// The peer.
        peer: usize,
    },
    /// Anything else (limits, memory, closed transport).
    Other,
}

/// Counters a transport keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Eager messages sent.
    pub eager_messages: u64,
    /// Eager bytes sent.
    pub eager_bytes: u64,
    /// Rendezvous messages sent.
    pub rendezvous_messages: u64,
    /// Rendezvous bytes sent.
    pub rendezvous_bytes: u64,
    /// Eager messages received.
    pub eager_received: u64,
    /// Rendezvous messages received.
    pub rendezvous_received: u64,
    /// One-sided reads done for rendezvous receives.
    pub one_sided_reads: u64,
    /// User-buffer registrations made.
    pub registrations: u64,
    /// Registration cache hits.
    pub registration_hits: u64,
    /// Messages received straight into the caller's memory (a posted receive).
    pub placed: u64,
    /// Bytes of those.
    pub placed_bytes: u64,
    /// Of those, messages reduced into the caller's memory as they arrived.
    pub folded: u64,
    /// Bytes of those.
    pub folded_bytes: u64,
    /// Messages received into a buffer of the transport first.
    pub staged: u64,
    /// Bytes of those.
    pub staged_bytes: u64,
    /// Eager messages a stream link wrote from the caller's memory, without a copy.
    pub eager_in_place: u64,
    /// Messages that left in one write with a message held for them (a call's header).
    pub joined: u64,
}

/// A network among `world` ranks. Messages between two ranks under one tag arrive in the
/// order they were sent; sends never wait for the receiver to post a matching receive.
pub trait Transport: Send + Sync {
    /// A received message (a pool buffer, returned when dropped).
    type Buf: Deref<Target = [u8]> + Send;
    /// A registration of user memory for zero-copy sends.
    type Reg: Send;
    /// A posted send that may still read its buffer.
    type Ticket<'a>: Send
    where
        Self: 'a;

    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Provider name, for logs (`tcp`, `sim`, `verbs`).
    fn provider(&self) -> &str;
    /// Largest eager message.
    fn eager_limit(&self) -> usize;
    /// Largest message of any protocol; callers segment above it.
    fn max_message(&self) -> usize;
    /// Whether rendezvous is one-sided (needs registrations of the sent memory).
    fn one_sided(&self) -> bool;
    /// What the provider under the transport can do, as the policy asks it.
    fn capabilities(&self) -> ProviderCapabilities;

    /// Registers `len` bytes at `ptr` for rendezvous sends out of them.
    ///
    /// # Safety
    /// The memory must stay valid while the registration lives.
    unsafe fn register(&self, ptr: *const u8, len: usize) -> Result<Self::Reg, TransportError>;

    /// Sends `data` to `peer` under `tag`; `reg` must cover `data` when given.
    fn send<'a>(
        &'a self,
        peer: usize,
        tag: Tag,
        data: &'a [u8],
        proto: Proto,
        reg: Option<&Self::Reg>,
    ) -> Result<Self::Ticket<'a>, TransportError>;

    /// Sends a small eager message that may leave with this rank's next message to `peer`
    /// or when this rank next waits (a collective's per-call header: one write with the
    /// data that follows instead of two). Complete on return.
    fn send_with_next(&self, peer: usize, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.send(peer, tag, data, Proto::Eager, None).map(drop)
    }

    /// Whether a ticket completed when posted (no need to wait).
    fn is_complete(ticket: &Self::Ticket<'_>) -> bool;

    /// Whether a send has completed by now (its buffer may be written), without waiting:
    /// a streamed rendezvous send over tcp is done once the loop wrote its last byte, often
    /// before `send` returned. [`wait`](Transport::wait) still takes the ticket back.
    fn is_done(&self, ticket: &Self::Ticket<'_>) -> bool {
        Self::is_complete(ticket)
    }

    /// Waits until a send no longer needs its buffer.
    fn wait(&self, ticket: Self::Ticket<'_>, deadline: Instant) -> Result<(), TransportError>;

    /// Receives the next message from `peer` under `tag`, or — when `also` is given —
    /// whichever of the two arrives first (`0` = the first, `1` = `also`).
    fn recv(
        &self,
        peer: usize,
        tag: Tag,
        also: Option<(usize, Tag)>,
        deadline: Instant,
    ) -> Result<(usize, Self::Buf), TransportError>;

    /// A receive posted into the caller's memory ([`post_recv`](Transport::post_recv)).
    type Posted: Send;

    /// Posts a receive of the next message from `peer` under `tag` into `len` bytes at
    /// `ptr`: a message of that length that arrives afterwards may be read straight there.
    ///
    /// # Safety
    /// The memory must stay valid, and untouched by anyone else, until the posted receive
    /// was waited for or dropped.
    unsafe fn post_recv(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        reg: Option<&Self::Reg>,
    ) -> Result<Self::Posted, TransportError>;

    /// Posts a reducing receive: the next message from `peer` under `tag`, of `len` bytes, is
    /// reduced (`op` over `dtype` elements) into the memory at `ptr` as it arrives, where the
    /// transport can do that; [`wait_posted`](Transport::wait_posted) hands over a message it
    /// could not reduce on the way (the caller reduces it). `None`: this transport never
    /// reduces on the way; receive and reduce as usual.
    ///
    /// # Safety
    /// As for [`post_recv`](Transport::post_recv); the memory holds the partial result the
    /// message is reduced into.
    unsafe fn post_recv_reduce(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        dtype: crate::dtype::DType,
        op: crate::dtype::ReduceOp,
    ) -> Result<Option<Self::Posted>, TransportError> {
        let _ = (peer, tag, ptr, len, dtype, op);
        Ok(None)
    }

    /// Waits for a posted receive, or — when `also` is given — whichever of it and that
    /// message comes first: `(0, None)` the message is in the posted memory; `(0, Some(buf))`
    /// it came in a buffer of the transport instead (it arrived before the receive was
    /// posted, or its length differs); `(1, Some(buf))` the `also` message, and the receive
    /// is still posted.
    fn wait_posted(
        &self,
        posted: &mut Self::Posted,
        also: Option<(usize, Tag)>,
        deadline: Instant,
    ) -> Result<(usize, Option<Self::Buf>), TransportError>;

    /// Tells every peer this rank gives up, because rank `culprit` failed when that is
    /// known (their errors then lead with it).
    fn abort(&self, culprit: Option<usize>, reason: &str);

    /// Told once the ranks know their hosts: whether this host runs more ranks than it has
    /// cores, so a waiting rank should yield its core rather than spin on it. Transports
    /// that do not spin ignore it.
    fn set_oversubscribed(&self, _yes: bool) {}

    /// Counters.
    fn stats(&self) -> TransportStats;
}
