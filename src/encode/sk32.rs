//! Dense -> SK32: a truncated SVD of every block matrix, quantized to the
//! seed's u8 layout.
//!
//! Within the SK32 layout (so readers written from the seed read our files),
//! three quantization variants were measured against plain max-abs
//! quantization of (U, σ, Vᵀ) (docs/QUALITY.md, examples/sk32_quant_explore):
//! - refit (default): after U and σ are quantized, Vᵀ is refit by least
//!   squares against W and then quantized, absorbing the rounding of U and
//!   σ: 38% less error added by quantization at rank 128 (with clipping);
//! - clipping (default): u_max / v_max by a search over clip levels
//!   minimizing each factor's squared error; alone it is slightly worse than
//!   max-abs, with refit it is better;
//! - balancing (off; `--balance`): U·diag(√σ), diag(√σ)·Vᵀ, σ = 1. Measured
//!   worse: it spreads the largest component's grid step onto the small
//!   ones (error of component k grows like √(σ_k σ_max) instead of σ_k).

use std::io::{Seek, Write};
use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::backend::Backend;
use crate::encode::linalg::{Mat, matmul, randomized_svd, symmetric_eigen};
use crate::encode::sk32_act::{
    InputWeighting, Sk32Calibration, check_coverage, site_for, unwhiten,
};
use crate::encode::{Progress, block_matrices, read_tensor};
use crate::error::{ErrorKind, Result, err};
use crate::format::sk32::{Sketch, write_sk32_with};
use crate::output::{AtomicOutput, OutputTarget};
use crate::probe::calibrate::SiteStats;

#[derive(Debug, Clone)]
pub struct Sk32Options {
    /// Fixed rank (clamped to each matrix's smaller dimension).
    pub rank: Option<usize>,
    /// Smallest rank that keeps this fraction of each matrix's energy.
    pub energy: Option<f64>,
    /// Glob on tensor names (block matrices only).
    pub tensors: Option<String>,
    pub oversample: usize,
    pub power_iters: usize,
    pub balance: bool,
    pub clip_search: bool,
    /// Refit Vᵀ by least squares against the quantized U and σ.
    pub refit: bool,
    pub seed: u64,
}

impl Default for Sk32Options {
    fn default() -> Self {
        Sk32Options {
            rank: Some(64),
            energy: None,
            tensors: None,
            oversample: 10,
            power_iters: 4,
            balance: false,
            clip_search: true,
            refit: true,
            seed: 0x5eed_5c32,
        }
    }
}

/// Quantize one factor with an 8-bit symmetric grid around 128: returns
/// (codes, max). With `clip`, the max is the clip level (searched over
/// fractions of the max-abs) that minimizes the squared error.
pub fn quantize_factor(x: &[f32], clip: bool) -> (Vec<u8>, f32) {
    quantize_factor_weighted(x, clip, None)
}

/// [`quantize_factor`] whose clip search minimises the squared error
/// weighted per column: `x` is row-major with `col_weights.len()` columns
/// (an activation-weighted Vᵀ: rounding on a quiet input channel costs
/// little output error).
pub fn quantize_factor_weighted(
    x: &[f32],
    clip: bool,
    col_weights: Option<&[f64]>,
) -> (Vec<u8>, f32) {
    let maxabs = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if maxabs == 0.0 || !maxabs.is_finite() {
        return (vec![128; x.len()], 0.0);
    }
    let code = |v: f32, m: f32| ((v / m * 127.0).round() + 128.0).clamp(1.0, 255.0) as u8;
    let err = |m: f32| -> f64 {
        let sq = |v: f32| {
            let q = crate::format::sk32::dequant_uv(code(v, m), m);
            f64::from(v - q).powi(2)
        };
        match col_weights.filter(|c| !c.is_empty()) {
            Some(c) => x
                .chunks(c.len())
                .map(|row| row.iter().zip(c).map(|(&v, w)| w * sq(v)).sum::<f64>())
                .sum(),
            None => x.iter().map(|&v| sq(v)).sum(),
        }
    };
    let mut best = maxabs;
    if clip {
        let mut best_err = err(maxabs);
        for i in 1..=40 {
            let m = maxabs * (1.0 - i as f32 * 0.0175); // down to 0.3 x max-abs
            let e = err(m);
            if e < best_err {
                best_err = e;
                best = m;
            }
        }
    }
    (x.iter().map(|&v| code(v, best)).collect(), best)
}

