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
/// tools/test.sh and .ci/run) a machine that cannot is a test failure, never
/// a silent skip. Without it, tests that need FUSE are ignored at build time
/// (`rknot_no_fuse`, build.rs); this run-time check covers a binary run
/// elsewhere than it was built, or with `--ignored`.
pub fn fuse_available() -> bool {
    let lacks = super::capability::mount_lacks();
    if !lacks.is_empty() {
        let why = format!(
            "FUSE mount tests need root, /dev/fuse and fusermount3 (missing: {})",
            lacks.join(", ")
        );
        if super::env_flag("RKNOT_REQUIRE_FUSE") {
            panic!("{why}; RKNOT_REQUIRE_FUSE is set, so this is a failure");
        }
        eprintln!("NOTE: skipping: {why}");
    }
    lacks.is_empty()
}

/// A fresh temporary directory and an empty mountpoint `mnt` in it
/// (canonical, as /proc/self/mountinfo shows it).
pub fn mountpoint() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let mp = mp.canonicalize().unwrap();
    (dir, mp)
}

/// `rknot-mount demo/tiny-llama.rknot MP --dense demo/tiny-llama.gguf
/// --log-file LOG` in the background (the default mode: it returns once
/// the mount answers); its output, asserted successful.
pub fn mount_demo_background(mp: &Path, log: &Path) -> std::process::Output {
    let out = Command::new(mount_bin())
        .arg(super::demo_path("tiny-llama.rknot"))
        .arg(mp)
        .arg("--dense")
        .arg(super::demo_path("tiny-llama.gguf"))
        .arg("--log-file")
        .arg(log)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
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
        Mounted::with_env::<&str>(source, args, &[])
    }

    /// [`Mounted::new`] with extra environment variables for the daemon
    /// (e.g. RKNOT_REMOTE_RETRIES, or the endpoint and credentials of a
    /// test S3 server).
    pub fn with_env<V: AsRef<std::ffi::OsStr>>(
        source: &Path,
        args: &[&str],
        env: &[(&str, V)],
    ) -> Mounted {
        let (dir, mp) = mountpoint();
        let stderr = dir.path().join("daemon.log");
        let child = Command::new(mount_bin())
            .arg(source)
            .arg(&mp)
            .arg("--foreground")
            .args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)))
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

    /// Send `sig` to the daemon; a no-op without a child (`pid()` is 0
    /// then, and kill(0, sig) would signal the whole process group).
    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill on our own child's pid.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    pub fn ctl(&self) -> String {
        std::fs::read_to_string(self.path("ctl")).unwrap()
    }

    /// Write one command line to `ctl`; Err(errno) when it is refused.
    pub fn command(&self, line: &str) -> Result<(), i32> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.path("ctl"))
            .unwrap();
        f.write_all(format!("{line}\n").as_bytes())
            .map_err(|e| e.raw_os_error().unwrap_or(0))
    }

    /// `ctl.json`, parsed (each call opens it: a fresh snapshot).
    pub fn ctl_json(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.path("ctl.json")).unwrap()).unwrap()
    }

    /// Why the last refused `ctl` command was refused ("" when none was).
    pub fn last_error(&self) -> String {
        self.ctl_json()["last_error"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Job `id` as `ctl.json` lists it; panics (showing `ctl`) when it is
    /// not listed.
    pub fn job(&self, id: u64) -> serde_json::Value {
        self.ctl_json()["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no job {id}: {}", self.ctl()))
    }

    /// Wait (up to `secs`) until job `id` is in one of `states`; returns it.
    pub fn wait_job(&self, id: u64, states: &[&str], secs: u64) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let j = self.job(id);
            if states.iter().any(|s| j["state"] == *s) {
                return j;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} stuck: {j}\n{}",
                self.ctl()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The daemon's peak RSS so far, in KiB (VmHWM of /proc/PID/status).
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no VmHWM in /proc/{}/status", self.pid()))
    }
}

/// `fusermount3 -u -z`: detach what a test left mounted at `mp` (clean-up;
/// errors are ignored).
fn unmount_lazily(mp: &Path) {
    let _ = Command::new("fusermount3")
        .arg("-u")
        .arg("-z")
        .arg(mp)
        .status();
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
            unmount_lazily(&self.mp);
        }
    }
}

/// The daemon's pid from what background mode prints on stdout
/// ("serving ... (pid N; log ...)" or "(pid N)").
pub fn background_pid(stdout: &str) -> Option<i32> {
    let rest = stdout.split("(pid ").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Whether process `pid` exists and is not a zombie.
pub fn pid_alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state is the first field after the parenthesised command name.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("");
    !matches!(state, "Z" | "X" | "x")
}

/// Clean-up for a mount a test makes without [`Mounted`] (background mode,
/// a daemon spawned by hand): on drop, also when an assertion failed, it
/// stops the daemon `pid` if it is still alive (SIGTERM, then SIGKILL after
/// 10 s) and lazily unmounts `mp` if it is still mounted. Declare it after
/// the temporary directory holding `mp`, so it runs first.
pub struct MountGuard {
    pub mp: PathBuf,
    pub pid: Option<i32>,
}

impl MountGuard {
    pub fn new(mp: &Path, pid: Option<i32>) -> MountGuard {
        // mountinfo lists canonical paths; canonicalize while `mp` is still
        // a plain directory (a dead FUSE mount cannot be resolved).
        let mp = mp.canonicalize().unwrap_or_else(|_| mp.to_path_buf());
        MountGuard { mp, pid }
    }

    /// The daemon's pid, once known (e.g. from background mode's output).
    pub fn set_pid(&mut self, pid: Option<i32>) {
        self.pid = pid;
    }

    /// The daemon has exited and was reaped: drop must not signal its pid,
    /// which may be reused.
    pub fn exited(&mut self) {
        self.pid = None;
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.pid.filter(|&p| p > 0)
            && pid_alive(pid)
        {
            // SAFETY: signalling the daemon this test started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while pid_alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if pid_alive(pid) {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        if is_mounted(&self.mp) {
            unmount_lazily(&self.mp);
        }
    }
}
