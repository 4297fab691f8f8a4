//! Deterministic synthetic tensors for the demo model and the benchmarks:
//! ggml blocks and sketch factors from a seeded generator. Not a quantizer
//! of real weights (the encoders issue owns those).

use crate::format::sk32::Sketch;
use crate::quant::GgmlType;

/// xorshift64: fast, seedable, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
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
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// ggml blocks for `n` elements of `ty` (n a multiple of the block size).
/// Float, Q8_0, Q4_x and Q5_x blocks quantize normal values of standard
/// deviation `std` with max-abs (or min/max) scales; k-quant blocks get
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
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            let bb = ty.block_bytes() as usize;
            let (d_at, dmin_at) = match ty {
                GgmlType::Q2K => (80, Some(82)),
                GgmlType::Q3K => (108, None),
                GgmlType::Q6K => (208, None),
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
