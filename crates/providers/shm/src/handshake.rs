//! Setting up a connection: a Unix-domain SEQPACKET socket in the abstract namespace, the
//! peer's kernel-reported uid checked, an optional challenge–response on the shared secret,
//! a probe of single-copy permission, then the segment and doorbells passed with SCM_RIGHTS.
//!
//! ```text
//!  connector                                              acceptor
//!   HELLO   {magic, auth, nonce, probe address, probe value}    →   (uid checked at accept)
//!   (uid of the acceptor checked)                        ←   WELCOME {same fields, ring bytes ‖ proof}
//!   PROOF   {can read the acceptor's probe ‖ proof}             →
//!                                                        ←   READY {can read ours} + [memfd, bell, bell]
//! ```
//!
//! Both proofs are HMAC-SHA256 under the secret over the transcript of the exact HELLO and
//! WELCOME bytes (wire's [`Transcript`] and labels; the shm magic keeps these transcripts apart
//! from every other protocol's). The acceptor proves first, and the segment is created and
//! sent only after the connector has proved too: a process that does not know the secret
//! (or runs as another user) never receives a descriptor. Each step is nonblocking, so a
//! silent connection holds nobody up; the owner polls [`fd`](ShmAccepting::fd) and calls
//! `poll` again.

use super::config::ShmConfig;
use super::conn::{Parts, ShmConn};
use super::segment::{check_ring, Segment, Side};
use super::sys::{self, Recv};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_wire::frame::PROOF_LEN;
use rdma_shuffle_wire::Transcript;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

const HELLO: &[u8; 8] = b"RSSHMh01";
const WELCOME: &[u8; 8] = b"RSSHMw01";
const PROOF: &[u8; 8] = b"RSSHMp01";
const READY: &[u8; 8] = b"RSSHMr01";
const REFUSE: &[u8; 8] = b"RSSHMx01";
const NONCE: usize = 16;
/// The `credits` argument of wire's server proof: shm grants none, a tag stands in.
const PROOF_TAG: u32 = u32::from_le_bytes(*b"SHM1");
/// Largest handshake message (a refusal's reason included).
const MAX_MSG: usize = 512;

/// HELLO and WELCOME share a layout: magic, auth, nonce, probe address and value (WELCOME
/// then adds ring bytes and, with auth, the acceptor's proof).
const INTRO: usize = 8 + 1 + NONCE + 8 + 8;

/// A word this process lets the peer read with process_vm_readv, to learn whether single
/// copy works between the two (ptrace permission is decided per pair of processes).
struct Probe(Box<u64>);

impl Probe {
    fn new() -> Probe {
        Probe(Box::new(rand::random::<u64>() | 1))
    }
    fn addr(&self) -> u64 {
        &*self.0 as *const u64 as u64
    }
}

fn intro(magic: &[u8; 8], auth: bool, nonce: &[u8; NONCE], probe: &Probe) -> Vec<u8> {
    let mut b = Vec::with_capacity(INTRO + 4 + PROOF_LEN);
    b.extend_from_slice(magic);
    b.push(auth as u8);
    b.extend_from_slice(nonce);
    b.extend_from_slice(&probe.addr().to_le_bytes());
    b.extend_from_slice(&probe.0.to_le_bytes());
    b
}

/// Probe address and value of a HELLO or WELCOME.
fn probe_of(m: &[u8]) -> (u64, u64) {
    let at = 8 + 1 + NONCE;
    let mut a = [0u8; 8];
    let mut v = [0u8; 8];
    a.copy_from_slice(&m[at..at + 8]);
    v.copy_from_slice(&m[at + 8..at + 16]);
    (u64::from_le_bytes(a), u64::from_le_bytes(v))
}

fn transcript(hello: &[u8], welcome_fields: &[u8]) -> Transcript {
    Transcript::of_messages(hello, welcome_fields)
}

static LOGGED_SINGLE_COPY: AtomicBool = AtomicBool::new(false);
static LOGGED_COPY: AtomicBool = AtomicBool::new(false);

