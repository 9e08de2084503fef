//! The serving endpoint: accepts links, runs a [`ServerSession`] per connection on its own
//! thread, resolves blocks through a [`BlockSource`], and sends eager payloads and pulls
//! straight from the sources (no copy on tcp).

use crate::error::FabricError;
use crate::link::{Link, Listener, Payload, Placement, Provider, Source};
use parking_lot::Mutex;
use rdma_shuffle_wire::server::ServerCounters;
use rdma_shuffle_wire::{BlockFailure, BlockSpan, Limits, Resolved, Secret, ServerConfig, ServerOutput, ServerSession};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Maps requested spans to registered bytes. Implemented by the shuffle layer's store.
pub trait BlockSource: Send + Sync {
    /// Where `span`'s bytes are, or why it cannot be served.
    fn resolve(&self, span: &BlockSpan) -> Result<Resolved<Arc<dyn Source>>, BlockFailure>;
}

/// Settings of a serving endpoint.
#[derive(Clone, Debug)]
pub struct ServerEndpointConfig {
    /// When set, clients must prove knowledge of it (`spark.authenticate`).
    pub secret: Option<Secret>,
    /// Blocks in flight per client connection.
    pub credits: u32,
    /// Blocks up to this size are sent inline.
    pub eager_threshold: u32,
    /// Bounds on what clients may send.
    pub limits: Limits,
    /// Limit for a client to complete the handshake.
    pub handshake_timeout: Duration,
    /// Name used in logs (the executor id).
    pub name: String,
}

impl Default for ServerEndpointConfig {
    fn default() -> Self {
        ServerEndpointConfig {
            secret: None,
            credits: 64,
            eager_threshold: 64 * 1024,
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(30),
            name: "server".into(),
        }
    }
}

/// Counters of a serving endpoint, summed over connections.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections that ended with a protocol or I/O error.
    pub connection_errors: AtomicU64,
    /// Connections refused during authentication.
    pub auth_failures: AtomicU64,
    /// Blocks sent inline.
    pub eager_blocks: AtomicU64,
    /// Bytes sent inline.
    pub eager_bytes: AtomicU64,
    /// Blocks offered by rendezvous.
    pub rendezvous_blocks: AtomicU64,
    /// Bytes offered by rendezvous.
    pub rendezvous_bytes: AtomicU64,
    /// Bytes streamed for pulls (tcp).
    pub pulled_bytes: AtomicU64,
    /// Blocks answered with a failure.
    pub failed_blocks: AtomicU64,
}

impl ServerStats {
    /// Adds what a session counted since `last` (connections are long-lived, so counters
    /// are published as they grow, not when the connection ends).
    fn publish(&self, now: &ServerCounters, last: &mut ServerCounters) {
        self.eager_blocks.fetch_add(now.eager_blocks - last.eager_blocks, Ordering::Relaxed);
        self.eager_bytes.fetch_add(now.eager_bytes - last.eager_bytes, Ordering::Relaxed);
        self.rendezvous_blocks.fetch_add(now.rendezvous_blocks - last.rendezvous_blocks, Ordering::Relaxed);
        self.rendezvous_bytes.fetch_add(now.rendezvous_bytes - last.rendezvous_bytes, Ordering::Relaxed);
        self.pulled_bytes.fetch_add(now.pulled_bytes - last.pulled_bytes, Ordering::Relaxed);
        self.failed_blocks.fetch_add(now.failed_blocks - last.failed_blocks, Ordering::Relaxed);
        *last = *now;
    }

    /// Blocks served (inline or by rendezvous).
    pub fn blocks_served(&self) -> u64 {
        self.eager_blocks.load(Ordering::Relaxed) + self.rendezvous_blocks.load(Ordering::Relaxed)
    }

    /// Bytes served (inline or by rendezvous).
    pub fn bytes_served(&self) -> u64 {
        self.eager_bytes.load(Ordering::Relaxed) + self.rendezvous_bytes.load(Ordering::Relaxed)
    }
}

struct Shared {
    config: ServerEndpointConfig,
    source: Arc<dyn BlockSource>,
    stats: Arc<ServerStats>,
    links: Mutex<HashMap<u64, Arc<dyn Link>>>,
    closed: AtomicBool,
}

/// A listening endpoint serving blocks until [`shutdown`](ServerEndpoint::shutdown) or drop.
pub struct ServerEndpoint {
    shared: Arc<Shared>,
    listener: Arc<dyn Listener>,
    addr: SocketAddr,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    provider: &'static str,
}

