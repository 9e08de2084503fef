//! Sample frames (tests and the `samples` feature).

use super::{Frame, MAX_RANGE_LEN};

/// One valid frame of every kind, in kind order (and both forms of the optional proofs, and
/// extreme field values): the fixtures of the codec tests and the fuzzers' seeds. Built for
/// tests and with the `samples` feature only.
pub fn sample_frames() -> Vec<Frame> {
    use crate::{BlockRange, BlockSpan, Descriptor, FailureCode};
    vec![
        Frame::Hello {
            min_version: 3,
            max_version: 3,
            caps: crate::caps::ALL,
            nonce: [3; 16],
            max_eager: 65536,
            app_id: "app-20260101000000-0001".into(),
        },
        Frame::Challenge {
            version: 3,
            caps: 5,
            nonce: [9; 16],
            auth_required: true,
            credits: 64,
            eager_threshold: 32768,
            app_id: "app-20260101000000-0001".into(),
        },
        Frame::Auth { proof: Some([1; 32]) },
        Frame::Auth { proof: None },
        Frame::Ready { proof: Some([2; 32]), credits: 16 },
        Frame::Ready { proof: None, credits: u32::MAX },
        Frame::Fetch {
            req: 42,
            first_index: 7,
            blocks: vec![BlockSpan::single(1, 2, 3), BlockSpan { group: 4, object: u64::MAX, start: 0, end: 9 }],
        },
        Frame::Eager { req: 1, index: 2, len: 100 },
        Frame::Rendezvous {
            req: 1,
            index: 0,
            desc: Descriptor { region: 5, addr: 0xdead, len: 1 << 20, rkey: 77 },
            block_len: 5 << 30,
        },
        Frame::BlockFailed { req: 3, index: 1, code: FailureCode::Corrupt, message: "bad index é".into() },
        Frame::Pull { region: 5, offset: 10, len: 20 },
        Frame::PullData { region: 5, offset: 10, len: 20 },
        Frame::Release { region: 5 },
        Frame::Credit { n: 3 },
        Frame::Error { code: FailureCode::AuthRefused, message: "no".into() },
        Frame::Attach { data: vec![0xa5; 44] },
        Frame::Attach { data: Vec::new() },
        Frame::FetchRange {
            req: 43,
            first_index: 0,
            ranges: vec![
                BlockRange { span: BlockSpan::single(1, 2, 3), offset: 0, len: 0 },
                BlockRange { span: BlockSpan { group: 4, object: 5, start: 0, end: 9 }, offset: 3 << 30, len: 4 << 20 },
                BlockRange { span: BlockSpan::single(1, 2, 3), offset: u64::MAX - MAX_RANGE_LEN, len: MAX_RANGE_LEN },
            ],
        },
    ]
}
