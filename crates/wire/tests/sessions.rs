//! The two session state machines driven against each other in memory, frames passing
//! through the real codec, with no transport at all.

use rdma_shuffle_wire::frame::HEADER_LEN;
use rdma_shuffle_wire::*;
use std::time::{Duration, Instant};

type Src = &'static str;

/// A server whose blocks are `len` bytes each, named by `object`; group 9 is unknown.
fn resolver(span: &BlockSpan) -> Result<Resolved<Src>, BlockFailure> {
    if span.group == 9 {
        return Err(BlockFailure::new(FailureCode::UnknownGroup, "shuffle 9 is not registered"));
    }
    let len = span.object * (span.end - span.start) as u64;
    Ok(Resolved { source: "file", offset: 1000, len })
}

/// Carries every pending frame between the two sessions, re-encoding each one, until quiet.
/// Pulls are answered like a tcp driver would. Returns the client events seen.
fn pump(c: &mut ClientSession, s: &mut ServerSession<Src>, now: Instant) -> Vec<ClientEvent> {
    let mut events = Vec::new();
    loop {
        let mut moved = false;
        while let Some(f) = c.poll_transmit() {
            moved = true;
            let bytes = f.to_vec();
            let (g, _) = Frame::decode_message(&bytes, &s.limits()).expect("client frame decodes");
            let _ = s.handle_frame(g, &mut resolver);
        }
        while let Some(o) = s.poll_output() {
            moved = true;
            let (f, payload) = match o {
                ServerOutput::Frame(f) => (f, 0),
                ServerOutput::Eager { frame, len, .. } | ServerOutput::PullData { frame, len, .. } => (frame, len),
                // As a one-sided provider would: the keys of the exposure go in the descriptor.
                ServerOutput::Expose { req, index, region, offset, len, block_len, .. } => {
                    (Frame::Rendezvous { req, index, desc: Descriptor { region, addr: offset, len, rkey: 7 }, block_len }, 0)
                }
                ServerOutput::Revoke { .. } => continue,
            };
            let mut bytes = f.to_vec();
            bytes.resize(bytes.len() + payload as usize, 0xee);
            let (g, off) = Frame::decode_message(&bytes, &c.limits()).expect("server frame decodes");
            assert_eq!(bytes.len() - off, payload as usize);
            let _ = c.handle_frame(g, now);
        }
        while let Some(e) = c.poll_event() {
            moved = true;
            match &e {
                ClientEvent::Rendezvous { token, .. } => c.send_pull(*token, now).unwrap(),
                ClientEvent::PullData { token, last: true, .. } => c.pull_complete(*token, Ok(()), now).unwrap(),
                _ => {}
            }
            events.push(e);
        }
        if !moved {
            return events;
        }
    }
}

fn pair(client_secret: Option<&str>, server_secret: Option<&str>, credits: u32) -> (ClientSession, ServerSession<Src>, Instant) {
    let now = Instant::now();
    let mut cc = ClientConfig::new("server-1", [1; 16]);
    cc.secret = client_secret.map(Secret::new);
    cc.max_eager = 4096;
    cc.app_id = "app-1".into();
    let mut sc = ServerConfig::new("client-1", [2; 16]);
    sc.secret = server_secret.map(Secret::new);
    sc.app_id = "app-1".into();
    sc.credits = credits;
    sc.eager_threshold = 1024;
    (ClientSession::new(cc, now), ServerSession::new(sc, now), now)
}

