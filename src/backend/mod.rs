//! Backends: one trait for "a set of named tensors whose element ranges I
//! can decode", one implementation per file kind, and the layered backend
//! (primary SK32/.rknot + dense fallback).
//!
//! A backend is opened once (all headers validated) and then only decodes:
//! `read_f32(index, first_elem, out)` touches only the ggml blocks, sketch
//! rows or .rknot tiles that overlap `[first_elem, first_elem + out.len())`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{ErrorKind, Result, err};
use crate::format::FileFormat;
use crate::format::meta::Metadata;
use crate::names::{NameIndex, TensorName};
use crate::quant::GgmlType;
use crate::source::SourceFile;

mod dense;
mod layered;
mod open;
mod rknot;
mod safetensors;
mod scratch;
mod sketch;

pub use dense::DenseBackend;
pub use layered::LayeredBackend;
pub(crate) use layered::is_lossy_vocab;
pub use open::{ParsedFile, READERS, Reader, assemble, open, open_parts, open_single, reader_of};
pub use rknot::RknotBackend;
pub use safetensors::{HfAlias, hf_alias, hf_aliases};
pub use sketch::SketchBackend;

/// How a tensor is stored in its source file.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredType {
    /// ggml blocks (GGUF, dense .knot).
    Ggml(GgmlType),
    /// SK32 rank-r sketch.
    Sketch { rank: u64 },
    /// .rknot blocks: `bits` is the uniform width or the graded maximum.
    Rknot { graded: bool, bits: u8 },
    /// .rknot lossless blocks: every value exactly the source's `float`
    /// word (not lossy: served wherever ggml blocks would be).
    RknotLossless(crate::format::rknot::LosslessFloat),
}

impl fmt::Display for StoredType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoredType::Ggml(t) => write!(f, "{t}"),
            StoredType::Sketch { rank } => write!(f, "SK32 r{rank}"),
            StoredType::Rknot {
                graded: false,
                bits,
            } => write!(f, "RKNOT u{bits}"),
            StoredType::Rknot { graded: true, bits } => write!(f, "RKNOT g{bits}"),
            StoredType::RknotLossless(float) => write!(f, "RKNOT lossless {}", float.name()),
        }
    }
}

/// How a tensor's stored blocks are coded, for a view that re-packs them
/// into ggml blocks without decoding (`fs::views::transcode`). Only codes
/// whose every block is laid out alike are described.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockCode {
    /// .rknot affine blocks of one row each (docs/FORMAT.md section 6.3):
    /// block `b` holds elements `[b * group, (b + 1) * group)` of the
    /// tensor (row-major; `group` divides the row), as an f16 scale, an
    /// f16 offset and `group` codes of `bits` bits, LSB-first; every block
    /// is `4 + group * bits / 8` bytes and they lie back to back, so block
    /// `b` is bytes `[b * len, (b + 1) * len)` of the tensor's stored
    /// blocks ([`Backend::read_stored_blocks`]). Value: `code * scale +
    /// offset` in f32, two roundings. No restricted axis: every value is
    /// a block's.
    AffineRows { bits: u8, group: u64 },
}

impl BlockCode {
    /// Bytes of one stored block.
    pub fn block_bytes(self) -> u64 {
        match self {
            BlockCode::AffineRows { bits, group } => 4 + (group * u64::from(bits)).div_ceil(8),
        }
    }
}

/// Which side of a layered backend serves a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    Fallback,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Fallback => "fallback",
        }
    }
}

/// Where a tensor's bytes come from.
#[derive(Debug, Clone, PartialEq)]
pub struct Origin {
    pub role: Role,
    pub format: FileFormat,
    pub path: Arc<PathBuf>,
}

/// Whether a listed tensor can be read.
#[derive(Debug, Clone, PartialEq)]
pub enum Availability {
    Available,
    Unavailable(String),
}

/// Everything a caller needs to know about one tensor.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: TensorName,
    /// Served shape, outer-first; the served bytes are row-major f32 LE.
    pub shape: Vec<u64>,
    pub n_elements: u64,
    pub stored: StoredType,
    pub stored_bytes: u64,
    pub origin: Origin,
    pub availability: Availability,
    /// Elements per natural decode unit (a row band for sketches and
    /// .rknot, a ggml block): reads aligned to it decode nothing extra.
    pub granule: u64,
}

impl TensorInfo {
    /// Decoded size in bytes.
    pub fn served_bytes(&self) -> u64 {
        self.n_elements * 4
    }

    /// The tensor's own stored bytes per element, x 8: its payload, without
    /// the file's headers and indexes (the honest figure is per file:
    /// `report`'s totals).
    pub fn payload_bits_per_weight(&self) -> f64 {
        self.stored_bytes as f64 * 8.0 / self.n_elements as f64
    }

    pub fn is_available(&self) -> bool {
        self.availability == Availability::Available
    }
}

