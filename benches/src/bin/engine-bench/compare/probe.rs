//! `engine-bench probe`: the engine alone, 4 KiB blocks, counting what the scheduler does.
//!
//! A quick look at the small-block path without the JVMs and iperf3 of `run`: the engine's
//! server process and a client engine in this process, rounds of one-at-a-time fetches
//! (p50/p99) and of 1024-block fetches with the server's 64 credits in flight (blocks/s), each
//! with the context switches and CPU migrations of both processes per 1,000 blocks (from
//! `/proc/PID/task/*/sched`: the events perf's `context-switches` and `cpu-migrations` count).
//! Then both processes sit idle for `--idle-secs` and their CPU time over that wait is
//! reported: an idle engine must use next to none. With `--perf-record FILE`, `perf record -g`
//! samples both processes during the timed rounds (for a flame graph).

use rdma_shuffle_bench::procfs::{self, Sched};
use rdma_shuffle_bench::{percentile, Spread};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::data::{write_small, BlockSet};
use super::measure::EngineSide;
use super::{engine_pair, R};

const USAGE: &str = "engine-bench probe [--rounds N (5)] [--lat-samples N (2000)] [--small-reps N (20)] \
    [--idle-secs S (10)] [--spin-us N (the engine's default)] [--perf-record FILE] [--dir DIR] [--out FILE]";

struct Args {
    rounds: usize,
    lat_samples: usize,
    small_reps: usize,
    idle_secs: f64,
    spin: Option<Duration>,
    perf_record: Option<PathBuf>,
    dir: PathBuf,
    out: Option<PathBuf>,
}

fn parse(args: &[String]) -> R<Args> {
    let mut a = Args {
        rounds: 5,
        lat_samples: 2000,
        small_reps: 20,
        idle_secs: 10.0,
        spin: None,
        perf_record: None,
        dir: std::env::var_os("BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir),
        out: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(|| format!("{flag} needs a value; usage: {USAGE}"))?;
        let count =
            || v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| format!("{flag}: '{v}' is not a positive integer"));
        match flag.as_str() {
            "--rounds" => a.rounds = count()?,
            "--lat-samples" => a.lat_samples = count()?,
            "--small-reps" => a.small_reps = count()?,
            "--idle-secs" => {
                a.idle_secs = v.parse().ok().filter(|x: &f64| x.is_finite() && *x >= 0.0).ok_or(format!("{flag}: '{v}'"))?
            }
            "--spin-us" => {
                a.spin = Some(Duration::from_micros(v.parse().map_err(|_| format!("{flag}: '{v}' is not a number of µs"))?))
            }
            "--perf-record" => a.perf_record = Some(PathBuf::from(v)),
            "--dir" => a.dir = PathBuf::from(v),
            "--out" => a.out = Some(PathBuf::from(v)),
            other => return Err(format!("unknown argument '{other}'; usage: {USAGE}")),
        }
    }
    Ok(a)
}

/// Scheduler counts of both engine processes.
fn sched(e: &EngineSide) -> Sched {
    let (c, s) = (procfs::sched(std::process::id()), procfs::sched(e.server_pid));
    Sched { switches: c.switches + s.switches, migrations: c.migrations + s.migrations }
}

fn per_1000(s: Sched, blocks: usize) -> (f64, f64) {
    let k = 1000.0 / blocks as f64;
    (s.switches as f64 * k, s.migrations as f64 * k)
}

fn spread(v: &[f64]) -> Value {
    match Spread::of(v) {
        Some(s) => json!({"median": s.median, "min": s.min, "max": s.max}),
        None => Value::Null,
    }
}

