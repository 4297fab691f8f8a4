//! Remote sources (`http://`): the small HTTP/1.1 server of
//! tests/common/http_server.rs (HEAD, ranged GET, ETag, If-Match -> 412)
//! with its switchable faults (503 every Nth request, a connection dropped
//! mid-body, a changed object, Range ignored). Reads either return the right
//! bytes or fail; never wrong bytes. tests/remote_faults.rs adds a
//! fault-injecting proxy.

mod common;

use std::io::BufReader;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::http_server::Server;
use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::backend::{Backend, DenseBackend, Role};
use rknot::error::ErrorKind;
use rknot::format::gguf::GgufFile;
use rknot::source::{RemoteOptions, SourceFile};

use common::http_server::PRESIGNED_QUERY;

fn opts(part_size: u64) -> RemoteOptions {
    RemoteOptions {
        part_size,
        backoff: Duration::from_millis(5),
        timeout: Duration::from_secs(10),
        ..RemoteOptions::default()
    }
}

fn cat(source: &str, tensor: &str, env: &[(&str, &str)]) -> std::process::Output {
    Command::new(rknot_bin())
        .args(["cat", source, tensor])
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn tensor_names(path: &Path) -> Vec<String> {
    let g = GgufFile::read(&SourceFile::open(path).unwrap()).unwrap();
    g.tensors.iter().map(|t| t.name.clone()).collect()
}

/// `rknot cat` over http equals the local cat, byte for byte, for every
/// tensor of the tiny demo model (small parts, so tensors span parts).
#[test]
fn tiny_cat_over_http_equals_local() {
    let local = demo_path("tiny-llama.gguf");
    let s = Server::start(std::fs::read(&local).unwrap());
    let url = s.url("m.gguf");
    for name in tensor_names(&local) {
        let want = cat(local.to_str().unwrap(), &name, &[]);
        assert!(want.status.success());
        let got = cat(&url, &name, &[("RKNOT_REMOTE_PART_SIZE", "4096")]);
        assert!(
            got.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&got.stderr)
        );
        assert!(got.stdout == want.stdout, "{name}: bytes differ");
    }
    let inspect = Command::new(rknot_bin())
        .args(["inspect", &url])
        .output()
        .unwrap();
    assert!(inspect.status.success());
    assert!(String::from_utf8_lossy(&inspect.stdout).contains(&url));
}

needs! { [model]
fn smollm2_cat_over_http_equals_local() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(std::fs::read(&model).unwrap());
    let url = s.url("m.gguf");
    for name in [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "output_norm.weight",
    ] {
        let want = cat(model.to_str().unwrap(), name, &[]);
        let got = cat(&url, name, &[]);
        assert!(
            got.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&got.stderr)
        );
        assert!(got.stdout == want.stdout, "{name}: bytes differ");
    }
}
}

needs! { [model]
/// Open: one ranged GET of the first block (an eighth of a part), which
/// pins the version; one tensor then costs at most its stored bytes plus
/// one part (in fact two blocks: the blocks at its ends), whatever the
/// read-ahead does.
fn bytes_fetched_for_one_tensor_are_bounded() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(std::fs::read(&model).unwrap());
    let part = 1u64 << 20;
    let block = part / 8;
    let src = SourceFile::open_remote(&s.url("m.gguf"), opts(part)).unwrap();
    let st = src.remote_stats().unwrap();
    assert_eq!(
        (st.requests, st.bytes_fetched, st.block_size),
        (1, block, block),
        "one GET of the first block"
    );
    assert_eq!(s.requests.load(Ordering::SeqCst), 1);
    let g = GgufFile::read(&src).unwrap();
    let header_fetched = src.remote_stats().unwrap().bytes_fetched;
    assert!(
        header_fetched <= (g.data_offset + (1 << 20)).next_multiple_of(block),
        "the header ({} bytes, read in chunks of 1 MiB) cost {header_fetched} bytes",
        g.data_offset
    );
    let b = DenseBackend::from_gguf(src, g, Role::Primary).unwrap();
    rknot::backend::declare_extents(&b);
    for name in ["blk.3.ffn_down.weight", "token_embd.weight"] {
        let before = b.source_files()[0].remote_stats().unwrap().bytes_fetched;
        let want = {
            let l = rknot::backend::open_single(&model, Role::Primary).unwrap();
            decode_bytes(l.as_ref(), name)
        };
        assert_eq!(decode_bytes(&b, name), want);
        let st = b.source_files()[0].remote_stats().unwrap();
        let fetched = st.bytes_fetched - before;
        let stored = b
            .stored_ranges(b.tensors().get(name).unwrap())
            .unwrap()
            .total();
        assert!(
            fetched <= stored + 2 * block && fetched <= stored + part,
            "{name}: fetched {fetched} for {stored} stored bytes (blocks of {block})"
        );
        assert_eq!(st.retries, 0);
    }
}
}

