//! The serving endpoint: accepts connections, runs a [`ServerSession`] each, resolves blocks
//! through a [`BlockSource`], sends eager payloads and pulls straight from the sources (no
//! copy on tcp), and exposes rendezvous regions to the one client that asked for them for
//! exactly as long as it holds them.
//!
//! Before a client authenticated, its connection is a socket and a session — nothing is
//! exposed, registered or granted for it, and at most
//! [`ServerEndpointConfig::max_pending_handshakes`] such connections exist on a loop: a new
//! one evicts the oldest.

use super::codec::{decode_or_fail, frame_error_of, WireCodec};
use super::{exposure, loop_stats, BlockLoopStats};
use rdma_shuffle_fabric::driver::{Acceptor, Driver, Loop, Service};
use rdma_shuffle_fabric::driver::{Conn, ConnKey, Handler, Incoming, Placement, Role, Transport};
use rdma_shuffle_fabric::providers::link::OutPayload;
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::server::ServerCounters;
use rdma_shuffle_wire::{
    BlockFailure, BlockSpan, Descriptor, FailureCode, Frame, Limits, ProtocolError, RegionId, Resolved, Secret, ServerConfig,
    ServerHooks, ServerOutput, ServerSession,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Maps requested spans to registered bytes. Implemented by the shuffle layer's store.
pub trait BlockSource: Send + Sync {
    /// Where `span`'s bytes are, or why it cannot be served. Runs on the loop thread: must
    /// not block on I/O beyond reading memory-mapped index data.
    fn resolve(&self, span: &BlockSpan) -> Result<Resolved<Arc<dyn Source>>, BlockFailure>;
}

/// Settings of a serving endpoint.
#[derive(Clone, Debug)]
pub struct ServerEndpointConfig {
    /// When set, clients must prove knowledge of it.
    pub secret: Option<Secret>,
    /// This engine's application id; clients of another application are refused.
    pub app_id: String,
    /// Most blocks in flight per client connection (a verbs server grants fewer when its
    /// shared receive queue is short).
    pub credits: u32,
    /// Blocks up to this size are sent inline.
    pub eager_threshold: u32,
    /// Bounds on what clients may send.
    pub limits: Limits,
    /// Limit for a client to complete the handshake.
    pub handshake_timeout: Duration,
    /// Name used in logs (the executor id).
    pub name: String,
    /// Most connections accepted but not yet authenticated, over the loop's servers (the
    /// smallest of their settings holds); a new one evicts the oldest.
    pub max_pending_handshakes: usize,
    /// Most bytes of rendezvous regions exposed to peers at once, over the loop's server
    /// connections (one-sided transports: each exposed region is registered memory; the
    /// smallest of the loop's servers' settings holds). Regions beyond it wait for releases.
    pub max_bytes_exposed: u64,
}

impl Default for ServerEndpointConfig {
    /// 64 credits, 64 KiB eager threshold, 30 s handshake limit, 256 pending handshakes,
    /// 4 MiB exposed.
    fn default() -> Self {
        ServerEndpointConfig {
            secret: None,
            app_id: String::new(),
            credits: 64,
            eager_threshold: 64 * 1024,
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(30),
            name: "server".into(),
            max_pending_handshakes: 256,
            max_bytes_exposed: 4 << 20,
        }
    }
}

/// Counters of a serving endpoint, summed over connections.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections open now.
    pub connections_open: AtomicU64,
    /// Connections that ended with a protocol or I/O error.
    pub connection_errors: AtomicU64,
    /// Connections refused during authentication (wrong or missing proof, other application).
    pub auth_failures: AtomicU64,
    /// Blocks sent inline.
    pub eager_blocks: AtomicU64,
    /// Bytes sent inline.
    pub eager_bytes: AtomicU64,
    /// Blocks offered by rendezvous.
    pub rendezvous_blocks: AtomicU64,
    /// Bytes offered by rendezvous.
    pub rendezvous_bytes: AtomicU64,
    /// Bytes streamed for pulls (tcp).
    pub pulled_bytes: AtomicU64,
    /// Blocks answered with a failure.
    pub failed_blocks: AtomicU64,
}

