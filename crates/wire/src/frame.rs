//! Frames and their codec.
//!
//! Every frame starts with a 12-byte header, all integers big-endian:
//!
//! ```text
//!  0      4        5     6       8          12
//!  | magic | version | kind | flags | body_len | body ...
//! ```
//!
//! `body_len` is bounded before anything is allocated: control frames by
//! [`Limits::max_control`], eager payloads by [`Limits::max_eager`], pull payloads by
//! [`Limits::max_pull`]. Two kinds carry a *payload* after a fixed part: `Eager` (a small
//! block inline) and `PullData` (a rendezvous region streamed over tcp). Decoding reads the
//! header and fixed part only, so a stream provider can read the payload straight into a
//! pool buffer (or a message provider can hand over the receive buffer itself).

use crate::block::{BlockSpan, Descriptor, FailureCode, RegionId};
use crate::{MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use std::fmt;
use thiserror::Error;

/// `"RDSH"`: the first four bytes of every frame.
pub const MAGIC: u32 = 0x5244_5348;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 12;
/// Upper bound on the text of an error message carried on the wire.
pub const MAX_MESSAGE_LEN: usize = 4096;
/// Largest payload of one `PullData` frame; servers split longer pulls into chunks of this
/// size so a single length read from the wire never asks for more.
pub const MAX_PULL_CHUNK: u64 = 16 * 1024 * 1024;
/// Length of handshake nonces.
pub const NONCE_LEN: usize = 16;
/// Length of an authentication proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;
/// Upper bound on the application id carried in the handshake.
pub const MAX_APP_ID_LEN: usize = 256;
/// Upper bound on the provider bytes of an `Attach` frame.
pub const MAX_ATTACH_LEN: usize = 512;

/// Bounds applied to every length read from the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest body of a frame without payload (handshake, requests, control).
    pub max_control: u32,
    /// Largest eager payload accepted.
    pub max_eager: u32,
    /// Largest pull payload accepted in one `PullData` frame.
    pub max_pull: u64,
    /// Most blocks in one `Fetch` frame.
    pub max_blocks_per_fetch: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_control: 256 * 1024, max_eager: 1024 * 1024, max_pull: MAX_PULL_CHUNK, max_blocks_per_fetch: 8192 }
    }
}

/// Frame kinds. The numeric values are the wire encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Client → server: versions, capabilities, nonce.
    Hello = 1,
    /// Server → client: chosen version, capabilities, nonce, limits, credits.
    Challenge = 2,
    /// Client → server: proof of the shared secret (empty when auth is off).
    Auth = 3,
    /// Server → client: handshake done, with the server's proof.
    Ready = 4,
    /// Client → server: request a list of blocks.
    Fetch = 5,
    /// Server → client: one block inline (payload follows).
    Eager = 6,
    /// Server → client: a descriptor of a registered region holding one block.
    Rendezvous = 7,
    /// Server → client: one block failed.
    BlockFailed = 8,
    /// Client → server (tcp): stream me a range of a rendezvous region.
    Pull = 9,
    /// Server → client (tcp): a range of a region (payload follows).
    PullData = 10,
    /// Client → server: done with a rendezvous region.
    Release = 11,
    /// Server → client: the client may have `n` more blocks in flight.
    Credit = 12,
    /// Either way: fatal error, the sender closes the connection.
    Error = 13,
    /// Either way, after the handshake: a provider's data-plane bootstrap (verbs: queue pair
    /// numbers and addresses), opaque to the protocol.
    Attach = 14,
}

