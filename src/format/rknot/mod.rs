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

use std::cell::RefCell;
use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;

use serde::de::{self, MapAccess, SeqAccess};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::error::{ErrorKind, Result, add, err, mul};
use crate::format::checksum::{self, GroupSums};
use crate::format::container::{check_utf8, parse_table};
use crate::format::json::{
    AnyFound, Entries, Expect, F32Array, Field, Found, MaxLen, ObjectOf, OptStr, Parse, Seed, Seen,
    U64Array, raw_value, required, skip_value,
};
use crate::format::knot::{self, KnotTensorInfo};
use crate::format::meta::{JsonMeta, MetaBudget, Metadata, MetadataSeed};
use crate::format::{MAX_TENSORS, too_many_tensors};
use crate::names;
use crate::quant::GgmlType;
use crate::source::SourceFile;

mod bits;
pub mod blocks;

use bits::BitReader;
pub use bits::BitWriter;
pub use blocks::{BlockTable, LengthCode, PackedLengths};

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

    /// Validate a manifest as parsed.
    fn from_raw(r: RawManifest) -> Result<Manifest> {
        let ctx = "manifest";
        let d = required(r.d, ctx, "d")?;
        let k = required(r.k, ctx, "k")?;
        let standing_indices = required(r.standing_indices, ctx, "standing_indices")?;
        let amplitudes = required(r.amplitudes, ctx, "amplitudes")?;
        let phase_alignment = required(r.phase_alignment, ctx, "phase_alignment")?;
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
        // Strictly increasing was checked while parsing.
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

    /// The manifest as header JSON: floats in their shortest f32 form
    /// (version 3) or widened to f64 as version 2's writer printed them.
    fn to_json(&self, short_floats: bool) -> Value {
        let floats = |v: &[f32]| -> Value {
            if short_floats {
                Value::Array(short_f32s(v))
            } else {
                json!(v)
            }
        };
        json!({
            "d": self.d, "k": self.k(),
            "standing_indices": self.standing_indices,
            "amplitudes": floats(&self.amplitudes),
            "phase_alignment": floats(&self.phase_alignment),
        })
    }
}

