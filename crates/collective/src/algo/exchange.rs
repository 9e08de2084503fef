//! Allgather (ring, recursive doubling / Bruck), alltoall (direct, pairwise) and the
//! dissemination barrier.
//!
//! Allgather works in place on the output buffer, into which the caller has already copied
//! this rank's block at position `rank`.
//!
//! * **Recursive doubling** (powers of two): at step `i` rank `r` swaps with `r xor 2^i` the
//!   `2^i` blocks it holds, which are contiguous.
//! * **Bruck** (other sizes, same `⌈log2 p⌉` steps): blocks are kept rotated in a scratch
//!   buffer (own block first); at step `i` rank `r` sends its first `min(2^i, p − 2^i)`
//!   blocks to `r − 2^i` and appends those of `r + 2^i`; a final rotation puts them in place.

use super::{blocks, log2_floor, Ctx};
use crate::error::CollectiveError;
use crate::transport::Transport;

/// Ring allgather of `p` blocks of `count` elements in `buf`.
pub(crate) fn allgather_ring<T: Transport>(ctx: &mut Ctx<'_, T>, buf: *mut u8, count: usize) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let b = blocks(count * p, p, ctx.elem());
    ctx.register(buf, count * p * ctx.elem())?;
    ctx.ring_pass(buf, &b, ctx.rank, 0, false, true, false)?;
    ctx.finish()
}

/// Recursive-doubling allgather (Bruck's variant when `p` is not a power of two).
pub(crate) fn allgather_rd<T: Transport>(ctx: &mut Ctx<'_, T>, buf: *mut u8, count: usize) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let r = ctx.rank;
    let cb = count * ctx.elem();
    if p.is_power_of_two() {
        ctx.register(buf, cb * p)?;
        let mut mask = 1;
        let mut step = 0;
        while mask < p {
            let partner = r ^ mask;
            let mine = (r / mask) * mask;
            let theirs = (partner / mask) * mask;
            // SAFETY: groups of `mask` blocks inside the `p`-block buffer.
            ctx.exchange(
                partner,
                partner,
                step,
                unsafe { buf.add(mine * cb) },
                mask * cb,
                unsafe { buf.add(theirs * cb) },
                mask * cb,
                false,
            )?;
            mask <<= 1;
            step += 1;
        }
        return ctx.finish();
    }
    let tmp = ctx.scratch(cb * p);
    ctx.register(tmp, cb * p)?;
    // SAFETY: `tmp` and `buf` hold `p` blocks; own block first.
    unsafe { std::ptr::copy_nonoverlapping(buf.add(r * cb), tmp, cb) };
    let mut d = 1;
    let mut step = 0;
    while d < p {
        let n = d.min(p - d);
        let (to, from) = ((r + p - d) % p, (r + d) % p);
        // SAFETY: the first `n ≤ d` blocks are sent, blocks `d..d+n` received: disjoint.
        ctx.exchange(to, from, step, tmp, n * cb, unsafe { tmp.add(d * cb) }, n * cb, false)?;
        d <<= 1;
        step += 1;
    }
    ctx.finish()?;
    for i in 0..p {
        // SAFETY: block `i` of `tmp` is rank `r + i`'s.
        unsafe { std::ptr::copy_nonoverlapping(tmp.add(i * cb), buf.add(((r + i) % p) * cb), cb) };
    }
    Ok(())
}

/// Alltoall with every block posted at once (`direct`) or one peer per step (`pairwise`).
/// `send` and `recv` hold `p` blocks of `count` elements; block `rank` is copied locally.
pub(crate) fn alltoall<T: Transport>(
    ctx: &mut Ctx<'_, T>,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    pairwise: bool,
) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let r = ctx.rank;
    let cb = count * ctx.elem();
    ctx.register(send, cb * p)?;
    // SAFETY (all pointer arithmetic): blocks of the `p`-block buffers.
    unsafe { std::ptr::copy_nonoverlapping(send.add(r * cb), recv.add(r * cb), cb) };
    if pairwise {
        for k in 1..p {
            let (to, from) = ((r + k) % p, (r + p - k) % p);
            ctx.exchange(to, from, k as u32, unsafe { send.add(to * cb) }, cb, unsafe { recv.add(from * cb) }, cb, false)?;
        }
    } else {
        for k in 1..p {
            let to = (r + k) % p;
            ctx.send_all(to, 0, unsafe { send.add(to * cb) }, cb)?;
        }
        for k in 1..p {
            let from = (r + p - k) % p;
            ctx.recv_copy_all(from, 0, unsafe { recv.add(from * cb) }, cb)?;
        }
    }
    ctx.finish()
}

/// Dissemination barrier: `⌈log2 p⌉` rounds of an empty message to `r + 2^i`.
pub(crate) fn barrier<T: Transport>(ctx: &mut Ctx<'_, T>) -> Result<(), CollectiveError> {
    let p = ctx.world;
    let r = ctx.rank;
    let rounds = if p <= 1 { 0 } else { log2_floor(p - 1) + 1 };
    let empty = [0u8; 0];
    for i in 0..rounds {
        let d = 1 << i;
        ctx.send((r + d) % p, i as u32, 0, empty.as_ptr(), 0)?;
        ctx.recv_copy((r + p - d) % p, i as u32, 0, empty.as_ptr() as *mut u8, 0)?;
    }
    ctx.finish()
}
