//! The fetching endpoint: one connection per server address, a [`ClientSession`] per
//! connection, a reader thread per connection, a few pull threads for rendezvous blocks, and
//! a timer that enforces the fetch timeout. Fetched blocks land in [`TieredPool`] buffers and
//! are handed to a [`BlockSink`] one by one.
//!
//! Threads never block on the pool while holding a connection's lock, and a reader never
//! waits for memory that only its own progress could free: rendezvous buffers are acquired
//! by pull threads, and only eager payloads (bounded by credits × eager threshold) are
//! acquired by readers.

use crate::error::FabricError;
use crate::link::{Link, Payload, Placement, Provider};
use crate::pool::{Lease, TieredPool};
use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use rdma_shuffle_wire::{
    BlockFailure, BlockSpan, ClientConfig, ClientEvent, ClientSession, Descriptor, FailureCode, Limits, RequestId, Secret, Token,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Receives the outcome of each block of one fetch, exactly once per block, from any thread.
pub trait BlockSink: Send + Sync {
    /// Block `index` of the fetch's list arrived (`Ok`) or failed (`Err`).
    fn on_block(&self, index: usize, result: Result<FetchedBlock, BlockFailure>);
}

/// A fetched block's bytes, in pool memory until dropped.
#[derive(Debug)]
pub struct FetchedBlock {
    lease: Option<Lease>,
    _budget: Option<BudgetGuard>,
}

impl FetchedBlock {
    /// Block length.
    pub fn len(&self) -> usize {
        self.lease.as_ref().map(|l| l.len()).unwrap_or(0)
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pool buffer holding the bytes (`None` for an empty block).
    pub fn into_lease(self) -> Option<Lease> {
        self.lease
    }
}

impl Deref for FetchedBlock {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.lease {
            Some(l) => l,
            None => &[],
        }
    }
}

/// Settings of a fetching endpoint.
#[derive(Clone, Debug)]
pub struct ClientEndpointConfig {
    /// Shared secret (`spark.authenticate`); servers must prove it too.
    pub secret: Option<Secret>,
    /// Limit for establishing a connection.
    pub connect_timeout: Duration,
    /// Limit for the handshake.
    pub handshake_timeout: Duration,
    /// Limit for silence from a server while blocks are outstanding.
    pub fetch_timeout: Duration,
    /// Largest block accepted inline.
    pub max_eager: u32,
    /// Bound on rendezvous bytes being transferred at once, over all servers.
    pub max_bytes_in_flight: u64,
    /// Threads acquiring buffers for and performing rendezvous pulls.
    pub pull_threads: usize,
    /// Bounds on what servers may send.
    pub limits: Limits,
    /// Name used in logs and errors (the executor id).
    pub name: String,
}

impl Default for ClientEndpointConfig {
    fn default() -> Self {
        ClientEndpointConfig {
            secret: None,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(30),
            fetch_timeout: Duration::from_secs(120),
            max_eager: 1024 * 1024,
            max_bytes_in_flight: 48 * 1024 * 1024,
            pull_threads: 4,
            limits: Limits::default(),
            name: "client".into(),
        }
    }
}

/// Counters of a fetching endpoint.
#[derive(Debug, Default)]
pub struct ClientStats {
    /// Connections established.
    pub connections: AtomicU64,
    /// Connection attempts that failed.
    pub connect_failures: AtomicU64,
    /// Blocks delivered.
    pub blocks_fetched: AtomicU64,
    /// Bytes delivered.
    pub bytes_fetched: AtomicU64,
    /// Blocks delivered inline.
    pub eager_blocks: AtomicU64,
    /// Blocks delivered by rendezvous.
    pub rendezvous_blocks: AtomicU64,
    /// Rendezvous blocks read one-sidedly (RDMA READ / sim).
    pub one_sided_reads: AtomicU64,
    /// Rendezvous blocks pulled over the stream (tcp).
    pub stream_pulls: AtomicU64,
    /// Blocks that failed.
    pub failed_blocks: AtomicU64,
}

/// Bounds bytes being transferred; a guard gives its bytes back on drop.
#[derive(Debug)]
struct ByteBudget {
    max: u64,
    used: Mutex<u64>,
    cv: Condvar,
}

/// Bytes reserved from the in-flight budget until dropped.
#[derive(Debug)]
pub struct BudgetGuard {
    budget: Arc<ByteBudget>,
    n: u64,
}

impl ByteBudget {
    /// Waits until `n` bytes fit (a single block larger than the whole budget goes alone).
    fn acquire(self: &Arc<Self>, n: u64, deadline: Instant) -> Option<BudgetGuard> {
        let mut used = self.used.lock();
        while *used > 0 && *used + n > self.max {
            if self.cv.wait_until(&mut used, deadline).timed_out() {
                return None;
            }
        }
        *used += n;
        Some(BudgetGuard { budget: self.clone(), n })
    }
}

impl Drop for BudgetGuard {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock();
        *used -= self.n;
        self.budget.cv.notify_all();
    }
}

