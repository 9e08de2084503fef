//! The settings of shm connections (apart, so the connection and the handshake need nothing
//! from the module that re-exports them).

use crate::ring::RING_HEAD_ROOM;
use rdma_shuffle_wire::Secret;
use std::time::Duration;

/// Settings of shm connections.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Bytes of each direction's ring (a power of two, 8 KiB–256 MiB). Chosen by the accepting
    /// side. Messages up to half of it travel inline, a caller's body up to
    /// [`largest_ring_body`](Self::largest_ring_body) with its head in one record; larger
    /// ones by single copy or fragments.
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

impl ShmConfig {
    /// The largest body of a caller's memory that goes into the ring with its head, in one
    /// record ([`ShmConn::send_through_ring`](super::ShmConn::send_through_ring)), with rings
    /// of [`ring_bytes`](Self::ring_bytes): half a ring, less a record header and the room
    /// kept for the head ([`RING_HEAD_ROOM`]).
    pub fn largest_ring_body(&self) -> usize {
        (self.ring_bytes / 2).saturating_sub(8 + RING_HEAD_ROOM)
    }
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            // A record takes up to half a ring: 2 MiB carries a 1 MiB allreduce's 512 KiB
            // halves (2 ranks) through the ring. Shared memory of 4 MiB per same-host peer,
            // touched only as far as messages reach.
            ring_bytes: 2 << 20,
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
