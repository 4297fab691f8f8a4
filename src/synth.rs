//! Deterministic synthetic data:
//!
//! - ggml blocks and sketch factors from a seeded generator, for the demo
//!   model, the benchmarks and the tests ([`ggml_blocks`], [`sketch`]);
//! - Q4_K and Q6_K quantizers ([`quantize_q4_k`], [`quantize_q6_k`]): the
//!   simple non-iterative kind (per sub-block min/max or max-abs, scales
//!   rounded up onto their grids so every value is covered, codes rounded
//!   against the stored scales), not llama.cpp's search for the best scales;
//! - whole models with real shapes and realistic values ([`write_model`],
//!   run by `examples/make_synth_model.rs`): Gaussian matrices with a
//!   per-matrix spread, outlier input channels and heavy-tailed elements,
//!   quantized as llama.cpp's Q4_K_M would type them, with a byte-level BPE
//!   tokenizer of the real vocabulary size that tokenizes English.
//!
//! Every value is a function of the seed, the tensor's index and the row
//! chunk's index, never of the thread count.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use half::f16;
use rayon::prelude::*;

use crate::error::{ErrorKind, Result, err};
use crate::format::gguf::{DEFAULT_ALIGNMENT, encode_header};
use crate::format::meta::{MetaType, MetaValue, Metadata};
use crate::format::sk32::Sketch;
use crate::quant::{GgmlType, QK_K};

/// xorshift64: fast, seedable, good enough for test data.
pub struct Rng(pub u64);

/// splitmix64's finalizer: a bijective mix of 64 bits.
fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 2^-24: one unit of a 24-bit uniform.
const U24: f32 = 1.0 / 16_777_216.0;

impl Rng {
    /// The generator of one stream of a family, e.g. `[seed, tensor,
    /// chunk]`: the parts are mixed so that neighbouring streams are
    /// unrelated.
    pub fn stream(parts: &[u64]) -> Rng {
        let mut h = 0x5eed_5eed_5eed_5eed_u64;
        for &p in parts {
            h = splitmix64(h ^ splitmix64(p));
        }
        // xorshift's one fixed point.
        Rng(if h == 0 { 0x9e37_79b9_7f4a_7c15 } else { h })
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Roughly normal with standard deviation ~1 (sum of four uniforms).
    pub fn normal(&mut self) -> f32 {
        (0..4)
            .map(|_| (self.next_u64() % 10_000) as f32 / 10_000.0)
            .sum::<f32>()
            * 1.7
            - 3.4
    }

    /// Uniform in [0, 1), 24 bits.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * U24
    }

    /// Two independent standard normal values (Box-Muller on 24-bit
    /// uniforms, so |x| < 5.8).
    pub fn gaussian_pair(&mut self) -> (f32, f32) {
        let x = self.next_u64();
        let u1 = ((x >> 40) + 1) as f32 * U24; // (0, 1]
        let u2 = ((x >> 16) & 0xff_ffff) as f32 * U24;
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        (r * c, r * s)
    }

    /// Fill `out` with standard normal values.
    pub fn fill_gaussian(&mut self, out: &mut [f32]) {
        let mut pairs = out.chunks_exact_mut(2);
        for p in &mut pairs {
            (p[0], p[1]) = self.gaussian_pair();
        }
        if let [last] = pairs.into_remainder() {
            *last = self.gaussian_pair().0;
        }
    }

    /// Failures before the first success of a trial with probability `p`
    /// (`ln_q` = ln(1 - p)), saturating at `usize::MAX`.
    fn geometric(&mut self, ln_q: f64) -> usize {
        let u = ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
        (u.ln() / ln_q) as usize
    }
}

fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

// -- quantizers ---------------------------------------------------------

/// The smallest f16 not below `x` (for `x >= 0`), saturating at the largest
/// finite f16; 0 for NaN or `x <= 0`. A super-scale rounded this way keeps
/// every sub-block scale within its integer grid.
fn f16_at_least(x: f32) -> f16 {
    if x.is_nan() || x <= 0.0 {
        return f16::ZERO;
    }
    if x >= f16::MAX.to_f32() {
        return f16::MAX;
    }
    let h = f16::from_f32(x);
    if h.to_f32() >= x {
        h
    } else {
        // The next f16 up: positive, so one more in the bit pattern.
        f16::from_bits(h.to_bits() + 1)
    }
}

/// Finite input as is, anything else as 0.
#[inline]
fn finite(v: f32) -> f32 {
    if v.is_finite() { v } else { 0.0 }
}

/// Quantize `values` (a multiple of 256 long) to Q4_K blocks appended to
/// `out`: 144 bytes per 256 values, f16 d, f16 dmin, eight 6-bit scales and
/// mins packed in 12 bytes, 128 bytes of 4-bit codes, decoded as
/// `d * sc * q - dmin * m` (see `quant::kquants`).
///
/// Per 32-value sub-block the range is [min(lo, 0), hi]; the mins and then
/// the scales are rounded *up* onto the grids `dmin * 0..=63` and
/// `d * 0..=63`, so the range stays covered and every decoded value is
/// within half a step (`d * sc / 2`) of its input. Non-finite inputs count
/// as 0; input beyond the f16 range of the scales (about 6e7) is clipped.
pub fn quantize_q4_k(values: &[f32], out: &mut Vec<u8>) {
    assert!(
        values.len().is_multiple_of(QK_K),
        "Q4_K quantizes whole 256-value blocks, got {}",
        values.len()
    );
    out.reserve(values.len() / QK_K * 144);
    for x in values.chunks_exact(QK_K) {
        q4_k_block(x, out);
    }
}

fn q4_k_block(x: &[f32], out: &mut Vec<u8>) {
    let mut lo = [0f32; 8];
    let mut hi = [0f32; 8];
    for (j, s) in x.chunks_exact(32).enumerate() {
        let (mut a, mut b) = (0f32, f32::MIN);
        for &v in s {
            let v = finite(v);
            a = a.min(v);
            b = b.max(v);
        }
        lo[j] = a; // <= 0: the offset is subtracted
        hi[j] = b;
    }
    let dmin = f16_at_least(lo.iter().fold(0f32, |a, &v| a.max(-v)) / 63.0);
    let dminf = dmin.to_f32();
    let mut m = [0u8; 8];
    let mut ml = [0f32; 8];
    let mut need = [0f32; 8];
    for j in 0..8 {
        if dminf > 0.0 {
            m[j] = (-lo[j] / dminf).ceil().min(63.0) as u8;
        }
        ml[j] = dminf * f32::from(m[j]);
        need[j] = ((hi[j] + ml[j]) / 15.0).max(0.0);
    }
    let d = f16_at_least(need.iter().fold(0f32, |a, &v| a.max(v)) / 63.0);
    let df = d.to_f32();
    let mut sc = [0u8; 8];
    let mut q = [0u8; QK_K];
    for j in 0..8 {
        if df > 0.0 {
            sc[j] = (need[j] / df).ceil().min(63.0) as u8;
        }
        let dl = df * f32::from(sc[j]);
        if dl > 0.0 {
            let inv = 1.0 / dl;
            for (q, &v) in q[j * 32..j * 32 + 32]
                .iter_mut()
                .zip(&x[j * 32..j * 32 + 32])
            {
                // Non-negative up to rounding, so +0.5 and truncation round.
                *q = (((finite(v) + ml[j]) * inv + 0.5) as i32).clamp(0, 15) as u8;
            }
        }
    }
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    out.extend(packed);
    for c in 0..4 {
        out.extend((0..32).map(|l| q[c * 64 + l] | (q[c * 64 + 32 + l] << 4)));
    }
}

