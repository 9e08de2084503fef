//! The engine server: `engine-bench serve`, the process that serves the engine's side.

use rdma_shuffle_shuffle::store::MapOutputFiles;
use rdma_shuffle_shuffle::{Engine, EngineConfig};
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use super::{BYTES_IN_FLIGHT, R, SMALL_IN_FLIGHT};

/// The engine's settings in the bench: tcp, or with `ofi` the libfabric provider over that
/// libfabric provider (`spark.shuffle.rdma.ofi.provider`, e.g. `tcp;ofi_rxm`).
pub(super) fn engine_config(id: &str, spin: Option<Duration>, ofi: Option<&str>) -> EngineConfig {
    let base = EngineConfig::default();
    let (transport, provider_settings) = match ofi {
        Some(p) => ("ofi", [("ofi.provider".to_string(), p.to_string())].into()),
        None => ("tcp", base.provider_settings.clone()),
    };
    EngineConfig {
        spin: spin.unwrap_or(base.spin),
        transport: transport.into(),
        provider_settings,
        bind_host: Ipv4Addr::LOCALHOST.into(),
        executor_id: id.into(),
        credits: SMALL_IN_FLIGHT,
        max_bytes_in_flight: BYTES_IN_FLIGHT as u64,
        ..base
    }
}

/// `engine-bench serve --manifest FILE [--spin-us N] [--ofi-provider P]`: an engine serving
/// the map outputs listed in FILE (lines `shuffle map partitions data index`), over tcp or
/// over the libfabric provider `ofi` on libfabric's provider P; prints `ready <port>`, serves
/// until its standard input closes.
pub fn serve(args: &[String]) -> R<()> {
    let usage = || "usage: engine-bench serve --manifest FILE [--spin-us N] [--ofi-provider P]".to_string();
    let (mut manifest, mut spin, mut ofi) = (None, None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(usage)?;
        match flag.as_str() {
            "--manifest" => manifest = Some(PathBuf::from(v)),
            "--spin-us" => spin = Some(Duration::from_micros(v.parse().map_err(|_| usage())?)),
            "--ofi-provider" => ofi = Some(v.clone()),
            _ => return Err(usage()),
        }
    }
    let manifest = manifest.ok_or_else(usage)?;
    let text = std::fs::read_to_string(&manifest).map_err(|e| format!("reading {}: {e}", manifest.display()))?;
    let engine = Engine::open(engine_config("bench-server", spin, ofi.as_deref()))
        .map_err(|e| format!("opening the server's engine: {e}"))?;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let [s, m, p, d, i] = w[..] else { return Err(format!("{}: bad line '{line}'", manifest.display())) };
        let n = |v: &str| v.parse::<u64>().map_err(|_| format!("{}: '{v}' is not a number", manifest.display()));
        let files = MapOutputFiles {
            shuffle_id: n(s)? as u32,
            map_id: n(m)?,
            data_path: d.into(),
            index_path: i.into(),
            num_partitions: Some(n(p)? as u32),
        };
        engine.server().register(files).map_err(|e| format!("registering {line}: {e}"))?;
    }
    println!("ready {}", engine.server().local_addr().port());
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut sink = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    engine.shutdown();
    Ok(())
}
