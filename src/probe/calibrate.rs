//! `rknot calibrate`: activation statistics of a model over a calibration
//! text, for encoders that minimise the output error ‖(W − Ŵ)X‖ rather
//! than the weight error (issue 12).
//!
//! The probe's forward pass ([`Model::forward_recorded`]) shows an
//! [`ActivationRecorder`] the input of every weight matrix; four inputs
//! per layer are distinct ([`Site`]). [`StatsRecorder`] keeps, per layer
//! and site, the per-input-channel mean of x² over all tokens and
//! optionally the Gram matrix XᵀX / n.
//!
//! # The STATS file (format "rknot-calibration", version 1)
//!
//! A safetensors file, so any safetensors or numpy reader opens it: an
//! 8-byte little-endian header length `H`, `H` bytes of JSON (padded with
//! spaces to a multiple of 8), then the arrays, little-endian, at
//! `data_offsets` relative to the end of the header.
//!
//! - `__metadata__` (all values strings): `format` = `rknot-calibration`,
//!   `version` = `1`, `layers` (count), `tokens` (rows every site saw),
//!   `windows`, `ctx`, `bos` (token id put first in each window, or
//!   `none`), `gram` (`true`/`false`), `model`, `text` (file name),
//!   `text_sha256`, `text_bytes` (or `tokens_given` = `true` when the
//!   token ids were given instead of a text), `rknot` (version),
//!   `sites` (JSON: site name → the tensors of a layer it feeds).
//! - `blk.L.SITE.mean_sq`: F64 `[d]`, Σₜ x²ₜ,c / tokens for channel c.
//! - `blk.L.SITE.gram` (with `--gram`): F32 `[d, d]`, Σₜ xₜ xₜᵀ / tokens,
//!   symmetric, accumulated in f64 (each window's product in f32) and
//!   stored in f32 to halve the file (SmolLM2: about 400 MB).
//!
//! SITE is one of `attn_in` (the normed x feeding attn_q/k/v),
//! `attn_out_in` (the attention output feeding attn_output), `ffn_in`
//! (the normed x feeding ffn_gate/up) and `ffn_down_in` (the SwiGLU
//! output feeding ffn_down). [`read_stats`] reads and checks such a file.
//!
//! # Windows
//!
//! The token stream is cut into consecutive windows, each run in a fresh
//! context: with a text, each window is the vocab's BOS (when it adds one)
//! followed by `ctx - 1` text tokens, so every text token is seen once
//! and every window starts as a prompt does; given token ids are cut into
//! windows of `ctx` as they are. The last window may be shorter. Every
//! position, BOS included, counts as a row.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{Map, Value, json};
use sha2::Digest;

use super::linalg::matmul_t;
use super::model::{Config, KvCache, Residency};
pub use super::sites::{ActivationRecorder, Site};
use super::{BoxResult, Tokenizer, load, read_text};
use crate::error::{Error, ErrorKind, Result, err};
use crate::output::{AtomicOutput, OutputTarget};
use crate::source::SourceVersion;

/// `__metadata__.format` of a STATS file.
pub const FORMAT_NAME: &str = "rknot-calibration";
/// `__metadata__.version` this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Running sums of one site.
#[derive(Default)]
struct SiteSums {
    d: usize,
    rows: u64,
    sum_sq: Vec<f64>,
    gram: Vec<f64>,
    /// Xᵀ of the current batch and its f32 Gram product (reused).
    xt: Vec<f32>,
    g32: Vec<f32>,
}

/// An [`ActivationRecorder`] that keeps mean squares and, optionally,
/// Gram matrices (see the module documentation).
pub struct StatsRecorder {
    gram: bool,
    layers: Vec<[SiteSums; 4]>,
    /// The first inconsistency seen (a recorder cannot fail mid-pass).
    fault: Option<String>,
}

impl StatsRecorder {
    pub fn new(n_layer: usize, gram: bool) -> StatsRecorder {
        StatsRecorder {
            gram,
            layers: (0..n_layer).map(|_| Default::default()).collect(),
            fault: None,
        }
    }

