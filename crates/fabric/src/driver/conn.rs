//! One connection inside the loop: its transport, its role (block client, block server, raw
//! channel), and the state every role shares (timers, liveness, closing).

use super::channel::ChannelConn;
use super::client::ClientConn;
use super::server::ServerConn;
use super::Net;
use crate::error::FabricError;
use crate::memory::pool::Lease;
use crate::providers::sim::SimConn;
use crate::providers::tcp::{OutPayload, TcpConn, TcpPlacement, TcpRead};
use crate::providers::Source;
use rdma_shuffle_wire::{Descriptor, Frame, Limits};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// Index and generation of a connection slot; the generation makes stale references (a
/// timer, a completion, a poll event for a connection that is gone) harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ConnKey {
    pub(crate) index: u32,
    pub(crate) gen: u32,
}

impl ConnKey {
    pub(crate) fn to_u64(self) -> u64 {
        ((self.gen as u64) << 32) | self.index as u64
    }
    pub(crate) fn from_u64(v: u64) -> Self {
        ConnKey { index: v as u32, gen: (v >> 32) as u32 }
    }
}

/// What a connection does.
pub(crate) enum Role {
    Client(Box<ClientConn>),
    Server(Box<ServerConn>),
    Channel(ChannelConn),
    Mesh(Box<super::mesh::MeshConn>),
}

/// The transport of a connection.
pub(crate) enum Transport {
    Tcp(TcpConn),
    Sim(SimTransport),
    #[cfg(feature = "verbs")]
    Verbs(Box<crate::providers::verbs::conn::VerbsConn>),
}

/// A sim connection and its completed one-sided reads (sim reads finish at once; they are
/// handed back through [`Transport::next`] like verbs completions).
pub(crate) struct SimTransport {
    pub(crate) conn: SimConn,
    pub(crate) reads_done: VecDeque<(u64, Lease, Result<(), FabricError>)>,
    /// Exposures by region key, for revocation and the registered-bytes gauge.
    pub(crate) exposed: std::collections::HashMap<u32, u64>,
}

/// A read that could not be posted: its buffer and why.
pub(crate) type FailedRead = Box<(Lease, FabricError)>;

/// A received message's payload (message transports hand over whole frames).
pub(crate) struct MsgPayload {
    pub(crate) buf: Vec<u8>,
    pub(crate) at: usize,
}

impl MsgPayload {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[self.at..]
    }
}

/// Something that arrived on a connection.
pub(crate) enum Incoming {
    /// (stream) A frame's fixed part; a payload, if its kind has one, awaits placement.
    Frame(Frame),
    /// (messages) A whole frame with its payload bytes.
    Message(Frame, MsgPayload),
    /// (stream) The placed payload is complete.
    Payload(Option<Lease>),
    /// (stream) The payload placed into a vector is complete.
    PayloadVec(Vec<u8>),
    /// A one-sided read finished (or was flushed): the buffer comes back either way.
    ReadDone { tag: u64, lease: Lease, result: Result<(), FabricError> },
    /// (verbs control) The peer's data-plane bootstrap record.
    #[cfg(feature = "verbs")]
    Attach(Vec<u8>),
    /// (verbs) The data plane is up (our attach was answered and the queue pair connected).
    #[cfg(feature = "verbs")]
    Attached,
}

/// Where a payload goes, as the role decides once it saw the frame.
pub(crate) enum Placement {
    Discard,
    Into { lease: Lease, at: usize },
    Vec,
}

impl Transport {
    /// Whether frames travel as a byte stream (payloads are placed while reading).
    pub(crate) fn is_stream(&self) -> bool {
        match self {
            Transport::Tcp(_) => true,
            Transport::Sim(_) => false,
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.is_stream(),
        }
    }

    /// Whether rendezvous regions are read one-sidedly.
    pub(crate) fn one_sided(&self) -> bool {
        match self {
            Transport::Tcp(_) => false,
            Transport::Sim(s) => s.conn.one_sided(),
            #[cfg(feature = "verbs")]
            Transport::Verbs(_) => true,
        }
    }

    /// Sends a frame and its payload (queued where the transport must wait).
    pub(crate) fn send(&mut self, net: &mut Net, frame: &Frame, payload: OutPayload) -> Result<(), FabricError> {
        let _ = &net;
        match self {
            Transport::Tcp(t) => t.send(frame, payload),
            Transport::Sim(s) => s.conn.send(encode_message(frame, payload)?),
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.send(net, frame, payload),
        }
    }

