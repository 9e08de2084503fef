//! `engine-bench run`: the engine against the real alternatives on loopback tcp, in one run.
//!
//! Three systems move the same bytes between two processes each:
//! * **iperf3** (`iperf3 -l 1M`, Debian's): a memory-to-memory TCP stream, the ceiling;
//! * **Spark's own block transfer** (`benches/netty`, `NettyBlockBench`): spark-network-common's
//!   `TransportServer` serving `FileSegmentManagedBuffer` blocks of Spark-layout map outputs
//!   through a `OneForOneStreamManager`, fetched chunk by chunk by a `TransportClient`, in two
//!   JVMs, as Spark's default shuffle does;
//! * **the engine** (tcp provider): a server process (`engine-bench serve`) serving the same
//!   files, fetched by an engine in this process through the public `Engine` / `BlockClient`
//!   API.
//!
//! Measured in every round, the systems taking turns (engine first in odd rounds, Spark first in
//! even ones; iperf3 opens each round), after `--warmup` untimed rounds (default 2):
//! * throughput at every block size of `--sizes` (the whole `--mib` of map outputs, every block
//!   requested, at most 48 MiB in flight: Spark's `maxBytesInFlight` and the engine's default),
//!   and CPU seconds per GiB of both processes (from `/proc`);
//! * 4 KiB blocks per second with 64 in flight (the engine: its server's 64 credits; Spark: a
//!   window of 64 `fetchChunk`s);
//! * 4 KiB latency, one block at a time (Spark: one `fetchChunk` of an opened stream, the
//!   opening RPC not timed, which flatters Spark; the engine: one whole fetch request).
//!
//! The report gives, per metric, the median over rounds with the range, the per-round values,
//! and each target of issue 13 with the value reached (reported, never asserted).

use rdma_shuffle_bench::{parse_size, percentile, procfs, Proc, Spread, Waiter};
use rdma_shuffle_shuffle::store::MapOutputFiles;
use rdma_shuffle_shuffle::testkit::{write_index, write_map_output, TestRng};
use rdma_shuffle_shuffle::{Engine, EngineConfig, ShuffleBlock, Transport};
use serde_json::{json, Value};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// Bytes of one map output's data file.
const MAP_BYTES: usize = 16 * MIB;
/// Small blocks: size and count of their map output.
const SMALL: usize = 4 * KIB;
const SMALL_PARTS: usize = 1024;
/// Small blocks in flight, for both systems.
const SMALL_IN_FLIGHT: u32 = 64;
/// Bytes in flight in the bulk runs: Spark's `spark.reducer.maxSizeInFlight` default.
const BYTES_IN_FLIGHT: usize = 48 * MIB;
const SHUFFLE_SMALL: u32 = 2;
/// Shuffle id of the bulk map outputs indexed for block size number `k` of `--sizes`.
const SHUFFLE_BULK_BASE: u32 = 100;
/// A fetch that makes no progress for this long fails the run.
const STALL: Duration = Duration::from_secs(120);

pub const USAGE: &str = "engine-bench run --netty-cp CLASSPATH [--java JAVA] [--jvm-opt OPT]... [--iperf3 IPERF3]
    [--mib N] [--sizes 64k,256k,1m,4m] [--rounds N] [--warmup N] [--small-reps N] [--lat-samples N] [--dir DIR] [--out FILE]
    [--spark-version V] [--min-secs S (0.5: each bulk measurement repeats its transfer until it ran this long)]";

type R<T> = Result<T, String>;

/// Settings of a comparison run.
#[derive(Clone, Debug)]
pub struct Config {
    /// MiB of map outputs fetched per bulk measurement (a multiple of 16).
    pub mib: usize,
    /// Block sizes of the bulk measurements (powers of two, 4 KiB..16 MiB; 1 MiB always).
    pub sizes: Vec<usize>,
    /// Timed rounds.
    pub rounds: usize,
    /// Untimed rounds first.
    pub warmup: usize,
    /// Small-block throughput: fetches of all 1024 blocks per round and system.
    pub small_reps: usize,
    /// Latency samples per round and system.
    pub lat_samples: usize,
    /// Class path of `NettyBlockBench` (benches/netty).
    pub netty_cp: String,
    /// The `java` to run it with.
    pub java: String,
    /// JVM options of both JVMs.
    pub jvm_opts: Vec<String>,
    /// The `iperf3` binary.
    pub iperf3: String,
    /// Where map outputs are written.
    pub dir: PathBuf,
    /// Where the JSON report goes (`None`: stdout).
    pub out: Option<PathBuf>,
    /// Spark version of the class path, for the report.
    pub spark_version: String,
    /// A bulk measurement repeats its transfer until it has run this long, so that its CPU
    /// figure (clock ticks of /proc/PID/stat, 10 ms each) is never a handful of ticks or 0.
    pub min_secs: f64,
}