    /// A recorder for `cfg`'s layers with every sum allocated now, so a
    /// model whose Gram matrices do not fit in memory is an error here
    /// rather than an abort mid-pass (f64 sums: 8 d² bytes per input;
    /// SmolLM2 0.8 GB, a 7B model about 44 GB).
    pub fn for_model(cfg: &Config, gram: bool) -> Result<StatsRecorder> {
        if let Some(m) = &cfg.moe {
            // The forward pass shows each expert its own rows
            // (ActivationRecorder::record_expert); the STATS file has no
            // per-expert sites yet.
            return Err(err(
                ErrorKind::UnsupportedType,
                format!(
                    "{}: calibration statistics of a mixture of {} experts are not written yet                      (STATS has no per-expert sites)",
                    cfg.arch.name(),
                    m.n_expert
                ),
            ));
        }
        let mut r = StatsRecorder::new(cfg.n_layer, gram);
        let widths = [cfg.d_model, cfg.q_dim(), cfg.d_model, cfg.d_ff];
        // f64 per layer; None when even the count overflows.
        let total = widths.iter().try_fold(0usize, |acc, &d| {
            let g = if gram { d.checked_mul(d)? } else { 0 };
            acc.checked_add(d)?.checked_add(g)
        });
        let too_large = || {
            err(
                ErrorKind::TooLarge,
                format!(
                    "the statistics' sums of {} layers of inputs {widths:?} wide do not fit \
                     in three quarters of the memory available{}",
                    cfg.n_layer,
                    if gram {
                        " (the Gram matrices; try without --gram)"
                    } else {
                        ""
                    }
                ),
            )
        };
        // Allocations succeed lazily on Linux and fail only when touched:
        // ask MemAvailable first, as the probe does for the weights.
        let bytes = total
            .and_then(|t| t.checked_mul(8))
            .and_then(|b| b.checked_mul(cfg.n_layer));
        if !bytes.is_some_and(super::model::fits_in_memory) {
            return Err(too_large());
        }
        for layer in &mut r.layers {
            for (s, &d) in layer.iter_mut().zip(&widths) {
                s.d = d;
                s.sum_sq = zeros_f64(d).ok_or_else(too_large)?;
                if gram {
                    s.gram = d.checked_mul(d).and_then(zeros_f64).ok_or_else(too_large)?;
                }
            }
        }
        Ok(r)
    }

    /// Means over the rows seen. `meta` goes into the file's metadata.
    pub fn finish(self, mut meta: BTreeMap<String, String>) -> Result<CalibrationStats> {
        if let Some(f) = self.fault {
            return Err(err(ErrorKind::BadShape, format!("internal: {f}")));
        }
        let tokens = self.layers.first().map_or(0, |l| l[0].rows);
        let mut layers = Vec::with_capacity(self.layers.len());
        for (li, sums) in self.layers.into_iter().enumerate() {
            let mut sites = Vec::with_capacity(4);
            for (site, s) in Site::ALL.into_iter().zip(sums) {
                if s.rows != tokens || s.rows == 0 {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!(
                            "internal: blk.{li}.{} saw {} rows, the first site {tokens}",
                            site.name(),
                            s.rows
                        ),
                    ));
                }
                let inv = 1.0 / s.rows as f64;
                sites.push(SiteStats {
                    site,
                    d: s.d,
                    mean_sq: s.sum_sq.iter().map(|v| v * inv).collect(),
                    gram: self
                        .gram
                        .then(|| s.gram.iter().map(|v| (v * inv) as f32).collect()),
                });
            }
            layers.push(sites);
        }
        meta.insert("tokens".into(), tokens.to_string());
        meta.insert("gram".into(), self.gram.to_string());
        Ok(CalibrationStats {
            meta,
            tokens,
            layers,
        })
    }
}

