//! Remote sources behind the fault-injecting proxy of
//! tests/common/fault_proxy.rs, in front of the HTTP server of
//! tests/common/http_server.rs (each test starts its own pair): delays and
//! timeouts, connections reset mid-body, 500/503 on every Nth request,
//! truncated bodies, a rewritten ETag and a replaced object. Through
//! `SourceFile::open_remote` and through a real FUSE mount, reads either
//! return the right bytes or fail with EIO (ESTALE for a changed object);
//! never wrong bytes; the daemon stays alive; once the faults stop, the same
//! files read again without a remount.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fault_proxy::{FaultProxy, ProxyFaults};
use common::http_server::Server;
use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::format::gguf::{GgufFile, GgufTensorInfo};
use rknot::source::{RemoteOptions, SourceFile};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Delay,
    Drop,
    Error500,
    Error503,
    Truncate,
    Mixed,
}

/// Switch `fault` on. The periods are co-prime so that, mixed, they hit
/// different requests; `timeouts`: some delays exceed a client timeout of
/// 150 ms (in-process only: the daemon's timeout is in whole seconds).
fn switch_on(f: &ProxyFaults, fault: Fault, timeouts: bool) {
    let delay = |f: &ProxyFaults| {
        if timeouts {
            f.delay_ms.store(250, Ordering::SeqCst);
            f.delay_every.store(11, Ordering::SeqCst);
        } else {
            f.delay_ms.store(20, Ordering::SeqCst);
            f.delay_every.store(3, Ordering::SeqCst);
        }
    };
    match fault {
        Fault::Delay => delay(f),
        Fault::Drop => f.drop_every.store(3, Ordering::SeqCst),
        Fault::Error500 => {
            f.error_status.store(500, Ordering::SeqCst);
            f.error_every.store(3, Ordering::SeqCst);
        }
        Fault::Error503 => f.error_every.store(3, Ordering::SeqCst),
        Fault::Truncate => f.truncate_every.store(3, Ordering::SeqCst),
        Fault::Mixed => {
            delay(f);
            f.drop_every.store(7, Ordering::SeqCst);
            f.error_every.store(5, Ordering::SeqCst);
            f.truncate_every.store(4, Ordering::SeqCst);
        }
    }
}

fn tensors(path: &Path) -> Vec<GgufTensorInfo> {
    GgufFile::read(&SourceFile::open(path).unwrap())
        .unwrap()
        .tensors
}

/// A server with `data` and a proxy in front of it.
fn server_and_proxy(data: Vec<u8>) -> (Server, FaultProxy) {
    let s = Server::start(data);
    let p = FaultProxy::start(s.addr());
    (s, p)
}

// ---------------------------------------------------------------------------
// In-process: SourceFile::open_remote

/// Read all of `src` in 4 MiB pieces: each either equals `want` or fails
/// with EIO. Returns the number of failed pieces.
fn read_all_checked(src: &SourceFile, want: &[u8]) -> usize {
    let mut failed = 0;
    for (i, piece) in want.chunks(4 << 20).enumerate() {
        let off = (i * (4 << 20)) as u64;
        let mut got = vec![0u8; piece.len()];
        match src.read_at(off, &mut got) {
            Ok(()) => assert!(got == piece, "wrong bytes at {off}"),
            Err(e) => {
                assert_eq!(e.errno(), libc::EIO, "at {off}: {e}");
                failed += 1;
            }
        }
    }
    failed
}

