//! Mesh: persistent all-to-all links among the N ranks of a collective group.
//!
//! A collective (allreduce, allgather, ...) is a different shape from a shuffle fetch: every
//! rank talks to a fixed set of peers for the life of the group, messages are matched by a
//! tag rather than requested, and a ring step sends and receives at the same time. This
//! module gives collectives that shape on top of any [`Provider`] (tcp, sim, verbs), and is
//! the only place where the collective library touches providers:
//!
//! * [`MeshListener::bind`] opens the rank's listener; its address is published to the other
//!   ranks (through a store, which is the caller's business);
//! * [`Mesh::connect`] builds one link per pair of ranks (the higher rank connects to the lower
//!   one), runs a handshake that checks job name, world size and ranks, and, with a shared
//!   secret, authenticates both sides with HMAC-SHA256 over the whole handshake transcript;
//! * [`Mesh::send`] / [`Mesh::recv`] move tagged messages. Every link has a reader thread that
//!   drains it into per-peer inboxes, so sends never wait for the receiving *collective* to
//!   reach the matching `recv`: links are full duplex and several messages may be in flight
//!   per peer (pipelined segments).
//!
//! # Protocols
//!
//! * **Eager** ([`Proto::Eager`], up to [`MeshConfig::eager_limit`] bytes): the bytes travel
//!   inline in one message; the receiver's reader thread places them in a buffer from the
//!   mesh's [`TieredPool`] (registered memory on verbs).
//! * **Rendezvous** ([`Proto::Rendezvous`], up to [`MeshConfig::max_message`] bytes):
//!   - on providers with one-sided reads (verbs, sim): the sender exposes its *own* buffer
//!     (registered through the [registration cache](Mesh::register)) and sends a small
//!     request-to-send with `{addr, rkey, len}`; the receiver RDMA READs the bytes straight
//!     into a pool buffer and answers `DONE`, after which the sender may reuse its buffer
//!     ([`Mesh::wait`]). The sender never copies the payload.
//!   - on stream providers (tcp): the whole buffer is written to the socket in one go from
//!     the caller's memory (`writev`, no copy) and streamed by the receiver into one pool
//!     buffer of the message's size.
//!
//!   The current `Link` API has no RDMA WRITE and places received payloads only into pool
//!   leases, so rendezvous is READ-based and the last hop into the user's buffer is the
//!   caller's copy or reduction. See the crate README for what the event-loop driver port
//!   should add (a placement into caller memory, WRITE with immediate).
//!
//! # Failures
//!
//! Nothing waits without a deadline. A link that fails (peer process died, connection reset)
//! marks its peer failed at once and wakes every waiter on it with an error naming the rank;
//! [`Mesh::abort`] tells every peer that this rank gave up (so ranks blocked on a third rank
//! fail fast instead of waiting out their timeout); a rank that closes its mesh cleanly sends
//! `BYE` first, so its peers can tell a departure from a crash.
//!
//! # Wire format
//!
//! Mesh messages are `wire` frames, so every provider carries them unchanged: eager data and
//! control messages travel as [`Frame::Eager`] (`req` = tag, `index` = message kind), tcp
//! rendezvous payloads as [`Frame::PullData`] (`region` = tag).

use crate::error::FabricError;
use crate::link::{Link, Listener, Payload, Placement, Provider, Received, Source, SourceKeys};
use crate::pool::{Lease, PoolConfig, PoolError, TieredPool};
use hmac::{Hmac, Mac};
use parking_lot::{Condvar, Mutex};
use rdma_shuffle_wire::{Descriptor, Frame, Limits, Secret};
use sha2::Sha256;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// A message tag. Its meaning belongs to the caller (collectives pack a call sequence
/// number, a step and a segment into it); the mesh only matches it.
pub type Tag = u64;

/// Version of the mesh handshake; both sides must speak the same.
const MESH_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"MOBIUSv1";
/// Upper 16 bits of the `index` of every mesh frame; lets a reader reject stray traffic.
const KIND_MARK: u32 = 0x4d42_0000;
const KIND_HELLO: u32 = KIND_MARK | 1;
const KIND_WELCOME: u32 = KIND_MARK | 2;
const KIND_PROOF: u32 = KIND_MARK | 3;
const KIND_READY: u32 = KIND_MARK | 4;
const KIND_REFUSE: u32 = KIND_MARK | 5;
const KIND_DATA: u32 = KIND_MARK | 16;
const KIND_RTS: u32 = KIND_MARK | 17;
const KIND_DONE: u32 = KIND_MARK | 18;
const KIND_ABORT: u32 = KIND_MARK | 19;
const KIND_BYE: u32 = KIND_MARK | 20;
/// Largest handshake or control message (hello with a job name, abort reasons).
const CONTROL_MAX: usize = 4096;
const PROOF_LEN: usize = 32;
const NONCE_LEN: usize = 16;
/// Longest job name accepted in a handshake.
pub const MAX_JOB_LEN: usize = 256;
/// Pause between connection attempts to a peer whose listener refused.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

type HmacSha256 = Hmac<Sha256>;

/// How [`Mesh::send`] moves a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    /// Inline copy through pool buffers; at most [`MeshConfig::eager_limit`] bytes.
    Eager,
    /// Zero-copy from the sender's buffer (one-sided READ on verbs/sim, streamed on tcp).
    Rendezvous,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Eager => "eager",
            Proto::Rendezvous => "rendezvous",
        })
    }
}

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
    /// Largest eager message in bytes. On verbs it must stay below the provider's
    /// `max_message` (64 KiB + 4 KiB by default) minus the frame header.
    pub eager_limit: usize,
    /// Largest single message (rendezvous) in bytes; callers segment larger buffers.
    pub max_message: usize,
    /// Receive buffers (registered with the provider). `cap_bytes` bounds what peers can
    /// have in flight towards this rank; readers wait for memory (backpressure) at the cap.
    pub pool: PoolConfig,
    /// How long a reader waits for pool memory before it fails its link.
    pub memory_timeout: Duration,
    /// Keep registrations of user buffers after their last use (see [`Mesh::register`]).
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
            .field("eager_limit", &self.eager_limit)
            .field("max_message", &self.max_message)
            .field("pool", &self.pool)
            .finish()
    }
}

impl MeshConfig {
    /// Defaults for `rank` of `world`: 64 KiB eager limit, 16 MiB messages, a 1 GiB receive
    /// pool cap (mapped lazily), 30 s limits, no secret.
    pub fn new(rank: usize, world: usize) -> Self {
        MeshConfig {
            rank,
            world,
            job: "mobius".into(),
            secret: None,
            connect_timeout: Duration::from_secs(30),
            eager_limit: 64 * 1024,
            max_message: 16 << 20,
            pool: PoolConfig { cap_bytes: 1 << 30, ..PoolConfig::default() },
            memory_timeout: Duration::from_secs(30),
            cache_registrations: false,
            cache_bytes: 1 << 30,
        }
    }

    fn validate(&self) -> Result<(), MeshError> {
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
            return bad(format!("eager limit {} must be between 1 and {}", self.eager_limit, u32::MAX));
        }
        if self.max_message < self.eager_limit {
            return bad(format!("max message {} is below the eager limit {}", self.max_message, self.eager_limit));
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
    #[error("rank {rank}: link to rank {peer} ({addr}) failed: {reason}")]
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
    /// A peer gave up (an error it saw) and told every rank.
    #[error("rank {rank}: rank {by} aborted: {reason}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The rank that aborted.
        by: usize,
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

/// A listening endpoint of one rank, bound before the mesh is built so its address can be
/// published to the other ranks first.
pub struct MeshListener {
    provider: Arc<dyn Provider>,
    listener: Box<dyn Listener>,
}

impl MeshListener {
    /// Listens on `addr` (port 0 picks a free port) with `provider`.
    pub fn bind(provider: Arc<dyn Provider>, addr: SocketAddr, rank: usize) -> Result<Self, MeshError> {
        let listener = provider.listen(addr).map_err(|source| MeshError::Listen { rank, addr, source })?;
        Ok(MeshListener { provider, listener })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }
}

/// One received message: a pool buffer (or nothing, for an empty message). Dropping it
/// returns the buffer to the pool.
pub struct Message {
    lease: Option<Lease>,
    proto: Proto,
}

impl Message {
    /// How the message came.
    pub fn proto(&self) -> Proto {
        self.proto
    }
}

impl Deref for Message {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.lease {
            Some(l) => l,
            None => &[],
        }
    }
}

impl AsRef<[u8]> for Message {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Message({} bytes, {})", self.len(), self.proto)
    }
}