impl FrameKind {
    /// From the wire byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        use FrameKind::*;
        Some(match v {
            1 => Hello,
            2 => Challenge,
            3 => Auth,
            4 => Ready,
            5 => Fetch,
            6 => Eager,
            7 => Rendezvous,
            8 => BlockFailed,
            9 => Pull,
            10 => PullData,
            11 => Release,
            12 => Credit,
            13 => Error,
            14 => Attach,
            _ => return None,
        })
    }

    /// Length of the fixed part of the body for kinds that carry a payload after it.
    pub fn payload_offset(self) -> Option<usize> {
        match self {
            FrameKind::Eager => Some(8 + 4),
            FrameKind::PullData => Some(8 + 8),
            _ => None,
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Why bytes could not be decoded as a frame.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`MAGIC`]: the peer does not speak this protocol.
    #[error("bad magic 0x{found:08x} (expected 0x{MAGIC:08x}): the peer is not an rdma-shuffle engine")]
    BadMagic {
        /// What was received.
        found: u32,
    },
    /// A version outside `[MIN_PROTOCOL_VERSION, PROTOCOL_VERSION]`.
    #[error("unsupported protocol version {found} (this build speaks {min}..={max})")]
    UnsupportedVersion {
        /// What was received.
        found: u8,
        /// Oldest supported.
        min: u8,
        /// Newest supported.
        max: u8,
    },
    /// Unknown frame kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Non-zero reserved flags.
    #[error("reserved flags 0x{0:04x} set")]
    ReservedFlags(u16),
    /// `body_len` exceeds the limit for that kind.
    #[error("{kind} frame length {len} exceeds the limit {max}")]
    TooLong {
        /// Frame kind.
        kind: FrameKind,
        /// Claimed body length.
        len: u64,
        /// The limit in force.
        max: u64,
    },
    /// Fewer bytes than the header or a field requires.
    #[error("truncated frame: needed {needed} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// A field's value is invalid.
    #[error("malformed {kind} frame: {what}")]
    Malformed {
        /// Frame kind.
        kind: FrameKind,
        /// What is wrong.
        what: String,
    },
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Protocol version the frame was encoded with.
    pub version: u8,
    /// Frame kind.
    pub kind: FrameKind,
    /// Length of everything after the header, payload included.
    pub body_len: u64,
}

impl Header {
    /// Decodes and bounds-checks a header. Nothing is allocated; `body_len` is checked against
    /// `limits` for its kind before the caller reads the body.
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Header, FrameError> {
        if buf.len() < HEADER_LEN {
            return Err(FrameError::Truncated { needed: HEADER_LEN, have: buf.len() });
        }
        let magic = u32::from_be_bytes(buf[0..4].try_into().unwrap_or_default());
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let version = buf[4];
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
            return Err(FrameError::UnsupportedVersion { found: version, min: MIN_PROTOCOL_VERSION, max: PROTOCOL_VERSION });
        }
        let kind = FrameKind::from_u8(buf[5]).ok_or(FrameError::UnknownKind(buf[5]))?;
        let flags = u16::from_be_bytes([buf[6], buf[7]]);
        if flags != 0 {
            return Err(FrameError::ReservedFlags(flags));
        }
        let body_len = u32::from_be_bytes(buf[8..12].try_into().unwrap_or_default()) as u64;
        let max = match kind {
            FrameKind::Eager => 12 + limits.max_eager as u64,
            // Servers chunk pulls at MAX_PULL_CHUNK, so this bound costs nothing legitimate.
            // Saturating: `max_pull` is a u64 a caller may set to u64::MAX ("no limit"), and
            // a plain add would overflow (a panic in debug, every pull refused in release).
            FrameKind::PullData => 16u64.saturating_add(limits.max_pull),
            _ => limits.max_control as u64,
        };
        if body_len > max {
            return Err(FrameError::TooLong { kind, len: body_len, max });
        }
        if let Some(fixed) = kind.payload_offset() {
            if body_len < fixed as u64 {
                return Err(FrameError::Truncated { needed: fixed, have: body_len as usize });
            }
        }
        Ok(Header { version, kind, body_len })
    }

    /// Bytes of the body the codec needs before [`Frame::decode_body`]: the whole body for
    /// control frames, only the fixed part for payload frames.
    pub fn fixed_len(&self) -> usize {
        match self.kind.payload_offset() {
            Some(n) => n,
            None => self.body_len as usize,
        }
    }

    /// Payload bytes that follow the fixed part (zero for control frames).
    pub fn payload_len(&self) -> u64 {
        match self.kind.payload_offset() {
            Some(n) => self.body_len - n as u64,
            None => 0,
        }
    }

    /// Writes a header for `kind` with `body_len`.
    pub fn encode(kind: FrameKind, body_len: u32, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC.to_be_bytes());
        out.push(PROTOCOL_VERSION);
        out.push(kind as u8);
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&body_len.to_be_bytes());
    }
}

