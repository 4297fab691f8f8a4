//! Dense -> .rknot.
//!
//! Per layer, a spectral manifest: every hidden dimension gets an energy
//! (see [`ManifestEnergy`]); the standing dimensions are the top
//! `coverage` fraction by energy; `amplitudes` are their energies over the
//! largest, and `phase_alignment = sqrt(amplitude)` (the RMS-magnitude
//! ratio, in (0, 1]).
//!
//! Two profiles:
//! - `seed` (the seed notes' default): off-standing dimensions are dropped
//!   (restricted axes decode to 0.0); Q/K at `bits_qk`, V and the attention
//!   output at `bits_v`, FFN at `bits_ffn`; `--graded` widens each standing
//!   line by `round(extra_bits × phase_alignment)` (seed 001 Module 2).
//! - `faithful`: nothing is dropped; every line (hidden dimension) gets its
//!   own width, chosen by measured sensitivity: standing dimensions start at
//!   `min_bits + 2`, the rest at `min_bits` (with coverage 1.0 all start
//!   equal), then the next bit goes to the line whose squared error it
//!   reduces most, per stored bit, until the tensor reaches `target_bpw`
//!   (block overhead included). Each block is one segment of one line (one
//!   width, one scale), and each block's scale is searched (clipping)
//!   rather than max-abs.

use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::backend::Backend;
use crate::encode::calibrated::{self, CalibratedOptions};
use crate::encode::order::OrdF64;
use crate::encode::{Progress, block_matrices, read_tensor, tensor_kind, tensor_layer};
use crate::error::{ErrorKind, Result, err};
use crate::format::meta::{MetaValue, Metadata};
use crate::format::rknot::{
    ArchMeta, Axis, Coding, MAX_TILE_ELEMS, Manifest, RknotWriter, TensorSpec, Tile, pack_block,
};
use crate::output::{AtomicOutput, OutputTarget};
use crate::probe::calibrate::Site;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Seed,
    Faithful,
    /// Affine blocks chosen with activation statistics
    /// ([`crate::encode::calibrated`]); set by `calibrated` options.
    Calibrated,
    /// Every float matrix stored exactly ([`crate::encode::lossless`]).
    Lossless,
}

impl Profile {
    /// No "default" spelling: `rknot encode rknot`'s default is the
    /// calibrated profile while a ctl job's is faithful, so the word would
    /// mean two things.
    pub fn parse(s: &str) -> Option<Profile> {
        match s {
            "seed" => Some(Profile::Seed),
            "faithful" => Some(Profile::Faithful),
            "calibrated" => Some(Profile::Calibrated),
            "lossless" => Some(Profile::Lossless),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Profile::Seed => "seed",
            Profile::Faithful => "faithful",
            Profile::Calibrated => "calibrated",
            Profile::Lossless => "lossless",
        }
    }
}

/// How a hidden dimension's energy is measured for the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManifestEnergy {
    /// Column energy of Q, K, V, gate, up plus row energy of down.
    Inputs,
    /// As `Inputs`, plus row energy of the attention output.
    InputsAndOutputs,
    /// As `InputsAndOutputs`, each matrix's contribution divided by its
    /// total energy (every matrix counts equally).
    Normalized,
}

#[derive(Debug, Clone)]
pub struct RknotOptions {
    pub profile: Profile,
    pub coverage: f64,
    pub bits_qk: u8,
    pub bits_v: u8,
    pub bits_ffn: u8,
    pub graded: bool,
    pub extra_bits: u8,
    pub energy: ManifestEnergy,
    /// Values per block (along the line) in the faithful profile and in
    /// graded seed blocks; uniform seed blocks cover whole compact rows.
    pub block: u64,
    /// Faithful profile: bits per weight each tensor aims at (codes + block
    /// overhead).
    pub target_bpw: f64,
    pub min_bits: u8,
    pub max_bits: u8,
    /// Faithful profile: lines along the hidden axis (true) or the other axis.
    pub hidden_lines: bool,
    pub clip_search: bool,
    pub tensors: Option<String>,
    /// Store only the compressed matrices (the file then needs a dense
    /// fallback to serve a whole model). Otherwise every other tensor of
    /// the input is stored too, as its ggml blocks verbatim.
    pub compressed_only: bool,
    /// The calibrated profile's options (with `profile` Calibrated).
    pub calibrated: Option<crate::encode::calibrated::CalibratedOptions>,
}

