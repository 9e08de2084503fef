//! What arrives on a mesh link: handshake messages, data, rendezvous requests and their
//! completions, and the memory a payload waits for.

use super::{control, end_revoked, mesh_after, mesh_mut, mesh_refuse, MeshConn, Phase, ReadJob, RtsJob, Rx};
use crate::mesh::codec::{Head, Kind};
use crate::mesh::handshake::Reader;
use crate::mesh::link::Meshes;
use crate::mesh::shared::{bump, Counters, Dest};
use crate::mesh::{memory_advice, Body, MeshError, Message, Proto, Tag};
use rdma_shuffle_fabric::driver::Loop;
use rdma_shuffle_fabric::driver::{Conn, Incoming, MsgPayload, Placement};
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::Descriptor;

fn protocol(conn: &Conn, what: String) -> FabricError {
    FabricError::Unsupported(format!("mesh peer {}: {what}", conn.peer))
}

pub(crate) fn mesh_incoming(lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
    let r = match inc {
        Incoming::Frame(head) => mesh_frame(lp, conn, &head),
        Incoming::Payload(lease) => mesh_payload(conn, lease.map(Body::Lease).unwrap_or(Body::Empty)),
        // The mesh places no payload into a vector.
        Incoming::PayloadVec(_) => Err(protocol(conn, "a payload arrived that no frame announced".into())),
        Incoming::Message(p) => mesh_message(lp, conn, p),
        Incoming::ReadDone { tag, lease, result } => mesh_read_done(lp, conn, tag, lease, result),
        Incoming::UserReadDone { tag, result, .. } => mesh_user_read_done(lp, conn, tag, result),
        Incoming::Attached => {
            mesh_up(lp, conn);
            Ok(())
        }
    };
    if let Err(e) = r {
        lp.fail(conn, e);
    }
}

/// A frame's fixed part, decoded with the link's codec.
fn decode<'a>(conn: &Conn, head: &'a [u8]) -> Result<Head<'a>, FabricError> {
    let m = conn.role.get::<MeshConn>().ok_or_else(|| protocol(conn, "not a mesh link".into()))?;
    m.codec.decode(head).map_err(|e| FabricError::Frame { peer: conn.peer.clone(), source: Box::new(e) })
}

/// (stream) A frame's fixed part: a control message is whole; a data frame's payload is
/// placed.
fn mesh_frame(lp: &mut Loop, conn: &mut Conn, head: &[u8]) -> Result<(), FabricError> {
    let up = matches!(mesh_mut(conn).phase, Phase::Up);
    let h = decode(conn, head)?;
    match h.kind {
        Kind::Data if up => mesh_data_frame(lp, conn, h.tag, Proto::Eager, h.len),
        Kind::Bulk if up => mesh_data_frame(lp, conn, h.tag, Proto::Rendezvous, h.len),
        Kind::Data | Kind::Bulk => Err(protocol(conn, format!("a {:?} frame before the handshake completed", h.kind))),
        kind => mesh_control(lp, conn, kind, h.tag, h.body),
    }
}

/// (stream) A data frame: its payload goes into a pool buffer of its size.
fn mesh_data_frame(lp: &mut Loop, conn: &mut Conn, tag: Tag, proto: Proto, len: u64) -> Result<(), FabricError> {
    let folds = conn.transport.capabilities().folds.admits(len);
    let m = mesh_mut(conn);
    let peer = m.peer.unwrap_or(0);
    let limit = if proto == Proto::Eager { m.shared.eager_limit } else { m.shared.max_message } as u64;
    if len > limit {
        return Err(protocol(conn, format!("a {proto} message of {len} bytes above the limit of {limit}")));
    }
    if len == 0 {
        let slot = m.shared.open_slot(peer, tag);
        m.rx = Some(Rx { tag, slot, proto, len, folded: false });
        return conn.transport.place(Placement::Discard);
    }
    match m.shared.open_slot_or_claim(peer, tag, len, false, folds) {
        Dest::Posted(dst, _, fold) => {
            m.rx = Some(Rx { tag, slot: 0, proto, len, folded: fold.is_some() });
            conn.transport.place(match fold {
                Some(fold) => Placement::Fold { dst, fold },
                None => Placement::User(dst),
            })
        }
        Dest::Slot(slot) => mesh_place(lp, conn, Rx { tag, slot, proto, len, folded: false }),
    }
}

