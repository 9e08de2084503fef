//! Receives posted into the caller's memory: a message that arrives after its receive was
//! posted is read straight into the caller's buffer (tcp: from the socket; shm: copied once
//! out of the sender's buffer), with no pool buffer and no copy out of one.

use super::shared::{MeshShared, Posted, State};
use super::{Mesh, MeshError, Message, Registration, Tag, UserReg, RELEASE_WAIT};
use crate::mesh::link::{submit, MeshCmd};
use parking_lot::MutexGuard;
use rdma_shuffle_fabric::driver::Driver;
use rdma_shuffle_fabric::providers::link::Fold;
use std::sync::Arc;
use std::time::Instant;

/// A receive posted with [`Mesh::post_recv`]. Wait for it with [`Mesh::wait_posted`];
/// dropping it unwaited takes the receive back, and waits until the loop no longer writes
/// the memory.
pub struct PostedRecv {
    shared: Arc<MeshShared>,
    driver: Driver,
    peer: usize,
    tag: Tag,
    /// Whether an entry is in the mesh's table (not when a message under the tag was queued
    /// already, or once the receive ended).
    active: bool,
    /// (verbs) The registration a READ into the memory uses; dropped after the receive is.
    _reg: Option<UserReg>,
}

impl std::fmt::Debug for PostedRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PostedRecv(peer {}, tag {:#x}, active {})", self.peer, self.tag, self.active)
    }
}

/// What [`Mesh::wait_posted`] got.
#[derive(Debug)]
pub enum Posting {
    /// The message is in the caller's memory.
    Placed,
    /// The message came before the receive was posted, or its length differs from the
    /// receive's: here it is, in a buffer of the mesh.
    Staged(Message),
    /// The other message waited for (`also`) came first.
    Also(Message),
}