fn in_process(fault: Fault) {
    let Some(model) = smollm2() else { return };
    let want = std::fs::read(&model).unwrap();
    let (_s, p) = server_and_proxy(want.clone());
    let o = RemoteOptions {
        // Blocks of 128 KiB: some 750 requests for the model.
        part_size: 1 << 20,
        // Smaller than the model: the second pass fetches again.
        cache_bytes: 8 << 20,
        max_retries: 30,
        backoff: Duration::from_millis(2),
        timeout: Duration::from_millis(150),
        ..RemoteOptions::default()
    };
    let src = SourceFile::open_remote(&p.url("m.gguf"), o).unwrap();
    switch_on(&p.faults, fault, true);
    let failed = read_all_checked(&src, &want);
    let st = src.remote_stats().unwrap();
    assert!(p.injected() > 0, "{fault:?}: no fault injected");
    if fault != Fault::Delay || p.faults.delay_ms.load(Ordering::SeqCst) > 150 {
        assert!(st.retries > 0, "{fault:?}: {st:?}");
    }
    assert!(!st.changed, "{fault:?}: {st:?}");
    p.faults.clear();
    assert_eq!(read_all_checked(&src, &want), 0, "{fault:?}: faults off");
    eprintln!("{fault:?}: {failed} pieces failed with faults on; {st:?}");
    p.assert_clean();
}

// ---------------------------------------------------------------------------
// Through a FUSE mount

/// The daemon's remote settings: small blocks (4 KiB for the small model,
/// 32 KiB for SmolLM2) so that a few MB of tensors are many requests, a
/// small memory cache, many quick retries.
fn daemon_env(part_size: &'static str, retries: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("RKNOT_REMOTE_PART_SIZE", part_size),
        ("RKNOT_REMOTE_CACHE_BYTES", "1048576"),
        ("RKNOT_REMOTE_RETRIES", retries),
        ("RKNOT_REMOTE_BACKOFF_MS", "1"),
        ("RKNOT_REMOTE_TIMEOUT_S", "5"),
    ]
}

struct RemoteMount {
    m: Mounted,
    _jobs: tempfile::TempDir,
}

fn mount_url(url: &str, env: &[(&str, &str)]) -> RemoteMount {
    // A remote source has no directory of its own for ctl jobs.
    let jobs = tempfile::tempdir().unwrap();
    let m = Mounted::with_env(
        Path::new(url),
        &["--jobs-dir", jobs.path().to_str().unwrap()],
        env,
    );
    RemoteMount { m, _jobs: jobs }
}

impl RemoteMount {
    /// Forget what the daemon and the kernel cached of `file`.
    fn drop_caches(&self, file: &Path) {
        std::fs::write(self.m.path("ctl"), "drop-cache\n").unwrap();
        let f = std::fs::File::open(file).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: advisory call on a descriptor we own.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }

    fn assert_alive(&mut self) {
        assert!(
            self.m.try_wait().is_none(),
            "daemon died:\n{}",
            self.m.log()
        );
        let _ = self.m.ctl_json();
    }
}

/// Outcome of reading a file in 1 MiB preads.
#[derive(Debug, Default, PartialEq)]
struct Outcome {
    ok_bytes: u64,
    errors: Vec<i32>,
}

/// Read `path` in 1 MiB preads (a failed piece is skipped) and compare
/// every byte read with `want`: wrong bytes panic, errors must be one of
/// `allowed` errnos.
fn read_file_checked(path: &Path, want: &[u8], allowed: &[i32]) -> Outcome {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            let errno = e.raw_os_error().unwrap_or(0);
            assert!(allowed.contains(&errno), "open {}: {e}", path.display());
            return Outcome {
                ok_bytes: 0,
                errors: vec![errno],
            };
        }
    };
    let mut out = Outcome::default();
    let mut off = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    while off < want.len() {
        let n = buf.len().min(want.len() - off);
        match f.read_at(&mut buf[..n], off as u64) {
            Ok(0) => panic!("{}: EOF at {off} of {}", path.display(), want.len()),
            Ok(k) => {
                assert!(
                    buf[..k] == want[off..off + k],
                    "{}: WRONG BYTES at {off}..{}",
                    path.display(),
                    off + k
                );
                out.ok_bytes += k as u64;
                off += k;
            }
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(0);
                assert!(allowed.contains(&errno), "{} at {off}: {e}", path.display());
                out.errors.push(errno);
                off += n;
            }
        }
    }
    out
}

