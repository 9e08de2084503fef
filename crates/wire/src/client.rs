//! The client side of a connection: handshake, request queueing under credits, and the
//! bookkeeping of every block until it is delivered or failed.

use crate::auth::{Secret, Transcript};
use crate::block::{BlockFailure, BlockRange, BlockSpan, Descriptor, FailureCode};
use crate::error::{ProtocolError, SessionError};
use crate::frame::{Frame, FrameKind, Limits, NONCE_LEN};
use crate::knob::Knob;
use crate::{caps, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Client-chosen id of one `fetch` call.
pub type RequestId = u64;

/// One block of one request: what every client event refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token {
    /// The request.
    pub req: RequestId,
    /// Index of the block in the request's list.
    pub index: u32,
}

/// Settings of one client session.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// How the peer is named in errors (address, executor id).
    pub peer: String,
    /// Shared secret; when set the server must prove it too.
    pub secret: Option<Secret>,
    /// This engine's application id; a server of another application is refused.
    pub app_id: String,
    /// Fresh random nonce for this connection (the caller owns randomness).
    pub nonce: [u8; NONCE_LEN],
    /// Capabilities offered ([`crate::caps`]).
    pub caps: u64,
    /// Largest eager block accepted inline (the receive buffers' size).
    pub max_eager: u32,
    /// Bounds on what the peer may send.
    pub limits: Limits,
    /// Limit for the handshake to complete.
    pub handshake_timeout: Duration,
    /// Limit for silence from the server while we wait for it.
    pub fetch_timeout: Duration,
    /// Whether queued blocks are sent as soon as credits allow (`true`), or only when the
    /// driver calls [`ClientSession::flush_requests`] with a budget of its own (a driver
    /// that bounds the answers in flight towards a shared receive queue).
    pub auto_flush: bool,
}

impl ClientConfig {
    /// Defaults for `peer` with `nonce`: no secret, an empty application id, every
    /// capability, 1 MiB eager maximum, 30 s handshake and 120 s fetch timeouts.
    pub fn new(peer: impl Into<String>, nonce: [u8; NONCE_LEN]) -> Self {
        ClientConfig {
            peer: peer.into(),
            secret: None,
            app_id: String::new(),
            nonce,
            caps: caps::ALL,
            max_eager: 1024 * 1024,
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(30),
            fetch_timeout: Duration::from_secs(120),
            auto_flush: true,
        }
    }
}

/// What the driver must act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientEvent {
    /// The handshake completed.
    Connected {
        /// Version in use.
        version: u8,
        /// Capabilities in use (intersection).
        caps: u64,
        /// Server's eager threshold.
        eager_threshold: u32,
        /// Initial credits.
        credits: u32,
    },
    /// Block `token`'s bytes come inline: `len` payload bytes follow the frame just handled
    /// (stream) or sit after it in the message. The block is complete once they are read.
    Eager {
        /// Which block.
        token: Token,
        /// Payload length.
        len: u32,
    },
    /// Block `token` must be pulled from `desc`: get a buffer of `desc.len` bytes, then either
    /// RDMA READ it (verbs) or call [`ClientSession::send_pull`] (tcp); finally report
    /// [`ClientSession::pull_complete`].
    Rendezvous {
        /// Which block.
        token: Token,
        /// Where it is.
        desc: Descriptor,
        /// Length of the whole block (more than `desc.len` for a range of a longer block).
        block_len: u64,
    },
    /// (tcp) `len` payload bytes for block `token` at `offset` follow the frame just handled.
    /// When `last` is set, the block is complete after they are read: call
    /// [`ClientSession::pull_complete`].
    PullData {
        /// Which block.
        token: Token,
        /// Offset of the payload in the block.
        offset: u64,
        /// Payload length.
        len: u64,
        /// Whether this completes the block.
        last: bool,
    },
    /// Block `token` failed.
    Failed {
        /// Which block.
        token: Token,
        /// Why.
        failure: BlockFailure,
    },
    /// Every block of request `req` has been delivered or failed.
    RequestDone {
        /// The request.
        req: RequestId,
    },
    /// The connection is dead; `Failed` events for everything outstanding precede this.
    Closed {
        /// Why.
        error: SessionError,
    },
}