/// Places a data payload into a pool buffer, or parks the link until memory comes back.
fn mesh_place(lp: &mut Loop, conn: &mut Conn, rx: Rx) -> Result<(), FabricError> {
    let len = rx.len;
    let m = mesh_mut(conn);
    let peer = m.peer.unwrap_or(0);
    match m.shared.pool.try_acquire(len as usize) {
        Ok(Some(lease)) => {
            m.shared.memory_wait(peer, None);
            m.rx = Some(rx);
            conn.transport.place(Placement::Into { lease, at: 0 })
        }
        Ok(None) => {
            m.shared.memory_wait(peer, Some(len));
            m.starved = Some(rx);
            lp.park_for_memory(conn.key);
            Ok(())
        }
        Err(e) => Err(FabricError::Unsupported(memory_advice(&e))),
    }
}

/// (stream) A data payload is complete.
fn mesh_payload(conn: &mut Conn, body: Body) -> Result<(), FabricError> {
    let m = mesh_mut(conn);
    let Some(Rx { tag, slot, proto, len, folded }) = m.rx.take() else {
        return Err(protocol(conn, "a payload arrived that no frame announced".into()));
    };
    let peer = m.peer.unwrap_or(0);
    let c = &m.shared.counters;
    count_received(c, proto, len);
    if slot == 0 {
        // Placed into the receive posted for it.
        bump(&c.placed, 1);
        bump(&c.placed_bytes, len);
        if folded {
            bump(&c.folded, 1);
            bump(&c.folded_bytes, len);
        }
        m.shared.posted_end(peer, tag, None);
        return Ok(());
    }
    if len > 0 {
        bump(&c.staged, 1);
        bump(&c.staged_bytes, len);
    }
    m.shared.fill_slot(peer, tag, slot, Message { body, proto });
    Ok(())
}

/// A data message of `len` bytes was received.
fn count_received(c: &Counters, proto: Proto, len: u64) {
    if proto == Proto::Eager {
        bump(&c.eager_received, 1);
        bump(&c.eager_received_bytes, len);
    } else {
        bump(&c.rendezvous_received, 1);
        bump(&c.rendezvous_received_bytes, len);
    }
}

/// (messages) A whole frame and its payload.
fn mesh_message(lp: &mut Loop, conn: &mut Conn, p: MsgPayload) -> Result<(), FabricError> {
    let h = decode(conn, p.head())?;
    let (kind, tag, len) = (h.kind, h.tag, h.len);
    let up = matches!(mesh_mut(conn).phase, Phase::Up);
    let proto = match kind {
        Kind::Data if up => Proto::Eager,
        Kind::Bulk if up => Proto::Rendezvous,
        Kind::Data | Kind::Bulk => return Err(protocol(conn, format!("a {kind:?} frame before the handshake completed"))),
        _ => return mesh_control(lp, conn, kind, tag, h.body),
    };
    let m = mesh_mut(conn);
    let peer = m.peer.unwrap_or(0);
    let c = &m.shared.counters;
    count_received(c, proto, len);
    let (buf, at) = p.into_parts();
    let body = if len == 0 { Body::Empty } else { Body::Bytes(buf, at) };
    m.shared.push_ready(peer, tag, Message { body, proto });
    Ok(())
}

