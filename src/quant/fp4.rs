//! The 4-bit float types MXFP4 (32 elements, one E8M0 power-of-two scale)
//! and NVFP4 (64 elements, four unsigned E4M3 scales of 16 each). Codes
//! are E2M1 values, doubled so they are integers; the scales are halved to
//! match (as ggml and gguf-py do). Every scale is an exact f32 and every
//! value one product `d * code`.

use super::float::split;
use super::{GgmlType, Kernels, blocks};

/// E2M1 values times two, by 4-bit code (sign in bit 3; -0 reads as 0).
const E2M1_DOUBLED: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
];

/// Half the E8M0 scale `2^(e - 127)`, as bits: `2^(e - 128)`, subnormal for
/// e < 2. Finite for every byte (e = 255 gives 2^127).
#[inline]
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// Half the unsigned E4M3 scale of byte `x` (4-bit exponent, bias 7, 3-bit
/// mantissa, bit 7 ignored), as gguf-py decodes it: 0 for 0x00 and 0x7f
/// (E4M3's NaN), `man * 2^-10` for exponent 0, else
/// `(8 + man) * 2^(exp - 11)`; all exact in f32.
#[inline]
fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = i32::from((x >> 3) & 0x0f);
    let man = f32::from(x & 0x07);
    if exp == 0 {
        man * (1.0 / 1024.0)
    } else {
        // exp - 11 is in -10..=4: a normal power of two.
        (8.0 + man) * f32::from_bits(((127 + exp - 11) as u32) << 23)
    }
}

/// 2 * N values `d * E2M1_DOUBLED[code]` from N bytes: element `j` from the
/// low nibble of byte `j`, element `N + j` from its high nibble.
#[inline]
fn fp4_pairs<const N: usize>(d: f32, qs: &[u8; N], y: &mut [f32]) {
    let (lo, hi) = y.split_at_mut(N);
    for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
        *lo = d * E2M1_DOUBLED[usize::from(q & 0x0f)];
        *hi = d * E2M1_DOUBLED[usize::from(q >> 4)];
    }
}

/// MXFP4, 17 bytes: the E8M0 scale byte, then 16 bytes of code nibbles.
pub(super) fn mxfp4(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<17, 32>(src, out) {
        let (e, qs): (&[u8; 1], &[u8; 16]) = split(b);
        fp4_pairs(e8m0_half(e[0]), qs, y);
    }
}

/// NVFP4, 36 bytes: four UE4M3 scale bytes, then per 16 elements 8 bytes
/// of code nibbles.
pub(super) fn nvfp4(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<36, 64>(src, out) {
        let (scales, qs): (&[u8; 4], &[u8; 32]) = split(b);
        let sub = qs.as_chunks::<8>().0.iter().zip(y.as_chunks_mut::<16>().0);
        for ((qs, y), &s) in sub.zip(scales) {
            fp4_pairs(ue4m3_half(s), qs, y);
        }
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[(GgmlType::Mxfp4, mxfp4), (GgmlType::Nvfp4, nvfp4)];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_halves_are_powers_of_two() {
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(255), 2f32.powi(127));
        assert_eq!(e8m0_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
    }

    #[test]
    fn ue4m3_halves() {
        assert_eq!(ue4m3_half(0x38), 0.5); // exp 7, man 0: 1.0
        assert_eq!(ue4m3_half(0x01), 1.0 / 1024.0);
        assert_eq!(ue4m3_half(0x7e), 224.0); // 448 / 2
        assert_eq!(ue4m3_half(0x7f), 0.0);
        assert_eq!(ue4m3_half(0xff), 240.0); // bit 7 ignored, no NaN check
        assert_eq!(ue4m3_half(0x80), 0.0);
    }
}
