//! `rknot bench remote`: a model served over HTTP from a loopback server in
//! this process ([`super::http_server`]) and mounted with `rknot-mount
//! http://...`, measured in one run against baselines of the same run:
//!
//! - cold sequential read: `cat` of the mount's `model.gguf` view (every
//!   tensor decoded to f32, in file order; each tensor file in turn when the
//!   source has no such view) on a fresh mount, against `curl -s -o
//!   /dev/null` of the same object from the same server. Ratio: curl's time
//!   / the mount's time, i.e. the throughput of fetching the model through
//!   the mount relative to curl's. The same read through a mount of the
//!   local file shows what decoding and FUSE alone cost (a ceiling for the
//!   remote mount). The served file is in the page cache for all of them.
//! - warm, with `--source-cache DIR` (when `rknot-mount` has it): the same
//!   read after a remount on the filled cache, against the same read
//!   through a mount of the local file.
//! - cost of a mount: time until it appears, bytes and requests fetched by
//!   then (`ctl.json`) against the GGUF header size, and the time to the
//!   first byte of a tensor file after it appears, for the bench model and
//!   synthetic 7B/70B-shaped models (sparse files: header and a hole).
//!
//! Rounds are interleaved; medians are reported. It fails only if something
//! is wrong (a mismatch between the remote and local mounts, an error).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::http_server::BenchServer;
use super::verdict::{self, meets};
use super::{BResult, Daemon, cat_secs, drop_page_cache, median};
use crate::format::gguf::{GgufFile, write_gguf};
use crate::format::meta::{MetaValue, Metadata};
use crate::progress::{Meter, Mode, Unit};
use crate::quant::GgmlType;
use crate::source::SourceFile;
use crate::synth::{self, Rng};

#[derive(Debug, Clone)]
pub struct RemoteBenchOpts {
    /// Scratch directory: synthetic models, mountpoints, the source cache.
    pub dir: PathBuf,
    /// The model to serve; default: SmolLM2 when found (`RKNOT_SMOLLM2`,
    /// else models/SmolLM2-135M-Instruct.Q4_1.gguf under the current
    /// directory) unless `size_mb` is given, else a synthetic one.
    pub model: Option<PathBuf>,
    /// Stored size of the synthetic model, MiB.
    pub size_mb: Option<u64>,
    pub rounds: usize,
    /// Synthetic shapes (`crate::synth::SHAPES`) of the mount-cost rows.
    pub shapes: Vec<String>,
    /// The rknot-mount binary.
    pub mount_bin: PathBuf,
    pub progress: Mode,
}

/// The synthetic model's size when neither a model nor a size is given and
/// SmolLM2 is not found.
const DEFAULT_SIZE_MB: u64 = 64;
const SMOLLM2_REL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn io(p: &Path) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", p.display())
}

/// A GGUF of Q4_K matrices 4096 wide, `size_mb` MiB of tensor data in
/// tensors of at most 16 MiB (a model's matrices are of that order).
fn write_synthetic(dir: &Path, size_mb: u64) -> BResult<PathBuf> {
    const COLS: u64 = 4096;
    let path = dir.join(format!("remote-bench-{size_mb}m.gguf"));
    if path.is_file() {
        return Ok(path);
    }
    let bytes_per_row = GgmlType::Q4K
        .bytes_for(COLS)
        .ok_or("Q4_K rows of 4096 have no size")?;
    let total_rows = ((size_mb << 20) / bytes_per_row).max(1);
    let rows_per_tensor = ((16 << 20) / bytes_per_row).max(1);
    let mut rng = Rng(0xbe4c_4b0d_5eed_0002);
    let mut data = Vec::new();
    let mut left = total_rows;
    while left > 0 {
        let rows = left.min(rows_per_tensor);
        data.push((
            rows,
            synth::ggml_blocks(GgmlType::Q4K, rows * COLS, 0.02, &mut rng),
        ));
        left -= rows;
    }
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = data
        .iter()
        .enumerate()
        .map(|(i, (rows, d))| {
            (
                format!("blk.{i}.ffn_up.weight"),
                vec![COLS, *rows],
                GgmlType::Q4K,
                &d[..],
            )
        })
        .collect();
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("bench".into()));
    let tmp = dir.join(format!(".remote-bench-{size_mb}m.gguf.tmp"));
    let f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut w = std::io::BufWriter::new(f);
    write_gguf(&mut w, &md, &tensors, 32).map_err(|e| e.to_string())?;
    std::io::Write::flush(&mut w).map_err(io(&tmp))?;
    drop(w);
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(path)
}

