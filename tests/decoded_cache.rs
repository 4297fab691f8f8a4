//! The decoded-file cache (`--decoded-cache DIR`) served by FUSE
//! passthrough, through real mounts: exact bytes for every tensor file and
//! view (and by mmap), no daemon reads once stored, one decode for
//! concurrent first opens, crash safety (kill -9 mid-decode), corrupted
//! entries rebuilt, entries of a changed source evicted, eviction that
//! spares open files, and the fallback when passthrough is off.
//!
//! These tests need FUSE passthrough from the kernel (Linux >= 6.9); on a
//! kernel without it they fail with the mount's reason, never pass.

mod common;

use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::mount::{Mounted, fuse_available, mount_bin};
use common::*;
use rknot::backend;

fn dc_args(cache: &Path) -> Vec<String> {
    vec!["--decoded-cache".to_string(), cache.display().to_string()]
}

fn mount_dc(source: &Path, cache: &Path, extra: &[&str]) -> Mounted {
    let mut args = dc_args(cache);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Mounted::new(source, &args)
}

/// `ctl.json`'s `decoded_cache`, asserting passthrough is on (with the
/// mount's reason when it is not).
fn decoded(m: &Mounted) -> serde_json::Value {
    let d = m.ctl_json()["decoded_cache"].clone();
    assert!(
        d["passthrough"].as_bool() == Some(true),
        "FUSE passthrough is off on this machine: {}\n{}",
        d["passthrough_off_reason"],
        m.log()
    );
    d
}

fn n(d: &serde_json::Value, key: &str) -> u64 {
    d[key].as_u64().unwrap_or_else(|| panic!("{key} in {d}"))
}

/// Files in the cache directory whose names end with `suffix`.
fn cache_files(cache: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(cache)
        .map(|r| r.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.to_string_lossy().ends_with(suffix));
    v.sort();
    v
}

fn demo() -> (PathBuf, PathBuf) {
    (demo_path("tiny-llama.rknot"), demo_path("tiny-llama.gguf"))
}

needs! { [model, fuse]
fn every_tensor_file_and_view_is_exact_through_passthrough() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("dc");
    let m = mount_dc(&model, &dir, &[]);
    let plain = Mounted::new(&model, &[]);
    let b = backend::open(&model, None).unwrap();
    for t in b.tensors().entries() {
        let name = format!("{}.f32", t.name.dot);
        let got = std::fs::read(m.path(&name)).unwrap();
        assert!(got == decode_bytes(b.as_ref(), &t.name.dot), "{name}");
    }
    for view in ["model.gguf", "model.safetensors"] {
        let got = std::fs::read(m.path(view)).unwrap();
        let want = std::fs::read(plain.path(view)).unwrap();
        assert!(got == want, "{view} differs from the plain mount's");
        // mmap of the passthrough file.
        let f = std::fs::File::open(m.path(view)).unwrap();
        // SAFETY: a read-only private mapping of a file nobody writes.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        assert!(map[..] == want[..], "mmap of {view}");
    }
    let d = decoded(&m);
    assert_eq!(n(&d, "builds"), 272 + 2, "{d}");
    assert_eq!(n(&d, "daemon_opens"), 0, "{d}");
    assert_eq!(n(&d, "backing_files_open"), 0, "{d}");
    assert_eq!(
        m.ctl_json()["reads"]["total"].as_u64(),
        Some(0),
        "the daemon served reads: {}",
        m.ctl()
    );
    assert!(m.ctl().contains("passthrough on"), "{}", m.ctl());
    // Entries are private to the daemon's user.
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    for p in cache_files(&dir, "") {
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", p.display());
    }
}
}

