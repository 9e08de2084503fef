//! A protocol's loop-wide duties: what it does when memory comes back, whether the loop
//! should spin for its answers, and how it closes at shutdown.

use super::event_loop::Loop;
use std::any::TypeId;

/// A protocol's loop-wide hooks, registered once per loop ([`Loop::add_service`]). Its
/// connections have their own hooks ([`Handler`](super::Handler)); these are for what is
/// not one connection's: blocks waiting for a buffer, a budget shared by every connection.
pub trait Service: Sync + 'static {
    /// Memory came back (a pool lease, budget bytes): serve what waited for it, in order.
    /// Returns whether something still waits (the loop then keeps listening for releases).
    fn memory(&self, lp: &mut Loop) -> bool {
        let _ = lp;
        false
    }
    /// Whether an answer to a request of this protocol is on its way: the loop thread then
    /// polls briefly before it sleeps ([`DriverConfig::spin`](super::DriverConfig::spin)).
    fn awaiting_answers(&self, lp: &Loop) -> bool {
        let _ = lp;
        false
    }
    /// The loop shuts down: close the protocol's endpoints. Connections still open are
    /// failed by the loop after every service closed.
    fn shutdown(&self, lp: &mut Loop) {
        let _ = lp;
    }
}

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
