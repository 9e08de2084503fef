//! The providers of the rdma-shuffle fabric, and the one place that lists them.
//!
//! Every protocol (the shuffle's engine, Mobius) opens its provider here; each provider is a
//! crate of its own (`crates/providers/<name>`) on the seam of `rdma-shuffle-fabric`.
#![deny(missing_docs)]

pub use rdma_shuffle_provider_shm as shm;
pub use rdma_shuffle_provider_sim as sim;
pub use rdma_shuffle_provider_tcp as tcp;
pub use rdma_shuffle_provider_verbs as verbs;

pub use rdma_shuffle_provider_shm::{ShmConfig, ShmProvider};
pub use rdma_shuffle_provider_sim::SimProvider;
pub use rdma_shuffle_provider_tcp::TcpProvider;

use rdma_shuffle_fabric::Provider;
use std::sync::Arc;

/// Which provider [`open_provider`] opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ProviderChoice {
    /// tcp sockets.
    #[default]
    Tcp,
    /// RDMA verbs, or an error.
    Verbs,
    /// verbs when a usable device exists, tcp otherwise (the reason is kept).
    Auto,
    /// shared memory, between processes of one host.
    Shm,
}

/// What [`open_provider`] needs: the choice, and for verbs the device settings (each `None`
/// keeps the verbs provider's default).
#[derive(Clone, Debug, Default)]
pub struct ProviderSpec {
    /// Which provider.
    pub choice: ProviderChoice,
    /// RDMA device name; `None`: the first device with an active port.
    pub device: Option<String>,
    /// GID index; `None`: the first RoCEv2 IPv4-mapped GID.
    pub gid_index: Option<u8>,
    /// Largest verbs message (frame + eager payload).
    pub max_message: Option<u32>,
    /// Buffers of each driver's shared receive queue.
    pub recv_buffers: Option<u32>,
    /// Bytes the pool may register (checked against the memlock limit).
    pub pool_bytes: u64,
}

/// A provider [`open_provider`] opened.
#[derive(Debug)]
pub struct OpenedProvider {
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// What was opened, for a log line (`tcp`, `verbs on RDMA device rxe0`).
    pub description: String,
    /// With [`ProviderChoice::Auto`] on tcp: why verbs could not be used.
    pub fallback: Option<rdma_shuffle_fabric::FabricError>,
}

/// Opens the provider `spec` asks for: the one place that lists the providers, used by every
/// protocol (the shuffle's engine, Mobius). `Verbs` in a build without the `verbs` feature,
/// or without a usable device, is an error; `Auto` then falls back to tcp and says why.
pub fn open_provider(spec: &ProviderSpec) -> Result<OpenedProvider, rdma_shuffle_fabric::FabricError> {
    let tcp = |fallback| OpenedProvider { provider: Arc::new(TcpProvider::new()), description: "tcp".into(), fallback };
    let verbs = |(provider, description)| OpenedProvider { provider, description, fallback: None };
    match spec.choice {
        ProviderChoice::Tcp => Ok(tcp(None)),
        ProviderChoice::Verbs => open_verbs(spec).map(verbs),
        ProviderChoice::Auto => Ok(open_verbs(spec).map(verbs).unwrap_or_else(|e| tcp(Some(e)))),
        ProviderChoice::Shm => {
            Ok(OpenedProvider { provider: Arc::new(ShmProvider::default()), description: "shm".into(), fallback: None })
        }
    }
}

#[cfg(feature = "verbs")]
fn open_verbs(spec: &ProviderSpec) -> Result<(Arc<dyn Provider>, String), rdma_shuffle_fabric::FabricError> {
    let d = verbs::VerbsConfig::default();
    let vc = verbs::VerbsConfig {
        device: spec.device.clone(),
        gid_index: spec.gid_index,
        max_message: spec.max_message.unwrap_or(d.max_message),
        recv_buffers: spec.recv_buffers.unwrap_or(d.recv_buffers),
        pool_bytes: spec.pool_bytes,
        ..d
    };
    let p = verbs::VerbsProvider::open(vc)?;
    let description = format!("verbs on RDMA device {}", p.device());
    Ok((Arc::new(p), description))
}

#[cfg(not(feature = "verbs"))]
fn open_verbs(_spec: &ProviderSpec) -> Result<(Arc<dyn Provider>, String), rdma_shuffle_fabric::FabricError> {
    Err(rdma_shuffle_fabric::FabricError::Unsupported(
        "this build of the native library has no verbs provider (built without the `verbs` feature: libibverbs was not available)"
            .into(),
    ))
}

#[cfg(test)]
mod open_tests {
    use super::*;

    #[test]
    fn tcp_opens_and_auto_falls_back_to_tcp_with_the_reason_where_verbs_is_unusable() {
        let p = open_provider(&ProviderSpec::default()).unwrap();
        assert_eq!((p.provider.name(), p.fallback.is_none()), ("tcp", true));
        // This test runs on hosts without an RDMA device (CI's, and every build without the
        // feature); the SoftRoCE VM suite opens verbs for real.
        if cfg!(feature = "verbs") && std::path::Path::new("/sys/class/infiniband").exists() {
            return;
        }
        let auto = open_provider(&ProviderSpec { choice: ProviderChoice::Auto, ..ProviderSpec::default() }).unwrap();
        assert_eq!(auto.provider.name(), "tcp");
        let why = auto.fallback.expect("auto on tcp says why").to_string();
        let err = open_provider(&ProviderSpec { choice: ProviderChoice::Verbs, ..ProviderSpec::default() }).unwrap_err();
        assert_eq!(err.to_string(), why, "auto falls back for the reason verbs fails");
        assert!(why.contains("verbs") || why.contains("RDMA") || why.contains("device"), "{why}");
    }
}