needs! { [fuse]
fn a_layered_rknot_is_served_exactly_and_reused_after_a_remount() {
    if !fuse_available() {
        return;
    }
    let (rknot, gguf) = demo();
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("dc");
    let b = backend::open(&rknot, Some(&gguf)).unwrap();
    let args = ["--dense", gguf.to_str().unwrap(), "--views", "f16,bf16"];
    let plain = Mounted::new(&rknot, &args);
    // Every element format: the views and one tensor's half-precision files.
    let others = [
        "model.gguf",
        "model.safetensors",
        "model.f16.safetensors",
        "model.bf16.safetensors",
        "blk.0.attn_q.weight.f16",
        "blk.0.attn_q.weight.bf16",
    ];
    let want: Vec<Vec<u8>> = others
        .iter()
        .map(|v| std::fs::read(plain.path(v)).unwrap())
        .collect();
    for round in 0..2 {
        let m = mount_dc(&rknot, &dir, &args);
        for t in b.tensors().entries().iter().filter(|t| t.is_available()) {
            let got = std::fs::read(m.path(&format!("{}.f32", t.name.dot))).unwrap();
            assert!(
                got == decode_bytes(b.as_ref(), &t.name.dot),
                "{}",
                t.name.dot
            );
        }
        for (v, want) in others.iter().zip(&want) {
            assert!(std::fs::read(m.path(v)).unwrap() == *want, "{v}");
        }
        let d = decoded(&m);
        if round == 0 {
            assert_eq!(n(&d, "hits"), 0, "{d}");
        } else {
            // The remount uses every entry, checked once each.
            assert_eq!((n(&d, "builds"), n(&d, "misses")), (0, 0), "{d}");
            assert_eq!(n(&d, "checks"), n(&d, "hits"), "{d}");
        }
        assert_eq!(m.ctl_json()["reads"]["total"].as_u64(), Some(0));
    }
}
}

needs! { [model, fuse]
/// Several processes open the same view at once while its first decode
/// runs: one decode, the same bytes for all.
fn concurrent_first_opens_wait_for_one_decode() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let m = mount_dc(&model, &cache.path().join("dc"), &[]);
    let view = m.path("model.gguf");
    let mut readers = Vec::new();
    for i in 0..4 {
        readers.push(
            Command::new("sha256sum")
                .arg(&view)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        // The later ones open while the first one's decode runs (it takes
        // hundreds of milliseconds for SmolLM2's 540 MB view).
        if i == 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let sums: Vec<String> = readers
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success());
            String::from_utf8(o.stdout).unwrap()[..64].to_string()
        })
        .collect();
    assert!(sums.iter().all(|s| *s == sums[0]), "{sums:?}");
    let want = sha256_hex(&std::fs::read(Mounted::new(&model, &[]).path("model.gguf")).unwrap());
    assert_eq!(sums[0], want);
    let d = decoded(&m);
    assert_eq!(n(&d, "builds"), 1, "{d}");
    assert_eq!(n(&d, "passthrough_opens"), 4, "{d}");
}
}

needs! { [model, fuse]
/// kill -9 of the daemon while it decodes into the cache: the next mount
/// never serves the partial file, removes it, and serves correct bytes.
fn kill_9_during_a_decode_leaves_nothing_that_is_served() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("dc");
    let mut m = mount_dc(&model, &dir, &[]);
    let mut reader = Command::new("cat")
        .arg(m.path("model.gguf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while cache_files(&dir, ".data").iter().all(|p| {
        !p.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".tmp.")
    }) {
        assert!(Instant::now() < deadline, "no decode started");
        std::thread::sleep(Duration::from_millis(1));
    }
    m.signal(libc::SIGKILL);
    m.wait_exit(10).expect("daemon killed");
    let _ = Command::new("fusermount3").arg("-uz").arg(&m.mp).status();
    let _ = reader.wait();
    assert!(
        cache_files(&dir, ".meta").is_empty(),
        "an entry was completed"
    );
    let want = std::fs::read(Mounted::new(&model, &[]).path("model.gguf")).unwrap();
    let m2 = mount_dc(&model, &dir, &[]);
    assert!(std::fs::read(m2.path("model.gguf")).unwrap() == want);
    let d = decoded(&m2);
    assert_eq!((n(&d, "builds"), n(&d, "hits")), (1, 0), "{d}");
    let left: Vec<PathBuf> = cache_files(&dir, "")
        .into_iter()
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".tmp.")
        })
        .collect();
    assert!(left.is_empty(), "temporaries left: {left:?}");
    assert!(
        m2.log().contains("left by a process that is gone"),
        "{}",
        m2.log()
    );
}
}

