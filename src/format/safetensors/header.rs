//! The header of one `.safetensors` file, read as strictly as the
//! safetensors crate reads it: an 8-byte little-endian length, that many
//! bytes of a JSON object (`__metadata__`: a map of strings; every other
//! key a tensor `{"dtype", "shape", "data_offsets"}`), then the data, which
//! the tensors cover exactly, in order, without gaps or overlaps. Two more
//! rules than serde_json's defaults: a key twice (in the header, a tensor
//! or the metadata) is refused, as is a field the format does not have.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{Dtype, SafeTensor, SafetensorsFile};
use crate::error::{ErrorKind, Result, err};
use crate::format::json::{Expect, Found, Parse, Seed, span_of};
use crate::format::{MAX_TENSORS, gguf::MAX_HEADER_BYTES, too_many_tensors};
use crate::source::SourceFile;

/// Bytes of the length prefix.
pub const PREFIX_BYTES: u64 = 8;

/// Most dimensions a tensor may have (the safetensors crate sets none;
/// real checkpoints have at most 5).
pub const MAX_RANK: usize = 8;

/// Read and validate the header of `src`; no tensor data is read.
pub fn read(src: &SourceFile) -> Result<SafetensorsFile> {
    let path = src.path();
    if src.len() < PREFIX_BYTES {
        return Err(err(
            ErrorKind::Truncated,
            format!(
                "a safetensors file starts with an 8-byte header length; this one has {} bytes",
                src.len()
            ),
        )
        .path(path)
        .at(0));
    }
    let mut prefix = [0u8; 8];
    src.read_at(0, &mut prefix)?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES {
        return Err(err(
            ErrorKind::TooLarge,
            format!("header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap"),
        )
        .path(path)
        .at(0));
    }
    let data_start = PREFIX_BYTES + header_len;
    if data_start > src.len() {
        return Err(err(
            ErrorKind::Truncated,
            format!(
                "header length {header_len} runs past the end of the {}-byte file",
                src.len()
            ),
        )
        .path(path)
        .at(0));
    }
    let json = src.read_vec(PREFIX_BYTES, header_len, "safetensors header")?;
    parse(&json, src.len()).map_err(|e| e.path(path))
}

/// Validate a header (`json`, the bytes after the length prefix) of a
/// file of `file_len` bytes.
pub fn parse(json: &[u8], file_len: u64) -> Result<SafetensorsFile> {
    let header_len = json.len() as u64;
    let data_start = PREFIX_BYTES + header_len;
    if json.first() != Some(&b'{') {
        return Err(err(
            ErrorKind::BadJson,
            "the header does not start with '{' (a JSON object)",
        )
        .at(PREFIX_BYTES));
    }
    if let Err(e) = std::str::from_utf8(json) {
        return Err(err(ErrorKind::BadJson, "the header is not UTF-8")
            .at(PREFIX_BYTES + e.valid_up_to() as u64));
    }
    let p = Parse::default();
    let (metadata, raw) = p.run(Top { p: &p, doc: json }, json, PREFIX_BYTES, "the header")?;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, at) in raw {
        let span = at.clone();
        let value = &json[at];
        let base = PREFIX_BYTES + span.start as u64;
        let tp = Parse::default();
        let t = tp
            .run(Seed(TensorSeed { p: &tp }), value, base, "the tensor entry")
            .map_err(|e| e.tensor(&name))?;
        tensors.push(SafeTensor {
            name,
            dtype: t.0,
            shape: t.1,
            begin: t.2,
            end: t.3,
            header_at: base,
        });
    }
    check_layout(&mut tensors, data_start, file_len)?;
    Ok(SafetensorsFile {
        header_len,
        data_start,
        metadata,
        tensors,
    })
}

