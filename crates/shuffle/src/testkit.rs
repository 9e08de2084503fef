//! Test-data generator: map outputs written exactly as Spark's sort shuffle lays them out,
//! with deterministic pseudo-random content, plus corrupt variants.
//!
//! Used by this crate's tests and by other crates' tests and benchmarks, so it depends on
//! nothing outside the standard library (its small PRNG, [`TestRng`], is here for the same
//! reason). Content is a pure function of the seed and the partition sizes, so two runs, or
//! a writer and a checker in different processes, agree on every byte.
//!
//! ```
//! use rdma_shuffle_shuffle::testkit::write_map_output;
//! # let dir = std::env::temp_dir().join(format!("testkit-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! let out = write_map_output(&dir, 3, 17, &[5, 0, 12], 42).unwrap();
//! assert!(out.data_path.ends_with("shuffle_3_17_0.data"));
//! assert_eq!(out.offsets(), vec![0, 5, 5, 17]);
//! assert_eq!(std::fs::read(&out.data_path).unwrap(), out.range_bytes(0, 3));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::store::{MapId, MapOutputFiles, ShuffleId};

/// A small, fast, deterministic PRNG (xorshift64*, seeded through splitmix64 so that any seed,
/// including 0, gives a good stream). Not cryptographic; for test data and layouts only.
#[derive(Debug, Clone)]
pub struct TestRng {
    state: u64,
}

impl TestRng {
    /// A generator whose whole stream is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        // splitmix64 finaliser: spreads low-entropy seeds (0, 1, 2, ...) over the state and
        // never yields the all-zero state, which is a fixed point of xorshift.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Self { state: if z == 0 { 0x2545_F491_4F6C_DD1D } else { z } }
    }

    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..bound` (`bound` must be non-zero; returns 0 for 0). Slightly biased for
    /// huge bounds, which does not matter for test layouts.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            0
        } else {
            self.next_u64() % bound
        }
    }

    /// Fills `buf` with pseudo-random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let bytes = self.next_u64().to_le_bytes();
            tail.copy_from_slice(&bytes[..tail.len()]);
        }
    }
}

/// Spark's data file name for a map output: `shuffle_<shuffleId>_<mapId>_0.data`.
pub fn data_file_name(shuffle_id: ShuffleId, map_id: MapId) -> String {
    format!("shuffle_{shuffle_id}_{map_id}_0.data")
}

/// Spark's index file name for a map output: `shuffle_<shuffleId>_<mapId>_0.index`.
pub fn index_file_name(shuffle_id: ShuffleId, map_id: MapId) -> String {
    format!("shuffle_{shuffle_id}_{map_id}_0.index")
}

/// A map output written by [`write_map_output`], with the bytes of every partition kept in
/// memory for comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedOutput {
    /// The shuffle id in the file names.
    pub shuffle_id: ShuffleId,
    /// The map id in the file names.
    pub map_id: MapId,
    /// Path of the `.data` file.
    pub data_path: PathBuf,
    /// Path of the `.index` file.
    pub index_path: PathBuf,
    /// The bytes of each reduce partition, in order.
    pub partitions: Vec<Vec<u8>>,
}

impl GeneratedOutput {
    /// Number of reduce partitions.
    pub fn num_partitions(&self) -> u32 {
        u32::try_from(self.partitions.len()).expect("partition count fits in a Spark Int")
    }

    /// The index offsets as written: `numPartitions + 1` values, first 0, last = data length.
    pub fn offsets(&self) -> Vec<i64> {
        let mut offsets = Vec::with_capacity(self.partitions.len() + 1);
        let mut at = 0i64;
        offsets.push(at);
        for p in &self.partitions {
            at += p.len() as i64;
            offsets.push(at);
        }
        offsets
    }

    /// Total size of the data file.
    pub fn data_len(&self) -> u64 {
        self.partitions.iter().map(|p| p.len() as u64).sum()
    }

    /// The bytes of the reduce range `[start, end)`, concatenated (what a batch fetch returns).
    /// Panics if the range is outside the partitions; test helper.
    pub fn range_bytes(&self, start: u32, end: u32) -> Vec<u8> {
        self.partitions[start as usize..end as usize].concat()
    }

    /// The registration request for these files, declaring the partition count.
    pub fn map_output_files(&self) -> MapOutputFiles {
        MapOutputFiles {
            shuffle_id: self.shuffle_id,
            map_id: self.map_id,
            data_path: self.data_path.clone(),
            index_path: self.index_path.clone(),
            num_partitions: Some(self.num_partitions()),
        }
    }
}

/// Writes `shuffle_<shuffleId>_<mapId>_0.{data,index}` into `dir` as Spark's sort shuffle does:
/// partitions back to back in the data file, `partition_sizes.len() + 1` big-endian `i64`
/// offsets in the index. The content is pseudo-random, determined by `seed` (and the sizes):
/// the same arguments always give the same bytes, and different partitions differ.
///
/// The data file is always written, even when empty (Spark omits it in that case; delete it to
/// reproduce that layout).
pub fn write_map_output(
    dir: &Path,
    shuffle_id: ShuffleId,
    map_id: MapId,
    partition_sizes: &[usize],
    seed: u64,
) -> io::Result<GeneratedOutput> {
    let mut rng = TestRng::new(seed);
    let partitions: Vec<Vec<u8>> = partition_sizes
        .iter()
        .map(|&size| {
            let mut bytes = vec![0u8; size];
            rng.fill(&mut bytes);
            bytes
        })
        .collect();
    let out = GeneratedOutput {
        shuffle_id,
        map_id,
        data_path: dir.join(data_file_name(shuffle_id, map_id)),
        index_path: dir.join(index_file_name(shuffle_id, map_id)),
        partitions,
    };
    let mut data = BufWriter::new(File::create(&out.data_path)?);
    for p in &out.partitions {
        data.write_all(p)?;
    }
    data.into_inner().map_err(io::IntoInnerError::into_error)?.sync_data()?;
    write_index(&out.index_path, &out.offsets())?;
    Ok(out)
}

/// Writes `offsets` as a Spark index file (big-endian `i64`s), replacing any existing file.
/// Any values are accepted, so tests can write corrupt indexes.
pub fn write_index(path: &Path, offsets: &[i64]) -> io::Result<()> {
    let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_be_bytes()).collect();
    fs::write(path, bytes)
}

/// A way to damage a generated map output's index (see [`corrupt_index`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexCorruption {
    /// Keep only the first `entries` offsets.
    Truncate {
        /// Offsets kept.
        entries: usize,
    },
    /// Cut the last offset in half (4 bytes left), so the size is not a multiple of 8.
    PartialEntry,
    /// Make the first offset non-zero (sets it to 1).
    FirstOffsetNonZero,
    /// Make partition `partition` end before it starts (`off[partition+1] = off[partition] -
    /// 1`, which may be -1). Needs `partition < numPartitions`.
    Decreasing {
        /// The partition given a negative length.
        partition: usize,
    },
    /// Make partition `partition` end one byte past the end of the data file, and every later
    /// offset too, so the index stays non-decreasing. Needs `partition < numPartitions`.
    PastEnd {
        /// The first partition to end past the data.
        partition: usize,
    },
    /// Make the last offset one less than the data length: the data file has a byte no
    /// partition accounts for. Needs a non-empty last partition to keep offsets non-decreasing.
    LastShort,
}

