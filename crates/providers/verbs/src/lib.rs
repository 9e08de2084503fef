//! The verbs provider: RDMA over ibverbs (InfiniBand, RoCE; SoftRoCE in the test VM).
//!
//! # Shape
//!
//! * **Control plane**: a tcp socket per connection, driven by the loop like any tcp
//!   connection. It carries the `wire` handshake — and only after that handshake
//!   authenticated the peer does anything get created for it: the queue pair is created and
//!   the two sides exchange their [`bootstrap`] records in `Attach` frames. The socket then
//!   stays silent as the liveness channel (RC queue pairs have no keepalive: a peer process
//!   that dies shows as the socket's end of stream).
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
//! Only [`bootstrap`] (the attach record codec) and [`memlock`] are built without the
//! `ibverbs` feature: the fuzzer and the host tests use them without libibverbs.

pub mod bootstrap;
pub mod memlock;

#[cfg(feature = "ibverbs")]
pub(crate) mod conn;
#[cfg(feature = "ibverbs")]
pub(crate) mod engine;
#[cfg(feature = "ibverbs")]
mod link;
#[cfg(feature = "ibverbs")]
mod sys;

pub use memlock::{can_lock_unlimited, check_memlock, memlock_limit};

#[cfg(feature = "ibverbs")]
pub use provider::{VerbsConfig, VerbsProvider};

#[cfg(feature = "ibverbs")]
mod provider {
    use super::engine::VerbsEngine;
    use super::memlock::{can_lock_unlimited, check_memlock, memlock_limit};
    use super::sys::{self, Device, PoolRegistrar};
    use rdma_shuffle_fabric::error::FabricError;
    use rdma_shuffle_fabric::memory::registration::Registrar;
    use rdma_shuffle_fabric::providers::link::{EngineCtx, ProviderCounters, ProviderEngine};
    use rdma_shuffle_fabric::providers::{Provider, UserRegion};
    use rdma_shuffle_wire::Knob;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// Settings of the verbs provider. Receive and send buffers are per driver (engine), not
    /// per connection.
    #[derive(Clone, Debug)]
    pub struct VerbsConfig {
        /// Device name (`mlx5_0`, `rxe0`); `None` takes the first device with an active port.
        pub device: Option<String>,
        /// Port number (1-based).
        pub port: u8,
        /// GID index; `None` picks the first RoCEv2 IPv4-mapped GID (`::ffff:a.b.c.d`).
        pub gid_index: Option<u8>,
        /// Buffers of each driver's shared receive queue (shared by every peer). Half of
        /// them back the credits its server grants, half the answers its client waits for.
        pub recv_buffers: u32,
        /// Registered send buffers of each driver.
        pub send_buffers: u32,
        /// Largest message (frame + eager payload): the size of every receive and send
        /// buffer. Peers announce theirs when they attach.
        pub max_message: u32,
        /// Bytes the pool may register, checked against the memlock limit when opening.
        pub pool_bytes: u64,
        /// Send-queue depth of each queue pair (sends, reads and binds posted at once).
        pub sq_depth: u32,
        /// One-sided reads one queue pair may have in flight.
        pub max_reads_per_qp: u32,
        /// Receiver-not-ready NAK timer this side asks senders to wait (IB encoding; 26 =
        /// 61 ms).
        pub min_rnr_timer: u8,
        /// Retries after a receiver-not-ready NAK before the send fails (finite: 7 would
        /// retry forever).
        pub rnr_retry: u8,
    }

    impl Default for VerbsConfig {
        /// 512 receive buffers and 128 send buffers of 68 KiB (64 KiB eager threshold plus
        /// frame headroom): about 43 MiB registered per driver whatever the number of peers.
        fn default() -> Self {
            VerbsConfig {
                device: None,
                port: 1,
                gid_index: None,
                recv_buffers: 512,
                send_buffers: 128,
                max_message: 64 * 1024 + 4096,
                pool_bytes: 0,
                sq_depth: 256,
                max_reads_per_qp: 128,
                min_rnr_timer: 26,
                rnr_retry: 6,
            }
        }
    }

    impl VerbsConfig {
        /// Registered bytes of one driver's receive and send buffers.
        pub fn buffer_bytes(&self) -> u64 {
            (self.recv_buffers as u64 + self.send_buffers as u64) * self.max_message as u64
        }
    }

    /// The verbs provider: an opened device and protection domain. Cheap to clone; every
    /// driver made on it builds its own completion queue, shared receive queue and send
    /// buffers.
    #[derive(Clone)]
    pub struct VerbsProvider {
        pub(crate) dev: Arc<Device>,
        pub(crate) config: VerbsConfig,
        registered: Arc<AtomicU64>,
    }

