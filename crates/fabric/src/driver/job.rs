//! Work for the loop from other threads: a [`Job`] runs on whichever thread holds the loop.
//!
//! The loop knows no protocol's commands. A protocol hands it a job (usually a closure,
//! [`Driver::submit`](super::Driver::submit)) that runs with the loop in hand, and keeps its
//! own command types to itself.

use super::Loop;

/// Something to run on the loop.
pub trait Job: Send + 'static {
    /// Runs it, with the loop.
    fn run(self: Box<Self>, lp: &mut Loop);
    /// It will never run: the loop stopped first, or its owner took it back
    /// ([`Driver::take_jobs`](super::Driver::take_jobs)). Answer whoever waits on it.
    fn cancel(self: Box<Self>) {}
    /// The endpoint it belongs to, if it can be taken back by id.
    fn owner(&self) -> Option<u64> {
        None
    }
}

/// A closure as a [`Job`].
pub(crate) struct FnJob<F>(pub(crate) F);

impl<F: FnOnce(&mut Loop) + Send + 'static> Job for FnJob<F> {
    fn run(self: Box<Self>, lp: &mut Loop) {
        (self.0)(lp)
    }
}
