//! What two ends exchange to attach a connection to their reliable-datagram endpoints, and
//! the routing word in front of every message between attached connections.
//!
//! One RDM endpoint per driver loop carries every connection of that loop, and two processes
//! may hold several connections between the same pair of endpoints; so a message names the
//! connection it is for (the receiver's 64-bit connection id, drawn at random so a peer cannot
//! guess another connection's), not just the endpoint it came from. The record travels over
//! the connection's control plane after the peer authenticated, and is bounded and checked
//! before anything in it reaches libfabric.

/// Version of the record's layout.
const VERSION: u8 = 1;

/// The longest endpoint address accepted (libfabric's are 16 to ~100 bytes: sockaddr_in,
/// sockaddr_in6, shm's path-like names, verbs' address blocks).
pub const MAX_ADDRESS: usize = 256;

/// One end's attach record: its connection id and its endpoint's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRecord {
    /// The sender's id for this connection: what the peer puts in front of messages to it.
    pub conn_id: u64,
    /// The sender's endpoint address (`fi_getname`).
    pub address: Vec<u8>,
}

/// Why a record was refused.
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
    #[error("attach record version {0}, this build reads version 1")]
    Version(u8),
    /// An address longer than any libfabric provider's.
    #[error("attach record states a {0}-byte address, more than {MAX_ADDRESS}")]
    AddressTooLong(usize),
    /// Bytes after the record.
    #[error("attach record followed by {0} stray bytes")]
    Trailing(usize),
    /// Connection id 0 (reserved: never drawn).
    #[error("attach record with connection id 0")]
    ZeroId,
}

impl AttachRecord {
    /// version (1) · conn_id (8, little-endian) · address length (2) · address.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(11 + self.address.len());
        out.push(VERSION);
        out.extend_from_slice(&self.conn_id.to_le_bytes());
        out.extend_from_slice(&(self.address.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.address);
        out
    }

    /// Reads a record, refusing any other length than the one it states.
    pub fn decode(bytes: &[u8]) -> Result<Self, AttachError> {
        if bytes.len() < 11 {
            return Err(AttachError::Truncated { got: bytes.len(), need: 11 });
        }
        if bytes[0] != VERSION {
            return Err(AttachError::Version(bytes[0]));
        }
        let conn_id = u64::from_le_bytes(bytes[1..9].try_into().expect("8 bytes"));
        if conn_id == 0 {
            return Err(AttachError::ZeroId);
        }
        let len = u16::from_le_bytes([bytes[9], bytes[10]]) as usize;
        if len > MAX_ADDRESS {
            return Err(AttachError::AddressTooLong(len));
        }
        let need = 11 + len;
        match bytes.len() {
            n if n < need => Err(AttachError::Truncated { got: n, need }),
            n if n > need => Err(AttachError::Trailing(n - need)),
            _ => Ok(AttachRecord { conn_id, address: bytes[11..].to_vec() }),
        }
    }
}

/// Bytes of the routing word in front of each message.
pub const ROUTE_LEN: usize = 8;

/// The routing word for a message to the connection the peer numbered `conn_id`.
pub fn route(conn_id: u64) -> [u8; ROUTE_LEN] {
    conn_id.to_le_bytes()
}

/// Splits a received message into the connection id it is for and its frame; `None` for a
/// message too short to carry one (dropped and counted by the caller).
pub fn split(message: &[u8]) -> Option<(u64, &[u8])> {
    let (word, frame) = message.split_at_checked(ROUTE_LEN)?;
    Some((u64::from_le_bytes(word.try_into().expect("8 bytes")), frame))
}

/// A new connection id: random (the thread-local generator is seeded from the OS), nonzero.
pub fn new_conn_id() -> u64 {
    rand::random::<u64>().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let r = AttachRecord { conn_id: 0x1234_5678_9abc_def0, address: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1] };
        assert_eq!(AttachRecord::decode(&r.encode()), Ok(r));
    }

    #[test]
    fn lying_and_malformed_records_are_refused() {
        let good = AttachRecord { conn_id: 7, address: vec![9; 16] }.encode();
        assert_eq!(AttachRecord::decode(&good[..5]), Err(AttachError::Truncated { got: 5, need: 11 }));
        assert_eq!(AttachRecord::decode(&good[..20]), Err(AttachError::Truncated { got: 20, need: 27 }));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(AttachRecord::decode(&long), Err(AttachError::Trailing(1)));
        let mut v = good.clone();
        v[0] = 2;
        assert_eq!(AttachRecord::decode(&v), Err(AttachError::Version(2)));
        let mut huge = good.clone();
        huge[9..11].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(AttachRecord::decode(&huge), Err(AttachError::AddressTooLong(65535)));
        let zero = AttachRecord { conn_id: 0, address: vec![1] }.encode();
        assert_eq!(AttachRecord::decode(&zero), Err(AttachError::ZeroId));
        // Every prefix of a good record is refused, never read past.
        for n in 0..good.len() {
            assert!(AttachRecord::decode(&good[..n]).is_err(), "prefix of {n} bytes");
        }
    }

    #[test]
    fn messages_carry_their_connection() {
        let mut m = route(42).to_vec();
        m.extend_from_slice(b"frame");
        assert_eq!(split(&m), Some((42, &b"frame"[..])));
        assert_eq!(split(&m[..7]), None);
        assert_ne!(new_conn_id(), new_conn_id());
    }
}
