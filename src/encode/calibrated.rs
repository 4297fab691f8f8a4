//! The calibrated .rknot profile: affine blocks chosen with the model's
//! real activations (`rknot encode rknot --calibrate TEXT`).
//!
//! Every matrix is stored in affine blocks (docs/FORMAT.md section 6.3:
//! one f16 scale and one f16 offset per `group` consecutive weights of a
//! row, `bits`-bit codes; the grid of ggml's Q4_1). What the calibration
//! statistics (`probe::calibrate`) buy, each measured alone in
//! docs/QUALITY.md:
//!
//! - **Error-compensating rounding** (GPTQ, `encode::gptq`): the columns
//!   of each row are rounded in order and each rounding error is pushed onto
//!   the columns not yet rounded through the inverse Gram matrix of the
//!   matrix's input, minimising the output error ‖(W − Ŵ)X‖ rather than the
//!   weight error.
//! - **Activation-weighted scale search**: each group's scale and offset
//!   minimise Σ h_j (w_j − ŵ_j)², h_j the mean square of input channel j,
//!   rather than the plain squared error; a group whose values already lie
//!   on an f16 affine grid of `2^bits` levels (a Q4_1 source at 4 bits) is
//!   stored exactly.
//! - **Bit allocation across matrices**: every matrix is encoded at every
//!   candidate width (first pass, nothing kept but the output errors), then
//!   widths are raised one step at a time where the output error falls most
//!   per stored bit, until the whole file reaches `--target-bpw` (tensors
//!   kept as ggml blocks, the header and the checksums counted), and the
//!   second pass writes the chosen widths.
//! - **The manifest** (standing indices, amplitudes) from the measured
//!   energy of the hidden dimensions at the layer's two normed inputs
//!   instead of the weights' column norms. With nothing dropped it does
//!   not change decoding; it records which dimensions carry the signal.

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use crate::encode::gptq::{GptqOptions, GroupQuantizer, InverseFactor, gptq_with};
use crate::encode::order::OrdF64;
use crate::error::{ErrorKind, Result, err};
use crate::format::rknot::{Coding, TensorSpec, pack_affine_block};
use crate::probe::calibrate::{CalibrationStats, Site};
use crate::quant::GgmlType;

/// How the first pass's output errors are compared across matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// One (width, group) for every matrix: the largest that fits.
    Uniform,
    /// `Uniform` first, then what is left of the budget by `Output`: the
    /// default, measured best (docs/QUALITY.md).
    Balanced,
    /// The output error ‖(W − Ŵ)X‖² / n as it is.
    Output,
    /// The output error over the matrix's output energy ‖WX‖² / n: every
    /// matrix's relative error counts the same.
    Relative,
}

impl Allocation {
    pub fn parse(s: &str) -> Option<Allocation> {
        match s {
            "uniform" => Some(Allocation::Uniform),
            "balanced" => Some(Allocation::Balanced),
            "output" => Some(Allocation::Output),
            "relative" => Some(Allocation::Relative),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Allocation::Uniform => "uniform",
            Allocation::Balanced => "balanced",
            Allocation::Output => "output",
            Allocation::Relative => "relative",
        }
    }
}

/// Options of the calibrated profile.
#[derive(Clone)]
pub struct CalibratedOptions {
    pub stats: Arc<CalibrationStats>,
    /// Whole-file bits per weight of the output.
    pub target_bpw: f64,
    /// Code widths a matrix may get, ascending.
    pub widths: Vec<u8>,
    /// Weights per affine block (along a row) a matrix may get: each
    /// width with each group size is a candidate.
    pub groups: Vec<u64>,
    /// Error-compensating rounding (needs Gram matrices in the stats).
    pub gptq: bool,
    /// Scale search weighted by the input channels' mean squares.
    pub weighted_fit: bool,
    pub allocation: Allocation,
    pub damp: f64,
    /// How vocabulary tables are stored.
    pub vocab: VocabType,
}

impl std::fmt::Debug for CalibratedOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CalibratedOptions")
            .field("tokens", &self.stats.tokens)
            .field("target_bpw", &self.target_bpw)
            .field("widths", &self.widths)
            .field("groups", &self.groups)
            .field("gptq", &self.gptq)
            .field("weighted_fit", &self.weighted_fit)
            .field("allocation", &self.allocation)
            .finish()
    }
}

