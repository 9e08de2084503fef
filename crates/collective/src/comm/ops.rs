//! The calls of a [`Communicator`]: the collectives and point-to-point messages on raw bytes
//! of a [`DType`], and their typed versions over [`Element`] slices.

use crate::algo::{exchange, hier, reducing, rooted};
use crate::dtype::{finish_avg, DType, Element, ReduceOp};
use crate::error::CollectiveError;
use crate::policy::{Algo, Op};
use crate::transport::{Proto, Tag, Transport, TransportError, TransportErrorKind};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Communicator, MONITORED_ARRIVE, MONITORED_RELEASE};

impl<T: Transport> Communicator<T> {
    /// Allreduce of `buf` in place, as raw bytes of `dtype`.
    pub fn allreduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CollectiveError> {
        self.check_op(Op::AllReduce, dtype, op)?;
        let count = self.elements(Op::AllReduce, "buf", buf.len(), dtype)?;
        let world = self.world;
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        self.run(Op::AllReduce, dtype, Some(op), 0, count, len, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::Hierarchical => {
                        let inner = ctx.inner.unwrap_or(Algo::Ring);
                        hier::allreduce_hier(ctx, ptr, count, &self.policy.topology, inner)?
                    }
                    flat => reducing::allreduce_flat(ctx, flat, ptr, count)?,
                }
            }
            Ok(())
        })?;
        if op == ReduceOp::Avg {
            finish_avg(dtype, buf, world);
        }
        Ok(())
    }

    /// Broadcast of root's `buf` to every rank.
    pub fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<(), CollectiveError> {
        self.check_root(Op::Broadcast, root)?;
        let count = self.elements(Op::Broadcast, "buf", buf.len(), dtype)?;
        let (len, ptr, world) = (buf.len(), buf.as_mut_ptr(), self.world);
        self.run(Op::Broadcast, dtype, None, root, count, len, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::Ring => rooted::broadcast_chain(ctx, ptr, len, root)?,
                    _ => rooted::broadcast_tree(ctx, ptr, len, root)?,
                }
            }
            Ok(())
        })
    }

    /// Reduce to `root` in place: root's `buf` gets the result; on other ranks `buf` holds
    /// partial results afterwards (as torch's `reduce`).
    pub fn reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<(), CollectiveError> {
        self.check_root(Op::Reduce, root)?;
        self.check_op(Op::Reduce, dtype, op)?;
        let count = self.elements(Op::Reduce, "buf", buf.len(), dtype)?;
        let (len, ptr, world) = (buf.len(), buf.as_mut_ptr(), self.world);
        self.run(Op::Reduce, dtype, Some(op), root, count, len, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::Ring => rooted::reduce_chain(ctx, ptr, len, root)?,
                    _ => rooted::reduce_tree(ctx, ptr, len, root)?,
                }
            }
            Ok(())
        })?;
        if op == ReduceOp::Avg && self.rank == root {
            finish_avg(dtype, buf, world);
        }
        Ok(())
    }

    /// Allgather: `recv` (world × `send`) gets every rank's `send`, in rank order.
    pub fn allgather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        let count = self.elements(Op::AllGather, "send", send.len(), dtype)?;
        if recv.len() != send.len() * self.world {
            return Err(self.invalid(
                Op::AllGather,
                "recv",
                format!(
                    "{} bytes, but world ({}) × send ({} bytes) = {}",
                    recv.len(),
                    self.world,
                    send.len(),
                    send.len() * self.world
                ),
            ));
        }
        recv[self.rank * send.len()..(self.rank + 1) * send.len()].copy_from_slice(send);
        self.gather_all(recv, count, dtype)
    }

    /// Allgather in place (MPI's `MPI_IN_PLACE`, an "in-place" all-gather of NCCL and torch):
    /// this rank's block of `recv` (world equal blocks) is its input, and every other block
    /// gets that rank's. FSDP's all-gather passes its input as a view of its output this way.
    pub fn allgather_in_place_bytes(&self, recv: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        if !recv.len().is_multiple_of(self.world) {
            return Err(self.invalid(
                Op::AllGather,
                "recv",
                format!("{} bytes do not split into {} equal blocks", recv.len(), self.world),
            ));
        }
        let count = self.elements(Op::AllGather, "recv block", recv.len() / self.world, dtype)?;
        self.gather_all(recv, count, dtype)
    }

    /// Runs the allgather on `recv`, whose own block is in place already.
    fn gather_all(&self, recv: &mut [u8], count: usize, dtype: DType) -> Result<(), CollectiveError> {
        let world = self.world;
        let (ptr, total) = (recv.as_mut_ptr(), recv.len());
        self.run(Op::AllGather, dtype, None, 0, count, total, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::RecursiveDoubling => exchange::allgather_rd(ctx, ptr, count)?,
                    Algo::Hierarchical => hier::allgather_hier(ctx, ptr, count, &self.policy.topology)?,
                    _ => exchange::allgather_ring(ctx, ptr, count)?,
                }
            }
            Ok(())
        })
    }

    /// Reduce-scatter: `send` holds world blocks of `recv.len()` bytes; rank `i`'s `recv`
    /// gets the reduction of every rank's block `i`.
    pub fn reduce_scatter_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CollectiveError> {
        self.check_op(Op::ReduceScatter, dtype, op)?;
        let count = self.elements(Op::ReduceScatter, "recv", recv.len(), dtype)?;
        if send.len() != recv.len() * self.world {
            return Err(self.invalid(
                Op::ReduceScatter,
                "send",
                format!(
                    "{} bytes, but world ({}) × recv ({} bytes) = {}",
                    send.len(),
                    self.world,
                    recv.len(),
                    recv.len() * self.world
                ),
            ));
        }
        let (world, rank, cb) = (self.world, self.rank, recv.len());
        let mut work = send.to_vec();
        let (ptr, total) = (work.as_mut_ptr(), work.len());
        self.run(Op::ReduceScatter, dtype, Some(op), 0, count, total, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::HalvingDoubling => reducing::reduce_scatter_rhd(ctx, ptr, count)?,
                    Algo::Hierarchical => hier::reduce_scatter_hier(ctx, ptr, count, &self.policy.topology)?,
                    _ => reducing::reduce_scatter_ring(ctx, ptr, count)?,
                }
            }
            Ok(())
        })?;
        recv.copy_from_slice(&work[rank * cb..(rank + 1) * cb]);
        if op == ReduceOp::Avg {
            finish_avg(dtype, recv, world);
        }
        Ok(())
    }

    /// Alltoall: block `j` of `send` goes to rank `j`, which puts it at block `rank` of its
    /// `recv`. Both hold world equal blocks.
    pub fn alltoall_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        if send.len() != recv.len() {
            return Err(self.invalid(Op::AllToAll, "recv", format!("{} bytes, but send has {}", recv.len(), send.len())));
        }
        let elems = self.elements(Op::AllToAll, "send", send.len(), dtype)?;
        if !elems.is_multiple_of(self.world) {
            return Err(self.invalid(
                Op::AllToAll,
                "send",
                format!("{elems} elements do not split into {} equal blocks", self.world),
            ));
        }
        let count = elems / self.world;
        let (world, total) = (self.world, send.len());
        let (sp, rp) = (send.as_ptr(), recv.as_mut_ptr());
        self.run(Op::AllToAll, dtype, None, 0, count, total, |ctx, algo| {
            if world > 1 {
                exchange::alltoall(ctx, sp, rp, count, algo == Algo::Pairwise)
            } else {
                // SAFETY: both buffers hold `total` bytes and are distinct (`&` and `&mut`).
                unsafe { std::ptr::copy_nonoverlapping(sp, rp, total) };
                Ok(())
            }
        })
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<(), CollectiveError> {
        let world = self.world;
        self.run(Op::Barrier, DType::U8, None, 0, 0, 0, |ctx, _| if world > 1 { exchange::barrier(ctx) } else { Ok(()) })
    }

    /// A barrier that names the ranks missing from it (torch's `monitored_barrier`, which
    /// gloo offers): every rank reports to rank 0, which releases them all once each has
    /// come within `timeout`. Rank 0 fails naming the first rank that did not come in time,
    /// or every such rank with `wait_all_ranks`, and releases nobody; the others then fail
    /// when `timeout` passes without a release, pointing at rank 0's error. Unlike a failed
    /// collective, a failed monitored barrier leaves the communicator usable.
    pub fn monitored_barrier(&self, timeout: Duration, wait_all_ranks: bool) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + timeout;
        // The same number on every rank: all call it in the same order.
        let n = (self.monitored.fetch_add(1, Ordering::Relaxed) & 0xF_FFFF) as u32;
        let (arrive, release) = (Self::init_tag(MONITORED_ARRIVE, n), Self::init_tag(MONITORED_RELEASE, n));
        let ms = timeout.as_millis();
        let fail = |message: String| CollectiveError::MonitoredBarrier { rank: self.rank, message };
        if self.world == 1 {
            return Ok(());
        }
        if self.rank != 0 {
            let met = (|| -> Result<(), TransportError> {
                let tk = self.t.send(0, arrive, &[], Proto::Eager, None)?;
                self.t.wait(tk, deadline)?;
                self.t.recv(0, release, None, deadline).map(|_| ())
            })();
            return met.map_err(|e| {
                fail(format!(
                    "reached it, but rank 0 did not release it within {ms} ms ({e}); rank 0's error names \
                     the ranks that did not arrive"
                ))
            });
        }
        let mut missing: Vec<(usize, TransportError)> = Vec::new();
        for peer in 1..self.world {
            // Past the deadline a rank that arrived is still counted: what came is taken
            // before the deadline is looked at.
            if let Err(e) = self.t.recv(peer, arrive, None, deadline) {
                missing.push((peer, e));
                if !wait_all_ranks {
                    break;
                }
            }
        }
        if let Some((first, cause)) = missing.first() {
            let ranks: Vec<String> = missing.iter().map(|(r, _)| r.to_string()).collect();
            let who = if ranks.len() == 1 { format!("rank {}", ranks[0]) } else { format!("ranks {}", ranks.join(", ")) };
            return Err(fail(format!("{who} failed to pass the monitored barrier within {ms} ms (rank {first}: {cause})")));
        }
        let mut sent = Vec::with_capacity(self.world - 1);
        for peer in 1..self.world {
            let label = format!("release of rank {peer}");
            sent.push(self.t.send(peer, release, &[], Proto::Eager, None).map_err(|e| fail(format!("{label}: {e}")))?);
        }
        let sends_by = Instant::now() + timeout;
        for tk in sent {
            self.t.wait(tk, sends_by).map_err(|e| fail(format!("release: {e}")))?;
        }
        Ok(())
    }

    fn p2p_tag(tag: u32, seg: u32, last: bool) -> Tag {
        (1u64 << 63) | ((tag as u64 & 0x7FFF_FFFF) << 32) | ((last as u64) << 31) | (seg as u64 & 0x7FFF_FFFF)
    }

    fn p2p_check(&self, what: &'static str, peer: usize, tag: u32) -> Result<(), CollectiveError> {
        if peer >= self.world || peer == self.rank {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                op: what,
                argument: "peer",
                message: format!("{peer} is not another rank of this world of {}", self.world),
            });
        }
        if tag > 0x7FFF_FFFF {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                op: what,
                argument: "tag",
                message: format!("{tag} is above 2^31 - 1"),
            });
        }
        Ok(())
    }

    /// Sends `buf` to `dst` under `tag`; returns when `buf` may be reused.
    pub fn send_bytes(&self, buf: &[u8], dst: usize, tag: u32) -> Result<(), CollectiveError> {
        self.p2p_check("send", dst, tag)?;
        let deadline = Instant::now() + self.timeout;
        let label = format!("send of {} bytes to rank {dst} (tag {tag})", buf.len());
        let err = |source| CollectiveError::Transport { rank: self.rank, op: label.clone(), source };
        let max = self.t.max_message();
        let n = buf.len().div_ceil(max).max(1);
        for j in 0..n {
            let part = &buf[(j * max).min(buf.len())..((j + 1) * max).min(buf.len())];
            let tk = self
                .t
                .send(dst, Self::p2p_tag(tag, j as u32, j + 1 == n), part, self.policy.proto(part.len()), None)
                .map_err(err)?;
            self.t.wait(tk, deadline).map_err(err)?;
        }
        self.p2p_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Receives into `buf` from `src` under `tag`; the sender must send exactly
    /// `buf.len()` bytes.
    pub fn recv_bytes(&self, buf: &mut [u8], src: usize, tag: u32) -> Result<(), CollectiveError> {
        self.p2p_check("recv", src, tag)?;
        self.recv_rest(buf, src, tag, None, Instant::now() + self.timeout)
    }

    /// Receives into `buf` under `tag` from whichever rank sends first, and returns that
    /// rank (torch's `recv` without a source). Peers are polled in turn, a millisecond
    /// each, until the per-call timeout.
    pub fn recv_any_bytes(&self, buf: &mut [u8], tag: u32) -> Result<usize, CollectiveError> {
        self.p2p_check("recv", (self.rank + 1) % self.world.max(2), tag)?;
        let deadline = Instant::now() + self.timeout;
        let label = format!("recv of {} bytes from any rank (tag {tag})", buf.len());
        let err = |source| CollectiveError::Transport { rank: self.rank, op: label.clone(), source };
        let slice = std::time::Duration::from_millis(1);
        loop {
            for src in (0..self.world).filter(|&p| p != self.rank) {
                let until = (Instant::now() + slice).min(deadline);
                match self.t.recv(src, Self::p2p_tag(tag, 0, false), Some((src, Self::p2p_tag(tag, 0, true))), until) {
                    Ok(first) => {
                        self.recv_rest(buf, src, tag, Some(first), deadline)?;
                        return Ok(src);
                    }
                    Err(e) if matches!(e.kind, TransportErrorKind::Timeout { .. }) && Instant::now() < deadline => {}
                    Err(e) => return Err(err(e)),
                }
            }
        }
    }

    /// Receives the segments of one message from `src` (the first already taken when
    /// `first` is given) into `buf`, checking the sender sent exactly `buf.len()` bytes.
    fn recv_rest(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: u32,
        mut first: Option<(usize, T::Buf)>,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let label = format!("recv of {} bytes from rank {src} (tag {tag})", buf.len());
        let err = |source| CollectiveError::Transport { rank: self.rank, op: label.clone(), source };
        let max = self.t.max_message();
        let n = buf.len().div_ceil(max).max(1);
        let expected = buf.len();
        let mismatch = |got: String| CollectiveError::Mismatch {
            rank: self.rank,
            op: "recv",
            peer: src,
            message: format!("this rank expects {expected} bytes under tag {tag} but rank {src} sent {got}"),
        };
        for j in 0..n {
            let (lo, hi) = ((j * max).min(buf.len()), ((j + 1) * max).min(buf.len()));
            let (which, msg) = match first.take() {
                Some(m) => m,
                None => self
                    .t
                    .recv(src, Self::p2p_tag(tag, j as u32, false), Some((src, Self::p2p_tag(tag, j as u32, true))), deadline)
                    .map_err(err)?,
            };
            let last = which == 1;
            if msg.len() != hi - lo || last != (j + 1 == n) {
                return Err(mismatch(if last { format!("{} bytes", j * max + msg.len()) } else { "more".into() }));
            }
            buf[lo..hi].copy_from_slice(&msg);
        }
        self.p2p_received.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    // ----- typed API -----

    /// Allreduce in place.
    pub fn allreduce<E: Element>(&self, buf: &mut [E], op: ReduceOp) -> Result<(), CollectiveError> {
        self.allreduce_bytes(bytemuck::cast_slice_mut(buf), E::DTYPE, op)
    }

    /// Broadcast from `root`.
    pub fn broadcast<E: Element>(&self, buf: &mut [E], root: usize) -> Result<(), CollectiveError> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), E::DTYPE, root)
    }

    /// Reduce to `root` (see [`reduce_bytes`](Self::reduce_bytes)).
    pub fn reduce<E: Element>(&self, buf: &mut [E], op: ReduceOp, root: usize) -> Result<(), CollectiveError> {
        self.reduce_bytes(bytemuck::cast_slice_mut(buf), E::DTYPE, op, root)
    }

    /// Allgather.
    pub fn allgather<E: Element>(&self, send: &[E], recv: &mut [E]) -> Result<(), CollectiveError> {
        self.allgather_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), E::DTYPE)
    }

    /// Reduce-scatter.
    pub fn reduce_scatter<E: Element>(&self, send: &[E], recv: &mut [E], op: ReduceOp) -> Result<(), CollectiveError> {
        self.reduce_scatter_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), E::DTYPE, op)
    }

    /// Alltoall.
    pub fn alltoall<E: Element>(&self, send: &[E], recv: &mut [E]) -> Result<(), CollectiveError> {
        self.alltoall_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), E::DTYPE)
    }

    /// Point-to-point send.
    pub fn send<E: Element>(&self, buf: &[E], dst: usize, tag: u32) -> Result<(), CollectiveError> {
        self.send_bytes(bytemuck::cast_slice(buf), dst, tag)
    }

    /// Point-to-point receive.
    pub fn recv<E: Element>(&self, buf: &mut [E], src: usize, tag: u32) -> Result<(), CollectiveError> {
        self.recv_bytes(bytemuck::cast_slice_mut(buf), src, tag)
    }
}
