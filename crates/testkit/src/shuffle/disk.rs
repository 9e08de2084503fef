//! Disk faults under a registered map output (issue 14): a data file truncated or deleted
//! after commit fails the blocks that need it with a typed error naming the file, never
//! SIGBUS; the server keeps serving everything else.

use super::*;
use std::fs;

pub fn truncated_or_deleted_data_files_fail_typed(f: Factory) {
    let fx = server_with(f, server_cfg(None), 2);
    let addr = fx.server.local_addr();
    let (a, b) = (&fx.outputs[0], &fx.outputs[1]);
    let offsets = a.offsets();
    // Cut map A inside partition 3 (an eager block of several pages): partitions 1 and 2
    // stay whole; 3 (eager), 6 and 8 (rendezvous) reach past the new end.
    let cut = offsets[3] as u64 + 100;
    fs::OpenOptions::new().write(true).open(&a.data_path).unwrap().set_len(cut).unwrap();
    // Map B's data file disappears.
    fs::remove_file(&b.data_path).unwrap();

    let c = client(f, None, 64 << 20);
    let blocks = [
        ShuffleBlock::single(3, a.map_id, 1),
        ShuffleBlock::single(3, a.map_id, 2),
        ShuffleBlock::single(3, a.map_id, 3),
        ShuffleBlock::single(3, a.map_id, 6),
        ShuffleBlock::single(3, a.map_id, 8),
        ShuffleBlock::batch(3, a.map_id, 0, 10),
        ShuffleBlock::single(3, b.map_id, 2),
        ShuffleBlock::single(3, b.map_id, 0), // empty: needs no bytes
    ];
    let got = fetch_all(&c, addr, &blocks);
    for (i, r) in [(0, 1), (1, 2)] {
        assert_eq!(got[&i].as_ref().unwrap_or_else(|e| panic!("intact block {r}: {e}")), &a.range_bytes(r, r + 1));
    }
    for i in [2, 3, 4, 5] {
        let e = got[&i].as_ref().expect_err("a block past the cut was served");
        assert_eq!(e.code, FailureCode::Corrupt, "block {i}: {e}");
        let data = a.data_path.display().to_string();
        assert!(
            e.message.contains("data file truncated")
                && e.message.contains(&data)
                && e.message.contains(&format!("shuffle 3 map {}", a.map_id))
                && e.message.contains(&format!("is {cut} bytes")),
            "block {i}: {}",
            e.message
        );
    }
    let e = got[&6].as_ref().expect_err("a block of a deleted file was served");
    assert_eq!(e.code, FailureCode::Corrupt, "{e}");
    assert!(e.message.contains("data file missing") && e.message.contains(&b.data_path.display().to_string()), "{}", e.message);
    assert!(got[&7].as_ref().unwrap().is_empty());

    // The same connection and server go on serving.
    let again = fetch_all(&c, addr, &[ShuffleBlock::single(3, a.map_id, 2)]);
    assert_eq!(again[&0].as_ref().unwrap(), &a.range_bytes(2, 3));
    assert_eq!(c.connections(), 1, "a disk fault failed blocks, not the connection");

    // Spark recomputes the map output and registers it again: served whole.
    let redo = write_map_output(fx.dir.path(), 3, a.map_id, &layout(0), 42).unwrap();
    fx.server.register(redo.map_output_files()).unwrap();
    let after = fetch_all(&c, addr, &[ShuffleBlock::single(3, a.map_id, 8)]);
    assert_eq!(after[&0].as_ref().unwrap(), &redo.range_bytes(8, 9));
}
