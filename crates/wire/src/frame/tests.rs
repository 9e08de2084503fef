//! Codec tests of [`super`].

use super::*;

#[test]
fn every_frame_round_trips_as_a_message() {
    let limits = Limits::default();
    for f in sample_frames() {
        let mut buf = f.to_vec();
        let payload = vec![0xab; f.payload_len() as usize];
        buf.extend_from_slice(&payload);
        let (g, off) = Frame::decode_message(&buf, &limits).unwrap();
        assert_eq!(f, g);
        assert_eq!(&buf[off..], &payload[..]);
    }
}

#[test]
fn header_rejects_bad_magic_version_kind_flags() {
    let limits = Limits::default();
    let good = Frame::Credit { n: 1 }.to_vec();
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(Header::decode(&b, &limits), Err(FrameError::BadMagic { .. })));
    let mut b = good.clone();
    b[4] = 99;
    assert!(matches!(Header::decode(&b, &limits), Err(FrameError::UnsupportedVersion { found: 99, .. })));
    let mut b = good.clone();
    b[5] = 200;
    assert_eq!(Header::decode(&b, &limits), Err(FrameError::UnknownKind(200)));
    let mut b = good;
    b[7] = 1;
    assert_eq!(Header::decode(&b, &limits), Err(FrameError::ReservedFlags(1)));
}

#[test]
fn lying_lengths_are_bounded_before_reading() {
    let limits = Limits { max_control: 100, max_eager: 1000, max_pull: 5000, max_blocks_per_fetch: 4 };
    let mut b = Frame::Credit { n: 1 }.to_vec();
    b[8..12].copy_from_slice(&101u32.to_be_bytes());
    assert!(matches!(Header::decode(&b, &limits), Err(FrameError::TooLong { len: 101, max: 100, .. })));
    let mut b = Frame::Eager { req: 1, index: 0, len: 1001 }.to_vec();
    assert!(matches!(Header::decode(&b, &limits), Err(FrameError::TooLong { kind: FrameKind::Eager, .. })));
    // An eager frame shorter than its fixed part.
    b[8..12].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(Header::decode(&b, &limits), Err(FrameError::Truncated { .. })));
    // A Fetch whose count disagrees with the body.
    let mut b = Frame::Fetch { req: 1, first_index: 0, blocks: vec![BlockSpan::single(0, 0, 0)] }.to_vec();
    b[HEADER_LEN + 12..HEADER_LEN + 16].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(Frame::decode_message(&b, &limits), Err(FrameError::Malformed { .. })));
    // Too many blocks.
    let f = Frame::Fetch { req: 1, first_index: 0, blocks: vec![BlockSpan::single(0, 0, 0); 5] };
    let roomy = Limits { max_control: 4096, ..limits };
    assert!(matches!(Frame::decode_message(&f.to_vec(), &roomy), Err(FrameError::Malformed { .. })));
}

#[test]
fn an_unlimited_pull_limit_does_not_overflow() {
    // Found by the frame_decode fuzz target: `16 + max_pull` overflowed for u64::MAX.
    let limits = Limits { max_pull: u64::MAX, ..Limits::default() };
    let b = Frame::PullData { region: 1, offset: 0, len: 100 }.to_vec();
    let h = Header::decode(&b, &limits).unwrap();
    assert_eq!((h.kind, h.payload_len()), (FrameKind::PullData, 100));
    let mut b = Frame::PullData { region: 1, offset: 0, len: u32::MAX as u64 - 16 }.to_vec();
    b.resize(HEADER_LEN + 16 + 3, 0);
    assert!(matches!(Frame::decode_message(&b, &limits), Err(FrameError::Truncated { .. })));
}

#[test]
fn encoding_a_huge_payload_length_saturates_instead_of_overflowing() {
    // Found by the handshake fuzz target: `encode` is documented never to panic, but
    // `fixed + payload_len` overflowed for a PullData len near u64::MAX.
    let b = Frame::PullData { region: 1, offset: 0, len: u64::MAX }.to_vec();
    assert_eq!(&b[8..12], &u32::MAX.to_be_bytes());
    let h = Header::decode(&b, &Limits { max_pull: u64::MAX, ..Limits::default() }).unwrap();
    assert_eq!(h.payload_len(), u32::MAX as u64 - 16);
    assert!(matches!(Header::decode(&b, &Limits::default()), Err(FrameError::TooLong { kind: FrameKind::PullData, .. })));
}

#[test]
fn truncated_messages_are_errors_at_every_cut() {
    let limits = Limits::default();
    for f in sample_frames() {
        let mut buf = f.to_vec();
        buf.extend(std::iter::repeat_n(7, f.payload_len() as usize));
        for cut in 0..buf.len() {
            assert!(Frame::decode_message(&buf[..cut], &limits).is_err(), "{f:?} cut at {cut}");
        }
    }
}

