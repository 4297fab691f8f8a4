//! Source files: where the bytes of a model come from, and which version of
//! them a mount serves.
//!
//! - [`SourceFile`]: what every format reader reads through, whatever the
//!   bytes come from:
//!   - `local`: a local file read by `pread(2)` only, never mapped, with a
//!     check after every read that the file is still the version that was
//!     opened ([`SourceVersion`]);
//!   - `remote`: an object at an `http(s)://` or `s3://` URL, read by
//!     conditional ranged GETs pinned to the version seen at open, in
//!     aligned parts cached in memory (`parts`) and optionally on disk
//!     (`part_cache`, in a private directory: `cache_dir`). Below it, and
//!     never using it: the fetch backends `http` (reqwest) and `s3`
//!     (object_store), what they share (`fetch`: the pin, retries within a
//!     deadline, stalls, blocks), `options` and the tokio `runtime`.
//! - [`SourceVersion`]: the identity of one version of a source file
//!   (device, inode, size, mtime, ctime). It is a small plain value: it
//!   prints, compares and hashes, so it can key a cache of decoded files or
//!   stand for the version of a remote object.
//!
//! Why the check: the headers a backend parsed at open fix where every
//! tensor's bytes are. A file rewritten in place (`cp new.gguf model.gguf`
//! keeps the inode) may move the data, and reads at the old offsets would
//! decode the wrong bytes without any error. A change of size or mtime is a
//! `Changed` error (ESTALE at the filesystem), and it is sticky: once a
//! source is seen changed, nothing more is read from it.

mod argv;
pub(crate) mod cache_dir;
pub mod cli;
mod fetch;
mod http;
mod identity;
mod local;
mod options;
pub mod part_cache;
mod parts;
mod remote;
mod runtime;
mod s3;
pub mod upload;

use std::fmt;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use crate::error::{ErrorKind, Result, err};
pub use argv::hide_url_secrets_in_argv;
pub use fetch::Pin;
use local::LocalFile;
pub use options::RemoteOptions;
pub use parts::PartStats;
use remote::RemoteFile;
pub use remote::{DiskCacheStats, RemoteStats, is_remote, redact};
pub use runtime::stop_runtime;

/// Lock a mutex whose data stays consistent even if a holder panicked:
/// every lock it is used for guards state each mutation leaves whole (a
/// single insert or remove), so poisoning is ignored. `cache` uses it too.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An open, read-only model file (local or remote) and the version it had
/// when opened. Readers hold this type and never know where bytes come
/// from.
#[derive(Debug)]
pub struct SourceFile {
    backing: Backing,
}

#[derive(Debug)]
enum Backing {
    Local(LocalFile),
    Remote(Box<RemoteFile>),
}

