//! The conformance suites a provider of the rdma-shuffle fabric passes, written once and run by
//! every provider's crate with one line:
//!
//! ```ignore
//! // crates/providers/<name>/tests/conformance.rs
//! fn provider() -> Arc<dyn Provider> { Arc::new(MyProvider::new()) }
//! rdma_shuffle_testkit::provider_suite!(provider);
//! ```
//!
//! * [`shuffle`] — the shuffle's block protocol over the provider: eager and rendezvous bytes
//!   equal to the file's, authentication, credits, typed errors for bad input, vanishing
//!   peers, backpressure, idle connections, resource bounds
//!   ([`provider_suite!`](crate::provider_suite));
//! * [`mesh`] — Mobius's mesh over the provider: ordered messages between every pair, posted
//!   and reducing receives, peers that close or die ([`mesh_suite!`](crate::mesh_suite)).
//!
//! Every test takes a provider [`Factory`](shuffle::Factory), so the same assertions run over
//! sim, tcp, shm and (inside the SoftRoCE VM) verbs.
#![allow(clippy::missing_panics_doc)]

pub mod mesh;
pub mod shuffle;
