//! The provider seam: what a transport implements for a [`Driver`](crate::driver::Driver) to run
//! connections over it.
//!
//! The providers themselves live in their own crates under `crates/providers/`
//! (`rdma-shuffle-provider-tcp`, `-shm`, `-sim`, `-verbs`), and are opened by name through
//! `rdma-shuffle-providers`. [`split`] is not a transport: two providers behind one, chosen
//! per peer (shm for the peers on this host, tcp for the others).
//!
//! A provider value is the device-level part (a verbs context and protection domain, the sim
//! network); each driver loop builds its own per-engine state from it (sockets, completion
//! queue, shared receive queue): a [`ProviderEngine`](link::ProviderEngine), whose connections
//! are [`Link`](link::Link)s. The driver sees only those traits (see [`link`]); nothing
//! here asks which provider it runs.
//!
//! # Adding a provider
//!
//! A new provider is a new crate (`crates/providers/<name>`) that implements [`Provider`],
//! [`ProviderEngine`](link::ProviderEngine), [`Link`](link::Link) and
//! [`Listener`](link::Listener), plus its registration in `rdma-shuffle-providers`.

pub mod codec;
pub mod link;
pub mod registry;
pub mod split;

use crate::memory::registration::Registrar;
use std::fmt;
use std::fs::File;
use std::io;
use std::sync::Arc;

/// Bytes a server can serve blocks from: typically one Spark data file, or user memory (mesh).
///
/// The CPU reads a file-backed source only through [`read_at`](Source::read_at) (`pread`) or
/// `sendfile` from [`file`](Source::file), never through a memory mapping: a file truncated
/// under a mapping faults (SIGBUS) on the first touch past its new end, which would kill the
/// executor; `pread` returns a short count that becomes a typed error instead.
pub trait Source: Send + Sync + fmt::Debug {
    /// Length of the source in bytes, as registered.
    fn len(&self) -> u64;
    /// Whether the source has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes from `offset` into `dst`. A file that is now shorter than
    /// that fails with an error that names the file and both lengths.
    fn read_at(&self, offset: u64, dst: &mut [u8]) -> io::Result<()>;
    /// The bytes in memory, for sources that are memory (mesh user buffers): written and
    /// exposed without a copy. `None` for files.
    fn memory(&self) -> Option<&[u8]> {
        None
    }
    /// An open file with the same bytes at the same offsets, for `sendfile` and for private
    /// mappings of a region (verbs). The `Arc` keeps the descriptor open while it is used.
    fn file(&self) -> io::Result<Option<Arc<File>>> {
        Ok(None)
    }
}

/// `src[offset..offset + dst.len()]` into `dst`, or the error a file-backed source would give.
pub fn copy_from_memory(src: &[u8], offset: u64, dst: &mut [u8]) -> io::Result<()> {
    let from = usize::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let bytes = from.checked_add(dst.len()).and_then(|to| src.get(from..to)).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} bytes at offset {offset} are outside the {}-byte source", dst.len(), src.len()),
        )
    })?;
    dst.copy_from_slice(bytes);
    Ok(())
}

/// Reads `len` bytes of `source` at `offset` into a new vector.
pub fn read_vec(source: &dyn Source, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "payload larger than memory"))?;
    let mut v = vec![0u8; n];
    source.read_at(offset, &mut v)?;
    Ok(v)
}

/// A transport (tcp, shm, verbs, sim...): the device-level part a driver builds its
/// per-loop [`ProviderEngine`](link::ProviderEngine) from.
pub trait Provider: Send + Sync + fmt::Debug {
    /// Its name in the registry (`"tcp"`, `"verbs"`; a combinator names both of its own:
    /// `"shm+tcp"`), for logs and counters. Nothing decides on it: protocols and policies ask
    /// [`capabilities`](Provider::capabilities).
    fn name(&self) -> &'static str;
    /// What the provider can do, as the protocols and Mobius's policy ask it.
    fn capabilities(&self) -> ProviderCapabilities;
    /// Registers pool memory with the device (no-op where nothing needs registering).
    fn registrar(&self) -> Arc<dyn Registrar>;
    /// Builds this provider's state for one driver loop (the loop calls it once, on start).
    fn engine(&self, ctx: link::EngineCtx<'_>) -> Result<Box<dyn link::ProviderEngine>, crate::error::FabricError>;
    /// Provider-specific counters as `(name, value)` pairs, from the driver's data-plane
    /// counters `driver` and the provider's own (empty on tcp).
    fn counters(&self, driver: &link::ProviderCounters) -> Vec<(&'static str, u64)> {
        let _ = driver;
        Vec::new()
    }
    /// Registers `len` bytes of caller memory at `ptr` for one-sided access by peers
    /// (mesh rendezvous from user buffers). `Ok(None)` where nothing needs registering.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must stay mapped until the returned region is dropped.
    unsafe fn register_user(&self, ptr: *const u8, len: usize) -> Result<Option<Arc<dyn UserRegion>>, crate::error::FabricError> {
        let _ = (ptr, len);
        Ok(None)
    }
    /// Bytes of pool memory currently registered through [`registrar`](Provider::registrar)
    /// (0 where nothing is registered).
    fn registered_bytes(&self) -> u64 {
        0
    }
}

/// What a provider can do ([`Provider::capabilities`]): the facts protocols and Mobius's
/// policy choose by, instead of a provider's name. Its links answer for themselves
/// ([`Link::capabilities`](link::Link::capabilities)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProviderCapabilities {
    /// Rendezvous regions are read one-sidedly (verbs, sim with one-sided reads on);
    /// otherwise the receiver pulls them over the connection (tcp, shm).
    pub one_sided: bool,
    /// The largest eager payload one message holds, where the provider's message buffers
    /// bound it (verbs); `None` for streams.
    pub max_eager: Option<usize>,
    /// The peers' own CPUs move the bytes through memory both map (shm, memory-polled
    /// links): a transfer cannot overlap the receiver's work on the one before it, and
    /// smaller pieces only add messages.
    pub cpu_copies: bool,
    /// The largest message body one in-memory record carries in place (shm: half a ring,
    /// less its record header), where the provider has such records: bodies up to it are
    /// copied in and out once each, larger ones take another path.
    pub record_body: Option<usize>,
}

/// Caller memory registered with a provider for one-sided access ([`Provider::register_user`]).
pub trait UserRegion: Send + Sync {
    /// The key a peer names the region with.
    fn rkey(&self) -> u32;
    /// The key a one-sided read of this process writes the region with
    /// ([`OneSided::start_read_user`](link::OneSided::start_read_user)), if it may be written.
    fn write_lkey(&self) -> Option<u32> {
        None
    }
}
