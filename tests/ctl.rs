//! The control file through real mounts: who may command it (a real second
//! user), consistent snapshots for readers, line-buffered commands, and a
//! log that does not grow with every open or failed read.

mod common;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use common::mount::{Mounted, fuse_available};
use common::users::test_user;
use common::*;

/// A copy of the demo GGUF in a directory the test user can read, as the
/// jobs directory of a mount.
fn demo_copy(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let p = dir.join("model.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    p
}

needs! { [fuse]
/// Item 1: with the documented `-o allow_other,uid=U,gid=G`, user U owns
/// the tensor files but may not command the daemon: not by opening ctl,
/// and not through a descriptor root opened and handed over (commands are
/// authorised by the credentials of each request, not by the mode shown).
fn only_root_and_the_daemon_user_may_command() {
    if !fuse_available() {
        return;
    }
    let Some(user) = test_user() else { return };
    let jobs = tempfile::tempdir().unwrap();
    let model = demo_copy(jobs.path());
    // A root-only file the job could replace with overwrite=1.
    let secret = jobs.path().join("secret.knot");
    std::fs::write(&secret, b"root only").unwrap();
    let opts = format!("allow_other,uid={},gid={}", user.uid, user.gid);
    let m = Mounted::new(
        &model,
        &["-o", &opts, "--jobs-dir", jobs.path().to_str().unwrap()],
    );
    std::fs::set_permissions(
        m.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let ctl = m.path("ctl");
    // The tensor files are the user's; ctl is the daemon's, 0600.
    let st = user.sh(&format!(
        "stat -c '%u %a' {}/blk.0.attn_q.weight.f32 {}",
        m.mp.display(),
        ctl.display()
    ));
    let out = String::from_utf8_lossy(&st.stdout).to_string();
    assert_eq!(out, format!("{} 444\n0 600\n", user.uid), "{out}");
    let read = user.sh(&format!(
        "od -N 8 -t f4 {}/blk.0.attn_q.weight.f32",
        m.mp.display()
    ));
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    // Opening ctl to write: refused.
    let w = user.sh(&format!(
        "echo 'encode knot out=secret.knot overwrite=1' > {}",
        ctl.display()
    ));
    assert!(!w.status.success());
    assert!(String::from_utf8_lossy(&w.stderr).contains("Permission denied"));
    // A descriptor opened by root, written by the user: refused by the
    // request's credentials.
    let fd = std::fs::OpenOptions::new().write(true).open(&ctl).unwrap();
    let raw = fd.as_raw_fd();
    // setpriv, not runuser: runuser's PAM session closes inherited
    // descriptors.
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={}", user.uid),
        &format!("--regid={}", user.gid),
        "--clear-groups",
        "sh",
        "-c",
        "/bin/echo 'encode knot out=secret.knot overwrite=1' >&3 && echo wrote",
    ]);
    // SAFETY: dup2 in the child between fork and exec, on descriptors we own.
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself keeps FD_CLOEXEC: clear it explicitly then.
            let rc = if raw == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(raw, 3)
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    drop(fd);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the user's write went through: {stderr}"
    );
    assert!(stderr.contains("Permission denied"), "{stderr}");
    assert!(m.ctl_json()["jobs"].as_array().unwrap().is_empty());
    assert_eq!(std::fs::read(&secret).unwrap(), b"root only");
    assert!(
        m.log().contains(&format!("command from uid {} ", user.uid)),
        "{}",
        m.log()
    );
    // Root may.
    let mut f = std::fs::OpenOptions::new().write(true).open(&ctl).unwrap();
    f.write_all(b"drop-cache\n").unwrap();
}
}

