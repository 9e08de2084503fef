//! Map-output store against files written in Spark's layout by the testkit.

use std::fs;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdma_shuffle_shuffle::store::{CorruptIndexPolicy, MapOutputFiles, MapOutputStore, StoreConfig, StoreError, StoreErrorClass};
use rdma_shuffle_shuffle::testkit::{corrupt_index, write_index, write_map_output, GeneratedOutput, IndexCorruption, TestRng};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("create temp dir")
}

/// Checks every contiguous reduce range of `gen` against the store, through both the mapping
/// and the file descriptor.
fn check_all_ranges(store: &MapOutputStore, gen: &GeneratedOutput) {
    let n = gen.num_partitions();
    let offsets = gen.offsets();
    for start in 0..n {
        for end in start + 1..=n {
            let slice =
                store.resolve(gen.shuffle_id, gen.map_id, start, end).unwrap_or_else(|e| panic!("resolve [{start},{end}): {e}"));
            let expected = gen.range_bytes(start, end);
            assert_eq!(slice.offset(), offsets[start as usize] as u64);
            assert_eq!(slice.len(), expected.len() as u64);
            assert_eq!(slice.is_empty(), expected.is_empty());
            assert!(slice.read().unwrap() == expected.as_slice(), "bytes of [{start},{end}) differ");
            // What the TCP provider would sendfile from.
            let mut via_fd = vec![0u8; expected.len()];
            slice.file().unwrap().expect("data file open").read_exact_at(&mut via_fd, slice.offset()).unwrap();
            assert_eq!(via_fd, expected);
        }
    }
}

#[test]
fn resolves_single_and_batch_ranges_of_random_layouts() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let mut rng = TestRng::new(0x5eed);
    let mut generated = Vec::new();
    for map_id in 0..40u64 {
        let n = 1 + rng.below(24) as usize;
        let sizes: Vec<usize> = (0..n)
            .map(|_| match rng.below(4) {
                0 => 0, // empty partitions are common in real shuffles
                1 => 1 + rng.below(8) as usize,
                _ => rng.below(5000) as usize,
            })
            .collect();
        let shuffle_id = (map_id % 3) as u32;
        let gen = write_map_output(dir.path(), shuffle_id, 1000 + map_id, &sizes, map_id).unwrap();
        let output = store.register(gen.map_output_files()).unwrap();
        assert_eq!(output.num_partitions() as usize, n);
        assert_eq!(output.data_len(), gen.data_len());
        assert!(output.index_valid());
        generated.push(gen);
    }
    assert_eq!(store.len(), 40);
    for gen in &generated {
        check_all_ranges(&store, gen);
    }
}

#[test]
fn partition_count_can_be_inferred_from_the_index() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 1, 2, &[3, 0, 9, 1], 5).unwrap();
    let mut files = gen.map_output_files();
    files.num_partitions = None;
    let output = store.register(files).unwrap();
    assert_eq!(output.num_partitions(), 4);
    assert_eq!(output.offsets(), gen.offsets().as_slice());
    assert_eq!(output.partition_len(2).unwrap(), 9);
    check_all_ranges(&store, &gen);
}

#[test]
fn zero_length_data_file_is_served() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 4, 8, &[0, 0, 0], 1).unwrap();
    assert_eq!(fs::metadata(&gen.data_path).unwrap().len(), 0);
    let output = store.register(gen.map_output_files()).unwrap();
    assert!(output.file().unwrap().is_some());
    for (start, end) in [(0, 1), (1, 3), (0, 3)] {
        let slice = store.resolve(4, 8, start, end).unwrap();
        assert!(slice.is_empty());
        assert_eq!(slice.read().unwrap(), Vec::<u8>::new());
    }
}

/// Spark commits an all-zero index and no data file when a map task writes nothing.
#[test]
fn missing_data_file_is_accepted_only_for_an_empty_output() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let empty = write_map_output(dir.path(), 4, 9, &[0, 0], 1).unwrap();
    fs::remove_file(&empty.data_path).unwrap();
    let output = store.register(empty.map_output_files()).unwrap();
    assert!(output.file().unwrap().is_none());
    let slice = store.resolve(4, 9, 0, 2).unwrap();
    assert!(slice.is_empty() && slice.file().unwrap().is_none());

    let full = write_map_output(dir.path(), 4, 10, &[0, 7], 1).unwrap();
    fs::remove_file(&full.data_path).unwrap();
    match store.register(full.map_output_files()) {
        Err(StoreError::Io { shuffle_id: 4, map_id: 10, action: "open", path, source }) => {
            assert_eq!(path, full.data_path);
            assert_eq!(source.kind(), io::ErrorKind::NotFound);
        }
        other => panic!("expected Io, got {other:?}"),
    }
}

