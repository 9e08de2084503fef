//! Providers: the transports a [`Driver`](crate::driver::Driver) runs connections over.
//!
//! * [`tcp`] — real sockets; frames over a byte stream, rendezvous regions streamed on request
//!   (`sendfile` from the data file where it can).
//! * [`sim`] — an in-memory network inside one process: whole messages (like verbs SEND/RECV)
//!   and one-sided reads that obey the access rules of verbs memory windows, so every
//!   protocol and security test runs without a device.
//! * [`verbs`] — RDMA over ibverbs (feature `verbs`): a socket control plane for the
//!   authenticated handshake, then SEND/RECV through one shared receive queue per driver and
//!   one-sided RDMA READ of windows bound to the requesting peer's queue pair.
//!
//! A provider value is the device-level part (a verbs context and protection domain, the sim
//! network); each driver loop builds its own per-engine state from it (sockets, completion
//! queue, shared receive queue). The set of providers is closed: [`Provider::kind`] tells the
//! driver which one it has.

pub mod sim;
pub mod tcp;
pub mod verbs;

use crate::memory::registration::Registrar;
use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;

pub use sim::SimProvider;
pub use tcp::TcpProvider;

/// Bytes a server can serve blocks from: typically one memory-mapped Spark data file.
pub trait Source: Send + Sync + fmt::Debug {
    /// All bytes of the source.
    fn as_bytes(&self) -> &[u8];
    /// A file descriptor with the same bytes at the same offsets, for `sendfile` and for
    /// private mappings of a region (verbs).
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Which provider a [`Provider`] is.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum ProviderKind<'a> {
    /// Sockets.
    Tcp(&'a TcpProvider),
    /// The in-memory network.
    Sim(&'a SimProvider),
    /// RDMA verbs.
    #[cfg(feature = "verbs")]
    Verbs(&'a verbs::VerbsProvider),
}

/// A transport: tcp, verbs or sim.
pub trait Provider: Send + Sync + fmt::Debug {
    /// Short name: `"tcp"`, `"verbs"`, `"sim"`.
    fn name(&self) -> &'static str;
    /// Registers pool memory with the device (no-op where nothing needs registering).
    fn registrar(&self) -> Arc<dyn Registrar>;
    /// Which provider this is, for the driver.
    fn kind(&self) -> ProviderKind<'_>;
    /// Bytes of pool memory currently registered through [`registrar`](Provider::registrar)
    /// (0 where nothing is registered).
    fn registered_bytes(&self) -> u64 {
        0
    }
}
