//! Who runs the loop: its own thread, or a caller that waits for something.
//!
//! The loop's state sits behind one lock, and whoever holds it runs turns
//! ([`Loop::turn`]). While nobody waits, the loop thread holds it and sleeps in `epoll`, so
//! the engine makes progress on its own (heartbeats, timers, accepting, an incoming
//! rendezvous). A caller that blocks for a message ([`Driver::progress`]) takes the loop
//! over instead and runs the turns on its own thread, as MPI's progress engine and UCX's
//! `ucp_worker_progress` do: its send goes out on that thread and the answer is read there,
//! so a message costs no thread hand-off at all, where handing work to the loop thread and
//! being woken by it cost two per hop (a futex wake and often a migration each, the largest
//! share of a small message's time on a loaded 2-core host, measured with `perf`).
//!
//! The hand-over costs one wake-up per *call* at most, not per message: a caller that
//! arrives while the loop thread sleeps in `epoll` rings its waker and takes the lock when
//! the thread lets go. The thread then stays away while any caller wants the loop, and
//! comes back only once none has come for a whole [`RESUME_CHECK`], so back-to-back calls
//! (a training loop's allreduces, with a few microseconds of Python between them) run
//! without it. (Coming back at the first look that found no caller, it took the loop in
//! such a gap now and then, a twelfth of 2-rank 4 KiB allreduces over tcp, and the next
//! call paid a wake-up of it and a hand-over; waiting for it, the thread's turns for the
//! lock cost 1.6 `sched_yield` per call.)
//!
//! A caller polls the loop without sleeping for [`DriverConfig::spin`](super::DriverConfig::spin)
//! before it sleeps: a reply that comes within it costs no sleep. It spins hard only for the
//! first fifth and yields its core between polls after that (always, where the host is
//! oversubscribed), so a compute thread of the same process keeps its core. Then it sleeps in the loop's
//! own `epoll` (for at most [`CALLER_NAP`] at a time, so a second waiting caller gets its
//! turn), and never past its deadline.

use super::types::{Loop, Shared, MAX_SPIN};
use mio::Events;
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the loop thread, while callers drive, looks whether they are gone.
pub(crate) const RESUME_CHECK: Duration = Duration::from_millis(1);
/// The longest a driving caller sleeps in `epoll` before it lets another caller in.
pub(crate) const CALLER_NAP: Duration = Duration::from_millis(2);
/// The share of [`DriverConfig::spin`](super::DriverConfig::spin) a caller spins without
/// yielding its core; for the rest of the spin it yields between polls.
const HARD_SPIN_SHARE: f32 = 0.2;
/// How long a caller waits for the lock before it looks at its condition again (another
/// caller driving may have delivered what it waits for).
const LOCK_WAIT: Duration = Duration::from_micros(200);

/// The loop, and how many callers want to drive it.
pub(crate) struct Progress {
    pub(super) lp: Mutex<Loop>,
    /// Callers inside [`Driver::progress`](super::Driver::progress); the loop thread keeps
    /// away while it is not zero.
    callers: AtomicUsize,
    /// Callers that ever drove or kicked the loop: the loop thread comes back only after a
    /// [`RESUME_CHECK`] in which this did not move.
    claims: AtomicUsize,
    /// The loop thread holds the loop (it may sleep in `epoll` with it): a caller's kick then
    /// takes the loop over instead of handing it each send.
    thread_holds: AtomicBool,
}

impl Progress {
    pub(super) fn new(lp: Loop) -> Progress {
        Progress {
            lp: Mutex::new(lp),
            callers: AtomicUsize::new(0),
            claims: AtomicUsize::new(0),
            thread_holds: AtomicBool::new(false),
        }
    }

    /// The loop thread: runs turns while no caller wants to, and stops with the loop.
    pub(super) fn run_thread(&self) {
        let mut events = Events::with_capacity(1024);
        let mut spin_until: Option<Instant> = None;
        loop {
            let mut lp = self.lp.lock();
            self.thread_holds.store(true, Ordering::Release);
            let spin = lp.shared.config.spin.min(MAX_SPIN);
            while self.callers.load(Ordering::Acquire) == 0 {
                let cap = if lp.spin_now(spin_until) { Some(Duration::ZERO) } else { None };
                let Some(worked) = lp.turn(&mut events, cap) else {
                    lp.finish();
                    self.thread_holds.store(false, Ordering::Release);
                    return;
                };
                lp.shared.stats.loop_turns.fetch_add(1, Ordering::Relaxed);
                if worked && !spin.is_zero() {
                    spin_until = Some(Instant::now() + spin);
                } else if spin_until.is_some_and(|u| Instant::now() >= u) {
                    spin_until = None;
                }
            }
            spin_until = None;
            let stopping = lp.shared.clone();
            self.thread_holds.store(false, Ordering::Release);
            drop(lp);
            // A caller drives. Look again now and then, and come back once no caller drove
            // or kicked between two looks that both found none driving (a wait that spanned
            // a look counts); a stop ends the waiting too (the callers' deadlines bound it
            // anyway).
            let mut seen = self.claims.load(Ordering::Acquire);
            let mut was_idle = false;
            while !stopping.stopping.load(Ordering::Acquire) {
                std::thread::park_timeout(RESUME_CHECK);
                let now = self.claims.load(Ordering::Acquire);
                let idle = self.callers.load(Ordering::Acquire) == 0;
                if idle && was_idle && now == seen {
                    break;
                }
                seen = now;
                was_idle = idle;
            }
        }
    }
}

