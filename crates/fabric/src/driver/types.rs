//! The loop's types, in one module because they refer to each other: the [`Loop`] owns
//! [`Conn`]s, each run by a [`Role`] whose [`Handler`] is called with the loop; listeners
//! hand connections to an [`Acceptor`], protocols' [`Service`]s and callers' [`Job`]s run
//! with the loop, and the loop shares [`Shared`] with the threads that command it. Their
//! behaviour lives in the sibling modules (`event_loop`, `sockets`, `commands`, `service`,
//! `conn`), which import from here and never the other way round.

use super::stats::DriverStats;
use super::timers::Timers;
use crate::error::FabricError;
use crate::providers::codec::Codec;
use crate::providers::link::{Incoming, Link, Listener, ProviderEngine};
use crate::providers::Provider;
use mio::{Poll, Waker};
use parking_lot::Mutex;
use std::any::{Any, TypeId};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Settings of a driver (one engine's loop).
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Name in thread names, logs and errors (the executor id).
    pub name: String,
    /// A connection with nothing outstanding for this long is closed (clients close at this
    /// limit, servers at twice it, so the client side normally goes first); the next fetch
    /// opens a new one.
    pub idle_timeout: Duration,
    /// While the loop waits for answers to requests it sent (a fetch in flight), it polls
    /// without sleeping for up to this long after its last turn with work before it blocks
    /// in the kernel (as UCX's and NCCL's progress threads spin before they sleep): an
    /// answer that comes back within it costs no wake-up of the loop thread. It never spins
    /// with nothing outstanding, nor past the first quiet stretch of this length, so an idle
    /// engine sleeps and uses no CPU; `Duration::ZERO` never spins. Bounded by [`MAX_SPIN`].
    pub spin: Duration,
}

/// The longest [`DriverConfig::spin`] honoured: a longer one is cut to it, so no setting can
/// turn the loop into a busy-waiting thread on a shared host.
pub const MAX_SPIN: Duration = Duration::from_millis(1);

impl Default for DriverConfig {
    /// 120 s idle timeout, 50 µs spin.
    fn default() -> Self {
        DriverConfig { name: "engine".into(), idle_timeout: Duration::from_secs(120), spin: DEFAULT_SPIN }
    }
}

/// Default [`DriverConfig::spin`]: longer than a loopback or RDMA round trip of a small
/// block (15-40 µs measured here), short enough to be noise on an idle core.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// How long a closing connection may take to flush its last frames (an `Error` for the peer)
/// and, on verbs, to collect the completions of its posted work.
pub(super) const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Incoming items one connection may handle before the loop serves the others.
pub(super) const DRIVE_BUDGET: usize = 128;

/// Work for the loop from other threads.
pub(crate) enum Command {
    /// A protocol's work ([`Job`]).
    Run(Box<dyn Job>),
    /// Close everything and stop.
    Shutdown,
}

/// What the loop shares with other threads.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) config: DriverConfig,
    pub(super) waker: Waker,
    pub(super) commands: Mutex<Vec<Command>>,
    /// Sim connections and listeners with something to read.
    pub(super) ready: Mutex<Vec<u64>>,
    /// Memory (a lease, budget bytes) came back while the loop waited for some.
    pub(super) mem_wake: AtomicBool,
    /// The loop has blocks waiting for memory.
    pub(super) mem_wanted: AtomicBool,
    pub(super) stopping: AtomicBool,
    /// A caller driving progress yields its core between polls instead of spinning on it
    /// (more threads wait than there are cores: see [`Driver::set_yield_when_idle`]).
    pub(super) yield_when_idle: AtomicBool,
    pub(super) thread: Mutex<Option<JoinHandle<()>>>,
    pub(crate) stats: DriverStats,
    pub(super) next_id: AtomicU64,
}

/// A listening socket of a server endpoint, mesh or channel listener.
pub(crate) type ListenSocket = Box<dyn Listener>;

pub(super) struct Slot {
    pub(super) gen: u32,
    pub(super) conn: Option<Conn>,
}

