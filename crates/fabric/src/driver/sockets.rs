//! Listening sockets, accepting, and outgoing connections, through the provider's engine.

use super::conn::Transport;
use super::{listener_token, Loop};
use crate::error::FabricError;
use std::net::SocketAddr;

pub(crate) use super::ListenSocket;

impl Loop {
    // ------------------------------------------------------------------ listeners

    /// Listens on `addr` for listener `id` (a socket in the poll, or the provider's own
    /// notification, which wakes the loop with the listener's key).
    pub(crate) fn listen(&mut self, id: u64, addr: SocketAddr) -> Result<(SocketAddr, ListenSocket), FabricError> {
        self.net.engine.listen(addr, self.poll.registry(), listener_token(id), (1 << 63) | id)
    }

    pub(crate) fn unlisten(&mut self, _addr: SocketAddr, socket: &mut ListenSocket) {
        socket.close(self.poll.registry());
    }

    /// Accepts every waiting connection of listener `id`.
    pub(crate) fn accept(&mut self, id: u64) {
        loop {
            let accepted = {
                let socket = if let Some(s) = self.servers.get_mut(&id) {
                    &mut s.socket
                } else if let Some(c) = self.chan_listeners.get_mut(&id) {
                    &mut c.socket
                } else if let Some(m) = self.meshes.get_mut(&id) {
                    // A mesh accepts once it was started (connections wait in the backlog).
                    let started = m.started();
                    match (&mut m.socket, started) {
                        (Some(s), true) => s,
                        _ => return,
                    }
                } else {
                    return;
                };
                socket.accept()
            };
            let Some((peer, transport)) = accepted else { return };
            if self.servers.contains_key(&id) {
                self.server_accepted(id, peer, transport);
            } else if self.meshes.contains_key(&id) {
                self.mesh_accepted(id, peer, transport);
            } else {
                self.channel_accepted(id, peer, transport);
            }
        }
    }
}

/// A new outgoing connection of the driver's provider to `addr`.
pub(crate) fn connect(lp: &mut Loop, addr: SocketAddr) -> Result<Transport, FabricError> {
    lp.net.engine.connect(addr)
}
