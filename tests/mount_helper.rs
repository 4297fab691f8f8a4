//! mount(8) integration: `mount -t fuse.rknot`, fstab lines and `umount`
//! through the helper `/sbin/mount.fuse.rknot` (a symlink to rknot-mount;
//! docs/OPERATIONS.md "mount(8) and /etc/fstab"). mount(8) looks for
//! helpers only in /sbin (and /sbin/fs.d, /sbin/fs), so the test installs
//! the symlink there for its duration and removes it on drop, also when an
//! assertion fails; a helper already installed there is moved aside and put
//! back. Needs root, FUSE and util-linux mount (FUSE-gated like
//! tests/mount.rs).

mod common;

use common::needs;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::demo_path as demo;
use common::mount::{
    MountGuard, background_pid, fuse_available, is_mounted, mount_bin, mountpoint, pid_alive,
};

const HELPER: &str = "/sbin/mount.fuse.rknot";

/// One test at a time owns /sbin/mount.fuse.rknot.
static SBIN: Mutex<()> = Mutex::new(());

/// The helper symlink in /sbin while it lives.
struct InstalledHelper {
    backup: Option<PathBuf>,
    _lock: std::sync::MutexGuard<'static, ()>,
}

impl InstalledHelper {
    fn install() -> InstalledHelper {
        let lock = SBIN.lock().unwrap_or_else(|p| p.into_inner());
        let path = Path::new(HELPER);
        let backup = if path.symlink_metadata().is_ok() {
            let b = PathBuf::from(format!(
                "/sbin/.mount.fuse.rknot.test-{}",
                std::process::id()
            ));
            std::fs::rename(path, &b).unwrap();
            Some(b)
        } else {
            None
        };
        let me = InstalledHelper {
            backup,
            _lock: lock,
        };
        std::os::unix::fs::symlink(mount_bin(), path).unwrap();
        me
    }
}

impl Drop for InstalledHelper {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(HELPER);
        if let Some(b) = &self.backup {
            let _ = std::fs::rename(b, HELPER);
        }
    }
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    eprintln!(
        "{cmd:?}: {}\nstdout: {}stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The capacity line of `ctl`, e.g. 8 MiB for `cache_mb=8`.
fn cache_capacity(mp: &Path) -> Option<u64> {
    let ctl = std::fs::read_to_string(mp.join("ctl")).ok()?;
    let line = ctl.lines().find(|l| l.contains("capacity"))?;
    let n: String = line
        .split("capacity ")
        .nth(1)?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    n.parse().ok()
}

/// `umount MP` ends the daemon: unmounted, and the process gone.
fn umount_and_wait(mp: &Path, guard: &mut MountGuard) {
    let out = run(Command::new("umount").arg(mp));
    assert!(out.status.success(), "umount failed");
    assert!(!is_mounted(mp));
    if let Some(pid) = guard.pid {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pid_alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!pid_alive(pid), "daemon {pid} still running after umount");
        guard.exited();
    }
    // A normal umount logs no WARN/ERROR (tests/quiet_logs.rs).
    let log = std::fs::read_to_string(rknot::mount::default_log_file(mp)).unwrap_or_default();
    assert!(!log.contains(" WARN ") && !log.contains(" ERROR "), "{log}");
}

fn mount_available() -> bool {
    if !fuse_available() {
        return false;
    }
    let ok = Command::new("mount")
        .arg("--version")
        .output()
        .is_ok_and(|o| text(&o.stdout).contains("util-linux"));
    if !ok {
        if common::env_flag("RKNOT_REQUIRE_FUSE") {
            panic!("util-linux mount(8) is needed (RKNOT_REQUIRE_FUSE is set)");
        }
        eprintln!("NOTE: skipping: util-linux mount(8) not found");
    }
    ok
}

