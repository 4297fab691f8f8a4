//! The decoded-file store (`--decoded-cache DIR`): whole tensor files and
//! model views decoded once into plain files, which the mount then serves
//! by FUSE passthrough (`fs::passthrough`).
//!
//! Layout of DIR (one flat directory, mode 0700, owned by the daemon's
//! user, which is checked at open: anyone who could write into it could
//! plant bytes the mount would serve):
//! - `<name>.data`: the exact bytes of one served file, nothing else (the
//!   kernel serves it at the same offsets, so it cannot carry a header);
//! - `<name>.meta`: JSON sidecar: the entry's key (what it is and of which
//!   source versions, [`EntryKey`]), its size and the CRC-32 of the data;
//! - `.tmp.<name>.<pid>.<n>.{data,meta}`: an entry being written.
//!
//! `<name>` is the SHA-256 of the key's canonical JSON, so a key with
//! another source version or build is another file: an entry of another
//! version is never looked at, let alone served.
//!
//! Rules:
//! - **Atomic entries.** An entry is written under a temporary name, then
//!   renamed: the data first, the sidecar last. An entry exists only when
//!   both do and agree, so a crash (or kill -9) at any point leaves nothing
//!   that is served: at most a temporary file, removed at the next open of
//!   the store once its writer's process is gone, or a data file without
//!   its sidecar, which is never used and goes first when room is needed.
//!   No fsync: what a power loss can leave (a renamed file whose blocks
//!   never reached the disk) fails the check below and is rebuilt.
//! - **Checked before first use in each process.** The first use of an
//!   entry in a mount reads it whole and compares its CRC-32 with the
//!   sidecar's (crc32fast: tens of GB/s, so the cost is reading the file
//!   once, which also brings it into the page cache the passthrough reads
//!   will use). A mismatch, a wrong size, or a sidecar with another key
//!   removes the entry and builds it again. Entries this process wrote are
//!   trusted (their CRC was computed from the bytes written).
//! - **Never evicted while open.** Every holder of an entry (this mount or
//!   another one on the host) keeps a shared `flock` on its data file.
//!   Eviction takes an exclusive non-blocking lock and skips what it cannot
//!   lock; a holder that got its lock checks that the name still points at
//!   its inode (an eviction may have removed it in between).
//! - **LRU by size.** Room for a new entry is made by removing the least
//!   recently used entries (the sidecar's mtime, touched on every use)
//!   until the data files, plus files being written, fit the limit. An
//!   entry that cannot fit is not stored (the caller serves the file as if
//!   there were no store).
//! - **No symlinks.** Every file is opened relative to the directory's
//!   descriptor with O_NOFOLLOW, created with O_EXCL and mode 0600.
//! - **One build per entry in a process.** Concurrent requests for the same
//!   entry wait for the first one's build. Two mounts of one source may
//!   build the same entry at once; both write complete files and the second
//!   rename replaces the first with identical bytes.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{Value, json};

use super::lock;
use crate::error::{Error, ErrorKind, Result, err};
use crate::source::SourceVersion;
use crate::source::cache_dir::{CacheDir, last_os_error};

/// Version of the entry layout (data + sidecar), part of every key. 2: a
/// remote source is named by its identity (`SourceFile::cache_identity`),
/// not its redacted URL, which two objects may share; entries of layout 1
/// are never used (they age out by LRU).
const LAYOUT: u32 = 2;

/// Largest sidecar read back: keys are a few hundred bytes.
const MAX_META_BYTES: u64 = 1 << 20;

/// Block size of the whole-file check.
const CHECK_BLOCK: usize = 4 << 20;

/// One source file an entry was decoded from: which file and which
/// version of its data (the read path's notion of "unchanged":
/// [`SourceVersion::same_data`], so a chmod or a rename of the source does
/// not invalidate its entries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceId {
    /// A local file's path, or a remote object's identity (its redacted URL
    /// and a digest of what selects it: `SourceFile::cache_identity`).
    pub path: String,
    pub version: SourceVersion,
}

impl SourceId {
    fn to_json(&self) -> Value {
        let v = &self.version;
        json!({
            "path": self.path, "dev": v.dev, "ino": v.ino, "size": v.size,
            "mtime": v.mtime.to_string(),
        })
    }

    /// Whether the JSON record `j` (of a sidecar) names the same file as
    /// `self` (same path, or same device and inode) but another version.
    fn changed_in(&self, j: &Value) -> bool {
        let v = &self.version;
        let same_path = j["path"].as_str() == Some(self.path.as_str());
        let same_inode = j["dev"].as_u64() == Some(v.dev) && j["ino"].as_u64() == Some(v.ino);
        (same_path || same_inode) && *j != self.to_json()
    }
}