#[derive(Debug)]
enum State {
    AwaitChallenge,
    AwaitReady { transcript: Transcript, version: u8, caps: u64, max_credits: u32, eager: u32 },
    Ready,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockState {
    /// Not yet sent in a `Fetch`.
    Queued,
    /// Sent; waiting for the server's answer.
    Requested,
    /// Announced by a `Rendezvous`. `started`: the pull was sent or the one-sided read
    /// posted, so the block waits for the peer; before that it waits for local memory only.
    Pulling {
        desc: Descriptor,
        received: u64,
        started: bool,
    },
    Done,
}

impl BlockState {
    /// Whether progress of this block depends on the peer (the silence clock runs).
    fn waits_for_peer(self) -> bool {
        matches!(self, BlockState::Requested | BlockState::Pulling { started: true, .. })
    }

    /// Whether this block waits for local memory before we can pull it: the peer then waits
    /// for us (its region stays exposed, and it may hold other answers back until we release).
    fn waits_for_us(self) -> bool {
        matches!(self, BlockState::Pulling { started: false, .. })
    }
}

#[derive(Debug)]
struct Request {
    blocks: Vec<BlockSpan>,
    /// For a range fetch ([`ClientSession::fetch_ranges`]), the range of each block.
    ranges: Option<Vec<BlockRange>>,
    state: Vec<BlockState>,
    remaining: usize,
    /// Next index not yet sent in a Fetch frame.
    next_unsent: u32,
}

/// The client half of the protocol for one connection.
///
/// Credits: the server's `Ready` grants `credits` blocks in flight. A block takes one when it
/// is sent in a `Fetch` and gives it back when its `Eager` or `BlockFailed` answer arrives, or
/// when the client sends the `Release` of its rendezvous region (the server reads that
/// `Release` before any later `Fetch`, so the credit is free for the next request at once).
/// Every requested block is answered by exactly one frame, which lets a driver bound the
/// frames in flight towards it.
///
/// Timeouts: the fetch timeout measures silence from the peer while something waits for the
/// peer: a requested block, a pull that was sent, a one-sided read that was posted. Blocks
/// waiting for local memory (a buffer, the bytes-in-flight budget) do not count, and a driver
/// that stops reading because it has no memory for a payload says so with
/// [`stall`](ClientSession::stall): local backpressure is not peer silence. While any block
/// announced by a `Rendezvous` waits for local memory the clock does not run at all: the peer
/// may be holding other answers back until we pull and release that region (a server whose
/// exposure budget is full), so its silence is our own backpressure too.
#[derive(Debug)]
pub struct ClientSession {
    config: ClientConfig,
    hello: Frame,
    state: State,
    credits: u32,
    /// Credits taken by requested blocks whose credit has not come back.
    in_use: u32,
    max_credits: u32,
    eager_max: u32,
    caps: u64,
    next_req: RequestId,
    requests: BTreeMap<RequestId, Request>,
    /// Requests with blocks not yet sent, oldest first.
    unsent: VecDeque<RequestId>,
    /// Region id → block being pulled from it.
    regions: HashMap<u64, Token>,
    transmit: VecDeque<Frame>,
    events: VecDeque<ClientEvent>,
    handshake_deadline: Instant,
    last_progress: Instant,
    /// Blocks in a state where they wait for the peer.
    peer_waits: usize,
    /// Announced blocks whose pull waits for local memory.
    our_waits: usize,
    /// The driver stopped reading for lack of local memory.
    stalled: bool,
}

impl ClientSession {
    /// Starts a session: the `Hello` frame is queued for transmission.
    pub fn new(config: ClientConfig, now: Instant) -> Self {
        let hello = Frame::Hello {
            min_version: MIN_PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            caps: config.caps,
            nonce: config.nonce,
            max_eager: config.max_eager.min(config.limits.max_eager),
            app_id: config.app_id.clone(),
        };
        let handshake_deadline = now + config.handshake_timeout;
        ClientSession {
            state: State::AwaitChallenge,
            credits: 0,
            in_use: 0,
            max_credits: 0,
            eager_max: 0,
            caps: 0,
            next_req: 1,
            requests: BTreeMap::new(),
            unsent: VecDeque::new(),
            regions: HashMap::new(),
            transmit: VecDeque::from([hello.clone()]),
            hello,
            events: VecDeque::new(),
            handshake_deadline,
            last_progress: now,
            peer_waits: 0,
            our_waits: 0,
            stalled: false,
            config,
        }
    }

    /// The peer's name as configured.
    pub fn peer(&self) -> &str {
        &self.config.peer
    }

