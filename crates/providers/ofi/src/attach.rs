//! What two ends exchange to attach a connection to their reliable-datagram endpoints, and
//! the trailer of every message between attached connections.
//!
//! One RDM endpoint per driver loop carries every connection of that loop, and two processes
//! may hold several connections between the same pair of endpoints; so a message names the
//! connection it is for (the receiver's 64-bit connection id, drawn at random so a peer cannot
//! guess another connection's), not just the endpoint it came from. The record travels over
//! the connection's control plane after the peer authenticated, and is bounded and checked
//! before anything in it reaches libfabric.
//!
//! The connection id and the message's kind travel at the *end* of the message (a trailer),
//! so the frame in front of it is handed up by truncating the received buffer, never by
//! moving its bytes.
//!
//! ```text
//!  record:  version (1) · conn_id (8) · max_msg (4) · address length (2) · address
//!  message: body · kind (1) · conn_id (8)                       (integers little-endian)
//!  grant:   handle (4) · key (8) · addr (8) · len (8)           (kind Grant's body)
//!  revoke:  handle (4)                                          (kind Revoke's body)
//!  fin:     (empty)                                             (the sender closes)
//! ```

/// Version of the record's layout.
const VERSION: u8 = 2;

/// The longest endpoint address accepted (libfabric's are 16 to ~100 bytes: sockaddr_in,
/// sockaddr_in6, shm's path-like names, verbs' address blocks).
pub const MAX_ADDRESS: usize = 256;

/// The smallest receive buffer a peer may announce.
pub const MIN_MESSAGE: u32 = 1024;
/// The largest receive buffer a peer may announce.
pub const MAX_MESSAGE: u32 = 64 << 20;

const FIXED: usize = 1 + 8 + 4 + 2;

/// One end's attach record: its connection id, the largest message its receive buffers
/// take, and its endpoint's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRecord {
    /// The sender's id for this connection: what the peer puts on messages to it.
    pub conn_id: u64,
    /// The sender's receive buffers' size: the peer cuts its messages to it.
    pub max_msg: u32,
    /// The sender's endpoint address (`fi_getname`).
    pub address: Vec<u8>,
}

/// Why a record or a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    /// Shorter than its fixed part or than the length it states.
    #[error("attach record truncated: {got} bytes, {need} needed")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the record needs.
        need: usize,
    },
    /// A layout this build does not read.
    #[error("attach record version {0}, this build reads version {VERSION}")]
    Version(u8),
    /// An address longer than any libfabric provider's, or empty.
    #[error("attach record states a {0}-byte address (1 to {MAX_ADDRESS} accepted)")]
    Address(usize),
    /// A receive buffer size out of bounds.
    #[error("attach record states {0}-byte receive buffers ({MIN_MESSAGE} to {MAX_MESSAGE} accepted)")]
    MaxMessage(u32),
    /// Bytes after the record.
    #[error("attach record followed by {0} stray bytes")]
    Trailing(usize),
    /// Connection id 0 (reserved: never drawn).
    #[error("attach record with connection id 0")]
    ZeroId,
}

impl AttachRecord {
    /// The record's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + self.address.len());
        out.push(VERSION);
        out.extend_from_slice(&self.conn_id.to_le_bytes());
        out.extend_from_slice(&self.max_msg.to_le_bytes());
        out.extend_from_slice(&(self.address.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.address);
        out
    }

    /// Reads a record, refusing any other length than the one it states and any field out
    /// of bounds.
    pub fn decode(bytes: &[u8]) -> Result<Self, AttachError> {
        if bytes.len() < FIXED {
            return Err(AttachError::Truncated { got: bytes.len(), need: FIXED });
        }
        if bytes[0] != VERSION {
            return Err(AttachError::Version(bytes[0]));
        }
        let conn_id = u64::from_le_bytes(bytes[1..9].try_into().expect("8 bytes"));
        if conn_id == 0 {
            return Err(AttachError::ZeroId);
        }
        let max_msg = u32::from_le_bytes(bytes[9..13].try_into().expect("4 bytes"));
        if !(MIN_MESSAGE..=MAX_MESSAGE).contains(&max_msg) {
            return Err(AttachError::MaxMessage(max_msg));
        }
        let len = u16::from_le_bytes([bytes[13], bytes[14]]) as usize;
        if len == 0 || len > MAX_ADDRESS {
            return Err(AttachError::Address(len));
        }
        let need = FIXED + len;
        match bytes.len() {
            n if n < need => Err(AttachError::Truncated { got: n, need }),
            n if n > need => Err(AttachError::Trailing(n - need)),
            _ => Ok(AttachRecord { conn_id, max_msg, address: bytes[FIXED..].to_vec() }),
        }
    }
}

/// Bytes of the trailer at the end of each message.
pub const TRAILER_LEN: usize = 9;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole frame of the protocol.
    Frame = 0,
    /// A piece of a frame larger than the receiver's buffers; more follow.
    More = 1,
    /// The last piece of such a frame.
    Last = 2,
    /// The sender exposed a region to this connection: a [`Grant`].
    Grant = 3,
    /// The sender revoked a region it granted: its handle.
    Revoke = 4,
    /// The sender closes the connection: nothing follows (sent with delivery completion,
    /// before its control socket closes, so the receiver has every message by then).
    Fin = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            0 => Kind::Frame,
            1 => Kind::More,
            2 => Kind::Last,
            3 => Kind::Grant,
            4 => Kind::Revoke,
            5 => Kind::Fin,
            _ => return None,
        })
    }
}

/// The trailer for a message of `kind` to the connection the peer numbered `conn_id`.
pub fn trailer(kind: Kind, conn_id: u64) -> [u8; TRAILER_LEN] {
    let mut t = [0u8; TRAILER_LEN];
    t[0] = kind as u8;
    t[1..].copy_from_slice(&conn_id.to_le_bytes());
    t
}

