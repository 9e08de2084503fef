//! The tcp provider: real sockets, frames over a byte stream, rendezvous regions streamed on
//! request, payloads sent zero-copy (`sendfile` from the data file, `writev` from its
//! mapping).
//!
//! [`TcpConn`] is the nonblocking framing both socket providers share: the tcp provider
//! carries everything over it, the verbs provider its control plane (handshake, attach,
//! liveness). Reading is a small state machine — header, fixed part, then the payload of
//! `Eager`/`PullData` frames straight into the buffer the connection's owner chose after
//! seeing the fixed part. Until the owner chooses (it may be waiting for pool memory) the
//! connection reads nothing more: the kernel's socket buffer and TCP flow control push back
//! on the peer, and no other connection is held up.
#![deny(missing_docs)]

use mio::{Interest, Registry, Token};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::pool::{Lease, NoRegistration};
use rdma_shuffle_fabric::memory::registration::Registrar;
use rdma_shuffle_fabric::providers::codec::{checked_shape, Codec, FrameShape};
use rdma_shuffle_fabric::providers::link::{
    Capabilities, Coalescing, EngineCtx, Folds, Incoming, Link, Listener, ProviderEngine, SendProgress,
};
use rdma_shuffle_fabric::providers::link::{Fold, OutPayload, Placement, UserBuf};
use rdma_shuffle_fabric::providers::registry::{FixedMemory, Opened, Registration};
use rdma_shuffle_fabric::providers::{Provider, ProviderCapabilities};
use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// Payloads at least this large go by `sendfile` when the source has a file descriptor;
/// smaller ones by one `writev` of header and mapped bytes (one syscall, still no copy).
const SENDFILE_MIN: u64 = 64 * 1024;
/// Socket buffers large enough for a few MiB in flight per connection on a LAN.
const SOCKET_BUFFER: usize = 4 * 1024 * 1024;
/// Read buffer for headers, fixed parts and small payloads; grows for a large fixed part.
const READ_BUFFER: usize = 64 * 1024;
/// Payloads at least this large are read straight into their destination, and the reads
/// around them take only a little of what follows into the read buffer ([`READ_AHEAD`]):
/// a 64 KiB read of a header would otherwise take most of the next payload with it, and
/// those bytes would then be copied a second time, from the read buffer into the block's
/// buffer (measured with `engine-bench profile`: at 64 KiB blocks the client loop copied
/// nearly every byte twice, `memmove` a quarter of its kernel copy). Smaller payloads
/// still come through the read buffer, many per system call: below this size a copy costs
/// less than a read.
const DIRECT_MIN: u64 = 32 * 1024;
/// What a read next to a direct payload takes of the bytes after it (the next frame's
/// header and fixed part, and the start of its payload): one system call reads the rest of
/// a payload and the next header.
const READ_AHEAD: usize = 2 * 1024;

/// The tcp provider.
#[derive(Debug, Default, Clone)]
pub struct TcpProvider {
    _private: (),
}

impl TcpProvider {
    /// A tcp provider.
    pub fn new() -> Self {
        TcpProvider::default()
    }
}

/// The tcp provider in the registry: `tcp`, nothing to configure, and no fixed memory
/// (the kernel's socket buffers are per connection, and not the process's).
pub fn registration() -> Registration {
    Registration {
        name: "tcp",
        about: "TCP sockets: frames over a byte stream, large blocks streamed on request",
        open: |_| Ok(Opened::new(Arc::new(TcpProvider::new()), "tcp")),
        fixed_memory: FixedMemory::none,
    }
}

impl Provider for TcpProvider {
    fn name(&self) -> &'static str {
        "tcp"
    }

    /// Two-sided, streams (no eager bound), the kernel moves the bytes.
    fn capabilities(&self) -> ProviderCapabilities {
        ProviderCapabilities::default()
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(NoRegistration)
    }

    fn engine(&self, _ctx: EngineCtx<'_>) -> Result<Box<dyn ProviderEngine>, FabricError> {
        Ok(Box::new(TcpEngine))
    }
}

/// The tcp provider keeps nothing per loop: its connections are sockets in the loop's poll.
struct TcpEngine;

impl ProviderEngine for TcpEngine {
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError> {
        Ok(Box::new(TcpConn::connect(addr)?))
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
        _notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError> {
        let (local, l) = TcpListener::bind(addr, registry, token, Box::new(|c| Box::new(c)))?;
        Ok((local, Box::new(l)))
    }
}

/// Turns an accepted socket into a provider's link (tcp: the framed connection itself;
/// verbs: its control plane).
pub type MakeLink = Box<dyn Fn(TcpConn) -> Box<dyn Link> + Send>;

/// A listening socket in the loop's poll, shared by the socket providers (tcp, verbs).
pub struct TcpListener {
    listener: mio::net::TcpListener,
    local: SocketAddr,
    make: MakeLink,
}

impl TcpListener {
    /// Binds `addr` and registers the socket under `token`.
    pub fn bind(addr: SocketAddr, registry: &Registry, token: Token, make: MakeLink) -> Result<(SocketAddr, Self), FabricError> {
        let mut l = mio::net::TcpListener::bind(addr).map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
        let local = l.local_addr().map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
        registry.register(&mut l, token, Interest::READABLE).map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
        Ok((local, TcpListener { listener: l, local, make }))
    }
}

impl Listener for TcpListener {
    fn accept(&mut self) -> Option<(String, Box<dyn Link>)> {
        loop {
            return match self.listener.accept() {
                Ok((s, peer)) => Some((peer.to_string(), (self.make)(TcpConn::accepted(s, peer)))),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted) => continue,
                Err(e) => {
                    // EMFILE and friends: the backlog keeps the peers; try again on the next
                    // turn instead of spinning.
                    tracing::warn!(listener = %self.local, error = %e, "accept failed; retrying later");
                    None
                }
            };
        }
    }

    fn close(&mut self, registry: &Registry) {
        let _ = registry.deregister(&mut self.listener);
    }
}

impl Link for TcpConn {
    /// Two-sided (regions are pulled), unbounded payloads, and every payload may be
    /// reduced out of the read buffer as it arrives.
    fn capabilities(&self) -> Capabilities {
        Capabilities { one_sided: false, max_eager: u32::MAX, folds: Folds::ALL }
    }

