//! The block codecs: one module per stored block mode, each owning its
//! block layout (docs/FORMAT.md section 6), its checks, its scalar decoder,
//! its packer and the reference quantizer, behind [`BlockCodec`].
//!
//! The reader reaches a codec from the tensor's [`BlockMode`], the writer
//! from its [`Coding`], both through [`BlockMode::codec`], the one place a
//! mode maps to its code. A new codec is a new file here implementing
//! [`BlockCodec`], its `BlockMode` and `Coding` variants, and its line in
//! [`BlockMode::codec`] and [`Coding::mode`].

use std::borrow::Cow;
use std::ops::Range;

use super::bits::BitWriter;
use super::{Axis, BlockMode, RknotTensorInfo, Tile};
use crate::error::{ErrorKind, Result, err};

mod affine;
mod graded;
mod lossless;
mod uniform;

pub use affine::{pack_affine_block, quantize_affine_tile};
pub use lossless::{
    LosslessFloat, code_lengths, decode_lossless_bf16, decode_lossless_words, pack_lossless_block,
};

/// One stored block mode. Reader methods take the tensor as its header
/// declared it (mode, bits, line axis) and a block's payload; writer
/// methods take the [`Coding`] of a tensor of this mode.
pub trait BlockCodec: Sync {
    /// Smallest and largest valid length of a block for `tile`.
    fn len_bounds(&self, t: &RknotTensorInfo, tile: &Tile) -> (u64, u64);

    /// Check the block and decode rows `rows` of it into `out`; `rows` lies
    /// in the tile and `out` holds `rows.len() * tile.cols` values (the
    /// caller checked both).
    fn decode_rows(
        &self,
        t: &RknotTensorInfo,
        tile: &Tile,
        bytes: &[u8],
        rows: Range<u64>,
        out: &mut [f32],
    ) -> Result<()>;

    /// Check the block as [`Self::decode_rows`] does and count the values
    /// that would decode to a non-finite f32, in work bounded by the
    /// block's size.
    fn check(&self, t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64>;

    /// Width of every value of a tile, row-major.
    fn widths(&self, coding: &Coding, tile: &Tile) -> Vec<u8>;

    /// Pack one block from its scale and unsigned codes (`codes[i]` in
    /// `0..2^w`, `w` the width of value `i`).
    fn pack(&self, coding: &Coding, tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8>;

    /// The reference writer's block for a tile's values (row-major).
    fn encode_tile(&self, coding: &Coding, tile: &Tile, values: &[f32]) -> Vec<u8>;
}

impl BlockMode {
    /// This mode's codec.
    pub fn codec(self) -> &'static dyn BlockCodec {
        match self {
            BlockMode::Uniform => &uniform::Uniform,
            BlockMode::Graded => &graded::Graded,
            BlockMode::Affine => &affine::Affine,
            BlockMode::LosslessBf16 => &lossless::Lossless(LosslessFloat::Bf16),
            BlockMode::LosslessF16 => &lossless::Lossless(LosslessFloat::F16),
            BlockMode::LosslessF32 => &lossless::Lossless(LosslessFloat::F32),
        }
    }
}

/// The header's `bits` of a lossless tensor: the width of its coded
/// symbol (the exponent of bf16 and f32, the high byte of f16).
pub const LOSSLESS_BITS: u8 = 8;

/// How a tensor is coded.
#[derive(Debug, Clone, PartialEq)]
pub enum Coding {
    Uniform {
        bits: u8,
    },
    /// `line_bits` has one width (0..=max_bits) per compact line along
    /// `line_axis`; each block repeats the widths of its tile's lines.
    Graded {
        max_bits: u8,
        line_axis: Axis,
        line_bits: Vec<u8>,
    },
    /// Every code `bits` wide; blocks built with [`pack_affine_block`].
    Affine {
        bits: u8,
    },
    /// Every value stored exactly; blocks built with [`pack_lossless_block`]
    /// (`codes` of [`pack_block`] are the words).
    Lossless {
        float: LosslessFloat,
    },
}

impl Coding {
    /// The block mode this coding writes.
    pub fn mode(&self) -> BlockMode {
        match self {
            Coding::Uniform { .. } => BlockMode::Uniform,
            Coding::Graded { .. } => BlockMode::Graded,
            Coding::Affine { .. } => BlockMode::Affine,
            Coding::Lossless { float } => BlockMode::lossless(*float),
        }
    }