struct ConnState {
    session: ClientSession,
    sinks: HashMap<RequestId, Arc<dyn BlockSink>>,
    /// tcp: buffers of blocks being pulled over the stream.
    pulls: HashMap<Token, (Lease, BudgetGuard)>,
}

struct Conn {
    addr: SocketAddr,
    link: Arc<dyn Link>,
    st: Mutex<ConnState>,
    dead: AtomicBool,
}

struct PullJob {
    conn: Arc<Conn>,
    token: Token,
    desc: Descriptor,
}

/// A block outcome to hand to a sink once no lock is held.
type Delivery = (Arc<dyn BlockSink>, usize, Result<FetchedBlock, BlockFailure>);

/// What the reader must do with the payload of the frame it just handed to the session.
enum PayloadPlan {
    Eager { token: Token, len: u32, sink: Arc<dyn BlockSink> },
    Pull { token: Token, offset: u64, last: bool, guard: Option<BudgetGuard> },
}

struct Inner {
    provider: Arc<dyn Provider>,
    pool: TieredPool,
    config: ClientEndpointConfig,
    conns: Mutex<HashMap<SocketAddr, Arc<Conn>>>,
    pull_tx: Mutex<Option<Sender<PullJob>>>,
    budget: Arc<ByteBudget>,
    stats: ClientStats,
    closed: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    timer_stop: Mutex<Option<Sender<()>>>,
}

/// Fetches blocks from many servers at once.
pub struct ClientEndpoint {
    inner: Arc<Inner>,
}