/// The tensor files of blocks 0..6 of SmolLM2 and its output norm: some
/// 13 MB stored, 80 MB decoded (all of it would take too long per fault).
fn smollm2_files(model: &Path) -> Vec<String> {
    tensors(model)
        .into_iter()
        .filter(|t| {
            (0..6).any(|b| t.name.starts_with(&format!("blk.{b}.")))
                || t.name == "output_norm.weight"
        })
        .map(|t| format!("{}.f32", t.name))
        .collect()
}

fn through_mount(fault: Fault) {
    if !fuse_available() {
        return;
    }
    let Some(model) = smollm2() else { return };
    let (_s, p) = server_and_proxy(std::fs::read(&model).unwrap());
    let local = Mounted::new(&model, &[]);
    let mut remote = mount_url(&p.url("m.gguf"), &daemon_env("262144", "30"));
    let files = smollm2_files(&model);
    let want: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(local.path(f)).unwrap())
        .collect();
    switch_on(&p.faults, fault, false);
    let mut failed = 0;
    for (f, w) in files.iter().zip(&want) {
        failed += read_file_checked(&remote.m.path(f), w, &[libc::EIO])
            .errors
            .len();
    }
    remote.assert_alive();
    assert!(p.injected() > 0, "{fault:?}: no fault injected");
    let j = remote.m.ctl_json();
    if fault != Fault::Delay {
        assert!(j["remote"][0]["retries"].as_u64().unwrap() > 0, "{j}");
    }
    assert_eq!(j["remote"][0]["changed"], false, "{j}");
    p.faults.clear();
    for (f, w) in files.iter().zip(&want) {
        let path = remote.m.path(f);
        remote.drop_caches(&path);
        let o = read_file_checked(&path, w, &[]);
        assert_eq!(o.ok_bytes, w.len() as u64, "{f}");
    }
    remote.assert_alive();
    eprintln!(
        "{fault:?}: {failed} MiB reads failed with faults on; remote: {}",
        remote.m.ctl_json()["remote"][0]
    );
    p.assert_clean();
}

macro_rules! fault_tests {
    ($($name:ident: $fault:expr;)*) => {
        mod in_process {
            use super::*;
            $(
                needs! { [model]
                fn $name() {
                    in_process($fault);
                }
                }
            )*
        }
        mod fuse_mount {
            use super::*;
            $(
                needs! { [model, fuse]
                fn $name() {
                    through_mount($fault);
                }
                }
            )*
        }
    };
}

fault_tests! {
    delay: Fault::Delay;
    dropped_connections: Fault::Drop;
    error_500: Fault::Error500;
    error_503: Fault::Error503;
    truncated_bodies: Fault::Truncate;
    all_mixed: Fault::Mixed;
}

// ---------------------------------------------------------------------------
// A small synthetic model: retries exhausted, a changed object, ctl

const SMALL_PART: &str = "32768"; // blocks of 4 KiB

