//! Tests of the tiered pool.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

fn cfg(tiers: &[usize], slab_bytes: usize, cap_bytes: usize) -> PoolConfig {
    PoolConfig { tiers: tiers.to_vec(), slab_bytes, cap_bytes: cap_bytes as u64, prealloc: false }
}

/// Registrar that records every region, checks alignment and overlap, and can be told to
/// fail like `ibv_reg_mr` does when the memlock limit is hit.
#[derive(Default)]
struct CountingRegistrar {
    live: Mutex<HashMap<u64, (usize, usize)>>,
    next: AtomicU64,
    registers: AtomicUsize,
    deregisters: AtomicUsize,
    /// Deregistrations of unknown handles, misaligned or overlapping registrations.
    violations: AtomicUsize,
    fail: AtomicBool,
}

impl CountingRegistrar {
    fn live(&self) -> usize {
        self.live.lock().len()
    }
    fn region(&self, handle: u64) -> Option<(usize, usize)> {
        self.live.lock().get(&handle).copied()
    }
}

impl Registrar for CountingRegistrar {
    fn register(&self, addr: *mut u8, len: usize) -> Result<RegionKeys, PoolError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(PoolError::Registration {
                bytes: len,
                source: "Cannot allocate memory (simulated memlock limit)".into(),
            });
        }
        let addr = addr as usize;
        let mut live = self.live.lock();
        let overlaps = live.values().any(|&(a, l)| addr < a + l && a < addr + len);
        if overlaps || (addr | len) & (SLAB_ALIGN - 1) != 0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        let handle = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        live.insert(handle, (addr, len));
        self.registers.fetch_add(1, Ordering::SeqCst);
        Ok(RegionKeys { lkey: handle as u32, rkey: handle as u32 + 1000, handle })
    }

    fn deregister(&self, keys: &RegionKeys) {
        if self.live.lock().remove(&keys.handle).is_none() {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        self.deregisters.fetch_add(1, Ordering::SeqCst);
    }
}

fn counted(config: PoolConfig) -> (TieredPool, Arc<CountingRegistrar>) {
    let reg = Arc::new(CountingRegistrar::default());
    let pool = TieredPool::new(config, reg.clone()).expect("valid config");
    (pool, reg)
}

/// The lease lies inside the region registered under its keys.
fn assert_inside_its_region(lease: &Lease, reg: &CountingRegistrar) {
    let (addr, len) = reg.region(lease.keys().handle).expect("lease keys name a live region");
    let p = lease.as_ptr() as usize;
    assert!(p >= addr && p + lease.capacity() <= addr + len, "{lease:?} outside {addr:#x}+{len}");
    assert_eq!(lease.keys().lkey as u64, lease.keys().handle);
    assert_eq!(lease.keys().rkey as u64, lease.keys().handle + 1000);
}

/// Polls `cond` for up to 10 s (tests must not hang if the pool misbehaves).
/// Threads parked in `acquire` on the pool's condition variable right now.
fn parked(pool: &TieredPool) -> usize {
    pool.shared.state.lock().waiters
}

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn default_config_is_valid() {
    let c = PoolConfig::default();
    assert_eq!(c.tiers, DEFAULT_TIERS.to_vec());
    assert_eq!(c.cap_bytes, 256 * MIB as u64);
    c.validate().unwrap();
}

