//! The persistent cache of remote source parts (`--source-cache DIR`):
//! aligned byte ranges ("parts") of remote objects, kept on disk so that a
//! remount, or another mount of the same object on this host (another
//! process), reads them from disk instead of the network.
//!
//! Layout of DIR (one flat directory, mode 0700, owned by the daemon's
//! user, checked at open as for the decoded store: `super::cache_dir`):
//! - `<name>`: one part, mode 0600. `<name>` is the lowercase hex SHA-256
//!   of the part's key (the layout version, then the object's identity
//!   and its pinned version, each preceded by its length, then the part
//!   size and the part's index, as little-endian u64), so every field
//!   counts and none can run into the next. The identity
//!   (`source::identity`) is the redacted URL followed by a SHA-256 of
//!   everything in the URL that selects the object (the query string
//!   without its signing parameters; an `s3://` object's endpoint): two
//!   objects whose URLs differ only in the query are two keys.
//! - `.tmp.<name>.<pid>.<n>`: a part being written; renamed to `<name>`
//!   when complete, so a reader never sees half a part. A writer killed
//!   mid-write leaves only this, removed at the next open once its pid is
//!   gone.
//! - anything else (another name, a symlink, a directory, a file of
//!   another user) is none of ours: never read, followed or removed.
//!
//! A part file is a header, then the part's bytes (all integers
//! little-endian):
//!
//! | offset | bytes | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `rknotSP\0` |
//! | 8 | 4 | format version (2) |
//! | 12 | 4 | header length H (52 + the two strings) |
//! | 16 | 8 | part size of the key |
//! | 24 | 8 | part index of the key |
//! | 32 | 8 | data length L |
//! | 40 | 4 | CRC-32C of the data |
//! | 44 | 4 | length of the object's identity |
//! | 48 | 4 | length of the version |
//! | 52 | | the object's identity, then the version (UTF-8) |
//! | H | L | the data |
//!
//! Why a checksum per part: the cache outlives the process, shares a disk
//! with everything else and is read back by other processes, so a torn or
//! corrupted file (disk error, power loss after a rename whose blocks never
//! reached the disk, a stray write) must be detected, not served: as
//! mountpoint-s3's disk data cache does, each part carries the CRC-32C of
//! its data, checked on every read (CRC-32C: the SSE4.2 / ARMv8 CRC
//! instructions compute it at memory speed, so checking costs far less than
//! reading the file). The key in the header catches a hash collision and a
//! file renamed or copied to another part's name. Any mismatch (magic,
//! format, key, length, CRC, a short file) removes the file and reads as a
//! miss: the caller fetches the part again.
//!
//! Versions: the key holds the object's pinned version (ETag, or size and
//! Last-Modified) next to its identity, never credentials or query strings
//! in the clear, so two mounts of one object (presigned URLs of it with
//! different signatures included) share parts, two objects never do, and a
//! changed object never sees its old version's parts; those age out by LRU.
//! An object without an ETag replaced by one of the same size within the
//! same second of Last-Modified cannot be told apart by any HTTP cache; a
//! server that sends ETags (every object store does) has no such case.
//!
//! LRU by size, across processes: a file's mtime is its last use (a hit
//! refreshes it, at most once per [`TOUCH_EVERY`]). A write keeps the
//! directory's total under the limit: the total is estimated in memory
//! (the last scan plus this process's writes since) and when the estimate
//! would pass the limit the directory is scanned again and the oldest parts
//! removed, down to a little under the limit ([`evict_slack`]) so that a
//! full cache is not rescanned at every write. A part removed while another
//! process reads it is fine: its open descriptor keeps the data.
//!
//! Best effort: a part that cannot be written (disk full, I/O error) is
//! logged (rate-limited) and counted, never an error of the read that
//! fetched it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sha2::Digest;

use super::cache_dir::{CacheDir, TMP_PREFIX};
use super::lock;
use crate::error::Result;

/// Start of every part file.
const MAGIC: [u8; 8] = *b"rknotSP\0";

/// Version of the file layout. Part of the file name too, so files of
/// another layout are never opened (they age out by LRU). 2: keyed by the
/// object's identity; layout 1 keyed by the redacted URL, which two
/// objects may share.
const FORMAT: u32 = 2;

/// Bytes of the header before the key's strings.
const FIXED_HEADER: usize = 52;

/// Longest object URL plus version accepted in a key: a longer one is not
/// cached (URLs are far shorter; this bounds the header).
pub const MAX_KEY_BYTES: usize = 16 << 10;

