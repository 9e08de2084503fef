//! [`Mode::Pair`]: a client and a server connected in memory, their outcomes compared with the expected ones.

use super::client::{ClientWatch, Outcome};
use super::server::ServerWatch;
use super::*;

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
                ClientEvent::Rendezvous { token, desc, .. } if desc.len == 0 => {
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

pub(super) fn run_pair(c: &mut Cursor<'_>) -> Stats {
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