/// f32 values as JSON numbers in their shortest form ("0.49652302", not the
/// f64 widening "0.49652302265167236"): about half the bytes of a
/// manifest. Readers parse a number as f64 and round it to f32; a value
/// for which that would not give it back (a double rounding) keeps its
/// exact f64 form.
fn short_f32s(values: &[f32]) -> Vec<Value> {
    values
        .iter()
        .map(|&x| {
            let short: Option<f64> = x.to_string().parse().ok();
            match short {
                Some(d) if d as f32 == x => json!(d),
                _ => json!(f64::from(x)),
            }
        })
        .collect()
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

/// Find header, index and body from the prefix (version 2) or the footer
/// (version 3), every length checked against the file and its cap.
pub fn read_layout(src: &SourceFile) -> Result<Layout> {
    let path = src.path();
    let len = src.len();
    let truncated = |need: u64, what: &str| {
        err(
            ErrorKind::Truncated,
            format!(".rknot needs a {need}-byte {what}, file has {len} bytes"),
        )
        .path(path)
    };
    if len < 6 {
        return Err(truncated(6, "magic"));
    }
    let mut magic = [0u8; 6];
    src.read_at(0, &mut magic)?;
    if &magic == RKNOT_MAGIC_V2 {
        if len < RKNOT_V2_PREFIX_LEN {
            return Err(truncated(RKNOT_V2_PREFIX_LEN, "prefix"));
        }
        let mut n = [0u8; 4];
        src.read_at(6, &mut n)?;
        let header_len = u64::from(u32::from_le_bytes(n));
        if header_len > MAX_HEADER_LEN {
            return Err(err(
                ErrorKind::TooLarge,
                format!("header_len {header_len} exceeds the {MAX_HEADER_LEN}-byte cap"),
            )
            .path(path)
            .at(6));
        }
        let body_offset = RKNOT_V2_PREFIX_LEN + header_len;
        if body_offset > len {
            return Err(err(
                ErrorKind::Truncated,
                format!("header_len {header_len} runs past the end of the file ({len} bytes)"),
            )
            .path(path)
            .at(6));
        }
        return Ok(Layout {
            version: 2,
            header_offset: RKNOT_V2_PREFIX_LEN,
            header_len,
            body_offset,
            body_len: len - body_offset,
            index_offset: 0,
            index_len: 0,
            ksum: None,
        });
    }
    if &magic != RKNOT_MAGIC_V3 {
        return Err(crate::format::bad_magic(path, &magic));
    }
    let min = RKNOT_V3_BODY_OFFSET + RKNOT_V3_FOOTER_LEN;
    if len < min {
        return Err(truncated(min, "prefix and footer"));
    }
    let mut pad = [0u8; 2];
    src.read_at(6, &mut pad)?;
    if pad != [0, 0] {
        return Err(err(
            ErrorKind::BadMagic,
            format!("bytes 6..8 are {pad:?}, want [0, 0] after \"RKNOT\\x03\""),
        )
        .path(path)
        .at(6));
    }
    let footer_at = len - RKNOT_V3_FOOTER_LEN;
    let mut footer = [0u8; 24];
    src.read_at(footer_at, &mut footer)?;
    if &footer[16..] != RKNOT_V3_END_MAGIC {
        return Err(err(
            ErrorKind::BadMagic,
            format!(
                "footer ends with \"{}\", want \"RKNOTEND\" (a truncated or unfinished file)",
                crate::text::Escaped(&String::from_utf8_lossy(&footer[16..]))
            ),
        )
        .path(path)
        .at(footer_at + 16));
    }
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&footer[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let (index_len, header_len) = (u64_at(0), u64_at(8));
    if header_len > MAX_HEADER_LEN_V3 {
        return Err(err(
            ErrorKind::TooLarge,
            format!("header_len {header_len} exceeds the {MAX_HEADER_LEN_V3}-byte cap"),
        )
        .path(path)
        .at(footer_at + 8));
    }
    if index_len > MAX_INDEX_LEN {
        return Err(err(
            ErrorKind::TooLarge,
            format!("index_len {index_len} exceeds the {MAX_INDEX_LEN}-byte cap"),
        )
        .path(path)
        .at(footer_at));
    }
    // Both are below 2^32, so the sum cannot overflow.
    let room = footer_at - RKNOT_V3_BODY_OFFSET;
    if header_len + index_len > room {
        return Err(err(
            ErrorKind::Truncated,
            format!(
                "index_len {index_len} + header_len {header_len} exceed the {room} bytes \
                 between prefix and footer"
            ),
        )
        .path(path)
        .at(footer_at));
    }
    let header_offset = footer_at - header_len;
    let index_offset = header_offset - index_len;
    let mut body_len = index_offset - RKNOT_V3_BODY_OFFSET;
    // A checked file's body ends in a KSUM record over the prefix, index,
    // header and footer: checked before the header is parsed, so a damaged
    // header is reported as damaged, not as whatever the damage parses to.
    let mut ksum = None;
    if body_len >= checksum::KSUM_LEN {
        let at = index_offset - checksum::KSUM_LEN;
        if let Some(crc) = checksum::read_ksum(src, at)? {
            checksum::check_ksum(
                src,
                crc,
                &[
                    (0, RKNOT_V3_BODY_OFFSET),
                    (index_offset, len - index_offset),
                ],
                at,
            )?;
            ksum = Some(crc);
            body_len -= checksum::KSUM_LEN;
        }
    }
    Ok(Layout {
        version: 3,
        header_offset,
        header_len,
        body_offset: RKNOT_V3_BODY_OFFSET,
        body_len,
        index_offset,
        index_len,
        ksum,
    })
}

// ------------------------------------------------------------ header parse

/// Absolute offset of a span captured from the header, which starts at
/// `at` in the file.
fn base_of(raw: &RawValue, header: &[u8], at: u64) -> u64 {
    at + crate::format::json::span_of(raw, header).start as u64
}

type Parsed = (
    ArchMeta,
    Vec<RknotLayer>,
    Vec<RknotTensorInfo>,
    Vec<KnotTensorInfo>,
);

/// Parse and validate the header JSON; block offsets are checked against
/// the body of `layout`, version 3's block lengths read from `src`'s index.
fn parse_header(raw: &[u8], layout: &Layout, src: &SourceFile) -> Result<Parsed> {
    let at = layout.header_offset;
    let p = Parse::default();
    let budget = RefCell::new(MetaBudget::default());
    let jm = JsonMeta {
        p: &p,
        budget: &budget,
        header_bytes: raw.len() as u64,
        depth: 0,
    };
    let root = p.run(
        Seed(ObjectOf {
            p: &p,
            ctx: "header_json",
            state: RootFields {
                jm,
                root: RawRoot::default(),
            },
        }),
        raw,
        at,
        "header_json",
    )?;
    if let Some(f) = &root.format
        && f != "rknot"
    {
        return Err(err(
            ErrorKind::BadValue,
            format!("header \"format\" is {f:?}, want \"rknot\""),
        ));
    }
    let version = u64::from(layout.version);
    if let Some(v) = &root.version
        && *v != Seen::U64(version)
    {
        return Err(err(
            ErrorKind::UnsupportedVersion,
            format!(
                "header version {} does not match the file's magic (version {version})",
                v.found()
            ),
        ));
    }
    let am = required(root.arch_meta, "header", "arch_meta")?;
    let arch = ArchMeta {
        arch: required(am.arch, "arch_meta", "arch")?,
        hidden_dim: required(am.hidden_dim, "arch_meta", "hidden_dim")?,
        num_layers: required(am.num_layers, "arch_meta", "num_layers")?,
        metadata: am.metadata.unwrap_or_default(),
    };
    let layers_raw = required(root.layers, "header", "layers")?;
    let raw_layers = p.run(
        Seed(LayersSeed { p: &p }),
        layers_raw.get().as_bytes(),
        base_of(layers_raw, raw, at),
        "header_json",
    )?;
    let mut layers = Vec::with_capacity(raw_layers.len());
    let mut tensors: Vec<RknotTensorInfo> = Vec::new();
    let mut codes = IndexReader {
        src,
        claimed: 0,
        ranges: Vec::new(),
    };
    let mut seen_layers = HashSet::new();
    for (li, rl) in raw_layers.into_iter().enumerate() {
        let lctx = format!("layers[{li}]");
        let index = required(rl.index, &lctx, "index")?;
        if index >= arch.num_layers || !seen_layers.insert(index) {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "{lctx}: layer index {index} is duplicated or not below num_layers {}",
                    arch.num_layers
                ),
            ));
        }
        let manifest = required(rl.manifest, &lctx, "manifest")
            .and_then(Manifest::from_raw)
            .map_err(|e| e.tensor(&format!("layer {index} manifest")))?;
        let manifest = Arc::new(manifest);
        let layer_pos = layers.len();
        let traw = required(rl.tensors, &lctx, "tensors")?;
        let raw_tensors = p.run(
            Seed(TensorsSeed {
                p: &p,
                lctx: &lctx,
                allowed: MAX_TENSORS.saturating_sub(tensors.len() as u64),
                current: RefCell::new(None),
            }),
            traw.get().as_bytes(),
            base_of(traw, raw, at),
            "header_json",
        )?;
        for rt in raw_tensors {
            let name = rt.name.clone().unwrap_or_else(|| "<unnamed>".into());
            let t = build_tensor(rt, layer_pos, &manifest, layout, &mut codes, &p, raw)
                .map_err(|e| e.tensor(&name))?;
            tensors.push(t);
        }
        layers.push(RknotLayer { index, manifest });
    }
    codes.check_disjoint(layout)?;
    // Version 3: tensors stored as ggml blocks, verbatim (section 6.6).
    let mut dense = Vec::new();
    if let Some(raw_dense) = root.dense_tensors
        && layout.version >= 3
    {
        let entries: Vec<(String, knot::RawTensor)> = parse_table(
            raw_dense.get().as_bytes(),
            base_of(raw_dense, raw, at),
            "dense_tensors",
            "dense tensor",
            "header_json",
        )?;
        if (tensors.len() + entries.len()) as u64 > MAX_TENSORS {
            return Err(too_many_tensors("layers and dense_tensors"));
        }
        for (name, r) in entries {
            let t = names::check_servable(&name)
                .and_then(|()| {
                    knot::dense_entry(&name, r, layout.ksum.is_some(), |offset, length| {
                        let end = add(offset, length, "data end")?;
                        if end > layout.body_len {
                            return Err(err(
                                ErrorKind::OutOfBounds,
                                format!(
                                    "data [{offset}, {end}) lies outside the body ({} bytes)",
                                    layout.body_len
                                ),
                            )
                            .at(layout.body_offset.saturating_add(offset)));
                        }
                        Ok(layout.body_offset + offset)
                    })
                })
                .map_err(|e| e.tensor(&name))?;
            dense.push(t);
        }
    }
    Ok((arch, layers, tensors, dense))
}

#[derive(Default)]
struct RawRoot<'de> {
    format: Option<String>,
    version: Option<Seen>,
    arch_meta: Option<RawArch>,
    layers: Option<&'de RawValue>,
    dense_tensors: Option<&'de RawValue>,
}

struct RootFields<'a, 'de> {
    jm: JsonMeta<'a>,
    root: RawRoot<'de>,
}

