//! Tests of the shm provider's connections: in one process (two threads) and across real
//! processes (this test binary re-executed as a child: security and death cases).

use super::*;
use rdma_shuffle_fabric::error::FabricError;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);

fn cfg(single_copy: bool) -> ShmConfig {
    ShmConfig { ring_bytes: 64 * 1024, single_copy, single_copy_min: 8 * 1024, ..ShmConfig::default() }
}

fn body(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ seed) as u8).collect()
}

/// Sizes around every boundary: empty, inline, the single-copy threshold, half a ring (the
/// largest record), and many rings' worth.
const SIZES: [usize; 9] = [0, 1, 100, 8 * 1024 - 1, 8 * 1024, 32 * 1024 - 8, 32 * 1024, 200_000, 3 << 20];

/// A pair of connected ends in this process (the acceptor on a thread).
fn pair(c: &ShmConfig) -> (ShmConn, ShmConn) {
    let l = ShmListener::bind(&unique_name()).unwrap();
    let name = l.name().to_string();
    let cc = c.clone();
    let acceptor = std::thread::spawn(move || l.accept_blocking(&cc, T));
    let conn = ShmConnecting::connect_blocking(&name, c, T).unwrap();
    (acceptor.join().unwrap().unwrap(), conn)
}

fn echo_both_ways(single_copy: bool) -> (ShmConnStats, LargeMessages) {
    let (mut a, mut b) = pair(&cfg(single_copy));
    let echo = std::thread::spawn(move || {
        // What arrives while an echo waits to go out (the next message can come in with the
        // acknowledgement of a message lent by reference) is echoed in turn.
        let mut waiting = std::collections::VecDeque::new();
        for _ in 0..SIZES.len() * 3 {
            let m = match waiting.pop_front() {
                Some(m) => m,
                None => a.recv_timeout(T).unwrap(),
            };
            a.send(m).unwrap();
            waiting.extend(a.send_all(T).unwrap());
        }
        assert!(waiting.is_empty());
        a
    });
    let mut sent = 0usize;
    for round in 0..3 {
        for (i, &len) in SIZES.iter().enumerate() {
            let m = body(len, round * 100 + i);
            b.send(m.clone()).unwrap();
            let mut got = b.send_all(T).unwrap();
            let back = if got.is_empty() { b.recv_timeout(T).unwrap() } else { got.remove(0) };
            assert!(got.is_empty());
            assert_eq!(back.len(), len, "round {round}, size {len}");
            assert!(back == m, "round {round}, size {len}: bytes differ");
            sent += 1;
        }
    }
    let a = echo.join().unwrap();
    assert_eq!(sent, SIZES.len() * 3);
    assert_eq!(a.queued_bytes() + b.queued_bytes(), 0, "every lent message was acknowledged");
    (b.stats(), b.large_messages())
}

#[test]
fn shm_messages_of_every_size_cross_both_ways_by_single_copy() {
    let (stats, large) = echo_both_ways(true);
    // Within one process ptrace permission is never in question.
    assert_eq!(large, LargeMessages::SingleCopy);
    assert!(stats.single_copy >= 3 * 5, "{stats:?}");
    assert_eq!(stats.fragmented, 0, "{stats:?}");
}

#[test]
fn shm_messages_of_every_size_cross_both_ways_through_the_segment() {
    let (stats, large) = echo_both_ways(false);
    assert_eq!(large, LargeMessages::CopyThroughSegment);
    assert_eq!(stats.single_copy, 0, "{stats:?}");
    // 32 KiB and more is past half of a 64 KiB ring.
    assert_eq!(stats.fragmented, 3 * 3, "{stats:?}");
}