/// A whole control or handshake message.
fn mesh_control(lp: &mut Loop, conn: &mut Conn, kind: Kind, req: u64, body: &[u8]) -> Result<(), FabricError> {
    let name = conn.peer.clone();
    let m = mesh_mut(conn);
    let phase = std::mem::replace(&mut m.phase, Phase::Attaching);
    match (phase, kind) {
        (Phase::Hello, Kind::Hello) => {
            let hs = m.shared.hs.clone();
            match hs.server_hello(body) {
                Ok((state, welcome)) => {
                    let from = state.from;
                    m.peer = Some(from);
                    m.phase = Phase::Proof(state);
                    let (f, p) = control(Kind::Welcome, 0, &welcome);
                    conn.transport.send(f, p)?;
                    let _ = from;
                }
                Err((_, why)) => {
                    m.phase = Phase::Hello;
                    m.shared.build_problem(format!("connection from {name}: {why}"), None, None);
                    mesh_refuse(lp, conn, &why);
                }
            }
            Ok(())
        }
        (Phase::Proof(state), Kind::Proof) => {
            let hs = m.shared.hs.clone();
            match hs.server_proof(&state, body) {
                Ok(()) => {
                    let (f, p) = control(Kind::Ready, 0, &[]);
                    conn.transport.send(f, p)?;
                    // The peer proved the secret (or none is required).
                    mesh_authenticated(lp, conn)
                }
                Err(why) => {
                    m.phase = Phase::Hello;
                    let problem = format!("connection from {name} claiming rank {}: {why}", state.from);
                    m.shared.build_problem(problem, None, None);
                    mesh_refuse(lp, conn, &why);
                    Ok(())
                }
            }
        }
        (Phase::Welcome(state), Kind::Welcome) => {
            let hs = m.shared.hs.clone();
            match hs.client_welcome(&state, body) {
                Ok(proof) => {
                    m.phase = Phase::Ready;
                    let (f, p) = control(Kind::Proof, 0, &proof);
                    conn.transport.send(f, p)
                }
                Err(why) => {
                    let peer = m.peer.unwrap_or(0);
                    let rank = m.shared.rank;
                    let e = MeshError::Handshake { rank, peer, addr: name.clone(), reason: why.clone() };
                    m.shared.build_problem(String::new(), Some(e), None);
                    mesh_refuse(lp, conn, &format!("rank {rank} refused rank {peer}: {why}"));
                    Ok(())
                }
            }
        }
        (Phase::Ready, Kind::Ready) => mesh_authenticated(lp, conn),
        (phase, Kind::Refuse) => {
            let why = String::from_utf8_lossy(body).into_owned();
            let outgoing = m.outgoing;
            m.phase = phase;
            if let (true, Some(peer)) = (outgoing, m.peer) {
                let e = MeshError::Handshake { rank: m.shared.rank, peer, addr: name.clone(), reason: format!("refused: {why}") };
                m.shared.build_problem(String::new(), Some(e), None);
            } else {
                // It would not prove itself to this rank (it has another secret).
                tracing::warn!(rank = m.shared.rank, from = %name, claimed = ?m.peer, reason = %why,
                    "mesh: a connecting peer gave up its handshake");
                m.shared.build_problem(format!("connection from {name}: refused: {why}"), None, None);
            }
            lp.close(conn, format!("refused by the peer: {why}"), false);
            Ok(())
        }
        (Phase::Up, Kind::Rts) => {
            m.phase = Phase::Up;
            mesh_rts(lp, conn, req, body)
        }
        (Phase::Up, Kind::Done) => {
            m.phase = Phase::Up;
            if let Some(rkey) = m.exposures.remove(&req) {
                conn.transport.revoke(rkey);
            }
            let m = mesh_mut(conn);
            if let Some(peer) = m.peer {
                m.shared.send_done(peer, req);
            }
            Ok(())
        }
        (Phase::Up, Kind::Abort) => {
            m.phase = Phase::Up;
            let (culprit, reason) = match body.split_first_chunk::<4>() {
                Some((c, rest)) => (u32::from_be_bytes(*c), rest),
                None => (u32::MAX, body),
            };
            let culprit = (culprit != u32::MAX).then_some(culprit as usize);
            if let Some(peer) = m.peer {
                m.shared.aborted(peer, culprit, String::from_utf8_lossy(reason).into_owned());
            }
            // A window of this peer was found taken back: the abort that explains it is
            // here, so the link fails now (its waits report the abort, recorded first).
            if let Some((why, _)) = &m.revoked {
                let why = why.clone();
                end_revoked(m, &why);
                return Err(FabricError::Unsupported(format!("the peer aborted after taking back a window ({why})")));
            }
            Ok(())
        }
        (Phase::Up, Kind::Bye) => {
            m.phase = Phase::Up;
            // What the peer acknowledged before its goodbye (over shm, the acknowledgement
            // of a borrowed send may have been read in this same look) completes first:
            // a send it read is done, not failed by its departure.
            mesh_after(conn);
            let m = mesh_mut(conn);
            // Left first, so a receive the goodbye ends reports the peer left.
            if let Some(peer) = m.peer {
                m.shared.peer_left(peer);
            }
            m.end_posted("the peer closed its mesh");
            // Nothing more comes on this link.
            lp.close(conn, "the peer closed its mesh".into(), false);
            Ok(())
        }
        (phase, kind) => {
            let what = match &phase {
                Phase::Up => "after the handshake",
                _ => "during the handshake",
            };
            m.phase = phase;
            Err(protocol(conn, format!("unexpected mesh message {kind:?} {what}")))
        }
    }
}

/// The peer authenticated: the loop tells the link, which attaches its data plane first
/// where it has one (verbs; then `Attached` brings the link up), or the link is up.
fn mesh_authenticated(lp: &mut Loop, conn: &mut Conn) -> Result<(), FabricError> {
    // Both sides of a mesh link send rendezvous messages: both expose regions to the peer.
    if lp.authenticated(conn, true)? {
        mesh_up(lp, conn);
    } else {
        mesh_mut(conn).phase = Phase::Attaching;
    }
    Ok(())
}