#[test]
fn retries_on_503_and_dropped_connections_give_the_right_bytes() {
    let local = demo_path("tiny-llama.gguf");
    let data = std::fs::read(&local).unwrap();
    let s = Server::start(data.clone());
    s.faults.fail_every.store(3, Ordering::SeqCst);
    s.faults.drop_every.store(4, Ordering::SeqCst);
    // Half of all requests fail, and with 8 in flight the failures no longer
    // alternate with successes for each one: 20 retries make a read that
    // still fails (1 in 2^21 per block) practically impossible.
    let many_retries = RemoteOptions {
        max_retries: 20,
        ..opts(4096)
    };
    let src = SourceFile::open_remote(&s.url("m.gguf"), many_retries).unwrap();
    let mut got = vec![0u8; data.len()];
    src.read_at(0, &mut got).unwrap();
    assert!(got == data, "bytes differ after retries");
    let st = src.remote_stats().unwrap();
    assert!(st.retries > 0, "{st:?}");
    assert_eq!(st.failures, 0);
    assert_eq!(st.bytes_fetched, data.len() as u64);
}

#[test]
fn retries_exhausted_fail_the_read_and_later_reads_work() {
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    let s = Server::start(data.clone());
    let mut o = opts(4096);
    o.max_retries = 2;
    let src = SourceFile::open_remote(&s.url("m.gguf"), o).unwrap();
    s.faults.fail_every.store(1, Ordering::SeqCst);
    let mut b = vec![0u8; 10];
    let e = src.read_at(50_000, &mut b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert_eq!(e.errno(), libc::EIO);
    assert!(e.to_string().contains("gave up after 2 retries"), "{e}");
    s.faults.fail_every.store(0, Ordering::SeqCst);
    src.read_at(50_000, &mut b).unwrap();
    assert_eq!(&b[..], &data[50_000..50_010]);
}

#[test]
fn a_changed_object_is_a_sticky_estale_never_wrong_bytes() {
    let data = vec![1u8; 50_000];
    let s = Server::start(data);
    let src = SourceFile::open_remote(&s.url("m.gguf"), opts(4096)).unwrap();
    let mut b = vec![0u8; 100];
    src.read_at(0, &mut b).unwrap(); // part 0: cached at open
    s.replace(vec![2u8; 50_000], "\"v2\"");
    let e = src.read_at(20_000, &mut b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Changed, "{e}");
    assert_eq!(e.errno(), libc::ESTALE);
    assert!(e.to_string().starts_with(&s.url("m.gguf")), "{e}");
    assert!(src.is_changed());
    // Sticky: even the cached part is refused now.
    assert_eq!(
        src.read_at(0, &mut b).unwrap_err().kind(),
        ErrorKind::Changed
    );
}

#[test]
fn range_ignored_is_refused_at_open() {
    let s = Server::start(vec![0u8; 10_000]);
    s.faults.ignore_range.store(true, Ordering::SeqCst);
    let e = SourceFile::open_remote(&s.url("m.gguf"), opts(4096)).unwrap_err();
    assert!(e.to_string().contains("ignored the Range"), "{e}");
    let out = cat(&s.url("m.gguf"), "x", &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ignored the Range"));
}

#[test]
fn not_found_and_forbidden_name_the_redacted_url_and_status() {
    let s = Server::start(vec![0u8; 10]);
    let e = SourceFile::open_remote(&s.url("nope.gguf"), opts(4096)).unwrap_err();
    assert!(e.to_string().contains("404"), "{e}");
    assert!(e.to_string().starts_with(&s.url("nope.gguf")), "{e}");
    let e = SourceFile::open_remote(&s.url("secret.gguf"), opts(4096)).unwrap_err();
    assert!(e.to_string().contains("403"), "{e}");
    // A query string is kept in requests (a presigned URL) and left out of
    // every name the source shows.
    let f = SourceFile::open_remote(
        &format!("{}?X-Amz-Signature=s3cr3t", s.url("m.gguf")),
        opts(4096),
    )
    .unwrap();
    assert_eq!(f.path(), Path::new(&s.url("m.gguf")));
    assert!(!format!("{f:?}").contains("s3cr3t"));
    let out = cat(&format!("{}?sig=s3cr3t", s.url("secret.gguf")), "x", &[]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cr3t"));
}

needs! { [fuse]
/// Every tensor and model.gguf of a mount of an http source equal those of
/// a local mount.
fn mount_over_http_equals_local_mount() {
    if !fuse_available() {
        return;
    }
    let local = match smollm2() {
        Some(m) => m,
        None => demo_path("tiny-llama.gguf"),
    };
    let s = Server::start(std::fs::read(&local).unwrap());
    let a = Mounted::new(&local, &[]);
    let url = s.url("m.gguf");
    // ctl.json comes with jobs; a remote source has jobs only with --jobs-dir.
    let jobs = tempfile::tempdir().unwrap();
    let b = Mounted::new(
        Path::new(&url),
        &["--jobs-dir", jobs.path().to_str().unwrap()],
    );
    let names = tensor_names(&local);
    for name in &names {
        let f = format!("{name}.f32");
        assert!(
            std::fs::read(a.path(&f)).unwrap() == std::fs::read(b.path(&f)).unwrap(),
            "{name}"
        );
    }
    for view in ["model.gguf", "model.safetensors"] {
        let (x, y) = (a.path(view), b.path(view));
        assert!(x.exists(), "{view}");
        let (x, y) = (std::fs::read(x).unwrap(), std::fs::read(y).unwrap());
        assert!(x == y, "{view} differs");
    }
    let ctl = b.ctl();
    assert!(ctl.contains(&url), "{ctl}");
    assert!(ctl.contains("remote:"), "{ctl}");
    let j = b.ctl_json();
    assert!(j["remote"][0]["bytes_fetched"].as_u64().unwrap() > 0, "{j}");
    assert_eq!(j["remote"][0]["pinned"]["etag"], "\"v1\"");
}
}

/// A presigned URL (the signature in the query string): read over the
/// query string, and the signature is in no error, log line, ctl file,
/// index.json, /proc/mounts or the daemon's command line.
#[test]
fn presigned_urls_work_and_their_signature_is_never_shown() {
    let local = demo_path("tiny-llama.gguf");
    let s = Server::start(std::fs::read(&local).unwrap());
    let url = format!("{}?{PRESIGNED_QUERY}", s.url("p.gguf"));
    let secret = "SECRETSIG0123";
    let name = &tensor_names(&local)[0];
    let want = cat(local.to_str().unwrap(), name, &[]);
    let got = cat(&url, name, &[]);
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert!(got.stdout == want.stdout, "bytes differ");
    let bad = cat(
        &format!("{}?X-Amz-Signature=WRONGSIG", s.url("p.gguf")),
        name,
        &[],
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        err.contains("403") && err.contains(&s.url("p.gguf")),
        "{err}"
    );
    assert!(!err.contains("WRONGSIG"), "{err}");
    if !fuse_available() {
        return;
    }
    let jobs = tempfile::tempdir().unwrap();
    let m = Mounted::new(
        Path::new(&url),
        &["--jobs-dir", jobs.path().to_str().unwrap()],
    );
    let f32 = std::fs::read(m.path(&format!("{name}.f32"))).unwrap();
    assert!(!f32.is_empty());
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", m.pid())).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(cmdline.contains(&s.url("p.gguf")), "{cmdline}");
    for (what, text) in [
        ("ctl", m.ctl()),
        ("ctl.json", m.ctl_json().to_string()),
        (
            "index.json",
            std::fs::read_to_string(m.path("index.json")).unwrap(),
        ),
        (
            "/proc/mounts",
            std::fs::read_to_string("/proc/mounts").unwrap(),
        ),
        ("the daemon's command line", cmdline),
        ("the daemon's log", m.log()),
    ] {
        assert!(!text.contains(secret), "{what} shows the signature: {text}");
    }
    assert!(m.ctl().contains(&s.url("p.gguf")));
}

/// The disk cache (`--source-cache`): a second open of the same object
/// (a remount, another mount) reads every block from disk and fetches
/// nothing; a corrupted part file is detected, removed and refetched,
/// never served; a changed object never gets its old version's blocks.
#[test]
fn disk_cache_serves_remounts_detects_corruption_and_keeps_versions_apart() {
    let local = demo_path("tiny-llama.gguf");
    let data = std::fs::read(&local).unwrap();
    let s = Server::start(data.clone());
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("parts");
    let with_cache = || RemoteOptions {
        source_cache: Some(dir.clone()),
        source_cache_bytes: 1 << 30,
        ..opts(64 << 10)
    };
    let read_all = |src: &SourceFile| {
        let mut got = vec![0u8; src.len() as usize];
        src.read_at(0, &mut got).unwrap();
        got
    };
    let first = SourceFile::open_remote(&s.url("m.gguf"), with_cache()).unwrap();
    assert!(read_all(&first) == data);
    let st = first.remote_stats().unwrap();
    assert_eq!(st.bytes_fetched, data.len() as u64);
    let d = st.disk.unwrap();
    assert!(d.cache.entries > 1 && d.cache.writes > 0, "{d:?}");
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);

    // A remount: only the open's request; every block from disk.
    let second = SourceFile::open_remote(&s.url("m.gguf"), with_cache()).unwrap();
    assert!(read_all(&second) == data);
    let st = second.remote_stats().unwrap();
    assert_eq!(st.requests, 1, "{st:?}");
    assert_eq!(st.bytes_fetched, st.block_size.min(data.len() as u64));
    assert!(st.disk.as_ref().unwrap().hits > 0);

    // Flip one byte in every part file: each is detected and refetched.
    let mut flipped = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let mut b = std::fs::read(&p).unwrap();
        let last = b.len() - 1;
        b[last] ^= 0x40;
        std::fs::write(&p, b).unwrap();
        flipped += 1;
    }
    assert!(flipped > 1);
    let third = SourceFile::open_remote(&s.url("m.gguf"), with_cache()).unwrap();
    assert!(read_all(&third) == data, "a corrupted part was served");
    let st = third.remote_stats().unwrap();
    assert!(st.disk.as_ref().unwrap().cache.corrupt > 0, "{st:?}");
    assert!(st.bytes_fetched >= data.len() as u64 - st.block_size);

    // A new version of the object: none of the old blocks.
    let mut v2 = data.clone();
    for b in v2.iter_mut().step_by(97) {
        *b = b.wrapping_add(1);
    }
    s.replace(v2.clone(), "\"v2\"");
    let fourth = SourceFile::open_remote(&s.url("m.gguf"), with_cache()).unwrap();
    assert!(
        read_all(&fourth) == v2,
        "bytes of the old version were served"
    );
    let st = fourth.remote_stats().unwrap();
    assert_eq!(st.disk.as_ref().unwrap().hits, 0);
}

/// Every command reads a layered model whose both files are remote: a
/// .rknot (and, mounted, an SK32) over http with `--dense` over http. verify, probe, cat and a
/// layered mount give exactly what the same local files give.
#[test]
fn layered_remote_model_in_every_command() {
    let (rk, gg) = (demo_path("tiny-llama.rknot"), demo_path("tiny-llama.gguf"));
    let rs = Server::start(std::fs::read(&rk).unwrap());
    let gs = Server::start(std::fs::read(&gg).unwrap());
    let (rku, ggu) = (rs.url("m.gguf"), gs.url("m.gguf"));
    let (rkl, ggl) = (rk.to_str().unwrap(), gg.to_str().unwrap());
    let run = |args: &[&str]| {
        let o = Command::new(rknot_bin()).args(args).output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).to_string(),
        )
    };
    // Names in reports differ (URL vs path); everything else must not.
    let same = |a: (Option<i32>, String), b: (Option<i32>, String)| {
        let b = (b.0, b.1.replace(&rku, rkl).replace(&ggu, ggl));
        assert_eq!(a, b);
    };
    same(
        run(&["verify", rkl, "--dense", ggl]),
        run(&["verify", &rku, "--dense", &ggu]),
    );
    // The probe's answer (its timings differ).
    let answer = |(code, out): (Option<i32>, String)| {
        let at = out.find("next token").unwrap_or(out.len());
        (code, out[at..].to_string())
    };
    same(
        answer(run(&[
            "probe", rkl, "--dense", ggl, "--tokens", "1,2,3", "--top", "5",
        ])),
        answer(run(&[
            "probe", &rku, "--dense", &ggu, "--tokens", "1,2,3", "--top", "5",
        ])),
    );
    let names = tensor_names(&gg);
    for name in &names[..3] {
        let l = Command::new(rknot_bin())
            .args(["cat", rkl, name, "--dense", ggl])
            .output()
            .unwrap();
        let r = Command::new(rknot_bin())
            .args(["cat", &rku, name, "--dense", &ggu])
            .output()
            .unwrap();
        assert!(l.status.success() && r.status.success());
        assert!(l.stdout == r.stdout, "{name}");
    }
    if !fuse_available() {
        return;
    }
    // The .rknot and the SK32 sketch, each over http with the GGUF as
    // --dense over http, against the same local files mounted.
    let sk = demo_path("tiny-llama.sk32");
    let ss = Server::start(std::fs::read(&sk).unwrap());
    for (local, url) in [(&rk, rku.clone()), (&sk, ss.url("m.gguf"))] {
        let a = Mounted::new(local, &["--dense", ggl]);
        let b = Mounted::new(Path::new(&url), &["--dense", &ggu]);
        for name in &names {
            let f = format!("{name}.f32");
            assert!(
                std::fs::read(a.path(&f)).unwrap() == std::fs::read(b.path(&f)).unwrap(),
                "{}: {name}",
                local.display()
            );
        }
        for view in ["model.gguf", "model.safetensors"] {
            assert!(
                std::fs::read(a.path(view)).unwrap() == std::fs::read(b.path(view)).unwrap(),
                "{}: {view}",
                local.display()
            );
        }
    }
}

