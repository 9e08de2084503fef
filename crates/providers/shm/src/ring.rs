//! A lock-free single-producer/single-consumer ring of records in shared memory.
//!
//! The producer owns `head`, the consumer `tail`; both are monotonic byte counters on cache
//! lines of their own (so the two processes do not bounce one line on every record). A record
//! is an 8-byte header `{len: u32, kind: u32}` and `len` bytes, padded to 8; a record never
//! wraps: when it does not fit before the end, a padding record fills the rest and it starts
//! at offset 0. The producer writes the bytes, then publishes them with a release store of
//! `head`; the consumer's acquire load of `head` makes them visible. Symmetrically the
//! consumer releases space with a release store of `tail`.
//!
//! **Small traffic stays at the ring's start.** Once small records (at most
//! [`SMALL_RECORD`]) reach past [`WARM`] bytes into the ring and the consumer has caught up,
//! the producer pads to the end and starts again at offset 0, as a wrap does. So a link whose
//! messages are small (a 4 KiB allreduce, a group's handshake and headers) touches the first
//! [`WARM`] bytes of its ring and no more: its pages stay few and hot in cache, and the
//! segment need not be populated when it is made (populating two 2 MiB rings was nearly all
//! of what a group's shm links cost to set up).
//!
//! **Larger records use the whole ring.** Starting them over at offset 0 too made a 2-rank
//! 1 MiB allreduce 1.7× slower (two 512 KiB records a call, each written over lines the
//! peer's core had just read). For the same reason small records do not start over within a
//! lap of a larger one (a call's header and barrier between its data pulled the data back to
//! the start: 256 KiB and 4 MiB allreduces 1.2–1.5× slower), nor while the consumer lags.
//! The first record that leaves the warm start maps the whole ring on that side at once
//! ([`populate`](super::sys::populate)): one system call per side and link, where touching
//! the pages one by one faulted on every first touch (16 KiB allreduces took 3.6× as long).
//!
//! The peer is another process and may be buggy or hostile: every value read from shared
//! memory (`head`, a record header) is checked before use, and a violation is an error of the
//! connection, never an out-of-bounds access. (A peer can still change a record's bytes while
//! they are copied out; that gives it garbage of its own making, nothing more.)

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of a record header.
pub(crate) const RECORD_HEADER: u64 = 8;

/// Bytes a head may take in a record of a head and a caller's body, its length included:
/// the room both sides leave for it when they decide by a body's length alone whether it
/// fits a record ([`ShmConn::ring_takes`](crate::ShmConn::ring_takes)).
pub const RING_HEAD_ROOM: usize = 512;
/// Record kind of padding (skipped by the consumer).
pub(crate) const KIND_PAD: u32 = 0;
/// Bytes at the ring's start that small traffic keeps to: a small record that would start
/// past them starts at offset 0 instead when the consumer has freed what lies there (see the
/// module docs). The producer reads the consumer's `tail` for it at most once per `WARM`
/// bytes.
pub(crate) const WARM: u64 = 64 * 1024;
/// Largest record (header and padding included) that starts over at the ring's start past
/// [`WARM`]: a 4 KiB payload.
pub(crate) const SMALL_RECORD: u64 = RECORD_HEADER + 4096;

/// Maps a side's whole ring the first time a record leaves the warm start (module docs).
fn map_whole_once(populated: &mut bool, data: *mut u8, cap: u64) {
    if !*populated {
        *populated = true;
        super::sys::populate(data, cap as usize);
    }
}

fn padded(len: u64) -> u64 {
    RECORD_HEADER + len.div_ceil(8) * 8
}

/// The writing end of a ring.
pub(crate) struct Producer {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    data: *mut u8,
    cap: u64,
    /// Our copy of `head` (only we write it).
    pos: u64,
    /// The consumer's `tail` as last read: room up to it is certain (it only grows), so a
    /// push reads the consumer's line only when that room runs out. Reading it on every
    /// record was the largest cost of a small send (a line the other core just wrote).
    seen_tail: u64,
    /// Position from which a record past [`WARM`] may look at `tail` again to start over at
    /// offset 0 (one look per `WARM` bytes while the consumer lags).
    rewind_from: u64,
    /// Position before which a small record does not start over: a larger record was
    /// written within the ring's last lap.
    large_until: u64,
    /// Whether the whole ring is mapped on this side (see the module docs).
    populated: bool,
}