impl ServerEndpoint {
    /// Listens on `addr` through `provider` and serves blocks from `source`.
    pub fn bind(
        provider: &dyn Provider,
        addr: SocketAddr,
        config: ServerEndpointConfig,
        source: Arc<dyn BlockSource>,
    ) -> Result<Self, FabricError> {
        let listener: Arc<dyn Listener> = Arc::from(provider.listen(addr)?);
        let addr = listener.local_addr();
        let shared = Arc::new(Shared {
            config,
            source,
            stats: Arc::new(ServerStats::default()),
            links: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        let (l, s) = (listener.clone(), shared.clone());
        let acceptor = std::thread::Builder::new()
            .name(format!("rdma-shuffle-accept-{}", addr.port()))
            .spawn(move || accept_loop(l, s))
            .map_err(|e| FabricError::io(&addr.to_string(), "start acceptor for", e))?;
        tracing::info!(%addr, provider = provider.name(), name = %shared.config.name, "block server listening");
        Ok(ServerEndpoint { shared, listener, addr, acceptor: Mutex::new(Some(acceptor)), provider: provider.name() })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The provider's name.
    pub fn provider(&self) -> &'static str {
        self.provider
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ServerStats> {
        &self.shared.stats
    }

    /// Open client connections.
    pub fn connections(&self) -> usize {
        self.shared.links.lock().len()
    }

    /// Stops accepting, closes every connection, and waits for the acceptor to exit.
    /// Connection threads exit on their own as their links close. Idempotent.
    pub fn shutdown(&self) {
        if self.shared.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.listener.shutdown();
        let links: Vec<_> = self.shared.links.lock().drain().map(|(_, l)| l).collect();
        for l in links {
            l.shutdown();
        }
        if let Some(h) = self.acceptor.lock().take() {
            let _ = h.join();
        }
        tracing::info!(addr = %self.addr, "block server stopped");
    }
}

impl Drop for ServerEndpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: Arc<dyn Listener>, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    loop {
        let link: Arc<dyn Link> = match listener.accept() {
            Ok(l) => Arc::from(l),
            Err(FabricError::Shutdown) => return,
            Err(e) => {
                if shared.closed.load(Ordering::Acquire) {
                    return;
                }
                crate::sock::pause_after_failed_accept(&listener.local_addr().to_string(), &e);
                continue;
            }
        };
        if shared.closed.load(Ordering::Acquire) {
            link.shutdown();
            return;
        }
        next_id += 1;
        let id = next_id;
        shared.stats.connections.fetch_add(1, Ordering::Relaxed);
        shared.links.lock().insert(id, link.clone());
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name(format!("rdma-shuffle-serve-{id}")).spawn(move || {
            serve(&s, &link);
            s.links.lock().remove(&id);
            link.flush_sends(Duration::from_secs(2));
            link.shutdown();
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a connection thread; dropping the connection");
            shared.links.lock().remove(&id);
        }
    }
}

/// Runs one connection to its end. Errors end this connection only.
fn serve(shared: &Shared, link: &Arc<dyn Link>) {
    let peer = link.peer().to_string();
    let mut cfg = ServerConfig::new(peer.clone(), rand::random());
    cfg.secret = shared.config.secret.clone();
    cfg.credits = shared.config.credits;
    cfg.eager_threshold = shared.config.eager_threshold;
    cfg.limits = shared.config.limits;
    cfg.handshake_timeout = shared.config.handshake_timeout;
    let mut session: ServerSession<Arc<dyn Source>> = ServerSession::new(cfg, Instant::now());
    let limits = session.limits();

    // A client that never finishes the handshake must not hold a thread forever: a watchdog
    // closes the link at the deadline unless the handshake completed.
    let handshaken = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (h, l, t) = (handshaken.clone(), link.clone(), shared.config.handshake_timeout);
        std::thread::Builder::new()
            .name("rdma-shuffle-handshake-watch".into())
            .spawn(move || {
                let deadline = Instant::now() + t;
                // Unparked as soon as the handshake completes; spurious wake-ups re-check.
                while !h.load(Ordering::Acquire) {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        l.shutdown();
                        return;
                    }
                    std::thread::park_timeout(left);
                }
            })
            .ok()
    };

    let mut published = ServerCounters::default();
    let result: Result<(), FabricError> = (|| loop {
        // Clients send no payload frames; anything else is dropped by the session's checks.
        let received = link.recv(&limits, &mut |_| Placement::Discard);
        let frame = match received {
            Ok(r) => r.frame,
            Err(FabricError::Frame { source, .. }) => {
                let err = session.handle_decode_error(source);
                flush(link, &mut session)?;
                return Err(err.into());
            }
            Err(e) => return Err(e),
        };
        let source = &shared.source;
        let r = session.handle_frame(frame, &mut |span| source.resolve(span));
        if session.is_ready() && !handshaken.swap(true, Ordering::AcqRel) {
            if let Some(w) = &watchdog {
                w.thread().unpark();
            }
        }
        let flushed = flush(link, &mut session);
        shared.stats.publish(&session.counters(), &mut published);
        flushed?;
        r?;
    })();
    match result {
        Err(FabricError::Closed { .. }) | Err(FabricError::Shutdown) => {
            tracing::debug!(%peer, "client disconnected");
        }
        Err(e) => {
            shared.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
            if let FabricError::Session(s) = &e {
                if matches!(s.error, rdma_shuffle_wire::ProtocolError::AuthRefused(_)) {
                    shared.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                }
            }
            tracing::warn!(%peer, server = %shared.config.name, error = %e, "closing client connection");
        }
        Ok(()) => {}
    }
    let _ = session.handle_connection_lost("closed");
    if let Some(w) = watchdog {
        handshaken.store(true, Ordering::Release);
        w.thread().unpark();
        let _ = w.join();
    }
}

fn flush(link: &Arc<dyn Link>, session: &mut ServerSession<Arc<dyn Source>>) -> Result<(), FabricError> {
    while let Some(out) = session.poll_output() {
        match out {
            ServerOutput::Frame(f) => link.send(&f, Payload::None)?,
            ServerOutput::Eager { frame, source, offset, len } | ServerOutput::PullData { frame, source, offset, len } => {
                link.send(&frame, Payload::Source { source: &*source, offset, len })?
            }
        }
    }
    Ok(())
}