impl ServerStats {
    /// Adds what a session counted since `last`.
    fn publish(&self, now: &ServerCounters, last: &mut ServerCounters) {
        self.eager_blocks.fetch_add(now.eager_blocks - last.eager_blocks, Ordering::Relaxed);
        self.eager_bytes.fetch_add(now.eager_bytes - last.eager_bytes, Ordering::Relaxed);
        // Abandoned regions take back what they counted.
        self.rendezvous_blocks.fetch_add(now.rendezvous_blocks.wrapping_sub(last.rendezvous_blocks), Ordering::Relaxed);
        self.rendezvous_bytes.fetch_add(now.rendezvous_bytes.wrapping_sub(last.rendezvous_bytes), Ordering::Relaxed);
        self.pulled_bytes.fetch_add(now.pulled_bytes - last.pulled_bytes, Ordering::Relaxed);
        self.failed_blocks.fetch_add(now.failed_blocks - last.failed_blocks, Ordering::Relaxed);
        *last = *now;
    }

    /// Blocks served (inline or by rendezvous).
    pub fn blocks_served(&self) -> u64 {
        self.eager_blocks.load(Ordering::Relaxed) + self.rendezvous_blocks.load(Ordering::Relaxed)
    }

    /// Bytes served (inline or by rendezvous).
    pub fn bytes_served(&self) -> u64 {
        self.eager_bytes.load(Ordering::Relaxed) + self.rendezvous_bytes.load(Ordering::Relaxed)
    }
}

/// A listening endpoint serving blocks until [`shutdown`](ServerEndpoint::shutdown) or drop.
pub struct ServerEndpoint {
    driver: Driver,
    id: u64,
    addr: SocketAddr,
    stats: Arc<ServerStats>,
    loop_stats: Arc<BlockLoopStats>,
    closed: AtomicBool,
}

impl ServerEndpoint {
    /// Listens on `addr` on `driver` and serves blocks from `source`.
    pub fn bind(
        driver: &Driver,
        addr: SocketAddr,
        config: ServerEndpointConfig,
        source: Arc<dyn BlockSource>,
    ) -> Result<Self, FabricError> {
        let id = driver.next_id();
        let stats = Arc::new(ServerStats::default());
        let (tx, rx) = crossbeam_channel::bounded(1);
        let name = config.name.clone();
        let a = AddServer { id, addr, config, source, stats: stats.clone(), reply: tx };
        driver.submit(move |lp| add_server(lp, a))?;
        let (addr, loop_stats) = rx.recv().map_err(|_| FabricError::Shutdown)??;
        tracing::info!(%addr, provider = driver.provider_name(), %name, "block server listening");
        Ok(ServerEndpoint { driver: driver.clone(), id, addr, stats, loop_stats, closed: AtomicBool::new(false) })
    }

    /// The counters this endpoint shares with the other endpoints of its loop (exposure
    /// budget, pending handshakes, deliveries).
    pub fn loop_stats(&self) -> &BlockLoopStats {
        &self.loop_stats
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The provider's name.
    pub fn provider(&self) -> &'static str {
        self.driver.provider_name()
    }

    /// The driver this endpoint runs on.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ServerStats> {
        &self.stats
    }

    /// Open client connections.
    pub fn connections(&self) -> usize {
        self.stats.connections_open.load(Ordering::Relaxed) as usize
    }

    /// Stops accepting and closes every connection. Idempotent.
    pub fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let id = self.id;
        let removed = self.driver.submit(move |lp| {
            remove_server(lp, id);
            let _ = tx.send(());
        });
        if removed.is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(30));
        }
        tracing::info!(addr = %self.addr, "block server stopped");
    }
}

impl Drop for ServerEndpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub(crate) struct AddServer {
    id: u64,
    addr: SocketAddr,
    config: ServerEndpointConfig,
    source: Arc<dyn BlockSource>,
    stats: Arc<ServerStats>,
    reply: crossbeam_channel::Sender<Result<(SocketAddr, Arc<BlockLoopStats>), FabricError>>,
}

