//! The block client: fetches Spark shuffle blocks from many executors' block servers.

use crate::blocks::{BlockSink, ChunkSink, ClientEndpoint, ClientEndpointConfig, ClientStats, FetchedBlock, StreamConfig};
use crate::knobs::render_failure;
use crate::store::{MapId, ReduceId, ShuffleId};
use rdma_shuffle_fabric::{Driver, DriverConfig, FabricError, Provider, TieredPool};
use rdma_shuffle_wire::{BlockFailure, BlockRange, BlockSpan};
use std::net::SocketAddr;
use std::sync::Arc;

/// A Spark shuffle block: one reduce partition (`ShuffleBlockId`) or a contiguous range
/// (`ShuffleBlockBatchId`) of one map output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShuffleBlock {
    /// Shuffle id.
    pub shuffle_id: ShuffleId,
    /// Map id (map task attempt id).
    pub map_id: MapId,
    /// First reduce id, inclusive.
    pub start_reduce: ReduceId,
    /// Last reduce id, exclusive.
    pub end_reduce: ReduceId,
}

impl ShuffleBlock {
    /// `shuffle_<s>_<m>_<r>`.
    pub fn single(shuffle_id: ShuffleId, map_id: MapId, reduce: ReduceId) -> Self {
        ShuffleBlock { shuffle_id, map_id, start_reduce: reduce, end_reduce: reduce + 1 }
    }

    /// `shuffle_<s>_<m>_<start>_<end>`.
    pub fn batch(shuffle_id: ShuffleId, map_id: MapId, start_reduce: ReduceId, end_reduce: ReduceId) -> Self {
        ShuffleBlock { shuffle_id, map_id, start_reduce, end_reduce }
    }

    /// The wire's name for this block.
    pub fn span(&self) -> BlockSpan {
        BlockSpan { group: self.shuffle_id, object: self.map_id, start: self.start_reduce, end: self.end_reduce }
    }
}

/// Fetches blocks with a bound on bytes in flight; every block ends in exactly one call of
/// the fetch's [`BlockSink`], with its bytes or a typed failure.
pub struct BlockClient {
    endpoint: ClientEndpoint,
}

/// Renders the setting behind a failure into its message before the user's sink sees it.
struct SparkSink(Arc<dyn BlockSink>);

impl BlockSink for SparkSink {
    fn on_block(&self, index: usize, result: Result<FetchedBlock, BlockFailure>) {
        self.0.on_block(index, result.map_err(render_failure))
    }
    fn inline(&self) -> bool {
        self.0.inline()
    }
}

/// As [`SparkSink`], for a streamed block.
struct SparkChunkSink(Arc<dyn ChunkSink>);

impl ChunkSink for SparkChunkSink {
    fn on_chunk(&self, offset: u64, block_len: u64, chunk: &[u8]) -> Result<(), BlockFailure> {
        self.0.on_chunk(offset, block_len, chunk)
    }
    fn on_end(&self, result: Result<u64, BlockFailure>) {
        self.0.on_end(result.map_err(render_failure))
    }
}

impl BlockClient {
    /// A client over `provider` on a driver (event loop) of its own, landing blocks in `pool`.
    pub fn new(provider: Arc<dyn Provider>, pool: TieredPool, config: ClientEndpointConfig) -> Result<Self, FabricError> {
        let driver = Driver::new(provider, DriverConfig { name: config.name.clone(), ..DriverConfig::default() })?;
        Self::on(&driver, pool, config)
    }

    /// A client on `driver` (an engine's loop, shared with its server).
    pub fn on(driver: &Driver, pool: TieredPool, config: ClientEndpointConfig) -> Result<Self, FabricError> {
        Ok(BlockClient { endpoint: ClientEndpoint::new(driver, pool, config)? })
    }

    /// Fetches `blocks` from the block server at `addr`; see [`ClientEndpoint::fetch`]. Failure
    /// messages name the Spark setting that cures them, where there is one.
    pub fn fetch(&self, addr: SocketAddr, blocks: &[ShuffleBlock], sink: Arc<dyn BlockSink>) {
        self.endpoint.fetch(addr, blocks.iter().map(ShuffleBlock::span).collect(), Arc::new(SparkSink(sink)))
    }

    /// Fetches byte ranges `(block, offset, len)` of blocks; see
    /// [`ClientEndpoint::fetch_ranges`]. A range past its block's end fails with `bad_range`.
    pub fn fetch_ranges(&self, addr: SocketAddr, ranges: &[(ShuffleBlock, u64, u64)], sink: Arc<dyn BlockSink>) {
        let ranges = ranges.iter().map(|(b, offset, len)| BlockRange { span: b.span(), offset: *offset, len: *len }).collect();
        self.endpoint.fetch_ranges(addr, ranges, Arc::new(SparkSink(sink)))
    }

    /// Streams `block`, of any length (above the pool cap, above 2 GiB), into `sink` in
    /// ranges of at most `config.chunk_len` bytes with at most `config.window` pool buffers
    /// held; see [`ClientEndpoint::fetch_stream`].
    pub fn fetch_stream(&self, addr: SocketAddr, block: ShuffleBlock, config: StreamConfig, sink: Arc<dyn ChunkSink>) {
        self.endpoint.fetch_stream(addr, block.span(), config, Arc::new(SparkChunkSink(sink)))
    }

    /// The driver (event loop) this client runs on.
    pub fn driver(&self) -> &Driver {
        self.endpoint.driver()
    }

    /// Fetching counters.
    pub fn stats(&self) -> &ClientStats {
        self.endpoint.stats()
    }

    /// The block protocol's counters of this client's loop (deliveries, the exposure budget
    /// of servers on the same loop).
    pub fn loop_stats(&self) -> &crate::blocks::BlockLoopStats {
        self.endpoint.loop_stats()
    }

    /// The pool blocks land in.
    pub fn pool(&self) -> &TieredPool {
        self.endpoint.pool()
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.endpoint.connections()
    }

    /// Closes all connections and threads. Idempotent.
    pub fn shutdown(&self) {
        self.endpoint.shutdown()
    }
}