/// Result of sketching one matrix.
pub struct SketchResult {
    pub sketch: Sketch,
    /// Σσ² of the kept components over ‖W‖², before quantization (with an
    /// input weighting: of the whitened W·R, i.e. the share of the mean
    /// output energy E‖Wx‖² the truncation keeps).
    pub energy_kept: f64,
}

/// Sketch a `[d_out, d_in]` row-major matrix.
pub fn sketch_matrix(
    name: &str,
    w: &[f32],
    d_out: usize,
    d_in: usize,
    o: &Sk32Options,
) -> Result<SketchResult> {
    sketch_matrix_weighted(name, w, d_out, d_in, o, None)
}

/// Sketch a `[d_out, d_in]` row-major matrix; with `weighting`, the sketch
/// that minimises the output error under those input statistics (see
/// [`crate::encode::sk32_act`]) rather than the weight error.
pub fn sketch_matrix_weighted(
    name: &str,
    w: &[f32],
    d_out: usize,
    d_in: usize,
    o: &Sk32Options,
    weighting: Option<&InputWeighting>,
) -> Result<SketchResult> {
    if let Some(wt) = weighting
        && wt.channel_energy.len() != d_in
    {
        return Err(err(
            ErrorKind::ShapeMismatch,
            format!(
                "input statistics of {} channels for a matrix of {d_in} inputs",
                wt.channel_energy.len()
            ),
        ));
    }
    let a = Mat::from_f32(d_out, d_in, w);
    // The matrix whose truncated SVD is wanted: W, or W whitened by the
    // input statistics.
    let whitened = weighting.map(|wt| wt.whiten(&a));
    let target = whitened.as_ref().unwrap_or(&a);
    let total = target.frobenius2();
    let max_rank = d_out.min(d_in);
    let (mut svd, rank) = match (o.energy, o.rank) {
        (Some(e), _) => {
            if !(0.0..=1.0).contains(&e) {
                return Err(err(
                    ErrorKind::BadValue,
                    format!("energy {e} must be in [0, 1]"),
                ));
            }
            // Grow the sketch until it captures the energy (or is full).
            let mut k = 32.min(max_rank);
            loop {
                let svd = randomized_svd(target, k, o.oversample, o.power_iters, o.seed);
                let mut acc = 0.0;
                let r = svd.sigma.iter().position(|s| {
                    acc += s * s;
                    acc >= e * total
                });
                match r {
                    Some(r) => break (svd, r + 1),
                    None if k >= max_rank => break (svd, max_rank),
                    None => k = (k * 2).min(max_rank),
                }
            }
        }
        (None, Some(r)) => {
            let r = r.clamp(1, max_rank);
            (
                randomized_svd(target, r, o.oversample, o.power_iters, o.seed),
                r,
            )
        }
        (None, None) => return Err(err(ErrorKind::BadValue, "need a rank or an energy")),
    };
    svd.truncate(rank);
    let r = svd.rank();
    let energy_kept = if total > 0.0 {
        svd.sigma.iter().map(|s| s * s).sum::<f64>() / total
    } else {
        1.0
    };
    if weighting.is_some() {
        svd = unwhiten(&svd, &a);
    }
    let (mut u, mut vt): (Vec<f32>, Vec<f32>) = (
        svd.u.data.iter().map(|&x| x as f32).collect(),
        svd.vt.data.iter().map(|&x| x as f32).collect(),
    );
    let mut sigma: Vec<f32> = svd.sigma.iter().map(|&s| s as f32).collect();
    if o.balance {
        for (j, s) in sigma.iter_mut().enumerate() {
            let root = s.max(0.0).sqrt();
            for i in 0..d_out {
                u[i * r + j] *= root;
            }
            for x in &mut vt[j * d_in..(j + 1) * d_in] {
                *x *= root;
            }
            *s = 1.0;
        }
    }
    let (u_q8, u_max) = quantize_factor(&u, o.clip_search);
    let sigma_max = sigma.iter().fold(0f32, |m, v| m.max(v.abs()));
    let sigma_q8: Vec<u8> = sigma
        .iter()
        .map(|&s| {
            if sigma_max > 0.0 {
                (s.max(0.0) / sigma_max * 255.0).round().clamp(0.0, 255.0) as u8
            } else {
                0
            }
        })
        .collect();
    if o.refit {
        // Vᵀ = argmin ‖W − Ũ·diag(σ̃)·Vᵀ‖ for the *quantized* Ũ and σ̃: the
        // least-squares fit absorbs their rounding (and part of the
        // truncation) before Vᵀ itself is quantized. With an input
        // weighting the same unweighted fit is the weighted optimum too
        // (sk32_act's module documentation), so it is not changed.
        let mut bq = Mat::zeros(d_out, r);
        for i in 0..d_out {
            for k in 0..r {
                bq.data[i * r + k] =
                    f64::from(crate::format::sk32::dequant_uv(u_q8[i * r + k], u_max))
                        * f64::from(crate::format::sk32::dequant_sigma(sigma_q8[k], sigma_max));
            }
        }
        if let Some(fit) = least_squares_right(&bq, &a) {
            vt = fit.data.iter().map(|&x| x as f32).collect();
        }
    }
    let (v_q8, v_max) = quantize_factor_weighted(
        &vt,
        o.clip_search,
        weighting.map(|wt| wt.channel_energy.as_slice()),
    );
    Ok(SketchResult {
        sketch: Sketch {
            name: name.to_string(),
            d_out: d_out as u64,
            d_in: d_in as u64,
            rank: r as u64,
            u_max,
            sigma_max,
            v_max,
            u_q8,
            sigma_q8,
            v_q8,
        },
        energy_kept,
    })
}