impl CalibratedOptions {
    pub fn new(stats: Arc<CalibrationStats>, target_bpw: f64) -> CalibratedOptions {
        CalibratedOptions {
            stats,
            target_bpw,
            widths: vec![2, 3, 4, 5, 6, 8],
            groups: vec![32, 64],
            gptq: true,
            weighted_fit: true,
            allocation: Allocation::Balanced,
            damp: 0.01,
            // Measured on SmolLM2 (docs/QUALITY.md): its Q8_0 embedding
            // as Q5_1 costs less perplexity than the bits it frees buy
            // back in the layer matrices.
            vocab: VocabType::Q5_1,
        }
    }

    /// Check the options against each other and the statistics.
    pub fn check(&self) -> Result<()> {
        if !(self.target_bpw.is_finite() && self.target_bpw > 0.0) {
            return Err(err(
                ErrorKind::BadValue,
                format!("--target-bpw {} must be positive", self.target_bpw),
            ));
        }
        if self.widths.is_empty() || self.widths.iter().any(|&w| !(1..=16).contains(&w)) {
            return Err(err(
                ErrorKind::BadValue,
                format!("code widths {:?} must be in 1..=16", self.widths),
            ));
        }
        if self.groups.is_empty()
            || self
                .groups
                .iter()
                .any(|g| !(1..=crate::format::rknot::MAX_TILE_ELEMS).contains(g))
        {
            return Err(err(
                ErrorKind::BadValue,
                format!("--groups {:?} must be in 1..=65536", self.groups),
            ));
        }
        if self.gptq && self.stats.layers.iter().flatten().any(|s| s.gram.is_none()) {
            return Err(err(
                ErrorKind::BadValue,
                "error-compensating rounding needs Gram matrices: a STATS file made with \
                 `rknot calibrate --gram`, or --no-gptq",
            ));
        }
        Ok(())
    }
}

/// An affine block's parameters: value = code × scale + offset (f32
/// arithmetic on the f16 values, as the reader computes it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AffineParams {
    pub scale: f16,
    pub offset: f16,
}

impl AffineParams {
    fn parts(self) -> (f32, f32) {
        (self.scale.to_f32(), self.offset.to_f32())
    }
}

/// Affine quantizer of `bits` bits over groups of `group` columns of a
/// row, its parameters searched per group.
pub struct AffineQuantizer<'a> {
    pub bits: u8,
    pub group: usize,
    /// Per column, what an error there costs (the input channel's mean
    /// square); `None`: every column the same.
    pub weights: Option<&'a [f32]>,
}

