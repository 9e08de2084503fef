//! `scale-bench`: what one engine costs as the number of engines it talks to grows.
//!
//! * `scale-bench run [--provider tcp|verbs] [--peers 2,4,8,16,32] ...` starts one **hub**
//!   engine (a process) and adds **peer** engines (one process each) step by step up to every
//!   count of `--peers`. The hub serves a map output to every peer and fetches each peer's map
//!   output, in rounds; every peer fetches the hub's map output in rounds too, so every
//!   connection carries traffic both ways, small blocks inline and large ones by rendezvous.
//!   At each count, once every peer and the hub have completed fetches over every connection,
//!   it samples the hub from `/proc` (threads, open fds, RSS, pinned memory) and from its own
//!   counters (`registered_bytes` when the engine has that counter), and checks that blocks
//!   kept flowing both ways during the samples. It prints a table and writes a JSON report
//!   (`scripts/bench-scale.sh` merges it into `target/bench/scale.json`).
//! * `scale-bench hub ...` and `scale-bench peer ...` are those processes.
//!
//! Everything goes through the public shuffle API (`Engine`, its `BlockServer` and
//! `BlockClient`), so the harness measures whatever engine the workspace builds.

use rdma_shuffle_bench::{parse_counters, procfs, Proc, Waiter};
use rdma_shuffle_shuffle::testkit::write_map_output;
use rdma_shuffle_shuffle::{Engine, EngineConfig, ShuffleBlock};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type R<T> = Result<T, String>;

const SHUFFLE: u32 = 1;
/// The hub's map id; peer `k` serves map `k` (k >= 1).
const HUB_MAP: u64 = 0;
/// Blocks of every map output: small ones (sent inline under the default 64 KiB eager
/// threshold) and large ones (rendezvous: READ on verbs, a streamed region on tcp).
const PARTITIONS: [usize; 10] = [4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 128 << 10, 128 << 10];
/// A fetch that makes no progress for this long is a failure.
const STALL: Duration = Duration::from_secs(120);

const USAGE: &str = "scale-bench run [--provider tcp|verbs] [--peers 2,4,8,16,32] [--device D] [--gid-index N]
    [--pause-ms MS] [--settle-secs S] [--samples N] [--progress-timeout S] [--dir DIR] [--out FILE]
  scale-bench hub --dir DIR [engine options]
  scale-bench peer --dir DIR --id K --hub ADDR [engine options]
  engine options: --provider tcp|verbs --device D --gid-index N --pause-ms MS";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rest = args.get(2..).unwrap_or(&[]);
    let result = match args.get(1).map(String::as_str) {
        Some("run") => run(rest),
        Some("hub") => hub(rest),
        Some("peer") => peer(rest),
        _ => Err(format!("usage: {USAGE}")),
    };
    if let Err(e) = result {
        eprintln!("scale-bench: {e}");
        std::process::exit(1);
    }
}

/// Options every role understands.
#[derive(Clone, Debug)]
struct Opts {
    transport: String,
    device: Option<String>,
    gid_index: Option<u8>,
    /// Pause between two fetch rounds of one fetcher: keeps traffic flowing on every
    /// connection without saturating a small machine.
    pause: Duration,
    peers: Vec<usize>,
    settle: Duration,
    samples: usize,
    progress_timeout: Duration,
    dir: PathBuf,
    out: Option<PathBuf>,
    id: u64,
    hub: Option<SocketAddr>,
}

