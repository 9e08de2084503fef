//! Every `unsafe` of the verbs provider: RAII wrappers over the ibverbs objects, each owning
//! `Arc`s of its parents so teardown runs in the order the kernel requires (a QP before its
//! CQ and SRQ — `ibv_destroy_cq` fails with `EBUSY` while a QP uses it; memory windows before
//! the memory region they are bound to; every MR and QP before the protection domain; the
//! domain before the device context). `Drop` logs failures, never panics: this runs inside
//! an executor JVM.
//!
//! Memory the device may write (receive buffers, READ targets) or read (send buffers, exposed
//! regions) is owned here for as long as work posted on it is outstanding:
//!
//! * receive and send buffers are slabs owned by [`Srq`] and [`SendBuffers`]; a slot is
//!   writable by the caller only while it is not posted;
//! * a READ takes its target [`Lease`] by value and keeps it in the queue pair's table of
//!   posted work until the completion (success or flush) comes back — so no code path can
//!   return the buffer to the pool while the NIC may still write into it;
//! * a bind keeps its window alive until its completion.
//!
//! Posting needs a [`Poster`], which only a queue pair in the ready-to-send state hands out:
//! after [`Qp::enter_error_state`] nothing more can be posted, and every posted request completes
//! (flushed) before the queue pair may be destroyed.

mod device;
mod memory;
mod qp;
mod queues;

pub(crate) use device::{err, probe_devices, Device, WR_RECV, WR_SEND};
pub(crate) use memory::{register_for_probe, Exposure, PoolRegistrar, UserRegion};
pub(crate) use qp::{Completed, Qp, QpTimers};
pub(crate) use queues::{CompChannel, Cq, SendBuffers, Srq, Wc};
