//! "Cost per executor does not grow with the cluster" (README): an engine has exactly two
//! native threads (its event loop and its delivery thread), whatever the number of peers.
//!
//! Counted from `/proc/self/task`, so this file holds a single test: the test harness runs
//! it alone in its process, and every thread that appears is one the engines started.

use rdma_shuffle_shuffle::blocks::{BlockSink, FetchedBlock};
use rdma_shuffle_shuffle::engine::{Engine, EngineConfig};
use rdma_shuffle_shuffle::testkit::write_map_output;
use rdma_shuffle_shuffle::ShuffleBlock;
use rdma_shuffle_wire::BlockFailure;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Peers of the engine under test: each fetches from it and is fetched from.
const PEERS: usize = 8;
/// Native threads per engine, as the README states.
const THREADS_PER_ENGINE: usize = 2;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("/proc/self/task").count()
}

fn engine(id: &str) -> Engine {
    Engine::open(EngineConfig {
        transport: "tcp".into(),
        bind_host: "127.0.0.1".parse().unwrap(),
        executor_id: id.into(),
        pool_cap: Some(16 << 20),
        ..EngineConfig::default()
    })
    .unwrap()
}

struct Sink(Mutex<Sender<Result<usize, BlockFailure>>>);
impl BlockSink for Sink {
    fn on_block(&self, _: usize, r: Result<FetchedBlock, BlockFailure>) {
        let _ = self.0.lock().unwrap().send(r.map(|b| b.len()));
    }
}

/// Fetches map 0's two blocks (one inline, one pulled) of `from` into `to`.
fn fetch(to: &Engine, from: &Engine, map: u64) {
    let (tx, rx) = channel();
    let blocks = [ShuffleBlock::single(0, map, 0), ShuffleBlock::single(0, map, 1)];
    to.client().fetch(from.server().local_addr(), &blocks, Arc::new(Sink(Mutex::new(tx))));
    let mut got: Vec<usize> =
        (0..2).map(|_| rx.recv_timeout(Duration::from_secs(60)).expect("block").expect("fetched")).collect();
    got.sort();
    assert_eq!(got, vec![100, 300_000]);
}

#[test]
fn an_engine_has_two_threads_whatever_the_number_of_peers() {
    let dir = tempfile::tempdir().unwrap();
    let start = threads();
    let hub = engine("hub");
    assert_eq!(threads(), start + THREADS_PER_ENGINE, "threads of one engine");
    let hub_out = write_map_output(dir.path(), 0, 0, &[100, 300_000], 1).unwrap();
    hub.server().register(hub_out.map_output_files()).unwrap();

    let peers: Vec<Engine> = (0..PEERS)
        .map(|i| {
            let p = engine(&format!("peer{i}"));
            let out = write_map_output(dir.path(), 0, 1 + i as u64, &[100, 300_000], 2 + i as u64).unwrap();
            p.server().register(out.map_output_files()).unwrap();
            p
        })
        .collect();
    let before = threads();
    assert_eq!(before, start + THREADS_PER_ENGINE * (PEERS + 1), "threads of {} engines", PEERS + 1);

    // Every peer connects to the hub's server, and the hub's client to every peer's server:
    // 2 x PEERS connections on the hub, all open at once (idle timeout far away).
    for (i, p) in peers.iter().enumerate() {
        fetch(p, &hub, 0);
        fetch(&hub, p, 1 + i as u64);
    }
    let hub_stats = hub.stats_text();
    let lines: Vec<&str> = hub_stats.lines().collect();
    assert!(lines.contains(&format!("blocks_served={}", 2 * PEERS).as_str()), "{hub_stats}");
    assert!(lines.contains(&format!("blocks_fetched={}", 2 * PEERS).as_str()), "{hub_stats}");
    assert_eq!(hub.client().connections(), PEERS, "the hub's client holds a connection per peer");
    assert_eq!(threads(), before, "threads grew with {PEERS} peers connected both ways");

    for p in &peers {
        p.shutdown();
    }
    hub.shutdown();
}
