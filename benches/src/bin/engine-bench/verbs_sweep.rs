//! `engine-bench verbs-sweep`: eager SEND against rendezvous RDMA READ, block size by block
//! size, on one RDMA device (SoftRoCE's `rxe0` inside the VM: `scripts/bench-engine.sh
//! --provider verbs` boots it and runs this).
//!
//! For every size two set-ups run side by side in this process, each with its own server and
//! client `VerbsProvider` on the same device (queue pairs on one device reach each other
//! through its loopback, as two executors on one host would):
//! * **SEND** — the server's eager threshold is the block size, so every block travels inline
//!   in one SEND; both providers' message buffers (`max_message`) hold a block plus its frame.
//! * **READ** — the eager threshold is below the smallest size, so every block is announced by
//!   a descriptor and the client pulls it with one RDMA READ into a registered pool buffer.
//!
//! Each set-up first fetches as many blocks as the server lets be in flight (this connects and
//! grows the pool to its working size, so the timed part pays for neither), then measures
//! throughput by fetching all blocks in one request, repeated until `--secs` have passed
//! (server credits bound how many blocks are in flight), then the latency of one block at a
//! time. The set-ups take turns (a round of SEND, a round of READ, …; a SEND sample, a READ
//! sample, …), so a machine whose speed drifts during the run treats both alike. Every
//! fetched block is compared with the data file (a memcmp, small next to moving the block
//! under emulation), and the server's and client's counters prove which path every block
//! took.
//!
//! Only the measurement needs the `verbs` feature; sizes, the crossover and the report are
//! plain code, tested on any host.
// Without the verbs feature only the report half is used (and tested).
#![cfg_attr(not(feature = "verbs"), allow(dead_code))]

use std::fmt::Write as _;
use std::path::PathBuf;
use thiserror::Error;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// The sizes of the sweep: 4 KiB … 16 MiB.
pub const DEFAULT_SIZES: [usize; 7] = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB];

/// Eager threshold of the READ set-ups: below every size the sweep accepts, so no block of
/// the sweep is sent inline there.
pub const READ_EAGER_THRESHOLD: usize = 1024;

/// Room for a frame's header next to an eager payload in one message buffer.
const FRAME_ROOM: usize = 8 * KIB;

/// What can go wrong; every variant says which size and path, and what to change.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SweepError {
    /// A command-line argument is malformed or out of range.
    #[error("verbs-sweep: {0}")]
    Usage(String),
    /// This binary was built without the verbs provider.
    #[cfg_attr(feature = "verbs", allow(dead_code))]
    #[error("verbs-sweep needs the verbs provider: build with `cargo build --release -p rdma-shuffle-bench --features verbs`")]
    NoVerbs,
    /// Writing or reading the benchmark's files failed.
    #[error("verbs-sweep: {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Opening the device, binding the server, registering files or building the pool failed.
    #[error("{path} path, {size}-byte blocks: setting up: {message}")]
    Setup {
        /// SEND or READ.
        path: PathKind,
        /// Block size.
        size: usize,
        /// What failed.
        message: String,
    },
    /// Blocks failed, came back wrong, or the fetch stalled.
    #[error("{path} path, {size}-byte blocks: {message}")]
    Fetch {
        /// SEND or READ.
        path: PathKind,
        /// Block size.
        size: usize,
        /// What failed.
        message: String,
    },
    /// The counters show blocks took the other path than the set-up forces.
    #[error(
        "{path} path, {size}-byte blocks: the server sent {eager} blocks inline and {rendezvous} by descriptor \
         ({reads} one-sided reads): the set-up did not force the path"
    )]
    PathNotForced {
        /// The path the set-up meant to force.
        path: PathKind,
        /// Block size.
        size: usize,
        /// Blocks the server sent inline.
        eager: u64,
        /// Blocks the server announced by descriptor.
        rendezvous: u64,
        /// Blocks the client read one-sidedly.
        reads: u64,
    },
}

/// The two ways a block can travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    /// Inline in one SEND (eager).
    Send,
    /// Descriptor, then one RDMA READ by the client (rendezvous).
    Read,
}

impl std::fmt::Display for PathKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PathKind::Send => "SEND",
            PathKind::Read => "READ",
        })
    }
}