/// The tensors of a backend with name lookup in every spelling.
#[derive(Debug, Clone, Default)]
pub struct TensorTable {
    entries: Vec<TensorInfo>,
    names: NameIndex,
}

impl TensorTable {
    /// Add an entry; a name collision (after aliasing) or a served size
    /// that does not fit in u64 bytes is an error.
    pub fn push(&mut self, info: TensorInfo, stored_name: &str) -> Result<usize> {
        if info.n_elements.checked_mul(4).is_none() {
            return Err(err(
                ErrorKind::Overflow,
                format!(
                    "{} elements of f32 do not fit in u64 bytes",
                    info.n_elements
                ),
            )
            .tensor(stored_name));
        }
        let index = self.entries.len();
        self.names.insert(&info.name, stored_name, index)?;
        self.entries.push(info);
        Ok(index)
    }

    pub fn get(&self, name: &str) -> Option<usize> {
        self.names.get(name)
    }

    pub fn entries(&self) -> &[TensorInfo] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn info(&self, index: usize) -> Option<&TensorInfo> {
        self.entries.get(index)
    }

    /// An entry to amend after it was pushed (its names stay).
    pub(crate) fn info_mut(&mut self, index: usize) -> Option<&mut TensorInfo> {
        self.entries.get_mut(index)
    }
}

/// What a backend says about its source.
#[derive(Debug, Clone)]
pub struct SourceSummary {
    pub format: FileFormat,
    pub version: u32,
    pub path: PathBuf,
    pub metadata: Metadata,
    /// Format-specific one-liners for `inspect` (topology, layers, ...).
    pub notes: Vec<String>,
    /// The file carries checksums of every stored byte (docs/FORMAT.md
    /// section 12), verified as they are read; false: "unchecked".
    pub checked: bool,
}

/// A set of named tensors whose element ranges decode to f32.
///
/// `Send + Sync`: reads from many threads at once are safe (all file access
/// is positioned reads on shared, read-only descriptors).
pub trait Backend: Send + Sync {
    /// The primary source (for a layered backend) or the only one.
    fn summary(&self) -> &SourceSummary;

    /// The fallback's summary, for layered backends.
    fn fallback_summary(&self) -> Option<&SourceSummary> {
        None
    }

    fn tensors(&self) -> &TensorTable;

    /// Decode elements `[first_elem, first_elem + out.len())` of tensor
    /// `index` (row-major over the served shape) into `out`.
    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()>;

    /// The files this backend reads, as opened: what an encoding made from
    /// it must never replace, and whose permission bits bound the output's.
    fn source_files(&self) -> Vec<&SourceFile> {
        Vec::new()
    }

    /// A layered backend's dense fallback, shared (jobs encode from it).
    fn fallback_backend(&self) -> Option<Arc<dyn Backend>> {
        None
    }

    /// This backend as a dense one, whose ggml blocks can be copied verbatim.
    fn as_dense(&self) -> Option<&DenseBackend> {
        None
    }

    /// Where tensor `index`'s stored bytes are: every byte its decode can
    /// read, in the order the format lists them (what a manifest digests).
    /// None for an index the backend does not have, or a tensor listed
    /// without bytes of its own (an unavailable vocabulary placeholder).
    fn stored_ranges(&self, index: usize) -> Option<StoredRanges<'_>>;

    /// How tensor `index`'s stored blocks are coded, when they are no ggml
    /// type but a view may re-pack them without decoding ([`BlockCode`]);
    /// None otherwise (ggml blocks, or a code no view re-packs).
    fn block_code(&self, index: usize) -> Option<BlockCode> {
        let _ = index;
        None
    }

    /// Bytes `[offset, offset + buf.len())` of tensor `index`'s stored
    /// blocks, verbatim: its ggml blocks, or the blocks [`Self::block_code`]
    /// describes, for a view that serves or re-packs them as they are
    /// stored (`model.native.gguf`): through the same checks as
    /// [`Backend::read_f32`] (the file's CRC-32s, a remote source's pinned
    /// version, a wrapper's manifest). A backend whose tensors are neither
    /// refuses.
    fn read_stored_blocks(&self, index: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let _ = (offset, buf);
        let name = self
            .tensors()
            .info(index)
            .map_or_else(String::new, |t| t.name.dot.clone());
        Err(err(
            ErrorKind::UnsupportedType,
            "this source's tensors are not served as stored ggml blocks",
        )
        .tensor(&name)
        .path(&self.summary().path))
    }
}