impl AffineQuantizer<'_> {
    fn levels(&self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// The code `value` rounds to.
    pub fn code(&self, p: &AffineParams, value: f32) -> u32 {
        let (s, o) = p.parts();
        if s == 0.0 {
            return 0;
        }
        let c = ((value - o) / s).round();
        if c.is_nan() {
            return 0;
        }
        c.clamp(0.0, self.levels() as f32) as u32
    }

    fn value(p: &AffineParams, code: u32) -> f32 {
        let (s, o) = p.parts();
        code as f32 * s + o
    }

    fn error(&self, p: &AffineParams, col0: usize, values: &[f32]) -> f64 {
        values
            .iter()
            .enumerate()
            .map(|(j, &v)| {
                let d = f64::from(v - Self::value(p, self.code(p, v)));
                let w = self.weights.map_or(1.0, |w| f64::from(w[col0 + j]));
                w * d * d
            })
            .sum()
    }

    /// The f16 grid of at most `2^bits` levels that holds every value
    /// exactly, if there is one (the group is already quantized: a Q4_1
    /// source at 4 bits or more).
    fn exact_grid(&self, values: &[f32]) -> Option<AffineParams> {
        let mut u: Vec<f32> = values.to_vec();
        u.sort_by(f32::total_cmp);
        u.dedup();
        let lo = *u.first()?;
        let exact = |p: AffineParams| {
            values
                .iter()
                .all(|&v| Self::value(&p, self.code(&p, v)) == v)
        };
        if u.len() == 1 {
            let p = AffineParams {
                scale: f16::ZERO,
                offset: f16::from_f32(lo),
            };
            return exact(p).then_some(p);
        }
        let step = u.windows(2).map(|w| w[1] - w[0]).fold(f32::MAX, f32::min);
        let scale = f16::from_f32(step);
        let s = scale.to_f32();
        if !(s > 0.0 && s.is_finite()) {
            return None;
        }
        let span = ((u[u.len() - 1] - lo) / s).round();
        if span.is_nan() || span > self.levels() as f32 {
            return None;
        }
        // The lowest value need not be code 0 when the group does not use
        // its grid's bottom: try offsets a few steps below it.
        let room = (self.levels() as f32 - span).min(32.0) as u32;
        (0..=room).find_map(|k| {
            let p = AffineParams {
                scale,
                offset: f16::from_f32(lo - k as f32 * s),
            };
            exact(p).then_some(p)
        })
    }

    /// Least-squares scale and offset for fixed codes (weighted), rounded
    /// to f16.
    fn refit(&self, p: &AffineParams, col0: usize, values: &[f32]) -> Option<AffineParams> {
        let (mut sw, mut sc, mut scc, mut sv, mut scv) = (0f64, 0f64, 0f64, 0f64, 0f64);
        for (j, &v) in values.iter().enumerate() {
            let w = self.weights.map_or(1.0, |w| f64::from(w[col0 + j]));
            let c = f64::from(self.code(p, v));
            let v = f64::from(v);
            sw += w;
            sc += w * c;
            scc += w * c * c;
            sv += w * v;
            scv += w * c * v;
        }
        let det = sw * scc - sc * sc;
        if det.is_nan() || det.abs() <= 1e-12 * sw * scc {
            return None;
        }
        let scale = (sw * scv - sc * sv) / det;
        let offset = (sv - scale * sc) / sw;
        let p = AffineParams {
            scale: f16::from_f64(scale),
            offset: f16::from_f64(offset),
        };
        (p.scale.is_finite() && p.offset.is_finite() && p.scale.to_f32() > 0.0).then_some(p)
    }
}

impl GroupQuantizer for AffineQuantizer<'_> {
    type Params = AffineParams;

    fn group_size(&self) -> usize {
        self.group
    }

    fn fit(&self, _row: usize, col0: usize, values: &[f32]) -> AffineParams {
        if let Some(p) = self.exact_grid(values) {
            return p;
        }
        let lo = values.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let levels = self.levels() as f32;
        let range = hi - lo;
        let candidate = |a: f32, b: f32| AffineParams {
            scale: f16::from_f32(((range * (1.0 - a - b)) / levels).max(0.0)),
            offset: f16::from_f32(lo + a * range),
        };
        let mut best = candidate(0.0, 0.0);
        let mut best_err = self.error(&best, col0, values);
        // Clip either end of the range (outliers cost less than coarse
        // steps everywhere), then refit scale and offset to the codes.
        const CLIPS: [f32; 3] = [0.0, 0.05, 0.1];
        for &a in &CLIPS {
            for &b in &CLIPS {
                if a == 0.0 && b == 0.0 {
                    continue;
                }
                let p = candidate(a, b);
                let e = self.error(&p, col0, values);
                if e < best_err {
                    (best, best_err) = (p, e);
                }
            }
        }
        for _ in 0..2 {
            match self.refit(&best, col0, values) {
                Some(p) => {
                    let e = self.error(&p, col0, values);
                    if e < best_err {
                        (best, best_err) = (p, e);
                    } else {
                        break;
                    }
                }
                None => break,
            }
        }
        best
    }

    fn round(&self, p: &AffineParams, value: f32) -> f32 {
        Self::value(p, self.code(p, value))
    }
}

/// One matrix quantized: its blocks and what it cost.
pub struct Quantized {
    pub blocks: Vec<Vec<u8>>,
    /// Output error ‖(W − Ŵ)X‖² / n (under the damped Gram matrix with
    /// GPTQ; under its diagonal without).
    pub loss: f64,
    /// Ŵ, row-major.
    pub w_hat: Vec<f32>,
}