/// Whether this process can read the peer's probe word (`cfg.single_copy` off: no, without
/// trying). Logged once per process for each outcome, with the reason.
fn can_read(cfg: &ShmConfig, pid: libc::pid_t, (addr, value): (u64, u64)) -> bool {
    if !cfg.single_copy {
        if !LOGGED_COPY.swap(true, Ordering::Relaxed) {
            tracing::info!("shm: large messages are copied through the segment (single copy is turned off)");
        }
        return false;
    }
    let mut got = [0u8; 8];
    match sys::vm_read(pid, addr, &mut got) {
        Ok(()) if u64::from_le_bytes(got) == value => {
            if !LOGGED_SINGLE_COPY.swap(true, Ordering::Relaxed) {
                tracing::info!("shm: large messages use single copy (process_vm_readv from the sender's memory)");
            }
            true
        }
        r => {
            if !LOGGED_COPY.swap(true, Ordering::Relaxed) {
                let why = match r {
                    Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                        format!(
                            "{e}: no ptrace permission over the peer (containers without CAP_SYS_PTRACE, Yama ptrace_scope ≥ 1)"
                        )
                    }
                    Err(e) => e.to_string(),
                    Ok(()) => "the probe word read back wrong".into(),
                };
                tracing::info!("shm: large messages are copied through the segment: process_vm_readv is refused: {why}");
            }
            false
        }
    }
}

fn proto(peer: &str, what: String) -> FabricError {
    FabricError::Provider { provider: "shm", message: format!("handshake with {peer}: {what}"), knob: None }
}

fn send(sock: &OwnedFd, peer: &str, bytes: &[u8], fds: &[RawFd]) -> Result<(), FabricError> {
    sys::send_msg(sock, bytes, fds).map_err(|e| FabricError::io(peer, "send the shm handshake to", e))
}

/// Tells the peer why, then gives the error.
fn refuse(sock: &OwnedFd, peer: &str, why: String) -> FabricError {
    let mut m = REFUSE.to_vec();
    m.extend_from_slice(why.as_bytes());
    m.truncate(MAX_MSG);
    let _ = sys::send_msg(sock, &m, &[]);
    proto(peer, why)
}

/// Reads the next handshake message. `Ok(None)`: nothing yet. A REFUSE is the peer's error.
/// Descriptors are kept only where `want_fds`; any others are closed here.
/// A handshake message and the descriptors that came with it.
type Received = (Vec<u8>, Vec<OwnedFd>);

fn recv(sock: &OwnedFd, peer: &str, want_fds: bool) -> Result<Option<Received>, FabricError> {
    match sys::recv_msg(sock, MAX_MSG).map_err(|e| FabricError::io(peer, "read the shm handshake from", e))? {
        Recv::Empty => Ok(None),
        Recv::Closed => Err(FabricError::Closed { peer: peer.into() }),
        Recv::Msg(m, _) if m.starts_with(REFUSE) => {
            Err(proto(peer, format!("the peer refused: {}", String::from_utf8_lossy(&m[8..]))))
        }
        Recv::Msg(m, fds) => Ok(Some((m, if want_fds { fds } else { Vec::new() }))),
    }
}

fn check_uid(sock: &OwnedFd, peer: &str) -> Result<sys::PeerCred, FabricError> {
    let cred = sys::peer_cred(sock).map_err(|e| FabricError::io(peer, "read the credentials of", e))?;
    if cred.uid != sys::euid() {
        return Err(refuse(
            sock,
            peer,
            format!(
                "process {} runs as uid {}, not as this process's uid {}: only the same user may share memory",
                cred.pid,
                cred.uid,
                sys::euid()
            ),
        ));
    }
    Ok(cred)
}

fn auth_mismatch(mine: bool) -> String {
    if mine {
        "this side requires a shared secret and the peer has none; give every process of the job the same secret".into()
    } else {
        "the peer requires a shared secret and this side has none; give every process of the job the same secret".into()
    }
}

/// A listener for shm connections at an abstract-namespace name.
#[derive(Debug)]
pub struct ShmListener {
    fd: OwnedFd,
    name: String,
}

