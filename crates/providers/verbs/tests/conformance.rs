//! The conformance suite over the verbs provider: real kernel RDMA. Runs inside the SoftRoCE
//! VM (`scripts/softroce-test.sh`); on a host without an RDMA device every test fails with a
//! message naming that script rather than passing or skipping silently: CI treats a skipped
//! suite as a failure, and the tcp and sim suites are the ones that cover a host without RDMA.
#![cfg(feature = "ibverbs")]

use rdma_shuffle_fabric::Provider;
use rdma_shuffle_provider_verbs::{VerbsConfig, VerbsProvider};
use rdma_shuffle_testkit::shuffle as suite;
use std::sync::{Arc, OnceLock};

/// One provider per process (device context, protection domain, progress thread), shared by
/// servers and clients: QPs on one device talk to each other through the device's loopback.
fn verbs() -> Arc<dyn Provider> {
    static P: OnceLock<VerbsProvider> = OnceLock::new();
    let p = P.get_or_init(|| {
        let cfg = VerbsConfig {
            device: std::env::var("RDMA_SHUFFLE_VERBS_DEVICE").ok(),
            max_message: suite::EAGER + 8192,
            ..VerbsConfig::default()
        };
        VerbsProvider::open(cfg)
            .unwrap_or_else(|e| panic!("verbs suite needs an RDMA device (run it via scripts/softroce-test.sh): {e}"))
    });
    Arc::new(p.clone())
}

rdma_shuffle_testkit::provider_suite!(verbs);

// Needs real sockets (the sim provider has none).
#[test]
fn silent_connections_do_not_delay_other_clients() {
    suite::silent_connections_do_not_delay_other_clients(verbs)
}

// Needs real sockets (the sim provider has none).
#[test]
fn a_thousand_silent_connections_leave_an_honest_client_served() {
    suite::a_thousand_silent_connections_leave_an_honest_client_served(verbs)
}
