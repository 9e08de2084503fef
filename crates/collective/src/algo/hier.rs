//! Hierarchical collectives, for ranks spread over hosts with several ranks on some of them
//! (NCCL's, Open MPI HAN's and UCC's shape). The allreduce:
//!
//! 1. **reduce inside each host** to its leader (the host's lowest rank), a pipelined
//!    binomial tree over the same-host links (steps from 0);
//! 2. **allreduce among the leaders**, one per host, with the flat algorithm the policy chose
//!    for that many ranks over the network links (steps from 1);
//! 3. **broadcast inside each host** from the leader (steps from [`MAX_STEP`], above any step
//!    of phase 2).
//!
//! Each phase runs the flat algorithms unchanged in a view of the ranks it involves
//! ([`Ctx::view`]). Hosts may have different numbers of ranks, and a host's ranks need not be
//! consecutive. Bytes cross the network once per host instead of once per rank. Allgather and
//! reduce-scatter have the same three phases (gather or reduce to the leader, the leaders' ring
//! over whole hosts' blocks, broadcast or scatter from the leader).

use super::{reducing, rooted, Ctx, MAX_STEP};
use crate::error::CollectiveError;
use crate::policy::{Algo, Topology};
use crate::transport::Transport;

/// Hierarchical allreduce of `count` elements in place; `inner` is the leaders' algorithm.
pub(crate) fn allreduce_hier<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    count: usize,
    topo: &Topology,
    inner: Algo,
) -> Result<(), CollectiveError> {
    let len = count * ctx.elem();
    let me = ctx.rank;
    let local = topo.members(topo.host_of[me]);
    let leaders = topo.leaders();
    if local.len() > 1 {
        ctx.view(&local, 0);
        rooted::reduce_tree(ctx, buf, len, 0)?;
    }
    if local[0] == me && leaders.len() > 1 {
        ctx.view(&leaders, 1);
        match inner {
            Algo::RecursiveDoubling => reducing::allreduce_rd(ctx, buf, count)?,
            Algo::HalvingDoubling => reducing::allreduce_rhd(ctx, buf, count)?,
            _ => reducing::allreduce_ring(ctx, buf, count)?,
        }
    }
    if local.len() > 1 {
        ctx.view(&local, MAX_STEP);
        rooted::broadcast_tree(ctx, buf, len, 0)?;
    }
    ctx.finish()
}

/// Rank order → host order: the position of each rank when hosts' ranks are laid out host
/// after host (each host's ranks in rank order), and each host's byte span of `cb`-byte
/// blocks in that layout.
fn packing(topo: &Topology, cb: usize) -> (Vec<usize>, Vec<(usize, usize)>) {
    let mut pos = vec![0; topo.host_of.len()];
    let mut spans = Vec::with_capacity(topo.hosts());
    let mut at = 0;
    for h in 0..topo.hosts() {
        let m = topo.members(h);
        for (i, &r) in m.iter().enumerate() {
            pos[r] = at + i;
        }
        spans.push((at * cb, m.len() * cb));
        at += m.len();
    }
    (pos, spans)
}

/// Hierarchical allgather of `p` blocks of `count` elements in `buf` (this rank's block
/// already at position `rank`): each host's blocks are gathered at its leader, in host
/// order; the leaders run a ring allgather of whole hosts' blocks (hosts of different sizes
/// give blocks of different sizes); each leader broadcasts the whole result inside its host.
pub(crate) fn allgather_hier<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    count: usize,
    topo: &Topology,
) -> Result<(), CollectiveError> {
    let (me, p) = (ctx.rank, ctx.world);
    let cb = count * ctx.elem();
    let (pos, spans) = packing(topo, cb);
    let host = topo.host_of[me];
    let local = topo.members(host);
    let leaders = topo.leaders();
    let packed = ctx.scratch(p * cb);
    ctx.register(packed, p * cb)?;
    ctx.register(buf, p * cb)?;
    // SAFETY (every `add`): block offsets inside the `p`-block buffers.
    ctx.view(&local, 0);
    if local[0] == me {
        unsafe { std::ptr::copy_nonoverlapping(buf.add(me * cb), packed.add(pos[me] * cb), cb) };
        for (v, &r) in local.iter().enumerate().skip(1) {
            ctx.recv_copy_all(v, 0, unsafe { packed.add(pos[r] * cb) }, cb)?;
        }
    } else {
        ctx.send_all(0, 0, unsafe { buf.add(me * cb) }, cb)?;
    }
    if local[0] == me && leaders.len() > 1 {
        ctx.view(&leaders, 1);
        ctx.ring_pass(packed, &spans, host, 0, false, true, false)?;
    }
    if local.len() > 1 {
        ctx.view(&local, MAX_STEP);
        rooted::broadcast_tree(ctx, packed, p * cb, 0)?;
    }
    ctx.finish()?;
    for (r, &at) in pos.iter().enumerate() {
        unsafe { std::ptr::copy_nonoverlapping(packed.add(at * cb), buf.add(r * cb), cb) };
    }
    Ok(())
}

/// Hierarchical reduce-scatter on `work` (this rank's whole input, `p` blocks of `count`
/// elements; afterwards block `rank` of `work` is the result): the input laid out host after
/// host, reduced inside each host to its leader; the leaders run a ring reduce-scatter of
/// whole hosts' blocks; each leader sends every rank of its host its block.
pub(crate) fn reduce_scatter_hier<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    work: *mut u8,
    count: usize,
    topo: &Topology,
) -> Result<(), CollectiveError> {
    let (me, p) = (ctx.rank, ctx.world);
    let cb = count * ctx.elem();
    let (pos, spans) = packing(topo, cb);
    let host = topo.host_of[me];
    let (local, leaders) = (topo.members(host), topo.leaders());
    let h = leaders.len();
    let packed = ctx.scratch(p * cb);
    ctx.register(packed, p * cb)?;
    // SAFETY (every `add`): block offsets inside the `p`-block buffers.
    for (r, &at) in pos.iter().enumerate() {
        unsafe { std::ptr::copy_nonoverlapping(work.add(r * cb), packed.add(at * cb), cb) };
    }
    if local.len() > 1 {
        ctx.view(&local, 0);
        rooted::reduce_tree(ctx, packed, p * cb, 0)?;
    }
    if local[0] == me && h > 1 {
        ctx.view(&leaders, 1);
        ctx.ring_pass(packed, &spans, (host + h - 1) % h, 0, true, true, false)?;
    }
    ctx.view(&local, MAX_STEP);
    if local[0] == me {
        for (v, &r) in local.iter().enumerate().skip(1) {
            ctx.send_all(v, 0, unsafe { packed.add(pos[r] * cb) }, cb)?;
        }
    } else {
        ctx.recv_copy_all(0, 0, unsafe { packed.add(pos[me] * cb) }, cb)?;
    }
    ctx.finish()?;
    unsafe { std::ptr::copy_nonoverlapping(packed.add(pos[me] * cb), work.add(me * cb), cb) };
    Ok(())
}
