//! The communicator: setting up a group of ranks, and the collective calls.
//!
//! * [`config`] — [`CommConfig`]: the settings, from the environment.
//! * [`rendezvous`] — [`Rendezvous`]: how the ranks find each other; [`StoreRendezvous`].
//! * this module — [`Communicator`]: joining, the start-up model exchange, and running a call.
//! * [`ops`] — the collective and point-to-point calls, raw-byte and typed.

mod config;
mod ops;
mod rendezvous;

use crate::algo::{self, CallLabel, Ctx, MAX_SEGMENTS, MAX_STEP, STEP_HEADER};
use crate::dtype::{DType, ReduceOp};
use crate::error::CollectiveError;
use crate::header::Header;
use crate::mesh::{Mesh, MeshListener};
use crate::mesh_transport::MeshTransport;
use crate::policy::{Algo, CostModel, Decision, Op, Policy, Topology};
use crate::store::StoreServer;
use crate::transport::{Proto, Tag, Transport, TransportStats};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tracing::{info, warn};

pub use config::{host_identity, CommConfig, GroupKey};
pub use rendezvous::{Rendezvous, StoreRendezvous};

/// Largest world supported (ring steps are numbered in 12 bits).
pub const MAX_WORLD: usize = (MAX_STEP as usize) / 2;

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
    /// Calls per (op, algorithm) and bytes per op, keyed by static names: counting a call
    /// allocates nothing (the string keys of [`CommStats`] are made when it is read).
    per_algo: BTreeMap<(&'static str, &'static str), u64>,
    per_op: BTreeMap<&'static str, u64>,
}

/// A group of ranks that run collectives together.
///
/// Collective calls on one communicator are serialised (point-to-point calls may run beside
/// them, from other threads); every rank must make the same calls in the same
/// order with matching arguments (checked: a mismatch is an error naming the argument). A
/// failed collective leaves the communicator unusable ([`CollectiveError::Broken`]).
pub struct Communicator<T: Transport = MeshTransport> {
    t: T,
    rank: usize,
    world: usize,
    timeout: Duration,
    policy: Policy,
    state: Mutex<State>,
    /// Every rank's published mesh address, in rank order (empty for a transport built by
    /// the caller).
    addresses: Vec<SocketAddr>,
    /// (rank 0) The links measured for the cost model.
    links: Vec<LinkCost>,
    // Point-to-point calls are counted outside `state`, which a collective holds for its
    // whole run: a send or receive on another thread must not wait for it.
    p2p_sent: AtomicU64,
    p2p_received: AtomicU64,
    /// Monitored barriers so far (their messages carry the number).
    monitored: AtomicU64,
}

/// What the start-up measurement found on one link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// The lower rank of the link.
    pub a: usize,
    /// The higher rank.
    pub b: usize,
    /// One-way latency of an eager message, seconds.
    pub alpha: f64,
    /// Seconds per byte of a rendezvous message.
    pub beta: f64,
    /// One-way latency of a small rendezvous message, seconds.
    pub alpha_rndv: f64,
}

/// The links the algorithms use, in rounds of disjoint pairs (each round's pairs measure at
/// the same time): ring neighbours `(r, r+1 mod p)` and the partners `r xor 2^k` of
/// recursive doubling, which are also those of recursive halving, Rabenseifner and the
/// binomial trees rooted at 0. Direct and pairwise exchanges use every pair; their cost is
/// bounded by the worst of these on the networks this measures (hosts in a ring order).
/// With several hosts, also the links of the hierarchical algorithms: each host's binomial
/// tree from its leader (so every host of two ranks or more has a same-host link measured),
/// and the ring and doubling partners among the leaders.
pub(crate) fn measured_links(topo: &Topology) -> Vec<Vec<(usize, usize)>> {
    let world = topo.host_of.len();
    let mut links: Vec<(usize, usize)> = Vec::new();
    let mut add = |a: usize, b: usize| {
        let l = (a.min(b), a.max(b));
        if l.0 != l.1 && !links.contains(&l) {
            links.push(l);
        }
    };
    let mut flat = |ranks: &[usize]| {
        let n = ranks.len();
        for i in 0..n {
            add(ranks[i], ranks[(i + 1) % n]);
        }
        let mut d = 1;
        while d < n {
            for i in 0..n {
                if i ^ d < n {
                    add(ranks[i], ranks[i ^ d]);
                }
            }
            d <<= 1;
        }
    };
    flat(&(0..world).collect::<Vec<_>>());
    if topo.hosts() > 1 {
        flat(&topo.leaders());
        for h in 0..topo.hosts() {
            // The binomial tree's parent of position v is v minus its lowest set bit.
            let m = topo.members(h);
            for v in 1..m.len() {
                add(m[v], m[v - (v & v.wrapping_neg())]);
            }
        }
    }
    let mut rounds: Vec<Vec<(usize, usize)>> = Vec::new();
    for l in links {
        let free = |round: &Vec<(usize, usize)>| round.iter().all(|&(x, y)| x != l.0 && x != l.1 && y != l.0 && y != l.1);
        match rounds.iter_mut().find(|r| free(r)) {
            Some(r) => r.push(l),
            None => rounds.push(vec![l]),
        }
    }
    rounds
}

