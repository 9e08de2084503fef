//! What the ofi provider keeps per driver loop: one reliable-datagram endpoint (opened when
//! the first connection attaches, in the provider's domain or, for tcp, in the domain of the
//! interface its peers reach it on), the routing of messages and completions to connections,
//! the address vector's references, the send buffers where the provider needs registered
//! ones, the copies exposed for one-sided read, and how the loop learns that completions wait
//! (the completion queue's descriptor in its poll where libfabric offers one, with a look
//! every [`SAFETY_TICK`] while connections are open; else it is polled each turn and, while
//! idle, woken every [`IDLE_TICK`]).
#![forbid(unsafe_code)]

use crate::attach::{decode_revoke, read_trailer, Grant, Kind};
use crate::config::{OfiConfig, PeerAddr, RemoteRegion};
use crate::error::OfiError;
use crate::sys::{Buffer, Completion, Domain, Endpoint, Exposure};
use crate::SEND_BUFFERS;
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::providers::link::{EngineCtx, FailedRead, Notify, ProviderCounters};
use rdma_shuffle_fabric::providers::Source;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A loop's engine as the loop and its links hold it. Only the loop's holder calls into
/// links and engine, so the lock is never contended; it is what lets every link reach the
/// endpoint and the routing without a type look-up.
pub(crate) type SharedEngine = Arc<parking_lot::Mutex<OfiEngine>>;

/// Reads in flight over the whole engine (the completion queue is sized for them).
pub(crate) const MAX_READS: usize = 1024;
/// Reads in flight per connection.
pub(crate) const MAX_READS_PER_LINK: usize = 64;
/// Sends in flight over the whole engine where they go from unregistered memory.
const MAX_SENDS: usize = 1024;
/// Without a completion descriptor the loop keeps turning this long after the last
/// completion or post, then looks every [`IDLE_TICK`].
const SPIN: Duration = Duration::from_micros(200);
/// How often an idle engine without a completion descriptor is looked at.
pub(crate) const IDLE_TICK: Duration = Duration::from_millis(1);
/// How often an idle engine that sleeps on its completion descriptor looks anyway while it
/// has connections. ofi_rxm's descriptor does not always wake its sleeper: over
/// `verbs;ofi_rxm` with a shared receive context, a new connection's first message sat
/// unseen until something else woke the loop (3 runs in 12 of the shuffle's conformance
/// suite in the SoftRoCE VM stalled 20 s; 0 in 12 when polled). A look costs one
/// `fi_cq_read`; the descriptor still wakes the loop at once for what it does signal.
const SAFETY_TICK: Duration = Duration::from_millis(10);
/// Completions taken in one turn before the loop gets to its other work.
const TURN_COMPLETIONS: usize = 512;
/// A key the loop routes nowhere: `notify` with it only wakes the loop for another turn.
const NO_CONN: u64 = u32::MAX as u64;

const SEND_TOKEN: u64 = 1 << 62;
const READ_TOKEN: u64 = 2 << 62;
const KIND_MASK: u64 = 3 << 62;

/// Regions a peer may have granted one connection at once: far above what a protocol's
/// exposure budget lets one server expose, so only a peer that ignores it reaches it.
const MAX_GRANTS: usize = 1 << 16;

/// Something that happened for one connection.
pub(crate) enum Event {
    /// A message for it arrived: its kind and its body (the trailer cut off).
    Message(Kind, Vec<u8>),
    /// One of its sends completed; `revoked`: it told the peer that region is revoked.
    Sent { revoked: Option<u32> },
    /// One of its sends failed.
    SendFailed { error: OfiError, revoked: Option<u32> },
    /// One of its reads finished: the lease comes back either way.
    ReadDone { tag: u64, lease: Lease, result: Result<(), FabricError> },
    /// The peer broke the provider's own protocol (a malformed grant).
    Broken(FabricError),
}

/// What the engine keeps for one connection: its events, in order, and the regions its peer
/// granted it (kept here, as their messages are routed, so a read looks them up as of the
/// last message that arrived, not the last one the connection handled).
#[derive(Default)]
struct Inbox {
    events: VecDeque<Event>,
    grants: HashMap<u32, Grant>,
}

