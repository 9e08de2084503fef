//! Policy: which algorithm, segment size and protocol each call uses.
//!
//! Every choice comes from one cost model, `time = α·steps + β·bytes moved + γ·bytes
//! reduced + c·bytes copied`, as in the textbook analyses (Thakur, Rabenseifner & Gropp 2005)
//! that Open MPI's decision tables and NCCL's tuner encode:
//!
//! * **α** — latency of one message, **β** — seconds per byte on the wire: measured when the
//!   communicator starts by a ping-pong between ranks 0 and 1 (small eager messages, then
//!   large rendezvous ones), and, on one-sided providers, **α_rndv**, the latency of a
//!   rendezvous message (request, READ, done);
//! * **γ** — seconds per byte of an `f32` sum, **c** — seconds per byte of `memcpy`:
//!   measured on rank 0.
//!
//! Rank 0's numbers are sent to every rank, so all ranks make the same choice for the same
//! call (a different choice would deadlock); the choice is also part of the per-call header
//! that ranks compare, so differing `MOBIUS_ALGO` settings are reported, not hung on.
//!
//! Overrides: `MOBIUS_ALGO` (`ring`, or per op: `allreduce=rd,broadcast=tree`),
//! `MOBIUS_PROTO` (`eager` | `rendezvous`), `MOBIUS_SEGMENT` (bytes). With
//! `MOBIUS_DEBUG=policy` every decision is logged (target `mobius::policy`).

use crate::dtype::DType;
use crate::error::CollectiveError;
use crate::transport::Proto;
use std::collections::HashMap;
use std::fmt;

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Reduce across ranks; every rank gets the result.
    AllReduce = 1,
    /// Root's buffer to every rank.
    Broadcast = 2,
    /// Reduce across ranks; the root gets the result.
    Reduce = 3,
    /// Every rank's block to every rank.
    AllGather = 4,
    /// Reduce across ranks; rank `i` gets block `i` of the result.
    ReduceScatter = 5,
    /// Block `j` of rank `i` goes to rank `j` (as block `i`).
    AllToAll = 6,
    /// Wait until every rank has arrived.
    Barrier = 7,
}

impl Op {
    /// Every collective.
    pub const ALL: [Op; 7] =
        [Op::AllReduce, Op::Broadcast, Op::Reduce, Op::AllGather, Op::ReduceScatter, Op::AllToAll, Op::Barrier];

    /// Name as in `MOBIUS_ALGO` and in errors.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "allreduce",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::AllGather => "allgather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllToAll => "alltoall",
            Op::Barrier => "barrier",
        }
    }

    /// The algorithms implemented for this op, the default first.
    pub fn algorithms(self) -> &'static [Algo] {
        match self {
            Op::AllReduce => &[Algo::Ring, Algo::RecursiveDoubling, Algo::HalvingDoubling, Algo::Hierarchical],
            Op::Broadcast => &[Algo::Tree, Algo::Ring],
            Op::Reduce => &[Algo::Tree, Algo::Ring],
            Op::AllGather => &[Algo::Ring, Algo::RecursiveDoubling, Algo::Hierarchical],
            Op::ReduceScatter => &[Algo::Ring, Algo::HalvingDoubling, Algo::Hierarchical],
            Op::AllToAll => &[Algo::Direct, Algo::Pairwise],
            Op::Barrier => &[Algo::Dissemination],
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|o| *o as u8 == c)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A collective algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Algo {
    /// Ring, segmented and pipelined (allreduce = reduce-scatter + allgather; broadcast and
    /// reduce as a pipelined chain).
    Ring = 1,
    /// Recursive doubling (allreduce; allgather, where non-powers of two use Bruck's
    /// variant); non-powers of two fold the extra ranks in first.
    RecursiveDoubling = 2,
    /// Rabenseifner: reduce-scatter by recursive halving, allgather by recursive doubling.
    HalvingDoubling = 3,
    /// Binomial tree (broadcast, reduce), pipelined by segment.
    Tree = 4,
    /// Every block posted at once (small alltoall).
    Direct = 5,
    /// One peer per step (large alltoall; bounded memory).
    Pairwise = 6,
    /// Dissemination barrier.
    Dissemination = 7,
    /// Hierarchical: allreduce reduces inside each host to its leader (binomial tree over the
    /// same-host links), allreduces among the host leaders (ring, recursive doubling or
    /// Rabenseifner, as the model chooses for that many hosts over the network links), then
    /// broadcasts inside each host; allgather and reduce-scatter gather or reduce to the
    /// leader, run the leaders' ring over whole hosts' blocks, then broadcast or scatter.
    Hierarchical = 8,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 8] = [
        Algo::Ring,
        Algo::RecursiveDoubling,
        Algo::HalvingDoubling,
        Algo::Tree,
        Algo::Direct,
        Algo::Pairwise,
        Algo::Dissemination,
        Algo::Hierarchical,
    ];

    /// Name as in `MOBIUS_ALGO`.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::HalvingDoubling => "rhd",
            Algo::Tree => "tree",
            Algo::Direct => "direct",
            Algo::Pairwise => "pairwise",
            Algo::Dissemination => "dissemination",
            Algo::Hierarchical => "hier",
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Algo> {
        Algo::ALL.into_iter().find(|a| *a as u8 == c)
    }

    fn parse(s: &str) -> Option<Algo> {
        let s = s.trim().to_ascii_lowercase();
        Algo::ALL.into_iter().find(|a| a.name() == s).or(match s.as_str() {
            "recursive_doubling" | "bruck" => Some(Algo::RecursiveDoubling),
            "rabenseifner" | "halving_doubling" => Some(Algo::HalvingDoubling),
            "binomial" => Some(Algo::Tree),
            "chain" => Some(Algo::Ring),
            "hierarchical" => Some(Algo::Hierarchical),
            _ => None,
        })
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parameters of the cost model, in seconds and seconds per byte.
///
/// `alpha`, `beta` and `alpha_rndv` are the network's: the worst link between ranks on
/// different hosts (all links when every rank is on one host, or when there is no rank to
/// share a host with). `local_alpha` and `local_beta` are those of links between ranks on the
/// same host, which the hierarchical algorithms use inside a host; on tcp both kinds are
/// sockets, and a same-host provider (shared memory) changes only the local pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Latency of one eager message (network links).
    pub alpha: f64,
    /// Wire time per byte (network links).
    pub beta: f64,
    /// Reduction time per byte (`f32` sum).
    pub gamma: f64,
    /// `memcpy` time per byte.
    pub copy: f64,
    /// Latency of one rendezvous message.
    pub alpha_rndv: f64,
    /// Latency of one eager message between ranks on the same host.
    pub local_alpha: f64,
    /// Time per byte between ranks on the same host.
    pub local_beta: f64,
}

