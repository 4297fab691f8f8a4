//! Plain float element types (f64, f32, f16, bf16) and the byte-layout helpers
//! shared by the block parsers.
//!
//! The f16 conversion follows numpy's `astype(np.float32)`, which is what
//! `gguf.quants.dequantize` uses for every f16 scale: exact for all finite
//! values (subnormals included), and NaN payloads are shifted into place
//! without setting the quiet bit, so a signalling NaN stays signalling.
//! That is why this does not go through the `half` crate: with F16C hardware
//! it converts with `vcvtph2ps`, which quiets signalling NaNs.

use super::{GgmlType, Kernels};

/// f32 value of the IEEE binary16 number with bits `h`.
#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let exp = h & 0x7c00;
    let man = h & 0x03ff;
    // Rebias the exponent from 15 to 127; the mantissa widens from 10 to 23
    // bits by appending zeros.
    let normal = ((h & 0x7fff) << 13) + ((127 - 15) << 23);
    // Inf and NaN keep their payload bit for bit (no quiet bit forced).
    let inf_nan = 0x7f80_0000 | (man << 13);
    // A subnormal is man * 2^-24; that product is a normal f32, computed
    // exactly (an integer below 2^10 times a power of two).
    let subnormal = (man as i32 as f32 * SUBNORMAL_UNIT).to_bits();
    let magnitude = if exp == 0x7c00 {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(sign | magnitude)
}

/// 2^-24, the value of the smallest f16 subnormal.
const SUBNORMAL_UNIT: f32 = 1.0 / 16_777_216.0;

/// f32 value of the bfloat16 number with bits `b` (the high half of an f32).
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 value of a little-endian f16 stored in two bytes: a block's scale.
///
/// Looked up in a table: one load per block instead of the select chain of
/// `f16_bits_to_f32`, which doubles the throughput of the 32-element formats
/// (the bulk `f16_le` path vectorizes the arithmetic instead).
#[inline]
pub(super) fn f16_le_at(b: &[u8; 2]) -> f32 {
    f16_table()[usize::from(u16::from_le_bytes(*b))]
}

/// Every f16 bit pattern's f32 value (256 KiB), built once.
fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (h, v) in t.iter_mut().enumerate() {
            *v = f16_bits_to_f32(h as u16);
        }
        t
    })
}

/// Splits a fixed-size array into its first `A` and last `B` bytes.
/// `A + B == N` is checked at compile time, so the conversions below cannot
/// fail; the parsers use this to name the fields of a block.
#[inline]
pub(super) fn split<const A: usize, const B: usize, const N: usize>(
    x: &[u8; N],
) -> (&[u8; A], &[u8; B]) {
    const { assert!(A + B == N) };
    let (a, b) = x.split_at(A);
    match (a.try_into(), b.try_into()) {
        (Ok(a), Ok(b)) => (a, b),
        _ => unreachable!("A + B == N is asserted at compile time"),
    }
}

pub(super) fn f32_le(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.as_chunks::<4>().0.iter().zip(out.iter_mut()) {
        *y = f32::from_le_bytes(*b);
    }
}

pub(super) fn f16_le(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.as_chunks::<2>().0.iter().zip(out.iter_mut()) {
        *y = f16_bits_to_f32(u16::from_le_bytes(*b));
    }
}

pub(super) fn bf16_le(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.as_chunks::<2>().0.iter().zip(out.iter_mut()) {
        *y = bf16_bits_to_f32(u16::from_le_bytes(*b));
    }
}

