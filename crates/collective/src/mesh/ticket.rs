//! Posted sends: the [`SendTicket`] a send returns and the [`PendingSend`] behind a
//! rendezvous ticket.

use super::{MeshError, Registration, RELEASE_WAIT};
use crate::mesh::link::{submit, MeshCmd};
use crate::mesh::shared::MeshShared;
use rdma_shuffle_fabric::driver::ConnKey;
use rdma_shuffle_fabric::driver::Driver;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

/// What a posted rendezvous send waits for, and how to take it back.
pub(super) struct PendingSend {
    pub(super) token: u64,
    pub(super) conn: ConnKey,
    pub(super) shared: Arc<MeshShared>,
    pub(super) driver: Driver,
}

impl PendingSend {
    /// Waits until the send no longer needs its buffer; on an error, makes sure the loop
    /// lets go of the buffer before returning.
    pub(super) fn wait(self, peer: usize, deadline: Instant) -> Result<(), MeshError> {
        let started = Instant::now();
        let s = &*self.shared;
        let check = |st: &mut parking_lot::MutexGuard<'_, super::shared::State>| -> Option<Result<(), MeshError>> {
            if st.done.remove(&(peer, self.token)) {
                return Some(Ok(()));
            }
            s.check(st, peer).err().map(Err)
        };
        // The caller runs the loop while it waits, as a receive does.
        let r = match s.wait_for(&self.driver, deadline, check) {
            Some(Ok(())) => return Ok(()),
            Some(Err(e)) => e,
            None => s.timed_out(&s.lock(), peer, "the read of a rendezvous buffer", started),
        };
        self.release(peer);
        Err(r)
    }

    /// Tells the loop to let go of the buffer (revoke its exposure, drop its unwritten bytes
    /// — failing the link, whose stream would be cut) and waits until it has.
    fn release(&self, peer: usize) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if submit(&self.driver, MeshCmd::Release { key: self.conn, token: self.token, reply: tx }).is_ok() {
            let _ = rx.recv_timeout(RELEASE_WAIT);
        }
        // It may have completed meanwhile.
        self.shared.lock().done.remove(&(peer, self.token));
    }
}

/// A posted send. It borrows the sent bytes until the send completes: [`Mesh::wait`] it to
/// learn the outcome; dropping it unwaited also waits (up to the mesh's memory timeout), so
/// the bytes are never released while a peer may still read them.
#[must_use = "wait for a send to learn whether it completed"]
pub struct SendTicket<'a> {
    pub(super) peer: usize,
    pub(super) pending: Option<PendingSend>,
    pub(super) drop_wait: Duration,
    /// A registration made for this send alone, released once it completes.
    pub(super) _temporary: Option<Registration>,
    pub(super) _data: PhantomData<&'a [u8]>,
}

impl SendTicket<'_> {
    pub(super) fn done(peer: usize) -> Self {
        SendTicket { peer, pending: None, drop_wait: Duration::ZERO, _temporary: None, _data: PhantomData }
    }

    /// Whether the send already completed when it was posted (eager).
    pub fn is_complete(&self) -> bool {
        self.pending.is_none()
    }

    /// Whether the send has completed by now (a streamed one: its last byte written), without
    /// waiting; [`Mesh::wait`](super::Mesh::wait) still takes the ticket back.
    pub fn is_done(&self) -> bool {
        self.pending.as_ref().is_none_or(|p| p.shared.lock().done.contains(&(self.peer, p.token)))
    }
}

impl Drop for SendTicket<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            if let Err(e) = p.wait(self.peer, Instant::now() + self.drop_wait) {
                debug!(error = %e, "an unwaited rendezvous send did not complete");
            }
        }
    }
}

impl fmt::Debug for SendTicket<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SendTicket(peer {}, {:?})", self.peer, self.pending.as_ref().map(|p| p.token))
    }
}
