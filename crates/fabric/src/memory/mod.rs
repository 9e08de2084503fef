//! Memory: the tiered pool of registered buffers fetched blocks land in, and the
//! registration of memory with a provider's device.

pub mod pool;
pub mod registration;
