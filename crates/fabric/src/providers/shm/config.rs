//! The settings of shm connections (apart, so the connection and the handshake need nothing
//! from the module that re-exports them).

use rdma_shuffle_wire::Secret;
use std::time::Duration;

/// Settings of shm connections.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Bytes of each direction's ring (a power of two, 8 KiB–256 MiB). Chosen by the accepting
    /// side. Messages up to half of it travel inline; larger ones by single copy or fragments.
    pub ring_bytes: usize,
    /// Whether large messages may go by single copy (process_vm_readv) where the kernel
    /// allows it. Off: always through the segment.
    pub single_copy: bool,
    /// Messages at least this large go by single copy (when it is available).
    pub single_copy_min: usize,
    /// Largest message; a peer announcing a larger one is an error, nothing is allocated.
    pub max_message: usize,
    /// The shared secret both sides must prove (the one the tcp handshake uses), or none.
    pub secret: Option<Secret>,
    /// How long a waiting side spins on its ring before it sleeps on the doorbell.
    pub spin: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            ring_bytes: 1 << 20,
            single_copy: true,
            // Above 64 KiB by a header's room: a protocol's message at a 64 KiB eager limit
            // (Mobius') still travels through the ring. With the bare 64 KiB every such message
            // went by process_vm_readv and an acknowledgement instead, and a 2-rank 64 KiB
            // allreduce took 58-89 us against 17-18 us through the ring (Open MPI sm: 22-23).
            single_copy_min: 64 * 1024 + 64,
            max_message: 1 << 30,
            secret: None,
            spin: Duration::from_micros(50),
        }
    }
}
