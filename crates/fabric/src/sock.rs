//! The socket plumbing both real providers share: the tcp provider carries everything over
//! the stream, the verbs provider uses it as its control plane (QP bootstrap, liveness).

use crate::error::FabricError;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A listening socket that can be shut down from another thread while one blocks in accept.
pub(crate) struct SocketListener {
    inner: TcpListener,
    local: SocketAddr,
    closed: AtomicBool,
}

impl SocketListener {
    /// Binds `addr` (port 0 picks a free port; `local_addr` tells which).
    pub(crate) fn bind(addr: SocketAddr) -> Result<Self, FabricError> {
        let inner = TcpListener::bind(addr).map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
        let local = inner.local_addr().map_err(|e| FabricError::io(&addr.to_string(), "listen on", e))?;
        Ok(SocketListener { inner, local, closed: AtomicBool::new(false) })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next connection. Failures of one connection (a client that reset before it was
    /// accepted) are skipped, never returned: they must not stop the listener. After
    /// [`shutdown`](Self::shutdown) this returns [`FabricError::Shutdown`].
    pub(crate) fn accept(&self) -> Result<(TcpStream, SocketAddr), FabricError> {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(FabricError::Shutdown);
            }
            match self.inner.accept() {
                Ok(conn) => {
                    if self.closed.load(Ordering::Acquire) {
                        return Err(FabricError::Shutdown);
                    }
                    return Ok(conn);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset) => continue,
                Err(e) => {
                    if self.closed.load(Ordering::Acquire) {
                        return Err(FabricError::Shutdown);
                    }
                    return Err(FabricError::io(&self.local.to_string(), "accept on", e));
                }
            }
        }
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Stops accepting; a thread blocked in [`accept`](Self::accept) returns `Shutdown`.
    pub(crate) fn shutdown(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            // shutdown(2) on a listening socket wakes a thread blocked in accept(2) on Linux.
            // SAFETY: plain syscall on a descriptor we own.
            unsafe { libc::shutdown(self.inner.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

/// How long an accept loop pauses after a failed accept before it tries again. The failures
/// that reach a loop are the persistent kind (EMFILE, ENFILE, ENOMEM: the process or the
/// machine is out of descriptors or memory), which fail again at once; without a pause the
/// loop would spin a core at 100 % until the condition clears.
pub(crate) const ACCEPT_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The one place accept loops handle a failed accept: log it, naming the listener, and pause
/// for [`ACCEPT_RETRY_PAUSE`]. The listener keeps running; connections that arrive meanwhile
/// wait in the kernel's backlog.
pub(crate) fn pause_after_failed_accept(listener: &str, error: &FabricError) {
    tracing::warn!(listener, error = %error, retry_ms = ACCEPT_RETRY_PAUSE.as_millis() as u64,
        "accept failed; the listener keeps running and retries");
    std::thread::sleep(ACCEPT_RETRY_PAUSE);
}

/// Connects to `addr` within `timeout`; a timeout is reported as such (with the limit), every
/// other failure as an I/O error naming the peer.
pub(crate) fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, FabricError> {
    TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
        if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) {
            FabricError::ConnectTimeout { peer: addr.to_string(), timeout_ms: timeout.as_millis() as u64 }
        } else {
            FabricError::io(&addr.to_string(), "connect to", e)
        }
    })
}
