//! The map-output store: Spark's own sort-shuffle files, indexed in memory and read with
//! `pread` (or sent with `sendfile`) from the open data file.
//!
//! The data file is never memory-mapped for the CPU: a file truncated after commit would make
//! the first read past its new end raise SIGBUS and kill the executor. `pread` sees the short
//! file instead, and every resolve checks the file's current length against the index, so a
//! truncated or deleted data file gives a typed [`StoreError::DataTruncated`] /
//! [`StoreError::DataFileMissing`], which the reducer receives as a fetch failure (Spark then
//! recomputes the map output). RDMA exposure maps a region privately per request from the
//! descriptor (`rdma_shuffle_fabric` verbs), after the same length check.
//!
//! # The on-disk format (Spark's `IndexShuffleBlockResolver`)
//!
//! Each committed map task leaves two files in the executor's block-manager directories:
//!
//! * `shuffle_<shuffleId>_<mapId>_0.data` — the bytes of every reduce partition, back to back;
//! * `shuffle_<shuffleId>_<mapId>_0.index` — `numPartitions + 1` **big-endian `i64`** offsets
//!   into the data file: the first is 0, they never decrease, and the last equals the length of
//!   the data file.
//!
//! Reduce partition `r` is the byte range `[off[r], off[r+1])`; a batch fetch of the contiguous
//! reduce range `[start, end)` (Spark's `ShuffleBlockBatchId`) is `[off[start], off[end])`.
//! When a map task writes no bytes at all, Spark commits an all-zero index and *no* data file;
//! the store accepts that case (see [`MapOutputStore::register`]).
//!
//! # Id types
//!
//! Spark's shuffle and reduce ids are JVM `Int`s and map ids (task attempt ids) are `Long`s, all
//! non-negative in practice. The store uses unsigned types ([`ShuffleId`] = `u32`,
//! [`ReduceId`] = `u32`, [`MapId`] = `u64`): the JNI / wire edge must reject negative values
//! before they get here, so nothing inside has to reason about negative ids.
//!
//! # What is checked when
//!
//! * **At registration** (once per map task, off the fetch path): everything that needs I/O —
//!   both files open, the index's size is bounded by [`StoreConfig::max_index_entries`] before
//!   it is read, is a whole number of 8-byte entries and has `numPartitions + 1` of them, and the
//!   data file's length is taken. Then the whole index is scanned once against the data file's length
//!   (first offset 0, never decreasing, nothing past the end, last offset == data length). What
//!   happens to an index that fails this scan is [`StoreConfig::corrupt_index`]: by default the
//!   registration is refused; with [`CorruptIndexPolicy::FailResolves`] the output is kept and
//!   every fetch from it fails with the recorded typed error (the reduce side then reports a
//!   fetch failure and Spark recomputes the map task).
//! * **At every resolve**, independently of what registration concluded: the request range is
//!   well-formed and inside the partition count, the index has the entries it needs, and the
//!   offsets of *that range* are non-negative, non-decreasing and inside the registered data
//!   length; then the data file still exists and is still that long (one `stat` and one
//!   `fstat`). This costs `O(end - start)`: no index content can make a resolve panic or read
//!   outside the file, and one corrupt map output only fails the fetches that touch it.
//!
//! # Lifetime
//!
//! Outputs are handed out as `Arc<MapOutput>` inside a [`BlockSlice`]. Unregistering a shuffle
//! removes its outputs from the store at once (later resolves fail with
//! [`StoreError::UnknownShuffle`]) while a transfer that already holds a slice keeps the file
//! descriptor alive until it drops the slice.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::open_files::{FileIdentity, OpenFiles, ReopenError};
use parking_lot::RwLock;

/// A Spark shuffle id (a JVM `Int`, checked non-negative at the edge).
pub type ShuffleId = u32;
/// A Spark map id: the map task's attempt id (a JVM `Long`, checked non-negative at the edge).
pub type MapId = u64;
/// A Spark reduce partition id (a JVM `Int`, checked non-negative at the edge).
pub type ReduceId = u32;

