#!/usr/bin/env bash
# Fuzz the wire protocol: each target of fuzz/ for N seconds (default 30), or for a number of
# executions.
#
#   scripts/fuzz.sh [seconds-per-target]     what CI runs (scripts/test.sh: 5 s per target; 60 under --full)
#   scripts/fuzz.sh --long [RUNS]            each target until RUNS executions (default 10 M;
#                                            hours on 2 cores), one worker per core; writes
#                                            target/bench/fuzz.json (runs, seconds, execs/s,
#                                            coverage per target)
#
# Exits non-zero if any target crashes (a panic, a failed invariant, an input slower than
# FUZZ_INPUT_TIMEOUT seconds, or more than FUZZ_RSS_MB of memory); the input is saved under
# fuzz/artifacts/<target>/ and the command to replay it is printed.
#
# Toolchain, in order of preference (FUZZ_ENGINE=libfuzzer-nightly|libfuzzer-bootstrap|stable
# forces one):
#   1. cargo-fuzz + libFuzzer on nightly; a missing nightly is installed with
#      `rustup toolchain install nightly --profile minimal` (works where rustup's download
#      server is reachable);
#   2. cargo-fuzz + libFuzzer on the stable toolchain with RUSTC_BOOTSTRAP=1, which lets
#      stable accept the -Z flags cargo-fuzz passes. Same engine, same coverage guidance; it
#      is what to use where no nightly can be downloaded;
#   3. if cargo-fuzz itself cannot be built, the coverage-blind random driver in
#      fuzz/tests/replay.rs on stable (far weaker; says so loudly).
# cargo-fuzz is installed from crates.io with `cargo install cargo-fuzz --locked` when missing
# (about 3 minutes on 2 cores).
#
# Other settings: FUZZ_TARGETS (default "frame_decode handshake verbs_bootstrap"), FUZZ_SANITIZER (default
# none: the wire crate and the harnesses forbid unsafe code, and without ASan libFuzzer runs
# about twice as many inputs; set "address" to check the dependencies' unsafe code too).
set -euo pipefail

LONG_RUNS=""
if [ "${1:-}" = --long ]; then
    LONG_RUNS="${2:-10000000}"
    if ! [[ "$LONG_RUNS" =~ ^[0-9]+$ ]] || [ "$LONG_RUNS" -lt 1 ]; then
        echo "usage: $0 --long [RUNS]   (got '$LONG_RUNS')" >&2
        exit 2
    fi
    set -- 0
fi
SECONDS_PER_TARGET="${1:-30}"
TARGETS="${FUZZ_TARGETS:-frame_decode handshake verbs_bootstrap}"
SANITIZER="${FUZZ_SANITIZER:-none}"
INPUT_TIMEOUT="${FUZZ_INPUT_TIMEOUT:-10}"
RSS_MB="${FUZZ_RSS_MB:-2048}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ -z "$LONG_RUNS" ] && { ! [[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ ]] || [ "$SECONDS_PER_TARGET" -lt 1 ]; }; then
    echo "usage: $0 [seconds-per-target]   (got '$SECONDS_PER_TARGET')" >&2
    exit 2
fi

log() { echo "fuzz.sh: $*" >&2; }

have_nightly() { cargo +nightly --version >/dev/null 2>&1; }

ensure_cargo_fuzz() {
    if cargo fuzz --version >/dev/null 2>&1; then
        return 0
    fi
    log "cargo-fuzz is missing; installing it from crates.io (takes a few minutes)"
    local t0=$SECONDS
    if cargo install cargo-fuzz --locked >&2; then
        log "cargo-fuzz installed in $((SECONDS - t0)) s"
        return 0
    fi
    log "could not install cargo-fuzz"
    return 1
}

pick_engine() {
    if [ -n "${FUZZ_ENGINE:-}" ]; then
        echo "$FUZZ_ENGINE"
        return
    fi
    if ! ensure_cargo_fuzz; then
        echo stable
        return
    fi
    if have_nightly; then
        echo libfuzzer-nightly
        return
    fi
    log "no nightly toolchain; trying: rustup toolchain install nightly --profile minimal"
    if rustup toolchain install nightly --profile minimal >&2 && have_nightly; then
        echo libfuzzer-nightly
        return
    fi
    log "nightly cannot be installed here; using cargo-fuzz on stable with RUSTC_BOOTSTRAP=1"
    echo libfuzzer-bootstrap
}

