//! The verbs engine on real kernel RDMA (SoftRoCE VM, `scripts/verbs-test.sh`): many peers
//! through one shared receive queue, a receiver overrun, many READs in flight, and the
//! flush of posted READs before their buffers go back when a connection fails.
#![cfg(feature = "ibverbs")]
use rdma_shuffle_testkit::shuffle as suite;

use rdma_shuffle_fabric::pool::PoolConfig;
use rdma_shuffle_fabric::{Driver, DriverConfig, Provider, Source};
use rdma_shuffle_provider_verbs::{VerbsConfig, VerbsProvider};
use rdma_shuffle_shuffle::blocks::{BlockSink, BlockSource, ClientEndpointConfig, ServerEndpoint, ServerEndpointConfig};
use rdma_shuffle_shuffle::channel::Channel;
use rdma_shuffle_shuffle::testkit::write_map_output;
use rdma_shuffle_shuffle::{BlockClient, BlockServer, ShuffleBlock};
use rdma_shuffle_wire::{BlockFailure, BlockSpan, ClientConfig, ClientSession, FailureCode, Frame, Resolved};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use suite::{listen_addr, pool_for, Collect, Hold};

fn provider(cfg: VerbsConfig) -> Arc<dyn Provider> {
    let cfg = VerbsConfig { device: std::env::var("RDMA_SHUFFLE_VERBS_DEVICE").ok(), ..cfg };
    Arc::new(VerbsProvider::open(cfg).unwrap_or_else(|e| panic!("needs an RDMA device (run via scripts/verbs-test.sh): {e}")))
}

fn counter(d: &Driver, name: &str) -> u64 {
    d.provider_counters().into_iter().find(|(k, _)| *k == name).map(|(_, v)| v).unwrap_or(0)
}

const MSG: u32 = 16 * 1024 + 8192;

/// A server's driver.
fn server_driver(p: &Arc<dyn Provider>) -> Driver {
    Driver::new(p.clone(), DriverConfig { name: "server".into(), ..DriverConfig::default() }).unwrap()
}
/// Pool tiers for the small pools of these tests (the defaults go up to 16 MiB).
const SMALL_TIERS: [usize; 4] = [4096, 64 << 10, 256 << 10, 1 << 20];

/// 32 client engines fetch at once from one server whose shared receive queue has 64
/// buffers: credits granted against it keep it from running dry (no receiver-not-ready),
/// and every block arrives intact.
#[test]
fn thirty_two_clients_through_one_shared_receive_queue_of_64() {
    let sp = provider(VerbsConfig { recv_buffers: 64, send_buffers: 32, max_message: MSG, ..VerbsConfig::default() });
    let cp = provider(VerbsConfig { recv_buffers: 16, send_buffers: 8, max_message: MSG, ..VerbsConfig::default() });
    let dir = tempfile::tempdir().unwrap();
    let sizes = [100usize, 16 * 1024 - 1, 20_000, 70_000, 0, 5000, 150_000, 1];
    let out = Arc::new(write_map_output(dir.path(), 4, 1, &sizes, 11).unwrap());
    let scfg = ServerEndpointConfig { eager_threshold: 16 * 1024, name: "srq-server".into(), ..ServerEndpointConfig::default() };
    let server = BlockServer::bind(sp, listen_addr(), scfg).unwrap();
    server.register(out.map_output_files()).unwrap();
    let addr = server.local_addr();
    let clients: Vec<_> = (0..32)
        .map(|i| {
            let (cp, out) = (cp.clone(), out.clone());
            std::thread::spawn(move || {
                let pool = pool_for(
                    &cp,
                    PoolConfig { tiers: SMALL_TIERS.to_vec(), cap_bytes: 2 << 20, slab_bytes: 1 << 20, prealloc: false },
                );
                let cfg =
                    ClientEndpointConfig { max_eager: 16 * 1024, name: format!("client-{i}"), ..ClientEndpointConfig::default() };
                let c = BlockClient::new(cp, pool, cfg).unwrap();
                let blocks: Vec<_> = (0..sizes.len() as u32).map(|r| ShuffleBlock::single(4, 1, r)).collect();
                for round in 0..2 {
                    let sink = Collect::new(blocks.len());
                    c.fetch(addr, &blocks, sink.clone());
                    if !sink.ready(Duration::from_secs(120)) {
                        panic!(
                            "client {i} round {round}: blocks missing; client {:?}; driver {:?} {:?}",
                            c.stats(),
                            c.driver().stats(),
                            c.driver().provider_counters()
                        );
                    }
                    let got = sink.wait(Duration::from_secs(1));
                    for (r, b) in blocks.iter().enumerate() {
                        let bytes = got[&r].as_ref().unwrap_or_else(|e| panic!("client {i} round {round} block {b:?}: {e}"));
                        assert!(bytes == &out.range_bytes(r as u32, r as u32 + 1), "client {i}: block {r} differs");
                    }
                }
                let rnr = counter(c.driver(), "rnr_errors");
                c.shutdown();
                rnr
            })
        })
        .collect();
    let client_rnr: u64 = clients
        .into_iter()
        .map(|t| {
            t.join().unwrap_or_else(|_| {
                panic!(
                    "a client failed; server {:?} {:?} {:?}",
                    server.stats(),
                    server.driver().stats(),
                    server.driver().provider_counters()
                )
            })
        })
        .sum();
    let d = server.driver();
    assert_eq!(counter(d, "qps_created"), 32, "one queue pair per client: {:?}", d.provider_counters());
    assert_eq!(counter(d, "rnr_errors") + client_rnr, 0, "credits kept every receive queue from running dry");
    assert_eq!(server.stats().blocks_served(), 32 * 2 * sizes.len() as u64);
    assert_eq!(d.stats().preauth_registered_bytes.load(Ordering::Relaxed), 0);
}