/// Default for [`StoreConfig::max_index_entries`]: 2^24 entries, i.e. a 128 MiB index for a
/// shuffle of about 16.7 million reduce partitions — far beyond any real Spark job, yet small
/// enough that a garbage file cannot make the executor allocate gigabytes.
pub const DEFAULT_MAX_INDEX_ENTRIES: u64 = 1 << 24;

/// Spark partition counts are JVM `Int`s; the store keeps them as `u32`, so an index can never
/// usefully hold more than `u32::MAX + 1` entries whatever the configuration says.
const HARD_MAX_INDEX_ENTRIES: u64 = u32::MAX as u64 + 1;

/// What [`MapOutputStore::register`] does with an index whose offsets are inconsistent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CorruptIndexPolicy {
    /// Refuse the registration with the typed error; the store is left unchanged. The map side
    /// learns about the corruption at commit time.
    #[default]
    RejectRegistration,
    /// Accept the registration, log a warning, and fail every resolve on this output with the
    /// typed error found at registration. The reduce side then gets a fetch failure and Spark
    /// recomputes the map task, which is Spark's own recovery path for a bad map output.
    FailResolves,
}

/// Settings of a [`MapOutputStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Largest index file accepted, in 8-byte entries (partitions + 1). Checked from the file's
    /// size before anything is read, so a garbage file cannot cause a huge allocation.
    /// Values above `u32::MAX + 1` behave as `u32::MAX + 1` (Spark partition counts are `Int`s).
    pub max_index_entries: u64,
    /// What to do with an index whose offsets fail the registration scan.
    pub corrupt_index: CorruptIndexPolicy,
    /// Data files the store keeps open at most (least recently used closed first, reopened
    /// on demand); `spark.shuffle.rdma.store.maxOpenFiles`.
    pub max_open_files: usize,
}

/// Default for [`StoreConfig::max_open_files`].
pub const DEFAULT_MAX_OPEN_FILES: usize = 1024;

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            max_index_entries: DEFAULT_MAX_INDEX_ENTRIES,
            corrupt_index: CorruptIndexPolicy::default(),
            max_open_files: DEFAULT_MAX_OPEN_FILES,
        }
    }
}

/// The files of one committed map task, as handed to [`MapOutputStore::register`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapOutputFiles {
    /// The shuffle the map task belongs to.
    pub shuffle_id: ShuffleId,
    /// The map task's attempt id (Spark's `mapId` since Spark 3.0).
    pub map_id: MapId,
    /// Path of `shuffle_<shuffleId>_<mapId>_0.data`. May be absent on disk when the index says
    /// every partition is empty (Spark writes no data file then).
    pub data_path: PathBuf,
    /// Path of `shuffle_<shuffleId>_<mapId>_0.index`.
    pub index_path: PathBuf,
    /// The shuffle's number of reduce partitions, when the caller knows it (the map side does:
    /// it is the partitioner's `numPartitions`). With `Some(n)` the index must hold exactly
    /// `n + 1` entries; with `None` the count is taken from the index's size.
    pub num_partitions: Option<u32>,
}

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

