//! The per-call header: what each rank believes the current collective is.
//!
//! At the start of every collective each rank sends its header to its right neighbour and,
//! while the call runs, compares the one from its left neighbour with its own. If all
//! neighbours agree, all ranks agree; if any two differ, at least one rank sees a mismatch,
//! fails with an error naming the argument and both values, and aborts the others. The
//! header goes out before the data and is checked whenever it arrives, so it costs one small
//! message and no round trip.

use crate::dtype::{DType, ReduceOp};
use crate::error::CollectiveError;
use crate::policy::{Algo, Op};

/// Encoded size.
pub(crate) const HEADER_LEN: usize = 40;

/// One rank's view of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// Number of collective calls made on the communicator, this one included.
    pub call: u64,
    pub op: Op,
    pub dtype: DType,
    pub reduce: Option<ReduceOp>,
    pub algo: Algo,
    pub root: u32,
    /// Elements of the buffer (allreduce, broadcast, reduce) or per block (allgather,
    /// reduce-scatter, alltoall).
    pub count: u64,
    /// Segment size in bytes (must agree: it shapes the messages).
    pub segment: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.call.to_be_bytes());
        b[8] = self.op as u8;
        b[9] = self.dtype as u8;
        b[10] = self.reduce.map(|r| r as u8).unwrap_or(0);
        b[11] = self.algo as u8;
        b[12..16].copy_from_slice(&self.root.to_be_bytes());
        b[16..24].copy_from_slice(&self.count.to_be_bytes());
        b[24..32].copy_from_slice(&self.segment.to_be_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Header> {
        if b.len() != HEADER_LEN {
            return None;
        }
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(Header {
            call: u64_at(0),
            op: Op::from_code(b[8])?,
            dtype: DType::from_code(b[9])?,
            reduce: if b[10] == 0 { None } else { Some(ReduceOp::from_code(b[10])?) },
            algo: Algo::from_code(b[11])?,
            root: u32::from_be_bytes(b[12..16].try_into().unwrap_or([0; 4])),
            count: u64_at(16),
            segment: u64_at(24),
        })
    }

    fn describe(&self) -> String {
        let mut s = format!("{}(count={}, dtype={}", self.op, self.count, self.dtype);
        if let Some(r) = self.reduce {
            s += &format!(", op={r}");
        }
        if matches!(self.op, Op::Broadcast | Op::Reduce) {
            s += &format!(", root={}", self.root);
        }
        s + &format!(") as call #{}", self.call)
    }

    /// Compares the header `theirs` from rank `peer` with this one.
    pub(crate) fn compare(&self, theirs: &[u8], rank: usize, peer: usize) -> Result<(), CollectiveError> {
        let op = self.op.name();
        let Some(t) = Header::decode(theirs) else {
            return Err(CollectiveError::Mismatch {
                rank,
                op,
                peer,
                message: "its call header is unreadable (a different Mobius version?)".into(),
            });
        };
        if *self == t {
            return Ok(());
        }
        let what = if t.call != self.call {
            format!(
                "rank {peer} is at collective call #{} and this rank at #{} (a rank skipped or added a collective)",
                t.call, self.call
            )
        } else if t.op != self.op {
            format!("rank {peer} called {} while this rank called {}", t.op, self.op)
        } else if t.count != self.count {
            format!("`count` differs: this rank passed {} elements, rank {peer} passed {}", self.count, t.count)
        } else if t.dtype != self.dtype {
            format!("`dtype` differs: this rank passed {}, rank {peer} passed {}", self.dtype, t.dtype)
        } else if t.reduce != self.reduce {
            format!(
                "the reduce `op` differs: this rank passed {}, rank {peer} passed {}",
                self.reduce.map(|r| r.name()).unwrap_or("-"),
                t.reduce.map(|r| r.name()).unwrap_or("-")
            )
        } else if t.root != self.root {
            format!("`root` differs: this rank passed {}, rank {peer} passed {}", self.root, t.root)
        } else if t.algo != self.algo {
            format!(
                "the chosen algorithm differs ({} here, {} on rank {peer}): MOBIUS_ALGO must be the same on every rank",
                self.algo, t.algo
            )
        } else {
            format!(
                "the segment size differs ({} here, {} on rank {peer}): MOBIUS_SEGMENT/MOBIUS_PROTO must be the same on every rank",
                self.segment, t.segment
            )
        };
        Err(CollectiveError::Mismatch {
            rank,
            op,
            peer,
            message: format!("{what}; this rank: {}, rank {peer}: {}", self.describe(), t.describe()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_name_the_differing_argument() {
        let h = Header {
            call: 3,
            op: Op::AllReduce,
            dtype: DType::F32,
            reduce: Some(ReduceOp::Sum),
            algo: Algo::Ring,
            root: 0,
            count: 10,
            segment: 65536,
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        assert!(h.compare(&h.encode(), 1, 0).is_ok());
        let e = h.compare(&Header { count: 12, ..h }.encode(), 1, 0).unwrap_err().to_string();
        assert!(e.contains("`count` differs") && e.contains("10") && e.contains("12") && e.contains("rank 0"), "{e}");
        let e = h.compare(&Header { dtype: DType::F64, ..h }.encode(), 1, 0).unwrap_err().to_string();
        assert!(e.contains("`dtype` differs") && e.contains("f64"), "{e}");
        let e = h.compare(&Header { op: Op::Broadcast, reduce: None, ..h }.encode(), 1, 0).unwrap_err().to_string();
        assert!(e.contains("called broadcast"), "{e}");
        let e = h.compare(&Header { call: 4, ..h }.encode(), 1, 0).unwrap_err().to_string();
        assert!(e.contains("#4") && e.contains("skipped"), "{e}");
        let e = h.compare(&Header { algo: Algo::RecursiveDoubling, ..h }.encode(), 1, 0).unwrap_err().to_string();
        assert!(e.contains("MOBIUS_ALGO"), "{e}");
        assert!(h.compare(b"junk", 1, 0).is_err());
    }
}
