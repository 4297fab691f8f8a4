//! Dense .knot: ggml blocks verbatim in a `KNOT` v1 container whose meta
//! JSON has a `tensors` map:
//!
//! ```json
//! {"format":"knot","metadata":{...},"tensors":{
//!   "blk_0_attn_q_weight":{"type":"q4_k","shape":[576,576],"offset":0,"length":...}}}
//! ```
//! `shape` is outer-first (the last dim is ggml's ne0); offsets are
//! relative to payload_base; `length` must equal what type and shape imply.

use std::io::Write;

use serde::de::MapAccess;
use serde_json::{Map, Value, json};

use crate::error::{Error, ErrorKind, Result, add, err, product};
use crate::format::checksum::{self, ChunkHasher, ChunkSums};
use crate::format::container::{self, KnotContainer, TableEntry};
use crate::format::json::{Field, MaxLen, Seed, U64Array, required, skip_value};
use crate::format::meta::{Metadata, parse_metadata_at};
use crate::names;
use crate::quant::GgmlType;
use crate::source::SourceFile;

/// Types a dense .knot may declare.
pub const KNOT_TYPES: &[GgmlType] = crate::quant::DECODABLE;

/// Most dims a tensor may have (as ggml).
pub const MAX_DIMS: usize = 4;

#[derive(Debug, Clone)]
pub struct KnotTensorInfo {
    /// Name as stored (underscore spelling).
    pub name: String,
    pub ty: GgmlType,
    /// Outer-first.
    pub shape: Vec<u64>,
    pub n_elements: u64,
    /// Absolute file offset.
    pub offset: u64,
    pub length: u64,
    /// CRC-32 per chunk of the stored bytes, in a checked file.
    pub sums: Option<ChunkSums>,
}

#[derive(Debug, Clone)]
pub struct DenseKnotFile {
    pub metadata: Metadata,
    pub payload_base: u64,
    /// The file carries checksums (a KSUM record and one `crc32` per tensor).
    pub checked: bool,
    /// Sorted by offset.
    pub tensors: Vec<KnotTensorInfo>,
}

/// Parse a dense .knot type name. `q4_k_m` (a file-type label some
/// producers wrote per tensor, see seed 001) is read as `q4_k`.
pub fn parse_type(name: &str) -> Option<GgmlType> {
    let lower = name.to_ascii_lowercase();
    let t = if lower == "q4_k_m" || lower == "q4_k_s" {
        GgmlType::Q4K
    } else {
        GgmlType::from_name(&lower)?
    };
    KNOT_TYPES.contains(&t).then_some(t)
}

/// Validate a shape for a ggml type; returns the element count.
pub fn check_shape(shape: &[u64], ty: GgmlType) -> Result<u64> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(err(
            ErrorKind::BadShape,
            format!("shape {shape:?} must have 1 to {MAX_DIMS} dims"),
        ));
    }
    if shape.contains(&0) {
        return Err(err(
            ErrorKind::BadShape,
            format!("shape {shape:?} has a zero dim"),
        ));
    }
    let n = product(shape, "element count")?;
    let inner = shape[shape.len() - 1];
    if !inner.is_multiple_of(ty.block_elems()) {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "innermost dim {inner} is not a multiple of the {ty} block size {}",
                ty.block_elems()
            ),
        ));
    }
    Ok(n)
}

/// A tensor entry as written, before validation (also a .rknot's
/// `dense_tensors` entry).
#[derive(Default)]
pub struct RawTensor {
    ty: Option<String>,
    shape: Option<Vec<u64>>,
    offset: Option<u64>,
    length: Option<u64>,
    crc32: Option<(u64, Vec<u64>)>,
}

/// More dims than this are refused while parsing (before they are kept).
const SHAPE_PARSE_CAP: MaxLen<'static> = MaxLen {
    len: MAX_DIMS,
    kind: ErrorKind::BadShape,
    message: "shape has more than 4 dims: it must have 1 to 4 dims",
};

