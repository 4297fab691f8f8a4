//! Checksums inside rknot's own formats (docs/FORMAT.md section 12).
//!
//! CRC-32 (IEEE 802.3, zlib's `crc32`): every language's standard library
//! has it (Python `zlib.crc32`, Go `hash/crc32`, Java `CRC32`), so an
//! independent reader needs nothing extra, and crc32fast computes it with
//! carry-less multiplication at well over 10 GB/s here, far above what a
//! decoder consumes. It detects every burst of up to 32 bits and every
//! 1-, 2- and 3-bit error in blocks of these sizes; it is not a defence
//! against a deliberate forger (that is what manifests of SHA-256 digests
//! are for, `integrity::manifest`).
//!
//! - A file is *checked* when it carries a KSUM record: 8 bytes, a CRC-32
//!   (u32 LE) of the file's metadata bytes followed by `"KSUM"`, at the end
//!   of its data area (KNOT: the last 8 bytes of the file; .rknot v3: the
//!   last 8 bytes of the body, just before the block index). Readers that
//!   predate checksums ignore those bytes (no tensor covers them).
//! - In a checked file every tensor carries its own checksums: per group of
//!   blocks for .rknot tensors, per fixed-size chunk of stored bytes for
//!   tensors stored as ggml blocks and for SK32 sketches.

use serde::de::{self, MapAccess};

use crate::error::{ErrorKind, Result, err};
use crate::format::json::{Entries, Field, MaxLen, ObjectOf, Parse, Seed, U64Array, skip_value};
use crate::source::SourceFile;

/// The KSUM record's tag, its last 4 bytes.
pub const KSUM_TAG: &[u8; 4] = b"KSUM";
/// Bytes of the KSUM record: CRC-32 (u32 LE) then the tag.
pub const KSUM_LEN: u64 = 8;

/// Stored bytes per checksum for tensors kept as ggml blocks and for
/// sketches, as writers choose it: a read verifies whole chunks, so a
/// small one bounds what a read pays beyond its own bytes (at most two
/// chunks), and 16 KiB keeps the values to 0.025% of the data.
pub const WRITE_CHUNK: u64 = 16 << 10;
/// Largest chunk readers accept: a read holds one chunk in memory.
pub const MAX_CHUNK: u64 = 64 << 20;
/// What writers aim a .rknot block group at: about 8 KiB of blocks per
/// checksum (0.05% of the data; a read of one block reads its group).
pub const WRITE_GROUP_BYTES: u64 = 8 << 10;
/// Largest group readers accept, in stored bytes: a read holds one group.
pub const MAX_GROUP_BYTES: u64 = 16 << 20;

/// CRC-32 of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// The KSUM record for metadata whose CRC-32 is `crc`.
pub fn ksum_record(crc: u32) -> [u8; KSUM_LEN as usize] {
    let mut r = [0u8; KSUM_LEN as usize];
    r[..4].copy_from_slice(&crc.to_le_bytes());
    r[4..].copy_from_slice(KSUM_TAG);
    r
}

/// The CRC-32 a KSUM record at absolute `at` holds, if the 8 bytes there
/// are one (end with the tag).
pub fn read_ksum(src: &SourceFile, at: u64) -> Result<Option<u32>> {
    let mut r = [0u8; KSUM_LEN as usize];
    src.read_at(at, &mut r)?;
    if &r[4..] != KSUM_TAG {
        return Ok(None);
    }
    Ok(Some(u32::from_le_bytes([r[0], r[1], r[2], r[3]])))
}

/// CRC-32 of the concatenation of absolute byte ranges of `src`, read in
/// bounded pieces.
pub fn crc32_of_ranges(src: &SourceFile, ranges: &[(u64, u64)]) -> Result<u32> {
    const PIECE: u64 = 1 << 20;
    let mut h = crc32fast::Hasher::new();
    let mut buf = Vec::new();
    for &(start, len) in ranges {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(PIECE) as usize;
            buf.resize(n, 0);
            src.read_at(start + done, &mut buf)?;
            h.update(&buf);
            done += n as u64;
        }
    }
    Ok(h.finalize())
}

