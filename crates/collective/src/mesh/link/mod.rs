//! Mesh links inside the loop: the connection kind behind [`crate::mesh`].
//!
//! A mesh endpoint ([`MeshEp`]) is one rank's listener and the links of its group. Each link
//! is a connection with the [`MeshConn`] role, driven like every other connection: the loop
//! runs its handshake (a sans-IO exchange, [`crate::mesh::handshake`]), attaches the verbs
//! data plane after the peer authenticated, then files every message that arrives into the
//! mesh's shared inboxes by `(peer, tag)` and performs the one-sided READs of rendezvous
//! messages. Callers' sends arrive as jobs carrying a [`MeshCmd`]. No thread is made per peer:
//! one loop runs every link, timers and backpressure included.
//!
//! Building: the caller's thread ([`Mesh::connect`](crate::mesh::Mesh::connect)) starts the
//! endpoint, waits for the links to come up, retries connections a listener refused, and
//! seals the endpoint (listener closed, stray connections dropped) once every link is up.

mod incoming;

use incoming::{mesh_incoming, mesh_memory};

use crate::mesh::codec::{Kind, MeshCodec};
use crate::mesh::handshake::{ClientHs, ServerHs};
use crate::mesh::shared::{bump, MeshShared};
use crate::mesh::{MeshError, Tag, UserMemory};
use crossbeam_channel::Sender;
use rdma_shuffle_fabric::driver::{Acceptor, Loop};
use rdma_shuffle_fabric::driver::{Conn, ConnKey, Handler, Incoming, Role, Transport};
use rdma_shuffle_fabric::providers::link::OutPayload;
use rdma_shuffle_fabric::providers::Source;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::Descriptor;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// What follows a data frame: bytes the caller handed over (copied), or the caller's own
/// memory (written from in place; the caller waits for the send to complete).
pub(crate) enum OutBody {
    Bytes(Vec<u8>),
    User(Arc<UserMemory>),
}

/// How the peer will read a one-sided rendezvous message.
pub(crate) enum RtsSource {
    /// Expose this memory to the peer for the message (sim: a window per message).
    Expose(Arc<UserMemory>),
    /// The memory is registered already; the peer reads it with these keys (verbs).
    Keys { addr: u64, rkey: u32 },
}

/// Work for the loop from a mesh's callers.
pub(crate) enum MeshCmd {
    Listen {
        id: u64,
        addr: SocketAddr,
        reply: Sender<Result<SocketAddr, FabricError>>,
    },
    Start {
        id: u64,
        shared: Arc<MeshShared>,
        addrs: Vec<SocketAddr>,
    },
    Connect {
        id: u64,
        peer: usize,
    },
    Seal {
        id: u64,
    },
    Send {
        key: ConnKey,
        /// The frame's fixed part (the mesh's own encoding).
        head: Vec<u8>,
        body: OutBody,
        mark: Option<u64>,
        /// Held in a link that coalesces sends until the end of the loop turn, so that what
        /// the same turn sends on the link leaves with it ([`Mesh::send_with_next`]).
        with_next: bool,
    },
    Rts {
        key: ConnKey,
        tag: Tag,
        token: u64,
        len: u64,
        source: RtsSource,
    },
    Release {
        key: ConnKey,
        token: u64,
        reply: Sender<()>,
    },
    /// A caller gives up a posted receive the loop is placing into: the link stops reading.
    Unpost {
        key: ConnKey,
        tag: Tag,
        reply: Sender<()>,
    },
    Abort {
        id: u64,
        culprit: Option<usize>,
        reason: String,
    },
    Close {
        id: u64,
        bye: bool,
        reply: Sender<()>,
    },
}

/// Queues `c` for the loop.
pub(crate) fn submit(driver: &rdma_shuffle_fabric::driver::Driver, c: MeshCmd) -> Result<(), FabricError> {
    driver.submit(move |lp| mesh_command(lp, c))
}

/// Queues `c` for the loop without waking its thread (the caller drives the loop next).
pub(crate) fn submit_quiet(driver: &rdma_shuffle_fabric::driver::Driver, c: MeshCmd) -> Result<(), FabricError> {
    driver.submit_quiet(move |lp| mesh_command(lp, c))
}

/// One rank's mesh inside the loop.
pub(crate) struct MeshEp {
    shared: Option<Arc<MeshShared>>,
    addrs: Vec<SocketAddr>,
    /// Every connection of this mesh: links, handshakes, strays.
    conns: Vec<ConnKey>,
    /// Accepted connections not yet authenticated, oldest first.
    pending: VecDeque<ConnKey>,
}