impl SourceFile {
    /// Open a local path, or a remote object when `path` is an `http://`,
    /// `https://` or `s3://` URL (with [`RemoteOptions::current`]).
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(s) = path.to_str()
            && is_remote(s)
        {
            return SourceFile::open_remote(s, RemoteOptions::current());
        }
        Ok(SourceFile {
            backing: Backing::Local(LocalFile::open(path)?),
        })
    }

    /// Open a remote object: a HEAD (the pinned version) and the first part.
    pub fn open_remote(url: &str, opts: RemoteOptions) -> Result<Self> {
        Ok(SourceFile {
            backing: Backing::Remote(Box::new(RemoteFile::open(url, opts)?)),
        })
    }

    /// The file named `name` (a bare file name) in the same directory as
    /// this one, or for a remote object the object whose URL differs from
    /// this one's in its last path segment only, opened the same way (each
    /// its own source, pinned on its own): how the members of a set of files
    /// that find each other by name (a split GGUF's shards) are opened.
    pub fn open_sibling(&self, name: &str) -> Result<SourceFile> {
        if name.is_empty() || name.contains(['/', '\\', '?', '#']) || name == "." || name == ".." {
            return Err(
                err(ErrorKind::BadValue, format!("{name:?} is not a file name")).path(self.path()),
            );
        }
        Ok(SourceFile {
            backing: match &self.backing {
                Backing::Local(l) => {
                    Backing::Local(LocalFile::open(&l.path().with_file_name(name))?)
                }
                Backing::Remote(r) => Backing::Remote(Box::new(r.open_sibling(name)?)),
            },
        })
    }

    /// The local path, or the redacted URL of a remote object.
    pub fn path(&self) -> &Path {
        match &self.backing {
            Backing::Local(l) => l.path(),
            Backing::Remote(r) => r.path(),
        }
    }

    /// Size at open time. All bounds checks use this value.
    pub fn len(&self) -> u64 {
        self.version().size
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn modified(&self) -> Option<SystemTime> {
        match &self.backing {
            Backing::Local(l) => l.modified(),
            Backing::Remote(r) => r.modified(),
        }
    }

    /// The version that was opened (and that every read is checked
    /// against). For a remote object: device 0 and an "inode" hashed from
    /// its identity ([`SourceFile::cache_identity`]) and pinned version
    /// ([`SourceFile::remote_pin`]).
    pub fn version(&self) -> &SourceVersion {
        match &self.backing {
            Backing::Local(l) => l.version(),
            Backing::Remote(r) => r.version(),
        }
    }

    /// Which file or object this is, for caches that outlive the process
    /// (with [`SourceFile::version`], which version of it): the path of a
    /// local file; for a remote object its redacted URL and a digest of
    /// every part of the URL that selects the object (`identity`): two
    /// objects may share a redacted URL.
    pub fn cache_identity(&self) -> String {
        match &self.backing {
            Backing::Local(l) => l.path().display().to_string(),
            Backing::Remote(r) => r.identity().to_string(),
        }
    }

    /// The pinned version of a remote object; None for a local file.
    pub fn remote_pin(&self) -> Option<&Pin> {
        match &self.backing {
            Backing::Local(_) => None,
            Backing::Remote(r) => Some(r.pin()),
        }
    }

    /// The counters of a remote object; None for a local file.
    pub fn remote_stats(&self) -> Option<RemoteStats> {
        match &self.backing {
            Backing::Local(_) => None,
            Backing::Remote(r) => Some(r.stats()),
        }
    }

    /// The permission bits now (`st_mode & 0o7777`), from the open
    /// descriptor; a remote object has none and counts as 0644.
    pub fn mode(&self) -> Result<u32> {
        match &self.backing {
            Backing::Local(l) => l.mode(),
            Backing::Remote(_) => Ok(0o644),
        }
    }

    /// Whether a read has seen the source changed (every read fails from
    /// then on).
    pub fn is_changed(&self) -> bool {
        match &self.backing {
            Backing::Local(l) => l.is_changed(),
            Backing::Remote(r) => r.is_changed(),
        }
    }

    /// Locally: compare size and mtime now with those at open. Remotely:
    /// whether a response already showed the object changed (no request).
    pub fn check_unchanged(&self) -> Result<()> {
        match &self.backing {
            Backing::Local(l) => l.check_unchanged(),
            Backing::Remote(r) => r.check_unchanged(),
        }
    }

    /// Check that `[offset, offset + len)` lies inside the file.
    pub fn check_range(&self, offset: u64, len: u64, what: &str) -> Result<()> {
        check_range(self.path(), self.len(), offset, len, what)
    }

    /// Declare the byte ranges that readers read as units (each tensor's
    /// stored bytes): a remote source's sequential read-ahead stays inside
    /// the one a read is in, so reading one tensor fetches little beyond
    /// it. No effect on a local file.
    pub fn set_extents(&self, ranges: Vec<std::ops::Range<u64>>) {
        if let Backing::Remote(r) = &self.backing {
            r.set_extents(ranges);
        }
    }

    /// Whether this is a remote object.
    pub fn is_remote(&self) -> bool {
        matches!(self.backing, Backing::Remote(_))
    }

    /// Fill `buf` from absolute offset `offset`, from the version that was
    /// opened: a source changed since is a `Changed` error (for this and
    /// every later read), a short read a `Truncated` one; never a panic or
    /// a fault.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        match &self.backing {
            Backing::Local(l) => l.read_at(offset, buf),
            Backing::Remote(r) => {
                r.check_unchanged()?;
                self.check_range(offset, buf.len() as u64, "read")?;
                r.read_at(offset, buf)
            }
        }
    }

    /// Read `len` bytes at `offset` into a new buffer. The length is checked
    /// against the file size before anything is allocated.
    pub fn read_vec(&self, offset: u64, len: u64, what: &str) -> Result<Vec<u8>> {
        self.check_range(offset, len, what)?;
        let n = usize::try_from(len).map_err(|_| {
            err(ErrorKind::TooLarge, format!("{what}: {len} bytes")).path(self.path())
        })?;
        let mut buf = vec![0u8; n];
        self.read_at(offset, &mut buf)?;
        Ok(buf)
    }
}

/// A file timestamp: seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileTime {
    pub secs: i64,
    pub nanos: u32,
}

impl fmt::Display for FileTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:09}", self.secs, self.nanos)
    }
}

/// One version of a source file, as `fstat` saw it.
///
/// Device and inode say which file it is; size and mtime which contents:
/// every `write(2)` and truncation sets the mtime (and a rewrite in place
/// usually changes the size). The ctime also moves on changes that leave
/// the data alone (chmod, chown, link, unlink, rename): equality of the
/// whole value (a cache key) includes it, [`SourceVersion::same_data`] (the
/// read path's check) does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceVersion {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime: FileTime,
    pub ctime: FileTime,
}

impl SourceVersion {
    /// The version described by a `stat` record.
    pub fn from_stat(st: &libc::stat) -> SourceVersion {
        // `as` on these fields: their C types differ between targets (i64
        // or u64); the values are never negative except timestamps, which
        // keep their sign in i64.
        #[allow(clippy::unnecessary_cast)]
        SourceVersion {
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
            size: st.st_size as u64,
            mtime: FileTime {
                secs: st.st_mtime as i64,
                nanos: st.st_mtime_nsec as u32,
            },
            ctime: FileTime {
                secs: st.st_ctime as i64,
                nanos: st.st_ctime_nsec as u32,
            },
        }
    }