impl Opts {
    fn parse(args: &[String]) -> R<Opts> {
        let mut o = Opts {
            transport: "tcp".into(),
            device: None,
            gid_index: None,
            pause: Duration::from_millis(100),
            peers: vec![2, 4, 8, 16, 32],
            settle: Duration::from_secs(2),
            samples: 5,
            progress_timeout: Duration::from_secs(120),
            dir: std::env::temp_dir(),
            out: None,
            id: 0,
            hub: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value = || it.next().cloned().ok_or_else(|| format!("{flag} needs a value; usage: {USAGE}"));
            let num = |v: String, what: &str| v.parse::<u64>().map_err(|_| format!("{what}: '{v}' is not a number"));
            match flag.as_str() {
                "--provider" => {
                    let name = value()?;
                    let registry = rdma_shuffle_providers::registry();
                    if name == rdma_shuffle_providers::AUTO || !registry.knows(&name) {
                        let names = registry.names().collect::<Vec<_>>().join(", ");
                        return Err(format!("--provider: '{name}' is not one of this build's providers ({names})"));
                    }
                    o.transport = name;
                }
                "--device" => o.device = Some(value()?).filter(|d| !d.is_empty()),
                "--gid-index" => {
                    let v = value()?;
                    o.gid_index = if v.is_empty() { None } else { Some(num(v, "--gid-index")?.min(255) as u8) }
                }
                "--pause-ms" => o.pause = Duration::from_millis(num(value()?, "--pause-ms")?),
                "--peers" => {
                    o.peers = value()?
                        .split(',')
                        .map(|p| p.trim().parse::<usize>().ok().filter(|n| *n >= 1))
                        .collect::<Option<Vec<_>>>()
                        .ok_or("--peers: expected counts like 2,4,8")?;
                    if o.peers.is_empty() || o.peers.windows(2).any(|w| w[0] >= w[1]) {
                        return Err(format!("--peers must increase, got {:?}", o.peers));
                    }
                }
                "--settle-secs" => o.settle = Duration::from_secs(num(value()?, "--settle-secs")?),
                "--samples" => o.samples = num(value()?, "--samples")?.max(1) as usize,
                "--progress-timeout" => o.progress_timeout = Duration::from_secs(num(value()?, "--progress-timeout")?.max(1)),
                "--dir" => o.dir = PathBuf::from(value()?),
                "--out" => o.out = Some(PathBuf::from(value()?)),
                "--id" => o.id = num(value()?, "--id")?,
                "--hub" => o.hub = Some(value()?.parse().map_err(|_| "--hub: expected ADDRESS:PORT".to_string())?),
                other => return Err(format!("unknown argument '{other}'; usage: {USAGE}")),
            }
        }
        Ok(o)
    }

    /// The engine options again, for a child process.
    fn engine_args(&self) -> Vec<String> {
        let mut a =
            vec!["--provider".to_string(), self.provider_name().into(), "--pause-ms".into(), self.pause.as_millis().to_string()];
        if let Some(d) = &self.device {
            a.extend(["--device".into(), d.clone()]);
        }
        if let Some(g) = self.gid_index {
            a.extend(["--gid-index".into(), g.to_string()]);
        }
        a
    }

    fn provider_name(&self) -> &str {
        &self.transport
    }

    fn engine(&self, id: &str) -> R<Engine> {
        let cfg = EngineConfig {
            transport: self.transport.clone(),
            bind_host: Ipv4Addr::LOCALHOST.into(),
            executor_id: id.into(),
            device: self.device.clone(),
            gid_index: self.gid_index,
            ..EngineConfig::default()
        };
        Engine::open(cfg).map_err(|e| format!("{id}: opening the engine: {e}"))
    }
}

fn blocks(map: u64) -> Vec<ShuffleBlock> {
    (0..PARTITIONS.len() as u32).map(|r| ShuffleBlock::single(SHUFFLE, map, r)).collect()
}

fn map_bytes() -> u64 {
    PARTITIONS.iter().sum::<usize>() as u64
}

/// Writes and registers this engine's map output.
fn serve_map(engine: &Engine, dir: &Path, map: u64) -> R<()> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let out = write_map_output(dir, SHUFFLE, map, &PARTITIONS, map).map_err(|e| format!("writing map {map}: {e}"))?;
    engine.server().register(out.map_output_files()).map_err(|e| format!("registering map {map}: {e}"))
}

/// A thread that sets the flag when standard input ends (the driver's signal to stop).
fn stop_on_eof() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        s.store(true, Ordering::SeqCst);
    });
    stop
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

// ------------------------------------------------------------------------------ peer

/// `scale-bench peer`: serves map `--id`, fetches the hub's map output in rounds, prints
/// `fetched <rounds>` after each; stops when stdin ends; exits 1 on a failed fetch.
fn peer(args: &[String]) -> R<()> {
    let o = Opts::parse(args)?;
    let hub = o.hub.ok_or("peer: --hub is required")?;
    let engine = o.engine(&format!("peer-{}", o.id))?;
    serve_map(&engine, &o.dir, o.id)?;
    say(&format!("ready {}", engine.server().local_addr().port()));
    let stop = stop_on_eof();
    let want = blocks(HUB_MAP);
    let mut rounds = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let w = Waiter::new(want.len());
        engine.client().fetch(hub, &want, w.clone());
        match w.wait(STALL) {
            Ok(b) if b == map_bytes() => {}
            Ok(b) => return Err(format!("peer {}: fetched {b} bytes from the hub, expected {}", o.id, map_bytes())),
            Err(e) => return Err(format!("peer {}: fetching from the hub at {hub}: {e}", o.id)),
        }
        rounds += 1;
        say(&format!("fetched {rounds}"));
        std::thread::sleep(o.pause);
    }
    engine.shutdown();
    Ok(())
}

