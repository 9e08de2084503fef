//! rdma-shuffle's libfabric provider, `ofi`.
//!
//! libfabric (the OFI working group's fabric interface, used by MPICH, Open MPI and NCCL's
//! AWS plugin) reaches fabrics the verbs provider does not: AWS EFA, HPE Slingshot (`cxi`),
//! Cornelis Omni-Path (`opx`), Intel's `psm3`, besides TCP (`tcp;ofi_rxm`), shared memory
//! (`shm`) and InfiniBand/RoCE (`verbs;ofi_rxm`). This crate drives any of them through one
//! reliable-datagram endpoint (`FI_EP_RDM`) per driver loop, whatever the number of peers.
//!
//! # Shape
//!
//! * **Control plane**: a tcp socket per connection (the tcp provider's), driven by the loop
//!   like any tcp connection. It carries the protocol's handshake; only once the loop told
//!   the link that the peer authenticated does anything get made for it: the two sides
//!   exchange attach records (connection id, receive-buffer size, endpoint address) in the
//!   protocol's frame for it, and the peer's address goes into the endpoint's address
//!   vector. The socket then stays silent as the liveness channel.
//! * **Data plane**: frames travel as messages (`fi_send`, `fi_inject` when small) through
//!   the loop's endpoint, each ending with the receiver's connection id (random, 64 bits);
//!   frames larger than the peer's receive buffers go in pieces. Large blocks are read
//!   one-sidedly (`fi_read`) where the provider offers RMA, from a registration of the block
//!   alone whose key only the connection it was exposed to learns; where it offers none (or
//!   `ofi.rma` is `false`), the protocol pulls them and the data comes as messages.
//! * **Memory**: pool memory is registered through the pool's registrar where the provider
//!   needs local registration (`FI_MR_LOCAL`: verbs, EFA); exposures are registered one by
//!   one and closed when revoked.
//! * **Progress**: the driver drives completions. Where libfabric offers a wait descriptor
//!   for the completion queue (tcp, verbs under `ofi_rxm`) it sits in the loop's poll and the
//!   loop sleeps on it only when `fi_trywait` allows; where not (shm, and most HPC fabrics)
//!   the queue is read every turn, and an idle loop is woken every millisecond.
//!
//! # Settings
//!
//! Handed over as provider settings (`ProviderOptions::extra`): `ofi.provider` (the
//! libfabric provider, `tcp;ofi_rxm` by default; Spark's `spark.shuffle.rdma.ofi.provider`,
//! Mobius's `MOBIUS_OFI_PROVIDER`) and `ofi.rma` (`false` moves large blocks by messages even
//! where RMA exists). The generic `device` names the libfabric domain (`rxe0`, `efa_0`,
//! `eth0`), and the eager message size sets the receive buffers.
//!
//! # Building
//!
//! The `libfabric` feature links libfabric >= 2.0 through `ofi-libfabric-sys` (found by
//! pkg-config). Without it the crate still builds and registers `ofi`, whose opening then
//! fails saying how to build it in. `scripts/ensure-libfabric.sh` builds libfabric 2.1 once
//! per machine:
//!
//! ```text
//! export PKG_CONFIG_PATH=$(bash scripts/ensure-libfabric.sh)/lib/pkgconfig
//! cargo test -p rdma-shuffle-provider-ofi --features libfabric
//! ```
//!
//! The build script puts libfabric's library directory in the tests' rpath, and exports it
//! to dependents as `DEP_RDMA_SHUFFLE_OFI_LIBDIR`. All `unsafe` code is in one module, `sys`.

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod attach;
mod config;
#[cfg(feature = "libfabric")]
mod conn;
#[cfg(feature = "libfabric")]
mod engine;
mod error;
#[cfg(feature = "libfabric")]
mod provider;
#[cfg(feature = "libfabric")]
mod sys;
#[cfg(not(feature = "libfabric"))]
mod unbuilt;

pub use config::{EndpointInfo, OfiConfig, PeerAddr, RemoteRegion, DEFAULT_PROVIDER};
pub use error::OfiError;
#[cfg(feature = "libfabric")]
pub use provider::OfiProvider;
#[cfg(feature = "libfabric")]
pub use sys::{
    runtime_version, Access, Buffer, Completion, Counters, Domain, Endpoint, Exposure, LocalDesc, MemoryRegion, PoolRegistrar,
    PostError,
};
#[cfg(not(feature = "libfabric"))]
pub use unbuilt::Endpoint;

use rdma_shuffle_fabric::providers::codec::HEAD_ROOM;
use rdma_shuffle_fabric::providers::registry::{FixedMemory, Opened, ProviderOptions, Registration};
use rdma_shuffle_fabric::FabricError;

/// Whether this build links libfabric.
pub const BUILT_WITH_LIBFABRIC: bool = cfg!(feature = "libfabric");

/// Receive-buffer size where the protocol names no eager message size (Mobius): a 64 KiB
/// eager payload and room for its frame.
const DEFAULT_MAX_MSG: u32 = (64 << 10) + 4096;

