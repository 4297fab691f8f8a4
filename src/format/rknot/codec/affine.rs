//! Affine blocks: `[f16 LE scale] [f16 LE offset] [codes]`, every code
//! `bits` wide, value = code × scale + offset: the grid of ggml's Q4_1 and
//! Q5_1 blocks (docs/FORMAT.md section 6.3).

use std::ops::Range;

use super::{BlockCodec, Coding, check_prefix, code_bytes, equal_widths, fixed_len};
use crate::error::{ErrorKind, Result, err};
use crate::format::rknot::bits::{BitReader, BitWriter};
use crate::format::rknot::{RknotTensorInfo, Tile};

pub(super) struct Affine;

/// An affine block's scale and offset (both finite) and codes (of exactly
/// the length its tile and bits imply).
fn parts<'a>(t: &RknotTensorInfo, tile: &Tile, bytes: &'a [u8]) -> Result<(f32, f32, &'a [u8])> {
    let n = tile.rows * tile.cols;
    check_prefix(tile, bytes)?;
    let scale = half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
    let offset = half::f16::from_le_bytes([bytes[2], bytes[3]]).to_f32();
    if !scale.is_finite() || !offset.is_finite() {
        return Err(err(
            ErrorKind::NonFinite,
            format!("affine block scale {scale}, offset {offset}: both must be finite"),
        ));
    }
    let codes = &bytes[4..];
    let want = code_bytes(n, t.bits);
    if codes.len() as u64 != want {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!(
                "affine block has {} code bytes, {want} expected",
                codes.len()
            ),
        ));
    }
    Ok((scale, offset, codes))
}