needs! { [fuse]
fn a_corrupted_entry_is_detected_and_rebuilt() {
    if !fuse_available() {
        return;
    }
    let (_, gguf) = demo();
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("dc");
    let b = backend::open(&gguf, None).unwrap();
    let name = "blk.0.attn_q.weight";
    let want = decode_bytes(b.as_ref(), name);
    {
        let m = mount_dc(&gguf, &dir, &[]);
        assert!(std::fs::read(m.path(&format!("{name}.f32"))).unwrap() == want);
    }
    let data = cache_files(&dir, ".data");
    assert_eq!(data.len(), 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&data[0])
        .unwrap();
    f.write_all_at(&[0x5a], 100).unwrap();
    drop(f);
    let m = mount_dc(&gguf, &dir, &[]);
    assert!(std::fs::read(m.path(&format!("{name}.f32"))).unwrap() == want);
    let d = decoded(&m);
    assert_eq!((n(&d, "bad_entries"), n(&d, "builds")), (1, 1), "{d}");
    assert!(m.log().contains("is bad (CRC-32"), "{}", m.log());
}
}

needs! { [fuse]
fn entries_of_a_changed_source_are_not_used_and_are_evicted() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("model.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &src).unwrap();
    let dir = tmp.path().join("dc");
    let name = "blk.0.attn_q.weight.f32";
    let first = {
        let m = mount_dc(&src, &dir, &[]);
        std::fs::read(m.path(name)).unwrap()
    };
    assert_eq!(cache_files(&dir, ".data").len(), 1);
    let old = cache_files(&dir, ".data");
    // Rewrite in place: same bytes but a new mtime is a new version.
    let bytes = std::fs::read(&src).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&src, &bytes).unwrap();
    let m = mount_dc(&src, &dir, &[]);
    assert!(m.log().contains("changed since"), "{}", m.log());
    assert!(!old[0].exists(), "the old version's entry is still there");
    assert!(std::fs::read(m.path(name)).unwrap() == first);
    let d = decoded(&m);
    assert_eq!((n(&d, "builds"), n(&d, "hits")), (1, 0), "{d}");
}
}

needs! { [fuse]
/// Under a limit that holds one of two files: the open one is kept (the
/// other is served by the daemon meanwhile), and evicted once closed.
fn eviction_never_removes_an_open_file() {
    if !fuse_available() {
        return;
    }
    let (_, gguf) = demo();
    let b = backend::open(&gguf, None).unwrap();
    // The two largest tensors; a limit that holds the larger, not both.
    let mut ts: Vec<(u64, String)> = b
        .tensors()
        .entries()
        .iter()
        .map(|t| (t.n_elements * 4, t.name.dot.clone()))
        .collect();
    ts.sort();
    let (small, large) = (&ts[ts.len() - 2], &ts[ts.len() - 1]);
    let limit_gb = format!("{}", (large.0 + small.0 / 2) as f64 / 1e9);
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("dc");
    let m = mount_dc(&gguf, &dir, &["--decoded-cache-gb", &limit_gb]);
    let (a, c) = (
        m.path(&format!("{}.f32", small.1)),
        m.path(&format!("{}.f32", large.1)),
    );
    let held = std::fs::File::open(&a).unwrap();
    let mut buf = vec![0u8; small.0 as usize];
    held.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf == decode_bytes(b.as_ref(), &small.1));
    // No room for the large one while the small one is open.
    assert!(std::fs::read(&c).unwrap() == decode_bytes(b.as_ref(), &large.1));
    let d = decoded(&m);
    assert_eq!((n(&d, "evictions"), n(&d, "daemon_opens")), (0, 1), "{d}");
    held.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf == decode_bytes(b.as_ref(), &small.1));
    drop(held);
    // Closed: it makes room now.
    assert!(std::fs::read(&c).unwrap() == decode_bytes(b.as_ref(), &large.1));
    let d = decoded(&m);
    assert_eq!((n(&d, "evictions"), n(&d, "entries")), (1, 1), "{d}");
    assert!(n(&d, "bytes") <= n(&d, "limit"), "{d}");
}
}