impl TableEntry for RawTensor {
    fn read_field<'de, A: MapAccess<'de>>(
        &mut self,
        f: Field<'_>,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match f.key {
            "type" => self.ty = Some(f.read_string(map)?),
            "shape" => {
                self.shape = Some(map.next_value_seed(Seed(U64Array {
                    f,
                    max: Some(SHAPE_PARSE_CAP),
                    increasing: None,
                }))?);
            }
            "offset" => self.offset = Some(f.read_u64(map)?),
            "length" => self.length = Some(f.read_u64(map)?),
            "crc32" => self.crc32 = Some(checksum::read_chunk_sums(f, map)?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
}

impl DenseKnotFile {
    pub fn from_container(src: &SourceFile, c: &KnotContainer) -> Result<DenseKnotFile> {
        let path = src.path();
        let at = container::KNOT_PREFIX_LEN;
        let wrap = |e: Error| e.path(path).at(at);
        if let Some(f) = &c.meta.format
            && f != "knot"
        {
            return Err(wrap(err(
                ErrorKind::BadValue,
                format!("meta has a \"tensors\" map but \"format\": {f:?} (want \"knot\")"),
            )));
        }
        let metadata = match &c.meta.metadata {
            Some(m) => {
                let (json, base) = c.member(m);
                parse_metadata_at(json, base, c.meta_len, "meta_json").map_err(|e| e.path(path))?
            }
            None => Metadata::default(),
        };
        let entries: Vec<(String, RawTensor)> =
            container::read_table(c, c.meta.tensors.as_ref(), "tensors", "tensor")
                .map_err(|e| e.path(path))?;
        let mut tensors = Vec::with_capacity(entries.len());
        for (name, r) in entries {
            let located = dense_entry(&name, r, c.ksum.is_some(), |offset, length| {
                c.payload_range(src, offset, length, "tensor")
            });
            tensors.push(located.map_err(|e| e.tensor(&name).path(path).at(at))?);
        }
        tensors.sort_by(|a, b| a.offset.cmp(&b.offset).then(a.name.cmp(&b.name)));
        for w in tensors.windows(2) {
            if w[0].offset + w[0].length > w[1].offset {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "tensors {:?} and {:?} overlap in the payload",
                        w[0].name, w[1].name
                    ),
                )
                .path(path)
                .tensor(&w[1].name)
                .at(w[1].offset));
            }
        }
        Ok(DenseKnotFile {
            metadata,
            payload_base: c.payload_base,
            checked: c.ksum.is_some(),
            tensors,
        })
    }
}

/// Validate one dense tensor entry: type, shape, and a length of exactly
/// the bytes the type and shape imply; `crc32` present exactly when the
/// file is `checked`; `locate(offset, length)` checks the range against
/// the file and returns its absolute offset.
pub fn dense_entry(
    name: &str,
    r: RawTensor,
    checked: bool,
    locate: impl FnOnce(u64, u64) -> Result<u64>,
) -> Result<KnotTensorInfo> {
    let ctx = format!("tensor {name:?}");
    let tname = required(r.ty, &ctx, "type")?;
    let ty = parse_type(&tname).ok_or_else(|| {
        err(
            ErrorKind::UnknownType,
            format!(
                "unknown tensor type {tname:?} (dense .knot types: f32, f16, bf16, \
                 q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k)"
            ),
        )
    })?;
    let shape = required(r.shape, &ctx, "shape")?;
    let n = check_shape(&shape, ty)?;
    let want = ty.bytes_for(n).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("byte size of {n} {ty} elements"),
        )
    })?;
    let offset = required(r.offset, &ctx, "offset")?;
    let length = required(r.length, &ctx, "length")?;
    if length != want {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!("length {length} != {want} bytes implied by {ty} {shape:?}"),
        ));
    }
    let abs = locate(offset, length)?;
    let sums = checksum::entry_sums(r.crc32, checked, length, "the tensor")?;
    Ok(KnotTensorInfo {
        name: name.to_string(),
        ty,
        shape,
        n_elements: n,
        offset: abs,
        length,
        sums,
    })
}