/// The meshes of a loop, by id (the loop's [state](Loop::state) for this protocol).
pub(crate) type Meshes = HashMap<u64, MeshEp>;

/// Hands a mesh's accepted connections to it, once the mesh has started (until then they
/// wait in the listener's backlog).
struct MeshAcceptor;

impl Acceptor for MeshAcceptor {
    fn accepting(&self, lp: &Loop, id: u64) -> bool {
        lp.state_ref::<Meshes>().and_then(|m| m.get(&id)).is_some_and(|m| m.shared.is_some())
    }

    fn accepted(&self, lp: &mut Loop, id: u64, peer: String, transport: Transport) {
        mesh_accepted(lp, id, peer, transport)
    }
}

/// Where a link is in its life.
pub(crate) enum Phase {
    /// (connecting side) HELLO sent; waits for WELCOME.
    Welcome(ClientHs),
    /// (connecting side) PROOF sent; waits for READY.
    Ready,
    /// (accepting side) waits for HELLO.
    Hello,
    /// (accepting side) WELCOME sent; waits for PROOF.
    Proof(ServerHs),
    /// (verbs) authenticated; the data plane is being attached.
    Attaching,
    /// Messages flow.
    Up,
}

/// A one-sided rendezvous message to read.
pub(crate) struct RtsJob {
    tag: Tag,
    slot: u64,
    token: u64,
    desc: Descriptor,
    /// (claimed by a posted receive) Its memory and the key a READ writes it with.
    user: Option<(rdma_shuffle_fabric::providers::link::UserBuf, u32)>,
}

/// A READ in flight.
pub(crate) struct ReadJob {
    tag: Tag,
    slot: u64,
    token: u64,
    len: u64,
    /// Its receive was given up: told once the device is done with the memory.
    unposted: Option<Sender<()>>,
}

impl ReadJob {
    /// Whether it reads into a posted receive's memory (slot 0, as in [`Rx`]): no
    /// slot, no pool buffer.
    fn posted(&self) -> bool {
        self.slot == 0
    }
}

/// (stream) The data frame whose payload is being read: into slot `slot`, or (`slot` 0)
/// into the receive posted for `tag`.
pub(crate) struct Rx {
    pub(crate) tag: Tag,
    /// The slot the payload fills, or 0: the receive posted for `tag`.
    pub(crate) slot: u64,
    pub(crate) proto: crate::mesh::Proto,
    pub(crate) len: u64,
    /// Reduced into the posted receive's memory as it arrives.
    pub(crate) folded: bool,
}

impl Rx {
    /// A data payload being placed into a posted receive.
    fn posted(&self) -> Option<Tag> {
        (self.slot == 0).then_some(self.tag)
    }
}

/// A mesh link inside the loop.
pub(crate) struct MeshConn {
    ep: u64,
    shared: Arc<MeshShared>,
    /// This link's codec: bounded to handshake sizes until the peer authenticated.
    pub(crate) codec: Arc<MeshCodec>,
    /// The peer's rank: the target of an outgoing link; learnt from HELLO on an accepted one.
    peer: Option<usize>,
    outgoing: bool,
    /// The transport connected (an outgoing connect can fail before: retried).
    connected: bool,
    phase: Phase,
    rx: Option<Rx>,
    /// (stream) A data frame whose payload waits for pool memory; the link reads nothing
    /// more until it has some.
    pub(crate) starved: Option<Rx>,
    /// (tcp) Rendezvous sends written from the caller's memory: `(stream position after the
    /// frame, token)`; complete once the socket took every byte up to the position.
    marks: VecDeque<(u64, u64)>,
    /// (sim) Exposures of the caller's memory by send token, revoked at `DONE`.
    exposures: HashMap<u64, u32>,
    /// One-sided rendezvous messages waiting to be read (memory, read caps), in order.
    rts: VecDeque<RtsJob>,
    reads: HashMap<u64, ReadJob>,
    next_read: u64,
    /// A READ from this peer found its window taken back (one-sided providers) before any
    /// abort arrived: `(why, tags of the posted receives it was for)`. The peer takes a
    /// window back only when it gives up, and it tells the group why before it does, so
    /// the link waits for that abort (which names the cause) instead of failing naming
    /// a rank that is alive.
    pub(crate) revoked: Option<(String, Vec<Tag>)>,
    /// When the connection was made: its handshake must be done within the mesh's
    /// handshake limit, or it is dropped (work before authentication is bounded).
    opened: Instant,
}

