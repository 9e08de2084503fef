//! Structured frames from fuzz input, their writer for seeds, and codec helpers shared by the
//! harnesses.

use crate::cursor::{Cursor, Writer};
use wire::frame::{Header, HEADER_LEN, MAX_APP_ID_LEN, MAX_ATTACH_LEN, MAX_MESSAGE_LEN};
use wire::{BlockRange, BlockSpan, Descriptor, FailureCode, Frame, FrameError, FrameKind, Limits};

/// Small limits, all at or below [`Limits::default`], so that every bound in the codec is
/// reachable by short inputs and "accepted under tight limits" implies "accepted under the
/// defaults".
pub const TIGHT: Limits = Limits { max_control: 256, max_eager: 4096, max_pull: 65536, max_blocks_per_fetch: 4 };

/// Reads one frame of any kind, every field chosen by the input. The frame need not be valid
/// on the wire (an empty `Fetch`, a huge `PullData`): callers send it through the codec.
pub fn read_frame(c: &mut Cursor<'_>) -> Frame {
    let kind = FrameKind::from_u8(c.u8() % 15 + 1).unwrap_or(FrameKind::Error);
    match kind {
        FrameKind::Hello => Frame::Hello {
            min_version: c.u8(),
            max_version: c.u8(),
            caps: c.u64(),
            nonce: c.array(),
            max_eager: c.u32(),
            app_id: String::from_utf8_lossy(c.blob()).into_owned(),
        },
        FrameKind::Challenge => Frame::Challenge {
            version: c.u8(),
            caps: c.u64(),
            nonce: c.array(),
            auth_required: c.u8() & 1 == 1,
            credits: c.u32(),
            eager_threshold: c.u32(),
            app_id: String::from_utf8_lossy(c.blob()).into_owned(),
        },
        FrameKind::Auth => Frame::Auth { proof: read_proof(c) },
        FrameKind::Ready => Frame::Ready { proof: read_proof(c), credits: c.u32() },
        FrameKind::Attach => Frame::Attach { data: c.blob().to_vec() },
        FrameKind::Fetch => {
            let req = c.u64();
            let first_index = c.u32();
            let count = c.u8() as usize;
            let blocks =
                (0..count).map(|_| BlockSpan { group: c.u32(), object: c.u64(), start: c.u32(), end: c.u32() }).collect();
            Frame::Fetch { req, first_index, blocks }
        }
        FrameKind::FetchRange => {
            let req = c.u64();
            let first_index = c.u32();
            let count = c.u8() as usize;
            let ranges = (0..count)
                .map(|_| BlockRange {
                    span: BlockSpan { group: c.u32(), object: c.u64(), start: c.u32(), end: c.u32() },
                    offset: c.u64(),
                    len: c.u64(),
                })
                .collect();
            Frame::FetchRange { req, first_index, ranges }
        }
        FrameKind::Eager => Frame::Eager { req: c.u64(), index: c.u32(), len: c.u32() },
        FrameKind::Rendezvous => Frame::Rendezvous {
            req: c.u64(),
            index: c.u32(),
            desc: Descriptor { region: c.u64(), addr: c.u64(), len: c.u64(), rkey: c.u32() },
            block_len: c.u64(),
        },
        FrameKind::BlockFailed => Frame::BlockFailed {
            req: c.u64(),
            index: c.u32(),
            code: FailureCode::from_u16(c.u16()),
            message: String::from_utf8_lossy(c.blob()).into_owned(),
        },
        FrameKind::Pull => Frame::Pull { region: c.u64(), offset: c.u64(), len: c.u64() },
        FrameKind::PullData => Frame::PullData { region: c.u64(), offset: c.u64(), len: c.u64() },
        FrameKind::Release => Frame::Release { region: c.u64() },
        FrameKind::Credit => Frame::Credit { n: c.u32() },
        FrameKind::Error => {
            Frame::Error { code: FailureCode::from_u16(c.u16()), message: String::from_utf8_lossy(c.blob()).into_owned() }
        }
    }
}

