//! A private cache directory on disk, shared by the processes of one user
//! (several mounts, remounts): what the decoded-file store (`store`) and
//! the source part cache (`part_cache`) have in common. It sits in
//! `source`, the lower of the two modules (the store, in `cache`, uses it
//! from above).
//!
//! - **Trusted or refused.** Created 0700 if missing; an existing one must
//!   be a real directory (not a symlink), owned by this process's euid,
//!   with no group or other permission bits: anyone who could write into it
//!   could plant bytes a mount would serve.
//! - **No symlinks.** Every file is opened relative to the directory's
//!   descriptor with O_NOFOLLOW (a renamed or replaced directory path does
//!   not redirect us either).
//! - **Temporaries.** Files are written under `.tmp.<stem>.<pid>.<n><suffix>`
//!   and renamed into place; a writer killed mid-write leaves only such a
//!   file, removed by [`CacheDir::remove_stale_temporaries`] once its pid
//!   is gone.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, ErrorKind, Result, err};

/// Prefix of the names of files being written.
pub(crate) const TMP_PREFIX: &str = ".tmp.";

/// What `fstatat` says of a name in the directory (not following a
/// symlink).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stat {
    pub ino: u64,
    pub size: u64,
    pub mode: libc::mode_t,
    pub uid: u32,
    /// Last modification, in nanoseconds since the epoch.
    pub mtime_ns: i64,
}

impl Stat {
    pub fn is_file(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
}

/// An open, checked cache directory.
pub(crate) struct CacheDir {
    file: File,
    path: PathBuf,
    /// What the directory is, for messages ("decoded cache").
    what: &'static str,
    euid: u32,
}

/// Number of the next temporary name: process-wide, so that two
/// `CacheDir`s on one directory in one process never pick the same name.
static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

impl std::fmt::Debug for CacheDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CacheDir({}: {})", self.what, self.path.display())
    }
}

pub(crate) fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