/// What an entry holds: the sources it was decoded from, what was decoded
/// (e.g. `{"tensor": "blk.0.attn_q.weight", "format": "f32"}`), and the
/// build that decoded it.
#[derive(Debug, Clone)]
pub struct EntryKey {
    json: Value,
    name: String,
}

impl EntryKey {
    pub fn new(sources: &[SourceId], what: Value) -> EntryKey {
        let json = json!({
            "layout": LAYOUT,
            "build": crate::LONG_VERSION,
            "sources": sources.iter().map(SourceId::to_json).collect::<Vec<_>>(),
            "what": what,
        });
        use sha2::Digest;
        let digest = sha2::Sha256::digest(json.to_string().as_bytes());
        let name = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        EntryKey { json, name }
    }

    /// The entry's file name stem.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// An entry in use: its data file, open read-only, with a shared lock that
/// keeps it from eviction until this is dropped.
#[derive(Debug)]
pub struct Entry {
    pub file: File,
    pub size: u64,
    pub name: String,
}

/// How [`DecodedStore::get_or_build`] found an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Present (and checked in this process).
    Hit,
    /// Decoded now.
    Built,
}

/// Counters for `ctl`.
#[derive(Debug, Clone, Default)]
pub struct StoreStats {
    pub entries: u64,
    pub bytes: u64,
    pub limit: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub builds: u64,
    pub build_failures: u64,
    pub bytes_built: u64,
    pub build_secs: f64,
    pub checks: u64,
    pub bytes_checked: u64,
    pub check_secs: f64,
    pub corrupt: u64,
    pub too_large: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    builds: AtomicU64,
    build_failures: AtomicU64,
    bytes_built: AtomicU64,
    build_ns: AtomicU64,
    checks: AtomicU64,
    bytes_checked: AtomicU64,
    check_ns: AtomicU64,
    corrupt: AtomicU64,
    too_large: AtomicU64,
}

pub struct DecodedStore {
    dir: CacheDir,
    limit: AtomicU64,
    /// Entries checked (or written) by this process.
    checked: Mutex<HashSet<String>>,
    /// One lock per entry name: a build and the check before it run under
    /// it, so concurrent requests for one entry wait for one build.
    flights: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Making room is one at a time in this process.
    room: Mutex<()>,
    counters: Counters,
}

impl std::fmt::Debug for DecodedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DecodedStore({})", self.dir.path().display())
    }
}

/// `flock` on an open file.
fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    // SAFETY: flock on a descriptor `file` owns.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(last_os_error())
    }
}

