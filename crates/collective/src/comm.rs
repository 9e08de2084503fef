//! The communicator: setting up a group of ranks, and the collective calls.

use crate::algo::{self, exchange, reducing, rooted, Ctx, MAX_SEGMENTS, MAX_STEP, STEP_HEADER};
use crate::dtype::{finish_avg, DType, Element, ReduceOp};
use crate::error::CollectiveError;
use crate::header::Header;
use crate::mesh_transport::MeshTransport;
use crate::policy::{parse_bytes, Algo, CostModel, Decision, Op, Overrides, Policy};
use crate::store::{StoreClient, StoreServer};
use crate::transport::{Proto, Tag, Transport, TransportStats};
use parking_lot::Mutex;
use rdma_shuffle_fabric::mesh::{Mesh, MeshConfig, MeshListener};
use rdma_shuffle_fabric::{PoolConfig, Provider, TcpProvider};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::info;

/// Largest world supported (ring steps are numbered in 12 bits).
pub const MAX_WORLD: usize = (MAX_STEP as usize) / 2;

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

    fn validate(&self) -> Result<(), CollectiveError> {
        if self.world == 0 || self.world > MAX_WORLD {
            return Err(CollectiveError::Config(format!("WORLD_SIZE={} must be between 1 and {MAX_WORLD}", self.world)));
        }
        if self.rank >= self.world {
            return Err(CollectiveError::Config(format!("RANK={} must be below WORLD_SIZE={}", self.rank, self.world)));
        }
        Ok(())
    }

    fn mesh_config(&self) -> MeshConfig {
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

    /// The provider this configuration asks for.
    pub fn provider(&self) -> Result<Arc<dyn Provider>, CollectiveError> {
        match &self.transport {
            TransportKind::Tcp => Ok(Arc::new(TcpProvider::new())),
            #[cfg(feature = "verbs")]
            TransportKind::Verbs(device) => {
                let vc = rdma_shuffle_fabric::verbs::VerbsConfig {
                    device: device.clone(),
                    pool_bytes: self.pool_bytes,
                    ..Default::default()
                };
                let p = rdma_shuffle_fabric::verbs::VerbsProvider::open(vc)
                    .map_err(|e| CollectiveError::Config(format!("MOBIUS_TRANSPORT=verbs: {e}")))?;
                Ok(Arc::new(p))
            }
            #[cfg(not(feature = "verbs"))]
            TransportKind::Verbs(_) => Err(CollectiveError::Config(
                "MOBIUS_TRANSPORT=verbs: this build has no verbs provider (build with the `verbs` feature)".into(),
            )),
        }
    }
}

/// The address of this host that routes to `to` (what peers should connect to).
fn route_ip(to: SocketAddr) -> IpAddr {
    if to.ip().is_loopback() {
        return to.ip();
    }
    UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|s| s.connect(to).and_then(|_| s.local_addr()))
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Where the ranks find each other: the store, or addresses exchanged by someone else.
pub trait Rendezvous {
    /// Publishes this rank's mesh address and returns every rank's, in rank order, waiting
    /// at most until `deadline`; the error names the ranks that never showed up.
    fn exchange(&mut self, rank: usize, world: usize, mine: SocketAddr, deadline: Instant) -> Result<Vec<SocketAddr>, String>;
}

/// [`Rendezvous`] through the crate's TCP store.
pub struct StoreRendezvous {
    client: StoreClient,
    addr: SocketAddr,
    prefix: String,
}

impl StoreRendezvous {
    /// Connects to the store at `addr` (retrying until `deadline`); keys go under `prefix`.
    pub fn connect(addr: SocketAddr, prefix: &str, deadline: Instant) -> Result<Self, String> {
        Ok(StoreRendezvous { client: StoreClient::connect(addr, deadline)?, addr, prefix: prefix.to_string() })
    }
}

