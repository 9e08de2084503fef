//! The server side of a connection: handshake and authentication, credit accounting,
//! resolving requested blocks, the eager-versus-rendezvous choice, and the table of
//! rendezvous regions the client may pull from until it releases them.

use crate::auth::{Secret, Transcript};
use crate::block::{BlockFailure, BlockRange, BlockSpan, Descriptor, FailureCode, RegionId};
use crate::error::{ProtocolError, SessionError};
use crate::frame::{Frame, Limits, MAX_PULL_CHUNK, NONCE_LEN};
use crate::knob::Knob;
use crate::{caps, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Settings of one server session.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// How the peer is named in errors and logs.
    pub peer: String,
    /// When set, clients must prove knowledge of it before any block is served.
    pub secret: Option<Secret>,
    /// This engine's application id; clients of another application are refused.
    pub app_id: String,
    /// Fresh random nonce for this connection.
    pub nonce: [u8; NONCE_LEN],
    /// Capabilities offered ([`crate::caps`]).
    pub caps: u64,
    /// Most blocks one client may have in flight on this connection (the live grant, chosen
    /// after authentication by [`ServerHooks::grant`], is at most this).
    pub credits: u32,
    /// Blocks up to this many bytes are sent inline; larger ones by rendezvous.
    pub eager_threshold: u32,
    /// Bounds on what the client may send.
    pub limits: Limits,
    /// Limit for the client to complete the handshake.
    pub handshake_timeout: Duration,
}

impl ServerConfig {
    /// Defaults for `peer` with `nonce`: no secret, an empty application id, 64 credits,
    /// 64 KiB eager threshold.
    pub fn new(peer: impl Into<String>, nonce: [u8; NONCE_LEN]) -> Self {
        ServerConfig {
            peer: peer.into(),
            secret: None,
            app_id: String::new(),
            nonce,
            caps: caps::ALL,
            credits: 64,
            eager_threshold: 64 * 1024,
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(30),
        }
    }
}

/// Where a resolved block's bytes are, as the server's block source reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved<H> {
    /// The driver's handle to the source (e.g. a mapped data file).
    pub source: H,
    /// Offset of the block in the source.
    pub offset: u64,
    /// Length of the block.
    pub len: u64,
}

/// What the session asks of its driver while it handles a frame.
///
/// Any `FnMut(&BlockSpan) -> Result<Resolved<H>, BlockFailure>` is a `ServerHooks` that
/// grants every client the full credit limit.
pub trait ServerHooks<H> {
    /// Where `span`'s bytes are, or why it cannot be served (unknown shuffle, corrupt
    /// index, ...).
    fn resolve(&mut self, span: &BlockSpan) -> Result<Resolved<H>, BlockFailure>;

    /// The live credit grant for a client that just authenticated, at most `max` (the
    /// session clamps the answer to `1..=max`). A driver whose receive buffers are shared by
    /// every connection grants from what is left of them.
    fn grant(&mut self, max: u32) -> u32 {
        max
    }
}