/// Where messages to a connection id go.
struct Route {
    key: u64,
    /// The peer's address-vector entry, once known: messages whose reported source is
    /// another known entry are dropped (where the provider reports sources).
    peer: Option<PeerAddr>,
}

/// The result of offering a message to the endpoint.
pub(crate) enum Posted {
    /// Taken (posted, injected, or queued by the endpoint behind earlier posts).
    Yes { completes: bool },
    /// No send buffer now: the connection is driven again when one comes back.
    NoSlot,
}

/// Wakes an idle loop every [`IDLE_TICK`] while it has connections and no completion
/// descriptor to sleep on, every [`SAFETY_TICK`] where it has one (one thread per engine,
/// parked while not needed).
struct Ticker {
    wanted: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(name: &str, notify: Arc<dyn Notify>, every: Duration) -> std::io::Result<Ticker> {
        let wanted = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (wanted.clone(), stop.clone());
        let thread = std::thread::Builder::new().name(format!("rdma-shuffle-ofi-tick-{name}")).spawn(move || {
            while !s.load(Ordering::Acquire) {
                if w.load(Ordering::Acquire) {
                    std::thread::sleep(every);
                    notify.notify(NO_CONN);
                } else {
                    std::thread::park();
                }
            }
        })?;
        Ok(Ticker { wanted, stop, thread: Some(thread) })
    }