    impl std::fmt::Debug for VerbsProvider {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "VerbsProvider({}, gid index {})", self.dev.name(), self.dev.gid_index)
        }
    }

    impl VerbsProvider {
        /// Opens the device. Fails with a typed error naming what is missing: no device, no
        /// active port, no usable GID, a memlock limit below the pool plus one driver's
        /// buffers.
        pub fn open(config: VerbsConfig) -> Result<Self, FabricError> {
            if config.recv_buffers < 8 || config.send_buffers < 4 || config.max_message < 8192 {
                return Err(FabricError::Provider {
                    provider: "verbs",
                    message: format!(
                        "{} receive buffers, {} send buffers of {} bytes: need at least 8, 4 and 8192",
                        config.recv_buffers, config.send_buffers, config.max_message
                    ),
                    knob: Some(Knob::RecvBuffers),
                });
            }
            let need = config.pool_bytes + config.buffer_bytes();
            check_memlock(memlock_limit(), can_lock_unlimited(), need).map_err(|m| FabricError::Provider {
                provider: "verbs",
                message: m,
                knob: Some(Knob::PoolCapBytes),
            })?;
            let dev = Device::open(config.device.as_deref(), config.port, config.gid_index)?;
            if dev.max_mw == 0 {
                return Err(sys::err(format!(
                    "{} has no memory windows: rendezvous regions could not be exposed to one peer only",
                    dev.name()
                )));
            }
            tracing::info!(device = %dev.name(), gid_index = dev.gid_index, mtu = dev.active_mtu, "verbs provider ready");
            Ok(VerbsProvider { dev: Arc::new(dev), config, registered: Arc::new(AtomicU64::new(0)) })
        }

        /// The device's name.
        pub fn device(&self) -> &str {
            self.dev.name()
        }

        /// The settings in force.
        pub fn config(&self) -> &VerbsConfig {
            &self.config
        }

        /// Registers a caller's buffer for mesh rendezvous (see [`sys::UserRegion`]).
        ///
        /// # Safety
        /// `[ptr, ptr + len)` must stay mapped until the region is dropped.
        pub(crate) unsafe fn register_user(&self, ptr: *const u8, len: usize) -> Result<sys::UserRegion, FabricError> {
            // SAFETY: forwarded contract.
            unsafe { sys::UserRegion::new(&self.dev, ptr, len) }
        }
    }

    impl UserRegion for sys::UserRegion {
        fn rkey(&self) -> u32 {
            sys::UserRegion::rkey(self)
        }

        fn write_lkey(&self) -> Option<u32> {
            sys::UserRegion::write_lkey(self)
        }
    }

    impl Provider for VerbsProvider {
        fn name(&self) -> &'static str {
            "verbs"
        }

        fn registrar(&self) -> Arc<dyn Registrar> {
            Arc::new(PoolRegistrar::new(&self.dev, self.registered.clone()))
        }

        fn engine(&self, ctx: EngineCtx<'_>) -> Result<Box<dyn ProviderEngine>, FabricError> {
            let engine = Arc::new(parking_lot::Mutex::new(VerbsEngine::new(self, ctx)?));
            Ok(Box::new(super::link::VerbsLoop { engine }))
        }

        fn one_sided(&self) -> bool {
            true
        }

        fn max_eager(&self) -> Option<usize> {
            // The message buffer holds the frame header, the eager fixed part and the payload.
            Some(self.config.max_message as usize - rdma_shuffle_fabric::providers::codec::HEAD_ROOM)
        }

        fn counters(&self, c: &ProviderCounters) -> Vec<(&'static str, u64)> {
            let r = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            vec![
                ("verbs_sends", r(&c.sends)),
                ("verbs_send_bytes", r(&c.send_bytes)),
                ("verbs_recvs", r(&c.recvs)),
                ("rdma_reads", r(&c.reads)),
                ("rdma_read_bytes", r(&c.read_bytes)),
                ("qps_created", r(&c.qps_created)),
                ("qps_open", r(&c.qps_open)),
                ("flushed_completions", r(&c.flushed_completions)),
                ("windows_bound", r(&c.windows_bound)),
                ("windows_revoked", r(&c.windows_revoked)),
                ("rnr_errors", r(&c.rnr_errors)),
            ]
        }

        unsafe fn register_user(&self, ptr: *const u8, len: usize) -> Result<Option<Arc<dyn UserRegion>>, FabricError> {
            // SAFETY: forwarded contract: the memory stays mapped while the region lives.
            let r = unsafe { VerbsProvider::register_user(self, ptr, len) }?;
            Ok(Some(Arc::new(r)))
        }

        fn registered_bytes(&self) -> u64 {
            self.registered.load(Ordering::Relaxed)
        }
    }
}
