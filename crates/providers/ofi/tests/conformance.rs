//! The conformance suites over the ofi provider, on libfabric's own providers of this host:
//! `tcp;ofi_rxm` (sockets on 127.0.0.1; with one-sided reads, and again with large blocks
//! moved by messages) and `shm`. In the SoftRoCE VM, `scripts/ofi-verbs-test.sh` runs the
//! ignored `env` suite over `OFI_TEST_PROVIDER` (`verbs;ofi_rxm`).
#![cfg(feature = "libfabric")]

use rdma_shuffle_fabric::{Provider, ProviderOptions};
use rdma_shuffle_provider_ofi::{OfiProvider, Settings};
use std::sync::{Arc, OnceLock};

/// One provider per process and libfabric provider (one domain; each driver opens its own
/// endpoint in it), as a Spark executor or a Mobius rank has.
fn open(provider: &str, rma: bool) -> OfiProvider {
    // RUST_LOG=rdma_shuffle_provider_ofi=debug shows what the engines do.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let mut o = ProviderOptions { eager_message: Some(rdma_shuffle_testkit::shuffle::EAGER + 4096), ..Default::default() };
    o.extra.insert("ofi.provider".into(), provider.into());
    o.extra.insert("ofi.rma".into(), rma.to_string());
    o.device = std::env::var("OFI_TEST_DOMAIN").ok();
    let s = Settings::from_options(&o).unwrap();
    OfiProvider::open(&s).unwrap_or_else(|e| panic!("open libfabric provider {provider}: {e}"))
}

macro_rules! shared {
    ($name:ident, $provider:expr, $rma:expr) => {
        fn $name() -> Arc<dyn Provider> {
            static P: OnceLock<Arc<OfiProvider>> = OnceLock::new();
            P.get_or_init(|| Arc::new(open($provider, $rma))).clone()
        }
    };
}

shared!(tcp, "tcp;ofi_rxm", true);
shared!(tcp_messages, "tcp;ofi_rxm", false);
shared!(shm, "shm", true);

/// What the suites expect of ofi's links: whole messages, staged (a rendezvous is read into
/// a pool buffer, or comes as messages), nothing reduced in place.
const OFI: rdma_shuffle_testkit::mesh::MeshExpect = rdma_shuffle_testkit::mesh::MeshExpect {
    places: false,
    folds_eager: false,
    folds_rendezvous: false,
    lends_rendezvous: false,
    close_rounds: 10,
};

mod tcp_rxm {
    rdma_shuffle_testkit::provider_suite!(super::tcp);
    rdma_shuffle_testkit::mesh_suite!(super::tcp, super::OFI);

    #[test]
    fn rendezvous_blocks_are_read_one_sidedly() {
        super::reads_are_counted(super::tcp, true);
    }
}

mod tcp_rxm_messages {
    rdma_shuffle_testkit::provider_suite!(super::tcp_messages);

    #[test]
    fn rendezvous_blocks_come_as_messages() {
        super::reads_are_counted(super::tcp_messages, false);
    }
}

mod shm {
    rdma_shuffle_testkit::provider_suite!(super::shm);
    rdma_shuffle_testkit::mesh_suite!(super::shm, super::OFI);

    #[test]
    fn rendezvous_blocks_are_read_one_sidedly() {
        super::reads_are_counted(super::shm, true);
    }
}

/// The suite over the libfabric provider the environment names (`OFI_TEST_PROVIDER`), for
/// the SoftRoCE VM's `verbs;ofi_rxm`; ignored on the host, which has no RDMA device.
mod env {
    use super::*;
    fn env() -> Arc<dyn Provider> {
        static P: OnceLock<Arc<OfiProvider>> = OnceLock::new();
        P.get_or_init(|| {
            let name = std::env::var("OFI_TEST_PROVIDER").expect("OFI_TEST_PROVIDER names the libfabric provider");
            Arc::new(open(&name, true))
        })
        .clone()
    }

