//! The rknot-mount process around the filesystem, with real mounts: how it
//! stops (signals, grace period, jobs), what it says about a dead mount or
//! an unusable /dev/fuse, the mount options a source name can (not) change,
//! and where a background daemon logs. Non-root cases run as a real second
//! user (tests/common/users.rs).

mod common;

use std::io::Read;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::mount::{Mounted, background_pid, fuse_available, is_mounted, mount_bin, pid_alive};
use common::users::{TestUser, in_fuse_namespace, namespace_test_user};
use common::*;
use rknot::mount::checks::{MountEntry, parse_mountinfo_line};

/// A scratch directory the test user can traverse, with `dirs` inside it
/// owned by the user (mountpoints and log directories: fusermount3 wants
/// write access to the mountpoint).
fn scratch_for(user: &TestUser, dirs: &[&str]) -> tempfile::TempDir {
    let scratch = tempfile::tempdir().unwrap();
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for d in dirs {
        let p = scratch.path().join(d);
        std::fs::create_dir_all(&p).unwrap();
        std::os::unix::fs::chown(&p, Some(user.uid), Some(user.gid)).unwrap();
    }
    scratch
}

/// A world-readable copy of the demo GGUF named `name` in `dir`.
fn demo_copy(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::copy(demo_path("tiny-llama.gguf"), &p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    p
}

/// Single-quote `s` for sh.
fn sq(s: impl AsRef<std::ffi::OsStr>) -> String {
    format!("'{}'", s.as_ref().to_string_lossy().replace('\'', r"'\''"))
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Background daemons a namespace script started: on drop (also when an
/// assertion failed) each one still alive is killed, and its mounts vanish
/// with the namespace.
struct Daemons(Vec<i32>);

impl Daemons {
    fn from_output(o: &Output) -> Daemons {
        Daemons(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(background_pid)
                .collect(),
        )
    }

    /// Wait (up to 20 s) for every daemon to exit; the ones left.
    fn wait_all(&self) -> Vec<i32> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.0.iter().any(|&p| pid_alive(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.0.iter().copied().filter(|&p| pid_alive(p)).collect()
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        for &p in &self.0 {
            if p > 0 && pid_alive(p) {
                // SAFETY: a daemon this test started.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
    }
}

/// The topmost mount at `mp` in a mountinfo text.
fn mount_at(mountinfo: &str, mp: &Path) -> Option<MountEntry> {
    mountinfo
        .lines()
        .rev()
        .filter_map(parse_mountinfo_line)
        .find(|m| Path::new(&m.mount_point) == mp)
}

needs! { [fuse]
/// Item 8: a source named `m,allow_other.gguf` or `a,ro.gguf`, or an
/// `-o fsname=` with a backslash, must not add, drop or break mount options
/// on the fusermount3 path (a non-root user), and the mount's source is
/// the name unchanged.
fn source_names_cannot_change_fusermount_options() {
    if !fuse_available() {
        return;
    }
    let Some(user) = namespace_test_user() else {
        return;
    };
    let scratch = scratch_for(&user, &["mnt1", "mnt2", "mnt3", "logs"]);
    let d = scratch.path();
    let m1 = demo_copy(d, "m,allow_other.gguf");
    let m2 = demo_copy(d, "a,ro.gguf");
    let (mp1, mp2, mp3) = (d.join("mnt1"), d.join("mnt2"), d.join("mnt3"));
    let tensor = "output.weight.f32";
    let script = format!(
        "as_user() {{ runuser -u {u} -- env HOME=/tmp \"$@\"; }}\n\
         as_user {bin} {m1} {mp1} --log-file {logs}/1.log || exit 11\n\
         as_user {bin} {m2} {mp2} --log-file {logs}/2.log || exit 12\n\
         as_user {bin} {m2} {mp3} --log-file {logs}/3.log -o 'fsname=back\\slash\\' || exit 13\n\
         cat /proc/self/mountinfo > {d}/mountinfo\n\
         for m in {mp1} {mp2} {mp3}; do as_user sha256sum \"$m/{tensor}\" || exit 14; done\n\
         for m in {mp1} {mp2} {mp3}; do as_user fusermount3 -u \"$m\" || exit 15; done\n",
        u = user.name,
        bin = sq(mount_bin()),
        m1 = sq(&m1),
        m2 = sq(&m2),
        mp1 = sq(&mp1),
        mp2 = sq(&mp2),
        mp3 = sq(&mp3),
        logs = sq(d.join("logs")),
        d = sq(d),
    );
    let o = in_fuse_namespace(d, 0o666, &script);
    let daemons = Daemons::from_output(&o);
    let logs = ["1", "2", "3"]
        .map(|n| std::fs::read_to_string(d.join(format!("logs/{n}.log"))).unwrap_or_default())
        .join("\n");
    assert!(o.status.success(), "{}\nlogs:\n{logs}", text(&o));
    let mountinfo = std::fs::read_to_string(d.join("mountinfo")).unwrap();
    for (mp, source) in [
        (&mp1, m1.to_str().unwrap()),
        (&mp2, m2.to_str().unwrap()),
        (&mp3, "back\\slash\\"),
    ] {
        let m = mount_at(&mountinfo, mp).unwrap_or_else(|| panic!("{mp:?} in {mountinfo}"));
        assert_eq!(m.source, source, "{m:?}");
        assert!(m.mount_options.starts_with("rw,"), "no ro: {m:?}");
        let sb: Vec<&str> = m.super_options.split(',').collect();
        assert!(!sb.contains(&"allow_other"), "no allow_other: {m:?}");
        assert!(sb.contains(&"default_permissions"), "{m:?}");
    }
    // Every mount serves the tensor.
    let b = rknot::backend::open(&m1, None).unwrap();
    let want = sha256_hex(&decode_bytes(b.as_ref(), "output.weight"));
    let sums = String::from_utf8_lossy(&o.stdout);
    assert_eq!(sums.matches(&want).count(), 3, "{sums}");
    assert!(daemons.wait_all().is_empty(), "daemons left after unmount");
}
}

needs! { [fuse]
/// Item 8, root: mount(2) gets the source name verbatim (no escaping shows
/// up in /proc/mounts) and it adds no option either.
fn root_mount_source_name_is_verbatim() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = demo_copy(dir.path(), "m,allow_other.gguf");
    let m = Mounted::new(&src, &[]);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let e = mount_at(&mountinfo, &m.mp).unwrap();
    assert_eq!(e.source, src.to_str().unwrap());
    assert!(
        !e.super_options.split(',').any(|o| o == "allow_other"),
        "{e:?}"
    );
}
}

/// The message for a /dev/fuse this user may not open names the device,
/// its mode and owner, and the fixes.
fn assert_device_advice(o: &Output, mode: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}", text(o));
    for want in [
        &format!("cannot open /dev/fuse (mode {mode}, owner root"),
        "as user rknot-test",
        "mode 0666",
        "usermod -aG",
        "run rknot-mount as root",
    ] {
        assert!(err.contains(want), "want {want:?} in: {err}");
    }
}

needs! { [fuse]
/// Item 22: a non-root user and a root-only /dev/fuse get advice, not a
/// bare "Permission denied"; nothing is mounted.
fn root_only_dev_fuse_is_explained() {
    if !fuse_available() {
        return;
    }
    let Some(user) = namespace_test_user() else {
        return;
    };
    let scratch = scratch_for(&user, &["mnt"]);
    let d = scratch.path();
    let src = demo_copy(d, "model.gguf");
    let mp = d.join("mnt");
    let cmd = format!(
        "runuser -u {} -- env HOME=/tmp {} {} {} --foreground",
        user.name,
        sq(mount_bin()),
        sq(&src),
        sq(&mp)
    );
    let o = in_fuse_namespace(d, 0o600, &cmd);
    assert_device_advice(&o, "0600");
    // The host's own /dev/fuse, when it is root-only (as on this project's
    // machines); elsewhere it is usually 0666 and the user may mount.
    let host_mode = std::fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777;
    if host_mode & 0o006 == 0o006 {
        eprintln!("NOTE: /dev/fuse is {host_mode:04o} here: no root-only device to test");
    } else {
        let o = user.sh(&format!(
            "{} {} {} --foreground",
            sq(mount_bin()),
            sq(&src),
            sq(&mp)
        ));
        assert_device_advice(&o, &format!("{host_mode:04o}"));
    }
    assert!(!is_mounted(&mp));
    assert_eq!(std::fs::read_dir(&mp).unwrap().count(), 0);
}
}

needs! { [fuse]
/// Item 20: after kill -9 the mount is dead even when the kernel still
/// answers `stat` of its root from cache; mounting again says so, with the
/// way to clear it, instead of "already a mount point".
fn dead_mount_after_kill9_gets_the_hint() {
    if !fuse_available() {
        return;
    }
    let src = demo_path("tiny-llama.gguf");
    let mut m = Mounted::new(&src, &[]);
    // Cache the root's attributes (the mount answers them for an hour).
    std::fs::metadata(&m.mp).unwrap();
    m.signal(libc::SIGKILL);
    m.wait_exit(10).expect("daemon killed");
    assert!(is_mounted(&m.mp), "a killed daemon leaves its mount");
    std::fs::metadata(&m.mp).expect("stat answered from the cache");
    let o = Command::new(mount_bin())
        .arg(&src)
        .arg(&m.mp)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        err.contains("dead FUSE mount")
            && err.contains(&format!("fusermount3 -uz {}", m.mp.display())),
        "{err}"
    );
    assert!(!err.contains("already a mount point"), "{err}");
    // The hint works.
    assert!(
        Command::new("fusermount3")
            .arg("-uz")
            .arg(&m.mp)
            .status()
            .unwrap()
            .success()
    );
    assert!(!is_mounted(&m.mp));
}
}

needs! { [fuse]
/// Item 20, a hung daemon: mounting again over a mount whose daemon does
/// not answer (stopped here with SIGSTOP) is refused within the probe's
/// 5 s with the way to clear it, and nothing stats the mountpoint before
/// that probe. A `stat` the kernel cannot answer from its attribute cache
/// (ours lasts an hour, so a daemon hung for longer) waits for the daemon;
/// it came first, and rknot-mount hung with the mount. strace shows the
/// order, since the cache cannot be expired from here.
fn hung_daemon_is_probed_before_its_mountpoint_is_stat() {
    if !fuse_available() {
        return;
    }
    let Some(strace) = ["/usr/bin/strace", "/bin/strace"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
    else {
        let why = "this test needs strace (tools/test.sh installs it)";
        assert!(!env_flag("RKNOT_REQUIRE_FUSE"), "{why}");
        eprintln!("NOTE: skipping: {why}");
        return;
    };
    let src = demo_path("tiny-llama.gguf");
    let m = Mounted::new(&src, &[]);
    m.signal(libc::SIGSTOP);
    let trace = m.dir.path().join("strace.txt");
    let started = Instant::now();
    let mut child = Command::new(strace)
        .args([
            "-f",
            "-qq",
            "-e",
            "trace=%stat,%statfs,statx,readlink",
            "-o",
        ])
        .arg(&trace)
        .arg(mount_bin())
        .arg(&src)
        .arg(&m.mp)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = started + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let hung = child.try_wait().unwrap().is_none();
    if hung {
        let _ = child.kill();
    }
    let o = child.wait_with_output().unwrap();
    let took = started.elapsed();
    m.signal(libc::SIGCONT);
    assert!(!hung, "rknot-mount hung on a stopped daemon's mount");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        err.contains("does not answer")
            && err.contains(&format!("fusermount3 -uz {}", m.mp.display())),
        "{err}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    // The calls naming the mountpoint, in order: statfs (the probe) first.
    let calls = std::fs::read_to_string(&trace).unwrap();
    let quoted = format!("\"{}\"", m.mp.display());
    let on_mp: Vec<&str> = calls.lines().filter(|l| l.contains(&quoted)).collect();
    assert!(
        on_mp.first().is_some_and(|l| l.contains("statfs(")),
        "the mountpoint was stat-ed before the liveness probe:\n{}",
        on_mp.join("\n")
    );
}
}

needs! { [fuse]
/// Item 21: without --log-file, a background daemon logs to a bounded file
/// name even when the mountpoint's path is longer than NAME_MAX, and says
/// where.
fn background_default_log_name_is_bounded() {
    if !fuse_available() {
        return;
    }
    let Some(user) = namespace_test_user() else {
        return;
    };
    // A mountpoint 5 levels of 60 characters below the scratch directory:
    // its flattened path alone is over 300 bytes.
    let deep: PathBuf = (0..5).map(|i| format!("{i}{}", "x".repeat(59))).collect();
    let deep_str = deep.to_str().unwrap();
    let scratch = scratch_for(&user, &[deep_str, "state"]);
    let d = scratch.path();
    let mut p = d.to_path_buf();
    for c in deep.components() {
        p.push(c);
        std::os::unix::fs::chown(&p, Some(user.uid), Some(user.gid)).unwrap();
    }
    let mp = d.join(&deep).canonicalize().unwrap();
    assert!(mp.as_os_str().len() > 300);
    let src = demo_copy(d, "model.gguf");
    let state = d.join("state");
    let script = format!(
        "runuser -u {u} -- env HOME=/tmp XDG_STATE_HOME={state} {bin} {src} {mp} || exit 11\n\
         runuser -u {u} -- ls {mp} > {d}/listing || exit 12\n\
         runuser -u {u} -- fusermount3 -u {mp} || exit 13\n",
        u = user.name,
        state = sq(&state),
        bin = sq(mount_bin()),
        src = sq(&src),
        mp = sq(&mp),
        d = sq(d),
    );
    let o = in_fuse_namespace(d, 0o666, &script);
    let daemons = Daemons::from_output(&o);
    assert!(o.status.success(), "{}", text(&o));
    let logs: Vec<PathBuf> = std::fs::read_dir(state.join("rknot"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(logs.len(), 1, "{logs:?}");
    let log = &logs[0];
    let name = log.file_name().unwrap().len();
    assert!(name <= 100, "log file name of {name} bytes: {log:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&format!("log {})", log.display())), "{out}");
    let listing = std::fs::read_to_string(d.join("listing")).unwrap();
    assert!(listing.contains("index.json"), "{listing}");
    assert!(daemons.wait_all().is_empty(), "daemon left after unmount");
    let logged = std::fs::read_to_string(log).unwrap();
    assert!(
        logged.contains("serving") && logged.contains("unmounted"),
        "{logged}"
    );
}
}

/// Wait until the daemon's log contains `what` (up to 30 s).
fn wait_log(m: &Mounted, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !m.log().contains(what) {
        assert!(Instant::now() < deadline, "no {what:?} in:\n{}", m.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A read of `f` that must reach the daemon: the kernel would answer from
/// pages it cached (FOPEN_KEEP_CACHE) even after the connection is gone.
fn uncached_read(f: &std::fs::File) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: fadvise on a descriptor we own; it only drops clean pages.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    f.read_at(&mut [0u8; 4096], 0)
}

needs! { [model, fuse]
/// Item 19: SIGTERM while a reader holds a tensor file open and a job runs.
/// The job is cancelled at once and removes its temporary file, the mount
/// is detached, and after the grace period (--stop-timeout) the connection
/// is aborted and the daemon exits 0: the open file fails from then on.
fn sigterm_with_an_open_file_stops_after_the_grace_period() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let mut m = Mounted::new(
        &model,
        &[
            "--jobs-dir",
            out.path().to_str().unwrap(),
            "--stop-timeout",
            "2",
        ],
    );
    std::fs::write(m.path("ctl"), "encode rknot profile=faithful out=x.rknot\n").unwrap();
    m.wait_job(1, &["running"], 60);
    let held = std::fs::File::open(m.path("blk.0.attn_q.weight.f32")).unwrap();
    let mut buf = vec![0u8; 4096];
    held.read_at(&mut buf, 0).unwrap();
    m.signal(libc::SIGTERM);
    // Before the fix the daemon stayed until the reader closed the file.
    let st = m
        .wait_exit(120)
        .unwrap_or_else(|| panic!("daemon still running with a file open:\n{}", m.log()));
    let log = m.log();
    assert!(st.success(), "{st}\n{log}");
    assert!(!is_mounted(&m.mp), "{log}");
    assert!(
        listing(out.path()).is_empty(),
        "no output, no temporary file: {:?}\n{log}",
        listing(out.path())
    );
    for want in [
        "SIGTERM: stopping",
        "job 1 cancelled",
        "grace period of 2 s is over",
        "stopped by SIGTERM",
    ] {
        assert!(log.contains(want), "want {want:?} in:\n{log}");
    }
    let err = uncached_read(&held).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");
    assert!(!pid_alive(m.pid() as i32));
}
}

needs! { [fuse]
/// Item 19: during the grace period open files keep working; a second
/// signal cuts them off and ends the daemon at once, however long the grace
/// period.
fn second_signal_ends_the_grace_period() {
    if !fuse_available() {
        return;
    }
    let src = demo_path("tiny-llama.gguf");
    let mut m = Mounted::new(&src, &["--stop-timeout", "3600"]);
    let b = rknot::backend::open(&src, None).unwrap();
    let want = decode_bytes(b.as_ref(), "output.weight");
    let mut held = std::fs::File::open(m.path("output.weight.f32")).unwrap();
    let mut first = vec![0u8; 1000];
    held.read_exact(&mut first).unwrap();
    m.signal(libc::SIGTERM);
    // Two signals sent before the first is taken would merge into one.
    wait_log(&m, "detaching lazily");
    let deadline = Instant::now() + Duration::from_secs(30);
    while is_mounted(&m.mp) {
        assert!(Instant::now() < deadline, "not detached:\n{}", m.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(m.try_wait().is_none(), "waiting for the open file");
    let mut rest = Vec::new();
    held.read_to_end(&mut rest).unwrap();
    assert_eq!([first, rest].concat(), want, "open files keep working");
    m.signal(libc::SIGINT);
    let st = m
        .wait_exit(30)
        .unwrap_or_else(|| panic!("second signal ignored:\n{}", m.log()));
    let log = m.log();
    assert!(st.success(), "{st}\n{log}");
    assert!(log.contains("second signal (SIGINT)"), "{log}");
    let err = uncached_read(&held).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");
    assert!(!pid_alive(m.pid() as i32));
}
}
