//! Checks made before anything is mounted, so a bad invocation fails with a
//! clear message and leaves nothing behind.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::text::Escaped;

/// How long the liveness probe of an existing FUSE mount may take before
/// its daemon counts as hung.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn dead_mount(p: &Path) -> String {
    format!(
        "mountpoint {} is a dead FUSE mount (its daemon is gone: \"Transport endpoint is not \
         connected\"); clear it with: fusermount3 -uz {}",
        p.display(),
        p.display()
    )
}

/// Validate the mountpoint: it exists, is a directory, is empty and is not
/// already a mount. Returns its canonical path.
///
/// A FUSE mount whose daemon died (kill -9, OOM) can still look like a live
/// directory here: the kernel answers `stat` from attributes it cached for
/// the root. So a FUSE mount is probed with `statfs`, which FUSE never
/// caches, and one whose connection is gone gets the dead-mount hint.
/// The probe comes before anything stats the path: a `stat` the kernel
/// cannot answer from cache waits for the daemon, and a hung (stopped,
/// deadlocked) daemon would hang rknot-mount with it.
pub fn check_mountpoint(p: &Path) -> Result<PathBuf, String> {
    if let Some(guess) = mount_path_without_stat(p)
        && let Some(m) = mount_entry(&guess)?
        && m.is_fuse()
    {
        return Err(already_mounted(&guess, &m));
    }
    let meta = std::fs::metadata(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("mountpoint {} does not exist", p.display()),
        std::io::ErrorKind::NotConnected => dead_mount(p),
        _ => format!("mountpoint {}: {e}", p.display()),
    })?;
    if !meta.is_dir() {
        return Err(format!("mountpoint {} is not a directory", p.display()));
    }
    let canon = p.canonicalize().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotConnected => dead_mount(p),
        _ => format!("mountpoint {}: {e}", p.display()),
    })?;
    if let Some(m) = mount_entry(&canon)? {
        return Err(already_mounted(&canon, &m));
    }
    let mut entries = std::fs::read_dir(&canon)
        .map_err(|e| format!("mountpoint {}: cannot list: {e}", canon.display()))?;
    if entries.next().is_some() {
        return Err(format!("mountpoint {} is not empty", canon.display()));
    }
    Ok(canon)
}

/// Where `p` would appear in mountinfo, found without touching `p` itself:
/// its parent canonicalized, joined with its last component. None when the
/// last component is `.`/`..` or the parent cannot be resolved; a symlink as
/// the last component is missed too, and then the checks after `stat` apply.
fn mount_path_without_stat(p: &Path) -> Option<PathBuf> {
    let abs = std::path::absolute(p).ok()?;
    let name = abs.file_name()?;
    let parent = abs.parent()?.canonicalize().ok()?;
    Some(parent.join(name))
}

/// The refusal for a mountpoint that is already a mount; a FUSE mount is
/// probed first so a dead or hung one gets the way to clear it.
fn already_mounted(canon: &Path, m: &MountEntry) -> String {
    let what = format!("{} {}", Escaped(&m.fstype), Escaped(&m.source));
    if m.is_fuse() {
        match probe_fuse(canon, PROBE_TIMEOUT) {
            Probe::Dead => return dead_mount(canon),
            Probe::Hung => {
                return format!(
                    "{} is already a mount point ({what}) whose daemon does not answer \
                     (statfs took over {} s); if it is stuck, clear it with: \
                     fusermount3 -uz {}",
                    canon.display(),
                    PROBE_TIMEOUT.as_secs(),
                    canon.display()
                );
            }
            Probe::Alive => {}
        }
    }
    format!("{} is already a mount point ({what})", canon.display())
}

/// What the liveness probe of a FUSE mount found.
#[derive(Debug, PartialEq, Eq)]
enum Probe {
    Alive,
    /// The FUSE connection is gone (ENOTCONN / ECONNABORTED).
    Dead,
    /// No answer within the timeout: the daemon hangs.
    Hung,
}