    /// Limits the driver applies when decoding frames from the server.
    pub fn limits(&self) -> Limits {
        let mut l = self.config.limits;
        l.max_eager = l.max_eager.min(self.config.max_eager);
        l
    }

    /// Whether the handshake completed and the session is usable.
    pub fn is_ready(&self) -> bool {
        matches!(self.state, State::Ready)
    }

    /// Whether the session has failed or was closed.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    /// Credits currently available (blocks that may still be requested).
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// Blocks requested but not yet complete, plus queued ones.
    pub fn outstanding_blocks(&self) -> usize {
        self.requests.values().map(|r| r.remaining).sum()
    }

    /// Blocks queued but not yet sent in a `Fetch`.
    pub fn queued_blocks(&self) -> usize {
        self.unsent.iter().filter_map(|q| self.requests.get(q)).map(|r| r.blocks.len() - r.next_unsent as usize).sum()
    }

    /// Queues a request for `blocks`; they are sent as credits allow. Returns its id. On a
    /// closed session every block fails at once.
    pub fn fetch(&mut self, blocks: Vec<BlockSpan>, now: Instant) -> RequestId {
        self.queue(blocks, None, now)
    }

    /// Queues a request for byte ranges of blocks (`FetchRange`); each is answered by a
    /// `Rendezvous` of exactly its range, which tells the whole block's length, or fails
    /// (`BadRange` for a range past the block's end). Returns its id.
    pub fn fetch_ranges(&mut self, ranges: Vec<BlockRange>, now: Instant) -> RequestId {
        let blocks = ranges.iter().map(|r| r.span).collect();
        self.queue(blocks, Some(ranges), now)
    }

    fn queue(&mut self, blocks: Vec<BlockSpan>, ranges: Option<Vec<BlockRange>>, now: Instant) -> RequestId {
        let req = self.next_req;
        self.next_req += 1;
        let n = blocks.len();
        if n == 0 {
            self.events.push_back(ClientEvent::RequestDone { req });
            return req;
        }
        self.requests.insert(req, Request { state: vec![BlockState::Queued; n], blocks, ranges, remaining: n, next_unsent: 0 });
        if self.is_closed() {
            let failure = BlockFailure::new(FailureCode::PeerGone, format!("connection to {} is closed", self.config.peer));
            for index in 0..n as u32 {
                self.finish(Token { req, index }, Some(failure.clone()), Some(now));
            }
            return req;
        }
        self.unsent.push_back(req);
        if self.config.auto_flush {
            self.flush_requests(u32::MAX, now);
        }
        req
    }

    /// Next frame to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.transmit.pop_front()
    }