impl CostModel {
    /// Values used when nothing was measured (world of 1, or `MOBIUS_TUNE=off`): typical of
    /// TCP on one host.
    pub fn assumed() -> Self {
        // A rendezvous costs a request, the READ and a completion: about three latencies.
        // Same-host links are assumed no faster than the network: on tcp both are sockets.
        CostModel {
            alpha: 30e-6,
            beta: 1.0 / 2.0e9,
            gamma: 1.0 / 4.0e9,
            copy: 1.0 / 8.0e9,
            alpha_rndv: 90e-6,
            local_alpha: 30e-6,
            local_beta: 1.0 / 2.0e9,
        }
    }

    /// The same model with the same-host links' α and β in place of the network's: what an
    /// algorithm running only inside a host pays.
    pub fn local(self) -> Self {
        CostModel { alpha: self.local_alpha, beta: self.local_beta, ..self }
    }

    fn fields(&self) -> [f64; 7] {
        [self.alpha, self.beta, self.gamma, self.copy, self.alpha_rndv, self.local_alpha, self.local_beta]
    }

    pub(crate) fn to_bytes(self) -> [u8; 56] {
        let mut b = [0u8; 56];
        for (i, v) in self.fields().iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_be_bytes());
        }
        b
    }

    pub(crate) fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != 56 {
            return None;
        }
        let v = |i: usize| f64::from_be_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        let m =
            CostModel { alpha: v(0), beta: v(1), gamma: v(2), copy: v(3), alpha_rndv: v(4), local_alpha: v(5), local_beta: v(6) };
        m.fields().iter().all(|x| x.is_finite() && *x >= 0.0).then_some(m)
    }
}

/// Which host each rank is on, as found when the communicator starts (every rank publishes
/// its host identity; see `CommConfig::host_id`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Topology {
    /// Host index of each rank (hosts numbered in the order of their lowest rank).
    pub host_of: Vec<usize>,
}

impl Topology {
    /// Every rank on one host.
    pub fn single(world: usize) -> Self {
        Topology { host_of: vec![0; world] }
    }

    /// From each rank's host identity.
    pub fn from_ids<S: AsRef<str>>(ids: &[S]) -> Self {
        let mut seen: Vec<&str> = Vec::new();
        let host_of = ids
            .iter()
            .map(|id| {
                let id = id.as_ref();
                match seen.iter().position(|s| *s == id) {
                    Some(i) => i,
                    None => {
                        seen.push(id);
                        seen.len() - 1
                    }
                }
            })
            .collect();
        Topology { host_of }
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.host_of.iter().copied().max().map_or(0, |m| m + 1)
    }

    /// The ranks on `host`, in rank order (the first is the host's leader).
    pub fn members(&self, host: usize) -> Vec<usize> {
        (0..self.host_of.len()).filter(|&r| self.host_of[r] == host).collect()
    }

    /// Each host's leader (its lowest rank), in host order.
    pub fn leaders(&self) -> Vec<usize> {
        (0..self.hosts()).filter_map(|h| self.host_of.iter().position(|&x| x == h)).collect()
    }

    /// Ranks on each host, in host order.
    fn host_sizes(&self) -> Vec<usize> {
        let mut n = vec![0; self.hosts()];
        for &h in &self.host_of {
            n[h] += 1;
        }
        n
    }

    /// The most ranks any host has.
    pub fn max_local(&self) -> usize {
        self.host_sizes().into_iter().max().unwrap_or(0)
    }

    /// The ranks per host when every host has the same number (`None` otherwise, or with no
    /// rank at all).
    pub fn uniform(&self) -> Option<usize> {
        let sizes = self.host_sizes();
        let m = *sizes.first()?;
        sizes.iter().all(|&n| n == m).then_some(m)
    }