#[test]
fn shm_a_borrowed_body_is_read_from_the_senders_buffer_when_the_peer_copies_it() {
    let (mut a, mut b) = pair(&cfg(true));
    let len = 200_000;
    let mut buf = body(len, 7);
    let owner: std::sync::Arc<dyn Send + Sync> = std::sync::Arc::new(());
    // SAFETY: `buf` lives (and is changed only as the test says) until the id is no longer lent.
    let id = unsafe { b.send_borrowed(b"HEAD".to_vec(), buf.as_ptr() as u64, len, owner.clone()).unwrap() };
    assert!(b.lent(id));
    assert_eq!(b.stats().single_copy, 1);
    assert!(b.queued_bytes() >= len, "a lent body counts as queued: {}", b.queued_bytes());
    // Nothing was copied on the sending side: a change made now is what the peer gets.
    buf[0] = buf[0].wrapping_add(1);
    buf[len - 1] = buf[len - 1].wrapping_add(1);
    let got = a.recv_timeout(T).unwrap();
    assert_eq!(&got[..4], b"HEAD");
    assert!(got[4..] == buf[..], "the peer read the buffer as it is now");
    // Still lent until the sender has seen the acknowledgement; then let go of.
    assert!(b.lent(id));
    b.send_all(T).unwrap();
    assert!(!b.lent(id));
    assert_eq!(b.queued_bytes(), 0);
    assert_eq!(std::sync::Arc::strong_count(&owner), 1, "the owner is let go of with the acknowledgement");

    // Refused, with the reason, where it cannot work: a body larger than the limit, and a
    // connection whose peer may not read this process (copy through the segment).
    let big = ShmConfig::default().max_message;
    // SAFETY: refused before anything is lent.
    let e = unsafe { b.send_borrowed(Vec::new(), buf.as_ptr() as u64, big + 1, owner.clone()) }.unwrap_err();
    assert!(e.to_string().contains("limit"), "{e}");
    let (_c, mut d) = pair(&cfg(false));
    // SAFETY: refused before anything is lent.
    let e = unsafe { d.send_borrowed(Vec::new(), buf.as_ptr() as u64, len, owner.clone()) }.unwrap_err();
    assert!(e.to_string().contains("may not read"), "{e}");
    assert_eq!(std::sync::Arc::strong_count(&owner), 1);
}

#[test]
fn shm_a_borrowed_body_is_folded_into_place_piece_by_piece() {
    let (mut a, mut b) = pair(&cfg(true));
    // Not a multiple of the piece: the last piece is short.
    let len = 3 * 4096 + 1000;
    let buf = body(len, 3);
    let owner: std::sync::Arc<dyn Send + Sync> = std::sync::Arc::new(());
    fn next_body(a: &mut ShmConn, b: &mut ShmConn, buf: &[u8], owner: &std::sync::Arc<dyn Send + Sync>) -> LentBody {
        // SAFETY: `buf` lives, unchanged, until the end of the test.
        unsafe { b.send_borrowed(b"HD".to_vec(), buf.as_ptr() as u64, buf.len(), owner.clone()).unwrap() };
        loop {
            match a.try_recv_parts().unwrap() {
                Some(Received::Lent(l)) => return l,
                Some(Received::Msg(m)) => panic!("a message of {} bytes instead of a lent body", m.len()),
                None => std::thread::yield_now(),
            }
        }
    }
    let l = next_body(&mut a, &mut b, &buf, &owner);
    assert_eq!(fold_xor(&mut a, l, &buf), [4096, 4096, 4096, 1000]);
    // Acknowledged: the sender lets its buffer go.
    b.send_all(T).unwrap();
    assert_eq!(b.queued_bytes(), 0);

    // A destination of another length is refused, with the sizes.
    let l = next_body(&mut a, &mut b, &buf, &owner);
    let e = a.fold_body(l, &mut vec![0u8; len - 1], &mut [0u8; 4096], |_, _| panic!("nothing is folded")).unwrap_err();
    assert!(e.to_string().contains(&format!("{len} bytes is not folded into {}", len - 1)), "{e}");
}

/// Folds `l` (whose body is `sent`) into a buffer of other bytes by xor in 4 KiB pieces,
/// checks every byte was folded once at its own offset, and answers the pieces' lengths.
fn fold_xor(a: &mut ShmConn, l: LentBody, sent: &[u8]) -> Vec<usize> {
    let acc = body(sent.len(), 9);
    let mut dst = acc.clone();
    let mut scratch = vec![0u8; 4096];
    let mut pieces = Vec::new();
    a.fold_body(l, &mut dst, &mut scratch, |d, s| {
        pieces.push(d.len());
        for (d, s) in d.iter_mut().zip(s) {
            *d ^= *s;
        }
    })
    .unwrap();
    assert!(dst.iter().zip(&acc).zip(sent).all(|((d, x), y)| *d == x ^ y), "every byte folded once, at its own offset");
    pieces
}

/// The next message of `a`, which must be a head with its body held (in the ring or lent).
fn next_lent(a: &mut ShmConn) -> LentBody {
    let deadline = Instant::now() + T;
    loop {
        match a.try_recv_parts().unwrap() {
            Some(Received::Lent(l)) => return l,
            Some(Received::Msg(m)) => panic!("a message of {} bytes instead of a head and its body", m.len()),
            None if Instant::now() < deadline => std::thread::yield_now(),
            None => panic!("nothing arrived within {T:?}"),
        }
    }
}

