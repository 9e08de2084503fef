//! The client role, inside the loop: blocks waiting for local memory, the start of pulls,
//! and deliveries.

use super::MemWaiter;
use super::*;
use crate::blocks::budget::BudgetGuard;
use rdma_shuffle_fabric::driver::Loop;
use rdma_shuffle_fabric::driver::{Conn, Placement};
use rdma_shuffle_fabric::memory::pool::Lease;
use rdma_shuffle_wire::frame::MAX_PULL_CHUNK;
use rdma_shuffle_wire::{BlockFailure, Descriptor, FailureCode, Token};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Tries to give a stopped stream connection the buffer its payload needs. `true` when
/// the connection can read on (buffer placed, or the block failed and its payload is
/// skipped).
pub(super) fn payload_memory(lp: &mut Loop, conn: &mut Conn) -> bool {
    let ep_id = client_mut(conn).ep;
    let (token, len) = match client_mut(conn).payload {
        PayloadState::NeedsMemory { token, len, .. } => (token, len as usize),
        PayloadState::PullNeedsMemory { token, len, .. } => (token, len),
        _ => return true,
    };
    let Some(ep) = clients(lp).eps.get(&ep_id) else { return true };
    let placement = match ep.pool.try_acquire(len) {
        Ok(Some(lease)) => match std::mem::replace(&mut client_mut(conn).payload, PayloadState::None) {
            PayloadState::NeedsMemory { sink, .. } => {
                client_mut(conn).payload = PayloadState::Eager { token, sink };
                Placement::Into { lease, at: 0 }
            }
            PayloadState::PullNeedsMemory { at, last, len, .. } => {
                client_mut(conn).payload = PayloadState::Pull { token, last, len: len.saturating_sub(at) as u64 };
                Placement::Into { lease, at }
            }
            _ => return true,
        },
        Ok(None) => return false,
        Err(e) => {
            let f = pool_failure(lp, ep_id, &conn.peer, len as u64, &e);
            match std::mem::replace(&mut client_mut(conn).payload, PayloadState::Discard) {
                PayloadState::NeedsMemory { sink: Some(sink), .. } => deliver_err(lp, ep_id, sink, token.index as usize, f),
                PayloadState::PullNeedsMemory { .. } => {
                    // A pull is one chunk (see `start_pull`): its bytes are skipped and the
                    // block fails; the region is released as for any failed pull.
                    let c = client_mut(conn);
                    c.pull_guards.remove(&token);
                    let _ = c.session.pull_complete(token, Err(f), Instant::now());
                    c.session.unstall(Instant::now());
                    if let Err(e) = conn.transport.place(Placement::Discard) {
                        lp.fail(conn, e);
                    }
                    client_events(lp, conn, None);
                    return true;
                }
                _ => {}
            }
            Placement::Discard
        }
    };
    client_mut(conn).session.unstall(Instant::now());
    if let Err(e) = conn.transport.place(placement) {
        lp.fail(conn, e);
    }
    true
}

/// Starts the pull of a rendezvous block if its budget and buffer can be had now.
pub(super) fn start_pull(lp: &mut Loop, conn: &mut Conn, token: Token, desc: Descriptor) -> bool {
    let ep_id = client_mut(conn).ep;
    if clients_ref(lp).and_then(|c| c.eps.get(&ep_id)).is_none() {
        return true;
    }
    if !conn.transport.one_sided().is_none_or(|o| o.can_read()) {
        // A cap on reads in flight (per queue pair, per engine): wait like for memory.
        return false;
    }
    let Some(ep) = clients(lp).eps.get(&ep_id) else { return true };
    let len = desc.len as usize;
    // Budget what the pool will really hand out (tier-rounded), or the budget would let
    // more pool memory into flight than it means to.
    let tier = ep.pool.tier_capacity_for(len);
    let cost = tier.unwrap_or(len) as u64;
    let Some(guard) = ep.budget.try_acquire(cost) else { return false };
    let one_sided = conn.transport.capabilities().one_sided;
    if !one_sided && client_mut(conn).stream == Some(true) && tier.is_some() && desc.len <= MAX_PULL_CHUNK {
        // A stream: the buffer is taken when the bytes arrive (see `pull_unleased`). A
        // tier's buffer never exceeds the pool's cap, and a region up to a chunk comes in one
        // `PullData`, so a pool failure then fails this block alone.
        let c = client_mut(conn);
        if c.session.send_pull(token, Instant::now()).is_ok() {
            c.pull_unleased.insert(token, len);
            c.pull_guards.insert(token, Some(guard));
        }
        return true;
    }
    let lease = match ep.pool.try_acquire(len) {
        Ok(Some(l)) => l,
        Ok(None) => return false,
        Err(e) => {
            let f = pool_failure(lp, ep_id, &conn.peer, desc.len, &e);
            let _ = client_mut(conn).session.pull_complete(token, Err(f), Instant::now());
            client_events(lp, conn, None);
            return true;
        }
    };
    let now = Instant::now();
    if one_sided {
        let c = client_mut(conn);
        let tag = c.next_tag;
        c.next_tag += 1;
        c.reads.insert(tag, (token, Some(guard), desc.len));
        let started = match conn.transport.one_sided() {
            Some(o) => o.start_read(tag, &desc, lease),
            None => Err(Box::new((lease, FabricError::Unsupported("this provider has no one-sided read".into())))),
        };
        match started {
            Ok(()) => {
                lp.stats().note_reads(1);
                let _ = client_mut(conn).session.pull_started(token, now);
            }
            Err(failed) => {
                let (_lease, e) = *failed;
                client_mut(conn).reads.remove(&tag);
                let f = BlockFailure::new(FailureCode::PullFailed, format!("read from {}: {e}", conn.peer)).with_knob(e.knob());
                let _ = client_mut(conn).session.pull_complete(token, Err(f), now);
                client_events(lp, conn, None);
            }
        }
    } else {
        let c = client_mut(conn);
        if c.session.send_pull(token, now).is_ok() {
            c.pull_leases.insert(token, lease);
            c.pull_guards.insert(token, Some(guard));
        }
    }
    true
}

