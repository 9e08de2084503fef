//! Mesh: persistent all-to-all links among the N ranks of a collective group.
//!
//! A collective (allreduce, allgather, ...) is a different shape from a shuffle fetch: every
//! rank talks to a fixed set of peers for the life of the group, messages are matched by a
//! tag rather than requested, and a ring step sends and receives at the same time. This
//! module gives collectives that shape as a protocol of the fabric's
//! [driver](rdma_shuffle_fabric::driver) (a [`Handler`](rdma_shuffle_fabric::driver::Handler) per link):
//! the links of a mesh are connections of one driver loop like any other (tcp, sim or verbs),
//! with no thread per peer. It is the only place where the collective library touches
//! providers:
//!
//! * [`MeshListener::bind`] starts the rank's driver and listener; its address is published
//!   to the other ranks (through a store, which is the caller's business);
//! * [`Mesh::connect`] builds one link per pair of ranks (the higher rank connects to the lower
//!   one). The loop runs each link's handshake — job name, world size and ranks, and with a
//!   shared secret mutual authentication by HMAC-SHA256 over the handshake transcript — and
//!   then, on verbs, attaches the queue pairs. Nothing is registered or exposed for a peer
//!   before it authenticated;
//! * [`Mesh::send`] / [`Mesh::recv`] move tagged messages. The loop reads every link as soon
//!   as bytes arrive and files messages by `(peer, tag)`, so sends never wait for the receiving
//!   *collective* to reach the matching `recv`: links are full duplex and several messages may
//!   be in flight per peer (pipelined segments).
//! * [`Mesh::post_recv`] / [`Mesh::wait_posted`] receive into the caller's memory: a message
//!   that starts to arrive after its receive was posted is read straight there by stream
//!   links (tcp from the socket, shm out of the sender's buffer), with no pool buffer.
//!
//! # Protocols
//!
//! * **Eager** ([`Proto::Eager`], up to [`MeshConfig::eager_limit`] bytes): the bytes travel
//!   inline in one message. The caller's bytes are copied once when the send is posted, so an
//!   eager send is complete at once.
//! * **Rendezvous** ([`Proto::Rendezvous`], up to [`MeshConfig::max_message`] bytes), never
//!   copied on the sending side:
//!   - on providers with one-sided reads (verbs, sim): the sender makes its *own* buffer
//!     readable (verbs: a registration through the [registration cache](Mesh::register); sim:
//!     an exposure per message) and sends a small request-to-send with `{addr, rkey, len}`;
//!     the receiver READs the bytes and answers `DONE`, after which the sender may reuse its
//!     buffer ([`Mesh::wait`]).
//!   - on stream providers (tcp): the loop writes the caller's buffer to the socket
//!     (`writev`, no copy) and the send completes once the last byte is written.
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
//! The mesh has frames of its own ([`codec`]): a 24-byte header (magic, kind, tag, length),
//! control bodies inside the fixed part, eager and streamed rendezvous payloads after it.
//! The providers cut them with the mesh's codec and never read inside them.

mod codec;
mod config;
pub(crate) mod handshake;
mod link;
mod message;
mod posted;
pub(crate) mod regcache;
mod registration;
pub(crate) mod shared;
#[cfg(test)]
mod tests;
mod ticket;

pub use config::{MeshConfig, MeshError, MAX_JOB_LEN};
pub(crate) use message::Body;
pub use message::Message;
pub use posted::{PostedRecv, Posting};
pub use registration::Registration;
pub(crate) use registration::{UserMemory, UserReg};
pub use ticket::SendTicket;

use crate::mesh::link::{submit, submit_quiet, MeshCmd, OutBody, RtsSource};
use handshake::Handshaker;
use parking_lot::Mutex;
use rdma_shuffle_fabric::driver::ConnKey;
use rdma_shuffle_fabric::driver::{Driver, DriverConfig};
use rdma_shuffle_fabric::memory::pool::{PoolError, TieredPool};
use rdma_shuffle_fabric::providers::{Provider, ProviderCapabilities};
use rdma_shuffle_fabric::FabricError;
use regcache::RegCache;
use registration::Regs;
use shared::{bump, MeshShared, PeerStatus};
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ticket::PendingSend;
use tracing::debug;

