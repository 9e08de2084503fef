//! Helpers shared by the collective test binaries: groups of communicators on threads of
//! one process, inputs whose reductions are exact in every dtype, and the op × dtype ×
//! reduce-op × size matrix.
#![allow(dead_code)]

use half::{bf16, f16};
use mobius_collective::fabric::{Mesh, MeshConfig, MeshListener, Provider};
use mobius_collective::{CommConfig, Communicator, DType, MeshTransport, ReduceOp};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

pub type Comm = Communicator<MeshTransport>;

/// Builds a group of `world` communicators over `provider`, one per thread, on 127.0.0.1.
pub fn group(provider: Arc<dyn Provider>, world: usize, tweak: impl Fn(&mut CommConfig, &mut MeshConfig) + Sync) -> Vec<Comm> {
    let ranks = (0..world).map(|_| (provider.clone(), IpAddr::from([127, 0, 0, 1]))).collect();
    group_on(ranks, tweak)
}

/// Builds a group with rank `r` on its own provider, listening on its own address.
pub fn group_on(ranks: Vec<(Arc<dyn Provider>, IpAddr)>, tweak: impl Fn(&mut CommConfig, &mut MeshConfig) + Sync) -> Vec<Comm> {
    let world = ranks.len();
    let listeners: Vec<MeshListener> =
        ranks.into_iter().enumerate().map(|(r, (p, ip))| MeshListener::bind(p, SocketAddr::new(ip, 0), r).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let (addrs, tweak) = (addrs.clone(), &tweak);
                s.spawn(move || {
                    let mut c = CommConfig::new(r, world);
                    c.tune = false;
                    c.timeout = Duration::from_secs(60);
                    let mut m = MeshConfig::new(r, world);
                    m.pool.cap_bytes = 256 << 20;
                    tweak(&mut c, &mut m);
                    let mesh = Mesh::connect(l, &addrs, m).unwrap();
                    Communicator::with_transport(MeshTransport::new(mesh), &c).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f(rank, comm)` on every rank at once; returns the results in rank order.
pub fn on_all<R: Send>(comms: &[Comm], f: impl Fn(usize, &Comm) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn({
                    let f = &f;
                    move || f(r, c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Input element `i` of `rank` for `op` (small values keep every reduction exact).
pub fn value(rank: usize, i: usize, op: ReduceOp, dtype: DType) -> f64 {
    let h = (rank * 7 + i * 3 + 1) % 11;
    match (op, dtype) {
        (_, DType::Bool) => (h % 2) as f64,
        (ReduceOp::Prod, DType::U8) => [1.0, 2.0, 1.0, 3.0][h % 4],
        (ReduceOp::Prod, DType::I32 | DType::I64 | DType::I8 | DType::I16) => [1.0, 2.0, -1.0, 3.0][h % 4],
        (ReduceOp::Prod, _) => [1.0, 2.0, -1.0, 0.5][h % 4],
        (_, DType::U8) => h as f64,
        _ => h as f64 - 5.0,
    }
}

pub fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&(x as f32).to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&x.to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_ne_bytes()),
            DType::I32 => out.extend_from_slice(&(x as i32).to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&(x as i64).to_ne_bytes()),
            DType::U8 | DType::Bool => out.push(x as u8),
            DType::I8 => out.push(x as i8 as u8),
            DType::I16 => out.extend_from_slice(&(x as i16).to_ne_bytes()),
        }
    }
    out
}

pub fn input(rank: usize, n: usize, op: ReduceOp, dtype: DType) -> Vec<u8> {
    encode(dtype, &(0..n).map(|i| value(rank, i, op, dtype)).collect::<Vec<_>>())
}

/// The reduction of element `i` over ranks, as the dtype stores it.
pub fn reduced(world: usize, i: usize, op: ReduceOp, dtype: DType) -> f64 {
    let vals: Vec<f64> = (0..world).map(|r| value(r, i, op, dtype)).collect();
    let int = !dtype.is_float();
    let bits = |f: fn(i64, i64) -> i64| vals.iter().map(|&v| v as i64).reduce(f).unwrap_or(0) as f64;
    if dtype == DType::Bool {
        // Sum and max are "any", prod and min "all"; the bitwise ops are logical.
        return match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => bits(|a, b| a | b),
            ReduceOp::BXor => bits(|a, b| a ^ b),
            _ => bits(|a, b| a & b),
        };
    }
    match op {
        ReduceOp::BAnd => bits(|a, b| a & b),
        ReduceOp::BOr => bits(|a, b| a | b),
        ReduceOp::BXor => bits(|a, b| a ^ b),
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Prod => vals.iter().product(),
        ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => {
            let s: f64 = vals.iter().sum();
            if int {
                (s / world as f64).trunc()
            } else {
                s / world as f64
            }
        }
    }
}

pub fn expect(world: usize, n: usize, op: ReduceOp, dtype: DType, offset: usize) -> Vec<u8> {
    encode(dtype, &(0..n).map(|i| reduced(world, i + offset, op, dtype)).collect::<Vec<_>>())
}

pub fn check(fails: &mut Vec<String>, what: String, got: &[u8], want: &[u8]) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        fails.push(format!("{what}: {} bytes vs {} expected, first difference at byte {first}", got.len(), want.len()));
    }
}

pub const SIZES: [usize; 5] = [0, 1, 7, 1000, 20_003];

/// Every op, dtype, reduce op and size on one group; returns the failures of every rank.
pub fn run_matrix(comms: &[Comm], label: &str) -> Vec<String> {
    run_matrix_sizes(comms, label, &SIZES)
}

/// [`run_matrix`] over the given element counts.
pub fn run_matrix_sizes(comms: &[Comm], label: &str, sizes: &[usize]) -> Vec<String> {
    let world = comms.len();
    let root = world - 1;
    on_all(comms, |rank, c| {
        let mut fails = Vec::new();
        for dtype in DType::ALL {
            for &n in sizes {
                for op in ReduceOp::ALL {
                    let tag = format!("{label} rank {rank} {dtype} {op} n={n}");
                    if dtype.check_op(op).is_err() {
                        // Refused on every rank before any byte moves, naming the pair.
                        let mut buf = input(rank, n, ReduceOp::Sum, dtype);
                        match c.allreduce_bytes(&mut buf, dtype, op) {
                            Err(e) if e.to_string().contains(&format!("{op} is not defined on {dtype}")) => {}
                            other => fails.push(format!("{tag}: expected a refusal, got {other:?}")),
                        }
                        continue;
                    }
                    let mut buf = input(rank, n, op, dtype);
                    match c.allreduce_bytes(&mut buf, dtype, op) {
                        Ok(()) => check(&mut fails, format!("{tag} allreduce"), &buf, &expect(world, n, op, dtype, 0)),
                        Err(e) => fails.push(format!("{tag} allreduce: {e}")),
                    }
                    let mut buf = input(rank, n, op, dtype);
                    match c.reduce_bytes(&mut buf, dtype, op, root) {
                        Ok(()) if rank == root => {
                            check(&mut fails, format!("{tag} reduce"), &buf, &expect(world, n, op, dtype, 0))
                        }
                        Ok(()) => {}
                        Err(e) => fails.push(format!("{tag} reduce: {e}")),
                    }
                    // reduce_scatter: `n` elements per rank, so the input has world × n.
                    let send = input(rank, n * world, op, dtype);
                    let mut recv = vec![0xAB; n * dtype.size()];
                    match c.reduce_scatter_bytes(&send, &mut recv, dtype, op) {
                        Ok(()) => {
                            check(&mut fails, format!("{tag} reduce_scatter"), &recv, &expect(world, n, op, dtype, rank * n))
                        }
                        Err(e) => fails.push(format!("{tag} reduce_scatter: {e}")),
                    }
                }
                let tag = format!("{label} rank {rank} {dtype} n={n}");
                let mine = input(rank, n, ReduceOp::Sum, dtype);
                let mut buf = if rank == root { mine.clone() } else { vec![0x5A; mine.len()] };
                match c.broadcast_bytes(&mut buf, dtype, root) {
                    Ok(()) => check(&mut fails, format!("{tag} broadcast"), &buf, &input(root, n, ReduceOp::Sum, dtype)),
                    Err(e) => fails.push(format!("{tag} broadcast: {e}")),
                }
                let mut all = vec![0u8; mine.len() * world];
                match c.allgather_bytes(&mine, &mut all, dtype) {
                    Ok(()) => {
                        let want: Vec<u8> = (0..world).flat_map(|r| input(r, n, ReduceOp::Sum, dtype)).collect();
                        check(&mut fails, format!("{tag} allgather"), &all, &want)
                    }
                    Err(e) => fails.push(format!("{tag} allgather: {e}")),
                }
                // alltoall: block j of rank r holds values of "rank" r*world+j.
                let send: Vec<u8> = (0..world).flat_map(|j| input(rank * world + j, n, ReduceOp::Sum, dtype)).collect();
                let mut recv = vec![0u8; send.len()];
                match c.alltoall_bytes(&send, &mut recv, dtype) {
                    Ok(()) => {
                        let want: Vec<u8> = (0..world).flat_map(|j| input(j * world + rank, n, ReduceOp::Sum, dtype)).collect();
                        check(&mut fails, format!("{tag} alltoall"), &recv, &want)
                    }
                    Err(e) => fails.push(format!("{tag} alltoall: {e}")),
                }
            }
        }
        if let Err(e) = c.barrier() {
            fails.push(format!("{label} rank {rank} barrier: {e}"));
        }
        fails
    })
    .into_iter()
    .flatten()
    .collect()
}
