//! The few numeric kernels of the forward pass. Matrix products go through
//! `matrixmultiply` (packed, cache-blocked SGEMM with runtime AVX/FMA
//! dispatch), split across the rayon pool by output columns; a single
//! token's product is a plain multithreaded GEMV, because packing a weight
//! matrix to use it once costs more than the product.

use rayon::prelude::*;

/// Output columns per parallel SGEMM task: a multiple of the kernels'
/// widths, small enough that 2..16 threads all get work on a 576-wide layer.
const COLS_PER_TASK: usize = 64;

/// Rows per GEMV task (enough work per task to amortize scheduling).
const ROWS_PER_TASK: usize = 32;

/// Up to this many tokens a product is done row by row instead of by
/// SGEMM, whose packing copies all of w for only a few uses of it.
const SMALL_BATCH: usize = 12;

/// Shared pointer to an output buffer whose tasks write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own column range of the output (see
// `matmul_t`), so no two threads touch the same element.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not a field access) so closures capture the whole
    /// wrapper, which is Send, rather than the raw pointer field.
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `y[n, d_out] = x[n, d_in] · w[d_out, d_in]ᵀ` (w row-major as served).
pub fn matmul_t(x: &[f32], n: usize, w: &[f32], d_out: usize, d_in: usize, y: &mut [f32]) {
    assert_eq!(y.len(), n * d_out, "matmul_t: y is not n × d_out");
    matmul_t_cols(x, n, w, d_out, d_in, y, d_out, 0);
}

/// Columns `col0..col0 + rows` of `y[n, y_cols]` = `x[n, d_in] · w[rows,
/// d_in]ᵀ`: a slice of the weight's rows at a time, for weights decoded a
/// chunk at a time. Each output element depends only on its own row of w
/// and of x, so a product split this way equals the whole one bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_cols(
    x: &[f32],
    n: usize,
    w: &[f32],
    rows: usize,
    d_in: usize,
    y: &mut [f32],
    y_cols: usize,
    col0: usize,
) {
    assert_eq!(x.len(), n * d_in, "matmul_t: x is not n × d_in");
    assert_eq!(w.len(), rows * d_in, "matmul_t: w is not rows × d_in");
    assert!(col0 + rows <= y_cols, "matmul_t: columns past y's width");
    assert_eq!(y.len(), n * y_cols, "matmul_t: y is not n × y_cols");
    if n == 0 || rows == 0 {
        return;
    }
    let out = OutPtr(y.as_mut_ptr());
    if n <= SMALL_BATCH {
        // Few tokens: the product is bound by reading w, so read each row
        // once (it stays in L1) and dot it with every token.
        let tasks = rows.div_ceil(ROWS_PER_TASK);
        (0..tasks).into_par_iter().for_each(|t| {
            let r0 = t * ROWS_PER_TASK;
            for r in r0..(r0 + ROWS_PER_TASK).min(rows) {
                let wr = &w[r * d_in..(r + 1) * d_in];
                for (i, xi) in x.chunks_exact(d_in).enumerate() {
                    // SAFETY: i < n and col0 + r < y_cols, so the element
                    // is inside y; row r belongs to this task alone.
                    unsafe { *out.at(i * y_cols + col0 + r) = dot(xi, wr) };
                }
            }
        });
        return;
    }
    let tasks = rows.div_ceil(COLS_PER_TASK);
    (0..tasks).into_par_iter().for_each(|t| {
        let c0 = t * COLS_PER_TASK;
        let cols = COLS_PER_TASK.min(rows - c0);
        // SAFETY: the pointers and strides describe, in bounds of the
        // slices checked above: x as n × d_in row-major; rows c0..c0+cols
        // of w read as a d_in × cols matrix (row stride 1, column stride
        // d_in); and columns col0+c0..col0+c0+cols of y (row stride
        // y_cols), which only this task writes.
        unsafe {
            matrixmultiply::sgemm(
                n,
                d_in,
                cols,
                1.0,
                x.as_ptr(),
                d_in as isize,
                1,
                w.as_ptr().add(c0 * d_in),
                1,
                d_in as isize,
                0.0,
                out.at(col0 + c0),
                y_cols as isize,
                1,
            );
        }
    });
}

/// Dot product with 16 independent partial sums, so the compiler can keep
/// them in vector registers (float addition is not reassociated for us).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    // Pairwise reduction of the lanes.
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0] + s
}

/// `out = x / rms(x) * weight`, rows of `weight.len()`; the mean square in
/// f64 so long rows do not lose the small terms.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / d as f64;
        let scale = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Log-probabilities of logits, in f64 (KL and perplexity sum many small
/// terms).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&v| (f64::from(v) - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&v| f64::from(v) - lse).collect()
}

/// SiLU(gate) · up, in place into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], n: usize, w: &[f32], d_out: usize, d_in: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * d_out];
        for t in 0..n {
            for r in 0..d_out {
                let mut s = 0f64;
                for k in 0..d_in {
                    s += f64::from(x[t * d_in + k]) * f64::from(w[r * d_in + k]);
                }
                y[t * d_out + r] = s as f32;
            }
        }
        y
    }

    #[test]
    fn matmul_matches_naive_for_odd_shapes() {
        let mut seed = 12345u64;
        let mut rnd = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for &(n, d_out, d_in) in &[
            (1, 1, 1),
            (1, 130, 67),
            (3, 65, 17),
            (12, 200, 129),
            (13, 130, 67),
            (40, 200, 129),
            (16, 64, 64),
        ] {
            let x: Vec<f32> = (0..n * d_in).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..d_out * d_in).map(|_| rnd()).collect();
            let mut y = vec![f32::NAN; n * d_out];
            matmul_t(&x, n, &w, d_out, d_in, &mut y);
            for (a, b) in y.iter().zip(naive(&x, n, &w, d_out, d_in)) {
                assert!((a - b).abs() < 1e-4, "{n}x{d_out}x{d_in}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn log_softmax_is_normalized() {
        let l = log_softmax(&[1.0, 2.0, 3.0, -1e4]);
        let s: f64 = l.iter().map(|v| v.exp()).sum();
        assert!((s - 1.0).abs() < 1e-12);
    }
}
