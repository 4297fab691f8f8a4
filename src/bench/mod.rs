//! `rknot bench mount`: decode throughput and FUSE read performance, all
//! measured in one run, interleaved, and reported as ratios against a plain
//! read of the same decoded bytes from tmpfs.
//!
//! Cases, per tensor (Q4_K and Q8_0 from a GGUF, an SK32 sketch), per round:
//! - in-process decode of the whole tensor, 1 thread and all threads;
//! - tmpfs baseline: `dd bs=1M` and `cat` of the decoded bytes in /dev/shm;
//! - through the mount, in page-cache mode (default) and direct_io mode:
//!   cold `dd bs=1M` and `cat` (kernel page cache and daemon cache dropped
//!   first), warm `dd bs=1M` (second read), cold 4 KiB random reads;
//! - daemon peak RSS while streaming files several times larger than its
//!   cache; mmap of a tensor file in both modes;
//! - the decoded cache (`--decoded-cache`) with FUSE passthrough against a
//!   plain file on the same filesystem: see [`passthrough`].
//!
//! This is a benchmark, not a test: it prints numbers and which targets
//! they meet; it fails only if something is wrong (a mismatch, an error).

use std::fmt::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{self, Backend};

mod checksums;
mod http_server;
mod kernels;
mod lossless;
mod passthrough;
mod remote;
mod verdict;
use crate::format::gguf::write_gguf;
use crate::format::meta::{MetaValue, Metadata};
use crate::format::sk32::write_sk32;
use crate::quant::GgmlType;
use crate::synth::{self, Rng};
pub use checksums::{checksums_bench, strip_checksums};
pub use kernels::kernels_bench;
pub use lossless::{LosslessBenchOpts, fp48_bisided_bytes, lossless_bench};
pub use remote::{RemoteBenchOpts, remote_bench};

use crate::progress::{Meter, Unit};

type BResult<T> = std::result::Result<T, String>;

#[derive(Debug, Clone)]
pub struct MountBenchOpts {
    /// Where the synthetic model files and mountpoints go.
    pub dir: PathBuf,
    pub rounds: usize,
    /// Decoded size of each tensor.
    pub size_mb: u64,
    /// Cold 4 KiB reads per tensor, mode and round.
    pub random_reads: usize,
    /// The rknot-mount binary.
    pub mount_bin: PathBuf,
    /// Where the decoded-cache section puts its store and its plain-file
    /// baseline (one filesystem for both); default `dir`/decoded.
    pub decoded_dir: Option<PathBuf>,
    /// How progress is shown on stderr (one step per measurement round).
    pub progress: crate::progress::Mode,
}

const COLS: u64 = 4096;
const SK_RANK: usize = 64;

struct Daemon {
    child: Child,
    mp: PathBuf,
}

impl Daemon {
    fn start(
        bin: &Path,
        source: &Path,
        dense: &Path,
        mp: &Path,
        extra: &[&str],
    ) -> BResult<Daemon> {
        Daemon::start_with(bin, source, Some(dense), mp, extra)
    }

