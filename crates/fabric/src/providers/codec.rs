//! The seam between a protocol's framing and the providers.
//!
//! Framing belongs to the protocol: the shuffle's block protocol and Mobius's mesh each define
//! their own frames. A provider never reads inside one. It asks the connection's [`Codec`]
//! only what it must know to cut frames out of what it receives:
//!
//! * a stream link (tcp, the verbs control socket) reads [`Codec::header_len`] bytes, asks
//!   [`Codec::shape`] how long the frame's fixed part is and whether a payload follows it,
//!   hands the fixed part to the protocol as [`Incoming::Frame`](super::link::Incoming), and
//!   places the payload where the protocol says ([`Link::place`](super::link::Link::place));
//! * a message link (verbs SEND/RECV, shm, sim) checks that a whole message is as long as its
//!   header says and hands it over as [`Incoming::Message`](super::link::Incoming).
//!
//! The codec bounds every length it reads from the wire before the link reads (or allocates)
//! that many bytes, so a lying length costs nothing but the connection.
//!
//! A provider with a data plane to bootstrap once the peer authenticated (verbs: queue pair
//! numbers exchanged over the control socket; any provider that must tell its peer an
//! address of its own) sends its record inside the protocol's own frame for it
//! ([`Codec::attach_frame`]) and recognizes the peer's ([`Codec::attach_record`]). The
//! protocol only frames the record: the link consumes the peer's and never hands it up.

use std::error::Error;

/// Bytes of every message a message provider keeps for a protocol's fixed part: its largest
/// eager payload is its message size less this. The data frames of both protocols (the
/// shuffle's `Eager`, the mesh's `DATA`) need at most 32.
pub const HEAD_ROOM: usize = 76;

/// What a codec found wrong in a frame, for
/// [`FabricError::Frame`](crate::FabricError::Frame). The protocol's own error type, boxed:
/// the protocol downcasts it to report it in its terms.
pub type CodecError = Box<dyn Error + Send + Sync>;

/// The extent of one frame, as its codec reads it from the frame's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameShape {
    /// Bytes of the frame's fixed part, header included: handed to the protocol whole.
    pub head: usize,
    /// Bytes of a payload that follows the fixed part and that the protocol places
    /// (`Some(0)`: an empty payload, still placed); `None`: the frame has none.
    pub payload: Option<u64>,
}

impl FrameShape {
    /// Bytes of the whole frame.
    pub fn total(&self) -> Option<u64> {
        (self.head as u64).checked_add(self.payload.unwrap_or(0))
    }
}

/// A protocol's framing, as far as a provider needs it. One value serves every connection
/// it is given to (`Arc`), from the loop thread.
pub trait Codec: Send + Sync {
    /// Bytes of the fixed header every frame starts with.
    fn header_len(&self) -> usize;

    /// The extent of the frame whose first [`header_len`](Codec::header_len) bytes are
    /// `header`, with every length bounded by the protocol's limits. An error is fatal for
    /// the connection.
    fn shape(&self, header: &[u8]) -> Result<FrameShape, CodecError>;

    /// The protocol's frame that carries a provider's data-plane bootstrap record.
    fn attach_frame(&self, record: &[u8]) -> Vec<u8>;

    /// The record, if `head` (a whole fixed part) is the protocol's attach frame.
    fn attach_record(&self, head: &[u8]) -> Option<Vec<u8>>;
}

/// Where the payload of a whole received message starts: after the fixed part its header
/// describes, which must account for every byte of the message.
pub fn message_head(codec: &dyn Codec, msg: &[u8]) -> Result<usize, CodecError> {
    let hl = codec.header_len();
    let header = msg.get(..hl).ok_or_else(|| format!("a message of {} bytes is shorter than a {hl}-byte header", msg.len()))?;
    let shape = checked_shape(codec, header)?;
    if shape.total() != Some(msg.len() as u64) {
        return Err(format!(
            "a message of {} bytes whose header describes {} bytes ({} fixed, {} payload)",
            msg.len(),
            shape.total().map_or_else(|| "more than 2^64".to_string(), |t| t.to_string()),
            shape.head,
            shape.payload.unwrap_or(0)
        )
        .into());
    }
    Ok(shape.head)
}

/// [`Codec::shape`], with the one property every link relies on checked: the fixed part
/// holds at least the header.
pub fn checked_shape(codec: &dyn Codec, header: &[u8]) -> Result<FrameShape, CodecError> {
    let shape = codec.shape(header)?;
    if shape.head < codec.header_len() {
        return Err(format!("a frame whose fixed part of {} bytes is shorter than its header", shape.head).into());
    }
    Ok(shape)
}
