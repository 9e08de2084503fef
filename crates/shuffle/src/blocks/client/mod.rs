//! The fetching endpoint: one connection per server address, a [`ClientSession`] each, all
//! run by the driver's loop. Fetched blocks land in [`TieredPool`] buffers and go to a
//! [`BlockSink`]: on the loop thread itself when the sink is cheap ([`BlockSink::inline`]),
//! otherwise on the driver's delivery thread.
//!
//! Memory: a block's buffer is taken with `try_acquire` only, never waited for. A
//! rendezvous block that finds no buffer (or no room in the bytes-in-flight budget) waits in
//! the loop's queue, and its session does not count that wait as peer silence. An eager
//! payload that finds no buffer stops its stream connection (the socket buffer and TCP flow
//! control push back on that one peer) or, on message transports whose receive buffers are
//! shared by every peer, is copied aside until a buffer comes back, so the shared receive
//! queue never runs dry because of a slow consumer.

mod incoming;
mod memory;
mod stream;

pub use stream::{ChunkSink, StreamConfig};

use super::budget::{BudgetGuard, ByteBudget};
use super::delivery::{Delivery, Job as DeliveryJob};
use super::MemWaiter;
use incoming::*;
use memory::*;
use rdma_shuffle_fabric::driver::{Conn, ConnKey, Handler, Incoming, Role};
use rdma_shuffle_fabric::driver::{Driver, Loop, Service};
use rdma_shuffle_fabric::memory::pool::{Lease, TieredPool};
use rdma_shuffle_fabric::providers::link::OutPayload;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::{
    caps, BlockFailure, BlockRange, BlockSpan, ClientConfig, ClientSession, Descriptor, FailureCode, Knob, Limits, ProtocolError,
    RequestId, Secret, Token,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Receives the outcome of each block of one fetch, exactly once per block: on the driver's
/// delivery thread, or, for a fetched block of a sink whose [`inline`](Self::inline) says so,
/// directly on the driver's loop thread.
pub trait BlockSink: Send + Sync {
    /// Block `index` of the fetch's list arrived (`Ok`) or failed (`Err`).
    fn on_block(&self, index: usize, result: Result<FetchedBlock, BlockFailure>);

    /// Whether [`on_block`](Self::on_block) with a fetched block (`Ok`) is cheap and never
    /// waits: it does no I/O, holds no lock for long, and never waits for this engine (no
    /// fetch-and-wait, no shutdown). Then the loop calls it on its own thread as the block
    /// completes, with no hand-off to the delivery thread (one thread wake-up less per block:
    /// the caller that waits for the block is woken by the sink itself). Failures always go
    /// through the delivery thread: a sink's failure path may do slow work (retries, a call
    /// to another service). The default, `false`, keeps every outcome off the loop, so a slow
    /// sink never stalls I/O.
    fn inline(&self) -> bool {
        false
    }
}

/// A fetched block's bytes, in pool memory until dropped.
#[derive(Debug)]
pub struct FetchedBlock {
    lease: Option<Lease>,
    _budget: Option<BudgetGuard>,
    /// Length of the whole block this is (a range of, for a range fetch).
    block_len: u64,
}

impl FetchedBlock {
    /// Length of the whole block: [`len`](Self::len) for a whole block, more for a range of
    /// a longer one ([`ClientEndpoint::fetch_ranges`]).
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// Block length.
    pub fn len(&self) -> usize {
        self.lease.as_ref().map(|l| l.len()).unwrap_or(0)
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pool buffer holding the bytes (`None` for an empty block). The block's share of
    /// the bytes-in-flight budget is given back here.
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
    /// Shared secret; servers must prove it too.
    pub secret: Option<Secret>,
    /// This engine's application id; servers of another application are refused.
    pub app_id: String,
    /// Limit for establishing a connection.
    pub connect_timeout: Duration,
    /// Limit for the handshake.
    pub handshake_timeout: Duration,
    /// Limit for silence from a server while we wait for it.
    pub fetch_timeout: Duration,
    /// Largest block accepted inline.
    pub max_eager: u32,
    /// Bound on rendezvous bytes in flight (being read, or delivered and not yet dropped),
    /// over all servers. Capped at half the pool: the other half stays for eager blocks, so a
    /// stream never waits for memory only its own progress could free.
    pub max_bytes_in_flight: u64,
    /// Bounds on what servers may send.
    pub limits: Limits,
    /// Name used in logs and errors (the executor id).
    pub name: String,
}

impl Default for ClientEndpointConfig {
    fn default() -> Self {
        ClientEndpointConfig {
            secret: None,
            app_id: String::new(),
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(30),
            fetch_timeout: Duration::from_secs(120),
            max_eager: 1024 * 1024,
            max_bytes_in_flight: 48 * 1024 * 1024,
            limits: Limits::default(),
            name: "client".into(),
        }
    }
}

/// Counters of a fetching endpoint.
#[derive(Debug, Default)]
pub struct ClientStats {
    /// Connections whose handshake completed.
    pub connections: AtomicU64,
    /// Connection attempts that failed.
    pub connect_failures: AtomicU64,
    /// Client connections open now.
    pub connections_open: AtomicU64,
    /// Blocks delivered.
    pub blocks_fetched: AtomicU64,
    /// Bytes delivered.
    pub bytes_fetched: AtomicU64,
    /// Blocks delivered inline.
    pub eager_blocks: AtomicU64,
    /// Bytes delivered inline.
    pub eager_bytes: AtomicU64,
    /// Blocks delivered by rendezvous.
    pub rendezvous_blocks: AtomicU64,
    /// Bytes delivered by rendezvous.
    pub rendezvous_bytes: AtomicU64,
    /// Rendezvous blocks read one-sidedly (RDMA READ / sim).
    pub one_sided_reads: AtomicU64,
    /// Bytes read one-sidedly.
    pub read_bytes: AtomicU64,
    /// Rendezvous blocks pulled over the stream (tcp).
    pub stream_pulls: AtomicU64,
    /// Blocks that failed.
    pub failed_blocks: AtomicU64,
    /// Blocks that failed, by [`FailureCode`] (index of the code in [`FailureCode::ALL`]).
    pub failed_by_code: [AtomicU64; FailureCode::ALL.len()],
    /// Eager payloads copied aside because no pool buffer was free when they arrived.
    pub staged_payloads: AtomicU64,
    /// Connections closed after their idle timeout.
    pub idle_closes: AtomicU64,
    /// Blocks fetched as a stream of ranges ([`ClientEndpoint::fetch_stream`]) to the end.
    pub streamed_blocks: AtomicU64,
    /// Bytes of those blocks.
    pub streamed_bytes: AtomicU64,
    /// Ranges delivered to streams, their length probes included. Each is also counted in
    /// [`blocks_fetched`](Self::blocks_fetched) and `rendezvous_blocks` as it arrives, so the
    /// blocks a consumer asked for are `blocks_fetched - stream_ranges + streamed_blocks`.
    pub stream_ranges: AtomicU64,
    /// Most pool buffers one streamed block held at once (ranges requested and not yet
    /// handed to the stream's sink), over all streams.
    pub peak_stream_buffers: AtomicU64,
}

impl ClientStats {
    /// Failed blocks of `code`.
    pub fn failed(&self, code: FailureCode) -> u64 {
        FailureCode::ALL.iter().position(|c| *c == code).map(|i| self.failed_by_code[i].load(Ordering::Relaxed)).unwrap_or(0)
    }
}

/// Fetches blocks from many servers at once.
pub struct ClientEndpoint {
    driver: Driver,
    id: u64,
    pool: TieredPool,
    stats: Arc<ClientStats>,
    loop_stats: Arc<super::BlockLoopStats>,
    closed: AtomicBool,
}

impl ClientEndpoint {
    /// A fetching endpoint on `driver`, landing blocks in `pool`.
    pub fn new(driver: &Driver, pool: TieredPool, config: ClientEndpointConfig) -> Result<Self, FabricError> {
        let half = (pool.config().cap_bytes / 2).max(1);
        let mut config = config;
        if config.max_bytes_in_flight > half {
            tracing::debug!(requested = config.max_bytes_in_flight, used = half, "bytes in flight capped at half the pool");
            config.max_bytes_in_flight = half;
        }
        let id = driver.next_id();
        let budget = ByteBudget::new(config.max_bytes_in_flight);
        let hook = driver.release_hook();
        budget.set_hook(Arc::downgrade(&hook));
        pool.add_release_hook(Arc::downgrade(&hook));
        let stats = Arc::new(ClientStats::default());
        let a = AddClient { id, config, pool: pool.clone(), budget, stats: stats.clone() };
        let (tx, rx) = crossbeam_channel::bounded(1);
        driver.submit(move |lp| {
            add_client(lp, a);
            let _ = tx.send(super::loop_stats(lp));
        })?;
        // The endpoint (and the loop's delivery thread, made with its first endpoint) exists
        // when this returns, as a server endpoint's listener does.
        let loop_stats = rx.recv_timeout(Duration::from_secs(30)).map_err(|_| FabricError::Shutdown)?;
        Ok(ClientEndpoint { driver: driver.clone(), id, pool, stats, loop_stats, closed: AtomicBool::new(false) })
    }

    /// Counters.
    pub fn stats(&self) -> &ClientStats {
        &self.stats
    }

    /// The counters this endpoint shares with the other endpoints of its loop (deliveries,
    /// the servers' exposure budget).
    pub fn loop_stats(&self) -> &super::BlockLoopStats {
        &self.loop_stats
    }

    /// The pool blocks land in.
    pub fn pool(&self) -> &TieredPool {
        &self.pool
    }

    /// The provider's name.
    pub fn provider(&self) -> &'static str {
        self.driver.provider_name()
    }

    /// The driver this endpoint runs on.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.stats.connections_open.load(Ordering::Relaxed) as usize
    }

    /// Fetches `blocks` from the server at `addr`. Returns at once; `sink` gets every block's
    /// outcome exactly once, on the delivery thread (fetched blocks of an
    /// [`inline`](BlockSink::inline) sink: on the loop thread).
    pub fn fetch(&self, addr: SocketAddr, blocks: Vec<BlockSpan>, sink: Arc<dyn BlockSink>) {
        if blocks.is_empty() {
            return;
        }
        self.submit(FetchCmd { client: self.id, addr, blocks, ranges: None, sink });
    }

    /// Fetches byte ranges of blocks from the server at `addr` (each range at most
    /// [`rdma_shuffle_wire::frame::MAX_RANGE_LEN`], inside its block, or it fails with
    /// `BadRange`). Each range lands in one pool buffer; [`FetchedBlock::block_len`] says how
    /// long the whole block is. `sink` gets every range's outcome exactly once.
    pub fn fetch_ranges(&self, addr: SocketAddr, ranges: Vec<BlockRange>, sink: Arc<dyn BlockSink>) {
        if ranges.is_empty() {
            return;
        }
        let blocks = ranges.iter().map(|r| r.span).collect();
        self.submit(FetchCmd { client: self.id, addr, blocks, ranges: Some(ranges), sink });
    }

    /// A handle that submits fetches to this endpoint from anywhere (a stream's sink).
    pub(crate) fn fetcher(&self) -> Fetcher {
        Fetcher { driver: self.driver.clone(), id: self.id, stats: self.stats.clone() }
    }

    fn submit(&self, f: FetchCmd) {
        if let Err(e) = self.driver.submit_job(Box::new(f)) {
            // The loop is gone: nothing else would ever answer these blocks.
            tracing::debug!(error = %e, "fetch after shutdown");
        }
        if self.closed.load(Ordering::Acquire) || self.driver.stopping() {
            // Commands queued after the loop's last turn are answered here.
            self.drain_unanswered();
        }
    }

    fn drain_unanswered(&self) {
        for job in self.driver.take_jobs(self.id) {
            job.cancel();
        }
    }

    /// Closes every connection (outstanding blocks fail with `PeerGone`). Idempotent.
    pub fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let id = self.id;
        let removed = self.driver.submit(move |lp| {
            remove_client(lp, id);
            let _ = tx.send(());
        });
        if removed.is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(30));
        }
        self.drain_unanswered();
    }
}

