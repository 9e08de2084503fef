//! `mobius._native`: the Python binding of Mobius.
//!
//! Buffers come in through the Python buffer protocol (numpy arrays, torch tensors viewed as
//! numpy arrays, `bytearray`, `memoryview`): the collective runs on the exporter's memory, in
//! place, with no copy, and with the GIL released. The export is held for the whole call, so
//! the memory cannot be resized or freed under it. The pure-Python layer (`mobius/__init__.py`)
//! maps numpy/torch dtypes and tensors onto this.

use mobius_collective::{
    CollectiveError, CommConfig, Communicator, CostModel, DType, GroupKey, Op, Overrides, ReduceOp, Rendezvous,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::net::{IpAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

create_exception!(_native, MobiusError, PyRuntimeError, "A collective failed: a peer died, left, aborted or timed out, or ranks passed different arguments. The message names the ranks.");

fn to_py(e: CollectiveError) -> PyErr {
    match e {
        CollectiveError::InvalidArgument { .. } | CollectiveError::Config(_) => PyValueError::new_err(e.to_string()),
        other => MobiusError::new_err(other.to_string()),
    }
}

/// A buffer-protocol export, released (with the GIL held) on drop.
struct View {
    view: Box<ffi::Py_buffer>,
}

impl View {
    fn get(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<View> {
        // SAFETY: a zeroed Py_buffer is a valid out-parameter; on success it must be released
        // exactly once (Drop), on failure it is left untouched.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let flags = ffi::PyBUF_C_CONTIGUOUS | if writable { ffi::PyBUF_WRITABLE } else { 0 };
        // SAFETY: `obj` is a live object (we hold a reference and the GIL).
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py()).map(|e| e.to_string()).unwrap_or_default();
            return Err(PyBufferError::new_err(format!(
                "`{what}` must be a C-contiguous{} buffer (numpy array, CPU tensor): {cause}",
                if writable { ", writable" } else { "" }
            )));
        }
        Ok(View { view })
    }

    fn len(&self) -> usize {
        self.view.len as usize
    }

    fn ptr(&self) -> *mut u8 {
        self.view.buf as *mut u8
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer; every View is
        // dropped while the GIL is held (the calls below re-acquire it before dropping).
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

/// A raw buffer handed to a thread without the GIL; the `View` it came from outlives it.
#[derive(Clone, Copy)]
struct Raw(*mut u8, usize);
// SAFETY: the memory is only touched by the one thread running the collective while the
// caller waits for it, and the export that keeps it alive is held across the call.
unsafe impl Send for Raw {}

impl Raw {
    fn of(v: &View) -> Raw {
        Raw(v.ptr(), v.len())
    }
    /// # Safety
    /// The export behind it must be alive and not aliased mutably elsewhere.
    unsafe fn slice<'a>(self) -> &'a mut [u8] {
        if self.1 == 0 {
            return &mut [];
        }
        // SAFETY: forwarded.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

fn dtype(s: &str) -> PyResult<DType> {
    s.parse().map_err(PyValueError::new_err)
}

fn reduce_op(s: &str) -> PyResult<ReduceOp> {
    s.parse().map_err(PyValueError::new_err)
}

/// Calls a Python function `exchange(my_address: str) -> list[str]` (e.g. over torch's store).
struct PyRendezvous {
    exchange: PyObject,
}

impl Rendezvous for PyRendezvous {
    fn exchange(&mut self, _rank: usize, world: usize, mine: &str, _deadline: Instant) -> Result<Vec<String>, String> {
        Python::with_gil(|py| {
            let out = self.exchange.call1(py, (mine,)).map_err(|e| format!("address exchange failed: {e}"))?;
            let list: Vec<String> = out.extract(py).map_err(|e| format!("address exchange returned no list of str: {e}"))?;
            if list.len() != world {
                return Err(format!("address exchange returned {} addresses for a world of {world}", list.len()));
            }
            Ok(list)
        })
    }
}

fn config(rank: usize, world: usize, settings: Option<&Bound<'_, PyDict>>) -> PyResult<CommConfig> {
    let mut c = CommConfig::new(rank, world);
    c.apply_env().map_err(to_py)?;
    let Some(s) = settings else { return Ok(c) };
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> { s.get_item(k) };
    if let Some(v) = get("timeout")? {
        let secs: f64 = v.extract()?;
        if !(secs > 0.0 && secs.is_finite()) {
            return Err(PyValueError::new_err(format!("timeout={secs} must be positive seconds")));
        }
        c.timeout = Duration::from_secs_f64(secs);
    }
    if let Some(v) = get("transport")? {
        let t: String = v.extract()?;
        c.set_transport(&t).map_err(|e| PyValueError::new_err(format!("transport={t:?}: {e}")))?;
        if let Some(d) = get("device")? {
            c.device = Some(d.extract()?);
        }
    }
    if let Some(v) = get("secret")? {
        c.secret = Some(v.extract()?);
    }
    if let Some(v) = get("job")? {
        c.job = v.extract()?;
    }
    if let Some(v) = get("group")? {
        let g: String = v.extract()?;
        c.group = Some(
            GroupKey::decode(&g)
                .ok_or_else(|| PyValueError::new_err("group must be 'id:secret' in hex (from the rendezvous)"))?,
        );
    }
    if let Some(v) = get("eager_limit")? {
        c.eager_limit = v.extract()?;
    }
    if let Some(v) = get("max_message")? {
        c.max_message = v.extract()?;
    }
    if let Some(v) = get("tune")? {
        c.tune = v.extract()?;
    }
    let (algo, proto, segment): (Option<String>, Option<String>, Option<String>) = (
        get("algo")?.map(|v| v.extract()).transpose()?,
        get("proto")?.map(|v| v.extract()).transpose()?,
        get("segment")?.map(|v| v.str().map(|s| s.to_string())).transpose()?,
    );
    if algo.is_some() || proto.is_some() || segment.is_some() {
        let env = |k: &str| std::env::var(k).ok();
        c.overrides = Overrides::parse(
            algo.or_else(|| env("MOBIUS_ALGO")).as_deref(),
            proto.or_else(|| env("MOBIUS_PROTO")).as_deref(),
            segment.or_else(|| env("MOBIUS_SEGMENT")).as_deref(),
        )
        .map_err(to_py)?;
    }
    if let Some(v) = get("model")? {
        // A dict as `cost_model()` returns it (a parent group's): used instead of measuring.
        let d = v.downcast::<PyDict>()?;
        let f = |k: &str| -> PyResult<f64> {
            d.get_item(k)?.ok_or_else(|| PyValueError::new_err(format!("model: missing {k:?}")))?.extract()
        };
        c.model = Some(CostModel {
            alpha: f("alpha")?,
            beta: f("beta")?,
            gamma: f("gamma")?,
            copy: f("copy")?,
            alpha_rndv: f("alpha_rndv")?,
            local_alpha: f("local_alpha")?,
            local_beta: f("local_beta")?,
        });
    }
    if let Some(v) = get("debug_policy")? {
        c.debug_policy = v.extract()?;
    }
    Ok(c)
}

/// One measured link as Python sees it: `(a, b, alpha, beta, alpha_rndv)`.
type LinkRow = (usize, usize, f64, f64, f64);

/// A Mobius communicator (see the `mobius` package for the documented Python API).
#[pyclass(name = "Communicator", module = "mobius._native", frozen)]
struct PyComm {
    inner: slot::Slot,
}

/// A tiny lock-protected slot, so `close()` can drop the communicator while other methods
/// hold their own `Arc`.
mod slot {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Slot(Mutex<Option<Arc<Communicator>>>);

    impl Slot {
        pub fn new(c: Communicator) -> Self {
            Slot(Mutex::new(Some(Arc::new(c))))
        }
        pub fn get(&self) -> PyResult<Arc<Communicator>> {
            self.0
                .lock()
                .map_err(|_| PyRuntimeError::new_err("communicator lock poisoned"))?
                .clone()
                .ok_or_else(|| MobiusError::new_err("the communicator is closed"))
        }
        pub fn take(&self) -> Option<Arc<Communicator>> {
            self.0.lock().ok()?.take()
        }
    }
}

impl PyComm {
    fn run(&self, py: Python<'_>, f: impl FnOnce(&Communicator) -> Result<(), CollectiveError> + Send) -> PyResult<()> {
        let comm = self.inner.get()?;
        py.allow_threads(move || f(&comm)).map_err(to_py)
    }
}

#[pymethods]
impl PyComm {
    /// Joins a group through the store served by rank 0 at `master_addr:master_port`.
    #[staticmethod]
    #[pyo3(signature = (rank, world_size, master_addr, master_port, settings=None))]
    fn init(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: u16,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let c = config(rank, world_size, settings)?;
        let master = (master_addr, master_port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.find(|a| a.is_ipv4()))
            .ok_or_else(|| PyValueError::new_err(format!("master_addr {master_addr:?} does not resolve")))?;
        let comm = py.allow_threads(move || Communicator::init(c, master)).map_err(to_py)?;
        Ok(PyComm { inner: slot::Slot::new(comm) })
    }

    /// Joins a group whose addresses are exchanged by `exchange(my_address) -> [address of
    /// each rank]` (the torch backend passes one over torch's store). The mesh listens on `ip`.
    #[staticmethod]
    #[pyo3(signature = (rank, world_size, ip, exchange, settings=None))]
    fn join(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        ip: &str,
        exchange: PyObject,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let c = config(rank, world_size, settings)?;
        let ip: IpAddr = ip.parse().map_err(|_| PyValueError::new_err(format!("{ip:?} is not an IP address")))?;
        let mut rdv = PyRendezvous { exchange };
        let comm = py.allow_threads(move || Communicator::join(c, ip, &mut rdv)).map_err(to_py)?;
        Ok(PyComm { inner: slot::Slot::new(comm) })
    }

    /// (rank 0) The links measured at start, `(a, b, alpha, beta, alpha_rndv)`: the cost
    /// model takes the worst of them. Empty on other ranks, and when nothing was measured.
    fn link_costs(&self) -> PyResult<Vec<LinkRow>> {
        Ok(self.inner.get()?.link_costs().iter().map(|l| (l.a, l.b, l.alpha, l.beta, l.alpha_rndv)).collect())
    }

    /// The host index of each rank, in rank order.
    #[getter]
    fn hosts(&self) -> PyResult<Vec<usize>> {
        Ok(self.inner.get()?.topology().host_of.clone())
    }

    /// Every rank's published mesh address (`ip:port`), in rank order.
    #[getter]
    fn addresses(&self) -> PyResult<Vec<String>> {
        Ok(self.inner.get()?.addresses().iter().map(|a| a.to_string()).collect())
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.inner.get()?.rank())
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> PyResult<usize> {
        Ok(self.inner.get()?.world())
    }

    /// Per-call timeout in seconds.
    #[getter]
    fn timeout(&self) -> PyResult<f64> {
        Ok(self.inner.get()?.timeout().as_secs_f64())
    }

    fn allreduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dtype_: &str, op: &str) -> PyResult<()> {
        let (d, o) = (dtype(dtype_)?, reduce_op(op)?);
        let v = View::get(buf, true, "tensor")?;
        let r = Raw::of(&v);
        // SAFETY (every `slice` below): `v` keeps the export alive until after the call.
        self.run(py, move |c| c.allreduce_bytes(unsafe { r.slice() }, d, o))
    }

    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dtype_: &str, root: usize) -> PyResult<()> {
        let d = dtype(dtype_)?;
        let v = View::get(buf, true, "tensor")?;
        let r = Raw::of(&v);
        self.run(py, move |c| c.broadcast_bytes(unsafe { r.slice() }, d, root))
    }

    fn reduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dtype_: &str, op: &str, root: usize) -> PyResult<()> {
        let (d, o) = (dtype(dtype_)?, reduce_op(op)?);
        let v = View::get(buf, true, "tensor")?;
        let r = Raw::of(&v);
        self.run(py, move |c| c.reduce_bytes(unsafe { r.slice() }, d, o, root))
    }

    fn allgather(&self, py: Python<'_>, send: &Bound<'_, PyAny>, recv: &Bound<'_, PyAny>, dtype_: &str) -> PyResult<()> {
        let d = dtype(dtype_)?;
        let (vs, vr) = (View::get(send, false, "input")?, View::get(recv, true, "output")?);
        let (s, r) = (Raw::of(&vs), Raw::of(&vr));
        self.run(py, move |c| {
            if overlaps(s, r) && s.0 as usize == r.0 as usize + c.rank() * s.1 && r.1 == c.world() * s.1 {
                // The input is this rank's block of the output: an in-place allgather (FSDP's).
                return c.allgather_in_place_bytes(unsafe { r.slice() }, d);
            }
            with_input(s, r, |send, recv| c.allgather_bytes(send, recv, d))
        })
    }

    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        dtype_: &str,
        op: &str,
    ) -> PyResult<()> {
        let (d, o) = (dtype(dtype_)?, reduce_op(op)?);
        let (vs, vr) = (View::get(send, false, "input")?, View::get(recv, true, "output")?);
        let (s, r) = (Raw::of(&vs), Raw::of(&vr));
        // An output inside the input (an in-place reduce-scatter) reads a copy of the input.
        self.run(py, move |c| with_input(s, r, |send, recv| c.reduce_scatter_bytes(send, recv, d, o)))
    }

    fn alltoall(&self, py: Python<'_>, send: &Bound<'_, PyAny>, recv: &Bound<'_, PyAny>, dtype_: &str) -> PyResult<()> {
        let d = dtype(dtype_)?;
        let (vs, vr) = (View::get(send, false, "input")?, View::get(recv, true, "output")?);
        let (s, r) = (Raw::of(&vs), Raw::of(&vr));
        self.run(py, move |c| with_input(s, r, |send, recv| c.alltoall_bytes(send, recv, d)))
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| c.barrier())
    }

    /// A barrier naming the ranks that did not come within `timeout` seconds (rank 0 fails
    /// with them; the others fail when rank 0 does not release them).
    #[pyo3(signature = (timeout, wait_all_ranks=false))]
    fn monitored_barrier(&self, py: Python<'_>, timeout: f64, wait_all_ranks: bool) -> PyResult<()> {
        let t = Duration::try_from_secs_f64(timeout)
            .map_err(|e| PyValueError::new_err(format!("monitored_barrier: timeout {timeout} s: {e}")))?;
        self.run(py, move |c| c.monitored_barrier(t, wait_all_ranks))
    }

    #[pyo3(signature = (buf, dst, tag=0))]
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dst: usize, tag: u32) -> PyResult<()> {
        let v = View::get(buf, false, "tensor")?;
        let r = Raw::of(&v);
        self.run(py, move |c| c.send_bytes(unsafe { r.slice() }, dst, tag))
    }

    #[pyo3(signature = (buf, src, tag=0))]
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: usize, tag: u32) -> PyResult<()> {
        let v = View::get(buf, true, "tensor")?;
        let r = Raw::of(&v);
        self.run(py, move |c| c.recv_bytes(unsafe { r.slice() }, src, tag))
    }

    /// Receives into `buf` under `tag` from whichever rank sends first; returns that rank.
    #[pyo3(signature = (buf, tag=0))]
    fn recv_any(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, tag: u32) -> PyResult<usize> {
        let v = View::get(buf, true, "tensor")?;
        let r = Raw::of(&v);
        let comm = self.inner.get()?;
        py.allow_threads(move || comm.recv_any_bytes(unsafe { r.slice() }, tag)).map_err(to_py)
    }

    /// What the policy would choose: `(algorithm, segment bytes, protocol of a segment)`.
    #[pyo3(signature = (op, nbytes, dtype_="f32"))]
    fn decide(&self, op: &str, nbytes: usize, dtype_: &str) -> PyResult<(String, usize, String)> {
        let c = self.inner.get()?;
        let op = Op::ALL
            .into_iter()
            .find(|o| o.name() == op)
            .ok_or_else(|| PyValueError::new_err(format!("unknown op {op:?}; ops: {}", Op::ALL.map(|o| o.name()).join(" "))))?;
        let d = c.decide(op, nbytes, dtype(dtype_)?);
        let proto = c.policy().proto(d.segment.min(nbytes.max(1)));
        Ok((d.algo.name().to_string(), d.segment, proto.name().to_string()))
    }

    /// The cost model every rank uses: alpha, beta, gamma, copy, alpha_rndv, local_alpha,
    /// local_beta (seconds, s/B).
    fn cost_model<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.inner.get()?.policy().model;
        let d = PyDict::new(py);
        d.set_item("alpha", m.alpha)?;
        d.set_item("beta", m.beta)?;
        d.set_item("gamma", m.gamma)?;
        d.set_item("copy", m.copy)?;
        d.set_item("alpha_rndv", m.alpha_rndv)?;
        d.set_item("local_alpha", m.local_alpha)?;
        d.set_item("local_beta", m.local_beta)?;
        Ok(d)
    }

    /// Counters: calls per `op.algorithm`, bytes per op, and messages/bytes per protocol.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.get()?;
        let s = c.stats();
        let d = PyDict::new(py);
        let calls = PyDict::new(py);
        for (k, v) in &s.calls {
            calls.set_item(k, v)?;
        }
        let bytes = PyDict::new(py);
        for (k, v) in &s.bytes {
            bytes.set_item(k, v)?;
        }
        d.set_item("calls", calls)?;
        d.set_item("bytes", bytes)?;
        let t = s.transport;
        for (k, v) in [
            ("eager_messages", t.eager_messages),
            ("eager_bytes", t.eager_bytes),
            ("rendezvous_messages", t.rendezvous_messages),
            ("rendezvous_bytes", t.rendezvous_bytes),
            ("eager_received", t.eager_received),
            ("rendezvous_received", t.rendezvous_received),
            ("one_sided_reads", t.one_sided_reads),
            ("registrations", t.registrations),
            ("registration_hits", t.registration_hits),
            ("placed", t.placed),
            ("placed_bytes", t.placed_bytes),
            ("folded", t.folded),
            ("folded_bytes", t.folded_bytes),
            ("staged", t.staged),
            ("staged_bytes", t.staged_bytes),
            ("eager_in_place", t.eager_in_place),
            ("joined", t.joined),
        ] {
            d.set_item(k, v)?;
        }
        let provider = PyList::empty(py);
        for (k, v) in c.provider_counters() {
            provider.append((k, v))?;
        }
        d.set_item("provider", provider)?;
        d.set_item("transport", c.transport().mesh().provider_name())?;
        Ok(d)
    }

    /// Forgets cached registrations of `[ptr, ptr + nbytes)` (memory about to be freed).
    fn invalidate(&self, ptr: usize, nbytes: usize) -> PyResult<()> {
        self.inner.get()?.invalidate(ptr as *const u8, nbytes);
        Ok(())
    }

    /// Ends the group at once: every pending call of this rank fails now, on any thread, and
    /// every peer is told (naming `culprit` as the rank that failed, when given). The
    /// communicator is unusable afterwards; `close()` releases it.
    #[pyo3(signature = (reason, culprit=None))]
    fn abort(&self, py: Python<'_>, reason: &str, culprit: Option<usize>) -> PyResult<()> {
        let c = self.inner.get()?;
        py.allow_threads(move || c.abort(culprit, reason));
        Ok(())
    }

    /// The abort this rank's group saw, if any: `(rank that aborted, rank that failed or
    /// None, reason)`.
    fn aborted(&self) -> PyResult<Option<(usize, Option<usize>, String)>> {
        Ok(self.inner.get()?.transport().mesh().aborted())
    }

    /// Closes the communicator (also when garbage-collected): says goodbye to every peer.
    fn close(&self, py: Python<'_>) {
        if let Some(c) = self.inner.take() {
            py.allow_threads(move || drop(c));
        }
    }
}