/// Quantize `w` (`rows × cols`) into affine blocks of `group` weights
/// along rows, at `bits` bits, with GPTQ when `factor` is given.
pub fn quantize_matrix(
    w: &[f32],
    cols: usize,
    bits: u8,
    group: usize,
    weights: Option<&[f32]>,
    factor: Option<&InverseFactor>,
    diag: &[f32],
) -> Result<Quantized> {
    // f16 scales and offsets: a value beyond f16's range (or not finite)
    // has no affine block that holds it.
    if let Some(i) = w.iter().position(|v| v.is_nan() || v.abs() > 65504.0) {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "weight {i} is {}: affine blocks hold values within f16's range (±65504)",
                w[i]
            ),
        ));
    }
    let q = AffineQuantizer {
        bits,
        group,
        weights,
    };
    let mut w_hat = w.to_vec();
    let (params, loss) = match factor {
        Some(f) => gptq_with(&mut w_hat, f, &q)?,
        None => {
            let params = crate::encode::gptq::round_to_nearest(&mut w_hat, cols, &q);
            let loss = w
                .par_chunks(cols)
                .zip(w_hat.par_chunks(cols))
                .map(|(a, b)| {
                    a.iter()
                        .zip(b)
                        .zip(diag)
                        .map(|((&x, &y), &h)| f64::from(h) * f64::from(x - y).powi(2))
                        .sum::<f64>()
                })
                .sum();
            (params, loss)
        }
    };
    let groups_per_row = cols.div_ceil(group);
    let blocks = params
        .par_iter()
        .enumerate()
        .map(|(i, p)| {
            let (r, g) = (i / groups_per_row, i % groups_per_row);
            let c0 = g * group;
            let c1 = (c0 + group).min(cols);
            let codes: Vec<u32> = w_hat[r * cols + c0..r * cols + c1]
                .iter()
                .map(|&v| q.code(p, v))
                .collect();
            pack_affine_block(bits, p.scale, p.offset, &codes)
        })
        .collect();
    Ok(Quantized {
        blocks,
        loss,
        w_hat,
    })
}

/// Stored bytes of a `rows × cols` matrix in affine blocks.
pub fn stored_bytes(rows: u64, cols: u64, bits: u8, group: u64) -> u64 {
    let full = cols / group;
    let tail = cols % group;
    let block = |n: u64| 4 + (n * u64::from(bits)).div_ceil(8);
    rows * (full * block(group) + if tail > 0 { block(tail) } else { 0 })
}

/// The spec of a matrix stored in affine blocks.
pub fn spec(name: &str, d_out: u64, d_in: u64, bits: u8, group: u64) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        d_out,
        d_in,
        restrict_rows: false,
        restrict_cols: false,
        coding: Coding::Affine { bits },
        block_rows: 1,
        block_cols: group.min(d_in),
    }
}

/// One way to store a matrix: its width and group size, what it costs and
/// what it loses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub bits: u8,
    pub group: u64,
    pub bytes: u64,
    pub loss: f64,
}

/// What one matrix may cost and lose.
#[derive(Debug, Clone)]
pub struct Candidates {
    pub name: String,
    /// Ascending in bytes, strictly descending in loss (see [`pareto`]).
    pub options: Vec<Choice>,
    /// What the allocation divides the loss by.
    pub norm: f64,
}

/// The choices worth having: sorted by size, each losing strictly less
/// than every smaller one (a bigger choice that loses as much is never
/// worth its bytes).
pub fn pareto(mut all: Vec<Choice>) -> Vec<Choice> {
    all.sort_by(|a, b| a.bytes.cmp(&b.bytes).then(a.loss.total_cmp(&b.loss)));
    let mut kept: Vec<Choice> = Vec::new();
    for c in all {
        if kept.last().is_none_or(|k| c.loss < k.loss) {
            kept.push(c);
        }
    }
    kept
}

