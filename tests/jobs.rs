//! Encoding jobs started through a real mount's `ctl`.

mod common;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::mount::{MountGuard, Mounted, fuse_available, is_mounted, mount_bin};
use common::*;

fn ctl_json(m: &Mounted) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(m.path("ctl.json")).unwrap()).unwrap()
}

fn job(m: &Mounted, id: u64) -> serde_json::Value {
    ctl_json(m)["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("no job {id}"))
}

/// Write one command to ctl; Err(errno) when the write is refused.
fn command(m: &Mounted, line: &str) -> Result<(), i32> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.path("ctl"))
        .unwrap();
    f.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| e.raw_os_error().unwrap_or(0))
}

fn wait_state(m: &Mounted, id: u64, states: &[&str], secs: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let j = job(m, id);
        if states.iter().any(|s| j["state"] == *s) {
            return j;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} stuck: {j}\n{}",
            m.ctl()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn jobs_progress_cancel_and_validation() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let m = Mounted::new(
        &model,
        &[
            "--jobs-dir",
            out.path().to_str().unwrap(),
            "-o",
            "max_jobs=2",
        ],
    );
    // Start a job; its progress advances and it finishes.
    command(&m, "encode sk32 rank=8 out=s8.sk32").unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let j = job(&m, 1);
        seen.push(j["tensors_done"].as_u64().unwrap());
        if j["state"] == "done" {
            assert_eq!(j["tensors_done"], 210);
            assert_eq!(j["tensors_total"], 210);
            assert!(j["bytes_written"].as_u64().unwrap() > 0);
            break;
        }
        assert!(Instant::now() < deadline, "{j}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]),
        "progress goes forward: {seen:?}"
    );
    assert!(out.path().join("s8.sk32").exists());
    let file = std::fs::read_to_string(m.path("jobs/1")).unwrap();
    assert!(file.contains("done") && file.contains("s8.sk32"), "{file}");
    assert!(m.ctl().contains("job 1 done"), "{}", m.ctl());
    // The output is a valid sketch file.
    let o = Command::new(rknot_bin())
        .args(["verify", out.path().join("s8.sk32").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));

    // Overwrite refusal, then allowed with overwrite=1.
    assert_eq!(
        command(&m, "encode sk32 rank=8 out=s8.sk32"),
        Err(libc::EINVAL)
    );
    assert!(m.ctl().contains("exists"), "{}", m.ctl());
    // Malformed commands and unsafe names: EINVAL, the reason in ctl.
    for (line, reason) in [
        ("encode sk32 rank=8 out=../x", "'..' is not allowed"),
        ("encode sk32 rank=8 out=/etc/x", "plain file name"),
        ("encode sk32 rank=8 out=.hidden", "must not start with '.'"),
        ("encode sk32 rank=eight out=a", "not a valid number"),
        ("encode rknot coverage=2 out=a", "coverage"),
        ("encode sk32 rank=8", "out=NAME is required"),
        ("format c:", "unknown command"),
        ("cancel 99", "no such job"),
    ] {
        assert_eq!(command(&m, line), Err(libc::EINVAL), "{line}");
        let last = ctl_json(&m)["last_error"].as_str().unwrap().to_string();
        assert!(last.contains(reason), "{line}: {last}");
    }
    assert!(!Path::new("/etc/x").exists());

    // Two jobs at once, reads continuing; then cancel the slow one.
    command(&m, "encode rknot profile=faithful out=f.rknot").unwrap();
    command(&m, "encode knot out=k.knot").unwrap();
    wait_state(&m, 2, &["running"], 30);
    let reads_before = ctl_json(&m)["reads"]["total"].as_u64().unwrap();
    for t in [
        "blk.3.ffn_up.weight.f32",
        "blk.9.attn_q.weight.f32",
        "token_embd.weight.f32",
    ] {
        command(&m, "drop-cache").unwrap();
        let bytes = std::fs::read(m.path(t)).unwrap();
        assert!(!bytes.is_empty());
    }
    assert!(ctl_json(&m)["reads"]["total"].as_u64().unwrap() > reads_before);
    command(&m, "cancel 2").unwrap_or_else(|e| panic!("cancel 2: {e}\n{}", m.ctl()));
    let j = wait_state(&m, 2, &["cancelled", "done", "failed"], 60);
    assert_eq!(j["state"], "cancelled", "{j}");
    assert_eq!(wait_state(&m, 3, &["done", "failed"], 120)["state"], "done");
    assert!(!out.path().join("f.rknot").exists());
    // Only the finished outputs; no temporary files left.
    assert_eq!(listing(out.path()), ["k.knot", "s8.sk32"]);
    let dir: Vec<String> = listing(&m.path("jobs"));
    assert_eq!(dir, ["1", "2", "3"]);
}

