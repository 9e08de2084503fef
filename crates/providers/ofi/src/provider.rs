//! The ofi provider: the libfabric provider and domain chosen by the settings, whose engines
//! each open one reliable-datagram endpoint, and whose registrar registers pool memory where
//! the provider needs local registration.
#![forbid(unsafe_code)]

use crate::config::OfiConfig;
use crate::conn::OfiConn;
use crate::engine::{OfiEngine, SharedEngine};
use crate::sys::{runtime_version, Domain, PoolRegistrar};
use crate::Settings;
use mio::{Registry, Token};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::memory::registration::Registrar;
use rdma_shuffle_fabric::providers::link::{EngineCtx, Link, Listener, ProviderCounters, ProviderEngine};
use rdma_shuffle_fabric::providers::{Provider, ProviderCapabilities};
use rdma_shuffle_provider_tcp::{TcpConn, TcpListener};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The ofi provider: an opened libfabric domain of the provider the settings name. Every
/// driver made on it opens its own endpoint (completion queue, address vector).
pub struct OfiProvider {
    domain: Domain,
    cfg: OfiConfig,
    one_sided: bool,
    /// [`Settings::spare_bytes`].
    spare_bytes: usize,
    registrar: Arc<PoolRegistrar>,
}

impl std::fmt::Debug for OfiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.domain.info();
        write!(f, "OfiProvider({} on {}, one-sided {})", i.provider, i.domain, self.one_sided)
    }
}

impl OfiProvider {
    /// Opens the libfabric provider `settings` name: checks the library's version, finds
    /// the provider with reliable-datagram endpoints, and opens its domain.
    pub fn open(settings: &Settings) -> Result<OfiProvider, FabricError> {
        let version = runtime_version();
        let major = version.split('.').next().and_then(|m| m.parse::<u32>().ok()).unwrap_or(0);
        if major < 2 {
            return Err(FabricError::Provider {
                provider: "ofi",
                message: format!(
                    "the libfabric loaded is {version}; this provider needs 2.0 or later (put its directory first on LD_LIBRARY_PATH)"
                ),
                knob: None,
            });
        }
        let mut cfg = OfiConfig {
            provider: settings.provider.clone(),
            domain: settings.domain.clone(),
            rma: settings.rma,
            rx_depth: settings.rx_depth,
            max_msg: settings.max_msg,
            ..OfiConfig::default()
        };
        let domain = Domain::open(&cfg).map_err(crate::engine::ofi)?;
        let info = domain.info();
        if info.provider.contains("ofi_rxm") {
            // ofi_rxm sends what exceeds its eager size (FI_OFI_RXM_BUFFER_SIZE, 16 KiB by
            // default) by segmentation, and 2.1 crashes closing an endpoint whose peer
            // vanished in the middle of such a message (a null free_entry of its shared
            // receive context, seen in the suite). Messages are cut to its eager size here
            // instead (the receive buffers, and so the pieces peers cut frames into).
            cfg.max_msg = cfg.max_msg.min(rxm_eager_size()).max(crate::attach::MIN_MESSAGE as usize);
        }
        if cfg.max_msg > info.max_msg_size {
            return Err(crate::engine::dead(&format!(
                "{} takes messages of at most {} bytes, fewer than the {} the eager threshold needs",
                info.provider, info.max_msg_size, cfg.max_msg
            )));
        }
        let one_sided = info.rma && settings.rma;
        tracing::info!(provider = %info.provider, fabric = %info.fabric, domain = %info.domain, one_sided,
            mr_local = info.mr_local, libfabric = %version, "ofi provider ready");
        let registrar = Arc::new(PoolRegistrar::new(&domain));
        Ok(OfiProvider { domain, cfg, one_sided, spare_bytes: settings.spare_bytes, registrar })
    }

    /// A line for the log: the library, the provider, its fabric and domain, how blocks move.
    pub fn description(&self) -> String {
        let i = self.domain.info();
        format!(
            "ofi: libfabric {} provider {} on {} ({}), large blocks by {}",
            runtime_version(),
            i.provider,
            i.domain,
            i.fabric,
            if self.one_sided { "one-sided fi_read" } else { "messages (no RMA)" }
        )
    }
}

impl Provider for OfiProvider {
    fn name(&self) -> &'static str {
        "ofi"
    }

    /// One-sided where the provider offers RMA; frames of any size (cut to the receive
    /// buffers and put back together).
    fn capabilities(&self) -> ProviderCapabilities {
        ProviderCapabilities { one_sided: self.one_sided, ..ProviderCapabilities::default() }
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        self.registrar.clone()
    }

    fn engine(&self, ctx: EngineCtx<'_>) -> Result<Box<dyn ProviderEngine>, FabricError> {
        let engine = OfiEngine::new(self.domain.clone(), self.cfg.clone(), self.spare_bytes, ctx)?;
        Ok(Box::new(OfiLoop { engine: Arc::new(parking_lot::Mutex::new(engine)), one_sided: self.one_sided }))
    }

    fn counters(&self, c: &ProviderCounters) -> Vec<(&'static str, u64)> {
        let r = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("ofi_sends", r(&c.sends)),
            ("ofi_send_bytes", r(&c.send_bytes)),
            ("ofi_recvs", r(&c.recvs)),
            ("ofi_reads", r(&c.reads)),
            ("ofi_read_bytes", r(&c.read_bytes)),
            ("ofi_exposures", r(&c.windows_bound)),
            ("ofi_revocations", r(&c.windows_revoked)),
            ("ofi_failed_completions", r(&c.flushed_completions)),
            ("ofi_dropped_messages", r(&c.rnr_errors)),
            ("ofi_peers_inserted", r(&c.qps_created)),
            ("ofi_peers", r(&c.qps_open)),
        ]
    }

    fn registered_bytes(&self) -> u64 {
        self.registrar.registered_bytes()
    }
}

/// ofi_rxm's eager message size: `FI_OFI_RXM_BUFFER_SIZE` (bytes), 16 KiB by default.
fn rxm_eager_size() -> usize {
    std::env::var("FI_OFI_RXM_BUFFER_SIZE").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(16 << 10)
}

/// The ofi engine of one driver loop, as the loop holds it.
struct OfiLoop {
    engine: SharedEngine,
    one_sided: bool,
}

impl ProviderEngine for OfiLoop {
    /// A connection whose control socket is connecting; it attaches to the endpoint after
    /// the handshake.
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError> {
        Ok(Box::new(OfiConn::new(TcpConn::connect(addr)?, self.engine.clone(), false, self.one_sided)))
    }

    /// A socket listener whose accepted connections are control planes of ofi links. Its
    /// address is the one this engine's endpoint binds (peers reach it there).
    fn listen(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
        _notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError> {
        let (engine, one_sided) = (self.engine.clone(), self.one_sided);
        let (local, l) = TcpListener::bind(
            addr,
            registry,
            token,
            Box::new(move |c| Box::new(OfiConn::new(c, engine.clone(), true, one_sided))),
        )?;
        self.engine.lock().listening_on(local.ip())?;
        Ok((local, Box::new(l)))
    }

    fn poll_completions(&mut self) -> Vec<u64> {
        self.engine.lock().collect()
    }

    fn registered_bytes(&self) -> u64 {
        self.engine.lock().registered_bytes()
    }
}
