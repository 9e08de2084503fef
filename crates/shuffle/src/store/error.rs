//! Errors of the map-output store: [`StoreError`] and its broad [`StoreErrorClass`].

use std::io;
use std::path::PathBuf;

use super::{MapId, ReduceId, ShuffleId};

/// Broad class of a [`StoreError`], for mapping onto protocol status codes without matching
/// every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreErrorClass {
    /// The shuffle or map output is not (or no longer) registered here.
    NotFound,
    /// The request itself is malformed (empty or out-of-range reduce range).
    BadRequest,
    /// The map output's files are inconsistent, truncated or gone; recomputing the map task is
    /// the cure.
    CorruptOutput,
    /// A file could not be opened or read.
    Io,
}

/// Why a registration or a resolve failed. Every variant names the shuffle and map output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No map output of this shuffle is registered (never registered, or unregistered).
    #[error("shuffle {shuffle_id} has no registered map outputs in this executor's store (never registered here, or already unregistered)")]
    UnknownShuffle {
        /// The shuffle asked for.
        shuffle_id: ShuffleId,
    },
    /// The shuffle is known but this map output is not registered here.
    #[error("shuffle {shuffle_id} map {map_id}: map output not registered in this executor's store (written by another executor, or unregistered)")]
    UnknownMapOutput {
        /// The shuffle asked for.
        shuffle_id: ShuffleId,
        /// The map output asked for.
        map_id: MapId,
    },
    /// The requested reduce range `[start, end)` is empty (`start >= end`).
    #[error("shuffle {shuffle_id} map {map_id}: empty reduce range [{start}, {end}); a fetch needs start < end")]
    EmptyRange {
        /// The shuffle asked for.
        shuffle_id: ShuffleId,
        /// The map output asked for.
        map_id: MapId,
        /// First reduce partition requested.
        start: ReduceId,
        /// One past the last reduce partition requested.
        end: ReduceId,
    },
    /// The requested reduce range reaches past the map output's partition count.
    #[error("shuffle {shuffle_id} map {map_id}: reduce range [{start}, {end}) is outside the map output's {num_partitions} partitions")]
    PartitionOutOfRange {
        /// The shuffle asked for.
        shuffle_id: ShuffleId,
        /// The map output asked for.
        map_id: MapId,
        /// First reduce partition requested.
        start: ReduceId,
        /// One past the last reduce partition requested.
        end: ReduceId,
        /// Number of reduce partitions of the map output.
        num_partitions: u32,
    },
    /// The index holds fewer entries than needed: `numPartitions + 1` at registration, or
    /// `end + 1` for a range at resolve time.
    #[error("shuffle {shuffle_id} map {map_id}: index file has {entries} offsets, needs at least {needed}")]
    IndexTooShort {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// Offsets present in the index.
        entries: u64,
        /// Offsets needed.
        needed: u64,
    },
    /// The index holds more entries than `numPartitions + 1` for the partition count the caller
    /// declared: the files do not belong to a shuffle of that many partitions.
    #[error(
        "shuffle {shuffle_id} map {map_id}: index file has {entries} offsets, expected exactly {expected} (numPartitions + 1)"
    )]
    IndexTooLong {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// Offsets present in the index.
        entries: u64,
        /// Offsets expected.
        expected: u64,
    },
    /// The index file's size is not a multiple of 8 bytes (truncated or not an index).
    #[error("shuffle {shuffle_id} map {map_id}: index file is {len} bytes, not a whole number of 8-byte offsets")]
    IndexNotMultipleOf8 {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// Size of the index file in bytes.
        len: u64,
    },
    /// The index file is larger than the configured bound; it was not read.
    #[error("shuffle {shuffle_id} map {map_id}: index file has {entries} offsets, more than the limit of {limit} (StoreConfig::max_index_entries); raise the limit only if the shuffle really has that many partitions")]
    IndexTooLarge {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// Offsets in the file (its size / 8).
        entries: u64,
        /// The limit in force.
        limit: u64,
    },
    /// The first offset of the index is not 0.
    #[error("shuffle {shuffle_id} map {map_id}: index starts at offset {offset}, Spark's format requires 0")]
    FirstOffsetNotZero {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// The first offset found.
        offset: i64,
    },
    /// Reduce partition `partition` would have a negative length: `off[partition+1] <
    /// off[partition]`.
    #[error("shuffle {shuffle_id} map {map_id}: index offsets decrease at partition {partition} (start {prev}, end {next})")]
    OffsetsDecreasing {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// The reduce partition whose end is before its start.
        partition: u32,
        /// `off[partition]`.
        prev: i64,
        /// `off[partition + 1]`.
        next: i64,
    },
    /// The start offset of reduce partition `partition` is negative.
    #[error("shuffle {shuffle_id} map {map_id}: index offset of partition {partition} is negative ({offset})")]
    NegativeOffset {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// The reduce partition whose start offset is negative.
        partition: u32,
        /// The offset found.
        offset: i64,
    },
    /// Reduce partition `partition` ends past the end of the data file.
    #[error("shuffle {shuffle_id} map {map_id}: partition {partition} ends at offset {offset}, past the end of the {data_len}-byte data file")]
    OffsetPastEnd {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// The reduce partition whose end offset is past the data.
        partition: u32,
        /// `off[partition + 1]`.
        offset: i64,
        /// Length of the data file.
        data_len: u64,
    },
    /// The last offset does not equal the data file's length (the data file has bytes no
    /// partition accounts for).
    #[error("shuffle {shuffle_id} map {map_id}: index ends at offset {last_offset} but the data file is {data_len} bytes")]
    LastOffsetMismatch {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// The last offset of the index.
        last_offset: i64,
        /// Length of the data file.
        data_len: u64,
    },
    /// The data file is shorter now than when it was registered (truncated after commit).
    #[error("shuffle {shuffle_id} map {map_id}: data file truncated: {path} is {actual} bytes, {what} needs {expected} (index offsets)")]
    DataTruncated {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// What needed the bytes: `reduce [start, end)` or `a read at offset N`.
        what: String,
        /// The data file.
        path: PathBuf,
        /// Bytes the request needs (its end offset in the file).
        expected: u64,
        /// The file's length now.
        actual: u64,
    },
    /// The data file was deleted (or another file put at its path) after it was registered.
    #[error(
        "shuffle {shuffle_id} map {map_id}: data file missing: {path} was deleted or replaced after the map output was registered ({what})"
    )]
    DataFileMissing {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// What needed the bytes: `reduce [start, end)` or `a read at offset N`.
        what: String,
        /// The data file.
        path: PathBuf,
    },
    /// A file could not be opened, inspected or read.
    #[error("shuffle {shuffle_id} map {map_id}: cannot {action} {path}: {source}")]
    Io {
        /// The shuffle of the map output.
        shuffle_id: ShuffleId,
        /// The map output.
        map_id: MapId,
        /// What was being done (`open`, `read`, `stat`, `memory-map`).
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
}

