//! One ofi connection: its control socket, and — once the handshake authenticated the peer
//! and the two sides attached — its route through the loop's reliable-datagram endpoint, the
//! frames waiting to go, the regions it exposed to the peer and those the peer granted it.
//!
//! The attach is the link's own business, as verbs': the loop tells it that the peer
//! authenticated ([`Link::authenticated`]); the connecting side then sends its record (its
//! connection id, receive-buffer size and endpoint address, in the protocol's frame for it,
//! [`Codec::attach_frame`]); the accepting side answers the record with its own once its peer
//! authenticated; both report [`Incoming::Attached`] when messages flow. A record before
//! authentication fails the connection, with nothing inserted, routed or exposed for the
//! peer.
//!
//! **Messages.** A frame goes as one message when it fits the peer's receive buffers, else as
//! pieces (libfabric's RDM endpoints keep a sender's messages in order, `FI_ORDER_SAS`); the
//! receiver checks the first piece's header against the protocol's limits before it keeps a
//! byte. Large blocks are read one-sidedly where the provider offers RMA; otherwise the
//! protocol pulls them, and the pull's data comes as pieces (a rendezvous of messages).
//!
//! **Exposure.** A region exposed to the peer is registered by itself with a random key (the
//! engine's [`expose`](crate::engine::OfiEngine::expose)), and the key travels to this
//! connection's peer only, in a grant message, under a per-connection handle: the protocol's
//! descriptor carries the handle, so a descriptor given to another connection names nothing
//! there, and its reads are refused before they are posted. (libfabric's keys are the
//! domain's, not a peer's: where the application chooses them (tcp, shm) they are random over
//! 64 bits; where the provider does (verbs), they are as hard to guess as its keys are.)
#![forbid(unsafe_code)]

use crate::attach::{new_conn_id, trailer, AttachRecord, Grant, Kind, TRAILER_LEN};
use crate::config::{PeerAddr, RemoteRegion};
use crate::engine::{dead, Event, OfiEngine, Posted, SharedEngine, MAX_READS_PER_LINK};
use crate::sys::Exposure;
use mio::{Interest, Registry, Token};
use parking_lot::MutexGuard;
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::providers::codec::{checked_shape, message_head, Codec};
use rdma_shuffle_fabric::providers::link::{
    encode_message, Authenticated, Capabilities, FailedRead, Folds, Incoming, Link, MsgPayload, OneSided, OutPayload, Placement,
};
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_provider_tcp::{ControlRead, TcpConn};
use rdma_shuffle_wire::Descriptor;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Frames go over the control socket (the handshake).
    Control,
    /// Our attach record went out; data frames wait for the peer's.
    Attaching,
    /// Both sides attached: frames go as messages through the endpoint.
    Open,
}

/// A frame (or a grant, a revoke) on its way out, sent in pieces as the peer's buffers and
/// the engine's send buffers allow.
struct Outgoing {
    kind: Kind,
    bytes: Vec<u8>,
    /// Bytes of it sent so far.
    at: usize,
    /// A revoke: the region whose registration closes once the peer has the message.
    revoke: Option<u32>,
}

/// A frame arriving in pieces: what came so far, and its length as its header says.
struct Partial {
    buf: Vec<u8>,
    total: usize,
}

