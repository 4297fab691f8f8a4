//! `s3://` sources and outputs against a real S3-compatible server (moto,
//! tests/common/s3.rs, on 127.0.0.1): mounts of the SmolLM2 GGUF, a
//! layered .rknot and an SK32 serve exactly the bytes of the same files
//! mounted locally; `rknot cat`/`inspect` over s3; 404 and 403 name the
//! URL and the status; `--endpoint` / `-o endpoint=` win over a wrong
//! AWS_ENDPOINT_URL; `rknot encode` from s3 to s3 equals a local encode,
//! never replaces an object without --overwrite (also one that appears
//! while it runs: the conditional completion), and SIGTERM/SIGINT leave no
//! object and no multipart upload behind.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::mount::{Mounted, fuse_available, mount_bin};
use common::s3::S3;
use common::*;

const BUCKET: &str = "models";

/// A wrong endpoint (nothing listens on port 9 of loopback).
const DEAD_ENDPOINT: &str = "http://127.0.0.1:9";

fn rknot(s3: &S3, args: &[&str]) -> Output {
    s3.command(rknot_bin()).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `rknot encode rknot` of the GGUF's blk.0 matrices only (and nothing
/// else): a small .rknot that serves the rest from its --dense fallback.
fn encode_b0(model: &Path, out: &Path) {
    let o = Command::new(rknot_bin())
        .args(["encode", "rknot", "--no-progress", "--profile", "faithful"])
        .args(["--tensors", "blk.0.*"])
        .args(["--compressed-only", "-o"])
        .arg(out)
        .arg(model)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
}

/// Write one command line to the mount's `ctl` (a refused one is an
/// error of the write; its reason is in `last_error`).
fn ctl_command(m: &Mounted, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.path("ctl"))
        .unwrap();
    let _ = f.write_all(format!("{line}\n").as_bytes());
}

/// Whether two files have the same bytes, read in chunks; panics naming
/// the first difference.
fn assert_same_file(a: &Path, b: &Path) {
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; 4 << 20], vec![0u8; 4 << 20]);
    let mut at = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        assert_eq!(
            na,
            nb,
            "{} and {} differ in length at {at}",
            a.display(),
            b.display()
        );
        if na == 0 {
            return;
        }
        if ba[..na] != bb[..nb] {
            let i = ba[..na].iter().zip(&bb[..nb]).position(|(x, y)| x != y);
            panic!(
                "{} and {} differ at byte {}",
                a.display(),
                b.display(),
                at + i.unwrap_or(0) as u64
            );
        }
        at += na as u64;
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// Every tensor file and both engine views of `remote` equal those of
/// `local`; the listings are the same. Returns the number of files.
fn assert_same_mount(remote: &Mounted, local: &Mounted) -> usize {
    // (jobs/ comes with encoding jobs, which a remote source has only
    // with a jobs directory; ctl.json differs between mounts.)
    let model_files = |m: &Mounted| {
        let mut v = listing(&m.mp);
        v.retain(|n| n != "ctl.json" && n != "jobs");
        v
    };
    let names = model_files(remote);
    let local_names = model_files(local);
    if names != local_names {
        let only = |a: &[String], b: &[String]| {
            a.iter()
                .filter(|x| !b.contains(x))
                .cloned()
                .collect::<Vec<_>>()
        };
        panic!(
            "listings differ: only remote {:?}, only local {:?}",
            only(&names, &local_names),
            only(&local_names, &names)
        );
    }
    let mut n = 0;
    for name in &names {
        // index.json and ctl name the sources (a URL, a path): not bytes
        // of the model.
        if matches!(name.as_str(), "index.json" | "ctl") {
            continue;
        }
        let p = remote.path(name);
        if p.is_dir() {
            continue;
        }
        assert_same_file(&p, &local.path(name));
        n += 1;
    }
    for view in ["model.gguf", "model.safetensors"] {
        assert!(names.iter().any(|x| x == view), "no {view}: {names:?}");
    }
    n
}

