//! Work for the loop from other threads: a [`Job`] runs on whichever thread holds the loop.
//!
//! The loop knows no protocol's commands. A protocol hands it a job (usually a closure,
//! [`Driver::submit`](super::Driver::submit)) that runs with the loop in hand, and keeps its
//! own command types to itself.

use super::types::{Job, Loop};

/// A closure as a [`Job`].
pub(crate) struct FnJob<F>(pub(crate) F);

impl<F: FnOnce(&mut Loop) + Send + 'static> Job for FnJob<F> {
    fn run(self: Box<Self>, lp: &mut Loop) {
        (self.0)(lp)
    }
}
