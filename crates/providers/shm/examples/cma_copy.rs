//! What one byte costs the shm provider's two ways of moving a large message, on this
//! kernel: a single copy with `process_vm_readv` (cross-memory attach, what Open MPI's sm
//! uses too) against a plain `memcpy` (each of the two copies of copy-in/copy-out through the
//! segment). The kernel pins the source's pages one by one for a single copy; where that
//! costs more than a second `memcpy`, copying through the segment moves a message faster.
//!
//! Reads this process's own memory (the same kernel path as another process's, with no
//! ptrace permission needed). Prints JSON: per size, the best of five runs of each.
//!
//! `cargo run --release -p rdma-shuffle-provider-shm --example cma_copy`

use std::time::Instant;

fn best_of(runs: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let pid = std::process::id() as libc::pid_t;
    let mut rows = Vec::new();
    for size in [64usize << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20] {
        let src = vec![1u8; size];
        let mut dst = vec![2u8; size];
        let iters = ((256usize << 20) / size).clamp(20, 4000);
        let cma = best_of(5, iters, || {
            let local = libc::iovec { iov_base: dst.as_mut_ptr().cast(), iov_len: size };
            let remote = libc::iovec { iov_base: src.as_ptr() as *mut _, iov_len: size };
            // SAFETY: both ranges are live buffers of `size` bytes of this process.
            let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
            assert_eq!(n, size as isize, "process_vm_readv: {}", std::io::Error::last_os_error());
        });
        let copy = best_of(5, iters, || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
        });
        let gbs = |t: f64| size as f64 / t / 1e9;
        rows.push(format!(
            "  {{\"bytes\": {size}, \"process_vm_readv_us\": {:.1}, \"process_vm_readv_GBps\": {:.1}, \"memcpy_us\": {:.1}, \"memcpy_GBps\": {:.1}}}",
            cma * 1e6,
            gbs(cma),
            copy * 1e6,
            gbs(copy)
        ));
    }
    println!("[\n{}\n]", rows.join(",\n"));
}
