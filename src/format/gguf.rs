//! GGUF v2/v3 (little-endian): validating reader and writer.
//!
//! Layout: magic `GGUF` | u32 version | u64 tensor_count | u64 kv_count |
//! kv pairs (gguf string key; u32 value type; value) | tensor infos (gguf
//! string name; u32 n_dims; u64 ne[n_dims]; u32 ggml type; u64 offset
//! relative to the data section) | zero padding to `general.alignment`
//! (default 32) | data section.
//!
//! The reader treats the file as untrusted. It streams the header through a
//! bounded, buffered cursor over [`SourceFile`] (positioned reads, no mmap,
//! never the whole file), checks every count and length against the bytes
//! left before it allocates, and reports every problem as an [`Error`] with
//! the file, the tensor (where there is one) and the absolute byte offset of
//! the offending field.
//!
//! Classification of size problems: a count or length that could not fit in
//! any sane header (past [`MAX_HEADER_BYTES`], a per-item cap, or u64
//! overflow) is `TooLarge`; a plausible one that merely runs past the end of
//! this file is `Truncated`.

use std::collections::HashSet;
use std::io::Write;

use crate::error::{Error, ErrorKind, Result, add, err, product};
use crate::format::MAX_TENSORS;
use crate::format::meta::{MetaBudget, MetaType, MetaValue, Metadata};
use crate::names::check_servable;
use crate::quant::GgmlType;
use crate::source::SourceFile;

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The version [`write_gguf`] / [`encode_header`] write.
pub const WRITE_VERSION: u32 = 3;

/// Largest accepted `general.alignment`.
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// Largest accepted string (metadata value or array element).
pub const MAX_STRING_BYTES: u64 = 64 << 20;
/// Largest accepted metadata key.
pub const MAX_KEY_BYTES: u64 = 64 << 10;
/// Largest accepted tensor name (`check_servable` is stricter still).
pub const MAX_TENSOR_NAME_BYTES: u64 = 4096;
/// Deepest accepted array nesting (an array of scalars is depth 1).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Largest accepted header (everything before the data section). Real
/// headers are a few MB, mostly tokenizer arrays: SmolLM2's (49k-token
/// BPE vocabulary with merges) is 1.8 MB; a 150k-token BPE vocabulary with
/// merges takes ~6 MB, a 256k one ~11 MB. 64 MiB leaves room for the
/// largest of those plus an embedded `tokenizer.huggingface.json` (up to
/// ~35 MB for Gemma 3's), and bounds what a hostile header can make a
/// reader do. The parsed metadata is further bounded by
/// [`crate::format::meta::meta_budget_limit`].
pub const MAX_HEADER_BYTES: u64 = 64 << 20;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: u32 = 4;

/// Bytes per positioned read of the header.
const READ_CHUNK: usize = 1 << 20;
/// Minimum encoded size of one kv pair (key length, type, 1 value byte).
const KV_MIN_BYTES: u64 = 8 + 4 + 1;
/// Minimum encoded size of one tensor info (name length, n_dims, ne0, type,
/// offset).
const TENSOR_INFO_MIN_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// Upper bound on capacity reserved from a count read from the file.
const PREALLOC_CAP: usize = 4096;

/// One tensor of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml `ne` order: `ne0` (the contiguous dimension) first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute file offset of the tensor's data.
    pub offset: u64,
    pub n_bytes: u64,
    pub n_elements: u64,
}

/// The parsed and validated header of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    pub version: u32,
    pub metadata: Metadata,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// In file order.
    pub tensors: Vec<GgufTensorInfo>,
}

impl GgufFile {
    /// Parse and validate the header of `src`; tensor data is bounds-checked
    /// but not read.
    pub fn read(src: &SourceFile) -> Result<GgufFile> {
        read_inner(src).map_err(|e| e.path(src.path()))
    }

    /// The tensor with exactly this stored name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Check an alignment value (from `general.alignment` or a writer's caller).
pub fn check_alignment(alignment: u64) -> Result<()> {
    if alignment == 0 || !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "{ALIGNMENT_KEY} = {alignment}: must be a nonzero power of two \
                 at most {MAX_ALIGNMENT}"
            ),
        ));
    }
    Ok(())
}

/// `v` rounded up to a multiple of `alignment` (a power of two), checked.
pub fn align_up(v: u64, alignment: u64) -> Result<u64> {
    let mask = alignment.saturating_sub(1);
    Ok(add(v, mask, "alignment padding")? & !mask)
}

// ---------------------------------------------------------------------------
// Reader

type What<'w> = &'w dyn Fn() -> String;

/// Sequential, bounded, buffered reader of the header.
struct Cursor<'a> {
    src: &'a SourceFile,
    /// File length at open time.
    len: u64,
    buf: Vec<u8>,
    /// Absolute offset of `buf[0]`.
    buf_start: u64,
    /// Absolute offset of the next byte to read.
    pos: u64,
}

impl<'a> Cursor<'a> {
    fn new(src: &'a SourceFile) -> Self {
        Cursor {
            src,
            len: src.len(),
            buf: Vec::new(),
            buf_start: 0,
            pos: 0,
        }
    }

    /// Bytes left before the end of the file.
    fn file_left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// Bytes left before the header cap.
    fn cap_left(&self) -> u64 {
        MAX_HEADER_BYTES.saturating_sub(self.pos)
    }

    /// Check that `n` more bytes exist in the file and within the header cap.
    fn need(&self, n: u64, what: What) -> Result<()> {
        if n > self.file_left() {
            return Err(err(
                ErrorKind::Truncated,
                format!(
                    "{}: needs {n} bytes at byte {} but the file ends at byte {}",
                    what(),
                    self.pos,
                    self.len
                ),
            )
            .at(self.pos));
        }
        if n > self.cap_left() {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "{}: the header would extend past {MAX_HEADER_BYTES} bytes (the cap)",
                    what()
                ),
            )
            .at(self.pos));
        }
        Ok(())
    }

    /// Check that `count` items of at least `min_size` bytes each can follow.
    /// `at` is the offset of the count field.
    fn need_items(&self, count: u64, min_size: u64, at: u64, what: What) -> Result<()> {
        let need = count.checked_mul(min_size);
        match need {
            Some(need) if need <= self.cap_left() => {
                if need > self.file_left() {
                    return Err(err(
                        ErrorKind::Truncated,
                        format!(
                            "{}: {count} declared, needing at least {need} bytes, \
                             but only {} bytes are left in the file",
                            what(),
                            self.file_left()
                        ),
                    )
                    .at(at));
                }
                Ok(())
            }
            _ => Err(err(
                ErrorKind::TooLarge,
                format!(
                    "{}: {count} declared, needing at least {count} * {min_size} bytes, \
                     more than the {MAX_HEADER_BYTES}-byte header cap allows",
                    what()
                ),
            )
            .at(at)),
        }
    }

    /// The next `n` bytes (`n <= READ_CHUNK`).
    fn take(&mut self, n: usize, what: What) -> Result<&[u8]> {
        self.need(n as u64, what)?;
        let buf_end = self.buf_start.saturating_add(self.buf.len() as u64);
        let end = self.pos.saturating_add(n as u64);
        if self.pos < self.buf_start || end > buf_end {
            // `need` guarantees `file_left() >= n`, and `n <= READ_CHUNK`.
            let want = self.file_left().min(READ_CHUNK as u64).max(n as u64);
            self.buf.resize(want as usize, 0);
            if let Err(e) = self.src.read_at(self.pos, &mut self.buf) {
                self.buf.clear();
                return Err(e);
            }
            self.buf_start = self.pos;
        }
        let start = (self.pos - self.buf_start) as usize;
        self.pos = end;
        self.buf.get(start..start + n).ok_or_else(|| {
            err(
                ErrorKind::Truncated,
                format!("{}: internal read buffer underrun", what()),
            )
        })
    }

    fn arr<const N: usize>(&mut self, what: What) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: What) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: What) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// A gguf string (u64 length + UTF-8 bytes). Longer than `max` is an
    /// error of kind `too_long`, reported at the length field.
    fn string(&mut self, max: u64, too_long: ErrorKind, what: What) -> Result<String> {
        let n = self.string_len(max, too_long, what)?;
        self.string_bytes(n, what)
    }

    /// The length field of a gguf string, checked against `max`.
    fn string_len(&mut self, max: u64, too_long: ErrorKind, what: What) -> Result<u64> {
        let len_at = self.pos;
        let n = self.u64(&|| format!("length of {}", what()))?;
        if n > max {
            return Err(err(
                too_long,
                format!(
                    "{}: string length {n} exceeds the cap of {max} bytes",
                    what()
                ),
            )
            .at(len_at));
        }
        Ok(n)
    }

    /// The `n` UTF-8 bytes of a gguf string whose length was just read.
    fn string_bytes(&mut self, n: u64, what: What) -> Result<String> {
        let data_at = self.pos;
        self.need(n, what)?;
        let bytes = if n <= READ_CHUNK as u64 {
            self.take(n as usize, what)?.to_vec()
        } else {
            let v = self.src.read_vec(data_at, n, "gguf string")?;
            self.pos = data_at + n;
            v
        };
        String::from_utf8(bytes).map_err(|e| {
            let bad = data_at + e.utf8_error().valid_up_to() as u64;
            err(
                ErrorKind::BadValue,
                format!(
                    "{}: string at byte {data_at} is not valid UTF-8 (bad byte at {bad})",
                    what()
                ),
            )
            .at(bad)
        })
    }
}

