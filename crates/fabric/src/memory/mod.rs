//! Memory: the tiered pool of registered buffers fetched blocks land in, the registration of
//! memory with a provider's device, and the accounting of every byte the engines hold
//! outside the JVM heap.

pub mod accounting;
pub mod pool;
pub mod registration;
