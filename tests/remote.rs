//! Remote sources (`http://`): the small HTTP/1.1 server of
//! tests/common/http_server.rs (HEAD, ranged GET, ETag, If-Match -> 412)
//! with its switchable faults (503 every Nth request, a connection dropped
//! mid-body, a changed object, Range ignored). Reads either return the right
//! bytes or fail; never wrong bytes. tests/remote_faults.rs adds a
//! fault-injecting proxy.

mod common;

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

#[test]
#[cfg_attr(
    rknot_no_model,
    ignore = "needs the SmolLM2 model: tools/fetch-smollm2.sh (README: Tests)"
)]
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

/// Open: one ranged GET of the first block (an eighth of a part), which
/// pins the version; one tensor then costs at most its stored bytes plus
/// one part (in fact two blocks: the blocks at its ends), whatever the
/// read-ahead does.
#[test]
#[cfg_attr(
    rknot_no_model,
    ignore = "needs the SmolLM2 model: tools/fetch-smollm2.sh (README: Tests)"
)]
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
    let e = SourceFile::open_remote(
        &format!("{}?X-Amz-Signature=s3cr3t", s.url("m.gguf")),
        opts(4096),
    )
    .unwrap_err();
    assert!(!e.to_string().contains("s3cr3t"), "{e}");
    let out = cat(&format!("{}?sig=s3cr3t", s.url("secret.gguf")), "x", &[]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cr3t"));
}

/// Every tensor and model.gguf of a mount of an http source equal those of
/// a local mount.
#[test]
#[cfg_attr(
    rknot_no_fuse,
    ignore = "needs root, /dev/fuse and fusermount3 (README: Tests)"
)]
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
    for view in ["model.gguf", "index.json"] {
        let (x, y) = (a.path(view), b.path(view));
        if x.exists() {
            let (x, y) = (std::fs::read(x).unwrap(), std::fs::read(y).unwrap());
            if view == "model.gguf" {
                assert!(x == y, "{view} differs");
            }
        }
    }
    let ctl = b.ctl();
    assert!(ctl.contains(&url), "{ctl}");
    assert!(ctl.contains("remote:"), "{ctl}");
    let j = b.ctl_json();
    assert!(j["remote"][0]["bytes_fetched"].as_u64().unwrap() > 0, "{j}");
    assert_eq!(j["remote"][0]["pinned"]["etag"], "\"v1\"");
}