/// Settings of a sweep (`engine-bench verbs-sweep --help` lists the flags).
#[derive(Clone, Debug)]
pub struct SweepConfig {
    /// Block sizes, increasing.
    pub sizes: Vec<usize>,
    /// Bytes of blocks per size (the data file), at most.
    pub max_bytes: usize,
    /// Blocks per size, at most.
    pub max_blocks: usize,
    /// Each throughput measurement repeats whole-set fetches until this much time has passed.
    pub min_secs: f64,
    /// Latency: at most this many samples …
    pub lat_max: usize,
    /// … at least this many …
    pub lat_min: usize,
    /// … and no more once this much time has passed.
    pub lat_secs: f64,
    /// RDMA device (`None`: the first with an active port).
    pub device: Option<String>,
    /// GID index (`None`: the first RoCEv2 IPv4-mapped one).
    pub gid_index: Option<u8>,
    /// Obsolete: READs are posted asynchronously by the driver, bounded by bytes in flight and
    /// the pool, not by threads. Accepted (and reported) for compatibility, otherwise unused.
    pub pull_threads: usize,
    /// Where data files are written (tmpfs in the VM, so they count against its memory).
    pub dir: PathBuf,
    /// Where the JSON report goes (`None`: stdout).
    pub out: Option<PathBuf>,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            sizes: DEFAULT_SIZES.to_vec(),
            max_bytes: 64 * MIB,
            max_blocks: 256,
            min_secs: 2.0,
            lat_max: 200,
            lat_min: 10,
            lat_secs: 3.0,
            device: None,
            gid_index: None,
            pull_threads: 0,
            dir: std::env::temp_dir(),
            out: None,
        }
    }
}

/// Usage text of the `verbs-sweep` mode.
pub const USAGE: &str = "engine-bench verbs-sweep [--out FILE] [--device NAME] [--gid-index N] [--sizes 4k,16k,...]
    [--max-mib N] [--max-blocks N] [--pull-threads N] [--secs S] [--lat-samples MIN:MAX] [--lat-secs S] [--dir DIR]";

/// Parses `4096`, `4k`, `16K`, `1m`, `16MiB` into bytes.
pub fn parse_size(s: &str) -> Result<usize, SweepError> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.strip_suffix("ib").or_else(|| t.strip_suffix('b')).unwrap_or(&t);
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], KIB),
        Some('m') => (&t[..t.len() - 1], MIB),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|n| *n > 0)
        .ok_or_else(|| SweepError::Usage(format!("'{s}' is not a size (examples: 4096, 4k, 1m)")))
}

impl SweepConfig {
    /// Builds the settings from `args` (the words after `verbs-sweep`).
    pub fn from_args(args: &[String]) -> Result<Self, SweepError> {
        let mut c = SweepConfig::default();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value =
                || it.next().cloned().ok_or_else(|| SweepError::Usage(format!("{flag} needs a value; usage: {USAGE}")));
            let num = |v: String, what: &str| {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| SweepError::Usage(format!("{what}: '{v}' is not a positive number")))
            };
            match flag.as_str() {
                "--out" => c.out = Some(PathBuf::from(value()?)),
                "--dir" => c.dir = PathBuf::from(value()?),
                "--device" => c.device = Some(value()?).filter(|d| !d.is_empty()),
                "--gid-index" => {
                    let v = value()?;
                    c.gid_index = if v.is_empty() {
                        None
                    } else {
                        Some(v.parse().map_err(|_| SweepError::Usage(format!("--gid-index: '{v}' is not 0..255")))?)
                    }
                }
                "--sizes" => c.sizes = value()?.split(',').map(parse_size).collect::<Result<_, _>>()?,
                "--max-mib" => c.max_bytes = (num(value()?, "--max-mib")? * MIB as f64) as usize,
                "--max-blocks" => c.max_blocks = num(value()?, "--max-blocks")? as usize,
                "--pull-threads" => c.pull_threads = num(value()?, "--pull-threads")? as usize,
                "--secs" => c.min_secs = num(value()?, "--secs")?,
                "--lat-secs" => c.lat_secs = num(value()?, "--lat-secs")?,
                "--lat-samples" => {
                    let v = value()?;
                    let (lo, hi) = v.split_once(':').unwrap_or((&v, &v));
                    match (lo.parse::<usize>(), hi.parse::<usize>()) {
                        (Ok(lo), Ok(hi)) if lo >= 1 && lo <= hi => (c.lat_min, c.lat_max) = (lo, hi),
                        _ => return Err(SweepError::Usage(format!("--lat-samples: '{v}' is not MIN:MAX with 1 <= MIN <= MAX"))),
                    }
                }
                "-h" | "--help" => return Err(SweepError::Usage(format!("usage: {USAGE}"))),
                other => return Err(SweepError::Usage(format!("unknown argument '{other}'; usage: {USAGE}"))),
            }
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), SweepError> {
        if self.sizes.is_empty() {
            return Err(SweepError::Usage("--sizes is empty".into()));
        }
        if self.sizes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(SweepError::Usage(format!("--sizes must increase, got {:?}", self.sizes)));
        }
        // The READ set-ups must send no block inline; the provider accepts messages (block +
        // frame) up to 64 MiB.
        let (lo, hi) = (self.sizes[0], self.sizes[self.sizes.len() - 1]);
        if lo <= READ_EAGER_THRESHOLD || hi + FRAME_ROOM > 64 * MIB {
            return Err(SweepError::Usage(format!(
                "--sizes must lie in {} bytes .. {} bytes (the READ eager threshold .. the verbs message limit), got {lo} .. {hi}",
                READ_EAGER_THRESHOLD + 1,
                64 * MIB - FRAME_ROOM
            )));
        }
        if self.max_blocks == 0 || self.lat_min == 0 {
            return Err(SweepError::Usage("--max-blocks and the latency samples must be at least 1".into()));
        }
        Ok(())
    }

    /// Blocks fetched per size: bounded by bytes and by count, at least one.
    pub fn blocks_for(&self, size: usize) -> usize {
        (self.max_bytes / size).clamp(1, self.max_blocks)
    }
}