/// Registered send buffers of each engine, where the libfabric provider needs local
/// registration (FI_MR_LOCAL).
pub(crate) const SEND_BUFFERS: usize = 64;

/// The most bytes of exposure copies an engine keeps for reuse, whatever the exposure budget.
pub(crate) const SPARE_BYTES_MAX: u64 = 64 << 20;

/// The ofi provider in the registry: `ofi`, on the libfabric provider the `ofi.provider`
/// setting names. In a build without the `libfabric` feature opening it is an error that
/// says so.
pub fn registration() -> Registration {
    Registration {
        name: "ofi",
        about: "libfabric reliable-datagram endpoints (tcp;ofi_rxm, shm, verbs;ofi_rxm, and the fabrics libfabric reaches: efa, cxi, opx, psm3): sends and one-sided fi_read",
        open,
        fixed_memory,
    }
}

/// What the ofi provider holds whatever the traffic: each engine's posted receive buffers
/// and its send buffers ([`Settings::rx_depth`] and [`SEND_BUFFERS`] of
/// [`Settings::max_msg`] bytes each; the send buffers only where the libfabric provider
/// needs them registered, which is known once it opens, so counted always), and, where large
/// blocks may be read one-sidedly (`ofi.rma`), the copies of the data exposed at once
/// (`exposed_bytes`, twice: a copy is the block's size rounded up to a power of two) and the
/// copies kept for reuse once their exposure ended ([`Settings::spare_bytes`]). Settings that
/// do not parse count as their defaults (opening then fails, naming them).
pub fn fixed_memory(o: &ProviderOptions) -> FixedMemory {
    let (max_msg, rx_depth) = buffer_sizes(o);
    let buffers = ((rx_depth + SEND_BUFFERS) * max_msg) as u64;
    let fixed = FixedMemory::default().with(buffers, "ofi receive and send buffers", &["recv_buffers", "eager_message"]);
    if rma(o).unwrap_or(true) {
        fixed.with(o.exposed_bytes.saturating_mul(2), "copies of blocks exposed for fi_read", &["exposed_bytes"]).with(
            spare_bytes(o) as u64,
            "copies of exposed blocks kept for reuse",
            &["exposed_bytes"],
        )
    } else {
        fixed
    }
}

/// Bytes of exposure copies an engine keeps for reuse: as many as it may expose at once
/// (`exposed_bytes`), at most [`SPARE_BYTES_MAX`]; that much where the protocol states no
/// exposure budget (0). Kept rather than freed because a target-side libfabric provider (tcp)
/// may still be answering a misbehaving reader from a copy whose registration closed.
fn spare_bytes(o: &ProviderOptions) -> usize {
    match o.exposed_bytes {
        0 => SPARE_BYTES_MAX as usize,
        n => n.min(SPARE_BYTES_MAX) as usize,
    }
}

/// Receive-buffer size and receive buffers posted per endpoint, from the options.
fn buffer_sizes(o: &ProviderOptions) -> (usize, usize) {
    let max_msg =
        o.eager_message.unwrap_or(DEFAULT_MAX_MSG).max(HEAD_ROOM as u32 + 4096).clamp(attach::MIN_MESSAGE, attach::MAX_MESSAGE)
            as usize;
    // ofi_rxm and shm keep what arrives before a receive is posted in their own buffers,
    // so a few dozen posted buffers serve any number of peers.
    let rx_depth = o.recv_buffers.map_or(64, |n| (n as usize / 8).clamp(16, 128));
    (max_msg, rx_depth)
}

/// `ofi.rma`, or the malformed value.
fn rma(o: &ProviderOptions) -> Result<bool, String> {
    match o.extra("ofi.rma").map(|v| v.trim().to_ascii_lowercase()) {
        None => Ok(true),
        // Spark's booleans are true/false, Mobius's on/off.
        Some(v) if matches!(v.as_str(), "" | "true" | "on" | "1") => Ok(true),
        Some(v) if matches!(v.as_str(), "false" | "off" | "0") => Ok(false),
        Some(v) => Err(v),
    }
}

/// What the ofi provider is opened with, read from the protocol's provider options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The libfabric provider (`ofi.provider`).
    pub provider: String,
    /// Whether large blocks may be read one-sidedly where the provider offers RMA (`ofi.rma`).
    pub rma: bool,
    /// The libfabric domain (the generic `device` option).
    pub domain: Option<String>,
    /// Receive-buffer size: the eager message size, or [`DEFAULT_MAX_MSG`].
    pub max_msg: usize,
    /// Receive buffers posted per endpoint.
    pub rx_depth: usize,
    /// Bytes of exposure copies each engine keeps for reuse once their exposure ended: the
    /// exposure budget (`exposed_bytes`), at most [`SPARE_BYTES_MAX`]; part of the
    /// [fixed memory](fixed_memory).
    pub spare_bytes: usize,
}

