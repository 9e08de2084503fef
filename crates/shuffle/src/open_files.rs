//! A bounded set of open data files, least recently used closed first.
//!
//! An executor of a long application registers thousands of map outputs. Keeping each data
//! file open until its shuffle is unregistered runs into `RLIMIT_NOFILE`; here at most `cap`
//! files are held open by the store, and a file evicted is opened again by path when a fetch
//! needs it. A transfer that holds a file (an `Arc<File>`) keeps it open until it is done, so
//! the process may briefly hold more than `cap` while those transfers finish.
//!
//! A file is reopened only if it is still the same file (device and inode) that was
//! registered: a file deleted, or replaced by another one, since registration is not served
//! (the caller turns that into a typed error).

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Identity of a file on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    /// The identity of an open file.
    pub fn of(file: &File) -> io::Result<FileIdentity> {
        let m = file.metadata()?;
        Ok(FileIdentity { dev: m.dev(), ino: m.ino() })
    }
}

/// Why a file could not be (re)opened.
#[derive(Debug)]
pub enum ReopenError {
    /// No file at the path any more.
    Missing,
    /// Another file is at the path now.
    Replaced,
    /// Opening or inspecting it failed.
    Io(io::Error),
}

#[derive(Default)]
struct Inner {
    /// key → (file, last use).
    open: HashMap<u64, (Arc<File>, u64)>,
    /// last use → key, oldest first.
    order: BTreeMap<u64, u64>,
    tick: u64,
}

/// Open files by key (a map output's registration id), at most `cap` of them.
pub struct OpenFiles {
    cap: usize,
    inner: Mutex<Inner>,
    opens: AtomicU64,
    evictions: AtomicU64,
}

impl std::fmt::Debug for OpenFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenFiles").field("cap", &self.cap).field("open", &self.len()).finish()
    }
}

impl OpenFiles {
    /// An empty set holding at most `cap` files open (at least 1).
    pub fn new(cap: usize) -> OpenFiles {
        OpenFiles { cap: cap.max(1), inner: Mutex::new(Inner::default()), opens: AtomicU64::new(0), evictions: AtomicU64::new(0) }
    }

    /// The cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Files held open now.
    pub fn len(&self) -> usize {
        self.inner.lock().open.len()
    }

    /// Whether no file is held open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Files opened since creation (first opens and reopens).
    pub fn opens(&self) -> u64 {
        self.opens.load(Ordering::Relaxed)
    }

    /// Files closed to stay under the cap.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Adds a file just opened (at registration).
    pub fn insert(&self, key: u64, file: Arc<File>) {
        self.opens.fetch_add(1, Ordering::Relaxed);
        let evicted = {
            let mut t = self.inner.lock();
            t.tick += 1;
            let tick = t.tick;
            if let Some((_, old)) = t.open.insert(key, (file, tick)) {
                t.order.remove(&old);
            }
            t.order.insert(tick, key);
            self.evict(&mut t)
        };
        // Closed outside the lock.
        drop(evicted);
    }

    fn evict(&self, t: &mut Inner) -> Vec<Arc<File>> {
        let mut out = Vec::new();
        while t.open.len() > self.cap {
            let Some((_, key)) = t.order.pop_first() else { break };
            if let Some((f, _)) = t.open.remove(&key) {
                self.evictions.fetch_add(1, Ordering::Relaxed);
                out.push(f);
            }
        }
        out
    }

    /// The open file of `key`, reopened from `path` if it was closed; only if it is still the
    /// file `identity` names.
    pub fn get(&self, key: u64, path: &Path, identity: FileIdentity) -> Result<Arc<File>, ReopenError> {
        {
            let mut t = self.inner.lock();
            t.tick += 1;
            let tick = t.tick;
            if let Some((f, last)) = t.open.get_mut(&key) {
                let (f, old) = (f.clone(), std::mem::replace(last, tick));
                t.order.remove(&old);
                t.order.insert(tick, key);
                return Ok(f);
            }
        }
        // Opened outside the lock: another thread may open the same file meanwhile; the
        // second insert replaces the first (both are the same file), nothing leaks.
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ReopenError::Missing),
            Err(e) => return Err(ReopenError::Io(e)),
        };
        if FileIdentity::of(&file).map_err(ReopenError::Io)? != identity {
            return Err(ReopenError::Replaced);
        }
        let file = Arc::new(file);
        self.insert(key, file.clone());
        Ok(file)
    }

    /// Closes the file of `key` (its map output is gone).
    pub fn remove(&self, key: u64) {
        let removed = {
            let mut t = self.inner.lock();
            let removed = t.open.remove(&key);
            if let Some((_, tick)) = &removed {
                t.order.remove(tick);
            }
            removed
        };
        drop(removed);
    }
}