impl ActivationRecorder for StatsRecorder {
    fn record(&mut self, layer: usize, site: Site, x: &[f32], n: usize) {
        if n == 0 || self.fault.is_some() {
            return;
        }
        let Some(s) = self.layers.get_mut(layer).map(|l| &mut l[site.index()]) else {
            self.fault = Some(format!("layer {layer} recorded, the model has fewer"));
            return;
        };
        let d = x.len() / n;
        if s.d == 0 {
            s.d = d;
            s.sum_sq = vec![0.0; d];
            if self.gram {
                s.gram = vec![0.0; d * d];
            }
        }
        if d != s.d || d * n != x.len() {
            self.fault = Some(format!(
                "blk.{layer}.{}: {} floats in {n} rows, {} wide before",
                site.name(),
                x.len(),
                s.d
            ));
            return;
        }
        for row in x.chunks_exact(d) {
            for (acc, &v) in s.sum_sq.iter_mut().zip(row) {
                *acc += f64::from(v) * f64::from(v);
            }
        }
        if self.gram {
            // XᵀX as (Xᵀ)(Xᵀ)ᵀ on the probe's parallel SGEMM: the rows of
            // one window in f32, the windows summed in f64.
            s.xt.resize(d * n, 0.0);
            for (r, row) in x.chunks_exact(d).enumerate() {
                for (c, &v) in row.iter().enumerate() {
                    s.xt[c * n + r] = v;
                }
            }
            s.g32.resize(d * d, 0.0);
            matmul_t(&s.xt, d, &s.xt, d, n, &mut s.g32);
            for (acc, &v) in s.gram.iter_mut().zip(&s.g32) {
                *acc += f64::from(v);
            }
        }
        s.rows += n as u64;
    }
}

/// `n` zeros, or None when the memory is not there.
fn zeros_f64(n: usize) -> Option<Vec<f64>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize(n, 0.0);
    Some(v)
}

/// The statistics of one matrix input.
#[derive(Debug, Clone)]
pub struct SiteStats {
    pub site: Site,
    /// Input channels.
    pub d: usize,
    /// Per channel, mean of x² over the tokens.
    pub mean_sq: Vec<f64>,
    /// XᵀX / tokens, `d × d` row-major, when recorded.
    pub gram: Option<Vec<f32>>,
}

/// A STATS file's content.
#[derive(Debug, Clone)]
pub struct CalibrationStats {
    /// `__metadata__`, format and version included.
    pub meta: BTreeMap<String, String>,
    /// Rows every site saw.
    pub tokens: u64,
    /// Per layer, the four sites in [`Site::ALL`] order.
    pub layers: Vec<Vec<SiteStats>>,
}

impl CalibrationStats {
    pub fn site(&self, layer: usize, site: Site) -> Option<&SiteStats> {
        self.layers.get(layer).and_then(|l| l.get(site.index()))
    }
}

/// Write `stats` as a STATS file (see the module documentation) through
/// an atomic output. Returns the bytes written.
pub fn write_stats(stats: &CalibrationStats, target: &OutputTarget) -> Result<u64> {
    let out = AtomicOutput::create(target)?;
    write_stats_to(stats, out)
}

fn write_stats_to(stats: &CalibrationStats, mut out: AtomicOutput) -> Result<u64> {
    let mut meta = Map::new();
    for (k, v) in &stats.meta {
        meta.insert(k.clone(), Value::String(v.clone()));
    }
    meta.insert("format".into(), FORMAT_NAME.into());
    meta.insert("version".into(), FORMAT_VERSION.to_string().into());
    meta.insert("layers".into(), stats.layers.len().to_string().into());
    meta.insert("tokens".into(), stats.tokens.to_string().into());
    let sites: Map<String, Value> = Site::ALL
        .iter()
        .map(|s| (s.name().to_string(), json!(s.feeds())))
        .collect();
    meta.insert(
        "sites".into(),
        Value::String(Value::Object(sites).to_string()),
    );
    let mut header = Map::new();
    header.insert("__metadata__".into(), Value::Object(meta));
    let mut offset = 0u64;
    for (li, sites) in stats.layers.iter().enumerate() {
        for s in sites {
            let base = format!("blk.{li}.{}", s.site.name());
            let len = 8 * s.mean_sq.len() as u64;
            header.insert(
                format!("{base}.mean_sq"),
                json!({"dtype": "F64", "shape": [s.d], "data_offsets": [offset, offset + len]}),
            );
            offset += len;
            if let Some(g) = &s.gram {
                let len = 4 * g.len() as u64;
                header.insert(
                    format!("{base}.gram"),
                    json!({"dtype": "F32", "shape": [s.d, s.d], "data_offsets": [offset, offset + len]}),
                );
                offset += len;
            }
        }
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let path = out.temp_path().to_path_buf();
    let io = |e| Error::io(&path, "cannot write the statistics", e);
    out.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&h).map_err(io)?;
    let mut buf = Vec::with_capacity(1 << 16);
    for sites in &stats.layers {
        for s in sites {
            buf.clear();
            s.mean_sq
                .iter()
                .for_each(|v| buf.extend_from_slice(&v.to_le_bytes()));
            out.write_all(&buf).map_err(io)?;
            if let Some(g) = &s.gram {
                for rows in g.chunks(1 << 14) {
                    buf.clear();
                    rows.iter()
                        .for_each(|v| buf.extend_from_slice(&v.to_le_bytes()));
                    out.write_all(&buf).map_err(io)?;
                }
            }
        }
    }
    out.commit()
}

