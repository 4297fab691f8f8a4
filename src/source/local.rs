//! A local source file read by positioned reads, checked against the
//! version that was opened.
//!
//! Every byte the library reads from a local model file goes through
//! [`LocalFile::read_at`] (behind [`super::SourceFile`]). It uses `pread(2)`, never a mapping: a file that
//! shrinks under a running mount gives a short read, never SIGBUS.
//!
//! After every `pread` the descriptor is `fstat`ed and its size and mtime
//! compared with those at open ([`SourceVersion::same_data`]; why not the
//! ctime is said there). Bytes read after the file changed may come from
//! the new contents at the old offsets, so a mismatch fails the read with a
//! `Changed` error, and every later read fails with the same error without
//! touching the file. Checking after the read (not before) matters: a write
//! that lands while the `pread` runs is caught by the `fstat` that follows
//! it. One `fstat` costs about 0.4 µs (examples/source_check_cost.rs: +60%
//! on a 4 KiB read from the page cache, +0.7% on 1 MiB; a FUSE round trip
//! costs tens of µs).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::SystemTime;

use super::SourceVersion;
use crate::error::{Error, ErrorKind, Result, err};

/// An open, read-only local model file and the version it had when opened.
#[derive(Debug)]
pub(crate) struct LocalFile {
    path: PathBuf,
    file: File,
    version: SourceVersion,
    modified: Option<SystemTime>,
    /// Set once, by the first read that saw the file changed: what changed.
    /// From then on every read fails with it.
    changed: OnceLock<String>,
}

/// `fstat` of an open file.
fn fstat(file: &File) -> io::Result<libc::stat> {
    // SAFETY: fstat fills the zeroed buffer we own; the descriptor is open
    // for as long as `file` lives.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(file.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st)
    }
}