/// Choose one width per matrix: start every matrix at its narrowest
/// option, then raise, one step at a time, the matrix whose loss falls
/// most per added byte, while the total stays within `budget` bytes.
/// Returns the index into each matrix's options; `None` when even the
/// narrowest options exceed the budget.
pub fn allocate(cands: &[Candidates], budget: u64, how: Allocation) -> Option<Vec<usize>> {
    let pick = vec![0usize; cands.len()];
    let used: u64 = cands.iter().map(|c| c.options[0].bytes).sum();
    if used > budget {
        return None;
    }
    let uniform = |pick: Vec<usize>| -> Vec<usize> {
        // The largest single (width, group) every matrix has that fits.
        let Some(first) = cands.first().map(|c| &c.options) else {
            return pick;
        };
        let mut best: Option<(u64, Vec<usize>)> = None;
        for c0 in first {
            let chosen: Option<Vec<usize>> = cands
                .iter()
                .map(|c| {
                    c.options
                        .iter()
                        .position(|o| o.bits == c0.bits && o.group == c0.group)
                })
                .collect();
            let Some(chosen) = chosen else { continue };
            let total: u64 = cands
                .iter()
                .zip(&chosen)
                .map(|(c, &k)| c.options[k].bytes)
                .sum();
            if total <= budget && best.as_ref().is_none_or(|(b, _)| total > *b) {
                best = Some((total, chosen));
            }
        }
        best.map_or(pick, |(_, p)| p)
    };
    Some(match how {
        Allocation::Uniform => uniform(pick),
        Allocation::Balanced => greedy(cands, uniform(pick), budget, Allocation::Output),
        Allocation::Output | Allocation::Relative => greedy(cands, pick, budget, how),
    })
}

/// From `pick`, raise one matrix one step at a time where the loss falls
/// most per added byte (over its output energy with `Relative`), while
/// the total stays within `budget`.
fn greedy(cands: &[Candidates], mut pick: Vec<usize>, budget: u64, how: Allocation) -> Vec<usize> {
    let mut used: u64 = cands
        .iter()
        .zip(&pick)
        .map(|(c, &k)| c.options[k].bytes)
        .sum();
    let norm = |c: &Candidates| {
        if how == Allocation::Relative && c.norm > 0.0 {
            c.norm
        } else {
            1.0
        }
    };
    let gain = |i: usize, k: usize| -> Option<f64> {
        let c = &cands[i];
        let (a, b) = (c.options.get(k)?, c.options.get(k + 1)?);
        let bytes = b.bytes.saturating_sub(a.bytes).max(1) as f64;
        Some((a.loss - b.loss) / norm(c) / bytes)
    };
    let mut heap: std::collections::BinaryHeap<(OrdF64, usize)> = (0..cands.len())
        .filter_map(|i| gain(i, pick[i]).map(|g| (OrdF64(g), i)))
        .collect();
    while let Some((OrdF64(g), i)) = heap.pop() {
        if g <= 0.0 {
            break;
        }
        let k = pick[i];
        let add = cands[i].options[k + 1].bytes - cands[i].options[k].bytes;
        if used + add > budget {
            continue;
        }
        used += add;
        pick[i] = k + 1;
        if let Some(g) = gain(i, k + 1) {
            heap.push((OrdF64(g), i));
        }
    }
    pick
}

/// The statistics a matrix needs: per-column mean squares (f32) and, with
/// GPTQ, the inverse Gram factor.
pub struct InputStats {
    pub diag: Vec<f32>,
    pub factor: Option<InverseFactor>,
}

impl InputStats {
    pub fn for_site(
        o: &CalibratedOptions,
        layer: u64,
        site: Site,
        d_in: u64,
    ) -> Result<InputStats> {
        let s = usize::try_from(layer)
            .ok()
            .and_then(|l| o.stats.site(l, site))
            .ok_or_else(|| {
                err(
                    ErrorKind::NotFound,
                    format!(
                        "the calibration statistics have no blk.{layer}.{} (made for another model?)",
                        site.name()
                    ),
                )
            })?;
        if s.d as u64 != d_in {
            return Err(err(
                ErrorKind::ShapeMismatch,
                format!(
                    "calibration input blk.{layer}.{} has {} channels, the matrix has {d_in} columns",
                    site.name(),
                    s.d
                ),
            ));
        }
        let diag = s.mean_sq.iter().map(|&v| v as f32).collect();
        let factor = match (&s.gram, o.gptq) {
            (Some(g), true) => Some(InverseFactor::new(g, s.d, GptqOptions { damp: o.damp })?),
            _ => None,
        };
        Ok(InputStats { diag, factor })
    }
}

/// Output energy ‖WX‖² / n under the diagonal of the input statistics.
pub fn output_energy(w: &[f32], cols: usize, diag: &[f32]) -> f64 {
    w.par_chunks(cols)
        .map(|row| {
            row.iter()
                .zip(diag)
                .map(|(&x, &h)| f64::from(h) * f64::from(x) * f64::from(x))
                .sum::<f64>()
        })
        .sum()
}