/// Charge `bytes` of parsed metadata for `key`, of a value whose bytes end
/// `ahead` bytes past the cursor (the header is at least that long).
fn charge(c: &Cursor, budget: &mut MetaBudget, bytes: u64, ahead: u64, key: &str) -> Result<()> {
    budget
        .charge(bytes, c.pos.saturating_add(ahead))
        .map_err(|m| err(ErrorKind::TooLarge, format!("metadata key {key:?}: {m}")).at(c.pos))
}

/// Read one value of type `ty`. `enclosing` is the number of arrays this
/// value sits in; `budget` accounts the memory the parsed metadata takes.
fn read_value(
    c: &mut Cursor,
    ty: MetaType,
    key: &str,
    enclosing: usize,
    budget: &mut MetaBudget,
) -> Result<MetaValue> {
    let what = || format!("value of metadata key {key:?}");
    let w: What = &what;
    if ty.scalar_size().is_some() {
        charge(c, budget, MetaBudget::VALUE_BYTES, 0, key)?;
    }
    Ok(match ty {
        MetaType::U8 => MetaValue::U8(u8::from_le_bytes(c.arr(w)?)),
        MetaType::I8 => MetaValue::I8(i8::from_le_bytes(c.arr(w)?)),
        MetaType::U16 => MetaValue::U16(u16::from_le_bytes(c.arr(w)?)),
        MetaType::I16 => MetaValue::I16(i16::from_le_bytes(c.arr(w)?)),
        MetaType::U32 => MetaValue::U32(u32::from_le_bytes(c.arr(w)?)),
        MetaType::I32 => MetaValue::I32(i32::from_le_bytes(c.arr(w)?)),
        MetaType::F32 => MetaValue::F32(f32::from_le_bytes(c.arr(w)?)),
        MetaType::U64 => MetaValue::U64(u64::from_le_bytes(c.arr(w)?)),
        MetaType::I64 => MetaValue::I64(i64::from_le_bytes(c.arr(w)?)),
        MetaType::F64 => MetaValue::F64(f64::from_le_bytes(c.arr(w)?)),
        MetaType::Bool => {
            let at = c.pos;
            match c.arr::<1>(w)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!("{}: bool byte is {b}, not 0 or 1", what()),
                    )
                    .at(at));
                }
            }
        }
        MetaType::String => {
            let n = c.string_len(MAX_STRING_BYTES, ErrorKind::TooLarge, w)?;
            // Charged before the bytes are read and copied; they are part
            // of the header.
            charge(c, budget, MetaBudget::VALUE_BYTES + n, n, key)?;
            MetaValue::String(c.string_bytes(n, w)?)
        }
        MetaType::Array => {
            let level = enclosing + 1;
            let et_at = c.pos;
            let et_id = c.u32(&|| format!("array element type of metadata key {key:?}"))?;
            let elem = MetaType::from_id(et_id).ok_or_else(|| {
                err(
                    ErrorKind::UnknownType,
                    format!("metadata key {key:?}: unknown array element type id {et_id}"),
                )
                .at(et_at)
            })?;
            if elem == MetaType::Array && level + 1 > MAX_ARRAY_DEPTH {
                return Err(err(
                    ErrorKind::TooLarge,
                    format!(
                        "metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
                    ),
                )
                .at(et_at));
            }
            let n_at = c.pos;
            let count = c.u64(&|| format!("array length of metadata key {key:?}"))?;
            let min_size = match elem {
                MetaType::String => 8,
                MetaType::Array => 4 + 8,
                other => other.scalar_size().unwrap_or(1),
            };
            c.need_items(count, min_size, n_at, &|| {
                format!("metadata key {key:?}: array of {} elements", elem.name())
            })?;
            // Refuse an array the budget cannot hold before reading it: its
            // elements take at least `min_size` header bytes each (which
            // raise the limit) and VALUE_BYTES of memory each.
            let mut after = budget.clone();
            let header_after = c.pos.saturating_add(count.saturating_mul(min_size));
            let need = count
                .saturating_mul(MetaBudget::VALUE_BYTES)
                .saturating_add(MetaBudget::VALUE_BYTES);
            if let Err(m) = after.charge(need, header_after) {
                return Err(err(
                    ErrorKind::TooLarge,
                    format!(
                        "metadata key {key:?}: array of {count} {} elements: {m}",
                        elem.name()
                    ),
                )
                .at(n_at));
            }
            charge(c, budget, MetaBudget::VALUE_BYTES, 0, key)?;
            let mut values = Vec::with_capacity((count as usize).min(PREALLOC_CAP));
            for _ in 0..count {
                values.push(read_value(c, elem, key, level, budget)?);
            }
            MetaValue::Array { elem, values }
        }
    })
}

/// A tensor info before the data offset is known.
struct RawTensor {
    info: GgufTensorInfo,
    /// Absolute offset of the info's `offset` field.
    offset_field: u64,
}

