//! The shuffle's block endpoints, a protocol on the fabric's driver: the fetching client
//! ([`ClientEndpoint`]) and the serving server ([`ServerEndpoint`]) that run the `wire`
//! sessions over any provider, with the bytes-in-flight budget ([`BudgetGuard`]), the
//! engine-wide budget of exposed rendezvous regions, and the delivery of fetched blocks to
//! their sinks.
//!
//! They plug into the driver the way any protocol does: a
//! [`Handler`](rdma_shuffle_fabric::driver::Handler) per connection, an
//! [`Acceptor`](rdma_shuffle_fabric::driver::Acceptor) for a server's listener,
//! [`Job`](rdma_shuffle_fabric::driver::Job)s for callers' commands (a fetch is one, answered
//! even if the loop never runs it), a [`Service`](rdma_shuffle_fabric::driver::Service) each
//! for memory waiters, the spin rule and shutdown, and their endpoints as
//! [loop state](rdma_shuffle_fabric::driver::Loop::state).

mod budget;
pub mod client;
mod delivery;
mod exposure;
pub mod server;

pub use budget::BudgetGuard;
pub use client::{BlockSink, ChunkSink, ClientEndpoint, ClientEndpointConfig, ClientStats, FetchedBlock, StreamConfig};
pub use server::{BlockSource, ServerEndpoint, ServerEndpointConfig, ServerStats};

use rdma_shuffle_fabric::driver::ConnKey;

/// A block waiting for local memory.
pub(crate) struct MemWaiter {
    pub(crate) conn: ConnKey,
    pub(crate) kind: client::MemWait,
}
