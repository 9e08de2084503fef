//! rdma-shuffle's libfabric provider.
//!
//! libfabric (the OFI working group's fabric interface, used by MPICH, Open MPI and NCCL's
//! AWS plugin) reaches fabrics the verbs provider does not: AWS EFA, HPE Slingshot (`cxi`),
//! Cornelis Omni-Path (`opx`), Intel's `psm3`, besides TCP (`tcp;ofi_rxm`), shared memory
//! (`shm`) and InfiniBand/RoCE (`verbs;ofi_rxm`). This crate drives any of them through one
//! reliable-datagram endpoint (`FI_EP_RDM`) per process: small messages by send, large blocks
//! by one-sided `fi_read` of registered memory where the provider offers RMA.
//!
//! The layer over libfabric is small and safe: [`Endpoint`] (fabric, domain, completion
//! queue, address vector and endpoint, closed in the order libfabric requires),
//! [`MemoryRegion`] registrations, owned [`Buffer`]s kept alive while an operation is in
//! flight, and typed [`OfiError`]s naming the libfabric call and its `fi_strerror` text.
//! All `unsafe` code is in one module, `sys`.
//!
//! Building: the `libfabric` feature links libfabric >= 2.0 through `ofi-libfabric-sys`
//! (found by pkg-config). Without it the crate still builds (so the workspace builds on any
//! machine) and [`Endpoint::open`] returns [`OfiError::NotBuilt`].
//! `scripts/ensure-libfabric.sh` builds libfabric 2.1 once per machine:
//!
//! ```text
//! export PKG_CONFIG_PATH=$(bash scripts/ensure-libfabric.sh)/lib/pkgconfig
//! cargo test -p rdma-shuffle-provider-ofi --features libfabric
//! ```
//!
//! The build script puts libfabric's library directory in the tests' rpath, and exports it
//! to dependents as `DEP_RDMA_SHUFFLE_OFI_LIBDIR`.

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod attach;
mod config;
mod error;
#[cfg(feature = "libfabric")]
mod sys;
#[cfg(not(feature = "libfabric"))]
mod unbuilt;

pub use config::{EndpointInfo, OfiConfig, PeerAddr, RemoteRegion, DEFAULT_PROVIDER};
pub use error::OfiError;
#[cfg(feature = "libfabric")]
pub use sys::{
    runtime_version, Access, Buffer, Completion, Counters, Domain, Endpoint, LocalDesc, MemoryRegion, PoolRegistrar, PostError,
};
#[cfg(not(feature = "libfabric"))]
pub use unbuilt::Endpoint;

/// Whether this build links libfabric.
pub const BUILT_WITH_LIBFABRIC: bool = cfg!(feature = "libfabric");
