//! The driver: one readiness loop per engine that runs every connection.
//!
//! # Threads
//!
//! A [`Driver`] owns one thread, whatever the number of peers: the **loop**
//! (`rdma-shuffle-loop-<name>`), a `mio` poll over every socket (listeners, tcp
//! connections, verbs control sockets), the verbs completion channel, and a waker for jobs
//! from other threads. It runs every connection's protocol, timers, memory backpressure, and
//! all I/O. A protocol may add a thread of its own once per loop (the shuffle's block client
//! adds one that hands outcomes to slow sinks), never one per peer.
//!
//! The loop spins briefly ([`DriverConfig::spin`]) after a turn with work before it sleeps
//! in the kernel, so an answer that follows a request closely costs no wake-up.
//!
//! The loop thread is the loop's *default* runner, not its only one: the loop's state sits
//! behind a lock, and a caller that blocks for a message (a Mobius call) takes
//! it over and runs the turns on its own thread, as MPI's progress engine does
//! (`progress`). Its sends go out and its answers are read without any thread hand-off;
//! the loop thread steps aside while callers drive and takes over again once none has come
//! for a millisecond.
//! No thread is added for it.
//!
//! Why `mio`: it is the small, widely used readiness layer under tokio — epoll on Linux,
//! registration of raw file descriptors (the verbs completion channel) next to sockets, and
//! a cross-thread waker — without an async runtime the JVM process would have to host. The
//! protocol logic already is a set of poll-style state machines; an executor would add
//! nothing but threads.
//!
//! # Rules of the loop
//!
//! * It never blocks: not on sockets (all nonblocking), not on memory (protocols
//!   `try_acquire`; a returned lease or budget wakes the loop through the
//!   [release hook](Driver::release_hook), and the loop serves what waited for it:
//!   [`Service::memory`], connections [parked](Loop::park_for_memory) for it).
//! * No locks are held across I/O: connections belong to the loop alone.
//! * Timers come from the protocols ([`Handler::deadline`]) and from the loop's own limits
//!   (close), in one heap.
//! * Work before authentication is bounded: protocols allocate, register or expose nothing
//!   for a connection until its peer proved the secret, and each keeps its unauthenticated
//!   connections under a cap of its own (counted in [`DriverStats::handshake_evictions`]).
//!
//! # Connections
//!
//! Every connection has a transport (a provider's [`Link`](crate::providers::link::Link):
//! tcp, sim, shm, verbs, whatever `providers/` holds; the driver never asks which) and a
//! [`Role`]: the protocol that runs on it and its state. The protocols live with their
//! owners: the shuffle's block client and server in `rdma_shuffle_shuffle::blocks`, Mobius's
//! mesh links in `mobius_collective::mesh`, and the shuffle's raw test channel
//! (`rdma_shuffle_shuffle::channel`, feature `testing`) for the provider conformance suites.
//!
//! # How a protocol plugs in
//!
//! The loop names no protocol. A protocol gives it:
//! * a [`Handler`] for its connections (`Role::new(&MyHandler, state, codec)` at
//!   [`Loop::insert`]): what to do when frames or messages arrive, a connect completes, a deadline passes, the
//!   link fails, memory it [parked](Loop::park_for_memory) for comes back, or it is removed;
//! * an [`Acceptor`] for each listener it opens ([`Loop::listen`]);
//! * [`Job`]s from its callers' threads ([`Driver::submit`]), which run with the loop in hand;
//! * its loop-wide bookkeeping (its endpoints by id) as [`Loop::state`], typed and lock-free;
//! * a [`Codec`] for its frames: the loop's links ask it only how long a frame is (and
//!   where a provider's bootstrap record goes), and hand the protocol the frame's fixed part
//!   to decode ([`Incoming::Frame`], [`Incoming::Message`]) and its payload where the
//!   protocol places it.

mod commands;
mod conn;
mod event_loop;
mod job;
mod progress;
mod service;
mod sockets;
mod stats;
mod timers;
mod types;

pub use crate::providers::codec::{Codec, CodecError, FrameShape};
pub use crate::providers::link::{Authenticated, Capabilities, Incoming, MsgPayload, Placement};
pub use stats::DriverStats;
pub use types::{
    Acceptor, Closing, Conn, ConnKey, DriverConfig, Handler, Job, Loop, Role, Service, Transport, DEFAULT_SPIN, MAX_SPIN,
};
pub(crate) use types::{Command, Shared};

