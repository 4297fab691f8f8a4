//! The k-quants: 256-element super-blocks with an f16 super-scale (and an
//! f16 super-minimum for Q2_K, Q4_K and Q5_K) and small per-sub-block
//! integer scales.
//!
//! Float order follows `gguf.quants`: the sub-block scale is formed first
//! (`d * sc`, `dmin * m`), then applied: `dl * q - ml` (Q2_K, Q4_K, Q5_K) or
//! `dl * q` (Q3_K, Q6_K). All products are exact in f32 (f16 significand:
//! 11 bits, sub-block scale: at most 7, code: at most 5, so at most 23
//! bits), so the one rounding step is the final `- ml`, which must stay a
//! plain subtraction of those two terms.

use super::float::{f16_le_at, split};
use super::{GgmlType, Kernels, QK_K};

/// Q2_K, 84 bytes: 16 scale bytes (low nibble scales d, high nibble scales
/// dmin, one per 16 elements), 64 bytes of 2-bit codes, f16 d, f16 dmin.
/// Code byte `h * 32 + l` holds element `h * 128 + s * 32 + l` in bits
/// `2s..2s+2`.
struct BlockQ2K<'a> {
    scales: &'a [u8; 16],
    qs: &'a [u8; 64],
    d: f32,
    dmin: f32,
}

impl<'a> BlockQ2K<'a> {
    fn parse(b: &'a [u8; 84]) -> Self {
        let (scales, rest): (_, &[u8; 68]) = split(b);
        let (qs, dd): (_, &[u8; 4]) = split(rest);
        let (d, dmin) = split(dd);
        Self {
            scales,
            qs,
            d: f16_le_at(d),
            dmin: f16_le_at(dmin),
        }
    }
}

/// Q3_K, 110 bytes: 32 bytes of high bits (bit `b` of byte `l` belongs to
/// element `b * 32 + l`; a clear bit means the code is 4 lower), 64 bytes of
/// 2-bit codes laid out as in Q2_K, 12 bytes packing sixteen 6-bit scales
/// (offset by 32), f16 d.
struct BlockQ3K<'a> {
    hmask: &'a [u8; 32],
    qs: &'a [u8; 64],
    scales: &'a [u8; 12],
    d: f32,
}

impl<'a> BlockQ3K<'a> {
    fn parse(b: &'a [u8; 110]) -> Self {
        let (hmask, rest): (_, &[u8; 78]) = split(b);
        let (qs, rest): (_, &[u8; 14]) = split(rest);
        let (scales, d) = split(rest);
        Self {
            hmask,
            qs,
            scales,
            d: f16_le_at(d),
        }
    }

