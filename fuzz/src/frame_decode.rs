//! The `frame_decode` harness: arbitrary bytes through the decoder.
//!
//! Asserted for the default limits, [`TIGHT`] limits, and limits taken from the first 20
//! input bytes (so extreme settings are covered too):
//!
//! - neither [`Header::decode`] nor [`Frame::decode_message`] panics;
//! - a header error is exactly the error `decode_message` reports;
//! - a decoded header is consistent: its length is within the limit for its kind, and the
//!   fixed part plus the payload is the whole body;
//! - the stream path (header, then [`Frame::decode_body`] on the fixed part) agrees with
//!   `decode_message` whenever the input is exactly one message;
//! - a decoded message re-encodes to the same bytes (modulo failure codes this build does not
//!   know, which decode to [`FailureCode::Other`]), and decodes again to the same frame;
//! - whatever tight limits accept, the defaults accept identically.

use crate::frames::TIGHT;
use wire::frame::{Header, HEADER_LEN};
use wire::{FailureCode, Frame, FrameKind, Limits};

/// Runs every check on `data`.
pub fn run(data: &[u8]) {
    let default = check(data, &Limits::default());
    let tight = check(data, &TIGHT);
    if let Some(t) = tight {
        assert_eq!(default, Some(t), "tight limits accepted what the defaults refuse");
    }
    if data.len() >= 20 {
        let (l, msg) = data.split_at(20);
        let limits = Limits {
            max_control: u32::from_be_bytes([l[0], l[1], l[2], l[3]]),
            max_eager: u32::from_be_bytes([l[4], l[5], l[6], l[7]]),
            max_pull: u64::from_be_bytes([l[8], l[9], l[10], l[11], l[12], l[13], l[14], l[15]]),
            max_blocks_per_fetch: u32::from_be_bytes([l[16], l[17], l[18], l[19]]),
        };
        check(msg, &limits);
    }
}

/// Decodes `data` under `limits` every way the crate offers and checks they agree. Returns the
/// decoded message, if any.
fn check(data: &[u8], limits: &Limits) -> Option<(Frame, usize)> {
    let header = Header::decode(data, limits);
    let message = Frame::decode_message(data, limits);
    let h = match header {
        Ok(h) => h,
        Err(e) => {
            assert_eq!(message, Err(e), "decode_message must fail as its header does");
            return None;
        }
    };
    let max = match h.kind {
        FrameKind::Eager => 12 + limits.max_eager as u64,
        FrameKind::PullData => 16u64.saturating_add(limits.max_pull),
        _ => limits.max_control as u64,
    };
    assert!(h.body_len <= max, "{h:?} passed a limit of {max}");
    assert_eq!(h.fixed_len() as u64 + h.payload_len(), h.body_len, "{h:?}");

    // The stream path: what a tcp driver decodes before reading the payload.
    let fixed_end = HEADER_LEN + h.fixed_len();
    if data.len() >= fixed_end {
        let streamed = Frame::decode_body(&h, &data[HEADER_LEN..fixed_end], limits);
        if data.len() as u64 == HEADER_LEN as u64 + h.body_len {
            assert_eq!(streamed.clone().map(|f| (f, fixed_end)), message, "stream and message decoding disagree");
        }
        if let Ok(f) = &streamed {
            assert_eq!(f.kind(), h.kind);
            assert_eq!(f.payload_len(), h.payload_len());
        }
    }

    let (frame, offset) = message.ok()?;
    assert_eq!(offset, fixed_end);
    assert_eq!((data.len() - offset) as u64, frame.payload_len(), "{frame:?}: payload length");

    let encoded = frame.to_vec();
    assert_eq!(encoded, normalised(&data[..offset], &frame), "{frame:?} does not re-encode to its bytes");
    let mut again = encoded;
    again.extend_from_slice(&data[offset..]);
    assert_eq!(Frame::decode_message(&again, limits), Ok((frame.clone(), offset)), "re-encoded frame decodes differently");
    Some((frame, offset))
}

/// `bytes` with an unknown failure code replaced by the one it decodes to, so that the
/// re-encoding of the decoded frame can be compared byte for byte.
fn normalised(bytes: &[u8], frame: &Frame) -> Vec<u8> {
    let mut v = bytes.to_vec();
    let at = match frame {
        Frame::BlockFailed { code: FailureCode::Other, .. } => Some(HEADER_LEN + 12),
        Frame::Error { code: FailureCode::Other, .. } => Some(HEADER_LEN),
        _ => None,
    };
    if let Some(at) = at {
        v[at..at + 2].copy_from_slice(&FailureCode::Other.to_u16().to_be_bytes());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frames::sample_frames;

    #[test]
    fn every_sample_frame_passes_with_its_payload_and_cut_short() {
        for f in sample_frames() {
            let mut b = f.to_vec();
            b.resize(b.len() + f.payload_len() as usize, 0x5a);
            assert!(check(&b, &Limits::default()).is_some(), "{f:?}");
            run(&b);
            for cut in 0..b.len() {
                run(&b[..cut]);
            }
        }
    }

    #[test]
    fn unknown_failure_codes_are_normalised_not_reported() {
        let mut b = Frame::Error { code: FailureCode::Io, message: "m".into() }.to_vec();
        b[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&0x4242u16.to_be_bytes());
        let (f, _) = check(&b, &Limits::default()).expect("decodes");
        assert_eq!(f, Frame::Error { code: FailureCode::Other, message: "m".into() });
    }
}
