//! `MOBIUS_TRANSPORT=auto` (the default) through the real rendezvous: ranks that all share a
//! host connect over shm, a group that spans hosts (or holds a rank that asked for tcp) stays on
//! tcp, and every rank of a group makes the same choice. Each case runs a checked allreduce
//! over the chosen provider.

use mobius_collective::{CommConfig, Communicator, MeshTransport, ReduceOp, StoreRendezvous, StoreServer, TransportKind};
use std::net::IpAddr;
use std::time::{Duration, Instant};

type Comm = Communicator<MeshTransport>;

/// Joins `world` ranks (threads) through one store; `tweak` sets up rank `r`'s config.
fn join(world: usize, tweak: impl Fn(usize, &mut CommConfig) + Sync) -> Vec<Comm> {
    let store = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let at = store.local_addr();
    let prefix = format!("auto-{}", rand_suffix());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (tweak, prefix) = (&tweak, &prefix);
                s.spawn(move || {
                    let mut c = CommConfig::new(r, world);
                    c.tune = false;
                    c.timeout = Duration::from_secs(60);
                    c.pool_bytes = 256 << 20;
                    tweak(r, &mut c);
                    let deadline = Instant::now() + c.timeout;
                    let mut rdv = StoreRendezvous::connect(at, prefix, deadline).unwrap();
                    Communicator::join(c, IpAddr::from([127, 0, 0, 1]), &mut rdv).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 ^ std::process::id() as u64
}

/// The provider every rank uses; asserts they agree and that an allreduce is exact over it.
fn provider_and_check(comms: &[Comm]) -> String {
    let names: Vec<String> = comms.iter().map(|c| c.transport().mesh().provider_name().to_string()).collect();
    assert!(names.iter().all(|n| *n == names[0]), "ranks chose different providers: {names:?}");
    let world = comms.len();
    // 1 MiB of f32: large enough to take the rendezvous (single-copy) path on shm.
    let n = 1 << 18;
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || {
                let mut buf: Vec<f32> = (0..n).map(|i| (r * 1000 + i % 997) as f32).collect();
                c.allreduce(&mut buf, ReduceOp::Sum).unwrap();
                let ranks: f32 = (0..world).map(|q| (q * 1000) as f32).sum();
                for (i, v) in buf.iter().enumerate() {
                    assert_eq!(*v, ranks + (world * (i % 997)) as f32, "rank {r} element {i}");
                }
            });
        }
    });
    names[0].clone()
}

#[test]
fn ranks_of_one_host_use_shm() {
    let comms = join(3, |_, _| {});
    assert_eq!(provider_and_check(&comms), "shm");
}

#[test]
fn a_group_across_hosts_uses_tcp() {
    // Two "hosts" by identity: ranks 0 and 1 share one, rank 2 is elsewhere.
    let comms = join(3, |r, c| c.host_id = Some(if r < 2 { "host-a".into() } else { "host-b".into() }));
    assert_eq!(provider_and_check(&comms), "tcp");
}

#[test]
fn one_rank_forcing_tcp_keeps_the_group_on_tcp() {
    let comms = join(3, |r, c| {
        if r == 1 {
            c.transport = TransportKind::Tcp;
        }
    });
    assert_eq!(provider_and_check(&comms), "tcp");
}

#[test]
fn every_rank_forcing_tcp_uses_tcp_on_one_host() {
    let comms = join(2, |_, c| c.transport = TransportKind::Tcp);
    assert_eq!(provider_and_check(&comms), "tcp");
}
