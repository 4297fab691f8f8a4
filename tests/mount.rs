//! Real FUSE mounts (root, /dev/fuse, fuse3). In CI `RKNOT_REQUIRE_FUSE=1`
//! turns "cannot mount" into a failure.

mod common;

use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mount::{
    MountGuard, Mounted, background_pid, fuse_available, is_mounted, mount_bin,
    mount_demo_background,
};
use common::*;
use rknot::backend::{self, Backend, Role};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

needs! { [model, fuse]
fn smollm2_every_tensor_through_the_mount() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&model, &[]);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    assert_eq!(index["tensors"].as_array().unwrap().len(), 272);
    assert_eq!(index["model"]["layers"], 30);
    for r in smollm2_reference() {
        let dot = m.path(&format!("{}.f32", r.name));
        let us = m.path(&format!("{}.f32", r.name.replace('.', "_")));
        let bytes = std::fs::read(&dot).unwrap();
        assert_eq!(bytes.len() as u64, r.n_elements * 4, "{}", r.name);
        assert_eq!(
            sha256_hex(&bytes),
            r.sha256,
            "{} (gguf-py reference)",
            r.name
        );
        let (a, b) = (
            std::fs::metadata(&dot).unwrap(),
            std::fs::metadata(&us).unwrap(),
        );
        assert_eq!(a.ino(), b.ino(), "both names are one inode");
        assert_eq!(a.mode() & 0o7777, 0o444);
        assert_eq!(a.len(), r.n_elements * 4);
    }
    // `cat` through the mount equals `rknot cat` for a few, both spellings.
    for name in [
        "blk.0.attn_q.weight",
        "token_embd.weight",
        "output_norm.weight",
    ] {
        let via_cat = Command::new("cat")
            .arg(m.path(&format!("{}.f32", name.replace('.', "_"))))
            .output()
            .unwrap()
            .stdout;
        let via_cli = Command::new(rknot_bin())
            .arg("cat")
            .arg(&model)
            .arg(name)
            .output()
            .unwrap()
            .stdout;
        assert_eq!(via_cat, via_cli, "{name}");
    }
    let ctl = m.ctl();
    assert!(ctl.contains("reads:") && ctl.contains("errors 0"), "{ctl}");
}
}

needs! { [model, fuse]
fn smollm2_random_dd_reads_and_numpy_memmap() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&model, &[]);
    let b = backend::open(&model, None).unwrap();
    let mut rng = Rng(0x1234_5678);
    for name in [
        "token_embd.weight",
        "blk.7.ffn_down.weight",
        "blk.29.attn_k.weight",
    ] {
        let full = decode_bytes(b.as_ref(), name);
        let path = m.path(&format!("{name}.f32"));
        for _ in 0..12 {
            let off = rng.next() % full.len() as u64;
            let len = 1 + rng.next() % 70_000;
            let out = Command::new("dd")
                .arg(format!("if={}", path.display()))
                .args(["iflag=skip_bytes,count_bytes", "bs=65536", "status=none"])
                .arg(format!("skip={off}"))
                .arg(format!("count={len}"))
                .output()
                .unwrap();
            assert!(out.status.success());
            let end = (off + len).min(full.len() as u64) as usize;
            assert_eq!(
                out.stdout,
                &full[off as usize..end],
                "{name} dd at {off}+{len}"
            );
        }
        // pread at odd offsets too, including past EOF.
        let f = std::fs::File::open(&path).unwrap();
        for _ in 0..50 {
            let off = rng.next() % (full.len() as u64 + 10);
            let mut buf = vec![0u8; (rng.next() % 5000) as usize + 1];
            let n = f.read_at(&mut buf, off).unwrap();
            let want = if off as usize >= full.len() {
                &[][..]
            } else {
                &full[off as usize..(off as usize + buf.len()).min(full.len())]
            };
            assert_eq!(&buf[..n], want);
        }
    }
    // numpy.memmap of a tensor file.
    let name = "blk.3.ffn_gate.weight";
    let want = sha256_hex(&decode_bytes(b.as_ref(), name));
    let script = format!(
        "import hashlib, numpy as np\n\
         m = np.memmap('{}', dtype='<f4', mode='r')\n\
         print(m.shape[0], hashlib.sha256(m.tobytes()).hexdigest())",
        m.path(&format!("{name}.f32")).display()
    );
    // (Skipped with a note when numpy is missing, unless RKNOT_REQUIRE_FUSE
    // is set; any other failure panics with the script's stderr.)
    if let Some(s) = python(&script, &[]) {
        assert_eq!(s.trim(), format!("{} {want}", 1536 * 576), "numpy.memmap");
    }
}
}