impl<'de> Entries<'de> for RootFields<'_, 'de> {
    type Value = RawRoot<'de>;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let p = self.jm.p;
        match key.as_str() {
            "format" => self.root.format = map.next_value_seed(Seed(OptStr))?,
            "version" => self.root.version = Some(map.next_value_seed(Seed(AnyFound))?),
            "arch_meta" => {
                self.root.arch_meta = Some(map.next_value_seed(Seed(ObjectOf {
                    p,
                    ctx: "header: field \"arch_meta\"",
                    state: ArchFields {
                        jm: self.jm,
                        raw: RawArch::default(),
                    },
                }))?);
            }
            "layers" => self.root.layers = Some(raw_value(map)?),
            "dense_tensors" => self.root.dense_tensors = Some(raw_value(map)?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<RawRoot<'de>, E> {
        Ok(self.root)
    }
}

#[derive(Default)]
struct RawArch {
    arch: Option<String>,
    hidden_dim: Option<u64>,
    num_layers: Option<u64>,
    metadata: Option<Metadata>,
}

struct ArchFields<'a> {
    jm: JsonMeta<'a>,
    raw: RawArch,
}

impl<'de> Entries<'de> for ArchFields<'_> {
    type Value = RawArch;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let f = Field::new(self.jm.p, "arch_meta", &key);
        let r = &mut self.raw;
        match key.as_str() {
            "arch" => r.arch = Some(f.read_string(map)?),
            "hidden_dim" => r.hidden_dim = Some(f.read_u64(map)?),
            "num_layers" => r.num_layers = Some(f.read_u64(map)?),
            "metadata" => r.metadata = Some(map.next_value_seed(Seed(MetadataSeed(self.jm)))?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<RawArch, E> {
        Ok(self.raw)
    }
}

/// `layers`: an array of layer objects.
struct LayersSeed<'a> {
    p: &'a Parse,
}

impl<'de> Expect<'de> for LayersSeed<'_> {
    type Value = Vec<RawLayer<'de>>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        Field::new(self.p, "header", "layers").wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let p = self.p;
        let mut out = Vec::new();
        loop {
            if out.len() as u64 >= MAX_LAYERS {
                if seq.next_element::<de::IgnoredAny>()?.is_none() {
                    break;
                }
                return Err(p.fail(
                    ErrorKind::TooLarge,
                    format!("header: more than {MAX_LAYERS} layers (the cap)"),
                ));
            }
            let ctx = format!("layers[{}]", out.len());
            let layer = seq.next_element_seed(Seed(ObjectOf {
                p,
                ctx: &ctx,
                state: LayerFields {
                    p,
                    lctx: &ctx,
                    raw: RawLayer::default(),
                },
            }))?;
            match layer {
                Some(l) => out.push(l),
                None => break,
            }
        }
        Ok(out)
    }
}

#[derive(Default)]
struct RawLayer<'de> {
    index: Option<u64>,
    manifest: Option<RawManifest>,
    tensors: Option<&'de RawValue>,
}

struct LayerFields<'a, 'de> {
    p: &'a Parse,
    /// `layers[i]`.
    lctx: &'a str,
    raw: RawLayer<'de>,
}

impl<'de> Entries<'de> for LayerFields<'_, 'de> {
    type Value = RawLayer<'de>;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let (p, lctx) = (self.p, self.lctx);
        match key.as_str() {
            "index" => self.raw.index = Some(Field::new(p, lctx, "index").read_u64(map)?),
            "manifest" => {
                let m = map
                    .next_value_seed(Seed(ObjectOf {
                        p,
                        ctx: &format!("{lctx}: field \"manifest\""),
                        state: ManifestFields {
                            p,
                            raw: RawManifest::default(),
                        },
                    }))
                    .inspect_err(|_| {
                        p.blame(&match self.raw.index {
                            Some(i) => format!("layer {i} manifest"),
                            None => format!("{lctx} manifest"),
                        });
                    })?;
                self.raw.manifest = Some(m);
            }
            "tensors" => self.raw.tensors = Some(raw_value(map)?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<RawLayer<'de>, E> {
        Ok(self.raw)
    }
}

#[derive(Default)]
struct RawManifest {
    d: Option<u64>,
    k: Option<u64>,
    standing_indices: Option<Vec<u64>>,
    amplitudes: Option<Vec<f32>>,
    phase_alignment: Option<Vec<f32>>,
}

struct ManifestFields<'a> {
    p: &'a Parse,
    raw: RawManifest,
}

impl<'de> Entries<'de> for ManifestFields<'_> {
    type Value = RawManifest;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let f = Field::new(self.p, "manifest", &key);
        let r = &mut self.raw;
        match key.as_str() {
            "d" => r.d = Some(f.read_u64(map)?),
            "k" => r.k = Some(f.read_u64(map)?),
            "standing_indices" => {
                // Checked while parsing: an array of repeated small numbers
                // would otherwise take 8 bytes per 2 bytes of header.
                r.standing_indices = Some(map.next_value_seed(Seed(U64Array {
                    f,
                    max: None,
                    increasing: Some("manifest standing_indices must be strictly increasing"),
                }))?);
            }
            "amplitudes" => r.amplitudes = Some(map.next_value_seed(Seed(F32Array(f)))?),
            "phase_alignment" => {
                r.phase_alignment = Some(map.next_value_seed(Seed(F32Array(f)))?);
            }
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<RawManifest, E> {
        Ok(self.raw)
    }
}

/// A layer's `tensors`: an array of tensor objects.
struct TensorsSeed<'a> {
    p: &'a Parse,
    lctx: &'a str,
    /// Tensors this layer may still add under [`MAX_TENSORS`].
    allowed: u64,
    /// Name of the tensor being parsed, once seen (for errors).
    current: RefCell<Option<String>>,
}

impl<'de> Expect<'de> for TensorsSeed<'_> {
    type Value = Vec<RawTensor<'de>>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        Field::new(self.p, self.lctx, "tensors").wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let p = self.p;
        let mut out = Vec::new();
        loop {
            *self.current.borrow_mut() = None;
            if out.len() as u64 >= self.allowed {
                if seq.next_element::<de::IgnoredAny>()?.is_none() {
                    break;
                }
                let e = too_many_tensors("header");
                return Err(p.fail(e.kind(), e.message()));
            }
            let t = seq
                .next_element_seed(Seed(ObjectOf {
                    p,
                    ctx: "tensor",
                    state: TensorFields {
                        p,
                        current: &self.current,
                        raw: RawTensor::default(),
                    },
                }))
                .inspect_err(|_| {
                    p.blame(self.current.borrow().as_deref().unwrap_or("<unnamed>"));
                })?;
            match t {
                Some(t) => out.push(t),
                None => break,
            }
        }
        Ok(out)
    }
}