    /// The header's `bits`: every code's width, or the largest width a
    /// graded line may have.
    pub fn bits(&self) -> u8 {
        match self {
            Coding::Uniform { bits } | Coding::Affine { bits } => *bits,
            Coding::Graded { max_bits, .. } => *max_bits,
            Coding::Lossless { .. } => LOSSLESS_BITS,
        }
    }

    /// The axis whose lines have their own width: graded's `line_axis`,
    /// rows for the other modes (what a reader assumes without one).
    pub fn line_axis(&self) -> Axis {
        match self {
            Coding::Graded { line_axis, .. } => *line_axis,
            _ => Axis::Rows,
        }
    }

    /// Widths of compact lines `lines` along [`Self::line_axis`]: graded's
    /// `line_bits`, every code's width for the other modes.
    pub fn line_widths(&self, lines: Range<u64>) -> Cow<'_, [u8]> {
        match self {
            Coding::Graded { line_bits, .. } => {
                Cow::Borrowed(&line_bits[lines.start as usize..lines.end as usize])
            }
            _ => Cow::Owned(vec![self.bits(); (lines.end - lines.start) as usize]),
        }
    }
}

/// Decode one block (`bytes` = its payload) into `out`, the tile's values in
/// row-major order (`tile.rows * tile.cols` entries).
pub fn decode_block(t: &RknotTensorInfo, tile: &Tile, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    decode_block_rows(t, tile, bytes, 0..tile.rows, out)
}

/// Decode rows `rows` (relative to the tile) of one block into `out`
/// (`rows.len() * tile.cols` entries, row-major). The codes of a row start
/// at a bit offset computed from the widths, so a read of a few rows of a
/// tall tile (the faithful profile's 256 x 1 column segments) decodes only
/// those rows.
pub fn decode_block_rows(
    t: &RknotTensorInfo,
    tile: &Tile,
    bytes: &[u8],
    rows: Range<u64>,
    out: &mut [f32],
) -> Result<()> {
    if rows.start > rows.end || rows.end > tile.rows {
        return Err(err(
            ErrorKind::Range,
            format!("rows {rows:?} of a tile of {} rows", tile.rows),
        ));
    }
    let cols = tile.cols as usize;
    let n = (rows.end - rows.start) as usize * cols;
    if out.len() != n {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!("buffer of {} values for {n} values of a tile", out.len()),
        ));
    }
    t.mode.codec().decode_rows(t, tile, bytes, rows, out)
}

