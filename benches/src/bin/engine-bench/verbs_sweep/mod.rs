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
mod measure;

#[cfg(test)]
mod tests;
