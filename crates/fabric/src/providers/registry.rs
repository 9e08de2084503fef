//! Providers by name: what a provider registers ([`Registration`]), what it is opened with
//! ([`ProviderOptions`]), and the [`Registry`] the protocols open them through.
//!
//! The registry holds no list of its own: the crate `rdma-shuffle-providers` builds the one
//! registry of this build from each provider crate's `registration()` (one line each), and
//! the shuffle's and Mobius's transport settings take its names.
//! Nothing above it matches on a provider: a protocol asks for a name it was given, and for
//! what a provider can do through its [`Capabilities`](super::ProviderCapabilities).

use super::Provider;
use crate::error::FabricError;
use rdma_shuffle_wire::Secret;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// What a provider is opened with: the settings every protocol can hand over (each `None`
/// keeps the provider's own default, and a provider reads only those that mean something to
/// it), and provider-specific settings by key.
#[derive(Clone, Default)]
pub struct ProviderOptions {
    /// The device to use (an RDMA device name, `mlx5_0`, `rxe0`); `None`: the provider's
    /// first usable one.
    pub device: Option<String>,
    /// GID index of the device's port; `None`: the provider's choice.
    pub gid_index: Option<u8>,
    /// Largest eager message (a frame and its eager payload), where a provider sizes
    /// receive buffers by it (verbs).
    pub eager_message: Option<u32>,
    /// Largest message of any kind the protocol sends over one link (a two-sided provider
    /// carries rendezvous bodies as messages too): a peer announcing more is refused (shm).
    pub max_message: Option<u64>,
    /// Receive buffers of each driver, where a provider receives into buffers it shares
    /// among its connections.
    pub recv_buffers: Option<u32>,
    /// Bytes the protocol's pool may register through the provider (checked against the
    /// memlock limit where registration pins memory).
    pub pool_bytes: u64,
    /// The secret peers prove before anything is made for them, where a provider has a
    /// handshake of its own (shm).
    pub secret: Option<Secret>,
    /// Settings of one provider, by key: `<provider>.<name>` (`ofi.provider`), as the
    /// protocol's settings carry them (the shuffle's `<prefix>.ofi.provider`).
    pub extra: BTreeMap<String, String>,
}

impl fmt::Debug for ProviderOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderOptions")
            .field("device", &self.device)
            .field("gid_index", &self.gid_index)
            .field("eager_message", &self.eager_message)
            .field("max_message", &self.max_message)
            .field("recv_buffers", &self.recv_buffers)
            .field("pool_bytes", &self.pool_bytes)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("extra", &self.extra)
            .finish()
    }
}

impl ProviderOptions {
    /// The provider-specific setting `key` (`ofi.provider`), if set.
    pub fn extra(&self, key: &str) -> Option<&str> {
        self.extra.get(key).map(String::as_str)
    }
}

/// A provider a registry opened.
#[derive(Debug)]
pub struct Opened {
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// What was opened, for a log line (`tcp`, `verbs on RDMA device rxe0`).
    pub description: String,
    /// Where `auto` passed over a provider it could not open: which, and why.
    pub fallback: Option<(&'static str, FabricError)>,
}

impl Opened {
    /// `provider`, described as `description`.
    pub fn new(provider: Arc<dyn Provider>, description: impl Into<String>) -> Self {
        Opened { provider, description: description.into(), fallback: None }
    }
}

/// Opens a registered provider.
pub type OpenFn = fn(&ProviderOptions) -> Result<Opened, FabricError>;

/// One provider as a registry knows it: its name, a line about it, how to open it.
#[derive(Clone, Copy)]
pub struct Registration {
    /// The name settings use (`tcp`, `verbs`): lower case, unique in a registry.
    pub name: &'static str,
    /// What it is, for the settings' documentation and errors.
    pub about: &'static str,
    /// Opens it, or says why it cannot be opened here (no device, not built in).
    pub open: OpenFn,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({})", self.name)
    }
}

/// The name that asks a registry for its automatic choice ([`Registry::open`]).
pub const AUTO: &str = "auto";

/// Providers by name, and the order `auto` tries them in.
#[derive(Debug, Clone)]
pub struct Registry {
    entries: Vec<Registration>,
    auto: Vec<&'static str>,
}

impl Registry {
    /// A registry of `entries`; `auto` opens the first of `auto` (names of `entries`) that
    /// opens here. Panics on a duplicate name or an `auto` name that is not registered:
    /// both are mistakes of the build, not of a user.
    pub fn new(entries: Vec<Registration>, auto: Vec<&'static str>) -> Self {
        for (i, e) in entries.iter().enumerate() {
            assert!(e.name != AUTO && !entries[..i].iter().any(|o| o.name == e.name), "provider {:?} registered twice", e.name);
        }
        for a in &auto {
            assert!(entries.iter().any(|e| e.name == *a), "auto names {a:?}, which is not registered");
        }
        Registry { entries, auto }
    }

    /// The registered names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.iter().map(|e| e.name)
    }

    /// The registrations.
    pub fn entries(&self) -> &[Registration] {
        &self.entries
    }

    /// The names `auto` tries, in order.
    pub fn auto_order(&self) -> &[&'static str] {
        &self.auto
    }

    /// Whether `name` is a registered provider or [`AUTO`].
    pub fn knows(&self, name: &str) -> bool {
        name == AUTO || self.find(name).is_some()
    }

    fn find(&self, name: &str) -> Option<&Registration> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Opens provider `name` with `options`. [`AUTO`] opens the first of the
    /// [auto order](Self::auto_order) that opens here, and keeps why the ones before it could
    /// not ([`Opened::fallback`], the first failure); it fails only if none opens (with the
    /// last one's error). An unknown name is an error that lists the names.
    pub fn open(&self, name: &str, options: &ProviderOptions) -> Result<Opened, FabricError> {
        if name == AUTO {
            let mut first: Option<(&'static str, FabricError)> = None;
            let mut last = None;
            for a in &self.auto {
                let Some(r) = self.find(a) else { continue };
                match (r.open)(options) {
                    Ok(mut o) => {
                        o.fallback = first;
                        return Ok(o);
                    }
                    Err(e) => {
                        tracing::debug!(provider = r.name, error = %e, "auto: provider unusable here");
                        match first {
                            None => first = Some((r.name, e)),
                            Some(_) => last = Some(e),
                        }
                    }
                }
            }
            return Err(last
                .or(first.map(|(_, e)| e))
                .unwrap_or_else(|| FabricError::Unsupported("auto: no provider to try".into())));
        }
        let r = self.find(name).ok_or_else(|| {
            FabricError::Unsupported(format!(
                "no provider named {name:?}: this build has {}, and {AUTO}",
                self.names().collect::<Vec<_>>().join(", ")
            ))
        })?;
        (r.open)(options)
    }
}
