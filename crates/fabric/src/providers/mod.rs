//! Providers: the transports a [`Driver`](crate::driver::Driver) runs connections over.
//!
//! * [`tcp`] — real sockets; frames over a byte stream, rendezvous regions streamed on request
//!   (`sendfile` from the data file where it can).
//! * [`sim`] — an in-memory network inside one process: whole messages (like verbs SEND/RECV)
//!   and one-sided reads that obey the access rules of verbs memory windows, so every
//!   protocol and security test runs without a device.
//! * [`verbs`] — RDMA over ibverbs (feature `verbs`): a socket control plane for the
//!   authenticated handshake, then SEND/RECV through one shared receive queue per driver and
//!   one-sided RDMA READ of windows bound to the requesting peer's queue pair.
//! * [`shm`] — shared memory between processes of one host.
//! * [`split`] — not a transport: two providers behind one, chosen per peer (shm for the
//!   peers on this host, tcp for the others).
//!
//! A provider value is the device-level part (a verbs context and protection domain, the sim
//! network); each driver loop builds its own per-engine state from it (sockets, completion
//! queue, shared receive queue): a [`ProviderEngine`](link::ProviderEngine), whose connections
//! are [`Link`](link::Link)s. The driver sees only those traits (see [`link`]); nothing
//! outside this folder asks which provider it runs.
//!
//! # Adding a provider
//!
//! A new provider is a new module here (`providers/<name>.rs` or `providers/<name>/`) that
//! implements [`Provider`], [`ProviderEngine`](link::ProviderEngine), [`Link`](link::Link)
//! and [`Listener`](link::Listener), plus its `mod` line below and its arm in
//! [`open_provider`] (with the [`ProviderChoice`] variant that asks for it).

pub mod codec;
pub mod link;
pub mod shm;
pub mod sim;
pub mod split;
pub mod tcp;
pub mod verbs;

use crate::memory::registration::Registrar;
use std::fmt;
use std::fs::File;
use std::io;
use std::sync::Arc;

pub use sim::SimProvider;
pub use tcp::TcpProvider;

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