impl Drop for ClientEndpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub(crate) struct AddClient {
    id: u64,
    config: ClientEndpointConfig,
    pool: TieredPool,
    budget: Arc<ByteBudget>,
    stats: Arc<ClientStats>,
}

pub(crate) struct FetchCmd {
    pub(crate) client: u64,
    addr: SocketAddr,
    blocks: Vec<BlockSpan>,
    ranges: Option<Vec<BlockRange>>,
    sink: Arc<dyn BlockSink>,
}

impl rdma_shuffle_fabric::driver::Job for FetchCmd {
    fn run(self: Box<Self>, lp: &mut Loop) {
        fetch(lp, *self)
    }

    fn cancel(self: Box<Self>) {
        for (i, span) in self.blocks.iter().enumerate() {
            self.sink.on_block(i, Err(BlockFailure::new(FailureCode::PeerGone, format!("{span}: the endpoint is shut down"))));
        }
    }

    fn owner(&self) -> Option<u64> {
        Some(self.client)
    }
}

/// Submits fetches to one endpoint's loop; what a stream holds to ask for its next ranges.
#[derive(Clone)]
pub(crate) struct Fetcher {
    driver: Driver,
    id: u64,
    pub(crate) stats: Arc<ClientStats>,
}

impl Fetcher {
    /// As [`ClientEndpoint::fetch_ranges`]; an error when the loop is gone and nothing will
    /// answer (a command the loop took is answered, if need be by the endpoint's shutdown).
    pub(crate) fn fetch_ranges(
        &self,
        addr: SocketAddr,
        ranges: Vec<BlockRange>,
        sink: Arc<dyn BlockSink>,
    ) -> Result<(), FabricError> {
        let blocks = ranges.iter().map(|r| r.span).collect();
        self.driver.submit_job(Box::new(FetchCmd { client: self.id, addr, blocks, ranges: Some(ranges), sink }))
    }
}

