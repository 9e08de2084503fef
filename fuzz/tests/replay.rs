//! The harnesses without libFuzzer: every seed, then randomly mutated seeds.
//!
//! This is the stable-toolchain fallback of `scripts/fuzz.sh` and a quick regression check
//! for the harnesses themselves. It is coverage-blind, so it finds far less than libFuzzer;
//! its budget comes from the environment:
//! `WIRE_FUZZ_SECONDS` (per target; when unset, `WIRE_FUZZ_ITERS` inputs, default 3000) and
//! `WIRE_FUZZ_SEED` (default fixed, so plain `cargo test` is deterministic).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};
use wire_fuzz::handshake::{self, Mode};
use wire_fuzz::{frame_decode, seeds, verbs_bootstrap};

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One libFuzzer-style mutation: flip, set to an interesting value, insert, erase, splice.
fn mutate(rng: &mut Rng, input: &mut Vec<u8>, other: &[u8]) {
    const INTERESTING: [u8; 8] = [0, 1, 0x7f, 0x80, 0xff, 0x10, 0x40, 13];
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(input.len() + 1);
        match rng.below(6) {
            0 if at < input.len() => input[at] ^= 1 << rng.below(8),
            1 if at < input.len() => input[at] = INTERESTING[rng.below(INTERESTING.len())],
            2 => input.insert(at, rng.next() as u8),
            3 if at < input.len() => {
                let n = rng.below(input.len() - at + 1);
                input.drain(at..at + n);
            }
            4 if !other.is_empty() => {
                let from = rng.below(other.len());
                let n = rng.below(other.len() - from + 1).min(64);
                input.splice(at..at, other[from..from + n].iter().copied());
            }
            _ => input.truncate(at),
        }
    }
}

fn run_one(target: &str, harness: fn(&[u8]), input: &[u8]) {
    if catch_unwind(AssertUnwindSafe(|| harness(input))).is_err() {
        let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
        panic!("{target} failed on input (hex) {hex}");
    }
}

fn fuzz(target: &str, harness: fn(&[u8]), seeds: Vec<(String, Vec<u8>)>) {
    let seed = std::env::var("WIRE_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_f00d_u64);
    let budget = std::env::var("WIRE_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).map(Duration::from_secs);
    let iters: u64 = std::env::var("WIRE_FUZZ_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(3000);
    let mut rng = Rng(seed | 1);
    let corpus: Vec<Vec<u8>> = seeds.into_iter().map(|(_, b)| b).collect();
    for s in &corpus {
        run_one(target, harness, s);
    }
    let start = Instant::now();
    let mut n = 0u64;
    while budget.map_or(n < iters, |b| start.elapsed() < b) {
        let mut input = corpus[rng.below(corpus.len())].clone();
        let other = &corpus[rng.below(corpus.len())];
        // Keep the mode byte of handshake scripts most of the time: a mutated mode turns a
        // script into noise for another mode.
        let mode = input.first().copied();
        mutate(&mut rng, &mut input, other);
        if let (Some(m), Some(first)) = (mode, input.first_mut()) {
            if rng.below(8) != 0 {
                *first = m;
            }
        }
        run_one(target, harness, &input);
        n += 1;
    }
    eprintln!("{target}: {n} mutated inputs in {:.1} s (seed {seed})", start.elapsed().as_secs_f64());
}

#[test]
fn frame_decode_seeds_and_mutations() {
    fuzz("frame_decode", frame_decode::run, seeds::frame_decode());
}

#[test]
fn handshake_seeds_and_mutations() {
    fuzz("handshake", handshake::run, seeds::handshake());
}

#[test]
fn verbs_bootstrap_seeds_and_mutations() {
    fuzz("verbs_bootstrap", verbs_bootstrap::run, verbs_bootstrap::seeds());
}

/// The seeds do what their names say, so the fuzzer starts from deep states.
#[test]
fn handshake_seeds_reach_deep_states() {
    for (name, bytes) in seeds::handshake() {
        let st = handshake::run_with_stats(&bytes);
        match name.as_str() {
            "server-open" | "server-secret" => {
                // One eager block, one rendezvous, then a pull of the whole region.
                assert_eq!(st.mode, Some(Mode::Server));
                assert!(st.server_served >= 3, "{name}: {st:?}");
            }
            "server-raw" => assert_eq!(st.server_served, 2, "{name}: {st:?}"),
            "server-wrong-proof" => assert_eq!(st.server_served, 0, "{name}: {st:?}"),
            "client-open" | "client-secret" => {
                assert!(st.client_connected, "{name}: {st:?}");
                assert_eq!(st.client_blocks_ended, 4, "{name}: {st:?}");
            }
            "client-forged-ready" => {
                assert!(!st.client_connected, "{name}: {st:?}");
                assert_eq!(st.client_blocks_ended, 1, "{name}: the queued block fails: {st:?}");
            }
            "pair-secret" => assert_eq!(st.pair_blocks_checked, 10, "{name}: {st:?}"),
            "pair-open-tiny-credits" | "pair-no-rendezvous" => assert_eq!(st.pair_blocks_checked, 5, "{name}: {st:?}"),
            "pair-mismatch" => {
                assert_eq!((st.pair_blocks_checked, st.server_served), (10, 0), "{name}: {st:?}");
            }
            "pair-corrupt" | "pair-timeout" => {
                assert_eq!(st.pair_blocks_checked, 0, "{name}: disturbed runs are not compared: {st:?}");
                assert!(st.client_blocks_ended > 0, "{name}: {st:?}");
            }
            other => panic!("seed {other} has no expectation here"),
        }
    }
}

/// Every input a fuzzer once failed on (`fuzz/regressions/<target>/`) passes now.
#[test]
fn past_crashes_pass() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    type Harness = fn(&[u8]);
    let targets: [(&str, Harness); 3] =
        [("frame_decode", frame_decode::run), ("handshake", handshake::run), ("verbs_bootstrap", verbs_bootstrap::run)];
    let mut replayed = 0;
    for (target, harness) in targets {
        let Ok(entries) = std::fs::read_dir(dir.join(target)) else { continue };
        for entry in entries {
            let path = entry.unwrap().path();
            let input = std::fs::read(&path).unwrap();
            eprintln!("replaying {}", path.display());
            run_one(target, harness, &input);
            replayed += 1;
        }
    }
    assert!(replayed > 0, "no inputs under {}", dir.display());
}
