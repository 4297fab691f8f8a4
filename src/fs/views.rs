//! Engine-ready views: whole-model files (`model.safetensors`,
//! `model.gguf`, `model.f16.safetensors`, `model.bf16.safetensors`) and
//! half-precision tensor files (`NAME.f16`, `NAME.bf16`), built from tensor
//! shapes and metadata only.
//!
//! A view is a *virtual file*: a [`Layout`] of header bytes followed by an
//! ordered list of [`Segment`]s, each the whole of one tensor encoded in the
//! view's [`ElemFormat`]; bytes between segments (GGUF alignment) are zero.
//! Nothing here decodes: [`Layout::pieces`] maps a byte range of the view to
//! header bytes, padding and tensor byte ranges, and the filesystem serves
//! the tensor ranges from the same decoded-chunk cache as the `.f32` files,
//! converting f32 to f16/bf16 on the fly ([`encode_into`]) so there is never
//! a second decoded copy.
//!
//! Inode numbers (stable across remounts of the same files, whatever
//! `--views` says): 4 `model.safetensors`, 5 `model.gguf`,
//! 6 `model.f16.safetensors`, 7 `model.bf16.safetensors`; the tensor file of
//! the i-th served tensor in format k (0 f32, 1 f16, 2 bf16) is
//! `16 + i + k * 2^32`, so `.f32` inodes keep their `16 + i`;
//! `hf/model.safetensors` in format k is `2^47 + 5 + k` ([`super::hf`]).

use std::borrow::Cow;
use std::ops::Range;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use serde_json::json;

use crate::error::{ErrorKind, Result, add, err, mul, product};
use crate::format::gguf::{self, ALIGNMENT_KEY, DEFAULT_ALIGNMENT};
use crate::format::meta::{MetaValue, Metadata};
use crate::quant::GgmlType;

/// Inode of `model.safetensors` (F32).
pub const SAFETENSORS_INO: u64 = 4;
/// Inode of `model.gguf`.
pub const GGUF_INO: u64 = 5;
/// Inode of `model.f16.safetensors`.
pub const F16_SAFETENSORS_INO: u64 = 6;
/// Inode of `model.bf16.safetensors`.
pub const BF16_SAFETENSORS_INO: u64 = 7;
/// Tensor files of format k live at `16 + i + k * FORMAT_INO_STRIDE`.
pub const FORMAT_INO_STRIDE: u64 = 1 << 32;

/// The reference safetensors implementation refuses headers larger than
/// this (`MAX_HEADER_SIZE`).
pub const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;

/// Metadata arrays longer than this are summarized in `__metadata__` only
/// when the full header would pass [`SAFETENSORS_MAX_HEADER`].
const SUMMARY_ARRAY_LIMIT: usize = 1024;

/// Elements converted per batch when encoding f16/bf16 (a stack buffer: no
/// allocation per read).
const ENCODE_BATCH: usize = 2048;

/// How a view stores each element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemFormat {
    F32,
    F16,
    Bf16,
}

impl ElemFormat {
    pub const ALL: [ElemFormat; 3] = [ElemFormat::F32, ElemFormat::F16, ElemFormat::Bf16];

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            ElemFormat::F32 => 4,
            ElemFormat::F16 | ElemFormat::Bf16 => 2,
        }
    }

    /// File extension and `--views` spelling.
    pub fn ext(self) -> &'static str {
        match self {
            ElemFormat::F32 => "f32",
            ElemFormat::F16 => "f16",
            ElemFormat::Bf16 => "bf16",
        }
    }

    /// safetensors dtype.
    pub fn dtype(self) -> &'static str {
        match self {
            ElemFormat::F32 => "F32",
            ElemFormat::F16 => "F16",
            ElemFormat::Bf16 => "BF16",
        }
    }

    /// k in the inode scheme (module docs).
    pub fn ordinal(self) -> u64 {
        match self {
            ElemFormat::F32 => 0,
            ElemFormat::F16 => 1,
            ElemFormat::Bf16 => 2,
        }
    }

    pub fn from_ordinal(k: u64) -> Option<ElemFormat> {
        ElemFormat::ALL.into_iter().find(|f| f.ordinal() == k)
    }

    pub fn from_ext(s: &str) -> Option<ElemFormat> {
        ElemFormat::ALL.into_iter().find(|f| f.ext() == s)
    }
}

/// The per-tensor formats a mount serves (`--views`). f32 is always
/// served: the `.f32` files and the F32 model views are the mount's base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ViewSet {
    pub f16: bool,
    pub bf16: bool,
}

impl ViewSet {
    /// Parse `f32,f16,bf16` (`,` or `+` separated; `+` is what fits in a
    /// `-o` list). Unknown entries are an error naming them.
    pub fn parse(list: &str) -> std::result::Result<ViewSet, String> {
        let mut v = ViewSet::default();
        for item in list
            .split([',', '+'])
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            match ElemFormat::from_ext(item) {
                Some(ElemFormat::F32) => {}
                Some(ElemFormat::F16) => v.f16 = true,
                Some(ElemFormat::Bf16) => v.bf16 = true,
                None => {
                    return Err(format!(
                        "unknown view {item:?} in {list:?} (views: f32, f16, bf16)"
                    ));
                }
            }
        }
        Ok(v)
    }

    pub fn has(self, fmt: ElemFormat) -> bool {
        match fmt {
            ElemFormat::F32 => true,
            ElemFormat::F16 => self.f16,
            ElemFormat::Bf16 => self.bf16,
        }
    }

    /// Served formats, f32 first.
    pub fn formats(self) -> Vec<ElemFormat> {
        ElemFormat::ALL
            .into_iter()
            .filter(|f| self.has(*f))
            .collect()
    }

    /// `f32,f16` style list.
    pub fn names(self) -> String {
        self.formats()
            .iter()
            .map(|f| f.ext())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The whole-model views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelView {
    Safetensors(ElemFormat),
    Gguf,
    /// `hf/model.safetensors` (and its F16/BF16 forms): Hugging Face names
    /// and row order ([`super::hf`]).
    Hf(ElemFormat),
}

impl ModelView {
    /// In listing order.
    pub const ALL: [ModelView; 7] = [
        ModelView::Safetensors(ElemFormat::F32),
        ModelView::Gguf,
        ModelView::Safetensors(ElemFormat::F16),
        ModelView::Safetensors(ElemFormat::Bf16),
        ModelView::Hf(ElemFormat::F32),
        ModelView::Hf(ElemFormat::F16),
        ModelView::Hf(ElemFormat::Bf16),
    ];

    /// Path in the mount.
    pub fn name(self) -> &'static str {
        match self {
            ModelView::Safetensors(ElemFormat::F32) => "model.safetensors",
            ModelView::Safetensors(ElemFormat::F16) => "model.f16.safetensors",
            ModelView::Safetensors(ElemFormat::Bf16) => "model.bf16.safetensors",
            ModelView::Gguf => "model.gguf",
            ModelView::Hf(ElemFormat::F32) => "hf/model.safetensors",
            ModelView::Hf(ElemFormat::F16) => "hf/model.f16.safetensors",
            ModelView::Hf(ElemFormat::Bf16) => "hf/model.bf16.safetensors",
        }
    }

    /// Name in its directory.
    pub fn file_name(self) -> &'static str {
        let n = self.name();
        n.rsplit_once('/').map_or(n, |(_, f)| f)
    }

    /// Whether it lives in `hf/` (else in the root).
    pub fn in_hf_dir(self) -> bool {
        matches!(self, ModelView::Hf(_))
    }

    pub fn ino(self) -> u64 {
        match self {
            ModelView::Safetensors(ElemFormat::F32) => SAFETENSORS_INO,
            ModelView::Safetensors(ElemFormat::F16) => F16_SAFETENSORS_INO,
            ModelView::Safetensors(ElemFormat::Bf16) => BF16_SAFETENSORS_INO,
            ModelView::Gguf => GGUF_INO,
            ModelView::Hf(f) => super::hf::safetensors_ino(f),
        }
    }

    pub fn format(self) -> ElemFormat {
        match self {
            ModelView::Safetensors(f) | ModelView::Hf(f) => f,
            ModelView::Gguf => ElemFormat::F32,
        }
    }

    /// The F32 views are always offered (when they can be built); the
    /// half-precision safetensors only when `--views` asks for the format.
    pub fn requested(self, set: ViewSet) -> bool {
        set.has(self.format())
    }
}