impl Config {
    /// Parses the words after `run`.
    pub fn from_args(args: &[String]) -> R<Config> {
        let mut c = Config {
            mib: 1024,
            sizes: vec![64 * KIB, 256 * KIB, MIB, 4 * MIB],
            rounds: 5,
            warmup: 2,
            small_reps: 20,
            lat_samples: 2000,
            netty_cp: String::new(),
            java: "java".into(),
            jvm_opts: Vec::new(),
            iperf3: "iperf3".into(),
            dir: std::env::var_os("BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir),
            out: None,
            spark_version: "unknown".into(),
            min_secs: 0.5,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value = || it.next().cloned().ok_or_else(|| format!("{flag} needs a value; usage: {USAGE}"));
            let count = |v: String, what: &str| -> R<usize> {
                v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| format!("{what}: '{v}' is not a positive integer"))
            };
            match flag.as_str() {
                "--mib" => c.mib = count(value()?, "--mib")?,
                // Older spelling, kept for the README's commands: whole GiB.
                "--gib" => c.mib = count(value()?, "--gib")? * 1024,
                "--sizes" => {
                    c.sizes = value()?
                        .split(',')
                        .map(|s| parse_size(s).ok_or_else(|| format!("--sizes: '{s}' is not a size (4k, 1m, ...)")))
                        .collect::<R<_>>()?
                }
                "--rounds" => c.rounds = count(value()?, "--rounds")?,
                "--warmup" => {
                    let v = value()?;
                    c.warmup = v.parse().map_err(|_| format!("--warmup: '{v}' is not a number of rounds"))?
                }
                "--small-reps" => c.small_reps = count(value()?, "--small-reps")?,
                "--lat-samples" => c.lat_samples = count(value()?, "--lat-samples")?,
                "--netty-cp" => c.netty_cp = value()?,
                "--java" => c.java = value()?,
                "--jvm-opt" => c.jvm_opts.push(value()?),
                "--iperf3" => c.iperf3 = value()?,
                "--dir" => c.dir = PathBuf::from(value()?),
                "--out" => c.out = Some(PathBuf::from(value()?)),
                "--spark-version" => c.spark_version = value()?,
                "--min-secs" => {
                    let v = value()?;
                    c.min_secs =
                        v.parse().ok().filter(|x: &f64| x.is_finite() && *x >= 0.0).ok_or(format!("--min-secs: '{v}'"))?
                }
                other => return Err(format!("unknown argument '{other}'; usage: {USAGE}")),
            }
        }
        if !c.sizes.contains(&MIB) {
            c.sizes.push(MIB);
        }
        c.sizes.sort_unstable();
        c.sizes.dedup();
        if let Some(bad) = c.sizes.iter().find(|s| !s.is_power_of_two() || **s < 4 * KIB || **s > MAP_BYTES) {
            return Err(format!("--sizes: {bad} bytes is not a power of two from 4 KiB to 16 MiB (a map output is 16 MiB)"));
        }
        if !c.mib.is_multiple_of(16) {
            return Err(format!("--mib {}: must be a multiple of 16 (map outputs of 16 MiB)", c.mib));
        }
        if c.netty_cp.is_empty() {
            return Err(format!(
                "--netty-cp is missing: the class path of benches/netty (scripts/bench-engine.sh builds it); usage: {USAGE}"
            ));
        }
        Ok(c)
    }

    fn maps(&self) -> usize {
        self.mib * MIB / MAP_BYTES
    }

    fn total_bytes(&self) -> u64 {
        (self.mib * MIB) as u64
    }
}

// ------------------------------------------------------------------------------ processes

fn get<'a>(kv: &'a [(String, String)], key: &str) -> R<&'a str> {
    kv.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str()).ok_or_else(|| format!("answer without '{key}'"))
}

fn get_f(kv: &[(String, String)], key: &str) -> R<f64> {
    let v = get(kv, key)?;
    v.parse::<f64>().map_err(|_| format!("'{key}={v}' is not a number"))
}