    fn want(&self, on: bool) {
        if self.wanted.swap(on, Ordering::AcqRel) != on && on {
            if let Some(t) = &self.thread {
                t.thread().unpark();
            }
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

pub(crate) struct OfiEngine {
    // Declaration order is drop order: the ticker stops, the endpoint closes (libfabric lets
    // go of every buffer and exposed copy), and only then are the spare copies freed.
    ticker: Option<Ticker>,
    ep: Option<Endpoint>,
    /// Exposure copies whose registration closed, kept for the next exposure rather than
    /// freed: a target-side provider (tcp) may still be writing a read's answer from one
    /// when its reader misbehaves, and must then find exposed bytes, not reused heap.
    spare: Vec<Box<[u8]>>,
    spare_bytes: usize,
    /// The most `spare` holds ([`Settings::spare_bytes`](crate::Settings::spare_bytes)):
    /// counted in the provider's fixed memory.
    spare_max: usize,
    name: String,
    cfg: OfiConfig,
    /// The provider's domain (pool memory is registered in it).
    domain: Domain,
    registry: Option<Registry>,
    token: Token,
    notify: Arc<dyn Notify>,
    pub(crate) counters: Arc<ProviderCounters>,
    routes: HashMap<u64, Route>,
    inbox: HashMap<u64, Inbox>,
    peers: HashMap<Vec<u8>, (PeerAddr, usize)>,
    send_free: Vec<Buffer>,
    /// Sends in flight, by id: their connection, and the region a revoke among them revokes.
    sends: HashMap<u64, (u64, Option<u32>)>,
    next_send: u64,
    send_waiters: VecDeque<u64>,
    reads: HashMap<u64, (u64, u64)>,
    next_read: u64,
    pub(crate) exposed_bytes: u64,
    completions: Vec<Completion>,
    last_activity: Instant,
    links: usize,
    /// Connections a link's own look at the queue ([`drain`](Self::drain)) found something
    /// for: handed to the loop with the next [`collect`](Self::collect).
    touched: Vec<u64>,
}

impl OfiEngine {
    /// The engine of one driver loop, with its endpoint open (in the provider's domain; a
    /// listener may move it to the address it binds, [`listening_on`](Self::listening_on)):
    /// opening one takes tens of milliseconds (ofi_rxm sizes its pools), which a driver pays
    /// when it starts rather than a connection when it attaches.
    pub(crate) fn new(domain: Domain, cfg: OfiConfig, spare_max: usize, ctx: EngineCtx<'_>) -> Result<Self, FabricError> {
        let registry = ctx.registry.try_clone().map_err(|e| FabricError::io("local", "clone the poll registry for", e))?;
        let mut e = OfiEngine {
            ticker: None,
            ep: None,
            spare: Vec::new(),
            spare_bytes: 0,
            spare_max,
            name: ctx.name.to_string(),
            cfg,
            domain,
            registry: Some(registry),
            token: ctx.token,
            notify: ctx.notify,
            counters: ctx.counters,
            routes: HashMap::new(),
            inbox: HashMap::new(),
            peers: HashMap::new(),
            send_free: Vec::new(),
            sends: HashMap::new(),
            next_send: 1,
            send_waiters: VecDeque::new(),
            reads: HashMap::new(),
            next_read: 1,
            exposed_bytes: 0,
            completions: Vec::with_capacity(64),
            last_activity: Instant::now(),
            links: 0,
            touched: Vec::new(),
        };
        e.open_endpoint(None)?;
        Ok(e)
    }

    /// A listener bound `ip`, where peers reach this engine. A tcp endpoint binds one
    /// interface's address; where it is not this one's (the provider's first interface was
    /// taken), and no connection uses the endpoint yet, it is opened again on `ip`'s.
    pub(crate) fn listening_on(&mut self, ip: IpAddr) -> Result<(), FabricError> {
        let Some(ep) = &self.ep else { return Ok(()) };
        let info = ep.info();
        if ip.is_unspecified() || !info.sockaddr || info.mr_local || self.links > 0 || ep.domain().source_ip() == Some(ip) {
            return Ok(());
        }
        self.close_endpoint();
        self.open_endpoint(Some(ip))
    }

    /// The largest message this engine's receive buffers take.
    pub(crate) fn max_msg(&self) -> usize {
        self.cfg.max_msg
    }

    /// The endpoint and its address.
    pub(crate) fn endpoint(&mut self) -> Result<(&mut Endpoint, Vec<u8>), FabricError> {
        let ep = self.ep.as_mut().ok_or_else(|| dead("the endpoint is not open"))?;
        let address = ep.address().map_err(ofi)?;
        Ok((ep, address))
    }

    fn open_endpoint(&mut self, ip: Option<IpAddr>) -> Result<(), FabricError> {
        // A tcp domain is one interface and its endpoints bind its address: another
        // interface's address is another domain (pool memory needs no registration there,
        // so the provider's domain is not needed for it).
        let domain = match ip {
            Some(ip) if self.domain.source_ip() != Some(ip) => {
                let cfg = OfiConfig { node: Some(ip.to_string()), domain: None, ..self.cfg.clone() };
                Domain::open(&cfg).map_err(|e| {
                    dead(&format!(
                        "no libfabric domain of '{}' binds {ip}, the address peers reach this engine on: {e}",
                        cfg.provider
                    ))
                })?
            }
            _ => self.domain.clone(),
        };
        let cfg = OfiConfig { cq_size: self.cfg.rx_depth + SEND_BUFFERS.max(MAX_SENDS) + MAX_READS + 64, ..self.cfg.clone() };
        let ep = Endpoint::open_in(&domain, &cfg).map_err(ofi)?;
        shm_opened(&ep);
        if let (Some(fd), Some(reg)) = (ep.wait_fd(), &self.registry) {
            reg.register(&mut SourceFd(&fd), self.token, Interest::READABLE)
                .map_err(|e| FabricError::io("local", "register the completion queue of", e))?;
        }
        if ep.info().mr_local {
            for _ in 0..SEND_BUFFERS {
                self.send_free.push(domain.alloc(self.cfg.max_msg, crate::sys::Access::Local).map_err(ofi)?);
            }
        }
        if self.ticker.is_none() {
            let every = if ep.wait_fd().is_some() { SAFETY_TICK } else { IDLE_TICK };
            let t = Ticker::start(&self.name, self.notify.clone(), every)
                .map_err(|e| FabricError::io("local", "start the idle ticker of", e))?;
            self.ticker = Some(t);
        }
        tracing::debug!(driver = %self.name, provider = %ep.info().provider, domain = %ep.info().domain,
            rma = ep.info().rma, wait_fd = ep.wait_fd().is_some(), "libfabric endpoint open");
        self.ep = Some(ep);
        Ok(())
    }

    fn close_endpoint(&mut self) {
        if let (Some(ep), Some(reg)) = (&self.ep, &self.registry) {
            if let Some(fd) = ep.wait_fd() {
                let _ = reg.deregister(&mut SourceFd(&fd));
            }
        }
        self.send_free.clear();
        if let Some(ep) = self.ep.take() {
            shm_keep(ep);
        }
    }

    /// A connection `key` exists (events are kept for it from now on).
    pub(crate) fn open_inbox(&mut self, key: u64) {
        self.inbox.entry(key).or_default();
        self.links += 1;
    }

    /// Connection `key` is gone: nothing more is kept for it.
    pub(crate) fn close_inbox(&mut self, key: u64) {
        if self.inbox.remove(&key).is_some() {
            self.links -= 1;
        }
        self.send_waiters.retain(|k| *k != key);
    }

    pub(crate) fn route(&mut self, conn_id: u64, key: u64, peer: Option<PeerAddr>) {
        self.routes.insert(conn_id, Route { key, peer });
    }

    pub(crate) fn unroute(&mut self, conn_id: u64, key: u64) {
        if self.routes.get(&conn_id).is_some_and(|r| r.key == key) {
            self.routes.remove(&conn_id);
        }
    }

    /// Inserts a peer's endpoint address (or takes another reference on it).
    pub(crate) fn insert_peer(&mut self, address: &[u8]) -> Result<PeerAddr, FabricError> {
        if let Some((p, n)) = self.peers.get_mut(address) {
            if *n == 0 {
                self.counters.qps_open.fetch_add(1, Ordering::Relaxed);
            }
            *n += 1;
            return Ok(*p);
        }
        let ep = self.ep.as_mut().ok_or_else(|| dead("the endpoint is not open"))?;
        let p = ep.insert_peer(address).map_err(ofi)?;
        self.peers.insert(address.to_vec(), (p, 1));
        self.counters.qps_created.fetch_add(1, Ordering::Relaxed);
        self.counters.qps_open.fetch_add(1, Ordering::Relaxed);
        Ok(p)
    }

    /// Lets go of a reference on a peer's address. The entry stays in the address vector:
    /// ofi_rxm (2.1) keeps its connection to a removed peer and, once the entry's index is
    /// reused, closes the wrong one when the endpoint closes (a crash, seen in the suite), so
    /// entries are kept for the endpoint's life and reused when the peer comes back. They
    /// are one per peer *endpoint* ever met (a Spark application's executors, a group's
    /// ranks), a few dozen bytes each.
    ///
    /// Posts to it libfabric has not taken yet are dropped with the last reference (a peer
    /// that vanished may refuse them for ever).
    pub(crate) fn release_peer(&mut self, address: &[u8]) {
        let Some((p, n)) = self.peers.get_mut(address) else { return };
        if *n == 0 {
            return;
        }
        *n -= 1;
        if *n > 0 {
            return;
        }
        let p = *p;
        self.counters.qps_open.fetch_sub(1, Ordering::Relaxed);
        let Some(ep) = self.ep.as_mut() else { return };
        let mut touched = Vec::new();
        for c in ep.forget_peer(p) {
            self.completion(c, &mut touched);
        }
    }

    /// Offers one message to `peer` for connection `key`: injected when small, else sent
    /// from its own memory, or copied into a registered send buffer where the provider needs
    /// one (none free: [`Posted::NoSlot`], and `key` is driven again when one comes back).
    ///
    /// `delivered`: the send completes only once the message reached the peer's endpoint
    /// (a connection's last message, see [`Endpoint::send_delivered`]); never injected.
    pub(crate) fn post(
        &mut self,
        peer: PeerAddr,
        key: u64,
        msg: Vec<u8>,
        delivered: bool,
        revoke: Option<u32>,
    ) -> Result<Posted, FabricError> {
        let ep = self.ep.as_mut().ok_or_else(|| dead("the endpoint is not open"))?;
        let len = msg.len();
        let c = &self.counters;
        if len <= ep.info().inject_size && !delivered {
            ep.inject(peer, &msg).map_err(ofi)?;
            c.sends.fetch_add(1, Ordering::Relaxed);
            c.send_bytes.fetch_add(len as u64, Ordering::Relaxed);
            self.last_activity = Instant::now();
            return Ok(Posted::Yes { completes: false });
        }
        let buf = if ep.info().mr_local {
            let Some(mut b) = self.send_free.pop() else {
                if !self.send_waiters.contains(&key) {
                    self.send_waiters.push_back(key);
                }
                return Ok(Posted::NoSlot);
            };
            b.as_mut_slice()[..len].copy_from_slice(&msg);
            b
        } else {
            if self.sends.len() >= MAX_SENDS {
                if !self.send_waiters.contains(&key) {
                    self.send_waiters.push_back(key);
                }
                return Ok(Posted::NoSlot);
            }
            Buffer::owned(msg.into_boxed_slice())
        };
        let id = self.next_send;
        self.next_send += 1;
        let token = SEND_TOKEN | id;
        let posted = if delivered { ep.send_delivered(peer, buf, len, token) } else { ep.send(peer, buf, len, token) };
        match posted {
            Ok(()) => {
                self.sends.insert(id, (key, revoke));
                c.send_bytes.fetch_add(len as u64, Ordering::Relaxed);
                self.last_activity = Instant::now();
                Ok(Posted::Yes { completes: true })
            }
            Err(e) => {
                if e.buf.region().is_some() {
                    self.send_free.push(e.buf);
                }
                Err(ofi(*e.error))
            }
        }
    }

    /// The region `handle` the peer of connection `key` granted it, as of the last message
    /// routed.
    pub(crate) fn grant(&self, key: u64, handle: u32) -> Option<Grant> {
        self.inbox.get(&key)?.grants.get(&handle).copied()
    }

    /// Whether another read may be posted engine-wide.
    pub(crate) fn read_room(&self) -> bool {
        self.reads.len() < MAX_READS
    }

    /// Reads `len` bytes at `offset` of `remote` from `peer` into `lease` for connection
    /// `key`; the outcome comes back as [`Event::ReadDone`] with `tag`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read(
        &mut self,
        key: u64,
        tag: u64,
        peer: PeerAddr,
        lease: Lease,
        remote: RemoteRegion,
        offset: u64,
    ) -> Result<(), FailedRead> {
        let len = lease.len();
        let Some(ep) = self.ep.as_mut() else { return Err(Box::new((lease, dead("the endpoint is not open")))) };
        let id = self.next_read;
        self.next_read += 1;
        match ep.read(peer, Buffer::from_lease(lease), len, remote, offset, READ_TOKEN | id) {
            Ok(()) => {
                self.reads.insert(id, (key, tag));
                self.last_activity = Instant::now();
                Ok(())
            }
            Err(e) => match e.buf.into_lease() {
                Some(lease) => Err(Box::new((lease, ofi(*e.error)))),
                None => unreachable!("a read's buffer is the lease it was given"),
            },
        }
    }

    /// Exposes `len` bytes of `source` from `offset` for one-sided read: memory sources (a
    /// caller's buffer) as they are, files by a copy read with `pread` (never a mapping, see
    /// `Source`) into memory kept for exposures.
    pub(crate) fn expose(&mut self, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<Exposure, FabricError> {
        let domain = self.ep.as_ref().ok_or_else(|| dead("the endpoint is not open"))?.domain().clone();
        let exposure = if source.memory().is_some() {
            let ep = self.ep.as_ref().ok_or_else(|| dead("the endpoint is not open"))?;
            domain.expose_source(source, offset, len, ep).map_err(ofi)?
        } else {
            let n = usize::try_from(len).map_err(|_| dead("a region larger than memory"))?;
            let mut copy = self.take_spare(n);
            if let Err(e) = source.read_at(offset, &mut copy[..n]) {
                self.give_spare(copy);
                return Err(dead(&format!("cannot read the region to expose: {e}")));
            }
            let Some(ep) = self.ep.as_ref() else { return Err(dead("the endpoint is not open")) };
            match domain.expose_copy(copy, n, ep) {
                Ok(x) => x,
                Err((copy, e)) => {
                    self.give_spare(copy);
                    return Err(ofi(e));
                }
            }
        };
        self.exposed_bytes += exposure.remote().len;
        self.counters.windows_bound.fetch_add(1, Ordering::Relaxed);
        Ok(exposure)
    }

    /// Closes an exposure's registration (later reads with its key fail at the target) and
    /// keeps its copy for reuse.
    pub(crate) fn revoke(&mut self, x: Exposure) {
        self.retire(&x);
        self.close_exposure(x);
    }

    /// An exposure is revoked, its registration about to close (once the peer has the
    /// revoke): it no longer counts as exposed.
    pub(crate) fn retire(&mut self, x: &Exposure) {
        self.exposed_bytes -= x.remote().len;
        self.counters.windows_revoked.fetch_add(1, Ordering::Relaxed);
    }

    /// Closes a [retired](Self::retire) exposure's registration and keeps its copy.
    pub(crate) fn close_exposure(&mut self, x: Exposure) {
        if let Some(copy) = x.close() {
            self.give_spare(copy);
        }
    }

    /// A copy buffer for `n` bytes, of the next power of two (so spares fit later regions of
    /// similar sizes): a spare of that size, else a new one. Never a larger spare: a copy is
    /// then less than twice its region, which the fixed memory counts on.
    fn take_spare(&mut self, n: usize) -> Box<[u8]> {
        let size = n.max(4096).next_power_of_two();
        match self.spare.iter().position(|b| b.len() == size) {
            Some(i) => {
                let b = self.spare.swap_remove(i);
                self.spare_bytes -= b.len();
                b
            }
            None => vec![0u8; size].into_boxed_slice(),
        }
    }

    fn give_spare(&mut self, b: Box<[u8]>) {
        if self.spare_bytes + b.len() <= self.spare_max {
            self.spare_bytes += b.len();
            self.spare.push(b);
        }
    }

    /// Bytes registered: exposed regions, and the receive and send buffers where the
    /// provider registers them.
    pub(crate) fn registered_bytes(&self) -> u64 {
        let buffers = match &self.ep {
            Some(ep) if ep.info().mr_local => ((self.cfg.rx_depth + SEND_BUFFERS) * self.cfg.max_msg) as u64,
            _ => 0,
        };
        buffers + self.exposed_bytes
    }

    /// Whether an event waits for connection `key`.
    pub(crate) fn has_event(&self, key: u64) -> bool {
        self.inbox.get(&key).is_some_and(|q| !q.events.is_empty())
    }

    /// The next event of connection `key`.
    pub(crate) fn take_event(&mut self, key: u64) -> Option<Event> {
        self.inbox.get_mut(&key)?.events.pop_front()
    }

    fn push(&mut self, key: u64, ev: Event) -> bool {
        match self.inbox.get_mut(&key) {
            Some(q) => {
                q.events.push_back(ev);
                true
            }
            // The connection is gone: a read's lease goes back to its pool as `ev` drops.
            None => false,
        }
    }

    /// Collects completions and routes them; answers the connections that have something
    /// to handle. Then makes sure the loop comes back: it may sleep on the completion
    /// queue's descriptor only when libfabric says so; otherwise another turn is asked for
    /// (at once while busy, every [`IDLE_TICK`] while idle).
    pub(crate) fn collect(&mut self) -> Vec<u64> {
        let Some(ep) = self.ep.as_mut() else { return Vec::new() };
        let mut comps = std::mem::take(&mut self.completions);
        let mut more = false;
        match ep.poll(&mut comps, TURN_COMPLETIONS) {
            Ok(n) => more = n >= TURN_COMPLETIONS,
            Err(e) => tracing::error!(driver = %self.name, error = %e, "reading the completion queue failed"),
        }
        let mut touched = std::mem::take(&mut self.touched);
        if !comps.is_empty() {
            self.last_activity = Instant::now();
        }
        for c in comps.drain(..) {
            self.completion(c, &mut touched);
        }
        self.completions = comps;
        self.keep_turning(more);
        touched.sort_unstable();
        touched.dedup();
        touched
    }

    /// Reads the completion queue now, for a link that must know whether messages of its
    /// peer are still on their way in (its control socket ended): what it finds waits in the
    /// inboxes, and the loop gets the connections with its next turn.
    pub(crate) fn drain(&mut self) {
        let found = self.collect();
        self.touched.extend(found);
        if !self.touched.is_empty() {
            self.notify.notify(NO_CONN);
        }
    }

    fn completion(&mut self, c: Completion, touched: &mut Vec<u64>) {
        let p = self.counters.clone();
        match c {
            Completion::Received { peer, mut data } => {
                let Some((conn_id, kind, body)) = read_trailer(&data) else {
                    p.rnr_errors.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let Some(route) = self.routes.get(&conn_id) else {
                    // No connection has that id (any more): a late message of a closed one,
                    // or a guess.
                    p.rnr_errors.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                if let (Some(from), Some(want)) = (peer, route.peer) {
                    if from != want {
                        tracing::warn!(driver = %self.name, "a message for a connection came from another peer's endpoint; dropped");
                        p.rnr_errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
                let key = route.key;
                p.recvs.fetch_add(1, Ordering::Relaxed);
                data.truncate(body);
                let Some(inbox) = self.inbox.get_mut(&key) else { return };
                match kind {
                    Kind::Grant => match Grant::decode(&data) {
                        Some(g) if inbox.grants.len() < MAX_GRANTS || inbox.grants.contains_key(&g.handle) => {
                            inbox.grants.insert(g.handle, g);
                            return;
                        }
                        Some(_) => inbox
                            .events
                            .push_back(Event::Broken(dead(&format!("the peer granted more than {MAX_GRANTS} regions at once")))),
                        None => inbox.events.push_back(Event::Broken(dead("the peer sent a malformed grant"))),
                    },
                    Kind::Revoke => match decode_revoke(&data) {
                        Some(h) => {
                            inbox.grants.remove(&h);
                            return;
                        }
                        None => inbox.events.push_back(Event::Broken(dead("the peer sent a malformed revoke"))),
                    },
                    _ => inbox.events.push_back(Event::Message(kind, data)),
                }
                touched.push(key);
            }
            Completion::Sent { token, buf } => {
                self.sent(buf, touched);
                let Some((key, revoked)) = self.sends.remove(&(token & !KIND_MASK)) else { return };
                p.sends.fetch_add(1, Ordering::Relaxed);
                if self.push(key, Event::Sent { revoked }) {
                    touched.push(key);
                }
            }
            Completion::Read { token, buf, len } => {
                let Some((key, tag)) = self.reads.remove(&(token & !KIND_MASK)) else { return };
                p.reads.fetch_add(1, Ordering::Relaxed);
                p.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
                if let Some(lease) = buf.into_lease() {
                    if self.push(key, Event::ReadDone { tag, lease, result: Ok(()) }) {
                        touched.push(key);
                    }
                }
            }
            Completion::Failed { token, error, buf } => {
                p.flushed_completions.fetch_add(1, Ordering::Relaxed);
                match token {
                    Some(t) if t & KIND_MASK == SEND_TOKEN => {
                        if let Some(b) = buf {
                            self.sent(b, touched);
                        }
                        let Some((key, revoked)) = self.sends.remove(&(t & !KIND_MASK)) else { return };
                        if self.push(key, Event::SendFailed { error, revoked }) {
                            touched.push(key);
                        }
                    }
                    Some(t) if t & KIND_MASK == READ_TOKEN => {
                        let Some((key, tag)) = self.reads.remove(&(t & !KIND_MASK)) else { return };
                        let result = Err(read_error(&error));
                        if let Some(lease) = buf.and_then(Buffer::into_lease) {
                            if self.push(key, Event::ReadDone { tag, lease, result }) {
                                touched.push(key);
                            }
                        }
                    }
                    _ => {
                        // A posted receive (reposted already) or an inject: no connection to
                        // tell (a peer sent more than the receive buffers take, or a post
                        // queued behind a full queue failed later).
                        tracing::warn!(driver = %self.name, %error, "a libfabric operation of no connection failed");
                    }
                }
            }
        }
    }

    /// A send completed (or failed): its registered buffer is free again, and a connection
    /// waiting for one is driven.
    fn sent(&mut self, buf: Buffer, touched: &mut Vec<u64>) {
        if buf.region().is_some() {
            self.send_free.push(buf);
        }
        if let Some(w) = self.send_waiters.pop_front() {
            touched.push(w);
        }
    }

    /// Asks for the loop's next turn where it may not sleep on the completion descriptor.
    fn keep_turning(&mut self, more: bool) {
        let Some(ep) = self.ep.as_ref() else { return };
        let busy = self.last_activity.elapsed() < SPIN;
        let wake_now =
            more || match ep.wait_fd() {
                // libfabric wants another look first (completions, a connection being set up).
                Some(_) => !ep.can_sleep(),
                // Nothing to sleep on: keep looking while busy, then on the ticker.
                None => busy,
            } || (ep.queued() > 0 && busy);
        tracing::trace!(driver = %self.name, more, busy, wake_now, queued = ep.queued(), sends = self.sends.len(),
            reads = self.reads.len(), "turn");
        if wake_now {
            self.notify.notify(NO_CONN);
        }
        if let Some(t) = &self.ticker {
            // Idle with connections (a message may come) or with posts still queued.
            t.want(!wake_now && (self.links > 0 || ep.queued() > 0 || !self.reads.is_empty()));
        }
    }
}

impl Drop for OfiEngine {
    fn drop(&mut self) {
        self.close_endpoint();
    }
}

/// Endpoints of libfabric's shm opened in this process so far, and those kept open.
static SHM_OPENED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static SHM_KEPT: parking_lot::Mutex<Vec<Endpoint>> = parking_lot::Mutex::new(Vec::new());

/// Counts an endpoint of libfabric's shm opened in this process.
fn shm_opened(ep: &Endpoint) {
    if is_shm(ep) {
        SHM_OPENED.fetch_add(1, Ordering::Relaxed);
    }
}

fn is_shm(ep: &Endpoint) -> bool {
    ep.info().provider.split(';').next() == Some("shm")
}

/// Closes an endpoint, except one of libfabric's shm in a process that opened more than one:
/// shm (2.1) reaches a peer endpoint of its own process through that endpoint's region
/// itself, and closing it frees the region under the others that still know it (a crash
/// in their progress, seen in the suites, which run many engines in one process). Such an
/// endpoint is kept open (idle, its 16 MiB region mostly unbacked) until the process exits.
/// A process with one engine, as a Spark executor or a Mobius rank has, closes it.
fn shm_keep(ep: Endpoint) {
    if is_shm(&ep) && SHM_OPENED.load(Ordering::Relaxed) > 1 {
        SHM_KEPT.lock().push(ep);
    }
}

/// A typed error of this provider.
pub(crate) fn dead(why: &str) -> FabricError {
    FabricError::Provider { provider: "ofi", message: why.to_string(), knob: None }
}

/// A libfabric error as the fabric's.
pub(crate) fn ofi(e: OfiError) -> FabricError {
    FabricError::Provider { provider: "ofi", message: e.to_string(), knob: None }
}

/// A read that failed: a key the target does not know (revoked, never granted) is a remote
/// access error, as verbs reports one; anything else is the provider's.
fn read_error(e: &OfiError) -> FabricError {
    match e.code() {
        Some(code) if crate::sys::is_access_error(code) => {
            FabricError::RemoteAccess { peer: "the peer's endpoint".into(), what: e.to_string() }
        }
        _ => ofi_ref(e),
    }
}

fn ofi_ref(e: &OfiError) -> FabricError {
    FabricError::Provider { provider: "ofi", message: e.to_string(), knob: None }
}
