//! Pieces shared by the engine benchmarks (`engine-bench`, `scale-bench`): readings of a
//! process from `/proc`, child processes driven by lines on their stdin and stdout, a block
//! sink that waits for a fetch, the engine's counters, and the small statistics the reports
//! use.
#![deny(missing_docs)]

use parking_lot::{Condvar, Mutex};
use rdma_shuffle_shuffle::blocks::{BlockSink, FetchedBlock};
use rdma_shuffle_wire::BlockFailure;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Readings of a process from `/proc`.
pub mod procfs {
    use std::io;

    /// CPU seconds (user + system, every thread) a process has used, from `/proc/PID/stat`;
    /// 0 when the process is gone.
    pub fn cpu_seconds(pid: u32) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The command name is in parentheses and may hold spaces: fields are counted after it.
        // utime and stime are fields 14 and 15 of the line, the 12th and 13th after it.
        stat_cpu(stat.rsplit_once(')').map(|(_, r)| r).unwrap_or(""))
    }

    /// CPU seconds of each live thread of `pid`, summed by thread name (`comm`, as `top -H`
    /// shows it), from `/proc/PID/task/*/stat`; empty when the process is gone.
    pub fn thread_cpu(pid: u32) -> std::collections::BTreeMap<String, f64> {
        let mut m = std::collections::BTreeMap::new();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return m };
        for t in tasks.flatten() {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            let Some((head, rest)) = stat.rsplit_once(')') else { continue };
            let name = head.split_once('(').map(|(_, n)| n).unwrap_or("?").to_string();
            *m.entry(name).or_insert(0.0) += stat_cpu(rest);
        }
        m
    }

    /// utime + stime in seconds from the part of a `stat` line after the command name.
    fn stat_cpu(rest: &str) -> f64 {
        let f: Vec<&str> = rest.split_whitespace().collect();
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (t(11) + t(12)) / ticks.max(1.0)
    }

    /// Scheduler counts of a process, summed over its threads.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Sched {
        /// Context switches (voluntary and involuntary), `nr_switches` of
        /// `/proc/PID/task/TID/sched` (the same events as perf's `context-switches`).
        pub switches: u64,
        /// Moves from one CPU to another, `se.nr_migrations` (perf's `cpu-migrations`); 0
        /// when the kernel does not publish it (no `CONFIG_SCHED_DEBUG`).
        pub migrations: u64,
    }

    impl Sched {
        /// What happened between `before` and `self`.
        pub fn since(self, before: Sched) -> Sched {
            Sched {
                switches: self.switches.saturating_sub(before.switches),
                migrations: self.migrations.saturating_sub(before.migrations),
            }
        }
    }

    /// `pid`'s [`Sched`] now, over its live threads (a thread that ended is not counted: the
    /// benchmarks measure long-lived threads); zeros when the process is gone.
    pub fn sched(pid: u32) -> Sched {
        let mut total = Sched::default();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return total };
        for t in tasks.flatten() {
            let one = task_sched(&t.path());
            total.switches += one.switches;
            total.migrations += one.migrations;
        }
        total
    }

    /// One thread's switches and migrations, from its `/proc/<pid>/task/<tid>` directory.
    pub fn task_sched(dir: &std::path::Path) -> Sched {
        let mut one = Sched::default();
        let field = |text: &str, name: &str| -> Option<u64> {
            text.lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.rsplit(':').next())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map(|v| v as u64)
        };
        match std::fs::read_to_string(dir.join("sched")) {
            Ok(text) => {
                one.switches = field(&text, "nr_switches").unwrap_or(0);
                one.migrations = field(&text, "se.nr_migrations").unwrap_or(0);
            }
            Err(_) => {
                // No sched file: the status file's two switch counts still give the total.
                let text = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
                one.switches = field(&text, "voluntary_ctxt_switches").unwrap_or(0)
                    + field(&text, "nonvoluntary_ctxt_switches").unwrap_or(0);
            }
        }
        one
    }

    /// What a process holds at one moment.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Footprint {
        /// Threads (`Threads:` of `/proc/PID/status`).
        pub threads: u64,
        /// Open file descriptors (entries of `/proc/PID/fd`).
        pub fds: u64,
        /// Resident set size in bytes (`VmRSS:`).
        pub rss_bytes: u64,
        /// Pinned memory in bytes (`VmPin:`): what RDMA memory registration pins (the kernel's
        /// `ib_umem_get` accounts registered pages there), 0 without verbs.
        pub vm_pin_bytes: u64,
    }

    /// Reads `pid`'s [`Footprint`].
    pub fn footprint(pid: u32) -> io::Result<Footprint> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
        Ok(Footprint { threads: field("Threads:"), fds, rss_bytes: field("VmRSS:") * 1024, vm_pin_bytes: field("VmPin:") * 1024 })
    }
}