impl Default for RknotOptions {
    fn default() -> Self {
        RknotOptions {
            // The profile that keeps the model answering like the dense
            // one (docs/QUALITY.md); the seed profile must be asked for.
            profile: Profile::Faithful,
            coverage: 0.30,
            bits_qk: 4,
            bits_v: 8,
            bits_ffn: 4,
            graded: false,
            extra_bits: 0,
            energy: ManifestEnergy::Inputs,
            block: 256,
            target_bpw: 5.0,
            min_bits: 2,
            max_bits: 8,
            hidden_lines: true,
            clip_search: true,
            tensors: None,
            compressed_only: false,
            calibrated: None,
        }
    }
}

/// Whether a matrix's hidden (residual stream) axis is its columns (it reads
/// the residual stream: Q, K, V, gate, up) or its rows (it writes it:
/// attention output, down).
fn hidden_axis(kind: &str) -> Option<Axis> {
    match kind {
        "attn_q" | "attn_k" | "attn_v" | "ffn_gate" | "ffn_up" => Some(Axis::Cols),
        "attn_output" | "ffn_down" => Some(Axis::Rows),
        _ => None,
    }
}

/// Quantize `x` (one block, one width `w` >= 1) to codes; returns
/// (scale, codes, squared error). With `clip`, the scale is the best of a
/// search over clip levels below and above max-abs.
pub fn quantize_block(x: &[f32], w: u8, clip: bool) -> (f32, Vec<u32>, f64) {
    let half = (1i64 << (w - 1)) as f32;
    let (lo, hi) = (-half, half - 1.0);
    let maxabs = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if maxabs == 0.0 {
        return (0.0, vec![half as u32; x.len()], 0.0);
    }
    // Round to nearest by adding and subtracting 1.5·2^23 (exact for
    // |v| < 2^22, ties to even): plain adds, so the loop vectorizes.
    const MAGIC: f32 = 12_582_912.0;
    let level = |v: f32, inv: f32| ((v * inv).clamp(lo, hi) + MAGIC) - MAGIC;
    let eval = |s: f32| -> f64 {
        let inv = 1.0 / s;
        let e: f32 = x.iter().map(|&v| (v - level(v, inv) * s).powi(2)).sum();
        f64::from(e)
    };
    // The grid reaches hi·s upwards and -half·s downwards: start from the
    // scale that fits the max magnitude on the shorter side.
    let base = maxabs / hi.max(1.0);
    let mut best = (base, eval(base));
    if clip {
        // Coarse search over clip levels, then a finer one around the best.
        let try_at = |f: f32, best: &mut (f32, f64)| {
            let s = base * f;
            let e = eval(s);
            if e < best.1 {
                *best = (s, e);
            }
        };
        for i in 0..8 {
            try_at(0.45 + 0.1 * i as f32, &mut best);
        }
        let center = best.0 / base;
        for i in -3..=3 {
            try_at(center + 0.025 * i as f32, &mut best);
        }
    }
    let s = best.0;
    let inv = 1.0 / s;
    let codes = x.iter().map(|&v| (level(v, inv) + half) as u32).collect();
    (s, codes, best.1)
}

/// Squared error of quantizing `line` in blocks of `block` at width `w`
/// (w = 0: the line is dropped).
fn line_error(line: &[f32], block: usize, w: u8, clip: bool) -> f64 {
    if w == 0 {
        return line.iter().map(|&v| f64::from(v).powi(2)).sum();
    }
    line.chunks(block)
        .map(|b| quantize_block(b, w, clip).2)
        .sum()
}

/// Greedy width allocation: every line starts at its floor (`floors[l]`,
/// at least `min`), then bits go one at a time to the line with the largest
/// error reduction per stored bit while the code bits stay within
/// `budget_bits` in total. Returns widths per line.
fn allocate_widths(
    lines: &[Vec<f32>],
    block: usize,
    min: u8,
    max: u8,
    floors: &[u8],
    budget_bits: f64,
    clip: bool,
) -> Vec<u8> {
    let n_lines = lines.len();
    // err[l][w - min] for w in min..=max
    let errs: Vec<Vec<f64>> = lines
        .par_iter()
        .map(|l| (min..=max).map(|w| line_error(l, block, w, clip)).collect())
        .collect();
    let mut widths: Vec<u8> = (0..n_lines)
        .map(|l| floors.get(l).copied().unwrap_or(min).clamp(min, max))
        .collect();
    let mut used: f64 = widths
        .iter()
        .zip(lines)
        .map(|(&w, l)| f64::from(w) * l.len() as f64)
        .sum();
    let gain = |l: usize, w: u8| -> f64 {
        let i = usize::from(w - min);
        (errs[l][i] - errs[l][i + 1]) / lines[l].len().max(1) as f64
    };
    // Max-heap of (gain per bit, line) for the next bit of each line.
    let mut heap: std::collections::BinaryHeap<(OrdF64, usize)> = (0..n_lines)
        .filter(|&l| widths[l] < max)
        .map(|l| (OrdF64(gain(l, widths[l])), l))
        .collect();
    while let Some((_, l)) = heap.pop() {
        let cost = lines[l].len() as f64;
        if used + cost > budget_bits {
            continue;
        }
        widths[l] += 1;
        used += cost;
        if widths[l] < max {
            heap.push((OrdF64(gain(l, widths[l])), l));
        }
    }
    widths
}

