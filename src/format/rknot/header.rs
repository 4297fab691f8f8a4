//! Reading a .rknot's layout and header: where header, index and body lie
//! (the version-2 prefix or the version-3 footer), the header JSON parsed
//! by streaming seeds into validated layers and tensors, and the check
//! that no two tensors' blocks overlap. Where each tensor's blocks are is
//! read by `index`.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Arc;

use serde::de::{self, MapAccess, SeqAccess};
use serde_json::value::RawValue;

use super::index::{BlocksSeed, IndexReader, LengthFields, group_sums, packed_blocks};
use super::{
    ArchMeta, Axis, BlockMode, BlockTable, LOSSLESS_BITS, Layout, LengthCode, MAX_BITS,
    MAX_HEADER_LEN, MAX_HEADER_LEN_V3, MAX_INDEX_LEN, MAX_LAYERS, MAX_TILE_ELEMS, Manifest,
    RKNOT_MAGIC_V2, RKNOT_MAGIC_V3, RKNOT_V2_PREFIX_LEN, RKNOT_V3_BODY_OFFSET, RKNOT_V3_END_MAGIC,
    RKNOT_V3_FOOTER_LEN, RknotLayer, RknotTensorInfo, TileGrid,
};
use crate::error::{ErrorKind, Result, err, mul};
use crate::format::checksum;
use crate::format::container::parse_table;
use crate::format::json::{
    AnyFound, Entries, Expect, F32Array, Field, Found, MaxLen, ObjectOf, OptStr, Parse, Seed, Seen,
    U64Array, raw_value, required, skip_value,
};
use crate::format::knot::{self, KnotTensorInfo};
use crate::format::meta::{JsonMeta, MetaBudget, Metadata, MetadataSeed};
use crate::format::{MAX_TENSORS, too_many_tensors};
use crate::names;
use crate::source::SourceFile;

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

/// Absolute offset of a span captured from the header, which starts at
/// `at` in the file.
fn base_of(raw: &RawValue, header: &[u8], at: u64) -> u64 {
    at + crate::format::json::span_of(raw, header).start as u64
}

pub(super) type Parsed = (
    ArchMeta,
    Vec<RknotLayer>,
    Vec<RknotTensorInfo>,
    Vec<KnotTensorInfo>,
);

/// Parse and validate the header JSON; block offsets are checked against
/// the body of `layout`, version 3's block lengths read from `src`'s index.
pub(super) fn parse_header(raw: &[u8], layout: &Layout, src: &SourceFile) -> Result<Parsed> {
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
                        layout.data_at(offset, length)
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
    let mode_name = required(r.mode, ctx, "mode")?;
    let mode = BlockMode::parse(&mode_name).ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            format!(
                "mode {mode_name:?} is not one of {}",
                BlockMode::ALL.map(|m| format!("{:?}", m.name())).join(", ")
            ),
        )
    })?;
    let bits = required(r.bits, ctx, "bits")?;
    if !(1..=u64::from(MAX_BITS)).contains(&bits) {
        return Err(err(
            ErrorKind::BadValue,
            format!("bits {bits} must be in 1..={MAX_BITS}"),
        ));
    }
    if mode.lossless_float().is_some() && bits != u64::from(LOSSLESS_BITS) {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "a {} tensor has bits {LOSSLESS_BITS}, not {bits}",
                mode.name()
            ),
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

impl Manifest {
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
}

/// No two blocks of the file may overlap.
pub(super) fn check_overlaps(tensors: &[RknotTensorInfo], dense: &[KnotTensorInfo]) -> Result<()> {
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