/// A message tag. Its meaning belongs to the caller (collectives pack a call sequence
/// number, a step and a segment into it); the mesh only matches it.
pub type Tag = u64;

/// Largest handshake or control message (hello with a job name, abort reasons).
pub(crate) const CONTROL_MAX: usize = 4096;
/// Pause between connection attempts to a peer whose listener refused.
const CONNECT_RETRY: Duration = Duration::from_millis(50);
/// How long a caller waits for the loop to let go of a buffer it gave up on.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// How [`Mesh::send`] moves a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    /// Inline copy; at most [`MeshConfig::eager_limit`] bytes.
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

/// A listening endpoint of one rank, bound before the mesh is built so its address can be
/// published to the other ranks first. It owns the rank's driver loop.
pub struct MeshListener {
    driver: Driver,
    id: u64,
    addr: SocketAddr,
    rank: usize,
}

impl MeshListener {
    /// Starts a driver loop over `provider` and listens on `addr` (port 0 picks a free port).
    /// The loop spins as long as [`DriverConfig::default`]'s.
    pub fn bind(provider: Arc<dyn Provider>, addr: SocketAddr, rank: usize) -> Result<Self, MeshError> {
        Self::bind_with_spin(provider, addr, rank, DriverConfig::default().spin)
    }

    /// [`bind`](Self::bind) with the loop's [`DriverConfig::spin`]: how long a caller waiting
    /// on the mesh polls after the last progress before it sleeps (`MOBIUS_SPIN`).
    pub fn bind_with_spin(provider: Arc<dyn Provider>, addr: SocketAddr, rank: usize, spin: Duration) -> Result<Self, MeshError> {
        let listen = |source| MeshError::Listen { rank, addr, source };
        let config = DriverConfig { name: format!("mobius-{rank}"), spin, ..DriverConfig::default() };
        let driver = Driver::new(provider, config).map_err(listen)?;
        let id = driver.next_id();
        let (tx, rx) = crossbeam_channel::bounded(1);
        submit(&driver, MeshCmd::Listen { id, addr, reply: tx }).map_err(listen)?;
        let addr = rx.recv().map_err(|_| listen(FabricError::Shutdown))?.map_err(listen)?;
        Ok(MeshListener { driver, id, addr, rank })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MeshListener {
    fn drop(&mut self) {
        // Consumed by `Mesh::connect` (id 0); otherwise never used: stop listening.
        if self.id != 0 {
            let (tx, rx) = crossbeam_channel::bounded(1);
            if submit(&self.driver, MeshCmd::Close { id: self.id, bye: false, reply: tx }).is_ok() {
                let _ = rx.recv_timeout(RELEASE_WAIT);
            }
        }
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
    /// Messages received straight into the caller's buffer (no intermediate buffer).
    pub placed: u64,
    /// Bytes of those.
    pub placed_bytes: u64,
    /// Of the placed messages, those reduced into the caller's buffer as they arrived (a
    /// reducing receive, [`Mesh::post_recv_fold`]).
    pub folded: u64,
    /// Bytes of those.
    pub folded_bytes: u64,
    /// Messages received into a pool buffer first (they arrived before their receive was
    /// posted, or a reduction consumes them from there).
    pub staged: u64,
    /// Bytes of those.
    pub staged_bytes: u64,
    /// Eager messages a stream link (tcp) wrote from the caller's memory, without a copy.
    pub eager_in_place: u64,
    /// Messages that left in one write with a message held for them (a collective call's
    /// header, [`Mesh::send_with_next`]).
    pub joined: u64,
}

/// Persistent links to every other rank of a group, with tagged send and receive.
///
/// `send`, `recv` and `wait` may be called from several threads; messages between one pair of
/// ranks under one tag are delivered in the order they were sent.
pub struct Mesh {
    shared: Arc<MeshShared>,
    driver: Driver,
    id: u64,
    one_sided: bool,
    memory_timeout: Duration,
    regs: Arc<Regs>,
    next_token: AtomicU64,
    closed: bool,
}

impl fmt::Debug for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mesh(rank {} of {}, {})", self.shared.rank, self.shared.world, self.driver.provider_name())
    }
}

/// Whether the provider reads rendezvous messages one-sidedly, and its largest eager
/// payload (verbs: what its message buffers hold).
fn provider_shape(p: &dyn Provider) -> (bool, Option<usize>) {
    let c = p.capabilities();
    (c.one_sided, c.max_eager)
}

/// Connects `listeners` (rank `r`'s at index `r`) into one mesh inside this process, one rank
/// per thread, each rank's [`MeshConfig::new`] given `connect_timeout` and then adjusted by
/// `tweak`: the group tests and benchmarks of the mesh and of providers build.
pub fn connect_in_threads(
    listeners: Vec<MeshListener>,
    connect_timeout: Duration,
    tweak: impl Fn(&mut MeshConfig) + Sync,
) -> Vec<Result<Mesh, MeshError>> {
    let world = listeners.len();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    std::thread::scope(|sc| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let mut c = MeshConfig::new(r, world);
                c.connect_timeout = connect_timeout;
                tweak(&mut c);
                let addrs = &addrs;
                sc.spawn(move || Mesh::connect(l, addrs, c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

impl Mesh {
    /// Builds the mesh: connects to every lower rank at `addrs[r]`, accepts every higher rank
    /// on `listener`, and authenticates each link. `addrs[config.rank]` is ignored (it is this
    /// rank's own listener). Fails with [`MeshError::ConnectTimeout`] naming the ranks that did
    /// not join within `config.connect_timeout`.
    pub fn connect(mut listener: MeshListener, addrs: &[SocketAddr], config: MeshConfig) -> Result<Mesh, MeshError> {
        config.validate()?;
        let (rank, world) = (config.rank, config.world);
        if addrs.len() != world {
            return Err(MeshError::Config(format!("{} peer addresses for a world of {world}", addrs.len())));
        }
        if listener.rank != rank {
            return Err(MeshError::Config(format!(
                "the listener was bound for rank {}, the config is rank {rank}",
                listener.rank
            )));
        }
        let driver = listener.driver.clone();
        let id = std::mem::replace(&mut listener.id, 0);
        let provider = driver.provider().clone();
        let (one_sided, verbs_max) = provider_shape(&*provider);
        if let Some(max) = verbs_max {
            if config.eager_limit > max {
                return Err(MeshError::Config(format!(
                    "eager limit {} exceeds the {max} bytes a verbs message buffer holds; lower MOBIUS_EAGER_LIMIT",
                    config.eager_limit
                )));
            }
        }
        let pool = TieredPool::new(config.pool.clone(), provider.registrar())
            .map_err(|e| MeshError::Memory { rank, message: format!("receive pool: {e}") })?;
        let hs = Handshaker { rank, world, job: config.job.clone(), secret: config.secret.clone() };
        let names = addrs.iter().map(|a| a.to_string()).collect();
        let shared = Arc::new(MeshShared::new(
            hs,
            config.eager_limit,
            config.max_message,
            pool,
            names,
            config.handshake_timeout.max(Duration::from_millis(10)),
        ));
        let mesh = Mesh {
            shared: shared.clone(),
            driver: driver.clone(),
            id,
            one_sided,
            memory_timeout: config.memory_timeout,
            regs: Arc::new(Regs { cache: Mutex::new(RegCache::new(config.cache_registrations, config.cache_bytes)) }),
            next_token: AtomicU64::new(1),
            closed: false,
        };
        let cmd = |c| submit(&driver, c).map_err(|_| MeshError::Closed { rank });
        cmd(MeshCmd::Start { id, shared: shared.clone(), addrs: addrs.to_vec() })?;
        let deadline = Instant::now() + config.connect_timeout;
        let mut retries: Vec<(Instant, usize)> = Vec::new();
        let outcome = loop {
            let mut st = shared.lock();
            if let Some(f) = st.build.fatal.take() {
                break Err(f);
            }
            if st.peers.iter().all(|p| matches!(p.status, PeerStatus::Up)) {
                break Ok(());
            }
            let now = Instant::now();
            for p in st.build.retry.drain(..) {
                retries.push((now + CONNECT_RETRY, p));
            }
            if now >= deadline {
                let missing = (0..world).filter(|&p| !matches!(st.peers[p].status, PeerStatus::Up)).collect();
                let seen: Vec<String> =
                    st.build.problems.iter().map(|(p, n)| if *n > 1 { format!("{p} (×{n})") } else { p.clone() }).collect();
                let details = if seen.is_empty() { String::new() } else { format!(" ({})", seen.join("; ")) };
                break Err(MeshError::ConnectTimeout {
                    rank,
                    missing,
                    waited_ms: config.connect_timeout.as_millis() as u64,
                    details,
                });
            }
            let wake = retries.iter().map(|r| r.0).min().unwrap_or(deadline).min(deadline);
            shared.wait_until(&mut st, wake);
            drop(st);
            let now = Instant::now();
            let (due, later): (Vec<_>, Vec<_>) = retries.into_iter().partition(|r| r.0 <= now);
            retries = later;
            for (_, peer) in due {
                if now + CONNECT_RETRY < deadline {
                    cmd(MeshCmd::Connect { id, peer })?;
                }
            }
        };
        match outcome {
            Ok(()) => {
                cmd(MeshCmd::Seal { id })?;
                debug!(rank, world, provider = provider.name(), one_sided, "mesh connected");
                Ok(mesh)
            }
            Err(e) => {
                // Dropping the mesh closes every connection made so far.
                drop(mesh);
                Err(e)
            }
        }
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
        self.driver.provider_name()
    }

    /// Whether rendezvous uses one-sided READ (verbs, sim) rather than a stream (tcp).
    pub fn one_sided(&self) -> bool {
        self.one_sided
    }

    /// What the provider can do (its capabilities once the mesh routed its links).
    pub fn capabilities(&self) -> ProviderCapabilities {
        self.driver.provider().capabilities()
    }

    /// Largest eager message.
    pub fn eager_limit(&self) -> usize {
        self.shared.eager_limit
    }

    /// Largest message of either protocol.
    pub fn max_message(&self) -> usize {
        self.shared.max_message
    }

    /// Says whether this host runs more waiting threads than it has cores (the caller
    /// knows how many ranks share the host). Then a rank waiting for a message yields its
    /// core while it polls, instead of spinning on it: the core is likely the one its peer
    /// needs to send that message.
    pub fn set_oversubscribed(&self, yes: bool) {
        self.driver.set_yield_when_idle(yes);
    }

    /// The spin the rank's driver loop runs with, asked of the loop itself.
    #[cfg(test)]
    pub(crate) fn driver_spin(&self) -> Duration {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.driver
            .submit(move |lp| {
                let _ = tx.send(lp.config().spin);
            })
            .expect("the mesh's loop runs");
        rx.recv_timeout(RELEASE_WAIT).expect("the loop answers")
    }

    /// Loop turns so far: `(run by the loop's thread, run by callers driving progress)`.
    pub fn loop_turns(&self) -> (u64, u64) {
        let s = self.driver.stats();
        (s.loop_turns.load(Ordering::Relaxed), s.caller_turns.load(Ordering::Relaxed))
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
            placed: l(&c.placed),
            placed_bytes: l(&c.placed_bytes),
            folded: l(&c.folded),
            folded_bytes: l(&c.folded_bytes),
            staged: l(&c.staged),
            staged_bytes: l(&c.staged_bytes),
            eager_in_place: l(&c.eager_in_place),
            joined: l(&c.joined),
        }
    }

    /// Provider counters (`rdma_reads`, `verbs_sends`, ...), for tests that check which path
    /// ran.
    pub fn provider_counters(&self) -> Vec<(&'static str, u64)> {
        self.driver.provider_counters()
    }

    fn peer_ok(&self, peer: usize) -> Result<(), MeshError> {
        let s = &*self.shared;
        if peer >= s.world || peer == s.rank {
            return Err(MeshError::BadPeer { rank: s.rank, peer, world: s.world });
        }
        Ok(())
    }

    /// The link to `peer` for a send (the peer must still be there).
    fn link(&self, peer: usize) -> Result<ConnKey, MeshError> {
        let s = &*self.shared;
        self.peer_ok(peer)?;
        let st = s.lock();
        s.check(&st, peer)?;
        st.peers[peer].conn.ok_or(MeshError::Closed { rank: s.rank })
    }

    fn command(&self, c: MeshCmd) -> Result<(), MeshError> {
        submit(&self.driver, c).map_err(|_| MeshError::Closed { rank: self.shared.rank })
    }

    /// Queues a send and runs a loop turn for it on this thread if the loop is free, so it
    /// goes out at once without waking the loop thread (which is rung otherwise).
    fn post(&self, c: MeshCmd) -> Result<(), MeshError> {
        submit_quiet(&self.driver, c).map_err(|_| MeshError::Closed { rank: self.shared.rank })?;
        self.driver.kick();
        Ok(())
    }

    /// Sends `data` to `peer` under `tag`. Eager messages are complete on return, but for
    /// one a stream link (tcp) wrote from `data` and its socket did not take whole, which
    /// completes once it has; a rendezvous completes when the peer has read it (one-sided) or
    /// the last byte is written (tcp). So [`wait`](Mesh::wait) on the ticket (or drop it,
    /// which waits) before changing `data`. `reg`, when given,
    /// must cover `data` (see [`register`](Mesh::register)); without it a one-sided rendezvous
    /// send registers `data` for its own duration.
    pub fn send<'a>(
        &self,
        peer: usize,
        tag: Tag,
        data: &'a [u8],
        proto: Proto,
        reg: Option<&Registration>,
    ) -> Result<SendTicket<'a>, MeshError> {
        let s = &*self.shared;
        let key = self.link(peer)?;
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
                let head = codec::encode(codec::Kind::Data, tag, len as u64, &[]);
                // A caller that finds the loop free puts the message out itself, from `data`
                // (shm: straight into the ring; tcp: written from `data`); else a copy goes
                // through the loop's queue.
                let token = self.next_token.fetch_add(1, Ordering::Relaxed);
                let memory = Arc::new(UserMemory { ptr: data.as_ptr() as usize, len });
                let now = self.driver.try_run(|lp| link::send_eager_now(lp, key, &head, &memory, token));
                bump(&s.counters.eager_sent, 1);
                bump(&s.counters.eager_sent_bytes, len as u64);
                match now.unwrap_or(link::EagerNow::NotTaken) {
                    link::EagerNow::Done => Ok(SendTicket::done(peer)),
                    // The socket did not take it all: the ticket holds `data` until it has.
                    link::EagerNow::Pending => Ok(SendTicket {
                        peer,
                        pending: Some(PendingSend { token, conn: key, shared: self.shared.clone(), driver: self.driver.clone() }),
                        drop_wait: self.memory_timeout,
                        _temporary: None,
                        _data: PhantomData,
                    }),
                    link::EagerNow::NotTaken => {
                        self.post(MeshCmd::Send {
                            key,
                            head,
                            body: OutBody::Bytes(data.to_vec()),
                            mark: None,
                            with_next: false,
                        })?;
                        Ok(SendTicket::done(peer))
                    }
                }
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
                let token = self.next_token.fetch_add(1, Ordering::Relaxed);
                let memory = Arc::new(UserMemory { ptr: data.as_ptr() as usize, len });
                let mut temporary = None;
                if !self.one_sided {
                    let head = codec::encode(codec::Kind::Bulk, tag, len as u64, &[]);
                    self.post(MeshCmd::Send { key, head, body: OutBody::User(memory), mark: Some(token), with_next: false })?;
                } else {
                    let r = match reg {
                        Some(r) if r.covers(data) => r,
                        Some(_) => {
                            return Err(MeshError::Config(format!(
                                "rank {}: a rendezvous send to rank {peer} is outside the registration passed with it",
                                s.rank
                            )))
                        }
                        None => {
                            // The temporary registration lives in the ticket, which borrows
                            // `data` and does not let go before the peer read it.
                            // SAFETY: `data` outlives the ticket (its lifetime `'a`).
                            let r = unsafe { self.register(data.as_ptr(), len) }?;
                            temporary.insert(r)
                        }
                    };
                    let source = match &r.reg {
                        // Nothing to read.
                        _ if len == 0 => RtsSource::Keys { addr: 0, rkey: 0 },
                        // Sim exposes a window per message, as the shuffle server does.
                        UserReg::Plain => RtsSource::Expose(memory),
                        UserReg::Region(v) => RtsSource::Keys { addr: data.as_ptr() as u64, rkey: v.rkey() },
                    };
                    self.post(MeshCmd::Rts { key, tag, token, len: len as u64, source })?;
                }
                Ok(SendTicket {
                    peer,
                    pending: Some(PendingSend { token, conn: key, shared: self.shared.clone(), driver: self.driver.clone() }),
                    drop_wait: self.memory_timeout,
                    _temporary: temporary,
                    _data: PhantomData,
                })
            }
        }
    }