#[test]
fn config_validation_names_the_problem() {
    let cases: Vec<(PoolConfig, &str)> = vec![
        (cfg(&[], MIB, MIB), "empty"),
        (cfg(&[0, 4 * KIB], MIB, MIB), "zero"),
        (cfg(&[64 * KIB, 4 * KIB], MIB, MIB), "strictly increasing"),
        (cfg(&[4 * KIB, 4 * KIB], MIB, MIB), "strictly increasing"),
        (cfg(&[4 * KIB], 0, MIB), "slab_bytes"),
        (cfg(&[4 * KIB, MIB], MIB, 512 * KIB), "memory pool cap"),
        (PoolConfig { prealloc: true, ..cfg(&[4 * KIB, 64 * KIB], MIB, MIB) }, "prealloc"),
    ];
    for (config, needle) in cases {
        match config.validate() {
            Err(PoolError::Config(msg)) => {
                assert!(msg.contains(needle), "{config:?}: message {msg:?} lacks {needle:?}")
            }
            other => panic!("{config:?} should be rejected, got {other:?}"),
        }
        assert!(matches!(TieredPool::unregistered(config), Err(PoolError::Config(_))));
    }
    // Exactly at the limits is fine.
    cfg(&[4 * KIB, MIB], MIB, MIB).validate().unwrap();
    PoolConfig { prealloc: true, ..cfg(&[4 * KIB, 64 * KIB], 64 * KIB, 128 * KIB) }.validate().unwrap();
}

#[test]
fn default_tiers_bound_the_waste_of_rounding_up() {
    // Any request from 1 byte to the largest tier gets a buffer at most 4x its size, and
    // at most 2x from 1 MiB up (where the bytes matter).
    let pool = TieredPool::unregistered(PoolConfig::default()).unwrap();
    let mut len = 4 * KIB + 1;
    while len <= 16 * MIB {
        let cap = pool.tier_capacity_for(len).unwrap();
        let bound = if len > MIB { 2 } else { 4 };
        assert!(cap >= len && cap < bound * len, "len {len} gets {cap}");
        len = len * 5 / 4 + 1;
    }
    // A 1.4 MB block (13 M records over 32 x 32 partitions) takes 2 MiB, not 16 MiB.
    assert_eq!(pool.tier_capacity_for(1_400_000), Some(2 * MIB));
}

#[test]
fn tier_selection_is_exact() {
    let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB, MIB, 16 * MIB], 4 * MIB, 256 * MIB)).unwrap();
    let cases = [
        (0, 4 * KIB),
        (1, 4 * KIB),
        (4 * KIB, 4 * KIB),
        (4 * KIB + 1, 64 * KIB),
        (64 * KIB, 64 * KIB),
        (64 * KIB + 1, MIB),
        (MIB, MIB),
        (MIB + 1, 16 * MIB),
        (16 * MIB, 16 * MIB),
    ];
    for (len, capacity) in cases {
        assert_eq!(pool.tier_capacity_for(len), Some(capacity), "len {len}");
        let lease = pool.acquire(len, None).unwrap();
        assert_eq!((lease.len(), lease.capacity()), (len, capacity), "len {len}");
        assert!(!lease.is_oversize());
        assert_eq!(lease.as_slice().len(), len);
    }
    assert_eq!(pool.tier_capacity_for(16 * MIB + 1), None);
    let big = pool.acquire(16 * MIB + 1, None).unwrap();
    assert!(big.is_oversize());
    assert_eq!(big.capacity(), round_up(16 * MIB + 1, page_size()).unwrap());
}

#[test]
fn grows_by_slabs_then_reuses_buffers() {
    // 4 buffers per slab.
    let pool = TieredPool::unregistered(cfg(&[4 * KIB], 16 * KIB, MIB)).unwrap();
    let first = pool.acquire(100, None).unwrap();
    let addr = first.as_ptr();
    assert_eq!(addr as usize % SLAB_ALIGN, 0, "slabs are page-aligned");
    let s = pool.stats();
    assert_eq!((s.grows, s.hits, s.acquires, s.bytes_allocated), (1, 0, 1, 16 * KIB as u64));
    drop(first);
    let again = pool.acquire(4 * KIB, None).unwrap();
    assert_eq!(again.as_ptr(), addr, "the returned buffer is reused");
    let s = pool.stats();
    assert_eq!((s.grows, s.hits, s.acquires), (1, 1, 2));

    let mut leases = vec![again];
    for _ in 0..3 {
        leases.push(pool.acquire(4 * KIB, None).unwrap());
    }
    assert_eq!(pool.stats().grows, 1, "one slab holds four buffers");
    let mut addrs: Vec<usize> = leases.iter().map(|l| l.as_ptr() as usize).collect();
    addrs.sort_unstable();
    assert!(addrs.windows(2).all(|w| w[1] - w[0] == 4 * KIB), "buffers tile the slab");
    leases.push(pool.acquire(1, None).unwrap());
    let s = pool.stats();
    assert_eq!((s.grows, s.bytes_allocated, s.bytes_in_use), (2, 32 * KIB as u64, 20 * KIB as u64));
    drop(leases);
    let s = pool.stats();
    assert_eq!((s.bytes_in_use, s.peak_bytes_in_use, s.bytes_allocated), (0, 20 * KIB as u64, 32 * KIB as u64));
    // A new peak reached through free-list hits alone is recorded too.
    let hits_before = s.hits;
    let six: Vec<Lease> = (0..6).map(|_| pool.acquire(1, None).unwrap()).collect();
    let s = pool.stats();
    assert_eq!((s.hits - hits_before, s.grows, s.peak_bytes_in_use), (6, 2, 24 * KIB as u64));
    drop(six);
}

