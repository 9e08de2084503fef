//! The verbs provider: RDMA over ibverbs (InfiniBand, RoCE; SoftRoCE in the test VM).
//!
//! Only [`bootstrap`] (the attach record codec) and [`memlock`] are built without the
//! `verbs` feature: the fuzzer and the host tests use them without libibverbs.

pub mod bootstrap;
pub mod memlock;

pub use memlock::{can_lock_unlimited, check_memlock, memlock_limit};