// ------------------------------------------------------------------------------ hub

struct HubState {
    /// (peer id, address, rounds fetched from it since it was added).
    peers: Vec<(u64, SocketAddr, u64)>,
    failures: u64,
    first_failure: Option<String>,
}

/// `scale-bench hub`: serves map 0, fetches every known peer's map output in rounds (all
/// peers at once per round). Commands on stdin: `peer <id> <addr>` (answer `ok`), `stats`
/// (answer `stats <json>`); stops when stdin ends.
fn hub(args: &[String]) -> R<()> {
    let o = Opts::parse(args)?;
    let engine = Arc::new(o.engine("hub")?);
    serve_map(&engine, &o.dir, HUB_MAP)?;
    say(&format!("ready {}", engine.server().local_addr().port()));
    let state = Arc::new(parking_lot::Mutex::new(HubState { peers: Vec::new(), failures: 0, first_failure: None }));
    let stop = Arc::new(AtomicBool::new(false));
    let fetcher = {
        let (engine, state, stop, pause) = (engine.clone(), state.clone(), stop.clone(), o.pause);
        std::thread::Builder::new()
            .name("hub-fetcher".into())
            .spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let peers: Vec<(u64, SocketAddr)> = state.lock().peers.iter().map(|p| (p.0, p.1)).collect();
                    if peers.is_empty() {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                    let per_peer = PARTITIONS.len();
                    let w = Waiter::new(per_peer * peers.len());
                    for (id, addr) in &peers {
                        engine.client().fetch(*addr, &blocks(*id), w.clone());
                    }
                    let result = w.wait(STALL);
                    let mut s = state.lock();
                    match result {
                        Ok(b) if b == map_bytes() * peers.len() as u64 => {
                            for p in s.peers.iter_mut().filter(|p| peers.iter().any(|q| q.0 == p.0)) {
                                p.2 += 1;
                            }
                        }
                        other => {
                            s.failures += 1;
                            let why = match other {
                                Ok(b) => format!("a round moved {b} bytes, expected {}", map_bytes() * peers.len() as u64),
                                Err(e) => e,
                            };
                            s.first_failure.get_or_insert(why);
                        }
                    }
                    drop(s);
                    std::thread::sleep(pause);
                }
            })
            .map_err(|e| format!("starting the hub's fetch thread: {e}"))?
    };
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        match w[..] {
            ["peer", id, addr] => match (id.parse::<u64>(), addr.parse::<SocketAddr>()) {
                (Ok(id), Ok(addr)) => {
                    state.lock().peers.push((id, addr, 0));
                    say("ok");
                }
                _ => say(&format!("error bad peer line '{line}'")),
            },
            ["stats"] => {
                let s = state.lock();
                let counters: BTreeMap<String, u64> = parse_counters(&engine.stats_text());
                let rounds: BTreeMap<String, u64> = s.peers.iter().map(|p| (p.0.to_string(), p.2)).collect();
                let v = json!({"counters": counters, "rounds": rounds, "failures": s.failures,
                               "first_failure": s.first_failure, "transport": engine.transport()});
                say(&format!("stats {v}"));
            }
            _ => say(&format!("error unknown command '{line}'")),
        }
    }
    stop.store(true, Ordering::SeqCst);
    let _ = fetcher.join();
    engine.shutdown();
    Ok(())
}

// ------------------------------------------------------------------------------ driver

struct HubStats {
    counters: BTreeMap<String, u64>,
    rounds: BTreeMap<u64, u64>,
    failures: u64,
    first_failure: Option<String>,
}

