//! shm vs tcp loopback at the connection level: ping-pong latency of small messages and
//! one-way throughput of 1 MiB and 16 MiB messages, shm with single copy (process_vm_readv)
//! and through the segment, tcp as length-prefixed messages on a loopback socket. Both ends
//! are threads of this process (for shm the same code path as between processes; single copy
//! needs no ptrace permission within one process). Rounds interleave the transports; the
//! JSON gives the median and the range of the rounds.
//!
//! `cargo run --release -p rdma-shuffle-provider-shm --example shm_bench [rounds]`

use rdma_shuffle_provider_shm::{unique_name, ShmConfig, ShmConn, ShmConnecting, ShmListener};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

trait Pipe: Send {
    fn send(&mut self, m: Vec<u8>);
    fn recv(&mut self) -> Vec<u8>;
}

/// An shm connection and what arrived while it waited to send.
struct ShmPipe(ShmConn, std::collections::VecDeque<Vec<u8>>);

impl Pipe for ShmPipe {
    fn send(&mut self, m: Vec<u8>) {
        self.0.send(m).unwrap();
        // Into the ring; a message lent by reference is freed when the peer has copied it.
        let got = self.0.push_all(T).unwrap();
        self.1.extend(got);
    }
    fn recv(&mut self) -> Vec<u8> {
        match self.1.pop_front() {
            Some(m) => m,
            None => self.0.recv_timeout(T).unwrap(),
        }
    }
}

impl Pipe for TcpStream {
    fn send(&mut self, m: Vec<u8>) {
        self.write_all(&(m.len() as u64).to_le_bytes()).unwrap();
        self.write_all(&m).unwrap();
    }
    fn recv(&mut self) -> Vec<u8> {
        let mut l = [0u8; 8];
        self.read_exact(&mut l).unwrap();
        let mut m = vec![0u8; u64::from_le_bytes(l) as usize];
        self.read_exact(&mut m).unwrap();
        m
    }
}

fn shm_pair(single_copy: bool) -> (Box<dyn Pipe>, Box<dyn Pipe>) {
    let cfg = ShmConfig { single_copy, ..ShmConfig::default() };
    let l = ShmListener::bind(&unique_name()).unwrap();
    let name = l.name().to_string();
    let c2 = cfg.clone();
    let h = std::thread::spawn(move || l.accept_blocking(&c2, T).unwrap());
    let c = ShmConnecting::connect_blocking(&name, &cfg, T).unwrap();
    (Box::new(ShmPipe(h.join().unwrap(), Default::default())), Box::new(ShmPipe(c, Default::default())))
}

fn tcp_pair() -> (Box<dyn Pipe>, Box<dyn Pipe>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    c.set_nodelay(true).unwrap();
    s.set_nodelay(true).unwrap();
    (Box::new(s), Box::new(c))
}

/// Mean round trip of `n` ping-pongs of `size` bytes, in µs.
fn pingpong(pair: (Box<dyn Pipe>, Box<dyn Pipe>), size: usize, n: usize) -> f64 {
    let (mut a, mut b) = pair;
    let echo = std::thread::spawn(move || {
        for _ in 0..n {
            let m = a.recv();
            a.send(m);
        }
    });
    let start = Instant::now();
    for _ in 0..n {
        b.send(vec![1u8; size]);
        b.recv();
    }
    let t = start.elapsed();
    echo.join().unwrap();
    t.as_secs_f64() * 1e6 / n as f64
}

/// GB/s of `n` messages of `size` bytes one way (acknowledged at the end).
fn throughput(pair: (Box<dyn Pipe>, Box<dyn Pipe>), size: usize, n: usize) -> f64 {
    let (mut a, mut b) = pair;
    let sink = std::thread::spawn(move || {
        let mut got = 0usize;
        for _ in 0..n {
            got += a.recv().len();
        }
        a.send(vec![0]);
        got
    });
    let msg = vec![5u8; size];
    let start = Instant::now();
    for _ in 0..n {
        b.send(msg.clone());
    }
    b.recv();
    let t = start.elapsed();
    assert_eq!(sink.join().unwrap(), size * n);
    (size * n) as f64 / t.as_secs_f64() / 1e9
}

fn stats(v: &mut [f64]) -> String {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    format!("{{\"median\": {:.3}, \"min\": {:.3}, \"max\": {:.3}}}", v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let kinds = ["shm_single_copy", "shm_through_segment", "tcp_loopback"];
    let pair = |k: &str| match k {
        "shm_single_copy" => shm_pair(true),
        "shm_through_segment" => shm_pair(false),
        _ => tcp_pair(),
    };
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut mb1: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut mb16: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for _ in 0..rounds {
        for (i, k) in kinds.iter().enumerate() {
            lat[i].push(pingpong(pair(k), 8, 20_000));
            mb1[i].push(throughput(pair(k), 1 << 20, 256));
            mb16[i].push(throughput(pair(k), 16 << 20, 16));
        }
    }
    let mut out = Vec::new();
    for (i, k) in kinds.iter().enumerate() {
        out.push(format!(
            "  \"{k}\": {{\"pingpong_8B_rtt_us\": {}, \"1MiB_GBps\": {}, \"16MiB_GBps\": {}}}",
            stats(&mut lat[i]),
            stats(&mut mb1[i]),
            stats(&mut mb16[i])
        ));
    }
    println!("{{\n  \"rounds\": {rounds},\n{}\n}}", out.join(",\n"));
}
