//! What a provider must implement: connections that move frames and payloads, listeners
//! that accept them, and registration of server-side sources for one-sided reads.

use crate::error::FabricError;
use crate::pool::{Lease, Registrar};
use rdma_shuffle_wire::{Descriptor, Frame, Limits};
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

/// Bytes a server can serve blocks from: typically one memory-mapped Spark data file.
pub trait Source: Send + Sync + fmt::Debug {
    /// All bytes of the source.
    fn as_bytes(&self) -> &[u8];
    /// A file descriptor with the same bytes at the same offsets, for `sendfile`.
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Keys under which a provider exposes a registered [`Source`] to one-sided reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceKeys {
    /// Remote address of the source's first byte (verbs: its virtual address).
    pub addr: u64,
    /// Remote key (verbs `rkey`), 0 where unused.
    pub rkey: u32,
    /// Provider-private handle for deregistration.
    pub handle: u64,
}

/// The payload that follows a frame on [`Link::send`].
#[derive(Clone, Copy)]
pub enum Payload<'a> {
    /// No payload.
    None,
    /// These bytes.
    Bytes(&'a [u8]),
    /// `len` bytes of `source` from `offset` (sent zero-copy where the provider can).
    Source {
        /// Where the bytes are.
        source: &'a dyn Source,
        /// Offset in the source.
        offset: u64,
        /// Length.
        len: u64,
    },
}

impl Payload<'_> {
    /// Payload length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Payload::None => 0,
            Payload::Bytes(b) => b.len() as u64,
            Payload::Source { len, .. } => *len,
        }
    }

    /// Whether there is no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where [`Link::recv`] puts a frame's payload; chosen after the frame's fixed part has been
/// decoded (and validated by the session), before any payload byte is read.
pub enum Placement {
    /// Read and drop the payload.
    Discard,
    /// Write the payload into `lease` starting at byte `at`.
    Into {
        /// Destination buffer.
        lease: Lease,
        /// Offset in the buffer.
        at: usize,
    },
    /// Stop: the connection must fail with this error.
    Abort(FabricError),
}

/// One received frame, with its payload if one was placed.
pub struct Received {
    /// The frame.
    pub frame: Frame,
    /// The buffer the payload went into (from [`Placement::Into`]).
    pub payload: Option<Lease>,
}

/// A connected link to one peer. `send` may be called from several threads; `recv` from one
/// reader thread at a time.
pub trait Link: Send + Sync {
    /// The peer's address or name, for errors and logs.
    fn peer(&self) -> &str;

    /// Sends one frame and its payload (which must be `frame.payload_len()` bytes).
    fn send(&self, frame: &Frame, payload: Payload<'_>) -> Result<(), FabricError>;

    /// Receives the next frame, bounded by `limits`. For frames with a payload, `place` is
    /// called with the decoded frame to choose where the payload goes.
    fn recv(&self, limits: &Limits, place: &mut dyn FnMut(&Frame) -> Placement) -> Result<Received, FabricError>;

    /// Whether [`read_remote`](Link::read_remote) works (verbs, sim), so rendezvous blocks are
    /// read one-sidedly instead of pulled over the stream.
    fn one_sided_read(&self) -> bool {
        false
    }

    /// Reads `desc.len` bytes of the peer's registered region into `dst` (RDMA READ). Blocks
    /// until the read completes or fails.
    fn read_remote(&self, desc: &Descriptor, dst: &mut Lease) -> Result<(), FabricError> {
        let _ = (desc, dst);
        Err(FabricError::Unsupported(format!("{}: this provider has no one-sided read", self.peer())))
    }

    /// Sends raw bytes as one message/stream write, bypassing the codec. For tests and fuzzing
    /// of a peer's decoder only.
    fn send_raw(&self, bytes: &[u8]) -> Result<(), FabricError>;

    /// Waits (at most `limit`) until frames already sent have left this side, so a final
    /// `Error` frame reaches the peer before [`shutdown`](Link::shutdown). Stream providers
    /// hand bytes to the kernel on `send`, so the default does nothing.
    fn flush_sends(&self, limit: Duration) {
        let _ = limit;
    }

    /// Closes the link; a blocked `recv` returns an error. Idempotent.
    fn shutdown(&self);
}

/// Accepts links.
pub trait Listener: Send + Sync {
    /// The bound address.
    fn local_addr(&self) -> SocketAddr;
    /// Waits for the next link; returns [`FabricError::Shutdown`] after [`shutdown`](Listener::shutdown).
    fn accept(&self) -> Result<Box<dyn Link>, FabricError>;
    /// Stops accepting; a blocked `accept` returns.
    fn shutdown(&self);
}

/// A transport: tcp, verbs or sim.
pub trait Provider: Send + Sync + fmt::Debug {
    /// Short name: `"tcp"`, `"verbs"`, `"sim"`.
    fn name(&self) -> &'static str;
    /// Listens on `addr` (port 0 picks one).
    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, FabricError>;
    /// Connects to a listener at `addr`.
    fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Box<dyn Link>, FabricError>;
    /// Registers pool memory with the device (no-op where nothing needs registering).
    fn registrar(&self) -> Arc<dyn Registrar>;
    /// Exposes `source` to one-sided reads by peers until
    /// [`deregister_source`](Provider::deregister_source).
    fn register_source(&self, source: &Arc<dyn Source>) -> Result<SourceKeys, FabricError> {
        let _ = source;
        Ok(SourceKeys::default())
    }
    /// Withdraws a registration made by [`register_source`](Provider::register_source).
    fn deregister_source(&self, keys: &SourceKeys) {
        let _ = keys;
    }
    /// Provider-specific counters as `(name, value)` pairs, for logs and benchmarks.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