/// One tensor of a virtual file: bytes `[start, start + len)` of the view
/// are tensor file `file` encoded in the view's format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub start: u64,
    pub len: u64,
    /// Index of the tensor file (the filesystem's table, not the backend's).
    pub file: usize,
    /// The segment's rows in another order than the tensor file's (the
    /// `hf/` view's Q/K projections); `None`: the file's bytes as they are.
    pub rows: Option<RowPerm>,
}

/// A row order within groups of rows: row `r` of the segment is row
/// `src_row(r)` of the tensor file. Rows come in `groups` groups of
/// `group_rows` (even) rows of `row_elems` elements; within a group, the
/// segment's row `j * group_rows / 2 + i` is the file's row `2 * i + j`
/// (j in 0..2). That is the inverse of the permutation llama.cpp's
/// converter applies to llama's Q and K projections (a group is a head:
/// llama.cpp interleaves the two rotary halves of each head, Hugging Face
/// keeps them apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowPerm {
    pub groups: u64,
    pub group_rows: u64,
    pub row_elems: u64,
}

impl RowPerm {
    /// The tensor file's row behind row `r` of the segment.
    pub fn src_row(&self, r: u64) -> u64 {
        let g = self.group_rows.max(2);
        let half = g / 2;
        let (head, rem) = (r / g, r % g);
        head * g + 2 * (rem % half) + rem / half
    }

    /// Rows of the tensor.
    pub fn rows(&self) -> u64 {
        self.groups.saturating_mul(self.group_rows)
    }
}

impl Segment {
    /// `Layout::new` checked that this does not overflow; saturating for
    /// segments built elsewhere (`chunks_after` takes any slice).
    fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }

    /// The byte ranges of the tensor file (in a format of `bpe` bytes per
    /// element) that make up bytes `range` of the segment, in order: the
    /// range itself, or one range per row the range touches when the rows
    /// are permuted.
    pub fn source_ranges(&self, range: Range<u64>, bpe: u64) -> Vec<Range<u64>> {
        let Some(p) = self.rows else {
            return vec![range];
        };
        let row_bytes = p.row_elems.saturating_mul(bpe).max(1);
        let mut out = Vec::new();
        let mut pos = range.start;
        while pos < range.end {
            let row = pos / row_bytes;
            let row_end = ((row + 1) * row_bytes).min(range.end);
            let src = p.src_row(row) * row_bytes + (pos - row * row_bytes);
            out.push(src..src + (row_end - pos));
            pos = row_end;
        }
        out
    }

    /// The tensor file's element behind element `e` of the segment.
    pub fn src_elem(&self, e: u64) -> u64 {
        match self.rows {
            Some(p) if p.row_elems > 0 => {
                p.src_row(e / p.row_elems) * p.row_elems + e % p.row_elems
            }
            _ => e,
        }
    }
}

/// Where the bytes of part of a read come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// These bytes of the header.
    Header(Range<usize>),
    /// This many zero bytes (alignment padding).
    Zeros(usize),
    /// Bytes `range` (relative to the segment's start, in the view's
    /// format) of segment `seg`.
    Tensor { seg: usize, range: Range<u64> },
}

/// A virtual file: header bytes, then segments in increasing order, zeros
/// in any gap and after the last segment up to `size`.
#[derive(Debug, Clone)]
pub struct Layout {
    header: Vec<u8>,
    fmt: ElemFormat,
    segments: Vec<Segment>,
    size: u64,
}

impl Layout {
    /// Check that segments follow the header, are in order, do not overlap,
    /// hold whole elements and end within `size`.
    pub fn new(
        header: Vec<u8>,
        fmt: ElemFormat,
        segments: Vec<Segment>,
        size: u64,
    ) -> Result<Layout> {
        let mut pos = header.len() as u64;
        for s in &segments {
            let end = add(s.start, s.len, "view segment end")?;
            let rows_fit = s.rows.is_none_or(|p| {
                p.group_rows >= 2
                    && p.group_rows.is_multiple_of(2)
                    && p.rows()
                        .checked_mul(p.row_elems)
                        .and_then(|n| n.checked_mul(fmt.bytes()))
                        == Some(s.len)
            });
            if s.start < pos || !s.len.is_multiple_of(fmt.bytes()) || !rows_fit {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "internal error: view segment [{}, {end}) overlaps byte {pos}, holds \
                         a partial element or permutes rows it does not have",
                        s.start
                    ),
                ));
            }
            pos = end;
        }
        if pos > size {
            return Err(err(
                ErrorKind::BadValue,
                format!("internal error: view segments end at {pos}, past the size {size}"),
            ));
        }
        // `stat` reports sizes as a signed 64-bit number.
        if size > i64::MAX as u64 {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "the view would be {size} bytes, more than the largest file size stat can \
                     report (2^63 - 1 bytes)"
                ),
            ));
        }
        Ok(Layout {
            header,
            fmt,
            segments,
            size,
        })
    }

    pub fn header(&self) -> &[u8] {
        &self.header
    }

    pub fn fmt(&self) -> ElemFormat {
        self.fmt
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Where bytes `[offset, end)` (clipped to the size) come from, in
    /// order. Empty at or past the end.
    pub fn pieces(&self, offset: u64, end: u64) -> Vec<Piece> {
        let end = end.min(self.size);
        let mut out = Vec::new();
        let mut pos = offset;
        let hlen = self.header.len() as u64;
        if pos < end && pos < hlen {
            let e = end.min(hlen);
            // Both are at most the header's length, which is a usize.
            out.push(Piece::Header(pos as usize..e as usize));
            pos = e;
        }
        let mut i = self.segments.partition_point(|s| s.end() <= pos);
        while pos < end {
            match self.segments.get(i) {
                Some(s) if pos < s.start => {
                    let e = end.min(s.start);
                    // A gap inside one read: bounded by the read's size.
                    out.push(Piece::Zeros((e - pos) as usize));
                    pos = e;
                }
                Some(s) => {
                    let e = end.min(s.end());
                    if e > pos {
                        out.push(Piece::Tensor {
                            seg: i,
                            range: pos - s.start..e - s.start,
                        });
                    }
                    pos = e;
                    i += 1;
                }
                None => {
                    out.push(Piece::Zeros((end - pos) as usize));
                    pos = end;
                }
            }
        }
        out
    }
}