/// The sparse synthetic model of `shape` (header, then a hole).
fn write_shape(dir: &Path, shape: &str) -> BResult<PathBuf> {
    let s = synth::model_shape(shape).ok_or_else(|| {
        format!(
            "unknown shape {shape:?} (known: {})",
            synth::SHAPES.join(", ")
        )
    })?;
    let path = dir.join(format!("remote-bench-{shape}.gguf"));
    if !path.is_file() {
        synth::write_model(&path, &s, 1, true, true, false).map_err(|e| e.to_string())?;
    }
    Ok(path)
}

fn smollm2() -> Option<PathBuf> {
    let p = std::env::var_os("RKNOT_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(SMOLLM2_REL));
    p.is_file().then_some(p)
}

struct Model {
    label: String,
    path: PathBuf,
    /// URL path on the bench server.
    name: String,
    size: u64,
    header: u64,
    /// The first tensor's file name in a mount.
    first_tensor_file: String,
}

fn model_info(label: String, path: PathBuf, name: &str) -> BResult<Model> {
    let src = SourceFile::open(&path).map_err(|e| e.to_string())?;
    let g = GgufFile::read(&src).map_err(|e| e.to_string())?;
    let first = g
        .tensors
        .first()
        .ok_or_else(|| format!("{}: no tensors", path.display()))?;
    Ok(Model {
        label,
        size: std::fs::metadata(&path).map_err(io(&path))?.len(),
        path,
        name: name.into(),
        header: g.data_offset,
        first_tensor_file: format!("{}.f32", first.name),
    })
}

/// Seconds of `curl -s -o /dev/null URL` (curl's own time_total), checking
/// that it received `size` bytes with a 200.
fn curl_secs(url: &str, size: u64) -> BResult<f64> {
    let o = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{size_download} %{time_total}",
            url,
        ])
        .output()
        .map_err(|e| format!("curl: {e} (is curl installed?)"))?;
    let out = String::from_utf8_lossy(&o.stdout);
    let f: Vec<&str> = out.split_whitespace().collect();
    match (
        f.first(),
        f.get(1).and_then(|s| s.parse::<u64>().ok()),
        f.get(2),
    ) {
        (Some(&"200"), Some(n), Some(t)) if o.status.success() && n == size => t
            .replace(',', ".")
            .parse()
            .map_err(|_| format!("curl: cannot parse {out:?}")),
        _ => Err(format!("curl {url}: {out} (want 200 and {size} bytes)")),
    }
}

/// What a sequential read reads in a mount: `model.gguf`, else every
/// tensor file.
fn read_targets(mp: &Path) -> BResult<Vec<PathBuf>> {
    let view = mp.join("model.gguf");
    if view.exists() {
        return Ok(vec![view]);
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(mp)
        .map_err(io(mp))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "f32"))
        .collect();
    v.sort();
    Ok(v)
}

