//! Large blocks (issue 14): a block several times the client's pool cap cannot be fetched
//! whole (a typed `pool_exhausted` error naming the cap setting), but streams in ranges that
//! each fit one pool buffer, in order, byte-exact, never holding more than the stream's
//! window of buffers; a range past a block's end is refused with `bad_range`.

use super::*;
use rdma_shuffle_shuffle::{ChunkSink, StreamConfig};

const CAP: u64 = 4 << 20;
const CHUNK: u64 = 1 << 20;

/// FNV-1a 64: the checksum the streamed bytes are compared by.
fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}
const FNV0: u64 = 0xcbf2_9ce4_8422_2325;

/// Records a stream: checks order and chunk sizes as they come, checksums the bytes, and
/// notes the most pool memory in use while a chunk is handed over.
struct Record {
    pool: rdma_shuffle_fabric::TieredPool,
    delay: Duration,
    state: Mutex<RecordState>,
    cv: Condvar,
}

#[derive(Default)]
struct RecordState {
    next: u64,
    sum: u64,
    chunks: usize,
    max_chunk: usize,
    peak_in_use: u64,
    bad: Option<String>,
    end: Option<Result<u64, BlockFailure>>,
}

impl Record {
    fn new(pool: &rdma_shuffle_fabric::TieredPool, delay: Duration) -> Arc<Self> {
        let state = RecordState { sum: FNV0, ..Default::default() };
        Arc::new(Record { pool: pool.clone(), delay, state: Mutex::new(state), cv: Condvar::new() })
    }

    fn wait(&self) -> RecordState {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut st = self.state.lock();
        while st.end.is_none() {
            assert!(!self.cv.wait_until(&mut st, deadline).timed_out(), "stream did not end within 60 s");
        }
        std::mem::take(&mut *st)
    }
}

impl ChunkSink for Record {
    fn on_chunk(&self, offset: u64, _block_len: u64, chunk: &[u8]) -> Result<(), BlockFailure> {
        std::thread::sleep(self.delay);
        let mut st = self.state.lock();
        if offset != st.next || chunk.is_empty() {
            st.bad = Some(format!("chunk at {offset} of {} bytes, expected offset {}", chunk.len(), st.next));
        }
        st.next = offset + chunk.len() as u64;
        st.sum = fnv(st.sum, chunk);
        st.chunks += 1;
        st.max_chunk = st.max_chunk.max(chunk.len());
        st.peak_in_use = st.peak_in_use.max(self.pool.stats().bytes_in_use);
        Ok(())
    }

    fn on_end(&self, result: Result<u64, BlockFailure>) {
        let mut st = self.state.lock();
        if st.end.is_some() {
            st.bad = Some("on_end called twice".into());
        }
        st.end = Some(result);
        self.cv.notify_all();
    }
}

/// A client whose pool is capped at [`CAP`], with tiers up to [`CHUNK`].
fn small_pool_client(f: Factory) -> BlockClient {
    let p = f();
    let pool =
        pool_for(&p, PoolConfig { tiers: vec![4 << 10, 64 << 10, 256 << 10, 1 << 20], cap_bytes: CAP, ..PoolConfig::default() });
    BlockClient::new(p, pool, client_cfg(None)).unwrap()
}

