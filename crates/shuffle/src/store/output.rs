//! One registered map output ([`MapOutput`], identified by a [`MapOutputId`]) and the
//! resolved blocks handed out from it ([`BlockSlice`]).

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::index::{check_range, Fault};
use super::{MapId, ReduceId, ShuffleId, StoreError};
use crate::open_files::{FileIdentity, OpenFiles, ReopenError};

/// Identity of one registration of a map output, unique within the process. A re-registration
/// of the same `(shuffle, map)` gets a new id, so anything cached per mapping (an RDMA memory
/// registration, a remote key) can tell the old mapping from the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MapOutputId(pub(super) u64);

impl MapOutputId {
    /// The id as a number (for logs and protocol fields).
    pub fn get(self) -> u64 {
        self.0
    }

    pub(super) fn next() -> Self {
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
    pub(super) id: MapOutputId,
    pub(super) shuffle_id: ShuffleId,
    pub(super) map_id: MapId,
    pub(super) num_partitions: u32,
    pub(super) offsets: Box<[i64]>,
    pub(super) data_len: u64,
    pub(super) data_path: PathBuf,
    pub(super) index_path: PathBuf,
    /// The data file's identity; `None` only when Spark wrote no data file because every
    /// partition is empty.
    pub(super) data_file: Option<FileIdentity>,
    /// Where the open data file is kept (and reopened from after an eviction).
    pub(super) open_files: Arc<OpenFiles>,
    /// First fault of the registration scan, kept under
    /// [`CorruptIndexPolicy::FailResolves`](super::CorruptIndexPolicy::FailResolves).
    pub(super) fault: Option<Fault>,
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
    /// again if the store closed it to stay under
    /// [`StoreConfig::max_open_files`](super::StoreConfig::max_open_files), and only if it is
    /// still the registered file. `None` only when Spark wrote no data file because every
    /// partition is empty.
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
    ///
    /// One `fstat` of the open file answers both in the common case: its length, and its link
    /// count, which is 0 only once the file has no name left. Only then is the path looked up,
    /// to tell a deletion (nothing there: missing) from a rename over it (another file there:
    /// the open file still serves, see below). A lookup by path on every block was the largest
    /// cost of serving a small block (40 % of the server loop at 4 KiB, `perf record` of
    /// `engine-bench profile`); Spark's own server opens the file by path for every block.
    pub fn check_data(&self, needed: u64, what: &dyn Fn() -> String) -> Result<(), StoreError> {
        if self.data_file.is_none() {
            // No data file: every partition is empty, so nothing is ever read.
            return Ok(());
        }
        let (shuffle_id, map_id) = (self.shuffle_id, self.map_id);
        let missing = || StoreError::DataFileMissing { shuffle_id, map_id, what: what(), path: self.data_path.clone() };
        // (Closed to stay under the cap, and gone or replaced when reopened: a typed error.)
        let Some(file) = self.file()? else { return Ok(()) };
        let meta = file.metadata().map_err(|source| StoreError::Io {
            shuffle_id,
            map_id,
            action: "stat",
            path: self.data_path.clone(),
            source,
        })?;
        if meta.nlink() == 0 {
            match std::fs::metadata(&self.data_path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(missing()),
                // A different file now at the path (a rename over it) is not ours to judge:
                // Spark re-registers the output when it replaces it; until then the open file
                // serves.
                _ => {}
            }
        }
        let actual = meta.len();
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
    /// [`CorruptIndexPolicy::RejectRegistration`](super::CorruptIndexPolicy::RejectRegistration).
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
    pub(super) fn byte_range(&self, start: ReduceId, end: ReduceId) -> Result<(u64, u64), StoreError> {
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
    pub(super) output: Arc<MapOutput>,
    pub(super) offset: u64,
    pub(super) len: u64,
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

    /// Offset of the block in the data file.
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
