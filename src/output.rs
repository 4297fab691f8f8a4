//! Atomic output files: written to a temporary file in the target's
//! directory, fsynced, then moved to the target, so a killed or failed
//! encoding leaves nothing at the target path (at most a hidden
//! `.NAME.tmp.*` file after SIGKILL; every other failure removes it).
//!
//! Rules an output follows ([`OutputTarget`]):
//! - it is created with at most the permission bits of the files it is
//!   made from (`mode & 0o666`; the umask may remove more): a private
//!   model never yields a world-readable encoding;
//! - without `overwrite` an existing file is never replaced, also not one
//!   that appears while the encoder runs: the commit is
//!   `renameat2(RENAME_NOREPLACE)`, or `link` + `unlink` where the
//!   filesystem lacks it; both fail with EEXIST instead of replacing;
//! - an `s3://BUCKET/KEY` target is a multipart upload instead
//!   ([`crate::source::upload::S3Upload`]): the object appears only when
//!   complete, an unfinished upload is aborted, and without `overwrite` an
//!   existing object is never replaced (conditional completion); an
//!   `http(s)://` target is refused;
//! - it is never one of its own sources (same device and inode, a hard
//!   link included): checked when the output is created and, with
//!   `overwrite`, again right before the rename.

use std::ffi::{CString, OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, ErrorKind, Result, err};
use crate::source::{SourceFile, SourceVersion};

/// The longest file name Linux filesystems accept (NAME_MAX).
pub(crate) const NAME_MAX: usize = 255;

/// Where an encoder writes and what it may replace.
#[derive(Debug, Clone)]
pub struct OutputTarget {
    pub path: PathBuf,
    /// Replace an existing file at `path` (never one of `sources`).
    pub overwrite: bool,
    /// Permission bits of the new file (masked with 0o666).
    pub mode: u32,
    /// The files the output is made from: never replaced.
    pub sources: Vec<SourceVersion>,
}

impl OutputTarget {
    /// A target made from `sources`: mode the intersection of their
    /// permission bits now (read from the open descriptors) and 0o666.
    pub fn from_sources(path: &Path, overwrite: bool, sources: &[&SourceFile]) -> Result<Self> {
        let mut mode = 0o666;
        for s in sources {
            mode &= s.mode()?;
        }
        Ok(OutputTarget {
            path: path.to_path_buf(),
            overwrite,
            mode,
            sources: sources.iter().map(|s| *s.version()).collect(),
        })
    }

    /// Refuse a target that is (now) one of the sources: same device and
    /// inode, whatever the name (a hard link included). The target itself
    /// is looked at, not what a symlink there points to: a rename replaces
    /// the link, never its target.
    pub fn check_not_a_source(&self) -> Result<()> {
        let Ok(meta) = std::fs::symlink_metadata(&self.path) else {
            return Ok(());
        };
        let here = SourceVersion::from_metadata(&meta);
        if self.sources.iter().any(|s| s.same_file(&here)) {
            return Err(err(
                ErrorKind::BadValue,
                "output is one of the files it is encoded from (same device and inode): \
                 refusing to replace it",
            )
            .path(&self.path));
        }
        Ok(())
    }
}

/// How the commit moves the temporary file without replacing a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoReplace {
    /// `renameat2(RENAME_NOREPLACE)`, falling back to `Link` when the
    /// filesystem does not support it.
    Rename,
    /// `link(temp, target)` then `unlink(temp)`. Chosen directly only by
    /// tests: the fallback must be exercised where renameat2 works too.
    #[cfg_attr(not(test), allow(dead_code))]
    Link,
}

pub struct AtomicOutput {
    target: OutputTarget,
    temp: PathBuf,
    writer: Option<BufWriter<File>>,
    written: u64,
    /// Whether `temp` is still ours to remove (false once committed).
    temp_exists: bool,
    no_replace: NoReplace,
    /// The upload of an `s3://` target (then `writer` is None and `temp`
    /// is the URL, redacted).
    remote: Option<crate::source::upload::S3Upload>,
}

/// A distinct number per temporary file of this process.
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// `.NAME.tmp.PID.N`, with NAME shortened (at a character boundary when
/// it is UTF-8) so the whole name fits NAME_MAX; the suffix keeps it unique.
fn temp_name(name: &OsStr, seq: u64) -> OsString {
    let suffix = format!(".tmp.{}.{seq}", std::process::id());
    let room = NAME_MAX - 1 - suffix.len();
    let bytes = name.as_bytes();
    let mut keep = bytes.len().min(room);
    if let Ok(s) = std::str::from_utf8(bytes) {
        while !s.is_char_boundary(keep) {
            keep -= 1;
        }
    }
    let mut out = Vec::with_capacity(1 + keep + suffix.len());
    out.push(b'.');
    out.extend_from_slice(&bytes[..keep]);
    out.extend_from_slice(suffix.as_bytes());
    OsString::from_vec(out)
}

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Move `from` to `to` unless `to` exists (EEXIST then), atomically.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (f, t) = (c_path(from)?, c_path(to)?);
    // SAFETY: two NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The same without renameat2: a hard link fails with EEXIST when `to`
