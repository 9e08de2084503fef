//! Seed inputs for both targets: every frame kind for `frame_decode`, and scripts that drive
//! the sessions through complete handshakes, fetches, pulls and failures for `handshake`.

use crate::cursor::Writer;
use crate::frames::{sample_frames, write_frame};
use crate::handshake::{client_op, pair_op, server_op, Mode, CLIENT_NONCE};
use wire::{caps, BlockSpan, Frame, Secret, Transcript};

/// Named seeds for the `frame_decode` target: each sample frame encoded as one message, with
/// its payload when it has one, and once more behind 20 bytes of roomy limits.
pub fn frame_decode() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, f) in sample_frames().into_iter().enumerate() {
        let mut b = f.to_vec();
        b.resize(b.len() + f.payload_len() as usize, 0xa5);
        let mut with_limits = Writer::new();
        with_limits.u32(1 << 16).u32(1 << 16).u64(1 << 16).u32(64).bytes(&b);
        out.push((format!("{i:02}-{}", f.kind()), b));
        out.push((format!("{i:02}-{}-limits", f.kind()), with_limits.buf));
    }
    out
}

fn frame_op(w: &mut Writer, op: u8, f: &Frame) {
    w.u8(op);
    write_frame(w, f);
}

fn hello() -> Frame {
    Frame::Hello { min_version: 3, max_version: 3, caps: caps::ALL, nonce: CLIENT_NONCE, max_eager: 4096, app_id: String::new() }
}

/// Fetch frame: one small block (eager), one large (rendezvous), one in a failing group.
fn fetch() -> Frame {
    Frame::Fetch {
        req: 1,
        first_index: 0,
        blocks: vec![BlockSpan::single(1, 100, 0), BlockSpan::single(1, 100_000, 1), BlockSpan::single(3, 5, 4)],
    }
}