static NEXT_NAME: AtomicU64 = AtomicU64::new(0);

/// A fresh abstract name for a listener of this process (pid, counter and a random part, so
/// nobody guesses it before it exists).
pub fn unique_name() -> String {
    format!(
        "rdma-shuffle-shm/{}/{}/{:016x}",
        std::process::id(),
        NEXT_NAME.fetch_add(1, Ordering::Relaxed),
        rand::random::<u64>()
    )
}

impl ShmListener {
    /// Listens at `name` (abstract namespace: no file, nothing to clean up, visible only in
    /// this network namespace).
    pub fn bind(name: &str) -> Result<ShmListener, FabricError> {
        let fd = sys::listen_abstract(name).map_err(|e| FabricError::io(&format!("shm:{name}"), "listen on", e))?;
        Ok(ShmListener { fd, name: name.into() })
    }

    /// The name peers connect to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The listening socket, to poll for readability.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Takes the next waiting connection, if any, and starts its handshake. A process of
    /// another user is refused here.
    pub fn accept(&self, cfg: &ShmConfig) -> Result<Option<ShmAccepting>, FabricError> {
        let Some(sock) = sys::accept(&self.fd).map_err(|e| FabricError::io(&format!("shm:{}", self.name), "accept on", e))?
        else {
            return Ok(None);
        };
        let peer = sys::peer_cred(&sock).map(|c| format!("shm:pid {}", c.pid)).unwrap_or_else(|_| "shm:unknown".into());
        let cred = check_uid(&sock, &peer)?;
        Ok(Some(ShmAccepting { sock, peer, cred, cfg: cfg.clone(), state: AcceptState::Hello }))
    }

    /// Accepts one connection and completes its handshake within `timeout` (tests, tools).
    pub fn accept_blocking(&self, cfg: &ShmConfig, timeout: Duration) -> Result<ShmConn, FabricError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut a = loop {
            if let Some(a) = self.accept(cfg)? {
                break a;
            }
            wait_readable(self.fd(), &format!("shm:{}", self.name), deadline, timeout)?;
        };
        loop {
            if let Some(c) = a.poll()? {
                return Ok(c);
            }
            wait_readable(a.fd(), &a.peer, deadline, timeout)?;
        }
    }
}

fn wait_readable(fd: RawFd, peer: &str, deadline: std::time::Instant, timeout: Duration) -> Result<(), FabricError> {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    if left.is_zero() {
        return Err(FabricError::ConnectTimeout { peer: peer.into(), timeout_ms: timeout.as_millis() as u64 });
    }
    sys::poll_in(&[fd], left).map_err(|e| FabricError::io(peer, "wait for", e))?;
    Ok(())
}

enum AcceptState {
    Hello,
    Proof { hello: Vec<u8>, welcome_fields: Vec<u8>, _probe: Probe },
    Done,
}

/// The accepting side of a handshake in progress.
pub struct ShmAccepting {
    sock: OwnedFd,
    peer: String,
    cred: sys::PeerCred,
    cfg: ShmConfig,
    state: AcceptState,
}

