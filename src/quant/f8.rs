//! The 8-bit floats of safetensors checkpoints (`F8_E4M3`, `F8_E5M2`):
//! not ggml types, decoded to f32 exactly as torch's `.to(torch.float32)`
//! does, NaN bit patterns included (checked on all 256 bytes of each
//! against torch in tests/safetensors.rs).

use super::float::f16_bits_to_f32;
use super::{GgmlType, Kernels};

/// f32 of an `F8_E4M3` byte (torch's `float8_e4m3fn`): 1 sign, 4 exponent
/// bits (bias 7), 3 mantissa bits; no infinities, `S.1111.111` is NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let exp = u32::from((b >> 3) & 0x0f);
    let man = u32::from(b & 0x07);
    let magnitude = match (exp, man) {
        // torch keeps the mantissa bits in place under an all-ones exponent.
        (15, 7) => 0x7f80_0000 | (man << 20),
        // A subnormal is man * 2^-9: an exact f32.
        (0, _) => (man as f32 * (1.0 / 512.0)).to_bits(),
        // Rebias 7 -> 127; the mantissa widens from 3 to 23 bits.
        _ => ((exp + 120) << 23) | (man << 20),
    };
    f32::from_bits(sign | magnitude)
}

/// f32 of an `F8_E5M2` byte: the high byte of an IEEE binary16 (bias 15,
/// infinities and NaNs); torch returns its NaNs quieted.
pub fn e5m2_to_f32(b: u8) -> f32 {
    let v = f16_bits_to_f32(u16::from(b) << 8);
    if v.is_nan() {
        f32::from_bits(v.to_bits() | 0x0040_0000)
    } else {
        v
    }
}

fn e4m3(src: &[u8], out: &mut [f32]) {
    for (&b, y) in src.iter().zip(out.iter_mut()) {
        *y = e4m3_to_f32(b);
    }
}

fn e5m2(src: &[u8], out: &mut [f32]) {
    for (&b, y) in src.iter().zip(out.iter_mut()) {
        *y = e5m2_to_f32(b);
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[(GgmlType::F8E4M3, e4m3), (GgmlType::F8E5M2, e5m2)];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values() {
        assert_eq!(e4m3_to_f32(0x00).to_bits(), 0);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), 0x8000_0000);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xc0), -2.0);
        // Largest finite 448, smallest subnormal 2^-9.
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x7f).to_bits(), 0x7ff0_0000);
        assert_eq!(e4m3_to_f32(0xff).to_bits(), 0xfff0_0000);
        assert_eq!(e4m3_to_f32(0x78), 256.0);
    }

    #[test]
    fn e5m2_values() {
        assert_eq!(e5m2_to_f32(0x3c), 1.0);
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
        assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
        assert_eq!(e5m2_to_f32(0xfc), f32::NEG_INFINITY);
        assert_eq!(e5m2_to_f32(0x7d).to_bits(), 0x7fe0_0000);
        assert_eq!(e5m2_to_f32(0x7e).to_bits(), 0x7fc0_0000);
        assert_eq!(e5m2_to_f32(0xff).to_bits(), 0xffe0_0000);
    }
}