/// A server endpoint, inside the loop.
pub(crate) struct ServerEp {
    config: ServerEndpointConfig,
    source: Arc<dyn BlockSource>,
    stats: Arc<ServerStats>,
    conns: HashSet<ConnKey>,
}

/// A server connection, inside the loop.
pub(crate) struct ServerConn {
    ep: u64,
    stats: Arc<ServerStats>,
    pub(crate) session: ServerSession<Arc<dyn Source>>,
    /// Exposed regions: their keys and the bytes they hold of the exposure budget.
    exposures: HashMap<RegionId, (u32, u64)>,
    /// Bytes of the exposure budget this connection holds.
    exposed: u64,
    /// Regions waiting for room in the exposure budget, in the session's order.
    deferred: VecDeque<Deferred>,
    published: ServerCounters,
    /// Not yet authenticated (counted in the pending gauge).
    pending: bool,
}

/// A region the session offered that waits for room in the exposure budget.
struct Deferred {
    req: u64,
    index: u32,
    region: RegionId,
    source: Arc<dyn Source>,
    offset: u64,
    len: u64,
    block_len: u64,
}

fn server_mut(conn: &mut Conn) -> &mut ServerConn {
    conn.role.get_mut::<ServerConn>().unwrap_or_else(|| unreachable_role())
}

#[cold]
fn unreachable_role() -> ! {
    // Only called from the server's handler, which the loop calls for server roles only.
    panic!("server handler called on a connection of another role")
}

/// The block server's [`Handler`]: serves one client connection.
pub(crate) struct ServerHandler;

impl Handler for ServerHandler {
    fn incoming(&self, lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
        server_incoming(lp, conn, inc)
    }

    fn failed(&self, lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool {
        server_failed(lp, conn, error)
    }

    fn after(&self, lp: &mut Loop, conn: &mut Conn) {
        server_after(lp, conn)
    }

    fn deadline(&self, lp: &Loop, conn: &Conn) -> Option<Instant> {
        server_deadline(lp, conn, conn.role.get::<ServerConn>()?)
    }

    fn timeout(&self, lp: &mut Loop, conn: &mut Conn, now: Instant) {
        server_timeout(lp, conn, now)
    }

    fn removed(&self, lp: &mut Loop, conn: &mut Conn) {
        server_removed(lp, conn)
    }
}

/// What the session asks of the loop while it handles a frame.
struct Hooks<'a> {
    source: &'a dyn BlockSource,
    grant: &'a mut dyn FnMut(u32) -> u32,
}

impl ServerHooks<Arc<dyn Source>> for Hooks<'_> {
    fn resolve(&mut self, span: &BlockSpan) -> Result<Resolved<Arc<dyn Source>>, BlockFailure> {
        self.source.resolve(span)
    }
    fn grant(&mut self, max: u32) -> u32 {
        (self.grant)(max)
    }
}

/// Hands a block server's accepted connections to it.
struct ServerAcceptor;

impl Acceptor for ServerAcceptor {
    fn accepted(&self, lp: &mut Loop, id: u64, peer: String, transport: Transport) {
        server_accepted(lp, id, peer, transport)
    }
}

/// The server endpoints of a loop, its unauthenticated connections and its exposure
/// budget: this protocol's [loop state](Loop::state).
#[derive(Default)]
pub(crate) struct Servers {
    pub(crate) eps: HashMap<u64, ServerEp>,
    /// Unauthenticated server connections, oldest first.
    pub(crate) pending: VecDeque<ConnKey>,
    /// Rendezvous regions exposed over all server connections, and those waiting for room.
    pub(crate) exposure: exposure::ExposureBudget,
    /// The most unauthenticated connections kept (0: not set yet, no server).
    pub(crate) pending_cap: usize,
}

/// The loop's server state (made on first use).
pub(crate) fn servers(lp: &mut Loop) -> &mut Servers {
    lp.state::<Servers>()
}

/// `bytes` more exposed (gauges updated).
fn take_exposure(lp: &mut Loop, bytes: u64) {
    let e = &mut servers(lp).exposure;
    e.take(bytes);
    let used = e.used();
    let st = loop_stats(lp);
    st.exposed_bytes.store(used, Ordering::Relaxed);
    st.peak_exposed_bytes.fetch_max(used, Ordering::Relaxed);
}

