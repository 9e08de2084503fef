//! One verbs connection: its control socket, and — once the handshake authenticated the peer
//! and the two sides attached — its queue pair, the messages waiting for a send buffer, the
//! regions it exposes, and the reads it posted.
//!
//! The attach is the link's own business: the loop tells it that the peer authenticated
//! ([`Link::authenticated`]); the connecting side then creates its queue pair and sends its
//! record (in the protocol's frame for it, [`Codec::attach_frame`]), the accepting side
//! answers the record with its own once its peer authenticated, and both report
//! [`Incoming::Attached`] when messages flow. A record before authentication fails the
//! connection, with nothing created for the peer.
#![forbid(unsafe_code)]

use crate::bootstrap::AttachRecord;
use crate::engine::{Event, SharedEngine, VerbsEngine};
use crate::sys::{Completed, Exposure, Qp, Wc};
use mio::{Interest, Registry, Token};
use parking_lot::MutexGuard;
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::providers::codec::{message_head, Codec};
use rdma_shuffle_fabric::providers::link::{
    encode_message, Authenticated, Capabilities, FailedRead, Folds, Incoming, Link, MsgPayload, OneSided, OutPayload, Placement,
    ReceiveCredits, UserBuf,
};
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_provider_tcp::{ControlRead, TcpConn};
use rdma_shuffle_wire::{Descriptor, Knob};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Frames go over the control socket (the handshake).
    Control,
    /// Our attach record went out; data frames wait for the peer's.
    Attaching,
    /// The queue pairs are connected: frames go as SEND/RECV messages.
    Open,
}

pub(crate) struct VerbsConn {
    control: TcpConn,
    /// This loop's engine (shared receive queue, send buffers, routing, credit budgets).
    engine: SharedEngine,
    /// Made by a listener: it answers the peer's attach record instead of sending first.
    accepted: bool,
    /// The loop said the peer authenticated: only now is anything created for it.
    authenticated: bool,
    phase: Phase,
    qp: Option<Qp>,
    psn: u32,
    /// The connection's key in the loop (completions are routed by it).
    key: u64,
    peer_max_message: usize,
    max_eager: u32,
    /// Messages waiting for the data plane or for a free send slot, in order.
    out: VecDeque<Vec<u8>>,
    sends_posted: usize,
    exposures: HashMap<u32, Arc<Exposure>>,
    reads: usize,
    ready: VecDeque<Incoming>,
    failed: Option<FabricError>,
    /// Credits granted against the engine's receive buffers (server side).
    granted: u32,
    /// Answers requested and not yet received (client side room).
    window: u32,
    qp_counted: bool,
    /// Shut down: only completions are collected now.
    closing: bool,
    /// The queue pair lets the peer read memory exposed to it: set, after the peer
    /// authenticated, where this side exposes regions (a block server, both sides of a
    /// mesh link; never a block client, which only reads).
    remote_read: bool,
}

fn dead(why: &str) -> FabricError {
    FabricError::Provider { provider: "verbs", message: why.to_string(), knob: None }
}

impl VerbsConn {
    pub(crate) fn new(control: TcpConn, engine: SharedEngine, accepted: bool) -> Self {
        let max_eager = engine.lock().max_eager();
        VerbsConn {
            control,
            engine,
            accepted,
            authenticated: false,
            phase: Phase::Control,
            qp: None,
            psn: 0,
            key: 0,
            peer_max_message: 0,
            max_eager,
            out: VecDeque::new(),
            sends_posted: 0,
            exposures: HashMap::new(),
            reads: 0,
            ready: VecDeque::new(),
            failed: None,
            granted: 0,
            window: 0,
            qp_counted: false,
            closing: false,
            remote_read: false,
        }
    }

