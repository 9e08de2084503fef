//! The sim provider: an in-memory network inside one process.
//!
//! Connections carry whole messages (like verbs SEND/RECV) between driver loops, which wake
//! each other through their wakers. One-sided reads follow the rules of a verbs memory window
//! of type 2, which is what the verbs provider exposes rendezvous regions with:
//!
//! * a region is readable only after the server exposed it on *this* connection (so only by
//!   an authenticated peer, since exposure follows a `Fetch`), only through this connection
//!   (another peer's connection has its own table: a key from it is worth nothing here), and
//!   only until the client's `Release` revokes it;
//! * the key must match and the whole range must lie inside the exposed region.
//!
//! Anything else is a "remote access error", as the NIC would report. So the security tests
//! of the protocol run on sim exactly as on verbs.

use mio::{Registry, Token};
use parking_lot::Mutex;
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::{Lease, NoRegistration};
use rdma_shuffle_fabric::memory::registration::Registrar;
use rdma_shuffle_fabric::providers::codec::{message_head, Codec};
pub(crate) use rdma_shuffle_fabric::providers::link::Notify;
use rdma_shuffle_fabric::providers::link::ProviderCounters;
use rdma_shuffle_fabric::providers::link::{
    encode_message, Capabilities, EngineCtx, FailedRead, Folds, Incoming, Link, Listener, MsgPayload, OneSided, OutPayload,
    ProviderEngine,
};
use rdma_shuffle_fabric::providers::{Provider, ProviderCapabilities, Source};
use rdma_shuffle_wire::Descriptor;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Default)]
struct Network {
    listeners: Mutex<HashMap<SocketAddr, Arc<SimAcceptQueue>>>,
    next_port: AtomicU16,
    reads: AtomicU64,
    read_bytes: AtomicU64,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network").field("listeners", &self.listeners.lock().len()).finish()
    }
}

/// An in-memory provider. Clones share one network: a listener made through one clone is
/// reachable through every other.
#[derive(Debug, Clone)]
pub struct SimProvider {
    net: Arc<Network>,
    one_sided: bool,
}

impl Default for SimProvider {
    fn default() -> Self {
        Self::new(true)
    }
}

impl SimProvider {
    /// A new, empty network. With `one_sided`, rendezvous blocks are read one-sidedly (as on
    /// verbs); without, they are pulled over the connection (as on tcp).
    pub fn new(one_sided: bool) -> Self {
        let net = Network { next_port: AtomicU16::new(40000), ..Default::default() };
        SimProvider { net: Arc::new(net), one_sided }
    }

    /// Whether rendezvous blocks are read one-sidedly on this network.
    pub fn one_sided(&self) -> bool {
        self.one_sided
    }

    /// One-sided reads done on this network, and their bytes.
    pub fn read_counters(&self) -> (u64, u64) {
        (self.net.reads.load(Ordering::Relaxed), self.net.read_bytes.load(Ordering::Relaxed))
    }

    /// Listens on `addr` (port 0 picks one).
    pub(crate) fn listen(&self, addr: SocketAddr) -> Result<(SocketAddr, Arc<SimAcceptQueue>), FabricError> {
        let mut addr = addr;
        if addr.port() == 0 {
            addr.set_port(self.net.next_port.fetch_add(1, Ordering::Relaxed));
        }
        let mut ls = self.net.listeners.lock();
        if ls.contains_key(&addr) {
            return Err(FabricError::io(&addr.to_string(), "listen on", std::io::ErrorKind::AddrInUse.into()));
        }
        let q = Arc::new(SimAcceptQueue { pending: Mutex::new(VecDeque::new()), notify: Mutex::new(None) });
        ls.insert(addr, q.clone());
        Ok((addr, q))
    }

    /// Stops listening on `addr`.
    pub(crate) fn unlisten(&self, addr: SocketAddr) {
        self.net.listeners.lock().remove(&addr);
    }

    /// Connects to a listener at `addr`; the connection is usable at once.
    pub(crate) fn connect(&self, addr: SocketAddr) -> Result<SimConn, FabricError> {
        let q = self
            .net
            .listeners
            .lock()
            .get(&addr)
            .cloned()
            .ok_or_else(|| FabricError::io(&addr.to_string(), "connect to", std::io::ErrorKind::ConnectionRefused.into()))?;
        let client_name = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.net.next_port.fetch_add(1, Ordering::Relaxed));
        let client_end = Arc::new(SimEnd::new(addr.to_string()));
        let server_end = Arc::new(SimEnd::new(client_name.to_string()));
        let server_side = SimConn { me: server_end.clone(), peer: client_end.clone(), provider: self.clone() };
        let client_side = SimConn { me: client_end, peer: server_end, provider: self.clone() };
        q.pending.lock().push_back(server_side);
        if let Some((n, key)) = q.notify.lock().as_ref() {
            n.notify(*key);
        }
        Ok(client_side)
    }
}