/// A protocol frame. Payload bytes of `Eager` and `PullData` are not part of the value:
/// `len` says how many follow the encoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Client → server, first frame of a connection.
    Hello {
        /// Oldest version the client speaks.
        min_version: u8,
        /// Newest version the client speaks.
        max_version: u8,
        /// Client capabilities ([`crate::caps`]).
        caps: u64,
        /// Client nonce for the challenge–response.
        nonce: [u8; NONCE_LEN],
        /// Largest eager block the client accepts inline.
        max_eager: u32,
        /// The client's application id; a server of another application refuses it.
        app_id: String,
    },
    /// Server → client, answer to `Hello`.
    Challenge {
        /// Version chosen for the connection.
        version: u8,
        /// Intersection of capabilities.
        caps: u64,
        /// Server nonce.
        nonce: [u8; NONCE_LEN],
        /// Whether the client must prove knowledge of the shared secret.
        auth_required: bool,
        /// Most blocks the client will ever be allowed in flight (the live grant comes in
        /// `Ready`, after authentication).
        credits: u32,
        /// Blocks up to this size come inline; larger ones by rendezvous.
        eager_threshold: u32,
        /// The server's application id.
        app_id: String,
    },
    /// Client → server: proof of the secret, `None` when auth is off.
    Auth {
        /// HMAC over the handshake transcript (see [`crate::auth`]).
        proof: Option<[u8; PROOF_LEN]>,
    },
    /// Server → client: handshake complete.
    Ready {
        /// Server's HMAC over the transcript and `credits` (mutual auth), `None` when auth
        /// is off.
        proof: Option<[u8; PROOF_LEN]>,
        /// Blocks the client may have in flight from now on (at most the `Challenge`'s
        /// `credits`). A credit comes back when its block's answer arrives, or when the
        /// client releases its rendezvous region.
        credits: u32,
    },
    /// Client → server: fetch `blocks`; block `i` of the list is index `first_index + i` of
    /// request `req` (a request larger than the client's credits is sent in several frames).
    Fetch {
        /// Request id chosen by the client.
        req: u64,
        /// Index of the first block of this frame within the request.
        first_index: u32,
        /// The blocks, answered one frame each, in any order.
        blocks: Vec<BlockSpan>,
    },
    /// Server → client: block `index` of `req` inline; `len` payload bytes follow.
    Eager {
        /// Request id.
        req: u64,
        /// Index into the request's blocks.
        index: u32,
        /// Payload length.
        len: u32,
    },
    /// Server → client: block `index` of `req` is in a registered region.
    Rendezvous {
        /// Request id.
        req: u64,
        /// Index into the request's blocks.
        index: u32,
        /// Where to pull it from.
        desc: Descriptor,
    },
    /// Server → client: block `index` of `req` failed.
    BlockFailed {
        /// Request id.
        req: u64,
        /// Index into the request's blocks.
        index: u32,
        /// Failure kind.
        code: FailureCode,
        /// Explanation.
        message: String,
    },
    /// Client → server (tcp): stream `len` bytes of `region` from `offset`.
    Pull {
        /// Region lease id from a `Rendezvous`.
        region: RegionId,
        /// Offset inside the region.
        offset: u64,
        /// Bytes wanted.
        len: u64,
    },
    /// Server → client (tcp): `len` bytes of `region` at `offset` follow.
    PullData {
        /// Region lease id.
        region: RegionId,
        /// Offset inside the region.
        offset: u64,
        /// Payload length.
        len: u64,
    },
    /// Client → server: the region is no longer needed.
    Release {
        /// Region lease id.
        region: RegionId,
    },
    /// Server → client: `n` more blocks may be in flight.
    Credit {
        /// Credits granted.
        n: u32,
    },
    /// Fatal error; the sender closes the connection after it.
    Error {
        /// Failure kind.
        code: FailureCode,
        /// Explanation.
        message: String,
    },
    /// Provider bootstrap bytes, exchanged once after the handshake (verbs).
    Attach {
        /// At most [`MAX_ATTACH_LEN`] bytes, decoded by the provider.
        data: Vec<u8>,
    },
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello { .. } => FrameKind::Hello,
            Frame::Challenge { .. } => FrameKind::Challenge,
            Frame::Auth { .. } => FrameKind::Auth,
            Frame::Ready { .. } => FrameKind::Ready,
            Frame::Fetch { .. } => FrameKind::Fetch,
            Frame::Eager { .. } => FrameKind::Eager,
            Frame::Rendezvous { .. } => FrameKind::Rendezvous,
            Frame::BlockFailed { .. } => FrameKind::BlockFailed,
            Frame::Pull { .. } => FrameKind::Pull,
            Frame::PullData { .. } => FrameKind::PullData,
            Frame::Release { .. } => FrameKind::Release,
            Frame::Credit { .. } => FrameKind::Credit,
            Frame::Error { .. } => FrameKind::Error,
            Frame::Attach { .. } => FrameKind::Attach,
        }
    }

    /// Payload bytes that follow this frame's encoding.
    pub fn payload_len(&self) -> u64 {
        match self {
            Frame::Eager { len, .. } => *len as u64,
            Frame::PullData { len, .. } => *len,
            _ => 0,
        }
    }

    /// Appends header and body (not the payload) to `out`.
    ///
    /// Panics never; strings longer than [`MAX_MESSAGE_LEN`] are cut at a char boundary.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        Header::encode(self.kind(), 0, out);
        let body_start = out.len();
        match self {
            Frame::Hello { min_version, max_version, caps, nonce, max_eager, app_id } => {
                out.push(*min_version);
                out.push(*max_version);
                out.extend_from_slice(&caps.to_be_bytes());
                out.extend_from_slice(nonce);
                out.extend_from_slice(&max_eager.to_be_bytes());
                put_str_max(out, app_id, MAX_APP_ID_LEN);
            }
            Frame::Challenge { version, caps, nonce, auth_required, credits, eager_threshold, app_id } => {
                out.push(*version);
                out.extend_from_slice(&caps.to_be_bytes());
                out.extend_from_slice(nonce);
                out.push(*auth_required as u8);
                out.extend_from_slice(&credits.to_be_bytes());
                out.extend_from_slice(&eager_threshold.to_be_bytes());
                put_str_max(out, app_id, MAX_APP_ID_LEN);
            }
            Frame::Auth { proof } => put_proof(out, proof),
            Frame::Ready { proof, credits } => {
                put_proof(out, proof);
                out.extend_from_slice(&credits.to_be_bytes());
            }
            Frame::Fetch { req, first_index, blocks } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&first_index.to_be_bytes());
                out.extend_from_slice(&(blocks.len() as u32).to_be_bytes());
                for b in blocks {
                    out.extend_from_slice(&b.group.to_be_bytes());
                    out.extend_from_slice(&b.object.to_be_bytes());
                    out.extend_from_slice(&b.start.to_be_bytes());
                    out.extend_from_slice(&b.end.to_be_bytes());
                }
            }
            Frame::Eager { req, index, .. } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
            }
            Frame::Rendezvous { req, index, desc } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
                out.extend_from_slice(&desc.region.to_be_bytes());
                out.extend_from_slice(&desc.addr.to_be_bytes());
                out.extend_from_slice(&desc.len.to_be_bytes());
                out.extend_from_slice(&desc.rkey.to_be_bytes());
            }
            Frame::BlockFailed { req, index, code, message } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
                out.extend_from_slice(&code.to_u16().to_be_bytes());
                put_str(out, message);
            }
            Frame::Pull { region, offset, len } => {
                out.extend_from_slice(&region.to_be_bytes());
                out.extend_from_slice(&offset.to_be_bytes());
                out.extend_from_slice(&len.to_be_bytes());
            }
            Frame::PullData { region, offset, .. } => {
                out.extend_from_slice(&region.to_be_bytes());
                out.extend_from_slice(&offset.to_be_bytes());
            }
            Frame::Release { region } => out.extend_from_slice(&region.to_be_bytes()),
            Frame::Credit { n } => out.extend_from_slice(&n.to_be_bytes()),
            Frame::Error { code, message } => {
                out.extend_from_slice(&code.to_u16().to_be_bytes());
                put_str(out, message);
            }
            Frame::Attach { data } => {
                // Longer data is cut rather than panicking; the peer then rejects it.
                let n = data.len().min(MAX_ATTACH_LEN);
                out.extend_from_slice(&(n as u16).to_be_bytes());
                out.extend_from_slice(&data[..n]);
            }
        }
        // Payload frames larger than u32 are never built (the server chunks pulls); saturate
        // rather than wrap so a bug shows up as a TooLong error on the peer, not as garbage.
        // The add saturates too: a `PullData` len near u64::MAX must not overflow here.
        let body_len = ((out.len() - body_start) as u64).saturating_add(self.payload_len());
        let body_len = u32::try_from(body_len).unwrap_or(u32::MAX);
        out[start + 8..start + 12].copy_from_slice(&body_len.to_be_bytes());
    }

    /// Encodes into a new vector (header + body, no payload).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64);
        self.encode(&mut v);
        v
    }

    /// Decodes the fixed body of a frame whose header was already decoded. `body` must be
    /// exactly [`Header::fixed_len`] bytes.
    pub fn decode_body(header: &Header, body: &[u8], limits: &Limits) -> Result<Frame, FrameError> {
        let kind = header.kind;
        if body.len() != header.fixed_len() {
            return Err(FrameError::Truncated { needed: header.fixed_len(), have: body.len() });
        }
        let mut r = Reader { buf: body, pos: 0, kind };
        let frame = match kind {
            FrameKind::Hello => Frame::Hello {
                min_version: r.u8()?,
                max_version: r.u8()?,
                caps: r.u64()?,
                nonce: r.array()?,
                max_eager: r.u32()?,
                app_id: r.string_max(MAX_APP_ID_LEN, "application id")?,
            },
            FrameKind::Challenge => Frame::Challenge {
                version: r.u8()?,
                caps: r.u64()?,
                nonce: r.array()?,
                auth_required: r.bool()?,
                credits: r.u32()?,
                eager_threshold: r.u32()?,
                app_id: r.string_max(MAX_APP_ID_LEN, "application id")?,
            },
            FrameKind::Auth => Frame::Auth { proof: r.opt_proof()? },
            FrameKind::Ready => Frame::Ready { proof: r.opt_proof()?, credits: r.u32()? },
            FrameKind::Fetch => {
                let req = r.u64()?;
                let first_index = r.u32()?;
                let count = r.u32()?;
                if count == 0 {
                    return Err(r.malformed("empty block list".into()));
                }
                if count > limits.max_blocks_per_fetch {
                    return Err(
                        r.malformed(format!("{count} blocks exceed the limit of {} per request", limits.max_blocks_per_fetch))
                    );
                }
                let need = count as usize * BlockSpan::ENCODED_LEN;
                if r.remaining() != need {
                    return Err(r.malformed(format!("{count} blocks need {need} bytes, body has {}", r.remaining())));
                }
                let mut blocks = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    blocks.push(BlockSpan { group: r.u32()?, object: r.u64()?, start: r.u32()?, end: r.u32()? });
                }
                if first_index.checked_add(count).is_none() {
                    return Err(r.malformed("block indices overflow".into()));
                }
                Frame::Fetch { req, first_index, blocks }
            }
            FrameKind::Eager => Frame::Eager { req: r.u64()?, index: r.u32()?, len: header.payload_len() as u32 },
            FrameKind::Rendezvous => Frame::Rendezvous {
                req: r.u64()?,
                index: r.u32()?,
                desc: Descriptor { region: r.u64()?, addr: r.u64()?, len: r.u64()?, rkey: r.u32()? },
            },
            FrameKind::BlockFailed => {
                Frame::BlockFailed { req: r.u64()?, index: r.u32()?, code: FailureCode::from_u16(r.u16()?), message: r.string()? }
            }
            FrameKind::Pull => Frame::Pull { region: r.u64()?, offset: r.u64()?, len: r.u64()? },
            FrameKind::PullData => Frame::PullData { region: r.u64()?, offset: r.u64()?, len: header.payload_len() },
            FrameKind::Release => Frame::Release { region: r.u64()? },
            FrameKind::Credit => Frame::Credit { n: r.u32()? },
            FrameKind::Error => Frame::Error { code: FailureCode::from_u16(r.u16()?), message: r.string()? },
            FrameKind::Attach => {
                let n = r.u16()? as usize;
                if n > MAX_ATTACH_LEN {
                    return Err(r.malformed(format!("attach data of {n} bytes exceeds {MAX_ATTACH_LEN}")));
                }
                Frame::Attach { data: r.take(n)?.to_vec() }
            }
        };
        if r.remaining() != 0 {
            return Err(r.malformed(format!("{} trailing bytes", r.remaining())));
        }
        Ok(frame)
    }

    /// Decodes one whole message (header, body and payload), as a message transport (verbs
    /// SEND, sim) delivers it. Returns the frame and the byte offset where its payload starts.
    pub fn decode_message(buf: &[u8], limits: &Limits) -> Result<(Frame, usize), FrameError> {
        let header = Header::decode(buf, limits)?;
        let total = HEADER_LEN as u64 + header.body_len;
        if (buf.len() as u64) < total {
            return Err(FrameError::Truncated { needed: total as usize, have: buf.len() });
        }
        if (buf.len() as u64) > total {
            return Err(FrameError::Malformed {
                kind: header.kind,
                what: format!("{} bytes after the frame", buf.len() as u64 - total),
            });
        }
        let fixed_end = HEADER_LEN + header.fixed_len();
        let frame = Frame::decode_body(&header, &buf[HEADER_LEN..fixed_end], limits)?;
        Ok((frame, fixed_end))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_str_max(out, s, MAX_MESSAGE_LEN)
}