/// The largest STATS header read (a real one is a few hundred KB).
const MAX_HEADER: u64 = 64 << 20;

/// Read and check a STATS file: format and version, every array's dtype,
/// shape and extent, all four sites of every layer present, a Gram matrix
/// for every site or none.
pub fn read_stats(path: &Path) -> Result<CalibrationStats> {
    let bad = |msg: String| err(ErrorKind::BadValue, msg).path(path);
    let mut f = File::open(path).map_err(|e| Error::io(path, "cannot open", e))?;
    let file_len = f
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat", e))?
        .len();
    let mut len8 = [0u8; 8];
    f.read_exact(&mut len8)
        .map_err(|_| err(ErrorKind::Truncated, "shorter than a STATS header").path(path))?;
    let hlen = u64::from_le_bytes(len8);
    if hlen > MAX_HEADER || hlen > file_len.saturating_sub(8) {
        return Err(err(
            ErrorKind::Truncated,
            format!("header of {hlen} bytes in a file of {file_len}"),
        )
        .path(path));
    }
    let mut h = vec![0u8; hlen as usize];
    f.read_exact(&mut h)
        .map_err(|e| Error::io(path, "cannot read the header", e))?;
    let header: Map<String, Value> = serde_json::from_slice(&h)
        .map_err(|e| err(ErrorKind::BadJson, format!("header: {e}")).path(path))?;
    let data_start = 8 + hlen;
    let meta: BTreeMap<String, String> = match header.get("__metadata__") {
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(bad(format!("__metadata__.{k} is not a string"))),
            })
            .collect::<Result<_>>()?,
        _ => return Err(bad("no __metadata__ object: not a STATS file".into())),
    };
    if meta.get("format").map(String::as_str) != Some(FORMAT_NAME) {
        return Err(err(
            ErrorKind::BadMagic,
            format!("__metadata__.format is not {FORMAT_NAME:?}: not a STATS file"),
        )
        .path(path));
    }
    let version = meta.get("version").map_or("", String::as_str);
    if version != FORMAT_VERSION.to_string() {
        return Err(err(
            ErrorKind::UnsupportedVersion,
            format!("STATS version {version:?}; this rknot reads version {FORMAT_VERSION}"),
        )
        .path(path));
    }
    let number = |k: &str| -> Result<u64> {
        meta.get(k)
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| bad(format!("__metadata__.{k} is missing or not a number")))
    };
    let tokens = number("tokens")?;
    let n_layer = usize::try_from(number("layers")?)
        .ok()
        .filter(|&n| n <= 1 << 16)
        .ok_or_else(|| bad("__metadata__.layers is out of range".into()))?;
    let gram = match meta.get("gram").map(String::as_str) {
        Some("true") => true,
        Some("false") => false,
        _ => return Err(bad("__metadata__.gram is not true or false".into())),
    };
    let mut layers: Vec<Vec<Option<SiteStats>>> = vec![vec![None, None, None, None]; n_layer];
    let mut grams: Vec<(usize, Site, usize, u64)> = Vec::new();
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        let (li, site, kind) = parse_name(name)
            .filter(|(li, _, _)| *li < n_layer)
            .ok_or_else(|| bad(format!("unexpected array {name:?}")))?;
        let dtype = entry.get("dtype").and_then(Value::as_str).unwrap_or("");
        let shape: Vec<u64> = entry
            .get("shape")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let offs: Vec<u64> = entry
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let (want_dtype, want_dims, elem) = match kind {
            "mean_sq" => ("F64", 1, 8u64),
            _ => ("F32", 2, 4u64),
        };
        let d = shape.first().copied().unwrap_or(0);
        let extent_ok = offs.len() == 2
            && offs[0] <= offs[1]
            && offs[1] <= file_len - data_start
            && shape.len() == want_dims
            && shape.iter().all(|&s| s == d)
            && d > 0
            && d <= 1 << 20
            && shape
                .iter()
                .try_fold(elem, |a, &s| a.checked_mul(s))
                .is_some_and(|bytes| bytes == offs[1] - offs[0]);
        if dtype != want_dtype || !extent_ok {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "{name}: dtype {dtype:?} shape {shape:?} data_offsets {offs:?} \
                     (want {want_dtype}, {want_dims} equal dims, inside the file)"
                ),
            )
            .path(path));
        }
        let d = d as usize;
        if kind == "mean_sq" {
            let bytes = read_at(&mut f, path, data_start + offs[0], d * 8)?;
            let mean_sq = bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap_or_default()))
                .collect();
            layers[li][site.index()] = Some(SiteStats {
                site,
                d,
                mean_sq,
                gram: None,
            });
        } else {
            grams.push((li, site, d, data_start + offs[0]));
        }
    }
    if grams.len() != if gram { n_layer * 4 } else { 0 } {
        return Err(bad(format!(
            "{} Gram matrices for {n_layer} layers with gram {gram}",
            grams.len()
        )));
    }
    for (li, site, d, at) in grams {
        let s = layers[li][site.index()]
            .as_mut()
            .filter(|s| s.d == d)
            .ok_or_else(|| {
                bad(format!(
                    "blk.{li}.{}.gram has no mean_sq of its width {d}",
                    site.name()
                ))
            })?;
        let bytes = read_at(&mut f, path, at, d * d * 4)?;
        s.gram = Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap_or_default()))
                .collect(),
        );
    }
    let layers = layers
        .into_iter()
        .enumerate()
        .map(|(li, sites)| {
            sites
                .into_iter()
                .zip(Site::ALL)
                .map(|(s, site)| {
                    s.ok_or_else(|| bad(format!("blk.{li}.{}.mean_sq is missing", site.name())))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(CalibrationStats {
        meta,
        tokens,
        layers,
    })
}

/// `blk.L.SITE.KIND` with KIND `mean_sq` or `gram`.
fn parse_name(name: &str) -> Option<(usize, Site, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (li, rest) = rest.split_once('.')?;
    let (site, kind) = rest.split_once('.')?;
    let li = li.parse().ok()?;
    let site = Site::from_name(site)?;
    matches!(kind, "mean_sq" | "gram").then_some((li, site, kind))
}

fn read_at(f: &mut File, path: &Path, at: u64, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    f.seek(SeekFrom::Start(at))
        .and_then(|_| f.read_exact(&mut buf))
        .map_err(|e| Error::io(path, "cannot read an array", e))?;
    Ok(buf)
}

/// Token ids given on the command line.
#[derive(Debug, Clone)]
pub struct TokenIds(pub Vec<u32>);

fn parse_token_ids(s: &str) -> std::result::Result<TokenIds, String> {
    let ids = s
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if ids.is_empty() {
        return Err("no token ids".into());
    }
    Ok(TokenIds(ids))
}

fn at_least(min: usize) -> impl Fn(&str) -> std::result::Result<usize, String> + Clone {
    move |s| match s.parse::<usize>() {
        Ok(v) if v >= min => Ok(v),
        Ok(v) => Err(format!("{v} is less than {min}")),
        Err(e) => Err(e.to_string()),
    }
}

/// `rknot calibrate` arguments.
#[derive(clap::Args, Debug, Clone)]
#[command(group(
    clap::ArgGroup::new("input")
        .required(true)
        .args(["text", "tokens"])
))]
pub struct CalibrateArgs {
    /// Model file (.rknot, SK32, dense .knot, GGUF) or a mounted rknot
    /// directory: anything `rknot probe` runs.
    pub model: PathBuf,
    /// Dense fallback (GGUF or dense .knot) for tensors MODEL lacks.
    #[arg(long)]
    pub dense: Option<PathBuf>,
    #[command(flatten)]
    pub remote: crate::source::cli::RemoteArgs,
    /// Calibration text (plain UTF-8), e.g.
    /// data/calibration/python-idle-help.txt.
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
    /// Token ids instead of a text, comma- or space-separated (no BOS is
    /// added).
    #[arg(long, value_name = "IDS", value_parser = parse_token_ids)]
    pub tokens: Option<TokenIds>,
    /// Where the statistics go (a safetensors file; see docs/QUALITY.md).
    #[arg(short, long, value_name = "STATS")]
    pub out: PathBuf,
    /// Replace an existing STATS.
    #[arg(long)]
    pub overwrite: bool,
    /// Tokens per window (each run in a fresh context), at least 2.
    #[arg(long, default_value_t = 512, value_parser = at_least(2))]
    pub ctx: usize,
    /// Use only the first N tokens of the text.
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    pub max_tokens: Option<usize>,
    /// Also record every input's Gram matrix XᵀX / n (d² floats each:
    /// about 400 MB for SmolLM2).
    #[arg(long)]
    pub gram: bool,
    /// Compute threads (default: all CPUs).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Where the decoded weights live (as `rknot probe --weights`).
    #[arg(long, value_enum, default_value_t = Residency::Auto)]
    pub weights: Residency,
    /// Take the tokenizer key/values from this model file.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

/// Run `rknot calibrate`.
pub fn run(args: CalibrateArgs) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("calibrate-{i}"))
        .build()?;
    pool.install(|| run_in_pool(&args))
        .map_err(|e| e as Box<dyn std::error::Error>)
}