/// A client endpoint, inside the loop.
pub(crate) struct ClientEp {
    config: ClientEndpointConfig,
    pool: TieredPool,
    budget: Arc<ByteBudget>,
    stats: Arc<ClientStats>,
    conns: HashMap<SocketAddr, ConnKey>,
}

/// What a block waiting for memory needs.
pub(crate) enum MemWait {
    /// A buffer (and budget) to pull a rendezvous block into.
    Rendezvous { token: Token, desc: Descriptor },
    /// A buffer for an eager payload copied aside (message transports).
    Staged { ep: u64, sink: Arc<dyn BlockSink>, index: usize, bytes: Vec<u8> },
    /// A buffer for the eager payload its stream connection stopped at.
    Payload,
}

/// What the payload being read on a stream connection is for.
enum PayloadState {
    None,
    /// No buffer yet: the connection reads nothing until one comes.
    NeedsMemory {
        token: Token,
        len: u32,
        sink: Option<Arc<dyn BlockSink>>,
    },
    Eager {
        token: Token,
        sink: Option<Arc<dyn BlockSink>>,
    },
    Pull {
        token: Token,
        last: bool,
        /// Bytes still to come into the pull's buffer: this `PullData`'s length, or, when the
        /// buffer was taken only after the bytes began to arrive, the rest of the buffer from
        /// the payload's offset (the same unless a pull is cut into several `PullData`).
        len: u64,
    },
    /// A pull's bytes arrived and its buffer is taken only now (see
    /// [`ClientConn::pull_unleased`]): the connection reads nothing until the pool gives one.
    PullNeedsMemory {
        token: Token,
        len: usize,
        at: usize,
        last: bool,
    },
    Discard,
}