fn hub_stats(hub: &mut Proc) -> R<HubStats> {
    hub.send("stats")?;
    let l = hub.line(Duration::from_secs(60))?;
    let v: Value = l
        .strip_prefix("stats ")
        .and_then(|j| serde_json::from_str(j).ok())
        .ok_or_else(|| format!("hub: expected 'stats {{json}}', got '{l}'"))?;
    let counters = v["counters"]
        .as_object()
        .map(|m| m.iter().filter_map(|(k, v)| v.as_u64().map(|v| (k.clone(), v))).collect())
        .unwrap_or_default();
    let rounds = v["rounds"]
        .as_object()
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.parse().ok()?, v.as_u64()?))).collect())
        .unwrap_or_default();
    Ok(HubStats {
        counters,
        rounds,
        failures: v["failures"].as_u64().unwrap_or(0),
        first_failure: v["first_failure"].as_str().map(String::from),
    })
}

/// A peer process and how many rounds it reported.
struct Peer {
    id: u64,
    proc: Proc,
    rounds: u64,
}

impl Peer {
    /// Reads what the peer printed; fails if it reported an error or exited.
    fn poll(&mut self) -> R<u64> {
        for l in self.proc.drain() {
            if let Some(n) = l.strip_prefix("fetched ").and_then(|n| n.parse().ok()) {
                self.rounds = n;
            }
        }
        if let Some(status) = self.proc.exited() {
            return Err(format!("peer {} exited ({status}); its errors are above", self.id));
        }
        Ok(self.rounds)
    }
}

