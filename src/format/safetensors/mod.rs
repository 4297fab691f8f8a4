//! Hugging Face safetensors checkpoints: one `.safetensors` file, or a
//! `model.safetensors.index.json` naming the shard of every tensor, with
//! the checkpoint's `config.json` and tokenizer files next to it.
//!
//! - [`header`]: one file's header, as strictly as the safetensors crate
//!   reads it (and stricter on duplicate keys, which serde_json would let
//!   the last of win).
//! - [`index`]: the index's `weight_map` and its shard names (plain file
//!   names in the same directory: nothing else is opened).
//! - [`checkpoint`]: the whole checkpoint, opened through [`SourceFile`]s
//!   named next to the file given (local, `http(s)://`, `s3://` alike).
//!
//! The reader yields tensors under their Hugging Face names with their
//! dtypes; how those become GGUF names (and the Q/K row order llama.cpp's
//! converter writes) belongs to the architecture, in the backend.

use std::fmt;

use crate::error::Result;
use crate::quant::GgmlType;
use crate::source::SourceFile;

pub mod checkpoint;
pub mod header;
pub mod index;

pub use checkpoint::{Checkpoint, CheckpointKind};

/// A safetensors dtype (every one the safetensors crate names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    Bf16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

/// (dtype, name, bits per element)
const DTYPES: &[(Dtype, &str, u64)] = &[
    (Dtype::Bool, "BOOL", 8),
    (Dtype::F4, "F4", 4),
    (Dtype::F6E2M3, "F6_E2M3", 6),
    (Dtype::F6E3M2, "F6_E3M2", 6),
    (Dtype::U8, "U8", 8),
    (Dtype::I8, "I8", 8),
    (Dtype::F8E5M2, "F8_E5M2", 8),
    (Dtype::F8E4M3, "F8_E4M3", 8),
    (Dtype::F8E8M0, "F8_E8M0", 8),
    (Dtype::I16, "I16", 16),
    (Dtype::U16, "U16", 16),
    (Dtype::F16, "F16", 16),
    (Dtype::Bf16, "BF16", 16),
    (Dtype::I32, "I32", 32),
    (Dtype::U32, "U32", 32),
    (Dtype::F32, "F32", 32),
    (Dtype::C64, "C64", 64),
    (Dtype::F64, "F64", 64),
    (Dtype::I64, "I64", 64),
    (Dtype::U64, "U64", 64),
];

impl Dtype {
    fn row(self) -> &'static (Dtype, &'static str, u64) {
        // Every variant has one row (checked by a test).
        DTYPES.iter().find(|r| r.0 == self).unwrap_or(&DTYPES[0])
    }

    /// From its name in a header (`"BF16"`), case as written.
    pub fn from_name(name: &str) -> Option<Self> {
        DTYPES.iter().find(|r| r.1 == name).map(|r| r.0)
    }

    pub fn name(self) -> &'static str {
        self.row().1
    }

    pub fn bits(self) -> u64 {
        self.row().2
    }

    /// Bytes of `n` elements; None when they are not whole bytes (F4, F6)
    /// or overflow.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bits = n.checked_mul(self.bits())?;
        bits.is_multiple_of(8).then_some(bits / 8)
    }

    /// The element type it decodes as, or why it is not served: integers
    /// and bools are not weights (served as floats they would be garbage);
    /// the sub-byte and block-scaled formats have no kernel here.
    pub fn element(self) -> std::result::Result<GgmlType, String> {
        match self {
            Dtype::F64 => Ok(GgmlType::F64),
            Dtype::F32 => Ok(GgmlType::F32),
            Dtype::F16 => Ok(GgmlType::F16),
            Dtype::Bf16 => Ok(GgmlType::Bf16),
            Dtype::F8E4M3 => Ok(GgmlType::F8E4M3),
            Dtype::F8E5M2 => Ok(GgmlType::F8E5M2),
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64 => Err(format!(
                "dtype {self} holds integers or booleans, not weights: not served as f32"
            )),
            Dtype::F4 | Dtype::F6E2M3 | Dtype::F6E3M2 | Dtype::F8E8M0 | Dtype::C64 => {
                Err(format!("dtype {self} is not decoded by this build"))
            }
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a header.
#[derive(Debug, Clone, PartialEq)]
pub struct SafeTensor {
    /// As stored (a Hugging Face name).
    pub name: String,
    pub dtype: Dtype,
    /// Outer-first, as torch's.
    pub shape: Vec<u64>,
    /// `data_offsets`, relative to the data's start.
    pub begin: u64,
    pub end: u64,
    /// Absolute offset of the tensor's entry in the header (for messages).
    pub header_at: u64,
}

impl SafeTensor {
    /// Elements (1 for a scalar, shape `[]`); None on overflow.
    pub fn n_elements(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }
}

/// One file's validated header.
#[derive(Debug, Clone)]
pub struct SafetensorsFile {
    pub header_len: u64,
    /// Absolute offset of the data (8 + `header_len`).
    pub data_start: u64,
    /// `__metadata__`, in header order.
    pub metadata: Vec<(String, String)>,
    /// In data order.
    pub tensors: Vec<SafeTensor>,
}

impl SafetensorsFile {
    pub fn read(src: &SourceFile) -> Result<Self> {
        header::read(src)
    }
}

/// The name part of a path or URL (no query string), for the detectors.
pub(crate) fn file_name(src: &SourceFile) -> String {
    let s = src.path().to_string_lossy();
    let s = s.split(['?', '#']).next().unwrap_or("");
    s.rsplit('/').next().unwrap_or("").to_string()
}

/// [`crate::format::Detect`] for a `.safetensors` file, which has no
/// magic: its name, or an 8-byte length that fits the file followed by
/// `{`. Tried after every reader with a magic.
pub fn is_safetensors(src: &SourceFile, head: &[u8]) -> Result<bool> {
    if file_name(src).ends_with(".safetensors") {
        return Ok(true);
    }
    if head.len() < crate::format::HEAD_BYTES || src.len() < 10 {
        return Ok(false);
    }
    let mut b = [0u8; 9];
    src.read_at(0, &mut b)?;
    let mut len = [0u8; 8];
    len.copy_from_slice(&b[..8]);
    let n = u64::from_le_bytes(len);
    Ok(b[8] == b'{' && n >= 2 && n <= src.len() - 8)
}

/// [`crate::format::Detect`] for a checkpoint's index: a file named
/// `*.safetensors.index.json` (its reader says what is wrong with it).
pub fn is_index(src: &SourceFile, _head: &[u8]) -> Result<bool> {
    Ok(file_name(src).ends_with(INDEX_SUFFIX))
}

/// How an index's name ends.
pub const INDEX_SUFFIX: &str = ".safetensors.index.json";

#[cfg(test)]
mod tests;