fn read_inner(src: &SourceFile) -> Result<GgufFile> {
    let mut c = Cursor::new(src);

    // Magic and version.
    if c.len < 4 {
        return Err(err(
            ErrorKind::Truncated,
            format!("file is {} bytes, too short for the GGUF magic", c.len),
        )
        .at(0));
    }
    let magic: [u8; 4] = c.arr(&|| "GGUF magic".into())?;
    if &magic != GGUF_MAGIC {
        return Err(err(
            ErrorKind::BadMagic,
            format!(
                "not a GGUF file: magic is {:?} ({:02x?}), expected \"GGUF\"",
                String::from_utf8_lossy(&magic),
                magic
            ),
        )
        .at(0));
    }
    let version = c.u32(&|| "GGUF version".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(err(
                ErrorKind::UnsupportedVersion,
                "GGUF v1 is not supported (v2/v3 are)",
            )
            .at(4));
        }
        v if v & 0xffff == 0 && (1..=3).contains(&v.swap_bytes()) => {
            return Err(err(
                ErrorKind::UnsupportedVersion,
                format!(
                    "GGUF version field is {v:#010x}, which is version {} byte-swapped: \
                     big-endian GGUF is not supported",
                    v.swap_bytes()
                ),
            )
            .at(4));
        }
        v => {
            return Err(err(
                ErrorKind::UnsupportedVersion,
                format!("GGUF version {v} is not supported (v2/v3 are)"),
            )
            .at(4));
        }
    }

    // Counts.
    let tc_at = c.pos;
    let tensor_count = c.u64(&|| "tensor count".into())?;
    let kc_at = c.pos;
    let kv_count = c.u64(&|| "metadata kv count".into())?;
    if tensor_count > MAX_TENSORS {
        return Err(err(
            ErrorKind::TooLarge,
            format!("tensor count {tensor_count} exceeds the cap of {MAX_TENSORS} tensors"),
        )
        .at(tc_at));
    }
    c.need_items(tensor_count, TENSOR_INFO_MIN_BYTES, tc_at, &|| {
        "tensor count".into()
    })?;
    c.need_items(kv_count, KV_MIN_BYTES, kc_at, &|| {
        "metadata kv count".into()
    })?;
    let both = tensor_count
        .saturating_mul(TENSOR_INFO_MIN_BYTES)
        .saturating_add(kv_count.saturating_mul(KV_MIN_BYTES));
    c.need_items(both, 1, kc_at, &|| {
        format!("{tensor_count} tensor infos plus {kv_count} kv pairs (minimum bytes)")
    })?;

    // Metadata.
    let mut metadata = Metadata::default();
    metadata
        .entries
        .reserve((kv_count as usize).min(PREALLOC_CAP));
    let mut keys: HashSet<String> = HashSet::new();
    let mut budget = MetaBudget::default();
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..kv_count {
        let key_at = c.pos;
        let key = c.string(MAX_KEY_BYTES, ErrorKind::TooLarge, &|| {
            format!("key of metadata kv #{i}")
        })?;
        if key.is_empty() {
            return Err(err(
                ErrorKind::BadValue,
                format!("metadata kv #{i} has an empty key"),
            )
            .at(key_at));
        }
        if !keys.insert(key.clone()) {
            return Err(err(
                ErrorKind::BadValue,
                format!("duplicate metadata key {key:?} (kv #{i})"),
            )
            .at(key_at));
        }
        charge(
            &c,
            &mut budget,
            MetaBudget::ENTRY_BYTES + key.len() as u64,
            0,
            &key,
        )?;
        let ty_at = c.pos;
        let ty_id = c.u32(&|| format!("value type of metadata key {key:?}"))?;
        let ty = MetaType::from_id(ty_id).ok_or_else(|| {
            err(
                ErrorKind::UnknownType,
                format!("metadata key {key:?}: unknown value type id {ty_id}"),
            )
            .at(ty_at)
        })?;
        let val_at = c.pos;
        let value = read_value(&mut c, ty, &key, 0, &mut budget)?;
        if key == ALIGNMENT_KEY {
            match value {
                MetaValue::U32(a) => {
                    check_alignment(a.into()).map_err(|e| e.at(val_at))?;
                    alignment = a.into();
                }
                ref other => {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!(
                            "{ALIGNMENT_KEY} must be a u32, found a {} ({})",
                            other.meta_type().name(),
                            other.summary()
                        ),
                    )
                    .at(ty_at));
                }
            }
        }
        metadata.entries.push((key, value));
    }

    // Tensor infos.
    let mut raw: Vec<RawTensor> = Vec::with_capacity((tensor_count as usize).min(PREALLOC_CAP));
    let mut names: HashSet<String> = HashSet::new();
    for i in 0..tensor_count {
        let name_at = c.pos;
        let name = c.string(MAX_TENSOR_NAME_BYTES, ErrorKind::BadName, &|| {
            format!("name of tensor #{i}")
        })?;
        check_servable(&name).map_err(|e| e.at(name_at))?;
        if !names.insert(name.clone()) {
            return Err(err(
                ErrorKind::BadName,
                format!("duplicate tensor name {name:?} (tensor #{i})"),
            )
            .tensor(&name)
            .at(name_at));
        }
        let info = read_tensor_info(&mut c, &name, alignment).map_err(|e| e.tensor(&name))?;
        raw.push(info);
    }

    // Data section.
    let header_end = c.pos;
    let data_offset = align_up(header_end, alignment).map_err(|e| e.at(header_end))?;

    let mut tensors = Vec::with_capacity(raw.len());
    for r in &raw {
        let mut t = r.info.clone();
        let at = r.offset_field;
        t.offset = add(data_offset, t.offset, "absolute tensor offset")
            .map_err(|e| e.tensor(&t.name).at(at))?;
        src.check_range(
            t.offset,
            t.n_bytes,
            &format!(
                "tensor data ({} bytes; offset field at byte {at}, data section at byte \
                 {data_offset})",
                t.n_bytes
            ),
        )
        .map_err(|e| e.tensor(&t.name).at(at))?;
        tensors.push(t);
    }

    // No two tensors may share bytes.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        // Both ranges were checked to lie inside the file: no overflow.
        let a_end = a.offset.saturating_add(a.n_bytes);
        if b.offset < a_end {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "tensor data overlaps: {:?} occupies bytes [{}, {a_end}) and {:?} starts \
                     at byte {}",
                    a.name, a.offset, b.name, b.offset
                ),
            )
            .tensor(&b.name)
            .at(raw[pair[1]].offset_field));
        }
    }

    Ok(GgufFile {
        version,
        metadata,
        alignment,
        data_offset,
        tensors,
    })
}

/// Everything of a tensor info after its name.
fn read_tensor_info(c: &mut Cursor, name: &str, alignment: u64) -> Result<RawTensor> {
    let nd_at = c.pos;
    let n_dims = c.u32(&|| "n_dims".into())?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(err(
            ErrorKind::BadShape,
            format!("n_dims is {n_dims}; must be 1..={MAX_DIMS}"),
        )
        .at(nd_at));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    let ne0_at = c.pos;
    for d in 0..n_dims {
        let at = c.pos;
        let ne = c.u64(&|| format!("ne[{d}]"))?;
        if ne == 0 {
            return Err(err(
                ErrorKind::BadShape,
                format!("ne[{d}] is 0: zero-sized tensors are not accepted"),
            )
            .at(at));
        }
        dims.push(ne);
    }
    let n_elements = product(&dims, "element count").map_err(|e| e.at(ne0_at))?;
    if n_elements > i64::MAX as u64 {
        return Err(err(
            ErrorKind::Overflow,
            format!("element count {n_elements} of shape {dims:?} does not fit in ggml's int64"),
        )
        .at(ne0_at));
    }
    let ty_at = c.pos;
    let ty_id = c.u32(&|| "ggml type".into())?;
    let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
        err(
            ErrorKind::UnknownType,
            format!("unknown ggml type id {ty_id}"),
        )
        .at(ty_at)
    })?;
    let ne0 = dims.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(ty.block_elems()) {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "ne0 = {ne0} is not a multiple of the {ty} block size {}",
                ty.block_elems()
            ),
        )
        .at(ne0_at));
    }
    let n_bytes = ty.bytes_for(n_elements).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("byte size of {n_elements} {ty} elements overflows u64"),
        )
        .at(ty_at)
    })?;
    let off_at = c.pos;
    let offset = c.u64(&|| "data offset".into())?;
    if !offset.is_multiple_of(alignment) {
        return Err(err(
            ErrorKind::BadValue,
            format!("data offset {offset} is not a multiple of the alignment {alignment}"),
        )
        .at(off_at));
    }
    Ok(RawTensor {
        info: GgufTensorInfo {
            name: name.to_string(),
            dims,
            ty,
            offset,
            n_bytes,
            n_elements,
        },
        offset_field: off_at,
    })
}

// ---------------------------------------------------------------------------
// Writer

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str, max: u64, what: &str) -> Result<()> {
    if s.len() as u64 > max {
        return Err(err(
            ErrorKind::TooLarge,
            format!(
                "{what}: string of {} bytes exceeds the cap of {max}",
                s.len()
            ),
        ));
    }
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Encode a value (without its type id). `enclosing` as in `read_value`.
fn put_value(out: &mut Vec<u8>, v: &MetaValue, key: &str, enclosing: usize) -> Result<()> {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => {
            put_str(out, s, MAX_STRING_BYTES, &format!("metadata key {key:?}"))?
        }
        MetaValue::Array { elem, values } => {
            let level = enclosing + 1;
            if *elem == MetaType::Array && level + 1 > MAX_ARRAY_DEPTH {
                return Err(err(
                    ErrorKind::TooLarge,
                    format!(
                        "metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
                    ),
                ));
            }
            put_u32(out, elem.id());
            put_u64(out, values.len() as u64);
            for x in values {
                if x.meta_type() != *elem {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!(
                            "metadata key {key:?}: array of {} holds a {}",
                            elem.name(),
                            x.meta_type().name()
                        ),
                    ));
                }
                put_value(out, x, key, level)?;
            }
        }
    }
    Ok(())
}

/// Serialized header (everything before the data section, padding
/// included) and each tensor's offset relative to the data section, for
/// tensors laid out in the given order with alignment padding between them.
///
/// Writes GGUF v3. If `alignment` is not the default and `metadata` lacks
/// `general.alignment`, the key is appended as a u32; if the key is present
/// it must be a u32 equal to `alignment`. Everything the reader would
/// reject (bad names, shapes, keys, nesting, lengths) is refused here too.
pub fn encode_header(
    metadata: &Metadata,
    tensors: &[(String, Vec<u64>, GgmlType)],
    alignment: u64,
) -> Result<(Vec<u8>, Vec<u64>)> {
    encode_header_with(metadata, &[], tensors, alignment)
}

