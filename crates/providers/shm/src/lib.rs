//! The shm provider: peers on the same host exchange messages through shared memory.
//!
//! # How a connection is made, and why it is safe
//!
//! The listener is a Unix-domain `SOCK_SEQPACKET` socket in the **abstract namespace**: it has
//! no file, so nothing is left behind when a process dies, and it is scoped to the network
//! namespace, so the namespace "hosts" of the test cluster stay apart even on one kernel. Its
//! name carries a random part (see [`unique_name`]); the connection is set up by the
//! [`handshake`](ShmConnecting) in four messages:
//!
//! * Both sides read the other's uid **from the kernel** (`SO_PEERCRED`), not from the peer,
//!   and refuse a process of another user — before anything is created for it.
//! * With a shared secret (the same one the tcp handshake uses: the application's or the
//!   Mobius group's), both sides prove they know it with HMAC-SHA256 over the exchanged
//!   nonces (wire's transcript and labels), the acceptor first. A process of another job —
//!   same user, other secret — is refused.
//! * Only then does the acceptor create the **segment**: a `memfd` (anonymous memory, no name
//!   in any filesystem, so no permission bits another user could get around), sealed against
//!   shrinking and growing (a peer that could shrink it could make our next access a SIGBUS),
//!   and sends it with two eventfd doorbells by `SCM_RIGHTS`. The connector checks the seals
//!   and the size before it maps it.
//! * Both sides close their memfd descriptor as soon as the segment is mapped. From then on
//!   nothing but the two mappings refers to the memory: there is no name to unlink and no
//!   descriptor another process could reach. The kernel frees it with the last mapping, so a
//!   rank that dies — `kill -9` included — leaves nothing behind once its peer drops the
//!   connection. (A process of the same user with ptrace rights over a rank can always read
//!   that rank's memory; that is the same trust boundary as for everything else in it.)
//!
//! The control socket stays open for the connection's lifetime and carries nothing more: when
//! the peer exits or dies the kernel closes its end, the socket polls as hung up, and the
//! connection fails with [`FabricError::Closed`](rdma_shuffle_fabric::FabricError::Closed) naming the peer
//! after everything the peer sent before was delivered — an error, not a hang.
//!
//! # Messages
//!
//! Each direction is a single-producer/single-consumer ring of records in the segment
//! ([`ring`]): cache-line-separated head and tail, release/acquire ordering, every value read
//! from the peer bounds-checked. A message up to half a ring goes as one record.
//!
//! Larger messages (from [`ShmConfig::single_copy_min`]) go by **single copy** where the
//! kernel allows it: the sender leaves the message in its own memory and sends its address;
//! the receiver copies it with `process_vm_readv` (cross-memory attach, as Open MPI's sm
//! does) and acknowledges, and only then does the sender free it. The receiver pulls, so
//! nobody ever writes into another process's memory. CMA needs ptrace permission over the
//! sender, which containers (no `CAP_SYS_PTRACE`, seccomp) and Yama often deny: the handshake
//! tests it once per connection by reading a probe word of the peer, and where it fails the
//! message is **copied through the segment** in fragments of half a ring (copy in, copy out).
//!
//! A message whose body is the caller's own memory (a Mobius rendezvous send: the
//! [`Link`](rdma_shuffle_fabric::providers::link::Link) gets it as a memory [`Source`](rdma_shuffle_fabric::providers::Source))
//! is not copied into a message first. Up to [`ShmConfig::largest_ring_body`] it goes **into
//! the ring with its head, in one record, straight from the caller's buffer**
//! ([`ShmConn::send_through_ring`]; the send is complete once the record is in the ring). The
//! receiving link hands the head to the protocol as a frame and leaves the record in the ring
//! until the protocol placed the body: copied, or reduced
//! ([`Placement::Fold`](rdma_shuffle_fabric::providers::link::Placement::Fold)), straight out of the ring
//! into its destination, then the record is freed. Two copies in all, and no acknowledgement:
//! on this project's machines `process_vm_readv` costs 3.6 memcpys a byte (the kernel pins
//! the source page by page; `cargo run --release -p rdma-shuffle-provider-shm --example cma_copy`),
//! so two copies through the ring beat one single copy, and need no ptrace permission.
//! A larger body goes by reference: the record carries the frame's head and the
//! address of the caller's buffer ([`ShmConn::send_borrowed`]), the receiving link hands the
//! head to the protocol as a frame, as a stream link would, and copies the body with
//! `process_vm_readv` straight into the buffer the protocol places it in (a pool buffer),
//! then acknowledges. The send is complete (`write_progress`) only on that acknowledgement,
//! so the caller keeps its buffer until the peer has read it: one copy in all. A body of at
//! least [`link::FOLD_MIN`] bytes whose receive reduces (a Mobius reduce-scatter segment,
//! [`Placement::Fold`](rdma_shuffle_fabric::providers::link::Placement::Fold)) is reduced on its way in
//! instead: copied a piece at a time into a scratch buffer and folded into the receive
//! ([`ShmConn::fold_body`]), so no pool buffer holds it whole.
//! Which one is used is logged once per process (`tracing`, with the reason) and reported by
//! [`ShmConn::large_messages`].
//!
//! # Waiting: eventfd doorbells
//!
//! A side that finds nothing to read spins for [`ShmConfig::spin`] (a message of a busy peer
//! typically arrives within it, and a wakeup costs more than the spin), then sets a "sleeping"
//! bit in the segment, looks at the ring once more (a sequentially consistent fence on both
//! sides orders the bit against the ring's head, so no wakeup is lost), and sleeps on its
//! **eventfd**. The peer rings it (one 8-byte `write`) only when that bit is set. An eventfd
//! rather than a futex because the driver waits for all its connections, sockets and timers in
//! one `epoll`: an eventfd is just another readable descriptor there (mio `SourceFd`),
//! whereas a futex would need a thread of its own per connection. The same bit, for "waiting
//! for room", wakes a producer whose ring was full.

mod config;
pub mod conn;
pub mod handshake;
pub mod link;
pub(crate) mod ring;
pub(crate) mod segment;
mod sys;
#[cfg(test)]
mod tests;

pub use config::ShmConfig;
pub use conn::{LargeMessages, LentBody, Received, ShmConn, ShmConnStats, RING_HEAD_ROOM};
pub use handshake::{unique_name, ShmAccepting, ShmConnecting, ShmListener};
pub use link::{registration, ShmProvider};
