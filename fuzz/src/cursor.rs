//! A byte cursor that turns fuzz input into choices, and its writing counterpart.
//!
//! Reads never fail: past the end of the input every read returns zeros, so any byte string
//! is a valid script and the harness loops end when [`Cursor::is_empty`] says so. The
//! [`Writer`] produces exactly the bytes a [`Cursor`] reads back, which is how the seed
//! corpora are built.

/// Reads big-endian integers and byte strings from fuzz input.
#[derive(Debug)]
pub struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Cursor { data, pos: 0 }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let end = self.pos.saturating_add(n).min(self.data.len());
        let s = &self.data[self.pos.min(end)..end];
        self.pos = end;
        s
    }

    /// `N` bytes, zero-padded at the end of the input.
    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        let s = self.bytes(N);
        a[..s.len()].copy_from_slice(s);
        a
    }

    /// One byte.
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    /// A big-endian `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.array())
    }

    /// A big-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.array())
    }

    /// A big-endian `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.array())
    }

    /// A byte string prefixed by its `u16` length.
    pub fn blob(&mut self) -> &'a [u8] {
        let n = self.u16() as usize;
        self.bytes(n)
    }
}

/// Builds inputs that a [`Cursor`] reads back field by field.
#[derive(Debug, Default, Clone)]
pub struct Writer {
    /// The bytes written so far.
    pub buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Writer::default()
    }

    /// Appends one byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// Appends a big-endian `u16`.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Appends a big-endian `u32`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Appends a big-endian `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }

    /// Appends a byte string with its `u16` length (cut at `u16::MAX`).
    pub fn blob(&mut self, b: &[u8]) -> &mut Self {
        let b = &b[..b.len().min(u16::MAX as usize)];
        self.u16(b.len() as u16).bytes(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writer_and_cursor_agree_and_reads_past_the_end_are_zero() {
        let mut w = Writer::new();
        w.u8(7).u16(0x1234).u32(0xdead_beef).u64(u64::MAX - 1).blob(b"abc");
        let mut c = Cursor::new(&w.buf);
        assert_eq!((c.u8(), c.u16(), c.u32(), c.u64()), (7, 0x1234, 0xdead_beef, u64::MAX - 1));
        assert_eq!(c.blob(), b"abc");
        assert!(c.is_empty());
        assert_eq!((c.u8(), c.u64()), (0, 0));
        let mut short = Cursor::new(&[0xff]);
        assert_eq!(short.u16(), 0xff00, "zero-padded at the end");
        assert_eq!(short.bytes(5), b"");
    }
}
