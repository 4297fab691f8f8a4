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
//!
//! Here: the types a parsed file is made of. Reading is `header` (layout,
//! header JSON, overlap checks) over `index` (where each tensor's blocks
//! lie) and [`blocks`] (the block tables); a block's bytes are its mode's
//! codec's (`codec`: one module per [`BlockMode`], codes through
//! `bits`); `writer` writes files.

use std::sync::Arc;

use crate::error::{ErrorKind, Result, add, err};
use crate::format::MAX_TENSORS;
use crate::format::checksum::GroupSums;
use crate::format::container::check_utf8;
use crate::format::knot::KnotTensorInfo;
use crate::format::meta::Metadata;
use crate::source::SourceFile;

mod bits;
pub mod blocks;
mod codec;
mod header;
mod index;
mod writer;

pub use bits::BitWriter;
pub use blocks::{BlockTable, LengthCode, PackedLengths};
pub use codec::{
    BlockCodec, Coding, LOSSLESS_BITS, LosslessFloat, check_block, code_lengths, decode_block,
    decode_block_rows, decode_lossless_bf16, decode_lossless_words, pack_affine_block, pack_block,
    pack_lossless_block, quantize_affine_tile, quantize_tile,
};
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
/// offset), the grid of ggml's Q4_1/Q5_1 blocks. Lossless: every bf16, f16
/// or f32 word stored exactly, its exponent entropy-coded (`bits` is 8, the
/// coded symbol's width).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMode {
    Uniform,
    Graded,
    Affine,
    LosslessBf16,
    LosslessF16,
    LosslessF32,
}

impl BlockMode {
    pub const ALL: [BlockMode; 6] = [
        BlockMode::Uniform,
        BlockMode::Graded,
        BlockMode::Affine,
        BlockMode::LosslessBf16,
        BlockMode::LosslessF16,
        BlockMode::LosslessF32,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BlockMode::Uniform => "uniform",
            BlockMode::Graded => "graded",
            BlockMode::Affine => "affine",
            BlockMode::LosslessBf16 => "lossless_bf16",
            BlockMode::LosslessF16 => "lossless_f16",
            BlockMode::LosslessF32 => "lossless_f32",
        }
    }

    pub fn parse(s: &str) -> Option<BlockMode> {
        BlockMode::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The lossless mode of `float`.
    pub fn lossless(float: LosslessFloat) -> BlockMode {
        match float {
            LosslessFloat::Bf16 => BlockMode::LosslessBf16,
            LosslessFloat::F16 => BlockMode::LosslessF16,
            LosslessFloat::F32 => BlockMode::LosslessF32,
        }
    }

    /// The float type a lossless mode stores; None for the others.
    pub fn lossless_float(self) -> Option<LosslessFloat> {
        match self {
            BlockMode::LosslessBf16 => Some(LosslessFloat::Bf16),
            BlockMode::LosslessF16 => Some(LosslessFloat::F16),
            BlockMode::LosslessF32 => Some(LosslessFloat::F32),
            _ => None,
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
        self.mode.codec().len_bounds(self, t)
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

impl Layout {
    /// Absolute offset of a tensor's data `[offset, offset + length)` in
    /// the body, which it must lie inside.
    fn data_at(&self, offset: u64, length: u64) -> Result<u64> {
        let end = add(offset, length, "data end")?;
        if end > self.body_len {
            return Err(err(
                ErrorKind::OutOfBounds,
                format!(
                    "data [{offset}, {end}) lies outside the body ({} bytes)",
                    self.body_len
                ),
            )
            .at(self.body_offset.saturating_add(offset)));
        }
        Ok(self.body_offset + offset)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