    /// [`Daemon::start`] with the dense fallback optional.
    fn start_with(
        bin: &Path,
        source: &Path,
        dense: Option<&Path>,
        mp: &Path,
        extra: &[&str],
    ) -> BResult<Daemon> {
        std::fs::create_dir_all(mp).map_err(|e| format!("{}: {e}", mp.display()))?;
        let mut cmd = Command::new(bin);
        cmd.arg(source).arg(mp);
        if let Some(dense) = dense {
            cmd.arg("--dense").arg(dense);
        }
        let child = cmd
            .arg("--foreground")
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let mut d = Daemon {
            child,
            mp: mp.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !mp.join("index.json").exists() {
            if let Ok(Some(st)) = d.child.try_wait() {
                return Err(format!("rknot-mount exited with {st}"));
            }
            if Instant::now() > deadline {
                return Err("mount did not come up".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(d)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.mp.join(format!("{name}.f32"))
    }

    /// A file in the mount root by its full name (`model.safetensors`).
    fn path(&self, file_name: &str) -> PathBuf {
        self.mp.join(file_name)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Drop the daemon's cache and the kernel's pages of `name`.
    fn drop_caches(&self, name: &str) -> BResult<()> {
        self.drop_caches_of(&self.file(name))
    }

    /// Drop the daemon's cache and the kernel's pages of file `p`.
    fn drop_caches_of(&self, p: &Path) -> BResult<()> {
        std::fs::write(self.mp.join("ctl"), "drop-cache\n").map_err(|e| format!("ctl: {e}"))?;
        drop_page_cache(p)
    }

    /// The mount's `ctl.json`.
    fn ctl_json(&self) -> BResult<serde_json::Value> {
        let p = self.mp.join("ctl.json");
        let s = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        serde_json::from_str(&s).map_err(|e| format!("{}: {e}", p.display()))
    }

    /// (VmRSS, VmHWM) in bytes.
    fn rss(&self) -> (u64, u64) {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let field = |k: &str| {
            s.lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = Command::new("fusermount3")
            .arg("-uz")
            .arg(&self.mp)
            .status();
    }
}

fn drop_page_cache(p: &Path) -> BResult<()> {
    let f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
    // SAFETY: advisory call on a descriptor we own.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(format!("posix_fadvise {}: error {rc}", p.display()));
    }
    Ok(())
}

/// Seconds `dd bs=1M` reports for reading `p` (excludes process start-up).
fn dd_secs(p: &Path) -> BResult<f64> {
    let o = Command::new("dd")
        .arg(format!("if={}", p.display()))
        .args(["of=/dev/null", "bs=1M"])
        .output()
        .map_err(|e| format!("dd: {e}"))?;
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        return Err(format!("dd {}: {err}", p.display()));
    }
    // "... copied, 0.0123 s, 5.4 GB/s"
    err.lines()
        .last()
        .and_then(|l| l.split("copied, ").nth(1))
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("cannot parse dd output: {err}"))
}

/// Wall-clock seconds of `cat p > /dev/null`.
fn cat_secs(p: &Path) -> BResult<f64> {
    let null = std::fs::File::create("/dev/null").map_err(|e| e.to_string())?;
    let t = Instant::now();
    let st = Command::new("cat")
        .arg(p)
        .stdout(null)
        .status()
        .map_err(|e| format!("cat: {e}"))?;
    let s = t.elapsed().as_secs_f64();
    if !st.success() {
        return Err(format!("cat {} failed", p.display()));
    }
    Ok(s)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Decode a whole tensor in-process with `threads` threads; seconds.
fn decode_secs(b: &Arc<dyn Backend>, index: usize, threads: usize) -> BResult<f64> {
    let n = b.tensors().entries()[index].n_elements;
    let per = n.div_ceil(threads as u64);
    let t = Instant::now();
    std::thread::scope(|s| -> BResult<()> {
        let handles: Vec<_> = (0..threads as u64)
            .map(|i| {
                let b = b.clone();
                s.spawn(move || -> BResult<()> {
                    let (lo, hi) = (i * per, ((i + 1) * per).min(n));
                    let mut buf = vec![0f32; 1 << 18];
                    let mut at = lo;
                    while at < hi {
                        let m = (hi - at).min(buf.len() as u64) as usize;
                        b.read_f32(index, at, &mut buf[..m])
                            .map_err(|e| e.to_string())?;
                        at += m as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| "decode thread panicked".to_string())??;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Mean seconds of one cold 4 KiB read at a random offset (both caches
/// dropped before each, outside the timed region).
fn random_4k_secs(d: &Daemon, name: &str, size: u64, reads: usize, rng: &mut Rng) -> BResult<f64> {
    let path = d.file(name);
    let mut total = 0f64;
    let mut buf = vec![0u8; 4096];
    for _ in 0..reads {
        d.drop_caches(name)?;
        let f = std::fs::File::open(&path).map_err(|e| e.to_string())?;
        let off = rng.next_u64() % (size / 4096) * 4096;
        let t = Instant::now();
        f.read_exact_at(&mut buf, off)
            .map_err(|e| format!("pread: {e}"))?;
        total += t.elapsed().as_secs_f64();
    }
    Ok(total / reads as f64)
}

fn mmap_matches(p: &Path, want: &[u8]) -> BResult<bool> {
    let f = std::fs::File::open(p).map_err(|e| e.to_string())?;
    // SAFETY: read-only mapping of a file that nobody writes while mapped
    // (the mount is read-only).
    let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("mmap {}: {e}", p.display()))?;
    Ok(m[..] == *want)
}

struct TensorCase {
    name: &'static str,
    label: &'static str,
    tmpfs: PathBuf,
    bytes: Vec<u8>,
}

fn write_sources(dir: &Path, size_mb: u64) -> BResult<(PathBuf, PathBuf)> {
    let rows = (size_mb << 20) / 4 / COLS;
    let mut rng = Rng(0xbe4c_4b0d_5eed_0001);
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("bench".into()));
    let q4 = synth::ggml_blocks(GgmlType::Q4K, rows * COLS, 0.02, &mut rng);
    let q8 = synth::ggml_blocks(GgmlType::Q8_0, rows * COLS, 0.02, &mut rng);
    let gguf = dir.join("bench.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&gguf).map_err(|e| e.to_string())?);
    write_gguf(
        &mut f,
        &md,
        &[
            ("q4_k.weight".into(), vec![COLS, rows], GgmlType::Q4K, &q4),
            ("q8_0.weight".into(), vec![COLS, rows], GgmlType::Q8_0, &q8),
        ],
        32,
    )
    .map_err(|e| e.to_string())?;
    drop(f);
    let sk = synth::sketch(
        "sk32.weight",
        rows as usize,
        COLS as usize,
        SK_RANK,
        &mut rng,
    );
    let sk32 = dir.join("bench.sk32");
    let mut f = std::fs::File::create(&sk32).map_err(|e| e.to_string())?;
    write_sk32(&mut f, "bench", &[sk]).map_err(|e| e.to_string())?;
    Ok((gguf, sk32))
}

/// Run the benchmark; returns the report.
pub fn mount_bench(o: &MountBenchOpts) -> BResult<String> {
    // Steps: sources, correctness and warm-up, a round of each tensor,
    // mmap and memory, a round of the decoded-cache section, llama.cpp.
    let meter = Meter::new("bench mount", Unit::Items("steps"), o.progress);
    meter.set_total(2 + 3 * o.rounds as u64 + 1 + o.rounds as u64 + 1);
    meter.set_message("writing the synthetic model");
    std::fs::create_dir_all(&o.dir).map_err(|e| format!("{}: {e}", o.dir.display()))?;
    let (gguf, sk32) = write_sources(&o.dir, o.size_mb)?;
    let b: Arc<dyn Backend> =
        Arc::from(backend::open(&sk32, Some(&gguf)).map_err(|e| e.to_string())?);
    let shm = PathBuf::from(format!("/dev/shm/rknot-bench-{}", std::process::id()));
    std::fs::create_dir_all(&shm).map_err(|e| format!("{}: {e}", shm.display()))?;
    struct RmDir(PathBuf);
    impl Drop for RmDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _shm_guard = RmDir(shm.clone());
    let mut cases = Vec::new();
    for (name, label) in [
        ("q4_k.weight", "Q4_K"),
        ("q8_0.weight", "Q8_0"),
        ("sk32.weight", "SK32 r64"),
    ] {
        let i = b.find(name).map_err(|e| e.to_string())?;
        let n = b.tensors().entries()[i].n_elements as usize;
        let mut v = vec![0f32; n];
        b.read_f32(i, 0, &mut v).map_err(|e| e.to_string())?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        // Written in 1 MiB pieces, the size in which the kernel fills a FUSE
        // file's page cache: the page layout of one huge write reads
        // measurably faster and would not be a like-for-like baseline.
        let tmpfs = shm.join(format!("{name}.f32"));
        let mut f = std::fs::File::create(&tmpfs).map_err(|e| e.to_string())?;
        for piece in bytes.chunks(1 << 20) {
            std::io::Write::write_all(&mut f, piece).map_err(|e| e.to_string())?;
        }
        cases.push(TensorCase {
            name,
            label,
            tmpfs,
            bytes,
        });
    }
    let size = cases[0].bytes.len() as u64;
    meter.inc(1);
    meter.set_message("correctness and warm-up");
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());

    let pc = Daemon::start(&o.mount_bin, &sk32, &gguf, &o.dir.join("mnt-pc"), &[])?;
    let dio = Daemon::start(
        &o.mount_bin,
        &sk32,
        &gguf,
        &o.dir.join("mnt-dio"),
        &["-o", "direct_io"],
    )?;
    let modes = [("page cache", &pc), ("direct_io", &dio)];

    // Correctness first: both mounts serve exactly the decoded bytes.
    for c in &cases {
        for (m, d) in &modes {
            let got = std::fs::read(d.file(c.name)).map_err(|e| e.to_string())?;
            if got != c.bytes {
                return Err(format!("{m} mount serves wrong bytes for {}", c.name));
            }
        }
    }

    // [case] -> series of samples
    #[derive(Default)]
    struct Samples {
        dec1: Vec<f64>,
        decn: Vec<f64>,
        tmp_dd: Vec<f64>,
        tmp_cat: Vec<f64>,
        cold_dd: [Vec<f64>; 2],
        cold_cat: [Vec<f64>; 2],
        warm_dd: [Vec<f64>; 2],
        rand4k: [Vec<f64>; 2],
    }
    let mut s: Vec<Samples> = cases.iter().map(|_| Samples::default()).collect();
    let mut rng = Rng(42);
    // Warm-up: page in code, the source files and the tmpfs copies.
    for c in &cases {
        let idx = b.find(c.name).map_err(|e| e.to_string())?;
        decode_secs(&b, idx, threads)?;
        dd_secs(&c.tmpfs)?;
        for (_, d) in &modes {
            dd_secs(&d.file(c.name))?;
        }
    }
    meter.inc(1);
    for round in 0..o.rounds {
        for (ci, c) in cases.iter().enumerate() {
            meter.set_message(&format!("round {} of {}: {}", round + 1, o.rounds, c.label));
            let idx = b.find(c.name).map_err(|e| e.to_string())?;
            let sm = &mut s[ci];
            sm.dec1.push(decode_secs(&b, idx, 1)?);
            sm.decn.push(decode_secs(&b, idx, threads)?);
            sm.tmp_dd.push(dd_secs(&c.tmpfs)?);
            for (mi, (_, d)) in modes.iter().enumerate() {
                d.drop_caches(c.name)?;
                sm.cold_dd[mi].push(dd_secs(&d.file(c.name))?);
                // Warm means steady state, as for the tmpfs file (read many
                // times): one untimed read after the cold one, then timed.
                dd_secs(&d.file(c.name))?;
                sm.warm_dd[mi].push(dd_secs(&d.file(c.name))?);
            }
            sm.tmp_cat.push(cat_secs(&c.tmpfs)?);
            for (mi, (_, d)) in modes.iter().enumerate() {
                d.drop_caches(c.name)?;
                sm.cold_cat[mi].push(cat_secs(&d.file(c.name))?);
            }
            for (mi, (_, d)) in modes.iter().enumerate() {
                sm.rand4k[mi].push(random_4k_secs(d, c.name, size, o.random_reads, &mut rng)?);
            }
            meter.inc(1);
        }
    }
    meter.set_message("mmap and daemon memory");

    let mut r = String::new();
    let _ = writeln!(
        r,
        "rknot bench mount: {} rounds, interleaved; tensors of {} MiB decoded ({} x {}); {} CPUs",
        o.rounds,
        size >> 20,
        size / 4 / COLS,
        COLS,
        threads
    );
    let _ = writeln!(
        r,
        "medians; GB/s of decoded bytes; (x) = ratio to the same reader on tmpfs\n"
    );
    let _ = writeln!(r, "in-process decode of the whole tensor:");
    for (ci, c) in cases.iter().enumerate() {
        let sm = &mut s[ci];
        let (d1, dn) = (median(&mut sm.dec1), median(&mut sm.decn));
        let _ = writeln!(
            r,
            "  {:<9} 1 thread {:>6.2} GB/s ({:.1} ms)   {} threads {:>6.2} GB/s",
            c.label,
            gbs(size, d1),
            d1 * 1e3,
            threads,
            gbs(size, dn)
        );
    }
    let mut verdicts = Vec::new();
    for (mi, (mname, _)) in modes.iter().enumerate() {
        let _ = writeln!(r, "\nthrough the mount, {mname} mode:");
        let _ = writeln!(
            r,
            "  {:<9} {:>18} {:>18} {:>18} {:>18} {:>14}",
            "tensor",
            "cold dd bs=1M",
            "cold cat",
            "warm dd bs=1M",
            "tmpfs dd / cat",
            "cold 4K read"
        );
        for (ci, c) in cases.iter().enumerate() {
            let sm = &mut s[ci];
            let (tdd, tcat) = (median(&mut sm.tmp_dd), median(&mut sm.tmp_cat));
            let (cdd, ccat, wdd) = (
                median(&mut sm.cold_dd[mi]),
                median(&mut sm.cold_cat[mi]),
                median(&mut sm.warm_dd[mi]),
            );
            let r4k = median(&mut sm.rand4k[mi]);
            let whole = median(&mut sm.dec1);
            let _ = writeln!(
                r,
                "  {:<9} {:>7.2} ({:.2}x) {:>9.2} ({:.2}x) {:>9.2} ({:.2}x) {:>8.2} / {:>5.2} {:>8.0} us = 1/{:.0} of a decode",
                c.label,
                gbs(size, cdd),
                tdd / cdd,
                gbs(size, ccat),
                tcat / ccat,
                gbs(size, wdd),
                tdd / wdd,
                gbs(size, tdd),
                gbs(size, tcat),
                r4k * 1e6,
                whole / r4k
            );
            if c.label == "Q4_K" {
                verdicts.push((
                    *mname,
                    "warm >= 1.0x tmpfs",
                    tdd / wdd >= 1.0,
                    format!("{:.2}x", tdd / wdd),
                ));
                verdicts.push((
                    *mname,
                    "cold sequential Q4_K >= 0.8x tmpfs",
                    tdd / cdd >= 0.8,
                    format!("{:.2}x", tdd / cdd),
                ));
            }
            let worst = whole / r4k;
            if c.label == "Q4_K" {
                verdicts.push((
                    *mname,
                    "cold 4 KiB read <= 1/100 of a decode",
                    worst >= 100.0,
                    format!("1/{worst:.0}"),
                ));
            }
        }
    }

    // mmap in both modes.
    let _ = writeln!(r);
    for (mname, d) in &modes {
        let ok = mmap_matches(&d.file(cases[0].name), &cases[0].bytes)?;
        let _ = writeln!(
            r,
            "mmap of a tensor file, {mname} mode: {}",
            if ok { "right bytes" } else { "WRONG BYTES" }
        );
        verdicts.push((*mname, "mmap works", ok, String::new()));
    }
    drop(pc);
    drop(dio);

    // Peak RSS while streaming every tensor through a small cache.
    let cache_mb = 64u64;
    let small = Daemon::start(
        &o.mount_bin,
        &sk32,
        &gguf,
        &o.dir.join("mnt-rss"),
        &["--cache-mb", &cache_mb.to_string()],
    )?;
    let streamed = size * cases.len() as u64 * 2;
    for _ in 0..2 {
        for c in &cases {
            small.drop_caches(c.name)?;
            dd_secs(&small.file(c.name))?;
        }
    }
    let (rss, hwm) = small.rss();
    let budget = (cache_mb + 64) << 20;
    let _ = writeln!(
        r,
        "daemon memory streaming {} MiB through a {} MiB cache: RSS {} MiB now, peak {} MiB (budget cache + 64 MiB = {} MiB)",
        streamed >> 20,
        cache_mb,
        rss >> 20,
        hwm >> 20,
        budget >> 20
    );
    verdicts.push((
        "page cache",
        "peak RSS <= cache + 64 MiB",
        hwm <= budget,
        format!("{} MiB", hwm >> 20),
    ));
    drop(small);
    meter.inc(1);

    passthrough::decoded_bench(o, &sk32, &gguf, &mut r, &mut verdicts, &meter)?;
    meter.finish();

    r.push_str(&verdict::targets(&verdicts, verdict::judged(o.rounds)));
    Ok(r)
}