/// exists. Once linked the output is in place and the commit has
/// succeeded; a temporary name that cannot be removed then is only logged
/// (it is a second name of the finished output, not a partial file).
fn link_then_unlink(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::hard_link(from, to)?;
    if let Err(e) = std::fs::remove_file(from) {
        log::warn!("cannot remove {} after linking it: {e}", from.display());
    }
    Ok(())
}

impl AtomicOutput {
    /// Create the temporary file next to the target. An existing target is
    /// an error unless `overwrite`; a target that is one of the sources is
    /// an error either way.
    pub fn create(target: &OutputTarget) -> Result<AtomicOutput> {
        let path = &target.path;
        if let Some(url) = path.to_str().filter(|s| crate::source::is_remote(s)) {
            let upload = crate::source::upload::S3Upload::create(
                url,
                target.overwrite,
                &crate::source::RemoteOptions::current(),
            )?;
            return Ok(AtomicOutput {
                target: target.clone(),
                temp: PathBuf::from(upload.url()),
                writer: None,
                written: 0,
                temp_exists: false,
                no_replace: NoReplace::Rename,
                remote: Some(upload),
            });
        }
        target.check_not_a_source()?;
        if !target.overwrite && std::fs::symlink_metadata(path).is_ok() {
            return Err(err(
                ErrorKind::BadValue,
                "output exists (pass overwrite to replace it)",
            )
            .path(path));
        }
        let name = path
            .file_name()
            .ok_or_else(|| err(ErrorKind::BadValue, "output has no file name").path(path))?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        // create_new never opens an existing file; a name taken by someone
        // else's file (or an earlier run of a reused pid) takes the next.
        let mut attempt = 0;
        let (temp, file) = loop {
            let temp = dir.join(temp_name(name, TEMP_SEQ.fetch_add(1, Ordering::Relaxed)));
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(target.mode & 0o666)
                .open(&temp)
            {
                Ok(f) => break (temp, f),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 100 => {
                    attempt += 1;
                }
                Err(e) => return Err(Error::io(&temp, "cannot create temporary output", e)),
            }
        };
        Ok(AtomicOutput {
            target: target.clone(),
            temp,
            writer: Some(BufWriter::with_capacity(1 << 20, file)),
            written: 0,
            temp_exists: true,
            no_replace: NoReplace::Rename,
            remote: None,
        })
    }

    pub fn temp_path(&self) -> &Path {
        &self.temp
    }

    /// An unnamed scratch file next to the temporary output (same
    /// filesystem, mode 0600, gone when closed, whatever happens): for
    /// writers whose header must precede data they only know once the data
    /// is made. `O_TMPFILE` where the filesystem has it; otherwise a
    /// hidden name that is removed at once.
    pub fn scratch_file(&self) -> Result<File> {
        // An upload has no directory of its own: the system's temporary one.
        let tmp = std::env::temp_dir();
        let dir = if self.remote.is_some() {
            tmp.as_path()
        } else {
            self.temp
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
        };
        if let Ok(c) = CString::new(dir.as_os_str().as_bytes()) {
            // SAFETY: c is a valid C string; the returned descriptor is
            // ours alone and owned by the File from here on.
            let fd = unsafe {
                libc::open(
                    c.as_ptr(),
                    libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
                    0o600,
                )
            };
            if fd >= 0 {
                use std::os::fd::FromRawFd;
                // SAFETY: fd was just opened and is not owned elsewhere.
                return Ok(unsafe { File::from_raw_fd(fd) });
            }
        }
        let name = self.target.path.file_name().unwrap_or(OsStr::new("output"));
        let scratch = dir.join(temp_name(name, TEMP_SEQ.fetch_add(1, Ordering::Relaxed)));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&scratch)
            .map_err(|e| Error::io(&scratch, "cannot create a scratch file", e))?;
        let _ = std::fs::remove_file(&scratch);
        Ok(file)
    }

    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// Flush, fsync, move into place, fsync the directory. On any error the
    /// temporary file is removed (by drop) and the target is as it was.
    pub fn commit(mut self) -> Result<u64> {
        if let Some(upload) = self.remote.take() {
            return upload.commit();
        }
        let w = self
            .writer
            .take()
            .ok_or_else(|| err(ErrorKind::Io, "output already finished"))?;
        let file = w
            .into_inner()
            .map_err(|e| Error::io(&self.temp, "flush", e.into_error()))?;
        file.sync_all()
            .map_err(|e| Error::io(&self.temp, "fsync", e))?;
        drop(file);
        let target = &self.target.path;
        if self.target.overwrite {
            // Right before the rename: the target may have been replaced by
            // a link to a source while the encoder ran.
            self.target.check_not_a_source()?;
            std::fs::rename(&self.temp, target)
                .map_err(|e| Error::io(target, "rename into place", e))?;
        } else {
            let moved = match self.no_replace {
                NoReplace::Rename => match rename_noreplace(&self.temp, target) {
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                        link_then_unlink(&self.temp, target)
                    }
                    r => r,
                },
                NoReplace::Link => link_then_unlink(&self.temp, target),
            };
            moved.map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    err(
                        ErrorKind::BadValue,
                        "a file appeared at the output while encoding; it was left as it is \
                         (pass overwrite to replace it)",
                    )
                    .path(target)
                } else {
                    Error::io(target, "move into place", e)
                }
            })?;
        }
        self.temp_exists = false;
        if let Some(dir) = target.parent().filter(|p| !p.as_os_str().is_empty())
            && let Ok(d) = File::open(dir)
        {
            let _ = d.sync_all();
        }
        Ok(self.written)
    }
}

