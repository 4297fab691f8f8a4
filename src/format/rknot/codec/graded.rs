//! Graded blocks: `[f32 LE scale] [u8 width per line of the tile] [codes]`,
//! each line's codes at its own width `w <= bits`, value = (code -
//! 2^(w-1)) × scale, a line of width 0 dropped (0.0, no codes)
//! (docs/FORMAT.md section 6.3). The lines are the tile's rows or columns
//! (the tensor's `line_axis`).

use std::ops::Range;

use super::{
    BlockCodec, Coding, cannot_overflow, code_bytes, pack_symmetric, quantize_tile,
    symmetric_scale, symmetric_value,
};
use crate::error::{ErrorKind, Result, err};
use crate::format::rknot::bits::BitReader;
use crate::format::rknot::{Axis, RknotTensorInfo, Tile};

pub(super) struct Graded;

/// A graded block's scale (finite), width table (every width <= the
/// tensor's bits) and codes (of exactly the length the widths imply).
fn parts<'a>(
    t: &RknotTensorInfo,
    tile: &Tile,
    bytes: &'a [u8],
) -> Result<(f32, &'a [u8], &'a [u8])> {
    let scale = symmetric_scale(tile, bytes)?;
    let lines = t.tile_lines(tile) as usize;
    let (table, codes) = bytes[4..].split_at(lines.min(bytes.len() - 4));
    if table.len() != lines {
        return Err(err(
            ErrorKind::LengthMismatch,
            "block shorter than its width table",
        ));
    }
    if let Some(&w) = table.iter().find(|&&w| w > t.bits) {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "width table holds {w} bits, the tensor's maximum is {}",
                t.bits
            ),
        ));
    }
    let line_len = match t.line_axis {
        Axis::Rows => tile.cols,
        Axis::Cols => tile.rows,
    };
    let total_bits: u64 = table.iter().map(|&w| u64::from(w) * line_len).sum();
    if codes.len() as u64 != total_bits.div_ceil(8) {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!(
                "graded block has {} code bytes, its width table implies {}",
                codes.len(),
                total_bits.div_ceil(8)
            ),
        ));
    }
    Ok((scale, table, codes))
}

impl BlockCodec for Graded {
    fn len_bounds(&self, t: &RknotTensorInfo, tile: &Tile) -> (u64, u64) {
        let l = t.tile_lines(tile);
        (4 + l, 4 + l + code_bytes(tile.rows * tile.cols, t.bits))
    }

    fn decode_rows(
        &self,
        t: &RknotTensorInfo,
        tile: &Tile,
        bytes: &[u8],
        rows: Range<u64>,
        out: &mut [f32],
    ) -> Result<()> {
        let (scale, table, codes) = parts(t, tile, bytes)?;
        let cols = tile.cols as usize;
        let r0 = rows.start;
        // Bits before row r0: whole lines (rows) of their widths, or
        // r0 rows of one code per coded column.
        let skip: u64 = match t.line_axis {
            Axis::Rows => table[..r0 as usize]
                .iter()
                .map(|&w| u64::from(w) * tile.cols)
                .sum(),
            Axis::Cols => r0 * table.iter().map(|&w| u64::from(w)).sum::<u64>(),
        };
        let mut reader = BitReader::at(codes, skip);
        match (t.line_axis, table) {
            // Runs of one width: a row of a row-lined tile, or the
            // whole of a one-column tile (the faithful profile's
            // column segments).
            (Axis::Rows, _) => {
                for (i, row) in out.chunks_mut(cols.max(1)).enumerate() {
                    unpack_run(&mut reader, table[r0 as usize + i], scale, row);
                }
            }
            (Axis::Cols, &[w]) => unpack_run(&mut reader, w, scale, out),
            (Axis::Cols, _) => {
                for (idx, v) in out.iter_mut().enumerate() {
                    let w = table[idx % cols];
                    *v = if w == 0 {
                        0.0
                    } else {
                        let code = reader.read(w);
                        (code as i32 - (1i32 << (w - 1))) as f32 * scale
                    };
                }
            }
        }
        Ok(())
    }

    fn check(&self, t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64> {
        let (scale, table, codes) = parts(t, tile, bytes)?;
        let widest = table.iter().copied().max().unwrap_or(0);
        if cannot_overflow(widest, scale) {
            return Ok(0);
        }
        let mut reader = BitReader::new(codes);
        let mut bad = 0u64;
        match t.line_axis {
            Axis::Rows => {
                for &w in table.iter().filter(|&&w| w > 0) {
                    for _ in 0..tile.cols {
                        bad += u64::from(!symmetric_value(reader.read(w), w, scale).is_finite());
                    }
                }
            }
            Axis::Cols => {
                // Codes are row-major: each row holds one code per coded column.
                let coded: Vec<u8> = table.iter().copied().filter(|&w| w > 0).collect();
                for _ in 0..tile.rows {
                    for &w in &coded {
                        bad += u64::from(!symmetric_value(reader.read(w), w, scale).is_finite());
                    }
                }
            }
        }
        Ok(bad)
    }

    fn widths(&self, coding: &Coding, tile: &Tile) -> Vec<u8> {
        let n = (tile.rows * tile.cols) as usize;
        let axis = coding.line_axis();
        let lines = coding.line_widths(tile_lines(axis, tile));
        (0..n)
            .map(|i| {
                let (r, c) = (i as u64 / tile.cols, i as u64 % tile.cols);
                let line = match axis {
                    Axis::Rows => r,
                    Axis::Cols => c,
                };
                lines[line as usize]
            })
            .collect()
    }

    fn pack(&self, coding: &Coding, tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8> {
        let table = coding.line_widths(tile_lines(coding.line_axis(), tile));
        pack_symmetric(scale, &table, codes, &self.widths(coding, tile))
    }

    fn encode_tile(&self, coding: &Coding, tile: &Tile, values: &[f32]) -> Vec<u8> {
        let (scale, codes) = quantize_tile(coding, tile, values);
        self.pack(coding, tile, scale, &codes)
    }
}

/// The compact lines along `axis` a tile covers.
fn tile_lines(axis: Axis, tile: &Tile) -> Range<u64> {
    match axis {
        Axis::Rows => tile.row0..tile.row0 + tile.rows,
        Axis::Cols => tile.col0..tile.col0 + tile.cols,
    }
}

/// Decode `out.len()` codes of width `w` (0: all zeros, no codes) from
/// `reader`: the graded modes' inner loop, with the width's offset hoisted.
fn unpack_run(reader: &mut BitReader<'_>, w: u8, scale: f32, out: &mut [f32]) {
    if w == 0 {
        out.fill(0.0);
        return;
    }
    let offset = 1i32 << (w - 1);
    for v in out.iter_mut() {
        *v = (reader.read(w) as i32 - offset) as f32 * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::check_counts_what_decode_makes_non_finite;
    use crate::format::rknot::{Axis, Coding};

    /// Both line axes, with dropped lines (width 0) and the widest.
    #[test]
    fn check_block_counts_what_decode_block_makes_non_finite() {
        check_counts_what_decode_makes_non_finite(&[
            Coding::Graded {
                max_bits: 12,
                line_axis: Axis::Rows,
                line_bits: vec![0, 3, 12, 1, 7],
            },
            Coding::Graded {
                max_bits: 12,
                line_axis: Axis::Cols,
                line_bits: vec![5, 0, 12, 2, 1, 9, 12],
            },
        ]);
    }
}