/// Pulled payloads of this many bytes or more are read with the loop spinning (see
/// [`ClientConn::streaming`]).
const SPIN_THROUGH_PULLS_FROM: u64 = 2 << 20;

/// A client connection, inside the loop.
pub(crate) struct ClientConn {
    ep: u64,
    stats: Arc<ClientStats>,
    addr: SocketAddr,
    pub(crate) session: ClientSession,
    sinks: HashMap<RequestId, Arc<dyn BlockSink>>,
    /// (stream pulls) buffers of blocks being pulled, and their budget.
    pull_leases: HashMap<Token, Lease>,
    pull_guards: HashMap<Token, Option<BudgetGuard>>,
    /// (stream pulls) blocks whose `Pull` went out with their budget but no buffer yet, by
    /// length: the buffer is taken from the pool when the first bytes arrive. The pool hands
    /// out the buffer freed last, so the kernel's copy lands in memory still in cache; taken
    /// when the region was announced, each buffer waited for every block in flight ahead of
    /// it (48 MiB at 1 and 4 MiB blocks in engine-bench) and was written cold.
    pull_unleased: HashMap<Token, usize>,
    /// Whether the link is a byte stream (tcp: every frame an [`Incoming::Frame`] whose payload
    /// is placed for reading): `Some(true)` from the first frame on, until a message arrives;
    /// any message makes it `Some(false)` for good. Message links (shm, ofi and verbs once
    /// attached) deliver a `Rendezvous` as a message, so they are never taken for a stream
    /// when its pull starts, even after handshake frames or a lent body came as frames.
    stream: Option<bool>,
    /// One-sided reads in flight: tag → block, budget, length.
    reads: HashMap<u64, (Token, Option<BudgetGuard>, u64)>,
    /// Whole-block lengths of rendezvous blocks not yet delivered (ranges of longer blocks).
    block_lens: HashMap<Token, u64>,
    next_tag: u64,
    payload: PayloadState,
    connected: bool,
    connect_deadline: Instant,
    /// The handshake completed (counted once).
    counted: bool,
}

