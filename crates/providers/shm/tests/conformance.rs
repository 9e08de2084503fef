//! The conformance suite over the shm provider: real processes' machinery (abstract Unix
//! sockets, a memfd segment per connection, eventfd doorbells) inside one test process.

use rdma_shuffle_fabric::Provider;
use rdma_shuffle_provider_shm::ShmProvider;
use std::sync::Arc;

fn shm() -> Arc<dyn Provider> {
    Arc::new(ShmProvider::default())
}

rdma_shuffle_testkit::provider_suite!(shm);
