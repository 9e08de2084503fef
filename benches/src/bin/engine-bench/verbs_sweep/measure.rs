//! The measurement half of the sweep (feature `verbs`): two drivers on one device, eager
//! SEND and rendezvous READ timed block size by block size.

use super::*;
use parking_lot::{Condvar, Mutex};
use rdma_shuffle_fabric::pool::{PoolConfig, TieredPool};
use rdma_shuffle_fabric::Provider;
use rdma_shuffle_providers::verbs::{VerbsConfig, VerbsProvider};
use rdma_shuffle_shuffle::blocks::{BlockSink, ClientEndpointConfig, FetchedBlock, ServerEndpointConfig};
use rdma_shuffle_shuffle::store::MapOutputFiles;
use rdma_shuffle_shuffle::testkit::{data_file_name, index_file_name, write_index, TestRng};
use rdma_shuffle_shuffle::{BlockClient, BlockServer, ShuffleBlock};
use rdma_shuffle_wire::{BlockFailure, Limits};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHUFFLE: u32 = 1;

/// How long a fetch may make no progress before the sweep gives up.
const STALL: Duration = Duration::from_secs(120);

/// Collects one fetch: counts bytes, keeps failures, compares every block with the bytes
/// it should have.
struct Collect {
    left: Mutex<usize>,
    cv: Condvar,
    bytes: Mutex<u64>,
    failures: Mutex<Vec<String>>,
    /// The data file's bytes, the block size, and the partition of the fetch's first block.
    expect: (Arc<Vec<u8>>, usize, usize),
}

impl BlockSink for Collect {
    fn on_block(&self, i: usize, r: Result<FetchedBlock, BlockFailure>) {
        match r {
            Ok(b) => {
                let (data, size, first) = &self.expect;
                let p = first + i;
                if data.get(p * size..(p + 1) * size) != Some(&b[..]) {
                    self.failures.lock().push(format!("partition {p} ({} bytes) differs from the data file", b.len()));
                }
                // The block is dropped here: its buffer goes back to the pool at once.
                *self.bytes.lock() += b.len() as u64;
            }
            Err(e) => self.failures.lock().push(format!("block {i}: {e}")),
        }
        let mut l = self.left.lock();
        *l -= 1;
        if *l == 0 {
            self.cv.notify_all();
        }
    }
}

struct Setup {
    path: PathKind,
    size: usize,
    server: BlockServer,
    client: BlockClient,
    addr: SocketAddr,
    client_provider: VerbsProvider,
}

impl Setup {
    fn open(cfg: &SweepConfig, path: PathKind, files: &MapOutputFiles, size: usize) -> Result<Setup, SweepError> {
        let fail = |message: String| SweepError::Setup { path, size, message };
        let eager = match path {
            PathKind::Send => size,
            PathKind::Read => READ_EAGER_THRESHOLD,
        };
        let depth = match path {
            PathKind::Send => send_path_depth(size),
            // READ frames are small: the provider's defaults, as the engine uses them.
            PathKind::Read => VerbsConfig::default().recv_buffers,
        };
        let vc = VerbsConfig {
            device: cfg.device.clone(),
            gid_index: cfg.gid_index,
            recv_buffers: depth.max(8),
            send_buffers: depth.clamp(4, VerbsConfig::default().send_buffers),
            max_message: max_message_for(eager),
            ..VerbsConfig::default()
        };
        // Two providers: the server's and the client's devices contexts and protection
        // domains are separate, as in two executors.
        let sp = VerbsProvider::open(vc.clone()).map_err(|e| fail(format!("opening the server's device: {e}")))?;
        let cp = VerbsProvider::open(vc).map_err(|e| fail(format!("opening the client's device: {e}")))?;
        let limits = Limits { max_eager: eager as u32, ..Limits::default() };
        let scfg = ServerEndpointConfig {
            credits: credits_for(size),
            eager_threshold: eager as u32,
            limits,
            name: format!("sweep-{path}-server"),
            ..ServerEndpointConfig::default()
        };
        let server = BlockServer::bind(Arc::new(sp), SocketAddr::from(([127, 0, 0, 1], 0)), scfg)
            .map_err(|e| fail(format!("binding the block server: {e}")))?;
        server.register(files.clone()).map_err(|e| fail(format!("registering the data file: {e}")))?;
        // READ destinations must be registered with the client's device.
        let pool = TieredPool::new(PoolConfig::default(), cp.registrar()).map_err(|e| fail(format!("building the pool: {e}")))?;
        let ccfg = ClientEndpointConfig {
            max_eager: eager as u32,
            limits,
            name: format!("sweep-{path}-client"),
            ..ClientEndpointConfig::default()
        };
        let client = BlockClient::new(Arc::new(cp.clone()), pool, ccfg).map_err(|e| fail(format!("starting the client: {e}")))?;
        let addr = server.local_addr();
        Ok(Setup { path, size, server, client, addr, client_provider: cp })
    }

