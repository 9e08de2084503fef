//! What building a group's mesh costs, per provider: `rounds` meshes of `world` ranks (one
//! thread per rank, one process), each built, used for one small message around the ring,
//! and closed. Prints the median and range of the build time. For profiling group creation
//! (`perf record`, `strace -c -f`): its cost is the links' setup, which this isolates from
//! any rendezvous.
//!
//! ```text
//! cargo run --release -p mobius-collective --example mesh_setup -- shm 4 40
//! ```

use mobius_collective::mesh::{connect_in_threads, MeshListener, Proto};
use rdma_shuffle_fabric::providers::registry::ProviderOptions;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let provider = args.get(1).map_or("shm", String::as_str);
    let world: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(4);
    let rounds: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(40);
    let opened = rdma_shuffle_providers::open(provider, &ProviderOptions::default()).expect("provider");
    let p = opened.provider;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        let listeners: Vec<MeshListener> = (0..world)
            .map(|r| MeshListener::bind(p.clone(), SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), r).expect("bind"))
            .collect();
        let meshes: Vec<_> =
            connect_in_threads(listeners, Duration::from_secs(30), |_| {}).into_iter().map(|m| m.expect("mesh")).collect();
        times.push(t0.elapsed());
        std::thread::scope(|s| {
            for m in &meshes {
                s.spawn(move || {
                    let (r, n) = (m.rank(), m.world());
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let msg = [r as u8; 16];
                    let t = m.send((r + 1) % n, 1, &msg, Proto::Eager, None).expect("send");
                    m.wait(t, deadline).expect("wait");
                    m.recv((r + n - 1) % n, 1, deadline).expect("recv");
                });
            }
        });
        drop(meshes);
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{provider}: {world} ranks, {rounds} meshes: build {:.2} ms median [{:.2}-{:.2}]",
        ms(times[times.len() / 2]),
        ms(times[0]),
        ms(times[times.len() - 1])
    );
}