impl Provider for SimProvider {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(NoRegistration)
    }

    fn engine(&self, ctx: EngineCtx<'_>) -> Result<Box<dyn ProviderEngine>, FabricError> {
        Ok(Box::new(SimEngine { provider: self.clone(), notify: ctx.notify, exposed: Arc::new(AtomicU64::new(0)) }))
    }

    /// One-sided as the network was made; whole messages of any length.
    fn capabilities(&self) -> ProviderCapabilities {
        ProviderCapabilities { one_sided: self.one_sided, ..ProviderCapabilities::default() }
    }

    fn counters(&self, _driver: &ProviderCounters) -> Vec<(&'static str, u64)> {
        let (reads, bytes) = self.read_counters();
        vec![("sim_reads", reads), ("sim_read_bytes", bytes)]
    }
}

/// A sim network as one driver loop sees it: connections and listeners wake the loop through
/// its notifier (they are not sockets in its poll).
struct SimEngine {
    provider: SimProvider,
    notify: Arc<dyn Notify>,
    /// Bytes exposed to peers by this loop's links (the registered-bytes gauge).
    exposed: Arc<AtomicU64>,
}

impl SimEngine {
    fn link(&self, conn: SimConn) -> Box<dyn Link> {
        Box::new(SimLink::new(conn, self.notify.clone(), self.exposed.clone()))
    }
}

impl ProviderEngine for SimEngine {
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError> {
        let c = self.provider.connect(addr)?;
        Ok(self.link(c))
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        _registry: &Registry,
        _token: Token,
        notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError> {
        let (addr, queue) = self.provider.listen(addr)?;
        queue.set_notify(self.notify.clone(), notify_key);
        let l = SimListener {
            provider: self.provider.clone(),
            notify: self.notify.clone(),
            exposed: self.exposed.clone(),
            addr,
            queue,
        };
        Ok((addr, Box::new(l)))
    }

    fn registered_bytes(&self) -> u64 {
        self.exposed.load(Ordering::Relaxed)
    }
}

/// A sim listener of one driver loop.
struct SimListener {
    provider: SimProvider,
    notify: Arc<dyn Notify>,
    exposed: Arc<AtomicU64>,
    addr: SocketAddr,
    queue: Arc<SimAcceptQueue>,
}

impl Listener for SimListener {
    fn accept(&mut self) -> Option<(String, Box<dyn Link>)> {
        let conn = self.queue.accept()?;
        let peer = conn.peer_name().to_string();
        Some((peer, Box::new(SimLink::new(conn, self.notify.clone(), self.exposed.clone()))))
    }

    fn close(&mut self, _registry: &Registry) {
        self.provider.unlisten(self.addr);
    }
}

/// A sim connection in a driver loop, and its completed one-sided reads (sim reads finish at
/// once; they are handed back through [`Link::next`] like verbs completions).
struct SimLink {
    conn: SimConn,
    notify: Arc<dyn Notify>,
    reads_done: VecDeque<(u64, Lease, Result<(), FabricError>)>,
    /// Exposures by region key, for revocation and the registered-bytes gauge.
    exposed: HashMap<u32, u64>,
    /// The loop's gauge of exposed bytes (its engine's).
    gauge: Arc<AtomicU64>,
}

impl SimLink {
    fn new(conn: SimConn, notify: Arc<dyn Notify>, gauge: Arc<AtomicU64>) -> Self {
        SimLink { conn, notify, reads_done: VecDeque::new(), exposed: HashMap::new(), gauge }
    }
}

impl Link for SimLink {
    /// Whole messages of any length; one-sided as the network was made.
    fn capabilities(&self) -> Capabilities {
        Capabilities { one_sided: self.conn.one_sided(), max_eager: u32::MAX, folds: Folds::NONE }
    }

    fn register(&mut self, _registry: &Registry, _token: Token, key: u64) -> std::io::Result<bool> {
        self.conn.set_notify(self.notify.clone(), key);
        Ok(false)
    }

    fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        self.conn.send(encode_message(head, payload)?)
    }

