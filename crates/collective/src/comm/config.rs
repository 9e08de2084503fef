//! Settings of a communicator ([`CommConfig`]), read from `RANK`, `WORLD_SIZE`, `MASTER_*`
//! and `MOBIUS_*`.

use crate::error::CollectiveError;
use crate::mesh::MeshConfig;
use crate::policy::{parse_bytes, Overrides};
use rdma_shuffle_fabric::{PoolConfig, Provider, DEFAULT_SPIN, MAX_SPIN};
use rdma_shuffle_providers::{registry, ProviderOptions, AUTO, PER_HOST};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use super::MAX_WORLD;

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
    /// How long a caller waiting on a call polls its links after their last progress before
    /// it sleeps, and the loop thread while answers are due (`MOBIUS_SPIN`; default the
    /// driver's [`DEFAULT_SPIN`], 50 µs; at most [`MAX_SPIN`]): the rank's
    /// [`DriverConfig::spin`](rdma_shuffle_fabric::DriverConfig::spin). Longer trades CPU
    /// burnt by a waiting caller for replies that cost no wake-up.
    pub spin: Duration,
    /// Provider (`MOBIUS_TRANSPORT`): a name of the provider registry
    /// (`rdma_shuffle_providers::registry`: `tcp`, `shm`, `verbs`...), or `auto` (the default):
    /// per link, the registry's near provider to the ranks on this host, its far one to the
    /// others ([`PER_HOST`](rdma_shuffle_providers::PER_HOST): shm and tcp).
    pub transport: String,
    /// The device a provider should use (`MOBIUS_VERBS_DEVICE`; unset: its first usable one).
    pub device: Option<String>,
    /// Settings of one provider, `<provider>.<name>`, from `MOBIUS_<PROVIDER>_<NAME>`
    /// (`MOBIUS_<PROVIDER>_<NAME>` in upper case, the provider's `<name>` setting), handed to
    /// it as they are.
    pub provider_settings: BTreeMap<String, String>,
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
    /// Address to listen on and publish (`MOBIUS_IFADDR`; default: see [`CommConfig::local_ip`]).
    pub bind_ip: Option<IpAddr>,
    /// Network interface whose address to listen on and publish (`MOBIUS_SOCKET_IFNAME`, as
    /// gloo's `GLOO_SOCKET_IFNAME`), when `bind_ip` is not set.
    pub ifname: Option<String>,
    /// The group's identity, handed out by the rendezvous (rank 0 draws it): every link's
    /// handshake carries it (a rank of another group, or of an earlier job on a reused port,
    /// is refused), and the group's fresh secret, which every link proves.
    pub group: Option<GroupKey>,
    /// Keep user-buffer registrations between calls (`MOBIUS_REGCACHE=1`; the caller must
    /// invalidate buffers it frees).
    pub cache_registrations: bool,
    /// This rank's host identity (`MOBIUS_HOST_ID`); `None`: [`host_identity`], the kernel's
    /// boot id and this process's network namespace. Ranks with equal identities share a host
    /// for the hierarchical algorithms and the cost model's same-host links.
    pub host_id: Option<String>,
    /// The same-host links' latency (seconds) and time per byte, in place of the measured
    /// ones (`MOBIUS_LOCAL_LINK=<α µs>,<GB/s>`; rank 0's value is the group's): for a
    /// same-host transport whose speed is known beforehand.
    pub local_link: Option<(f64, f64)>,
    /// A cost model measured before (a parent group's), used instead of measuring when
    /// `tune` is off; rank 0's is the group's. Groups made from a measured one (torch's
    /// `new_group`, `split_group`, a `DeviceMesh`) run over the same links and need no
    /// start-up measurement of their own.
    pub model: Option<crate::policy::CostModel>,
}