/// Check one block the way [`decode_block`] would decode it (scale, width
/// table, lengths) and count the values that would decode to a non-finite
/// f32, without producing the values: the work is bounded by the block's
/// size, not its tile's (a 5-byte graded block may stand for 65536 zeros).
/// When `2^(w-1) * |scale|` is finite for the widest line no value can
/// overflow and no code is read.
pub fn check_block(t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64> {
    t.mode.codec().check(t, tile, bytes)
}

/// Pack one block from its scale and unsigned codes (`codes[i]` in
/// `0..2^w`, `w` the width of value `i`; dropped lines' codes are ignored).
/// An affine block gets `scale` rounded to f16 and offset 0: affine
/// encoders call [`pack_affine_block`].
pub fn pack_block(coding: &Coding, tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8> {
    coding.mode().codec().pack(coding, tile, scale, codes)
}

/// Width of every value of a tile, row-major.
fn tile_widths(coding: &Coding, tile: &Tile) -> Vec<u8> {
    coding.mode().codec().widths(coding, tile)
}

/// Max-abs quantization of a tile's values (row-major) to codes; returns
/// (scale, codes). The scale makes the largest magnitude reachable on the
/// narrowest non-dropped line; encoders with better scale searches build
/// blocks with [`pack_block`] directly.
pub fn quantize_tile(coding: &Coding, tile: &Tile, values: &[f32]) -> (f32, Vec<u32>) {
    let widths = tile_widths(coding, tile);
    let mut scale = 0f32;
    for (&x, &w) in values.iter().zip(&widths) {
        if w > 0 {
            let levels = ((1u32 << (w - 1)) - 1).max(1) as f32;
            scale = scale.max(x.abs() / levels);
        }
    }
    let codes = values
        .iter()
        .zip(&widths)
        .map(|(&x, &w)| {
            if w == 0 {
                return 0;
            }
            let half = (1i64 << (w - 1)) as f32;
            let q = if scale > 0.0 {
                (x / scale).round()
            } else {
                0.0
            };
            (q + half).clamp(0.0, (1i64 << w) as f32 - 1.0) as u32
        })
        .collect();
    (scale, codes)
}

/// Code bytes of `n` values of `bits` bits.
fn code_bytes(n: u64, bits: u8) -> u64 {
    (n * u64::from(bits)).div_ceil(8)
}

/// The one valid length of a block whose codes all have the tensor's
/// bits, after 4 bytes of scale (and offset): uniform and affine.
fn fixed_len(t: &RknotTensorInfo, tile: &Tile) -> (u64, u64) {
    let len = 4 + code_bytes(tile.rows * tile.cols, t.bits);
    (len, len)
}

/// Every value of a tile at the coding's bits: uniform and affine.
fn equal_widths(coding: &Coding, tile: &Tile) -> Vec<u8> {
    vec![coding.bits(); (tile.rows * tile.cols) as usize]
}

/// Every block starts with 4 bytes of scale (and offset).
fn check_prefix(tile: &Tile, bytes: &[u8]) -> Result<()> {
    let n = tile.rows * tile.cols;
    if bytes.len() < 4 {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!("block of {} bytes for a tile of {n} values", bytes.len()),
        ));
    }
    Ok(())
}

/// The f32 LE scale of a symmetric (uniform or graded) block, finite.
fn symmetric_scale(tile: &Tile, bytes: &[u8]) -> Result<f32> {
    check_prefix(tile, bytes)?;
    let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if !scale.is_finite() {
        return Err(err(ErrorKind::NonFinite, format!("block scale is {scale}")));
    }
    Ok(scale)
}

/// No code of width up to `widest` decodes to a non-finite value:
/// `|code - 2^(w-1)| <= 2^(w-1)`, and f32 multiplication is monotone.
fn cannot_overflow(widest: u8, scale: f32) -> bool {
    widest == 0 || ((1u32 << (widest - 1)) as f32 * scale.abs()).is_finite()
}

/// A symmetric block's value of `code` at width `w`.
fn symmetric_value(code: u32, w: u8, scale: f32) -> f32 {
    (code as i32 - (1i32 << (w - 1))) as f32 * scale
}

