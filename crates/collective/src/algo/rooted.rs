//! Broadcast and reduce: binomial trees and pipelined chains.
//!
//! Ranks are renumbered so the root is virtual rank 0 (`v = (r − root) mod p`). Both shapes
//! move one segment at a time: a rank forwards (or reduces and passes on) segment `j` before
//! it waits for segment `j + 1`, so the levels of a tree and the links of a chain work on
//! different segments at once.
//!
//! * **Binomial tree**: virtual rank `v` receives from `v` minus its lowest set bit and sends
//!   to `v + 2^i` for every `2^i` below that bit; `⌈log2 p⌉` levels.
//! * **Chain** (`ring`): broadcast flows `0 → 1 → … → p−1`; reduce flows `1 → 2 → … → p−1 → 0`.

use super::Ctx;
use crate::error::CollectiveError;
use crate::transport::Transport;

/// Parent and children of virtual rank `v` in a binomial tree of `p` ranks. Children come in
/// increasing distance.
fn binomial(v: usize, p: usize) -> (Option<usize>, Vec<usize>) {
    let mut children = Vec::new();
    let mut mask = 1;
    while mask < p {
        if v & mask != 0 {
            return (Some(v - mask), children);
        }
        if v + mask < p {
            children.push(v + mask);
        }
        mask <<= 1;
    }
    (None, children)
}

/// Binomial-tree broadcast of `len` bytes from `root`.
pub(crate) fn broadcast_tree<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    len: usize,
    root: usize,
) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let v = (ctx.rank + p - root) % p;
    let real = |x: usize| (x + root) % p;
    let (parent, mut children) = binomial(v, p);
    // Farthest child first: its subtree is the largest.
    children.reverse();
    ctx.register(buf, len)?;
    let segs: Vec<_> = ctx.segs(len).collect();
    for (j, off, l) in segs {
        // SAFETY: segments of `buf`.
        let at = unsafe { buf.add(off) };
        if let Some(pv) = parent {
            ctx.recv_copy(real(pv), 0, j, at, l)?;
        }
        for &c in &children {
            ctx.send(real(c), 0, j, at, l)?;
        }
    }
    ctx.finish()
}

/// Chain broadcast of `len` bytes from `root`.
pub(crate) fn broadcast_chain<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    len: usize,
    root: usize,
) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let v = (ctx.rank + p - root) % p;
    let real = |x: usize| (x + root) % p;
    ctx.register(buf, len)?;
    let segs: Vec<_> = ctx.segs(len).collect();
    for (j, off, l) in segs {
        // SAFETY: segments of `buf`.
        let at = unsafe { buf.add(off) };
        if v > 0 {
            ctx.recv_copy(real(v - 1), 0, j, at, l)?;
        }
        if v + 1 < p {
            ctx.send(real(v + 1), 0, j, at, l)?;
        }
    }
    ctx.finish()
}

/// Binomial-tree reduce of `len` bytes to `root`, in place (non-root buffers end with
/// partial results).
pub(crate) fn reduce_tree<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    len: usize,
    root: usize,
) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let v = (ctx.rank + p - root) % p;
    let real = |x: usize| (x + root) % p;
    let (parent, children) = binomial(v, p);
    ctx.register(buf, len)?;
    let segs: Vec<_> = ctx.segs(len).collect();
    for (j, off, l) in segs {
        // SAFETY: segments of `buf`.
        let at = unsafe { buf.add(off) };
        for &c in &children {
            ctx.recv_reduce(real(c), 0, j, at, l)?;
        }
        if let Some(pv) = parent {
            ctx.send(real(pv), 0, j, at, l)?;
        }
    }
    ctx.finish()
}

/// Chain reduce of `len` bytes to `root`, in place.
pub(crate) fn reduce_chain<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    buf: *mut u8,
    len: usize,
    root: usize,
) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let v = (ctx.rank + p - root) % p;
    let real = |x: usize| (x + root) % p;
    let prev = match v {
        1 => None,
        0 => Some(p - 1),
        _ => Some(v - 1),
    };
    let next = (v != 0).then(|| (v + 1) % p);
    ctx.register(buf, len)?;
    let segs: Vec<_> = ctx.segs(len).collect();
    for (j, off, l) in segs {
        // SAFETY: segments of `buf`.
        let at = unsafe { buf.add(off) };
        if let Some(pv) = prev {
            ctx.recv_reduce(real(pv), 0, j, at, l)?;
        }
        if let Some(nv) = next {
            ctx.send(real(nv), 0, j, at, l)?;
        }
    }
    ctx.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_tree_reaches_every_rank_once_in_log_levels() {
        for p in 1..40usize {
            let mut parent_of = vec![None; p];
            for v in 0..p {
                let (parent, children) = binomial(v, p);
                for c in children {
                    assert!(parent_of[c].replace(v).is_none(), "p={p}: {c} has two parents");
                    assert_eq!(binomial(c, p).0, Some(v));
                }
                assert_eq!(parent.is_none(), v == 0);
            }
            assert!(parent_of.iter().skip(1).all(|x| x.is_some()));
        }
    }
}