#[test]
fn app_ids_and_attach_data_are_bounded() {
    let limits = Limits::default();
    let long = Frame::Hello {
        min_version: 3,
        max_version: 3,
        caps: 0,
        nonce: [0; 16],
        max_eager: 1,
        app_id: "a".repeat(MAX_APP_ID_LEN + 10),
    };
    // Encoding cuts; a peer that writes the length by hand is refused.
    let (g, _) = Frame::decode_message(&long.to_vec(), &limits).unwrap();
    assert!(matches!(g, Frame::Hello { app_id, .. } if app_id.len() == MAX_APP_ID_LEN));
    let mut b = Frame::Attach { data: vec![1; 8] }.to_vec();
    b[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&((MAX_ATTACH_LEN + 1) as u16).to_be_bytes());
    b.resize(HEADER_LEN + 2 + MAX_ATTACH_LEN + 1, 0);
    let body_len = (b.len() - HEADER_LEN) as u32;
    b[8..12].copy_from_slice(&body_len.to_be_bytes());
    assert!(matches!(Frame::decode_message(&b, &limits), Err(FrameError::Malformed { kind: FrameKind::Attach, .. })));
}

#[test]
fn message_strings_are_bounded_and_cut_on_char_boundaries() {
    let long = "é".repeat(MAX_MESSAGE_LEN);
    let f = Frame::Error { code: FailureCode::Other, message: long };
    let (g, _) = Frame::decode_message(&f.to_vec(), &Limits::default()).unwrap();
    match g {
        Frame::Error { message, .. } => assert!(message.len() <= MAX_MESSAGE_LEN && message.chars().all(|c| c == 'é')),
        other => panic!("unexpected {other:?}"),
    }
}

/// A `FetchRange` of one entry with `offset` and `len` written by hand (a peer that does not
/// use this encoder).
fn raw_range(offset: u64, len: u64) -> Vec<u8> {
    let f = Frame::FetchRange {
        req: 1,
        first_index: 0,
        ranges: vec![BlockRange { span: BlockSpan::single(1, 2, 3), offset: 0, len: 0 }],
    };
    let mut b = f.to_vec();
    let at = HEADER_LEN + 16 + BlockSpan::ENCODED_LEN;
    b[at..at + 8].copy_from_slice(&offset.to_be_bytes());
    b[at + 8..at + 16].copy_from_slice(&len.to_be_bytes());
    b
}

#[test]
fn range_lengths_are_bounded_and_ends_cannot_overflow() {
    let limits = Limits::default();
    let (f, _) = Frame::decode_message(&raw_range(5 << 30, MAX_RANGE_LEN), &limits).unwrap();
    assert!(matches!(f, Frame::FetchRange { ref ranges, .. } if ranges[0].offset == 5 << 30 && ranges[0].len == MAX_RANGE_LEN));
    // One byte over 2 GiB - 1 per range: refused before anything is resolved.
    let e = Frame::decode_message(&raw_range(0, MAX_RANGE_LEN + 1), &limits).unwrap_err();
    assert!(matches!(&e, FrameError::Malformed { kind: FrameKind::FetchRange, what } if what.contains("per range")), "{e}");
    // offset + len past u64::MAX.
    let e = Frame::decode_message(&raw_range(u64::MAX - 10, 11), &limits).unwrap_err();
    assert!(matches!(&e, FrameError::Malformed { kind: FrameKind::FetchRange, what } if what.contains("overflows")), "{e}");
    // A count that disagrees with the body, and too many entries.
    let mut b = raw_range(0, 1);
    b[HEADER_LEN + 12..HEADER_LEN + 16].copy_from_slice(&2u32.to_be_bytes());
    assert!(matches!(Frame::decode_message(&b, &limits), Err(FrameError::Malformed { .. })));
    let r = BlockRange { span: BlockSpan::single(0, 0, 0), offset: 0, len: 1 };
    let f = Frame::FetchRange { req: 1, first_index: 0, ranges: vec![r; 5] };
    let few = Limits { max_blocks_per_fetch: 4, ..limits };
    assert!(matches!(Frame::decode_message(&f.to_vec(), &few), Err(FrameError::Malformed { .. })));
    // Indices that overflow u32.
    let f = Frame::FetchRange { req: 1, first_index: u32::MAX, ranges: vec![r; 2] };
    assert!(matches!(Frame::decode_message(&f.to_vec(), &limits), Err(FrameError::Malformed { .. })));
}

#[test]
fn a_rendezvous_region_longer_than_its_block_is_refused() {
    let d = Descriptor { region: 1, addr: 0, len: 100, rkey: 0 };
    let ok = Frame::Rendezvous { req: 1, index: 0, desc: d, block_len: 100 };
    assert_eq!(Frame::decode_message(&ok.to_vec(), &Limits::default()).unwrap().0, ok);
    let bad = Frame::Rendezvous { req: 1, index: 0, desc: d, block_len: 99 };
    let e = Frame::decode_message(&bad.to_vec(), &Limits::default()).unwrap_err();
    assert!(matches!(e, FrameError::Malformed { kind: FrameKind::Rendezvous, .. }), "{e}");
}

#[test]
fn version_2_frames_are_refused() {
    let mut b = Frame::Credit { n: 1 }.to_vec();
    b[4] = 2;
    let e = Header::decode(&b, &Limits::default()).unwrap_err();
    assert_eq!(e, FrameError::UnsupportedVersion { found: 2, min: 3, max: 3 });
}