fn free_port() -> R<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("finding a free port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

// ------------------------------------------------------------------------------ data

/// Where each system finds one set of blocks.
#[derive(Clone, Debug)]
struct BlockSet {
    /// Engine shuffle id.
    shuffle_id: u32,
    /// Per map output: data file, index file.
    maps: Vec<(PathBuf, PathBuf)>,
    /// Blocks per map output.
    parts: usize,
    /// Block size.
    size: usize,
}

impl BlockSet {
    fn engine_files(&self) -> Vec<MapOutputFiles> {
        self.maps
            .iter()
            .enumerate()
            .map(|(m, (d, i))| MapOutputFiles {
                shuffle_id: self.shuffle_id,
                map_id: m as u64,
                data_path: d.clone(),
                index_path: i.clone(),
                num_partitions: Some(self.parts as u32),
            })
            .collect()
    }

    fn netty_specs(&self) -> Vec<String> {
        self.maps.iter().map(|(d, i)| format!("{}|{}|0|{}", d.display(), i.display(), self.parts)).collect()
    }

    fn engine_blocks(&self, map: usize) -> Vec<ShuffleBlock> {
        (0..self.parts as u32).map(|r| ShuffleBlock::single(self.shuffle_id, map as u64, r)).collect()
    }

    fn bytes(&self) -> u64 {
        (self.maps.len() * self.parts * self.size) as u64
    }
}

/// Writes the map outputs: `maps` data files of 16 MiB (one stream of pseudo-random bytes),
/// an index per block size over the same data files, and the small blocks' map output.
fn write_data(cfg: &Config, dir: &Path) -> R<(Vec<BlockSet>, BlockSet)> {
    let io = |what: String| move |e: std::io::Error| format!("{what}: {e}");
    let mut rng = TestRng::new(0x5eed);
    let mut buf = vec![0u8; MAP_BYTES];
    let mut data = Vec::new();
    for m in 0..cfg.maps() {
        rng.fill(&mut buf);
        let p = dir.join(format!("bulk_{m}.data"));
        std::fs::write(&p, &buf).map_err(io(format!("writing {}", p.display())))?;
        data.push(p);
    }
    let mut sets = Vec::new();
    for (k, &size) in cfg.sizes.iter().enumerate() {
        let parts = MAP_BYTES / size;
        let offsets: Vec<i64> = (0..=parts).map(|i| (i * size) as i64).collect();
        let mut maps = Vec::new();
        for (m, d) in data.iter().enumerate() {
            let i = dir.join(format!("bulk_{m}_{size}.index"));
            write_index(&i, &offsets).map_err(io(format!("writing {}", i.display())))?;
            maps.push((d.clone(), i));
        }
        sets.push(BlockSet { shuffle_id: SHUFFLE_BULK_BASE + k as u32, maps, parts, size });
    }
    let small = write_map_output(dir, SHUFFLE_SMALL, 0, &[SMALL; SMALL_PARTS], 99)
        .map_err(io(format!("writing the small blocks in {}", dir.display())))?;
    let small =
        BlockSet { shuffle_id: SHUFFLE_SMALL, maps: vec![(small.data_path, small.index_path)], parts: SMALL_PARTS, size: SMALL };
    for s in sets.iter().chain([&small]) {
        for (d, i) in &s.maps {
            for p in [d, i] {
                let t = p.display().to_string();
                if t.contains(' ') || t.contains('|') {
                    return Err(format!("{t}: the bench directory's path must hold no spaces or '|' (set --dir)"));
                }
            }
        }
    }
    Ok((sets, small))
}

// ------------------------------------------------------------------------------ engine server

fn engine_config(id: &str) -> EngineConfig {
    EngineConfig {
        transport: Transport::Tcp,
        bind_host: Ipv4Addr::LOCALHOST.into(),
        executor_id: id.into(),
        credits: SMALL_IN_FLIGHT,
        max_bytes_in_flight: BYTES_IN_FLIGHT as u64,
        ..EngineConfig::default()
    }
}

/// `engine-bench serve --manifest FILE`: an engine serving the map outputs listed in FILE
/// (lines `shuffle map partitions data index`); prints `ready <port>`, serves until its
/// standard input closes.
pub fn serve(args: &[String]) -> R<()> {
    let manifest = match args {
        [flag, path] if flag == "--manifest" => PathBuf::from(path),
        _ => return Err("usage: engine-bench serve --manifest FILE".into()),
    };
    let text = std::fs::read_to_string(&manifest).map_err(|e| format!("reading {}: {e}", manifest.display()))?;
    let engine = Engine::open(engine_config("bench-server")).map_err(|e| format!("opening the server's engine: {e}"))?;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let [s, m, p, d, i] = w[..] else { return Err(format!("{}: bad line '{line}'", manifest.display())) };
        let n = |v: &str| v.parse::<u64>().map_err(|_| format!("{}: '{v}' is not a number", manifest.display()));
        let files = MapOutputFiles {
            shuffle_id: n(s)? as u32,
            map_id: n(m)?,
            data_path: d.into(),
            index_path: i.into(),
            num_partitions: Some(n(p)? as u32),
        };
        engine.server().register(files).map_err(|e| format!("registering {line}: {e}"))?;
    }
    println!("ready {}", engine.server().local_addr().port());
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut sink = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    engine.shutdown();
    Ok(())
}

// ------------------------------------------------------------------------------ measurements

/// One timed transfer: seconds, bytes, CPU seconds of both processes.
#[derive(Clone, Copy, Debug)]
struct Transfer {
    secs: f64,
    bytes: u64,
    cpu: f64,
}

impl Transfer {
    fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.secs / 1e9
    }
    fn cpu_per_gib(&self) -> f64 {
        self.cpu / (self.bytes as f64 / GIB)
    }
}

struct EngineSide {
    engine: Engine,
    addr: SocketAddr,
    server_pid: u32,
}

impl EngineSide {
    fn cpu(&self) -> f64 {
        procfs::cpu_seconds(std::process::id()) + procfs::cpu_seconds(self.server_pid)
    }

    fn bulk(&self, set: &BlockSet) -> R<Transfer> {
        let cpu0 = self.cpu();
        let t = Instant::now();
        let w = Waiter::new(set.maps.len() * set.parts);
        for m in 0..set.maps.len() {
            self.engine.client().fetch(self.addr, &set.engine_blocks(m), w.clone());
        }
        let bytes = w.wait(STALL).map_err(|e| format!("engine, {} byte blocks: {e}", set.size))?;
        let secs = t.elapsed().as_secs_f64();
        if bytes != set.bytes() {
            return Err(format!("engine, {} byte blocks: moved {bytes} bytes, expected {}", set.size, set.bytes()));
        }
        Ok(Transfer { secs, bytes, cpu: self.cpu() - cpu0 })
    }

    fn small_rate(&self, set: &BlockSet, reps: usize) -> R<f64> {
        let blocks = set.engine_blocks(0);
        let t = Instant::now();
        for _ in 0..reps {
            let w = Waiter::new(blocks.len());
            self.engine.client().fetch(self.addr, &blocks, w.clone());
            let got = w.wait(STALL).map_err(|e| format!("engine, small blocks: {e}"))?;
            if got != set.bytes() {
                return Err(format!("engine, small blocks: moved {got} bytes, expected {}", set.bytes()));
            }
        }
        Ok((reps * blocks.len()) as f64 / t.elapsed().as_secs_f64())
    }