/// Up to `n` (tensor file, chunk) pairs a sequential reader of `segments`
/// (elements of `bpe` bytes) will need after byte `end`: the chunks after
/// the one holding byte `end - 1`, continuing into the following segments.
/// `chunk_elems(file)` is that file's chunk length in elements.
pub fn chunks_after(
    segments: &[Segment],
    bpe: u64,
    end: u64,
    n: u64,
    chunk_elems: impl Fn(usize) -> u64,
) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    let mut i = segments.partition_point(|s| s.end() <= end);
    let mut first = match segments.get(i) {
        Some(s) if end > s.start => {
            let ce = chunk_elems(s.file).max(1);
            s.src_elem((end - s.start - 1) / bpe) / ce + 1
        }
        _ => 0,
    };
    while (out.len() as u64) < n {
        let Some(s) = segments.get(i) else { break };
        let ce = chunk_elems(s.file).max(1);
        let n_chunks = (s.len / bpe).div_ceil(ce);
        let mut c = first;
        while c < n_chunks && (out.len() as u64) < n {
            out.push((s.file, c));
            c += 1;
        }
        first = 0;
        i += 1;
    }
    out
}

/// Append bytes `[skip, skip + take)` of `vals` encoded little-endian as
/// `fmt` to `out`. f16 and bf16 round to nearest, ties to even (the `half`
/// crate; F16C instructions when the CPU has them).
pub fn encode_into(fmt: ElemFormat, vals: &[f32], skip: usize, take: usize, out: &mut Vec<u8>) {
    if fmt == ElemFormat::F32 {
        let bytes = bytemuck::cast_slice::<f32, u8>(vals);
        let end = (skip + take).min(bytes.len());
        out.extend_from_slice(&bytes[skip.min(end)..end]);
        return;
    }
    let end = skip + take;
    let mut buf = [0u16; ENCODE_BATCH];
    let mut pos = 0usize;
    for batch in vals.chunks(ENCODE_BATCH) {
        if pos >= end {
            break;
        }
        let nb = batch.len() * 2;
        if pos + nb > skip {
            let dst = &mut buf[..batch.len()];
            match fmt {
                ElemFormat::F16 => dst
                    .reinterpret_cast_mut::<f16>()
                    .convert_from_f32_slice(batch),
                // Bf16 (f32 returned above).
                _ => dst
                    .reinterpret_cast_mut::<bf16>()
                    .convert_from_f32_slice(batch),
            }
            // The crate serves little-endian hosts only (as for f32).
            let bytes = bytemuck::cast_slice::<u16, u8>(dst);
            let lo = skip.saturating_sub(pos);
            let hi = nb.min(end - pos);
            out.extend_from_slice(&bytes[lo..hi]);
        }
        pos += nb;
    }
}

// ---------------------------------------------------------------------------
// Building the views (shapes and metadata only: nothing is decoded)

/// One tensor as the view builders see it.
#[derive(Debug, Clone)]
pub struct ViewTensor<'a> {
    /// Index of the tensor file.
    pub file: usize,
    /// Canonical dot name.
    pub name: &'a str,
    /// Served shape, outer-first.
    pub shape: &'a [u64],
    pub n_elements: u64,
    /// Rows served in another order (the `hf/` view).
    pub rows: Option<RowPerm>,
}

/// Bytes of `t` in `fmt`, after checking that its shape holds its elements.
fn tensor_len(t: &ViewTensor, fmt: ElemFormat) -> Result<u64> {
    let n = product(t.shape, "element count").map_err(|e| e.tensor(t.name))?;
    if n != t.n_elements {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "shape {:?} holds {n} elements, not {}",
                t.shape, t.n_elements
            ),
        )
        .tensor(t.name));
    }
    mul(n, fmt.bytes(), "tensor bytes").map_err(|e| e.tensor(t.name))
}

/// A metadata value as a safetensors `__metadata__` string: strings as
/// they are; numbers and bools as JSON text (floats in their shortest
/// round-trip form, non-finite ones as `nan`, `inf`, `-inf`); arrays as
/// JSON array text (non-finite floats inside as the strings "nan", ...).
pub fn meta_string(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) => s.clone(),
        MetaValue::F32(x) if !x.is_finite() => nonfinite(f64::from(*x)).to_string(),
        MetaValue::F64(x) if !x.is_finite() => nonfinite(*x).to_string(),
        other => {
            let mut s = String::new();
            json_text(other, &mut s);
            s
        }
    }
}

fn nonfinite(x: f64) -> &'static str {
    if x.is_nan() {
        "nan"
    } else if x > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

fn json_text(v: &MetaValue, out: &mut String) {
    use std::fmt::Write as _;
    // Writing to a String cannot fail.
    let _ = match v {
        MetaValue::String(s) => {
            out.push_str(&json_str(s));
            Ok(())
        }
        MetaValue::F32(x) if x.is_finite() => write!(out, "{x:?}"),
        MetaValue::F64(x) if x.is_finite() => write!(out, "{x:?}"),
        MetaValue::F32(x) => write!(out, "\"{}\"", nonfinite(f64::from(*x))),
        MetaValue::F64(x) => write!(out, "\"{}\"", nonfinite(*x)),
        MetaValue::Bool(b) => write!(out, "{b}"),
        MetaValue::U8(x) => write!(out, "{x}"),
        MetaValue::I8(x) => write!(out, "{x}"),
        MetaValue::U16(x) => write!(out, "{x}"),
        MetaValue::I16(x) => write!(out, "{x}"),
        MetaValue::U32(x) => write!(out, "{x}"),
        MetaValue::I32(x) => write!(out, "{x}"),
        MetaValue::U64(x) => write!(out, "{x}"),
        MetaValue::I64(x) => write!(out, "{x}"),
        MetaValue::Array { values, .. } => {
            out.push('[');
            for (i, x) in values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_text(x, out);
            }
            out.push(']');
            Ok(())
        }
    };
}

/// A built view and what a reader should know about it.
#[derive(Debug, Clone)]
pub struct Built {
    pub layout: Layout,
    pub notes: Vec<String>,
}

