//! Settings of a communicator ([`CommConfig`]), read from `RANK`, `WORLD_SIZE`, `MASTER_*`
//! and `MOBIUS_*`.

use crate::error::CollectiveError;
use crate::policy::{parse_bytes, Overrides};
use rdma_shuffle_fabric::mesh::MeshConfig;
use rdma_shuffle_fabric::{open_provider, PoolConfig, Provider, ProviderChoice, ProviderSpec};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use super::MAX_WORLD;

/// Which provider carries a communicator's traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP sockets.
    Tcp,
    /// RDMA verbs (needs the `verbs` feature and a device); `None` takes the first active one.
    Verbs(Option<String>),
}

/// Settings of a communicator. [`CommConfig::from_env`] reads them from the environment.
#[derive(Clone, Debug)]
pub struct CommConfig {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Limit for every wait: joining the group, and each collective call (`MOBIUS_TIMEOUT`,
    /// seconds; default 120).
    pub timeout: Duration,
    /// Provider (`MOBIUS_TRANSPORT`: `tcp` | `verbs`; default tcp).
    pub transport: TransportKind,
    /// Largest eager message (`MOBIUS_EAGER_LIMIT`; default 64k).
    pub eager_limit: usize,
    /// Largest single message (`MOBIUS_MAX_MESSAGE`; default 16m).
    pub max_message: usize,
    /// Cap on receive-buffer memory (`MOBIUS_POOL_BYTES`; default 1g, mapped lazily).
    pub pool_bytes: u64,
    /// Shared secret authenticating every link (`MOBIUS_SECRET`).
    pub secret: Option<String>,
    /// Group name; a rank of another job is refused (`MOBIUS_JOB`; default `mobius`).
    pub job: String,
    /// `MOBIUS_ALGO`, `MOBIUS_PROTO`, `MOBIUS_SEGMENT`.
    pub overrides: Overrides,
    /// Log each policy decision (`MOBIUS_DEBUG=policy`).
    pub debug_policy: bool,
    /// Measure α, β, γ at start (`MOBIUS_TUNE=off` uses assumed values).
    pub tune: bool,
    /// Address to listen on and publish (`MOBIUS_IFADDR`; default: the local address that
    /// routes to `MASTER_ADDR`).
    pub bind_ip: Option<IpAddr>,
    /// Keep user-buffer registrations between calls (`MOBIUS_REGCACHE=1`; the caller must
    /// invalidate buffers it frees).
    pub cache_registrations: bool,
}

impl CommConfig {
    /// Defaults for `rank` of `world`.
    pub fn new(rank: usize, world: usize) -> Self {
        CommConfig {
            rank,
            world,
            timeout: Duration::from_secs(120),
            transport: TransportKind::Tcp,
            eager_limit: 64 << 10,
            max_message: 16 << 20,
            pool_bytes: 1 << 30,
            secret: None,
            job: "mobius".into(),
            overrides: Overrides::default(),
            debug_policy: false,
            tune: true,
            bind_ip: None,
            cache_registrations: false,
        }
    }