/// `bytes` no longer exposed: waiting regions get a pass at the end of the turn.
fn give_exposure(lp: &mut Loop, bytes: u64) {
    let e = &mut servers(lp).exposure;
    let due = e.give(bytes);
    let used = e.used();
    loop_stats(lp).exposed_bytes.store(used, Ordering::Relaxed);
    if due {
        lp.defer(service_exposures);
    }
}

/// The block server's loop-wide hooks.
struct ServerService;

impl Service for ServerService {
    fn shutdown(&self, lp: &mut Loop) {
        let ids: Vec<u64> = servers(lp).eps.keys().copied().collect();
        for id in ids {
            remove_server(lp, id);
        }
    }
}

pub(crate) fn add_server(lp: &mut Loop, a: AddServer) {
    let AddServer { id, addr, config, source, stats, reply } = a;
    lp.add_service(&ServerService);
    let s = servers(lp);
    s.exposure.lower_limit(config.max_bytes_exposed);
    s.pending_cap = match s.pending_cap {
        0 => config.max_pending_handshakes.max(1),
        cap => cap.min(config.max_pending_handshakes.max(1)),
    };
    match lp.listen(id, addr, &ServerAcceptor) {
        Ok(local) => {
            servers(lp).eps.insert(id, ServerEp { config, source, stats, conns: HashSet::new() });
            let _ = reply.send(Ok((local, loop_stats(lp))));
        }
        Err(e) => {
            let _ = reply.send(Err(e));
        }
    }
}

pub(crate) fn remove_server(lp: &mut Loop, id: u64) {
    lp.unlisten(id);
    let Some(ep) = servers(lp).eps.remove(&id) else { return };
    let keys: Vec<ConnKey> = ep.conns.iter().copied().collect();
    // Put the endpoint back while its connections close, so their handlers find it.
    servers(lp).eps.insert(id, ep);
    for k in keys {
        if let Some(mut conn) = lp.take(k) {
            lp.fail(&mut conn, FabricError::Shutdown);
            lp.put(conn);
        }
    }
    if let Some(mut ep) = servers(lp).eps.remove(&id) {
        // Connections still draining keep nothing of the endpoint but its id.
        ep.conns.clear();
    }
}

pub(crate) fn server_accepted(lp: &mut Loop, id: u64, peer: String, transport: Transport) {
    let Some(ep) = servers(lp).eps.get(&id) else { return };
    let c = &ep.config;
    let mut sc = ServerConfig::new(peer.clone(), rand::random());
    sc.secret = c.secret.clone();
    sc.app_id = c.app_id.clone();
    sc.credits = c.credits;
    sc.eager_threshold = c.eager_threshold;
    sc.limits = c.limits;
    sc.handshake_timeout = c.handshake_timeout;
    if !transport.capabilities().one_sided {
        sc.caps &= !rdma_shuffle_wire::caps::RDMA_READ;
    }
    let session = ServerSession::new(sc, Instant::now());
    let codec = WireCodec::new(session.limits());
    let role = Role::new(
        &ServerHandler,
        ServerConn {
            ep: id,
            stats: ep.stats.clone(),
            session,
            exposures: HashMap::new(),
            exposed: 0,
            deferred: VecDeque::new(),
            published: ServerCounters::default(),
            pending: true,
        },
        codec,
    );
    ep.stats.connections.fetch_add(1, Ordering::Relaxed);
    ep.stats.connections_open.fetch_add(1, Ordering::Relaxed);
    let key = lp.insert(peer, transport, role);
    if let Some(ep) = servers(lp).eps.get_mut(&id) {
        ep.conns.insert(key);
    }
    servers(lp).pending.push_back(key);
    loop_stats(lp).pending_handshakes.fetch_add(1, Ordering::Relaxed);
    // Oldest first: a flood of silent peers cannot keep out the ones behind it, and it
    // never holds more than the cap.
    while servers(lp).pending.len() > servers(lp).pending_cap.max(1) {
        let Some(oldest) = servers(lp).pending.pop_front() else { break };
        if let Some(mut conn) = lp.take(oldest) {
            lp.stats().handshake_evictions.fetch_add(1, Ordering::Relaxed);
            leave_pending(lp, &mut conn);
            lp.close(&mut conn, "evicted: too many connections waiting for their handshake".into(), false);
            lp.put(conn);
        }
    }
    lp.activate(key);
}