impl Settings {
    /// Reads the options; a malformed value is an error naming the setting.
    pub fn from_options(o: &ProviderOptions) -> Result<Settings, FabricError> {
        let bad = |key: &str, value: &str, why: &str| FabricError::Provider {
            provider: "ofi",
            message: format!(
                "setting {key}={value:?}: {why} (Spark: spark.shuffle.rdma.{key}; Mobius: MOBIUS_{})",
                key.replace('.', "_").to_uppercase()
            ),
            knob: None,
        };
        let provider = match o.extra("ofi.provider").map(str::trim) {
            None | Some("") => DEFAULT_PROVIDER.to_string(),
            Some(p) if p.contains('\0') || p.len() > 128 => return Err(bad("ofi.provider", p, "not a libfabric provider name")),
            Some(p) => p.to_string(),
        };
        let rma = rma(o).map_err(|v| bad("ofi.rma", &v, "true or false (on or off)"))?;
        let (max_msg, rx_depth) = buffer_sizes(o);
        Ok(Settings { provider, rma, domain: o.device.clone(), max_msg, rx_depth, spare_bytes: spare_bytes(o) })
    }
}

#[cfg(feature = "libfabric")]
fn open(o: &ProviderOptions) -> Result<Opened, FabricError> {
    let p = OfiProvider::open(&Settings::from_options(o)?)?;
    let description = p.description();
    Ok(Opened::new(std::sync::Arc::new(p), description))
}

#[cfg(not(feature = "libfabric"))]
fn open(o: &ProviderOptions) -> Result<Opened, FabricError> {
    Settings::from_options(o)?;
    Err(FabricError::Unsupported(
        "this build of the native library has no ofi provider (built without libfabric). Build it in with the cargo \
         feature `ofi` (rdma-shuffle-providers/ofi) after `export PKG_CONFIG_PATH=$(bash scripts/ensure-libfabric.sh)/lib/pkgconfig`; \
         it needs libfabric >= 2.0, also on the library path where it runs. Or choose another transport (auto, tcp, shm, verbs)"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_come_from_the_options_and_bad_values_are_named() {
        let s = Settings::from_options(&ProviderOptions::default()).unwrap();
        assert_eq!((s.provider.as_str(), s.rma, s.max_msg, s.rx_depth), (DEFAULT_PROVIDER, true, DEFAULT_MAX_MSG as usize, 64));
        let mut o = ProviderOptions {
            eager_message: Some(20_480),
            recv_buffers: Some(512),
            device: Some("rxe0".into()),
            ..Default::default()
        };
        o.extra.insert("ofi.provider".into(), "verbs;ofi_rxm".into());
        o.extra.insert("ofi.rma".into(), "false".into());
        let s = Settings::from_options(&o).unwrap();
        assert_eq!(
            s,
            Settings {
                provider: "verbs;ofi_rxm".into(),
                rma: false,
                domain: Some("rxe0".into()),
                max_msg: 20_480,
                rx_depth: 64,
                spare_bytes: SPARE_BYTES_MAX as usize
            }
        );
        o.extra.insert("ofi.rma".into(), "on".into());
        assert!(Settings::from_options(&o).unwrap().rma, "Mobius's on");
        o.extra.insert("ofi.rma".into(), "maybe".into());
        let e = Settings::from_options(&o).unwrap_err().to_string();
        assert!(e.contains("ofi.rma") && e.contains("spark.shuffle.rdma.ofi.rma") && e.contains("MOBIUS_OFI_RMA"), "{e}");
    }

    #[test]
    fn fixed_memory_is_the_buffers_the_settings_size_and_the_exposed_copies_where_blocks_are_read() {
        let mut o = ProviderOptions {
            eager_message: Some(20_480),
            recv_buffers: Some(512),
            exposed_bytes: 4 << 20,
            ..Default::default()
        };
        // 64 receive (512 / 8) and 64 send buffers of 20 KiB, the exposed copies (rounded
        // up to powers of two: twice the budget at most) and as many kept for reuse.
        assert_eq!(fixed_memory(&o).bytes(), 128 * 20_480 + 2 * (4 << 20) + (4 << 20));
        assert_eq!(Settings::from_options(&o).unwrap().spare_bytes, 4 << 20);
        o.exposed_bytes = 1 << 30;
        assert_eq!(Settings::from_options(&o).unwrap().spare_bytes, 64 << 20, "spares are bounded whatever the budget");
        let unstated = ProviderOptions { exposed_bytes: 0, ..o.clone() };
        assert_eq!(Settings::from_options(&unstated).unwrap().spare_bytes, 64 << 20, "no budget stated: the bound");
        assert_eq!(fixed_memory(&unstated).bytes(), 128 * 20_480 + (64 << 20));
        assert_eq!(fixed_memory(&o).bytes(), 128 * 20_480 + 2 * (1 << 30) + (64 << 20));
        o.extra.insert("ofi.rma".into(), "off".into());
        assert_eq!(fixed_memory(&o).bytes(), 128 * 20_480);
        let s = Settings::from_options(&o).unwrap();
        assert_eq!(fixed_memory(&o).bytes(), ((s.rx_depth + SEND_BUFFERS) * s.max_msg) as u64);
    }
}