/// A block source that stalls the server's loop on its first resolve (as a blocked disk
/// would), then answers "unknown".
struct Stall {
    first: std::sync::atomic::AtomicBool,
}

impl BlockSource for Stall {
    fn resolve(&self, span: &BlockSpan) -> Result<Resolved<Arc<dyn Source>>, BlockFailure> {
        if self.first.swap(false, Ordering::AcqRel) {
            std::thread::sleep(Duration::from_secs(3));
        }
        Err(BlockFailure::new(FailureCode::UnknownGroup, format!("{span}: nothing here")))
    }
}

/// A peer that ignores its credits and floods a receiver whose loop is stalled overruns the
/// 16-buffer shared receive queue: its sends get receiver-not-ready NAKs, the finite retries
/// run out, and it gets a typed error naming the cause — no hang. The server recovers and
/// answers the next client.
#[test]
fn a_receiver_overrun_fails_the_sender_with_a_typed_error_never_a_hang() {
    let sp = provider(VerbsConfig { recv_buffers: 16, max_message: MSG, min_rnr_timer: 1, ..VerbsConfig::default() });
    let cp = provider(VerbsConfig { max_message: MSG, rnr_retry: 1, ..VerbsConfig::default() });
    let sd = Driver::new(sp, DriverConfig { name: "rnr-server".into(), ..DriverConfig::default() }).unwrap();
    let source = Arc::new(Stall { first: std::sync::atomic::AtomicBool::new(true) });
    let server = ServerEndpoint::bind(&sd, listen_addr(), ServerEndpointConfig::default(), source).unwrap();
    let addr = server.local_addr();
    let cd = Driver::new(cp.clone(), DriverConfig { name: "flooder".into(), ..DriverConfig::default() }).unwrap();
    let link = Channel::connect(&cd, addr, Duration::from_secs(30)).unwrap();
    let mut s = ClientSession::new(ClientConfig::new(addr.to_string(), [3; 16]), Instant::now());
    while !s.is_ready() {
        while let Some(fr) = s.poll_transmit() {
            link.send(&fr, &[]).unwrap();
        }
        s.handle_frame(link.recv(Duration::from_secs(30)).unwrap().frame, Instant::now()).unwrap();
    }
    link.attach(Duration::from_secs(30)).unwrap();
    let t = Instant::now();
    for req in 0..200u64 {
        let f = Frame::Fetch { req, first_index: 0, blocks: vec![BlockSpan::single(1, req, 0)] };
        link.send(&f, &[]).unwrap();
    }
    // The first Fetch stalls the server's loop; the rest fill its receive queue and overrun it.
    let err = loop {
        match link.recv(Duration::from_secs(60)) {
            Ok(_) => continue,
            Err(e) => break e.to_string(),
        }
    };
    eprintln!("flooder stopped after {:?}: {err}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(60), "bounded");
    assert!(
        counter(&cd, "rnr_errors") >= 1 && err.contains("receiver not ready"),
        "the sender learns why: {err} (counters {:?})",
        cd.provider_counters()
    );
    // The server serves the next, well-behaved client.
    let pool =
        pool_for(&cp, PoolConfig { tiers: SMALL_TIERS.to_vec(), cap_bytes: 4 << 20, slab_bytes: 1 << 20, prealloc: false });
    let c = BlockClient::new(cp, pool, ClientEndpointConfig::default()).unwrap();
    let got = suite::fetch_all(&c, addr, &[ShuffleBlock::single(1, 1, 0)]);
    assert_eq!(got[&0].as_ref().unwrap_err().code, FailureCode::UnknownGroup);
}

struct Fixture {
    _dir: tempfile::TempDir,
    server: BlockServer,
    out: rdma_shuffle_shuffle::testkit::GeneratedOutput,
    client: BlockClient,
}

/// One block of 64 × `small` bytes (which takes the client's whole bytes-in-flight budget
/// while held) and 64 blocks of `small` bytes (a tier size).
fn many_reads(small: usize) -> Fixture {
    let p = provider(VerbsConfig { max_message: MSG, ..VerbsConfig::default() });
    let dir = tempfile::tempdir().unwrap();
    let mut sizes = vec![small; 64];
    sizes.push(64 * small);
    let out = write_map_output(dir.path(), 6, 1, &sizes, 21).unwrap();
    // Every block exposed at once (the big one and the 64 small ones): a budget that holds them.
    let scfg = ServerEndpointConfig {
        credits: 128,
        eager_threshold: 16 * 1024,
        max_bytes_exposed: 128 * small as u64,
        ..ServerEndpointConfig::default()
    };
    let server = BlockServer::bind_on(&server_driver(&p), listen_addr(), scfg).unwrap();
    server.register(out.map_output_files()).unwrap();
    // Budget: half the pool = the big block, or the 64 small ones.
    let pool = pool_for(&p, PoolConfig { cap_bytes: 128 * small as u64, ..PoolConfig::default() });
    let client =
        BlockClient::new(p, pool, ClientEndpointConfig { max_eager: 16 * 1024, ..ClientEndpointConfig::default() }).unwrap();
    Fixture { _dir: dir, server, out, client }
}

/// Holds the big block (budget full), lets the 64 descriptors arrive, then lets go: all 64
/// READs are posted in one turn of the loop.
fn release_64_at_once(fx: &Fixture, sink: Arc<dyn BlockSink>) {
    let addr = fx.server.local_addr();
    let big = Arc::new(Hold::default());
    fx.client.fetch(addr, &[ShuffleBlock::single(6, 1, 64)], big.clone());
    assert!(big.wait(1, Duration::from_secs(300)), "the big block arrives");
    let held = big.take(0).unwrap().unwrap();
    let blocks: Vec<_> = (0..64).map(|r| ShuffleBlock::single(6, 1, r)).collect();
    fx.client.fetch(addr, &blocks, sink);
    let d = fx.server.driver();
    suite::wait_for(|| counter(d, "windows_bound") >= 65, "the server exposed all 64 blocks");
    // Exposed is not arrived: under load the descriptors can still be on their way, and a
    // descriptor that arrives after the release is posted in a later turn. Wait until the
    // client has received every message the server sent.
    let c = fx.client.driver();
    suite::wait_for(|| counter(c, "verbs_recvs") >= counter(d, "verbs_sends"), "every descriptor reached the client");
    // Nothing may be read while the budget is full: give a wrong build time to show it.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(fx.client.driver().stats().reads_in_flight.load(Ordering::Relaxed), 0, "no read before memory is back");
    drop(held);
}

/// Many READs are in flight at once: posted asynchronously, bounded by bytes and the pool,
/// not by threads.
#[test]
fn sixty_four_reads_in_flight() {
    let fx = many_reads(256 << 10);
    let sink = Collect::new(64);
    release_64_at_once(&fx, sink.clone());
    let got = sink.wait(Duration::from_secs(300));
    for r in 0..64u32 {
        let b = got[&(r as usize)].as_ref().unwrap_or_else(|e| panic!("block {r}: {e}"));
        assert!(b == &fx.out.range_bytes(r, r + 1), "block {r} differs");
    }
    let peak = fx.client.driver().stats().peak_reads_in_flight.load(Ordering::Relaxed);
    eprintln!("peak READs in flight: {peak}");
    assert!(peak >= 64, "peak {peak}");
    assert_eq!(counter(fx.client.driver(), "rdma_reads"), 65);
}

/// Issue 14 bug 1: a connection that fails with READs posted moves its queue pair to the
/// error state and collects every posted READ's (flush) completion before the buffers the
/// READs target go back to the pool. The buffers are owned by the queue pair's table of
/// posted work until then: every read below answers (none hangs), the ones caught by the
/// failure fail, every buffer comes back, and no connection goes with work still posted.
///
/// The failure is made deterministic: 64 READs are posted back to back in one turn of the
/// loop and the second one reads outside its window, so the responder answers it with a
/// remote access error, which puts the queue pair in the error state with the 62 READs
/// behind it still posted (a close issued from another thread would come too late on rxe,
/// which moves the bytes of a READ within the posting call).
#[test]
fn a_failed_connection_flushes_its_reads_before_their_buffers_go_back() {
    let p = provider(VerbsConfig { max_message: MSG, ..VerbsConfig::default() });
    let dir = tempfile::tempdir().unwrap();
    let out = write_map_output(dir.path(), 7, 1, &vec![1 << 20; 64], 5).unwrap();
    // All 64 regions exposed before the first READ: a budget that holds them.
    let scfg = ServerEndpointConfig {
        credits: 64,
        eager_threshold: 16 * 1024,
        max_bytes_exposed: 65 << 20,
        ..ServerEndpointConfig::default()
    };
    let server = BlockServer::bind_on(&server_driver(&p), listen_addr(), scfg).unwrap();
    server.register(out.map_output_files()).unwrap();
    let addr = server.local_addr();
    let cd = Driver::new(p.clone(), DriverConfig { name: "reader".into(), ..DriverConfig::default() }).unwrap();
    let link = Channel::connect(&cd, addr, Duration::from_secs(30)).unwrap();
    let mut s = ClientSession::new(ClientConfig::new(addr.to_string(), [4; 16]), Instant::now());
    while !s.is_ready() {
        while let Some(fr) = s.poll_transmit() {
            link.send(&fr, &[]).unwrap();
        }
        s.handle_frame(link.recv(Duration::from_secs(30)).unwrap().frame, Instant::now()).unwrap();
    }
    link.attach(Duration::from_secs(30)).unwrap();
    s.fetch((0..64).map(|r| BlockSpan::single(7, 1, r)).collect(), Instant::now());
    let mut descs = Vec::new();
    while descs.len() < 64 {
        while let Some(fr) = s.poll_transmit() {
            link.send(&fr, &[]).unwrap();
        }
        if let Frame::Rendezvous { desc, .. } = link.recv(Duration::from_secs(60)).unwrap().frame {
            descs.push(desc);
        }
    }
    let pool = pool_for(&p, PoolConfig { cap_bytes: 128 << 20, ..PoolConfig::default() });
    let mut reads: Vec<_> = descs.iter().map(|d| (*d, pool.acquire(d.len as usize, None).unwrap())).collect();
    reads[1].0.addr = reads[1].0.addr.wrapping_add(1 << 40);
    let pending = link.read_batch(reads).unwrap();
    let (mut ok, mut failed) = (0, 0);
    for (i, pr) in pending.into_iter().enumerate() {
        match pr.wait(Duration::from_secs(120)) {
            Ok(lease) => {
                ok += 1;
                drop(lease);
            }
            Err(e) => {
                failed += 1;
                let msg = e.to_string();
                assert!(!msg.contains("did not complete"), "read {i} hung: {msg}");
                if i == 1 {
                    assert!(msg.contains("remote access"), "read 1: {msg}");
                }
            }
        }
    }
    suite::wait_for(|| counter(&cd, "qps_open") == 0, "the queue pair is destroyed after its flush");
    let flushed = counter(&cd, "flushed_completions");
    eprintln!("{ok} READs completed, {failed} failed with the connection, {flushed} flush completions");
    assert!(ok <= 1 && failed >= 63, "the bad READ and every READ behind it failed");
    assert!(flushed >= 62, "the READs behind the bad one were flushed, not lost");
    assert_eq!(cd.stats().reads_in_flight.load(Ordering::Relaxed), 0, "every posted READ completed");
    assert_eq!(cd.stats().unflushed_closes.load(Ordering::Relaxed), 0, "no connection went with work posted");
    assert_eq!(pool.stats().bytes_in_use, 0, "every buffer is back, none leaked");
}