    /// Sends a small eager message that may leave together with this rank's next message on
    /// the same link, or when this rank next waits (a collective's per-call header before its
    /// data: over tcp, one `writev` and one wake-up of the peer instead of two). Complete on
    /// return, as an eager [`send`](Mesh::send). Every caller path after it runs the loop (a
    /// send kicks it, a wait drives it), so it never waits for anything but that.
    pub fn send_with_next(&self, peer: usize, tag: Tag, data: &[u8]) -> Result<(), MeshError> {
        let s = &*self.shared;
        let key = self.link(peer)?;
        if data.len() > s.eager_limit {
            return Err(MeshError::TooLarge {
                rank: s.rank,
                peer,
                proto: Proto::Eager,
                len: data.len(),
                limit: s.eager_limit,
                setting: "MOBIUS_EAGER_LIMIT",
            });
        }
        let head = codec::encode(codec::Kind::Data, tag, data.len() as u64, &[]);
        // A link read in memory (shm) takes it at once, from `data`: nothing to gain by waiting.
        let sent = self.driver.try_run(|lp| link::send_polled_now(lp, key, &head, data)).unwrap_or(false);
        if !sent {
            let body = OutBody::Bytes(data.to_vec());
            submit_quiet(&self.driver, MeshCmd::Send { key, head, body, mark: None, with_next: true })
                .map_err(|_| MeshError::Closed { rank: s.rank })?;
        }
        bump(&s.counters.eager_sent, 1);
        bump(&s.counters.eager_sent_bytes, data.len() as u64);
        Ok(())
    }