/// Add the per-hidden-dimension energies of some of a layer's matrices
/// to `e` (one entry per hidden dimension). Called once per matrix in the
/// layer's order, it sums exactly as one call over the whole layer.
fn add_layer_energy(
    e: &mut [f64],
    mats: &[(&str, &[f32], u64, u64)],
    hidden: u64,
    how: ManifestEnergy,
) {
    for &(kind, w, d_out, d_in) in mats {
        let axis = match hidden_axis(kind) {
            Some(a) => a,
            None => continue,
        };
        if how == ManifestEnergy::Inputs && kind == "attn_output" {
            continue;
        }
        let total: f64 = w.iter().map(|&v| f64::from(v).powi(2)).sum();
        let norm = if how == ManifestEnergy::Normalized && total > 0.0 {
            total
        } else {
            1.0
        };
        match axis {
            Axis::Cols if d_in == hidden => {
                for r in 0..d_out as usize {
                    for (c, &v) in w[r * d_in as usize..(r + 1) * d_in as usize]
                        .iter()
                        .enumerate()
                    {
                        e[c] += f64::from(v).powi(2) / norm;
                    }
                }
            }
            Axis::Rows if d_out == hidden => {
                for (r, row) in w.chunks(d_in as usize).enumerate() {
                    e[r] += row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / norm;
                }
            }
            _ => {}
        }
    }
}

/// The manifest from per-dimension energies.
pub fn build_manifest(energy: &[f64], coverage: f64) -> Manifest {
    let d = energy.len();
    let k = ((coverage * d as f64).round() as usize).clamp(1, d);
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| energy[b].total_cmp(&energy[a]).then(a.cmp(&b)));
    let mut standing: Vec<u64> = order[..k].iter().map(|&i| i as u64).collect();
    standing.sort_unstable();
    let emax = standing
        .iter()
        .map(|&i| energy[i as usize])
        .fold(0f64, f64::max);
    let amplitudes: Vec<f32> = standing
        .iter()
        .map(|&i| {
            if emax > 0.0 {
                (energy[i as usize] / emax) as f32
            } else {
                0.0
            }
        })
        .collect();
    let phase_alignment = amplitudes
        .iter()
        .map(|a| a.max(0.0).sqrt().min(1.0))
        .collect();
    Manifest {
        d: d as u64,
        standing_indices: standing,
        amplitudes,
        phase_alignment,
    }
}

