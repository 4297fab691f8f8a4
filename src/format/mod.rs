//! File formats: readers (validation + index) and writers.
//!
//! Readers parse and check a file's header and tables and return a plain
//! index (names, shapes, types, absolute offsets); they never decode tensor
//! data. The backends in [`crate::backend`] decode through these indexes.
//! The byte-level specification of every format is docs/FORMAT.md.

use std::fmt;
use std::path::Path;

use crate::error::{Error, ErrorKind, Result, err};
use crate::source::SourceFile;

pub mod checksum;
pub mod container;
pub mod gguf;
pub mod json;
pub mod knot;
pub mod meta;
pub mod rknot;
pub mod safetensors;
pub mod sk32;

/// Most tensors a file may hold, in every format (GGUF `tensor_count`,
/// SK32 sketches, dense .knot tensors, .rknot tensors). Real models hold far
/// fewer: ~300 (SmolLM2) to ~1-2k (the largest merged-expert MoE GGUFs);
/// the old unmerged-MoE layouts (one tensor per expert) reach ~15k for
/// Arctic and ~36k for a 94-layer, 128-expert model. Each tensor costs the
/// mount inodes, two directory entries and index.json lines, so a
/// million-tensor header of 44 MB must not get that far.
pub const MAX_TENSORS: u64 = 65_536;

/// The error for a table with more than [`MAX_TENSORS`] entries.
pub fn too_many_tensors(what: &str) -> Error {
    err(
        ErrorKind::TooLarge,
        format!(
            "{what}: more than {MAX_TENSORS} tensors (the cap; real models have a few thousand at most)"
        ),
    )
}

/// The kinds of file we read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// `RKNOT\x02` or `RKNOT\x03`: spectral-residual blocks.
    Rknot,
    /// `KNOT` v1 with a `sketches` map: rank-r u8 factors.
    Sk32,
    /// `KNOT` v1 with a `tensors` map: ggml blocks verbatim.
    DenseKnot,
    /// `GGUF` v2/v3.
    Gguf,
    /// A Hugging Face safetensors checkpoint (one file, or an index and
    /// its shards).
    Safetensors,
}

impl FileFormat {
    pub fn name(self) -> &'static str {
        match self {
            FileFormat::Rknot => "rknot",
            FileFormat::Sk32 => "sk32",
            FileFormat::DenseKnot => "knot",
            FileFormat::Gguf => "gguf",
            FileFormat::Safetensors => "safetensors",
        }
    }

    /// Dense files of plain blocks `encode knot` repacks verbatim.
    pub fn is_repackable(self) -> bool {
        matches!(self, FileFormat::Gguf | FileFormat::Safetensors)
    }

    /// Lossy, compressed primaries (served through the layered backend).
    pub fn is_primary_kind(self) -> bool {
        matches!(self, FileFormat::Rknot | FileFormat::Sk32)
    }
}

impl fmt::Display for FileFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes of a file's start that the readers' detectors look at.
pub const HEAD_BYTES: usize = 6;

/// How a reader recognises its kind of file: whether `head` (the file's
/// first [`HEAD_BYTES`] bytes, fewer in a shorter file) is its kind; an
/// error for a file of its kind in a version no reader reads. The readers
/// are tried in turn by `backend::open` (its `READERS` table).
pub type Detect = fn(&SourceFile, &[u8]) -> Result<bool>;

/// The first [`HEAD_BYTES`] bytes of `src` into `head` (fewer in a shorter
/// file); returns how many.
pub fn read_head(src: &SourceFile, head: &mut [u8; HEAD_BYTES]) -> Result<usize> {
    let n = src.len().min(HEAD_BYTES as u64) as usize;
    src.read_at(0, &mut head[..n])?;
    Ok(n)
}

/// Error for a file whose first bytes match no format.
pub fn bad_magic(path: &Path, found: &[u8]) -> Error {
    let shown: String = found
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() {
                (b as char).to_string()
            } else {
                format!("\\x{b:02x}")
            }
        })
        .collect();
    err(
        ErrorKind::BadMagic,
        format!(
            "bad magic: found {found:?} (\"{shown}\"); expected RKNOT\\x03 or RKNOT\\x02 (.rknot), \
             KNOT (SK32 sketch or dense .knot), GGUF, or a safetensors header (an \
             8-byte length, then '{{')"
        ),
    )
    .path(path)
    .at(0)
}

/// [`Detect`] for .rknot: `RKNOT\x02` or `RKNOT\x03`; another version
/// byte after `RKNOT` is an error naming it.
pub fn is_rknot(src: &SourceFile, head: &[u8]) -> Result<bool> {
    if head == rknot::RKNOT_MAGIC_V2 || head == rknot::RKNOT_MAGIC_V3 {
        return Ok(true);
    }
    if head.len() == 6 && head.starts_with(rknot::RKNOT_MAGIC_STEM) {
        return Err(err(
            ErrorKind::UnsupportedVersion,
            format!(
                ".rknot version byte {} is not supported (only 2 and 3, \"RKNOT\\x02\" and \
                 \"RKNOT\\x03\")",
                head[5]
            ),
        )
        .path(src.path())
        .at(5));
    }
    Ok(false)
}
