//! Delivery of block outcomes to their sinks: a fetched block of a cheap sink
//! ([`BlockSink::inline`]) on the calling (loop) thread at once, everything else on the
//! delivery thread, so a slow sink (a failure path that retries or asks another service)
//! never stalls the loop's I/O.

use super::client::{BlockSink, FetchedBlock};
use super::BlockLoopStats;
use crossbeam_channel::{unbounded, Sender};
use parking_lot::Mutex;
use rdma_shuffle_wire::BlockFailure;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

/// One outcome for one sink.
pub(crate) type Job = (Arc<dyn BlockSink>, usize, Result<FetchedBlock, BlockFailure>);

pub(crate) struct Delivery {
    tx: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stats: Arc<BlockLoopStats>,
}

impl Delivery {
    pub(crate) fn start(name: &str, stats: Arc<BlockLoopStats>) -> std::io::Result<Delivery> {
        let (tx, rx) = unbounded::<Job>();
        let thread = std::thread::Builder::new().name(format!("rdma-shuffle-deliver-{name}")).spawn(move || {
            for (sink, index, result) in rx.iter() {
                // A sink that panics loses its block, not the thread: every other sink still
                // gets its outcomes.
                if catch_unwind(AssertUnwindSafe(|| sink.on_block(index, result))).is_err() {
                    tracing::error!(index, "a block sink panicked; its outcome is lost");
                }
            }
        })?;
        Ok(Delivery { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)), stats })
    }

    /// Delivers an outcome: a fetched block of an [`inline`](BlockSink::inline) sink on the
    /// calling thread now (counted in `inline`), anything else through the delivery thread's
    /// queue (counted in `queued`). After [`stop`](Self::stop) every outcome is delivered on
    /// the calling thread, so none is ever lost.
    pub(crate) fn send(&self, job: Job) {
        let stats = &self.stats;
        if job.2.is_ok() && job.0.inline() {
            stats.inline_deliveries.fetch_add(1, Ordering::Relaxed);
            let (sink, index, result) = job;
            if catch_unwind(AssertUnwindSafe(|| sink.on_block(index, result))).is_err() {
                tracing::error!(index, "a block sink panicked; its outcome is lost");
            }
            return;
        }
        stats.queued_deliveries.fetch_add(1, Ordering::Relaxed);
        let job = match self.tx.lock().as_ref() {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(e) => e.0,
            },
            None => job,
        };
        Self::deliver_here(job);
    }

    /// Delivers `job` on the calling thread (no delivery thread could be started).
    pub(crate) fn deliver_here(job: Job) {
        let (sink, index, result) = job;
        if catch_unwind(AssertUnwindSafe(|| sink.on_block(index, result))).is_err() {
            tracing::error!(index, "a block sink panicked; its outcome is lost");
        }
    }

    /// Delivers everything queued, then ends the thread.
    pub(crate) fn stop(&self) {
        drop(self.tx.lock().take());
        let t = self.thread.lock().take();
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Delivery {
    /// The loop's state is dropped when the loop stops: what is queued is delivered first.
    fn drop(&mut self) {
        self.stop();
    }
}