/// Encode one matrix; returns its spec and block payloads.
fn encode_matrix(
    name: &str,
    w: &[f32],
    d_out: u64,
    d_in: u64,
    manifest: &Manifest,
    o: &RknotOptions,
) -> Result<(TensorSpec, Vec<Vec<u8>>)> {
    let kind = tensor_kind(name);
    let axis = hidden_axis(kind).ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            format!("no rknot encoding for tensor kind {kind}"),
        )
    })?;
    let hidden_len = match axis {
        Axis::Rows => d_out,
        Axis::Cols => d_in,
    };
    if hidden_len != manifest.d {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "hidden axis has length {hidden_len}, the layer's hidden size is {}",
                manifest.d
            ),
        ));
    }
    let block = o.block.clamp(1, MAX_TILE_ELEMS);
    match o.profile {
        Profile::Seed => {
            let bits = match kind {
                "attn_q" | "attn_k" => o.bits_qk,
                "attn_v" | "attn_output" => o.bits_v,
                _ => o.bits_ffn,
            }
            .clamp(1, 16);
            let (restrict_rows, restrict_cols) = (axis == Axis::Rows, axis == Axis::Cols);
            let (cr, cc) = (
                if restrict_rows { manifest.k() } else { d_out },
                if restrict_cols { manifest.k() } else { d_in },
            );
            let (coding, block_rows, block_cols) = if o.graded && o.extra_bits > 0 {
                let widths: Vec<u8> = manifest
                    .phase_alignment
                    .iter()
                    .map(|p| {
                        (f32::from(bits) + (f32::from(o.extra_bits) * p).round()).clamp(1.0, 16.0)
                            as u8
                    })
                    .collect();
                let max_bits = widths.iter().copied().max().unwrap_or(bits);
                // Each block is a segment of one line: one width, one scale.
                let (br, bc) = match axis {
                    Axis::Rows => (1, block.min(cc)),
                    Axis::Cols => (block.min(cr), 1),
                };
                (
                    Coding::Graded {
                        max_bits,
                        line_axis: axis,
                        line_bits: widths,
                    },
                    br,
                    bc,
                )
            } else {
                // Whole compact rows (bounded by the tile limit).
                let bc = cc.min(MAX_TILE_ELEMS);
                (Coding::Uniform { bits }, 1, bc)
            };
            let spec = TensorSpec {
                name: name.to_string(),
                d_out,
                d_in,
                restrict_rows,
                restrict_cols,
                coding,
                block_rows,
                block_cols,
            };
            let blocks = encode_blocks(&spec, manifest, w, o.clip_search);
            Ok((spec, blocks))
        }
        Profile::Calibrated => Err(err(
            ErrorKind::BadValue,
            "the calibrated profile needs calibration statistics (--calibrate)",
        )),
        Profile::Lossless => Err(err(
            ErrorKind::BadValue,
            "the lossless profile encodes whole files (encode::lossless)",
        )),
        Profile::Faithful => {
            let line_axis = if o.hidden_lines {
                axis
            } else {
                match axis {
                    Axis::Rows => Axis::Cols,
                    Axis::Cols => Axis::Rows,
                }
            };
            let lines: Vec<Vec<f32>> = match line_axis {
                Axis::Rows => w.chunks(d_in as usize).map(<[f32]>::to_vec).collect(),
                Axis::Cols => (0..d_in as usize)
                    .map(|c| {
                        (0..d_out as usize)
                            .map(|r| w[r * d_in as usize + c])
                            .collect()
                    })
                    .collect(),
            };
            let line_len = lines.first().map_or(0, Vec::len) as u64;
            let block = block.min(line_len.max(1));
            let min = o.min_bits.clamp(1, 16);
            let max = o.max_bits.clamp(min, 16);
            // Standing hidden dimensions (when lines are hidden dimensions)
            // start two bits wider than the rest.
            let floors: Vec<u8> = (0..lines.len() as u64)
                .map(|l| {
                    let standing = line_axis == axis
                        && manifest.position(l).is_some()
                        && manifest.k() < manifest.d;
                    if standing { (min + 2).min(max) } else { min }
                })
                .collect();
            // Bits left for codes: the target minus each block's 4-byte
            // scale and 1-byte width.
            let n_blocks = lines.len() as f64 * line_len.div_ceil(block) as f64;
            let total = (d_out * d_in) as f64;
            let budget = o.target_bpw * total - 40.0 * n_blocks;
            let widths = allocate_widths(
                &lines,
                block as usize,
                min,
                max,
                &floors,
                budget,
                o.clip_search,
            );
            // The lines were only for choosing widths; free their copy of
            // the matrix before the blocks make another.
            drop(lines);
            let max_bits = widths.iter().copied().max().unwrap_or(o.min_bits).max(1);
            let (block_rows, block_cols) = match line_axis {
                Axis::Rows => (1, block),
                Axis::Cols => (block, 1),
            };
            let spec = TensorSpec {
                name: name.to_string(),
                d_out,
                d_in,
                restrict_rows: false,
                restrict_cols: false,
                coding: Coding::Graded {
                    max_bits,
                    line_axis,
                    line_bits: widths,
                },
                block_rows,
                block_cols,
            };
            let blocks = encode_blocks(&spec, manifest, w, o.clip_search);
            Ok((spec, blocks))
        }
    }
}

/// Quantize and pack every block of a spec. Blocks whose values all share
/// one width get a searched scale; mixed-width blocks (uniform rows) too,
/// as uniform blocks have a single width.
fn encode_blocks(spec: &TensorSpec, m: &Manifest, dense: &[f32], clip: bool) -> Vec<Vec<u8>> {
    let grid = spec.grid(m);
    let compact = spec.compact(m, dense);
    (0..grid.n_blocks())
        .into_par_iter()
        .map(|b| {
            let tile = grid.tile(b);
            let vals = tile_values(&compact, grid.compact_cols, &tile);
            let w = block_width(&spec.coding, &tile);
            if w == 0 {
                return pack_block(&spec.coding, &tile, 0.0, &vec![0; vals.len()]);
            }
            let (scale, codes, _) = quantize_block(&vals, w, clip);
            pack_block(&spec.coding, &tile, scale, &codes)
        })
        .collect()
}

fn tile_values(compact: &[f32], cols: u64, t: &Tile) -> Vec<f32> {
    let mut v = Vec::with_capacity((t.rows * t.cols) as usize);
    for r in t.row0..t.row0 + t.rows {
        let s = (r * cols + t.col0) as usize;
        v.extend_from_slice(&compact[s..s + t.cols as usize]);
    }
    v
}