/// Named seeds for the `handshake` target.
pub fn handshake() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();

    // Server, with and without a secret: handshake, a fetch, a pull and a release.
    for secret in [false, true] {
        let mut w = Writer::new();
        w.u8(Mode::Server as u8).u8(secret as u8 | (7 << 2)).u8(8).u32(1024);
        frame_op(&mut w, server_op::FRAME, &hello());
        if secret {
            w.u8(server_op::VALID_AUTH);
        } else {
            frame_op(&mut w, server_op::FRAME, &Frame::Auth { proof: None });
        }
        frame_op(&mut w, server_op::FRAME, &fetch());
        w.u8(server_op::PULL).u8(0).u8(3).u64(0).u64(u64::MAX);
        w.u8(server_op::RELEASE).u8(0);
        out.push((format!("server-{}", if secret { "secret" } else { "open" }), w.buf));
    }
    // Server with a secret, fed a wrong proof and then a fetch; and raw bytes.
    {
        let mut w = Writer::new();
        w.u8(Mode::Server as u8).u8(1 | (7 << 2)).u8(8).u32(1024);
        frame_op(&mut w, server_op::FRAME, &hello());
        frame_op(&mut w, server_op::FRAME, &Frame::Auth { proof: Some([7; 32]) });
        frame_op(&mut w, server_op::FRAME, &fetch());
        out.push(("server-wrong-proof".into(), w.buf));
        let mut w = Writer::new();
        w.u8(Mode::Server as u8).u8(7 << 2).u8(8).u32(1024);
        w.u8(server_op::RAW).blob(&hello().to_vec());
        w.u8(server_op::STREAM).blob(&Frame::Auth { proof: None }.to_vec());
        w.u8(server_op::RAW).blob(&fetch().to_vec());
        w.u8(server_op::TIMEOUT).u16(400);
        out.push(("server-raw".into(), w.buf));
    }

    // Client, with and without a secret: handshake, a fetch, every kind of answer.
    for secret in [false, true] {
        let mut w = Writer::new();
        w.u8(Mode::Client as u8).u8(secret as u8 | (7 << 2)).u32(1 << 20);
        w.u8(client_op::FETCH).u8(4);
        for (g, o, s, e) in [(1u8, 10u8, 0u8, 1u8), (1, 20, 1, 3), (2, 30, 0, 1), (4, 40, 5, 6)] {
            w.u8(g).u8(o).u8(s).u8(e);
        }
        w.u8(client_op::CHALLENGE).u8(7).bytes(&[0x11; 16]).u8(3).u32(4096);
        w.u8(client_op::READY);
        w.u8(client_op::EAGER).u8(0).u8(1).u32(100);
        w.u8(client_op::RENDEZVOUS).u8(1).u8(9).u64(0x1000).u32(100_000).u32(5);
        w.u8(client_op::DRIVER).u8(0).u8(1);
        w.u8(client_op::PULL_DATA).u8(0).u8(1).u64(0).u64(60_000);
        w.u8(client_op::PULL_DATA).u8(0).u8(1).u64(0).u64(40_000);
        w.u8(client_op::DRIVER).u8(0).u8(2);
        w.u8(client_op::CREDIT).u32(2);
        w.u8(client_op::BLOCK_FAILED).u8(2).u16(2).blob(b"no such map output");
        w.u8(client_op::CREDIT).u32(1);
        w.u8(client_op::EAGER).u8(3).u8(0).u32(0);
        w.u8(client_op::LIFECYCLE).u8(0).u16(2000);
        out.push((format!("client-{}", if secret { "secret" } else { "open" }), w.buf));
    }
    // Client fed raw server frames, including a forged Ready.
    {
        let mut w = Writer::new();
        w.u8(Mode::Client as u8).u8(1 | (7 << 2)).u32(1 << 20);
        w.u8(client_op::FETCH).u8(1).u8(1).u8(1).u8(0).u8(1);
        let challenge = Frame::Challenge {
            version: 3,
            caps: 7,
            nonce: [0x22; 16],
            auth_required: true,
            credits: 4,
            eager_threshold: 1024,
            app_id: String::new(),
        };
        w.u8(client_op::RAW).blob(&challenge.to_vec());
        let forged = Secret::new("guess").server_proof(&Transcript::new(&hello(), &challenge), 4);
        w.u8(client_op::RAW).blob(&Frame::Ready { proof: Some(forged), credits: 4 }.to_vec());
        out.push(("client-forged-ready".into(), w.buf));
    }

    // Pairs: agreeing secrets, mismatched secrets, no rendezvous, corruption, timeouts.
    let pair = |flags: u8, credits: u8, ops: &dyn Fn(&mut Writer)| {
        let mut w = Writer::new();
        w.u8(Mode::Pair as u8).u8(flags).u8(credits).u32(2048).u32(1 << 20).u8(2);
        ops(&mut w);
        w.buf
    };
    let fetch_ops = |w: &mut Writer| {
        w.u8(pair_op::FETCH).u8(5);
        for (g, o, s, e) in [(1u8, 100u32, 0u8, 1u8), (1, 50_000_000, 0, 2), (7, 1, 3, 4), (1, 5000, 2, 2), (2, 0, 0, 1)] {
            w.u8(g).u32(o).u8(s).u8(e);
        }
    };
    out.push((
        "pair-secret".into(),
        pair(3, 3, &|w| {
            fetch_ops(w);
            w.u8(pair_op::STEP).u8(3);
            fetch_ops(w);
            w.u8(pair_op::SETTLE);
        }),
    ));
    out.push((
        "pair-open-tiny-credits".into(),
        pair(0, 1, &|w| {
            fetch_ops(w);
            w.u8(pair_op::SETTLE);
        }),
    ));
    out.push((
        "pair-mismatch".into(),
        pair(1 | 2 | 4, 4, &|w| {
            fetch_ops(w);
            w.u8(pair_op::SETTLE);
            fetch_ops(w);
        }),
    ));
    out.push((
        "pair-no-rendezvous".into(),
        pair(8, 4, &|w| {
            fetch_ops(w);
        }),
    ));
    out.push((
        "pair-corrupt".into(),
        pair(0, 4, &|w| {
            fetch_ops(w);
            w.u8(pair_op::STEP).u8(2);
            w.u8(pair_op::CORRUPT).u8(1).u16(13).u8(0x40);
            w.u8(pair_op::SETTLE);
        }),
    ));
    out.push((
        "pair-timeout".into(),
        pair(3, 4, &|w| {
            fetch_ops(w);
            w.u8(pair_op::STEP).u8(4);
            w.u8(pair_op::TIMEOUT).u16(200);
            w.u8(pair_op::LOST);
        }),
    ));
    out
}