/// The link is up: messages may flow.
fn mesh_up(lp: &mut Loop, conn: &mut Conn) {
    let key = conn.key;
    let name = conn.peer.clone();
    let m = mesh_mut(conn);
    let Some(peer) = m.peer else { return };
    m.phase = Phase::Up;
    m.codec.up();
    let ep = m.ep;
    let fresh = m.shared.peer_up(peer, key, name);
    if let Some(ep) = lp.state::<Meshes>().get_mut(&ep) {
        ep.pending.retain(|k| *k != key);
    }
    if !fresh {
        tracing::warn!(rank = mesh_mut(conn).shared.rank, peer, "second connection from the same rank; dropping it");
        mesh_mut(conn).phase = Phase::Attaching;
        lp.close(conn, "a second link to the same rank".into(), false);
    }
}

/// A one-sided rendezvous request: its slot keeps its place; the READ starts when memory
/// and the read caps allow.
fn mesh_rts(lp: &mut Loop, conn: &mut Conn, tag: Tag, body: &[u8]) -> Result<(), FabricError> {
    let mut r = Reader(body);
    let parsed = (|| Ok::<_, String>((r.u64()?, r.u32()?, r.u64()?, r.u64()?)))();
    let (addr, rkey, len, token) = parsed.map_err(|e| protocol(conn, format!("bad rendezvous request: {e}")))?;
    let max = mesh_mut(conn).shared.max_message;
    if len > max as u64 {
        return Err(protocol(conn, format!("a rendezvous message of {len} bytes above the limit {max}")));
    }
    let m = mesh_mut(conn);
    let peer = m.peer.unwrap_or(0);
    if len == 0 {
        let slot = m.shared.open_slot(peer, tag);
        bump(&m.shared.counters.rendezvous_received, 1);
        m.shared.fill_slot(peer, tag, slot, Message { body: Body::Empty, proto: Proto::Rendezvous });
        let (f, p) = control(Kind::Done, token, &[]);
        return conn.transport.send(f, p);
    }
    // A receive posted for it, with the key to write its memory, takes the READ straight in.
    let (slot, user) = match m.shared.open_slot_or_claim(peer, tag, len, true, false) {
        Dest::Posted(buf, Some(lkey), None) => (0, Some((buf, lkey))),
        Dest::Posted(..) => {
            m.shared.posted_end(peer, tag, Some("claimed for a READ without a write key".into()));
            return Err(protocol(conn, "internal: a posted receive was claimed for a READ without its write key".into()));
        }
        Dest::Slot(id) => (id, None),
    };
    m.rts.push_back(RtsJob { tag, slot, token, desc: Descriptor { region: token, addr, len, rkey }, user });
    mesh_pump_reads(lp, conn)
}

/// Starts the READs of waiting rendezvous requests, in order, while memory and the
/// provider's read caps allow.
pub(crate) fn mesh_pump_reads(lp: &mut Loop, conn: &mut Conn) -> Result<(), FabricError> {
    loop {
        if !conn.transport.one_sided().is_some_and(|o| o.can_read()) {
            return Ok(());
        }
        let m = mesh_mut(conn);
        let Some(job) = m.rts.front() else { return Ok(()) };
        let peer = m.peer.unwrap_or(0);
        let len = job.desc.len;
        if job.user.is_some() {
            // Straight into the posted receive's registered memory: no pool buffer.
            let Some(job) = m.rts.pop_front() else { return Ok(()) };
            let read_tag = start_job(m, &job);
            let Some((buf, lkey)) = job.user else { return Ok(()) };
            let started = match conn.transport.one_sided() {
                Some(o) => o.start_read_user(read_tag, &job.desc, buf, lkey),
                None => Err(FabricError::Unsupported("this provider has no one-sided read".into())),
            };
            if let Err(e) = started {
                let m = mesh_mut(conn);
                m.reads.remove(&read_tag);
                m.shared.posted_end(peer, job.tag, Some(e.to_string()));
                return Err(e);
            }
            lp.stats().note_reads(1);
            continue;
        }
        let lease = match m.shared.pool.try_acquire(len as usize) {
            Ok(Some(l)) => l,
            Ok(None) => {
                m.shared.memory_wait(peer, Some(len));
                lp.park_for_memory(conn.key);
                return Ok(());
            }
            Err(e) => return Err(FabricError::Unsupported(memory_advice(&e))),
        };
        m.shared.memory_wait(peer, None);
        let Some(job) = m.rts.pop_front() else { return Ok(()) };
        let read_tag = start_job(m, &job);
        let started = match conn.transport.one_sided() {
            Some(o) => o.start_read(read_tag, &job.desc, lease),
            None => Err(Box::new((lease, FabricError::Unsupported("this provider has no one-sided read".into())))),
        };
        if let Err(failed) = started {
            let (_lease, e) = *failed;
            return Err(e);
        }
        lp.stats().note_reads(1);
    }
}