/// The reading end of a ring.
pub(crate) struct Consumer {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    data: *mut u8,
    cap: u64,
    /// Our copy of `tail` (only we write it).
    pos: u64,
    /// The producer's `head` as last read (checked): records up to it are published, so a
    /// pop reads the producer's line only once it has consumed them.
    seen_head: u64,
    /// Bytes of the record [`pop_keep`](Self::pop_keep) left in the ring, not yet released
    /// (0: none).
    held: u64,
    /// Whether the whole ring is mapped on this side (see the module docs).
    populated: bool,
}

// SAFETY: the pointers point into a shared mapping that the owning connection keeps alive as
// long as the ring; each end is used by one thread at a time (`&mut self` methods).
unsafe impl Send for Producer {}
// SAFETY: as above.
unsafe impl Send for Consumer {}

/// The shared locations of one ring.
#[derive(Clone, Copy)]
pub(crate) struct RingPtrs {
    pub(crate) head: *const AtomicU64,
    pub(crate) tail: *const AtomicU64,
    pub(crate) data: *mut u8,
    /// Bytes of `data`; a power of two.
    pub(crate) cap: u64,
}

impl Producer {
    /// # Safety
    /// `p` must point into a live mapping that outlives the producer, with `cap` bytes of
    /// data, and no other producer may exist for the ring.
    pub(crate) unsafe fn new(p: RingPtrs) -> Producer {
        // SAFETY: the caller guarantees `head` is live.
        let pos = unsafe { (*p.head).load(Ordering::Relaxed) };
        // SAFETY: as above, for `tail`.
        let seen_tail = unsafe { (*p.tail).load(Ordering::Acquire) };
        Producer {
            head: p.head,
            tail: p.tail,
            data: p.data,
            cap: p.cap,
            pos,
            seen_tail,
            rewind_from: pos,
            large_until: pos,
            populated: false,
        }
    }

    /// Largest payload one record carries (so a record and its padding fit an empty ring).
    pub(crate) fn max_record(&self) -> usize {
        (self.cap / 2 - RECORD_HEADER) as usize
    }

    /// Appends one record of `kind` whose payload is `parts` concatenated, or returns `false`
    /// when the ring has no room now. Parts longer than [`max_record`](Self::max_record)
    /// together are a caller bug.
    pub(crate) fn push(&mut self, kind: u32, parts: &[&[u8]]) -> bool {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        debug_assert!(len <= self.max_record() && kind != KIND_PAD);
        let need = padded(len as u64);
        let at = self.pos & (self.cap - 1);
        let to_end = self.cap - at;
        // A hostile consumer could move `tail` past `head`; then this wraps to a huge number
        // and we see no room, which only stalls our own sends to it.
        let room = |tail: u64, total: u64| self.pos.wrapping_sub(tail).saturating_add(total) <= self.cap;
        // Past the warm start, a small record starts over at offset 0 if the consumer freed
        // it (see WARM).
        let rewind = at > WARM
            && need <= SMALL_RECORD
            && self.pos >= self.large_until
            && need <= to_end
            && self.pos >= self.rewind_from
            && {
                // SAFETY: as the load below.
                self.seen_tail = unsafe { (*self.tail).load(Ordering::Acquire) };
                self.rewind_from = self.pos + WARM;
                room(self.seen_tail, to_end + need)
            };
        let wrap = rewind || need > to_end;
        let total = if wrap { to_end + need } else { need };
        if !room(self.seen_tail, total) {
            // SAFETY: `tail` is live (constructor contract); acquire orders the consumer's
            // reads of the records it freed before our overwrite.
            self.seen_tail = unsafe { (*self.tail).load(Ordering::Acquire) };
            if !room(self.seen_tail, total) {
                return false;
            }
        }
        let mut at = at;
        if !rewind && (wrap || at + need > WARM + SMALL_RECORD) {
            map_whole_once(&mut self.populated, self.data, self.cap);
        }
        if wrap {
            self.write_header(at, (to_end - RECORD_HEADER) as u32, KIND_PAD);
            self.pos += to_end;
            at = 0;
        }
        self.write_header(at, len as u32, kind);
        let mut off = (at + RECORD_HEADER) as usize;
        for p in parts {
            // SAFETY: `off + p.len()` stays inside the data area: the record fits before its
            // end (checked above) and the consumer has released these bytes.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), self.data.add(off), p.len()) };
            off += p.len();
        }
        self.pos += need;
        if need > SMALL_RECORD {
            self.large_until = self.pos + self.cap;
        }
        // SAFETY: `head` is live; the release store publishes the bytes written above.
        unsafe { (*self.head).store(self.pos, Ordering::Release) };
        true
    }