/// A small HTTPS server with Range and ETag (Python's ssl + http.server),
/// serving one file as /m.gguf with the certificate given.
const HTTPS_SERVER: &str = r#"
import http.server, ssl, sys, os
path, cert, key = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(path, "rb").read()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        r = self.headers.get("Range", "")
        if self.path.split("?")[0] != "/m.gguf" or not r.startswith("bytes="):
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers(); return
        a, b = r[6:].split("-")
        a, b = int(a), min(int(b), len(data) - 1)
        body = data[a:b + 1]
        self.send_response(206)
        self.send_header("Content-Range", "bytes %d-%d/%d" % (a, b, len(data)))
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"tls1"')
        self.end_headers()
        self.wfile.write(body)
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
s.socket = ctx.wrap_socket(s.socket, server_side=True)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

/// https: the certificate is verified. A server whose certificate no
/// trusted CA signed is refused with a clear error (there is no option to
/// skip verification); with `--ca-bundle` naming its CA, it is read.
#[test]
fn https_verifies_certificates_and_takes_a_ca_bundle() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let (ca, ca_key, cert, key, csr) = (
        p("ca.pem"),
        p("ca.key"),
        p("cert.pem"),
        p("key.pem"),
        p("c.csr"),
    );
    let openssl = |args: &[&std::ffi::OsStr]| {
        let o = Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl (tools/test.sh installs it)");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let s = |v: &'static str| std::ffi::OsStr::new(v);
    // A CA, and a server certificate for 127.0.0.1 that it signs.
    openssl(&[
        s("req"),
        s("-x509"),
        s("-newkey"),
        s("rsa:2048"),
        s("-nodes"),
        s("-days"),
        s("1"),
        s("-subj"),
        s("/CN=rknot test CA"),
        s("-keyout"),
        ca_key.as_os_str(),
        s("-out"),
        ca.as_os_str(),
    ]);
    openssl(&[
        s("req"),
        s("-newkey"),
        s("rsa:2048"),
        s("-nodes"),
        s("-subj"),
        s("/CN=127.0.0.1"),
        s("-keyout"),
        key.as_os_str(),
        s("-out"),
        csr.as_os_str(),
    ]);
    let ext = p("ext.cnf");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(&[
        s("x509"),
        s("-req"),
        s("-in"),
        csr.as_os_str(),
        s("-CA"),
        ca.as_os_str(),
        s("-CAkey"),
        ca_key.as_os_str(),
        s("-CAcreateserial"),
        s("-days"),
        s("1"),
        s("-extfile"),
        ext.as_os_str(),
        s("-out"),
        cert.as_os_str(),
    ]);
    let local = demo_path("tiny-llama.gguf");
    let mut server = Command::new("python3")
        .arg("-c")
        .arg(HTTPS_SERVER)
        .arg(&local)
        .arg(&cert)
        .arg(&key)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut port = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let url = format!("https://127.0.0.1:{}/m.gguf", port.trim());
    let refused = SourceFile::open_remote(&url, opts(64 << 10));
    let with_ca = SourceFile::open_remote(
        &url,
        RemoteOptions {
            ca_bundle: Some(ca.clone()),
            ..opts(64 << 10)
        },
    );
    let not_pem = std::fs::write(dir.path().join("junk.pem"), "not a certificate");
    let junk = SourceFile::open_remote(
        &url,
        RemoteOptions {
            ca_bundle: Some(dir.path().join("junk.pem")),
            ..opts(64 << 10)
        },
    );
    let _ = server.kill();
    let _ = server.wait();
    not_pem.unwrap();
    let e = refused.unwrap_err().to_string();
    assert!(
        e.starts_with(&url) && e.to_lowercase().contains("certificate"),
        "{e}"
    );
    let src = with_ca.unwrap();
    let data = std::fs::read(&local).unwrap();
    let mut head = vec![0u8; 4096.min(data.len())];
    src.read_at(0, &mut head).unwrap();
    assert!(head[..] == data[..head.len()]);
    let e = junk.unwrap_err().to_string();
    assert!(e.contains("CA bundle"), "{e}");
}