/// A synthetic GGUF of 16 Q8_0 tensors of 256 KiB-ish each (4.4 MB): the
/// demo model is smaller than the 1 MiB that the header read fetches, so
/// all of it would be cached at mount.
struct SmallModel {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn small_model() -> SmallModel {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.gguf");
    q8_0_gguf(&path, 16, 0x5eed_fa17);
    SmallModel { _dir: dir, path }
}

/// The byte range of the 4 KiB blocks holding `t`'s data.
fn blocks_of(t: &GgufTensorInfo) -> std::ops::Range<u64> {
    let b = 4096;
    (t.offset / b * b)..(t.offset + t.n_bytes).next_multiple_of(b)
}

needs! { [fuse]
/// Retries exhausted on the blocks of one tensor: its file fails with EIO,
/// every tensor file whose blocks it does not share still reads right,
/// `ctl` counts the retries and the failure, and once the blocks can be
/// fetched again the file reads right, without a remount.
fn retries_exhausted_fail_one_file_and_the_others_still_read() {
    if !fuse_available() {
        return;
    }
    let small = small_model();
    let (_s, p) = server_and_proxy(std::fs::read(&small.path).unwrap());
    let local = Mounted::new(&small.path, &[]);
    let mut remote = mount_url(&p.url("m.gguf"), &daemon_env(SMALL_PART, "2"));
    let all = tensors(&small.path);
    // The last tensor: far from the first MiB that the header read fetched.
    let victim = all.last().expect("tensors").clone();
    let bad = blocks_of(&victim);
    let others: Vec<&GgufTensorInfo> = all
        .iter()
        .filter(|t| {
            let r = blocks_of(t);
            r.end <= bad.start || bad.end <= r.start
        })
        .collect();
    assert!(others.len() >= 3, "too few tensors outside {bad:?}");
    *p.faults.error_range.lock().unwrap() = Some(bad.clone());

    let victim_file = format!("{}.f32", victim.name);
    let want_victim = std::fs::read(local.path(&victim_file)).unwrap();
    let t = Instant::now();
    let o = read_file_checked(&remote.m.path(&victim_file), &want_victim, &[libc::EIO]);
    assert!(
        !o.errors.is_empty(),
        "{victim_file} read despite the faults on {bad:?}: {}",
        remote.m.ctl()
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    for t in &others {
        let f = format!("{}.f32", t.name);
        let want = std::fs::read(local.path(&f)).unwrap();
        assert_eq!(
            read_file_checked(&remote.m.path(&f), &want, &[]).ok_bytes,
            want.len() as u64
        );
    }
    remote.assert_alive();
    let j = remote.m.ctl_json();
    let r = &j["remote"][0];
    assert!(r["retries"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["failures"].as_u64().unwrap() >= 1, "{r}");
    let ctl = remote.m.ctl();
    let line = ctl
        .lines()
        .find(|l| l.starts_with("remote:"))
        .unwrap_or_else(|| panic!("no remote line in ctl:\n{ctl}"));
    assert!(
        !line.contains(" 0 retries") && !line.contains(" 0 failures"),
        "{line}"
    );

    p.faults.clear();
    let path = remote.m.path(&victim_file);
    remote.drop_caches(&path);
    let o = read_file_checked(&path, &want_victim, &[]);
    assert_eq!(o.ok_bytes, want_victim.len() as u64);
    remote.assert_alive();
    p.assert_clean();
}
}

/// Every tensor file of `model`, read through `remote`: each piece
/// either equals the v1 bytes (from `local`) or fails with ESTALE/EIO.
/// Returns the files that failed.
fn read_all(model: &Path, remote: &RemoteMount, local: &Mounted) -> Vec<String> {
    let mut failed = Vec::new();
    for t in tensors(model) {
        let f = format!("{}.f32", t.name);
        let want = std::fs::read(local.path(&f)).unwrap();
        let o = read_file_checked(&remote.m.path(&f), &want, &[libc::ESTALE, libc::EIO]);
        if !o.errors.is_empty() {
            failed.push(f);
        }
    }
    failed
}

/// The object replaced during a mount (new bytes, same size and header)
/// while the proxy also rewrites ETags (and, with `strip_if_match`, hides
/// If-Match from the server, which then serves the new bytes: only the
/// client's check of the response's ETag stands between them and the
/// reader). Files read before stay right; files not read before fail with
/// ESTALE or EIO; no byte of the new version is ever served; the daemon
/// lives.
fn changed_object(strip_if_match: bool) {
    if !fuse_available() {
        return;
    }
    let small = small_model();
    let model = small.path.as_path();
    let v1 = std::fs::read(model).unwrap();
    let g = GgufFile::read(&SourceFile::open(model).unwrap()).unwrap();
    let mut v2 = v1.clone();
    for b in &mut v2[g.data_offset as usize..] {
        *b ^= 0x5a;
    }
    let (s, p) = server_and_proxy(v1);
    let local = Mounted::new(model, &[]);
    let mut remote = mount_url(&p.url("m.gguf"), &daemon_env(SMALL_PART, "3"));
    let all = tensors(model);
    let first = format!("{}.f32", all[0].name);
    let want_first = std::fs::read(local.path(&first)).unwrap();
    assert_eq!(
        std::fs::read(remote.m.path(&first)).unwrap(),
        want_first,
        "before the change"
    );

    s.replace(v2, "\"v2\"");
    *p.faults.rewrite_etag.lock().unwrap() = Some("\"v2-rewritten\"".into());
    p.faults
        .strip_if_match
        .store(strip_if_match, Ordering::SeqCst);
    let failed = read_all(model, &remote, &local);
    // Every tensor whose blocks were not fetched before the change (by the
    // header read, the first MiB, or by the read of the first tensor)
    // fails.
    let fetched_before = (1u64 << 20).max(blocks_of(&all[0]).end);
    for t in &all[1..] {
        if blocks_of(t).start >= fetched_before {
            let f = format!("{}.f32", t.name);
            assert!(failed.contains(&f), "{f} read after the change");
        }
    }
    assert!(!failed.is_empty());
    remote.assert_alive();
    let j = remote.m.ctl_json();
    assert_eq!(j["remote"][0]["changed"], true, "{j}");
    assert!(remote.m.ctl().contains("CHANGED"));
    // Sticky: the faults off, the object is still another version.
    p.faults.clear();
    assert!(!read_all(model, &remote, &local).is_empty());
    remote.assert_alive();
    p.assert_clean();
}

needs! { [fuse]
fn etag_rewritten_and_object_replaced_mid_mount_is_estale_never_mixed() {
    changed_object(false);
}
}

needs! { [fuse]
fn object_replaced_behind_a_server_ignoring_if_match_is_estale_never_mixed() {
    changed_object(true);
}
}

/// The proxy relays chunked responses and close-delimited bodies of other
/// servers verbatim (an S3-compatible server may send either).
#[test]
fn proxy_relays_chunked_and_close_delimited_bodies() {
    use std::io::{BufRead, BufReader, Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for (i, c) in l.incoming().enumerate() {
            let mut c = c.unwrap();
            let mut r = BufReader::new(c.try_clone().unwrap());
            loop {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                if line.trim_end().is_empty() {
                    break;
                }
            }
            if i == 0 {
                c.write_all(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                      5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
                )
                .unwrap();
            } else {
                c.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close")
                    .unwrap();
                return;
            }
        }
    });
    let p = FaultProxy::start(addr);
    let get = |conn_close: bool| {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", p.port)).unwrap();
        let extra = if conn_close {
            "Connection: close\r\n"
        } else {
            ""
        };
        write!(c, "GET /x HTTP/1.1\r\nHost: h\r\n{extra}\r\n").unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // Chunked: read until the last chunk's trailers end.
        loop {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
            if out.ends_with(b"X-T: 1\r\n\r\n") {
                break;
            }
        }
        String::from_utf8(out).unwrap()
    };
    let a = get(false);
    assert!(
        a.ends_with("5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nX-T: 1\r\n\r\n"),
        "{a:?}"
    );
    let b = get(true);
    assert!(b.ends_with("\r\n\r\nuntil close"), "{b:?}");
    p.assert_clean();
}

needs! { [fuse]
/// SIGTERM stops a foreground mount of a remote source cleanly (exit 0,
/// unmounted), as it does a local one: the remote I/O runtime's threads,
/// started while the source opened, must not take the signal (its default
/// action killed the daemon and left a dead mount).
fn sigterm_unmounts_a_remote_mount_cleanly() {
    if !fuse_available() {
        return;
    }
    let small = small_model();
    let (_s, p) = server_and_proxy(std::fs::read(&small.path).unwrap());
    for _ in 0..3 {
        let mut remote = mount_url(&p.url("m.gguf"), &[]);
        // A request after the mount too (the runtime restarted).
        let first = format!("{}.f32", tensors(&small.path)[0].name);
        std::fs::read(remote.m.path(&first)).unwrap();
        remote.m.signal(libc::SIGTERM);
        let st = remote.m.wait_exit(10).expect("daemon did not exit");
        assert!(st.success(), "{st}:\n{}", remote.m.log());
        assert!(
            !common::mount::is_mounted(&remote.m.mp),
            "still mounted after SIGTERM"
        );
    }
}
}

needs! { [fuse]
/// Mixed faults with a single retry: some reads fail, with EIO only, the
/// others return the right bytes; the daemon lives; once the faults stop
/// every file reads right without a remount.
fn mixed_faults_with_one_retry_give_right_bytes_or_eio() {
    if !fuse_available() {
        return;
    }
    let small = small_model();
    let (_s, p) = server_and_proxy(std::fs::read(&small.path).unwrap());
    let local = Mounted::new(&small.path, &[]);
    let mut remote = mount_url(&p.url("m.gguf"), &daemon_env(SMALL_PART, "1"));
    switch_on(&p.faults, Fault::Mixed, false);
    p.faults.error_every.store(2, Ordering::SeqCst);
    let files: Vec<String> = tensors(&small.path)
        .iter()
        .map(|t| format!("{}.f32", t.name))
        .collect();
    let mut eio = 0;
    for f in &files {
        let want = std::fs::read(local.path(f)).unwrap();
        eio += read_file_checked(&remote.m.path(f), &want, &[libc::EIO])
            .errors
            .len();
    }
    remote.assert_alive();
    let j = remote.m.ctl_json();
    assert!(j["remote"][0]["failures"].as_u64().unwrap() > 0, "{j}");
    assert!(eio > 0, "no read failed with one retry: {j}");
    p.faults.clear();
    for f in &files {
        let want = std::fs::read(local.path(f)).unwrap();
        let path = remote.m.path(f);
        remote.drop_caches(&path);
        assert_eq!(
            read_file_checked(&path, &want, &[]).ok_bytes,
            want.len() as u64,
            "{f}"
        );
    }
    remote.assert_alive();
    p.assert_clean();
}
}

// ---------------------------------------------------------------------------
// Stalled servers: a body that stops halfway, a request never answered

/// How a server stops answering.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// Headers and half the body, then nothing.
    MidBody,
    /// The request is read and never answered.
    NoAnswer,
}

fn stall_on(f: &ProxyFaults, how: Stall) {
    match how {
        Stall::MidBody => f.stall_every.store(1, Ordering::SeqCst),
        Stall::NoAnswer => f.hang_every.store(1, Ordering::SeqCst),
    }
}

/// Run `op` on a thread of its own and wait `limit` for it at most:
/// `Some((its result, how long it took))`, or None if it did not finish
/// (the thread is left behind: the test fails, and the mount's teardown
/// ends the call).
fn timed<T: Send + 'static>(
    limit: Duration,
    op: impl FnOnce() -> T + Send + 'static,
) -> Option<(T, Duration)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let r = op();
        let _ = tx.send((r, t.elapsed()));
    });
    rx.recv_timeout(limit).ok()
}