needs! { [fuse]
/// `--no-passthrough` (as on a kernel or user without passthrough): the
/// mount serves as without a store and says so once.
fn without_passthrough_files_are_served_by_the_daemon_and_it_says_so_once() {
    if !fuse_available() {
        return;
    }
    let (rknot, gguf) = demo();
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("dc");
    let dense = gguf.to_str().unwrap();
    let m = mount_dc(&rknot, &dir, &["--dense", dense, "--no-passthrough"]);
    let plain = Mounted::new(&rknot, &["--dense", dense]);
    for v in ["model.gguf", "model.safetensors", "blk.0.attn_q.weight.f32"] {
        for _ in 0..2 {
            assert!(std::fs::read(m.path(v)).unwrap() == std::fs::read(plain.path(v)).unwrap());
        }
    }
    let d = m.ctl_json()["decoded_cache"].clone();
    assert_eq!(d["passthrough"], false, "{d}");
    assert!(
        d["passthrough_off_reason"]
            .as_str()
            .unwrap()
            .contains("--no-passthrough")
    );
    assert_eq!((n(&d, "builds"), n(&d, "passthrough_opens")), (0, 0), "{d}");
    assert!(m.ctl_json()["reads"]["total"].as_u64().unwrap() > 0);
    assert_eq!(
        m.log().matches("FUSE passthrough is off").count(),
        1,
        "{}",
        m.log()
    );
    assert!(cache_files(&dir, ".data").is_empty());
}
}

needs! { [fuse]
fn an_unsafe_cache_directory_refuses_the_mount() {
    if !fuse_available() {
        return;
    }
    let (_, gguf) = demo();
    let tmp = tempfile::tempdir().unwrap();
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mp = tmp.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let o = Command::new(mount_bin())
        .arg(&gguf)
        .arg(&mp)
        .arg("-o")
        .arg(format!("decoded_cache={}", open.display()))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("mode 777") && err.contains("--decoded-cache"),
        "{err}"
    );
    // A size without a directory, or a nonsense size: usage errors.
    for args in [
        vec!["--decoded-cache-gb", "1"],
        vec!["--decoded-cache", "/x", "--decoded-cache-gb", "0"],
        vec!["-o", "decoded_cache=/x,decoded_cache_gb=-1"],
    ] {
        let o = Command::new(mount_bin())
            .arg(&gguf)
            .arg(&mp)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
}

needs! { [fuse]
/// A plain SHA256SUMS under unverified=allow may find a file bad after its
/// bytes were served: nothing is stored in the cache for such a mount.
fn whole_file_manifests_under_unverified_allow_turn_passthrough_off() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("m.gguf");
    std::fs::copy(demo_path("tiny-llama.gguf"), &src).unwrap();
    let sums = tmp.path().join("SHA256SUMS");
    let digest = sha256_hex(&std::fs::read(&src).unwrap());
    std::fs::write(&sums, format!("{digest}  m.gguf\n")).unwrap();
    let dir = tmp.path().join("dc");
    let m = mount_dc(
        &src,
        &dir,
        &[
            "--manifest",
            sums.to_str().unwrap(),
            "-o",
            "unverified=allow",
        ],
    );
    let plain = Mounted::new(&src, &[]);
    let v = "model.safetensors";
    assert!(std::fs::read(m.path(v)).unwrap() == std::fs::read(plain.path(v)).unwrap());
    let d = m.ctl_json()["decoded_cache"].clone();
    assert_eq!(d["passthrough"], false, "{d}");
    assert!(
        d["passthrough_off_reason"]
            .as_str()
            .unwrap()
            .contains("unverified=allow"),
        "{d}"
    );
    assert!(cache_files(&dir, ".data").is_empty());
}
}