/// Waits for the blocks of one or more fetches; counts their bytes and keeps failures.
///
/// Blocks are dropped as soon as they arrive, so their buffers go back to the pool at once,
/// as when a consumer is done with a block.
pub struct Waiter {
    state: Mutex<WaiterState>,
    cv: Condvar,
}

struct WaiterState {
    left: usize,
    done: u64,
    bytes: u64,
    failures: Vec<String>,
}

impl Waiter {
    /// A waiter for `blocks` blocks.
    pub fn new(blocks: usize) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Waiter {
            state: Mutex::new(WaiterState { left: blocks, done: 0, bytes: 0, failures: Vec::new() }),
            cv: Condvar::new(),
        })
    }

    /// Waits until every block arrived or failed; fails when one failed, or when no block
    /// completed for `stall`. Returns the bytes received.
    pub fn wait(&self, stall: Duration) -> Result<u64, String> {
        let mut s = self.state.lock();
        let mut last = s.done;
        let mut since = Instant::now();
        while s.left > 0 {
            self.cv.wait_for(&mut s, Duration::from_millis(200));
            if s.done != last {
                (last, since) = (s.done, Instant::now());
            } else if since.elapsed() > stall {
                return Err(format!("fetch stalled: {} blocks outstanding, none completed for {} s", s.left, stall.as_secs()));
            }
        }
        match s.failures.first() {
            Some(f) => Err(format!("{} blocks failed; first: {f}", s.failures.len())),
            None => Ok(s.bytes),
        }
    }
}

impl BlockSink for Waiter {
    fn on_block(&self, index: usize, result: Result<FetchedBlock, BlockFailure>) {
        let mut s = self.state.lock();
        match result {
            Ok(b) => s.bytes += b.len() as u64,
            Err(e) => s.failures.push(format!("block {index}: {e}")),
        }
        s.left = s.left.saturating_sub(1);
        s.done += 1;
        if s.left == 0 {
            self.cv.notify_all();
        }
    }

    /// A counter under a short lock and a notify: cheap enough for the loop thread (as a
    /// consumer that queues the block for another thread is).
    fn inline(&self) -> bool {
        true
    }
}

