#![no_main]
//! Scripted peers against the session state machines; see `wire_fuzz::handshake`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| wire_fuzz::handshake::run(data));
