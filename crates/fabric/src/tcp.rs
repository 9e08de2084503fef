//! The tcp provider: real sockets, frames over a byte stream, rendezvous blocks pulled over
//! the same stream, payloads sent zero-copy (`sendfile` from the data file, `writev` from
//! its mapping).

use crate::error::FabricError;
use crate::link::{Link, Listener, Payload, Placement, Provider, Received};
use crate::pool::{NoRegistration, Registrar};
use crate::sock::{self, SocketListener};
use parking_lot::Mutex;
use rdma_shuffle_wire::frame::HEADER_LEN;
use rdma_shuffle_wire::{Frame, Header, Limits};
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

/// Payloads at least this large go by `sendfile` when the source has a file descriptor;
/// smaller ones by one `writev` of header and mapped bytes (one syscall, still no copy).
const SENDFILE_MIN: u64 = 64 * 1024;
/// Socket buffers large enough for a few MiB in flight per connection on a LAN.
const SOCKET_BUFFER: usize = 4 * 1024 * 1024;

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

fn tune(stream: &TcpStream) {
    // Latency of small control frames matters more than packet count.
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    let size = SOCKET_BUFFER as libc::c_int;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on a valid socket with pointers to live c_ints of the right size.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, &size as *const _ as *const libc::c_void, 4);
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &size as *const _ as *const libc::c_void, 4);
        // Dead peers behind a cut link are found by the fetch timeout; keepalive also frees
        // idle server-side connections of vanished clients.
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, &one as *const _ as *const libc::c_void, 4);
    }
}

impl Provider for TcpProvider {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, FabricError> {
        Ok(Box::new(TcpLinkListener(SocketListener::bind(addr)?)))
    }

    fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Box<dyn Link>, FabricError> {
        Ok(Box::new(TcpLink::new(sock::connect(addr, timeout)?, addr.to_string())?))
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(NoRegistration)
    }
}

struct TcpLinkListener(SocketListener);

impl Listener for TcpLinkListener {
    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }

    fn accept(&self) -> Result<Box<dyn Link>, FabricError> {
        let (s, peer) = self.0.accept()?;
        Ok(Box::new(TcpLink::new(s, peer.to_string())?))
    }

    fn shutdown(&self) {
        self.0.shutdown()
    }
}

/// One tcp connection: a buffered reader half used by the single reader thread, and a writer
/// half shared by senders under a lock so frames never interleave.
struct TcpLink {
    peer: String,
    reader: Mutex<TcpReader>,
    writer: Mutex<TcpStream>,
    control: TcpStream,
}

struct TcpReader {
    stream: BufReader<TcpStream>,
    fixed: Vec<u8>,
}

impl TcpLink {
    fn new(s: TcpStream, peer: String) -> Result<Self, FabricError> {
        tune(&s);
        let clone = |s: &TcpStream| s.try_clone().map_err(|e| FabricError::io(&peer, "set up", e));
        let reader = clone(&s)?;
        let control = clone(&s)?;
        Ok(TcpLink {
            reader: Mutex::new(TcpReader { stream: BufReader::with_capacity(64 * 1024, reader), fixed: Vec::with_capacity(256) }),
            writer: Mutex::new(s),
            control,
            peer,
        })
    }

    fn write_err(&self, e: io::Error) -> FabricError {
        FabricError::io(&self.peer, "write to", e)
    }
}

/// Writes all of `bufs`, handling short writes.
fn write_all_vectored(w: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Sends `len` bytes of file `fd` from `offset` with sendfile(2).
fn sendfile_all(w: &TcpStream, fd: i32, mut offset: u64, mut len: u64) -> io::Result<()> {
    while len > 0 {
        let mut off = offset as libc::off_t;
        let chunk = len.min(1 << 30) as usize;
        // SAFETY: both descriptors are valid for the call; `off` is a live off_t.
        let n = unsafe { libc::sendfile(w.as_raw_fd(), fd, &mut off, chunk) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            // The file is shorter than the index claims: never send a short frame.
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "data file ended before the block did"));
        }
        offset += n as u64;
        len -= n as u64;
    }
    Ok(())
}

impl Link for TcpLink {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn send(&self, frame: &Frame, payload: Payload<'_>) -> Result<(), FabricError> {
        let mut head = Vec::with_capacity(64);
        frame.encode(&mut head);
        let mut w = self.writer.lock();
        match payload {
            Payload::None => w.write_all(&head).map_err(|e| self.write_err(e)),
            Payload::Bytes(b) => {
                write_all_vectored(&mut w, &mut [IoSlice::new(&head), IoSlice::new(b)]).map_err(|e| self.write_err(e))
            }
            Payload::Source { source, offset, len } => {
                if let (Some(fd), true) = (source.raw_fd(), len >= SENDFILE_MIN) {
                    w.write_all(&head).map_err(|e| self.write_err(e))?;
                    sendfile_all(&w, fd, offset, len).map_err(|e| self.write_err(e))
                } else {
                    let bytes = source.as_bytes();
                    let end = offset.checked_add(len).filter(|e| *e <= bytes.len() as u64).ok_or_else(|| {
                        self.write_err(io::Error::new(io::ErrorKind::InvalidInput, "payload range outside its source"))
                    })?;
                    let body = &bytes[offset as usize..end as usize];
                    write_all_vectored(&mut w, &mut [IoSlice::new(&head), IoSlice::new(body)]).map_err(|e| self.write_err(e))
                }
            }
        }
    }

    fn recv(&self, limits: &Limits, place: &mut dyn FnMut(&Frame) -> Placement) -> Result<Received, FabricError> {
        let mut r = self.reader.lock();
        let TcpReader { stream, fixed } = &mut *r;
        let read_err = |e: io::Error| FabricError::io(&self.peer, "read from", e);
        let mut hdr = [0u8; HEADER_LEN];
        stream.read_exact(&mut hdr).map_err(read_err)?;
        let header = Header::decode(&hdr, limits).map_err(|e| FabricError::Frame { peer: self.peer.clone(), source: e })?;
        fixed.resize(header.fixed_len(), 0);
        stream.read_exact(fixed).map_err(read_err)?;
        let frame =
            Frame::decode_body(&header, fixed, limits).map_err(|e| FabricError::Frame { peer: self.peer.clone(), source: e })?;
        let n = header.payload_len();
        if n == 0 && header.kind.payload_offset().is_none() {
            return Ok(Received { frame, payload: None });
        }
        match place(&frame) {
            Placement::Into { mut lease, at } => {
                let end = at as u64 + n;
                if end > lease.len() as u64 {
                    return Err(FabricError::Unsupported(format!(
                        "{}: payload of {n} bytes at {at} does not fit a buffer of {}",
                        self.peer,
                        lease.len()
                    )));
                }
                stream.read_exact(&mut lease[at..end as usize]).map_err(read_err)?;
                Ok(Received { frame, payload: Some(lease) })
            }
            Placement::Discard => {
                io::copy(&mut stream.by_ref().take(n), &mut io::sink()).map_err(read_err).and_then(|copied| {
                    if copied == n {
                        Ok(())
                    } else {
                        Err(FabricError::Closed { peer: self.peer.clone() })
                    }
                })?;
                Ok(Received { frame, payload: None })
            }
            Placement::Abort(e) => Err(e),
        }
    }

    fn send_raw(&self, bytes: &[u8]) -> Result<(), FabricError> {
        self.writer.lock().write_all(bytes).map_err(|e| self.write_err(e))
    }

    fn shutdown(&self) {
        let _ = self.control.shutdown(Shutdown::Both);
    }
}
