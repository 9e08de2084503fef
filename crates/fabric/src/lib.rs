//! Transports and memory for rdma-shuffle.
//!
//! * [`memory`] — the tiered pool of registered memory every fetched block lands in, and the
//!   registration of memory with a device.
//! * [`providers`] — the transports: [`tcp`](providers::tcp), [`sim`](providers::sim) and,
//!   with the `verbs` feature, [`verbs`](providers::verbs).
//! * [`driver`] — one event loop per engine that runs every connection of every provider:
//!   the block client and server endpoints that execute the `wire` sessions, raw channels,
//!   and mesh links.
//! * [`mesh`] — persistent all-to-all links among the ranks of a collective group (Mobius),
//!   with tagged eager and zero-copy rendezvous messages, as a connection kind of the driver.
//!
//! Nothing here is specific to Spark: settings arrive as plain values, and errors name the
//! setting to change as a [`Knob`](rdma_shuffle_wire::Knob). The shuffle crate and the
//! collectives (crates/collective) build on these pieces.
#![deny(missing_docs)]

pub mod driver;
pub mod error;
pub mod memory;
pub mod mesh;
pub mod providers;

pub use driver::{
    BlockSink, BlockSource, BudgetGuard, Channel, ChannelListener, ChunkSink, ClientEndpoint, ClientEndpointConfig, ClientStats,
    Driver, DriverConfig, DriverStats, FetchedBlock, PendingRead, Received, ServerEndpoint, ServerEndpointConfig, ServerStats,
    StreamConfig, DEFAULT_SPIN, MAX_SPIN,
};
pub use error::FabricError;
pub use memory::pool;
pub use pool::{Lease, PoolConfig, PoolError, PoolStats, TieredPool};
pub use providers::verbs;
pub use providers::{open_provider, OpenedProvider, Provider, ProviderChoice, ProviderSpec, SimProvider, Source, TcpProvider};
