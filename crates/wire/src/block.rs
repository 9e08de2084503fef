//! What a request names and what a response carries, independent of framing.

use crate::knob::Knob;
use std::fmt;

/// A contiguous range of parts `[start, end)` of one object in one group.
///
/// The shuffle layer maps it to Spark's block ids: `group` = shuffleId, `object` = mapId
/// (the map task attempt id), `start..end` = reduce ids (`end = start + 1` for a single
/// `ShuffleBlockId`, wider for a `ShuffleBlockBatchId`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSpan {
    /// Group id (Spark: shuffle id).
    pub group: u32,
    /// Object id inside the group (Spark: map id).
    pub object: u64,
    /// First part, inclusive (Spark: start reduce id).
    pub start: u32,
    /// Last part, exclusive (Spark: end reduce id).
    pub end: u32,
}

impl BlockSpan {
    /// Encoded size in bytes.
    pub const ENCODED_LEN: usize = 4 + 8 + 4 + 4;

    /// A single part `part` of `object` in `group`.
    pub fn single(group: u32, object: u64, part: u32) -> Self {
        BlockSpan { group, object, start: part, end: part.saturating_add(1) }
    }
}

impl fmt::Display for BlockSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.end == self.start.wrapping_add(1) {
            write!(f, "shuffle_{}_{}_{}", self.group, self.object, self.start)
        } else {
            write!(f, "shuffle_{}_{}_{}_{}", self.group, self.object, self.start, self.end)
        }
    }
}

/// Bytes `[offset, offset + len)` of one block: what a range fetch asks for.
///
/// A block larger than any buffer the client has is fetched as a series of ranges, each of
/// which fits one buffer. A range must lie inside the block (`offset + len` at most the
/// block's length); `len == 0` at `offset == 0` asks only for the block's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRange {
    /// The block.
    pub span: BlockSpan,
    /// First byte of the range inside the block.
    pub offset: u64,
    /// Length of the range; at most [`crate::frame::MAX_RANGE_LEN`].
    pub len: u64,
}

impl BlockRange {
    /// Encoded size in bytes.
    pub const ENCODED_LEN: usize = BlockSpan::ENCODED_LEN + 8 + 8;

    /// End of the range (saturating: the decoder refuses ranges whose end overflows).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

impl fmt::Display for BlockRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes {}..{}", self.span, self.offset, self.end())
    }
}

/// Server-chosen id of a rendezvous region lease; valid until the client releases it or the
/// connection ends.
pub type RegionId = u64;

/// Where a rendezvous block's bytes are: a registered region the client pulls from.
///
/// On verbs, `addr`/`rkey` name the remote memory for an RDMA READ; on tcp they are
/// informational and the client pulls by `region` over the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// The server's lease id for this region.
    pub region: RegionId,
    /// Remote virtual address of the first byte (verbs) or offset in the source (tcp).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key of the memory region (verbs); 0 on tcp.
    pub rkey: u32,
}

impl Descriptor {
    /// Encoded size in bytes.
    pub const ENCODED_LEN: usize = 8 + 8 + 8 + 4;
}

/// Why one block could not be delivered. Carried on the wire in `BlockFailed` frames and
/// produced locally for connection-level failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureCode {
    /// The server has no live registration for the group (shuffle unregistered or never seen).
    UnknownGroup,
    /// The group exists but not this object (map output).
    UnknownObject,
    /// The part range is empty or outside the object's parts.
    BadRange,
    /// The object's index or data is corrupt (short index, decreasing offsets, past the end).
    Corrupt,
    /// The server hit an I/O error reading the object.
    Io,
    /// The connection to the peer was lost before the block completed.
    PeerGone,
    /// The block did not complete within the fetch timeout.
    Timeout,
    /// The peer refused our credentials, or we refused the peer's.
    AuthRefused,
    /// Local memory for the block could not be had within the timeout (pool cap).
    PoolExhausted,
    /// The peer violated the protocol; the connection was closed.
    Protocol,
    /// A pull of a rendezvous region failed (RDMA READ error or stream error).
    PullFailed,
    /// Anything else the server reports; the message says what.
    Other,
}

