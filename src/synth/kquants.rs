//! Q4_K and Q6_K quantizers: the simple non-iterative kind.

use half::f16;

use crate::quant::QK_K;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::quant::dequantize;
    use crate::synth::{Rng, encode_values, matrix_profile, matrix_values};

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
}