#[derive(Default)]
struct RawTensor<'de> {
    name: Option<String>,
    shape: Option<Vec<u64>>,
    /// (rows, cols) restricted.
    restricted: Option<(bool, bool)>,
    mode: Option<String>,
    bits: Option<u64>,
    line_axis: Option<Seen>,
    block_shape: Option<Vec<u64>>,
    /// Version 2.
    blocks: Option<&'de RawValue>,
    /// Version 3: `[offset, length]` of the tensor's blocks in the body.
    data: Option<Vec<u64>>,
    /// Version 3: how the block lengths are coded.
    block_lengths: Option<LengthCode>,
    /// Version 3 with checksums: `(at, group)` of the block-group CRC-32s.
    block_crc32: Option<(u64, u64)>,
}

struct TensorFields<'a, 'de> {
    p: &'a Parse,
    current: &'a RefCell<Option<String>>,
    raw: RawTensor<'de>,
}

impl<'de> Entries<'de> for TensorFields<'_, 'de> {
    type Value = RawTensor<'de>;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let p = self.p;
        let f = Field::new(p, "tensor", &key);
        let two = |message| MaxLen {
            len: 2,
            kind: ErrorKind::BadShape,
            message,
        };
        let r = &mut self.raw;
        match key.as_str() {
            "name" => {
                let name = f.read_string(map)?;
                *self.current.borrow_mut() = Some(name.clone());
                r.name = Some(name);
            }
            "shape" => {
                r.shape = Some(map.next_value_seed(Seed(U64Array {
                    f,
                    max: Some(two("shape has more than 2 entries (must be [d_out, d_in])")),
                    increasing: None,
                }))?);
            }
            "restricted_axes" => r.restricted = Some(map.next_value_seed(Seed(Axes(f)))?),
            "mode" => r.mode = Some(f.read_string(map)?),
            "bits" => r.bits = Some(f.read_u64(map)?),
            "line_axis" => r.line_axis = Some(map.next_value_seed(Seed(AnyFound))?),
            "block_shape" => {
                r.block_shape = Some(map.next_value_seed(Seed(U64Array {
                    f,
                    max: Some(two(
                        "block_shape has more than 2 entries (must be [rows, cols])",
                    )),
                    increasing: None,
                }))?);
            }
            "blocks" => r.blocks = Some(raw_value(map)?),
            "data" => {
                r.data = Some(map.next_value_seed(Seed(U64Array {
                    f,
                    max: Some(two(
                        "data has more than 2 entries (must be [offset, length])",
                    )),
                    increasing: None,
                }))?);
            }
            "block_lengths" => {
                r.block_lengths = Some(map.next_value_seed(Seed(ObjectOf {
                    p,
                    ctx: "tensor: field \"block_lengths\"",
                    state: LengthFields { p, seen: [None; 4] },
                }))?);
            }
            "block_crc32" => r.block_crc32 = Some(checksum::read_group_field(f, map)?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<RawTensor<'de>, E> {
        Ok(self.raw)
    }
}

/// `restricted_axes`: a list of "rows" / "cols".
struct Axes<'a>(Field<'a>);

impl<'de> Expect<'de> for Axes<'_> {
    type Value = (bool, bool);
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.0.wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(bool, bool), A::Error> {
        let (mut rows, mut cols) = (false, false);
        while let Some(a) = seq.next_element_seed(Seed(AnyFound))? {
            let axis = match &a {
                Seen::Str(s) => Axis::parse(s),
                _ => None,
            };
            match axis {
                Some(Axis::Rows) => rows = true,
                Some(Axis::Cols) => cols = true,
                None => {
                    return Err(self.0.p.fail(
                        ErrorKind::BadValue,
                        format!(
                            "restricted_axes entry {} is not \"rows\" or \"cols\"",
                            a.found()
                        ),
                    ));
                }
            }
        }
        Ok((rows, cols))
    }
}

/// Validate a tensor as parsed and read its block table.
fn build_tensor(
    r: RawTensor<'_>,
    layer: usize,
    manifest: &Manifest,
    layout: &Layout,
    index: &mut IndexReader<'_>,
    p: &Parse,
    header: &[u8],
) -> Result<RknotTensorInfo> {
    let ctx = "tensor";
    let name = required(r.name, ctx, "name")?;
    names::check_servable(&name)?;
    let shape = required(r.shape, ctx, "shape")?;
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
    let (restrict_rows, restrict_cols) = required(r.restricted, ctx, "restricted_axes")?;
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
    let mode = match required(r.mode, ctx, "mode")?.as_str() {
        "uniform" => BlockMode::Uniform,
        "graded" => BlockMode::Graded,
        "affine" => BlockMode::Affine,
        m => {
            return Err(err(
                ErrorKind::BadValue,
                format!("mode {m:?} is not \"uniform\", \"graded\" or \"affine\""),
            ));
        }
    };
    let bits = required(r.bits, ctx, "bits")?;
    if !(1..=u64::from(MAX_BITS)).contains(&bits) {
        return Err(err(
            ErrorKind::BadValue,
            format!("bits {bits} must be in 1..={MAX_BITS}"),
        ));
    }
    let line_axis = match &r.line_axis {
        Some(v) => match v {
            Seen::Str(s) => Axis::parse(s),
            _ => None,
        }
        .ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("line_axis {} is not \"rows\" or \"cols\"", v.found()),
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
    let block_shape = required(r.block_shape, ctx, "block_shape")?;
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
        blocks: BlockTable::Listed(Vec::new()),
        sums: None,
    };
    if layout.version == 2 {
        let blocks_raw = required(r.blocks, ctx, "blocks")?;
        info.blocks = BlockTable::Listed(p.run(
            Seed(BlocksSeed {
                p,
                info: &info,
                body_offset: layout.body_offset,
                body_len: layout.body_len,
            }),
            blocks_raw.get().as_bytes(),
            base_of(blocks_raw, header, layout.header_offset),
            "header_json",
        )?);
    } else {
        let data = required(r.data, ctx, "data")?;
        let code = required(r.block_lengths, ctx, "block_lengths")?;
        info.blocks = packed_blocks(&info, &data, code, layout, index)?;
        info.sums =
            checksum::present_if_checked(r.block_crc32, layout.ksum.is_some(), "the tensor")?
                .map(|(at, group)| group_sums(&info, at, group, layout, index))
                .transpose()?;
    }
    Ok(info)
}