/// Blocks a server lets one client have in flight: the engine's default (64) where that is
/// cheap, fewer for large blocks so eager blocks in flight stay near 32 MiB, at least 4.
pub fn credits_for(size: usize) -> u32 {
    (32 * MIB / size).clamp(4, 64) as u32
}

/// Receive buffers of each engine on the SEND path: each buffer holds a whole block, so
/// their number is capped to keep one engine's buffers near 64 MiB (the VM has 2 GiB).
pub fn send_path_depth(size: usize) -> u32 {
    (64 * MIB / (size + FRAME_ROOM)).clamp(4, 64) as u32
}

/// The largest message a provider must accept when blocks up to `eager` bytes go inline.
pub fn max_message_for(eager: usize) -> u32 {
    (eager + FRAME_ROOM) as u32
}

/// One size's numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct SizeResult {
    /// Block size in bytes.
    pub bytes: usize,
    /// Blocks per fetch of the throughput measurement.
    pub blocks: usize,
    /// Server credits (blocks in flight) of both set-ups.
    pub credits: u32,
    /// SEND path.
    pub send: PathResult,
    /// READ path.
    pub read: PathResult,
}

/// One path's numbers at one size.
#[derive(Clone, Debug, PartialEq)]
pub struct PathResult {
    /// Throughput of block payload, 10^6 bit/s.
    pub mbps: f64,
    /// Median latency of one block fetched alone, µs.
    pub p50_us: f64,
    /// Latency samples taken.
    pub samples: usize,
    /// Whole-set fetches timed for the throughput.
    pub rounds: usize,
}

/// The smallest size at which READ moves more bytes per second than SEND.
pub fn crossover(results: &[SizeResult]) -> Option<usize> {
    results.iter().find(|r| r.read.mbps > r.send.mbps).map(|r| r.bytes)
}

/// Median of `v` (sorted in place); 0 for no samples.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// What the report says about where it ran.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// RDMA device.
    pub device: String,
    /// Kernel release.
    pub kernel: String,
    /// Wall-clock seconds of the whole sweep.
    pub seconds: f64,
}

