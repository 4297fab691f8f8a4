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
//! ## Mixture-of-experts models (version 2)
//!
//! A model with experts writes `version` = `2` and `experts` (the count
//! per layer) in `__metadata__`. Its layers have no `ffn_down_in` (each
//! expert's down has its own input); `ffn_in` is every token's (the
//! router's input). Each expert E of layer L has its own sites, over only
//! the rows routed to it:
//! - `blk.L.expert.E.ffn_in.mean_sq` / `.gram` (the rows expert E's slab
//!   of ffn_gate_exps/ffn_up_exps multiplies) and
//!   `blk.L.expert.E.ffn_down_in.mean_sq` / `.gram` (its SwiGLU output,
//!   which its slab of ffn_down_exps multiplies), as above but divided by
//!   that expert's row count (all zeros when no row was routed to it);
//! - `blk.L.expert.E.rows`: U64 `[1]`, the rows routed to it.
//!
//! Each token goes to `expert_used_count` experts, so a layer's rows sum
//! to that many times `tokens`. A dense model's file is version 1 as
//! before; this rknot reads both.
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
/// `__metadata__.version` this code writes for a dense model (and reads).
pub const FORMAT_VERSION: u32 = 1;
/// `__metadata__.version` of a model with experts (per-expert sites).
pub const FORMAT_VERSION_EXPERTS: u32 = 2;

/// The sites of each expert, in file order.
pub const EXPERT_SITES: [Site; 2] = [Site::FfnIn, Site::FfnDownIn];

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
    /// Per layer, per expert, the sums of [`EXPERT_SITES`] (no layers: a
    /// dense model).
    experts: Vec<Vec<[SiteSums; 2]>>,
    /// Experts each token goes to (0: a dense model).
    n_used: usize,
    /// The first inconsistency seen (a recorder cannot fail mid-pass).
    fault: Option<String>,
}

impl StatsRecorder {
    pub fn new(n_layer: usize, gram: bool) -> StatsRecorder {
        StatsRecorder {
            gram,
            layers: (0..n_layer).map(|_| Default::default()).collect(),
            experts: Vec::new(),
            n_used: 0,
            fault: None,
        }
    }