/// Rewrites the index of `out` with the given corruption (the data file is left alone) and
/// returns the offsets now on disk (the whole-entry part, for [`IndexCorruption::PartialEntry`]).
/// Returns `InvalidInput` if the corruption does not fit the output's layout.
pub fn corrupt_index(out: &GeneratedOutput, how: IndexCorruption) -> io::Result<Vec<i64>> {
    let mut offsets = out.offsets();
    let n = out.partitions.len();
    let data_len = out.data_len() as i64;
    let invalid = |what: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, what.to_string()));
    match how {
        IndexCorruption::Truncate { entries } => {
            if entries > offsets.len() {
                return invalid("cannot truncate an index to more entries than it has");
            }
            offsets.truncate(entries);
        }
        IndexCorruption::PartialEntry => {
            let mut bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_be_bytes()).collect();
            bytes.truncate(bytes.len() - 4);
            fs::write(&out.index_path, bytes)?;
            offsets.pop();
            return Ok(offsets);
        }
        IndexCorruption::FirstOffsetNonZero => offsets[0] = 1,
        IndexCorruption::Decreasing { partition } => {
            if partition >= n {
                return invalid("Decreasing needs partition < numPartitions");
            }
            offsets[partition + 1] = offsets[partition] - 1;
        }
        IndexCorruption::PastEnd { partition } => {
            if partition >= n {
                return invalid("PastEnd needs partition < numPartitions");
            }
            for o in &mut offsets[partition + 1..] {
                *o = data_len + 1;
            }
        }
        IndexCorruption::LastShort => {
            if !matches!(out.partitions.last(), Some(p) if !p.is_empty()) {
                return invalid("LastShort needs a non-empty last partition");
            }
            offsets[n] = data_len - 1;
        }
    }
    write_index(&out.index_path, &offsets)?;
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_seed_sensitive() {
        let a: Vec<u64> = {
            let mut r = TestRng::new(0);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = TestRng::new(0);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = TestRng::new(1);
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&x| x != 0));
    }

    #[test]
    fn fill_covers_odd_lengths() {
        let mut r = TestRng::new(7);
        let mut buf = [0u8; 13];
        r.fill(&mut buf);
        // 13 zero bytes from a good stream is astronomically unlikely; the tail must be filled.
        assert_ne!(&buf[8..], &[0u8; 5]);
        assert!(r.below(10) < 10);
        assert_eq!(r.below(0), 0);
    }

    #[test]
    fn file_names_match_spark() {
        assert_eq!(data_file_name(0, 5), "shuffle_0_5_0.data");
        assert_eq!(index_file_name(12, 9_000_000_001), "shuffle_12_9000000001_0.index");
    }
}
