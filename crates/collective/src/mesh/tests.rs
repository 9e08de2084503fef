//! The mesh's own protocol, over tcp and sim (and shm for the loop test): limits,
//! connecting, authentication, refusals, abort, the registration cache, who drives the loop,
//! the split provider, a receive given up mid-placement. What every provider must do under
//! the mesh (ordering, posted and reducing receives, dead and departing peers) is the
//! conformance suite `rdma_shuffle_testkit::mesh`, which each provider's crate runs.

use super::shared::Posted;
use super::*;
use rdma_shuffle_providers::{sim::SimProvider, tcp::TcpProvider};
use rdma_shuffle_wire::Secret;
use std::net::{IpAddr, Ipv4Addr};

fn localhost() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)
}

/// Builds a mesh of `world` ranks in threads; `tweak` adjusts each rank's config.
fn build(provider: Arc<dyn Provider>, world: usize, tweak: impl Fn(&mut MeshConfig) + Sync) -> Vec<Result<Mesh, MeshError>> {
    let listeners: Vec<MeshListener> =
        (0..world).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
    connect_all(listeners, |c| {
        c.pool.cap_bytes = 64 << 20;
        c.max_message = 16 << 20;
        tweak(c);
    })
}

/// Connects bound listeners into a mesh, one rank per thread; `tweak` adjusts each config.
fn connect_all(listeners: Vec<MeshListener>, tweak: impl Fn(&mut MeshConfig) + Sync) -> Vec<Result<Mesh, MeshError>> {
    connect_in_threads(listeners, Duration::from_secs(20), tweak)
}

/// The providers the mesh's own loop test runs over (the per-provider conformance suite is
/// `rdma_shuffle_testkit::mesh`, run by each provider's crate).
fn providers() -> Vec<Arc<dyn Provider>> {
    vec![
        Arc::new(TcpProvider::new()),
        Arc::new(SimProvider::new(true)),
        Arc::new(SimProvider::new(false)),
        Arc::new(rdma_shuffle_providers::shm::ShmProvider::default()),
    ]
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

#[test]
fn eager_messages_above_the_limit_are_refused_with_the_setting() {
    let meshes: Vec<Mesh> =
        build(Arc::new(SimProvider::new(true)), 2, |c| c.eager_limit = 1024).into_iter().map(|m| m.unwrap()).collect();
    let e = meshes[0].send(1, 0, &[0u8; 1025], Proto::Eager, None).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("1025") && text.contains("MOBIUS_EAGER_LIMIT") && text.contains("rank 1"), "{text}");
    assert!(matches!(meshes[0].send(0, 0, &[1], Proto::Eager, None), Err(MeshError::BadPeer { .. })));
}