    fn err(&self, message: String) -> SweepError {
        SweepError::Fetch { path: self.path, size: self.size, message }
    }

    /// Fetches `blocks` (partitions `first..`) in one request, waits for all of them, and
    /// checks their bytes against `data`. Returns the bytes moved.
    fn fetch(&self, blocks: &[ShuffleBlock], data: &Arc<Vec<u8>>, first: usize) -> Result<u64, SweepError> {
        let expect = (data.clone(), self.size, first);
        let c = Arc::new(Collect {
            left: Mutex::new(blocks.len()),
            cv: Condvar::new(),
            bytes: Mutex::new(0),
            failures: Mutex::new(Vec::new()),
            expect,
        });
        self.client.fetch(self.addr, blocks, c.clone());
        let mut left = c.left.lock();
        let mut last = *left;
        let mut since = Instant::now();
        while *left > 0 {
            c.cv.wait_for(&mut left, Duration::from_secs(1));
            if *left != last {
                (last, since) = (*left, Instant::now());
            } else if since.elapsed() > STALL {
                return Err(self.err(format!(
                    "fetch stalled: {} of {} blocks outstanding for {} s",
                    *left,
                    blocks.len(),
                    STALL.as_secs()
                )));
            }
        }
        drop(left);
        let f = c.failures.lock();
        if let Some(first) = f.first() {
            return Err(self.err(format!("{} of {} blocks failed; first: {first}", f.len(), blocks.len())));
        }
        let bytes = *c.bytes.lock();
        Ok(bytes)
    }

    /// Checks from both sides' counters that every block took this set-up's path.
    fn check_path(&self) -> Result<(), SweepError> {
        let s = self.server.stats();
        let eager = s.eager_blocks.load(std::sync::atomic::Ordering::Relaxed);
        let rendezvous = s.rendezvous_blocks.load(std::sync::atomic::Ordering::Relaxed);
        let reads = self.client.stats().one_sided_reads.load(std::sync::atomic::Ordering::Relaxed);
        let device_reads =
            self.client.driver().provider_counters().iter().find(|(n, _)| *n == "rdma_reads").map(|(_, v)| *v).unwrap_or(0);
        let ok = match self.path {
            PathKind::Send => eager > 0 && rendezvous == 0 && reads == 0 && device_reads == 0,
            PathKind::Read => eager == 0 && rendezvous > 0 && reads == rendezvous && device_reads == rendezvous,
        };
        if ok {
            Ok(())
        } else {
            Err(SweepError::PathNotForced { path: self.path, size: self.size, eager, rendezvous, reads })
        }
    }

    fn close(self) {
        self.client.shutdown();
        self.server.shutdown();
    }
}

fn mem_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| l.strip_prefix("MemAvailable:").map(|v| v.trim().trim_end_matches("kB").trim().to_string()))
        })
        .and_then(|v| v.parse::<u64>().ok())
        .map(|kb| kb / 1024)
        .unwrap_or(0)
}