needs! { [model, fuse]
/// An SK32 made from SmolLM2 weights with the GGUF as fallback.
fn sk32_over_gguf_fallback() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let dense = backend::open_single(&model, Role::Fallback).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sk = smollm2_sketch(&model, dir.path());

    let layered = backend::open(&sk, Some(&model)).unwrap();
    let m = Mounted::new(&sk, &["--dense", model.to_str().unwrap()]);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    let tensors = index["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 272);
    let role = |n: &str| tensors.iter().find(|t| t["name"] == n).unwrap()["source"].clone();
    assert_eq!(role("blk.0.attn_q.weight")["role"], "primary");
    assert_eq!(role("blk.0.attn_output.weight")["role"], "primary");
    assert_eq!(role("token_embd.weight")["role"], "fallback");
    assert_eq!(role("blk.0.attn_norm.weight")["role"], "fallback");
    assert_eq!(role("blk.0.attn_q.weight")["path"], sk.to_str().unwrap());
    assert_eq!(role("token_embd.weight")["path"], model.to_str().unwrap());
    assert!(
        index["fallback"]["path"]
            .as_str()
            .unwrap()
            .ends_with(".gguf")
    );
    for name in [
        "blk.0.attn_q.weight",
        "blk_0_attn_o_weight",
        "blk.4.ffn_up.weight",
        "token_embd.weight",
        "blk.0.attn_norm.weight",
    ] {
        let canonical = rknot::names::canonical(name);
        let want = decode_bytes(layered.as_ref(), &canonical);
        for file in [
            format!("{canonical}.f32"),
            format!("{}.f32", rknot::names::underscore(&canonical)),
        ] {
            assert_eq!(std::fs::read(m.path(&file)).unwrap(), want, "{file}");
        }
    }
    assert_eq!(
        std::fs::read(m.path("token_embd.weight.f32")).unwrap(),
        decode_bytes(dense.as_ref(), "token_embd.weight"),
        "vocab table comes from the fallback"
    );
}
}

needs! { [fuse]
/// 8 readers on random tensors and offsets, with a cache smaller than one
/// tensor: every byte right, no errors.
fn concurrent_readers_small_cache() {
    if !fuse_available() {
        return;
    }
    let src = demo_path("tiny-llama.rknot");
    let dense = demo_path("tiny-llama.gguf");
    // 64 KiB chunks and a 1 MiB cache: smaller than token_embd/ffn tensors' decoded size... and
    // smaller than the whole model, so chunks are evicted while readers run.
    let m = Mounted::new(
        &src,
        &[
            "--dense",
            dense.to_str().unwrap(),
            "--cache-mb",
            "1",
            "-o",
            "chunk_kb=64",
            "--threads",
            "4",
        ],
    );
    let b: Arc<dyn Backend> = Arc::from(backend::open(&src, Some(&dense)).unwrap());
    let names: Vec<String> = b
        .tensors()
        .entries()
        .iter()
        .map(|t| t.name.dot.clone())
        .collect();
    let full: Arc<Vec<Vec<u8>>> =
        Arc::new(names.iter().map(|n| decode_bytes(b.as_ref(), n)).collect());
    let mp = m.mp.clone();
    let names = Arc::new(names);
    let deadline = Instant::now() + Duration::from_secs(4);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (full, names, mp) = (full.clone(), names.clone(), mp.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(t * 7919 + 17);
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let i = (rng.next() % names.len() as u64) as usize;
                    let f = std::fs::File::open(mp.join(format!("{}.f32", names[i]))).unwrap();
                    let len = full[i].len() as u64;
                    for _ in 0..8 {
                        let off = rng.next() % len;
                        let mut buf = vec![0u8; (rng.next() % 200_000) as usize + 1];
                        let got = f.read_at(&mut buf, off).unwrap();
                        let end = (off as usize + buf.len()).min(full[i].len());
                        assert_eq!(
                            &buf[..got],
                            &full[i][off as usize..end],
                            "{} at {off}",
                            names[i]
                        );
                        n += 1;
                    }
                }
                n
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(total > 100, "only {total} reads");
    let ctl = m.ctl();
    assert!(ctl.contains("errors 0"), "{ctl}");
    assert!(ctl.contains("capacity 1048576 B"), "{ctl}");
}
}

