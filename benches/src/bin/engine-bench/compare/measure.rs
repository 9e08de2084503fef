//! The measurements: one timed transfer, and each system's side of it (the engine, Spark's
//! block transfer in two JVMs, iperf3), with the helpers that talk to their processes.

use rdma_shuffle_bench::{procfs, Proc, Waiter};
use rdma_shuffle_shuffle::Engine;
use serde_json::Value;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::data::BlockSet;
use super::{BYTES_IN_FLIGHT, GIB, R, SMALL, SMALL_IN_FLIGHT, STALL};

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

// ------------------------------------------------------------------------------ measurements

/// One timed transfer: seconds, bytes, CPU seconds of both processes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Transfer {
    pub(super) secs: f64,
    pub(super) bytes: u64,
    pub(super) cpu: f64,
}

impl Transfer {
    pub(super) fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.secs / 1e9
    }
    pub(super) fn cpu_per_gib(&self) -> f64 {
        self.cpu / (self.bytes as f64 / GIB)
    }
}

pub(super) struct EngineSide {
    pub(super) engine: Engine,
    pub(super) addr: SocketAddr,
    pub(super) server_pid: u32,
}

impl EngineSide {
    /// Client (this process) and server.
    pub(super) fn pids(&self) -> [u32; 2] {
        [std::process::id(), self.server_pid]
    }

    fn cpu(&self) -> f64 {
        procfs::cpu_seconds(std::process::id()) + procfs::cpu_seconds(self.server_pid)
    }

    pub(super) fn bulk(&self, set: &BlockSet) -> R<Transfer> {
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

    pub(super) fn small_rate(&self, set: &BlockSet, reps: usize) -> R<f64> {
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

    pub(super) fn latency(&self, set: &BlockSet, samples: usize) -> R<Vec<f64>> {
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

pub(super) struct NettySide {
    pub(super) client: Proc,
    pub(super) server: Proc,
    pub(super) info: String,
}

impl NettySide {
    /// Client and server JVMs.
    pub(super) fn pids(&self) -> [u32; 2] {
        [self.client.pid(), self.server.pid()]
    }

    fn cpu(&self) -> f64 {
        procfs::cpu_seconds(self.client.pid()) + procfs::cpu_seconds(self.server.pid())
    }

    pub(super) fn bulk(&mut self, set: &BlockSet) -> R<Transfer> {
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

    pub(super) fn small_rate(&mut self, set: &BlockSet, reps: usize) -> R<f64> {
        let cmd = format!("window {SMALL_IN_FLIGHT} {reps} {}", set.netty_specs()[0]);
        let kv = self.client.command(&cmd, STALL * 4)?;
        let (blocks, bytes) = (get_f(&kv, "blocks")?, get_f(&kv, "bytes")? as u64);
        if bytes != set.bytes() * reps as u64 {
            return Err(format!("Spark (Netty), small blocks: moved {bytes} bytes, expected {}", set.bytes() * reps as u64));
        }
        Ok(blocks / get_f(&kv, "secs")?)
    }

    pub(super) fn latency(&mut self, set: &BlockSet, samples: usize) -> R<Vec<f64>> {
        let kv = self.client.command(&format!("latency {samples} {}", set.netty_specs()[0]), STALL * 4)?;
        let us: Vec<f64> = get(&kv, "us")?.split(',').filter_map(|v| v.parse().ok()).collect();
        if us.len() != samples {
            return Err(format!("Spark (Netty), latency: {} samples, expected {samples}", us.len()));
        }
        Ok(us)
    }
}

/// iperf3's server, and a client run per measurement.
pub(super) struct Iperf {
    bin: String,
    pub(super) port: u16,
    _server: Proc,
}

impl Iperf {
    pub(super) fn start(bin: &str) -> R<Iperf> {
        let port = free_port()?;
        let server = Proc::spawn(
            "iperf3 server",
            Command::new(bin).args(["-s", "-B", "127.0.0.1", "-p", &port.to_string()]).stdout(Stdio::null()),
        )?;
        Ok(Iperf { bin: bin.into(), port, _server: server })
    }

    /// Streams `bytes` in 1 MiB writes; returns the received rate in Gbit/s and both ends' CPU
    /// seconds (iperf3's own `cpu_utilization_percent`).
    pub(super) fn run(&self, bytes: u64) -> R<(f64, f64)> {
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