    fn next(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        if let Some((tag, lease, result)) = self.reads_done.pop_front() {
            return Ok(Some(Incoming::ReadDone { tag, lease, result }));
        }
        match self.conn.recv()? {
            None => Ok(None),
            Some(buf) => {
                let peer = self.conn.peer_name();
                let at = message_head(codec, &buf).map_err(|e| FabricError::Frame { peer: peer.into(), source: e })?;
                Ok(Some(Incoming::Message(MsgPayload::new(buf, at))))
            }
        }
    }

    fn sends_done(&self) -> bool {
        true
    }

    fn shutdown(&mut self) {
        let bytes: u64 = self.exposed.drain().map(|(_, len)| len).sum();
        self.gauge.fetch_sub(bytes, Ordering::Relaxed);
        self.conn.shutdown();
    }

    fn one_sided(&mut self) -> Option<&mut dyn OneSided> {
        if self.conn.one_sided() {
            Some(self)
        } else {
            None
        }
    }
}

impl OneSided for SimLink {
    fn expose(&mut self, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError> {
        let (addr, rkey) = self.conn.expose(source, offset, len);
        self.exposed.insert(rkey, len);
        self.gauge.fetch_add(len, Ordering::Relaxed);
        Ok((addr, rkey))
    }

    fn revoke(&mut self, rkey: u32) {
        if let Some(len) = self.exposed.remove(&rkey) {
            self.conn.revoke(rkey);
            self.gauge.fetch_sub(len, Ordering::Relaxed);
        }
    }

    fn start_read(&mut self, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        let mut lease = lease;
        let r = self.conn.read(desc, &mut lease);
        self.reads_done.push_back((tag, lease, r));
        Ok(())
    }
}

/// Connections waiting for a sim listener's driver to accept them.
pub(crate) struct SimAcceptQueue {
    pending: Mutex<VecDeque<SimConn>>,
    notify: Mutex<Option<(Arc<dyn Notify>, u64)>>,
}

impl SimAcceptQueue {
    /// Who to wake when a connection arrives.
    pub(crate) fn set_notify(&self, n: Arc<dyn Notify>, key: u64) {
        *self.notify.lock() = Some((n, key));
    }

    /// The next waiting connection.
    pub(crate) fn accept(&self) -> Option<SimConn> {
        self.pending.lock().pop_front()
    }
}

/// A region exposed to the peer for one-sided reads.
struct Exposure {
    source: Arc<dyn Source>,
    /// Offset of the region in the source.
    offset: u64,
    len: u64,
    /// The "virtual address" of the region's first byte, as the descriptor names it.
    addr: u64,
}

/// One end of a sim connection.
struct SimEnd {
    /// The peer's name, seen from this end.
    name: String,
    inbox: Mutex<VecDeque<Vec<u8>>>,
    open: AtomicBool,
    notify: Mutex<Option<(Arc<dyn Notify>, u64)>>,
    /// Regions this end exposes to its peer, by key.
    exposures: Mutex<HashMap<u32, Exposure>>,
}

impl SimEnd {
    fn new(name: String) -> Self {
        SimEnd {
            name,
            inbox: Mutex::new(VecDeque::new()),
            open: AtomicBool::new(true),
            notify: Mutex::new(None),
            exposures: Mutex::new(HashMap::new()),
        }
    }

    fn wake(&self) {
        if let Some((n, key)) = self.notify.lock().as_ref() {
            n.notify(*key);
        }
    }
}

/// A sim connection, owned by a driver loop.
pub(crate) struct SimConn {
    me: Arc<SimEnd>,
    peer: Arc<SimEnd>,
    provider: SimProvider,
}

impl SimConn {
    /// The peer's name.
    pub(crate) fn peer_name(&self) -> &str {
        &self.me.name
    }

    /// Who to wake when a message arrives (the owning loop, with its key for this conn).
    pub(crate) fn set_notify(&self, n: Arc<dyn Notify>, key: u64) {
        *self.me.notify.lock() = Some((n, key));
        // Messages may have arrived before the loop took the connection.
        if !self.me.inbox.lock().is_empty() || !self.peer.open.load(Ordering::Acquire) {
            self.me.wake();
        }
    }

    /// Whether rendezvous blocks are read one-sidedly on this network.
    pub(crate) fn one_sided(&self) -> bool {
        self.provider.one_sided
    }

