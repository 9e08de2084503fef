//! The verbs data-plane bootstrap record, carried in the `Attach` frame of the control socket
//! after the handshake authenticated the peer.
//!
//! It is the only bytes of a peer the verbs provider decodes itself (everything else goes
//! through the `wire` codec), so it is bounded and checked field by field, never panics, and
//! has its own fuzz target (`fuzz/fuzz_targets/verbs_bootstrap.rs`). Compiled without the
//! `verbs` feature so the fuzzer needs no libibverbs.
//!
//! ```text
//!  0     4      8     12    16         32    36           40        44
//!  | magic | qpn | psn | mtu | gid (16) | max_message | recv_credits |
//! ```
//!
//! All integers big-endian. `qpn` and `psn` are 24-bit values; `mtu` is the verbs enum
//! (1 = 256 B … 5 = 4096 B); `max_message` is the largest message the sender's receive
//! buffers take; `recv_credits` is how many messages it lets the peer have in flight towards
//! it (informational: the block protocol's own credits bound what is sent).
#![forbid(unsafe_code)]

use std::fmt;
use thiserror::Error;

/// `"RSV2"`.
pub const MAGIC: [u8; 4] = *b"RSV2";
/// Encoded length.
pub const LEN: usize = 44;
/// Smallest receive buffer a peer may announce.
pub const MIN_MESSAGE: u32 = 1024;
/// Largest receive buffer a peer may announce.
pub const MAX_MESSAGE: u32 = 64 << 20;

/// What one side tells the other to connect its queue pair.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct AttachRecord {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Active path MTU, as the verbs enum value (1..=5).
    pub mtu: u32,
    /// The sender's GID (RoCEv2: an IPv4-mapped IPv6 address).
    pub gid: [u8; 16],
    /// Largest message the sender's receive buffers take.
    pub max_message: u32,
    /// Messages the sender's receive queue holds for this peer.
    pub recv_credits: u32,
}

impl fmt::Debug for AttachRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AttachRecord(qpn {:#x}, psn {:#x}, mtu {}, max_message {}, credits {})",
            self.qpn, self.psn, self.mtu, self.max_message, self.recv_credits
        )
    }
}

/// Why bytes are not a valid record.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BootstrapError {
    /// Not exactly [`LEN`] bytes.
    #[error("bootstrap record of {0} bytes (expected {LEN})")]
    Length(usize),
    /// Wrong magic: not a verbs engine of this protocol.
    #[error("bad bootstrap magic {0:02x?}: the peer is not a verbs rdma-shuffle engine of this version")]
    Magic([u8; 4]),
    /// A field out of range.
    #[error("bootstrap field {field} = {value} is out of range ({allowed})")]
    Field {
        /// Field name.
        field: &'static str,
        /// Value received.
        value: u64,
        /// What is allowed.
        allowed: &'static str,
    },
}

impl AttachRecord {
    /// The encoded record.
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&(self.qpn & 0xff_ffff).to_be_bytes());
        b[8..12].copy_from_slice(&(self.psn & 0xff_ffff).to_be_bytes());
        b[12..16].copy_from_slice(&self.mtu.to_be_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b[32..36].copy_from_slice(&self.max_message.to_be_bytes());
        b[36..40].copy_from_slice(&self.recv_credits.to_be_bytes());
        b
    }

    /// Decodes and checks a record.
    pub fn decode(b: &[u8]) -> Result<AttachRecord, BootstrapError> {
        if b.len() != LEN {
            return Err(BootstrapError::Length(b.len()));
        }
        let u = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut magic = [0u8; 4];
        magic.copy_from_slice(&b[0..4]);
        if magic != MAGIC {
            return Err(BootstrapError::Magic(magic));
        }
        let field = |field, value: u32, ok: bool, allowed| {
            if ok {
                Ok(value)
            } else {
                Err(BootstrapError::Field { field, value: value as u64, allowed })
            }
        };
        let qpn = u(4);
        let qpn = field("qpn", qpn, qpn <= 0xff_ffff && qpn > 1, "2..=0xffffff")?;
        let psn = u(8);
        let psn = field("psn", psn, psn <= 0xff_ffff, "0..=0xffffff")?;
        let mtu = u(12);
        let mtu = field("mtu", mtu, (1..=5).contains(&mtu), "1..=5")?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        let max_message = u(32);
        let max_message =
            field("max_message", max_message, (MIN_MESSAGE..=MAX_MESSAGE).contains(&max_message), "1 KiB..=64 MiB")?;
        let recv_credits = u(36);
        let recv_credits = field("recv_credits", recv_credits, recv_credits >= 1, ">= 1")?;
        if b[40..44] != [0, 0, 0, 0] {
            return Err(BootstrapError::Field { field: "reserved", value: u(40) as u64, allowed: "0" });
        }
        Ok(AttachRecord { qpn, psn, mtu, gid, max_message, recv_credits })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AttachRecord {
        AttachRecord { qpn: 0x123, psn: 0xabcde, mtu: 3, gid: [7; 16], max_message: 69632, recv_credits: 64 }
    }

    #[test]
    fn records_round_trip_and_every_field_is_checked() {
        let r = sample();
        assert_eq!(AttachRecord::decode(&r.encode()), Ok(r));
        assert_eq!(AttachRecord::decode(&r.encode()[..LEN - 1]), Err(BootstrapError::Length(LEN - 1)));
        let mut b = r.encode();
        b[0] = b'X';
        assert!(matches!(AttachRecord::decode(&b), Err(BootstrapError::Magic(_))));
        for (at, field) in [(4, "qpn"), (12, "mtu"), (32, "max_message"), (36, "recv_credits"), (40, "reserved")] {
            let mut b = r.encode();
            b[at..at + 4].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
            if field == "recv_credits" {
                b[at..at + 4].copy_from_slice(&[0, 0, 0, 0]);
            }
            match AttachRecord::decode(&b) {
                Err(BootstrapError::Field { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