/// Files `job` as a READ in flight; its read tag.
fn start_job(m: &mut MeshConn, job: &RtsJob) -> u64 {
    let read_tag = m.next_read;
    m.next_read += 1;
    m.reads.insert(read_tag, ReadJob { tag: job.tag, slot: job.slot, token: job.token, len: job.desc.len, unposted: None });
    read_tag
}

/// Counts a rendezvous message of `len` bytes READ: `placed` into a posted receive, else
/// staged in a pool buffer.
fn count_read(c: &Counters, len: u64, placed: bool) {
    bump(&c.reads, 1);
    bump(&c.rendezvous_received, 1);
    bump(&c.rendezvous_received_bytes, len);
    if placed {
        bump(&c.placed, 1);
        bump(&c.placed_bytes, len);
    } else {
        bump(&c.staged, 1);
        bump(&c.staged_bytes, len);
    }
}

fn mesh_read_done(
    lp: &mut Loop,
    conn: &mut Conn,
    read_tag: u64,
    lease: Lease,
    result: Result<(), FabricError>,
) -> Result<(), FabricError> {
    lp.stats().note_reads(-1);
    let m: &mut MeshConn = mesh_mut(conn);
    let Some(job) = m.reads.remove(&read_tag) else { return Ok(()) };
    if let Err(e) = result {
        return hold_revoked(m, e, None);
    }
    let peer = m.peer.unwrap_or(0);
    count_read(&m.shared.counters, job.len, false);
    m.shared.fill_slot(peer, job.tag, job.slot, Message { body: Body::Lease(lease), proto: Proto::Rendezvous });
    let (f, p) = control(Kind::Done, job.token, &[]);
    conn.transport.send(f, p)?;
    mesh_pump_reads(lp, conn)
}

/// A READ failed. A window the peer took back ([`FabricError::RemoteAccess`]) before its
/// abort reached this rank holds the receive (`posted`) until the abort or the link's end
/// ([`MeshConn::revoked`]); any other failure fails the link at once.
fn hold_revoked(m: &mut MeshConn, e: FabricError, posted: Option<Tag>) -> Result<(), FabricError> {
    let peer = m.peer.unwrap_or(0);
    if !matches!(e, FabricError::RemoteAccess { .. }) || m.shared.lock().abort.is_some() {
        if let Some(tag) = posted {
            m.shared.posted_end(peer, tag, Some(e.to_string()));
        }
        return Err(e);
    }
    let held = m.revoked.get_or_insert_with(|| (e.to_string(), Vec::new()));
    held.1.extend(posted);
    Ok(())
}

/// A READ into a posted receive's memory completed (or was flushed): the memory is the
/// caller's again. A failed one fails the receive, then the link.
fn mesh_user_read_done(
    lp: &mut Loop,
    conn: &mut Conn,
    read_tag: u64,
    result: Result<(), FabricError>,
) -> Result<(), FabricError> {
    lp.stats().note_reads(-1);
    let m: &mut MeshConn = mesh_mut(conn);
    let Some(job) = m.reads.remove(&read_tag) else { return Ok(()) };
    let peer = m.peer.unwrap_or(0);
    if let Some(reply) = job.unposted {
        // Its caller gave it up and waits until the device is done with the memory.
        let _ = reply.send(());
    }
    if let Err(e) = result {
        return hold_revoked(m, e, Some(job.tag));
    }
    count_read(&m.shared.counters, job.len, true);
    m.shared.posted_end(peer, job.tag, None);
    let (f, p) = control(Kind::Done, job.token, &[]);
    conn.transport.send(f, p)?;
    mesh_pump_reads(lp, conn)
}

// ------------------------------------------------------------------ memory

/// Memory came back after the link parked for it: the payload it stopped at is placed,
/// waiting READs start (or it parks again).
pub(crate) fn mesh_memory(lp: &mut Loop, conn: &mut Conn) {
    let mut r = Ok(());
    if let Some(rx) = mesh_mut(conn).starved.take() {
        r = mesh_place(lp, conn, rx);
    }
    if r.is_ok() && mesh_mut(conn).starved.is_none() {
        r = mesh_pump_reads(lp, conn);
    }
    if let Err(e) = r {
        lp.fail(conn, e);
    }
}
