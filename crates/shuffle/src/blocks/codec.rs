//! The block protocol's framing, as the fabric's links need it ([`WireCodec`]): `wire`
//! frames, cut by their 12-byte header, every length bounded by the session's [`Limits`].

use rdma_shuffle_fabric::driver::{Codec, CodecError, Conn, FrameShape, Loop};
use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::frame::HEADER_LEN;
use rdma_shuffle_wire::{Frame, FrameError, FrameKind, Header, Limits};
use std::sync::Arc;

/// `wire` frames for a link: a frame's fixed part is its header and the body before any
/// payload (`Eager` and `PullData` carry one); provider records travel as `Attach` frames.
pub struct WireCodec {
    limits: Limits,
}

impl WireCodec {
    /// The codec of a connection whose session decodes with `limits`.
    pub fn new(limits: Limits) -> Arc<WireCodec> {
        Arc::new(WireCodec { limits })
    }
}

impl Codec for WireCodec {
    fn header_len(&self) -> usize {
        HEADER_LEN
    }

    fn shape(&self, header: &[u8]) -> Result<FrameShape, CodecError> {
        let h = Header::decode(header, &self.limits)?;
        Ok(FrameShape { head: HEADER_LEN + h.fixed_len(), payload: h.kind.payload_offset().map(|_| h.payload_len()) })
    }

    fn attach_frame(&self, record: &[u8]) -> Vec<u8> {
        Frame::Attach { data: record.to_vec() }.to_vec()
    }

    fn attach_record(&self, head: &[u8]) -> Option<Vec<u8>> {
        // Only a head whose header says Attach is decoded here: any other goes to the session
        // whole, which reports its errors in its own terms.
        if Header::decode(head, &self.limits).map(|h| h.kind) != Ok(FrameKind::Attach) {
            return None;
        }
        match Frame::decode_head(head, &self.limits) {
            Ok(Frame::Attach { data }) => Some(data),
            _ => None,
        }
    }
}

/// The `wire` frame whose fixed part arrived on `conn`, decoded with `limits`. A malformed
/// one fails the connection, as a [`FabricError::Frame`] whose source the connection's
/// session reports in its own terms ([`frame_error_of`]).
pub(crate) fn decode_or_fail(lp: &mut Loop, conn: &mut Conn, head: &[u8], limits: &Limits) -> Option<Frame> {
    match Frame::decode_head(head, limits) {
        Ok(f) => Some(f),
        Err(e) => {
            let peer = conn.peer.clone();
            lp.fail(conn, FabricError::Frame { peer, source: Box::new(e) });
            None
        }
    }
}

/// The `wire` decoding error a connection failed with, if it failed with one (from this
/// codec in a link, or from the endpoint decoding a frame's fixed part).
pub(crate) fn frame_error_of(e: &FabricError) -> Option<&FrameError> {
    match e {
        FabricError::Frame { source, .. } => source.downcast_ref::<FrameError>(),
        _ => None,
    }
}