/// A URL that redirects (a Hugging Face resolve URL, to a presigned CDN
/// URL): after open, requests go straight to where it led (one round trip
/// each, not two); when that target refuses (expired), the URL as given is
/// asked again and its new target used from then on. Never wrong bytes.
#[test]
fn redirect_targets_are_remembered_and_renewed_when_they_expire() {
    let data: Vec<u8> = (0..4_000_000u32).map(|i| (i * 31 + 7) as u8).collect();
    let s = Server::start(data.clone());
    let src = SourceFile::open_remote(&s.url("r.gguf"), opts(64 << 10)).unwrap();
    assert_eq!(src.path(), Path::new(&s.url("r.gguf")));
    // Open: the 302 and the first block.
    assert_eq!(s.requests.load(Ordering::SeqCst), 2);
    let read = |at: u64| {
        let mut b = vec![0u8; 100];
        src.read_at(at, &mut b).unwrap();
        assert!(
            b[..] == data[at as usize..at as usize + 100],
            "bytes at {at}"
        );
    };
    read(1_000_000);
    assert_eq!(
        s.requests.load(Ordering::SeqCst),
        3,
        "straight to the target"
    );
    s.faults.signature.fetch_add(1, Ordering::SeqCst);
    read(2_000_000);
    // 403 from the old target, then the 302 and the new target.
    assert_eq!(s.requests.load(Ordering::SeqCst), 6);
    read(3_000_000);
    assert_eq!(
        s.requests.load(Ordering::SeqCst),
        7,
        "straight to the new target"
    );
    let st = src.remote_stats().unwrap();
    assert_eq!((st.retries, st.failures), (0, 1), "{st:?}");
}