/// A hit refreshes its file's mtime (its recency for LRU) only if the mtime
/// is older than this: LRU at this granularity is enough, a syscall per
/// read is not.
pub const TOUCH_EVERY: Duration = Duration::from_secs(10);

/// Write failures are logged at most once per this interval.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Length of a part's file name: hex SHA-256.
const NAME_LEN: usize = 64;

/// Identity of one part: never contains credentials or query strings in
/// the clear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartKey<'a> {
    /// The object's identity (`source::identity`), e.g.
    /// `https://host/get sha256:<hex>`.
    pub object: &'a str,
    /// The object's pinned version, e.g. its ETag or `size+last-modified`.
    pub version: &'a str,
    /// Part size the object is split in (parts of another size are other
    /// parts).
    pub part_size: u64,
    /// Index of the part: it holds bytes from `index * part_size`.
    pub index: u64,
}

impl PartKey<'_> {
    fn key_bytes(&self) -> usize {
        self.object.len().saturating_add(self.version.len())
    }

    fn header_len(&self) -> usize {
        FIXED_HEADER + self.key_bytes()
    }

    /// The part's file name: hex SHA-256 of the layout version and every
    /// field, strings preceded by their length.
    fn file_name(&self) -> String {
        let mut h = sha2::Sha256::new();
        h.update(b"rknot source part\0");
        h.update(FORMAT.to_le_bytes());
        for s in [self.object, self.version] {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        h.update(self.part_size.to_le_bytes());
        h.update(self.index.to_le_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The header of this part's file holding `data_len` bytes of CRC-32C
    /// `crc`. The caller checks [`MAX_KEY_BYTES`], so lengths fit u32.
    fn header(&self, data_len: u64, crc: u32) -> Vec<u8> {
        let mut h = Vec::with_capacity(self.header_len());
        h.extend_from_slice(&MAGIC);
        h.extend_from_slice(&FORMAT.to_le_bytes());
        h.extend_from_slice(&(self.header_len() as u32).to_le_bytes());
        h.extend_from_slice(&self.part_size.to_le_bytes());
        h.extend_from_slice(&self.index.to_le_bytes());
        h.extend_from_slice(&data_len.to_le_bytes());
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&(self.object.len() as u32).to_le_bytes());
        h.extend_from_slice(&(self.version.len() as u32).to_le_bytes());
        h.extend_from_slice(self.object.as_bytes());
        h.extend_from_slice(self.version.as_bytes());
        h
    }
}

/// Whether `name` is a part file's name (not a temporary, not someone
/// else's file).
fn is_part_name(name: &str) -> bool {
    name.len() == NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// How far under the limit a write that has to evict brings the directory:
/// a sixteenth of the limit (at most 1 GiB), so that a full cache is
/// scanned once per that many bytes written, not at every write.
pub fn evict_slack(limit: u64) -> u64 {
    (limit / 16).min(1 << 30)
}

/// Counters for `ctl`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourcePartCacheStats {
    /// Reads served from the cache (verified).
    pub hits: u64,
    /// Reads that found nothing usable (corrupt ones included).
    pub misses: u64,
    /// Files found bad (checksum, length, key, short) and removed.
    pub corrupt: u64,
    /// Parts written.
    pub writes: u64,
    /// Parts that could not be written (disk full, I/O error).
    pub write_failures: u64,
    /// Parts not written because they alone exceed the limit (or their
    /// key is longer than any URL: [`MAX_KEY_BYTES`]).
    pub too_large: u64,
    /// Parts removed to stay under the limit (by this process).
    pub evictions: u64,
    /// Bytes of part files in the directory (and files being written),
    /// at the time of the call, from all processes.
    pub bytes: u64,
    pub limit: u64,
    /// Part files in the directory.
    pub entries: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    writes: AtomicU64,
    write_failures: AtomicU64,
    too_large: AtomicU64,
    evictions: AtomicU64,
}

/// Rate limit of the write-failure warning.
#[derive(Default)]
struct Warnings {
    last: Option<Instant>,
    unlogged: u64,
}

/// One part file found by a scan.
struct PartFile {
    name: String,
    size: u64,
    mtime_ns: i64,
}

/// A persistent, host-wide cache of parts of remote objects (see the
/// module's documentation). Shared by threads behind an `Arc`.
pub struct SourcePartCache {
    dir: CacheDir,
    limit: u64,
    /// Estimated bytes in the directory: the last scan plus what this
    /// process wrote since (reserved before writing). Held while a write
    /// makes room, so one thread of this process scans at a time.
    estimate: Mutex<u64>,
    counters: Counters,
    warnings: Mutex<Warnings>,
}

impl std::fmt::Debug for SourcePartCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SourcePartCache({})", self.dir.path().display())
    }
}