impl ClientEndpoint {
    /// A fetching endpoint over `provider`, landing blocks in `pool`.
    pub fn new(provider: Arc<dyn Provider>, pool: TieredPool, config: ClientEndpointConfig) -> Result<Self, FabricError> {
        // Rendezvous pulls hold their buffers while readers fill them, and readers need
        // buffers for eager blocks: keep pulls to at most half the pool so a reader never
        // waits for memory only its own progress could free.
        let half = (pool.config().cap_bytes / 2).max(1);
        let mut config = config;
        if config.max_bytes_in_flight > half {
            tracing::debug!(requested = config.max_bytes_in_flight, used = half, "bytes in flight capped at half the pool");
            config.max_bytes_in_flight = half;
        }
        let (pull_tx, pull_rx) = unbounded::<PullJob>();
        let (timer_tx, timer_rx) = unbounded::<()>();
        let inner = Arc::new(Inner {
            provider,
            pool,
            budget: Arc::new(ByteBudget { max: config.max_bytes_in_flight.max(1), used: Mutex::new(0), cv: Condvar::new() }),
            config,
            conns: Mutex::new(HashMap::new()),
            pull_tx: Mutex::new(Some(pull_tx)),
            stats: ClientStats::default(),
            closed: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            timer_stop: Mutex::new(Some(timer_tx)),
        });
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name).spawn(f).map_err(|e| FabricError::io("local", "start thread for", e))
        };
        let mut threads = Vec::new();
        for i in 0..inner.config.pull_threads.max(1) {
            let (inn, rx) = (inner.clone(), pull_rx.clone());
            threads.push(spawn(format!("rdma-shuffle-pull-{i}"), Box::new(move || pull_loop(&inn, rx)))?);
        }
        let inn = inner.clone();
        threads.push(spawn("rdma-shuffle-timer".into(), Box::new(move || timer_loop(&inn, timer_rx)))?);
        *inner.threads.lock() = threads;
        Ok(ClientEndpoint { inner })
    }

    /// Counters.
    pub fn stats(&self) -> &ClientStats {
        &self.inner.stats
    }

    /// The pool blocks land in.
    pub fn pool(&self) -> &TieredPool {
        &self.inner.pool
    }

    /// The provider's name.
    pub fn provider(&self) -> &'static str {
        self.inner.provider.name()
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.inner.conns.lock().len()
    }

    /// Fetches `blocks` from the server at `addr`. Returns at once (after connecting if
    /// needed); `sink` gets every block's outcome exactly once, possibly before this returns.
    pub fn fetch(&self, addr: SocketAddr, blocks: Vec<BlockSpan>, sink: Arc<dyn BlockSink>) {
        let inner = &self.inner;
        let n = blocks.len();
        let conn = match inner.connection(addr) {
            Ok(c) => c,
            Err(e) => {
                let code = match e {
                    FabricError::ConnectTimeout { .. } => FailureCode::Timeout,
                    _ => FailureCode::PeerGone,
                };
                for (i, span) in blocks.iter().enumerate() {
                    inner.stats.failed_blocks.fetch_add(1, Ordering::Relaxed);
                    sink.on_block(
                        i,
                        Err(BlockFailure::new(code, format!("{span}: {} cannot reach {addr}: {e}", inner.config.name))),
                    );
                }
                return;
            }
        };
        if n == 0 {
            return;
        }
        let deliveries = {
            let mut st = conn.st.lock();
            let req = st.session.fetch(blocks, Instant::now());
            st.sinks.insert(req, sink);
            inner.drain(&conn, &mut st).0
        };
        inner.deliver(deliveries);
    }

    /// Closes every connection (outstanding blocks fail with `PeerGone`) and stops all
    /// threads. Idempotent.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        if inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let conns: Vec<_> = inner.conns.lock().drain().map(|(_, c)| c).collect();
        for c in conns {
            let deliveries = {
                let mut st = c.st.lock();
                st.session.close();
                inner.drain(&c, &mut st).0
            };
            inner.deliver(deliveries);
            c.link.shutdown();
        }
        inner.pull_tx.lock().take();
        inner.timer_stop.lock().take();
        let threads: Vec<_> = inner.threads.lock().drain(..).collect();
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl Drop for ClientEndpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inner {
    fn connection(self: &Arc<Self>, addr: SocketAddr) -> Result<Arc<Conn>, FabricError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(FabricError::Shutdown);
        }
        if let Some(c) = self.conns.lock().get(&addr) {
            if !c.dead.load(Ordering::Acquire) {
                return Ok(c.clone());
            }
        }
        // Connect without holding the map lock: other peers' fetches must not wait on this one.
        let link: Arc<dyn Link> = match self.provider.connect(addr, self.config.connect_timeout) {
            Ok(l) => Arc::from(l),
            Err(e) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let mut cfg = ClientConfig::new(format!("{addr}"), rand::random());
        cfg.secret = self.config.secret.clone();
        cfg.max_eager = self.config.max_eager;
        cfg.limits = self.config.limits;
        cfg.handshake_timeout = self.config.handshake_timeout;
        cfg.fetch_timeout = self.config.fetch_timeout;
        let conn = Arc::new(Conn {
            addr,
            link,
            st: Mutex::new(ConnState {
                session: ClientSession::new(cfg, Instant::now()),
                sinks: HashMap::new(),
                pulls: HashMap::new(),
            }),
            dead: AtomicBool::new(false),
        });
        {
            let mut map = self.conns.lock();
            if let Some(c) = map.get(&addr) {
                if !c.dead.load(Ordering::Acquire) {
                    // Another thread won the race; use its connection.
                    conn.link.shutdown();
                    return Ok(c.clone());
                }
            }
            map.insert(addr, conn.clone());
        }
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let (inner, c) = (self.clone(), conn.clone());
        let spawned = std::thread::Builder::new().name(format!("rdma-shuffle-read-{addr}")).spawn(move || read_loop(&inner, &c));
        if let Err(e) = spawned {
            self.conns.lock().remove(&addr);
            conn.link.shutdown();
            return Err(FabricError::io(&addr.to_string(), "start reader for", e));
        }
        let mut st = conn.st.lock();
        let _ = self.drain(&conn, &mut st);
        drop(st);
        Ok(conn)
    }

    fn sink(st: &ConnState, req: RequestId) -> Option<Arc<dyn BlockSink>> {
        st.sinks.get(&req).cloned()
    }

    /// Processes the session's events and sends its frames. Returns the deliveries to make
    /// after unlocking, and the payload plan if the last frame handled carries one.
    fn drain(&self, conn: &Arc<Conn>, st: &mut ConnState) -> (Vec<Delivery>, Option<PayloadPlan>) {
        let mut out = Vec::new();
        let mut plan = None;
        loop {
            while let Some(ev) = st.session.poll_event() {
                match ev {
                    ClientEvent::Connected { version, eager_threshold, credits, .. } => {
                        tracing::debug!(peer = %conn.addr, version, eager_threshold, credits, "connected");
                    }
                    ClientEvent::Eager { token, len } => {
                        if let Some(sink) = Self::sink(st, token.req) {
                            plan = Some(PayloadPlan::Eager { token, len, sink });
                        }
                    }
                    ClientEvent::PullData { token, offset, last, .. } => {
                        plan = Some(PayloadPlan::Pull { token, offset, last, guard: None })
                    }
                    ClientEvent::Rendezvous { token, desc } => {
                        let job = PullJob { conn: conn.clone(), token, desc };
                        let sent = self.pull_tx.lock().as_ref().map(|tx| tx.send(job).is_ok()).unwrap_or(false);
                        if !sent {
                            let _ = st
                                .session
                                .pull_complete(token, Err(BlockFailure::new(FailureCode::PeerGone, "endpoint is shutting down")));
                        }
                    }
                    ClientEvent::Failed { token, failure } => {
                        st.pulls.remove(&token);
                        if let Some(sink) = Self::sink(st, token.req) {
                            out.push((sink, token.index as usize, Err(failure)));
                        }
                    }
                    ClientEvent::RequestDone { req } => {
                        st.sinks.remove(&req);
                    }
                    ClientEvent::Closed { error } => {
                        conn.dead.store(true, Ordering::Release);
                        st.pulls.clear();
                        tracing::warn!(client = %self.config.name, error = %error, "connection failed; its blocks failed");
                        conn.link.shutdown();
                        let mut map = self.conns.lock();
                        if map.get(&conn.addr).map(|c| Arc::ptr_eq(c, conn)).unwrap_or(false) {
                            map.remove(&conn.addr);
                        }
                    }
                }
            }
            let mut failed = None;
            while let Some(f) = st.session.poll_transmit() {
                if failed.is_none() {
                    if let Err(e) = conn.link.send(&f, Payload::None) {
                        failed = Some(e);
                    }
                }
            }
            match failed {
                Some(e) => st.session.handle_connection_lost(e.to_string()),
                None => return (out, plan),
            }
        }
    }

    fn deliver(&self, deliveries: Vec<Delivery>) {
        for (sink, index, result) in deliveries {
            match &result {
                Ok(b) => {
                    self.stats.blocks_fetched.fetch_add(1, Ordering::Relaxed);
                    self.stats.bytes_fetched.fetch_add(b.len() as u64, Ordering::Relaxed);
                }
                Err(_) => {
                    self.stats.failed_blocks.fetch_add(1, Ordering::Relaxed);
                }
            }
            sink.on_block(index, result);
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.fetch_timeout
    }

    fn pool_failure(&self, conn: &Conn, len: u64, e: impl std::fmt::Display) -> BlockFailure {
        BlockFailure::new(
            FailureCode::PoolExhausted,
            format!("{}: no buffer for a {len}-byte block from {}: {e}", self.config.name, conn.addr),
        )
    }
}