    fn latency(&self, set: &BlockSet, samples: usize) -> R<Vec<f64>> {
        let blocks = set.engine_blocks(0);
        let mut us = Vec::with_capacity(samples);
        for i in 0..samples {
            let b = &blocks[i % blocks.len()..i % blocks.len() + 1];
            let t = Instant::now();
            let w = Waiter::new(1);
            self.engine.client().fetch(self.addr, b, w.clone());
            let got = w.wait(STALL).map_err(|e| format!("engine, latency: {e}"))?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
            if got != SMALL as u64 {
                return Err(format!("engine, latency: a block of {got} bytes, expected {SMALL}"));
            }
        }
        Ok(us)
    }
}

struct NettySide {
    client: Proc,
    server: Proc,
    info: String,
}

impl NettySide {
    fn cpu(&self) -> f64 {
        procfs::cpu_seconds(self.client.pid()) + procfs::cpu_seconds(self.server.pid())
    }

    fn bulk(&mut self, set: &BlockSet) -> R<Transfer> {
        let window = (BYTES_IN_FLIGHT / set.size).max(1);
        let cmd = format!("bulk {window} {}", set.netty_specs().join(" "));
        let cpu0 = self.cpu();
        let kv = self.client.command(&cmd, STALL * 4)?;
        let cpu = self.cpu() - cpu0;
        let bytes = get_f(&kv, "bytes")? as u64;
        if bytes != set.bytes() {
            return Err(format!("Spark (Netty), {} byte blocks: moved {bytes} bytes, expected {}", set.size, set.bytes()));
        }
        Ok(Transfer { secs: get_f(&kv, "secs")?, bytes, cpu })
    }

    fn small_rate(&mut self, set: &BlockSet, reps: usize) -> R<f64> {
        let cmd = format!("window {SMALL_IN_FLIGHT} {reps} {}", set.netty_specs()[0]);
        let kv = self.client.command(&cmd, STALL * 4)?;
        let (blocks, bytes) = (get_f(&kv, "blocks")?, get_f(&kv, "bytes")? as u64);
        if bytes != set.bytes() * reps as u64 {
            return Err(format!("Spark (Netty), small blocks: moved {bytes} bytes, expected {}", set.bytes() * reps as u64));
        }
        Ok(blocks / get_f(&kv, "secs")?)
    }

    fn latency(&mut self, set: &BlockSet, samples: usize) -> R<Vec<f64>> {
        let kv = self.client.command(&format!("latency {samples} {}", set.netty_specs()[0]), STALL * 4)?;
        let us: Vec<f64> = get(&kv, "us")?.split(',').filter_map(|v| v.parse().ok()).collect();
        if us.len() != samples {
            return Err(format!("Spark (Netty), latency: {} samples, expected {samples}", us.len()));
        }
        Ok(us)
    }
}

/// iperf3's server, and a client run per measurement.
struct Iperf {
    bin: String,
    port: u16,
    _server: Proc,
}

impl Iperf {
    fn start(bin: &str) -> R<Iperf> {
        let port = free_port()?;
        let server = Proc::spawn(
            "iperf3 server",
            Command::new(bin).args(["-s", "-B", "127.0.0.1", "-p", &port.to_string()]).stdout(Stdio::null()),
        )?;
        Ok(Iperf { bin: bin.into(), port, _server: server })
    }

    /// Streams `bytes` in 1 MiB writes; returns the received rate in Gbit/s and both ends' CPU
    /// seconds (iperf3's own `cpu_utilization_percent`).
    fn run(&self, bytes: u64) -> R<(f64, f64)> {
        // The first run may find the server still starting, and a run right after another may
        // find it "busy running a test": a few attempts, a second apart.
        let mut last = String::new();
        for _attempt in 0..10 {
            let out = Command::new(&self.bin)
                .args(["-c", "127.0.0.1", "-p", &self.port.to_string(), "-l", "1M", "-n", &bytes.to_string(), "-J"])
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("running {}: {e}", self.bin))?;
            let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
            let rate = v.pointer("/end/sum_received/bits_per_second").and_then(Value::as_f64);
            let secs = v.pointer("/end/sum_received/seconds").and_then(Value::as_f64);
            let cpu = |k: &str| v.pointer(&format!("/end/cpu_utilization_percent/{k}")).and_then(Value::as_f64);
            if let (Some(rate), Some(secs), Some(h), Some(r)) = (rate, secs, cpu("host_total"), cpu("remote_total")) {
                return Ok((rate / 1e9, (h + r) / 100.0 * secs));
            }
            last = v.get("error").map(|e| e.to_string()).unwrap_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned());
            std::thread::sleep(Duration::from_secs(1));
        }
        Err(format!("iperf3 -c failed 10 times; last: {last}"))
    }
}

// ------------------------------------------------------------------------------ the run

/// One round's numbers.
#[derive(Debug, Default)]
struct Round {
    iperf3_gbps: f64,
    iperf3_cpu_per_gib: f64,
    /// Per block size: (engine, Spark).
    bulk: Vec<(Transfer, Transfer)>,
    engine_small: f64,
    netty_small: f64,
    engine_lat: Vec<f64>,
    netty_lat: Vec<f64>,
    order: &'static str,
}

