//! The device, its protection domain, and the errors and work-request ids every wrapper
//! shares.

use crate::ports::{mtu_bytes, DeviceInfo, GidInfo, PortInfo};
use rdma_shuffle_fabric::error::FabricError;
use rdma_shuffle_wire::Knob;
use rdma_sys::*;
use std::ffi::CStr;
use std::io;
use std::sync::Arc;

const PROVIDER: &str = "verbs";

pub(crate) fn err(message: impl Into<String>) -> FabricError {
    FabricError::Provider { provider: PROVIDER, message: message.into(), knob: None }
}

pub(super) fn err_knob(message: impl Into<String>, knob: Knob) -> FabricError {
    FabricError::Provider { provider: PROVIDER, message: message.into(), knob: Some(knob) }
}

pub(super) fn os_err(what: &str) -> FabricError {
    err(format!("{what}: {}", io::Error::last_os_error()))
}

/// Verbs return a positive errno, or -1 with errno set.
pub(super) fn rc_err(what: &str, rc: i32) -> FabricError {
    let code = if rc < 0 { io::Error::last_os_error().raw_os_error().unwrap_or(0) } else { rc };
    err(format!("{what}: {}", io::Error::from_raw_os_error(code)))
}

/// Work-request id bit of receive buffers (the rest is the slot).
pub(crate) const WR_RECV: u64 = 1 << 63;
/// Work-request id bit of sends (the rest is the send slot).
pub(crate) const WR_SEND: u64 = 1 << 62;

// ------------------------------------------------------------------------------ device

pub(super) struct Context {
    pub(super) raw: *mut ibv_context,
    pub(super) name: String,
}
// SAFETY: ibverbs contexts are thread-safe (rdma-core documents the verbs as MT-safe).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}
impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: last owner; every child object holds an Arc<Context> and is gone.
        let rc = unsafe { ibv_close_device(self.raw) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub(super) raw: *mut ibv_pd,
    pub(super) ctx: Arc<Context>,
}
// SAFETY: a PD is a kernel handle; the verbs taking it are MT-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}
impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR, MW, SRQ and QP holds an Arc<Pd>, so none is left.
        let rc = unsafe { ibv_dealloc_pd(self.raw) };
        if rc != 0 {
            tracing::warn!(device = %self.ctx.name, rc, "ibv_dealloc_pd failed");
        }
    }
}

/// An opened RDMA device, port and GID, and its protection domain.
pub(crate) struct Device {
    pub(crate) pd: Arc<Pd>,
    pub(crate) port: u8,
    pub(crate) active_mtu: u32,
    pub(crate) gid: [u8; 16],
    pub(crate) gid_index: u8,
    pub(crate) rd_atomic: u8,
    pub(crate) max_mw: u32,
}

/// The non-empty entries of a port's GID table, as (index, GID).
///
/// # Safety
/// `ctx` must be an open device context.
unsafe fn gid_table(ctx: *mut ibv_context, port: u8, len: i32) -> Vec<(u32, [u8; 16])> {
    (0..len.clamp(0, 1024))
        .filter_map(|i| {
            // SAFETY: per the contract; `g` is a plain out-parameter.
            let mut g: ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let rc = unsafe { ibv_query_gid(ctx, port, i, &mut g) };
            // SAFETY: every bit pattern is a valid `raw`.
            let raw = unsafe { g.raw };
            (rc == 0 && raw.iter().any(|b| *b != 0)).then_some((i as u32, raw))
        })
        .collect()
}

fn port_state(state: u32) -> &'static str {
    match state {
        ibv_port_state::IBV_PORT_DOWN => "DOWN",
        ibv_port_state::IBV_PORT_INIT => "INIT",
        ibv_port_state::IBV_PORT_ARMED => "ARMED",
        ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
        ibv_port_state::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

/// Every device, port and GID (the preflight, [`crate::probe`]). A device that cannot be opened
/// is listed without ports.
pub(crate) fn probe_devices() -> Result<Vec<DeviceInfo>, FabricError> {
    // SAFETY: plain verbs calls; every pointer is checked before use, each context opened here
    // is closed here, and the list is freed after the loop.
    unsafe {
        let mut n = 0i32;
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            let e = io::Error::last_os_error();
            return Err(err(format!(
                "no RDMA device found (ibv_get_device_list: {e}; no /dev/infiniband or no rdma driver loaded)"
            )));
        }
        let mut out = Vec::new();
        for i in 0..n.max(0) as usize {
            let d = *list.add(i);
            let name = CStr::from_ptr(ibv_get_device_name(d)).to_string_lossy().into_owned();
            let mut info = DeviceInfo { name: name.clone(), ports: Vec::new(), max_mw: 0 };
            let ctx = ibv_open_device(d);
            if !ctx.is_null() {
                let mut attr: ibv_device_attr = std::mem::zeroed();
                if ibv_query_device(ctx, &mut attr) == 0 {
                    info.max_mw = attr.max_mw.max(0) as u32;
                    for port in 1..=attr.phys_port_cnt {
                        let mut pa: ibv_port_attr = std::mem::zeroed();
                        if ___ibv_query_port(ctx, port, &mut pa) != 0 {
                            continue;
                        }
                        let gids = gid_table(ctx, port, pa.gid_tbl_len)
                            .into_iter()
                            .map(|(index, gid)| {
                                let (kind, netdev) = crate::ports::gid_attrs(&name, port, index);
                                GidInfo { index, gid, kind, netdev }
                            })
                            .collect();
                        info.ports.push(PortInfo {
                            port,
                            state: port_state(pa.state).into(),
                            // IBV_LINK_LAYER_INFINIBAND and _ETHERNET (an anonymous enum in
                            // verbs.h that the bindings do not carry).
                            link_layer: match pa.link_layer {
                                1 => "InfiniBand",
                                2 => "Ethernet",
                                _ => "unspecified",
                            }
                            .into(),
                            active_mtu: mtu_bytes(pa.active_mtu),
                            max_mtu: mtu_bytes(pa.max_mtu),
                            gids,
                        });
                    }
                }
                ibv_close_device(ctx);
            }
            out.push(info);
        }
        ibv_free_device_list(list);
        Ok(out)
    }
}

