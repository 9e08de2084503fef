//! The conformance suite over the shm provider: real processes' machinery (abstract Unix
//! sockets, a memfd segment per connection, eventfd doorbells) inside one test process.
mod suite;

use rdma_shuffle_fabric::providers::shm::ShmProvider;
use rdma_shuffle_fabric::Provider;
use std::sync::Arc;

fn shm() -> Arc<dyn Provider> {
    Arc::new(ShmProvider::default())
}

provider_suite!(shm);