/// Quantize `values` (a multiple of 256 long) to Q6_K blocks appended to
/// `out`: 210 bytes per 256 values, 128 bytes of low nibbles, 64 bytes of
/// 2-bit high parts, sixteen int8 scales, f16 d, decoded as
/// `d * sc * (q - 32)` (see `quant::kquants`).
///
/// Per 16-value sub-block the value of largest magnitude maps to code
/// -32 (the scale takes its sign, as ggml does); the scales are rounded
/// *up* in magnitude onto `d * -127..=127`, so a decoded value is within
/// one step (`|d * sc|`) of its input, and within half a step unless it
/// is on the short side of the code range. Non-finite inputs count as 0.
pub fn quantize_q6_k(values: &[f32], out: &mut Vec<u8>) {
    assert!(
        values.len().is_multiple_of(QK_K),
        "Q6_K quantizes whole 256-value blocks, got {}",
        values.len()
    );
    out.reserve(values.len() / QK_K * 210);
    for x in values.chunks_exact(QK_K) {
        q6_k_block(x, out);
    }
}

fn q6_k_block(x: &[f32], out: &mut Vec<u8>) {
    // Signed sub-block scales: the extreme value over -32.
    let mut s = [0f32; 16];
    for (i, sub) in x.chunks_exact(16).enumerate() {
        let extreme = sub.iter().fold(0f32, |a, &v| {
            let v = finite(v);
            if v.abs() > a.abs() { v } else { a }
        });
        s[i] = -extreme / 32.0;
    }
    let d = f16_at_least(s.iter().fold(0f32, |a, &v| a.max(v.abs())) / 127.0);
    let df = d.to_f32();
    let mut sc = [0i8; 16];
    let mut code = [32u8; QK_K];
    for i in 0..16 {
        if df > 0.0 {
            let mag = (s[i].abs() / df).ceil().min(127.0);
            sc[i] = (mag.copysign(s[i])) as i8;
        }
        let dl = df * f32::from(sc[i]);
        if dl != 0.0 {
            let inv = 1.0 / dl;
            for (c, &v) in code[i * 16..i * 16 + 16]
                .iter_mut()
                .zip(&x[i * 16..i * 16 + 16])
            {
                // x / dl + 32 rounded: above -0.5 for every code we keep,
                // so +0.5 and truncation round (and clamp catches the rest).
                *c = ((finite(v) * inv + 32.5) as i32).clamp(0, 63) as u8;
            }
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for h in 0..2 {
        for sub in 0..4 {
            for l in 0..32 {
                let c = code[h * 128 + sub * 32 + l];
                ql[h * 64 + (sub % 2) * 32 + l] |= (c & 0x0f) << (4 * (sub / 2));
                qh[h * 32 + l] |= (c >> 4) << (2 * sub);
            }
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.map(|v| v as u8));
    out.extend(d.to_le_bytes());
}

/// ggml blocks for `n` elements of `ty` (n a multiple of the block size).
/// Float, Q8_0, Q4_x, Q5_x, Q4_K and Q6_K blocks quantize normal values of
/// standard deviation `std` (max-abs or min/max scales; the k-quants with
/// [`quantize_q4_k`] / [`quantize_q6_k`]); Q2_K, Q3_K and Q5_K blocks get
/// random codes and small, realistic super-scales.
pub fn ggml_blocks(ty: GgmlType, n: u64, std: f32, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    let mut vals = |m: usize| -> Vec<f32> { (0..m).map(|_| rng.normal() * std).collect() };
    match ty {
        GgmlType::F32 => vals(n as usize)
            .iter()
            .for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => vals(n as usize)
            .iter()
            .for_each(|v| out.extend(f16_bytes(*v))),
        GgmlType::Bf16 => vals(n as usize)
            .iter()
            .for_each(|v| out.extend(half::bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for b in vals(n as usize).chunks(32) {
                let m = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = m / 127.0;
                out.extend(f16_bytes(d));
                out.extend(b.iter().map(|v| {
                    if d > 0.0 {
                        (v / d).round() as i8 as u8
                    } else {
                        0
                    }
                }));
            }
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            let levels = if ty == GgmlType::Q4_0 { 8.0 } else { 16.0 };
            for b in vals(n as usize).chunks(32) {
                let m = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = m / levels;
                let q: Vec<u8> = b
                    .iter()
                    .map(|v| {
                        let x = if d > 0.0 {
                            (v / d).round() + levels
                        } else {
                            levels
                        };
                        x.clamp(0.0, 2.0 * levels - 1.0) as u8
                    })
                    .collect();
                out.extend(f16_bytes(d));
                if ty == GgmlType::Q5_0 {
                    let qh: u32 = (0..32).map(|i| u32::from(q[i] >> 4) << i).sum();
                    out.extend(qh.to_le_bytes());
                }
                out.extend((0..16).map(|i| (q[i] & 0xf) | ((q[i + 16] & 0xf) << 4)));
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let top = if ty == GgmlType::Q4_1 { 15.0 } else { 31.0 };
            for b in vals(n as usize).chunks(32) {
                let lo = b.iter().fold(f32::MAX, |a, v| a.min(*v));
                let hi = b.iter().fold(f32::MIN, |a, v| a.max(*v));
                let d = (hi - lo) / top;
                let q: Vec<u8> = b
                    .iter()
                    .map(|v| {
                        if d > 0.0 {
                            ((v - lo) / d).round().clamp(0.0, top) as u8
                        } else {
                            0
                        }
                    })
                    .collect();
                out.extend(f16_bytes(d));
                out.extend(f16_bytes(lo));
                if ty == GgmlType::Q5_1 {
                    let qh: u32 = (0..32).map(|i| u32::from(q[i] >> 4) << i).sum();
                    out.extend(qh.to_le_bytes());
                }
                out.extend((0..16).map(|i| (q[i] & 0xf) | ((q[i + 16] & 0xf) << 4)));
            }
        }
        GgmlType::Q4K => quantize_q4_k(&vals(n as usize), &mut out),
        GgmlType::Q6K => quantize_q6_k(&vals(n as usize), &mut out),
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q5K => {
            let bb = ty.block_bytes() as usize;
            let (d_at, dmin_at) = match ty {
                GgmlType::Q2K => (80, Some(82)),
                GgmlType::Q3K => (108, None),
                _ => (0, Some(2)),
            };
            for _ in 0..n / 256 {
                let mut blk: Vec<u8> = (0..bb).map(|_| rng.next_u64() as u8).collect();
                blk[d_at..d_at + 2].copy_from_slice(&f16_bytes(std / 24.0));
                if let Some(at) = dmin_at {
                    blk[at..at + 2].copy_from_slice(&f16_bytes(std / 48.0));
                }
                out.extend(blk);
            }
        }
        // Types rknot does not decode get zero blocks.
        other => out.resize(other.bytes_for(n).unwrap_or(0) as usize, 0),
    }
    out
}

/// A rank-`rank` sketch with random factors and a decaying spectrum.
pub fn sketch(name: &str, d_out: usize, d_in: usize, rank: usize, rng: &mut Rng) -> Sketch {
    let u: Vec<f32> = (0..d_out * rank)
        .map(|_| rng.normal() / (d_out as f32).sqrt())
        .collect();
    let vt: Vec<f32> = (0..rank * d_in)
        .map(|_| rng.normal() / (d_in as f32).sqrt())
        .collect();
    let sigma: Vec<f32> = (0..rank).map(|r| 0.5 / (r + 1) as f32).collect();
    Sketch::quantize(name, d_out, d_in, &u, &sigma, &vt)
}

// -- realistic values ---------------------------------------------------

/// What a synthetic tensor's values look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// A weight matrix: see [`matrix_profile`] and [`matrix_values`].
    Matrix,
    /// A norm weight: `1 + 0.1 N(0, 1)`.
    Norm,
    /// A bias: `0.02 N(0, 1)`.
    Bias,
}

/// Fraction of a matrix's input channels that are outliers.
pub const OUTLIER_CHANNELS: f32 = 0.01;
/// Probability that an element is a heavy-tailed outlier.
pub const OUTLIER_ELEMENTS: f64 = 1e-3;
/// Elements per generation chunk (whole rows, at least one).
const CHUNK_ELEMS: u64 = 1 << 20;

/// The stream of a tensor's per-matrix parameters (chunks count from 0).
const PROFILE_STREAM: u64 = u64::MAX;

/// Per-input-channel standard deviations of a matrix with rows of `d_in`:
/// `factor / sqrt(d_in)` with a per-matrix factor uniform in [0.5, 1.5),
/// times a per-channel scale, `1 + 0.05 N(0, 1)` for most channels and
/// uniform in [4, 8) for [`OUTLIER_CHANNELS`] of them (real LLMs have a few
/// input channels of much larger magnitude).
pub fn matrix_profile(seed: u64, tensor: u64, d_in: usize) -> Vec<f32> {
    let mut rng = Rng::stream(&[seed, tensor, PROFILE_STREAM]);
    let sigma = (0.5 + rng.uniform()) / (d_in as f32).sqrt();
    let mut g = vec![0f32; d_in];
    rng.fill_gaussian(&mut g);
    g.iter()
        .map(|&g| {
            let ch = if rng.uniform() < OUTLIER_CHANNELS {
                4.0 + 4.0 * rng.uniform()
            } else {
                1.0 + 0.05 * g
            };
            sigma * ch
        })
        .collect()
}

/// Fill `out` (whole rows of `col_std.len()`) with Gaussian values of the
/// given per-column standard deviations, then make each element an outlier
/// with probability [`OUTLIER_ELEMENTS`]: multiplied by a magnitude
/// uniform in [5, 20) and a random sign.
pub fn matrix_values(rng: &mut Rng, col_std: &[f32], out: &mut [f32]) {
    rng.fill_gaussian(out);
    for row in out.chunks_mut(col_std.len()) {
        for (v, s) in row.iter_mut().zip(col_std) {
            *v *= s;
        }
    }
    let ln_q = (1.0 - OUTLIER_ELEMENTS).ln();
    let mut at = rng.geometric(ln_q);
    while at < out.len() {
        let k = 5.0 + 15.0 * rng.uniform();
        out[at] *= if rng.next_u64() >> 63 == 0 { k } else { -k };
        at = at.saturating_add(1).saturating_add(rng.geometric(ln_q));
    }
}

/// One tensor of a synthetic model: name, ggml-order dims (`[d_in,
/// d_out]` for a matrix), stored type and what its values look like.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub kind: ValueKind,
}

impl TensorPlan {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Rows per generation chunk: a function of the shape alone.
    pub fn chunk_rows(&self) -> u64 {
        (CHUNK_ELEMS / self.row_len()).max(1)
    }

    pub fn chunks(&self) -> u64 {
        (self.elements() / self.row_len()).div_ceil(self.chunk_rows())
    }
}

/// Store `values` as `ty` (F32, F16, Q4_K or Q6_K).
pub fn encode_values(ty: GgmlType, values: &[f32], out: &mut Vec<u8>) -> Result<()> {
    match ty {
        GgmlType::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => out.extend(values.iter().flat_map(|v| f16_bytes(*v))),
        GgmlType::Q4K => quantize_q4_k(values, out),
        GgmlType::Q6K => quantize_q6_k(values, out),
        other => {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!("synthetic tensors are F32, F16, Q4_K or Q6_K, not {other}"),
            ));
        }
    }
    Ok(())
}

/// The values of chunk `chunk` of tensor number `index` (`profile`: its
/// [`matrix_profile`], for matrices), from its own generator
/// `[seed, index, chunk]`.
pub fn chunk_values(
    seed: u64,
    index: u64,
    plan: &TensorPlan,
    profile: &[f32],
    chunk: u64,
) -> Vec<f32> {
    let (row_len, rows) = (plan.row_len(), plan.elements() / plan.row_len());
    let r0 = chunk * plan.chunk_rows();
    let r1 = (r0 + plan.chunk_rows()).min(rows);
    let mut v = vec![0f32; (r1.saturating_sub(r0) * row_len) as usize];
    let mut rng = Rng::stream(&[seed, index, chunk]);
    match plan.kind {
        ValueKind::Matrix => matrix_values(&mut rng, profile, &mut v),
        ValueKind::Norm => {
            rng.fill_gaussian(&mut v);
            v.iter_mut().for_each(|x| *x = 1.0 + 0.1 * *x);
        }
        ValueKind::Bias => {
            rng.fill_gaussian(&mut v);
            v.iter_mut().for_each(|x| *x *= 0.02);
        }
    }
    v
}

/// Generate, encode and write tensor number `index`, a few chunks at a
/// time in parallel; returns the bytes written. Memory in use is a few
/// chunks per thread, whatever the tensor's size.
pub fn write_tensor<W: Write>(w: &mut W, seed: u64, index: u64, plan: &TensorPlan) -> Result<u64> {
    let profile = match plan.kind {
        ValueKind::Matrix => matrix_profile(seed, index, plan.row_len() as usize),
        _ => Vec::new(),
    };
    let chunks = plan.chunks();
    let batch = (2 * rayon::current_num_threads()).max(1) as u64;
    let mut written = 0u64;
    let mut k = 0;
    while k < chunks {
        let end = (k + batch).min(chunks);
        let bufs: Vec<Result<Vec<u8>>> = (k..end)
            .into_par_iter()
            .map(|c| {
                let v = chunk_values(seed, index, plan, &profile, c);
                let mut out = Vec::new();
                encode_values(plan.ty, &v, &mut out)?;
                Ok(out)
            })
            .collect();
        for b in bufs {
            let b = b.map_err(|e| e.tensor(&plan.name))?;
            w.write_all(&b).map_err(io_err("writing tensor data"))?;
            written += b.len() as u64;
        }
        k = end;
    }
    Ok(written)
}

fn io_err(what: &'static str) -> impl Fn(std::io::Error) -> crate::error::Error {
    move |e| err(ErrorKind::Io, format!("{what}: {e}"))
}

// -- model shapes -------------------------------------------------------

/// A model's hyper-parameters and tokenizer layout.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// `qwen2.5-7b`, `llama3-70b`, `tiny`.
    pub name: &'static str,
    /// `general.architecture`.
    pub arch: &'static str,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub context: u64,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// Q/K/V biases (Qwen2).
    pub qkv_bias: bool,
    pub tokenizer: TokenizerShape,
}

