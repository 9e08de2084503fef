//! The sim provider: an in-memory network inside one process. Links carry whole messages
//! over channels (like verbs SEND/RECV), and registered sources can be read one-sidedly
//! with the same checks an RDMA NIC applies (right key, range inside the region), so the
//! protocol suite exercises the verbs-shaped data path without a device.

use crate::error::FabricError;
use crate::link::{Link, Listener, Payload, Placement, Provider, Received, Source, SourceKeys};
use crate::pool::{Lease, NoRegistration, Registrar};
use crossbeam_channel::{bounded, select, unbounded, Receiver, Sender};
use parking_lot::Mutex;
use rdma_shuffle_wire::{Descriptor, Frame, Limits};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Default)]
struct Network {
    listeners: Mutex<HashMap<SocketAddr, Sender<SimLink>>>,
    regions: Mutex<HashMap<u32, Arc<dyn Source>>>,
    next_port: AtomicU16,
    next_rkey: AtomicU32,
    reads: AtomicU64,
    read_bytes: AtomicU64,
}

/// An in-memory provider. Clones share one network: a listener made through one clone is
/// reachable through every other.
#[derive(Debug, Clone)]
pub struct SimProvider {
    net: Arc<Network>,
    one_sided: bool,
}

impl Default for SimProvider {
    fn default() -> Self {
        Self::new(true)
    }
}

impl SimProvider {
    /// A new, empty network. With `one_sided`, rendezvous blocks are read one-sidedly (as on
    /// verbs); without, they are pulled over the link (as on tcp).
    pub fn new(one_sided: bool) -> Self {
        let net = Network { next_port: AtomicU16::new(40000), next_rkey: AtomicU32::new(1), ..Default::default() };
        SimProvider { net: Arc::new(net), one_sided }
    }
}

impl Provider for SimProvider {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, FabricError> {
        let mut addr = addr;
        if addr.port() == 0 {
            addr.set_port(self.net.next_port.fetch_add(1, Ordering::Relaxed));
        }
        let (tx, rx) = unbounded();
        let mut ls = self.net.listeners.lock();
        if ls.contains_key(&addr) {
            return Err(FabricError::io(&addr.to_string(), "listen on", std::io::ErrorKind::AddrInUse.into()));
        }
        ls.insert(addr, tx);
        let (stop_tx, stop_rx) = bounded(1);
        Ok(Box::new(SimListener { addr, rx, stop_tx, stop_rx, net: self.net.clone() }))
    }

    fn connect(&self, addr: SocketAddr, _timeout: Duration) -> Result<Box<dyn Link>, FabricError> {
        let tx = self
            .net
            .listeners
            .lock()
            .get(&addr)
            .cloned()
            .ok_or_else(|| FabricError::io(&addr.to_string(), "connect to", std::io::ErrorKind::ConnectionRefused.into()))?;
        let (a_tx, a_rx) = unbounded();
        let (b_tx, b_rx) = unbounded();
        let client_name = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.net.next_port.fetch_add(1, Ordering::Relaxed));
        let server_side = SimLink::new(client_name.to_string(), b_tx, a_rx, self.clone());
        let client_side = SimLink::new(addr.to_string(), a_tx, b_rx, self.clone());
        tx.send(server_side)
            .map_err(|_| FabricError::io(&addr.to_string(), "connect to", std::io::ErrorKind::ConnectionRefused.into()))?;
        Ok(Box::new(client_side))
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(NoRegistration)
    }

    fn register_source(&self, source: &Arc<dyn Source>) -> Result<SourceKeys, FabricError> {
        let rkey = self.net.next_rkey.fetch_add(1, Ordering::Relaxed);
        self.net.regions.lock().insert(rkey, source.clone());
        Ok(SourceKeys { addr: source.as_bytes().as_ptr() as u64, rkey, handle: rkey as u64 })
    }

    fn deregister_source(&self, keys: &SourceKeys) {
        self.net.regions.lock().remove(&keys.rkey);
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("sim_reads", self.net.reads.load(Ordering::Relaxed)),
            ("sim_read_bytes", self.net.read_bytes.load(Ordering::Relaxed)),
        ]
    }
}

struct SimListener {
    addr: SocketAddr,
    rx: Receiver<SimLink>,
    stop_tx: Sender<()>,
    stop_rx: Receiver<()>,
    net: Arc<Network>,
}

impl Listener for SimListener {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self) -> Result<Box<dyn Link>, FabricError> {
        if !self.net.listeners.lock().contains_key(&self.addr) {
            return Err(FabricError::Shutdown);
        }
        select! {
            recv(self.rx) -> l => l.map(|l| Box::new(l) as Box<dyn Link>).map_err(|_| FabricError::Shutdown),
            recv(self.stop_rx) -> _ => Err(FabricError::Shutdown),
        }
    }

    fn shutdown(&self) {
        self.net.listeners.lock().remove(&self.addr);
        let _ = self.stop_tx.try_send(());
    }
}