    /// The rank at position `i` of each host (in host order): the ranks that hold the same
    /// share of the buffer in the split hierarchical allreduce.
    pub fn column(&self, i: usize) -> Vec<usize> {
        (0..self.hosts()).filter_map(|h| self.members(h).get(i).copied()).collect()
    }

    /// Whether ranks `a` and `b` share a host.
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        self.host_of.get(a).is_some() && self.host_of.get(a) == self.host_of.get(b)
    }
}

/// User overrides (`MOBIUS_ALGO`, `MOBIUS_PROTO`, `MOBIUS_SEGMENT`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Forced algorithm per op.
    pub algo: HashMap<Op, Algo>,
    /// Forced protocol for every message.
    pub proto: Option<Proto>,
    /// Forced segment size in bytes.
    pub segment: Option<usize>,
}

impl Overrides {
    /// Parses the three settings (`None` = unset). `algo` is a comma-separated list of
    /// `name` (every op that has it) or `op=name`.
    pub fn parse(algo: Option<&str>, proto: Option<&str>, segment: Option<&str>) -> Result<Self, CollectiveError> {
        let mut o = Overrides::default();
        if let Some(spec) = algo.map(str::trim).filter(|s| !s.is_empty() && *s != "auto") {
            for part in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let bad = || {
                    CollectiveError::Config(format!(
                        "MOBIUS_ALGO={spec:?}: {part:?} is not an algorithm; use one of {} or op=algorithm with ops {}",
                        Algo::ALL.map(|a| a.name()).join(" "),
                        Op::ALL.map(|o| o.name()).join(" ")
                    ))
                };
                match part.split_once('=') {
                    Some((op, name)) => {
                        let op = Op::ALL.into_iter().find(|o| o.name() == op.trim().to_ascii_lowercase()).ok_or_else(bad)?;
                        let a = Algo::parse(name).ok_or_else(bad)?;
                        if !op.algorithms().contains(&a) {
                            return Err(CollectiveError::Config(format!(
                                "MOBIUS_ALGO: {op} has no algorithm {a}; it has {}",
                                op.algorithms().iter().map(|a| a.name()).collect::<Vec<_>>().join(" ")
                            )));
                        }
                        o.algo.insert(op, a);
                    }
                    None => {
                        let a = Algo::parse(part).ok_or_else(bad)?;
                        let mut any = false;
                        for op in Op::ALL {
                            if op.algorithms().contains(&a) {
                                o.algo.entry(op).or_insert(a);
                                any = true;
                            }
                        }
                        if !any {
                            return Err(bad());
                        }
                    }
                }
            }
        }
        if let Some(p) = proto.map(str::trim).filter(|s| !s.is_empty() && *s != "auto") {
            o.proto = Some(match p.to_ascii_lowercase().as_str() {
                "eager" => Proto::Eager,
                "rendezvous" | "rndv" => Proto::Rendezvous,
                _ => return Err(CollectiveError::Config(format!("MOBIUS_PROTO={p:?}: use eager, rendezvous or auto"))),
            });
        }
        if let Some(s) = segment.map(str::trim).filter(|s| !s.is_empty()) {
            let n = parse_bytes(s)
                .ok_or_else(|| CollectiveError::Config(format!("MOBIUS_SEGMENT={s:?}: not a byte size (e.g. 262144 or 256k)")))?;
            if n < 64 {
                return Err(CollectiveError::Config(format!("MOBIUS_SEGMENT={s:?}: at least 64 bytes")));
            }
            o.segment = Some(n);
        }
        Ok(o)
    }
}

/// Parses `123`, `64k`, `4m`, `1g` (binary multiples).
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim().to_ascii_lowercase();
    let s = s.strip_suffix("ib").or_else(|| s.strip_suffix('b')).unwrap_or(&s);
    let (num, mult) = match s.chars().last()? {
        'k' => (&s[..s.len() - 1], 1usize << 10),
        'm' => (&s[..s.len() - 1], 1 << 20),
        'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

/// One decision of the policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// The algorithm.
    pub algo: Algo,
    /// Segment size in bytes (a multiple of the element size).
    pub segment: usize,
    /// Estimated time in seconds of the chosen algorithm.
    pub estimate: f64,
    /// Whether the algorithm was forced.
    pub forced: bool,
    /// For [`Algo::Hierarchical`]: the algorithm the host leaders run among themselves.
    pub inner: Option<Algo>,
}

/// The policy of one communicator.
#[derive(Clone, Debug)]
pub struct Policy {
    /// The model (identical on every rank).
    pub model: CostModel,
    /// Overrides.
    pub overrides: Overrides,
    /// Log every decision.
    pub debug: bool,
    /// Which host each rank is on.
    pub topology: Topology,
    pub(crate) eager_limit: usize,
    pub(crate) max_message: usize,
    pub(crate) one_sided: bool,
    /// Every link moves bytes with the ranks' own CPUs (the provider's
    /// [`cpu_copies`](rdma_shuffle_fabric::ProviderCapabilities::cpu_copies): through a ring,
    /// or the receiver copying a segment out of the sender's memory), so a segment's transfer
    /// cannot overlap the receiver's reduction of the one before, and smaller segments only
    /// add messages.
    pub(crate) cpu_copies: bool,
    /// The segment that goes through the provider's in-memory records in place
    /// ([`record_segment`] of its
    /// [`record_body`](rdma_shuffle_fabric::ProviderCapabilities::record_body)); 0: none.
    pub(crate) record_segment: usize,
}

