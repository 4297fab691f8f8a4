//! Manifests (issue 15): `rknot manifest`, `rknot-mount --manifest`, and
//! `rknot verify --manifest`, on copies of the demo model (a GGUF, and an
//! SK32 layered over it). The FUSE tests need root and fuse3 (with
//! `RKNOT_REQUIRE_FUSE=1` a machine that cannot mount fails them).

mod common;

use std::ops::Range;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mount::{MountGuard, Mounted, background_pid, fuse_available, is_mounted, mount_bin};
use common::*;
use rknot::ErrorKind;
use rknot::backend::{Backend, Role, open_single};
use rknot::integrity::manifest::{self, Manifest, Subject, Unverified, open_verified};
use sha2::{Digest as _, Sha256};

const GGUF: &str = "tiny-llama.gguf";
const SK32: &str = "tiny-llama.sk32";
/// A Q4_K tensor of the demo GGUF (a flipped bit in its quants decodes to
/// other finite values: only the manifest can tell).
const VICTIM: &str = "blk.0.attn_q.weight";
const BYSTANDER: &str = "blk.1.ffn_down.weight";

/// Copies of demo files in a fresh directory.
fn demo_copies(names: &[&str]) -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().unwrap();
    let paths = names
        .iter()
        .map(|n| {
            let p = dir.path().join(n);
            std::fs::copy(demo_path(n), &p).unwrap();
            p
        })
        .collect();
    (dir, paths)
}