impl ClientConn {
    pub(crate) fn blocked(&self) -> bool {
        matches!(self.payload, PayloadState::NeedsMemory { .. } | PayloadState::PullNeedsMemory { .. })
    }

    /// Whether a pulled block's bytes are being placed from the stream (tcp) and are short
    /// enough that the loop should sleep between their pieces rather than spin. Every answer
    /// on this connection is behind those bytes, which come at the wire's pace: a spinning
    /// loop reads them a few at a time. Measured on loopback (whole `bench-engine.sh`, three
    /// interleaved pairs each): sleeping through 1 MiB pulls took the engine's CPU per GiB
    /// from 0.82-0.90x Netty's to 0.68-0.81x at the same throughput. Through 4 MiB pulls it
    /// saved 6 % of the CPU, and the throughput was 8 % lower in all three pairs; but with
    /// the 4 MiB path unchanged the same comparison read 4 % lower, so that loss is not
    /// resolved from noise. Until it is, pulls from [`SPIN_THROUGH_PULLS_FROM`] on keep the
    /// spin, as before.
    fn streaming(&self) -> bool {
        matches!(self.payload, PayloadState::Pull { len, .. } if len < SPIN_THROUGH_PULLS_FROM)
    }

    fn idle(&self) -> bool {
        self.session.is_ready()
            && self.session.outstanding_blocks() == 0
            && self.reads.is_empty()
            && matches!(self.payload, PayloadState::None | PayloadState::Discard)
    }
}

fn client_mut(conn: &mut Conn) -> &mut ClientConn {
    conn.role.get_mut::<ClientConn>().unwrap_or_else(|| unreachable_role())
}

#[cold]
fn unreachable_role() -> ! {
    // Only called from the client's handler, which the loop calls for client roles only.
    panic!("client handler called on a connection of another role")
}

/// The block client's [`Handler`]: fetches over one connection to a server.
pub(crate) struct ClientHandler;

impl Handler for ClientHandler {
    fn blocked(&self, conn: &Conn) -> bool {
        conn.role.get::<ClientConn>().is_some_and(|c| c.blocked())
    }

    fn connected(&self, _lp: &mut Loop, conn: &mut Conn) {
        client_connected(conn)
    }

    fn incoming(&self, lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
        client_incoming(lp, conn, inc)
    }

    fn failed(&self, lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool {
        client_failed(lp, conn, error);
        false
    }

    fn after(&self, lp: &mut Loop, conn: &mut Conn) {
        client_after(lp, conn)
    }

    fn deadline(&self, lp: &Loop, conn: &Conn) -> Option<Instant> {
        client_deadline(lp, conn, conn.role.get::<ClientConn>()?)
    }

    fn timeout(&self, lp: &mut Loop, conn: &mut Conn, now: Instant) {
        client_timeout(lp, conn, now)
    }

    fn removed(&self, lp: &mut Loop, conn: &mut Conn) {
        client_removed(lp, conn)
    }
}

fn code_index(code: FailureCode) -> usize {
    FailureCode::ALL.iter().position(|c| *c == code).unwrap_or(FailureCode::ALL.len() - 1)
}

/// The client endpoints of a loop, the blocks waiting for memory, and the delivery thread
/// (one per loop, made with the first endpoint): this protocol's [loop state](Loop::state).
#[derive(Default)]
pub(crate) struct Clients {
    pub(crate) eps: HashMap<u64, ClientEp>,
    /// Blocks waiting for local memory, in arrival order.
    pub(crate) waiters: std::collections::VecDeque<MemWaiter>,
    delivery: Option<Delivery>,
}

/// The loop's client state (made on first use).
pub(crate) fn clients(lp: &mut Loop) -> &mut Clients {
    lp.state::<Clients>()
}

/// The loop's client state, if any endpoint was added.
pub(crate) fn clients_ref(lp: &Loop) -> Option<&Clients> {
    lp.state_ref::<Clients>()
}

/// Hands an outcome to its sink: a cheap sink's fetched block at once, on this thread;
/// anything else through the delivery thread.
pub(crate) fn deliver(lp: &Loop, job: DeliveryJob) {
    match clients_ref(lp).and_then(|c| c.delivery.as_ref()) {
        Some(d) => d.send(job),
        None => Delivery::deliver_here(job),
    }
}

/// The block client's loop-wide hooks.
struct ClientService;

impl Service for ClientService {
    fn memory(&self, lp: &mut Loop) -> bool {
        serve_waiters(lp)
    }