impl ShmAccepting {
    /// The socket, to poll for readability.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Goes on with the handshake; `Ok(Some)` once the connection is up.
    pub fn poll(&mut self) -> Result<Option<ShmConn>, FabricError> {
        loop {
            let Some((m, _)) = recv(&self.sock, &self.peer, false)? else { return Ok(None) };
            match std::mem::replace(&mut self.state, AcceptState::Done) {
                AcceptState::Hello => {
                    if m.len() != INTRO || !m.starts_with(HELLO) {
                        return Err(refuse(&self.sock, &self.peer, "the first message is not an shm HELLO".into()));
                    }
                    let auth = m[8] != 0;
                    if auth != self.cfg.secret.is_some() {
                        return Err(refuse(&self.sock, &self.peer, auth_mismatch(self.cfg.secret.is_some())));
                    }
                    let probe = Probe::new();
                    let mut w = intro(WELCOME, auth, &rand::random(), &probe);
                    w.extend_from_slice(&(self.cfg.ring_bytes as u32).to_le_bytes());
                    let fields = w.clone();
                    if let Some(s) = &self.cfg.secret {
                        w.extend_from_slice(&s.server_proof(&transcript(&m, &fields), PROOF_TAG));
                    }
                    send(&self.sock, &self.peer, &w, &[])?;
                    self.state = AcceptState::Proof { hello: m, welcome_fields: fields, _probe: probe };
                }
                AcceptState::Proof { hello, welcome_fields, _probe } => {
                    if m.len() != 8 + 1 + PROOF_LEN || !m.starts_with(PROOF) {
                        return Err(refuse(&self.sock, &self.peer, "expected an shm PROOF".into()));
                    }
                    if let Some(s) = &self.cfg.secret {
                        let mut proof = [0u8; PROOF_LEN];
                        proof.copy_from_slice(&m[9..]);
                        if !s.verify_client(&transcript(&hello, &welcome_fields), &proof) {
                            return Err(refuse(
                                &self.sock,
                                &self.peer,
                                "authentication failed: the peer does not know the shared secret (another job, or a different secret)"
                                    .into(),
                            ));
                        }
                    }
                    let peer_reads_us = m[8] != 0;
                    let we_read_peer = can_read(&self.cfg, self.cred.pid, probe_of(&hello));
                    let name = format!("rdma-shuffle-shm-{}", NEXT_NAME.fetch_add(1, Ordering::Relaxed));
                    let io = |e| FabricError::io(&self.peer, "create the shared segment for", e);
                    let (seg, memfd) = Segment::create(&name, self.cfg.ring_bytes).map_err(io)?;
                    let (bell, peer_bell) = (sys::eventfd().map_err(io)?, sys::eventfd().map_err(io)?);
                    let mut r = READY.to_vec();
                    r.push(we_read_peer as u8);
                    send(&self.sock, &self.peer, &r, &[memfd.as_raw_fd(), bell.as_raw_fd(), peer_bell.as_raw_fd()])?;
                    // Mapped here, and the peer holds its own descriptor: ours can go.
                    drop(memfd);
                    let parts = Parts {
                        peer: self.peer.clone(),
                        sock: self.sock.try_clone().map_err(|e| FabricError::io(&self.peer, "keep the socket of", e))?,
                        side: Side::Acceptor,
                        seg,
                        bell,
                        peer_bell,
                        peer_pid: self.cred.pid,
                        peer_reads_us,
                    };
                    return Ok(Some(ShmConn::new(parts, &self.cfg)));
                }
                AcceptState::Done => return Err(proto(&self.peer, "message after the handshake finished".into())),
            }
        }
    }
}

enum ConnectState {
    Welcome { hello: Vec<u8> },
    Ready { ring: usize },
    Done,
}

/// The connecting side of a handshake in progress.
pub struct ShmConnecting {
    sock: OwnedFd,
    peer: String,
    cred: sys::PeerCred,
    cfg: ShmConfig,
    state: ConnectState,
    /// Kept until READY: the acceptor probes it after our PROOF.
    _probe: Probe,
}

impl ShmConnecting {
    /// Connects to the listener at `name` and sends HELLO. An acceptor of another user is
    /// refused at once.
    pub fn start(name: &str, cfg: &ShmConfig) -> Result<ShmConnecting, FabricError> {
        let peer = format!("shm:{name}");
        let sock = sys::connect_abstract(name, Duration::from_secs(1)).map_err(|e| FabricError::io(&peer, "connect to", e))?;
        let cred = check_uid(&sock, &peer)?;
        let probe = Probe::new();
        let hello = intro(HELLO, cfg.secret.is_some(), &rand::random(), &probe);
        send(&sock, &peer, &hello, &[])?;
        Ok(ShmConnecting { sock, peer, cred, cfg: cfg.clone(), state: ConnectState::Welcome { hello }, _probe: probe })
    }