/// A format fault found in an index, without the ids (so it can be recorded on a
/// [`MapOutput`] and re-issued as a [`StoreError`] on every resolve, `io::Error` not being
/// `Clone`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
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
    fn into_error(self, shuffle_id: ShuffleId, map_id: MapId) -> StoreError {
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
fn scan_index(offsets: &[i64], data_len: u64) -> Option<Fault> {
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
fn check_range(offsets: &[i64], data_len: u64, num_partitions: u32, start: ReduceId, end: ReduceId) -> Result<(u64, u64), Fault> {
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

/// Identity of one registration of a map output, unique within the process. A re-registration
/// of the same `(shuffle, map)` gets a new id, so anything cached per mapping (an RDMA memory
/// registration, a remote key) can tell the old mapping from the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MapOutputId(u64);

impl MapOutputId {
    /// The id as a number (for logs and protocol fields).
    pub fn get(self) -> u64 {
        self.0
    }

    fn next() -> Self {
        // Process-wide rather than per store, so ids never collide between stores either.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for MapOutputId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mo#{}", self.0)
    }
}

/// One registered map output: its index in memory, its data file open read-only.
///
/// Shared as `Arc<MapOutput>`; the file descriptor lives until the last holder (the store or
/// an in-flight transfer) drops it.
pub struct MapOutput {
    id: MapOutputId,
    shuffle_id: ShuffleId,
    map_id: MapId,
    num_partitions: u32,
    offsets: Box<[i64]>,
    data_len: u64,
    data_path: PathBuf,
    index_path: PathBuf,
    /// The data file's identity; `None` only when Spark wrote no data file because every
    /// partition is empty.
    data_file: Option<FileIdentity>,
    /// Where the open data file is kept (and reopened from after an eviction).
    open_files: Arc<OpenFiles>,
    /// First fault of the registration scan, kept under [`CorruptIndexPolicy::FailResolves`].
    fault: Option<Fault>,
}

impl fmt::Debug for MapOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapOutput")
            .field("id", &self.id)
            .field("shuffle_id", &self.shuffle_id)
            .field("map_id", &self.map_id)
            .field("num_partitions", &self.num_partitions)
            .field("data_len", &self.data_len)
            .field("data_path", &self.data_path)
            .field("index_valid", &self.fault.is_none())
            .finish_non_exhaustive()
    }
}

impl Drop for MapOutput {
    fn drop(&mut self) {
        // The last holder is gone (unregistered, replaced, and no transfer left): close it.
        self.open_files.remove(self.id.0);
    }
}

impl MapOutput {
    /// Identity of this registration.
    pub fn id(&self) -> MapOutputId {
        self.id
    }

    /// The shuffle this output belongs to.
    pub fn shuffle_id(&self) -> ShuffleId {
        self.shuffle_id
    }

    /// The map task attempt that wrote it.
    pub fn map_id(&self) -> MapId {
        self.map_id
    }

    /// Number of reduce partitions.
    pub fn num_partitions(&self) -> u32 {
        self.num_partitions
    }

    /// Length of the data file in bytes (0 when Spark wrote none).
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// Path of the data file.
    pub fn data_path(&self) -> &Path {
        &self.data_path
    }

    /// Path of the index file.
    pub fn index_path(&self) -> &Path {
        &self.index_path
    }

    /// The open data file (read-only), for `sendfile` and `pread` from its descriptor and for
    /// private mappings of one region (RDMA exposure, after [`MapOutput::check_data`]); opened
    /// again if the store closed it to stay under [`StoreConfig::max_open_files`], and only if
    /// it is still the registered file. `None` only when Spark wrote no data file because
    /// every partition is empty.
    pub fn file(&self) -> Result<Option<Arc<File>>, StoreError> {
        let Some(identity) = self.data_file else {
            return Ok(None);
        };
        let (shuffle_id, map_id) = (self.shuffle_id, self.map_id);
        let missing =
            |what: &str| StoreError::DataFileMissing { shuffle_id, map_id, what: what.into(), path: self.data_path.clone() };
        match self.open_files.get(self.id.0, &self.data_path, identity) {
            Ok(f) => Ok(Some(f)),
            Err(ReopenError::Missing) => Err(missing("found when reopening it")),
            Err(ReopenError::Replaced) => Err(missing("another file is at its path now")),
            Err(ReopenError::Io(source)) => {
                Err(StoreError::Io { shuffle_id, map_id, action: "reopen", path: self.data_path.clone(), source })
            }
        }
    }

    /// Checks that the data file still exists and holds the first `needed` bytes: a file
    /// deleted or truncated after commit gives a typed error instead of a short read (or, with
    /// a mapping, SIGBUS). `what` names the request in the error.
    pub fn check_data(&self, needed: u64, what: &dyn Fn() -> String) -> Result<(), StoreError> {
        if self.data_file.is_none() {
            // No data file: every partition is empty, so nothing is ever read.
            return Ok(());
        }
        let (shuffle_id, map_id) = (self.shuffle_id, self.map_id);
        match std::fs::metadata(&self.data_path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::DataFileMissing { shuffle_id, map_id, what: what(), path: self.data_path.clone() })
            }
            // A different file now at the path (a rename over it) is not ours to judge: Spark
            // re-registers the output when it replaces it; until then the open file serves.
            _ => {}
        }
        let Some(file) = self.file()? else { return Ok(()) };
        let actual = file
            .metadata()
            .map_err(|source| StoreError::Io { shuffle_id, map_id, action: "stat", path: self.data_path.clone(), source })?
            .len();
        if actual < needed {
            return Err(StoreError::DataTruncated {
                shuffle_id,
                map_id,
                what: what(),
                path: self.data_path.clone(),
                expected: needed,
                actual,
            });
        }
        Ok(())
    }

    /// Reads `dst.len()` bytes of the data file from `offset` with `pread`. A file truncated
    /// since registration gives [`StoreError::DataTruncated`]; nothing is ever read through a
    /// memory mapping.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), StoreError> {
        if dst.is_empty() {
            return Ok(());
        }
        let what = || format!("a read of {} bytes at offset {offset}", dst.len());
        let needed = offset.saturating_add(dst.len() as u64);
        let (shuffle_id, map_id) = (self.shuffle_id, self.map_id);
        let Some(file) = self.file()? else {
            return Err(StoreError::DataTruncated {
                shuffle_id,
                map_id,
                what: what(),
                path: self.data_path.clone(),
                expected: needed,
                actual: 0,
            });
        };
        let mut done = 0;
        while done < dst.len() {
            match file.read_at(&mut dst[done..], offset + done as u64) {
                Ok(0) => {
                    let actual = file.metadata().map(|m| m.len()).unwrap_or(offset + done as u64);
                    let what = format!("a read of {} bytes at offset {offset}", dst.len());
                    return Err(StoreError::DataTruncated {
                        shuffle_id,
                        map_id,
                        what,
                        path: self.data_path.clone(),
                        expected: needed,
                        actual,
                    });
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(StoreError::Io { shuffle_id, map_id, action: "read", path: self.data_path.clone(), source })
                }
            }
        }
        Ok(())
    }

    /// The index offsets as read from disk (`numPartitions + 1` of them), unvalidated when
    /// [`MapOutput::index_valid`] is false.
    pub fn offsets(&self) -> &[i64] {
        &self.offsets
    }

    /// Whether the index passed the registration scan. Always true under
    /// [`CorruptIndexPolicy::RejectRegistration`].
    pub fn index_valid(&self) -> bool {
        self.fault.is_none()
    }

    /// Size in bytes of reduce partition `reduce_id`, validated like a resolve.
    pub fn partition_len(&self, reduce_id: ReduceId) -> Result<u64, StoreError> {
        let end = reduce_id.checked_add(1).ok_or(StoreError::PartitionOutOfRange {
            shuffle_id: self.shuffle_id,
            map_id: self.map_id,
            start: reduce_id,
            end: reduce_id,
            num_partitions: self.num_partitions,
        })?;
        let (from, to) = self.byte_range(reduce_id, end)?;
        Ok(to - from)
    }

    /// Validated byte range `[from, to)` of the reduce range `[start, end)`.
    fn byte_range(&self, start: ReduceId, end: ReduceId) -> Result<(u64, u64), StoreError> {
        let err = |f: Fault| f.into_error(self.shuffle_id, self.map_id);
        // Request-shape faults first: a malformed request is reported as such even when the
        // output is also corrupt.
        if start >= end {
            return Err(err(Fault::EmptyRange { start, end }));
        }
        if end > self.num_partitions {
            return Err(err(Fault::PartitionOutOfRange { start, end, num_partitions: self.num_partitions }));
        }
        if let Some(fault) = self.fault {
            return Err(err(fault));
        }
        check_range(&self.offsets, self.data_len, self.num_partitions, start, end).map_err(err)
    }
}

