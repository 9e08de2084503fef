//! Where the ranks find each other: the [`Rendezvous`] trait and [`StoreRendezvous`], through
//! the crate's TCP store.

use super::config::GroupKey;
use crate::store::StoreClient;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Where the ranks find each other: the store, or addresses exchanged by someone else.
pub trait Rendezvous {
    /// Publishes this rank's card (its mesh address, and what else the ranks must agree on
    /// before they connect: see `Communicator::join`) and returns every rank's, in rank order,
    /// waiting at most until `deadline`; the error names the ranks that never showed up.
    /// Cards are opaque single-line strings to the rendezvous.
    fn exchange(&mut self, rank: usize, world: usize, mine: &str, deadline: Instant) -> Result<Vec<String>, String>;
}

/// [`Rendezvous`] through the crate's TCP store.
pub struct StoreRendezvous {
    client: StoreClient,
    addr: SocketAddr,
    prefix: String,
}

impl StoreRendezvous {
    /// Connects to the store at `addr` (retrying until `deadline`); keys go under `prefix`.
    pub fn connect(addr: SocketAddr, prefix: &str, deadline: Instant) -> Result<Self, String> {
        Ok(StoreRendezvous { client: StoreClient::connect(addr, deadline)?, addr, prefix: prefix.to_string() })
    }
}

impl Rendezvous for StoreRendezvous {
    fn exchange(&mut self, rank: usize, world: usize, mine: &str, deadline: Instant) -> Result<Vec<String>, String> {
        self.client.set(&format!("{}/addr/{rank}", self.prefix), mine.as_bytes())?;
        let mut out = Vec::with_capacity(world);
        let mut missing = Vec::new();
        let mut note = String::new();
        for r in 0..world {
            if r == rank {
                out.push(mine.to_string());
                continue;
            }
            let key = format!("{}/addr/{r}", self.prefix);
            if !missing.is_empty() {
                // After one timeout, only ask which others are missing too.
                let probe = StoreClient::connect(self.client_addr(), Instant::now() + Duration::from_secs(1))
                    .and_then(|mut p| p.get(&key, Instant::now() + Duration::from_millis(20)));
                if !matches!(probe, Ok(Some(_))) {
                    missing.push(r);
                }
                continue;
            }
            match self.client.get(&key, deadline) {
                Ok(Some(v)) => out.push(String::from_utf8(v).map_err(|_| format!("rank {r} published an unreadable card"))?),
                Ok(None) => {
                    missing.push(r);
                    if let Ok(c) = StoreClient::connect(self.client_addr(), Instant::now() + Duration::from_secs(1)) {
                        self.client = c;
                    }
                }
                Err(e) => {
                    // The store went away while this rank waited (rank 0 gave up first).
                    missing.push(r);
                    note = format!("; then the store closed: {e}");
                }
            }
        }
        if missing.is_empty() {
            Ok(out)
        } else {
            Err(format!(
                "rank(s) {missing:?} never joined: their addresses did not appear in the store within the timeout{note} (are \
                 all {world} ranks started with the same MASTER_ADDR/MASTER_PORT? raise MOBIUS_TIMEOUT if they start late)"
            ))
        }
    }
}

impl StoreRendezvous {
    fn client_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The group's identity and fresh secret: rank 0 draws them and sets them in the store,
    /// the others read them (waiting until `deadline`).
    pub fn group(&mut self, rank: usize, deadline: Instant) -> Result<GroupKey, String> {
        let key = format!("{}/group", self.prefix);
        if rank == 0 {
            let g = GroupKey::generate().map_err(|e| e.to_string())?;
            self.client.set(&key, g.encode().as_bytes())?;
            return Ok(g);
        }
        match self.client.get(&key, deadline)? {
            Some(v) => GroupKey::decode(&String::from_utf8_lossy(&v))
                .ok_or_else(|| "the group key in the store is unreadable (another program uses this store?)".to_string()),
            None => Err("rank 0 did not publish the group key within the timeout (is rank 0 running? raise MOBIUS_TIMEOUT \
                         if it starts late)"
                .into()),
        }
    }
}