struct SimLink {
    peer: String,
    tx: Mutex<Option<Sender<Vec<u8>>>>,
    rx: Receiver<Vec<u8>>,
    stop_tx: Sender<()>,
    stop_rx: Receiver<()>,
    stopped: std::sync::atomic::AtomicBool,
    provider: SimProvider,
}

impl SimLink {
    fn new(peer: String, tx: Sender<Vec<u8>>, rx: Receiver<Vec<u8>>, provider: SimProvider) -> Self {
        let (stop_tx, stop_rx) = bounded(1);
        SimLink { peer, tx: Mutex::new(Some(tx)), rx, stop_tx, stop_rx, stopped: Default::default(), provider }
    }

    fn closed(&self) -> FabricError {
        FabricError::Closed { peer: self.peer.clone() }
    }
}

impl Link for SimLink {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn send(&self, frame: &Frame, payload: Payload<'_>) -> Result<(), FabricError> {
        let mut msg = Vec::with_capacity(64 + payload.len() as usize);
        frame.encode(&mut msg);
        match payload {
            Payload::None => {}
            Payload::Bytes(b) => msg.extend_from_slice(b),
            Payload::Source { source, offset, len } => {
                let b = source.as_bytes();
                let range = offset as usize..(offset + len) as usize;
                let slice =
                    b.get(range).ok_or_else(|| FabricError::Unsupported(format!("{}: payload outside its source", self.peer)))?;
                msg.extend_from_slice(slice);
            }
        }
        self.send_raw(&msg)
    }

    fn recv(&self, limits: &Limits, place: &mut dyn FnMut(&Frame) -> Placement) -> Result<Received, FabricError> {
        if self.stopped.load(Ordering::Acquire) {
            return Err(self.closed());
        }
        let msg = select! {
            recv(self.rx) -> m => m.map_err(|_| self.closed())?,
            recv(self.stop_rx) -> _ => return Err(self.closed()),
        };
        let (frame, off) =
            Frame::decode_message(&msg, limits).map_err(|e| FabricError::Frame { peer: self.peer.clone(), source: e })?;
        if frame.kind().payload_offset().is_none() {
            return Ok(Received { frame, payload: None });
        }
        let body = &msg[off..];
        match place(&frame) {
            Placement::Into { mut lease, at } => {
                let dst = lease.get_mut(at..at + body.len()).ok_or_else(|| {
                    FabricError::Unsupported(format!("{}: payload of {} bytes does not fit its buffer", self.peer, body.len()))
                })?;
                dst.copy_from_slice(body);
                Ok(Received { frame, payload: Some(lease) })
            }
            Placement::Discard => Ok(Received { frame, payload: None }),
            Placement::Abort(e) => Err(e),
        }
    }

    fn one_sided_read(&self) -> bool {
        self.provider.one_sided
    }

    fn read_remote(&self, desc: &Descriptor, dst: &mut Lease) -> Result<(), FabricError> {
        if !self.provider.one_sided {
            return Err(FabricError::Unsupported(format!("{}: one-sided reads are off on this sim network", self.peer)));
        }
        let src = self.provider.net.regions.lock().get(&desc.rkey).cloned();
        let remote_err = |what: &str| FabricError::Provider {
            provider: "sim",
            message: format!("remote access error reading from {}: {what}", self.peer),
        };
        let src = src.ok_or_else(|| remote_err(&format!("rkey {} is not registered", desc.rkey)))?;
        let bytes = src.as_bytes();
        let base = bytes.as_ptr() as u64;
        let start = desc.addr.checked_sub(base).ok_or_else(|| remote_err("address below the region"))?;
        let end = start
            .checked_add(desc.len)
            .filter(|e| *e <= bytes.len() as u64)
            .ok_or_else(|| remote_err("range past the region"))?;
        if dst.len() < desc.len as usize {
            return Err(remote_err("local buffer shorter than the read"));
        }
        dst[..desc.len as usize].copy_from_slice(&bytes[start as usize..end as usize]);
        self.provider.net.reads.fetch_add(1, Ordering::Relaxed);
        self.provider.net.read_bytes.fetch_add(desc.len, Ordering::Relaxed);
        Ok(())
    }

    fn send_raw(&self, bytes: &[u8]) -> Result<(), FabricError> {
        let tx = self.tx.lock();
        let tx = tx.as_ref().ok_or_else(|| self.closed())?;
        tx.send(bytes.to_vec()).map_err(|_| self.closed())
    }

    fn shutdown(&self) {
        // Dropping our sender ends the peer's receive side; the stop signal ends ours.
        self.stopped.store(true, Ordering::Release);
        self.tx.lock().take();
        let _ = self.stop_tx.try_send(());
    }
}

impl Drop for SimLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}