/// A posted send. It borrows the sent bytes until the send completes: [`Mesh::wait`] it to
/// learn the outcome; dropping it unwaited also waits (up to the mesh's memory timeout), so
/// the bytes are never released while a peer may still read them.
#[must_use = "wait for a send to learn whether it completed"]
pub struct SendTicket<'a> {
    peer: usize,
    /// For a one-sided rendezvous send, which completes when the peer says `DONE`: the token
    /// and the mesh to wait on.
    pending: Option<(u64, Arc<Shared>)>,
    /// A registration made for this send alone, released once it completes.
    _temporary: Option<Registration>,
    _data: PhantomData<&'a [u8]>,
}

impl SendTicket<'_> {
    fn done(peer: usize) -> Self {
        SendTicket { peer, pending: None, _temporary: None, _data: PhantomData }
    }

    /// Whether the send already completed when it was posted (eager, or streamed on tcp).
    pub fn is_complete(&self) -> bool {
        self.pending.is_none()
    }
}

impl Drop for SendTicket<'_> {
    fn drop(&mut self) {
        if let Some((token, shared)) = self.pending.take() {
            let deadline = Instant::now() + shared.memory_timeout;
            if let Err(e) = shared.wait_done(self.peer, token, deadline) {
                debug!(error = %e, "an unwaited rendezvous send did not complete");
            }
        }
    }
}

impl fmt::Debug for SendTicket<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SendTicket(peer {}, {:?})", self.peer, self.pending.as_ref().map(|p| p.0))
    }
}

/// Counters of one mesh (monotonic since it was built).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MeshStats {
    /// Eager messages sent.
    pub eager_sent: u64,
    /// Payload bytes of eager messages sent.
    pub eager_sent_bytes: u64,
    /// Rendezvous messages sent.
    pub rendezvous_sent: u64,
    /// Payload bytes of rendezvous messages sent.
    pub rendezvous_sent_bytes: u64,
    /// Eager messages received.
    pub eager_received: u64,
    /// Payload bytes of eager messages received.
    pub eager_received_bytes: u64,
    /// Rendezvous messages received (READ or streamed).
    pub rendezvous_received: u64,
    /// Payload bytes of rendezvous messages received.
    pub rendezvous_received_bytes: u64,
    /// One-sided READs this rank performed for rendezvous receives.
    pub reads: u64,
    /// Registration cache hits.
    pub registration_hits: u64,
    /// User-buffer registrations made (cache misses).
    pub registrations: u64,
}

#[derive(Default)]
struct Counters {
    eager_sent: AtomicU64,
    eager_sent_bytes: AtomicU64,
    rendezvous_sent: AtomicU64,
    rendezvous_sent_bytes: AtomicU64,
    eager_received: AtomicU64,
    eager_received_bytes: AtomicU64,
    rendezvous_received: AtomicU64,
    rendezvous_received_bytes: AtomicU64,
    reads: AtomicU64,
    registration_hits: AtomicU64,
    registrations: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

#[derive(Clone, Debug)]
enum PeerStatus {
    Up,
    Left,
    Failed(String),
}

struct State {
    inbox: Vec<HashMap<Tag, VecDeque<Message>>>,
    peers: Vec<PeerStatus>,
    done: HashSet<(usize, u64)>,
    abort: Option<(usize, String)>,
    closed: bool,
}

struct Shared {
    rank: usize,
    world: usize,
    provider: Arc<dyn Provider>,
    links: Vec<Option<Arc<dyn Link>>>,
    names: Vec<String>,
    pool: TieredPool,
    limits: Limits,
    eager_limit: usize,
    max_message: usize,
    memory_timeout: Duration,
    one_sided: bool,
    state: Mutex<State>,
    cond: Condvar,
    next_token: AtomicU64,
    counters: Counters,
    regs: Mutex<RegCache>,
}

/// Persistent links to every other rank of a group, with tagged send and receive.
///
/// `send`, `recv` and `wait` may be called from several threads; messages between one pair of
/// ranks are delivered in the order they were sent.
pub struct Mesh {
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mesh(rank {} of {}, {})", self.shared.rank, self.shared.world, self.shared.provider.name())
    }
}

// ---------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------

struct Hello {
    world: u32,
    from: u32,
    to: u32,
    auth: bool,
    nonce: [u8; NONCE_LEN],
    job: String,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.job.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&MESH_VERSION.to_be_bytes());
        b.extend_from_slice(&self.world.to_be_bytes());
        b.extend_from_slice(&self.from.to_be_bytes());
        b.extend_from_slice(&self.to.to_be_bytes());
        b.push(self.auth as u8);
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&(self.job.len() as u16).to_be_bytes());
        b.extend_from_slice(self.job.as_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Hello, String> {
        let mut r = Reader(b);
        if r.take(8)? != MAGIC {
            return Err("not a Mobius mesh peer (bad magic)".into());
        }
        let version = r.u32()?;
        if version != MESH_VERSION {
            return Err(format!("mesh protocol version {version}, this rank speaks {MESH_VERSION}; use the same Mobius build"));
        }
        let world = r.u32()?;
        let from = r.u32()?;
        let to = r.u32()?;
        let auth = r.take(1)?[0] != 0;
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(r.take(NONCE_LEN)?);
        let n = u16::from_be_bytes(r.take(2)?.try_into().unwrap_or([0; 2])) as usize;
        if n > MAX_JOB_LEN {
            return Err(format!("job name of {n} bytes"));
        }
        let job = String::from_utf8(r.take(n)?.to_vec()).map_err(|_| "job name is not UTF-8".to_string())?;
        Ok(Hello { world, from, to, auth, nonce, job })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated handshake message".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().map_err(|_| "truncated".to_string())?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().map_err(|_| "truncated".to_string())?))
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut n);
    n
}