/// `model.safetensors` (or its F16/BF16 form): u64 LE header length N, N
/// bytes of JSON padded with spaces to a multiple of 8 (as the reference
/// implementation writes it, so the data starts 8-aligned), then every
/// tensor's bytes, contiguous, in the given order. The JSON holds
/// `__metadata__` (every key/value as a string, [`meta_string`]) and one
/// entry per tensor: dtype, outer-first shape, `data_offsets` relative to
/// the data.
pub fn safetensors(tensors: &[ViewTensor], md: &Metadata, fmt: ElemFormat) -> Result<Built> {
    let mut v = safetensors_all(tensors, md, &[fmt]);
    v.pop()
        .unwrap_or_else(|| Err(err(ErrorKind::BadValue, "no safetensors view built")))
}

/// [`safetensors`] in each of `fmts`, sharing the `__metadata__` text
/// (for a 150k-token vocabulary it is megabytes of JSON).
pub fn safetensors_all(
    tensors: &[ViewTensor],
    md: &Metadata,
    fmts: &[ElemFormat],
) -> Vec<Result<Built>> {
    if fmts.is_empty() {
        // Nothing to build; skip rendering the metadata (megabytes of JSON
        // for a large vocabulary).
        return Vec::new();
    }
    // The full `__metadata__`, unless it alone passes safetensors' limit
    // (then every format gets the summarized one: no header is built
    // beyond the limit).
    let mut full = metadata_json(md, false);
    let mut summarized: Option<String> = None;
    let note = || {
        format!(
            "__metadata__ arrays longer than {SUMMARY_ARRAY_LIMIT} are summarized \
             (the full header would pass safetensors' {SAFETENSORS_MAX_HEADER}-byte limit)"
        )
    };
    let last = fmts.len() - 1;
    fmts.iter()
        .enumerate()
        .map(|(i, &fmt)| {
            // The last format takes the text's buffer as its header.
            let full_meta = match &mut full {
                Some(text) if i == last => Some(Cow::Owned(std::mem::take(text))),
                Some(text) => Some(Cow::Borrowed(text.as_str())),
                None => None,
            };
            let tried = full_meta.map(|m| safetensors_with(tensors, m, fmt));
            match tried {
                Some(Err(e)) if e.kind() != ErrorKind::TooLarge => Err(e),
                Some(Ok(layout)) => Ok(Built {
                    layout,
                    notes: Vec::new(),
                }),
                _ => {
                    let meta = match &summarized {
                        Some(m) => m,
                        None => summarized.insert(
                            metadata_json(md, true)
                                .ok_or_else(|| err(ErrorKind::TooLarge, note()))?,
                        ),
                    };
                    let layout = safetensors_with(tensors, Cow::Borrowed(meta.as_str()), fmt)?;
                    Ok(Built {
                        layout,
                        notes: vec![note()],
                    })
                }
            }
        })
        .collect()
}

/// JSON text of a string (escaped and quoted).
fn json_str(s: &str) -> String {
    // Serializing a str cannot fail.
    serde_json::to_string(s).unwrap_or_default()
}

/// Append `s` to `out` JSON-escaped, without the quotes: exactly what
/// serde_json writes between them (`"` and `\\` escaped, the control
/// characters as `\b`, `\t`, `\n`, `\f`, `\r` or `\u00xx`, nothing else).
fn push_escaped(out: &mut String, s: &str) {
    let mut plain = 0;
    for (i, b) in s.bytes().enumerate() {
        let Some(e) = escape_of(b) else { continue };
        // Every byte escaped is ASCII, so these are char boundaries.
        out.push_str(&s[plain..i]);
        out.push_str(&e);
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
}

/// The JSON escape of byte `b` ([`push_escaped`]), None for a byte
/// written as it is.
fn escape_of(b: u8) -> Option<std::borrow::Cow<'static, str>> {
    Some(match b {
        b'"' => "\\\"".into(),
        b'\\' => "\\\\".into(),
        0x08 => "\\b".into(),
        b'\t' => "\\t".into(),
        b'\n' => "\\n".into(),
        0x0c => "\\f".into(),
        b'\r' => "\\r".into(),
        0x00..=0x1f => format!("\\u{b:04x}").into(),
        _ => return None,
    })
}

/// Length of `s` JSON-escaped once (`twice`: escaped, quoted, and that
/// escaped again: a string element of an array in `__metadata__`).
fn escaped_len(s: &str, twice: bool) -> usize {
    let specials: usize = s
        .bytes()
        .map(|b| match escape_of(b) {
            None => 0,
            Some(e) if twice => {
                e.bytes()
                    .map(|x| escape_of(x).map_or(1, |d| d.len()))
                    .sum::<usize>()
                    - 1
            }
            Some(e) => e.len() - 1,
        })
        .sum();
    s.len() + specials + if twice { 4 } else { 0 }
}

/// Append `s` as a JSON string (quoted, escaped), escaped again: how a
/// string element of an array stands in `__metadata__`'s text.
fn push_escaped_twice(out: &mut String, s: &str) {
    out.push_str("\\\"");
    let mut plain = 0;
    for (i, b) in s.bytes().enumerate() {
        let Some(e) = escape_of(b) else { continue };
        // Every byte escaped is ASCII, so these are char boundaries.
        out.push_str(&s[plain..i]);
        push_escaped(out, &e);
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
    out.push_str("\\\"");
}

/// Append the `__metadata__` string of `v` ([`meta_string`]) to `out` as
/// a JSON string, escaped on the way: a long array is never held as text
/// and again escaped (for a vocabulary, tens of megabytes each). False,
/// with `out` grown by at most `limit` bytes, when `out` would pass
/// `limit`: nothing is built beyond it, however the value escapes.
fn push_meta_string(out: &mut String, v: &MetaValue, limit: usize) -> bool {
    let fits = |out: &String, more: usize| out.len().saturating_add(more) <= limit;
    out.push('"');
    match v {
        MetaValue::Array { values, .. } => {
            let mut element = String::new();
            out.push('[');
            for (i, x) in values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if let MetaValue::String(s) = x {
                    if !fits(out, escaped_len(s, true)) {
                        return false;
                    }
                    push_escaped_twice(out, s);
                    continue;
                }
                // Numbers, bools, nested arrays: short, or checked as
                // they grow (a nested array's elements are each short).
                element.clear();
                json_text(x, &mut element);
                if !fits(out, escaped_len(&element, false)) {
                    return false;
                }
                push_escaped(out, &element);
            }
            out.push(']');
        }
        MetaValue::String(s) => {
            if !fits(out, escaped_len(s, false)) {
                return false;
            }
            push_escaped(out, s);
        }
        other => push_escaped(out, &meta_string(other)),
    }
    out.push('"');
    fits(out, 0)
}