pub fn blocks_over_the_pool_cap_stream_in_bounded_buffers(f: Factory) {
    let fx = server_with(f, server_cfg(None), 0);
    let addr = fx.server.local_addr();
    // Partition 1 is 3.2 times the client's pool cap (and not a multiple of the chunk).
    let big = (CAP * 16 / 5) as usize + 12_345;
    let out = write_map_output(fx.dir.path(), 4, 7, &[100, big, 5, 70_000], 9).unwrap();
    fx.server.register(out.map_output_files()).unwrap();
    let c = small_pool_client(f);

    // Today's path: the whole block wants one buffer larger than the pool may ever hold.
    let got = fetch_all(&c, addr, &[ShuffleBlock::single(4, 7, 1)]);
    let e = got[&0].as_ref().expect_err("a block over the pool cap was fetched whole");
    assert_eq!(e.code, FailureCode::PoolExhausted, "{e}");
    assert!(e.message.contains("spark.shuffle.rdma.pool.capBytes") && e.message.contains(&big.to_string()), "{}", e.message);

    // Streamed: the single block with 2 buffers, then a batch over all four partitions with
    // 1 buffer and a slow sink (the stream must wait for it, not buffer ahead; the client's
    // bytes-in-flight budget, half the pool, would let 2 buffers in).
    for (block, delay, window) in
        [(ShuffleBlock::single(4, 7, 1), Duration::ZERO, 2), (ShuffleBlock::batch(4, 7, 0, 4), Duration::from_millis(15), 1)]
    {
        let want = out.range_bytes(block.start_reduce, block.end_reduce);
        let rec = Record::new(c.pool(), delay);
        c.fetch_stream(addr, block, StreamConfig { chunk_len: CHUNK, window }, rec.clone());
        let st = rec.wait();
        assert_eq!(st.bad, None);
        assert_eq!(st.end.as_ref().unwrap().as_ref().map_err(|e| e.to_string()), Ok(&(want.len() as u64)));
        assert_eq!((st.next, st.sum), (want.len() as u64, fnv(FNV0, &want)), "streamed bytes differ from the file's");
        assert_eq!(st.chunks, want.len().div_ceil(CHUNK as usize), "one chunk per range");
        assert_eq!(st.max_chunk as u64, CHUNK);
        assert!(st.peak_in_use <= window as u64 * CHUNK, "the stream held {} B of pool memory", st.peak_in_use);
    }
    let s = c.stats();
    assert_eq!(s.streamed_blocks.load(Ordering::Relaxed), 2);
    let total = (big + out.range_bytes(0, 4).len()) as u64;
    assert_eq!(s.streamed_bytes.load(Ordering::Relaxed), total);
    let peak = s.peak_stream_buffers.load(Ordering::Relaxed);
    assert_eq!(peak, 2, "peak buffers per stream");
    assert!(c.pool().stats().peak_bytes_in_use <= CAP);
    wait_for(|| c.pool().stats().bytes_in_use == 0, "every buffer went back to the pool");

    // A block the server does not have ends the stream with its typed error.
    let rec = Record::new(c.pool(), Duration::ZERO);
    c.fetch_stream(addr, ShuffleBlock::single(4, 8, 1), StreamConfig::default(), rec.clone());
    let e = rec.wait().end.unwrap().expect_err("an unknown map output was streamed");
    assert_eq!(e.code, FailureCode::UnknownObject, "{e}");
    // An empty block streams as nothing.
    let empty = write_map_output(fx.dir.path(), 4, 9, &[0, 3], 1).unwrap();
    fx.server.register(empty.map_output_files()).unwrap();
    let rec = Record::new(c.pool(), Duration::ZERO);
    c.fetch_stream(addr, ShuffleBlock::single(4, 9, 0), StreamConfig::default(), rec.clone());
    let st = rec.wait();
    assert_eq!((st.chunks, st.end.unwrap().map_err(|e| e.to_string())), (0, Ok(0)));
    assert_eq!(c.connections(), 1, "one connection served it all");
}

