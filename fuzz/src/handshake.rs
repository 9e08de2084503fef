//! The `handshake` harness: the session state machines fed hostile or arbitrary peers.
//!
//! The input is a script. Its first byte picks a mode, a few bytes configure the sessions,
//! and the rest is a list of operations, each an op byte and its arguments, read with a
//! [`Cursor`] until the input ends (see the `*_op` modules for the op numbers, and
//! [`crate::seeds`] for scripts that do real work):
//!
//! - [`Mode::Server`]: a [`ServerSession`], with or without a secret, fed frames built from
//!   the input and sent through the codec, raw bytes through both decoders, a correct `Auth`
//!   (the proof cannot be guessed, so the script can ask for it), pulls and releases of the
//!   regions it announced, timeouts and connection loss.
//! - [`Mode::Client`]: a [`ClientSession`] that fetches blocks while the script plays the
//!   server: arbitrary frames, well-formed answers for the blocks it requested, pulls,
//!   credits, and the driver's `send_pull`/`pull_complete` calls.
//! - [`Mode::Pair`]: a client and a server connected in memory through the codec, the script
//!   choosing secrets, credits, thresholds, the blocks, the interleaving, and optional
//!   corruption, loss and timeouts.
//!
//! Invariants asserted (besides "no panic"):
//!
//! - server: with a secret, no block is resolved and no `Eager`, `Rendezvous`, `PullData`,
//!   `BlockFailed` or `Credit` is sent before an `Auth` carrying the correct proof arrived;
//!   its `Ready` carries the correct server proof; an `Err` from any handler leaves the
//!   session closed, and a closed session emits nothing more; in-flight blocks never exceed
//!   the credits; eager blocks respect both thresholds; pulls stay inside announced regions
//!   and within [`MAX_PULL_CHUNK`]; every output survives the codec;
//! - client: `Connected` only after a correct server proof when a secret is set; no `Fetch`
//!   before `Connected`, each block requested once and as asked; every block ends exactly
//!   once (delivered or failed), `RequestDone` exactly once and only after all of its blocks,
//!   `Closed` exactly once and only after every request is done; credits never exceed the
//!   grant; an `Err` leaves the session closed;
//! - pair, when nothing was disturbed: every block has exactly the outcome the resolver and
//!   the negotiated thresholds call for, all credits come back and every region is released;
//!   with mismatched secrets, nothing is served and every block fails with `AuthRefused`.

use crate::cursor::Cursor;
use crate::frames::{read_frame, same_after_codec, through_codec, TIGHT};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use wire::frame::{Header, HEADER_LEN, MAX_PULL_CHUNK, NONCE_LEN, PROOF_LEN};
use wire::{
    caps, BlockFailure, BlockSpan, ClientConfig, ClientEvent, ClientSession, Descriptor, FailureCode, Frame, FrameError, Limits,
    ProtocolError, Resolved, Secret, ServerConfig, ServerOutput, ServerSession, Token, Transcript,
};

/// The server's nonce in every mode.
pub const SERVER_NONCE: [u8; NONCE_LEN] = [0x5e; NONCE_LEN];
/// The client's nonce in every mode.
pub const CLIENT_NONCE: [u8; NONCE_LEN] = [0xc1; NONCE_LEN];
/// The shared secret, where one is configured.
pub const SECRET: &str = "fuzz-secret";
/// A different secret, for mismatches.
pub const OTHER_SECRET: &str = "not-the-secret";

/// What the first input byte selects (modulo 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// A server session against a scripted client.
    Server = 0,
    /// A client session against a scripted server.
    Client = 1,
    /// A client and a server against each other.
    Pair = 2,
}

/// Server-mode ops (the op byte is taken modulo [`server_op::COUNT`]).
pub mod server_op {
    /// A frame built from the input ([`crate::frames::read_frame`]), through the codec.
    pub const FRAME: u8 = 0;
    /// A `u16`-length blob decoded with `Frame::decode_message`.
    pub const RAW: u8 = 1;
    /// A blob decoded as a stream driver does: header, then the fixed part.
    pub const STREAM: u8 = 2;
    /// An `Auth` with the correct proof for the first `Hello`'s nonce.
    pub const VALID_AUTH: u8 = 3;
    /// A `Pull` of an announced region: index byte, mode byte, offset `u64`, len `u64`.
    pub const PULL: u8 = 4;
    /// A `Release` of an announced region: index byte.
    pub const RELEASE: u8 = 5;
    /// Advance the clock by `u16` × 100 ms and call `handle_timeout`.
    pub const TIMEOUT: u8 = 6;
    /// The transport reports the connection lost.
    pub const LOST: u8 = 7;
    /// Number of ops.
    pub const COUNT: u8 = 8;
}

/// Client-mode ops (the op byte is taken modulo [`client_op::COUNT`]).
pub mod client_op {
    /// A frame built from the input, through the codec.
    pub const FRAME: u8 = 0;
    /// A blob decoded with `Frame::decode_message`.
    pub const RAW: u8 = 1;
    /// A version-1 `Challenge`: caps byte, nonce, flags byte (bit 7 flips `auth_required`,
    /// low 4 bits + 1 = credits), eager threshold `u32`.
    pub const CHALLENGE: u8 = 2;
    /// A `Ready` with the correct server proof (none without a secret).
    pub const READY: u8 = 3;
    /// `ClientSession::fetch`: count byte (mod 12), then group, object, start, end bytes each.
    pub const FETCH: u8 = 4;
    /// An `Eager` for a requested block: index byte, mode byte, len `u32`.
    pub const EAGER: u8 = 5;
    /// A `Rendezvous` for a requested block: index byte, region byte, addr `u64`, len `u32`,
    /// rkey `u32`.
    pub const RENDEZVOUS: u8 = 6;
    /// A `BlockFailed` for a requested block: index byte, code `u16`, message blob.
    pub const BLOCK_FAILED: u8 = 7;
    /// A `PullData` for an announced region: index byte, mode byte, offset `u64`, len `u64`.
    pub const PULL_DATA: u8 = 8;
    /// The driver: index byte, then a byte: bit 0 `send_pull`, else `pull_complete` (bit 1:
    /// success).
    pub const DRIVER: u8 = 9;
    /// A `Credit`: `u32`.
    pub const CREDIT: u8 = 10;
    /// A byte: 0 timeout (then `u16` × 100 ms), 1 connection lost, 2 close, 3 decode error.
    pub const LIFECYCLE: u8 = 11;
    /// Number of ops.
    pub const COUNT: u8 = 12;
}

