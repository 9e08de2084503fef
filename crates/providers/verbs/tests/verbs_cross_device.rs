//! Cross-device RDMA: the server on one SoftRoCE device, the client on another, their RoCE
//! traffic crossing a veth pair (`scripts/softroce-test.sh --veth` creates rxe_a/rxe_b on
//! 192.168.77.1/.2). Proves READs and SENDs really travel between two devices, not through
//! one device's loopback.
#![cfg(feature = "ibverbs")]

use rdma_shuffle_fabric::pool::{PoolConfig, TieredPool};
use rdma_shuffle_fabric::{Driver, Provider};
use rdma_shuffle_provider_verbs::{VerbsConfig, VerbsProvider};
use rdma_shuffle_shuffle::blocks::{BlockSink, ClientEndpointConfig, FetchedBlock, ServerEndpointConfig};
use rdma_shuffle_shuffle::testkit::write_map_output;
use rdma_shuffle_shuffle::{BlockClient, BlockServer, ShuffleBlock};
use rdma_shuffle_wire::BlockFailure;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

type Outcome = (usize, Result<Vec<u8>, BlockFailure>);
struct Tx(parking_lot::Mutex<mpsc::Sender<Outcome>>);
impl BlockSink for Tx {
    fn on_block(&self, i: usize, r: Result<FetchedBlock, BlockFailure>) {
        let _ = self.0.lock().send((i, r.map(|b| b.to_vec())));
    }
}

fn counter(d: &Driver, name: &str) -> u64 {
    d.provider_counters().into_iter().find(|(k, _)| *k == name).map(|(_, v)| v).unwrap_or(0)
}

#[test]
fn blocks_cross_between_two_rdma_devices() {
    let devs = std::env::var("SOFTROCE_VETH_DEVS").expect("run via scripts/softroce-test.sh --veth (SOFTROCE_VETH_DEVS unset)");
    let ips = std::env::var("SOFTROCE_VETH_IPS").expect("SOFTROCE_VETH_IPS unset");
    let devs: Vec<&str> = devs.split_whitespace().collect();
    let ips: Vec<&str> = ips.split_whitespace().collect();
    let open = |d: &str| {
        VerbsProvider::open(VerbsConfig { device: Some(d.to_string()), max_message: 64 * 1024 + 8192, ..VerbsConfig::default() })
            .unwrap()
    };
    let server_p = open(devs[0]);
    let client_p = open(devs[1]);
    assert_ne!(server_p.device(), client_p.device());

    let dir = tempfile::tempdir().unwrap();
    let sizes = [100usize, 70_000, 3 << 20, 0, 64 * 1024];
    let out = write_map_output(dir.path(), 1, 7, &sizes, 5).unwrap();
    let server =
        BlockServer::bind(Arc::new(server_p.clone()), format!("{}:0", ips[0]).parse().unwrap(), ServerEndpointConfig::default())
            .unwrap();
    server.register(out.map_output_files()).unwrap();

    let cp: Arc<dyn Provider> = Arc::new(client_p.clone());
    let pool = TieredPool::new(PoolConfig { cap_bytes: 64 << 20, ..PoolConfig::default() }, cp.registrar()).unwrap();
    let client = BlockClient::new(cp, pool, ClientEndpointConfig::default()).unwrap();
    let blocks: Vec<_> = (0..sizes.len() as u32).map(|r| ShuffleBlock::single(1, 7, r)).collect();
    let (tx, rx) = mpsc::channel();
    client.fetch(server.local_addr(), &blocks, Arc::new(Tx(parking_lot::Mutex::new(tx))));
    for _ in 0..blocks.len() {
        let (i, r) = rx.recv_timeout(Duration::from_secs(120)).expect("block within 2 minutes");
        let got = r.unwrap_or_else(|e| panic!("block {i}: {e}"));
        assert!(got == out.range_bytes(i as u32, i as u32 + 1), "block {i} differs");
    }
    // The large blocks came by RDMA READ on the client's device; the small ones by SEND from
    // the server's device.
    let (cd, sd) = (client.driver(), server.driver());
    assert!(counter(cd, "rdma_reads") >= 2, "client counters: {:?}", cd.provider_counters());
    assert!(counter(sd, "verbs_sends") >= 3, "server counters: {:?}", sd.provider_counters());
    client.shutdown();
    server.shutdown();
}

/// With a usable device, `transport=auto` picks verbs and says so.
#[test]
fn auto_transport_picks_verbs_where_a_device_exists() {
    let cfg = rdma_shuffle_shuffle::EngineConfig {
        pool_cap: Some(32 << 20),
        bind_host: "127.0.0.1".parse().unwrap(),
        recv_buffers: 64,
        ..Default::default()
    };
    let engine = rdma_shuffle_shuffle::Engine::open(cfg).unwrap();
    assert_eq!(engine.transport(), "verbs", "{}", engine.transport_reason());
    assert!(engine.transport_reason().contains("RDMA device"), "{}", engine.transport_reason());
    engine.shutdown();
}

/// Drops CAP_IPC_LOCK from the calling thread only (capabilities are per thread), so the
/// memlock limit applies to its registrations as it does to a non-root executor.
fn drop_ipc_lock_for_this_thread() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header { version: 0x2008_0522, pid: 0 };
    let mut d = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data words, as the ABI requires.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()), 0);
        d[0].effective &= !(1 << 14);
        d[0].permitted &= !(1 << 14);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()), 0);
    }
}

/// A memlock limit too low for the pool is a typed error that names `ulimit -l` and the
/// bytes needed: at provider open (so `auto` can fall back to tcp), and at registration.
#[test]
fn memlock_limit_too_low_is_a_typed_error() {
    std::thread::spawn(|| {
        // Opened with the capability: registrations below happen without it, under the low
        // limit.
        let p = VerbsProvider::open(VerbsConfig::default()).unwrap();
        drop_ipc_lock_for_this_thread();
        assert!(!rdma_shuffle_provider_verbs::can_lock_unlimited());
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        let low = libc::rlimit { rlim_cur: 1 << 20, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: plain rlimit calls; the old limit is restored below.
        unsafe {
            libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old);
            libc::setrlimit(libc::RLIMIT_MEMLOCK, &low);
        }
        let cfg = VerbsConfig { pool_bytes: 32 << 20, ..VerbsConfig::default() };
        let need = (32u64 << 20) + cfg.buffer_bytes();
        let e = VerbsProvider::open(cfg).expect_err("open must refuse");
        let msg = e.to_string();
        assert!(msg.contains("ulimit -l") && msg.contains(&need.to_string()) && msg.contains("1048576"), "{msg}");
        // Registration itself: the kernel refuses the 16 MiB slab with ENOMEM.
        let pool = TieredPool::new(PoolConfig { cap_bytes: 64 << 20, ..PoolConfig::default() }, p.registrar()).unwrap();
        let e = pool.acquire(16 << 20, None).expect_err("registration beyond the limit must fail");
        let msg = format!("{e}: {:?}", std::error::Error::source(&e).map(|s| s.to_string()));
        assert!(msg.contains("ulimit -l"), "{msg}");
        // SAFETY: restores the limit read above.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) };
    })
    .join()
    .unwrap();
}