#[test]
fn one_large_partition_among_small_ones() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let big = 24 << 20;
    let gen = write_map_output(dir.path(), 7, 1, &[10, 0, big, 3, 0], 99).unwrap();
    store.register(gen.map_output_files()).unwrap();
    let slice = store.resolve(7, 1, 2, 3).unwrap();
    assert_eq!(slice.offset(), 10);
    assert_eq!(slice.len(), big as u64);
    assert!(slice.read().unwrap() == gen.partitions[2].as_slice());
    let batch = store.resolve(7, 1, 1, 5).unwrap();
    assert!(batch.read().unwrap() == gen.range_bytes(1, 5).as_slice());
    assert_eq!(store.stats().data_bytes, (big + 13) as u64);
}

#[test]
fn content_is_deterministic_and_partitions_differ() {
    let (a, b) = (tempdir(), tempdir());
    let x = write_map_output(a.path(), 0, 0, &[64, 64], 3).unwrap();
    let y = write_map_output(b.path(), 0, 0, &[64, 64], 3).unwrap();
    let z = write_map_output(b.path(), 0, 1, &[64, 64], 4).unwrap();
    assert_eq!(x.partitions, y.partitions);
    assert_ne!(x.partitions[0], x.partitions[1]);
    assert_ne!(x.partitions, z.partitions);
    // The index on disk is big-endian i64, as Spark's DataOutputStream.writeLong writes it.
    let raw = fs::read(&x.index_path).unwrap();
    assert_eq!(raw.len(), 3 * 8);
    assert_eq!(&raw[8..16], &64i64.to_be_bytes());
    assert_eq!(&raw[16..24], &128i64.to_be_bytes());
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

fn registered(dir: &Path, store: &MapOutputStore) -> GeneratedOutput {
    let gen = write_map_output(dir, 1, 10, &[5, 0, 7, 2], 11).unwrap();
    store.register(gen.map_output_files()).unwrap();
    gen
}

#[test]
fn unknown_shuffle_and_map_output() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    registered(dir.path(), &store);
    let e = store.resolve(2, 10, 0, 1).unwrap_err();
    assert!(matches!(e, StoreError::UnknownShuffle { shuffle_id: 2 }), "{e:?}");
    assert_eq!(e.class(), StoreErrorClass::NotFound);
    let e = store.resolve(1, 11, 0, 1).unwrap_err();
    assert!(matches!(e, StoreError::UnknownMapOutput { shuffle_id: 1, map_id: 11 }), "{e:?}");
    assert_eq!(store.stats().failed_resolves, 2);
}

#[test]
fn empty_and_out_of_range_requests() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    registered(dir.path(), &store);
    for (start, end) in [(2, 2), (3, 1)] {
        let e = store.resolve(1, 10, start, end).unwrap_err();
        assert!(
            matches!(e, StoreError::EmptyRange { shuffle_id: 1, map_id: 10, start: s, end: t } if s == start && t == end),
            "{e:?}"
        );
        assert_eq!(e.class(), StoreErrorClass::BadRequest);
    }
    for (start, end) in [(0, 5), (4, 5), (3, u32::MAX)] {
        let e = store.resolve(1, 10, start, end).unwrap_err();
        assert!(matches!(e, StoreError::PartitionOutOfRange { shuffle_id: 1, map_id: 10, num_partitions: 4, .. }), "{e:?}");
        assert!(e.to_string().contains("4 partitions"), "{e}");
    }
    // The last valid range still works.
    assert_eq!(store.resolve(1, 10, 3, 4).unwrap().len(), 2);
}

/// Registers `gen`'s files (after corrupting them) and expects the given error; the store must
/// be unchanged by the refusal.
fn expect_rejected(store: &MapOutputStore, files: MapOutputFiles) -> StoreError {
    let before = store.list();
    let e = store.register(files).unwrap_err();
    assert_eq!(store.list(), before, "a refused registration changed the store");
    e
}

