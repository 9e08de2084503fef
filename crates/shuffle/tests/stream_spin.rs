//! The engine's loop spins before sleeping only while an answer is due, not while a pulled
//! block of less than 2 MiB streams in over tcp: then every answer on the connection is
//! behind the block's bytes, which come at the wire's pace, and a spinning loop would read
//! them a few at a time (at 1 MiB blocks on loopback, 10-16 % more CPU per GiB for the same
//! throughput).
//!
//! The block goes through a relay that lets the server's bytes through in small pieces with
//! pauses shorter than the spin, as a slow link would: a loop that spins through the block
//! runs hundreds of turns per piece; one that sleeps wakes a few times per piece. Loop turns
//! are counted by the client's driver.

use rdma_shuffle_shuffle::blocks::{BlockSink, FetchedBlock};
use rdma_shuffle_shuffle::engine::{Engine, EngineConfig};
use rdma_shuffle_shuffle::testkit::write_map_output;
use rdma_shuffle_shuffle::ShuffleBlock;
use rdma_shuffle_wire::BlockFailure;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The pulled block (above the eager threshold, so it is announced and pulled; below the
/// length from which pulls keep the spin).
const BLOCK: usize = 1 << 20;
/// What the relay lets through at a time, server to client.
const PIECE: usize = 4 << 10;
/// The relay's pause between pieces: well inside the client's 1 ms spin, so a loop that
/// spins through the stream never stops spinning.
const PAUSE: Duration = Duration::from_micros(300);

fn engine(id: &str) -> Engine {
    Engine::open(EngineConfig {
        transport: "tcp".into(),
        bind_host: "127.0.0.1".parse().unwrap(),
        executor_id: id.into(),
        pool_cap: Some(32 << 20),
        spin: Duration::from_millis(1),
        ..EngineConfig::default()
    })
    .unwrap()
}

struct Sink(Mutex<Sender<Result<Vec<u8>, BlockFailure>>>);
impl BlockSink for Sink {
    fn on_block(&self, _: usize, r: Result<FetchedBlock, BlockFailure>) {
        let _ = self.0.lock().unwrap().send(r.map(|b| b.to_vec()));
    }
}

/// Copies `from` to `to` until `from` ends; with `pace`, in pieces of `PIECE` bytes with a
/// pause after each, counting the pieces written into `pieces`.
fn pump(mut from: TcpStream, mut to: TcpStream, pace: Option<Arc<AtomicU64>>) {
    let mut buf = vec![0u8; PIECE];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(pieces) = &pace {
            pieces.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(PAUSE);
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// A relay to `server` for one connection: client to server at full speed, server to
/// client paced. Answers its address and the count of paced pieces.
fn relay(server: SocketAddr) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let pieces = Arc::new(AtomicU64::new(0));
    let counted = pieces.clone();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let upstream = TcpStream::connect(server).unwrap();
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (c2, u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
        std::thread::spawn(move || pump(c2, u2, None));
        pump(upstream, client, Some(counted));
    });
    (addr, pieces)
}

#[test]
fn the_loop_sleeps_while_a_pulled_block_streams_in() {
    let dir = tempfile::tempdir().unwrap();
    let server = engine("server");
    let client = engine("client");
    let out = write_map_output(dir.path(), 0, 0, &[100, BLOCK], 7).unwrap();
    server.server().register(out.map_output_files()).unwrap();
    let (via, pieces) = relay(server.server().local_addr());

    let fetch = |partition: u32| {
        let (tx, rx) = channel();
        client.client().fetch(via, &[ShuffleBlock::single(0, 0, partition)], Arc::new(Sink(Mutex::new(tx))));
        rx.recv_timeout(Duration::from_secs(120)).expect("the block").expect("fetched")
    };
    // Connect and shake hands first: the turns counted below are the block's.
    assert_eq!(fetch(0), out.partitions[0]);
    let turns = || client.driver().stats().loop_turns.load(Ordering::Relaxed);
    let (turns0, pieces0) = (turns(), pieces.load(Ordering::Relaxed));
    assert!(fetch(1) == out.partitions[1], "the streamed block's bytes are the file's");
    let (turns, pieces) = (turns() - turns0, pieces.load(Ordering::Relaxed) - pieces0);
    eprintln!("{turns} loop turns for {pieces} pieces of the block");
    assert!(pieces >= (BLOCK / PIECE) as u64, "the relay paced the block: {pieces} pieces");
    // A sleeping loop wakes for each piece (a piece may arrive in two reads); a spinning one
    // turns every microsecond or so through each 300 us pause.
    assert!(turns <= 8 * pieces, "{turns} loop turns for {pieces} pieces: the loop spun while the block streamed in");
}
