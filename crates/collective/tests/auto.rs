//! `MOBIUS_TRANSPORT=auto` (the default) through the real rendezvous: each link goes over shm
//! between ranks that share a host and over tcp otherwise (a rank that asked for tcp is reached
//! over tcp by everyone), and both ends of a link make the same choice (a disagreement would
//! leave the link unconnected and the group would not form). Each case runs a checked
//! allreduce over the links chosen.

use mobius_collective::{CommConfig, Communicator, MeshTransport, ReduceOp, StoreRendezvous, StoreServer};
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

/// The providers each rank's links use (`shm`, `tcp`, or `shm+tcp`), after checking that an
/// allreduce over them is exact.
fn providers_and_check(comms: &[Comm]) -> Vec<String> {
    let names: Vec<String> = comms.iter().map(|c| c.transport().mesh().provider_name().to_string()).collect();
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
    names
}

#[test]
fn ranks_of_one_host_use_shm() {
    let comms = join(3, |_, _| {});
    assert_eq!(providers_and_check(&comms), ["shm", "shm", "shm"]);
}

#[test]
fn a_group_across_hosts_uses_shm_inside_a_host_and_tcp_between_hosts() {
    // Two "hosts" by identity: ranks 0 and 1 share one, rank 2 is elsewhere.
    let comms = join(3, |r, c| c.host_id = Some(if r < 2 { "host-a".into() } else { "host-b".into() }));
    assert_eq!(providers_and_check(&comms), ["shm+tcp", "shm+tcp", "tcp"]);
}

#[test]
fn a_rank_forcing_tcp_is_reached_over_tcp_and_the_others_keep_shm() {
    let comms = join(3, |r, c| {
        if r == 1 {
            c.transport = "tcp".into();
        }
    });
    assert_eq!(providers_and_check(&comms), ["shm+tcp", "tcp", "shm+tcp"]);
}

#[test]
fn every_rank_forcing_tcp_uses_tcp_on_one_host() {
    let comms = join(2, |_, c| c.transport = "tcp".into());
    assert_eq!(providers_and_check(&comms), ["tcp", "tcp"]);
}
