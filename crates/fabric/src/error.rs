//! Errors of the fabric layer.

use crate::memory::pool::PoolError;
use crate::providers::codec::CodecError;
use rdma_shuffle_wire::Knob;
use std::io;
use thiserror::Error;

/// What went wrong moving bytes. Every variant names the peer it happened with.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FabricError {
    /// A socket (or device) operation failed.
    #[error("{op} {peer}: {source}")]
    Io {
        /// Peer address or name.
        peer: String,
        /// What was being done ("connect to", "read from", ...).
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer closed the connection (end of stream, peer process gone).
    #[error("connection to {peer} closed by the peer")]
    Closed {
        /// Peer address or name.
        peer: String,
    },
    /// The peer sent bytes that are not a valid frame of the connection's protocol.
    #[error("peer {peer} sent an invalid frame: {source}")]
    Frame {
        /// Peer address or name.
        peer: String,
        /// What the protocol's codec found wrong (its own error type, boxed).
        #[source]
        source: CodecError,
    },
    /// Registered memory could not be had.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// No connection could be made in time.
    #[error("connect to {peer} timed out after {timeout_ms} ms (raise {})", Knob::ConnectTimeout)]
    ConnectTimeout {
        /// Peer address.
        peer: String,
        /// The limit.
        timeout_ms: u64,
    },
    /// A one-sided read was refused by the peer's memory protection: the key names no window
    /// of this peer for this connection (never exposed, another peer's, or released), or the
    /// range lies outside it.
    #[error("remote access error reading from {peer}: {what}")]
    RemoteAccess {
        /// Peer address or name.
        peer: String,
        /// What the check found.
        what: String,
    },
    /// The provider cannot do what was asked (e.g. a one-sided read on tcp).
    #[error("{0}")]
    Unsupported(String),
    /// A provider-specific failure (verbs work-request errors, device setup), with context.
    #[error("{provider} provider: {message}")]
    Provider {
        /// Provider name.
        provider: &'static str,
        /// What failed, with context.
        message: String,
        /// The setting that cures it, where there is one.
        knob: Option<Knob>,
    },
    /// The endpoint was shut down.
    #[error("endpoint is shut down")]
    Shutdown,
}

impl FabricError {
    /// An I/O error while doing `op` with `peer`.
    pub fn io(peer: &str, op: &'static str, source: io::Error) -> Self {
        if matches!(
            source.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionAborted
        ) {
            return FabricError::Closed { peer: peer.to_string() };
        }
        FabricError::Io { peer: peer.to_string(), op, source }
    }

    /// The setting a user changes to cure this error, where there is one.
    pub fn knob(&self) -> Option<Knob> {
        match self {
            FabricError::Pool(p) => p.knob(),
            FabricError::ConnectTimeout { .. } => Some(Knob::ConnectTimeout),
            FabricError::Provider { knob, .. } => *knob,
            _ => None,
        }
    }
}
