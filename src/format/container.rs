//! The `KNOT` container shared by SK32 sketches and dense .knot files.
//!
//! ```text
//! "KNOT" | u16 LE version (1) | u32 LE meta_len | meta_json
//!        | zero pad to a 4-byte boundary | codec byte (0 = raw) | payload
//! payload_base = ((10 + meta_len + 3) & !3) + 1
//! ```
//! Every offset in the meta JSON is relative to `payload_base`.

use std::io::Write;
use std::ops::Range;

use serde::de::{self, MapAccess};
use serde_json::Value;

use crate::error::{Error, ErrorKind, Result, add, err};
use crate::format::checksum;
use crate::format::json::{
    Entries, Field, ObjectOf, OptStr, Parse, Seed, is_object, skip_value, span_of,
};
use crate::format::{MAX_TENSORS, too_many_tensors};
use crate::source::SourceFile;

pub const KNOT_MAGIC: &[u8; 4] = b"KNOT";
pub const KNOT_VERSION: u16 = 1;
/// Bytes before the meta JSON: magic, version, meta_len.
pub const KNOT_PREFIX_LEN: u64 = 10;

/// [`crate::format::Detect`] for the KNOT container (SK32 and dense .knot).
pub fn is_knot(_src: &SourceFile, head: &[u8]) -> Result<bool> {
    Ok(head.starts_with(KNOT_MAGIC))
}

/// Codec byte value for a raw (uncompressed) payload.
pub const CODEC_RAW: u8 = 0;
/// Largest meta JSON we read (it is read into memory whole). A dense .knot
/// carries the model's metadata (SmolLM2's meta JSON is 1.2 MB, smaller
/// than its 1.8 MB GGUF header; a 256k-token vocabulary with merges takes
/// ~10 MB) and one small entry per tensor (at most
/// [`crate::format::MAX_TENSORS`], ~100 bytes each); an SK32's is a few
/// hundred bytes per sketch. 64 MiB is several times the largest real one
/// and bounds what a hostile header can make a reader do (the parsers keep
/// peak memory within ~4x the header).
pub const MAX_META_LEN: u64 = 64 << 20;

/// Parsed container header: the meta JSON's bytes and where its members
/// are (each parsed by the reader that needs it).
#[derive(Debug, Clone)]
pub struct KnotContainer {
    pub version: u16,
    pub meta_len: u64,
    /// The meta JSON (valid UTF-8 JSON whose root is an object).
    pub meta_json: Vec<u8>,
    pub meta: KnotMeta,
    /// Absolute file offset that every payload offset is relative to.
    pub payload_base: u64,
    /// The KSUM record's CRC-32 (already checked against the header bytes)
    /// when the file is checked: then every entry must carry `crc32`.
    pub ksum: Option<u32>,
    /// Where the payload ends: the file's end, or the KSUM record's start.
    pub data_end: u64,
}

/// One member of the meta object: where its value lies in `meta_json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub span: Range<usize>,
    pub is_object: bool,
}

/// The root of the meta JSON: the scalars, and where the tables are.
#[derive(Debug, Clone, Default)]
pub struct KnotMeta {
    /// `format` when it is a string.
    pub format: Option<String>,
    /// `topology` when it is a string.
    pub topology: Option<String>,
    pub sketches: Option<Member>,
    pub tensors: Option<Member>,
    pub metadata: Option<Member>,
}

impl KnotContainer {
    /// A `sketches` object is present (an SK32).
    pub fn has_sketches(&self) -> bool {
        self.meta.sketches.as_ref().is_some_and(|m| m.is_object)
    }

    /// A `tensors` object is present (a dense .knot).
    pub fn has_tensors(&self) -> bool {
        self.meta.tensors.as_ref().is_some_and(|m| m.is_object)
    }

    /// A member's JSON and its absolute file offset.
    pub fn member(&self, m: &Member) -> (&[u8], u64) {
        let json = self.meta_json.get(m.span.clone()).unwrap_or_default();
        (json, KNOT_PREFIX_LEN + m.span.start as u64)
    }
}

