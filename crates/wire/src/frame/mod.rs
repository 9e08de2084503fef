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

use crate::block::{BlockRange, BlockSpan, Descriptor, FailureCode, RegionId};
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
/// Largest range one `FetchRange` entry may ask for (and so the largest piece a streamed
/// block is fetched in): below 2 GiB, so every piece fits one JVM buffer.
pub const MAX_RANGE_LEN: u64 = i32::MAX as u64;
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
    /// Client → server (version 3): request byte ranges of blocks; answered like `Fetch`,
    /// always by `Rendezvous` (which carries the whole block's length) or `BlockFailed`.
    FetchRange = 15,
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
            15 => FetchRange,
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
    /// Client → server: fetch byte ranges of blocks; entry `i` is index `first_index + i` of
    /// request `req`. Each is answered by one `Rendezvous` of exactly the range (or one
    /// `BlockFailed`: a range past the block's end fails with `BadRange`).
    FetchRange {
        /// Request id chosen by the client.
        req: u64,
        /// Index of the first entry of this frame within the request.
        first_index: u32,
        /// The ranges, each inside its block, each at most [`MAX_RANGE_LEN`] bytes.
        ranges: Vec<BlockRange>,
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
        /// Length of the whole block: `desc.len` for a `Fetch`, the block's full length for
        /// a `FetchRange` (so the client knows how many ranges follow).
        block_len: u64,
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
            Frame::FetchRange { .. } => FrameKind::FetchRange,
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
                    put_span(out, b);
                }
            }
            Frame::Eager { req, index, .. } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
            }
            Frame::FetchRange { req, first_index, ranges } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&first_index.to_be_bytes());
                out.extend_from_slice(&(ranges.len() as u32).to_be_bytes());
                for r in ranges {
                    put_span(out, &r.span);
                    out.extend_from_slice(&r.offset.to_be_bytes());
                    out.extend_from_slice(&r.len.to_be_bytes());
                }
            }
            Frame::Rendezvous { req, index, desc, block_len } => {
                out.extend_from_slice(&req.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
                out.extend_from_slice(&desc.region.to_be_bytes());
                out.extend_from_slice(&desc.addr.to_be_bytes());
                out.extend_from_slice(&desc.len.to_be_bytes());
                out.extend_from_slice(&desc.rkey.to_be_bytes());
                out.extend_from_slice(&block_len.to_be_bytes());
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
                let (req, first_index, count) = r.list_head(limits, BlockSpan::ENCODED_LEN)?;
                let mut blocks = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    blocks.push(r.span()?);
                }
                Frame::Fetch { req, first_index, blocks }
            }
            FrameKind::FetchRange => {
                let (req, first_index, count) = r.list_head(limits, BlockRange::ENCODED_LEN)?;
                let mut ranges = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let range = BlockRange { span: r.span()?, offset: r.u64()?, len: r.u64()? };
                    if range.len > MAX_RANGE_LEN {
                        return Err(r.malformed(format!("{range}: {} bytes exceed {MAX_RANGE_LEN} per range", range.len)));
                    }
                    if range.offset.checked_add(range.len).is_none() {
                        return Err(r.malformed(format!("{}: range end overflows", range.span)));
                    }
                    ranges.push(range);
                }
                Frame::FetchRange { req, first_index, ranges }
            }
            FrameKind::Eager => Frame::Eager { req: r.u64()?, index: r.u32()?, len: header.payload_len() as u32 },
            FrameKind::Rendezvous => {
                let (req, index) = (r.u64()?, r.u32()?);
                let desc = Descriptor { region: r.u64()?, addr: r.u64()?, len: r.u64()?, rkey: r.u32()? };
                let block_len = r.u64()?;
                if desc.len > block_len {
                    return Err(r.malformed(format!("region of {} bytes exceeds its block of {block_len}", desc.len)));
                }
                Frame::Rendezvous { req, index, desc, block_len }
            }
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

    /// Decodes a frame's fixed part (header and body without payload), as a link hands it
    /// over after cutting it with the frame's [`Header`]. Its length must be exactly what
    /// the header describes.
    pub fn decode_head(buf: &[u8], limits: &Limits) -> Result<Frame, FrameError> {
        let header = Header::decode(buf, limits)?;
        let fixed_end = HEADER_LEN + header.fixed_len();
        if buf.len() < fixed_end {
            return Err(FrameError::Truncated { needed: fixed_end, have: buf.len() });
        }
        if buf.len() > fixed_end {
            return Err(FrameError::Malformed {
                kind: header.kind,
                what: format!("{} bytes after the frame", buf.len() - fixed_end),
            });
        }
        Frame::decode_body(&header, &buf[HEADER_LEN..], limits)
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

fn put_span(out: &mut Vec<u8>, b: &BlockSpan) {
    out.extend_from_slice(&b.group.to_be_bytes());
    out.extend_from_slice(&b.object.to_be_bytes());
    out.extend_from_slice(&b.start.to_be_bytes());
    out.extend_from_slice(&b.end.to_be_bytes());
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
    fn span(&mut self) -> Result<BlockSpan, FrameError> {
        Ok(BlockSpan { group: self.u32()?, object: self.u64()?, start: self.u32()?, end: self.u32()? })
    }
    /// The head of a `Fetch`/`FetchRange` body: request, first index and a count of entries
    /// of `entry_len` bytes, checked against the limit and the body's length.
    fn list_head(&mut self, limits: &Limits, entry_len: usize) -> Result<(u64, u32, u32), FrameError> {
        let req = self.u64()?;
        let first_index = self.u32()?;
        let count = self.u32()?;
        if count == 0 {
            return Err(self.malformed("empty block list".into()));
        }
        if count > limits.max_blocks_per_fetch {
            return Err(self.malformed(format!("{count} blocks exceed the limit of {} per request", limits.max_blocks_per_fetch)));
        }
        let need = count as usize * entry_len;
        if self.remaining() != need {
            return Err(self.malformed(format!("{count} blocks need {need} bytes, body has {}", self.remaining())));
        }
        if first_index.checked_add(count).is_none() {
            return Err(self.malformed("block indices overflow".into()));
        }
        Ok((req, first_index, count))
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

#[cfg(any(test, feature = "samples"))]
mod samples;
#[cfg(any(test, feature = "samples"))]
pub use samples::sample_frames;

#[cfg(test)]
mod tests;