#[test]
fn falls_back_to_a_free_larger_buffer_at_the_cap() {
    let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, 128 * KIB)).unwrap();
    drop((pool.acquire(64 * KIB, None).unwrap(), pool.acquire(64 * KIB, None).unwrap()));
    assert_eq!(pool.stats().bytes_allocated, 128 * KIB as u64);
    let small = pool.acquire(10, None).unwrap();
    assert_eq!((small.len(), small.capacity()), (10, 64 * KIB));
    let s = pool.stats();
    assert_eq!((s.grows, s.hits, s.reclaims), (2, 1, 0));
}

#[test]
fn cap_holds_and_a_waiter_wakes_when_a_lease_returns() {
    let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, 128 * KIB)).unwrap();
    let a = pool.acquire(64 * KIB, None).unwrap();
    let b = pool.acquire(64 * KIB, None).unwrap();
    assert!(pool.try_acquire(64 * KIB).unwrap().is_none());
    assert!(pool.try_acquire(1).unwrap().is_none(), "no room, no free buffer, no idle slab");
    assert_eq!(pool.stats().waits, 0, "try_acquire never waits");

    let waiter = {
        let pool = pool.clone();
        // A deadline so a lost wake-up fails the test instead of hanging it.
        thread::spawn(move || pool.acquire(60 * KIB, Some(Instant::now() + Duration::from_secs(20))))
    };
    eventually("the waiter blocks", || pool.stats().waits == 1);
    // Parked on the condition variable (counted under the lock it releases there): from here
    // it can only leave when woken, so it has not grown past the cap, however slow the machine.
    eventually("the waiter is parked", || parked(&pool) == 1);
    assert!(!waiter.is_finished(), "must wait, not grow past the cap");
    assert_eq!(pool.stats().bytes_allocated, 128 * KIB as u64);
    let b_addr = b.as_ptr();
    let returned = Instant::now();
    drop(b);
    let got = waiter.join().unwrap().unwrap();
    // Well before its 20 s deadline: woken by the return, not by the deadline's retry.
    assert!(returned.elapsed() < Duration::from_secs(5), "{:?}", returned.elapsed());
    assert_eq!(got.as_ptr(), b_addr);
    let s = pool.stats();
    assert_eq!((s.grows, s.bytes_allocated, s.bytes_in_use), (2, 128 * KIB as u64, 128 * KIB as u64));
    assert!(s.peak_bytes_in_use <= 128 * KIB as u64);
    drop((a, got));
}

