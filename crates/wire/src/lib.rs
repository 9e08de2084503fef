//! Sans-IO protocol of rdma-shuffle.
//!
//! This crate holds everything two engine endpoints must agree on, and nothing else:
//! the frame format and its codec ([`frame`]), the handshake with its optional
//! challenge–response authentication ([`auth`]), and the two session state machines
//! ([`ClientSession`], [`ServerSession`]) that track requests, credits, eager and
//! rendezvous deliveries, and failures.
//!
//! There are no sockets, threads or clocks here (the style of `quinn-proto`): callers feed
//! decoded frames and the current [`Instant`](std::time::Instant) in, and drain the frames to
//! send and the events to act on. The `fabric` crate's providers (tcp, verbs, sim) are the
//! drivers that execute those outputs, so one protocol test suite runs on every provider.
//!
//! Nothing here knows about Spark: a block is a [`BlockSpan`] (a group, an object inside it
//! and a contiguous range of parts), which the shuffle layer maps to
//! `(shuffleId, mapId, startReduceId..endReduceId)`.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod auth;
pub mod block;
pub mod client;
pub mod error;
pub mod frame;
pub mod knob;
pub mod server;

pub use auth::{Secret, Transcript};
pub use block::{BlockFailure, BlockRange, BlockSpan, Descriptor, FailureCode, RegionId};
pub use client::{ClientConfig, ClientEvent, ClientSession, RequestId, Token};
pub use error::{ProtocolError, SessionError};
pub use frame::{Frame, FrameError, FrameKind, Header, Limits};
pub use knob::Knob;
pub use server::{Resolved, ServerConfig, ServerHooks, ServerOutput, ServerSession};

/// The protocol versions this build speaks. The handshake picks the highest both sides share.
///
/// Version 2: the handshake carries the application id, the proofs cover the whole
/// transcript, `Ready` carries the live credit grant, credits come back implicitly (with a
/// block's answer, or with its `Release`), and `Attach` bootstraps a data plane.
///
/// Version 3: `FetchRange` asks for byte ranges of blocks (a block larger than any buffer is
/// fetched in pieces), and `Rendezvous` carries the whole block's length.
pub const PROTOCOL_VERSION: u8 = 3;
/// The oldest protocol version this build still accepts (version 2 peers have no range
/// fetch and a shorter `Rendezvous`).
pub const MIN_PROTOCOL_VERSION: u8 = 3;

/// Capability bits exchanged in the handshake; the session uses the intersection.
pub mod caps {
    /// The client can pull rendezvous blocks (always set by this build).
    pub const RENDEZVOUS: u64 = 1 << 0;
    /// The client's provider can do one-sided RDMA READ (verbs).
    pub const RDMA_READ: u64 = 1 << 1;
    /// Batch fetches of contiguous part ranges (Spark's `ShuffleBlockBatchId`).
    pub const BATCH: u64 = 1 << 2;
    /// Every capability this build knows.
    pub const ALL: u64 = RENDEZVOUS | RDMA_READ | BATCH;
}