    /// Connects and completes the handshake within `timeout` (tests, tools).
    pub fn connect_blocking(name: &str, cfg: &ShmConfig, timeout: Duration) -> Result<ShmConn, FabricError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut c = ShmConnecting::start(name, cfg)?;
        loop {
            if let Some(conn) = c.poll()? {
                return Ok(conn);
            }
            wait_readable(c.fd(), &c.peer, deadline, timeout)?;
        }
    }

    /// The socket, to poll for readability.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Goes on with the handshake; `Ok(Some)` once the connection is up.
    pub fn poll(&mut self) -> Result<Option<ShmConn>, FabricError> {
        loop {
            let want_fds = matches!(self.state, ConnectState::Ready { .. });
            let Some((m, fds)) = recv(&self.sock, &self.peer, want_fds)? else { return Ok(None) };
            match std::mem::replace(&mut self.state, ConnectState::Done) {
                ConnectState::Welcome { hello } => {
                    let auth = self.cfg.secret.is_some();
                    let want = INTRO + 4 + if auth { PROOF_LEN } else { 0 };
                    if !m.starts_with(WELCOME) || m.len() < INTRO + 4 {
                        return Err(refuse(&self.sock, &self.peer, "expected an shm WELCOME".into()));
                    }
                    if (m[8] != 0) != auth {
                        return Err(refuse(&self.sock, &self.peer, auth_mismatch(auth)));
                    }
                    if m.len() != want {
                        return Err(refuse(&self.sock, &self.peer, "the shm WELCOME has the wrong length".into()));
                    }
                    let fields = &m[..INTRO + 4];
                    let t = transcript(&hello, fields);
                    let mut proof = [0u8; PROOF_LEN];
                    if let Some(s) = &self.cfg.secret {
                        let mut theirs = [0u8; PROOF_LEN];
                        theirs.copy_from_slice(&m[INTRO + 4..]);
                        if !s.verify_server(&t, PROOF_TAG, &theirs) {
                            return Err(refuse(
                                &self.sock,
                                &self.peer,
                                "authentication failed: the acceptor does not know the shared secret (another job, or a different secret)"
                                    .into(),
                            ));
                        }
                        proof = s.client_proof(&t);
                    }
                    let ring = u32::from_le_bytes([m[INTRO], m[INTRO + 1], m[INTRO + 2], m[INTRO + 3]]) as usize;
                    check_ring(ring).map_err(|e| refuse(&self.sock, &self.peer, e))?;
                    let we_read_peer = can_read(&self.cfg, self.cred.pid, probe_of(&m));
                    let mut p = PROOF.to_vec();
                    p.push(we_read_peer as u8);
                    p.extend_from_slice(&proof);
                    send(&self.sock, &self.peer, &p, &[])?;
                    // The acceptor's READY says whether it can read us.
                    self.state = ConnectState::Ready { ring };
                }
                ConnectState::Ready { ring } => {
                    if m.len() != 9 || !m.starts_with(READY) || fds.len() != 3 {
                        return Err(proto(
                            &self.peer,
                            format!("expected READY with 3 descriptors, got {} bytes and {}", m.len(), fds.len()),
                        ));
                    }
                    let peer_reads_us = m[8] != 0;
                    let mut fds = fds.into_iter();
                    let (Some(memfd), Some(peer_bell), Some(bell)) = (fds.next(), fds.next(), fds.next()) else {
                        return Err(proto(&self.peer, "READY without its descriptors".into()));
                    };
                    let seg = Segment::attach(memfd, ring).map_err(|e| proto(&self.peer, e))?;
                    let parts = Parts {
                        peer: self.peer.clone(),
                        sock: self.sock.try_clone().map_err(|e| FabricError::io(&self.peer, "keep the socket of", e))?,
                        side: Side::Connector,
                        seg,
                        bell,
                        peer_bell,
                        peer_pid: self.cred.pid,
                        peer_reads_us,
                    };
                    return Ok(Some(ShmConn::new(parts, &self.cfg)));
                }
                ConnectState::Done => return Err(proto(&self.peer, "message after the handshake finished".into())),
            }
        }
    }
}