#[test]
fn truncated_index_is_too_short() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 3, 1, &[5, 0, 7, 2], 1).unwrap();
    corrupt_index(&gen, IndexCorruption::Truncate { entries: 3 }).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert!(matches!(e, StoreError::IndexTooShort { shuffle_id: 3, map_id: 1, entries: 3, needed: 5 }), "{e:?}");
    assert_eq!(e.class(), StoreErrorClass::CorruptOutput);

    // An empty index file has not even the leading 0.
    corrupt_index(&gen, IndexCorruption::Truncate { entries: 0 }).unwrap();
    let mut files = gen.map_output_files();
    files.num_partitions = None;
    let e = expect_rejected(&store, files);
    assert!(matches!(e, StoreError::IndexTooShort { entries: 0, needed: 1, .. }), "{e:?}");
}

#[test]
fn index_longer_than_declared_partition_count() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 3, 2, &[5, 0, 7, 2], 1).unwrap();
    let mut files = gen.map_output_files();
    files.num_partitions = Some(3);
    let e = expect_rejected(&store, files);
    assert!(matches!(e, StoreError::IndexTooLong { entries: 5, expected: 4, .. }), "{e:?}");
}

#[test]
fn partial_entry_is_not_a_multiple_of_8() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 3, 3, &[5, 0, 7, 2], 1).unwrap();
    corrupt_index(&gen, IndexCorruption::PartialEntry).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert!(matches!(e, StoreError::IndexNotMultipleOf8 { shuffle_id: 3, map_id: 3, len: 36 }), "{e:?}");
}

#[test]
fn index_larger_than_the_limit_is_not_read() {
    let dir = tempdir();
    let store = MapOutputStore::with_config(StoreConfig { max_index_entries: 4, ..StoreConfig::default() });
    let ok = write_map_output(dir.path(), 3, 4, &[1, 2, 3], 1).unwrap();
    store.register(ok.map_output_files()).unwrap();
    let big = write_map_output(dir.path(), 3, 5, &[1, 2, 3, 4], 1).unwrap();
    let e = expect_rejected(&store, big.map_output_files());
    assert!(matches!(e, StoreError::IndexTooLarge { entries: 5, limit: 4, .. }), "{e:?}");
    // The message names the setting to change.
    assert!(e.to_string().contains("max_index_entries"), "{e}");
}

#[test]
fn offset_faults_are_refused_at_registration() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let sizes = [5, 0, 7, 2];

    let gen = write_map_output(dir.path(), 5, 1, &sizes, 1).unwrap();
    corrupt_index(&gen, IndexCorruption::FirstOffsetNonZero).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert!(matches!(e, StoreError::FirstOffsetNotZero { shuffle_id: 5, map_id: 1, offset: 1 }), "{e:?}");

    let gen = write_map_output(dir.path(), 5, 2, &sizes, 1).unwrap();
    corrupt_index(&gen, IndexCorruption::Decreasing { partition: 2 }).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert!(matches!(e, StoreError::OffsetsDecreasing { map_id: 2, partition: 2, prev: 5, next: 4, .. }), "{e:?}");

    let gen = write_map_output(dir.path(), 5, 3, &sizes, 1).unwrap();
    corrupt_index(&gen, IndexCorruption::PastEnd { partition: 1 }).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert!(matches!(e, StoreError::OffsetPastEnd { map_id: 3, partition: 1, offset: 15, data_len: 14, .. }), "{e:?}");

    let gen = write_map_output(dir.path(), 5, 4, &sizes, 1).unwrap();
    corrupt_index(&gen, IndexCorruption::LastShort).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert!(matches!(e, StoreError::LastOffsetMismatch { map_id: 4, last_offset: 13, data_len: 14, .. }), "{e:?}");
    assert_eq!(store.stats().rejected_registrations, 4);
    assert!(store.is_empty());
}

#[test]
fn missing_index_is_an_io_error_naming_the_file() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 6, 1, &[1], 1).unwrap();
    fs::remove_file(&gen.index_path).unwrap();
    let e = expect_rejected(&store, gen.map_output_files());
    assert_eq!(e.class(), StoreErrorClass::Io);
    let msg = e.to_string();
    assert!(msg.contains(&gen.index_path.display().to_string()), "{msg}");
    assert!(msg.contains("shuffle 6 map 1"), "{msg}");
    assert!(std::error::Error::source(&e).is_some());
}