/// Check a KSUM record's CRC against the metadata it covers.
pub fn check_ksum(
    src: &SourceFile,
    stored: u32,
    covered: &[(u64, u64)],
    record_at: u64,
) -> Result<()> {
    let actual = crc32_of_ranges(src, covered)?;
    if actual != stored {
        let what: Vec<String> = covered
            .iter()
            .filter(|r| r.1 > 0)
            .map(|&(s, l)| format!("[{s}, {})", s + l))
            .collect();
        return Err(err(
            ErrorKind::Checksum,
            format!(
                "the file's metadata (bytes {}) has CRC-32 {actual:08x}; its KSUM record says \
                 {stored:08x}: the header or index is damaged",
                what.join(" + ")
            ),
        )
        .path(src.path())
        .at(record_at));
    }
    Ok(())
}

/// Per-chunk CRC-32s of a tensor's stored bytes (`"crc32": {"chunk": C,
/// "values": [...]}`): value `i` covers bytes `[i*C, min(len, i*C + C))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSums {
    pub chunk: u64,
    pub values: Box<[u32]>,
    /// The stored bytes the values cover.
    pub len: u64,
}

impl ChunkSums {
    /// Check the shape against a tensor of `length` stored bytes.
    pub fn validate(chunk: u64, values: Vec<u64>, length: u64) -> Result<ChunkSums> {
        if chunk == 0 || chunk > MAX_CHUNK {
            return Err(err(
                ErrorKind::BadValue,
                format!("crc32 chunk {chunk} must be in 1..={MAX_CHUNK}"),
            ));
        }
        let want = length.div_ceil(chunk);
        if values.len() as u64 != want {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "crc32 has {} values; {length} stored bytes in chunks of {chunk} need {want}",
                    values.len()
                ),
            ));
        }
        let values = values
            .into_iter()
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    err(
                        ErrorKind::BadValue,
                        format!("crc32 value {v} is above 2^32"),
                    )
                })
            })
            .collect::<Result<Box<[u32]>>>()?;
        Ok(ChunkSums {
            chunk,
            values,
            len: length,
        })
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"chunk": self.chunk, "values": self.values})
    }

    /// Read bytes `[offset, offset + buf.len())` of a tensor whose stored
    /// bytes start at absolute `base` of `src`, verifying every chunk the
    /// range touches (the whole chunks are read, with one pread). The
    /// caller has checked the range against the tensor's length, which the
    /// sums cover.
    pub fn read_verified(
        &self,
        src: &SourceFile,
        base: u64,
        offset: u64,
        buf: &mut [u8],
        tensor: &str,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset + buf.len() as u64;
        let lo = offset / self.chunk * self.chunk;
        // The last chunk may be short: the tensor's end bounds the read.
        let hi = (end.div_ceil(self.chunk) * self.chunk).min(self.len);
        if lo == offset && hi == end {
            // Whole chunks: straight into the caller's buffer.
            src.read_at(base + lo, buf).map_err(|e| e.tensor(tensor))?;
            return self.verify_span(src, base, lo, buf, tensor);
        }
        self.with_verified(src, base, offset, buf.len() as u64, tensor, |bytes| {
            buf.copy_from_slice(bytes);
            Ok(())
        })
    }

    /// Call `f` with the verified stored bytes `[offset, offset + len)`
    /// (`len > 0`, inside the tensor), read as whole chunks with one pread
    /// into a buffer the thread keeps: a decoder reads them where they are,
    /// without a copy. `f` must not read through checksums itself.
    pub fn with_verified<R>(
        &self,
        src: &SourceFile,
        base: u64,
        offset: u64,
        len: u64,
        tensor: &str,
        f: impl FnOnce(&[u8]) -> Result<R>,
    ) -> Result<R> {
        let end = offset + len;
        let lo = offset / self.chunk * self.chunk;
        let hi = (end.div_ceil(self.chunk) * self.chunk).min(self.len);
        SPAN.with(|cell| {
            let mut span = cell.borrow_mut();
            span.resize((hi - lo) as usize, 0);
            src.read_at(base + lo, &mut span)
                .map_err(|e| e.tensor(tensor))?;
            self.verify_span(src, base, lo, &span, tensor)?;
            let r = f(&span[(offset - lo) as usize..(end - lo) as usize]);
            // A huge read must not pin its buffer in the thread for good.
            if span.capacity() > SPAN_KEEP {
                *span = Vec::new();
            }
            r
        })
    }

    /// Check the chunks of `bytes`, the stored bytes from `lo` (a chunk
    /// boundary) on.
    fn verify_span(
        &self,
        src: &SourceFile,
        base: u64,
        lo: u64,
        bytes: &[u8],
        tensor: &str,
    ) -> Result<()> {
        for (k, piece) in bytes.chunks(self.chunk as usize).enumerate() {
            let at = lo + k as u64 * self.chunk;
            let ci = at / self.chunk;
            let stored = self.values.get(ci as usize).copied().unwrap_or(0);
            let actual = crc32(piece);
            if actual != stored {
                return Err(chunk_mismatch(
                    src,
                    tensor,
                    ci,
                    base + at,
                    piece.len() as u64,
                    stored,
                    actual,
                ));
            }
        }
        Ok(())
    }
}

