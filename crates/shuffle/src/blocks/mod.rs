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
pub mod codec;
mod delivery;
mod exposure;
pub mod server;

pub use budget::BudgetGuard;

pub use client::{BlockSink, ChunkSink, ClientEndpoint, ClientEndpointConfig, ClientStats, FetchedBlock, StreamConfig};
pub use server::{BlockSource, ServerEndpoint, ServerEndpointConfig, ServerStats};

use rdma_shuffle_fabric::driver::{ConnKey, Loop};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The block protocol's counters and gauges that belong to a driver loop rather than to one
/// endpoint: the exposure budget and the unauthenticated connections the loop's servers
/// share, and the delivery of every client's blocks. Every endpoint on the loop holds it
/// ([`ServerEndpoint::loop_stats`], [`ClientEndpoint::loop_stats`]).
#[derive(Debug, Default)]
pub struct BlockLoopStats {
    /// Server connections accepted but not yet authenticated, now.
    pub pending_handshakes: AtomicU64,
    /// Bytes of rendezvous regions exposed to peers now (one-sided transports), within the
    /// loop's exposure budget ([`ServerEndpointConfig::max_bytes_exposed`]).
    pub exposed_bytes: AtomicU64,
    /// The most bytes ever exposed at once.
    pub peak_exposed_bytes: AtomicU64,
    /// Regions that waited for room in the exposure budget before being exposed.
    pub exposure_waits: AtomicU64,
    /// Block outcomes handed to their sinks on the loop thread (inline sinks).
    pub inline_deliveries: AtomicU64,
    /// Block outcomes handed to the delivery thread.
    pub queued_deliveries: AtomicU64,
}

/// The loop's [`BlockLoopStats`] (made on first use).
pub(crate) fn loop_stats(lp: &mut Loop) -> Arc<BlockLoopStats> {
    lp.state::<Arc<BlockLoopStats>>().clone()
}

/// A block waiting for local memory.
pub(crate) struct MemWaiter {
    pub(crate) conn: ConnKey,
    pub(crate) kind: client::MemWait,
}
