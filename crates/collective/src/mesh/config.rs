//! Settings and errors of a mesh.

use super::Proto;
use rdma_shuffle_fabric::memory::pool::PoolConfig;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::Secret;
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// Longest job name accepted in a handshake.
pub const MAX_JOB_LEN: usize = 256;

/// Settings of a mesh. Every rank of a group must use the same `job`, `world` and secret.
#[derive(Clone)]
pub struct MeshConfig {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Name of the group; a connection from another job is refused (it catches two jobs that
    /// picked the same ports).
    pub job: String,
    /// Shared secret; when set, every link is mutually authenticated before any data moves.
    pub secret: Option<Secret>,
    /// Limit for building the mesh (all peers connected and authenticated).
    pub connect_timeout: Duration,
    /// Limit for one connection's handshake, from accept (or connect) to authenticated.
    /// A connection that has not proved the secret by then is dropped, so a stranger that
    /// connects and says nothing holds nothing for long.
    pub handshake_timeout: Duration,
    /// Largest eager message in bytes. On verbs it must fit the provider's message buffers
    /// (64 KiB + 4 KiB by default, minus the frame header).
    pub eager_limit: usize,
    /// Largest single message (rendezvous) in bytes; callers segment larger buffers.
    pub max_message: usize,
    /// Receive buffers (registered with the provider) for messages that arrive before their
    /// receive is posted. `cap_bytes` bounds what peers can have in flight towards this rank;
    /// at the cap a link stops reading (backpressure) until buffers come back.
    pub pool: PoolConfig,
    /// Kept for compatibility: waits for memory are bounded by each call's deadline now.
    pub memory_timeout: Duration,
    /// Keep registrations of user buffers after their last use (see [`Mesh::register`](super::Mesh::register)).
    pub cache_registrations: bool,
    /// Bytes of user memory the registration cache keeps registered at most.
    pub cache_bytes: usize,
}

impl fmt::Debug for MeshConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeshConfig")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("job", &self.job)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("connect_timeout", &self.connect_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("eager_limit", &self.eager_limit)
            .field("max_message", &self.max_message)
            .field("pool", &self.pool)
            .finish()
    }
}

