//! A protocol's loop-wide duties: what it does when memory comes back, whether the loop
//! should spin for its answers, and how it closes at shutdown.

use super::types::{Loop, Service};
use std::any::TypeId;

impl Loop {
    /// Registers `service` (once per type; later calls are no-ops).
    pub fn add_service<S: Service>(&mut self, service: &'static S) {
        let id = TypeId::of::<S>();
        if !self.services.iter().any(|(t, _)| *t == id) {
            self.services.push((id, service));
        }
    }

    /// Runs `f` at the end of this loop turn (or the next, if the turn is over), without
    /// sleeping first: for work a handler makes due but should not do in its own call (a
    /// budget that freed room serves its waiters once, after the turn's events).
    pub fn defer(&mut self, f: fn(&mut Loop)) {
        self.deferred.push(f);
    }

    /// Every service's [`memory`](Service::memory); whether one still waits.
    pub(crate) fn services_memory(&mut self) -> bool {
        let mut waiting = false;
        for i in 0..self.services.len() {
            let s = self.services[i].1;
            waiting |= s.memory(self);
        }
        waiting
    }

    /// Whether any service awaits answers.
    pub(crate) fn awaiting_answers(&self) -> bool {
        self.services.iter().any(|(_, s)| s.awaiting_answers(self))
    }

    /// Every service's [`shutdown`](Service::shutdown).
    pub(crate) fn services_shutdown(&mut self) {
        for i in 0..self.services.len() {
            let s = self.services[i].1;
            s.shutdown(self);
        }
    }

    /// Runs the deferred work; whether there was any.
    pub(crate) fn run_deferred(&mut self) -> bool {
        let due = std::mem::take(&mut self.deferred);
        let any = !due.is_empty();
        for f in due {
            f(self);
        }
        any
    }
}