/// Calls `f(input, output)`; an input that overlaps the output is copied first, so the two
/// slices never alias (torch allows a collective in place: gloo's run on the same memory).
fn with_input(s: Raw, r: Raw, f: impl FnOnce(&[u8], &mut [u8]) -> Result<(), CollectiveError>) -> Result<(), CollectiveError> {
    if overlaps(s, r) {
        // SAFETY (both): the exports are alive across the call; the first slice is gone
        // before the second is made.
        let own = unsafe { s.slice() }.to_vec();
        return f(&own, unsafe { r.slice() });
    }
    // SAFETY: alive across the call and disjoint.
    f(unsafe { s.slice() }, unsafe { r.slice() })
}

fn overlaps(a: Raw, b: Raw) -> bool {
    let (a0, a1, b0, b1) = (a.0 as usize, a.0 as usize + a.1, b.0 as usize, b.0 as usize + b.1);
    a.1 > 0 && b.1 > 0 && a0 < b1 && b0 < a1
}

/// Names of the supported dtypes, reduce ops, collectives and algorithms.
/// The address this process should listen on and publish (`MOBIUS_IFADDR`, then
/// `MOBIUS_SOCKET_IFNAME`, then the interface routing to the store at `store_host:store_port`,
/// then the default route's), as a string.
#[pyfunction]
#[pyo3(signature = (store_host=None, store_port=0))]
fn local_ip(store_host: Option<&str>, store_port: u16) -> PyResult<String> {
    let mut c = CommConfig::new(0, 1);
    c.apply_env().map_err(to_py)?;
    let store = match store_host {
        Some(h) if !h.is_empty() => Some(
            (h, store_port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.find(|a| a.is_ipv4()))
                .ok_or_else(|| PyValueError::new_err(format!("store host {h:?} does not resolve")))?,
        ),
        _ => None,
    };
    Ok(c.local_ip(store).map_err(to_py)?.to_string())
}

