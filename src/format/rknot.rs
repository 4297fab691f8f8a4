//! .rknot: the spectral-residual format.
//!
//! ```text
//! "RKNOT\x02" | u32 LE header_len | header_json | body
//! ```
//! The header holds `arch_meta` and, per layer, a spectral manifest (the
//! "standing" hidden dimensions) and a pointer table for each tensor the
//! layer carries: shape, which axes are restricted to the standing
//! indices, bit widths, tile shape and the body offset/length of every
//! block. A block is one tile of the tensor's *compact* matrix (the matrix
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

use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;

use serde_json::{Value, json};

use crate::error::{Error, ErrorKind, Result, add, err, mul};
use crate::format::container::parse_json_object;
use crate::format::json::{self as j};
use crate::format::meta::Metadata;
use crate::names;
use crate::source::SourceFile;

pub const RKNOT_MAGIC: &[u8; 6] = b"RKNOT\x02";
/// Magic + header_len.
pub const RKNOT_PREFIX_LEN: u64 = 10;
pub const RKNOT_VERSION: u64 = 2;
/// Largest header JSON we parse.
pub const MAX_HEADER_LEN: u64 = 1 << 30;
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

    fn from_json(o: &j::Obj) -> Result<Manifest> {
        let ctx = "manifest";
        let d = j::u64_field(o, ctx, "d")?;
        let k = j::u64_field(o, ctx, "k")?;
        let standing_indices = j::u64_array(o, ctx, "standing_indices")?;
        let amplitudes = j::f32_array(o, ctx, "amplitudes")?;
        let phase_alignment = j::f32_array(o, ctx, "phase_alignment")?;
        if d == 0 {
            return Err(err(ErrorKind::BadValue, "manifest d is 0"));
        }
        if k == 0 || k > d {
            return Err(err(
                ErrorKind::BadValue,
                format!("manifest k {k} must be in 1..=d ({d})"),
            ));
        }
        for (what, len) in [
            ("standing_indices", standing_indices.len()),
            ("amplitudes", amplitudes.len()),
            ("phase_alignment", phase_alignment.len()),
        ] {
            if len as u64 != k {
                return Err(err(
                    ErrorKind::BadValue,
                    format!("manifest {what} has {len} entries, k is {k}"),
                ));
            }
        }
        if standing_indices.windows(2).any(|w| w[0] >= w[1]) {
            return Err(err(
                ErrorKind::BadValue,
                "manifest standing_indices must be strictly increasing",
            ));
        }
        if let Some(&last) = standing_indices.last()
            && last >= d
        {
            return Err(err(
                ErrorKind::BadValue,
                format!("standing index {last} is not below d = {d}"),
            ));
        }
        if let Some(p) = phase_alignment.iter().find(|p| !(0.0..=1.0).contains(*p)) {
            return Err(err(
                ErrorKind::BadValue,
                format!("phase_alignment {p} is outside [0, 1]"),
            ));
        }
        Ok(Manifest {
            d,
            standing_indices,
            amplitudes,
            phase_alignment,
        })
    }

    fn to_json(&self) -> Value {
        json!({
            "d": self.d, "k": self.k(),
            "standing_indices": self.standing_indices,
            "amplitudes": self.amplitudes,
            "phase_alignment": self.phase_alignment,
        })
    }
}

/// Uniform: every code has `bits`. Graded: each block starts with a width
/// per line of its tile, each <= `bits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMode {
    Uniform,
    Graded,
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
    /// Per block: absolute file offset and length.
    pub blocks: Vec<(u64, u32)>,
}