/// Reads a received message's trailer: the connection it is for, its kind, and the length of
/// its body (the bytes in front of the trailer). `None` for a message too short to carry one
/// or of an unknown kind (dropped and counted by the caller).
pub fn read_trailer(message: &[u8]) -> Option<(u64, Kind, usize)> {
    let body = message.len().checked_sub(TRAILER_LEN)?;
    let t = &message[body..];
    let kind = Kind::from_u8(t[0])?;
    Some((u64::from_le_bytes(t[1..].try_into().expect("8 bytes")), kind, body))
}

/// A region the peer exposed to this connection alone, as a [`Kind::Grant`] message tells
/// it: the protocol's descriptor names it by `handle`, and only this connection learns the
/// `key` that reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// What the protocol's descriptor carries as its key (per connection, random).
    pub handle: u32,
    /// The libfabric memory key.
    pub key: u64,
    /// The address reads of the region start at.
    pub addr: u64,
    /// Bytes exposed.
    pub len: u64,
}

impl Grant {
    /// Encoded length.
    pub const LEN: usize = 28;

    /// The grant's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&self.handle.to_le_bytes());
        b[4..12].copy_from_slice(&self.key.to_le_bytes());
        b[12..20].copy_from_slice(&self.addr.to_le_bytes());
        b[20..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads a grant; `None` unless exactly [`Grant::LEN`] bytes with a nonzero handle and
    /// a range that does not wrap.
    pub fn decode(b: &[u8]) -> Option<Grant> {
        if b.len() != Self::LEN {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let g = Grant {
            handle: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
            key: u64_at(4),
            addr: u64_at(12),
            len: u64_at(20),
        };
        (g.handle != 0 && g.addr.checked_add(g.len).is_some()).then_some(g)
    }

    /// Whether `len` bytes at `addr` lie inside the granted range.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

/// A revoke's body: the handle.
pub fn decode_revoke(b: &[u8]) -> Option<u32> {
    (b.len() == 4).then(|| u32::from_le_bytes(b.try_into().expect("4 bytes")))
}

/// A new connection id: random (the thread-local generator is seeded from the OS), nonzero.
pub fn new_conn_id() -> u64 {
    rand::random::<u64>().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AttachRecord {
        AttachRecord { conn_id: 0x1234_5678_9abc_def0, max_msg: 69632, address: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1] }
    }

    #[test]
    fn records_round_trip() {
        let r = sample();
        assert_eq!(AttachRecord::decode(&r.encode()), Ok(r));
    }

    #[test]
    fn lying_and_malformed_records_are_refused() {
        let good = AttachRecord { address: vec![9; 16], ..sample() }.encode();
        assert_eq!(AttachRecord::decode(&good[..5]), Err(AttachError::Truncated { got: 5, need: FIXED }));
        assert_eq!(AttachRecord::decode(&good[..20]), Err(AttachError::Truncated { got: 20, need: FIXED + 16 }));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(AttachRecord::decode(&long), Err(AttachError::Trailing(1)));
        let mut v = good.clone();
        v[0] = 1;
        assert_eq!(AttachRecord::decode(&v), Err(AttachError::Version(1)));
        let mut huge = good.clone();
        huge[13..15].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(AttachRecord::decode(&huge), Err(AttachError::Address(65535)));
        let empty = AttachRecord { address: vec![], ..sample() }.encode();
        assert_eq!(AttachRecord::decode(&empty), Err(AttachError::Address(0)));
        for bad in [0, MIN_MESSAGE - 1, MAX_MESSAGE + 1, u32::MAX] {
            let r = AttachRecord { max_msg: bad, ..sample() }.encode();
            assert_eq!(AttachRecord::decode(&r), Err(AttachError::MaxMessage(bad)));
        }
        let zero = AttachRecord { conn_id: 0, ..sample() }.encode();
        assert_eq!(AttachRecord::decode(&zero), Err(AttachError::ZeroId));
        // Every prefix of a good record is refused, never read past.
        for n in 0..good.len() {
            assert!(AttachRecord::decode(&good[..n]).is_err(), "prefix of {n} bytes");
        }
    }

    #[test]
    fn messages_carry_their_connection_and_kind_at_the_end() {
        let mut m = b"frame".to_vec();
        m.extend_from_slice(&trailer(Kind::Last, 42));
        assert_eq!(read_trailer(&m), Some((42, Kind::Last, 5)));
        assert_eq!(read_trailer(&m[..8]), None, "too short for a trailer");
        let mut unknown = m.clone();
        unknown[5] = 9;
        assert_eq!(read_trailer(&unknown), None, "an unknown kind");
        assert_ne!(new_conn_id(), new_conn_id());
    }

    #[test]
    fn grants_round_trip_and_bound_reads() {
        let g = Grant { handle: 7, key: u64::MAX - 3, addr: 4096, len: 1000 };
        assert_eq!(Grant::decode(&g.encode()), Some(g));
        assert_eq!(Grant::decode(&g.encode()[..27]), None);
        assert_eq!(Grant::decode(&Grant { handle: 0, ..g }.encode()), None);
        assert_eq!(Grant::decode(&Grant { addr: u64::MAX, ..g }.encode()), None, "a wrapping range");
        assert!(g.covers(4096, 1000) && g.covers(5000, 96));
        assert!(!g.covers(4095, 10) && !g.covers(5000, 97) && !g.covers(u64::MAX, 2));
        assert_eq!(decode_revoke(&7u32.to_le_bytes()), Some(7));
        assert_eq!(decode_revoke(&[1, 2, 3]), None);
    }
}