impl Rendezvous for StoreRendezvous {
    fn exchange(&mut self, rank: usize, world: usize, mine: SocketAddr, deadline: Instant) -> Result<Vec<SocketAddr>, String> {
        self.client.set(&format!("{}/addr/{rank}", self.prefix), mine.to_string().as_bytes())?;
        let mut out = Vec::with_capacity(world);
        let mut missing = Vec::new();
        let mut note = String::new();
        for r in 0..world {
            if r == rank {
                out.push(mine);
                continue;
            }
            let key = format!("{}/addr/{r}", self.prefix);
            if !missing.is_empty() {
                // After one timeout, only ask which others are missing too.
                let probe = StoreClient::connect(self.client_addr(), Instant::now() + Duration::from_secs(1))
                    .and_then(|mut p| p.get(&key, Instant::now() + Duration::from_millis(20)));
                if !matches!(probe, Ok(Some(_))) {
                    missing.push(r);
                }
                continue;
            }
            match self.client.get(&key, deadline) {
                Ok(Some(v)) => out.push(
                    String::from_utf8_lossy(&v).parse().map_err(|_| format!("rank {r} published an unreadable address {v:?}"))?,
                ),
                Ok(None) => {
                    missing.push(r);
                    if let Ok(c) = StoreClient::connect(self.client_addr(), Instant::now() + Duration::from_secs(1)) {
                        self.client = c;
                    }
                }
                Err(e) => {
                    // The store went away while this rank waited (rank 0 gave up first).
                    missing.push(r);
                    note = format!("; then the store closed: {e}");
                }
            }
        }
        if missing.is_empty() {
            Ok(out)
        } else {
            Err(format!(
                "rank(s) {missing:?} never joined: their addresses did not appear in the store within the timeout{note} (are \
                 all {world} ranks started with the same MASTER_ADDR/MASTER_PORT? raise MOBIUS_TIMEOUT if they start late)"
            ))
        }
    }
}