/// `X = argmin ‖A − B·X‖_F` (B is m×r, A is m×n): the normal equations
/// `(BᵀB) X = BᵀA`, solved through the eigen-decomposition of the small
/// r×r Gram matrix. None when B is (numerically) rank deficient.
fn least_squares_right(b: &Mat, a: &Mat) -> Option<Mat> {
    let g = matmul(b, true, b, false);
    let (vals, vecs) = symmetric_eigen(&g);
    let top = vals.first().copied().unwrap_or(0.0);
    if top <= 0.0 || vals.iter().any(|&l| l <= top * 1e-12) {
        return None;
    }
    let r = g.rows;
    // G⁻¹ = V diag(1/λ) Vᵀ
    let mut vs = vecs.clone();
    for row in vs.data.chunks_mut(r) {
        for (x, l) in row.iter_mut().zip(&vals) {
            *x /= l;
        }
    }
    let ginv = matmul(&vs, false, &vecs, true);
    let bta = matmul(b, true, a, false);
    Some(matmul(&ginv, false, &bta, false))
}

/// Per-tensor outcome of an SK32 encoding.
#[derive(Debug, Clone)]
pub struct Sk32Entry {
    pub name: String,
    pub rank: u64,
    pub energy_kept: f64,
}

/// Encode every block matrix of `dense` into an SK32 file at `out`.
pub fn encode_sk32(
    dense: &dyn Backend,
    out: &OutputTarget,
    o: &Sk32Options,
    progress: &Progress,
) -> Result<Vec<Sk32Entry>> {
    encode_sk32_calibrated(dense, out, o, None, progress)
}

