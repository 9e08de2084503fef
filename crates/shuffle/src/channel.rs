//! Raw channels (feature `testing`): `wire` frames over any provider of the fabric, without
//! a session on top.
//!
//! A [`Channel`] connects (or is accepted), sends frames with payloads, receives whole frames,
//! bootstraps the provider's data plane ([`Channel::attach`]; verbs builds its queue pair
//! then) and performs one-sided reads of regions its peer exposed. It is what the provider
//! conformance and security suites use to play a misbehaving peer of the block protocol.
//! Authentication is the caller's: run a `wire` session's handshake over the channel first,
//! then attach. It is a protocol on the fabric like the block endpoints, through the same
//! public seams (a handler, an acceptor, jobs, loop state).

use crate::blocks::codec::{decode_or_fail, WireCodec};
use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};
use rdma_shuffle_fabric::driver::{Acceptor, Conn, ConnKey, Driver, Handler, Incoming, Loop, Placement, Role, Transport};
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::providers::link::OutPayload;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::{Descriptor, Frame, Limits};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One received frame with its payload bytes.
#[derive(Debug, Clone)]
pub struct Received {
    /// The frame.
    pub frame: Frame,
    /// The payload that followed it (empty for frames without one).
    pub payload: Vec<u8>,
}

#[derive(Default)]
struct Inbox {
    msgs: VecDeque<Received>,
    error: Option<String>,
}

/// What a channel handle shares with its connection in the loop.
struct ChannelShared {
    inbox: Mutex<Inbox>,
    cv: Condvar,
}

impl ChannelShared {
    fn new() -> Arc<Self> {
        Arc::new(ChannelShared { inbox: Mutex::new(Inbox::default()), cv: Condvar::new() })
    }

    fn push(&self, r: Received) {
        self.inbox.lock().msgs.push_back(r);
        self.cv.notify_all();
    }

    fn fail(&self, why: String) {
        let mut i = self.inbox.lock();
        if i.error.is_none() {
            i.error = Some(why);
        }
        self.cv.notify_all();
    }
}

/// A raw connection to a peer.
pub struct Channel {
    driver: Driver,
    key: ConnKey,
    peer: String,
    shared: Arc<ChannelShared>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Channel({})", self.peer)
    }
}

impl Channel {
    /// Connects to `addr` through `driver`'s provider; returns once connected, or the error.
    pub fn connect(driver: &Driver, addr: SocketAddr, timeout: Duration) -> Result<Channel, FabricError> {
        let shared = ChannelShared::new();
        let (tx, rx) = crossbeam_channel::bounded(1);
        run(driver, ChannelCmd::Connect { addr, shared: shared.clone(), limits: Limits::default(), reply: tx })?;
        match rx.recv_timeout(timeout) {
            Ok(Ok(key)) => Ok(Channel { driver: driver.clone(), key, peer: addr.to_string(), shared }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(FabricError::ConnectTimeout { peer: addr.to_string(), timeout_ms: timeout.as_millis() as u64 }),
        }
    }

    /// The peer's address or name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    fn cmd(&self, c: ChannelCmd) -> Result<(), FabricError> {
        run(&self.driver, c)
    }

    /// Sends `frame` followed by `payload` (which must be `frame.payload_len()` bytes).
    pub fn send(&self, frame: &Frame, payload: &[u8]) -> Result<(), FabricError> {
        self.cmd(ChannelCmd::Send { key: self.key, frame: frame.clone(), payload: payload.to_vec() })
    }

    /// Sends raw bytes as one write or message, bypassing the codec (tests of a peer's
    /// decoder).
    pub fn send_raw(&self, bytes: &[u8]) -> Result<(), FabricError> {
        self.cmd(ChannelCmd::Raw { key: self.key, bytes: bytes.to_vec() })
    }