/// The tensors in data order, each exactly its dtype × shape in size,
/// one after the other from the data's start to the file's end.
fn check_layout(tensors: &mut [SafeTensor], data_start: u64, file_len: u64) -> Result<()> {
    tensors.sort_by_key(|t| (t.begin, t.end));
    let Some(data_len) = file_len.checked_sub(data_start) else {
        return Err(err(
            ErrorKind::Truncated,
            format!("the header runs past the end of the {file_len}-byte file"),
        )
        .at(0));
    };
    let mut next = 0u64;
    for t in tensors.iter() {
        let fail = |kind, msg: String| Err(err(kind, msg).tensor(&t.name).at(t.header_at));
        if t.end < t.begin {
            return fail(
                ErrorKind::BadValue,
                format!(
                    "data_offsets [{}, {}] end before they begin",
                    t.begin, t.end
                ),
            );
        }
        if t.begin != next {
            let what = if t.begin < next {
                "overlaps"
            } else {
                "leaves a gap after"
            };
            return fail(
                ErrorKind::BadValue,
                format!(
                    "data_offsets [{}, {}] {what} the previous tensor's data (which ends at {next}; \
                     absolute byte {})",
                    t.begin,
                    t.end,
                    data_start.saturating_add(next)
                ),
            );
        }
        let n = t.n_elements().ok_or_else(|| {
            err(
                ErrorKind::Overflow,
                format!("shape {:?} overflows u64 elements", t.shape),
            )
            .tensor(&t.name)
            .at(t.header_at)
        })?;
        let want = t.dtype.bytes_for(n).ok_or_else(|| {
            err(
                ErrorKind::LengthMismatch,
                format!(
                    "{n} elements of {} are not a whole number of bytes, or overflow",
                    t.dtype
                ),
            )
            .tensor(&t.name)
            .at(t.header_at)
        })?;
        if t.end - t.begin != want {
            return fail(
                ErrorKind::LengthMismatch,
                format!(
                    "data_offsets [{}, {}] hold {} bytes; shape {:?} of {} takes {want}",
                    t.begin,
                    t.end,
                    t.end - t.begin,
                    t.shape,
                    t.dtype
                ),
            );
        }
        if t.end > data_len {
            return fail(
                ErrorKind::OutOfBounds,
                format!(
                    "data_offsets [{}, {}] run past the end of the file (its data is {data_len} \
                     bytes from byte {data_start})",
                    t.begin, t.end
                ),
            );
        }
        next = t.end;
    }
    if next != data_len {
        return Err(err(
            ErrorKind::LengthMismatch,
            format!(
                "the tensors cover {next} bytes of data; the file has {data_len} after its header \
                 (from byte {data_start})"
            ),
        )
        .at(data_start.saturating_add(next)));
    }
    Ok(())
}

/// The top-level object: the metadata, and each tensor's name with where
/// its entry lies in the header (parsed after, so that its errors point
/// into it).
struct Top<'a> {
    p: &'a Parse,
    doc: &'a [u8],
}

type TopValue = (Vec<(String, String)>, Vec<(String, std::ops::Range<usize>)>);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = TopValue;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<TopValue, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = TopValue;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopValue, A::Error> {
        let mut seen = HashSet::new();
        let mut metadata = None;
        let mut tensors = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!("the header names {key:?} twice"),
                ));
            }
            if key == "__metadata__" {
                metadata = Some(map.next_value_seed(Seed(StringMap { p: self.p }))?);
                continue;
            }
            if tensors.len() as u64 >= MAX_TENSORS {
                return Err(self.p.fail_error(too_many_tensors("the header")));
            }
            let raw = map.next_value::<&RawValue>()?;
            tensors.push((key, span_of(raw, self.doc)));
        }
        Ok((metadata.unwrap_or_default(), tensors))
    }
}

/// `__metadata__`: string keys to string values (or null: none).
struct StringMap<'a> {
    p: &'a Parse,
}