    /// Waits until the send of `ticket` completed (the peer has read a rendezvous buffer, or
    /// it is written). On an error the buffer is let go of before this returns.
    pub fn wait(&self, mut ticket: SendTicket<'_>, deadline: Instant) -> Result<(), MeshError> {
        match ticket.pending.take() {
            None => Ok(()),
            Some(p) => p.wait(ticket.peer, deadline),
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
        // Messages that arrived before a peer left (or failed) are still delivered.
        self.peer_ok(first.0)?;
        if let Some((p, _)) = second {
            self.peer_ok(p)?;
        }
        let started = Instant::now();
        // The calling thread runs the loop while it waits (no hand-off to the loop thread
        // and back): see the driver's progress module.
        let take = |st: &mut parking_lot::MutexGuard<'_, shared::State>| -> Option<Result<(usize, Message), MeshError>> {
            // The watched message first: when both are there, the check it carries must run
            // before the data is used.
            if let Some((p, t)) = second {
                if let Some(m) = MeshShared::take(st, p, t) {
                    return Some(Ok((1, m)));
                }
            }
            if let Some(m) = MeshShared::take(st, first.0, first.1) {
                return Some(Ok((0, m)));
            }
            if let Err(e) = s.check(st, first.0) {
                return Some(Err(e));
            }
            if let Some((p, _)) = second {
                if let Err(e) = s.check(st, p) {
                    return Some(Err(e));
                }
            }
            None
        };
        match s.wait_for(&self.driver, deadline, take) {
            Some(r) => r,
            None => Err(s.timed_out(&s.lock(), first.0, "a message", started)),
        }
    }

