//! Error-compensating rounding (GPTQ, Frantar et al. 2022) for any scalar
//! quantizer: minimise the output error ‖(W − Ŵ)X‖ over calibration inputs
//! X instead of the weight error ‖W − Ŵ‖.
//!
//! The columns of W (input channels) are quantized in order; each
//! column's rounding error is pushed onto the columns not yet quantized
//! through the inverse of the damped Gram matrix H = XᵀX / n, so later
//! columns absorb what earlier ones got wrong, as far as the inputs are
//! correlated. With the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU), after
//! column i of a row is rounded to q:
//!
//! ```text
//! e = (w_i − q) / U[i][i];   w_j −= e · U[i][j]  for every j > i
//! ```
//!
//! Each row's updates involve only that row, so rows run in parallel.
//! The quantizer chooses its parameters (a scale, an offset) per group of
//! columns of a row from the group's values *as compensated so far*, when
//! the group is reached, and rounds with them: the output is ordinary
//! codes and scales of that quantizer. The calibrated .rknot profile
//! (`encode::calibrated`) runs it with the affine block quantizer.

use rayon::prelude::*;

use crate::error::{ErrorKind, Result, err};

/// A scalar quantizer applied in groups of consecutive columns of a row
/// (e.g. a 32-weight block with one scale).
pub trait GroupQuantizer: Sync {
    /// What a group's values are rounded with (e.g. its scale).
    type Params: Send;

    /// Columns per group (at least 1; the last group of a row may be
    /// shorter).
    fn group_size(&self) -> usize;

    /// Parameters for the group of `row` starting at column `col0`, from
    /// its current values.
    fn fit(&self, row: usize, col0: usize, values: &[f32]) -> Self::Params;

    /// The representable value `value` rounds to (dequantized).
    fn round(&self, params: &Self::Params, value: f32) -> f32;
}

/// Options of [`gptq`].
#[derive(Debug, Clone, Copy)]
pub struct GptqOptions {
    /// Added to H's diagonal, as a fraction of its mean diagonal: keeps
    /// the Cholesky factorisation stable when inputs are nearly dependent
    /// (GPTQ's default 0.01).
    pub damp: f64,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions { damp: 0.01 }
    }
}

/// Dot product in four independent partial sums, so it vectorizes (a
/// plain `sum()` is one dependency chain in f64).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            acc[k] += x[k] * y[k];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// Lower Cholesky factor L of the symmetric positive definite `a`
/// (`n × n`, row-major): a = L Lᵀ. Row-oriented, every inner product over
/// two contiguous row prefixes.
pub(crate) fn cholesky_lower(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s = dot(&l[i * n..i * n + j], &l[j * n..j * n + j]);
            if i == j {
                let d = a[i * n + i] - s;
                if !(d > 0.0 && d.is_finite()) {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!(
                            "the Gram matrix is not positive definite (pivot {i} of {n} \
                             is {d:e}): more damping is needed"
                        ),
                    ));
                }
                l[i * n + i] = d.sqrt();
            } else {
                l[i * n + j] = (a[i * n + j] - s) / l[j * n + j];
            }
        }
    }
    Ok(l)
}

/// L⁻¹ of a lower triangular L, row by row: row i of L⁻¹ is (eᵢ − Σ_{k<i}
/// L[i][k] · row k of L⁻¹) / L[i][i], contiguous row updates.
fn lower_inverse(l: &[f64], n: usize) -> Vec<f64> {
    let mut x = vec![0f64; n * n];
    for i in 0..n {
        let (done, rest) = x.split_at_mut(i * n);
        let row = &mut rest[..n];
        for k in 0..i {
            let lik = l[i * n + k];
            if lik != 0.0 {
                for (v, &xk) in row[..=k].iter_mut().zip(&done[k * n..k * n + k + 1]) {
                    *v -= lik * xk;
                }
            }
        }
        row[i] += 1.0;
        let d = l[i * n + i];
        for v in row[..=i].iter_mut() {
            *v /= d;
        }
    }
    x
}