/// HMAC-SHA256 over a label and the handshake transcript. `Secret` keeps its bytes private,
/// so the key is derived from the secret's own proof function over fixed nonces: a value only
/// holders of the secret can compute, and different from any shuffle-handshake proof (those
/// use fresh random nonces).
fn proof(secret: &Secret, label: &[u8], parts: &[&[u8]]) -> [u8; PROOF_LEN] {
    let key = secret.client_proof(b"mobius-mesh-key\0", b"mobius-mesh-kdf\0");
    let mut mac = match HmacSha256::new_from_slice(&key) {
        Ok(m) => m,
        // HMAC takes keys of any length.
        Err(_) => return [0u8; PROOF_LEN],
    };
    mac.update(label);
    for p in parts {
        mac.update(&(p.len() as u32).to_be_bytes());
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

fn verify(secret: &Secret, label: &[u8], parts: &[&[u8]], got: &[u8]) -> bool {
    let want = proof(secret, label, parts);
    // Constant-time comparison.
    got.len() == PROOF_LEN && want.iter().zip(got).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

fn handshake_limits() -> Limits {
    Limits { max_control: CONTROL_MAX as u32, max_eager: CONTROL_MAX as u32, max_pull: 0, max_blocks_per_fetch: 0 }
}

/// Receives one handshake message of `kind` (or a refusal) on `link`.
fn recv_control(link: &dyn Link, scratch: &TieredPool, want: u32) -> Result<Vec<u8>, String> {
    let mut place = |f: &Frame| match f {
        Frame::Eager { len, .. } => match scratch.acquire(*len as usize, None) {
            Ok(lease) => Placement::Into { lease, at: 0 },
            Err(e) => Placement::Abort(FabricError::Pool(e)),
        },
        _ => Placement::Discard,
    };
    let Received { frame, payload } = link.recv(&handshake_limits(), &mut place).map_err(|e| e.to_string())?;
    let body = payload.map(|l| l.to_vec()).unwrap_or_default();
    match frame {
        Frame::Eager { index, .. } if index == want => Ok(body),
        Frame::Eager { index: KIND_REFUSE, .. } => Err(format!("refused: {}", String::from_utf8_lossy(&body))),
        other => Err(format!("unexpected {:?} frame during the handshake", other.kind())),
    }
}

fn send_control(link: &dyn Link, kind: u32, body: &[u8]) -> Result<(), String> {
    link.send(&Frame::Eager { req: 0, index: kind, len: body.len() as u32 }, Payload::Bytes(body)).map_err(|e| e.to_string())
}

struct Handshaker {
    rank: usize,
    world: usize,
    job: String,
    secret: Option<Secret>,
    scratch: TieredPool,
}

impl Handshaker {
    /// Client side (this rank connected to the lower rank `to`). A refusal of ours is told
    /// to the peer, so its error says why too.
    fn client(&self, link: &dyn Link, to: usize) -> Result<(), String> {
        self.client_steps(link, to).map_err(|why| {
            if !why.starts_with("refused") {
                let _ = send_control(link, KIND_REFUSE, format!("rank {} refused rank {to}: {why}", self.rank).as_bytes());
                link.flush_sends(Duration::from_millis(200));
            }
            why
        })
    }

    fn client_steps(&self, link: &dyn Link, to: usize) -> Result<(), String> {
        let hello = Hello {
            world: self.world as u32,
            from: self.rank as u32,
            to: to as u32,
            auth: self.secret.is_some(),
            nonce: nonce(),
            job: self.job.clone(),
        }
        .encode();
        send_control(link, KIND_HELLO, &hello)?;
        let welcome = recv_control(link, &self.scratch, KIND_WELCOME)?;
        if welcome.len() < PROOF_LEN {
            return Err("truncated welcome".into());
        }
        let (fields, server_proof) = welcome.split_at(welcome.len() - PROOF_LEN);
        let w = Hello::decode(fields)?;
        if w.from as usize != to || w.to as usize != self.rank || w.world as usize != self.world || w.job != self.job {
            return Err(format!(
                "it answered as rank {} of world {} in job {:?} (expected rank {to} of world {} in job {:?})",
                w.from, w.world, w.job, self.world, self.job
            ));
        }
        let my_proof = match (&self.secret, w.auth) {
            (Some(s), true) => {
                if !verify(s, b"mobius-mesh server", &[&hello, fields], server_proof) {
                    return Err(
                        "it does not know the shared secret (server proof invalid); set the same MOBIUS_SECRET on every rank"
                            .into(),
                    );
                }
                proof(s, b"mobius-mesh client", &[&hello, &welcome])
            }
            (Some(_), false) => {
                return Err(
                    "it runs without a shared secret but this rank requires one; set the same MOBIUS_SECRET on every rank".into(),
                )
            }
            (None, true) => {
                return Err("it requires a shared secret and this rank has none; set the same MOBIUS_SECRET on every rank".into())
            }
            (None, false) => [0u8; PROOF_LEN],
        };
        send_control(link, KIND_PROOF, &my_proof)?;
        recv_control(link, &self.scratch, KIND_READY)?;
        Ok(())
    }

    /// Server side: returns the authenticated peer rank.
    fn server(&self, link: &dyn Link) -> Result<usize, (Option<usize>, String)> {
        let hello = recv_control(link, &self.scratch, KIND_HELLO).map_err(|e| (None, e))?;
        let h = Hello::decode(&hello).map_err(|e| (None, e))?;
        let from = h.from as usize;
        let refuse = |why: String| {
            let _ = send_control(link, KIND_REFUSE, why.as_bytes());
            link.flush_sends(Duration::from_millis(200));
            Err((Some(from), why))
        };
        if h.job != self.job {
            return refuse(format!("job {:?} connected to job {:?}", h.job, self.job));
        }
        if h.world as usize != self.world {
            return refuse(format!(
                "world size {} differs from this rank's {} (set WORLD_SIZE alike on every rank)",
                h.world, self.world
            ));
        }
        if h.to as usize != self.rank || from <= self.rank || from >= self.world {
            return refuse(format!("a connection claiming rank {} for rank {} reached rank {}", h.from, h.to, self.rank));
        }
        match (&self.secret, h.auth) {
            (Some(_), false) => {
                return refuse(
                    "this rank requires a shared secret and the peer has none; set the same MOBIUS_SECRET on every rank".into(),
                )
            }
            (None, true) => {
                return refuse(
                    "the peer requires a shared secret and this rank has none; set the same MOBIUS_SECRET on every rank".into(),
                )
            }
            _ => {}
        }
        let fields = Hello {
            world: self.world as u32,
            from: self.rank as u32,
            to: from as u32,
            auth: self.secret.is_some(),
            nonce: nonce(),
            job: self.job.clone(),
        }
        .encode();
        let server_proof = match &self.secret {
            Some(s) => proof(s, b"mobius-mesh server", &[&hello, &fields]),
            None => [0u8; PROOF_LEN],
        };
        let mut welcome = fields.clone();
        welcome.extend_from_slice(&server_proof);
        send_control(link, KIND_WELCOME, &welcome).map_err(|e| (Some(from), e))?;
        let client_proof = recv_control(link, &self.scratch, KIND_PROOF).map_err(|e| (Some(from), e))?;
        if let Some(s) = &self.secret {
            if !verify(s, b"mobius-mesh client", &[&hello, &welcome], &client_proof) {
                return refuse("authentication failed: the peer does not know the shared secret (MOBIUS_SECRET differs)".into());
            }
        }
        send_control(link, KIND_READY, &[]).map_err(|e| (Some(from), e))?;
        Ok(from)
    }
}

// ---------------------------------------------------------------------------------------
// Building the mesh
// ---------------------------------------------------------------------------------------

enum Joined {
    Link(usize, Arc<dyn Link>),
    Refused(Option<usize>, String),
}

impl Mesh {
    /// Builds the mesh: connects to every lower rank at `addrs[r]`, accepts every higher rank
    /// on `listener`, and authenticates each link. `addrs[config.rank]` is ignored (it is this
    /// rank's own listener). Fails with [`MeshError::ConnectTimeout`] naming the ranks that did
    /// not join within `config.connect_timeout`.
    pub fn connect(listener: MeshListener, addrs: &[SocketAddr], config: MeshConfig) -> Result<Mesh, MeshError> {
        config.validate()?;
        let (rank, world) = (config.rank, config.world);
        if addrs.len() != world {
            return Err(MeshError::Config(format!("{} peer addresses for a world of {world}", addrs.len())));
        }
        let provider = listener.provider.clone();
        let pool = TieredPool::new(config.pool.clone(), provider.registrar())
            .map_err(|e| MeshError::Memory { rank, message: format!("receive pool: {e}") })?;
        let scratch = TieredPool::unregistered(PoolConfig {
            tiers: vec![CONTROL_MAX],
            slab_bytes: 16 * CONTROL_MAX,
            cap_bytes: 64 * CONTROL_MAX as u64,
            prealloc: false,
        })
        .map_err(|e| MeshError::Config(e.to_string()))?;
        let hs = Arc::new(Handshaker { rank, world, job: config.job.clone(), secret: config.secret.clone(), scratch });
        let deadline = Instant::now() + config.connect_timeout;
        let (tx, rx) = crossbeam_channel::unbounded::<Joined>();
        // Every link made during set-up, so a timeout can shut them all (which ends the
        // handshake threads blocked in `recv`).
        let pending: Arc<Mutex<Vec<Arc<dyn Link>>>> = Arc::default();
        let listener = Arc::new(listener.listener);
        let expected_accepts = world - 1 - rank;
        let mut threads = Vec::new();
        if expected_accepts > 0 {
            let (listener, tx, hs, pending) = (listener.clone(), tx.clone(), hs.clone(), pending.clone());
            threads.push(std::thread::Builder::new().name(format!("mobius-accept-{rank}")).spawn(move || {
                while let Ok(link) = listener.accept() {
                    let link: Arc<dyn Link> = Arc::from(link);
                    pending.lock().push(link.clone());
                    let (tx, hs) = (tx.clone(), hs.clone());
                    let _ = std::thread::Builder::new().name("mobius-handshake".into()).spawn(move || {
                        let joined = match hs.server(&*link) {
                            Ok(peer) => Joined::Link(peer, link),
                            Err((peer, why)) => {
                                link.shutdown();
                                Joined::Refused(peer, format!("connection from {}: {why}", link.peer()))
                            }
                        };
                        let _ = tx.send(joined);
                    });
                }
            }));
        }
        for (to, &addr) in addrs.iter().enumerate().take(rank) {
            let (tx, hs, pending, provider) = (tx.clone(), hs.clone(), pending.clone(), provider.clone());
            threads.push(std::thread::Builder::new().name(format!("mobius-connect-{to}")).spawn(move || {
                let joined = loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match provider.connect(addr, left.max(Duration::from_millis(1))) {
                        Ok(link) => {
                            let link: Arc<dyn Link> = Arc::from(link);
                            pending.lock().push(link.clone());
                            break match hs.client(&*link, to) {
                                Ok(()) => Joined::Link(to, link),
                                Err(why) => {
                                    link.shutdown();
                                    Joined::Refused(Some(to), format!("connecting to {addr}: {why}"))
                                }
                            };
                        }
                        Err(e) if Instant::now() + CONNECT_RETRY < deadline => {
                            debug!(to, %addr, error = %e, "mesh connect failed; retrying");
                            std::thread::sleep(CONNECT_RETRY);
                        }
                        Err(e) => break Joined::Refused(Some(to), format!("connecting to {addr}: {e}")),
                    }
                };
                let _ = tx.send(joined);
            }));
        }
        drop(tx);
        let mut links: Vec<Option<Arc<dyn Link>>> = vec![None; world];
        let mut problems: Vec<String> = Vec::new();
        let mut fatal: Option<MeshError> = None;
        let mut joined = 0;
        while joined < world - 1 {
            match rx.recv_deadline(deadline) {
                Ok(Joined::Link(peer, link)) => {
                    if links[peer].is_some() {
                        warn!(rank, peer, "second connection from the same rank; dropping it");
                        link.shutdown();
                        continue;
                    }
                    links[peer] = Some(link);
                    joined += 1;
                }
                Ok(Joined::Refused(peer, why)) => {
                    warn!(rank, ?peer, why = %why, "mesh connection refused");
                    // A lower rank refusing us is final (we do not reconnect); a bad
                    // incoming connection may be a stray and the right peer may still come.
                    if let Some(p) = peer.filter(|p| *p < rank) {
                        fatal = Some(MeshError::Handshake { rank, peer: p, addr: addrs[p].to_string(), reason: why });
                        break;
                    }
                    problems.push(why);
                }
                Err(_) => break,
            }
        }
        listener.shutdown();
        if joined < world - 1 || fatal.is_some() {
            for l in pending.lock().iter() {
                l.shutdown();
            }
            for t in threads.into_iter().flatten() {
                let _ = t.join();
            }
            if let Some(e) = fatal {
                return Err(e);
            }
            let missing = (0..world).filter(|&p| p != rank && links[p].is_none()).collect();
            let details = if problems.is_empty() { String::new() } else { format!(" ({})", problems.join("; ")) };
            return Err(MeshError::ConnectTimeout {
                rank,
                missing,
                waited_ms: config.connect_timeout.as_millis() as u64,
                details,
            });
        }
        for t in threads.into_iter().flatten() {
            let _ = t.join();
        }
        // Connections that never became mesh links (strays, refused duplicates) are closed,
        // which also ends their handshake threads.
        for l in pending.lock().iter() {
            if !links.iter().flatten().any(|m| Arc::ptr_eq(m, l)) {
                l.shutdown();
            }
        }
        let one_sided = links.iter().flatten().all(|l| l.one_sided_read());
        let names = links
            .iter()
            .enumerate()
            .map(|(p, l)| l.as_ref().map(|l| l.peer().to_string()).unwrap_or_else(|| format!("rank {p}")))
            .collect();
        let shared = Arc::new(Shared {
            rank,
            world,
            provider,
            links,
            names,
            pool,
            limits: Limits {
                max_control: CONTROL_MAX as u32,
                max_eager: config.eager_limit.max(CONTROL_MAX) as u32,
                max_pull: config.max_message as u64,
                max_blocks_per_fetch: 0,
            },
            eager_limit: config.eager_limit,
            max_message: config.max_message,
            memory_timeout: config.memory_timeout,
            one_sided,
            state: Mutex::new(State {
                inbox: (0..world).map(|_| HashMap::new()).collect(),
                peers: vec![PeerStatus::Up; world],
                done: HashSet::new(),
                abort: None,
                closed: false,
            }),
            cond: Condvar::new(),
            next_token: AtomicU64::new(1),
            counters: Counters::default(),
            regs: Mutex::new(RegCache::new(config.cache_registrations, config.cache_bytes)),
        });
        let mut readers = Vec::new();
        for peer in 0..world {
            if peer == rank {
                continue;
            }
            let s = shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("mobius-rx-{rank}-{peer}"))
                .spawn(move || s.read_loop(peer))
                .map_err(|e| MeshError::Config(format!("cannot start a reader thread: {e}")))?;
            readers.push(t);
        }
        debug!(rank, world, provider = shared.provider.name(), one_sided, "mesh connected");
        Ok(Mesh { shared, readers })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.shared.world
    }

    /// The provider's name (`tcp`, `sim`, `verbs`).
    pub fn provider_name(&self) -> &'static str {
        self.shared.provider.name()
    }

    /// Whether rendezvous uses one-sided READ (verbs, sim) rather than a stream (tcp).
    pub fn one_sided(&self) -> bool {
        self.shared.one_sided
    }

    /// Largest eager message.
    pub fn eager_limit(&self) -> usize {
        self.shared.eager_limit
    }

    /// Largest message of either protocol.
    pub fn max_message(&self) -> usize {
        self.shared.max_message
    }

    /// Counters.
    pub fn stats(&self) -> MeshStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MeshStats {
            eager_sent: l(&c.eager_sent),
            eager_sent_bytes: l(&c.eager_sent_bytes),
            rendezvous_sent: l(&c.rendezvous_sent),
            rendezvous_sent_bytes: l(&c.rendezvous_sent_bytes),
            eager_received: l(&c.eager_received),
            eager_received_bytes: l(&c.eager_received_bytes),
            rendezvous_received: l(&c.rendezvous_received),
            rendezvous_received_bytes: l(&c.rendezvous_received_bytes),
            reads: l(&c.reads),
            registration_hits: l(&c.registration_hits),
            registrations: l(&c.registrations),
        }
    }

    /// Provider counters (`rdma_reads`, `verbs_sends`, ...), for tests that check which path
    /// ran.
    pub fn provider_counters(&self) -> Vec<(&'static str, u64)> {
        self.shared.provider.counters()
    }

    /// Exposes `len` bytes at `ptr` to one-sided reads by peers, for rendezvous sends out of
    /// them (a no-op handle on stream providers). Registrations are cached by `(ptr, len)`:
    /// a buffer sent from many times (every step of a ring, every training step with
    /// [`MeshConfig::cache_registrations`]) is registered once.
    ///
    /// # Safety
    ///
    /// The memory must stay valid (mapped, not freed) while the returned [`Registration`]
    /// lives. With `cache_registrations`, a cached registration outlives the handle: the
    /// caller must call [`invalidate`](Mesh::invalidate) before the memory is freed, or a
    /// later registration of new memory at the same address would reuse a stale one.
    pub unsafe fn register(&self, ptr: *const u8, len: usize) -> Result<Registration, MeshError> {
        self.shared.register(ptr, len)
    }

    /// Drops cached registrations overlapping `[ptr, ptr + len)` (the memory is about to be
    /// freed). Registrations still in use are dropped when their last handle goes.
    pub fn invalidate(&self, ptr: *const u8, len: usize) {
        let dropped = self.shared.regs.lock().invalidate(ptr as usize, len);
        for keys in dropped {
            self.shared.provider.deregister_source(&keys);
        }
    }

    /// Sends `data` to `peer` under `tag`. Eager messages (and every message on tcp) are
    /// complete on return; a one-sided rendezvous completes when the peer has read it, so
    /// [`wait`](Mesh::wait) on the ticket before changing `data`. `reg`, when given, must
    /// cover `data` (see [`register`](Mesh::register)); without it a rendezvous send registers
    /// `data` for its own duration.
    pub fn send<'a>(
        &self,
        peer: usize,
        tag: Tag,
        data: &'a [u8],
        proto: Proto,
        reg: Option<&Registration>,
    ) -> Result<SendTicket<'a>, MeshError> {
        let s = &*self.shared;
        let link = s.link(peer)?;
        s.check_peer(peer)?;
        let len = data.len();
        match proto {
            Proto::Eager => {
                if len > s.eager_limit {
                    return Err(MeshError::TooLarge {
                        rank: s.rank,
                        peer,
                        proto,
                        len,
                        limit: s.eager_limit,
                        setting: "MOBIUS_EAGER_LIMIT",
                    });
                }
                let frame = Frame::Eager { req: tag, index: KIND_DATA, len: len as u32 };
                link.send(&frame, Payload::Bytes(data)).map_err(|e| s.link_failed(peer, e))?;
                bump(&s.counters.eager_sent, 1);
                bump(&s.counters.eager_sent_bytes, len as u64);
                Ok(SendTicket::done(peer))
            }
            Proto::Rendezvous => {
                if len > s.max_message {
                    return Err(MeshError::TooLarge {
                        rank: s.rank,
                        peer,
                        proto,
                        len,
                        limit: s.max_message,
                        setting: "MOBIUS_MAX_MESSAGE",
                    });
                }
                bump(&s.counters.rendezvous_sent, 1);
                bump(&s.counters.rendezvous_sent_bytes, len as u64);
                if !s.one_sided {
                    let frame = Frame::PullData { region: tag, offset: 0, len: len as u64 };
                    link.send(&frame, Payload::Bytes(data)).map_err(|e| s.link_failed(peer, e))?;
                    return Ok(SendTicket::done(peer));
                }
                let (keys, temporary) = match reg {
                    Some(r) if r.covers(data) => (r.keys, None),
                    Some(_) => {
                        return Err(MeshError::Config(format!(
                            "rank {}: a rendezvous send to rank {peer} is outside the registration passed with it",
                            s.rank
                        )))
                    }
                    None => {
                        // The temporary registration lives in the ticket, which borrows
                        // `data` and does not let go before the peer has read it.
                        let r = self.shared.register(data.as_ptr(), len)?;
                        (r.keys, Some(r))
                    }
                };
                let base = match &temporary {
                    Some(r) => r.ptr,
                    None => reg.map(|r| r.ptr).unwrap_or(0),
                };
                let token = s.next_token.fetch_add(1, Ordering::Relaxed);
                let mut rts = Vec::with_capacity(36);
                // The remote address is the provider's address of the registered region plus
                // the offset of `data` in it.
                rts.extend_from_slice(&(keys.addr + (data.as_ptr() as usize - base) as u64).to_be_bytes());
                rts.extend_from_slice(&keys.rkey.to_be_bytes());
                rts.extend_from_slice(&(len as u64).to_be_bytes());
                rts.extend_from_slice(&token.to_be_bytes());
                let frame = Frame::Eager { req: tag, index: KIND_RTS, len: rts.len() as u32 };
                link.send(&frame, Payload::Bytes(&rts)).map_err(|e| s.link_failed(peer, e))?;
                Ok(SendTicket { peer, pending: Some((token, self.shared.clone())), _temporary: temporary, _data: PhantomData })
            }
        }
    }

    /// Waits until the send of `ticket` completed (the peer has read a rendezvous buffer).
    pub fn wait(&self, mut ticket: SendTicket<'_>, deadline: Instant) -> Result<(), MeshError> {
        match ticket.pending.take() {
            None => Ok(()),
            Some((token, shared)) => shared.wait_done(ticket.peer, token, deadline),
        }
    }

    /// Receives the next message from `peer` under `tag`, waiting until `deadline`.
    pub fn recv(&self, peer: usize, tag: Tag, deadline: Instant) -> Result<Message, MeshError> {
        self.recv_either((peer, tag), None, deadline).map(|(_, m)| m)
    }

    /// Receives whichever of two expected messages arrives first: `(0, m)` for `first`,
    /// `(1, m)` for `second` (which wins when both are there). Collectives use it to watch
    /// for a check message from one peer while waiting for data from another.
    pub fn recv_either(
        &self,
        first: (usize, Tag),
        second: Option<(usize, Tag)>,
        deadline: Instant,
    ) -> Result<(usize, Message), MeshError> {
        let s = &*self.shared;
        s.link(first.0)?;
        if let Some((p, _)) = second {
            s.link(p)?;
        }
        let started = Instant::now();
        let mut st = s.state.lock();
        loop {
            // The watched message first: when both are there, the check it carries must run
            // before the data is used.
            if let Some((p, t)) = second {
                if let Some(m) = take(&mut st.inbox[p], t) {
                    return Ok((1, m));
                }
            }
            if let Some(m) = take(&mut st.inbox[first.0], first.1) {
                return Ok((0, m));
            }
            s.check_locked(&st, first.0)?;
            if let Some((p, _)) = second {
                s.check_locked(&st, p)?;
            }
            if Instant::now() >= deadline {
                return Err(MeshError::Timeout { rank: s.rank, peer: first.0, what: "a message", waited_ms: ms(started) });
            }
            s.cond.wait_until(&mut st, deadline);
        }
    }

    /// Takes a message that has already arrived, without waiting.
    pub fn try_recv(&self, peer: usize, tag: Tag) -> Result<Option<Message>, MeshError> {
        let s = &*self.shared;
        s.link(peer)?;
        let mut st = s.state.lock();
        if let Some(m) = take(&mut st.inbox[peer], tag) {
            return Ok(Some(m));
        }
        s.check_locked(&st, peer)?;
        Ok(None)
    }

    /// Tells every peer that this rank gives up, with `reason`; their waits fail with
    /// [`MeshError::Aborted`] naming this rank. Best effort: dead links are skipped.
    pub fn abort(&self, reason: &str) {
        let s = &*self.shared;
        let mut reason = reason.to_string();
        reason.truncate(CONTROL_MAX - 64);
        while !reason.is_char_boundary(reason.len()) {
            reason.pop();
        }
        {
            let mut st = s.state.lock();
            if st.abort.is_none() {
                st.abort = Some((s.rank, reason.clone()));
            }
            s.cond.notify_all();
        }
        for (peer, link) in s.links.iter().enumerate() {
            let Some(link) = link else { continue };
            if matches!(s.state.lock().peers[peer], PeerStatus::Up) {
                let _ = link.send(
                    &Frame::Eager { req: 0, index: KIND_ABORT, len: reason.len() as u32 },
                    Payload::Bytes(reason.as_bytes()),
                );
            }
        }
    }

    /// Closes every link at once without a goodbye, as a crashed process would: peers see
    /// the links fail. For fault-injection tests; [`close`](Mesh::close) is the clean way out.
    pub fn sever(&self) {
        {
            let mut st = self.shared.state.lock();
            st.closed = true;
            self.shared.cond.notify_all();
        }
        for link in self.shared.links.iter().flatten() {
            link.shutdown();
        }
    }

    /// The abort this mesh saw, if any: `(rank that aborted, reason)`.
    pub fn aborted(&self) -> Option<(usize, String)> {
        self.shared.state.lock().abort.clone()
    }

    /// Closes the mesh: says `BYE` to every peer, closes the links and joins the reader
    /// threads. Also done on drop.
    pub fn close(&mut self) {
        let s = &*self.shared;
        let was_closed = {
            let mut st = s.state.lock();
            let was = st.closed;
            st.closed = true;
            s.cond.notify_all();
            was
        };
        if self.readers.is_empty() && was_closed {
            return;
        }
        if !was_closed {
            for link in s.links.iter().flatten() {
                let _ = link.send(&Frame::Eager { req: 0, index: KIND_BYE, len: 0 }, Payload::Bytes(&[]));
                link.flush_sends(Duration::from_millis(200));
            }
        }
        for link in s.links.iter().flatten() {
            link.shutdown();
        }
        for t in self.readers.drain(..) {
            let _ = t.join();
        }
        let keys = s.regs.lock().clear();
        for k in keys {
            s.provider.deregister_source(&k);
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.close();
    }
}

