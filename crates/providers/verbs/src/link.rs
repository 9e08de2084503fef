//! The verbs provider behind the driver's seam: its per-loop engine makes verbs links for
//! outgoing connections and for a socket listener's accepted control planes, each holding
//! the engine's state, typed ([`SharedEngine`]).
#![forbid(unsafe_code)]

use crate::conn::VerbsConn;
use crate::engine::SharedEngine;
use mio::{Registry, Token};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::providers::link::{Link, Listener, ProviderEngine};
use rdma_shuffle_provider_tcp::{TcpConn, TcpListener};
use std::net::SocketAddr;

/// The verbs engine of one driver loop, as the loop holds it.
pub(crate) struct VerbsLoop {
    pub(crate) engine: SharedEngine,
}

impl ProviderEngine for VerbsLoop {
    /// A connection whose control socket is connecting; the queue pair comes after the
    /// handshake.
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError> {
        Ok(Box::new(VerbsConn::new(TcpConn::connect(addr)?, self.engine.clone(), false)))
    }

    /// A socket listener whose accepted connections are control planes of verbs links.
    fn listen(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
        _notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError> {
        let engine = self.engine.clone();
        let (local, l) =
            TcpListener::bind(addr, registry, token, Box::new(move |c| Box::new(VerbsConn::new(c, engine.clone(), true))))?;
        Ok((local, Box::new(l)))
    }

    fn poll_completions(&mut self) -> Vec<u64> {
        self.engine.lock().collect()
    }

    fn registered_bytes(&self) -> u64 {
        self.engine.lock().registered_bytes()
    }
}