/// A synthetic byte-level BPE vocabulary: ids `0..regular` are the 256
/// byte tokens and merged tokens, then the special tokens, then `[PADn]`
/// up to the model's vocab size.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerShape {
    /// `tokenizer.ggml.pre`.
    pub pre: &'static str,
    /// Byte tokens plus merged tokens.
    pub regular: u64,
    /// Merges in all: one per merged token, then alternative splits of
    /// merged tokens (Llama 3 lists 280147 merges for 127744 tokens).
    pub merges: u64,
    /// (text, GGUF token type), ids from `regular` on.
    pub specials: Vec<(String, i32)>,
    pub bos: u32,
    pub eos: u32,
    pub padding: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<&'static str>,
}

/// The shapes [`model_shape`] knows.
pub const SHAPES: &[&str] = &["qwen2.5-7b", "llama3-70b", "tiny"];

const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' \
    + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

fn qwen2_specials(all: bool) -> Vec<(String, i32)> {
    let names: &[&str] = if all {
        &[
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ]
    } else {
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    };
    names
        .iter()
        .map(|&n| {
            let ty = if n.starts_with("<|") {
                TOKEN_CONTROL
            } else {
                TOKEN_USER_DEFINED
            };
            (n.to_string(), ty)
        })
        .collect()
}