/// In-process: a read from a server that stalls (either way) fails with
/// EIO within the deadline (plus a margin), however many retries are
/// allowed; the source reads again once the server answers.
#[test]
fn stalled_reads_fail_within_the_deadline_in_process() {
    let data: Vec<u8> = (0..6_000_000u32).map(|i| (i * 13 + 5) as u8).collect();
    let (_s, p) = server_and_proxy(data.clone());
    let deadline = Duration::from_millis(1500);
    let o = RemoteOptions {
        part_size: 1 << 20,
        max_retries: 100,
        backoff: Duration::from_millis(10),
        deadline,
        ..RemoteOptions::default()
    };
    let src = SourceFile::open_remote(&p.url("m.gguf"), o).unwrap();
    for (i, how) in [Stall::MidBody, Stall::NoAnswer].into_iter().enumerate() {
        stall_on(&p.faults, how);
        let at = (1 + 2 * i as u64) << 20;
        let t = Instant::now();
        let mut buf = vec![0u8; 300_000];
        let e = src.read_at(at, &mut buf).unwrap_err();
        let took = t.elapsed();
        assert_eq!(e.errno(), libc::EIO, "{how:?}: {e}");
        assert!(
            took < deadline + Duration::from_secs(2),
            "{how:?}: failed after {took:?}: {e}"
        );
        let m = e.to_string();
        assert!(
            m.starts_with(&p.url("m.gguf")) && m.contains("deadline") && m.contains("bytes"),
            "{how:?}: {m}"
        );
        assert!(p.stalls() > 0, "{how:?}: no stall injected");
        p.faults.clear();
        src.read_at(at, &mut buf).unwrap();
        assert!(
            buf[..] == data[at as usize..at as usize + buf.len()],
            "{how:?}"
        );
    }
    p.assert_clean();
}

