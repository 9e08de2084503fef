//! The index checks: the registration scan of a whole index ([`scan_index`]) and the
//! resolve-time check of one reduce range ([`check_range`]), both reporting a [`Fault`].

use super::{MapId, ReduceId, ShuffleId, StoreError};

/// A format fault found in an index, without the ids (so it can be recorded on a
/// [`MapOutput`](super::MapOutput) and re-issued as a [`StoreError`] on every resolve, `io::Error` not being
/// `Clone`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    EmptyRange { start: u32, end: u32 },
    PartitionOutOfRange { start: u32, end: u32, num_partitions: u32 },
    IndexTooShort { entries: u64, needed: u64 },
    FirstOffsetNotZero { offset: i64 },
    OffsetsDecreasing { partition: u32, prev: i64, next: i64 },
    NegativeOffset { partition: u32, offset: i64 },
    OffsetPastEnd { partition: u32, offset: i64, data_len: u64 },
    LastOffsetMismatch { last_offset: i64, data_len: u64 },
}

impl Fault {
    pub(super) fn into_error(self, shuffle_id: ShuffleId, map_id: MapId) -> StoreError {
        match self {
            Fault::EmptyRange { start, end } => StoreError::EmptyRange { shuffle_id, map_id, start, end },
            Fault::PartitionOutOfRange { start, end, num_partitions } => {
                StoreError::PartitionOutOfRange { shuffle_id, map_id, start, end, num_partitions }
            }
            Fault::IndexTooShort { entries, needed } => StoreError::IndexTooShort { shuffle_id, map_id, entries, needed },
            Fault::FirstOffsetNotZero { offset } => StoreError::FirstOffsetNotZero { shuffle_id, map_id, offset },
            Fault::OffsetsDecreasing { partition, prev, next } => {
                StoreError::OffsetsDecreasing { shuffle_id, map_id, partition, prev, next }
            }
            Fault::NegativeOffset { partition, offset } => StoreError::NegativeOffset { shuffle_id, map_id, partition, offset },
            Fault::OffsetPastEnd { partition, offset, data_len } => {
                StoreError::OffsetPastEnd { shuffle_id, map_id, partition, offset, data_len }
            }
            Fault::LastOffsetMismatch { last_offset, data_len } => {
                StoreError::LastOffsetMismatch { shuffle_id, map_id, last_offset, data_len }
            }
        }
    }
}

/// Scans a whole index (exactly `numPartitions + 1` entries, at least one) against the data
/// length, in file order, and returns the first fault found.
pub(super) fn scan_index(offsets: &[i64], data_len: u64) -> Option<Fault> {
    let first = *offsets.first()?;
    if first != 0 {
        return Some(Fault::FirstOffsetNotZero { offset: first });
    }
    for (partition, pair) in offsets.windows(2).enumerate() {
        // The caller bounded the entry count to u32::MAX + 1, so partition fits in u32.
        let partition = partition as u32;
        let (start, end) = (pair[0], pair[1]);
        if end < start {
            return Some(Fault::OffsetsDecreasing { partition, prev: start, next: end });
        }
        // `end >= start >= 0` here (induction from first == 0), so the cast is exact.
        if end as u64 > data_len {
            return Some(Fault::OffsetPastEnd { partition, offset: end, data_len });
        }
    }
    let last = offsets[offsets.len() - 1];
    if last as u64 != data_len {
        return Some(Fault::LastOffsetMismatch { last_offset: last, data_len });
    }
    None
}