/// A `u16` length and at most `max` bytes of `s`, cut at a char boundary.
fn put_str_max(out: &mut Vec<u8>, s: &str, max: usize) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_be_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

fn put_proof(out: &mut Vec<u8>, proof: &Option<[u8; PROOF_LEN]>) {
    match proof {
        Some(p) => {
            out.push(1);
            out.extend_from_slice(p);
        }
        None => out.push(0),
    }
}

/// A bounds-checked cursor; every read returns `Truncated` instead of panicking.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    kind: FrameKind,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.remaining() < n {
            return Err(FrameError::Truncated { needed: self.pos + n, have: self.buf.len() });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn malformed(&self, what: String) -> FrameError {
        FrameError::Malformed { kind: self.kind, what }
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool, FrameError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.malformed(format!("boolean byte {v}"))),
        }
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_be_bytes(a))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn opt_proof(&mut self) -> Result<Option<[u8; PROOF_LEN]>, FrameError> {
        if self.bool()? {
            Ok(Some(self.array()?))
        } else {
            Ok(None)
        }
    }
    fn string(&mut self) -> Result<String, FrameError> {
        self.string_max(MAX_MESSAGE_LEN, "message")
    }
    fn string_max(&mut self, max: usize, what: &str) -> Result<String, FrameError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(self.malformed(format!("{what} of {n} bytes exceeds {max}")));
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.malformed(format!("{what} is not UTF-8")))
    }
}