    fn write_header(&self, at: u64, len: u32, kind: u32) {
        let mut h = [0u8; 8];
        h[..4].copy_from_slice(&len.to_le_bytes());
        h[4..].copy_from_slice(&kind.to_le_bytes());
        // SAFETY: `at` is 8-aligned and at least 8 bytes before the end of the data area.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), self.data.add(at as usize), 8) };
    }
}

impl Consumer {
    /// # Safety
    /// As [`Producer::new`], for the one consumer of the ring.
    pub(crate) unsafe fn new(p: RingPtrs) -> Consumer {
        // SAFETY: the caller guarantees `tail` is live.
        let pos = unsafe { (*p.tail).load(Ordering::Relaxed) };
        Consumer { head: p.head, tail: p.tail, data: p.data, cap: p.cap, pos, seen_head: pos, held: 0, populated: false }
    }

    /// Whether a record is waiting (after a held one).
    pub(crate) fn has_data(&self) -> bool {
        let next = self.pos + self.held;
        // SAFETY: `head` is live (constructor contract).
        self.seen_head != next || unsafe { (*self.head).load(Ordering::Acquire) != next }
    }

    /// Hands the next record to `f` (kind and payload, valid only during the call), then frees
    /// its space. `Ok(None)` when the ring is empty; `Err` names what the peer corrupted.
    #[cfg(test)]
    pub(crate) fn pop<R>(&mut self, f: impl FnOnce(u32, &[u8]) -> R) -> Result<Option<R>, String> {
        self.pop_keep(|kind, payload| (f(kind, payload), false))
    }

    /// Like [`pop`](Self::pop), but when `f` answers `true` the record stays in the ring: its
    /// payload (a slice of the shared mapping) stays valid and its space unfreed until
    /// [`release_held`](Self::release_held), so the caller may copy it straight to where it
    /// belongs later. Nothing more is popped meanwhile (`Ok(None)`).
    pub(crate) fn pop_keep<R>(&mut self, f: impl FnOnce(u32, &[u8]) -> (R, bool)) -> Result<Option<R>, String> {
        if self.held != 0 {
            return Ok(None);
        }
        loop {
            let head = if self.seen_head != self.pos {
                self.seen_head
            } else {
                // SAFETY: `head` is live; acquire pairs with the producer's release.
                unsafe { (*self.head).load(Ordering::Acquire) }
            };
            if head == self.pos {
                return Ok(None);
            }
            let avail = head.wrapping_sub(self.pos);
            if avail > self.cap || avail < RECORD_HEADER {
                return Err(format!("ring head {head} is not within {} bytes after tail {}", self.cap, self.pos));
            }
            self.seen_head = head;
            let at = self.pos & (self.cap - 1);
            let mut h = [0u8; 8];
            // SAFETY: `at` is 8-aligned (positions advance by multiples of 8), so 8 bytes fit.
            unsafe { std::ptr::copy_nonoverlapping(self.data.add(at as usize), h.as_mut_ptr(), 8) };
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as u64;
            let kind = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
            let need = padded(len);
            if need > avail || need > self.cap - at {
                return Err(format!("record of {len} bytes at {at} runs past the published data or the ring's end"));
            }
            if kind == KIND_PAD {
                self.release(need);
                continue;
            }
            if at + need > WARM + SMALL_RECORD {
                map_whole_once(&mut self.populated, self.data, self.cap);
            }
            // SAFETY: the record lies inside the data area and inside what the producer
            // published (both checked above).
            let payload = unsafe { std::slice::from_raw_parts(self.data.add((at + RECORD_HEADER) as usize), len as usize) };
            let (r, keep) = f(kind, payload);
            if keep {
                self.held = need;
            } else {
                self.release(need);
            }
            return Ok(Some(r));
        }
    }

