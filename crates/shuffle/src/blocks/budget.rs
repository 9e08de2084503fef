//! The bound on rendezvous bytes being transferred at once, for a loop that never blocks.

use parking_lot::Mutex;
use rdma_shuffle_fabric::memory::pool::ReleaseHook;
use std::fmt;
use std::sync::{Arc, Weak};

/// Bytes of rendezvous blocks in flight (being read, or delivered and not yet dropped by the
/// consumer). A guard gives its bytes back on drop and tells the loop, which may be waiting
/// for room.
pub(crate) struct ByteBudget {
    max: u64,
    used: Mutex<u64>,
    hook: Mutex<Option<Weak<dyn ReleaseHook>>>,
}

impl ByteBudget {
    pub(crate) fn new(max: u64) -> Arc<Self> {
        Arc::new(ByteBudget { max: max.max(1), used: Mutex::new(0), hook: Mutex::new(None) })
    }

    /// Who to tell when bytes come back.
    pub(crate) fn set_hook(&self, hook: Weak<dyn ReleaseHook>) {
        *self.hook.lock() = Some(hook);
    }

    /// `n` bytes if they fit now (a single block larger than the whole budget goes alone).
    pub(crate) fn try_acquire(self: &Arc<Self>, n: u64) -> Option<BudgetGuard> {
        let mut used = self.used.lock();
        if *used > 0 && *used + n > self.max {
            return None;
        }
        *used += n;
        Some(BudgetGuard { budget: self.clone(), n })
    }

    /// Bytes reserved now.
    pub(crate) fn used(&self) -> u64 {
        *self.used.lock()
    }
}

/// Bytes reserved from the in-flight budget until dropped.
pub struct BudgetGuard {
    budget: Arc<ByteBudget>,
    n: u64,
}

impl fmt::Debug for BudgetGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BudgetGuard({} bytes)", self.n)
    }
}

impl Drop for BudgetGuard {
    fn drop(&mut self) {
        *self.budget.used.lock() -= self.n;
        let hook = self.budget.hook.lock().as_ref().and_then(Weak::upgrade);
        if let Some(h) = hook {
            h.released();
        }
    }
}
