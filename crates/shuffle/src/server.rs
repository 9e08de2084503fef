//! The block server: Spark's committed map outputs, exposed to remote executors through a
//! fabric [`ServerEndpoint`].

use crate::store::{
    CorruptIndexPolicy, MapId, MapOutput, MapOutputFiles, MapOutputId, MapOutputStore, ShuffleId, StoreConfig, StoreError,
    StoreErrorClass,
};
use parking_lot::RwLock;
use rdma_shuffle_fabric::{
    BlockSource, FabricError, Provider, ServerEndpoint, ServerEndpointConfig, ServerStats, Source, SourceKeys,
};
use rdma_shuffle_wire::{BlockFailure, BlockSpan, FailureCode, Resolved};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use thiserror::Error;

/// A registered map output seen as a fabric [`Source`]: its mapped data file and descriptor.
#[derive(Debug)]
struct MappedOutput(Arc<MapOutput>);

impl Source for MappedOutput {
    fn as_bytes(&self) -> &[u8] {
        self.0.mapped()
    }
    fn raw_fd(&self) -> Option<RawFd> {
        self.0.file().map(|f| f.as_raw_fd())
    }
}

struct Exposed {
    id: MapOutputId,
    source: Arc<dyn Source>,
    keys: SourceKeys,
}

/// Errors of registering map outputs.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The files could not be registered.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The provider could not expose the data file (e.g. memory registration failed).
    #[error("exposing shuffle {shuffle_id} map {map_id}: {source}")]
    Expose {
        /// Shuffle id.
        shuffle_id: ShuffleId,
        /// Map id.
        map_id: MapId,
        /// What the provider said.
        #[source]
        source: FabricError,
    },
    /// The endpoint could not start.
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

struct Catalog {
    store: MapOutputStore,
    provider: Arc<dyn Provider>,
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
        Ok(Resolved {
            source: e.source.clone(),
            offset: slice.offset(),
            len: slice.len(),
            addr: e.keys.addr + slice.offset(),
            rkey: e.keys.rkey,
        })
    }
}

/// Serves the map outputs registered with it to remote [`crate::BlockClient`]s.
pub struct BlockServer {
    catalog: Arc<Catalog>,
    endpoint: ServerEndpoint,
}

impl BlockServer {
    /// Starts serving on `addr` through `provider`.
    pub fn bind(provider: Arc<dyn Provider>, addr: SocketAddr, config: ServerEndpointConfig) -> Result<Self, ServerError> {
        let catalog = Arc::new(Catalog {
            // A corrupt index is kept and every fetch from it fails with the exact reason, so
            // the reducer's FetchFailedException says what is wrong (and Spark recomputes the
            // map task) instead of a bare "unknown map output".
            store: MapOutputStore::with_config(StoreConfig {
                corrupt_index: CorruptIndexPolicy::FailResolves,
                ..StoreConfig::default()
            }),
            name: config.name.clone(),
            provider: provider.clone(),
            exposed: RwLock::new(HashMap::new()),
        });
        let endpoint = ServerEndpoint::bind(&*provider, addr, config, catalog.clone())?;
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
        let source: Arc<dyn Source> = Arc::new(MappedOutput(output.clone()));
        let keys = match self.catalog.provider.register_source(&source) {
            Ok(k) => k,
            Err(e) => {
                self.catalog.store.unregister_map_output(shuffle_id, map_id);
                return Err(ServerError::Expose { shuffle_id, map_id, source: e });
            }
        };
        let old = self.catalog.exposed.write().insert((shuffle_id, map_id), Exposed { id: output.id(), source, keys });
        if let Some(old) = old {
            self.catalog.provider.deregister_source(&old.keys);
        }
        tracing::debug!(shuffle_id, map_id, bytes = output.data_len(), "map output registered");
        Ok(())
    }

    /// Drops every map output of `shuffle_id`; returns how many there were. Their remote keys
    /// die with them.
    pub fn unregister_shuffle(&self, shuffle_id: ShuffleId) -> usize {
        let n = self.catalog.store.unregister_shuffle(shuffle_id);
        let gone: Vec<Exposed> = {
            let mut ex = self.catalog.exposed.write();
            let keys: Vec<_> = ex.keys().filter(|(s, _)| *s == shuffle_id).copied().collect();
            keys.into_iter().filter_map(|k| ex.remove(&k)).collect()
        };
        for e in gone {
            self.catalog.provider.deregister_source(&e.keys);
        }
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

    /// Open client connections.
    pub fn connections(&self) -> usize {
        self.endpoint.connections()
    }

    /// Stops serving. Idempotent.
    pub fn shutdown(&self) {
        self.endpoint.shutdown();
    }
}