/// A resolved block: a validated byte range of one map output's data file. Holding it keeps
/// the map output (and its file descriptor) alive, even after its shuffle is unregistered.
#[derive(Debug, Clone)]
pub struct BlockSlice {
    output: Arc<MapOutput>,
    offset: u64,
    len: u64,
}

impl BlockSlice {
    /// The map output the bytes come from.
    pub fn output(&self) -> &Arc<MapOutput> {
        &self.output
    }

    /// Identity of the map output's registration.
    pub fn id(&self) -> MapOutputId {
        self.output.id
    }

    /// Offset of the block in the data file (and in [`BlockSlice::mmap_base`]).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the block in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the block has no bytes (empty reduce partitions are legal).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block's bytes, read with `pread` (a typed error if the file was truncated since).
    pub fn read(&self) -> Result<Vec<u8>, StoreError> {
        let mut v = vec![0u8; self.len as usize];
        self.output.read_at(self.offset, &mut v)?;
        Ok(v)
    }

    /// The open data file, for `sendfile` of `[offset, offset + len)` from its descriptor;
    /// `None` only when Spark wrote no data file (then the block is empty). See
    /// [`MapOutput::file`].
    pub fn file(&self) -> Result<Option<Arc<File>>, StoreError> {
        self.output.file()
    }
}