fn take(inbox: &mut HashMap<Tag, VecDeque<Message>>, tag: Tag) -> Option<Message> {
    let q = inbox.get_mut(&tag)?;
    let m = q.pop_front();
    if q.is_empty() {
        inbox.remove(&tag);
    }
    m
}

impl Shared {
    fn link(&self, peer: usize) -> Result<&Arc<dyn Link>, MeshError> {
        self.links.get(peer).and_then(|l| l.as_ref()).ok_or(MeshError::BadPeer { rank: self.rank, peer, world: self.world })
    }

    fn check_peer(&self, peer: usize) -> Result<(), MeshError> {
        self.check_locked(&self.state.lock(), peer)
    }

    fn check_locked(&self, st: &State, peer: usize) -> Result<(), MeshError> {
        if st.closed {
            return Err(MeshError::Closed { rank: self.rank });
        }
        if let Some((by, reason)) = &st.abort {
            return Err(MeshError::Aborted { rank: self.rank, by: *by, reason: reason.clone() });
        }
        match &st.peers[peer] {
            PeerStatus::Up => Ok(()),
            PeerStatus::Left => Err(MeshError::PeerLeft { rank: self.rank, peer }),
            PeerStatus::Failed(reason) => {
                Err(MeshError::PeerFailed { rank: self.rank, peer, addr: self.names[peer].clone(), reason: reason.clone() })
            }
        }
    }