    /// The engine, for the length of one call (never held across a call into another link).
    fn engine(&self) -> MutexGuard<'_, VerbsEngine> {
        self.engine.lock()
    }

    /// Whether the data plane is up.
    fn is_open(&self) -> bool {
        self.phase == Phase::Open
    }

    fn record(e: &VerbsEngine, qp: &Qp, psn: u32) -> AttachRecord {
        AttachRecord {
            qpn: qp.num(),
            psn,
            mtu: e.dev.active_mtu,
            gid: e.dev.gid,
            max_message: e.cfg.max_message,
            recv_credits: (e.cfg.recv_buffers / 2).max(1),
        }
    }

    fn count_qp(&mut self) {
        if !self.qp_counted {
            self.qp_counted = true;
            let e = self.engine();
            e.counters.qps_created.fetch_add(1, Ordering::Relaxed);
            e.counters.qps_open.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (connecting side, after the handshake) Creates the queue pair and sends our attach
    /// record; frames wait until the peer's answers.
    fn begin_attach(&mut self, codec: &dyn Codec) -> Result<(), FabricError> {
        if self.phase != Phase::Control {
            return Ok(());
        }
        let (qp, rec) = {
            let mut e = self.engine();
            let (qp, psn) = e.new_qp()?;
            e.route(qp.num(), self.key);
            let rec = Self::record(&e, &qp, psn);
            (qp, rec)
        };
        self.psn = rec.psn;
        self.qp = Some(qp);
        self.count_qp();
        self.control.send(codec.attach_frame(&rec.encode()), OutPayload::None)?;
        self.phase = Phase::Attaching;
        Ok(())
    }

    /// (connecting side) The peer's record arrived: connect the queue pair; the data plane
    /// is up.
    fn complete_attach(&mut self, data: &[u8]) -> Result<(), FabricError> {
        if self.phase != Phase::Attaching {
            return Err(dead("an attach record arrived that was not asked for"));
        }
        let remote = AttachRecord::decode(data).map_err(|e| dead(&format!("bad attach record: {e}")))?;
        let (dev, timers) = {
            let e = self.engine();
            (e.dev.clone(), e.timers())
        };
        let qp = self.qp.as_mut().ok_or_else(|| dead("no queue pair"))?;
        // A block client only reads: its queue pair grants the peer no remote access unless
        // this side exposes regions (a mesh link).
        qp.connect(&dev, self.psn, &remote, self.remote_read, timers)?;
        self.peer_max_message = remote.max_message as usize;
        self.phase = Phase::Open;
        self.ready.push_back(Incoming::Attached);
        self.flush()
    }

    /// (accepting side) The peer's record arrived and the peer is authenticated: create and
    /// connect our queue pair and answer with our record.
    fn accept_attach(&mut self, data: &[u8], codec: &dyn Codec) -> Result<(), FabricError> {
        if !self.authenticated {
            // Nothing is created for a peer that has not proved the secret.
            return Err(dead("an attach record before the peer authenticated"));
        }
        if self.phase != Phase::Control {
            return Err(dead("a second attach record"));
        }
        let remote = AttachRecord::decode(data).map_err(|e| dead(&format!("bad attach record: {e}")))?;
        let (mut qp, rec, dev, timers) = {
            let mut e = self.engine();
            let (qp, psn) = e.new_qp()?;
            e.route(qp.num(), self.key);
            let rec = Self::record(&e, &qp, psn);
            (qp, rec, e.dev.clone(), e.timers())
        };
        qp.connect(&dev, rec.psn, &remote, self.remote_read, timers)?;
        self.qp = Some(qp);
        self.psn = rec.psn;
        self.count_qp();
        self.peer_max_message = remote.max_message as usize;
        // The record goes over the control socket before any message: the peer connects
        // its queue pair when it reads it, and sends nothing on it before.
        self.control.send(codec.attach_frame(&rec.encode()), OutPayload::None)?;
        self.phase = Phase::Open;
        self.ready.push_back(Incoming::Attached);
        self.flush()
    }

    /// The peer's attach record, on either side.
    fn attach_record(&mut self, data: &[u8], codec: &dyn Codec) -> Result<(), FabricError> {
        if self.accepted {
            self.accept_attach(data, codec)
        } else {
            self.complete_attach(data)
        }
    }

    fn send_frame(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        if self.phase == Phase::Control {
            return self.control.send(head, payload);
        }
        // Fast path: straight into a send slot from the header and the source's bytes.
        if self.phase == Phase::Open && self.out.is_empty() && self.failed.is_none() {
            // File bytes are read with pread (never through a mapping, see `Source`).
            let read;
            let body: &[u8] = match &payload {
                OutPayload::None => &[],
                OutPayload::Bytes(b) => b,
                OutPayload::Source { source, offset, len } => {
                    if offset.checked_add(*len).is_none_or(|end| end > source.len()) {
                        return Err(dead(&format!("payload {offset}+{len} outside its {}-byte source", source.len())));
                    }
                    match source.memory() {
                        Some(b) => &b[*offset as usize..(*offset + *len) as usize],
                        None => {
                            read = rdma_shuffle_fabric::providers::read_vec(&**source, *offset, *len)
                                .map_err(|e| dead(&format!("cannot read the payload: {e}")))?;
                            &read
                        }
                    }
                }
                OutPayload::File { file, offset, len } => {
                    let mut v = vec![0u8; *len as usize];
                    std::os::unix::fs::FileExt::read_exact_at(&**file, &mut v, *offset)
                        .map_err(|e| dead(&format!("cannot read the payload: {e}")))?;
                    read = v;
                    &read
                }
            };
            if self.post_parts(&[&head, body])? {
                return Ok(());
            }
        }
        let msg = encode_message(head, payload)?;
        self.out.push_back(msg);
        self.flush()
    }

    /// Posts one message from `parts` if a send slot and queue room are free. `Ok(false)`:
    /// not now (the caller queues it).
    fn post_parts(&mut self, parts: &[&[u8]]) -> Result<bool, FabricError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.peer_max_message {
            return Err(FabricError::Provider {
                provider: "verbs",
                message: format!(
                    "a message of {total} bytes exceeds the peer's receive buffers of {} bytes (the eager threshold must be the same on every engine)",
                    self.peer_max_message
                ),
                knob: Some(Knob::EagerThreshold),
            });
        }
        let key = self.key;
        let Some(qp) = self.qp.as_mut() else { return Ok(false) };
        if !qp.has_room() {
            return Ok(false);
        }
        let mut e = self.engine.lock();
        let e = &mut *e;
        let Some((slot, len)) = e.send.fill(parts) else {
            e.wait_for_send_slot(key);
            return Ok(false);
        };
        let r = qp.poster().and_then(|mut p| p.send(&mut e.send, slot, len));
        if let Err(err) = r {
            e.send.unfill(slot);
            return Err(err);
        }
        self.sends_posted += 1;
        let c = &e.counters;
        c.sends.fetch_add(1, Ordering::Relaxed);
        c.send_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(true)
    }

    /// Posts queued messages while slots and queue room last.
    fn flush(&mut self) -> Result<(), FabricError> {
        if self.phase != Phase::Open || self.failed.is_some() {
            return Ok(());
        }
        while let Some(msg) = self.out.pop_front() {
            if !self.post_parts(&[&msg])? {
                self.out.push_front(msg);
                break;
            }
        }
        Ok(())
    }

    /// The next thing that arrived: completions routed to this connection first, then the
    /// control socket (which carries the handshake and the attach records, and must stay
    /// silent once the data plane is up).
    fn next_incoming(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        // Woken as a send-slot waiter, or slots freed by other connections: go on posting.
        if !self.out.is_empty() {
            if let Err(e) = self.flush() {
                self.fail(e);
            }
        }
        loop {
            loop {
                if let Some(i) = self.ready.pop_front() {
                    return Ok(Some(i));
                }
                let ev = if self.qp.is_some() { self.engine().take_event(self.key) } else { None };
                let Some(ev) = ev else { break };
                self.event(ev, codec)?;
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
                    self.control.poll_attached()?;
                    return Ok(None);
                }
            }
        }
    }

    fn event(&mut self, ev: Event, codec: &dyn Codec) -> Result<(), FabricError> {
        match ev {
            Event::Recv(Ok(bytes)) => match message_head(codec, &bytes) {
                Ok(at) => self.ready.push_back(Incoming::Message(MsgPayload::new(bytes, at))),
                Err(source) => return Err(FabricError::Frame { peer: self.control_peer(), source }),
            },
            Event::Recv(Err(why)) => self.fail(dead(&why)),
            Event::Sq(wc) => {
                let Some(qp) = self.qp.as_mut() else { return Ok(()) };
                match qp.complete(&wc) {
                    Some(Completed::Send) => {
                        self.sends_posted -= 1;
                        if !wc.ok() && !wc.flushed() {
                            self.fail(dead(&format!("send failed: {}", wc.status_text())));
                        } else if let Err(e) = self.flush() {
                            self.fail(e);
                        }
                    }
                    Some(Completed::Read { tag, lease }) => {
                        let result = self.read_completed(&wc, lease.len() as u64);
                        self.ready.push_back(Incoming::ReadDone { tag, lease, result });
                    }
                    Some(Completed::ReadUser { tag, len }) => {
                        let result = self.read_completed(&wc, len);
                        self.ready.push_back(Incoming::UserReadDone { tag, len, result });
                    }
                    Some(Completed::Bind) => {
                        self.engine().binds -= 1;
                        if !wc.ok() && !wc.flushed() {
                            self.fail(dead(&format!("binding a memory window failed: {}", wc.status_text())));
                        }
                    }
                    None => {}
                }
            }
        }
        Ok(())
    }

    /// A READ of `bytes` completed (or was flushed): the read caps and counters are
    /// updated, and its outcome returned. An error completion that is not a flush fails the
    /// link (it moved the queue pair to the error state).
    fn read_completed(&mut self, wc: &Wc, bytes: u64) -> Result<(), FabricError> {
        self.reads -= 1;
        {
            let mut e = self.engine();
            e.reads -= 1;
            if wc.ok() {
                e.counters.reads.fetch_add(1, Ordering::Relaxed);
                e.counters.read_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
        }
        let result = if wc.ok() {
            Ok(())
        } else if wc.remote_access() {
            Err(FabricError::RemoteAccess { peer: self.control_peer(), what: wc.status_text() })
        } else {
            Err(dead(&format!("RDMA READ failed: {}", wc.status_text())))
        };
        if !wc.ok() && !wc.flushed() {
            self.fail(dead(&format!("RDMA READ failed: {}", wc.status_text())));
        }
        result
    }

    fn fail(&mut self, e: FabricError) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
        if let Some(qp) = self.qp.as_mut() {
            qp.enter_error_state();
        }
    }

    fn control_peer(&self) -> String {
        self.control.peer().to_string()
    }

    /// Whether the last frames went out (control written, messages completed).
    fn all_sent(&self) -> bool {
        self.out.is_empty() && self.sends_posted == 0 && self.control.queued_bytes() == 0
    }
}