fn write_proof(w: &mut Writer, proof: &Option<[u8; 32]>) {
    match proof {
        Some(p) => {
            w.u8(1).bytes(p);
        }
        None => {
            w.u8(0);
        }
    }
}

fn read_proof(c: &mut Cursor<'_>) -> Option<[u8; 32]> {
    if c.u8() & 1 == 1 {
        Some(c.array())
    } else {
        None
    }
}

/// Writes `f` so that [`read_frame`] reads it back (for seeds). `Fetch` lists are cut at 255
/// blocks, the most [`read_frame`] reads.
pub fn write_frame(w: &mut Writer, f: &Frame) {
    w.u8(f.kind() as u8 - 1);
    match f {
        Frame::Hello { min_version, max_version, caps, nonce, max_eager, app_id } => {
            w.u8(*min_version).u8(*max_version).u64(*caps).bytes(nonce).u32(*max_eager).blob(app_id.as_bytes());
        }
        Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold, app_id } => {
            w.u8(*version)
                .u64(*caps)
                .bytes(nonce)
                .u8(*auth_required as u8)
                .u32(*credits)
                .u32(*eager_threshold)
                .blob(app_id.as_bytes());
        }
        Frame::Auth { proof } => write_proof(w, proof),
        Frame::Ready { proof, credits } => {
            write_proof(w, proof);
            w.u32(*credits);
        }
        Frame::Attach { data } => {
            w.blob(data);
        }
        Frame::Fetch { req, first_index, blocks } => {
            let blocks = &blocks[..blocks.len().min(255)];
            w.u64(*req).u32(*first_index).u8(blocks.len() as u8);
            for b in blocks {
                w.u32(b.group).u64(b.object).u32(b.start).u32(b.end);
            }
        }
        Frame::FetchRange { req, first_index, ranges } => {
            let ranges = &ranges[..ranges.len().min(255)];
            w.u64(*req).u32(*first_index).u8(ranges.len() as u8);
            for r in ranges {
                let b = &r.span;
                w.u32(b.group).u64(b.object).u32(b.start).u32(b.end).u64(r.offset).u64(r.len);
            }
        }
        Frame::Eager { req, index, len } => {
            w.u64(*req).u32(*index).u32(*len);
        }
        Frame::Rendezvous { req, index, desc, block_len } => {
            w.u64(*req).u32(*index).u64(desc.region).u64(desc.addr).u64(desc.len).u32(desc.rkey).u64(*block_len);
        }
        Frame::BlockFailed { req, index, code, message } => {
            w.u64(*req).u32(*index).u16(code.to_u16()).blob(message.as_bytes());
        }
        Frame::Pull { region, offset, len } | Frame::PullData { region, offset, len } => {
            w.u64(*region).u64(*offset).u64(*len);
        }
        Frame::Release { region } => {
            w.u64(*region);
        }
        Frame::Credit { n } => {
            w.u32(*n);
        }
        Frame::Error { code, message } => {
            w.u16(code.to_u16()).blob(message.as_bytes());
        }
    }
}

/// One valid frame of every kind (the wire crate's fixtures).
pub use wire::frame::sample_frames;

/// Encodes `f` (header and fixed part) and decodes it the way a stream driver does: header
/// first, then the fixed part; the payload is never materialised, only its length checked.
/// Returns what the peer would see.
pub fn through_codec(f: &Frame, limits: &Limits) -> Result<Frame, FrameError> {
    let bytes = f.to_vec();
    let header = Header::decode(&bytes, limits)?;
    let fixed_end = HEADER_LEN + header.fixed_len();
    // The encoder writes exactly the header and the fixed part, and the header it writes
    // must say so (control frames' bodies are far below u32::MAX, so nothing saturates).
    assert_eq!(bytes.len(), fixed_end, "{f:?}: the header disagrees with the bytes written");
    let g = Frame::decode_body(&header, &bytes[HEADER_LEN..fixed_end], limits)?;
    assert_eq!(header.payload_len(), g.payload_len(), "{g:?}: header and frame disagree on the payload");
    Ok(g)
}

