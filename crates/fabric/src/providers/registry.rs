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
    /// Bytes of its data the protocol may expose for one-sided reads at once (the shuffle's
    /// `maxBytesExposed`), where a provider registers or copies what it exposes: part of its
    /// [fixed memory](FixedMemory).
    pub exposed_bytes: u64,
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
            .field("exposed_bytes", &self.exposed_bytes)
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

/// The native memory a provider holds for given options whatever the traffic (receive and
/// send buffers, exposed data, caches it keeps), so that a protocol can budget it before
/// the provider opens. Memory that grows with links (a ring per peer) is not fixed and is
/// not here.
pub type FixedMemoryFn = fn(&ProviderOptions) -> FixedMemory;

/// A provider's fixed native memory ([`FixedMemoryFn`]), in parts a protocol can name in an
/// error: each with what it is and the [`ProviderOptions`] fields it follows, which the
/// protocol maps to its own settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FixedMemory {
    /// The parts; none for a provider that holds no fixed memory (tcp).
    pub parts: Vec<FixedPart>,
}

/// One part of a provider's [`FixedMemory`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FixedPart {
    /// Bytes.
    pub bytes: u64,
    /// What they are (`verbs receive and send buffers`).
    pub what: String,
    /// The [`ProviderOptions`] fields the size follows (`recv_buffers`, `eager_message`,
    /// `exposed_bytes`); empty where no option changes it.
    pub follows: &'static [&'static str],
}

impl FixedMemory {
    /// No fixed memory.
    pub fn none(_: &ProviderOptions) -> FixedMemory {
        FixedMemory::default()
    }

    /// The total.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).fold(0, u64::saturating_add)
    }

    /// With one more part.
    pub fn with(mut self, bytes: u64, what: impl Into<String>, follows: &'static [&'static str]) -> FixedMemory {
        self.parts.push(FixedPart { bytes, what: what.into(), follows });
        self
    }
}

/// One provider as a registry knows it: its name, a line about it, how to open it, and the
/// native memory it holds whatever the traffic.
#[derive(Clone, Copy)]
pub struct Registration {
    /// The name settings use (`tcp`, `verbs`): lower case, unique in a registry.
    pub name: &'static str,
    /// What it is, for the settings' documentation and errors.
    pub about: &'static str,
    /// Opens it, or says why it cannot be opened here (no device, not built in).
    pub open: OpenFn,
    /// Its fixed native memory for given options, known without opening it (also in a build
    /// without the provider's system library); [`FixedMemory::none`] where it holds none.
    pub fixed_memory: FixedMemoryFn,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({})", self.name)
    }
}

/// The name that asks a registry for its automatic choice ([`Registry::open`]).
pub const AUTO: &str = "auto";

/// What [`Registry::fit`] chose: a provider, what the caller's check made of its fixed
/// memory, and, where `auto` passed over a provider whose fixed memory the check refused,
/// which one and why (the first one passed over).
#[derive(Debug)]
pub struct Fit<T, E> {
    /// The provider chosen.
    pub name: &'static str,
    /// The check's answer for it.
    pub value: T,
    /// The first provider `auto` passed over, and the check's error for it.
    pub passed_over: Option<(&'static str, E)>,
}

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

    /// The fixed native memory provider `name` holds with `options` (its
    /// [`Registration::fixed_memory`]); `None` for a name that is not registered.
    pub fn fixed_memory(&self, name: &str, options: &ProviderOptions) -> Option<FixedMemory> {
        self.find(name).map(|r| (r.fixed_memory)(options))
    }

    /// The providers `name` may open: [`AUTO`]'s order, or the one registered `name` (none
    /// for a name that is not registered).
    pub fn candidates(&self, name: &str) -> Vec<&'static str> {
        if name == AUTO {
            self.auto.clone()
        } else {
            self.find(name).map(|r| vec![r.name]).unwrap_or_default()
        }
    }

    /// The provider `name` would open as far as its fixed memory goes: `check` judges a
    /// provider's [fixed memory](Self::fixed_memory) for `options` (a memory budget). For a
    /// name, that provider and `check`'s answer, an error included. For [`AUTO`], the first of
    /// the auto order `check` accepts, with the first one it refused and why
    /// ([`Fit::passed_over`]); if it accepts none, the last one's error. `None` for a name
    /// that is not registered, or an empty auto order.
    pub fn fit<T, E>(
        &self,
        name: &str,
        options: &ProviderOptions,
        mut check: impl FnMut(&'static str, &FixedMemory) -> Result<T, E>,
    ) -> Option<Result<Fit<T, E>, E>> {
        let mut passed_over: Option<(&'static str, E)> = None;
        let mut last = None;
        for n in self.candidates(name) {
            let fixed = self.fixed_memory(n, options)?;
            match check(n, &fixed) {
                Ok(value) => return Some(Ok(Fit { name: n, value, passed_over })),
                Err(e) if name == AUTO => match passed_over {
                    None => passed_over = Some((n, e)),
                    Some(_) => last = Some(e),
                },
                Err(e) => return Some(Err(e)),
            }
        }
        last.or(passed_over.map(|(_, e)| e)).map(Err)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn unopenable(_: &ProviderOptions) -> Result<Opened, FabricError> {
        Err(FabricError::Unsupported("not here".into()))
    }

    fn buffers(o: &ProviderOptions) -> FixedMemory {
        FixedMemory::default().with(u64::from(o.recv_buffers.unwrap_or(0)) * 1000, "buffers", &["recv_buffers"])
    }

    #[test]
    fn auto_fits_the_first_provider_whose_fixed_memory_the_check_accepts_and_says_why_it_passed_over_others() {
        let r = Registry::new(
            vec![
                Registration { name: "big", about: "", open: unopenable, fixed_memory: buffers },
                Registration { name: "small", about: "", open: unopenable, fixed_memory: FixedMemory::none },
            ],
            vec!["big", "small"],
        );
        let o = ProviderOptions { recv_buffers: Some(10), ..Default::default() };
        assert_eq!(r.fixed_memory("big", &o).unwrap().bytes(), 10_000);
        assert_eq!(r.fixed_memory("small", &o).unwrap().bytes(), 0);
        assert!(r.fixed_memory("none", &o).is_none());
        let under =
            |limit: u64| move |_: &'static str, f: &FixedMemory| if f.bytes() <= limit { Ok(f.bytes()) } else { Err(f.bytes()) };
        let fit = r.fit(AUTO, &o, under(20_000)).unwrap().unwrap();
        assert_eq!((fit.name, fit.value, fit.passed_over), ("big", 10_000, None));
        let fit = r.fit(AUTO, &o, under(5_000)).unwrap().unwrap();
        assert_eq!((fit.name, fit.value, fit.passed_over), ("small", 0, Some(("big", 10_000))));
        // A name is that provider or its error; nothing fits: the last error.
        assert_eq!(r.fit("big", &o, under(5_000)).unwrap().unwrap_err(), 10_000);
        assert_eq!(r.fit(AUTO, &o, |_, _| Err::<(), _>("no")).unwrap().unwrap_err(), "no");
        assert!(r.fit("none", &o, under(0)).is_none());
    }
}
