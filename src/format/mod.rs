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

/// The four kinds of file we read.
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
}

impl FileFormat {
    pub fn name(self) -> &'static str {
        match self {
            FileFormat::Rknot => "rknot",
            FileFormat::Sk32 => "sk32",
            FileFormat::DenseKnot => "knot",
            FileFormat::Gguf => "gguf",
        }
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

/// What the first bytes say, before the full header is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Magic {
    Rknot,
    Knot,
    Gguf,
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
             KNOT (SK32 sketch or dense .knot) or GGUF"
        ),
    )
    .path(path)
    .at(0)
}

/// Sniff the first bytes of a file.
pub fn sniff(src: &SourceFile) -> Result<Magic> {
    let n = src.len().min(6) as usize;
    let mut head = [0u8; 6];
    src.read_at(0, &mut head[..n])?;
    let head = &head[..n];
    if head == rknot::RKNOT_MAGIC_V2 || head == rknot::RKNOT_MAGIC_V3 {
        return Ok(Magic::Rknot);
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
    if head.starts_with(container::KNOT_MAGIC) {
        return Ok(Magic::Knot);
    }
    if head.starts_with(gguf::GGUF_MAGIC) {
        return Ok(Magic::Gguf);
    }
    Err(bad_magic(src.path(), head))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn bad_magic_prints_path_and_bytes() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"PK\x03\x04zz").unwrap();
        let e = sniff(&SourceFile::open(f.path()).unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadMagic);
        let s = e.to_string();
        assert!(s.contains("[80, 75, 3, 4, 122, 122]"), "{s}");
        assert!(s.contains(&f.path().display().to_string()), "{s}");
    }

    #[test]
    fn sniffs_short_and_versioned() {
        for (bytes, want) in [
            (&b"GGUF\x03\x00"[..], Ok(Magic::Gguf)),
            (b"KNOT\x01\x00", Ok(Magic::Knot)),
            (b"RKNOT\x02", Ok(Magic::Rknot)),
            (b"RKNOT\x03", Ok(Magic::Rknot)),
            (b"RKNOT\x04", Err(ErrorKind::UnsupportedVersion)),
            (b"", Err(ErrorKind::BadMagic)),
            (b"GG", Err(ErrorKind::BadMagic)),
        ] {
            let mut f = tempfile::NamedTempFile::new().unwrap();
            f.write_all(bytes).unwrap();
            let got = sniff(&SourceFile::open(f.path()).unwrap()).map_err(|e| e.kind());
            assert_eq!(got, want, "{bytes:?}");
        }
    }
}