impl Communicator<MeshTransport> {
    /// Joins the group described by the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `MOBIUS_*`).
    pub fn from_env() -> Result<Self, CollectiveError> {
        let (config, master) = CommConfig::from_env()?;
        Self::init(config, master)
    }

    /// Joins the group through the store at `master` (served by rank 0).
    pub fn init(mut config: CommConfig, master: SocketAddr) -> Result<Self, CollectiveError> {
        config.validate()?;
        let rank = config.rank;
        let rdv = |m: String| CollectiveError::Rendezvous { rank, message: m };
        let deadline = Instant::now() + config.timeout;
        let _server = if rank == 0 { Some(StoreServer::bind(master).map_err(rdv)?) } else { None };
        let mut store = StoreRendezvous::connect(master, &format!("mobius/{}", config.job), deadline).map_err(rdv)?;
        if config.group.is_none() {
            config.group = Some(store.group(rank, deadline).map_err(rdv)?);
        }
        let ip = config.local_ip(Some(master))?;
        Self::join(config, ip, &mut store)
        // Rank 0's store stops here: the mesh is complete, so every rank has read every
        // address (each connects to rank 0 only after reading them all).
    }

    /// Joins the group, exchanging addresses through `rendezvous` (e.g. torch's store), with
    /// the mesh listening on `ip`.
    ///
    /// With `MOBIUS_TRANSPORT=auto` a rank listens on tcp and on the shm provider's socket
    /// named after the same address (one split provider of the registry's
    /// [`PER_HOST`](rdma_shuffle_providers::PER_HOST) pair), and its card says which host it
    /// is on. Each link then goes over shm when both ranks' cards name the same host, over tcp
    /// otherwise: a group on one host is all shm, a group of several hosts reduces inside each
    /// over shm and across them over tcp, and a rank that asked for tcp (or could not listen
    /// on shm) publishes no host and is reached over tcp by everyone. Each rank decides from
    /// the same cards, so both ends of a link agree without another round.
    pub fn join(config: CommConfig, ip: IpAddr, rendezvous: &mut dyn Rendezvous) -> Result<Self, CollectiveError> {
        config.validate()?;
        let rank = config.rank;
        let rdv = |m: String| CollectiveError::Rendezvous { rank, message: m };
        let deadline = Instant::now() + config.timeout;
        let bind = |p| MeshListener::bind_with_spin(p, SocketAddr::new(ip, 0), rank, config.spin).map_err(|e| rdv(e.to_string()));
        let mut split = None;
        let listener = if config.transport == rdma_shuffle_providers::AUTO && config.world > 1 {
            let s = rdma_shuffle_providers::open_per_host(&config.provider_options()).map_err(|e| rdv(e.to_string()))?;
            match bind(s.clone()) {
                Ok(l) => {
                    split = Some(s);
                    l
                }
                // Shared memory is an optimisation: without it this rank says nothing of its
                // host, and every link of it is tcp.
                Err(e) => {
                    warn!(target: "mobius", rank, error = %e, "no shm listener; this rank's links will use tcp");
                    bind(config.provider()?)?
                }
            }
        } else {
            bind(config.provider()?)?
        };
        let addr = listener.local_addr();
        let card = match split {
            Some(_) => auto_card(addr, &config.host_id.clone().unwrap_or_else(host_identity)),
            None => addr.to_string(),
        };
        let cards = rendezvous.exchange(rank, config.world, &card, deadline).map_err(rdv)?;
        let mut addrs = Vec::with_capacity(cards.len());
        for (r, c) in cards.iter().enumerate() {
            let a = c.split(' ').next().unwrap_or_default();
            addrs.push(a.parse().map_err(|_| rdv(format!("rank {r} published an unreadable address {a:?}")))?);
        }
        if let Some(s) = &split {
            // The other ranks on this host; this rank connects to none of itself.
            let here = card_host(&card);
            let near: HashSet<SocketAddr> =
                (0..addrs.len()).filter(|&r| r != rank && card_host(&cards[r]) == here).map(|r| addrs[r]).collect();
            let all = near.len() + 1 == addrs.len();
            s.route(near, all);
        }
        let mut mc = config.mesh_config();
        mc.connect_timeout = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        let mesh = Mesh::connect(listener, &addrs, mc).map_err(|e| rdv(e.to_string()))?;
        let mut comm = Communicator::with_transport(MeshTransport::new(mesh), &config)?;
        comm.addresses = addrs;
        Ok(comm)
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

/// The card of a rank that can use shm: its address and its host.
fn auto_card(addr: SocketAddr, host: &str) -> String {
    // Cards are split at spaces; an identity is compared, never parsed.
    format!("{addr} shm@{}", host.replace(char::is_whitespace, "_"))
}

/// The host a card names, if its rank can use shm.
fn card_host(card: &str) -> Option<&str> {
    card.split_once(' ').and_then(|(_, rest)| rest.strip_prefix("shm@"))
}

/// Tags of the start-up exchange (call number 0, below every collective's).
const INIT_TUNE: u32 = 1;
const INIT_MODEL: u32 = 2;
const INIT_PING: u32 = 3;
const INIT_PONG: u32 = 4;
const INIT_LINKS: u32 = 5;
const INIT_HOSTS: u32 = 6;
/// Tags of the monitored barrier (call number 0 as well; the barrier's own number, modulo
/// 2^20, is the segment): a rank's arrival at rank 0, and rank 0's release.
pub(super) const MONITORED_ARRIVE: u32 = 7;
pub(super) const MONITORED_RELEASE: u32 = 8;

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
            topology: Topology::single(world),
            eager_limit: t.eager_limit(),
            max_message: t.max_message(),
            one_sided: t.one_sided(),
            cpu_copies: t.capabilities().cpu_copies,
            record_segment: crate::policy::record_segment(t.capabilities().record_body),
        };
        let mut comm = Communicator {
            t,
            rank,
            world,
            timeout: config.timeout,
            policy,
            state: Mutex::new(State { calls: 0, broken: None, per_algo: BTreeMap::new(), per_op: BTreeMap::new() }),
            addresses: Vec::new(),
            links: Vec::new(),
            p2p_sent: AtomicU64::new(0),
            p2p_received: AtomicU64::new(0),
            monitored: AtomicU64::new(0),
        };
        if world > 1 {
            let mine = config.host_id.clone().unwrap_or_else(host_identity);
            let ids = comm.exchange_hosts(&mine).map_err(|e| CollectiveError::Rendezvous { rank, message: e.to_string() })?;
            comm.policy.topology = Topology::from_ids(&ids);
            // More ranks here than cores: a waiting rank yields instead of spinning (Open
            // MPI's yield_when_idle rule), before the links are measured below.
            let here = ids.iter().filter(|h| **h == mine).count();
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            comm.t.set_oversubscribed(here > cores);
            let (model, links) = comm
                .agree_model(config.tune, config.local_link, config.model)
                .map_err(|e| CollectiveError::Rendezvous { rank, message: e.to_string() })?;
            comm.policy.model = model;
            comm.links = links;
        }
        if comm.policy.debug {
            let m = comm.policy.model;
            let topo = &comm.policy.topology;
            info!(target: "mobius::policy", rank, world, provider = comm.t.provider(),
                alpha_us = m.alpha * 1e6, beta_gbs = 1e-9 / m.beta.max(1e-18), gamma_gbs = 1e-9 / m.gamma.max(1e-18),
                copy_gbs = 1e-9 / m.copy.max(1e-18), alpha_rndv_us = m.alpha_rndv * 1e6,
                local_alpha_us = m.local_alpha * 1e6, local_beta_gbs = 1e-9 / m.local_beta.max(1e-18),
                hosts = topo.hosts(), host = topo.host_of.get(rank).copied().unwrap_or(0), max_ranks_per_host = topo.max_local(),
                "mobius cost model");
        }
        Ok(comm)
    }

    pub(super) fn init_tag(step: u32, seg: u32) -> Tag {
        algo::tag(0, step, seg)
    }

    /// Every rank's host identity, in rank order: each sends its own to rank 0, which sends
    /// the list to every rank.
    fn exchange_hosts(&self, mine: &str) -> Result<Vec<String>, crate::transport::TransportError> {
        let deadline = Instant::now() + self.timeout;
        let proto = |n: usize| if n <= self.t.eager_limit() { Proto::Eager } else { Proto::Rendezvous };
        if self.rank != 0 {
            let tk = self.t.send(0, Self::init_tag(INIT_HOSTS, 0), mine.as_bytes(), proto(mine.len()), None)?;
            self.t.wait(tk, deadline)?;
            let (_, msg) = self.t.recv(0, Self::init_tag(INIT_HOSTS, 1), None, deadline)?;
            return Ok(String::from_utf8_lossy(&msg).split('\n').map(str::to_string).collect());
        }
        let mut ids = vec![mine.to_string()];
        for peer in 1..self.world {
            let (_, msg) = self.t.recv(peer, Self::init_tag(INIT_HOSTS, 0), None, deadline)?;
            // A newline would split the list: identities are compared, not parsed.
            ids.push(String::from_utf8_lossy(&msg).replace('\n', " "));
        }
        let all = ids.join("\n");
        for peer in 1..self.world {
            let tk = self.t.send(peer, Self::init_tag(INIT_HOSTS, 1), all.as_bytes(), proto(all.len()), None)?;
            self.t.wait(tk, deadline)?;
        }
        Ok(ids)
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

    /// Measures one link with `peer` (the lower rank initiates): eager latency, and the
    /// rendezvous line through two sizes — its time per byte and its fixed cost per message.
    ///
    /// The fixed cost is what sets the pipeline's segment size. A rendezvous message pays
    /// more than an eager one: a request, the receiver's pull (shm: a `process_vm_readv`,
    /// which pins the sender's pages; verbs: a READ) and an acknowledgement. Taking the eager
    /// latency in its place made segments of 64 KiB on shm, where each cost ~8 µs more than
    /// the bytes (2 ranks, 1 MiB allreduce: 350 µs against 265 µs with 256 KiB segments).
    fn measure_link(&self, peer: usize, deadline: Instant) -> Result<(f64, f64, f64), crate::transport::TransportError> {
        let initiator = self.rank < peer;
        let small = [0u8; 8];
        let large = vec![0u8; (1 << 20).min(self.t.max_message())];
        let mid = vec![0u8; (large.len() / 16).max(self.t.eager_limit() + 1).min(large.len())];
        let a = median(self.ping(peer, 20, &small, Proto::Eager, initiator, deadline)?.split_off(4)) / 2.0;
        let big = median(self.ping(peer, 6, &large, Proto::Rendezvous, initiator, deadline)?.split_off(1)) / 2.0;
        let at_mid = median(self.ping(peer, 12, &mid, Proto::Rendezvous, initiator, deadline)?.split_off(2)) / 2.0;
        let ar = if self.t.one_sided() {
            median(self.ping(peer, 12, &small, Proto::Rendezvous, initiator, deadline)?.split_off(2)) / 2.0
        } else {
            a
        };
        let span = (large.len() - mid.len()) as f64;
        let beta = if span > 0.0 { (big - at_mid) / span } else { (big - a) / large.len() as f64 };
        // The line's intercept; never below the latencies measured directly (a noisy pair of
        // points can put it under them).
        let fixed = at_mid - mid.len() as f64 * beta.max(0.0);
        Ok((a, beta.max(1e-12), fixed.max(ar).max(a)))
    }

    /// Rank 0 decides whether to measure; then every link the algorithms use is measured
    /// (rounds of disjoint pairs, [`measured_links`]), the lower rank of each link sends what
    /// it found to rank 0, and rank 0 sends the model — the worst link's α, β and rendezvous
    /// latency, with its own γ and copy speed — to every rank, so all choose alike.
    /// `local_link` (rank 0's `MOBIUS_LOCAL_LINK`) replaces the same-host α and β.
    fn agree_model(
        &self,
        tune: bool,
        local_link: Option<(f64, f64)>,
        known: Option<CostModel>,
    ) -> Result<(CostModel, Vec<LinkCost>), crate::transport::TransportError> {
        let deadline = Instant::now() + self.timeout;
        let rank = self.rank;
        if rank == 0 {
            let flag = [tune as u8];
            for peer in 1..self.world {
                let tk = self.t.send(peer, Self::init_tag(INIT_TUNE, 0), &flag, Proto::Eager, None)?;
                self.t.wait(tk, deadline)?;
            }
        }
        let tuning =
            if rank == 0 { tune } else { self.t.recv(0, Self::init_tag(INIT_TUNE, 0), None, deadline)?.1.first() == Some(&1) };
        let mut model = known.unwrap_or_else(CostModel::assumed);
        let mut links = Vec::new();
        if tuning {
            let mut mine = Vec::new();
            for round in measured_links(&self.policy.topology) {
                for &(a, b) in &round {
                    if a == rank || b == rank {
                        let peer = if a == rank { b } else { a };
                        let (alpha, beta, alpha_rndv) = self.measure_link(peer, deadline)?;
                        if a == rank {
                            mine.push(LinkCost { a, b, alpha, beta, alpha_rndv });
                        }
                    }
                }
            }
            if rank == 0 {
                links = mine;
                for peer in 1..self.world {
                    let (_, msg) = self.t.recv(peer, Self::init_tag(INIT_LINKS, 0), None, deadline)?;
                    for c in msg.chunks_exact(32) {
                        let f = |i: usize| f64::from_be_bytes(c[i..i + 8].try_into().unwrap_or([0; 8]));
                        let b = u64::from_be_bytes(c[0..8].try_into().unwrap_or([0; 8])) as usize;
                        links.push(LinkCost { a: peer, b, alpha: f(8), beta: f(16), alpha_rndv: f(24) });
                    }
                }
                // Network links are those between hosts; with one host (or one rank per host)
                // every link is both kinds.
                let topo = &self.policy.topology;
                let kind = |local: bool| -> Vec<&LinkCost> {
                    let some: Vec<&LinkCost> = links.iter().filter(|l| topo.same_host(l.a, l.b) == local).collect();
                    if some.is_empty() {
                        links.iter().collect()
                    } else {
                        some
                    }
                };
                let (net, same) = (kind(false), kind(true));
                let worst = |ls: &[&LinkCost], f: fn(&LinkCost) -> f64| {
                    ls.iter().map(|l| f(l)).filter(|x| x.is_finite()).fold(0.0, f64::max)
                };
                let (gamma, copy) = local_speeds();
                model = CostModel {
                    alpha: worst(&net, |l| l.alpha),
                    beta: worst(&net, |l| l.beta).max(1e-12),
                    gamma,
                    copy,
                    alpha_rndv: worst(&net, |l| l.alpha_rndv),
                    local_alpha: worst(&same, |l| l.alpha),
                    local_beta: worst(&same, |l| l.beta).max(1e-12),
                };
            } else {
                let mut body = Vec::with_capacity(mine.len() * 32);
                for l in &mine {
                    body.extend_from_slice(&(l.b as u64).to_be_bytes());
                    for v in [l.alpha, l.beta, l.alpha_rndv] {
                        body.extend_from_slice(&v.to_be_bytes());
                    }
                }
                let proto = if body.len() <= self.t.eager_limit() { Proto::Eager } else { Proto::Rendezvous };
                let tk = self.t.send(0, Self::init_tag(INIT_LINKS, 0), &body, proto, None)?;
                self.t.wait(tk, deadline)?;
            }
        }
        if rank == 0 {
            if let Some((alpha, beta)) = local_link {
                (model.local_alpha, model.local_beta) = (alpha, beta);
            }
            let bytes = model.to_bytes();
            for peer in 1..self.world {
                let tk = self.t.send(peer, Self::init_tag(INIT_MODEL, 0), &bytes, Proto::Eager, None)?;
                self.t.wait(tk, deadline)?;
            }
            Ok((model, links))
        } else {
            let (_, msg) = self.t.recv(0, Self::init_tag(INIT_MODEL, 0), None, deadline)?;
            Ok((CostModel::from_bytes(&msg).unwrap_or(model), links))
        }
    }

    /// Ends the group at once (torch's `ProcessGroup.abort`): every pending call of this
    /// rank, collective or point-to-point, on any thread, fails now, and every peer is told
    /// (their pending calls fail naming this rank, or `culprit` when the abort is because
    /// that rank failed). The communicator is unusable afterwards; dropping it releases
    /// its links, threads and memory.
    pub fn abort(&self, culprit: Option<usize>, reason: &str) {
        if self.world > 1 {
            self.t.abort(culprit, reason);
        }
    }

    /// Every rank's published mesh address, in rank order (empty when the caller built the
    /// transport).
    pub fn addresses(&self) -> &[SocketAddr] {
        &self.addresses
    }

    /// (rank 0) The links measured at start: the model takes the worst of them. Empty on
    /// other ranks and when nothing was measured.
    pub fn link_costs(&self) -> &[LinkCost] {
        &self.links
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

    /// Which host each rank is on (from the host identities the ranks published at start).
    pub fn topology(&self) -> &Topology {
        &self.policy.topology
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
        let mut s = CommStats::default();
        {
            let st = self.state.lock();
            s.calls = st.per_algo.iter().map(|((op, algo), n)| (format!("{op}.{algo}"), *n)).collect();
            s.bytes = st.per_op.iter().map(|(op, n)| (op.to_string(), *n)).collect();
        }
        for (key, n) in [("send", &self.p2p_sent), ("recv", &self.p2p_received)] {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                s.calls.insert(key.to_string(), n);
            }
        }
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

    fn check_op(&self, op: Op, dtype: DType, reduce: ReduceOp) -> Result<(), CollectiveError> {
        dtype.check_op(reduce).map_err(|m| self.invalid(op, "op", m))
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
                estimate_us = d.estimate * 1e6, forced = d.forced, leaders = d.inner.map_or("-", |a| a.name()),
                hosts = self.policy.topology.hosts(), "mobius policy decision");
        }
        let header =
            Header { call, op, dtype, reduce, algo: d.algo, root: root as u32, count: count as u64, segment: seg as u64 };
        // Formatted only for an error: a small call's time is a few microseconds.
        let label = CallLabel { op, call, algo: d.algo, bytes: policy_bytes, dtype };
        let deadline = Instant::now() + self.timeout;
        let seq = ((call - 1) % 0x7FFF_FFFF) as u32 + 1;
        let result = (|| {
            if self.world > 1 {
                let right = (self.rank + 1) % self.world;
                let bytes = header.encode();
                let err = |source| CollectiveError::Transport { rank: self.rank, op: label.to_string(), source };
                // It leaves with the call's first message on the same link (the ring's and
                // a 2-rank call's data go to the right neighbour too).
                self.t.send_with_next(right, algo::tag(0, STEP_HEADER, 0), &bytes).map_err(err)?;
            }
            let expect = (self.world > 1).then_some(header);
            let op_value = reduce.unwrap_or(ReduceOp::Sum);
            let mut ctx = Ctx::new(&self.t, &self.policy, seq, deadline, dtype, op_value, seg, expect, label, op.name());
            ctx.inner = d.inner;
            body(&mut ctx, d.algo)
        })();
        match result {
            Ok(()) => {
                *st.per_algo.entry((op.name(), d.algo.name())).or_default() += 1;
                *st.per_op.entry(op.name()).or_default() += policy_bytes as u64;
                Ok(())
            }
            Err(e) => {
                if !e.is_remote_abort() && self.world > 1 {
                    self.t.abort(e.culprit(), &e.to_string());
                }
                st.broken = Some(e.to_string());
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{measured_links, CommConfig, Communicator, Rendezvous};
    use crate::policy::Topology;
    use std::net::{IpAddr, Ipv4Addr};
    use std::time::{Duration, Instant};

    /// The rendezvous of a group of one.
    struct Alone;
    impl Rendezvous for Alone {
        fn exchange(&mut self, _: usize, _: usize, mine: &str, _: Instant) -> Result<Vec<String>, String> {
            Ok(vec![mine.to_string()])
        }
    }

    /// `MOBIUS_SPIN` is the spin of the rank's driver loop, as the loop holds it.
    #[test]
    fn the_spin_setting_reaches_the_ranks_driver() {
        for (setting, want) in [(None, rdma_shuffle_fabric::DEFAULT_SPIN), (Some("500us"), Duration::from_micros(500))] {
            let mut c = CommConfig::new(0, 1);
            c.apply_vars(setting.map(|v| ("MOBIUS_SPIN".to_string(), v.to_string()))).unwrap();
            c.set_transport("tcp").unwrap();
            c.tune = false;
            let comm = Communicator::join(c, IpAddr::V4(Ipv4Addr::LOCALHOST), &mut Alone).unwrap();
            assert_eq!(comm.transport().mesh().driver_spin(), want, "MOBIUS_SPIN={setting:?}");
        }
    }

    fn flat(world: usize) -> Vec<Vec<(usize, usize)>> {
        measured_links(&Topology::single(world))
    }

    #[test]
    fn the_model_measures_every_ring_and_doubling_link_in_rounds_of_disjoint_pairs() {
        assert_eq!(flat(1), Vec::<Vec<(usize, usize)>>::new());
        assert_eq!(flat(2), vec![vec![(0, 1)]]);
        for world in 2..=9 {
            let rounds = flat(world);
            let all: Vec<(usize, usize)> = rounds.concat();
            for r in 0..world {
                let ring = (r.min((r + 1) % world), r.max((r + 1) % world));
                assert!(ring.0 == ring.1 || all.contains(&ring), "world {world}: ring link {ring:?} missing");
                let mut d = 1;
                while d < world {
                    if r ^ d < world {
                        assert!(all.contains(&(r.min(r ^ d), r.max(r ^ d))), "world {world}: {r} xor {d} missing");
                    }
                    d <<= 1;
                }
            }
            for round in &rounds {
                let mut seen = std::collections::HashSet::new();
                for &(a, b) in round {
                    assert!(a < b && seen.insert(a) && seen.insert(b), "world {world}: round {round:?} reuses a rank");
                }
            }
            let mut dedup = all.clone();
            dedup.sort();
            dedup.dedup();
            assert_eq!(dedup.len(), all.len(), "world {world}: a link measured twice");
        }
        // Four ranks: all six pairs, three rounds of two.
        assert_eq!(flat(4).concat().len(), 6);
        assert_eq!(flat(4).len(), 3);
    }

    #[test]
    fn with_several_hosts_every_host_tree_and_leader_link_is_measured() {
        // Hosts interleaved and unequal: ranks 0 2 4 on host 0, 1 3 on host 1, 5 on host 2.
        let topo = Topology::from_ids(&["a", "b", "a", "b", "a", "c"]);
        assert_eq!((topo.hosts(), topo.max_local(), topo.leaders()), (3, 3, vec![0, 1, 5]));
        let all = measured_links(&topo).concat();
        for l in [(0, 2), (0, 4), (1, 3), (0, 1), (1, 5), (0, 5)] {
            assert!(all.contains(&l), "{l:?} missing from {all:?}");
        }
        assert!(all.iter().any(|&(a, b)| topo.same_host(a, b)) && all.iter().any(|&(a, b)| !topo.same_host(a, b)));
    }
}
