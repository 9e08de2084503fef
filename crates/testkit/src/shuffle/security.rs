//! Security over every provider: the handshake's scope (application id, secret, the whole
//! transcript), and one-sided reads that need authentication, die with `Release`, and never
//! reach another peer's region — whatever address and key a peer tries.

use super::*;
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::{BlockSpan, Descriptor};

/// Whether rendezvous regions of this provider are read one-sidedly (else pulled).
pub fn one_sided(p: &Arc<dyn Provider>) -> bool {
    p.capabilities().one_sided
}

fn secret_cfg(addr: SocketAddr, secret: &str, app: &str) -> ClientConfig {
    let mut c = ClientConfig::new(addr.to_string(), rand::random());
    c.secret = Some(Secret::new(secret));
    c.app_id = app.into();
    c
}

/// Asks for one block over a raw, authenticated channel; answers its descriptor.
fn rendezvous(link: &Channel, s: &mut ClientSession, span: BlockSpan) -> Descriptor {
    s.fetch(vec![span], Instant::now());
    while let Some(fr) = s.poll_transmit() {
        link.send(&fr, &[]).unwrap();
    }
    loop {
        let r = link.recv(T).unwrap();
        match r.frame {
            Frame::Rendezvous { desc, .. } => return desc,
            Frame::Error { message, .. } => panic!("server error: {message}"),
            _ => {}
        }
    }
}