/// Under `FailResolves` a corrupt index is registered but never served: every fetch from it
/// fails with the typed error, and the other map outputs are served normally.
#[test]
fn corrupt_index_registered_under_fail_resolves_fails_every_fetch() {
    let dir = tempdir();
    let store =
        MapOutputStore::with_config(StoreConfig { corrupt_index: CorruptIndexPolicy::FailResolves, ..StoreConfig::default() });
    let good = write_map_output(dir.path(), 8, 1, &[5, 0, 7, 2], 1).unwrap();
    store.register(good.map_output_files()).unwrap();
    let bad = write_map_output(dir.path(), 8, 2, &[5, 0, 7, 2], 2).unwrap();
    corrupt_index(&bad, IndexCorruption::Decreasing { partition: 2 }).unwrap();
    let output = store.register(bad.map_output_files()).unwrap();
    assert!(!output.index_valid());
    assert!(!store.list().iter().find(|i| i.map_id == 2).unwrap().index_valid);

    // Even ranges whose own offsets look fine: the index as a whole cannot be trusted.
    for (start, end) in [(0, 1), (2, 3), (0, 4)] {
        let e = store.resolve(8, 2, start, end).unwrap_err();
        assert!(matches!(e, StoreError::OffsetsDecreasing { shuffle_id: 8, map_id: 2, partition: 2, .. }), "{e:?}");
    }
    assert!(output.partition_len(0).is_err());
    // A malformed request is still reported as such.
    assert!(matches!(store.resolve(8, 2, 1, 1), Err(StoreError::EmptyRange { .. })));
    check_all_ranges(&store, &good);

    // Same for a past-end offset: slicing must never reach outside the mapping.
    let past = write_map_output(dir.path(), 8, 3, &[5, 0, 7, 2], 3).unwrap();
    corrupt_index(&past, IndexCorruption::PastEnd { partition: 3 }).unwrap();
    store.register(past.map_output_files()).unwrap();
    assert!(matches!(store.resolve(8, 3, 3, 4), Err(StoreError::OffsetPastEnd { offset: 15, data_len: 14, .. })));
}

// ---------------------------------------------------------------------------------------------
// Lifetime
// ---------------------------------------------------------------------------------------------

#[test]
fn reregistration_replaces_and_old_slices_stay_valid() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let first = write_map_output(dir.path(), 2, 5, &[100, 50], 1).unwrap();
    let first_out = store.register(first.map_output_files()).unwrap();
    let old_slice = store.resolve(2, 5, 0, 2).unwrap();

    // A retried attempt commits new files under the same names, by rename as Spark does.
    let staging = tempdir();
    let second = write_map_output(staging.path(), 2, 5, &[30, 70, 1], 2).unwrap();
    fs::rename(&second.data_path, &first.data_path).unwrap();
    fs::rename(&second.index_path, &first.index_path).unwrap();
    let mut files = first.map_output_files();
    files.num_partitions = Some(3);
    let second_out = store.register(files).unwrap();
    assert_ne!(first_out.id(), second_out.id());

    assert_eq!(store.len(), 1);
    let new_slice = store.resolve(2, 5, 0, 3).unwrap();
    assert_eq!(new_slice.id(), second_out.id());
    assert!(new_slice.read().unwrap() == second.range_bytes(0, 3).as_slice());
    assert_eq!(old_slice.id(), first_out.id());
    assert!(old_slice.read().unwrap() == first.range_bytes(0, 2).as_slice());
    let stats = store.stats();
    assert_eq!((stats.registrations, stats.replacements), (2, 1));
}

#[test]
fn refused_reregistration_keeps_the_existing_output() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 2, 6, &[10, 20], 1).unwrap();
    let out = store.register(gen.map_output_files()).unwrap();
    let mut files = gen.map_output_files();
    files.index_path = dir.path().join("does-not-exist.index");
    assert!(store.register(files).is_err());
    assert_eq!(store.get(2, 6).unwrap().id(), out.id());
}

#[test]
fn unregister_stops_new_resolves_but_outstanding_slices_stay_readable() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let a = write_map_output(dir.path(), 3, 1, &[4096, 0, 10], 1).unwrap();
    let b = write_map_output(dir.path(), 3, 2, &[7, 7], 2).unwrap();
    let other = write_map_output(dir.path(), 4, 1, &[9], 3).unwrap();
    for g in [&a, &b, &other] {
        store.register(g.map_output_files()).unwrap();
    }
    let held = store.resolve(3, 1, 0, 3).unwrap();

    assert_eq!(store.unregister_shuffle(3), 2);
    assert_eq!(store.unregister_shuffle(3), 0);
    // Spark deletes the files when it cleans the shuffle up; a held slice's descriptor outlives that.
    fs::remove_file(&a.data_path).unwrap();
    fs::remove_file(&a.index_path).unwrap();

    assert!(matches!(store.resolve(3, 1, 0, 1), Err(StoreError::UnknownShuffle { shuffle_id: 3 })));
    assert!(held.read().unwrap() == a.range_bytes(0, 3).as_slice());
    let mut via_fd = vec![0u8; 10];
    held.file().unwrap().unwrap().read_exact_at(&mut via_fd, 4096).unwrap();
    assert_eq!(via_fd, a.partitions[2]);

    assert_eq!(store.shuffle_ids(), vec![4]);
    assert_eq!(store.len(), 1);
    check_all_ranges(&store, &other);

    assert!(store.unregister_map_output(4, 1));
    assert!(!store.unregister_map_output(4, 1));
    assert!(store.is_empty());
    assert!(matches!(store.resolve(4, 1, 0, 1), Err(StoreError::UnknownShuffle { .. })));
}

