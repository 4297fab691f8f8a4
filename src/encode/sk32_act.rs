//! Activation-weighted SK32 sketches (issue 12): truncate the SVD of W
//! where it matters for the matrix's *output*, not its weights.
//!
//! A matrix W (`d_out × d_in`) sees inputs x with second moments
//! G = E[x xᵀ] (a STATS file's `blk.L.SITE.gram`; its diagonal is
//! `mean_sq`). The output error of a sketch Ŵ is
//! E‖(W − Ŵ)x‖² = ‖(W − Ŵ)·R‖²_F for any R with R Rᵀ = G. The best rank-r
//! Ŵ under that norm (Eckart–Young on W·R) is Ŵ = U Uᵀ W, where U holds
//! the r leading left singular vectors of the *whitened* matrix W·R:
//! "whiten, truncate, unwhiten". Two whitenings:
//! - [`Whitening::Diagonal`]: R = diag(√(mean_sq + λ)), the input
//!   channels taken as uncorrelated (only `mean_sq` needed, 0.8 MB STATS);
//! - [`Whitening::Gram`]: R = the lower Cholesky factor of G + λI (needs a
//!   STATS made with `--gram`).
//!
//! λ is 1% of the mean diagonal of G in both (GPTQ's damping): a channel
//! never seen in calibration keeps a little weight, the Cholesky factor
//! exists, and the diagonal variant is exactly the Gram variant with the
//! off-diagonal terms dropped.
//!
//! Unwhitening needs no R⁻¹: with U fixed, Vᵀ = Uᵀ W (up to the σ
//! split) is the least-squares right factor, and that least-squares fit is
//! the same under *any* input weighting (the residual W − U Uᵀ W is
//! orthogonal to U column by column, whatever R mixes columns afterwards).
//! So the encoder's refit of Vᵀ against the quantized U and σ (plain least
//! squares against W) already minimises the activation-weighted error; it
//! is kept as is. What does change is the rounding of Vᵀ: its one scale
//! (`v_max`) is chosen by a clip search weighted by each input channel's
//! energy (the diagonal of G + λI), since rounding error on a quiet
//! channel costs little output error.

use crate::backend::Backend;
use crate::encode::linalg::{Mat, Svd, matmul};
use crate::encode::{block_matrices, tensor_kind, tensor_layer};
use crate::error::{ErrorKind, Result, err};
use crate::probe::calibrate::{CalibrationStats, Site, SiteStats};

/// Added to the second-moment matrix's diagonal, as a fraction of its
/// mean diagonal (GPTQ's 1%).
pub const DAMP: f64 = 0.01;

/// How the input statistics weight a sketch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Whitening {
    /// Per-input-channel mean squares (channels uncorrelated).
    Diagonal,
    /// The full input Gram matrix (STATS made with `--gram`).
    Gram,
}

impl Whitening {
    pub fn name(self) -> &'static str {
        match self {
            Whitening::Diagonal => "diagonal",
            Whitening::Gram => "gram",
        }
    }
}

/// An SK32 encoding's calibration: the STATS and how to use them.
#[derive(Debug, Clone, Copy)]
pub struct Sk32Calibration<'a> {
    pub stats: &'a CalibrationStats,
    pub whitening: Whitening,
}

/// The input weighting of one matrix (shared by the matrices one site
/// feeds).
#[derive(Debug, Clone)]
pub struct InputWeighting {
    /// Per input channel, the damped second moment G_jj + λ: the weights of
    /// the clip search of Vᵀ, and (square-rooted) the diagonal whitening.
    pub channel_energy: Vec<f64>,
    /// Lower Cholesky factor of G + λI, `d_in × d_in` (Gram whitening).
    pub gram_root: Option<Mat>,
}

/// λ for a matrix whose diagonal is `diag`: DAMP × its mean, or None when
/// the input never carried energy (no weighting can be derived).
fn damping(diag: impl Iterator<Item = f64>, d: usize) -> Option<f64> {
    let mean = diag.map(|v| v.max(0.0)).sum::<f64>() / d.max(1) as f64;
    (mean > 0.0 && mean.is_finite()).then_some(DAMP * mean)
}

impl InputWeighting {
    /// Diagonal whitening from per-channel mean squares. An all-zero input
    /// gives uniform weights (the plain sketch).
    pub fn diagonal(mean_sq: &[f64]) -> Result<InputWeighting> {
        if let Some(j) = mean_sq.iter().position(|v| !v.is_finite() || *v < 0.0) {
            return Err(err(
                ErrorKind::NonFinite,
                format!(
                    "mean_sq of channel {j} is {}: not a finite non-negative number",
                    mean_sq[j]
                ),
            ));
        }
        let channel_energy = match damping(mean_sq.iter().copied(), mean_sq.len()) {
            Some(lambda) => mean_sq.iter().map(|v| v + lambda).collect(),
            None => vec![1.0; mean_sq.len()],
        };
        Ok(InputWeighting {
            channel_energy,
            gram_root: None,
        })
    }

