//! The original ggml block formats: 32 elements per block, one f16 scale
//! (plus an f16 minimum for the `_1` variants).
//!
//! Float order follows `gguf.quants`: `d * (q - offset)` for the symmetric
//! types, `(d * q) + m` for the `_1` types and `x * d` for Q8_0. Every
//! product is exact in f32 (an 11-bit f16 significand times a code of at
//! most 8 bits), so the one rounding step is the `+ m`; it must stay a plain
//! add of those two terms (no precomputed `m / d` or similar rewrites).

use super::float::{f16_le_at, split};
use super::{GgmlType, Kernels};

const QK: usize = 32;

/// Q4_0, 18 bytes: f16 d, then 16 bytes of nibbles. Byte j holds element j
/// in its low nibble and element j + 16 in its high nibble.
struct BlockQ4_0<'a> {
    d: f32,
    qs: &'a [u8; 16],
}

impl<'a> BlockQ4_0<'a> {
    fn parse(b: &'a [u8; 18]) -> Self {
        let (d, qs) = split(b);
        Self {
            d: f16_le_at(d),
            qs,
        }
    }
}

/// Q4_1, 20 bytes: f16 d, f16 m, then nibbles laid out as in Q4_0.
struct BlockQ4_1<'a> {
    d: f32,
    m: f32,
    qs: &'a [u8; 16],
}

impl<'a> BlockQ4_1<'a> {
    fn parse(b: &'a [u8; 20]) -> Self {
        let (dm, qs): (&[u8; 4], _) = split(b);
        let (d, m) = split(dm);
        Self {
            d: f16_le_at(d),
            m: f16_le_at(m),
            qs,
        }
    }
}

/// Q5_0, 22 bytes: f16 d, a little-endian u32 whose bit i is the fifth bit
/// of element i, then the low four bits laid out as in Q4_0.
struct BlockQ5_0<'a> {
    d: f32,
    qh: u32,
    qs: &'a [u8; 16],
}

impl<'a> BlockQ5_0<'a> {
    fn parse(b: &'a [u8; 22]) -> Self {
        let (d, rest): (_, &[u8; 20]) = split(b);
        let (qh, qs) = split(rest);
        Self {
            d: f16_le_at(d),
            qh: u32::from_le_bytes(*qh),
            qs,
        }
    }
}

/// Q5_1, 24 bytes: f16 d, f16 m, u32 high bits, nibbles (as Q5_0).
struct BlockQ5_1<'a> {
    d: f32,
    m: f32,
    qh: u32,
    qs: &'a [u8; 16],
}

impl<'a> BlockQ5_1<'a> {
    fn parse(b: &'a [u8; 24]) -> Self {
        let (dm, rest): (&[u8; 4], &[u8; 20]) = split(b);
        let (d, m) = split(dm);
        let (qh, qs) = split(rest);
        Self {
            d: f16_le_at(d),
            m: f16_le_at(m),
            qh: u32::from_le_bytes(*qh),
            qs,
        }
    }
}

/// Q8_0, 34 bytes: f16 d, then 32 signed bytes.
struct BlockQ8_0<'a> {
    d: f32,
    qs: &'a [u8; 32],
}

impl<'a> BlockQ8_0<'a> {
    fn parse(b: &'a [u8; 34]) -> Self {
        let (d, qs) = split(b);
        Self {
            d: f16_le_at(d),
            qs,
        }
    }
}

/// Pairs each source block with its 32 output values ([`super::blocks`]).
fn blocks<'s, 'o, const B: usize>(
    src: &'s [u8],
    out: &'o mut [f32],
) -> impl Iterator<Item = (&'s [u8; B], &'o mut [f32; QK])> {
    super::blocks::<B, QK>(src, out)
}

/// The two 16-element halves of a block's output, numbered `k`: half `k`
/// takes its codes from nibble `k` (bits `4k..4k+4`) of the 16 code bytes.
fn halves(y: &mut [f32; QK]) -> impl Iterator<Item = (usize, &mut [f32; 16])> {
    y.as_chunks_mut::<16>().0.iter_mut().enumerate()
}

pub(super) fn q4_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ4_0::parse(b);
        for (k, y) in halves(y) {
            let shift = 4 * k;
            for (&q, y) in b.qs.iter().zip(y) {
                *y = b.d * f32::from(i16::from((q >> shift) & 0x0f) - 8);
            }
        }
    }
}

pub(super) fn q4_1(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ4_1::parse(b);
        for (k, y) in halves(y) {
            let shift = 4 * k;
            for (&q, y) in b.qs.iter().zip(y) {
                *y = b.d * f32::from((q >> shift) & 0x0f) + b.m;
            }
        }
    }
}

/// The 5-bit code of element `16 * k + j`: its nibble plus bit `16 * k + j`
/// of `qh` as the fifth bit. Testing against a per-lane constant mask (rather
/// than shifting by a per-lane amount) keeps the loop vectorizable.
#[inline]
fn five_bit(q: u8, qh: u32, k: usize, j: usize) -> u8 {
    let fifth = if qh & (1 << (16 * k + j)) != 0 { 16 } else { 0 };
    ((q >> (4 * k)) & 0x0f) | fifth
}

pub(super) fn q5_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ5_0::parse(b);
        for (k, y) in halves(y) {
            for (j, (&q, y)) in b.qs.iter().zip(y).enumerate() {
                *y = b.d * f32::from(i16::from(five_bit(q, b.qh, k, j)) - 16);
            }
        }
    }
}