/// A transport: tcp, verbs or sim.
pub trait Provider: Send + Sync + fmt::Debug {
    /// Short name: `"tcp"`, `"verbs"`, `"sim"`.
    fn name(&self) -> &'static str;
    /// Registers pool memory with the device (no-op where nothing needs registering).
    fn registrar(&self) -> Arc<dyn Registrar>;
    /// Builds this provider's state for one driver loop (the loop calls it once, on start).
    fn engine(&self, ctx: link::EngineCtx<'_>) -> Result<Box<dyn link::ProviderEngine>, crate::error::FabricError>;
    /// Whether rendezvous regions are read one-sidedly (verbs, sim with one-sided reads on);
    /// otherwise the receiver pulls them over the connection (tcp).
    fn one_sided(&self) -> bool {
        false
    }
    /// The largest eager payload one message holds, where the provider's message buffers
    /// bound it (verbs); `None` for streams.
    fn max_eager(&self) -> Option<usize> {
        None
    }
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

/// Caller memory registered with a provider for one-sided access ([`Provider::register_user`]).
pub trait UserRegion: Send + Sync {
    /// The key a peer names the region with.
    fn rkey(&self) -> u32;
    /// The key a one-sided read of this process writes the region with
    /// ([`Link::start_read_user`](link::Link::start_read_user)), if it may be written.
    fn write_lkey(&self) -> Option<u32> {
        None
    }
}

/// Which provider [`open_provider`] opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ProviderChoice {
    /// tcp sockets.
    #[default]
    Tcp,
    /// RDMA verbs, or an error.
    Verbs,
    /// verbs when a usable device exists, tcp otherwise (the reason is kept).
    Auto,
    /// shared memory, between processes of one host.
    Shm,
}

/// What [`open_provider`] needs: the choice, and for verbs the device settings (each `None`
/// keeps the verbs provider's default).
#[derive(Clone, Debug, Default)]
pub struct ProviderSpec {
    /// Which provider.
    pub choice: ProviderChoice,
    /// RDMA device name; `None`: the first device with an active port.
    pub device: Option<String>,
    /// GID index; `None`: the first RoCEv2 IPv4-mapped GID.
    pub gid_index: Option<u8>,
    /// Largest verbs message (frame + eager payload).
    pub max_message: Option<u32>,
    /// Buffers of each driver's shared receive queue.
    pub recv_buffers: Option<u32>,
    /// Bytes the pool may register (checked against the memlock limit).
    pub pool_bytes: u64,
}

/// A provider [`open_provider`] opened.
#[derive(Debug)]
pub struct OpenedProvider {
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// What was opened, for a log line (`tcp`, `verbs on RDMA device rxe0`).
    pub description: String,
    /// With [`ProviderChoice::Auto`] on tcp: why verbs could not be used.
    pub fallback: Option<crate::error::FabricError>,
}

/// Opens the provider `spec` asks for: the one place that lists the providers, used by every
/// protocol (the shuffle's engine, Mobius). `Verbs` in a build without the `verbs` feature,
/// or without a usable device, is an error; `Auto` then falls back to tcp and says why.
pub fn open_provider(spec: &ProviderSpec) -> Result<OpenedProvider, crate::error::FabricError> {
    let tcp = |fallback| OpenedProvider { provider: Arc::new(TcpProvider::new()), description: "tcp".into(), fallback };
    let verbs = |(provider, description)| OpenedProvider { provider, description, fallback: None };
    match spec.choice {
        ProviderChoice::Tcp => Ok(tcp(None)),
        ProviderChoice::Verbs => open_verbs(spec).map(verbs),
        ProviderChoice::Auto => Ok(open_verbs(spec).map(verbs).unwrap_or_else(|e| tcp(Some(e)))),
        ProviderChoice::Shm => {
            Ok(OpenedProvider { provider: Arc::new(shm::ShmProvider::default()), description: "shm".into(), fallback: None })
        }
    }
}

#[cfg(feature = "verbs")]
fn open_verbs(spec: &ProviderSpec) -> Result<(Arc<dyn Provider>, String), crate::error::FabricError> {
    let d = verbs::VerbsConfig::default();
    let vc = verbs::VerbsConfig {
        device: spec.device.clone(),
        gid_index: spec.gid_index,
        max_message: spec.max_message.unwrap_or(d.max_message),
        recv_buffers: spec.recv_buffers.unwrap_or(d.recv_buffers),
        pool_bytes: spec.pool_bytes,
        ..d
    };
    let p = verbs::VerbsProvider::open(vc)?;
    let description = format!("verbs on RDMA device {}", p.device());
    Ok((Arc::new(p), description))
}

#[cfg(not(feature = "verbs"))]
fn open_verbs(_spec: &ProviderSpec) -> Result<(Arc<dyn Provider>, String), crate::error::FabricError> {
    Err(crate::error::FabricError::Unsupported(
        "this build of the native library has no verbs provider (built without the `verbs` feature: libibverbs was not available)"
            .into(),
    ))
}

#[cfg(test)]
mod open_tests {
    use super::*;

    #[test]
    fn tcp_opens_and_auto_falls_back_to_tcp_with_the_reason_where_verbs_is_unusable() {
        let p = open_provider(&ProviderSpec::default()).unwrap();
        assert_eq!((p.provider.name(), p.fallback.is_none()), ("tcp", true));
        // This test runs on hosts without an RDMA device (CI's, and every build without the
        // feature); the SoftRoCE VM suite opens verbs for real.
        if cfg!(feature = "verbs") && std::path::Path::new("/sys/class/infiniband").exists() {
            return;
        }
        let auto = open_provider(&ProviderSpec { choice: ProviderChoice::Auto, ..ProviderSpec::default() }).unwrap();
        assert_eq!(auto.provider.name(), "tcp");
        let why = auto.fallback.expect("auto on tcp says why").to_string();
        let err = open_provider(&ProviderSpec { choice: ProviderChoice::Verbs, ..ProviderSpec::default() }).unwrap_err();
        assert_eq!(err.to_string(), why, "auto falls back for the reason verbs fails");
        assert!(why.contains("verbs") || why.contains("RDMA") || why.contains("device"), "{why}");
    }
}