/// A version-3 tensor's block-group CRC-32s: `ceil(n / group)` u32 LE at
/// index byte `at`, inside the index and counted with the length codes
/// against it; every group at most [`checksum::MAX_GROUP_BYTES`] long, so
/// a read holds at most that much.
fn group_sums(
    info: &RknotTensorInfo,
    at: u64,
    group: u64,
    layout: &Layout,
    index: &mut IndexReader<'_>,
) -> Result<GroupSums> {
    let n = info.grid.n_blocks();
    let len = GroupSums::index_len(n, group)?;
    let end = add(at, len, "block_crc32 end")?;
    let index_at = layout.index_offset.saturating_add(at);
    if end > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "block_crc32 of {n} blocks in groups of {group} needs index bytes [{at}, {end}); \
                 the index has {} bytes",
                layout.index_len
            ),
        )
        .at(index_at));
    }
    index.claimed = add(index.claimed, len, "block index total")?;
    index.take(at, len, &info.name, "block_crc32");
    if index.claimed > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "the tensors' block_lengths and block_crc32 so far take {} index bytes; the \
                 index has {} (code ranges may not overlap: each tensor holds its own copy)",
                index.claimed, layout.index_len
            ),
        )
        .at(index_at));
    }
    let too_large = |g0: u64, bytes: u64| {
        let g1 = n.min(g0.saturating_add(group));
        err(
            ErrorKind::TooLarge,
            format!(
                "block group of blocks [{g0}, {g1}) takes {bytes} bytes or more, above the {}-byte \
                 cap",
                checksum::MAX_GROUP_BYTES
            ),
        )
        .at(index_at)
    };
    if matches!(&info.blocks, BlockTable::Packed(p) if p.uniform()) {
        // Equal-length blocks make equal groups: the first tells.
        let g1 = n.min(group);
        let bytes = info.blocks.span(0, g1).map(|(_, l)| l).unwrap_or(u64::MAX);
        if bytes > checksum::MAX_GROUP_BYTES {
            return Err(too_large(0, bytes));
        }
    } else {
        // One pass over the lengths (one per block; the blocks' number is
        // bounded by the index bytes their codes take), not a lookup per
        // group, which may sum 63 lengths for a group of one block.
        let (mut g0, mut bytes) = (0u64, 0u64);
        for (b, (_, len)) in (0u64..).zip(info.blocks.iter()) {
            if b - g0 == group {
                (g0, bytes) = (b, 0);
            }
            bytes += u64::from(len);
            if bytes > checksum::MAX_GROUP_BYTES {
                return Err(too_large(g0, bytes));
            }
        }
    }
    let bytes = index.src.read_vec(index_at, len, "block_crc32")?;
    Ok(GroupSums::from_index(group, &bytes))
}

/// Where version-3 tensors read their length codes from, and how many
/// index bytes they have taken so far (at most `index_len` in all).
struct IndexReader<'a> {
    src: &'a SourceFile,
    claimed: u64,
    /// Every non-empty range taken: `[at, end)` in the index, the tensor
    /// and which of its fields.
    ranges: Vec<(u64, u64, String, &'static str)>,
}

impl IndexReader<'_> {
    /// Take index bytes `[at, at + len)` for `tensor`'s `field`.
    fn take(&mut self, at: u64, len: u64, tensor: &str, field: &'static str) {
        if len > 0 {
            self.ranges.push((at, at + len, tensor.to_string(), field));
        }
    }

    /// No two ranges share a byte: every tensor's length codes and CRC-32s
    /// are its own, so what the reader holds for the index is at most the
    /// index (the sum rule alone would let ranges overlap where the index
    /// has bytes no tensor uses).
    fn check_disjoint(&mut self, layout: &Layout) -> Result<()> {
        self.ranges.sort_unstable_by_key(|r| (r.0, r.1));
        for w in self.ranges.windows(2) {
            let ((a0, a1, ta, fa), (b0, b1, tb, fb)) = (&w[0], &w[1]);
            if a1 > b0 {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "index bytes [{b0}, {}) are both tensor {ta:?}'s {fa} [{a0}, {a1}) and \
                         tensor {tb:?}'s {fb} [{b0}, {b1}): no two index ranges may share a byte",
                        a1.min(b1)
                    ),
                )
                .tensor(tb)
                .at(layout.index_offset.saturating_add(*b0)));
            }
        }
        Ok(())
    }
}

/// A version-3 tensor's block table: its data range checked against the
/// body, its packed lengths read from the index and checked against the
/// tiles and the data length.
fn packed_blocks(
    info: &RknotTensorInfo,
    data: &[u64],
    code: LengthCode,
    layout: &Layout,
    index: &mut IndexReader<'_>,
) -> Result<BlockTable> {
    let [offset, length] = data[..] else {
        return Err(err(
            ErrorKind::BadJson,
            format!("data {data:?} must be [offset, length]"),
        ));
    };
    let end = add(offset, length, "data end")?;
    if end > layout.body_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "data [{offset}, {end}) lies outside the body ({} bytes)",
                layout.body_len
            ),
        )
        .at(layout.body_offset.saturating_add(offset)));
    }
    let start = layout.body_offset + offset;
    let n = info.grid.n_blocks();
    // Before the width sizes anything.
    if code.bits > blocks::MAX_LENGTH_BITS {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "block_lengths bits {} is above {}",
                code.bits,
                blocks::MAX_LENGTH_BITS
            ),
        ));
    }
    check_length_budget(info, n, length).map_err(|e| e.at(start))?;
    let packed_len = code.packed_len(n)?;
    let packed_end = add(code.at, packed_len, "block index end")?;
    if packed_end > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "block_lengths of {n} blocks at {} bits need index bytes [{}, {packed_end}); \
                 the index has {} bytes",
                code.bits, code.at, layout.index_len
            ),
        )
        .at(layout.index_offset.saturating_add(code.at)));
    }
    // Each tensor holds its own copy of its codes: ranges that add up to
    // more than the index (overlapping ones) would let a small file claim
    // many times its size in memory.
    index.claimed = add(index.claimed, packed_len, "block index total")?;
    index.take(code.at, packed_len, &info.name, "block_lengths");
    if index.claimed > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "the tensors' block_lengths so far take {} index bytes; the index has {} \
                 (code ranges may not overlap: each tensor holds its own copy)",
                index.claimed, layout.index_len
            ),
        )
        .at(layout.index_offset.saturating_add(code.at)));
    }
    let index_at = layout.index_offset + code.at;
    let packed = index.src.read_vec(index_at, packed_len, "block index")?;
    let grid = &info.grid;
    let (rt, ct) = (grid.row_tiles(), grid.col_tiles());
    // A block of each tile size: interior, right edge, bottom edge, corner.
    let one_of_each = [0, ct - 1, (rt - 1) * ct, n - 1];
    // Bounds depend only on the tile's size: one of four, picked without
    // a division while blocks come in order (the check of every length
    // asks for block after block).
    let kinds = [0, ct - 1, (rt - 1) * ct, n - 1].map(|b| info.block_len_bounds(&grid.tile(b)));
    let mut at = (0u64, 0u64, 0u64);
    let bounds = |b: u64| {
        let (next, r, c) = &mut at;
        if b == *next {
            *next += 1;
        } else {
            (*r, *c) = (b / ct, b % ct);
            *next = b + 1;
        }
        let kind = usize::from(*c == ct - 1) + 2 * usize::from(*r == rt - 1);
        *c += 1;
        if *c == ct {
            (*r, *c) = (*r + 1, 0);
        }
        kinds[kind]
    };
    let table = PackedLengths::build(code, n, packed, (start, length), bounds, &one_of_each)
        .map_err(|e| e.at(index_at))?;
    Ok(BlockTable::Packed(table))
}