    /// The next frame, waiting at most `timeout`. After the connection ended, the frames it
    /// delivered first, then its error.
    pub fn recv(&self, timeout: Duration) -> Result<Received, FabricError> {
        let deadline = Instant::now() + timeout;
        let mut i = self.shared.inbox.lock();
        loop {
            if let Some(r) = i.msgs.pop_front() {
                return Ok(r);
            }
            if let Some(e) = &i.error {
                return Err(FabricError::Unsupported(format!("channel to {}: {e}", self.peer)));
            }
            if self.shared.cv.wait_until(&mut i, deadline).timed_out() {
                return Err(FabricError::Unsupported(format!("channel to {}: nothing arrived within {timeout:?}", self.peer)));
            }
        }
    }

    /// Bootstraps the provider's data plane with the peer (verbs: exchanges queue pair
    /// addresses over the control socket and connects the queue pairs; the connecting side
    /// sends first, the accepting side answers). A no-op on tcp and sim. Call it after the
    /// handshake: a verbs server creates nothing for a peer that has not authenticated.
    pub fn attach(&self, timeout: Duration) -> Result<(), FabricError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.cmd(ChannelCmd::Attach { key: self.key, reply: tx })?;
        rx.recv_timeout(timeout).map_err(|_| FabricError::Unsupported(format!("attach to {} timed out", self.peer)))?
    }

    /// Reads `desc.len` bytes of a region the peer exposed into `dst` (one-sided), waiting
    /// at most `timeout`. The buffer comes back with the bytes; on an error it goes back to
    /// its pool once the device has let go of it.
    pub fn read(&self, desc: &Descriptor, dst: Lease, timeout: Duration) -> Result<Lease, FabricError> {
        self.read_async(desc, dst)?.wait(timeout)
    }

    /// Starts a one-sided read and returns at once; many may be in flight.
    pub fn read_async(&self, desc: &Descriptor, dst: Lease) -> Result<PendingRead, FabricError> {
        Ok(self.read_batch(vec![(*desc, dst)])?.pop().expect("one read"))
    }

    /// Starts one-sided reads back to back (posted in order in one turn of the loop, nothing
    /// handled between them) and returns at once.
    pub fn read_batch(&self, reads: Vec<(Descriptor, Lease)>) -> Result<Vec<PendingRead>, FabricError> {
        let mut pending = Vec::with_capacity(reads.len());
        let mut batch = Vec::with_capacity(reads.len());
        for (desc, lease) in reads {
            let (tx, rx) = crossbeam_channel::bounded(1);
            batch.push((desc, lease, tx));
            pending.push(PendingRead { rx, peer: self.peer.clone() });
        }
        self.cmd(ChannelCmd::Read { key: self.key, reads: batch })?;
        Ok(pending)
    }

    /// Closes the connection. Idempotent.
    pub fn shutdown(&self) {
        let _ = self.cmd(ChannelCmd::Close { key: self.key });
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A one-sided read in flight (see [`Channel::read_async`]).
pub struct PendingRead {
    rx: crossbeam_channel::Receiver<(Lease, Result<(), FabricError>)>,
    peer: String,
}

impl PendingRead {
    /// Waits at most `timeout` for the read: the buffer with the bytes, or why it failed (its
    /// buffer then goes back to its pool — after the device let go of it).
    pub fn wait(self, timeout: Duration) -> Result<Lease, FabricError> {
        match self.rx.recv_timeout(timeout) {
            Ok((lease, Ok(()))) => Ok(lease),
            Ok((_, Err(e))) => Err(e),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                Err(FabricError::Unsupported(format!("read from {} did not complete within {timeout:?}", self.peer)))
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(FabricError::Closed { peer: self.peer.clone() }),
        }
    }
}

struct AcceptQueue {
    queue: Mutex<VecDeque<(ConnKey, String, Arc<ChannelShared>)>>,
    cv: Condvar,
}

/// Accepts raw channels.
pub struct ChannelListener {
    driver: Driver,
    id: u64,
    addr: SocketAddr,
    accepted: Arc<AcceptQueue>,
}

impl ChannelListener {
    /// Listens on `addr` (port 0 picks one).
    pub fn bind(driver: &Driver, addr: SocketAddr) -> Result<ChannelListener, FabricError> {
        let id = driver.next_id();
        let accepted = Arc::new(AcceptQueue { queue: Mutex::new(VecDeque::new()), cv: Condvar::new() });
        let (tx, rx) = crossbeam_channel::bounded(1);
        run(driver, ChannelCmd::Listen { id, addr, accepted: accepted.clone(), reply: tx })?;
        let addr = rx.recv().map_err(|_| FabricError::Shutdown)??;
        Ok(ChannelListener { driver: driver.clone(), id, addr, accepted })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next channel, waiting at most `timeout`.
    pub fn accept(&self, timeout: Duration) -> Result<Channel, FabricError> {
        let deadline = Instant::now() + timeout;
        let mut q = self.accepted.queue.lock();
        loop {
            if let Some((key, peer, shared)) = q.pop_front() {
                return Ok(Channel { driver: self.driver.clone(), key, peer, shared });
            }
            if self.accepted.cv.wait_until(&mut q, deadline).timed_out() {
                return Err(FabricError::Unsupported(format!("no connection to {} within {timeout:?}", self.addr)));
            }
        }
    }

    /// Stops listening (returns once the socket is closed). Idempotent.
    pub fn shutdown(&self) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if run(&self.driver, ChannelCmd::Unlisten { id: self.id, done: tx }).is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(10));
        }
    }
}