fn read_loop(inner: &Arc<Inner>, conn: &Arc<Conn>) {
    let limits = conn.st.lock().session.limits();
    loop {
        let mut plan: Option<PayloadPlan> = None;
        let mut early: Vec<Delivery> = Vec::new();
        let received = conn.link.recv(&limits, &mut |frame| {
            // Payload frames are validated by the session before any payload byte is read.
            let mut st = conn.st.lock();
            if st.session.handle_frame(frame.clone(), Instant::now()).is_err() {
                let (d, _) = inner.drain(conn, &mut st);
                early = d;
                return Placement::Abort(FabricError::Closed { peer: conn.addr.to_string() });
            }
            let (d, p) = inner.drain(conn, &mut st);
            early = d;
            match p {
                Some(PayloadPlan::Eager { token, len, sink }) => {
                    drop(st);
                    if len == 0 {
                        plan = Some(PayloadPlan::Eager { token, len, sink });
                        return Placement::Discard;
                    }
                    match inner.pool.acquire(len as usize, Some(inner.deadline())) {
                        Ok(lease) => {
                            plan = Some(PayloadPlan::Eager { token, len, sink });
                            Placement::Into { lease, at: 0 }
                        }
                        Err(e) => {
                            early.push((sink, token.index as usize, Err(inner.pool_failure(conn, len as u64, e))));
                            Placement::Discard
                        }
                    }
                }
                Some(PayloadPlan::Pull { token, offset, last, .. }) => match st.pulls.remove(&token) {
                    Some((lease, guard)) => {
                        // The buffer travels through `recv`, its budget guard through the plan.
                        plan = Some(PayloadPlan::Pull { token, offset, last, guard: Some(guard) });
                        Placement::Into { lease, at: offset as usize }
                    }
                    None => {
                        Placement::Abort(FabricError::Unsupported(format!("{}: pull data for a block with no buffer", conn.addr)))
                    }
                },
                None => Placement::Discard,
            }
        });
        inner.deliver(std::mem::take(&mut early));
        match received {
            Ok(r) => {
                let deliveries = match (plan, r.payload) {
                    (None, _) if r.frame.kind().payload_offset().is_none() => {
                        let mut st = conn.st.lock();
                        let _ = st.session.handle_frame(r.frame, Instant::now());
                        inner.drain(conn, &mut st).0
                    }
                    (Some(PayloadPlan::Eager { token, sink, .. }), lease) => {
                        if lease.is_some() || r.frame.payload_len() == 0 {
                            inner.stats.eager_blocks.fetch_add(1, Ordering::Relaxed);
                            vec![(sink, token.index as usize, Ok(FetchedBlock { lease, _budget: None }))]
                        } else {
                            Vec::new()
                        }
                    }
                    (Some(PayloadPlan::Pull { token, last, guard, .. }), Some(lease)) => {
                        let mut st = conn.st.lock();
                        match guard {
                            Some(guard) if last => {
                                let sink = Inner::sink(&st, token.req);
                                let _ = st.session.pull_complete(token, Ok(()));
                                let mut d = inner.drain(conn, &mut st).0;
                                if let Some(sink) = sink {
                                    inner.stats.rendezvous_blocks.fetch_add(1, Ordering::Relaxed);
                                    inner.stats.stream_pulls.fetch_add(1, Ordering::Relaxed);
                                    d.push((
                                        sink,
                                        token.index as usize,
                                        Ok(FetchedBlock { lease: Some(lease), _budget: Some(guard) }),
                                    ));
                                }
                                d
                            }
                            // More chunks follow, unless the block failed meanwhile.
                            Some(guard) if !conn.dead.load(Ordering::Acquire) => {
                                st.pulls.insert(token, (lease, guard));
                                Vec::new()
                            }
                            _ => Vec::new(),
                        }
                    }
                    _ => Vec::new(),
                };
                inner.deliver(deliveries);
            }
            Err(e) => {
                let deliveries = {
                    let mut st = conn.st.lock();
                    st.session.handle_connection_lost(e.to_string());
                    let mut d = inner.drain(conn, &mut st).0;
                    // The session counted an eager block as done when its header arrived; if
                    // its payload never did, the failure is ours to report.
                    if let Some(PayloadPlan::Eager { token, sink, .. }) = plan {
                        let span = st.session.span(token);
                        let msg = format!("block {} of request {} ({span}) from {}: {e}", token.index, token.req, conn.addr);
                        d.push((sink, token.index as usize, Err(BlockFailure::new(FailureCode::PeerGone, msg))));
                    }
                    d
                };
                inner.deliver(deliveries);
                return;
            }
        }
    }
}

