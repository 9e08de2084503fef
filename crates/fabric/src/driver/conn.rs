//! One connection inside the loop: its transport (a provider's [`Link`]), its role (block client, block server, raw
//! channel), and the state every role shares (timers, liveness, closing).

use super::channel::ChannelConn;
use super::client::ClientConn;
use super::server::ServerConn;
pub(crate) use crate::providers::link::{Incoming, Link, MsgPayload, Placement};
use std::time::Instant;

/// Index and generation of a connection slot; the generation makes stale references (a
/// timer, a completion, a poll event for a connection that is gone) harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ConnKey {
    pub(crate) index: u32,
    pub(crate) gen: u32,
}

impl ConnKey {
    pub(crate) fn to_u64(self) -> u64 {
        ((self.gen as u64) << 32) | self.index as u64
    }
    pub(crate) fn from_u64(v: u64) -> Self {
        ConnKey { index: v as u32, gen: (v >> 32) as u32 }
    }
}

/// What a connection does.
pub(crate) enum Role {
    Client(Box<ClientConn>),
    Server(Box<ServerConn>),
    Channel(ChannelConn),
    Mesh(Box<super::mesh::MeshConn>),
}

/// The transport of a connection: its provider's link (the driver never asks which).
pub(crate) type Transport = Box<dyn Link>;

/// How a connection is being closed.
pub(crate) struct Closing {
    /// Give up flushing (and waiting for device completions) at this time.
    pub(crate) deadline: Instant,
    /// Why, for the log.
    pub(crate) reason: String,
}

/// One connection.
pub(crate) struct Conn {
    pub(crate) key: ConnKey,
    pub(crate) peer: String,
    pub(crate) transport: Transport,
    pub(crate) role: Role,
    /// The peer proved the secret (or none was required); only then may anything be
    /// allocated, registered or exposed for it.
    pub(crate) authenticated: bool,
    /// The deadline this connection last armed and that has not fired.
    pub(crate) armed: Option<Instant>,
    /// Last time the connection did anything (idle accounting).
    pub(crate) last_active: Instant,
    /// Set once the connection is closing: nothing more is read, it lingers until its
    /// sends are out and its device work completed (or the deadline passes).
    pub(crate) closing: Option<Closing>,
    /// The socket is registered with the poll (stream transports and verbs control).
    pub(crate) registered: bool,
}
