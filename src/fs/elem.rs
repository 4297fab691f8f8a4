//! How a served file stores each element (f32, f16, bf16) and the
//! conversion from the decoded f32 values: every tensor file and model view
//! is one of these.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

/// Elements converted per batch when encoding f16/bf16 (a stack buffer: no
/// allocation per read).
const ENCODE_BATCH: usize = 2048;

/// How a view stores each element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemFormat {
    F32,
    F16,
    Bf16,
}

impl ElemFormat {
    pub const ALL: [ElemFormat; 3] = [ElemFormat::F32, ElemFormat::F16, ElemFormat::Bf16];

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            ElemFormat::F32 => 4,
            ElemFormat::F16 | ElemFormat::Bf16 => 2,
        }
    }

    /// File extension and `--views` spelling.
    pub fn ext(self) -> &'static str {
        match self {
            ElemFormat::F32 => "f32",
            ElemFormat::F16 => "f16",
            ElemFormat::Bf16 => "bf16",
        }
    }

    /// safetensors dtype.
    pub fn dtype(self) -> &'static str {
        match self {
            ElemFormat::F32 => "F32",
            ElemFormat::F16 => "F16",
            ElemFormat::Bf16 => "BF16",
        }
    }

    /// k in the inode scheme (module docs).
    pub fn ordinal(self) -> u64 {
        match self {
            ElemFormat::F32 => 0,
            ElemFormat::F16 => 1,
            ElemFormat::Bf16 => 2,
        }
    }

    pub fn from_ordinal(k: u64) -> Option<ElemFormat> {
        ElemFormat::ALL.into_iter().find(|f| f.ordinal() == k)
    }

    pub fn from_ext(s: &str) -> Option<ElemFormat> {
        ElemFormat::ALL.into_iter().find(|f| f.ext() == s)
    }
}

/// Append bytes `[skip, skip + take)` of `vals` encoded little-endian as
/// `fmt` to `out`. f16 and bf16 round to nearest, ties to even (the `half`
/// crate; F16C instructions when the CPU has them).
pub fn encode_into(fmt: ElemFormat, vals: &[f32], skip: usize, take: usize, out: &mut Vec<u8>) {
    if fmt == ElemFormat::F32 {
        let bytes = bytemuck::cast_slice::<f32, u8>(vals);
        let end = (skip + take).min(bytes.len());
        out.extend_from_slice(&bytes[skip.min(end)..end]);
        return;
    }
    let end = skip + take;
    let mut buf = [0u16; ENCODE_BATCH];
    let mut pos = 0usize;
    for batch in vals.chunks(ENCODE_BATCH) {
        if pos >= end {
            break;
        }
        let nb = batch.len() * 2;
        if pos + nb > skip {
            let dst = &mut buf[..batch.len()];
            match fmt {
                ElemFormat::F16 => dst
                    .reinterpret_cast_mut::<f16>()
                    .convert_from_f32_slice(batch),
                // Bf16 (f32 returned above).
                _ => dst
                    .reinterpret_cast_mut::<bf16>()
                    .convert_from_f32_slice(batch),
            }
            keep_nans(fmt, batch, dst);
            // The crate serves little-endian hosts only (as for f32).
            let bytes = bytemuck::cast_slice::<u16, u8>(dst);
            let lo = skip.saturating_sub(pos);
            let hi = nb.min(end - pos);
            out.extend_from_slice(&bytes[lo..hi]);
        }
        pos += nb;
    }
}

/// Give each NaN of `vals` its narrowed bits as a shift would (sign and
/// the payload's high bits kept, a signalling NaN left signalling): the
/// `half` crate sets the quiet bit of every NaN, so a bf16 checkpoint's
/// signalling NaN, widened exactly to f32, came back quiet in its `.bf16`
/// file. A NaN whose payload the shift would drop entirely gets the quiet
/// bit, as `half` gives it (it must stay a NaN).
fn keep_nans(fmt: ElemFormat, vals: &[f32], dst: &mut [u16]) {
    for (d, v) in dst.iter_mut().zip(vals) {
        if v.is_nan() {
            let b = v.to_bits();
            *d = match fmt {
                ElemFormat::Bf16 => {
                    let h = (b >> 16) as u16;
                    if h & 0x7f == 0 { h | 0x40 } else { h }
                }
                _ => {
                    let payload = ((b >> 13) & 0x3ff) as u16;
                    let h = ((b >> 16) & 0x8000) as u16 | 0x7c00 | payload;
                    if payload == 0 { h | 0x200 } else { h }
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn nans_keep_their_payload_and_signalling_bit() {
        // bf16 words as f32, the f16 signalling NaN 0x7c01 widened exactly.
        let vals = [
            f32::from_bits(0x7f81_0000),
            f32::from_bits(0xffc1_0000),
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x7f80_2000),
        ];
        let mut out = Vec::new();
        encode_into(ElemFormat::Bf16, &vals, 0, 8, &mut out);
        assert_eq!(out, vec![0x81, 0x7f, 0xc1, 0xff, 0xc0, 0x7f, 0xc0, 0x7f]);
        let mut out = Vec::new();
        encode_into(ElemFormat::F16, &vals[3..], 0, 2, &mut out);
        assert_eq!(out, vec![0x01, 0x7c]);
    }

    use super::*;

    #[test]
    fn encoding_rounds_to_nearest_even_and_slices_bytes() {
        let vals = [1.0f32, 65520.0, 1.0 + 1.0 / 2048.0, -0.0, 3.0e-8];
        let mut out = Vec::new();
        encode_into(ElemFormat::F16, &vals, 0, 10, &mut out);
        let bits: Vec<u16> = out
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        // 65520 rounds to inf; 1 + 2^-11 is a tie that goes to even (1.0).
        assert_eq!(bits, vec![0x3c00, 0x7c00, 0x3c00, 0x8000, 0x0001]);
        let mut out = Vec::new();
        // 1 + 2^-8 is a bf16 tie -> 1.0; 1 + 3*2^-8 -> 1 + 2^-6 (even).
        encode_into(
            ElemFormat::Bf16,
            &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0],
            0,
            4,
            &mut out,
        );
        assert_eq!(out, vec![0x80, 0x3f, 0x82, 0x3f]);
        // Unaligned byte windows, across batch boundaries.
        let many: Vec<f32> = (0..5000).map(|i| i as f32 * 0.37).collect();
        for fmt in ElemFormat::ALL {
            let mut full = Vec::new();
            encode_into(fmt, &many, 0, many.len() * fmt.bytes() as usize, &mut full);
            for (skip, take) in [(1, 3), (4095, 4), (4097, 5000), (0, 1), (9999, 1)] {
                let mut part = Vec::new();
                encode_into(fmt, &many, skip, take, &mut part);
                assert_eq!(part, &full[skip..(skip + take).min(full.len())], "{fmt:?}");
            }
        }
    }
}