fn run_in_pool(args: &CalibrateArgs) -> BoxResult<()> {
    // The output first: an existing STATS is refused before any work.
    let local = [Some(&args.model), args.dense.as_ref(), args.text.as_ref()];
    let mut target = OutputTarget {
        path: args.out.clone(),
        overwrite: args.overwrite,
        mode: 0o666,
        sources: Vec::new(),
    };
    for p in local.into_iter().flatten() {
        if let Ok(m) = std::fs::metadata(p) {
            use std::os::unix::fs::PermissionsExt;
            target.mode &= m.permissions().mode();
            target.sources.push(SourceVersion::from_metadata(&m));
        }
    }
    let out = AtomicOutput::create(&target)?;
    let stdout = std::io::stdout();
    let mut so = stdout.lock();
    let stats = record(args, &mut so)?;
    let bytes = write_stats_to(&stats, out)?;
    writeln!(
        so,
        "wrote {} ({bytes} bytes): {} layers × {} inputs over {} tokens",
        args.out.display(),
        stats.layers.len(),
        Site::ALL.len(),
        stats.tokens
    )?;
    Ok(())
}

/// Run the model over the calibration input `args` names (its `out` and
/// `overwrite` are not used) and return the statistics; progress lines go
/// to `so`. `rknot encode rknot --calibrate` calls this directly.
pub fn record(args: &CalibrateArgs, so: &mut dyn Write) -> BoxResult<CalibrationStats> {
    let text = match &args.text {
        Some(p) => {
            let t = read_text(p)?;
            if t.trim().is_empty() {
                return Err(format!("{}: the calibration text is empty", p.display()).into());
            }
            let name = p
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            Some((name, t))
        }
        None => None,
    };
    record_text(
        args,
        text.as_ref().map(|(n, t)| (n.as_str(), t.as_str())),
        so,
    )
}