impl DecodedStore {
    /// Open (creating it, mode 0700) the store in `dir`, holding at most
    /// `limit` bytes of data (default: what it holds now plus 90% of the
    /// free space of its filesystem). Refused: a symlink, something that is
    /// not a directory, a directory of another user or one that group or
    /// others may access.
    pub fn open(dir: &Path, limit: Option<u64>) -> Result<DecodedStore> {
        let dir_file = CacheDir::open(dir, "decoded cache")?;
        let store = DecodedStore {
            dir: dir_file,
            limit: AtomicU64::new(limit.unwrap_or(u64::MAX)),
            checked: Mutex::new(HashSet::new()),
            flights: Mutex::new(HashMap::new()),
            room: Mutex::new(()),
            counters: Counters::default(),
        };
        if limit.is_none() {
            let free = store
                .dir
                .free_bytes()
                .map_err(|e| Error::io(dir, "cannot statvfs", e))?;
            let held = store.inventory().1;
            store
                .limit
                .store(held.saturating_add(free / 10 * 9), Ordering::Relaxed);
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    fn names(&self) -> Vec<String> {
        self.dir.names()
    }

    fn open_at(&self, name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<File> {
        self.dir.open_at(name, flags, mode)
    }

    fn unlink(&self, name: &str) {
        self.dir.unlink(name);
    }

    /// Remove temporary files whose writer is gone (killed mid-decode).
    pub fn remove_stale_temporaries(&self) {
        self.dir.remove_stale_temporaries();
    }

    /// Remove entries decoded from another version of one of `ours` (same
    /// path or inode, other size or mtime): a changed source's entries can
    /// never be used again. Entries still open somewhere are left. Returns
    /// how many were removed.
    pub fn evict_changed(&self, ours: &[SourceId]) -> usize {
        let mut removed = 0;
        for n in self.names() {
            let Some(stem) = n.strip_suffix(".meta").filter(|s| !s.starts_with('.')) else {
                continue;
            };
            let Some(meta) = self.read_meta(stem) else {
                continue;
            };
            let stale = meta["key"]["sources"]
                .as_array()
                .is_some_and(|srcs| srcs.iter().any(|j| ours.iter().any(|o| o.changed_in(j))));
            if stale && self.evict(stem) {
                log::info!(
                    "decoded cache: removed {stem}, decoded from a source that changed since"
                );
                removed += 1;
            }
        }
        removed
    }

    fn read_meta(&self, stem: &str) -> Option<Value> {
        let f = self
            .open_at(&format!("{stem}.meta"), libc::O_RDONLY, 0)
            .ok()?;
        let m = f.metadata().ok()?;
        if !m.is_file() || m.len() > MAX_META_BYTES {
            return None;
        }
        let mut buf = vec![0u8; m.len() as usize];
        f.read_exact_at(&mut buf, 0).ok()?;
        serde_json::from_slice(&buf).ok()
    }

    /// Remove entry `stem` unless it is open somewhere. True if removed.
    fn evict(&self, stem: &str) -> bool {
        let data = format!("{stem}.data");
        if let Ok(f) = self.open_at(&data, libc::O_RDONLY, 0) {
            if flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_err() {
                return false;
            }
            // The sidecar first: without it the data is never used.
            self.unlink(&format!("{stem}.meta"));
            self.unlink(&data);
        } else {
            self.unlink(&format!("{stem}.meta"));
        }
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Data files (and files being written): (stem or temp name, bytes,
    /// last use). Orphan data files (no sidecar) count as never used.
    fn inventory(&self) -> (Vec<(String, u64, i64)>, u64) {
        let names = self.names();
        let mut entries = Vec::new();
        let mut total = 0u64;
        for n in &names {
            if n.starts_with(".tmp.") && n.ends_with(".data") {
                total = total.saturating_add(self.dir.stat_at(n).map_or(0, |s| s.size));
                continue;
            }
            let Some(stem) = n.strip_suffix(".data") else {
                continue;
            };
            let size = self.dir.stat_at(n).map_or(0, |s| s.size);
            total = total.saturating_add(size);
            let meta = format!("{stem}.meta");
            let used = self
                .open_at(&meta, libc::O_RDONLY, 0)
                .and_then(|f| f.metadata())
                .map_or(i64::MIN, |m| m.mtime() * 1_000_000_000 + m.mtime_nsec());
            entries.push((stem.to_string(), size, used));
        }
        (entries, total)
    }

    /// Evict least recently used entries until `need` more bytes fit.
    fn make_room(&self, need: u64) -> bool {
        let _one = lock(&self.room);
        let (mut entries, mut total) = self.inventory();
        entries.sort_by_key(|e| e.2);
        let mut victims = entries.into_iter();
        while total.saturating_add(need) > self.limit() {
            let Some((stem, size, _)) = victims.next() else {
                return false;
            };
            if self.evict(&stem) {
                log::info!("decoded cache: evicted {stem} ({size} B) to make room");
                total = total.saturating_sub(size);
            }
        }
        true
    }

    /// The entry for `key` (`size` bytes): present and good, or built now
    /// by `build`, which fills the (sparse, `size`-byte) file it is given
    /// and returns the CRC-32 of all its bytes.
    pub fn get_or_build(
        &self,
        key: &EntryKey,
        size: u64,
        build: impl FnOnce(&File) -> Result<u32>,
    ) -> Result<(Entry, Found)> {
        let flight = lock(&self.flights)
            .entry(key.name.clone())
            .or_default()
            .clone();
        let _one = lock(&flight);
        if let Some(e) = self.lookup(key, size) {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((e, Found::Hit));
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        if size > self.limit() || !self.make_room(size) {
            self.counters.too_large.fetch_add(1, Ordering::Relaxed);
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "{size} B do not fit the decoded cache's limit of {} B (with what is open)",
                    self.limit()
                ),
            )
            .path(self.dir.path()));
        }
        let t = Instant::now();
        let r = self.build(key, size, build);
        self.counters
            .build_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match r {
            Ok(e) => {
                self.counters.builds.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes_built.fetch_add(size, Ordering::Relaxed);
                lock(&self.checked).insert(key.name.clone());
                Ok((e, Found::Built))
            }
            Err(e) => {
                self.counters.build_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// The existing entry for `key`, if it is complete and (checked once in
    /// this process) intact; a bad one is removed.
    fn lookup(&self, key: &EntryKey, size: u64) -> Option<Entry> {
        let (file, _) = self.open_checked(&key.name, |meta| {
            if meta["key"] != key.json {
                Err("its sidecar names another key".to_string())
            } else if meta["size"].as_u64() != Some(size) {
                Err(format!(
                    "its sidecar says {} B, expected {size} B",
                    meta["size"]
                ))
            } else {
                Ok(())
            }
        })?;
        // Recency for LRU eviction: the sidecar's mtime.
        if let Ok(f) = self.open_at(&format!("{}.meta", key.name), libc::O_RDONLY, 0) {
            // SAFETY: a descriptor we own; NULL times means "now".
            unsafe { libc::futimens(f.as_raw_fd(), std::ptr::null()) };
        }
        Some(Entry {
            file,
            size,
            name: key.name.clone(),
        })
    }

    /// Open entry `stem` with a shared lock and, unless this process
    /// already did, check its data against its sidecar (size, CRC-32) and
    /// `accept` (the key). A bad entry is removed (and logged); a missing
    /// one is None.
    fn open_checked(
        &self,
        stem: &str,
        accept: impl FnOnce(&Value) -> std::result::Result<(), String>,
    ) -> Option<(File, Value)> {
        let data = format!("{stem}.data");
        let file = self.open_at(&data, libc::O_RDONLY, 0).ok()?;
        // A shared lock, then: is the name still this file? An eviction
        // may have unlinked it between our open and our lock.
        flock(&file, libc::LOCK_SH).ok()?;
        let m = file.metadata().ok()?;
        if self.dir.stat_at(&data).map(|s| s.ino) != Some(m.ino()) {
            return None;
        }
        let bad = |why: String| {
            log::warn!(
                "decoded cache: entry {stem} in {} is bad ({why}): removed, decoding again",
                self.dir.path().display()
            );
            self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            lock(&self.checked).remove(stem);
            self.unlink(&format!("{stem}.meta"));
            self.unlink(&data);
            None
        };
        let meta = self.read_meta(stem)?;
        if let Err(why) = accept(&meta) {
            return bad(why);
        }
        if !m.is_file() || m.uid() != self.dir.uid() {
            return bad("not a regular file of this user".into());
        }
        let size = m.len();
        if meta["size"].as_u64() != Some(size) {
            return bad(format!("{size} B, its sidecar says {}", meta["size"]));
        }
        let crc = meta["crc32"].as_u64()?;
        if !lock(&self.checked).contains(stem) {
            let t = Instant::now();
            let got = match crc_of(&file, size) {
                Ok(c) => c,
                Err(e) => return bad(format!("cannot read it: {e}")),
            };
            let c = &self.counters;
            c.checks.fetch_add(1, Ordering::Relaxed);
            c.bytes_checked.fetch_add(size, Ordering::Relaxed);
            c.check_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if u64::from(got) != crc {
                return bad(format!("CRC-32 {got:08x}, its sidecar says {crc:08x}"));
            }
            lock(&self.checked).insert(stem.to_string());
        }
        Some((file, meta))
    }

    /// Entries decoded from exactly `sources` by this build: what a mount
    /// of them may use (and checks in the background, [`Self::precheck`]).
    pub fn entries_of(&self, sources: &[SourceId]) -> Vec<String> {
        let ours: Vec<Value> = sources.iter().map(SourceId::to_json).collect();
        self.names()
            .iter()
            .filter_map(|n| n.strip_suffix(".meta").filter(|s| !s.starts_with('.')))
            .filter(|stem| {
                self.read_meta(stem).is_some_and(|m| {
                    m["key"]["sources"].as_array() == Some(&ours)
                        && m["key"]["build"].as_str() == Some(crate::LONG_VERSION)
                        && m["key"]["layout"].as_u64() == Some(u64::from(LAYOUT))
                })
            })
            .map(str::to_string)
            .collect()
    }

    /// Check entry `stem` now (once per process), so that its first open
    /// need not: run in the background after a mount. An open of the
    /// entry meanwhile waits for this check instead of doing its own.
    pub fn precheck(&self, stem: &str) {
        let flight = lock(&self.flights)
            .entry(stem.to_string())
            .or_default()
            .clone();
        let _one = lock(&flight);
        // Any key: the open that uses it compares the key.
        let _ = self.open_checked(stem, |_| Ok(()));
    }

    fn build(
        &self,
        key: &EntryKey,
        size: u64,
        build: impl FnOnce(&File) -> Result<u32>,
    ) -> Result<Entry> {
        let stem = &key.name;
        let tmp = self.dir.temp_name(stem, "");
        let (tmp_data, tmp_meta) = (format!("{tmp}.data"), format!("{tmp}.meta"));
        // Removes the temporaries on every way out but success (errors and
        // a panicking decoder alike).
        struct Cleanup<'a>(&'a DecodedStore, [&'a str; 2], bool);
        impl Drop for Cleanup<'_> {
            fn drop(&mut self) {
                if !self.2 {
                    for n in self.1 {
                        self.0.unlink(n);
                    }
                }
            }
        }
        let mut cleanup = Cleanup(self, [&tmp_data, &tmp_meta], false);
        let io = |what: &str, e: io::Error| Error::io(&self.dir.path().join(&tmp_data), what, e);
        let create = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL;
        let f = self
            .open_at(&tmp_data, create, 0o600)
            .map_err(|e| io("cannot create", e))?;
        f.set_len(size).map_err(|e| io("cannot size", e))?;
        let crc = build(&f)?;
        let len = f.metadata().map_err(|e| io("cannot stat", e))?.len();
        if len != size {
            return Err(err(
                ErrorKind::Io,
                format!("decoded {len} B, expected {size} B (a bug)"),
            )
            .path(&self.dir.path().join(&tmp_data)));
        }
        drop(f);
        let meta = json!({"key": key.json, "size": size, "crc32": crc});
        let m = self
            .open_at(
                &tmp_meta,
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                0o600,
            )
            .map_err(|e| io("cannot create", e))?;
        m.write_all_at(meta.to_string().as_bytes(), 0)
            .map_err(|e| io("cannot write", e))?;
        drop(m);
        let data = format!("{stem}.data");
        self.dir
            .rename(&tmp_data, &data)
            .map_err(|e| io("cannot rename", e))?;
        self.dir
            .rename(&tmp_meta, &format!("{stem}.meta"))
            .map_err(|e| io("cannot rename", e))?;
        cleanup.2 = true;
        let file = self
            .open_at(&data, libc::O_RDONLY, 0)
            .map_err(|e| Error::io(&self.dir.path().join(&data), "cannot reopen", e))?;
        flock(&file, libc::LOCK_SH)
            .map_err(|e| Error::io(&self.dir.path().join(&data), "cannot lock", e))?;
        Ok(Entry {
            file,
            size,
            name: stem.clone(),
        })
    }

    pub fn stats(&self) -> StoreStats {
        let (entries, bytes) = {
            let (list, _) = self.inventory();
            (list.len() as u64, list.iter().map(|e| e.1).sum())
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            entries,
            bytes,
            limit: self.limit(),
            hits: get(&c.hits),
            misses: get(&c.misses),
            evictions: get(&c.evictions),
            builds: get(&c.builds),
            build_failures: get(&c.build_failures),
            bytes_built: get(&c.bytes_built),
            build_secs: get(&c.build_ns) as f64 / 1e9,
            checks: get(&c.checks),
            bytes_checked: get(&c.bytes_checked),
            check_secs: get(&c.check_ns) as f64 / 1e9,
            corrupt: get(&c.corrupt),
            too_large: get(&c.too_large),
        }
    }
}

/// CRC-32 of the first `size` bytes of `file`, on every core: each thread
/// hashes one contiguous range, the states are combined in order.
fn crc_of(file: &File, size: u64) -> io::Result<u32> {
    const MIN_RANGE: u64 = 64 << 20;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let n = size.div_ceil(MIN_RANGE).clamp(1, cores);
    let per = size.div_ceil(n).max(1);
    let ranges: Vec<(u64, u64)> = (0..n)
        .map(|i| (i * per, ((i + 1) * per).min(size)))
        .filter(|(a, b)| a < b)
        .collect();
    let hash_range = |(a, b): (u64, u64)| -> io::Result<crc32fast::Hasher> {
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; (CHECK_BLOCK as u64).min(b - a) as usize];
        let mut pos = a;
        while pos < b {
            let k = (b - pos).min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..k], pos)?;
            h.update(&buf[..k]);
            pos += k as u64;
        }
        Ok(h)
    };
    let parts: Vec<io::Result<crc32fast::Hasher>> = if ranges.len() <= 1 {
        ranges.iter().map(|r| hash_range(*r)).collect()
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = ranges
                .iter()
                .map(|r| s.spawn(move || hash_range(*r)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(io::Error::other("checksum thread panicked")))
                })
                .collect()
        })
    };
    let mut total = crc32fast::Hasher::new();
    for p in parts {
        total.combine(&p?);
    }
    Ok(total.finalize())
}

#[cfg(test)]
mod tests;