/// The tiling's blocks must fit the tensor's data range: the smallest
/// length every tile allows, summed over the blocks, at most `length` (and
/// the largest at least `length`). `length` lies inside the body, so the
/// blocks a header may declare are bounded by what the file stores: a
/// 465-byte header cannot declare 2^34 blocks over an 8 KB body. Computed
/// from the four tile sizes (interior, right edge, bottom edge, corner)
/// and their counts, before any index byte is read or any block visited.
fn check_length_budget(info: &RknotTensorInfo, n: u64, length: u64) -> Result<()> {
    let grid = &info.grid;
    let (rt, ct) = (grid.row_tiles(), grid.col_tiles());
    let (mut lo_sum, mut hi_sum) = (0u128, 0u128);
    // A representative tile of each size, and how many tiles have it.
    let rows = [(0, rt - 1), (rt - 1, 1)];
    let cols = [(0, ct - 1), (ct - 1, 1)];
    for &(r, r_count) in &rows {
        for &(c, c_count) in &cols {
            let count = u128::from(r_count) * u128::from(c_count);
            if count == 0 {
                continue;
            }
            let (lo, hi) = info.block_len_bounds(&grid.tile(grid.block_index(r, c)));
            lo_sum += count * u128::from(lo);
            hi_sum += count * u128::from(hi);
        }
    }
    let length = u128::from(length);
    if length < lo_sum || length > hi_sum {
        let (which, bound) = if length < lo_sum {
            ("at least", lo_sum)
        } else {
            ("at most", hi_sum)
        };
        return Err(err(
            ErrorKind::LengthMismatch,
            format!(
                "{n} blocks of its tiling take {which} {bound} bytes (the lengths its tiles \
                 allow), data length is {length}"
            ),
        ));
    }
    Ok(())
}

/// A tensor's `block_lengths`: `{"at", "base", "step", "bits"}`, all
/// required non-negative integers.
struct LengthFields<'a> {
    p: &'a Parse,
    /// at, base, step, bits as seen.
    seen: [Option<u64>; 4],
}

const LENGTH_FIELDS: [&str; 4] = ["at", "base", "step", "bits"];

impl<'de> Entries<'de> for LengthFields<'_> {
    type Value = LengthCode;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        match LENGTH_FIELDS.iter().position(|k| *k == key) {
            Some(i) => {
                let f = Field::new(self.p, "block_lengths", &key);
                self.seen[i] = Some(f.read_u64(map)?);
            }
            None => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<LengthCode, E> {
        let mut v = [0u64; 4];
        for (i, s) in self.seen.iter().enumerate() {
            v[i] = s.ok_or_else(|| {
                self.p.fail(
                    ErrorKind::BadJson,
                    format!("block_lengths: missing field \"{}\"", LENGTH_FIELDS[i]),
                )
            })?;
        }
        Ok(LengthCode {
            at: v[0],
            base: v[1],
            step: v[2],
            bits: v[3],
        })
    }
}

/// A tensor's `blocks`: `[offset, length]` pairs, each checked against the
/// body and its tile as it is read.
struct BlocksSeed<'a> {
    p: &'a Parse,
    info: &'a RknotTensorInfo,
    body_offset: u64,
    body_len: u64,
}

impl BlocksSeed<'_> {
    fn check(&self, bi: u64, off: u64, len: u64) -> Result<(u64, u32)> {
        let body_offset = self.body_offset;
        let end = add(off, len, "block end")?;
        if end > self.body_len {
            return Err(err(
                ErrorKind::OutOfBounds,
                format!(
                    "block {bi} [{off}, {end}) lies outside the body ({} bytes)",
                    self.body_len
                ),
            )
            .at(body_offset.saturating_add(off)));
        }
        let tile = self.info.grid.tile(bi);
        let (lo, hi) = self.info.block_len_bounds(&tile);
        if len < lo || len > hi {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "block {bi} has length {len}; a {}x{} tile at {} bits needs {}",
                    tile.rows,
                    tile.cols,
                    self.info.bits,
                    if lo == hi {
                        lo.to_string()
                    } else {
                        format!("{lo}..={hi}")
                    }
                ),
            )
            .at(body_offset + off));
        }
        // len <= hi < 2^32 (a tile is <= 65536 values of <= 16 bits), and
        // end <= body_len, so the absolute offset fits.
        Ok((body_offset + off, len as u32))
    }
}

impl<'de> Expect<'de> for BlocksSeed<'_> {
    type Value = Vec<(u64, u32)>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        Field::new(self.p, "tensor", "blocks").wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<(u64, u32)>, A::Error> {
        let p = self.p;
        let need = self.info.grid.n_blocks();
        // Not reserved from `need`: that number comes from the file.
        let mut out = Vec::new();
        let mut listed = 0u64;
        loop {
            if listed < need {
                match seq.next_element_seed(Seed(Pair { p, bi: listed }))? {
                    Some((off, len)) => {
                        out.push(self.check(listed, off, len).map_err(|e| p.fail_error(e))?);
                    }
                    None => break,
                }
            } else if seq.next_element::<de::IgnoredAny>()?.is_none() {
                break;
            }
            listed += 1;
        }
        if listed != need {
            return Err(p.fail(
                ErrorKind::BadValue,
                format!("{listed} blocks listed, the tiling needs {need}"),
            ));
        }
        Ok(out)
    }
}

/// One `[offset, length]` pair.
#[derive(Clone, Copy)]
struct Pair<'a> {
    p: &'a Parse,
    bi: u64,
}

impl Pair<'_> {
    /// `blocks[i] must be [offset, length]` (BadJson), for any other shape.
    fn bad<E: de::Error>(self) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!("blocks[{}] must be [offset, length]", self.bi),
        )
    }
}

impl<'de> Expect<'de> for Pair<'_> {
    type Value = (u64, u64);
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.bad()
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(u64, u64), A::Error> {
        let first = seq.next_element_seed(Seed(PairElem(self)))?;
        let second = seq.next_element_seed(Seed(PairElem(self)))?;
        match (first, second) {
            (Some(o), Some(l)) => {
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(self.bad());
                }
                Ok((o, l))
            }
            _ => Err(self.bad()),
        }
    }
}