impl Drop for ChannelListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

type ReadReply = Sender<(Lease, Result<(), FabricError>)>;

enum ChannelCmd {
    Connect { addr: SocketAddr, shared: Arc<ChannelShared>, limits: Limits, reply: Sender<Result<ConnKey, FabricError>> },
    Listen { id: u64, addr: SocketAddr, accepted: Arc<AcceptQueue>, reply: Sender<Result<SocketAddr, FabricError>> },
    Unlisten { id: u64, done: Sender<()> },
    Send { key: ConnKey, frame: Frame, payload: Vec<u8> },
    Raw { key: ConnKey, bytes: Vec<u8> },
    Attach { key: ConnKey, reply: Sender<Result<(), FabricError>> },
    Read { key: ConnKey, reads: Vec<(Descriptor, Lease, ReadReply)> },
    Close { key: ConnKey },
}

/// The channel listeners of a loop, by id.
type ChanListeners = HashMap<u64, ChanListenerEp>;

/// A channel listener inside the loop.
struct ChanListenerEp {
    accepted: Arc<AcceptQueue>,
}

/// A channel inside the loop.
struct ChannelConn {
    shared: Arc<ChannelShared>,
    limits: Limits,
    /// (stream) the frame whose payload is being read.
    pending: Option<Frame>,
    reads: HashMap<u64, ReadReply>,
    next_tag: u64,
    connect_reply: Option<Sender<Result<ConnKey, FabricError>>>,
    attach_reply: Option<Sender<Result<(), FabricError>>>,
    /// Accepted (the peer connected), as opposed to connected by us.
    #[allow(dead_code)]
    accepted: bool,
}

fn chan_mut(conn: &mut Conn) -> &mut ChannelConn {
    conn.role.get_mut::<ChannelConn>().unwrap_or_else(|| unreachable_role())
}

#[cold]
fn unreachable_role() -> ! {
    // Only called from the channel's handler, which the loop calls for channel roles only.
    panic!("channel handler called on a connection of another role")
}

/// The raw channel's [`Handler`]: frames in and out, no session.
struct ChannelHandler;

impl Handler for ChannelHandler {
    fn connected(&self, _lp: &mut Loop, conn: &mut Conn) {
        channel_connected(conn)
    }

    fn incoming(&self, lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
        channel_incoming(lp, conn, inc)
    }