/// Tell each remote source file of `backend` where its tensors' stored
/// bytes are (one extent per tensor, from its first stored byte to its
/// last): a remote source's read-ahead stays inside the tensor a reader
/// is in, so reading one tensor fetches little more than its bytes.
pub fn declare_extents(backend: &dyn Backend) {
    let mut per_file: Vec<(&SourceFile, Vec<std::ops::Range<u64>>)> = Vec::new();
    for index in 0..backend.tensors().len() {
        let Some(stored) = backend.stored_ranges(index) else {
            continue;
        };
        if !stored.file.is_remote() {
            continue;
        }
        let (Some(start), Some(end)) = (
            stored.ranges.iter().map(|r| r.start).min(),
            stored.ranges.iter().map(|r| r.end).max(),
        ) else {
            continue;
        };
        let hull = start..end;
        match per_file
            .iter_mut()
            .find(|(f, _)| std::ptr::eq(*f, stored.file))
        {
            Some((_, v)) => v.push(hull),
            None => per_file.push((stored.file, vec![hull])),
        }
    }
    for (file, extents) in per_file {
        file.set_extents(extents);
    }
}

/// A tensor's stored bytes in its source file: absolute byte ranges, in
/// format order, adjacent ranges merged.
#[derive(Debug, Clone)]
pub struct StoredRanges<'a> {
    pub file: &'a SourceFile,
    pub ranges: Vec<std::ops::Range<u64>>,
}

impl<'a> StoredRanges<'a> {
    /// One contiguous range `[offset, offset + length)`.
    pub fn one(file: &'a SourceFile, offset: u64, length: u64) -> Self {
        StoredRanges {
            file,
            ranges: std::iter::once(offset..offset + length).collect(),
        }
    }

    /// From ranges in order, merging each into the previous one where they
    /// touch.
    pub fn merged(file: &'a SourceFile, parts: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
        for (offset, length) in parts {
            match ranges.last_mut() {
                Some(last) if last.end == offset => last.end += length,
                _ => ranges.push(offset..offset + length),
            }
        }
        StoredRanges { file, ranges }
    }

    pub fn total(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }
}

impl dyn Backend + '_ {
    /// Look a tensor up by any spelling.
    pub fn find(&self, name: &str) -> Result<usize> {
        self.tensors().get(name).ok_or_else(|| {
            err(ErrorKind::NotFound, format!("no tensor named {name:?}")).path(&self.summary().path)
        })
    }

    /// Decoded little-endian f32 bytes `[byte_offset, byte_offset + buf.len())`
    /// of tensor `index`, clipped at the tensor's end; returns the number of
    /// bytes written (0 at or past the end). Any byte offset works.
    pub fn read_bytes(&self, index: usize, byte_offset: u64, buf: &mut [u8]) -> Result<usize> {
        let info = self
            .tensors()
            .info(index)
            .ok_or_else(|| no_such_index(index))?;
        let size = info.served_bytes();
        if byte_offset >= size || buf.is_empty() {
            return Ok(0);
        }
        let end = size.min(byte_offset.saturating_add(buf.len() as u64));
        let first = byte_offset / 4;
        let last = end.div_ceil(4);
        let mut vals = vec![0f32; (last - first) as usize];
        self.read_f32(index, first, &mut vals)?;
        let skip = (byte_offset - first * 4) as usize;
        let n = (end - byte_offset) as usize;
        let mut written = 0;
        for (i, v) in vals.iter().enumerate() {
            let bytes = v.to_le_bytes();
            let lo = if i == 0 { skip } else { 0 };
            let take = (4 - lo).min(n - written);
            buf[written..written + take].copy_from_slice(&bytes[lo..lo + take]);
            written += take;
            if written == n {
                break;
            }
        }
        Ok(n)
    }
}

/// The error for a tensor index a backend does not have.
pub(crate) fn no_such_index(index: usize) -> crate::Error {
    err(ErrorKind::NotFound, format!("no tensor with index {index}"))
}

/// Tensor `index`'s table entry together with the backend's own record for
/// it (both are indexed alike), after checking `[first, first + n)` against
/// the tensor's size and availability.
pub(crate) fn entry_for_read<'a, T>(
    table: &'a TensorTable,
    records: &'a [T],
    index: usize,
    first: u64,
    n: usize,
) -> Result<(&'a TensorInfo, &'a T)> {
    match (table.info(index), records.get(index)) {
        (Some(info), Some(record)) => {
            check_read(info, first, n)?;
            Ok((info, record))
        }
        _ => Err(no_such_index(index)),
    }
}

/// Check `[first, first + n)` against a tensor's size and availability.
pub(crate) fn check_read(info: &TensorInfo, first: u64, n: usize) -> Result<()> {
    if let Availability::Unavailable(why) = &info.availability {
        return Err(err(ErrorKind::Unavailable, why.clone())
            .tensor(&info.name.dot)
            .path(&info.origin.path));
    }
    let end = first.checked_add(n as u64);
    if end.is_none_or(|e| e > info.n_elements) {
        return Err(err(
            ErrorKind::Range,
            format!(
                "elements [{first}, {first}+{n}) are outside the tensor's {} elements",
                info.n_elements
            ),
        )
        .tensor(&info.name.dot));
    }
    Ok(())
}

pub(crate) fn origin(role: Role, format: FileFormat, path: &Path) -> Origin {
    Origin {
        role,
        format,
        path: Arc::new(path.to_path_buf()),
    }
}