/// The segment of a balanced op over a provider whose in-memory records carry bodies of up
/// to `record_body` bytes in place (shm's ring): the largest that fits, in whole 4 KiB
/// pages (1 MiB − 4 KiB with the 2 MiB rings Mobius uses). Larger segments go by single
/// copy, `process_vm_readv`, which costs 3.6 memcpys a byte on this project's machines
/// against the ring's two copies: 2-rank allreduce of 1 MiB 62–65 µs through the ring
/// against 124–126 by single copy, 4 MiB 279–467 against 540–614 (2 MiB segments by single
/// copy; back-to-back loops, docs/mobius.md Run 12).
pub fn record_segment(record_body: Option<usize>) -> usize {
    record_body.map_or(0, |b| b / 4096 * 4096)
}

/// The largest buffer whose balanced op goes in [`record_segment`]s through the provider's
/// records. Above it the working set leaves the cache, and the ring's two copies (the
/// sender's into the ring, then the receiver's out of it, both from and to memory) cost more
/// than one single copy straight between the ranks' buffers: 4 ranks, 16 MiB, 12.8–18.5 ms
/// through the ring against 9.9–12.4 by single copy (`perf`: `memmove` 40 % of samples
/// against the single copy's 26 %); 2 ranks, 16 MiB, level (docs/mobius.md Run 12).
pub const RECORD_PATH_MAX: usize = 4 << 20;

fn log2_floor(p: usize) -> usize {
    (usize::BITS - 1 - p.leading_zeros()) as usize
}

fn log2_ceil(p: usize) -> usize {
    if p <= 1 {
        0
    } else {
        log2_floor(p - 1) + 1
    }
}

impl Policy {
    /// Estimated seconds of `algo` for `op` over `bytes` on `p` ranks with segments of
    /// `seg` bytes (`bytes` is the buffer for allreduce/broadcast/reduce, the whole output for
    /// allgather, the whole input for reduce-scatter and alltoall). `None` where the
    /// algorithm does not apply.
    ///
    /// The flat algorithms pay the network's α and β (the worst link sets a ring's pace).
    /// [`Algo::Hierarchical`] pays the same-host α and β for its reduce and broadcast inside
    /// the largest host, and the network's for the leaders' allreduce among the hosts; the
    /// policy considers it only with at least two hosts and at least one host of two ranks.
    pub fn cost(&self, op: Op, algo: Algo, bytes: usize, p: usize, seg: usize) -> Option<f64> {
        if algo == Algo::Hierarchical {
            if self.topology.hosts() < 2 || self.topology.max_local() < 2 {
                return None;
            }
            return self.hier_cost(op, bytes, p, seg).map(|c| c.0);
        }
        self.cost_in(&self.model, op, algo, bytes, p, seg)
    }

    /// Estimated seconds of a hierarchical `op`, and the leaders' algorithm; `None` for ops
    /// without one.
    fn hier_cost(&self, op: Op, bytes: usize, p: usize, seg: usize) -> Option<(f64, Algo)> {
        let (h, m) = (self.topology.hosts().max(1), self.topology.max_local().max(1));
        let local = self.model.local();
        let CostModel { alpha: a, beta: b, gamma: g, copy: c, local_alpha: la, local_beta: lb, .. } = self.model;
        let n = bytes as f64;
        let (hf, mf, pf) = (h as f64, m as f64, p.max(1) as f64);
        // The leader takes (or hands out) m − 1 blocks of n/p bytes, one at a time.
        let gather = (mf - 1.0) * (la + n / pf * lb);
        let leaders_ring = |reduce: bool| (hf - 1.0) * a + (hf - 1.0) / hf * n * (b + if reduce { g } else { 0.0 });
        let bcast = if m > 1 { self.cost_in(&local, Op::Broadcast, Algo::Tree, bytes, m, seg).unwrap_or(0.0) } else { 0.0 };
        let reduce = if m > 1 { self.cost_in(&local, Op::Reduce, Algo::Tree, bytes, m, seg).unwrap_or(0.0) } else { 0.0 };
        match op {
            Op::AllReduce => {}
            Op::AllGather => return Some((gather + leaders_ring(false) + bcast + n * c, Algo::Ring)),
            Op::ReduceScatter => return Some((n * c + reduce + leaders_ring(true) + gather, Algo::Ring)),
            _ => return None,
        }
        // Every host with m ranks (m > 1), and at least m elements: the split form (see
        // `algo::hier`), a ring reduce-scatter and allgather inside each host around m
        // allreduces of n/m bytes among the hosts at once. Else the leader's tree form.
        let split = self.topology.uniform().is_some_and(|u| u > 1 && bytes >= u * 8);
        let (inside, across) = if split {
            (self.cost_in(&local, Op::AllReduce, Algo::Ring, bytes, m, seg).unwrap_or(0.0), bytes.div_ceil(m))
        } else if m > 1 {
            (
                self.cost_in(&local, Op::Reduce, Algo::Tree, bytes, m, seg).unwrap_or(0.0)
                    + self.cost_in(&local, Op::Broadcast, Algo::Tree, bytes, m, seg).unwrap_or(0.0),
                bytes,
            )
        } else {
            (0.0, bytes)
        };
        let mut best = (0.0, Algo::Ring);
        if h > 1 {
            best = (f64::INFINITY, Algo::Ring);
            for a in [Algo::Ring, Algo::RecursiveDoubling, Algo::HalvingDoubling] {
                if let Some(t) = self.cost_in(&self.model, Op::AllReduce, a, across, h, seg) {
                    if t < best.0 {
                        best = (t, a);
                    }
                }
            }
        }
        Some((inside + best.0, best.1))
    }