/// The resolve-time check of one reduce range: returns the byte range `[from, to)` of the data
/// file, guaranteed `from <= to <= data_len`, whatever the index contains.
pub(super) fn check_range(
    offsets: &[i64],
    data_len: u64,
    num_partitions: u32,
    start: ReduceId,
    end: ReduceId,
) -> Result<(u64, u64), Fault> {
    if start >= end {
        return Err(Fault::EmptyRange { start, end });
    }
    if end > num_partitions {
        return Err(Fault::PartitionOutOfRange { start, end, num_partitions });
    }
    let needed = u64::from(end) + 1;
    if (offsets.len() as u64) < needed {
        return Err(Fault::IndexTooShort { entries: offsets.len() as u64, needed });
    }
    let from = offsets[start as usize];
    if from < 0 {
        return Err(Fault::NegativeOffset { partition: start, offset: from });
    }
    // Every partition of the range must have a non-negative length: a batch whose total is
    // positive but whose inner offsets go backwards is still corrupt.
    for partition in start..end {
        let (prev, next) = (offsets[partition as usize], offsets[partition as usize + 1]);
        if next < prev {
            return Err(Fault::OffsetsDecreasing { partition, prev, next });
        }
    }
    let to = offsets[end as usize];
    // `to >= from >= 0` by the loop above.
    if to as u64 > data_len {
        return Err(Fault::OffsetPastEnd { partition: end - 1, offset: to, data_len });
    }
    Ok((from as u64, to as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_accepts_spark_layouts() {
        assert_eq!(scan_index(&[0], 0), None);
        assert_eq!(scan_index(&[0, 0, 0], 0), None);
        assert_eq!(scan_index(&[0, 3, 3, 10], 10), None);
    }

    #[test]
    fn scan_reports_first_fault_in_file_order() {
        assert_eq!(scan_index(&[4, 4, 10], 10), Some(Fault::FirstOffsetNotZero { offset: 4 }));
        assert_eq!(scan_index(&[0, 5, 3, 10], 10), Some(Fault::OffsetsDecreasing { partition: 1, prev: 5, next: 3 }));
        // A negative offset after a valid start is a decrease.
        assert_eq!(scan_index(&[0, -1, 10], 10), Some(Fault::OffsetsDecreasing { partition: 0, prev: 0, next: -1 }));
        assert_eq!(scan_index(&[0, 11, 11], 10), Some(Fault::OffsetPastEnd { partition: 0, offset: 11, data_len: 10 }));
        assert_eq!(scan_index(&[0, 4, 8], 10), Some(Fault::LastOffsetMismatch { last_offset: 8, data_len: 10 }));
        // i64::MIN / MAX must not wrap into something plausible.
        assert_eq!(scan_index(&[0, i64::MAX], 10), Some(Fault::OffsetPastEnd { partition: 0, offset: i64::MAX, data_len: 10 }));
    }

    #[test]
    fn range_check_returns_byte_range() {
        let idx = [0, 3, 3, 10];
        assert_eq!(check_range(&idx, 10, 3, 0, 1), Ok((0, 3)));
        assert_eq!(check_range(&idx, 10, 3, 1, 2), Ok((3, 3)));
        assert_eq!(check_range(&idx, 10, 3, 1, 3), Ok((3, 10)));
        assert_eq!(check_range(&idx, 10, 3, 0, 3), Ok((0, 10)));
    }

    #[test]
    fn range_check_rejects_bad_requests() {
        let idx = [0, 3, 3, 10];
        assert_eq!(check_range(&idx, 10, 3, 2, 2), Err(Fault::EmptyRange { start: 2, end: 2 }));
        assert_eq!(check_range(&idx, 10, 3, 2, 4), Err(Fault::PartitionOutOfRange { start: 2, end: 4, num_partitions: 3 }));
    }

    /// The resolve-time check stands on its own: it catches every kind of corrupt index even
    /// though registration would normally have refused it, so slicing can never go wrong.
    #[test]
    fn range_check_catches_corrupt_index_on_its_own() {
        // Index shorter than the declared partition count.
        assert_eq!(check_range(&[0, 3], 3, 3, 1, 3), Err(Fault::IndexTooShort { entries: 2, needed: 4 }));
        assert_eq!(check_range(&[0, -7, 3], 3, 2, 1, 2), Err(Fault::NegativeOffset { partition: 1, offset: -7 }));
        // Decrease inside a batch whose total span is positive.
        assert_eq!(check_range(&[0, 6, 2, 8], 8, 3, 0, 3), Err(Fault::OffsetsDecreasing { partition: 1, prev: 6, next: 2 }));
        assert_eq!(check_range(&[0, 6, 20], 8, 2, 1, 2), Err(Fault::OffsetPastEnd { partition: 1, offset: 20, data_len: 8 }));
        // A range untouched by the corruption still resolves.
        assert_eq!(check_range(&[0, 6, 2, 8], 8, 3, 0, 1), Ok((0, 6)));
    }
}