/// Pair-mode ops (the op byte is taken modulo [`pair_op::COUNT`]).
pub mod pair_op {
    /// `ClientSession::fetch`: count byte (mod 10), then group byte, object `u32`, start
    /// byte, end byte each.
    pub const FETCH: u8 = 0;
    /// Move up to (byte mod 16 + 1) frames each way.
    pub const STEP: u8 = 1;
    /// Move frames until both sides are quiet.
    pub const SETTLE: u8 = 2;
    /// Flip bits of the next frame: direction byte (bit 0: server to client), position
    /// `u16`, xor byte.
    pub const CORRUPT: u8 = 3;
    /// Both transports report the connection lost.
    pub const LOST: u8 = 4;
    /// Advance the clock by `u16` seconds and call both `handle_timeout`s.
    pub const TIMEOUT: u8 = 5;
    /// Number of ops.
    pub const COUNT: u8 = 6;
}

/// Runs one script.
pub fn run(data: &[u8]) {
    run_with_stats(data);
}

/// How far a script got, so tests can tell that the seeds exercise what they claim to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// The mode the script ran in.
    pub mode: Option<Mode>,
    /// Eager, rendezvous and pull-data outputs the server produced.
    pub server_served: u64,
    /// Whether a client reported `Connected`.
    pub client_connected: bool,
    /// Blocks whose end (delivered or failed) a client reported.
    pub client_blocks_ended: u64,
    /// Blocks whose outcome the pair mode compared with the expected one.
    pub pair_blocks_checked: u64,
}

/// Runs one script and says how far it got.
pub fn run_with_stats(data: &[u8]) -> Stats {
    let mut c = Cursor::new(data);
    match c.u8() % 3 {
        0 => run_server(&mut c),
        1 => run_client(&mut c),
        _ => run_pair(&mut c),
    }
}

// ---------------------------------------------------------------------------------------
// Server side

/// Blocks of `object % 2^32` bytes, served from source `object`; groups `3 mod 4` fail with
/// the code numbered by the span's start.
fn server_mode_resolver(span: &BlockSpan) -> Result<Resolved<u64>, BlockFailure> {
    if span.group % 4 == 3 {
        return Err(BlockFailure::new(FailureCode::from_u16(span.start as u16), "fuzz: failing block"));
    }
    Ok(Resolved { source: span.object, offset: span.start as u64, len: span.object % (1 << 32) })
}

/// Watches one server session and checks everything it says.
struct ServerWatch {
    secret: Option<Secret>,
    credits: u32,
    eager_threshold: u32,
    /// The first `Hello` handed to the session.
    hello: Option<Frame>,
    /// The `Challenge` the session answered it with.
    challenge: Option<Frame>,
    /// Whether an `Auth` with the correct proof was handed to the session.
    valid_auth: bool,
    /// Regions announced and not released: id → length.
    regions: HashMap<u64, u64>,
    /// Every region ever announced. Outputs queued before a failure are still flushed after
    /// it, so pull data is checked against these, not against the live table.
    announced: HashMap<u64, u64>,
    /// Regions whose `Release` the session accepted before the watch saw the `Rendezvous`
    /// announcing them. Only possible in pair mode, where outputs wait in the session's
    /// queue until the pump moves them: a corrupted `Release` can name a region the server
    /// has queued but the client has not heard of. The queued `Rendezvous` must follow.
    released_early: HashSet<u64>,
    /// Whether the watch takes and discards the outputs after each input (server mode), or
    /// leaves them for the pump to carry to a client (pair mode), which checks them then.
    drains: bool,
    /// Eager, rendezvous and pull-data outputs seen.
    served: u64,
}

impl ServerWatch {
    fn new(config: &ServerConfig) -> Self {
        ServerWatch {
            secret: config.secret.clone(),
            credits: config.credits,
            eager_threshold: config.eager_threshold,
            hello: None,
            challenge: None,
            valid_auth: false,
            regions: HashMap::new(),
            announced: HashMap::new(),
            released_early: HashSet::new(),
            drains: true,
            served: 0,
        }
    }

    fn may_serve(&self) -> bool {
        self.secret.is_none() || self.valid_auth
    }

    fn transcript(&self) -> Option<Transcript> {
        Some(Transcript::new(self.hello.as_ref()?, self.challenge.as_ref()?))
    }

    /// The proof a client that knows the secret would send (garbage before a `Challenge`).
    fn correct_client_proof(&self) -> [u8; PROOF_LEN] {
        match self.transcript() {
            Some(t) => self.secret.clone().unwrap_or_else(|| Secret::new(SECRET)).client_proof(&t),
            None => [0; PROOF_LEN],
        }
    }

    fn hello_max_eager(&self) -> u32 {
        match &self.hello {
            Some(Frame::Hello { max_eager, .. }) => *max_eager,
            _ => 0,
        }
    }

    /// Hands `frame` to `s`, with every check before and after.
    fn feed<F>(&mut self, s: &mut ServerSession<u64>, frame: Frame, resolver: F)
    where
        F: Fn(&BlockSpan) -> Result<Resolved<u64>, BlockFailure>,
    {
        match &frame {
            Frame::Hello { .. } if self.hello.is_none() => self.hello = Some(frame.clone()),
            Frame::Auth { proof: Some(p) }
                if self.secret.is_some() && self.challenge.is_some() && *p == self.correct_client_proof() =>
            {
                self.valid_auth = true
            }
            _ => {}
        }
        let release = match &frame {
            Frame::Release { region } => Some(*region),
            _ => None,
        };
        let was_closed = s.is_closed();
        let may_serve = self.may_serve();
        let mut resolve = |span: &BlockSpan| {
            assert!(may_serve, "the server resolved {span} before the client proved the secret");
            resolver(span)
        };
        match s.handle_frame(frame, &mut resolve) {
            Ok(()) => {
                assert!(!was_closed && !s.is_closed(), "Ok from a closed session");
                if let Some(region) = release {
                    if self.regions.remove(&region).is_none() {
                        // Not announced yet as far as the watch knows: fine only while the
                        // announcement may still be queued, and never twice.
                        assert!(
                            !self.drains && !self.announced.contains_key(&region),
                            "release of unknown region {region} accepted"
                        );
                        assert!(self.released_early.insert(region), "region {region} released twice");
                    }
                }
            }
            Err(e) => {
                assert!(s.is_closed(), "handle_frame returned {e} but the session is not closed");
                if was_closed {
                    assert_eq!(e.error, ProtocolError::LocallyClosed);
                }
            }
        }
        self.after_input(s, was_closed);
    }