fn pull_loop(inner: &Arc<Inner>, rx: Receiver<PullJob>) {
    for PullJob { conn, token, desc } in rx.iter() {
        if conn.dead.load(Ordering::Acquire) {
            continue;
        }
        let deadline = inner.deadline();
        let complete = |result: Result<Option<(Lease, BudgetGuard)>, BlockFailure>| {
            let deliveries = {
                let mut st = conn.st.lock();
                let sink = Inner::sink(&st, token.req);
                let ok = result.is_ok();
                let _ = st.session.pull_complete(token, result.as_ref().map(|_| ()).map_err(|f| f.clone()));
                let mut d = inner.drain(&conn, &mut st).0;
                if let (true, Some(sink), Ok(buf)) = (ok, sink, result) {
                    inner.stats.rendezvous_blocks.fetch_add(1, Ordering::Relaxed);
                    let (lease, guard) = match buf {
                        Some((l, g)) => (Some(l), Some(g)),
                        None => (None, None),
                    };
                    d.push((sink, token.index as usize, Ok(FetchedBlock { lease, _budget: guard })));
                }
                d
            };
            inner.deliver(deliveries);
        };
        if desc.len == 0 {
            complete(Ok(None));
            continue;
        }
        // Budget what the pool will really hand out (tier-rounded), or the budget would let
        // more pool memory into flight than it means to.
        let cost = inner.pool.tier_capacity_for(desc.len as usize).unwrap_or(desc.len as usize) as u64;
        let Some(guard) = inner.budget.acquire(cost, deadline) else {
            complete(Err(BlockFailure::new(
                FailureCode::Timeout,
                format!(
                    "{}: {} bytes in flight did not drain within the fetch timeout",
                    inner.config.name, inner.config.max_bytes_in_flight
                ),
            )));
            continue;
        };
        let mut lease = match inner.pool.acquire(desc.len as usize, Some(deadline)) {
            Ok(l) => l,
            Err(e) => {
                complete(Err(inner.pool_failure(&conn, desc.len, e)));
                continue;
            }
        };
        if conn.link.one_sided_read() {
            match conn.link.read_remote(&desc, &mut lease) {
                Ok(()) => {
                    inner.stats.one_sided_reads.fetch_add(1, Ordering::Relaxed);
                    complete(Ok(Some((lease, guard))));
                }
                Err(e) => complete(Err(BlockFailure::new(
                    FailureCode::PullFailed,
                    format!("{}: read from {}: {e}", inner.config.name, conn.addr),
                ))),
            }
        } else {
            let deliveries = {
                let mut st = conn.st.lock();
                if st.session.send_pull(token).is_ok() {
                    st.pulls.insert(token, (lease, guard));
                }
                inner.drain(&conn, &mut st).0
            };
            inner.deliver(deliveries);
        }
    }
}

fn timer_loop(inner: &Arc<Inner>, stop: Receiver<()>) {
    // Deadlines are coarse (seconds): a 100 ms tick is precise enough and keeps one timer
    // for all connections.
    while let Err(crossbeam_channel::RecvTimeoutError::Timeout) = stop.recv_timeout(Duration::from_millis(100)) {
        let conns: Vec<_> = inner.conns.lock().values().cloned().collect();
        let now = Instant::now();
        for c in conns {
            let deliveries = {
                let mut st = c.st.lock();
                match st.session.poll_timeout() {
                    Some(t) if t <= now => {
                        st.session.handle_timeout(now);
                        inner.drain(&c, &mut st).0
                    }
                    _ => continue,
                }
            };
            inner.deliver(deliveries);
        }
    }
}