/// Entries of the meta object's root.
struct RootEntries<'j> {
    doc: &'j [u8],
    meta: KnotMeta,
}

impl<'de: 'j, 'j> Entries<'de> for RootEntries<'j> {
    type Value = KnotMeta;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let member = |raw: &serde_json::value::RawValue| Member {
            span: span_of(raw, self.doc),
            is_object: is_object(raw),
        };
        match key.as_str() {
            "format" => self.meta.format = map.next_value_seed(Seed(OptStr))?,
            "topology" => self.meta.topology = map.next_value_seed(Seed(OptStr))?,
            "sketches" => self.meta.sketches = Some(member(map.next_value()?)),
            "tensors" => self.meta.tensors = Some(member(map.next_value()?)),
            "metadata" => self.meta.metadata = Some(member(map.next_value()?)),
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<KnotMeta, E> {
        Ok(self.meta)
    }
}

/// Check that a header is UTF-8 before parsing it: serde_json skips the
/// strings of ignored values without looking at their bytes.
pub fn check_utf8(json: &[u8], base: u64, what: &str) -> Result<()> {
    std::str::from_utf8(json).map(|_| ()).map_err(|e| {
        err(
            ErrorKind::BadJson,
            format!(
                "{what} is not valid JSON: invalid UTF-8 at byte {}",
                e.valid_up_to()
            ),
        )
        .at(base + e.valid_up_to() as u64)
    })
}

/// Parse the root of a meta JSON document (`what` names it in errors).
pub fn parse_meta_root(json: &[u8], base: u64, what: &str) -> Result<KnotMeta> {
    check_utf8(json, base, what)?;
    let p = Parse::default();
    p.run(
        Seed(ObjectOf {
            p: &p,
            ctx: what,
            state: RootEntries {
                doc: json,
                meta: KnotMeta::default(),
            },
        }),
        json,
        base,
        what,
    )
}

/// An entry of a `name -> object` table of the meta JSON (`sketches` of an
/// SK32, `tensors` of a dense .knot), as written, before validation:
/// [`read_table`] fills it field by field.
pub trait TableEntry: Default {
    /// Read the value of field `f.key` (the next value of `map`) into
    /// `self`, or skip it.
    fn read_field<'de, A: MapAccess<'de>>(
        &mut self,
        f: Field<'_>,
        map: &mut A,
    ) -> Result<(), A::Error>;
}

/// The fields of one table entry.
struct EntryFields<'a, T> {
    p: &'a Parse,
    ctx: &'a str,
    entry: T,
}

impl<'de, T: TableEntry> Entries<'de> for EntryFields<'_, T> {
    type Value = T;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        self.entry
            .read_field(Field::new(self.p, self.ctx, &key), map)
    }
    fn done<E: de::Error>(self) -> Result<T, E> {
        Ok(self.entry)
    }
}

/// A table: name -> entry, in file order.
struct Table<'a, T> {
    p: &'a Parse,
    /// The table's member name (`tensors`).
    key: &'a str,
    /// What an entry is (`tensor`), for `tensor "name"` in messages.
    noun: &'a str,
    out: Vec<(String, T)>,
}

impl<'de, T: TableEntry> Entries<'de> for Table<'_, T> {
    type Value = Vec<(String, T)>;
    fn entry<A: MapAccess<'de>>(&mut self, name: String, map: &mut A) -> Result<(), A::Error> {
        let p = self.p;
        if self.out.len() as u64 >= MAX_TENSORS {
            let e = too_many_tensors(&format!("\"{}\"", self.key));
            return Err(p.fail(e.kind(), e.message()));
        }
        let ctx = format!("{} {name:?}", self.noun);
        let entry = map
            .next_value_seed(Seed(ObjectOf {
                p,
                ctx: &ctx,
                state: EntryFields {
                    p,
                    ctx: &ctx,
                    entry: T::default(),
                },
            }))
            .inspect_err(|_| p.blame(&name))?;
        self.out.push((name, entry));
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.out)
    }
}

