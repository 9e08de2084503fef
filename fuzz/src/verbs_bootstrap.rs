//! The `verbs_bootstrap` harness: arbitrary bytes through the verbs attach-record decoder
//! (`rdma_shuffle_provider_verbs::bootstrap`), the only bytes of a peer the verbs
//! provider decodes itself.
//!
//! Asserted: decoding never panics; a record that decodes re-encodes to exactly the input
//! (the format is canonical: reserved bytes must be zero, 24-bit fields must fit), and every
//! field of a decoded record is within the documented bounds.

use verbs::bootstrap::{AttachRecord, LEN, MAX_MESSAGE, MIN_MESSAGE};

/// Runs every check on `data`.
pub fn run(data: &[u8]) {
    match AttachRecord::decode(data) {
        Ok(r) => {
            assert_eq!(data.len(), LEN);
            assert_eq!(&r.encode()[..], data, "{r:?} does not re-encode to its input");
            assert!(r.qpn > 1 && r.qpn <= 0xff_ffff && r.psn <= 0xff_ffff, "{r:?}");
            assert!((1..=5).contains(&r.mtu), "{r:?}");
            assert!((MIN_MESSAGE..=MAX_MESSAGE).contains(&r.max_message) && r.recv_credits >= 1, "{r:?}");
        }
        Err(e) => {
            // Every error names what is wrong; formatting it must not panic either.
            assert!(!e.to_string().is_empty());
        }
    }
}

/// Seeds: a valid record, and one with each field at a bound.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let base = AttachRecord { qpn: 0x11, psn: 0x123456, mtu: 3, gid: [0xfe; 16], max_message: 69632, recv_credits: 512 };
    let mut out = vec![("valid".to_string(), base.encode().to_vec())];
    let edges = [
        ("max-qpn", AttachRecord { qpn: 0xff_ffff, ..base }),
        ("mtu-4096", AttachRecord { mtu: 5, ..base }),
        ("min-message", AttachRecord { max_message: MIN_MESSAGE, recv_credits: 1, ..base }),
        ("max-message", AttachRecord { max_message: MAX_MESSAGE, ..base }),
    ];
    for (name, r) in edges {
        out.push((name.to_string(), r.encode().to_vec()));
    }
    let mut short = base.encode().to_vec();
    short.pop();
    out.push(("short".to_string(), short));
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn seeds_pass() {
        for (name, s) in super::seeds() {
            super::run(&s);
            assert!(!name.is_empty());
        }
    }
}