    fn cost_in(&self, model: &CostModel, op: Op, algo: Algo, bytes: usize, p: usize, seg: usize) -> Option<f64> {
        let CostModel { alpha: a, beta: b, gamma: g, copy: c, .. } = *model;
        let n = bytes as f64;
        let pf = p as f64;
        let lg = log2_ceil(p) as f64;
        let p2 = 1usize << log2_floor(p);
        let lg2 = log2_floor(p) as f64;
        let p2f = p2 as f64;
        let np2 = if p2 != p { 1.0 } else { 0.0 };
        let k = bytes.div_ceil(seg.max(1)).max(1) as f64;
        let s = (seg.min(bytes.max(1))) as f64;
        let frac = (pf - 1.0) / pf;
        // Recursive doubling sends and reduces the same buffer, so a segment's reducing
        // receive can be posted only once its own send completed. Over a stream link (tcp)
        // the peer's segment has mostly arrived by then and is staged in a pool buffer: one
        // more pass through memory per byte (2 ranks, 1 MiB over tcp, a barrier before each
        // call as the benchmark does: 196 of 210 MB staged in 200 calls; the ring, whose
        // receives are posted before its sends, 58). The ring also reduces half as much.
        let staged = if self.one_sided || self.cpu_copies { 0.0 } else { n * c };
        Some(match (op, algo) {
            (Op::AllReduce, Algo::Ring) => 2.0 * (pf - 1.0) * a + 2.0 * frac * n * b + frac * n * g,
            (Op::AllReduce, Algo::RecursiveDoubling) => lg2 * (a + n * b + n * g + staged) + np2 * (2.0 * (a + n * b) + n * g),
            (Op::AllReduce, Algo::HalvingDoubling) => {
                let f2 = (p2f - 1.0) / p2f;
                2.0 * lg2 * a + 2.0 * f2 * n * b + f2 * n * g + np2 * (2.0 * (a + n * b) + n * g)
            }
            (Op::Broadcast, Algo::Tree) => lg * (k * a + n * b),
            (Op::Broadcast, Algo::Ring) => (pf - 2.0 + k) * (a + s * b),
            (Op::Reduce, Algo::Tree) => lg * (k * a + n * (b + g)),
            (Op::Reduce, Algo::Ring) => (pf - 2.0 + k) * (a + s * (b + g)),
            (Op::AllGather, Algo::Ring) => (pf - 1.0) * a + frac * n * b,
            (Op::AllGather, Algo::RecursiveDoubling) => lg * a + frac * n * b + np2 * n * c,
            (Op::ReduceScatter, Algo::Ring) => (pf - 1.0) * a + frac * n * (b + g) + n * c,
            (Op::ReduceScatter, Algo::HalvingDoubling) => {
                let f2 = (p2f - 1.0) / p2f;
                lg2 * a + f2 * n * (b + g) + n * c + np2 * (2.0 * a + n * (b + g) + n / pf * b)
            }
            (Op::AllToAll, Algo::Direct) => {
                // Every block is in flight at once and lands in unexpected buffers: only for
                // blocks that go eager.
                if bytes / p.max(1) > self.eager_limit {
                    return None;
                }
                a + frac * n * b
            }
            (Op::AllToAll, Algo::Pairwise) => (pf - 1.0) * a + frac * n * b,
            (Op::Barrier, Algo::Dissemination) => lg * a,
            _ => return None,
        })
    }

    /// The segment size for `bytes` moved over `steps` pipelined steps: the optimum of
    /// `(steps + k - 1)(α + sβ)`, `s* = sqrt(bytes·α / (β·(steps - 1)))`, kept between
    /// 16 KiB and the message limit (the eager limit when eager is forced) and rounded to
    /// whole elements. α is the rendezvous message's fixed cost where the segment goes by
    /// rendezvous (above the eager limit), the eager latency where it fits an eager message.
    pub fn segment(&self, bytes: usize, steps: usize, elem: usize) -> usize {
        let mut s = match self.overrides.segment {
            Some(s) => s,
            None => {
                let m = &self.model;
                let ideal = |alpha: f64| {
                    let s = ((bytes as f64) * alpha / (m.beta.max(1e-15) * (steps.max(2) - 1) as f64)).sqrt();
                    if s.is_finite() {
                        s as usize
                    } else {
                        usize::MAX
                    }
                };
                let rndv = ideal(m.alpha_rndv.max(m.alpha));
                let ideal =
                    if rndv > self.eager_limit && self.overrides.proto != Some(Proto::Eager) { rndv } else { ideal(m.alpha) };
                ideal.clamp(16 << 10, 4 << 20)
            }
        };
        s = s.min(self.max_message);
        if self.overrides.proto == Some(Proto::Eager) {
            s = s.min(self.eager_limit);
        }
        (s / elem).max(1) * elem
    }

