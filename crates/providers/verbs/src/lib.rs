//! The verbs provider: RDMA over ibverbs (InfiniBand, RoCE; SoftRoCE in the test VM).
//!
//! # Shape
//!
//! * **Control plane**: a tcp socket per connection, driven by the loop like any tcp
//!   connection. It carries the protocol's handshake — and only once the loop told the link
//!   that the peer authenticated (`Link::authenticated`) does anything get created for it:
//!   the queue pair is created and the two sides exchange their [`bootstrap`] records, each
//!   in the protocol's frame for it (`Codec::attach_frame`); the link consumes the peer's
//!   record itself and reports `Incoming::Attached` when messages flow. A record before
//!   authentication fails the connection. The socket then stays silent as the liveness
//!   channel (RC queue pairs have no keepalive: a peer process that dies shows as the
//!   socket's end of stream).
//! * **Engine**: a driver's verbs state (completion queue, shared receive queue, send
//!   buffers, routing of completions, credit budgets) is one `VerbsEngine` that the loop and
//!   every link of it hold, typed, behind an uncontended lock (only the loop's holder calls
//!   in).
//! * **Data plane**: frames travel as SEND/RECV messages. Every connection of a driver
//!   receives into **one shared receive queue** ([`VerbsConfig::recv_buffers`] buffers of
//!   [`VerbsConfig::max_message`] bytes), so receive memory does not grow with the number of
//!   peers. Credits are granted against it: a server grants each client a share of its half
//!   of the buffers (each credit can be in at most one message towards it), and a client
//!   requests only as many blocks as its half has room for answers (every block is answered
//!   by exactly one message). A sender that still overruns a receiver (a peer ignoring its
//!   credits) gets receiver-not-ready NAKs, retries a finite number of times, and fails with
//!   a typed error — never hangs.
//! * **Rendezvous**: the server exposes each large block for exactly one client and exactly
//!   as long as that client holds it: a private mapping of the block's pages, registered for
//!   window binding only, and a **type-2 memory window** bound to that client's queue pair
//!   with remote read. Only that queue pair can use the key; the client's `Release`
//!   deallocates the window, after which the key is dead. (A per-region MR with remote read
//!   would be readable by any queue pair of the protection domain, i.e. by every other peer
//!   that learns the key; a protection domain per connection would need a receive queue per
//!   connection, since receive buffers must be in the queue pair's domain. rxe supports
//!   type-2 windows, as do mlx5 and other NICs.) The client reads it with one-sided RDMA
//!   READs posted asynchronously — many in flight, bounded by bytes in flight, the pool and a
//!   per-queue-pair cap, never by threads.
//! * **Failure**: a connection that fails moves its queue pair to the error state and waits
//!   for the (flush) completion of every request it posted before any buffer a request
//!   targets goes back to the pool; [`sys`] enforces it by owning those buffers until then.
//!
//! Only [`bootstrap`] (the attach record codec), [`memlock`], the registration and the pure
//! parts of [`probe`] are built without the `ibverbs` feature: the fuzzer, the preflight and the
//! host tests use them without libibverbs.

pub mod bootstrap;
pub mod memlock;

#[cfg(feature = "ibverbs")]
mod config;
#[cfg(feature = "ibverbs")]
pub(crate) mod conn;
#[cfg(feature = "ibverbs")]
pub(crate) mod engine;
#[cfg(feature = "ibverbs")]
mod link;
mod ports;
pub mod probe;
#[cfg(feature = "ibverbs")]
mod provider;
#[cfg(feature = "ibverbs")]
mod sys;

pub use memlock::{can_lock_unlimited, check_memlock, memlock_limit};

/// Registered send buffers of each driver ([`VerbsConfig`]'s default), known without the
/// `ibverbs` feature so that an engine can budget them before it opens a device.
pub const DEFAULT_SEND_BUFFERS: u32 = 128;
/// Buffers of each driver's shared receive queue where the options name none.
pub const DEFAULT_RECV_BUFFERS: u32 = 512;
/// Size of every receive and send buffer where the options name no eager message: a 64 KiB
/// eager payload and room for its frame.
pub const DEFAULT_MAX_MESSAGE: u32 = 64 * 1024 + 4096;

#[cfg(feature = "ibverbs")]
pub use config::VerbsConfig;
#[cfg(feature = "ibverbs")]
pub use provider::VerbsProvider;

use rdma_shuffle_fabric::providers::registry::{FixedMemory, Opened, ProviderOptions, Registration};
use rdma_shuffle_fabric::FabricError;

/// The verbs provider in the registry: `verbs`, on the device, GID index, message size,
/// receive buffers and pool size of the options. In a build without the `ibverbs` feature
/// (libibverbs was not available) opening it is an error that says so.
pub fn registration() -> Registration {
    Registration { name: "verbs", about: "RDMA verbs (InfiniBand, RoCE): SEND/RECV and one-sided RDMA READ", open, fixed_memory }
}

/// What verbs pins whatever the traffic: each driver's receive and send buffers (the
/// `recv_buffers` of the options and [`DEFAULT_SEND_BUFFERS`], of `eager_message` bytes each),
/// and the data exposed for RDMA READ at once (`exposed_bytes`: registration pins it).
pub fn fixed_memory(o: &ProviderOptions) -> FixedMemory {
    let message = u64::from(o.eager_message.unwrap_or(DEFAULT_MAX_MESSAGE));
    let buffers = u64::from(o.recv_buffers.unwrap_or(DEFAULT_RECV_BUFFERS)) + u64::from(DEFAULT_SEND_BUFFERS);
    FixedMemory::default().with(buffers * message, "verbs receive and send buffers", &["recv_buffers", "eager_message"]).with(
        o.exposed_bytes,
        "blocks exposed for RDMA READ",
        &["exposed_bytes"],
    )
}

#[cfg(feature = "ibverbs")]
fn open(o: &ProviderOptions) -> Result<Opened, FabricError> {
    let d = VerbsConfig::default();
    let vc = VerbsConfig {
        device: o.device.clone(),
        gid_index: o.gid_index,
        max_message: o.eager_message.unwrap_or(d.max_message),
        recv_buffers: o.recv_buffers.unwrap_or(d.recv_buffers),
        pool_bytes: o.pool_bytes,
        ..d
    };
    let p = VerbsProvider::open(vc)?;
    let description = format!("verbs on RDMA device {}", p.device());
    Ok(Opened::new(std::sync::Arc::new(p), description))
}

#[cfg(not(feature = "ibverbs"))]
fn open(_: &ProviderOptions) -> Result<Opened, FabricError> {
    Err(FabricError::Unsupported(
        "this build of the native library has no verbs provider (built without the `verbs` feature: libibverbs was not available)"
            .into(),
    ))
}