impl CommConfig {
    /// Defaults for `rank` of `world`.
    pub fn new(rank: usize, world: usize) -> Self {
        CommConfig {
            rank,
            world,
            timeout: Duration::from_secs(120),
            spin: DEFAULT_SPIN,
            transport: AUTO.into(),
            device: None,
            provider_settings: BTreeMap::new(),
            eager_limit: 64 << 10,
            max_message: 16 << 20,
            pool_bytes: 1 << 30,
            secret: None,
            job: "mobius".into(),
            overrides: Overrides::default(),
            debug_policy: false,
            tune: true,
            bind_ip: None,
            ifname: None,
            group: None,
            cache_registrations: false,
            host_id: None,
            local_link: None,
            model: None,
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
        // Variables whose name or value is not Unicode are no setting of ours (and would
        // make `std::env::vars` panic).
        self.apply_vars(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))))
    }

    /// Applies the `MOBIUS_*` settings among `vars` (name, value), as
    /// [`apply_env`](Self::apply_env) does those of the environment.
    pub fn apply_vars(&mut self, vars: impl IntoIterator<Item = (String, String)>) -> Result<(), CollectiveError> {
        let vars: BTreeMap<String, String> = vars.into_iter().collect();
        let var = |k: &str| vars.get(k).filter(|v| !v.trim().is_empty()).cloned();
        let bytes = |k: &str| -> Result<Option<usize>, CollectiveError> {
            var(k)
                .map(|v| parse_bytes(&v).ok_or_else(|| CollectiveError::Config(format!("{k}={v:?} is not a byte size"))))
                .transpose()
        };
        let seconds = |k: &str, v: &str| {
            parse_seconds(v)
                .ok_or_else(|| CollectiveError::Config(format!("{k}={v:?} is not seconds (e.g. 120, 30s, 500ms, 50us)")))
        };
        if let Some(t) = var("MOBIUS_TIMEOUT") {
            self.timeout = seconds("MOBIUS_TIMEOUT", &t)?;
            if self.timeout.is_zero() {
                return Err(CollectiveError::Config(format!("MOBIUS_TIMEOUT={t:?} must be positive")));
            }
        }
        if let Some(t) = var("MOBIUS_SPIN") {
            let spin = seconds("MOBIUS_SPIN", &t)?;
            // Refused, not cut to the driver's limit: the setting would say a spin the
            // driver does not do.
            if spin > MAX_SPIN {
                return Err(CollectiveError::Config(format!(
                    "MOBIUS_SPIN={t:?} is above the longest spin the driver honours, {} µs",
                    MAX_SPIN.as_micros()
                )));
            }
            self.spin = spin;
        }
        if let Some(t) = var("MOBIUS_TRANSPORT") {
            self.set_transport(&t)?;
        }
        if let Some(d) = var("MOBIUS_VERBS_DEVICE") {
            self.device = Some(d);
        }
        self.provider_settings.extend(provider_settings(vars.iter().map(|(k, v)| (k.clone(), v.clone()))));
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
        if let Some(n) = var("MOBIUS_SOCKET_IFNAME") {
            self.ifname = Some(n.trim().to_string());
        }
        if let Some(c) = var("MOBIUS_REGCACHE") {
            self.cache_registrations = matches!(c.trim(), "1" | "on" | "true" | "yes");
        }
        if let Some(h) = var("MOBIUS_HOST_ID") {
            self.host_id = Some(h.trim().to_string());
        }
        if let Some(l) = var("MOBIUS_LOCAL_LINK") {
            self.local_link = Some(parse_link(&l)?);
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
        m.job = match &self.group {
            Some(g) => format!("{}/{}", self.job, g.id),
            None => self.job.clone(),
        };
        // Both secrets when both are there: a reader of the store (which holds the group's
        // secret) still cannot join without `MOBIUS_SECRET`.
        m.secret = match (&self.secret, &self.group) {
            (None, None) => None,
            (user, group) => {
                let mut key = Vec::new();
                if let Some(g) = group {
                    key.extend_from_slice(b"group:");
                    key.extend_from_slice(g.secret.as_bytes());
                }
                if let Some(u) = user {
                    key.extend_from_slice(b"\0user:");
                    key.extend_from_slice(u.as_bytes());
                }
                Some(rdma_shuffle_wire::Secret::new(key))
            }
        };
        m.connect_timeout = self.timeout;
        m.memory_timeout = self.timeout;
        m.eager_limit = self.eager_limit;
        m.max_message = self.max_message;
        m.pool = PoolConfig { cap_bytes: self.pool_bytes, ..PoolConfig::default() };
        m.cache_registrations = self.cache_registrations;
        m
    }

    /// Sets [`transport`](Self::transport) to `name` (any case): `auto` or a provider of the
    /// registry; anything else is an error that lists them.
    pub fn set_transport(&mut self, name: &str) -> Result<(), CollectiveError> {
        let t = name.trim().to_ascii_lowercase();
        if !registry().knows(&t) {
            let names = registry().names().collect::<Vec<_>>().join(", ");
            return Err(CollectiveError::Config(format!(
                "MOBIUS_TRANSPORT={t:?}: use {AUTO} or a provider of this build ({names})"
            )));
        }
        self.transport = t;
        Ok(())
    }

    /// What the providers of this configuration are opened with: its device, largest
    /// message, pool and secret (a provider with a handshake of its own, shm, makes a link's
    /// segment only for a peer that proves the group's secret and `MOBIUS_SECRET`, so a
    /// process of the same user but another job gets no shared memory, not only no messages).
    pub fn provider_options(&self) -> ProviderOptions {
        ProviderOptions {
            device: self.device.clone(),
            // The largest message of the mesh and room for its frame header.
            max_message: Some(self.max_message.max(self.eager_limit) as u64 + (64 << 10)),
            pool_bytes: self.pool_bytes,
            secret: self.mesh_config().secret,
            extra: self.provider_settings.clone(),
            ..ProviderOptions::default()
        }
    }

    /// The provider `transport` names, from the provider registry. `auto` opens the far
    /// provider of [`PER_HOST`] (tcp) here: with more than one rank the communicator puts the
    /// near one beside it and picks one per link at the rendezvous
    /// ([`open_per_host`](rdma_shuffle_providers::open_per_host)).
    pub fn provider(&self) -> Result<Arc<dyn Provider>, CollectiveError> {
        let name = if self.transport == AUTO { PER_HOST.1 } else { self.transport.as_str() };
        rdma_shuffle_providers::open(name, &self.provider_options())
            .map(|o| o.provider)
            .map_err(|e| CollectiveError::Config(format!("MOBIUS_TRANSPORT={}: {e}", self.transport)))
    }
}

