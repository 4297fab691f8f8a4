//! .rknot: the spectral-residual format.
//!
//! ```text
//! version 3: "RKNOT\x03\0\0" | body | block index | header_json
//!            | u64 LE index_len | u64 LE header_len | "RKNOTEND"
//! version 2: "RKNOT\x02" | u32 LE header_len | header_json | body
//! ```
//! The header holds `arch_meta` and, per layer, a spectral manifest (the
//! "standing" hidden dimensions) and a pointer table for each tensor the
//! layer carries: shape, which axes are restricted to the standing
//! indices, bit widths, tile shape and where its blocks are: version 2
//! lists every block's offset and length in the JSON; version 3 gives the
//! tensor's data range and codes its block lengths in the binary block
//! index ([`blocks`]). Version 3 puts header and index after the body, so
//! a writer streams blocks out as it makes them. A block is one tile of the tensor's *compact* matrix (the matrix
//! with restricted axes reduced to the standing indices) and decodes on its
//! own:
//!
//! ```text
//! uniform: [f32 LE scale] [codes]
//! graded:  [f32 LE scale] [u8 width per line of the tile] [codes]
//! value = (code - 2^(w-1)) * scale        (w = 0: the line is dropped, 0.0)
//! ```
//! Codes are the tile's entries in row-major order, each `w` bits, packed
//! LSB-first into a little-endian bit stream, zero-padded to a byte.
//! Entries outside the standing indices are exactly 0.0. The complete
//! byte-level specification is docs/FORMAT.md.

use std::sync::Arc;

use crate::error::{ErrorKind, Result, err};
use crate::format::MAX_TENSORS;
use crate::format::checksum::GroupSums;
use crate::format::container::check_utf8;
use crate::format::knot::KnotTensorInfo;
use crate::format::meta::Metadata;
use crate::source::SourceFile;

mod bits;
pub mod blocks;
mod header;
mod index;
mod writer;

use bits::BitReader;
pub use bits::BitWriter;
pub use blocks::{BlockTable, LengthCode, PackedLengths};
pub use header::read_layout;
use header::{check_overlaps, parse_header};
pub use writer::{LayerOut, RknotWriter, TensorSpec, write_rknot, write_rknot_v2};

/// The first 5 bytes of every .rknot; the 6th is the version.
pub const RKNOT_MAGIC_STEM: &[u8; 5] = b"RKNOT";
pub const RKNOT_MAGIC_V2: &[u8; 6] = b"RKNOT\x02";
/// Version 3 starts with this and two zero bytes (the body is 8-aligned).
pub const RKNOT_MAGIC_V3: &[u8; 6] = b"RKNOT\x03";
/// Version 2: magic + u32 header_len.
pub const RKNOT_V2_PREFIX_LEN: u64 = 10;
/// Version 3: where the body starts.
pub const RKNOT_V3_BODY_OFFSET: u64 = 8;
/// Version 3's last 8 bytes.
pub const RKNOT_V3_END_MAGIC: &[u8; 8] = b"RKNOTEND";
/// Version 3's footer: index_len, header_len, end magic.
pub const RKNOT_V3_FOOTER_LEN: u64 = 24;
/// The version new files are written in.
pub const RKNOT_VERSION: u64 = 3;
/// Largest version-2 header JSON we parse. That header lists every block's
/// offset and length (~18 bytes of JSON per block), so it grows with the
/// model: SmolLM2-135M at 5 bits per weight has an 8 MB header, a 7B model
/// ~420 MB. 1 GiB holds models up to ~17B parameters at that tiling; the
/// reader keeps peak memory within ~4x the header (blocks are kept as
/// 16-byte pairs, the rest is small), so the cap bounds what a hostile
/// header costs without refusing real files.
pub const MAX_HEADER_LEN: u64 = 1 << 30;
/// Largest version-3 header JSON. It no longer lists blocks: what remains
/// is the model metadata (a tokenizer is a few MB; GGUF headers are capped
/// at 64 MiB), one manifest per layer (~30 bytes per hidden dimension: 18
/// MB for an 80-layer, 8192-wide model) and ~300 bytes per tensor.
pub const MAX_HEADER_LEN_V3: u64 = 128 << 20;
/// Largest version-3 block index. Its size is about blocks x bits / 8: a
/// 70B model in 256-value blocks at 4 bits is 140 MB; 2 GiB is ten times
/// the largest model anyone serves from one file, and bounds what a
/// hostile footer can make the reader allocate (the index is held in
/// memory, plus an 8-byte anchor per 64 blocks).
pub const MAX_INDEX_LEN: u64 = 2 << 30;
/// Most layers a header may list (no real model has more than a few
/// hundred).
pub const MAX_LAYERS: u64 = MAX_TENSORS;
/// Largest tile, in values: 256 KiB of decoded f32.
pub const MAX_TILE_ELEMS: u64 = 65536;
pub const MAX_BITS: u8 = 16;