/// Reads `desc` through `link`: one-sided where the provider has it, else by a `Pull`.
fn read_via(p: &Arc<dyn Provider>, link: &Channel, desc: &Descriptor) -> Result<Vec<u8>, String> {
    if one_sided(p) {
        let pool = pool_for(p, PoolConfig { cap_bytes: 16 << 20, ..PoolConfig::default() });
        let lease = pool.acquire(desc.len as usize, None).unwrap();
        return link.read(desc, lease, T).map(|l| l.to_vec()).map_err(|e| match e {
            FabricError::RemoteAccess { .. } => format!("REMOTE ACCESS: {e}"),
            e => e.to_string(),
        });
    }
    link.send(&Frame::Pull { region: desc.region, offset: 0, len: desc.len }, &[]).map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    loop {
        match link.recv(T) {
            Ok(r) => match r.frame {
                Frame::PullData { len, .. } => {
                    got.extend_from_slice(&r.payload);
                    if got.len() as u64 >= desc.len || len == 0 {
                        return Ok(got);
                    }
                }
                Frame::Error { message, .. } => return Err(format!("REFUSED: {message}")),
                _ => {}
            },
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The read was refused by the peer's protection: a remote access error (one-sided), or the
/// server refusing the pull of a region this connection does not hold (stream).
fn assert_refused(what: &str, r: Result<Vec<u8>, String>, expect_stream: &str) {
    match r {
        Ok(b) => panic!("{what}: read {} bytes it must not", b.len()),
        Err(e) => assert!(e.contains("REMOTE ACCESS") || (e.contains("REFUSED") && e.contains(expect_stream)), "{what}: {e}"),
    }
}

fn registered(fx: &Fixture) -> u64 {
    fx.server.driver().stats().registered_bytes.load(Ordering::Relaxed)
}

pub fn reads_need_authentication_die_with_release_and_stay_with_their_peer(f: Factory) {
    let fx = server_with(f, server_cfg(Some("k")), 1);
    let addr = fx.server.local_addr();
    let o = &fx.outputs[0];
    let p = fx.provider.clone();
    let span = ShuffleBlockSpan::of(3, o.map_id, 8);
    let want = o.range_bytes(8, 9);
    let baseline = registered(&fx);

    // X: authenticated, holds a region; its own read works.
    let (x, mut xs) = raw_client_with(f, addr, secret_cfg(addr, "k", ""));
    let desc = rendezvous(&x, &mut xs, span);
    assert!(desc.len as usize == want.len() && desc.len > EAGER as u64);
    if one_sided(&p) {
        assert!(registered(&fx) > baseline, "the exposed region is counted as registered");
    }
    assert_eq!(read_via(&p, &x, &desc).unwrap(), want, "the peer that holds the region reads it");

    // Y: another authenticated peer. X's descriptor, and variations of it, are refused.
    let attempts = [
        ("X's descriptor", desc),
        ("X's key, next address", Descriptor { addr: desc.addr + 4096, len: 4096, ..desc }),
        ("X's address, other keys", Descriptor { rkey: desc.rkey.wrapping_add(1), ..desc }),
        ("a random key and address", Descriptor { rkey: rand::random(), addr: rand::random(), ..desc }),
    ];
    for (what, d) in attempts {
        // A fresh connection each time: on verbs an error completion ends the queue pair.
        let (y, _ys) = raw_client_with(f, addr, secret_cfg(addr, "k", ""));
        assert_refused(&format!("another peer reading {what}"), read_via(&p, &y, &d), "unknown region");
    }

    // Z: connected, never authenticated. No read works, whatever it names.
    let z = channel(f, addr);
    z.send(
        &Frame::Hello { min_version: 3, max_version: 3, caps: 7, nonce: [9; 16], max_eager: 1 << 20, app_id: String::new() },
        &[],
    )
    .unwrap();
    assert!(matches!(z.recv(T).unwrap().frame, Frame::Challenge { .. }));
    if p.name() == "verbs" {
        // Nothing exists to read through: the server creates no queue pair before the proof.
        let qps = |d: &Driver| d.provider_counters().into_iter().find(|(k, _)| *k == "qps_created").map(|(_, v)| v);
        let before = qps(fx.server.driver());
        assert!(z.attach(T).is_err(), "attach before authentication must be refused");
        assert_eq!(qps(fx.server.driver()), before, "no queue pair for an unauthenticated peer");
    } else {
        assert_refused("an unauthenticated peer", read_via(&p, &z, &desc), "no block is served before");
    }

    // X releases: once the server handled it, X's own descriptor is dead too.
    x.send(&Frame::Release { region: desc.region }, &[]).unwrap();
    wait_for(|| registered(&fx) == baseline, "the server revoked the released region");
    assert_refused("the holder after its Release", read_via(&p, &x, &desc), "unknown region");
    assert_eq!(fx.server.driver().stats().preauth_registered_bytes.load(Ordering::Relaxed), 0);
}

pub fn another_application_or_secret_is_refused_and_nothing_is_served(f: Factory) {
    let cfg = ServerEndpointConfig { app_id: "app-1".into(), ..server_cfg(Some("k")) };
    let fx = server_with(f, cfg, 1);
    let o = &fx.outputs[0];
    for (app, secret) in [("app-2", "k"), ("app-1", "other"), ("", "k")] {
        let c = client_with(
            f,
            16 << 20,
            ClientEndpointConfig { app_id: app.into(), secret: Some(Secret::new(secret)), ..client_cfg(None) },
        );
        let got =
            fetch_all(&c, fx.server.local_addr(), &[ShuffleBlock::single(3, o.map_id, 2), ShuffleBlock::single(3, o.map_id, 8)]);
        for i in 0..2 {
            let e = got[&i].as_ref().unwrap_err();
            assert_eq!(e.code, FailureCode::AuthRefused, "app {app:?} secret {secret}: {e}");
            if app != "app-1" {
                assert!(e.message.contains("app-1") && e.message.contains("application"), "names the applications: {e}");
            }
        }
    }
    wait_for(|| fx.server.stats().auth_failures.load(Ordering::Relaxed) >= 3, "the server counts every refusal");
    let s = fx.server.stats();
    assert_eq!((s.blocks_served(), s.bytes_served()), (0, 0), "nothing served to another application");
    // The same application with the same secret is served.
    let c = client_with(f, 16 << 20, ClientEndpointConfig { app_id: "app-1".into(), ..client_cfg(Some("k")) });
    let got = fetch_all(&c, fx.server.local_addr(), &[ShuffleBlock::single(3, o.map_id, 2)]);
    assert_eq!(got[&0].as_ref().unwrap(), &o.range_bytes(2, 3));
}

pub fn a_tampered_handshake_field_fails_authentication(f: Factory) {
    let fx = server_with(f, server_cfg(Some("k")), 1);
    let addr = fx.server.local_addr();
    let link = channel(f, addr);
    let mut s = ClientSession::new(secret_cfg(addr, "k", ""), Instant::now());
    let hello = s.poll_transmit().unwrap();
    link.send(&hello, &[]).unwrap();
    // A man in the middle lowers the eager threshold the client sees (the proof it computes
    // then covers a transcript the server never sent).
    let challenge = match link.recv(T).unwrap().frame {
        Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold, app_id } => {
            Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold: eager_threshold / 2, app_id }
        }
        other => panic!("expected a Challenge, got {other:?}"),
    };
    s.handle_frame(challenge, Instant::now()).unwrap();
    let auth = s.poll_transmit().unwrap();
    link.send(&auth, &[]).unwrap();
    let msg = expect_error_frame(&link);
    assert!(msg.contains("proof") && msg.contains("wrong"), "{msg}");
    wait_for(|| fx.server.stats().auth_failures.load(Ordering::Relaxed) >= 1, "the server counts the refusal");
    assert_eq!(fx.server.stats().blocks_served(), 0);
}