    fn decode_error(&mut self, s: &mut ServerSession<u64>, e: FrameError) {
        let was_closed = s.is_closed();
        let err = s.handle_decode_error(e.clone());
        assert_eq!(err.error, ProtocolError::Frame(e));
        assert!(s.is_closed());
        self.after_input(s, was_closed);
    }

    fn after_input(&mut self, s: &mut ServerSession<u64>, was_closed: bool) {
        if self.drains {
            self.drain(s, was_closed);
        } else {
            self.check_state(s, false);
        }
    }

    /// Takes every queued output and checks it.
    fn drain(&mut self, s: &mut ServerSession<u64>, was_closed: bool) {
        let client_limits = Limits { max_eager: u32::MAX, max_pull: MAX_PULL_CHUNK, ..Limits::default() };
        while let Some(o) = s.poll_output() {
            assert!(!was_closed, "a closed session emitted {o:?}");
            self.check_output(&o);
            let Some(frame) = output_frame(&o, 9) else { continue };
            let got = through_codec(&frame, &client_limits)
                .unwrap_or_else(|e| panic!("server sent {frame:?}, which does not decode: {e}"));
            assert!(same_after_codec(&frame, &got), "{frame:?} decodes as {got:?}");
        }
        self.check_state(s, true);
    }

    /// Credits and regions. The region table can only be compared once every output has been
    /// seen (`all_seen`).
    fn check_state(&mut self, s: &ServerSession<u64>, all_seen: bool) {
        assert!(
            s.outstanding() <= self.credits.max(1),
            "{} blocks in flight with {} credits",
            s.outstanding(),
            self.credits.max(1)
        );
        if s.is_closed() {
            assert_eq!(s.open_regions(), 0, "a closed session keeps regions");
            self.regions.clear();
        } else if all_seen {
            assert_eq!(s.open_regions(), self.regions.len(), "region table disagrees with what was announced and released");
        }
    }

    fn check_output(&mut self, o: &ServerOutput<u64>) {
        let serving = self.may_serve();
        if matches!(o, ServerOutput::Eager { .. } | ServerOutput::PullData { .. } | ServerOutput::Expose { .. }) {
            self.served += 1;
        }
        let eager_limit = self.eager_threshold.min(self.hello_max_eager());
        match o {
            ServerOutput::Expose { region, len, .. } => {
                assert!(serving, "region exposed before a valid Auth: {o:?}");
                assert!(*len > eager_limit as u64, "{len} bytes offered by rendezvous under the eager threshold {eager_limit}");
                assert!(self.announced.insert(*region, *len).is_none(), "region id {region} reused");
                if !self.released_early.remove(region) {
                    self.regions.insert(*region, *len);
                }
            }
            ServerOutput::Revoke { region } => {
                assert!(serving, "revoke before a valid Auth: {o:?}");
                assert!(
                    self.announced.contains_key(region) || self.released_early.contains(region),
                    "revoke of region {region}, never exposed"
                );
                assert!(!self.regions.contains_key(region), "revoke of region {region}, which the client still holds");
            }
            ServerOutput::Eager { frame: Frame::Eager { len, .. }, len: payload, .. } => {
                assert!(serving, "eager block sent before a valid Auth: {o:?}");
                assert_eq!(*len as u64, *payload);
                assert!(*len <= eager_limit, "eager block of {len} bytes over the threshold {eager_limit}");
            }
            ServerOutput::PullData { frame: Frame::PullData { region, offset, len }, len: payload, .. } => {
                assert!(serving, "pull data sent before a valid Auth: {o:?}");
                assert_eq!(len, payload);
                assert!(*len <= MAX_PULL_CHUNK, "pull chunk of {len} bytes");
                let rlen = *self.announced.get(region).unwrap_or_else(|| panic!("pull data for unannounced region {region}"));
                assert!(
                    offset.checked_add(*len).is_some_and(|end| end <= rlen),
                    "pull data {offset}+{len} outside region of {rlen}"
                );
            }
            ServerOutput::Eager { .. } | ServerOutput::PullData { .. } => panic!("payload output with the wrong frame: {o:?}"),
            ServerOutput::Frame(f) => match f {
                Frame::BlockFailed { .. } | Frame::Credit { .. } => assert!(serving, "{f:?} sent before a valid Auth"),
                Frame::Ready { proof, credits } => {
                    assert!(
                        (1..=self.credits.max(1)).contains(credits),
                        "live grant {credits} outside 1..={}",
                        self.credits.max(1)
                    );
                    let expected = self.secret.as_ref().map(|s| {
                        assert!(self.valid_auth, "Ready sent without a valid Auth");
                        s.server_proof(&self.transcript().expect("Ready after a Challenge"), *credits)
                    });
                    assert_eq!(*proof, expected, "wrong server proof");
                }
                Frame::Challenge { auth_required, app_id, .. } => {
                    assert_eq!(*auth_required, self.secret.is_some());
                    assert!(app_id.is_empty(), "the server announced another application");
                    assert!(
                        matches!(&self.hello, Some(Frame::Hello { app_id, .. }) if app_id.is_empty()),
                        "a Challenge for a client of another application: {:?}",
                        self.hello
                    );
                    assert!(self.challenge.is_none(), "two Challenges");
                    self.challenge = Some(f.clone());
                }
                Frame::Error { .. } => {}
                other => panic!("the server sent a client frame: {other:?}"),
            },
        }
    }
}