/// Formats a size as `4 KiB`, `16 MiB`, or bytes.
pub fn human(bytes: usize) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= KIB && bytes.is_multiple_of(KIB) {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} B")
    }
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// The JSON report (`target/bench/engine-verbs.json`).
pub fn render_json(results: &[SizeResult], info: &RunInfo, cfg: &SweepConfig) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{{");
    let _ = writeln!(o, "  \"provider\": \"verbs\",");
    let _ = writeln!(o, "  \"device\": {},", json_str(&info.device));
    let _ = writeln!(o, "  \"kernel\": {},", json_str(&info.kernel));
    let _ = writeln!(
        o,
        "  \"note\": {},",
        json_str(
            "SoftRoCE (rdma_rxe) inside a qemu TCG guest: emulation speeds. Compare SEND with READ within one run; \
             the absolute numbers say nothing about RDMA hardware."
        )
    );
    let _ = writeln!(
        o,
        "  \"units\": {},",
        json_str("*_mbps: block payload throughput in 10^6 bit/s, all blocks of a size requested at once; *_p50_us: median microseconds to fetch one block alone")
    );
    let _ = writeln!(o, "  \"read_eager_threshold\": {READ_EAGER_THRESHOLD},");
    let _ = writeln!(o, "  \"pull_threads\": {},", cfg.pull_threads);
    match crossover(results) {
        Some(b) => {
            let _ = writeln!(o, "  \"crossover_bytes\": {b},");
        }
        None => {
            let _ = writeln!(o, "  \"crossover_bytes\": null,");
        }
    }
    let _ = writeln!(o, "  \"seconds\": {:.1},", info.seconds);
    let _ = writeln!(o, "  \"sizes\": [");
    for (i, r) in results.iter().enumerate() {
        let _ = writeln!(
            o,
            "    {{\"bytes\": {}, \"send_mbps\": {:.1}, \"read_mbps\": {:.1}, \"send_p50_us\": {:.1}, \"read_p50_us\": {:.1}, \
             \"blocks\": {}, \"credits\": {}, \"send_rounds\": {}, \"read_rounds\": {}, \"send_samples\": {}, \"read_samples\": {}}}{}",
            r.bytes,
            r.send.mbps,
            r.read.mbps,
            r.send.p50_us,
            r.read.p50_us,
            r.blocks,
            r.credits,
            r.send.rounds,
            r.read.rounds,
            r.send.samples,
            r.read.samples,
            if i + 1 < results.len() { "," } else { "" }
        );
    }
    let _ = writeln!(o, "  ]");
    let _ = writeln!(o, "}}");
    o
}

/// The short table printed at the end.
pub fn render_table(results: &[SizeResult], info: &RunInfo) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "eager SEND vs rendezvous RDMA READ on {} (kernel {}; emulation speeds, compare within the run)",
        info.device, info.kernel
    );
    let _ = writeln!(
        o,
        "  {:>7} {:>11} {:>11} {:>7} {:>12} {:>12}",
        "block", "SEND Mb/s", "READ Mb/s", "faster", "SEND p50 us", "READ p50 us"
    );
    for r in results {
        let faster = if r.read.mbps > r.send.mbps { "READ" } else { "SEND" };
        let _ = writeln!(
            o,
            "  {:>7} {:>11.1} {:>11.1} {:>7} {:>12.0} {:>12.0}",
            human(r.bytes),
            r.send.mbps,
            r.read.mbps,
            faster,
            r.send.p50_us,
            r.read.p50_us
        );
    }
    match crossover(results) {
        Some(b) => {
            let _ = writeln!(o, "  crossover: READ beats SEND from {} ({b} bytes)", human(b));
        }
        None => {
            let _ = writeln!(o, "  crossover: none (SEND was faster at every size)");
        }
    }
    let _ = writeln!(o, "  sweep took {:.0} s", info.seconds);
    o
}

/// Runs the sweep and writes the report; prints progress on stderr and the table on stdout.
pub fn run(args: &[String]) -> Result<(), SweepError> {
    let cfg = SweepConfig::from_args(args)?;
    let (results, info) = measure::sweep(&cfg)?;
    let json = render_json(&results, &info, &cfg);
    match &cfg.out {
        Some(out) => {
            if let Some(p) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(p)
                    .map_err(|e| SweepError::Io { what: format!("creating {}", p.display()), source: e })?;
            }
            std::fs::write(out, &json).map_err(|e| SweepError::Io { what: format!("writing {}", out.display()), source: e })?;
        }
        None => print!("{json}"),
    }
    print!("{}", render_table(&results, &info));
    Ok(())
}

#[cfg(not(feature = "verbs"))]
mod measure {
    use super::*;

    pub(super) fn sweep(_cfg: &SweepConfig) -> Result<(Vec<SizeResult>, RunInfo), SweepError> {
        Err(SweepError::NoVerbs)
    }
}

#[cfg(feature = "verbs")]
mod measure {
    use super::*;
    use parking_lot::{Condvar, Mutex};
    use rdma_shuffle_fabric::pool::{PoolConfig, TieredPool};
    use rdma_shuffle_fabric::verbs::{VerbsConfig, VerbsProvider};
    use rdma_shuffle_fabric::{BlockSink, ClientEndpointConfig, FetchedBlock, Provider, ServerEndpointConfig};
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
            let pool =
                TieredPool::new(PoolConfig::default(), cp.registrar()).map_err(|e| fail(format!("building the pool: {e}")))?;
            let ccfg = ClientEndpointConfig {
                max_eager: eager as u32,
                limits,
                name: format!("sweep-{path}-client"),
                ..ClientEndpointConfig::default()
            };
            let client =
                BlockClient::new(Arc::new(cp.clone()), pool, ccfg).map_err(|e| fail(format!("starting the client: {e}")))?;
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
                m.lines()
                    .find_map(|l| l.strip_prefix("MemAvailable:").map(|v| v.trim().trim_end_matches("kB").trim().to_string()))
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
                s.check_path()?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(bytes: usize, send: f64, read: f64) -> SizeResult {
        let p = |mbps| PathResult { mbps, p50_us: 100.0, samples: 30, rounds: 2 };
        SizeResult { bytes, blocks: 4, credits: 8, send: p(send), read: p(read) }
    }