use crate::error::FabricError;
use crate::memory::pool::ReleaseHook;
use crate::providers::link::Notify;
use crate::providers::Provider;
use event_loop::WAKER;
use mio::{Poll, Waker};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use timers::Timers;

impl Shared {
    pub(crate) fn command(&self, c: Command) -> Result<(), FabricError> {
        if self.stopping.load(Ordering::Acquire) {
            return Err(FabricError::Shutdown);
        }
        self.commands.lock().push(c);
        let _ = self.waker.wake();
        Ok(())
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn stop(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        self.commands.lock().push(Command::Shutdown);
        let _ = self.waker.wake();
        let t = self.thread.lock().take();
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Notify for Shared {
    fn notify(&self, key: u64) {
        self.ready.lock().push(key);
        let _ = self.waker.wake();
    }
}

impl ReleaseHook for Shared {
    fn released(&self) {
        if self.mem_wanted.load(Ordering::Acquire) && !self.mem_wake.swap(true, Ordering::AcqRel) {
            let _ = self.waker.wake();
        }
    }
}

struct Owner {
    shared: Arc<Shared>,
    progress: Arc<progress::Progress>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.shared.stop();
    }
}

/// One engine's event loop. Cheap to clone; the loop stops when the last clone (and every
/// endpoint made on it) is gone, or at [`shutdown`](Driver::shutdown).
#[derive(Clone)]
pub struct Driver {
    owner: Arc<Owner>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Driver({}, {})", self.owner.shared.name, self.owner.shared.provider.name())
    }
}

impl Driver {
    /// Starts a loop over `provider`.
    pub fn new(provider: Arc<dyn Provider>, config: DriverConfig) -> Result<Driver, FabricError> {
        let poll = Poll::new().map_err(|e| FabricError::io("local", "create the poll of", e))?;
        let waker = Waker::new(poll.registry(), WAKER).map_err(|e| FabricError::io("local", "create the waker of", e))?;
        let shared = Arc::new(Shared {
            name: config.name.clone(),
            provider: provider.clone(),
            config,
            waker,
            commands: Mutex::new(Vec::new()),
            ready: Mutex::new(Vec::new()),
            mem_wake: AtomicBool::new(false),
            mem_wanted: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            yield_when_idle: AtomicBool::new(false),
            thread: Mutex::new(None),
            stats: DriverStats::default(),
            next_id: AtomicU64::new(1),
        });
        let engine = event_loop::new_engine(&shared, &poll)?;
        let lp = Loop {
            shared: shared.clone(),
            poll,
            conns: Vec::new(),
            listeners: HashMap::new(),
            free: Vec::new(),
            services: Vec::new(),
            deferred: Vec::new(),
            parked: VecDeque::new(),
            states: Vec::new(),
            timers: Timers::default(),
            again: Vec::new(),
            polled: Vec::new(),
            polls_skipped: 0,
            mem_dirty: false,
            engine,
            exiting: None,
        };
        // The gauge includes what the provider registered for this loop from the start (verbs:
        // the shared receive queue and the send buffers), before anyone can read it.
        lp.update_registered();
        let name = format!("rdma-shuffle-loop-{}", shared.name);
        let progress = Arc::new(progress::Progress::new(lp));
        let runner = progress.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || runner.run_thread())
            .map_err(|e| FabricError::io("local", "start the loop thread of", e))?;
        *shared.thread.lock() = Some(thread);
        tracing::debug!(name = %shared.name, provider = provider.name(), "driver started");
        Ok(Driver { owner: Arc::new(Owner { shared, progress }) })
    }

    /// Runs `f` on the loop (on its thread, or on a caller's that drives it): how a protocol
    /// outside the driver adds endpoints, sends and closes. Fails once the loop stops.
    pub fn submit(&self, f: impl FnOnce(&mut Loop) + Send + 'static) -> Result<(), FabricError> {
        self.submit_job(Box::new(job::FnJob(f)))
    }

    /// Runs `job` on the loop ([`submit`](Driver::submit) for a [`Job`] with an owner or a
    /// cancel action).
    pub fn submit_job(&self, job: Box<dyn Job>) -> Result<(), FabricError> {
        self.owner.shared.command(Command::Run(job))
    }

