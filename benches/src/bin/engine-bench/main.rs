//! Engine benchmarks.
//!
//! * `engine-bench run --netty-cp CP [...]` — the engine against the real alternatives on
//!   loopback tcp in one run, rounds interleaved: iperf3 (the ceiling), Spark's own block
//!   transfer (spark-network-common's Netty server and client, in two JVMs) and the engine (two
//!   processes); see [`compare`]. `scripts/bench-engine.sh` builds the Spark side and runs it.
//! * `engine-bench serve --manifest FILE` — the engine's server process of `run`.
//! * `engine-bench probe [...]` — the engine alone with 4 KiB blocks: latency, blocks/s,
//!   context switches and migrations per 1,000 blocks, idle CPU; see `compare::probe`.
//! * `engine-bench verbs-sweep [...]` (built with `--features verbs`, run on an RDMA device: the
//!   SoftRoCE VM) compares eager SEND with rendezvous RDMA READ by block size; see
//!   [`verbs_sweep`].

// The report is one large `json!` literal.
#![recursion_limit = "256"]

mod compare;
mod verbs_sweep;

/// The engines' warnings and errors (a peer that closed a connection, a failed completion) go
/// to stderr, so a run whose blocks fail says why from the side that gave up; `RUST_LOG`
/// overrides the level. Reports and tables stay on stdout and in their files.
fn init_logs() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
}

fn main() {
    init_logs();
    let args: Vec<String> = std::env::args().collect();
    let rest = args.get(2..).unwrap_or(&[]);
    let result = match args.get(1).map(String::as_str) {
        Some("run") => compare::run(rest),
        Some("serve") => compare::serve(rest),
        Some("probe") => compare::probe(rest),
        Some("profile") => compare::profile(rest),
        Some("verbs-sweep") => {
            if let Err(e) = verbs_sweep::run(rest) {
                eprintln!("{e}");
                std::process::exit(if matches!(e, verbs_sweep::SweepError::Usage(_) | verbs_sweep::SweepError::NoVerbs) {
                    2
                } else {
                    1
                });
            }
            Ok(())
        }
        other => {
            eprintln!(
                "usage: {} | engine-bench serve --manifest FILE | {} (got {})",
                compare::USAGE,
                verbs_sweep::USAGE,
                other.unwrap_or("nothing")
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("engine-bench: {e}");
        std::process::exit(1);
    }
}
