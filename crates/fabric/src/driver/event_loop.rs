//! The loop thread: its state ([`Loop`]), the `mio` tokens, the table of connections, and
//! what drives one connection (I/O, sessions, timers, closing).

use super::types::{Closing, Conn, ConnKey, Loop, Role, Shared, Slot, Transport, CLOSE_LINGER, DRIVE_BUDGET};
use crate::error::FabricError;
use crate::providers::link::{Authenticated, EngineCtx, Notify, ProviderEngine};
use mio::{Events, Poll, Token};
use std::any::{Any, TypeId};

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) const WAKER: Token = Token(0);
/// The provider engine's own descriptors (the verbs completion channel).
const ENGINE_EVENTS: Token = Token(1);
const LISTENER_BIT: usize = 1 << 62;
const CONN_BIT: usize = 2 << 62;
const KIND_MASK: usize = 3 << 62;
/// While polled links are read in memory, one spin turn in this many runs `epoll_wait(0)`
/// (for sockets, the waker, hang-ups and timers' neighbours): often enough that a socket
/// event waits a handful of microseconds at most, rarely enough that a spin turn over shm is
/// mostly memory reads.
const POLL_EVERY: u32 = 8;

fn conn_token(k: ConnKey) -> Token {
    Token(CONN_BIT | (((k.gen as usize) & 0x3fff_ffff) << 32) | k.index as usize)
}

pub(super) fn listener_token(id: u64) -> Token {
    Token(LISTENER_BIT | (id as usize & !KIND_MASK))
}

/// Builds the loop's per-loop provider state: the provider's engine, its descriptors (a
/// completion channel) registered under [`ENGINE_EVENTS`].
pub(super) fn new_engine(shared: &Arc<Shared>, poll: &Poll) -> Result<Box<dyn ProviderEngine>, FabricError> {
    let notify: Arc<dyn Notify> = shared.clone();
    let ctx = EngineCtx {
        name: &shared.name,
        registry: poll.registry(),
        token: ENGINE_EVENTS,
        notify,
        counters: shared.stats.provider.clone(),
    };
    shared.provider.engine(ctx)
}