/// [`encode_header`] of `metadata` with `overrides`: each override's value
/// replaces that of its key where `metadata` has it, and is added after
/// the others where not. The same header as encoding a copy of `metadata`
/// changed that way, without the copy (a vocabulary's metadata can be
/// tens of megabytes of strings).
pub fn encode_header_with(
    metadata: &Metadata,
    overrides: &[(&str, MetaValue)],
    tensors: &[(String, Vec<u64>, GgmlType)],
    alignment: u64,
) -> Result<(Vec<u8>, Vec<u64>)> {
    check_alignment(alignment)?;
    let overridden = |key: &str| overrides.iter().find(|(k, _)| *k == key).map(|(_, v)| v);
    let value_of =
        |key: &str| -> Option<&MetaValue> { overridden(key).or_else(|| metadata.get(key)) };
    let added: Vec<&(&str, MetaValue)> = overrides
        .iter()
        .filter(|(k, _)| metadata.get(k).is_none())
        .collect();
    let add_alignment_key = match value_of(ALIGNMENT_KEY) {
        None => alignment != DEFAULT_ALIGNMENT,
        Some(MetaValue::U32(a)) if u64::from(*a) == alignment => false,
        Some(other) => {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "metadata {ALIGNMENT_KEY} = {} ({}) disagrees with the requested \
                     alignment {alignment} (u32)",
                    other.summary(),
                    other.meta_type().name()
                ),
            ));
        }
    };

    let mut out = Vec::new();
    out.extend_from_slice(GGUF_MAGIC);
    put_u32(&mut out, WRITE_VERSION);
    put_u64(&mut out, tensors.len() as u64);
    put_u64(
        &mut out,
        (metadata.len() + added.len()) as u64 + u64::from(add_alignment_key),
    );

    let mut keys = HashSet::new();
    let entries = metadata
        .entries
        .iter()
        .map(|(k, v)| (k.as_str(), overridden(k).unwrap_or(v)))
        .chain(added.iter().map(|(k, v)| (*k, v)));
    for (key, value) in entries {
        if key.is_empty() {
            return Err(err(ErrorKind::BadValue, "empty metadata key"));
        }
        if !keys.insert(key) {
            return Err(err(
                ErrorKind::BadValue,
                format!("duplicate metadata key {key:?}"),
            ));
        }
        put_str(&mut out, key, MAX_KEY_BYTES, "metadata key")?;
        put_u32(&mut out, value.meta_type().id());
        put_value(&mut out, value, key, 0)?;
    }
    if add_alignment_key {
        put_str(&mut out, ALIGNMENT_KEY, MAX_KEY_BYTES, "metadata key")?;
        put_u32(&mut out, MetaType::U32.id());
        // check_alignment bounds it by MAX_ALIGNMENT.
        put_u32(&mut out, alignment as u32);
    }

    let mut names = HashSet::new();
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut next = 0u64;
    for (name, dims, ty) in tensors {
        check_servable(name)?;
        if !names.insert(name.as_str()) {
            return Err(err(
                ErrorKind::BadName,
                format!("duplicate tensor name {name:?}"),
            )
            .tensor(name));
        }
        let n_bytes = tensor_bytes(name, dims, *ty)?;
        let offset = align_up(next, alignment)?;
        next = add(offset, n_bytes, "data section size").map_err(|e| e.tensor(name))?;
        put_str(&mut out, name, MAX_TENSOR_NAME_BYTES, "tensor name")?;
        put_u32(&mut out, dims.len() as u32);
        for &d in dims {
            put_u64(&mut out, d);
        }
        put_u32(&mut out, ty.id());
        put_u64(&mut out, offset);
        offsets.push(offset);
    }
    let padded = align_up(out.len() as u64, alignment)?;
    out.resize(padded as usize, 0);
    if padded > MAX_HEADER_BYTES {
        return Err(err(
            ErrorKind::TooLarge,
            format!("GGUF header of {padded} bytes exceeds the cap of {MAX_HEADER_BYTES}"),
        ));
    }
    Ok((out, offsets))
}

/// Validate a shape for writing and return its byte size.
fn tensor_bytes(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64> {
    let bad = |m: String| err(ErrorKind::BadShape, m).tensor(name);
    if dims.is_empty() || dims.len() > MAX_DIMS as usize {
        return Err(bad(format!("{} dims; must be 1..={MAX_DIMS}", dims.len())));
    }
    if dims.contains(&0) {
        return Err(bad(format!("zero-sized shape {dims:?}")));
    }
    let n = product(dims, "element count").map_err(|e| e.tensor(name))?;
    let ne0 = dims.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(ty.block_elems()) {
        return Err(bad(format!(
            "ne0 = {ne0} is not a multiple of the {ty} block size {}",
            ty.block_elems()
        )));
    }
    if n > i64::MAX as u64 {
        return Err(err(
            ErrorKind::Overflow,
            format!("element count {n} does not fit in ggml's int64"),
        )
        .tensor(name));
    }
    ty.bytes_for(n).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("byte size of {n} {ty} elements overflows u64"),
        )
        .tensor(name)
    })
}

fn write_err(e: std::io::Error) -> Error {
    err(ErrorKind::Io, format!("writing GGUF: {e}"))
}

fn write_zeros<W: Write>(w: &mut W, n: u64) -> Result<()> {
    let mut zeros = std::io::Read::take(std::io::repeat(0), n);
    std::io::copy(&mut zeros, w).map_err(write_err)?;
    Ok(())
}