ENGINE="$(pick_engine)"
if [ -n "$LONG_RUNS" ]; then
    log "engine: $ENGINE, $LONG_RUNS executions per target, targets: $TARGETS"
else
    log "engine: $ENGINE, ${SECONDS_PER_TARGET} s per target, targets: $TARGETS"
fi

# Seeds: valid frames of every kind and scripts that reach deep session states. They are
# generated, not committed, and written into the corpus directories libFuzzer reads.
cargo run --quiet --release --manifest-path fuzz/Cargo.toml --no-default-features --example seeds -- fuzz/corpus

# The fuzz crate's own tests, before any fuzzing: fuzz/ is outside the workspace, so this is
# the only place CI runs them. They check the seeds (every frame kind is covered, the handshake
# scripts reach the deep states their names promise), the harnesses' unit tests, a short
# mutation run per target, and that inputs which once failed (fuzz/regressions/<target>/,
# committed) pass now; those inputs also join the corpus, so libFuzzer mutates from them.
# A test that silently stopped existing (renamed, filtered away, compiled out) must fail the
# step too, so the names that matter are checked in libtest's output, not only the exit code.
log "the fuzz crate's tests (seeds, harness unit tests, past failures)"
TEST_LOG="$(mktemp)"
trap 'rm -f "$TEST_LOG"' EXIT
cargo test --release --manifest-path fuzz/Cargo.toml --no-default-features 2>&1 | tee "$TEST_LOG"
missing=()
for t in frames::tests::sample_frames_survive_the_codec_and_cover_every_kind \
    frames::tests::written_frames_read_back_identically \
    frame_decode::tests::every_sample_frame_passes_with_its_payload_and_cut_short \
    frame_decode::tests::unknown_failure_codes_are_normalised_not_reported \
    verbs_bootstrap::tests::seeds_pass \
    cursor::tests::writer_and_cursor_agree_and_reads_past_the_end_are_zero \
    handshake_seeds_reach_deep_states past_crashes_pass \
    frame_decode_seeds_and_mutations handshake_seeds_and_mutations verbs_bootstrap_seeds_and_mutations; do
    grep -q "^test $t \.\.\. ok$" "$TEST_LOG" || missing+=("$t")
done
passed="$(sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' "$TEST_LOG" | awk '{n += $1} END {print n + 0}')"
if [ "${#missing[@]}" -gt 0 ]; then
    log "FAILED: these fuzz-crate tests did not run and pass: ${missing[*]} ($passed passed in all)"
    exit 1
fi
log "fuzz crate: $passed tests passed"
for target in $TARGETS; do
    if [ -d "fuzz/regressions/$target" ]; then
        mkdir -p "fuzz/corpus/$target"
        # "dir/." rather than "dir/*": an empty regression directory must not stop the run.
        cp -R "fuzz/regressions/$target/." "fuzz/corpus/$target/"
    fi
done

if [ "$ENGINE" = stable ]; then
    log "WARNING: no libFuzzer; running the coverage-blind random driver (fuzz/tests/replay.rs)"
    WIRE_FUZZ_SECONDS="$SECONDS_PER_TARGET" WIRE_FUZZ_SEED="${WIRE_FUZZ_SEED:-$RANDOM$RANDOM}" \
        cargo test --release --manifest-path fuzz/Cargo.toml --no-default-features --test replay -- --nocapture
    exit $?
fi

case "$ENGINE" in
    libfuzzer-nightly) CARGO=(cargo +nightly fuzz) ;;
    libfuzzer-bootstrap)
        export RUSTC_BOOTSTRAP=1
        # A target dir of its own, so switching engines does not rebuild the other's.
        CARGO=(cargo +stable fuzz)
        EXTRA_BUILD=(--target-dir "$ROOT/fuzz/target/bootstrap")
        ;;
    *) log "unknown FUZZ_ENGINE '$ENGINE'"; exit 2 ;;
