//! The decoded-cache section of `rknot bench mount`: files served from a
//! `--decoded-cache` store by FUSE passthrough, against a plain local file
//! holding the same bytes in the same directory (`--decoded-dir DIR`, so
//! both are on one filesystem: the filesystem decides the speed).
//!
//! Files: the Q4_K tensor file `q4_k.weight.f32` and the engine view
//! `model.safetensors` of the bench model (`sk32 --dense gguf`). Their
//! bytes are copied once from a plain mount (no store) into
//! `DIR/local-<name>`, the baseline.
//!
//! Every read here is one in-process pass: open, `read()` in 1 MiB blocks
//! to the end, close, timed wall-clock (the `dd bs=1M` pattern; `dd`'s own
//! figure leaves out `open()`, which is where the decode into the store and
//! the once-per-mount check happen). "Cold" means the file's page cache was
//! dropped before, untimed: `fdatasync` then `posix_fadvise(DONTNEED)` on
//! the local file, or on the store's entry (`DIR/cache/<hash>.data`, found
//! through its `.meta` sidecar) for a passthrough file, which is where the
//! kernel reads from; on tmpfs this drops nothing, so cold equals warm
//! there. Before a first load the page cache of the source files is
//! dropped too (pages the daemon has mapped stay). The local file and each
//! new store entry get one untimed cold read before they are timed cold:
//! on the development VM the first read of a newly written file runs at
//! about a third of later cold reads (the host caches the disk image), so
//! "cold" means the guest's page cache dropped, in that steady state.
//!
//! Per round, interleaved, medians over the rounds, ratios of medians
//! against the local file in the same state (cold or warm):
//! - the local file, cold and warm;
//! - a mount with `--decoded-cache DIR/cache`, the store emptied first:
//!   first load (the open decodes the whole file into the store), second
//!   load cold and warm (with the daemon's read() calls, `reads.total` of
//!   `ctl.json`, and its CPU time, utime + stime of /proc/PID/stat, over
//!   both), warm mmap touching one byte per 4 KiB page (and numpy.memmap
//!   doing the same, when a python3 with numpy is found: `$RKNOT_VENV`,
//!   ~/.cache/rknot/venv, then `python3`);
//! - the plain mount in page-cache mode (no store), cold (daemon cache
//!   dropped through `ctl`) and warm;
//! - a remount on the same store (new daemon): first open at once, cold
//!   (it waits for the entry's check, started at mount, which reads the
//!   entry from disk), then another remount for the first open at once
//!   warm, then a second open cold and warm; then two more remounts whose
//!   background check is done before the first open (an engine started
//!   after the mount), warm and cold. The goal (>= 0.95x) applies to those
//!   and to second opens; the rows "at once" show what an open that races
//!   the check pays.
//!
//! Checked (an error if wrong): the bytes read through the store's mount
//! equal the local file every round, and mmap of the passthrough files
//! gives them. If `ctl.json` says passthrough is off the section is skipped
//! with its reason.
//!
//! Optional, `RKNOT_LLAMA_BIN` (llama.cpp's tools, `tools/llama-cpp.sh
//! --print-bin-dir`; tools/test.sh exports it) and the SmolLM2 GGUF
//! (`RKNOT_SMOLLM2`, default models/SmolLM2-135M-Instruct.Q4_1.gguf):
//! llama.cpp's own "load time" of a one-token `llama-completion` (which
//! mmaps the model) of a local copy of the mount's `model.gguf` (F32), the
//! plain mount, and the store's mount (first load with an empty store,
//! second load), each in a new process.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::Value;

use super::{BResult, Daemon, MountBenchOpts, drop_page_cache, gbs, median, mmap_matches};

/// The served files measured: (name in the mount, short label).
const FILES: [(&str, &str); 2] = [
    ("q4_k.weight.f32", "q4_k.weight.f32"),
    ("model.safetensors", "model.safetensors"),
];

const MODE: &str = "decoded cache";

type Verdicts = Vec<(&'static str, &'static str, bool, String)>;

fn io_err(p: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", p.display())
}