/// The spectral manifest of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// Size of the hidden axis the indices refer to.
    pub d: u64,
    /// Strictly increasing, each < d; k = len.
    pub standing_indices: Vec<u64>,
    /// One per standing index, finite.
    pub amplitudes: Vec<f32>,
    /// One per standing index, in [0, 1].
    pub phase_alignment: Vec<f32>,
}

impl Manifest {
    pub fn k(&self) -> u64 {
        self.standing_indices.len() as u64
    }

    /// Position of hidden index `i` among the standing indices.
    pub fn position(&self, i: u64) -> Option<usize> {
        self.standing_indices.binary_search(&i).ok()
    }

    /// First position whose index is >= `i`.
    pub fn lower_bound(&self, i: u64) -> usize {
        self.standing_indices.partition_point(|&s| s < i)
    }
}

/// Uniform: every code has `bits`. Graded: each block starts with a width
/// per line of its tile, each <= `bits`. Affine: every code has `bits` and
/// the block has an f16 scale and an f16 offset (value = code × scale +
/// offset), the grid of ggml's Q4_1/Q5_1 blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMode {
    Uniform,
    Graded,
    Affine,
}

impl BlockMode {
    pub fn name(self) -> &'static str {
        match self {
            BlockMode::Uniform => "uniform",
            BlockMode::Graded => "graded",
            BlockMode::Affine => "affine",
        }
    }
}

/// Matrix axis: rows (d_out) or columns (d_in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    Rows,
    Cols,
}

impl Axis {
    fn name(self) -> &'static str {
        match self {
            Axis::Rows => "rows",
            Axis::Cols => "cols",
        }
    }
    fn parse(s: &str) -> Option<Axis> {
        match s {
            "rows" => Some(Axis::Rows),
            "cols" => Some(Axis::Cols),
            _ => None,
        }
    }
}

/// Geometry of a tensor's blocks: how the compact matrix is tiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileGrid {
    pub compact_rows: u64,
    pub compact_cols: u64,
    pub block_rows: u64,
    pub block_cols: u64,
}

/// One tile of the compact matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    pub row0: u64,
    pub rows: u64,
    pub col0: u64,
    pub cols: u64,
}

impl TileGrid {
    pub fn row_tiles(&self) -> u64 {
        self.compact_rows.div_ceil(self.block_rows)
    }
    pub fn col_tiles(&self) -> u64 {
        self.compact_cols.div_ceil(self.block_cols)
    }
    pub fn n_blocks(&self) -> u64 {
        self.row_tiles() * self.col_tiles()
    }
    /// Block index of tile (row tile, col tile); blocks are row-tile major.
    pub fn block_index(&self, rt: u64, ct: u64) -> u64 {
        rt * self.col_tiles() + ct
    }
    pub fn tile(&self, block: u64) -> Tile {
        let ct_n = self.col_tiles();
        let (rt, ct) = (block / ct_n, block % ct_n);
        let row0 = rt * self.block_rows;
        let col0 = ct * self.block_cols;
        Tile {
            row0,
            rows: self.block_rows.min(self.compact_rows - row0),
            col0,
            cols: self.block_cols.min(self.compact_cols - col0),
        }
    }
}

