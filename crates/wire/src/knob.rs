//! Typed names of the settings an error can point at.
//!
//! `wire` and `fabric` take plain values and know nothing of how a user sets them
//! (Spark configuration keys, an environment variable, a Python argument). An error that a user cures
//! by changing a setting carries a [`Knob`] instead of a key; the layer that owns the
//! settings (the shuffle crate for Spark) renders the key it reads that value from.

use std::fmt;

/// A setting that bounds or configures something the protocol or a transport does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Knob {
    /// How long a fetch may see no progress from its peer.
    FetchTimeout,
    /// How long setting up a connection (connect plus handshake) may take.
    ConnectTimeout,
    /// The shared secret both sides must prove (and whether authentication is on at all).
    Secret,
    /// The application id both sides must share.
    AppId,
    /// The hard cap on the registered-memory pool.
    PoolCapBytes,
    /// Blocks up to this size travel inline; it also sizes receive buffers.
    EagerThreshold,
    /// Receive buffers of the shared receive queue (verbs).
    RecvBuffers,
    /// Rendezvous bytes being transferred at once.
    MaxBytesInFlight,
    /// Blocks in flight per connection.
    Credits,
    /// How long an unused connection stays open.
    IdleTimeout,
    /// The RDMA device to use.
    Device,
    /// The GID index of the RDMA port.
    GidIndex,
    /// The local address the engine binds.
    BindHost,
}

impl Knob {
    /// Every knob.
    pub const ALL: [Knob; 13] = [
        Knob::FetchTimeout,
        Knob::ConnectTimeout,
        Knob::Secret,
        Knob::AppId,
        Knob::PoolCapBytes,
        Knob::EagerThreshold,
        Knob::RecvBuffers,
        Knob::MaxBytesInFlight,
        Knob::Credits,
        Knob::IdleTimeout,
        Knob::Device,
        Knob::GidIndex,
        Knob::BindHost,
    ];

    /// What the knob is, in words (used in messages of the layers that do not know its key).
    pub fn what(self) -> &'static str {
        match self {
            Knob::FetchTimeout => "the fetch timeout",
            Knob::ConnectTimeout => "the connect timeout",
            Knob::Secret => "the authentication secret",
            Knob::AppId => "the application id",
            Knob::PoolCapBytes => "the memory pool cap",
            Knob::EagerThreshold => "the eager threshold",
            Knob::RecvBuffers => "the number of receive buffers",
            Knob::MaxBytesInFlight => "the bytes-in-flight limit",
            Knob::Credits => "the credits per connection",
            Knob::IdleTimeout => "the idle timeout",
            Knob::Device => "the RDMA device",
            Knob::GidIndex => "the GID index",
            Knob::BindHost => "the bind address",
        }
    }
}

impl fmt::Display for Knob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what())
    }
}