    /// Takes a message that has already arrived, without waiting.
    pub fn try_recv(&self, peer: usize, tag: Tag) -> Result<Option<Message>, MeshError> {
        let s = &*self.shared;
        self.peer_ok(peer)?;
        let mut st = s.lock();
        if let Some(m) = MeshShared::take(&mut st, peer, tag) {
            return Ok(Some(m));
        }
        s.check(&st, peer)?;
        Ok(None)
    }

    /// Tells every peer that this rank gives up, with `reason`; their waits fail with
    /// [`MeshError::Aborted`] naming this rank. Best effort: dead links are skipped.
    pub fn abort(&self, reason: &str) {
        self.abort_for(None, reason)
    }

    /// [`abort`](Mesh::abort), naming the rank whose failure is the cause (`culprit`), so
    /// every peer's error leads with it.
    pub fn abort_for(&self, culprit: Option<usize>, reason: &str) {
        let s = &*self.shared;
        let mut reason = reason.to_string();
        reason.truncate(CONTROL_MAX - 64);
        while !reason.is_char_boundary(reason.len()) {
            reason.pop();
        }
        s.aborted(s.rank, culprit, reason.clone());
        let _ = self.command(MeshCmd::Abort { id: self.id, culprit, reason });
    }

    /// Closes every link at once without a goodbye, as a crashed process would: peers see
    /// the links fail. For fault-injection tests; [`close`](Mesh::close) is the clean way out.
    pub fn sever(&self) {
        self.shared.lock().closed = true;
        self.shared.cond.notify_all();
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.command(MeshCmd::Close { id: self.id, bye: false, reply: tx }).is_ok() {
            let _ = rx.recv_timeout(RELEASE_WAIT);
        }
    }

    /// The abort this mesh saw, if any: `(rank that aborted, rank whose failure caused
    /// it if known, reason)`.
    pub fn aborted(&self) -> Option<(usize, Option<usize>, String)> {
        self.shared.lock().abort.clone().map(|a| (a.by, a.culprit, a.reason))
    }

    /// Closes the mesh: says `BYE` to every peer, closes the links and stops the driver loop.
    /// Also done on drop.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let was_closed = {
            let mut st = self.shared.lock();
            std::mem::replace(&mut st.closed, true)
        };
        self.shared.cond.notify_all();
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.command(MeshCmd::Close { id: self.id, bye: !was_closed, reply: tx }).is_ok() {
            let _ = rx.recv_timeout(RELEASE_WAIT);
        }
        drop(self.regs.cache.lock().clear());
        self.driver.shutdown();
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.close();
    }
}

pub(crate) fn memory_advice(e: &PoolError) -> String {
    match e {
        PoolError::ExceedsCap { requested, cap } => {
            format!("a message of {requested} bytes exceeds the receive pool cap of {cap} bytes; raise MOBIUS_POOL_BYTES")
        }
        other => format!("receive buffer: {other}"),
    }
}