    /// The version described by `std::fs::Metadata` (of a path or a file).
    pub fn from_metadata(m: &std::fs::Metadata) -> SourceVersion {
        use std::os::unix::fs::MetadataExt;
        SourceVersion {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: FileTime {
                secs: m.mtime(),
                nanos: m.mtime_nsec() as u32,
            },
            ctime: FileTime {
                secs: m.ctime(),
                nanos: m.ctime_nsec() as u32,
            },
        }
    }

    /// Whether both describe the same file (device and inode), whatever its
    /// contents.
    pub fn same_file(&self, other: &SourceVersion) -> bool {
        self.dev == other.dev && self.ino == other.ino
    }

    /// Whether `now` is the same file with the same data: device, inode,
    /// size and mtime equal. The ctime is left out on purpose: renaming a
    /// new model over the path (the safe way to replace one), `mv`, `chmod`
    /// or a hard link change the open file's ctime but not a byte of it, and
    /// must not stop a mount. What this cannot see: a rewrite in place that
    /// keeps the size and then sets the mtime back (`touch -d`, `cp -p` of a
    /// file with the same mtime).
    pub fn same_data(&self, now: &SourceVersion) -> bool {
        self.same_file(now) && self.size == now.size && self.mtime == now.mtime
    }

    /// What differs from `self` in `now`, e.g. "size 100 -> 132 bytes,
    /// mtime 1700000000.000000000 -> 1700000100.250000000"; empty when
    /// nothing does.
    pub fn changes(&self, now: &SourceVersion) -> String {
        let mut parts = Vec::new();
        if !self.same_file(now) {
            parts.push(format!(
                "file {}:{} -> {}:{}",
                self.dev, self.ino, now.dev, now.ino
            ));
        }
        if self.size != now.size {
            parts.push(format!("size {} -> {} bytes", self.size, now.size));
        }
        if self.mtime != now.mtime {
            parts.push(format!("mtime {} -> {}", self.mtime, now.mtime));
        }
        if self.ctime != now.ctime {
            parts.push(format!("ctime {} -> {}", self.ctime, now.ctime));
        }
        parts.join(", ")
    }

    /// The device as `major:minor`.
    fn dev_name(&self) -> String {
        format!("{}:{}", libc::major(self.dev), libc::minor(self.dev))
    }
}

impl fmt::Display for SourceVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dev {} ino {}, {} bytes, mtime {}, ctime {}",
            self.dev_name(),
            self.ino,
            self.size,
            self.mtime,
            self.ctime
        )
    }
}

/// Check that `[offset, offset + len)` lies inside a file of `size` bytes
/// at `path` (for errors): overflow and out-of-bounds errors name both.
fn check_range(path: &Path, size: u64, offset: u64, len: u64, what: &str) -> Result<()> {
    let end = offset.checked_add(len).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("{what}: offset {offset} + length {len} overflows u64"),
        )
        .path(path)
    })?;
    if end > size {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!("{what}: bytes [{offset}, {end}) lie outside the file ({size} bytes)"),
        )
        .path(path)
        .at(offset));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(size: u64, mtime: i64) -> SourceVersion {
        SourceVersion {
            dev: (8 << 8) | 1,
            ino: 42,
            size,
            mtime: FileTime {
                secs: mtime,
                nanos: 5,
            },
            ctime: FileTime {
                secs: mtime,
                nanos: 5,
            },
        }
    }

    #[test]
    fn prints_compares_and_names_changes() {
        let a = v(100, 1_700_000_000);
        assert_eq!(
            a.to_string(),
            "dev 8:1 ino 42, 100 bytes, mtime 1700000000.000000005, ctime 1700000000.000000005"
        );
        assert_eq!(a, v(100, 1_700_000_000));
        assert!(a.changes(&a).is_empty());
        let b = v(132, 1_700_000_100);
        assert_ne!(a, b);
        assert!(a.same_file(&b) && !a.same_data(&b));
        let mut chmodded = a;
        chmodded.ctime.secs += 1;
        assert!(a.same_data(&chmodded) && a != chmodded);
        assert_eq!(
            a.changes(&b),
            "size 100 -> 132 bytes, mtime 1700000000.000000005 -> 1700000100.000000005, \
             ctime 1700000000.000000005 -> 1700000100.000000005"
        );
        let set: std::collections::HashSet<SourceVersion> = [a, b, a].into_iter().collect();
        assert_eq!(set.len(), 2);
    }

    #[test]
    fn stat_and_metadata_agree() {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), b"abc").unwrap();
        let m = std::fs::metadata(f.path()).unwrap();
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(f.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string and a stat buffer we own.
        assert_eq!(unsafe { libc::stat(c.as_ptr(), &mut st) }, 0);
        assert_eq!(
            SourceVersion::from_stat(&st),
            SourceVersion::from_metadata(&m)
        );
        assert_eq!(SourceVersion::from_metadata(&m).size, 3);
    }
}