fn llama3_specials() -> Vec<(String, i32)> {
    let mut names: Vec<String> = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    .map(String::from)
    .into();
    names.extend((3..248).map(|i| format!("<|reserved_special_token_{i}|>")));
    names.into_iter().map(|n| (n, TOKEN_CONTROL)).collect()
}

/// A named shape with its real number of layers.
pub fn model_shape(name: &str) -> Option<ModelShape> {
    Some(match name {
        "qwen2.5-7b" => ModelShape {
            name: "qwen2.5-7b",
            arch: "qwen2",
            layers: 28,
            hidden: 3584,
            heads: 28,
            kv_heads: 4,
            ffn: 18944,
            vocab: 152064,
            context: 32768,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            qkv_bias: true,
            tokenizer: TokenizerShape {
                pre: "qwen2",
                regular: 151643,
                merges: 151387,
                specials: qwen2_specials(true),
                bos: 151643,
                eos: 151645,
                padding: Some(151643),
                add_bos: false,
                chat_template: Some(CHATML),
            },
        },
        "llama3-70b" => ModelShape {
            name: "llama3-70b",
            arch: "llama",
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            vocab: 128256,
            context: 8192,
            rope_theta: 500_000.0,
            rms_eps: 1e-5,
            qkv_bias: false,
            tokenizer: TokenizerShape {
                pre: "llama-bpe",
                regular: 128000,
                merges: 280147,
                specials: llama3_specials(),
                bos: 128000,
                eos: 128001,
                padding: None,
                add_bos: true,
                chat_template: None,
            },
        },
        "tiny" => ModelShape {
            name: "tiny",
            arch: "qwen2",
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            ffn: 512,
            vocab: 1000,
            context: 4096,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            qkv_bias: true,
            tokenizer: TokenizerShape {
                pre: "qwen2",
                regular: 997,
                merges: 741,
                specials: qwen2_specials(false),
                bos: 997,
                eos: 999,
                padding: Some(997),
                add_bos: false,
                chat_template: Some(CHATML),
            },
        },
        _ => return None,
    })
}

/// llama.cpp's `use_more_bits(i, n)`: the layers whose `attn_v` and
/// `ffn_down` Q4_K_M stores as Q6_K.
pub fn use_more_bits(i: u64, n: u64) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The tensors of a shape in llama.cpp's order, typed as its Q4_K_M
/// quantization does: matrices Q4_K; `output.weight`, and `attn_v` /
/// `ffn_down` on [`use_more_bits`] layers, Q6_K; norms and biases F32.
pub fn model_tensors(s: &ModelShape) -> Vec<TensorPlan> {
    use GgmlType::{F32, Q4K, Q6K};
    use ValueKind::{Bias, Matrix, Norm};
    let head_dim = s.hidden / s.heads;
    let (qd, kv) = (s.heads * head_dim, s.kv_heads * head_dim);
    let t = |name: String, dims: Vec<u64>, ty, kind| TensorPlan {
        name,
        dims,
        ty,
        kind,
    };
    let mut out = vec![t(
        "token_embd.weight".into(),
        vec![s.hidden, s.vocab],
        Q4K,
        Matrix,
    )];
    for l in 0..s.layers {
        let n = |p: &str| format!("blk.{l}.{p}");
        let more = if use_more_bits(l, s.layers) { Q6K } else { Q4K };
        out.push(t(n("attn_norm.weight"), vec![s.hidden], F32, Norm));
        out.push(t(n("attn_q.weight"), vec![s.hidden, qd], Q4K, Matrix));
        if s.qkv_bias {
            out.push(t(n("attn_q.bias"), vec![qd], F32, Bias));
        }
        out.push(t(n("attn_k.weight"), vec![s.hidden, kv], Q4K, Matrix));
        if s.qkv_bias {
            out.push(t(n("attn_k.bias"), vec![kv], F32, Bias));
        }
        out.push(t(n("attn_v.weight"), vec![s.hidden, kv], more, Matrix));
        if s.qkv_bias {
            out.push(t(n("attn_v.bias"), vec![kv], F32, Bias));
        }
        out.extend([
            t(n("attn_output.weight"), vec![qd, s.hidden], Q4K, Matrix),
            t(n("ffn_norm.weight"), vec![s.hidden], F32, Norm),
            t(n("ffn_gate.weight"), vec![s.hidden, s.ffn], Q4K, Matrix),
            t(n("ffn_up.weight"), vec![s.hidden, s.ffn], Q4K, Matrix),
            t(n("ffn_down.weight"), vec![s.ffn, s.hidden], more, Matrix),
        ]);
    }
    out.push(t("output_norm.weight".into(), vec![s.hidden], F32, Norm));
    out.push(t(
        "output.weight".into(),
        vec![s.hidden, s.vocab],
        Q6K,
        Matrix,
    ));
    out
}