/// Takes the hub's peak footprint over `samples` readings half a second apart, and checks that
/// traffic flowed both ways on every connection meanwhile.
fn measure(o: &Opts, hub: &mut Proc, peers: &mut [Peer]) -> R<Value> {
    let n = peers.len();
    let before = hub_stats(hub)?;
    let peer_before: Vec<u64> = peers.iter_mut().map(Peer::poll).collect::<R<_>>()?;
    let mut peak = procfs::Footprint::default();
    let mut registered: Option<u64> = None;
    // What registered memory is made of (peaks over the samples): the server's exposed
    // rendezvous regions and the fetch pool's slabs.
    let (mut exposed, mut pool) = (0u64, 0u64);
    for i in 0..o.samples {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(500));
        }
        let f = procfs::footprint(hub.pid()).map_err(|e| format!("reading /proc/{} of the hub: {e}", hub.pid()))?;
        peak.threads = peak.threads.max(f.threads);
        peak.fds = peak.fds.max(f.fds);
        peak.rss_bytes = peak.rss_bytes.max(f.rss_bytes);
        peak.vm_pin_bytes = peak.vm_pin_bytes.max(f.vm_pin_bytes);
        let hs = hub_stats(hub)?;
        if let Some(r) = hs.counters.get("registered_bytes") {
            registered = Some(registered.unwrap_or(0).max(*r));
        }
        exposed = exposed.max(hs.counters.get("exposed_bytes").copied().unwrap_or(0));
        pool = pool.max(hs.counters.get("pool_bytes_allocated").copied().unwrap_or(0));
    }
    // Every peer and the hub must complete another round over every connection.
    let t = Instant::now();
    let after = loop {
        let after = hub_stats(hub)?;
        let mut stuck = Vec::new();
        for (p, b) in peers.iter_mut().zip(&peer_before) {
            if p.poll()? <= *b {
                stuck.push(format!("peer {} fetched nothing from the hub", p.id));
            }
            if after.rounds.get(&p.id).copied().unwrap_or(0) <= before.rounds.get(&p.id).copied().unwrap_or(0) {
                stuck.push(format!("the hub fetched nothing from peer {}", p.id));
            }
        }
        if after.failures > 0 {
            return Err(format!("the hub's fetches failed; first: {}", after.first_failure.unwrap_or_default()));
        }
        if stuck.is_empty() {
            break after;
        }
        if t.elapsed() > o.progress_timeout {
            return Err(format!("{n} peers: traffic stopped while measuring: {}", stuck.join("; ")));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let c = |s: &HubStats, k: &str| s.counters.get(k).copied().unwrap_or(0);
    let (registered_bytes, source) = match registered {
        Some(r) => (r, "engine counter registered_bytes"),
        None => (peak.vm_pin_bytes, "VmPin of /proc/PID/status (this engine has no registered_bytes counter)"),
    };
    Ok(json!({
        "peers": n,
        "threads": peak.threads,
        "registered_bytes": registered_bytes,
        "rss_bytes": peak.rss_bytes,
        "fds": peak.fds,
        "vm_pin_bytes": peak.vm_pin_bytes,
        "registered_source": source,
        "exposed_bytes": exposed,
        "peak_exposed_bytes": c(&after, "peak_exposed_bytes"),
        "pool_bytes_allocated": pool,
        "samples": o.samples,
        "connections_opened": c(&after, "connections_opened"),
        "connections_accepted": c(&after, "connections_accepted"),
        "blocks_fetched_in_window": c(&after, "blocks_fetched") - c(&before, "blocks_fetched"),
        "blocks_served_in_window": c(&after, "blocks_served") - c(&before, "blocks_served"),
    }))
}

/// The scale checks over the rows, reported (not asserted).
fn checks(rows: &[Value]) -> Value {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else { return Value::Null };
    let g = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let ratio = |k: &str| {
        let (a, b) = (g(first, k), g(last, k));
        if a == 0.0 && b == 0.0 {
            Some(1.0)
        } else if a > 0.0 {
            Some(b / a)
        } else {
            None
        }
    };
    let dp = g(last, "peers") - g(first, "peers");
    let rss_per_peer = if dp > 0.0 { (g(last, "rss_bytes") - g(first, "rss_bytes")) / dp } else { f64::NAN };
    let th = ratio("threads");
    let reg = ratio("registered_bytes");
    json!({
        "from_peers": first["peers"], "to_peers": last["peers"],
        "threads_ratio": th, "threads_ratio_goal": 1.1, "threads_met": th.map(|x| x <= 1.1),
        "registered_ratio": reg, "registered_ratio_goal": 1.1, "registered_met": reg.map(|x| x <= 1.1),
        "rss_growth_bytes_per_peer": rss_per_peer, "rss_growth_goal_bytes_per_peer": 1 << 20,
        "rss_met": rss_per_peer < (1 << 20) as f64,
    })
}

fn table(provider: &str, rows: &[Value], checks: &Value) -> String {
    let mib = |v: &Value| v.as_f64().unwrap_or(0.0) / (1u64 << 20) as f64;
    let u = |v: &Value| v.as_u64().unwrap_or(0);
    let mut o = format!(
        "one engine serving and fetching, talking to N peer engines (processes), {provider}; peak of the hub over the samples, traffic flowing\n"
    );
    o += &format!(
        "  {:>5} {:>8} {:>6} {:>9} {:>15} {:>12} {:>12}\n",
        "peers", "threads", "fds", "RSS MiB", "registered MiB", "fetched/win", "served/win"
    );
    for r in rows {
        o += &format!(
            "  {:>5} {:>8} {:>6} {:>9.1} {:>15.1} {:>12} {:>12}\n",
            u(&r["peers"]),
            u(&r["threads"]),
            u(&r["fds"]),
            mib(&r["rss_bytes"]),
            mib(&r["registered_bytes"]),
            u(&r["blocks_fetched_in_window"]),
            u(&r["blocks_served_in_window"])
        );
    }
    if let Some(src) = rows.first().and_then(|r| r["registered_source"].as_str()) {
        o += &format!("  registered bytes from: {src}\n");
    }
    let f = |k: &str| checks[k].as_f64().map(|x| format!("{x:.2}")).unwrap_or_else(|| "n/a".into());
    let met = |k: &str| match checks[k].as_bool() {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "n/a",
    };
    o += &format!(
        "  targets (issue 13; reported, not asserted): threads {}->{} peers x{} (<= 1.1: {}), registered x{} (<= 1.1: {}), RSS +{:.0} KiB per peer (< 1024: {})\n",
        checks["from_peers"],
        checks["to_peers"],
        f("threads_ratio"),
        met("threads_met"),
        f("registered_ratio"),
        met("registered_met"),
        checks["rss_growth_bytes_per_peer"].as_f64().unwrap_or(f64::NAN) / 1024.0,
        met("rss_met"),
    );
    o
}

fn run(args: &[String]) -> R<()> {
    let o = Opts::parse(args)?;
    let t0 = Instant::now();
    let dir = tempfile::tempdir_in(&o.dir).map_err(|e| format!("creating a directory in {}: {e}", o.dir.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut hub = Proc::spawn(
        "hub",
        Command::new(&exe).arg("hub").args(["--dir", &dir.path().join("hub").display().to_string()]).args(o.engine_args()),
    )?;
    let port: u16 = hub.ready(Duration::from_secs(120))?.first().and_then(|p| p.parse().ok()).ok_or("hub: no port")?;
    let hub_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut peers: Vec<Peer> = Vec::new();
    let mut rows = Vec::new();
    for &target in &o.peers {
        let t = Instant::now();
        while peers.len() < target {
            let id = peers.len() as u64 + 1;
            let name = format!("peer {id}");
            let mut p = Proc::spawn(
                &name,
                Command::new(&exe)
                    .arg("peer")
                    .args(["--dir", &dir.path().join(format!("peer{id}")).display().to_string()])
                    .args(["--id", &id.to_string(), "--hub", &hub_addr.to_string()])
                    .args(o.engine_args()),
            )?;
            let pport: u16 = p.ready(Duration::from_secs(120))?.first().and_then(|x| x.parse().ok()).ok_or("peer: no port")?;
            hub.send(&format!("peer {id} 127.0.0.1:{pport}"))?;
            let ack = hub.line(Duration::from_secs(60))?;
            if ack != "ok" {
                return Err(format!("hub refused peer {id}: {ack}"));
            }
            peers.push(Peer { id, proc: p, rounds: 0 });
        }
        // Every connection in use before measuring: each peer and the hub completed rounds.
        let started = Instant::now();
        loop {
            let s = hub_stats(&mut hub)?;
            if s.failures > 0 {
                return Err(format!("the hub's fetches failed; first: {}", s.first_failure.unwrap_or_default()));
            }
            let mut waiting = 0;
            for p in peers.iter_mut() {
                if p.poll()? < 2 || s.rounds.get(&p.id).copied().unwrap_or(0) < 2 {
                    waiting += 1;
                }
            }
            if waiting == 0 {
                break;
            }
            if started.elapsed() > o.progress_timeout {
                return Err(format!(
                    "{target} peers: {waiting} connections had not carried 2 rounds both ways after {} s",
                    o.progress_timeout.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(o.settle);
        let row = measure(&o, &mut hub, &mut peers)?;
        eprintln!(
            "scale-bench: {target} peers ({:.1} s): threads {} fds {} rss {:.1} MiB registered {:.1} MiB",
            t.elapsed().as_secs_f64(),
            row["threads"],
            row["fds"],
            row["rss_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            row["registered_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        );
        rows.push(row);
    }
    drop(peers);
    drop(hub);
    let checks = checks(&rows);
    print!("{}", table(o.provider_name(), &rows, &checks));
    let report = json!({
        "provider": o.provider_name(),
        "what": "one hub engine (a process) serving every peer and fetching from every peer, peers added step by step; \
                 threads/fds/rss/VmPin from /proc of the hub, peak over the samples; registered_bytes from the engine's \
                 counter when it has one, else VmPin",
        "block_bytes": PARTITIONS,
        "pause_ms": o.pause.as_millis() as u64,
        "samples": o.samples,
        "seconds": t0.elapsed().as_secs_f64(),
        "rows": rows,
        "checks": checks,
    });
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n";
    match &o.out {
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

    #[test]
    fn options_parse_and_pass_on() {
        let a = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o = Opts::parse(&a("--provider verbs --device rxe0 --gid-index 1 --peers 2,4 --pause-ms 50")).unwrap();
        assert_eq!((o.transport.as_str(), o.peers.clone(), o.pause), ("verbs", vec![2, 4], Duration::from_millis(50)));
        assert_eq!(o.engine_args(), a("--provider verbs --pause-ms 50 --device rxe0 --gid-index 1"));
        for bad in ["--peers 4,2", "--peers 0", "--provider ib", "--bogus", "--hub nowhere"] {
            assert!(Opts::parse(&a(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn checks_compare_first_and_last_rows() {
        let row =
            |p: u64, th: u64, rss: u64, reg: u64| json!({"peers": p, "threads": th, "rss_bytes": rss, "registered_bytes": reg});
        let c = checks(&[row(2, 10, 100 << 20, 0), row(32, 11, 110 << 20, 0)]);
        assert_eq!(c["threads_met"], json!(true));
        assert_eq!(c["registered_ratio"], json!(1.0), "0 and 0 do not grow");
        assert_eq!(c["rss_met"], json!(true), "10 MiB over 30 peers");
        let c = checks(&[row(2, 10, 100 << 20, 1 << 20), row(32, 70, 200 << 20, 64 << 20)]);
        assert_eq!(
            (c["threads_met"].clone(), c["registered_met"].clone(), c["rss_met"].clone()),
            (json!(false), json!(false), json!(false))
        );
        let t = table("tcp", &[row(2, 10, 100 << 20, 0)], &c);
        assert!(t.contains("NOT met") && t.contains("peers"), "{t}");
    }
}