impl LocalFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, "cannot open", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat", e))?;
        if meta.is_dir() {
            return Err(err(ErrorKind::Io, "is a directory, not a model file").path(path));
        }
        Ok(LocalFile {
            path: path.to_path_buf(),
            version: SourceVersion::from_metadata(&meta),
            file,
            modified: meta.modified().ok(),
            changed: OnceLock::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size at open time. All bounds checks use this value.
    pub fn len(&self) -> u64 {
        self.version.size
    }

    pub fn modified(&self) -> Option<SystemTime> {
        self.modified
    }

    /// The version that was opened (and that every read is checked against).
    pub fn version(&self) -> &SourceVersion {
        &self.version
    }

    /// The file's permission bits now (`st_mode & 0o7777`), from the open
    /// descriptor: a rename over the path does not change what this says.
    pub fn mode(&self) -> Result<u32> {
        let st = fstat(&self.file).map_err(|e| Error::io(&self.path, "cannot stat", e))?;
        Ok(st.st_mode & 0o7777)
    }

    /// Whether a read has seen the file changed (every read fails from then on).
    pub fn is_changed(&self) -> bool {
        self.changed.get().is_some()
    }

    fn changed_error(&self, what: &str) -> Error {
        err(
            ErrorKind::Changed,
            format!(
                "the file changed after it was opened ({what}); its data may have moved, so \
                 nothing more is read from it: remount to serve the new version"
            ),
        )
        .path(&self.path)
    }

    /// Compare the file's size and mtime now with those at open. A mismatch
    /// is recorded (sticky) and returned as a `Changed` error.
    pub fn check_unchanged(&self) -> Result<()> {
        if let Some(what) = self.changed.get() {
            return Err(self.changed_error(what));
        }
        let st = fstat(&self.file).map_err(|e| Error::io(&self.path, "cannot stat", e))?;
        let now = SourceVersion::from_stat(&st);
        if self.version.same_data(&now) {
            return Ok(());
        }
        // The first reader to notice records what changed; later ones
        // report the same thing.
        let what = self.changed.get_or_init(|| self.version.changes(&now));
        Err(self.changed_error(what))
    }

    /// Check that `[offset, offset + len)` lies inside the file.
    pub fn check_range(&self, offset: u64, len: u64, what: &str) -> Result<()> {
        super::check_range(&self.path, self.len(), offset, len, what)
    }

    /// Fill `buf` from absolute offset `offset`, from the version that was
    /// opened: a file changed since is a `Changed` error (for this and every
    /// later read), a short read a `Truncated` one; never a panic or a fault.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if let Some(what) = self.changed.get() {
            return Err(self.changed_error(what));
        }
        self.check_range(offset, buf.len() as u64, "read")?;
        let mut done = 0usize;
        while done < buf.len() {
            // `done` and `offset` were bounds-checked above against the
            // open-time length.
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    // The file shrank: that is a change (and says so).
                    self.check_unchanged()?;
                    return Err(err(
                        ErrorKind::Truncated,
                        format!(
                            "file ended at byte {} while reading {} bytes at {offset} \
                             (it was {} bytes when opened)",
                            offset + done as u64,
                            buf.len(),
                            self.len()
                        ),
                    )
                    .path(&self.path)
                    .at(offset));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::io(&self.path, &format!("read at byte {offset}"), e));
                }
            }
        }
        self.check_unchanged()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_and_bounds() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"0123456789").unwrap();
        let s = LocalFile::open(f.path()).unwrap();
        assert_eq!(s.len(), 10);
        let mut b = [0u8; 3];
        s.read_at(7, &mut b).unwrap();
        assert_eq!(&b, b"789");
        assert_eq!(
            s.read_at(8, &mut b).unwrap_err().kind(),
            ErrorKind::OutOfBounds
        );
        assert_eq!(
            s.check_range(u64::MAX, 2, "x").unwrap_err().kind(),
            ErrorKind::Overflow
        );
    }

    #[test]
    fn shrink_after_open_is_a_sticky_change() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        let s = LocalFile::open(f.path()).unwrap();
        f.as_file().set_len(100).unwrap();
        let mut b = [0u8; 64];
        let e = s.read_at(1000, &mut b).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Changed);
        assert_eq!(e.errno(), libc::ESTALE);
        assert!(e.to_string().contains("size 4096 -> 100 bytes"), "{e}");
        assert!(e.to_string().contains("remount"), "{e}");
        // Bytes still inside the file fail too: the file changed.
        let again = s.read_at(0, &mut b).unwrap_err();
        assert_eq!(again.kind(), ErrorKind::Changed);
        assert_eq!(again.to_string(), e.to_string());
    }

    /// Changes that leave the data alone (chmod, a hard link, a new file
    /// renamed over the path) do not stop reads of the open file.
    #[test]
    fn metadata_changes_do_not_fail_reads() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.gguf");
        std::fs::write(&path, b"0123456789").unwrap();
        let s = LocalFile::open(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::hard_link(&path, d.path().join("link")).unwrap();
        std::fs::write(d.path().join("new"), b"something else").unwrap();
        std::fs::rename(d.path().join("new"), &path).unwrap();
        std::fs::remove_file(d.path().join("link")).unwrap();
        let mut b = [0u8; 4];
        s.read_at(6, &mut b).unwrap();
        assert_eq!(&b, b"6789");
        assert_eq!(s.mode().unwrap(), 0o600);
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: an open descriptor and a buffer we own.
        assert_eq!(unsafe { libc::fstat(s.file.as_raw_fd(), &mut st) }, 0);
        assert_eq!(st.st_nlink, 0, "unlinked, still open");
    }

    /// A rewrite in place that keeps the size: caught by the mtime, and
    /// the error stays after the file is put back.
    #[test]
    fn rewrite_in_place_is_changed_and_sticky() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"0123456789").unwrap();
        let s = LocalFile::open(f.path()).unwrap();
        let mut b = [0u8; 4];
        s.read_at(0, &mut b).unwrap();
        assert!(!s.is_changed());
        // Timestamps have the kernel's tick resolution: set them explicitly
        // so the test does not depend on a tick passing.
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(f.path())
            .unwrap()
            .set_modified(later)
            .unwrap();
        let e = s.read_at(0, &mut b).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Changed);
        let msg = e.to_string();
        assert!(msg.contains("mtime") && msg.contains("ctime"), "{msg}");
        assert!(!msg.contains("size"), "{msg}");
        assert!(msg.starts_with(&f.path().display().to_string()), "{msg}");
        assert!(s.is_changed());
        assert_eq!(
            s.read_at(2, &mut b).unwrap_err().to_string(),
            msg,
            "every later read fails with the same error"
        );
    }
}