/// Measures both paths at one size, alternating between them round by round and sample by
/// sample, so both see the same share of a noisy (emulated, shared) machine.
fn measure_size(
    cfg: &SweepConfig,
    files: &MapOutputFiles,
    data: &Arc<Vec<u8>>,
    size: usize,
    n: usize,
) -> Result<(PathResult, PathResult, String), SweepError> {
    let send = Setup::open(cfg, PathKind::Send, files, size)?;
    let read = match Setup::open(cfg, PathKind::Read, files, size) {
        Ok(r) => r,
        Err(e) => {
            send.close();
            return Err(e);
        }
    };
    let device = read.client_provider.device().to_string();
    let result = (|| {
        let setups = [&send, &read];
        let blocks: Vec<ShuffleBlock> = (0..n as u32).map(|r| ShuffleBlock::single(SHUFFLE, files.map_id, r)).collect();
        // Warm-up: connect, and grow the pool towards what a window of blocks in flight
        // needs (at most 16 MiB of blocks: growing a slab costs little next to moving it).
        let warm = n.min(credits_for(size) as usize).min((16 * MIB / size).max(1));
        for s in setups {
            s.fetch(&blocks[..warm], data, 0)?;
        }
        // Throughput: all blocks requested at once, repeated until each path has been
        // timed for at least min_secs.
        let mut rounds = [0usize; 2];
        let mut secs = [0f64; 2];
        while (0..2).any(|k| rounds[k] == 0 || secs[k] < cfg.min_secs) {
            for (k, s) in setups.iter().enumerate() {
                if rounds[k] > 0 && secs[k] >= cfg.min_secs {
                    continue;
                }
                let t = Instant::now();
                let got = s.fetch(&blocks, data, 0)?;
                secs[k] += t.elapsed().as_secs_f64();
                if got != (n * size) as u64 {
                    return Err(s.err(format!("a fetch of {n} blocks moved {got} bytes, expected {}", n * size)));
                }
                rounds[k] += 1;
            }
        }
        // Latency: one block at a time, cycling through the blocks, alternating paths.
        let mut lat = [Vec::with_capacity(cfg.lat_max), Vec::with_capacity(cfg.lat_max)];
        let t = Instant::now();
        while lat[0].len() < cfg.lat_max && (lat[0].len() < cfg.lat_min || t.elapsed().as_secs_f64() < 2.0 * cfg.lat_secs) {
            let i = lat[0].len() % n;
            for (k, s) in setups.iter().enumerate() {
                let t = Instant::now();
                s.fetch(&blocks[i..i + 1], data, i)?;
                lat[k].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        for s in setups {
            // The server publishes a connection's counters as they grow, a moment after the
            // client may have had its last block: give them up to 5 s to agree.
            let t = std::time::Instant::now();
            while let Err(e) = s.check_path() {
                if t.elapsed() > std::time::Duration::from_secs(5) {
                    return Err(e);
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        let bytes = (n * size) as f64;
        let [mut ls, mut lr] = lat;
        let r = |k: usize, l: &mut Vec<f64>| PathResult {
            mbps: bytes * rounds[k] as f64 * 8.0 / secs[k] / 1e6,
            p50_us: median(l),
            samples: l.len(),
            rounds: rounds[k],
        };
        Ok((r(0, &mut ls), r(1, &mut lr)))
    })();
    send.close();
    read.close();
    result.map(|(s, r)| (s, r, device))
}

pub(super) fn sweep(cfg: &SweepConfig) -> Result<(Vec<SizeResult>, RunInfo), SweepError> {
    let t0 = Instant::now();
    let dir = tempfile::tempdir_in(&cfg.dir)
        .map_err(|e| SweepError::Io { what: format!("creating a directory in {}", cfg.dir.display()), source: e })?;
    let mut device = String::new();
    let mut results = Vec::new();
    // One stream of pseudo-random bytes; each size's data file is its first blocks × size
    // bytes, so generating (slow under emulation) happens once.
    let t = Instant::now();
    let longest = cfg.sizes.iter().map(|&s| cfg.blocks_for(s) * s).max().unwrap_or(0);
    let mut bytes = vec![0u8; longest];
    TestRng::new(0x5eed).fill(&mut bytes);
    let data = Arc::new(bytes);
    eprintln!("verbs-sweep: {} MiB of block data generated in {:.1} s", longest / MIB, t.elapsed().as_secs_f64());
    for (k, &size) in cfg.sizes.iter().enumerate() {
        let n = cfg.blocks_for(size);
        let t = Instant::now();
        // A map output per size: a file still mapped by a server thread that has not
        // exited yet is never rewritten under it.
        let map_id = k as u64;
        let files = MapOutputFiles {
            shuffle_id: SHUFFLE,
            map_id,
            data_path: dir.path().join(data_file_name(SHUFFLE, map_id)),
            index_path: dir.path().join(index_file_name(SHUFFLE, map_id)),
            num_partitions: Some(n as u32),
        };
        let io = |what: &str, e| SweepError::Io {
            what: format!("writing the {what} file for {n} blocks of {size} bytes in {}", dir.path().display()),
            source: e,
        };
        std::fs::write(&files.data_path, &data[..n * size]).map_err(|e| io("data", e))?;
        let offsets: Vec<i64> = (0..=n).map(|i| (i * size) as i64).collect();
        write_index(&files.index_path, &offsets).map_err(|e| io("index", e))?;
        let written = t.elapsed().as_secs_f64();
        let (send, read, dev) = measure_size(cfg, &files, &data, size, n)?;
        device = dev;
        eprintln!(
            "verbs-sweep: {:>7} x {n:>3}: SEND {:7.1} Mbit/s p50 {:8.0} us | READ {:7.1} Mbit/s p50 {:8.0} us | rounds {}/{}, samples {}/{}, {:.1} s (+{written:.1} s writing), {} MiB free",
            human(size),
            send.mbps,
            send.p50_us,
            read.mbps,
            read.p50_us,
            send.rounds,
            read.rounds,
            send.samples,
            read.samples,
            t.elapsed().as_secs_f64() - written,
            mem_available_mib()
        );
        results.push(SizeResult { bytes: size, blocks: n, credits: credits_for(size), send, read });
        // tmpfs in the VM: the file is memory.
        let _ = std::fs::remove_file(&files.data_path);
        let _ = std::fs::remove_file(&files.index_path);
    }
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_default();
    Ok((results, RunInfo { device, kernel, seconds: t0.elapsed().as_secs_f64() }))
}
