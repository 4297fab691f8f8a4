//! Stored blocks that are no ggml type, re-packed into ggml blocks for
//! `model.native.gguf` ([`super::native_gguf`]) without decoding, where the
//! stored code is a ggml type's exactly, bit for bit; everything else is
//! served decoded, as F32.
//!
//! What maps (docs/FORMAT.md section 6.8 has the reasoning per code):
//!
//! - .rknot affine blocks of 1 to 5 bits in one-row groups of 32 (or any
//!   multiple of 32): ggml's Q4_1 (1 to 4 bits) and Q5_1 (5 bits) dequantize
//!   `d * q + m` in f32 from an f16 `d` and `m`, two roundings, which is the
//!   affine value `code * scale + offset` exactly; a group of 64 is two
//!   ggml blocks with the same `d` and `m`. Only the codes move: LSB-first
//!   row order to ggml's nibble layout (element `j` in the low nibble of
//!   byte `j`, element `j + 16` in its high nibble; Q5_1's fifth bits in a
//!   u32).
//! - Nothing else: 6- and 8-bit affine codes have no ggml type with an
//!   offset (Q8_0 and Q8_1 dequantize `d * q`, Q6_K too), the symmetric
//!   (uniform, graded) blocks carry an f32 scale where Q4_0/Q5_0/Q8_0 carry
//!   an f16 one and are tiled by columns or with dropped lines, and no
//!   .rknot code holds a K-quant super-block's 6-bit sub-scales.
//!
//! The segments of such a tensor are read by `fs::native_read`:
//! [`repack_range`] for re-packed ones (the stored blocks through
//! [`Backend::read_stored_blocks`], checked as for any read of them).

use std::ops::Range;

use crate::backend::{Backend, BlockCode, TensorInfo};
use crate::error::{ErrorKind, Result, err};
use crate::quant::GgmlType;

/// Elements of one Q4_1/Q5_1 block.
const QK: u64 = 32;

/// How the bytes of one segment of `model.native.gguf` are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentBytes {
    /// The tensor's stored ggml blocks, verbatim.
    Stored,
    /// Stored blocks re-packed into ggml blocks.
    Repacked(Repack),
    /// The decoded values, as F32 (what `model.gguf` serves).
    DecodedF32,
}

/// Affine rows of `bits`-bit codes in groups of `group` re-packed into
/// `to` (Q4_1 or Q5_1) blocks, `group / 32` per stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repack {
    pub bits: u8,
    pub group: u64,
    pub to: GgmlType,
}

impl Repack {
    /// The exact re-packing of `code`, if there is one.
    pub fn of(code: BlockCode) -> Option<Repack> {
        let BlockCode::AffineRows { bits, group } = code;
        let to = match bits {
            1..=4 => GgmlType::Q4_1,
            5 => GgmlType::Q5_1,
            _ => return None,
        };
        (group > 0 && group.is_multiple_of(QK)).then_some(Repack { bits, group, to })
    }

    fn stored_block_bytes(self) -> u64 {
        BlockCode::AffineRows {
            bits: self.bits,
            group: self.group,
        }
        .block_bytes()
    }

    fn ggml_block_bytes(self) -> u64 {
        match self.to {
            GgmlType::Q5_1 => 24,
            _ => 20,
        }
    }
}

/// The ggml type and bytes of tensor `info` in the view, and how they are
/// made: stored ggml blocks as they are, an exactly re-packable code
/// re-packed, anything else F32.
pub fn plan(info: &TensorInfo, code: Option<BlockCode>) -> (GgmlType, u64, SegmentBytes) {
    if let crate::backend::StoredType::Ggml(ty) = info.stored
        && ty.is_ggml()
        && ty.bytes_for(info.n_elements) == Some(info.stored_bytes)
    {
        return (ty, info.stored_bytes, SegmentBytes::Stored);
    }
    // The re-packed blocks run along ne0 = the last served dimension; the
    // backend's code tiles rows by `group`, a multiple of 32.
    if let Some(r) = code.and_then(Repack::of)
        && let Some(len) = r.to.bytes_for(info.n_elements)
        && info
            .shape
            .last()
            .is_some_and(|&c| c.is_multiple_of(r.group))
    {
        return (r.to, len, SegmentBytes::Repacked(r));
    }
    (
        GgmlType::F32,
        info.n_elements.saturating_mul(4),
        SegmentBytes::DecodedF32,
    )
}

