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
//!
//! The files: `read` (the validating reader of the header and tensor
//! table), `write` (the writer), `value` (the metadata value model, shared
//! with the JSON headers of our formats through [`crate::format::meta`]),
//! `split` (a split set of GGUF files, opened as one).

mod read;
pub mod split;
pub mod value;
mod write;

use crate::error::{ErrorKind, Result, add, err};
use crate::quant::GgmlType;
use crate::source::SourceFile;
pub use value::MAX_ARRAY_DEPTH;
use value::Metadata;
pub use write::{encode_header, encode_header_with, write_gguf};

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
        read::read_inner(src).map_err(|e| e.path(src.path()))
    }

    /// The tensor with exactly this stored name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// [`crate::format::Detect`] for GGUF, a shard of a split set included:
/// the reader's parse opens a shard (`split.count` > 1) as its whole set
/// ([`split::GgufSplit`]).
pub fn is_gguf(_src: &SourceFile, head: &[u8]) -> Result<bool> {
    Ok(head.starts_with(GGUF_MAGIC))
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

#[cfg(test)]
mod tests;
