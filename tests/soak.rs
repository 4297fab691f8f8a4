//! The soak test of remote mounts (loopback only, bounded: about 80 s): a
//! mount of an http source behind the fault proxy of
//! tests/common/fault_proxy.rs is read by 8 concurrent readers while the
//! proxy cycles through stalls mid-body, requests never answered, resets,
//! 5xx, everything at once, and last the object replaced mid-way. All the
//! while `ls` and `cat ctl` are timed: each must answer within 1 s. Every
//! byte a reader gets is compared with the reference (a local mount of the
//! same model): 0 wrong bytes. Errors are EIO (ESTALE once the object was
//! replaced), never anything else; the daemon lives throughout; once the
//! faults stop (before the replacement) every file reads right again.

mod common;

use common::needs;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fault_proxy::{FaultProxy, ProxyFaults};
use common::http_server::Server;
use common::mount::{Mounted, fuse_available};
use rknot::format::gguf::GgufFile;
use rknot::source::SourceFile;

/// A synthetic GGUF of 24 Q8_0 tensors (6.7 MB): several times the
/// daemon's memory cache of remote blocks, so reads keep going to the
/// server.
fn model(dir: &Path) -> PathBuf {
    let path = dir.join("soak.gguf");
    common::q8_0_gguf(&path, 24, 0x50a6_0001);
    path
}

/// What the readers saw.
#[derive(Default)]
struct Tally {
    ok_bytes: AtomicU64,
    wrong_bytes: AtomicU64,
    eio: AtomicU64,
    estale: AtomicU64,
    /// Errors other than EIO / ESTALE, or ESTALE before the replacement.
    unexpected: Mutex<Vec<String>>,
    /// The longest a single 1 MiB read took.
    slowest_read_ms: AtomicU64,
}

/// Read `path` in 1 MiB preads, each compared with `want`; `stale_ok`:
/// ESTALE is allowed (the object was replaced).
fn read_once(path: &Path, want: &[u8], stale_ok: &AtomicBool, tally: &Tally) {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            tally
                .unexpected
                .lock()
                .unwrap()
                .push(format!("open {}: {e}", path.display()));
            return;
        }
    };
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advisory call on a descriptor we own. The kernel's page
        // cache would otherwise serve the second pass.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0usize;
    while off < want.len() {
        let n = buf.len().min(want.len() - off);
        let t = Instant::now();
        let r = f.read_at(&mut buf[..n], off as u64);
        tally
            .slowest_read_ms
            .fetch_max(t.elapsed().as_millis() as u64, Ordering::SeqCst);
        match r {
            Ok(0) => {
                tally
                    .unexpected
                    .lock()
                    .unwrap()
                    .push(format!("{}: EOF at {off}", path.display()));
                return;
            }
            Ok(k) => {
                let wrong = buf[..k]
                    .iter()
                    .zip(&want[off..off + k])
                    .filter(|(a, b)| a != b)
                    .count();
                tally.wrong_bytes.fetch_add(wrong as u64, Ordering::SeqCst);
                tally
                    .ok_bytes
                    .fetch_add((k - wrong) as u64, Ordering::SeqCst);
                off += k;
            }
            Err(e) => {
                match e.raw_os_error() {
                    Some(libc::EIO) => tally.eio.fetch_add(1, Ordering::SeqCst),
                    Some(libc::ESTALE) if stale_ok.load(Ordering::SeqCst) => {
                        tally.estale.fetch_add(1, Ordering::SeqCst)
                    }
                    _ => {
                        tally
                            .unexpected
                            .lock()
                            .unwrap()
                            .push(format!("{} at {off}: {e}", path.display()));
                        0
                    }
                };
                off += n;
            }
        }
    }
}

/// `op` on a thread of its own, waited for 5 s at most: how long it took,
/// or None (it hangs).
fn timed(op: impl FnOnce() -> bool + Send + 'static) -> Option<(bool, Duration)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let ok = op();
        let _ = tx.send((ok, t.elapsed()));
    });
    rx.recv_timeout(Duration::from_secs(5)).ok()
}