    fn wait_done(&self, peer: usize, token: u64, deadline: Instant) -> Result<(), MeshError> {
        let started = Instant::now();
        let mut st = self.state.lock();
        loop {
            if st.done.remove(&(peer, token)) {
                return Ok(());
            }
            self.check_locked(&st, peer)?;
            if Instant::now() >= deadline {
                return Err(MeshError::Timeout {
                    rank: self.rank,
                    peer,
                    what: "the read of a rendezvous buffer",
                    waited_ms: ms(started),
                });
            }
            self.cond.wait_until(&mut st, deadline);
        }
    }

    /// Records that the link to `peer` failed and turns the error into one naming it.
    fn link_failed(&self, peer: usize, e: FabricError) -> MeshError {
        let mut st = self.state.lock();
        if let PeerStatus::Up = st.peers[peer] {
            st.peers[peer] = PeerStatus::Failed(describe(&e));
        }
        self.cond.notify_all();
        match self.check_locked(&st, peer) {
            Err(err) => err,
            Ok(()) => MeshError::PeerFailed { rank: self.rank, peer, addr: self.names[peer].clone(), reason: describe(&e) },
        }
    }

    /// See [`Mesh::register`] for the contract on the memory.
    fn register(self: &Arc<Self>, ptr: *const u8, len: usize) -> Result<Registration, MeshError> {
        if !self.one_sided || len == 0 {
            return Ok(Registration { ptr: ptr as usize, len, keys: SourceKeys::default(), owner: None });
        }
        let key = (ptr as usize, len);
        if let Some((id, keys)) = self.regs.lock().hit(key) {
            bump(&self.counters.registration_hits, 1);
            return Ok(Registration { ptr: key.0, len, keys, owner: Some((Arc::downgrade(self), id)) });
        }
        let source: Arc<dyn Source> = Arc::new(UserMemory { ptr: ptr as usize, len });
        let keys = self
            .provider
            .register_source(&source)
            .map_err(|e| MeshError::Memory { rank: self.rank, message: format!("registering a {len}-byte user buffer: {e}") })?;
        bump(&self.counters.registrations, 1);
        let (id, evicted) = self.regs.lock().insert(key, keys);
        for k in evicted {
            self.provider.deregister_source(&k);
        }
        Ok(Registration { ptr: key.0, len, keys, owner: Some((Arc::downgrade(self), id)) })
    }

