//! The mesh's own frames, and the codec the fabric's links cut them with.
//!
//! Every frame starts with a 24-byte header: the magic `MOB1`, a kind byte, three reserved
//! zero bytes, a tag and a length (both big-endian `u64`).
//!
//! * Control frames (the handshake, `RTS`, `DONE`, `ABORT`, `BYE`, a provider's `ATTACH`
//!   record) carry a body of `len` bytes inside their fixed part, at most [`CONTROL_MAX`].
//! * `DATA` (an eager message) and `BULK` (a rendezvous message streamed on tcp) are followed
//!   by a payload of `len` bytes, which the link places where the mesh says (a pool buffer,
//!   or the receive posted for it).
//!
//! Until the handshake authenticated the peer, every length is bounded by [`CONTROL_MAX`]: a
//! stranger cannot make a link read more than a handshake's worth of bytes.

use super::{Tag, CONTROL_MAX};
use rdma_shuffle_fabric::driver::{Codec, CodecError, FrameShape};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// First bytes of every mesh frame ("MOB1").
const MAGIC: u32 = 0x4d4f_4231;
/// Bytes of a mesh frame's header.
pub(crate) const HEADER_LEN: usize = 24;

/// A mesh frame's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// Connecting rank → accepting rank: who it is, a nonce.
    Hello = 1,
    /// The answer: the accepting rank's nonce and fields.
    Welcome = 2,
    /// The connecting rank's proof of the job's secret.
    Proof = 3,
    /// The accepting rank accepted the proof: the link is authenticated.
    Ready = 4,
    /// Either side refuses the connection, with the reason.
    Refuse = 5,
    /// A provider's data-plane bootstrap record (verbs queue pair numbers).
    Attach = 6,
    /// An eager message: the payload follows.
    Data = 16,
    /// A rendezvous message's descriptor (one-sided providers): the peer reads it.
    Rts = 17,
    /// A rendezvous message was read: the sender's memory is its own again.
    Done = 18,
    /// The rank gave up (the body says why).
    Abort = 19,
    /// The rank closes its mesh cleanly.
    Bye = 20,
    /// A rendezvous message streamed (tcp): the payload follows.
    Bulk = 21,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Welcome,
            3 => Proof,
            4 => Ready,
            5 => Refuse,
            6 => Attach,
            16 => Data,
            17 => Rts,
            18 => Done,
            19 => Abort,
            20 => Bye,
            21 => Bulk,
            _ => return None,
        })
    }

    /// Whether a payload follows the fixed part.
    fn has_payload(self) -> bool {
        matches!(self, Kind::Data | Kind::Bulk)
    }
}

/// A decoded mesh frame's fixed part: its kind, tag and length (a control frame's body is
/// in `body`; a data frame's payload, of `len` bytes, follows).
#[derive(Debug)]
pub(crate) struct Head<'a> {
    pub(crate) kind: Kind,
    pub(crate) tag: Tag,
    pub(crate) len: u64,
    pub(crate) body: &'a [u8],
}

/// What is wrong with a frame a peer sent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MeshFrameError {
    #[error("bad magic 0x{0:08x} (expected 0x{MAGIC:08x}): the peer is not a Mobius rank")]
    BadMagic(u32),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("reserved bytes 0x{0:06x} set")]
    Reserved(u32),
    #[error("a {kind:?} frame of {len} bytes, above the limit of {max}")]
    TooLong { kind: Kind, len: u64, max: u64 },
    #[error("a frame of {have} bytes, its header says {want}")]
    Length { have: usize, want: u64 },
}

/// Decodes a header (the first [`HEADER_LEN`] bytes of `buf`), bounding the length by
/// `limit(kind)`.
fn header(buf: &[u8], limit: impl Fn(Kind) -> u64) -> Result<(Kind, Tag, u64), MeshFrameError> {
    let word = |at: usize| u64::from_be_bytes(buf[at..at + 8].try_into().unwrap_or_default());
    if buf.len() < HEADER_LEN {
        return Err(MeshFrameError::Length { have: buf.len(), want: HEADER_LEN as u64 });
    }
    let magic = u32::from_be_bytes(buf[0..4].try_into().unwrap_or_default());
    if magic != MAGIC {
        return Err(MeshFrameError::BadMagic(magic));
    }
    let kind = Kind::from_u8(buf[4]).ok_or(MeshFrameError::UnknownKind(buf[4]))?;
    let reserved = u32::from_be_bytes([0, buf[5], buf[6], buf[7]]);
    if reserved != 0 {
        return Err(MeshFrameError::Reserved(reserved));
    }
    let (tag, len) = (word(8), word(16));
    let max = limit(kind);
    if len > max {
        return Err(MeshFrameError::TooLong { kind, len, max });
    }
    Ok((kind, tag, len))
}