needs! { [fuse]
/// Truncate the source under the mount: it changed, so reads of what was
/// not decoded before fail with ESTALE (even blocks the truncation kept) and
/// are logged; what was decoded before keeps being served.
fn truncated_source_gives_estale_not_a_crash() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("model.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &copy).unwrap();
    let b = backend::open(&copy, None).unwrap();
    let mut m = Mounted::new(&copy, &[]);
    let first = "token_embd.weight";
    let last = "output.weight";
    let want_first = decode_bytes(b.as_ref(), first);
    assert_eq!(
        std::fs::read(m.path(&format!("{first}.f32"))).unwrap(),
        want_first
    );
    // Keep the first half of the file.
    let len = std::fs::metadata(&copy).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&copy)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    for t in [last, "blk.0.attn_q.weight"] {
        let err = std::fs::read(m.path(&format!("{t}.f32"))).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESTALE), "{t}: {err}");
    }
    assert!(m.try_wait_alive(), "daemon died:\n{}", m.log());
    // Still serving what it decoded before, and it says why in the log.
    assert_eq!(
        std::fs::read(m.path(&format!("{first}.f32"))).unwrap(),
        want_first
    );
    assert!(
        m.ctl().contains("errors 1") || m.ctl().contains("errors 2"),
        "{}",
        m.ctl()
    );
    assert!(
        m.log().contains("changed after it was opened"),
        "{}",
        m.log()
    );
}
}

trait Alive {
    fn try_wait_alive(&mut self) -> bool;
}
impl Alive for Mounted {
    /// The daemon has not exited (a zombie counts as exited: `try_wait`
    /// reaps it, where kill(pid, 0) would still succeed).
    fn try_wait_alive(&mut self) -> bool {
        self.try_wait().is_none()
    }
}

needs! { [fuse]
fn sigterm_sigint_and_external_unmount_exit_zero() {
    if !fuse_available() {
        return;
    }
    for how in ["SIGTERM", "SIGINT", "fusermount3", "umount"] {
        let mut m = Mounted::new(&demo_path("tiny-llama.gguf"), &[]);
        match how {
            "SIGTERM" => m.signal(libc::SIGTERM),
            "SIGINT" => m.signal(libc::SIGINT),
            "fusermount3" => assert!(
                Command::new("fusermount3")
                    .arg("-u")
                    .arg(&m.mp)
                    .status()
                    .unwrap()
                    .success()
            ),
            _ => assert!(
                Command::new("umount")
                    .arg(&m.mp)
                    .status()
                    .unwrap()
                    .success()
            ),
        }
        let st = m
            .wait_exit(10)
            .unwrap_or_else(|| panic!("{how}: daemon did not exit:\n{}", m.log()));
        assert!(st.success(), "{how}: exit {st}:\n{}", m.log());
        assert!(!is_mounted(&m.mp), "{how}: still mounted");
        // No stale "Transport endpoint is not connected".
        assert!(
            std::fs::read_dir(&m.mp).is_ok(),
            "{how}: mountpoint unusable"
        );
    }
}
}