    fn read_loop(self: Arc<Self>, peer: usize) {
        let Ok(link) = self.link(peer).cloned() else { return };
        loop {
            let pool = &self.pool;
            let memory_timeout = self.memory_timeout;
            let mut place = |f: &Frame| {
                let len = match f {
                    Frame::Eager { len, .. } => *len as u64,
                    Frame::PullData { len, .. } => *len,
                    _ => return Placement::Discard,
                };
                if len == 0 {
                    return Placement::Discard;
                }
                match pool.acquire(len as usize, Some(Instant::now() + memory_timeout)) {
                    Ok(lease) => Placement::Into { lease, at: 0 },
                    Err(e) => Placement::Abort(FabricError::Pool(e)),
                }
            };
            let got = link.recv(&self.limits, &mut place);
            let result = match got {
                Ok(Received { frame, payload }) => self.deliver(peer, &link, frame, payload),
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                let mut st = self.state.lock();
                if !st.closed {
                    if let PeerStatus::Up = st.peers[peer] {
                        let why = match &e {
                            FabricError::Closed { .. } => {
                                "the connection closed without a goodbye (the process exited or was killed)".to_string()
                            }
                            FabricError::Pool(p) => memory_advice(p),
                            other => describe(other),
                        };
                        debug!(rank = self.rank, peer, why = %why, "mesh link failed");
                        st.peers[peer] = PeerStatus::Failed(why);
                    }
                }
                self.cond.notify_all();
                return;
            }
        }
    }

    fn deliver(&self, peer: usize, link: &Arc<dyn Link>, frame: Frame, payload: Option<Lease>) -> Result<(), FabricError> {
        let protocol = |m: String| FabricError::Unsupported(format!("{}: {m}", link.peer()));
        match frame {
            Frame::Eager { req, index: KIND_DATA, len } => {
                bump(&self.counters.eager_received, 1);
                bump(&self.counters.eager_received_bytes, len as u64);
                self.push(peer, req, Message { lease: payload, proto: Proto::Eager });
            }
            Frame::PullData { region, len, .. } => {
                bump(&self.counters.rendezvous_received, 1);
                bump(&self.counters.rendezvous_received_bytes, len);
                self.push(peer, region, Message { lease: payload, proto: Proto::Rendezvous });
            }
            Frame::Eager { req, index: KIND_RTS, .. } => {
                let body = payload.as_deref().unwrap_or(&[]);
                let mut r = Reader(body);
                let parsed = (|| Ok::<_, String>((r.u64()?, r.u32()?, r.u64()?, r.u64()?)))();
                let (addr, rkey, len, token) = parsed.map_err(protocol)?;
                if len > self.max_message as u64 {
                    return Err(protocol(format!("rendezvous of {len} bytes above the limit {}", self.max_message)));
                }
                let mut lease = None;
                if len > 0 {
                    let mut l = self.pool.acquire(len as usize, Some(Instant::now() + self.memory_timeout))?;
                    link.read_remote(&Descriptor { region: token, addr, len, rkey }, &mut l)?;
                    bump(&self.counters.reads, 1);
                    lease = Some(l);
                }
                link.send(&Frame::Eager { req: token, index: KIND_DONE, len: 0 }, Payload::Bytes(&[]))?;
                bump(&self.counters.rendezvous_received, 1);
                bump(&self.counters.rendezvous_received_bytes, len);
                self.push(peer, req, Message { lease, proto: Proto::Rendezvous });
            }
            Frame::Eager { req, index: KIND_DONE, .. } => {
                let mut st = self.state.lock();
                st.done.insert((peer, req));
                self.cond.notify_all();
            }
            Frame::Eager { index: KIND_ABORT, .. } => {
                let reason = String::from_utf8_lossy(payload.as_deref().unwrap_or(&[])).into_owned();
                let mut st = self.state.lock();
                if st.abort.is_none() {
                    st.abort = Some((peer, reason));
                }
                self.cond.notify_all();
            }
            Frame::Eager { index: KIND_BYE, .. } => {
                let mut st = self.state.lock();
                st.peers[peer] = PeerStatus::Left;
                self.cond.notify_all();
                // Nothing more comes on this link; stop reading it.
                return Err(FabricError::Shutdown);
            }
            other => return Err(protocol(format!("unexpected {:?} frame on a mesh link", other.kind()))),
        }
        Ok(())
    }

    fn push(&self, peer: usize, tag: Tag, m: Message) {
        let mut st = self.state.lock();
        st.inbox[peer].entry(tag).or_default().push_back(m);
        self.cond.notify_all();
    }
}

fn describe(e: &FabricError) -> String {
    match e {
        FabricError::Closed { .. } => "the connection closed (the process exited or was killed)".into(),
        other => other.to_string(),
    }
}

fn memory_advice(e: &PoolError) -> String {
    match e {
        PoolError::Timeout { requested, cap, in_use } => format!(
            "no receive buffer of {requested} bytes within the memory timeout: {in_use} of {cap} bytes are held by \
             messages not yet consumed; raise MOBIUS_POOL_BYTES"
        ),
        PoolError::ExceedsCap { requested, cap } => {
            format!("a message of {requested} bytes exceeds the receive pool cap of {cap} bytes; raise MOBIUS_POOL_BYTES")
        }
        other => format!("receive buffer: {other}"),
    }
}

fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}

// ---------------------------------------------------------------------------------------
// Registrations of user memory
// ---------------------------------------------------------------------------------------

/// User memory exposed to one-sided reads. The mesh only hands its bytes to the provider
/// while a [`Registration`] promises they are alive.
#[derive(Debug)]
struct UserMemory {
    ptr: usize,
    len: usize,
}