/// One tensor's pointer-table entry, validated.
#[derive(Debug, Clone)]
pub struct RknotTensorInfo {
    /// Name as stored.
    pub name: String,
    /// Index into [`RknotFile::layers`].
    pub layer: usize,
    /// Served shape `[d_out, d_in]`.
    pub d_out: u64,
    pub d_in: u64,
    pub restrict_rows: bool,
    pub restrict_cols: bool,
    pub mode: BlockMode,
    /// Uniform width, or the largest width a graded table may hold.
    pub bits: u8,
    /// Graded mode: the axis whose lines the width tables index.
    pub line_axis: Axis,
    pub grid: TileGrid,
    /// Where each block is.
    pub blocks: BlockTable,
    /// Version 3 with checksums: the CRC-32 of each group of blocks.
    pub sums: Option<GroupSums>,
}

impl RknotTensorInfo {
    pub fn stored_bytes(&self) -> u64 {
        self.blocks.stored_bytes()
    }

    pub fn n_elements(&self) -> u64 {
        self.d_out * self.d_in
    }

    /// Lines in a tile (length of a graded block's width table).
    pub fn tile_lines(&self, t: &Tile) -> u64 {
        match self.line_axis {
            Axis::Rows => t.rows,
            Axis::Cols => t.cols,
        }
    }

    /// Smallest and largest valid length of a block for a tile.
    pub fn block_len_bounds(&self, t: &Tile) -> (u64, u64) {
        let n = t.rows * t.cols;
        let max_codes = (n * u64::from(self.bits)).div_ceil(8);
        match self.mode {
            BlockMode::Uniform | BlockMode::Affine => (4 + max_codes, 4 + max_codes),
            BlockMode::Graded => {
                let l = self.tile_lines(t);
                (4 + l, 4 + l + max_codes)
            }
        }
    }
}

/// `arch_meta` of the header.
#[derive(Debug, Clone, Default)]
pub struct ArchMeta {
    pub arch: String,
    pub hidden_dim: u64,
    pub num_layers: u64,
    pub metadata: Metadata,
}

#[derive(Debug, Clone)]
pub struct RknotLayer {
    pub index: u64,
    pub manifest: Arc<Manifest>,
}

/// Where the parts of a .rknot file are (absolute offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// 2 or 3.
    pub version: u8,
    pub header_offset: u64,
    pub header_len: u64,
    /// Version 2: block offsets in the header are relative to it; version
    /// 3: tensor data offsets are.
    pub body_offset: u64,
    pub body_len: u64,
    /// Version 3's block index (0, 0 for version 2).
    pub index_offset: u64,
    pub index_len: u64,
    /// Version 3 with checksums: the KSUM record's CRC-32, already checked
    /// against the file's metadata. The record is the body's last 8 bytes,
    /// which `body_len` then leaves out (no tensor may cover them).
    pub ksum: Option<u32>,
}

/// A parsed .rknot file.
#[derive(Debug, Clone)]
pub struct RknotFile {
    pub layout: Layout,
    pub arch: ArchMeta,
    pub layers: Vec<RknotLayer>,
    pub tensors: Vec<RknotTensorInfo>,
    /// Version 3: tensors stored as ggml blocks (embeddings, norms, anything
    /// the profile does not compress), served as a dense file serves them.
    pub dense: Vec<KnotTensorInfo>,
}

impl RknotFile {
    pub fn read(src: &SourceFile) -> Result<RknotFile> {
        let path = src.path();
        let layout = read_layout(src)?;
        let raw = src.read_vec(layout.header_offset, layout.header_len, "header_json")?;
        check_utf8(&raw, layout.header_offset, "header_json").map_err(|e| e.path(path))?;
        let (arch, layers, tensors, dense) =
            parse_header(&raw, &layout, src).map_err(|e| e.path(path).at(layout.header_offset))?;
        // Everything kept is owned: the header's bytes can go before the
        // overlap check needs its own memory.
        drop(raw);
        check_overlaps(&tensors, &dense).map_err(|e| e.path(path))?;
        Ok(RknotFile {
            layout,
            arch,
            layers,
            tensors,
            dense,
        })
    }
}

/// A block's payload split and checked: scale (finite), width table
/// (graded; every width <= the tensor's bits) and codes (of exactly the
/// length the mode and widths imply).
struct BlockParts<'a> {
    scale: f32,
    /// Affine blocks: the value of code 0 (0 for the symmetric modes).
    offset: f32,
    table: &'a [u8],
    codes: &'a [u8],
}

