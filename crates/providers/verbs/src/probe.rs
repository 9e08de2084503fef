//! What a node's RDMA devices offer, for the preflight an operator runs before Spark does
//! (`Doctor`): devices, ports, their state, link layer and MTU, the GID table with each GID's
//! type, which GID the engine would use and why, and whether the pool's memory registers.
//!
//! On RoCE the GID index decides the wire protocol (RoCE v1 or v2) and the source address;
//! the wrong one gives connect timeouts or retry-exceeded errors that say nothing about the
//! cause, so the choice is shown with its reason. The selection is [`pick_gid`], the same
//! function the provider uses when it opens a device.

use rdma_shuffle_fabric::error::FabricError;
use std::time::Duration;

pub use crate::ports::{gid_attrs, is_ipv4_mapped, mtu_bytes, pick_gid, DeviceInfo, GidInfo, PortInfo};

/// Every RDMA device of this node, with its ports and GID tables.
#[cfg(feature = "ibverbs")]
pub fn devices() -> Result<Vec<DeviceInfo>, FabricError> {
    crate::sys::probe_devices()
}

/// Every RDMA device of this node: this build has no verbs provider.
#[cfg(not(feature = "ibverbs"))]
pub fn devices() -> Result<Vec<DeviceInfo>, FabricError> {
    Err(FabricError::Unsupported("this build of the native library has no verbs provider (built without libibverbs)".into()))
}

/// Opens `device` (or the first with an active port) as the provider would and registers
/// `bytes` of fresh memory in one region, as much as the engine's pool may register; returns
/// how long the registration took. The error names the memlock limit and what to change when
/// that is what stopped it.
#[cfg(feature = "ibverbs")]
pub fn register(device: Option<&str>, gid_index: Option<u8>, bytes: usize) -> Result<Duration, FabricError> {
    let dev = crate::sys::Device::open(device, 1, gid_index)?;
    crate::sys::register_for_probe(&dev, bytes)
}

/// Registration needs the verbs provider, which this build lacks.
#[cfg(not(feature = "ibverbs"))]
pub fn register(_device: Option<&str>, _gid_index: Option<u8>, _bytes: usize) -> Result<Duration, FabricError> {
    devices().map(|_| Duration::ZERO)
}