needs! { [fuse]
/// Item 15: every read of one open sees one rendering, however the state
/// changes between reads (a JSON reader never gets halves of two).
fn ctl_reads_come_from_one_snapshot_per_open() {
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&demo_path("tiny-llama.gguf"), &[]);
    for name in ["ctl.json", "ctl"] {
        let mut f = std::fs::File::open(m.path(name)).unwrap();
        let mut first = vec![0u8; 200];
        let n = f.read(&mut first).unwrap();
        first.truncate(n);
        // Change the state: 20 tensor files read (each once, so the
        // daemon sees the reads, not the page cache).
        let names = listing(&m.mp);
        let uncached = |p: &Path| {
            // Drop the kernel's cached pages so the read reaches the daemon.
            let f = std::fs::File::open(p).unwrap();
            // SAFETY: fadvise on a descriptor we own.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            std::fs::read(p).unwrap()
        };
        let tensors: Vec<&String> = names
            .iter()
            .filter(|n| n.ends_with(".f32") && n.contains('.'))
            .take(20)
            .collect();
        assert_eq!(tensors.len(), 20);
        let before = m.ctl_json()["reads"]["total"].as_u64().unwrap();
        for t in &tensors {
            uncached(&m.mp.join(t));
        }
        let mut rest = Vec::new();
        f.read_to_end(&mut rest).unwrap();
        let mut whole = first.clone();
        whole.extend_from_slice(&rest);
        if name == "ctl.json" {
            let v: serde_json::Value = serde_json::from_slice(&whole).unwrap_or_else(|e| {
                panic!("torn ctl.json ({e}):\n{}", String::from_utf8_lossy(&whole))
            });
            // All of it is the rendering made at open, before the reads.
            assert!(v["reads"]["total"].as_u64().unwrap() <= before, "{v}");
        } else {
            let text = String::from_utf8(whole).unwrap();
            assert!(
                text.starts_with("rknot-mount ") && text.ends_with('\n'),
                "{text}"
            );
            assert_eq!(text.matches("\nreads:").count(), 1, "{text}");
            let total: u64 = text
                .split("\nreads:")
                .nth(1)
                .and_then(|r| r.split(", total ").nth(1))
                .and_then(|r| r.split(',').next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("{text}"));
            assert!(total <= before + 1, "rendered at open: {text}");
        }
        // A new open sees the new state.
        let fresh = m.ctl_json();
        assert!(fresh["reads"]["total"].as_u64().unwrap() >= before + 20);
    }
}
}

needs! { [fuse]
/// Item 16: commands are lines, whatever the write() boundaries; a write
/// with a bad line runs nothing; bad UTF-8 and over-long lines are refused;
/// a last line without a newline runs at close.
fn ctl_commands_are_lines_checked_whole() {
    if !fuse_available() {
        return;
    }
    let jobs = tempfile::tempdir().unwrap();
    let model = demo_copy(jobs.path());
    let m = Mounted::new(&model, &["--jobs-dir", jobs.path().to_str().unwrap()]);
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(m.path("ctl"))
            .unwrap()
    };
    let errno = |r: std::io::Result<()>| r.err().and_then(|e| e.raw_os_error());
    // One command in two writes: one command, not two unknown ones.
    {
        let mut f = open();
        f.write_all(b"drop-").unwrap();
        f.write_all(b"cache\n").unwrap();
    }
    assert!(!m.log().contains("unknown command"), "{}", m.log());
    assert_eq!(
        m.log().matches("drop-cache: cache dropped").count(),
        1,
        "{}",
        m.log()
    );
    // A valid line and a bad one in one write: EINVAL, and no job queued.
    assert_eq!(
        errno(open().write_all(b"encode knot out=a.knot\nfrobnicate\n")),
        Some(libc::EINVAL)
    );
    assert!(m.ctl_json()["jobs"].as_array().unwrap().is_empty());
    let e = m.last_error();
    assert!(
        e.contains("line 2") && e.contains("nothing in this write was run"),
        "{e}"
    );
    // Invalid UTF-8 in a name: refused, not replaced by U+FFFD.
    assert_eq!(
        errno(open().write_all(b"encode knot out=\xff\xfe.knot\n")),
        Some(libc::EINVAL)
    );
    assert!(
        m.last_error().contains("not valid UTF-8"),
        "{}",
        m.last_error()
    );
    // An over-long line, even split across writes.
    {
        let mut f = open();
        let long = vec![b'x'; 3000];
        f.write_all(&long).unwrap();
        assert_eq!(errno(f.write_all(&long)), Some(libc::EINVAL));
    }
    assert!(m.last_error().contains("longer than"), "{}", m.last_error());
    // No newline: the command runs when the file is closed.
    {
        let mut f = open();
        f.write_all(b"encode knot out=b.knot").unwrap();
        assert!(m.ctl_json()["jobs"].as_array().unwrap().is_empty());
    }
    let jobs_now = m.ctl_json()["jobs"].clone();
    assert_eq!(jobs_now.as_array().unwrap().len(), 1, "{jobs_now}");
    assert_eq!(jobs_now[0]["command"], "encode knot out=b.knot");
    // A bad last line without newline: close() reports it.
    let mut f = open();
    f.write_all(b"explode").unwrap();
    // SAFETY: closing a descriptor we own (and forgetting the File).
    let rc = unsafe { libc::close(std::os::fd::IntoRawFd::into_raw_fd(f)) };
    assert_eq!(rc, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EINVAL)
    );
    // Nothing but the finished output in the jobs directory.
    for _ in 0..600 {
        if m.ctl_json()["jobs"][0]["state"] == "done" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(listing(jobs.path()), ["b.knot", "model.gguf"]);
}
}