/// A tensor to write into a dense .knot.
pub struct KnotTensorOut<'a> {
    /// Any spelling; written in underscore spelling.
    pub name: &'a str,
    pub ty: GgmlType,
    /// Outer-first.
    pub shape: &'a [u64],
    /// ggml blocks verbatim.
    pub data: &'a [u8],
}

/// Write a dense .knot: container header, then tensor bytes in order.
pub fn write_knot<W: Write>(
    w: &mut W,
    metadata: &Metadata,
    tensors: &[KnotTensorOut],
) -> Result<()> {
    for t in tensors {
        let n = check_shape(t.shape, t.ty).map_err(|e| e.tensor(t.name))?;
        if t.data.len() as u64 != t.ty.bytes_for(n).unwrap_or(u64::MAX) {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!("{} bytes of data for {} {:?}", t.data.len(), t.ty, t.shape),
            )
            .tensor(t.name));
        }
    }
    let layout: Vec<(&str, GgmlType, &[u64])> =
        tensors.iter().map(|t| (t.name, t.ty, t.shape)).collect();
    write_knot_with(w, metadata, &layout, |i, w| {
        w.write_all(tensors[i].data)
            .map_err(|e| err(ErrorKind::Io, format!("write: {e}")))
    })
}

/// Counts what passes through to `w`.
struct CountingWriter<'a, W: Write> {
    w: &'a mut W,
    n: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.w.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

/// Write a dense .knot whose tensor bytes come from `write_data(i, w)`,
/// called twice per tensor in order, once into a checksum pass and once
/// into the file (it must write exactly the bytes the type and shape
/// imply, the same both times): lets a repack stream blocks from its
/// source. The header carries each tensor's CRC-32s and a KSUM record
/// after the payload closes the file (docs/FORMAT.md section 12).
pub fn write_knot_with<W: Write>(
    w: &mut W,
    metadata: &Metadata,
    tensors: &[(&str, GgmlType, &[u64])],
    mut write_data: impl FnMut(usize, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let mut sums = Vec::with_capacity(tensors.len());
    for i in 0..tensors.len() {
        let mut h = ChunkHasher::new(checksum::WRITE_CHUNK);
        write_data(i, &mut h)?;
        sums.push(h.finish());
    }
    let mut map = Map::new();
    let mut offset = 0u64;
    let mut lengths = Vec::with_capacity(tensors.len());
    for (&(stored, ty, shape), sums) in tensors.iter().zip(&sums) {
        let name = names::underscore(&names::canonical(stored));
        if !KNOT_TYPES.contains(&ty) {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!("{ty} cannot be stored in a dense .knot"),
            )
            .tensor(&name));
        }
        let n = check_shape(shape, ty).map_err(|e| e.tensor(&name))?;
        let want = ty
            .bytes_for(n)
            .ok_or_else(|| err(ErrorKind::Overflow, "tensor byte size").tensor(&name))?;
        if map.contains_key(&name) {
            return Err(err(ErrorKind::BadName, "duplicate tensor name").tensor(&name));
        }
        lengths.push((want, sums.len == want));
        map.insert(
            name,
            json!({"type": ty.name(), "shape": shape, "offset": offset, "length": want,
                   "crc32": sums.to_json()}),
        );
        offset = add(offset, want, "payload size")?;
    }
    // After every name, type and shape is known good: those errors say
    // more than a length.
    for (i, &(want, right_len)) in lengths.iter().enumerate() {
        if !right_len {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!("the data written is not the {want} bytes its type and shape need"),
            )
            .tensor(tensors[i].0));
        }
    }
    let meta =
        json!({"format": "knot", "metadata": metadata.to_json(), "tensors": Value::Object(map)});
    let (_, header_crc) = container::write_container_header_crc(w, &meta)?;
    for (i, &(want, _)) in lengths.iter().enumerate() {
        let mut counted = CountingWriter { w: &mut *w, n: 0 };
        write_data(i, &mut counted)?;
        if counted.n != want {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!("{} bytes written for a tensor of {want}", counted.n),
            )
            .tensor(tensors[i].0));
        }
    }
    w.write_all(&checksum::ksum_record(header_crc))
        .map_err(|e| err(ErrorKind::Io, format!("write: {e}")))?;
    Ok(())
}
