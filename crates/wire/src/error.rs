//! Connection-level errors. Per-block failures are [`crate::BlockFailure`]s.

use crate::block::{FailureCode, RegionId};
use crate::frame::{FrameError, FrameKind};
use crate::knob::Knob;
use thiserror::Error;

/// A fatal error of one connection. After it the session is closed: every outstanding block
/// fails, and the connection must be dropped. Other connections are unaffected.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The bytes received are not a valid frame.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A valid frame that is not allowed in the current state.
    #[error("unexpected {kind} frame while {state}")]
    UnexpectedFrame {
        /// Kind received.
        kind: FrameKind,
        /// What the session was doing.
        state: &'static str,
    },
    /// The two sides share no protocol version.
    #[error("no common protocol version: peer speaks {peer_min}..={peer_max}, we speak {our_min}..={our_max}")]
    NoCommonVersion {
        /// Peer's oldest.
        peer_min: u8,
        /// Peer's newest.
        peer_max: u8,
        /// Our oldest.
        our_min: u8,
        /// Our newest.
        our_max: u8,
    },
    /// A proof of the shared secret was wrong or missing, or only one side has a secret.
    #[error("authentication refused: {0} (authentication and its secret must be the same on every peer)")]
    AuthRefused(String),
    /// The peer belongs to another application.
    #[error("the peer belongs to application '{theirs}' but this engine serves application '{ours}'; engines of different applications never exchange blocks")]
    AppMismatch {
        /// Our application id.
        ours: String,
        /// The peer's application id.
        theirs: String,
    },
    /// The peer rejected our handshake or reported a fatal error.
    #[error("peer reported {code}: {message}")]
    PeerError {
        /// Failure kind sent by the peer.
        code: FailureCode,
        /// Peer's message.
        message: String,
    },
    /// The client had more blocks in flight than the server granted.
    #[error("credit exceeded: {requested} more blocks with {outstanding} outstanding, {granted} granted")]
    CreditExceeded {
        /// Blocks in the offending request.
        requested: u32,
        /// Blocks already in flight.
        outstanding: u32,
        /// Credits granted by the server.
        granted: u32,
    },
    /// The server returned more credits than it ever granted.
    #[error("credit overflow: {available} available after a grant of {n}, but only {granted} were ever granted")]
    CreditOverflow {
        /// Credits after the grant.
        available: u64,
        /// The grant.
        n: u32,
        /// The initial grant.
        granted: u32,
    },
    /// A response for a request or block we never sent, or a second response for one block.
    #[error("response for unknown or finished block {index} of request {req}")]
    UnknownBlock {
        /// Request id.
        req: u64,
        /// Block index.
        index: u32,
    },
    /// A pull or release named a region this connection does not hold.
    #[error("unknown region {region}")]
    UnknownRegion {
        /// Region id received.
        region: RegionId,
    },
    /// A pull asked for bytes outside its region, or pull data arrived out of place.
    #[error("pull of region {region} bytes {offset}..{end} is outside its {region_len} bytes or out of order")]
    PullOutOfBounds {
        /// Region id.
        region: RegionId,
        /// Start offset.
        offset: u64,
        /// End offset.
        end: u64,
        /// Region length.
        region_len: u64,
    },
    /// An eager block larger than we allowed.
    #[error("eager block of {len} bytes exceeds the negotiated maximum {max}")]
    EagerTooLarge {
        /// Payload length.
        len: u64,
        /// Negotiated maximum.
        max: u64,
    },
    /// A fetch request with a block range that cannot be valid.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Nothing arrived from the peer within the timeout while we waited for it.
    #[error("no progress for {waited_ms} ms while {what} (timeout {timeout_ms} ms; raise {knob})")]
    Timeout {
        /// What we were waiting for.
        what: &'static str,
        /// How long we waited.
        waited_ms: u64,
        /// The limit.
        timeout_ms: u64,
        /// The setting that sets the limit.
        knob: Knob,
    },
    /// The transport reported the connection gone.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The session was closed locally.
    #[error("connection closed locally")]
    LocallyClosed,
}

impl ProtocolError {
    /// The per-block failure code that blocks outstanding on a connection failed with this
    /// error get.
    pub fn failure_code(&self) -> FailureCode {
        match self {
            ProtocolError::AuthRefused(_) | ProtocolError::AppMismatch { .. } => FailureCode::AuthRefused,
            ProtocolError::PeerError { code, .. } => *code,
            ProtocolError::Timeout { .. } => FailureCode::Timeout,
            ProtocolError::ConnectionLost(_) | ProtocolError::LocallyClosed => FailureCode::PeerGone,
            _ => FailureCode::Protocol,
        }
    }

    /// The setting a user changes to cure this error, where there is one.
    pub fn knob(&self) -> Option<Knob> {
        match self {
            ProtocolError::AuthRefused(_) => Some(Knob::Secret),
            ProtocolError::PeerError { code: FailureCode::AuthRefused, .. } => Some(Knob::Secret),
            ProtocolError::AppMismatch { .. } => Some(Knob::AppId),
            ProtocolError::Timeout { knob, .. } => Some(*knob),
            ProtocolError::EagerTooLarge { .. } => Some(Knob::EagerThreshold),
            _ => None,
        }
    }
}

/// A [`ProtocolError`] with the peer it happened with.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("peer {peer}: {error}")]
pub struct SessionError {
    /// The peer (address, executor id), as given in the session config.
    pub peer: String,
    /// What went wrong.
    pub error: ProtocolError,
}