impl Loop {
    /// One turn: waits for events (at most `cap`, and never past the next timer), then runs
    /// everything they and the queued commands ask for. `Some(worked)` says whether there was
    /// anything to do; `None` that the loop has stopped (after a shutdown, once every
    /// connection closed or the linger passed). Whoever holds the loop runs it: its own
    /// thread, or a caller driving progress ([`super::progress`]).
    pub(super) fn turn(&mut self, events: &mut Events, cap: Option<Duration>) -> Option<bool> {
        let now = Instant::now();
        let mut timeout = self.timers.next().map(|t| t.saturating_duration_since(now));
        if !self.again.is_empty() || !self.deferred.is_empty() || self.mem_dirty || self.shared.mem_wake.load(Ordering::Acquire) {
            timeout = Some(Duration::ZERO);
        }
        if let Some(c) = cap {
            timeout = Some(timeout.map_or(c, |t| t.min(c)));
        }
        if let Some(x) = self.exiting {
            timeout = Some(timeout.unwrap_or(Duration::from_millis(50)).min(Duration::from_millis(50)));
            if Instant::now() >= x || self.conns.iter().all(|s| s.conn.is_none()) {
                return None;
            }
        }
        let spinning = timeout == Some(Duration::ZERO);
        if !spinning && self.arm_polled() {
            timeout = Some(Duration::ZERO);
        }
        // A spin turn with polled links reads them in memory below; the epoll_wait(0) that
        // would see sockets, the waker and hang-ups runs on every POLL_EVERY-th such turn
        // only (it was the largest cost of a spin turn over shm, measured with perf).
        let skip_poll = spinning && !self.polled.is_empty() && self.polls_skipped + 1 < POLL_EVERY;
        if skip_poll {
            self.polls_skipped += 1;
            events.clear();
        } else {
            self.polls_skipped = 0;
            if let Err(e) = self.poll.poll(events, timeout) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!(driver = %self.shared.name, error = %e, "poll failed; the loop stops");
                    self.exiting = Some(Instant::now());
                    return None;
                }
            }
        }
        let mut worked = !events.is_empty();
        for ev in events.iter() {
            let t = ev.token();
            match t.0 & KIND_MASK {
                _ if t == WAKER => {}
                _ if t == ENGINE_EVENTS => self.engine_events(),
                LISTENER_BIT => self.accept((t.0 & !KIND_MASK) as u64),
                CONN_BIT => {
                    let index = (t.0 & 0xffff_ffff) as u32;
                    let gen = ((t.0 >> 32) & 0x3fff_ffff) as u32;
                    let Some(slot) = self.conns.get(index as usize) else { continue };
                    if slot.gen & 0x3fff_ffff != gen {
                        continue;
                    }
                    let key = ConnKey { index, gen: slot.gen };
                    let hung_up = ev.is_read_closed() || ev.is_error();
                    if ev.is_readable() || hung_up {
                        if let Some(conn) = self.conn_mut(key) {
                            conn.transport.on_readable(hung_up);
                        }
                    }
                    if ev.is_writable() {
                        self.on_writable(key);
                    }
                    self.drive(key);
                }
                _ => {}
            }
        }
        worked |= self.commands();
        let ready: Vec<u64> = std::mem::take(&mut *self.shared.ready.lock());
        worked |= !ready.is_empty();
        for k in ready {
            if k & (1 << 63) != 0 {
                self.accept(k & !(1 << 63));
            } else {
                self.drive(ConnKey::from_u64(k));
            }
        }
        // A completion channel is edge-like (one event per arm): poll the engine on every
        // turn too, it is cheap and catches completions of work posted above.
        self.engine_events();
        if self.shared.mem_wake.swap(false, Ordering::AcqRel) || std::mem::take(&mut self.mem_dirty) {
            self.service_memory();
        }
        worked |= self.run_deferred();
        // No event is behind these (a command ran on the link, memory came back, an armed
        // link had input): a look that costs no system call will do. On shm, `next`'s
        // liveness read of the control socket after every send's command was a tenth of a
        // 4 KiB allreduce (perf); a hang-up still comes as an event.
        let again = std::mem::take(&mut self.again);
        for k in again {
            self.drive_as(k, true);
        }
        if spinning {
            for i in 0..self.polled.len() {
                let Some(&k) = self.polled.get(i) else { break };
                // A look at the ring first: an empty one costs no take, put or timer.
                if self.conn_mut(k).is_some_and(|c| c.transport.memory_polled().is_some_and(|m| m.ready())) {
                    worked |= self.drive_as(k, true);
                }
            }
        }
        self.fire_timers();
        Some(worked)
    }

    /// Before a turn that may sleep: arms every polled link that can read (one that waits for
    /// memory is woken by the memory's return); whether one has something already.
    fn arm_polled(&mut self) -> bool {
        let mut ready = false;
        for i in 0..self.polled.len() {
            let k = self.polled[i];
            let Some(conn) = self.conn_mut(k) else { continue };
            if !conn.role.handler().blocked(conn) && conn.transport.memory_polled().is_some_and(|m| m.arm()) {
                ready = true;
                self.again.push(k);
            }
        }
        ready
    }

    /// The loop thread's spin rule: whether its next turn should poll without sleeping.
    /// It spins only while an answer is on its way to a request of ours: then it saves the
    /// loop a wake-up. Spinning otherwise, after a reply sent or a block delivered, only takes
    /// a core from the thread that the block woke (on two cores, measured: the one-at-a-time
    /// latency grew by about twice the spin).
    pub(super) fn spin_now(&self, spin_until: Option<Instant>) -> bool {
        spin_until.is_some_and(|u| Instant::now() < u) && self.awaiting_answers()
    }

    /// Called once the loop stopped for good.
    pub(super) fn finish(&mut self) {
        self.close_everything("the engine stopped");
        // Protocols' state goes with the loop (a delivery thread it owns ends here, after
        // delivering what the close failed).
        self.states.clear();
        tracing::debug!(driver = %self.shared.name, "loop stopped");
    }

    /// The protocol state of type `T` this loop keeps (a protocol's endpoints by id), made
    /// with `T::default()` on first use. Only the loop's holder reaches it, so it needs no lock.
    pub fn state<T: Any + Send + Default>(&mut self) -> &mut T {
        // A list, not a map: a loop holds a state or two, and this runs several times per
        // block; a scan of TypeIds is cheaper than hashing one.
        let id = TypeId::of::<T>();
        let i = match self.states.iter().position(|(t, _)| *t == id) {
            Some(i) => i,
            None => {
                self.states.push((id, Box::new(T::default())));
                self.states.len() - 1
            }
        };
        self.states[i].1.downcast_mut().unwrap_or_else(|| unreachable!("a loop state is keyed by its own type"))
    }

    /// The peer of `conn` proved the protocol's secret (or none is required): the
    /// connection is marked authenticated, and its link is told (only now may it create,
    /// register or expose anything for the peer). `exposes`: this side exposes regions for
    /// the peer to read. `Ok(true)`: messages flow; `Ok(false)`: the link attaches its data
    /// plane first and reports [`Incoming::Attached`](crate::driver::Incoming::Attached)
    /// once it is up (what is sent meanwhile waits). Called once per connection.
    pub fn authenticated(&mut self, conn: &mut Conn, exposes: bool) -> Result<bool, FabricError> {
        conn.authenticated = true;
        let Conn { transport, role, .. } = conn;
        let r = transport.authenticated(&Authenticated { codec: role.codec(), exposes });
        self.update_registered();
        r
    }

    /// The driver's counters.
    pub fn stats(&self) -> &super::DriverStats {
        &self.shared.stats
    }

    /// The driver's name (the executor id, or `mobius-<rank>`), for logs.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// What a pool of this loop's protocol calls when memory comes back, so the loop wakes
    /// and serves the connections [parked](Loop::park_for_memory) for it (the pool holds it
    /// weakly).
    pub fn release_hook(&self) -> Arc<dyn crate::memory::pool::ReleaseHook> {
        self.shared.clone()
    }

    /// [`state`](Self::state), if it was made.
    pub fn state_ref<T: Any + Send>(&self) -> Option<&T> {
        let id = TypeId::of::<T>();
        self.states.iter().find(|(t, _)| *t == id).and_then(|(_, v)| v.downcast_ref())
    }

    // ------------------------------------------------------------------ connection table

    /// Adds a connection over `transport` run by `role`, not yet in the poll: the caller may
    /// queue its first frames, then [`activate`](Self::activate)s it.
    pub fn insert(&mut self, peer: String, transport: Transport, role: Role) -> ConnKey {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(Slot { gen: 0, conn: None });
                (self.conns.len() - 1) as u32
            }
        };
        let slot = &mut self.conns[index as usize];
        slot.gen = slot.gen.wrapping_add(1) & 0x3fff_ffff;
        let key = ConnKey { index, gen: slot.gen };
        let now = Instant::now();
        slot.conn = Some(Conn {
            key,
            peer,
            transport,
            role,
            authenticated: false,
            armed: None,
            last_active: now,
            closing: None,
            registered: false,
        });
        self.shared.stats.connections_open.fetch_add(1, Ordering::Relaxed);
        key
    }

    /// Registers the connection's socket (if it has one) and its sim notifier, then drives it
    /// once (messages may be waiting already).
    pub fn activate(&mut self, key: ConnKey) {
        let Some(mut conn) = self.take(key) else { return };
        let token = conn_token(key);
        let res = conn.transport.register(self.poll.registry(), token, key.to_u64());
        if conn.transport.memory_polled().is_some() {
            self.polled.push(key);
        }
        match res {
            Ok(registered) => conn.registered = registered,
            Err(e) => {
                let err = FabricError::io(&conn.peer, "register", e);
                self.fail(&mut conn, err);
            }
        }
        self.put(conn);
        self.drive(key);
    }

    /// Takes connection `key` out of the table to handle it (`None` if it is gone); every
    /// take is followed by a [`put`](Self::put).
    pub fn take(&mut self, key: ConnKey) -> Option<Conn> {
        let slot = self.conns.get_mut(key.index as usize)?;
        if slot.gen != key.gen {
            return None;
        }
        slot.conn.take()
    }

    /// Puts a connection back after handling it, or removes it for good when it finished
    /// closing.
    pub fn put(&mut self, mut conn: Conn) {
        self.after(&mut conn);
        if self.finished(&mut conn) {
            self.remove(conn);
            return;
        }
        let key = conn.key;
        if let Some(slot) = self.conns.get_mut(key.index as usize) {
            if slot.gen == key.gen {
                slot.conn = Some(conn);
            }
        }
    }

    /// Connection `key`, if it is in the table.
    pub fn conn_ref(&self, key: ConnKey) -> Option<&Conn> {
        let slot = self.conns.get(key.index as usize)?;
        if slot.gen != key.gen {
            return None;
        }
        slot.conn.as_ref()
    }

    fn conn_mut(&mut self, key: ConnKey) -> Option<&mut Conn> {
        let slot = self.conns.get_mut(key.index as usize)?;
        if slot.gen != key.gen {
            return None;
        }
        slot.conn.as_mut()
    }

    /// Whether `key` is a connection that is not closing.
    pub fn live(&self, key: ConnKey) -> bool {
        self.conns
            .get(key.index as usize)
            .is_some_and(|s| s.gen == key.gen && s.conn.as_ref().is_some_and(|c| c.closing.is_none()))
    }

    fn remove(&mut self, mut conn: Conn) {
        let key = conn.key;
        if conn.registered {
            let _ = conn.transport.deregister(self.poll.registry());
        }
        self.polled.retain(|k| *k != key);
        self.parked.retain(|k| *k != key);
        self.role_removed(&mut conn);
        conn.transport.shutdown();
        self.shared.stats.connections_open.fetch_sub(1, Ordering::Relaxed);
        if let Some(slot) = self.conns.get_mut(key.index as usize) {
            if slot.gen == key.gen {
                slot.conn = None;
                self.free.push(key.index);
            }
        }
        self.update_registered();
    }

    /// Refreshes the registered-bytes gauge after a protocol registered or released memory.
    pub fn update_registered(&self) {
        self.shared.stats.registered_bytes.store(self.engine.registered_bytes(), Ordering::Relaxed);
    }

    // ------------------------------------------------------------------ driving

    /// Handles everything that arrived on `key` (up to a budget; the rest on the next turn).
    pub fn drive(&mut self, key: ConnKey) {
        self.drive_as(key, false);
    }

    /// [`drive`](Self::drive); `polled`: no event is behind it (a polled link on a spin
    /// turn). Whether anything arrived.
    fn drive_as(&mut self, key: ConnKey, polled: bool) -> bool {
        let Some(mut conn) = self.take(key) else { return false };
        let mut got = false;
        if conn.closing.is_none() {
            let mut budget = DRIVE_BUDGET;
            while budget > 0 && conn.closing.is_none() && !self.blocked(&conn) {
                budget -= 1;
                let codec = &*conn.role.codec;
                let looked = if polled { conn.transport.memory_polled().map(|m| m.next_polled(codec)) } else { None };
                let next = match looked {
                    Some(next) => next,
                    None => conn.transport.next(codec),
                };
                match next {
                    Ok(Some(inc)) => {
                        got = true;
                        conn.last_active = Instant::now();
                        self.incoming(&mut conn, inc);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.fail(&mut conn, e);
                        break;
                    }
                }
            }
            if budget == 0 {
                self.again.push(key);
            }
        }
        if conn.closing.is_some() {
            // A closing connection reads nothing but must still collect device completions
            // (the flushes that give back the buffers its posted work targets).
            while let Ok(Some(inc)) = conn.transport.next(&*conn.role.codec) {
                self.incoming(&mut conn, inc);
            }
        }
        self.put(conn);
        got
    }

    fn on_writable(&mut self, key: ConnKey) {
        let Some(mut conn) = self.take(key) else { return };
        match conn.transport.on_writable() {
            Ok(true) => self.connected(&mut conn),
            Ok(false) => {}
            Err(e) => self.fail(&mut conn, e),
        }
        self.put(conn);
    }

    /// A pending connect completed.
    fn connected(&mut self, conn: &mut Conn) {
        conn.role.handler().connected(self, conn);
    }

    /// Whether the connection cannot read on for now (its payload waits for memory).
    fn blocked(&self, conn: &Conn) -> bool {
        conn.role.handler().blocked(conn)
    }

    fn incoming(&mut self, conn: &mut Conn, inc: crate::providers::link::Incoming) {
        conn.role.handler().incoming(self, conn, inc);
    }

    /// The transport failed (or the peer went away): the role fails its work, the
    /// connection closes without lingering.
    pub fn fail(&mut self, conn: &mut Conn, error: FabricError) {
        if conn.closing.is_some() {
            return;
        }
        let flush = conn.role.handler().failed(self, conn, &error);
        self.close(conn, format!("{error}"), flush);
    }

    /// Starts closing: with `flush`, frames still queued (an `Error` for the peer) go out
    /// first. The transport stops (a verbs queue pair goes to the error state, which flushes
    /// its posted work); the connection is removed once nothing posted is outstanding.
    pub fn close(&mut self, conn: &mut Conn, reason: String, flush: bool) {
        if conn.closing.is_some() {
            return;
        }
        tracing::debug!(driver = %self.shared.name, peer = %conn.peer, %reason, "closing connection");
        conn.closing = Some(Closing { deadline: Instant::now() + CLOSE_LINGER, reason });
        if !flush || conn.transport.sends_done() {
            conn.transport.shutdown();
        }
        self.update_registered();
    }

    /// Whether a closing connection may be removed now.
    fn finished(&mut self, conn: &mut Conn) -> bool {
        let Some(closing) = &conn.closing else { return false };
        let late = Instant::now() >= closing.deadline;
        if !conn.transport.sends_done() && !late {
            return false;
        }
        conn.transport.shutdown();
        if conn.transport.busy() && !late {
            return false;
        }
        if conn.transport.busy() {
            self.shared.stats.unflushed_closes.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(driver = %self.shared.name, peer = %conn.peer, reason = %closing.reason,
                "device work still outstanding after the close limit; its buffers are kept, not reused");
        }
        true
    }

    /// After a connection was handled: send what its role queued, arm its next deadline.
    fn after(&mut self, conn: &mut Conn) {
        if conn.closing.is_none() {
            conn.role.handler().after(self, conn);
        }
        let deadline = self.deadline(conn);
        if let Some(d) = deadline {
            self.timers.arm(conn.key.to_u64(), d, &mut conn.armed);
        }
    }

    fn deadline(&self, conn: &Conn) -> Option<Instant> {
        if let Some(c) = &conn.closing {
            return Some(c.deadline);
        }
        conn.role.handler().deadline(self, conn)
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some((t, k)) = self.timers.pop_due(now) {
            let key = ConnKey::from_u64(k);
            let Some(mut conn) = self.take(key) else { continue };
            if conn.armed == Some(t) {
                conn.armed = None;
            }
            if conn.closing.is_none() {
                conn.role.handler().timeout(self, &mut conn, now);
            }
            self.put(conn);
        }
    }

    /// A removed connection: its role gives back what it held.
    fn role_removed(&mut self, conn: &mut Conn) {
        conn.role.handler().removed(self, conn);
    }
}