/// `statfs` on a helper thread, so a hung daemon cannot hang rknot-mount
/// (the thread stays blocked until the process exits; the wait is
/// killable). Any answer other than a dead connection counts as alive:
/// a caller the mount does not admit (no allow_other) gets a fake answer
/// from the kernel without a request.
fn probe_fuse(dir: &Path, timeout: Duration) -> Probe {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return Probe::Alive;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("rknot-probe".into())
        .spawn(move || {
            // SAFETY: statfs writes into the zeroed struct we own; c is a
            // valid C string.
            let rc = unsafe {
                let mut st: libc::statfs = std::mem::zeroed();
                libc::statfs(c.as_ptr(), &mut st)
            };
            let errno = std::io::Error::last_os_error().raw_os_error();
            let _ = tx.send(if rc == 0 { None } else { errno });
        });
    if spawned.is_err() {
        return Probe::Alive;
    }
    match rx.recv_timeout(timeout) {
        Ok(Some(libc::ENOTCONN | libc::ECONNABORTED)) => Probe::Dead,
        Ok(_) => Probe::Alive,
        Err(_) => Probe::Hung,
    }
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

/// One line of /proc/self/mountinfo (the fields we use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// The superblock's device number (`MAJOR:MINOR`).
    pub major: u32,
    pub minor: u32,
    pub mount_point: String,
    pub fstype: String,
    pub source: String,
    /// Per-mount options (`rw,nosuid,...`).
    pub mount_options: String,
    /// Superblock options (`rw,user_id=0,...,allow_other`).
    pub super_options: String,
}

impl MountEntry {
    pub fn is_fuse(&self) -> bool {
        self.fstype == "fuse" || self.fstype == "fuseblk" || self.fstype.starts_with("fuse.")
    }

    /// The FUSE connection's name under /sys/fs/fuse/connections: the
    /// kernel's device number of the superblock.
    pub fn fuse_connection(&self) -> u64 {
        (u64::from(self.major) << 20) | u64::from(self.minor)
    }
}

/// Parse one mountinfo line: `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS
/// [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`.
pub fn parse_mountinfo_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let l: Vec<&str> = left.split(' ').collect();
    let r: Vec<&str> = right.split(' ').collect();
    let (major, minor) = l.get(2)?.split_once(':')?;
    Some(MountEntry {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        mount_point: unescape(l.get(4)?),
        mount_options: l.get(5)?.to_string(),
        fstype: unescape(r.first()?),
        source: unescape(r.get(1)?),
        super_options: r.get(2).map_or_else(String::new, |s| s.to_string()),
    })
}

/// The topmost mount at `canon`, if any.
pub fn mount_entry(canon: &Path) -> Result<Option<MountEntry>, String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let want = canon.to_string_lossy();
    Ok(text
        .lines()
        .rev()
        .filter_map(parse_mountinfo_line)
        .find(|m| m.mount_point == want))
}

/// Whether `canon` is the mount point of some mount.
pub fn is_mountpoint(canon: &Path) -> Result<bool, String> {
    Ok(mount_entry(canon)?.is_some())
}

/// FUSE must be usable: /dev/fuse present and openable by this user, and
/// for a mount without CAP_SYS_ADMIN the setuid helper fusermount3 (which
/// opens /dev/fuse with the caller's rights too).
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
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        return Err(match e.kind() {
            std::io::ErrorKind::PermissionDenied => device_denied(dev, &e),
            _ => format!(
                "FUSE is not available: cannot open {}: {e}; {INSTALL}",
                dev.display()
            ),
        });
    }
    if !can_mount_directly() && find_in_path("fusermount3").is_none() {
        return Err(format!(
            "FUSE is not available to this user: fusermount3 is not on PATH; {INSTALL}"
        ));
    }
    Ok(())
}

