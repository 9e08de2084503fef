#![no_main]
//! Arbitrary bytes through the verbs attach-record decoder; see `wire_fuzz::verbs_bootstrap`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| wire_fuzz::verbs_bootstrap::run(data));