impl SourcePartCache {
    /// Open (creating it, mode 0700) the cache in `dir`, holding at most
    /// `limit_bytes` of part files. Refused, with an error naming `dir`: a
    /// symlink, something that is not a directory, a directory of another
    /// user or one that group or others may access. Temporaries of writers
    /// that are gone are removed, and parts beyond the limit (a smaller
    /// limit than the last run's) evicted.
    pub fn open(dir: &Path, limit_bytes: u64) -> Result<Arc<Self>> {
        let dir = CacheDir::open(dir, "source cache")?;
        dir.remove_stale_temporaries();
        let cache = SourcePartCache {
            dir,
            limit: limit_bytes,
            estimate: Mutex::new(0),
            counters: Counters::default(),
            warnings: Mutex::new(Warnings::default()),
        };
        {
            let mut estimate = lock(&cache.estimate);
            cache.make_room(&mut estimate, 0, true);
        }
        Ok(Arc::new(cache))
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The part `key`, if the cache holds it intact with exactly
    /// `expect_len` bytes of data. A bad file is removed (and counted in
    /// `corrupt`); None means: fetch it.
    pub fn get(&self, key: &PartKey, expect_len: usize) -> Option<Bytes> {
        let got = self.read(key, expect_len);
        let counter = match got {
            Some(_) => &self.counters.hits,
            None => &self.counters.misses,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        got
    }

    fn read(&self, key: &PartKey, expect_len: usize) -> Option<Bytes> {
        if key.key_bytes() > MAX_KEY_BYTES {
            return None;
        }
        let name = key.file_name();
        // O_NONBLOCK: a FIFO planted under our name must not hang us (no
        // effect on regular files).
        let file = self
            .dir
            .open_at(&name, libc::O_RDONLY | libc::O_NONBLOCK, 0)
            .ok()?;
        let m = file.metadata().ok()?;
        if !m.is_file() || m.uid() != self.dir.uid() {
            // Not ours: ignored, left alone (a write replaces the name).
            return None;
        }
        let header_len = key.header_len();
        let total = header_len.checked_add(expect_len)?;
        if m.len() != total as u64 {
            return self.corrupt(
                key,
                &name,
                &file,
                format!("{} B, expected {total} B", m.len()),
            );
        }
        let mut buf = vec![0u8; total];
        if let Err(e) = file.read_exact_at(&mut buf, 0) {
            return self.corrupt(key, &name, &file, format!("cannot read it: {e}"));
        }
        if buf[..MAGIC.len()] != MAGIC {
            return self.corrupt(key, &name, &file, "not a part file (magic)".into());
        }
        let field = |at: usize| [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]];
        let format = u32::from_le_bytes(field(8));
        if format != FORMAT {
            return self.corrupt(key, &name, &file, format!("format {format}"));
        }
        let crc = u32::from_le_bytes(field(40));
        if buf[..header_len] != key.header(expect_len as u64, crc) {
            return self.corrupt(key, &name, &file, "its header names another part".into());
        }
        let got = crc32c::crc32c(&buf[header_len..]);
        if got != crc {
            return self.corrupt(
                key,
                &name,
                &file,
                format!("CRC-32C {got:08x}, its header says {crc:08x}"),
            );
        }
        self.touch(&file, &m);
        Some(Bytes::from(buf).slice(header_len..))
    }

    /// Refresh the recency of a part just hit, unless done recently.
    fn touch(&self, file: &File, m: &std::fs::Metadata) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        if now.saturating_sub(m.mtime()) >= TOUCH_EVERY.as_secs() as i64 {
            // SAFETY: a descriptor we own; NULL times means "now". Works on
            // a read-only descriptor for the file's owner.
            unsafe { libc::futimens(file.as_raw_fd(), std::ptr::null()) };
        }
    }