impl RknotTensorInfo {
    pub fn stored_bytes(&self) -> u64 {
        self.blocks.iter().map(|&(_, l)| u64::from(l)).sum()
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
    fn block_len_bounds(&self, t: &Tile) -> (u64, u64) {
        let n = t.rows * t.cols;
        let max_codes = (n * u64::from(self.bits)).div_ceil(8);
        match self.mode {
            BlockMode::Uniform => (4 + max_codes, 4 + max_codes),
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

/// A parsed .rknot file.
#[derive(Debug, Clone)]
pub struct RknotFile {
    pub header_len: u64,
    /// Absolute offset of the body; block offsets in the header are
    /// relative to it.
    pub body_offset: u64,
    pub arch: ArchMeta,
    pub layers: Vec<RknotLayer>,
    pub tensors: Vec<RknotTensorInfo>,
}

impl RknotFile {
    pub fn read(src: &SourceFile) -> Result<RknotFile> {
        let path = src.path();
        if src.len() < RKNOT_PREFIX_LEN {
            return Err(err(
                ErrorKind::Truncated,
                format!(
                    ".rknot needs a {RKNOT_PREFIX_LEN}-byte prefix, file has {} bytes",
                    src.len()
                ),
            )
            .path(path));
        }
        let mut prefix = [0u8; 10];
        src.read_at(0, &mut prefix)?;
        if &prefix[..6] != RKNOT_MAGIC {
            return Err(crate::format::bad_magic(path, &prefix[..6]));
        }
        let header_len = u64::from(u32::from_le_bytes([
            prefix[6], prefix[7], prefix[8], prefix[9],
        ]));
        if header_len > MAX_HEADER_LEN {
            return Err(err(
                ErrorKind::TooLarge,
                format!("header_len {header_len} exceeds the {MAX_HEADER_LEN}-byte cap"),
            )
            .path(path)
            .at(6));
        }
        let body_offset = RKNOT_PREFIX_LEN + header_len;
        if body_offset > src.len() {
            return Err(err(
                ErrorKind::Truncated,
                format!(
                    "header_len {header_len} runs past the end of the file ({} bytes)",
                    src.len()
                ),
            )
            .path(path)
            .at(6));
        }
        let raw = src.read_vec(RKNOT_PREFIX_LEN, header_len, "header_json")?;
        let at = RKNOT_PREFIX_LEN;
        let wrap = |e: Error| e.path(path).at(at);
        let h = parse_json_object(&raw, "header_json").map_err(wrap)?;
        if let Some(f) = h.get("format").and_then(Value::as_str)
            && f != "rknot"
        {
            return Err(wrap(err(
                ErrorKind::BadValue,
                format!("header \"format\" is {f:?}, want \"rknot\""),
            )));
        }
        if let Some(v) = h.get("version")
            && v.as_u64() != Some(RKNOT_VERSION)
        {
            return Err(wrap(err(
                ErrorKind::UnsupportedVersion,
                format!("header version {v} is not supported (only {RKNOT_VERSION})"),
            )));
        }
        let am = j::obj_field(&h, "header", "arch_meta").map_err(wrap)?;
        let arch = ArchMeta {
            arch: j::str_field(am, "arch_meta", "arch")
                .map_err(wrap)?
                .to_string(),
            hidden_dim: j::u64_field(am, "arch_meta", "hidden_dim").map_err(wrap)?,
            num_layers: j::u64_field(am, "arch_meta", "num_layers").map_err(wrap)?,
            metadata: match am.get("metadata") {
                Some(v) => Metadata::from_json(v).map_err(wrap)?,
                None => Metadata::default(),
            },
        };
        let body_len = src.len() - body_offset;
        let mut layers = Vec::new();
        let mut tensors = Vec::new();
        let mut seen_layers = HashSet::new();
        for (li, lv) in j::arr_field(&h, "header", "layers")
            .map_err(wrap)?
            .iter()
            .enumerate()
        {
            let lctx = format!("layers[{li}]");
            let lo = j::as_obj(lv, &lctx).map_err(wrap)?;
            let index = j::u64_field(lo, &lctx, "index").map_err(wrap)?;
            if index >= arch.num_layers || !seen_layers.insert(index) {
                return Err(wrap(err(
                    ErrorKind::BadValue,
                    format!(
                        "{lctx}: layer index {index} is duplicated or not below num_layers {}",
                        arch.num_layers
                    ),
                )));
            }
            let manifest = Manifest::from_json(j::obj_field(lo, &lctx, "manifest").map_err(wrap)?)
                .map_err(|e| wrap(e).tensor(&format!("layer {index} manifest")))?;
            let manifest = Arc::new(manifest);
            let layer_pos = layers.len();
            for tv in j::arr_field(lo, &lctx, "tensors").map_err(wrap)? {
                let t =
                    parse_tensor(tv, layer_pos, &manifest, body_offset, body_len).map_err(|e| {
                        let name = tv
                            .get("name")
                            .and_then(Value::as_str)
                            .unwrap_or("<unnamed>")
                            .to_string();
                        wrap(e).tensor(&name)
                    })?;
                tensors.push(t);
            }
            layers.push(RknotLayer { index, manifest });
        }
        // Blocks of all tensors must not overlap.
        let mut extents: Vec<(u64, u64, usize)> = tensors
            .iter()
            .enumerate()
            .flat_map(|(ti, t)| t.blocks.iter().map(move |&(o, l)| (o, u64::from(l), ti)))
            .collect();
        extents.sort_unstable();
        for w in extents.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                let (a, b) = (&tensors[w[0].2].name, &tensors[w[1].2].name);
                return Err(err(
                    ErrorKind::BadValue,
                    format!("blocks overlap in the body (tensors {a:?} and {b:?})"),
                )
                .path(path)
                .tensor(b)
                .at(w[1].0));
            }
        }
        Ok(RknotFile {
            header_len,
            body_offset,
            arch,
            layers,
            tensors,
        })
    }
}

fn parse_tensor(
    tv: &Value,
    layer: usize,
    manifest: &Manifest,
    body_offset: u64,
    body_len: u64,
) -> Result<RknotTensorInfo> {
    let ctx = "tensor";
    let o = j::as_obj(tv, ctx)?;
    let name = j::str_field(o, ctx, "name")?.to_string();
    names::check_servable(&name)?;
    let shape = j::u64_array(o, ctx, "shape")?;
    let [d_out, d_in] = shape[..] else {
        return Err(err(
            ErrorKind::BadShape,
            format!("shape {shape:?} must be [d_out, d_in]"),
        ));
    };
    if d_out == 0 || d_in == 0 {
        return Err(err(
            ErrorKind::BadShape,
            format!("shape {shape:?} is empty"),
        ));
    }
    // The served f32 bytes (d_out * d_in * 4) must fit u64 too.
    mul(mul(d_out, d_in, "d_out * d_in")?, 4, "served size in bytes")?;
    let mut restrict_rows = false;
    let mut restrict_cols = false;
    for a in j::arr_field(o, ctx, "restricted_axes")? {
        match a.as_str().and_then(Axis::parse) {
            Some(Axis::Rows) => restrict_rows = true,
            Some(Axis::Cols) => restrict_cols = true,
            None => {
                return Err(err(
                    ErrorKind::BadValue,
                    format!("restricted_axes entry {a} is not \"rows\" or \"cols\""),
                ));
            }
        }
    }
    for (on, len, axis) in [
        (restrict_rows, d_out, "rows"),
        (restrict_cols, d_in, "cols"),
    ] {
        if on && len != manifest.d {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "{axis} are restricted to the standing indices but have length {len}, \
                     manifest d is {}",
                    manifest.d
                ),
            ));
        }
    }
    let mode = match j::str_field(o, ctx, "mode")? {
        "uniform" => BlockMode::Uniform,
        "graded" => BlockMode::Graded,
        m => {
            return Err(err(
                ErrorKind::BadValue,
                format!("mode {m:?} is not \"uniform\" or \"graded\""),
            ));
        }
    };
    let bits = j::u64_field(o, ctx, "bits")?;
    if !(1..=u64::from(MAX_BITS)).contains(&bits) {
        return Err(err(
            ErrorKind::BadValue,
            format!("bits {bits} must be in 1..={MAX_BITS}"),
        ));
    }
    let line_axis = match o.get("line_axis") {
        Some(v) => v.as_str().and_then(Axis::parse).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("line_axis {v} is not \"rows\" or \"cols\""),
            )
        })?,
        None if mode == BlockMode::Graded => {
            return Err(err(
                ErrorKind::BadJson,
                "graded tensor without \"line_axis\"",
            ));
        }
        None => Axis::Rows,
    };
    let block_shape = j::u64_array(o, ctx, "block_shape")?;
    let [block_rows, block_cols] = block_shape[..] else {
        return Err(err(
            ErrorKind::BadShape,
            format!("block_shape {block_shape:?} must be [rows, cols]"),
        ));
    };
    let compact_rows = if restrict_rows { manifest.k() } else { d_out };
    let compact_cols = if restrict_cols { manifest.k() } else { d_in };
    if block_rows == 0
        || block_cols == 0
        || block_rows > compact_rows
        || block_cols > compact_cols
        || block_rows * block_cols > MAX_TILE_ELEMS
    {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "block_shape {block_shape:?} must be non-empty, fit the compact matrix \
                 [{compact_rows}, {compact_cols}] and hold at most {MAX_TILE_ELEMS} values"
            ),
        ));
    }
    let grid = TileGrid {
        compact_rows,
        compact_cols,
        block_rows,
        block_cols,
    };
    let raw_blocks = j::arr_field(o, ctx, "blocks")?;
    if raw_blocks.len() as u64 != grid.n_blocks() {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "{} blocks listed, the tiling needs {}",
                raw_blocks.len(),
                grid.n_blocks()
            ),
        ));
    }
    let mut info = RknotTensorInfo {
        name,
        layer,
        d_out,
        d_in,
        restrict_rows,
        restrict_cols,
        mode,
        bits: bits as u8,
        line_axis,
        grid,
        blocks: Vec::with_capacity(raw_blocks.len()),
    };
    for (bi, b) in raw_blocks.iter().enumerate() {
        let pair = b.as_array().filter(|a| a.len() == 2);
        let (off, len) = match pair.map(|a| (a[0].as_u64(), a[1].as_u64())) {
            Some((Some(o), Some(l))) => (o, l),
            _ => {
                return Err(err(
                    ErrorKind::BadJson,
                    format!("blocks[{bi}] must be [offset, length]"),
                ));
            }
        };
        let end = add(off, len, "block end")?;
        if end > body_len {
            return Err(err(
                ErrorKind::OutOfBounds,
                format!("block {bi} [{off}, {end}) lies outside the body ({body_len} bytes)"),
            )
            .at(body_offset.saturating_add(off)));
        }
        let tile = grid.tile(bi as u64);
        let (lo, hi) = info.block_len_bounds(&tile);
        if len < lo || len > hi {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "block {bi} has length {len}; a {}x{} tile at {} bits needs {}",
                    tile.rows,
                    tile.cols,
                    info.bits,
                    if lo == hi {
                        lo.to_string()
                    } else {
                        format!("{lo}..={hi}")
                    }
                ),
            )
            .at(body_offset + off));
        }
        // len <= hi < 2^32 (tile <= 65536 values of <= 16 bits).
        info.blocks.push((body_offset + off, len as u32));
    }
    Ok(info)
}