/// One number of a pair.
struct PairElem<'a>(Pair<'a>);

impl<'de> Expect<'de> for PairElem<'_> {
    type Value = u64;
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.0.bad()
    }
    fn on_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
}

/// No two blocks of the file may overlap.
fn check_overlaps(tensors: &[RknotTensorInfo], dense: &[KnotTensorInfo]) -> Result<()> {
    // Version 3: a tensor's blocks are back to back inside its data range,
    // so the ranges (of compressed and dense tensors alike) are what must
    // not overlap.
    let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
    let mut any_listed = false;
    for t in tensors {
        match &t.blocks {
            BlockTable::Packed(_) => {
                if let Some(start) = t.blocks.first_offset() {
                    ranges.push((start, start + t.blocks.stored_bytes(), &t.name));
                }
            }
            BlockTable::Listed(_) => any_listed = true,
        }
    }
    for d in dense {
        ranges.push((d.offset, d.offset + d.length, &d.name));
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].1 > w[1].0 {
            let (na, nb) = (w[0].2, w[1].2);
            return Err(err(
                ErrorKind::BadValue,
                format!("tensor data ranges overlap in the body (tensors {na:?} and {nb:?})"),
            )
            .tensor(nb)
            .at(w[1].0));
        }
    }
    if !any_listed {
        return Ok(());
    }
    check_listed_overlaps(tensors)
}

/// Version 2: no two listed blocks overlap.
fn check_listed_overlaps(tensors: &[RknotTensorInfo]) -> Result<()> {
    fn listed(t: &RknotTensorInfo) -> &[(u64, u32)] {
        match &t.blocks {
            BlockTable::Listed(v) => v,
            BlockTable::Packed(_) => &[],
        }
    }
    // Writers lay blocks out in tensor and block order: check that in one
    // pass without allocating.
    let mut prev_end = 0u64;
    let in_order = tensors
        .iter()
        .flat_map(|t| listed(t).iter())
        .all(|&(o, l)| {
            let ok = o >= prev_end;
            prev_end = o + u64::from(l);
            ok
        });
    if in_order {
        return Ok(());
    }
    // Otherwise sort block numbers (4 bytes each) by offset.
    let mut starts = Vec::with_capacity(tensors.len() + 1);
    let mut total = 0u64;
    for t in tensors {
        starts.push(total);
        total += listed(t).len() as u64;
    }
    let total = u32::try_from(total).map_err(|_| {
        err(
            ErrorKind::TooLarge,
            format!("{total} blocks: more than any header can list"),
        )
    })?;
    let block = |g: u32| -> (usize, (u64, u32)) {
        let ti = starts.partition_point(|&s| s <= u64::from(g)) - 1;
        (
            ti,
            listed(&tensors[ti])[(u64::from(g) - starts[ti]) as usize],
        )
    };
    let mut order: Vec<u32> = (0..total).collect();
    order.sort_unstable_by_key(|&g| block(g).1.0);
    for w in order.windows(2) {
        let (ta, a) = block(w[0]);
        let (tb, b) = block(w[1]);
        if a.0 + u64::from(a.1) > b.0 {
            let (na, nb) = (&tensors[ta].name, &tensors[tb].name);
            return Err(err(
                ErrorKind::BadValue,
                format!("blocks overlap in the body (tensors {na:?} and {nb:?})"),
            )
            .tensor(nb)
            .at(b.0));
        }
    }
    Ok(())
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
                if let Coding::Affine { bits } = self.coding {
                    let (scale, offset, codes) = quantize_affine_tile(bits, &vals);
                    return pack_affine_block(bits, scale, offset, &codes);
                }
                let (scale, codes) = quantize_tile(&self.coding, &tile, &vals);
                pack_block(&self.coding, &tile, scale, &codes)
            })
            .collect()
    }
}

/// A tensor's header entry, with `located` (where its blocks are) after
/// `block_shape`: the key order version 2's writer had.
fn tensor_json(spec: &TensorSpec, located: Vec<(&str, Value)>) -> Value {
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
    });
    for (k, v) in located {
        t[k] = v;
    }
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
        Coding::Affine { bits } => {
            t["mode"] = json!("affine");
            t["bits"] = json!(bits);
        }
    }
    t
}

fn header_json(
    arch: &ArchMeta,
    version: u64,
    layers: Vec<Value>,
    dense_tensors: Option<Value>,
) -> Result<Vec<u8>> {
    let mut header = json!({
        "format": "rknot",
        "version": version,
        "arch_meta": {
            "arch": arch.arch, "hidden_dim": arch.hidden_dim, "num_layers": arch.num_layers,
            "metadata": arch.metadata.to_json(),
        },
        "layers": layers,
    });
    if let Some(d) = dense_tensors {
        header["dense_tensors"] = d;
    }
    serde_json::to_vec(&header)
        .map_err(|e| err(ErrorKind::BadJson, format!("cannot serialize header: {e}")))
}

fn write_err(e: std::io::Error) -> crate::Error {
    err(ErrorKind::Io, format!("write: {e}"))
}

/// Writes a version-3 .rknot as a stream: each tensor's blocks go out as
/// they are made; the block index and the header follow the last tensor,
/// and the footer says where they are. Memory: the index (a few bits per
/// block), the header, and one `u32` per block of the tensor being written.
pub struct RknotWriter<W: Write> {
    w: W,
    /// Bytes of body written so far (block offsets are relative to the
    /// body, which starts at byte 8).
    body_len: u64,
    index: Vec<u8>,
    /// Layer index, manifest, tensor entries.
    layers: Vec<(u64, Manifest, Vec<Value>)>,
    /// `dense_tensors` entries, in the order written.
    dense: serde_json::Map<String, Value>,
}

impl<W: Write> RknotWriter<W> {
    /// Start a file: writes the 8-byte prefix.
    pub fn new(mut w: W) -> Result<RknotWriter<W>> {
        w.write_all(RKNOT_MAGIC_V3).map_err(write_err)?;
        w.write_all(&[0, 0]).map_err(write_err)?;
        Ok(RknotWriter {
            w,
            body_len: 0,
            index: Vec::new(),
            layers: Vec::new(),
            dense: serde_json::Map::new(),
        })
    }