impl Mesh {
    /// Posts a receive of the next message from `peer` under `tag` into `len` bytes at
    /// `ptr`. A message of exactly `len` bytes that starts to arrive after this call goes
    /// straight there; one that arrived before, or of another length, is kept in a buffer of
    /// the mesh as usual, and [`wait_posted`](Mesh::wait_posted) hands it over. On verbs a
    /// rendezvous message is READ straight there only when `reg` (a [`register`](Mesh::register)ed
    /// range that holds the receive's, with pages that took a writable pin) is given; else
    /// it is read into a pool buffer.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay valid, and must be neither read nor written by anyone else,
    /// until the [`PostedRecv`] was waited for or dropped.
    pub unsafe fn post_recv(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        reg: Option<&Registration>,
    ) -> Result<PostedRecv, MeshError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_into(peer, tag, ptr, len, reg, None) }
    }

    /// Posts a reducing receive: like [`post_recv`](Mesh::post_recv), but the message is
    /// reduced into `len` bytes at `ptr` by `fold` as it arrives, on links that can (tcp:
    /// out of the socket's 64 KiB read buffer, a piece at a time), so its bytes are touched
    /// once, in cache, instead of being written to a pool buffer and read back. A message
    /// that arrived before, and one on a link that does not fold (shm, sim, verbs), is handed
    /// over by [`wait_posted`](Mesh::wait_posted) as [`Posting::Staged`] for the caller to
    /// reduce.
    ///
    /// # Safety
    /// As for [`post_recv`](Mesh::post_recv); also, the memory is read and written by the
    /// fold on the thread that drives the mesh until the receive ended.
    pub unsafe fn post_recv_fold(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        fold: Fold,
    ) -> Result<PostedRecv, MeshError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_into(peer, tag, ptr, len, None, Some(fold)) }
    }

    /// # Safety
    /// As for [`post_recv`](Mesh::post_recv).
    unsafe fn post_into(
        &self,
        peer: usize,
        tag: Tag,
        ptr: *mut u8,
        len: usize,
        reg: Option<&Registration>,
        fold: Option<Fold>,
    ) -> Result<PostedRecv, MeshError> {
        let (start, end) = (ptr as usize, ptr as usize + len);
        let lkey = reg.filter(|r| start >= r.ptr && end <= r.ptr + r.len).and_then(|r| match &r.reg {
            UserReg::Region(region) => region.write_lkey(),
            UserReg::Plain => None,
        });
        let s = &*self.shared;
        self.peer_ok(peer)?;
        let mut st = s.lock();
        let active = !st.queued(peer, tag) && len > 0;
        if active {
            if st.posted.contains_key(&(peer, tag)) {
                return Err(MeshError::Config(format!(
                    "rank {}: a receive from rank {peer} under tag {tag:#x} is posted twice",
                    s.rank
                )));
            }
            st.posted.insert((peer, tag), Posted::Waiting(ptr as usize, len, lkey, fold));
        }
        // The registration is the caller's, alive until the receive ends: a clone keeps it
        // (and the READ's target pages) registered until then in any case.
        let reg = reg.filter(|_| lkey.is_some()).map(|r| r.reg.clone());
        Ok(PostedRecv { shared: self.shared.clone(), driver: self.driver.clone(), peer, tag, active, _reg: reg })
    }

    /// Waits for a posted receive until `deadline`; with `also`, whichever of it and that
    /// other message comes first (`also` wins when both are there, as in
    /// [`recv_either`](Mesh::recv_either)). After [`Posting::Also`] the receive is still
    /// posted: wait again.
    pub fn wait_posted(&self, p: &mut PostedRecv, also: Option<(usize, Tag)>, deadline: Instant) -> Result<Posting, MeshError> {
        if !p.active {
            return self.recv_either((p.peer, p.tag), also, deadline).map(|(which, m)| {
                if which == 1 {
                    Posting::Also(m)
                } else {
                    Posting::Staged(m)
                }
            });
        }
        if let Some((q, _)) = also {
            self.peer_ok(q)?;
        }
        let s = &*self.shared;
        let started = Instant::now();
        let (peer, tag) = (p.peer, p.tag);
        let take = |st: &mut MutexGuard<'_, State>| -> Option<Result<Posting, MeshError>> {
            if let Some((q, t)) = also {
                if let Some(m) = MeshShared::take(st, q, t) {
                    return Some(Ok(Posting::Also(m)));
                }
            }
            match st.posted.get(&(peer, tag)) {
                Some(Posted::Done) => {
                    st.posted.remove(&(peer, tag));
                    return Some(Ok(Posting::Placed));
                }
                Some(Posted::Failed(why)) => {
                    // The group's own state names the cause best (this rank closed, the
                    // peer left or aborted); the link's reason is the fallback.
                    let e = s.check(st, peer).err().unwrap_or_else(|| MeshError::PeerFailed {
                        rank: s.rank,
                        peer,
                        addr: st.peers[peer].name.clone(),
                        reason: why.clone(),
                    });
                    st.posted.remove(&(peer, tag));
                    return Some(Err(e));
                }
                // The loop is writing the caller's memory: nothing but its end may end this.
                Some(Posted::Claimed) => return None,
                Some(Posted::Waiting(..)) | None => {}
            }
            // Not claimed: a message of another length may have come instead.
            if let Some(m) = MeshShared::take(st, peer, tag) {
                st.posted.remove(&(peer, tag));
                return Some(Ok(Posting::Staged(m)));
            }
            let bad = s.check(st, peer).err().or_else(|| also.and_then(|(q, _)| s.check(st, q).err()));
            if let Some(e) = bad {
                st.posted.remove(&(peer, tag));
                return Some(Err(e));
            }
            None
        };
        match s.wait_for(&self.driver, deadline, take) {
            Some(r) => {
                if !matches!(r, Ok(Posting::Also(_))) {
                    p.active = false;
                }
                r
            }
            None => {
                let e = s.timed_out(&s.lock(), peer, "a message", started);
                p.take_back();
                Err(e)
            }
        }
    }
}

impl PostedRecv {
    /// Takes the receive back; returns once the loop no longer writes its memory.
    fn take_back(&mut self) {
        if !std::mem::replace(&mut self.active, false) {
            return;
        }
        let key = (self.peer, self.tag);
        let conn = {
            let mut st = self.shared.lock();
            match st.posted.get(&key) {
                Some(Posted::Claimed) => st.peers[self.peer].conn,
                _ => {
                    st.posted.remove(&key);
                    return;
                }
            }
        };
        // Being placed into: the link must stop reading before the memory goes back.
        if let Some(key) = conn {
            let (tx, rx) = crossbeam_channel::bounded(1);
            if submit(&self.driver, MeshCmd::Unpost { key, tag: self.tag, reply: tx }).is_ok() {
                let _ = rx.recv_timeout(RELEASE_WAIT);
            }
        }
        self.shared.lock().posted.remove(&key);
    }
}

impl Drop for PostedRecv {
    fn drop(&mut self) {
        self.take_back();
    }
}