/// Decode one block (`bytes` = its payload) into `out`, the tile's values in
/// row-major order (`tile.rows * tile.cols` entries).
pub fn decode_block(t: &RknotTensorInfo, tile: &Tile, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n = (tile.rows * tile.cols) as usize;
    if out.len() != n || bytes.len() < 4 {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!("block of {} bytes for a tile of {n} values", bytes.len()),
        ));
    }
    let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if !scale.is_finite() {
        return Err(err(ErrorKind::NonFinite, format!("block scale is {scale}")));
    }
    match t.mode {
        BlockMode::Uniform => {
            let codes = &bytes[4..];
            let want = (n as u64 * u64::from(t.bits)).div_ceil(8);
            if codes.len() as u64 != want {
                return Err(err(
                    ErrorKind::LengthMismatch,
                    format!(
                        "uniform block has {} code bytes, {want} expected",
                        codes.len()
                    ),
                ));
            }
            unpack_uniform(codes, t.bits, scale, out);
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
            let mut reader = BitReader::new(codes);
            let cols = tile.cols as usize;
            for (idx, v) in out.iter_mut().enumerate() {
                let line = match t.line_axis {
                    Axis::Rows => idx / cols,
                    Axis::Cols => idx % cols,
                };
                let w = table[line];
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

/// LSB-first bit stream reader. Reading past the end yields zero bits (the
/// callers check lengths first).
struct BitReader<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    have: u32,
}

impl<'a> BitReader<'a> {
    fn new(data: &'a [u8]) -> Self {
        BitReader {
            data,
            pos: 0,
            acc: 0,
            have: 0,
        }
    }

    #[inline]
    fn read(&mut self, w: u8) -> u32 {
        let w = u32::from(w);
        while self.have < w {
            let byte = self.data.get(self.pos).copied().unwrap_or(0);
            self.pos += 1;
            self.acc |= u64::from(byte) << self.have;
            self.have += 8;
        }
        let v = (self.acc & ((1u64 << w) - 1)) as u32;
        self.acc >>= w;
        self.have -= w;
        v
    }
}

/// LSB-first bit stream writer.
#[derive(Default)]
pub struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    have: u32,
}

impl BitWriter {
    pub fn push(&mut self, code: u32, w: u8) {
        let w = u32::from(w);
        if w == 0 {
            return;
        }
        // w <= 16 (MAX_BITS), so the mask and the shift fit in u64.
        self.acc |= (u64::from(code) & ((1u64 << w) - 1)) << self.have;
        self.have += w;
        while self.have >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.have -= 8;
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        if self.have > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
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
}

/// Layout of one tensor to write.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub d_out: u64,
    pub d_in: u64,
    pub restrict_rows: bool,
    pub restrict_cols: bool,
    pub coding: Coding,
    pub block_rows: u64,
    pub block_cols: u64,
}

/// Width of every value of a tile, row-major.
fn tile_widths(coding: &Coding, tile: &Tile) -> Vec<u8> {
    let n = (tile.rows * tile.cols) as usize;
    match coding {
        Coding::Uniform { bits } => vec![*bits; n],
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
pub fn pack_block(coding: &Coding, tile: &Tile, scale: f32, codes: &[u32]) -> Vec<u8> {
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

/// A layer to write.
#[derive(Debug, Clone)]
pub struct LayerOut {
    pub index: u64,
    pub manifest: Manifest,
    /// Each tensor with its blocks' payloads in block order.
    pub tensors: Vec<(TensorSpec, Vec<Vec<u8>>)>,
}

impl TensorSpec {
    pub fn grid(&self, manifest: &Manifest) -> TileGrid {
        TileGrid {
            compact_rows: if self.restrict_rows {
                manifest.k()
            } else {
                self.d_out
            },
            compact_cols: if self.restrict_cols {
                manifest.k()
            } else {
                self.d_in
            },
            block_rows: self.block_rows,
            block_cols: self.block_cols,
        }
    }

    /// The compact matrix of a dense `[d_out, d_in]` row-major tensor.
    pub fn compact(&self, manifest: &Manifest, dense: &[f32]) -> Vec<f32> {
        let rows: Vec<u64> = if self.restrict_rows {
            manifest.standing_indices.clone()
        } else {
            (0..self.d_out).collect()
        };
        let cols: Vec<u64> = if self.restrict_cols {
            manifest.standing_indices.clone()
        } else {
            (0..self.d_in).collect()
        };
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for &r in &rows {
            let row = &dense[(r * self.d_in) as usize..((r + 1) * self.d_in) as usize];
            out.extend(cols.iter().map(|&c| row[c as usize]));
        }
        out
    }

    /// Encode a dense tensor with [`quantize_tile`] into block payloads.
    pub fn encode(&self, manifest: &Manifest, dense: &[f32]) -> Vec<Vec<u8>> {
        let grid = self.grid(manifest);
        let compact = self.compact(manifest, dense);
        (0..grid.n_blocks())
            .map(|b| {
                let tile = grid.tile(b);
                let mut vals = Vec::with_capacity((tile.rows * tile.cols) as usize);
                for r in tile.row0..tile.row0 + tile.rows {
                    let start = (r * grid.compact_cols + tile.col0) as usize;
                    vals.extend_from_slice(&compact[start..start + tile.cols as usize]);
                }
                let (scale, codes) = quantize_tile(&self.coding, &tile, &vals);
                pack_block(&self.coding, &tile, scale, &codes)
            })
            .collect()
    }
}

/// Write a .rknot file. Blocks are laid out in layer, tensor, block order.
pub fn write_rknot<W: Write>(w: &mut W, arch: &ArchMeta, layers: &[LayerOut]) -> Result<()> {
    let mut offset = 0u64;
    let mut layer_json = Vec::new();
    for l in layers {
        let mut tj = Vec::new();
        for (spec, blocks) in &l.tensors {
            let grid = spec.grid(&l.manifest);
            if blocks.len() as u64 != grid.n_blocks() {
                return Err(err(
                    ErrorKind::BadValue,
                    format!("{} blocks for a grid of {}", blocks.len(), grid.n_blocks()),
                )
                .tensor(&spec.name));
            }
            let mut table = Vec::with_capacity(blocks.len());
            for b in blocks {
                table.push(json!([offset, b.len()]));
                offset = add(offset, b.len() as u64, "body size")?;
            }
            let mut axes = Vec::new();
            if spec.restrict_rows {
                axes.push("rows");
            }
            if spec.restrict_cols {
                axes.push("cols");
            }
            let mut t = json!({
                "name": spec.name,
                "shape": [spec.d_out, spec.d_in],
                "restricted_axes": axes,
                "block_shape": [spec.block_rows, spec.block_cols],
                "blocks": table,
            });
            match &spec.coding {
                Coding::Uniform { bits } => {
                    t["mode"] = json!("uniform");
                    t["bits"] = json!(bits);
                }
                Coding::Graded {
                    max_bits,
                    line_axis,
                    ..
                } => {
                    t["mode"] = json!("graded");
                    t["bits"] = json!(max_bits);
                    t["line_axis"] = json!(line_axis.name());
                }
            }
            tj.push(t);
        }
        layer_json.push(json!({"index": l.index, "manifest": l.manifest.to_json(), "tensors": tj}));
    }
    let header = json!({
        "format": "rknot",
        "version": RKNOT_VERSION,
        "arch_meta": {
            "arch": arch.arch, "hidden_dim": arch.hidden_dim, "num_layers": arch.num_layers,
            "metadata": arch.metadata.to_json(),
        },
        "layers": layer_json,
    });
    let bytes = serde_json::to_vec(&header)
        .map_err(|e| err(ErrorKind::BadJson, format!("cannot serialize header: {e}")))?;
    let header_len = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| u64::from(n) <= MAX_HEADER_LEN)
        .ok_or_else(|| err(ErrorKind::TooLarge, "header JSON is too large"))?;
    let io = |e: std::io::Error| err(ErrorKind::Io, format!("write: {e}"));
    w.write_all(RKNOT_MAGIC).map_err(io)?;
    w.write_all(&header_len.to_le_bytes()).map_err(io)?;
    w.write_all(&bytes).map_err(io)?;
    for l in layers {
        for (_, blocks) in &l.tensors {
            for b in blocks {
                w.write_all(b).map_err(io)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_stream_round_trip() {
        let widths = [1u8, 16, 3, 0, 7, 8, 13, 2, 16, 5];
        let codes: Vec<u32> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                if w == 0 {
                    0
                } else {
                    (i as u32).wrapping_mul(2654435761) & ((1 << w) - 1)
                }
            })
            .collect();
        let mut bw = BitWriter::default();
        for (&c, &w) in codes.iter().zip(&widths) {
            bw.push(c, w);
        }
        let bytes = bw.finish();
        let total: u32 = widths.iter().map(|&w| u32::from(w)).sum();
        assert_eq!(bytes.len() as u32, total.div_ceil(8));
        let mut r = BitReader::new(&bytes);
        for (&c, &w) in codes.iter().zip(&widths) {
            if w > 0 {
                assert_eq!(r.read(w), c);
            }
        }
    }

    #[test]
    fn lsb_first_packing_order() {
        // Two 4-bit codes 0x3 then 0xA share one byte: low nibble first.
        let mut bw = BitWriter::default();
        bw.push(0x3, 4);
        bw.push(0xA, 4);
        bw.push(0b1, 1);
        assert_eq!(bw.finish(), vec![0xA3, 0x01]);
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
}