/// One line of [`MapOutputStore::list`], for logs and diagnostics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapOutputInfo {
    /// The shuffle.
    pub shuffle_id: ShuffleId,
    /// The map task attempt.
    pub map_id: MapId,
    /// Identity of the registration.
    pub id: MapOutputId,
    /// Number of reduce partitions.
    pub num_partitions: u32,
    /// Data file length in bytes.
    pub data_len: u64,
    /// Data file path.
    pub data_path: PathBuf,
    /// Index file path.
    pub index_path: PathBuf,
    /// Whether the index passed the registration scan.
    pub index_valid: bool,
}

/// Counters and gauges of a [`MapOutputStore`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Shuffles with at least one registered output.
    pub shuffles: usize,
    /// Registered map outputs.
    pub map_outputs: usize,
    /// Bytes of data files currently registered.
    pub data_bytes: u64,
    /// Index entries held in memory (8 bytes each).
    pub index_entries: u64,
    /// Successful registrations since creation (including replacements).
    pub registrations: u64,
    /// Registrations that replaced an existing output of the same `(shuffle, map)`.
    pub replacements: u64,
    /// Registrations refused with an error.
    pub rejected_registrations: u64,
    /// Successful resolves since creation.
    pub resolves: u64,
    /// Failed resolves since creation.
    pub failed_resolves: u64,
    /// Data files the store holds open now (at most [`StoreConfig::max_open_files`]).
    pub open_files: usize,
    /// Data files opened since creation (at registration and again after an eviction).
    pub file_opens: u64,
    /// Data files closed to stay under [`StoreConfig::max_open_files`].
    pub file_evictions: u64,
}

#[derive(Default)]
struct Counters {
    registrations: AtomicU64,
    replacements: AtomicU64,
    rejected_registrations: AtomicU64,
    resolves: AtomicU64,
    failed_resolves: AtomicU64,
}