impl<H, F> ServerHooks<H> for F
where
    F: FnMut(&BlockSpan) -> Result<Resolved<H>, BlockFailure>,
{
    fn resolve(&mut self, span: &BlockSpan) -> Result<Resolved<H>, BlockFailure> {
        self(span)
    }
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerOutput<H> {
    /// Send a frame without payload.
    Frame(Frame),
    /// Send an `Eager` frame followed by `len` bytes of `source` at `offset`.
    Eager {
        /// The frame (header and fixed part).
        frame: Frame,
        /// Source of the payload.
        source: H,
        /// Offset in the source.
        offset: u64,
        /// Payload length.
        len: u64,
    },
    /// Expose `len` bytes of `source` at `offset` to this client as `region` (verbs: a memory
    /// window only this connection's queue pair can use), then send
    /// `Frame::Rendezvous { req, index, desc }` with the keys of the exposure. The exposure
    /// lasts until a [`ServerOutput::Revoke`] of the region, or the end of the connection.
    Expose {
        /// Request id.
        req: u64,
        /// Block index in the request.
        index: u32,
        /// The region id the client will name in `Pull` and `Release`.
        region: RegionId,
        /// Source of the bytes.
        source: H,
        /// Offset in the source.
        offset: u64,
        /// Length.
        len: u64,
        /// Length of the whole block (`len`, unless a range of it was asked for); the
        /// `Rendezvous` frame carries it.
        block_len: u64,
    },
    /// The client released `region`: revoke its exposure (from now on reads of it must fail).
    Revoke {
        /// The region.
        region: RegionId,
    },
    /// Send a `PullData` frame followed by `len` bytes of `source` at `offset` (tcp).
    PullData {
        /// The frame (header and fixed part).
        frame: Frame,
        /// Source of the payload.
        source: H,
        /// Offset in the source.
        offset: u64,
        /// Payload length.
        len: u64,
    },
}

#[derive(Debug)]
enum State {
    AwaitHello,
    AwaitAuth { transcript: Transcript },
    Ready,
    Closed,
}

#[derive(Debug)]
struct Region<H> {
    source: H,
    offset: u64,
    len: u64,
}

/// Counters of one server session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerCounters {
    /// Blocks sent inline.
    pub eager_blocks: u64,
    /// Bytes sent inline.
    pub eager_bytes: u64,
    /// Blocks offered by rendezvous.
    pub rendezvous_blocks: u64,
    /// Bytes offered by rendezvous.
    pub rendezvous_bytes: u64,
    /// Bytes streamed in `PullData` frames.
    pub pulled_bytes: u64,
    /// Blocks that failed.
    pub failed_blocks: u64,
}

/// The server half of the protocol for one connection.
///
/// Credits (see [`crate::ClientSession`]): a block takes a credit when it arrives in a
/// `Fetch`; the credit comes back when the session answers it inline or with a failure, or
/// when the client releases its rendezvous region. There are no credit frames in normal
/// operation; [`raise_credits`](Self::raise_credits) sends one to grant more, up to the limit
/// the `Challenge` announced.
#[derive(Debug)]
pub struct ServerSession<H> {
    config: ServerConfig,
    state: State,
    eager_threshold: u64,
    caps: u64,
    /// Credits the client may use now (the live grant).
    live: u32,
    outstanding: u32,
    next_region: RegionId,
    regions: HashMap<RegionId, Region<H>>,
    out: VecDeque<ServerOutput<H>>,
    handshake_deadline: Instant,
    counters: ServerCounters,
}

impl<H: Clone> ServerSession<H> {
    /// Starts a session waiting for the client's `Hello`.
    pub fn new(config: ServerConfig, now: Instant) -> Self {
        ServerSession {
            state: State::AwaitHello,
            eager_threshold: 0,
            caps: 0,
            live: 0,
            outstanding: 0,
            next_region: 1,
            regions: HashMap::new(),
            out: VecDeque::new(),
            handshake_deadline: now + config.handshake_timeout,
            counters: ServerCounters::default(),
            config,
        }
    }

    /// The peer's name as configured.
    pub fn peer(&self) -> &str {
        &self.config.peer
    }

    /// Limits the driver applies when decoding frames from the client.
    pub fn limits(&self) -> Limits {
        self.config.limits
    }

    /// Whether the client is authenticated and may fetch.
    pub fn is_ready(&self) -> bool {
        matches!(self.state, State::Ready)
    }

    /// Whether the session failed or was closed.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    /// Counters so far.
    pub fn counters(&self) -> ServerCounters {
        self.counters
    }

    /// Rendezvous regions the client holds.
    pub fn open_regions(&self) -> usize {
        self.regions.len()
    }

    /// Blocks the client has in flight (credits in use).
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// The live credit grant (0 before authentication).
    pub fn live_credits(&self) -> u32 {
        self.live
    }