/// One valid frame of every kind, in kind order (and both forms of the optional proofs, and
/// extreme field values): the fixtures of the codec tests and the fuzzers' seeds. Built for
/// tests and with the `samples` feature only.
#[cfg(any(test, feature = "samples"))]
pub fn sample_frames() -> Vec<Frame> {
    use crate::{BlockSpan, Descriptor, FailureCode};
    vec![
        Frame::Hello {
            min_version: 2,
            max_version: 2,
            caps: crate::caps::ALL,
            nonce: [3; 16],
            max_eager: 65536,
            app_id: "app-20260101000000-0001".into(),
        },
        Frame::Challenge {
            version: 2,
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
        Frame::Rendezvous { req: 1, index: 0, desc: Descriptor { region: 5, addr: 0xdead, len: 1 << 20, rkey: 77 } },
        Frame::BlockFailed { req: 3, index: 1, code: FailureCode::Corrupt, message: "bad index é".into() },
        Frame::Pull { region: 5, offset: 10, len: 20 },
        Frame::PullData { region: 5, offset: 10, len: 20 },
        Frame::Release { region: 5 },
        Frame::Credit { n: 3 },
        Frame::Error { code: FailureCode::AuthRefused, message: "no".into() },
        Frame::Attach { data: vec![0xa5; 44] },
        Frame::Attach { data: Vec::new() },
    ]
}

#[cfg(test)]
mod tests {
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
            min_version: 2,
            max_version: 2,
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
}
