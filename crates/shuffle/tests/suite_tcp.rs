//! The conformance suite over the tcp provider on real loopback sockets.
mod suite;

use rdma_shuffle_fabric::{Provider, TcpProvider};
use std::sync::Arc;

fn tcp() -> Arc<dyn Provider> {
    Arc::new(TcpProvider::new())
}

provider_suite!(tcp);
