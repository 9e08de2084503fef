//! A small TCP key-value store where ranks meet (`MASTER_ADDR`, `MASTER_PORT`), in the spirit
//! of torch's `TCPStore`: rank 0 serves it, every rank publishes its mesh address and reads
//! the others'. Reads block (on the server) until the key exists, bounded by the caller's
//! deadline.
//!
//! Wire format, both ways: `op u8 | key len u32 | key | value len u32 | value`. Ops: `SET`
//! (reply: empty `OK`) and `GET` (reply: `OK` with the value once the key exists).

use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_OK: u8 = 0x80;
/// Longest key or value accepted.
const MAX_FIELD: usize = 64 * 1024;

#[derive(Default)]
struct Data {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    cond: Condvar,
    stop: AtomicBool,
}

/// The store server (rank 0). Stops when dropped.
pub struct StoreServer {
    data: Arc<Data>,
    listener: Arc<TcpListener>,
    addr: SocketAddr,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Serves on `addr`. The error names the address (a port in use is the usual cause).
    pub fn bind(addr: SocketAddr) -> Result<Self, String> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            format!("cannot serve the rendezvous store on {addr}: {e} (choose a free MASTER_PORT, or stop the process using it)")
        })?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let listener = Arc::new(listener);
        let data = Arc::new(Data::default());
        let (l, d) = (listener.clone(), data.clone());
        let thread = std::thread::Builder::new()
            .name("mobius-store".into())
            .spawn(move || {
                for conn in l.incoming() {
                    if d.stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let d = d.clone();
                    let _ = std::thread::Builder::new().name("mobius-store-conn".into()).spawn(move || serve(conn, d));
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(StoreServer { data, listener, addr, thread: Some(thread) })
    }

    /// The address it serves on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.data.stop.store(true, Ordering::Release);
        self.data.cond.notify_all();
        // shutdown(2) wakes the thread blocked in accept(2).
        // SAFETY: a plain syscall on a socket this server owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read_field(s: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let n = u32::from_be_bytes(n) as usize;
    if n > MAX_FIELD {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("store field of {n} bytes")));
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn write_msg(s: &mut impl Write, op: u8, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut b = Vec::with_capacity(9 + key.len() + value.len());
    b.push(op);
    b.extend_from_slice(&(key.len() as u32).to_be_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(&(value.len() as u32).to_be_bytes());
    b.extend_from_slice(value);
    s.write_all(&b)
}

fn serve(mut s: TcpStream, d: Arc<Data>) {
    let _ = s.set_nodelay(true);
    loop {
        let mut op = [0u8; 1];
        if s.read_exact(&mut op).is_err() {
            return;
        }
        let (Ok(key), Ok(value)) = (read_field(&mut s), read_field(&mut s)) else { return };
        let reply = match op[0] {
            OP_SET => {
                d.map.lock().insert(key.clone(), value);
                d.cond.notify_all();
                Vec::new()
            }
            OP_GET => {
                let mut m = d.map.lock();
                loop {
                    if let Some(v) = m.get(&key) {
                        break v.clone();
                    }
                    if d.stop.load(Ordering::Acquire) {
                        return;
                    }
                    // The client bounds its own wait; wake now and then to notice `stop`.
                    d.cond.wait_for(&mut m, Duration::from_millis(200));
                }
            }
            _ => return,
        };
        if write_msg(&mut s, OP_OK, &key, &reply).is_err() {
            return;
        }
    }
}

/// A connection to the store.
pub struct StoreClient {
    stream: TcpStream,
    addr: SocketAddr,
}

impl StoreClient {
    /// Connects to the store at `addr`, retrying until `deadline` (rank 0 may start later).
    pub fn connect(addr: SocketAddr, deadline: Instant) -> Result<Self, String> {
        let mut last = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "could not reach the rendezvous store at {addr} before the timeout ({last}); is rank 0 running, and are \
                     MASTER_ADDR/MASTER_PORT the same on every rank?"
                ));
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(StoreClient { stream, addr });
                }
                Err(e) => {
                    last = e.to_string();
                    std::thread::sleep(Duration::from_millis(50).min(left));
                }
            }
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), String> {
        self.stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        write_msg(&mut self.stream, OP_SET, key.as_bytes(), value).map_err(|e| format!("store {}: {e}", self.addr))?;
        self.reply(key).map(|_| ())
    }

    /// Gets `key`, waiting until some rank sets it or `deadline` passes (`Ok(None)`).
    pub fn get(&mut self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>, String> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        self.stream.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        write_msg(&mut self.stream, OP_GET, key.as_bytes(), &[]).map_err(|e| format!("store {}: {e}", self.addr))?;
        match self.reply(key) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.contains("timed out") || e.contains("would block") => {
                // The request is still pending on the server; this connection is done.
                let _ = self.stream.shutdown(Shutdown::Both);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn reply(&mut self, key: &str) -> Result<Vec<u8>, String> {
        let err = |e: io::Error| {
            if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                format!("store {}: timed out", self.addr)
            } else {
                format!("store {} (key {key}): {e}", self.addr)
            }
        };
        let mut op = [0u8; 1];
        self.stream.read_exact(&mut op).map_err(err)?;
        let _ = read_field(&mut self.stream).map_err(err)?;
        let v = read_field(&mut self.stream).map_err(err)?;
        if op[0] != OP_OK {
            return Err(format!("store {} answered an unknown op {}", self.addr, op[0]));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_waits_for_a_later_set_and_times_out_when_nobody_sets() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr();
        let soon = || Instant::now() + Duration::from_secs(10);
        let t = std::thread::spawn(move || {
            let mut c = StoreClient::connect(addr, soon()).unwrap();
            c.get("a", soon()).unwrap()
        });
        std::thread::sleep(Duration::from_millis(100));
        let mut c = StoreClient::connect(addr, soon()).unwrap();
        c.set("a", b"hello").unwrap();
        assert_eq!(t.join().unwrap().as_deref(), Some(&b"hello"[..]));
        let started = Instant::now();
        assert_eq!(c.get("never", Instant::now() + Duration::from_millis(300)).unwrap(), None);
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(server);
        let e = StoreClient::connect(addr, Instant::now() + Duration::from_millis(300)).err().unwrap();
        assert!(e.contains("MASTER_ADDR"), "{e}");
    }
}
