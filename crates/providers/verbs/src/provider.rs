//! The verbs provider: the opened device and protection domain every driver builds its
//! engine from.

use crate::config::VerbsConfig;
use crate::engine::VerbsEngine;
use crate::link::VerbsLoop;
use crate::memlock::{can_lock_unlimited, check_memlock, memlock_limit};
use crate::sys::{self, Device, PoolRegistrar};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::registration::Registrar;
use rdma_shuffle_fabric::providers::link::{EngineCtx, ProviderCounters, ProviderEngine};
use rdma_shuffle_fabric::providers::{Provider, ProviderCapabilities, UserRegion};
use rdma_shuffle_wire::Knob;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
        // The device first: where there is none, that is the answer, whatever the limit.
        let dev = Device::open(config.device.as_deref(), config.port, config.gid_index)?;
        let need = config.pool_bytes + config.buffer_bytes();
        check_memlock(memlock_limit(), can_lock_unlimited(), need).map_err(|m| FabricError::Provider {
            provider: "verbs",
            message: m,
            knob: Some(Knob::PoolCapBytes),
        })?;
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
        let engine = Arc::new(parking_lot::Mutex::new(VerbsEngine::new(self.dev.clone(), self.config.clone(), ctx)?));
        Ok(Box::new(VerbsLoop { engine }))
    }

    /// One-sided; eager payloads bounded by the message buffers, which hold the frame
    /// header, the eager fixed part and the payload.
    fn capabilities(&self) -> ProviderCapabilities {
        ProviderCapabilities {
            one_sided: true,
            max_eager: Some(self.config.max_message as usize - rdma_shuffle_fabric::providers::codec::HEAD_ROOM),
            ..ProviderCapabilities::default()
        }
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