/// [`encode_sk32`], with `calibration` each matrix's sketch weighted by
/// the statistics of the input that feeds it (`Site::feeds`). A STATS
/// that lacks a needed site or layer, or whose width disagrees with a
/// matrix, is refused before any work, naming the tensor.
pub fn encode_sk32_calibrated(
    dense: &dyn Backend,
    out: &OutputTarget,
    o: &Sk32Options,
    calibration: Option<Sk32Calibration<'_>>,
    progress: &Progress,
) -> Result<Vec<Sk32Entry>> {
    let targets = block_matrices(dense, o.tensors.as_deref());
    if targets.is_empty() {
        return Err(
            err(ErrorKind::NotFound, "no block matrices to encode").path(&dense.summary().path)
        );
    }
    if let Some(cal) = calibration {
        check_coverage(cal, dense, o.tensors.as_deref())?;
    }
    progress.start(targets.len() as u64);
    // Create the output first: an existing target fails before any work.
    let mut output = AtomicOutput::create(out)?;
    // The header lists every sketch's scales, known only once it is made:
    // the factors go to a scratch file as they are made (a few matrices at
    // a time), and only their heads stay in memory.
    let scratch = output.scratch_file()?;
    let mut factors = std::io::BufWriter::with_capacity(1 << 20, scratch);
    let io = |e: std::io::Error| err(ErrorKind::Io, format!("scratch file: {e}"));
    let mut heads = Vec::with_capacity(targets.len());
    let mut entries = Vec::with_capacity(targets.len());
    let batch = rayon::current_num_threads().max(1) * 2;
    for chunk in targets.chunks(batch) {
        // The chunk's input weightings, one per site (the matrices a site
        // feeds are usually neighbours): a Gram whitening's Cholesky
        // factor costs as much as a sketch.
        let weightings: Vec<(&SiteStats, InputWeighting)> = match calibration {
            None => Vec::new(),
            Some(cal) => {
                let mut sites: Vec<(&SiteStats, &str)> = Vec::new();
                for (_, t) in chunk {
                    let s = site_for(cal.stats, &t.name.dot, t.shape[1] as usize)?;
                    if !sites.iter().any(|(x, _)| std::ptr::eq(*x, s)) {
                        sites.push((s, &t.name.dot));
                    }
                }
                sites
                    .par_iter()
                    .map(|&(s, name)| {
                        progress.check()?;
                        let wt = InputWeighting::from_site(s, cal.whitening)
                            .map_err(|e| e.tensor(name))?;
                        Ok((s, wt))
                    })
                    .collect::<Result<_>>()?
            }
        };
        let results: Vec<Result<SketchResult>> = chunk
            .par_iter()
            .map(|&(i, t)| {
                progress.check()?;
                let weighting = match calibration {
                    None => None,
                    Some(cal) => {
                        let s = site_for(cal.stats, &t.name.dot, t.shape[1] as usize)?;
                        weightings
                            .iter()
                            .find(|(p, _)| std::ptr::eq(*p, s))
                            .map(|(_, wt)| wt)
                    }
                };
                let w = read_tensor(dense, i)?;
                let r = sketch_matrix_weighted(
                    &t.name.dot,
                    &w,
                    t.shape[0] as usize,
                    t.shape[1] as usize,
                    o,
                    weighting,
                )
                .map_err(|e| e.tensor(&t.name.dot))?;
                progress.tick(&t.name.dot);
                Ok(r)
            })
            .collect();
        for r in results {
            let r = r?;
            let s = &r.sketch;
            factors.write_all(&s.u_q8).map_err(io)?;
            factors.write_all(&s.sigma_q8).map_err(io)?;
            factors.write_all(&s.v_q8).map_err(io)?;
            heads.push(s.head());
            entries.push(Sk32Entry {
                name: s.name.clone(),
                rank: s.rank,
                energy_kept: r.energy_kept,
            });
        }
    }
    progress.check()?;
    let mut topology = match (o.energy, o.rank) {
        (Some(e), _) => format!("energy-{e}-svd-sketch"),
        (None, Some(r)) => format!("rank-{r}-svd-sketch"),
        _ => "svd-sketch".into(),
    };
    if let Some(cal) = calibration {
        topology.push_str(&format!("-whitened-{}", cal.whitening.name()));
    }
    let mut scratch = factors.into_inner().map_err(|e| io(e.into_error()))?;
    write_sk32_with(&mut output, &topology, &heads, |w| {
        scratch.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        std::io::copy(&mut scratch, w).map_err(io)?;
        Ok(())
    })?;
    let n = output.commit()?;
    progress.bytes_written.store(n, Ordering::Relaxed);
    progress.finish();
    Ok(entries)
}