#[test]
fn shm_a_body_through_the_ring_is_copied_or_folded_straight_out_of_it() {
    // No single copy: the ring needs no permission to read the peer's memory.
    let c = cfg(false);
    let (mut a, mut b) = pair(&c);
    // A 64 KiB ring: records of up to 32 KiB − 8, of which a body takes all but the head's room.
    let largest = c.largest_ring_body();
    assert_eq!(largest, 32 * 1024 - 8 - RING_HEAD_ROOM);
    assert!(b.ring_takes(largest) && !b.ring_takes(largest + 1), "decided by the length alone");
    assert!(!b.ring_takes(c.single_copy_min - 1), "a small message goes whole");
    let len = 5 * 4096 + 1000;
    let mut buf = body(len, 5);
    let sent = buf.clone();
    let owner: std::sync::Arc<dyn Send + Sync> = std::sync::Arc::new(());
    // SAFETY: `buf` lives until the end of the test; it is pushed at once (the ring is empty).
    let id = unsafe { b.send_through_ring(b"HEAD".to_vec(), buf.as_ptr() as u64, len, owner.clone()).unwrap() };
    // Copied into the ring by the send: the caller's buffer is its own again at once.
    assert!(!b.lent(id));
    assert_eq!((b.stats().through_ring, b.stats().single_copy, b.queued_bytes()), (1, 0, 0));
    assert_eq!(std::sync::Arc::strong_count(&owner), 1, "the owner is let go of once the body is in the ring");
    buf[0] = buf[0].wrapping_add(1);
    b.send(body(10, 1)).unwrap();
    let l = next_lent(&mut a);
    assert_eq!((&l.head[..], l.len()), (&b"HEAD"[..], len as u64));
    // Held in the ring until placed: what came after it waits, and is seen waiting.
    assert!(a.try_recv_parts().unwrap().is_none(), "nothing is read past a held body");
    assert!(a.has_input());
    let mut dst = vec![0u8; len];
    a.copy_body(l, Some(&mut dst)).unwrap();
    assert!(dst == sent, "the bytes as they were sent, not as the caller changed them after");
    assert_eq!(a.recv_timeout(T).unwrap(), body(10, 1), "the next message follows");

    // Folded out of the ring in the pieces asked for, every byte once at its own offset.
    // SAFETY: as above.
    unsafe { b.send_through_ring(b"HD".to_vec(), sent.as_ptr() as u64, len, owner.clone()).unwrap() };
    let l = next_lent(&mut a);
    assert_eq!(fold_xor(&mut a, l, &sent), [4096, 4096, 4096, 4096, 4096, 1000]);

    // Each record's space comes back once its body is taken: many times the ring's size go
    // through, each pushed at once.
    for i in 0..20 {
        let m = body(largest, i);
        // SAFETY: `m` lives until its body was taken below.
        let id = unsafe { b.send_through_ring(Vec::new(), m.as_ptr() as u64, largest, owner.clone()).unwrap() };
        assert!(!b.lent(id), "record {i} waited for room: the ring was not freed");
        let l = next_lent(&mut a);
        let mut got = vec![0u8; largest];
        a.copy_body(l, Some(&mut got)).unwrap();
        assert!(got == m, "record {i}");
    }

    // Refused, with the sizes: a body past a record, a head past its room, a destination of
    // another length; and a body held by another connection's ring.
    // SAFETY: refused before anything is queued.
    let e = unsafe { b.send_through_ring(Vec::new(), sent.as_ptr() as u64, largest + 1, owner.clone()) }.unwrap_err();
    assert!(e.to_string().contains(&format!("0 + {}", largest + 1)), "{e}");
    // SAFETY: as above.
    let e = unsafe { b.send_through_ring(vec![0; RING_HEAD_ROOM], sent.as_ptr() as u64, len, owner.clone()) }.unwrap_err();
    assert!(e.to_string().contains("does not go this way"), "{e}");
    // SAFETY: `sent` lives until the end of the test.
    unsafe { b.send_through_ring(Vec::new(), sent.as_ptr() as u64, len, owner.clone()).unwrap() };
    let l = next_lent(&mut a);
    let e = a.copy_body(l, Some(&mut vec![0u8; len - 1])).unwrap_err();
    assert!(e.to_string().contains(&format!("{len} bytes does not go into {}", len - 1)), "{e}");
    let (mut x, mut y) = pair(&c);
    // SAFETY: as above.
    unsafe { y.send_through_ring(Vec::new(), sent.as_ptr() as u64, len, owner.clone()).unwrap() };
    let other = next_lent(&mut x);
    let e = a.copy_body(other, None).unwrap_err();
    assert!(e.to_string().contains("not the one this ring holds"), "{e}");
}