    /// Gram whitening from `gram` (`d × d`, row-major, symmetric).
    pub fn gram(gram: &[f32], d: usize) -> Result<InputWeighting> {
        if gram.len() != d * d {
            return Err(err(
                ErrorKind::ShapeMismatch,
                format!("Gram matrix of {} values for {d} channels", gram.len()),
            ));
        }
        if let Some(i) = gram.iter().position(|v| !v.is_finite()) {
            return Err(err(
                ErrorKind::NonFinite,
                format!("Gram matrix entry ({}, {}) is not finite", i / d, i % d),
            ));
        }
        let Some(lambda) = damping((0..d).map(|j| f64::from(gram[j * d + j])), d) else {
            return InputWeighting::diagonal(&vec![0.0; d]);
        };
        // Symmetrized: the file's f32 rounding must not make G asymmetric.
        let mut g = Mat::zeros(d, d);
        for i in 0..d {
            for j in 0..d {
                g.data[i * d + j] = 0.5 * (f64::from(gram[i * d + j]) + f64::from(gram[j * d + i]));
            }
            g.data[i * d + i] = g.data[i * d + i].max(0.0) + lambda;
        }
        let channel_energy = (0..d).map(|j| g.data[j * d + j]).collect();
        let root = cholesky_lower(&g)?;
        Ok(InputWeighting {
            channel_energy,
            gram_root: Some(root),
        })
    }

    /// The weighting of one site's statistics.
    pub fn from_site(s: &SiteStats, whitening: Whitening) -> Result<InputWeighting> {
        match whitening {
            Whitening::Diagonal => InputWeighting::diagonal(&s.mean_sq),
            Whitening::Gram => match &s.gram {
                Some(g) => InputWeighting::gram(g, s.d),
                None => Err(err(
                    ErrorKind::NotFound,
                    "no Gram matrix (make the STATS with `rknot calibrate --gram`, or whiten diagonally)",
                )),
            },
        }
    }

    /// `a · R`: the matrix whose truncated SVD is the weighted optimum.
    pub fn whiten(&self, a: &Mat) -> Mat {
        match &self.gram_root {
            Some(l) => matmul(a, false, l, false),
            None => {
                let scale: Vec<f64> = self.channel_energy.iter().map(|e| e.sqrt()).collect();
                let mut w = a.clone();
                for row in w.data.chunks_mut(a.cols) {
                    for (x, s) in row.iter_mut().zip(&scale) {
                        *x *= s;
                    }
                }
                w
            }
        }
    }
}

/// The statistics site feeding block matrix `name` (`blk.L.KIND.weight`),
/// checked against the matrix's input width: the error names the tensor
/// and what is missing.
pub fn site_for<'a>(stats: &'a CalibrationStats, name: &str, d_in: usize) -> Result<&'a SiteStats> {
    let layer = tensor_layer(name)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| err(ErrorKind::BadName, "not a block tensor (blk.L.KIND)").tensor(name))?;
    let kind = format!("{}.weight", tensor_kind(name));
    let site = Site::ALL
        .into_iter()
        .find(|s| s.feeds().contains(&kind.as_str()))
        .ok_or_else(|| {
            err(
                ErrorKind::NotFound,
                format!("no calibration site feeds a {kind} matrix"),
            )
            .tensor(name)
        })?;
    let s = stats.site(layer, site).ok_or_else(|| {
        err(
            ErrorKind::NotFound,
            format!(
                "the calibration STATS has no blk.{layer}.{} (it covers {} layers)",
                site.name(),
                stats.layers.len()
            ),
        )
        .tensor(name)
    })?;
    if s.d != d_in || s.mean_sq.len() != d_in {
        return Err(err(
            ErrorKind::ShapeMismatch,
            format!(
                "the calibration STATS's blk.{layer}.{} has {} channels, the matrix {d_in} inputs \
                 (STATS of another model?)",
                site.name(),
                s.d
            ),
        )
        .tensor(name));
    }
    Ok(s)
}

/// Check, before any work, that `cal` covers every block matrix of
/// `dense` (those matching `glob`) that an SK32 encoding sketches.
pub fn check_coverage(
    cal: Sk32Calibration<'_>,
    dense: &dyn Backend,
    glob: Option<&str>,
) -> Result<()> {
    for (_, t) in block_matrices(dense, glob) {
        let name = t.name.dot.as_str();
        let d_in = t.shape.get(1).map_or(0, |&d| d as usize);
        let s = site_for(cal.stats, name, d_in)?;
        if cal.whitening == Whitening::Gram && s.gram.is_none() {
            let layer = tensor_layer(name).unwrap_or_default();
            return Err(err(
                ErrorKind::NotFound,
                format!(
                    "the calibration STATS has no Gram matrix for blk.{layer}.{} (make it with \
                     `rknot calibrate --gram`, or use --whiten diagonal)",
                    s.site.name()
                ),
            )
            .tensor(name));
        }
    }
    Ok(())
}

