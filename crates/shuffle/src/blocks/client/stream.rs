//! Streaming fetch: one block of any length as a series of ranges, each of which fits one
//! pool buffer, handed to a [`ChunkSink`] in order.
//!
//! A block larger than the pool cap (or than a JVM array) cannot be fetched whole. The
//! stream first asks for the empty range at offset 0, whose answer tells the block's length,
//! then keeps at most [`StreamConfig::window`] ranges requested and not yet handed to the
//! sink. A range that arrives out of order waits (in its pool buffer) for the ones before
//! it; the next range is asked for only when one has been handed over and its buffer
//! dropped. So one block never holds more than `window` pool buffers, whatever its length:
//! a slow sink slows the stream (backpressure), it does not grow memory.

use super::{BlockSink, ClientEndpoint, FetchedBlock, Fetcher};
use parking_lot::Mutex;
use rdma_shuffle_wire::frame::MAX_RANGE_LEN;
use rdma_shuffle_wire::{BlockFailure, BlockRange, BlockSpan, FailureCode};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Receives one streamed block, chunk by chunk, on the driver's delivery thread.
pub trait ChunkSink: Send + Sync {
    /// The next `chunk` of the block, which starts at `offset` (chunks come in order, back
    /// to back, each non-empty); `block_len` is the whole block's length. The chunk's pool
    /// buffer is free again when this returns. An `Err` ends the stream with that failure.
    fn on_chunk(&self, offset: u64, block_len: u64, chunk: &[u8]) -> Result<(), BlockFailure>;

    /// The stream ended, exactly once: `Ok(block_len)` after the last chunk, or why it
    /// failed (no more chunks follow).
    fn on_end(&self, result: Result<u64, BlockFailure>);
}

/// How a block is streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// Bytes asked for per range; cut to the pool's largest buffer size and to
    /// [`MAX_RANGE_LEN`].
    pub chunk_len: u64,
    /// Most ranges of one block requested and not yet handed to the sink (so most pool
    /// buffers one block holds). At least 1.
    pub window: usize,
}

impl Default for StreamConfig {
    /// 16 MiB ranges, 2 in flight.
    fn default() -> Self {
        StreamConfig { chunk_len: 16 << 20, window: 2 }
    }
}

impl ClientEndpoint {
    /// Streams block `span` from the server at `addr` into `sink` (see the module docs).
    /// Returns at once.
    pub fn fetch_stream(&self, addr: SocketAddr, span: BlockSpan, config: StreamConfig, sink: Arc<dyn ChunkSink>) {
        let largest = self.pool.config().tiers.last().copied().unwrap_or(1) as u64;
        let chunk = config.chunk_len.min(largest).clamp(1, MAX_RANGE_LEN);
        let stream = Arc::new(Stream {
            fetcher: self.fetcher(),
            addr,
            span,
            chunk,
            window: config.window.max(1),
            sink,
            state: Mutex::new(State::default()),
        });
        // The empty range at 0 is inside every block: its answer carries the length.
        stream.request(&mut stream.state.lock(), 0, 0);
    }
}

#[derive(Default)]
struct State {
    /// Known once the first answer came.
    block_len: Option<u64>,
    /// Offset of the next range to ask for.
    next_request: u64,
    /// Offset of the next chunk the sink gets.
    next_deliver: u64,
    /// Ranges that arrived before their predecessors, by offset.
    early: BTreeMap<u64, FetchedBlock>,
    /// Ranges asked for and not yet handed to the sink.
    outstanding: usize,
    done: bool,
}

struct Stream {
    fetcher: Fetcher,
    addr: SocketAddr,
    span: BlockSpan,
    chunk: u64,
    window: usize,
    sink: Arc<dyn ChunkSink>,
    state: Mutex<State>,
}

/// The answer to one range of a stream.
struct RangeAnswer {
    stream: Arc<Stream>,
    offset: u64,
    len: u64,
}

impl BlockSink for RangeAnswer {
    fn on_block(&self, _index: usize, result: Result<FetchedBlock, BlockFailure>) {
        self.stream.answer(self.offset, self.len, result)
    }
}

impl Stream {
    fn request(self: &Arc<Self>, st: &mut State, offset: u64, len: u64) {
        st.outstanding += 1;
        let held = (st.outstanding + st.early.len()) as u64;
        self.fetcher.stats.peak_stream_buffers.fetch_max(held, Ordering::Relaxed);
        let range = BlockRange { span: self.span, offset, len };
        let answer = Arc::new(RangeAnswer { stream: self.clone(), offset, len });
        if let Err(e) = self.fetcher.fetch_ranges(self.addr, vec![range], answer) {
            st.outstanding -= 1;
            self.fail(st, BlockFailure::new(FailureCode::PeerGone, format!("{}: {e}", self.span)));
        }
    }

    fn fail(&self, st: &mut State, failure: BlockFailure) {
        if !st.done {
            st.done = true;
            st.early.clear();
            self.sink.on_end(Err(failure));
        }
    }

    fn answer(self: &Arc<Self>, offset: u64, len: u64, result: Result<FetchedBlock, BlockFailure>) {
        let mut st = self.state.lock();
        st.outstanding = st.outstanding.saturating_sub(1);
        if st.done {
            return;
        }
        let block = match result {
            Ok(b) => b,
            Err(f) => return self.fail(&mut st, f),
        };
        self.fetcher.stats.stream_ranges.fetch_add(1, Ordering::Relaxed);
        let block_len = match st.block_len {
            Some(n) if block.block_len() == n && block.len() as u64 == len => n,
            None if len == 0 => {
                let n = block.block_len();
                st.block_len = Some(n);
                n
            }
            _ => {
                let f = BlockFailure::new(
                    FailureCode::Protocol,
                    format!(
                        "{} from {}: range at {offset} came back with {} bytes of a {}-byte block (asked for {len} of {:?})",
                        self.span,
                        self.addr,
                        block.len(),
                        block.block_len(),
                        st.block_len
                    ),
                );
                return self.fail(&mut st, f);
            }
        };
        if len > 0 {
            st.early.insert(offset, block);
        }
        // Hand over what is next in line, each buffer dropped right after.
        loop {
            let at = st.next_deliver;
            let Some(b) = st.early.remove(&at) else { break };
            if let Err(f) = self.sink.on_chunk(at, block_len, &b) {
                return self.fail(&mut st, f);
            }
            st.next_deliver += b.len() as u64;
        }
        if st.next_deliver == block_len {
            st.done = true;
            self.fetcher.stats.streamed_blocks.fetch_add(1, Ordering::Relaxed);
            self.fetcher.stats.streamed_bytes.fetch_add(block_len, Ordering::Relaxed);
            drop(st);
            self.sink.on_end(Ok(block_len));
            return;
        }
        while !st.done && st.outstanding + st.early.len() < self.window && st.next_request < block_len {
            let at = st.next_request;
            let n = self.chunk.min(block_len - at);
            st.next_request += n;
            self.request(&mut st, at, n);
        }
    }
}
