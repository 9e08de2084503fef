//! **Mobius**: collective communication for distributed deep learning, on the rdma-shuffle
//! fabric.
//!
//! Layers, bottom up:
//!
//! * **transport** — [`Transport`]: tagged, ordered, full-duplex messages among ranks, eager
//!   or rendezvous. [`MeshTransport`] is a thin adapter over [`crate::mesh`],
//!   where every provider-facing piece lives (tcp, sim, verbs);
//! * **algorithms** — ring (segmented, pipelined), recursive doubling, halving-doubling
//!   (Rabenseifner), binomial trees, pipelined chains, direct and pairwise exchange, for any
//!   world size;
//! * **policy** — [`Policy`]: per call, the algorithm, segment size and protocol with the
//!   least estimated time under a cost model measured when the communicator starts
//!   (`MOBIUS_ALGO`, `MOBIUS_PROTO`, `MOBIUS_SEGMENT` override; `MOBIUS_DEBUG=policy` logs);
//! * **input** — [`Communicator`] (this crate's Rust API) and the Python package `mobius`
//!   with its `torch.distributed` backend (crate `mobius-py`).
//!
//! ```no_run
//! use mobius_collective::{Communicator, ReduceOp};
//! // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as for torch.distributed.
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.allreduce(&mut grads, ReduceOp::Avg)?;
//! # Ok::<(), mobius_collective::CollectiveError>(())
//! ```
#![deny(missing_docs)]

mod algo;
mod comm;
mod dtype;
mod error;
mod header;
pub mod mesh;
mod mesh_transport;
mod policy;
mod store;
mod transport;

pub use comm::{host_identity, CommConfig, CommStats, Communicator, GroupKey, LinkCost, Rendezvous, StoreRendezvous, MAX_WORLD};
pub use dtype::{finish_avg, reduce_into, DType, Element, ReduceOp};
pub use error::CollectiveError;
pub use mesh_transport::MeshTransport;
pub use policy::{parse_bytes, record_segment, Algo, CostModel, Decision, Op, Overrides, Policy, Topology, RECORD_PATH_MAX};
pub use store::{StoreClient, StoreServer};
pub use transport::{Proto, Tag, Transport, TransportError, TransportErrorKind, TransportStats};

/// The fabric pieces a caller needs to build a communicator on a provider of its choice.
pub mod fabric {
    pub use crate::mesh::{Mesh, MeshConfig, MeshListener};
    pub use rdma_shuffle_fabric::Provider;
    pub use rdma_shuffle_providers::{sim::SimProvider, tcp::TcpProvider};
}