/// `{"__metadata__":` and the `__metadata__` object as JSON text: every
/// key/value as a string; with `summarize`, long arrays as a summary
/// object's text. The start of a safetensors header ([`safetensors_with`]).
/// None once it passes [`SAFETENSORS_MAX_HEADER`]: no header can hold it.
fn metadata_json(md: &Metadata, summarize: bool) -> Option<String> {
    let mut out = String::from(METADATA_PREFIX);
    out.push('{');
    for (i, (k, v)) in md.entries.iter().enumerate() {
        if out.len() > MAX_METADATA_JSON {
            return None;
        }
        if i > 0 {
            out.push(',');
        }
        out.push_str(&json_str(k));
        out.push(':');
        match v {
            MetaValue::Array { elem, values }
                if summarize && values.len() > SUMMARY_ARRAY_LIMIT =>
            {
                out.push_str(&json_str(
                    &json!({"type": "array", "elem_type": elem.name(), "len": values.len(), "omitted": true})
                        .to_string(),
                ));
            }
            _ => {
                if !push_meta_string(&mut out, v, MAX_METADATA_JSON) {
                    return None;
                }
            }
        }
    }
    out.push('}');
    (out.len() <= MAX_METADATA_JSON).then_some(out)
}

/// The start of a safetensors header whose `__metadata__` is the JSON
/// object `object` (for [`safetensors_with`]).
pub(super) fn header_start(object: &str) -> String {
    format!("{METADATA_PREFIX}{object}")
}

/// The longest `__metadata__` text built: safetensors' header limit.
const MAX_METADATA_JSON: usize = SAFETENSORS_MAX_HEADER as usize;

/// What a safetensors header starts with: 8 bytes for its length (written
/// over these spaces when the header is done), then the JSON.
const METADATA_PREFIX: &str = "        {\"__metadata__\":";

/// A safetensors layout whose header starts with `meta_json` (from
/// [`metadata_json`]: the length's 8 bytes, then `{"__metadata__":{...}`).
/// The header is built in `meta_json`'s own buffer when the caller gives
/// it away (one view), copied from it otherwise.
pub(super) fn safetensors_with(
    tensors: &[ViewTensor],
    meta_json: Cow<'_, str>,
    fmt: ElemFormat,
) -> Result<Layout> {
    use std::fmt::Write as _;
    let mut json = meta_json.into_owned();
    json.reserve(128 * tensors.len() + 32);
    let mut names = std::collections::HashSet::with_capacity(tensors.len());
    let mut spans = Vec::with_capacity(tensors.len());
    let mut off = 0u64;
    for t in tensors {
        if t.name == "__metadata__" || !names.insert(t.name) {
            return Err(err(
                ErrorKind::BadName,
                "a safetensors file cannot hold two tensors of one name, nor one named __metadata__",
            )
            .tensor(t.name));
        }
        let len = tensor_len(t, fmt)?;
        let end = add(off, len, "safetensors data size")?;
        let shape = t
            .shape
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        // Writing to a String cannot fail.
        let _ = write!(
            json,
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{shape}],\"data_offsets\":[{off},{end}]}}",
            json_str(t.name),
            fmt.dtype()
        );
        spans.push((off, len));
        off = end;
    }
    json.push('}');
    // Spaces, as the reference writer pads: the data then starts 8-aligned.
    let padded = (json.len() - 8).next_multiple_of(8);
    let n = padded as u64;
    if n > SAFETENSORS_MAX_HEADER {
        return Err(err(
            ErrorKind::TooLarge,
            format!(
                "safetensors header of {n} bytes exceeds the {SAFETENSORS_MAX_HEADER}-byte limit"
            ),
        ));
    }
    let base = 8 + n;
    // Every segment ends by `size`, so computing it first bounds them all.
    let size = add(base, off, "safetensors size")?;
    let mut header = json.into_bytes();
    header[..8].copy_from_slice(&n.to_le_bytes());
    header.resize(padded + 8, b' ');
    let segments = tensors
        .iter()
        .zip(&spans)
        .map(|(t, &(o, len))| Segment {
            start: base + o,
            len,
            file: t.file,
            rows: t.rows,
        })
        .collect();
    Layout::new(header, fmt, segments, size)
}

/// The key/values llama.cpp needs before it can load a model, missing from
/// `md`: the architecture, its block count, embedding length and context
/// length, and the tokenizer (model, and tokens unless it has none).
pub fn gguf_missing_keys(md: &Metadata) -> Vec<String> {
    let mut missing = Vec::new();
    match md.architecture() {
        Some(arch) => {
            for k in ["block_count", "embedding_length", "context_length"] {
                if md.arch_u64(k).is_none() {
                    missing.push(format!("{arch}.{k}"));
                }
            }
        }
        None => missing.push("general.architecture".to_string()),
    }
    match md.get("tokenizer.ggml.model").and_then(MetaValue::as_str) {
        Some("none" | "no_vocab") => {}
        Some(_) => {
            if !matches!(
                md.get("tokenizer.ggml.tokens"),
                Some(MetaValue::Array { .. })
            ) {
                missing.push("tokenizer.ggml.tokens".to_string());
            }
        }
        None => missing.push("tokenizer.ggml.model".to_string()),
    }
    missing
}

/// What the served tensors lack for llama.cpp to build the model, as far as
/// can be told without the architecture's tensor list: the token embedding,
/// and tensors of every block `0..<arch>.block_count`. (A .rknot without
/// its dense fallback carries only the layers it compresses.)
pub fn gguf_missing_tensors(md: &Metadata, names: &[&str]) -> Vec<String> {
    let mut missing = Vec::new();
    if !names.contains(&"token_embd.weight") {
        missing.push("token_embd.weight".to_string());
    }
    if let Some(blocks) = md.arch_u64("block_count") {
        let present: std::collections::HashSet<u64> = names
            .iter()
            .filter_map(|n| n.strip_prefix("blk.")?.split('.').next()?.parse().ok())
            .filter(|&b| b < blocks)
            .collect();
        if (present.len() as u64) < blocks {
            missing.push(format!(
                "tensors of {} of the {blocks} blocks",
                blocks - present.len() as u64
            ));
        }
    }
    missing
}

/// The view's key/values and alignment: the model's, with
/// `general.file_type` set to 0 (ALL_F32: every tensor is F32 here) and
/// `general.alignment` kept (as a u32) when it is valid, 32 when absent.
pub fn gguf_metadata(md: &Metadata) -> Result<(Metadata, u64)> {
    let (overrides, alignment) = gguf_overrides(md)?;
    let mut out = Metadata::default();
    for (k, v) in &md.entries {
        let v = overrides
            .iter()
            .find(|(o, _)| *o == k.as_str())
            .map_or_else(|| v.clone(), |(_, o)| o.clone());
        out.push(k.clone(), v);
    }
    for (k, v) in overrides {
        if md.get(k).is_none() {
            out.push(k, v);
        }
    }
    Ok((out, alignment))
}