    /// Count and remove a bad part file (if the name is still that file:
    /// another process may have replaced it with a good one meanwhile).
    fn corrupt(&self, key: &PartKey, name: &str, file: &File, why: String) -> Option<Bytes> {
        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "source cache: part {} of {} ({}) in {} is bad ({why}): removed, fetching it again",
            key.index,
            key.object,
            key.version,
            self.dir.path().display()
        );
        let ino = file.metadata().map(|m| m.ino()).ok();
        if ino.is_some() && self.dir.stat_at(name).map(|s| s.ino) == ino {
            self.dir.unlink(name);
        }
        None
    }

    /// Store part `key` holding `data`. Best effort: a failure is counted
    /// and logged (rate-limited), never returned.
    pub fn put(&self, key: &PartKey, data: &[u8]) {
        if key.key_bytes() > MAX_KEY_BYTES {
            self.counters.too_large.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let name = key.file_name();
        let total = (key.header_len() as u64).saturating_add(data.len() as u64);
        if total > self.limit {
            self.counters.too_large.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Already there (another mount fetched it too): keep that one.
        if self
            .dir
            .stat_at(&name)
            .is_some_and(|s| s.is_file() && s.uid == self.dir.uid() && s.size == total)
        {
            return;
        }
        {
            let mut estimate = lock(&self.estimate);
            self.make_room(&mut estimate, total, false);
        }
        match self.write(key, &name, data) {
            Ok(()) => {
                self.counters.writes.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                {
                    let mut estimate = lock(&self.estimate);
                    *estimate = estimate.saturating_sub(total);
                }
                self.write_failed(key, e);
            }
        }
    }

    fn write(&self, key: &PartKey, name: &str, data: &[u8]) -> io::Result<()> {
        let tmp = self.dir.temp_name(name, "");
        let write = || -> io::Result<()> {
            let f = self
                .dir
                .open_at(&tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600)?;
            let header = key.header(data.len() as u64, crc32c::crc32c(data));
            f.write_all_at(&header, 0)?;
            f.write_all_at(data, header.len() as u64)?;
            drop(f);
            self.dir.rename(&tmp, name)
        };
        let r = write();
        if r.is_err() {
            self.dir.unlink(&tmp);
        }
        r
    }

    fn write_failed(&self, key: &PartKey, e: io::Error) {
        self.counters.write_failures.fetch_add(1, Ordering::Relaxed);
        let mut w = lock(&self.warnings);
        let now = Instant::now();
        if w.last.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            w.unlogged += 1;
            return;
        }
        let unlogged = std::mem::take(&mut w.unlogged);
        w.last = Some(now);
        drop(w);
        let more = if unlogged > 0 {
            format!(" ({unlogged} more failures since the last such message)")
        } else {
            String::new()
        };
        log::warn!(
            "source cache: cannot store part {} of {} in {}: {e}; reads go on without it{more}",
            key.index,
            key.object,
            self.dir.path().display()
        );
    }

    /// Make room for `need` more bytes: reserve them in the estimate if it
    /// allows, else (or if `rescan`) scan the directory and remove the
    /// least recently used parts until the total is [`evict_slack`] under
    /// the limit with `need` added.
    fn make_room(&self, estimate: &mut u64, need: u64, rescan: bool) {
        if !rescan && estimate.saturating_add(need) <= self.limit {
            *estimate += need;
            return;
        }
        let (mut parts, mut total) = self.scan();
        if total.saturating_add(need) > self.limit {
            let target = self
                .limit
                .saturating_sub(evict_slack(self.limit))
                .saturating_sub(need);
            parts.sort_by_key(|p| p.mtime_ns);
            for p in parts {
                if total <= target {
                    break;
                }
                if self.dir.unlink(&p.name) {
                    self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                    log::debug!("source cache: evicted {} ({} B)", p.name, p.size);
                }
                // Gone either way (another process may have removed it).
                total = total.saturating_sub(p.size);
            }
        }
        *estimate = total.saturating_add(need);
    }

    /// The part files in the directory, and the bytes they and the files
    /// being written take.
    fn scan(&self) -> (Vec<PartFile>, u64) {
        let mut parts = Vec::new();
        let mut total = 0u64;
        for name in self.dir.names() {
            let ours = is_part_name(&name);
            if !ours && !name.starts_with(TMP_PREFIX) {
                continue;
            }
            let Some(s) = self.dir.stat_at(&name) else {
                continue;
            };
            if !s.is_file() || s.uid != self.dir.uid() {
                continue;
            }
            total = total.saturating_add(s.size);
            if ours {
                parts.push(PartFile {
                    name,
                    size: s.size,
                    mtime_ns: s.mtime_ns,
                });
            }
        }
        (parts, total)
    }

    /// Counters, and the directory's current contents (a scan).
    pub fn stats(&self) -> SourcePartCacheStats {
        let (parts, bytes) = self.scan();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SourcePartCacheStats {
            hits: get(&c.hits),
            misses: get(&c.misses),
            corrupt: get(&c.corrupt),
            writes: get(&c.writes),
            write_failures: get(&c.write_failures),
            too_large: get(&c.too_large),
            evictions: get(&c.evictions),
            bytes,
            limit: self.limit,
            entries: parts.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests;
