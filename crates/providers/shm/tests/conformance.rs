//! The conformance suites over the shm provider: real processes' machinery (abstract Unix
//! sockets, a memfd segment per connection, eventfd doorbells) inside one test process.

use rdma_shuffle_fabric::Provider;
use rdma_shuffle_provider_shm::ShmProvider;
use std::sync::Arc;

fn shm() -> Arc<dyn Provider> {
    Arc::new(ShmProvider::default())
}

rdma_shuffle_testkit::provider_suite!(shm);

mod mesh {
    use rdma_shuffle_provider_shm::link::FOLD_MIN;
    use rdma_shuffle_provider_shm::ShmConfig;
    use rdma_shuffle_testkit::mesh::{MeshExpect, FOLD_WORDS, RING_BODY};
    // A rendezvous body is lent and copied once, straight into a posted receive (or reduced
    // into a reducing one as it is copied); an eager message comes whole in the ring and is
    // staged. The goodbye can share a turn with the last acknowledgement: more rounds.
    const SHM: MeshExpect =
        MeshExpect { places: true, folds_eager: false, folds_rendezvous: true, lends_rendezvous: true, close_rounds: 200 };
    rdma_shuffle_testkit::mesh_suite!(super::shm, SHM);

    /// The suite's reducing messages take both of shm's folding paths: by reference (at
    /// least FOLD_MIN) and through one ring record.
    #[test]
    fn the_suites_reducing_messages_take_both_folding_paths() {
        let shm = ShmConfig::default();
        assert!(FOLD_WORDS as u64 * 4 >= FOLD_MIN);
        assert!(RING_BODY > shm.single_copy_min && RING_BODY <= shm.largest_ring_body());
    }
}