impl StoreRendezvous {
    fn client_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Seconds per byte of an `f32` sum and of a copy on this machine (medians of a few runs over
/// 8 MiB: larger than caches, as the buffers whose cost the model matters for).
fn local_speeds() -> (f64, f64) {
    let n = 8 << 20;
    let a = vec![1.0f32; n / 4];
    let mut b = vec![2.0f32; n / 4];
    let mut sums = Vec::new();
    let mut copies = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        crate::dtype::reduce_into(DType::F32, ReduceOp::Sum, bytemuck::cast_slice_mut(&mut b), bytemuck::cast_slice(&a));
        sums.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b.copy_from_slice(std::hint::black_box(&a));
        copies.push(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&b);
    ((median(sums) / n as f64).max(1e-13), (median(copies) / n as f64).max(1e-13))
}
/// Counters of a communicator.
#[derive(Clone, Debug, Default)]
pub struct CommStats {
    /// Calls per `op.algorithm` (e.g. `allreduce.rd`), and `send`/`recv`.
    pub calls: BTreeMap<String, u64>,
    /// Bytes per op (the buffer size as the op defines it).
    pub bytes: BTreeMap<String, u64>,
    /// Messages and bytes by protocol.
    pub transport: TransportStats,
}

struct State {
    calls: u64,
    broken: Option<String>,
    stats: CommStats,
}

/// A group of ranks that run collectives together.
///
/// Calls on one communicator are serialised; every rank must make the same calls in the same
/// order with matching arguments (checked: a mismatch is an error naming the argument). A
/// failed collective leaves the communicator unusable ([`CollectiveError::Broken`]).
pub struct Communicator<T: Transport = MeshTransport> {
    t: T,
    rank: usize,
    world: usize,
    timeout: Duration,
    policy: Policy,
    state: Mutex<State>,
}

impl Communicator<MeshTransport> {
    /// Joins the group described by the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `MOBIUS_*`).
    pub fn from_env() -> Result<Self, CollectiveError> {
        let (config, master) = CommConfig::from_env()?;
        Self::init(config, master)
    }

    /// Joins the group through the store at `master` (served by rank 0).
    pub fn init(config: CommConfig, master: SocketAddr) -> Result<Self, CollectiveError> {
        config.validate()?;
        let rank = config.rank;
        let rdv = |m: String| CollectiveError::Rendezvous { rank, message: m };
        let deadline = Instant::now() + config.timeout;
        let _server = if rank == 0 { Some(StoreServer::bind(master).map_err(rdv)?) } else { None };
        let mut store = StoreRendezvous::connect(master, &format!("mobius/{}", config.job), deadline).map_err(rdv)?;
        let ip = config.bind_ip.unwrap_or_else(|| route_ip(master));
        Self::join(config, ip, &mut store)
        // Rank 0's store stops here: the mesh is complete, so every rank has read every
        // address (each connects to rank 0 only after reading them all).
    }

    /// Joins the group, exchanging addresses through `rendezvous` (e.g. torch's store), with
    /// the mesh listening on `ip`.
    pub fn join(config: CommConfig, ip: IpAddr, rendezvous: &mut dyn Rendezvous) -> Result<Self, CollectiveError> {
        config.validate()?;
        let rank = config.rank;
        let rdv = |m: String| CollectiveError::Rendezvous { rank, message: m };
        let deadline = Instant::now() + config.timeout;
        let provider = config.provider()?;
        let listener = MeshListener::bind(provider, SocketAddr::new(ip, 0), rank).map_err(|e| rdv(e.to_string()))?;
        let addrs = rendezvous.exchange(rank, config.world, listener.local_addr(), deadline).map_err(rdv)?;
        let mut mc = config.mesh_config();
        mc.connect_timeout = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        let mesh = Mesh::connect(listener, &addrs, mc).map_err(|e| rdv(e.to_string()))?;
        Communicator::with_transport(MeshTransport::new(mesh), &config)
    }

    /// Drops cached registrations of memory about to be freed (with `MOBIUS_REGCACHE=1`).
    pub fn invalidate(&self, ptr: *const u8, len: usize) {
        self.t.invalidate(ptr, len)
    }

    /// Provider counters (e.g. `rdma_reads` on verbs, `sim_reads` on sim).
    pub fn provider_counters(&self) -> Vec<(&'static str, u64)> {
        self.t.mesh().provider_counters()
    }
}

/// Tags of the start-up exchange (call number 0, below every collective's).
const INIT_TUNE: u32 = 1;
const INIT_MODEL: u32 = 2;
const INIT_PING: u32 = 3;
const INIT_PONG: u32 = 4;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

impl<T: Transport> Communicator<T> {
    /// A communicator over a connected transport: agrees on the cost model (rank 0 measures
    /// it, unless `config.tune` is off) and is ready for calls.
    pub fn with_transport(t: T, config: &CommConfig) -> Result<Self, CollectiveError> {
        let (rank, world) = (t.rank(), t.world());
        if world > MAX_WORLD {
            return Err(CollectiveError::Config(format!("a world of {world} ranks is above the supported {MAX_WORLD}")));
        }
        let policy = Policy {
            model: CostModel::assumed(),
            overrides: config.overrides.clone(),
            debug: config.debug_policy,
            eager_limit: t.eager_limit(),
            max_message: t.max_message(),
            one_sided: t.one_sided(),
        };
        let mut comm = Communicator {
            t,
            rank,
            world,
            timeout: config.timeout,
            policy,
            state: Mutex::new(State { calls: 0, broken: None, stats: CommStats::default() }),
        };
        if world > 1 {
            let model =
                comm.agree_model(config.tune).map_err(|e| CollectiveError::Rendezvous { rank, message: e.to_string() })?;
            comm.policy.model = model;
        }
        if comm.policy.debug {
            let m = comm.policy.model;
            info!(target: "mobius::policy", rank, world, provider = comm.t.provider(),
                alpha_us = m.alpha * 1e6, beta_gbs = 1e-9 / m.beta.max(1e-18), gamma_gbs = 1e-9 / m.gamma.max(1e-18),
                copy_gbs = 1e-9 / m.copy.max(1e-18), alpha_rndv_us = m.alpha_rndv * 1e6, "mobius cost model");
        }
        Ok(comm)
    }

    fn init_tag(step: u32, seg: u32) -> Tag {
        algo::tag(0, step, seg)
    }

    fn ping(
        &self,
        peer: usize,
        rounds: usize,
        data: &[u8],
        proto: Proto,
        initiator: bool,
        deadline: Instant,
    ) -> Result<Vec<f64>, crate::transport::TransportError> {
        let mut times = Vec::with_capacity(rounds);
        for i in 0..rounds as u32 {
            let t0 = Instant::now();
            if initiator {
                let tk = self.t.send(peer, Self::init_tag(INIT_PING, i), data, proto, None)?;
                self.t.wait(tk, deadline)?;
                self.t.recv(peer, Self::init_tag(INIT_PONG, i), None, deadline)?;
            } else {
                self.t.recv(peer, Self::init_tag(INIT_PING, i), None, deadline)?;
                let tk = self.t.send(peer, Self::init_tag(INIT_PONG, i), data, proto, None)?;
                self.t.wait(tk, deadline)?;
            }
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(times)
    }

    /// Rank 0 decides whether to measure, measures with rank 1, and sends the model to all.
    fn agree_model(&self, tune: bool) -> Result<CostModel, crate::transport::TransportError> {
        let deadline = Instant::now() + self.timeout;
        let rank = self.rank;
        if rank == 0 {
            let flag = [tune as u8];
            let tk = self.t.send(1, Self::init_tag(INIT_TUNE, 0), &flag, Proto::Eager, None)?;
            self.t.wait(tk, deadline)?;
        }
        let tuning =
            if rank == 1 { self.t.recv(0, Self::init_tag(INIT_TUNE, 0), None, deadline)?.1.first() == Some(&1) } else { tune };
        let mut model = CostModel::assumed();
        if tuning && rank <= 1 {
            let initiator = rank == 0;
            let small = [0u8; 8];
            let large = vec![0u8; (1 << 20).min(self.t.max_message())];
            let a = median(self.ping(1 - rank, 20, &small, Proto::Eager, initiator, deadline)?.split_off(4)) / 2.0;
            let big = median(self.ping(1 - rank, 6, &large, Proto::Rendezvous, initiator, deadline)?.split_off(1)) / 2.0;
            let ar = if self.t.one_sided() {
                median(self.ping(1 - rank, 12, &small, Proto::Rendezvous, initiator, deadline)?.split_off(2)) / 2.0
            } else {
                a
            };
            if rank == 0 {
                let (gamma, copy) = local_speeds();
                model =
                    CostModel { alpha: a, beta: ((big - a) / large.len() as f64).max(1e-12), gamma, copy, alpha_rndv: ar.max(a) };
            }
        }
        if rank == 0 {
            let bytes = model.to_bytes();
            for peer in 1..self.world {
                let tk = self.t.send(peer, Self::init_tag(INIT_MODEL, 0), &bytes, Proto::Eager, None)?;
                self.t.wait(tk, deadline)?;
            }
            Ok(model)
        } else {
            let (_, msg) = self.t.recv(0, Self::init_tag(INIT_MODEL, 0), None, deadline)?;
            Ok(CostModel::from_bytes(&msg).unwrap_or(model))
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The per-call limit.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The policy (its model is the same on every rank).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.t
    }

    /// Counters.
    pub fn stats(&self) -> CommStats {
        let mut s = self.state.lock().stats.clone();
        s.transport = self.t.stats();
        s
    }

    /// What the policy would choose for `op` over `bytes` (`f32` unless given).
    pub fn decide(&self, op: Op, bytes: usize, dtype: DType) -> Decision {
        self.policy.choose(op, bytes, dtype, self.world)
    }

    fn invalid(&self, op: Op, argument: &'static str, message: String) -> CollectiveError {
        CollectiveError::InvalidArgument { rank: self.rank, op: op.name(), argument, message }
    }

    fn elements(&self, op: Op, argument: &'static str, bytes: usize, dtype: DType) -> Result<usize, CollectiveError> {
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(self.invalid(op, argument, format!("{bytes} bytes is not a whole number of {dtype} elements")));
        }
        Ok(bytes / dtype.size())
    }

    fn check_root(&self, op: Op, root: usize) -> Result<(), CollectiveError> {
        if root >= self.world {
            return Err(self.invalid(op, "root", format!("{root} is not a rank of this world of {}", self.world)));
        }
        Ok(())
    }

    /// Runs one collective: numbers the call, chooses the algorithm, sends the header, runs
    /// `body`, and on failure tells the other ranks and marks the communicator broken.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        op: Op,
        dtype: DType,
        reduce: Option<ReduceOp>,
        root: usize,
        count: usize,
        policy_bytes: usize,
        body: impl FnOnce(&mut Ctx<'_, T>, Algo) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        let mut st = self.state.lock();
        if let Some(first) = &st.broken {
            return Err(CollectiveError::Broken { rank: self.rank, first: first.clone() });
        }
        st.calls += 1;
        let call = st.calls;
        let d = self.policy.choose(op, policy_bytes, dtype, self.world);
        let mut seg = d.segment;
        if policy_bytes / seg >= MAX_SEGMENTS {
            seg = (policy_bytes / (MAX_SEGMENTS - 1)).div_ceil(dtype.size()) * dtype.size();
        }
        if self.policy.debug {
            info!(target: "mobius::policy", rank = self.rank, call, op = op.name(), bytes = policy_bytes, dtype = dtype.name(),
                world = self.world, algo = d.algo.name(), segment = seg, proto = self.policy.proto(seg.min(policy_bytes.max(1))).name(),
                estimate_us = d.estimate * 1e6, forced = d.forced, "mobius policy decision");
        }
        let header =
            Header { call, op, dtype, reduce, algo: d.algo, root: root as u32, count: count as u64, segment: seg as u64 };
        let label = format!("{op} (call #{call}, {}, {policy_bytes} bytes of {dtype})", d.algo);
        let deadline = Instant::now() + self.timeout;
        let seq = ((call - 1) % 0x7FFF_FFFF) as u32 + 1;
        let result = (|| {
            if self.world > 1 {
                let right = (self.rank + 1) % self.world;
                let bytes = header.encode();
                let err = |source| CollectiveError::Transport { rank: self.rank, op: label.clone(), source };
                let tk = self.t.send(right, algo::tag(0, STEP_HEADER, 0), &bytes, Proto::Eager, None).map_err(err)?;
                self.t.wait(tk, deadline).map_err(err)?;
            }
            let expect = (self.world > 1).then_some(header);
            let op_value = reduce.unwrap_or(ReduceOp::Sum);
            let mut ctx = Ctx::new(&self.t, &self.policy, seq, deadline, dtype, op_value, seg, expect, label.clone(), op.name());
            body(&mut ctx, d.algo)
        })();
        match result {
            Ok(()) => {
                let key = format!("{}.{}", op.name(), d.algo.name());
                *st.stats.calls.entry(key).or_default() += 1;
                *st.stats.bytes.entry(op.name().to_string()).or_default() += policy_bytes as u64;
                Ok(())
            }
            Err(e) => {
                if !e.is_remote_abort() && self.world > 1 {
                    self.t.abort(&e.to_string());
                }
                st.broken = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// Allreduce of `buf` in place, as raw bytes of `dtype`.
    pub fn allreduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CollectiveError> {
        let count = self.elements(Op::AllReduce, "buf", buf.len(), dtype)?;
        let world = self.world;
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        self.run(Op::AllReduce, dtype, Some(op), 0, count, len, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::RecursiveDoubling => reducing::allreduce_rd(ctx, ptr, count)?,
                    Algo::HalvingDoubling => reducing::allreduce_rhd(ctx, ptr, count)?,
                    _ => reducing::allreduce_ring(ctx, ptr, count)?,
                }
            }
            Ok(())
        })?;
        if op == ReduceOp::Avg {
            finish_avg(dtype, buf, world);
        }
        Ok(())
    }

    /// Broadcast of root's `buf` to every rank.
    pub fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<(), CollectiveError> {
        self.check_root(Op::Broadcast, root)?;
        let count = self.elements(Op::Broadcast, "buf", buf.len(), dtype)?;
        let (len, ptr, world) = (buf.len(), buf.as_mut_ptr(), self.world);
        self.run(Op::Broadcast, dtype, None, root, count, len, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::Ring => rooted::broadcast_chain(ctx, ptr, len, root)?,
                    _ => rooted::broadcast_tree(ctx, ptr, len, root)?,
                }
            }
            Ok(())
        })
    }