fn run_server(c: &mut Cursor<'_>) -> Stats {
    let flags = c.u8();
    let start = Instant::now();
    let mut config = ServerConfig::new("fuzz-client", SERVER_NONCE);
    config.secret = (flags & 1 == 1).then(|| Secret::new(SECRET));
    if flags & 2 == 2 {
        config.limits = TIGHT;
    }
    config.caps = ((flags >> 2) & 7) as u64;
    config.credits = (c.u8() % 17) as u32;
    config.eager_threshold = c.u32();
    let handshake_timeout = config.handshake_timeout;
    let mut watch = ServerWatch::new(&config);
    let mut s: ServerSession<u64> = ServerSession::new(config, start);
    let mut now = start;
    let limits = s.limits();

    while !c.is_empty() {
        match c.u8() % server_op::COUNT {
            server_op::FRAME => match through_codec(&read_frame(c), &limits) {
                Ok(f) => watch.feed(&mut s, f, server_mode_resolver),
                Err(e) => watch.decode_error(&mut s, e),
            },
            server_op::RAW => match Frame::decode_message(c.blob(), &limits) {
                Ok((f, _)) => watch.feed(&mut s, f, server_mode_resolver),
                Err(e) => watch.decode_error(&mut s, e),
            },
            server_op::STREAM => {
                let bytes = c.blob();
                match Header::decode(bytes, &limits) {
                    // A stream driver waits for more bytes; nothing to hand over yet.
                    Ok(h) if bytes.len() < HEADER_LEN + h.fixed_len() => {}
                    Ok(h) => match Frame::decode_body(&h, &bytes[HEADER_LEN..HEADER_LEN + h.fixed_len()], &limits) {
                        Ok(f) => watch.feed(&mut s, f, server_mode_resolver),
                        Err(e) => watch.decode_error(&mut s, e),
                    },
                    // Fewer bytes than a header: a stream driver waits. (With a whole
                    // header, `Truncated` means a payload frame shorter than its fixed part,
                    // which is an error.)
                    Err(FrameError::Truncated { .. }) if bytes.len() < HEADER_LEN => {}
                    Err(e) => watch.decode_error(&mut s, e),
                }
            }
            server_op::VALID_AUTH => {
                let f = Frame::Auth { proof: Some(watch.correct_client_proof()) };
                watch.feed(&mut s, f, server_mode_resolver);
            }
            server_op::PULL => {
                let (region, rlen) = pick_region(c, &watch.regions);
                let mode = c.u8();
                let (mut offset, mut len) = (c.u64(), c.u64());
                if mode & 1 == 1 {
                    offset %= rlen + 2;
                }
                if mode & 2 == 2 {
                    len %= rlen + 2;
                }
                match through_codec(&Frame::Pull { region, offset, len }, &limits) {
                    Ok(f) => watch.feed(&mut s, f, server_mode_resolver),
                    Err(e) => watch.decode_error(&mut s, e),
                }
            }
            server_op::RELEASE => {
                let (region, _) = pick_region(c, &watch.regions);
                watch.feed(&mut s, Frame::Release { region }, server_mode_resolver);
            }
            server_op::TIMEOUT => {
                now += Duration::from_millis(c.u16() as u64 * 100);
                let (was_closed, was_ready) = (s.is_closed(), s.is_ready());
                let r = s.handle_timeout(now);
                let due = !was_closed && !was_ready && now >= start + handshake_timeout;
                assert_eq!(r.is_err(), due, "handshake timeout: due {due}, got {r:?}");
                if r.is_err() {
                    assert!(s.is_closed());
                }
                watch.drain(&mut s, was_closed);
            }
            _ => {
                let err = s.handle_connection_lost("fuzz: reset");
                assert!(matches!(err.error, ProtocolError::ConnectionLost(_)));
                assert!(s.is_closed());
                // Nobody is left to tell: nothing may be queued.
                watch.drain(&mut s, true);
            }
        }
    }
    Stats { mode: Some(Mode::Server), server_served: watch.served, ..Stats::default() }
}

/// An announced region chosen by an index byte, or an arbitrary id when there is none.
fn pick_region(c: &mut Cursor<'_>, regions: &HashMap<u64, u64>) -> (u64, u64) {
    let i = c.u8() as usize;
    let mut ids: Vec<(u64, u64)> = regions.iter().map(|(k, v)| (*k, *v)).collect();
    ids.sort_unstable();
    if ids.is_empty() || i == 255 {
        (c.u64(), 0)
    } else {
        ids[i % ids.len()]
    }
}

// ---------------------------------------------------------------------------------------
// Client side

/// How one block ended, as the client reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Eager(u32),
    Pulled(u64),
    Failed(FailureCode),
}

#[derive(Debug)]
struct RequestWatch {
    spans: Vec<BlockSpan>,
    outcome: Vec<Option<Outcome>>,
    requested: Vec<bool>,
    done: bool,
    /// Whether the session was already closed when `fetch` was called.
    fetched_closed: bool,
}

/// The frame a driver sends for a server output (`None` for a revocation, which sends
/// nothing); an exposure becomes a `Rendezvous` with key `rkey`.
fn output_frame(o: &ServerOutput<u64>, rkey: u32) -> Option<Frame> {
    match o {
        ServerOutput::Frame(f) | ServerOutput::Eager { frame: f, .. } | ServerOutput::PullData { frame: f, .. } => {
            Some(f.clone())
        }
        ServerOutput::Expose { req, index, region, offset, len, .. } => Some(Frame::Rendezvous {
            req: *req,
            index: *index,
            desc: Descriptor { region: *region, addr: *offset, len: *len, rkey },
        }),
        ServerOutput::Revoke { .. } => None,
    }
}

/// Watches one client session and checks everything it says.
struct ClientWatch {
    secret: Option<Secret>,
    max_eager: u32,
    transmitted: usize,
    /// The session's `Hello`.
    hello: Option<Frame>,
    /// The first `Challenge` handed over.
    challenge: Option<Frame>,
    /// Whether a `Ready` with the correct server proof was handed over.
    valid_ready: bool,
    /// Credits and eager threshold from `Connected`.
    connected: Option<(u32, u32)>,
    requests: BTreeMap<u64, RequestWatch>,
    /// Blocks sent in `Fetch` frames, in order.
    requested: Vec<Token>,
    /// Blocks announced by `Rendezvous` events: descriptor, bytes received so far, and
    /// whether the driver started the pull.
    rendezvous: BTreeMap<Token, (Descriptor, u64, bool)>,
    closed_event: bool,
    /// Blocks that ended.
    ended: u64,
}

impl ClientWatch {
    fn new(config: &ClientConfig) -> Self {
        ClientWatch {
            secret: config.secret.clone(),
            max_eager: config.max_eager,
            transmitted: 0,
            hello: None,
            challenge: None,
            valid_ready: false,
            connected: None,
            requests: BTreeMap::new(),
            requested: Vec::new(),
            rendezvous: BTreeMap::new(),
            closed_event: false,
            ended: 0,
        }
    }

    fn transcript(&self) -> Option<Transcript> {
        Some(Transcript::new(self.hello.as_ref()?, self.challenge.as_ref()?))
    }

    /// The proof a server that knows the secret would send with a grant of `credits`.
    fn correct_server_proof(&self, credits: u32) -> Option<[u8; PROOF_LEN]> {
        let t = self.transcript().unwrap_or(Transcript::new(&Frame::Credit { n: 0 }, &Frame::Credit { n: 0 }));
        self.secret.as_ref().map(|s| s.server_proof(&t, credits))
    }