#[test]
fn handshake_eager_rendezvous_and_failures() {
    let (mut c, mut s, now) = pair(Some("k"), Some("k"), 8);
    let ev = pump(&mut c, &mut s, now);
    assert!(matches!(ev[0], ClientEvent::Connected { credits: 8, eager_threshold: 1024, .. }), "{ev:?}");
    let req = c.fetch(
        vec![
            BlockSpan::single(1, 100, 0),                           // 100 B: eager
            BlockSpan { group: 1, object: 5000, start: 0, end: 2 }, // 10 000 B: rendezvous
            BlockSpan::single(9, 1, 0),                             // unknown shuffle
            BlockSpan::single(1, 0, 3),                             // empty block: eager, 0 B
        ],
        now,
    );
    let ev = pump(&mut c, &mut s, now);
    assert!(ev.contains(&ClientEvent::Eager { token: Token { req, index: 0 }, len: 100 }));
    assert!(ev.contains(&ClientEvent::Eager { token: Token { req, index: 3 }, len: 0 }));
    assert!(ev.iter().any(
        |e| matches!(e, ClientEvent::Rendezvous { token, desc, .. } if token.index == 1 && desc.len == 10_000 && desc.rkey == 7)
    ));
    assert!(ev.iter().any(|e| matches!(e, ClientEvent::PullData { token, len: 10_000, last: true, .. } if token.index == 1)));
    assert!(ev.iter().any(|e| matches!(e, ClientEvent::Failed { token, failure } if token.index == 2 && failure.code == FailureCode::UnknownGroup && failure.message.contains("server-1"))));
    assert_eq!(ev.last(), Some(&ClientEvent::RequestDone { req }));
    assert_eq!(s.open_regions(), 0, "the region was released");
    assert_eq!(c.credits(), 8, "every credit came back");
}

#[test]
fn wrong_secret_is_refused_and_no_block_is_served() {
    let (mut c, mut s, now) = pair(Some("wrong"), Some("right"), 8);
    c.fetch(vec![BlockSpan::single(1, 10, 0)], now);
    let ev = pump(&mut c, &mut s, now);
    assert!(
        ev.iter().any(|e| matches!(e, ClientEvent::Failed { failure, .. } if failure.code == FailureCode::AuthRefused)),
        "{ev:?}"
    );
    assert!(matches!(ev.last(), Some(ClientEvent::Closed { .. })));
    assert!(s.is_closed());
    assert_eq!(s.counters().eager_blocks, 0);

    // A client without a secret against a server that requires one.
    let (mut c, mut s, now) = pair(None, Some("right"), 8);
    let ev = pump(&mut c, &mut s, now);
    assert!(matches!(ev.last(), Some(ClientEvent::Closed { error }) if matches!(error.error, ProtocolError::AuthRefused(_))));
    // A client with a secret refuses a server that does not authenticate.
    let (mut c, mut s, now) = pair(Some("k"), None, 8);
    let ev = pump(&mut c, &mut s, now);
    assert!(matches!(ev.last(), Some(ClientEvent::Closed { error }) if matches!(error.error, ProtocolError::AuthRefused(_))));
}

#[test]
fn credits_run_out_and_refill() {
    let (mut c, mut s, now) = pair(None, None, 2);
    pump(&mut c, &mut s, now);
    let req = c.fetch((0..7).map(|i| BlockSpan::single(1, 10, i)).collect(), now);
    // Only two blocks go out until credits return.
    let mut fetch_frames = Vec::new();
    while let Some(f) = c.poll_transmit() {
        fetch_frames.push(f);
    }
    assert_eq!(fetch_frames.len(), 1);
    assert!(matches!(&fetch_frames[0], Frame::Fetch { blocks, first_index: 0, .. } if blocks.len() == 2));
    assert_eq!(c.credits(), 0);
    for f in fetch_frames {
        s.handle_frame(f, &mut resolver).unwrap();
    }
    let ev = pump(&mut c, &mut s, now);
    let delivered = ev.iter().filter(|e| matches!(e, ClientEvent::Eager { .. })).count();
    assert_eq!(delivered, 7);
    assert_eq!(ev.last(), Some(&ClientEvent::RequestDone { req }));
}