/// A child process speaking a line protocol: commands on its stdin, answers one per line on
/// its stdout (read by a thread, so reads can time out); its stderr goes to ours. Its stdin is
/// closed when it is dropped (the benchmarks' servers stop at the end of their input), and it
/// is killed if it has not exited 3 s later.
pub struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Proc {
    /// Starts `cmd` under `name` (which errors use).
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Proc, String> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {name} ({cmd:?}): {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Proc { name: name.into(), stdin: child.stdin.take(), child, lines: rx })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The name errors use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The next line of output, waiting at most `timeout`.
    pub fn line(&mut self, timeout: Duration) -> Result<String, String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => Err(format!("{}: no answer within {} s", self.name, timeout.as_secs())),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!("{} exited ({status}); its errors are above", self.name))
            }
        }
    }

    /// Every line printed since the last call, without waiting.
    pub fn drain(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.lines.try_recv().ok()).collect()
    }

    /// Waits for the `ready ...` line; returns the words after `ready`.
    pub fn ready(&mut self, timeout: Duration) -> Result<Vec<String>, String> {
        let l = self.line(timeout)?;
        match l.strip_prefix("ready") {
            Some(rest) => Ok(rest.split_whitespace().map(String::from).collect()),
            None => Err(format!("{}: expected 'ready ...', got '{l}'", self.name)),
        }
    }

    /// Writes one line to the process's stdin.
    pub fn send(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or_else(|| format!("{}: stdin closed", self.name))?;
        writeln!(stdin, "{line}").and_then(|_| stdin.flush()).map_err(|e| format!("{}: sending '{line}': {e}", self.name))
    }

    /// Sends one command and returns the answer's `key=value` words; an answer other than
    /// `ok ...` (e.g. `error <why>`) fails.
    pub fn command(&mut self, cmd: &str, timeout: Duration) -> Result<Vec<(String, String)>, String> {
        self.send(cmd)?;
        let l = self.line(timeout)?;
        match l.strip_prefix("ok ") {
            Some(rest) => Ok(rest
                .split_whitespace()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()),
            None => {
                let short: String = l.chars().take(400).collect();
                Err(format!("{}: '{}' failed: {short}", self.name, cmd.split(' ').next().unwrap_or("")))
            }
        }
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The engine's counters (`Engine::stats_text`, `key=value` lines) as numbers; keys whose
/// value is not a number (`transport=tcp`) are left out.
pub fn parse_counters(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .filter_map(|(k, v)| v.trim().parse::<u64>().ok().map(|v| (k.trim().to_string(), v)))
        .collect()
}

/// Median and range of a set of samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// Median (mean of the middle two for an even count).
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Spread {
    /// The spread of `v`; `None` when it is empty or holds a non-finite value.
    pub fn of(v: &[f64]) -> Option<Spread> {
        if v.is_empty() || v.iter().any(|x| !x.is_finite()) {
            return None;
        }
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
        Some(Spread { median, min: s[0], max: s[n - 1] })
    }
}

/// The `p`-quantile (0..=1) of `v` by the nearest rank; `None` when `v` is empty.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p.clamp(0.0, 1.0) * s.len() as f64).ceil() as usize).clamp(1, s.len());
    Some(s[rank - 1])
}

/// Parses `4096`, `4k`, `16K`, `1m`, `16MiB` into bytes.
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.strip_suffix("ib").or_else(|| t.strip_suffix('b')).unwrap_or(&t);
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>().ok().and_then(|n| n.checked_mul(mul)).filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_and_percentiles() {
        let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        assert_eq!(Spread::of(&[5.0]).unwrap().median, 5.0);
        assert!(Spread::of(&[]).is_none());
        assert!(Spread::of(&[1.0, f64::NAN]).is_none());
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn counters_and_sizes_parse() {
        let c = parse_counters("blocks_served=3\nregistered_bytes=4096\ntransport=tcp\nnoise\n");
        assert_eq!(c.get("blocks_served"), Some(&3));
        assert_eq!(c.get("registered_bytes"), Some(&4096));
        assert!(!c.contains_key("transport"));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("1MiB"), Some(1 << 20));
        assert_eq!(parse_size("0"), None);
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn footprint_of_this_process() {
        let f = procfs::footprint(std::process::id()).unwrap();
        assert!(f.threads >= 1 && f.fds >= 3 && f.rss_bytes > 0, "{f:?}");
        let before = procfs::cpu_seconds(std::process::id());
        // Spin until the kernel has charged this process a clock tick (10 s bound: a loaded
        // machine may give it little of a core).
        let t = Instant::now();
        let mut x = 0u64;
        while procfs::cpu_seconds(std::process::id()) <= before && t.elapsed() < Duration::from_secs(10) {
            for _ in 0..100_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
        assert!(procfs::cpu_seconds(std::process::id()) > before, "10 s of spinning were charged no CPU");
        assert!(procfs::footprint(u32::MAX).is_err());
    }

    #[test]
    fn a_thread_that_sleeps_is_switched_out_and_counted() {
        // This thread's own counts: the process's sum also loses the counts of other tests'
        // threads when they exit meanwhile (cargo runs tests in parallel threads).
        let me = std::path::Path::new("/proc/thread-self");
        let before = procfs::task_sched(me);
        // Each sleep takes the thread off its CPU: at least one switch per sleep.
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let d = procfs::task_sched(me).since(before);
        assert!(d.switches >= 5, "{d:?}");
        assert!(procfs::sched(std::process::id()).switches >= d.switches);
        assert_eq!(procfs::sched(u32::MAX), procfs::Sched::default());
    }
}
