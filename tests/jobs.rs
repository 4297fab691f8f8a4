//! Encoding jobs started through a real mount's `ctl`.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::mount::{MountGuard, Mounted, fuse_available, is_mounted, mount_bin};
use common::users::test_user;
use common::*;

needs! { [model, fuse]
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
    m.command("encode sk32 rank=8 out=s8.sk32").unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let j = m.job(1);
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
        m.command("encode sk32 rank=8 out=s8.sk32"),
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
        assert_eq!(m.command(line), Err(libc::EINVAL), "{line}");
        let last = m.last_error();
        assert!(last.contains(reason), "{line}: {last}");
    }
    assert!(!Path::new("/etc/x").exists());

    // Two jobs at once, reads continuing; then cancel the slow one.
    m.command("encode rknot profile=faithful out=f.rknot").unwrap();
    m.command("encode knot out=k.knot").unwrap();
    m.wait_job(2, &["running"], 30);
    let reads_before = m.ctl_json()["reads"]["total"].as_u64().unwrap();
    for t in [
        "blk.3.ffn_up.weight.f32",
        "blk.9.attn_q.weight.f32",
        "token_embd.weight.f32",
    ] {
        m.command("drop-cache").unwrap();
        let bytes = std::fs::read(m.path(t)).unwrap();
        assert!(!bytes.is_empty());
    }
    assert!(m.ctl_json()["reads"]["total"].as_u64().unwrap() > reads_before);
    m.command("cancel 2").unwrap_or_else(|e| panic!("cancel 2: {e}\n{}", m.ctl()));
    let j = m.wait_job(2, &["cancelled", "done", "failed"], 60);
    assert_eq!(j["state"], "cancelled", "{j}");
    assert_eq!(m.wait_job(3, &["done", "failed"], 120)["state"], "done");
    assert!(!out.path().join("f.rknot").exists());
    // Only the finished outputs; no temporary files left.
    assert_eq!(listing(out.path()), ["k.knot", "s8.sk32"]);
    let dir: Vec<String> = listing(&m.path("jobs"));
    assert_eq!(dir, ["1", "2", "3"]);
}
}

