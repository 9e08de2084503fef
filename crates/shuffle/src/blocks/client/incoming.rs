//! The client role, inside the loop: what arrives on a client connection and what the
//! session makes of it.

use super::MemWaiter;
use super::*;
use rdma_shuffle_fabric::driver::Loop;
use rdma_shuffle_fabric::driver::{Conn, ConnKey, Incoming, MsgPayload, Placement};
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::{BlockFailure, ClientEvent, FailureCode, Frame, Token};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

pub(crate) fn client_incoming(lp: &mut Loop, conn: &mut Conn, inc: Incoming) {
    let now = Instant::now();
    match inc {
        Incoming::Frame(head) => {
            client_mut(conn).stream.get_or_insert(true);
            let Some(frame) = client_decode(lp, conn, &head) else { return };
            let r = client_mut(conn).session.handle_frame(frame, now);
            client_events(lp, conn, None);
            if r.is_err() {
                client_session_failed(lp, conn);
            }
        }
        Incoming::Message(payload) => {
            client_mut(conn).stream = Some(false);
            let Some(frame) = client_decode(lp, conn, payload.head()) else { return };
            if matches!(frame, Frame::Eager { .. } | Frame::Rendezvous { .. } | Frame::BlockFailed { .. }) {
                client_answer(lp, conn);
            }
            let r = client_mut(conn).session.handle_frame(frame, now);
            client_events(lp, conn, Some(payload));
            if r.is_err() {
                client_session_failed(lp, conn);
            }
        }
        Incoming::Payload(lease) => client_payload(lp, conn, lease),
        Incoming::PayloadVec(_) => {}
        Incoming::ReadDone { tag, lease, result } => client_read_done(lp, conn, tag, lease, result),
        // Blocks land in pool buffers: the client starts no reads into user memory.
        Incoming::UserReadDone { .. } => {}
        // The data plane is up (verbs): requests held until now go out after this turn.
        Incoming::Attached => {}
    }
}

/// The frame whose fixed part arrived; a malformed one fails the connection (the session
/// reports it to the fetches waiting on it).
fn client_decode(lp: &mut Loop, conn: &mut Conn, head: &[u8]) -> Option<Frame> {
    let limits = client_mut(conn).session.limits();
    crate::blocks::codec::decode_or_fail(lp, conn, head, &limits)
}

/// An answer arrived: where answers take room in a shared receive queue (verbs), its
/// room is free again, and connections that waited for room go on.
pub(super) fn client_answer(lp: &mut Loop, conn: &mut Conn) {
    let Some(credits) = conn.transport.receive_credits() else { return };
    for k in credits.answer_arrived() {
        lp.drive_again(ConnKey::from_u64(k));
    }
}

/// The session closed after a frame: flush its `Error` for the peer, then close.
pub(super) fn client_session_failed(lp: &mut Loop, conn: &mut Conn) {
    if conn.closing.is_none() {
        client_after(lp, conn);
        lp.close(conn, "protocol error".into(), true);
    }
}

pub(super) fn client_payload(lp: &mut Loop, conn: &mut Conn, lease: Option<Lease>) {
    let ep_id = client_mut(conn).ep;
    match std::mem::replace(&mut client_mut(conn).payload, PayloadState::None) {
        PayloadState::Eager { token, sink } => {
            if let Some(sink) = sink {
                let len = lease.as_ref().map(|l| l.len()).unwrap_or(0) as u64;
                deliver_ok(lp, ep_id, sink, token.index as usize, lease, None, Path::Eager, (len, len));
            }
        }
        PayloadState::Pull { token, last, .. } => {
            let Some(lease) = lease else { return };
            let c = client_mut(conn);
            if last {
                let guard = c.pull_guards.remove(&token).flatten();
                let sink = c.sinks.get(&token.req).cloned();
                let _ = c.session.pull_complete(token, Ok(()), Instant::now());
                let len = lease.len() as u64;
                let block_len = c.block_lens.remove(&token).unwrap_or(len);
                if let Some(sink) = sink {
                    deliver_ok(lp, ep_id, sink, token.index as usize, Some(lease), guard, Path::Stream, (len, block_len));
                }
                client_events(lp, conn, None);
            } else if !c.session.is_closed() {
                c.pull_leases.insert(token, lease);
            }
        }
        PayloadState::Discard | PayloadState::None | PayloadState::NeedsMemory { .. } | PayloadState::PullNeedsMemory { .. } => {}
    }
}

