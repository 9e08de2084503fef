//! Spark's names for the settings `wire` and `fabric` point at.
//!
//! The layers below this crate take plain values and name no `spark.*` key: their errors carry
//! a [`Knob`]. This module renders it into the key a Spark user sets, so that every message
//! reaching the JVM still says what to change.

use rdma_shuffle_fabric::FabricError;
use rdma_shuffle_wire::{BlockFailure, Knob};

/// The Spark setting (and, where it has one, the setting its default comes from) behind
/// `knob`.
pub fn spark_key(knob: Knob) -> &'static str {
    match knob {
        Knob::FetchTimeout => "spark.shuffle.rdma.fetchTimeout (default: spark.network.timeout)",
        Knob::ConnectTimeout => "spark.shuffle.rdma.connectTimeout (default: spark.shuffle.io.connectionTimeout)",
        Knob::Secret => "spark.authenticate and spark.authenticate.secret",
        Knob::AppId => "spark.app.id",
        Knob::PoolCapBytes => "spark.shuffle.rdma.pool.capBytes",
        Knob::EagerThreshold => "spark.shuffle.rdma.eagerThreshold",
        Knob::RecvBuffers => "spark.shuffle.rdma.recvBuffers",
        Knob::MaxBytesInFlight => "spark.shuffle.rdma.maxBytesInFlight",
        Knob::Credits => "spark.shuffle.rdma.credits",
        Knob::IdleTimeout => "spark.shuffle.rdma.idleTimeout (default: spark.shuffle.rdma.connectTimeout)",
        Knob::Device => "spark.shuffle.rdma.device",
        Knob::GidIndex => "spark.shuffle.rdma.gidIndex",
        Knob::BindHost => "spark.shuffle.rdma.bindHost",
        _ => "the spark.shuffle.rdma.* settings",
    }
}

/// `message` with the Spark setting behind `knob` appended.
pub fn with_setting(message: &str, knob: Option<Knob>) -> String {
    match knob {
        Some(k) => format!("{message} [setting: {}]", spark_key(k)),
        None => message.to_string(),
    }
}

/// A block failure as the JVM sees it: its message names the Spark setting.
pub fn render_failure(mut f: BlockFailure) -> BlockFailure {
    if f.knob.is_some() && !f.message.contains("[setting: ") {
        f.message = with_setting(&f.message, f.knob);
    }
    f
}

/// A fabric error as the JVM sees it.
pub fn render_error(e: &FabricError) -> String {
    with_setting(&e.to_string(), e.knob())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_shuffle_wire::FailureCode;
    use std::path::{Path, PathBuf};

    #[test]
    fn every_knob_has_a_spark_key() {
        for k in Knob::ALL {
            let key = spark_key(k);
            assert!(key.starts_with("spark."), "{k:?} -> {key}");
        }
        let f = render_failure(BlockFailure::new(FailureCode::Timeout, "no progress").with_knob(Some(Knob::FetchTimeout)));
        assert!(f.message.contains("spark.shuffle.rdma.fetchTimeout") && f.message.contains("spark.network.timeout"), "{f}");
        assert_eq!(render_failure(f.clone()).message, f.message, "rendering twice adds nothing");
    }

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// `wire` and `fabric` take plain values: not one `spark.` key in their sources.
    #[test]
    fn wire_and_fabric_name_no_spark_setting() {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for c in ["wire/src", "fabric/src"] {
            rust_files(&crates.join(c), &mut files);
        }
        assert!(files.len() > 10, "found only {} files", files.len());
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for (n, line) in text.lines().enumerate() {
                assert!(!line.contains("spark."), "{}:{}: names a Spark setting: {line}", f.display(), n + 1);
            }
        }
    }
}
