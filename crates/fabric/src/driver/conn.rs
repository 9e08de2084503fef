//! One connection inside the loop: its transport (a provider's [`Link`]), its role (the protocol that runs it: its handler,
//! state and codec), and the state every role shares (timers, liveness, closing).

use super::types::{ConnKey, Handler, Role};
use crate::providers::codec::Codec;
use std::any::Any;
use std::sync::Arc;

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

impl Role {
    /// A role run by `handler` with `state`, its frames cut by `codec`.
    pub fn new<S: Any + Send>(handler: &'static dyn Handler, state: S, codec: Arc<dyn Codec>) -> Role {
        Role { handler, state: Box::new(state), codec }
    }

    /// The protocol's framing.
    pub fn codec(&self) -> &dyn Codec {
        &*self.codec
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
