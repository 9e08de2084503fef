//! Allreduce (ring, recursive doubling, Rabenseifner) and reduce-scatter (ring, recursive
//! halving).
//!
//! **Ring pass** ([`Ctx::ring_pass`]): the buffer is cut into one block per rank; at step `k`
//! rank `r` sends block `first − k` to `r + 1` and receives block `first − k − 1` from
//! `r − 1`. Each block is cut into segments, and a segment received is forwarded at once, so
//! consecutive steps overlap (pipelining); the first block goes out a window at a time.
//! Reduce-scatter is a pass that reduces (`first = r − 1`, so rank `r` ends with block
//! `r`), allgather one that copies; ring allreduce is both, with the last reduced segments
//! forwarded as the allgather's first step.
//!
//! **Non-powers of two** (recursive doubling and halving): with `p'` the largest power of two
//! ≤ `p` and `rem = p − p'`, ranks `0..2·rem` pair up first: each even rank hands its data to
//! the odd one above it and sits out; the `p'` remaining ranks run the power-of-two
//! algorithm; the odd ranks then give the result (or the even rank's block) back.

use super::{blocks, log2_floor, span, Ctx};
use crate::error::CollectiveError;
use crate::policy::Algo;
use crate::transport::Transport;

/// The virtual rank of `r` after folding (`None` for the even ranks that sit out).
fn fold_rank(r: usize, rem: usize) -> Option<usize> {
    if r < 2 * rem {
        (r % 2 == 1).then_some(r / 2)
    } else {
        Some(r - rem)
    }
}

/// The real rank of virtual rank `v`.
fn real_rank(v: usize, rem: usize) -> usize {
    if v < rem {
        2 * v + 1
    } else {
        v + rem
    }
}

/// Ring allreduce of `count` elements in place.
pub(crate) fn allreduce_ring<T: Transport>(ctx: &mut Ctx<'_, T>, buf: *mut u8, count: usize) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let b = blocks(count, p, ctx.elem());
    ctx.register(buf, count * ctx.elem())?;
    let r = ctx.rank;
    // The allgather's receives are posted before the reduce-scatter starts: its first
    // segments are forwarded while the reduce-scatter's last step runs, so a receive posted
    // at its turn would mostly find them arrived, in pool buffers to copy out of. Posted
    // now, they land in place (tcp, shm). No fence: the allgather's segment of a block is
    // sent by its owner only after the owner reduced that block, which took in this rank's
    // partial of it (already written, or read by the peer) and came after this rank's own
    // last reduction into it; so it never lands in memory a send still reads or a reduction
    // still writes.
    let left = (r + p - 1) % p;
    for k in 0..p - 1 {
        let (off, len) = b[(r + 2 * p - k - 1) % p];
        // SAFETY: `blocks` partitions the buffer.
        ctx.post_all(left, (p - 1 + k) as u32, unsafe { buf.add(off) }, len, true)?;
    }
    ctx.ring_pass(buf, &b, (r + p - 1) % p, 0, true, true, true)?;
    ctx.ring_pass(buf, &b, r, (p - 1) as u32, false, false, false)?;
    ctx.finish()
}

/// Folds the extra ranks in (step 0); returns this rank's virtual rank.
fn fold_in<T: Transport>(ctx: &mut Ctx<'_, T>, buf: *mut u8, len: usize, rem: usize) -> Result<Option<usize>, CollectiveError> {
    let r = ctx.rank;
    let vr = fold_rank(r, rem);
    if r < 2 * rem {
        if vr.is_none() {
            ctx.send_all(r + 1, 0, buf, len)?;
        } else {
            ctx.recv_reduce_all(r - 1, 0, buf, len)?;
        }
    }
    Ok(vr)
}

/// The flat allreduce `algo` names (recursive doubling, Rabenseifner, else the ring) in
/// place: the one dispatch for a call and for the hierarchy's allreduce among hosts.
pub(crate) fn allreduce_flat<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    algo: Algo,
    buf: *mut u8,
    count: usize,
) -> Result<(), CollectiveError> {
    match algo {
        Algo::RecursiveDoubling => allreduce_rd(ctx, buf, count),
        Algo::HalvingDoubling => allreduce_rhd(ctx, buf, count),
        _ => allreduce_ring(ctx, buf, count),
    }
}

/// Recursive-doubling allreduce in place.
pub(crate) fn allreduce_rd<T: Transport>(ctx: &mut Ctx<'_, T>, buf: *mut u8, count: usize) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let len = count * ctx.elem();
    ctx.register(buf, len)?;
    let p2 = 1usize << log2_floor(p);
    let rem = p - p2;
    let vr = fold_in(ctx, buf, len, rem)?;
    let mut step = 1u32;
    if let Some(vr) = vr {
        let mut mask = 1;
        while mask < p2 {
            let partner = real_rank(vr ^ mask, rem);
            ctx.exchange(partner, partner, step, buf, len, buf, len, true)?;
            mask <<= 1;
            step += 1;
        }
    }
    let last = 1 + log2_floor(p2) as u32;
    let r = ctx.rank;
    if r < 2 * rem {
        if vr.is_some() {
            ctx.send_all(r - 1, last, buf, len)?;
        } else {
            ctx.recv_copy_all(r + 1, last, buf, len)?;
        }
    }
    ctx.finish()
}

