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
//!   API;
//! * with `--ofi-provider P` (a build with the `ofi` feature), **the engine over libfabric**:
//!   the same two processes again with `transport=ofi` on libfabric's provider P (e.g.
//!   `tcp;ofi_rxm`), its own server process and client engine, measured in the same rounds
//!   right after the tcp engine in odd rounds and right before it in even ones.
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
//! the context switches and CPU migrations of both processes of each system per 1,000 small
//! blocks, and each target of issues 13 and 21 with the value reached (reported, never
//! asserted).
//!
//! Layout: [`data`] writes the map outputs, [`server`] is the engine server process
//! (`engine-bench serve`), [`measure`] times each system, [`report`] builds the JSON report and
//! the table; this module holds the settings and runs the rounds.

mod data;
mod measure;
mod probe;
mod profile;
mod report;
mod server;

use rdma_shuffle_bench::procfs::{self, Sched};
use rdma_shuffle_bench::{parse_size, percentile, Proc};
use rdma_shuffle_shuffle::Engine;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use data::{write_data, BlockSet};
use measure::{EngineSide, Iperf, NettySide, Transfer};
pub use probe::probe;
pub use profile::profile;
use report::{report, table};
use server::engine_config;
pub use server::serve;

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
    [--mib N] [--sizes 4k,16k,64k,256k,1m,4m] [--rounds N] [--warmup N] [--small-reps N] [--lat-samples N] [--dir DIR] [--out FILE]
    [--spark-version V] [--min-secs S (0.5: each bulk measurement repeats its transfer until it ran this long)]
    [--ofi-provider P (the engine over libfabric's provider P too, e.g. 'tcp;ofi_rxm'; needs the ofi feature)]";

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
    /// Also the engine over the libfabric provider `ofi` on this libfabric provider.
    pub ofi_provider: Option<String>,
}

impl Config {
    /// Parses the words after `run`.
    pub fn from_args(args: &[String]) -> R<Config> {
        let mut c = Config {
            mib: 1024,
            sizes: vec![4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB],
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
            ofi_provider: None,
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
                "--ofi-provider" => c.ofi_provider = Some(value()?),
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
    /// Scheduler counts of both processes of each system during its small-block runs:
    /// (blocks/s run, latency run).
    engine_sched: (Sched, Sched),
    netty_sched: (Sched, Sched),
    order: &'static str,
    /// The engine over libfabric (`--ofi-provider`), when asked for.
    ofi: Option<OfiRound>,
}

/// One round's numbers of the engine over libfabric: as the tcp engine's, per block size.
#[derive(Debug, Default)]
struct OfiRound {
    bulk: Vec<Transfer>,
    small: f64,
    lat: Vec<f64>,
}

/// Runs `f`, returning its result and what the scheduler did to `pids` meanwhile.
fn counted<T>(pids: [u32; 2], f: impl FnOnce() -> R<T>) -> R<(T, Sched)> {
    let s = || {
        let (a, b) = (procfs::sched(pids[0]), procfs::sched(pids[1]));
        Sched { switches: a.switches + b.switches, migrations: a.migrations + b.migrations }
    };
    let before = s();
    let v = f()?;
    Ok((v, s().since(before)))
}

#[allow(clippy::too_many_arguments)]
fn run_round(
    cfg: &Config,
    r: usize,
    e: &EngineSide,
    o: Option<&EngineSide>,
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
    // The engine over libfabric sits between the tcp engine and Spark in either order.
    let mut ofi = o.map(|_| OfiRound::default());
    for set in sets {
        let (et, nt) = if engine_first {
            let et = repeat(min, || e.bulk(set))?;
            if let (Some(o), Some(or)) = (o, ofi.as_mut()) {
                or.bulk.push(repeat(min, || o.bulk(set))?);
            }
            (et, repeat(min, || n.bulk(set))?)
        } else {
            let nt = repeat(min, || n.bulk(set))?;
            if let (Some(o), Some(or)) = (o, ofi.as_mut()) {
                or.bulk.push(repeat(min, || o.bulk(set))?);
            }
            (repeat(min, || e.bulk(set))?, nt)
        };
        round.bulk.push((et, nt));
    }
    if let (Some(o), Some(or)) = (o, ofi.as_mut()) {
        or.small = o.small_rate(small, cfg.small_reps)?;
        or.lat = o.latency(small, cfg.lat_samples)?;
    }
    round.ofi = ofi;
    let (ep, np) = (e.pids(), n.pids());
    let (es, ns, el, nl);
    if engine_first {
        es = counted(ep, || e.small_rate(small, cfg.small_reps))?;
        ns = counted(np, || n.small_rate(small, cfg.small_reps))?;
        el = counted(ep, || e.latency(small, cfg.lat_samples))?;
        nl = counted(np, || n.latency(small, cfg.lat_samples))?;
    } else {
        ns = counted(np, || n.small_rate(small, cfg.small_reps))?;
        es = counted(ep, || e.small_rate(small, cfg.small_reps))?;
        nl = counted(np, || n.latency(small, cfg.lat_samples))?;
        el = counted(ep, || e.latency(small, cfg.lat_samples))?;
    }
    (round.engine_small, round.netty_small, round.engine_lat, round.netty_lat) = (es.0, ns.0, el.0, nl.0);
    round.engine_sched = (es.1, el.1);
    round.netty_sched = (ns.1, nl.1);
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

/// Starts the engine's server process (`engine-bench serve`) serving `sets` and opens the
/// client's engine in this process.
fn engine_pair<'a>(
    dir: &std::path::Path,
    sets: impl Iterator<Item = &'a BlockSet>,
    spin: Option<Duration>,
    ofi: Option<&str>,
) -> R<(Proc, EngineSide)> {
    let manifest = dir.join("manifest");
    let mut m = String::new();
    for set in sets {
        for f in set.engine_files() {
            m += &format!("{} {} {} {} {}\n", f.shuffle_id, f.map_id, set.parts, f.data_path.display(), f.index_path.display());
        }
    }
    std::fs::write(&manifest, m).map_err(|e| format!("writing {}: {e}", manifest.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // ENGINE_BENCH_SERVER_PREFIX runs the server under a tool (e.g. `valgrind
    // --tool=callgrind`: instruction counts of the server, which no load distorts).
    let prefix: Vec<String> =
        std::env::var("ENGINE_BENCH_SERVER_PREFIX").unwrap_or_default().split_whitespace().map(String::from).collect();
    let mut cmd = match prefix.split_first() {
        Some((tool, args)) => {
            let mut c = Command::new(tool);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(["serve", "--manifest", &manifest.display().to_string()]);
    if let Some(s) = spin {
        cmd.args(["--spin-us", &s.as_micros().to_string()]);
    }
    if let Some(p) = ofi {
        cmd.args(["--ofi-provider", p]);
    }
    let mut server = Proc::spawn(if ofi.is_some() { "engine server (ofi)" } else { "engine server" }, &mut cmd)?;
    let port =
        server.ready(Duration::from_secs(600))?.first().and_then(|p| p.parse::<u16>().ok()).ok_or("engine server: no port")?;
    let engine =
        Engine::open(engine_config("bench-client", spin, ofi)).map_err(|e| format!("opening the client's engine: {e}"))?;
    let side = EngineSide { engine, addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)), server_pid: server.pid() };
    Ok((server, side))
}

/// Starts Spark's block transfer: its server JVM, then its client JVM connected to it.
fn netty_pair(cfg: &Config) -> R<NettySide> {
    let java = |mode: &[&str]| {
        let mut c = Command::new(&cfg.java);
        c.args(&cfg.jvm_opts).args(["-cp", &cfg.netty_cp, "rdmashuffle.bench.NettyBlockBench"]).args(mode);
        c
    };
    let mut server = Proc::spawn("Spark (Netty) server JVM", &mut java(&["server"]))?;
    let words = server.ready(Duration::from_secs(120))?;
    let port = words.first().cloned().ok_or("Spark (Netty) server: no port")?;
    let mut client = Proc::spawn("Spark (Netty) client JVM", &mut java(&["client", &port]))?;
    let cwords = client.ready(Duration::from_secs(120))?;
    let info = format!("server {}; client {}", words[1..].join(" "), cwords.join(" "));
    Ok(NettySide { client, server, info })
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

    let (engine_server, e) = engine_pair(dir.path(), sets.iter().chain([&small]), None, None)?;
    let ofi = match cfg.ofi_provider.as_deref() {
        Some(p) => Some(engine_pair(dir.path(), sets.iter().chain([&small]), None, Some(p))?),
        None => None,
    };
    let o = ofi.as_ref().map(|(_, side)| side);

    let mut n = netty_pair(&cfg)?;
    let ip = Iperf::start(&cfg.iperf3)?;
    eprintln!("engine-bench: Spark {} block transfer ({}); iperf3 on port {}", cfg.spark_version, n.info, ip.port);

    // Warm-up: whole rounds, not recorded: connections, page cache, pools, and above all the
    // JVMs' JIT (Spark's transfer runs several times faster once C2 has compiled it, as it is
    // in an executor that has been running for a while).
    for w in 1..=cfg.warmup {
        let t = Instant::now();
        run_round(&cfg, w, &e, o, &mut n, &ip, &sets, &small)?;
        eprintln!("engine-bench: warm-up round {w}/{} {:.1} s", cfg.warmup, t.elapsed().as_secs_f64());
    }

    let mb = sets.iter().position(|s| s.size == MIB).expect("1 MiB is always measured");
    let mut rounds = Vec::new();
    for r in 1..=cfg.rounds {
        let t = Instant::now();
        let round = run_round(&cfg, r, &e, o, &mut n, &ip, &sets, &small)?;
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
        if let Some(or) = &round.ofi {
            eprintln!(
                "engine-bench: round {r}/{}: engine over ofi ({}): 1 MiB Gbit/s {:.2} | 4 KiB/s {:.0} | p50 us {:.0}",
                cfg.rounds,
                cfg.ofi_provider.as_deref().unwrap_or(""),
                or.bulk[mb].gbps(),
                or.small,
                percentile(&or.lat, 0.5).unwrap_or(0.0),
            );
        }
        rounds.push(round);
    }
    e.engine.shutdown();
    if let Some((server, side)) = ofi {
        side.engine.shutdown();
        drop(server);
    }
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
}