    /// Holds what is sent from now on until [`uncork`](Self::uncork), which sends it together
    /// (tcp: one `writev` for many small frames). A no-op where each send is one message.
    pub(crate) fn cork(&mut self) {
        if let Transport::Tcp(t) = self {
            t.cork();
        }
    }

    /// Ends [`cork`](Self::cork) and writes what was held.
    pub(crate) fn uncork(&mut self) -> Result<(), FabricError> {
        match self {
            Transport::Tcp(t) => t.uncork().map(|_| ()),
            _ => Ok(()),
        }
    }

    /// Sends raw bytes as one write or message (tests of a peer's decoder).
    pub(crate) fn send_raw(&mut self, net: &mut Net, bytes: Vec<u8>) -> Result<(), FabricError> {
        let _ = &net;
        match self {
            Transport::Tcp(t) => t.send_raw(bytes),
            Transport::Sim(s) => s.conn.send(bytes),
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.send_raw(net, bytes),
        }
    }

    /// The next thing that arrived, if any.
    pub(crate) fn next(&mut self, net: &mut Net, limits: &Limits) -> Result<Option<Incoming>, FabricError> {
        let _ = &net;
        match self {
            Transport::Tcp(t) => tcp_next(t, limits),
            Transport::Sim(s) => {
                if let Some((tag, lease, result)) = s.reads_done.pop_front() {
                    return Ok(Some(Incoming::ReadDone { tag, lease, result }));
                }
                match s.conn.recv()? {
                    None => Ok(None),
                    Some(buf) => {
                        let peer = s.conn.peer_name();
                        let (frame, at) = Frame::decode_message(&buf, limits)
                            .map_err(|e| FabricError::Frame { peer: peer.into(), source: e })?;
                        Ok(Some(Incoming::Message(frame, MsgPayload { buf, at })))
                    }
                }
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.next(net, limits),
        }
    }

    /// Places the payload of the frame just returned (stream transports).
    pub(crate) fn place(&mut self, placement: Placement) -> Result<(), FabricError> {
        let p = match placement {
            Placement::Discard => TcpPlacement::Discard,
            Placement::Into { lease, at } => TcpPlacement::Into { lease, at },
            Placement::Vec => TcpPlacement::Vec,
        };
        match self {
            Transport::Tcp(t) => t.place(p),
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.place(p),
            Transport::Sim(_) => Ok(()),
        }
    }

    /// Exposes a region to the peer for one-sided reads; answers `(addr, rkey)`.
    pub(crate) fn expose(
        &mut self,
        net: &mut Net,
        source: Arc<dyn Source>,
        offset: u64,
        len: u64,
    ) -> Result<(u64, u32), FabricError> {
        let _ = &net;
        match self {
            Transport::Tcp(_) => Ok((offset, 0)),
            Transport::Sim(s) => {
                if !s.conn.one_sided() {
                    return Ok((offset, 0));
                }
                let (addr, rkey) = s.conn.expose(source, offset, len);
                s.exposed.insert(rkey, len);
                net.exposed_bytes += len;
                Ok((addr, rkey))
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.expose(net, source, offset, len),
        }
    }

    /// Revokes an exposure; later reads of it fail.
    pub(crate) fn revoke(&mut self, net: &mut Net, rkey: u32) {
        let _ = &net;
        match self {
            Transport::Tcp(_) => {}
            Transport::Sim(s) => {
                if let Some(len) = s.exposed.remove(&rkey) {
                    s.conn.revoke(rkey);
                    net.exposed_bytes -= len;
                }
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.revoke(net, rkey),
        }
    }

    /// Whether a one-sided read may be posted now (verbs caps reads per queue pair and per
    /// engine).
    pub(crate) fn can_read(&self, net: &Net) -> bool {
        let _ = net;
        match self {
            Transport::Tcp(_) | Transport::Sim(_) => true,
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.can_read(net),
        }
    }

    /// Starts a one-sided read of `desc` into `lease`; its completion comes back through
    /// [`next`](Self::next) as [`Incoming::ReadDone`] with `tag`. On `Err` nothing was posted.
    pub(crate) fn start_read(&mut self, net: &mut Net, tag: u64, desc: &Descriptor, lease: Lease) -> Result<(), FailedRead> {
        let _ = &net;
        match self {
            Transport::Tcp(_) => Err(Box::new((lease, FabricError::Unsupported("tcp has no one-sided read".into())))),
            Transport::Sim(s) => {
                let mut lease = lease;
                let r = s.conn.read(desc, &mut lease);
                s.reads_done.push_back((tag, lease, r));
                Ok(())
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.start_read(net, tag, desc, lease),
        }
    }

    /// Whether everything sent has left (stream: written to the socket; verbs: completed).
    pub(crate) fn sends_done(&self) -> bool {
        match self {
            Transport::Tcp(t) => t.queued_bytes() == 0,
            Transport::Sim(_) => true,
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.sends_done(),
        }
    }

    /// Whether work posted to the device is still outstanding (the connection cannot be
    /// torn down, nor its buffers reused, until it completes).
    pub(crate) fn busy(&self) -> bool {
        match self {
            Transport::Tcp(_) | Transport::Sim(_) => false,
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.busy(),
        }
    }

    /// Stops the connection: sockets shut down, exposures revoked, a queue pair moved to the
    /// error state (its posted work then completes as flushed). Idempotent.
    pub(crate) fn shutdown(&mut self, net: &mut Net) {
        let _ = &net;
        match self {
            Transport::Tcp(t) => t.shutdown(),
            Transport::Sim(s) => {
                let bytes: u64 = s.exposed.drain().map(|(_, len)| len).sum();
                net.exposed_bytes -= bytes;
                s.conn.shutdown();
            }
            #[cfg(feature = "verbs")]
            Transport::Verbs(v) => v.shutdown(net),
        }
    }
}

fn tcp_next(t: &mut TcpConn, limits: &Limits) -> Result<Option<Incoming>, FabricError> {
    Ok(match t.next(limits)? {
        TcpRead::Frame(f) => Some(Incoming::Frame(f)),
        TcpRead::Payload(l) => Some(Incoming::Payload(l)),
        TcpRead::PayloadVec(v) => Some(Incoming::PayloadVec(v)),
        TcpRead::Idle => None,
    })
}

/// A frame and its payload as one message.
pub(crate) fn encode_message(frame: &Frame, payload: OutPayload) -> Result<Vec<u8>, FabricError> {
    let mut msg = Vec::with_capacity(64 + payload_len(&payload) as usize);
    frame.encode(&mut msg);
    match payload {
        OutPayload::None => {}
        OutPayload::Bytes(b) => msg.extend_from_slice(&b),
        OutPayload::Source { source, offset, len } => {
            let have = source.len();
            if offset.checked_add(len).is_none_or(|end| end > have) {
                return Err(FabricError::Unsupported(format!("payload {offset}+{len} outside its {have}-byte source")));
            }
            let at = msg.len();
            msg.resize(at + len as usize, 0);
            source.read_at(offset, &mut msg[at..]).map_err(|e| FabricError::io("local", "read the payload for", e))?;
        }
        OutPayload::File { file, offset, len } => {
            let at = msg.len();
            msg.resize(at + len as usize, 0);
            std::os::unix::fs::FileExt::read_exact_at(&*file, &mut msg[at..], offset)
                .map_err(|e| FabricError::io("local", "read the payload for", e))?;
        }
    }
    Ok(msg)
}

fn payload_len(p: &OutPayload) -> u64 {
    match p {
        OutPayload::None => 0,
        OutPayload::Bytes(b) => b.len() as u64,
        OutPayload::Source { len, .. } | OutPayload::File { len, .. } => *len,
    }
}

/// How a connection is being closed.
pub(crate) struct Closing {
    /// Give up flushing (and waiting for device completions) at this time.
    pub(crate) deadline: Instant,
    /// Why, for the log.
    pub(crate) reason: String,
}

/// One connection.
pub(crate) struct Conn {
    pub(crate) key: ConnKey,
    pub(crate) peer: String,
    pub(crate) transport: Transport,
    pub(crate) role: Role,
    /// The peer proved the secret (or none was required); only then may anything be
    /// allocated, registered or exposed for it.
    pub(crate) authenticated: bool,
    /// The deadline this connection last armed and that has not fired.
    pub(crate) armed: Option<Instant>,
    /// Last time the connection did anything (idle accounting).
    pub(crate) last_active: Instant,
    /// Set once the connection is closing: nothing more is read, it lingers until its
    /// sends are out and its device work completed (or the deadline passes).
    pub(crate) closing: Option<Closing>,
    /// The socket is registered with the poll (stream transports and verbs control).
    pub(crate) registered: bool,
}
