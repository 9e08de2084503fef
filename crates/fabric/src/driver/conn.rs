//! One connection inside the loop: its transport (a provider's [`Link`]), its role (block client, block server, raw
//! channel), and the state every role shares (timers, liveness, closing).

use super::Loop;
use crate::error::FabricError;
use crate::providers::link::Link;
pub use crate::providers::link::{Incoming, MsgPayload, Placement};
use rdma_shuffle_wire::Limits;
use std::any::Any;
use std::time::Instant;

/// Index and generation of a connection slot; the generation makes stale references (a
/// timer, a completion, a poll event for a connection that is gone) harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub(crate) index: u32,
    pub(crate) gen: u32,
}

impl ConnKey {
    /// The key as one number (a timer's or a completion's key).
    pub fn to_u64(self) -> u64 {
        ((self.gen as u64) << 32) | self.index as u64
    }
    /// The key [`to_u64`](Self::to_u64) made.
    pub fn from_u64(v: u64) -> Self {
        ConnKey { index: v as u32, gen: (v >> 32) as u32 }
    }
}

/// What a connection does: the protocol that runs on it (a block client or server, a raw
/// channel, a mesh link...). The loop calls these for every connection and never asks which
/// protocol it is; a new protocol is a new implementation, not a new arm in the loop.
///
/// Implementations are stateless markers (`&'static`); a connection's protocol state lives
/// in its [`Role`] and is reached with [`Role::get`] / [`Role::get_mut`]. The hooks take the
/// loop and the connection (taken out of the table while it is handled), so a handler can
/// send, expose and revoke memory, post reads and arm timers through them.
pub trait Handler: Sync {
    /// Limits for decoding what arrives on the connection.
    fn limits(&self, conn: &Conn) -> Limits;
    /// Whether the connection reads nothing more for now (its payload waits for memory).
    fn blocked(&self, conn: &Conn) -> bool {
        let _ = conn;
        false
    }
    /// A pending outgoing connect completed.
    fn connected(&self, lp: &mut Loop, conn: &mut Conn) {
        let _ = (lp, conn);
    }
    /// Something arrived.
    fn incoming(&self, lp: &mut Loop, conn: &mut Conn, inc: Incoming);
    /// The transport failed (or the peer went away): fail the protocol's work. Answers
    /// whether frames still queued (an `Error` for the peer) should be flushed first.
    fn failed(&self, lp: &mut Loop, conn: &mut Conn, error: &FabricError) -> bool;
    /// After the connection was handled (and is not closing): send what was queued.
    fn after(&self, lp: &mut Loop, conn: &mut Conn) {
        let _ = (lp, conn);
    }
    /// The protocol's next deadline, if any.
    fn deadline(&self, lp: &Loop, conn: &Conn) -> Option<Instant> {
        let _ = (lp, conn);
        None
    }
    /// The deadline armed from [`deadline`](Handler::deadline) passed.
    fn timeout(&self, lp: &mut Loop, conn: &mut Conn, now: Instant) {
        let _ = (lp, conn, now);
    }
    /// Memory came back after the connection [parked](Loop::park_for_memory) for it: go on
    /// (or park again).
    fn memory(&self, lp: &mut Loop, conn: &mut Conn) {
        let _ = (lp, conn);
    }
    /// The connection is removed: give back what the protocol held for it.
    fn removed(&self, lp: &mut Loop, conn: &mut Conn);
}

/// A connection's protocol: its [`Handler`] and its state.
pub struct Role {
    handler: &'static dyn Handler,
    state: Box<dyn Any + Send>,
}

impl Role {
    /// A role run by `handler` with `state`.
    pub fn new<S: Any + Send>(handler: &'static dyn Handler, state: S) -> Role {
        Role { handler, state: Box::new(state) }
    }

    /// The protocol's handler.
    pub fn handler(&self) -> &'static dyn Handler {
        self.handler
    }

    /// The state, if it is an `S`.
    pub fn get<S: Any>(&self) -> Option<&S> {
        self.state.downcast_ref()
    }

    /// The state, if it is an `S`.
    pub fn get_mut<S: Any>(&mut self) -> Option<&mut S> {
        self.state.downcast_mut()
    }

    /// Whether the state is an `S`.
    pub fn is<S: Any>(&self) -> bool {
        self.state.is::<S>()
    }
}

/// The transport of a connection: its provider's link (the driver never asks which).
pub type Transport = Box<dyn Link>;

/// How a connection is being closed.
pub struct Closing {
    /// Give up flushing (and waiting for device completions) at this time.
    pub deadline: Instant,
    /// Why, for the log.
    pub reason: String,
}

/// One connection.
pub struct Conn {
    /// Its key in the loop's table.
    pub key: ConnKey,
    /// The peer's address or name, for logs and errors.
    pub peer: String,
    /// The provider's link.
    pub transport: Transport,
    /// The protocol that runs on it.
    pub role: Role,
    /// The peer proved the secret (or none was required); only then may anything be
    /// allocated, registered or exposed for it.
    pub authenticated: bool,
    /// The deadline this connection last armed and that has not fired.
    pub(crate) armed: Option<Instant>,
    /// Last time the connection did anything (idle accounting).
    pub last_active: Instant,
    /// Set once the connection is closing: nothing more is read, it lingers until its
    /// sends are out and its device work completed (or the deadline passes).
    pub closing: Option<Closing>,
    /// The socket is registered with the poll (stream transports and verbs control).
    pub(crate) registered: bool,
}
