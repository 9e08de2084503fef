//! Micro-benchmarks of the codec and of one in-memory session round trip.
//!
//! `cargo bench -p rdma-shuffle-wire --bench codec -- --warm-up-time 1 --measurement-time 2`
//!
//! Encode+decode reuse one buffer, as a driver would; the round trip runs a client and a
//! server session through the real codec for one eager block (fetch → server → eager and
//! credit back), so it prices the per-block protocol work the data path pays on top of I/O.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use rdma_shuffle_wire::frame::HEADER_LEN;
use rdma_shuffle_wire::*;
use std::time::Instant;

fn encode_decode(c: &mut Criterion, name: &str, frame: Frame) {
    let limits = Limits::default();
    let mut buf = Vec::with_capacity(2048);
    // Payload frames: decode the header and fixed part only, as a stream driver does.
    c.bench_function(name, |b| {
        b.iter(|| {
            buf.clear();
            black_box(&frame).encode(&mut buf);
            let h = Header::decode(black_box(&buf), &limits).unwrap();
            let body = &buf[HEADER_LEN..HEADER_LEN + h.fixed_len()];
            black_box(Frame::decode_body(&h, body, &limits).unwrap())
        })
    });
}

fn codec(c: &mut Criterion) {
    let fetch = |n: u32| Frame::Fetch {
        req: 7,
        first_index: 0,
        blocks: (0..n).map(|i| BlockSpan::single(3, 1000 + i as u64, i)).collect(),
    };
    encode_decode(c, "fetch_1_block/encode+decode", fetch(1));
    encode_decode(c, "fetch_64_blocks/encode+decode", fetch(64));
    encode_decode(c, "eager_header/encode+decode", Frame::Eager { req: 7, index: 3, len: 32 * 1024 });
    encode_decode(
        c,
        "rendezvous/encode+decode",
        Frame::Rendezvous {
            req: 7,
            index: 3,
            desc: Descriptor { region: 11, addr: 0x7f00_0000_1000, len: 8 << 20, rkey: 0x1234 },
            block_len: 8 << 20,
        },
    );

    let limits = Limits::default();
    let header = Frame::Eager { req: 7, index: 3, len: 32 * 1024 }.to_vec();
    c.bench_function("header/decode", |b| b.iter(|| black_box(Header::decode(black_box(&header), &limits).unwrap())));
}

fn resolve(span: &BlockSpan) -> Result<Resolved<u64>, BlockFailure> {
    Ok(Resolved { source: span.object, offset: 0, len: 4096 })
}

/// Encodes `f` into `buf` and decodes it back, as the transport between the two sessions.
fn carry(f: &Frame, buf: &mut Vec<u8>, limits: &Limits) -> Frame {
    buf.clear();
    f.encode(buf);
    let h = Header::decode(buf, limits).unwrap();
    Frame::decode_body(&h, &buf[HEADER_LEN..HEADER_LEN + h.fixed_len()], limits).unwrap()
}

fn session(c: &mut Criterion) {
    let now = Instant::now();
    let mut cc = ClientConfig::new("server", [1; 16]);
    cc.secret = Some(Secret::new("bench"));
    let mut sc = ServerConfig::new("client", [2; 16]);
    sc.secret = Some(Secret::new("bench"));
    let mut client = ClientSession::new(cc, now);
    let mut server: ServerSession<u64> = ServerSession::new(sc, now);
    let mut buf = Vec::with_capacity(256);
    let (cl, sl) = (client.limits(), server.limits());

    // Handshake once, outside the measurement.
    loop {
        let mut moved = false;
        while let Some(f) = client.poll_transmit() {
            server.handle_frame(carry(&f, &mut buf, &sl), &mut resolve).unwrap();
            moved = true;
        }
        while let Some(ServerOutput::Frame(f)) = server.poll_output() {
            client.handle_frame(carry(&f, &mut buf, &cl), now).unwrap();
            moved = true;
        }
        if !moved {
            break;
        }
    }
    assert!(client.is_ready() && server.is_ready());
    while client.poll_event().is_some() {}

    let mut group = c.benchmark_group("session");
    group.throughput(Throughput::Elements(1));
    group.bench_function("eager_block_round_trip", |b| {
        b.iter(|| {
            client.fetch(vec![BlockSpan::single(3, 42, 1)], now);
            let f = client.poll_transmit().unwrap();
            server.handle_frame(carry(&f, &mut buf, &sl), &mut resolve).unwrap();
            while let Some(o) = server.poll_output() {
                let f = match o {
                    ServerOutput::Frame(f) | ServerOutput::Eager { frame: f, .. } | ServerOutput::PullData { frame: f, .. } => f,
                    // Eager-sized blocks only: nothing is exposed or revoked here.
                    ServerOutput::Expose { .. } | ServerOutput::Revoke { .. } => continue,
                };
                client.handle_frame(carry(&f, &mut buf, &cl), now).unwrap();
            }
            let mut delivered = 0;
            while let Some(e) = client.poll_event() {
                if matches!(e, ClientEvent::Eager { len: 4096, .. }) {
                    delivered += 1;
                }
            }
            assert_eq!(delivered, 1);
        })
    });
    group.finish();
}

criterion_group!(benches, codec, session);
criterion_main!(benches);