/// The model's key/values, tokenizer included, as a llama.cpp Q4_K_M file
/// of this shape would have them.
pub fn model_metadata(s: &ModelShape) -> Metadata {
    let mut md = Metadata::default();
    let str_ = |v: &str| MetaValue::String(v.into());
    let u = |v: u64| MetaValue::U32(v as u32);
    let k = |key: &str| format!("{}.{key}", s.arch);
    md.push("general.architecture", str_(s.arch));
    md.push("general.type", str_("model"));
    md.push(
        "general.name",
        str_(&format!(
            "rknot synthetic {} (random weights, {} blocks)",
            s.name, s.layers
        )),
    );
    md.push(k("block_count"), u(s.layers));
    md.push(k("context_length"), u(s.context));
    md.push(k("embedding_length"), u(s.hidden));
    md.push(k("feed_forward_length"), u(s.ffn));
    md.push(k("attention.head_count"), u(s.heads));
    md.push(k("attention.head_count_kv"), u(s.kv_heads));
    md.push(k("rope.freq_base"), MetaValue::F32(s.rope_theta));
    md.push(
        k("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(s.rms_eps),
    );
    if s.arch == "llama" {
        md.push(k("rope.dimension_count"), u(s.hidden / s.heads));
        md.push(k("vocab_size"), u(s.vocab));
    }
    md.push("general.file_type", u(15)); // LLAMA_FTYPE_MOSTLY_Q4_K_M
    let t = &s.tokenizer;
    let vocab = synth_vocab(t, s.vocab);
    md.push("tokenizer.ggml.model", str_("gpt2"));
    md.push("tokenizer.ggml.pre", str_(t.pre));
    let strings = |v: Vec<String>| MetaValue::Array {
        elem: MetaType::String,
        values: v.into_iter().map(MetaValue::String).collect(),
    };
    md.push("tokenizer.ggml.tokens", strings(vocab.tokens));
    md.push(
        "tokenizer.ggml.token_type",
        MetaValue::Array {
            elem: MetaType::I32,
            values: vocab.types.into_iter().map(MetaValue::I32).collect(),
        },
    );
    md.push("tokenizer.ggml.merges", strings(vocab.merges));
    md.push("tokenizer.ggml.bos_token_id", u(u64::from(t.bos)));
    md.push("tokenizer.ggml.eos_token_id", u(u64::from(t.eos)));
    if let Some(p) = t.padding {
        md.push("tokenizer.ggml.padding_token_id", u(u64::from(p)));
    }
    md.push("tokenizer.ggml.add_bos_token", MetaValue::Bool(t.add_bos));
    if let Some(ct) = t.chat_template {
        md.push("tokenizer.chat_template", str_(ct));
    }
    md.push("general.quantization_version", u(2));
    md
}

// -- tokenizer ----------------------------------------------------------

/// English text the vocabulary's first merges are learned from, so that
/// ordinary English tokenizes into whole words (a sentence a line, so that
/// words start lines as well as follow spaces).
const CORPUS: &str = "\
The capital of France is Paris.\n\
The capital of Germany is Berlin.\n\
The capital of Italy is Rome.\n\
The capital of Spain is Madrid.\n\
The capital of Japan is Tokyo.\n\
The capital of England is London.\n\
Paris is the largest city in France, and it is known for its museums, its food and its long history.\n\
What is the capital of France?\n\
It is Paris.\n\
What is the capital of the United States?\n\
It is Washington.\n\
A language model reads a sequence of tokens and predicts the next one.\n\
Each token is a word, a part of a word or a single character.\n\
The model has a vocabulary of many thousands of tokens, and it was trained on a large amount of text from books, articles, code and the web.\n\
When you ask the model a question, it writes an answer one token at a time.\n\
It is not always right, and it can be wrong about things that it has never seen, but it is often useful for many kinds of work.\n\
The weather today is cold and the sky is grey.\n\
Tomorrow it will be warm and sunny, and the people of the city will go to the park to walk, to read and to play with their children and their dogs.\n\
She said that she would come back after the meeting, but the meeting was long and she did not come back until the evening.\n\
He was waiting for her at the station with two cups of coffee and a small cake.\n\
There are seven days in a week, twelve months in a year and about three hundred and sixty five days in a year.\n\
The first day of the week is Monday in many countries and Sunday in others.\n\
Water is made of hydrogen and oxygen.\n\
The sun is a star, and the earth is a planet that moves around it.\n\
The moon moves around the earth.\n\
Light from the sun takes about eight minutes to reach the earth.\n\
Once upon a time there was a little girl who lived in a village near the forest.\n\
Every day she would walk through the forest to visit her grandmother, who lived in a small house on the other side.\n\
In this paper we present a new method for the problem of learning from data.\n\
We show that our method is simple, that it is fast and that it works well in practice.\n\
The results of our experiments show that the new method is better than the previous methods on most of the tasks that we have tested.\n\
The function returns the number of elements in the list.\n\
If the list is empty, it returns zero.\n\
Please read the following instructions carefully before you start.\n\
You should answer all of the questions, and you should write your answers in the space provided.\n\
You have one hour.\n\
The history of the world is the history of people, of their work, of their ideas and of their wars.\n\
Many great cities were built on rivers, because the river gave them water, food and a way to travel.\n\
Thank you for your help.\n\
I think that this is a good idea, and I would like to know more about it.\n\
Hello, how are you?\n\
Hello world!\n\
It's a nice day, isn't it?\n\
That's what I've heard, and we'll see what they'd say.\n\
Could you tell me where the nearest train station is?\n\
Go straight ahead and turn left at the church.\n\
";

/// GPT-2's byte-to-char map (printable Latin-1 bytes as themselves, the
/// other 68 from U+0100 on) and its token order: printable bytes first.
fn byte_chars() -> ([char; 256], Vec<u8>) {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\u{FFFD}')
        };
    }
    let order = (0..=255u8)
        .filter(|&b| printable(b))
        .chain((0..=255u8).filter(|&b| !printable(b)))
        .collect();
    (table, order)
}

/// A vocabulary being built: tokens, their index and the merges.
struct VocabBuilder {
    tokens: Vec<String>,
    index: HashMap<String, u32>,
    merges: Vec<String>,
    merged: HashSet<(u32, u32)>,
    /// Token id of each byte.
    byte_id: [u32; 256],
}

impl VocabBuilder {
    fn new() -> Self {
        let (table, order) = byte_chars();
        let mut v = VocabBuilder {
            tokens: Vec::new(),
            index: HashMap::new(),
            merges: Vec::new(),
            merged: HashSet::new(),
            byte_id: [0; 256],
        };
        for b in order {
            v.byte_id[b as usize] = v.tokens.len() as u32;
            v.push(table[b as usize].to_string());
        }
        v
    }

    fn push(&mut self, t: String) -> u32 {
        let id = self.tokens.len() as u32;
        self.index.insert(t.clone(), id);
        self.tokens.push(t);
        id
    }