    /// [`segment`](Self::segment) for the ops whose every step keeps every rank busy (ring
    /// and halving/doubling allreduce, allgather, reduce-scatter). Over shared memory
    /// ([`cpu_copies`](Policy::cpu_copies)) no segment overlaps another on the same rank,
    /// and with every rank busy in every step there is no pipeline to fill: the largest
    /// segment is best (measured on shm, 2 and 4 ranks, 1–64 MiB allreduce: 1–4 MiB segments
    /// beat the formula's 64–512 KiB by 1.1–1.5x). Up to [`RECORD_PATH_MAX`] bytes that is
    /// the largest body the provider carries through its ring
    /// ([`record_segment`](Policy::record_segment)), which the receiver reduces straight out
    /// of the ring; above, 4 MiB, sent by reference and reduced a piece at a time as it is
    /// copied. (Chains and trees, where a rank forwards
    /// what it received, still pipeline across ranks.)
    pub fn balanced_segment(&self, bytes: usize, steps: usize, elem: usize) -> usize {
        if self.cpu_copies && self.overrides.segment.is_none() && self.overrides.proto != Some(Proto::Eager) {
            let seg = if bytes <= RECORD_PATH_MAX && self.record_segment > 0 { self.record_segment } else { 4 << 20 };
            return (self.max_message.min(seg) / elem).max(1) * elem;
        }
        self.segment(bytes, steps, elem)
    }

    /// Chooses the algorithm and segment size for one call.
    pub fn choose(&self, op: Op, bytes: usize, dtype: DType, p: usize) -> Decision {
        let elem = dtype.size();
        let steps = match op {
            Op::Broadcast | Op::Reduce => p,
            _ => 2 * p,
        };
        let seg = match op {
            Op::AllReduce | Op::AllGather | Op::ReduceScatter => self.balanced_segment(bytes, steps, elem),
            _ => self.segment(bytes, steps, elem),
        };
        let inner =
            |algo: Algo| (algo == Algo::Hierarchical).then(|| self.hier_cost(op, bytes, p, seg).map_or(Algo::Ring, |c| c.1));
        if let Some(&algo) = self.overrides.algo.get(&op) {
            let estimate = match self.cost(op, algo, bytes, p, seg) {
                Some(t) => t,
                None if algo == Algo::Hierarchical => self.hier_cost(op, bytes, p, seg).map_or(f64::NAN, |c| c.0),
                None => f64::NAN,
            };
            let segment = if self.overrides.segment.is_some() { seg } else { self.whole_if_unpipelined(algo, seg, bytes, elem) };
            return Decision { algo, segment, estimate, forced: true, inner: inner(algo) };
        }
        let mut best: Option<(Algo, f64)> = None;
        for &algo in op.algorithms() {
            if let Some(t) = self.cost(op, algo, bytes, p, seg) {
                // The hierarchy must win clearly: where same-host links are no faster than the
                // network, its split form moves exactly what a flat halving-doubling does
                // (2 × 2 ranks), and its phases run one after another.
                let margin = if algo == Algo::Hierarchical { 1.02 } else { 1.0 };
                if best.is_none_or(|(_, bt)| t * margin < bt) {
                    best = Some((algo, t));
                }
            }
        }
        let (algo, estimate) = best.unwrap_or((op.algorithms()[0], f64::NAN));
        let segment = if self.overrides.segment.is_some() { seg } else { self.whole_if_unpipelined(algo, seg, bytes, elem) };
        Decision { algo, segment, estimate, forced: false, inner: inner(algo) }
    }

    /// Algorithms that send a whole buffer per step gain nothing from segments below the
    /// eager limit: such a buffer goes as one message.
    fn whole_if_unpipelined(&self, algo: Algo, seg: usize, bytes: usize, elem: usize) -> usize {
        match algo {
            Algo::Ring | Algo::Tree | Algo::Hierarchical => seg,
            _ => {
                let whole = bytes.min(self.eager_limit).min(self.max_message);
                seg.max((whole / elem).max(1) * elem)
            }
        }
    }

    /// The protocol of one message of `bytes`: eager when it fits the eager limit and costs
    /// no more than rendezvous (`α + n(β + 2c)` for eager on one-sided providers, which copy
    /// into and out of bounce buffers, against `α_rndv + nβ`; on stream providers both are
    /// one write and one read, so eager wins every tie).
    pub fn proto(&self, bytes: usize) -> Proto {
        if let Some(p) = self.overrides.proto {
            return if p == Proto::Eager && bytes > self.eager_limit { Proto::Rendezvous } else { p };
        }
        if bytes > self.eager_limit {
            return Proto::Rendezvous;
        }
        if !self.one_sided {
            return Proto::Eager;
        }
        let m = &self.model;
        let n = bytes as f64;
        if m.alpha + n * (m.beta + 2.0 * m.copy) <= m.alpha_rndv + n * m.beta {
            Proto::Eager
        } else {
            Proto::Rendezvous
        }
    }

