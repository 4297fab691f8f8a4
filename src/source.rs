//! Read-only access to a source file by positioned reads.
//!
//! Every byte the library reads from a model file goes through
//! [`SourceFile::read_at`]. It uses `pread(2)`, never a mapping: a file that
//! shrinks under a running mount gives a short read, which becomes a
//! `Truncated` error (EIO at the filesystem), where a mapping would raise
//! SIGBUS and kill the daemon.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Error, ErrorKind, Result, err};

/// An open, read-only model file and the size it had when opened.
#[derive(Debug)]
pub struct SourceFile {
    path: PathBuf,
    file: File,
    len: u64,
    modified: Option<SystemTime>,
}

impl SourceFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, "cannot open", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat", e))?;
        if meta.is_dir() {
            return Err(err(ErrorKind::Io, "is a directory, not a model file").path(path));
        }
        Ok(SourceFile {
            path: path.to_path_buf(),
            file,
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size at open time. All bounds checks use this value.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn modified(&self) -> Option<SystemTime> {
        self.modified
    }

    /// Check that `[offset, offset + len)` lies inside the file.
    pub fn check_range(&self, offset: u64, len: u64, what: &str) -> Result<()> {
        let end = offset.checked_add(len).ok_or_else(|| {
            err(
                ErrorKind::Overflow,
                format!("{what}: offset {offset} + length {len} overflows u64"),
            )
            .path(&self.path)
        })?;
        if end > self.len {
            return Err(err(
                ErrorKind::OutOfBounds,
                format!(
                    "{what}: bytes [{offset}, {end}) lie outside the file ({} bytes)",
                    self.len
                ),
            )
            .path(&self.path)
            .at(offset));
        }
        Ok(())
    }

    /// Fill `buf` from absolute offset `offset`. A short read (the file
    /// shrank after open) is a `Truncated` error, not a panic or a fault.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64, "read")?;
        let mut done = 0usize;
        while done < buf.len() {
            // `done` and `offset` were bounds-checked above against the
            // open-time length.
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(err(
                        ErrorKind::Truncated,
                        format!(
                            "file ended at byte {} while reading {} bytes at {offset} \
                             (it was {} bytes when opened: changed or truncated underneath)",
                            offset + done as u64,
                            buf.len(),
                            self.len
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
        Ok(())
    }

    /// Read `len` bytes at `offset` into a new buffer. The length is checked
    /// against the file size before anything is allocated.
    pub fn read_vec(&self, offset: u64, len: u64, what: &str) -> Result<Vec<u8>> {
        self.check_range(offset, len, what)?;
        let n = usize::try_from(len).map_err(|_| {
            err(ErrorKind::TooLarge, format!("{what}: {len} bytes")).path(&self.path)
        })?;
        let mut buf = vec![0u8; n];
        self.read_at(offset, &mut buf)?;
        Ok(buf)
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
        let s = SourceFile::open(f.path()).unwrap();
        assert_eq!(s.len(), 10);
        let mut b = [0u8; 3];
        s.read_at(7, &mut b).unwrap();
        assert_eq!(&b, b"789");
        assert_eq!(
            s.read_at(8, &mut b).unwrap_err().kind(),
            ErrorKind::OutOfBounds
        );
        assert_eq!(
            s.read_vec(u64::MAX, 2, "x").unwrap_err().kind(),
            ErrorKind::Overflow
        );
    }

    #[test]
    fn shrink_after_open_is_truncated_error() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        let s = SourceFile::open(f.path()).unwrap();
        f.as_file().set_len(100).unwrap();
        let mut b = [0u8; 64];
        s.read_at(0, &mut b).unwrap();
        let e = s.read_at(1000, &mut b).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Truncated);
        assert!(e.to_string().contains("changed or truncated"), "{e}");
    }
}