esac
EXTRA_BUILD=("${EXTRA_BUILD[@]+"${EXTRA_BUILD[@]}"}")

"${CARGO[@]}" build -s "$SANITIZER" "${EXTRA_BUILD[@]+"${EXTRA_BUILD[@]}"}"

failed=()
summary=()
json_rows=()
for target in $TARGETS; do
    out="$(mktemp)"
    if [ -n "$LONG_RUNS" ]; then
        # One libFuzzer job per core (-jobs/-workers), each with an even share of the
        # executions (-runs is per job) and all sharing the target's corpus directory.
        workers="$(nproc)"
        limit=(-runs="$(( (LONG_RUNS + workers - 1) / workers ))" -jobs="$workers" -workers="$workers")
        log "running $target until $LONG_RUNS executions ($workers workers)"
    else
        limit=(-max_total_time="$SECONDS_PER_TARGET")
        log "running $target for ${SECONDS_PER_TARGET} s"
    fi
    t0=$SECONDS
    set +e
    "${CARGO[@]}" run -s "$SANITIZER" "${EXTRA_BUILD[@]+"${EXTRA_BUILD[@]}"}" "$target" -- \
        "${limit[@]}" -timeout="$INPUT_TIMEOUT" -rss_limit_mb="$RSS_MB" \
        -print_final_stats=1 2>&1 | tee "$out" | grep -v -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)'
    rc=${PIPESTATUS[0]}
    set -e
    secs=$((SECONDS - t0))
    # With -jobs, each job also leaves its log (fuzz-<n>.log) in the working directory; libFuzzer
    # has printed it to the output read above when the job ended.
    [ -z "$LONG_RUNS" ] || rm -f fuzz-[0-9]*.log fuzz/fuzz-[0-9]*.log
    total_runs="$(grep -oE '^Done [0-9]+ runs' "$out" | grep -oE '[0-9]+' | awk '{ s += $1 } END { print s + 0 }')"
    runs="$(grep -oE '^Done [0-9]+ runs in [0-9]+ second' "$out" | tail -1 || true)"
    # Executions per second over the whole target (libFuzzer's own figure rounds short runs to 0).
    execs="$(awk -v r="$total_runs" -v s="$secs" 'BEGIN { printf "%d", (s > 0 ? r / s : r) }')"
    cov="$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$out" | sort -t' ' -k2 -n | tail -1 || true)"
    rm -f "$out"
    if [ "$rc" -ne 0 ]; then
        failed+=("$target")
        summary+=("$target: CRASH (exit $rc); see fuzz/artifacts/$target/")
    elif [ -n "$LONG_RUNS" ] && [ "$total_runs" -lt "$LONG_RUNS" ]; then
        failed+=("$target")
        summary+=("$target: only $total_runs of $LONG_RUNS executions ran")
    else
        summary+=("$target: ok; ${total_runs} runs in ${secs} s (${runs:-?}), ${execs:-?} execs/s, ${cov:-}")
    fi
    json_rows+=("{\"target\": \"$target\", \"ok\": $([ "$rc" -eq 0 ] && echo true || echo false), \"runs\": $total_runs, \"seconds\": $secs, \"execs_per_s\": ${execs:-0}, \"coverage\": \"${cov:-}\"}")
done

if [ -n "$LONG_RUNS" ]; then
    mkdir -p target/bench
    {
        printf '{"engine": "%s", "runs_per_target": %s, "date": "%s", "commit": "%s", "targets": [\n' \
            "$ENGINE" "$LONG_RUNS" "$(date -u +%FT%TZ)" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        (IFS=,; printf '  %s\n' "${json_rows[*]}" | sed 's/},{/},\n  {/g')
        printf ']}\n'
    } > target/bench/fuzz.json
    log "report: target/bench/fuzz.json"
fi

log "summary ($ENGINE):"
for line in "${summary[@]}"; do log "  $line"; done
if [ "${#failed[@]}" -ne 0 ]; then
    log "crashes in: ${failed[*]}"
    exit 1
fi