    fn is_connected(&self) -> bool {
        self.connected
    }

    fn register(&mut self, registry: &Registry, token: Token, _key: u64) -> io::Result<bool> {
        registry.register(&mut self.stream, token, Interest::READABLE | Interest::WRITABLE).map(|()| true)
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        registry.deregister(&mut self.stream)
    }

    fn on_writable(&mut self) -> Result<bool, FabricError> {
        TcpConn::on_writable(self)
    }

    fn on_readable(&mut self, hung_up: bool) {
        TcpConn::on_readable(self, hung_up)
    }

    fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        TcpConn::send(self, head, payload)
    }

    fn next(&mut self, codec: &dyn Codec) -> Result<Option<Incoming>, FabricError> {
        Ok(match TcpConn::next(self, codec)? {
            TcpRead::Frame(f) => Some(Incoming::Frame(f)),
            TcpRead::Payload(l) => Some(Incoming::Payload(l)),
            TcpRead::PayloadVec(v) => Some(Incoming::PayloadVec(v)),
            TcpRead::Idle => None,
        })
    }

    fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        TcpConn::place(self, placement)
    }

    fn sends_done(&self) -> bool {
        self.queued_bytes() == 0
    }

    fn shutdown(&mut self) {
        TcpConn::shutdown(self)
    }

    fn coalescing(&mut self) -> Option<&mut dyn Coalescing> {
        Some(self)
    }

    fn send_progress(&self) -> Option<&dyn SendProgress> {
        Some(self)
    }
}

impl Coalescing for TcpConn {
    fn cork(&mut self) {
        TcpConn::cork(self)
    }

    fn uncork(&mut self) -> Result<(), FabricError> {
        TcpConn::uncork(self).map(|_| ())
    }
}

/// A frame is written from the caller's memory (a memory [`Source`](rdma_shuffle_fabric::Source))
/// until the socket took it.
impl SendProgress for TcpConn {
    fn write_progress(&self) -> (u64, u64) {
        (self.queued_total, self.sent_total)
    }
}

/// Latency of small control frames matters more than packet count; large buffers keep a
/// LAN busy; keepalive eventually frees connections of vanished peers.
pub fn tune(stream: &mio::net::TcpStream) {
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    let size = SOCKET_BUFFER as libc::c_int;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on a valid socket with pointers to live c_ints of the right size.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, &size as *const _ as *const libc::c_void, 4);
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &size as *const _ as *const libc::c_void, 4);
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, &one as *const _ as *const libc::c_void, 4);
    }
}

struct OutFrame {
    head: Vec<u8>,
    payload: OutPayload,
    /// Bytes of `head` then `payload` already written.
    pos: u64,
}

enum ReadState {
    Header,
    Fixed(FrameShape),
    /// A payload frame was returned; its owner has not placed the payload yet.
    AwaitPlacement {
        remaining: u64,
    },
    Skip {
        remaining: u64,
    },
    Fill {
        lease: Dst,
        at: usize,
        done: u64,
        total: u64,
    },
    FillVec {
        buf: Vec<u8>,
        total: u64,
    },
    /// A payload reduced into the caller's memory out of the read buffer, a piece at a time.
    Fold {
        dst: UserBuf,
        fold: Fold,
        done: u64,
        total: u64,
    },
}

/// Where a payload is read into: a pool buffer, or the caller's memory (a posted receive).
enum Dst {
    Lease(Lease),
    User(UserBuf),
}

impl std::ops::Deref for Dst {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Dst::Lease(l) => l,
            Dst::User(u) => u,
        }
    }
}

impl std::ops::DerefMut for Dst {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Dst::Lease(l) => l,
            Dst::User(u) => u,
        }
    }
}

/// One step of reading.
pub enum TcpRead {
    /// A frame's fixed part, header included. Where its shape has a payload, the payload
    /// follows: call [`TcpConn::place`] before reading on.
    Frame(Vec<u8>),
    /// The placed payload is complete (`None` when it was discarded).
    Payload(Option<Lease>),
    /// The placed payload is complete, as a vector.
    PayloadVec(Vec<u8>),
    /// Nothing more to read now (the socket is drained, or a payload awaits placement).
    Idle,
}

/// What the control socket of a link whose data plane attaches after authentication (verbs,
/// ofi) read before the switch ([`TcpConn::next_control`]).
pub enum ControlRead {
    /// The peer's attach record: the link's own, never handed up to the protocol.
    Attach(Vec<u8>),
    /// A frame or payload of the protocol (its handshake).
    Up(Incoming),
    /// Nothing more to read now.
    Idle,
}

/// A nonblocking, framed tcp connection.
pub struct TcpConn {
    stream: mio::net::TcpStream,
    peer: String,
    connected: bool,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    rstate: ReadState,
    eof: bool,
    out: VecDeque<OutFrame>,
    /// Bytes queued and not yet written.
    out_bytes: u64,
    /// Bytes ever queued, and ever written: a frame queued when `queued_total` became `n` is
    /// out once `sent_total >= n` (mesh sends written from caller memory complete then).
    queued_total: u64,
    sent_total: u64,
    /// Frames queued while corked wait for [`uncork`](TcpConn::uncork), which writes them
    /// together (one `writev` for many small frames).
    corked: bool,
    /// The last payload was read straight into its destination ([`DIRECT_MIN`]): reads of
    /// headers take at most [`READ_AHEAD`] bytes, as the next payload is likely large too.
    direct: bool,
    /// Bytes of placed payloads copied out of the read buffer (a second copy of each).
    copied: u64,
    /// Readiness as the owner's poll reported it ([`on_readable`](TcpConn::on_readable)):
    /// `None` until it reported any (every read is tried); then whether the socket may hold
    /// bytes. A read that finds it empty clears it, the next readable event sets it, and
    /// reads in between are skipped: the loop drives a connection after each command on it
    /// too, and those reads found nothing (measured: 2.5 empty `recvfrom` per 2-rank 4 KiB
    /// allreduce over tcp). Edge-triggered epoll reports every arrival after a read, so
    /// nothing that arrives later goes unnoticed.
    may_read: Option<bool>,
    /// The poll reported the peer's end closed (or an error): read until the end of the
    /// stream, even after a short read (the event that said so will not come again).
    hung_up: bool,
}