needs! { [fuse]
fn background_mode_returns_when_live() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("m");
    std::fs::create_dir(&mp).unwrap();
    let log = dir.path().join("bg.log");
    // Unmounts and stops the daemon if an assertion below fails.
    let mut guard = MountGuard::new(&mp, None);
    let out = mount_demo_background(&mp, &log);
    let msg = String::from_utf8(out.stdout).unwrap();
    guard.set_pid(background_pid(&msg));
    assert!(
        msg.contains("serving") && msg.contains(log.to_str().unwrap()),
        "{msg}"
    );
    // Live immediately after the command returns.
    let names: Vec<_> = std::fs::read_dir(&mp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        names.iter().any(|n| n == "blk.0.attn_q.weight.f32"),
        "{names:?}"
    );
    let pid: i32 = background_pid(&msg).unwrap();
    assert!(
        Command::new("fusermount3")
            .arg("-u")
            .arg(&mp)
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    // SAFETY: signal 0 only probes the pid.
    while unsafe { libc::kill(pid, 0) } == 0 {
        assert!(Instant::now() < deadline, "daemon {pid} still running");
        std::thread::sleep(Duration::from_millis(20));
    }
    guard.exited();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("unmounted"), "{text}");
}
}

needs! { [fuse]
fn tools_work_and_writes_are_refused() {
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&demo_path("tiny-llama.gguf"), &[]);
    let mp = m.mp.to_str().unwrap();
    let sh = |cmd: &str| {
        let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
        )
    };
    let (ok, out) = sh(&format!("ls -l {mp}"));
    assert!(
        ok && out.contains("-r--r--r-- 2") && out.contains("index.json") && out.contains("ctl"),
        "{out}"
    );
    let (ok, out) = sh(&format!("du -sb {mp}"));
    assert!(ok, "{out}");
    let du: u64 = out.split_whitespace().next().unwrap().parse().unwrap();
    assert!(du >= 5_248_000, "du counts each tensor once: {du}");
    let (ok, out) = sh(&format!("find {mp} -name '*.f32' | wc -l"));
    assert!(ok && out.trim() == "42", "{out}");
    let (ok, out) = sh(&format!("stat -c '%s %h %a' {mp}/blk.0.attn_q.weight.f32"));
    assert!(ok && out.trim() == "262144 2 444", "{out}");
    let (ok, out) = sh(&format!("stat -f -c '%b %S' {mp}"));
    assert!(ok && out.trim() != "0 0", "statfs: {out}");
    let dst = m.dir.path().join("copy");
    let (ok, out) = sh(&format!(
        "cp -r {mp} {} && cmp {mp}/output.weight.f32 {}/output_weight.f32",
        dst.display(),
        dst.display()
    ));
    assert!(ok, "cp -r: {out}");
    let dst2 = m.dir.path().join("rsync");
    let (ok, out) = sh(&format!(
        "rsync -a {mp}/ {}/ && cmp {mp}/blk.1.ffn_down.weight.f32 {}/blk.1.ffn_down.weight.f32",
        dst2.display(),
        dst2.display()
    ));
    assert!(ok, "rsync -a: {out}");
    for cmd in [
        format!("touch {mp}/new"),
        format!("echo x > {mp}/blk.0.attn_q.weight.f32"),
        format!("echo x >> {mp}/index.json"),
        format!("rm {mp}/output.weight.f32"),
        format!("mkdir {mp}/d"),
        format!("mv {mp}/output.weight.f32 {mp}/o"),
        format!("ln -s x {mp}/l"),
        format!("chmod 666 {mp}/output.weight.f32"),
        format!("truncate -s 0 {mp}/output.weight.f32"),
    ] {
        let (ok, out) = sh(&cmd);
        assert!(!ok, "{cmd} must fail");
        assert!(
            out.contains("Read-only file system") || out.contains("Permission denied"),
            "{cmd}: {out}"
        );
    }
    // ctl takes commands; a bad one is EINVAL and shows up in ctl.
    let (ok, out) = sh(&format!("echo drop-cache > {mp}/ctl"));
    assert!(ok, "{out}");
    let (ok, _) = sh(&format!("echo frobnicate > {mp}/ctl"));
    assert!(!ok);
    assert!(m.ctl().contains("unknown command \"frobnicate\""));
}
}