impl CommConfig {
    /// The address this rank listens on and publishes to the other ranks, the first that
    /// applies of:
    /// 1. `MOBIUS_IFADDR` ([`bind_ip`](Self::bind_ip));
    /// 2. the address of the interface `MOBIUS_SOCKET_IFNAME` ([`ifname`](Self::ifname));
    /// 3. the address of the interface that routes to the rendezvous store at `store` (the
    ///    store is on a host every rank reaches, so this is the address the others can reach
    ///    this host at; a loopback store means a single-host group, which stays on loopback);
    /// 4. without a store address (torch's `file://`): the interface of the default route,
    ///    else the first interface that is up and not loopback, else 127.0.0.1.
    pub fn local_ip(&self, store: Option<SocketAddr>) -> Result<IpAddr, CollectiveError> {
        if let Some(ip) = self.bind_ip {
            return Ok(ip);
        }
        if let Some(name) = &self.ifname {
            return interface_ip(name);
        }
        if let Some(to) = store {
            if to.ip().is_loopback() {
                return Ok(to.ip());
            }
            if let Some(ip) = route_to(to) {
                return Ok(ip);
            }
        }
        // A documentation address (RFC 5737): a UDP connect sends nothing, it only asks the
        // kernel which source address the default route would use.
        let default_route = SocketAddr::from(([192, 0, 2, 1], 9));
        Ok(route_to(default_route)
            .or_else(|| interface_addrs().into_iter().map(|(_, ip)| ip).find(usable))
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
    }
}

/// A duration as the `seconds` settings of settings/mobius.tsv take it: a bare number is
/// seconds (`120`, `0.5`), or a number with the unit `us` (or `µs`), `ms` or `s` (`50us`,
/// `1.5ms`, `30s`) — the shuffle's (Spark's) unit names, though a bare number stays seconds
/// here, as `MOBIUS_TIMEOUT` always took it. Rounded to nanoseconds; `None` for anything
/// else, a negative number included.
pub(crate) fn parse_seconds(text: &str) -> Option<Duration> {
    let t = text.trim().to_ascii_lowercase();
    let (number, nanos) = if let Some(n) = t.strip_suffix("us").or_else(|| t.strip_suffix("µs")) {
        (n, 1e3)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1e6)
    } else {
        (t.strip_suffix('s').unwrap_or(&t), 1e9)
    };
    let ns = number.trim().parse::<f64>().ok()? * nanos;
    // Below 2^64 ns (584 years): the cast neither saturates nor wraps.
    (0.0..1.8e19).contains(&ns).then(|| Duration::from_nanos(ns.round() as u64))
}