/// Largest span buffer a thread keeps between reads.
const SPAN_KEEP: usize = 8 << 20;

thread_local! {
    /// The chunk-aligned span a read that is not itself chunk-aligned is
    /// read into (one per thread, reused: a fresh large buffer per read
    /// would be an mmap and page faults each time).
    static SPAN: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn chunk_mismatch(
    src: &SourceFile,
    tensor: &str,
    chunk: u64,
    at: u64,
    n: u64,
    stored: u32,
    actual: u32,
) -> crate::Error {
    err(
        ErrorKind::Checksum,
        format!(
            "chunk {chunk} ({n} bytes) has CRC-32 {actual:08x}, the file records {stored:08x}: \
             the stored bytes are damaged"
        ),
    )
    .tensor(tensor)
    .path(src.path())
    .at(at)
}

/// Computes [`ChunkSums`] over bytes fed in any pieces.
pub struct ChunkHasher {
    chunk: u64,
    in_chunk: u64,
    total: u64,
    h: crc32fast::Hasher,
    values: Vec<u32>,
}

impl ChunkHasher {
    pub fn new(chunk: u64) -> ChunkHasher {
        ChunkHasher {
            chunk: chunk.max(1),
            in_chunk: 0,
            total: 0,
            h: crc32fast::Hasher::new(),
            values: Vec::new(),
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let take = ((self.chunk - self.in_chunk) as usize).min(data.len());
            self.h.update(&data[..take]);
            self.in_chunk += take as u64;
            self.total += take as u64;
            data = &data[take..];
            if self.in_chunk == self.chunk {
                let h = std::mem::replace(&mut self.h, crc32fast::Hasher::new());
                self.values.push(h.finalize());
                self.in_chunk = 0;
            }
        }
    }

    pub fn finish(mut self) -> ChunkSums {
        if self.in_chunk > 0 {
            self.values.push(self.h.finalize());
        }
        ChunkSums {
            chunk: self.chunk,
            values: self.values.into_boxed_slice(),
            len: self.total,
        }
    }
}

impl std::io::Write for ChunkHasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A .rknot tensor's block-group CRC-32s (`"block_crc32": {"at": A,
/// "group": G}`): value `g` covers blocks `[g*G, min(n, g*G + G))`, whose
/// bytes are contiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSums {
    pub group: u64,
    pub values: Box<[u32]>,
}

impl GroupSums {
    /// Decode `ceil(n / group)` little-endian u32s.
    pub fn from_index(group: u64, bytes: &[u8]) -> GroupSums {
        GroupSums {
            group,
            values: bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }
    }