/// Drop the page cache of local file `p`: its dirty pages written first
/// (DONTNEED keeps dirty pages), outside any timed region.
fn drop_local(p: &Path) -> BResult<()> {
    let f = File::open(p).map_err(|e| io_err(p, e))?;
    // SAFETY: a descriptor we own.
    unsafe { libc::fdatasync(f.as_raw_fd()) };
    drop(f);
    drop_page_cache(p)
}

/// One untimed cold read of a file just written, page cache dropped after.
/// On the development VM the first read of a newly written file from the
/// virtual disk runs at about a third of later cold reads (the host's
/// caching of the disk image), so without this the local file (written
/// at the start) and a new store entry would be timed in another state
/// than the files they are compared with.
fn prime(p: &Path, size: u64, buf: &mut [u8]) -> BResult<()> {
    drop_local(p)?;
    load_secs(p, size, buf)?;
    drop_local(p)
}

/// Seconds to open `p`, read it whole in 1 MiB blocks and close it; fails
/// unless exactly `size` bytes come back.
fn load_secs(p: &Path, size: u64, buf: &mut [u8]) -> BResult<f64> {
    let t = Instant::now();
    let mut f = File::open(p).map_err(|e| io_err(p, e))?;
    let mut n = 0u64;
    loop {
        let k = f.read(buf).map_err(|e| io_err(p, e))?;
        if k == 0 {
            break;
        }
        n += k as u64;
    }
    drop(f);
    let s = t.elapsed().as_secs_f64();
    if n != size {
        return Err(format!("{}: read {n} B, expected {size} B", p.display()));
    }
    Ok(s)
}

/// Whether files `a` and `b` hold the same bytes.
fn same_bytes(a: &Path, b: &Path) -> BResult<bool> {
    let (mut fa, mut fb) = (
        File::open(a).map_err(|e| io_err(a, e))?,
        File::open(b).map_err(|e| io_err(b, e))?,
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(|e| io_err(a, e))?;
        let nb = read_full(&mut fb, &mut bb).map_err(|e| io_err(b, e))?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read(&mut buf[n..])?;
        if k == 0 {
            break;
        }
        n += k;
    }
    Ok(n)
}

/// Copy `from` to a new file `to` in 1 MiB pieces; its size.
fn copy_file(from: &Path, to: &Path) -> BResult<u64> {
    let mut src = File::open(from).map_err(|e| io_err(from, e))?;
    let mut dst = File::create(to).map_err(|e| io_err(to, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = read_full(&mut src, &mut buf).map_err(|e| io_err(from, e))?;
        if n == 0 {
            break;
        }
        dst.write_all(&buf[..n]).map_err(|e| io_err(to, e))?;
        total += n as u64;
    }
    dst.sync_data().map_err(|e| io_err(to, e))?;
    Ok(total)
}

/// Seconds to touch (read one byte of) every 4 KiB page of `p` through a
/// shared read-only mapping; the mapping itself is not timed.
fn mmap_touch_secs(p: &Path) -> BResult<f64> {
    let f = File::open(p).map_err(|e| io_err(p, e))?;
    // SAFETY: read-only mapping of a file nobody writes while it is mapped.
    let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("mmap {}: {e}", p.display()))?;
    let t = Instant::now();
    let mut sum = 0u64;
    for i in (0..m.len()).step_by(4096) {
        sum = sum.wrapping_add(u64::from(m[i]));
    }
    std::hint::black_box(sum);
    Ok(t.elapsed().as_secs_f64())
}

/// The store entry (data file) holding served file `served`, found through
/// the `.meta` sidecars of `cache`.
fn entry_of(cache: &Path, served: &str) -> BResult<PathBuf> {
    let rd = std::fs::read_dir(cache).map_err(|e| io_err(cache, e))?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(stem) = name.strip_suffix(".meta").filter(|s| !s.starts_with('.')) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let Ok(meta) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let what = &meta["key"]["what"];
        let tensor = what["tensor"]
            .as_str()
            .zip(what["format"].as_str())
            .map(|(t, f)| format!("{t}.{f}"));
        if what["view"].as_str() == Some(served) || tensor.as_deref() == Some(served) {
            return Ok(cache.join(format!("{stem}.data")));
        }
    }
    Err(format!(
        "no entry for {served} in {} (was it decoded?)",
        cache.display()
    ))
}

