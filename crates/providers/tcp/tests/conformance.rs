//! The conformance suites over the tcp provider on real loopback sockets.

use rdma_shuffle_fabric::Provider;
use rdma_shuffle_provider_tcp::TcpProvider;
use rdma_shuffle_testkit::shuffle as suite;
use std::sync::Arc;

fn tcp() -> Arc<dyn Provider> {
    Arc::new(TcpProvider::new())
}

rdma_shuffle_testkit::provider_suite!(tcp);

mod mesh {
    use rdma_shuffle_testkit::mesh::MeshExpect;
    // A stream reads a payload straight into a posted receive, and reduces it out of its
    // read buffer as it arrives, eager or rendezvous.
    const TCP: MeshExpect =
        MeshExpect { places: true, folds_eager: true, folds_rendezvous: true, lends_rendezvous: false, close_rounds: 10 };
    rdma_shuffle_testkit::mesh_suite!(super::tcp, TCP);
}

// Needs real sockets (the sim provider has none).
#[test]
fn silent_connections_do_not_delay_other_clients() {
    suite::silent_connections_do_not_delay_other_clients(tcp)
}

// Needs real sockets (the sim provider has none).
#[test]
fn a_thousand_silent_connections_leave_an_honest_client_served() {
    suite::a_thousand_silent_connections_leave_an_honest_client_served(tcp)
}

// A sparse data file of 4 GiB and more (needs a real file system, which every provider reads
// from; kept off the verbs suite, whose VM has a small disk and memlock limit).
#[test]
fn blocks_stored_past_4_gib_are_served_exactly() {
    suite::blocks_stored_past_4_gib_are_served_exactly(tcp)
}

// A stream takes a pulled block's buffer when its bytes arrive (one-sided reads need theirs
// before the read is posted, message transports when the message comes).
#[test]
fn a_stream_pull_takes_its_buffer_when_its_bytes_arrive() {
    suite::a_stream_pull_takes_its_buffer_when_its_bytes_arrive(tcp)
}

#[test]
fn a_stream_pull_that_finds_the_pool_full_waits_for_a_buffer() {
    suite::a_stream_pull_that_finds_the_pool_full_waits_for_a_buffer(tcp)
}
