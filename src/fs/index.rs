//! `index.json`: every tensor (names, shape, stored type, source, sizes,
//! its files), the model metadata (long arrays and strings summarized as
//! `rknot inspect --json` does) and the views.
//!
//! The document is served in pages, never held whole: its bytes are a head
//! (everything before the tensor list), one element per tensor, and a tail.
//! Only the head, the tail and the element offsets (8 bytes per tensor) are
//! kept; a read renders just the tensor elements it overlaps. Rendering is
//! deterministic, so every page agrees with the lengths measured at mount.

use serde_json::{Value, json};

use super::files::{ViewFile, view_metadata};
use super::inodes::HF_DIR_NAME;
use super::namespace::Namespace;
use super::precision::Precision;
use super::views::{ElemFormat, ModelView};
use crate::backend::Backend;
use crate::names::TensorName;
use crate::report;

/// Stands in for the tensor list while the rest is rendered.
const PLACEHOLDER: &str = "\u{1}rknot-tensor-list\u{1}";

/// Each tensor element sits at depth 2 of the pretty-printed document.
const ELEMENT_INDENT: &str = "    ";

pub(super) struct IndexJson {
    head: Vec<u8>,
    tail: Vec<u8>,
    /// `starts[i]`: offset of tensor element i (with its separator) from
    /// the end of the head; `starts[n]` is where the tail begins.
    starts: Vec<u64>,
    formats: Vec<ElemFormat>,
}

/// One tensor's entry: what `inspect --json` says, plus its file names in
/// the mount (none when it is not served) and, for a checkpoint's tensor
/// served under its GGUF name, its Hugging Face name and files.
fn tensor_value(b: &dyn Backend, i: usize, formats: &[ElemFormat], ns: &Namespace) -> Value {
    let t = &b.tensors().entries()[i];
    let mut v = report::tensor_json(t);
    let names = |n: &TensorName| {
        let mut files = Vec::new();
        for fmt in formats {
            files.push(format!("{}.{}", n.underscore, fmt.ext()));
            if n.underscore != n.dot {
                files.push(format!("{}.{}", n.dot, fmt.ext()));
            }
        }
        files
    };
    if ns.is_served(i) {
        v["files"] = json!(names(&t.name));
    }
    if let Some(a) = ns.aliases.of_index(i) {
        v["hf_name"] = json!(a.name.dot);
        v["hf_files"] = json!(names(&a.name));
        // The HF-named files hold the checkpoint's row order, the
        // GGUF-named ones llama.cpp's converter's.
        v["hf_rows_permuted"] = json!(a.permuted());
    }
    v
}

/// Pretty JSON of one tensor element, indented for its depth, with the
/// separator that follows it unless it is the last.
fn render_element(v: &Value, last: bool) -> Vec<u8> {
    let text = serde_json::to_string_pretty(v).unwrap_or_default();
    let mut out = String::with_capacity(text.len() + 64);
    for (n, line) in text.split('\n').enumerate() {
        if n > 0 {
            out.push('\n');
        }
        out.push_str(ELEMENT_INDENT);
        out.push_str(line);
    }
    if !last {
        out.push_str(",\n");
    }
    crate::text::escape_json_text(out).into_bytes()
}

/// `views.hf`: whether `hf/` is there, its files, or why it is not.
fn hf_value(ns: &Namespace) -> Value {
    match &ns.hf {
        Ok(dir) => {
            let mut v = json!({
                "available": true,
                "dir": HF_DIR_NAME,
                "files": ns.hf_entries().iter().map(|(n, _)| format!("{HF_DIR_NAME}/{n}")).collect::<Vec<_>>(),
            });
            if !dir.notes.is_empty() {
                v["notes"] = json!(dir.notes);
            }
            v
        }
        Err(why) => json!({"available": false, "dir": HF_DIR_NAME, "unavailable_reason": why}),
    }
}

fn views_value(
    b: &dyn Backend,
    formats: &[ElemFormat],
    views: &[ViewFile],
    precision: &Precision,
) -> Value {
    let files: Vec<Value> = views
        .iter()
        .map(|vf| {
            let mut e = json!({
                "name": vf.view.name(),
                "kind": match vf.view {
                    ModelView::Gguf | ModelView::NativeGguf => "gguf",
                    ModelView::Safetensors(_) | ModelView::Hf(_) => "safetensors",
                },
                "dtype": vf.dtype(),
                "available": vf.layout.is_ok(),
            });
            if vf.layout.is_ok() && vf.view != ModelView::NativeGguf {
                // Whether every tensor's values are the decoded ones
                // exactly (the notes say what rounds otherwise).
                e["exact"] = json!(precision.rounding_of(vf).is_none());
            }
            match &vf.layout {
                Ok(l) => {
                    e["size"] = json!(l.size());
                    e["header_bytes"] = json!(l.header().len());
                    e["tensors"] = json!(l.segments().len());
                }
                Err(why) => e["unavailable_reason"] = json!(why),
            }
            if !vf.notes.is_empty() {
                e["notes"] = json!(vf.notes);
            }
            e
        })
        .collect();
    json!({
        "tensor_formats": formats.iter().map(|f| f.ext()).collect::<Vec<_>>(),
        "metadata_from": view_metadata(b).1,
        // model.safetensors and hf/ are in this dtype (-o hf_dtype=).
        "main_dtype": precision.main.dtype(),
        "main_dtype_reason": precision.reason,
        "files": files,
    })
}