pub(super) fn client_read_done(lp: &mut Loop, conn: &mut Conn, tag: u64, lease: Lease, result: Result<(), FabricError>) {
    lp.stats().note_reads(-1);
    let ep_id = client_mut(conn).ep;
    let name = clients(lp).eps.get(&ep_id).map(|e| e.config.name.clone()).unwrap_or_default();
    let c = client_mut(conn);
    let Some((token, guard, len)) = c.reads.remove(&tag) else { return };
    if c.session.is_closed() {
        // The block already failed with the connection; the buffer is free only now that
        // the device has let go of it.
        return;
    }
    let sink = c.sinks.get(&token.req).cloned();
    let now = Instant::now();
    let block_len = c.block_lens.remove(&token).unwrap_or(len);
    match result {
        Ok(()) => {
            let _ = c.session.pull_complete(token, Ok(()), now);
            if let Some(sink) = sink {
                deliver_ok(lp, ep_id, sink, token.index as usize, Some(lease), guard, Path::Read, (len, block_len));
            }
        }
        Err(e) => {
            let failure =
                BlockFailure::new(FailureCode::PullFailed, format!("{name}: read from {}: {e}", c.addr)).with_knob(e.knob());
            let _ = c.session.pull_complete(token, Err(failure), now);
        }
    }
    client_events(lp, conn, None);
}

