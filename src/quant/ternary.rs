//! The ternary types TQ1_0 and TQ2_0: 256-element blocks of codes in
//! {-1, 0, 1} (TQ2_0's two-bit codes also allow 2) and one f16 scale,
//! decoded as `d * q` (exact: q is an integer of at most two bits).

use super::float::{f16_le_at, split};
use super::{GgmlType, Kernels, QK_K, blocks};

/// Powers of three that move base-3 digit `n` of a packed byte to the top.
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// The trit selected by `pow3` from a TQ1_0 byte holding five (or four)
/// base-3 digits in fixed point: multiplying by `pow3` (mod 256) shifts the
/// digit wanted to the top, and `* 3 >> 8` reads it (0..=2), minus one.
#[inline]
fn trit(q: u8, pow3: u8) -> f32 {
    let top = q.wrapping_mul(pow3);
    // The digit is at most 765 >> 8 = 2, so the subtraction cannot wrap;
    // wrapping_sub keeps an overflow check (profile ci) out of the loop.
    f32::from((((u16::from(top) * 3) >> 8) as i8).wrapping_sub(1))
}

/// `y[n * W + m] = d * trit(qs[m], 3^n)` for every digit `n` of `y`.
#[inline]
fn trits<const W: usize>(d: f32, qs: &[u8; W], y: &mut [f32]) {
    for (y, &p) in y.chunks_exact_mut(W).zip(&POW3) {
        for (&q, y) in qs.iter().zip(y) {
            *y = d * trit(q, p);
        }
    }
}

/// TQ1_0, 54 bytes: 48 bytes of five trits each (bytes 0..32 give
/// elements 0..160, digit n of byte m being element 32n + m; bytes 32..48
/// give elements 160..240 the same way with width 16), 4 bytes of four
/// trits (elements 240..256, width 4), f16 d.
pub(super) fn tq1_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<54, QK_K>(src, out) {
        let (qs, rest): (&[u8; 48], &[u8; 6]) = split(b);
        let (q32, q16): (&[u8; 32], &[u8; 16]) = split(qs);
        let (qh, d): (&[u8; 4], _) = split(rest);
        let d = f16_le_at(d);
        let (y0, rest) = y.split_at_mut(160);
        let (y1, y2) = rest.split_at_mut(80);
        trits(d, q32, y0);
        trits(d, q16, y1);
        trits(d, qh, y2);
    }
}

/// TQ2_0, 66 bytes: 64 bytes of four 2-bit codes (code minus one), byte
/// `32c + m` holding element `128c + 32s + m` at bits `2s`, then f16 d.
pub(super) fn tq2_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<66, QK_K>(src, out) {
        let (qs, d): (&[u8; 64], _) = split(b);
        let d = f16_le_at(d);
        let halves = qs
            .as_chunks::<32>()
            .0
            .iter()
            .zip(y.as_chunks_mut::<128>().0);
        for (qs, y) in halves {
            for (s, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                for (&q, y) in qs.iter().zip(y) {
                    *y = d * f32::from((((q >> (2 * s)) & 3) as i8).wrapping_sub(1));
                }
            }
        }
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[(GgmlType::Tq1_0, tq1_0), (GgmlType::Tq2_0, tq2_0)];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte value's trits agree with plain base-3 arithmetic on the
    /// byte's fixed-point value where that is exact (the encoder's bytes).
    #[test]
    fn trits_read_the_encoders_digits() {
        // The encoder stores ceil(v * 256 / 243) for v = sum of digit_n * 3^(4-n).
        for v in 0u16..243 {
            let q = (v * 256).div_ceil(243) as u8;
            let mut rest = v;
            for n in (0..5).rev() {
                let digit = rest % 3;
                rest /= 3;
                assert_eq!(trit(q, POW3[n]), f32::from(digit as i8 - 1), "v={v} n={n}");
            }
        }
    }
}