    /// Reduce to `root` in place: root's `buf` gets the result; on other ranks `buf` holds
    /// partial results afterwards (as torch's `reduce`).
    pub fn reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<(), CollectiveError> {
        self.check_root(Op::Reduce, root)?;
        let count = self.elements(Op::Reduce, "buf", buf.len(), dtype)?;
        let (len, ptr, world) = (buf.len(), buf.as_mut_ptr(), self.world);
        self.run(Op::Reduce, dtype, Some(op), root, count, len, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::Ring => rooted::reduce_chain(ctx, ptr, len, root)?,
                    _ => rooted::reduce_tree(ctx, ptr, len, root)?,
                }
            }
            Ok(())
        })?;
        if op == ReduceOp::Avg && self.rank == root {
            finish_avg(dtype, buf, world);
        }
        Ok(())
    }

    /// Allgather: `recv` (world × `send`) gets every rank's `send`, in rank order.
    pub fn allgather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        let count = self.elements(Op::AllGather, "send", send.len(), dtype)?;
        if recv.len() != send.len() * self.world {
            return Err(self.invalid(
                Op::AllGather,
                "recv",
                format!(
                    "{} bytes, but world ({}) × send ({} bytes) = {}",
                    recv.len(),
                    self.world,
                    send.len(),
                    send.len() * self.world
                ),
            ));
        }
        let (world, rank) = (self.world, self.rank);
        recv[rank * send.len()..(rank + 1) * send.len()].copy_from_slice(send);
        let (ptr, total) = (recv.as_mut_ptr(), recv.len());
        self.run(Op::AllGather, dtype, None, 0, count, total, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::RecursiveDoubling => exchange::allgather_rd(ctx, ptr, count)?,
                    _ => exchange::allgather_ring(ctx, ptr, count)?,
                }
            }
            Ok(())
        })
    }

    /// Reduce-scatter: `send` holds world blocks of `recv.len()` bytes; rank `i`'s `recv`
    /// gets the reduction of every rank's block `i`.
    pub fn reduce_scatter_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CollectiveError> {
        let count = self.elements(Op::ReduceScatter, "recv", recv.len(), dtype)?;
        if send.len() != recv.len() * self.world {
            return Err(self.invalid(
                Op::ReduceScatter,
                "send",
                format!(
                    "{} bytes, but world ({}) × recv ({} bytes) = {}",
                    send.len(),
                    self.world,
                    recv.len(),
                    recv.len() * self.world
                ),
            ));
        }
        let (world, rank, cb) = (self.world, self.rank, recv.len());
        let mut work = send.to_vec();
        let (ptr, total) = (work.as_mut_ptr(), work.len());
        self.run(Op::ReduceScatter, dtype, Some(op), 0, count, total, |ctx, algo| {
            if world > 1 {
                match algo {
                    Algo::HalvingDoubling => reducing::reduce_scatter_rhd(ctx, ptr, count)?,
                    _ => reducing::reduce_scatter_ring(ctx, ptr, count)?,
                }
            }
            Ok(())
        })?;
        recv.copy_from_slice(&work[rank * cb..(rank + 1) * cb]);
        if op == ReduceOp::Avg {
            finish_avg(dtype, recv, world);
        }
        Ok(())
    }

    /// Alltoall: block `j` of `send` goes to rank `j`, which puts it at block `rank` of its
    /// `recv`. Both hold world equal blocks.
    pub fn alltoall_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        if send.len() != recv.len() {
            return Err(self.invalid(Op::AllToAll, "recv", format!("{} bytes, but send has {}", recv.len(), send.len())));
        }
        let elems = self.elements(Op::AllToAll, "send", send.len(), dtype)?;
        if !elems.is_multiple_of(self.world) {
            return Err(self.invalid(
                Op::AllToAll,
                "send",
                format!("{elems} elements do not split into {} equal blocks", self.world),
            ));
        }
        let count = elems / self.world;
        let (world, total) = (self.world, send.len());
        let (sp, rp) = (send.as_ptr(), recv.as_mut_ptr());
        self.run(Op::AllToAll, dtype, None, 0, count, total, |ctx, algo| {
            if world > 1 {
                exchange::alltoall(ctx, sp, rp, count, algo == Algo::Pairwise)
            } else {
                // SAFETY: both buffers hold `total` bytes and are distinct (`&` and `&mut`).
                unsafe { std::ptr::copy_nonoverlapping(sp, rp, total) };
                Ok(())
            }
        })
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<(), CollectiveError> {
        let world = self.world;
        self.run(Op::Barrier, DType::U8, None, 0, 0, 0, |ctx, _| if world > 1 { exchange::barrier(ctx) } else { Ok(()) })
    }

    fn p2p_tag(tag: u32, seg: u32, last: bool) -> Tag {
        (1u64 << 63) | ((tag as u64 & 0x7FFF_FFFF) << 32) | ((last as u64) << 31) | (seg as u64 & 0x7FFF_FFFF)
    }

    fn p2p_check(&self, what: &'static str, peer: usize, tag: u32) -> Result<(), CollectiveError> {
        if peer >= self.world || peer == self.rank {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                op: what,
                argument: "peer",
                message: format!("{peer} is not another rank of this world of {}", self.world),
            });
        }
        if tag > 0x7FFF_FFFF {
            return Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                op: what,
                argument: "tag",
                message: format!("{tag} is above 2^31 - 1"),
            });
        }
        Ok(())
    }

    /// Sends `buf` to `dst` under `tag`; returns when `buf` may be reused.
    pub fn send_bytes(&self, buf: &[u8], dst: usize, tag: u32) -> Result<(), CollectiveError> {
        self.p2p_check("send", dst, tag)?;
        let deadline = Instant::now() + self.timeout;
        let label = format!("send of {} bytes to rank {dst} (tag {tag})", buf.len());
        let err = |source| CollectiveError::Transport { rank: self.rank, op: label.clone(), source };
        let max = self.t.max_message();
        let n = buf.len().div_ceil(max).max(1);
        for j in 0..n {
            let part = &buf[(j * max).min(buf.len())..((j + 1) * max).min(buf.len())];
            let tk = self
                .t
                .send(dst, Self::p2p_tag(tag, j as u32, j + 1 == n), part, self.policy.proto(part.len()), None)
                .map_err(err)?;
            self.t.wait(tk, deadline).map_err(err)?;
        }
        let mut st = self.state.lock();
        *st.stats.calls.entry("send".into()).or_default() += 1;
        Ok(())
    }

    /// Receives into `buf` from `src` under `tag`; the sender must send exactly
    /// `buf.len()` bytes.
    pub fn recv_bytes(&self, buf: &mut [u8], src: usize, tag: u32) -> Result<(), CollectiveError> {
        self.p2p_check("recv", src, tag)?;
        let deadline = Instant::now() + self.timeout;
        let label = format!("recv of {} bytes from rank {src} (tag {tag})", buf.len());
        let err = |source| CollectiveError::Transport { rank: self.rank, op: label.clone(), source };
        let max = self.t.max_message();
        let n = buf.len().div_ceil(max).max(1);
        let expected = buf.len();
        let mismatch = |got: String| CollectiveError::Mismatch {
            rank: self.rank,
            op: "recv",
            peer: src,
            message: format!("this rank expects {expected} bytes under tag {tag} but rank {src} sent {got}"),
        };
        for j in 0..n {
            let (lo, hi) = ((j * max).min(buf.len()), ((j + 1) * max).min(buf.len()));
            let (which, msg) = self
                .t
                .recv(src, Self::p2p_tag(tag, j as u32, false), Some((src, Self::p2p_tag(tag, j as u32, true))), deadline)
                .map_err(err)?;
            let last = which == 1;
            if msg.len() != hi - lo || last != (j + 1 == n) {
                return Err(mismatch(if last { format!("{} bytes", j * max + msg.len()) } else { "more".into() }));
            }
            buf[lo..hi].copy_from_slice(&msg);
        }
        let mut st = self.state.lock();
        *st.stats.calls.entry("recv".into()).or_default() += 1;
        Ok(())
    }

    // ----- typed API -----

    /// Allreduce in place.
    pub fn allreduce<E: Element>(&self, buf: &mut [E], op: ReduceOp) -> Result<(), CollectiveError> {
        self.allreduce_bytes(bytemuck::cast_slice_mut(buf), E::DTYPE, op)
    }

    /// Broadcast from `root`.
    pub fn broadcast<E: Element>(&self, buf: &mut [E], root: usize) -> Result<(), CollectiveError> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), E::DTYPE, root)
    }

    /// Reduce to `root` (see [`reduce_bytes`](Self::reduce_bytes)).
    pub fn reduce<E: Element>(&self, buf: &mut [E], op: ReduceOp, root: usize) -> Result<(), CollectiveError> {
        self.reduce_bytes(bytemuck::cast_slice_mut(buf), E::DTYPE, op, root)
    }

    /// Allgather.
    pub fn allgather<E: Element>(&self, send: &[E], recv: &mut [E]) -> Result<(), CollectiveError> {
        self.allgather_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), E::DTYPE)
    }

    /// Reduce-scatter.
    pub fn reduce_scatter<E: Element>(&self, send: &[E], recv: &mut [E], op: ReduceOp) -> Result<(), CollectiveError> {
        self.reduce_scatter_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), E::DTYPE, op)
    }

    /// Alltoall.
    pub fn alltoall<E: Element>(&self, send: &[E], recv: &mut [E]) -> Result<(), CollectiveError> {
        self.alltoall_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), E::DTYPE)
    }

    /// Point-to-point send.
    pub fn send<E: Element>(&self, buf: &[E], dst: usize, tag: u32) -> Result<(), CollectiveError> {
        self.send_bytes(bytemuck::cast_slice(buf), dst, tag)
    }

    /// Point-to-point receive.
    pub fn recv<E: Element>(&self, buf: &mut [E], src: usize, tag: u32) -> Result<(), CollectiveError> {
        self.recv_bytes(bytemuck::cast_slice_mut(buf), src, tag)
    }
}