    macro_rules! ignored_suite {
        ($($name:ident),*) => {
            $(
                #[test]
                #[ignore = "needs OFI_TEST_PROVIDER (scripts/ofi-verbs-test.sh runs it in the SoftRoCE VM)"]
                fn $name() {
                    rdma_shuffle_testkit::shuffle::$name(env)
                }
            )*
        };
    }
    ignored_suite!(
        eager_and_rendezvous_bytes_equal_file_slices,
        handshake_with_matching_secret_serves,
        wrong_secret_is_refused_and_server_keeps_serving,
        credits_run_out_and_refill,
        unknown_blocks_get_typed_errors,
        corrupt_indexes_get_typed_errors,
        bad_input_gets_typed_errors_and_server_keeps_serving,
        client_vanishing_mid_stream_leaves_server_serving,
        server_vanishing_mid_stream_fails_blocks_in_bounded_time,
        silent_server_times_out,
        unreachable_server_fails_fast,
        reads_need_authentication_die_with_release_and_stay_with_their_peer,
        another_application_or_secret_is_refused_and_nothing_is_served,
        local_backpressure_is_not_peer_silence,
        idle_connections_close_and_reopen,
        truncated_or_deleted_data_files_fail_typed,
        blocks_over_the_pool_cap_stream_in_bounded_buffers,
        a_range_past_the_end_of_a_block_is_refused
    );

    #[test]
    #[ignore = "needs OFI_TEST_PROVIDER (scripts/ofi-verbs-test.sh runs it in the SoftRoCE VM)"]
    fn rendezvous_blocks_are_read_one_sidedly() {
        super::reads_are_counted(env, true);
    }
}

/// Fetches every block of a map output and checks, against the engine's own counters, how
/// its rendezvous blocks moved: by one-sided reads (`fi_read`, counted by both the client's
/// provider counters and the server's exposures), or as messages with no read at all.
fn reads_are_counted(f: rdma_shuffle_testkit::shuffle::Factory, one_sided: bool) {
    use rdma_shuffle_testkit::shuffle::{client, fetch_all, server_cfg, server_with};
    let fx = server_with(f, server_cfg(Some("k")), 1);
    let c = client(f, Some("k"), 64 << 20);
    let o = &fx.outputs[0];
    let n = o.num_partitions();
    let blocks: Vec<_> = (0..n).map(|r| rdma_shuffle_shuffle::ShuffleBlock::single(3, o.map_id, r)).collect();
    let got = fetch_all(&c, fx.server.local_addr(), &blocks);
    for r in 0..n {
        assert_eq!(got[&(r as usize)].as_ref().unwrap(), &o.range_bytes(r, r + 1), "block {r}");
    }
    let counter = |d: &rdma_shuffle_fabric::Driver, name: &str| {
        d.provider_counters().into_iter().find(|(k, _)| *k == name).map(|(_, v)| v).unwrap_or_else(|| panic!("no counter {name}"))
    };
    let large: Vec<u64> = (0..n)
        .map(|r| o.range_bytes(r, r + 1).len() as u64)
        .filter(|l| *l > rdma_shuffle_testkit::shuffle::EAGER as u64)
        .collect();
    assert!(!large.is_empty());
    let (reads, read_bytes) = (counter(c.driver(), "ofi_reads"), counter(c.driver(), "ofi_read_bytes"));
    eprintln!("{}: {reads} reads of {read_bytes} bytes for {} rendezvous blocks", fx.provider.name(), large.len());
    if one_sided {
        assert_eq!(reads, large.len() as u64, "one fi_read per rendezvous block");
        assert_eq!(read_bytes, large.iter().sum::<u64>());
        rdma_shuffle_testkit::shuffle::wait_for(
            || {
                counter(fx.server.driver(), "ofi_exposures") == large.len() as u64
                    && counter(fx.server.driver(), "ofi_revocations") == large.len() as u64
            },
            "the server exposed each rendezvous block once and revoked it at its release",
        );
    } else {
        assert_eq!((reads, counter(fx.server.driver(), "ofi_exposures")), (0, 0), "no region exposed, none read");
        assert!(counter(c.driver(), "ofi_recvs") as usize > large.len(), "the blocks came as messages");
    }
    assert!(counter(c.driver(), "ofi_sends") > 0 && counter(fx.server.driver(), "ofi_recvs") > 0);
}