impl FailureCode {
    /// Every code, in wire order.
    pub const ALL: [FailureCode; 12] = [
        FailureCode::UnknownGroup,
        FailureCode::UnknownObject,
        FailureCode::BadRange,
        FailureCode::Corrupt,
        FailureCode::Io,
        FailureCode::PeerGone,
        FailureCode::Timeout,
        FailureCode::AuthRefused,
        FailureCode::PoolExhausted,
        FailureCode::Protocol,
        FailureCode::PullFailed,
        FailureCode::Other,
    ];

    /// Whether asking again may succeed: transport trouble or a momentary memory shortage.
    /// Missing or corrupt data, refused credentials and protocol violations give the same
    /// answer every time.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            FailureCode::Io | FailureCode::PeerGone | FailureCode::Timeout | FailureCode::PoolExhausted | FailureCode::PullFailed
        )
    }

    /// Wire value.
    pub fn to_u16(self) -> u16 {
        match self {
            FailureCode::UnknownGroup => 1,
            FailureCode::UnknownObject => 2,
            FailureCode::BadRange => 3,
            FailureCode::Corrupt => 4,
            FailureCode::Io => 5,
            FailureCode::PeerGone => 6,
            FailureCode::Timeout => 7,
            FailureCode::AuthRefused => 8,
            FailureCode::PoolExhausted => 9,
            FailureCode::Protocol => 10,
            FailureCode::PullFailed => 11,
            FailureCode::Other => 0xffff,
        }
    }

    /// From a wire value; unknown values map to [`FailureCode::Other`] so newer peers can add
    /// codes without breaking older ones.
    pub fn from_u16(v: u16) -> Self {
        match v {
            1 => FailureCode::UnknownGroup,
            2 => FailureCode::UnknownObject,
            3 => FailureCode::BadRange,
            4 => FailureCode::Corrupt,
            5 => FailureCode::Io,
            6 => FailureCode::PeerGone,
            7 => FailureCode::Timeout,
            8 => FailureCode::AuthRefused,
            9 => FailureCode::PoolExhausted,
            10 => FailureCode::Protocol,
            11 => FailureCode::PullFailed,
            _ => FailureCode::Other,
        }
    }

    /// A stable lower-case name, used by the JNI layer to pick the Java exception.
    pub fn name(self) -> &'static str {
        match self {
            FailureCode::UnknownGroup => "unknown_shuffle",
            FailureCode::UnknownObject => "unknown_map_output",
            FailureCode::BadRange => "bad_range",
            FailureCode::Corrupt => "corrupt",
            FailureCode::Io => "io",
            FailureCode::PeerGone => "peer_gone",
            FailureCode::Timeout => "timeout",
            FailureCode::AuthRefused => "auth_refused",
            FailureCode::PoolExhausted => "pool_exhausted",
            FailureCode::Protocol => "protocol",
            FailureCode::PullFailed => "pull_failed",
            FailureCode::Other => "other",
        }
    }
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A typed per-block failure with a human-readable explanation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockFailure {
    /// What kind of failure.
    pub code: FailureCode,
    /// What exactly went wrong: names the peer, the block and the limit where known.
    pub message: String,
    /// The setting that cures it, where there is one; the layer that owns the settings
    /// renders its name into what the user sees.
    pub knob: Option<Knob>,
}

impl BlockFailure {
    /// A failure of `code` with `message`.
    pub fn new(code: FailureCode, message: impl Into<String>) -> Self {
        BlockFailure { code, message: message.into(), knob: None }
    }

    /// The same failure, pointing at `knob`.
    pub fn with_knob(mut self, knob: Option<Knob>) -> Self {
        self.knob = knob;
        self
    }
}

impl fmt::Display for BlockFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for BlockFailure {}
