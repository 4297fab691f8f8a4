//! The GGUF reader: the header and tensor table of an untrusted file,
//! streamed through a bounded cursor, every count and length checked
//! against the bytes left before anything is allocated (module docs of
//! [`super`]).

use std::collections::HashSet;

use super::value::{MetaBudget, MetaType, MetaValue, Metadata};
use super::*;
use crate::error::product;
use crate::format::MAX_TENSORS;
use crate::names::check_servable;

/// Bytes per positioned read of the header.
const READ_CHUNK: usize = 1 << 20;
/// Minimum encoded size of one kv pair (key length, type, 1 value byte).
const KV_MIN_BYTES: u64 = 8 + 4 + 1;
/// Minimum encoded size of one tensor info (name length, n_dims, ne0, type,
/// offset).
const TENSOR_INFO_MIN_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// Upper bound on capacity reserved from a count read from the file.
const PREALLOC_CAP: usize = 4096;

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

pub(super) fn read_inner(src: &SourceFile) -> Result<GgufFile> {
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