    /// Index bytes the values of `n` blocks take with groups of `group`.
    pub fn index_len(n: u64, group: u64) -> Result<u64> {
        if group == 0 {
            return Err(err(
                ErrorKind::BadValue,
                "block_crc32 group 0: must be at least 1",
            ));
        }
        crate::error::mul(n.div_ceil(group), 4, "block_crc32 size")
    }

    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Verify group `g`'s bytes.
    pub fn check(&self, g: u64, bytes: &[u8]) -> std::result::Result<(), (u32, u32)> {
        let stored = self.values.get(g as usize).copied().unwrap_or(0);
        let actual = crc32(bytes);
        if actual == stored {
            Ok(())
        } else {
            Err((stored, actual))
        }
    }
}

/// Groups blocks for [`GroupSums`] as a writer produces them: each block's
/// CRC is kept (with its length) until the tensor ends and the group size
/// is known, then combined.
#[derive(Default)]
pub struct GroupHasher {
    blocks: Vec<crc32fast::Hasher>,
    max_len: u64,
}

impl GroupHasher {
    pub fn block(&mut self, bytes: &[u8]) {
        let mut h = crc32fast::Hasher::new();
        h.update(bytes);
        self.blocks.push(h);
        self.max_len = self.max_len.max(bytes.len() as u64);
    }

    /// Blocks per group: as many of the longest block as fit in
    /// [`WRITE_GROUP_BYTES`], at least one.
    pub fn finish(self) -> GroupSums {
        let group = (WRITE_GROUP_BYTES / self.max_len.max(1)).max(1);
        let values = self
            .blocks
            .chunks(group as usize)
            .map(|c| {
                let mut h = crc32fast::Hasher::new();
                for b in c {
                    h.combine(b);
                }
                h.finalize()
            })
            .collect();
        GroupSums { group, values }
    }
}

/// Most values a `crc32` list may hold while it is parsed (before its
/// length is checked against the tensor's): 2^24 chunks of 64 KiB are a
/// terabyte.
const MAX_CHUNK_VALUES: usize = 1 << 24;

/// A `crc32` field as written: `{"chunk": C, "values": [...]}`.
pub fn read_chunk_sums<'de, A: MapAccess<'de>>(
    f: Field<'_>,
    map: &mut A,
) -> Result<(u64, Vec<u64>), A::Error> {
    map.next_value_seed(Seed(ObjectOf {
        p: f.p,
        ctx: "field \"crc32\"",
        state: ChunkFields {
            p: f.p,
            chunk: None,
            values: None,
        },
    }))
}

struct ChunkFields<'a> {
    p: &'a Parse,
    chunk: Option<u64>,
    values: Option<Vec<u64>>,
}

impl<'de> Entries<'de> for ChunkFields<'_> {
    type Value = (u64, Vec<u64>);
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let f = Field::new(self.p, "crc32", &key);
        match key.as_str() {
            "chunk" => self.chunk = Some(f.read_u64(map)?),
            "values" => {
                self.values = Some(map.next_value_seed(Seed(U64Array {
                    f,
                    max: Some(MaxLen {
                        len: MAX_CHUNK_VALUES,
                        kind: ErrorKind::TooLarge,
                        message: "crc32 holds more than 2^24 values",
                    }),
                    increasing: None,
                }))?)
            }
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<(u64, Vec<u64>), E> {
        match (self.chunk, self.values) {
            (Some(c), Some(v)) => Ok((c, v)),
            (None, _) => Err(self
                .p
                .fail(ErrorKind::BadJson, "crc32: missing field \"chunk\"")),
            (_, None) => Err(self
                .p
                .fail(ErrorKind::BadJson, "crc32: missing field \"values\"")),
        }
    }
}

/// A `block_crc32` field as written: `{"at": A, "group": G}`.
pub fn read_group_field<'de, A: MapAccess<'de>>(
    f: Field<'_>,
    map: &mut A,
) -> Result<(u64, u64), A::Error> {
    map.next_value_seed(Seed(ObjectOf {
        p: f.p,
        ctx: "tensor: field \"block_crc32\"",
        state: GroupFields {
            p: f.p,
            at: None,
            group: None,
        },
    }))
}