fn sha(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Each tensor's stored ranges in `path` opened on its own, by dot name.
fn stored(path: &Path) -> Vec<(String, Vec<Range<u64>>)> {
    let b = open_single(path, Role::Primary).unwrap();
    (0..b.tensors().len())
        .filter_map(|i| {
            let r = b.stored_ranges(i)?;
            Some((b.tensors().entries()[i].name.dot.clone(), r.ranges))
        })
        .collect()
}

/// The manifest lines for `path`, computed here from the bytes (sha2 over
/// the ranges, the header by a byte mask).
fn independent_lines(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    let base = path.file_name().unwrap().to_str().unwrap();
    let tensors = stored(path);
    let mut covered = vec![false; bytes.len()];
    for r in tensors.iter().flat_map(|(_, rs)| rs) {
        covered[r.start as usize..r.end as usize].fill(true);
    }
    let header: Vec<u8> = bytes
        .iter()
        .zip(&covered)
        .filter(|(_, c)| !**c)
        .map(|(b, _)| *b)
        .collect();
    let mut out = format!("{}  {base}\n", sha(&[&bytes]));
    out += &format!("#rknot {}  {base}//header\n", sha(&[&header]));
    for (name, ranges) in &tensors {
        let parts: Vec<&[u8]> = ranges
            .iter()
            .map(|r| &bytes[r.start as usize..r.end as usize])
            .collect();
        out += &format!("#rknot {}  {base}//tensor/{name}\n", sha(&parts));
    }
    out
}

fn rknot(args: &[&Path]) -> Output {
    Command::new(rknot_bin()).args(args).output().unwrap()
}

fn p(s: &str) -> &Path {
    Path::new(s)
}

/// `rknot manifest FILE [--dense D] -o OUT`, which must succeed.
fn make_manifest(file: &Path, dense: Option<&Path>, out: &Path) {
    let mut args = vec![p("manifest"), file];
    if let Some(d) = dense {
        args.extend([p("--dense"), d]);
    }
    args.extend([p("-o"), out]);
    let o = rknot(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// XOR one byte of `path` at `offset`.
fn flip(path: &Path, offset: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset as usize] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

/// A byte inside `tensor`'s stored bytes (past a Q4_K block's scales).
fn tensor_byte(path: &Path, tensor: &str) -> u64 {
    let (_, ranges) = stored(path).into_iter().find(|(n, _)| n == tensor).unwrap();
    ranges[0].start + 20
}

/// A byte of the header: inside the `general.name` metadata string.
fn header_byte(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(b"rknot tiny demo".len())
        .position(|w| w == b"rknot tiny demo")
        .unwrap();
    (at + 6) as u64
}

/// Whether the real `sha256sum` is here (a note otherwise).
fn have_sha256sum() -> bool {
    let ok = Command::new("sha256sum").arg("--version").output().is_ok();
    if !ok {
        eprintln!("NOTE: sha256sum not found; skipping the stock-tool check");
    }
    ok
}

/// `sha256sum -c ARGS` in `dir`.
fn sha256sum_check(dir: &Path, args: &[&str]) -> Output {
    Command::new("sha256sum")
        .current_dir(dir)
        .arg("-c")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn manifest_checks_with_sha256sum_and_equals_independent_digests() {
    let (dir, files) = demo_copies(&[SK32, GGUF]);
    let (sk, gguf) = (&files[0], &files[1]);
    // The manifest gets no more permission bits than its sources.
    std::fs::set_permissions(gguf, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = dir.path().join("m.sums");
    make_manifest(sk, Some(gguf), &out);
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(text, independent_lines(sk) + &independent_lines(gguf));
    // The SK32 lists its vocab sketch too, which the layered mount shadows.
    assert!(
        text.contains("tiny-llama.sk32//tensor/token_embd.weight"),
        "{text}"
    );
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & !0o640, 0, "mode {mode:o}");
    if have_sha256sum() {
        for args in [
            &["m.sums"][..],
            &["--ignore-missing", "m.sums"],
            &["--strict", "m.sums"],
        ] {
            let o = sha256sum_check(dir.path(), args);
            let said = String::from_utf8_lossy(&o.stdout);
            assert!(
                o.status.success(),
                "sha256sum -c {args:?}: {said}{}",
                String::from_utf8_lossy(&o.stderr)
            );
            assert_eq!(said, "tiny-llama.sk32: OK\ntiny-llama.gguf: OK\n");
        }
        // ...and it catches a changed file.
        flip(gguf, tensor_byte(gguf, VICTIM));
        let o = sha256sum_check(dir.path(), &["m.sums"]);
        assert!(!o.status.success());
        assert!(String::from_utf8_lossy(&o.stdout).contains("tiny-llama.gguf: FAILED"));
    }
}

#[test]
fn manifest_refuses_to_overwrite_without_force() {
    let (dir, files) = demo_copies(&[GGUF]);
    let out = dir.path().join("m.sums");
    std::fs::write(&out, "keep me\n").unwrap();
    let o = rknot(&[p("manifest"), &files[0], p("-o"), &out]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--force"));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "keep me\n");
    let o = rknot(&[p("manifest"), &files[0], p("-o"), &out, p("--force")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        independent_lines(&files[0])
    );
    // Never over its own input, --force or not; no temporary left behind.
    let o = rknot(&[p("manifest"), &files[0], p("-o"), &files[0], p("--force")]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        std::fs::read(&files[0]).unwrap(),
        std::fs::read(demo_path(GGUF)).unwrap()
    );
    let mut names = listing(dir.path());
    names.sort();
    assert_eq!(names, ["m.sums", GGUF]);
}

#[test]
fn manifest_escapes_odd_names_as_gnu_does() {
    let dir = tempfile::tempdir().unwrap();
    let odd = "odd\\name\nwith\rbreaks.gguf";
    let model = dir.path().join(odd);
    std::fs::copy(demo_path(GGUF), &model).unwrap();
    let out = dir.path().join("m.sums");
    make_manifest(&model, None, &out);
    let text = std::fs::read(&out).unwrap();
    let lines: Vec<&[u8]> = text
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines.len(), 2 + stored(&model).len());
    assert!(
        lines[0].starts_with(b"\\"),
        "{}",
        String::from_utf8_lossy(lines[0])
    );
    assert!(lines[0].ends_with(b"  odd\\\\name\\nwith\\rbreaks.gguf"));
    assert!(lines[1].starts_with(b"#rknot \\"));
    assert!(lines[1].ends_with(b"  odd\\\\name\\nwith\\rbreaks.gguf//header"));
    let m = Manifest::read(&out).unwrap();
    let f = m.for_file(odd.as_bytes());
    assert!(f.whole.is_some() && f.header.is_some());
    assert_eq!(f.tensors.len(), stored(&model).len());
    if have_sha256sum() {
        // What GNU sha256sum writes for the name, and reads back.
        let o = Command::new("sha256sum")
            .current_dir(dir.path())
            .arg(odd)
            .output()
            .unwrap();
        assert_eq!(o.stdout, [lines[0], b"\n"].concat());
        let o = sha256sum_check(dir.path(), &["--strict", "m.sums"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let found =
        manifest::check_paths(&[model.as_path()], &m, &rknot::progress::Meter::hidden()).unwrap();
    assert!(found.is_empty(), "{found:?}");
}

/// In process: a flipped byte in one tensor fails only that tensor's
/// decodes, once hashed however many threads ask at once; the others serve.
#[test]
fn flipped_tensor_fails_alone_and_is_hashed_once() {
    let (dir, files) = demo_copies(&[GGUF]);
    let gguf = &files[0];
    let sums = dir.path().join("m.sums");
    make_manifest(gguf, None, &sums);
    let clean = open_single(&demo_path(GGUF), Role::Primary).unwrap();
    flip(gguf, tensor_byte(gguf, VICTIM));
    let (b, integrity) = open_verified(gguf, None, &sums, Unverified::Hold).unwrap();
    let (victim, bystander) = (b.find(VICTIM).unwrap(), b.find(BYSTANDER).unwrap());
    let n = b.tensors().entries()[bystander].n_elements as usize;
    type Outcome = (Result<(), ErrorKind>, Result<Vec<f32>, ErrorKind>);
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let b = b.clone();
                s.spawn(move || {
                    let mut v = vec![0f32; 256];
                    let bad = b.read_f32(victim, 0, &mut v).map_err(|e| e.kind());
                    let mut w = vec![0f32; n];
                    let good = b.read_f32(bystander, 0, &mut w).map(|_| w);
                    (bad, good.map_err(|e| e.kind()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want = decode_bytes(clean.as_ref(), BYSTANDER);
    for (bad, good) in results {
        assert_eq!(bad, Err(ErrorKind::Checksum));
        assert_eq!(f32_le_bytes(&good.unwrap()), want);
    }
    // Each tensor hashed once: one failure, one verification.
    assert_eq!(integrity.tensor_counts(), (1, 1));
    let e = b.read_f32(victim, 0, &mut [0f32; 4]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(VICTIM) && msg.contains("m.sums"), "{msg}");
    assert_eq!(e.errno(), libc::EIO);
    assert!(
        integrity
            .status_text()
            .contains(&format!("failed tensor {VICTIM}"))
    );
}

/// In process: what must not mount is refused before anything is served.
#[test]
fn header_flips_and_foreign_manifests_are_refused() {
    let (dir, files) = demo_copies(&[GGUF, SK32]);
    let (gguf, sk) = (&files[0], &files[1]);
    let sums = dir.path().join("m.sums");
    make_manifest(sk, Some(gguf), &sums);
    let refused = |source: &Path, dense: Option<&Path>, sums: &Path| match open_verified(
        source,
        dense,
        sums,
        Unverified::Hold,
    ) {
        Ok(_) => panic!("mounted {source:?} against {sums:?}"),
        Err(e) => e,
    };
    // The layered pair itself is fine.
    open_verified(sk, Some(gguf), &sums, Unverified::Hold).unwrap();
    // A manifest that does not list the fallback.
    let only_sk = dir.path().join("sk.sums");
    make_manifest(sk, None, &only_sk);
    let e = refused(sk, Some(gguf), &only_sk);
    assert!(
        e.to_string().contains("no line for this file's name"),
        "{e}"
    );
    // Another model's manifest under the same basename: header differs.
    let other_dir = tempfile::tempdir().unwrap();
    let other = other_dir.path().join(GGUF);
    std::fs::copy(demo_path("tiny-llama.knot"), &other).unwrap();
    let other_sums = other_dir.path().join("other.sums");
    make_manifest(&other, None, &other_sums);
    let e = refused(gguf, None, &other_sums);
    assert_eq!(e.kind(), ErrorKind::Checksum);
    assert!(e.to_string().contains("header sha256"), "{e}");
    // A flipped header byte.
    flip(gguf, header_byte(gguf));
    let e = refused(sk, Some(gguf), &sums);
    assert_eq!(e.kind(), ErrorKind::Checksum);
    let msg = e.to_string();
    assert!(
        msg.contains("tiny-llama.gguf: header sha256") && msg.contains("m.sums"),
        "{msg}"
    );
    // A tensor the manifest lacks (an added tensor) is refused too.
    let text = std::fs::read_to_string(&only_sk).unwrap();
    let cut: String = text
        .lines()
        .filter(|l| !l.ends_with("//tensor/blk.1.attn_k.weight"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&only_sk, cut).unwrap();
    let e = refused(sk, None, &only_sk);
    assert!(
        e.to_string().contains("the manifest has no line for it"),
        "{e}"
    );
}

#[test]
fn verify_names_the_flipped_tensor() {
    let (dir, files) = demo_copies(&[GGUF]);
    let gguf = &files[0];
    let sums = dir.path().join("m.sums");
    make_manifest(gguf, None, &sums);
    let o = rknot(&[p("verify"), gguf, p("--manifest"), &sums]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("every listed digest matches"));
    flip(gguf, tensor_byte(gguf, VICTIM));
    let o = rknot(&[p("verify"), gguf, p("--manifest"), &sums]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        out.contains(&format!(
            "MISMATCH   {}: tensor {VICTIM}: sha256",
            gguf.display()
        )),
        "{out}"
    );
    // Only that tensor and the whole file differ.
    assert_eq!(out.matches("MISMATCH").count(), 2, "{out}");
    assert!(
        err.contains("2 mismatch(es)") && err.contains(VICTIM),
        "{err}"
    );
    let o = rknot(&[p("verify"), gguf, p("--manifest"), &sums, p("--json")]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = &v["manifest"]["mismatches"];
    assert!(
        m.as_array()
            .unwrap()
            .iter()
            .any(|x| x["tensor"] == VICTIM && x["problem"] == "differs"),
        "{m}"
    );
    // The library function the command calls, directly.
    let found = manifest::check_paths(
        &[gguf.as_path()],
        &Manifest::read(&sums).unwrap(),
        &rknot::progress::Meter::hidden(),
    )
    .unwrap();
    let subjects: Vec<&Subject> = found.iter().map(|x| &x.subject).collect();
    assert_eq!(subjects, [&Subject::Whole, &Subject::Tensor(VICTIM.into())]);
}

/// Every tensor file of a mount, by name.
fn read_all(m: &Mounted, b: &dyn Backend) -> Vec<(String, std::io::Result<Vec<u8>>)> {
    b.tensors()
        .entries()
        .iter()
        .filter(|t| t.is_available())
        .map(|t| {
            let name = t.name.dot.clone();
            let r = std::fs::read(m.path(&format!("{name}.f32")));
            (name, r)
        })
        .collect()
}

needs! { [fuse]
fn mount_with_manifest_serves_the_same_bytes() {
    if !fuse_available() {
        return;
    }
    let (dir, files) = demo_copies(&[SK32, GGUF]);
    let (sk, gguf) = (&files[0], &files[1]);
    let sums = dir.path().join("m.sums");
    make_manifest(sk, Some(gguf), &sums);
    let dense = gguf.to_str().unwrap();
    let plain = Mounted::new(sk, &["--dense", dense]);
    let checked = Mounted::new(
        sk,
        &["--dense", dense, "--manifest", sums.to_str().unwrap()],
    );
    let b = rknot::backend::open(sk, Some(gguf)).unwrap();
    let (a, c) = (read_all(&plain, b.as_ref()), read_all(&checked, b.as_ref()));
    assert!(!a.is_empty());
    for ((name, x), (_, y)) in a.iter().zip(&c) {
        assert_eq!(x.as_ref().unwrap(), y.as_ref().unwrap(), "{name}");
    }
    // The views too.
    assert_eq!(
        std::fs::read(plain.path("model.gguf")).unwrap(),
        std::fs::read(checked.path("model.gguf")).unwrap()
    );
    let ctl = checked.ctl();
    let n = a.len();
    assert!(
        ctl.contains(&format!("integrity: tensors verified {n}, failed 0")),
        "{ctl}"
    );
    let j = checked.ctl_json();
    assert_eq!(j["integrity"]["tensors_verified"], n);
    assert_eq!(j["integrity"]["files"].as_array().unwrap().len(), 2);
    assert!(
        checked.log().contains("header verified at mount"),
        "{}",
        checked.log()
    );
    // Through -o as well.
    let via_o = Mounted::new(gguf, &["-o", &format!("manifest={}", sums.display())]);
    assert!(
        via_o.ctl().contains("integrity: manifest"),
        "{}",
        via_o.ctl()
    );
}
}

needs! { [fuse]
fn mount_fails_only_the_flipped_tensor() {
    if !fuse_available() {
        return;
    }
    let (dir, files) = demo_copies(&[GGUF]);
    let gguf = &files[0];
    let sums = dir.path().join("m.sums");
    make_manifest(gguf, None, &sums);
    let want = decode_bytes(
        open_single(gguf, Role::Primary).unwrap().as_ref(),
        BYSTANDER,
    );
    flip(gguf, tensor_byte(gguf, VICTIM));
    let mut m = Mounted::new(gguf, &["--manifest", sums.to_str().unwrap()]);
    for _ in 0..3 {
        let e = std::fs::read(m.path(&format!("{VICTIM}.f32")))
            .map(|v| v.len())
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    }
    assert_eq!(
        std::fs::read(m.path(&format!("{BYSTANDER}.f32"))).unwrap(),
        want
    );
    assert!(m.try_wait().is_none(), "daemon died:\n{}", m.log());
    let ctl = m.ctl();
    assert!(
        ctl.contains("integrity: tensors verified 1, failed 1"),
        "{ctl}"
    );
    assert!(ctl.contains(&format!("failed tensor {VICTIM}")), "{ctl}");
    // The engine view fails where it reaches the tensor (what it reads on
    // the way is verified then).
    assert!(std::fs::read(m.path("model.gguf")).is_err());
    let j = m.ctl_json();
    assert_eq!(j["integrity"]["tensors_failed"], 1);
    assert_eq!(j["integrity"]["files"][0]["failed_tensors"][0], VICTIM);
    let log = m.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("differ") && l.contains(VICTIM))
        .collect();
    assert!(!lines.is_empty(), "{log}");
    assert!(lines.iter().all(|l| l.contains("m.sums")), "{log}");
    // Rate-limited: one line when it was found bad, one for the three reads
    // of its file (and one each for the view and read-ahead).
    let count = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(count("which differs from manifest"), 1, "{log}");
    assert_eq!(count(&format!("of {VICTIM}.f32")), 1, "{log}");
}
}

/// `rknot-mount` in the background with `args`; must fail with `want`.
fn mount_refused(source: &Path, args: &[&str], want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mp = dir.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let o = Command::new(mount_bin())
        .arg(source)
        .arg(&mp)
        .args(args)
        .arg("--log-file")
        .arg(dir.path().join("log"))
        .output()
        .unwrap();
    let _guard = MountGuard::new(&mp, background_pid(&String::from_utf8_lossy(&o.stdout)));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains(want), "want {want:?} in {err}");
    assert!(!is_mounted(&mp.canonicalize().unwrap()));
}

needs! { [fuse]
fn mount_refuses_header_flips_and_foreign_manifests() {
    if !fuse_available() {
        return;
    }
    let (dir, files) = demo_copies(&[GGUF, SK32]);
    let (gguf, sk) = (&files[0], &files[1]);
    let sums = dir.path().join("m.sums");
    make_manifest(gguf, None, &sums);
    let sums_arg = sums.to_str().unwrap();
    // Another model: the SK32's manifest does not list the GGUF.
    let sk_sums = dir.path().join("sk.sums");
    make_manifest(sk, None, &sk_sums);
    mount_refused(
        gguf,
        &["--manifest", sk_sums.to_str().unwrap()],
        "no line for this file's name",
    );
    // A layered mount whose fallback the manifest lacks.
    mount_refused(
        sk,
        &[
            "--dense",
            gguf.to_str().unwrap(),
            "--manifest",
            sk_sums.to_str().unwrap(),
        ],
        "tiny-llama.gguf: the manifest has no line",
    );
    // A missing or malformed manifest.
    mount_refused(
        gguf,
        &["--manifest", "/nonexistent.sums"],
        "cannot open manifest",
    );
    let junk = dir.path().join("junk.sums");
    std::fs::write(&junk, "hello world\n").unwrap();
    mount_refused(
        gguf,
        &["-o", &format!("manifest={}", junk.display())],
        "junk.sums: line 1: expected a SHA-256 line",
    );
    // A flipped header byte.
    flip(gguf, header_byte(gguf));
    mount_refused(gguf, &["--manifest", sums_arg], "header sha256");
}
}

/// A plain SHA256SUMS line for `path` (what `sha256sum` writes).
fn plain_sums(path: &Path, out: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let name = path.file_name().unwrap().to_str().unwrap();
    std::fs::write(out, format!("{}  {name}\n", sha(&[&bytes]))).unwrap();
}

/// Poll ctl.json until the whole-file check of the first file is `state`.
fn wait_whole(m: &Mounted, state: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let j = m.ctl_json();
        let f = j["integrity"]["files"][0].clone();
        if f["state"] == state {
            return f;
        }
        assert!(Instant::now() < deadline, "still {f} (want {state})");
        std::thread::sleep(Duration::from_millis(20));
    }
}

needs! { [fuse]
fn plain_sha256sums_good_file_serves_after_verification() {
    if !fuse_available() {
        return;
    }
    let (dir, files) = demo_copies(&[GGUF]);
    let gguf = &files[0];
    let sums = dir.path().join("SHA256SUMS");
    plain_sums(gguf, &sums);
    let b = open_single(gguf, Role::Primary).unwrap();
    for mode in ["hold", "allow"] {
        let m = Mounted::new(
            gguf,
            &[
                "--manifest",
                sums.to_str().unwrap(),
                "-o",
                &format!("unverified={mode}"),
            ],
        );
        for (name, r) in read_all(&m, b.as_ref()) {
            assert_eq!(r.unwrap(), decode_bytes(b.as_ref(), &name), "{name}");
        }
        let f = wait_whole(&m, "verified");
        let size = std::fs::metadata(gguf).unwrap().len();
        assert_eq!(
            (f["bytes_hashed"].as_u64(), f["bytes_total"].as_u64()),
            (Some(size), Some(size))
        );
        assert!(m.ctl().contains("whole file verified"), "{}", m.ctl());
        assert!(m.log().contains("whole-file sha256 matches"), "{}", m.log());
    }
}
}

/// A copy of the demo GGUF followed by `extra` bytes of zeros (a hole: no
/// disk), so its whole-file check takes a while; its SHA256SUMS; and the
/// copy with a flipped byte in VICTIM.
fn slow_bad_file(extra: u64) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (dir, files) = demo_copies(&[GGUF]);
    let gguf = files[0].clone();
    let f = std::fs::OpenOptions::new().write(true).open(&gguf).unwrap();
    f.set_len(f.metadata().unwrap().len() + extra).unwrap();
    drop(f);
    let sums = dir.path().join("SHA256SUMS");
    let src = rknot::source::SourceFile::open(&gguf).unwrap();
    let d = manifest::digest_whole(&src, manifest::READ_PIECE, &|_| {}).unwrap();
    std::fs::write(
        &sums,
        manifest::entry_line(GGUF.as_bytes(), &Subject::Whole, &d),
    )
    .unwrap();
    drop(src);
    flip(&gguf, tensor_byte(&gguf, VICTIM));
    (dir, gguf, sums)
}

needs! { [fuse]
fn plain_sha256sums_bad_file_hold_fails_reads_and_ctl_answers_meanwhile() {
    if !fuse_available() {
        return;
    }
    let (_dir, gguf, sums) = slow_bad_file(3 << 30);
    // Two FUSE threads and four held readers: ctl must still answer.
    let m = Arc::new(Mounted::new(
        &gguf,
        &["--manifest", sums.to_str().unwrap(), "--threads", "2"],
    ));
    let readers: Vec<_> = [
        VICTIM,
        BYSTANDER,
        "output_norm.weight",
        "blk.1.attn_v.weight",
    ]
    .into_iter()
    .map(|t| {
        let m = m.clone();
        std::thread::spawn(move || std::fs::read(m.path(&format!("{t}.f32"))))
    })
    .collect();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let f = m.ctl_json()["integrity"]["files"][0].clone();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "ctl took {:?}",
        t0.elapsed()
    );
    assert_eq!(f["state"], "verifying", "{f}");
    assert!(m.ctl().contains("whole file verifying"), "{}", m.ctl());
    for r in readers {
        let e = r.join().unwrap().map(|v| v.len()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    }
    let f = wait_whole(&m, "failed");
    assert!(
        f["error"]
            .as_str()
            .unwrap()
            .contains("differs from the manifest"),
        "{f}"
    );
    let e = std::fs::read(m.path(&format!("{BYSTANDER}.f32")))
        .map(|v| v.len())
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO));
    // One ERROR line for the failed check (reads log their own, limited).
    let log = m.log();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("ERROR") && l.contains("every read of its tensors fails"))
            .count(),
        1,
        "{log}"
    );
}
}

needs! { [fuse]
fn plain_sha256sums_bad_file_allow_serves_until_the_check_fails() {
    if !fuse_available() {
        return;
    }
    let (_dir, gguf, sums) = slow_bad_file(3 << 30);
    let clean = {
        let b = open_single(&demo_path(GGUF), Role::Primary).unwrap();
        decode_bytes(b.as_ref(), BYSTANDER)
    };
    let m = Mounted::new(
        &gguf,
        &[
            "--manifest",
            sums.to_str().unwrap(),
            "-o",
            "unverified=allow",
        ],
    );
    let path = m.path(&format!("{BYSTANDER}.f32"));
    let first = std::fs::read(&path);
    let state = m.ctl_json()["integrity"]["files"][0]["state"].clone();
    if state == "verifying" {
        // Served while the check ran (into the kernel's page cache too).
        assert_eq!(first.unwrap(), clean);
    } else {
        eprintln!("NOTE: the check finished before the first read ({state})");
    }
    wait_whole(&m, "failed");
    // Withdrawn: the daemon's cache dropped, the kernel's pages invalidated.
    for t in [BYSTANDER, VICTIM] {
        let e = std::fs::read(m.path(&format!("{t}.f32")))
            .map(|v| v.len())
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{t}: {e}");
    }
    assert!(m.ctl().contains("whole file failed"), "{}", m.ctl());
}
}