impl Link for VerbsConn {
    /// One-sided; eager payloads bounded by the engine's message buffers.
    fn capabilities(&self) -> Capabilities {
        Capabilities { one_sided: true, max_eager: self.max_eager, folds: Folds::NONE }
    }

    fn register(&mut self, registry: &Registry, token: Token, key: u64) -> std::io::Result<bool> {
        self.key = key;
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

    /// Messages flow only once the queue pairs attached: the connecting side starts now,
    /// the accepting side answers the peer's record when it comes.
    fn authenticated(&mut self, peer: &Authenticated<'_>) -> Result<bool, FabricError> {
        self.authenticated = true;
        self.remote_read = peer.exposes;
        if !self.accepted {
            self.begin_attach(peer.codec)?;
        }
        Ok(false)
    }

    fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        self.send_frame(head, payload)
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

    /// Whether posted work is outstanding (the connection may not go until it completed).
    fn busy(&self) -> bool {
        self.qp.as_ref().is_some_and(|q| q.outstanding() > 0)
    }

    /// Stops: the queue pair goes to the error state (posted work completes, flushed), the
    /// control socket closes, exposures are revoked.
    fn shutdown(&mut self) {
        self.closing = true;
        if let Some(qp) = self.qp.as_mut() {
            qp.enter_error_state();
        }
        self.control.shutdown();
        let keys: Vec<u32> = self.exposures.keys().copied().collect();
        for k in keys {
            OneSided::revoke(self, k);
        }
    }

    fn one_sided(&mut self) -> Option<&mut dyn OneSided> {
        Some(self)
    }

    fn receive_credits(&mut self) -> Option<&mut dyn ReceiveCredits> {
        Some(self)
    }
}

impl OneSided for VerbsConn {
    /// Exposes `len` bytes of `source` at `offset` to this connection's peer: a window bound
    /// to this queue pair only. Answers `(addr, rkey)`.
    fn expose(&mut self, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError> {
        let mut e = self.engine.lock();
        if !e.bind_room() {
            return Err(dead("too many windows being bound at once"));
        }
        let qp = self.qp.as_mut().ok_or_else(|| dead("the data plane is not up"))?;
        let exposure = Arc::new(Exposure::new(&e.dev, &*source, offset, len)?);
        let (addr, rkey) = qp.poster()?.bind(&exposure)?;
        e.binds += 1;
        e.counters.windows_bound.fetch_add(1, Ordering::Relaxed);
        e.exposed_bytes += exposure.bytes();
        self.exposures.insert(rkey, exposure);
        Ok((addr, rkey))
    }

    /// Revokes an exposure: its window is deallocated (its key dies) once no bind of it is
    /// outstanding.
    fn revoke(&mut self, rkey: u32) {
        if let Some(x) = self.exposures.remove(&rkey) {
            let mut e = self.engine();
            e.exposed_bytes -= x.bytes();
            e.counters.windows_revoked.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether another read may be posted now (queue pair and engine caps).
    fn can_read(&self) -> bool {
        let engine_room = {
            let e = self.engine();
            e.read_room() && self.reads < e.cfg.max_reads_per_qp as usize
        };
        engine_room && self.qp.as_ref().is_some_and(|q| q.has_room()) && self.phase == Phase::Open && self.failed.is_none()
    }

    fn start_read(&mut self, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        let Some(qp) = self.qp.as_mut() else {
            return Err(Box::new((lease, dead("the data plane is not up"))));
        };
        let mut poster = match qp.poster() {
            Ok(p) => p,
            Err(e) => return Err(Box::new((lease, e))),
        };
        poster.read(tag, desc, lease)?;
        self.reads += 1;
        self.engine().reads += 1;
        Ok(())
    }

    fn start_read_user(&mut self, tag: u64, desc: &Descriptor, dst: UserBuf, lkey: u32) -> Result<(), FabricError> {
        let Some(qp) = self.qp.as_mut() else {
            return Err(dead("the data plane is not up"));
        };
        qp.poster()?.read_user(tag, desc, dst, lkey)?;
        self.reads += 1;
        self.engine().reads += 1;
        Ok(())
    }
}

/// Answers land in the shared receive queue: requests go out only as far as it has room for
/// their answers; a server grants credits out of its half.
impl ReceiveCredits for VerbsConn {
    fn answer_room(&mut self) -> Option<u32> {
        if !self.is_open() {
            return None;
        }
        Some(self.engine().client_room())
    }

    fn answers_requested(&mut self, sent: u32, starved: bool) {
        let key = self.key;
        let mut e = self.engine();
        e.take_client_room(sent);
        if starved {
            e.starve(key);
        }
        drop(e);
        self.window += sent;
    }

    fn answer_arrived(&mut self) -> Vec<u64> {
        if self.window == 0 {
            return Vec::new();
        }
        self.window -= 1;
        self.engine().return_client_room(1)
    }

    fn grant_credits(&mut self, max: u32) -> u32 {
        self.engine().grant(max)
    }

    fn credits_granted(&mut self, n: u32) {
        self.granted = n;
    }
}

/// The connection is removed: credits and room go back, the queue pair is destroyed (after
/// its posted work completed, or past the close limit, leaking its buffers).
impl Drop for VerbsConn {
    fn drop(&mut self) {
        let key = self.key;
        let mut e = self.engine.lock();
        e.return_grant(std::mem::take(&mut self.granted));
        let _ = e.return_client_room(std::mem::take(&mut self.window));
        if let Some(qp) = &self.qp {
            e.unroute(qp.num(), key);
        }
        e.reads -= self.reads;
        self.reads = 0;
        if self.qp.take().is_some() && self.qp_counted {
            e.counters.qps_open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