needs! { [fuse]
/// Opening against a dead server fails in seconds (the open deadline,
/// 10 s by default), with an error naming the URL: a server that accepts
/// and never answers, one that refuses connections, and one that stalls
/// in the middle of the first GET's body. (Before: 60 s per attempt, six
/// attempts: 380 s.)
fn mount_against_a_dead_server_fails_in_seconds() {
    if !fuse_available() {
        return;
    }
    let small = small_model();
    let data = std::fs::read(&small.path).unwrap();
    let (_s1, silent) = server_and_proxy(data.clone());
    silent.faults.hang_every.store(1, Ordering::SeqCst);
    let (_s2, stalling) = server_and_proxy(data);
    stalling.faults.stall_every.store(1, Ordering::SeqCst);
    let refusing = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        format!("http://127.0.0.1:{port}/m.gguf")
    };
    let cases = [
        ("never answers", silent.url("m.gguf")),
        ("refuses", refusing),
        ("stalls mid-body", stalling.url("m.gguf")),
    ];
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(what, url)| {
            std::thread::spawn(move || {
                let dir = tempfile::tempdir().unwrap();
                let jobs = tempfile::tempdir().unwrap();
                let mp = dir.path().join("mnt");
                std::fs::create_dir(&mp).unwrap();
                let t = Instant::now();
                let mut child = std::process::Command::new(common::mount::mount_bin())
                    .arg(&url)
                    .arg(&mp)
                    .args(["--foreground", "--jobs-dir"])
                    .arg(jobs.path())
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                let mut status = None;
                while t.elapsed() < Duration::from_secs(60) {
                    if let Some(st) = child.try_wait().unwrap() {
                        status = Some(st);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let took = t.elapsed();
                if status.is_none() {
                    let _ = child.kill();
                }
                let out = child.wait_with_output().unwrap();
                let stderr = String::from_utf8_lossy(&out.stderr).to_string();
                if common::mount::is_mounted(&mp) {
                    let _ = std::process::Command::new("fusermount3")
                        .args(["-u", "-z"])
                        .arg(&mp)
                        .status();
                }
                (what, url, status, took, stderr)
            })
        })
        .collect();
    for r in runs {
        let (what, url, status, took, stderr) = r.join().unwrap();
        let status = status.unwrap_or_else(|| panic!("{what}: still opening after {took:?}"));
        assert!(!status.success(), "{what}: mounted?\n{stderr}");
        assert!(
            took < Duration::from_secs(20),
            "{what}: failed after {took:?}\n{stderr}"
        );
        assert!(
            stderr.contains(&url),
            "{what}: the URL is not named:\n{stderr}"
        );
        eprintln!("{what}: failed in {took:?}: {}", stderr.trim_end());
    }
}
}