#[test]
fn credit_violations_and_unknown_regions_are_fatal_for_that_connection() {
    let (mut c, mut s, now) = pair(None, None, 2);
    pump(&mut c, &mut s, now);
    let blocks = vec![BlockSpan::single(1, 10, 0); 3];
    let err = s.handle_frame(Frame::Fetch { req: 1, first_index: 0, blocks }, &mut resolver).unwrap_err();
    assert!(matches!(err.error, ProtocolError::CreditExceeded { requested: 3, granted: 2, .. }), "{err}");
    let _ = c;
    assert!(matches!(s.poll_output(), Some(ServerOutput::Frame(Frame::Error { .. }))));

    let (mut c, mut s, now) = pair(None, None, 2);
    pump(&mut c, &mut s, now);
    let err = s.handle_frame(Frame::Pull { region: 77, offset: 0, len: 1 }, &mut resolver).unwrap_err();
    assert_eq!(err.error, ProtocolError::UnknownRegion { region: 77 });
    assert!(err.to_string().contains("client-1"));

    // A pull past the end of a real region.
    let (mut c, mut s, now) = pair(None, None, 2);
    pump(&mut c, &mut s, now);
    c.fetch(vec![BlockSpan::single(1, 5000, 0)], now);
    let f = c.poll_transmit().unwrap();
    s.handle_frame(f, &mut resolver).unwrap();
    let Some(ServerOutput::Expose { region, .. }) = s.poll_output() else { panic!() };
    let err = s.handle_frame(Frame::Pull { region, offset: 4000, len: 1001 }, &mut resolver).unwrap_err();
    assert!(matches!(err.error, ProtocolError::PullOutOfBounds { .. }));
}

#[test]
fn server_lies_are_caught_by_the_client() {
    let (mut c, mut s, now) = pair(None, None, 4);
    pump(&mut c, &mut s, now);
    // An eager block for a request never made.
    let err = c.handle_frame(Frame::Eager { req: 99, index: 0, len: 1 }, now).unwrap_err();
    assert_eq!(err.error, ProtocolError::UnknownBlock { req: 99, index: 0 });
    assert!(c.is_closed());

    // An eager block bigger than negotiated, and credits never granted.
    let (mut c, mut s, now) = pair(None, None, 4);
    pump(&mut c, &mut s, now);
    let req = c.fetch(vec![BlockSpan::single(1, 1, 0)], now);
    c.poll_transmit();
    let err = c.handle_frame(Frame::Eager { req, index: 0, len: 5000 }, now).unwrap_err();
    assert!(matches!(err.error, ProtocolError::EagerTooLarge { len: 5000, .. }));
    let (mut c, mut s, now) = pair(None, None, 4);
    pump(&mut c, &mut s, now);
    let err = c.handle_frame(Frame::Credit { n: 1 }, now).unwrap_err();
    assert!(matches!(err.error, ProtocolError::CreditOverflow { .. }));
}

#[test]
fn peer_vanishing_mid_transfer_fails_every_outstanding_block() {
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    let req = c.fetch(vec![BlockSpan::single(1, 5000, 0), BlockSpan::single(1, 6000, 0)], now);
    let f = c.poll_transmit().unwrap();
    s.handle_frame(f, &mut resolver).unwrap();
    // Deliver the first rendezvous only, then the connection dies.
    let Some(ServerOutput::Expose { req: r, index, region, len, .. }) = s.poll_output() else { panic!() };
    assert_eq!(r, req);
    c.handle_frame(Frame::Rendezvous { req, index, desc: Descriptor { region, addr: 0, len, rkey: 1 }, block_len: len }, now)
        .unwrap();
    c.handle_connection_lost("reset by peer");
    let ev: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    let failed: Vec<_> = ev
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Failed { token, failure } => Some((token.index, failure.code)),
            _ => None,
        })
        .collect();
    assert_eq!(failed, vec![(0, FailureCode::PeerGone), (1, FailureCode::PeerGone)]);
    assert!(ev.contains(&ClientEvent::RequestDone { req }));
    // New requests on the dead session fail at once instead of hanging.
    let req2 = c.fetch(vec![BlockSpan::single(1, 1, 0)], now);
    let ev: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    assert!(ev.contains(&ClientEvent::RequestDone { req: req2 }));
}