/// The executor's registry of committed map outputs, from which the block server resolves
/// fetch requests. `Send + Sync`; lookups take a read lock only long enough to clone an `Arc`,
/// and all file I/O of a registration happens outside the lock.
pub struct MapOutputStore {
    config: StoreConfig,
    open_files: Arc<OpenFiles>,
    shuffles: RwLock<HashMap<ShuffleId, HashMap<MapId, Arc<MapOutput>>>>,
    counters: Counters,
}

impl fmt::Debug for MapOutputStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapOutputStore").field("config", &self.config).field("stats", &self.stats()).finish()
    }
}

impl Default for MapOutputStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MapOutputStore {
    /// An empty store with [`StoreConfig::default`].
    pub fn new() -> Self {
        Self::with_config(StoreConfig::default())
    }

    /// An empty store with the given settings.
    pub fn with_config(config: StoreConfig) -> Self {
        let open_files = Arc::new(OpenFiles::new(config.max_open_files));
        Self { config, open_files, shuffles: RwLock::new(HashMap::new()), counters: Counters::default() }
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Registers a committed map output: opens both files, reads the index into memory, takes
    /// the data file's length and scans the index (see the module docs for what is checked).
    /// Replaces an earlier registration of the same `(shuffle, map)` (task retries and
    /// speculation); in-flight readers of the old one keep it alive. On error the store is
    /// unchanged.
    ///
    /// A data file that does not exist is accepted when the index's last offset is 0: Spark
    /// commits an all-zero index and no data file for a map task that wrote nothing.
    ///
    /// The data file must not be modified in place while registered (Spark never does: it
    /// commits by renaming temporary files over the final names, which leaves the open
    /// descriptor on the old inode). A data file truncated or deleted anyway fails the
    /// fetches that need it with [`StoreError::DataTruncated`] / [`StoreError::DataFileMissing`].
    pub fn register(&self, files: MapOutputFiles) -> Result<Arc<MapOutput>, StoreError> {
        let (shuffle_id, map_id) = (files.shuffle_id, files.map_id);
        let output = match self.load(files) {
            Ok(output) => Arc::new(output),
            Err(e) => {
                self.counters.rejected_registrations.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(shuffle_id, map_id, error = %e, "map output registration refused");
                return Err(e);
            }
        };
        let previous = self.shuffles.write().entry(shuffle_id).or_default().insert(map_id, Arc::clone(&output));
        self.counters.registrations.fetch_add(1, Ordering::Relaxed);
        if let Some(previous) = previous {
            self.counters.replacements.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                shuffle_id,
                map_id,
                old = %previous.id,
                new = %output.id,
                "map output re-registered; replacing the previous registration"
            );
        } else {
            tracing::debug!(
                shuffle_id,
                map_id,
                id = %output.id,
                num_partitions = output.num_partitions,
                data_len = output.data_len,
                "map output registered"
            );
        }
        Ok(output)
    }

    /// Opens, reads, maps and scans; no lock held.
    fn load(&self, files: MapOutputFiles) -> Result<MapOutput, StoreError> {
        let MapOutputFiles { shuffle_id, map_id, data_path, index_path, num_partitions } = files;
        let io_err = |action: &'static str, path: &Path, source: io::Error| StoreError::Io {
            shuffle_id,
            map_id,
            action,
            path: path.to_path_buf(),
            source,
        };