/// The single width of a block (blocks never span lines of different widths
/// in this encoder).
fn block_width(c: &Coding, t: &Tile) -> u8 {
    match c {
        Coding::Uniform { bits } | Coding::Affine { bits } => *bits,
        Coding::Lossless { .. } => c.bits(),
        Coding::Graded {
            line_axis: Axis::Rows,
            line_bits,
            ..
        } => line_bits[t.row0 as usize],
        Coding::Graded {
            line_axis: Axis::Cols,
            line_bits,
            ..
        } => line_bits[t.col0 as usize],
    }
}

/// Per-tensor outcome.
#[derive(Debug, Clone)]
pub struct RknotEntry {
    pub name: String,
    pub stored_bytes: u64,
    pub n_elements: u64,
}

/// Encode the attention and FFN matrices of every layer of `dense`.
pub fn encode_rknot(
    dense: &dyn Backend,
    out: &OutputTarget,
    o: &RknotOptions,
    progress: &Progress,
) -> Result<Vec<RknotEntry>> {
    if o.profile == Profile::Lossless {
        let lo = crate::encode::lossless::LosslessOptions {
            tensors: o.tensors.clone(),
            compressed_only: o.compressed_only,
        };
        let done = crate::encode::lossless::encode_lossless(dense, out, &lo, progress)?;
        return Ok(done
            .into_iter()
            .map(|(name, stored_bytes, n_elements)| RknotEntry {
                name,
                stored_bytes,
                n_elements,
            })
            .collect());
    }
    if !(0.0..=1.0).contains(&o.coverage) || o.coverage == 0.0 {
        return Err(err(
            ErrorKind::BadValue,
            format!("coverage {} must be in (0, 1]", o.coverage),
        ));
    }
    let md = crate::report::effective_metadata(dense).clone();
    let arch = md.architecture().unwrap_or("llama").to_string();
    let hidden = md.arch_u64("embedding_length").ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            format!("metadata lacks {arch}.embedding_length"),
        )
    })?;
    let num_layers = md.arch_u64("block_count").unwrap_or(0);
    let targets: Vec<_> = block_matrices(dense, o.tensors.as_deref())
        .into_iter()
        .filter(|(_, t)| hidden_axis(tensor_kind(&t.name.dot)).is_some())
        .collect();
    if targets.is_empty() {
        return Err(
            err(ErrorKind::NotFound, "no attention/FFN matrices to encode")
                .path(&dense.summary().path),
        );
    }
    let mut layers: std::collections::BTreeMap<u64, Vec<(usize, &crate::backend::TensorInfo)>> =
        Default::default();
    for (i, t) in targets {
        let l = tensor_layer(&t.name.dot)
            .ok_or_else(|| err(ErrorKind::BadName, "no layer index").tensor(&t.name.dot))?;
        layers.entry(l).or_default().push((i, t));
    }
    let num_layers = num_layers.max(layers.keys().max().map_or(0, |l| l + 1));
    let total: usize = layers.values().map(Vec::len).sum();
    // Every other tensor of the model goes in as ggml blocks, verbatim, so
    // the file serves the whole model alone.
    let encoded: std::collections::HashSet<&str> = layers
        .values()
        .flatten()
        .map(|(_, t)| t.name.dot.as_str())
        .collect();
    let kept: Vec<(usize, &crate::backend::TensorInfo)> = if o.compressed_only {
        Vec::new()
    } else {
        dense
            .tensors()
            .entries()
            .iter()
            .enumerate()
            .filter(|(_, t)| !encoded.contains(t.name.dot.as_str()))
            .filter(|(_, t)| matches!(t.stored, crate::backend::StoredType::Ggml(_)))
            .collect()
    };
    let stored = dense.as_dense().filter(|_| !kept.is_empty());
    if !kept.is_empty() && stored.is_none() {
        return Err(err(
            ErrorKind::BadValue,
            "the tensors left uncompressed are copied as ggml blocks, which needs a GGUF or \
             dense .knot input (or --compressed-only)",
        )
        .path(&dense.summary().path));
    }
    let mut metadata: Metadata = md.clone();
    metadata.push("rknot.profile", MetaValue::String(o.profile.name().into()));
    metadata.push("rknot.coverage", MetaValue::F32(o.coverage as f32));
    // The calibrated profile's first pass: every matrix at every width,
    // then one width per matrix for the whole-file target.
    let widths = match (&o.calibrated, o.profile) {
        (Some(c), Profile::Calibrated) => {
            c.check()?;
            progress.start((2 * total + kept.len()) as u64);
            let params: u64 = layers
                .values()
                .flatten()
                .map(|(_, t)| t.n_elements)
                .sum::<u64>()
                + kept.iter().map(|(_, t)| t.n_elements).sum::<u64>();
            let kept_bytes: u64 = kept
                .iter()
                .map(|(_, t)| match requantized_type(o, t) {
                    Some(ty) => ty.bytes_for(t.n_elements).unwrap_or(u64::MAX / 4),
                    None => t.stored_bytes,
                })
                .sum();
            calibrated_metadata(&mut metadata, c);
            let overhead = header_estimate(&metadata, hidden, &layers, kept.len());
            Some(plan_widths(
                dense,
                &layers,
                c,
                params,
                kept_bytes + overhead,
                progress,
            )?)
        }
        (_, Profile::Calibrated) => {
            return Err(err(
                ErrorKind::BadValue,
                "the calibrated profile needs calibration statistics (--calibrate)",
            ));
        }
        _ => {
            progress.start((total + kept.len()) as u64);
            None
        }
    };
    let mut output = AtomicOutput::create(out)?;
    // Streamed: each layer's blocks are written as soon as they are made.
    let mut writer = RknotWriter::new(&mut output)?;
    let mut entries = Vec::new();
    for (&index, mats) in &layers {
        progress.check()?;
        // Two passes, one matrix in memory at a time: the manifest needs
        // every matrix's energy before any is encoded, and holding the
        // whole layer would make peak memory a layer's fp32 size (3.4 GB
        // for a 70B layer) instead of its largest matrix's (0.9 GB). The
        // price is decoding the source twice.
        // With calibration statistics (any profile) the standing dimensions
        // are the ones the activations carry most energy in; the faithful
        // profile gives those lines two more bits to start from.
        let manifest = match &o.calibrated {
            Some(c) => build_manifest(&activation_energy(c, index, hidden)?, o.coverage),
            _ => {
                let mut energy = vec![0f64; hidden as usize];
                for &(i, t) in mats {
                    progress.check()?;
                    let w = read_tensor(dense, i).map_err(|e| e.tensor(&t.name.dot))?;
                    let kind = tensor_kind(&t.name.dot);
                    add_layer_energy(
                        &mut energy,
                        &[(kind, &w, t.shape[0], t.shape[1])],
                        hidden,
                        o.energy,
                    );
                }
                build_manifest(&energy, o.coverage)
            }
        };
        writer.begin_layer(index, manifest.clone());
        let mut site_stats = SiteCache::default();
        for &(i, t) in mats {
            progress.check()?;
            let w = read_tensor(dense, i).map_err(|e| e.tensor(&t.name.dot))?;
            let (spec, blocks) = match (&o.calibrated, &widths) {
                (Some(c), Some(widths)) => {
                    let (bits, group) = widths
                        .get(&t.name.dot)
                        .copied()
                        .unwrap_or((c.widths[0], c.groups[0]));
                    let stats = site_stats.get(c, index, &t.name.dot, t.shape[1])?;
                    let q = calibrated::quantize_matrix(
                        &w,
                        t.shape[1] as usize,
                        bits,
                        group as usize,
                        c.weighted_fit.then_some(&stats.diag[..]),
                        stats.factor.as_ref(),
                        &stats.diag,
                    )
                    .map_err(|e| e.tensor(&t.name.dot))?;
                    let spec = calibrated::spec(&t.name.dot, t.shape[0], t.shape[1], bits, group);
                    (spec, q.blocks)
                }
                _ => encode_matrix(&t.name.dot, &w, t.shape[0], t.shape[1], &manifest, o)
                    .map_err(|e| e.tensor(&t.name.dot))?,
            };
            drop(w);
            entries.push(RknotEntry {
                name: t.name.dot.clone(),
                stored_bytes: blocks.iter().map(|b| b.len() as u64).sum(),
                n_elements: t.n_elements,
            });
            writer.tensor(&spec, &blocks)?;
            progress.tick(&t.name.dot);
        }
    }
    if let Some(stored) = stored {
        for (i, t) in kept {
            progress.check()?;
            let crate::backend::StoredType::Ggml(ty) = t.stored else {
                continue;
            };
            if let Some(to) = requantized_type(o, t) {
                let w = read_tensor(dense, i).map_err(|e| e.tensor(&t.name.dot))?;
                let bytes =
                    calibrated::requantize_ggml(&w, to).map_err(|e| e.tensor(&t.name.dot))?;
                drop(w);
                writer
                    .dense_tensor(&t.name.dot, to, &t.shape, |off, buf| {
                        let at = off as usize;
                        buf.copy_from_slice(&bytes[at..at + buf.len()]);
                        Ok(())
                    })
                    .map_err(|e| e.tensor(&t.name.dot))?;
                progress.tick(&t.name.dot);
                continue;
            }
            writer
                .dense_tensor(&t.name.dot, ty, &t.shape, |off, buf| {
                    stored.read_stored(i, off, buf)
                })
                .map_err(|e| e.tensor(&t.name.dot))?;
            progress.tick(&t.name.dot);
        }
    }
    let arch_meta = ArchMeta {
        arch,
        hidden_dim: hidden,
        num_layers,
        metadata,
    };
    progress.check()?;
    writer.finish(&arch_meta)?;
    let n = output.commit()?;
    progress.bytes_written.store(n, Ordering::Relaxed);
    progress.finish();
    Ok(entries)
}