impl Write for AtomicOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(u) = self.remote.as_mut() {
            let n = u.write(buf)?;
            self.written += n as u64;
            return Ok(n);
        }
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| std::io::Error::other("output already finished"))?;
        let n = w.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.writer.as_mut() {
            Some(w) => w.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for AtomicOutput {
    fn drop(&mut self) {
        // Close before removing (a failed flush here is moot: the file goes).
        drop(self.writer.take());
        if self.temp_exists {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn target(path: &Path, overwrite: bool) -> OutputTarget {
        OutputTarget {
            path: path.to_path_buf(),
            overwrite,
            mode: 0o644,
            sources: Vec::new(),
        }
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        v.sort();
        v
    }

    /// A scratch file reads back what was written and has no name: the
    /// directory holds only the temporary output, and after commit only
    /// the target.
    #[test]
    fn scratch_files_are_unnamed() {
        use std::io::{Read, Seek};
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("m.sk32");
        let mut o = AtomicOutput::create(&target(&out, false)).unwrap();
        let mut s = o.scratch_file().unwrap();
        s.write_all(b"factors").unwrap();
        s.seek(io::SeekFrom::Start(0)).unwrap();
        let mut back = String::new();
        s.read_to_string(&mut back).unwrap();
        assert_eq!(back, "factors");
        assert_eq!(names(d.path()).len(), 1, "{:?}", names(d.path()));
        o.write_all(b"x").unwrap();
        o.commit().unwrap();
        drop(s);
        assert_eq!(names(d.path()), vec!["m.sk32".to_string()]);
    }

    #[test]
    fn commit_renames_and_drop_cleans_up() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("out.sk32");
        let mut o = AtomicOutput::create(&target(&path, false)).unwrap();
        o.write_all(b"hello").unwrap();
        let temp = o.temp_path().to_path_buf();
        let temp_name = temp.file_name().unwrap().to_string_lossy().to_string();
        assert!(temp_name.starts_with(".out.sk32.tmp."), "{temp_name}");
        assert!(temp.exists() && !path.exists());
        assert_eq!(o.commit().unwrap(), 5);
        assert_eq!(std::fs::read(&path).unwrap(), b"hello");
        assert!(!temp.exists());
        // Exists: refused without overwrite.
        assert!(AtomicOutput::create(&target(&path, false)).is_err());
        // A dropped (failed) output leaves nothing behind.
        let mut o = AtomicOutput::create(&target(&path, true)).unwrap();
        o.write_all(b"partial").unwrap();
        let temp = o.temp_path().to_path_buf();
        drop(o);
        assert!(!temp.exists());
        assert_eq!(std::fs::read(&path).unwrap(), b"hello");
        assert_eq!(names(d.path()), ["out.sk32"]);
    }

    /// A file that appears at the target after create is never replaced,
    /// by the renameat2 commit and by the link fallback alike; the
    /// temporary file goes.
    #[test]
    fn commit_never_replaces_a_file_that_appeared() {
        for how in [NoReplace::Rename, NoReplace::Link] {
            let d = tempfile::tempdir().unwrap();
            let path = d.path().join("x.knot");
            let mut o = AtomicOutput::create(&target(&path, false)).unwrap();
            o.no_replace = how;
            o.write_all(b"encoded").unwrap();
            std::fs::write(&path, b"someone else's").unwrap();
            let e = o.commit().unwrap_err();
            assert!(e.to_string().contains("appeared"), "{how:?}: {e}");
            assert!(e.to_string().contains("x.knot"), "{how:?}: {e}");
            assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
            assert_eq!(names(d.path()), ["x.knot"], "{how:?}");
            // Without a competitor both commit.
            let other = d.path().join("y.knot");
            let mut o = AtomicOutput::create(&target(&other, false)).unwrap();
            o.no_replace = how;
            o.write_all(b"ok").unwrap();
            o.commit().unwrap();
            assert_eq!(std::fs::read(&other).unwrap(), b"ok");
            assert_eq!(names(d.path()), ["x.knot", "y.knot"], "{how:?}");
        }
    }

    /// A commit that fails (the target is a directory) removes the
    /// temporary file and leaves the directory alone.
    #[test]
    fn failed_commit_removes_the_temporary() {
        for overwrite in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let path = d.path().join("out.knot");
            let mut o = AtomicOutput::create(&target(&path, overwrite)).unwrap();
            o.write_all(&[1u8; 100_000]).unwrap();
            std::fs::create_dir(&path).unwrap();
            std::fs::write(path.join("inside"), b"x").unwrap();
            assert!(o.commit().is_err());
            assert_eq!(names(d.path()), ["out.knot"], "overwrite {overwrite}");
            assert!(path.join("inside").exists());
        }
    }

    #[test]
    fn temp_names_fit_name_max() {
        let d = tempfile::tempdir().unwrap();
        // ASCII at the limit, and multi-byte characters (cut at a char).
        for name in ["a".repeat(255), "é".repeat(127), "b".repeat(200)] {
            let path = d.path().join(&name);
            let mut o = AtomicOutput::create(&target(&path, false)).unwrap();
            let temp = o.temp_path().file_name().unwrap().to_owned();
            assert!(temp.len() <= NAME_MAX, "{} bytes", temp.len());
            let t = temp.to_str().expect("cut at a character boundary");
            assert!(t.starts_with('.') && t.contains(".tmp."), "{t}");
            o.write_all(b"x").unwrap();
            o.commit().unwrap();
            assert!(path.exists());
            std::fs::remove_file(&path).unwrap();
        }
        // Two outputs with one long name get distinct temporaries.
        let path = d.path().join("c".repeat(255));
        let a = AtomicOutput::create(&target(&path, true)).unwrap();
        let b = AtomicOutput::create(&target(&path, true)).unwrap();
        assert_ne!(a.temp_path(), b.temp_path());
    }

    #[test]
    fn mode_is_at_most_the_sources() {
        let d = tempfile::tempdir().unwrap();
        let private = d.path().join("private.gguf");
        std::fs::write(&private, b"model").unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        let open = d.path().join("open.gguf");
        std::fs::write(&open, b"model").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        let (p, o) = (
            SourceFile::open(&private).unwrap(),
            SourceFile::open(&open).unwrap(),
        );
        let t = OutputTarget::from_sources(&d.path().join("out"), false, &[&o, &p]).unwrap();
        assert_eq!(t.mode, 0o600);
        let mut out = AtomicOutput::create(&t).unwrap();
        out.write_all(b"x").unwrap();
        out.commit().unwrap();
        let mode = std::fs::metadata(d.path().join("out"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn never_replaces_a_source() {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("model.gguf");
        std::fs::write(&model, b"model").unwrap();
        let link = d.path().join("link.gguf");
        std::fs::hard_link(&model, &link).unwrap();
        let src = SourceFile::open(&model).unwrap();
        for path in [&model, &link] {
            let t = OutputTarget::from_sources(path, true, &[&src]).unwrap();
            let e = AtomicOutput::create(&t).err().unwrap();
            assert!(e.to_string().contains("same device and inode"), "{e}");
        }
        // A link made after create is caught at commit.
        let later = d.path().join("later.gguf");
        let t = OutputTarget::from_sources(&later, true, &[&src]).unwrap();
        let mut o = AtomicOutput::create(&t).unwrap();
        o.write_all(b"encoded").unwrap();
        std::fs::hard_link(&model, &later).unwrap();
        let e = o.commit().unwrap_err();
        assert!(e.to_string().contains("same device and inode"), "{e}");
        assert_eq!(std::fs::read(&model).unwrap(), b"model");
        assert_eq!(names(d.path()), ["later.gguf", "link.gguf", "model.gguf"]);
    }
}
