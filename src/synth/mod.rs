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

mod kquants;
mod model;
mod vocab;

pub use kquants::{quantize_q4_k, quantize_q6_k};
pub use model::*;
pub use vocab::{SynthVocab, TokenizerShape, synth_vocab};

use half::f16;

use crate::format::sk32::Sketch;
use crate::quant::GgmlType;

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
        // Types this generator has no writer for get all-zero blocks (IQ and
        // ternary grids decode them to zeros; the point is a file of the
        // right shape, not realistic values).
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