    /// The decision table for `p` ranks: for each op, the algorithm and protocol chosen at
    /// sizes 1 KiB … 256 MiB (`f32`). Printed by the README generator and `MOBIUS_DEBUG`.
    pub fn table(&self, p: usize) -> Vec<(Op, usize, Decision, Proto)> {
        let mut out = Vec::new();
        for op in [Op::AllReduce, Op::Broadcast, Op::Reduce, Op::AllGather, Op::ReduceScatter, Op::AllToAll] {
            let mut bytes = 1usize << 10;
            while bytes <= 256 << 20 {
                let d = self.choose(op, bytes, DType::F32, p);
                out.push((op, bytes, d, self.proto(d.segment.min(bytes))));
                bytes <<= 2;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(one_sided: bool) -> Policy {
        Policy {
            model: CostModel::assumed(),
            overrides: Overrides::default(),
            debug: false,
            topology: Topology::default(),
            eager_limit: 64 << 10,
            max_message: 16 << 20,
            one_sided,
            cpu_copies: false,
            record_segment: 0,
        }
    }

    #[test]
    fn shared_memory_links_take_the_largest_segments() {
        let mut p = policy(false);
        let pipelined = p.choose(Op::AllReduce, 16 << 20, DType::F32, 2).segment;
        assert!(pipelined < 4 << 20, "the formula pipelines a 16 MiB ring: {pipelined}");
        // As over shm, with the rings Mobius sets up.
        let shm = rdma_shuffle_providers::shm::ShmConfig::default();
        let shm_segment = record_segment(Some(shm.largest_ring_body()));
        assert_eq!(shm_segment, (1 << 20) - 4096, "the 2 MiB ring's largest body, in whole pages");
        p.cpu_copies = true;
        p.record_segment = shm_segment;
        assert_eq!(p.choose(Op::AllReduce, 16 << 20, DType::F32, 2).segment, 4 << 20);
        assert_eq!(p.choose(Op::AllGather, 16 << 20, DType::F64, 4).segment, 4 << 20);
        assert_eq!(p.balanced_segment(16 << 20, 4, 12), (4 << 20) / 12 * 12, "whole elements");
        assert!(p.choose(Op::Broadcast, 16 << 20, DType::F32, 4).segment < 4 << 20, "a tree still pipelines");
        // Up to RECORD_PATH_MAX, segments that go through the ring.
        assert_eq!(p.choose(Op::AllReduce, 4 << 20, DType::F32, 2).segment, shm_segment);
        assert_eq!(p.choose(Op::AllReduce, 1 << 20, DType::F32, 4).segment, shm_segment);
        assert_eq!(p.balanced_segment(RECORD_PATH_MAX, 4, 12), shm_segment / 12 * 12, "whole elements");
        // Every such segment goes through the ring of the shm provider as Mobius sets it up.
        assert!(shm_segment <= shm.largest_ring_body() && shm_segment > shm.single_copy_min);
        p.overrides.segment = Some(128 << 10);
        assert_eq!(p.choose(Op::AllReduce, 16 << 20, DType::F32, 2).segment, 128 << 10, "a forced segment still wins");
    }

    #[test]
    fn over_tcp_two_ranks_leave_recursive_doubling_where_its_staging_costs_more_than_a_step() {
        // The model the benchmark measured over tcp loopback (2 ranks, 7 December).
        let model = CostModel {
            alpha: 2.3715e-5,
            beta: 3.674e-10,
            gamma: 2.5616e-11,
            copy: 2.8068e-11,
            alpha_rndv: 2.3715e-5,
            local_alpha: 2.3715e-5,
            local_beta: 3.674e-10,
        };
        let mut p = policy(false);
        p.model = model;
        let at = |p: &Policy, bytes: usize| p.choose(Op::AllReduce, bytes, DType::F32, 2).algo;
        assert_eq!(at(&p, 64 << 10), Algo::RecursiveDoubling, "64 KiB: one step is worth its staging");
        assert_ne!(at(&p, 1 << 20), Algo::RecursiveDoubling, "1 MiB: staging 1 MiB costs more than a second step");
        // Where receives do not stage (one-sided reads, shm's copies), the choice is as before.
        for (one_sided, cpu_copies) in [(true, false), (false, true)] {
            let mut q = policy(one_sided);
            q.cpu_copies = cpu_copies;
            q.model = model;
            assert_eq!(at(&q, 1 << 20), Algo::RecursiveDoubling, "one_sided {one_sided}, cpu_copies {cpu_copies}");
        }
    }

    #[test]
    fn small_allreduce_goes_recursive_doubling_and_large_goes_bandwidth_optimal() {
        let p = policy(false);
        for world in [2, 3, 4, 8] {
            assert_eq!(p.choose(Op::AllReduce, 4 << 10, DType::F32, world).algo, Algo::RecursiveDoubling, "world {world}");
            let big = p.choose(Op::AllReduce, 64 << 20, DType::F32, world).algo;
            assert!(matches!(big, Algo::Ring | Algo::HalvingDoubling), "world {world}: {big}");
        }
        assert_eq!(p.choose(Op::Broadcast, 1 << 10, DType::F32, 8).algo, Algo::Tree);
        assert_eq!(p.choose(Op::Broadcast, 256 << 20, DType::F32, 8).algo, Algo::Ring);
        assert_eq!(p.choose(Op::AllToAll, 4 << 10, DType::F32, 4).algo, Algo::Direct);
        assert_eq!(p.choose(Op::AllToAll, 64 << 20, DType::F32, 4).algo, Algo::Pairwise);
    }

    #[test]
    fn hierarchy_is_chosen_for_large_buffers_only_when_same_host_links_are_faster() {
        let mut p = policy(false);
        p.topology = Topology::from_ids(&["a", "a", "b", "b"]);
        // Same-host links as fast as the network (tcp everywhere): the flat algorithms win.
        for bytes in [4 << 10, 1 << 20, 64 << 20] {
            assert_ne!(p.choose(Op::AllReduce, bytes, DType::F32, 4).algo, Algo::Hierarchical, "{bytes}");
        }
        // A 10 Gb/s network, shared memory inside the hosts (Open MPI sm's 7.6 GB/s and 2 µs
        // here), and the f32 sum at 10 GB/s: the leader reduces n more bytes than a flat
        // Rabenseifner rank, but sends 1.0·n instead of 1.5·n over the network.
        p.model.beta = 1.0 / 1.25e9;
        p.model.gamma = 1.0 / 10e9;
        p.model.local_beta = 1.0 / 7.6e9;
        p.model.local_alpha = 2e-6;
        for bytes in [1 << 20, 16 << 20, 256 << 20] {
            let d = p.choose(Op::AllReduce, bytes, DType::F32, 4);
            assert_eq!(d.algo, Algo::Hierarchical, "{bytes}");
            assert!(d.inner.is_some() && !d.forced);
        }
        // One rank per host, or one host: nothing to gain, never chosen.
        for ids in [&["a", "b", "c", "d"][..], &["a", "a", "a", "a"][..]] {
            p.topology = Topology::from_ids(ids);
            assert_ne!(p.choose(Op::AllReduce, 64 << 20, DType::F32, 4).algo, Algo::Hierarchical, "{ids:?}");
        }
        // Forced, it runs whatever the hosts (and reports an estimate).
        p.overrides = Overrides::parse(Some("hier"), None, None).unwrap();
        let d = p.choose(Op::AllReduce, 4096, DType::F32, 4);
        assert!(d.forced && d.algo == Algo::Hierarchical && d.estimate.is_finite(), "{d:?}");
        assert!(!p.overrides.algo.contains_key(&Op::Broadcast), "hier is for allreduce, allgather and reduce-scatter");
        assert_eq!(p.overrides.algo[&Op::AllGather], Algo::Hierarchical);
    }

    #[test]
    fn protocol_crossover_follows_the_measured_rendezvous_latency() {
        let mut p = policy(true);
        p.model.alpha_rndv = 3.0 * p.model.alpha;
        // Crossover at (α_rndv − α) / 2c = 60 µs / (2 × 0.125 ns) = 240 KB > the eager limit.
        assert_eq!(p.proto(64 << 10), Proto::Eager);
        p.model.alpha_rndv = p.model.alpha + 2.0 * p.model.copy * 8192.0;
        assert_eq!(p.proto(4096), Proto::Eager);
        assert_eq!(p.proto(16384), Proto::Rendezvous);
        assert_eq!(policy(false).proto(64 << 10), Proto::Eager);
        assert_eq!(policy(false).proto((64 << 10) + 1), Proto::Rendezvous);
    }

    #[test]
    fn overrides_parse_force_and_explain_mistakes() {
        let o = Overrides::parse(Some("ring,broadcast=tree"), Some("eager"), Some("256k")).unwrap();
        assert_eq!(o.algo[&Op::AllReduce], Algo::Ring);
        assert_eq!(o.algo[&Op::Broadcast], Algo::Tree);
        assert_eq!(o.algo[&Op::AllGather], Algo::Ring);
        assert!(!o.algo.contains_key(&Op::AllToAll));
        assert_eq!((o.proto, o.segment), (Some(Proto::Eager), Some(256 << 10)));
        let mut p = policy(false);
        p.overrides = o;
        let d = p.choose(Op::AllReduce, 4 << 10, DType::F32, 4);
        assert!(d.forced && d.algo == Algo::Ring);
        assert_eq!(p.segment(1 << 30, 8, 4), 64 << 10, "forced eager caps segments at the eager limit");
        let e = Overrides::parse(Some("allreduce=tree"), None, None).unwrap_err().to_string();
        assert!(e.contains("allreduce has no algorithm tree") && e.contains("ring rd rhd"), "{e}");
        assert!(Overrides::parse(Some("fastest"), None, None).unwrap_err().to_string().contains("MOBIUS_ALGO"));
        assert!(Overrides::parse(None, Some("carrier-pigeon"), None).unwrap_err().to_string().contains("MOBIUS_PROTO"));
        assert_eq!(parse_bytes("4MiB"), Some(4 << 20));
    }

    #[test]
    fn segments_are_whole_elements_within_limits() {
        let p = policy(false);
        for bytes in [1usize, 1000, 1 << 20, 1 << 30] {
            let s = p.segment(bytes, 8, 8);
            assert!(s.is_multiple_of(8) && (16 << 10..=4 << 20).contains(&s), "{bytes}: {s}");
        }
        let m = CostModel::assumed();
        assert_eq!(CostModel::from_bytes(&m.to_bytes()), Some(m));
    }
}