/// Unwhiten a truncated SVD of `a·R`: keep its left factor U and refit
/// the rest against `a` itself, Vᵀ = Uᵀ a, split as σ_k = ‖(Uᵀa)_k‖ with
/// unit rows (the plain sketch's shape, so one `v_max` suits every row),
/// ordered by σ descending.
pub fn unwhiten(whitened: &Svd, a: &Mat) -> Svd {
    let p = matmul(&whitened.u, true, a, false); // r × d_in
    let (r, n, m) = (p.rows, p.cols, whitened.u.rows);
    let norms: Vec<f64> = p
        .data
        .chunks(n.max(1))
        .map(|row| row.iter().map(|x| x * x).sum::<f64>().sqrt())
        .collect();
    let mut order: Vec<usize> = (0..r).collect();
    order.sort_by(|&i, &j| norms[j].total_cmp(&norms[i]));
    let mut u = Mat::zeros(m, r);
    let mut vt = Mat::zeros(r, n);
    let mut sigma = Vec::with_capacity(r);
    for (k, &src) in order.iter().enumerate() {
        for i in 0..m {
            u.data[i * r + k] = whitened.u.data[i * r + src];
        }
        let s = norms[src];
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (o, x) in vt.data[k * n..(k + 1) * n]
            .iter_mut()
            .zip(&p.data[src * n..(src + 1) * n])
        {
            *o = x * inv;
        }
        sigma.push(s);
    }
    Svd { u, sigma, vt }
}