needs! { [fuse]
/// Each bad invocation: its message, exit code 1 (2 for a usage error),
/// nothing mounted.
fn bad_usage_messages() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let empty = d.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let full = d.join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("x"), b"x").unwrap();
    let file = d.join("file");
    std::fs::write(&file, b"x").unwrap();
    let junk = d.join("junk.bin");
    std::fs::write(&junk, b"PK\x03\x04 not a model").unwrap();
    let gguf = demo_path("tiny-llama.gguf");
    let busy = Mounted::new(&gguf, &[]);
    let run_code = |args: &[&Path], env: Option<(&str, &str)>, want: &str, code: i32| {
        // Should this invocation mount after all (background mode), the
        // guard unmounts it and stops the daemon when an assertion fails; a
        // mountpoint that was already mounted (busy) is left alone.
        let mp = args[1];
        let already = is_mounted(&mp.canonicalize().unwrap_or_else(|_| mp.to_path_buf()));
        let mut c = Command::new(mount_bin());
        c.args(args);
        if let Some((k, v)) = env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        let _guard = (!already)
            .then(|| MountGuard::new(mp, background_pid(&String::from_utf8_lossy(&o.stdout))));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
    };
    let run = |args: &[&Path], env: Option<(&str, &str)>, want: &str| run_code(args, env, want, 1);
    run(&[&gguf, &d.join("missing")], None, "does not exist");
    run(&[&gguf, &file], None, "is not a directory");
    run(&[&gguf, &full], None, "is not empty");
    run(&[&gguf, &busy.mp], None, "already a mount point");
    run(&[&d.join("nope.gguf"), &empty], None, "cannot open");
    run(&[&junk, &empty], None, "bad magic");
    run(
        &[&gguf, &empty],
        Some(("RKNOT_FUSE_DEVICE", "/nonexistent/fuse")),
        "apt-get install fuse3",
    );
    run_code(
        &[&gguf, &empty, Path::new("-o"), Path::new("rw")],
        None,
        "always read-only",
        2,
    );
    assert!(
        !is_mounted(&empty.canonicalize().unwrap()),
        "nothing mounted"
    );
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    let mut s = String::new();
    std::fs::File::open(busy.path("ctl"))
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    assert!(s.contains("rknot-mount"));
}
}

needs! { [fuse]
/// The systemd unit's command line, with its EnvironmentFile, and the
/// Type=notify readiness message.
fn systemd_unit_command_line_and_notify() {
    if !fuse_available() {
        return;
    }
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("not-yet-created");
    let conf = dir.path().join("demo.conf");
    std::fs::write(
        &conf,
        format!(
            "# comment\nSOURCE={}\nMOUNTPOINT={}\nOPTIONS=--dense {} --cache-mb 32 -o fsname=demo\n",
            demo_path("tiny-llama.rknot").display(),
            mp.display(),
            demo_path("tiny-llama.gguf").display()
        ),
    )
    .unwrap();
    // What systemd does with EnvironmentFile= and `$VAR` (split on spaces).
    let env: std::collections::HashMap<String, String> = std::fs::read_to_string(&conf)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect();
    // ExecStartPre=/bin/mkdir -p ${MOUNTPOINT}
    std::fs::create_dir_all(&env["MOUNTPOINT"]).unwrap();
    let unit = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("systemd/rknot-mount@.service"),
    )
    .unwrap();
    assert!(unit.contains(
        "ExecStart=/usr/local/bin/rknot-mount --foreground $SOURCE $MOUNTPOINT $OPTIONS"
    ));
    assert!(
        unit.contains("Type=notify")
            && unit.contains("Restart=on-failure")
            && unit.contains("After=local-fs.target")
    );
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut child = Command::new(mount_bin())
        .arg("--foreground")
        .arg(&env["SOURCE"])
        .arg(&env["MOUNTPOINT"])
        .args(env["OPTIONS"].split_whitespace())
        .env("NOTIFY_SOCKET", &sock_path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Stops the daemon and unmounts if an assertion below fails.
    let mut guard = MountGuard::new(&mp, Some(child.id() as i32));
    let mut buf = [0u8; 512];
    let n = sock.recv(&mut buf).expect("READY=1 from the daemon");
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(
        msg.contains("READY=1") && msg.contains(&format!("MAINPID={}", child.id())),
        "{msg}"
    );
    // Ready means readable.
    assert!(mp.join("blk.1.ffn_up.weight.f32").exists());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(mounts.contains(" demo "), "fsname option applied");
    // systemd stops with SIGTERM: clean unmount, exit 0.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    guard.exited();
    assert!(st.success(), "{st}");
    assert!(!is_mounted(&mp.canonicalize().unwrap()));
}
}

