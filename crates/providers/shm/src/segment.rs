//! The shared segment of one connection: a sealed memfd holding a header, the two sides'
//! "about to sleep" flags and two rings (accepting side → connecting side, and back).
//!
//! ```text
//!  0     magic u64 · version u32 · ring bytes u32
//!  64    flag: side 0 (acceptor) sleeps         128   flag: side 1 (connector) sleeps
//!  192   ring 0 head   256 ring 0 tail   320 ring 1 head   384 ring 1 tail   (a line each)
//!  4096  ring 0 data (acceptor → connector)    4096 + R   ring 1 data (connector → acceptor)
//! ```

use super::ring::RingPtrs;
use super::sys::{self, Mapping};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"RSSHMSG1");
const VERSION: u32 = 1;
const HEADER: usize = 4096;
const FLAG: [usize; 2] = [64, 128];
const HEAD: [usize; 2] = [192, 320];
const TAIL: [usize; 2] = [256, 384];

/// Smallest and largest ring, per direction.
pub(crate) const MIN_RING: usize = 8 * 1024;
pub(crate) const MAX_RING: usize = 256 * 1024 * 1024;

/// Which end of a connection this process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The side that accepted (and created the segment).
    Acceptor = 0,
    /// The side that connected.
    Connector = 1,
}

impl Side {
    fn index(self) -> usize {
        self as usize
    }
    /// The other end.
    pub(crate) fn other(self) -> Side {
        match self {
            Side::Acceptor => Side::Connector,
            Side::Connector => Side::Acceptor,
        }
    }
}

/// A mapped segment. The memfd itself is closed as soon as it is mapped (and sent): the
/// mapping alone keeps the memory, so when both sides have attached no descriptor and no name
/// refer to it, and it is freed with the last mapping — the death of a process included.
pub(crate) struct Segment {
    map: Mapping,
    ring: usize,
    /// The memfd's name (as `/proc/<pid>/maps` shows it: `/memfd:<name> (deleted)`).
    name: String,
}

/// Total bytes of a segment with rings of `ring` bytes.
pub(crate) fn segment_len(ring: usize) -> usize {
    HEADER + 2 * ring
}

/// Checks a ring size a peer or a setting gave.
pub(crate) fn check_ring(ring: usize) -> Result<(), String> {
    if !ring.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&ring) {
        return Err(format!("ring size {ring} is not a power of two between {MIN_RING} and {MAX_RING} bytes"));
    }
    Ok(())
}

impl Segment {
    /// Creates a segment with rings of `ring` bytes; returns it and the memfd to send to the
    /// peer (close it once sent).
    pub(crate) fn create(name: &str, ring: usize) -> io::Result<(Segment, OwnedFd)> {
        check_ring(ring).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let fd = sys::memfd_sealed(name, segment_len(ring))?;
        let map = Mapping::new(&fd, segment_len(ring))?;
        let seg = Segment { map, ring, name: name.to_string() };
        // SAFETY: offsets inside the header page of our fresh, zeroed mapping.
        unsafe {
            std::ptr::write(seg.map.ptr().add(8) as *mut u32, VERSION);
            std::ptr::write(seg.map.ptr().add(12) as *mut u32, ring as u32);
            (*(seg.map.ptr() as *const AtomicU64)).store(MAGIC, Ordering::Release);
        }
        Ok((seg, fd))
    }

    /// Attaches the segment a peer sent, after checking that it is what the handshake
    /// announced and sealed against resizing (a peer that could shrink it could make our next
    /// access fault).
    pub(crate) fn attach(fd: OwnedFd, ring: usize) -> Result<Segment, String> {
        check_ring(ring)?;
        let (size, seals) = sys::memfd_size_and_seals(&fd).map_err(|e| format!("the segment cannot be inspected: {e}"))?;
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if seals & need != need {
            return Err(format!("the segment is not sealed against resizing (seals {seals:#x})"));
        }
        if size != segment_len(ring) as u64 {
            return Err(format!("the segment has {size} bytes, not the {} announced", segment_len(ring)));
        }
        let map = Mapping::new(&fd, segment_len(ring)).map_err(|e| format!("the segment cannot be mapped: {e}"))?;
        let name = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map(|p| p.to_string_lossy().trim_start_matches("/memfd:").trim_end_matches(" (deleted)").to_string())
            .unwrap_or_default();
        drop(fd);
        // SAFETY: the header page lies inside the mapping.
        let (magic, version, r) = unsafe {
            (
                (*(map.ptr() as *const AtomicU64)).load(Ordering::Acquire),
                std::ptr::read_volatile(map.ptr().add(8) as *const u32),
                std::ptr::read_volatile(map.ptr().add(12) as *const u32),
            )
        };
        if magic != MAGIC || version != VERSION || r as usize != ring {
            return Err(format!("the segment's header is not a version-{VERSION} segment with {ring}-byte rings"));
        }
        Ok(Segment { map, ring, name })
    }

    /// The ring `side` writes into.
    pub(crate) fn tx(&self, side: Side) -> RingPtrs {
        self.ring_ptrs(side.index())
    }

    /// The ring `side` reads from.
    pub(crate) fn rx(&self, side: Side) -> RingPtrs {
        self.ring_ptrs(side.other().index())
    }

    fn ring_ptrs(&self, i: usize) -> RingPtrs {
        let base = self.map.ptr();
        debug_assert!(self.map.len() == segment_len(self.ring));
        // SAFETY: every offset lies inside the mapping (header page, then two rings).
        unsafe {
            RingPtrs {
                head: base.add(HEAD[i]) as *const AtomicU64,
                tail: base.add(TAIL[i]) as *const AtomicU64,
                data: base.add(HEADER + i * self.ring),
                cap: self.ring as u64,
            }
        }
    }

    /// The memfd's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The flag `side` sets before it sleeps on its doorbell.
    pub(crate) fn sleep_flag(&self, side: Side) -> &AtomicU32 {
        // SAFETY: inside the header page, 4-aligned, live as long as `self`.
        unsafe { &*(self.map.ptr().add(FLAG[side.index()]) as *const AtomicU32) }
    }
}
