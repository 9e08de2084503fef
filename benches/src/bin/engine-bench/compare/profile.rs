//! `engine-bench profile`: where each system spends its work per block, by block size, with
//! measures that load on the machine does not distort much.
//!
//! The engine (its server process and a client engine in this process) and Spark's block
//! transfer (two JVMs) move the same bulk transfers as `run` does, size by size, after
//! `--warmup` untimed transfers of that size (the JVMs' JIT). Each measured transfer runs
//! under a tool attached to both processes of its system:
//! * `stat` (default): `perf stat` of system calls (`raw_syscalls:sys_enter`, and
//!   `epoll_wait` alone: a loop that polls while it spins shows there, where `perf trace`
//!   and `strace` slow it down too much to see it), wake-ups (`sched:sched_wakeup`), context
//!   switches, CPU migrations, page faults and CPU time (`task-clock`), reported per block
//!   and per MiB: counts of events, which do not change with the load (this host's VM has no
//!   hardware counters: `perf stat -e instructions,cycles` says `<not supported>`);
//! * `trace`: `perf trace -s`, every system call by name with its count and its errors (an
//!   `EAGAIN` is a read or write that found nothing to do), per block, summed over threads
//!   (the per-thread summary stays in `--out-dir`);
//! * `strace`: `strace -c -f`, the same from strace; it slows the transfer down a lot, which
//!   changes how many reads find the socket empty, so prefer `trace`;
//! * `record`: `perf record -g` (cpu-clock) into `--out-dir`, one file per system and size,
//!   for `perf report`.
//!
//! `--spin-us 0` takes the engine's bounded spin out, so that its CPU time is work and
//! wake-ups only (a spinning loop's CPU time is waiting, not work).
//!
//! Each measured transfer repeats until it ran `--secs`. Then `--lat-samples` 4 KiB blocks
//! are fetched one at a time by each system (the latency test of `run`) under the same tool.
//! The report (JSON on stdout or `--out`) holds per size and system the blocks moved
//! (`units`) and each counter per block, and the same per fetch in `one_at_a_time_4k`; one
//! line per measurement goes to stderr.

use rdma_shuffle_bench::{parse_size, percentile, procfs};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::data::write_data;
use super::measure::{EngineSide, NettySide, Transfer};
use super::{engine_pair, netty_pair, repeat, Config, KIB, MIB, R};

const USAGE: &str = "engine-bench profile --netty-cp CP [--java JAVA] [--jvm-opt OPT]... [--sizes 4k,16k,64k,256k,1m,4m] \
    [--mib N (256)] [--secs S (2: each measured transfer repeats until then)] [--warmup N (3)] [--spin-us N (the engine's default)] [--lat-samples N (2000; 0: none)] [--tool stat|trace|strace|record] [--systems engine,netty] [--out-dir DIR] [--out FILE] [--dir DIR]";

/// What runs around each measured transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tool {
    Stat,
    Trace,
    Strace,
    Record,
}

const EVENTS: &str =
    "raw_syscalls:sys_enter,syscalls:sys_enter_epoll_wait,sched:sched_wakeup,context-switches,cpu-migrations,page-faults,task-clock";