/// The type a kept tensor is requantized to (calibrated profile,
/// `--vocab-type`), if any.
fn requantized_type(
    o: &RknotOptions,
    t: &crate::backend::TensorInfo,
) -> Option<crate::quant::GgmlType> {
    let c = o
        .calibrated
        .as_ref()
        .filter(|_| o.profile == Profile::Calibrated)?;
    // Only ever smaller: a table already stored in fewer bytes is kept.
    c.vocab
        .ggml()
        .filter(|_| calibrated::is_vocab_table(&t.name.dot))
        .filter(|ty| {
            ty.bytes_for(t.n_elements)
                .is_some_and(|b| b < t.stored_bytes)
        })
}

/// The inputs of a layer's matrices, each site's statistics prepared once
/// (Q, K and V share one inverse Gram factor, gate and up another).
#[derive(Default)]
struct SiteCache {
    sites: std::collections::HashMap<Site, std::rc::Rc<calibrated::InputStats>>,
}

impl SiteCache {
    fn get(
        &mut self,
        c: &CalibratedOptions,
        layer: u64,
        name: &str,
        d_in: u64,
    ) -> Result<std::rc::Rc<calibrated::InputStats>> {
        let kind = tensor_kind(name);
        let site = Site::input_of(kind).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("no calibration input for tensor kind {kind}"),
            )
            .tensor(name)
        })?;
        if let Some(s) = self.sites.get(&site) {
            return Ok(s.clone());
        }
        let s = std::rc::Rc::new(
            calibrated::InputStats::for_site(c, layer, site, d_in).map_err(|e| e.tensor(name))?,
        );
        self.sites.insert(site, s.clone());
        Ok(s)
    }
}