#[test]
fn list_and_stats_describe_the_store() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let x = write_map_output(dir.path(), 9, 2, &[3, 4], 1).unwrap();
    let y = write_map_output(dir.path(), 9, 1, &[5], 1).unwrap();
    let z = write_map_output(dir.path(), 1, 7, &[], 1).unwrap();
    for g in [&x, &y, &z] {
        store.register(g.map_output_files()).unwrap();
    }
    let list = store.list();
    let keys: Vec<_> = list.iter().map(|i| (i.shuffle_id, i.map_id)).collect();
    assert_eq!(keys, vec![(1, 7), (9, 1), (9, 2)]);
    assert_eq!(list[2].num_partitions, 2);
    assert_eq!(list[2].data_len, 7);
    assert_eq!(list[2].data_path, x.data_path);
    assert_eq!(list[0].num_partitions, 0);

    store.resolve(9, 2, 0, 2).unwrap();
    // A zero-partition output has nothing to fetch.
    assert!(matches!(store.resolve(1, 7, 0, 1), Err(StoreError::PartitionOutOfRange { num_partitions: 0, .. })));
    let stats = store.stats();
    assert_eq!(stats.shuffles, 2);
    assert_eq!(stats.map_outputs, 3);
    assert_eq!(stats.data_bytes, 12);
    assert_eq!(stats.index_entries, 3 + 2 + 1);
    assert_eq!(stats.resolves, 1);
    assert_eq!(stats.failed_resolves, 1);
}

#[test]
fn raw_index_with_declared_partitions() {
    // write_index lets tests build any index by hand; a valid hand-built one registers.
    let dir = tempdir();
    let store = MapOutputStore::new();
    let data = dir.path().join("shuffle_0_0_0.data");
    let index = dir.path().join("shuffle_0_0_0.index");
    fs::write(&data, b"hello world").unwrap();
    write_index(&index, &[0, 5, 5, 11]).unwrap();
    store
        .register(MapOutputFiles { shuffle_id: 0, map_id: 0, data_path: data, index_path: index, num_partitions: Some(3) })
        .unwrap();
    assert_eq!(store.resolve(0, 0, 0, 1).unwrap().read().unwrap(), b"hello");
    assert_eq!(store.resolve(0, 0, 1, 3).unwrap().read().unwrap(), b" world");
}

// ---------------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------------