needs! { [moto, model, fuse]
fn mounts_over_s3_serve_the_bytes_of_local_mounts() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let t0 = Instant::now();
    let s3 = S3::start();
    s3.create_bucket(BUCKET);
    let dir = tempfile::tempdir().unwrap();
    let b0 = dir.path().join("b0.rknot");
    encode_b0(&model, &b0);
    let sk = smollm2_sketch(&model, dir.path());
    s3.upload(&model, BUCKET, "smol/model.gguf");
    s3.upload(&b0, BUCKET, "smol/b0.rknot");
    s3.upload(&sk, BUCKET, "smol/smol.sk32");
    let url = |k: &str| format!("s3://{BUCKET}/smol/{k}");
    let env = s3.env();

    // The GGUF, configured by AWS_ENDPOINT_URL alone; its encoding jobs
    // upload under the administrator's prefix.
    let prefix = format!("jobs_remote_prefix=s3://{BUCKET}/jobs");
    let remote = Mounted::with_env(Path::new(&url("model.gguf")), &["-o", &prefix], &env);
    let local = Mounted::new(&model, &[]);
    let files = assert_same_mount(&remote, &local);
    assert!(files > 270, "{files} files compared");
    let ctl = remote.ctl();
    assert!(ctl.contains(&url("model.gguf")), "{ctl}");
    assert!(ctl.contains("errors 0"), "{ctl}");
    ctl_command(&remote, "encode knot out=k.knot");
    let job = remote.wait_job(1, &["done", "failed"], 120);
    assert_eq!(job["state"], "done", "{job}\n{}", remote.log());
    let knot = dir.path().join("k.knot");
    let o = Command::new(rknot_bin())
        .args(["encode", "knot", "--no-progress"])
        .arg(&model)
        .arg("-o")
        .arg(&knot)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        s3.get(BUCKET, "jobs/k.knot").unwrap() == std::fs::read(&knot).unwrap(),
        "the job's upload differs from a local encode"
    );
    // Names stay plain names under the prefix.
    ctl_command(&remote, "encode knot out=../escape.knot");
    assert!(
        remote.last_error().contains("'..'"),
        "{}",
        remote.last_error()
    );
    drop((remote, local));

    // Layered: the .rknot over the GGUF, both remote; AWS_ENDPOINT_URL is
    // wrong and -o endpoint= puts it right.
    let mut wrong_env = env.clone();
    wrong_env.retain(|(k, _)| *k != "AWS_ENDPOINT_URL");
    wrong_env.push(("AWS_ENDPOINT_URL", DEAD_ENDPOINT.into()));
    let endpoint_opt = format!("endpoint={}", s3.endpoint);
    let gguf_url = url("model.gguf");
    let remote = Mounted::with_env(
        Path::new(&url("b0.rknot")),
        &["--dense", &gguf_url, "-o", &endpoint_opt],
        &wrong_env,
    );
    let local = Mounted::new(&b0, &["--dense", model.to_str().unwrap()]);
    assert_same_mount(&remote, &local);
    drop((remote, local));

    // The SK32 over the GGUF, --endpoint this time.
    let remote = Mounted::with_env(
        Path::new(&url("smol.sk32")),
        &["--dense", &gguf_url, "--endpoint", &s3.endpoint],
        &wrong_env,
    );
    let local = Mounted::new(&sk, &["--dense", model.to_str().unwrap()]);
    assert_same_mount(&remote, &local);
    drop((remote, local));

    // A missing object: the mount fails, naming the URL and the status.
    let mp = dir.path().join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let o = s3
        .command(mount_bin())
        .arg(url("missing.gguf"))
        .arg(&mp)
        .arg("--foreground")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&url("missing.gguf")) && err.contains("404"),
        "{err}"
    );
    // A bad -o value is a usage error.
    let o = s3
        .command(mount_bin())
        .arg(url("model.gguf"))
        .arg(&mp)
        .args(["-o", "part_size_mb=0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    eprintln!("mounts over s3: {:.1} s", t0.elapsed().as_secs_f64());
}
}

needs! { [moto, model]
fn rknot_commands_over_s3() {
    let Some(model) = smollm2() else { return };
    let t0 = Instant::now();
    let s3 = S3::start();
    s3.create_bucket(BUCKET);
    s3.upload(&model, BUCKET, "m.gguf");
    let url = format!("s3://{BUCKET}/m.gguf");
    let model_s = model.to_str().unwrap();

    // cat: the same bytes as from the local file.
    for tensor in ["blk.3.ffn_down.weight", "output_norm.weight"] {
        let remote = rknot(&s3, &["cat", &url, tensor]);
        assert!(remote.status.success(), "{}", text(&remote.stderr));
        let local = run_rknot(&["cat", model_s, tensor]);
        assert!(!local.stdout.is_empty());
        assert!(remote.stdout == local.stdout, "cat {tensor} differs");
    }
    // inspect: the same report but for the file's name.
    let remote = rknot(&s3, &["inspect", "--json", &url]);
    assert!(remote.status.success(), "{}", text(&remote.stderr));
    let local = run_rknot(&["inspect", "--json", model_s]);
    let strip = |o: &Output| {
        let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        drop_paths(&mut v);
        v
    };
    assert!(strip(&remote) == strip(&local), "inspect --json differs");

    // 404: the redacted URL and the status, exit 1.
    let missing = format!("s3://{BUCKET}/nope.gguf");
    let o = rknot(&s3, &["inspect", &missing]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&missing) && err.contains("HTTP 404"), "{err}");

    // --endpoint wins over a wrong AWS_ENDPOINT_URL; without it the
    // command fails (connection refused: retried, then an error).
    let o = s3
        .command(rknot_bin())
        .env("AWS_ENDPOINT_URL", DEAD_ENDPOINT)
        .args([
            "cat",
            "--endpoint",
            &s3.endpoint,
            &url,
            "output_norm.weight",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = s3
        .command(rknot_bin())
        .env("AWS_ENDPOINT_URL", DEAD_ENDPOINT)
        .args(["inspect", "--remote-retries", "0", &url])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains(&url), "{}", text(&o.stderr));

    // Bad flag values: usage errors (exit 2).
    for bad in [
        ["--endpoint", "s3.example.com"],
        ["--part-size-mb", "0"],
        ["--remote-retries", "101"],
        ["--ca-bundle", "/nonexistent.pem"],
    ] {
        let o = rknot(&s3, &["inspect", bad[0], bad[1], &url]);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", text(&o.stderr));
    }

    // 403: a wrong secret (the server checks signatures).
    let o = s3
        .command(rknot_bin())
        .env("AWS_SECRET_ACCESS_KEY", "wrong")
        .args(["inspect", &url])
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&url) && err.contains("HTTP 403"), "{err}");
    assert!(!err.contains("wrong"), "the secret leaked: {err}");
    eprintln!(
        "rknot commands over s3: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}
}