pub(super) fn pool_failure(
    lp: &Loop,
    ep_id: u64,
    peer: &str,
    len: u64,
    e: &rdma_shuffle_fabric::memory::pool::PoolError,
) -> BlockFailure {
    let name = clients_ref(lp).and_then(|c| c.eps.get(&ep_id)).map(|e| e.config.name.as_str()).unwrap_or("client");
    BlockFailure::new(FailureCode::PoolExhausted, format!("{name}: no buffer for a {len}-byte block from {peer}: {e}"))
        .with_knob(e.knob())
}

/// Serves blocks waiting for memory, in order, as far as memory allows; whether some still
/// wait.
pub(crate) fn serve_waiters(lp: &mut Loop) -> bool {
    let mut waiters = std::mem::take(&mut clients(lp).waiters);
    let mut kept = std::collections::VecDeque::new();
    while let Some(w) = waiters.pop_front() {
        if let Some(w) = serve(lp, w) {
            kept.push_back(w);
        }
    }
    kept.extend(clients(lp).waiters.drain(..));
    clients(lp).waiters = kept;
    !clients(lp).waiters.is_empty()
}

/// Tries one waiter; gives it back if it must go on waiting.
pub(super) fn serve(lp: &mut Loop, w: MemWaiter) -> Option<MemWaiter> {
    match w.kind {
        MemWait::Staged { ep, sink, index, bytes } => {
            let Some(e) = clients(lp).eps.get(&ep) else {
                let f = BlockFailure::new(FailureCode::PeerGone, "the client endpoint was shut down");
                deliver(lp, (sink, index, Err(f)));
                return None;
            };
            match e.pool.try_acquire(bytes.len()) {
                Ok(Some(mut lease)) => {
                    lease.copy_from_slice(&bytes);
                    let len = bytes.len() as u64;
                    deliver_ok(lp, ep, sink, index, Some(lease), None, Path::Eager, (len, len));
                    None
                }
                Ok(None) => Some(MemWaiter { conn: w.conn, kind: MemWait::Staged { ep, sink, index, bytes } }),
                Err(err) => {
                    let f = pool_failure(lp, ep, "a peer", bytes.len() as u64, &err);
                    deliver_err(lp, ep, sink, index, f);
                    None
                }
            }
        }
        MemWait::Rendezvous { token, desc } => {
            let mut conn = lp.take(w.conn)?;
            let keep = if conn.closing.is_some() || client_mut(&mut conn).session.is_closed() {
                false
            } else {
                !start_pull(lp, &mut conn, token, desc)
            };
            let key = conn.key;
            lp.put(conn);
            if !keep {
                // A read that completed at once (sim) waits in the transport.
                lp.drive_again(key);
            }
            keep.then_some(MemWaiter { conn: w.conn, kind: MemWait::Rendezvous { token, desc } })
        }
        MemWait::Payload => {
            let mut conn = lp.take(w.conn)?;
            let done = conn.closing.is_some() || payload_memory(lp, &mut conn);
            let key = conn.key;
            lp.put(conn);
            if done {
                lp.drive_again(key);
                None
            } else {
                Some(MemWaiter { conn: w.conn, kind: MemWait::Payload })
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn deliver_ok(
    lp: &Loop,
    ep_id: u64,
    sink: Arc<dyn BlockSink>,
    index: usize,
    lease: Option<Lease>,
    guard: Option<BudgetGuard>,
    path: Path,
    (len, block_len): (u64, u64),
) {
    if let Some(ep) = clients_ref(lp).and_then(|c| c.eps.get(&ep_id)) {
        let s = &ep.stats;
        s.blocks_fetched.fetch_add(1, Ordering::Relaxed);
        s.bytes_fetched.fetch_add(len, Ordering::Relaxed);
        match path {
            Path::Eager => {
                s.eager_blocks.fetch_add(1, Ordering::Relaxed);
                s.eager_bytes.fetch_add(len, Ordering::Relaxed);
            }
            Path::Read | Path::Stream => {
                s.rendezvous_blocks.fetch_add(1, Ordering::Relaxed);
                s.rendezvous_bytes.fetch_add(len, Ordering::Relaxed);
                if path == Path::Read {
                    s.one_sided_reads.fetch_add(1, Ordering::Relaxed);
                    s.read_bytes.fetch_add(len, Ordering::Relaxed);
                } else {
                    s.stream_pulls.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    deliver(lp, (sink, index, Ok(FetchedBlock { lease, _budget: guard, block_len })));
}

pub(super) fn deliver_err(lp: &Loop, ep_id: u64, sink: Arc<dyn BlockSink>, index: usize, failure: BlockFailure) {
    if let Some(ep) = clients_ref(lp).and_then(|c| c.eps.get(&ep_id)) {
        ep.stats.failed_blocks.fetch_add(1, Ordering::Relaxed);
        ep.stats.failed_by_code[code_index(failure.code)].fetch_add(1, Ordering::Relaxed);
    }
    deliver(lp, (sink, index, Err(failure)));
}