/// Readers resolve and verify bytes while a writer keeps registering, replacing and
/// unregistering another shuffle. Readers of the stable shuffle must never fail; readers of
/// the churning one either get correct bytes or a not-found error.
#[test]
fn concurrent_resolves_during_registration_churn() {
    let dir = tempdir();
    let store = Arc::new(MapOutputStore::new());
    let stable: Vec<GeneratedOutput> =
        (0..4).map(|m| write_map_output(dir.path(), 0, m, &[300, 0, 1200, 17, 64], m).unwrap()).collect();
    for g in &stable {
        store.register(g.map_output_files()).unwrap();
    }
    // Two versions of the churning outputs with different content and layout, in separate
    // directories, so a reader can check which one it got by the slice's partition count.
    let churn_dirs = [tempdir(), tempdir()];
    let churn: Vec<Vec<GeneratedOutput>> = churn_dirs
        .iter()
        .enumerate()
        .map(|(v, d)| {
            let sizes: &[usize] = if v == 0 { &[50, 60] } else { &[7, 0, 900] };
            (0..3).map(|m| write_map_output(d.path(), 1, m, sizes, 100 + v as u64 * 10 + m).unwrap()).collect()
        })
        .collect();

    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (store, stable, churn, done) = (&store, &stable, &churn, &done);
            s.spawn(move || {
                let mut rng = TestRng::new(t);
                let mut checked = 0u64;
                while !done.load(Ordering::Relaxed) || checked < 200 {
                    let g = &stable[rng.below(4) as usize];
                    let start = rng.below(5) as u32;
                    let end = start + 1 + rng.below(5 - u64::from(start)) as u32;
                    let slice = store.resolve(0, g.map_id, start, end).unwrap();
                    assert!(slice.read().unwrap() == g.range_bytes(start, end).as_slice());

                    let m = rng.below(3);
                    match store.resolve(1, m, 0, 2) {
                        Ok(slice) => {
                            let v = if slice.output().num_partitions() == 2 { 0 } else { 1 };
                            let expected = churn[v][m as usize].range_bytes(0, 2);
                            assert!(slice.read().unwrap() == expected.as_slice());
                        }
                        Err(StoreError::UnknownShuffle { .. }) | Err(StoreError::UnknownMapOutput { .. }) => {}
                        Err(e) => panic!("unexpected error during churn: {e}"),
                    }
                    checked += 1;
                }
            });
        }
        let (store, churn, done) = (&store, &churn, &done);
        s.spawn(move || {
            for round in 0..150usize {
                for g in &churn[round % 2] {
                    store.register(g.map_output_files()).unwrap();
                }
                if round % 3 == 2 {
                    store.unregister_shuffle(1);
                }
            }
            done.store(true, Ordering::Relaxed);
        });
    });
    assert_eq!(store.resolve(0, 3, 0, 5).unwrap().len(), 1581);
    assert_eq!(store.stats().rejected_registrations, 0);
}

/// Issue 14: a data file truncated or deleted after commit gives typed errors that name the
/// output, the file and both lengths, on resolve and on a read of a slice resolved before.
#[test]
fn truncated_or_deleted_data_file_gives_typed_errors() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let gen = write_map_output(dir.path(), 5, 11, &[4000, 9000, 20000], 3).unwrap();
    store.register(gen.map_output_files()).unwrap();
    let held = store.resolve(5, 11, 2, 3).unwrap();
    fs::OpenOptions::new().write(true).open(&gen.data_path).unwrap().set_len(5000).unwrap();
    assert!(store.resolve(5, 11, 0, 1).unwrap().read().unwrap() == gen.partitions[0]);
    match store.resolve(5, 11, 1, 3) {
        Err(e @ StoreError::DataTruncated { shuffle_id: 5, map_id: 11, expected: 33000, actual: 5000, .. }) => {
            assert_eq!(e.class(), StoreErrorClass::CorruptOutput);
            let msg = e.to_string();
            assert!(msg.contains("data file truncated") && msg.contains("reduce [1, 3)"), "{msg}");
            assert!(msg.contains(&gen.data_path.display().to_string()), "{msg}");
        }
        other => panic!("expected DataTruncated, got {other:?}"),
    }
    // Resolved before the cut, read after it: pread sees the short file.
    assert!(matches!(held.read(), Err(StoreError::DataTruncated { actual: 5000, expected: 33000, .. })));
    fs::remove_file(&gen.data_path).unwrap();
    match store.resolve(5, 11, 0, 1) {
        Err(e @ StoreError::DataFileMissing { shuffle_id: 5, map_id: 11, .. }) => {
            assert!(e.to_string().contains("data file missing"), "{e}")
        }
        other => panic!("expected DataFileMissing, got {other:?}"),
    }
}

/// A data file renamed over (a retried attempt committing new files under the same names)
/// keeps serving the registered bytes from its open descriptor until Spark registers the
/// new output; a data file deleted gives `DataFileMissing`. Both leave the open file without
/// a name (link count 0): only the path tells them apart.
#[test]
fn renamed_over_data_file_serves_until_reregistered_deleted_one_is_missing() {
    let dir = tempdir();
    let store = MapOutputStore::new();
    let first = write_map_output(dir.path(), 6, 1, &[100, 50], 1).unwrap();
    store.register(first.map_output_files()).unwrap();
    let staging = tempdir();
    let second = write_map_output(staging.path(), 6, 1, &[30, 70, 1], 2).unwrap();
    fs::rename(&second.data_path, &first.data_path).unwrap();
    let slice = store.resolve(6, 1, 0, 2).unwrap();
    assert!(slice.read().unwrap() == first.range_bytes(0, 2).as_slice(), "the registered bytes, not the new file's");
    fs::remove_file(&first.data_path).unwrap();
    assert!(matches!(store.resolve(6, 1, 0, 1), Err(StoreError::DataFileMissing { shuffle_id: 6, map_id: 1, .. })));
}