    fn failed(&self, _lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool {
        channel_failed(conn, error.to_string());
        false
    }

    fn removed(&self, _lp: &mut Loop, conn: &mut Conn) {
        let why = format!("connection to {} closed", conn.peer);
        channel_failed(conn, why)
    }
}

/// Queues `c` for `driver`'s loop.
fn run(driver: &Driver, c: ChannelCmd) -> Result<(), FabricError> {
    driver.submit(move |lp| channel_command(lp, c))
}

/// Hands a channel listener's accepted connections to it.
struct ChannelAcceptor;

impl Acceptor for ChannelAcceptor {
    fn accepted(&self, lp: &mut Loop, id: u64, peer: String, transport: Transport) {
        channel_accepted(lp, id, peer, transport)
    }
}

fn channel_role(shared: Arc<ChannelShared>, limits: Limits, connect_reply: Option<Sender<Result<ConnKey, FabricError>>>) -> Role {
    let accepted = connect_reply.is_none();
    Role::new(
        &ChannelHandler,
        ChannelConn {
            shared,
            limits,
            pending: None,
            reads: HashMap::new(),
            next_tag: 1,
            connect_reply,
            attach_reply: None,
            accepted,
        },
        WireCodec::new(limits),
    )
}

fn channel_command(lp: &mut Loop, c: ChannelCmd) {
    match c {
        ChannelCmd::Connect { addr, shared, limits, reply } => {
            let transport = match lp.connect(addr) {
                Ok(t) => t,
                Err(e) => {
                    let _ = reply.send(Err(e));
                    return;
                }
            };
            let connected = transport.is_connected();
            let role = channel_role(shared, limits, Some(reply));
            let key = lp.insert(addr.to_string(), transport, role);
            if connected {
                if let Some(mut conn) = lp.take(key) {
                    channel_connected(&mut conn);
                    lp.put(conn);
                }
            }
            lp.activate(key);
        }
        ChannelCmd::Listen { id, addr, accepted, reply } => match lp.listen(id, addr, &ChannelAcceptor) {
            Ok(local) => {
                lp.state::<ChanListeners>().insert(id, ChanListenerEp { accepted });
                let _ = reply.send(Ok(local));
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        },
        ChannelCmd::Unlisten { id, done } => {
            lp.unlisten(id);
            lp.state::<ChanListeners>().remove(&id);
            let _ = done.send(());
        }
        ChannelCmd::Send { key, frame, payload } => with_channel(lp, key, |lp, conn| {
            let p = if payload.is_empty() { OutPayload::None } else { OutPayload::Bytes(payload) };
            if let Err(e) = conn.transport.send(frame.to_vec(), p) {
                lp.fail(conn, e);
            }
        }),
        ChannelCmd::Raw { key, bytes } => with_channel(lp, key, |lp, conn| {
            if let Err(e) = conn.transport.send(bytes, OutPayload::None) {
                lp.fail(conn, e);
            }
        }),
        ChannelCmd::Attach { key, reply } => {
            if lp.conn_ref(key).is_none() {
                let _ = reply.send(Err(FabricError::Closed { peer: "channel".into() }));
                return;
            }
            with_channel(lp, key, |lp, conn| channel_attach(lp, conn, reply))
        }
        ChannelCmd::Read { key, reads } => {
            if lp.conn_ref(key).is_none() {
                for (_, lease, reply) in reads {
                    let _ = reply.send((lease, Err(FabricError::Closed { peer: "channel".into() })));
                }
                return;
            }
            with_channel(lp, key, |lp, conn| {
                for (desc, lease, reply) in reads {
                    let c = chan_mut(conn);
                    let tag = c.next_tag;
                    c.next_tag += 1;
                    let started = match conn.transport.one_sided() {
                        Some(o) => o.start_read(tag, &desc, lease),
                        None => Err(Box::new((lease, FabricError::Unsupported("this provider has no one-sided read".into())))),
                    };
                    match started {
                        Ok(()) => {
                            lp.stats().note_reads(1);
                            chan_mut(conn).reads.insert(tag, reply);
                        }
                        Err(failed) => {
                            let (lease, e) = *failed;
                            let _ = reply.send((lease, Err(e)));
                        }
                    }
                }
            })
        }
        ChannelCmd::Close { key } => with_channel(lp, key, |lp, conn| {
            channel_failed(conn, "closed locally".into());
            lp.close(conn, "channel closed locally".into(), true);
        }),
    }
}

fn with_channel(lp: &mut Loop, key: ConnKey, f: impl FnOnce(&mut Loop, &mut Conn)) {
    let Some(mut conn) = lp.take(key) else { return };
    if conn.role.is::<ChannelConn>() {
        f(lp, &mut conn);
    }
    let k = conn.key;
    lp.put(conn);
    // Whatever the command started (a read, an attach) may have completed already.
    lp.drive_again(k);
}

/// The caller ran the handshake itself and vouches for the peer: the loop tells the link,
/// which attaches its data plane if it has one (the caller waits for `Attached` then). An
/// accepting channel exposes regions (it stands in for a server); a connecting one only reads.
fn channel_attach(lp: &mut Loop, conn: &mut Conn, reply: Sender<Result<(), FabricError>>) {
    let exposes = chan_mut(conn).accepted;
    match lp.authenticated(conn, exposes) {
        Ok(true) => {
            let _ = reply.send(Ok(()));
        }
        Ok(false) => chan_mut(conn).attach_reply = Some(reply),
        Err(e) => {
            let _ = reply.send(Err(FabricError::Unsupported(e.to_string())));
            lp.fail(conn, e);
        }
    }
}

fn channel_accepted(lp: &mut Loop, id: u64, peer: String, transport: Transport) {
    let Some(l) = lp.state::<ChanListeners>().get(&id) else { return };
    let accepted = l.accepted.clone();
    let shared = ChannelShared::new();
    let role = channel_role(shared.clone(), Limits::default(), None);
    let key = lp.insert(peer.clone(), transport, role);
    accepted.queue.lock().push_back((key, peer, shared));
    accepted.cv.notify_all();
    lp.activate(key);
}

fn channel_connected(conn: &mut Conn) {
    if let Some(r) = chan_mut(conn).connect_reply.take() {
        let _ = r.send(Ok(conn.key));
    }
}

/// The frame whose fixed part arrived, decoded as a `wire` frame.
fn decode(lp: &mut Loop, conn: &mut Conn, head: &[u8]) -> Option<Frame> {
    let limits = chan_mut(conn).limits;
    decode_or_fail(lp, conn, head, &limits)
}

fn channel_incoming(lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
    match inc {
        Incoming::Frame(head) => {
            let Some(frame) = decode(lp, conn, &head) else { return };
            if frame.kind().payload_offset().is_some() {
                chan_mut(conn).pending = Some(frame);
                if let Err(e) = conn.transport.place(Placement::Vec) {
                    lp.fail(conn, e);
                }
            } else {
                chan_mut(conn).shared.push(Received { frame, payload: Vec::new() });
            }
        }
        Incoming::PayloadVec(payload) => {
            let c = chan_mut(conn);
            if let Some(frame) = c.pending.take() {
                c.shared.push(Received { frame, payload });
            }
        }
        Incoming::Payload(_) => {}
        Incoming::Message(p) => {
            if let Some(frame) = decode(lp, conn, p.head()) {
                chan_mut(conn).shared.push(Received { frame, payload: p.bytes().to_vec() })
            }
        }
        Incoming::ReadDone { tag, lease, result } => {
            lp.stats().note_reads(-1);
            if let Some(reply) = chan_mut(conn).reads.remove(&tag) {
                let _ = reply.send((lease, result));
            }
        }
        // A channel starts no reads into user memory.
        Incoming::UserReadDone { .. } => {}
        Incoming::Attached => {
            if let Some(reply) = chan_mut(conn).attach_reply.take() {
                let _ = reply.send(Ok(()));
            }
        }
    }
}

fn channel_failed(conn: &mut Conn, why: String) {
    let c = chan_mut(conn);
    if let Some(r) = c.connect_reply.take() {
        let _ = r.send(Err(FabricError::Unsupported(why.clone())));
    }
    if let Some(r) = c.attach_reply.take() {
        let _ = r.send(Err(FabricError::Unsupported(why.clone())));
    }
    c.shared.fail(why);
}