    /// The credit limit the `Challenge` announced.
    fn max_credits(&self) -> u32 {
        match &self.challenge {
            Some(Frame::Challenge { credits, .. }) => *credits,
            _ => 0,
        }
    }

    fn fetch(&mut self, c: &mut ClientSession, spans: Vec<BlockSpan>, now: Instant) {
        let fetched_closed = c.is_closed();
        let n = spans.len();
        let req = c.fetch(spans.clone(), now);
        let prev = self
            .requests
            .insert(req, RequestWatch { spans, outcome: vec![None; n], requested: vec![false; n], done: false, fetched_closed });
        assert!(prev.is_none(), "request id {req} reused");
    }

    fn feed(&mut self, c: &mut ClientSession, frame: Frame, now: Instant) {
        match &frame {
            Frame::Challenge { .. } if self.challenge.is_none() => self.challenge = Some(frame.clone()),
            Frame::Ready { proof, credits }
                if self.secret.is_some() && self.challenge.is_some() && *proof == self.correct_server_proof(*credits) =>
            {
                self.valid_ready = true
            }
            _ => {}
        }
        let was_closed = c.is_closed();
        match c.handle_frame(frame, now) {
            Ok(()) => assert!(!was_closed && !c.is_closed(), "Ok from a closed session"),
            Err(e) => {
                assert!(c.is_closed(), "handle_frame returned {e} but the session is not closed");
                if was_closed {
                    assert_eq!(e.error, ProtocolError::LocallyClosed);
                }
            }
        }
    }

    fn finish(&mut self, t: Token, outcome: Outcome) {
        let r = self.requests.get_mut(&t.req).unwrap_or_else(|| panic!("{t:?} of an unknown request ended"));
        assert!(!r.done, "{t:?} ended after its RequestDone");
        let slot = r.outcome.get_mut(t.index as usize).unwrap_or_else(|| panic!("{t:?} is out of range"));
        assert!(slot.is_none(), "{t:?} ended twice: {slot:?} then {outcome:?}");
        *slot = Some(outcome);
        self.ended += 1;
        self.rendezvous.remove(&t);
    }

    fn live(&self, t: Token) -> bool {
        self.requests.get(&t.req).is_some_and(|r| !r.done && r.outcome.get(t.index as usize).is_some_and(|o| o.is_none()))
    }

    /// The driver finished a pull; checks the session's answer.
    fn pull_complete(&mut self, c: &mut ClientSession, t: Token, ok: bool, now: Instant) {
        let result = if ok { Ok(()) } else { Err(BlockFailure::new(FailureCode::PullFailed, "fuzz: read failed")) };
        let pulling = self.rendezvous.get(&t).copied();
        let r = c.pull_complete(t, result, now);
        match (pulling, &r) {
            (Some((_, received, _)), Ok(())) => {
                if ok {
                    self.finish(t, Outcome::Pulled(received));
                }
            }
            (None, Ok(())) => panic!("pull_complete accepted {t:?}, which is not being pulled"),
            (Some(_), Err(e)) => assert!(c.is_closed(), "pull_complete refused a block being pulled: {e}"),
            (None, Err(_)) => {}
        }
    }

    /// Takes every queued event and frame, and checks them. Events go first: the `Connected`
    /// event and the `Fetch` frames it releases come out of the same call.
    fn drain(&mut self, c: &mut ClientSession) {
        while let Some(e) = c.poll_event() {
            self.check_event(e, c);
        }
        while let Some(f) = c.poll_transmit() {
            self.check_transmit(&f, c);
        }
        self.check_state(c);
    }

    fn check_transmit(&mut self, f: &Frame, c: &ClientSession) {
        self.transmitted += 1;
        let got =
            through_codec(f, &Limits::default()).unwrap_or_else(|e| panic!("client sent {f:?}, which does not decode: {e}"));
        assert!(same_after_codec(f, &got), "{f:?} decodes as {got:?}");
        match f {
            Frame::Hello { nonce, .. } => {
                assert_eq!(self.transmitted, 1, "Hello is the first frame and only that");
                assert_eq!(*nonce, CLIENT_NONCE);
                self.hello = Some(f.clone());
            }
            Frame::Auth { proof } => {
                let t = self.transcript().expect("Auth after a Challenge");
                let expected = self.secret.as_ref().map(|s| s.client_proof(&t));
                assert_eq!(*proof, expected, "wrong client proof");
            }
            Frame::Fetch { req, first_index, blocks } => {
                assert!(self.connected.is_some(), "Fetch sent before the handshake completed");
                assert!(!blocks.is_empty(), "empty Fetch");
                let r = self.requests.get_mut(req).unwrap_or_else(|| panic!("Fetch for unknown request {req}"));
                for (i, b) in blocks.iter().enumerate() {
                    let index = *first_index as usize + i;
                    assert_eq!(r.spans.get(index), Some(b), "Fetch of request {req} index {index} is not what was asked");
                    assert!(!r.requested[index], "block {index} of request {req} requested twice");
                    r.requested[index] = true;
                    self.requested.push(Token { req: *req, index: index as u32 });
                }
            }
            Frame::Pull { region, offset, len } => {
                // Frames queued before a failure are still flushed after it, when the
                // region may be gone; only a live session's pulls can be checked.
                if !c.is_closed() {
                    let d = self.rendezvous.values().find(|(d, _, _)| d.region == *region);
                    assert!(
                        d.is_some_and(|(d, _, _)| *offset == 0 && *len == d.len),
                        "pull {f:?} does not match an announced region"
                    );
                }
            }
            Frame::Release { .. } => {}
            Frame::Error { .. } => assert!(c.is_closed(), "Error frame sent on a live session"),
            other => panic!("the client sent a server frame: {other:?}"),
        }
    }