impl Device {
    /// Opens `device` (or the first device with an active `port`), picks the GID, allocates
    /// the protection domain. Errors say what is missing and which knob picks another.
    pub(crate) fn open(device: Option<&str>, port: u8, gid_index: Option<u8>) -> Result<Device, FabricError> {
        // SAFETY: plain verbs calls; every pointer is checked before use, and the device list
        // is freed after the chosen device was opened (opening keeps its own reference).
        unsafe {
            let mut n = 0i32;
            let list = ibv_get_device_list(&mut n);
            if list.is_null() || n == 0 {
                let e = io::Error::last_os_error();
                if !list.is_null() {
                    ibv_free_device_list(list);
                }
                return Err(err(format!(
                    "no RDMA device found (ibv_get_device_list: {e}; no /dev/infiniband or no rdma driver loaded)"
                )));
            }
            let mut names = Vec::new();
            let mut chosen = None;
            for i in 0..n as usize {
                let d = *list.add(i);
                let name = CStr::from_ptr(ibv_get_device_name(d)).to_string_lossy().into_owned();
                let wanted = device.map(|w| w == name).unwrap_or(true);
                if wanted && chosen.is_none() {
                    let ctx = ibv_open_device(d);
                    if !ctx.is_null() {
                        let mut pa: ibv_port_attr = std::mem::zeroed();
                        let active = ___ibv_query_port(ctx, port, &mut pa) == 0 && pa.state == ibv_port_state::IBV_PORT_ACTIVE;
                        if active || device.is_some() {
                            chosen = Some((Context { raw: ctx, name: name.clone() }, pa, active));
                        } else {
                            ibv_close_device(ctx);
                        }
                    }
                }
                names.push(name);
            }
            ibv_free_device_list(list);
            let (ctx, port_attr, active) = chosen.ok_or_else(|| match device {
                Some(d) => err_knob(format!("RDMA device {d} not found or cannot be opened (devices: {names:?})"), Knob::Device),
                None => err(format!("no RDMA device has an active port {port} (devices: {names:?})")),
            })?;
            if !active {
                return Err(err_knob(format!("port {port} of {} is not active", ctx.name), Knob::Device));
            }
            let ctx = Arc::new(ctx);
            let mut dev_attr: ibv_device_attr = std::mem::zeroed();
            let rc = ibv_query_device(ctx.raw, &mut dev_attr);
            if rc != 0 {
                return Err(rc_err("ibv_query_device", rc));
            }
            let table = gid_table(ctx.raw, port, port_attr.gid_tbl_len);
            let (gid_index, _why) = crate::ports::pick_gid(&table, gid_index)
                .map_err(|e| err_knob(format!("{} port {port}: {e}", ctx.name), Knob::GidIndex))?;
            let gid = table.iter().find(|(i, _)| *i == u32::from(gid_index)).map(|(_, g)| *g).unwrap_or_default();
            let pd = ibv_alloc_pd(ctx.raw);
            if pd.is_null() {
                return Err(os_err("ibv_alloc_pd"));
            }
            Ok(Device {
                pd: Arc::new(Pd { raw: pd, ctx }),
                port,
                active_mtu: port_attr.active_mtu,
                gid,
                gid_index,
                rd_atomic: dev_attr.max_qp_rd_atom.clamp(1, 16) as u8,
                max_mw: dev_attr.max_mw.max(0) as u32,
            })
        }
    }

    /// The device's name.
    pub(crate) fn name(&self) -> &str {
        &self.pd.ctx.name
    }
}