        let mut index_file = File::open(&index_path).map_err(|e| io_err("open", &index_path, e))?;
        let index_len = index_file.metadata().map_err(|e| io_err("stat", &index_path, e))?.len();
        let limit = self.config.max_index_entries.min(HARD_MAX_INDEX_ENTRIES);
        // Bound the size before reading anything: the allocation below is index_len bytes.
        if index_len / 8 > limit {
            return Err(StoreError::IndexTooLarge { shuffle_id, map_id, entries: index_len / 8, limit });
        }
        if index_len % 8 != 0 {
            return Err(StoreError::IndexNotMultipleOf8 { shuffle_id, map_id, len: index_len });
        }
        let entries = index_len / 8;
        let needed = num_partitions.map_or(1, |n| u64::from(n) + 1);
        // A short index whose partition count Spark told us is kept under FailResolves, so
        // every fetch from it reports exactly this (and the reducer's FetchFailed says why).
        let keep_short =
            entries >= 1 && num_partitions.is_some() && self.config.corrupt_index == CorruptIndexPolicy::FailResolves;
        if entries < needed && !keep_short {
            return Err(StoreError::IndexTooShort { shuffle_id, map_id, entries, needed });
        }
        let short_fault = (entries < needed).then_some(Fault::IndexTooShort { entries, needed });
        if num_partitions.is_some() && entries > needed {
            return Err(StoreError::IndexTooLong { shuffle_id, map_id, entries, expected: needed });
        }
        // entries is in 1..=u32::MAX + 1 here, so this cannot truncate.
        let num_partitions = match short_fault {
            Some(_) => num_partitions.unwrap_or(0),
            None => (entries - 1) as u32,
        };

        let mut raw = vec![0u8; index_len as usize];
        index_file.read_exact(&mut raw).map_err(|e| io_err("read", &index_path, e))?;
        drop(index_file);
        let offsets: Box<[i64]> =
            raw.chunks_exact(8).map(|b| i64::from_be_bytes(b.try_into().expect("chunks_exact yields 8 bytes"))).collect();

        let (file, data_len) = match File::open(&data_path) {
            Ok(file) => {
                let len = file.metadata().map_err(|e| io_err("stat", &data_path, e))?.len();
                (Some(file), len)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && offsets[offsets.len() - 1] == 0 => (None, 0),
            Err(e) => return Err(io_err("open", &data_path, e)),
        };
        let fault = short_fault.or_else(|| scan_index(&offsets, data_len));
        if let Some(fault) = fault {
            let error = fault.into_error(shuffle_id, map_id);
            match self.config.corrupt_index {
                CorruptIndexPolicy::RejectRegistration => return Err(error),
                CorruptIndexPolicy::FailResolves => tracing::warn!(
                    shuffle_id,
                    map_id,
                    error = %error,
                    index = %index_path.display(),
                    "corrupt shuffle index registered; every fetch from this map output will fail"
                ),
            }
        }

        let id = MapOutputId::next();
        let data_file = match file {
            Some(file) => {
                let identity = FileIdentity::of(&file).map_err(|e| io_err("stat", &data_path, e))?;
                self.open_files.insert(id.0, Arc::new(file));
                Some(identity)
            }
            None => None,
        };
        Ok(MapOutput {
            id,
            shuffle_id,
            map_id,
            num_partitions,
            offsets,
            data_len,
            data_path,
            index_path,
            data_file,
            open_files: self.open_files.clone(),
            fault,
        })
    }

    /// Removes every map output of a shuffle and returns how many there were. Resolves issued
    /// after this returns fail; slices already handed out stay readable until dropped.
    pub fn unregister_shuffle(&self, shuffle_id: ShuffleId) -> usize {
        let removed = self.shuffles.write().remove(&shuffle_id);
        let count = removed.as_ref().map_or(0, HashMap::len);
        tracing::debug!(shuffle_id, map_outputs = count, "shuffle unregistered");
        // `removed` drops here, outside the lock: unmapping can take a while for big files.
        count
    }

    /// Removes one map output (Spark's `removeDataByMap`); returns whether it was registered.
    pub fn unregister_map_output(&self, shuffle_id: ShuffleId, map_id: MapId) -> bool {
        let removed = {
            let mut shuffles = self.shuffles.write();
            let Some(maps) = shuffles.get_mut(&shuffle_id) else {
                return false;
            };
            let removed = maps.remove(&map_id);
            if maps.is_empty() {
                shuffles.remove(&shuffle_id);
            }
            removed
        };
        removed.is_some()
    }

