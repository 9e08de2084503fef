//! What a mesh's callers and its connections in the driver loop share: the state of every
//! peer, the inboxes of messages by tag, completed sends, and the counters.
//!
//! The loop fills it (messages arrive, sends complete, links fail) and notifies; callers
//! wait on it with deadlines. The lock is never held across I/O or a copy of a payload.

use super::handshake::Handshaker;
use super::{MeshError, Message, Tag};
use parking_lot::{Condvar, Mutex, MutexGuard};
use rdma_shuffle_fabric::driver::ConnKey;
use rdma_shuffle_fabric::driver::Driver;
use rdma_shuffle_fabric::memory::pool::TieredPool;
use rdma_shuffle_fabric::providers::link::Fold;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Where a peer stands.
#[derive(Clone, Debug)]
pub(crate) enum PeerStatus {
    /// The mesh is being built and this link is not up yet.
    Joining,
    /// The link is up.
    Up,
    /// The peer closed its mesh.
    Left,
    /// The link failed; why.
    Failed(String),
}

pub(crate) struct Peer {
    pub(crate) status: PeerStatus,
    /// The link, once up.
    pub(crate) conn: Option<ConnKey>,
    /// Its address, for errors.
    pub(crate) name: String,
    /// Bytes a message from this peer waits for in the receive pool (the link stopped
    /// reading), for the error a caller's timeout reports.
    pub(crate) memory_wait: Option<u64>,
}

/// One message of an inbox: still arriving (a payload being read, an RDMA READ in flight),
/// or complete. Slots are created when a message starts to arrive, so messages under one
/// tag are taken in the order they were sent even when a later one completes first.
pub(crate) enum Slot {
    Pending(u64),
    Ready(Message),
}

/// A receive posted into the caller's memory ([`Mesh::post_recv`](super::Mesh::post_recv)),
/// by `(peer, tag)`.
pub(crate) enum Posted {
    /// Waits for its message: `(address, length)` of the caller's memory, the key a
    /// one-sided READ writes it with (verbs, when registered), and for a reducing receive
    /// how the message is reduced into the memory instead of written there.
    Waiting(usize, usize, Option<u32>, Option<Fold>),
    /// The loop is placing a message into it.
    Claimed,
    /// The message is in the caller's memory.
    Done,
    /// The link failed while the message was being placed; why.
    Failed(String),
}

/// Where an arriving message goes: a slot of the inbox, or a posted receive.
pub(crate) enum Dest {
    Slot(u64),
    /// The caller's memory, (one-sided) the key a READ writes it with, and (a reducing
    /// receive) how the message is reduced into it.
    Posted(rdma_shuffle_fabric::providers::link::UserBuf, Option<u32>, Option<Fold>),
}

/// Distinct problems kept while building the mesh (the error quotes them).
const MAX_PROBLEMS: usize = 32;

/// What building the mesh saw.
#[derive(Default)]
pub(crate) struct Build {
    /// Refusals and failures of connections that may yet be replaced, each once with how
    /// often it happened (a retried connect fails the same way every 50 ms).
    pub(crate) problems: Vec<(String, u32)>,
    /// A lower rank refused this one: building stops.
    pub(crate) fatal: Option<MeshError>,
    /// Lower ranks whose listener refused the connection: try again shortly.
    pub(crate) retry: Vec<usize>,
}

/// Why a group gave up: the rank that said so, the rank whose failure caused it (when
/// known), and its words.
#[derive(Clone, Debug)]
pub(crate) struct AbortNote {
    pub(crate) by: usize,
    pub(crate) culprit: Option<usize>,
    pub(crate) reason: String,
}

pub(crate) struct State {
    pub(crate) peers: Vec<Peer>,
    pub(crate) inbox: Vec<HashMap<Tag, VecDeque<Slot>>>,
    /// Sends `(peer, token)` whose buffer is no longer needed.
    pub(crate) done: HashSet<(usize, u64)>,
    /// Receives posted into callers' memory.
    pub(crate) posted: HashMap<(usize, Tag), Posted>,
    /// The group gave up: the first abort seen (a peer's, this rank's own, or the loop's
    /// when a link died).
    pub(crate) abort: Option<AbortNote>,
    pub(crate) closed: bool,
    pub(crate) build: Build,
    next_slot: u64,
}

impl State {
    /// Whether a message from `peer` under `tag` is queued (arriving or arrived).
    pub(crate) fn queued(&self, peer: usize, tag: Tag) -> bool {
        self.inbox[peer].get(&tag).is_some_and(|q| !q.is_empty())
    }

