//! The system calls of the shm provider, each wrapped once with its `# Safety` reasoning, so
//! the rest of the provider is safe code over owned descriptors.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cvt_size(r: libc::ssize_t) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// An anonymous memory file of `len` bytes, sealed so that nobody (the peer included) can
/// shrink or grow it: a peer that could shrink it would make our next touch of the mapping a
/// SIGBUS. It has no name in any filesystem and is freed with its last descriptor/mapping.
pub(crate) fn memfd_sealed(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid NUL-terminated name; the flags are memfd_create's.
    let fd = cvt(unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) })?;
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate and fcntl on a descriptor we own.
    unsafe {
        cvt(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t))?;
        cvt(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL))?;
    }
    Ok(fd)
}

/// The size and seals of a memory file a peer handed us.
pub(crate) fn memfd_size_and_seals(fd: &OwnedFd) -> io::Result<(u64, libc::c_int)> {
    // SAFETY: fstat into a zeroed stat we own; fcntl F_GET_SEALS takes no argument.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        cvt(libc::fstat(fd.as_raw_fd(), &mut st))?;
        let seals = cvt(libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS))?;
        Ok((st.st_size as u64, seals))
    }
}

/// A shared, read-write mapping of a whole memory file; unmapped on drop.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through the ring's
// atomics or through copies the ring's protocol orders.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out the base pointer.
unsafe impl Sync for Mapping {}

/// Maps (allocating where needed) every page of `len` bytes at `ptr` into this process in one
/// system call (`MADV_POPULATE_WRITE`), so later first touches do not fault one page at a
/// time. Best effort: a kernel before 5.14 refuses it (`EINVAL`), a range that is not
/// page-aligned too (the rings' test memory), and the pages then fault in as they are
/// touched.
pub(crate) fn populate(ptr: *mut u8, len: usize) {
    // SAFETY: madvise only changes which pages are mapped; the range is the caller's ring
    // (live memory of this process), and an invalid one is refused, not touched.
    unsafe { libc::madvise(ptr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
}

impl Mapping {
    /// Maps `len` bytes of `fd` shared.
    pub(crate) fn new(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        // Not populated: a page is made when a side first touches it, and small traffic
        // keeps to the first 64 KiB of each ring (ring.rs, `WARM`), so a link used for small
        // messages touches a few pages, not its whole segment; a ring that carries larger
        // records is mapped whole when the first one comes (`populate`). Populating both 2 MiB rings
        // (allocating, zeroing and mapping 1,024 pages per side, freeing them at close) was
        // nearly all of a group's shm setup (`perf record` of the `mesh_setup` example).
        // SAFETY: a fresh mapping chosen by the kernel; the file is at least `len` bytes long
        // and sealed against shrinking (checked by the caller for files a peer sent).
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr as *mut u8, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the range mmap returned; nothing refers into it after drop (the
        // rings that point here are owned by the same connection and dropped with it).
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
        }
    }
}

/// A nonblocking eventfd: the doorbell a sleeping side waits on.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd with valid flags; the result is a new descriptor we own.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
    // SAFETY: just returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd (wakes whoever polls it). A full counter (never in practice) still
/// leaves it readable, so `EAGAIN` is success too.
pub(crate) fn eventfd_ring(fd: RawFd) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64.
    let r = unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
    match cvt_size(r) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(e),
    }
}

/// Resets an eventfd's counter (after a wakeup), so level-triggered polls sleep again.
pub(crate) fn eventfd_drain(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64; EAGAIN (nothing to drain) is fine.
    unsafe {
        libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8);
    }
}

/// The abstract-namespace address `name` (no filesystem entry; scoped to the network
/// namespace).
fn abstract_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all-zero is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() + 1 > a.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("shm address `{name}` is empty or longer than 107 bytes"),
        ));
    }
    // sun_path[0] = 0 marks the abstract namespace; the name follows, not NUL-terminated.
    for (i, b) in bytes.iter().enumerate() {
        a.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    Ok((a, len as libc::socklen_t))
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with valid constants; the result is a new descriptor we own.
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: just returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening, nonblocking SEQPACKET socket on the abstract name `name`.
pub(crate) fn listen_abstract(name: &str) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (addr, len) = abstract_addr(name)?;
    // SAFETY: bind/listen on our socket with an address that lives for the call.
    unsafe {
        cvt(libc::bind(fd.as_raw_fd(), &addr as *const libc::sockaddr_un as *const libc::sockaddr, len))?;
        cvt(libc::listen(fd.as_raw_fd(), 128))?;
    }
    set_nonblocking(&fd)?;
    Ok(fd)
}

/// Connects to the abstract name `name`; waits at most `timeout` while the listener's
/// backlog is full. The socket is nonblocking afterwards.
pub(crate) fn connect_abstract(name: &str, timeout: Duration) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (addr, len) = abstract_addr(name)?;
    let tv = libc::timeval {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_usec: timeout.subsec_micros().max(1) as libc::suseconds_t,
    };
    // SAFETY: setsockopt with a live timeval; connect with an address that lives for the call.
    unsafe {
        cvt(libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        ))?;
        cvt(libc::connect(fd.as_raw_fd(), &addr as *const libc::sockaddr_un as *const libc::sockaddr, len))?;
    }
    set_nonblocking(&fd)?;
    Ok(fd)
}