struct GroupFields<'a> {
    p: &'a Parse,
    at: Option<u64>,
    group: Option<u64>,
}

impl<'de> Entries<'de> for GroupFields<'_> {
    type Value = (u64, u64);
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        let f = Field::new(self.p, "block_crc32", &key);
        match key.as_str() {
            "at" => self.at = Some(f.read_u64(map)?),
            "group" => self.group = Some(f.read_u64(map)?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<(u64, u64), E> {
        match (self.at, self.group) {
            (Some(a), Some(g)) => Ok((a, g)),
            (None, _) => Err(self
                .p
                .fail(ErrorKind::BadJson, "block_crc32: missing field \"at\"")),
            (_, None) => Err(self
                .p
                .fail(ErrorKind::BadJson, "block_crc32: missing field \"group\"")),
        }
    }
}

/// A checksum field as parsed: required in a `checked` file (one with a
/// KSUM record), refused in another (a writer writes both or neither).
pub fn present_if_checked<T>(raw: Option<T>, checked: bool, what: &str) -> Result<Option<T>> {
    match (raw, checked) {
        (Some(v), true) => Ok(Some(v)),
        (None, false) => Ok(None),
        (_, has) => Err(inconsistent(has, what)),
    }
}

/// An entry's `crc32` as parsed, checked for presence and against its
/// `length`.
pub fn entry_sums(
    raw: Option<(u64, Vec<u64>)>,
    checked: bool,
    length: u64,
    what: &str,
) -> Result<Option<ChunkSums>> {
    present_if_checked(raw, checked, what)?
        .map(|(chunk, values)| ChunkSums::validate(chunk, values, length))
        .transpose()
}

/// The error for a checksum field in a file without a KSUM record, or a
/// checked file's tensor without one: either way the file is damaged (a
/// writer writes both or neither).
fn inconsistent(has_record: bool, what: &str) -> crate::Error {
    if has_record {
        err(
            ErrorKind::Checksum,
            format!("the file has a KSUM record but {what} has no checksum field: damaged"),
        )
    } else {
        err(
            ErrorKind::Checksum,
            format!(
                "{what} has a checksum field but the file has no KSUM record (its end is \
                 damaged or cut)"
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_zlibs() {
        // zlib.crc32(b"123456789") == 0xCBF43926, the standard check value.
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn chunk_hasher_matches_whole_chunks_in_any_pieces() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut one = ChunkHasher::new(64);
        one.update(&data);
        let whole = one.finish();
        assert_eq!(whole.values.len(), 16);
        assert_eq!(whole.values[15], crc32(&data[960..]));
        let mut h = ChunkHasher::new(64);
        for piece in data.chunks(37) {
            h.update(piece);
        }
        assert_eq!(h.finish(), whole);
    }

    #[test]
    fn group_hasher_combines_blocks_in_order() {
        let blocks: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 1000 + i as usize]).collect();
        let mut g = GroupHasher::default();
        for b in &blocks {
            g.block(b);
        }
        let sums = g.finish();
        assert_eq!(sums.group, 8192 / 1009);
        let per = sums.group as usize;
        for (gi, c) in blocks.chunks(per).enumerate() {
            assert_eq!(sums.check(gi as u64, &c.concat()), Ok(()));
        }
        // Two blocks swapped inside a group change its CRC.
        let mut swapped = blocks[..per].to_vec();
        swapped.swap(0, 1);
        assert!(sums.check(0, &swapped.concat()).is_err());
    }

    #[test]
    fn validate_refuses_bad_shapes() {
        assert!(ChunkSums::validate(0, vec![], 0).is_err());
        assert!(ChunkSums::validate(10, vec![1, 2], 21).is_err());
        assert!(ChunkSums::validate(10, vec![1, 2, 1 << 32], 21).is_err());
        assert!(ChunkSums::validate(10, vec![1, 2, 3], 21).is_ok());
    }
}