impl Source for UserMemory {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `Mesh::register`'s contract: the memory is valid while registered.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

/// A user buffer exposed to peers' one-sided reads (see [`Mesh::register`]). Dropping it
/// releases the registration, or leaves it in the cache.
pub struct Registration {
    ptr: usize,
    len: usize,
    keys: SourceKeys,
    /// The mesh and cache entry it came from; `None` when nothing was registered.
    owner: Option<(Weak<Shared>, u64)>,
}

impl Registration {
    fn covers(&self, data: &[u8]) -> bool {
        let (a, n) = (data.as_ptr() as usize, data.len());
        a >= self.ptr && a + n <= self.ptr + self.len
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({:#x}+{}, rkey {})", self.ptr, self.len, self.keys.rkey)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some((owner, id)) = self.owner.take() else { return };
        // A mesh already closed has deregistered everything.
        let Some(shared) = owner.upgrade() else { return };
        let released = shared.regs.lock().release(id);
        for k in released {
            shared.provider.deregister_source(&k);
        }
    }
}

struct RegEntry {
    key: (usize, usize),
    keys: SourceKeys,
    users: usize,
    /// Invalidated while in use: deregistered when the last user lets go, never reused.
    stale: bool,
    last_use: u64,
}

/// Registration cache: a user buffer is registered once and reused while it is in use
/// (always: every step of a ring sends from the same buffer) and, when `keep` is on, after
/// its last use too (a training loop sends from the same gradient buffers every step), up to
/// `cap_bytes` of registered memory, least recently used first out.
struct RegCache {
    keep: bool,
    cap_bytes: usize,
    /// Bytes of every registration still held (live and stale).
    bytes: usize,
    clock: u64,
    next_id: u64,
    entries: HashMap<u64, RegEntry>,
    /// Live (reusable) entries by `(ptr, len)`.
    index: HashMap<(usize, usize), u64>,
}

impl RegCache {
    fn new(keep: bool, cap_bytes: usize) -> Self {
        RegCache { keep, cap_bytes, bytes: 0, clock: 0, next_id: 1, entries: HashMap::new(), index: HashMap::new() }
    }

    fn hit(&mut self, key: (usize, usize)) -> Option<(u64, SourceKeys)> {
        self.clock += 1;
        let id = *self.index.get(&key)?;
        let e = self.entries.get_mut(&id)?;
        e.users += 1;
        e.last_use = self.clock;
        Some((id, e.keys))
    }

    /// Adds a fresh registration, in use once; returns it and the registrations evicted to
    /// stay under the cap.
    fn insert(&mut self, key: (usize, usize), keys: SourceKeys) -> (u64, Vec<SourceKeys>) {
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        // Two threads may register the same buffer at once; the older entry stays usable by
        // its holders and goes when they do.
        if let Some(old) = self.index.insert(key, id) {
            if let Some(e) = self.entries.get_mut(&old) {
                e.stale = true;
            }
        }
        self.entries.insert(id, RegEntry { key, keys, users: 1, stale: false, last_use: self.clock });
        self.bytes += key.1;
        (id, self.evict())
    }

    fn remove(&mut self, id: u64) -> Option<SourceKeys> {
        let e = self.entries.remove(&id)?;
        if self.index.get(&e.key) == Some(&id) {
            self.index.remove(&e.key);
        }
        self.bytes -= e.key.1.min(self.bytes);
        Some(e.keys)
    }

    fn evict(&mut self) -> Vec<SourceKeys> {
        let mut out = Vec::new();
        while self.bytes > self.cap_bytes {
            let victim = self.entries.iter().filter(|(_, e)| e.users == 0).min_by_key(|(_, e)| e.last_use).map(|(id, _)| *id);
            let Some(id) = victim else { break };
            out.extend(self.remove(id));
        }
        out
    }

    fn release(&mut self, id: u64) -> Vec<SourceKeys> {
        let keep = self.keep;
        let Some(e) = self.entries.get_mut(&id) else { return Vec::new() };
        e.users = e.users.saturating_sub(1);
        let mut out = Vec::new();
        if e.users == 0 && (!keep || e.stale) {
            out.extend(self.remove(id));
        }
        out.extend(self.evict());
        out
    }

    fn invalidate(&mut self, ptr: usize, len: usize) -> Vec<SourceKeys> {
        let end = ptr.saturating_add(len);
        let hit: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.key.0 < end && ptr < e.key.0.saturating_add(e.key.1))
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::new();
        for id in hit {
            let Some(e) = self.entries.get_mut(&id) else { continue };
            e.stale = true;
            let key = e.key;
            if e.users == 0 {
                out.extend(self.remove(id));
            } else if self.index.get(&key) == Some(&id) {
                self.index.remove(&key);
            }
        }
        out
    }

    fn clear(&mut self) -> Vec<SourceKeys> {
        self.bytes = 0;
        self.index.clear();
        self.entries.drain().map(|(_, e)| e.keys).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(rkey: u32) -> SourceKeys {
        SourceKeys { addr: 0, rkey, handle: rkey as u64 }
    }

    #[test]
    fn cache_reuses_live_registrations_and_drops_them_after_use_unless_kept() {
        let mut c = RegCache::new(false, 1 << 20);
        let (id, ev) = c.insert((0x1000, 100), keys(1));
        assert!(ev.is_empty());
        assert_eq!(c.hit((0x1000, 100)).map(|h| h.1.rkey), Some(1));
        assert!(c.release(id).is_empty(), "one user left");
        assert_eq!(c.release(id).iter().map(|k| k.rkey).collect::<Vec<_>>(), vec![1]);
        assert!(c.hit((0x1000, 100)).is_none());

        let mut c = RegCache::new(true, 1 << 20);
        let (id, _) = c.insert((0x1000, 100), keys(1));
        assert!(c.release(id).is_empty(), "kept after its last use");
        assert!(c.hit((0x1000, 100)).is_some());
    }

    #[test]
    fn cache_evicts_least_recently_used_idle_entries_above_its_cap() {
        let mut c = RegCache::new(true, 250);
        let (a, _) = c.insert((0x1000, 100), keys(1));
        let (b, _) = c.insert((0x2000, 100), keys(2));
        c.release(a);
        c.release(b);
        assert!(c.hit((0x1000, 100)).is_some());
        c.release(a);
        let (_, ev) = c.insert((0x3000, 100), keys(3));
        assert_eq!(ev.iter().map(|k| k.rkey).collect::<Vec<_>>(), vec![2], "b was used least recently");
        assert_eq!(c.bytes, 200);
    }

    #[test]
    fn invalidated_entries_are_never_reused_and_go_with_their_last_user() {
        let mut c = RegCache::new(true, 1 << 20);
        let (id, _) = c.insert((0x1000, 4096), keys(1));
        assert!(c.invalidate(0x1800, 1).is_empty(), "still in use");
        assert!(c.hit((0x1000, 4096)).is_none(), "stale entries are not reused");
        assert_eq!(c.release(id).iter().map(|k| k.rkey).collect::<Vec<_>>(), vec![1]);
        assert_eq!(c.bytes, 0);
        let (id2, _) = c.insert((0x1000, 4096), keys(2));
        c.release(id2);
        assert_eq!(c.invalidate(0, 0x1001).len(), 1);
        assert!(c.entries.is_empty() && c.index.is_empty());
    }

    use crate::{SimProvider, TcpProvider};
    use std::net::{IpAddr, Ipv4Addr};

    fn localhost() -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)
    }