pub fn a_range_past_the_end_of_a_block_is_refused(f: Factory) {
    let fx = server_with(f, server_cfg(None), 1);
    let addr = fx.server.local_addr();
    let o = &fx.outputs[0];
    // Partition 8 is 1.5 MB: rendezvous; partition 2 is 100 bytes.
    let (b8, b2) = (ShuffleBlock::single(3, o.map_id, 8), ShuffleBlock::single(3, o.map_id, 2));
    let n8 = o.range_bytes(8, 9).len() as u64;
    let c = client(f, None, 64 << 20);
    let ranges = [(b8, 1000, 5000), (b8, n8 - 10, 11), (b8, n8 + 1, 0), (b2, 0, 100), (b2, 50, 51), (b2, 100, 0)];
    let sink = Collect::new(ranges.len());
    c.fetch_ranges(addr, &ranges, sink.clone());
    let got = sink.wait(T);
    assert_eq!(got[&0].as_ref().unwrap(), &o.range_bytes(8, 9)[1000..6000]);
    assert_eq!(got[&3].as_ref().unwrap(), &o.range_bytes(2, 3));
    assert!(got[&5].as_ref().unwrap().is_empty(), "an empty range at the very end is inside the block");
    for (i, len) in [(1, n8), (2, n8), (4, 100)] {
        let e = got[&i].as_ref().expect_err("a range past the end was served");
        assert_eq!(e.code, FailureCode::BadRange, "range {i}: {e}");
        assert!(e.message.contains("past the end") && e.message.contains(&format!("has {len} bytes")), "{}", e.message);
    }
    // Refusals fail ranges, not the connection.
    let again = fetch_all(&c, addr, &[b2]);
    assert_eq!(again[&0].as_ref().unwrap(), &o.range_bytes(2, 3));
    assert_eq!(c.connections(), 1);
}

/// A map output whose data file passes 4 GiB (a sparse file: the first partition is a hole
/// of 4 GiB and a bit), with two blocks stored beyond it: one under the eager threshold and one
/// over it, so both the inline and the pulled path read at 64-bit offsets. Each arrives with
/// exactly the bytes written there; an offset cut to 32 bits anywhere on the way (index, store,
/// the server's read, a descriptor) would read the hole's zeros or the first bytes instead.
pub fn blocks_stored_past_4_gib_are_served_exactly(f: Factory) {
    const HOLE: u64 = (4 << 30) + 4093; // not a multiple of anything convenient
    let dir = tempfile::tempdir().unwrap();
    let (shuffle, map) = (9, 1);
    let data_path = dir.path().join(format!("shuffle_{shuffle}_{map}_0.data"));
    let index_path = dir.path().join(format!("shuffle_{shuffle}_{map}_0.index"));
    let mut rng = rdma_shuffle_shuffle::testkit::TestRng::new(4);
    let parts: Vec<Vec<u8>> =
        [100usize, EAGER as usize * 3].iter().map(|&n| (0..n).map(|_| rng.next_u64() as u8).collect()).collect();
    let file = std::fs::File::create(&data_path).unwrap();
    let mut at = HOLE;
    let mut offsets = vec![0i64, HOLE as i64];
    for p in &parts {
        std::os::unix::fs::FileExt::write_all_at(&file, p, at).unwrap();
        at += p.len() as u64;
        offsets.push(at as i64);
    }
    drop(file);
    rdma_shuffle_shuffle::testkit::write_index(&index_path, &offsets).unwrap();
    let server = BlockServer::bind(f(), listen_addr(), server_cfg(None)).unwrap();
    let files = MapOutputFiles { shuffle_id: shuffle, map_id: map, data_path, index_path, num_partitions: Some(3) };
    server.register(files).unwrap();
    assert_eq!(server.store().get(shuffle, map).unwrap().data_len(), at);
    let c = client(f, None, 16 << 20);
    let blocks =
        [ShuffleBlock::single(shuffle, map, 1), ShuffleBlock::single(shuffle, map, 2), ShuffleBlock::batch(shuffle, map, 1, 3)];
    let got = fetch_all(&c, server.local_addr(), &blocks);
    let both: Vec<u8> = parts.concat();
    for (i, want) in [&parts[0], &parts[1], &both].into_iter().enumerate() {
        let b = got[&i].as_ref().unwrap_or_else(|e| panic!("block {i} past 4 GiB: {e}"));
        assert!(b == want, "block {i} past 4 GiB: {} bytes, not the ones stored there", b.len());
    }
    let st = c.stats();
    assert!(st.eager_blocks.load(Ordering::Relaxed) >= 1 && st.rendezvous_blocks.load(Ordering::Relaxed) >= 1, "both paths ran");
}