    /// Queues a slot for a message from `peer` under `tag` that starts to arrive.
    fn open_slot(&mut self, peer: usize, tag: Tag) -> u64 {
        let id = self.next_slot;
        self.next_slot += 1;
        self.inbox[peer].entry(tag).or_default().push_back(Slot::Pending(id));
        id
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) eager_sent: AtomicU64,
    pub(crate) eager_sent_bytes: AtomicU64,
    pub(crate) rendezvous_sent: AtomicU64,
    pub(crate) rendezvous_sent_bytes: AtomicU64,
    pub(crate) eager_received: AtomicU64,
    pub(crate) eager_received_bytes: AtomicU64,
    pub(crate) rendezvous_received: AtomicU64,
    pub(crate) rendezvous_received_bytes: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) registration_hits: AtomicU64,
    pub(crate) registrations: AtomicU64,
    pub(crate) placed: AtomicU64,
    pub(crate) placed_bytes: AtomicU64,
    pub(crate) folded: AtomicU64,
    pub(crate) folded_bytes: AtomicU64,
    pub(crate) staged: AtomicU64,
    pub(crate) staged_bytes: AtomicU64,
    pub(crate) eager_in_place: AtomicU64,
    pub(crate) joined: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A mesh's shared part.
pub(crate) struct MeshShared {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) hs: Handshaker,
    pub(crate) eager_limit: usize,
    pub(crate) max_message: usize,
    /// Limit for one connection's handshake (see [`MeshConfig::handshake_timeout`](super::MeshConfig)).
    pub(crate) handshake_timeout: std::time::Duration,
    /// Buffers for messages that arrive before a receive names their destination.
    pub(crate) pool: TieredPool,
    state: Mutex<State>,
    pub(crate) cond: Condvar,
    pub(crate) counters: Counters,
}

