//! [`Mode::Server`]: a server session fed hostile frames, watched for the server invariants.

use super::*;

/// Blocks of `object % 2^32` bytes, served from source `object`; groups `3 mod 4` fail with
/// the code numbered by the span's start.
pub(super) fn server_mode_resolver(span: &BlockSpan) -> Result<Resolved<u64>, BlockFailure> {
    if span.group % 4 == 3 {
        return Err(BlockFailure::new(FailureCode::from_u16(span.start as u16), "fuzz: failing block"));
    }
    Ok(Resolved { source: span.object, offset: span.start as u64, len: span.object % (1 << 32) })
}

/// Watches one server session and checks everything it says.
pub(super) struct ServerWatch {
    pub(super) secret: Option<Secret>,
    pub(super) credits: u32,
    pub(super) eager_threshold: u32,
    /// The first `Hello` handed to the session.
    pub(super) hello: Option<Frame>,
    /// The `Challenge` the session answered it with.
    pub(super) challenge: Option<Frame>,
    /// Whether an `Auth` with the correct proof was handed to the session.
    pub(super) valid_auth: bool,
    /// Regions announced and not released: id → length.
    pub(super) regions: HashMap<u64, u64>,
    /// Every region ever announced. Outputs queued before a failure are still flushed after
    /// it, so pull data is checked against these, not against the live table.
    pub(super) announced: HashMap<u64, u64>,
    /// Regions whose `Release` the session accepted before the watch saw the `Rendezvous`
    /// announcing them. Only possible in pair mode, where outputs wait in the session's
    /// queue until the pump moves them: a corrupted `Release` can name a region the server
    /// has queued but the client has not heard of. The queued `Rendezvous` must follow.
    pub(super) released_early: HashSet<u64>,
    /// Whether the watch takes and discards the outputs after each input (server mode), or
    /// leaves them for the pump to carry to a client (pair mode), which checks them then.
    pub(super) drains: bool,
    /// Eager, rendezvous and pull-data outputs seen.
    pub(super) served: u64,
    /// `(req, index)` → length of every range a `FetchRange` handed to the session asked
    /// for. A range is offered by rendezvous whatever its length (wire v3), so an `Expose`
    /// under the eager threshold is correct for exactly these.
    pub(super) ranges: HashMap<(u64, u32), HashSet<u64>>,
}

impl ServerWatch {
    pub(super) fn new(config: &ServerConfig) -> Self {
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
            ranges: HashMap::new(),
        }
    }

    pub(super) fn may_serve(&self) -> bool {
        self.secret.is_none() || self.valid_auth
    }

    pub(super) fn transcript(&self) -> Option<Transcript> {
        Some(Transcript::new(self.hello.as_ref()?, self.challenge.as_ref()?))
    }

    /// The proof a client that knows the secret would send (garbage before a `Challenge`).
    pub(super) fn correct_client_proof(&self) -> [u8; PROOF_LEN] {
        match self.transcript() {
            Some(t) => self.secret.clone().unwrap_or_else(|| Secret::new(SECRET)).client_proof(&t),
            None => [0; PROOF_LEN],
        }
    }

    pub(super) fn hello_max_eager(&self) -> u32 {
        match &self.hello {
            Some(Frame::Hello { max_eager, .. }) => *max_eager,
            _ => 0,
        }
    }

    /// Hands `frame` to `s`, with every check before and after.
    pub(super) fn feed<F>(&mut self, s: &mut ServerSession<u64>, frame: Frame, resolver: F)
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
            Frame::FetchRange { req, first_index, ranges } => {
                for (i, r) in ranges.iter().enumerate() {
                    let index = first_index.wrapping_add(i as u32);
                    self.ranges.entry((*req, index)).or_default().insert(r.len);
                }
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

    pub(super) fn decode_error(&mut self, s: &mut ServerSession<u64>, e: FrameError) {
        let was_closed = s.is_closed();
        let err = s.handle_decode_error(e.clone());
        assert_eq!(err.error, ProtocolError::Frame(e));
        assert!(s.is_closed());
        self.after_input(s, was_closed);
    }

    pub(super) fn after_input(&mut self, s: &mut ServerSession<u64>, was_closed: bool) {
        if self.drains {
            self.drain(s, was_closed);
        } else {
            self.check_state(s, false);
        }
    }

    /// Takes every queued output and checks it.
    pub(super) fn drain(&mut self, s: &mut ServerSession<u64>, was_closed: bool) {
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
    pub(super) fn check_state(&mut self, s: &ServerSession<u64>, all_seen: bool) {
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

    pub(super) fn check_output(&mut self, o: &ServerOutput<u64>) {
        let serving = self.may_serve();
        if matches!(
            o,
            ServerOutput::Eager { .. }
                | ServerOutput::PullData { .. }
                | ServerOutput::Expose { .. }
                | ServerOutput::Frame(Frame::Rendezvous { .. })
        ) {
            self.served += 1;
        }
        let eager_limit = self.eager_threshold.min(self.hello_max_eager());
        match o {
            ServerOutput::Expose { req, index, region, len, .. } => {
                assert!(serving, "region exposed before a valid Auth: {o:?}");
                let asked_as_range = self.ranges.get(&(*req, *index)).is_some_and(|lens| lens.contains(len));
                assert!(
                    *len > eager_limit as u64 || asked_as_range,
                    "{len} bytes offered by rendezvous under the eager threshold {eager_limit}, and no range asked for them"
                );
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
                // The answer to an empty range (a stream's length probe): a region of 0 bytes
                // with nothing exposed, which the client releases like any other.
                Frame::Rendezvous { desc, .. } if desc.len == 0 => {
                    assert!(serving, "empty range answered before a valid Auth: {f:?}");
                    assert!(self.announced.insert(desc.region, 0).is_none(), "region id {} reused", desc.region);
                    if !self.released_early.remove(&desc.region) {
                        self.regions.insert(desc.region, 0);
                    }
                }
                other => panic!("the server sent a client frame: {other:?}"),
            },
        }
    }
}

pub(super) fn run_server(c: &mut Cursor<'_>) -> Stats {
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
pub(super) fn pick_region(c: &mut Cursor<'_>, regions: &HashMap<u64, u64>) -> (u64, u64) {
    let i = c.u8() as usize;
    let mut ids: Vec<(u64, u64)> = regions.iter().map(|(k, v)| (*k, *v)).collect();
    ids.sort_unstable();
    if ids.is_empty() || i == 255 {
        (c.u64(), 0)
    } else {
        ids[i % ids.len()]
    }
}
