//! The protocol-neutral core of rdma-shuffle: the driver, memory, and the provider seam.
//!
//! * [`memory`] — the tiered pool of registered memory every fetched block lands in, and the
//!   registration of memory with a device.
//! * [`providers`] — the seam a transport implements ([`Provider`], its per-loop
//!   [`ProviderEngine`](providers::link::ProviderEngine) and its connections'
//!   [`Link`](providers::link::Link)s). The transports are crates of their own
//!   (`crates/providers/<name>`: tcp, shm, sim, verbs), opened by name through
//!   `rdma-shuffle-providers`.
//! * [`driver`] — one event loop per engine that runs every connection of every provider.
//!   A protocol plugs in from outside: a [`Handler`](driver::Handler) per connection, an
//!   [`Acceptor`](driver::Acceptor) per listener, [`Job`](driver::Job)s from its callers, and
//!   loop-wide [state](driver::Loop::state). The protocols live with their owners: the
//!   shuffle's block endpoints in crates/shuffle, Mobius's mesh in crates/collective. Each
//!   frames its own messages; a provider cuts them with the protocol's
//!   [`Codec`](driver::Codec) and never reads inside them.
//!
//! Nothing here is specific to Spark: settings arrive as plain values, and errors name the
//! setting to change as a [`Knob`](rdma_shuffle_wire::Knob). The shuffle crate and the
//! collectives (crates/collective) build on these pieces.
#![deny(missing_docs)]

pub mod driver;
pub mod error;
pub mod memory;
pub mod providers;

pub use driver::{Driver, DriverConfig, DriverStats, DEFAULT_SPIN, MAX_SPIN};
pub use error::FabricError;
pub use memory::pool;
pub use pool::{Lease, PoolConfig, PoolError, PoolStats, TieredPool};
pub use providers::registry::{Fit, FixedMemory, FixedPart, ProviderOptions, Registration, Registry};
pub use providers::{Provider, ProviderCapabilities, Source};