    fn check_event(&mut self, e: ClientEvent, c: &ClientSession) {
        if self.closed_event {
            // A closed session still answers new fetches, failing them at once.
            let after_close = |req: &u64| self.requests.get(req).is_some_and(|r| r.fetched_closed);
            let ok = match &e {
                ClientEvent::Failed { token, failure } => failure.code == FailureCode::PeerGone && after_close(&token.req),
                ClientEvent::RequestDone { req } => after_close(req),
                _ => false,
            };
            assert!(ok, "event after Closed: {e:?}");
        }
        match e {
            ClientEvent::Connected { credits, eager_threshold, .. } => {
                assert!(self.connected.is_none(), "connected twice");
                if self.secret.is_some() {
                    assert!(self.valid_ready, "connected without the server proving the secret");
                }
                assert!(credits >= 1 && credits <= self.max_credits() && eager_threshold <= self.max_eager);
                self.connected = Some((credits, eager_threshold));
            }
            ClientEvent::Eager { token, len } => {
                let eager = self.connected.map(|c| c.1).unwrap_or(0);
                assert!(len <= eager, "eager block of {len} bytes accepted over {eager}");
                self.finish(token, Outcome::Eager(len));
            }
            ClientEvent::Rendezvous { token, desc } => {
                assert!(self.live(token), "rendezvous for finished {token:?}");
                assert!(self.rendezvous.insert(token, (desc, 0, false)).is_none(), "{token:?} announced twice");
            }
            ClientEvent::PullData { token, offset, len, last } => {
                let (desc, received, started) =
                    self.rendezvous.get_mut(&token).unwrap_or_else(|| panic!("pull data for {token:?}, not announced"));
                assert!(*started, "pull data for {token:?} before its pull was sent");
                assert_eq!(offset, *received, "pull data out of order");
                *received += len;
                assert!(*received <= desc.len);
                assert_eq!(last, *received == desc.len);
            }
            ClientEvent::Failed { token, failure } => self.finish(token, Outcome::Failed(failure.code)),
            ClientEvent::RequestDone { req } => {
                let r = self.requests.get_mut(&req).unwrap_or_else(|| panic!("RequestDone for unknown {req}"));
                assert!(!r.done, "RequestDone twice for {req}");
                assert!(r.outcome.iter().all(|o| o.is_some()), "RequestDone for {req} with blocks outstanding: {r:?}");
                r.done = true;
            }
            ClientEvent::Closed { .. } => {
                assert!(c.is_closed());
                self.closed_event = true;
                let open: Vec<_> = self.requests.iter().filter(|(_, r)| !r.done).map(|(k, _)| *k).collect();
                assert!(open.is_empty(), "Closed with requests {open:?} still open");
            }
        }
    }

    fn check_state(&self, c: &ClientSession) {
        assert_eq!(self.closed_event, c.is_closed(), "closed without a Closed event, or the reverse");
        if self.connected.is_some() {
            let max = self.max_credits();
            assert!(c.credits() <= max, "{} credits with a limit of {max}", c.credits());
        }
        let open: usize =
            self.requests.values().filter(|r| !r.done).map(|r| r.outcome.iter().filter(|o| o.is_none()).count()).sum();
        assert_eq!(c.outstanding_blocks(), open, "the session and the events disagree on the blocks outstanding");
    }
}

fn client_config(flags: u8, max_eager: u32) -> ClientConfig {
    let mut config = ClientConfig::new("fuzz-server", CLIENT_NONCE);
    config.secret = (flags & 1 == 1).then(|| Secret::new(SECRET));
    if flags & 2 == 2 {
        config.limits = TIGHT;
    }
    config.caps = ((flags >> 2) & 7) as u64;
    config.max_eager = max_eager;
    config
}

fn run_client(c: &mut Cursor<'_>) -> Stats {
    let flags = c.u8();
    let config = client_config(flags, c.u32());
    let mut watch = ClientWatch::new(&config);
    let mut now = Instant::now();
    let mut s = ClientSession::new(config, now);
    watch.drain(&mut s);
    while !c.is_empty() {
        let limits = s.limits();
        match c.u8() % client_op::COUNT {
            client_op::FRAME => match through_codec(&read_frame(c), &limits) {
                Ok(f) => watch.feed(&mut s, f, now),
                Err(e) => {
                    s.handle_decode_error(e);
                }
            },
            client_op::RAW => match Frame::decode_message(c.blob(), &limits) {
                Ok((f, _)) => watch.feed(&mut s, f, now),
                Err(e) => {
                    s.handle_decode_error(e);
                }
            },
            client_op::CHALLENGE => {
                let caps = (c.u8() & 7) as u64;
                let nonce = c.array();
                let b = c.u8();
                let f = Frame::Challenge {
                    version: 2,
                    caps,
                    nonce,
                    auth_required: watch.secret.is_some() ^ (b & 0x80 != 0),
                    credits: 1 + (b & 15) as u32,
                    eager_threshold: c.u32(),
                    app_id: String::new(),
                };
                watch.feed(&mut s, f, now);
            }
            client_op::READY => {
                let credits = watch.max_credits().max(1);
                let f = Frame::Ready { proof: watch.correct_server_proof(credits), credits };
                watch.feed(&mut s, f, now);
            }
            client_op::FETCH => {
                let n = c.u8() % 12;
                let spans = (0..n)
                    .map(|_| BlockSpan { group: c.u8() as u32, object: c.u8() as u64, start: c.u8() as u32, end: c.u8() as u32 })
                    .collect();
                watch.fetch(&mut s, spans, now);
            }
            client_op::EAGER => {
                let token = pick_token(c, &watch.requested);
                let mode = c.u8();
                let mut len = c.u32();
                if mode & 1 == 1 {
                    len %= watch.connected.map(|c| c.1).unwrap_or(0).saturating_add(2);
                }
                watch.feed(&mut s, Frame::Eager { req: token.req, index: token.index, len }, now);
            }
            client_op::RENDEZVOUS => {
                let token = pick_token(c, &watch.requested);
                let desc = Descriptor { region: c.u8() as u64, addr: c.u64(), len: c.u32() as u64, rkey: c.u32() };
                watch.feed(&mut s, Frame::Rendezvous { req: token.req, index: token.index, desc }, now);
            }
            client_op::BLOCK_FAILED => {
                let token = pick_token(c, &watch.requested);
                let code = FailureCode::from_u16(c.u16());
                let message = String::from_utf8_lossy(c.blob()).into_owned();
                match through_codec(&Frame::BlockFailed { req: token.req, index: token.index, code, message }, &limits) {
                    Ok(f) => watch.feed(&mut s, f, now),
                    Err(e) => {
                        s.handle_decode_error(e);
                    }
                }
            }
            client_op::PULL_DATA => {
                let i = c.u8() as usize;
                let mode = c.u8();
                let (mut offset, mut len) = (c.u64(), c.u64());
                let announced: Vec<(Descriptor, u64, bool)> = watch.rendezvous.values().copied().collect();
                let region = match announced.get(i % announced.len().max(1)) {
                    Some((desc, received, _)) => {
                        if mode & 1 == 1 {
                            offset = *received;
                        }
                        if mode & 2 == 2 {
                            len %= desc.len + 2;
                        }
                        desc.region
                    }
                    None => i as u64,
                };
                match through_codec(&Frame::PullData { region, offset, len }, &limits) {
                    Ok(f) => watch.feed(&mut s, f, now),
                    Err(e) => {
                        s.handle_decode_error(e);
                    }
                }
            }
            client_op::DRIVER => {
                let i = c.u8() as usize;
                let b = c.u8();
                let tokens: Vec<Token> = watch.rendezvous.keys().copied().collect();
                let token = tokens.get(i % tokens.len().max(1)).copied().unwrap_or(Token { req: i as u64, index: b as u32 });
                if b & 1 == 1 {
                    let r = s.send_pull(token, now);
                    let fresh = watch.rendezvous.get(&token).is_some_and(|(_, received, started)| *received == 0 && !started);
                    assert_eq!(r.is_ok(), fresh && !s.is_closed(), "send_pull({token:?}) gave {r:?}");
                    if let (Ok(()), Some(entry)) = (r, watch.rendezvous.get_mut(&token)) {
                        entry.2 = true;
                    }
                } else {
                    watch.pull_complete(&mut s, token, b & 2 == 2, now);
                }
            }
            client_op::CREDIT => watch.feed(&mut s, Frame::Credit { n: c.u32() }, now),
            _ => match c.u8() % 4 {
                0 => {
                    now += Duration::from_millis(c.u16() as u64 * 100);
                    s.handle_timeout(now);
                }
                1 => s.handle_connection_lost("fuzz: reset"),
                2 => s.close(),
                _ => {
                    let e = FrameError::BadMagic { found: c.u32() };
                    let err = s.handle_decode_error(e.clone());
                    assert_eq!(err.error, ProtocolError::Frame(e));
                    assert!(s.is_closed());
                }
            },
        }
        watch.drain(&mut s);
    }
    Stats {
        mode: Some(Mode::Client),
        client_connected: watch.connected.is_some(),
        client_blocks_ended: watch.ended,
        ..Stats::default()
    }
}