#[test]
fn silence_past_the_fetch_timeout_fails_the_connection() {
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    assert_eq!(c.poll_timeout(), None, "idle sessions do not time out");
    c.fetch(vec![BlockSpan::single(1, 1, 0)], now);
    let deadline = c.poll_timeout().unwrap();
    c.handle_timeout(deadline - Duration::from_millis(1));
    assert!(!c.is_closed());
    c.handle_timeout(deadline);
    let ev: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    assert!(ev.iter().any(|e| matches!(e, ClientEvent::Failed { failure, .. } if failure.code == FailureCode::Timeout)));
    // A server whose client never says Hello.
    let (_, mut s2, now) = pair(None, None, 8);
    assert!(s2.handle_timeout(now + Duration::from_secs(31)).is_err());
    let _ = s;
}

#[test]
fn frames_before_the_handshake_are_refused() {
    let (_c, mut s, _) = pair(None, None, 8);
    let err = s
        .handle_frame(Frame::Fetch { req: 1, first_index: 0, blocks: vec![BlockSpan::single(1, 1, 0)] }, &mut resolver)
        .unwrap_err();
    assert!(matches!(err.error, ProtocolError::UnexpectedFrame { kind: FrameKind::Fetch, .. }));
    assert_eq!(HEADER_LEN, 12);
}

/// Like `pump`, but `tamper` may rewrite every frame in flight (a man in the middle).
fn pump_tampered(
    c: &mut ClientSession,
    s: &mut ServerSession<Src>,
    now: Instant,
    tamper: &mut dyn FnMut(Frame) -> Frame,
) -> Vec<ClientEvent> {
    let mut events = Vec::new();
    loop {
        let mut moved = false;
        while let Some(f) = c.poll_transmit() {
            moved = true;
            let _ = s.handle_frame(tamper(f), &mut resolver);
        }
        while let Some(o) = s.poll_output() {
            moved = true;
            if let ServerOutput::Frame(f) = o {
                let _ = c.handle_frame(tamper(f), now);
            }
        }
        while let Some(e) = c.poll_event() {
            moved = true;
            events.push(e);
        }
        if !moved {
            return events;
        }
    }
}

#[test]
fn another_application_is_refused_both_ways_and_nothing_is_served() {
    // The server refuses a client of another application at its Hello.
    let (_, mut s, now) = pair(Some("k"), Some("k"), 8);
    let mut cc = ClientConfig::new("server-1", [1; 16]);
    cc.secret = Some(Secret::new("k"));
    cc.app_id = "app-2".into();
    let mut c = ClientSession::new(cc, now);
    c.fetch(vec![BlockSpan::single(1, 10, 0)], now);
    let ev = pump(&mut c, &mut s, now);
    let failure = ev
        .iter()
        .find_map(|e| match e {
            ClientEvent::Failed { failure, .. } => Some(failure.clone()),
            _ => None,
        })
        .expect("the block fails");
    assert_eq!(failure.code, FailureCode::AuthRefused);
    assert!(failure.message.contains("app-2") && failure.message.contains("app-1"), "{failure}");
    assert!(s.is_closed());
    assert_eq!(s.counters(), Default::default(), "nothing served");

    // A client refuses a server of another application, even without secrets.
    let now = Instant::now();
    let mut cc = ClientConfig::new("server-1", [1; 16]);
    cc.app_id = "app-1".into();
    let mut c = ClientSession::new(cc, now);
    let mut sc = ServerConfig::new("client-1", [2; 16]);
    sc.app_id = "app-1".into();
    let mut s: ServerSession<Src> = ServerSession::new(sc, now);
    let ev = pump_tampered(&mut c, &mut s, now, &mut |f| match f {
        Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold, .. } => {
            Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold, app_id: "app-evil".into() }
        }
        f => f,
    });
    assert!(
        matches!(ev.last(), Some(ClientEvent::Closed { error }) if matches!(&error.error, ProtocolError::AppMismatch { theirs, .. } if theirs == "app-evil")),
        "{ev:?}"
    );
    assert_eq!(error_knob(&ev), Some(Knob::AppId));
}