impl MeshConn {
    /// The link stops reading (it failed or closes): a receive it was placing into is told,
    /// so its caller may have its memory back.
    pub(crate) fn end_posted(&mut self, why: &str) {
        let Some(peer) = self.peer else { return };
        if let Some(tag) = self.rx.as_ref().and_then(Rx::posted) {
            self.rx = None;
            self.shared.posted_end(peer, tag, Some(why.to_string()));
        }
        // Claimed READs not started yet: nothing was posted to the device.
        for job in self.rts.iter().filter(|j| j.user.is_some()) {
            self.shared.posted_end(peer, job.tag, Some(why.to_string()));
        }
        self.rts.retain(|j| j.user.is_none());
        // READs posted into a receive's memory end with their completion (a flush, once the
        // queue pair stopped): until then the device may still write the memory.
    }

    /// The link is removed: receives whose READs never completed end now (the loop only
    /// removes a link once its device work completed, or after the close limit).
    fn end_user_reads(&mut self, why: &str) {
        let Some(peer) = self.peer else { return };
        for (_, job) in self.reads.drain().filter(|(_, j)| j.posted()) {
            if let Some(reply) = job.unposted {
                let _ = reply.send(());
            }
            self.shared.posted_end(peer, job.tag, Some(why.to_string()));
        }
    }

    /// A link's role for mesh `ep`: outgoing to `peer` (a lower rank), or accepted (`None`:
    /// the peer names itself in its hello).
    fn role(ep: u64, shared: Arc<MeshShared>, peer: Option<usize>, connected: bool, phase: Phase) -> Role {
        let codec = MeshCodec::new(shared.eager_limit, shared.max_message);
        let conn = MeshConn {
            ep,
            shared,
            codec: codec.clone(),
            peer,
            outgoing: peer.is_some(),
            connected,
            phase,
            rx: None,
            starved: None,
            marks: VecDeque::new(),
            exposures: HashMap::new(),
            rts: VecDeque::new(),
            reads: HashMap::new(),
            next_read: 1,
            revoked: None,
            opened: Instant::now(),
        };
        Role::new(&MeshHandler, conn, codec)
    }
}

pub(crate) fn mesh_mut(conn: &mut Conn) -> &mut MeshConn {
    conn.role.get_mut::<MeshConn>().unwrap_or_else(|| unreachable_role())
}

#[cold]
fn unreachable_role() -> ! {
    // Only called from the mesh's handler, which the loop calls for mesh links only.
    panic!("mesh handler called on a connection of another role")
}

/// The mesh link's [`Handler`]: one link of a collective group.
pub(crate) struct MeshHandler;

impl Handler for MeshHandler {
    fn blocked(&self, conn: &Conn) -> bool {
        conn.role.get::<MeshConn>().is_some_and(|m| m.starved.is_some())
    }

    fn connected(&self, _lp: &mut Loop, conn: &mut Conn) {
        mesh_connected(conn)
    }

    fn incoming(&self, lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
        mesh_incoming(lp, conn, inc)
    }