/// What to do when this user may not open the FUSE device: the kernel's
/// bare EACCES says nothing about it.
fn device_denied(dev: &Path, e: &std::io::Error) -> String {
    use std::os::unix::fs::MetadataExt;
    let uid = geteuid();
    let user = user_name(uid).unwrap_or_else(|| uid.to_string());
    let Ok(meta) = std::fs::metadata(dev) else {
        return format!("cannot open {}: {e}", dev.display());
    };
    let group = group_name(meta.gid()).unwrap_or_else(|| meta.gid().to_string());
    let owner = user_name(meta.uid()).unwrap_or_else(|| meta.uid().to_string());
    let group_may_open = meta.mode() & 0o060 == 0o060 && meta.gid() != 0;
    let group_fix = if group_may_open {
        format!(
            "ask an administrator to add {user} to the group {group}, which may open it \
             (usermod -aG {group} {user}; then log in again)"
        )
    } else {
        format!(
            "ask an administrator to let a group open it and add {user} to that group \
             (e.g. chgrp fuse {d}; chmod 0660 {d}; usermod -aG fuse {user}; then log in again)",
            d = dev.display()
        )
    };
    format!(
        "cannot open {d} (mode {mode:04o}, owner {owner}, group {group}) as user {user}: {e}. \
         Mounting without root needs read-write access to {d}. Either ask an administrator to \
         make it mode 0666, as the usual udev rule does (KERNEL==\"fuse\", MODE=\"0666\"; at \
         once: chmod 0666 {d}); or {group_fix}; or run rknot-mount as root",
        d = dev.display(),
        mode = meta.mode() & 0o7777,
    )
}

/// Whether this process may call mount(2) itself (CAP_SYS_ADMIN), which is
/// what fuser tries first; without it the mount goes through fusermount3.
pub fn can_mount_directly() -> bool {
    crate::fs::passthrough::cap_sys_admin().unwrap_or_else(|| geteuid() == 0)
}

/// The name of user `uid` (NSS), if it has one.
fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: getpwuid_r fills `pw` with pointers into `buf`, which outlives
    // every use of them below; all pointers are to memory we own.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out);
        if rc != 0 || out.is_null() || pw.pw_name.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(pw.pw_name)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// The name of group `gid` (NSS), if it has one.
fn group_name(gid: u32) -> Option<String> {
    let mut buf = vec![0u8; 16384];
    // SAFETY: as in user_name, with getgrgid_r.
    unsafe {
        let mut gr: libc::group = std::mem::zeroed();
        let mut out: *mut libc::group = std::ptr::null_mut();
        let rc = libc::getgrgid_r(gid, &mut gr, buf.as_mut_ptr().cast(), buf.len(), &mut out);
        if rc != 0 || out.is_null() || gr.gr_name.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(gr.gr_name)
                .to_string_lossy()
                .into_owned(),
        )
    }
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
    fn mountinfo_lines() {
        let l = "64 43 0:39 / /tmp/m\\040x rw,nosuid,nodev,noexec,noatime shared:1 - fuse \
                 /srv/m,allow_other.gguf rw,user_id=1002,group_id=1002,default_permissions";
        let m = parse_mountinfo_line(l).unwrap();
        assert_eq!((m.major, m.minor), (0, 39));
        assert_eq!(m.mount_point, "/tmp/m x");
        assert_eq!(m.fstype, "fuse");
        assert!(m.is_fuse());
        assert_eq!(m.source, "/srv/m,allow_other.gguf");
        assert_eq!(m.mount_options, "rw,nosuid,nodev,noexec,noatime");
        assert!(m.super_options.ends_with("default_permissions"));
        assert_eq!(m.fuse_connection(), 39);
        let l = "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw";
        let m = parse_mountinfo_line(l).unwrap();
        assert!(!m.is_fuse());
        assert_eq!(m.fuse_connection(), 254 << 20);
        for fstype in ["fuse.sshfs", "fuseblk"] {
            let l = format!("1 1 0:5 / /x rw - {fstype} s rw");
            assert!(parse_mountinfo_line(&l).unwrap().is_fuse());
        }
        assert!(parse_mountinfo_line("garbage").is_none());
    }

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape("/x\\\\y"), "/x\\\\y");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
