//! Uniform blocks: `[f32 LE scale] [codes]`, every code `bits` wide,
//! value = (code - 2^(bits-1)) × scale (docs/FORMAT.md section 6.3).

use std::ops::Range;

use super::{
    BlockCodec, Coding, cannot_overflow, code_bytes, equal_widths, fixed_len, pack_symmetric,
    quantize_tile, symmetric_scale, symmetric_value,
};
use crate::error::{ErrorKind, Result, err};
use crate::format::rknot::bits::BitReader;
use crate::format::rknot::{RknotTensorInfo, Tile};

pub(super) struct Uniform;

/// A uniform block's scale (finite) and codes (of exactly the length its
/// tile and bits imply).
fn parts<'a>(t: &RknotTensorInfo, tile: &Tile, bytes: &'a [u8]) -> Result<(f32, &'a [u8])> {
    let n = tile.rows * tile.cols;
    let scale = symmetric_scale(tile, bytes)?;
    let codes = &bytes[4..];
    let want = code_bytes(n, t.bits);
    if codes.len() as u64 != want {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!(
                "uniform block has {} code bytes, {want} expected",
                codes.len()
            ),
        ));
    }
    Ok((scale, codes))
}

impl BlockCodec for Uniform {
    fn len_bounds(&self, t: &RknotTensorInfo, tile: &Tile) -> (u64, u64) {
        fixed_len(t, tile)
    }

    fn decode_rows(
        &self,
        t: &RknotTensorInfo,
        tile: &Tile,
        bytes: &[u8],
        rows: Range<u64>,
        out: &mut [f32],
    ) -> Result<()> {
        let (scale, codes) = parts(t, tile, bytes)?;
        let skip = rows.start * tile.cols * u64::from(t.bits);
        if skip.is_multiple_of(8) {
            let from = usize::try_from(skip / 8).unwrap_or(usize::MAX);
            unpack_uniform(codes.get(from..).unwrap_or(&[]), t.bits, scale, out);
        } else {
            let mut reader = BitReader::at(codes, skip);
            let offset = 1i32 << (t.bits - 1);
            for v in out.iter_mut() {
                *v = (reader.read(t.bits) as i32 - offset) as f32 * scale;
            }
        }
        Ok(())
    }

    fn check(&self, t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64> {
        let (scale, codes) = parts(t, tile, bytes)?;
        if cannot_overflow(t.bits, scale) {
            return Ok(0);
        }
        let mut reader = BitReader::new(codes);
        let mut bad = 0u64;
        for _ in 0..tile.rows * tile.cols {
            bad += u64::from(!symmetric_value(reader.read(t.bits), t.bits, scale).is_finite());
        }
        Ok(bad)
    }

    fn widths(&self, coding: &Coding, tile: &Tile) -> Vec<u8> {
        equal_widths(coding, tile)
    }

    fn pack(&self, coding: &Coding, tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8> {
        pack_symmetric(scale, &[], codes, &self.widths(coding, tile))
    }

    fn encode_tile(&self, coding: &Coding, tile: &Tile, values: &[f32]) -> Vec<u8> {
        let (scale, codes) = quantize_tile(coding, tile, values);
        self.pack(coding, tile, scale, &codes)
    }
}

fn unpack_uniform(codes: &[u8], bits: u8, scale: f32, out: &mut [f32]) {
    let offset = 1i32 << (bits - 1);
    match bits {
        8 => {
            for (v, &c) in out.iter_mut().zip(codes) {
                *v = (i32::from(c) - offset) as f32 * scale;
            }
        }
        4 => {
            for (pair, &c) in out.chunks_mut(2).zip(codes) {
                pair[0] = (i32::from(c & 0x0f) - offset) as f32 * scale;
                if let Some(hi) = pair.get_mut(1) {
                    *hi = (i32::from(c >> 4) - offset) as f32 * scale;
                }
            }
        }
        _ => {
            let mut reader = BitReader::new(codes);
            for v in out.iter_mut() {
                *v = (reader.read(bits) as i32 - offset) as f32 * scale;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::check_counts_what_decode_makes_non_finite;
    use crate::format::rknot::Coding;

    /// Widths of one bit, the byte-aligned fast paths (4 and 8 bits; 8 and
    /// 16 here) and the widest.
    #[test]
    fn check_block_counts_what_decode_block_makes_non_finite() {
        check_counts_what_decode_makes_non_finite(&[
            Coding::Uniform { bits: 1 },
            Coding::Uniform { bits: 8 },
            Coding::Uniform { bits: 16 },
        ]);
    }
}
