//! The hierarchical allreduce, allgather and reduce-scatter (`MOBIUS_ALGO=hier`): ranks given host identities
//! (`CommConfig::host_id`, as `MOBIUS_HOST_ID` sets it) that make 2 or 3 "hosts" of equal and
//! unequal sizes, interleaved with rank order, on worlds of 2–6 ranks over sim and tcp. Every
//! op × dtype × reduce op of the shared matrix runs (the other ops take the policy's choice)
//! and must equal the reference bit for bit.

mod common;

use common::*;
use mobius_collective::fabric::{Provider, SimProvider, TcpProvider};
use mobius_collective::{Algo, DType, Op, Overrides, ReduceOp};
use std::sync::Arc;

/// Host of each rank: equal and unequal hosts, consecutive and interleaved ranks.
const LAYOUTS: &[&[usize]] = &[
    &[0, 1],
    &[0, 0, 1],
    &[0, 1, 0, 1],
    &[0, 0, 1, 1],
    &[0, 0, 0, 1, 1],
    &[0, 1, 2, 0, 1],
    &[0, 0, 1, 1, 2, 2],
    &[2, 0, 0, 0, 1, 0],
];

fn hier_group(provider: Arc<dyn Provider>, hosts: &'static [usize], algo: &str) -> Vec<Comm> {
    let algo = algo.to_string();
    group(provider, hosts.len(), move |c, m| {
        c.overrides = Overrides::parse(Some(&algo), None, Some("1k")).unwrap();
        c.host_id = Some(format!("host-{}", hosts[c.rank]));
        m.eager_limit = 2048;
    })
}

#[test]
fn hierarchical_collectives_equal_the_reference_on_two_and_three_hosts() {
    let providers: Vec<(&str, Arc<dyn Provider>)> =
        vec![("sim", Arc::new(SimProvider::new(true))), ("tcp", Arc::new(TcpProvider::new()))];
    let mut fails = Vec::new();
    for (pname, provider) in providers {
        for hosts in LAYOUTS {
            let comms = hier_group(provider.clone(), hosts, "hier");
            let topo = comms[0].topology().clone();
            assert_eq!(topo.hosts(), hosts.iter().max().unwrap() + 1, "{hosts:?}");
            assert!(comms.iter().all(|c| *c.topology() == topo), "every rank sees the same hosts");
            fails.extend(run_matrix(&comms, &format!("{pname} hosts {hosts:?}")));
            let calls = comms[0].stats().calls;
            for op in ["allreduce", "allgather", "reduce_scatter"] {
                assert!(calls.get(&format!("{op}.hier")).copied().unwrap_or(0) > 0, "{pname} {hosts:?}: {calls:?}");
            }
        }
    }
    assert!(fails.is_empty(), "{} failures:\n{}", fails.len(), fails.iter().take(40).cloned().collect::<Vec<_>>().join("\n"));
}

#[test]
fn hierarchical_allreduce_of_large_buffers_with_each_leader_algorithm() {
    // The leaders' algorithm is the policy's for that many hosts; a large buffer with default
    // segments exercises the pipelined tree and ring paths with short last segments.
    for hosts in [&[0usize, 0, 1, 1][..], &[0, 1, 1, 2, 2, 2][..]] {
        let comms = group(Arc::new(SimProvider::new(true)), hosts.len(), |c, _| {
            c.overrides = Overrides::parse(Some("hier"), None, None).unwrap();
            c.host_id = Some(format!("h{}", hosts[c.rank]));
        });
        let n = 1_000_003;
        let world = hosts.len();
        let fails: Vec<String> = on_all(&comms, |rank, c| {
            let mut fails = Vec::new();
            for (dtype, op) in [(DType::F32, ReduceOp::Sum), (DType::I64, ReduceOp::Max), (DType::F64, ReduceOp::Avg)] {
                let mut buf = input(rank, n, op, dtype);
                c.allreduce_bytes(&mut buf, dtype, op).unwrap();
                check(&mut fails, format!("hosts {hosts:?} rank {rank} {dtype} {op}"), &buf, &expect(world, n, op, dtype, 0));
            }
            fails
        })
        .concat();
        assert!(fails.is_empty(), "{}", fails.join("\n"));
        let d = comms[0].decide(Op::AllReduce, n * 4, DType::F32);
        assert_eq!(d.algo, Algo::Hierarchical);
        assert!(d.inner.is_some() && d.forced, "{d:?}");
    }
}

#[test]
fn without_host_ids_every_rank_is_on_this_host_and_forced_hier_still_reduces() {
    // No host id: the boot id and network namespace, the same for threads of one process.
    let comms = group(Arc::new(TcpProvider::new()), 3, |c, _| {
        c.overrides = Overrides::parse(Some("hier"), None, Some("1k")).unwrap();
    });
    assert_eq!(comms[0].topology().hosts(), 1);
    let fails = run_matrix_sizes(&comms, "one host", &[1, 1000]);
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

#[test]
fn equal_hosts_split_the_buffer_so_every_rank_moves_a_share() {
    // Two hosts of two ranks: the split form (reduce-scatter inside the host, each half
    // allreduced between the hosts, allgather inside) has every rank send 3n/2 bytes: n/2
    // inside, n/4 + n/4 to the other host, n/2 inside. The leader's form would have the
    // second rank of a host send the whole buffer once and nothing else.
    let hosts = [0usize, 0, 1, 1];
    let comms = group(Arc::new(SimProvider::new(true)), hosts.len(), |c, _| {
        c.overrides = Overrides::parse(Some("hier"), None, None).unwrap();
        c.host_id = Some(format!("h{}", hosts[c.rank]));
    });
    assert_eq!(comms[0].topology().uniform(), Some(2));
    assert_eq!(comms[0].topology().column(1), vec![1, 3]);
    let n = 1 << 20;
    let sent: Vec<u64> = on_all(&comms, |rank, c| {
        let before = c.stats().transport;
        let mut buf = input(rank, n, ReduceOp::Sum, DType::F32);
        c.allreduce_bytes(&mut buf, DType::F32, ReduceOp::Sum).unwrap();
        let mut fails = Vec::new();
        check(&mut fails, format!("rank {rank}"), &buf, &expect(4, n, ReduceOp::Sum, DType::F32, 0));
        assert!(fails.is_empty(), "{}", fails.join("\n"));
        let after = c.stats().transport;
        (after.eager_bytes + after.rendezvous_bytes) - (before.eager_bytes + before.rendezvous_bytes)
    });
    let bytes = (n * 4) as f64;
    for (rank, s) in sent.iter().enumerate() {
        let share = *s as f64 / bytes;
        assert!((1.45..1.55).contains(&share), "rank {rank} sent {s} bytes, {share:.3} of the buffer");
    }
}
