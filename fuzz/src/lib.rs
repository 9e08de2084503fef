//! Fuzz harnesses for `rdma-shuffle-wire`.
//!
//! The harness logic lives in this library, not in the `fuzz_targets/` binaries, so that the
//! same code runs three ways:
//!
//! - under libFuzzer (`cargo fuzz run frame_decode|handshake`, see `scripts/fuzz.sh`);
//! - from `cargo test` on stable, replaying the generated seeds and a bounded number of
//!   randomly mutated inputs (`tests/replay.rs`), which is the fallback where no nightly
//!   toolchain can be had and a quick regression check everywhere else;
//! - from the `seeds` example, which writes the seed corpora.
//!
//! The `verbs_bootstrap` target covers the one decoder outside `wire`: the verbs provider's
//! attach record (built without libibverbs).
//!
//! Every harness takes arbitrary bytes and panics only when the protocol breaks one of the
//! invariants it asserts; see [`frame_decode`] and [`handshake`].
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod cursor;
pub mod frame_decode;
pub mod frames;
pub mod handshake;
pub mod seeds;
pub mod verbs_bootstrap;