/// Write a whole GGUF v3 file: the header from [`encode_header`], then each
/// tensor's bytes (which must be exactly `bytes_for(n_elements)`), zero
/// padding between them and after the last one (as llama.cpp and gguf-py
/// do). Nothing is written if any tensor's length is wrong.
pub fn write_gguf<W: Write>(
    w: &mut W,
    metadata: &Metadata,
    tensors: &[(String, Vec<u64>, GgmlType, &[u8])],
    alignment: u64,
) -> Result<()> {
    let shapes: Vec<(String, Vec<u64>, GgmlType)> = tensors
        .iter()
        .map(|(n, d, t, _)| (n.clone(), d.clone(), *t))
        .collect();
    let (header, offsets) = encode_header(metadata, &shapes, alignment)?;
    for (name, dims, ty, data) in tensors {
        let want = tensor_bytes(name, dims, *ty)?;
        if data.len() as u64 != want {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "{} bytes of data given for a {ty} tensor of shape {dims:?}, which takes {want}",
                    data.len()
                ),
            )
            .tensor(name));
        }
    }
    w.write_all(&header).map_err(write_err)?;
    let mut pos = 0u64;
    for ((_, _, _, data), &offset) in tensors.iter().zip(&offsets) {
        write_zeros(w, offset.saturating_sub(pos))?;
        w.write_all(data).map_err(write_err)?;
        pos = offset.saturating_add(data.len() as u64);
    }
    let end = align_up(pos, alignment)?;
    write_zeros(w, end - pos)?;
    w.flush().map_err(write_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::path::Path;

    // -- helpers ----------------------------------------------------------

    fn read_bytes(bytes: &[u8]) -> Result<GgufFile> {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        let src = SourceFile::open(f.path()).unwrap();
        GgufFile::read(&src)
    }

    /// Read, expect an error of `kind`, check it names the file and an
    /// offset, and return it.
    #[track_caller]
    fn fails(bytes: &[u8], kind: ErrorKind) -> Error {
        let e = match read_bytes(bytes) {
            Ok(g) => panic!("expected {kind:?}, read OK: {g:?}"),
            Err(e) => e,
        };
        eprintln!("{:?}: {e}", e.kind());
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.file().is_some(), "no path: {e}");
        assert!(e.offset().is_some(), "no offset: {e}");
        e
    }

    /// Hand-rolled little-endian builder that remembers named offsets.
    #[derive(Default, Clone)]
    struct B {
        out: Vec<u8>,
        marks: Vec<(String, usize)>,
    }

    impl B {
        fn mark(&mut self, m: impl Into<String>) -> &mut Self {
            self.marks.push((m.into(), self.out.len()));
            self
        }
        fn at(&self, m: &str) -> usize {
            self.marks
                .iter()
                .find(|(k, _)| k == m)
                .unwrap_or_else(|| panic!("no mark {m}"))
                .1
        }
        fn bytes(&mut self, b: &[u8]) -> &mut Self {
            self.out.extend_from_slice(b);
            self
        }
        fn u32(&mut self, v: u32) -> &mut Self {
            self.bytes(&v.to_le_bytes())
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.bytes(&v.to_le_bytes())
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64).bytes(s.as_bytes())
        }
        fn pad(&mut self, align: usize) -> &mut Self {
            while !self.out.len().is_multiple_of(align) {
                self.out.push(0);
            }
            self
        }
        fn set_u32(&mut self, m: &str, v: u32) -> &mut Self {
            let at = self.at(m);
            self.out[at..at + 4].copy_from_slice(&v.to_le_bytes());
            self
        }
        fn set_u64(&mut self, m: &str, v: u64) -> &mut Self {
            let at = self.at(m);
            self.out[at..at + 8].copy_from_slice(&v.to_le_bytes());
            self
        }
        fn cut(&self, len: usize) -> Vec<u8> {
            self.out[..len].to_vec()
        }
    }

    /// Encoded (type id, value bytes).
    fn v_u32(x: u32) -> (u32, Vec<u8>) {
        (4, x.to_le_bytes().to_vec())
    }
    fn v_str(s: &str) -> (u32, Vec<u8>) {
        let mut b = B::default();
        b.str(s);
        (8, b.out)
    }
    fn v_str_array(items: &[&str]) -> (u32, Vec<u8>) {
        let mut b = B::default();
        b.u32(8).u64(items.len() as u64);
        for s in items {
            b.str(s);
        }
        (9, b.out)
    }

    /// A GGUF file from parts. Marks: magic, version, tensor_count,
    /// kv_count, key{i}, type{i}, value{i}, tensor{i}, n_dims{i},
    /// ne{i}_{d}, ttype{i}, offset{i}, data.
    fn file(
        version: u32,
        kvs: &[(&str, (u32, Vec<u8>))],
        tensors: &[(&str, &[u64], u32, u64)],
        align: usize,
        data_len: usize,
    ) -> B {
        let mut b = B::default();
        b.mark("magic").bytes(GGUF_MAGIC);
        b.mark("version").u32(version);
        b.mark("tensor_count").u64(tensors.len() as u64);
        b.mark("kv_count").u64(kvs.len() as u64);
        for (i, (k, (ty, v))) in kvs.iter().enumerate() {
            b.mark(format!("key{i}")).str(k);
            b.mark(format!("type{i}")).u32(*ty);
            b.mark(format!("value{i}")).bytes(v);
        }
        for (i, (name, dims, ty, off)) in tensors.iter().enumerate() {
            b.mark(format!("tensor{i}")).str(name);
            b.mark(format!("n_dims{i}")).u32(dims.len() as u32);
            for (d, ne) in dims.iter().enumerate() {
                b.mark(format!("ne{i}_{d}")).u64(*ne);
            }
            b.mark(format!("ttype{i}")).u32(*ty);
            b.mark(format!("offset{i}")).u64(*off);
        }
        b.pad(align).mark("data");
        let n = b.out.len() + data_len;
        let mut x = 1u8;
        while b.out.len() < n {
            x = x.wrapping_mul(31).wrapping_add(7);
            b.out.push(x);
        }
        b
    }

    const DESCRIPTION: &str = "A small test model — «naïve» café, 日本語, emoji 🦀. \
        Long enough that truncations inside it leave room for the declared counts. \
        Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.";

    /// A small valid file: 5 kvs (a long non-ASCII string, a u32, a string
    /// array, the alignment, a string), 2 tensors: `a.weight` F32 [8] at 0
    /// (32 bytes) and `b.weight` Q8_0 [32, 2] at 64 (68 bytes).
    fn small_v(version: u32) -> B {
        file(
            version,
            &[
                ("general.description", v_str(DESCRIPTION)),
                ("llama.block_count", v_u32(30)),
                ("tokenizer.ggml.tokens", v_str_array(&["a", "bé", "c"])),
                ("general.alignment", v_u32(32)),
                ("general.architecture", v_str("llama")),
            ],
            &[("a.weight", &[8], 0, 0), ("b.weight", &[32, 2], 8, 64)],
            32,
            160,
        )
    }

    fn small() -> B {
        small_v(3)
    }

    // -- valid files ------------------------------------------------------

    #[test]
    fn small_file_reads() {
        let b = small();
        let g = read_bytes(&b.out).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.alignment, 32);
        assert_eq!(g.data_offset, b.at("data") as u64);
        assert_eq!(g.metadata.len(), 5);
        assert_eq!(
            g.metadata.get("general.description"),
            Some(&MetaValue::String(DESCRIPTION.into()))
        );
        assert_eq!(g.metadata.arch_u64("block_count"), Some(30));
        let t = g.tensor("b.weight").unwrap();
        assert_eq!(t.dims, vec![32, 2]);
        assert_eq!(t.ty, GgmlType::Q8_0);
        assert_eq!(t.n_elements, 64);
        assert_eq!(t.n_bytes, 68);
        assert_eq!(t.offset, g.data_offset + 64);
    }

    #[test]
    fn v2_file_reads() {
        let g = read_bytes(&small_v(2).out).unwrap();
        assert_eq!(g.version, 2);
        assert_eq!(g.tensors.len(), 2);
        assert_eq!(g.metadata.len(), 5);
    }

    fn every_type_metadata() -> Metadata {
        let mut md = Metadata::default();
        md.push("general.architecture", MetaValue::String("llama".into()));
        md.push("llama.block_count", MetaValue::U32(30));
        md.push("t.u8", MetaValue::U8(250));
        md.push("t.i8", MetaValue::I8(-100));
        md.push("t.u16", MetaValue::U16(65000));
        md.push("t.i16", MetaValue::I16(-30000));
        md.push("t.i32", MetaValue::I32(-2_000_000_000));
        md.push("t.f32", MetaValue::F32(1.0e-5));
        md.push("t.f32inf", MetaValue::F32(f32::NEG_INFINITY));
        md.push("t.bool", MetaValue::Bool(true));
        md.push("t.bool0", MetaValue::Bool(false));
        md.push(
            "t.str",
            MetaValue::String("Grüße, 世界 🦀\n\"quoted\"".into()),
        );
        md.push("t.empty_str", MetaValue::String(String::new()));
        md.push("t.u64", MetaValue::U64(u64::MAX));
        md.push("t.i64", MetaValue::I64(i64::MIN));
        md.push("t.f64", MetaValue::F64(-0.1));
        md.push(
            "t.arr_f32",
            MetaValue::Array {
                elem: MetaType::F32,
                values: vec![MetaValue::F32(1.5), MetaValue::F32(-2.0)],
            },
        );
        md.push(
            "t.arr_str",
            MetaValue::Array {
                elem: MetaType::String,
                values: vec![
                    MetaValue::String("<s>".into()),
                    MetaValue::String("ĠÃ©".into()),
                    MetaValue::String(String::new()),
                ],
            },
        );
        md.push(
            "t.arr_empty",
            MetaValue::Array {
                elem: MetaType::I32,
                values: vec![],
            },
        );
        md.push(
            "t.arr_nested",
            MetaValue::Array {
                elem: MetaType::Array,
                values: vec![
                    MetaValue::Array {
                        elem: MetaType::I16,
                        values: vec![MetaValue::I16(-2), MetaValue::I16(5)],
                    },
                    MetaValue::Array {
                        elem: MetaType::String,
                        values: vec![MetaValue::String("x".into())],
                    },
                    MetaValue::Array {
                        elem: MetaType::Array,
                        values: vec![MetaValue::Array {
                            elem: MetaType::Bool,
                            values: vec![MetaValue::Bool(true)],
                        }],
                    },
                    MetaValue::Array {
                        elem: MetaType::U64,
                        values: vec![],
                    },
                ],
            },
        );
        md
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect()
    }

    fn round_trip(alignment: u64) {
        let md = every_type_metadata();
        let shapes: Vec<(String, Vec<u64>, GgmlType)> = vec![
            ("token_embd.weight".into(), vec![8], GgmlType::F32),
            ("blk.0.attn_norm.weight".into(), vec![16, 3], GgmlType::F16),
            ("blk.0.attn_q.weight".into(), vec![64, 2], GgmlType::Q8_0),
            ("blk.0.ffn_up.weight".into(), vec![256, 2, 3], GgmlType::Q4K),
        ];
        let sizes = [32usize, 96, 4 * 34, 6 * 144];
        let datas: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(n, i as u8))
            .collect();
        let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = shapes
            .iter()
            .zip(&datas)
            .map(|((n, d, t), data)| (n.clone(), d.clone(), *t, data.as_slice()))
            .collect();

        let f = tempfile::NamedTempFile::new().unwrap();
        {
            let mut w = std::io::BufWriter::new(std::fs::File::create(f.path()).unwrap());
            write_gguf(&mut w, &md, &tensors, alignment).unwrap();
        }
        let (header, rel) = encode_header(&md, &shapes, alignment).unwrap();
        assert_eq!(header.len() as u64 % alignment, 0);

        let src = SourceFile::open(f.path()).unwrap();
        let g = GgufFile::read(&src).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.alignment, alignment);
        assert_eq!(g.data_offset, header.len() as u64);
        let mut want_md = md.clone();
        if alignment != DEFAULT_ALIGNMENT {
            want_md.push(ALIGNMENT_KEY, MetaValue::U32(alignment as u32));
        }
        assert_eq!(g.metadata, want_md);
        assert_eq!(g.tensors.len(), 4);
        for (i, t) in g.tensors.iter().enumerate() {
            assert_eq!(t.name, shapes[i].0);
            assert_eq!(t.dims, shapes[i].1);
            assert_eq!(t.ty, shapes[i].2);
            assert_eq!(t.n_bytes, sizes[i] as u64);
            assert_eq!(t.n_elements, shapes[i].1.iter().product::<u64>());
            assert_eq!(t.offset, g.data_offset + rel[i]);
            assert_eq!(t.offset % alignment, 0);
            assert_eq!(src.read_vec(t.offset, t.n_bytes, "t").unwrap(), datas[i]);
        }
        // The file ends padded after the last tensor.
        let last = &g.tensors[3];
        assert_eq!(
            src.len(),
            align_up(last.offset + last.n_bytes, alignment).unwrap()
        );
        // The header bytes are exactly what encode_header returns.
        assert_eq!(src.read_vec(0, header.len() as u64, "h").unwrap(), header);
    }

    #[test]
    fn round_trip_default_alignment() {
        round_trip(32);
    }

    #[test]
    fn round_trip_alignment_64_and_4096() {
        round_trip(64);
        round_trip(4096);
    }

    #[test]
    fn writer_alignment_key_rules() {
        let shapes = vec![("x.weight".to_string(), vec![4], GgmlType::F32)];
        // Present and agreeing: not written twice.
        let mut md = Metadata::default();
        md.push(ALIGNMENT_KEY, MetaValue::U32(64));
        let data = [0u8; 16];
        let mut out = Vec::new();
        write_gguf(
            &mut out,
            &md,
            &[("x.weight".into(), vec![4], GgmlType::F32, &data[..])],
            64,
        )
        .unwrap();
        let g = read_bytes(&out).unwrap();
        assert_eq!(g.metadata.len(), 1);
        assert_eq!(g.alignment, 64);
        // Default alignment without the key: no key added.
        let (h, _) = encode_header(&Metadata::default(), &shapes, 32).unwrap();
        assert_eq!(u64::from_le_bytes(h[16..24].try_into().unwrap()), 0);
        // Disagreeing or mistyped key.
        for v in [
            MetaValue::U32(32),
            MetaValue::U64(64),
            MetaValue::String("64".into()),
        ] {
            let mut md = Metadata::default();
            md.push(ALIGNMENT_KEY, v);
            let e = encode_header(&md, &shapes, 64).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::BadValue, "{e}");
        }
        for a in [0, 3, 48, 1 << 21] {
            let e = encode_header(&Metadata::default(), &shapes, a).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::BadValue, "{a}: {e}");
        }
    }

    type Shapes = Vec<(String, Vec<u64>, GgmlType)>;

    #[test]
    fn writer_refuses_what_the_reader_would() {
        let md = Metadata::default();
        let t = |n: &str, d: Vec<u64>, ty| vec![(n.to_string(), d, ty)];
        let cases: Vec<(Shapes, ErrorKind)> = vec![
            (t("a", vec![], GgmlType::F32), ErrorKind::BadShape),
            (
                t("a", vec![1, 1, 1, 1, 1], GgmlType::F32),
                ErrorKind::BadShape,
            ),
            (t("a", vec![4, 0], GgmlType::F32), ErrorKind::BadShape),
            (t("a", vec![33], GgmlType::Q8_0), ErrorKind::BadShape),
            (
                t("a", vec![1 << 40, 1 << 40], GgmlType::F32),
                ErrorKind::Overflow,
            ),
            (t("a/b", vec![4], GgmlType::F32), ErrorKind::BadName),
            (
                vec![
                    ("a".into(), vec![4], GgmlType::F32),
                    ("a".into(), vec![4], GgmlType::F32),
                ],
                ErrorKind::BadName,
            ),
        ];
        for (shapes, kind) in cases {
            let e = encode_header(&md, &shapes, 32).unwrap_err();
            assert_eq!(e.kind(), kind, "{shapes:?}: {e}");
        }
        let mut dup = Metadata::default();
        dup.push("k", MetaValue::U8(1));
        dup.push("k", MetaValue::U8(2));
        assert_eq!(
            encode_header(&dup, &[], 32).unwrap_err().kind(),
            ErrorKind::BadValue
        );
        let mut mixed = Metadata::default();
        mixed.push(
            "k",
            MetaValue::Array {
                elem: MetaType::U8,
                values: vec![MetaValue::U16(1)],
            },
        );
        assert_eq!(
            encode_header(&mixed, &[], 32).unwrap_err().kind(),
            ErrorKind::BadValue
        );
        // Wrong data length: LengthMismatch, nothing written.
        let mut out = Vec::new();
        let e = write_gguf(
            &mut out,
            &md,
            &[("a".into(), vec![4], GgmlType::F32, &[0u8; 15][..])],
            32,
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::LengthMismatch);
        assert_eq!(e.tensor_name(), Some("a"));
        assert!(out.is_empty());
    }

    #[test]
    fn large_header_streams_through_chunks() {
        // A 3 MiB string (read directly) and 300k short strings (buffer
        // refills at chunk boundaries).
        let big = "é".repeat(3 << 19);
        let tokens: Vec<MetaValue> = (0..300_000)
            .map(|i| MetaValue::String(format!("tok{i}")))
            .collect();
        let mut md = Metadata::default();
        md.push("big", MetaValue::String(big.clone()));
        md.push(
            "tokenizer.ggml.tokens",
            MetaValue::Array {
                elem: MetaType::String,
                values: tokens.clone(),
            },
        );
        let data = pattern(4 * 32 * 4, 9);
        let mut out = Vec::new();
        write_gguf(
            &mut out,
            &md,
            &[("w".into(), vec![32, 4], GgmlType::F32, &data[..])],
            32,
        )
        .unwrap();
        let g = read_bytes(&out).unwrap();
        assert_eq!(g.metadata, md);
        let t = &g.tensors[0];
        assert_eq!(&out[t.offset as usize..][..t.n_bytes as usize], &data[..]);
    }

    #[test]
    fn real_model_if_present() {
        let p =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !p.exists() {
            eprintln!("skipping: {} not present", p.display());
            return;
        }
        let src = SourceFile::open(&p).unwrap();
        let g = GgufFile::read(&src).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.tensors.len(), 272);
        assert_eq!(g.metadata.len(), 33);
        assert_eq!(
            g.metadata
                .get("llama.block_count")
                .and_then(MetaValue::as_u64),
            Some(30)
        );
        let te = g.tensor("token_embd.weight").unwrap();
        assert_eq!(te.dims, vec![576, 49152]);
        assert_eq!(te.ty, GgmlType::Q8_0);
        let fd = g.tensor("blk.0.ffn_down.weight").unwrap();
        assert_eq!(fd.dims, vec![1536, 576]);
        assert_eq!(fd.ty, GgmlType::Q4_1);
        let count = |ty| g.tensors.iter().filter(|t| t.ty == ty).count();
        assert_eq!(count(GgmlType::Q4_1), 210);
        assert_eq!(count(GgmlType::F32), 61);
        assert_eq!(count(GgmlType::Q8_0), 1);
        for t in &g.tensors {
            assert!(t.offset >= g.data_offset && t.offset + t.n_bytes <= src.len());
        }
    }

    // -- malformed files --------------------------------------------------

    #[test]
    fn wrong_magic() {
        let mut b = small();
        b.out[..4].copy_from_slice(b"GGML");
        let e = fails(&b.out, ErrorKind::BadMagic);
        assert!(e.message().contains("GGML"), "{e}");
        assert_eq!(e.offset(), Some(0));
    }

    #[test]
    fn v1_is_unsupported() {
        let mut b = small();
        b.set_u32("version", 1);
        let e = fails(&b.out, ErrorKind::UnsupportedVersion);
        assert!(
            e.message().contains("GGUF v1 is not supported (v2/v3 are)"),
            "{e}"
        );
        assert_eq!(e.offset(), Some(4));
    }

    #[test]
    fn big_endian_is_unsupported() {
        for v in [0x0300_0000u32, 0x0200_0000] {
            let mut b = small();
            b.set_u32("version", v);
            let e = fails(&b.out, ErrorKind::UnsupportedVersion);
            assert!(e.message().contains("big-endian"), "{e}");
        }
        let mut b = small();
        b.set_u32("version", 4);
        let e = fails(&b.out, ErrorKind::UnsupportedVersion);
        assert!(e.message().contains("version 4"), "{e}");
    }

    #[test]
    fn truncated_at_every_section() {
        let b = small();
        let elems = b.at("value2") + 12;
        // (label, cut length, expected kind, expected offset)
        let cases: Vec<(&str, usize, ErrorKind, Option<u64>)> = vec![
            ("empty file", 0, ErrorKind::Truncated, Some(0)),
            ("inside magic", 2, ErrorKind::Truncated, Some(0)),
            ("inside version", 6, ErrorKind::Truncated, Some(4)),
            ("inside tensor_count", 12, ErrorKind::Truncated, Some(8)),
            ("inside kv_count", 20, ErrorKind::Truncated, Some(16)),
            // Too little left for the declared counts.
            (
                "inside first key",
                b.at("key0") + 11,
                ErrorKind::Truncated,
                None,
            ),
            // Inside the long description string: past the count check.
            (
                "inside a string value",
                b.at("value0") + 150,
                ErrorKind::Truncated,
                Some(b.at("value0") as u64 + 8),
            ),
            (
                "inside a key",
                b.at("key1") + 12,
                ErrorKind::Truncated,
                Some(b.at("key1") as u64 + 8),
            ),
            (
                "inside a u32 value",
                b.at("value1") + 2,
                ErrorKind::Truncated,
                Some(b.at("value1") as u64),
            ),
            (
                "inside array header",
                b.at("value2") + 6,
                ErrorKind::Truncated,
                Some(b.at("value2") as u64 + 4),
            ),
            (
                "inside array elements",
                elems + 25,
                ErrorKind::Truncated,
                Some(elems as u64 + 20),
            ),
            (
                "inside a tensor name",
                b.at("tensor0") + 10,
                ErrorKind::Truncated,
                Some(b.at("tensor0") as u64 + 8),
            ),
            (
                "inside a tensor ne",
                b.at("ne1_1") + 3,
                ErrorKind::Truncated,
                Some(b.at("ne1_1") as u64),
            ),
            (
                "inside a tensor offset",
                b.at("offset1") + 7,
                ErrorKind::Truncated,
                Some(b.at("offset1") as u64),
            ),
            (
                "inside padding",
                b.at("data") - 1,
                ErrorKind::OutOfBounds,
                None,
            ),
            (
                "inside first tensor's data",
                b.at("data") + 10,
                ErrorKind::OutOfBounds,
                Some(b.at("data") as u64),
            ),
            (
                "inside last tensor's data",
                b.at("data") + 100,
                ErrorKind::OutOfBounds,
                Some(b.at("data") as u64 + 64),
            ),
        ];
        for (label, len, kind, off) in cases {
            let e = fails(&b.cut(len), kind);
            if let Some(off) = off {
                assert_eq!(e.offset(), Some(off), "{label}: {e}");
            }
            assert!(
                e.offset().unwrap() <= len as u64 || kind == ErrorKind::OutOfBounds,
                "{label}: {e}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains("file") || msg.contains("outside"),
                "{label}: {e}"
            );
            if kind == ErrorKind::OutOfBounds {
                assert!(e.tensor_name().is_some(), "{label}: {e}");
            }
        }
        // The last byte of the last tensor is needed too; trailing padding
        // is not.
        fails(&b.cut(b.at("data") + 131), ErrorKind::OutOfBounds);
        read_bytes(&b.cut(b.at("data") + 132)).unwrap();
    }

    #[test]
    fn absurd_counts() {
        for v in [u64::MAX, 1 << 40, u64::MAX / 32 + 1] {
            let mut b = small();
            b.set_u64("tensor_count", v);
            let e = fails(&b.out, ErrorKind::TooLarge);
            assert_eq!(e.offset(), Some(8), "{e}");
            assert!(e.message().contains(&v.to_string()), "{e}");
            let mut b = small();
            b.set_u64("kv_count", v);
            let e = fails(&b.out, ErrorKind::TooLarge);
            assert_eq!(e.offset(), Some(16), "{e}");
        }
        // Plausible counts the file cannot hold: truncated.
        let mut b = small();
        b.set_u64("tensor_count", 1000);
        fails(&b.out, ErrorKind::Truncated);
    }

    #[test]
    fn absurd_string_lengths() {
        for m in ["value0", "key1"] {
            for v in [u64::MAX, 1 << 40, MAX_STRING_BYTES + 1] {
                let mut b = small();
                b.set_u64(m, v);
                let e = fails(&b.out, ErrorKind::TooLarge);
                assert_eq!(e.offset(), Some(b.at(m) as u64), "{e}");
                assert!(e.message().contains(&v.to_string()), "{e}");
            }
            // Within the cap but past the end of the file.
            let mut b = small();
            b.set_u64(m, 60_000);
            let e = fails(&b.out, ErrorKind::Truncated);
            assert_eq!(e.offset(), Some(b.at(m) as u64 + 8), "{e}");
        }
    }

    #[test]
    fn absurd_array_count() {
        let count_at = "value2";
        for v in [u64::MAX, 1 << 40, u64::MAX / 8 + 1] {
            let mut b = small();
            let at = b.at(count_at) + 4;
            b.out[at..at + 8].copy_from_slice(&v.to_le_bytes());
            let e = fails(&b.out, ErrorKind::TooLarge);
            assert_eq!(e.offset(), Some(at as u64), "{e}");
            assert!(e.message().contains("tokenizer.ggml.tokens"), "{e}");
        }
        let mut b = small();
        let at = b.at(count_at) + 4;
        b.out[at..at + 8].copy_from_slice(&1000u64.to_le_bytes());
        let e = fails(&b.out, ErrorKind::Truncated);
        assert_eq!(e.offset(), Some(at as u64), "{e}");
    }

    #[test]
    fn array_nesting_too_deep() {
        // Five levels of arrays.
        let mut v = B::default();
        for _ in 0..4 {
            v.u32(9).u64(1);
        }
        v.u32(0).u64(1).bytes(&[7]);
        let b = file(3, &[("deep", (9, v.out.clone()))], &[], 32, 0);
        let e = fails(&b.out, ErrorKind::TooLarge);
        assert!(e.message().contains("nested"), "{e}");
        // Four levels are fine.
        let mut v = B::default();
        for _ in 0..3 {
            v.u32(9).u64(1);
        }
        v.u32(0).u64(1).bytes(&[7]);
        read_bytes(&file(3, &[("deep", (9, v.out))], &[], 32, 0).out).unwrap();
    }

    #[test]
    fn unknown_value_type() {
        let mut b = small();
        b.set_u32("type1", 13);
        let e = fails(&b.out, ErrorKind::UnknownType);
        assert_eq!(e.offset(), Some(b.at("type1") as u64));
        assert!(
            e.message().contains("13") && e.message().contains("llama.block_count"),
            "{e}"
        );
        // Unknown array element type.
        let mut b = small();
        b.set_u32("value2", 99);
        let e = fails(&b.out, ErrorKind::UnknownType);
        assert_eq!(e.offset(), Some(b.at("value2") as u64));
        assert!(e.message().contains("99"), "{e}");
    }

    #[test]
    fn unknown_ggml_type() {
        for id in [4u32, 5, 36, 1000, u32::MAX] {
            let mut b = small();
            b.set_u32("ttype1", id);
            let e = fails(&b.out, ErrorKind::UnknownType);
            assert_eq!(e.tensor_name(), Some("b.weight"));
            assert_eq!(e.offset(), Some(b.at("ttype1") as u64));
            assert!(e.message().contains(&format!("id {id}")), "{e}");
        }
        // Known but not decodable types are accepted.
        let b = file(3, &[], &[("iq.weight", &[256], 16, 0)], 32, 66);
        assert_eq!(read_bytes(&b.out).unwrap().tensors[0].ty, GgmlType::Iq2Xxs);
    }

    #[test]
    fn bad_n_dims() {
        for n in [0u32, 5, u32::MAX] {
            let mut b = small();
            b.set_u32("n_dims1", n);
            let e = fails(&b.out, ErrorKind::BadShape);
            assert_eq!(e.tensor_name(), Some("b.weight"));
            assert_eq!(e.offset(), Some(b.at("n_dims1") as u64));
            assert!(e.message().contains(&format!("n_dims is {n}")), "{e}");
        }
    }

    #[test]
    fn zero_dim() {
        let mut b = small();
        b.set_u64("ne1_1", 0);
        let e = fails(&b.out, ErrorKind::BadShape);
        assert_eq!(e.offset(), Some(b.at("ne1_1") as u64));
        assert!(e.message().contains("ne[1] is 0"), "{e}");
    }

    #[test]
    fn element_count_overflow() {
        for ne1 in [1u64 << 60, u64::MAX, 1 << 58] {
            let mut b = small();
            b.set_u64("ne1_1", ne1);
            let e = fails(&b.out, ErrorKind::Overflow);
            assert_eq!(e.tensor_name(), Some("b.weight"));
            assert_eq!(e.offset(), Some(b.at("ne1_0") as u64), "{e}");
        }
        // The 2^42 + 1 wraparound shape from llama.cpp PR #18674.
        let b = file(
            3,
            &[],
            &[("w", &[1 << 42, (1 << 22) + 1, 1 << 0], 0, 0)],
            32,
            0,
        );
        // 2^42 * (2^22 + 1) = 2^64 + 2^42 overflows u64.
        let e = fails(&b.out, ErrorKind::Overflow);
        assert!(
            e.message().contains("overflow") || e.message().contains("int64"),
            "{e}"
        );
    }

    #[test]
    fn ne0_not_multiple_of_block() {
        let mut b = small();
        b.set_u64("ne1_0", 33);
        let e = fails(&b.out, ErrorKind::BadShape);
        assert_eq!(e.offset(), Some(b.at("ne1_0") as u64));
        assert!(e.message().contains("block size 32"), "{e}");
    }

    #[test]
    fn misaligned_offset() {
        let mut b = small();
        b.set_u64("offset1", 65);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert_eq!(e.tensor_name(), Some("b.weight"));
        assert_eq!(e.offset(), Some(b.at("offset1") as u64));
        assert!(e.message().contains("alignment 32"), "{e}");
    }

    #[test]
    fn offset_past_eof() {
        for off in [1u64 << 20, u64::MAX - 31] {
            let mut b = small();
            b.set_u64("offset1", off);
            let e = read_bytes(&b.out).unwrap_err();
            assert!(
                matches!(e.kind(), ErrorKind::OutOfBounds | ErrorKind::Overflow),
                "{e}"
            );
            assert_eq!(e.tensor_name(), Some("b.weight"));
            assert!(e.offset().is_some() && e.file().is_some(), "{e}");
        }
        let mut b = small();
        b.set_u64("offset1", 1 << 20);
        let e = fails(&b.out, ErrorKind::OutOfBounds);
        assert!(e.message().contains("outside the file"), "{e}");
    }

    #[test]
    fn overlapping_tensors() {
        let mut b = small();
        b.set_u64("offset1", 0);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert!(
            e.message().contains("a.weight") && e.message().contains("b.weight"),
            "{e}"
        );
        assert!(e.message().contains("overlap"), "{e}");
        // Touching ranges are fine: a.weight is 32 bytes at 0, b at 32.
        let mut b = small();
        b.set_u64("offset1", 32);
        read_bytes(&b.out).unwrap();
    }

    #[test]
    fn duplicate_tensor_name() {
        let b = file(
            3,
            &[],
            &[("a.weight", &[8], 0, 0), ("a.weight", &[8], 0, 32)],
            32,
            64,
        );
        let e = fails(&b.out, ErrorKind::BadName);
        assert_eq!(e.offset(), Some(b.at("tensor1") as u64));
        assert!(e.message().contains("duplicate"), "{e}");
    }

    #[test]
    fn bad_tensor_names() {
        for name in ["", "a/b", "..", "x\0y"] {
            let b = file(3, &[], &[(name, &[8], 0, 0)], 32, 32);
            let e = fails(&b.out, ErrorKind::BadName);
            assert_eq!(e.offset(), Some(b.at("tensor0") as u64), "{name:?}: {e}");
        }
        let long = "n".repeat(300);
        let b = file(3, &[], &[(&long, &[8], 0, 0)], 32, 32);
        fails(&b.out, ErrorKind::BadName);
        // Declared length over the 4096-byte cap.
        let mut b = file(3, &[], &[("a", &[8], 0, 0)], 32, 32);
        b.set_u64("tensor0", 5000);
        let e = fails(&b.out, ErrorKind::BadName);
        assert!(e.message().contains("5000"), "{e}");
    }

    #[test]
    fn duplicate_and_empty_keys() {
        let b = file(3, &[("k", v_u32(1)), ("k", v_u32(2))], &[], 32, 0);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert_eq!(e.offset(), Some(b.at("key1") as u64));
        assert!(e.message().contains("duplicate metadata key \"k\""), "{e}");
        let b = file(3, &[("", v_u32(1))], &[], 32, 0);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert!(e.message().contains("empty key"), "{e}");
    }

    #[test]
    fn bad_alignment() {
        for a in [0u32, 3, 48, 1 << 21, u32::MAX] {
            let mut b = small();
            b.set_u32("value3", a);
            let e = fails(&b.out, ErrorKind::BadValue);
            assert_eq!(e.offset(), Some(b.at("value3") as u64));
            assert!(e.message().contains("general.alignment"), "{e}");
        }
        let b = file(3, &[("general.alignment", v_str("32"))], &[], 32, 0);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert!(e.message().contains("must be a u32"), "{e}");
        let b = file(
            3,
            &[("general.alignment", (10, 32u64.to_le_bytes().to_vec()))],
            &[],
            32,
            0,
        );
        fails(&b.out, ErrorKind::BadValue);
        // A valid non-default alignment moves the data section.
        let b = file(
            3,
            &[("general.alignment", v_u32(256))],
            &[("a", &[8], 0, 0)],
            256,
            32,
        );
        let g = read_bytes(&b.out).unwrap();
        assert_eq!((g.alignment, g.data_offset), (256, 256));
    }

    #[test]
    fn bad_utf8_and_bool() {
        let mut b = small();
        let at = b.at("value0") + 8 + 3;
        b.out[at] = 0xff;
        let e = fails(&b.out, ErrorKind::BadValue);
        assert_eq!(e.offset(), Some(at as u64));
        assert!(e.message().contains("UTF-8"), "{e}");
        let b = file(3, &[("flag", (7, vec![2]))], &[], 32, 0);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert!(e.message().contains("bool"), "{e}");
    }

    // -- fuzz ---------------------------------------------------------------

    #[test]
    fn mutations_never_panic() {
        let base = small().out;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rng = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let huge = [
            u64::MAX,
            1 << 40,
            1 << 63,
            1 << 32,
            u64::MAX - 31,
            0,
            1 << 20,
        ];
        let f = tempfile::NamedTempFile::new().unwrap();
        let (mut ok, mut errs) = (0, 0);
        let mut kinds = std::collections::BTreeSet::new();
        let t0 = std::time::Instant::now();
        for _ in 0..20_000 {
            let mut m = base.clone();
            for _ in 0..1 + rng() % 3 {
                let len = m.len().max(1) as u64;
                match rng() % 5 {
                    0 => {
                        let i = (rng() % len) as usize;
                        if let Some(x) = m.get_mut(i) {
                            *x ^= 1 << (rng() % 8);
                        }
                    }
                    1 => {
                        let i = (rng() % len) as usize;
                        if let Some(x) = m.get_mut(i) {
                            *x = rng() as u8;
                        }
                    }
                    2 => m.truncate((rng() % len) as usize),
                    3 => {
                        let i = (rng() % len) as usize;
                        let v = huge[(rng() % huge.len() as u64) as usize].to_le_bytes();
                        for (k, b) in v.iter().enumerate() {
                            if let Some(x) = m.get_mut(i + k) {
                                *x = *b;
                            }
                        }
                    }
                    _ => {
                        let i = (rng() % len) as usize;
                        let v = (rng() as u32 % 64).to_le_bytes();
                        for (k, b) in v.iter().enumerate() {
                            if let Some(x) = m.get_mut(i + k) {
                                *x = *b;
                            }
                        }
                    }
                }
            }
            // Rewrite in place without truncating to zero (ext4 flushes a
            // file replaced by truncation on close, which is slow).
            f.as_file().set_len(m.len() as u64).unwrap();
            f.as_file().write_all_at(&m, 0).unwrap();
            let src = SourceFile::open(f.path()).unwrap();
            match GgufFile::read(&src) {
                Ok(g) => {
                    ok += 1;
                    for t in &g.tensors {
                        assert!(t.offset + t.n_bytes <= src.len());
                    }
                }
                Err(e) => {
                    errs += 1;
                    assert!(e.file().is_some(), "{e}");
                    assert!(e.offset().is_some(), "{e}");
                    kinds.insert(format!("{:?}", e.kind()));
                }
            }
        }
        eprintln!(
            "fuzz: {ok} ok, {errs} errors {kinds:?} in {:?}",
            t0.elapsed()
        );
        assert!(errs > 5000);
    }
}