#[test]
fn deadline_gives_a_timeout_error_with_the_numbers() {
    let pool = TieredPool::unregistered(cfg(&[4 * KIB], 4 * KIB, 8 * KIB)).unwrap();
    let held = (pool.acquire(1, None).unwrap(), pool.acquire(1, None).unwrap());
    let start = Instant::now();
    let err = pool.acquire(100, Some(start + Duration::from_millis(50))).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(50));
    match &err {
        PoolError::Timeout { requested, cap, in_use } => {
            assert_eq!((*requested, *cap, *in_use), (100, 8 * KIB as u64, 8 * KIB as u64))
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(err.to_string().contains("memory pool cap") && err.knob() == Some(CAP_KNOB), "{err}");
    // A deadline already past still fails cleanly.
    assert!(matches!(pool.acquire(1, Some(Instant::now())), Err(PoolError::Timeout { .. })));
    let s = pool.stats();
    assert_eq!((s.timeouts, s.waits, s.bytes_allocated), (2, 2, 8 * KIB as u64));

    // A lease coming back before the deadline satisfies the waiter.
    let releaser = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        drop(held);
    });
    let start = Instant::now();
    let got = pool.acquire(100, Some(start + Duration::from_secs(20))).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "woken by the return: {:?}", start.elapsed());
    assert_eq!(got.capacity(), 4 * KIB);
    releaser.join().unwrap();
    assert_eq!(pool.stats().timeouts, 2);
}

#[test]
fn oversize_requests_get_a_registered_one_off_buffer() {
    let (pool, reg) = counted(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB));
    let mut big = pool.acquire(100_000, None).unwrap();
    let mapped = round_up(100_000, page_size()).unwrap();
    assert!(big.is_oversize());
    assert_eq!((big.len(), big.capacity()), (100_000, mapped));
    assert_inside_its_region(&big, &reg);
    assert_eq!(reg.region(big.keys().handle), Some((big.as_ptr() as usize, mapped)));
    big.fill(0xab);
    assert!(big.iter().all(|&b| b == 0xab));
    let s = pool.stats();
    assert_eq!((s.oversize, s.grows, s.bytes_allocated, s.bytes_in_use), (1, 0, mapped as u64, mapped as u64));
    drop(big);
    let s = pool.stats();
    assert_eq!((s.bytes_allocated, s.bytes_in_use, s.peak_bytes_in_use), (0, 0, mapped as u64));
    assert_eq!((reg.live(), reg.registers.load(Ordering::SeqCst), reg.deregisters.load(Ordering::SeqCst)), (0, 1, 1));
}

#[test]
fn requests_above_the_cap_fail_at_once() {
    let pool = TieredPool::unregistered(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB)).unwrap();
    let _hold = pool.acquire(64 * KIB, None).unwrap();
    for len in [MIB + 1, usize::MAX] {
        // No deadline: it must not wait.
        match pool.acquire(len, None) {
            Err(PoolError::ExceedsCap { requested, cap }) => {
                assert_eq!((requested, cap), (len, MIB as u64))
            }
            other => panic!("expected ExceedsCap, got {other:?}"),
        }
        let err = pool.try_acquire(len).unwrap_err();
        assert!(err.to_string().contains("memory pool cap") && err.knob() == Some(CAP_KNOB), "{err}");
    }
    // Exactly the cap is servable once the memory is free.
    assert!(pool.try_acquire(MIB).unwrap().is_none(), "64 KiB are held");
    drop(_hold);
    let whole = pool.acquire(MIB, None).unwrap();
    assert_eq!(whole.capacity(), MIB);
    let s = pool.stats();
    assert_eq!((s.reclaims, s.bytes_allocated, s.waits), (1, MIB as u64, 0));
}