/// Parse the table `key` of the meta JSON (`member`: where the root has
/// it): its entries in file order, at most [`MAX_TENSORS`]. An error
/// inside an entry names it (`noun "name"`, and as the tensor) and its byte
/// offset.
pub fn read_table<T: TableEntry>(
    c: &KnotContainer,
    member: Option<&Member>,
    key: &str,
    noun: &str,
) -> Result<Vec<(String, T)>> {
    let member = member.ok_or_else(|| {
        err(
            ErrorKind::BadJson,
            format!("meta_json: missing field \"{key}\""),
        )
        .at(KNOT_PREFIX_LEN)
    })?;
    let (json, base) = c.member(member);
    parse_table(json, base, key, noun, "meta_json")
}

/// A `name -> object` table in `json` (absolute file offset `base`) of
/// document `doc`: [`read_table`]'s parser, also used for a .rknot's
/// `dense_tensors`.
pub fn parse_table<T: TableEntry>(
    json: &[u8],
    base: u64,
    key: &str,
    noun: &str,
    doc: &str,
) -> Result<Vec<(String, T)>> {
    let p = Parse::default();
    p.run(
        Seed(ObjectOf {
            p: &p,
            ctx: &format!("{doc}: field \"{key}\""),
            state: Table {
                p: &p,
                key,
                noun,
                out: Vec::new(),
            },
        }),
        json,
        base,
        doc,
    )
}

/// Offset of the codec byte for a given meta length.
pub fn codec_offset(meta_len: u64) -> Option<u64> {
    Some(KNOT_PREFIX_LEN.checked_add(meta_len)?.checked_add(3)? & !3)
}

/// Read and check the container header (not the payload).
pub fn read_container(src: &SourceFile) -> Result<KnotContainer> {
    let path = src.path();
    if src.len() < KNOT_PREFIX_LEN {
        return Err(err(
            ErrorKind::Truncated,
            format!(
                "KNOT container needs a {KNOT_PREFIX_LEN}-byte prefix, file has {} bytes",
                src.len()
            ),
        )
        .path(path));
    }
    let mut prefix = [0u8; 10];
    src.read_at(0, &mut prefix)?;
    if &prefix[0..4] != KNOT_MAGIC {
        return Err(crate::format::bad_magic(path, &prefix[..6]));
    }
    let version = u16::from_le_bytes([prefix[4], prefix[5]]);
    if version != KNOT_VERSION {
        return Err(err(
            ErrorKind::UnsupportedVersion,
            format!("KNOT container version {version} is not supported (only {KNOT_VERSION})"),
        )
        .path(path)
        .at(4));
    }
    let meta_len = u64::from(u32::from_le_bytes([
        prefix[6], prefix[7], prefix[8], prefix[9],
    ]));
    if meta_len > MAX_META_LEN {
        return Err(err(
            ErrorKind::TooLarge,
            format!("meta_len {meta_len} exceeds the {MAX_META_LEN}-byte cap"),
        )
        .path(path)
        .at(6));
    }
    let meta_end = KNOT_PREFIX_LEN + meta_len;
    if meta_end > src.len() {
        return Err(err(
            ErrorKind::Truncated,
            format!(
                "meta_len {meta_len} runs past the end of the file ({} bytes)",
                src.len()
            ),
        )
        .path(path)
        .at(6));
    }
    // meta_len <= MAX_META_LEN, so none of this overflows.
    let payload_base = ((meta_end + 3) & !3) + 1;
    // A checked file ends in a KSUM record over everything before the
    // payload: checked before the meta is parsed, so a damaged header is
    // reported as damaged rather than as whatever the damage parses to.
    let mut data_end = src.len();
    let mut ksum = None;
    if src.len() >= payload_base + checksum::KSUM_LEN {
        let at = src.len() - checksum::KSUM_LEN;
        if let Some(crc) = checksum::read_ksum(src, at)? {
            checksum::check_ksum(src, crc, &[(0, payload_base)], at)?;
            ksum = Some(crc);
            data_end = at;
        }
    }
    let meta_json = src.read_vec(KNOT_PREFIX_LEN, meta_len, "meta_json")?;
    let meta =
        parse_meta_root(&meta_json, KNOT_PREFIX_LEN, "meta_json").map_err(|e| e.path(path))?;
    // meta_len <= MAX_META_LEN, so none of this overflows.
    let codec_at = (meta_end + 3) & !3;
    if codec_at >= src.len() {
        return Err(err(
            ErrorKind::Truncated,
            format!(
                "file ends before the codec byte at {codec_at} ({} bytes)",
                src.len()
            ),
        )
        .path(path)
        .at(codec_at));
    }
    let mut codec = [0u8; 1];
    src.read_at(codec_at, &mut codec)?;
    if codec[0] != CODEC_RAW {
        return Err(err(
            ErrorKind::UnsupportedCodec,
            format!(
                "unsupported codec byte {} (only 0 = raw payload is defined)",
                codec[0]
            ),
        )
        .path(path)
        .at(codec_at));
    }
    Ok(KnotContainer {
        version,
        meta_len,
        meta_json,
        meta,
        payload_base: codec_at + 1,
        ksum,
        data_end,
    })
}

