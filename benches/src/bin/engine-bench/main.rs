//! Engine benchmark: the raw TCP ceiling against the engine, in two processes on loopback.
//!
//! `engine-bench run [--gib N] [--out FILE]` writes map outputs in Spark's layout, starts a
//! server process (this binary, `serve` mode), and measures in one run:
//! (a) the ceiling: plain sockets moving the same bytes between the two processes;
//! (b) the engine fetching every 1 MiB block from the server process;
//! (c) 4 KiB blocks: blocks/s with many in flight, and p50/p99 latency of one at a time;
//! (d) CPU seconds (both processes) per GiB for (a) and (b).
//! It prints a table and writes JSON. Machines here are shared and noisy: the ratio of the
//! engine to the ceiling measured in the same run is the number to watch.
//!
//! `engine-bench verbs-sweep [--out FILE] ...` (built with `--features verbs`, run on an RDMA
//! device: the SoftRoCE VM) compares eager SEND with rendezvous RDMA READ by block size; see
//! [`verbs_sweep`].

mod verbs_sweep;

use parking_lot::{Condvar, Mutex};
use rdma_shuffle_fabric::pool::{PoolConfig, TieredPool};
use rdma_shuffle_fabric::{BlockSink, ClientEndpointConfig, FetchedBlock, Provider, ServerEndpointConfig, TcpProvider};
use rdma_shuffle_shuffle::testkit::write_map_output;
use rdma_shuffle_shuffle::{BlockClient, BlockServer, ShuffleBlock};
use rdma_shuffle_wire::BlockFailure;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
const BIG_PARTS: usize = 128;
const SMALL_PARTS: usize = 1024;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned();
    match args.get(1).map(String::as_str) {
        Some("serve") => serve(Path::new(&get("--dir").expect("--dir")), get("--maps").and_then(|m| m.parse().ok()).unwrap_or(8)),
        Some("run") | None => run(get("--gib").and_then(|g| g.parse().ok()).unwrap_or(1.0), get("--out").map(PathBuf::from)),
        Some("verbs-sweep") => {
            if let Err(e) = verbs_sweep::run(&args[2..]) {
                eprintln!("{e}");
                std::process::exit(if matches!(e, verbs_sweep::SweepError::Usage(_) | verbs_sweep::SweepError::NoVerbs) {
                    2
                } else {
                    1
                });
            }
        }
        Some(other) => {
            eprintln!(
                "usage: engine-bench run [--gib N] [--out FILE] | serve --dir D --maps N | {} (got {other})",
                verbs_sweep::USAGE
            );
            std::process::exit(2);
        }
    }
}

/// CPU seconds (user + system) of a process, from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / ticks
}