/// f64 rounded to the nearest f32 (ties to even), as numpy's
/// `astype(np.float32)` and torch's `.float()` do.
pub(super) fn f64_le(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.as_chunks::<8>().0.iter().zip(out.iter_mut()) {
        *y = f64::from_le_bytes(*b) as f32;
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[
    (GgmlType::F64, f64_le),
    (GgmlType::F32, f32_le),
    (GgmlType::F16, f16_le),
    (GgmlType::Bf16, bf16_le),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(h: u16) -> u32 {
        f16_bits_to_f32(h).to_bits()
    }

    #[test]
    fn f16_zeros_and_infinities() {
        assert_eq!(bits(0x0000), 0x0000_0000);
        assert_eq!(bits(0x8000), 0x8000_0000);
        assert_eq!(bits(0x7c00), 0x7f80_0000);
        assert_eq!(bits(0xfc00), 0xff80_0000);
    }

    #[test]
    fn f16_normals() {
        assert_eq!(f16_bits_to_f32(0x3c00), 1.0);
        assert_eq!(f16_bits_to_f32(0xc000), -2.0);
        assert_eq!(f16_bits_to_f32(0x3555), 1365.0 / 4096.0);
        // Max normal 65504 and min normal 2^-14.
        assert_eq!(f16_bits_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_bits_to_f32(0xfbff), -65504.0);
        assert_eq!(f16_bits_to_f32(0x0400), 2f32.powi(-14));
    }

    #[test]
    fn f16_subnormals_are_exact() {
        assert_eq!(f16_bits_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(bits(0x0001), 0x3380_0000);
        assert_eq!(bits(0x8001), 0xb380_0000);
        // Largest subnormal: 1023 * 2^-24.
        assert_eq!(f16_bits_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(bits(0x03ff), 0x387f_c000);
        assert_eq!(f16_bits_to_f32(0x0200), 2f32.powi(-15));
    }

    #[test]
    fn f16_nan_payloads_are_kept_unquieted() {
        // Values observed from numpy's astype(np.float32).
        assert_eq!(bits(0x7c01), 0x7f80_2000);
        assert_eq!(bits(0xfc01), 0xff80_2000);
        assert_eq!(bits(0x7d55), 0x7faa_a000);
        assert_eq!(bits(0x7e00), 0x7fc0_0000);
        assert_eq!(bits(0xfe01), 0xffc0_2000);
        assert_eq!(bits(0x7fff), 0x7fff_e000);
    }

    #[test]
    fn f16_every_non_nan_value_round_trips_through_half() {
        // `half`'s f32 -> f16 conversion is exact for values that came from
        // f16, so this checks the whole non-NaN range independently.
        for h in 0..=u16::MAX {
            let f = f16_bits_to_f32(h);
            if f.is_nan() {
                assert_eq!(h & 0x7c00, 0x7c00);
                continue;
            }
            assert_eq!(half::f16::from_f32(f).to_bits(), h, "{h:#06x}");
            assert_eq!(f64::from(f), half::f16::from_bits(h).to_f64());
        }
    }

    #[test]
    fn f16_table_matches_the_conversion_bit_for_bit() {
        let table = f16_table();
        for h in 0..=u16::MAX {
            assert_eq!(table[usize::from(h)].to_bits(), bits(h), "{h:#06x}");
            assert_eq!(f16_le_at(&h.to_le_bytes()).to_bits(), bits(h));
        }
    }

    #[test]
    fn bf16_is_the_high_half() {
        assert_eq!(bf16_bits_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_bits_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert_eq!(bf16_bits_to_f32(0x7f81).to_bits(), 0x7f81_0000);
        assert_eq!(bf16_bits_to_f32(0xff80), f32::NEG_INFINITY);
        assert_eq!(bf16_bits_to_f32(0x0001).to_bits(), 0x0001_0000);
    }

    #[test]
    fn element_arrays_are_little_endian() {
        let mut out = [0f32; 2];
        f32_le(&[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
        f16_le(&[0x00, 0x3c, 0x01, 0x7c], &mut out);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1].to_bits(), 0x7f80_2000);
        bf16_le(&[0x80, 0x3f, 0x00, 0xc0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
    }

    #[test]
    fn split_names_the_fields() {
        let x = [1u8, 2, 3, 4, 5];
        let (a, b): (&[u8; 2], &[u8; 3]) = split(&x);
        assert_eq!(a, &[1, 2]);
        assert_eq!(b, &[3, 4, 5]);
        assert_eq!(f16_le_at(&[0x00, 0xbc]), -1.0);
    }
}