/// A redirect to a scheme that is not http(s) (file://), a redirect loop
/// and a chain of redirects without end are final errors that say so, at
/// open and promptly: never retried (a retried "HTTP 302" before).
#[test]
fn redirects_to_file_urls_loops_and_endless_chains_are_final_errors() {
    let s = Server::start(vec![0u8; 10]);
    let o = RemoteOptions {
        backoff: Duration::from_millis(200),
        ..opts(4096)
    };
    for (path, says) in [
        (
            "to-file.gguf",
            "redirects to file:///etc/passwd, which is not http(s)",
        ),
        ("loop-a.gguf", "redirect loop"),
        ("hop/0.gguf", "too many redirects"),
    ] {
        let before = s.requests.load(Ordering::SeqCst);
        let t = std::time::Instant::now();
        let e = SourceFile::open_remote(&s.url(path), o.clone()).unwrap_err();
        let m = e.to_string();
        assert!(
            m.starts_with(&s.url(path)) && m.contains(says),
            "{path}: {m}"
        );
        assert!(!m.contains("retries"), "{path}: retried: {m}");
        assert_eq!(e.errno(), libc::EIO, "{path}: {m}");
        let asked = s.requests.load(Ordering::SeqCst) - before;
        // One request, plus the redirects it followed: at most 12.
        assert!(asked <= 12, "{path}: {asked} requests: retried? {m}");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{path}: {:?}",
            t.elapsed()
        );
    }
}

