//! A real second user for tests about who may do what, and a private mount
//! namespace in which `/dev/fuse` has a chosen mode (for non-root mounts;
//! the host's `/dev/fuse` may be root-only, as on the CI machines).
//!
//! These need root, `useradd`, `runuser` and `unshare`. Without them a test
//! prints a note and returns, or fails under RKNOT_REQUIRE_FUSE (CI must
//! not skip them silently).
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The test user's name (created once per machine, no home, no shell).
pub const TEST_USER: &str = "rknot-test";

#[derive(Debug, Clone)]
pub struct TestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

fn skip(why: &str) -> Option<TestUser> {
    if super::env_flag("RKNOT_REQUIRE_FUSE") {
        panic!("{why}; RKNOT_REQUIRE_FUSE is set, so this is a failure");
    }
    eprintln!("NOTE: skipping: {why}");
    None
}

fn id_of(flag: &str) -> Option<u32> {
    let o = Command::new("id").args([flag, TEST_USER]).output().ok()?;
    if !o.status.success() {
        return None;
    }
    String::from_utf8_lossy(&o.stdout).trim().parse().ok()
}

/// `tool` on PATH (or in the sbin directories root's PATH usually has).
pub fn find_tool(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The unprivileged test user, created if missing. `None` (after a note)
/// when this machine cannot have one.
pub fn test_user() -> Option<TestUser> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("tests with a second user need root (to create it and run as it)");
    }
    for tool in ["useradd", "runuser"] {
        if find_tool(tool).is_none() {
            return skip(&format!("tests with a second user need {tool}"));
        }
    }
    if id_of("-u").is_none() {
        // Two tests may race to create it: a failure here is fine if the
        // user exists afterwards.
        let _ = Command::new("useradd")
            .args([
                "-M",
                "-s",
                "/usr/sbin/nologin",
                "-c",
                "rknot tests",
                TEST_USER,
            ])
            .output();
    }
    match (id_of("-u"), id_of("-g")) {
        (Some(uid), Some(gid)) => Some(TestUser {
            name: TEST_USER.to_string(),
            uid,
            gid,
        }),
        _ => skip(&format!("could not create the user {TEST_USER}")),
    }
}

/// The test user, when [`in_fuse_namespace`] can run too (it needs
/// `unshare`); `None` after a note, as [`test_user`].
pub fn namespace_test_user() -> Option<TestUser> {
    let user = test_user()?;
    if find_tool("unshare").is_none() {
        return skip("tests in a mount namespace need unshare");
    }
    Some(user)
}

impl TestUser {
    /// Run `sh -c script` as this user (no login environment; HOME=/tmp).
    pub fn sh(&self, script: &str) -> Output {
        Command::new("runuser")
            .args([
                "-u",
                &self.name,
                "--",
                "env",
                "HOME=/tmp",
                "sh",
                "-c",
                script,
            ])
            .output()
            .expect("runuser")
    }
}

/// Run `sh -c script` as root in a private mount namespace where
/// `/dev/fuse` is a fresh device node (10, 229) with mode `dev_mode`, made
/// in `scratch` (a directory on a filesystem that allows device nodes).
/// Mounts made inside exist only there and vanish with it.
pub fn in_fuse_namespace(scratch: &Path, dev_mode: u32, script: &str) -> Output {
    let node = scratch.join("fuse-node");
    let _ = std::fs::remove_file(&node);
    let c = std::ffi::CString::new(node.to_str().expect("utf-8 path")).expect("path");
    // SAFETY: mknod with a valid C string; the device numbers of /dev/fuse.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(10, 229)) };
    assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
    // chmod after mknod: the umask applies to mknod's mode.
    std::fs::set_permissions(&node, std::fs::Permissions::from_mode(dev_mode))
        .expect("chmod device node");
    let full = format!(
        "mount --bind '{}' /dev/fuse || exit 97\n{script}",
        node.display()
    );
    Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &full])
        .output()
        .expect("unshare")
}