fn block_parts<'a>(t: &RknotTensorInfo, tile: &Tile, bytes: &'a [u8]) -> Result<BlockParts<'a>> {
    let n = tile.rows * tile.cols;
    if bytes.len() < 4 {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!("block of {} bytes for a tile of {n} values", bytes.len()),
        ));
    }
    if t.mode == BlockMode::Affine {
        let scale = half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
        let offset = half::f16::from_le_bytes([bytes[2], bytes[3]]).to_f32();
        if !scale.is_finite() || !offset.is_finite() {
            return Err(err(
                ErrorKind::NonFinite,
                format!("affine block scale {scale}, offset {offset}: both must be finite"),
            ));
        }
        let codes = &bytes[4..];
        let want = (n * u64::from(t.bits)).div_ceil(8);
        if codes.len() as u64 != want {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "affine block has {} code bytes, {want} expected",
                    codes.len()
                ),
            ));
        }
        return Ok(BlockParts {
            scale,
            offset,
            table: &[],
            codes,
        });
    }
    let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if !scale.is_finite() {
        return Err(err(ErrorKind::NonFinite, format!("block scale is {scale}")));
    }
    match t.mode {
        BlockMode::Affine => Err(err(ErrorKind::BadValue, "affine block parsed as symmetric")),
        BlockMode::Uniform => {
            let codes = &bytes[4..];
            let want = (n * u64::from(t.bits)).div_ceil(8);
            if codes.len() as u64 != want {
                return Err(err(
                    ErrorKind::LengthMismatch,
                    format!(
                        "uniform block has {} code bytes, {want} expected",
                        codes.len()
                    ),
                ));
            }
            Ok(BlockParts {
                scale,
                offset: 0.0,
                table: &[],
                codes,
            })
        }
        BlockMode::Graded => {
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
            Ok(BlockParts {
                scale,
                offset: 0.0,
                table,
                codes,
            })
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
    rows: std::ops::Range<u64>,
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
    let BlockParts {
        scale,
        offset,
        table,
        codes,
    } = block_parts(t, tile, bytes)?;
    let r0 = rows.start;
    match t.mode {
        BlockMode::Affine => {
            let skip = r0 * tile.cols * u64::from(t.bits);
            unpack_affine(codes, skip, t.bits, scale, offset, out);
        }
        BlockMode::Uniform => {
            let skip = r0 * tile.cols * u64::from(t.bits);
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
        }
        BlockMode::Graded => {
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
        }
    }
    Ok(())
}

/// Check one block the way [`decode_block`] would decode it (scale, width
/// table, lengths) and count the values that would decode to a non-finite
/// f32, without producing the values: the work is bounded by the block's
/// size, not its tile's (a 5-byte graded block may stand for 65536 zeros).
/// When `2^(w-1) * |scale|` is finite for the widest line no value can
/// overflow and no code is read.
pub fn check_block(t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64> {
    let BlockParts {
        scale,
        table,
        codes,
        ..
    } = block_parts(t, tile, bytes)?;
    let widest = match t.mode {
        // |code × scale + offset| < 2^16 · 65504 + 65504: always finite.
        BlockMode::Affine => return Ok(0),
        BlockMode::Uniform => t.bits,
        BlockMode::Graded => table.iter().copied().max().unwrap_or(0),
    };
    // |code - 2^(w-1)| <= 2^(w-1), and f32 multiplication is monotone.
    if widest == 0 || ((1u32 << (widest - 1)) as f32 * scale.abs()).is_finite() {
        return Ok(0);
    }
    let value = |code: u32, w: u8| (code as i32 - (1i32 << (w - 1))) as f32 * scale;
    let mut reader = BitReader::new(codes);
    let mut bad = 0u64;
    match (t.mode, t.line_axis) {
        (BlockMode::Uniform | BlockMode::Affine, _) => {
            for _ in 0..tile.rows * tile.cols {
                bad += u64::from(!value(reader.read(t.bits), t.bits).is_finite());
            }
        }
        (BlockMode::Graded, Axis::Rows) => {
            for &w in table.iter().filter(|&&w| w > 0) {
                for _ in 0..tile.cols {
                    bad += u64::from(!value(reader.read(w), w).is_finite());
                }
            }
        }
        (BlockMode::Graded, Axis::Cols) => {
            // Codes are row-major: each row holds one code per coded column.
            let coded: Vec<u8> = table.iter().copied().filter(|&w| w > 0).collect();
            for _ in 0..tile.rows {
                for &w in &coded {
                    bad += u64::from(!value(reader.read(w), w).is_finite());
                }
            }
        }
    }
    Ok(bad)
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
            let mut reader = BitReader::at(codes, skip);
            for v in out.iter_mut() {
                *v = value(reader.read(bits));
            }
        }
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

// ---------------------------------------------------------------- writing

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
}

/// Width of every value of a tile, row-major.
fn tile_widths(coding: &Coding, tile: &Tile) -> Vec<u8> {
    let n = (tile.rows * tile.cols) as usize;
    match coding {
        Coding::Uniform { bits } | Coding::Affine { bits } => vec![*bits; n],
        Coding::Graded {
            line_axis,
            line_bits,
            ..
        } => (0..n)
            .map(|i| {
                let (r, c) = (i as u64 / tile.cols, i as u64 % tile.cols);
                let line = match line_axis {
                    Axis::Rows => tile.row0 + r,
                    Axis::Cols => tile.col0 + c,
                };
                line_bits[line as usize]
            })
            .collect(),
    }
}

/// Pack one block from its scale and unsigned codes (`codes[i]` in
/// `0..2^w`, `w` the width of value `i`; dropped lines' codes are ignored).
/// An affine block gets `scale` rounded to f16 and offset 0: affine
/// encoders call [`pack_affine_block`].
pub fn pack_block(coding: &Coding, tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8> {
    if let Coding::Affine { bits } = coding {
        return pack_affine_block(*bits, half::f16::from_f32(scale), half::f16::ZERO, codes);
    }
    let widths = tile_widths(coding, tile);
    let mut bytes = scale.to_le_bytes().to_vec();
    if let Coding::Graded {
        line_axis,
        line_bits,
        ..
    } = coding
    {
        let (start, count) = match line_axis {
            Axis::Rows => (tile.row0, tile.rows),
            Axis::Cols => (tile.col0, tile.cols),
        };
        bytes.extend_from_slice(&line_bits[start as usize..(start + count) as usize]);
    }
    let mut bw = BitWriter::default();
    for (&c, &w) in codes.iter().zip(&widths) {
        bw.push(c, w);
    }
    bytes.extend(bw.finish());
    bytes
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

#[cfg(test)]
mod tests {
    use super::*;

    /// [`check_block`] accepts and refuses what [`decode_block`] does, and
    /// counts exactly the values it would decode to NaN or infinity: every
    /// mode and line axis, scales that cannot overflow and scales that do
    /// for some widths and codes. [`decode_block_rows`] gives the same
    /// values as the whole decode for every run of rows.
    #[test]
    fn check_block_counts_what_decode_block_makes_non_finite() {
        let grid = TileGrid {
            compact_rows: 5,
            compact_cols: 7,
            block_rows: 3,
            block_cols: 4,
        };
        let codings = [
            Coding::Uniform { bits: 1 },
            Coding::Uniform { bits: 8 },
            Coding::Uniform { bits: 16 },
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
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut non_finite = 0u64;
        for coding in &codings {
            let (mode, bits, line_axis) = match coding {
                Coding::Uniform { bits } => (BlockMode::Uniform, *bits, Axis::Rows),
                Coding::Graded {
                    max_bits,
                    line_axis,
                    ..
                } => (BlockMode::Graded, *max_bits, *line_axis),
                Coding::Affine { bits } => (BlockMode::Affine, *bits, Axis::Rows),
            };
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

    #[test]
    fn tile_grid_edges() {
        let g = TileGrid {
            compact_rows: 5,
            compact_cols: 7,
            block_rows: 2,
            block_cols: 3,
        };
        assert_eq!((g.row_tiles(), g.col_tiles(), g.n_blocks()), (3, 3, 9));
        assert_eq!(
            g.tile(8),
            Tile {
                row0: 4,
                rows: 1,
                col0: 6,
                cols: 1
            }
        );
        assert_eq!(g.block_index(2, 2), 8);
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