    /// Record the merge `a b`, adding the merged token if it is new; the
    /// merged token's id.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        let (sa, sb) = (&self.tokens[a as usize], &self.tokens[b as usize]);
        let joined = format!("{sa}{sb}");
        if self.merged.insert((a, b)) {
            self.merges.push(format!("{sa} {sb}"));
        }
        match self.index.get(&joined) {
            Some(&id) => id,
            None => self.push(joined),
        }
    }

    /// Learn up to `max_tokens` new tokens from `text` by byte-pair
    /// encoding (most frequent pair first, until every word is one token).
    fn train(&mut self, text: &str, max_tokens: usize) {
        // Qwen2's pre-tokenizer, without the look-ahead.
        let re = regex::Regex::new(
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+",
        )
        .expect("static regex");
        let mut counts: HashMap<&str, u64> = HashMap::new();
        for m in re.find_iter(text) {
            *counts.entry(m.as_str()).or_default() += 1;
        }
        let mut words: Vec<(Vec<u32>, u64)> = counts
            .into_iter()
            .map(|(w, c)| (w.bytes().map(|b| self.byte_id[b as usize]).collect(), c))
            .collect();
        words.sort();
        let start = self.tokens.len();
        while self.tokens.len() - start < max_tokens {
            let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
            for (w, c) in &words {
                for p in w.windows(2) {
                    *pairs.entry((p[0], p[1])).or_default() += c;
                }
            }
            // Most frequent, then the smallest pair: no hash order leaks in.
            let Some((&(a, b), _)) = pairs.iter().max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0)))
            else {
                break;
            };
            let id = self.merge(a, b);
            for (w, _) in &mut words {
                let mut i = 0;
                while i + 1 < w.len() {
                    if w[i] == a && w[i + 1] == b {
                        w[i] = id;
                        w.remove(i + 1);
                    }
                    i += 1;
                }
            }
        }
    }

    /// Grow to `total` tokens with the prefixes of pseudo-English words
    /// (half of them after a space, some capitalized), each prefix merged
    /// from the one before and a byte.
    fn fill(&mut self, total: usize, rng: &mut Rng) {
        const CONSONANTS: &[(u8, f32)] = &[
            (b't', 9.1),
            (b'n', 6.7),
            (b's', 6.3),
            (b'h', 6.1),
            (b'r', 6.0),
            (b'd', 4.3),
            (b'l', 4.0),
            (b'c', 2.8),
            (b'm', 2.4),
            (b'w', 2.4),
            (b'f', 2.2),
            (b'g', 2.0),
            (b'y', 2.0),
            (b'p', 1.9),
            (b'b', 1.5),
            (b'v', 1.0),
            (b'k', 0.8),
            (b'j', 0.15),
            (b'x', 0.15),
            (b'q', 0.1),
            (b'z', 0.07),
        ];
        const VOWELS: &[(u8, f32)] = &[
            (b'e', 12.7),
            (b'a', 8.2),
            (b'o', 7.5),
            (b'i', 7.0),
            (b'u', 2.8),
        ];
        let pick = |rng: &mut Rng, set: &[(u8, f32)]| {
            let total: f32 = set.iter().map(|p| p.1).sum();
            let mut x = rng.uniform() * total;
            for &(c, w) in set {
                if x < w {
                    return c;
                }
                x -= w;
            }
            set[0].0
        };
        let mut word = Vec::new();
        while self.tokens.len() < total {
            word.clear();
            if rng.uniform() < 0.5 {
                word.push(b' ');
            }
            let len = 2 + (rng.next_u64() % 9) as usize;
            let mut vowel = rng.uniform() < 0.3;
            for _ in 0..len {
                let set = if vowel { VOWELS } else { CONSONANTS };
                word.push(pick(rng, set));
                // Mostly alternate; sometimes two of a kind.
                if rng.uniform() < 0.8 {
                    vowel = !vowel;
                }
            }
            if rng.uniform() < 0.15 {
                let first = usize::from(word[0] == b' ');
                word[first] = word[first].to_ascii_uppercase();
            }
            let mut cur = self.byte_id[word[0] as usize];
            for &b in &word[1..] {
                if self.tokens.len() >= total {
                    break;
                }
                let byte = self.byte_id[b as usize];
                let joined = format!(
                    "{}{}",
                    self.tokens[cur as usize], self.tokens[byte as usize]
                );
                // Through existing tokens without a new merge, so that each
                // merge here adds a token.
                cur = match self.index.get(&joined) {
                    Some(&id) => id,
                    None => self.merge(cur, byte),
                };
            }
        }
    }

    /// Add merges that split existing tokens differently from the merge
    /// that made them (both halves tokens), until there are `total`.
    fn alternative_merges(&mut self, total: usize) {
        let mut id = 256;
        while self.merges.len() < total && id < self.tokens.len() {
            let t = self.tokens[id].clone();
            for (k, _) in t.char_indices().skip(1) {
                if self.merges.len() >= total {
                    break;
                }
                if let (Some(&a), Some(&b)) = (self.index.get(&t[..k]), self.index.get(&t[k..]))
                    && self.merged.insert((a, b))
                {
                    self.merges.push(format!("{} {}", &t[..k], &t[k..]));
                }
            }
            id += 1;
        }
    }
}

/// A synthetic vocabulary: token texts, types and merges.
pub struct SynthVocab {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub merges: Vec<String>,
}

/// The vocabulary of `t` padded to `n_vocab` tokens: the 256 GPT-2 byte
/// tokens; merges learned from a paragraph of English (so the probe and
/// llama.cpp tokenize English into words); pseudo-word prefixes up to
/// `t.regular`; alternative merges up to `t.merges`; the special tokens;
/// `[PADn]` (unused) to the end. The same for every seed.
pub fn synth_vocab(t: &TokenizerShape, n_vocab: u64) -> SynthVocab {
    let regular = t.regular as usize;
    let mut v = VocabBuilder::new();
    v.train(CORPUS, regular.saturating_sub(v.tokens.len()));
    v.fill(regular, &mut Rng::stream(&[0x70c3_2b1e]));
    v.alternative_merges(t.merges as usize);
    // Training can merge two pairs into one token; the last few pseudo-word
    // prefixes then have no merge (tokens BPE never reaches, as real
    // vocabularies have too).
    v.merges.truncate(t.merges as usize);
    let mut types = vec![TOKEN_NORMAL; v.tokens.len()];
    for (s, ty) in &t.specials {
        v.tokens.push(s.clone());
        types.push(*ty);
    }
    while (v.tokens.len() as u64) < n_vocab {
        v.tokens.push(format!("[PAD{}]", v.tokens.len()));
        types.push(TOKEN_UNUSED);
    }
    v.tokens.truncate(n_vocab as usize);
    types.truncate(n_vocab as usize);
    SynthVocab {
        tokens: v.tokens,
        types,
        merges: v.merges,
    }
}

// -- writing a model ----------------------------------------------------

/// What [`write_model`] wrote.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    pub path: PathBuf,
    pub tensors: usize,
    pub parameters: u64,
    pub header_bytes: u64,
    /// The file's length (sparse: mostly a hole).
    pub bytes: u64,
}