/// Whether `received` is what the codec makes of `sent`: equal, except that messages longer
/// than [`MAX_MESSAGE_LEN`] and application ids longer than [`MAX_APP_ID_LEN`] are cut on a
/// char boundary, and attach data longer than [`MAX_ATTACH_LEN`] is cut.
pub fn same_after_codec(sent: &Frame, received: &Frame) -> bool {
    fn cut_ok(a: &str, b: &str, max: usize) -> bool {
        a == b || (a.len() > max && b.len() <= max && a.starts_with(b) && max - b.len() < 4)
    }
    match (sent, received) {
        (Frame::Error { code: c1, message: m1 }, Frame::Error { code: c2, message: m2 }) => {
            c1 == c2 && cut_ok(m1, m2, MAX_MESSAGE_LEN)
        }
        (
            Frame::BlockFailed { req: r1, index: i1, code: c1, message: m1 },
            Frame::BlockFailed { req: r2, index: i2, code: c2, message: m2 },
        ) => (r1, i1, c1) == (r2, i2, c2) && cut_ok(m1, m2, MAX_MESSAGE_LEN),
        (
            Frame::Hello { min_version: a1, max_version: b1, caps: c1, nonce: n1, max_eager: e1, app_id: i1 },
            Frame::Hello { min_version: a2, max_version: b2, caps: c2, nonce: n2, max_eager: e2, app_id: i2 },
        ) => (a1, b1, c1, n1, e1) == (a2, b2, c2, n2, e2) && cut_ok(i1, i2, MAX_APP_ID_LEN),
        (
            Frame::Challenge {
                version: v1,
                caps: c1,
                nonce: n1,
                auth_required: a1,
                credits: r1,
                eager_threshold: e1,
                app_id: i1,
            },
            Frame::Challenge {
                version: v2,
                caps: c2,
                nonce: n2,
                auth_required: a2,
                credits: r2,
                eager_threshold: e2,
                app_id: i2,
            },
        ) => (v1, c1, n1, a1, r1, e1) == (v2, c2, n2, a2, r2, e2) && cut_ok(i1, i2, MAX_APP_ID_LEN),
        (Frame::Attach { data: d1 }, Frame::Attach { data: d2 }) => {
            d1 == d2 || (d1.len() > MAX_ATTACH_LEN && d1[..MAX_ATTACH_LEN] == d2[..])
        }
        _ => sent == received,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_frames_read_back_identically() {
        for f in sample_frames() {
            let mut w = Writer::new();
            write_frame(&mut w, &f);
            let mut c = Cursor::new(&w.buf);
            assert_eq!(read_frame(&mut c), f);
            assert!(c.is_empty(), "{f:?}: reader left bytes");
        }
    }

    #[test]
    fn sample_frames_survive_the_codec_and_cover_every_kind() {
        let mut kinds: Vec<u8> = sample_frames().iter().map(|f| f.kind() as u8).collect();
        kinds.dedup();
        assert_eq!(kinds, (1..=15).collect::<Vec<_>>());
        for f in sample_frames() {
            assert_eq!(through_codec(&f, &Limits::default()), Ok(f.clone()));
        }
        // Long messages are cut, and `same_after_codec` accepts exactly that.
        let long = Frame::Error { code: FailureCode::Io, message: "x".repeat(MAX_MESSAGE_LEN + 10) };
        let got = through_codec(&long, &Limits::default()).unwrap();
        assert_ne!(got, long);
        assert!(same_after_codec(&long, &got));
        assert!(!same_after_codec(&long, &Frame::Error { code: FailureCode::Io, message: "x".into() }));
    }
}