#[test]
fn idle_slabs_of_other_tiers_are_reclaimed_to_make_room() {
    let (pool, reg) = counted(cfg(&[4 * KIB, 512 * KIB], 512 * KIB, MIB));
    // 128 small buffers per slab: 129 leases fill two slabs and the whole cap.
    let mut small: Vec<Lease> = (0..129).map(|_| pool.acquire(4 * KIB, None).unwrap()).collect();
    assert_eq!((pool.stats().grows, pool.stats().bytes_allocated), (2, MIB as u64));
    for (i, l) in small.iter_mut().enumerate() {
        l.fill(i as u8);
    }
    assert!(pool.try_acquire(512 * KIB).unwrap().is_none(), "both slabs are busy");

    let last = small.pop().unwrap();
    let idle_handle = last.keys().handle;
    drop(last);
    let large = pool.try_acquire(512 * KIB).unwrap().expect("idle slab reclaimed");
    assert_eq!(large.capacity(), 512 * KIB);
    let s = pool.stats();
    assert_eq!((s.reclaims, s.grows, s.bytes_allocated), (1, 3, MIB as u64));
    assert_eq!(reg.region(idle_handle), None, "the reclaimed slab was deregistered");
    assert_eq!(reg.deregisters.load(Ordering::SeqCst), 1);
    assert_inside_its_region(&large, &reg);
    for (i, l) in small.iter().enumerate() {
        assert!(l.iter().all(|&b| b == i as u8), "busy slab untouched");
        assert_inside_its_region(l, &reg);
    }

    // An oversize request reclaims as many idle slabs as it needs, largest first.
    drop((small, large));
    let huge = pool.acquire(600 * KIB, None).unwrap();
    assert!(huge.is_oversize());
    let s = pool.stats();
    assert_eq!((s.reclaims, s.bytes_allocated), (3, round_up(600 * KIB, page_size()).unwrap() as u64));
    assert_eq!(reg.live(), 1);
    assert_eq!(reg.violations.load(Ordering::SeqCst), 0);
}

#[test]
fn reclaim_waits_for_a_slab_to_become_idle() {
    let pool = TieredPool::unregistered(cfg(&[4 * KIB, 512 * KIB], 512 * KIB, MIB)).unwrap();
    let a = pool.acquire(1, None).unwrap();
    let mut rest: Vec<Lease> = (0..128).map(|_| pool.acquire(1, None).unwrap()).collect();
    let waiter = {
        let pool = pool.clone();
        thread::spawn(move || pool.acquire(512 * KIB, Some(Instant::now() + Duration::from_secs(20))))
    };
    eventually("the large request waits", || pool.stats().waits == 1);
    // The 129th lease sits alone in the second slab; returning it makes that slab idle.
    drop(rest.pop());
    let large = waiter.join().unwrap().unwrap();
    assert_eq!(large.capacity(), 512 * KIB);
    assert_eq!(pool.stats().reclaims, 1);
    drop((a, rest, large));
}

#[test]
fn failed_registration_is_a_typed_error_and_leaks_nothing() {
    let (pool, reg) = counted(cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB));
    reg.fail.store(true, Ordering::SeqCst);
    for len in [100, 200 * KIB] {
        match pool.acquire(len, None) {
            Err(PoolError::Registration { bytes, source }) => {
                assert_eq!(bytes, round_up(len.max(64 * KIB), page_size()).unwrap());
                assert!(source.to_string().contains("memlock"));
            }
            other => panic!("expected Registration error, got {other:?}"),
        }
    }
    let s = pool.stats();
    assert_eq!((s.bytes_allocated, s.bytes_in_use, s.grows, s.acquires), (0, 0, 0, 0));
    assert_eq!((reg.live(), reg.deregisters.load(Ordering::SeqCst)), (0, 0));

    reg.fail.store(false, Ordering::SeqCst);
    let ok = pool.acquire(100, None).unwrap();
    assert_inside_its_region(&ok, &reg);
    assert_eq!(pool.stats().bytes_allocated, 64 * KIB as u64, "the failed reservations were returned");

    // Preallocation surfaces the failure from the constructor.
    let failing = Arc::new(CountingRegistrar::default());
    failing.fail.store(true, Ordering::SeqCst);
    let config = PoolConfig { prealloc: true, ..cfg(&[4 * KIB], 64 * KIB, MIB) };
    assert!(matches!(TieredPool::new(config, failing.clone()), Err(PoolError::Registration { .. })));
    assert_eq!(failing.live(), 0);
}

