//! One verbs connection: its control socket, and — once the handshake authenticated the peer
//! and the two sides attached — its queue pair, the messages waiting for a send buffer, the
//! regions it exposes, and the reads it posted.
#![forbid(unsafe_code)]

use super::bootstrap::AttachRecord;
use super::engine::{Event, VerbsEngine};
use super::sys::{Completed, Exposure, Qp, Wc};
use mio::{Interest, Registry, Token};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::providers::codec::{message_head, Codec};
use rdma_shuffle_fabric::providers::link::OutPayload;
use rdma_shuffle_fabric::providers::link::{
    encode_message, FailedRead, Incoming, Link, MsgPayload, Net, Placement, ProviderCounters, UserBuf,
};
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_provider_tcp::{TcpConn, TcpRead};
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
    phase: Phase,
    qp: Option<Qp>,
    psn: u32,
    key: u64,
    /// The accepting side waits for the peer's attach (raw channels).
    expecting: bool,
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
    /// The connecting side's queue pair lets the peer read too (mesh links: both sides
    /// send rendezvous messages). Set only after the peer authenticated.
    remote_read: bool,
}

fn dead(why: &str) -> FabricError {
    FabricError::Provider { provider: "verbs", message: why.to_string(), knob: None }
}

impl VerbsConn {
    pub(crate) fn new(control: TcpConn, max_eager: u32) -> Self {
        VerbsConn {
            control,
            phase: Phase::Control,
            qp: None,
            psn: 0,
            key: 0,
            expecting: false,
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

    pub(crate) fn control_mut(&mut self) -> &mut mio::net::TcpStream {
        self.control.stream_mut()
    }

    pub(crate) fn control_connected(&self) -> bool {
        self.control.is_connected()
    }

    pub(crate) fn on_writable(&mut self) -> Result<bool, FabricError> {
        self.control.on_writable()
    }

    /// Frames are a byte stream until the data plane is up.
    pub(crate) fn is_stream(&self) -> bool {
        self.phase != Phase::Open
    }

    /// Whether the data plane is up.
    pub(crate) fn is_open(&self) -> bool {
        self.phase == Phase::Open
    }

    /// Server side: the credits its session granted (given back when the connection goes).
    pub(crate) fn granted(&mut self, n: u32) {
        self.granted = n;
    }

    /// Client side: `n` more answers requested.
    pub(crate) fn requested(&mut self, n: u32) {
        self.window += n;
    }

    /// Client side: one answer arrived.
    pub(crate) fn answered(&mut self) -> bool {
        if self.window > 0 {
            self.window -= 1;
            true
        } else {
            false
        }
    }

    fn engine<'a>(&self, net: &'a mut Net) -> Result<&'a mut VerbsEngine, FabricError> {
        net.engine_mut::<VerbsEngine>().ok_or_else(|| dead("no verbs engine in this driver"))
    }

    fn record(&self, net: &mut Net, qp: &Qp, psn: u32) -> Result<AttachRecord, FabricError> {
        let e = self.engine(net)?;
        Ok(AttachRecord {
            qpn: qp.num(),
            psn,
            mtu: e.dev.active_mtu,
            gid: e.dev.gid,
            max_message: e.cfg.max_message,
            recv_credits: (e.cfg.recv_buffers / 2).max(1),
        })
    }