#[test]
fn a_connect_retried_until_the_timeout_is_reported_once_with_its_count() {
    // Rank 0's published address has no listener: rank 1 retries it every 50 ms, and the
    // error quotes the refusal once, with how often it happened, not once per try.
    let l1 = MeshListener::bind(Arc::new(TcpProvider::new()), localhost(), 1).unwrap();
    let addrs = vec!["127.0.0.1:9".parse().unwrap(), l1.local_addr()];
    let mut c = MeshConfig::new(1, 2);
    c.connect_timeout = Duration::from_millis(1000);
    let e = Mesh::connect(l1, &addrs, c).unwrap_err().to_string();
    assert_eq!(e.matches("connecting to rank 0 at 127.0.0.1:9").count(), 1, "{e}");
    let times: u32 = e.split("(×").nth(1).and_then(|t| t.split(')').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(times >= 2, "{e}");
}

#[test]
fn a_rank_that_never_joins_is_named_after_the_timeout() {
    let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
    let listeners: Vec<MeshListener> = (0..3).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    let mut it = listeners.into_iter();
    let (l0, l1, _l2_never_runs) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let a2 = addrs.clone();
    let t = std::thread::spawn(move || {
        let mut c = MeshConfig::new(1, 3);
        // Longer than rank 0's: rank 0 must reach its own deadline while rank 1 is still
        // connected to it, or it would rightly name rank 1 as gone too.
        c.connect_timeout = Duration::from_millis(4000);
        Mesh::connect(l1, &a2, c)
    });
    let mut c = MeshConfig::new(0, 3);
    c.connect_timeout = Duration::from_millis(1500);
    let started = Instant::now();
    let e = Mesh::connect(l0, &addrs, c).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    match &e {
        MeshError::ConnectTimeout { missing, .. } => assert_eq!(missing, &vec![2]),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("rank(s) [2]"), "{e}");
    assert!(matches!(t.join().unwrap(), Err(MeshError::ConnectTimeout { .. })));
}

#[test]
fn secrets_authenticate_every_link_and_a_wrong_secret_is_refused() {
    let ok = build(Arc::new(TcpProvider::new()), 3, |c| c.secret = Some(Secret::new("s3cret")));
    assert!(ok.iter().all(|m| m.is_ok()));
    drop(ok);
    let bad = build(Arc::new(TcpProvider::new()), 2, |c| {
        c.connect_timeout = Duration::from_secs(3);
        c.secret = Some(Secret::new(if c.rank == 1 { "wrong" } else { "s3cret" }));
    });
    let e1 = bad[1].as_ref().unwrap_err().to_string();
    assert!(e1.contains("rank 0") && e1.contains("MOBIUS_SECRET"), "{e1}");
    let e0 = bad[0].as_ref().unwrap_err().to_string();
    assert!(e0.contains("[1]") && e0.contains("MOBIUS_SECRET"), "{e0}");
    let half = build(Arc::new(TcpProvider::new()), 2, |c| {
        c.connect_timeout = Duration::from_secs(3);
        c.secret = (c.rank == 0).then(|| Secret::new("s3cret"));
    });
    assert!(half.iter().all(|m| m.as_ref().is_err_and(|e| e.to_string().contains("secret"))));
}

#[test]
fn a_stray_connection_sending_junk_does_not_stop_the_mesh() {
    use std::io::Write;
    let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
    let listeners: Vec<MeshListener> = (0..2).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    let mut stray = std::net::TcpStream::connect(addrs[0]).unwrap();
    stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let meshes: Vec<Mesh> = connect_all(listeners, |_| {}).into_iter().map(|m| m.unwrap()).collect();
    meshes[1].wait(meshes[1].send(0, 3, b"ok", Proto::Eager, None).unwrap(), soon()).unwrap();
    assert_eq!(&*meshes[0].recv(1, 3, soon()).unwrap(), b"ok");
}

/// A group of three with its secret and group-bound job; before ranks 1 and 2 start, rank 0's
/// port gets a silent stranger, a rank of the same group name with the wrong secret and a
/// rank of an earlier group (another id, the same secret). Each is refused or dropped, the
/// real group forms and moves data, and once it is complete nothing listens any more.
#[test]
fn strangers_wrong_secrets_and_old_groups_are_refused_while_the_group_forms() {
    use std::io::Read;
    let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
    let config = |r: usize, job: &str, secret: &str| {
        let mut c = MeshConfig::new(r, 3);
        c.connect_timeout = Duration::from_secs(20);
        c.handshake_timeout = Duration::from_millis(300);
        c.job = job.into();
        c.secret = Some(Secret::new(secret));
        c
    };
    let listeners: Vec<MeshListener> = (0..3).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    let mut listeners = listeners.into_iter();
    let l0 = listeners.next().unwrap();
    let a = addrs.clone();
    let rank0 = std::thread::spawn(move || Mesh::connect(l0, &a, config(0, "mobius/g1", "k1")));

    // A stranger that connects and says nothing is dropped after the handshake limit.
    let mut silent = std::net::TcpStream::connect(addrs[0]).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let n = silent.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the silent stranger got bytes");
    assert!(t.elapsed() < Duration::from_secs(10), "the silent stranger was kept {:?}", t.elapsed());

    // A rank with the group's name but the wrong secret, and a rank of an earlier group.
    for (job, secret, what) in [("mobius/g1", "wrong", "secret"), ("mobius/g0", "k1", "job")] {
        let l = MeshListener::bind(provider.clone(), localhost(), 2).unwrap();
        let mut a = addrs.clone();
        a[1] = "127.0.0.1:9".parse().unwrap(); // never reached: rank 0 refuses first
        let e = Mesh::connect(l, &a, config(2, job, secret)).unwrap_err().to_string();
        assert!(e.contains("rank 0") && e.contains(what), "{e}");
    }

    // The real ranks join; the group forms and data moves.
    let rest: Vec<_> = listeners
        .enumerate()
        .map(|(i, l)| {
            let a = addrs.clone();
            std::thread::spawn(move || Mesh::connect(l, &a, config(i + 1, "mobius/g1", "k1")))
        })
        .collect();
    let m0 = rank0.join().unwrap().unwrap();
    let others: Vec<Mesh> = rest.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    for m in &others {
        m.wait(m.send(0, 5, &[m.rank() as u8], Proto::Eager, None).unwrap(), soon()).unwrap();
    }
    assert_eq!(&*m0.recv(1, 5, soon()).unwrap(), &[1]);
    assert_eq!(&*m0.recv(2, 5, soon()).unwrap(), &[2]);
    // Complete: the listener is closed, a connection is refused by the kernel.
    let e = std::net::TcpStream::connect(addrs[0]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
}

/// A flood of silent connections while the group forms: at most `2·world + 16` of them are
/// kept (the oldest make room), and the group still forms.
#[test]
fn a_flood_of_strangers_is_capped_and_the_group_still_forms() {
    use std::io::Read;
    let provider: Arc<dyn Provider> = Arc::new(TcpProvider::new());
    let listeners: Vec<MeshListener> = (0..2).map(|r| MeshListener::bind(provider.clone(), localhost(), r).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    let mut listeners = listeners.into_iter();
    let config = |r: usize| {
        let mut c = MeshConfig::new(r, 2);
        c.connect_timeout = Duration::from_secs(30);
        c.secret = Some(Secret::new("k"));
        c
    };
    let (l0, a) = (listeners.next().unwrap(), addrs.clone());
    let rank0 = std::thread::spawn(move || Mesh::connect(l0, &a, config(0)));
    let strangers: Vec<std::net::TcpStream> = (0..60).map(|_| std::net::TcpStream::connect(addrs[0]).unwrap()).collect();
    let (l1, a) = (listeners.next().unwrap(), addrs.clone());
    let m1 = std::thread::spawn(move || Mesh::connect(l1, &a, config(1))).join().unwrap().unwrap();
    let m0 = rank0.join().unwrap().unwrap();
    m1.wait(m1.send(0, 1, b"hi", Proto::Eager, None).unwrap(), soon()).unwrap();
    assert_eq!(&*m0.recv(1, 1, soon()).unwrap(), b"hi");
    // Every stranger was closed: evicted while the group formed, or dropped once it was complete.
    for mut s in strangers {
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("a stranger was kept: {other:?}"),
        }
    }
}

#[test]
fn mismatched_world_or_job_is_refused_with_what_differs() {
    let res = build(Arc::new(TcpProvider::new()), 2, |c| {
        c.connect_timeout = Duration::from_secs(3);
        if c.rank == 1 {
            c.job = "other".into();
        }
    });
    let e1 = res[1].as_ref().unwrap_err().to_string();
    assert!(e1.contains("\"other\"") && e1.contains("\"mobius\""), "{e1}");
}

#[test]
fn abort_reaches_every_peer_with_the_reason() {
    let meshes: Vec<Mesh> = build(Arc::new(TcpProvider::new()), 3, |_| {}).into_iter().map(|m| m.unwrap()).collect();
    meshes[1].abort("count differs");
    for m in [&meshes[0], &meshes[2]] {
        let e = m.recv(if m.rank() == 0 { 2 } else { 0 }, 5, soon()).unwrap_err();
        assert!(matches!(&e, MeshError::Aborted { by: 1, reason, .. } if reason == "count differs"), "{e}");
    }
}

#[test]
fn registrations_are_cached_per_buffer_while_in_use() {
    let meshes: Vec<Mesh> =
        build(Arc::new(SimProvider::new(true)), 2, |c| c.cache_registrations = true).into_iter().map(|m| m.unwrap()).collect();
    let buf = vec![5u8; 1 << 20];
    for round in 0..3 {
        // SAFETY: `buf` outlives the registration and is invalidated before it is freed.
        let reg = unsafe { meshes[0].register(buf.as_ptr(), buf.len()) }.unwrap();
        for half in buf.chunks(buf.len() / 2) {
            meshes[0].wait(meshes[0].send(1, round, half, Proto::Rendezvous, Some(&reg)).unwrap(), soon()).unwrap();
            assert!(*meshes[1].recv(0, round, soon()).unwrap() == *half);
        }
    }
    let st = meshes[0].stats();
    assert_eq!((st.registrations, st.registration_hits), (1, 2));
    meshes[0].invalidate(buf.as_ptr(), 1);
    // SAFETY: as above.
    let _reg = unsafe { meshes[0].register(buf.as_ptr(), buf.len()) }.unwrap();
    assert_eq!(meshes[0].stats().registrations, 2, "an invalidated registration is not reused");
}

/// A blocking receive runs the loop on the caller's thread (no hand-off to the loop thread),
/// and once the callers are gone the loop thread goes back to sleeping: an idle mesh makes
/// no turns.
#[test]
fn callers_drive_the_loop_and_an_idle_mesh_sleeps() {
    for provider in providers() {
        let name = provider.name();
        let meshes: Vec<Mesh> = build(provider, 2, |_| {}).into_iter().map(|m| m.unwrap()).collect();
        let before: Vec<(u64, u64)> = meshes.iter().map(|m| m.loop_turns()).collect();
        const ROUNDS: u64 = 300;
        std::thread::scope(|sc| {
            for m in &meshes {
                sc.spawn(move || {
                    let peer = 1 - m.rank();
                    for i in 0..ROUNDS {
                        let word = i.to_le_bytes();
                        if m.rank() == 0 {
                            m.wait(m.send(peer, 7, &word, Proto::Eager, None).unwrap(), soon()).unwrap();
                            assert_eq!(&*m.recv(peer, 8, soon()).unwrap(), &word);
                        } else {
                            assert_eq!(&*m.recv(peer, 7, soon()).unwrap(), &word);
                            m.wait(m.send(peer, 8, &word, Proto::Eager, None).unwrap(), soon()).unwrap();
                        }
                    }
                });
            }
        });
        for (m, b) in meshes.iter().zip(&before) {
            let (lt, ct) = m.loop_turns();
            // Every receive that did not find its message waiting ran turns itself; a
            // hand-off design makes none.
            assert!(
                ct - b.1 >= ROUNDS / 2,
                "{name} rank {}: {} caller turns for {ROUNDS} round trips ({} by the loop thread)",
                m.rank(),
                ct - b.1,
                lt - b.0
            );
        }
        // Idle: the loop thread takes the loop back and sleeps in epoll. Wait until it made
        // a turn of its own again (it is back), then count its turns over a quiet second.
        let deadline = soon();
        let back: Vec<u64> = meshes.iter().map(|m| m.loop_turns().0).collect();
        while meshes.iter().zip(&back).any(|(m, b)| m.loop_turns().0 == *b) && Instant::now() < deadline {
            // Nudge: anything for the loop makes it turn once it is back.
            for m in &meshes {
                m.driver.kick();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let start: Vec<u64> = meshes.iter().map(|m| m.loop_turns().0).collect();
        std::thread::sleep(Duration::from_secs(1));
        for (m, s) in meshes.iter().zip(&start) {
            let idle = m.loop_turns().0 - s;
            // Heartbeat-free links: a handful of timer turns at most, never a spinning loop
            // (thousands per second).
            assert!(idle < 50, "{name} rank {}: {idle} loop turns in an idle second", m.rank());
        }
    }
}

#[test]
fn a_split_provider_runs_each_link_over_the_provider_routed_for_its_peer() {
    use rdma_shuffle_fabric::providers::split::SplitProvider;
    use rdma_shuffle_providers::shm::ShmProvider;
    // Ranks 0 and 1 "share a host" (shm between them), rank 2 is "elsewhere" (tcp with both).
    let splits: Vec<Arc<SplitProvider>> = (0..3)
        .map(|_| Arc::new(SplitProvider::new(Arc::new(ShmProvider::default()), Arc::new(TcpProvider::new())).unwrap()))
        .collect();
    let listeners: Vec<MeshListener> =
        splits.iter().enumerate().map(|(r, s)| MeshListener::bind(s.clone(), localhost(), r).unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr()).collect();
    splits[0].route([addrs[1]].into(), false);
    splits[1].route([addrs[0]].into(), false);
    splits[2].route(Default::default(), false);
    assert_eq!((splits[0].name(), splits[2].name()), ("shm+tcp", "tcp"));
    let meshes: Vec<Mesh> = connect_all(listeners, |_| {}).into_iter().map(|m| m.unwrap()).collect();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    std::thread::scope(|sc| {
        for m in &meshes {
            let big = &big;
            sc.spawn(move || {
                let me = m.rank();
                for peer in (0..3).filter(|p| *p != me) {
                    m.wait(m.send(peer, 1, &[me as u8; 100], Proto::Eager, None).unwrap(), soon()).unwrap();
                    m.wait(m.send(peer, 2, big, Proto::Rendezvous, None).unwrap(), soon()).unwrap();
                }
                for peer in (0..3).filter(|p| *p != me) {
                    assert_eq!(&*m.recv(peer, 1, soon()).unwrap(), &[peer as u8; 100][..]);
                    assert!(*m.recv(peer, 2, soon()).unwrap() == big[..], "rank {me}: rendezvous from {peer} differs");
                }
            });
        }
    });
    // An eager message is filed whole over shm (a message link) and placed from the byte
    // stream over tcp ("staged"); a 300 KB rendezvous is placed on both. So rank 0 stages its
    // eager message from rank 2 only, rank 2 both of its own.
    let eager_staged = |m: &Mesh| m.stats().staged - 2;
    assert_eq!(eager_staged(&meshes[0]), 1, "{:?}", meshes[0].stats());
    assert_eq!(eager_staged(&meshes[1]), 1, "{:?}", meshes[1].stats());
    assert_eq!(eager_staged(&meshes[2]), 2, "{:?}", meshes[2].stats());
    assert_eq!(meshes[0].provider_name(), "shm+tcp");
}

#[test]
fn a_receive_given_up_while_its_message_is_placed_never_sees_its_memory_written_after() {
    // tcp reads a claimed message from the socket straight into the caller's memory. A
    // caller that gives the receive up mid-message must get its memory back only once
    // nothing writes it any more: either the placement finished first (the buffer holds the
    // whole message and the link stays up), or the link stopped reading and failed, loudly
    // (the rest of the frame cannot be skipped). Which one happens depends on whether the
    // loop finished the message before it ran the give-up; both are checked.
    let big: Vec<u8> = (0..(16u32 << 20)).map(|i| (i % 249) as u8).collect();
    let tcp: Arc<dyn Provider> = Arc::new(TcpProvider::new());
    let mut stopped = 0;
    for attempt in 0..10u64 {
        let meshes: Vec<Mesh> = build(tcp.clone(), 2, |_| {}).into_iter().map(|m| m.unwrap()).collect();
        let (m0, m1) = (&meshes[0], &meshes[1]);
        let tag = 100 + attempt;
        let mut dst = vec![0u8; big.len()];
        let p = unsafe { m1.post_recv(0, tag, dst.as_mut_ptr(), dst.len(), None) }.unwrap();
        let ticket = m0.send(1, tag, &big, Proto::Rendezvous, None).unwrap();
        let deadline = soon();
        loop {
            if matches!(m1.shared.lock().posted.get(&(0, tag)), Some(Posted::Claimed | Posted::Done | Posted::Failed(_))) {
                break;
            }
            assert!(Instant::now() < deadline, "the posted receive was never claimed");
            std::hint::spin_loop();
        }
        // Returns once nothing writes `dst` any more.
        drop(p);
        let snapshot: Vec<u8> = dst.clone();
        let status = m1.shared.lock().peers[0].status.clone();
        assert!(!m1.shared.lock().posted.contains_key(&(0, tag)), "the receive is forgotten");
        match status {
            PeerStatus::Up => assert!(dst == big, "the link stayed up, so the whole message was placed"),
            PeerStatus::Failed(why) => {
                assert!(why.contains("abandoned"), "{why}");
                stopped += 1;
            }
            other => panic!("unexpected link state {other:?}"),
        }
        let _ = m0.wait(ticket, soon());
        drop(meshes);
        assert!(dst == snapshot, "the buffer was written after its receive was given up");
    }
    eprintln!("{stopped} of 10 give-ups stopped a placement in progress");
}