    /// Next event to act on, if any.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::AwaitChallenge | State::AwaitReady { .. } => Some(self.handshake_deadline),
            State::Ready if self.silence_counts() => Some(self.last_progress + self.config.fetch_timeout),
            _ => None,
        }
    }

    /// Whether the silence clock runs: something waits for the peer, and nothing the peer
    /// may be waiting on waits on us.
    fn silence_counts(&self) -> bool {
        self.peer_waits > 0 && !self.stalled && self.our_waits == 0
    }

    /// Records that bytes arrived (e.g. part of a long payload), which resets the silence
    /// clock.
    pub fn note_progress(&mut self, now: Instant) {
        self.last_progress = now;
    }

    /// The driver stopped reading from the peer because it has no local memory for the
    /// payload at hand: the silence clock stops until [`unstall`](Self::unstall).
    pub fn stall(&mut self) {
        self.stalled = true;
    }

    /// The driver reads again: the silence clock restarts from `now`.
    pub fn unstall(&mut self, now: Instant) {
        if self.stalled {
            self.stalled = false;
            self.last_progress = now;
        }
    }

    /// Fails the connection if a deadline has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let (what, since, limit, knob) = match self.state {
            State::AwaitChallenge | State::AwaitReady { .. } => (
                "waiting for the handshake",
                self.handshake_deadline - self.config.handshake_timeout,
                self.config.handshake_timeout,
                Knob::ConnectTimeout,
            ),
            State::Ready if self.silence_counts() => {
                ("waiting for blocks", self.last_progress, self.config.fetch_timeout, Knob::FetchTimeout)
            }
            _ => return,
        };
        if now >= since + limit {
            self.fail(ProtocolError::Timeout {
                what,
                waited_ms: now.saturating_duration_since(since).as_millis() as u64,
                timeout_ms: limit.as_millis() as u64,
                knob,
            });
        }
    }

    /// The transport lost the connection (peer vanished, reset, I/O error).
    pub fn handle_connection_lost(&mut self, reason: impl Into<String>) {
        self.fail(ProtocolError::ConnectionLost(reason.into()));
    }

    /// Closes the session locally; outstanding blocks fail with `PeerGone`.
    pub fn close(&mut self) {
        self.fail(ProtocolError::LocallyClosed);
    }

    /// Fails the session with `error` (e.g. a transport-level protocol violation the driver
    /// detected); outstanding blocks fail with its code.
    pub fn fail_with(&mut self, error: ProtocolError) -> SessionError {
        self.fail(error)
    }

    /// A frame that could not be decoded: fatal for the connection.
    pub fn handle_decode_error(&mut self, error: crate::FrameError) -> SessionError {
        self.fail(ProtocolError::Frame(error))
    }

    /// Handles one decoded frame from the server. An `Err` means the connection is dead (a
    /// `Closed` event is queued and outstanding blocks failed); the driver should flush
    /// [`poll_transmit`](Self::poll_transmit) (it may hold an `Error` frame for the peer) and
    /// close the transport.
    pub fn handle_frame(&mut self, frame: Frame, now: Instant) -> Result<(), SessionError> {
        if self.is_closed() {
            return Err(self.err(ProtocolError::LocallyClosed));
        }
        self.last_progress = now;
        let r = self.on_frame(frame, now);
        r.map_err(|e| {
            if matches!(e, ProtocolError::PeerError { .. }) {
                self.fail(e)
            } else {
                self.transmit.push_back(Frame::Error { code: e.failure_code(), message: e.to_string() });
                self.fail(e)
            }
        })
    }

    fn on_frame(&mut self, frame: Frame, now: Instant) -> Result<(), ProtocolError> {
        match (&self.state, frame) {
            (_, Frame::Error { code, message }) => Err(ProtocolError::PeerError { code, message }),
            (
                State::AwaitChallenge,
                Frame::Challenge { version, caps: server_caps, nonce, auth_required, credits, eager_threshold, app_id },
            ) => {
                if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
                    return Err(ProtocolError::NoCommonVersion {
                        peer_min: version,
                        peer_max: version,
                        our_min: MIN_PROTOCOL_VERSION,
                        our_max: PROTOCOL_VERSION,
                    });
                }
                if app_id != self.config.app_id {
                    return Err(ProtocolError::AppMismatch { ours: self.config.app_id.clone(), theirs: app_id });
                }
                if credits == 0 {
                    return Err(ProtocolError::InvalidRequest("server offers zero credits".into()));
                }
                // The transcript is over the frame as received (re-encoding is canonical).
                let challenge =
                    Frame::Challenge { version, caps: server_caps, nonce, auth_required, credits, eager_threshold, app_id };
                let transcript = Transcript::new(&self.hello, &challenge);
                let proof = match (&self.config.secret, auth_required) {
                    (Some(s), true) => Some(s.client_proof(&transcript)),
                    (None, false) => None,
                    (Some(_), false) => {
                        // A server that does not ask for auth could be anyone: with a secret
                        // configured we only talk to servers that prove they know it.
                        return Err(ProtocolError::AuthRefused(
                            "the server does not require authentication but authentication is on here".into(),
                        ));
                    }
                    (None, true) => {
                        return Err(ProtocolError::AuthRefused(
                            "the server requires authentication but no secret is configured here".into(),
                        ))
                    }
                };
                self.transmit.push_back(Frame::Auth { proof });
                let eager = eager_threshold.min(self.config.max_eager);
                self.state =
                    State::AwaitReady { transcript, version, caps: server_caps & self.config.caps, max_credits: credits, eager };
                Ok(())
            }
            (State::AwaitReady { transcript, version, caps, max_credits, eager }, Frame::Ready { proof, credits }) => {
                if let Some(secret) = &self.config.secret {
                    let ok = proof.map(|p| secret.verify_server(transcript, credits, &p)).unwrap_or(false);
                    if !ok {
                        return Err(ProtocolError::AuthRefused(
                            "the server's proof of the shared secret over the handshake is wrong".into(),
                        ));
                    }
                }
                let (version, caps, max_credits, eager) = (*version, *caps, *max_credits, *eager);
                if credits == 0 || credits > max_credits {
                    return Err(ProtocolError::InvalidRequest(format!(
                        "server granted {credits} credits (must be 1..={max_credits}, as its challenge said)"
                    )));
                }
                self.state = State::Ready;
                self.credits = credits;
                self.max_credits = max_credits;
                self.eager_max = eager;
                self.caps = caps;
                self.events.push_back(ClientEvent::Connected { version, caps, eager_threshold: eager, credits });
                if self.config.auto_flush {
                    self.flush_requests(u32::MAX, now);
                }
                Ok(())
            }
            (State::Ready, Frame::Credit { n }) => {
                let total = self.credits as u64 + self.in_use as u64 + n as u64;
                if total > self.max_credits as u64 {
                    return Err(ProtocolError::CreditOverflow { available: total, n, granted: self.max_credits });
                }
                self.credits += n;
                if self.config.auto_flush {
                    self.flush_requests(u32::MAX, now);
                }
                Ok(())
            }
            (State::Ready, Frame::Eager { req, index, len }) => {
                let token = Token { req, index };
                self.expect(token, |s| matches!(s, BlockState::Requested))?;
                if self.range(token).is_some() {
                    return Err(ProtocolError::UnexpectedFrame {
                        kind: FrameKind::Eager,
                        state: "a range fetch is answered by rendezvous",
                    });
                }
                if len > self.eager_max {
                    return Err(ProtocolError::EagerTooLarge { len: len as u64, max: self.eager_max as u64 });
                }
                self.events.push_back(ClientEvent::Eager { token, len });
                self.return_credit();
                self.finish(token, None, Some(now));
                self.auto_flush(now);
                Ok(())
            }
            (State::Ready, Frame::Rendezvous { req, index, desc, block_len }) => {
                let token = Token { req, index };
                self.expect(token, |s| matches!(s, BlockState::Requested))?;
                if self.caps & caps::RENDEZVOUS == 0 {
                    return Err(ProtocolError::UnexpectedFrame {
                        kind: FrameKind::Rendezvous,
                        state: "rendezvous was not negotiated",
                    });
                }
                if self.regions.contains_key(&desc.region) {
                    return Err(ProtocolError::InvalidRequest(format!("region {} announced twice", desc.region)));
                }
                if desc.len > i32::MAX as u64 {
                    return Err(ProtocolError::InvalidRequest(format!(
                        "region of {} bytes exceeds 2 GiB (a larger block is fetched in ranges)",
                        desc.len
                    )));
                }
                let fits = match self.range(token) {
                    Some(r) => desc.len == r.len && r.end() <= block_len,
                    None => desc.len == block_len,
                };
                if !fits {
                    return Err(ProtocolError::InvalidRequest(format!(
                        "{}: region of {} bytes of a {block_len}-byte block does not answer what was asked ({})",
                        self.span(token),
                        desc.len,
                        self.range(token).map(|r| r.to_string()).unwrap_or_else(|| "the whole block".into())
                    )));
                }
                self.set_state(token, BlockState::Pulling { desc, received: 0, started: false }, now);
                self.regions.insert(desc.region, token);
                self.events.push_back(ClientEvent::Rendezvous { token, desc, block_len });
                Ok(())
            }
            (State::Ready, Frame::PullData { region, offset, len }) => {
                let token = *self.regions.get(&region).ok_or(ProtocolError::UnknownRegion { region })?;
                let (desc, received) = match self.block_state(token) {
                    Some(BlockState::Pulling { desc, received, started: true }) => (desc, received),
                    _ => return Err(ProtocolError::UnknownRegion { region }),
                };
                let end = offset.saturating_add(len);
                if offset != received || end > desc.len || (len == 0 && desc.len != 0) {
                    return Err(ProtocolError::PullOutOfBounds { region, offset, end, region_len: desc.len });
                }
                self.set_state(token, BlockState::Pulling { desc, received: end, started: true }, now);
                self.events.push_back(ClientEvent::PullData { token, offset, len, last: end == desc.len });
                Ok(())
            }
            (State::Ready, Frame::BlockFailed { req, index, code, message }) => {
                let token = Token { req, index };
                self.expect(token, |s| matches!(s, BlockState::Requested))?;
                let span = self.span(token);
                let failure = BlockFailure::new(code, format!("{} from {}: {}", span, self.config.peer, message));
                self.return_credit();
                self.finish(token, Some(failure), Some(now));
                self.auto_flush(now);
                Ok(())
            }
            (_, other) => Err(ProtocolError::UnexpectedFrame { kind: other.kind(), state: self.state_name() }),
        }
    }

    fn return_credit(&mut self) {
        self.in_use = self.in_use.saturating_sub(1);
        self.credits += 1;
    }

    fn auto_flush(&mut self, now: Instant) {
        if self.config.auto_flush {
            self.flush_requests(u32::MAX, now);
        }
    }

    /// (tcp) Queues the `Pull` frame for a block announced by a `Rendezvous` event, once the
    /// driver has a buffer for it. From here on the block waits for the peer.
    pub fn send_pull(&mut self, token: Token, now: Instant) -> Result<(), SessionError> {
        match self.block_state(token) {
            Some(BlockState::Pulling { desc, received: 0, started: false }) => {
                self.transmit.push_back(Frame::Pull { region: desc.region, offset: 0, len: desc.len });
                self.set_state(token, BlockState::Pulling { desc, received: 0, started: true }, now);
                Ok(())
            }
            _ => Err(self.err(ProtocolError::UnknownBlock { req: token.req, index: token.index })),
        }
    }

    /// (one-sided) The driver posted the read of a block announced by a `Rendezvous` event:
    /// from here on the block waits for the peer.
    pub fn pull_started(&mut self, token: Token, now: Instant) -> Result<(), SessionError> {
        match self.block_state(token) {
            Some(BlockState::Pulling { desc, received, started: false }) => {
                self.set_state(token, BlockState::Pulling { desc, received, started: true }, now);
                Ok(())
            }
            _ => Err(self.err(ProtocolError::UnknownBlock { req: token.req, index: token.index })),
        }
    }

    /// The pull of `token` finished: its bytes are in the driver's buffer (`Ok`) or could not
    /// be had (`Err`, e.g. an RDMA READ completion error or no memory). The region is released
    /// either way, which gives the block's credit back. A zero-length region completes with
    /// no `PullData`.
    pub fn pull_complete(&mut self, token: Token, result: Result<(), BlockFailure>, now: Instant) -> Result<(), SessionError> {
        let desc = match self.block_state(token) {
            Some(BlockState::Pulling { desc, .. }) => desc,
            _ => return Err(self.err(ProtocolError::UnknownBlock { req: token.req, index: token.index })),
        };
        self.regions.remove(&desc.region);
        if !self.is_closed() {
            self.transmit.push_back(Frame::Release { region: desc.region });
            self.return_credit();
        }
        self.finish(token, result.err(), Some(now));
        self.auto_flush(now);
        Ok(())
    }

    /// The span a token refers to.
    pub fn span(&self, token: Token) -> BlockSpan {
        self.requests.get(&token.req).and_then(|r| r.blocks.get(token.index as usize).copied()).unwrap_or(BlockSpan {
            group: 0,
            object: 0,
            start: 0,
            end: 0,
        })
    }

    /// The range a token asked for, if it belongs to a range fetch.
    fn range(&self, token: Token) -> Option<BlockRange> {
        self.requests.get(&token.req).and_then(|r| r.ranges.as_ref()).and_then(|v| v.get(token.index as usize).copied())
    }

    fn state_name(&self) -> &'static str {
        match self.state {
            State::AwaitChallenge => "waiting for the server's challenge",
            State::AwaitReady { .. } => "waiting for the server's Ready",
            State::Ready => "connected",
            State::Closed => "closed",
        }
    }

    fn block_state(&self, t: Token) -> Option<BlockState> {
        self.requests.get(&t.req).and_then(|r| r.state.get(t.index as usize).copied())
    }

    /// Sets a block's state, keeping the count of blocks that wait for the peer (and
    /// restarting the silence clock when that count leaves zero).
    fn set_state(&mut self, t: Token, s: BlockState, now: Instant) {
        let Some(slot) = self.requests.get_mut(&t.req).and_then(|r| r.state.get_mut(t.index as usize)) else { return };
        let (was, is) = (slot.waits_for_peer(), s.waits_for_peer());
        let (was_ours, is_ours) = (slot.waits_for_us(), s.waits_for_us());
        *slot = s;
        if was_ours && !is_ours {
            self.our_waits -= 1;
            if self.our_waits == 0 {
                // The clock restarts from now: the wait was ours, not the peer's.
                self.last_progress = now;
            }
        } else if !was_ours && is_ours {
            self.our_waits += 1;
        }
        if was && !is {
            self.peer_waits -= 1;
        } else if !was && is {
            if self.peer_waits == 0 {
                self.last_progress = now;
            }
            self.peer_waits += 1;
        }
    }

    fn expect(&self, t: Token, ok: impl Fn(BlockState) -> bool) -> Result<(), ProtocolError> {
        match self.block_state(t) {
            Some(s) if ok(s) => Ok(()),
            _ => Err(ProtocolError::UnknownBlock { req: t.req, index: t.index }),
        }
    }

    /// Marks a block done, emitting `Failed` if `failure`, and `RequestDone` when it was the
    /// request's last.
    fn finish(&mut self, t: Token, failure: Option<BlockFailure>, now: Option<Instant>) {
        match self.block_state(t) {
            None | Some(BlockState::Done) => return,
            Some(s) => {
                if s.waits_for_peer() {
                    self.peer_waits -= 1;
                }
                if s.waits_for_us() {
                    self.our_waits -= 1;
                    if self.our_waits == 0 {
                        if let Some(now) = now {
                            self.last_progress = now;
                        }
                    }
                }
            }
        }
        let Some(r) = self.requests.get_mut(&t.req) else { return };
        r.state[t.index as usize] = BlockState::Done;
        r.remaining -= 1;
        let done = r.remaining == 0;
        if let Some(failure) = failure {
            self.events.push_back(ClientEvent::Failed { token: t, failure });
        }
        if done {
            self.requests.remove(&t.req);
            self.unsent.retain(|q| *q != t.req);
            self.events.push_back(ClientEvent::RequestDone { req: t.req });
        }
    }

    /// Sends queued blocks, oldest request first, while credits last and at most
    /// `max_blocks` of them. Returns how many blocks were sent. With
    /// [`ClientConfig::auto_flush`] the session calls this itself with no bound.
    pub fn flush_requests(&mut self, max_blocks: u32, now: Instant) -> u32 {
        if !self.is_ready() {
            return 0;
        }
        let max = self.config.limits.max_blocks_per_fetch.max(1);
        let mut sent = 0u32;
        while self.credits > 0 && sent < max_blocks {
            let Some(&req) = self.unsent.front() else { break };
            let Some(r) = self.requests.get_mut(&req) else {
                self.unsent.pop_front();
                continue;
            };
            let total = r.blocks.len() as u32;
            let first = r.next_unsent;
            let n = (total - first).min(self.credits).min(max).min(max_blocks - sent);
            let (lo, hi) = (first as usize, (first + n) as usize);
            let frame = match &r.ranges {
                Some(ranges) => Frame::FetchRange { req, first_index: first, ranges: ranges[lo..hi].to_vec() },
                None => Frame::Fetch { req, first_index: first, blocks: r.blocks[lo..hi].to_vec() },
            };
            r.next_unsent += n;
            if r.next_unsent == total {
                self.unsent.pop_front();
            }
            for i in first..first + n {
                self.set_state(Token { req, index: i }, BlockState::Requested, now);
            }
            self.credits -= n;
            self.in_use += n;
            sent += n;
            self.transmit.push_back(frame);
        }
        sent
    }

    fn err(&self, error: ProtocolError) -> SessionError {
        SessionError { peer: self.config.peer.clone(), error }
    }

    /// Closes the session with `error`: every unfinished block fails with the error's code,
    /// then `Closed` is emitted. Idempotent.
    fn fail(&mut self, error: ProtocolError) -> SessionError {
        let err = self.err(error);
        if self.is_closed() {
            return err;
        }
        self.state = State::Closed;
        let code = err.error.failure_code();
        let knob = err.error.knob();
        let tokens: Vec<Token> = self
            .requests
            .iter()
            .flat_map(|(req, r)| {
                r.state
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| **s != BlockState::Done)
                    .map(move |(i, _)| Token { req: *req, index: i as u32 })
            })
            .collect();
        for t in tokens {
            let failure = BlockFailure::new(code, format!("{}: {}", self.span(t), err)).with_knob(knob);
            self.finish(t, Some(failure), None);
        }
        self.regions.clear();
        self.unsent.clear();
        self.events.push_back(ClientEvent::Closed { error: err.clone() });
        err
    }
}