#[test]
fn shm_a_head_and_body_record_that_lies_about_its_head_is_refused() {
    let max = 1 << 20;
    let rec = |head_len: u64, rest: &[u8]| [&head_len.to_le_bytes()[..], rest].concat();
    let ok = conn::head_body(&rec(3, b"abcdefgh"), max).unwrap();
    assert_eq!((&ok.head[..], ok.len()), (&b"abc"[..], 5));
    for (bytes, what) in [
        (rec(9, b"abcdefgh"), "a head of 9 bytes"),
        (rec(u64::MAX, b"x"), &format!("a head of {} bytes", u64::MAX)),
        (b"short".to_vec(), "a head-and-body record of 5 bytes"),
    ] {
        let e = conn::head_body(&bytes, max).unwrap_err();
        assert!(e.contains(what), "{e}");
    }
    let e = conn::head_body(&rec(0, &[0; 64]), 32).unwrap_err();
    assert!(e.contains("past the 32-byte limit"), "{e}");
}

#[test]
fn shm_a_flood_in_one_direction_sleeps_and_wakes_on_the_doorbells() {
    let (mut a, mut b) = pair(&ShmConfig { spin: Duration::ZERO, ..cfg(false) });
    let n = 5000usize;
    let reader = std::thread::spawn(move || {
        for i in 0..n {
            let m = a.recv_timeout(T).unwrap();
            assert_eq!(m, body(i % 3000, i), "message {i}");
        }
        a
    });
    for i in 0..n {
        b.send(body(i % 3000, i)).unwrap();
    }
    b.send_all(T).unwrap();
    let a = reader.join().unwrap();
    // Without a spin every wait sleeps, and the ring (64 KiB) holds far less than the ~7 MiB
    // sent: a reader that caught up slept until the sender rang it, a sender that filled the
    // ring slept until the reader rang it. Which one happens depends on the scheduler (a
    // reader starved by a loaded machine never catches up), so count both sides' rings.
    assert!(a.stats().doorbells + b.stats().doorbells > 0, "{:?} {:?}", a.stats(), b.stats());
}

#[test]
fn shm_a_reader_polling_in_memory_is_rung_only_once_it_armed() {
    let (mut a, mut b) = pair(&cfg(false));
    // `a` polls without arming (a driver loop that spins): pushes to it ring nobody.
    assert_eq!(a.try_recv().unwrap(), None);
    for i in 0..100 {
        b.send(body(64, i)).unwrap();
        let got = a.try_recv().unwrap();
        assert_eq!(got, Some(body(64, i)), "message {i}");
        assert_eq!(a.try_recv().unwrap(), None);
    }
    assert_eq!(b.stats().doorbells, 0, "{:?}", b.stats());
    // Armed with nothing there (the loop is about to sleep): the next push rings once, and
    // only once (the ring clears the wish).
    assert!(!a.arm());
    b.send(body(10, 1)).unwrap();
    b.send(body(10, 2)).unwrap();
    assert_eq!(b.stats().doorbells, 1, "{:?}", b.stats());
    // Arming with a record there says so: the loop must not sleep.
    assert!(a.arm());
    assert_eq!(a.try_recv().unwrap(), Some(body(10, 1)));
    assert_eq!(a.try_recv().unwrap(), Some(body(10, 2)));
    // The doorbell really is readable after a ring: a sleep on it returns at once.
    assert!(!a.arm());
    b.send(body(10, 3)).unwrap();
    let ev = sys::poll_in(&a.poll_fds(), T).unwrap();
    assert!(ev[0] != 0, "the doorbell did not become readable");
    assert_eq!(a.try_recv().unwrap(), Some(body(10, 3)));
}