    /// Queues `f` for the loop without waking its thread: for a caller that drives the loop
    /// itself right after ([`progress`](Driver::progress)), so the job costs no wake-up.
    pub fn submit_quiet(&self, f: impl FnOnce(&mut Loop) + Send + 'static) -> Result<(), FabricError> {
        let s = &self.owner.shared;
        if s.stopping.load(Ordering::Acquire) {
            return Err(FabricError::Shutdown);
        }
        s.commands.lock().push(Command::Run(Box::new(job::FnJob(f))));
        Ok(())
    }

    /// Takes back the queued jobs of endpoint `owner` that the loop has not run (the endpoint
    /// closes, or the loop stopped before it could): the caller answers them.
    pub fn take_jobs(&self, owner: u64) -> Vec<Box<dyn Job>> {
        let mut q = self.owner.shared.commands.lock();
        let (mine, rest): (Vec<_>, Vec<_>) =
            std::mem::take(&mut *q).into_iter().partition(|c| matches!(c, Command::Run(j) if j.owner() == Some(owner)));
        *q = rest;
        mine.into_iter().filter_map(|c| if let Command::Run(j) = c { Some(j) } else { None }).collect()
    }

    /// Whether the loop is stopping or stopped (jobs submitted now are refused).
    pub fn stopping(&self) -> bool {
        self.owner.shared.stopping.load(Ordering::Acquire)
    }

    /// What a protocol hands its pools and budgets so that memory coming back wakes the
    /// loop, which then serves what waited for it ([`Service::memory`], parked connections).
    /// Held weakly by whoever calls it.
    pub fn release_hook(&self) -> Arc<dyn ReleaseHook> {
        self.owner.shared.clone()
    }

    /// A fresh id for an endpoint or listener of this loop.
    pub fn next_id(&self) -> u64 {
        self.owner.shared.next_id()
    }

    /// Whether a caller driving progress yields its core between polls while it spins
    /// (`sched_yield`), as Open MPI's `mpi_yield_when_idle` does when a host is
    /// oversubscribed: a spinning waiter then takes the core from the very peer it waits for.
    pub fn set_yield_when_idle(&self, yes: bool) {
        self.owner.shared.yield_when_idle.store(yes, Ordering::Relaxed);
    }

    /// Runs `f` with the loop on this thread at once if nobody holds it, after the commands
    /// other threads queued (so what they queued before goes first); `Err(f)` when the loop
    /// is held (its thread sleeps in it, or another caller drives it): queue the work then.
    /// No turn runs after `f`: a caller that waits next drives the loop anyway. This is the
    /// path of a small send from a caller that drives progress: no boxed job, no queue.
    pub fn try_run<R, F: FnOnce(&mut Loop) -> R>(&self, f: F) -> Result<R, F> {
        match self.owner.progress.lp.try_lock() {
            Some(mut lp) => {
                lp.commands();
                Ok(f(&mut lp))
            }
            None => Err(f),
        }
    }

    /// Runs one loop turn on this thread if nobody holds the loop (it picks up queued
    /// commands without sleeping); otherwise rings the waker of whoever sleeps in it.
    pub fn kick(&self) {
        progress::kick(&self.owner.progress, &self.owner.shared);
    }

    /// Runs the loop on the calling thread until `done` gives a value, `deadline` passes or
    /// the loop stops (then `None`): see [`progress`](self::progress) for why and how. `done`
    /// is called between turns with the loop held, so it must not take the loop itself.
    pub fn progress<R>(&self, deadline: Instant, done: impl FnMut() -> Option<R>) -> Option<R> {
        progress::drive(&self.owner.progress, &self.owner.shared, deadline, done)
    }

    /// The provider's name.
    pub fn provider_name(&self) -> &'static str {
        self.owner.shared.provider.name()
    }

    /// The provider.
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.owner.shared.provider
    }

    /// The driver's name.
    pub fn name(&self) -> &str {
        &self.owner.shared.name
    }

    /// Counters and gauges.
    pub fn stats(&self) -> &DriverStats {
        &self.owner.shared.stats
    }

    /// Provider-specific counters as `(name, value)` pairs (empty on tcp).
    pub fn provider_counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.owner.shared;
        s.provider.counters(&s.stats.provider)
    }

    /// Stops the loop: every connection closes (outstanding blocks fail), posted device work
    /// is collected, the threads end. Idempotent; also done when the last handle drops.
    pub fn shutdown(&self) {
        self.owner.shared.stop();
    }
}