/// Every file of the malformed corpus, opened by a presigned URL: what a
/// reader refuses names the object, never its signature (an error that
/// carried the URL as given, not the source's redacted name, showed the
/// query string).
#[test]
fn reader_errors_never_show_a_presigned_urls_signature() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/malformed");
    let mut files: Vec<_> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x != "json"))
        .collect();
    files.sort();
    assert!(files.len() > 200, "{} corpus files", files.len());
    let s = Server::start(Vec::new());
    let mut refused = 0;
    for (i, f) in files.iter().enumerate() {
        s.replace(std::fs::read(f).unwrap(), &format!("\"c{i}\""));
        let name = f.file_name().unwrap().to_str().unwrap();
        // The server serves its object as /p.gguf (with this query only);
        // the readers go by the magic, not the name.
        let url = format!("{}?{PRESIGNED_QUERY}", s.url("p.gguf"));
        if let Err(e) = rknot::backend::open(Path::new(&url), None) {
            refused += 1;
            let shown = e.to_string();
            assert!(!shown.contains("SECRETSIG"), "{name}: {shown}");
            assert!(
                shown.contains(&s.url("p.gguf")),
                "{name}: not named: {shown}"
            );
        }
    }
    assert!(refused > 150, "only {refused} of {} refused", files.len());
}
