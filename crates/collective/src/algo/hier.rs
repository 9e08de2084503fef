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

/// Hierarchical allreduce of `count` elements in place; `inner` is the algorithm among the
/// hosts. Every host with the same number of ranks m > 1 (and at least m elements): the split
/// form ([`allreduce_split`]); else the leader's tree form below.
pub(crate) fn allreduce_hier<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    count: usize,
    topo: &Topology,
    inner: Algo,
) -> Result<(), CollectiveError> {
    if let Some(m) = topo.uniform().filter(|&m| m > 1 && count >= m) {
        return allreduce_split(ctx, buf, count, topo, inner, m);
    }
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
        reducing::allreduce_flat(ctx, inner, buf, count)?;
    }
    if local.len() > 1 {
        ctx.view(&local, MAX_STEP);
        rooted::broadcast_tree(ctx, buf, len, 0)?;
    }
    ctx.finish()
}

/// The split hierarchical allreduce (Horovod's and NCCL's two-level shape), for hosts of m
/// ranks each:
///
/// 1. **reduce-scatter inside each host** (ring over the same-host links, steps from 0): the
///    rank at position i of its host ends with block i of m, reduced over the host;
/// 2. **allreduce of block i among the hosts** by the ranks at position i of every host (m
///    such allreduces at once, each over its own network links; steps from m);
/// 3. **allgather inside each host** (ring, steps from m: phase 2 uses only links between
///    hosts, phase 1 only steps below m − 1 on the links inside one).
///
/// Against the leader's form, the network carries n/m bytes per rank instead of n per
/// leader, every rank works in every phase, and no rank reduces the whole buffer alone.
/// Against a flat ring over all ranks, each byte crosses a network link fewer times
/// (2·(h − 1)/h · n/m per rank, where the ring's slowest links carry 2·(p − 1)/p · n).
fn allreduce_split<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    count: usize,
    topo: &Topology,
    inner: Algo,
    m: usize,
) -> Result<(), CollectiveError> {
    let elem = ctx.elem();
    let me = ctx.rank;
    let local = topo.members(topo.host_of[me]);
    let i = local.iter().position(|&r| r == me).unwrap_or(0);
    let b = super::blocks(count, m, elem);
    ctx.register(buf, count * elem)?;
    ctx.view(&local, 0);
    // The ring reduce-scatter of `allreduce_ring`, without forwarding its last block: rank i
    // of the host ends with block i reduced.
    ctx.ring_pass(buf, &b, (i + m - 1) % m, 0, true, true, false)?;
    let column = topo.column(i);
    if column.len() > 1 {
        let (off, len) = b[i];
        ctx.view(&column, m as u32);
        // SAFETY: `blocks` partitions the buffer.
        let part = unsafe { buf.add(off) };
        let n = len / elem;
        reducing::allreduce_flat(ctx, inner, part, n)?;
    }
    ctx.view(&local, m as u32);
    ctx.ring_pass(buf, &b, i, 0, false, true, false)?;
    ctx.finish()
}

/// A call's blocks laid out host after host (each host's ranks in rank order), in scratch
/// memory of the call.
struct Packed {
    /// The position of each rank's block in the layout.
    pos: Vec<usize>,
    /// Each host's byte span in the layout.
    spans: Vec<(usize, usize)>,
    /// This rank's host, the ranks on it (the leader first) and every host's leader.
    host: usize,
    local: Vec<usize>,
    leaders: Vec<usize>,
    /// Bytes per block.
    cb: usize,
    /// The scratch holding the layout (registered for sends).
    at: *mut u8,
}

impl Packed {
    fn new<T: Transport>(ctx: &mut Ctx<'_, T>, topo: &Topology, count: usize) -> Result<Self, CollectiveError> {
        let cb = count * ctx.elem();
        let mut pos = vec![0; topo.host_of.len()];
        let mut spans = Vec::with_capacity(topo.hosts());
        let mut n = 0;
        for h in 0..topo.hosts() {
            let m = topo.members(h);
            for (i, &r) in m.iter().enumerate() {
                pos[r] = n + i;
            }
            spans.push((n * cb, m.len() * cb));
            n += m.len();
        }
        let at = ctx.scratch(n * cb);
        ctx.register(at, n * cb)?;
        let host = topo.host_of[ctx.rank];
        Ok(Packed { pos, spans, host, local: topo.members(host), leaders: topo.leaders(), cb, at })
    }

    /// Where rank `r`'s block is in the layout.
    fn block(&self, r: usize) -> *mut u8 {
        // SAFETY: `pos[r] < p`, and the scratch holds `p` blocks.
        unsafe { self.at.add(self.pos[r] * self.cb) }
    }
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
    let k = Packed::new(ctx, topo, count)?;
    let cb = k.cb;
    ctx.register(buf, p * cb)?;
    // SAFETY (every `add`): block offsets inside the `p`-block buffer.
    ctx.view(&k.local, 0);
    if k.local[0] == me {
        unsafe { std::ptr::copy_nonoverlapping(buf.add(me * cb), k.block(me), cb) };
        for (v, &r) in k.local.iter().enumerate().skip(1) {
            ctx.recv_copy_all(v, 0, k.block(r), cb)?;
        }
    } else {
        ctx.send_all(0, 0, unsafe { buf.add(me * cb) }, cb)?;
    }
    if k.local[0] == me && k.leaders.len() > 1 {
        ctx.view(&k.leaders, 1);
        ctx.ring_pass(k.at, &k.spans, k.host, 0, false, true, false)?;
    }
    if k.local.len() > 1 {
        ctx.view(&k.local, MAX_STEP);
        rooted::broadcast_tree(ctx, k.at, p * cb, 0)?;
    }
    ctx.finish()?;
    for r in 0..p {
        unsafe { std::ptr::copy_nonoverlapping(k.block(r), buf.add(r * cb), cb) };
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
    let k = Packed::new(ctx, topo, count)?;
    let (cb, h) = (k.cb, k.leaders.len());
    // SAFETY (every `add`): block offsets inside the `p`-block buffer.
    for r in 0..p {
        unsafe { std::ptr::copy_nonoverlapping(work.add(r * cb), k.block(r), cb) };
    }
    if k.local.len() > 1 {
        ctx.view(&k.local, 0);
        rooted::reduce_tree(ctx, k.at, p * cb, 0)?;
    }
    if k.local[0] == me && h > 1 {
        ctx.view(&k.leaders, 1);
        ctx.ring_pass(k.at, &k.spans, (k.host + h - 1) % h, 0, true, true, false)?;
    }
    ctx.view(&k.local, MAX_STEP);
    if k.local[0] == me {
        for (v, &r) in k.local.iter().enumerate().skip(1) {
            ctx.send_all(v, 0, k.block(r), cb)?;
        }
    } else {
        ctx.recv_copy_all(0, 0, k.block(me), cb)?;
    }
    ctx.finish()?;
    unsafe { std::ptr::copy_nonoverlapping(k.block(me), work.add(me * cb), cb) };
    Ok(())
}