/// Unmount cancels running jobs and removes their temporary files; kill -9
/// of the daemon leaves nothing at the target path.
#[test]
fn unmount_and_kill_leave_no_output() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    for kill in [false, true] {
        let out = tempfile::tempdir().unwrap();
        let mut m = Mounted::new(&model, &["--jobs-dir", out.path().to_str().unwrap()]);
        command(&m, "encode rknot profile=faithful out=x.rknot").unwrap();
        wait_state(&m, 1, &["running"], 30);
        std::thread::sleep(Duration::from_millis(500));
        if kill {
            m.signal(libc::SIGKILL);
            m.wait_exit(10);
            let _ = Command::new("fusermount3").arg("-uz").arg(&m.mp).status();
            assert!(
                !out.path().join("x.rknot").exists(),
                "nothing at the target after kill -9"
            );
            // A hidden temporary may remain after SIGKILL; never the target.
            assert!(
                listing(out.path())
                    .iter()
                    .all(|n| n.starts_with(".x.rknot.tmp."))
            );
        } else {
            m.signal(libc::SIGTERM);
            let st = m
                .wait_exit(60)
                .expect("daemon exits after cancelling its job");
            assert!(st.success(), "{st}\n{}", m.log());
            assert!(!is_mounted(&m.mp));
            assert!(
                listing(out.path()).is_empty(),
                "temp files removed: {:?}",
                listing(out.path())
            );
            assert!(m.log().contains("job 1 cancelled"), "{}", m.log());
        }
    }
}

/// ctl is 0600: with allow_other another user reads tensors but cannot
/// start jobs.
#[test]
fn other_users_cannot_start_jobs() {
    if !fuse_available() {
        return;
    }
    // Without a `nobody` user or runuser this cannot run: a note, or a
    // failure under RKNOT_REQUIRE_FUSE (CI must not skip it silently).
    let skip = |why: &str| {
        if env_flag("RKNOT_REQUIRE_FUSE") {
            panic!("{why}; RKNOT_REQUIRE_FUSE is set, so this is a failure");
        }
        eprintln!("NOTE: skipping: {why}");
    };
    let nobody = match Command::new("id").args(["-u", "nobody"]).output() {
        Ok(o) => o,
        Err(e) => return skip(&format!("cannot run `id -u nobody`: {e}")),
    };
    if !nobody.status.success() {
        return skip("no 'nobody' user");
    }
    if Command::new("runuser").arg("--help").output().is_err() {
        return skip("no runuser");
    }
    let base = tempfile::tempdir().unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mp = base.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let demo = demo_path("tiny-llama.gguf");
    let mut child = Command::new(mount_bin())
        .arg(&demo)
        .arg(&mp)
        .args(["--foreground", "-o", "allow_other", "--jobs-dir"])
        .arg(base.path())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Stops the daemon and unmounts if an assertion below fails.
    let mut guard = MountGuard::new(&mp, Some(child.id() as i32));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !mp.join("index.json").exists() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    let as_nobody = |cmd: &str| {
        Command::new("runuser")
            .args(["-u", "nobody", "--", "sh", "-c", cmd])
            .output()
            .unwrap()
    };
    let read = as_nobody(&format!(
        "od -N 16 -t f4 {}/blk.0.attn_q.weight.f32",
        mp.display()
    ));
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let write = as_nobody(&format!(
        "echo 'encode knot out=x.knot' > {}/ctl",
        mp.display()
    ));
    assert!(!write.status.success());
    assert!(String::from_utf8_lossy(&write.stderr).contains("Permission denied"));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    guard.exited();
    assert!(st.success());
    assert!(!base.path().join("x.knot").exists());
}