    /// Next output to act on, if any.
    pub fn poll_output(&mut self) -> Option<ServerOutput<H>> {
        self.out.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::AwaitHello | State::AwaitAuth { .. } => Some(self.handshake_deadline),
            _ => None,
        }
    }

    /// Fails the session if the client has not completed the handshake in time.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), SessionError> {
        if matches!(self.state, State::AwaitHello | State::AwaitAuth { .. }) && now >= self.handshake_deadline {
            let t = self.config.handshake_timeout.as_millis() as u64;
            return Err(self.fail(
                ProtocolError::Timeout {
                    what: "waiting for the client's handshake",
                    waited_ms: t,
                    timeout_ms: t,
                    knob: Knob::ConnectTimeout,
                },
                true,
            ));
        }
        Ok(())
    }

    /// A frame that could not be decoded: fatal for the connection (an `Error` frame is queued
    /// for the peer).
    pub fn handle_decode_error(&mut self, error: crate::FrameError) -> SessionError {
        self.fail(ProtocolError::Frame(error), true)
    }

    /// Fails the session with `error`, telling the peer (e.g. a transport-level violation the
    /// driver detected).
    pub fn fail_with(&mut self, error: ProtocolError) -> SessionError {
        self.fail(error, true)
    }

    /// The transport lost the connection. Regions are dropped.
    pub fn handle_connection_lost(&mut self, reason: impl Into<String>) -> SessionError {
        self.fail(ProtocolError::ConnectionLost(reason.into()), false)
    }

    /// Grants the client `n` more credits (a `Credit` frame), up to the limit announced in
    /// the `Challenge`. Returns how many were granted.
    pub fn raise_credits(&mut self, n: u32) -> u32 {
        if !self.is_ready() {
            return 0;
        }
        let n = n.min(self.config.credits.max(1) - self.live);
        if n > 0 {
            self.live += n;
            self.out.push_back(ServerOutput::Frame(Frame::Credit { n }));
        }
        n
    }

    /// The driver could not expose `region` (announced by a [`ServerOutput::Expose`]): the
    /// block fails instead with `failure`, its credit comes back, and the region is forgotten.
    pub fn abandon_region(&mut self, req: u64, index: u32, region: RegionId, failure: BlockFailure) {
        if let Some(r) = self.regions.remove(&region) {
            self.outstanding = self.outstanding.saturating_sub(1);
            self.counters.rendezvous_blocks -= 1;
            self.counters.rendezvous_bytes -= r.len;
            self.counters.failed_blocks += 1;
            self.out.push_back(ServerOutput::Frame(Frame::BlockFailed {
                req,
                index,
                code: failure.code,
                message: failure.message,
            }));
        }
    }

    /// Handles one decoded frame from the client; `hooks` resolves requested spans (and
    /// chooses the credit grant at authentication).
    ///
    /// An `Err` is fatal for this connection only: an `Error` frame for the client is queued
    /// (flush [`poll_output`](Self::poll_output), then close the transport).
    pub fn handle_frame(&mut self, frame: Frame, hooks: &mut dyn ServerHooks<H>) -> Result<(), SessionError> {
        if self.is_closed() {
            return Err(self.err(ProtocolError::LocallyClosed));
        }
        match self.on_frame(frame, hooks) {
            Ok(()) => Ok(()),
            Err(ProtocolError::PeerError { code, message }) => Err(self.fail(ProtocolError::PeerError { code, message }, false)),
            Err(e) => Err(self.fail(e, true)),
        }
    }

    fn on_frame(&mut self, frame: Frame, hooks: &mut dyn ServerHooks<H>) -> Result<(), ProtocolError> {
        match (&self.state, frame) {
            (_, Frame::Error { code, message }) => Err(ProtocolError::PeerError { code, message }),
            (State::AwaitHello, Frame::Hello { min_version, max_version, caps: client_caps, nonce, max_eager, app_id }) => {
                let version = max_version.min(PROTOCOL_VERSION);
                if version < min_version.max(MIN_PROTOCOL_VERSION) {
                    return Err(ProtocolError::NoCommonVersion {
                        peer_min: min_version,
                        peer_max: max_version,
                        our_min: MIN_PROTOCOL_VERSION,
                        our_max: PROTOCOL_VERSION,
                    });
                }
                if app_id != self.config.app_id {
                    return Err(ProtocolError::AppMismatch { ours: self.config.app_id.clone(), theirs: app_id });
                }
                let hello = Frame::Hello { min_version, max_version, caps: client_caps, nonce, max_eager, app_id };
                self.caps = client_caps & self.config.caps;
                self.eager_threshold = (self.config.eager_threshold as u64).min(max_eager as u64);
                let challenge = Frame::Challenge {
                    version,
                    caps: self.caps,
                    nonce: self.config.nonce,
                    auth_required: self.config.secret.is_some(),
                    credits: self.config.credits.max(1),
                    eager_threshold: self.eager_threshold as u32,
                    app_id: self.config.app_id.clone(),
                };
                let transcript = Transcript::new(&hello, &challenge);
                self.out.push_back(ServerOutput::Frame(challenge));
                self.state = State::AwaitAuth { transcript };
                Ok(())
            }
            (State::AwaitAuth { transcript }, Frame::Auth { proof }) => {
                let transcript = *transcript;
                match (&self.config.secret, proof) {
                    (None, _) => {}
                    (Some(s), Some(p)) if s.verify_client(&transcript, &p) => {}
                    (Some(_), Some(_)) => {
                        return Err(ProtocolError::AuthRefused(
                            "the client's proof of the shared secret over the handshake is wrong".into(),
                        ))
                    }
                    (Some(_), None) => {
                        return Err(ProtocolError::AuthRefused("the client sent no proof but authentication is required".into()))
                    }
                }
                // Authenticated: only now may the driver spend anything on this peer.
                let max = self.config.credits.max(1);
                let live = hooks.grant(max).clamp(1, max);
                let proof = self.config.secret.as_ref().map(|s| s.server_proof(&transcript, live));
                self.live = live;
                self.out.push_back(ServerOutput::Frame(Frame::Ready { proof, credits: live }));
                self.state = State::Ready;
                Ok(())
            }
            (State::Ready, Frame::Fetch { req, first_index, blocks }) => self.on_fetch(req, first_index, blocks, hooks),
            (State::Ready, Frame::FetchRange { req, first_index, ranges }) => {
                self.on_fetch_range(req, first_index, ranges, hooks)
            }
            (State::Ready, Frame::Pull { region, offset, len }) => {
                let r = self.regions.get(&region).ok_or(ProtocolError::UnknownRegion { region })?;
                let end = offset.saturating_add(len);
                if end > r.len {
                    return Err(ProtocolError::PullOutOfBounds { region, offset, end, region_len: r.len });
                }
                // Chunk so no single PullData frame exceeds what a client accepts.
                let (source, base) = (r.source.clone(), r.offset);
                let mut at = offset;
                loop {
                    let n = (end - at).min(MAX_PULL_CHUNK);
                    self.out.push_back(ServerOutput::PullData {
                        frame: Frame::PullData { region, offset: at, len: n },
                        source: source.clone(),
                        offset: base + at,
                        len: n,
                    });
                    at += n;
                    if at >= end {
                        break;
                    }
                }
                self.counters.pulled_bytes += len;
                Ok(())
            }
            (State::Ready, Frame::Release { region }) => {
                self.regions.remove(&region).ok_or(ProtocolError::UnknownRegion { region })?;
                self.outstanding = self.outstanding.saturating_sub(1);
                self.out.push_back(ServerOutput::Revoke { region });
                Ok(())
            }
            (State::AwaitHello | State::AwaitAuth { .. }, other) => Err(ProtocolError::UnexpectedFrame {
                kind: other.kind(),
                state: "waiting for the handshake (no block is served before it)",
            }),
            (_, other) => Err(ProtocolError::UnexpectedFrame { kind: other.kind(), state: "serving" }),
        }
    }

    fn on_fetch(
        &mut self,
        req: u64,
        first_index: u32,
        blocks: Vec<BlockSpan>,
        hooks: &mut dyn ServerHooks<H>,
    ) -> Result<(), ProtocolError> {
        let n = blocks.len() as u32;
        if self.outstanding.saturating_add(n) > self.live {
            return Err(ProtocolError::CreditExceeded { requested: n, outstanding: self.outstanding, granted: self.live });
        }
        self.outstanding += n;
        for (i, span) in blocks.iter().enumerate() {
            let index = first_index + i as u32;
            let resolved = if span.start >= span.end {
                Err(BlockFailure::new(FailureCode::BadRange, format!("{span}: empty part range {}..{}", span.start, span.end)))
            } else {
                hooks.resolve(span)
            };
            match resolved {
                Err(f) => {
                    self.counters.failed_blocks += 1;
                    self.out.push_back(ServerOutput::Frame(Frame::BlockFailed { req, index, code: f.code, message: f.message }));
                    self.outstanding -= 1;
                }
                Ok(r) if r.len <= self.eager_threshold || self.caps & caps::RENDEZVOUS == 0 => {
                    if r.len > self.eager_threshold {
                        self.counters.failed_blocks += 1;
                        self.out.push_back(ServerOutput::Frame(Frame::BlockFailed {
                            req,
                            index,
                            code: FailureCode::Other,
                            message: format!("{span}: {} bytes exceed the client's eager limit and it cannot pull", r.len),
                        }));
                    } else {
                        self.counters.eager_blocks += 1;
                        self.counters.eager_bytes += r.len;
                        self.out.push_back(ServerOutput::Eager {
                            frame: Frame::Eager { req, index, len: r.len as u32 },
                            source: r.source,
                            offset: r.offset,
                            len: r.len,
                        });
                    }
                    self.outstanding -= 1;
                }
                Ok(r) => {
                    let region = self.next_region;
                    self.next_region += 1;
                    self.counters.rendezvous_blocks += 1;
                    self.counters.rendezvous_bytes += r.len;
                    self.regions.insert(region, Region { source: r.source.clone(), offset: r.offset, len: r.len });
                    self.out.push_back(ServerOutput::Expose {
                        req,
                        index,
                        region,
                        source: r.source,
                        offset: r.offset,
                        len: r.len,
                        block_len: r.len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Resolves each range's block and offers exactly the range by rendezvous; a range that
    /// does not lie inside its block fails with `BadRange`. An empty range at offset 0 is
    /// answered with an empty region (nothing exposed) whose `block_len` tells the client the
    /// block's length.
    fn on_fetch_range(
        &mut self,
        req: u64,
        first_index: u32,
        ranges: Vec<BlockRange>,
        hooks: &mut dyn ServerHooks<H>,
    ) -> Result<(), ProtocolError> {
        let n = ranges.len() as u32;
        if self.outstanding.saturating_add(n) > self.live {
            return Err(ProtocolError::CreditExceeded { requested: n, outstanding: self.outstanding, granted: self.live });
        }
        self.outstanding += n;
        for (i, range) in ranges.iter().enumerate() {
            let index = first_index + i as u32;
            let span = &range.span;
            let resolved = if span.start >= span.end {
                Err(BlockFailure::new(FailureCode::BadRange, format!("{span}: empty part range {}..{}", span.start, span.end)))
            } else if self.caps & caps::RENDEZVOUS == 0 {
                Err(BlockFailure::new(FailureCode::Other, format!("{range}: a range fetch needs rendezvous, not negotiated")))
            } else {
                hooks.resolve(span).and_then(|r| match range.offset.checked_add(range.len) {
                    Some(end) if end <= r.len => Ok(r),
                    _ => Err(BlockFailure::new(
                        FailureCode::BadRange,
                        format!("{range}: past the end of the block, which has {} bytes", r.len),
                    )),
                })
            };
            let r = match resolved {
                Ok(r) => r,
                Err(f) => {
                    self.counters.failed_blocks += 1;
                    self.out.push_back(ServerOutput::Frame(Frame::BlockFailed { req, index, code: f.code, message: f.message }));
                    self.outstanding -= 1;
                    continue;
                }
            };
            let region = self.next_region;
            self.next_region += 1;
            self.counters.rendezvous_blocks += 1;
            self.counters.rendezvous_bytes += range.len;
            let (offset, len) = (r.offset + range.offset, range.len);
            self.regions.insert(region, Region { source: r.source.clone(), offset, len });
            if len == 0 {
                // Nothing to expose; the client releases the empty region like any other.
                let desc = Descriptor { region, addr: 0, len: 0, rkey: 0 };
                self.out.push_back(ServerOutput::Frame(Frame::Rendezvous { req, index, desc, block_len: r.len }));
            } else {
                self.out.push_back(ServerOutput::Expose { req, index, region, source: r.source, offset, len, block_len: r.len });
            }
        }
        Ok(())
    }

    fn err(&self, error: ProtocolError) -> SessionError {
        SessionError { peer: self.config.peer.clone(), error }
    }

    fn fail(&mut self, error: ProtocolError, tell_peer: bool) -> SessionError {
        let err = self.err(error);
        if !self.is_closed() {
            self.state = State::Closed;
            self.regions.clear();
            if tell_peer {
                let message = format!("server rejected the connection from {}: {}", self.config.peer, err.error);
                self.out.push_back(ServerOutput::Frame(Frame::Error { code: err.error.failure_code(), message }));
            }
        }
        err
    }
}