/// CPU time (user + system) of process `pid` so far, ms.
fn cpu_ms(pid: u32) -> BResult<f64> {
    let p = format!("/proc/{pid}/stat");
    let s = std::fs::read_to_string(&p).map_err(|e| format!("{p}: {e}"))?;
    // Fields after "(comm)": state is field 3, utime 14, stime 15.
    let f: Vec<&str> = s
        .rsplit_once(')')
        .map(|x| x.1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    let (Some(u), Some(st)) = (tick(11), tick(12)) else {
        return Err(format!("cannot parse {p}"));
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((u + st) as f64 * 1e3 / hz)
}

fn reads_total(d: &Daemon) -> BResult<u64> {
    d.ctl_json()?["reads"]["total"]
        .as_u64()
        .ok_or_else(|| "ctl.json has no reads.total".to_string())
}

/// The filesystem `p` is on: type and options, from /proc/self/mounts.
fn fs_of(p: &Path) -> String {
    let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut best: Option<(usize, String)> = None;
    for l in mounts.lines() {
        let f: Vec<&str> = l.split(' ').collect();
        if f.len() < 4 || !p.starts_with(f[1]) {
            continue;
        }
        if best.as_ref().is_none_or(|b| f[1].len() >= b.0) {
            let huge = f[3]
                .split(',')
                .find(|o| o.starts_with("huge="))
                .map_or(String::new(), |h| format!(", {h}"));
            best = Some((f[1].len(), format!("{} on {}{huge}", f[2], f[1])));
        }
    }
    best.map_or_else(|| "unknown filesystem".into(), |b| b.1)
}

/// A python3 that can import `module` (`--version` style probe).
fn python_with(candidates: &[PathBuf], module: &str) -> Option<PathBuf> {
    candidates.iter().find_map(|py| {
        Command::new(py)
            .args(["-c", &format!("import {module}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .ok()
            .filter(|s| s.success())
            .map(|_| py.clone())
    })
}

fn numpy_python() -> Option<PathBuf> {
    let mut c = Vec::new();
    if let Some(v) = std::env::var_os("RKNOT_VENV") {
        c.push(PathBuf::from(v).join("bin/python3"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        c.push(PathBuf::from(h).join(".cache/rknot/venv/bin/python3"));
    }
    c.push(PathBuf::from("python3"));
    python_with(&c, "numpy")
}

/// Seconds a python script prints as its last line.
fn python_secs(py: &Path, script: &str, arg: &Path) -> BResult<f64> {
    let o = Command::new(py)
        .args(["-c", script])
        .arg(arg)
        .output()
        .map_err(|e| format!("{}: {e}", py.display()))?;
    let out = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        return Err(format!(
            "{} on {}: {}",
            py.display(),
            arg.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    out.lines()
        .last()
        .and_then(|l| l.trim().parse::<f64>().ok())
        .ok_or_else(|| format!("cannot parse python output: {out}"))
}

const NUMPY_TOUCH: &str = "import sys, time\nimport numpy as np\n\
m = np.memmap(sys.argv[1], dtype=np.uint8, mode='r')\n\
t = time.perf_counter()\nint(m[::4096].sum(dtype=np.uint64))\n\
print(time.perf_counter() - t)\n";

#[derive(Default)]
struct Samples {
    base_cold: Vec<f64>,
    base_warm: Vec<f64>,
    first: Vec<f64>,
    second_cold: Vec<f64>,
    second_warm: Vec<f64>,
    re_first_cold: Vec<f64>,
    re_first_warm: Vec<f64>,
    re_second_cold: Vec<f64>,
    re_second_warm: Vec<f64>,
    re_checked_cold: Vec<f64>,
    re_checked_warm: Vec<f64>,
    mmap_base: Vec<f64>,
    mmap_pt: Vec<f64>,
    np_base: Vec<f64>,
    np_pt: Vec<f64>,
    plain_cold: Vec<f64>,
    plain_warm: Vec<f64>,
    reads: Vec<u64>,
    cpu_ms: Vec<f64>,
}

/// Removes the files the section made on every way out.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            if p.is_dir() {
                let _ = std::fs::remove_dir_all(p);
            } else {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Run the decoded-cache section; appends to report `r` and `verdicts`.
pub(super) fn decoded_bench(
    o: &MountBenchOpts,
    sk32: &Path,
    gguf: &Path,
    r: &mut String,
    verdicts: &mut Verdicts,
    meter: &crate::progress::Meter,
) -> BResult<()> {
    let ddir = o
        .decoded_dir
        .clone()
        .unwrap_or_else(|| o.dir.join("decoded"));
    let made_ddir = !ddir.exists();
    std::fs::create_dir_all(&ddir).map_err(|e| io_err(&ddir, e))?;
    let ddir = std::fs::canonicalize(&ddir).map_err(|e| io_err(&ddir, e))?;
    let cache = ddir.join("cache");
    let mut cleanup = Cleanup(vec![cache.clone()]);
    let bin = &o.mount_bin;
    let cache_arg = cache.display().to_string();
    let start_dc = |mp: &str| {
        Daemon::start(
            bin,
            sk32,
            gguf,
            &o.dir.join(mp),
            &["--decoded-cache", &cache_arg],
        )
    };

    let plain = Daemon::start(bin, sk32, gguf, &o.dir.join("mnt-plain"), &[])?;
    let mut sizes = Vec::new();
    let mut local = Vec::new();
    for (name, _) in FILES {
        let p = ddir.join(format!("local-{name}"));
        cleanup.0.push(p.clone());
        sizes.push(copy_file(&plain.path(name), &p)?);
        local.push(p);
    }
    let fs = fs_of(&ddir);
    let _ = writeln!(
        r,
        "\ndecoded cache (--decoded-cache) served by FUSE passthrough: store and local baseline in {} ({fs})",
        ddir.display()
    );
    let numpy = numpy_python();
    let mut buf = vec![1u8; 1 << 20];
    let mut s: Vec<Samples> = FILES.iter().map(|_| Samples::default()).collect();
    let (mut build_rate, mut check_cold, mut check_warm) = (Vec::new(), Vec::new(), Vec::new());
    let _ = std::fs::remove_dir_all(&cache);
    // Warm-up: code, the source files, the local files (one cold read
    // each: see `prime`).
    for (fi, (name, _)) in FILES.iter().enumerate() {
        prime(&local[fi], sizes[fi], &mut buf)?;
        load_secs(&plain.path(name), sizes[fi], &mut buf)?;
    }

    for round in 0..o.rounds {
        meter.set_message(&format!(
            "decoded cache, round {} of {}",
            round + 1,
            o.rounds
        ));
        let _ = std::fs::remove_dir_all(&cache);
        let d = start_dc("mnt-dc")?;
        for (fi, (name, _)) in FILES.iter().enumerate() {
            let (lp, size, sm) = (&local[fi], sizes[fi], &mut s[fi]);
            let pt = d.path(name);
            drop_local(lp)?;
            sm.base_cold.push(load_secs(lp, size, &mut buf)?);
            sm.base_warm.push(load_secs(lp, size, &mut buf)?);

            drop_local(gguf)?;
            drop_local(sk32)?;
            sm.first.push(load_secs(&pt, size, &mut buf)?);
            if round == 0 && fi == 0 {
                let dc = d.ctl_json()?["decoded_cache"].clone();
                if dc["passthrough"] != Value::Bool(true)
                    || dc["passthrough_opens"].as_u64() == Some(0)
                {
                    let why = dc["passthrough_off_reason"]
                        .as_str()
                        .unwrap_or("no open was answered by passthrough")
                        .to_string();
                    let _ = writeln!(
                        r,
                        "  skipped: ctl.json says passthrough is off ({why}); nothing measured"
                    );
                    return Ok(());
                }
            }
            if !same_bytes(&pt, lp)? {
                return Err(format!(
                    "{name} read through the decoded-cache mount differs from the plain mount's"
                ));
            }
            if round == 0 && !mmap_matches(&pt, &std::fs::read(lp).map_err(|e| io_err(lp, e))?)? {
                return Err(format!("mmap of {name} by passthrough gives wrong bytes"));
            }

            let entry = entry_of(&cache, name)?;
            prime(&entry, size, &mut buf)?;
            drop_local(&entry)?;
            let (r0, c0) = (reads_total(&d)?, cpu_ms(d.pid())?);
            sm.second_cold.push(load_secs(&pt, size, &mut buf)?);
            sm.second_warm.push(load_secs(&pt, size, &mut buf)?);
            let (r1, c1) = (reads_total(&d)?, cpu_ms(d.pid())?);
            sm.reads.push(r1 - r0);
            sm.cpu_ms.push(c1 - c0);

            sm.mmap_base.push(mmap_touch_secs(lp)?);
            sm.mmap_pt.push(mmap_touch_secs(&pt)?);
            if let Some(py) = &numpy {
                sm.np_base.push(python_secs(py, NUMPY_TOUCH, lp)?);
                sm.np_pt.push(python_secs(py, NUMPY_TOUCH, &pt)?);
            }

            let pp = plain.path(name);
            plain.drop_caches_of(&pp)?;
            drop_local(gguf)?;
            drop_local(sk32)?;
            sm.plain_cold.push(load_secs(&pp, size, &mut buf)?);
            load_secs(&pp, size, &mut buf)?;
            sm.plain_warm.push(load_secs(&pp, size, &mut buf)?);
        }
        let dc = d.ctl_json()?["decoded_cache"].clone();
        build_rate.extend(rate(&dc, "bytes_built", "build_secs"));
        drop(d);

        // Remount: first opens cold (the check reads the entry from disk).
        let d = start_dc("mnt-dc")?;
        for (fi, (name, _)) in FILES.iter().enumerate() {
            drop_local(&entry_of(&cache, name)?)?;
            s[fi]
                .re_first_cold
                .push(load_secs(&d.path(name), sizes[fi], &mut buf)?);
        }
        let dc = d.ctl_json()?["decoded_cache"].clone();
        check_cold.extend(rate(&dc, "bytes_checked", "check_secs"));
        drop(d);
        // Again with the entries in the page cache, then second opens.
        let d = start_dc("mnt-dc")?;
        for (fi, (name, _)) in FILES.iter().enumerate() {
            let (pt, size, sm) = (d.path(name), sizes[fi], &mut s[fi]);
            sm.re_first_warm.push(load_secs(&pt, size, &mut buf)?);
            drop_local(&entry_of(&cache, name)?)?;
            sm.re_second_cold.push(load_secs(&pt, size, &mut buf)?);
            sm.re_second_warm.push(load_secs(&pt, size, &mut buf)?);
            if !same_bytes(&pt, &local[fi])? {
                return Err(format!(
                    "{name} read through the decoded-cache mount after a remount differs"
                ));
            }
        }
        let dc = d.ctl_json()?["decoded_cache"].clone();
        check_warm.extend(rate(&dc, "bytes_checked", "check_secs"));
        drop(d);
        // Remounts whose background check of the entries is done (an engine
        // started after the mount): first opens warm (the check read the
        // entries), then in another mount cold.
        for cold in [false, true] {
            let d = start_dc("mnt-dc")?;
            wait_checked(&d)?;
            for (fi, (name, _)) in FILES.iter().enumerate() {
                let (pt, size, sm) = (d.path(name), sizes[fi], &mut s[fi]);
                if cold {
                    drop_local(&entry_of(&cache, name)?)?;
                    sm.re_checked_cold.push(load_secs(&pt, size, &mut buf)?);
                } else {
                    sm.re_checked_warm.push(load_secs(&pt, size, &mut buf)?);
                }
            }
            drop(d);
        }
        meter.inc(1);
    }
    drop(plain);

    let _ = writeln!(
        r,
        "medians of {} rounds; open + read() in 1 MiB blocks + close, in-process; GB/s of the file's bytes;",
        o.rounds
    );
    let _ = writeln!(
        r,
        "(x) = ratio to the local file (same bytes, same directory) read the same way, cold or warm as the row says"
    );
    if fs.starts_with("tmpfs") {
        let _ = writeln!(
            r,
            "(tmpfs: posix_fadvise(DONTNEED) drops nothing there, so \"cold\" rows are warm)"
        );
    }
    let _ = write!(r, "  {:<44}", "case");
    for (fi, (_, label)) in FILES.iter().enumerate() {
        let _ = write!(r, " {:>26}", format!("{label} {} MiB", sizes[fi] >> 20));
    }
    let _ = writeln!(r);
    // (row label, samples, baseline samples) -> GB/s and ratio per file.
    type Pick = fn(&mut Samples) -> &mut Vec<f64>;
    let rows: Vec<(&str, Pick, Option<Pick>)> = vec![
        ("local file, cold", |s| &mut s.base_cold, None),
        ("local file, warm", |s| &mut s.base_warm, None),
        (
            "store mount: first load (decodes), cold",
            |s| &mut s.first,
            Some(|s| &mut s.base_cold),
        ),
        (
            "store mount: second load, cold",
            |s| &mut s.second_cold,
            Some(|s| &mut s.base_cold),
        ),
        (
            "store mount: second load, warm",
            |s| &mut s.second_warm,
            Some(|s| &mut s.base_warm),
        ),
        (
            "remount: first open at once (+ check), cold",
            |s| &mut s.re_first_cold,
            Some(|s| &mut s.base_cold),
        ),
        (
            "remount: first open at once (+ check), warm",
            |s| &mut s.re_first_warm,
            Some(|s| &mut s.base_warm),
        ),
        (
            "remount: first open after the check, cold",
            |s| &mut s.re_checked_cold,
            Some(|s| &mut s.base_cold),
        ),
        (
            "remount: first open after the check, warm",
            |s| &mut s.re_checked_warm,
            Some(|s| &mut s.base_warm),
        ),
        (
            "remount: second open, cold",
            |s| &mut s.re_second_cold,
            Some(|s| &mut s.base_cold),
        ),
        (
            "remount: second open, warm",
            |s| &mut s.re_second_warm,
            Some(|s| &mut s.base_warm),
        ),
        (
            "plain mount (page cache, no store), cold",
            |s| &mut s.plain_cold,
            Some(|s| &mut s.base_cold),
        ),
        (
            "plain mount (page cache, no store), warm",
            |s| &mut s.plain_warm,
            Some(|s| &mut s.base_warm),
        ),
        (
            "mmap touch 1 B per 4 KiB, warm: local",
            |s| &mut s.mmap_base,
            None,
        ),
        (
            "mmap touch 1 B per 4 KiB, warm: passthrough",
            |s| &mut s.mmap_pt,
            Some(|s| &mut s.mmap_base),
        ),
        (
            "numpy.memmap [::4096].sum(), warm: local",
            |s| &mut s.np_base,
            None,
        ),
        (
            "numpy.memmap [::4096].sum(), warm: passthrough",
            |s| &mut s.np_pt,
            Some(|s| &mut s.np_base),
        ),
    ];
    // Ratios per row label, per file.
    let mut ratios: Vec<(&str, Vec<f64>)> = Vec::new();
    for (label, pick, base) in rows {
        if label.starts_with("numpy") && numpy.is_none() {
            continue;
        }
        let _ = write!(r, "  {label:<44}");
        let mut rs = Vec::new();
        for (fi, sm) in s.iter_mut().enumerate() {
            let t = median(pick(sm));
            let cell = match base {
                Some(b) => {
                    let x = median(b(sm)) / t;
                    rs.push(x);
                    format!("{:.2} ({x:.2}x)", gbs(sizes[fi], t))
                }
                None => format!("{:.2}", gbs(sizes[fi], t)),
            };
            let _ = write!(r, " {cell:>26}");
        }
        let _ = writeln!(r);
        ratios.push((label, rs));
    }
    if numpy.is_none() {
        let _ = writeln!(r, "  numpy.memmap: skipped (no numpy)");
    }
    // SAFETY: sysconf has no preconditions.
    let tick_ms = 1e3 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let _ = write!(
        r,
        "daemon during the second load (cold + warm read; CPU in {tick_ms:.0} ms ticks): read() calls"
    );
    let mut max_reads = 0;
    for (fi, sm) in s.iter_mut().enumerate() {
        let reads = sm.reads.iter().copied().max().unwrap_or(0);
        max_reads = max_reads.max(reads);
        let _ = write!(
            r,
            "{} {} {reads} (max), CPU {:.0} ms (median)",
            if fi == 0 { "" } else { ";" },
            FILES[fi].1,
            median(&mut sm.cpu_ms)
        );
    }
    let _ = writeln!(r);
    let _ = writeln!(
        r,
        "store (ctl.json, medians): decode into it {:.2} GB/s (bytes_built / build_secs); \
         check after a remount {:.2} GB/s cold, {:.2} GB/s warm (bytes_checked / check_secs)",
        median(&mut build_rate),
        median(&mut check_cold),
        median(&mut check_warm)
    );
    let _ = writeln!(
        r,
        "bytes read through the store's mount: equal to the local file (every round); mmap of them: right bytes"
    );

    let mut verdict = |what: &'static str, row: &str, goal: f64| {
        if let Some((_, rs)) = ratios.iter().find(|x| x.0 == row) {
            let ok = rs.iter().all(|x| *x >= goal);
            let val = rs
                .iter()
                .zip(FILES)
                .map(|(x, f)| format!("{} {x:.3}x", f.1))
                .collect::<Vec<_>>()
                .join(", ");
            verdicts.push((MODE, what, ok, val));
        }
    };
    verdict(
        "first load >= 0.5x the local file cold",
        "store mount: first load (decodes), cold",
        0.5,
    );
    verdict(
        "second load cold >= 0.95x the local file cold",
        "store mount: second load, cold",
        0.95,
    );
    verdict(
        "second load warm >= 0.95x the local file warm",
        "store mount: second load, warm",
        0.95,
    );
    verdict(
        "first open after a remount's check, cold >= 0.95x",
        "remount: first open after the check, cold",
        0.95,
    );
    verdict(
        "first open after a remount's check, warm >= 0.95x",
        "remount: first open after the check, warm",
        0.95,
    );
    verdict(
        "second open after a remount, cold >= 0.95x",
        "remount: second open, cold",
        0.95,
    );
    verdict(
        "second open after a remount, warm >= 0.95x",
        "remount: second open, warm",
        0.95,
    );
    verdict(
        "mmap touch warm >= 0.95x the local file",
        "mmap touch 1 B per 4 KiB, warm: passthrough",
        0.95,
    );
    verdict(
        "numpy.memmap warm >= 0.95x the local file",
        "numpy.memmap [::4096].sum(), warm: passthrough",
        0.95,
    );
    verdicts.push((
        MODE,
        "no daemon read() during a second load",
        max_reads == 0,
        format!("{max_reads} reads"),
    ));

    meter.set_message("llama.cpp load");
    llama_section(o, &ddir, &mut cleanup, r)?;
    drop(cleanup);
    if made_ddir {
        let _ = std::fs::remove_dir(&ddir);
    }
    Ok(())
}

/// llama.cpp's own "load time" and the whole process's wall time
/// (seconds) of a one-token completion of `model` by the
/// `llama-completion` binary `tool` (it mmaps the file). The wall time
/// includes the open, where a store mount decodes on a first load.
fn llama_load_secs(tool: &Path, model: &Path) -> BResult<(f64, f64)> {
    let started = Instant::now();
    let o = Command::new(tool)
        .arg("-m")
        .arg(model)
        .args(["-p", "The capital of France is", "-n", "1", "--temp", "0"])
        .args(["-no-cnv", "-c", "128", "-t", "2"])
        .output()
        .map_err(|e| format!("{}: {e}", tool.display()))?;
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        return Err(format!(
            "{} on {}: {}\n{err}",
            tool.display(),
            model.display(),
            o.status
        ));
    }
    // "llama_perf_context_print:        load time =     123.45 ms"
    err.lines()
        .find_map(|l| {
            let rest = l.split("load time =").nth(1)?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .map(|ms| (ms / 1e3, started.elapsed().as_secs_f64()))
        .ok_or_else(|| format!("no \"load time\" in llama-completion's output:\n{err}"))
}

/// Wait until the mount's background check of its store entries is done
/// (`ctl.json` `decoded_cache.checks_pending` 0).
fn wait_checked(d: &Daemon) -> BResult<()> {
    let deadline = Instant::now() + std::time::Duration::from_secs(300);
    while d.ctl_json()?["decoded_cache"]["checks_pending"].as_u64() != Some(0) {
        if Instant::now() > deadline {
            return Err("the store's background check did not finish in 300 s".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// Bytes over seconds of a `decoded_cache` record (`ctl.json`), GB/s.
fn rate(dc: &Value, bytes: &str, secs: &str) -> Option<f64> {
    let t = dc[secs].as_f64().filter(|s| *s > 0.0)?;
    Some(dc[bytes].as_f64()? / 1e9 / t)
}

/// llama.cpp load time of SmolLM2, when its python and the model are there.
fn llama_section(
    o: &MountBenchOpts,
    ddir: &Path,
    cleanup: &mut Cleanup,
    r: &mut String,
) -> BResult<()> {
    let model = std::env::var_os("RKNOT_SMOLLM2").map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    // llama.cpp's completion tool, as tools/llama-cpp.sh builds it
    // (tools/test.sh exports RKNOT_LLAMA_BIN).
    let tool = std::env::var_os("RKNOT_LLAMA_BIN")
        .map(|d| PathBuf::from(d).join("llama-completion"))
        .filter(|t| t.is_file());
    let (Some(tool), true) = (tool, model.is_file()) else {
        let _ = writeln!(
            r,
            "llama.cpp load: skipped (set RKNOT_LLAMA_BIN to the bin directory of \
             tools/llama-cpp.sh --print-bin-dir, and RKNOT_SMOLLM2 or have \
             models/SmolLM2-135M-Instruct.Q4_1.gguf)"
        );
        return Ok(());
    };
    let model = std::fs::canonicalize(&model).map_err(|e| io_err(&model, e))?;
    let bin = &o.mount_bin;
    let cache = ddir.join("llama-cache");
    let local = ddir.join("local-smollm2-f32.gguf");
    cleanup.0.push(cache.clone());
    cleanup.0.push(local.clone());
    let cache_arg = cache.display().to_string();
    let mp_dc = o.dir.join("mnt-llama-dc");
    let plain = Daemon::start_with(bin, &model, None, &o.dir.join("mnt-llama"), &[])?;
    if !plain.path("model.gguf").exists() {
        let views = plain.ctl_json()?["views"].clone();
        let why = views
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == "model.gguf"))
            .and_then(|v| v["absent"].as_str())
            .unwrap_or("not offered")
            .to_string();
        let _ = writeln!(
            r,
            "llama.cpp load: skipped (the mount of {} has no model.gguf: {why})",
            model.display()
        );
        return Ok(());
    }
    let size = copy_file(&plain.path("model.gguf"), &local)?;
    let mut t: [Vec<(f64, f64)>; 4] = Default::default();
    for _ in 0..o.rounds {
        t[0].push(llama_load_secs(&tool, &local)?);
        plain.drop_caches_of(&plain.path("model.gguf"))?;
        t[1].push(llama_load_secs(&tool, &plain.path("model.gguf"))?);
        let _ = std::fs::remove_dir_all(&cache);
        let d = Daemon::start_with(bin, &model, None, &mp_dc, &["--decoded-cache", &cache_arg])?;
        t[2].push(llama_load_secs(&tool, &d.path("model.gguf"))?);
        t[3].push(llama_load_secs(&tool, &d.path("model.gguf"))?);
        drop(d);
    }
    drop(plain);
    let _ = writeln!(
        r,
        "llama.cpp load of SmolLM2 (model.gguf, F32, {} MiB, mmap): llama-completion -n 1 -c 128, \
         llama.cpp's own \"load time\" and the process's wall time, medians of {} rounds",
        size >> 20,
        o.rounds
    );
    for (i, label) in [
        "local copy in the decoded dir",
        "plain mount (daemon cache dropped)",
        "store mount, first load (decodes)",
        "store mount, second load",
    ]
    .iter()
    .enumerate()
    {
        let mut load: Vec<f64> = t[i].iter().map(|x| x.0).collect();
        let mut wall: Vec<f64> = t[i].iter().map(|x| x.1).collect();
        let _ = writeln!(
            r,
            "  {label:<40} load {:.3} s, process {:.3} s",
            median(&mut load),
            median(&mut wall)
        );
    }
    Ok(())
}
