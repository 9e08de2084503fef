//! [`Mode::Client`]: a client session facing a scripted server, watched for the client invariants.

use super::*;

/// How one block ended, as the client reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    Eager(u32),
    Pulled(u64),
    Failed(FailureCode),
}

#[derive(Debug)]
pub(super) struct RequestWatch {
    pub(super) spans: Vec<BlockSpan>,
    pub(super) outcome: Vec<Option<Outcome>>,
    pub(super) requested: Vec<bool>,
    pub(super) done: bool,
    /// Whether the session was already closed when `fetch` was called.
    pub(super) fetched_closed: bool,
}

/// Watches one client session and checks everything it says.
pub(super) struct ClientWatch {
    pub(super) secret: Option<Secret>,
    pub(super) max_eager: u32,
    pub(super) transmitted: usize,
    /// The session's `Hello`.
    pub(super) hello: Option<Frame>,
    /// The first `Challenge` handed over.
    pub(super) challenge: Option<Frame>,
    /// Whether a `Ready` with the correct server proof was handed over.
    pub(super) valid_ready: bool,
    /// Credits and eager threshold from `Connected`.
    pub(super) connected: Option<(u32, u32)>,
    pub(super) requests: BTreeMap<u64, RequestWatch>,
    /// Blocks sent in `Fetch` frames, in order.
    pub(super) requested: Vec<Token>,
    /// Blocks announced by `Rendezvous` events: descriptor, bytes received so far, and
    /// whether the driver started the pull.
    pub(super) rendezvous: BTreeMap<Token, (Descriptor, u64, bool)>,
    pub(super) closed_event: bool,
    /// Blocks that ended.
    pub(super) ended: u64,
}

impl ClientWatch {
    pub(super) fn new(config: &ClientConfig) -> Self {
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

    pub(super) fn transcript(&self) -> Option<Transcript> {
        Some(Transcript::new(self.hello.as_ref()?, self.challenge.as_ref()?))
    }

    /// The proof a server that knows the secret would send with a grant of `credits`.
    pub(super) fn correct_server_proof(&self, credits: u32) -> Option<[u8; PROOF_LEN]> {
        let t = self.transcript().unwrap_or(Transcript::new(&Frame::Credit { n: 0 }, &Frame::Credit { n: 0 }));
        self.secret.as_ref().map(|s| s.server_proof(&t, credits))
    }

    /// The credit limit the `Challenge` announced.
    pub(super) fn max_credits(&self) -> u32 {
        match &self.challenge {
            Some(Frame::Challenge { credits, .. }) => *credits,
            _ => 0,
        }
    }

    pub(super) fn fetch(&mut self, c: &mut ClientSession, spans: Vec<BlockSpan>, now: Instant) {
        let fetched_closed = c.is_closed();
        let n = spans.len();
        let req = c.fetch(spans.clone(), now);
        let prev = self
            .requests
            .insert(req, RequestWatch { spans, outcome: vec![None; n], requested: vec![false; n], done: false, fetched_closed });
        assert!(prev.is_none(), "request id {req} reused");
    }

    pub(super) fn feed(&mut self, c: &mut ClientSession, frame: Frame, now: Instant) {
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

    pub(super) fn finish(&mut self, t: Token, outcome: Outcome) {
        let r = self.requests.get_mut(&t.req).unwrap_or_else(|| panic!("{t:?} of an unknown request ended"));
        assert!(!r.done, "{t:?} ended after its RequestDone");
        let slot = r.outcome.get_mut(t.index as usize).unwrap_or_else(|| panic!("{t:?} is out of range"));
        assert!(slot.is_none(), "{t:?} ended twice: {slot:?} then {outcome:?}");
        *slot = Some(outcome);
        self.ended += 1;
        self.rendezvous.remove(&t);
    }

    pub(super) fn live(&self, t: Token) -> bool {
        self.requests.get(&t.req).is_some_and(|r| !r.done && r.outcome.get(t.index as usize).is_some_and(|o| o.is_none()))
    }

    /// The driver finished a pull; checks the session's answer.
    pub(super) fn pull_complete(&mut self, c: &mut ClientSession, t: Token, ok: bool, now: Instant) {
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
    pub(super) fn drain(&mut self, c: &mut ClientSession) {
        while let Some(e) = c.poll_event() {
            self.check_event(e, c);
        }
        while let Some(f) = c.poll_transmit() {
            self.check_transmit(&f, c);
        }
        self.check_state(c);
    }

    pub(super) fn check_transmit(&mut self, f: &Frame, c: &ClientSession) {
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

    pub(super) fn check_event(&mut self, e: ClientEvent, c: &ClientSession) {
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
            ClientEvent::Rendezvous { token, desc, .. } => {
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

    pub(super) fn check_state(&self, c: &ClientSession) {
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

pub(super) fn client_config(flags: u8, max_eager: u32) -> ClientConfig {
    let mut config = ClientConfig::new("fuzz-server", CLIENT_NONCE);
    config.secret = (flags & 1 == 1).then(|| Secret::new(SECRET));
    if flags & 2 == 2 {
        config.limits = TIGHT;
    }
    config.caps = ((flags >> 2) & 7) as u64;
    config.max_eager = max_eager;
    config
}

pub(super) fn run_client(c: &mut Cursor<'_>) -> Stats {
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
                    version: wire::PROTOCOL_VERSION,
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
                watch.feed(&mut s, Frame::Rendezvous { req: token.req, index: token.index, desc, block_len: desc.len }, now);
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
pub(super) fn pick_token(c: &mut Cursor<'_>, requested: &[Token]) -> Token {
    let i = c.u8() as usize;
    if requested.is_empty() || i == 255 {
        Token { req: c.u8() as u64, index: c.u8() as u32 }
    } else {
        requested[i % requested.len()]
    }
}