needs! { [model, fuse]
/// Unmount cancels running jobs and removes their temporary files; kill -9
/// of the daemon leaves nothing at the target path.
fn unmount_and_kill_leave_no_output() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    for kill in [false, true] {
        let out = tempfile::tempdir().unwrap();
        let mut m = Mounted::new(&model, &["--jobs-dir", out.path().to_str().unwrap()]);
        m.command("encode rknot profile=faithful out=x.rknot").unwrap();
        m.wait_job(1, &["running"], 30);
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
}

needs! { [fuse]
/// ctl is 0600: with allow_other another user reads tensors but cannot
/// start jobs.
fn other_users_cannot_start_jobs() {
    if !fuse_available() {
        return;
    }
    let Some(user) = test_user() else { return };
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
    let read = user.sh(&format!(
        "od -N 16 -t f4 {}/blk.0.attn_q.weight.f32",
        mp.display()
    ));
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let write = user.sh(&format!(
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
}

/// Copy `from` to `dir/name` with permission bits `mode`.
fn copy_with_mode(from: &Path, dir: &Path, name: &str, mode: u32) -> std::path::PathBuf {
    let to = dir.join(name);
    std::fs::copy(from, &to).unwrap();
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode)).unwrap();
    to
}

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

needs! { [fuse]
/// A job's output has at most the permission bits of the mount's source
/// files (the mounted file and its fallback): a private model never yields
/// a world-readable encoding.
fn job_outputs_get_at_most_the_sources_mode() {
    if !fuse_available() {
        return;
    }
    // (mounted file, its mode, fallback and its mode, expected output mode)
    let cases = [
        ("tiny-llama.gguf", 0o600, None, 0o600),
        (
            "tiny-llama.sk32",
            0o644,
            Some(("tiny-llama.gguf", 0o640)),
            0o640,
        ),
        (
            "tiny-llama.sk32",
            0o604,
            Some(("tiny-llama.gguf", 0o640)),
            0o600,
        ),
    ];
    for (source, mode, fallback, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let src = copy_with_mode(&demo_path(source), dir.path(), source, mode);
        let mut args = vec!["--jobs-dir", dir.path().to_str().unwrap()];
        let fb;
        if let Some((name, mode)) = fallback {
            fb = copy_with_mode(&demo_path(name), dir.path(), name, mode);
            args.extend(["--dense", fb.to_str().unwrap()]);
        }
        let m = Mounted::new(&src, &args);
        m.command("encode knot out=k.knot").unwrap();
        m.command("encode sk32 rank=4 out=s.sk32").unwrap();
        for (id, out) in [(1, "k.knot"), (2, "s.sk32")] {
            let j = m.wait_job(id, &["done", "failed", "cancelled"], 60);
            assert_eq!(j["state"], "done", "{j}");
            let got = mode_of(&dir.path().join(out));
            assert_eq!(
                got, want,
                "{source} {mode:o} over {fallback:?}: {out} is {got:o}, want {want:o}"
            );
        }
    }
}
}

/// Wait until job `id` has encoded a tensor: its output (the temporary
/// file) exists by then.
fn wait_started(m: &Mounted, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let j = m.job(id);
        if j["state"] == "running" && j["tensors_done"].as_u64().unwrap() > 0 {
            return;
        }
        assert!(Instant::now() < deadline && j["state"] != "failed", "{j}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

needs! { [model, fuse]
/// Nothing replaces a file that is not the job's to replace: a second job
/// with the same output is refused at submit, and a file that appears at the
/// target while the job runs (by hand, or written by `rknot encode`)
/// survives; the job fails naming it and leaves no temporary file.
fn jobs_never_replace_a_file_that_appears_or_another_jobs_output() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let m = Mounted::new(&model, &["--jobs-dir", out.path().to_str().unwrap()]);
    m.command("encode sk32 rank=8 out=a.sk32").unwrap();
    m.command("encode sk32 rank=8 out=b.sk32").unwrap();
    for line in [
        "encode knot out=a.sk32",
        "encode knot out=a.sk32 overwrite=1",
        "encode sk32 rank=4 out=b.sk32 overwrite=1",
    ] {
        assert_eq!(m.command(line), Err(libc::EINVAL), "{line}");
        let e = m.last_error();
        assert!(e.contains("already writes"), "{line}: {e}");
    }
    // While job 1 runs, a file by hand at a.sk32; while job 2 runs,
    // `rknot encode` writes b.sk32.
    wait_started(&m, 1);
    std::fs::write(out.path().join("a.sk32"), b"mine").unwrap();
    let j = m.job(1);
    assert_eq!(j["state"], "running", "finished too early to test: {j}");
    let j = m.wait_job(1, &["done", "failed", "cancelled"], 300);
    assert_eq!(j["state"], "failed", "{j}");
    let e = j["error"].as_str().unwrap();
    assert!(e.contains("appeared") && e.contains("a.sk32"), "{e}");
    wait_started(&m, 2);
    let cli = Command::new(rknot_bin())
        .args(["encode", "knot", model.to_str().unwrap(), "-o"])
        .arg(out.path().join("b.sk32"))
        .output()
        .unwrap();
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    let cli_bytes = std::fs::read(out.path().join("b.sk32")).unwrap();
    let j = m.job(2);
    assert_eq!(j["state"], "running", "finished too early to test: {j}");
    let j = m.wait_job(2, &["done", "failed", "cancelled"], 300);
    assert_eq!(j["state"], "failed", "{j}");
    let e = j["error"].as_str().unwrap();
    assert!(e.contains("appeared") && e.contains("b.sk32"), "{e}");
    assert_eq!(std::fs::read(out.path().join("a.sk32")).unwrap(), b"mine");
    assert_eq!(std::fs::read(out.path().join("b.sk32")).unwrap(), cli_bytes);
    assert_eq!(listing(out.path()), ["a.sk32", "b.sk32"]);
}
}

needs! { [fuse]
/// A job may never write over a source of the mount (the mounted file, the
/// fallback; under any name, a hard link included), with or without
/// overwrite=1.
fn jobs_never_overwrite_a_source_of_the_mount() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &gguf).unwrap();
    let sk = dir.path().join("model.sk32");
    std::fs::copy(demo_path("tiny-llama.sk32"), &sk).unwrap();
    std::fs::hard_link(&gguf, dir.path().join("link.gguf")).unwrap();
    std::fs::hard_link(&sk, dir.path().join("link.sk32")).unwrap();
    let before = [&gguf, &sk].map(|p| sha256_hex(&std::fs::read(p).unwrap()));
    // (mounted file, fallback, the names of its sources in the jobs dir)
    let mounts = [
        (&gguf, None, &["model.gguf", "link.gguf"][..]),
        (
            &sk,
            Some(&gguf),
            &["model.gguf", "link.gguf", "model.sk32", "link.sk32"][..],
        ),
    ];
    for (source, dense, names) in mounts {
        let mut args = vec![];
        if let Some(d) = dense {
            args.extend(["--dense", d.to_str().unwrap()]);
        }
        let m = Mounted::new(source, &args);
        for name in names {
            for kind in ["knot", "sk32 rank=4"] {
                let line = format!("encode {kind} out={name} overwrite=1");
                assert_eq!(m.command(&line), Err(libc::EINVAL), "{line}");
                let e = m.last_error();
                assert!(e.contains("same device and inode"), "{line}: {e}");
            }
        }
        assert!(
            m.ctl_json()["jobs"].as_array().unwrap().is_empty(),
            "nothing queued"
        );
    }
    assert_eq!(
        [&gguf, &sk].map(|p| sha256_hex(&std::fs::read(p).unwrap())),
        before
    );
}
}

needs! { [model, fuse]
/// Jobs encode the model the mount serves, read through its open file: a
/// different model renamed over the source path changes nothing.
fn jobs_read_the_mounted_file_not_the_path() {
    let Some(smol) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("model.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &source).unwrap();
    let m = Mounted::new(&source, &[]);
    let other = dir.path().join("other.gguf");
    std::fs::copy(&smol, &other).unwrap();
    std::fs::rename(&other, &source).unwrap();
    m.command("encode knot out=k.knot").unwrap();
    m.command("encode sk32 rank=4 out=s.sk32").unwrap();
    for id in [1, 2] {
        let j = m.wait_job(id, &["done", "failed", "cancelled"], 300);
        assert_eq!(j["state"], "done", "{j}");
    }
    // The repack holds exactly the mount's tensors, byte for byte.
    let knot = rknot::backend::open(&dir.path().join("k.knot"), None).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    let served = index["tensors"].as_array().unwrap();
    assert_eq!(knot.tensors().len(), served.len());
    for t in knot.tensors().entries() {
        let want = std::fs::read(m.path(&format!("{}.f32", t.name.dot))).unwrap();
        assert_eq!(
            decode_bytes(knot.as_ref(), &t.name.dot),
            want,
            "{}",
            t.name.dot
        );
    }
    // The sketches have the mounted model's shapes.
    let sk = rknot::backend::open(&dir.path().join("s.sk32"), None).unwrap();
    let q = sk.find("blk.0.attn_q.weight").unwrap();
    assert_eq!(sk.tensors().entries()[q].shape, [256, 256]);
}
}

needs! { [fuse]
/// A commit that fails (the output is a directory) leaves no temporary
/// file; an out= name of 255 bytes (the longest accepted) works.
fn failed_commits_leave_nothing_and_long_names_work() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = Mounted::new(
        &demo_path("tiny-llama.gguf"),
        &["--jobs-dir", dir.path().to_str().unwrap()],
    );
    std::fs::create_dir(dir.path().join("d.knot")).unwrap();
    m.command("encode knot out=d.knot overwrite=1").unwrap();
    let j = m.wait_job(1, &["done", "failed", "cancelled"], 60);
    assert_eq!(j["state"], "failed", "{j}");
    assert_eq!(listing(dir.path()), ["d.knot"]);
    let long = "k".repeat(255);
    m.command(&format!("encode knot out={long}")).unwrap();
    let j = m.wait_job(2, &["done", "failed", "cancelled"], 60);
    assert_eq!(j["state"], "done", "{j}");
    assert_eq!(listing(dir.path()), ["d.knot", long.as_str()]);
}
}

needs! { [model, fuse]
/// The job list is bounded: at most 16 queued (a submit beyond fails with
/// EINVAL and the reason), the last 64 finished; older ones expire from
/// ctl.json and jobs/.
fn job_list_is_bounded() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = Mounted::new(&model, &["--jobs-dir", dir.path().to_str().unwrap()]);
    // One long job keeps the others queued.
    m.command("encode rknot profile=faithful out=slow.rknot").unwrap();
    m.wait_job(1, &["running"], 30);
    let mut next = 2u64;
    for round in 0..6 {
        let first = next;
        for _ in 0..16 {
            m.command(&format!("encode knot out=q{next}.knot"))
                .unwrap_or_else(|e| panic!("round {round}, job {next}: {e}: {}", m.last_error()));
            next += 1;
        }
        assert_eq!(
            m.command("encode knot out=one-too-many.knot"),
            Err(libc::EINVAL)
        );
        assert!(m.last_error().contains("queued"), "{}", m.last_error());
        for id in first..next {
            m.command(&format!("cancel {id}")).unwrap();
        }
        let jobs = m.ctl_json()["jobs"].as_array().unwrap().len();
        assert!(jobs <= 1 + 64, "round {round}: {jobs} jobs listed");
    }
    // 96 cancelled: the last 64 remain, with the running one.
    let ids: Vec<u64> = m.ctl_json()["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_u64().unwrap())
        .collect();
    let mut want = vec![1];
    want.extend(next - 64..next);
    assert_eq!(ids, want);
    assert_eq!(listing(&m.path("jobs")).len(), 65);
    assert!(std::fs::read(m.path("jobs/2")).is_err(), "job 2 expired");
    assert!(m.ctl().contains(&format!("job {} cancelled", next - 1)));
    // Job 1 finishing makes it the oldest of 65 finished: it expires.
    m.command("cancel 1").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while m.ctl_json()["jobs"][0]["id"] == 1 {
        assert!(Instant::now() < deadline, "{}", m.ctl());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(m.ctl_json()["jobs"].as_array().unwrap().len(), 64);
}
}