needs! { [fuse]
/// Item 17: 2,000 opens that ask isatty() (as every Python open does), and
/// 2,000 failing reads, grow the log by a few lines, not thousands.
fn opens_and_failed_reads_do_not_flood_the_log() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &model).unwrap();
    let m = Mounted::new(&model, &["-o", "prefetch_threads=0"]);
    let lines = |m: &Mounted| m.log().lines().count();
    let before = lines(&m);
    let tensor = m.path("blk.1.ffn_down.weight.f32");
    for _ in 0..2000 {
        let f = std::fs::File::open(&tensor).unwrap();
        // SAFETY: isatty on a descriptor we own.
        assert_eq!(unsafe { libc::isatty(f.as_raw_fd()) }, 0);
    }
    let after_opens = lines(&m);
    assert!(
        after_opens - before <= 3,
        "2000 opens added {} log lines:\n{}",
        after_opens - before,
        m.log()
    );
    // Truncate the source: reads of its tensors now fail (EIO).
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap();
    f.set_len(4096).unwrap();
    let mut failed = 0;
    for i in 0..2000u64 {
        let f = std::fs::File::open(&tensor).unwrap();
        let mut buf = [0u8; 4096];
        if std::os::unix::fs::FileExt::read_at(&f, &mut buf, (i % 50) * 4096).is_err() {
            failed += 1;
        }
    }
    assert_eq!(failed, 2000);
    let added = lines(&m) - after_opens;
    assert!(
        added <= 5,
        "2000 failed reads added {added} log lines:\n{}",
        m.log()
    );
    // The rate-limited line names the module where the read failed as its
    // target (as log's macros do), not the rate limiter's.
    assert!(
        m.log()
            .lines()
            .any(|l| l.contains(" rknot::fs::read] read of ")),
        "{}",
        m.log()
    );
    // (The kernel's read-ahead adds a few failing reads of its own.)
    assert!(m.ctl_json()["reads"]["errors"].as_u64().unwrap() >= 2000);
}
}

needs! { [fuse]
/// Every mount has `ctl.json`, the read-only status, with or without
/// encoding jobs (`-o nojobs` here; a remote mount without `--jobs-dir`
/// likewise): mode 0444, so another user reads the status that `ctl`
/// (0600, the owner's) keeps from them.
fn ctl_json_is_served_without_jobs_and_readable_by_other_users() {
    if !fuse_available() {
        return;
    }
    let Some(user) = test_user() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = demo_copy(dir.path());
    let m = Mounted::new(&model, &["-o", "allow_other,nojobs"]);
    std::fs::set_permissions(
        m.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let names = listing(&m.mp);
    assert!(names.iter().any(|n| n == "ctl.json"), "{names:?}");
    assert!(!names.iter().any(|n| n == "jobs"), "{names:?}");
    let v = m.ctl_json();
    assert!(v["jobs"].as_array().is_some_and(|j| j.is_empty()), "{v}");
    assert!(v["jobs_dir"].is_null(), "{v}");
    let st = user.sh(&format!(
        "stat -c '%a' {0}/ctl.json {0}/ctl && cat {0}/ctl.json",
        m.mp.display()
    ));
    let out = String::from_utf8_lossy(&st.stdout).to_string();
    assert!(
        st.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let (modes, json) = out.split_at(out.find('{').unwrap_or(out.len()));
    assert_eq!(modes, "444\n600\n");
    let theirs: serde_json::Value = serde_json::from_str(json).unwrap();
    assert!(theirs["reads"]["total"].is_u64(), "{theirs}");
}
}