type Phase = (&'static str, Duration, fn(&ProxyFaults));

needs! { [fuse]
fn soak_eight_readers_through_cycling_faults() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let server = Server::start(std::fs::read(&model).unwrap());
    let proxy = FaultProxy::start(server.addr());
    let local = Mounted::new(&model, &[]);
    let jobs = tempfile::tempdir().unwrap();
    let mut remote = Mounted::with_env(
        Path::new(&proxy.url("m.gguf")),
        &["--jobs-dir", jobs.path().to_str().unwrap()],
        &[
            // Blocks of 32 KiB, a 1 MiB memory cache: many requests.
            ("RKNOT_REMOTE_PART_SIZE", "262144"),
            ("RKNOT_REMOTE_CACHE_BYTES", "1048576"),
            ("RKNOT_REMOTE_RETRIES", "30"),
            ("RKNOT_REMOTE_BACKOFF_MS", "1"),
            ("RKNOT_REMOTE_DEADLINE_S", "3"),
        ],
    );
    let names: Vec<String> = GgufFile::read(&SourceFile::open(&model).unwrap())
        .unwrap()
        .tensors
        .iter()
        .map(|t| format!("{}.f32", t.name))
        .collect();
    let want: Arc<Vec<Vec<u8>>> = Arc::new(
        names
            .iter()
            .map(|n| std::fs::read(local.path(n)).unwrap())
            .collect(),
    );
    let paths: Arc<Vec<PathBuf>> = Arc::new(names.iter().map(|n| remote.path(n)).collect());

    let stop = Arc::new(AtomicBool::new(false));
    let stale_ok = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let readers: Vec<_> = (0..8)
        .map(|r| {
            let (stop, stale_ok, tally) = (stop.clone(), stale_ok.clone(), tally.clone());
            let (want, paths) = (want.clone(), paths.clone());
            std::thread::spawn(move || {
                let mut i = r * 3;
                while !stop.load(Ordering::SeqCst) {
                    let k = i % paths.len();
                    read_once(&paths[k], &want[k], &stale_ok, &tally);
                    i += 1;
                }
            })
        })
        .collect();

    // `ls` and `cat ctl` timed throughout (and `drop-cache` now and then,
    // so the decoded chunks are decoded again from remote bytes).
    let slowest = Arc::new(Mutex::new((Duration::ZERO, String::new())));
    let hung = Arc::new(Mutex::new(Vec::<String>::new()));
    let probes = {
        let (stop, slowest, hung) = (stop.clone(), slowest.clone(), hung.clone());
        let mp = remote.mp.clone();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let ls = {
                    let mp = mp.clone();
                    move || std::fs::read_dir(&mp).is_ok_and(|d| d.count() > 20)
                };
                let ctl = {
                    let f = mp.join("ctl");
                    move || std::fs::read_to_string(&f).is_ok_and(|s| s.contains("remote"))
                };
                let drop_cache = {
                    let f = mp.join("ctl");
                    move || std::fs::write(&f, "drop-cache\n").is_ok()
                };
                type Op = Box<dyn FnOnce() -> bool + Send>;
                let mut ops: Vec<(&str, Op)> =
                    vec![("ls", Box::new(ls) as Op), ("cat ctl", Box::new(ctl) as Op)];
                if n.is_multiple_of(10) {
                    ops.push(("drop-cache", Box::new(drop_cache)));
                }
                for (what, op) in ops {
                    match timed(op) {
                        Some((ok, took)) => {
                            let mut s = slowest.lock().unwrap();
                            if !ok {
                                hung.lock().unwrap().push(format!("{what} failed"));
                            }
                            if took > s.0 {
                                *s = (took, what.to_string());
                            }
                        }
                        None => hung.lock().unwrap().push(format!("{what} hung for 5 s")),
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };

    let phases: [Phase; 7] = [
        ("clean", Duration::from_secs(5), |_| {}),
        ("stalls mid-body", Duration::from_secs(12), |f| {
            f.stall_ms.store(5000, Ordering::SeqCst);
            f.stall_every.store(4, Ordering::SeqCst);
        }),
        ("requests never answered", Duration::from_secs(12), |f| {
            f.stall_ms.store(5000, Ordering::SeqCst);
            f.hang_every.store(5, Ordering::SeqCst);
        }),
        ("resets", Duration::from_secs(8), |f| {
            f.drop_every.store(3, Ordering::SeqCst)
        }),
        ("5xx", Duration::from_secs(8), |f| {
            f.error_status.store(500, Ordering::SeqCst);
            f.error_every.store(3, Ordering::SeqCst);
        }),
        ("everything at once", Duration::from_secs(12), |f| {
            f.stall_ms.store(5000, Ordering::SeqCst);
            f.stall_every.store(11, Ordering::SeqCst);
            f.hang_every.store(13, Ordering::SeqCst);
            f.drop_every.store(5, Ordering::SeqCst);
            f.error_every.store(7, Ordering::SeqCst);
            f.truncate_every.store(9, Ordering::SeqCst);
            f.delay_ms.store(30, Ordering::SeqCst);
            f.delay_every.store(3, Ordering::SeqCst);
        }),
        ("clean again", Duration::from_secs(5), |_| {}),
    ];
    let mut seen = Vec::new();
    for (name, length, switch) in phases {
        proxy.faults.clear();
        switch(&proxy.faults);
        let before = (
            tally.eio.load(Ordering::SeqCst),
            proxy.injected(),
            tally.ok_bytes.load(Ordering::SeqCst),
        );
        std::thread::sleep(length);
        assert!(
            remote.try_wait().is_none(),
            "daemon died in {name}:\n{}",
            remote.log()
        );
        seen.push(format!(
            "{name}: {} faults injected, {} EIO, {} MB right",
            proxy.injected() - before.1,
            tally.eio.load(Ordering::SeqCst) - before.0,
            (tally.ok_bytes.load(Ordering::SeqCst) - before.2) / 1_000_000
        ));
    }
    // The faults off (the last phase): every file reads right, without a
    // remount, while the readers go on.
    let check = Tally::default();
    for (p, w) in paths.iter().zip(want.iter()) {
        read_once(p, w, &AtomicBool::new(false), &check);
    }
    assert_eq!(
        (
            check.wrong_bytes.load(Ordering::SeqCst),
            check.eio.load(Ordering::SeqCst)
        ),
        (0, 0),
        "with the faults off: {:?}\n{}",
        check.unexpected.lock().unwrap(),
        seen.join("\n")
    );
    assert!(check.unexpected.lock().unwrap().is_empty());
    // The object replaced mid-way, last: from now on reads are right
    // (blocks cached before) or fail with ESTALE/EIO, never new bytes.
    proxy.faults.clear();
    stale_ok.store(true, Ordering::SeqCst);
    proxy.faults.replaced.store(true, Ordering::SeqCst);
    let before = tally.estale.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(8));
    seen.push(format!(
        "replaced: {} ESTALE",
        tally.estale.load(Ordering::SeqCst) - before
    ));
    stop.store(true, Ordering::SeqCst);
    for r in readers {
        r.join().unwrap();
    }
    probes.join().unwrap();
    assert!(
        remote.try_wait().is_none(),
        "daemon died:\n{}",
        remote.log()
    );

    let (slow, what) = slowest.lock().unwrap().clone();
    let report = format!(
        "{}\nreaders: {} MB right, {} wrong bytes, {} EIO, {} ESTALE, slowest 1 MiB read {} ms; \
         slowest probe: {what} {slow:?}; proxy: {} requests, {} faults, {} stalls",
        seen.join("\n"),
        tally.ok_bytes.load(Ordering::SeqCst) / 1_000_000,
        tally.wrong_bytes.load(Ordering::SeqCst),
        tally.eio.load(Ordering::SeqCst),
        tally.estale.load(Ordering::SeqCst),
        tally.slowest_read_ms.load(Ordering::SeqCst),
        proxy.requests(),
        proxy.injected(),
        proxy.stalls(),
    );
    eprintln!("{report}");
    assert_eq!(tally.wrong_bytes.load(Ordering::SeqCst), 0, "{report}");
    let unexpected = tally.unexpected.lock().unwrap().clone();
    assert!(unexpected.is_empty(), "{unexpected:?}\n{report}");
    let hung = hung.lock().unwrap().clone();
    assert!(hung.is_empty(), "{hung:?}\n{report}");
    assert!(
        slow < Duration::from_secs(1),
        "{what} took {slow:?}\n{report}"
    );
    // Stalls happened (retried within the deadline: reads need not fail).
    assert!(proxy.stalls() > 0, "{report}");
    assert!(
        tally.ok_bytes.load(Ordering::SeqCst) > 10_000_000,
        "{report}"
    );
    // Every read ends: one read() may wait out a few deadlines (3 s each:
    // the kernel splits it into page requests and asks again for a page
    // its read-ahead missed), never the minutes a stalled request held
    // before. (10.4 s was seen on a loaded 2-core machine: no tighter
    // bound is a property of the mount.)
    assert!(
        tally.slowest_read_ms.load(Ordering::SeqCst) < 30_000,
        "{report}"
    );
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(remote.path("ctl.json")).unwrap()).unwrap();
    assert!(j["remote"][0]["retries"].as_u64().unwrap() > 0, "{j}");
    proxy.assert_clean();
}
}

