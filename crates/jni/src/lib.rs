//! JNI bridge between the JVM plugin (`org.apache.spark.shuffle.rdma.NativeBridge`) and the
//! native engine.
//!
//! Rules every export follows (see [`guard`]):
//! * `Err` and panics become a pending `RdmaShuffleException(kind, message)`, never an abort:
//!   the executor JVM must survive anything the engine does;
//! * native objects cross as `jlong` handles with an explicit close;
//! * fetched blocks reach Java as direct `ByteBuffer`s over pool memory, plus a lease handle
//!   that `releaseLease` returns to the pool — the fetch path never copies into the Java heap.
#![deny(missing_docs)]

mod bridge;
pub mod errors;
pub mod heap;
pub mod leases;

/// Every Rust allocation of the library is counted (the `native_heap_bytes` gauge).
#[global_allocator]
static ALLOC: heap::CountingAlloc = heap::CountingAlloc;

pub use errors::{guard, BridgeError};