#[test]
fn each_slab_is_registered_once_and_deregistered_when_the_last_user_goes() {
    let config = PoolConfig { prealloc: true, ..cfg(&[4 * KIB, 64 * KIB], 64 * KIB, MIB) };
    let (pool, reg) = counted(config);
    assert_eq!((reg.registers.load(Ordering::SeqCst), pool.stats().grows), (2, 2));
    assert_eq!(pool.stats().bytes_allocated, 128 * KIB as u64);

    // 16 small buffers per slab, 1 large: 20 small + 3 large need 2 + 3 slabs.
    let mut leases: Vec<Lease> = (0..20).map(|_| pool.acquire(4 * KIB, None).unwrap()).collect();
    leases.extend((0..3).map(|_| pool.acquire(64 * KIB, None).unwrap()));
    assert_eq!((reg.registers.load(Ordering::SeqCst), pool.stats().grows), (5, 5));
    for l in &leases {
        assert_inside_its_region(l, &reg);
    }
    drop(leases);
    for _ in 0..100 {
        let x = pool.acquire(4 * KIB, None).unwrap();
        let y = pool.acquire(64 * KIB, None).unwrap();
        drop((x, y));
    }
    assert_eq!(reg.registers.load(Ordering::SeqCst), 5, "reuse never registers again");
    assert_eq!(reg.deregisters.load(Ordering::SeqCst), 0);

    // Dropping the pool with a lease outstanding keeps its memory alive.
    let mut survivor = pool.acquire(64 * KIB, None).unwrap();
    let other_handle = pool.clone();
    drop(pool);
    drop(other_handle);
    assert_eq!(reg.live(), 5);
    survivor.fill(7);
    assert!(survivor.iter().all(|&b| b == 7));
    drop(survivor);
    assert_eq!(reg.live(), 0);
    assert_eq!(reg.deregisters.load(Ordering::SeqCst), 5);
    assert_eq!(reg.violations.load(Ordering::SeqCst), 0);
}

/// Registrar whose first registration blocks until the test opens the gate.
#[derive(Default)]
struct GateRegistrar {
    calls: AtomicUsize,
    open: Mutex<bool>,
    opened: Condvar,
}

impl Registrar for GateRegistrar {
    fn register(&self, _addr: *mut u8, _len: usize) -> Result<RegionKeys, PoolError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock();
        while !*open {
            self.opened.wait(&mut open);
        }
        Ok(RegionKeys::default())
    }
    fn deregister(&self, _keys: &RegionKeys) {}
}

#[test]
fn concurrent_requests_share_one_growing_slab() {
    let reg = Arc::new(GateRegistrar::default());
    let pool = TieredPool::new(cfg(&[4 * KIB], 64 * KIB, MIB), reg.clone()).unwrap();
    let spawn = |pool: &TieredPool| {
        let pool = pool.clone();
        thread::spawn(move || pool.acquire(1, Some(Instant::now() + Duration::from_secs(20))))
    };
    let first = spawn(&pool);
    eventually("the first acquire is registering", || reg.calls.load(Ordering::SeqCst) == 1);
    // Registration runs outside the lock: the pool still answers.
    assert_eq!(pool.stats().bytes_allocated, 64 * KIB as u64, "the slab is reserved");
    let second = spawn(&pool);
    // The second request parks (the first is inside `register`, not on the pool's condition
    // variable): it decided to wait for the slab in flight rather than register one of its own.
    eventually("the second request is parked", || parked(&pool) == 1);
    assert_eq!(reg.calls.load(Ordering::SeqCst), 1, "the second request waits for the slab in flight");
    *reg.open.lock() = true;
    reg.opened.notify_all();
    let (a, b) = (first.join().unwrap().unwrap(), second.join().unwrap().unwrap());
    assert_ne!(a.as_ptr(), b.as_ptr());
    let s = pool.stats();
    assert_eq!((s.grows, s.bytes_allocated, s.waits, s.hits), (1, 64 * KIB as u64, 0, 1));
}

