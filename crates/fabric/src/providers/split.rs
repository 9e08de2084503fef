//! Two providers behind one: each connection goes over the *near* provider (shared memory,
//! for peers on this host) or the *far* one (tcp, verbs: everyone else), chosen per peer.
//!
//! A group spread over several hosts with several ranks on each (`torchrun --nnodes 2
//! --nproc-per-node 4`) then reduces inside a host over shared memory and across hosts over
//! the network — what Open MPI does by picking a transport per peer — instead of running
//! every link over the network provider because one peer is elsewhere.
//!
//! It is a combinator, not a provider of its own: it listens with both (the far provider
//! first, which picks the port, then the near one at the same address, so a peer reaches
//! either with the one address it published) and accepts from both, and its engine routes each
//! outgoing connection by the peer's address ([`SplitProvider::route`], set once the
//! addresses are known and before the first connect). Both ends of a link decide from the same
//! published information, so they agree; a connection arriving over either provider is
//! authenticated by the protocol above like any other.

use super::link::{EngineCtx, Link, Listener, ProviderCounters, ProviderEngine};
use super::{Provider, ProviderCapabilities, UserRegion};
use crate::error::FabricError;
use crate::memory::registration::Registrar;
use mio::{Registry, Token};
use parking_lot::RwLock;
use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

/// Which peers go over the near provider.
#[derive(Debug, Default)]
struct Routes {
    near: HashSet<SocketAddr>,
    /// Every peer is near (no far connection will be made).
    all_near: bool,
}

/// Two providers, chosen per peer: see the [module docs](self).
pub struct SplitProvider {
    near: Arc<dyn Provider>,
    far: Arc<dyn Provider>,
    routes: Arc<RwLock<Routes>>,
    /// `near+far`, for a group that uses both.
    both: &'static str,
}

impl fmt::Debug for SplitProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SplitProvider")
            .field("near", &self.near.name())
            .field("far", &self.far.name())
            .field("routes", &*self.routes.read())
            .finish()
    }
}

impl SplitProvider {
    /// `near` for the peers [`route`](Self::route) names, `far` for the others (all of them
    /// until then). Neither may read one-sidedly: rendezvous is pulled on both kinds of link
    /// (a one-sided far provider, verbs, keeps a group to itself).
    pub fn new(near: Arc<dyn Provider>, far: Arc<dyn Provider>) -> Result<Self, FabricError> {
        if near.capabilities().one_sided || far.capabilities().one_sided {
            return Err(FabricError::Unsupported(format!(
                "providers {} and {} cannot be split per peer: one of them reads one-sidedly",
                near.name(),
                far.name()
            )));
        }
        let both = joined_name(near.name(), far.name());
        Ok(SplitProvider { near, far, routes: Arc::default(), both })
    }

    /// From now on, connections to the addresses in `near` go over the near provider; `all`
    /// says they are every peer there is (for [`name`](Provider::name)).
    pub fn route(&self, near: HashSet<SocketAddr>, all: bool) {
        *self.routes.write() = Routes { all_near: all && !near.is_empty(), near };
    }
}

impl Provider for SplitProvider {
    /// The near provider's name when every peer is near, the far one's when none is, and
    /// both joined (`shm+tcp`) for a mixture.
    fn name(&self) -> &'static str {
        let r = self.routes.read();
        match (r.all_near, r.near.is_empty()) {
            (true, _) => self.near.name(),
            (false, true) => self.far.name(),
            (false, false) => self.both,
        }
    }

    /// As [`name`](Provider::name): the near provider's when every peer is near, the far
    /// one's when none is; for a mixture, what both can do (two-sided, the smaller eager
    /// bound, CPU copies and in-place records only where both have them).
    fn capabilities(&self) -> ProviderCapabilities {
        let (n, f) = (self.near.capabilities(), self.far.capabilities());
        let r = self.routes.read();
        match (r.all_near, r.near.is_empty()) {
            (true, _) => n,
            (false, true) => f,
            (false, false) => ProviderCapabilities {
                one_sided: n.one_sided && f.one_sided,
                max_eager: match (n.max_eager, f.max_eager) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                },
                cpu_copies: n.cpu_copies && f.cpu_copies,
                record_body: n.record_body.zip(f.record_body).map(|(a, b)| a.min(b)),
            },
        }
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        self.far.registrar()
    }

    fn engine(&self, ctx: EngineCtx<'_>) -> Result<Box<dyn ProviderEngine>, FabricError> {
        let near = self.near.engine(EngineCtx {
            name: ctx.name,
            registry: ctx.registry,
            token: ctx.token,
            notify: ctx.notify.clone(),
            counters: ctx.counters.clone(),
        })?;
        let far = self.far.engine(ctx)?;
        Ok(Box::new(SplitEngine { near, far, routes: self.routes.clone() }))
    }

    fn counters(&self, driver: &ProviderCounters) -> Vec<(&'static str, u64)> {
        let mut c = self.far.counters(driver);
        c.extend(self.near.counters(driver));
        c
    }

    unsafe fn register_user(&self, ptr: *const u8, len: usize) -> Result<Option<Arc<dyn UserRegion>>, FabricError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.far.register_user(ptr, len) }
    }

    fn registered_bytes(&self) -> u64 {
        self.far.registered_bytes() + self.near.registered_bytes()
    }
}

/// `near+far` as a `'static` name: each distinct pair is made once per process (a process
/// builds a handful), so names cost no allocation per call and no leak per group.
fn joined_name(near: &str, far: &str) -> &'static str {
    static NAMES: parking_lot::Mutex<Vec<&'static str>> = parking_lot::Mutex::new(Vec::new());
    let want = format!("{near}+{far}");
    let mut names = NAMES.lock();
    if let Some(n) = names.iter().find(|n| **n == want) {
        return n;
    }
    let n: &'static str = Box::leak(want.into_boxed_str());
    names.push(n);
    n
}

struct SplitEngine {
    near: Box<dyn ProviderEngine>,
    far: Box<dyn ProviderEngine>,
    routes: Arc<RwLock<Routes>>,
}

impl ProviderEngine for SplitEngine {
    fn connect(&mut self, addr: SocketAddr) -> Result<Box<dyn Link>, FabricError> {
        if self.routes.read().near.contains(&addr) {
            self.near.connect(addr)
        } else {
            self.far.connect(addr)
        }
    }

    fn listen(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
        notify_key: u64,
    ) -> Result<(SocketAddr, Box<dyn Listener>), FabricError> {
        let (local, far) = self.far.listen(addr, registry, token, notify_key)?;
        match self.near.listen(local, registry, token, notify_key) {
            Ok((_, near)) => Ok((local, Box::new(SplitListener { near, far }))),
            Err(e) => {
                let mut far = far;
                far.close(registry);
                Err(e)
            }
        }
    }

    fn poll_completions(&mut self) -> Vec<u64> {
        let mut keys = self.far.poll_completions();
        keys.extend(self.near.poll_completions());
        keys
    }

    fn registered_bytes(&self) -> u64 {
        self.far.registered_bytes() + self.near.registered_bytes()
    }
}

/// Both listeners under one token: a readiness of either is answered by accepting from both.
struct SplitListener {
    near: Box<dyn Listener>,
    far: Box<dyn Listener>,
}

impl Listener for SplitListener {
    fn accept(&mut self) -> Option<(String, Box<dyn Link>)> {
        self.far.accept().or_else(|| self.near.accept())
    }

    fn close(&mut self, registry: &Registry) {
        self.far.close(registry);
        self.near.close(registry);
    }
}
