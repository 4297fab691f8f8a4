//! Engine-ready views: whole-model files (`model.safetensors`,
//! `model.gguf`, `model.f16.safetensors`, `model.bf16.safetensors`) and
//! half-precision tensor files (`NAME.f16`, `NAME.bf16`), built from tensor
//! shapes and metadata only.
//!
//! A view is a *virtual file*: a [`Layout`] of header bytes followed by an
//! ordered list of [`Segment`]s, each the whole of one tensor encoded in the
//! view's [`ElemFormat`]; bytes between segments (GGUF alignment) are zero.
//! Nothing here decodes: [`Layout::pieces`] maps a byte range of the view to
//! header bytes, padding and tensor byte ranges, and the filesystem serves
//! the tensor ranges from the same decoded-chunk cache as the `.f32` files,
//! converting f32 to f16/bf16 on the fly ([`encode_into`]) so there is never
//! a second decoded copy.
//!
//! Inode numbers (stable across remounts of the same files, whatever
//! `--views` says): 4 `model.safetensors`, 5 `model.gguf`,
//! 6 `model.f16.safetensors`, 7 `model.bf16.safetensors`; the tensor file of
//! the i-th served tensor in format k (0 f32, 1 f16, 2 bf16) is
//! `16 + i + k * 2^32`, so `.f32` inodes keep their `16 + i`;
//! `hf/model.safetensors` in format k is `2^47 + 5 + k` ([`super::hf`]; the numbers live in [`super::inodes`]).
//!
//! By concern: [`layout`] (a view's bytes as header, segments and padding),
//! [`safetensors`] and [`gguf`] (the builders), this module (which views
//! exist, and the tensors the builders take).

mod gguf;
mod layout;
mod native;
mod safetensors;
pub mod transcode;

pub use self::gguf::{gguf, gguf_metadata, gguf_missing_keys, gguf_missing_tensors};
pub use self::layout::{Layout, Piece, Segment, chunks_after};
pub use self::native::native_gguf;
pub use self::safetensors::{SAFETENSORS_MAX_HEADER, meta_string, safetensors, safetensors_all};
pub(in crate::fs) use self::safetensors::{header_start, safetensors_with};
pub use super::elem::{ElemFormat, encode_into};
pub use super::inodes::{
    BF16_SAFETENSORS_INO, F16_SAFETENSORS_INO, FORMAT_INO_STRIDE, GGUF_INO, NATIVE_GGUF_INO,
    SAFETENSORS_INO,
};
pub use crate::arch::rows::RowGroups;

use crate::error::{ErrorKind, Result, err, mul, product};

/// The per-tensor formats a mount serves (`--views`). f32 is always
/// served: the `.f32` files and the F32 model views are the mount's base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ViewSet {
    pub f16: bool,
    pub bf16: bool,
}

impl ViewSet {
    /// Parse `f32,f16,bf16` (`,` or `+` separated; `+` is what fits in a
    /// `-o` list). Unknown entries are an error naming them.
    pub fn parse(list: &str) -> std::result::Result<ViewSet, String> {
        let mut v = ViewSet::default();
        for item in list
            .split([',', '+'])
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            match ElemFormat::from_ext(item) {
                Some(ElemFormat::F32) => {}
                Some(ElemFormat::F16) => v.f16 = true,
                Some(ElemFormat::Bf16) => v.bf16 = true,
                None => {
                    return Err(format!(
                        "unknown view {item:?} in {list:?} (views: f32, f16, bf16)"
                    ));
                }
            }
        }
        Ok(v)
    }

    pub fn has(self, fmt: ElemFormat) -> bool {
        match fmt {
            ElemFormat::F32 => true,
            ElemFormat::F16 => self.f16,
            ElemFormat::Bf16 => self.bf16,
        }
    }

    /// Served formats, f32 first.
    pub fn formats(self) -> Vec<ElemFormat> {
        ElemFormat::ALL
            .into_iter()
            .filter(|f| self.has(*f))
            .collect()
    }

    /// `f32,f16` style list.
    pub fn names(self) -> String {
        self.formats()
            .iter()
            .map(|f| f.ext())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The whole-model views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelView {
    /// `model.safetensors` (named F32) and `model.{f16,bf16}.safetensors`:
    /// the format names the file; the unsuffixed one is served in the
    /// mount's dtype (`fs::precision`; its layout's format is the truth).
    Safetensors(ElemFormat),
    Gguf,
    /// `model.native.gguf`: every tensor in its stored ggml type, its bytes
    /// the source's ([`native`]).
    NativeGguf,
    /// `hf/model.safetensors` (and its F16/BF16 forms): Hugging Face names
    /// and row order ([`super::hf`]); named as `Safetensors` is.
    Hf(ElemFormat),
}

impl ModelView {
    /// In listing order.
    pub const ALL: [ModelView; 8] = [
        ModelView::Safetensors(ElemFormat::F32),
        ModelView::Gguf,
        ModelView::NativeGguf,
        ModelView::Safetensors(ElemFormat::F16),
        ModelView::Safetensors(ElemFormat::Bf16),
        ModelView::Hf(ElemFormat::F32),
        ModelView::Hf(ElemFormat::F16),
        ModelView::Hf(ElemFormat::Bf16),
    ];

    /// Path in the mount.
    pub fn name(self) -> &'static str {
        match self {
            ModelView::Safetensors(ElemFormat::F32) => "model.safetensors",
            ModelView::Safetensors(ElemFormat::F16) => "model.f16.safetensors",
            ModelView::Safetensors(ElemFormat::Bf16) => "model.bf16.safetensors",
            ModelView::Gguf => "model.gguf",
            ModelView::NativeGguf => "model.native.gguf",
            ModelView::Hf(ElemFormat::F32) => "hf/model.safetensors",
            ModelView::Hf(ElemFormat::F16) => "hf/model.f16.safetensors",
            ModelView::Hf(ElemFormat::Bf16) => "hf/model.bf16.safetensors",
        }
    }

    /// Name in its directory.
    pub fn file_name(self) -> &'static str {
        let n = self.name();
        n.rsplit_once('/').map_or(n, |(_, f)| f)
    }

    /// Whether it lives in `hf/` (else in the root).
    pub fn in_hf_dir(self) -> bool {
        matches!(self, ModelView::Hf(_))
    }

    pub fn ino(self) -> u64 {
        match self {
            ModelView::Safetensors(ElemFormat::F32) => SAFETENSORS_INO,
            ModelView::Safetensors(ElemFormat::F16) => F16_SAFETENSORS_INO,
            ModelView::Safetensors(ElemFormat::Bf16) => BF16_SAFETENSORS_INO,
            ModelView::Gguf => GGUF_INO,
            ModelView::NativeGguf => NATIVE_GGUF_INO,
            ModelView::Hf(f) => super::inodes::hf_safetensors_ino(f),
        }
    }

    pub fn format(self) -> ElemFormat {
        match self {
            ModelView::Safetensors(f) | ModelView::Hf(f) => f,
            // Offered whatever `--views` says, as the F32 views are.
            ModelView::Gguf | ModelView::NativeGguf => ElemFormat::F32,
        }
    }

    /// The element type its name says (a built view's is its layout's:
    /// `ViewFile::dtype`).
    pub fn dtype(self) -> &'static str {
        match self {
            ModelView::NativeGguf => "stored",
            _ => self.format().dtype(),
        }
    }

    /// The F32 views are always offered (when they can be built); the
    /// half-precision safetensors only when `--views` asks for the format.
    pub fn requested(self, set: ViewSet) -> bool {
        set.has(self.format())
    }
}