/// `v` without its "path" members (where the file is, not what it is).
fn drop_paths(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("path");
            m.values_mut().for_each(drop_paths);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(drop_paths),
        _ => {}
    }
}

/// Wait until `bucket` has a multipart upload in progress (the encoder's
/// first part is on its way) or `child` ends.
fn wait_for_upload(s3: &S3, child: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while s3.uploads_in_progress(BUCKET).is_empty() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the encoder ended before uploading"
        );
        assert!(Instant::now() < deadline, "no upload started in 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

needs! { [moto, model]
fn encode_from_s3_to_s3() {
    let Some(model) = smollm2() else { return };
    let t0 = Instant::now();
    let s3 = S3::start();
    s3.create_bucket(BUCKET);
    s3.upload(&model, BUCKET, "m.gguf");
    let src = format!("s3://{BUCKET}/m.gguf");
    let dir = tempfile::tempdir().unwrap();
    // The blk.1x layers compressed, every other tensor copied: an output
    // of ~95 MB, a dozen parts.
    let opts = ["--no-progress", "--profile", "faithful", "--tensors", "blk.1*"];
    let local = dir.path().join("local.rknot");
    let o = Command::new(rknot_bin())
        .args(["encode", "rknot"])
        .args(opts)
        .arg(&model)
        .arg("-o")
        .arg(&local)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let local_bytes = std::fs::read(&local).unwrap();
    assert!(local_bytes.len() > 50 << 20, "{}", local_bytes.len());

    let encode = |out: &str, extra: &[&str]| {
        let mut c = s3.command(rknot_bin());
        c.args(["encode", "rknot"])
            .args(opts)
            .args(extra)
            .args([src.as_str(), "-o", out]);
        c
    };
    let out = format!("s3://{BUCKET}/out/m.rknot");
    let o = encode(&out, &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains(&out), "{}", text(&o.stderr));
    let uploaded = s3.get(BUCKET, "out/m.rknot").expect("the object");
    assert!(
        uploaded == local_bytes,
        "s3 -> s3 differs from the local encode"
    );
    assert!(s3.uploads_in_progress(BUCKET).is_empty());

    // An existing object without --overwrite: refused before encoding,
    // left as it is.
    let existing = dir.path().join("existing");
    std::fs::write(&existing, b"someone else's object").unwrap();
    s3.upload(&existing, BUCKET, "out/taken.rknot");
    let taken = format!("s3://{BUCKET}/out/taken.rknot");
    let o = encode(&taken, &[]).output().unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&taken) && err.contains("--overwrite"), "{err}");
    assert_eq!(
        s3.get(BUCKET, "out/taken.rknot").unwrap(),
        b"someone else's object"
    );

    // One that appears while the encoder runs: the conditional completion
    // refuses it (moto answers If-None-Match: * with 412, as S3 does).
    let late = format!("s3://{BUCKET}/out/late.rknot");
    let mut child = encode(&late, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_upload(&s3, &mut child);
    s3.upload(&existing, BUCKET, "out/late.rknot");
    let o = child.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("appeared"), "{err}");
    assert_eq!(
        s3.get(BUCKET, "out/late.rknot").unwrap(),
        b"someone else's object"
    );
    assert!(
        s3.uploads_in_progress(BUCKET).is_empty(),
        "a dangling upload"
    );

    // --overwrite replaces it.
    let o = encode(&taken, &["--overwrite"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(s3.get(BUCKET, "out/taken.rknot").unwrap() == local_bytes);

    // SIGTERM and SIGINT mid-upload: no object, no upload in progress.
    for (sig, name) in [(libc::SIGTERM, "term"), (libc::SIGINT, "int")] {
        let key = format!("out/{name}.rknot");
        let mut child = encode(&format!("s3://{BUCKET}/{key}"), &[])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_upload(&s3, &mut child);
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(child.id() as i32, sig) };
        let o = child.wait_with_output().unwrap();
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(128 + sig), "{err}");
        assert!(err.contains("aborted"), "{err}");
        assert!(s3.get(BUCKET, &key).is_none(), "{key} exists");
        assert!(
            s3.uploads_in_progress(BUCKET).is_empty(),
            "a dangling upload after signal {sig}"
        );
    }

    // The input as output: refused, also with --overwrite.
    let o = encode(&src, &["--overwrite"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("the output is the input"));
    // http(s) outputs are refused.
    let o = encode("https://127.0.0.1:9/m.rknot", &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("http(s)"));
    let keys = s3.keys(BUCKET);
    assert_eq!(
        keys,
        ["m.gguf", "out/late.rknot", "out/m.rknot", "out/taken.rknot"],
        "{keys:?}"
    );
    eprintln!("encode s3 -> s3: {:.1} s", t0.elapsed().as_secs_f64());
}
}