fn leave_pending(lp: &mut Loop, conn: &mut Conn) {
    let s = server_mut(conn);
    if s.pending {
        s.pending = false;
        loop_stats(lp).pending_handshakes.fetch_sub(1, Ordering::Relaxed);
        let key = conn.key;
        servers(lp).pending.retain(|k| *k != key);
    }
}

pub(crate) fn server_incoming(lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
    match inc {
        Incoming::Frame(head) => {
            let Some(frame) = server_decode(lp, conn, &head) else { return };
            if frame.kind().payload_offset().is_some() {
                // Clients send no payloads; the session refuses the frame, the bytes go.
                let _ = conn.transport.place(Placement::Discard);
            }
            server_frame(lp, conn, frame);
        }
        Incoming::Message(p) => {
            if let Some(frame) = server_decode(lp, conn, p.head()) {
                server_frame(lp, conn, frame)
            }
        }
        Incoming::Payload(_) | Incoming::PayloadVec(_) | Incoming::ReadDone { .. } | Incoming::UserReadDone { .. } => {}
        // The data plane of an authenticated client is up (verbs): nothing to do, frames
        // sent meanwhile went out with it.
        Incoming::Attached => {}
    }
}

/// The frame whose fixed part arrived; a malformed one fails the connection (the session
/// answers it with an `Error` frame first, see [`ServerHandler::failed`]).
fn server_decode(lp: &mut Loop, conn: &mut Conn, head: &[u8]) -> Option<Frame> {
    let limits = server_mut(conn).session.limits();
    decode_or_fail(lp, conn, head, &limits)
}

