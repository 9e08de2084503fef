//! The providers of this build, by name: the one place that lists them.
//!
//! Every protocol opens its provider here by the name its settings carry (Spark's
//! `spark.shuffle.rdma.transport`, Mobius's `MOBIUS_TRANSPORT`); each provider is a crate of
//! its own (`crates/providers/<name>`) on the seam of `rdma-shuffle-fabric`, and is listed
//! below by one line: its `registration()`. A new provider adds that line, its crate to this
//! crate's dependencies, and its name to the settings' allowed values (settings/*.tsv; a test
//! checks both lists against [`registry`]).
//!
//! * [`AUTO`] between hosts (the shuffle's `auto`): the first of `verbs`, `tcp` that opens
//!   here, saying why the ones before it could not.
//! * [`open_per_host`] (Mobius's `auto`): [`PER_HOST`]'s near provider to the peers on this
//!   host and its far provider to the others, behind fabric's split combinator.
//!
//! The sim provider is a test network inside one process and is not registered: tests build
//! it directly (`rdma_shuffle_provider_sim::SimProvider`).
#![deny(missing_docs)]

pub use rdma_shuffle_fabric::providers::registry::{Fit, FixedMemory, Opened, ProviderOptions, Registration, Registry, AUTO};
pub use rdma_shuffle_provider_shm as shm;
pub use rdma_shuffle_provider_sim as sim;
pub use rdma_shuffle_provider_tcp as tcp;
pub use rdma_shuffle_provider_verbs as verbs;

use rdma_shuffle_fabric::providers::split::SplitProvider;
use rdma_shuffle_fabric::FabricError;
use std::sync::{Arc, OnceLock};

/// The registry of this build: every provider by name, and the order `auto` tries them in.
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        Registry::new(
            vec![
                rdma_shuffle_provider_tcp::registration(),
                rdma_shuffle_provider_shm::registration(),
                rdma_shuffle_provider_verbs::registration(),
                rdma_shuffle_provider_ofi::registration(),
            ],
            // `auto`: RDMA where a device is usable here, tcp otherwise (and why).
            vec!["verbs", "tcp"],
        )
    })
}

/// Opens provider `name` (a registered name, or [`AUTO`]) of [`registry`] with `options`.
pub fn open(name: &str, options: &ProviderOptions) -> Result<Opened, FabricError> {
    registry().open(name, options)
}

/// The providers [`open_per_host`] puts together: `(near, far)`, the near one to the peers on
/// this host, the far one to the others.
pub const PER_HOST: (&str, &str) = ("shm", "tcp");

/// [`PER_HOST`]'s providers behind one, chosen per peer once the caller routed its peers
/// ([`SplitProvider::route`]).
pub fn open_per_host(options: &ProviderOptions) -> Result<Arc<SplitProvider>, FabricError> {
    let near = open(PER_HOST.0, options)?.provider;
    let far = open(PER_HOST.1, options)?.provider;
    Ok(Arc::new(SplitProvider::new(near, far)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_opens_and_auto_falls_back_to_tcp_with_the_reason_where_verbs_is_unusable() {
        let p = open("tcp", &ProviderOptions::default()).unwrap();
        assert_eq!((p.provider.name(), p.fallback.is_none()), ("tcp", true));
        // This test runs on hosts without an RDMA device (CI's, and every build without the
        // feature); the SoftRoCE VM suite opens verbs for real.
        if cfg!(feature = "verbs") && std::path::Path::new("/sys/class/infiniband").exists() {
            return;
        }
        let auto = open(AUTO, &ProviderOptions::default()).unwrap();
        assert_eq!(auto.provider.name(), "tcp");
        let (skipped, why) = auto.fallback.expect("auto on tcp says why");
        assert_eq!(skipped, "verbs");
        let err = open("verbs", &ProviderOptions::default()).unwrap_err();
        assert_eq!(err.to_string(), why.to_string(), "auto falls back for the reason verbs fails");
        let why = why.to_string();
        assert!(why.contains("verbs") || why.contains("RDMA") || why.contains("device"), "{why}");
    }

    #[test]
    fn names_are_the_registered_providers_and_an_unknown_one_is_refused_with_them() {
        let names: Vec<_> = registry().names().collect();
        assert_eq!(names, ["tcp", "shm", "verbs", "ofi"]);
        assert!(registry().knows(AUTO) && registry().knows("shm") && !registry().knows("sim"));
        let e = open("ib", &ProviderOptions::default()).unwrap_err().to_string();
        assert!(e.contains("\"ib\"") && e.contains("tcp, shm, verbs, ofi"), "{e}");
    }

    /// A build without libfabric still knows `ofi`, and opening it says how to build it in.
    #[cfg(not(feature = "ofi"))]
    #[test]
    fn ofi_without_libfabric_is_refused_saying_how_to_build_it() {
        let e = open("ofi", &ProviderOptions::default()).unwrap_err();
        assert!(matches!(e, FabricError::Unsupported(_)), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("feature `ofi`") && e.contains("scripts/ensure-libfabric.sh") && e.contains("libfabric >= 2.0"),
            "{e}"
        );
    }

    /// Built with libfabric (scripts/test.sh's libfabric step), `ofi` opens by name on the
    /// default libfabric provider, and a libfabric provider that does not exist is refused
    /// naming the setting that chooses one.
    #[cfg(feature = "ofi")]
    #[test]
    fn ofi_opens_by_name_and_an_unknown_libfabric_provider_names_the_setting() {
        let p = open("ofi", &ProviderOptions::default()).unwrap();
        assert_eq!(p.provider.name(), "ofi");
        assert!(p.description.contains("tcp;ofi_rxm"), "{}", p.description);
        let mut o = ProviderOptions::default();
        o.extra.insert("ofi.provider".into(), "no-such-provider".into());
        let e = open("ofi", &o).unwrap_err().to_string();
        assert!(e.contains("no-such-provider") && e.contains("spark.shuffle.rdma.ofi.provider"), "{e}");
    }

    #[test]
    fn per_host_is_shm_near_and_tcp_far_and_says_so_once_routed() {
        let s = open_per_host(&ProviderOptions::default()).unwrap();
        use rdma_shuffle_fabric::Provider;
        assert_eq!(s.name(), "tcp", "no peer routed near yet");
        let here: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
        s.route([here].into_iter().collect(), false);
        assert_eq!(s.name(), "shm+tcp");
        assert!(!s.capabilities().cpu_copies, "a mixture is not all shared memory");
        s.route([here].into_iter().collect(), true);
        assert_eq!((s.name(), s.capabilities().cpu_copies), ("shm", true));
    }
}