    /// Frees the record [`pop_keep`](Self::pop_keep) kept (a no-op without one): the producer
    /// may overwrite it from now on.
    pub(crate) fn release_held(&mut self) {
        let n = std::mem::take(&mut self.held);
        if n != 0 {
            self.release(n);
        }
    }

    fn release(&mut self, n: u64) {
        self.pos += n;
        // SAFETY: `tail` is live; release orders our reads of the record before the producer
        // may overwrite it.
        unsafe { (*self.tail).store(self.pos, Ordering::Release) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring in ordinary memory (the layout of one ring of a segment).
    struct Local {
        _ctl: Box<[AtomicU64; 16]>,
        _data: Vec<u64>,
        ptrs: RingPtrs,
    }

    // SAFETY: test rings are moved to one producer and one consumer thread.
    unsafe impl Send for Local {}
    // SAFETY: as above.
    unsafe impl Sync for Local {}

    fn local(cap: usize) -> Local {
        let ctl: Box<[AtomicU64; 16]> = Box::new(std::array::from_fn(|_| AtomicU64::new(0)));
        let mut data = vec![0u64; cap / 8];
        let ptrs = RingPtrs { head: &ctl[0], tail: &ctl[8], data: data.as_mut_ptr() as *mut u8, cap: cap as u64 };
        Local { _ctl: ctl, _data: data, ptrs }
    }

    #[test]
    fn records_of_every_size_cross_in_order_with_wraparound_and_backpressure() {
        // 4 KiB: records wrap at the end; 256 KiB: small ones also start over past WARM
        // whenever the consumer caught up.
        for cap in [4096, 256 << 10] {
            every_size_crosses_in_order(cap);
        }
    }

    #[test]
    fn small_records_a_consumer_keeps_up_with_stay_at_the_ring_s_start() {
        let cap = 1 << 20;
        let ring = local(cap);
        // SAFETY: one producer and one consumer over `ring`, which outlives both.
        let (mut p, mut c) = unsafe { (Producer::new(ring.ptrs), Consumer::new(ring.ptrs)) };
        let body = vec![5u8; 4096];
        let base = ring.ptrs.data as usize;
        let mut furthest = 0;
        for i in 0..2_000u32 {
            assert!(p.push(i + 1, &[&body[..4096 - (i as usize % 64)]]));
            let (kind, at) = c.pop(|kind, bytes| (kind, bytes.as_ptr() as usize - base)).unwrap().unwrap();
            assert_eq!(kind, i + 1);
            furthest = furthest.max(at + 4096);
        }
        // 8 MiB went through a 1 MiB ring, all of it within the warm start and one record.
        assert!(furthest as u64 <= WARM + 4096 + RECORD_HEADER, "records reached {furthest} bytes into the ring");
        // A consumer that lags keeps the producer going round the whole ring.
        let mut furthest = 0;
        for _ in 0..2_000 {
            while !p.push(7, &[&body]) {
                let at = c.pop(|_, bytes| bytes.as_ptr() as usize - base).unwrap().unwrap();
                furthest = furthest.max(at + 4096);
            }
        }
        assert!(furthest > cap / 2, "a lagging consumer's records reached only {furthest} bytes");
    }

    #[test]
    fn small_records_within_a_lap_of_a_larger_one_do_not_start_over() {
        let cap = 1 << 20;
        let ring = local(cap);
        // SAFETY: one producer and one consumer over `ring`, which outlives both.
        let (mut p, mut c) = unsafe { (Producer::new(ring.ptrs), Consumer::new(ring.ptrs)) };
        let base = ring.ptrs.data as usize;
        let large = vec![1u8; 96 << 10];
        let small = [2u8; 64];
        assert!(p.push(1, &[&large]));
        c.pop(|_, _| ()).unwrap().unwrap();
        // Past WARM now, the consumer caught up: a small record goes on after the large one.
        assert!(p.push(2, &[&small]));
        let at = c.pop(|_, bytes| bytes.as_ptr() as usize - base).unwrap().unwrap();
        assert!(at as u64 > WARM, "a small record after a large one started over at {at}");
    }

    fn every_size_crosses_in_order(cap: usize) {
        let ring = std::sync::Arc::new(local(cap));
        let r2 = ring.clone();
        // SAFETY: the ring lives in `ring`, kept by both threads; one producer, one consumer.
        let mut p = unsafe { Producer::new(ring.ptrs) };
        let max = p.max_record();
        let count = 5_000u32;
        let consumer = std::thread::spawn(move || {
            // SAFETY: as above.
            let mut c = unsafe { Consumer::new(r2.ptrs) };
            let mut i = 0u32;
            while i < count {
                let got = c.pop(|kind, bytes| (kind, bytes.to_vec())).unwrap();
                let Some((kind, bytes)) = got else {
                    // Two cores shared with other jobs: let the producer run.
                    std::thread::yield_now();
                    continue;
                };
                assert_eq!(kind, i + 1);
                let len = (i as usize * 37) % (max + 1);
                assert_eq!(bytes.len(), len, "record {i}");
                assert!(bytes.iter().enumerate().all(|(j, b)| *b == (i as usize + j) as u8), "record {i} bytes");
                i += 1;
            }
        });
        let mut full = 0u64;
        for i in 0..count {
            let len = (i as usize * 37) % (max + 1);
            let body: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
            let (a, b) = body.split_at(len / 3);
            while !p.push(i + 1, &[a, b]) {
                full += 1;
                std::thread::yield_now();
            }
        }
        consumer.join().unwrap();
        assert!(full > 0, "a 4 KiB ring must have pushed back at some point");
    }

    #[test]
    fn a_held_record_stays_in_place_and_unfreed_until_released() {
        let ring = local(4096);
        // SAFETY: one producer and one consumer over `ring`, which outlives both.
        let (mut p, mut c) = unsafe { (Producer::new(ring.ptrs), Consumer::new(ring.ptrs)) };
        let big = vec![7u8; p.max_record()];
        assert!(p.push(1, &[&big]));
        assert!(p.push(3, &[b"small"]));
        let at = c.pop_keep(|kind, bytes| ((kind, bytes.as_ptr() as usize, bytes.len()), true)).unwrap().unwrap();
        assert_eq!((at.0, at.2), (1, big.len()));
        // Held: the producer has no room for another record of half the ring, the consumer
        // pops nothing more, but sees what waits behind the held record.
        assert!(!p.push(2, &[&big]), "a held record's space is not freed");
        assert!(c.has_data());
        assert_eq!(c.pop(|k, _| k).unwrap(), None, "nothing is popped past a held record");
        // SAFETY: the held record's bytes stay in the ring until released.
        assert!(unsafe { std::slice::from_raw_parts(at.1 as *const u8, at.2) }.iter().all(|&b| b == 7));
        c.release_held();
        assert_eq!(c.pop(|k, b| (k, b.to_vec())).unwrap(), Some((3, b"small".to_vec())));
        assert!(p.push(2, &[&big]), "released: room again");
        assert_eq!(c.pop(|k, b| (k, b.len())).unwrap(), Some((2, big.len())));
        c.release_held();
        assert!(!c.has_data());
    }

    #[test]
    fn a_corrupt_head_or_record_is_an_error_not_an_out_of_bounds_read() {
        let ring = local(4096);
        // SAFETY: one producer and one consumer over `ring`, which outlives both.
        let (mut p, mut c) = unsafe { (Producer::new(ring.ptrs), Consumer::new(ring.ptrs)) };
        assert!(p.push(7, &[b"hello"]));
        // SAFETY: the head is live; the test plays a hostile producer.
        unsafe { (*ring.ptrs.head).store(1 << 20, Ordering::Release) };
        assert!(c.pop(|_, _| ()).unwrap_err().contains("not within"));
        // SAFETY: as above.
        unsafe {
            (*ring.ptrs.head).store(16, Ordering::Release);
            // A header claiming 4000 bytes where 8 were published.
            std::ptr::copy_nonoverlapping(4000u32.to_le_bytes().as_ptr(), ring.ptrs.data, 4);
        }
        assert!(c.pop(|_, _| ()).unwrap_err().contains("runs past"));
    }
}