/// Acts on the session's events. `msg` is the payload of the message just handled
/// (message transports); on a stream the payload is placed for reading instead.
pub(crate) fn client_events(lp: &mut Loop, conn: &mut Conn, msg: Option<MsgPayload>) {
    let ep_id = client_mut(conn).ep;
    let mut msg = msg;
    while let Some(ev) = client_mut(conn).session.poll_event() {
        match ev {
            ClientEvent::Connected { version, eager_threshold, credits, .. } => {
                let c = client_mut(conn);
                if !c.counted {
                    c.counted = true;
                    if let Some(ep) = clients(lp).eps.get(&ep_id) {
                        ep.stats.connections.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tracing::debug!(peer = %conn.peer, version, eager_threshold, credits, "connected");
                // Authenticated: only now may the link create a data plane (verbs: a queue
                // pair) for this peer. A block client exposes nothing: it only reads.
                if let Err(e) = lp.authenticated(conn, false) {
                    lp.fail(conn, e);
                    return;
                }
            }
            ClientEvent::Eager { token, len } => {
                let sink = client_mut(conn).sinks.get(&token.req).cloned();
                match msg.take() {
                    Some(p) => eager_message(lp, conn, token, sink, p),
                    None => eager_stream(lp, conn, token, len, sink),
                }
            }
            ClientEvent::PullData { token, offset, len, last } => match msg.take() {
                Some(p) => {
                    let c = client_mut(conn);
                    if let Some(lease) = c.pull_leases.get_mut(&token) {
                        let at = offset as usize;
                        let bytes = p.bytes();
                        if bytes.len() as u64 == len && at + bytes.len() <= lease.len() {
                            lease[at..at + bytes.len()].copy_from_slice(bytes);
                        }
                    }
                    if last {
                        if let Some(lease) = c.pull_leases.remove(&token) {
                            client_mut(conn).payload = PayloadState::Pull { token, last: true, len };
                            client_payload(lp, conn, Some(lease));
                        }
                    }
                }
                None => {
                    let c = client_mut(conn);
                    match c.pull_leases.remove(&token) {
                        Some(lease) => {
                            c.payload = PayloadState::Pull { token, last, len };
                            if let Err(e) = conn.transport.place(Placement::Into { lease, at: offset as usize }) {
                                lp.fail(conn, e);
                                return;
                            }
                        }
                        None => match c.pull_unleased.remove(&token) {
                            // Its buffer now, as eager payloads get theirs (see `pull_unleased`).
                            Some(len) => {
                                c.payload = PayloadState::PullNeedsMemory { token, len, at: offset as usize, last };
                                if !clients(lp).waiters.is_empty() || !payload_memory(lp, conn) {
                                    client_mut(conn).session.stall();
                                    clients(lp).waiters.push_back(MemWaiter { conn: conn.key, kind: MemWait::Payload });
                                    lp.want_memory();
                                }
                            }
                            None => {
                                let e = FabricError::Unsupported(format!("{}: pull data for a block with no buffer", conn.peer));
                                lp.fail(conn, e);
                                return;
                            }
                        },
                    }
                }
            },
            ClientEvent::Rendezvous { token, desc, block_len } => {
                if desc.len == 0 {
                    let c = client_mut(conn);
                    let sink = c.sinks.get(&token.req).cloned();
                    let _ = c.session.pull_complete(token, Ok(()), Instant::now());
                    if let Some(sink) = sink {
                        deliver_ok(lp, ep_id, sink, token.index as usize, None, None, Path::Read, (0, block_len));
                    }
                } else if block_len != desc.len && client_mut(conn).block_lens.insert(token, block_len).is_some() {
                    // Cannot happen (the session refuses a region announced twice).
                } else if clients(lp).waiters.is_empty() && start_pull(lp, conn, token, desc) {
                    // Started at once.
                } else {
                    clients(lp).waiters.push_back(MemWaiter { conn: conn.key, kind: MemWait::Rendezvous { token, desc } });
                    lp.want_memory();
                }
            }
            ClientEvent::Failed { token, failure } => {
                let c = client_mut(conn);
                c.pull_leases.remove(&token);
                c.pull_guards.remove(&token);
                c.pull_unleased.remove(&token);
                c.block_lens.remove(&token);
                if let Some(sink) = c.sinks.get(&token.req).cloned() {
                    deliver_err(lp, ep_id, sink, token.index as usize, failure);
                }
            }
            ClientEvent::RequestDone { req } => {
                client_mut(conn).sinks.remove(&req);
            }
            ClientEvent::Closed { error } => {
                tracing::debug!(driver = %lp.name(), peer = %conn.peer, error = %error, "client session closed");
                // An eager block whose payload never came is ours to fail.
                if let PayloadState::Eager { token, sink: Some(sink) }
                | PayloadState::NeedsMemory { token, sink: Some(sink), .. } =
                    std::mem::replace(&mut client_mut(conn).payload, PayloadState::Discard)
                {
                    let f = BlockFailure::new(
                        error.error.failure_code(),
                        format!("block {} of request {} from {}: {error}", token.index, token.req, conn.peer),
                    )
                    .with_knob(error.error.knob());
                    deliver_err(lp, ep_id, sink, token.index as usize, f);
                }
            }
        }
    }
    if client_mut(conn).session.is_closed() && conn.closing.is_none() {
        let flush = true;
        client_after(lp, conn);
        lp.close(conn, "session closed".into(), flush);
    }
}

pub(super) fn eager_message(lp: &mut Loop, conn: &mut Conn, token: Token, sink: Option<Arc<dyn BlockSink>>, p: MsgPayload) {
    let ep_id = client_mut(conn).ep;
    let Some(sink) = sink else { return };
    let bytes = p.bytes();
    if bytes.is_empty() {
        deliver_ok(lp, ep_id, sink, token.index as usize, None, None, Path::Eager, (0, 0));
        return;
    }
    let c = clients(lp);
    let Some(ep) = c.eps.get(&ep_id) else { return };
    let r = if c.waiters.is_empty() { ep.pool.try_acquire(bytes.len()) } else { Ok(None) };
    match r {
        Ok(Some(mut lease)) => {
            lease.copy_from_slice(bytes);
            let len = bytes.len() as u64;
            deliver_ok(lp, ep_id, sink, token.index as usize, Some(lease), None, Path::Eager, (len, len));
        }
        Ok(None) => {
            ep.stats.staged_payloads.fetch_add(1, Ordering::Relaxed);
            let bytes = bytes.to_vec();
            c.waiters.push_back(MemWaiter {
                conn: conn.key,
                kind: MemWait::Staged { ep: ep_id, sink, index: token.index as usize, bytes },
            });
            lp.want_memory();
        }
        Err(e) => {
            let f = pool_failure(lp, ep_id, &conn.peer, bytes.len() as u64, &e);
            deliver_err(lp, ep_id, sink, token.index as usize, f);
        }
    }
}

pub(super) fn eager_stream(lp: &mut Loop, conn: &mut Conn, token: Token, len: u32, sink: Option<Arc<dyn BlockSink>>) {
    let ep_id = client_mut(conn).ep;
    if len == 0 {
        if let Some(sink) = sink {
            deliver_ok(lp, ep_id, sink, token.index as usize, None, None, Path::Eager, (0, 0));
        }
        client_mut(conn).payload = PayloadState::Discard;
        if let Err(e) = conn.transport.place(Placement::Discard) {
            lp.fail(conn, e);
        }
        return;
    }
    client_mut(conn).payload = PayloadState::NeedsMemory { token, len, sink };
    if !clients(lp).waiters.is_empty() || !payload_memory(lp, conn) {
        client_mut(conn).session.stall();
        clients(lp).waiters.push_back(MemWaiter { conn: conn.key, kind: MemWait::Payload });
        lp.want_memory();
    }
}