fn c_name(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Whether process `pid` exists (on this host's PID namespace).
fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    alive || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl CacheDir {
    /// Open (creating it, mode 0700) the cache directory `dir`; `what`
    /// names it in errors and logs ("decoded cache"). Refused: a symlink,
    /// something that is not a directory, a directory of another user or
    /// one that group or others may access.
    pub fn open(dir: &Path, what: &'static str) -> Result<CacheDir> {
        let c = CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| err(ErrorKind::BadValue, "NUL in the path").path(dir))?;
        // SAFETY: a valid C string; mkdir does not keep it.
        if unsafe { libc::mkdir(c.as_ptr(), 0o700) } != 0 {
            let e = last_os_error();
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(Error::io(
                    dir,
                    &format!("cannot create the {what} directory"),
                    e,
                ));
            }
        }
        // SAFETY: a valid C string; the descriptor returned is owned below.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(Error::io(
                dir,
                &format!("cannot open the {what} directory (a symlink or not a directory?)"),
                last_os_error(),
            ));
        }
        // SAFETY: `fd` is a new descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let m = file
            .metadata()
            .map_err(|e| Error::io(dir, "cannot stat", e))?;
        // SAFETY: geteuid cannot fail.
        let euid = unsafe { libc::geteuid() };
        if m.uid() != euid {
            return Err(err(
                ErrorKind::Io,
                format!(
                    "the {what} directory belongs to uid {}, not to this user ({euid}): \
                     its entries could not be trusted",
                    m.uid()
                ),
            )
            .path(dir));
        }
        if m.mode() & 0o077 != 0 {
            return Err(err(
                ErrorKind::Io,
                format!(
                    "the {what} directory has mode {:o}: others could plant entries \
                     (chmod 700 it)",
                    m.mode() & 0o7777
                ),
            )
            .path(dir));
        }
        Ok(CacheDir {
            file,
            path: dir.to_path_buf(),
            what,
            euid,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The user the directory (and every file we use in it) belongs to.
    pub fn uid(&self) -> u32 {
        self.euid
    }

    /// Names in the directory (not `.` and `..`; names that are not UTF-8
    /// are none of ours and left out).
    pub fn names(&self) -> Vec<String> {
        // A second descriptor for the listing: fdopendir takes ownership.
        // SAFETY: dup of a descriptor we own; fdopendir owns the copy and
        // closedir closes it.
        let mut out = Vec::new();
        unsafe {
            let fd = libc::dup(self.file.as_raw_fd());
            if fd < 0 {
                return out;
            }
            let d = libc::fdopendir(fd);
            if d.is_null() {
                libc::close(fd);
                return out;
            }
            libc::rewinddir(d);
            loop {
                let e = libc::readdir(d);
                if e.is_null() {
                    break;
                }
                let name = CStr::from_ptr((*e).d_name.as_ptr());
                if let Ok(s) = name.to_str()
                    && s != "."
                    && s != ".."
                {
                    out.push(s.to_string());
                }
            }
            libc::closedir(d);
        }
        out
    }

    /// Open `name` in the directory (no symlinks followed).
    pub fn open_at(&self, name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<File> {
        let c = c_name(name)?;
        // SAFETY: a valid C string and our directory descriptor; the new
        // descriptor is owned by the File.
        let fd = unsafe {
            libc::openat(
                self.file.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(last_os_error());
        }
        // SAFETY: a new descriptor nobody else owns.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// Remove `name`; true if this call removed it.
    pub fn unlink(&self, name: &str) -> bool {
        let Ok(c) = c_name(name) else {
            return false;
        };
        // SAFETY: a valid C string and our directory descriptor.
        unsafe { libc::unlinkat(self.file.as_raw_fd(), c.as_ptr(), 0) == 0 }
    }

    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (f, t) = (c_name(from)?, c_name(to)?);
        let d = self.file.as_raw_fd();
        // SAFETY: valid C strings and our directory descriptor.
        if unsafe { libc::renameat(d, f.as_ptr(), d, t.as_ptr()) } == 0 {
            Ok(())
        } else {
            Err(last_os_error())
        }
    }

    /// `fstatat` of `name`, not following a symlink.
    pub fn stat_at(&self, name: &str) -> Option<Stat> {
        let c = c_name(name).ok()?;
        // SAFETY: a valid C string, our directory and a buffer we own.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstatat(
                self.file.as_raw_fd(),
                c.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            ) != 0
            {
                return None;
            }
            #[allow(clippy::unnecessary_cast)]
            Some(Stat {
                ino: st.st_ino as u64,
                size: st.st_size as u64,
                mode: st.st_mode,
                uid: st.st_uid,
                mtime_ns: (st.st_mtime as i64)
                    .saturating_mul(1_000_000_000)
                    .saturating_add(st.st_mtime_nsec as i64),
            })
        }
    }

    /// A fresh name to write `stem` under before renaming it into place:
    /// `.tmp.<stem>.<pid>.<n><suffix>` (`stem` must not contain a dot, so
    /// the pid can be read back).
    pub fn temp_name(&self, stem: &str, suffix: &str) -> String {
        let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
        format!("{TMP_PREFIX}{stem}.{}.{n}{suffix}", std::process::id())
    }

    /// Remove temporary files whose writer is gone (killed mid-write).
    pub fn remove_stale_temporaries(&self) {
        for n in self.names() {
            let Some(rest) = n.strip_prefix(TMP_PREFIX) else {
                continue;
            };
            let pid = rest.split('.').nth(1).and_then(|p| p.parse::<i32>().ok());
            if pid.is_some_and(|p| !process_alive(p)) {
                log::info!(
                    "{}: removing {n}, left by a process that is gone",
                    self.what
                );
                self.unlink(&n);
            }
        }
    }

    /// Bytes an unprivileged writer may still allocate on the directory's
    /// filesystem.
    pub fn free_bytes(&self) -> io::Result<u64> {
        // SAFETY: fstatvfs fills the zeroed buffer we own.
        unsafe {
            let mut s: libc::statvfs = std::mem::zeroed();
            if libc::fstatvfs(self.file.as_raw_fd(), &mut s) != 0 {
                return Err(last_os_error());
            }
            #[allow(clippy::unnecessary_cast)]
            Ok((s.f_bavail as u64).saturating_mul(s.f_frsize as u64))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn refusal(dir: &Path) -> String {
        CacheDir::open(dir, "test cache").unwrap_err().to_string()
    }

    #[test]
    fn only_a_private_directory_of_this_user_is_opened() {
        let t = tempfile::tempdir().unwrap();
        let set_mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        let new = t.path().join("new");
        let d = CacheDir::open(&new, "test cache").unwrap();
        assert_eq!(
            std::fs::metadata(&new).unwrap().permissions().mode() & 0o7777,
            0o700
        );
        assert_eq!(d.path(), new);
        for mode in [0o777, 0o750, 0o701] {
            set_mode(&new, mode);
            let e = refusal(&new);
            assert!(
                e.contains(&format!("test cache directory has mode {mode:o}")),
                "{e}"
            );
            assert!(e.contains(&*new.to_string_lossy()), "{e}");
        }
        set_mode(&new, 0o700);
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&new, &link).unwrap();
        let e = refusal(&link);
        assert!(
            e.contains("symlink") && e.contains(&*link.to_string_lossy()),
            "{e}"
        );
        let file = t.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(refusal(&file).contains("not a directory"));
        // Another user's directory: as root, one chowned to nobody;
        // otherwise `/`, which belongs to root.
        // SAFETY: geteuid cannot fail.
        let others = if unsafe { libc::geteuid() } == 0 {
            let d = t.path().join("nobody");
            std::fs::create_dir(&d).unwrap();
            set_mode(&d, 0o700);
            std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
            d
        } else {
            PathBuf::from("/")
        };
        let e = refusal(&others);
        assert!(e.contains("belongs to uid"), "{e}");
    }

    #[test]
    fn files_are_opened_without_following_symlinks() {
        let t = tempfile::tempdir().unwrap();
        let d = CacheDir::open(&t.path().join("d"), "test cache").unwrap();
        std::fs::write(t.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(t.path().join("secret"), d.path().join("a")).unwrap();
        let e = d.open_at("a", libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        assert!(!d.stat_at("a").unwrap().is_file());
        // Temporaries: unique names, removed once their writer is gone.
        let (a, b) = (d.temp_name("x", ".data"), d.temp_name("x", ".data"));
        assert_ne!(a, b);
        std::fs::write(d.path().join(&a), b"").unwrap();
        std::fs::write(d.path().join(".tmp.x.999999999.0.data"), b"").unwrap();
        d.remove_stale_temporaries();
        let mut left: Vec<String> = d.names();
        left.sort();
        assert_eq!(left, vec![a, "a".to_string()]);
    }
}