/// Server process: serves the map outputs in `dir` over the engine (port printed on stdout),
/// and the same data file bytes over plain sockets (the ceiling).
fn serve(dir: &Path, maps: u64) {
    let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
    let cfg = ServerEndpointConfig { name: "bench-server".into(), ..Default::default() };
    let server = BlockServer::bind(provider, "127.0.0.1:0".parse().unwrap(), cfg).expect("bind");
    for m in 0..maps {
        let data = dir.join(format!("shuffle_1_{m}_0.data"));
        let index = dir.join(format!("shuffle_1_{m}_0.index"));
        server
            .register(rdma_shuffle_shuffle::store::MapOutputFiles {
                shuffle_id: 1,
                map_id: m,
                data_path: data,
                index_path: index,
                num_partitions: None,
            })
            .expect("register big");
    }
    let data = dir.join("shuffle_2_0_0.data");
    let index = dir.join("shuffle_2_0_0.index");
    server
        .register(rdma_shuffle_shuffle::store::MapOutputFiles {
            shuffle_id: 2,
            map_id: 0,
            data_path: data,
            index_path: index,
            num_partitions: None,
        })
        .expect("register small");
    let raw = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("{} {}", server.local_addr().port(), raw.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    // Ceiling: each connection receives the map outputs' data files back to back, written
    // from their mappings in 1 MiB writes, exactly the bytes the engine moves.
    let files: Vec<Vec<u8>> = (0..maps).map(|m| std::fs::read(dir.join(format!("shuffle_1_{m}_0.data"))).unwrap()).collect();
    for s in raw.incoming() {
        let Ok(mut s) = s else { break };
        let _ = s.set_nodelay(true);
        for f in &files {
            for chunk in f.chunks(MIB) {
                if s.write_all(chunk).is_err() {
                    break;
                }
            }
        }
    }
}

struct Waiter {
    left: Mutex<usize>,
    cv: Condvar,
    bytes: Mutex<u64>,
    failures: Mutex<Vec<String>>,
}

impl BlockSink for Waiter {
    fn on_block(&self, _i: usize, r: Result<FetchedBlock, BlockFailure>) {
        match r {
            // The consumer is done with the block at once: its buffer goes back to the pool.
            Ok(b) => *self.bytes.lock() += b.len() as u64,
            Err(e) => self.failures.lock().push(e.to_string()),
        }
        let mut l = self.left.lock();
        *l -= 1;
        if *l == 0 {
            self.cv.notify_all();
        }
    }
}

impl Waiter {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Waiter { left: Mutex::new(n), cv: Condvar::new(), bytes: Mutex::new(0), failures: Mutex::new(Vec::new()) })
    }
    fn wait(&self) -> u64 {
        let mut l = self.left.lock();
        while *l > 0 {
            if self.cv.wait_for(&mut l, Duration::from_secs(120)).timed_out() {
                panic!("benchmark fetch stalled with {} blocks outstanding", *l);
            }
        }
        let f = self.failures.lock();
        assert!(f.is_empty(), "{} blocks failed, first: {}", f.len(), f[0]);
        *self.bytes.lock()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn run(gib: f64, out: Option<PathBuf>) {
    let maps = ((gib * 1024.0) / BIG_PARTS as f64).ceil().max(1.0) as u64;
    let dir =
        tempfile::tempdir_in(std::env::var("BENCH_DIR").unwrap_or_else(|_| std::env::temp_dir().display().to_string())).unwrap();
    eprintln!("writing {maps} map outputs of {BIG_PARTS} x 1 MiB in {}", dir.path().display());
    for m in 0..maps {
        write_map_output(dir.path(), 1, m, &vec![MIB; BIG_PARTS], m).unwrap();
    }
    write_map_output(dir.path(), 2, 0, &vec![4096; SMALL_PARTS], 99).unwrap();
    let total = maps * BIG_PARTS as u64 * MIB as u64;

    let exe = std::env::current_exe().unwrap();
    let mut child: Child = Command::new(exe)
        .args(["serve", "--dir", &dir.path().display().to_string(), "--maps", &maps.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start server process");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let ports: Vec<u16> = line.split_whitespace().map(|p| p.parse().unwrap()).collect();
    let engine_addr: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
    let raw_addr: SocketAddr = format!("127.0.0.1:{}", ports[1]).parse().unwrap();
    let me = std::process::id();
    let server_pid = child.id();

    // Warm the page cache and both processes once.
    let mut warm = TcpStream::connect(raw_addr).unwrap();
    std::io::copy(&mut warm, &mut std::io::sink()).unwrap();

    // (a) ceiling
    let cpu0 = cpu_seconds(me) + cpu_seconds(server_pid);
    let t = Instant::now();
    let mut s = TcpStream::connect(raw_addr).unwrap();
    let mut buf = vec![0u8; MIB];
    let mut got = 0u64;
    loop {
        let n = s.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let ceiling_s = t.elapsed().as_secs_f64();
    let ceiling_cpu = cpu_seconds(me) + cpu_seconds(server_pid) - cpu0;
    assert_eq!(got, total, "ceiling moved the wrong byte count");

    // (b) engine, 1 MiB blocks: every map output's blocks in one fetch, all maps at once.
    let pool = TieredPool::unregistered(PoolConfig { prealloc: true, ..PoolConfig::default() }).unwrap();
    let client = BlockClient::new(
        Arc::new(TcpProvider::new()),
        pool,
        ClientEndpointConfig { name: "bench-client".into(), ..Default::default() },
    )
    .unwrap();
    let fetch_big = |client: &BlockClient| {
        let w = Waiter::new(maps as usize * BIG_PARTS);
        for m in 0..maps {
            let blocks: Vec<_> = (0..BIG_PARTS as u32).map(|r| ShuffleBlock::single(1, m, r)).collect();
            client.fetch(engine_addr, &blocks, w.clone());
        }
        w.wait()
    };
    fetch_big(&client); // warm-up: connection, pool slabs
    let cpu0 = cpu_seconds(me) + cpu_seconds(server_pid);
    let t = Instant::now();
    let moved = fetch_big(&client);
    let engine_s = t.elapsed().as_secs_f64();
    let engine_cpu = cpu_seconds(me) + cpu_seconds(server_pid) - cpu0;
    assert_eq!(moved, total);

    // (c) 4 KiB blocks: throughput with all in flight, then latency one at a time.
    let small: Vec<_> = (0..SMALL_PARTS as u32).map(|r| ShuffleBlock::single(2, 0, r)).collect();
    let rounds = 20;
    let t = Instant::now();
    for _ in 0..rounds {
        let w = Waiter::new(small.len());
        client.fetch(engine_addr, &small, w.clone());
        w.wait();
    }
    let small_per_s = (rounds * small.len()) as f64 / t.elapsed().as_secs_f64();
    let mut lat = Vec::with_capacity(2000);
    for i in 0..2000 {
        let w = Waiter::new(1);
        let t = Instant::now();
        client.fetch(engine_addr, &small[i % SMALL_PARTS..i % SMALL_PARTS + 1], w.clone());
        w.wait();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    client.shutdown();
    let _ = child.kill();
    let _ = child.wait();

    let gibs = total as f64 / GIB;
    let ceiling_gbps = total as f64 * 8.0 / ceiling_s / 1e9;
    let engine_gbps = total as f64 * 8.0 / engine_s / 1e9;
    let json = format!(
        "{{\n  \"provider\": \"tcp\",\n  \"bytes\": {total},\n  \"block_bytes\": {MIB},\n  \"ceiling_gbps\": {ceiling_gbps:.3},\n  \"engine_gbps\": {engine_gbps:.3},\n  \"ratio\": {:.3},\n  \"small_block_bytes\": 4096,\n  \"small_blocks_per_s\": {small_per_s:.0},\n  \"small_p50_us\": {:.1},\n  \"small_p99_us\": {:.1},\n  \"cpu_s_per_gib_ceiling\": {:.3},\n  \"cpu_s_per_gib_engine\": {:.3}\n}}\n",
        engine_gbps / ceiling_gbps,
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        ceiling_cpu / gibs,
        engine_cpu / gibs,
    );
    println!("engine benchmark over loopback tcp, {gibs:.2} GiB as 1 MiB blocks (two processes)");
    println!("  {:<34} {:>10}", "metric", "value");
    println!("  {:<34} {:>10.2}", "ceiling (plain sockets), Gbit/s", ceiling_gbps);
    println!("  {:<34} {:>10.2}", "engine, Gbit/s", engine_gbps);
    println!("  {:<34} {:>10.3}", "engine / ceiling", engine_gbps / ceiling_gbps);
    println!("  {:<34} {:>10.0}", "4 KiB blocks/s (1024 in flight)", small_per_s);
    println!("  {:<34} {:>10.1}", "4 KiB fetch p50, us", percentile(&lat, 0.5));
    println!("  {:<34} {:>10.1}", "4 KiB fetch p99, us", percentile(&lat, 0.99));
    println!("  {:<34} {:>10.3}", "CPU s/GiB ceiling (both procs)", ceiling_cpu / gibs);
    println!("  {:<34} {:>10.3}", "CPU s/GiB engine (both procs)", engine_cpu / gibs);
    if let Some(out) = out {
        if let Some(p) = out.parent() {
            std::fs::create_dir_all(p).unwrap();
        }
        std::fs::write(&out, json).unwrap();
        println!("wrote {}", out.display());
    } else {
        print!("{json}");
    }
}