    /// Write a tensor stored as ggml blocks of type `ty`, shape outer-first
    /// as a dense .knot's: `fill(offset, buf)` supplies its bytes (verbatim
    /// ggml blocks) from byte `offset` of the tensor, in pieces of at most
    /// 4 MiB.
    pub fn dense_tensor(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        mut fill: impl FnMut(u64, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        const PIECE: u64 = 4 << 20;
        if self.dense.contains_key(name) {
            return Err(err(ErrorKind::BadName, "written twice").tensor(name));
        }
        let n = knot::check_shape(shape, ty).map_err(|e| e.tensor(name))?;
        let length = ty.bytes_for(n).ok_or_else(|| {
            err(
                ErrorKind::Overflow,
                format!("byte size of {n} {ty} elements"),
            )
            .tensor(name)
        })?;
        let offset = self.body_len;
        let mut buf = vec![0u8; PIECE.min(length) as usize];
        let mut done = 0u64;
        let mut sums = checksum::ChunkHasher::new(checksum::WRITE_CHUNK);
        while done < length {
            let piece = &mut buf[..(length - done).min(PIECE) as usize];
            fill(done, piece)?;
            sums.update(piece);
            self.w.write_all(piece).map_err(write_err)?;
            done += piece.len() as u64;
        }
        self.body_len = add(self.body_len, length, "body size")?;
        self.dense.insert(
            name.to_string(),
            json!({"type": ty.name(), "shape": shape, "offset": offset, "length": length,
                   "crc32": sums.finish().to_json()}),
        );
        Ok(())
    }

    /// The tensors written next belong to layer `index`.
    pub fn begin_layer(&mut self, index: u64, manifest: Manifest) {
        self.layers.push((index, manifest, Vec::new()));
    }

    /// Write one tensor of the current layer: its blocks' payloads in block
    /// order, exactly as many as its tiling has.
    pub fn tensor<B: AsRef<[u8]>>(
        &mut self,
        spec: &TensorSpec,
        blocks: impl IntoIterator<Item = B>,
    ) -> Result<()> {
        let Some((_, manifest, entries)) = self.layers.last_mut() else {
            return Err(
                err(ErrorKind::BadValue, "a tensor before any layer was begun").tensor(&spec.name),
            );
        };
        let need = spec.grid(manifest).n_blocks();
        let offset = self.body_len;
        let mut lengths: Vec<u32> = Vec::new();
        let mut sums = checksum::GroupHasher::default();
        for b in blocks {
            let b = b.as_ref();
            let len = u32::try_from(b.len())
                .map_err(|_| err(ErrorKind::TooLarge, format!("a block of {} bytes", b.len())))?;
            lengths.push(len);
            sums.block(b);
            self.w.write_all(b).map_err(write_err)?;
            self.body_len = add(self.body_len, b.len() as u64, "body size")?;
        }
        if lengths.len() as u64 != need {
            return Err(err(
                ErrorKind::BadValue,
                format!("{} blocks for a grid of {need}", lengths.len()),
            )
            .tensor(&spec.name));
        }
        let mut code = LengthCode::for_lengths(&lengths);
        code.at = self.index.len() as u64;
        self.index.extend(code.pack(&lengths));
        let sums = sums.finish();
        let sums_at = self.index.len() as u64;
        self.index.extend(sums.to_le_bytes());
        entries.push(tensor_json(
            spec,
            vec![
                ("data", json!([offset, self.body_len - offset])),
                (
                    "block_lengths",
                    json!({"at": code.at, "base": code.base, "step": code.step, "bits": code.bits}),
                ),
                ("block_crc32", json!({"at": sums_at, "group": sums.group})),
            ],
        ));
        Ok(())
    }

    /// Write the block index, the header and the footer; returns the
    /// writer (flushed).
    pub fn finish(mut self, arch: &ArchMeta) -> Result<W> {
        let layers = std::mem::take(&mut self.layers)
            .into_iter()
            .map(|(index, m, tensors)| {
                json!({"index": index, "manifest": m.to_json(true), "tensors": tensors})
            })
            .collect();
        let dense = std::mem::take(&mut self.dense);
        let dense = (!dense.is_empty()).then_some(Value::Object(dense));
        let header = header_json(arch, RKNOT_VERSION, layers, dense)?;
        let (index_len, header_len) = (self.index.len() as u64, header.len() as u64);
        if header_len > MAX_HEADER_LEN_V3 || index_len > MAX_INDEX_LEN {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "header {header_len} bytes / block index {index_len} bytes: above the \
                     caps readers apply ({MAX_HEADER_LEN_V3} / {MAX_INDEX_LEN})"
                ),
            ));
        }
        let mut footer = Vec::with_capacity(RKNOT_V3_FOOTER_LEN as usize);
        footer.extend_from_slice(&index_len.to_le_bytes());
        footer.extend_from_slice(&header_len.to_le_bytes());
        footer.extend_from_slice(RKNOT_V3_END_MAGIC);
        // The KSUM record ends the body: a CRC-32 of everything that is not
        // body (docs/FORMAT.md section 12).
        let mut crc = crc32fast::Hasher::new();
        crc.update(RKNOT_MAGIC_V3);
        crc.update(&[0, 0]);
        crc.update(&self.index);
        crc.update(&header);
        crc.update(&footer);
        self.w
            .write_all(&checksum::ksum_record(crc.finalize()))
            .map_err(write_err)?;
        self.w.write_all(&self.index).map_err(write_err)?;
        self.w.write_all(&header).map_err(write_err)?;
        self.w.write_all(&footer).map_err(write_err)?;
        self.w.flush().map_err(write_err)?;
        Ok(self.w)
    }
}

/// Write a .rknot file (version 3) from layers held in memory. Blocks are
/// laid out in layer, tensor, block order.
pub fn write_rknot<W: Write>(w: &mut W, arch: &ArchMeta, layers: &[LayerOut]) -> Result<()> {
    let mut out = RknotWriter::new(w)?;
    for l in layers {
        out.begin_layer(l.index, l.manifest.clone());
        for (spec, blocks) in &l.tensors {
            out.tensor(spec, blocks)?;
        }
    }
    out.finish(arch)?;
    Ok(())
}

/// Write the previous layout, version 2 (every block listed in the JSON
/// header). Nothing writes it any more but tests: they check that files
/// made by earlier releases keep opening and serving the same bytes.
pub fn write_rknot_v2<W: Write>(w: &mut W, arch: &ArchMeta, layers: &[LayerOut]) -> Result<()> {
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
            tj.push(tensor_json(spec, vec![("blocks", json!(table))]));
        }
        layer_json
            .push(json!({"index": l.index, "manifest": l.manifest.to_json(false), "tensors": tj}));
    }
    let bytes = header_json(arch, 2, layer_json, None)?;
    let header_len = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| u64::from(n) <= MAX_HEADER_LEN)
        .ok_or_else(|| err(ErrorKind::TooLarge, "header JSON is too large"))?;
    w.write_all(RKNOT_MAGIC_V2).map_err(write_err)?;
    w.write_all(&header_len.to_le_bytes()).map_err(write_err)?;
    w.write_all(&bytes).map_err(write_err)?;
    for l in layers {
        for (_, blocks) in &l.tensors {
            for b in blocks {
                w.write_all(b).map_err(write_err)?;
            }
        }
    }
    Ok(())
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