    fn count_qp(&mut self, stats: &ProviderCounters) {
        if !self.qp_counted {
            self.qp_counted = true;
            stats.qps_created.fetch_add(1, Ordering::Relaxed);
            stats.qps_open.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (connecting side, after the handshake) Lets the authenticated peer read memory
    /// registered for it through this connection's queue pair (mesh links, where both sides
    /// expose rendezvous buffers). Block clients never do: they only read.
    pub(crate) fn grant_remote_read(&mut self) {
        self.remote_read = true;
    }

    /// (connecting side, after the handshake) Creates the queue pair and sends our attach
    /// record; frames wait until the peer's answers.
    pub(crate) fn begin_attach(&mut self, net: &mut Net, key: u64, codec: &dyn Codec) -> Result<(), FabricError> {
        if self.phase != Phase::Control {
            return Ok(());
        }
        self.key = key;
        let e = self.engine(net)?;
        let (qp, psn) = e.new_qp()?;
        e.route(qp.num(), key);
        let rec = self.record(net, &qp, psn)?;
        self.qp = Some(qp);
        self.psn = psn;
        let counters = self.engine(net)?.counters.clone();
        self.count_qp(&counters);
        self.control.send(codec.attach_frame(&rec.encode()), OutPayload::None)?;
        self.phase = Phase::Attaching;
        Ok(())
    }

    /// (connecting side) The peer's record arrived: connect the queue pair; the data plane
    /// is up.
    pub(crate) fn complete_attach(&mut self, net: &mut Net, data: &[u8]) -> Result<(), FabricError> {
        if self.phase != Phase::Attaching {
            return Err(dead("an attach record arrived that was not asked for"));
        }
        let remote = AttachRecord::decode(data).map_err(|e| dead(&format!("bad attach record: {e}")))?;
        let e = self.engine(net)?;
        let (dev, timers) = (e.dev.clone(), e.timers());
        let qp = self.qp.as_mut().ok_or_else(|| dead("no queue pair"))?;
        // A block client only reads: its queue pair grants the peer no remote access unless
        // its owner asked for it (a mesh link).
        qp.connect(&dev, self.psn, &remote, self.remote_read, timers)?;
        self.peer_max_message = remote.max_message as usize;
        self.phase = Phase::Open;
        self.ready.push_back(Incoming::Attached);
        self.flush(net)
    }

    /// (accepting side, raw channels) Waits for the peer's attach record.
    pub(crate) fn expect_attach(&mut self) -> Result<(), FabricError> {
        self.expecting = true;
        Ok(())
    }

    /// (accepting side) The peer's record arrived and the peer is authenticated: create and
    /// connect our queue pair — with remote read, since it is ours that exposes windows —
    /// and answer with our record.
    pub(crate) fn accept_attach(&mut self, net: &mut Net, key: u64, data: &[u8], codec: &dyn Codec) -> Result<(), FabricError> {
        if self.phase != Phase::Control {
            return Err(dead("a second attach record"));
        }
        let remote = AttachRecord::decode(data).map_err(|e| dead(&format!("bad attach record: {e}")))?;
        self.key = key;
        let e = self.engine(net)?;
        let (mut qp, psn) = e.new_qp()?;
        let (dev, timers) = (e.dev.clone(), e.timers());
        e.route(qp.num(), key);
        let rec = self.record(net, &qp, psn)?;
        qp.connect(&dev, psn, &remote, true, timers)?;
        self.qp = Some(qp);
        self.psn = psn;
        let counters = self.engine(net)?.counters.clone();
        self.count_qp(&counters);
        self.peer_max_message = remote.max_message as usize;
        // The record goes over the control socket before any message: the peer connects
        // its queue pair when it reads it, and sends nothing on it before.
        self.control.send(codec.attach_frame(&rec.encode()), OutPayload::None)?;
        self.phase = Phase::Open;
        if self.expecting {
            self.expecting = false;
            self.ready.push_back(Incoming::Attached);
        }
        self.flush(net)
    }

    pub(crate) fn send(&mut self, net: &mut Net, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
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
            if self.post_parts(net, &[&head, body])? {
                return Ok(());
            }
        }
        let msg = encode_message(head, payload)?;
        self.out.push_back(msg);
        self.flush(net)
    }

    pub(crate) fn send_raw(&mut self, net: &mut Net, bytes: Vec<u8>) -> Result<(), FabricError> {
        if self.phase == Phase::Control {
            return self.control.send_raw(bytes);
        }
        self.out.push_back(bytes);
        self.flush(net)
    }

    /// Posts one message from `parts` if a send slot and queue room are free. `Ok(false)`:
    /// not now (the caller queues it).
    fn post_parts(&mut self, net: &mut Net, parts: &[&[u8]]) -> Result<bool, FabricError> {
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
        let e = net.engine_mut::<VerbsEngine>().ok_or_else(|| dead("no verbs engine"))?;
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
    fn flush(&mut self, net: &mut Net) -> Result<(), FabricError> {
        if self.phase != Phase::Open || self.failed.is_some() {
            return Ok(());
        }
        while let Some(msg) = self.out.pop_front() {
            if !self.post_parts(net, &[&msg])? {
                self.out.push_front(msg);
                break;
            }
        }
        Ok(())
    }

    pub(crate) fn place(&mut self, p: Placement) -> Result<(), FabricError> {
        self.control.place(p)
    }

    /// The next thing that arrived: completions routed to this connection first, then the
    /// control socket (which must stay silent once the data plane is up).
    pub(crate) fn next(&mut self, net: &mut Net, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        // Woken as a send-slot waiter, or slots freed by other connections: go on posting.
        if !self.out.is_empty() {
            if let Err(e) = self.flush(net) {
                self.fail(e);
            }
        }
        loop {
            if let Some(i) = self.ready.pop_front() {
                return Ok(Some(i));
            }
            let ev = match net.engine_mut::<VerbsEngine>() {
                Some(e) if self.qp.is_some() => e.take_event(self.key),
                _ => None,
            };
            let Some(ev) = ev else { break };
            self.event(net, ev, codec)?;
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
            Phase::Control | Phase::Attaching => Ok(match self.control.next(codec)? {
                TcpRead::Frame(head) => Some(match codec.attach_record(&head) {
                    Some(data) => Incoming::Attach(data),
                    None => Incoming::Frame(head),
                }),
                TcpRead::Payload(l) => Some(Incoming::Payload(l)),
                TcpRead::PayloadVec(v) => Some(Incoming::PayloadVec(v)),
                TcpRead::Idle => None,
            }),
            Phase::Open => {
                // Stream bytes before the switch (an Attach sent with frames after it) would
                // be a protocol error; so is anything but the end of the stream now.
                if self.control.awaits_placement() {
                    return Err(dead("the peer sent a payload frame on the control socket"));
                }
                self.control.poll_silent()?;
                Ok(None)
            }
        }
    }

    fn event(&mut self, net: &mut Net, ev: Event, codec: &dyn Codec) -> Result<(), FabricError> {
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
                        } else if let Err(e) = self.flush(net) {
                            self.fail(e);
                        }
                    }
                    Some(Completed::Read { tag, lease }) => {
                        let result = self.read_completed(net, &wc, lease.len() as u64);
                        self.ready.push_back(Incoming::ReadDone { tag, lease, result });
                    }
                    Some(Completed::ReadUser { tag, len }) => {
                        let result = self.read_completed(net, &wc, len);
                        self.ready.push_back(Incoming::UserReadDone { tag, len, result });
                    }
                    Some(Completed::Bind) => {
                        if let Some(e) = net.engine_mut::<VerbsEngine>() {
                            e.binds -= 1;
                        }
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
    fn read_completed(&mut self, net: &mut Net, wc: &Wc, bytes: u64) -> Result<(), FabricError> {
        self.reads -= 1;
        if let Some(e) = net.engine_mut::<VerbsEngine>() {
            e.reads -= 1;
        }
        let result = if wc.ok() {
            if let Some(e) = net.engine_ref::<VerbsEngine>() {
                let c = &e.counters;
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.read_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
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

    /// Exposes `len` bytes of `source` at `offset` to this connection's peer: a window bound
    /// to this queue pair only. Answers `(addr, rkey)`.
    pub(crate) fn expose(
        &mut self,
        net: &mut Net,
        source: Arc<dyn Source>,
        offset: u64,
        len: u64,
    ) -> Result<(u64, u32), FabricError> {
        let e = net.engine_mut::<VerbsEngine>().ok_or_else(|| dead("no verbs engine"))?;
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
    pub(crate) fn revoke(&mut self, net: &mut Net, rkey: u32) {
        if let Some(x) = self.exposures.remove(&rkey) {
            if let Some(e) = net.engine_mut::<VerbsEngine>() {
                e.exposed_bytes -= x.bytes();
                e.counters.windows_revoked.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether another read may be posted now (queue pair and engine caps).
    pub(crate) fn can_read(&self, net: &Net) -> bool {
        let engine_room =
            net.engine_ref::<VerbsEngine>().is_some_and(|e| e.read_room() && self.reads < e.cfg.max_reads_per_qp as usize);
        engine_room && self.qp.as_ref().is_some_and(|q| q.has_room()) && self.phase == Phase::Open && self.failed.is_none()
    }

    pub(crate) fn start_read(&mut self, net: &mut Net, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        let Some(qp) = self.qp.as_mut() else {
            return Err(Box::new((lease, dead("the data plane is not up"))));
        };
        let mut poster = match qp.poster() {
            Ok(p) => p,
            Err(e) => return Err(Box::new((lease, e))),
        };
        poster.read(tag, desc, lease)?;
        self.reads += 1;
        if let Some(e) = net.engine_mut::<VerbsEngine>() {
            e.reads += 1;
        }
        Ok(())
    }

    pub(crate) fn start_read_user(
        &mut self,
        net: &mut Net,
        tag: u64,
        desc: &Descriptor,
        dst: UserBuf,
        lkey: u32,
    ) -> Result<(), FabricError> {
        let Some(qp) = self.qp.as_mut() else {
            return Err(dead("the data plane is not up"));
        };
        qp.poster()?.read_user(tag, desc, dst, lkey)?;
        self.reads += 1;
        if let Some(e) = net.engine_mut::<VerbsEngine>() {
            e.reads += 1;
        }
        Ok(())
    }

    /// Whether the last frames went out (control written, messages completed).
    pub(crate) fn sends_done(&self) -> bool {
        self.out.is_empty() && self.sends_posted == 0 && self.control.queued_bytes() == 0
    }

    /// Whether posted work is outstanding (the connection may not go until it completed).
    pub(crate) fn busy(&self) -> bool {
        self.qp.as_ref().is_some_and(|q| q.outstanding() > 0)
    }

    /// Stops: the queue pair goes to the error state (posted work completes, flushed), the
    /// control socket closes, exposures are revoked.
    pub(crate) fn shutdown(&mut self, net: &mut Net) {
        self.closing = true;
        if let Some(qp) = self.qp.as_mut() {
            qp.enter_error_state();
        }
        self.control.shutdown();
        let keys: Vec<u32> = self.exposures.keys().copied().collect();
        for k in keys {
            self.revoke(net, k);
        }
    }

    /// The connection is removed: credits and room go back, the queue pair is destroyed
    /// (after its posted work completed, or past the close limit, leaking its buffers).
    pub(crate) fn destroy(&mut self, net: &mut Net) {
        let key = self.key;
        let counters = net.engine_ref::<VerbsEngine>().map(|e| e.counters.clone());
        if let Some(e) = net.engine_mut::<VerbsEngine>() {
            e.return_grant(std::mem::take(&mut self.granted));
            let _ = e.return_client_room(std::mem::take(&mut self.window));
            if let Some(qp) = &self.qp {
                e.unroute(qp.num(), key);
            }
            e.reads -= self.reads;
        }
        self.reads = 0;
        if self.qp.take().is_some() && self.qp_counted {
            if let Some(c) = counters {
                c.qps_open.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Link for VerbsConn {
    fn is_stream(&self) -> bool {
        VerbsConn::is_stream(self)
    }

    fn one_sided(&self) -> bool {
        true
    }

    fn is_connected(&self) -> bool {
        self.control_connected()
    }

    fn register(&mut self, registry: &Registry, token: Token, _key: u64) -> std::io::Result<bool> {
        registry.register(self.control_mut(), token, Interest::READABLE | Interest::WRITABLE).map(|()| true)
    }

    fn deregister(&mut self, registry: &Registry) -> std::io::Result<()> {
        registry.deregister(self.control_mut())
    }

    fn on_writable(&mut self) -> Result<bool, FabricError> {
        VerbsConn::on_writable(self)
    }

    fn send(&mut self, net: &mut Net, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        VerbsConn::send(self, net, head, payload)
    }

    fn send_raw(&mut self, net: &mut Net, bytes: Vec<u8>) -> Result<(), FabricError> {
        VerbsConn::send_raw(self, net, bytes)
    }

    fn next(&mut self, net: &mut Net, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        VerbsConn::next(self, net, codec)
    }

    fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        VerbsConn::place(self, placement)
    }

    fn expose(&mut self, net: &mut Net, source: Arc<dyn Source>, offset: u64, len: u64) -> Result<(u64, u32), FabricError> {
        VerbsConn::expose(self, net, source, offset, len)
    }

    fn revoke(&mut self, net: &mut Net, rkey: u32) {
        VerbsConn::revoke(self, net, rkey)
    }

    fn can_read(&self, net: &Net) -> bool {
        VerbsConn::can_read(self, net)
    }

    fn start_read(&mut self, net: &mut Net, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        VerbsConn::start_read(self, net, tag, desc, lease)
    }

    fn start_read_user(
        &mut self,
        net: &mut Net,
        tag: u64,
        desc: &Descriptor,
        dst: UserBuf,
        lkey: u32,
    ) -> Result<(), FabricError> {
        VerbsConn::start_read_user(self, net, tag, desc, dst, lkey)
    }

    fn sends_done(&self) -> bool {
        VerbsConn::sends_done(self)
    }

    fn busy(&self) -> bool {
        VerbsConn::busy(self)
    }

    fn shutdown(&mut self, net: &mut Net) {
        VerbsConn::shutdown(self, net)
    }

    fn destroy(&mut self, net: &mut Net) {
        VerbsConn::destroy(self, net)
    }

    fn max_eager(&self) -> u32 {
        self.max_eager
    }

    fn needs_attach(&self) -> bool {
        true
    }

    fn allow_remote_read(&mut self) {
        self.grant_remote_read()
    }

    fn begin_attach(&mut self, net: &mut Net, key: u64, codec: &dyn Codec) -> Result<(), FabricError> {
        VerbsConn::begin_attach(self, net, key, codec)
    }

    fn expect_attach(&mut self) -> Result<(), FabricError> {
        VerbsConn::expect_attach(self)
    }

    fn complete_attach(&mut self, net: &mut Net, data: &[u8]) -> Result<(), FabricError> {
        VerbsConn::complete_attach(self, net, data)
    }

    fn accept_attach(&mut self, net: &mut Net, key: u64, data: &[u8], codec: &dyn Codec) -> Result<(), FabricError> {
        VerbsConn::accept_attach(self, net, key, data, codec)
    }

    /// Answers land in the shared receive queue: requests go out only as far as it has
    /// room for their answers, and a `Fetch` must fit one buffer.
    fn bounded_answers(&self) -> bool {
        true
    }

    fn answer_room(&mut self, net: &mut Net) -> Option<u32> {
        if !self.is_open() {
            return None;
        }
        net.engine_ref::<VerbsEngine>().map(|e| e.client_room())
    }

    fn answers_requested(&mut self, net: &mut Net, sent: u32, starved: bool, key: u64) {
        let Some(e) = net.engine_mut::<VerbsEngine>() else { return };
        e.take_client_room(sent);
        self.requested(sent);
        if starved {
            e.starve(key);
        }
    }

    fn answer_arrived(&mut self, net: &mut Net) -> Vec<u64> {
        if !self.answered() {
            return Vec::new();
        }
        net.engine_mut::<VerbsEngine>().map(|e| e.return_client_room(1)).unwrap_or_default()
    }

    fn grant_credits(&mut self, net: &mut Net, max: u32) -> u32 {
        net.engine_mut::<VerbsEngine>().map(|e| e.grant(max)).unwrap_or(max)
    }

    fn credits_granted(&mut self, n: u32) {
        self.granted(n)
    }
}
