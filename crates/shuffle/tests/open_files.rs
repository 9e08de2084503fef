//! The store's bound on open data files (issue 14), alone in its test binary so that the
//! process's descriptor count (/proc/self/fd) measures only the store.

use std::fs;

use rdma_shuffle_shuffle::store::{MapOutputStore, StoreConfig, StoreError};
use rdma_shuffle_shuffle::testkit::{write_map_output, TestRng};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

fn open_fds() -> usize {
    fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Issue 14: with `max_open_files` = 4, 50 registered outputs keep at most 4 data files open;
/// fetches in random order reopen what they need and get the right bytes; a file deleted
/// while closed fails its fetch typed.
#[test]
fn open_data_files_stay_under_the_cap_and_reopen_on_demand() {
    let dir = tempdir();
    let store = MapOutputStore::with_config(StoreConfig { max_open_files: 4, ..StoreConfig::default() });
    let before = open_fds();
    let gens: Vec<_> =
        (0..50u64).map(|m| write_map_output(dir.path(), 8, m, &[100 + m as usize, 0, 5000, 17], m).unwrap()).collect();
    for g in &gens {
        store.register(g.map_output_files()).unwrap();
    }
    let st = store.stats();
    assert_eq!((st.map_outputs, st.open_files), (50, 4), "{st:?}");
    // The only test of its binary, so nothing else opens files meanwhile.
    assert!(open_fds() <= before + 4, "{} descriptors open, {before} before registering 50 outputs", open_fds());

    let mut rng = TestRng::new(7);
    let mut peak = 0;
    for _ in 0..400 {
        let m = (rng.next_u64() % 50) as usize;
        let r = (rng.next_u64() % 4) as u32;
        let slice = store.resolve(8, m as u64, r, r + 1).unwrap();
        assert!(slice.read().unwrap() == gens[m].partitions[r as usize], "map {m} reduce {r}");
        drop(slice);
        peak = peak.max(store.stats().open_files);
    }
    let st = store.stats();
    assert!(peak <= 4 && st.open_files <= 4, "peak {peak}, {st:?}");
    assert!(st.file_evictions > 0 && st.file_opens > 50, "files were closed and reopened: {st:?}");
    assert!(open_fds() <= before + 4, "{} descriptors open after 400 fetches (before: {before})", open_fds());

    // A map output whose file is closed (four others used since) and then deleted: typed
    // error on its next fetch, naming the file.
    for m in 46..50 {
        store.resolve(8, m, 0, 1).unwrap();
    }
    fs::remove_file(&gens[0].data_path).unwrap();
    match store.resolve(8, 0, 0, 1) {
        Err(e @ StoreError::DataFileMissing { map_id: 0, .. }) => {
            assert!(e.to_string().contains(&gens[0].data_path.display().to_string()), "{e}")
        }
        other => panic!("expected DataFileMissing, got {other:?}"),
    }
    // Unregistering closes everything.
    assert_eq!(store.unregister_shuffle(8), 50);
    assert_eq!(store.stats().open_files, 0);
}
