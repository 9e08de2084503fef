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
    Ok(Resolved { source: "file", offset: 1000, len, addr: 1000, rkey: 7 })
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
                ClientEvent::Rendezvous { token, .. } => c.send_pull(*token).unwrap(),
                ClientEvent::PullData { token, last: true, .. } => c.pull_complete(*token, Ok(())).unwrap(),
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
    let mut sc = ServerConfig::new("client-1", [2; 16]);
    sc.secret = server_secret.map(Secret::new);
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
        |e| matches!(e, ClientEvent::Rendezvous { token, desc } if token.index == 1 && desc.len == 10_000 && desc.rkey == 7)
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
    let Some(ServerOutput::Frame(Frame::Rendezvous { desc, .. })) = s.poll_output() else { panic!() };
    let err = s.handle_frame(Frame::Pull { region: desc.region, offset: 4000, len: 1001 }, &mut resolver).unwrap_err();
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
    let Some(ServerOutput::Frame(f)) = s.poll_output() else { panic!() };
    c.handle_frame(f, now).unwrap();
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