impl StoreError {
    /// The shuffle the error is about.
    pub fn shuffle_id(&self) -> ShuffleId {
        match self {
            Self::UnknownShuffle { shuffle_id }
            | Self::UnknownMapOutput { shuffle_id, .. }
            | Self::EmptyRange { shuffle_id, .. }
            | Self::PartitionOutOfRange { shuffle_id, .. }
            | Self::IndexTooShort { shuffle_id, .. }
            | Self::IndexTooLong { shuffle_id, .. }
            | Self::IndexNotMultipleOf8 { shuffle_id, .. }
            | Self::IndexTooLarge { shuffle_id, .. }
            | Self::FirstOffsetNotZero { shuffle_id, .. }
            | Self::OffsetsDecreasing { shuffle_id, .. }
            | Self::NegativeOffset { shuffle_id, .. }
            | Self::OffsetPastEnd { shuffle_id, .. }
            | Self::LastOffsetMismatch { shuffle_id, .. }
            | Self::DataTruncated { shuffle_id, .. }
            | Self::DataFileMissing { shuffle_id, .. }
            | Self::Io { shuffle_id, .. } => *shuffle_id,
        }
    }

    /// The map output the error is about; `None` for [`StoreError::UnknownShuffle`].
    pub fn map_id(&self) -> Option<MapId> {
        match self {
            Self::UnknownShuffle { .. } => None,
            Self::UnknownMapOutput { map_id, .. }
            | Self::EmptyRange { map_id, .. }
            | Self::PartitionOutOfRange { map_id, .. }
            | Self::IndexTooShort { map_id, .. }
            | Self::IndexTooLong { map_id, .. }
            | Self::IndexNotMultipleOf8 { map_id, .. }
            | Self::IndexTooLarge { map_id, .. }
            | Self::FirstOffsetNotZero { map_id, .. }
            | Self::OffsetsDecreasing { map_id, .. }
            | Self::NegativeOffset { map_id, .. }
            | Self::OffsetPastEnd { map_id, .. }
            | Self::LastOffsetMismatch { map_id, .. }
            | Self::DataTruncated { map_id, .. }
            | Self::DataFileMissing { map_id, .. }
            | Self::Io { map_id, .. } => Some(*map_id),
        }
    }

    /// The broad class of the error (what a block server tells its client).
    pub fn class(&self) -> StoreErrorClass {
        match self {
            Self::UnknownShuffle { .. } | Self::UnknownMapOutput { .. } => StoreErrorClass::NotFound,
            Self::EmptyRange { .. } | Self::PartitionOutOfRange { .. } => StoreErrorClass::BadRequest,
            Self::IndexTooShort { .. }
            | Self::IndexTooLong { .. }
            | Self::IndexNotMultipleOf8 { .. }
            | Self::IndexTooLarge { .. }
            | Self::FirstOffsetNotZero { .. }
            | Self::OffsetsDecreasing { .. }
            | Self::NegativeOffset { .. }
            | Self::OffsetPastEnd { .. }
            | Self::LastOffsetMismatch { .. }
            | Self::DataTruncated { .. }
            | Self::DataFileMissing { .. } => StoreErrorClass::CorruptOutput,
            Self::Io { .. } => StoreErrorClass::Io,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::index::Fault;

    #[test]
    fn error_accessors_and_classes() {
        let e = Fault::OffsetsDecreasing { partition: 1, prev: 6, next: 2 }.into_error(7, 42);
        assert_eq!(e.shuffle_id(), 7);
        assert_eq!(e.map_id(), Some(42));
        assert_eq!(e.class(), StoreErrorClass::CorruptOutput);
        let msg = e.to_string();
        assert!(msg.contains("shuffle 7 map 42"), "{msg}");
        assert!(msg.contains("partition 1"), "{msg}");

        let e = StoreError::UnknownShuffle { shuffle_id: 9 };
        assert_eq!(e.map_id(), None);
        assert_eq!(e.class(), StoreErrorClass::NotFound);
        assert_eq!(Fault::EmptyRange { start: 1, end: 1 }.into_error(0, 0).class(), StoreErrorClass::BadRequest);
    }
}