needs! { [fuse]
fn mount_t_fuse_rknot_passes_options_and_umount_ends_the_daemon() {
    if !mount_available() {
        return;
    }
    let _helper = InstalledHelper::install();
    let (dir, mp) = mountpoint();
    let mut guard = MountGuard::new(&mp, None);
    let (src, gguf) = (demo("tiny-llama.rknot"), demo("tiny-llama.gguf"));

    // -v: the helper prints rknot-mount's "serving ... (pid N; log F)".
    let out = run(Command::new("mount")
        .arg("-v")
        .args(["-t", "fuse.rknot"])
        .arg(&src)
        .arg(&mp)
        .arg("-o")
        .arg(format!("dense={},cache_mb=8", gguf.display())));
    guard.set_pid(background_pid(&text(&out.stdout)));
    assert!(out.status.success());
    assert!(guard.pid.is_some(), "no pid in the -v output");
    assert!(is_mounted(&mp));
    // cache_mb= and dense= reached the daemon: the cache is 8 MiB and a
    // tensor only the GGUF has is served from it, as `rknot cat` serves it.
    assert_eq!(cache_capacity(&mp), Some(8 << 20));
    let name = "blk.0.attn_output.weight";
    let via_mount = std::fs::read(mp.join(format!("{name}.f32"))).unwrap();
    let cat = run(Command::new(env!("CARGO_BIN_EXE_rknot"))
        .arg("cat")
        .arg(&src)
        .arg(name)
        .arg("--dense")
        .arg(&gguf));
    assert!(cat.status.success());
    assert_eq!(via_mount, cat.stdout);
    let ctl = std::fs::read_to_string(mp.join("ctl")).unwrap();
    assert!(ctl.contains("fallback:"), "{ctl}");
    umount_and_wait(&mp, &mut guard);

    // Without -v the helper is silent; no options at all still mounts
    // (mount(8) passes `-o rw`, which the helper accepts). An .rknot
    // without its fallback serves what it holds.
    let out = run(Command::new("mount")
        .args(["-t", "fuse.rknot"])
        .arg(demo("tiny-llama.gguf"))
        .arg(&mp));
    assert!(out.status.success());
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    assert!(is_mounted(&mp));
    guard.set_pid(daemon_pid_from_log(&mp));
    umount_and_wait(&mp, &mut guard);

    // An unknown option fails the mount (exit 2, nothing mounted); with
    // -s (sloppy) it is ignored.
    let bad = || {
        let mut c = Command::new("mount");
        c.args(["-t", "fuse.rknot"])
            .arg(&gguf)
            .arg(&mp)
            .args(["-o", "frobnicate,cache_mb=4"]);
        c
    };
    let out = run(&mut bad());
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("unknown mount option \"frobnicate\""),
        "{}",
        text(&out.stderr)
    );
    assert!(!is_mounted(&mp));
    let out = run(bad().arg("-s"));
    assert!(out.status.success());
    assert!(text(&out.stderr).contains("ignoring unknown mount option"));
    guard.set_pid(daemon_pid_from_log(&mp));
    assert_eq!(cache_capacity(&mp), Some(4 << 20));
    umount_and_wait(&mp, &mut guard);

    // A missing source: exit 1, nothing mounted.
    let out = run(Command::new("mount")
        .args(["-t", "fuse.rknot"])
        .arg(dir.path().join("missing.rknot"))
        .arg(&mp));
    assert_eq!(out.status.code(), Some(1));
    assert!(!is_mounted(&mp));
    let _ = std::fs::remove_file(rknot::mount::default_log_file(&mp));
}
}

/// The daemon's pid from its log's last "serving ... (pid N; ...)" line
/// (the helper prints it only with -v), for clean-up.
fn daemon_pid_from_log(mp: &Path) -> Option<i32> {
    let log = std::fs::read_to_string(rknot::mount::default_log_file(mp)).ok()?;
    log.lines()
        .rev()
        .find(|l| l.contains("] serving "))
        .and_then(background_pid)
}

needs! { [fuse]
fn fstab_line_mounts_with_its_options() {
    if !mount_available() {
        return;
    }
    let _helper = InstalledHelper::install();
    let (dir, mp) = mountpoint();
    let mut guard = MountGuard::new(&mp, None);
    let (src, gguf) = (demo("tiny-llama.rknot"), demo("tiny-llama.gguf"));
    // The documented line (docs/OPERATIONS.md), with this test's paths.
    let fstab = dir.path().join("fstab");
    std::fs::write(
        &fstab,
        format!(
            "# a comment\n{} {} fuse.rknot dense={},cache_mb=16,allow_other,nofail,x-systemd.requires-mounts-for={} 0 0\n",
            src.display(),
            mp.display(),
            gguf.display(),
            dir.path().display()
        ),
    )
    .unwrap();

    // -f (fake): mount(8) passes it on; every check runs, nothing mounts.
    let out = run(Command::new("mount")
        .arg("-f")
        .arg("-T")
        .arg(&fstab)
        .arg(&mp));
    assert!(out.status.success());
    assert!(!is_mounted(&mp));

    let out = run(Command::new("mount")
        .arg("-v")
        .arg("-T")
        .arg(&fstab)
        .arg(&mp));
    guard.set_pid(background_pid(&text(&out.stdout)));
    assert!(out.status.success());
    assert!(is_mounted(&mp));
    assert_eq!(cache_capacity(&mp), Some(16 << 20));
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let line = mounts
        .lines()
        .find(|l| l.split(' ').nth(1) == Some(mp.to_str().unwrap()))
        .unwrap();
    assert!(line.contains("allow_other"), "{line}");
    assert!(
        line.starts_with(&format!("{} ", src.display())),
        "the source column is the model file: {line}"
    );
    // The daemon's log: what it mounted, no WARN/ERROR on the way up.
    let log = std::fs::read_to_string(rknot::mount::default_log_file(&mp)).unwrap_or_default();
    assert!(log.contains("mounted "), "{log}");
    // Mounting again at the same place fails (rknot-mount refuses a
    // mountpoint that is already mounted), and leaves the mount alone.
    let out = run(Command::new("mount").arg("-T").arg(&fstab).arg(&mp));
    assert!(!out.status.success());
    assert!(is_mounted(&mp));
    umount_and_wait(&mp, &mut guard);
    let _ = std::fs::remove_file(rknot::mount::default_log_file(&mp));
}
}