    /// The registered output of `(shuffle_id, map_id)`, if any.
    pub fn get(&self, shuffle_id: ShuffleId, map_id: MapId) -> Result<Arc<MapOutput>, StoreError> {
        let shuffles = self.shuffles.read();
        let maps = shuffles.get(&shuffle_id).ok_or(StoreError::UnknownShuffle { shuffle_id })?;
        maps.get(&map_id).cloned().ok_or(StoreError::UnknownMapOutput { shuffle_id, map_id })
    }

    /// Resolves the reduce range `[start_reduce, end_reduce)` of one map output to its bytes
    /// (a single block is `[r, r + 1)`; a batch block is any longer contiguous range).
    pub fn resolve(
        &self,
        shuffle_id: ShuffleId,
        map_id: MapId,
        start_reduce: ReduceId,
        end_reduce: ReduceId,
    ) -> Result<BlockSlice, StoreError> {
        let result = self.get(shuffle_id, map_id).and_then(|output| {
            let (from, to) = output.byte_range(start_reduce, end_reduce)?;
            if to > from {
                output.check_data(to, &|| format!("reduce [{start_reduce}, {end_reduce})"))?;
            }
            Ok(BlockSlice { output, offset: from, len: to - from })
        });
        match &result {
            Ok(_) => self.counters.resolves.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                tracing::debug!(shuffle_id, map_id, start_reduce, end_reduce, error = %e, "resolve failed");
                self.counters.failed_resolves.fetch_add(1, Ordering::Relaxed)
            }
        };
        result
    }

    /// Number of registered map outputs.
    pub fn len(&self) -> usize {
        self.shuffles.read().values().map(HashMap::len).sum()
    }

    /// Whether no map output is registered.
    pub fn is_empty(&self) -> bool {
        self.shuffles.read().is_empty()
    }

    /// Ids of the shuffles with registered outputs, ascending.
    pub fn shuffle_ids(&self) -> Vec<ShuffleId> {
        let mut ids: Vec<_> = self.shuffles.read().keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Every registered output, sorted by `(shuffle, map)`.
    pub fn list(&self) -> Vec<MapOutputInfo> {
        let mut infos: Vec<_> = self
            .shuffles
            .read()
            .values()
            .flat_map(HashMap::values)
            .map(|o| MapOutputInfo {
                shuffle_id: o.shuffle_id,
                map_id: o.map_id,
                id: o.id,
                num_partitions: o.num_partitions,
                data_len: o.data_len,
                data_path: o.data_path.clone(),
                index_path: o.index_path.clone(),
                index_valid: o.fault.is_none(),
            })
            .collect();
        infos.sort_unstable_by_key(|i| (i.shuffle_id, i.map_id));
        infos
    }

    /// Current gauges and counters.
    pub fn stats(&self) -> StoreStats {
        let mut stats = StoreStats::default();
        {
            let shuffles = self.shuffles.read();
            stats.shuffles = shuffles.len();
            for output in shuffles.values().flat_map(HashMap::values) {
                stats.map_outputs += 1;
                stats.data_bytes += output.data_len;
                stats.index_entries += output.offsets.len() as u64;
            }
        }
        let c = &self.counters;
        stats.registrations = c.registrations.load(Ordering::Relaxed);
        stats.replacements = c.replacements.load(Ordering::Relaxed);
        stats.rejected_registrations = c.rejected_registrations.load(Ordering::Relaxed);
        stats.resolves = c.resolves.load(Ordering::Relaxed);
        stats.failed_resolves = c.failed_resolves.load(Ordering::Relaxed);
        stats.open_files = self.open_files.len();
        stats.file_opens = self.open_files.opens();
        stats.file_evictions = self.open_files.evictions();
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_types_are_send_and_sync() {
        assert_send_sync::<MapOutputStore>();
        assert_send_sync::<MapOutput>();
        assert_send_sync::<BlockSlice>();
    }

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