fn error_knob(ev: &[ClientEvent]) -> Option<Knob> {
    ev.iter().find_map(|e| match e {
        ClientEvent::Closed { error } => error.error.knob(),
        _ => None,
    })
}

#[test]
fn a_tampered_handshake_field_fails_authentication() {
    // Each rewrite changes one negotiated field in flight; with a secret on both sides the
    // proofs, computed over the transcript each side saw, no longer match.
    type Rewrite = fn(Frame) -> Frame;
    let rewrites: [(&str, Rewrite); 5] = [
        ("Hello caps", |f| match f {
            Frame::Hello { min_version, max_version, nonce, max_eager, app_id, .. } => {
                Frame::Hello { min_version, max_version, caps: caps::RENDEZVOUS, nonce, max_eager, app_id }
            }
            f => f,
        }),
        ("Hello max_eager", |f| match f {
            Frame::Hello { min_version, max_version, caps, nonce, app_id, .. } => {
                Frame::Hello { min_version, max_version, caps, nonce, max_eager: 100, app_id }
            }
            f => f,
        }),
        ("Challenge credits", |f| match f {
            Frame::Challenge { version, caps, nonce, auth_required, eager_threshold, app_id, .. } => {
                Frame::Challenge { version, caps, nonce, auth_required, credits: 9999, eager_threshold, app_id }
            }
            f => f,
        }),
        ("Challenge eager threshold", |f| match f {
            Frame::Challenge { version, caps, nonce, auth_required, credits, app_id, .. } => {
                Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold: 1, app_id }
            }
            f => f,
        }),
        ("Ready credits", |f| match f {
            Frame::Ready { proof, .. } => Frame::Ready { proof, credits: 1 },
            f => f,
        }),
    ];
    for (what, rewrite) in rewrites {
        let (mut c, mut s, now) = pair(Some("k"), Some("k"), 8);
        c.fetch(vec![BlockSpan::single(1, 10, 0)], now);
        let ev = pump_tampered(&mut c, &mut s, now, &mut |f| rewrite(f));
        assert!(
            ev.iter().any(|e| matches!(e, ClientEvent::Failed { failure, .. } if failure.code == FailureCode::AuthRefused)),
            "{what}: {ev:?}"
        );
        assert!(!ev.iter().any(|e| matches!(e, ClientEvent::Connected { .. })), "{what}: connected anyway");
        assert_eq!(s.counters(), Default::default(), "{what}: nothing served");
    }
    // The same rewrites without authentication are not detectable, and are accepted: the
    // point of the test above is that the secret is what protects the transcript.
    let (mut c, mut s, now) = pair(None, None, 8);
    let ev = pump_tampered(&mut c, &mut s, now, &mut |f| f);
    assert!(matches!(ev[0], ClientEvent::Connected { .. }));
}

#[test]
fn credits_come_back_with_answers_and_releases_without_credit_frames() {
    let (mut c, mut s, now) = pair(None, None, 2);
    pump(&mut c, &mut s, now);
    // Two rendezvous blocks take both credits; the pulls release them one by one.
    let req = c.fetch(vec![BlockSpan::single(1, 5000, 0), BlockSpan::single(1, 6000, 0), BlockSpan::single(1, 7000, 0)], now);
    let ev = pump(&mut c, &mut s, now);
    let mut frames = Vec::new();
    assert_eq!(ev.last(), Some(&ClientEvent::RequestDone { req }));
    assert_eq!((c.credits(), s.outstanding()), (2, 0));
    while let Some(o) = s.poll_output() {
        frames.push(o);
    }
    assert!(frames.is_empty());
    // No Credit frame was ever needed; a raise is still possible up to the limit.
    assert_eq!(s.raise_credits(5), 0, "the live grant is already the limit");
}

