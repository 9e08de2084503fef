//! Where the ranks find each other: the [`Rendezvous`] trait and [`StoreRendezvous`], through
//! the crate's TCP store.

use crate::store::StoreClient;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Where the ranks find each other: the store, or addresses exchanged by someone else.
pub trait Rendezvous {
    /// Publishes this rank's mesh address and returns every rank's, in rank order, waiting
    /// at most until `deadline`; the error names the ranks that never showed up.
    fn exchange(&mut self, rank: usize, world: usize, mine: SocketAddr, deadline: Instant) -> Result<Vec<SocketAddr>, String>;
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
    fn exchange(&mut self, rank: usize, world: usize, mine: SocketAddr, deadline: Instant) -> Result<Vec<SocketAddr>, String> {
        self.client.set(&format!("{}/addr/{rank}", self.prefix), mine.to_string().as_bytes())?;
        let mut out = Vec::with_capacity(world);
        let mut missing = Vec::new();
        let mut note = String::new();
        for r in 0..world {
            if r == rank {
                out.push(mine);
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
                Ok(Some(v)) => out.push(
                    String::from_utf8_lossy(&v).parse().map_err(|_| format!("rank {r} published an unreadable address {v:?}"))?,
                ),
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
}
