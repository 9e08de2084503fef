#![no_main]
//! Arbitrary bytes through the frame decoder; see `wire_fuzz::frame_decode`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| wire_fuzz::frame_decode::run(data));
