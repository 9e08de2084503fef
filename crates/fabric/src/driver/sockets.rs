//! Listening sockets, accepting, and outgoing connections, through the provider's engine.
//!
//! The loop keeps every listener in one table and knows nothing of who owns it: an
//! [`Acceptor`] (a block server, a mesh, a test channel) is handed each accepted connection.

use super::event_loop::listener_token;
use super::types::{Acceptor, Listening, Loop, Transport};
use crate::error::FabricError;
use std::net::SocketAddr;

impl Loop {
    // ------------------------------------------------------------------ listeners

    /// Listens on `addr` as listener `id` (a socket in the poll, or the provider's own
    /// notification, which wakes the loop with the listener's key); what it accepts goes to
    /// `acceptor`. Returns the address bound (port 0 picks one).
    pub fn listen(&mut self, id: u64, addr: SocketAddr, acceptor: &'static dyn Acceptor) -> Result<SocketAddr, FabricError> {
        let (local, socket) = self.engine.listen(addr, self.poll.registry(), listener_token(id), (1 << 63) | id)?;
        self.listeners.insert(id, Listening { socket, acceptor });
        Ok(local)
    }

    /// Stops listener `id` (its socket closes; connections it accepted stay). Idempotent.
    pub fn unlisten(&mut self, id: u64) {
        if let Some(mut l) = self.listeners.remove(&id) {
            l.socket.close(self.poll.registry());
        }
    }

    /// Accepts every waiting connection of listener `id` that its acceptor takes now.
    pub fn accept(&mut self, id: u64) {
        loop {
            let Some(acceptor) = self.listeners.get(&id).map(|l| l.acceptor) else { return };
            if !acceptor.accepting(self, id) {
                return;
            }
            let Some(l) = self.listeners.get_mut(&id) else { return };
            let Some((peer, transport)) = l.socket.accept() else { return };
            acceptor.accepted(self, id, peer, transport);
        }
    }

    /// Closes every listener (the loop shuts down).
    pub(crate) fn unlisten_all(&mut self) {
        let ids: Vec<u64> = self.listeners.keys().copied().collect();
        for id in ids {
            self.unlisten(id);
        }
    }

    /// A new outgoing connection of the driver's provider to `addr`.
    pub fn connect(&mut self, addr: SocketAddr) -> Result<Transport, FabricError> {
        self.engine.connect(addr)
    }
}