/// A block the client requested, chosen by an index byte, or an arbitrary one when none is.
fn pick_token(c: &mut Cursor<'_>, requested: &[Token]) -> Token {
    let i = c.u8() as usize;
    if requested.is_empty() || i == 255 {
        Token { req: c.u8() as u64, index: c.u8() as u32 }
    } else {
        requested[i % requested.len()]
    }
}

// ---------------------------------------------------------------------------------------
// Both sides

/// Blocks of `object mod 64 MiB` bytes (up to four pull chunks); groups `7 mod 8` fail with
/// the code numbered by the span's start.
fn pair_resolver(span: &BlockSpan) -> Result<Resolved<u64>, BlockFailure> {
    if span.group % 8 == 7 {
        return Err(BlockFailure::new(FailureCode::from_u16(span.start as u16), "fuzz: failing block"));
    }
    Ok(Resolved { source: span.object, offset: 0, len: span.object % (64 << 20) })
}

struct Pair {
    client: ClientSession,
    server: ServerSession<u64>,
    cw: ClientWatch,
    sw: ServerWatch,
    now: Instant,
    /// Pending corruption: direction (true: server to client), byte position, xor mask.
    corrupt: Option<(bool, usize, u8)>,
    /// Whether corruption, loss or a timeout interfered, so only safety can be checked.
    disturbed: bool,
}

impl Pair {
    fn corrupt(&mut self, to_client: bool, bytes: &mut [u8]) {
        if let Some((dir, pos, mask)) = self.corrupt {
            if dir == to_client && !bytes.is_empty() {
                bytes[pos % bytes.len()] ^= mask;
                self.corrupt = None;
            }
        }
    }

    /// Moves one frame from the client to the server, if one is waiting.
    fn client_to_server(&mut self) -> bool {
        let Some(f) = self.client.poll_transmit() else { return false };
        self.cw.check_transmit(&f, &self.client);
        let mut bytes = f.to_vec();
        self.corrupt(false, &mut bytes);
        match Frame::decode_message(&bytes, &self.server.limits()) {
            Ok((g, _)) => self.sw.feed(&mut self.server, g, pair_resolver),
            Err(e) => self.sw.decode_error(&mut self.server, e),
        }
        true
    }

    /// Moves one output from the server to the client, if one is waiting: header and fixed
    /// part through the codec as a tcp driver reads them (the payload is only a length).
    fn server_to_client(&mut self) -> bool {
        let Some(o) = self.server.poll_output() else { return false };
        self.sw.check_output(&o);
        let payload = match &o {
            ServerOutput::Eager { len, .. } | ServerOutput::PullData { len, .. } => *len,
            _ => 0,
        };
        // A revocation sends nothing (as a driver would: it only withdraws the exposure).
        let Some(frame) = output_frame(&o, 3) else { return true };
        let mut bytes = frame.to_vec();
        self.corrupt(true, &mut bytes);
        let limits = self.client.limits();
        let decoded = Header::decode(&bytes, &limits).and_then(|h| {
            let end = HEADER_LEN + h.fixed_len();
            if bytes.len() < end {
                return Err(FrameError::Truncated { needed: end, have: bytes.len() });
            }
            Ok((h, Frame::decode_body(&h, &bytes[HEADER_LEN..end], &limits)?))
        });
        match decoded {
            Ok((h, g)) => {
                if !self.disturbed {
                    assert_eq!(h.payload_len(), payload, "{frame:?}: header and output disagree on the payload");
                }
                self.cw.feed(&mut self.client, g, self.now);
            }
            Err(e) => {
                assert!(self.disturbed, "server frame {frame:?} does not decode at the client: {e}");
                self.client.handle_decode_error(e);
            }
        }
        self.client_events();
        true
    }

    /// Checks the client's events and acts on them as a tcp driver would: pull each
    /// announced region, complete each finished pull.
    fn client_events(&mut self) {
        while let Some(e) = self.client.poll_event() {
            self.cw.check_event(e.clone(), &self.client);
            match e {
                ClientEvent::Rendezvous { token, desc } if desc.len == 0 => {
                    self.cw.pull_complete(&mut self.client, token, true, self.now)
                }
                ClientEvent::Rendezvous { token, .. } => {
                    let r = self.client.send_pull(token, self.now);
                    assert!(r.is_ok() || self.client.is_closed(), "send_pull after Rendezvous: {r:?}");
                    if let (Ok(()), Some(entry)) = (r, self.cw.rendezvous.get_mut(&token)) {
                        entry.2 = true;
                    }
                }
                ClientEvent::PullData { token, last: true, .. } => self.cw.pull_complete(&mut self.client, token, true, self.now),
                _ => {}
            }
        }
        self.cw.check_state(&self.client);
    }

