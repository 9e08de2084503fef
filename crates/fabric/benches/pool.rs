//! Hit-path cost of the tiered pool: one acquire plus the release on drop, with the buffer
//! already in a free list (the steady state of a shuffle fetch).

use std::hint::black_box;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rdma_shuffle_fabric::pool::{PoolConfig, TieredPool};

fn pool() -> TieredPool {
    // Preallocated so every measured acquire is a free-list hit.
    let config = PoolConfig { prealloc: true, ..PoolConfig::default() };
    TieredPool::unregistered(config).expect("default config is valid")
}

fn hit_path(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool_acquire_release");
    group.throughput(Throughput::Elements(1));
    for (name, len) in [("4KiB", 4 << 10), ("1MiB", 1 << 20)] {
        let pool = pool();
        group.bench_function(format!("{name}/1thread"), |b| {
            b.iter(|| drop(black_box(pool.acquire(black_box(len), None).unwrap())))
        });

        // Two threads hammering the same pool (the lock is shared by all tiers). Each
        // thread does `iters` pairs; the time reported is wall time per pair per thread.
        group.bench_function(format!("{name}/2threads"), |b| {
            b.iter_custom(|iters| {
                let barrier = Barrier::new(2);
                let run = || {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        drop(black_box(pool.acquire(black_box(len), None).unwrap()));
                    }
                    start.elapsed()
                };
                thread::scope(|s| {
                    let other = s.spawn(run);
                    let mine = run();
                    mine.max(other.join().expect("bench thread"))
                })
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = hit_path
}
criterion_main!(benches);
