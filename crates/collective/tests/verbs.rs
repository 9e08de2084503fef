//! Mobius on real kernel RDMA: the correctness matrix of `ops.rs` (every op × dtype × reduce
//! op, sizes 0 … 1000 elements) on two ranks over one SoftRoCE device (`rxe0`, queue-pair
//! loopback: every algorithm forced in turn and the policy's choice) and over two devices
//! whose RoCE traffic crosses a veth pair (`rxe_a`/`rxe_b`: ring and the policy), plus
//! buffers of 1 000 003 elements with ring, rd and rhd; and the counters
//! that show which protocol ran: small messages eager (RDMA SEND, no READ), large ones
//! rendezvous (the receiver READs the sender's registered buffer).
//!
//! Runs inside the VM: `scripts/verbs-test.sh` builds this binary with `--features verbs` and
//! runs it there (`scripts/softroce-test.sh --veth` sets `SOFTROCE_IBDEV`, `SOFTROCE_VETH_*`).
#![cfg(feature = "verbs")]

mod common;

use common::*;
use mobius_collective::fabric::Provider;
use mobius_collective::{DType, Overrides, ReduceOp};
use rdma_shuffle_providers::verbs::{VerbsConfig, VerbsProvider};
use std::net::IpAddr;
use std::sync::Arc;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} unset: run via scripts/verbs-test.sh (SoftRoCE VM)"))
}

fn open(device: &str) -> Arc<dyn Provider> {
    let cfg = VerbsConfig { device: Some(device.to_string()), pool_bytes: 256 << 20, ..VerbsConfig::default() };
    Arc::new(VerbsProvider::open(cfg).unwrap_or_else(|e| panic!("open {device}: {e}")))
}

/// Two ranks on one device (its queue pairs talk through rxe's loopback).
fn one_device() -> Vec<(Arc<dyn Provider>, IpAddr)> {
    let p = open(&env("SOFTROCE_IBDEV"));
    vec![(p.clone(), IpAddr::from([127, 0, 0, 1])), (p, IpAddr::from([127, 0, 0, 1]))]
}

/// Rank 0 on rxe_a, rank 1 on rxe_b, each listening on its own veth address.
fn two_devices() -> Vec<(Arc<dyn Provider>, IpAddr)> {
    let devs = env("SOFTROCE_VETH_DEVS");
    let ips = env("SOFTROCE_VETH_IPS");
    devs.split_whitespace().zip(ips.split_whitespace()).map(|(d, ip)| (open(d), ip.parse::<IpAddr>().unwrap())).collect()
}

fn counter(c: &Comm, name: &str) -> u64 {
    c.provider_counters().into_iter().find(|(k, _)| *k == name).map(|(_, v)| v).unwrap_or(0)
}

/// Element counts of the matrix on verbs: empty, one element, odd counts that do not divide
/// by the world, and one that spans several segments (the full `SIZES` of `ops.rs` take
/// minutes under the VM's emulated CPU).
const VERBS_SIZES: [usize; 4] = [0, 1, 7, 1000];

fn matrix(label: &str, algos: &[&str], ranks: impl Fn() -> Vec<(Arc<dyn Provider>, IpAddr)>) {
    let mut fails = Vec::new();
    for &algo in algos {
        // 4 KiB segments so blocks split, and an eager limit below them so segments go
        // rendezvous while headers and small buffers go eager.
        let comms = group_on(ranks(), |c, m| {
            c.overrides = Overrides::parse(Some(algo), None, Some("4k")).unwrap();
            m.eager_limit = 2048;
        });
        assert_eq!(comms[0].transport().mesh().provider_name(), "verbs");
        fails.extend(run_matrix_sizes(&comms, &format!("{label} algo {algo}"), &VERBS_SIZES));
        let stats = comms[0].stats();
        if algo != "auto" {
            let forced: u64 = stats.calls.iter().filter(|(k, _)| k.ends_with(&format!(".{algo}"))).map(|(_, v)| v).sum();
            assert!(forced > 0, "{label}: MOBIUS_ALGO={algo} never ran: {:?}", stats.calls);
        }
        // Both protocols ran, and rendezvous receives were one-sided READs on the device.
        for (r, c) in comms.iter().enumerate() {
            let t = c.stats().transport;
            assert!(t.eager_messages > 0 && t.rendezvous_messages > 0, "{label} {algo} rank {r}: {t:?}");
            assert!(t.one_sided_reads > 0 && counter(c, "rdma_reads") >= t.one_sided_reads, "{label} {algo} rank {r}: {t:?}");
        }
        eprintln!("{label} algo {algo}: matrix done, rank 0 {:?}", comms[0].stats().transport);
    }
    assert!(fails.is_empty(), "{} failures:\n{}", fails.len(), fails.iter().take(40).cloned().collect::<Vec<_>>().join("\n"));
}

/// Every algorithm under `scripts/test.sh --full` (`RDMA_TEST_FULL=1`, passed into the VM); CI
/// runs the policy's choice, the ring and recursive halving-doubling (each algorithm's own
/// correctness is the host's `ops.rs`: what verbs adds is the transport under each pattern).
#[test]
fn every_op_dtype_and_reduce_op_on_one_rxe_device() {
    let full = std::env::var("RDMA_TEST_FULL").is_ok_and(|v| v == "1");
    let algos: &[&str] =
        if full { &["auto", "ring", "rd", "rhd", "tree", "direct", "pairwise"] } else { &["auto", "ring", "rhd"] };
    matrix("rxe0", algos, one_device);
}

