//! Opening libfabric endpoints leaves the process's SIGSEGV and SIGBUS handlers as they were:
//! libfabric's shm installs its own on its first endpoint in a process, and in a JVM (which
//! takes SIGSEGV in normal running) the first such signal unlinked shm's regions while the
//! executor lived on, so peers could no longer reach it. Its own test binary: shm installs
//! them once per process, so no other test may open an shm endpoint first.
#![cfg(feature = "libfabric")]

use rdma_shuffle_provider_ofi::{Endpoint, OfiConfig};

/// The handler address installed for `sig` now.
fn handler(sig: libc::c_int) -> usize {
    // SAFETY: a null new action only reads the current one into a zeroed plain C struct.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut now), 0);
        now.sa_sigaction
    }
}

extern "C" fn ours(_: libc::c_int) {}

#[test]
fn opening_endpoints_keeps_the_processs_fault_handlers() {
    // A handler of our own, as a JVM has one, and the defaults' stand-in for SIGBUS.
    // SAFETY: installs a handler that does nothing, for signals this test never raises.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = ours as *const () as usize;
        assert_eq!(libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()), 0);
    }
    let before = (handler(libc::SIGSEGV), handler(libc::SIGBUS));
    assert_eq!(before.0, ours as *const () as usize);
    for provider in ["shm", "tcp;ofi_rxm"] {
        let mut cfg = OfiConfig::provider(provider);
        if provider.starts_with("tcp") {
            cfg.node = Some("127.0.0.1".into());
        }
        cfg.rx_depth = 4;
        cfg.max_msg = 4096;
        let eps: Vec<Endpoint> =
            (0..2).map(|_| Endpoint::open(&cfg).unwrap_or_else(|e| panic!("open {provider}: {e}"))).collect();
        assert_eq!(
            (handler(libc::SIGSEGV), handler(libc::SIGBUS)),
            before,
            "{provider}: opening endpoints replaced the process's SIGSEGV/SIGBUS handlers"
        );
        drop(eps);
    }
}