    fn awaiting_answers(&self, lp: &Loop) -> bool {
        awaiting_answers(lp)
    }

    fn shutdown(&self, lp: &mut Loop) {
        let ids: Vec<u64> = clients(lp).eps.keys().copied().collect();
        for id in ids {
            remove_client(lp, id);
        }
    }
}

pub(crate) fn add_client(lp: &mut Loop, a: AddClient) {
    let AddClient { id, config, pool, budget, stats } = a;
    lp.add_service(&ClientService);
    if clients(lp).delivery.is_none() {
        let name = lp.name().to_string();
        let stats = super::loop_stats(lp);
        match Delivery::start(&name, stats) {
            Ok(d) => clients(lp).delivery = Some(d),
            // Outcomes are then delivered on the loop thread: slower sinks stall I/O, but
            // nothing is lost.
            Err(e) => {
                tracing::error!(driver = %name, error = %e, "could not start the delivery thread; delivering on the loop thread")
            }
        }
    }
    clients(lp).eps.insert(id, ClientEp { config, pool, budget, stats, conns: HashMap::new() });
}

pub(crate) fn remove_client(lp: &mut Loop, id: u64) {
    let Some(ep) = clients(lp).eps.get(&id) else { return };
    let keys: Vec<ConnKey> = ep.conns.values().copied().collect();
    for k in keys {
        if let Some(mut conn) = lp.take(k) {
            client_mut(&mut conn).session.close();
            client_events(lp, &mut conn, None);
            lp.close(&mut conn, "the client endpoint was shut down".into(), false);
            lp.put(conn);
        }
    }
    clients(lp).eps.remove(&id);
    // Staged payloads of this endpoint fail now (no pool to put them in).
    serve_waiters(lp);
}

pub(crate) fn fetch(lp: &mut Loop, f: FetchCmd) {
    let FetchCmd { client, addr, blocks, ranges, sink } = f;
    let fail_all = |lp: &Loop, code: FailureCode, why: String, knob: Option<Knob>| {
        for (i, span) in blocks.iter().enumerate() {
            let failure = BlockFailure::new(code, format!("{span}: {why}")).with_knob(knob);
            if let Some(ep) = clients_ref(lp).and_then(|c| c.eps.get(&client)) {
                ep.stats.failed_blocks.fetch_add(1, Ordering::Relaxed);
                ep.stats.failed_by_code[code_index(code)].fetch_add(1, Ordering::Relaxed);
            }
            deliver(lp, (sink.clone(), i, Err(failure)));
        }
    };
    let Some(ep) = clients(lp).eps.get(&client) else {
        fail_all(lp, FailureCode::PeerGone, "the endpoint is shut down".into(), None);
        return;
    };
    // A connection that is closing (idle, or failed and draining its device work) takes
    // no new requests: the fetch opens a new one.
    let existing = ep.conns.get(&addr).copied().filter(|k| lp.live(*k));
    let (key, fresh) = match existing {
        Some(k) => (k, false),
        None => match client_connect(lp, client, addr) {
            Ok(k) => (k, true),
            Err(e) => {
                let name = clients(lp).eps.get(&client).map(|e| e.config.name.clone()).unwrap_or_default();
                if let Some(ep) = clients_ref(lp).and_then(|c| c.eps.get(&client)) {
                    ep.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                }
                let code =
                    if matches!(e, FabricError::ConnectTimeout { .. }) { FailureCode::Timeout } else { FailureCode::PeerGone };
                let knob = e.knob();
                fail_all(lp, code, format!("{name} cannot reach {addr}: {e}"), knob);
                return;
            }
        },
    };
    let Some(mut conn) = lp.take(key) else {
        // Gone between the lookup and now (cannot happen within one turn): fail rather than
        // lose the blocks.
        fail_all(lp, FailureCode::PeerGone, format!("the connection to {addr} closed"), None);
        return;
    };
    // The request is in the session before the connection is first driven: a peer that
    // answers (or refuses) at once still finds it there.
    let c = client_mut(&mut conn);
    let req = match ranges {
        Some(r) => c.session.fetch_ranges(r, Instant::now()),
        None => c.session.fetch(blocks, Instant::now()),
    };
    c.sinks.insert(req, sink);
    client_events(lp, &mut conn, None);
    lp.put(conn);
    if fresh {
        lp.activate(key);
    }
}

pub(super) fn client_connect(lp: &mut Loop, ep_id: u64, addr: SocketAddr) -> Result<ConnKey, FabricError> {
    let mut transport = lp.connect(addr)?;
    let ep = clients(lp).eps.get_mut(&ep_id).ok_or(FabricError::Shutdown)?;
    let cfg = &ep.config;
    let now = Instant::now();
    let mut sc = ClientConfig::new(addr.to_string(), rand::random());
    sc.secret = cfg.secret.clone();
    sc.app_id = cfg.app_id.clone();
    let link = transport.capabilities();
    sc.max_eager = cfg.max_eager.min(link.max_eager);
    sc.limits = cfg.limits;
    sc.handshake_timeout = cfg.handshake_timeout;
    sc.fetch_timeout = cfg.fetch_timeout;
    if transport.receive_credits().is_some() {
        // Answers land in a shared receive queue: the driver sends requests only as far
        // as the queue has room for their answers, and a Fetch must fit one buffer.
        sc.auto_flush = false;
        let fit = (link.max_eager as usize / BlockSpan::ENCODED_LEN).max(1) as u32;
        sc.limits.max_blocks_per_fetch = sc.limits.max_blocks_per_fetch.min(fit);
    }
    if !link.one_sided {
        sc.caps &= !caps::RDMA_READ;
    }
    let connect_deadline = now + cfg.connect_timeout;
    let session = ClientSession::new(sc, now);
    let codec = crate::blocks::codec::WireCodec::new(session.limits());
    let role = Role::new(
        &ClientHandler,
        ClientConn {
            ep: ep_id,
            stats: ep.stats.clone(),
            addr,
            session,
            sinks: HashMap::new(),
            pull_leases: HashMap::new(),
            pull_guards: HashMap::new(),
            pull_unleased: HashMap::new(),
            stream: None,
            reads: HashMap::new(),
            block_lens: HashMap::new(),
            next_tag: 1,
            payload: PayloadState::None,
            connected: transport.is_connected(),
            connect_deadline,
            counted: false,
        },
        codec,
    );
    let stats = ep.stats.clone();
    let key = lp.insert(addr.to_string(), transport, role);
    stats.connections_open.fetch_add(1, Ordering::Relaxed);
    if let Some(ep) = clients(lp).eps.get_mut(&ep_id) {
        ep.conns.insert(addr, key);
    }
    // Activated by the caller once the first request is in the session.
    Ok(key)
}

pub(crate) fn client_connected(conn: &mut Conn) {
    client_mut(conn).connected = true;
}

/// Sends what the session queued (where answers take room in a shared receive queue,
/// verbs, first the requests it has room to answer).
pub(crate) fn client_after(lp: &mut Loop, conn: &mut Conn) {
    let Some(c) = conn.role.get_mut::<ClientConn>() else { return };
    if c.session.queued_blocks() > 0 {
        if let Some(credits) = conn.transport.receive_credits() {
            if let Some(room) = credits.answer_room() {
                let sent = c.session.flush_requests(room, Instant::now());
                let starved = c.session.queued_blocks() > 0;
                credits.answers_requested(sent, starved);
            }
        }
    }
    // The requests, pulls and releases of one turn leave together (tcp: one writev).
    conn.transport.cork();
    let mut sent = Ok(());
    while let Some(f) = client_mut(conn).session.poll_transmit() {
        sent = conn.transport.send(f.to_vec(), OutPayload::None);
        if sent.is_err() {
            break;
        }
    }
    if let Err(e) = sent.and(conn.transport.uncork()) {
        lp.fail(conn, e);
    }
}

pub(crate) fn client_deadline(lp: &Loop, conn: &Conn, c: &ClientConn) -> Option<Instant> {
    let mut d = c.session.poll_timeout();
    if !c.connected {
        d = Some(d.map_or(c.connect_deadline, |x| x.min(c.connect_deadline)));
    }
    if c.idle() {
        let idle = conn.last_active + lp.idle_timeout();
        d = Some(d.map_or(idle, |x| x.min(idle)));
    }
    d
}

pub(crate) fn client_timeout(lp: &mut Loop, conn: &mut Conn, now: Instant) {
    let ep_id = client_mut(conn).ep;
    let c = client_mut(conn);
    if !c.connected && now >= c.connect_deadline {
        let ms = clients(lp).eps.get(&ep_id).map(|e| e.config.connect_timeout.as_millis() as u64).unwrap_or(0);
        c.session.fail_with(ProtocolError::Timeout {
            what: "connecting",
            waited_ms: ms,
            timeout_ms: ms,
            knob: Knob::ConnectTimeout,
        });
        if let Some(ep) = clients(lp).eps.get(&ep_id) {
            ep.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
        }
        client_events(lp, conn, None);
        return;
    }
    c.session.handle_timeout(now);
    if client_mut(conn).session.is_closed() {
        client_events(lp, conn, None);
        return;
    }
    if client_mut(conn).idle() && now >= conn.last_active + lp.idle_timeout() {
        if let Some(ep) = clients(lp).eps.get(&ep_id) {
            ep.stats.idle_closes.fetch_add(1, Ordering::Relaxed);
        }
        lp.stats().idle_closes.fetch_add(1, Ordering::Relaxed);
        client_mut(conn).session.close();
        client_events(lp, conn, None);
    }
}

pub(crate) fn client_failed(lp: &mut Loop, conn: &mut Conn, error: &FabricError) {
    let c = client_mut(conn);
    if !c.session.is_closed() {
        match crate::blocks::codec::frame_error_of(error) {
            Some(source) => {
                c.session.handle_decode_error(source.clone());
            }
            None => c.session.handle_connection_lost(error.to_string()),
        }
    }
    client_events(lp, conn, None);
}

pub(crate) fn client_removed(lp: &mut Loop, conn: &mut Conn) {
    let c = client_mut(conn);
    let (ep_id, addr) = (c.ep, c.addr);
    c.pull_leases.clear();
    c.pull_guards.clear();
    c.pull_unleased.clear();
    let reads = c.reads.len();
    c.reads.clear();
    if reads > 0 {
        lp.stats().note_reads(-(reads as i64));
    }
    c.stats.connections_open.fetch_sub(1, Ordering::Relaxed);
    if let Some(ep) = clients(lp).eps.get_mut(&ep_id) {
        if ep.conns.get(&addr) == Some(&conn.key) {
            ep.conns.remove(&addr);
        }
    }
}

/// Whether a client connection waits for answers from its server (blocks asked for and
/// not yet complete, none of them waiting for local memory, and no pulled payload streaming
/// in): what makes spinning before sleeping worth it, since the answer is on its way.
pub(crate) fn awaiting_answers(lp: &Loop) -> bool {
    let Some(clients) = clients_ref(lp) else { return false };
    clients.eps.values().flat_map(|ep| ep.conns.values()).any(|k| {
        lp.conn_ref(*k)
            .and_then(|conn| conn.role.get::<ClientConn>())
            .is_some_and(|c| c.session.outstanding_blocks() > 0 && !c.blocked() && !c.streaming())
    })
}

/// Blocks of `ep` the driver still holds (for shutdown accounting in tests).
#[allow(dead_code)]
pub(crate) fn client_budget_used(lp: &Loop, ep: u64) -> u64 {
    clients_ref(lp).and_then(|c| c.eps.get(&ep)).map(|e| e.budget.used()).unwrap_or(0)
}

/// How a block was delivered, for the counters.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Eager,
    Read,
    Stream,
}
