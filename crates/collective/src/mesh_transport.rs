//! The fabric-backed [`Transport`]: a thin adapter over [`crate::mesh`], which
//! holds every provider-facing piece of Mobius.

use crate::dtype::{reduce_into, DType, ReduceOp};
use crate::mesh::{self, Mesh, MeshError, Message, PostedRecv, Posting, Registration, SendTicket};
use crate::transport::{Proto, Tag, Transport, TransportError, TransportErrorKind, TransportStats};
use rdma_shuffle_fabric::providers::link::Fold;
use rdma_shuffle_fabric::ProviderCapabilities;
use std::sync::Arc;
use std::time::Instant;

/// [`Transport`] over a fabric [`Mesh`] (tcp, sim or verbs provider).
#[derive(Debug)]
pub struct MeshTransport {
    mesh: Mesh,
}

impl MeshTransport {
    /// Wraps a connected mesh.
    pub fn new(mesh: Mesh) -> Self {
        MeshTransport { mesh }
    }

    /// The mesh (for its provider counters).
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Drops cached registrations of `[ptr, ptr + len)`: the memory is about to be freed.
    pub fn invalidate(&self, ptr: *const u8, len: usize) {
        self.mesh.invalidate(ptr, len)
    }
}

fn convert(e: MeshError) -> TransportError {
    let kind = match &e {
        MeshError::PeerFailed { peer, .. } => TransportErrorKind::PeerFailed { peer: *peer },
        MeshError::PeerLeft { peer, .. } => TransportErrorKind::PeerLeft { peer: *peer },
        MeshError::Aborted { by, culprit, .. } => TransportErrorKind::Aborted { by: *by, culprit: *culprit },
        MeshError::Timeout { peer, .. } => TransportErrorKind::Timeout { peer: *peer },
        _ => TransportErrorKind::Other,
    };
    TransportError { kind, message: e.to_string() }
}

fn proto(p: Proto) -> mesh::Proto {
    match p {
        Proto::Eager => mesh::Proto::Eager,
        Proto::Rendezvous => mesh::Proto::Rendezvous,
    }
}

impl Transport for MeshTransport {
    type Buf = Message;
    type Reg = Registration;
    type Ticket<'a> = SendTicket<'a>;

    fn rank(&self) -> usize {
        self.mesh.rank()
    }

    fn world(&self) -> usize {
        self.mesh.world()
    }

    fn set_oversubscribed(&self, yes: bool) {
        self.mesh.set_oversubscribed(yes);
    }

    fn provider(&self) -> &str {
        self.mesh.provider_name()
    }

    fn eager_limit(&self) -> usize {
        self.mesh.eager_limit()
    }

    fn max_message(&self) -> usize {
        self.mesh.max_message()
    }

    fn one_sided(&self) -> bool {
        self.mesh.one_sided()
    }

    fn capabilities(&self) -> ProviderCapabilities {
        self.mesh.capabilities()
    }

    unsafe fn register(&self, ptr: *const u8, len: usize) -> Result<Registration, TransportError> {
        // SAFETY: forwarded contract.
        unsafe { self.mesh.register(ptr, len) }.map_err(convert)
    }

    fn send<'a>(
        &'a self,
        peer: usize,
        tag: Tag,
        data: &'a [u8],
        p: Proto,
        reg: Option<&Registration>,
    ) -> Result<SendTicket<'a>, TransportError> {
        self.mesh.send(peer, tag, data, proto(p), reg).map_err(convert)
    }

    fn send_with_next(&self, peer: usize, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.mesh.send_with_next(peer, tag, data).map_err(convert)
    }

    fn is_complete(ticket: &SendTicket<'_>) -> bool {
        ticket.is_complete()
    }

    fn is_done(&self, ticket: &SendTicket<'_>) -> bool {
        ticket.is_done()
    }

    fn wait(&self, ticket: SendTicket<'_>, deadline: Instant) -> Result<(), TransportError> {
        self.mesh.wait(ticket, deadline).map_err(convert)
    }

    fn recv(
        &self,
        peer: usize,
        tag: Tag,
        also: Option<(usize, Tag)>,
        deadline: Instant,
    ) -> Result<(usize, Message), TransportError> {
        self.mesh.recv_either((peer, tag), also, deadline).map_err(convert)
    }

    type Posted = PostedRecv;

    unsafe fn post_recv(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        reg: Option<&Registration>,
    ) -> Result<PostedRecv, TransportError> {
        // SAFETY: forwarded contract.
        unsafe { self.mesh.post_recv(peer, tag, ptr, len, reg) }.map_err(convert)
    }

    unsafe fn post_recv_reduce(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Option<PostedRecv>, TransportError> {
        let fold = Fold { align: dtype.size(), apply: Arc::new(move |d: &mut [u8], s: &[u8]| reduce_into(dtype, op, d, s)) };
        // SAFETY: forwarded contract.
        unsafe { self.mesh.post_recv_fold(peer, tag, ptr, len, fold) }.map(Some).map_err(convert)
    }

    fn wait_posted(
        &self,
        posted: &mut PostedRecv,
        also: Option<(usize, Tag)>,
        deadline: Instant,
    ) -> Result<(usize, Option<Message>), TransportError> {
        Ok(match self.mesh.wait_posted(posted, also, deadline).map_err(convert)? {
            Posting::Placed => (0, None),
            Posting::Staged(m) => (0, Some(m)),
            Posting::Also(m) => (1, Some(m)),
        })
    }

    fn abort(&self, culprit: Option<usize>, reason: &str) {
        self.mesh.abort_for(culprit, reason)
    }

    fn stats(&self) -> TransportStats {
        let s = self.mesh.stats();
        TransportStats {
            eager_messages: s.eager_sent,
            eager_bytes: s.eager_sent_bytes,
            rendezvous_messages: s.rendezvous_sent,
            rendezvous_bytes: s.rendezvous_sent_bytes,
            eager_received: s.eager_received,
            rendezvous_received: s.rendezvous_received,
            one_sided_reads: s.reads,
            registrations: s.registrations,
            registration_hits: s.registration_hits,
            placed: s.placed,
            placed_bytes: s.placed_bytes,
            folded: s.folded,
            folded_bytes: s.folded_bytes,
            staged: s.staged,
            staged_bytes: s.staged_bytes,
            eager_in_place: s.eager_in_place,
            joined: s.joined,
        }
    }
}