/// The loop's state: the connection table, listeners, timers, the provider engine, and
/// each protocol's loop-wide [state](Loop::state). Whoever runs the loop holds it; protocols
/// reach it in their [`Handler`](super::Handler) hooks and [`Job`](super::Job)s.
pub struct Loop {
    pub(crate) shared: Arc<Shared>,
    pub(super) poll: Poll,
    pub(super) conns: Vec<Slot>,
    /// Every listening socket, by listener id.
    pub(super) listeners: HashMap<u64, Listening>,
    pub(super) free: Vec<u32>,
    /// Protocols' loop-wide hooks ([`Loop::add_service`]), by the service's type.
    pub(super) services: Vec<(TypeId, &'static dyn Service)>,
    /// Work due at the end of the turn ([`Loop::defer`]).
    pub(super) deferred: Vec<fn(&mut Loop)>,
    /// Connections parked until memory comes back ([`Loop::park_for_memory`]).
    pub(super) parked: VecDeque<ConnKey>,
    /// Protocols' loop-wide state, one value per type ([`Loop::state`]).
    pub(super) states: Vec<(TypeId, Box<dyn Any + Send>)>,
    pub(super) timers: Timers,
    /// Connections to drive again (they used their budget, or were unblocked).
    pub(super) again: Vec<ConnKey>,
    /// Connections whose link is [memory-polled](crate::providers::link::Link::memory_polled): read on
    /// every spin turn, armed before a sleep.
    pub(super) polled: Vec<ConnKey>,
    /// Spin turns since the last `epoll_wait`, while polled links are read in memory.
    pub(super) polls_skipped: u32,
    /// A block started waiting for memory since the queue was last served: serve it once
    /// (memory may be free already, and no release would then come to wake us).
    pub(super) mem_dirty: bool,
    /// The provider's engine for this loop.
    pub(crate) engine: Box<dyn ProviderEngine>,
    /// Set at shutdown: when the loop gives up waiting for connections to close.
    pub(super) exiting: Option<Instant>,
}

/// Index and generation of a connection slot; the generation makes stale references (a
/// timer, a completion, a poll event for a connection that is gone) harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub(crate) index: u32,
    pub(crate) gen: u32,
}