needs! { [moto, model]
/// The fault proxy (tests/common/fault_proxy.rs) between rknot and the S3
/// server, as the endpoint: with 503s, reset connections and truncated
/// bodies, a mount via s3:// serves exactly the local mount's bytes (after
/// retries); then with the object's ETag rewritten (a new version), reads
/// of blocks not yet fetched fail (ESTALE or EIO), never with other bytes,
/// and the daemon lives on.
fn s3_through_a_fault_proxy_gives_right_bytes_or_errors() {
    use std::sync::atomic::Ordering;
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let s3 = S3::start();
    s3.create_bucket(BUCKET);
    s3.upload(&model, BUCKET, "model.gguf");
    let proxy =
        common::fault_proxy::FaultProxy::start(format!("127.0.0.1:{}", s3.port).parse().unwrap());
    let f = &proxy.faults;
    f.error_every.store(3, Ordering::SeqCst);
    f.drop_every.store(4, Ordering::SeqCst);
    f.truncate_every.store(5, Ordering::SeqCst);
    let mut env = s3.env();
    env.push(("RKNOT_REMOTE_RETRIES", "30".into()));
    env.push(("RKNOT_REMOTE_BACKOFF_MS", "2".into()));
    // A memory cache of 8 MiB (read-ahead at most 2 MiB): the tensors read
    // after the change cannot all be cached from before it (a whole-file
    // reader's read-ahead may otherwise have brought most of the 94 MB).
    env.push(("RKNOT_REMOTE_CACHE_BYTES", (8u64 << 20).to_string()));
    let endpoint = format!("http://127.0.0.1:{}", proxy.port);
    let local = Mounted::new(&model, &[]);
    let remote = Mounted::with_env(
        Path::new(&format!("s3://{BUCKET}/model.gguf")),
        &["--endpoint", &endpoint],
        &env,
    );
    let mut names: Vec<String> = std::fs::read_dir(&local.mp)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        // One spelling of each layer tensor (the dotted one).
        .filter(|n| n.starts_with("blk.") && n.ends_with(".f32"))
        .collect();
    names.sort();
    let (read_now, read_later) = names.split_at(names.len() / 2);
    for n in read_now.iter().step_by(4) {
        let want = std::fs::read(local.path(n)).unwrap();
        let got = std::fs::read(remote.path(n)).unwrap();
        assert!(got == want, "{n}: wrong bytes through the faults");
    }
    assert!(proxy.injected() > 0, "no fault was injected");
    let ctl = remote.ctl();
    assert!(ctl.contains("retries") && !ctl.contains("CHANGED"), "{ctl}");
    assert!(
        ctl.contains("of 8388608 B"),
        "the 8 MiB memory cache: {ctl}"
    );
    // A new version, as far as rknot can tell.
    f.clear();
    *f.rewrite_etag.lock().unwrap() = Some("\"another-version\"".into());
    let mut refused = 0;
    for n in read_later.iter().step_by(4) {
        match std::fs::read(remote.path(n)) {
            Ok(got) => {
                // Only possible for bytes already cached before the change.
                assert!(
                    got == std::fs::read(local.path(n)).unwrap(),
                    "{n}: wrong bytes"
                );
            }
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(0);
                assert!(errno == libc::ESTALE || errno == libc::EIO, "{n}: {e}");
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "no read saw the new version");
    assert!(remote.ctl().contains("CHANGED"));
    proxy.assert_clean();
}
}