/// Per hidden dimension, the mean square of the layer's two normed
/// inputs (what Q/K/V and gate/up see).
fn activation_energy(c: &CalibratedOptions, layer: u64, hidden: u64) -> Result<Vec<f64>> {
    let mut e = vec![0f64; hidden as usize];
    for site in [Site::AttnIn, Site::FfnIn] {
        let s = usize::try_from(layer)
            .ok()
            .and_then(|l| c.stats.site(l, site))
            .filter(|s| s.d as u64 == hidden)
            .ok_or_else(|| {
                err(
                    ErrorKind::NotFound,
                    format!(
                        "the calibration statistics have no blk.{layer}.{} of {hidden} channels",
                        site.name()
                    ),
                )
            })?;
        for (a, &b) in e.iter_mut().zip(&s.mean_sq) {
            *a += b;
        }
    }
    Ok(e)
}

fn calibrated_metadata(md: &mut Metadata, c: &CalibratedOptions) {
    md.push("rknot.target_bpw", MetaValue::F32(c.target_bpw as f32));
    md.push("rknot.gptq", MetaValue::Bool(c.gptq));
    md.push(
        "rknot.allocation",
        MetaValue::String(c.allocation.name().into()),
    );
    for key in ["text", "text_sha256", "tokens", "ctx"] {
        if let Some(v) = c.stats.meta.get(key) {
            md.push(
                format!("rknot.calibration.{key}"),
                MetaValue::String(v.clone()),
            );
        }
    }
}

/// Bytes a file will hold besides the compressed matrices' blocks and
/// the kept tensors' bytes: the header (metadata, manifests, tensor
/// entries), the footer, and the checksums (4 bytes per block group or
/// chunk of about 8 KiB, with margin).
fn header_estimate(
    md: &Metadata,
    hidden: u64,
    layers: &std::collections::BTreeMap<u64, Vec<(usize, &crate::backend::TensorInfo)>>,
    kept: usize,
) -> u64 {
    let metadata = serde_json::to_vec(&md.to_json()).map_or(0, |v| v.len() as u64);
    // A manifest lists up to `hidden` indices, amplitudes and alignments.
    let manifests = layers.len() as u64 * hidden * 30;
    let entries = (layers.values().map(Vec::len).sum::<usize>() + kept) as u64 * 400;
    let body: u64 = layers
        .values()
        .flatten()
        .map(|(_, t)| t.n_elements)
        .sum::<u64>();
    // Checksums: 4 bytes per ~8 KiB of blocks (at most 8 bits per weight).
    let sums = body / 2048 + 64;
    metadata + manifests + entries + sums + 4096
}