/// What a connection does: the protocol that runs on it (a block client or server, a raw
/// channel, a mesh link...). The loop calls these for every connection and never asks which
/// protocol it is; a new protocol is a new implementation, not a new arm in the loop.
///
/// Implementations are stateless markers (`&'static`); a connection's protocol state lives
/// in its [`Role`] and is reached with [`Role::get`] / [`Role::get_mut`]. The hooks take the
/// loop and the connection (taken out of the table while it is handled), so a handler can
/// send, expose and revoke memory, post reads and arm timers through them.
pub trait Handler: Sync {
    /// Whether the connection reads nothing more for now (its payload waits for memory).
    fn blocked(&self, conn: &Conn) -> bool {
        let _ = conn;
        false
    }
    /// A pending outgoing connect completed.
    fn connected(&self, lp: &mut Loop, conn: &mut Conn) {
        let _ = (lp, conn);
    }
    /// Something arrived.
    fn incoming(&self, lp: &mut Loop, conn: &mut Conn, inc: Incoming);
    /// The transport failed (or the peer went away): fail the protocol's work. Answers
    /// whether frames still queued (an `Error` for the peer) should be flushed first.
    fn failed(&self, lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool;
    /// After the connection was handled (and is not closing): send what was queued.
    fn after(&self, lp: &mut Loop, conn: &mut Conn) {
        let _ = (lp, conn);
    }
    /// The protocol's next deadline, if any.
    fn deadline(&self, lp: &Loop, conn: &Conn) -> Option<Instant> {
        let _ = (lp, conn);
        None
    }
    /// The deadline armed from [`deadline`](Handler::deadline) passed.
    fn timeout(&self, lp: &mut Loop, conn: &mut Conn, now: Instant) {
        let _ = (lp, conn, now);
    }
    /// Memory came back after the connection [parked](Loop::park_for_memory) for it: go on
    /// (or park again).
    fn memory(&self, lp: &mut Loop, conn: &mut Conn) {
        let _ = (lp, conn);
    }
    /// The connection is removed: give back what the protocol held for it.
    fn removed(&self, lp: &mut Loop, conn: &mut Conn);
}

/// A connection's protocol: its [`Handler`], its state, and its framing (the [`Codec`] its
/// link cuts frames with).
pub struct Role {
    pub(super) handler: &'static dyn Handler,
    pub(super) state: Box<dyn Any + Send>,
    pub(super) codec: Arc<dyn Codec>,
}

/// The transport of a connection: its provider's link (the driver never asks which).
pub type Transport = Box<dyn Link>;

/// How a connection is being closed.
pub struct Closing {
    /// Give up flushing (and waiting for device completions) at this time.
    pub deadline: Instant,
    /// Why, for the log.
    pub reason: String,
}

/// One connection.
pub struct Conn {
    /// Its key in the loop's table.
    pub key: ConnKey,
    /// The peer's address or name, for logs and errors.
    pub peer: String,
    /// The provider's link.
    pub transport: Transport,
    /// The protocol that runs on it.
    pub role: Role,
    /// The peer proved the secret (or none was required); only then may anything be
    /// allocated, registered or exposed for it.
    pub authenticated: bool,
    /// The deadline this connection last armed and that has not fired.
    pub(crate) armed: Option<Instant>,
    /// Last time the connection did anything (idle accounting).
    pub last_active: Instant,
    /// Set once the connection is closing: nothing more is read, it lingers until its
    /// sends are out and its device work completed (or the deadline passes).
    pub closing: Option<Closing>,
    /// The socket is registered with the poll (stream transports and verbs control).
    pub(crate) registered: bool,
}

/// Something to run on the loop.
pub trait Job: Send + 'static {
    /// Runs it, with the loop.
    fn run(self: Box<Self>, lp: &mut Loop);
    /// It will never run: the loop stopped first, or its owner took it back
    /// ([`Driver::take_jobs`](super::Driver::take_jobs)). Answer whoever waits on it.
    fn cancel(self: Box<Self>) {}
    /// The endpoint it belongs to, if it can be taken back by id.
    fn owner(&self) -> Option<u64> {
        None
    }
}

/// Who takes the connections a listener accepts: the protocol that owns the port.
pub trait Acceptor: Sync {
    /// Whether connections waiting on listener `id` are taken now; `false` leaves them in
    /// the backlog until the owner calls [`Loop::accept`] (a mesh that has not started).
    fn accepting(&self, lp: &Loop, id: u64) -> bool {
        let _ = (lp, id);
        true
    }
    /// A connection accepted on listener `id`, from `peer`.
    fn accepted(&self, lp: &mut Loop, id: u64, peer: String, transport: Transport);
}

/// A listener in the loop's table.
pub(crate) struct Listening {
    pub(super) socket: ListenSocket,
    pub(super) acceptor: &'static dyn Acceptor,
}

/// A protocol's loop-wide hooks, registered once per loop ([`Loop::add_service`]). Its
/// connections have their own hooks ([`Handler`](super::Handler)); these are for what is
/// not one connection's: blocks waiting for a buffer, a budget shared by every connection.
pub trait Service: Sync + 'static {
    /// Memory came back (a pool lease, budget bytes): serve what waited for it, in order.
    /// Returns whether something still waits (the loop then keeps listening for releases).
    fn memory(&self, lp: &mut Loop) -> bool {
        let _ = lp;
        false
    }
    /// Whether an answer to a request of this protocol is on its way: the loop thread then
    /// polls briefly before it sleeps ([`DriverConfig::spin`](super::DriverConfig::spin)).
    fn awaiting_answers(&self, lp: &Loop) -> bool {
        let _ = lp;
        false
    }
    /// The loop shuts down: close the protocol's endpoints. Connections still open are
    /// failed by the loop after every service closed.
    fn shutdown(&self, lp: &mut Loop) {
        let _ = lp;
    }
}