    /// `RANK`, `WORLD_SIZE` and every `MOBIUS_*` setting, plus the store address from
    /// `MASTER_ADDR`/`MASTER_PORT`.
    pub fn from_env() -> Result<(Self, SocketAddr), CollectiveError> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let need = |k: &str| var(k).ok_or_else(|| CollectiveError::Config(format!("{k} is not set")));
        let num = |k: &str, v: String| {
            v.trim().parse::<usize>().map_err(|_| CollectiveError::Config(format!("{k}={v:?} is not a number")))
        };
        let rank = num("RANK", need("RANK")?)?;
        let world = num("WORLD_SIZE", need("WORLD_SIZE")?)?;
        let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = num("MASTER_PORT", need("MASTER_PORT")?)?;
        let master = (host.as_str(), port as u16)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.find(|a| a.is_ipv4()).or_else(|| (host.as_str(), port as u16).to_socket_addrs().ok()?.next()))
            .ok_or_else(|| CollectiveError::Config(format!("MASTER_ADDR={host:?} does not resolve")))?;
        let mut c = CommConfig::new(rank, world);
        c.apply_env()?;
        Ok((c, master))
    }

    /// Applies the `MOBIUS_*` settings found in the environment.
    pub fn apply_env(&mut self) -> Result<(), CollectiveError> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let bytes = |k: &str| -> Result<Option<usize>, CollectiveError> {
            var(k)
                .map(|v| parse_bytes(&v).ok_or_else(|| CollectiveError::Config(format!("{k}={v:?} is not a byte size"))))
                .transpose()
        };
        if let Some(t) = var("MOBIUS_TIMEOUT") {
            let s: f64 = t.trim().parse().map_err(|_| CollectiveError::Config(format!("MOBIUS_TIMEOUT={t:?} is not seconds")))?;
            if !(s > 0.0 && s.is_finite()) {
                return Err(CollectiveError::Config(format!("MOBIUS_TIMEOUT={t:?} must be positive")));
            }
            self.timeout = Duration::from_secs_f64(s);
        }
        if let Some(t) = var("MOBIUS_TRANSPORT") {
            self.transport = match t.trim().to_ascii_lowercase().as_str() {
                "tcp" => TransportKind::Tcp,
                "verbs" | "rdma" => TransportKind::Verbs(var("MOBIUS_VERBS_DEVICE")),
                other => return Err(CollectiveError::Config(format!("MOBIUS_TRANSPORT={other:?}: use tcp or verbs"))),
            };
        }
        if let Some(n) = bytes("MOBIUS_EAGER_LIMIT")? {
            self.eager_limit = n;
        }
        if let Some(n) = bytes("MOBIUS_MAX_MESSAGE")? {
            self.max_message = n;
        }
        if let Some(n) = bytes("MOBIUS_POOL_BYTES")? {
            self.pool_bytes = n as u64;
        }
        if let Some(s) = var("MOBIUS_SECRET") {
            self.secret = Some(s);
        }
        if let Some(j) = var("MOBIUS_JOB") {
            self.job = j;
        }
        self.overrides =
            Overrides::parse(var("MOBIUS_ALGO").as_deref(), var("MOBIUS_PROTO").as_deref(), var("MOBIUS_SEGMENT").as_deref())?;
        if let Some(d) = var("MOBIUS_DEBUG") {
            self.debug_policy = d.split(',').any(|x| matches!(x.trim(), "policy" | "all" | "1"));
        }
        if let Some(t) = var("MOBIUS_TUNE") {
            self.tune = !matches!(t.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no");
        }
        if let Some(ip) = var("MOBIUS_IFADDR") {
            self.bind_ip = Some(
                ip.trim().parse().map_err(|_| CollectiveError::Config(format!("MOBIUS_IFADDR={ip:?} is not an IP address")))?,
            );
        }
        if let Some(c) = var("MOBIUS_REGCACHE") {
            self.cache_registrations = matches!(c.trim(), "1" | "on" | "true" | "yes");
        }
        Ok(())
    }

    pub(super) fn validate(&self) -> Result<(), CollectiveError> {
        if self.world == 0 || self.world > MAX_WORLD {
            return Err(CollectiveError::Config(format!("WORLD_SIZE={} must be between 1 and {MAX_WORLD}", self.world)));
        }
        if self.rank >= self.world {
            return Err(CollectiveError::Config(format!("RANK={} must be below WORLD_SIZE={}", self.rank, self.world)));
        }
        Ok(())
    }

    pub(super) fn mesh_config(&self) -> MeshConfig {
        let mut m = MeshConfig::new(self.rank, self.world);
        m.job = self.job.clone();
        m.secret = self.secret.as_ref().map(|s| rdma_shuffle_wire::Secret::new(s.as_bytes()));
        m.connect_timeout = self.timeout;
        m.memory_timeout = self.timeout;
        m.eager_limit = self.eager_limit;
        m.max_message = self.max_message;
        m.pool = PoolConfig { cap_bytes: self.pool_bytes, ..PoolConfig::default() };
        m.cache_registrations = self.cache_registrations;
        m
    }

    /// The provider this configuration asks for (fabric's [`open_provider`], which lists the
    /// providers).
    pub fn provider(&self) -> Result<Arc<dyn Provider>, CollectiveError> {
        let spec = match &self.transport {
            TransportKind::Tcp => ProviderSpec::default(),
            TransportKind::Verbs(device) => ProviderSpec {
                choice: ProviderChoice::Verbs,
                device: device.clone(),
                pool_bytes: self.pool_bytes,
                ..ProviderSpec::default()
            },
        };
        open_provider(&spec).map(|o| o.provider).map_err(|e| CollectiveError::Config(format!("MOBIUS_TRANSPORT=verbs: {e}")))
    }
}

/// The address of this host that routes to `to` (what peers should connect to).
pub(super) fn route_ip(to: SocketAddr) -> IpAddr {
    if to.ip().is_loopback() {
        return to.ip();
    }
    UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|s| s.connect(to).and_then(|_| s.local_addr()))
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}