/// Runs the profile.
pub fn profile(args: &[String]) -> R<()> {
    let mut tool = Tool::Stat;
    let mut out_dir = PathBuf::from("target/bench/profile");
    let mut systems = vec!["engine".to_string(), "netty".to_string()];
    let mut rest = Vec::new();
    let mut warmup = 3usize;
    let mut mib = 256usize;
    let mut secs = 2.0f64;
    let mut spin = None;
    let mut lat_samples = 2000usize;
    let mut sizes = "4k,16k,64k,256k,1m,4m".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().ok_or_else(|| format!("{a} needs a value; usage: {USAGE}"));
        match a.as_str() {
            "--tool" => {
                tool = match v()?.as_str() {
                    "stat" => Tool::Stat,
                    "trace" => Tool::Trace,
                    "strace" => Tool::Strace,
                    "record" => Tool::Record,
                    t => return Err(format!("--tool {t}: stat, trace, strace or record")),
                }
            }
            "--out-dir" => out_dir = PathBuf::from(v()?),
            "--systems" => systems = v()?.split(',').map(String::from).collect(),
            "--warmup" => warmup = v()?.parse().map_err(|_| "--warmup: a number".to_string())?,
            "--mib" => mib = v()?.parse().map_err(|_| "--mib: a number".to_string())?,
            "--sizes" => sizes = v()?,
            "--spin-us" => spin = Some(Duration::from_micros(v()?.parse().map_err(|_| "--spin-us: a number of µs".to_string())?)),
            "--lat-samples" => lat_samples = v()?.parse().map_err(|_| "--lat-samples: a number".to_string())?,
            "--secs" => secs = v()?.parse().map_err(|_| "--secs: a number of seconds".to_string())?,
            _ => rest.push(a.clone()),
        }
    }
    if let Some(bad) = systems.iter().find(|s| *s != "engine" && *s != "netty") {
        return Err(format!("--systems: '{bad}' is neither engine nor netty"));
    }
    for s in sizes.split(',') {
        parse_size(s).ok_or_else(|| format!("--sizes: '{s}'"))?;
    }
    rest.extend(["--mib".into(), mib.to_string(), "--sizes".into(), sizes]);
    let cfg = Config::from_args(&rest)?;
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let dir = tempfile::tempdir_in(&cfg.dir).map_err(|e| format!("creating a directory in {}: {e}", cfg.dir.display()))?;
    let (sets, small) = write_data(&cfg, dir.path())?;
    let (engine_server, e) = engine_pair(dir.path(), sets.iter().chain([&small]), spin, None)?;
    let mut n = if systems.iter().any(|s| s == "netty") { Some(netty_pair(&cfg)?) } else { None };

    let mut report = Vec::new();
    for set in &sets {
        let mut row = Map::new();
        row.insert("bytes".into(), json!(set.size));
        for sys in &systems {
            let (pids, label) = pids_of(sys, &e, &n);
            let transfer = |e: &EngineSide, n: &mut Option<NettySide>| -> R<Transfer> {
                match (sys.as_str(), n) {
                    ("engine", _) => e.bulk(set),
                    (_, Some(n)) => n.bulk(set),
                    _ => unreachable!("netty is started when asked for"),
                }
            };
            for _ in 0..warmup {
                transfer(&e, &mut n)?;
            }
            let what = format!("{label} {}", human(set.size));
            let base = out_dir.join(format!("{label}-{}", human(set.size)));
            // Repeated until it ran --secs: enough samples for `record`, enough blocks for counts.
            let per = measured(tool, pids, &base, &what, || {
                let t = repeat(secs, || transfer(&e, &mut n))?;
                Ok(((t.bytes / set.size as u64) as f64, t.bytes, Some(t.gbps())))
            })?;
            row.insert(label.into(), Value::Object(per));
        }
        report.push(Value::Object(row));
    }
    // 4 KiB blocks one at a time (the latency test of `run`): the counts per fetch.
    let mut one = Map::new();
    if lat_samples > 0 {
        for sys in &systems {
            let (pids, label) = pids_of(sys, &e, &n);
            let fetches = |n: &mut Option<NettySide>, k: usize| -> R<Vec<f64>> {
                match (sys.as_str(), n) {
                    ("engine", _) => e.latency(&small, k),
                    (_, Some(n)) => n.latency(&small, k),
                    _ => unreachable!("netty is started when asked for"),
                }
            };
            fetches(&mut n, lat_samples / 2)?;
            let base = out_dir.join(format!("{label}-one-at-a-time"));
            let mut us = Vec::new();
            let mut per = measured(tool, pids, &base, &format!("{label} 4k one at a time"), || {
                us = fetches(&mut n, lat_samples)?;
                Ok((us.len() as f64, (us.len() * small.size) as u64, None))
            })?;
            per.insert("p50_us_under_tool".into(), json!(percentile(&us, 0.5)));
            one.insert(label.into(), Value::Object(per));
        }
    }
    e.engine.shutdown();
    drop(n);
    drop(engine_server);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let r = json!({
        "what": "per-block counts of both processes of each system during one bulk transfer per size \
                 (and per fetch of 4 KiB blocks fetched one at a time), after warm-up transfers; tool as named",
        "tool": format!("{tool:?}").to_lowercase(),
        "events": if tool == Tool::Stat { EVENTS } else { "" },
        "mib_per_transfer": cfg.mib,
        "loadavg": load.trim(),
        "sizes": report,
        "one_at_a_time_4k": one,
    });
    let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())? + "\n";
    match &cfg.out {
        Some(p) => std::fs::write(p, text).map_err(|e| format!("writing {}: {e}", p.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

fn pids_of(sys: &str, e: &EngineSide, n: &Option<NettySide>) -> ([u32; 2], &'static str) {
    match sys {
        "engine" => (e.pids(), "engine"),
        _ => (n.as_ref().map(NettySide::pids).unwrap_or_default(), "netty"),
    }
}

/// Runs `run` (which answers the units it moved: blocks or fetches, bytes, and Gbit/s if
/// that means anything) under `tool` attached to `pids`; each count per unit, and the
/// busiest threads' CPU seconds per GiB (on two cores the busiest bounds the throughput).
fn measured(
    tool: Tool,
    pids: [u32; 2],
    base: &Path,
    what: &str,
    run: impl FnOnce() -> R<(f64, u64, Option<f64>)>,
) -> R<Map<String, Value>> {
    let threads0 = thread_cpu(pids);
    let attached = attach(tool, pids, base)?;
    let (units, bytes, gbps) = run()?;
    let threads = since(thread_cpu(pids), &threads0);
    let counts = attached.finish()?;
    let gib = bytes as f64 / (1u64 << 30) as f64;
    let mut per = Map::new();
    per.insert("units".into(), json!(units));
    if let Some(g) = gbps {
        per.insert("gbps_under_tool".into(), json!(g));
    }
    for (k, v) in &counts {
        per.insert(format!("{k}_per_unit"), json!(v / units));
    }
    if let Some(ms) = counts.get("task-clock") {
        per.insert("cpu_s_per_gib".into(), json!(ms / 1e3 / gib));
    }
    let mut busy: Vec<(String, f64)> = threads.into_iter().filter(|(_, s)| *s > 0.0).collect();
    busy.sort_by(|a, b| b.1.total_cmp(&a.1));
    let busy: Map<String, Value> = busy.into_iter().take(6).map(|(k, s)| (k, json!(s / gib))).collect();
    eprintln!("profile {what}: {}", summary(&per));
    eprintln!("profile {what}: threads' CPU s/GiB {}", summary(&busy));
    per.insert("thread_cpu_s_per_gib".into(), Value::Object(busy));
    Ok(per)
}

/// CPU seconds by thread name over both processes of a system (names prefixed `client:` or
/// `server:` by process).
fn thread_cpu(pids: [u32; 2]) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for (i, p) in pids.iter().enumerate() {
        for (name, s) in procfs::thread_cpu(*p) {
            *m.entry(format!("{}:{name}", ["client", "server"][i])).or_insert(0.0) += s;
        }
    }
    m
}

fn since(now: BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    now.into_iter()
        .map(|(k, v)| {
            let b = before.get(&k).copied().unwrap_or(0.0);
            (k, v - b)
        })
        .collect()
}

fn human(b: usize) -> String {
    if b >= MIB {
        format!("{}m", b / MIB)
    } else {
        format!("{}k", b / KIB)
    }
}

fn summary(per: &Map<String, Value>) -> String {
    per.iter().map(|(k, v)| format!("{k}={:.3}", v.as_f64().unwrap_or(f64::NAN))).collect::<Vec<_>>().join(" ")
}

/// A tool attached to the processes of one system.
struct Attached {
    tool: Tool,
    child: Child,
    out: PathBuf,
}

fn attach(tool: Tool, pids: [u32; 2], base: &Path) -> R<Attached> {
    let list = format!("{},{}", pids[0], pids[1]);
    let (mut cmd, out) = match tool {
        Tool::Stat => {
            let out = base.with_extension("stat.csv");
            let mut c = Command::new("perf");
            c.args(["stat", "-x", ",", "-e", EVENTS, "-p", &list, "-o"]).arg(&out);
            (c, out)
        }
        Tool::Trace => {
            let out = base.with_extension("trace.txt");
            let mut c = Command::new("perf");
            c.args(["trace", "-s", "-p", &list, "-o"]).arg(&out);
            (c, out)
        }
        Tool::Strace => {
            let out = base.with_extension("strace.txt");
            let mut c = Command::new("strace");
            c.args(["-c", "-f", "-o"]).arg(&out);
            for p in pids {
                c.args(["-p", &p.to_string()]);
            }
            (c, out)
        }
        Tool::Record => {
            let out = base.with_extension("perf.data");
            let mut c = Command::new("perf");
            c.args(["record", "-e", "cpu-clock", "-F", "1999", "-g", "-p", &list, "-o"]).arg(&out);
            (c, out)
        }
    };
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| format!("starting {cmd:?}: {e}"))?;
    // perf and strace need a moment to attach to every thread.
    std::thread::sleep(Duration::from_millis(700));
    Ok(Attached { tool, child, out })
}

impl Attached {
    /// Stops the tool and reads its counts.
    fn finish(mut self) -> R<BTreeMap<String, f64>> {
        // SAFETY: kill(2) on our child's pid has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let mut m = BTreeMap::new();
        match self.tool {
            Tool::Stat => {
                // value,unit,event,...
                for l in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
                    let f: Vec<&str> = l.split(',').collect();
                    if let (Some(v), Some(ev)) = (f.first().and_then(|v| v.parse::<f64>().ok()), f.get(2)) {
                        m.insert(ev.replace(':', "_").to_string(), v);
                    }
                }
            }
            Tool::Strace => {
                // % time, seconds, usecs/call, calls, [errors,] syscall
                for l in text.lines() {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    if f.len() >= 5 && f[0].parse::<f64>().is_ok() {
                        if let (Ok(calls), Some(name)) = (f[3].parse::<f64>(), f.last()) {
                            if *name != "total" {
                                m.insert(format!("sys_{name}"), calls);
                            }
                        }
                    }
                }
            }
            Tool::Trace => {
                // Per thread: `name calls errors total min avg max stddev` rows.
                for l in text.lines() {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    if f.len() == 8 && f[1].parse::<f64>().is_ok() && f[2].parse::<f64>().is_ok() {
                        let (calls, errors) = (f[1].parse::<f64>().unwrap_or(0.0), f[2].parse::<f64>().unwrap_or(0.0));
                        *m.entry(format!("sys_{}", f[0])).or_insert(0.0) += calls;
                        if errors > 0.0 {
                            *m.entry(format!("err_{}", f[0])).or_insert(0.0) += errors;
                        }
                    }
                }
            }
            Tool::Record => {}
        }
        Ok(m)
    }
}
