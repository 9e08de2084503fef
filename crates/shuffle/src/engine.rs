//! One executor's engine: provider, pool, block server and block client, configured from
//! Spark's `spark.shuffle.rdma.*` settings. This is what the JNI layer opens per executor.

use crate::blocks::{ClientEndpointConfig, ServerEndpointConfig};
use crate::budget::MemoryBudget;
use crate::knobs::{render_error, with_setting};
use crate::{BlockClient, BlockServer, ServerError};
use rdma_shuffle_fabric::memory::accounting;
use rdma_shuffle_fabric::pool::{PoolConfig, TieredPool};
use rdma_shuffle_fabric::ProviderOptions;
use rdma_shuffle_fabric::{Driver, DriverConfig, FabricError, PoolError, Provider};
use rdma_shuffle_providers as providers;
use rdma_shuffle_wire::{FailureCode, Limits, Secret};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// A setting that cannot be used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A `key=value` setting is malformed or out of range.
    #[error("setting {key}='{value}': {why}")]
    Setting {
        /// Full key.
        key: String,
        /// Value given.
        value: String,
        /// What is allowed.
        why: String,
    },
    /// The requested transport cannot be had.
    #[error("{0}")]
    Transport(String),
    /// The pool could not be built.
    #[error("{}", with_setting(&.0.to_string(), .0.knob()))]
    Pool(#[from] PoolError),
    /// The server could not start.
    #[error("{}", match .0 { ServerError::Fabric(e) => render_error(e), e => e.to_string() })]
    Server(#[from] ServerError),
    /// The driver or the client could not start.
    #[error("{}", render_error(.0))]
    Fabric(#[from] FabricError),
}

/// Settings of an engine. Field docs name the Spark setting each comes from; defaults, parsing
/// and validation are in [`crate::settings`] (from the one schema, `settings/settings.tsv`).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// `spark.shuffle.rdma.transport`: a provider's name in the registry
    /// (`rdma_shuffle_providers::registry`), or `auto`: verbs when a usable RDMA device
    /// exists, tcp otherwise.
    pub transport: String,
    /// `spark.shuffle.rdma.<provider>.<name>` settings of one provider (`ofi.provider`),
    /// handed to it as they are.
    pub provider_settings: BTreeMap<String, String>,
    /// `spark.shuffle.rdma.eagerThreshold` (bytes).
    pub eager_threshold: u32,
    /// `spark.shuffle.rdma.pool.tiers` (bytes).
    pub pool_tiers: Vec<usize>,
    /// `spark.shuffle.rdma.pool.capBytes`; `None`: derived from [`memory_bound`](Self::memory_bound)
    /// ([`MemoryBudget`](crate::budget::MemoryBudget)).
    pub pool_cap: Option<u64>,
    /// The bound on all the engine's native memory, from Spark's memory settings
    /// ([`MemoryBound::from_spark`](crate::budget::MemoryBound::from_spark)); `None` outside Spark.
    pub memory_bound: Option<crate::budget::MemoryBound>,
    /// `spark.shuffle.rdma.memory.overheadPercent`: the bound's share of the memory overhead.
    pub overhead_percent: u32,
    /// `spark.shuffle.rdma.port` (0 = ephemeral).
    pub port: u16,
    /// `spark.shuffle.rdma.bindHost`: the executor's own address, which the caller must set
    /// (the JVM passes the executor's host). The default, unspecified, is refused by
    /// [`Engine::open`]: a block server on every interface is not what anyone asked for.
    pub bind_host: IpAddr,
    /// `spark.shuffle.rdma.connectTimeout` (ms).
    pub connect_timeout: Duration,
    /// `spark.shuffle.rdma.fetchTimeout` (ms).
    pub fetch_timeout: Duration,
    /// `spark.shuffle.rdma.idleTimeout`: connections idle this long are closed.
    pub idle_timeout: Duration,
    /// `spark.shuffle.rdma.credits`: blocks in flight per connection.
    pub credits: u32,
    /// `spark.shuffle.rdma.maxBytesInFlight`: rendezvous bytes being transferred at once.
    pub max_bytes_in_flight: u64,
    /// `spark.shuffle.rdma.recvBuffers`: verbs receive buffers in the engine's shared receive
    /// queue.
    pub recv_buffers: u32,
    /// `spark.shuffle.rdma.store.maxOpenFiles`: data files the block server keeps open.
    pub max_open_files: usize,
    /// `spark.shuffle.rdma.maxBytesExposed`: bytes of rendezvous regions the block server
    /// exposes at once, over all peers (verbs).
    pub max_bytes_exposed: u64,
    /// `spark.authenticate.secret` when `spark.authenticate=true`.
    pub secret: Option<Secret>,
    /// `spark.executor.id`, for logs and errors.
    pub executor_id: String,
    /// `spark.shuffle.rdma.device`: RDMA device name (default: first with an active port).
    pub device: Option<String>,
    /// `spark.shuffle.rdma.gidIndex`: GID index (default: first RoCEv2 IPv4-mapped GID).
    pub gid_index: Option<u8>,
    /// `spark.app.id`: engines of different applications refuse each other.
    pub app_id: String,
    /// How long the engine's loop spins before sleeping while a fetch is in flight
    /// ([`DriverConfig::spin`]; default [`rdma_shuffle_fabric::DEFAULT_SPIN`]). Not a Spark
    /// setting: benchmarks and tests set it.
    pub spin: Duration,
}

/// The provider an engine opens, why, and how its native memory is split for it.
pub struct Selected {
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// Why this provider (logged once by the caller).
    pub why: String,
    /// The pool cap and fixed memory for this provider ([`MemoryBudget`]).
    pub budget: MemoryBudget,
}

/// The options an engine of `config` opens its provider with; `pool_bytes`: what the pool
/// may register (0 where only the provider's [fixed memory](crate::budget::fixed_memory) is
/// asked, which does not follow it).
pub fn provider_options(config: &EngineConfig, pool_bytes: u64) -> ProviderOptions {
    ProviderOptions {
        device: config.device.clone(),
        gid_index: config.gid_index,
        eager_message: Some(config.eager_threshold.max(4096) + 4096),
        max_message: None,
        recv_buffers: Some(config.recv_buffers),
        pool_bytes,
        exposed_bytes: config.max_bytes_exposed,
        secret: config.secret.clone(),
        extra: config.provider_settings.clone(),
    }
}

/// Picks the provider `transport` names, with the reason (logged once by the caller),
/// through the provider registry (`rdma_shuffle_providers`, the one place providers are
/// listed), and the memory budget for it ([`MemoryBudget`]).
///
/// `auto` tries the registry's automatic order (verbs, then tcp) and falls back on any
/// failure (no device, no active port, memlock too low, a provider's fixed memory that does
/// not fit in the memory bound), saying why; a name fails instead of falling back.
pub fn select_provider(config: &EngineConfig) -> Result<Selected, EngineError> {
    let fit = MemoryBudget::for_transport(config)?;
    // `auto` where a provider's fixed memory would not fit in the bound: the first whose
    // does, and why.
    let name = if fit.passed_over.is_some() { fit.name } else { config.transport.as_str() };
    // Checked against the memlock limit: the pool, and the blocks exposed at once (their
    // registration pins their pages too).
    let options = provider_options(config, fit.value.pool_cap + config.max_bytes_exposed);
    let opened = providers::open(name, &options).map_err(|e| EngineError::Transport(render_error(&e)))?;
    let name = opened.provider.name();
    let why = match (&opened.fallback, &fit.passed_over) {
        (_, Some((skipped, e))) => {
            format!("transport=auto: using {name} because the fixed memory of {skipped} does not fit in the memory bound: {e}")
        }
        (Some((skipped, e)), None) => {
            format!("transport=auto: using {name} because {skipped} is unusable: {}", render_error(e))
        }
        (None, None) if config.transport == name => format!("spark.shuffle.rdma.transport={name}: {}", opened.description),
        (None, None) => format!("transport: {}", opened.description),
    };
    // Where `auto` opened another provider than the one the budget was fitted for (that one
    // could not open here), the budget is the opened provider's own.
    let budget = if name == fit.name { fit.value } else { MemoryBudget::over(config, name)? };
    Ok(Selected { provider: opened.provider, why, budget })
}

/// An executor's engine: one driver (event loop, plus its delivery thread) runs both the
/// block server and the block client, whatever the number of peers.
pub struct Engine {
    config: EngineConfig,
    provider: Arc<dyn Provider>,
    driver: Driver,
    server: BlockServer,
    client: BlockClient,
    why: String,
    budget: MemoryBudget,
}

impl Engine {
    /// Builds provider, driver, pool, server and client.
    pub fn open(config: EngineConfig) -> Result<Self, EngineError> {
        if config.bind_host.is_unspecified() {
            return Err(EngineError::Setting {
                key: "spark.shuffle.rdma.bindHost".into(),
                value: config.bind_host.to_string(),
                why: format!(
                    "executor {}: the engine binds the executor's own address, which the caller must pass; \
                     an unspecified address would serve blocks on every interface",
                    config.executor_id
                ),
            });
        }
        let Selected { provider, why, budget } = select_provider(&config)?;
        tracing::info!(executor = %config.executor_id, transport = provider.name(), "{why}");
        let driver = Driver::new(
            provider.clone(),
            DriverConfig { name: config.executor_id.clone(), idle_timeout: config.idle_timeout, spin: config.spin },
        )?;
        let pool_cfg = PoolConfig { tiers: config.pool_tiers.clone(), cap_bytes: budget.pool_cap, ..PoolConfig::default() };
        let pool = TieredPool::new(pool_cfg, provider.registrar())?;
        let limits = Limits { max_eager: config.eager_threshold.max(1), ..Limits::default() };
        let handshake_timeout = config.connect_timeout.min(Duration::from_secs(30));
        let server_cfg = ServerEndpointConfig {
            secret: config.secret.clone(),
            app_id: config.app_id.clone(),
            credits: config.credits,
            eager_threshold: config.eager_threshold,
            limits,
            handshake_timeout,
            name: config.executor_id.clone(),
            max_bytes_exposed: config.max_bytes_exposed,
            ..ServerEndpointConfig::default()
        };
        let server = BlockServer::bind_on_with_files(
            &driver,
            SocketAddr::new(config.bind_host, config.port),
            server_cfg,
            config.max_open_files,
        )?;
        let client_cfg = ClientEndpointConfig {
            secret: config.secret.clone(),
            app_id: config.app_id.clone(),
            connect_timeout: config.connect_timeout,
            handshake_timeout,
            fetch_timeout: config.fetch_timeout,
            max_eager: config.eager_threshold.max(1),
            max_bytes_in_flight: config.max_bytes_in_flight,
            limits,
            name: format!("executor {}", config.executor_id),
        };
        let client = BlockClient::on(&driver, pool, client_cfg)?;
        Ok(Engine { config, provider, driver, server, client, why, budget })
    }

    /// The driver (event loop) of this engine.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The block server.
    pub fn server(&self) -> &BlockServer {
        &self.server
    }

    /// The block client.
    pub fn client(&self) -> &BlockClient {
        &self.client
    }

    /// The provider's name (`tcp`, `verbs`, `sim`).
    pub fn transport(&self) -> &'static str {
        self.provider.name()
    }

    /// What the provider can do ([`Provider::capabilities`]): whether large blocks are read
    /// one-sidedly, among others.
    pub fn capabilities(&self) -> rdma_shuffle_fabric::ProviderCapabilities {
        self.provider.capabilities()
    }

    /// Why this transport was chosen.
    pub fn transport_reason(&self) -> &str {
        &self.why
    }

    /// The settings in force.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// How this engine's native memory is split (bound, fixed memory, pool cap).
    pub fn budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// Counters as `key=value` lines (what the executor logs and tests read).
    pub fn stats_text(&self) -> String {
        let s = self.server.stats();
        let c = self.client.stats();
        let p = self.client.pool().stats();
        let r = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut kv = |k: &str, v: u64| {
            let _ = writeln!(out, "{k}={v}");
        };
        let d = self.driver.stats();
        let b = self.server.loop_stats();
        kv("blocks_served", s.blocks_served());
        kv("bytes_served", s.bytes_served());
        kv("blocks_fetched", r(&c.blocks_fetched));
        kv("bytes_fetched", r(&c.bytes_fetched));
        kv("eager_blocks_served", r(&s.eager_blocks));
        kv("rendezvous_blocks_served", r(&s.rendezvous_blocks));
        kv("failed_blocks_served", r(&s.failed_blocks));
        kv("eager_blocks_fetched", r(&c.eager_blocks));
        kv("eager_bytes_fetched", r(&c.eager_bytes));
        kv("rendezvous_blocks_fetched", r(&c.rendezvous_blocks));
        kv("rendezvous_bytes_fetched", r(&c.rendezvous_bytes));
        kv("one_sided_reads", r(&c.one_sided_reads));
        kv("read_bytes", r(&c.read_bytes));
        kv("stream_pulls", r(&c.stream_pulls));
        kv("streamed_blocks", r(&c.streamed_blocks));
        kv("streamed_bytes", r(&c.streamed_bytes));
        kv("stream_ranges", r(&c.stream_ranges));
        kv("peak_stream_buffers", r(&c.peak_stream_buffers));
        kv("failed_blocks_fetched", r(&c.failed_blocks));
        for code in FailureCode::ALL {
            let _ = writeln!(out, "failed_blocks_fetched_{}={}", code.name(), c.failed(code));
        }
        let mut kv = |k: &str, v: u64| {
            let _ = writeln!(out, "{k}={v}");
        };
        kv("staged_payloads", r(&c.staged_payloads));
        kv("connections_accepted", r(&s.connections));
        kv("connections_opened", r(&c.connections));
        kv("connections_open", r(&d.connections_open));
        kv("idle_closes", r(&d.idle_closes));
        kv("auth_failures", r(&s.auth_failures));
        kv("pending_handshakes", r(&b.pending_handshakes));
        kv("handshake_timeouts", r(&d.handshake_timeouts));
        kv("handshake_evictions", r(&d.handshake_evictions));
        kv("registered_bytes", self.provider.registered_bytes() + r(&d.registered_bytes));
        kv("preauth_registered_bytes", r(&d.preauth_registered_bytes));
        kv("reads_in_flight", r(&d.reads_in_flight));
        kv("peak_reads_in_flight", r(&d.peak_reads_in_flight));
        kv("unflushed_closes", r(&d.unflushed_closes));
        kv("exposed_bytes", r(&b.exposed_bytes));
        kv("peak_exposed_bytes", r(&b.peak_exposed_bytes));
        kv("exposure_waits", r(&b.exposure_waits));
        kv("pool_bytes_allocated", p.bytes_allocated);
        kv("pool_cap_bytes", self.budget.pool_cap);
        kv("pool_bytes_in_use", p.bytes_in_use);
        kv("pool_peak_bytes_in_use", p.peak_bytes_in_use);
        kv("pool_waits", p.waits);
        let st = self.server.store().stats();
        kv("map_outputs_registered", st.map_outputs as u64);
        // Shuffles (and their data bytes) the store holds now: Spark's ContextCleaner
        // unregisters a shuffle once the driver drops it, so these stay bounded over an
        // application's life (scripts/soak.sh checks it).
        kv("shuffles_registered", st.shuffles as u64);
        kv("registered_data_bytes", st.data_bytes);
        kv("open_data_files", st.open_files as u64);
        kv("data_file_opens", st.file_opens);
        kv("data_file_evictions", st.file_evictions);
        for (k, v) in self.driver.provider_counters() {
            kv(k, v);
        }
        // All the native memory of the process's engines (one per executor), by kind, with
        // its exact peak, against the bound Spark's settings gave (0: none).
        let m = accounting::snapshot();
        kv("native_bytes", m.total);
        kv("native_peak_bytes", m.peak);
        kv("native_heap_bytes", m.heap);
        kv("native_pool_bytes", m.pool);
        kv("native_provider_bytes", m.provider);
        kv("native_bound_bytes", self.budget.bound.unwrap_or(0));
        kv("native_fixed_bytes", self.budget.fixed);
        let _ = writeln!(out, "transport={}", self.transport());
        out
    }

    /// Stops client, server and driver. Idempotent; leases still held stay valid until
    /// released.
    pub fn shutdown(&self) {
        self.client.shutdown();
        self.server.shutdown();
        self.driver.shutdown();
        tracing::info!(executor = %self.config.executor_id, "engine stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_tcp_on_a_machine_without_a_device_and_says_why() {
        // This test runs on hosts without RDMA (CI's); inside the SoftRoCE VM the verbs suite
        // covers the other branch.
        let Selected { provider: p, why, .. } = select_provider(&EngineConfig::default()).unwrap();
        assert_eq!(p.name(), "tcp");
        assert!(why.contains("using tcp because verbs is unusable"), "{why}");
        let e = select_provider(&EngineConfig { transport: "verbs".into(), ..EngineConfig::default() }).err().unwrap();
        assert!(e.to_string().contains("verbs"), "{e}");
    }

    #[test]
    fn engines_fetch_from_each_other_and_count_it() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = |id: &str| EngineConfig {
            transport: "tcp".into(),
            bind_host: "127.0.0.1".parse().unwrap(),
            executor_id: id.into(),
            pool_cap: Some(64 << 20),
            ..EngineConfig::default()
        };
        let a = Engine::open(cfg("1")).unwrap();
        let b = Engine::open(cfg("2")).unwrap();
        let out = crate::testkit::write_map_output(dir.path(), 0, 5, &[10, 100_000, 0], 1).unwrap();
        a.server().register(out.map_output_files()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        struct S(parking_lot::Mutex<std::sync::mpsc::Sender<(usize, usize)>>);
        impl crate::blocks::BlockSink for S {
            fn on_block(&self, i: usize, r: Result<crate::blocks::FetchedBlock, rdma_shuffle_wire::BlockFailure>) {
                let _ = self.0.lock().send((i, r.map(|b| b.len()).unwrap_or(usize::MAX)));
            }
        }
        let blocks =
            [crate::ShuffleBlock::single(0, 5, 0), crate::ShuffleBlock::single(0, 5, 1), crate::ShuffleBlock::single(0, 5, 2)];
        b.client().fetch(a.server().local_addr(), &blocks, Arc::new(S(parking_lot::Mutex::new(tx))));
        let mut got: Vec<_> = (0..3).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        got.sort();
        assert_eq!(got, vec![(0, 10), (1, 100_000), (2, 0)]);
        assert!(a.stats_text().contains("blocks_served=3"), "{}", a.stats_text());
        assert!(b.stats_text().contains("blocks_fetched=3"));
        assert!(b.stats_text().contains("bytes_fetched=100010"));
        // What the store holds is visible, and goes once the shuffle is unregistered (the soak,
        // scripts/soak.sh, relies on these gauges between shuffles).
        let held = a.stats_text();
        assert!(held.contains("\nshuffles_registered=1\n") && held.contains("\nmap_outputs_registered=1\n"), "{held}");
        assert!(held.contains(&format!("\nregistered_data_bytes={}\n", 100_010)), "{held}");
        assert_eq!(a.server().store().unregister_shuffle(0), 1);
        let after = a.stats_text();
        assert!(after.contains("\nshuffles_registered=0\n") && after.contains("\nregistered_data_bytes=0\n"), "{after}");
        a.shutdown();
        b.shutdown();
    }
}