/// What `model.gguf` changes in the source's key/values (every tensor is
/// F32: `general.file_type` 0; the alignment as u32), and the alignment.
/// [`gguf`] encodes the source's metadata with these in place, without a
/// copy of it; [`gguf_metadata`] is the same as a value.
fn gguf_overrides(md: &Metadata) -> Result<(Vec<(&'static str, MetaValue)>, u64)> {
    const FILE_TYPE: &str = "general.file_type";
    let alignment = match md.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_u64().ok_or_else(|| {
                err(
                    ErrorKind::BadValue,
                    format!("{ALIGNMENT_KEY} = {} is not an integer", v.summary()),
                )
            })?;
            gguf::check_alignment(a)?;
            a
        }
    };
    // check_alignment bounds it by MAX_ALIGNMENT, so it fits in a u32.
    let alignment_u32 = u32::try_from(alignment).map_err(|_| {
        err(
            ErrorKind::BadValue,
            format!("{ALIGNMENT_KEY} = {alignment}"),
        )
    })?;
    let mut overrides = vec![(FILE_TYPE, MetaValue::U32(0))];
    if md.get(ALIGNMENT_KEY).is_some() {
        overrides.push((ALIGNMENT_KEY, MetaValue::U32(alignment_u32)));
    }
    Ok((overrides, alignment))
}

/// `model.gguf`: a GGUF v3 header from [`gguf::encode_header`] (the
/// key/values of [`gguf_metadata`], every tensor as F32 with its dot name
/// and ne-order dims), then each tensor's f32 bytes at its aligned offset,
/// zeros between them and after the last up to the alignment (as
/// [`gguf::write_gguf`] writes a file).
pub fn gguf(tensors: &[ViewTensor], md: &Metadata) -> Result<Built> {
    let (overrides, alignment) = gguf_overrides(md)?;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut lens = Vec::with_capacity(tensors.len());
    for t in tensors {
        lens.push(tensor_len(t, ElemFormat::F32)?);
        let ne: Vec<u64> = t.shape.iter().rev().copied().collect();
        infos.push((t.name.to_string(), ne, GgmlType::F32));
    }
    let (header, offsets) = gguf::encode_header_with(md, &overrides, &infos, alignment)?;
    let base = header.len() as u64;
    let mut segments = Vec::with_capacity(tensors.len());
    let mut data_end = 0u64;
    for ((t, &off), &len) in tensors.iter().zip(&offsets).zip(&lens) {
        segments.push(Segment {
            start: add(base, off, "gguf tensor offset")?,
            len,
            file: t.file,
            rows: None,
        });
        data_end = add(off, len, "gguf data size")?;
    }
    let size = add(base, gguf::align_up(data_end, alignment)?, "gguf size")?;
    Ok(Built {
        layout: Layout::new(header, ElemFormat::F32, segments, size)?,
        notes: vec![format!(
            "general.file_type = 0 (all F32), alignment {alignment}"
        )],
    })
}

#[cfg(test)]
mod tests {

    /// The streamed escaping is serde_json's, byte for byte, and the
    /// streamed `__metadata__` strings are [`meta_string`]'s, escaped.
    #[test]
    fn streamed_metadata_text_is_what_serde_json_writes() {
        let mut all: String = (0u8..=0x7f).map(char::from).collect();
        all.push_str("é\u{2028}\u{10ffff}\"\\\u{7f}x");
        for s in [all.as_str(), "", "plain", "\"", "a\u{0}b\u{1f}"] {
            let mut got = String::new();
            push_escaped(&mut got, s);
            assert_eq!(format!("\"{got}\""), json_str(s), "{s:?}");
        }
        let values = [
            MetaValue::String(all.clone()),
            MetaValue::F32(f32::NAN),
            MetaValue::F64(-1.5),
            MetaValue::U64(u64::MAX),
            MetaValue::Bool(true),
            MetaValue::Array {
                elem: crate::format::meta::MetaType::String,
                values: vec![
                    MetaValue::String(all.clone()),
                    MetaValue::String("\n".into()),
                ],
            },
            MetaValue::Array {
                elem: crate::format::meta::MetaType::F32,
                values: vec![MetaValue::F32(f32::INFINITY), MetaValue::F32(0.25)],
            },
        ];
        for v in &values {
            let mut got = String::new();
            assert!(push_meta_string(&mut got, v, usize::MAX));
            let want = json_str(&meta_string(v));
            assert_eq!(got, want, "{v:?}");
            // A limit one byte short refuses it; one at half its length
            // stops it near there (a string or array is not built past the
            // limit but for its closing characters).
            let mut short = String::new();
            assert!(!push_meta_string(&mut short, v, want.len() - 1), "{v:?}");
            if matches!(v, MetaValue::String(_) | MetaValue::Array { .. }) {
                let mut half = String::new();
                assert!(!push_meta_string(&mut half, v, want.len() / 2), "{v:?}");
                assert!(half.len() <= want.len() / 2 + 2, "{v:?}: {}", half.len());
            }
        }
        for s in [all.as_str(), "", "\u{0}\u{1f}\\\""] {
            assert_eq!(escaped_len(s, false), json_str(s).len() - 2, "{s:?}");
            assert_eq!(
                escaped_len(s, true),
                json_str(&json_str(s)).len() - 2,
                "{s:?}"
            );
        }
    }

    use super::*;
    use crate::format::meta::MetaType;
    use serde_json::Value;

    fn layout() -> Layout {
        // header 10 bytes, tensor 0 at [16, 24), tensor 1 at [24, 36),
        // gap to 40, tensor 2 at [40, 44), trailing zeros to 48.
        Layout::new(
            (0u8..10).collect(),
            ElemFormat::F32,
            vec![
                Segment {
                    start: 16,
                    len: 8,
                    file: 0,
                    rows: None,
                },
                Segment {
                    start: 24,
                    len: 12,
                    file: 1,
                    rows: None,
                },
                Segment {
                    start: 40,
                    len: 4,
                    file: 2,
                    rows: None,
                },
            ],
            48,
        )
        .unwrap()
    }

    fn t(seg: usize, r: Range<u64>) -> Piece {
        Piece::Tensor { seg, range: r }
    }

    #[test]
    fn pieces_cover_header_gaps_and_segment_boundaries() {
        let l = layout();
        assert_eq!(l.pieces(0, 48).len(), 7);
        assert_eq!(
            l.pieces(0, 48),
            vec![
                Piece::Header(0..10),
                Piece::Zeros(6),
                t(0, 0..8),
                t(1, 0..12),
                Piece::Zeros(4),
                t(2, 0..4),
                Piece::Zeros(4),
            ]
        );
        // Straddles header/padding/data.
        assert_eq!(
            l.pieces(8, 18),
            vec![Piece::Header(8..10), Piece::Zeros(6), t(0, 0..2)]
        );
        // Straddles two tensors, unaligned at both ends.
        assert_eq!(l.pieces(21, 27), vec![t(0, 5..8), t(1, 0..3)]);
        // Inside one tensor.
        assert_eq!(l.pieces(25, 26), vec![t(1, 1..2)]);
        // Exactly one tensor.
        assert_eq!(l.pieces(24, 36), vec![t(1, 0..12)]);
        // Tail padding, clipped at EOF; past EOF is empty.
        assert_eq!(l.pieces(43, 1000), vec![t(2, 3..4), Piece::Zeros(4)]);
        assert_eq!(l.pieces(48, 60), vec![]);
        assert_eq!(l.pieces(1000, 2000), vec![]);
        assert_eq!(l.pieces(5, 5), vec![]);
        // Every byte is accounted for exactly once, for every range.
        for a in 0..50u64 {
            for b in a..52u64 {
                let n: u64 = l
                    .pieces(a, b)
                    .iter()
                    .map(|p| match p {
                        Piece::Header(r) => r.len() as u64,
                        Piece::Zeros(n) => *n as u64,
                        Piece::Tensor { range, .. } => range.end - range.start,
                    })
                    .sum();
                assert_eq!(n, b.min(48).saturating_sub(a), "{a}..{b}");
            }
        }
    }