#[test]
fn blocks_waiting_for_local_memory_do_not_run_the_silence_clock() {
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    c.fetch(vec![BlockSpan::single(1, 5000, 0)], now);
    let f = c.poll_transmit().unwrap();
    s.handle_frame(f, &mut resolver).unwrap();
    let Some(ServerOutput::Expose { req, index, region, len, .. }) = s.poll_output() else { panic!() };
    assert!(c.poll_timeout().is_some(), "a requested block waits for the peer");
    c.handle_frame(Frame::Rendezvous { req, index, desc: Descriptor { region, addr: 0, len, rkey: 1 }, block_len: len }, now)
        .unwrap();
    // The driver has no buffer yet: nothing waits for the peer, so no deadline at all.
    assert_eq!(c.poll_timeout(), None);
    let later = now + Duration::from_secs(3600);
    c.handle_timeout(later);
    assert!(!c.is_closed(), "an hour waiting for local memory is not peer silence");
    // The read is posted an hour later: the clock starts then, not at the Rendezvous.
    let token = Token { req, index };
    c.pull_started(token, later).unwrap();
    assert_eq!(c.poll_timeout(), Some(later + Duration::from_secs(120)));
    // A stalled reader (no memory for a payload) stops the clock; reading again restarts it.
    c.stall();
    assert_eq!(c.poll_timeout(), None);
    let much_later = later + Duration::from_secs(7200);
    c.handle_timeout(much_later);
    assert!(!c.is_closed());
    c.unstall(much_later);
    assert_eq!(c.poll_timeout(), Some(much_later + Duration::from_secs(120)));
    c.handle_timeout(much_later + Duration::from_secs(120));
    assert!(c.is_closed(), "real silence still times out");
    let ev: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    let failure = ev
        .iter()
        .find_map(|e| match e {
            ClientEvent::Failed { failure, .. } => Some(failure.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!((failure.code, failure.knob), (FailureCode::Timeout, Some(Knob::FetchTimeout)));
}

#[test]
fn a_block_the_server_holds_back_while_we_owe_it_a_pull_is_not_peer_silence() {
    // Issue 14 (slow consumer): block A's rendezvous waits for a local buffer, so we have not
    // pulled or released it; the server may hold B's answer back until we do (its exposure
    // budget is full of A). B's silence is then our own backpressure: no deadline runs.
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    c.fetch(vec![BlockSpan::single(1, 5000, 0), BlockSpan::single(1, 6000, 0)], now);
    let f = c.poll_transmit().unwrap();
    s.handle_frame(f, &mut resolver).unwrap();
    let Some(ServerOutput::Expose { req, index, region, len, .. }) = s.poll_output() else { panic!() };
    // The server answers A only; B stays requested.
    c.handle_frame(Frame::Rendezvous { req, index, desc: Descriptor { region, addr: 0, len, rkey: 1 }, block_len: len }, now)
        .unwrap();
    assert_eq!(c.poll_timeout(), None, "B's silence is not the peer's while A waits for our memory");
    let later = now + Duration::from_secs(3600);
    c.handle_timeout(later);
    assert!(!c.is_closed(), "an hour of local backpressure is not peer silence");
    // The buffer comes: the pull of A starts, and from then on both wait for the peer.
    c.pull_started(Token { req, index }, later).unwrap();
    assert_eq!(c.poll_timeout(), Some(later + Duration::from_secs(120)));
    c.handle_timeout(later + Duration::from_secs(120));
    assert!(c.is_closed(), "real silence still times out");
}

#[test]
fn a_driver_budget_bounds_the_blocks_sent() {
    let now = Instant::now();
    let mut cc = ClientConfig::new("server-1", [1; 16]);
    cc.auto_flush = false;
    cc.app_id = "app-1".into();
    let mut c = ClientSession::new(cc, now);
    let mut sc = ServerConfig::new("client-1", [2; 16]);
    sc.app_id = "app-1".into();
    sc.credits = 8;
    let mut s: ServerSession<Src> = ServerSession::new(sc, now);
    pump(&mut c, &mut s, now);
    c.fetch((0..5).map(|i| BlockSpan::single(1, 10, i)).collect(), now);
    assert!(c.poll_transmit().is_none(), "nothing goes out without the driver");
    assert_eq!(c.queued_blocks(), 5);
    assert_eq!(c.flush_requests(3, now), 3);
    assert_eq!(c.queued_blocks(), 2);
    assert!(matches!(c.poll_transmit(), Some(Frame::Fetch { blocks, .. }) if blocks.len() == 3));
}

#[test]
fn the_live_grant_comes_from_the_hooks_after_authentication() {
    struct Hooks(u32);
    impl ServerHooks<Src> for Hooks {
        fn resolve(&mut self, span: &BlockSpan) -> Result<Resolved<Src>, BlockFailure> {
            resolver(span)
        }
        fn grant(&mut self, max: u32) -> u32 {
            self.0 = max;
            3
        }
    }
    let (mut c, mut s, now) = pair(Some("k"), Some("k"), 8);
    let mut hooks = Hooks(0);
    let f = c.poll_transmit().unwrap();
    s.handle_frame(f, &mut hooks).unwrap();
    let Some(ServerOutput::Frame(ch)) = s.poll_output() else { panic!() };
    c.handle_frame(ch, now).unwrap();
    assert_eq!(hooks.0, 0, "no grant before the client authenticated");
    let auth = c.poll_transmit().unwrap();
    s.handle_frame(auth, &mut hooks).unwrap();
    assert_eq!((hooks.0, s.live_credits()), (8, 3));
    let Some(ServerOutput::Frame(ready)) = s.poll_output() else { panic!() };
    c.handle_frame(ready, now).unwrap();
    assert_eq!(c.credits(), 3);
}

/// Range fetches: an empty range tells the block's length, ranges are offered exactly (at
/// their offset in the source), the last one may be short, and a range past the end of the
/// block fails with `BadRange` naming the block and its length, without hurting the
/// connection.
#[test]
fn range_fetches_offer_exact_ranges_and_refuse_ranges_past_the_end() {
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    // Block 10_000 bytes long (object 10_000, one part).
    let span = BlockSpan::single(1, 10_000, 0);
    let probe = c.fetch_ranges(vec![BlockRange { span, offset: 0, len: 0 }], now);
    let ev = pump(&mut c, &mut s, now);
    assert!(
        ev.iter().any(
            |e| matches!(e, ClientEvent::Rendezvous { token, desc, block_len: 10_000 } if token.req == probe && desc.len == 0)
        ),
        "{ev:?}"
    );
    // The driver completes an empty region without pulling; its Release gives the credit back.
    let ranges: Vec<BlockRange> =
        (0..3).map(|i| BlockRange { span, offset: i * 4096, len: 4096.min(10_000 - i * 4096) }).collect();
    let req = c.fetch_ranges(ranges, now);
    let ev = pump(&mut c, &mut s, now);
    let offered: Vec<(u64, u64, u64)> = ev
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Rendezvous { token, desc, block_len } if token.req == req => Some((desc.addr, desc.len, *block_len)),
            _ => None,
        })
        .collect();
    // The source offset of the block is 1000 (see `resolver`).
    assert_eq!(offered, vec![(1000, 4096, 10_000), (5096, 4096, 10_000), (9192, 1808, 10_000)]);
    let pulled: u64 = ev
        .iter()
        .filter_map(|e| match e {
            ClientEvent::PullData { token, len, .. } if token.req == req => Some(*len),
            _ => None,
        })
        .sum();
    assert_eq!(pulled, 10_000);
    assert!(ev.contains(&ClientEvent::RequestDone { req }));
    // Past the end: offset beyond the block, and a length that runs over it.
    let bad = c.fetch_ranges(
        vec![
            BlockRange { span, offset: 10_001, len: 0 },
            BlockRange { span, offset: 9000, len: 1001 },
            BlockRange { span, offset: 9000, len: 1000 },
        ],
        now,
    );
    let ev = pump(&mut c, &mut s, now);
    let failures: Vec<&BlockFailure> = ev
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Failed { token, failure } if token.req == bad => Some(failure),
            _ => None,
        })
        .collect();
    assert_eq!(failures.len(), 2, "{ev:?}");
    for f in failures {
        assert_eq!(f.code, FailureCode::BadRange);
        assert!(f.message.contains("shuffle_1_10000_0") && f.message.contains("10000 bytes"), "{}", f.message);
    }
    assert!(ev.iter().any(|e| matches!(e, ClientEvent::PullData { token, len: 1000, last: true, .. } if token.req == bad)));
    assert!(c.is_ready() && s.is_ready());
    assert_eq!(s.outstanding(), 0);
    assert_eq!(c.credits(), 8);
}