    /// Builds a mesh of `world` ranks in threads; `tweak` adjusts each rank's config.
    fn build(provider: Arc<dyn Provider>, world: usize, tweak: impl Fn(&mut MeshConfig)) -> Vec<Result<Mesh, MeshError>> {
        let listeners: Vec<MeshListener> =
            (0..world).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = addrs.clone();
                let mut c = MeshConfig::new(r, world);
                c.connect_timeout = Duration::from_secs(20);
                c.pool.cap_bytes = 64 << 20;
                c.max_message = 16 << 20;
                tweak(&mut c);
                std::thread::spawn(move || Mesh::connect(l, &addrs, c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn providers() -> Vec<Arc<dyn Provider>> {
        vec![Arc::new(TcpProvider::new()), Arc::new(SimProvider::new(true)), Arc::new(SimProvider::new(false))]
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    #[test]
    fn every_pair_exchanges_eager_and_rendezvous_messages_in_order() {
        for provider in providers() {
            let meshes: Vec<Mesh> = build(provider.clone(), 3, |_| {}).into_iter().map(|m| m.unwrap()).collect();
            let big: Vec<u8> = (0..3_000_001u32).map(|i| (i % 251) as u8).collect();
            std::thread::scope(|sc| {
                for m in &meshes {
                    let big = &big;
                    sc.spawn(move || {
                        let me = m.rank();
                        for peer in (0..3).filter(|p| *p != me) {
                            let small = [me as u8, peer as u8, 7];
                            m.wait(m.send(peer, 1, &small, Proto::Eager, None).unwrap(), soon()).unwrap();
                            m.wait(m.send(peer, 1, &small[..1], Proto::Eager, None).unwrap(), soon()).unwrap();
                            let t = m.send(peer, 2, big, Proto::Rendezvous, None).unwrap();
                            m.wait(t, soon()).unwrap();
                            m.wait(m.send(peer, 3, &[], Proto::Rendezvous, None).unwrap(), soon()).unwrap();
                        }
                        for peer in (0..3).filter(|p| *p != me) {
                            let first = m.recv(peer, 1, soon()).unwrap();
                            assert_eq!(&*first, &[peer as u8, me as u8, 7]);
                            assert_eq!(first.proto(), Proto::Eager);
                            assert_eq!(&*m.recv(peer, 1, soon()).unwrap(), &[peer as u8]);
                            let got = m.recv(peer, 2, soon()).unwrap();
                            assert_eq!(got.proto(), Proto::Rendezvous);
                            assert!(*got == big[..], "rendezvous bytes differ from rank {peer}");
                            assert!(m.recv(peer, 3, soon()).unwrap().is_empty());
                        }
                    });
                }
            });
            let st = meshes[0].stats();
            assert_eq!((st.eager_sent, st.rendezvous_sent, st.eager_received, st.rendezvous_received), (4, 4, 4, 4));
            assert_eq!(st.rendezvous_received_bytes, 2 * big.len() as u64);
            if meshes[0].one_sided() {
                assert_eq!(st.reads, 2, "{}: rendezvous must be one-sided reads", provider.name());
                assert!(st.registrations >= 2);
            } else {
                assert_eq!(st.reads, 0);
            }
        }
    }

    #[test]
    fn eager_messages_above_the_limit_are_refused_with_the_setting() {
        let meshes: Vec<Mesh> =
            build(Arc::new(SimProvider::new(true)), 2, |c| c.eager_limit = 1024).into_iter().map(|m| m.unwrap()).collect();
        let e = meshes[0].send(1, 0, &[0u8; 1025], Proto::Eager, None).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("1025") && text.contains("MOBIUS_EAGER_LIMIT") && text.contains("rank 1"), "{text}");
        assert!(matches!(meshes[0].send(0, 0, &[1], Proto::Eager, None), Err(MeshError::BadPeer { .. })));
    }

    #[test]
    fn a_rank_that_never_joins_is_named_after_the_timeout() {
        let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
        let listeners: Vec<MeshListener> =
            (0..3).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
        let mut it = listeners.into_iter();
        let (l0, l1, _l2_never_runs) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let a2 = addrs.clone();
        let t = std::thread::spawn(move || {
            let mut c = MeshConfig::new(1, 3);
            c.connect_timeout = Duration::from_millis(1500);
            Mesh::connect(l1, &a2, c)
        });
        let mut c = MeshConfig::new(0, 3);
        c.connect_timeout = Duration::from_millis(1500);
        let started = Instant::now();
        let e = Mesh::connect(l0, &addrs, c).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(10));
        match &e {
            MeshError::ConnectTimeout { missing, .. } => assert_eq!(missing, &vec![2]),
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains("rank(s) [2]"), "{e}");
        assert!(matches!(t.join().unwrap(), Err(MeshError::ConnectTimeout { .. })));
    }

    #[test]
    fn secrets_authenticate_every_link_and_a_wrong_secret_is_refused() {
        let ok = build(Arc::new(TcpProvider::new()), 3, |c| c.secret = Some(Secret::new("s3cret")));
        assert!(ok.iter().all(|m| m.is_ok()));
        drop(ok);
        let bad = build(Arc::new(TcpProvider::new()), 2, |c| {
            c.connect_timeout = Duration::from_secs(3);
            c.secret = Some(Secret::new(if c.rank == 1 { "wrong" } else { "s3cret" }));
        });
        let e1 = bad[1].as_ref().unwrap_err().to_string();
        assert!(e1.contains("rank 0") && e1.contains("MOBIUS_SECRET"), "{e1}");
        let e0 = bad[0].as_ref().unwrap_err().to_string();
        assert!(e0.contains("[1]") && e0.contains("MOBIUS_SECRET"), "{e0}");
        let half = build(Arc::new(TcpProvider::new()), 2, |c| {
            c.connect_timeout = Duration::from_secs(3);
            c.secret = (c.rank == 0).then(|| Secret::new("s3cret"));
        });
        assert!(half.iter().all(|m| m.as_ref().is_err_and(|e| e.to_string().contains("secret"))));
    }

    #[test]
    fn a_stray_connection_sending_junk_does_not_stop_the_mesh() {
        use std::io::Write;
        let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
        let listeners: Vec<MeshListener> =
            (0..2).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
        let mut stray = std::net::TcpStream::connect(addrs[0]).unwrap();
        stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || {
                    let mut c = MeshConfig::new(r, 2);
                    c.connect_timeout = Duration::from_secs(20);
                    Mesh::connect(l, &addrs, c)
                })
            })
            .collect();
        let meshes: Vec<Mesh> = handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        meshes[1].wait(meshes[1].send(0, 3, b"ok", Proto::Eager, None).unwrap(), soon()).unwrap();
        assert_eq!(&*meshes[0].recv(1, 3, soon()).unwrap(), b"ok");
    }

    #[test]
    fn mismatched_world_or_job_is_refused_with_what_differs() {
        let res = build(Arc::new(TcpProvider::new()), 2, |c| {
            c.connect_timeout = Duration::from_secs(3);
            if c.rank == 1 {
                c.job = "other".into();
            }
        });
        let e1 = res[1].as_ref().unwrap_err().to_string();
        assert!(e1.contains("\"other\"") && e1.contains("\"mobius\""), "{e1}");
    }

    #[test]
    fn a_peer_that_dies_fails_waits_on_it_at_once_and_a_clean_close_is_a_departure() {
        for provider in providers() {
            let mut meshes: Vec<Mesh> = build(provider.clone(), 3, |_| {}).into_iter().map(|m| m.unwrap()).collect();
            let m2 = meshes.pop().unwrap();
            // Simulate a crash: links go down without a goodbye.
            for l in m2.shared.links.iter().flatten() {
                l.shutdown();
            }
            let started = Instant::now();
            let e = meshes[0].recv(2, 9, Instant::now() + Duration::from_secs(30)).unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(5), "{}: waited {:?}", provider.name(), started.elapsed());
            assert!(matches!(e, MeshError::PeerFailed { peer: 2, .. }), "{e}");
            assert!(e.to_string().contains("rank 2"), "{e}");
            // A wait on a healthy peer times out after its deadline, naming it.
            let e = meshes[0].recv(1, 9, Instant::now() + Duration::from_millis(200)).unwrap_err();
            assert!(matches!(e, MeshError::Timeout { peer: 1, .. }), "{e}");
            // A clean close is reported as a departure, not a failure.
            let mut m1 = meshes.pop().unwrap();
            m1.close();
            let e = meshes[0].recv(1, 9, soon()).unwrap_err();
            assert!(matches!(e, MeshError::PeerLeft { peer: 1, .. }), "{}: {e}", provider.name());
            drop(m2);
        }
    }

    #[test]
    fn abort_reaches_every_peer_with_the_reason() {
        let meshes: Vec<Mesh> = build(Arc::new(TcpProvider::new()), 3, |_| {}).into_iter().map(|m| m.unwrap()).collect();
        meshes[1].abort("count differs");
        for m in [&meshes[0], &meshes[2]] {
            let e = m.recv(if m.rank() == 0 { 2 } else { 0 }, 5, soon()).unwrap_err();
            assert!(matches!(&e, MeshError::Aborted { by: 1, reason, .. } if reason == "count differs"), "{e}");
        }
    }

    #[test]
    fn registrations_are_cached_per_buffer_while_in_use() {
        let meshes: Vec<Mesh> = build(Arc::new(SimProvider::new(true)), 2, |c| c.cache_registrations = true)
            .into_iter()
            .map(|m| m.unwrap())
            .collect();
        let buf = vec![5u8; 1 << 20];
        for round in 0..3 {
            // SAFETY: `buf` outlives the registration and is invalidated before it is freed.
            let reg = unsafe { meshes[0].register(buf.as_ptr(), buf.len()) }.unwrap();
            for half in buf.chunks(buf.len() / 2) {
                meshes[0].wait(meshes[0].send(1, round, half, Proto::Rendezvous, Some(&reg)).unwrap(), soon()).unwrap();
                assert!(*meshes[1].recv(0, round, soon()).unwrap() == *half);
            }
        }
        let st = meshes[0].stats();
        assert_eq!((st.registrations, st.registration_hits), (1, 2));
        meshes[0].invalidate(buf.as_ptr(), 1);
        // SAFETY: as above.
        let _reg = unsafe { meshes[0].register(buf.as_ptr(), buf.len()) }.unwrap();
        assert_eq!(meshes[0].stats().registrations, 2, "an invalidated registration is not reused");
    }
}