pub(crate) struct OfiConn {
    control: TcpConn,
    /// This loop's engine (endpoint, routing, send buffers).
    engine: SharedEngine,
    /// Made by a listener: it answers the peer's attach record instead of sending first.
    accepted: bool,
    /// The loop said the peer authenticated: only now is anything made for it.
    authenticated: bool,
    /// This side exposes regions to the peer (a block server, a mesh link).
    exposes: bool,
    /// The peer's record, come before the loop said the peer authenticated.
    early: Option<Vec<u8>>,
    /// Rendezvous regions are read one-sidedly (the provider offers RMA and the settings
    /// allow it); else the protocol pulls them.
    one_sided: bool,
    phase: Phase,
    /// The connection's key in the loop (events are routed by it).
    key: u64,
    /// Our id for this connection: the peer puts it on messages to us.
    conn_id: u64,
    /// The peer's id for it.
    peer_conn: u64,
    /// The peer's endpoint in the address vector, and its address.
    peer: Option<(PeerAddr, Vec<u8>)>,
    /// Body bytes per message towards the peer.
    piece: usize,
    out: VecDeque<Outgoing>,
    sends_posted: usize,
    partial: Option<Partial>,
    /// Regions this side exposed to the peer, by handle.
    exposures: HashMap<u32, Exposure>,
    /// Regions revoked whose revoke is on its way: their registrations close once the peer
    /// has it (so a read of the peer's that overtook it finds the key, and a later one finds
    /// the grant gone on its own side).
    revoking: HashMap<u32, Exposure>,
    reads: usize,
    ready: VecDeque<Incoming>,
    failed: Option<FabricError>,
    /// Shut down: only completions are collected now.
    closing: bool,
    /// Our last message went (delivery-completed before the control socket closes).
    fin_sent: bool,
    /// The control socket was shut down.
    control_closed: bool,
    /// The control socket ended and the completion queue was read once more since, for
    /// messages of the peer still on their way in.
    drained: bool,
    /// The peer's last message (`Fin`) came: it is closing, and a last message of ours
    /// would go to an endpoint that may be gone (shm never completes such a send).
    peer_fin: bool,
}

impl OfiConn {
    pub(crate) fn new(control: TcpConn, engine: SharedEngine, accepted: bool, one_sided: bool) -> Self {
        OfiConn {
            control,
            engine,
            accepted,
            authenticated: false,
            exposes: false,
            early: None,
            one_sided,
            phase: Phase::Control,
            key: 0,
            conn_id: 0,
            peer_conn: 0,
            peer: None,
            piece: 0,
            out: VecDeque::new(),
            sends_posted: 0,
            partial: None,
            exposures: HashMap::new(),
            revoking: HashMap::new(),
            reads: 0,
            ready: VecDeque::new(),
            failed: None,
            closing: false,
            fin_sent: false,
            control_closed: false,
            drained: false,
            peer_fin: false,
        }
    }