/// Most slices one `writev` of queued frames gathers (two per frame: header and payload).
const MAX_IOV: usize = 64;

impl TcpConn {
    /// Starts connecting to `addr` (nonblocking); [`on_writable`](Self::on_writable) says
    /// when it is done.
    pub fn connect(addr: SocketAddr) -> Result<TcpConn, FabricError> {
        let stream = mio::net::TcpStream::connect(addr).map_err(|e| FabricError::io(&addr.to_string(), "connect to", e))?;
        Ok(TcpConn::new(stream, addr.to_string(), false))
    }

    /// An accepted connection.
    pub fn accepted(stream: mio::net::TcpStream, peer: SocketAddr) -> TcpConn {
        TcpConn::new(stream, peer.to_string(), true)
    }

    fn new(stream: mio::net::TcpStream, peer: String, connected: bool) -> TcpConn {
        if connected {
            tune(&stream);
        }
        TcpConn {
            stream,
            peer,
            connected,
            rbuf: vec![0; READ_BUFFER],
            rstart: 0,
            rend: 0,
            rstate: ReadState::Header,
            eof: false,
            out: VecDeque::new(),
            out_bytes: 0,
            queued_total: 0,
            sent_total: 0,
            corked: false,
            direct: false,
            copied: 0,
            may_read: None,
            hung_up: false,
        }
    }

    /// The owner's poll reported the socket readable (`hung_up`: closed by the peer, or in
    /// error): the next read is tried. From the first report on, reads after one that found
    /// the socket empty wait for the next (see `may_read`).
    pub fn on_readable(&mut self, hung_up: bool) {
        self.may_read = Some(true);
        self.hung_up |= hung_up;
    }

    /// Holds frames sent from now on in the queue until [`uncork`](Self::uncork): a batch of
    /// answers produced in one turn then leaves in one `writev` (and wakes the peer once)
    /// instead of one system call each.
    pub fn cork(&mut self) {
        self.corked = true;
    }

    /// Ends [`cork`](Self::cork) and writes what is queued, as [`flush`](Self::flush) does.
    pub fn uncork(&mut self) -> Result<bool, FabricError> {
        self.corked = false;
        if self.connected {
            self.flush()
        } else {
            Ok(self.out.is_empty())
        }
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The socket, for registration with the poll.
    pub fn stream_mut(&mut self) -> &mut mio::net::TcpStream {
        &mut self.stream
    }

    /// Whether the connect completed.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Bytes queued and not yet written.
    pub fn queued_bytes(&self) -> u64 {
        self.out_bytes
    }

    /// The socket became writable: completes a pending connect (`Ok(true)` the first time),
    /// then writes what is queued.
    pub fn on_writable(&mut self) -> Result<bool, FabricError> {
        let mut just_connected = false;
        if !self.connected {
            if let Some(e) = self.stream.take_error().map_err(|e| self.err("connect to", e))? {
                return Err(self.err("connect to", e));
            }
            match self.stream.peer_addr() {
                Ok(_) => {
                    self.connected = true;
                    just_connected = true;
                    tune(&self.stream);
                }
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return Ok(false),
                Err(e) => return Err(self.err("connect to", e)),
            }
        }
        self.flush()?;
        Ok(just_connected)
    }

    fn err(&self, op: &'static str, e: io::Error) -> FabricError {
        FabricError::io(&self.peer, op, e)
    }

    /// Queues a frame (its fixed part `head` and its payload) and writes as much as the
    /// socket takes.
    pub fn send(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        let payload = match payload {
            OutPayload::Source { source, offset, len } => {
                let have = source.len();
                if offset.checked_add(len).is_none_or(|end| end > have) {
                    return Err(self.err(
                        "write to",
                        io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!("payload {offset}+{len} outside its {have}-byte source"),
                        ),
                    ));
                }
                if source.memory().is_some() {
                    OutPayload::Source { source, offset, len }
                } else {
                    let read = |e| self.err("read the payload for", e);
                    match source.file().map_err(read)? {
                        Some(file) if len >= SENDFILE_MIN => OutPayload::File { file, offset, len },
                        Some(file) => OutPayload::Bytes(pread_vec(&file, offset, len as usize).map_err(read)?),
                        None => OutPayload::Bytes(rdma_shuffle_fabric::providers::read_vec(&*source, offset, len).map_err(read)?),
                    }
                }
            }
            p => p,
        };
        self.push(head, payload)
    }

