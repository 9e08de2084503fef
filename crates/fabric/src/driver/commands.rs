//! Commands from other threads, whole-loop shutdown, the verbs completion queue, and memory
//! interest.

use super::types::{Command, ConnKey, Loop, CLOSE_LINGER};
use crate::error::FabricError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Loop {
    // ------------------------------------------------------------------ commands

    /// Runs the commands other threads queued; whether there were any.
    pub(crate) fn commands(&mut self) -> bool {
        let cmds: Vec<Command> = std::mem::take(&mut *self.shared.commands.lock());
        let any = !cmds.is_empty();
        for c in cmds {
            match c {
                Command::Run(job) => job.run(self),
                Command::Shutdown => {
                    self.close_everything("the engine is shutting down");
                    self.exiting = Some(Instant::now() + CLOSE_LINGER + Duration::from_secs(1));
                }
            }
        }
        any
    }

    pub(crate) fn close_everything(&mut self, why: &str) {
        self.services_shutdown();
        // Every other listener (a mesh, a test channel) closes; their connections fail below.
        self.unlisten_all();
        let keys: Vec<ConnKey> = self
            .conns
            .iter()
            .enumerate()
            .filter(|(_, s)| s.conn.is_some())
            .map(|(i, s)| ConnKey { index: i as u32, gen: s.gen })
            .collect();
        for k in keys {
            if let Some(mut conn) = self.take(k) {
                self.fail(&mut conn, FabricError::Shutdown);
                let _ = why;
                self.put(conn);
            }
        }
        // Blocks staged in memory waiters of endpoints that are gone fail now.
        self.service_memory();
    }

    // ------------------------------------------------------------------ provider engine

    /// Collects the provider engine's completions and drives the connections they concern.
    pub(crate) fn engine_events(&mut self) {
        let touched = self.engine.poll_completions();
        for k in touched {
            self.drive(ConnKey::from_u64(k));
        }
    }

    // ------------------------------------------------------------------ memory

    /// Memory came back (or may have): every service serves its waiters, then the parked
    /// connections go on.
    pub(crate) fn service_memory(&mut self) {
        // Interest first: a lease coming back while we try must wake the loop again.
        self.shared.mem_wanted.store(true, Ordering::Release);
        let mut waiting = self.services_memory();
        waiting |= self.service_parked();
        if !waiting {
            self.shared.mem_wanted.store(false, Ordering::Release);
        }
    }

    /// Parks connection `key` until memory comes back (pool leases, budget bytes): its
    /// handler's [`memory`](super::Handler::memory) is called then, in parking order.
    pub fn park_for_memory(&mut self, key: ConnKey) {
        if !self.parked.contains(&key) {
            self.parked.push_back(key);
        }
        self.want_memory();
    }

    /// Memory came back: parked connections go on, in order. Returns whether some still wait.
    pub(crate) fn service_parked(&mut self) -> bool {
        let waiting: Vec<ConnKey> = self.parked.drain(..).collect();
        for key in waiting {
            let Some(mut conn) = self.take(key) else { continue };
            if conn.closing.is_none() {
                conn.role.handler().memory(self, &mut conn);
            }
            self.put(conn);
            self.drive_again(key);
        }
        !self.parked.is_empty()
    }

    /// Registers interest in memory coming back (pool leases, budget bytes), for a block
    /// just queued to wait for it.
    pub fn want_memory(&mut self) {
        self.shared.mem_wanted.store(true, Ordering::Release);
        self.mem_dirty = true;
    }

    /// Queues a connection to be driven again on this turn (it was unblocked).
    pub fn drive_again(&mut self, key: ConnKey) {
        self.again.push(key);
    }

    /// The driver's [`idle_timeout`](super::DriverConfig::idle_timeout).
    pub fn idle_timeout(&self) -> Duration {
        self.shared.config.idle_timeout
    }

    /// The driver's settings.
    pub fn config(&self) -> &super::DriverConfig {
        &self.shared.config
    }
}
