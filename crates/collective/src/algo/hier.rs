//! Hierarchical allreduce, for ranks spread over hosts with several ranks on some of them
//! (NCCL's, Open MPI HAN's and UCC's shape):
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
//! consecutive. Bytes cross the network once per host instead of once per rank.

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