/// As [`record`], the calibration text given as (name, text) instead of
/// `args.text` (the encoder's default calibrates on a text built into the
/// binary); None: `args.tokens`.
pub fn record_text(
    args: &CalibrateArgs,
    text: Option<(&str, &str)>,
    so: &mut dyn Write,
) -> BoxResult<CalibrationStats> {
    let main = load(
        "model:",
        &args.model,
        args.dense.as_deref(),
        args.tokenizer.as_deref(),
        args.weights,
        so,
    )?;
    let mut meta = BTreeMap::new();
    meta.insert("model".to_string(), main.label.clone());
    meta.insert("rknot".to_string(), crate::LONG_VERSION.to_string());
    meta.insert("ctx".to_string(), args.ctx.to_string());
    let (mut ids, bos) = match (text, &args.tokens) {
        (Some((name, t)), _) => {
            let tok = Tokenizer::from_metadata(main.source.metadata())
                .map_err(|e| format!("--text needs the model's tokenizer: {e}"))?;
            meta.insert("text".into(), name.to_string());
            meta.insert("text_bytes".into(), t.len().to_string());
            let digest = sha2::Sha256::digest(t.as_bytes());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            meta.insert("text_sha256".into(), hex);
            (
                tok.encode(t, false, false),
                tok.add_bos.then_some(tok.bos).flatten(),
            )
        }
        (None, Some(TokenIds(ids))) => {
            meta.insert("tokens_given".into(), "true".into());
            (ids.clone(), None)
        }
        _ => return Err("one of --text or --tokens is required".into()),
    };
    if let Some(m) = args.max_tokens {
        ids.truncate(m);
    }
    if ids.is_empty() {
        return Err("the calibration text has no tokens".into());
    }
    meta.insert(
        "bos".into(),
        bos.map_or_else(|| "none".to_string(), |b| b.to_string()),
    );
    let body = args.ctx - usize::from(bos.is_some());
    let windows: Vec<Vec<u32>> = ids
        .chunks(body)
        .map(|c| bos.into_iter().chain(c.iter().copied()).collect())
        .collect();
    meta.insert("windows".into(), windows.len().to_string());
    writeln!(
        so,
        "text:     {} tokens in {} windows of up to {} tokens{}{}",
        ids.len(),
        windows.len(),
        args.ctx,
        if bos.is_some() {
            " (each starting with BOS)"
        } else {
            ""
        },
        if args.gram {
            "; with Gram matrices"
        } else {
            ""
        }
    )?;
    let model = &main.model;
    let mut rec = StatsRecorder::for_model(&model.config, args.gram)?;
    let t = Instant::now();
    write!(so, "recording:")?;
    for (i, w) in windows.iter().enumerate() {
        let mut cache = KvCache::new(&model.config);
        // No logits: only the matrices' inputs are wanted.
        model.forward_recorded(w, &mut cache, w.len()..w.len(), Some(&mut rec))?;
        write!(so, " [{}/{}]", i + 1, windows.len())?;
        so.flush()?;
    }
    writeln!(so)?;
    let rows: usize = windows.iter().map(Vec::len).sum();
    let secs = t.elapsed().as_secs_f64();
    writeln!(so, "recorded {rows} tokens in {secs:.2} s")?;
    Ok(rec.finish(meta)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(n_layer: usize, d_model: usize, d_ff: usize) -> Config {
        Config {
            arch: &crate::arch::llama::Llama,
            n_layer,
            d_model,
            d_ff,
            moe: None,
            n_head: 1,
            n_head_kv: 1,
            head_dim: d_model,
            n_rot: 0,
            rope_base: 10000.0,
            rope_pos_scale: 1.0,
            rms_eps: 1e-5,
            n_vocab: 1,
            tied_embeddings: true,
        }
    }

    #[test]
    fn sums_that_cannot_fit_are_an_error_not_an_abort() {
        // 2^33 wide: d² overflows on the way to a byte count.
        let e = StatsRecorder::for_model(&config(1, 8, 1 << 33), true)
            .err()
            .unwrap();
        assert!(e.to_string().contains("--gram"), "{e}");
        // A 70B-shaped model's Gram matrices: terabytes.
        let e = StatsRecorder::for_model(&config(80, 8192, 28672), true)
            .err()
            .unwrap();
        assert!(e.to_string().contains("memory available"), "{e}");
        // Mean squares alone fit.
        let r = StatsRecorder::for_model(&config(2, 16, 32), false).unwrap();
        assert_eq!(r.layers[1][Site::FfnDownIn.index()].sum_sq.len(), 32);
    }

    #[test]
    fn names_round_trip() {
        for s in Site::ALL {
            assert_eq!(Site::from_name(s.name()), Some(s));
            assert_eq!(
                parse_name(&format!("blk.3.{}.gram", s.name())),
                Some((3, s, "gram"))
            );
        }
        assert_eq!(parse_name("blk.x.attn_in.gram"), None);
        assert_eq!(parse_name("blk.0.attn_in.other"), None);
    }
}