fn server_frame(lp: &mut Loop, conn: &mut Conn, frame: Frame) {
    let ep_id = server_mut(conn).ep;
    let Some(ep) = servers(lp).eps.get(&ep_id) else {
        lp.close(conn, "the server endpoint was shut down".into(), false);
        return;
    };
    let source = ep.source.clone();
    let r = {
        // Credits come from the provider where answers take room in a receive queue it
        // shares (verbs: a share of the shared receive queue); elsewhere as asked.
        let Conn { transport, role, .. } = &mut *conn;
        let mut credits = transport.receive_credits();
        let mut grant = |max: u32| credits.as_mut().map_or(max, |c| c.grant_credits(max));
        let mut hooks = Hooks { source: &*source, grant: &mut grant };
        let s = role.get_mut::<ServerConn>().unwrap_or_else(|| unreachable_role());
        s.session.handle_frame(frame, &mut hooks)
    };
    if server_mut(conn).session.is_ready() && !conn.authenticated {
        leave_pending(lp, conn);
        let live = server_mut(conn).session.live_credits();
        if let Some(c) = conn.transport.receive_credits() {
            c.credits_granted(live);
        }
        // The link may create what the client's data plane needs now (verbs: its queue
        // pair, once the client's attach record arrives); a block server exposes regions.
        if let Err(e) = lp.authenticated(conn, true) {
            lp.fail(conn, e);
            return;
        }
    }
    if let Err(e) = r {
        if let Some(ep) = servers(lp).eps.get(&ep_id) {
            ep.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
            if matches!(e.error, ProtocolError::AuthRefused(_) | ProtocolError::AppMismatch { .. }) {
                ep.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        tracing::warn!(driver = %lp.name(), peer = %conn.peer, error = %e, "closing client connection");
        server_after(lp, conn);
        lp.close(conn, e.to_string(), true);
    }
}

/// Acts on what the session produced: frames, payloads, exposures and revocations. The
/// frames of one turn leave together (one `writev` for many small ones on tcp).
pub(crate) fn server_after(lp: &mut Loop, conn: &mut Conn) {
    conn.transport.cork();
    server_outputs(lp, conn);
    if let Err(e) = conn.transport.uncork() {
        lp.fail(conn, e);
    }
}

fn server_outputs(lp: &mut Loop, conn: &mut Conn) {
    let ep_id = server_mut(conn).ep;
    while let Some(out) = server_mut(conn).session.poll_output() {
        let r = match out {
            ServerOutput::Frame(f) => conn.transport.send(f.to_vec(), OutPayload::None),
            ServerOutput::Eager { frame, source, offset, len } | ServerOutput::PullData { frame, source, offset, len } => {
                conn.transport.send(frame.to_vec(), OutPayload::Source { source, offset, len })
            }
            ServerOutput::Expose { req, index, region, source, offset, len, block_len } => {
                if !conn.authenticated {
                    // Cannot happen (the session exposes only after authentication); the
                    // counter would show it.
                    lp.stats().preauth_registered_bytes.fetch_add(len, Ordering::Relaxed);
                }
                let d = Deferred { req, index, region, source, offset, len, block_len };
                let one_sided = conn.transport.capabilities().one_sided;
                let s = server_mut(conn);
                if !one_sided {
                    // tcp exposes nothing (the region is streamed on request).
                    expose_region(lp, conn, d)
                } else if s.deferred.is_empty() && servers(lp).exposure.admits(exposure::charge(offset, len), s.exposed) {
                    expose_region(lp, conn, d)
                } else {
                    s.deferred.push_back(d);
                    loop_stats(lp).exposure_waits.fetch_add(1, Ordering::Relaxed);
                    servers(lp).exposure.wait(conn.key);
                    Ok(())
                }
            }
            ServerOutput::Revoke { region } => {
                if let Some((rkey, charged)) = server_mut(conn).exposures.remove(&region) {
                    conn.transport.revoke(rkey);
                    server_mut(conn).exposed -= charged;
                    give_exposure(lp, charged);
                }
                Ok(())
            }
        };
        if let Err(e) = r {
            lp.fail(conn, e);
            return;
        }
    }
    lp.update_registered();
    if let Some(ep) = servers(lp).eps.get(&ep_id) {
        let s = server_mut(conn);
        ep.stats.publish(&s.session.counters(), &mut s.published);
    }
}

/// Exposes a region (within the budget: the caller checked) and sends its descriptor.
fn expose_region(lp: &mut Loop, conn: &mut Conn, d: Deferred) -> Result<(), FabricError> {
    let Deferred { req, index, region, source, offset, len, block_len } = d;
    match conn.transport.expose_or_offer(source, offset, len) {
        Ok((addr, rkey)) => {
            let charged = if conn.transport.capabilities().one_sided { exposure::charge(offset, len) } else { 0 };
            let s = server_mut(conn);
            s.exposures.insert(region, (rkey, charged));
            s.exposed += charged;
            take_exposure(lp, charged);
            // Counted before the descriptor leaves.
            lp.update_registered();
            let desc = Descriptor { region, addr, len, rkey };
            conn.transport.send(Frame::Rendezvous { req, index, desc, block_len }.to_vec(), OutPayload::None)
        }
        Err(e) => {
            tracing::warn!(peer = %conn.peer, error = %e, "cannot expose a rendezvous region; the block fails");
            let f = BlockFailure::new(FailureCode::Io, format!("cannot expose the block for reading: {e}"));
            server_mut(conn).session.abandon_region(req, index, region, f);
            Ok(())
        }
    }
}

/// Releases made room in the exposure budget: waiting connections get one region each in
/// turn (those with nothing exposed first) for as long as regions fit.
pub(crate) fn service_exposures(lp: &mut Loop) {
    servers(lp).exposure.dirty = false;
    loop {
        let mut keys = servers(lp).exposure.drain_waiters();
        // A connection with nothing exposed goes first (stable: arrival order otherwise).
        keys.sort_by_key(|k| server_exposed(lp, *k).unwrap_or(0) > 0);
        let mut progressed = false;
        let mut i = 0;
        while i < keys.len() {
            let key = keys[i];
            let Some(mut conn) = lp.take(key) else {
                i += 1;
                continue;
            };
            if conn.closing.is_some() || !conn.role.is::<ServerConn>() {
                lp.put(conn);
                i += 1;
                continue;
            }
            let need = server_mut(&mut conn).deferred.front().map(|d| exposure::charge(d.offset, d.len));
            let Some(need) = need else {
                lp.put(conn);
                i += 1;
                continue;
            };
            if !servers(lp).exposure.fits(need) {
                lp.put(conn);
                break;
            }
            let d = server_mut(&mut conn).deferred.pop_front().expect("checked above");
            let r = expose_region(lp, &mut conn, d);
            progressed = true;
            match r {
                Err(e) => lp.fail(&mut conn, e),
                Ok(()) => {
                    // Frames the exposure produced (a failure of an abandoned region) go
                    // out with the rest.
                    if !server_mut(&mut conn).deferred.is_empty() {
                        servers(lp).exposure.wait(key);
                    }
                }
            }
            lp.put(conn);
            i += 1;
        }
        // Those not reached keep their place at the head of the queue.
        servers(lp).exposure.requeue_front(keys[i..].iter().copied());
        if !progressed || i < keys.len() {
            break;
        }
    }
}

fn server_exposed(lp: &Loop, key: ConnKey) -> Option<u64> {
    lp.conn_ref(key)?.role.get::<ServerConn>().map(|s| s.exposed)
}

pub(crate) fn server_deadline(lp: &Loop, conn: &Conn, s: &ServerConn) -> Option<Instant> {
    let mut d = s.session.poll_timeout();
    if s.session.is_ready() && s.session.outstanding() == 0 && s.session.open_regions() == 0 {
        // Twice the client's limit: the client normally closes first.
        let idle = conn.last_active + lp.idle_timeout() * 2;
        d = Some(d.map_or(idle, |x| x.min(idle)));
    }
    d
}

pub(crate) fn server_timeout(lp: &mut Loop, conn: &mut Conn, now: Instant) {
    if server_mut(conn).session.handle_timeout(now).is_err() {
        lp.stats().handshake_timeouts.fetch_add(1, Ordering::Relaxed);
        server_after(lp, conn);
        lp.close(conn, "handshake timeout".into(), true);
        return;
    }
    let s = server_mut(conn);
    if s.session.is_ready()
        && s.session.outstanding() == 0
        && s.session.open_regions() == 0
        && now >= conn.last_active + lp.idle_timeout() * 2
    {
        lp.stats().idle_closes.fetch_add(1, Ordering::Relaxed);
        lp.close(conn, "idle".into(), false);
    }
}

/// The transport failed. Returns whether frames queued for the peer (an `Error` about a
/// frame it sent that could not be decoded) should be flushed first.
pub(crate) fn server_failed(lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool {
    let ep_id = server_mut(conn).ep;
    let quiet = matches!(error, FabricError::Closed { .. } | FabricError::Shutdown);
    if !quiet {
        if let Some(ep) = servers(lp).eps.get(&ep_id) {
            ep.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(driver = %lp.name(), peer = %conn.peer, error = %error, "closing client connection");
    } else {
        tracing::debug!(peer = %conn.peer, "client disconnected");
    }
    let s = server_mut(conn);
    if let Some(source) = frame_error_of(error) {
        s.session.handle_decode_error(source.clone());
        server_after(lp, conn);
        return true;
    }
    let _ = s.session.handle_connection_lost(error.to_string());
    false
}

pub(crate) fn server_removed(lp: &mut Loop, conn: &mut Conn) {
    leave_pending(lp, conn);
    let s = server_mut(conn);
    let ep_id = s.ep;
    s.stats.connections_open.fetch_sub(1, Ordering::Relaxed);
    let regions: Vec<u32> = s.exposures.drain().map(|(_, (k, _))| k).collect();
    s.deferred.clear();
    let held = std::mem::take(&mut s.exposed);
    for rkey in regions {
        conn.transport.revoke(rkey);
    }
    give_exposure(lp, held);
    if let Some(ep) = servers(lp).eps.get_mut(&ep_id) {
        ep.conns.remove(&conn.key);
    }
}
