//! Listening sockets, accepting, and outgoing connections of every provider.

use super::conn::{self, Transport};
use super::{listener_token, Loop};
use crate::error::FabricError;
use crate::providers::sim::Notify;
use crate::providers::tcp::TcpConn;
use crate::providers::ProviderKind;
use mio::Interest;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;

pub(crate) use super::ListenSocket;

impl Loop {
    // ------------------------------------------------------------------ listeners

    /// Binds a listening socket on `addr`.
    pub(crate) fn listen(&mut self, id: u64, addr: SocketAddr) -> Result<(SocketAddr, ListenSocket), FabricError> {
        match self.shared.provider.kind() {
            ProviderKind::Sim(p) => {
                let (addr, q) = p.listen(addr)?;
                let n: Arc<dyn Notify> = self.shared.clone();
                q.set_notify(n, (1 << 63) | id);
                Ok((addr, ListenSocket::Sim(q)))
            }
            _ => {
                let mut l = mio::net::TcpListener::bind(addr).map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
                let local = l.local_addr().map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
                self.poll
                    .registry()
                    .register(&mut l, listener_token(id), Interest::READABLE)
                    .map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
                Ok((local, ListenSocket::Tcp(l)))
            }
        }
    }

    pub(crate) fn unlisten(&mut self, addr: SocketAddr, socket: &mut ListenSocket) {
        match socket {
            ListenSocket::Tcp(l) => {
                let _ = self.poll.registry().deregister(l);
            }
            ListenSocket::Sim(_) => {
                if let ProviderKind::Sim(p) = self.shared.provider.kind() {
                    p.unlisten(addr);
                }
            }
        }
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
                match socket {
                    ListenSocket::Tcp(l) => match l.accept() {
                        Ok((s, peer)) => Some(Accepted::Tcp(s, peer)),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::Interrupted) => {
                            continue
                        }
                        Err(e) => {
                            // EMFILE and friends: the backlog keeps the peers; try again on the
                            // next turn instead of spinning.
                            tracing::warn!(driver = %self.shared.name, error = %e, "accept failed; retrying later");
                            None
                        }
                    },
                    ListenSocket::Sim(q) => q.accept().map(Accepted::Sim),
                }
            };
            let Some(accepted) = accepted else { return };
            let (peer, transport) = match accepted {
                Accepted::Tcp(s, peer) => {
                    let t = TcpConn::accepted(s, peer);
                    #[cfg(feature = "verbs")]
                    if let Some(v) = &self.net.verbs {
                        (peer.to_string(), Transport::Verbs(Box::new(v.accepted(t))))
                    } else {
                        (peer.to_string(), Transport::Tcp(t))
                    }
                    #[cfg(not(feature = "verbs"))]
                    (peer.to_string(), Transport::Tcp(t))
                }
                Accepted::Sim(c) => {
                    let peer = c.peer_name().to_string();
                    (peer, Transport::Sim(conn::SimTransport { conn: c, reads_done: VecDeque::new(), exposed: HashMap::new() }))
                }
            };
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

enum Accepted {
    Tcp(mio::net::TcpStream, SocketAddr),
    Sim(crate::providers::sim::SimConn),
}

/// A sim connection made by `provider` (used by client and channel roles).
pub(crate) fn sim_transport(c: crate::providers::sim::SimConn) -> Transport {
    Transport::Sim(conn::SimTransport { conn: c, reads_done: VecDeque::new(), exposed: HashMap::new() })
}

/// A new outgoing connection of the driver's provider to `addr`.
pub(crate) fn connect(lp: &Loop, addr: SocketAddr) -> Result<Transport, FabricError> {
    match lp.shared.provider.kind() {
        ProviderKind::Sim(p) => Ok(sim_transport(p.connect(addr)?)),
        ProviderKind::Tcp(_) => Ok(Transport::Tcp(TcpConn::connect(addr)?)),
        #[cfg(feature = "verbs")]
        ProviderKind::Verbs(_) => {
            let t = TcpConn::connect(addr)?;
            match &lp.net.verbs {
                Some(v) => Ok(Transport::Verbs(Box::new(v.connecting(t)))),
                None => Err(FabricError::Unsupported("verbs engine missing".into())),
            }
        }
    }
}