    /// A recorder for `cfg`'s layers with every sum allocated now, so a
    /// model whose Gram matrices do not fit in memory is an error here
    /// rather than an abort mid-pass (f64 sums: 8 d² bytes per input;
    /// SmolLM2 0.8 GB, a 7B model about 44 GB).
    pub fn for_model(cfg: &Config, gram: bool) -> Result<StatsRecorder> {
        let mut r = StatsRecorder::new(cfg.n_layer, gram);
        // A layer with experts has no one ffn_down_in (width 0: not a
        // site); each expert has its ffn_in and ffn_down_in.
        let (n_expert, expert_widths) = match &cfg.moe {
            Some(m) => (m.n_expert, [cfg.d_model, m.d_ff]),
            None => (0, [0, 0]),
        };
        let down_width = if cfg.moe.is_some() { 0 } else { cfg.d_ff };
        let widths = [cfg.d_model, cfg.q_dim(), cfg.d_model, down_width];
        // f64 per layer; None when even the count overflows.
        let sums = |ws: &[usize]| {
            ws.iter().try_fold(0usize, |acc, &d| {
                let g = if gram { d.checked_mul(d)? } else { 0 };
                acc.checked_add(d)?.checked_add(g)
            })
        };
        let total =
            sums(&widths).and_then(|t| sums(&expert_widths)?.checked_mul(n_expert)?.checked_add(t));
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
        let alloc = |s: &mut SiteSums, d: usize| -> Result<()> {
            s.d = d;
            s.sum_sq = zeros_f64(d).ok_or_else(too_large)?;
            if gram {
                s.gram = d.checked_mul(d).and_then(zeros_f64).ok_or_else(too_large)?;
            }
            Ok(())
        };
        for layer in &mut r.layers {
            for (s, &d) in layer.iter_mut().zip(&widths) {
                alloc(s, d)?;
            }
        }
        if let Some(m) = &cfg.moe {
            r.n_used = m.n_used;
            r.experts = (0..cfg.n_layer)
                .map(|_| (0..m.n_expert).map(|_| Default::default()).collect())
                .collect();
            for layer in &mut r.experts {
                for e in layer.iter_mut() {
                    for (s, &d) in e.iter_mut().zip(&expert_widths) {
                        alloc(s, d)?;
                    }
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
        let internal = |msg: String| err(ErrorKind::BadValue, format!("internal: {msg}"));
        let tokens = self.layers.first().map_or(0, |l| l[0].rows);
        let gram = self.gram;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (li, sums) in self.layers.into_iter().enumerate() {
            let mut sites = Vec::with_capacity(4);
            for (site, s) in Site::ALL.into_iter().zip(sums) {
                // A layer with experts has no ffn_down_in of its own.
                if s.d == 0 && s.rows == 0 && !self.experts.is_empty() && site == Site::FfnDownIn {
                    continue;
                }
                if s.rows != tokens || s.rows == 0 {
                    return Err(internal(format!(
                        "blk.{li}.{} saw {} rows, the first site {tokens}",
                        site.name(),
                        s.rows
                    )));
                }
                sites.push(s.stats(site, gram));
            }
            layers.push(sites);
        }
        let mut experts = Vec::with_capacity(self.experts.len());
        for (li, layer) in self.experts.into_iter().enumerate() {
            let routed: u64 = layer.iter().map(|e| e[0].rows).sum();
            if routed != tokens * self.n_used as u64 {
                return Err(internal(format!(
                    "layer {li}'s experts saw {routed} rows, {} tokens × {} experts each",
                    tokens, self.n_used
                )));
            }
            let mut out = Vec::with_capacity(layer.len());
            for (e, sums) in layer.into_iter().enumerate() {
                let rows = sums[0].rows;
                if sums[1].rows != rows {
                    return Err(internal(format!(
                        "blk.{li}.expert.{e}: ffn_in saw {rows} rows, ffn_down_in {}",
                        sums[1].rows
                    )));
                }
                let sites = EXPERT_SITES
                    .into_iter()
                    .zip(sums)
                    .map(|(site, s)| s.stats(site, gram))
                    .collect();
                out.push(ExpertStats { rows, sites });
            }
            experts.push(out);
        }
        meta.insert("tokens".into(), tokens.to_string());
        meta.insert("gram".into(), gram.to_string());
        Ok(CalibrationStats {
            meta,
            tokens,
            layers,
            experts,
        })
    }
}

impl SiteSums {
    /// The means over the rows seen (zeros when none were).
    fn stats(self, site: Site, gram: bool) -> SiteStats {
        let inv = if self.rows == 0 {
            0.0
        } else {
            1.0 / self.rows as f64
        };
        SiteStats {
            site,
            d: self.d,
            mean_sq: self.sum_sq.iter().map(|v| v * inv).collect(),
            gram: gram.then(|| self.gram.iter().map(|v| (v * inv) as f32).collect()),
        }
    }

    /// Add the `n` rows `x` (`n × d`); an error (the recorder's fault)
    /// when they are not `d` wide.
    fn add(&mut self, gram: bool, x: &[f32], n: usize) -> std::result::Result<(), String> {
        let d = x.len() / n;
        if self.d == 0 {
            self.d = d;
            self.sum_sq = vec![0.0; d];
            if gram {
                self.gram = vec![0.0; d * d];
            }
        }
        if d != self.d || d * n != x.len() {
            return Err(format!(
                "{} floats in {n} rows, {} wide before",
                x.len(),
                self.d
            ));
        }
        for row in x.chunks_exact(d) {
            for (acc, &v) in self.sum_sq.iter_mut().zip(row) {
                *acc += f64::from(v) * f64::from(v);
            }
        }
        if gram {
            // XᵀX as (Xᵀ)(Xᵀ)ᵀ on the probe's parallel SGEMM: the rows of
            // one window in f32, the windows summed in f64.
            self.xt.resize(d * n, 0.0);
            for (r, row) in x.chunks_exact(d).enumerate() {
                for (c, &v) in row.iter().enumerate() {
                    self.xt[c * n + r] = v;
                }
            }
            self.g32.resize(d * d, 0.0);
            matmul_t(&self.xt, d, &self.xt, d, n, &mut self.g32);
            for (acc, &v) in self.gram.iter_mut().zip(&self.g32) {
                *acc += f64::from(v);
            }
        }
        self.rows += n as u64;
        Ok(())
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
        if let Err(why) = s.add(self.gram, x, n) {
            self.fault = Some(format!("blk.{layer}.{}: {why}", site.name()));
        }
    }

    fn record_expert(&mut self, layer: usize, expert: usize, site: Site, x: &[f32], n: usize) {
        if n == 0 || self.fault.is_some() {
            return;
        }
        let k = EXPERT_SITES.iter().position(|s| *s == site);
        let Some(s) = self
            .experts
            .get_mut(layer)
            .and_then(|l| l.get_mut(expert))
            .zip(k)
            .map(|(e, k)| &mut e[k])
        else {
            self.fault = Some(format!(
                "blk.{layer}.expert.{expert}.{} recorded, the model has no such expert site",
                site.name()
            ));
            return;
        };
        if let Err(why) = s.add(self.gram, x, n) {
            self.fault = Some(format!(
                "blk.{layer}.expert.{expert}.{}: {why}",
                site.name()
            ));
        }
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

/// One expert's statistics.
#[derive(Debug, Clone)]
pub struct ExpertStats {
    /// Rows routed to it.
    pub rows: u64,
    /// [`EXPERT_SITES`], in order.
    pub sites: Vec<SiteStats>,
}

/// A STATS file's content.
#[derive(Debug, Clone)]
pub struct CalibrationStats {
    /// `__metadata__`, format and version included.
    pub meta: BTreeMap<String, String>,
    /// Rows every site of a layer saw.
    pub tokens: u64,
    /// Per layer, its sites in [`Site::ALL`] order: all four, or, with
    /// experts, all but `ffn_down_in`.
    pub layers: Vec<Vec<SiteStats>>,
    /// Per layer, per expert (no layers: a dense model).
    pub experts: Vec<Vec<ExpertStats>>,
}

impl CalibrationStats {
    pub fn site(&self, layer: usize, site: Site) -> Option<&SiteStats> {
        self.layers
            .get(layer)
            .and_then(|l| l.iter().find(|s| s.site == site))
    }

    /// Expert `expert`'s `site` (of [`EXPERT_SITES`]) in layer `layer`.
    pub fn expert_site(&self, layer: usize, expert: usize, site: Site) -> Option<&SiteStats> {
        self.experts
            .get(layer)?
            .get(expert)?
            .sites
            .iter()
            .find(|s| s.site == site)
    }

    /// Experts per layer (0: a dense model).
    pub fn n_expert(&self) -> usize {
        self.experts.first().map_or(0, Vec::len)
    }

    /// Every site's statistics, the experts' included.
    pub fn all_sites(&self) -> impl Iterator<Item = &SiteStats> {
        self.layers
            .iter()
            .flatten()
            .chain(self.experts.iter().flatten().flat_map(|e| &e.sites))
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
    let n_expert = stats.n_expert();
    let version = match n_expert {
        0 => FORMAT_VERSION,
        _ => FORMAT_VERSION_EXPERTS,
    };
    meta.insert("format".into(), FORMAT_NAME.into());
    meta.insert("version".into(), version.to_string().into());
    meta.insert("layers".into(), stats.layers.len().to_string().into());
    meta.insert("tokens".into(), stats.tokens.to_string().into());
    if n_expert > 0 {
        meta.insert("experts".into(), n_expert.to_string().into());
    }
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
    // Every array in data order: its name, then what to write.
    enum Data<'a> {
        F64(&'a [f64]),
        F32(&'a [f32]),
        U64(u64),
    }
    let mut arrays: Vec<(String, Data)> = Vec::new();
    for (li, sites) in stats.layers.iter().enumerate() {
        for s in sites {
            let base = format!("blk.{li}.{}", s.site.name());
            arrays.push((format!("{base}.mean_sq"), Data::F64(&s.mean_sq)));
            if let Some(g) = &s.gram {
                arrays.push((format!("{base}.gram"), Data::F32(g)));
            }
        }
        for (e, x) in stats.experts.get(li).into_iter().flatten().enumerate() {
            arrays.push((format!("blk.{li}.expert.{e}.rows"), Data::U64(x.rows)));
            for s in &x.sites {
                let base = format!("blk.{li}.expert.{e}.{}", s.site.name());
                arrays.push((format!("{base}.mean_sq"), Data::F64(&s.mean_sq)));
                if let Some(g) = &s.gram {
                    arrays.push((format!("{base}.gram"), Data::F32(g)));
                }
            }
        }
    }
    let mut offset = 0u64;
    for (name, data) in &arrays {
        let (dtype, shape, len) = match data {
            Data::F64(v) => ("F64", vec![v.len()], 8 * v.len() as u64),
            Data::F32(g) => {
                let d = g.len().isqrt();
                ("F32", vec![d, d], 4 * g.len() as u64)
            }
            Data::U64(_) => ("U64", vec![1], 8),
        };
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let path = out.temp_path().to_path_buf();
    let io = |e| Error::io(&path, "cannot write the statistics", e);
    out.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&h).map_err(io)?;
    let mut buf = Vec::with_capacity(1 << 16);
    for (_, data) in &arrays {
        match data {
            Data::F64(v) => {
                buf.clear();
                v.iter()
                    .for_each(|v| buf.extend_from_slice(&v.to_le_bytes()));
                out.write_all(&buf).map_err(io)?;
            }
            Data::F32(g) => {
                for rows in g.chunks(1 << 14) {
                    buf.clear();
                    rows.iter()
                        .for_each(|v| buf.extend_from_slice(&v.to_le_bytes()));
                    out.write_all(&buf).map_err(io)?;
                }
            }
            Data::U64(n) => out.write_all(&n.to_le_bytes()).map_err(io)?,
        }
    }
    out.commit()
}

/// The largest STATS header read (a real one is a few hundred KB).
const MAX_HEADER: u64 = 64 << 20;

/// Read and check a STATS file: format and version, every array's dtype,
/// shape and extent, every site of every layer (and of every expert, in
/// version 2) present, a Gram matrix for every site or none.
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
    let with_experts = match version {
        v if v == FORMAT_VERSION.to_string() => false,
        v if v == FORMAT_VERSION_EXPERTS.to_string() => true,
        _ => {
            return Err(err(
                ErrorKind::UnsupportedVersion,
                format!(
                    "STATS version {version:?}; this rknot reads versions {FORMAT_VERSION} and \
                     {FORMAT_VERSION_EXPERTS}"
                ),
            )
            .path(path));
        }
    };
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
    let n_expert = match with_experts {
        false => 0,
        true => usize::try_from(number("experts")?)
            .ok()
            .filter(|n| (1..=4096).contains(n))
            .ok_or_else(|| bad("__metadata__.experts is not in 1..=4096".into()))?,
    };
    let gram = match meta.get("gram").map(String::as_str) {
        Some("true") => true,
        Some("false") => false,
        _ => return Err(bad("__metadata__.gram is not true or false".into())),
    };
    // Slots: per layer its four sites, then per expert its two (a layer
    // with experts has no ffn_down_in: that slot stays empty).
    let slots_per_layer = 4 + 2 * n_expert;
    let slot_of = |a: &ArrayName| -> Option<usize> {
        let base = a.layer * slots_per_layer;
        match a.expert {
            None => Some(base + a.site.index()),
            Some(e) => {
                let k = EXPERT_SITES.iter().position(|s| *s == a.site)?;
                Some(base + 4 + 2 * e + k)
            }
        }
    };
    let slot_name = |slot: usize| {
        let (li, k) = (slot / slots_per_layer, slot % slots_per_layer);
        match k.checked_sub(4) {
            None => format!("blk.{li}.{}", Site::ALL[k].name()),
            Some(x) => format!("blk.{li}.expert.{}.{}", x / 2, EXPERT_SITES[x % 2].name()),
        }
    };
    let mut slots: Vec<Option<SiteStats>> = vec![None; n_layer * slots_per_layer];
    let mut rows: Vec<Option<u64>> = vec![None; n_layer * n_expert];
    let mut grams: Vec<(usize, usize, u64)> = Vec::new();
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        let a = parse_name(name)
            .filter(|a| a.layer < n_layer && a.expert.is_none_or(|e| e < n_expert))
            .filter(|a| !(with_experts && a.expert.is_none() && a.site == Site::FfnDownIn))
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
        let (want_dtype, want_dims, elem) = match a.kind {
            ArrayKind::MeanSq => ("F64", 1, 8u64),
            ArrayKind::Rows => ("U64", 1, 8u64),
            ArrayKind::Gram => ("F32", 2, 4u64),
        };
        let d = shape.first().copied().unwrap_or(0);
        let extent_ok = offs.len() == 2
            && offs[0] <= offs[1]
            && offs[1] <= file_len - data_start
            && shape.len() == want_dims
            && shape.iter().all(|&s| s == d)
            && d > 0
            && d <= 1 << 20
            && (a.kind != ArrayKind::Rows || d == 1)
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
        let slot = slot_of(&a).ok_or_else(|| bad(format!("unexpected array {name:?}")))?;
        match a.kind {
            ArrayKind::Rows => {
                let bytes = read_at(&mut f, path, data_start + offs[0], 8)?;
                let e = a.expert.unwrap_or(0);
                rows[a.layer * n_expert + e] =
                    Some(u64::from_le_bytes(bytes.try_into().unwrap_or_default()));
            }
            ArrayKind::MeanSq => {
                let bytes = read_at(&mut f, path, data_start + offs[0], d * 8)?;
                let mean_sq = bytes
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap_or_default()))
                    .collect();
                slots[slot] = Some(SiteStats {
                    site: a.site,
                    d,
                    mean_sq,
                    gram: None,
                });
            }
            ArrayKind::Gram => grams.push((slot, d, data_start + offs[0])),
        }
    }
    let sites_per_layer = if with_experts { 3 } else { 4 };
    let want_grams = n_layer * (sites_per_layer + 2 * n_expert);
    if grams.len() != if gram { want_grams } else { 0 } {
        return Err(bad(format!(
            "{} Gram matrices for {n_layer} layers of {n_expert} experts with gram {gram}",
            grams.len()
        )));
    }
    for (slot, d, at) in grams {
        let s = slots[slot].as_mut().filter(|s| s.d == d).ok_or_else(|| {
            bad(format!(
                "{}.gram has no mean_sq of its width {d}",
                slot_name(slot)
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
    let mut layers = Vec::with_capacity(n_layer);
    let mut experts = Vec::with_capacity(if with_experts { n_layer } else { 0 });
    let mut slots = slots.into_iter().enumerate();
    let mut take = || -> Result<SiteStats> {
        match slots.next() {
            Some((_, Some(s))) => Ok(s),
            Some((slot, None)) => Err(bad(format!("{}.mean_sq is missing", slot_name(slot)))),
            None => Err(bad("internal: fewer slots than sites".into())),
        }
    };
    for li in 0..n_layer {
        let mut sites = Vec::with_capacity(4);
        for site in Site::ALL {
            if with_experts && site == Site::FfnDownIn {
                // The layer's own ffn_down_in slot: none with experts.
                let _ = take();
                continue;
            }
            sites.push(take()?);
        }
        layers.push(sites);
        if !with_experts {
            continue;
        }
        let mut layer = Vec::with_capacity(n_expert);
        for e in 0..n_expert {
            let sites = vec![take()?, take()?];
            let rows = rows[li * n_expert + e]
                .ok_or_else(|| bad(format!("blk.{li}.expert.{e}.rows is missing")))?;
            layer.push(ExpertStats { rows, sites });
        }
        experts.push(layer);
    }
    Ok(CalibrationStats {
        meta,
        tokens,
        layers,
        experts,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrayKind {
    MeanSq,
    Gram,
    Rows,
}

/// A STATS array's name: `blk.L.SITE.KIND` (KIND `mean_sq` or `gram`),
/// `blk.L.expert.E.SITE.KIND` or `blk.L.expert.E.rows` (site `ffn_in`).
#[derive(Debug, PartialEq, Eq)]
struct ArrayName {
    layer: usize,
    expert: Option<usize>,
    site: Site,
    kind: ArrayKind,
}

fn parse_name(name: &str) -> Option<ArrayName> {
    let rest = name.strip_prefix("blk.")?;
    let (li, rest) = rest.split_once('.')?;
    let layer = li.parse().ok()?;
    let (expert, rest) = match rest.strip_prefix("expert.") {
        Some(r) => {
            let (e, r) = r.split_once('.')?;
            (Some(e.parse().ok()?), r)
        }
        None => (None, rest),
    };
    if expert.is_some() && rest == "rows" {
        return Some(ArrayName {
            layer,
            expert,
            site: Site::FfnIn,
            kind: ArrayKind::Rows,
        });
    }
    let (site, kind) = rest.split_once('.')?;
    let site = Site::from_name(site).filter(|s| expert.is_none() || EXPERT_SITES.contains(s))?;
    let kind = match kind {
        "mean_sq" => ArrayKind::MeanSq,
        "gram" => ArrayKind::Gram,
        _ => return None,
    };
    Some(ArrayName {
        layer,
        expert,
        site,
        kind,
    })
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
mod tests;