/// Bytes `range` of tensor `index`'s re-packed ggml blocks into `out`
/// (`range.end - range.start` bytes): the stored blocks behind them read
/// through [`Backend::read_stored_blocks`], each checked as a decode checks
/// it (finite scale and offset), its codes moved into the ggml block.
pub fn repack_range(
    b: &dyn Backend,
    index: usize,
    name: &str,
    r: Repack,
    range: Range<u64>,
    out: &mut [u8],
) -> Result<()> {
    let (sb, gb) = (r.stored_block_bytes(), r.ggml_block_bytes());
    let per = r.group / QK;
    let (k0, k1) = (range.start / gb, range.end.div_ceil(gb));
    let (s0, s1) = (k0 / per, k1.div_ceil(per));
    // At most a read's worth of ggml blocks' stored bytes (a stored
    // block is never larger than the ggml blocks it becomes).
    let mut stored = vec![0u8; ((s1 - s0) * sb) as usize];
    b.read_stored_blocks(index, s0 * sb, &mut stored)?;
    let mut block = [0u8; 24];
    for k in k0..k1 {
        let s = k / per;
        let raw = &stored[((s - s0) * sb) as usize..((s - s0 + 1) * sb) as usize];
        check_finite(raw).map_err(|e| e.tensor(name).at(s * sb))?;
        let first = (k % per) * QK;
        ggml_block(r, raw, first, &mut block[..gb as usize]);
        // The part of this ggml block inside `range`.
        let (start, end) = (k * gb, (k + 1) * gb);
        let lo = start.max(range.start);
        let hi = end.min(range.end);
        out[(lo - range.start) as usize..(hi - range.start) as usize]
            .copy_from_slice(&block[(lo - start) as usize..(hi - start) as usize]);
    }
    Ok(())
}

/// An affine block's scale and offset are finite, as its decode requires
/// (`NonFinite` otherwise, the decode's error).
fn check_finite(raw: &[u8]) -> Result<()> {
    let scale = half::f16::from_le_bytes([raw[0], raw[1]]);
    let offset = half::f16::from_le_bytes([raw[2], raw[3]]);
    if scale.is_finite() && offset.is_finite() {
        return Ok(());
    }
    Err(err(
        ErrorKind::NonFinite,
        format!("affine block scale {scale}, offset {offset}: both must be finite"),
    ))
}

/// Write the ggml block of elements `[first, first + 32)` of stored affine
/// block `raw` into `out` (20 bytes for Q4_1, 24 for Q5_1): `d` and `m` the
/// block's f16 scale and offset, bytes as stored, then the codes.
fn ggml_block(r: Repack, raw: &[u8], first: u64, out: &mut [u8]) {
    out[..4].copy_from_slice(&raw[..4]);
    let codes = &raw[4..];
    let bits = u64::from(r.bits);
    let code = |j: u64| -> u8 {
        // LSB-first: code `i` is bits [i * bits, i * bits + bits).
        let bit = (first + j) * bits;
        let (byte, shift) = ((bit / 8) as usize, bit % 8);
        let lo = u16::from(codes[byte]);
        let hi = codes.get(byte + 1).map_or(0, |&b| u16::from(b));
        (((lo | hi << 8) >> shift) & ((1u16 << bits) - 1)) as u8
    };
    let qs_at = match r.to {
        GgmlType::Q5_1 => {
            let mut qh = 0u32;
            for j in 0..QK {
                qh |= u32::from(code(j) >> 4 & 1) << j;
            }
            out[4..8].copy_from_slice(&qh.to_le_bytes());
            8
        }
        _ => 4,
    };
    for j in 0..QK / 2 {
        out[qs_at + j as usize] = (code(j) & 0x0f) | (code(j + 16) & 0x0f) << 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::rknot::pack_affine_block;
    use crate::quant::dequantize;

    /// Every width 1..=5 with groups of 32 and 64: the re-packed ggml
    /// blocks dequantize (rknot's ggml kernels) to exactly the affine
    /// values, `code * scale + offset` in f32.
    #[test]
    fn repacked_blocks_dequantize_to_the_affine_values() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for bits in 1u8..=5 {
            for group in [32u64, 64, 96] {
                let code = BlockCode::AffineRows { bits, group };
                let r = Repack::of(code).unwrap();
                let scale = half::f16::from_f32((next() % 1000) as f32 * 1e-4 - 0.03);
                let offset = half::f16::from_f32((next() % 1000) as f32 * -1e-3);
                let codes: Vec<u32> = (0..group)
                    .map(|_| next() as u32 & ((1 << bits) - 1))
                    .collect();
                let raw = pack_affine_block(bits, scale, offset, &codes);
                assert_eq!(raw.len() as u64, code.block_bytes());
                let mut ggml = Vec::new();
                for part in 0..group / QK {
                    let mut block = vec![0u8; r.ggml_block_bytes() as usize];
                    ggml_block(r, &raw, part * QK, &mut block);
                    ggml.extend(block);
                }
                let mut got = vec![0f32; group as usize];
                dequantize(r.to, &ggml, &mut got).unwrap();
                for (i, (&v, &c)) in got.iter().zip(&codes).enumerate() {
                    let want = c as f32 * scale.to_f32() + offset.to_f32();
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{bits} bits, group {group}, {i}"
                    );
                }
            }
        }
        assert_eq!(
            Repack::of(BlockCode::AffineRows { bits: 6, group: 32 }),
            None
        );
        assert_eq!(
            Repack::of(BlockCode::AffineRows { bits: 4, group: 48 }),
            None
        );
    }
}