impl KnotContainer {
    /// Payload range `[payload_base + offset, ... + length)` as an absolute
    /// offset, checked against the file and, in a checked file, kept off
    /// the KSUM record.
    pub fn payload_range(
        &self,
        src: &SourceFile,
        offset: u64,
        length: u64,
        what: &str,
    ) -> Result<u64> {
        let abs = payload_range(src, self.payload_base, offset, length, what)?;
        if abs + length > self.data_end {
            return Err(err(
                ErrorKind::OutOfBounds,
                format!(
                    "{what} [{abs}, {}) runs into the KSUM record at {}",
                    abs + length,
                    self.data_end
                ),
            )
            .path(src.path())
            .at(abs));
        }
        Ok(abs)
    }
}

/// Payload range `[base + offset, base + offset + length)` as absolute
/// offsets, checked against the file.
pub fn payload_range(
    src: &SourceFile,
    payload_base: u64,
    offset: u64,
    length: u64,
    what: &str,
) -> Result<u64> {
    let abs = add(payload_base, offset, what).map_err(|e| e.path(src.path()))?;
    src.check_range(abs, length, what)?;
    Ok(abs)
}

/// Write a container: header, pad, raw codec byte; the caller writes the
/// payload after it. Returns the number of header bytes written
/// (= payload_base).
pub fn write_container_header<W: Write>(w: &mut W, meta: &Value) -> Result<u64> {
    write_container_header_crc(w, meta).map(|(base, _)| base)
}