impl BlockCodec for Affine {
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
        let (scale, offset, codes) = parts(t, tile, bytes)?;
        let skip = rows.start * tile.cols * u64::from(t.bits);
        unpack_affine(codes, skip, t.bits, scale, offset, out);
        Ok(())
    }

    fn check(&self, t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64> {
        parts(t, tile, bytes)?;
        // |code × scale + offset| < 2^16 · 65504 + 65504: always finite.
        Ok(0)
    }

    fn widths(&self, coding: &Coding, tile: &Tile) -> Vec<u8> {
        equal_widths(coding, tile)
    }

    fn pack(&self, coding: &Coding, _tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8> {
        pack_affine_block(
            coding.bits(),
            half::f16::from_f32(scale),
            half::f16::ZERO,
            codes,
        )
    }

    fn encode_tile(&self, coding: &Coding, _tile: &Tile, values: &[f32]) -> Vec<u8> {
        let bits = coding.bits();
        let (scale, offset, codes) = quantize_affine_tile(bits, values);
        pack_affine_block(bits, scale, offset, &codes)
    }
}

/// Pack one affine block: its f16 scale and offset, then `bits`-bit codes
/// (`codes[i]` in `0..2^bits`) in row-major order.
pub fn pack_affine_block(bits: u8, scale: half::f16, offset: half::f16, codes: &[u32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(4 + (codes.len() * usize::from(bits)).div_ceil(8));
    bytes.extend_from_slice(&scale.to_le_bytes());
    bytes.extend_from_slice(&offset.to_le_bytes());
    let mut bw = BitWriter::default();
    for &c in codes {
        bw.push(c, bits);
    }
    bytes.extend(bw.finish());
    bytes
}

/// Min-max affine quantization of a tile's values (the reference writer):
/// offset the minimum, scale the range over `2^bits - 1`, both rounded to
/// f16 (values beyond f16's range saturate).
pub fn quantize_affine_tile(bits: u8, values: &[f32]) -> (half::f16, half::f16, Vec<u32>) {
    let lo = values.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let levels = ((1u32 << bits) - 1) as f32;
    let clamp16 = |v: f32| half::f16::from_f32(v.clamp(-65504.0, 65504.0));
    let (offset, scale) = if lo.is_finite() && hi.is_finite() {
        (clamp16(lo), clamp16((hi - lo) / levels))
    } else {
        (half::f16::ZERO, half::f16::ZERO)
    };
    let (s, o) = (scale.to_f32(), offset.to_f32());
    let codes = values
        .iter()
        .map(|&v| {
            if s > 0.0 {
                ((v - o) / s).round().clamp(0.0, levels) as u32
            } else {
                0
            }
        })
        .collect();
    (scale, offset, codes)
}

/// Affine codes from bit `skip` of `codes`: `code × scale + offset`, a
/// product then a sum, each rounded to f32 (never fused), as ggml's Q4_1
/// and Q5_1 dequantize.
fn unpack_affine(codes: &[u8], skip: u64, bits: u8, scale: f32, offset: f32, out: &mut [f32]) {
    let value = |c: u32| c as f32 * scale + offset;
    let byte = usize::try_from(skip / 8).unwrap_or(usize::MAX);
    let aligned = codes.get(byte..).filter(|_| skip.is_multiple_of(8));
    match (bits, aligned) {
        (8, Some(codes)) => {
            for (v, &c) in out.iter_mut().zip(codes) {
                *v = value(u32::from(c));
            }
        }
        (4, Some(codes)) => {
            for (pair, &c) in out.chunks_mut(2).zip(codes) {
                pair[0] = value(u32::from(c & 0x0f));
                if let Some(hi) = pair.get_mut(1) {
                    *hi = value(u32::from(c >> 4));
                }
            }
        }
        _ => {
            let done = unpack_words(codes, skip, bits, out, value);
            let mut reader = BitReader::at(codes, skip + done as u64 * u64::from(bits));
            for v in &mut out[done..] {
                *v = value(reader.read(bits));
            }
        }
    }
}

/// The fast part of an unaligned or narrow unpack: eight codes at a time
/// from one little-endian 64-bit load (eight `bits`-wide codes span
/// exactly `bits` bytes, so the load plus the start's bit shift fits in 64
/// bits for widths up to 7, and for 8 when the start is byte-aligned).
/// Stops where a load would pass the end of `codes`; returns how many
/// values it wrote, the caller's bit reader does the rest. The codes are
/// the ones `BitReader` (LSB first) would read, so the values are the same.
fn unpack_words(
    codes: &[u8],
    skip: u64,
    bits: u8,
    out: &mut [f32],
    value: impl Fn(u32) -> f32,
) -> usize {
    if bits == 0 || bits > 8 || (bits == 8 && !skip.is_multiple_of(8)) {
        return 0;
    }
    let mask = (1u64 << bits) - 1;
    let step = usize::from(bits);
    let shift = (skip % 8) as u32;
    let Ok(mut byte) = usize::try_from(skip / 8) else {
        return 0;
    };
    let mut done = 0;
    for group in out.chunks_exact_mut(8) {
        let Some(word) = byte.checked_add(8).and_then(|end| codes.get(byte..end)) else {
            break;
        };
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let w = u64::from_le_bytes(w) >> shift;
        for (i, v) in group.iter_mut().enumerate() {
            *v = value(((w >> (i * step)) & mask) as u32);
        }
        byte += step;
        done += 8;
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::format::rknot::{
        Axis, BlockMode, BlockTable, TileGrid, check_block, decode_block, decode_block_rows,
    };

    /// The eight-codes-per-load unpack reads the codes the bit reader
    /// reads, for every width, start bit and length (tails included).
    #[test]
    fn word_unpack_equals_the_bit_reader() {
        let codes: Vec<u8> = (0..97u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for bits in 1..=8u8 {
            for skip in 0..24u64 {
                for n in [0usize, 1, 7, 8, 9, 31, 32, 33, 64, 70] {
                    let (scale, offset) = (0.37f32, -1.25f32);
                    let mut want = vec![0f32; n];
                    let mut reader = BitReader::at(&codes, skip);
                    for v in want.iter_mut() {
                        *v = reader.read(bits) as f32 * scale + offset;
                    }
                    let mut got = vec![f32::NAN; n];
                    unpack_affine(&codes, skip, bits, scale, offset, &mut got);
                    let (w, g): (Vec<u32>, Vec<u32>) = (
                        want.iter().map(|v| v.to_bits()).collect(),
                        got.iter().map(|v| v.to_bits()).collect(),
                    );
                    assert_eq!(w, g, "bits {bits} skip {skip} n {n}");
                }
            }
        }
    }

    /// Affine blocks (section 6.3): the documented example, every width
    /// against a plain f32 evaluation of `code * scale + offset`, runs of
    /// rows against the whole tile, and the blocks a reader refuses.
    #[test]
    fn affine_blocks_decode_as_specified() {
        use half::f16;
        let grid = TileGrid {
            compact_rows: 5,
            compact_cols: 7,
            block_rows: 3,
            block_cols: 4,
        };
        let info = |bits: u8| RknotTensorInfo {
            name: "t".into(),
            layer: 0,
            d_out: 5,
            d_in: 7,
            restrict_rows: false,
            restrict_cols: false,
            mode: BlockMode::Affine,
            bits,
            line_axis: Axis::Rows,
            grid,
            blocks: BlockTable::Listed(Vec::new()),
            sums: None,
        };
        // docs/FORMAT.md's example: codes 3, 10, scale 0.5, offset -1.
        let one = TileGrid {
            compact_rows: 1,
            compact_cols: 2,
            block_rows: 1,
            block_cols: 2,
        };
        let t = RknotTensorInfo {
            grid: one,
            d_out: 1,
            d_in: 2,
            ..info(4)
        };
        let bytes = pack_affine_block(4, f16::from_f32(0.5), f16::from_f32(-1.0), &[3, 10]);
        assert_eq!(bytes, [0x00, 0x38, 0x00, 0xBC, 0xA3]);
        let mut out = [0f32; 2];
        decode_block(&t, &one.tile(0), &bytes, &mut out).unwrap();
        assert_eq!(out, [0.5, 4.0]);

        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for bits in [1u8, 3, 4, 5, 8, 13, 16] {
            let t = info(bits);
            for b in 0..grid.n_blocks() {
                let tile = grid.tile(b);
                let n = (tile.rows * tile.cols) as usize;
                let codes: Vec<u32> = (0..n)
                    .map(|_| next() as u32 & ((1u32 << bits) - 1))
                    .collect();
                let (scale, offset) = (f16::from_f32(0.0123), f16::from_f32(-65504.0));
                let bytes = pack_affine_block(bits, scale, offset, &codes);
                assert_eq!(bytes.len() as u64, t.block_len_bounds(&tile).0);
                let mut out = vec![0f32; n];
                decode_block(&t, &tile, &bytes, &mut out).unwrap();
                for (&v, &c) in out.iter().zip(&codes) {
                    let want = c as f32 * scale.to_f32() + offset.to_f32();
                    assert_eq!(v.to_bits(), want.to_bits(), "{bits} bits, code {c}");
                }
                let c = tile.cols as usize;
                for r0 in 0..=tile.rows {
                    for r1 in r0..=tile.rows {
                        let mut part = vec![0f32; (r1 - r0) as usize * c];
                        decode_block_rows(&t, &tile, &bytes, r0..r1, &mut part).unwrap();
                        assert_eq!(part, out[r0 as usize * c..r1 as usize * c]);
                    }
                }
                assert_eq!(check_block(&t, &tile, &bytes).unwrap(), 0);
            }
            let tile = grid.tile(0);
            let good = pack_affine_block(bits, f16::ONE, f16::ZERO, &[0; 12]);
            let mut nan_scale = good.clone();
            nan_scale[..2].copy_from_slice(&f16::NAN.to_le_bytes());
            let mut inf_offset = good.clone();
            inf_offset[2..4].copy_from_slice(&f16::INFINITY.to_le_bytes());
            let mut long = good.clone();
            long.push(0);
            for (bad, kind) in [
                (nan_scale, ErrorKind::NonFinite),
                (inf_offset, ErrorKind::NonFinite),
                (long, ErrorKind::LengthMismatch),
                (good[..good.len() - 1].to_vec(), ErrorKind::LengthMismatch),
                (good[..3].to_vec(), ErrorKind::LengthMismatch),
            ] {
                let mut out = vec![0f32; 12];
                let d = decode_block(&t, &tile, &bad, &mut out).unwrap_err();
                assert_eq!(d.kind(), kind, "{bits} bits: {d}");
                let c = check_block(&t, &tile, &bad).unwrap_err();
                assert_eq!((c.kind(), c.message()), (d.kind(), d.message()));
            }
        }
    }
}