#[test]
fn every_op_dtype_and_reduce_op_across_two_rxe_devices() {
    matrix("rxe_a<->rxe_b", &["auto", "ring"], two_devices);
}

/// Default settings (64 KiB eager limit, the policy's choice): a 1 KiB allreduce goes eager
/// only (verbs SENDs, no READ); a 4 MiB one goes rendezvous, READ by the receiver straight
/// from the sender's registered buffer; large odd-sized buffers of every algorithm come out
/// right.
#[test]
fn small_messages_go_eager_and_large_ones_rendezvous_with_rdma_reads() {
    for (label, ranks) in [("rxe0", one_device as fn() -> _), ("rxe_a<->rxe_b", two_devices)] {
        let comms = group_on(ranks(), |_, _| {});
        let before: Vec<u64> = comms.iter().map(|c| counter(c, "rdma_reads")).collect();
        on_all(&comms, |_, c| {
            let mut small = vec![1.0f32; 256];
            c.allreduce(&mut small, ReduceOp::Sum).unwrap();
            assert!(small.iter().all(|v| *v == 2.0));
        });
        for (r, c) in comms.iter().enumerate() {
            let t = c.stats().transport;
            assert!(t.eager_messages > 0 && t.rendezvous_messages == 0 && t.one_sided_reads == 0, "{label} rank {r}: {t:?}");
            assert_eq!(counter(c, "rdma_reads"), before[r], "{label} rank {r}: a small allreduce did RDMA READs");
            assert!(counter(c, "verbs_sends") > 0, "{label} rank {r}: {:?}", c.provider_counters());
        }
        on_all(&comms, |_, c| {
            let mut big = vec![1.0f32; 1 << 20];
            c.allreduce(&mut big, ReduceOp::Sum).unwrap();
            assert!(big.iter().all(|v| *v == 2.0));
        });
        for (r, c) in comms.iter().enumerate() {
            let t = c.stats().transport;
            assert!(t.rendezvous_messages > 0 && t.rendezvous_bytes >= 2 << 20, "{label} rank {r}: {t:?}");
            assert!(t.one_sided_reads > 0 && t.rendezvous_received > 0, "{label} rank {r}: {t:?}");
            let read_bytes = counter(c, "rdma_read_bytes");
            assert!(read_bytes >= 2 << 20, "{label} rank {r}: {read_bytes} bytes READ for a 4 MiB allreduce");
        }
        eprintln!("{label}: counters rank 0 {:?} {:?}", comms[0].stats().transport, comms[0].provider_counters());
        drop(comms);
        for algo in ["ring", "rd", "rhd"] {
            let comms = group_on(ranks(), |c, _| c.overrides = Overrides::parse(Some(algo), None, None).unwrap());
            let n = 1_000_003;
            let fails: Vec<String> = on_all(&comms, |rank, c| {
                let mut fails = Vec::new();
                let mut buf = input(rank, n, ReduceOp::Sum, DType::F32);
                c.allreduce_bytes(&mut buf, DType::F32, ReduceOp::Sum).unwrap();
                check(&mut fails, format!("{label} {algo} allreduce"), &buf, &expect(2, n, ReduceOp::Sum, DType::F32, 0));
                let mine = input(rank, 333_333, ReduceOp::Sum, DType::U8);
                let mut all = vec![0u8; mine.len() * 2];
                c.allgather_bytes(&mine, &mut all, DType::U8).unwrap();
                let want: Vec<u8> = (0..2).flat_map(|r| input(r, 333_333, ReduceOp::Sum, DType::U8)).collect();
                check(&mut fails, format!("{label} {algo} allgather"), &all, &want);
                fails
            })
            .into_iter()
            .flatten()
            .collect();
            assert!(fails.is_empty(), "{fails:?}");
        }
    }
}

/// The ring posts its allgather half's receives with the registration of the caller's
/// buffer, so each rendezvous segment is READ straight into that buffer (no pool buffer,
/// no copy out of one), and the result is right.
#[test]
fn the_ring_allgather_half_is_read_straight_into_the_callers_buffer() {
    for (label, ranks) in [("rxe0", one_device as fn() -> _), ("rxe_a<->rxe_b", two_devices)] {
        let comms = group_on(ranks(), |c, _| c.overrides = Overrides::parse(Some("ring"), None, None).unwrap());
        on_all(&comms, |rank, c| {
            let mut big = vec![(rank + 1) as f32; 1 << 20];
            c.allreduce(&mut big, ReduceOp::Sum).unwrap();
            assert!(big.iter().all(|v| *v == 3.0), "{label} rank {rank}");
        });
        for (r, c) in comms.iter().enumerate() {
            let t = c.stats().transport;
            assert!(t.placed > 0 && t.placed_bytes >= 1 << 20, "{label} rank {r}: no READ landed in place: {t:?}");
            assert!(t.one_sided_reads > 0, "{label} rank {r}: {t:?}");
        }
        eprintln!("{label}: ring 4 MiB, rank 0 {:?}", comms[0].stats().transport);
    }
}
