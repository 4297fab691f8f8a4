//! The records of what the mount serves: one per tensor (its files in every
//! format share it) and one per whole-model view. The namespace builds
//! them; the views, `hf/` and the read path use them.

use std::time::SystemTime;

use super::elem::ElemFormat;
use super::views::{Layout, ModelView};
use crate::backend::Backend;
use crate::format::meta::Metadata;

/// Largest file size `stat` can report (`st_size` is a signed 64-bit
/// number): a tensor or view larger than this is not offered.
pub const MAX_FILE_BYTES: u64 = i64::MAX as u64;

/// One served tensor: its files in every format share this.
pub(crate) struct TensorFile {
    /// Index in the backend's table.
    pub(super) index: usize,
    pub(super) n_elements: u64,
    pub(super) chunk_elems: u64,
    pub(super) mtime: SystemTime,
    pub(super) nlink: u32,
}

impl TensorFile {
    /// Size of this tensor's file in `fmt`.
    pub(super) fn bytes(&self, fmt: ElemFormat) -> u64 {
        self.n_elements * fmt.bytes()
    }
}

/// One whole-model view (`model.safetensors`, ...): its layout when it is
/// offered, or why it is not.
pub(super) struct ViewFile {
    pub(super) view: ModelView,
    pub(super) layout: std::result::Result<Layout, String>,
    pub(super) notes: Vec<String>,
}

impl ViewFile {
    /// The element type its tensors are in, as `ctl` and index.json say
    /// it: the layout's (`model.safetensors` is in the mount's dtype,
    /// `fs::precision`), "stored" for `model.native.gguf`.
    pub(super) fn dtype(&self) -> &'static str {
        match (&self.layout, self.view) {
            (_, ModelView::NativeGguf) | (Err(_), _) => self.view.dtype(),
            (Ok(l), _) => l.fmt().dtype(),
        }
    }

    /// The tensor files its segments serve.
    pub(super) fn tensor_files(&self) -> Vec<usize> {
        match &self.layout {
            Ok(l) => l.segments().iter().map(|s| s.file).collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// The key/values the model views carry, and whose they are: the dense
/// fallback's when there is one (it is the complete model file), unless it
/// has none; else the source's.
pub(super) fn view_metadata(b: &dyn Backend) -> (&Metadata, &'static str) {
    match b.fallback_summary() {
        Some(f) if !f.metadata.is_empty() => (&f.metadata, "fallback"),
        _ => (&b.summary().metadata, "source"),
    }
}
