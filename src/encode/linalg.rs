//! Dense linear algebra for the encoders, in f64: matrix products (through
//! `matrixmultiply`), thin QR, symmetric eigen-decomposition (cyclic
//! Jacobi), and the randomized truncated SVD built from them.
//!
//! Matrices are row-major `Mat { rows, cols, data }`.

use matrixmultiply::dgemm;

use crate::synth::Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f64>,
}

impl Mat {
    pub fn zeros(rows: usize, cols: usize) -> Mat {
        Mat {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    pub fn from_f32(rows: usize, cols: usize, v: &[f32]) -> Mat {
        Mat {
            rows,
            cols,
            data: v.iter().map(|&x| f64::from(x)).collect(),
        }
    }

    pub fn at(&self, r: usize, c: usize) -> f64 {
        self.data[r * self.cols + c]
    }

    pub fn transpose(&self) -> Mat {
        let mut t = Mat::zeros(self.cols, self.rows);
        for r in 0..self.rows {
            for c in 0..self.cols {
                t.data[c * self.rows + r] = self.data[r * self.cols + c];
            }
        }
        t
    }

    pub fn frobenius2(&self) -> f64 {
        self.data.iter().map(|x| x * x).sum()
    }
}

/// `op(a) · op(b)` where `op` transposes when the flag is set.
pub fn matmul(a: &Mat, ta: bool, b: &Mat, tb: bool) -> Mat {
    let (m, k) = if ta {
        (a.cols, a.rows)
    } else {
        (a.rows, a.cols)
    };
    let (k2, n) = if tb {
        (b.cols, b.rows)
    } else {
        (b.rows, b.cols)
    };
    assert_eq!(k, k2, "matmul inner dimensions");
    let mut c = Mat::zeros(m, n);
    // Row-major strides; a transpose is the same buffer with swapped strides.
    let (rsa, csa) = if ta { (1, a.cols) } else { (a.cols, 1) };
    let (rsb, csb) = if tb { (1, b.cols) } else { (b.cols, 1) };
    if m > 0 && n > 0 && k > 0 {
        // SAFETY: the pointers and strides describe exactly the m×k, k×n
        // and m×n matrices owned by a, b and c (dimensions checked above).
        unsafe {
            dgemm(
                m,
                k,
                n,
                1.0,
                a.data.as_ptr(),
                rsa as isize,
                csa as isize,
                b.data.as_ptr(),
                rsb as isize,
                csb as isize,
                0.0,
                c.data.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    }
    c
}

/// Orthonormalize the columns of `y` in place (Gram-Schmidt applied twice,
/// which is as accurate as Householder for these tall, thin matrices).
/// Columns that vanish are replaced by zeros.
pub fn orthonormalize_columns(y: &mut Mat) {
    let (m, k) = (y.rows, y.cols);
    for j in 0..k {
        for _pass in 0..2 {
            for i in 0..j {
                let mut dot = 0.0;
                for r in 0..m {
                    dot += y.data[r * k + i] * y.data[r * k + j];
                }
                for r in 0..m {
                    y.data[r * k + j] -= dot * y.data[r * k + i];
                }
            }
        }
        let norm = (0..m)
            .map(|r| y.data[r * k + j].powi(2))
            .sum::<f64>()
            .sqrt();
        for r in 0..m {
            y.data[r * k + j] = if norm > 1e-300 {
                y.data[r * k + j] / norm
            } else {
                0.0
            };
        }
    }
}

/// Eigen-decomposition of a symmetric matrix by cyclic Jacobi rotations:
/// returns eigenvalues in descending order and the matching eigenvectors as
/// the columns of a matrix.
pub fn symmetric_eigen(a: &Mat) -> (Vec<f64>, Mat) {
    let n = a.rows;
    assert_eq!(n, a.cols, "symmetric_eigen needs a square matrix");
    let mut s = a.clone();
    let mut v = Mat::zeros(n, n);
    for i in 0..n {
        v.data[i * n + i] = 1.0;
    }
    let scale = s.frobenius2().sqrt().max(1e-300);
    for _sweep in 0..60 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| s.data[i * n + j].powi(2))
            .sum::<f64>()
            .sqrt();
        if off <= 1e-14 * scale {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = s.data[p * n + q];
                if apq.abs() <= 1e-300 {
                    continue;
                }
                let (app, aqq) = (s.data[p * n + p], s.data[q * n + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let sn = t * c;
                // Rotate rows/columns p and q of s, and columns of v.
                for k in 0..n {
                    let (skp, skq) = (s.data[k * n + p], s.data[k * n + q]);
                    s.data[k * n + p] = c * skp - sn * skq;
                    s.data[k * n + q] = sn * skp + c * skq;
                }
                for k in 0..n {
                    let (spk, sqk) = (s.data[p * n + k], s.data[q * n + k]);
                    s.data[p * n + k] = c * spk - sn * sqk;
                    s.data[q * n + k] = sn * spk + c * sqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v.data[k * n + p], v.data[k * n + q]);
                    v.data[k * n + p] = c * vkp - sn * vkq;
                    v.data[k * n + q] = sn * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| s.data[j * n + j].total_cmp(&s.data[i * n + i]));
    let vals: Vec<f64> = order.iter().map(|&i| s.data[i * n + i]).collect();
    let mut vecs = Mat::zeros(n, n);
    for (new, &old) in order.iter().enumerate() {
        for k in 0..n {
            vecs.data[k * n + new] = v.data[k * n + old];
        }
    }
    (vals, vecs)
}

/// All singular values of `a`, descending (from the eigenvalues of the
/// smaller Gram matrix). Exact up to rounding: the reference the
/// randomized SVD is checked against.
pub fn singular_values(a: &Mat) -> Vec<f64> {
    let g = if a.rows >= a.cols {
        matmul(a, true, a, false)
    } else {
        matmul(a, false, a, true)
    };
    symmetric_eigen(&g)
        .0
        .into_iter()
        .map(|l| l.max(0.0).sqrt())
        .collect()
}

/// A truncated SVD: `a ≈ u · diag(sigma) · vt`, `u` [m × r], `vt` [r × n].
#[derive(Debug, Clone)]
pub struct Svd {
    pub u: Mat,
    pub sigma: Vec<f64>,
    pub vt: Mat,
}

impl Svd {
    pub fn rank(&self) -> usize {
        self.sigma.len()
    }

    /// Keep the leading `r` triplets.
    pub fn truncate(&mut self, r: usize) {
        let r = r.min(self.rank());
        let m = self.u.rows;
        let mut u = Mat::zeros(m, r);
        for i in 0..m {
            u.data[i * r..(i + 1) * r]
                .copy_from_slice(&self.u.data[i * self.u.cols..i * self.u.cols + r]);
        }
        self.u = u;
        self.sigma.truncate(r);
        self.vt.data.truncate(r * self.vt.cols);
        self.vt.rows = r;
    }

    /// `u · diag(sigma) · vt`.
    pub fn reconstruct(&self) -> Mat {
        let mut us = self.u.clone();
        let r = self.rank();
        for i in 0..us.rows {
            for j in 0..r {
                us.data[i * r + j] *= self.sigma[j];
            }
        }
        matmul(&us, false, &self.vt, false)
    }
}

/// Randomized truncated SVD (Halko, Martinsson, Tropp 2011, algorithm 4.4):
/// a Gaussian sketch of `rank + oversample` columns, `power_iters` rounds of
/// subspace iteration with re-orthonormalization, then the exact SVD of the
/// small projected matrix. Deterministic for a given `seed`.
pub fn randomized_svd(
    a: &Mat,
    rank: usize,
    oversample: usize,
    power_iters: usize,
    seed: u64,
) -> Svd {
    let (m, n) = (a.rows, a.cols);
    let k = (rank + oversample).min(m.min(n));
    let mut rng = Rng(seed | 1);
    let omega = Mat {
        rows: n,
        cols: k,
        data: (0..n * k).map(|_| f64::from(rng.normal())).collect(),
    };
    let mut y = matmul(a, false, &omega, false); // m × k
    orthonormalize_columns(&mut y);
    for _ in 0..power_iters {
        let mut z = matmul(a, true, &y, false); // n × k
        orthonormalize_columns(&mut z);
        y = matmul(a, false, &z, false);
        orthonormalize_columns(&mut y);
    }
    let q = y; // m × k, orthonormal columns
    let b = matmul(&q, true, a, false); // k × n
    // SVD of the small b through the eigen-decomposition of b·bᵀ (k × k).
    let bbt = matmul(&b, false, &b, true);
    let (vals, w) = symmetric_eigen(&bbt);
    let r = rank.min(k);
    let sigma: Vec<f64> = vals.iter().take(r).map(|&l| l.max(0.0).sqrt()).collect();
    // u = q · w[:, :r]; vt = diag(1/σ) · w[:, :r]ᵀ · b.
    let mut wr = Mat::zeros(k, r);
    for i in 0..k {
        for j in 0..r {
            wr.data[i * r + j] = w.data[i * k + j];
        }
    }
    let u = matmul(&q, false, &wr, false);
    let mut vt = matmul(&wr, true, &b, false);
    for (j, &s) in sigma.iter().enumerate() {
        let inv = if s > 1e-300 { 1.0 / s } else { 0.0 };
        for x in &mut vt.data[j * n..(j + 1) * n] {
            *x *= inv;
        }
    }
    Svd { u, sigma, vt }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(rows: usize, cols: usize, seed: u64) -> Mat {
        let mut rng = Rng(seed);
        Mat {
            rows,
            cols,
            data: (0..rows * cols).map(|_| f64::from(rng.normal())).collect(),
        }
    }

    #[test]
    fn matmul_with_transposes() {
        let a = random(3, 4, 1);
        let b = random(4, 2, 2);
        let c = matmul(&a, false, &b, false);
        let c2 = matmul(&a.transpose(), true, &b.transpose(), true);
        for i in 0..3 {
            for j in 0..2 {
                let want: f64 = (0..4).map(|k| a.at(i, k) * b.at(k, j)).sum();
                assert!((c.at(i, j) - want).abs() < 1e-12);
                assert!((c2.at(i, j) - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn eigen_of_a_known_matrix() {
        // [[2,1],[1,2]] has eigenvalues 3 and 1.
        let a = Mat {
            rows: 2,
            cols: 2,
            data: vec![2.0, 1.0, 1.0, 2.0],
        };
        let (vals, vecs) = symmetric_eigen(&a);
        assert!((vals[0] - 3.0).abs() < 1e-12 && (vals[1] - 1.0).abs() < 1e-12);
        let v0 = (vecs.at(0, 0), vecs.at(1, 0));
        assert!((v0.0.abs() - v0.1.abs()).abs() < 1e-12);
    }

    #[test]
    fn randomized_svd_recovers_a_low_rank_matrix() {
        // Exact rank 5: the rank-5 SVD must reconstruct it.
        let a = matmul(&random(60, 5, 3), false, &random(5, 40, 4), false);
        let svd = randomized_svd(&a, 5, 5, 2, 7);
        let r = svd.reconstruct();
        let err: f64 = a
            .data
            .iter()
            .zip(&r.data)
            .map(|(x, y)| (x - y).powi(2))
            .sum();
        assert!(err.sqrt() < 1e-9 * a.frobenius2().sqrt(), "{err}");
        let exact = singular_values(&a);
        for (s, e) in svd.sigma.iter().zip(&exact) {
            assert!((s - e).abs() < 1e-9 * exact[0]);
        }
        assert!(exact[5] < 1e-6 * exact[0]);
    }

    #[test]
    fn truncation_error_is_near_optimal_on_noise() {
        let a = random(80, 50, 9);
        let exact = singular_values(&a);
        let r = 10;
        let optimal: f64 = exact[r..].iter().map(|s| s * s).sum::<f64>().sqrt();
        let svd = randomized_svd(&a, r, 10, 4, 11);
        let rec = svd.reconstruct();
        let err: f64 = a
            .data
            .iter()
            .zip(&rec.data)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(err <= optimal * 1.05, "{err} vs optimal {optimal}");
    }
}
