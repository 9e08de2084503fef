//! Transport fabric of rdma-shuffle: the providers that move bytes (TCP, verbs, in-memory
//! simulation) and the registered memory they move them from and into.
//!
//! The crate is shared by the shuffle engine and, later, other users of the same transport,
//! so nothing in it knows about Spark shuffles beyond the names of user-facing settings
//! quoted in error messages.
#![deny(missing_docs)]

pub mod pool;
