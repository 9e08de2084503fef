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
//!   length; then the data file still exists and is still that long (one `fstat` of the open
//!   file; its path is looked up only when the file has no name left, a deletion or a rename
//!   over it). This costs `O(end - start)`: no index content can make a resolve panic or read
//!   outside the file, and one corrupt map output only fails the fetches that touch it.
//!
//! # Lifetime
//!
//! Outputs are handed out as `Arc<MapOutput>` inside a [`BlockSlice`]. Unregistering a shuffle
//! removes its outputs from the store at once (later resolves fail with
//! [`StoreError::UnknownShuffle`]) while a transfer that already holds a slice keeps the file
//! descriptor alive until it drops the slice.

mod error;
mod index;
mod output;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::open_files::{FileIdentity, OpenFiles};
use index::{scan_index, Fault};
use parking_lot::RwLock;

pub use error::{StoreError, StoreErrorClass};
pub use output::{BlockSlice, MapOutput, MapOutputId};

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
}