#[test]
fn shm_secrets_must_match_and_the_refusal_says_why() {
    let with = |s: Option<&str>| ShmConfig { secret: s.map(rdma_shuffle_wire::Secret::new), ..cfg(true) };
    let (a, b) = pair(&with(Some("k")));
    drop((a, b));
    for (server, client, want) in [
        (Some("k"), Some("wrong"), "does not know the shared secret"),
        (Some("k"), None, "shared secret"),
        (None, Some("k"), "shared secret"),
    ] {
        let l = ShmListener::bind(&unique_name()).unwrap();
        let name = l.name().to_string();
        let sc = with(server);
        let acceptor = std::thread::spawn(move || l.accept_blocking(&sc, T).map(|_| ()));
        let e = ShmConnecting::connect_blocking(&name, &with(client), T).unwrap_err().to_string();
        let ae = acceptor.join().unwrap().unwrap_err().to_string();
        assert!(e.contains(want) || ae.contains(want), "{server:?}/{client:?}: {e} / {ae}");
    }
}

#[test]
fn shm_connecting_to_nothing_is_a_typed_error() {
    let e = ShmConnecting::connect_blocking(&unique_name(), &cfg(true), T).unwrap_err();
    assert!(matches!(e, FabricError::Io { .. } | FabricError::Closed { .. }), "{e}");
}

// ---- across processes -------------------------------------------------------------------

/// The child side of the cross-process tests; does nothing unless this binary was started
/// by one of them.
#[test]
fn shm_child_process() {
    let Ok(mode) = std::env::var("RSSHM_CHILD") else { return };
    let name = std::env::var("RSSHM_NAME").unwrap();
    let secret = std::env::var("RSSHM_SECRET").ok().map(rdma_shuffle_wire::Secret::new);
    let c = ShmConfig { secret, ..cfg(true) };
    match mode.as_str() {
        "hold" => {
            let mut conn = ShmConnecting::connect_blocking(&name, &c, T).unwrap();
            conn.send(b"ready".to_vec()).unwrap();
            conn.send_all(T).unwrap();
            // Hold the segment (never read again) until killed.
            loop {
                std::thread::park();
            }
        }
        "intrude" => {
            let r = ShmConnecting::connect_blocking(&name, &c, T);
            println!("RSSHM-RESULT {}", r.as_ref().map(|_| "connected".to_string()).unwrap_or_else(|e| e.to_string()));
            println!("RSSHM-MEMFDS {}", memfds_open());
        }
        m => panic!("unknown child mode {m}"),
    }
}

fn child(mode: &str, name: &str, secret: Option<&str>) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "tests::shm_child_process", "--nocapture", "--test-threads=1"])
        .env("RSSHM_CHILD", mode)
        .env("RSSHM_NAME", name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(s) = secret {
        c.env("RSSHM_SECRET", s);
    }
    c
}

/// memfd descriptors open in this process.
fn memfds_open() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.to_string_lossy().starts_with("/memfd:"))
        .count()
}

/// Whether the segment named `seg` is mapped in this process.
fn mapped(seg: &str) -> bool {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| l.contains(&format!("/memfd:{seg} ")))
}

/// Accepts on `l` while the child runs, returning the acceptor's result.
fn accept_while(l: &ShmListener, c: &ShmConfig, child: &mut std::process::Child) -> Result<ShmConn, FabricError> {
    let deadline = Instant::now() + T;
    loop {
        match l.accept_blocking(c, Duration::from_millis(200)) {
            Err(FabricError::ConnectTimeout { .. }) if Instant::now() < deadline && child.try_wait().unwrap().is_none() => {}
            r => return r,
        }
    }
}

fn intrude(secret: Option<&str>, uid: Option<u32>) -> (String, String, Result<ShmConn, FabricError>) {
    let l = ShmListener::bind(&unique_name()).unwrap();
    let server = ShmConfig { secret: Some(rdma_shuffle_wire::Secret::new("job-secret")), ..cfg(true) };
    let mut cmd = child("intrude", l.name(), secret);
    if let Some(uid) = uid {
        std::os::unix::process::CommandExt::uid(&mut cmd, uid);
    }
    let mut ch = cmd.spawn().unwrap();
    let accepted = accept_while(&l, &server, &mut ch);
    let out = ch.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let line = |tag: &str| stdout.lines().find_map(|l| Some(l.split_once(tag)?.1)).unwrap_or_default().to_string();
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    (line("RSSHM-RESULT "), line("RSSHM-MEMFDS "), accepted)
}

