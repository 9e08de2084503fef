//! The registration cache of user buffers.
//!
//! # Why keyed by `(address, length)` and dropped after each call by default
//!
//! A registration pins the pages that back an address range *when it is made*. If the caller
//! frees the buffer and a later allocation gets the same address, a cached registration would
//! still name the old pages: a peer's READ would see stale bytes (or a READ into it would
//! write memory the process no longer uses there). Linux offers no portable hook on `munmap`
//! to invalidate such entries (MPI libraries intercept `free`/`munmap` or rely on on-demand
//! paging, which SoftRoCE does not offer).
//!
//! So the cache keeps an entry only while someone uses it — every step and segment of one
//! collective call shares one registration of the caller's buffer — and drops it at the end
//! of the call. Keeping entries across calls (`MOBIUS_REGCACHE=1`, for training loops that
//! reuse their gradient buffers) is opt-in, and then the owner of the memory invalidates it
//! before freeing (the Python layer does so from a finalizer of the array that owns the
//! memory); an entry invalidated while in use is never handed out again and goes when its
//! last user does.

use std::collections::HashMap;

struct RegEntry<V> {
    key: (usize, usize),
    value: V,
    users: usize,
    /// Invalidated while in use: released when the last user lets go, never reused.
    stale: bool,
    last_use: u64,
}

/// Registrations of user memory by `(address, length)`, in use or (with `keep`) idle up to
/// `cap_bytes`, least recently used first out. Values that leave the cache are returned to
/// the caller, which releases them outside its lock (deregistering is a system call).
pub(crate) struct RegCache<V> {
    keep: bool,
    cap_bytes: usize,
    /// Bytes of every registration still held (live and stale).
    pub(crate) bytes: usize,
    clock: u64,
    next_id: u64,
    entries: HashMap<u64, RegEntry<V>>,
    /// Live (reusable) entries by `(ptr, len)`.
    index: HashMap<(usize, usize), u64>,
}

impl<V: Clone> RegCache<V> {
    pub(crate) fn new(keep: bool, cap_bytes: usize) -> Self {
        RegCache { keep, cap_bytes, bytes: 0, clock: 0, next_id: 1, entries: HashMap::new(), index: HashMap::new() }
    }

    /// A live entry for exactly `key`, now used once more.
    pub(crate) fn hit(&mut self, key: (usize, usize)) -> Option<(u64, V)> {
        self.clock += 1;
        let id = *self.index.get(&key)?;
        let e = self.entries.get_mut(&id)?;
        e.users += 1;
        e.last_use = self.clock;
        Some((id, e.value.clone()))
    }

    /// Adds a fresh registration, in use once; returns its id and the values evicted to stay
    /// under the cap.
    pub(crate) fn insert(&mut self, key: (usize, usize), value: V) -> (u64, Vec<V>) {
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        // Two threads may register the same buffer at once; the older entry stays usable by
        // its holders and goes when they do.
        if let Some(old) = self.index.insert(key, id) {
            if let Some(e) = self.entries.get_mut(&old) {
                e.stale = true;
            }
        }
        self.entries.insert(id, RegEntry { key, value, users: 1, stale: false, last_use: self.clock });
        self.bytes += key.1;
        (id, self.evict())
    }

    fn remove(&mut self, id: u64) -> Option<V> {
        let e = self.entries.remove(&id)?;
        if self.index.get(&e.key) == Some(&id) {
            self.index.remove(&e.key);
        }
        self.bytes -= e.key.1.min(self.bytes);
        Some(e.value)
    }

    fn evict(&mut self) -> Vec<V> {
        let mut out = Vec::new();
        while self.bytes > self.cap_bytes {
            let victim = self.entries.iter().filter(|(_, e)| e.users == 0).min_by_key(|(_, e)| e.last_use).map(|(id, _)| *id);
            let Some(id) = victim else { break };
            out.extend(self.remove(id));
        }
        out
    }

    /// One user let go of entry `id`.
    pub(crate) fn release(&mut self, id: u64) -> Vec<V> {
        let keep = self.keep;
        let Some(e) = self.entries.get_mut(&id) else { return Vec::new() };
        e.users = e.users.saturating_sub(1);
        let mut out = Vec::new();
        if e.users == 0 && (!keep || e.stale) {
            out.extend(self.remove(id));
        }
        out.extend(self.evict());
        out
    }

    /// Drops entries overlapping `[ptr, ptr + len)`: the memory is about to be freed.
    pub(crate) fn invalidate(&mut self, ptr: usize, len: usize) -> Vec<V> {
        let end = ptr.saturating_add(len);
        let hit: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.key.0 < end && ptr < e.key.0.saturating_add(e.key.1))
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::new();
        for id in hit {
            let Some(e) = self.entries.get_mut(&id) else { continue };
            e.stale = true;
            let key = e.key;
            if e.users == 0 {
                out.extend(self.remove(id));
            } else if self.index.get(&key) == Some(&id) {
                self.index.remove(&key);
            }
        }
        out
    }

    /// Empties the cache (the mesh closes).
    pub(crate) fn clear(&mut self) -> Vec<V> {
        self.bytes = 0;
        self.index.clear();
        self.entries.drain().map(|(_, e)| e.value).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_reuses_live_registrations_and_drops_them_after_use_unless_kept() {
        let mut c = RegCache::new(false, 1 << 20);
        let (id, ev) = c.insert((0x1000, 100), 1u32);
        assert!(ev.is_empty());
        assert_eq!(c.hit((0x1000, 100)).map(|h| h.1), Some(1));
        assert!(c.release(id).is_empty(), "one user left");
        assert_eq!(c.release(id), vec![1]);
        assert!(c.hit((0x1000, 100)).is_none());

        let mut c = RegCache::new(true, 1 << 20);
        let (id, _) = c.insert((0x1000, 100), 1u32);
        assert!(c.release(id).is_empty(), "kept after its last use");
        assert!(c.hit((0x1000, 100)).is_some());
    }

    #[test]
    fn cache_evicts_least_recently_used_idle_entries_above_its_cap() {
        let mut c = RegCache::new(true, 250);
        let (a, _) = c.insert((0x1000, 100), 1u32);
        let (b, _) = c.insert((0x2000, 100), 2);
        c.release(a);
        c.release(b);
        assert!(c.hit((0x1000, 100)).is_some());
        c.release(a);
        let (_, ev) = c.insert((0x3000, 100), 3);
        assert_eq!(ev, vec![2], "b was used least recently");
        assert_eq!(c.bytes, 200);
    }

    #[test]
    fn invalidated_entries_are_never_reused_and_go_with_their_last_user() {
        let mut c = RegCache::new(true, 1 << 20);
        let (id, _) = c.insert((0x1000, 4096), 1u32);
        assert!(c.invalidate(0x1800, 1).is_empty(), "still in use");
        assert!(c.hit((0x1000, 4096)).is_none(), "stale entries are not reused");
        assert_eq!(c.release(id), vec![1]);
        assert_eq!(c.bytes, 0);
        let (id2, _) = c.insert((0x1000, 4096), 2);
        c.release(id2);
        assert_eq!(c.invalidate(0, 0x1001).len(), 1);
        assert!(c.entries.is_empty() && c.index.is_empty());
    }
}