impl IndexJson {
    /// Measure the document for `b` as mounted with namespace `ns`.
    pub(super) fn build(b: &dyn Backend, ns: &Namespace) -> IndexJson {
        let mut v = report::inspect_json_without_tensors(b, report::ARRAY_SUMMARY_LIMIT);
        v["tensors"] = json!(PLACEHOLDER);
        if !ns.unserved.is_empty() {
            v["unserved"] = ns
                .unserved
                .iter()
                .map(|(name, why)| json!({"name": name, "reason": why}))
                .collect();
        }
        // Remote sources: what they are and which version is served (the
        // counters change while mounted: they are in ctl.json).
        let remote: Vec<Value> = b
            .source_files()
            .into_iter()
            .filter_map(super::ctl::remote_identity_json)
            .collect();
        if !remote.is_empty() {
            v["remote"] = json!(remote);
        }
        v["views"] = views_value(b, &ns.formats, &ns.views, &ns.precision);
        v["views"]["hf"] = hf_value(ns);
        v["version"] = json!(env!("CARGO_PKG_VERSION"));
        let mut doc = serde_json::to_string_pretty(&v).unwrap_or_default();
        doc.push('\n');
        let doc = crate::text::escape_json_text(doc);
        let marker = serde_json::to_string(PLACEHOLDER).unwrap_or_default();
        let n = b.tensors().len();
        let (head, tail) = match doc.split_once(&marker) {
            Some((h, t)) if n > 0 => (format!("{h}[\n"), format!("\n  ]{t}")),
            Some((h, t)) => (format!("{h}[]"), t.to_string()),
            None => (doc, String::new()),
        };
        let mut starts = Vec::with_capacity(n + 1);
        let mut at = 0u64;
        for i in 0..n {
            starts.push(at);
            let e = tensor_value(b, i, &ns.formats, ns);
            at += render_element(&e, i + 1 == n).len() as u64;
        }
        starts.push(at);
        IndexJson {
            head: head.into_bytes(),
            tail: tail.into_bytes(),
            starts,
            formats: ns.formats.clone(),
        }
    }

    pub(super) fn len(&self) -> u64 {
        self.head.len() as u64 + self.starts.last().copied().unwrap_or(0) + self.tail.len() as u64
    }

    /// Bytes `[offset, offset + size)` of the document.
    pub(super) fn read(&self, b: &dyn Backend, ns: &Namespace, offset: u64, size: u32) -> Vec<u8> {
        let end = self.len().min(offset.saturating_add(u64::from(size)));
        let mut out = Vec::new();
        if offset >= end {
            return out;
        }
        let head_len = self.head.len() as u64;
        let list_len = self.starts.last().copied().unwrap_or(0);
        // Head.
        if offset < head_len {
            out.extend_from_slice(&self.head[offset as usize..end.min(head_len) as usize]);
        }
        // Tensor elements overlapping [offset, end) (list-relative).
        let (lo, hi) = (
            offset.saturating_sub(head_len),
            end.saturating_sub(head_len).min(list_len),
        );
        if lo < hi {
            let n = self.starts.len() - 1;
            // First element whose end is past `lo`.
            let first = self.starts[1..].partition_point(|&e| e <= lo);
            for i in first..n {
                let (s, e) = (self.starts[i], self.starts[i + 1]);
                if s >= hi {
                    break;
                }
                let bytes = render_element(&tensor_value(b, i, &self.formats, ns), i + 1 == n);
                let a = lo.max(s) - s;
                let z = hi.min(e) - s;
                // Rendering is deterministic; guard anyway so a mismatch
                // can never index out of bounds.
                let z = z.min(bytes.len() as u64);
                if a < z {
                    out.extend_from_slice(&bytes[a as usize..z as usize]);
                }
            }
        }
        // Tail.
        let tail_start = head_len + list_len;
        if end > tail_start {
            let a = offset.max(tail_start) - tail_start;
            let z = end - tail_start;
            out.extend_from_slice(&self.tail[a as usize..z as usize]);
        }
        out
    }
}
