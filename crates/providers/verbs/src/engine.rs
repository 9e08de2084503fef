//! What the verbs provider keeps per driver (engine): the completion channel in the loop's
//! poll, one completion queue, one shared receive queue, the send buffers, the routing of
//! completions to connections, and the credit budgets against the shared receive queue.
#![forbid(unsafe_code)]

use crate::config::VerbsConfig;
use crate::sys::{CompChannel, Cq, Device, Qp, QpTimers, SendBuffers, Srq, Wc, WR_RECV, WR_SEND};
use mio::unix::SourceFd;
use mio::Interest;
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_fabric::providers::link::{EngineCtx, ProviderCounters};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A completion routed to its connection.
pub(crate) enum Event {
    /// A message arrived (its bytes, copied out of the receive buffer, which is reposted), or
    /// the receive failed.
    Recv(Result<Vec<u8>, String>),
    /// A send-queue completion.
    Sq(Wc),
}

/// Engine-wide caps on posted reads and binds, so the completion queue can never overflow:
/// its size covers every receive buffer, every send slot, and these.
const MAX_READS: usize = 1024;
const MAX_BINDS: usize = 1024;

/// A loop's verbs engine as the loop and its links hold it. Only the loop's holder calls into
/// links and engine, so the lock is never contended; it is what lets every link reach the
/// shared receive queue, the send buffers and the routing without a type look-up.
pub(crate) type SharedEngine = Arc<parking_lot::Mutex<VerbsEngine>>;

pub(crate) struct VerbsEngine {
    /// The driver's data-plane counters.
    pub(crate) counters: Arc<ProviderCounters>,
    pub(crate) dev: Arc<Device>,
    pub(crate) cfg: VerbsConfig,
    _channel: Arc<CompChannel>,
    pub(crate) cq: Arc<Cq>,
    pub(crate) srq: Srq,
    pub(crate) send: SendBuffers,
    routes: HashMap<u32, u64>,
    inbox: HashMap<u64, VecDeque<Event>>,
    /// Connections waiting for a free send slot.
    send_waiters: VecDeque<u64>,
    /// Receive buffers the server may still grant as credits.
    server_free: i64,
    /// Receive buffers the client may still fill with answers.
    client_free: i64,
    /// Connections with blocks waiting for client room.
    starved: VecDeque<u64>,
    pub(crate) reads: usize,
    pub(crate) binds: usize,
    pub(crate) exposed_bytes: u64,
    wcs: Vec<Wc>,
    next_psn: u32,
}

impl VerbsEngine {
    pub(crate) fn new(dev: Arc<Device>, cfg: VerbsConfig, ctx: EngineCtx<'_>) -> Result<Self, FabricError> {
        let channel = Arc::new(CompChannel::new(&dev)?);
        let cq_size = cfg.recv_buffers as usize + cfg.send_buffers as usize + MAX_READS + MAX_BINDS + 64;
        let cq = Arc::new(Cq::new(&dev, &channel, cq_size)?);
        let srq = Srq::new(&dev, cfg.recv_buffers, cfg.max_message as usize)?;
        let send = SendBuffers::new(&dev, cfg.send_buffers, cfg.max_message as usize)?;
        let fd = channel.fd();
        ctx.registry
            .register(&mut SourceFd(&fd), ctx.token, Interest::READABLE)
            .map_err(|e| FabricError::io("local", "register the completion channel of", e))?;
        let half = (cfg.recv_buffers / 2) as i64;
        tracing::debug!(driver = %ctx.name, recv_buffers = cfg.recv_buffers, send_buffers = cfg.send_buffers,
            max_message = cfg.max_message, "verbs engine ready");
        Ok(VerbsEngine {
            counters: ctx.counters,
            dev,
            _channel: channel,
            cq,
            srq,
            send,
            routes: HashMap::new(),
            inbox: HashMap::new(),
            send_waiters: VecDeque::new(),
            server_free: half,
            // A little headroom: error frames and late answers of closing connections.
            client_free: half - (cfg.recv_buffers as i64 / 16).max(2),
            starved: VecDeque::new(),
            reads: 0,
            binds: 0,
            exposed_bytes: 0,
            wcs: Vec::with_capacity(64),
            next_psn: rand::random::<u32>() & 0xff_ffff,
            cfg,
        })
    }