// ---------------------------------------------------------------------------
// Building the views (shapes and metadata only: nothing is decoded)

/// One tensor as the view builders see it.
#[derive(Debug, Clone)]
pub struct ViewTensor<'a> {
    /// Index of the tensor file.
    pub file: usize,
    /// Canonical dot name.
    pub name: &'a str,
    /// Served shape, outer-first.
    pub shape: &'a [u64],
    pub n_elements: u64,
    /// Rows served in another order (the `hf/` view).
    pub rows: Option<RowGroups>,
    /// The tensor's elements as runs of tensor files' elements, in order
    /// (a tensor Hugging Face stores fused, in `hf/`); empty: the whole
    /// of `file`.
    pub runs: &'a [ElemRun],
}

/// `n` elements of tensor file `file` from element `elem0` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElemRun {
    pub file: usize,
    pub elem0: u64,
    pub n: u64,
}

/// The segments of `t` (`len` bytes in `fmt`, from [`tensor_len`]) placed
/// at byte `start` of a view: the whole tensor file, or one per run.
fn tensor_segments(t: &ViewTensor, start: u64, len: u64, fmt: ElemFormat) -> Result<Vec<Segment>> {
    if t.runs.is_empty() {
        return Ok(vec![Segment {
            start,
            len,
            file: t.file,
            elem0: 0,
            rows: t.rows,
        }]);
    }
    if t.rows.is_some() {
        return Err(err(
            ErrorKind::BadValue,
            "internal error: a fused view tensor with permuted rows",
        )
        .tensor(t.name));
    }
    let mut at = start;
    let mut out = Vec::with_capacity(t.runs.len());
    for r in t.runs {
        let bytes = mul(r.n, fmt.bytes(), "tensor bytes").map_err(|e| e.tensor(t.name))?;
        out.push(Segment {
            start: at,
            len: bytes,
            file: r.file,
            elem0: r.elem0,
            rows: None,
        });
        at = crate::error::add(at, bytes, "view segment end")?;
    }
    if at - start != len {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "its runs hold {} bytes, its shape {:?} {len}",
                at - start,
                t.shape
            ),
        )
        .tensor(t.name));
    }
    Ok(out)
}

/// Bytes of `t` in `fmt`, after checking that its shape holds its elements.
fn tensor_len(t: &ViewTensor, fmt: ElemFormat) -> Result<u64> {
    let n = product(t.shape, "element count").map_err(|e| e.tensor(t.name))?;
    if n != t.n_elements {
        return Err(err(
            ErrorKind::BadShape,
            format!(
                "shape {:?} holds {n} elements, not {}",
                t.shape, t.n_elements
            ),
        )
        .tensor(t.name));
    }
    mul(n, fmt.bytes(), "tensor bytes").map_err(|e| e.tensor(t.name))
}

/// A built view and what a reader should know about it.
#[derive(Debug, Clone)]
pub struct Built {
    pub layout: Layout,
    pub notes: Vec<String>,
}

#[cfg(test)]
mod tests;