    fn failed(&self, lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool {
        mesh_failed(lp, conn, error);
        false
    }

    fn after(&self, _lp: &mut Loop, conn: &mut Conn) {
        mesh_after(conn)
    }

    fn deadline(&self, _lp: &Loop, conn: &Conn) -> Option<Instant> {
        mesh_deadline(conn)
    }

    fn timeout(&self, lp: &mut Loop, conn: &mut Conn, now: Instant) {
        mesh_timeout(lp, conn, now)
    }

    fn memory(&self, lp: &mut Loop, conn: &mut Conn) {
        mesh_memory(lp, conn)
    }

    fn removed(&self, lp: &mut Loop, conn: &mut Conn) {
        mesh_removed(lp, conn)
    }
}

/// A control message on a link: its frame (the body inside the fixed part), and no payload.
pub(crate) fn control(kind: Kind, tag: Tag, body: &[u8]) -> (Vec<u8>, OutPayload) {
    (crate::mesh::codec::control(kind, tag, body), OutPayload::None)
}

pub(crate) fn mesh_command(lp: &mut Loop, c: MeshCmd) {
    match c {
        MeshCmd::Listen { id, addr, reply } => match lp.listen(id, addr, &MeshAcceptor) {
            Ok(local) => {
                let ep = MeshEp { shared: None, addrs: Vec::new(), conns: Vec::new(), pending: VecDeque::new() };
                lp.state::<Meshes>().insert(id, ep);
                let _ = reply.send(Ok(local));
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        },
        MeshCmd::Start { id, shared, addrs } => {
            let hook = lp.release_hook();
            let Some(ep) = lp.state::<Meshes>().get_mut(&id) else { return };
            shared.pool.add_release_hook(Arc::downgrade(&hook));
            let rank = shared.rank;
            ep.shared = Some(shared);
            ep.addrs = addrs;
            for peer in 0..rank {
                mesh_connect(lp, id, peer);
            }
            // Peers may have connected before the mesh started: their connections wait in
            // the listener's backlog.
            lp.accept(id);
        }
        MeshCmd::Connect { id, peer } => mesh_connect(lp, id, peer),
        MeshCmd::Seal { id } => {
            let Some(ep) = lp.state::<Meshes>().get_mut(&id) else { return };
            let links: Vec<ConnKey> = ep.conns.clone();
            ep.pending.clear();
            lp.unlisten(id);
            for key in links {
                with_mesh(lp, key, |lp, conn| {
                    if !matches!(mesh_mut(conn).phase, Phase::Up) {
                        lp.close(conn, "a connection that is not a mesh link (the mesh is complete)".into(), false);
                    }
                });
            }
        }
        MeshCmd::Send { key, head, body, mark, with_next } => with_mesh(lp, key, |lp, conn| {
            if conn.closing.is_some() {
                return;
            }
            if with_next {
                hold_until_turn_ends(lp, conn);
            } else if lp.state::<Held>().0.contains(&conn.key) {
                bump(&mesh_mut(conn).shared.counters.joined, 1);
            }
            let payload = match body {
                OutBody::Bytes(b) => OutPayload::Bytes(b),
                OutBody::User(m) => {
                    let len = m.len as u64;
                    OutPayload::Source { source: m as Arc<dyn Source>, offset: 0, len }
                }
            };
            if let Err(e) = conn.transport.send(head, payload) {
                lp.fail(conn, e);
                return;
            }
            if let Some(token) = mark {
                // A stream writes from the caller's memory until the frame is out; message
                // transports copied the bytes.
                let written_at = conn.transport.send_progress().map(|p| p.write_progress().0);
                let m = mesh_mut(conn);
                match (written_at, m.peer) {
                    (Some(pos), _) => m.marks.push_back((pos, token)),
                    (None, Some(peer)) => m.shared.send_done(peer, token),
                    (None, None) => {}
                }
            }
        }),
        MeshCmd::Rts { key, tag, token, len, source } => with_mesh(lp, key, |lp, conn| {
            if conn.closing.is_some() {
                return;
            }
            let (addr, rkey) = match source {
                RtsSource::Keys { addr, rkey } => (addr, rkey),
                RtsSource::Expose(m) => match conn.transport.expose_or_offer(m as Arc<dyn Source>, 0, len) {
                    Ok((addr, rkey)) => {
                        mesh_mut(conn).exposures.insert(token, rkey);
                        (addr, rkey)
                    }
                    Err(e) => {
                        lp.fail(conn, e);
                        return;
                    }
                },
            };
            let mut body = Vec::with_capacity(28);
            body.extend_from_slice(&addr.to_be_bytes());
            body.extend_from_slice(&rkey.to_be_bytes());
            body.extend_from_slice(&len.to_be_bytes());
            body.extend_from_slice(&token.to_be_bytes());
            let (f, p) = control(Kind::Rts, tag, &body);
            if let Err(e) = conn.transport.send(f, p) {
                lp.fail(conn, e);
            }
        }),
        MeshCmd::Release { key, token, reply } => {
            with_mesh(lp, key, |lp, conn| {
                let m = mesh_mut(conn);
                if let Some(rkey) = m.exposures.remove(&token) {
                    conn.transport.revoke(rkey);
                }
                if mesh_mut(conn).marks.iter().any(|(_, t)| *t == token) {
                    // Its bytes are not all written and its memory is about to go: the
                    // stream cannot be cut in the middle of a frame, so the link goes.
                    lp.fail(conn, FabricError::Unsupported("a rendezvous send was abandoned before it was written".into()));
                }
            });
            let _ = reply.send(());
        }
        MeshCmd::Unpost { key, tag, reply } => {
            let mut reply = Some(reply);
            with_mesh(lp, key, |lp, conn| {
                let m = mesh_mut(conn);
                // (verbs) A READ into the memory is in flight: the queue pair stops, and the
                // caller hears back once the flushed READ completed, not before.
                let reading = match m.reads.values_mut().find(|j| j.posted() && j.tag == tag) {
                    Some(job) => {
                        job.unposted = reply.take();
                        true
                    }
                    None => false,
                };
                // The payload cannot be skipped from the middle of a stream frame, nor a
                // claimed READ handed back, once the memory is gone: the link goes.
                let claimed =
                    m.rx.as_ref().and_then(Rx::posted) == Some(tag) || m.rts.iter().any(|j| j.user.is_some() && j.tag == tag);
                if reading || claimed {
                    lp.fail(conn, FabricError::Unsupported("a posted receive was abandoned while its message arrived".into()));
                }
            });
            if let Some(reply) = reply {
                let _ = reply.send(());
            }
        }
        MeshCmd::Abort { id, culprit, reason } => send_abort(lp, id, None, culprit, &reason),
        MeshCmd::Close { id, bye, reply } => {
            remove_mesh(lp, id, bye);
            let _ = reply.send(());
        }
    }
}

/// Tells every peer of mesh `id` (but `skip`) that the group gives up: the body is the
/// culprit's rank (`u32::MAX`: none known) and the reason.
pub(crate) fn send_abort(lp: &mut Loop, id: u64, skip: Option<ConnKey>, culprit: Option<usize>, reason: &str) {
    let Some(ep) = lp.state::<Meshes>().get(&id) else { return };
    let mut body = culprit.map_or(u32::MAX, |c| c as u32).to_be_bytes().to_vec();
    body.extend_from_slice(reason.as_bytes());
    for key in ep.conns.clone() {
        if Some(key) == skip {
            continue;
        }
        with_mesh(lp, key, |_, conn| {
            if conn.closing.is_none() && matches!(mesh_mut(conn).phase, Phase::Up) {
                let (f, p) = control(Kind::Abort, 0, &body);
                let _ = conn.transport.send(f, p);
            }
        });
    }
}

/// Closes a mesh endpoint: its listener, and every connection (links say `BYE` first
/// when `bye`, unless a send from caller memory is still unwritten on them).
pub(crate) fn remove_mesh(lp: &mut Loop, id: u64, bye: bool) {
    lp.unlisten(id);
    let Some(ep) = lp.state::<Meshes>().remove(&id) else { return };
    for key in ep.conns {
        let Some(mut conn) = lp.take(key) else { continue };
        if conn.closing.is_none() {
            let m = mesh_mut(&mut conn);
            let clean = bye && matches!(m.phase, Phase::Up) && m.marks.is_empty();
            m.marks.clear();
            m.end_posted("the mesh was closed");
            if clean {
                let (f, p) = control(Kind::Bye, 0, &[]);
                let _ = conn.transport.send(f, p);
            }
            lp.close(&mut conn, "the mesh was closed".into(), clean);
        }
        lp.put(conn);
    }
}

/// What became of an eager message a caller holding the loop tried to put out at once
/// ([`send_eager_now`]).
pub(crate) enum EagerNow {
    /// Out (or the link failed on it, as the queued send would have).
    Done,
    /// Queued on a stream link from the caller's memory; complete once the socket took it
    /// (the token's mark).
    Pending,
    /// Not taken: send a copy through the queue.
    NotTaken,
}

/// Runs `f` on the mesh link `key` for a caller holding the loop; a link that fails on it is
/// failed here, as the queued send would have been, and the message counts as out.
fn eager_now(lp: &mut Loop, key: ConnKey, f: impl FnOnce(&mut Loop, &mut Conn) -> Result<EagerNow, FabricError>) -> EagerNow {
    let Some(mut conn) = lp.take(key) else { return EagerNow::NotTaken };
    let mut now = EagerNow::NotTaken;
    if conn.closing.is_none() && conn.role.is::<MeshConn>() {
        now = f(lp, &mut conn).unwrap_or_else(|e| {
            lp.fail(&mut conn, e);
            EagerNow::Done
        });
    }
    lp.put(conn);
    now
}

/// A link read in memory (shm) takes `head` then `body` into its ring at once, without a
/// copy of its own ([`MemoryPolled::send_now`]).
fn into_ring(conn: &mut Conn, head: &[u8], body: &[u8]) -> Result<EagerNow, FabricError> {
    match conn.transport.memory_polled() {
        Some(m) => Ok(if m.send_now(head, body)? { EagerNow::Done } else { EagerNow::NotTaken }),
        None => Ok(EagerNow::NotTaken),
    }
}

/// An eager message put out at once, by a caller holding the loop, where the link is read in
/// memory (shm); `false`: not taken (send it through the queue).
///
/// [`MemoryPolled::send_now`]: rdma_shuffle_fabric::providers::link::MemoryPolled::send_now
pub(crate) fn send_polled_now(lp: &mut Loop, key: ConnKey, head: &[u8], body: &[u8]) -> bool {
    matches!(eager_now(lp, key, |_, conn| into_ring(conn, head, body)), EagerNow::Done)
}

/// An eager message, `head` then the caller's `memory`, put out at once by a caller holding
/// the loop, without a copy of the bytes:
/// * a link read in memory (shm) takes it into its ring ([`MemoryPolled::send_now`]);
/// * a stream link (tcp) writes it from the caller's memory, together with what this turn
///   held for the link (a call's header, [`hold_until_turn_ends`]): `Done` when the socket
///   took all of it, as it does unless it is full; else `Pending` under `token`, and the
///   caller keeps its bytes until the mark passes. (The copy into a message was a fifth of
///   a 64 KiB allreduce's memory traffic, and the policy assumes streams copy nothing.)
///
/// [`MemoryPolled::send_now`]: rdma_shuffle_fabric::providers::link::MemoryPolled::send_now
pub(crate) fn send_eager_now(lp: &mut Loop, key: ConnKey, head: &[u8], memory: &Arc<UserMemory>, token: u64) -> EagerNow {
    eager_now(lp, key, |lp, conn| {
        if conn.transport.memory_polled().is_some() {
            into_ring(conn, head, memory.memory().unwrap_or(&[]))
        } else if conn.transport.send_progress().is_some() {
            write_in_place(lp, conn, head, memory, token)
        } else {
            Ok(EagerNow::NotTaken)
        }
    })
}

/// The stream half of [`send_eager_now`].
fn write_in_place(
    lp: &mut Loop,
    conn: &mut Conn,
    head: &[u8],
    memory: &Arc<UserMemory>,
    token: u64,
) -> Result<EagerNow, FabricError> {
    let len = memory.len as u64;
    conn.transport.send(head.to_vec(), OutPayload::Source { source: memory.clone() as Arc<dyn Source>, offset: 0, len })?;
    let held = &mut lp.state::<Held>().0;
    let joined = held.iter().position(|k| *k == conn.key).map(|i| held.swap_remove(i)).is_some();
    if joined {
        if let Some(c) = conn.transport.coalescing() {
            c.uncork()?;
        }
    }
    let counters = &mesh_mut(conn).shared.counters;
    bump(&counters.eager_in_place, 1);
    bump(&counters.joined, joined as u64);
    let Some((queued, written)) = conn.transport.send_progress().map(|p| p.write_progress()) else {
        return Ok(EagerNow::Done);
    };
    if written >= queued {
        return Ok(EagerNow::Done);
    }
    mesh_mut(conn).marks.push_back((queued, token));
    Ok(EagerNow::Pending)
}

/// Links holding their sends until the end of the loop turn (the loop's state for
/// [`hold_until_turn_ends`]).
#[derive(Default)]
struct Held(Vec<ConnKey>);

/// Corks `conn`'s link, if it coalesces sends, until the end of this loop turn: a message
/// sent [with the next](crate::mesh::Mesh::send_with_next) and whatever the turn sends after
/// it on the link leave together (tcp: one `writev`, one segment, one wake-up of the peer).
/// The turn's deferred pass uncorks every held link, so nothing waits past the turn.
fn hold_until_turn_ends(lp: &mut Loop, conn: &mut Conn) {
    let Some(c) = conn.transport.coalescing() else { return };
    c.cork();
    let held = &mut lp.state::<Held>().0;
    if !held.contains(&conn.key) {
        held.push(conn.key);
        if held.len() == 1 {
            lp.defer(release_held);
        }
    }
}

/// The end of a turn: every held link writes what it holds.
fn release_held(lp: &mut Loop) {
    for key in std::mem::take(&mut lp.state::<Held>().0) {
        let Some(mut conn) = lp.take(key) else { continue };
        if let Some(c) = conn.transport.coalescing() {
            if let Err(e) = c.uncork() {
                lp.fail(&mut conn, e);
            }
        }
        lp.put(conn);
    }
}

pub(crate) fn with_mesh(lp: &mut Loop, key: ConnKey, f: impl FnOnce(&mut Loop, &mut Conn)) {
    let Some(mut conn) = lp.take(key) else { return };
    if conn.role.is::<MeshConn>() {
        f(lp, &mut conn);
    }
    let k = conn.key;
    lp.put(conn);
    // Whatever the command started (a sim read) may have completed already.
    lp.drive_again(k);
}

/// Opens (or reopens, after a refusal) the link to the lower rank `peer`.
fn mesh_connect(lp: &mut Loop, id: u64, peer: usize) {
    let Some(ep) = lp.state::<Meshes>().get(&id) else { return };
    let Some(shared) = ep.shared.clone() else { return };
    let Some(&addr) = ep.addrs.get(peer) else { return };
    let transport = match lp.connect(addr) {
        Ok(t) => t,
        Err(e) => {
            shared.build_problem(format!("connecting to rank {peer} at {addr}: {e}"), None, Some(peer));
            return;
        }
    };
    let connected = transport.is_connected();
    let (hs, hello) = shared.hs.client_hello(peer);
    let role = MeshConn::role(id, shared, Some(peer), connected, Phase::Welcome(hs));
    let key = lp.insert(addr.to_string(), transport, role);
    if let Some(ep) = lp.state::<Meshes>().get_mut(&id) {
        ep.conns.push(key);
    }
    if let Some(mut conn) = lp.take(key) {
        let (f, p) = control(Kind::Hello, 0, &hello);
        if let Err(e) = conn.transport.send(f, p) {
            lp.fail(&mut conn, e);
        }
        lp.put(conn);
    }
    lp.activate(key);
}

/// A connection accepted on mesh listener `id`.
pub(crate) fn mesh_accepted(lp: &mut Loop, id: u64, peer: String, transport: Transport) {
    let Some(ep) = lp.state::<Meshes>().get(&id) else { return };
    let Some(shared) = ep.shared.clone() else { return };
    let cap = 2 * shared.world + 16;
    let role = MeshConn::role(id, shared, None, true, Phase::Hello);
    let key = lp.insert(peer, transport, role);
    let mut evict = None;
    if let Some(ep) = lp.state::<Meshes>().get_mut(&id) {
        ep.conns.push(key);
        ep.pending.push_back(key);
        // Work before authentication is bounded: the oldest unauthenticated connection
        // makes room for a new one.
        if ep.pending.len() > cap {
            evict = ep.pending.pop_front();
        }
    }
    if let Some(old) = evict {
        lp.stats().handshake_evictions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(driver = %lp.name(), cap, "mesh: too many unauthenticated connections; dropping the oldest");
        with_mesh(lp, old, |lp, conn| lp.close(conn, "evicted: too many unauthenticated mesh connections".into(), false));
    }
    lp.activate(key);
}

/// An outgoing connect completed.
pub(crate) fn mesh_connected(conn: &mut Conn) {
    mesh_mut(conn).connected = true;
}

/// After a mesh connection was handled: completes stream sends whose bytes are all
/// written.
pub(crate) fn mesh_after(conn: &mut Conn) {
    let Some((_, sent)) = conn.transport.send_progress().map(|p| p.write_progress()) else { return };
    let m = mesh_mut(conn);
    if m.marks.is_empty() {
        return;
    }
    while let Some(&(end, token)) = m.marks.front() {
        if end > sent {
            break;
        }
        m.marks.pop_front();
        if let Some(peer) = m.peer {
            m.shared.send_done(peer, token);
        }
    }
}

/// The connection failed: a link's peer is marked failed; while building, the failure
/// is reported (a refused connect, or a handshake closed before the lower rank answered,
/// is retried; a lower rank refusing is final). An accepted connection that fails before
/// it authenticated (garbage bytes, a stranger hanging up, a handshake timeout) is logged
/// and dropped; it never touches the mesh's links.
///
/// A link that was up and dies makes the group give up at once: the loop records the abort
/// (every wait of this rank fails naming the dead rank) and tells every other peer in the
/// same turn, before any caller of this rank wakes and takes back memory it lent, so a
/// peer READing that memory learns the cause before it sees the window gone.
pub(crate) fn mesh_failed(lp: &mut Loop, conn: &mut Conn, error: &FabricError) {
    let key = conn.key;
    let name = conn.peer.clone();
    let m = mesh_mut(conn);
    let why = match error {
        FabricError::Closed { .. } => "the connection closed without a goodbye (the process exited or was killed)".to_string(),
        other => other.to_string(),
    };
    let ep = m.ep;
    m.end_posted(&why);
    match (&m.phase, m.peer) {
        (Phase::Up, Some(peer)) => {
            if let Some(note) = m.shared.peer_failed(peer, key, why.clone()) {
                send_abort(lp, ep, Some(key), note.culprit, &note.reason);
            }
            // The receives held back by a revoked window end with the link.
            end_revoked(m, &why);
        }
        // The provider's own handshake refused the peer or was refused by it (shm: the
        // shared secret or the uid differs): trying again cannot change that, so building
        // stops now, naming why, as the mesh's own refusal over tcp does.
        (_, Some(peer)) if m.outgoing && matches!(error, FabricError::Provider { .. }) => {
            let e = MeshError::Handshake { rank: m.shared.rank, peer, addr: name, reason: why };
            m.shared.build_problem(String::new(), Some(e), None);
        }
        (_, Some(peer)) if m.outgoing && !m.connected => {
            m.shared.build_problem(format!("connecting to rank {peer} at {name}: {why}"), None, Some(peer))
        }
        // No answer yet: the listener may have dropped it (a flood of strangers made it
        // evict its oldest handshakes), so try again until the build limit.
        (Phase::Welcome(_), Some(peer)) if m.outgoing => {
            m.shared.build_problem(format!("handshake with rank {peer} at {name}: {why}"), None, Some(peer))
        }
        (_, Some(peer)) if m.outgoing => {
            let e = MeshError::Handshake { rank: m.shared.rank, peer, addr: name, reason: why };
            m.shared.build_problem(String::new(), Some(e), None);
        }
        _ => {
            tracing::warn!(rank = m.shared.rank, from = %name, reason = %why,
                "mesh: dropped an unauthenticated connection");
            m.shared.build_problem(format!("connection from {name}: {why}"), None, None)
        }
    }
    m.marks.clear();
}

/// Ends the posted receives held back by a revoked window (see [`MeshConn::revoked`]).
pub(crate) fn end_revoked(m: &mut MeshConn, why: &str) {
    if let (Some(peer), Some((_, tags))) = (m.peer, m.revoked.take()) {
        for tag in tags {
            m.shared.posted_end(peer, tag, Some(why.to_string()));
        }
    }
}

/// When a connection still in its handshake must have finished it.
pub(crate) fn mesh_deadline(conn: &Conn) -> Option<Instant> {
    let m = conn.role.get::<MeshConn>()?;
    match m.phase {
        Phase::Up | Phase::Attaching => None,
        _ => Some(m.opened + m.shared.handshake_timeout),
    }
}

/// A handshake ran past its limit: the connection fails (logged and dropped when it was
/// accepted, retried when this rank connected).
pub(crate) fn mesh_timeout(lp: &mut Loop, conn: &mut Conn, now: Instant) {
    match mesh_deadline(conn) {
        Some(d) if now >= d => {
            let limit = mesh_mut(conn).shared.handshake_timeout;
            lp.stats().handshake_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let e = FabricError::Unsupported(format!("no complete mesh handshake within {} ms", limit.as_millis()));
            lp.fail(conn, e);
        }
        _ => {}
    }
}

/// A mesh connection is gone: it leaves its endpoint's lists, and a link's peer is
/// failed if nothing said why before.
pub(crate) fn mesh_removed(lp: &mut Loop, conn: &mut Conn) {
    let key = conn.key;
    let m = mesh_mut(conn);
    if let (Phase::Up, Some(peer)) = (&m.phase, m.peer) {
        m.shared.peer_failed(peer, key, "the connection closed".into());
    }
    m.end_posted("the connection closed");
    m.end_user_reads("the connection closed");
    let ep = m.ep;
    if let Some(ep) = lp.state::<Meshes>().get_mut(&ep) {
        ep.conns.retain(|k| *k != key);
        ep.pending.retain(|k| *k != key);
    }
}

/// Refuses a handshake: tells the peer why, then closes once that is written. A refused
/// incoming connection is logged (who connected, what it claimed, why it was refused).
fn mesh_refuse(lp: &mut Loop, conn: &mut Conn, why: &str) {
    let from = conn.peer.clone();
    let m = mesh_mut(conn);
    if !m.outgoing {
        tracing::warn!(rank = m.shared.rank, %from, claimed = ?m.peer, reason = %why,
            "mesh: refused a connection");
    }
    let (f, p) = control(Kind::Refuse, 0, why.as_bytes());
    let _ = conn.transport.send(f, p);
    lp.close(conn, format!("mesh handshake refused: {why}"), true);
}
