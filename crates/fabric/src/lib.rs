//! Transports and memory for rdma-shuffle.
//!
//! * [`link`] — what a provider implements: [`Link`]s that move frames and payloads,
//!   [`Listener`]s, and registration of sources for one-sided reads.
//! * [`tcp`], [`sim`] — the providers available everywhere (verbs joins them where a
//!   device exists).
//! * [`pool`] — the tiered pool of registered memory every fetched block lands in.
//! * [`server`], [`client`] — the endpoints that run the `wire` sessions over any provider:
//!   the progress engine.
//!
//! Nothing here is specific to Spark's shuffle; the shuffle crate and, later, collectives
//! build on these pieces.
#![deny(missing_docs)]

pub mod client;
pub mod error;
pub mod link;
pub mod memory;
pub mod server;
pub mod sim;
mod sock;
pub mod tcp;
#[cfg(feature = "verbs")]
pub mod verbs;

pub use client::{BlockSink, ClientEndpoint, ClientEndpointConfig, ClientStats, FetchedBlock};
pub use error::FabricError;
pub use link::{Link, Listener, Payload, Placement, Provider, Received, Source, SourceKeys};
pub use memory::pool;
pub use pool::{Lease, PoolConfig, PoolError, PoolStats, TieredPool};
pub use server::{BlockSource, ServerEndpoint, ServerEndpointConfig, ServerStats};
pub use sim::SimProvider;
pub use tcp::TcpProvider;