impl MeshConfig {
    /// Defaults for `rank` of `world`: 64 KiB eager limit, 16 MiB messages, a 1 GiB receive
    /// pool cap (mapped lazily), 30 s limits (10 s per handshake), no secret.
    pub fn new(rank: usize, world: usize) -> Self {
        MeshConfig {
            rank,
            world,
            job: "mobius".into(),
            secret: None,
            connect_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            eager_limit: 64 * 1024,
            max_message: 16 << 20,
            pool: PoolConfig { cap_bytes: 1 << 30, ..PoolConfig::default() },
            memory_timeout: Duration::from_secs(30),
            cache_registrations: false,
            cache_bytes: 1 << 30,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), MeshError> {
        let bad = |m: String| Err(MeshError::Config(m));
        if self.world == 0 {
            return bad("world size is 0".into());
        }
        if self.rank >= self.world {
            return bad(format!("rank {} is outside the world of {} ranks", self.rank, self.world));
        }
        if self.job.len() > MAX_JOB_LEN {
            return bad(format!("job name of {} bytes is longer than {MAX_JOB_LEN}", self.job.len()));
        }
        if self.eager_limit == 0 || self.eager_limit > u32::MAX as usize {
            return bad(format!("eager limit {} must be between 1 and {} (MOBIUS_EAGER_LIMIT)", self.eager_limit, u32::MAX));
        }
        if self.max_message < self.eager_limit {
            return bad(format!(
                "max message {} is below the eager limit {} (MOBIUS_MAX_MESSAGE, MOBIUS_EAGER_LIMIT)",
                self.max_message, self.eager_limit
            ));
        }
        if self.max_message as u64 > self.pool.cap_bytes {
            return bad(format!(
                "max message {} exceeds the receive pool cap {}; raise the pool cap (MOBIUS_POOL_BYTES)",
                self.max_message, self.pool.cap_bytes
            ));
        }
        self.pool.validate().map_err(|e| MeshError::Config(e.to_string()))
    }
}

/// What went wrong in the mesh. Every variant that involves a peer names its rank.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeshError {
    /// The configuration cannot work; the message names the field.
    #[error("mesh configuration: {0}")]
    Config(String),
    /// Binding the listener failed.
    #[error("rank {rank}: cannot listen on {addr}: {source}")]
    Listen {
        /// This rank.
        rank: usize,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: FabricError,
    },
    /// Building the mesh did not finish in time.
    #[error(
        "rank {rank}: no connection with rank(s) {missing:?} after {waited_ms} ms{details} \
         (is every rank started with the same world size and job? raise the timeout with MOBIUS_TIMEOUT)"
    )]
    ConnectTimeout {
        /// This rank.
        rank: usize,
        /// Ranks that never connected.
        missing: Vec<usize>,
        /// The limit.
        waited_ms: u64,
        /// Refusals and failures seen meanwhile.
        details: String,
    },
    /// A peer failed the handshake (wrong job, world, secret, version).
    #[error("rank {rank}: handshake with rank {peer} ({addr}) failed: {reason}")]
    Handshake {
        /// This rank.
        rank: usize,
        /// The peer's rank (or what it claimed).
        peer: usize,
        /// Its address.
        addr: String,
        /// What did not match, and what to change.
        reason: String,
    },
    /// The link to a peer failed (the peer process died, the connection reset).
    #[error("rank {rank}: rank {peer} failed (its link, {addr}): {reason}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// Its address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The peer closed its mesh (a clean departure) while this rank still needed it.
    #[error("rank {rank}: rank {peer} has closed its communicator")]
    PeerLeft {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
    },
    /// A peer gave up (an error it saw) and told every rank; or this rank's loop saw a link
    /// die and gave up for the group.
    ///
    /// `culprit` is the rank whose failure caused it, when that is known (a link to it
    /// died): the message then leads with that rank, so no survivor blames another
    /// survivor. Without one (the rank that aborted only timed out, or its caller gave up),
    /// `peer` — the rank this one was exchanging with when the news came — is the likelier
    /// culprit, and the message names both.
    #[error("{}", aborted_message(*rank, *by, *culprit, *peer, reason))]
    Aborted {
        /// This rank.
        rank: usize,
        /// The rank that aborted.
        by: usize,
        /// The rank whose failure caused the abort, when known.
        culprit: Option<usize>,
        /// The peer this rank was sending to or waiting on.
        peer: usize,
        /// Its reason.
        reason: String,
    },
    /// Nothing arrived from a peer before the deadline.
    #[error("rank {rank}: timed out after {waited_ms} ms waiting for {what} from rank {peer} (raise MOBIUS_TIMEOUT if it is only slow)")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The awaited peer.
        peer: usize,
        /// What was awaited.
        what: &'static str,
        /// How long.
        waited_ms: u64,
    },
    /// A message is larger than the protocol allows.
    #[error("rank {rank}: a {proto} message of {len} bytes to rank {peer} exceeds the limit of {limit} bytes ({setting})")]
    TooLarge {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The protocol.
        proto: Proto,
        /// The length.
        len: usize,
        /// The limit.
        limit: usize,
        /// The setting that raises it.
        setting: &'static str,
    },
    /// Registered memory could not be had.
    #[error("rank {rank}: {message}")]
    Memory {
        /// This rank.
        rank: usize,
        /// What failed, with the setting to change.
        message: String,
    },
    /// A call named a rank that is not a peer.
    #[error("rank {rank}: {peer} is not a peer rank (world of {world})")]
    BadPeer {
        /// This rank.
        rank: usize,
        /// The rank asked for.
        peer: usize,
        /// The world size.
        world: usize,
    },
    /// The mesh was closed.
    #[error("rank {rank}: the mesh is closed")]
    Closed {
        /// This rank.
        rank: usize,
    },
}

fn aborted_message(rank: usize, by: usize, culprit: Option<usize>, peer: usize, reason: &str) -> String {
    match culprit {
        // The reason says who saw it ("rank {by}: link to rank {c} ... failed: ...").
        Some(c) => format!("rank {rank}: rank {c} failed, so the group is aborted: {reason}"),
        None => format!("rank {rank}: rank {by} aborted while rank {rank} was exchanging with rank {peer}: {reason}"),
    }
}