/// [`write_container_header`], also returning the CRC-32 of the header
/// bytes written (what a KSUM record after the payload holds).
pub fn write_container_header_crc<W: Write>(w: &mut W, meta: &Value) -> Result<(u64, u32)> {
    let json = serde_json::to_vec(meta)
        .map_err(|e| err(ErrorKind::BadJson, format!("cannot serialize meta: {e}")))?;
    let meta_len = u32::try_from(json.len())
        .ok()
        .filter(|&n| u64::from(n) <= MAX_META_LEN)
        .ok_or_else(|| {
            err(
                ErrorKind::TooLarge,
                format!("meta JSON of {} bytes is too large", json.len()),
            )
        })?;
    let codec_at = codec_offset(u64::from(meta_len)).unwrap_or(u64::MAX);
    let pad = (codec_at - KNOT_PREFIX_LEN - u64::from(meta_len)) as usize;
    let mut head = Vec::with_capacity(json.len() + 14);
    head.extend_from_slice(KNOT_MAGIC);
    head.extend_from_slice(&KNOT_VERSION.to_le_bytes());
    head.extend_from_slice(&meta_len.to_le_bytes());
    head.extend_from_slice(&json);
    head.extend_from_slice(&[0u8; 3][..pad]);
    head.push(CODEC_RAW);
    w.write_all(&head)
        .map_err(|e| Error::new(ErrorKind::Io, format!("write: {e}")))?;
    Ok((codec_at + 1, checksum::crc32(&head)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    fn container_bytes(meta: &str, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(b"KNOT");
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        v.extend_from_slice(meta.as_bytes());
        while v.len() % 4 != 0 {
            v.push(0);
        }
        v.push(0);
        v.extend_from_slice(payload);
        v
    }

    /// Seed 001 Module 1: payload_base follows the production loader at an
    /// unaligned and an aligned meta_len.
    #[test]
    fn payload_base_matches_production_rule() {
        // meta_len 17 (unaligned): (10 + 17 + 3) & !3 = 28, base 29.
        let meta17 = r#"{"tensors":{}}   "#;
        assert_eq!(meta17.len(), 17);
        // meta_len 20 (10 + 20 = 30 -> 32), base 33.
        let meta20 = r#"{"tensors":{}}      "#;
        assert_eq!(meta20.len(), 20);
        // meta_len 22: 10 + 22 = 32 is aligned already, base 33.
        let meta22 = r#"{"tensors":{}}        "#;
        for (meta, base) in [(meta17, 29u64), (meta20, 33), (meta22, 33)] {
            let f = file_with(&container_bytes(meta, b"PAYLOAD"));
            let src = SourceFile::open(f.path()).unwrap();
            let c = read_container(&src).unwrap();
            assert_eq!(c.payload_base, base, "meta_len {}", meta.len());
            let mut b = [0u8; 7];
            src.read_at(c.payload_base, &mut b).unwrap();
            assert_eq!(&b, b"PAYLOAD");
        }
    }

    #[test]
    fn writer_and_reader_agree() {
        for pad in 0..6 {
            let meta = serde_json::json!({"tensors": {}, "pad": "x".repeat(pad)});
            let mut v = Vec::new();
            let base = write_container_header(&mut v, &meta).unwrap();
            assert_eq!(base as usize, v.len());
            v.extend_from_slice(b"P");
            let f = file_with(&v);
            let c = read_container(&SourceFile::open(f.path()).unwrap()).unwrap();
            assert_eq!(c.payload_base, base);
        }
    }

    #[test]
    fn malformed_headers() {
        let cases: Vec<(Vec<u8>, ErrorKind)> = vec![
            (b"KNO".to_vec(), ErrorKind::Truncated),
            (
                b"KNOT\x01\x00\xff\xff\xff\x00{}".to_vec(),
                ErrorKind::Truncated,
            ),
            (
                b"KNOT\x02\x00\x02\x00\x00\x00{}\x00\x00\x00".to_vec(),
                ErrorKind::UnsupportedVersion,
            ),
            (
                container_bytes("{}", b"")[..12].to_vec(),
                ErrorKind::Truncated,
            ),
            (container_bytes("[1]", b"x"), ErrorKind::BadJson),
            (container_bytes("{nope", b"x"), ErrorKind::BadJson),
            (
                {
                    let mut v = container_bytes("{}", b"x");
                    let at = v.len() - 2;
                    v[at] = 7;
                    v
                },
                ErrorKind::UnsupportedCodec,
            ),
        ];
        for (bytes, kind) in cases {
            let f = file_with(&bytes);
            let e = read_container(&SourceFile::open(f.path()).unwrap()).unwrap_err();
            assert_eq!(e.kind(), kind, "{e}");
            assert!(
                e.to_string().contains(&f.path().display().to_string()),
                "{e}"
            );
        }
    }
}
