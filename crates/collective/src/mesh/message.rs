//! Received messages: [`Message`] and where its bytes are ([`Body`]).

use super::Proto;
use rdma_shuffle_fabric::memory::pool::Lease;
use std::fmt;
use std::ops::Deref;

/// Where a received message's bytes are.
pub(crate) enum Body {
    Empty,
    Lease(Lease),
    /// A whole received message (sim, verbs) and where its payload starts.
    Bytes(Vec<u8>, usize),
}

/// One received message. Dropping it returns its buffer.
pub struct Message {
    pub(crate) body: Body,
    pub(crate) proto: Proto,
}

impl Message {
    /// How the message came.
    pub fn proto(&self) -> Proto {
        self.proto
    }
}

impl Deref for Message {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.body {
            Body::Empty => &[],
            Body::Lease(l) => l,
            Body::Bytes(b, at) => &b[*at..],
        }
    }
}

impl AsRef<[u8]> for Message {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Message({} bytes, {})", self.len(), self.proto)
    }
}