#[test]
fn lease_accessors_and_raw_round_trip() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Lease>();
    send_sync::<TieredPool>();

    let pool = TieredPool::unregistered(cfg(&[4 * KIB], 4 * KIB, MIB)).unwrap();
    let mut lease = pool.acquire(10, None).unwrap();
    assert_eq!((lease.len(), lease.capacity(), lease.is_empty()), (10, 4 * KIB, false));
    assert_eq!(lease.keys(), RegionKeys::default());
    lease.copy_from_slice(b"0123456789");
    lease.set_len(4 * KIB).unwrap();
    assert_eq!(&lease[..10], b"0123456789");
    match lease.set_len(4 * KIB + 1) {
        Err(PoolError::LenExceedsCapacity { requested, capacity }) => {
            assert_eq!((requested, capacity), (4 * KIB + 1, 4 * KIB))
        }
        other => panic!("expected LenExceedsCapacity, got {other:?}"),
    }
    assert_eq!(lease.len(), 4 * KIB, "a failed set_len changes nothing");
    lease.set_len(3).unwrap();
    assert_eq!(lease.as_ref(), b"012");

    // As a JNI layer would: the handle crosses to another thread as a jlong.
    let addr = lease.as_ptr() as usize;
    let handle = lease.into_raw() as usize as i64;
    assert_eq!(pool.stats().bytes_in_use, 4 * KIB as u64, "still leased while raw");
    thread::spawn(move || {
        // SAFETY: `handle` came from `into_raw` and is released exactly once.
        let back = unsafe { Lease::from_raw(handle as usize as *mut Lease) };
        assert_eq!((back.as_ptr() as usize, back.as_slice()), (addr, &b"012"[..]));
    })
    .join()
    .unwrap();
    assert_eq!(pool.stats().bytes_in_use, 0);
}

#[test]
fn stress_many_threads_never_exceed_the_cap() {
    const THREADS: usize = 64;
    const ROUNDS: usize = 150;
    let cap = 512 * KIB;
    let (pool, reg) = counted(cfg(&[4 * KIB, 16 * KIB, 64 * KIB], 64 * KIB, cap));
    let sizes = [1, 3000, 4 * KIB, 9000, 16 * KIB, 40_000, 64 * KIB, 90_000];
    let done = Arc::new(AtomicBool::new(false));

    let monitor = {
        let (pool, done) = (pool.clone(), done.clone());
        thread::spawn(move || {
            let mut samples = 0u64;
            while !done.load(Ordering::SeqCst) {
                let s = pool.stats();
                assert!(s.bytes_allocated <= cap as u64, "{s:?}");
                assert!(s.bytes_in_use <= s.bytes_allocated, "{s:?}");
                assert!(s.peak_bytes_in_use <= cap as u64, "{s:?}");
                samples += 1;
                thread::yield_now();
            }
            samples
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(t as u64);
                for round in 0..ROUNDS {
                    let len = sizes[rng.gen_range(0..sizes.len())];
                    let deadline = Instant::now() + Duration::from_secs(60);
                    let mut lease = if rng.gen_bool(0.2) {
                        match pool.try_acquire(len).unwrap() {
                            Some(l) => l,
                            None => pool.acquire(len, Some(deadline)).unwrap(),
                        }
                    } else {
                        pool.acquire(len, Some(deadline)).unwrap()
                    };
                    assert!(lease.capacity() >= len && lease.len() == len);
                    let tag = (t * 7 + round) as u8;
                    lease.fill(tag);
                    if round % 4 == 0 {
                        thread::yield_now();
                    }
                    // Another holder writing into this buffer would show here.
                    let n = lease.len();
                    for i in (0..n).step_by(509).chain([n / 2, n - 1]) {
                        assert_eq!(lease[i], tag, "buffer shared between two leases");
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::SeqCst);
    assert!(monitor.join().unwrap() > 0);

    let s = pool.stats();
    assert_eq!(s.bytes_in_use, 0);
    assert_eq!(s.acquires, (THREADS * ROUNDS) as u64);
    assert_eq!(s.timeouts, 0);
    assert!(s.peak_bytes_in_use <= cap as u64 && s.bytes_allocated <= cap as u64, "{s:?}");
    assert!(s.waits > 0, "a cap this small must have pushed back: {s:?}");
    drop(pool);
    assert_eq!(reg.live(), 0);
    assert_eq!(reg.registers.load(Ordering::SeqCst), reg.deregisters.load(Ordering::SeqCst));
    assert_eq!(reg.violations.load(Ordering::SeqCst), 0);
}