/// Lower Cholesky factor L of the symmetric positive definite `a`:
/// a = L Lᵀ (`encode::gptq`'s factorisation, on a [`Mat`]).
pub fn cholesky_lower(a: &Mat) -> Result<Mat> {
    let n = a.rows;
    Ok(Mat {
        rows: n,
        cols: n,
        data: crate::encode::gptq::cholesky_lower(&a.data, n)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::sk32::{Sk32Options, sketch_matrix, sketch_matrix_weighted};
    use crate::synth::Rng;

    fn decoded(s: &crate::format::sk32::Sketch) -> Vec<f64> {
        use crate::format::sk32::{dequant_sigma, dequant_uv};
        let (m, n, r) = (s.d_out as usize, s.d_in as usize, s.rank as usize);
        let mut w = vec![0f64; m * n];
        for i in 0..m {
            for k in 0..r {
                let c = f64::from(dequant_uv(s.u_q8[i * r + k], s.u_max))
                    * f64::from(dequant_sigma(s.sigma_q8[k], s.sigma_max));
                for j in 0..n {
                    w[i * n + j] += c * f64::from(dequant_uv(s.v_q8[k * n + j], s.v_max));
                }
            }
        }
        w
    }

    /// tr(E G Eᵀ) for E = W − Ŵ: the mean squared output error.
    fn output_error(w: &[f32], w_hat: &[f64], n: usize, gram: &[f64]) -> f64 {
        let mut total = 0.0;
        for (row, row_hat) in w.chunks(n).zip(w_hat.chunks(n)) {
            let e: Vec<f64> = row
                .iter()
                .zip(row_hat)
                .map(|(&a, b)| f64::from(a) - b)
                .collect();
            for i in 0..n {
                let gi = &gram[i * n..(i + 1) * n];
                total += e[i] * gi.iter().zip(&e).map(|(g, x)| g * x).sum::<f64>();
            }
        }
        total
    }

    fn random_matrix(m: usize, n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng(seed);
        (0..m * n).map(|_| rng.normal()).collect()
    }

    /// With input channel energies spread over six orders of magnitude,
    /// the diagonally weighted sketch's output error
    /// Σ_j mean_sq_j Σ_i (W − Ŵ)_ij² is well below the plain sketch's at
    /// the same rank, quantization included.
    #[test]
    fn diagonal_weighting_lowers_the_output_error() {
        let (m, n, rank) = (48, 64, 8);
        let w = random_matrix(m, n, 7);
        let mean_sq: Vec<f64> = (0..n)
            .map(|j| 10f64.powf(-3.0 + 6.0 * j as f64 / n as f64))
            .collect();
        let o = Sk32Options {
            rank: Some(rank),
            ..Default::default()
        };
        let plain = sketch_matrix("t", &w, m, n, &o).unwrap().sketch;
        let weighting = InputWeighting::diagonal(&mean_sq).unwrap();
        let weighted = sketch_matrix_weighted("t", &w, m, n, &o, Some(&weighting))
            .unwrap()
            .sketch;
        assert_eq!(weighted.rank, plain.rank);
        let diag_err = |s: &crate::format::sk32::Sketch| -> f64 {
            let w_hat = decoded(s);
            (0..m * n)
                .map(|k| mean_sq[k % n] * (f64::from(w[k]) - w_hat[k]).powi(2))
                .sum()
        };
        let (e_plain, e_weighted) = (diag_err(&plain), diag_err(&weighted));
        eprintln!("output error: plain {e_plain:.4e}, weighted {e_weighted:.4e}");
        assert!(
            e_weighted < 0.5 * e_plain,
            "weighted {e_weighted} vs plain {e_plain}"
        );
    }

    /// With strongly correlated inputs (a low-rank-plus-noise Gram matrix),
    /// Gram whitening beats the diagonal one, which beats the plain sketch,
    /// in the true output error tr(E G Eᵀ).
    #[test]
    fn gram_weighting_lowers_the_output_error_further() {
        let (m, n, rank) = (40, 48, 6);
        let w = random_matrix(m, n, 11);
        // X = Z·B + noise: inputs driven by 4 latent factors.
        let (t, latent) = (400, 4);
        let mut rng = Rng(3);
        let b: Vec<f64> = (0..latent * n)
            .map(|_| f64::from(rng.normal()) * 3.0)
            .collect();
        let mut gram = vec![0f64; n * n];
        for _ in 0..t {
            let z: Vec<f64> = (0..latent).map(|_| f64::from(rng.normal())).collect();
            let x: Vec<f64> = (0..n)
                .map(|j| {
                    (0..latent).map(|k| z[k] * b[k * n + j]).sum::<f64>()
                        + 0.05 * f64::from(rng.normal())
                })
                .collect();
            for i in 0..n {
                for j in 0..n {
                    gram[i * n + j] += x[i] * x[j] / t as f64;
                }
            }
        }
        let gram32: Vec<f32> = gram.iter().map(|&g| g as f32).collect();
        let mean_sq: Vec<f64> = (0..n).map(|j| gram[j * n + j]).collect();
        let o = Sk32Options {
            rank: Some(rank),
            ..Default::default()
        };
        let plain = sketch_matrix("t", &w, m, n, &o).unwrap().sketch;
        let diag = InputWeighting::diagonal(&mean_sq).unwrap();
        let full = InputWeighting::gram(&gram32, n).unwrap();
        let by_diag = sketch_matrix_weighted("t", &w, m, n, &o, Some(&diag))
            .unwrap()
            .sketch;
        let by_gram = sketch_matrix_weighted("t", &w, m, n, &o, Some(&full))
            .unwrap()
            .sketch;
        let [e_plain, e_diag, e_gram] =
            [&plain, &by_diag, &by_gram].map(|s| output_error(&w, &decoded(s), n, &gram));
        eprintln!("output error: plain {e_plain:.4e}, diagonal {e_diag:.4e}, gram {e_gram:.4e}");
        assert!(e_gram < 0.5 * e_diag, "gram {e_gram} vs diagonal {e_diag}");
        assert!(e_gram < 0.5 * e_plain, "gram {e_gram} vs plain {e_plain}");
    }

    #[test]
    fn cholesky_reconstructs_and_refuses_indefinite() {
        let a = Mat {
            rows: 3,
            cols: 3,
            data: vec![4.0, 2.0, 0.4, 2.0, 5.0, 1.0, 0.4, 1.0, 3.0],
        };
        let l = cholesky_lower(&a).unwrap();
        let back = matmul(&l, false, &l, true);
        for (x, y) in back.data.iter().zip(&a.data) {
            assert!((x - y).abs() < 1e-12);
        }
        let bad = Mat {
            rows: 2,
            cols: 2,
            data: vec![1.0, 2.0, 2.0, 1.0],
        };
        assert!(cholesky_lower(&bad).is_err());
    }

    #[test]
    fn bad_statistics_are_errors() {
        assert!(InputWeighting::diagonal(&[1.0, f64::NAN]).is_err());
        assert!(InputWeighting::diagonal(&[1.0, -1.0]).is_err());
        assert!(InputWeighting::gram(&[1.0, 0.0, 0.0], 2).is_err());
        assert!(InputWeighting::gram(&[1.0, f32::INFINITY, 0.0, 1.0], 2).is_err());
        // No energy at all: uniform weights, no error.
        let w = InputWeighting::diagonal(&[0.0, 0.0]).unwrap();
        assert_eq!(w.channel_energy, [1.0, 1.0]);
    }
}