    #[test]
    fn layouts_refuse_overlap_partial_elements_and_overrun() {
        let seg = |start, len| Segment {
            start,
            len,
            file: 0,
            rows: None,
        };
        assert!(Layout::new(vec![0; 8], ElemFormat::F32, vec![seg(4, 4)], 16).is_err());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(0, 8), seg(4, 8)], 16).is_err());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(0, 6)], 16).is_err());
        assert!(Layout::new(vec![], ElemFormat::F16, vec![seg(0, 6)], 16).is_ok());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(0, 8)], 4).is_err());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(u64::MAX, 4)], 4).is_err());
    }

    #[test]
    fn layouts_larger_than_stat_can_report_are_refused() {
        let max = i64::MAX as u64;
        let segs = |len| {
            vec![Segment {
                start: 8,
                len,
                file: 0,
                rows: None,
            }]
        };
        let e = Layout::new(vec![0; 8], ElemFormat::F32, segs(8), max + 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TooLarge);
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("the view would be {} bytes", max + 1))
                && msg.contains("the largest file size stat can report (2^63 - 1 bytes)"),
            "{msg}"
        );
        // The largest size stat can report is fine.
        assert!(Layout::new(vec![0; 8], ElemFormat::F32, segs(max - 11), max).is_ok());
    }

    #[test]
    fn permuted_segments_map_rows_to_their_source() {
        // 2 groups of 4 rows of 3 elements, f32: rows 0..8 of the segment
        // come from file rows 0 2 1 3 | 4 6 5 7.
        let p = RowPerm {
            groups: 2,
            group_rows: 4,
            row_elems: 3,
        };
        let s = Segment {
            start: 100,
            len: 8 * 3 * 4,
            file: 0,
            rows: Some(p),
        };
        let rows: Vec<u64> = (0..8).map(|r| p.src_row(r)).collect();
        assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
        // Bytes 10..30: the end of row 0, all of row 1, the start of row 2.
        assert_eq!(s.source_ranges(10..30, 4), vec![10..12, 24..36, 12..18]);
        // Every byte once, in order, for every range.
        for a in 0..96u64 {
            for b in a..=96 {
                let got: Vec<u64> = s.source_ranges(a..b, 4).into_iter().flatten().collect();
                let want: Vec<u64> = (a..b).map(|x| p.src_row(x / 12) * 12 + x % 12).collect();
                assert_eq!(got, want, "{a}..{b}");
            }
        }
        assert_eq!(s.src_elem(4), 2 * 3 + 1);
        // The layout refuses a permutation that does not cover the segment.
        let bad = Segment {
            len: 7 * 3 * 4,
            ..s.clone()
        };
        assert!(Layout::new(vec![0; 100], ElemFormat::F32, vec![bad], 400).is_err());
        assert!(Layout::new(vec![0; 100], ElemFormat::F32, vec![s], 400).is_ok());
    }

    #[test]
    fn read_ahead_follows_segments() {
        let segs = vec![
            Segment {
                start: 100,
                len: 40, // 10 elements: chunks of 4 -> 3 chunks
                file: 7,
                rows: None,
            },
            Segment {
                start: 140,
                len: 16, // 4 elements -> 1 chunk
                file: 3,
                rows: None,
            },
        ];
        let ce = |_| 4;
        assert_eq!(
            chunks_after(&segs, 4, 0, 10, ce),
            vec![(7, 0), (7, 1), (7, 2), (3, 0)]
        );
        // After byte 116 (end of chunk 0): chunk 1 onwards.
        assert_eq!(chunks_after(&segs, 4, 116, 2, ce), vec![(7, 1), (7, 2)]);
        // Mid-chunk 1: its chunk was just read, the next is 2.
        assert_eq!(chunks_after(&segs, 4, 121, 5, ce), vec![(7, 2), (3, 0)]);
        assert_eq!(chunks_after(&segs, 4, 140, 5, ce), vec![(3, 0)]);
        assert_eq!(chunks_after(&segs, 4, 150, 5, ce), vec![]);
        assert_eq!(chunks_after(&segs, 4, 0, 0, ce), vec![]);
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_slices_bytes() {
        let vals = [1.0f32, 65520.0, 1.0 + 1.0 / 2048.0, -0.0, 3.0e-8];
        let mut out = Vec::new();
        encode_into(ElemFormat::F16, &vals, 0, 10, &mut out);
        let bits: Vec<u16> = out
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        // 65520 rounds to inf; 1 + 2^-11 is a tie that goes to even (1.0).
        assert_eq!(bits, vec![0x3c00, 0x7c00, 0x3c00, 0x8000, 0x0001]);
        let mut out = Vec::new();
        // 1 + 2^-8 is a bf16 tie -> 1.0; 1 + 3*2^-8 -> 1 + 2^-6 (even).
        encode_into(
            ElemFormat::Bf16,
            &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0],
            0,
            4,
            &mut out,
        );
        assert_eq!(out, vec![0x80, 0x3f, 0x82, 0x3f]);
        // Unaligned byte windows, across batch boundaries.
        let many: Vec<f32> = (0..5000).map(|i| i as f32 * 0.37).collect();
        for fmt in ElemFormat::ALL {
            let mut full = Vec::new();
            encode_into(fmt, &many, 0, many.len() * fmt.bytes() as usize, &mut full);
            for (skip, take) in [(1, 3), (4095, 4), (4097, 5000), (0, 1), (9999, 1)] {
                let mut part = Vec::new();
                encode_into(fmt, &many, skip, take, &mut part);
                assert_eq!(part, &full[skip..(skip + take).min(full.len())], "{fmt:?}");
            }
        }
    }

    fn md() -> Metadata {
        let mut md = Metadata::default();
        md.push("general.architecture", MetaValue::String("llama".into()));
        md.push("general.file_type", MetaValue::U32(15));
        md.push("llama.block_count", MetaValue::U32(2));
        md.push("llama.embedding_length", MetaValue::U32(4));
        md.push("llama.context_length", MetaValue::U32(8));
        md.push("llama.eps", MetaValue::F32(1e-5));
        md.push("x.nan", MetaValue::F64(f64::NAN));
        md.push("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
        md.push(
            "tokenizer.ggml.tokens",
            MetaValue::Array {
                elem: MetaType::String,
                values: vec![
                    MetaValue::String("a\"".into()),
                    MetaValue::String("b".into()),
                ],
            },
        );
        md
    }

    fn tensors() -> Vec<(usize, String, Vec<u64>)> {
        vec![
            (0, "token_embd.weight".into(), vec![3, 4]),
            (1, "blk.0.attn_norm.weight".into(), vec![5]),
            (2, "output.weight".into(), vec![2, 1, 3]),
        ]
    }

    fn views(ts: &[(usize, String, Vec<u64>)]) -> Vec<ViewTensor<'_>> {
        ts.iter()
            .map(|(f, n, s)| ViewTensor {
                file: *f,
                name: n,
                shape: s,
                n_elements: s.iter().product(),
                rows: None,
            })
            .collect()
    }

    #[test]
    fn safetensors_header_follows_the_rules() {
        let ts = tensors();
        for fmt in ElemFormat::ALL {
            let b = safetensors(&views(&ts), &md(), fmt).unwrap();
            let l = &b.layout;
            let h = l.header();
            let n = u64::from_le_bytes(h[..8].try_into().unwrap());
            assert_eq!(n as usize + 8, h.len());
            assert_eq!(n % 8, 0, "padded to a multiple of 8");
            assert_eq!(h[8], b'{');
            let text = std::str::from_utf8(&h[8..]).unwrap();
            assert_eq!(text.trim_end(), text.trim_end_matches(' '));
            let v: Value = serde_json::from_str(text).unwrap();
            let obj = v.as_object().unwrap();
            let keys: Vec<&String> = obj.keys().collect();
            assert_eq!(
                keys,
                [
                    "__metadata__",
                    "token_embd.weight",
                    "blk.0.attn_norm.weight",
                    "output.weight"
                ]
            );
            let meta = &obj["__metadata__"];
            assert_eq!(meta["llama.block_count"], "2");
            assert_eq!(meta["llama.eps"], "1e-5");
            assert_eq!(meta["x.nan"], "nan");
            assert_eq!(meta["general.file_type"], "15");
            assert_eq!(meta["tokenizer.ggml.tokens"], r#"["a\"","b"]"#);
            // Contiguous, in order, sized by dtype, ending at the file's end.
            let mut off = 0;
            for ((_, name, shape), seg) in ts.iter().zip(l.segments()) {
                let e = &obj[name.as_str()];
                assert_eq!(e["dtype"], fmt.dtype());
                assert_eq!(e["shape"], json!(shape));
                let n_el: u64 = shape.iter().product();
                assert_eq!(e["data_offsets"], json!([off, off + n_el * fmt.bytes()]));
                assert_eq!(seg.start, 8 + n + off);
                off += n_el * fmt.bytes();
            }
            assert_eq!(l.size(), 8 + n + off);
        }
        // Duplicate names and a tensor called __metadata__ are refused.
        let mut dup = tensors();
        dup.push((3, "output.weight".into(), vec![1]));
        assert!(safetensors(&views(&dup), &md(), ElemFormat::F32).is_err());
        let meta_named = vec![(0, "__metadata__".to_string(), vec![1])];
        assert!(safetensors(&views(&meta_named), &md(), ElemFormat::F32).is_err());
    }

    #[test]
    fn gguf_view_is_what_write_gguf_writes() {
        let ts = tensors();
        let b = gguf(&views(&ts), &md()).unwrap();
        let (vmd, al) = gguf_metadata(&md()).unwrap();
        assert_eq!(al, 32);
        assert_eq!(vmd.get("general.file_type"), Some(&MetaValue::U32(0)));
        // Data: element i of file f is f * 100 + i.
        let data: Vec<Vec<u8>> = ts
            .iter()
            .map(|(f, _, s)| {
                let n: u64 = s.iter().product();
                (0..n)
                    .flat_map(|i| ((*f as f32) * 100.0 + i as f32).to_le_bytes())
                    .collect()
            })
            .collect();
        let with_data: Vec<(String, Vec<u64>, GgmlType, &[u8])> = ts
            .iter()
            .zip(&data)
            .map(|((_, n, s), d)| {
                (
                    n.clone(),
                    s.iter().rev().copied().collect(),
                    GgmlType::F32,
                    &d[..],
                )
            })
            .collect();
        let mut want = Vec::new();
        gguf::write_gguf(&mut want, &vmd, &with_data, al).unwrap();
        let l = &b.layout;
        assert_eq!(l.size(), want.len() as u64);
        let mut got = Vec::new();
        for p in l.pieces(0, l.size()) {
            match p {
                Piece::Header(r) => got.extend_from_slice(&l.header()[r]),
                Piece::Zeros(n) => got.resize(got.len() + n, 0),
                Piece::Tensor { seg, range } => {
                    let d = &data[l.segments()[seg].file];
                    got.extend_from_slice(&d[range.start as usize..range.end as usize]);
                }
            }
        }
        assert_eq!(got, want);
    }

    #[test]
    fn gguf_needs_run_metadata_and_a_valid_alignment() {
        assert!(gguf_missing_keys(&md()).is_empty());
        let missing = gguf_missing_keys(&Metadata::default());
        assert_eq!(missing, ["general.architecture", "tokenizer.ggml.model"]);
        let mut m = md();
        m.entries
            .retain(|(k, _)| k != "llama.block_count" && k != "tokenizer.ggml.tokens");
        assert_eq!(
            gguf_missing_keys(&m),
            ["llama.block_count", "tokenizer.ggml.tokens"]
        );
        let mut m = md();
        m.push(ALIGNMENT_KEY, MetaValue::U64(64));
        let (vmd, al) = gguf_metadata(&m).unwrap();
        assert_eq!(
            (al, vmd.get(ALIGNMENT_KEY)),
            (64, Some(&MetaValue::U32(64)))
        );
        let mut m = md();
        m.push(ALIGNMENT_KEY, MetaValue::U32(48));
        assert!(gguf_metadata(&m).is_err());
        let mut m = md();
        m.entries.retain(|(k, _)| k != "general.file_type");
        let (vmd, _) = gguf_metadata(&m).unwrap();
        assert_eq!(vmd.entries.last().unwrap().0, "general.file_type");
    }

    #[test]
    fn gguf_needs_the_embedding_and_every_block() {
        let m = md();
        let all = [
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "blk.1.ffn_up.weight",
        ];
        assert!(gguf_missing_tensors(&m, &all).is_empty());
        assert_eq!(
            gguf_missing_tensors(&m, &["blk.0.attn_q.weight", "blk.7.x.weight"]),
            ["token_embd.weight", "tensors of 1 of the 2 blocks"]
        );
    }

    #[test]
    fn view_lists_parse() {
        assert_eq!(ViewSet::parse("f32").unwrap(), ViewSet::default());
        assert_eq!(
            ViewSet::parse("f32,f16, bf16").unwrap(),
            ViewSet {
                f16: true,
                bf16: true
            }
        );
        assert_eq!(ViewSet::parse("bf16+f32").unwrap().names(), "f32,bf16");
        assert!(ViewSet::parse("f32,f64").unwrap_err().contains("\"f64\""));
        assert_eq!(ViewSet::parse("").unwrap(), ViewSet::default());
    }
}