needs! { [model, fuse]
/// Streaming a model several times larger than the cache keeps the
/// daemon's resident memory within the cache plus a small fixed overhead.
fn memory_stays_bounded_while_streaming() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let cache_mb = 16u64;
    let m = Mounted::new(&model, &["--cache-mb", &cache_mb.to_string()]);
    let mut streamed = 0u64;
    for e in std::fs::read_dir(&m.mp).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "f32") && p.to_string_lossy().contains("_weight") {
            let mut f = std::fs::File::open(&p).unwrap();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                streamed += n as u64;
            }
        }
    }
    let hwm_kb = m.peak_rss_kib();
    assert!(
        streamed > 30 * (cache_mb << 20),
        "streamed only {streamed} bytes"
    );
    let budget_kb = (cache_mb + 64) * 1024;
    assert!(
        hwm_kb <= budget_kb,
        "peak RSS {hwm_kb} KiB > cache {cache_mb} MiB + 64 MiB"
    );
    eprintln!(
        "streamed {} MiB through a {cache_mb} MiB cache; peak RSS {} MiB",
        streamed >> 20,
        hwm_kb >> 10
    );
}
}

needs! { [fuse]
/// A source that cannot serve its model (an SK32, or a compressed-only
/// .rknot, without --dense) is refused with exit 2 before anything is
/// mounted, naming what is missing and --dense; --allow-partial (or
/// -o allow_partial) mounts it anyway and says what is missing; with
/// --dense it mounts as before, without a word on stderr.
fn a_partial_model_is_refused_unless_allowed() {
    if !fuse_available() {
        return;
    }
    let (sk, rk, gguf) = (
        demo_path("tiny-llama.sk32"),
        demo_path("tiny-llama.rknot"),
        demo_path("tiny-llama.gguf"),
    );
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let log = dir.path().join("daemon.log");
    // Background mode (the default); the guard unmounts whatever did mount.
    let mount = |source: &Path, extra: &[&str]| {
        let o = Command::new(mount_bin())
            .arg(source)
            .arg(&mp)
            .arg("--log-file")
            .arg(&log)
            .args(extra)
            .output()
            .unwrap();
        let pid = background_pid(&String::from_utf8_lossy(&o.stdout));
        let guard = MountGuard::new(&mp, pid);
        (o, guard)
    };
    let (sk_names, rk_names) = (
        ["token_embd.weight", "general.architecture", "SK32"],
        ["token_embd.weight", "--compressed-only", "model.embed_tokens.weight"],
    );
    for (source, names) in [(&sk, sk_names), (&rk, rk_names)] {
        let (o, _guard) = mount(source, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{}: {err}", source.display());
        let always = ["cannot serve its model", "--dense FILE", "--allow-partial"];
        for want in names.iter().chain(&always) {
            let shown = source.display();
            assert!(err.contains(want), "{shown}: want {want:?} in {err}");
        }
        assert!(!is_mounted(&mp.canonicalize().unwrap()), "nothing mounted");
    }
    for allow in [&["--allow-partial"][..], &["-o", "allow_partial"][..]] {
        let (o, guard) = mount(&sk, allow);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{allow:?}: {err}");
        assert!(err.contains("partial model"), "{allow:?}: {err}");
        assert!(err.contains("token_embd.weight"), "{allow:?}: {err}");
        assert!(mp.join("blk.0.attn_q.weight.f32").exists());
        assert!(!mp.join("model.gguf").exists());
        drop(guard);
    }
    let (o, _guard) = mount(&sk, &["--dense", gguf.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(mp.join("model.gguf").exists());
}
}