/// Runs the probe; prints one line per round and the summary, writes the JSON report.
pub fn probe(args: &[String]) -> R<()> {
    let a = parse(args)?;
    let dir = tempfile::tempdir_in(&a.dir).map_err(|e| format!("creating a directory in {}: {e}", a.dir.display()))?;
    let small: BlockSet = write_small(dir.path())?;
    let (server, e) = engine_pair(dir.path(), [&small].into_iter(), a.spin, None)?;
    // Warm-up: the connection, the pool's buffers, the page cache.
    e.latency(&small, 200)?;
    e.small_rate(&small, 2)?;

    let perf = match &a.perf_record {
        Some(out) => {
            let pids = format!("{},{}", std::process::id(), e.server_pid);
            let child = Command::new("perf")
                .args(["record", "-F", "1999", "-g", "-o", &out.display().to_string(), "-p", &pids])
                .stdout(Stdio::null())
                .spawn()
                .map_err(|err| format!("starting perf record (Debian's linux-perf): {err}"))?;
            // perf needs a moment to attach to every thread.
            std::thread::sleep(Duration::from_millis(500));
            Some(child)
        }
        None => None,
    };

    let (mut p50, mut p99, mut rate) = (Vec::new(), Vec::new(), Vec::new());
    let (mut lat_cs, mut lat_mig, mut win_cs, mut win_mig) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 1..=a.rounds {
        let s0 = sched(&e);
        let us = e.latency(&small, a.lat_samples)?;
        let (cs, mig) = per_1000(sched(&e).since(s0), a.lat_samples);
        let q = |x| percentile(&us, x).unwrap_or(f64::NAN);
        p50.push(q(0.5));
        p99.push(q(0.99));
        lat_cs.push(cs);
        lat_mig.push(mig);
        let s0 = sched(&e);
        let bps = e.small_rate(&small, a.small_reps)?;
        let (wcs, wmig) = per_1000(sched(&e).since(s0), a.small_reps * small.parts);
        rate.push(bps);
        win_cs.push(wcs);
        win_mig.push(wmig);
        eprintln!(
            "engine-bench probe: round {r}/{}: one at a time p50 {:.1} us p99 {:.1} us, {cs:.0} switches {mig:.0} migrations \
             per 1000 | 64 in flight {bps:.0} blocks/s, {wcs:.0} switches {wmig:.0} migrations per 1000",
            a.rounds,
            q(0.5),
            q(0.99)
        );
    }
    if let Some(mut child) = perf {
        // SAFETY: kill(2) with a child's pid has no memory-safety preconditions.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let _ = child.wait();
    }

    // Idle: connections stay open (the idle timeout is 120 s), nothing is asked.
    let cpu = || procfs::cpu_seconds(std::process::id()) + procfs::cpu_seconds(e.server_pid);
    let (cpu0, s0, t0) = (cpu(), sched(&e), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(a.idle_secs));
    let idle_secs = t0.elapsed().as_secs_f64();
    let (idle_cpu, idle_sched) = (cpu() - cpu0, sched(&e).since(s0));
    let idle_threads = procfs::footprint(std::process::id()).map(|f| f.threads).unwrap_or(0)
        + procfs::footprint(e.server_pid).map(|f| f.threads).unwrap_or(0);
    e.engine.shutdown();
    drop(server);

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let report = json!({
        "what": "the engine alone (tcp, loopback, two processes), 4 KiB blocks; scheduler counts of both processes \
                 from /proc/PID/task/*/sched; medians over rounds with ranges",
        "rounds": a.rounds,
        "latency_samples_per_round": a.lat_samples,
        "small_blocks_per_round": a.small_reps * small.parts,
        "loadavg": load.trim(),
        "spin_us": a.spin.unwrap_or(rdma_shuffle_fabric::DEFAULT_SPIN).as_micros() as u64,
        "one_at_a_time": {
            "p50_us": spread(&p50), "p99_us": spread(&p99),
            "switches_per_1000": spread(&lat_cs), "migrations_per_1000": spread(&lat_mig),
        },
        "in_flight_64": {
            "blocks_per_s": spread(&rate),
            "switches_per_1000": spread(&win_cs), "migrations_per_1000": spread(&win_mig),
        },
        "idle": {
            "secs": idle_secs, "cpu_secs": idle_cpu, "cpu_fraction": idle_cpu / idle_secs,
            "switches": idle_sched.switches, "threads": idle_threads,
        },
        "perf_record": a.perf_record.as_ref().map(|p| p.display().to_string()),
    });
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n";
    match &a.out {
        Some(out) => std::fs::write(out, &text).map_err(|e| format!("writing {}: {e}", out.display()))?,
        None => print!("{text}"),
    }
    eprintln!(
        "engine-bench probe: idle {idle_secs:.1} s: {idle_cpu:.3} CPU s over both processes ({} threads), {} switches; load {}",
        idle_threads,
        idle_sched.switches,
        load.trim()
    );
    Ok(())
}