#[test]
fn shm_a_process_with_the_wrong_secret_gets_no_segment() {
    let (result, memfds, accepted) = intrude(Some("other-job"), None);
    assert!(result.contains("does not know the shared secret"), "{result}");
    assert_eq!(memfds, "0", "the refused process holds no segment descriptor");
    let e = accepted.unwrap_err().to_string();
    assert!(e.contains("does not know the shared secret"), "{e}");
    // And the control: the right secret connects.
    let (result, _, accepted) = intrude(Some("job-secret"), None);
    assert_eq!(result, "connected");
    assert!(accepted.is_ok());
}

#[test]
fn shm_a_process_of_another_user_gets_no_segment() {
    if super::sys::euid() != 0 {
        // Starting a process as another user needs root; as a non-root user the test
        // process itself is "the other user" of every root-owned rank, covered by the check.
        eprintln!("shm_a_process_of_another_user_gets_no_segment: not root, cannot start a process as another user");
        return;
    }
    // nobody, with the right secret: the uid check alone refuses it.
    let (result, memfds, accepted) = intrude(Some("job-secret"), Some(65534));
    assert!(result.contains("uid"), "{result}");
    assert_eq!(memfds, "0");
    let e = accepted.unwrap_err().to_string();
    assert!(e.contains("uid 65534"), "{e}");
}

#[test]
fn shm_a_killed_peer_is_an_error_within_the_timeout_and_leaves_no_segment() {
    for sending in [false, true] {
        let l = ShmListener::bind(&unique_name()).unwrap();
        let c = cfg(false);
        let mut ch = child("hold", l.name(), None).spawn().unwrap();
        let mut conn = accept_while(&l, &c, &mut ch).unwrap();
        let seg = conn.segment_name().to_string();
        assert_eq!(conn.recv_timeout(T).unwrap(), b"ready");
        assert!(mapped(&seg));
        let killed = Instant::now();
        ch.kill().unwrap(); // SIGKILL
        let r = if sending {
            // More than the ring holds: the child never reads, so this waits for room until
            // the child's death is seen.
            conn.send(vec![7u8; 1 << 20]).and_then(|_| conn.send_all(T).map(|_| ()))
        } else {
            conn.recv_timeout(T).map(|_| ())
        };
        let e = r.unwrap_err();
        assert!(matches!(&e, FabricError::Closed { peer } if peer.contains("pid")), "{e}");
        assert!(killed.elapsed() < T, "the death was seen only after {:?}", killed.elapsed());
        ch.wait().unwrap();
        drop(conn);
        assert!(!mapped(&seg), "segment {seg} still mapped after the connection was dropped");
    }
}

/// The ring rules of ring.rs on a real segment (a memfd), where `mincore` can tell mapped pages.
mod ring_on_a_segment {
    use crate::ring::{Consumer, Producer};
    use crate::segment::{Segment, Side};

    #[test]
    fn larger_records_walk_the_whole_ring_which_is_mapped_at_once_when_they_leave_the_warm_start() {
        let cap = 1 << 20;
        let (seg, _fd) = Segment::create("ring-populate-test", cap).unwrap();
        let ptrs = seg.tx(Side::Acceptor);
        // Pages of the ring mapped in this process (for a memfd: present in its page cache).
        let resident = || {
            let mut v = vec![0u8; cap / 4096];
            // SAFETY: the ring's data area is page-aligned, `cap` bytes long, and mapped.
            assert_eq!(unsafe { libc::mincore(ptrs.data as *mut libc::c_void, cap, v.as_mut_ptr()) }, 0);
            v.iter().filter(|b| **b & 1 == 1).count()
        };
        // SAFETY: one producer and one consumer over the segment's ring, which outlives both.
        let (mut p, mut c) = unsafe { (Producer::new(ptrs), Consumer::new(ptrs)) };
        let body = vec![9u8; 16 << 10];
        let base = ptrs.data as usize;
        let mut furthest = 0;
        for i in 0..200u32 {
            if i == 2 {
                // Two records in, still within the warm start: only their pages are mapped.
                assert!(resident() <= 9, "{} pages mapped after two 16 KiB records", resident());
            }
            assert!(p.push(i + 1, &[&body]));
            let (kind, at) = c.pop(|kind, bytes| (kind, bytes.as_ptr() as usize - base)).unwrap().unwrap();
            assert_eq!(kind, i + 1);
            furthest = furthest.max(at + body.len());
        }
        // 16 KiB records are not small: they go round the whole ring, consumer caught up or not.
        assert!(furthest > cap / 2, "16 KiB records reached only {furthest} bytes into the ring");
        assert_eq!(resident(), cap / 4096, "the ring was not mapped whole");
    }
}