fn run_round(
    cfg: &Config,
    r: usize,
    e: &EngineSide,
    n: &mut NettySide,
    ip: &Iperf,
    sets: &[BlockSet],
    small: &BlockSet,
) -> R<Round> {
    let engine_first = r % 2 == 1;
    let mut round = Round { order: if engine_first { "engine first" } else { "Spark first" }, ..Round::default() };
    let (g, cpu) = ip.run(cfg.total_bytes())?;
    round.iperf3_gbps = g;
    round.iperf3_cpu_per_gib = cpu / (cfg.total_bytes() as f64 / GIB);
    let min = cfg.min_secs;
    for set in sets {
        let (et, nt) = if engine_first {
            let et = repeat(min, || e.bulk(set))?;
            (et, repeat(min, || n.bulk(set))?)
        } else {
            let nt = repeat(min, || n.bulk(set))?;
            (repeat(min, || e.bulk(set))?, nt)
        };
        round.bulk.push((et, nt));
    }
    if engine_first {
        round.engine_small = e.small_rate(small, cfg.small_reps)?;
        round.netty_small = n.small_rate(small, cfg.small_reps)?;
        round.engine_lat = e.latency(small, cfg.lat_samples)?;
        round.netty_lat = n.latency(small, cfg.lat_samples)?;
    } else {
        round.netty_small = n.small_rate(small, cfg.small_reps)?;
        round.engine_small = e.small_rate(small, cfg.small_reps)?;
        round.netty_lat = n.latency(small, cfg.lat_samples)?;
        round.engine_lat = e.latency(small, cfg.lat_samples)?;
    }
    Ok(round)
}

/// Repeats a transfer until `min_secs` have passed in all, summing time, bytes and CPU.
fn repeat(min_secs: f64, mut transfer: impl FnMut() -> R<Transfer>) -> R<Transfer> {
    let mut all = transfer()?;
    while all.secs < min_secs {
        let t = transfer()?;
        all.secs += t.secs;
        all.bytes += t.bytes;
        all.cpu += t.cpu;
    }
    Ok(all)
}

fn spread_json(s: Option<Spread>) -> Value {
    match s {
        Some(s) => json!({"median": s.median, "min": s.min, "max": s.max}),
        None => Value::Null,
    }
}

