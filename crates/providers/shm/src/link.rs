//! The shm provider behind the driver's seam: [`ShmProvider`], its per-loop engine, listener
//! and [`Link`].
//!
//! Addresses stay `SocketAddr`s, as for every provider: `ip:port` names the abstract socket
//! `rdma-shuffle-shm/ip:port` (so a peer known by its tcp-shaped address is reached the same
//! way, and the namespace test hosts, each with its own network namespace, stay apart).
//! Listening on port 0 picks a free name. A connection is a message link (whole frames, like
//! sim without one-sided reads): rendezvous regions are pulled, and their large answers go by
//! single copy or through the segment (see the module docs of [`shm`](super)).
//!
//! Sends made while the shm handshake is still running are queued and go out once it is
//! done, so a link is "connected" at once for the protocol above it.

use crate::config::ShmConfig;
use crate::conn::{LargeMessages, LentBody, Received, ShmConn};
use crate::handshake::{ShmAccepting, ShmConnecting, ShmListener};
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::NoRegistration;
use rdma_shuffle_fabric::memory::registration::Registrar;
use rdma_shuffle_fabric::providers::codec::{checked_shape, message_head, Codec};
use rdma_shuffle_fabric::providers::link::{
    encode_message, Capabilities, EngineCtx, Folds, Incoming, Link, Listener, MemoryPolled, MsgPayload, OutPayload, Placement,
    ProviderEngine, SendProgress,
};
use rdma_shuffle_fabric::providers::registry::{FixedMemory, Opened, Registration};
use rdma_shuffle_fabric::providers::{Provider, ProviderCapabilities};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;

/// The shm provider: connections between processes of one host through shared memory.
#[derive(Debug, Clone, Default)]
pub struct ShmProvider {
    config: ShmConfig,
}

impl ShmProvider {
    /// A provider with these settings.
    pub fn new(config: ShmConfig) -> Self {
        ShmProvider { config }
    }

    /// The abstract socket name of the shm listener at `addr`.
    pub fn socket_name(addr: SocketAddr) -> String {
        format!("rdma-shuffle-shm/{addr}")
    }
}

/// The shm provider in the registry: `shm`, with the protocol's largest message and its
/// secret, which a peer proves before its segment is made. It holds no fixed memory: its
/// rings are per link, made for a peer that proved the secret and gone with the link.
pub fn registration() -> Registration {
    Registration {
        name: "shm",
        about: "shared memory between processes of one host: rings in a sealed memfd per link",
        open: |o| {
            let d = ShmConfig::default();
            let config = ShmConfig {
                max_message: o.max_message.map_or(d.max_message, |m| usize::try_from(m).unwrap_or(usize::MAX)),
                secret: o.secret.clone(),
                ..d
            };
            Ok(Opened::new(Arc::new(ShmProvider::new(config)), "shm"))
        },
        fixed_memory: FixedMemory::none,
    }
}

impl Provider for ShmProvider {
    fn name(&self) -> &'static str {
        "shm"
    }

    /// Two-sided (regions are pulled); the ranks' CPUs copy through the rings, whose records
    /// carry a body of up to [`ShmConfig::largest_ring_body`] in place.
    fn capabilities(&self) -> ProviderCapabilities {
        ProviderCapabilities {
            one_sided: false,
            max_eager: None,
            cpu_copies: true,
            record_body: Some(self.config.largest_ring_body()),
        }
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(NoRegistration)
    }

    fn engine(&self, _ctx: EngineCtx<'_>) -> Result<Box<dyn ProviderEngine>, FabricError> {
        Ok(Box::new(ShmEngine { config: self.config.clone() }))
    }
}

/// Nothing per loop but the settings: connections are descriptors in the loop's poll.
struct ShmEngine {
    config: ShmConfig,
}

/// Tries for a free name when listening on port 0.
const PORT_TRIES: usize = 64;

