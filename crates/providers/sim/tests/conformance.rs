//! The conformance suites over the in-memory sim provider, with one-sided reads (verbs-shaped)
//! and without (tcp-shaped).

use rdma_shuffle_fabric::Provider;
use rdma_shuffle_provider_sim::SimProvider;
use rdma_shuffle_testkit::shuffle as suite;
use std::sync::{Arc, OnceLock};

fn one_sided() -> Arc<dyn Provider> {
    static NET: OnceLock<SimProvider> = OnceLock::new();
    Arc::new(NET.get_or_init(|| SimProvider::new(true)).clone())
}

mod one_sided {
    use super::*;
    rdma_shuffle_testkit::provider_suite!(one_sided);
    // Whole messages: nothing is placed or reduced in place (staged, and the caller reduces).
    rdma_shuffle_testkit::mesh_suite!(
        one_sided,
        rdma_shuffle_testkit::mesh::MeshExpect { close_rounds: 10, ..Default::default() }
    );

    // A sparse file past 4 GiB: the one-sided (verbs-shaped) path reads it too.
    #[test]
    fn blocks_stored_past_4_gib_are_served_exactly() {
        suite::blocks_stored_past_4_gib_are_served_exactly(one_sided)
    }
}

fn streamed() -> Arc<dyn Provider> {
    static NET: OnceLock<SimProvider> = OnceLock::new();
    Arc::new(NET.get_or_init(|| SimProvider::new(false)).clone())
}

mod streamed {
    use super::*;
    rdma_shuffle_testkit::provider_suite!(streamed);
    rdma_shuffle_testkit::mesh_suite!(
        streamed,
        rdma_shuffle_testkit::mesh::MeshExpect { close_rounds: 10, ..Default::default() }
    );
}