    /// Sends one whole message.
    pub(crate) fn send(&self, msg: Vec<u8>) -> Result<(), FabricError> {
        if !self.me.open.load(Ordering::Acquire) || !self.peer.open.load(Ordering::Acquire) {
            return Err(FabricError::Closed { peer: self.me.name.clone() });
        }
        self.peer.inbox.lock().push_back(msg);
        self.peer.wake();
        Ok(())
    }

    /// The next message; `Ok(None)` when none is waiting, `Err(Closed)` once the peer closed
    /// and every message it sent before was read.
    pub(crate) fn recv(&self) -> Result<Option<Vec<u8>>, FabricError> {
        if let Some(m) = self.me.inbox.lock().pop_front() {
            return Ok(Some(m));
        }
        if !self.peer.open.load(Ordering::Acquire) || !self.me.open.load(Ordering::Acquire) {
            return Err(FabricError::Closed { peer: self.me.name.clone() });
        }
        Ok(None)
    }

    /// Exposes `len` bytes of `source` at `offset` to the peer; answers `(addr, rkey)`.
    pub(crate) fn expose(&self, source: Arc<dyn Source>, offset: u64, len: u64) -> (u64, u32) {
        // Addresses only name the window: a memory source's own address, else a synthetic base
        // per exposure (nothing reads through them; reads go through `Source::read_at`).
        let base = match source.memory() {
            Some(b) => b.as_ptr() as u64,
            None => {
                static NEXT_BASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT_BASE.fetch_add(1, Ordering::Relaxed) << 40
            }
        };
        let addr = base + offset;
        let mut ex = self.me.exposures.lock();
        // Random keys, as a NIC's are not predictable either.
        let rkey = loop {
            let k: u32 = rand::random();
            if k != 0 && !ex.contains_key(&k) {
                break k;
            }
        };
        ex.insert(rkey, Exposure { source, offset, len, addr });
        (addr, rkey)
    }

    /// Revokes the exposure with `rkey`; later reads of it fail.
    pub(crate) fn revoke(&self, rkey: u32) {
        self.me.exposures.lock().remove(&rkey);
    }

    /// Reads `desc.len` bytes of the peer's exposed region into `dst` (the one-sided read),
    /// with the checks an RDMA NIC applies to a type-2 memory window.
    pub(crate) fn read(&self, desc: &Descriptor, dst: &mut Lease) -> Result<(), FabricError> {
        let remote_err = |what: String| FabricError::RemoteAccess { peer: self.me.name.clone(), what };
        if !self.provider.one_sided {
            return Err(FabricError::Unsupported(format!("{}: one-sided reads are off on this sim network", self.me.name)));
        }
        if dst.len() < desc.len as usize {
            return Err(FabricError::Unsupported(format!(
                "{}: local buffer of {} bytes for a {}-byte read",
                self.me.name,
                dst.len(),
                desc.len
            )));
        }
        if !self.peer.open.load(Ordering::Acquire) {
            return Err(FabricError::Closed { peer: self.me.name.clone() });
        }
        let ex = self.peer.exposures.lock();
        let e = ex.get(&desc.rkey).ok_or_else(|| remote_err(format!("key {:#x} names no window of this peer", desc.rkey)))?;
        let start = desc.addr.checked_sub(e.addr).ok_or_else(|| remote_err("address below the window".into()))?;
        let end =
            start.checked_add(desc.len).filter(|end| *end <= e.len).ok_or_else(|| remote_err("range past the window".into()))?;
        if e.offset + end > e.source.len() {
            return Err(remote_err("window outside its source".into()));
        }
        // The source's own read (pread for files): a file truncated since it was exposed fails
        // this read with an error naming the file, as a NIC reading unpinned pages would fail.
        e.source
            .read_at(e.offset + start, &mut dst[..desc.len as usize])
            .map_err(|err| remote_err(format!("the exposed source cannot be read: {err}")))?;
        self.provider.net.reads.fetch_add(1, Ordering::Relaxed);
        self.provider.net.read_bytes.fetch_add(desc.len, Ordering::Relaxed);
        Ok(())
    }

    /// Closes this end: the peer reads what was sent, then sees the end. Revokes every
    /// exposure. Idempotent.
    pub(crate) fn shutdown(&self) {
        if self.me.open.swap(false, Ordering::AcqRel) {
            self.me.exposures.lock().clear();
            self.me.inbox.lock().clear();
            self.peer.wake();
        }
    }
}

impl Drop for SimConn {
    fn drop(&mut self) {
        self.shutdown();
    }
}
