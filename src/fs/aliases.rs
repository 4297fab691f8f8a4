//! The HF-named files of a safetensors checkpoint: every tensor served
//! under its GGUF name is also a file under its Hugging Face name, in both
//! spellings and every served format, with the rows in the checkpoint's
//! order ([`crate::backend::hf_aliases`]).
//!
//! They are names, not tensors: no view, tensor count or index entry
//! counts them twice. Where the rows are the tensor file's, the HF name is
//! a hard link of the tensor file (same inode); where they are not
//! (llama's Q/K, which the GGUF name serves in llama.cpp's converter's
//! order), it is a file of its own ([`super::inodes::alias_ino`]) whose
//! bytes are a one-segment layout over the tensor file in Hugging Face row
//! order, read as the views' permuted segments are: the decoded chunks are
//! the tensor file's, one copy for every name.

use std::collections::HashMap;

use super::files::TensorFile;
use super::inodes::{alias_ino, tensor_ino};
use super::views::{ElemFormat, Layout, Segment};
use crate::backend::{Backend, hf_aliases};
use crate::names::TensorName;

/// One HF-named file.
pub(super) struct AliasFile {
    /// The tensor file it names.
    pub(super) file: usize,
    /// Index in the backend's table.
    pub(super) index: usize,
    pub(super) name: TensorName,
    /// Per served format (the namespace's order), the file's bytes in
    /// Hugging Face row order; empty when they are the tensor file's.
    pub(super) layouts: Vec<Layout>,
}

impl AliasFile {
    /// Whether its rows are in another order than the tensor file's.
    pub(super) fn permuted(&self) -> bool {
        !self.layouts.is_empty()
    }

    /// Its inode in `fmt`: the tensor file's unless the rows differ.
    pub(super) fn ino(&self, fmt: ElemFormat) -> u64 {
        match self.permuted() {
            true => alias_ino(self.file, fmt),
            false => tensor_ino(self.file, fmt),
        }
    }
}

/// Every HF-named file of a mount, in tensor file order.
#[derive(Default)]
pub(super) struct Aliases {
    list: Vec<AliasFile>,
    /// Both spellings of each name -> position in `list`.
    by_name: HashMap<String, usize>,
}

impl Aliases {
    /// The HF-named files of the tensor files `files` of `b`, in
    /// `formats`. A name that is already a tensor's (in either spelling) is
    /// left out, logged.
    pub(super) fn build(b: &dyn Backend, files: &[TensorFile], formats: &[ElemFormat]) -> Aliases {
        let mut out = Aliases::default();
        let table = b.tensors();
        for a in hf_aliases(b) {
            // Tensor files are in table order.
            let Ok(f) = files.binary_search_by_key(&a.index, |tf| tf.index) else {
                continue;
            };
            let taken = [&a.name.dot, &a.name.underscore]
                .into_iter()
                .any(|n| table.get(n).is_some() || out.by_name.contains_key(n));
            if taken {
                log::warn!(
                    "{} is also a tensor's name: not served as the Hugging Face name of {}",
                    crate::text::escape(&a.name.dot),
                    table.entries()[a.index].name.dot
                );
                continue;
            }
            let mut layouts = Vec::new();
            if let Some(rows) = a.rows {
                for &fmt in formats {
                    let len = files[f].bytes(fmt);
                    let seg = Segment {
                        start: 0,
                        len,
                        file: f,
                        elem0: 0,
                        rows: Some(rows),
                    };
                    match Layout::new(Vec::new(), fmt, vec![seg], len) {
                        Ok(l) => layouts.push(l),
                        Err(e) => {
                            log::warn!("{} is not served: {e}", crate::text::escape(&a.name.dot));
                            break;
                        }
                    }
                }
                if layouts.len() != formats.len() {
                    continue;
                }
            }
            let at = out.list.len();
            out.by_name.insert(a.name.dot.clone(), at);
            out.by_name.insert(a.name.underscore.clone(), at);
            out.list.push(AliasFile {
                file: f,
                index: a.index,
                name: a.name,
                layouts,
            });
        }
        out
    }

    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    /// The `k`-th in listing order.
    pub(super) fn at(&self, k: usize) -> Option<&AliasFile> {
        self.list.get(k)
    }

    /// The file named `stem` (either spelling).
    pub(super) fn get(&self, stem: &str) -> Option<&AliasFile> {
        self.by_name.get(stem).and_then(|&k| self.list.get(k))
    }

    /// The HF-named file of tensor file `f`.
    pub(super) fn of_file(&self, f: usize) -> Option<&AliasFile> {
        let k = self.list.binary_search_by_key(&f, |a| a.file).ok()?;
        self.list.get(k)
    }

    /// The HF-named file of table entry `index`.
    pub(super) fn of_index(&self, index: usize) -> Option<&AliasFile> {
        let k = self.list.binary_search_by_key(&index, |a| a.index).ok()?;
        self.list.get(k)
    }

    /// Names tensor file `f` has beyond its own spellings (hard links).
    pub(super) fn extra_links(&self, f: usize) -> u32 {
        match self.of_file(f) {
            Some(a) if !a.permuted() => 2,
            _ => 0,
        }
    }

    /// The HF-named files with inodes of their own.
    pub(super) fn permuted(&self) -> impl Iterator<Item = &AliasFile> {
        self.list.iter().filter(|a| a.permuted())
    }
}