/// `<α µs>,<GB/s>` → (seconds, seconds per byte).
fn parse_link(s: &str) -> Result<(f64, f64), CollectiveError> {
    let bad = || {
        CollectiveError::Config(format!(
            "MOBIUS_LOCAL_LINK={s:?}: use <latency in µs>,<bandwidth in GB/s>, both positive, e.g. 2,7.6"
        ))
    };
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    let (a, b): (f64, f64) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if !(a > 0.0 && a.is_finite() && b > 0.0 && b.is_finite()) {
        return Err(bad());
    }
    Ok((a * 1e-6, 1e-9 / b))
}

/// This host's identity as ranks compare it: the kernel's boot id (one per booted kernel, so
/// per machine or VM) joined with the network namespace of this process (its inode), so that
/// namespace "hosts" sharing one kernel, as the test cluster's, count as different hosts —
/// they reach each other through the network, not loopback. Falls back to the host name.
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).ok();
    let netns = std::fs::read_link("/proc/self/ns/net").ok().map(|p| p.to_string_lossy().into_owned());
    match (boot, netns) {
        (Some(b), Some(n)) => format!("{b}/{n}"),
        (Some(b), None) => b,
        _ => {
            let mut name = [0u8; 256];
            // SAFETY: gethostname writes at most `name.len()` bytes into the live buffer.
            let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
            let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
            if rc == 0 {
                String::from_utf8_lossy(&name[..end]).into_owned()
            } else {
                "unknown-host".into()
            }
        }
    }
}

/// A group's identity and secret (see [`CommConfig::group`]).
#[derive(Clone, PartialEq, Eq)]
pub struct GroupKey {
    /// Public id of the group: part of every link's handshake, in clear.
    pub id: String,
    /// The group's secret (hex); never sent on a link.
    pub secret: String,
}

impl GroupKey {
    /// A fresh group: 8 random bytes of id and 32 of secret, from the OS's generator.
    pub fn generate() -> Result<Self, CollectiveError> {
        let mut b = [0u8; 40];
        fill_random(&mut b)?;
        Ok(GroupKey { id: hex(&b[..8]), secret: hex(&b[8..]) })
    }

    /// `id:secret`, as the rendezvous stores it.
    pub fn encode(&self) -> String {
        format!("{}:{}", self.id, self.secret)
    }

    /// Reads [`encode`](Self::encode)'s form.
    pub fn decode(s: &str) -> Option<Self> {
        let (id, secret) = s.trim().split_once(':')?;
        let hexy = |x: &str| !x.is_empty() && x.len() <= 128 && x.bytes().all(|c| c.is_ascii_hexdigit());
        (hexy(id) && hexy(secret)).then(|| GroupKey { id: id.into(), secret: secret.into() })
    }
}