needs! { [fuse]
/// Through a mount (2 FUSE threads, the default here): readers of a server
/// that stalls (either way) get EIO within the deadline plus a margin
/// (twice the deadline: the kernel asks again for a page it failed to
/// read ahead),
/// and meanwhile `ls`, `stat`, `ctl`, `ctl.json` and `index.json` answer
/// within 1 s each; the log names the object and the range of the failed
/// read; once the server answers, the same files read right. (Before: the
/// readers held both FUSE threads for minutes and `ls` hung.)
fn stalled_reads_fail_in_the_deadline_and_the_mount_keeps_answering() {
    if !fuse_available() {
        return;
    }
    let small = small_model();
    let (_s, p) = server_and_proxy(std::fs::read(&small.path).unwrap());
    let local = Mounted::new(&small.path, &[]);
    let mut env = daemon_env(SMALL_PART, "30");
    env.push(("RKNOT_REMOTE_DEADLINE_S", "3"));
    let mut remote = mount_url(&p.url("m.gguf"), &env);
    let deadline = Duration::from_secs(3);
    let all = tensors(&small.path);
    // Tensors beyond the first MiB (fetched at open): 4 per kind of stall.
    let files: Vec<String> = all[5..13]
        .iter()
        .map(|t| format!("{}.f32", t.name))
        .collect();
    let mp = remote.m.mp.clone();
    for (how, batch) in [Stall::MidBody, Stall::NoAnswer]
        .into_iter()
        .zip(files.chunks(4))
    {
        stall_on(&p.faults, how);
        let readers: Vec<_> = batch
            .iter()
            .map(|f| {
                let path = mp.join(f);
                std::thread::spawn(move || {
                    let t = Instant::now();
                    let mut buf = vec![0u8; 1 << 20];
                    let r = std::fs::File::open(&path).and_then(|f| f.read_at(&mut buf, 0));
                    (r.map_err(|e| e.raw_os_error()), t.elapsed())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        // Everything else answers while the readers wait.
        let checks_until = Instant::now() + deadline;
        let mut rounds = 0;
        while Instant::now() < checks_until || rounds == 0 {
            rounds += 1;
            type Probe = Box<dyn FnOnce() -> bool + Send>;
            let probes: [(&str, Probe); 5] = [
                ("ls", {
                    let mp = mp.clone();
                    Box::new(move || std::fs::read_dir(&mp).is_ok_and(|d| d.count() > 4))
                }),
                ("stat", {
                    let f = mp.join(&batch[0]);
                    Box::new(move || std::fs::metadata(&f).is_ok())
                }),
                ("cat ctl", {
                    let f = mp.join("ctl");
                    Box::new(move || {
                        std::fs::read_to_string(&f).is_ok_and(|s| s.contains("remote"))
                    })
                }),
                ("cat ctl.json", {
                    let f = mp.join("ctl.json");
                    Box::new(move || std::fs::read(&f).is_ok_and(|b| !b.is_empty()))
                }),
                ("cat index.json", {
                    let f = mp.join("index.json");
                    Box::new(move || std::fs::read(&f).is_ok_and(|b| !b.is_empty()))
                }),
            ];
            for (what, probe) in probes {
                let (ok, took) = timed(Duration::from_secs(5), probe).unwrap_or_else(|| {
                    panic!("{how:?}: `{what}` did not answer in 5 s while reads stall")
                });
                assert!(ok, "{how:?}: `{what}` failed");
                assert!(
                    took < Duration::from_secs(1),
                    "{how:?}: `{what}` took {took:?}"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for (f, r) in batch.iter().zip(readers) {
            // Joined within the test's own bound: a reader that hangs
            // fails it instead of hanging it.
            let limit = Instant::now() + deadline + Duration::from_secs(10);
            while !r.is_finished() && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(r.is_finished(), "{how:?}: the read of {f} still waits");
            let (res, took) = r.join().unwrap();
            assert_eq!(res, Err(Some(libc::EIO)), "{how:?}: {f}");
            // Twice the deadline: through the page cache, the kernel
            // asks once more for a page its read-ahead failed to get.
            assert!(
                took < 2 * deadline + Duration::from_secs(3),
                "{how:?}: {f} failed after {took:?}"
            );
        }
        remote.assert_alive();
        p.faults.clear();
    }
    let log = remote.m.log();
    assert!(
        log.lines().any(|l| l.contains("read of")
            && l.contains(&p.url("m.gguf"))
            && l.contains("GET bytes")
            && l.contains("deadline")),
        "no log line names the object and range of a failed read:\n{log}"
    );
    for f in &files {
        let want = std::fs::read(local.path(f)).unwrap();
        let path = remote.m.path(f);
        remote.drop_caches(&path);
        let o = read_file_checked(&path, &want, &[]);
        assert_eq!(o.ok_bytes, want.len() as u64, "{f}");
    }
    remote.assert_alive();
    p.assert_clean();
}
}
