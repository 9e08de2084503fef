//! The block server: Spark's committed map outputs, served to remote executors through a
//! fabric [`ServerEndpoint`].
//!
//! Nothing is registered with a device when a map output is registered: a rendezvous block
//! is exposed by the driver per request, to the one authenticated peer that asked for it,
//! until that peer releases it (see `rdma_shuffle_fabric::driver`).

use crate::blocks::{BlockSource, ServerEndpoint, ServerEndpointConfig, ServerStats};
use crate::store::{
    CorruptIndexPolicy, MapId, MapOutput, MapOutputFiles, MapOutputId, MapOutputStore, ShuffleId, StoreConfig, StoreError,
    StoreErrorClass,
};
use parking_lot::RwLock;
use rdma_shuffle_fabric::{Driver, DriverConfig, FabricError, Provider, Source};
use rdma_shuffle_wire::{BlockFailure, BlockSpan, FailureCode, Resolved};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use thiserror::Error;

/// A registered map output seen as a fabric [`Source`]: its data file, read with `pread` or
/// sent with `sendfile`, never through a CPU mapping (see the store's module docs).
#[derive(Debug)]
struct FileOutput(Arc<MapOutput>);

impl Source for FileOutput {
    fn len(&self) -> u64 {
        self.0.data_len()
    }
    fn read_at(&self, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        self.0.read_at(offset, dst).map_err(std::io::Error::other)
    }
    fn file(&self) -> std::io::Result<Option<Arc<std::fs::File>>> {
        self.0.file().map_err(std::io::Error::other)
    }
}

struct Exposed {
    id: MapOutputId,
    source: Arc<dyn Source>,
}

/// Errors of registering map outputs.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The files could not be registered.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The endpoint could not start.
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

struct Catalog {
    store: MapOutputStore,
    exposed: RwLock<HashMap<(ShuffleId, MapId), Exposed>>,
    name: String,
}

impl Catalog {
    fn failure(&self, span: &BlockSpan, e: StoreError) -> BlockFailure {
        let code = match (&e, e.class()) {
            (StoreError::UnknownShuffle { .. }, _) => FailureCode::UnknownGroup,
            (_, StoreErrorClass::NotFound) => FailureCode::UnknownObject,
            (_, StoreErrorClass::BadRequest) => FailureCode::BadRange,
            (_, StoreErrorClass::CorruptOutput) => FailureCode::Corrupt,
            (_, StoreErrorClass::Io) => FailureCode::Io,
        };
        BlockFailure::new(code, format!("executor {} cannot serve {span}: {e}", self.name))
    }
}

impl BlockSource for Catalog {
    fn resolve(&self, span: &BlockSpan) -> Result<Resolved<Arc<dyn Source>>, BlockFailure> {
        let slice = self.store.resolve(span.group, span.object, span.start, span.end).map_err(|e| self.failure(span, e))?;
        let exposed = self.exposed.read();
        let e = exposed
            .get(&(span.group, span.object))
            .filter(|e| e.id == slice.id())
            // Only registered outputs of live shuffles are ever exposed; a resolve racing an
            // unregister or a re-registration is answered as unknown, never with stale bytes.
            .ok_or_else(|| self.failure(span, StoreError::UnknownMapOutput { shuffle_id: span.group, map_id: span.object }))?;
        Ok(Resolved { source: e.source.clone(), offset: slice.offset(), len: slice.len() })
    }
}

/// Serves the map outputs registered with it to remote [`crate::BlockClient`]s.
pub struct BlockServer {
    catalog: Arc<Catalog>,
    endpoint: ServerEndpoint,
}

impl BlockServer {
    /// Starts serving on `addr` through `provider`, on a driver (event loop) of its own.
    pub fn bind(provider: Arc<dyn Provider>, addr: SocketAddr, config: ServerEndpointConfig) -> Result<Self, ServerError> {
        let driver = Driver::new(provider, DriverConfig { name: config.name.clone(), ..DriverConfig::default() })?;
        Self::bind_on(&driver, addr, config)
    }

    /// Starts serving on `addr` on `driver` (an engine's loop, shared with its client).
    pub fn bind_on(driver: &Driver, addr: SocketAddr, config: ServerEndpointConfig) -> Result<Self, ServerError> {
        Self::bind_on_with_files(driver, addr, config, crate::store::DEFAULT_MAX_OPEN_FILES)
    }

    /// [`bind_on`](Self::bind_on), keeping at most `max_open_files` data files open
    /// ([`StoreConfig::max_open_files`]).
    pub fn bind_on_with_files(
        driver: &Driver,
        addr: SocketAddr,
        config: ServerEndpointConfig,
        max_open_files: usize,
    ) -> Result<Self, ServerError> {
        let catalog = Arc::new(Catalog {
            // A corrupt index is kept and every fetch from it fails with the exact reason, so
            // the reducer's FetchFailedException says what is wrong (and Spark recomputes the
            // map task) instead of a bare "unknown map output".
            store: MapOutputStore::with_config(StoreConfig {
                corrupt_index: CorruptIndexPolicy::FailResolves,
                max_open_files,
                ..StoreConfig::default()
            }),
            name: config.name.clone(),
            exposed: RwLock::new(HashMap::new()),
        });
        let endpoint = ServerEndpoint::bind(driver, addr, config, catalog.clone())?;
        Ok(BlockServer { catalog, endpoint })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr()
    }

    /// Registers a committed map output (Spark's data and index files), replacing an
    /// earlier registration of the same `(shuffle, map)`.
    pub fn register(&self, files: MapOutputFiles) -> Result<(), ServerError> {
        let (shuffle_id, map_id) = (files.shuffle_id, files.map_id);
        let output = self.catalog.store.register(files)?;
        let source: Arc<dyn Source> = Arc::new(FileOutput(output.clone()));
        self.catalog.exposed.write().insert((shuffle_id, map_id), Exposed { id: output.id(), source });
        tracing::debug!(shuffle_id, map_id, bytes = output.data_len(), "map output registered");
        Ok(())
    }

    /// Drops every map output of `shuffle_id`; returns how many there were. Later requests
    /// for them fail; a region already handed to a client stays readable by that client
    /// until it releases it (its bytes stay mapped until then).
    pub fn unregister_shuffle(&self, shuffle_id: ShuffleId) -> usize {
        let n = self.catalog.store.unregister_shuffle(shuffle_id);
        let mut ex = self.catalog.exposed.write();
        ex.retain(|(s, _), _| *s != shuffle_id);
        n
    }

    /// The store of registered outputs.
    pub fn store(&self) -> &MapOutputStore {
        &self.catalog.store
    }

    /// Serving counters.
    pub fn stats(&self) -> &Arc<ServerStats> {
        self.endpoint.stats()
    }

    /// The block protocol's counters of this server's loop (exposure budget, pending
    /// handshakes, deliveries).
    pub fn loop_stats(&self) -> &crate::blocks::BlockLoopStats {
        self.endpoint.loop_stats()
    }

    /// The driver (event loop) serving this server.
    pub fn driver(&self) -> &Driver {
        self.endpoint.driver()
    }

    /// Open client connections.
    pub fn connections(&self) -> usize {
        self.endpoint.connections()
    }

    /// Stops serving. Idempotent.
    pub fn shutdown(&self) {
        self.endpoint.shutdown();
    }
}