/// The calibrated profile's first pass: each matrix quantized at each
/// candidate width (nothing kept but sizes and output errors), then the
/// widths that fit `target_bpw × params` bits with `fixed_bytes` already
/// spent.
fn plan_widths(
    dense: &dyn Backend,
    layers: &std::collections::BTreeMap<u64, Vec<(usize, &crate::backend::TensorInfo)>>,
    c: &CalibratedOptions,
    params: u64,
    fixed_bytes: u64,
    progress: &Progress,
) -> Result<std::collections::HashMap<String, (u8, u64)>> {
    let mut cands = Vec::new();
    for (&index, mats) in layers {
        let mut site_stats = SiteCache::default();
        for &(i, t) in mats {
            progress.check()?;
            let name = &t.name.dot;
            let w = read_tensor(dense, i).map_err(|e| e.tensor(name))?;
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let stats = site_stats.get(c, index, name, cols)?;
            // Every (width, group), cheapest first; once one loses nothing,
            // bigger ones are not worth trying.
            let mut tries: Vec<(u8, u64, u64)> = c
                .widths
                .iter()
                .flat_map(|&b| c.groups.iter().map(move |&g| (b, g)))
                .map(|(b, g)| (b, g, calibrated::stored_bytes(rows, cols, b, g)))
                .collect();
            tries.sort_by_key(|&(b, g, bytes)| (bytes, b, g));
            let mut options: Vec<calibrated::Choice> = Vec::new();
            for (bits, group, bytes) in tries {
                if options.iter().any(|o| o.loss == 0.0) {
                    break;
                }
                let q = calibrated::quantize_matrix(
                    &w,
                    cols as usize,
                    bits,
                    group as usize,
                    c.weighted_fit.then_some(&stats.diag[..]),
                    stats.factor.as_ref(),
                    &stats.diag,
                )
                .map_err(|e| e.tensor(name))?;
                options.push(calibrated::Choice {
                    bits,
                    group,
                    bytes,
                    loss: q.loss,
                });
            }
            let options = calibrated::pareto(options);
            let norm = calibrated::output_energy(&w, cols as usize, &stats.diag);
            log::debug!("{name}: {options:?}, output energy {norm:.4e}");
            cands.push(calibrated::Candidates {
                name: name.clone(),
                options,
                norm,
            });
            progress.tick(name);
        }
    }
    let budget_bits = c.target_bpw * params as f64;
    let budget = (budget_bits / 8.0) as u64;
    let narrowest: u64 = cands.iter().map(|c| c.options[0].bytes).sum();
    let spare = budget.checked_sub(fixed_bytes).ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            format!(
                "--target-bpw {}: the tensors kept as ggml blocks and the header alone take {:.3}                  bits per weight",
                c.target_bpw,
                fixed_bytes as f64 * 8.0 / params as f64
            ),
        )
    })?;
    let pick = calibrated::allocate(&cands, spare, c.allocation).ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            format!(
                "--target-bpw {}: even the smallest codes ({} bits) everywhere make {:.3} bits \
                 per weight",
                c.target_bpw,
                c.widths[0],
                (fixed_bytes + narrowest) as f64 * 8.0 / params as f64
            ),
        )
    })?;
    Ok(cands
        .iter()
        .zip(pick)
        .map(|(c, k)| (c.name.clone(), (c.options[k].bits, c.options[k].group)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipped_scale_beats_max_abs_on_heavy_tails() {
        let mut x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        x[5] = 9.0; // one outlier
        let (_, _, e_max) = quantize_block(&x, 4, false);
        let (_, _, e_clip) = quantize_block(&x, 4, true);
        assert!(e_clip <= e_max);
    }

    #[test]
    fn greedy_widths_respect_the_budget_and_favor_big_lines() {
        let lines: Vec<Vec<f32>> = (0..8)
            .map(|l| {
                (0..64)
                    .map(|i| ((i * 31 + l * 7) % 23) as f32 * if l == 0 { 10.0 } else { 0.1 })
                    .collect()
            })
            .collect();
        let w = allocate_widths(&lines, 32, 2, 8, &[], 4.0 * 8.0 * 64.0, true);
        let avg = w.iter().map(|&b| f64::from(b)).sum::<f64>() / 8.0;
        assert!(avg <= 4.0 + 1e-9, "{w:?}");
        assert!(w[0] >= w[1], "{w:?}");
    }

    #[test]
    fn manifest_from_energy() {
        let m = build_manifest(&[1.0, 9.0, 4.0, 0.0], 0.5);
        assert_eq!(m.standing_indices, vec![1, 2]);
        assert_eq!(m.amplitudes, vec![1.0, 4.0 / 9.0]);
        assert!((m.phase_alignment[1] - 2.0 / 3.0).abs() < 1e-6);
    }
}
