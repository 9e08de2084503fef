//! Errors of Mobius. Each names the rank that reports it, the operation, and what to change.

use crate::transport::TransportError;

/// What went wrong in a collective or while setting up a communicator.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// This rank's own arguments are unusable (wrong buffer length, root out of range, ...).
    #[error("rank {rank}: {op}: invalid argument `{argument}`: {message}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// The argument.
        argument: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// Ranks called the same collective with different arguments (or different collectives).
    #[error("rank {rank}: {op} arguments differ from rank {peer}'s: {message}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// This rank's operation.
        op: &'static str,
        /// The rank whose call differs.
        peer: usize,
        /// Which argument differs, with both values.
        message: String,
    },
    /// Moving data failed: a peer died, left, aborted, or was silent past the timeout.
    #[error("rank {rank}: {op} failed: {source}")]
    Transport {
        /// This rank.
        rank: usize,
        /// The operation, algorithm and size.
        op: String,
        /// The cause (names the peer).
        #[source]
        source: TransportError,
    },
    /// Ranks could not meet (store unreachable, a rank never joined, handshake refused).
    #[error("rank {rank}: rendezvous failed: {message}")]
    Rendezvous {
        /// This rank.
        rank: usize,
        /// What failed, naming the store address, missing ranks and the setting to change.
        message: String,
    },
    /// The communicator failed earlier and cannot be used again.
    #[error("rank {rank}: the communicator is unusable after an earlier failure ({first}); create a new one")]
    Broken {
        /// This rank.
        rank: usize,
        /// The first failure.
        first: String,
    },
    /// A monitored barrier failed: on rank 0, the ranks that did not arrive in time; on the
    /// others, that rank 0 did not release them.
    #[error("rank {rank}: monitored barrier: {message}")]
    MonitoredBarrier {
        /// This rank.
        rank: usize,
        /// Which ranks failed to arrive (rank 0), or that rank 0 never released this one.
        message: String,
    },
    /// A setting is invalid; the message names it.
    #[error("invalid Mobius setting: {0}")]
    Config(String),
}

impl CollectiveError {
    /// Whether the error came from another rank's abort (so this rank need not abort too).
    /// The rank whose failure this error comes from, when that is known: the peer whose
    /// link died or who left, or the culprit an abort named.
    pub fn culprit(&self) -> Option<usize> {
        use crate::transport::TransportErrorKind as K;
        match self {
            CollectiveError::Transport { source, .. } => match source.kind {
                K::PeerFailed { peer } | K::PeerLeft { peer } => Some(peer),
                K::Aborted { culprit, .. } => culprit,
                _ => None,
            },
            _ => None,
        }
    }

    pub(crate) fn is_remote_abort(&self) -> bool {
        matches!(self, CollectiveError::Transport { source, .. } if matches!(source.kind, crate::transport::TransportErrorKind::Aborted { .. }))
    }
}