    /// Moves up to `n` frames each way; returns whether anything moved.
    fn step(&mut self, n: usize) -> bool {
        let mut moved = false;
        for _ in 0..n {
            let a = self.client_to_server();
            let b = self.server_to_client();
            moved |= a | b;
            if !(a | b) {
                break;
            }
        }
        moved
    }

    /// Moves frames until both sides are quiet. Every block costs a bounded number of
    /// frames, so a session that keeps talking has a livelock.
    fn settle(&mut self) {
        for _ in 0..100_000 {
            if !self.step(1) {
                return;
            }
        }
        panic!("the sessions did not settle after 100000 frames each way");
    }
}

fn run_pair(c: &mut Cursor<'_>) -> Stats {
    let flags = c.u8();
    let credits = (c.u8() % 9) as u32;
    let eager_threshold = c.u32() % (1 << 21);
    let max_eager = c.u32() % (1 << 21);
    let max_blocks = (c.u8() % 8) as u32 + 1;
    let start = Instant::now();

    let mut cc = ClientConfig::new("fuzz-server", CLIENT_NONCE);
    cc.secret = (flags & 1 == 1).then(|| Secret::new(SECRET));
    cc.max_eager = max_eager;
    if flags & 8 == 8 {
        cc.caps &= !caps::RENDEZVOUS;
    }
    cc.limits.max_blocks_per_fetch = max_blocks;
    let mut sc = ServerConfig::new("fuzz-client", SERVER_NONCE);
    sc.secret = (flags & 2 == 2).then(|| Secret::new(if flags & 4 == 4 { OTHER_SECRET } else { SECRET }));
    sc.credits = credits;
    sc.eager_threshold = eager_threshold;
    let secrets_agree = match (&cc.secret, &sc.secret) {
        (None, None) => true,
        (Some(_), Some(_)) => flags & 4 == 0,
        _ => false,
    };
    let rendezvous = cc.caps & sc.caps & caps::RENDEZVOUS != 0;
    // The threshold the server settles on: its own, capped by what the client said it takes.
    let eager_limit = eager_threshold.min(max_eager.min(cc.limits.max_eager)) as u64;

    let cw = ClientWatch::new(&cc);
    let mut sw = ServerWatch::new(&sc);
    sw.drains = false;
    let client = ClientSession::new(cc, start);
    let server = ServerSession::new(sc, start);
    let mut p = Pair { client, server, cw, sw, now: start, corrupt: None, disturbed: false };

    while !c.is_empty() {
        match c.u8() % pair_op::COUNT {
            pair_op::FETCH => {
                let n = c.u8() % 10;
                let spans = (0..n)
                    .map(|_| BlockSpan { group: c.u8() as u32, object: c.u32() as u64, start: c.u8() as u32, end: c.u8() as u32 })
                    .collect();
                p.cw.fetch(&mut p.client, spans, p.now);
                p.client_events();
            }
            pair_op::STEP => {
                let n = (c.u8() % 16) as usize + 1;
                p.step(n);
            }
            pair_op::SETTLE => p.settle(),
            pair_op::CORRUPT => {
                let dir = c.u8() & 1 == 1;
                let pos = c.u16() as usize;
                let mask = c.u8() | 1;
                p.corrupt = Some((dir, pos, mask));
                p.disturbed = true;
            }
            pair_op::LOST => {
                p.disturbed = true;
                p.client.handle_connection_lost("fuzz: reset");
                p.client_events();
                p.server.handle_connection_lost("fuzz: reset");
                p.sw.check_state(&p.server, false);
                // The transport is gone: whatever was still queued either way is dropped,
                // including announcements of regions released early.
                while p.client.poll_transmit().is_some() {}
                while p.server.poll_output().is_some() {}
                p.sw.released_early.clear();
            }
            _ => {
                p.now += Duration::from_secs(c.u16() as u64);
                let before = (p.client.is_closed(), p.server.is_closed());
                p.client.handle_timeout(p.now);
                p.client_events();
                if p.server.handle_timeout(p.now).is_err() {
                    assert!(p.server.is_closed());
                }
                if (p.client.is_closed(), p.server.is_closed()) != before {
                    p.disturbed = true;
                }
            }
        }
    }
    p.settle();
    assert!(
        p.sw.released_early.is_empty(),
        "the server accepted releases of regions it never announced: {:?}",
        p.sw.released_early
    );

    let mut stats = Stats {
        mode: Some(Mode::Pair),
        server_served: p.sw.served,
        client_connected: p.cw.connected.is_some(),
        client_blocks_ended: p.cw.ended,
        pair_blocks_checked: 0,
    };
    if p.disturbed {
        return stats;
    }
    let requests = std::mem::take(&mut p.cw.requests);
    for (req, r) in &requests {
        assert!(r.done, "request {req} never finished: {r:?}");
    }
    if secrets_agree {
        assert!(p.client.is_ready() && p.server.is_ready(), "handshake with agreeing secrets did not complete");
        for (req, r) in &requests {
            for (i, (span, outcome)) in r.spans.iter().zip(&r.outcome).enumerate() {
                let expected = match pair_resolver(span) {
                    _ if span.start >= span.end => Outcome::Failed(FailureCode::BadRange),
                    Err(f) => Outcome::Failed(f.code),
                    Ok(res) if res.len <= eager_limit => Outcome::Eager(res.len as u32),
                    Ok(res) if rendezvous => Outcome::Pulled(res.len),
                    Ok(_) => Outcome::Failed(FailureCode::Other),
                };
                assert_eq!(outcome.as_ref(), Some(&expected), "block {i} of request {req} ({span})");
                stats.pair_blocks_checked += 1;
            }
        }
        assert_eq!(p.server.outstanding(), 0, "server still counts blocks in flight");
        assert_eq!(p.server.open_regions(), 0, "regions never released");
        assert_eq!(p.client.credits(), p.sw.credits.max(1), "credits did not all come back");
    } else {
        assert!(p.client.is_closed() && p.server.counters() == Default::default(), "mismatched secrets, yet the server served");
        for (req, r) in &requests {
            let code = if r.fetched_closed { FailureCode::PeerGone } else { FailureCode::AuthRefused };
            for o in &r.outcome {
                assert_eq!(o.as_ref(), Some(&Outcome::Failed(code)), "request {req} with mismatched secrets");
                stats.pair_blocks_checked += 1;
            }
        }
    }
    stats
}