    /// The engine, for the length of one call (never held across a call into another link).
    fn engine(&self) -> MutexGuard<'_, OfiEngine> {
        self.engine.lock()
    }

    fn peer_name(&self) -> String {
        self.control.peer().to_string()
    }

    /// Routes our new connection id to this link, and answers our record.
    fn our_record(&mut self) -> Result<AttachRecord, FabricError> {
        let conn_id = new_conn_id();
        let mut e = self.engine();
        let (_, address) = e.endpoint()?;
        let max_msg = e.max_msg() as u32;
        e.route(conn_id, self.key, None);
        drop(e);
        self.conn_id = conn_id;
        Ok(AttachRecord { conn_id, max_msg, address })
    }

    /// The peer's record: its address goes into the address vector, messages to it are cut
    /// to its buffers.
    fn take_peer(&mut self, data: &[u8]) -> Result<(), FabricError> {
        let rec = AttachRecord::decode(data).map_err(|e| dead(&format!("bad attach record from {}: {e}", self.peer_name())))?;
        let mut e = self.engine();
        let p = e.insert_peer(&rec.address)?;
        e.route(self.conn_id, self.key, Some(p));
        let own = e.max_msg();
        drop(e);
        self.peer = Some((p, rec.address));
        self.peer_conn = rec.conn_id;
        self.piece = (rec.max_msg as usize).min(own) - TRAILER_LEN;
        Ok(())
    }

    /// (connecting side, after the handshake) Sends our attach record; frames wait until the
    /// peer's answers.
    fn begin_attach(&mut self, codec: &dyn Codec) -> Result<(), FabricError> {
        if self.phase != Phase::Control {
            return Ok(());
        }
        let rec = self.our_record()?;
        self.control.send(codec.attach_frame(&rec.encode()), OutPayload::None)?;
        self.phase = Phase::Attaching;
        Ok(())
    }

    /// The peer's attach record, on either side.
    fn attach_record(&mut self, data: &[u8], codec: &dyn Codec) -> Result<(), FabricError> {
        if !self.authenticated {
            // Nothing is made for a peer that has not proved the secret. Its record may
            // overtake the loop's word that it did (a protocol that tells the loop after
            // answering the proof, as the raw test channel does): one record is held, as
            // bytes, until then; anything more fails the connection.
            if self.accepted && self.phase == Phase::Control && self.early.is_none() && data.len() <= 512 {
                self.early = Some(data.to_vec());
                return Ok(());
            }
            return Err(dead("an attach record before the peer authenticated"));
        }
        match (self.accepted, self.phase) {
            (true, Phase::Control) => {
                let rec = self.our_record()?;
                self.take_peer(data)?;
                // Our record goes over the control socket; the peer sends nothing through
                // the endpoint before it read it, and messages we send from now on wait in
                // its engine (routed to its id) until it did.
                self.control.send(codec.attach_frame(&rec.encode()), OutPayload::None)?;
            }
            (false, Phase::Attaching) => self.take_peer(data)?,
            _ => return Err(dead("an attach record that was not asked for")),
        }
        self.phase = Phase::Open;
        self.ready.push_back(Incoming::Attached);
        self.flush()
    }

    /// Sends what waits, in order, as far as the engine takes it.
    fn flush(&mut self) -> Result<(), FabricError> {
        if self.phase != Phase::Open || self.failed.is_some() {
            return Ok(());
        }
        let Some((peer, _)) = &self.peer else { return Ok(()) };
        let peer = *peer;
        while let Some(o) = self.out.front_mut() {
            let rest = o.bytes.len() - o.at;
            let (n, kind) = match o.kind {
                Kind::Frame if o.at == 0 && rest <= self.piece => (rest, Kind::Frame),
                Kind::Frame | Kind::More | Kind::Last => {
                    let n = rest.min(self.piece);
                    (n, if n == rest { Kind::Last } else { Kind::More })
                }
                k => (rest, k),
            };
            let mut msg = Vec::with_capacity(n + TRAILER_LEN);
            msg.extend_from_slice(&o.bytes[o.at..o.at + n]);
            msg.extend_from_slice(&trailer(kind, self.peer_conn));
            let (delivered, revoke) = (o.revoke.is_some(), o.revoke);
            let posted = self.engine.lock().post(peer, self.key, msg, delivered, revoke)?;
            match posted {
                Posted::NoSlot => break,
                Posted::Yes { completes } => {
                    if completes {
                        self.sends_posted += 1;
                    }
                    o.at += n;
                    if o.at == o.bytes.len() {
                        self.out.pop_front();
                    }
                }
            }
        }
        Ok(())
    }

    fn queue(&mut self, kind: Kind, bytes: Vec<u8>) -> Result<(), FabricError> {
        self.out.push_back(Outgoing { kind, bytes, at: 0, revoke: None });
        self.flush()
    }

    /// The next thing that arrived: events routed to this connection first, then the control
    /// socket (which carries the handshake and the attach records, and must stay silent once
    /// messages flow).
    fn next_incoming(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        // Woken as a send-buffer waiter, or sends completed: go on sending.
        if !self.out.is_empty() {
            if let Err(e) = self.flush() {
                self.fail(e);
            }
        }
        loop {
            if let Some(i) = self.ready.pop_front() {
                return Ok(Some(i));
            }
            if self.phase == Phase::Open || self.closing {
                let ev = self.engine().take_event(self.key);
                if let Some(ev) = ev {
                    self.event(ev, codec)?;
                    continue;
                }
            }
            if self.closing {
                // Collecting completions only; the failure was reported already.
                self.failed = None;
                return Ok(None);
            }
            if let Some(e) = self.failed.take() {
                return Err(e);
            }
            match self.phase {
                Phase::Control | Phase::Attaching => match self.control.next_control(codec)? {
                    // The peer's record, the link's own: what it produced (`Attached`) is
                    // returned on the next round.
                    ControlRead::Attach(record) => self.attach_record(&record, codec)?,
                    ControlRead::Up(incoming) => return Ok(Some(incoming)),
                    ControlRead::Idle => return Ok(None),
                },
                Phase::Open => {
                    // The socket is the liveness channel now: anything but its end is a
                    // protocol error.
                    match self.control.poll_attached() {
                        Ok(()) => return Ok(None),
                        // The end may overtake the peer's last messages, which come another
                        // way: read the completion queue once more before reporting it (the
                        // peer's last message was delivered before its socket closed).
                        Err(e @ FabricError::Closed { .. }) if !self.drained => {
                            self.drained = true;
                            self.engine().drain();
                            if self.engine().has_event(self.key) {
                                self.failed = Some(e);
                            } else {
                                return Err(e);
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }

    fn event(&mut self, ev: Event, codec: &dyn Codec) -> Result<(), FabricError> {
        match ev {
            Event::Message(kind, body) => {
                if !self.closing {
                    self.message(kind, body, codec)?;
                }
            }
            Event::Sent { revoked } => {
                self.sends_posted = self.sends_posted.saturating_sub(1);
                self.revoked(revoked);
                if let Err(e) = self.flush() {
                    self.fail(e);
                }
                self.close_control_after_fin();
            }
            Event::SendFailed { error, revoked } => {
                self.sends_posted = self.sends_posted.saturating_sub(1);
                self.revoked(revoked);
                self.fail(dead(&format!("a send to {} failed: {error}", self.peer_name())));
                self.close_control_after_fin();
            }
            Event::Broken(e) => self.fail(e),
            Event::ReadDone { tag, lease, result } => {
                self.reads = self.reads.saturating_sub(1);
                let peer = self.peer_name();
                let result = result.map_err(|e| match e {
                    FabricError::RemoteAccess { what, .. } => FabricError::RemoteAccess { peer, what },
                    other => other,
                });
                self.ready.push_back(Incoming::ReadDone { tag, lease, result });
            }
        }
        Ok(())
    }

    fn message(&mut self, kind: Kind, body: Vec<u8>, codec: &dyn Codec) -> Result<(), FabricError> {
        let name = self.peer_name();
        let peer = || name.clone();
        if self.partial.is_some() && !matches!(kind, Kind::More | Kind::Last) {
            return Err(dead(&format!("{} interleaved a message with the pieces of a frame", peer())));
        }
        match kind {
            Kind::Frame => self.frame(body, codec)?,
            Kind::More | Kind::Last => {
                let p = match self.partial.take() {
                    Some(p) => p,
                    None => {
                        // The first piece: its header says how long the frame is, bounded by
                        // the protocol's limits, before anything is kept.
                        let hl = codec.header_len();
                        let header =
                            body.get(..hl).ok_or_else(|| dead(&format!("{} sent a piece shorter than a header", peer())))?;
                        let shape = checked_shape(codec, header).map_err(|source| FabricError::Frame { peer: peer(), source })?;
                        let total = shape
                            .total()
                            .and_then(|t| usize::try_from(t).ok())
                            .ok_or_else(|| dead("a frame larger than memory"))?;
                        Partial { buf: Vec::with_capacity(total.min(16 << 20)), total }
                    }
                };
                let mut p = p;
                if p.buf.len() + body.len() > p.total {
                    return Err(dead(&format!("{} sent more pieces than its frame's {} bytes", peer(), p.total)));
                }
                p.buf.extend_from_slice(&body);
                if kind == Kind::Last {
                    if p.buf.len() != p.total {
                        return Err(dead(&format!("{} ended a {}-byte frame after {} bytes", peer(), p.total, p.buf.len())));
                    }
                    self.frame(p.buf, codec)?;
                } else {
                    self.partial = Some(p);
                }
            }
            // Kept by the engine as they are routed.
            Kind::Grant | Kind::Revoke => {}
            // The peer closes; its control socket's end follows and ends the connection.
            Kind::Fin => self.peer_fin = true,
        }
        Ok(())
    }

    /// A whole frame arrived: handed up as a message.
    fn frame(&mut self, bytes: Vec<u8>, codec: &dyn Codec) -> Result<(), FabricError> {
        let at = message_head(codec, &bytes).map_err(|source| FabricError::Frame { peer: self.peer_name(), source })?;
        self.ready.push_back(Incoming::Message(MsgPayload::new(bytes, at)));
        Ok(())
    }

    /// The peer has a revoke: the region's registration closes now.
    fn revoked(&mut self, handle: Option<u32>) {
        if let Some(x) = handle.and_then(|h| self.revoking.remove(&h)) {
            self.engine().close_exposure(x);
        }
    }

    fn close_control(&mut self) {
        if !self.control_closed {
            self.control_closed = true;
            self.control.shutdown();
        }
    }

    /// Our last message completed (or every send did): the control socket may close now.
    fn close_control_after_fin(&mut self) {
        if self.fin_sent && self.sends_posted == 0 {
            self.close_control();
        }
    }

    fn fail(&mut self, e: FabricError) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
    }

    /// Whether the last frames went out (control written, messages completed).
    fn all_sent(&self) -> bool {
        self.out.is_empty() && self.sends_posted == 0 && self.control.queued_bytes() == 0
    }

    fn open_for_reads(&self) -> bool {
        self.phase == Phase::Open && self.failed.is_none() && !self.closing
    }

    /// A handle no region of this connection uses.
    fn new_handle(&self) -> u32 {
        loop {
            let h = rand::random::<u32>();
            if h != 0 && !self.exposures.contains_key(&h) {
                return h;
            }
        }
    }
}

impl Link for OfiConn {
    /// One-sided where the provider offers RMA; no eager bound (large frames go in pieces).
    fn capabilities(&self) -> Capabilities {
        Capabilities { one_sided: self.one_sided, max_eager: u32::MAX, folds: Folds::NONE }
    }

    fn register(&mut self, registry: &Registry, token: Token, key: u64) -> std::io::Result<bool> {
        self.key = key;
        self.engine().open_inbox(key);
        registry.register(self.control.stream_mut(), token, Interest::READABLE | Interest::WRITABLE).map(|()| true)
    }

    fn deregister(&mut self, registry: &Registry) -> std::io::Result<()> {
        registry.deregister(self.control.stream_mut())
    }

    fn is_connected(&self) -> bool {
        self.control.is_connected()
    }

    fn on_writable(&mut self) -> Result<bool, FabricError> {
        self.control.on_writable()
    }

    /// Messages flow only once both sides attached: the connecting side starts now, the
    /// accepting side answers the peer's record when it comes.
    fn authenticated(&mut self, peer: &Authenticated<'_>) -> Result<bool, FabricError> {
        self.authenticated = true;
        self.exposes = peer.exposes;
        if !self.accepted {
            self.begin_attach(peer.codec)?;
        } else if let Some(rec) = self.early.take() {
            self.attach_record(&rec, peer.codec)?;
        }
        Ok(false)
    }

    fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        if self.phase == Phase::Control {
            return self.control.send(head, payload);
        }
        let frame = encode_message(head, payload)?;
        self.queue(Kind::Frame, frame)
    }

    fn next(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        self.next_incoming(codec)
    }

    fn place(&mut self, p: Placement) -> Result<(), FabricError> {
        self.control.place(p)
    }

    fn sends_done(&self) -> bool {
        self.all_sent()
    }

    /// Sends and reads posted and not completed: their buffers are libfabric's until then.
    fn busy(&self) -> bool {
        self.reads > 0 || self.sends_posted > 0
    }

    /// Stops: exposures are revoked (their registrations close), and the control socket
    /// closes — after a last message whose completion says the peer's endpoint has every
    /// message sent before it, where the data plane is up (the peer sees them before the
    /// end).
    fn shutdown(&mut self) {
        if self.closing {
            return;
        }
        self.closing = true;
        let mut e = self.engine.lock();
        for (_, x) in self.exposures.drain() {
            e.revoke(x);
        }
        for (_, x) in self.revoking.drain() {
            e.close_exposure(x);
        }
        // No last message to a peer that has closed (its Fin came, or its control socket
        // ended): nobody reads it, and over shm a send to a closed endpoint never completes,
        // which held the link for the driver's whole close limit.
        let fin = match (&self.peer, self.phase, &self.failed) {
            (Some((peer, _)), Phase::Open, None) if !self.peer_fin && !self.drained => {
                let msg = trailer(Kind::Fin, self.peer_conn).to_vec();
                matches!(e.post(*peer, self.key, msg, true, None), Ok(Posted::Yes { completes: true }))
            }
            _ => false,
        };
        drop(e);
        if fin {
            self.fin_sent = true;
            self.sends_posted += 1;
        } else {
            self.close_control();
        }
    }

    fn one_sided(&mut self) -> Option<&mut dyn OneSided> {
        if self.one_sided {
            Some(self)
        } else {
            None
        }
    }
}

impl OneSided for OfiConn {
    /// Registers the region by itself (a file's bytes by a copy) and grants it to this
    /// connection's peer alone; answers `(addr, handle)`.
    fn expose(&mut self, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError> {
        if !self.authenticated || !self.exposes {
            return Err(dead("nothing is exposed to a peer that has not authenticated, or that this side does not serve"));
        }
        if self.phase != Phase::Open || self.closing {
            return Err(dead("the connection is not attached"));
        }
        let exposure = self.engine().expose(source, offset, len)?;
        let RemoteRegion { addr, len, key } = exposure.remote();
        let handle = self.new_handle();
        self.exposures.insert(handle, exposure);
        // The grant goes before the descriptor the caller sends next (messages keep order).
        self.queue(Kind::Grant, Grant { handle, key, addr, len }.encode().to_vec())?;
        Ok((addr, handle))
    }

    /// Revokes a region: the peer is told, and its registration closes (its key dies) once
    /// the peer has the message.
    fn revoke(&mut self, handle: u32) {
        let Some(x) = self.exposures.remove(&handle) else { return };
        if self.phase != Phase::Open || self.closing || self.failed.is_some() {
            self.engine().revoke(x);
            return;
        }
        self.engine().retire(&x);
        self.revoking.insert(handle, x);
        self.out.push_back(Outgoing { kind: Kind::Revoke, bytes: handle.to_le_bytes().to_vec(), at: 0, revoke: Some(handle) });
        if let Err(e) = self.flush() {
            self.fail(e);
        }
    }

    fn can_read(&self) -> bool {
        self.open_for_reads() && self.reads < MAX_READS_PER_LINK && self.engine().read_room()
    }

    /// Reads a region the peer granted this connection. A descriptor naming no grant of this
    /// connection (another connection's, a guess, a revoked one), or a range outside it, is
    /// refused here, as the peer's protection would: it completes as a remote access error.
    fn start_read(&mut self, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        if self.closing || self.failed.is_some() {
            return Err(Box::new((lease, dead("the connection is closing"))));
        }
        // Nothing is granted before the peer authenticated and both sides attached. The
        // grant is looked up after the completion queue was read: a revoke that has reached
        // this endpoint is seen (a read with a dead key would end the provider's connection
        // between the two endpoints, tcp's, for every link over it).
        let attached = self.peer.as_ref().map(|(p, _)| *p).filter(|_| self.phase == Phase::Open);
        let grant = {
            let mut e = self.engine();
            if attached.is_some() {
                e.drain();
            }
            e.grant(self.key, desc.rkey)
        };
        let (g, peer) = match (grant, attached) {
            (Some(g), Some(peer)) if desc.len as usize <= lease.capacity() && g.covers(desc.addr, desc.len) => (g, peer),
            (other, _) => {
                let what = match other {
                    None => format!("key {:#x} names no region {} exposed to this connection", desc.rkey, self.peer_name()),
                    Some(g) => format!(
                        "{} bytes at {:#x} lie outside the {}-byte region exposed at {:#x}",
                        desc.len, desc.addr, g.len, g.addr
                    ),
                };
                let result = Err(FabricError::RemoteAccess { peer: self.peer_name(), what });
                self.ready.push_back(Incoming::ReadDone { tag, lease, result });
                return Ok(());
            }
        };
        let mut lease = lease;
        if let Err(e) = lease.set_len(desc.len as usize) {
            return Err(Box::new((lease, FabricError::Pool(e))));
        }
        let remote = RemoteRegion { addr: g.addr, len: g.len, key: g.key };
        let posted = self.engine().read(self.key, tag, peer, lease, remote, desc.addr - g.addr);
        match posted {
            Ok(()) => {
                self.reads += 1;
                Ok(())
            }
            Err(failed) => Err(failed),
        }
    }
}

/// The connection is removed: its route, its peer's address-vector reference and its
/// exposures go.
impl Drop for OfiConn {
    fn drop(&mut self) {
        let mut e = self.engine.lock();
        for (_, x) in self.exposures.drain() {
            e.revoke(x);
        }
        for (_, x) in self.revoking.drain() {
            e.close_exposure(x);
        }
        if self.conn_id != 0 {
            e.unroute(self.conn_id, self.key);
        }
        if let Some((_, address)) = &self.peer {
            e.release_peer(address);
        }
        e.close_inbox(self.key);
    }
}