    #[test]
    fn sizes_parse_with_units_and_reject_junk() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("16KiB").unwrap(), 16 << 10);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("16MB").unwrap(), 16 << 20);
        for bad in ["", "0", "k", "4x", "-4k", "99999999999999999999g"] {
            assert!(matches!(parse_size(bad), Err(SweepError::Usage(_))), "{bad} parsed");
        }
    }

    #[test]
    fn arguments_are_checked() {
        let a = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let c = SweepConfig::from_args(&a("--sizes 4k,1m --device rxe0 --gid-index 1 --lat-samples 10:50 --secs 0.5")).unwrap();
        assert_eq!(c.sizes, vec![4096, 1 << 20]);
        assert_eq!((c.device.as_deref(), c.gid_index, c.lat_min, c.lat_max, c.min_secs), (Some("rxe0"), Some(1), 10, 50, 0.5));
        // Empty device / gid (unset variables in the guest) mean "pick one".
        let c = SweepConfig::from_args(&["--device".into(), "".into(), "--gid-index".into(), "".into()]).unwrap();
        assert_eq!((c.device, c.gid_index), (None, None));
        for bad in [
            "--sizes 16k,4k",
            "--sizes 1k",
            "--sizes 64m",
            "--secs 0",
            "--lat-samples 5:2",
            "--gid-index 300",
            "--bogus 1",
            "--out",
        ] {
            let e = SweepConfig::from_args(&a(bad)).unwrap_err();
            assert!(matches!(e, SweepError::Usage(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn block_counts_buffers_and_credits_stay_bounded() {
        let c = SweepConfig::default();
        assert_eq!(c.blocks_for(4096), 256);
        assert_eq!(c.blocks_for(MIB), 64);
        assert_eq!(c.blocks_for(16 * MIB), 4);
        assert_eq!(c.blocks_for(128 * MIB), 1);
        for &s in &DEFAULT_SIZES {
            // One connection's buffers: receive + send on both sides of the pair.
            let per_side = 2 * send_path_depth(s) as u64 * max_message_for(s) as u64;
            assert!(per_side <= 160 * MIB as u64, "{s}: {per_side} bytes of buffers per side");
            assert!((4..=64).contains(&credits_for(s)));
            assert!(max_message_for(s) as usize > s);
        }
        assert_eq!(credits_for(4096), 64);
        assert_eq!(credits_for(16 * MIB), 4);
    }

    #[test]
    fn crossover_is_the_first_size_where_read_is_faster() {
        assert_eq!(crossover(&[res(4096, 50.0, 10.0), res(65536, 80.0, 81.0), res(1 << 20, 90.0, 200.0)]), Some(65536));
        assert_eq!(crossover(&[res(4096, 50.0, 10.0), res(65536, 80.0, 80.0)]), None, "a tie is not a win");
        assert_eq!(crossover(&[]), None);
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn report_has_every_field_the_host_script_reads() {
        let info = RunInfo { device: "rxe0".into(), kernel: "6.1.0-x".into(), seconds: 12.3 };
        let rs = [res(4096, 50.0, 10.0), res(1 << 20, 90.0, 200.0)];
        let cfg = SweepConfig::default();
        let j = render_json(&rs, &info, &cfg);
        for key in [
            "\"device\": \"rxe0\"",
            "\"crossover_bytes\": 1048576",
            "\"note\"",
            "\"bytes\": 4096",
            "\"send_mbps\": 50.0",
            "\"read_mbps\": 200.0",
            "\"send_p50_us\": 100.0",
            "\"read_p50_us\"",
        ] {
            assert!(j.contains(key), "missing {key} in {j}");
        }
        assert!(render_json(&rs[..1], &info, &cfg).contains("\"crossover_bytes\": null"));
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        let t = render_table(&rs, &info);
        assert!(t.contains("4 KiB") && t.contains("1 MiB") && t.contains("READ beats SEND from 1 MiB"), "{t}");
    }
}