/// Write a synthetic GGUF of shape `s` (with `s.layers` blocks) to `path`:
/// the header, then every tensor generated and quantized in parallel row
/// chunks and written in turn, so memory stays at a few chunks per thread.
/// `sparse`: the header only, the data section a hole (every tensor then
/// decodes to zeros). Written to a temporary file in the same directory,
/// synced and renamed into place; an existing `path` is an error unless
/// `force`. `progress`: a line to stderr every ten tensors.
pub fn write_model(
    path: &Path,
    s: &ModelShape,
    seed: u64,
    sparse: bool,
    force: bool,
    progress: bool,
) -> Result<ModelSummary> {
    if !force && path.symlink_metadata().is_ok() {
        return Err(err(
            ErrorKind::Io,
            format!("{} exists (pass --force to replace it)", path.display()),
        ));
    }
    let plans = model_tensors(s);
    let shapes: Vec<(String, Vec<u64>, GgmlType)> = plans
        .iter()
        .map(|p| (p.name.clone(), p.dims.clone(), p.ty))
        .collect();
    let (header, offsets) = encode_header(&model_metadata(s), &shapes, DEFAULT_ALIGNMENT)?;
    let mut end = 0u64;
    for (p, off) in plans.iter().zip(&offsets) {
        end = end.max(off + p.ty.bytes_for(p.elements()).unwrap_or(0));
    }
    let size = header.len() as u64 + end.next_multiple_of(DEFAULT_ALIGNMENT);

    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| err(ErrorKind::Io, format!("{}: no file name", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    /// Removes the temporary file unless it was renamed into place.
    struct Tmp<'a>(&'a Path, bool);
    impl Drop for Tmp<'_> {
        fn drop(&mut self) {
            if !self.1 {
                let _ = std::fs::remove_file(self.0);
            }
        }
    }
    let mut guard = Tmp(&tmp, false);
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| err(ErrorKind::Io, format!("creating {}: {e}", tmp.display())))?;
    f.write_all(&header).map_err(io_err("writing the header"))?;
    let t0 = Instant::now();
    let parameters: u64 = plans.iter().map(TensorPlan::elements).sum();
    if !sparse {
        let mut pos = 0u64;
        let mut done = 0u64;
        for (i, (p, &off)) in plans.iter().zip(&offsets).enumerate() {
            f.write_all(&vec![0u8; (off - pos) as usize])
                .map_err(io_err("writing padding"))?;
            pos = off + write_tensor(&mut f, seed, i as u64, p)?;
            done += p.elements();
            if progress && ((i + 1) % 10 == 0 || i + 1 == plans.len()) {
                eprintln!(
                    "[{:>4}/{}] {:<28} {:5.1}% of parameters, {:.1} s",
                    i + 1,
                    plans.len(),
                    p.name,
                    100.0 * done as f64 / parameters as f64,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        f.write_all(&vec![
            0u8;
            (end.next_multiple_of(DEFAULT_ALIGNMENT) - pos)
                as usize
        ])
        .map_err(io_err("writing padding"))?;
    }
    // Sparse: the data section stays a hole.
    f.set_len(size).map_err(io_err("setting the file length"))?;
    f.sync_all().map_err(io_err("syncing"))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| {
        err(
            ErrorKind::Io,
            format!("renaming {} to {}: {e}", tmp.display(), path.display()),
        )
    })?;
    guard.1 = true;
    Ok(ModelSummary {
        path: path.to_path_buf(),
        tensors: plans.len(),
        parameters,
        header_bytes: header.len() as u64,
        bytes: size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;

    fn decode(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; n];
        dequantize(ty, bytes, &mut y).unwrap();
        y
    }

    fn f16_at(b: &[u8], at: usize) -> f32 {
        f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
    }

    /// The step `d * sc` of each of a Q4_K block's 32-value sub-blocks.
    fn q4_k_steps(b: &[u8]) -> [f32; 8] {
        let d = f16_at(b, 0);
        let s = &b[4..16];
        std::array::from_fn(|j| {
            let sc = if j < 4 {
                s[j] & 0x3f
            } else {
                (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4)
            };
            d * f32::from(sc)
        })
    }

    /// The step `|d * sc|` of each of a Q6_K block's 16-value sub-blocks.
    fn q6_k_steps(b: &[u8]) -> [f32; 16] {
        let d = f16_at(b, 208);
        std::array::from_fn(|i| (d * f32::from(b[192 + i] as i8)).abs())
    }

    /// Relative RMS error, and a check that every value is within
    /// `slack * step` of its input (plus float rounding).
    #[track_caller]
    fn round_trip(ty: GgmlType, x: &[f32], slack: f32) -> f32 {
        let mut b = Vec::new();
        encode_values(ty, x, &mut b).unwrap();
        assert_eq!(b.len() as u64, ty.bytes_for(x.len() as u64).unwrap());
        let y = decode(ty, &b, x.len());
        let (bb, sub) = if ty == GgmlType::Q4K {
            (144, 32)
        } else {
            (210, 16)
        };
        for (blk, (xs, ys)) in x.chunks(256).zip(y.chunks(256)).enumerate() {
            let raw = &b[blk * bb..(blk + 1) * bb];
            let steps: Vec<f32> = if ty == GgmlType::Q4K {
                q4_k_steps(raw).to_vec()
            } else {
                q6_k_steps(raw).to_vec()
            };
            for (e, (&a, &v)) in xs.iter().zip(ys).enumerate() {
                assert!(v.is_finite(), "block {blk} element {e}: {v}");
                let bound = slack * steps[e / sub] * (1.0 + 1e-4) + 1e-6 * a.abs() + 1e-30;
                assert!(
                    (a - v).abs() <= bound,
                    "block {blk} element {e}: {a} decoded as {v} (step {})",
                    steps[e / sub]
                );
            }
        }
        let num: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        let den: f64 = x.iter().map(|a| f64::from(*a).powi(2)).sum();
        (num / den.max(1e-300)).sqrt() as f32
    }

    fn gaussian(n: usize, std: f32, seed: u64) -> Vec<f32> {
        let mut v = vec![0f32; n];
        Rng::stream(&[seed]).fill_gaussian(&mut v);
        v.iter_mut().for_each(|x| *x *= std);
        v
    }

    #[test]
    fn gaussian_round_trip() {
        let x = gaussian(256 * 512, 0.02, 1);
        let e4 = round_trip(GgmlType::Q4K, &x, 0.5);
        let e6 = round_trip(GgmlType::Q6K, &x, 1.0);
        eprintln!("gaussian: Q4_K rel RMS {e4:.4}, Q6_K rel RMS {e6:.4}");
        assert!(e4 < 0.1, "Q4_K {e4}");
        assert!(e6 < 0.03, "Q6_K {e6}");
    }

    #[test]
    fn heavy_tailed_round_trip() {
        // Outlier channels and elements, as the model generator makes them
        // (with many more outlier elements than usual).
        let d_in = 1024;
        let profile = matrix_profile(7, 3, d_in);
        let mut x = vec![0f32; d_in * 128];
        matrix_values(&mut Rng::stream(&[7, 3, 0]), &profile, &mut x);
        let mut rng = Rng::stream(&[8]);
        for v in x.iter_mut() {
            if rng.uniform() < 0.01 {
                *v *= 5.0 + 15.0 * rng.uniform();
            }
        }
        let e4 = round_trip(GgmlType::Q4K, &x, 0.5);
        let e6 = round_trip(GgmlType::Q6K, &x, 1.0);
        eprintln!("heavy-tailed: Q4_K rel RMS {e4:.4}, Q6_K rel RMS {e6:.4}");
        // A sub-block with an outlier has a coarser step for the rest.
        assert!(e4 < 0.15, "Q4_K {e4}");
        assert!(e6 < 0.045, "Q6_K {e6}");
    }

    #[test]
    fn zeros_encode_to_zero_scales() {
        let x = vec![0f32; 512];
        let mut b = Vec::new();
        quantize_q4_k(&x, &mut b);
        assert!(b.iter().all(|&v| v == 0), "Q4_K zeros are zero bytes");
        assert!(decode(GgmlType::Q4K, &b, 512).iter().all(|&v| v == 0.0));
        let mut b = Vec::new();
        quantize_q6_k(&x, &mut b);
        for blk in b.chunks(210) {
            assert_eq!(&blk[192..], &[0u8; 18], "Q6_K scales and d are 0");
        }
        assert!(decode(GgmlType::Q6K, &b, 512).iter().all(|&v| v == 0.0));
        // NaN and infinity count as 0.
        let x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0].repeat(64);
        for ty in [GgmlType::Q4K, GgmlType::Q6K] {
            let mut b = Vec::new();
            encode_values(ty, &x, &mut b).unwrap();
            assert!(decode(ty, &b, 256).iter().all(|&v| v == 0.0), "{ty}");
        }
    }

    #[test]
    fn constant_and_extreme_blocks() {
        for c in [0.7f32, -0.3, 1e-3, -2.5e-6, 1e-30, 100.0, -4096.0] {
            let x = vec![c; 256];
            for (ty, slack) in [(GgmlType::Q4K, 0.5), (GgmlType::Q6K, 1.0)] {
                round_trip(ty, &x, slack);
                let mut b = Vec::new();
                encode_values(ty, &x, &mut b).unwrap();
                let y = decode(ty, &b, 256);
                let rel = ((y[0] - c) / c).abs();
                // Within the f16 precision of the scales unless c is below
                // the smallest step.
                assert!(rel < 0.02 || c.abs() < 1e-6, "{ty} {c} -> {}", y[0]);
            }
        }
        // Beyond the scales' range: clipped, never inf or NaN.
        let mut x = gaussian(256, 1e9, 2);
        x[5] = f32::MAX;
        x[6] = -f32::MAX;
        for ty in [GgmlType::Q4K, GgmlType::Q6K] {
            let mut b = Vec::new();
            encode_values(ty, &x, &mut b).unwrap();
            assert!(decode(ty, &b, 256).iter().all(|v| v.is_finite()), "{ty}");
        }
    }

    #[test]
    fn q4_k_exact_layout() {
        // Sub-block j: step (63 - 4j)/64, offset m_j/32 with m_j = 63 - 5j,
        // codes q(e) = (7e + j) % 16 with both 0 and 15 present. Every
        // quantity is an exact binary fraction, so the scales come out as
        // d = 1/64, sc_j = 63 - 4j, dmin = 1/32, m_j, and decoding is exact.
        let sc: [u8; 8] = std::array::from_fn(|j| 63 - 4 * j as u8);
        let m: [u8; 8] = std::array::from_fn(|j| 63 - 5 * j as u8);
        let code = |e: usize| {
            let l = e % 32;
            match l {
                0 => 0,
                1 => 15,
                _ => ((7 * e + e / 32) % 16) as u8,
            }
        };
        let x: Vec<f32> = (0..256)
            .map(|e| {
                let j = e / 32;
                f32::from(sc[j]) / 64.0 * f32::from(code(e)) - f32::from(m[j]) / 32.0
            })
            .collect();
        let mut b = Vec::new();
        quantize_q4_k(&x, &mut b);
        assert_eq!(f16_at(&b, 0), 1.0 / 64.0);
        assert_eq!(f16_at(&b, 2), 1.0 / 32.0);
        for j in 0..4 {
            assert_eq!(b[4 + j] & 0x3f, sc[j]);
            assert_eq!(b[8 + j] & 0x3f, m[j]);
            assert_eq!(b[4 + j] >> 6, sc[j + 4] >> 4);
            assert_eq!(b[8 + j] >> 6, m[j + 4] >> 4);
            assert_eq!(b[12 + j], (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4));
        }
        for c in 0..4 {
            for l in 0..32 {
                let want = code(c * 64 + l) | (code(c * 64 + 32 + l) << 4);
                assert_eq!(b[16 + c * 32 + l], want, "code byte {}", c * 32 + l);
            }
        }
        assert_eq!(decode(GgmlType::Q4K, &b, 256), x);
    }

    #[test]
    fn q6_k_exact_layout() {
        // Sub-block i: scale sc_i (signed, one of magnitude 127) times
        // d = 1/256; codes c(e) with 0 (-32, the extreme) present; the other
        // codes up to 63.
        let sc: [i8; 16] = std::array::from_fn(|i| {
            let m = 127 - 7 * i as i8;
            if i % 3 == 1 { -m } else { m }
        });
        let code = |e: usize| -> u8 {
            if e.is_multiple_of(16) {
                0
            } else {
                ((5 * e + e / 16) % 64) as u8
            }
        };
        let x: Vec<f32> = (0..256)
            .map(|e| f32::from(sc[e / 16]) / 256.0 * (f32::from(code(e)) - 32.0))
            .collect();
        let mut b = Vec::new();
        quantize_q6_k(&x, &mut b);
        assert_eq!(f16_at(&b, 208), 1.0 / 256.0);
        assert_eq!(&b[192..208], &sc.map(|v| v as u8));
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let c = code(h * 128 + s * 32 + l);
                    let lo = (b[h * 64 + (s % 2) * 32 + l] >> (4 * (s / 2))) & 0x0f;
                    let hi = (b[128 + h * 32 + l] >> (2 * s)) & 3;
                    assert_eq!(lo | (hi << 4), c, "element {}", h * 128 + s * 32 + l);
                }
            }
        }
        assert_eq!(decode(GgmlType::Q6K, &b, 256), x);
    }

    #[test]
    fn values_do_not_depend_on_threads() {
        let plan = TensorPlan {
            name: "w".into(),
            dims: vec![256, 9000], // 3 chunks, the last one short
            ty: GgmlType::Q4K,
            kind: ValueKind::Matrix,
        };
        assert_eq!(plan.chunks(), 3);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut out = Vec::new();
                write_tensor(&mut out, 42, 5, &plan).unwrap();
                out
            })
        };
        let one = run(1);
        assert_eq!(
            one.len() as u64,
            GgmlType::Q4K.bytes_for(256 * 9000).unwrap()
        );
        assert_eq!(one, run(3));
        let mut other = Vec::new();
        write_tensor(&mut other, 43, 5, &plan).unwrap();
        assert_ne!(one, other, "the seed matters");
    }

    #[test]
    fn matrix_statistics() {
        let d_in = 2048;
        let profile = matrix_profile(1, 2, d_in);
        let outliers = profile
            .iter()
            .filter(|&&s| s > 2.5 * profile[0].min(profile[1]))
            .count();
        assert!((5..60).contains(&outliers), "{outliers} outlier channels");
        let mut x = vec![0f32; d_in * 512];
        matrix_values(&mut Rng::stream(&[1]), &profile, &mut x);
        let n_big = x
            .iter()
            .enumerate()
            .filter(|(i, v)| v.abs() > 4.9 * profile[i % d_in])
            .count();
        let expect = (x.len() as f64 * OUTLIER_ELEMENTS) as usize;
        assert!(
            n_big > expect / 2 && n_big < expect * 2,
            "{n_big} vs {expect}"
        );
        let std = (x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
        let base = 1.0 / (d_in as f64).sqrt();
        assert!(std > 0.4 * base && std < 3.0 * base, "std {std}");
    }

    #[test]
    fn llama_cpp_q4_k_m_types() {
        let s = model_shape("qwen2.5-7b").unwrap();
        let t = model_tensors(&s);
        assert_eq!(t.len(), 339);
        let more: Vec<u64> = (0..28).filter(|&i| use_more_bits(i, 28)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        let ty = |n: &str| t.iter().find(|p| p.name == n).unwrap().ty;
        assert_eq!(ty("blk.5.attn_v.weight"), GgmlType::Q6K);
        assert_eq!(ty("blk.6.ffn_down.weight"), GgmlType::Q4K);
        assert_eq!(ty("output.weight"), GgmlType::Q6K);
        assert_eq!(ty("token_embd.weight"), GgmlType::Q4K);
        assert_eq!(ty("blk.0.attn_q.bias"), GgmlType::F32);
        let params: u64 = t.iter().map(TensorPlan::elements).sum();
        assert_eq!(params, 7_615_616_512);
        let l = model_shape("llama3-70b").unwrap();
        let t = model_tensors(&l);
        assert_eq!(t.len(), 1 + 80 * 9 + 2);
        assert_eq!(
            t.iter().map(TensorPlan::elements).sum::<u64>(),
            70_553_706_496
        );
    }

    #[test]
    fn vocab_tokenizes_english() {
        use crate::probe::tokenizer::Tokenizer;
        let s = model_shape("tiny").unwrap();
        let md = model_metadata(&s);
        let v = synth_vocab(&s.tokenizer, s.vocab);
        assert_eq!(v.tokens.len(), 1000);
        assert_eq!(v.merges.len(), 741);
        let tok = Tokenizer::from_metadata(&md).unwrap();
        let text = "The capital of France is";
        let ids = tok.encode(text, true, true);
        assert!(ids.len() <= 6, "{ids:?}");
        assert_eq!(tok.decode(&ids), text);
        let odd = "naïve café — 東京 🎉 x=3.14\n";
        assert_eq!(tok.decode(&tok.encode(odd, false, false)), odd);
        assert_eq!(tok.encode("<|im_end|>", true, false), [999]);
    }

    #[test]
    fn tiny_model_file() {
        use crate::format::gguf::GgufFile;
        use crate::source::SourceFile;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let s = model_shape("tiny").unwrap();
        let sum = write_model(&path, &s, 1, false, false, false).unwrap();
        assert!(write_model(&path, &s, 1, false, false, false).is_err());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), sum.bytes);
        let src = SourceFile::open(&path).unwrap();
        let g = GgufFile::read(&src).unwrap();
        assert_eq!(g.tensors.len(), sum.tensors);
        let again = dir.path().join("again.gguf");
        write_model(&again, &s, 1, false, false, false).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&again).unwrap()
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            2,
            "no temp files left"
        );
    }
}