fn human(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

/// Runs the comparison; prints progress on stderr, the table on stdout, writes the report.
pub fn run(args: &[String]) -> R<()> {
    let cfg = Config::from_args(args)?;
    let t0 = Instant::now();
    let dir = tempfile::tempdir_in(&cfg.dir).map_err(|e| format!("creating a directory in {}: {e}", cfg.dir.display()))?;
    eprintln!(
        "engine-bench: writing {} map outputs of 16 MiB (indexed for {} block sizes) and 1024 x 4 KiB in {}",
        cfg.maps(),
        cfg.sizes.len(),
        dir.path().display()
    );
    let (sets, small) = write_data(&cfg, dir.path())?;

    // The engine's server process.
    let manifest = dir.path().join("manifest");
    let mut m = String::new();
    for set in sets.iter().chain([&small]) {
        for f in set.engine_files() {
            m += &format!("{} {} {} {} {}\n", f.shuffle_id, f.map_id, set.parts, f.data_path.display(), f.index_path.display());
        }
    }
    std::fs::write(&manifest, m).map_err(|e| format!("writing {}: {e}", manifest.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut engine_server =
        Proc::spawn("engine server", Command::new(&exe).args(["serve", "--manifest", &manifest.display().to_string()]))?;
    let port = engine_server
        .ready(Duration::from_secs(60))?
        .first()
        .and_then(|p| p.parse::<u16>().ok())
        .ok_or("engine server: no port")?;
    let engine = Engine::open(engine_config("bench-client")).map_err(|e| format!("opening the client's engine: {e}"))?;
    let e = EngineSide { engine, addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)), server_pid: engine_server.pid() };

    // Spark's transfer: two JVMs.
    let java = |mode: &[&str]| {
        let mut c = Command::new(&cfg.java);
        c.args(&cfg.jvm_opts).args(["-cp", &cfg.netty_cp, "rdmashuffle.bench.NettyBlockBench"]).args(mode);
        c
    };
    let mut netty_server = Proc::spawn("Spark (Netty) server JVM", &mut java(&["server"]))?;
    let words = netty_server.ready(Duration::from_secs(120))?;
    let nport = words.first().cloned().ok_or("Spark (Netty) server: no port")?;
    let mut netty_client = Proc::spawn("Spark (Netty) client JVM", &mut java(&["client", &nport]))?;
    let cwords = netty_client.ready(Duration::from_secs(120))?;
    let info = format!("server {}; client {}", words[1..].join(" "), cwords.join(" "));
    let mut n = NettySide { client: netty_client, server: netty_server, info };
    let ip = Iperf::start(&cfg.iperf3)?;
    eprintln!("engine-bench: Spark {} block transfer ({}); iperf3 on port {}", cfg.spark_version, n.info, ip.port);

    // Warm-up: whole rounds, not recorded: connections, page cache, pools, and above all the
    // JVMs' JIT (Spark's transfer runs several times faster once C2 has compiled it, as it is
    // in an executor that has been running for a while).
    for w in 1..=cfg.warmup {
        let t = Instant::now();
        run_round(&cfg, w, &e, &mut n, &ip, &sets, &small)?;
        eprintln!("engine-bench: warm-up round {w}/{} {:.1} s", cfg.warmup, t.elapsed().as_secs_f64());
    }

    let mb = sets.iter().position(|s| s.size == MIB).expect("1 MiB is always measured");
    let mut rounds = Vec::new();
    for r in 1..=cfg.rounds {
        let t = Instant::now();
        let round = run_round(&cfg, r, &e, &mut n, &ip, &sets, &small)?;
        let (et, nt) = round.bulk[mb];
        eprintln!(
            "engine-bench: round {r}/{} ({}, {:.1} s): 1 MiB Gbit/s iperf3 {:.2} Spark {:.2} engine {:.2} | 4 KiB/s Spark {:.0} engine {:.0} | p50 us Spark {:.0} engine {:.0}",
            cfg.rounds,
            round.order,
            t.elapsed().as_secs_f64(),
            round.iperf3_gbps,
            nt.gbps(),
            et.gbps(),
            round.netty_small,
            round.engine_small,
            percentile(&round.netty_lat, 0.5).unwrap_or(0.0),
            percentile(&round.engine_lat, 0.5).unwrap_or(0.0),
        );
        rounds.push(round);
    }
    e.engine.shutdown();
    drop(n);
    drop(engine_server);

    let report = report(&cfg, &rounds, &sets, mb, t0.elapsed().as_secs_f64());
    print!("{}", table(&cfg, &report));
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n";
    match &cfg.out {
        Some(out) => {
            if let Some(p) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(p).map_err(|e| format!("creating {}: {e}", p.display()))?;
            }
            std::fs::write(out, text).map_err(|e| format!("writing {}: {e}", out.display()))?;
            println!("wrote {}", out.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// Median over rounds of `f`.
fn med(rounds: &[Round], f: impl Fn(&Round) -> f64) -> Option<Spread> {
    Spread::of(&rounds.iter().map(f).collect::<Vec<_>>())
}

fn report(cfg: &Config, rounds: &[Round], sets: &[BlockSet], mb: usize, secs: f64) -> Value {
    let p = |v: &[f64], q: f64| percentile(v, q).unwrap_or(f64::NAN);
    let m = |f: &dyn Fn(&Round) -> f64| med(rounds, f);
    let v = |s: Option<Spread>| s.map(|s| s.median).unwrap_or(f64::NAN);
    let iperf3 = m(&|r| r.iperf3_gbps);
    let engine = m(&|r| r.bulk[mb].0.gbps());
    let netty = m(&|r| r.bulk[mb].1.gbps());
    let ratio_iperf3 = m(&|r| r.bulk[mb].0.gbps() / r.iperf3_gbps);
    let ratio_netty = m(&|r| r.bulk[mb].0.gbps() / r.bulk[mb].1.gbps());
    let small = m(&|r| r.engine_small);
    let nsmall = m(&|r| r.netty_small);
    let p50 = m(&|r| p(&r.engine_lat, 0.5));
    let p99 = m(&|r| p(&r.engine_lat, 0.99));
    let np50 = m(&|r| p(&r.netty_lat, 0.5));
    let np99 = m(&|r| p(&r.netty_lat, 0.99));
    let cpu_e = m(&|r| r.bulk[mb].0.cpu_per_gib());
    let cpu_n = m(&|r| r.bulk[mb].1.cpu_per_gib());
    let cpu_i = m(&|r| r.iperf3_cpu_per_gib);
    // Targets of issue 13, as per-round ratios (both sides measured next to each other).
    let small_x = m(&|r| r.engine_small / r.netty_small);
    let p50_x = m(&|r| p(&r.engine_lat, 0.5) / p(&r.netty_lat, 0.5));
    let p99_x = m(&|r| p(&r.engine_lat, 0.99) / p(&r.netty_lat, 0.99));
    let cpu_x = m(&|r| r.bulk[mb].0.cpu_per_gib() / r.bulk[mb].1.cpu_per_gib());
    let target = |what: &str, value: f64, goal: f64, at_least: bool| {
        json!({"target": what, "value": value, "goal": goal,
               "met": if at_least { value >= goal } else { value <= goal }})
    };
    let sizes: Vec<Value> = sets
        .iter()
        .enumerate()
        .map(|(k, s)| {
            json!({
                "bytes": s.size,
                "blocks": s.maps.len() * s.parts,
                "engine_gbps": v(m(&|r| r.bulk[k].0.gbps())),
                "netty_gbps": v(m(&|r| r.bulk[k].1.gbps())),
                "engine_cpu_s_per_gib": v(m(&|r| r.bulk[k].0.cpu_per_gib())),
                "netty_cpu_s_per_gib": v(m(&|r| r.bulk[k].1.cpu_per_gib())),
                "engine_gbps_spread": spread_json(m(&|r| r.bulk[k].0.gbps())),
                "netty_gbps_spread": spread_json(m(&|r| r.bulk[k].1.gbps())),
                "engine_gbps_rounds": rounds.iter().map(|r| r.bulk[k].0.gbps()).collect::<Vec<_>>(),
                "netty_gbps_rounds": rounds.iter().map(|r| r.bulk[k].1.gbps()).collect::<Vec<_>>(),
            })
        })
        .collect();
    let per_round: Vec<Value> = rounds
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({
                "round": i + 1,
                "order": r.order,
                "iperf3_gbps": r.iperf3_gbps,
                "netty_gbps": r.bulk[mb].1.gbps(),
                "engine_gbps": r.bulk[mb].0.gbps(),
                "small_blocks_per_s": r.engine_small,
                "netty_small_blocks_per_s": r.netty_small,
                "small_p50_us": p(&r.engine_lat, 0.5),
                "small_p99_us": p(&r.engine_lat, 0.99),
                "netty_small_p50_us": p(&r.netty_lat, 0.5),
                "netty_small_p99_us": p(&r.netty_lat, 0.99),
                "cpu_s_per_gib_engine": r.bulk[mb].0.cpu_per_gib(),
                "cpu_s_per_gib_netty": r.bulk[mb].1.cpu_per_gib(),
                "cpu_s_per_gib_iperf3": r.iperf3_cpu_per_gib,
            })
        })
        .collect();
    json!({
        "provider": "tcp",
        "what": "loopback, two processes per system; medians over interleaved rounds (engine first in odd rounds, Spark first in even), ranges in `spread`, raw values in `rounds`",
        "spark_version": cfg.spark_version,
        "netty": "spark-network-common TransportServer + OneForOneStreamManager serving FileSegmentManagedBuffer, TransportClient.fetchChunk, two JVMs",
        "iperf3": "iperf3 -l 1M -n <bytes>, one stream, loopback",
        "bytes_per_measurement": cfg.total_bytes(),
        "block_bytes": MIB,
        "bytes_in_flight": BYTES_IN_FLIGHT,
        "small_block_bytes": SMALL,
        "small_in_flight": SMALL_IN_FLIGHT,
        "small_blocks_per_round": cfg.small_reps * SMALL_PARTS,
        "latency_samples_per_round": cfg.lat_samples,
        "rounds_timed": rounds.len(),
        "warmup_rounds": cfg.warmup,
        "seconds": secs,
        "iperf3_gbps": v(iperf3),
        "netty_gbps": v(netty),
        "engine_gbps": v(engine),
        "ratio_vs_iperf3": v(ratio_iperf3),
        "ratio_vs_netty": v(ratio_netty),
        "small_blocks_per_s": v(small),
        "netty_small_blocks_per_s": v(nsmall),
        "small_p50_us": v(p50),
        "small_p99_us": v(p99),
        "netty_small_p50_us": v(np50),
        "netty_small_p99_us": v(np99),
        "cpu_s_per_gib_engine": v(cpu_e),
        "cpu_s_per_gib_netty": v(cpu_n),
        "cpu_s_per_gib_iperf3": v(cpu_i),
        "spread": {
            "iperf3_gbps": spread_json(iperf3), "netty_gbps": spread_json(netty), "engine_gbps": spread_json(engine),
            "ratio_vs_iperf3": spread_json(ratio_iperf3), "ratio_vs_netty": spread_json(ratio_netty),
            "small_blocks_per_s": spread_json(small), "netty_small_blocks_per_s": spread_json(nsmall),
            "small_p50_us": spread_json(p50), "small_p99_us": spread_json(p99),
            "netty_small_p50_us": spread_json(np50), "netty_small_p99_us": spread_json(np99),
            "cpu_s_per_gib_engine": spread_json(cpu_e), "cpu_s_per_gib_netty": spread_json(cpu_n),
        },
        "targets": [
            target("1 MiB blocks >= 0.95 x iperf3", v(ratio_iperf3), 0.95, true),
            target("4 KiB blocks/s >= 3 x Spark's", v(small_x), 3.0, true),
            target("4 KiB p50 <= 1/3 of Spark's", v(p50_x), 1.0 / 3.0, false),
            target("4 KiB p99 <= 1/3 of Spark's", v(p99_x), 1.0 / 3.0, false),
            target("CPU per GiB <= 0.5 x Spark's", v(cpu_x), 0.5, false),
        ],
        "sizes": sizes,
        "rounds": per_round,
    })
}

/// `median [min..max]` of a spread in the report, with `prec` decimals.
fn cell(x: &Value, prec: usize) -> String {
    let g = |k: &str| x[k].as_f64().unwrap_or(f64::NAN);
    if x.is_null() {
        return String::new();
    }
    format!("{:.*} [{:.*}..{:.*}]", prec, g("median"), prec, g("min"), prec, g("max"))
}

fn table(cfg: &Config, r: &Value) -> String {
    let sp = |k: &str, prec: usize| cell(&r["spread"][k], prec);
    let mut o = String::new();
    o += &format!(
        "engine vs Spark's block transfer (spark-network-common {}) vs iperf3 -l 1M, loopback tcp, {} MiB per \
         measurement, {} rounds interleaved; median [min..max] over rounds\n",
        cfg.spark_version, cfg.mib, r["rounds_timed"]
    );
    let line = |o: &mut String, name: &str, a: String, b: String, c: String| {
        *o += &format!("  {name:<30} {a:>24} {b:>26} {c:>26}\n");
    };
    line(&mut o, "", "iperf3".into(), "Spark (Netty)".into(), "engine".into());
    for z in r["sizes"].as_array().into_iter().flatten() {
        let b = z["bytes"].as_u64().unwrap_or(0) as usize;
        let ip = if b == MIB { sp("iperf3_gbps", 2) } else { String::new() };
        let name = format!("Gbit/s, {} blocks", human(b));
        line(&mut o, &name, ip, cell(&z["netty_gbps_spread"], 2), cell(&z["engine_gbps_spread"], 2));
    }
    line(&mut o, "4 KiB blocks/s, 64 in flight", String::new(), sp("netty_small_blocks_per_s", 0), sp("small_blocks_per_s", 0));
    line(&mut o, "4 KiB one at a time, p50 us", String::new(), sp("netty_small_p50_us", 0), sp("small_p50_us", 0));
    line(&mut o, "4 KiB one at a time, p99 us", String::new(), sp("netty_small_p99_us", 0), sp("small_p99_us", 0));
    line(
        &mut o,
        "CPU s/GiB (1 MiB, both procs)",
        format!("{:.3}", r["cpu_s_per_gib_iperf3"].as_f64().unwrap_or(f64::NAN)),
        sp("cpu_s_per_gib_netty", 3),
        sp("cpu_s_per_gib_engine", 3),
    );
    o += "targets (issue 13), median of the per-round ratios; reported, not asserted:\n";
    for t in r["targets"].as_array().into_iter().flatten() {
        o += &format!(
            "  {:<34} {:>8.3}  {}\n",
            t["target"].as_str().unwrap_or(""),
            t["value"].as_f64().unwrap_or(f64::NAN),
            if t["met"].as_bool() == Some(true) { "met" } else { "NOT met" }
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn arguments_are_checked_and_1m_is_always_measured() {
        let c = Config::from_args(&args("--netty-cp x --sizes 64k,4m --mib 32 --rounds 2")).unwrap();
        assert_eq!(c.sizes, vec![64 * KIB, MIB, 4 * MIB]);
        assert_eq!((c.maps(), c.total_bytes(), c.rounds), (2, 32 << 20, 2));
        assert_eq!(Config::from_args(&args("--netty-cp x --gib 1")).unwrap().mib, 1024);
        for bad in ["--sizes 3k", "--sizes 32m", "--sizes 2k", "--mib 20", "--rounds 0", "--bogus 1", "--mib"] {
            let e = Config::from_args(&args(&format!("--netty-cp x {bad}"))).unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
        let e = Config::from_args(&args("--mib 16")).unwrap_err();
        assert!(e.contains("--netty-cp"), "{e}");
    }

    /// `--tiny` used to exit 1: a 32 MiB transfer took less than one clock tick of CPU, the
    /// CPU ratio was 0/0. A measurement now repeats until it ran `min_secs`.
    #[test]
    fn a_short_transfer_repeats_until_the_window_is_long_enough_for_cpu_ticks() {
        let mut calls = 0;
        let t = repeat(0.5, || {
            calls += 1;
            Ok(Transfer { secs: 0.12, bytes: 32 << 20, cpu: if calls % 2 == 0 { 0.01 } else { 0.0 } })
        })
        .unwrap();
        assert_eq!(calls, 5, "0.12 s transfers until 0.5 s: five");
        assert_eq!(t.bytes, 5 * (32 << 20));
        assert!((t.secs - 0.6).abs() < 1e-9 && (t.cpu - 0.02).abs() < 1e-9 && t.cpu_per_gib() > 0.0, "{t:?}");
        assert_eq!(Config::from_args(&args("--netty-cp x --min-secs 0")).unwrap().min_secs, 0.0);
        assert!(Config::from_args(&args("--netty-cp x --min-secs -1")).is_err());
    }

    #[test]
    fn the_report_has_every_key_and_the_targets_compare_the_right_way() {
        let cfg = Config::from_args(&args("--netty-cp x --sizes 1m --mib 16 --rounds 2")).unwrap();
        let t = |gbps: f64, cpu: f64| Transfer { secs: 8.0 * 16.0 * MIB as f64 / gbps / 1e9, bytes: (16 * MIB) as u64, cpu };
        let round = |k: f64| Round {
            iperf3_gbps: 20.0 * k,
            iperf3_cpu_per_gib: 0.5,
            bulk: vec![(t(19.5 * k, 0.01), t(10.0 * k, 0.04))],
            engine_small: 300_000.0,
            netty_small: 50_000.0,
            engine_lat: vec![10.0; 100],
            netty_lat: vec![40.0; 100],
            order: "engine first",
        };
        let sets = vec![BlockSet { shuffle_id: 100, maps: vec![("d".into(), "i".into())], parts: 16, size: MIB }];
        let r = report(&cfg, &[round(1.0), round(2.0)], &sets, 0, 1.0);
        for k in [
            "iperf3_gbps",
            "netty_gbps",
            "engine_gbps",
            "ratio_vs_iperf3",
            "small_blocks_per_s",
            "netty_small_blocks_per_s",
            "small_p50_us",
            "small_p99_us",
            "netty_small_p50_us",
            "netty_small_p99_us",
            "cpu_s_per_gib_engine",
            "cpu_s_per_gib_netty",
        ] {
            let x = r[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {r}"));
            assert!(x.is_finite() && x > 0.0, "{k} = {x}");
        }
        assert!((r["iperf3_gbps"].as_f64().unwrap() - 30.0).abs() < 1e-9, "median of 20 and 40");
        assert!((r["ratio_vs_iperf3"].as_f64().unwrap() - 0.975).abs() < 1e-9);
        assert!((r["cpu_s_per_gib_engine"].as_f64().unwrap() - 0.01 * 64.0).abs() < 1e-9, "16 MiB is 1/64 GiB");
        let met: Vec<bool> = r["targets"].as_array().unwrap().iter().map(|t| t["met"].as_bool().unwrap()).collect();
        // 0.975 >= 0.95; 6x >= 3x; 0.25 <= 1/3 twice; 0.25 <= 0.5.
        assert_eq!(met, vec![true, true, true, true, true]);
        assert_eq!(r["rounds"].as_array().unwrap().len(), 2);
        assert_eq!(r["sizes"][0]["engine_gbps_rounds"].as_array().unwrap().len(), 2);
        let tab = table(&cfg, &r);
        assert!(tab.contains("1 MiB") && !tab.contains("NOT met") && tab.contains("iperf3"), "{tab}");
    }
}