impl MeshShared {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        hs: Handshaker,
        eager_limit: usize,
        max_message: usize,
        pool: TieredPool,
        names: Vec<String>,
        handshake_timeout: std::time::Duration,
    ) -> Self {
        let (rank, world) = (hs.rank, hs.world);
        let peers = names
            .into_iter()
            .enumerate()
            .map(|(p, name)| Peer {
                status: if p == rank { PeerStatus::Up } else { PeerStatus::Joining },
                conn: None,
                name,
                memory_wait: None,
            })
            .collect();
        MeshShared {
            rank,
            world,
            hs,
            eager_limit,
            max_message,
            handshake_timeout,
            pool,
            state: Mutex::new(State {
                peers,
                inbox: (0..world).map(|_| HashMap::new()).collect(),
                done: HashSet::new(),
                posted: HashMap::new(),
                abort: None,
                closed: false,
                build: Build::default(),
                next_slot: 1,
            }),
            cond: Condvar::new(),
            counters: Counters::default(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Waits on the state until `deadline`; `true` when the deadline passed.
    pub(crate) fn wait_until(&self, st: &mut MutexGuard<'_, State>, deadline: Instant) -> bool {
        self.cond.wait_until(st, deadline).timed_out()
    }

    /// Waits until `take` answers from the state, at most until `deadline` (`None`: it
    /// passed). The calling thread runs `driver`'s loop meanwhile (no hand-off to the loop
    /// thread and back: see the driver's progress module); once the deadline passed or the
    /// loop stopped (its links failed), what is left is waited out on the state itself.
    pub(crate) fn wait_for<R>(
        &self,
        driver: &Driver,
        deadline: Instant,
        mut take: impl FnMut(&mut MutexGuard<'_, State>) -> Option<R>,
    ) -> Option<R> {
        if let Some(r) = driver.progress(deadline, || take(&mut self.lock())) {
            return Some(r);
        }
        let mut st = self.lock();
        loop {
            if let Some(r) = take(&mut st) {
                return Some(r);
            }
            if Instant::now() >= deadline {
                return None;
            }
            self.wait_until(&mut st, deadline);
        }
    }

    fn notify(&self) {
        self.cond.notify_all();
    }

    // ---------------------------------------------------------------- used by the loop

    /// A message from `peer` under `tag` starts to arrive; its slot keeps its place.
    pub(crate) fn open_slot(&self, peer: usize, tag: Tag) -> u64 {
        self.state.lock().open_slot(peer, tag)
    }

    /// A message of `len` bytes from `peer` under `tag` starts to arrive: it goes straight
    /// into a receive posted for it, when one of that length waits and no earlier message
    /// under the tag is queued (messages under one tag keep their order); else into a slot.
    /// `read`: the message is to be READ one-sided, which needs the receive's write key (and
    /// cannot be reduced on its way: a reducing receive is not claimed for a READ). `folds`:
    /// the link can reduce the message on its way in; a reducing receive is claimed only then.
    pub(crate) fn open_slot_or_claim(&self, peer: usize, tag: Tag, len: u64, read: bool, folds: bool) -> Dest {
        let mut st = self.state.lock();
        if !st.queued(peer, tag) {
            if let Some(p) = st.posted.get_mut(&(peer, tag)) {
                if let Posted::Waiting(ptr, plen, lkey, fold) = p {
                    let (ptr, plen, lkey) = (*ptr, *plen, *lkey);
                    let claim = if read { lkey.is_some() && fold.is_none() } else { fold.is_none() || folds };
                    if plen as u64 == len && len > 0 && claim {
                        let fold = fold.take();
                        *p = Posted::Claimed;
                        // SAFETY: the poster keeps the memory and leaves it alone until the
                        // receive is done or failed (`Mesh::post_recv`).
                        let buf = unsafe { rdma_shuffle_fabric::providers::link::UserBuf::new(ptr as *mut u8, plen) };
                        return Dest::Posted(buf, lkey, fold);
                    }
                }
            }
        }
        Dest::Slot(st.open_slot(peer, tag))
    }

    /// The posted receive `(peer, tag)` holds its message, or failed (`Some(why)`).
    pub(crate) fn posted_end(&self, peer: usize, tag: Tag, failed: Option<String>) {
        let mut st = self.state.lock();
        if let Some(p) = st.posted.get_mut(&(peer, tag)) {
            *p = match failed {
                None => Posted::Done,
                Some(why) => Posted::Failed(why),
            };
        }
        drop(st);
        self.notify();
    }

    /// The message of slot `id` is complete.
    pub(crate) fn fill_slot(&self, peer: usize, tag: Tag, id: u64, m: Message) {
        let mut st = self.state.lock();
        if let Some(q) = st.inbox[peer].get_mut(&tag) {
            if let Some(s) = q.iter_mut().find(|s| matches!(s, Slot::Pending(x) if *x == id)) {
                *s = Slot::Ready(m);
            }
        }
        drop(st);
        self.notify();
    }

    /// A whole message arrived.
    pub(crate) fn push_ready(&self, peer: usize, tag: Tag, m: Message) {
        self.state.lock().inbox[peer].entry(tag).or_default().push_back(Slot::Ready(m));
        self.notify();
    }

    /// The send `(peer, token)` no longer needs its buffer.
    pub(crate) fn send_done(&self, peer: usize, token: u64) {
        self.state.lock().done.insert((peer, token));
        self.notify();
    }

    /// The link to `peer` is up on `conn`; `false` if it already was (a duplicate).
    pub(crate) fn peer_up(&self, peer: usize, conn: ConnKey, name: String) -> bool {
        let mut st = self.state.lock();
        let p = &mut st.peers[peer];
        if !matches!(p.status, PeerStatus::Joining) {
            return false;
        }
        p.status = PeerStatus::Up;
        p.conn = Some(conn);
        p.name = name;
        drop(st);
        self.notify();
        true
    }

    /// The link `conn` to `peer` failed (ignored if it is not the peer's link, or the mesh
    /// is closed, or the peer had left). Returns the abort the loop must tell the other
    /// peers about when this is news: the cause travels first, so every survivor's waits
    /// fail naming `peer` (not a survivor that gave up because of it), and it reaches them
    /// before this rank's callers wake and take back what they lent.
    pub(crate) fn peer_failed(&self, peer: usize, conn: ConnKey, why: String) -> Option<AbortNote> {
        let mut st = self.state.lock();
        let closed = st.closed;
        let p = &mut st.peers[peer];
        let mut note = None;
        if p.conn == Some(conn) && matches!(p.status, PeerStatus::Up) && !closed {
            tracing::debug!(rank = self.rank, peer, why = %why, "mesh link failed");
            let reason = format!("rank {} saw its link to rank {peer} ({}) fail: {why}", self.rank, p.name);
            p.status = PeerStatus::Failed(why);
            if st.abort.is_none() {
                let n = AbortNote { by: self.rank, culprit: Some(peer), reason };
                st.abort = Some(n.clone());
                note = Some(n);
            }
        }
        drop(st);
        self.notify();
        note
    }

    /// `peer` said goodbye.
    pub(crate) fn peer_left(&self, peer: usize) {
        let mut st = self.state.lock();
        if matches!(st.peers[peer].status, PeerStatus::Up) {
            st.peers[peer].status = PeerStatus::Left;
        }
        drop(st);
        self.notify();
    }

    /// A message from `peer` waits for `bytes` of receive memory (`None`: no longer).
    pub(crate) fn memory_wait(&self, peer: usize, bytes: Option<u64>) {
        self.state.lock().peers[peer].memory_wait = bytes;
    }

    /// Rank `by` aborted (because rank `culprit` failed, when it says so).
    pub(crate) fn aborted(&self, by: usize, culprit: Option<usize>, reason: String) {
        let mut st = self.state.lock();
        if st.abort.is_none() {
            st.abort = Some(AbortNote { by, culprit, reason });
        }
        drop(st);
        self.notify();
    }

    /// A connection made while building failed or was refused.
    pub(crate) fn build_problem(&self, problem: String, fatal: Option<MeshError>, retry: Option<usize>) {
        let mut st = self.state.lock();
        if let Some(f) = fatal {
            st.build.fatal.get_or_insert(f);
        }
        if let Some(r) = retry {
            st.build.retry.push(r);
        }
        if !problem.is_empty() {
            let problems = &mut st.build.problems;
            match problems.iter().position(|(p, _)| *p == problem) {
                Some(i) => problems[i].1 = problems[i].1.saturating_add(1),
                // Distinct problems are few (one or two per peer); the bound only guards
                // against a stranger varying what it sends.
                None if problems.len() < MAX_PROBLEMS => problems.push((problem, 1)),
                None => {}
            }
        }
        drop(st);
        self.notify();
    }

    // ---------------------------------------------------------------- used by callers

    /// The error for `peer`, if waiting on it cannot succeed.
    pub(crate) fn check(&self, st: &State, peer: usize) -> Result<(), MeshError> {
        if st.closed {
            return Err(MeshError::Closed { rank: self.rank });
        }
        if let Some(a) = &st.abort {
            // A wait on the rank that failed reports its link's failure itself.
            if let (Some(c), PeerStatus::Failed(reason)) = (a.culprit, &st.peers[peer].status) {
                if c == peer {
                    return Err(MeshError::PeerFailed {
                        rank: self.rank,
                        peer,
                        addr: st.peers[peer].name.clone(),
                        reason: reason.clone(),
                    });
                }
            }
            return Err(MeshError::Aborted { rank: self.rank, by: a.by, culprit: a.culprit, peer, reason: a.reason.clone() });
        }
        match &st.peers[peer].status {
            PeerStatus::Up | PeerStatus::Joining => Ok(()),
            PeerStatus::Left => Err(MeshError::PeerLeft { rank: self.rank, peer }),
            PeerStatus::Failed(reason) => {
                Err(MeshError::PeerFailed { rank: self.rank, peer, addr: st.peers[peer].name.clone(), reason: reason.clone() })
            }
        }
    }

    /// The error for a wait on `peer` that reached its deadline: a timeout, or the memory
    /// shortage that held its message back.
    pub(crate) fn timed_out(&self, st: &State, peer: usize, what: &'static str, started: Instant) -> MeshError {
        let waited_ms = started.elapsed().as_millis() as u64;
        if let Some(bytes) = st.peers[peer].memory_wait {
            let p = self.pool.stats();
            return MeshError::Memory {
                rank: self.rank,
                message: format!(
                    "timed out after {waited_ms} ms waiting for {what} from rank {peer}: its next message needs {bytes} bytes of \
                     receive memory and {} of {} bytes are held by messages not yet consumed; raise MOBIUS_POOL_BYTES",
                    p.bytes_in_use,
                    self.pool.config().cap_bytes
                ),
            };
        }
        MeshError::Timeout { rank: self.rank, peer, what, waited_ms }
    }

    /// Takes the first message of `(peer, tag)` if it is complete.
    pub(crate) fn take(st: &mut State, peer: usize, tag: Tag) -> Option<Message> {
        let q = st.inbox[peer].get_mut(&tag)?;
        if !matches!(q.front(), Some(Slot::Ready(_))) {
            return None;
        }
        let m = match q.pop_front() {
            Some(Slot::Ready(m)) => Some(m),
            _ => None,
        };
        if q.is_empty() {
            st.inbox[peer].remove(&tag);
        }
        m
    }
}
