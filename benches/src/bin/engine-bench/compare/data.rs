//! The data: the map outputs every system serves, in Spark's layout.

use rdma_shuffle_shuffle::store::MapOutputFiles;
use rdma_shuffle_shuffle::testkit::{write_index, write_map_output, TestRng};
use rdma_shuffle_shuffle::ShuffleBlock;
use std::path::{Path, PathBuf};

use super::{Config, MAP_BYTES, R, SHUFFLE_BULK_BASE, SHUFFLE_SMALL, SMALL, SMALL_PARTS};

/// Where each system finds one set of blocks.
#[derive(Clone, Debug)]
pub(super) struct BlockSet {
    /// Engine shuffle id.
    pub(super) shuffle_id: u32,
    /// Per map output: data file, index file.
    pub(super) maps: Vec<(PathBuf, PathBuf)>,
    /// Blocks per map output.
    pub(super) parts: usize,
    /// Block size.
    pub(super) size: usize,
}

impl BlockSet {
    pub(super) fn engine_files(&self) -> Vec<MapOutputFiles> {
        self.maps
            .iter()
            .enumerate()
            .map(|(m, (d, i))| MapOutputFiles {
                shuffle_id: self.shuffle_id,
                map_id: m as u64,
                data_path: d.clone(),
                index_path: i.clone(),
                num_partitions: Some(self.parts as u32),
            })
            .collect()
    }

    pub(super) fn netty_specs(&self) -> Vec<String> {
        self.maps.iter().map(|(d, i)| format!("{}|{}|0|{}", d.display(), i.display(), self.parts)).collect()
    }

    pub(super) fn engine_blocks(&self, map: usize) -> Vec<ShuffleBlock> {
        (0..self.parts as u32).map(|r| ShuffleBlock::single(self.shuffle_id, map as u64, r)).collect()
    }

    pub(super) fn bytes(&self) -> u64 {
        (self.maps.len() * self.parts * self.size) as u64
    }
}

/// Writes the map outputs: `maps` data files of 16 MiB (one stream of pseudo-random bytes),
/// an index per block size over the same data files, and the small blocks' map output.
pub(super) fn write_data(cfg: &Config, dir: &Path) -> R<(Vec<BlockSet>, BlockSet)> {
    let io = |what: String| move |e: std::io::Error| format!("{what}: {e}");
    let mut rng = TestRng::new(0x5eed);
    let mut buf = vec![0u8; MAP_BYTES];
    let mut data = Vec::new();
    for m in 0..cfg.maps() {
        rng.fill(&mut buf);
        let p = dir.join(format!("bulk_{m}.data"));
        std::fs::write(&p, &buf).map_err(io(format!("writing {}", p.display())))?;
        data.push(p);
    }
    let mut sets = Vec::new();
    for (k, &size) in cfg.sizes.iter().enumerate() {
        let parts = MAP_BYTES / size;
        let offsets: Vec<i64> = (0..=parts).map(|i| (i * size) as i64).collect();
        let mut maps = Vec::new();
        for (m, d) in data.iter().enumerate() {
            let i = dir.join(format!("bulk_{m}_{size}.index"));
            write_index(&i, &offsets).map_err(io(format!("writing {}", i.display())))?;
            maps.push((d.clone(), i));
        }
        sets.push(BlockSet { shuffle_id: SHUFFLE_BULK_BASE + k as u32, maps, parts, size });
    }
    let small = write_small(dir)?;
    for s in sets.iter().chain([&small]) {
        for (d, i) in &s.maps {
            for p in [d, i] {
                let t = p.display().to_string();
                if t.contains(' ') || t.contains('|') {
                    return Err(format!("{t}: the bench directory's path must hold no spaces or '|' (set --dir)"));
                }
            }
        }
    }
    Ok((sets, small))
}

/// Writes the small blocks' map output (1024 x 4 KiB).
pub(super) fn write_small(dir: &Path) -> R<BlockSet> {
    let small = write_map_output(dir, SHUFFLE_SMALL, 0, &[SMALL; SMALL_PARTS], 99)
        .map_err(|e| format!("writing the small blocks in {}: {e}", dir.display()))?;
    Ok(BlockSet { shuffle_id: SHUFFLE_SMALL, maps: vec![(small.data_path, small.index_path)], parts: SMALL_PARTS, size: SMALL })
}