/// A server that answers a range with a region of another length (or a block shorter than
/// the range) violates the protocol: the connection fails, the block with it.
#[test]
fn a_rendezvous_that_does_not_answer_the_range_is_a_protocol_error() {
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    let span = BlockSpan::single(1, 10_000, 0);
    let req = c.fetch_ranges(vec![BlockRange { span, offset: 4096, len: 4096 }], now);
    while c.poll_transmit().is_some() {}
    let desc = Descriptor { region: 1, addr: 0, len: 4096, rkey: 0 };
    // Block shorter than the range's end.
    let err = c.handle_frame(Frame::Rendezvous { req, index: 0, desc, block_len: 8000 }, now).unwrap_err();
    assert!(matches!(err.error, ProtocolError::InvalidRequest(ref m) if m.contains("bytes 4096..8192")), "{err}");
    let ev: Vec<ClientEvent> = std::iter::from_fn(|| c.poll_event()).collect();
    assert!(
        ev.iter().any(|e| matches!(e, ClientEvent::Failed { failure, .. } if failure.code == FailureCode::Protocol)),
        "{ev:?}"
    );
    // An eager answer to a range.
    let (mut c, mut s2, now) = pair(None, None, 8);
    pump(&mut c, &mut s2, now);
    let req = c.fetch_ranges(vec![BlockRange { span, offset: 0, len: 10 }], now);
    while c.poll_transmit().is_some() {}
    assert!(c.handle_frame(Frame::Eager { req, index: 0, len: 10 }, now).is_err());
    let _ = s;
}

/// Before range fetches, a block over 2 GiB had no way through: the client refuses a region
/// larger than a JVM buffer (the connection fails, with every block on it). It still does; a
/// block that large is fetched in ranges.
#[test]
fn a_region_over_2_gib_is_refused() {
    let (mut c, mut s, now) = pair(None, None, 8);
    pump(&mut c, &mut s, now);
    let req = c.fetch(vec![BlockSpan::single(1, 3 << 30, 0)], now);
    while c.poll_transmit().is_some() {}
    let desc = Descriptor { region: 1, addr: 0, len: 3 << 30, rkey: 0 };
    let err = c.handle_frame(Frame::Rendezvous { req, index: 0, desc, block_len: 3 << 30 }, now).unwrap_err();
    assert!(
        matches!(err.error, ProtocolError::InvalidRequest(ref m) if m.contains("exceeds 2 GiB") && m.contains("ranges")),
        "{err}"
    );
}