/// The fixed part of a frame: its header, and a control frame's `body`. A data frame's
/// payload of `len` bytes goes after it (`body` is empty then).
pub(crate) fn encode(kind: Kind, tag: Tag, len: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC.to_be_bytes());
    out.extend_from_slice(&[kind as u8, 0, 0, 0]);
    out.extend_from_slice(&tag.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// A control frame with `body`.
pub(crate) fn control(kind: Kind, tag: Tag, body: &[u8]) -> Vec<u8> {
    encode(kind, tag, body.len() as u64, body)
}

/// The codec of one mesh link: bounded to handshake sizes until [`up`](MeshCodec::up).
pub(crate) struct MeshCodec {
    up: AtomicBool,
    eager_limit: u64,
    max_message: u64,
}

impl MeshCodec {
    pub(crate) fn new(eager_limit: usize, max_message: usize) -> Arc<MeshCodec> {
        Arc::new(MeshCodec { up: AtomicBool::new(false), eager_limit: eager_limit as u64, max_message: max_message as u64 })
    }

    /// The peer authenticated: data frames of every size the mesh allows may come.
    pub(crate) fn up(&self) {
        self.up.store(true, Ordering::Relaxed);
    }

    fn limit(&self, kind: Kind) -> u64 {
        if !self.up.load(Ordering::Relaxed) {
            return CONTROL_MAX as u64;
        }
        match kind {
            Kind::Data => self.eager_limit,
            Kind::Bulk => self.max_message,
            _ => CONTROL_MAX as u64,
        }
    }

    /// A whole fixed part, as a link handed it over.
    pub(crate) fn decode<'a>(&self, head: &'a [u8]) -> Result<Head<'a>, MeshFrameError> {
        let (kind, tag, len) = header(head, |k| self.limit(k))?;
        let want = if kind.has_payload() { HEADER_LEN as u64 } else { HEADER_LEN as u64 + len };
        if head.len() as u64 != want {
            return Err(MeshFrameError::Length { have: head.len(), want });
        }
        Ok(Head { kind, tag, len, body: &head[HEADER_LEN..] })
    }
}

impl Codec for MeshCodec {
    fn header_len(&self) -> usize {
        HEADER_LEN
    }

    fn shape(&self, buf: &[u8]) -> Result<FrameShape, CodecError> {
        let (kind, _, len) = header(buf, |k| self.limit(k))?;
        Ok(if kind.has_payload() {
            FrameShape { head: HEADER_LEN, payload: Some(len) }
        } else {
            FrameShape { head: HEADER_LEN + len as usize, payload: None }
        })
    }

    fn attach_frame(&self, record: &[u8]) -> Vec<u8> {
        control(Kind::Attach, 0, record)
    }

    fn attach_record(&self, head: &[u8]) -> Option<Vec<u8>> {
        match self.decode(head) {
            Ok(Head { kind: Kind::Attach, body, .. }) => Some(body.to_vec()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_lengths_are_bounded_until_the_link_is_up() {
        let c = MeshCodec::new(64 << 10, 1 << 30);
        let hello = control(Kind::Hello, 7, b"rank 3");
        let shape = c.shape(&hello[..HEADER_LEN]).unwrap();
        assert_eq!(shape, FrameShape { head: HEADER_LEN + 6, payload: None });
        let h = c.decode(&hello).unwrap();
        assert_eq!((h.kind, h.tag, h.body), (Kind::Hello, 7, &b"rank 3"[..]));

        let data = encode(Kind::Data, 9, 10_000, &[]);
        let err = c.shape(&data).unwrap_err().to_string();
        assert!(err.contains("above the limit of 4096"), "{err}");
        c.up();
        assert_eq!(c.shape(&data).unwrap(), FrameShape { head: HEADER_LEN, payload: Some(10_000) });
        let big = encode(Kind::Data, 9, (64 << 10) + 1, &[]);
        assert!(c.shape(&big).is_err());

        let mut bad = hello.clone();
        bad[0] = b'X';
        assert!(c.shape(&bad).unwrap_err().to_string().contains("not a Mobius rank"));
        let mut bad = hello.clone();
        bad[4] = 99;
        assert!(c.shape(&bad).unwrap_err().to_string().contains("unknown frame kind 99"));
        let mut bad = hello.clone();
        bad[6] = 1;
        assert!(c.shape(&bad).is_err());
        // A fixed part longer than its header says is refused, not read past.
        let mut long = hello.clone();
        long.push(0);
        assert!(c.decode(&long).is_err());
        assert_eq!(c.attach_record(&c.attach_frame(b"qpn")), Some(b"qpn".to_vec()));
        assert_eq!(c.attach_record(&hello), None);
    }
}