impl ProviderEngine for ShmEngine {
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError> {
        let c = ShmConnecting::start(&ShmProvider::socket_name(addr), &self.config)?;
        Ok(Box::new(ShmLink::new(format!("shm:{addr}"), State::Connecting(c))))
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
        _notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError> {
        let mut tries = 0;
        let (local, l) = loop {
            let mut a = addr;
            if addr.port() == 0 {
                a.set_port(rand::random::<u16>().max(1024));
            }
            match ShmListener::bind(&ShmProvider::socket_name(a)) {
                Ok(l) => break (a, l),
                Err(FabricError::Io { source, .. })
                    if addr.port() == 0 && source.kind() == std::io::ErrorKind::AddrInUse && tries < PORT_TRIES =>
                {
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        };
        registry
            .register(&mut SourceFd(&l.fd()), token, Interest::READABLE)
            .map_err(|e| FabricError::io(&local.to_string(), "listen on", e))?;
        Ok((local, Box::new(ShmLinkListener { listener: l, config: self.config.clone() })))
    }
}

struct ShmLinkListener {
    listener: ShmListener,
    config: ShmConfig,
}

impl Listener for ShmLinkListener {
    fn accept(&mut self) -> Option<(String, Box<dyn Link>)> {
        loop {
            match self.listener.accept(&self.config) {
                Ok(Some(a)) => {
                    let peer = a.peer().to_string();
                    return Some((peer.clone(), Box::new(ShmLink::new(peer, State::Accepting(a)))));
                }
                Ok(None) => return None,
                Err(e) => {
                    // A process of another user (refused and told why), or a peer that
                    // vanished at once: nothing to hand to the driver; look for the next one.
                    tracing::warn!(listener = %self.listener.name(), error = %e, "shm connection refused");
                }
            }
        }
    }

    fn close(&mut self, registry: &Registry) {
        let _ = registry.deregister(&mut SourceFd(&self.listener.fd()));
    }
}

enum State {
    Accepting(ShmAccepting),
    Connecting(ShmConnecting),
    Up(Box<ShmConn>),
    Closed,
}

struct ShmLink {
    peer: String,
    state: State,
    /// Messages sent before the handshake finished.
    pending: VecDeque<Vec<u8>>,
    /// The loop's poll and this link's token, to move the registration from the handshake's
    /// socket to the connection's descriptors when it comes up.
    reg: Option<(Registry, Token)>,
    /// Descriptors registered now.
    registered: Vec<RawFd>,
    /// A frame was handed over whose body still waits in the peer's memory, for
    /// [`place`](Link::place).
    body: Option<LentBody>,
    /// The placed body, handed over by the next [`next`](Link::next).
    placed: Option<Incoming>,
    /// Bytes of every message ever sent (the first half of [`Link::write_progress`]).
    queued: u64,
    /// Messages whose body the peer reads from the caller's memory, oldest first: the
    /// position where each starts in `queued`, and its id on the connection. Everything
    /// before the first one still lent is "written" (copied, or read by the peer).
    borrowed: VecDeque<(u64, u64)>,
    /// Where a folded body's pieces are copied before they are reduced (see
    /// [`ShmConn::fold_body`]); allocated on the first fold.
    scratch: Vec<u8>,
}

/// The smallest body an shm link reduces on its way in; smaller ones are staged in a pool
/// buffer and reduced by the caller. Measured (2-rank allreduce, `bench-collective.sh`,
/// alternated with staging): folding 4 MiB segments made 64 MiB 1.2-1.3x faster (2 and 4
/// ranks) and 16 MiB 1.0-1.2x, but folding 0.5-2 MiB bodies made 1 and 4 MiB allreduces
/// 1.3-1.8x slower: the ranks spent the difference waiting for each other (`perf`:
/// scheduling and yields), the peer's acknowledgement coming only after the reduction.
/// Since Mobius sends segments that fit a ring record over shm (reduced straight out of the
/// ring, see [`ShmConn::send_through_ring`]), this applies to larger bodies only (a forced
/// `MOBIUS_SEGMENT`, another protocol).
pub const FOLD_MIN: u64 = 4 << 20;

/// Bytes of a folded body copied and reduced at a time. Pieces of 0.5-4 MiB measured the
/// same at 64 MiB (256 KiB was slower: a system call and a page pinning per piece); 1 MiB
/// keeps the scratch buffer a link holds small.
const FOLD_PIECE: usize = 1 << 20;

impl ShmLink {
    fn new(peer: String, state: State) -> Self {
        ShmLink {
            peer,
            state,
            pending: VecDeque::new(),
            reg: None,
            registered: Vec::new(),
            body: None,
            placed: None,
            queued: 0,
            borrowed: VecDeque::new(),
            scratch: Vec::new(),
        }
    }

    fn fds(&self) -> Vec<RawFd> {
        match &self.state {
            State::Accepting(a) => vec![a.fd()],
            State::Connecting(c) => vec![c.fd()],
            State::Up(c) => c.poll_fds().to_vec(),
            State::Closed => Vec::new(),
        }
    }

    fn deregister_all(&mut self) {
        if let Some((r, _)) = &self.reg {
            for fd in self.registered.drain(..) {
                let _ = r.deregister(&mut SourceFd(&fd));
            }
        }
        self.registered.clear();
    }

    fn register_all(&mut self) -> std::io::Result<()> {
        let fds = self.fds();
        if let Some((r, token)) = &self.reg {
            for fd in fds {
                r.register(&mut SourceFd(&fd), *token, Interest::READABLE)?;
                self.registered.push(fd);
            }
        }
        Ok(())
    }

    /// Drives the handshake; `Ok(true)` once the connection is up.
    fn progress(&mut self) -> Result<bool, FabricError> {
        let conn = match &mut self.state {
            State::Up(_) => return Ok(true),
            State::Closed => return Err(FabricError::Closed { peer: self.peer.clone() }),
            State::Accepting(a) => a.poll()?,
            State::Connecting(c) => c.poll()?,
        };
        let Some(conn) = conn else { return Ok(false) };
        // The handshake's socket is closed with it: deregister it while its number is ours.
        self.deregister_all();
        self.state = State::Up(Box::new(conn));
        self.register_all().map_err(|e| FabricError::io(&self.peer, "poll", e))?;
        if let State::Up(c) = &mut self.state {
            while let Some(m) = self.pending.pop_front() {
                c.send(m)?;
            }
        }
        Ok(true)
    }

    /// What arrived, for the loop: a whole message as [`Incoming::Message`]; a head whose
    /// body waits in the peer's memory as [`Incoming::Frame`], as a stream link hands over a
    /// frame, and its body follows once the protocol [placed](Link::place) it.
    fn received(&mut self, got: Received, codec: &dyn Codec) -> Result<Incoming, FabricError> {
        let frame_err = |e| FabricError::Frame { peer: self.peer.clone(), source: e };
        let mut b = match got {
            Received::Msg(buf) => {
                let at = message_head(codec, &buf).map_err(frame_err)?;
                return Ok(Incoming::Message(MsgPayload::new(buf, at)));
            }
            Received::Lent(b) => b,
        };
        let header = b.head.get(..codec.header_len()).unwrap_or(&b.head);
        let shape = checked_shape(codec, header).map_err(frame_err)?;
        if b.head.len() != shape.head || shape.payload != Some(b.len()) {
            return Err(FabricError::Unsupported(format!(
                "{}: a head of {} bytes before a body of {} sent by reference does not describe it",
                self.peer,
                b.head.len(),
                b.len()
            )));
        }
        let head = std::mem::take(&mut b.head);
        self.body = Some(b);
        Ok(Incoming::Frame(head))
    }

    /// What a look hands over before the ring is read: a placed body (`Some(Some)`), or
    /// nothing while a body still waits for its placement (`Some(None)`: the ring is not read
    /// past it). `None`: read the ring. Also drops the borrowed messages the peer has read.
    fn held(&mut self) -> Option<Option<Incoming>> {
        self.forget_read();
        if let Some(placed) = self.placed.take() {
            return Some(Some(placed));
        }
        self.body.is_some().then_some(None)
    }

    /// Drops the borrowed messages the peer has read, oldest first.
    fn forget_read(&mut self) {
        if let State::Up(c) = &self.state {
            while self.borrowed.front().is_some_and(|(_, id)| !c.lent(*id)) {
                self.borrowed.pop_front();
            }
        }
    }

    fn send_msg(&mut self, msg: Vec<u8>) -> Result<(), FabricError> {
        match &mut self.state {
            State::Up(c) => c.send(msg),
            State::Closed => Err(FabricError::Closed { peer: self.peer.clone() }),
            _ => {
                self.pending.push_back(msg);
                Ok(())
            }
        }
    }
}

impl Link for ShmLink {
    /// Whole messages (rendezvous regions are pulled). Folds: a body sent by reference of at
    /// least [`FOLD_MIN`] bytes is reduced piece by piece as it is copied (see
    /// [`ShmConn::fold_body`]); a body in the ring (the peer sends a body of a length
    /// [`ShmConn::ring_takes`] that way) is reduced straight out of it.
    fn capabilities(&self) -> Capabilities {
        let range = match &self.state {
            State::Up(c) => c.ring_body_range(),
            _ => (1, 0),
        };
        Capabilities { one_sided: false, max_eager: u32::MAX, folds: Folds { range, from: Some(FOLD_MIN) } }
    }

    fn register(&mut self, registry: &Registry, token: Token, _key: u64) -> std::io::Result<bool> {
        self.reg = Some((registry.try_clone()?, token));
        self.register_all()?;
        Ok(true)
    }

    fn deregister(&mut self, _registry: &Registry) -> std::io::Result<()> {
        self.deregister_all();
        Ok(())
    }

    fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        // A large body in the caller's memory (a Mobius rendezvous send) is left there for
        // the peer to copy: one copy in all, where encoding it into a message first made two.
        // The caller waits until `write_progress` says the peer read it.
        // One that fits a record of the ring goes into it straight from the caller's memory,
        // and the peer copies (or reduces) it straight out: two copies, cheaper than one
        // single copy where the kernel pins pages one by one (see `KIND_HEAD_BODY`).
        if let (State::Up(c), OutPayload::Source { source, offset, len }) = (&mut self.state, &payload) {
            let ring = c.ring_takes_message(head.len(), *len as usize);
            let single = c.large_messages() == LargeMessages::SingleCopy && *len as usize >= c.single_copy_min();
            if let (true, Some(mem)) = (ring || single, source.memory()) {
                let body = usize::try_from(*offset).ok().and_then(|at| mem.get(at..at.checked_add(*len as usize)?)).ok_or_else(
                    || FabricError::Unsupported(format!("payload {offset}+{len} outside its {}-byte source", mem.len())),
                )?;
                let total = (head.len() + body.len()) as u64;
                let owner: Arc<dyn Send + Sync> = Arc::new(source.clone());
                // SAFETY: `source` is memory its owner keeps unchanged until the send is
                // written (`write_progress`), which it is only once the body is in the ring
                // or, sent by reference, once the peer acknowledged its copy; `owner` keeps
                // the source itself alive until then.
                let id = if ring {
                    unsafe { c.send_through_ring(head, body.as_ptr() as u64, body.len(), owner)? }
                } else {
                    unsafe { c.send_borrowed(head, body.as_ptr() as u64, body.len(), owner)? }
                };
                self.borrowed.push_back((self.queued, id));
                self.queued += total;
                return Ok(());
            }
        }
        let m = encode_message(head, payload)?;
        self.queued += m.len() as u64;
        self.send_msg(m)
    }

    fn next(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        if !self.progress()? {
            return Ok(None);
        }
        if let Some(held) = self.held() {
            return Ok(held);
        }
        let State::Up(c) = &mut self.state else { return Ok(None) };
        // The doorbell is armed by the loop before it sleeps (`arm`), not here: a loop that
        // spins polls the ring in memory, and a peer pushing to it rings nobody.
        let got = match c.try_recv_parts()? {
            Some(b) => b,
            None => {
                // Nothing in the ring: has the peer gone? (its socket hung up; the loop woke
                // us for it, or for the doorbell: one nonblocking read tells.) Then whatever
                // it sent before was delivered, and recv reports the end.
                c.check_peer()?;
                if !c.peer_gone() {
                    return Ok(None);
                }
                match c.try_recv_parts()? {
                    Some(b) => b,
                    None => return Err(FabricError::Closed { peer: self.peer.clone() }),
                }
            }
        };
        self.received(got, codec).map(Some)
    }

    fn memory_polled(&mut self) -> Option<&mut dyn MemoryPolled> {
        Some(self)
    }

    fn send_progress(&self) -> Option<&dyn SendProgress> {
        Some(self)
    }

    fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        let Some(b) = self.body.take() else {
            return Err(FabricError::Unsupported(format!("{}: no payload awaits placement", self.peer)));
        };
        let State::Up(c) = &mut self.state else { return Err(FabricError::Closed { peer: self.peer.clone() }) };
        let len = b.len() as usize;
        // The peer's buffer is copied once, straight into where the protocol wants it.
        self.placed = Some(match placement {
            Placement::Discard => {
                c.copy_body(b, None)?;
                Incoming::Payload(None)
            }
            Placement::Into { mut lease, at } => {
                let Some(dst) = at.checked_add(len).and_then(|end| lease.get_mut(at..end)) else {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {len} bytes at {at} does not fit a buffer of {}",
                        self.peer,
                        lease.len()
                    )));
                };
                c.copy_body(b, Some(dst))?;
                Incoming::Payload(Some(lease))
            }
            Placement::Vec => {
                let mut v = vec![0u8; len];
                c.copy_body(b, Some(&mut v))?;
                Incoming::PayloadVec(v)
            }
            Placement::User(mut dst) => {
                if dst.len() != len {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {len} bytes placed into a receive of {}",
                        self.peer,
                        dst.len()
                    )));
                }
                c.copy_body(b, Some(&mut dst))?;
                Incoming::Payload(None)
            }
            Placement::Fold { mut dst, fold } => {
                if dst.len() != len || fold.align == 0 || !len.is_multiple_of(fold.align) {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {len} bytes folded into a receive of {} in pieces of {}",
                        self.peer,
                        dst.len(),
                        fold.align
                    )));
                }
                let piece = (FOLD_PIECE / fold.align).max(1) * fold.align;
                let scratch = &mut self.scratch;
                if scratch.len() < piece {
                    scratch.resize(piece, 0);
                }
                c.fold_body(b, &mut dst, &mut scratch[..piece], |d, s| (fold.apply)(d, s))?;
                Incoming::Payload(None)
            }
        });
        Ok(())
    }

    fn sends_done(&self) -> bool {
        self.pending.is_empty()
            && match &self.state {
                State::Up(c) => c.queued_bytes() == 0,
                _ => true,
            }
    }

    fn shutdown(&mut self) {
        // Deregister first: dropping the connection closes the descriptors, and a number
        // reused afterwards must not be deregistered by mistake.
        self.deregister_all();
        self.pending.clear();
        self.body = None;
        self.placed = None;
        // Unmaps the segment and closes the socket: the peer sees the hangup.
        self.state = State::Closed;
    }
}