    /// Scale of sub-block `i` (16 elements): low four bits from the nibbles
    /// of bytes 0..8 (sub-blocks 0..8 in the low nibbles, 8..16 in the high
    /// ones), top two bits from bytes 8..12, two bits per sub-block.
    fn scale(&self, i: usize) -> i8 {
        let low = (self.scales[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (self.scales[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        (low | (high << 4)) as i8 - 32
    }
}

/// Q4_K, 144 bytes: f16 d, f16 dmin, 12 bytes packing eight 6-bit scales and
/// eight 6-bit minimums, 128 bytes of nibbles. Code byte `c * 32 + l` holds
/// element `c * 64 + l` (sub-block 2c) in its low nibble and element
/// `c * 64 + 32 + l` (sub-block 2c + 1) in its high nibble.
struct BlockQ4K<'a> {
    d: f32,
    dmin: f32,
    scales: &'a [u8; 12],
    qs: &'a [u8; 128],
}

impl<'a> BlockQ4K<'a> {
    fn parse(b: &'a [u8; 144]) -> Self {
        let (dd, rest): (&[u8; 4], &[u8; 140]) = split(b);
        let (d, dmin) = split(dd);
        let (scales, qs) = split(rest);
        Self {
            d: f16_le_at(d),
            dmin: f16_le_at(dmin),
            scales,
            qs,
        }
    }
}

/// Q5_K, 176 bytes: as Q4_K, with 32 bytes of fifth bits before the nibbles
/// (bit `j` of byte `l` belongs to element `l` of sub-block `j`).
struct BlockQ5K<'a> {
    d: f32,
    dmin: f32,
    scales: &'a [u8; 12],
    qh: &'a [u8; 32],
    qs: &'a [u8; 128],
}

impl<'a> BlockQ5K<'a> {
    fn parse(b: &'a [u8; 176]) -> Self {
        let (dd, rest): (&[u8; 4], &[u8; 172]) = split(b);
        let (d, dmin) = split(dd);
        let (scales, rest): (_, &[u8; 160]) = split(rest);
        let (qh, qs) = split(rest);
        Self {
            d: f16_le_at(d),
            dmin: f16_le_at(dmin),
            scales,
            qh,
            qs,
        }
    }
}

/// Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
/// sixteen signed 8-bit scales (one per 16 elements), f16 d. Codes are
/// offset by 32. Within each 128-element half `h`, element `s * 32 + l`
/// takes its low nibble from byte `h * 64 + (s % 2) * 32 + l` (low nibble
/// for s < 2, high for s >= 2) and its high bits from bits `2s..2s+2` of
/// byte `h * 32 + l` of the high parts.
struct BlockQ6K<'a> {
    ql: &'a [u8; 128],
    qh: &'a [u8; 64],
    scales: &'a [u8; 16],
    d: f32,
}

impl<'a> BlockQ6K<'a> {
    fn parse(b: &'a [u8; 210]) -> Self {
        let (ql, rest): (_, &[u8; 82]) = split(b);
        let (qh, rest): (_, &[u8; 18]) = split(rest);
        let (scales, d) = split(rest);
        Self {
            ql,
            qh,
            scales,
            d: f16_le_at(d),
        }
    }
}

/// Pairs each source super-block with its 256 output values ([`super::blocks`]).
fn blocks<'s, 'o, const B: usize>(
    src: &'s [u8],
    out: &'o mut [f32],
) -> impl Iterator<Item = (&'s [u8; B], &'o mut [f32; QK_K])> {
    super::blocks::<B, QK_K>(src, out)
}

/// The 6-bit (scale, min) pair of sub-block `j` of Q4_K and Q5_K: sub-blocks
/// 0..4 sit in the low six bits of bytes 0..4 (scales) and 4..8 (mins);
/// sub-blocks 4..8 take their low four bits from the nibbles of bytes 8..12
/// and their top two bits from the spare top bits of bytes 0..8.
fn scale_min_k4(scales: &[u8; 12], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 0x3f, scales[j + 4] & 0x3f)
    } else {
        let sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

pub(super) fn q2_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ2K::parse(b);
        for (h, (qs, y)) in
            b.qs.as_chunks::<32>()
                .0
                .iter()
                .zip(y.as_chunks_mut::<128>().0)
                .enumerate()
        {
            for (s, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                let shift = 2 * s;
                for (half, (qs, y)) in qs
                    .as_chunks::<16>()
                    .0
                    .iter()
                    .zip(y.as_chunks_mut::<16>().0)
                    .enumerate()
                {
                    let sc = b.scales[h * 8 + s * 2 + half];
                    let dl = b.d * f32::from(sc & 0x0f);
                    let ml = b.dmin * f32::from(sc >> 4);
                    for (&q, y) in qs.iter().zip(y) {
                        *y = dl * f32::from((q >> shift) & 3) - ml;
                    }
                }
            }
        }
    }
}

pub(super) fn q3_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ3K::parse(b);
        for (h, (qs, y)) in
            b.qs.as_chunks::<32>()
                .0
                .iter()
                .zip(y.as_chunks_mut::<128>().0)
                .enumerate()
        {
            for (s, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                let shift = 2 * s;
                let hbit = 4 * h + s;
                for (half, ((qs, hm), y)) in qs
                    .as_chunks::<16>()
                    .0
                    .iter()
                    .zip(b.hmask.as_chunks::<16>().0)
                    .zip(y.as_chunks_mut::<16>().0)
                    .enumerate()
                {
                    let dl = b.d * f32::from(b.scale(h * 8 + s * 2 + half));
                    for ((&q, &m), y) in qs.iter().zip(hm).zip(y) {
                        let low = ((q >> shift) & 3) as i8;
                        let minus4 = (((m >> hbit) & 1) ^ 1) << 2;
                        *y = dl * f32::from(low - minus4 as i8);
                    }
                }
            }
        }
    }
}

pub(super) fn q4_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ4K::parse(b);
        for (c, (qs, y)) in
            b.qs.as_chunks::<32>()
                .0
                .iter()
                .zip(y.as_chunks_mut::<64>().0)
                .enumerate()
        {
            for (k, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                let (sc, m) = scale_min_k4(b.scales, 2 * c + k);
                let dl = b.d * f32::from(sc);
                let ml = b.dmin * f32::from(m);
                let shift = 4 * k;
                for (&q, y) in qs.iter().zip(y) {
                    *y = dl * f32::from((q >> shift) & 0x0f) - ml;
                }
            }
        }
    }
}