pub(super) fn q5_1(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ5_1::parse(b);
        for (k, y) in halves(y) {
            for (j, (&q, y)) in b.qs.iter().zip(y).enumerate() {
                *y = b.d * f32::from(five_bit(q, b.qh, k, j)) + b.m;
            }
        }
    }
}

pub(super) fn q8_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks(src, out) {
        let b = BlockQ8_0::parse(b);
        for (&q, y) in b.qs.iter().zip(y) {
            *y = f32::from(q as i8) * b.d;
        }
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[
    (GgmlType::Q4_0, q4_0),
    (GgmlType::Q4_1, q4_1),
    (GgmlType::Q5_0, q5_0),
    (GgmlType::Q5_1, q5_1),
    (GgmlType::Q8_0, q8_0),
];

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: [u8; 2] = [0x00, 0x3c]; // f16 1.0
    const HALF: [u8; 2] = [0x00, 0x38]; // f16 0.5
    const MINUS_TWO: [u8; 2] = [0x00, 0xc0]; // f16 -2.0

    /// Nibbles such that element i has code i % 16.
    fn ramp_nibbles() -> [u8; 16] {
        std::array::from_fn(|j| (j as u8 & 0x0f) | (((j as u8 + 16) & 0x0f) << 4))
    }

    fn decode(f: fn(&[u8], &mut [f32]), block: &[u8]) -> [f32; 32] {
        let mut out = [f32::NAN; 32];
        f(block, &mut out);
        out
    }

    #[test]
    fn q4_0_is_d_times_code_minus_8() {
        let mut b = HALF.to_vec();
        b.extend(ramp_nibbles());
        let y = decode(q4_0, &b);
        for (i, y) in y.iter().enumerate() {
            assert_eq!(*y, 0.5 * ((i % 16) as f32 - 8.0), "element {i}");
        }
    }

    #[test]
    fn q4_0_low_nibbles_come_first() {
        let mut b = ONE.to_vec();
        b.extend([0xf0; 16]);
        let y = decode(q4_0, &b);
        assert!(y[..16].iter().all(|&v| v == -8.0));
        assert!(y[16..].iter().all(|&v| v == 7.0));
    }

    #[test]
    fn q4_1_adds_the_minimum() {
        let mut b = HALF.to_vec();
        b.extend(MINUS_TWO);
        b.extend(ramp_nibbles());
        let y = decode(q4_1, &b);
        for (i, y) in y.iter().enumerate() {
            assert_eq!(*y, 0.5 * (i % 16) as f32 - 2.0, "element {i}");
        }
    }

    #[test]
    fn q5_0_takes_the_fifth_bit_from_qh() {
        let mut b = ONE.to_vec();
        // Fifth bit set for elements 1 and 17 (bits 1 and 17 of the u32).
        b.extend(0x0002_0002u32.to_le_bytes());
        b.extend([0u8; 16]);
        let y = decode(q5_0, &b);
        for (i, y) in y.iter().enumerate() {
            let code = if i == 1 || i == 17 { 16.0 } else { 0.0 };
            assert_eq!(*y, code - 16.0, "element {i}");
        }
    }

    #[test]
    fn q5_1_full_range() {
        let mut b = HALF.to_vec();
        b.extend(ONE);
        b.extend(0xffff_0000u32.to_le_bytes());
        b.extend([0xff; 16]);
        let y = decode(q5_1, &b);
        assert!(y[..16].iter().all(|&v| v == 0.5 * 15.0 + 1.0));
        assert!(y[16..].iter().all(|&v| v == 0.5 * 31.0 + 1.0));
    }

    #[test]
    fn q8_0_codes_are_signed() {
        let mut b = MINUS_TWO.to_vec();
        b.extend((0..32).map(|i: i32| ((i - 16) * 8) as i8 as u8));
        let y = decode(q8_0, &b);
        for (i, y) in y.iter().enumerate() {
            assert_eq!(*y, ((i as i32 - 16) * 8) as f32 * -2.0, "element {i}");
        }
        let mut b = ONE.to_vec();
        b.extend([0x80, 0x7f]);
        b.extend([0; 30]);
        let y = decode(q8_0, &b);
        assert_eq!((y[0], y[1], y[2]), (-128.0, 127.0, 0.0));
    }

    #[test]
    fn special_scales_decode_like_gguf_py() {
        // An infinite scale times a nonzero code is infinite; a NaN scale
        // propagates (quieted by the multiply, payload kept).
        let mut b = vec![0x00, 0x7c];
        b.extend([0x11; 16]);
        let y = decode(q4_0, &b);
        assert!(y.iter().all(|&v| v == f32::NEG_INFINITY));
        let mut b = vec![0x01, 0x7c];
        b.extend([5u8; 32]);
        let y = decode(q8_0, &b);
        assert!(y.iter().all(|v| v.to_bits() == 0x7fc0_2000));
    }

    #[test]
    fn several_blocks_decode_in_order() {
        let mut src = Vec::new();
        for d in [ONE, HALF, MINUS_TWO] {
            src.extend(d);
            src.extend([0x99; 16]);
        }
        let mut out = vec![0f32; 96];
        q4_0(&src, &mut out);
        assert!(out[..32].iter().all(|&v| v == 1.0));
        assert!(out[32..64].iter().all(|&v| v == 0.5));
        assert!(out[64..].iter().all(|&v| v == -2.0));
    }
}