/// A fresh group key (`id:secret`, hex), for rank 0 to hand to its group through a store.
#[pyfunction]
fn new_group_key() -> PyResult<String> {
    Ok(GroupKey::generate().map_err(to_py)?.encode())
}

#[pyfunction]
fn capabilities<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("dtypes", DType::ALL.map(|x| x.name()).to_vec())?;
    d.set_item("reduce_ops", ReduceOp::ALL.map(|x| x.name()).to_vec())?;
    let algos = PyDict::new(py);
    for op in Op::ALL {
        algos.set_item(op.name(), op.algorithms().iter().map(|a| a.name()).collect::<Vec<_>>())?;
    }
    d.set_item("algorithms", algos)?;
    d.set_item("verbs", cfg!(feature = "verbs"))?;
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // MOBIUS_DEBUG=policy (or MOBIUS_LOG=<filter>) prints Mobius' logs on stderr; otherwise
    // warnings (refused connections among them) do.
    let filter = std::env::var("MOBIUS_LOG")
        .ok()
        .or_else(|| std::env::var("MOBIUS_DEBUG").ok().map(|_| "mobius=info,warn".to_string()))
        .or_else(|| Some("warn".to_string()));
    if let Some(f) = filter {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(f))
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
    }
    m.add_class::<PyComm>()?;
    m.add_function(wrap_pyfunction!(capabilities, m)?)?;
    m.add_function(wrap_pyfunction!(local_ip, m)?)?;
    m.add_function(wrap_pyfunction!(new_group_key, m)?)?;
    m.add("MobiusError", m.py().get_type::<MobiusError>())?;
    Ok(())
}
