//! A real FUSE mount for tests: `rknot-mount --foreground` in a child
//! process on a temporary mountpoint, unmounted and cleaned up on drop even
//! when the test fails.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub fn mount_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_rknot-mount"))
}

/// Whether this machine can mount. With `RKNOT_REQUIRE_FUSE=1` (set by
/// .ci/run) a machine that cannot is a test failure, never a silent skip.
pub fn fuse_available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .is_ok();
    let helper =
        Path::new("/usr/bin/fusermount3").exists() || Path::new("/bin/fusermount3").exists();
    let ok = root && dev && helper;
    if !ok {
        let why = format!(
            "FUSE mount tests need root, /dev/fuse and fusermount3 (root {root}, /dev/fuse {dev}, fusermount3 {helper})"
        );
        if std::env::var_os("RKNOT_REQUIRE_FUSE").is_some_and(|v| v != "0") {
            panic!("{why}; RKNOT_REQUIRE_FUSE is set, so this is a failure");
        }
        eprintln!("NOTE: skipping: {why}");
    }
    ok
}

pub fn is_mounted(mp: &Path) -> bool {
    let want = mp.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| m == want)
}

pub struct Mounted {
    pub dir: tempfile::TempDir,
    pub mp: PathBuf,
    child: Option<Child>,
    pub stderr: PathBuf,
}

impl Mounted {
    /// Mount `source` (plus `args`) in the foreground and wait until it
    /// answers. Panics with the daemon's stderr if it does not come up.
    pub fn new(source: &Path, args: &[&str]) -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let mp = dir.path().join("mnt");
        std::fs::create_dir(&mp).unwrap();
        let mp = mp.canonicalize().unwrap();
        let stderr = dir.path().join("daemon.log");
        let child = Command::new(mount_bin())
            .arg(source)
            .arg(&mp)
            .arg("--foreground")
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let mut m = Mounted {
            dir,
            mp,
            child: Some(child),
            stderr,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if is_mounted(&m.mp) && m.mp.join("index.json").exists() {
                return m;
            }
            if let Some(st) = m.try_wait() {
                panic!("rknot-mount exited with {st} before mounting:\n{}", m.log());
            }
            if Instant::now() > deadline {
                panic!("mount did not come up in 30 s:\n{}", m.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.mp.join(name)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Wait for the daemon to exit (up to `secs`).
    pub fn wait_exit(&mut self, secs: u64) -> Option<ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if let Some(st) = self.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(self.pid() as i32, sig) };
    }

    pub fn ctl(&self) -> String {
        std::fs::read_to_string(self.path("ctl")).unwrap()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.try_wait().is_none() {
            self.signal(libc::SIGTERM);
            if self.wait_exit(10).is_none()
                && let Some(c) = self.child.as_mut()
            {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if is_mounted(&self.mp) {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(&self.mp)
                .status();
        }
    }
}