pub(super) fn q5_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ5K::parse(b);
        for (c, (qs, y)) in
            b.qs.as_chunks::<32>()
                .0
                .iter()
                .zip(y.as_chunks_mut::<64>().0)
                .enumerate()
        {
            for (k, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                let j = 2 * c + k;
                let (sc, m) = scale_min_k4(b.scales, j);
                let dl = b.d * f32::from(sc);
                let ml = b.dmin * f32::from(m);
                let shift = 4 * k;
                for ((&q, &qh), y) in qs.iter().zip(b.qh).zip(y) {
                    let code = ((q >> shift) & 0x0f) | (((qh >> j) & 1) << 4);
                    *y = dl * f32::from(code) - ml;
                }
            }
        }
    }
}

pub(super) fn q6_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ6K::parse(b);
        for (h, ((ql, qh), y)) in
            b.ql.as_chunks::<64>()
                .0
                .iter()
                .zip(b.qh.as_chunks::<32>().0)
                .zip(y.as_chunks_mut::<128>().0)
                .enumerate()
        {
            let ql = ql.as_chunks::<32>().0;
            for (s, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                let low = &ql[s % 2];
                let (lshift, hshift) = (4 * (s / 2), 2 * s);
                for (half, ((ql, qh), y)) in low
                    .as_chunks::<16>()
                    .0
                    .iter()
                    .zip(qh.as_chunks::<16>().0)
                    .zip(y.as_chunks_mut::<16>().0)
                    .enumerate()
                {
                    let sc = b.scales[h * 8 + s * 2 + half] as i8;
                    let dl = b.d * f32::from(sc);
                    for ((&l, &hi), y) in ql.iter().zip(qh).zip(y) {
                        let code = ((l >> lshift) & 0x0f) | (((hi >> hshift) & 3) << 4);
                        *y = dl * f32::from(code as i8 - 32);
                    }
                }
            }
        }
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[
    (GgmlType::Q2K, q2_k),
    (GgmlType::Q3K, q3_k),
    (GgmlType::Q4K, q4_k),
    (GgmlType::Q5K, q5_k),
    (GgmlType::Q6K, q6_k),
];

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: [u8; 2] = [0x00, 0x3c]; // f16 1.0
    const HALF: [u8; 2] = [0x00, 0x38]; // f16 0.5
    const QUARTER: [u8; 2] = [0x00, 0x34]; // f16 0.25

    fn decode(f: fn(&[u8], &mut [f32]), block: &[u8]) -> Vec<f32> {
        let mut out = vec![f32::NAN; QK_K];
        f(block, &mut out);
        out
    }

    /// Packs eight 6-bit scales and mins the way Q4_K/Q5_K store them.
    fn pack_k4(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
        let mut p = [0u8; 12];
        for j in 0..4 {
            p[j] = (sc[j] & 0x3f) | ((sc[j + 4] >> 4) << 6);
            p[j + 4] = (m[j] & 0x3f) | ((m[j + 4] >> 4) << 6);
            p[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
        }
        p
    }

    #[test]
    fn k4_scales_unpack() {
        let sc = [1, 2, 3, 63, 17, 33, 48, 63];
        let m = [63, 0, 5, 9, 62, 16, 1, 47];
        let p = pack_k4(sc, m);
        for j in 0..8 {
            assert_eq!(scale_min_k4(&p, j), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn q2_k_layout_and_formula() {
        // Sub-block g has scale nibble (g % 16) and min nibble 1; every
        // element's code is its shift index s, so element h*128 + s*32 + l
        // decodes to 0.5 * (g % 16) * s - 0.25.
        let scales: [u8; 16] = std::array::from_fn(|g| 0x10 | g as u8);
        let qs = [0b1110_0100u8; 64];
        let mut b = scales.to_vec();
        b.extend(qs);
        b.extend(HALF);
        b.extend(QUARTER);
        let y = decode(q2_k, &b);
        for (e, y) in y.iter().enumerate() {
            let g = e / 16;
            let s = (e % 128) / 32;
            assert_eq!(*y, 0.5 * g as f32 * s as f32 - 0.25, "element {e}");
        }
    }

    #[test]
    fn q3_k_layout_and_formula() {
        // Scales: sub-block i gets 6-bit value 32 + i - 8 (so i - 8 signed).
        let want: [u8; 16] = std::array::from_fn(|i| (24 + i) as u8);
        let mut scales = [0u8; 12];
        for (i, &v) in want.iter().enumerate() {
            scales[i % 8] |= (v & 0x0f) << (4 * (i / 8));
            scales[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
        }
        // Low codes: element h*128 + s*32 + l has code 3 - s (byte value
        // 0b00_01_10_11). High bit set only for high-bit plane 5, i.e.
        // elements 160..192, which therefore have no -4.
        let qs = [0b0001_1011u8; 64];
        let hmask = [1u8 << 5; 32];
        let mut b = hmask.to_vec();
        b.extend(qs);
        b.extend(scales);
        b.extend(HALF);
        let y = decode(q3_k, &b);
        for (e, y) in y.iter().enumerate() {
            let i = e / 16;
            let s = (e % 128) / 32;
            let q = 3 - s as i32 - if (160..192).contains(&e) { 0 } else { 4 };
            let dl = 0.5 * (i as f32 - 8.0);
            assert_eq!(*y, dl * q as f32, "element {e}");
        }
    }

    #[test]
    fn q4_k_layout_and_formula() {
        let sc = [1, 2, 3, 4, 5, 6, 7, 63];
        let m = [0, 1, 2, 3, 4, 5, 6, 7];
        // Byte c*32 + l: low nibble l % 16, high nibble 15 - l % 16.
        let qs: [u8; 128] = std::array::from_fn(|i| {
            let l = (i % 16) as u8;
            l | ((15 - l) << 4)
        });
        let mut b = HALF.to_vec();
        b.extend(QUARTER);
        b.extend(pack_k4(sc, m));
        b.extend(qs);
        let y = decode(q4_k, &b);
        for (e, y) in y.iter().enumerate() {
            let j = e / 32;
            let l = e % 16;
            let q = if j % 2 == 0 { l } else { 15 - l };
            let want = 0.5 * sc[j] as f32 * q as f32 - 0.25 * m[j] as f32;
            assert_eq!(*y, want, "element {e}");
        }
    }

    #[test]
    fn q5_k_layout_and_formula() {
        let sc = [2; 8];
        let m = [1; 8];
        // Fifth bit j of byte l is set when l == j, so element l of sub-block
        // j gets +16 exactly when l == j.
        let qh: [u8; 32] = std::array::from_fn(|l| if l < 8 { 1 << l } else { 0 });
        let qs = [0x53u8; 128];
        let mut b = ONE.to_vec();
        b.extend(HALF);
        b.extend(pack_k4(sc, m));
        b.extend(qh);
        b.extend(qs);
        let y = decode(q5_k, &b);
        for (e, y) in y.iter().enumerate() {
            let j = e / 32;
            let l = e % 32;
            let low = if j % 2 == 0 { 3 } else { 5 };
            let q = low + if l == j { 16 } else { 0 };
            assert_eq!(*y, 2.0 * q as f32 - 0.5, "element {e}");
        }
    }

    #[test]
    fn q6_k_layout_and_formula() {
        // Low nibbles: byte index as code (mod 16); high parts: bits 2s..2s+2
        // hold s; scales: sub-block i has scale i - 8.
        let ql: [u8; 128] = std::array::from_fn(|i| ((i % 16) as u8) * 0x11);
        let qh = [0b1110_0100u8; 64];
        let scales: [u8; 16] = std::array::from_fn(|i| (i as i8 - 8) as u8);
        let mut b = ql.to_vec();
        b.extend(qh);
        b.extend(scales);
        b.extend(QUARTER);
        let y = decode(q6_k, &b);
        for (e, y) in y.iter().enumerate() {
            let s = (e % 128) / 32;
            let l = e % 32;
            let code = (l % 16) as i32 | ((s as i32) << 4);
            let dl = 0.25 * (e / 16) as f32 - 2.0;
            assert_eq!(*y, dl * (code - 32) as f32, "element {e}");
        }
    }

    #[test]
    fn q6_k_extreme_codes() {
        let mut b = vec![0xffu8; 128];
        b.extend([0xff; 64]);
        b.extend([0x80u8; 16]); // scale -128
        b.extend(ONE);
        let y = decode(q6_k, &b);
        assert!(y.iter().all(|&v| v == -128.0 * 31.0));
        let mut b = vec![0u8; 192];
        b.extend([0x7fu8; 16]);
        b.extend(ONE);
        let y = decode(q6_k, &b);
        assert!(y.iter().all(|&v| v == 127.0 * -32.0));
    }
}