    /// Bytes this engine has registered: receive and send buffers, exposed regions.
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.srq.bytes() as u64 + self.send.bytes() as u64 + self.exposed_bytes
    }

    /// Largest eager payload this engine's buffers hold.
    pub(crate) fn max_eager(&self) -> u32 {
        self.cfg.max_message - rdma_shuffle_fabric::providers::codec::HEAD_ROOM as u32
    }

    /// Transport timers of this engine's queue pairs.
    pub(crate) fn timers(&self) -> QpTimers {
        QpTimers { min_rnr_timer: self.cfg.min_rnr_timer, rnr_retry: self.cfg.rnr_retry, timeout: 16, retry_cnt: 7 }
    }

    pub(crate) fn new_qp(&mut self) -> Result<(Qp, u32), FabricError> {
        let qp = Qp::new(&self.dev, &self.cq, &self.srq, self.cfg.sq_depth)?;
        let psn = self.next_psn;
        self.next_psn = (self.next_psn.wrapping_add(0x9e37)) & 0xff_ffff;
        Ok((qp, psn))
    }

    pub(crate) fn route(&mut self, qpn: u32, key: u64) {
        self.routes.insert(qpn, key);
    }

    pub(crate) fn unroute(&mut self, qpn: u32, key: u64) {
        if self.routes.get(&qpn) == Some(&key) {
            self.routes.remove(&qpn);
        }
        self.inbox.remove(&key);
        self.send_waiters.retain(|k| *k != key);
        self.starved.retain(|k| *k != key);
    }

    /// The server's credit grant for a client that just authenticated: half of what is left
    /// of the server's share of receive buffers, at least 1 (so a flood of peers can
    /// overcommit the queue by at most one message each; receiver-not-ready retries cover
    /// that).
    pub(crate) fn grant(&mut self, max: u32) -> u32 {
        let g = (self.server_free / 2).clamp(1, max.max(1) as i64);
        self.server_free -= g;
        g as u32
    }

    pub(crate) fn return_grant(&mut self, g: u32) {
        self.server_free += g as i64;
    }

    /// Room for answers the client may request now.
    pub(crate) fn client_room(&self) -> u32 {
        self.client_free.max(0) as u32
    }

    pub(crate) fn take_client_room(&mut self, n: u32) {
        self.client_free -= n as i64;
    }

    /// Answers arrived (or will never come): room comes back. Starved connections go first.
    pub(crate) fn return_client_room(&mut self, n: u32) -> Vec<u64> {
        self.client_free += n as i64;
        if self.client_free > 0 && !self.starved.is_empty() {
            self.starved.drain(..).collect()
        } else {
            Vec::new()
        }
    }

    pub(crate) fn starve(&mut self, key: u64) {
        if !self.starved.contains(&key) {
            self.starved.push_back(key);
        }
    }

    pub(crate) fn wait_for_send_slot(&mut self, key: u64) {
        if !self.send_waiters.contains(&key) {
            self.send_waiters.push_back(key);
        }
    }

    /// The next event of connection `key`.
    pub(crate) fn take_event(&mut self, key: u64) -> Option<Event> {
        self.inbox.get_mut(&key)?.pop_front()
    }

    /// Collects completions: acknowledges channel events, re-arms, polls. Receives are
    /// copied out and reposted at once (the shared queue never waits for a connection to be
    /// handled). Returns the connections that have something to handle.
    pub(crate) fn collect(&mut self) -> Vec<u64> {
        let _ = self.cq.take_events();
        if let Err(e) = self.cq.arm() {
            tracing::error!(error = %e, "re-arming the completion queue failed");
        }
        let mut wcs = std::mem::take(&mut self.wcs);
        self.cq.poll(&mut wcs);
        let mut touched = Vec::new();
        let p = &*self.counters;
        for wc in wcs.drain(..) {
            if !wc.ok() && wc.flushed() {
                p.flushed_completions.fetch_add(1, Ordering::Relaxed);
            }
            if wc.rnr() {
                p.rnr_errors.fetch_add(1, Ordering::Relaxed);
            }
            let key = self.routes.get(&wc.qp_num).copied();
            if wc.wr_id & WR_RECV != 0 {
                let data = if wc.ok() {
                    p.recvs.fetch_add(1, Ordering::Relaxed);
                    self.srq.take(wc.wr_id, wc.byte_len, |b| b.to_vec())
                } else {
                    self.srq.take(wc.wr_id, 0, |_| Vec::new())
                };
                let event = match data {
                    Ok(Some(bytes)) if wc.ok() => Event::Recv(Ok(bytes)),
                    Ok(_) => Event::Recv(Err(format!("receive failed: {}", wc.status_text()))),
                    Err(e) => {
                        tracing::error!(error = %e, "reposting a receive buffer failed");
                        Event::Recv(Err(e.to_string()))
                    }
                };
                if let Some(k) = key {
                    self.inbox.entry(k).or_default().push_back(event);
                    touched.push(k);
                }
                continue;
            }
            if wc.wr_id & WR_SEND != 0 {
                self.send.completed(wc.wr_id);
                if let Some(w) = self.send_waiters.pop_front() {
                    touched.push(w);
                }
            }
            if let Some(k) = key {
                self.inbox.entry(k).or_default().push_back(Event::Sq(wc));
                touched.push(k);
            }
        }
        self.wcs = wcs;
        touched.sort_unstable();
        touched.dedup();
        touched
    }

    /// Whether another READ may be posted engine-wide.
    pub(crate) fn read_room(&self) -> bool {
        self.reads < MAX_READS
    }

    /// Whether another bind may be posted engine-wide.
    pub(crate) fn bind_room(&self) -> bool {
        self.binds < MAX_BINDS
    }
}