/// A symmetric block: scale, width table (graded; empty for uniform), then
/// the codes at their widths.
fn pack_symmetric(scale: f32, table: &[u8], codes: &[u32], widths: &[u8]) -> Vec<u8> {
    let mut bytes = scale.to_le_bytes().to_vec();
    bytes.extend_from_slice(table);
    let mut bw = BitWriter::default();
    for (&c, &w) in codes.iter().zip(widths) {
        bw.push(c, w);
    }
    bytes.extend(bw.finish());
    bytes
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::format::rknot::{BlockTable, TileGrid};

    /// [`check_block`] accepts and refuses what [`decode_block`] does, and
    /// counts exactly the values it would decode to NaN or infinity: the
    /// codings given (each codec's tests pass every line axis and a range of
    /// widths), scales that cannot overflow and scales that do
    /// for some widths and codes. [`decode_block_rows`] gives the same
    /// values as the whole decode for every run of rows.
    pub(in crate::format::rknot::codec) fn check_counts_what_decode_makes_non_finite(
        codings: &[Coding],
    ) {
        let grid = TileGrid {
            compact_rows: 5,
            compact_cols: 7,
            block_rows: 3,
            block_cols: 4,
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut non_finite = 0u64;
        for coding in codings {
            let (mode, bits, line_axis) = (coding.mode(), coding.bits(), coding.line_axis());
            let t = RknotTensorInfo {
                name: "t".into(),
                layer: 0,
                d_out: 5,
                d_in: 7,
                restrict_rows: false,
                restrict_cols: false,
                mode,
                bits,
                line_axis,
                grid,
                blocks: BlockTable::Listed(Vec::new()),
                sums: None,
            };
            for scale in [0.5f32, -3.0, f32::MAX / 4096.0, f32::MAX / 2.0, f32::MAX] {
                for b in 0..grid.n_blocks() {
                    let tile = grid.tile(b);
                    // Extreme codes (which overflow first) and random ones.
                    let codes: Vec<u32> = tile_widths(coding, &tile)
                        .iter()
                        .map(|&w| match (w, next() % 3) {
                            (0, _) => 0,
                            (_, 0) => 0,
                            (_, 1) => (1 << w) - 1,
                            _ => next() as u32 & ((1 << w) - 1),
                        })
                        .collect();
                    let bytes = pack_block(coding, &tile, scale, &codes);
                    let mut out = vec![0f32; (tile.rows * tile.cols) as usize];
                    decode_block(&t, &tile, &bytes, &mut out).unwrap();
                    // Any run of rows decodes to the same values as the
                    // whole tile (codes that start mid-byte included).
                    let c = tile.cols as usize;
                    for r0 in 0..=tile.rows {
                        for r1 in r0..=tile.rows {
                            let mut part = vec![0f32; (r1 - r0) as usize * c];
                            decode_block_rows(&t, &tile, &bytes, r0..r1, &mut part).unwrap();
                            let whole = &out[r0 as usize * c..r1 as usize * c];
                            assert!(
                                part.iter()
                                    .map(|v| v.to_bits())
                                    .eq(whole.iter().map(|v| v.to_bits())),
                                "{coding:?} block {b} rows {r0}..{r1}"
                            );
                        }
                    }
                    let mut past = vec![0f32; c];
                    assert!(
                        decode_block_rows(&t, &tile, &bytes, tile.rows..tile.rows + 1, &mut past)
                            .is_err()
                    );
                    let want = out.iter().filter(|v| !v.is_finite()).count() as u64;
                    let got = check_block(&t, &tile, &bytes).unwrap();
                    assert_eq!(got, want, "{coding:?} scale {scale:e} block {b}");
                    non_finite += got;
                }
            }
            // Blocks decode_block refuses: check_block refuses them too.
            let tile = grid.tile(0);
            let codes = vec![0u32; (tile.rows * tile.cols) as usize];
            let good = pack_block(coding, &tile, 1.0, &codes);
            let mut nan_scale = good.clone();
            nan_scale[..4].copy_from_slice(&f32::NAN.to_le_bytes());
            let mut long = good.clone();
            long.push(0);
            let mut bad_blocks = vec![nan_scale, long, good[..3].to_vec()];
            if mode == BlockMode::Graded {
                // A width over the tensor's bits.
                let mut wide = good.clone();
                wide[4] = bits + 1;
                bad_blocks.push(wide);
            }
            for bytes in bad_blocks {
                let mut out = vec![0f32; (tile.rows * tile.cols) as usize];
                let d = decode_block(&t, &tile, &bytes, &mut out).unwrap_err();
                let c = check_block(&t, &tile, &bytes).unwrap_err();
                assert_eq!((c.kind(), c.message()), (d.kind(), d.message()));
            }
        }
        // The scales above do overflow somewhere: the count was exercised.
        assert!(non_finite > 0);
    }
}