impl<'de> Expect<'de> for StringMap<'_> {
    type Value = Vec<(String, String)>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!("__metadata__ is {}, not a map of strings", found.kind()),
        )
    }
    fn on_null<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }
    fn on_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out: Vec<(String, String)> = Vec::new();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!("__metadata__ names {key:?} twice"),
                ));
            }
            let serde_json::Value::String(v) = map.next_value::<serde_json::Value>()? else {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!(
                        "__metadata__ {key:?} is not a string (the format allows only strings)"
                    ),
                ));
            };
            out.push((key, v));
        }
        Ok(out)
    }
}

/// One tensor entry: exactly `dtype`, `shape` and `data_offsets`, once each.
struct TensorSeed<'a> {
    p: &'a Parse,
}

type TensorValue = (Dtype, Vec<u64>, u64, u64);

impl<'de> Expect<'de> for TensorSeed<'_> {
    type Value = TensorValue;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!("the tensor entry is {}, not an object", found.kind()),
        )
    }
    fn on_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TensorValue, A::Error> {
        let p = self.p;
        let (mut dtype, mut shape, mut offsets) = (None, None, None);
        while let Some(key) = map.next_key::<String>()? {
            let twice = || {
                p.fail(
                    ErrorKind::BadJson,
                    format!("the tensor entry names {key:?} twice"),
                )
            };
            match key.as_str() {
                "dtype" => {
                    if dtype.is_some() {
                        return Err(twice());
                    }
                    let serde_json::Value::String(s) = map.next_value::<serde_json::Value>()?
                    else {
                        return Err(p.fail(ErrorKind::BadJson, "\"dtype\" is not a string"));
                    };
                    let d = Dtype::from_name(&s).ok_or_else(|| {
                        p.fail::<A::Error>(
                            ErrorKind::UnknownType,
                            format!(
                                "dtype {:?} is not a safetensors dtype",
                                crate::text::escape(&s)
                            ),
                        )
                    })?;
                    dtype = Some(d);
                }
                "shape" => {
                    if shape.is_some() {
                        return Err(twice());
                    }
                    shape = Some(map.next_value_seed(Seed(U64List {
                        p,
                        what: "shape",
                        max: MAX_RANK,
                    }))?);
                }
                "data_offsets" => {
                    if offsets.is_some() {
                        return Err(twice());
                    }
                    let v = map.next_value_seed(Seed(U64List {
                        p,
                        what: "data_offsets",
                        max: 2,
                    }))?;
                    let [b, e] = v[..] else {
                        return Err(p.fail(
                            ErrorKind::BadJson,
                            format!("\"data_offsets\" has {} numbers, not 2", v.len()),
                        ));
                    };
                    offsets = Some((b, e));
                }
                _ => {
                    return Err(p.fail(
                        ErrorKind::BadJson,
                        format!(
                            "the tensor entry has a field {:?}; safetensors has only dtype, shape \
                             and data_offsets",
                            crate::text::escape(&key)
                        ),
                    ));
                }
            }
        }
        let missing = |k: &str| {
            p.fail::<A::Error>(ErrorKind::BadJson, format!("the tensor entry has no {k:?}"))
        };
        let dtype = dtype.ok_or_else(|| missing("dtype"))?;
        let shape = shape.ok_or_else(|| missing("shape"))?;
        let (b, e) = offsets.ok_or_else(|| missing("data_offsets"))?;
        Ok((dtype, shape, b, e))
    }
}

/// A list of at most `max` non-negative integers.
struct U64List<'a> {
    p: &'a Parse,
    what: &'static str,
    max: usize,
}

impl<'de> Expect<'de> for U64List<'_> {
    type Value = Vec<u64>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!("{:?} is {}, not a list", self.what, found.kind()),
        )
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element::<serde_json::Value>()? {
            if out.len() >= self.max {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!("{:?} has more than {} numbers", self.what, self.max),
                ));
            }
            let Some(n) = v.as_u64() else {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!("{:?} holds {v}, not a non-negative integer", self.what),
                ));
            };
            out.push(n);
        }
        Ok(out)
    }
}