/// What the calibrated profile stores a vocabulary table
/// (`token_embd.weight`, `output.weight`) as: its own ggml blocks, or
/// requantized to ggml's Q6_K, Q5_1 or Q4_1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabType {
    Keep,
    Q6K,
    Q5_1,
    Q4_1,
}

impl VocabType {
    pub fn parse(s: &str) -> Option<VocabType> {
        match s {
            "keep" => Some(VocabType::Keep),
            "q6_k" => Some(VocabType::Q6K),
            "q5_1" => Some(VocabType::Q5_1),
            "q4_1" => Some(VocabType::Q4_1),
            _ => None,
        }
    }
    pub fn ggml(self) -> Option<GgmlType> {
        match self {
            VocabType::Keep => None,
            VocabType::Q6K => Some(GgmlType::Q6K),
            VocabType::Q5_1 => Some(GgmlType::Q5_1),
            VocabType::Q4_1 => Some(GgmlType::Q4_1),
        }
    }
}

/// Whether a tensor is a vocabulary table (what `--vocab-type` applies to):
/// [`crate::names::VOCAB_TENSORS`].
pub fn is_vocab_table(name: &str) -> bool {
    crate::names::is_vocab_tensor(name)
}

/// `w` (a multiple of 32 values, rows of whole 32-blocks) as ggml Q5_1 or
/// Q4_1 blocks: each block's f16 d and m from the affine quantizer's search
/// (plain squared error: a vocabulary table has no calibration input), its
/// codes packed as ggml lays them out (`qs[j]` holds elements j and j + 16
/// in its low and high nibble; Q5_1's `qh` bit i is element i's fifth bit).
pub fn requantize_ggml(w: &[f32], ty: GgmlType) -> Result<Vec<u8>> {
    if ty == GgmlType::Q6K {
        if !w.len().is_multiple_of(256) {
            return Err(err(
                ErrorKind::BadShape,
                format!("{} values are not whole Q6_K blocks of 256", w.len()),
            ));
        }
        // The simple Q6_K quantizer of `synth` (max-magnitude sub-block
        // scales), runs of blocks in parallel.
        let parts: Vec<Vec<u8>> = w
            .par_chunks(256 * 64)
            .map(|c| {
                let mut out = Vec::new();
                crate::synth::quantize_q6_k(c, &mut out);
                out
            })
            .collect();
        return Ok(parts.concat());
    }
    let bits = match ty {
        GgmlType::Q5_1 => 5,
        GgmlType::Q4_1 => 4,
        _ => {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!("requantizing to {ty} is not supported (q5_1, q4_1)"),
            ));
        }
    };
    if !w.len().is_multiple_of(32) {
        return Err(err(
            ErrorKind::BadShape,
            format!("{} values are not whole blocks of 32", w.len()),
        ));
    }
    let q = AffineQuantizer {
        bits,
        group: 32,
        weights: None,
    };
    let blocks: Vec<Vec<u8>> = w
        .par_chunks(32)
        .map(|x| {
            let p = q.fit(0, 0, x);
            let codes: Vec<u8> = x.iter().map(|&v| q.code(&p, v) as u8).collect();
            let mut b = Vec::with_capacity(24);
            b.extend_from_slice(&p.scale.to_le_bytes());
            b.extend_from_slice(&p.offset.to_le_bytes());
            if bits == 5 {
                let qh: u32 = codes
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| u32::from((c >> 4) & 1) << i)
                    .sum();
                b.extend_from_slice(&qh.to_le_bytes());
            }
            b.extend((0..16).map(|j| (codes[j] & 0x0f) | ((codes[j + 16] & 0x0f) << 4)));
            b
        })
        .collect();
    Ok(blocks.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requantized_blocks_decode_to_the_quantizer_values() {
        let w: Vec<f32> = (0..128)
            .map(|i| ((i * 7919) % 211) as f32 / 97.0 - 1.1)
            .collect();
        for (ty, bits) in [(GgmlType::Q5_1, 5u8), (GgmlType::Q4_1, 4)] {
            let bytes = requantize_ggml(&w, ty).unwrap();
            assert_eq!(Some(bytes.len() as u64), ty.bytes_for(128));
            let mut out = vec![0f32; 128];
            crate::quant::dequantize(ty, &bytes, &mut out).unwrap();
            let q = AffineQuantizer {
                bits,
                group: 32,
                weights: None,
            };
            for (x, y) in w.chunks(32).zip(out.chunks(32)) {
                let p = q.fit(0, 0, x);
                let want: Vec<f32> = x.iter().map(|&v| q.round(&p, v)).collect();
                assert_eq!(y, &want[..], "{ty}");
            }
        }
        assert!(requantize_ggml(&w[..40], GgmlType::Q5_1).is_err());
        assert!(requantize_ggml(&w, GgmlType::Q8_0).is_err());
    }

    #[test]
    fn q4_1_groups_are_stored_exactly() {
        // Values d·q + m as ggml's Q4_1 dequantizes them (q in 0..16).
        let d = f16::from_f32(0.0123);
        let m = f16::from_f32(-0.0871);
        let values: Vec<f32> = (0..32)
            .map(|i| ((i * 7 + 3) % 16) as f32 * d.to_f32() + m.to_f32())
            .collect();
        let q = AffineQuantizer {
            bits: 4,
            group: 32,
            weights: None,
        };
        let p = q.fit(0, 0, &values);
        for &v in &values {
            assert_eq!(q.round(&p, v), v);
        }
        // A group that does not use its grid's bottom code.
        let high: Vec<f32> = (0..32)
            .map(|i| (3 + i % 12) as f32 * d.to_f32() + m.to_f32())
            .collect();
        let p = q.fit(0, 0, &high);
        assert!(high.iter().all(|&v| q.round(&p, v) == v), "{p:?}");
    }

    #[test]
    fn weighted_fit_favours_heavy_columns() {
        let values: Vec<f32> = (0..32)
            .map(|i| ((i * 13) % 29) as f32 / 7.0 - 2.0)
            .collect();
        let weights: Vec<f32> = (0..32).map(|i| if i < 4 { 100.0 } else { 0.01 }).collect();
        let plain = AffineQuantizer {
            bits: 2,
            group: 32,
            weights: None,
        };
        let heavy = AffineQuantizer {
            bits: 2,
            group: 32,
            weights: Some(&weights),
        };
        let (pp, ph) = (plain.fit(0, 0, &values), heavy.fit(0, 0, &values));
        assert!(heavy.error(&ph, 0, &values) <= heavy.error(&pp, 0, &values));
    }

    #[test]
    fn allocation_spends_bytes_where_the_loss_falls_most() {
        let c = |name: &str, losses: [f64; 3]| Candidates {
            name: name.into(),
            options: (0..3)
                .map(|k| Choice {
                    bits: 2 + k as u8,
                    group: 32,
                    bytes: 100 + 50 * k as u64,
                    loss: losses[k],
                })
                .collect(),
            norm: 1.0,
        };
        let cands = [c("a", [10.0, 5.0, 0.0]), c("b", [100.0, 20.0, 10.0])];
        assert_eq!(allocate(&cands, 199, Allocation::Output), None);
        assert_eq!(allocate(&cands, 250, Allocation::Output), Some(vec![0, 1]));
        assert_eq!(allocate(&cands, 300, Allocation::Output), Some(vec![0, 2]));
        assert_eq!(allocate(&cands, 400, Allocation::Output), Some(vec![2, 2]));
        assert_eq!(allocate(&cands, 320, Allocation::Uniform), Some(vec![1, 1]));
        // Balanced: the uniform choice, then the bytes left where the loss
        // falls most.
        assert_eq!(
            allocate(&cands, 300, Allocation::Balanced),
            Some(vec![1, 1])
        );
        assert_eq!(
            allocate(&cands, 350, Allocation::Balanced),
            Some(vec![1, 2])
        );
        assert_eq!(stored_bytes(2, 70, 4, 32), 2 * (2 * 20 + (4 + 3)));
        // A bigger choice that loses as much is dropped.
        let ch = |bits, bytes, loss| Choice {
            bits,
            group: 32,
            bytes,
            loss,
        };
        let kept = pareto(vec![
            ch(5, 300, 0.0),
            ch(3, 100, 2.0),
            ch(4, 200, 0.0),
            ch(2, 150, 3.0),
        ]);
        assert_eq!(kept, vec![ch(3, 100, 2.0), ch(4, 200, 0.0)]);
    }
}