/// Recursive halving over virtual blocks `vb` among `p2` virtual ranks: afterwards virtual
/// rank `vr` holds the reduced block `vr`. Uses steps `step..step + log2(p2)`.
fn halving<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    vb: &[(usize, usize)],
    vr: usize,
    rem: usize,
    step: &mut u32,
) -> Result<(), CollectiveError> {
    let p2 = vb.len();
    let (mut lo, mut hi) = (0, p2);
    let mut mask = p2 >> 1;
    while mask > 0 {
        let partner = real_rank(vr ^ mask, rem);
        let mid = (lo + hi) / 2;
        let (keep, give) = if vr & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
        let (g_off, g_len) = span(vb, give);
        let (k_off, k_len) = span(vb, keep);
        // SAFETY: spans of blocks that partition `buf`.
        ctx.exchange(partner, partner, *step, unsafe { buf.add(g_off) }, g_len, unsafe { buf.add(k_off) }, k_len, true)?;
        (lo, hi) = keep;
        mask >>= 1;
        *step += 1;
    }
    Ok(())
}

/// Rabenseifner allreduce in place: reduce-scatter by recursive halving, allgather by
/// recursive doubling.
pub(crate) fn allreduce_rhd<T: Transport>(ctx: &mut Ctx<'_, T>, buf: *mut u8, count: usize) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let len = count * ctx.elem();
    ctx.register(buf, len)?;
    let p2 = 1usize << log2_floor(p);
    let rem = p - p2;
    let vr = fold_in(ctx, buf, len, rem)?;
    let mut step = 1u32;
    if let Some(vr) = vr {
        let vb = blocks(count, p2, ctx.elem());
        halving(ctx, buf, &vb, vr, rem, &mut step)?;
        let (mut lo, mut hi) = (vr, vr + 1);
        let mut mask = 1;
        while mask < p2 {
            let partner = real_rank(vr ^ mask, rem);
            let size = hi - lo;
            let other = if vr & mask == 0 { (hi, hi + size) } else { (lo - size, lo) };
            let (m_off, m_len) = span(&vb, (lo, hi));
            let (o_off, o_len) = span(&vb, other);
            // SAFETY: spans of blocks that partition `buf`.
            ctx.exchange(partner, partner, step, unsafe { buf.add(m_off) }, m_len, unsafe { buf.add(o_off) }, o_len, false)?;
            lo = lo.min(other.0);
            hi = hi.max(other.1);
            mask <<= 1;
            step += 1;
        }
    }
    let last = 1 + 2 * log2_floor(p2) as u32;
    let r = ctx.rank;
    if r < 2 * rem {
        if vr.is_some() {
            ctx.send_all(r - 1, last, buf, len)?;
        } else {
            ctx.recv_copy_all(r + 1, last, buf, len)?;
        }
    }
    ctx.finish()
}

/// Ring reduce-scatter: `work` holds this rank's whole input (`p` blocks of `count`
/// elements) and is reduced in place; afterwards block `rank` of `work` is the result.
pub(crate) fn reduce_scatter_ring<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    work: *mut u8,
    count: usize,
) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let b = blocks(count * p, p, ctx.elem());
    ctx.register(work, count * p * ctx.elem())?;
    ctx.ring_pass(work, &b, (ctx.rank + p - 1) % p, 0, true, true, false)?;
    ctx.finish()
}

/// Recursive-halving reduce-scatter (Rabenseifner's first half) on `work` as in
/// [`reduce_scatter_ring`]. With a non-power of two, virtual rank `v < rem` stands for real
/// ranks `2v` and `2v + 1` and owns both their blocks, giving the even one its block at the
/// end.
pub(crate) fn reduce_scatter_rhd<T: Transport>(ctx: &mut Ctx<'_, T>, work: *mut u8, count: usize) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let elem = ctx.elem();
    let total = count * p * elem;
    ctx.register(work, total)?;
    let p2 = 1usize << log2_floor(p);
    let rem = p - p2;
    let real = blocks(count * p, p, elem);
    let vb: Vec<(usize, usize)> =
        (0..p2).map(|v| if v < rem { span(&real, (2 * v, 2 * v + 2)) } else { real[v + rem] }).collect();
    let vr = fold_in(ctx, work, total, rem)?;
    let mut step = 1u32;
    if let Some(vr) = vr {
        halving(ctx, work, &vb, vr, rem, &mut step)?;
    }
    let last = 1 + log2_floor(p2) as u32;
    let r = ctx.rank;
    if r < 2 * rem {
        let (off, len) = real[r - r % 2];
        // SAFETY: a block of `work`.
        if vr.is_some() {
            ctx.send_all(r - 1, last, unsafe { work.add(off) }, len)?;
        } else {
            ctx.recv_copy_all(r + 1, last, unsafe { work.add(off) }, len)?;
        }
    }
    ctx.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folding_maps_ranks_both_ways() {
        for p in 1..20usize {
            let rem = p - (1 << log2_floor(p));
            let mut seen = Vec::new();
            for r in 0..p {
                if let Some(v) = fold_rank(r, rem) {
                    assert_eq!(real_rank(v, rem), r);
                    seen.push(v);
                }
            }
            assert_eq!(seen, (0..(1 << log2_floor(p))).collect::<Vec<_>>());
        }
    }
}