/// The rings are read in memory on every spin turn; the eventfd doorbell is armed only
/// before the loop sleeps.
impl MemoryPolled for ShmLink {
    fn next_polled(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        // No event behind this look: the peer's liveness (a read of the control socket)
        // waits for one; the ring costs no system call. A handshake still running is driven
        // (its socket reads are the handshake's own, and a command may have queued sends).
        if matches!(self.state, State::Accepting(_) | State::Connecting(_)) && !self.progress()? {
            return Ok(None);
        }
        if let Some(held) = self.held() {
            return Ok(held);
        }
        let State::Up(c) = &mut self.state else { return Ok(None) };
        match c.try_recv_parts()? {
            Some(got) => self.received(got, codec).map(Some),
            None => Ok(None),
        }
    }

    fn ready(&self) -> bool {
        self.placed.is_some()
            || (self.body.is_none()
                && match &self.state {
                    State::Up(c) => c.has_input(),
                    _ => false,
                })
    }

    fn arm(&mut self) -> bool {
        if self.placed.is_some() {
            return true;
        }
        match &self.state {
            State::Up(c) => c.arm(),
            _ => false,
        }
    }

    fn send_now(&mut self, head: &[u8], body: &[u8]) -> Result<bool, FabricError> {
        let State::Up(c) = &mut self.state else { return Ok(false) };
        if !self.pending.is_empty() || !c.send_parts(&[head, body])? {
            return Ok(false);
        }
        self.queued += (head.len() + body.len()) as u64;
        Ok(true)
    }
}

/// A body sent from the caller's memory (through the ring, or by reference) is written once
/// it is in the ring or the peer acknowledged its copy.
impl SendProgress for ShmLink {
    fn write_progress(&self) -> (u64, u64) {
        let lent = |id: &u64| matches!(&self.state, State::Up(c) if c.lent(*id));
        let written = self.borrowed.iter().find(|(_, id)| lent(id)).map_or(self.queued, |(at, _)| *at);
        (self.queued, written)
    }
}