fn targets_bytes(t: &[PathBuf]) -> u64 {
    t.iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Seconds to `cat` every target (one `cat` each), the kernel's pages of
/// them dropped first.
fn cold_read_secs(mp: &Path) -> BResult<f64> {
    let targets = read_targets(mp)?;
    for t in &targets {
        drop_page_cache(t)?;
    }
    let mut s = 0.0;
    for t in &targets {
        s += cat_secs(t)?;
    }
    Ok(s)
}

/// `remote[0]` of the mount's ctl.json: (bytes_fetched, requests).
fn fetched(d: &Daemon) -> BResult<(u64, u64)> {
    let j = d.ctl_json()?;
    let r = &j["remote"][0];
    match (r["bytes_fetched"].as_u64(), r["requests"].as_u64()) {
        (Some(b), Some(n)) => Ok((b, n)),
        _ => Err(format!("no remote counters in ctl.json: {j}")),
    }
}

/// Seconds to read the whole object through a fresh in-process remote
/// source (`SourceFile::open_remote`, default options), sequentially in
/// 8 MiB reads, with read-ahead: the fetch engine alone, without decoding
/// or FUSE.
fn source_read_secs(url: &str, size: u64) -> BResult<f64> {
    let t = Instant::now();
    let src = SourceFile::open_remote(url, crate::source::RemoteOptions::default())
        .map_err(|e| e.to_string())?;
    // The whole object is one extent: read-ahead runs to its end (as it
    // does inside each tensor of a mounted model).
    src.set_extents(std::iter::once(0..size).collect());
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0u64;
    while off < size {
        let n = (size - off).min(buf.len() as u64) as usize;
        src.read_at(off, &mut buf[..n]).map_err(|e| e.to_string())?;
        off += n as u64;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Whether this rknot-mount takes `--source-cache`.
fn has_source_cache(mount_bin: &Path) -> bool {
    Command::new(mount_bin)
        .arg("--help")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--source-cache"))
}

/// Whether two files hold the same bytes.
fn same_bytes(a: &Path, b: &Path) -> BResult<bool> {
    let (fa, fb) = (
        std::fs::File::open(a).map_err(io(a))?,
        std::fs::File::open(b).map_err(io(b))?,
    );
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut off = 0u64;
    loop {
        let n = fa.read_at(&mut x, off).map_err(io(a))?;
        let m = fb.read_at(&mut y[..n.max(1)], off).map_err(io(b))?;
        if n != m || x[..n] != y[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
        off += n as u64;
    }
}

/// One mount's cost: (seconds until it appeared, bytes and requests
/// fetched by then, seconds from then to the first 4 KiB of the first
/// tensor file).
fn mount_cost(
    o: &RemoteBenchOpts,
    url: &str,
    m: &Model,
    mp: &Path,
) -> BResult<(f64, u64, u64, f64)> {
    let t = Instant::now();
    let d = Daemon::start_with(&o.mount_bin, Path::new(url), None, mp, &jobs_args(o))?;
    let mount_secs = t.elapsed().as_secs_f64();
    let (bytes, requests) = fetched(&d)?;
    let t = Instant::now();
    let p = mp.join(&m.first_tensor_file);
    let f = std::fs::File::open(&p).map_err(io(&p))?;
    let mut buf = vec![0u8; 4096];
    f.read_at(&mut buf, 0).map_err(io(&p))?;
    Ok((mount_secs, bytes, requests, t.elapsed().as_secs_f64()))
}

fn jobs_args(o: &RemoteBenchOpts) -> Vec<&str> {
    // A remote source has no directory of its own for ctl jobs.
    vec!["--jobs-dir", o.dir.to_str().unwrap_or("/tmp")]
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Run the benchmark; returns the report.
pub fn remote_bench(o: &RemoteBenchOpts) -> BResult<String> {
    let judged = verdict::judged(o.rounds);
    if o.dir.to_str().is_none() {
        return Err(format!("{}: not UTF-8", o.dir.display()));
    }
    std::fs::create_dir_all(&o.dir).map_err(io(&o.dir))?;
    let meter = Meter::new("bench remote", Unit::Items("steps"), o.progress);
    meter.set_total(1 + 2 * o.rounds as u64);
    meter.set_message("models");
    let (label, path) = match (&o.model, o.size_mb, smollm2()) {
        (Some(p), _, _) => (p.display().to_string(), p.clone()),
        (None, None, Some(p)) => ("SmolLM2-135M Q4_1".to_string(), p),
        (None, size, _) => {
            let size = size.unwrap_or(DEFAULT_SIZE_MB);
            (
                format!("synthetic Q4_K, {size} MiB"),
                write_synthetic(&o.dir, size)?,
            )
        }
    };
    let mut models = vec![model_info(label, path, "model.gguf")?];
    for s in &o.shapes {
        let p = write_shape(&o.dir, s)?;
        models.push(model_info(
            format!("{s} (sparse)"),
            p,
            &format!("{s}.gguf"),
        )?);
    }
    let files: HashMap<String, PathBuf> = models
        .iter()
        .map(|m| (m.name.clone(), m.path.clone()))
        .collect();
    let server = BenchServer::start(files).map_err(|e| format!("bench server: {e}"))?;
    let main = &models[0];
    let url = server.url(&main.name);
    // The served file in the page cache for everyone.
    std::io::copy(
        &mut std::fs::File::open(&main.path).map_err(io(&main.path))?,
        &mut std::io::sink(),
    )
    .map_err(io(&main.path))?;
    let source_cache = has_source_cache(&o.mount_bin);
    meter.inc(1);

    let (mut curl, mut remote_cold, mut local_cold) = (vec![], vec![], vec![]);
    let mut source_read = vec![];
    let (mut warm_remote, mut warm_local) = (vec![], vec![]);
    let mut cold_fetch = (0u64, 0u64);
    let mut costs: Vec<Vec<(f64, u64, u64, f64)>> = vec![vec![]; models.len()];
    let mut read_bytes = 0;
    let mut read_what = String::new();
    let mut checked = false;
    let cache_dir = o.dir.join("source-cache");
    for round in 0..o.rounds {
        meter.set_message(&format!("round {}: sequential reads", round + 1));
        curl.push(curl_secs(&url, main.size)?);
        source_read.push(source_read_secs(&url, main.size)?);
        {
            let d = Daemon::start_with(
                &o.mount_bin,
                Path::new(&url),
                None,
                &o.dir.join("mnt-remote"),
                &jobs_args(o),
            )?;
            remote_cold.push(cold_read_secs(&d.mp)?);
            cold_fetch = fetched(&d)?;
            let l = Daemon::start_with(
                &o.mount_bin,
                &main.path,
                None,
                &o.dir.join("mnt-local"),
                &[],
            )?;
            local_cold.push(cold_read_secs(&l.mp)?);
            if !checked {
                let (a, b) = (read_targets(&d.mp)?, read_targets(&l.mp)?);
                read_bytes = targets_bytes(&b);
                read_what = match &b[..] {
                    [one] if one.ends_with("model.gguf") => "model.gguf".into(),
                    _ => format!("{} tensor files", b.len()),
                };
                for (x, y) in a.iter().zip(&b) {
                    if !same_bytes(x, y)? {
                        return Err(format!(
                            "{} differs between the remote and the local mount",
                            y.display()
                        ));
                    }
                }
                checked = true;
            }
        }
        if source_cache {
            let _ = std::fs::remove_dir_all(&cache_dir);
            let cache = cache_dir.to_str().unwrap_or_default();
            let mut args = jobs_args(o);
            args.extend(["--source-cache", cache]);
            let mp = o.dir.join("mnt-remote");
            {
                let d = Daemon::start_with(&o.mount_bin, Path::new(&url), None, &mp, &args)?;
                cold_read_secs(&d.mp)?;
            }
            let d = Daemon::start_with(&o.mount_bin, Path::new(&url), None, &mp, &args)?;
            warm_remote.push(cold_read_secs(&d.mp)?);
            drop(d);
            let l = Daemon::start_with(
                &o.mount_bin,
                &main.path,
                None,
                &o.dir.join("mnt-local"),
                &[],
            )?;
            warm_local.push(cold_read_secs(&l.mp)?);
        }
        meter.inc(1);
        meter.set_message(&format!("round {}: mount costs", round + 1));
        for (m, c) in models.iter().zip(costs.iter_mut()) {
            c.push(mount_cost(
                o,
                &server.url(&m.name),
                m,
                &o.dir.join("mnt-cost"),
            )?);
        }
        meter.inc(1);
    }
    drop(meter);

    let (tc, tr, tl) = (
        median(&mut curl),
        median(&mut remote_cold),
        median(&mut local_cold),
    );
    let gbs = |b: u64, s: f64| b as f64 / s / 1e9;
    let mut r = String::new();
    let _ = writeln!(
        r,
        "rknot bench remote: {} ({:.1} MiB, header {:.2} MiB), loopback HTTP server in-process \
         (the file in its page cache), {} round(s), medians",
        main.label,
        mib(main.size),
        mib(main.header),
        o.rounds
    );
    let _ = writeln!(
        r,
        "sequential read: `cat` of the mount's {} ({:.1} MiB decoded) vs `curl -s -o /dev/null` of the object",
        read_what,
        mib(read_bytes)
    );
    let row = |r: &mut String, case: &str, secs: Option<f64>, ratio: Option<f64>, note: &str| {
        let (s, g, x) = match (secs, ratio) {
            (Some(s), Some(x)) => (
                format!("{s:.3}"),
                format!("{:.3}", gbs(main.size, s)),
                format!("{x:.2}x"),
            ),
            _ => ("n/a".into(), String::new(), String::new()),
        };
        let _ = writeln!(r, "{case:<46} {s:>8} {g:>12} {x:>7}  {note}");
    };
    let _ = writeln!(
        r,
        "{:<46} {:>8} {:>12} {:>7}  goal / note",
        "case", "seconds", "object GB/s", "ratio"
    );
    row(&mut r, "curl (the baseline)", Some(tc), Some(1.0), "");
    row(
        &mut r,
        "remote mount, cold (fresh mount)",
        Some(tr),
        Some(tc / tr),
        &meets(tc / tr, 0.8, judged),
    );
    row(
        &mut r,
        "local-file mount, fresh (decode + FUSE only)",
        Some(tl),
        Some(tc / tl),
        "(the same read of the local file)",
    );
    let ts = median(&mut source_read);
    row(
        &mut r,
        "source layer in-process (no decode, no FUSE)",
        Some(ts),
        Some(tc / ts),
        "(the fetch engine alone)",
    );
    let _ = writeln!(
        r,
        "  remote mount / local-file mount: {:.2}x; the cold read fetched {:.1} MiB in {} \
         requests ({:.2}x the object)",
        tl / tr,
        mib(cold_fetch.0),
        cold_fetch.1,
        cold_fetch.0 as f64 / main.size as f64
    );
    if source_cache {
        let (wr, wl) = (median(&mut warm_remote), median(&mut warm_local));
        row(
            &mut r,
            "remote mount, warm --source-cache (remount)",
            Some(wr),
            Some(wl / wr),
            &format!(
                "vs the local-file mount's {wl:.3} s: {}",
                meets(wl / wr, 0.8, judged)
            ),
        );
    } else {
        row(
            &mut r,
            "remote mount, warm --source-cache (remount)",
            None,
            None,
            "n/a (no --source-cache yet)",
        );
    }
    let _ = writeln!(
        r,
        "\nmount cost: until the mount appears, fetched by then (ctl.json), time to the first \
         4 KiB of the first tensor file after"
    );
    let _ = writeln!(
        r,
        "{:<26} {:>10} {:>11} {:>11} {:>8} {:>9} {:>8} {:>11}",
        "model",
        "object MiB",
        "header KiB",
        "fetched KiB",
        "requests",
        "/header",
        "mount s",
        "1st byte ms"
    );
    for (m, c) in models.iter().zip(costs.iter_mut()) {
        let mut ms: Vec<f64> = c.iter().map(|x| x.0).collect();
        let mut tt: Vec<f64> = c.iter().map(|x| x.3).collect();
        let mut fb: Vec<f64> = c.iter().map(|x| x.1 as f64).collect();
        let mut rq: Vec<f64> = c.iter().map(|x| x.2 as f64).collect();
        let fb = median(&mut fb);
        let _ = writeln!(
            r,
            "{:<26} {:>10.1} {:>11.0} {:>11.0} {:>8} {:>8.2}x {:>8.3} {:>11.1}",
            m.label,
            mib(m.size),
            m.header as f64 / 1024.0,
            fb / 1024.0,
            median(&mut rq),
            fb / m.header as f64,
            median(&mut ms),
            1e3 * median(&mut tt)
        );
    }
    let _ = writeln!(
        r,
        "server: {} requests, {:.1} MiB sent",
        server.requests.load(std::sync::atomic::Ordering::Relaxed),
        mib(server.bytes_sent.load(std::sync::atomic::Ordering::Relaxed))
    );
    Ok(r)
}