/// Before/after figures (not a check: prints them), with the default
/// settings: how long a read from a server that stalls mid-body takes to
/// fail, how long `ls` takes while two such reads wait (2 FUSE threads on
/// a 2-core machine), and how long a mount against a server that accepts
/// and never answers takes to fail. Minutes on code without deadlines:
/// `cargo test --profile ci --test soak -- --ignored --nocapture figures`.
#[test]
#[ignore = "measurement: prints before/after figures, up to 7 minutes on code without deadlines"]
fn figures_stalled_read_dead_mount_and_ls_latency() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let data = std::fs::read(&model).unwrap();
    let dead = {
        let server = Server::start(data.clone());
        let proxy = FaultProxy::start(server.addr());
        proxy.faults.hang_every.store(1, Ordering::SeqCst);
        std::thread::spawn(move || {
            let (mp, jobs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let t = Instant::now();
            let mut child = std::process::Command::new(common::mount::mount_bin())
                .arg(proxy.url("m.gguf"))
                .arg(mp.path())
                .args(["--foreground", "--jobs-dir"])
                .arg(jobs.path())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            while t.elapsed() < Duration::from_secs(500) {
                if child.try_wait().unwrap().is_some() {
                    return format!("{:.1} s", t.elapsed().as_secs_f64());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            drop(server);
            "still opening after 500 s".to_string()
        })
    };
    let server = Server::start(data);
    let proxy = FaultProxy::start(server.addr());
    let jobs = tempfile::tempdir().unwrap();
    let remote = Mounted::new(
        Path::new(&proxy.url("m.gguf")),
        &["--jobs-dir", jobs.path().to_str().unwrap()],
    );
    proxy.faults.stall_every.store(1, Ordering::SeqCst);
    let readers: Vec<_> = ["t10.weight.f32", "t20.weight.f32"]
        .iter()
        .map(|f| {
            let path = remote.path(f);
            std::thread::spawn(move || {
                let t = Instant::now();
                let mut buf = vec![0u8; 1 << 20];
                let r = std::fs::File::open(&path).and_then(|f| f.read_at(&mut buf, 0));
                (r.map_err(|e| e.to_string()), t.elapsed())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let mp = remote.mp.clone();
    let ls = match timed(move || std::fs::read_dir(&mp).is_ok_and(|d| d.count() > 0)) {
        Some((_, took)) => format!("{:.1} ms", took.as_secs_f64() * 1000.0),
        None => "hung (no answer in 5 s)".to_string(),
    };
    let mut reads = Vec::new();
    for r in readers {
        let limit = Instant::now() + Duration::from_secs(500);
        while !r.is_finished() && Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(50));
        }
        if r.is_finished() {
            let (res, took) = r.join().unwrap();
            reads.push(format!("{:.1} s ({res:?})", took.as_secs_f64()));
        } else {
            reads.push("still waiting after 500 s".to_string());
        }
    }
    eprintln!(
        "FIGURES: stalled reads failed after: {}; ls while 2 reads stall: {ls}; \
         mount against a server that never answers failed after: {}",
        reads.join(", "),
        dead.join().unwrap()
    );
    proxy.faults.clear();
}