/// Accepts one connection, nonblocking; `Ok(None)` when none waits.
pub(crate) fn accept(listener: &OwnedFd) -> io::Result<Option<OwnedFd>> {
    loop {
        // SAFETY: accept4 on our listening socket without a peer address.
        let r = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            )
        };
        match cvt(r) {
            // SAFETY: just returned by the kernel.
            Ok(fd) => return Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) })),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl flag get/set on our descriptor.
    unsafe {
        let fl = cvt(libc::fcntl(fd.as_raw_fd(), libc::F_GETFL))?;
        cvt(libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK))?;
    }
    Ok(())
}

/// The process, user and group at the other end of a Unix socket, as the kernel recorded
/// them at connect/listen time (not what the peer claims).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerCred {
    pub(crate) pid: libc::pid_t,
    pub(crate) uid: libc::uid_t,
    pub(crate) gid: libc::gid_t,
}

pub(crate) fn peer_cred(fd: &OwnedFd) -> io::Result<PeerCred> {
    let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a live ucred of the stated length.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut c as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    })?;
    Ok(PeerCred { pid: c.pid, uid: c.uid, gid: c.gid })
}

/// This process's effective user id.
pub(crate) fn euid() -> libc::uid_t {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Most descriptors one message carries (the segment and two doorbells).
pub(crate) const MAX_FDS: usize = 3;

/// Sends one message with `fds` attached (SCM_RIGHTS).
pub(crate) fn send_msg(sock: &OwnedFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // Control buffer aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; zero is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: CMSG_* compute sizes and walk our own control buffer, which is large enough
        // for MAX_FDS descriptors (checked by CMSG_SPACE ≤ its size below).
        unsafe {
            let space = libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) as usize;
            assert!(space <= std::mem::size_of_val(&cbuf));
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut RawFd, fds.len());
        }
    }
    loop {
        // SAFETY: msg points at live iov and control buffers for the call.
        match cvt_size(unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) }) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(_) => return Err(io::Error::new(io::ErrorKind::WriteZero, "short write of a handshake message")),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// One received message.
pub(crate) enum Recv {
    /// Nothing waiting.
    Empty,
    /// The peer closed (or died: the kernel closes its end).
    Closed,
    /// A message and the descriptors that came with it (every one now owned by us: unwanted
    /// ones are closed when dropped).
    Msg(Vec<u8>, Vec<OwnedFd>),
}

/// Receives one message (nonblocking), at most `max` bytes; a longer message is an error.
pub(crate) fn recv_msg(sock: &OwnedFd, max: usize) -> io::Result<Recv> {
    let mut buf = vec![0u8; max + 1];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
    let mut cbuf = [0u64; 16];
    loop {
        // SAFETY: msghdr is plain data; zero is a valid start.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        // SAFETY: msg points at live buffers of the stated sizes.
        let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
        let n = match cvt_size(r) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Recv::Empty),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let mut fds = Vec::new();
        // SAFETY: walks the control messages the kernel wrote into our buffer; every
        // SCM_RIGHTS descriptor is a new one installed in our table, owned from here on.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c) as *const RawFd;
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the peer sent more descriptors than a handshake carries"));
        }
        if n == 0 && fds.is_empty() {
            return Ok(Recv::Closed);
        }
        if n > max || msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("handshake message longer than {max} bytes")));
        }
        buf.truncate(n);
        return Ok(Recv::Msg(buf, fds));
    }
}

/// Waits until one of `fds` is readable or hung up, or `timeout` passes. Returns the
/// `revents` of each.
pub(crate) fn poll_in(fds: &[RawFd], timeout: Duration) -> io::Result<Vec<libc::c_short>> {
    let mut p: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }).collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: poll over our own array of pollfds.
    match cvt(unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) }) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
        Err(e) => return Err(e),
    }
    Ok(p.iter().map(|p| p.revents).collect())
}

/// Copies `dst.len()` bytes at address `addr` of process `pid` into `dst` with
/// process_vm_readv (cross-memory attach: one copy, no intermediate buffer). Needs ptrace
/// permission over `pid`.
pub(crate) fn vm_read(pid: libc::pid_t, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let local = libc::iovec { iov_base: dst[done..].as_mut_ptr() as *mut libc::c_void, iov_len: dst.len() - done };
        let remote = libc::iovec { iov_base: (addr + done as u64) as usize as *mut libc::c_void, iov_len: dst.len() - done };
        // SAFETY: the local iovec covers our own live buffer; the kernel checks the remote one
        // against the other process's address space (EFAULT, never a fault here).
        let n = cvt_size(unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) });
        match n {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "process_vm_readv read nothing")),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