/// The upper Cholesky factor U (H⁻¹ = UᵀU) of the damped inverse Gram
/// matrix, `cols × cols` row-major: what [`gptq`] propagates errors with.
///
/// With P the order-reversing permutation and P H P = L Lᵀ, H⁻¹ = P L⁻ᵀ
/// L⁻¹ P = (P L⁻¹ P)ᵀ (P L⁻¹ P), and P L⁻¹ P is upper triangular: one
/// Cholesky factorisation and one triangular inverse, no explicit H⁻¹.
pub fn inverse_gram_factor(gram: &[f32], cols: usize, opts: GptqOptions) -> Result<Vec<f64>> {
    if gram.len() != cols * cols {
        return Err(err(
            ErrorKind::ShapeMismatch,
            format!("Gram matrix of {} values for {cols} columns", gram.len()),
        ));
    }
    if let Some(i) = gram.iter().position(|v| !v.is_finite()) {
        return Err(err(
            ErrorKind::NonFinite,
            format!("Gram matrix entry {i} is not finite"),
        ));
    }
    let n = cols;
    // H reversed in both axes.
    let mut h = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            h[(n - 1 - i) * n + (n - 1 - j)] = f64::from(gram[i * n + j]);
        }
    }
    // An input that is always zero: its weights never matter; a unit
    // diagonal keeps H invertible without coupling it to the others.
    for i in 0..n {
        if h[i * n + i] <= 0.0 {
            h[i * n + i] = 1.0;
        }
    }
    let mean_diag = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n.max(1) as f64;
    for i in 0..n {
        h[i * n + i] += opts.damp * mean_diag;
    }
    let l = cholesky_lower(&h, n)?;
    let li = lower_inverse(&l, n);
    let mut u = vec![0f64; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = li[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    Ok(u)
}

/// Quantize `w` (`rows × cols`, row-major) in place with error
/// compensation under the input Gram matrix `gram` (`cols × cols`, e.g. a
/// STATS file's `blk.L.SITE.gram`). On return `w` holds the dequantized
/// values Ŵ; the result is each group's parameters, row by row, groups in
/// column order.
pub fn gptq<Q: GroupQuantizer>(
    w: &mut [f32],
    rows: usize,
    cols: usize,
    gram: &[f32],
    quantizer: &Q,
    opts: GptqOptions,
) -> Result<Vec<Q::Params>> {
    if w.len() != rows * cols || cols == 0 {
        return Err(err(
            ErrorKind::ShapeMismatch,
            format!("{} weights for {rows} × {cols}", w.len()),
        ));
    }
    let u = InverseFactor::new(gram, cols, opts)?;
    Ok(gptq_with(w, &u, quantizer)?.0)
}

/// [`inverse_gram_factor`] in the form [`gptq_with`] uses: f32, so the
/// row updates run eight lanes wide, and the reciprocal diagonal.
pub struct InverseFactor {
    cols: usize,
    u: Vec<f32>,
    inv_diag: Vec<f64>,
}

impl InverseFactor {
    pub fn new(gram: &[f32], cols: usize, opts: GptqOptions) -> Result<InverseFactor> {
        let u = inverse_gram_factor(gram, cols, opts)?;
        let inv_diag = (0..cols).map(|i| 1.0 / u[i * cols + i]).collect();
        Ok(InverseFactor {
            cols,
            u: u.into_iter().map(|v| v as f32).collect(),
            inv_diag,
        })
    }
}

/// GPTQ with a factor computed once (matrices that share an input share
/// it). Returns the groups' parameters and the loss Σ ((w − q) / U[i][i])²
/// over every column of every row: the output error ‖(W − Ŵ)X‖² / n the
/// rounding adds under the damped Gram matrix (the optimal-brain-surgeon
/// identity GPTQ rests on), without another pass over H.
pub fn gptq_with<Q: GroupQuantizer>(
    w: &mut [f32],
    u: &InverseFactor,
    quantizer: &Q,
) -> Result<(Vec<Q::Params>, f64)> {
    let cols = u.cols;
    if cols == 0 || !w.len().is_multiple_of(cols) {
        return Err(err(
            ErrorKind::ShapeMismatch,
            format!("{} weights for rows of {cols}", w.len()),
        ));
    }
    Ok(compensate_rows(w, u, quantizer))
}

/// Round-to-nearest with the same quantizer and groups: the baseline.
pub fn round_to_nearest<Q: GroupQuantizer>(
    w: &mut [f32],
    cols: usize,
    quantizer: &Q,
) -> Vec<Q::Params> {
    let g = quantizer.group_size().max(1);
    w.par_chunks_mut(cols)
        .enumerate()
        .flat_map_iter(|(r, row)| {
            let mut params = Vec::with_capacity(cols.div_ceil(g));
            for (gi, group) in row.chunks_mut(g).enumerate() {
                let p = quantizer.fit(r, gi * g, group);
                for v in group.iter_mut() {
                    *v = quantizer.round(&p, *v);
                }
                params.push(p);
            }
            params
        })
        .collect()
}

fn compensate_rows<Q: GroupQuantizer>(
    w: &mut [f32],
    f: &InverseFactor,
    quantizer: &Q,
) -> (Vec<Q::Params>, f64) {
    let cols = f.cols;
    let g = quantizer.group_size().max(1);
    let per_row: Vec<(Vec<Q::Params>, f64)> = w
        .par_chunks_mut(cols)
        .enumerate()
        .map(|(r, row)| {
            // `row` holds the values as compensated so far, then the
            // rounded ones behind the current column.
            let mut params = Vec::with_capacity(cols.div_ceil(g));
            let mut loss = 0f64;
            for g0 in (0..cols).step_by(g) {
                let g1 = (g0 + g).min(cols);
                let p = quantizer.fit(r, g0, &row[g0..g1]);
                for i in g0..g1 {
                    let q = quantizer.round(&p, row[i]);
                    let e = f64::from(row[i] - q) * f.inv_diag[i];
                    loss += e * e;
                    row[i] = q;
                    let e = e as f32;
                    let ui = &f.u[i * cols + i + 1..(i + 1) * cols];
                    for (xj, &uij) in row[i + 1..].iter_mut().zip(ui) {
                        *xj -= e * uij;
                    }
                }
                params.push(p);
            }
            (params, loss)
        })
        .collect();
    let loss = per_row.iter().map(|(_, l)| l).sum();
    (per_row.into_iter().flat_map(|(p, _)| p).collect(), loss)
}

/// ‖(W − Ŵ)X‖² / n = Σ_rows δ H δᵀ with δ a row of W − Ŵ and H = XᵀX / n:
/// the output error the calibration inputs see.
pub fn output_error(w: &[f32], w_hat: &[f32], cols: usize, gram: &[f32]) -> f64 {
    w.chunks_exact(cols)
        .zip(w_hat.chunks_exact(cols))
        .map(|(a, b)| {
            let d: Vec<f64> = a
                .iter()
                .zip(b)
                .map(|(&x, &y)| f64::from(x) - f64::from(y))
                .collect();
            let mut s = 0.0;
            for (i, &di) in d.iter().enumerate() {
                let h = &gram[i * cols..(i + 1) * cols];
                s += di
                    * d.iter()
                        .zip(h)
                        .map(|(&dj, &hij)| dj * f64::from(hij))
                        .sum::<f64>();
            }
            s
        })
        .sum()
}

/// Synthetic inputs for the tests of error-compensating rounding (here and
/// in tests/calibrated.rs): a seeded generator and the Gram matrix of
/// correlated, unevenly scaled input channels.
#[doc(hidden)]
pub mod synthetic {
    /// A small deterministic generator (xorshift), normal-ish by summing.
    pub struct Rng(pub u64);
    impl Rng {
        pub fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
        pub fn normal(&mut self) -> f64 {
            (0..12).map(|_| self.uniform()).sum::<f64>() - 6.0
        }
    }

    /// Inputs like activations: a few factors shared by every channel
    /// (correlation), each channel's own noise, uneven channel scales
    /// (0.3 .. 3).
    pub fn gram(cols: usize, n: usize, rng: &mut Rng) -> Vec<f32> {
        const FACTORS: usize = 4;
        let load: Vec<f64> = (0..FACTORS * cols).map(|_| rng.normal()).collect();
        let scale: Vec<f64> = (0..cols)
            .map(|c| 10f64.powf(c as f64 / cols as f64 - 0.5))
            .collect();
        let mut h = vec![0f64; cols * cols];
        for _ in 0..n {
            let f: Vec<f64> = (0..FACTORS).map(|_| rng.normal()).collect();
            let x: Vec<f64> = (0..cols)
                .map(|c| {
                    let shared: f64 = (0..FACTORS).map(|k| f[k] * load[k * cols + c]).sum();
                    scale[c] * (shared + 0.3 * rng.normal())
                })
                .collect();
            for i in 0..cols {
                for j in 0..cols {
                    h[i * cols + j] += x[i] * x[j] / n as f64;
                }
            }
        }
        h.into_iter().map(|v| v as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::synthetic::{Rng, gram};
    use super::*;

    /// Symmetric 4-bit: one scale per group, codes -8..=7.
    struct Sym4 {
        group: usize,
    }

    impl GroupQuantizer for Sym4 {
        type Params = f32;
        fn group_size(&self) -> usize {
            self.group
        }
        fn fit(&self, _row: usize, _col0: usize, values: &[f32]) -> f32 {
            let m = values.iter().fold(0f32, |a, v| a.max(v.abs()));
            if m > 0.0 { m / 7.0 } else { 1.0 }
        }
        fn round(&self, scale: &f32, value: f32) -> f32 {
            (value / scale).round().clamp(-8.0, 7.0) * scale
        }
    }

    #[test]
    fn inverse_factor_is_the_cholesky_factor_of_the_inverse() {
        let mut rng = Rng(7);
        let cols = 12;
        let h = gram(cols, 64, &mut rng);
        let u = inverse_gram_factor(&h, cols, GptqOptions { damp: 0.0 }).unwrap();
        // (UᵀU) H = I.
        for i in 0..cols {
            for j in 0..cols {
                let mut s = 0.0;
                for k in 0..cols {
                    let inv_ik: f64 = (0..cols).map(|m| u[m * cols + i] * u[m * cols + k]).sum();
                    s += inv_ik * f64::from(h[k * cols + j]);
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((s - want).abs() < 1e-6, "({i},{j}): {s}");
            }
        }
    }

    #[test]
    fn gptq_beats_round_to_nearest_on_the_output_error() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (rows, cols) = (24, 96);
        let h = gram(cols, 400, &mut rng);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() as f32).collect();
        let q = Sym4 { group: 32 };
        let mut rtn = w.clone();
        let rtn_params = round_to_nearest(&mut rtn, cols, &q);
        let mut comp = w.clone();
        let params = gptq(&mut comp, rows, cols, &h, &q, GptqOptions::default()).unwrap();
        assert_eq!(params.len(), rows * cols / 32);
        assert_eq!(rtn_params.len(), params.len());
        // Ordinary codes: every value is an integer multiple of its
        // group's scale in -8..=7.
        for (r, row) in comp.chunks_exact(cols).enumerate() {
            for (gi, group) in row.chunks(32).enumerate() {
                let s = params[r * (cols / 32) + gi];
                for &v in group {
                    let code = v / s;
                    assert!(
                        (code - code.round()).abs() < 1e-4 && (-8.0..=7.0).contains(&code.round()),
                        "row {r} group {gi}: {v} / {s} = {code}"
                    );
                }
            }
        }
        let (e_rtn, e_gptq) = (
            output_error(&w, &rtn, cols, &h),
            output_error(&w, &comp, cols, &h),
        );
        eprintln!("output error: GPTQ {e_gptq:.4}, round-to-nearest {e_rtn:.4}");
        assert!(
            e_gptq < 0.5 * e_rtn,
            "output error: GPTQ {e_gptq:.4} vs round-to-nearest {e_rtn:.4}"
        );
    }

    #[test]
    fn uncorrelated_inputs_give_round_to_nearest() {
        // H diagonal: nothing to push errors onto, so GPTQ is RTN exactly.
        let cols = 40;
        let mut h = vec![0f32; cols * cols];
        for i in 0..cols {
            h[i * cols + i] = 1.0 + i as f32;
        }
        let mut rng = Rng(3);
        let w: Vec<f32> = (0..3 * cols).map(|_| rng.normal() as f32).collect();
        let q = Sym4 { group: 8 };
        let (mut a, mut b) = (w.clone(), w.clone());
        round_to_nearest(&mut a, cols, &q);
        gptq(&mut b, 3, cols, &h, &q, GptqOptions::default()).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_gram_is_an_error() {
        let q = Sym4 { group: 4 };
        let mut w = vec![0.5f32; 8];
        assert!(gptq(&mut w, 2, 4, &[1.0; 15], &q, GptqOptions::default()).is_err());
        let mut nan = vec![0f32; 16];
        nan[5] = f32::NAN;
        assert!(gptq(&mut w, 2, 4, &nan, &q, GptqOptions::default()).is_err());
        // Indefinite without damping.
        let mut bad = vec![0f32; 16];
        for i in 0..4 {
            bad[i * 4 + i] = 1.0;
        }
        bad[1] = 2.0;
        bad[4] = 2.0;
        let no_damp = GptqOptions { damp: 0.0 };
        assert!(gptq(&mut w, 2, 4, &bad, &q, no_damp).is_err());
    }
}
