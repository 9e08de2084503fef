//! Shuffle layer of rdma-shuffle: the executor-side store of Spark's committed map outputs
//! (served by the block server) and the test-data generator used across the workspace.
//!
//! * [`store`] — [`store::MapOutputStore`]: Spark's own `.data`/`.index` files, indexed in
//!   memory, mapped read-only, resolved to validated byte ranges.
//! * [`server`] — [`BlockServer`]: the store exposed through a fabric endpoint.
//! * [`client`] — [`BlockClient`]: fetches Spark shuffle blocks from many block servers.
//! * [`budget`] — the engine's native-memory bound and the pool cap it leaves.
//! * [`doctor`] — the preflight an operator runs on a node (devices, GIDs, memlock, a
//!   loopback transfer), behind the plugin's `Doctor`.
//! * [`engine`] — [`Engine`]: one executor's provider, driver (event loop), pool, server and
//!   client, from Spark's settings.
//! * [`knobs`] — the Spark key behind each setting an error of a lower layer points at.
//! * [`settings`] — the `spark.shuffle.rdma.*` schema (`settings/settings.tsv`, compiled in):
//!   defaults, parsing and validation of [`EngineConfig`].
//! * `channel` (feature `testing`) — raw `wire` frames over any provider, for the
//!   conformance and security suites to play a misbehaving peer.
//! * [`testkit`] — writes map outputs in Spark's exact layout (and corrupt variants) for tests
//!   and benchmarks.
#![deny(missing_docs)]

pub mod blocks;
pub mod budget;
#[cfg(any(test, feature = "testing"))]
pub mod channel;
pub mod client;
pub mod doctor;
pub mod engine;
pub mod knobs;
pub mod open_files;
pub mod server;
pub mod settings;
pub mod store;
pub mod testkit;

/// What the JNI layer (which talks to this crate only) needs of the layers below.
pub use blocks::{BlockSink, ChunkSink, FetchedBlock, StreamConfig};
pub use client::{BlockClient, ShuffleBlock};
pub use engine::{Engine, EngineConfig, EngineError};
pub use rdma_shuffle_fabric::Lease;
pub use rdma_shuffle_wire::{BlockFailure, FailureCode};
pub use server::{BlockServer, ServerError};