impl std::fmt::Debug for GroupKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GroupKey {{ id: {:?}, secret: <{} hex digits> }}", self.id, self.secret.len())
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn fill_random(buf: &mut [u8]) -> Result<(), CollectiveError> {
    let mut at = 0;
    while at < buf.len() {
        // SAFETY: writes at most `buf.len() - at` bytes into the live buffer from `at`.
        let n = unsafe { libc::getrandom(buf[at..].as_mut_ptr().cast(), buf.len() - at, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(CollectiveError::Config(format!("cannot draw the group's secret from the OS (getrandom): {e}")));
        }
        at += n as usize;
    }
    Ok(())
}

/// An address other hosts may reach: not loopback, not unspecified, not IPv6 link-local
/// (which would need a scope id).
fn usable(ip: &IpAddr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && !matches!(ip, IpAddr::V6(v) if (v.segments()[0] & 0xffc0) == 0xfe80)
}

/// The local address the kernel would use to reach `to` (a UDP connect sends nothing).
fn route_to(to: SocketAddr) -> Option<IpAddr> {
    let any: SocketAddr = if to.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(to).ok()?;
    Some(s.local_addr().ok()?.ip()).filter(|ip| !ip.is_unspecified())
}

/// The address of interface `name` (IPv4 first).
fn interface_ip(name: &str) -> Result<IpAddr, CollectiveError> {
    let all = interface_addrs();
    let mine: Vec<IpAddr> =
        all.iter().filter(|(n, ip)| n == name && (ip.is_loopback() || usable(ip))).map(|(_, ip)| *ip).collect();
    mine.iter().find(|ip| ip.is_ipv4()).or_else(|| mine.first()).copied().ok_or_else(|| {
        let known: Vec<String> = all.iter().map(|(n, ip)| format!("{n} ({ip})")).collect();
        CollectiveError::Config(format!(
            "MOBIUS_SOCKET_IFNAME={name:?}: no interface of that name is up with an address; interfaces here: {}",
            known.join(", ")
        ))
    })
}

/// `(interface name, address)` of every interface that is up.
fn interface_addrs() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that is freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() || ifa.ifa_flags & (libc::IFF_UP as u32) == 0 {
            continue;
        }
        // SAFETY: a non-null `ifa_name` is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: a non-null `ifa_addr` points at a sockaddr whose family says its type.
        let ip = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                }
                _ => None,
            }
        };
        if let Some(ip) = ip {
            out.push((name, ip));
        }
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The `MOBIUS_<PROVIDER>_<NAME>` settings among `vars` of the registry's providers, as
/// `<provider>.<name>` (lower case: a provider `ofi`'s setting `provider` is `ofi.provider`). A new provider's
/// settings need a line in settings/mobius.tsv and nothing here. `MOBIUS_VERBS_DEVICE` is
/// the device every provider is given ([`CommConfig::device`]), not one provider's own.
fn provider_settings(vars: impl Iterator<Item = (String, String)>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (k, v) in vars {
        if k == "MOBIUS_VERBS_DEVICE" || v.trim().is_empty() {
            continue;
        }
        let Some(rest) = k.strip_prefix("MOBIUS_") else { continue };
        for name in registry().names() {
            let Some(setting) = rest.strip_prefix(&name.to_ascii_uppercase()).and_then(|r| r.strip_prefix('_')) else { continue };
            if !setting.is_empty() {
                out.insert(format!("{name}.{}", setting.to_ascii_lowercase()), v.trim().to_string());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_bytes;

    #[test]
    fn the_published_address_follows_the_settings_then_the_route_to_the_store() {
        let mut c = CommConfig::new(0, 2);
        let store: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        assert_eq!(c.local_ip(Some(store)).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        c.ifname = Some("lo".into());
        assert_eq!(c.local_ip(None).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        c.ifname = Some("no-such-if0".into());
        let e = c.local_ip(Some(store)).unwrap_err().to_string();
        assert!(e.contains("MOBIUS_SOCKET_IFNAME") && e.contains("lo (127.0.0.1)"), "{e}");
        c.bind_ip = Some("10.1.2.3".parse().unwrap());
        assert_eq!(c.local_ip(Some(store)).unwrap().to_string(), "10.1.2.3");
        // Without a store address, never a loopback address when the host has another one.
        let c = CommConfig::new(0, 2);
        let ip = c.local_ip(None).unwrap();
        if interface_addrs().iter().any(|(_, ip)| usable(ip)) {
            assert!(usable(&ip), "{ip}");
        }
    }

    #[test]
    fn local_link_parses_microseconds_and_gigabytes_per_second() {
        let (a, b) = parse_link("2, 7.6").unwrap();
        assert!((a - 2e-6).abs() < 1e-12 && (b - 1.0 / 7.6e9).abs() < 1e-15);
        for bad in ["2", "x,1", "0,1", "1,-3", "1,inf"] {
            assert!(parse_link(bad).unwrap_err().to_string().contains("MOBIUS_LOCAL_LINK"), "{bad}");
        }
        assert!(!host_identity().is_empty());
    }

    #[test]
    fn seconds_take_a_bare_number_or_a_unit() {
        for (text, want) in [
            ("120", Duration::from_secs(120)),
            ("0.5", Duration::from_millis(500)),
            ("30s", Duration::from_secs(30)),
            (" 1.5ms ", Duration::from_micros(1500)),
            ("50us", Duration::from_micros(50)),
            ("50µs", Duration::from_micros(50)),
            ("0.05ms", Duration::from_micros(50)),
            ("5e-5", Duration::from_micros(50)),
            ("0", Duration::ZERO),
        ] {
            assert_eq!(parse_seconds(text), Some(want), "{text}");
        }
        for bad in ["", "us", "fast", "-1", "-5us", "2min", "1h", "nan", "inf", "1e30"] {
            assert_eq!(parse_seconds(bad), None, "{bad}");
        }
    }

    #[test]
    fn spin_and_timeout_settings_are_read_and_bounded() {
        let vars = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let mut c = CommConfig::new(0, 1);
        c.apply_vars(vars(&[("MOBIUS_SPIN", "500us"), ("MOBIUS_TIMEOUT", "30s")])).unwrap();
        assert_eq!((c.spin, c.timeout), (Duration::from_micros(500), Duration::from_secs(30)));
        c.apply_vars(vars(&[("MOBIUS_SPIN", "0")])).unwrap();
        assert_eq!(c.spin, Duration::ZERO);
        c.apply_vars(vars(&[("MOBIUS_SPIN", "1ms")])).unwrap();
        assert_eq!(c.spin, MAX_SPIN);
        for (k, v, says) in [
            ("MOBIUS_SPIN", "2ms", "above the longest spin"),
            ("MOBIUS_SPIN", "fast", "is not seconds"),
            ("MOBIUS_TIMEOUT", "0", "must be positive"),
            ("MOBIUS_TIMEOUT", "soon", "is not seconds"),
        ] {
            let e = CommConfig::new(0, 1).apply_vars(vars(&[(k, v)])).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(says), "{k}={v}: {e}");
        }
        // Unset or blank leaves the default.
        let mut c = CommConfig::new(0, 1);
        c.apply_vars(vars(&[("MOBIUS_SPIN", " ")])).unwrap();
        assert_eq!(c.spin, DEFAULT_SPIN);
    }

    #[test]
    fn groups_are_fresh_and_bind_the_job_and_the_secret() {
        let (a, b) = (GroupKey::generate().unwrap(), GroupKey::generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(GroupKey::decode(&a.encode()), Some(a.clone()));
        assert_eq!(GroupKey::decode("zz:11"), None);
        assert!(!format!("{a:?}").contains(&a.secret));
        let mut c = CommConfig::new(1, 2);
        c.group = Some(a.clone());
        let m = c.mesh_config();
        assert_eq!(m.job, format!("mobius/{}", a.id));
        assert!(m.secret.is_some());
    }

    /// settings/mobius.tsv is the declaration the docs are generated from; the defaults it
    /// states must be the ones `CommConfig::new` uses.
    #[test]
    fn defaults_match_the_settings_schema() {
        let schema = include_str!("../../../../settings/mobius.tsv");
        let default = |key: &str| -> String {
            schema
                .lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| l.strip_prefix(&format!("{key}\t")).map(|rest| rest.split('\t').nth(1).unwrap().to_string()))
                .unwrap_or_else(|| panic!("{key} is not in settings/mobius.tsv"))
        };
        let range_of = |key: &str| -> &str {
            schema
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{key}\t")))
                .and_then(|rest| rest.split('\t').nth(2))
                .unwrap_or_else(|| panic!("{key}'s range in settings/mobius.tsv"))
        };
        let c = CommConfig::new(0, 1);
        assert_eq!(parse_seconds(&default("MOBIUS_TIMEOUT")), Some(c.timeout));
        assert_eq!(parse_seconds(&default("MOBIUS_SPIN")), Some(c.spin));
        assert_eq!(c.spin, DEFAULT_SPIN, "MOBIUS_SPIN's default is the driver's");
        let spin_range = range_of("MOBIUS_SPIN");
        let (lo, hi) = spin_range.split_once("..").expect("MOBIUS_SPIN's range lo..hi");
        assert_eq!((parse_seconds(lo), parse_seconds(hi)), (Some(Duration::ZERO), Some(MAX_SPIN)), "MOBIUS_SPIN's range");
        assert_eq!(parse_bytes(&default("MOBIUS_EAGER_LIMIT")), Some(c.eager_limit));
        assert_eq!(parse_bytes(&default("MOBIUS_MAX_MESSAGE")), Some(c.max_message));
        assert_eq!(parse_bytes(&default("MOBIUS_POOL_BYTES")).map(|n| n as u64), Some(c.pool_bytes));
        assert_eq!(default("MOBIUS_JOB"), c.job);
        assert_eq!(default("MOBIUS_TRANSPORT"), "auto");
        assert_eq!(c.transport, AUTO);
        // MOBIUS_TRANSPORT takes the provider registry's names and auto.
        let range = range_of("MOBIUS_TRANSPORT");
        let mut names: Vec<&str> = range.split('|').collect();
        let mut want: Vec<&str> = std::iter::once(AUTO).chain(registry().names()).collect();
        names.sort_unstable();
        want.sort_unstable();
        assert_eq!(names, want, "settings/mobius.tsv's MOBIUS_TRANSPORT values against the provider registry");
        assert_eq!(default("MOBIUS_TUNE") == "on", c.tune);
        assert_eq!(default("MOBIUS_REGCACHE") == "on", c.cache_registrations);
        for unset in [
            "MOBIUS_HOST_ID",
            "MOBIUS_LOCAL_LINK",
            "MOBIUS_SECRET",
            "MOBIUS_IFADDR",
            "MOBIUS_SOCKET_IFNAME",
            "MOBIUS_ALGO",
            "MOBIUS_PROTO",
            "MOBIUS_SEGMENT",
        ] {
            assert_eq!(default(unset), "-", "{unset}");
        }
    }

    #[test]
    fn a_providers_own_settings_and_unknown_transports() {
        // Made up names (built here, so tests/collective/test_settings.py does not take them for
        // settings the code reads): one of a registered provider, one of none.
        let (ours, stray) = (format!("MOBIUS_{}_EXAMPLE", "VERBS"), format!("MOBIUS_{}_A", "NOSUCH"));
        let vars = [(ours.as_str(), "x;y"), ("MOBIUS_VERBS_DEVICE", "rxe0"), (stray.as_str(), "1"), ("PATH", "/bin")];
        let got = provider_settings(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        assert_eq!(got.into_iter().collect::<Vec<_>>(), [("verbs.example".to_string(), "x;y".to_string())]);
        let mut c = CommConfig::new(0, 1);
        c.set_transport("SHM").unwrap();
        assert_eq!(c.transport, "shm");
        let e = c.set_transport("ib").unwrap_err().to_string();
        assert!(e.contains("\"ib\"") && e.contains("tcp") && e.contains("verbs"), "{e}");
    }
}
