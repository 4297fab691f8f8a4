//! Checks made before anything is mounted, so a bad invocation fails with a
//! clear message and leaves nothing behind.

use std::path::{Path, PathBuf};

/// Validate the mountpoint: it exists, is a directory, is empty and is not
/// already a mount. Returns its canonical path.
pub fn check_mountpoint(p: &Path) -> Result<PathBuf, String> {
    let meta = std::fs::metadata(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("mountpoint {} does not exist", p.display()),
        std::io::ErrorKind::NotConnected => format!(
            "mountpoint {} is a dead FUSE mount (\"Transport endpoint is not connected\"); \
             clear it with: fusermount3 -uz {}",
            p.display(),
            p.display()
        ),
        _ => format!("mountpoint {}: {e}", p.display()),
    })?;
    if !meta.is_dir() {
        return Err(format!("mountpoint {} is not a directory", p.display()));
    }
    let canon = p
        .canonicalize()
        .map_err(|e| format!("mountpoint {}: {e}", p.display()))?;
    if is_mountpoint(&canon)? {
        return Err(format!("{} is already a mount point", canon.display()));
    }
    let mut entries = std::fs::read_dir(&canon)
        .map_err(|e| format!("mountpoint {}: cannot list: {e}", canon.display()))?;
    if entries.next().is_some() {
        return Err(format!("mountpoint {} is not empty", canon.display()));
    }
    Ok(canon)
}

/// Undo the octal escapes of /proc/self/mountinfo (`\040` is a space).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = oct.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `canon` is the mount point of some mount.
pub fn is_mountpoint(canon: &Path) -> Result<bool, String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let want = canon.to_string_lossy();
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape(mp) == want))
}

/// FUSE must be usable: /dev/fuse present and openable, and for a non-root
/// user the setuid helper fusermount3.
pub fn check_fuse() -> Result<(), String> {
    const INSTALL: &str = "install FUSE 3 (Debian/Ubuntu: apt-get install fuse3) and load the \
                           kernel module (modprobe fuse)";
    // RKNOT_FUSE_DEVICE points the check elsewhere (tests of this message).
    let dev_override = std::env::var_os("RKNOT_FUSE_DEVICE").map(PathBuf::from);
    let dev = dev_override.as_deref().unwrap_or(Path::new("/dev/fuse"));
    if !dev.exists() {
        return Err(format!(
            "FUSE is not available: {} does not exist; {INSTALL}",
            dev.display()
        ));
    }
    let root = geteuid() == 0;
    if root {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dev)
            .map_err(|e| {
                format!(
                    "FUSE is not available: cannot open {}: {e}; {INSTALL}",
                    dev.display()
                )
            })?;
    } else if find_in_path("fusermount3").is_none() {
        return Err(format!(
            "FUSE is not available to this user: fusermount3 is not on PATH; {INSTALL}"
        ));
    }
    Ok(())
}

pub fn geteuid() -> u32 {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

pub fn find_in_path(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(bin))
            .find(|p| p.is_file())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountpoint_checks() {
        let d = tempfile::tempdir().unwrap();
        assert!(
            check_mountpoint(&d.path().join("nope"))
                .unwrap_err()
                .contains("does not exist")
        );
        let f = d.path().join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(
            check_mountpoint(&f)
                .unwrap_err()
                .contains("not a directory")
        );
        assert!(
            check_mountpoint(d.path())
                .unwrap_err()
                .contains("not empty")
        );
        let empty = d.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(
            check_mountpoint(&empty).unwrap(),
            empty.canonicalize().unwrap()
        );
        assert!(
            check_mountpoint(Path::new("/proc"))
                .unwrap_err()
                .contains("already a mount point")
        );
    }

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape("/x\\\\y"), "/x\\\\y");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