    fn push(&mut self, head: Vec<u8>, payload: OutPayload) -> Result<(), FabricError> {
        self.out_bytes += head.len() as u64 + payload.len();
        self.queued_total += head.len() as u64 + payload.len();
        self.out.push_back(OutFrame { head, payload, pos: 0 });
        if self.connected && !self.corked {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the queued frames at the front that hold no file payload with one `writev`
    /// (at most [`MAX_IOV`] slices). `None` when the front frame is a file payload's, which
    /// [`flush`](Self::flush) sends on its own.
    fn write_gathered(&mut self) -> Option<io::Result<usize>> {
        if self.out.len() < 2 || self.out.front().is_some_and(|f| matches!(f.payload, OutPayload::File { .. })) {
            return None;
        }
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_IOV);
        for f in self.out.iter() {
            if matches!(f.payload, OutPayload::File { .. }) || iov.len() + 2 > MAX_IOV {
                break;
            }
            let head_len = f.head.len() as u64;
            if f.pos < head_len {
                iov.push(IoSlice::new(&f.head[f.pos as usize..]));
            }
            let body = payload_slice(&f.payload, f.pos.saturating_sub(head_len));
            if !body.is_empty() {
                iov.push(IoSlice::new(body));
            }
        }
        Some((&self.stream).write_vectored(&iov))
    }

    /// Accounts `n` bytes written from the front of the queue, popping frames that are out.
    fn advance(&mut self, mut n: u64) {
        self.out_bytes -= n;
        self.sent_total += n;
        while n > 0 {
            let Some(f) = self.out.front_mut() else { break };
            let left = f.head.len() as u64 + f.payload.len() - f.pos;
            if n >= left {
                n -= left;
                self.out.pop_front();
            } else {
                f.pos += n;
                n = 0;
            }
        }
    }

    /// Writes queued frames until the socket would block. `Ok(true)` when everything is out.
    pub fn flush(&mut self) -> Result<bool, FabricError> {
        loop {
            // Several small frames queued: one writev for as many as fit.
            match self.write_gathered() {
                None => {}
                Some(Ok(0)) => return Err(FabricError::io(&self.peer, "write to", io::ErrorKind::WriteZero.into())),
                Some(Ok(n)) => {
                    self.advance(n as u64);
                    continue;
                }
                Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Some(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Some(Err(e)) => return Err(FabricError::io(&self.peer, "write to", e)),
            }
            // One frame alone, or a file payload's (header with MSG_MORE, then sendfile).
            if !self.flush_front()? {
                return Ok(false);
            }
            if self.out.is_empty() {
                return Ok(true);
            }
        }
    }

    /// Writes the front frame until it is out (`Ok(true)`) or the socket would block.
    fn flush_front(&mut self) -> Result<bool, FabricError> {
        if let Some(f) = self.out.front_mut() {
            let head_len = f.head.len() as u64;
            let total = head_len + f.payload.len();
            while f.pos < total {
                let r = if f.pos >= head_len {
                    let at = f.pos - head_len;
                    match &f.payload {
                        OutPayload::File { file, offset, len } => sendfile(&self.stream, file.as_raw_fd(), offset + at, len - at),
                        p => {
                            let rest = payload_slice(p, at);
                            (&self.stream).write(rest)
                        }
                    }
                } else {
                    let head = &f.head[f.pos as usize..];
                    let body = payload_slice(&f.payload, 0);
                    let small = !matches!(&f.payload, OutPayload::File { .. });
                    if small && !body.is_empty() {
                        (&self.stream).write_vectored(&[IoSlice::new(head), IoSlice::new(body)])
                    } else if !small {
                        // The payload follows by sendfile: MSG_MORE keeps the header in the
                        // socket until the payload joins it, so header and data leave in the
                        // same segments (with TCP_NODELAY the header would otherwise go alone,
                        // one more packet and one more wakeup of the reader per frame).
                        send_more(&self.stream, head)
                    } else {
                        (&self.stream).write(head)
                    }
                };
                match r {
                    Ok(0) => return Err(FabricError::io(&self.peer, "write to", io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        f.pos += n as u64;
                        self.out_bytes -= n as u64;
                        self.sent_total += n as u64;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(FabricError::io(&self.peer, "write to", e)),
                }
            }
            self.out.pop_front();
        }
        Ok(true)
    }

    /// Places the payload of the frame [`next`](Self::next) just returned.
    pub fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        let ReadState::AwaitPlacement { remaining } = self.rstate else {
            return Err(FabricError::Unsupported(format!("{}: no payload awaits placement", self.peer)));
        };
        // Only a payload read into its own buffer is read around (`DIRECT_MIN`); the others
        // go through the read buffer in large reads (a fold reduces out of it piece by piece).
        if !matches!(placement, Placement::Into { .. } | Placement::User(_)) {
            self.direct = false;
        }
        self.rstate = match placement {
            Placement::Discard => ReadState::Skip { remaining },
            Placement::Into { lease, at } => {
                if (at as u64).saturating_add(remaining) > lease.len() as u64 {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {remaining} bytes at {at} does not fit a buffer of {}",
                        self.peer,
                        lease.len()
                    )));
                }
                ReadState::Fill { lease: Dst::Lease(lease), at, done: 0, total: remaining }
            }
            Placement::User(dst) => {
                if dst.len() as u64 != remaining {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {remaining} bytes placed into a receive of {}",
                        self.peer,
                        dst.len()
                    )));
                }
                ReadState::Fill { lease: Dst::User(dst), at: 0, done: 0, total: remaining }
            }
            Placement::Vec => ReadState::FillVec { buf: Vec::with_capacity(remaining as usize), total: remaining },
            Placement::Fold { dst, fold } => {
                if dst.len() as u64 != remaining || fold.align == 0 || !remaining.is_multiple_of(fold.align as u64) {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {remaining} bytes folded into a receive of {} in pieces of {}",
                        self.peer,
                        dst.len(),
                        fold.align
                    )));
                }
                ReadState::Fold { dst, fold, done: 0, total: remaining }
            }
        };
        Ok(())
    }

    /// Whether a payload waits for [`place`](Self::place).
    pub fn awaits_placement(&self) -> bool {
        matches!(self.rstate, ReadState::AwaitPlacement { .. })
    }

    /// Reads the next frame or payload. Errors are fatal for the connection (end of stream
    /// included: [`FabricError::Closed`]).
    pub fn next(&mut self, codec: &dyn Codec) -> Result<TcpRead, FabricError> {
        loop {
            match &mut self.rstate {
                ReadState::AwaitPlacement { .. } => return Ok(TcpRead::Idle),
                ReadState::Header => {
                    let hl = codec.header_len();
                    if self.buffered() < hl {
                        if !self.fill(hl)? {
                            return Ok(TcpRead::Idle);
                        }
                        continue;
                    }
                    let shape = checked_shape(codec, &self.rbuf[self.rstart..self.rstart + hl])
                        .map_err(|e| FabricError::Frame { peer: self.peer.clone(), source: e })?;
                    self.rstate = ReadState::Fixed(shape);
                }
                ReadState::Fixed(shape) => {
                    let shape = *shape;
                    if self.buffered() < shape.head {
                        if !self.fill(shape.head)? {
                            return Ok(TcpRead::Idle);
                        }
                        continue;
                    }
                    let head = self.rbuf[self.rstart..self.rstart + shape.head].to_vec();
                    self.rstart += shape.head;
                    self.rstate = match shape.payload {
                        Some(remaining) => ReadState::AwaitPlacement { remaining },
                        None => ReadState::Header,
                    };
                    return Ok(TcpRead::Frame(head));
                }
                ReadState::Skip { remaining } => {
                    let take = (*remaining).min((self.rend - self.rstart) as u64) as usize;
                    self.rstart += take;
                    *remaining -= take as u64;
                    if *remaining == 0 {
                        self.rstate = ReadState::Header;
                        return Ok(TcpRead::Payload(None));
                    }
                    if !self.fill(1)? {
                        return Ok(TcpRead::Idle);
                    }
                }
                ReadState::FillVec { buf, total } => {
                    let take = (*total - buf.len() as u64).min((self.rend - self.rstart) as u64) as usize;
                    buf.extend_from_slice(&self.rbuf[self.rstart..self.rstart + take]);
                    self.rstart += take;
                    if buf.len() as u64 == *total {
                        let ReadState::FillVec { buf, .. } = std::mem::replace(&mut self.rstate, ReadState::Header) else {
                            continue;
                        };
                        return Ok(TcpRead::PayloadVec(buf));
                    }
                    if !self.fill(1)? {
                        return Ok(TcpRead::Idle);
                    }
                }
                ReadState::Fold { dst, fold, done, total } => {
                    // Whole elements out of the read buffer (at most its 64 KiB at a time, so
                    // a piece is still in cache when it is reduced), then the next read.
                    let align = fold.align;
                    let take = ((*total - *done) as usize).min(self.rend - self.rstart) / align * align;
                    if take > 0 {
                        let at = *done as usize;
                        (fold.apply)(&mut dst[at..at + take], &self.rbuf[self.rstart..self.rstart + take]);
                        self.rstart += take;
                        *done += take as u64;
                    }
                    if *done == *total {
                        self.rstate = ReadState::Header;
                        return Ok(TcpRead::Payload(None));
                    }
                    if !self.fill(align)? {
                        return Ok(TcpRead::Idle);
                    }
                }
                ReadState::Fill { lease, at, done, total } => {
                    // Buffered bytes first, then straight from the socket into the lease.
                    let buffered = self.rend - self.rstart;
                    if buffered > 0 {
                        let take = ((*total - *done) as usize).min(buffered);
                        let dst = *at + *done as usize;
                        lease[dst..dst + take].copy_from_slice(&self.rbuf[self.rstart..self.rstart + take]);
                        self.rstart += take;
                        *done += take as u64;
                        self.copied += take as u64;
                    }
                    let direct = *total >= DIRECT_MIN;
                    while *done < *total {
                        let dst = *at + *done as usize;
                        let end = *at + *total as usize;
                        // A large payload: the same read takes the start of the next frame
                        // into the (now empty) read buffer, so a stream of large frames costs
                        // one system call per frame, not two.
                        let r = if direct && self.rstart == self.rend {
                            self.rstart = 0;
                            self.rend = 0;
                            let ahead = READ_AHEAD.min(self.rbuf.len());
                            let (first, second) = (&mut lease[dst..end], &mut self.rbuf[..ahead]);
                            read_socket(
                                &self.stream,
                                &mut self.may_read,
                                self.hung_up,
                                &mut [IoSliceMut::new(first), IoSliceMut::new(second)],
                            )
                        } else {
                            read_socket(
                                &self.stream,
                                &mut self.may_read,
                                self.hung_up,
                                &mut [IoSliceMut::new(&mut lease[dst..end])],
                            )
                        };
                        match r {
                            Ok(0) => {
                                self.eof = true;
                                return Err(FabricError::Closed { peer: self.peer.clone() });
                            }
                            Ok(n) => {
                                let want = (*total - *done) as usize;
                                *done += n.min(want) as u64;
                                if n > want {
                                    self.rend = n - want;
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(TcpRead::Idle),
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(FabricError::io(&self.peer, "read from", e)),
                        }
                    }
                    self.direct = direct;
                    let ReadState::Fill { lease, .. } = std::mem::replace(&mut self.rstate, ReadState::Header) else {
                        continue;
                    };
                    return Ok(TcpRead::Payload(match lease {
                        Dst::Lease(l) => Some(l),
                        Dst::User(_) => None,
                    }));
                }
            }
        }
    }

    fn buffered(&self) -> usize {
        self.rend - self.rstart
    }

    /// Reads from the socket until at least `need` bytes are buffered. `Ok(false)` when the
    /// socket has nothing more now.
    fn fill(&mut self, need: usize) -> Result<bool, FabricError> {
        if self.eof {
            return Err(FabricError::Closed { peer: self.peer.clone() });
        }
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        } else if self.rbuf.len() - self.rstart < need {
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
        }
        if self.rbuf.len() < need {
            self.rbuf.resize(need, 0);
        } else if self.rbuf.len() > READ_BUFFER && self.rend < READ_BUFFER && need <= READ_BUFFER {
            // A large fixed part passed: give the memory back.
            self.rbuf.truncate(READ_BUFFER);
            self.rbuf.shrink_to_fit();
        }
        loop {
            // After a large payload, a header is read with little of what follows: the next
            // payload is probably large too, and goes straight into its own buffer.
            // (`rstart + need` fits: the buffer was compacted or grown above.)
            let cap = if self.direct { (self.rstart + need.max(READ_AHEAD)).min(self.rbuf.len()) } else { self.rbuf.len() };
            match read_socket(
                &self.stream,
                &mut self.may_read,
                self.hung_up,
                &mut [IoSliceMut::new(&mut self.rbuf[self.rend..cap])],
            ) {
                Ok(0) => {
                    self.eof = true;
                    return Err(FabricError::Closed { peer: self.peer.clone() });
                }
                Ok(n) => {
                    self.rend += n;
                    if self.rend - self.rstart >= need {
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FabricError::io(&self.peer, "read from", e)),
            }
        }
    }

    /// The next step of reading the control socket of a link whose data plane attaches after
    /// authentication: the protocol's frames and payloads go up as they are, the peer's
    /// attach record (the protocol's attach frame, recognised by `codec`) is told apart.
    /// The providers that attach a data plane (verbs, ofi) read their control socket through
    /// this until the switch, and through [`poll_attached`](Self::poll_attached) after it.
    pub fn next_control(&mut self, codec: &dyn Codec) -> Result<ControlRead, FabricError> {
        Ok(match self.next(codec)? {
            TcpRead::Frame(head) => match codec.attach_record(&head) {
                Some(record) => ControlRead::Attach(record),
                None => ControlRead::Up(Incoming::Frame(head)),
            },
            TcpRead::Payload(l) => ControlRead::Up(Incoming::Payload(l)),
            TcpRead::PayloadVec(v) => ControlRead::Up(Incoming::PayloadVec(v)),
            TcpRead::Idle => ControlRead::Idle,
        })
    }

    /// The liveness check of a control socket once its link's data plane is attached: the
    /// socket must stay silent. A payload frame read before the switch and still waiting
    /// (the peer sent one with or after its attach record) is a protocol error, as is any
    /// byte now; the end of the stream is [`FabricError::Closed`].
    pub fn poll_attached(&mut self) -> Result<(), FabricError> {
        if self.awaits_placement() {
            return Err(FabricError::Unsupported(format!("{} sent a payload frame on its control socket", self.peer)));
        }
        self.poll_silent()
    }

    /// Whether the socket has bytes (or an end of stream) waiting: a liveness check for
    /// control sockets that must stay silent.
    pub fn poll_silent(&mut self) -> Result<(), FabricError> {
        let mut one = [0u8; 1];
        loop {
            match (&self.stream).read(&mut one) {
                Ok(0) => return Err(FabricError::Closed { peer: self.peer.clone() }),
                Ok(_) => {
                    return Err(FabricError::Unsupported(format!(
                        "{} sent bytes on its control socket after the data plane was set up",
                        self.peer
                    )))
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FabricError::io(&self.peer, "read from", e)),
            }
        }
    }

    /// Closes both directions now.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn payload_slice(p: &OutPayload, at: u64) -> &[u8] {
    match p {
        OutPayload::None => &[],
        OutPayload::Bytes(b) => &b[at as usize..],
        OutPayload::Source { source, offset, len } => {
            // Only memory sources stay `Source` (see `send`); checked against the length then.
            let bytes = source.memory().unwrap_or(&[]);
            let start = (offset + at) as usize;
            let end = (offset + len) as usize;
            bytes.get(start..end).unwrap_or(&[])
        }
        // Sent with sendfile, never sliced.
        OutPayload::File { .. } => &[],
    }
}

/// Writes `bytes` with MSG_MORE: more data follows at once.
fn send_more(w: &mio::net::TcpStream, bytes: &[u8]) -> io::Result<usize> {
    // SAFETY: a valid socket; `bytes` is live for the call.
    let n = unsafe { libc::send(w.as_raw_fd(), bytes.as_ptr() as *const libc::c_void, bytes.len(), libc::MSG_MORE) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One read from `stream` into `bufs`, unless the socket is known to be empty (`may_read`
/// is `Some(false)`, see [`TcpConn::on_readable`]): then `WouldBlock` without a system call.
/// A read that returns less than asked (the socket had no more; unless the peer `hung_up`,
/// whose end of stream is still to be read) or would block marks it empty until the next
/// readable event, once the owner reports events at all.
fn read_socket(
    stream: &mio::net::TcpStream,
    may_read: &mut Option<bool>,
    hung_up: bool,
    bufs: &mut [IoSliceMut<'_>],
) -> io::Result<usize> {
    if *may_read == Some(false) {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    let asked: usize = bufs.iter().map(|b| b.len()).sum();
    let r = if let [one] = bufs { (&*stream).read(one) } else { (&*stream).read_vectored(bufs) };
    let empty = match &r {
        Ok(n) => *n > 0 && *n < asked && !hung_up,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
    };
    if empty && may_read.is_some() {
        *may_read = Some(false);
    }
    r
}

/// `len` bytes of `file` from `offset`, read with pread(2) into a vector that is not zeroed
/// first: zeroing a buffer that the read overwrites whole was 5 % of the server loop at
/// 16 KiB blocks (`perf record` of `engine-bench profile`). A file shorter than that fails,
/// as [`sendfile`] does.
fn pread_vec(file: &std::fs::File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut v: Vec<u8> = Vec::with_capacity(len);
    let mut done = 0usize;
    while done < len {
        let at = offset + done as u64;
        // SAFETY: the destination is the vector's spare capacity from `done` on, `len - done`
        // bytes, all allocated and not aliased; pread writes at most that many.
        let n = unsafe {
            libc::pread(file.as_raw_fd(), v.as_mut_ptr().add(done) as *mut libc::c_void, len - done, at as libc::off_t)
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "data file ended before the block did")),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    // SAFETY: pread initialized all `len` bytes (the loop ends only when `done == len`).
    unsafe { v.set_len(len) };
    Ok(v)
}

/// Sends up to `len` bytes of file `fd` from `offset` with sendfile(2); one call.
fn sendfile(w: &mio::net::TcpStream, fd: i32, offset: u64, len: u64) -> io::Result<usize> {
    let mut off = offset as libc::off_t;
    let chunk = len.min(1 << 30) as usize;
    // SAFETY: both descriptors are valid for the call; `off` is a live off_t.
    let n = unsafe { libc::sendfile(w.as_raw_fd(), fd, &mut off, chunk) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        // The file is shorter than the index claims: never send a short frame.
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "data file ended before the block did"));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::time::{Duration, Instant};

    /// Frames held by `cork` leave in gathered `writev`s; with more queued than the socket
    /// buffers hold, writes end part-way through frames and go on from there: the reader gets
    /// every byte, in order.
    #[test]
    fn corked_frames_leave_gathered_and_whole_across_partial_writes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        });
        let std_stream = std::net::TcpStream::connect(addr).unwrap();
        std_stream.set_nonblocking(true).unwrap();
        let mut conn = TcpConn::accepted(mio::net::TcpStream::from_std(std_stream), addr);
        let mut want = Vec::new();
        conn.cork();
        for i in 0..400usize {
            let head: Vec<u8> = (0..(7 + i % 50)).map(|b| (b + i) as u8).collect();
            // Payloads from none to 60 KiB: 400 frames are about 12 MiB, more than the two
            // 4 MiB socket buffers take at once.
            let body: Vec<u8> = (0..(i * 151) % 61_440).map(|b| (b * 31 + i) as u8).collect();
            want.extend_from_slice(&head);
            want.extend_from_slice(&body);
            let payload = if body.is_empty() { OutPayload::None } else { OutPayload::Bytes(body) };
            conn.push(head, payload).unwrap();
        }
        assert_eq!(conn.queued_bytes(), want.len() as u64, "nothing leaves while corked");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut done = conn.uncork().unwrap();
        while !done {
            assert!(Instant::now() < deadline, "{} bytes still queued", conn.queued_bytes());
            std::thread::sleep(Duration::from_millis(1));
            done = conn.flush().unwrap();
        }
        assert_eq!(conn.sent_total, want.len() as u64);
        conn.shutdown();
        drop(conn);
        let got = reader.join().unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "bytes differ from what was queued");
    }

    /// A frame of the test codec: an 8-byte header (fixed part's length, then the payload's,
    /// `u32::MAX` for none), the rest of the fixed part, the payload.
    struct TestCodec;

    impl Codec for TestCodec {
        fn header_len(&self) -> usize {
            8
        }
        fn shape(&self, h: &[u8]) -> Result<FrameShape, rdma_shuffle_fabric::providers::codec::CodecError> {
            let head = u32::from_le_bytes(h[0..4].try_into().unwrap()) as usize;
            let payload = u32::from_le_bytes(h[4..8].try_into().unwrap());
            Ok(FrameShape { head, payload: (payload != u32::MAX).then_some(payload as u64) })
        }
        fn attach_frame(&self, _: &[u8]) -> Vec<u8> {
            Vec::new()
        }
        fn attach_record(&self, _: &[u8]) -> Option<Vec<u8>> {
            None
        }
    }

    /// [`TestCodec`]'s frames, where a fixed part whose first byte after the header is `A`
    /// is the attach frame (its record the rest).
    struct AttachCodec;

    impl Codec for AttachCodec {
        fn header_len(&self) -> usize {
            TestCodec.header_len()
        }
        fn shape(&self, h: &[u8]) -> Result<FrameShape, rdma_shuffle_fabric::providers::codec::CodecError> {
            TestCodec.shape(h)
        }
        fn attach_frame(&self, _: &[u8]) -> Vec<u8> {
            Vec::new()
        }
        fn attach_record(&self, head: &[u8]) -> Option<Vec<u8>> {
            (head.get(8) == Some(&b'A')).then(|| head[9..].to_vec())
        }
    }

    /// A nonblocking connection over loopback, and its peer's blocking socket.
    fn connected() -> (TcpConn, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let std_stream = std::net::TcpStream::connect(addr).unwrap();
        let (peer, _) = listener.accept().unwrap();
        std_stream.set_nonblocking(true).unwrap();
        (TcpConn::accepted(mio::net::TcpStream::from_std(std_stream), addr), peer)
    }

    /// Before the switch the control socket hands up the protocol's frames and payloads and
    /// tells the attach record apart; after it, silence is fine, and a byte, a payload frame
    /// left waiting, or the end of the stream fail the link.
    #[test]
    fn a_control_socket_tells_the_attach_record_apart_and_must_stay_silent_after_it() {
        let (mut conn, mut peer) = connected();
        let codec = AttachCodec;
        let (mut hello, _) = test_frame(1, 0);
        hello[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut attach = vec![0u8; 12];
        attach[0..4].copy_from_slice(&12u32.to_le_bytes());
        attach[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        attach[8..12].copy_from_slice(b"Arec");
        let (data_head, data) = test_frame(2, 100);
        for b in [&hello, &attach, &data_head, &data] {
            peer.write_all(b).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let next = |conn: &mut TcpConn| loop {
            assert!(Instant::now() < deadline, "nothing read in 60 s");
            conn.on_readable(false);
            match conn.next_control(&codec).unwrap() {
                ControlRead::Idle => std::thread::sleep(Duration::from_millis(1)),
                r => return r,
            }
        };
        assert!(matches!(next(&mut conn), ControlRead::Up(Incoming::Frame(h)) if h == hello));
        assert!(matches!(next(&mut conn), ControlRead::Attach(r) if r == b"rec"));
        assert!(matches!(next(&mut conn), ControlRead::Up(Incoming::Frame(h)) if h == data_head));
        // The data frame's payload waits for placement: after the switch that is an error.
        let err = conn.poll_attached().unwrap_err();
        assert!(err.to_string().contains("payload frame on its control socket"), "{err}");
        conn.place(Placement::Discard).unwrap();
        assert!(matches!(next(&mut conn), ControlRead::Up(Incoming::Payload(None))));
        conn.poll_attached().unwrap();
        peer.write_all(b"x").unwrap();
        let err = loop {
            assert!(Instant::now() < deadline, "the byte after the switch was not seen in 60 s");
            match conn.poll_attached() {
                Ok(()) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, FabricError::Unsupported(_)), "{err}");
        drop(peer);
        let err = loop {
            assert!(Instant::now() < deadline, "the end of the stream was not seen in 60 s");
            match conn.poll_attached() {
                Ok(()) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, FabricError::Closed { .. }), "{err}");
    }

    fn test_frame(i: usize, len: usize) -> (Vec<u8>, Vec<u8>) {
        let mut head = vec![0u8; 24];
        head[0..4].copy_from_slice(&24u32.to_le_bytes());
        head[4..8].copy_from_slice(&(len as u32).to_le_bytes());
        head[8..16].copy_from_slice(&(i as u64).to_le_bytes());
        let body = (0..len).map(|b| (b * 7 + i * 13) as u8).collect();
        (head, body)
    }

    /// Large payloads are read straight into their buffers: what goes through the read
    /// buffer (and is copied twice) is the start of a run of them and at most `READ_AHEAD`
    /// per frame after it, while small payloads still share reads. Every byte arrives in
    /// order, whatever the sizes in between.
    #[test]
    fn large_payloads_are_read_into_their_buffers_not_through_the_read_buffer() {
        // Runs of sizes: small ones between large ones, a large run of 64 KiB, one of 1 MiB.
        let mut sizes = Vec::new();
        sizes.extend(std::iter::repeat_n(4096, 50));
        sizes.extend(std::iter::repeat_n(64 * 1024, 200));
        sizes.extend(std::iter::repeat_n(16 * 1024, 50));
        sizes.extend(std::iter::repeat_n(1 << 20, 20));
        sizes.extend((0..200).map(|i| [0, 100, 40_000, 70_000, 8, 33_000][i % 6]));
        let frames: Vec<(Vec<u8>, Vec<u8>)> = sizes.iter().enumerate().map(|(i, &n)| test_frame(i, n)).collect();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let wire: Vec<u8> = frames.iter().flat_map(|(h, b)| h.iter().chain(b.iter()).copied()).collect();
        let writer = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // In pieces of odd sizes, so frames straddle every kind of read boundary.
            for piece in wire.chunks(100_003) {
                s.write_all(piece).unwrap();
            }
        });
        let std_stream = std::net::TcpStream::connect(addr).unwrap();
        std_stream.set_nonblocking(true).unwrap();
        let mut conn = TcpConn::accepted(mio::net::TcpStream::from_std(std_stream), addr);
        let codec = TestCodec;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut got = 0;
        // Bytes through the read buffer, per run: (run's first frame, last frame, copied).
        let runs = [(50usize, 250usize), (300, 320)];
        let mut copied_at = vec![0u64; frames.len() + 1];
        let mut dst: Vec<u8> = Vec::new();
        while got < frames.len() {
            assert!(Instant::now() < deadline, "{got} of {} frames in 60 s", frames.len());
            match conn.next(&codec).unwrap() {
                TcpRead::Frame(head) => {
                    assert_eq!(head, frames[got].0, "fixed part of frame {got}");
                    dst = vec![0u8; frames[got].1.len()];
                    // SAFETY: `dst` is not touched until the payload is answered.
                    let user = unsafe { UserBuf::new(dst.as_mut_ptr(), dst.len()) };
                    conn.place(Placement::User(user)).unwrap();
                }
                TcpRead::Payload(None) => {
                    assert!(dst == frames[got].1, "payload of frame {got} ({} bytes)", dst.len());
                    got += 1;
                    copied_at[got] = conn.copied;
                }
                TcpRead::Payload(Some(_)) | TcpRead::PayloadVec(_) => unreachable!("placed into user memory"),
                TcpRead::Idle => std::thread::sleep(Duration::from_micros(200)),
            }
        }
        writer.join().unwrap();
        for (first, end) in runs {
            let copied = copied_at[end] - copied_at[first];
            let bound = READ_BUFFER as u64 + (end - first) as u64 * READ_AHEAD as u64;
            assert!(copied <= bound, "frames {first}..{end}: {copied} bytes copied out of the read buffer, more than {bound}");
        }
        // Small payloads share reads: most of their bytes come through the read buffer.
        let small = copied_at[50];
        assert!(small >= 40 * 4096, "the first 50 small payloads: only {small} bytes through the read buffer");
    }

    /// Once the owner's poll reports readiness, a read that found the socket empty is not
    /// tried again until the next readable event: bytes that arrive meanwhile wait for their
    /// event (edge-triggered epoll reports each arrival), and none is lost. The peer's close
    /// is read to the end of the stream even when its bytes and its FIN came in one event.
    #[test]
    fn reads_after_an_empty_one_wait_for_the_next_event_and_a_close_is_read_to_its_end() {
        let (mut conn, mut peer) = connected();
        let mut poll = mio::Poll::new().unwrap();
        poll.registry().register(conn.stream_mut(), Token(7), Interest::READABLE).unwrap();
        let codec = TestCodec;
        let mut events = mio::Events::with_capacity(8);
        // What arrives, read the way the driver reads: each event reported, then the link
        // driven until it has nothing (or fails).
        let mut wait_and_read = |conn: &mut TcpConn, want: usize| -> (Vec<Vec<u8>>, Option<FabricError>) {
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut got = Vec::new();
            while got.len() < want && Instant::now() < deadline {
                poll.poll(&mut events, Some(Duration::from_millis(100))).unwrap();
                for ev in events.iter() {
                    conn.on_readable(ev.is_read_closed() || ev.is_error());
                }
                loop {
                    match conn.next(&codec) {
                        Ok(TcpRead::Frame(head)) => {
                            got.push(head);
                            conn.place(Placement::Vec).unwrap();
                        }
                        Ok(TcpRead::PayloadVec(_)) => {}
                        Ok(TcpRead::Idle) => break,
                        Ok(other) => panic!("unexpected {:?}", std::mem::discriminant(&other)),
                        Err(e) => return (got, Some(e)),
                    }
                }
            }
            (got, None)
        };
        let (h1, b1) = test_frame(1, 3000);
        peer.write_all(&[h1.clone(), b1].concat()).unwrap();
        assert_eq!(wait_and_read(&mut conn, 1).0, vec![h1]);
        // Found empty since: a frame that arrives now is not read without its event ...
        let (h2, b2) = test_frame(2, 5000);
        peer.write_all(&[h2.clone(), b2].concat()).unwrap();
        assert!(matches!(conn.next(&codec), Ok(TcpRead::Idle)), "read without an event after the socket was found empty");
        // ... and is with it.
        assert_eq!(wait_and_read(&mut conn, 1).0, vec![h2]);
        // A last frame and the close, both there before the poll looks: one event for both.
        let (h3, b3) = test_frame(3, 700);
        peer.write_all(&[h3.clone(), b3].concat()).unwrap();
        peer.shutdown(std::net::Shutdown::Write).unwrap();
        drop(peer);
        let (got, err) = wait_and_read(&mut conn, 2);
        assert_eq!(got, vec![h3]);
        assert!(matches!(err, Some(FabricError::Closed { .. })), "the close was not read: {err:?}");
    }

    /// A small payload of a file is read whole; one past the file's end fails instead of
    /// sending a short frame.
    #[test]
    fn small_file_payloads_are_read_whole_and_a_short_file_fails() {
        let path = std::env::temp_dir().join(format!("tcp-pread-test-{}", std::process::id()));
        let data: Vec<u8> = (0..100_000usize).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        for (offset, len) in [(0, 1), (5, 4096), (99_000, 1000), (1234, 64 * 1024 - 1), (0, 0)] {
            assert_eq!(pread_vec(&file, offset as u64, len).unwrap(), data[offset..offset + len]);
        }
        let e = pread_vec(&file, 99_000, 1001).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