/// A caller's claim on the loop, given back on drop.
struct Claim<'a>(&'a Progress);

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.callers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the loop on the calling thread until `done` returns a value or `deadline` passes
/// (`None`), or the loop has stopped (`None` too: the caller finds out why from its own
/// state, which the stop failed).
pub(super) fn drive<R>(
    progress: &Arc<Progress>,
    shared: &Shared,
    deadline: Instant,
    mut done: impl FnMut() -> Option<R>,
) -> Option<R> {
    if let Some(r) = done() {
        return Some(r);
    }
    progress.callers.fetch_add(1, Ordering::AcqRel);
    progress.claims.fetch_add(1, Ordering::Relaxed);
    let _claim = Claim(progress);
    let spin = shared.config.spin.min(MAX_SPIN);
    let mut rang = false;
    let mut events = Events::with_capacity(256);
    loop {
        let lp = match progress.lp.try_lock() {
            Some(lp) => lp,
            None => {
                // The loop thread may sleep in epoll holding the lock: ring it once so it
                // lets go. Another caller driving lets go within a nap.
                if !rang {
                    rang = true;
                    let _ = shared.waker.wake();
                }
                match progress.lp.try_lock_for(LOCK_WAIT) {
                    Some(lp) => lp,
                    None => {
                        if let Some(r) = done() {
                            return Some(r);
                        }
                        if Instant::now() >= deadline {
                            return None;
                        }
                        continue;
                    }
                }
            }
        };
        let yield_now = shared.yield_when_idle.load(Ordering::Relaxed);
        match turns(lp, &mut events, spin, yield_now, deadline, &progress.callers, &mut done) {
            Turns::Done(r) => return Some(r),
            Turns::Stopped | Turns::Deadline => return None,
            Turns::LetIn => {
                if let Some(r) = done() {
                    return Some(r);
                }
                if Instant::now() >= deadline {
                    return None;
                }
            }
        }
    }
}

/// Runs one turn without sleeping if the loop is free; else rings its waker, so whoever
/// holds it picks up the queued commands. Where that is the loop thread (back after the
/// callers were quiet), the caller takes the loop over as a waiting caller does: the
/// thread's turn ends at the ring and it keeps away, so this call's next sends find the loop
/// free instead of each ringing the thread and being written by it (a wake-up and a switch
/// per message: 4.7 per 2-rank 1 MiB allreduce over tcp).
pub(super) fn kick(progress: &Progress, shared: &Shared) {
    let mut events = Events::with_capacity(64);
    if let Some(mut lp) = progress.lp.try_lock() {
        progress.claims.fetch_add(1, Ordering::Relaxed);
        let _ = lp.turn(&mut events, Some(Duration::ZERO));
        shared.stats.caller_turns.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let _ = shared.waker.wake();
    if !progress.thread_holds.load(Ordering::Acquire) {
        // Another caller drives: it picks the commands up in its next turn.
        return;
    }
    progress.callers.fetch_add(1, Ordering::AcqRel);
    progress.claims.fetch_add(1, Ordering::Relaxed);
    let _claim = Claim(progress);
    if let Some(mut lp) = progress.lp.try_lock_for(LOCK_WAIT) {
        let _ = lp.turn(&mut events, Some(Duration::ZERO));
        shared.stats.caller_turns.fetch_add(1, Ordering::Relaxed);
    }
}

enum Turns<R> {
    Done(R),
    Stopped,
    Deadline,
    /// Another caller waits for the loop: it was let go of for a moment.
    LetIn,
}

/// Turns of a caller holding the loop: spin, then nap in epoll; let a second caller in
/// after each nap.
fn turns<R>(
    mut lp: MutexGuard<'_, Loop>,
    events: &mut Events,
    spin: Duration,
    yield_now: bool,
    deadline: Instant,
    callers: &AtomicUsize,
    done: &mut impl FnMut() -> Option<R>,
) -> Turns<R> {
    let mut spin_until = Instant::now() + spin;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Turns::Deadline;
        }
        let cap = if now < spin_until { Duration::ZERO } else { CALLER_NAP.min(deadline - now) };
        let Some(worked) = lp.turn(events, Some(cap)) else {
            return Turns::Stopped;
        };
        lp.shared.stats.caller_turns.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = done() {
            return Turns::Done(r);
        }
        if worked {
            spin_until = Instant::now() + spin;
        } else if cap > Duration::ZERO && callers.load(Ordering::Acquire) > 1 {
            drop(lp);
            return Turns::LetIn;
        }
        if cap == Duration::ZERO {
            // Spin hard only for the first part of the spin (a reply on a free core comes
            // within it); then yield between polls, so a thread of this process with work
            // (DDP's backward pass beside its allreduce) gets the core. Measured on 2
            // cores: pure spinning for the whole spin made a DDP step 1.5x slower.
            if yield_now || Instant::now() + spin.mul_f32(1.0 - HARD_SPIN_SHARE) >= spin_until {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
