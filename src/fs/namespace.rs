//! What the mount shows: inodes, names, attributes, directory listings.
//!
//! Nothing here holds a string per file: a tensor file's name is its
//! tensor's name (from the backend's table) plus the format's extension,
//! looked up through the table's name index and listed by position, so a
//! model with tens of thousands of tensors costs a few bytes per tensor
//! (an `ls` of it pages through positions, it never clones a listing).
//! A checkpoint's Hugging Face names ([`super::aliases`]) are listed after
//! the tensor files, in the same slots per name.

use std::path::Path;
use std::time::SystemTime;

use super::aliases::{AliasFile, Aliases};
use super::elem::ElemFormat;
use super::files::{MAX_FILE_BYTES, TensorFile, ViewFile, view_metadata};
use super::hf::{self, HfDir};
use super::inodes::{
    CTL_INO, CTL_JSON_INO, CTL_JSON_NAME, CTL_NAME, FIRST_TENSOR_INO, FORMAT_INO_STRIDE,
    HF_DIR_INO, HF_DIR_NAME, INDEX_INO, INDEX_NAME, JOB_INO_BASE, JOBS_DIR_INO, JOBS_DIR_NAME,
    ROOT_INO, alias_of, is_hf_ino, tensor_ino,
};
use super::precision::{Precision, served_format};
use super::views::{self, Layout, ModelView, ViewTensor};
use super::{Attr, FsConfig, Kind, StatFs, TensorFs};
use crate::backend::{Availability, Backend, TensorInfo};
use crate::format::FileFormat;
use crate::format::meta::Metadata;

/// What an inode with tensor bytes is.
pub(super) enum Node<'a> {
    /// Tensor file `f` served in `fmt`.
    Tensor {
        f: usize,
        fmt: ElemFormat,
    },
    View(&'a ViewFile, &'a Layout),
    /// An HF-named file in Hugging Face row order, its bytes `Layout`.
    Alias(&'a AliasFile, &'a Layout),
    /// `model.native.gguf`: stored bytes, verbatim (`fs::native_read`).
    Native(&'a ViewFile, &'a Layout),
}

/// The namespace of one mount.
pub(super) struct Namespace {
    /// Tensor formats served, f32 first.
    pub(super) formats: Vec<ElemFormat>,
    /// The requested model views, offered or not, in listing order.
    pub(super) views: Vec<ViewFile>,
    /// Root entries that are not tensor files, in listing order.
    fixed: Vec<(&'static str, u64)>,
    /// Backend table index -> tensor file number, for served tensors.
    file_of: Vec<Option<usize>>,
    /// Available tensors that get no file, and why (index.json lists them).
    pub(super) unserved: Vec<(String, String)>,
    pub(super) root_mtime: SystemTime,
    /// Newest of the source files: the model views mix them.
    pub(super) views_mtime: SystemTime,
    jobs: bool,
    /// `hf/` (its JSON files; its safetensors views are in `views`), or why
    /// there is none.
    pub(super) hf: std::result::Result<HfDir, String>,
    /// The dtype of `model.safetensors` and `hf/`, and what rounds where.
    pub(super) precision: Precision,
    /// A checkpoint's Hugging Face names of its GGUF-named tensors.
    pub(super) aliases: Aliases,
}

fn mtime_of(path: &Path) -> SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Chunk length in elements for a tensor: a whole number of the backend's
/// decode granules when a granule fits in a chunk, so chunk edges do not
/// split a granule.
fn chunk_elems_for(granule: u64, chunk_bytes: u64) -> u64 {
    let target = (chunk_bytes / 4).max(1);
    if granule > 0 && granule <= target {
        target / granule * granule
    } else {
        target
    }
}

/// The served tensors (available, and small enough for `stat`) as files,
/// and the available ones left out with the reason.
pub(super) fn tensor_files(
    b: &dyn Backend,
    config: &FsConfig,
) -> (Vec<TensorFile>, Vec<(String, String)>) {
    let mut files = Vec::new();
    let mut unserved = Vec::new();
    for (i, t) in b.tensors().entries().iter().enumerate() {
        if !t.is_available() {
            continue;
        }
        // n_elements * 4 fits u64 (TensorTable::push checks it).
        if t.served_bytes() > MAX_FILE_BYTES {
            unserved.push((
                t.name.dot.clone(),
                format!(
                    "its {} bytes of f32 exceed the largest file size stat can report \
                     (2^63 - 1 bytes)",
                    t.served_bytes()
                ),
            ));
            continue;
        }
        files.push(TensorFile {
            index: i,
            n_elements: t.n_elements,
            chunk_elems: chunk_elems_for(t.granule, config.chunk_bytes),
            mtime: mtime_of(&t.origin.path),
            nlink: if t.name.dot == t.name.underscore {
                1
            } else {
                2
            },
        });
    }
    (files, unserved)
}

/// Build the model views `requested` from shapes and metadata (no tensor is
/// decoded). A view that cannot be offered records why.
pub(super) fn build_views(
    b: &dyn Backend,
    files: &[TensorFile],
    requested: &[ModelView],
    main: ElemFormat,
) -> Vec<ViewFile> {
    let entries = b.tensors().entries();
    let tensors = view_tensors(entries, files);
    let unavailable: Vec<&TensorInfo> = entries.iter().filter(|t| !t.is_available()).collect();
    let (md, _) = view_metadata(b);
    let st_formats: Vec<ElemFormat> = requested
        .iter()
        .filter_map(|v| match v {
            ModelView::Safetensors(f) => Some(served_format(*f, main)),
            ModelView::Gguf | ModelView::NativeGguf | ModelView::Hf(_) => None,
        })
        .collect();
    // In `requested` order.
    let mut st = views::safetensors_all(&tensors, md, &st_formats).into_iter();
    let mut out = Vec::new();
    for &view in requested {
        let built = match view {
            ModelView::Safetensors(_) => match st.next() {
                Some(r) => r.map_err(|e| e.to_string()),
                None => Err("internal error: safetensors view not built".to_string()),
            },
            ModelView::Gguf => ModelGap::of(md, &tensors, &unavailable)
                .gguf_refusal()
                .map_or_else(|| views::gguf(&tensors, md).map_err(|e| e.to_string()), Err),
            ModelView::NativeGguf => ModelGap::of(md, &tensors, &unavailable)
                .gguf_refusal()
                .map_or_else(
                    || {
                        let infos: Vec<&TensorInfo> =
                            files.iter().map(|f| &entries[f.index]).collect();
                        views::native_gguf(b, &infos, &tensors, md).map_err(|e| e.to_string())
                    },
                    Err,
                ),
            // Built by `hf::build`.
            ModelView::Hf(_) => continue,
        };
        let mut notes = Vec::new();
        if !unavailable.is_empty() && !matches!(view, ModelView::Gguf | ModelView::NativeGguf) {
            notes.push(format!(
                "{} unavailable tensor(s) left out: {}",
                unavailable.len(),
                name_list(&unavailable)
            ));
        }
        let layout = built.map(|b| {
            notes.extend(b.notes);
            b.layout
        });
        if let Err(why) = &layout {
            log::info!("{} is not offered: {why}", view.name());
        }
        out.push(ViewFile {
            view,
            layout,
            notes,
        });
    }
    out
}

fn name_list(ts: &[&TensorInfo]) -> String {
    let mut names: Vec<&str> = ts.iter().take(8).map(|t| t.name.dot.as_str()).collect();
    if ts.len() > 8 {
        names.push("...");
    }
    names.join(", ")
}

/// The served tensors as the view builders see them.
fn view_tensors<'a>(entries: &'a [TensorInfo], files: &[TensorFile]) -> Vec<ViewTensor<'a>> {
    files
        .iter()
        .enumerate()
        .map(|(f, tf)| {
            let t = &entries[tf.index];
            ViewTensor {
                file: f,
                name: &t.name.dot,
                shape: &t.shape,
                n_elements: t.n_elements,
                rows: None,
                runs: &[],
            }
        })
        .collect()
}

/// What the model lacks for llama.cpp to load it: the one computation
/// behind `model.gguf`'s absence (ctl, index.json) and the mount's refusal
/// of a partial model ([`partial_model`]).
struct ModelGap<'a> {
    md: &'a Metadata,
    /// Key/values llama.cpp needs that the metadata lacks.
    keys: Vec<String>,
    /// Listed tensors that cannot be served.
    unavailable: &'a [&'a TensorInfo],
    /// What the served tensors lack (names, or "tensors of N of the M
    /// blocks").
    tensors: Vec<String>,
}

impl<'a> ModelGap<'a> {
    fn of(
        md: &'a Metadata,
        tensors: &[ViewTensor],
        unavailable: &'a [&'a TensorInfo],
    ) -> ModelGap<'a> {
        let names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
        ModelGap {
            md,
            keys: views::gguf_missing_keys(md),
            unavailable,
            tensors: views::gguf_missing_tensors(md, &names),
        }
    }

    /// Why `model.gguf` cannot be offered, if it cannot: llama.cpp needs
    /// the run metadata and every tensor.
    fn gguf_refusal(&self) -> Option<String> {
        let md = self.md;
        if !self.keys.is_empty() {
            let hint = if md.is_empty() {
                " (the source carries no model key/values, e.g. a bare SK32: mount it with \
                 --dense MODEL.gguf)"
            } else {
                ""
            };
            return Some(format!(
                "the model metadata lacks {}, which llama.cpp needs to load the model{hint}",
                self.keys.join(", ")
            ));
        }
        if let Some(first) = self.unavailable.first() {
            return Some(format!(
                "{} tensor(s) cannot be served ({}: {}) and llama.cpp needs every tensor",
                self.unavailable.len(),
                name_list(self.unavailable),
                unavailable_reason(first)
            ));
        }
        if !self.tensors.is_empty() {
            return Some(format!(
                "the served tensors lack {}, which llama.cpp needs to build the model (a \
                 compressed file alone carries only what it compresses: mount it with \
                 --dense MODEL.gguf)",
                self.tensors.join(" and ")
            ));
        }
        None
    }
}

fn unavailable_reason(t: &TensorInfo) -> &str {
    match &t.availability {
        Availability::Unavailable(w) => w.as_str(),
        Availability::Available => "",
    }
}

/// A source that holds only part of a model, mounted without what
/// completes it: what is missing, and why `model.gguf` and `hf/` are not
/// offered (as ctl and index.json say).
#[derive(Debug, Clone)]
pub struct PartialModel {
    /// What is missing: counted, the first few named.
    pub missing: Vec<String>,
    /// Why the source lacks it.
    pub why: String,
    /// Why `model.gguf` is not offered.
    pub gguf: String,
    /// Why `hf/` is not offered (None: it is).
    pub hf: Option<String>,
    /// Whether a dense fallback is attached already (it then lacks the
    /// tensors too).
    pub has_fallback: bool,
}

/// Whether `b`, a compressed source (SK32, .rknot), cannot serve its model
/// whole because part of it is missing: tensors listed but unservable,
/// tensors a model with complete metadata lacks, or a bare SK32 (sketched matrices
/// only, no metadata). A compressed file without model metadata that lacks
/// nothing it lists is a set of tensors, not a partial model; a dense file
/// (GGUF, .knot) is never partial: None.
pub fn partial_model(b: &dyn Backend) -> Option<PartialModel> {
    let (files, _) = tensor_files(b, &FsConfig::default());
    let entries = b.tensors().entries();
    let tensors = view_tensors(entries, &files);
    let unavailable: Vec<&TensorInfo> = entries.iter().filter(|t| !t.is_available()).collect();
    let (md, _) = view_metadata(b);
    let gap = ModelGap::of(md, &tensors, &unavailable);
    let gguf = gap.gguf_refusal()?;
    // A dense file serves what it holds: whatever it lacks, nothing of it
    // is elsewhere.
    let format = b.summary().format;
    if !matches!(format, FileFormat::Sk32 | FileFormat::Rknot) {
        return None;
    }
    let has_fallback = b.fallback_summary().is_some();
    let bare_sketch = format == FileFormat::Sk32 && !has_fallback;
    // Missing tensors count only for metadata that describes a model
    // llama.cpp could load (a synthetic set of tensors under an
    // architecture name is not one).
    let lacks_tensors = gap.keys.is_empty() && !gap.tensors.is_empty();
    if unavailable.is_empty() && !lacks_tensors && !bare_sketch {
        return None;
    }
    let mut missing = Vec::new();
    if !unavailable.is_empty() {
        missing.push(format!(
            "{} tensor(s) that cannot be served ({})",
            unavailable.len(),
            name_list(&unavailable)
        ));
    }
    // A tensor listed but unservable is missing from the served ones too:
    // named once.
    let lacked: Vec<&str> = gap
        .tensors
        .iter()
        .map(String::as_str)
        .filter(|n| !unavailable.iter().any(|t| t.name.dot == *n))
        .collect();
    if !lacked.is_empty() {
        missing.push(lacked.join(" and "));
    }
    if bare_sketch && !gap.keys.is_empty() {
        missing.push(format!(
            "{} model key/value(s) ({})",
            gap.keys.len(),
            gap.keys.join(", ")
        ));
    }
    let why = if bare_sketch {
        "an SK32 file holds only the low-rank sketches of the weight matrices: no embeddings, \
         norms or model metadata"
            .to_string()
    } else if let Some(first) = unavailable.first() {
        unavailable_reason(first).to_string()
    } else if has_fallback {
        "the dense fallback does not supply them either (it must be the GGUF the source was \
         encoded from)"
            .to_string()
    } else {
        format!(
            "a .{} written with --compressed-only holds only the matrices it compresses",
            format.name()
        )
    };
    let hf = hf::build(b, &files, &[], ElemFormat::F32).dir.err();
    Some(PartialModel {
        missing,
        why,
        gguf,
        hf,
        has_fallback,
    })
}

/// The model views built, and the dtype choice their notes come from.
pub(super) struct ServedViews {
    pub(super) views: Vec<ViewFile>,
    pub(super) precision: Precision,
}

impl Namespace {
    pub(super) fn new(
        b: &dyn Backend,
        files: &[TensorFile],
        unserved: Vec<(String, String)>,
        formats: Vec<ElemFormat>,
        views: ServedViews,
        hf: std::result::Result<HfDir, String>,
        jobs: bool,
    ) -> Namespace {
        let ServedViews { views, precision } = views;
        // ctl.json is the read-only status (0444, whoever may command the
        // mount): every mount has one, with or without jobs.
        let mut fixed = vec![
            (INDEX_NAME, INDEX_INO),
            (CTL_NAME, CTL_INO),
            (CTL_JSON_NAME, CTL_JSON_INO),
        ];
        if jobs {
            fixed.push((JOBS_DIR_NAME, JOBS_DIR_INO));
        }
        for v in views
            .iter()
            .filter(|v| v.layout.is_ok() && !v.view.in_hf_dir())
        {
            fixed.push((v.view.name(), v.view.ino()));
        }
        if hf.is_ok() {
            fixed.push((HF_DIR_NAME, HF_DIR_INO));
        }
        let mut file_of = vec![None; b.tensors().len()];
        for (f, tf) in files.iter().enumerate() {
            file_of[tf.index] = Some(f);
        }
        let aliases = Aliases::build(b, files, &formats);
        let root_mtime = mtime_of(&b.summary().path);
        let views_mtime = b
            .fallback_summary()
            .map_or(root_mtime, |f| root_mtime.max(mtime_of(&f.path)));
        Namespace {
            formats,
            views,
            fixed,
            file_of,
            unserved,
            root_mtime,
            views_mtime,
            jobs,
            hf,
            precision,
            aliases,
        }
    }

    /// `hf/`'s entries in listing order: its JSON files, then its offered
    /// safetensors views.
    pub(super) fn hf_entries(&self) -> Vec<(&'static str, u64)> {
        let Ok(dir) = &self.hf else {
            return Vec::new();
        };
        let mut out: Vec<(&'static str, u64)> = dir.files.iter().map(|f| (f.name, f.ino)).collect();
        out.extend(
            self.offered_views()
                .filter(|(v, _)| v.view.in_hf_dir())
                .map(|(v, _)| (v.view.file_name(), v.view.ino())),
        );
        out
    }

    /// Whether tensor `index` of the backend's table has files.
    pub(super) fn is_served(&self, index: usize) -> bool {
        self.file_of.get(index).is_some_and(Option::is_some)
    }

    /// Offered model views.
    pub(super) fn offered_views(&self) -> impl Iterator<Item = (&ViewFile, &Layout)> {
        self.views
            .iter()
            .filter_map(|v| v.layout.as_ref().ok().map(|l| (v, l)))
    }

    /// Listing position of the first tensor file name.
    fn first_tensor_slot(&self) -> u64 {
        2 + self.fixed.len() as u64
    }

    /// Listing slots per tensor file: two names (underscore, dot) per format.
    fn slots_per_file(&self) -> u64 {
        2 * self.formats.len() as u64
    }
}

impl TensorFs {
    /// The JSON file of `hf/` behind an inode.
    pub(super) fn hf_file(&self, ino: u64) -> Option<&hf::HfFile> {
        if !is_hf_ino(ino) {
            return None;
        }
        self.ns.hf.as_ref().ok()?.file(ino)
    }

    /// The tensor file or offered model view behind an inode.
    pub(super) fn node(&self, ino: u64) -> Option<Node<'_>> {
        if let Some((f, fmt)) = alias_of(ino) {
            let a = self.ns.aliases.of_file(f)?;
            let k = self.ns.formats.iter().position(|x| *x == fmt)?;
            return a.layouts.get(k).map(|l| Node::Alias(a, l));
        }
        if let Some(v) = self.ns.views.iter().find(|v| v.view.ino() == ino) {
            return v.layout.as_ref().ok().map(|l| {
                if v.view == ModelView::NativeGguf {
                    Node::Native(v, l)
                } else {
                    Node::View(v, l)
                }
            });
        }
        let fmt = ElemFormat::from_ordinal(ino / FORMAT_INO_STRIDE)?;
        if !self.ns.formats.contains(&fmt) {
            return None;
        }
        let f = usize::try_from((ino % FORMAT_INO_STRIDE).checked_sub(FIRST_TENSOR_INO)?).ok()?;
        (f < self.shared.files.len()).then_some(Node::Tensor { f, fmt })
    }

    pub fn getattr(&self, ino: u64) -> std::result::Result<Attr, i32> {
        let base = Attr {
            ino,
            size: 0,
            kind: Kind::File,
            perm: 0o444,
            nlink: 1,
            uid: self.config.uid,
            gid: self.config.gid,
            mtime: self.ns.root_mtime,
        };
        // Live files: size 0, read with direct I/O (like /proc), owned by
        // the daemon's user (they are its control interface, see ctl.rs).
        let live = Attr {
            uid: self.ctl.owner.0,
            gid: self.ctl.owner.1,
            mtime: SystemTime::now(),
            ..base
        };
        match ino {
            ROOT_INO => Ok(Attr {
                kind: Kind::Dir,
                perm: 0o555,
                nlink: 2,
                ..base
            }),
            INDEX_INO => Ok(Attr {
                size: self.index.len(),
                ..base
            }),
            CTL_INO => Ok(Attr {
                perm: 0o600,
                ..live
            }),
            CTL_JSON_INO => Ok(live),
            JOBS_DIR_INO if self.ns.jobs => Ok(Attr {
                kind: Kind::Dir,
                perm: 0o555,
                nlink: 2,
                ..live
            }),
            HF_DIR_INO if self.ns.hf.is_ok() => Ok(Attr {
                kind: Kind::Dir,
                perm: 0o555,
                nlink: 2,
                mtime: self.ns.views_mtime,
                ..base
            }),
            _ if let Some(f) = self.hf_file(ino) => Ok(Attr {
                size: f.len(),
                mtime: self.ns.views_mtime,
                ..base
            }),
            _ if self.job_of(ino).is_some() => Ok(live),
            _ => match self.node(ino).ok_or(libc::ENOENT)? {
                Node::Tensor { f, fmt } => {
                    let file = &self.shared.files[f];
                    Ok(Attr {
                        size: file.bytes(fmt),
                        nlink: file.nlink + self.ns.aliases.extra_links(f),
                        mtime: file.mtime,
                        ..base
                    })
                }
                Node::Alias(a, l) => Ok(Attr {
                    size: l.size(),
                    nlink: 2,
                    mtime: self.shared.files[a.file].mtime,
                    ..base
                }),
                Node::View(_, l) | Node::Native(_, l) => Ok(Attr {
                    size: l.size(),
                    mtime: self.ns.views_mtime,
                    ..base
                }),
            },
        }
    }

    pub fn lookup(&self, parent: u64, name: &str) -> std::result::Result<Attr, i32> {
        if parent == JOBS_DIR_INO && self.ns.jobs {
            let id: u64 = name.parse().map_err(|_| libc::ENOENT)?;
            return self.getattr(JOB_INO_BASE.checked_add(id).ok_or(libc::ENOENT)?);
        }
        if parent == HF_DIR_INO && self.ns.hf.is_ok() {
            let &(_, ino) = self
                .ns
                .hf_entries()
                .iter()
                .find(|(n, _)| *n == name)
                .ok_or(libc::ENOENT)?;
            return self.getattr(ino);
        }
        if parent != ROOT_INO {
            return Err(libc::ENOENT);
        }
        if let Some(&(_, ino)) = self.ns.fixed.iter().find(|(n, _)| *n == name) {
            return self.getattr(ino);
        }
        // `<tensor name>.<ext>`, in exactly the two listed spellings.
        let (stem, ext) = name.rsplit_once('.').ok_or(libc::ENOENT)?;
        let fmt = ElemFormat::from_ext(ext)
            .filter(|f| self.ns.formats.contains(f))
            .ok_or(libc::ENOENT)?;
        if let Some(a) = self.ns.aliases.get(stem) {
            return self.getattr(a.ino(fmt));
        }
        let table = self.shared.backend.tensors();
        let index = table.get(stem).ok_or(libc::ENOENT)?;
        let t = &table.entries()[index];
        if stem != t.name.dot && stem != t.name.underscore {
            return Err(libc::ENOENT);
        }
        let f = self.ns.file_of[index].ok_or(libc::ENOENT)?;
        self.getattr(tensor_ino(f, fmt))
    }

    /// List directory `ino` from position `offset` (0: the start), calling
    /// `add(next_offset, ino, kind, name)` for each entry until it returns
    /// true (the reply is full). Positions are stable for the life of the
    /// mount, so a listing read in several calls is consistent.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(u64, u64, Kind, &str) -> bool,
    ) -> std::result::Result<(), i32> {
        if ino == JOBS_DIR_INO && self.ns.jobs {
            // Positions: 0 ".", 1 "..", 2 + id for job `id`.
            if offset == 0 && add(1, JOBS_DIR_INO, Kind::Dir, ".") {
                return Ok(());
            }
            if offset <= 1 && add(2, ROOT_INO, Kind::Dir, "..") {
                return Ok(());
            }
            if let Some(jobs) = &self.jobs {
                for j in jobs.jobs() {
                    let pos = j.id.saturating_add(2);
                    if pos >= offset
                        && add(pos + 1, JOB_INO_BASE + j.id, Kind::File, &j.id.to_string())
                    {
                        return Ok(());
                    }
                }
            }
            return Ok(());
        }
        if ino == HF_DIR_INO && self.ns.hf.is_ok() {
            // Positions: 0 ".", 1 "..", 2 + k for entry k.
            if offset == 0 && add(1, HF_DIR_INO, Kind::Dir, ".") {
                return Ok(());
            }
            if offset <= 1 && add(2, ROOT_INO, Kind::Dir, "..") {
                return Ok(());
            }
            for (k, (name, ino)) in self.ns.hf_entries().into_iter().enumerate() {
                let pos = k as u64 + 2;
                if pos >= offset && add(pos + 1, ino, Kind::File, name) {
                    return Ok(());
                }
            }
            return Ok(());
        }
        if ino != ROOT_INO {
            return Err(if self.getattr(ino).is_ok() {
                libc::ENOTDIR
            } else {
                libc::ENOENT
            });
        }
        let mut pos = offset;
        if pos == 0 {
            if add(1, ROOT_INO, Kind::Dir, ".") {
                return Ok(());
            }
            pos = 1;
        }
        if pos == 1 {
            if add(2, ROOT_INO, Kind::Dir, "..") {
                return Ok(());
            }
            pos = 2;
        }
        let first = self.ns.first_tensor_slot();
        while pos < first {
            let (name, ino) = self.ns.fixed[(pos - 2) as usize];
            let kind = if ino == JOBS_DIR_INO || ino == HF_DIR_INO {
                Kind::Dir
            } else {
                Kind::File
            };
            if add(pos + 1, ino, kind, name) {
                return Ok(());
            }
            pos += 1;
        }
        let per_file = self.ns.slots_per_file();
        let table = self.shared.backend.tensors().entries();
        let n_files = self.shared.files.len();
        let mut name = String::new();
        loop {
            let slot = pos - first;
            let f = (slot / per_file) as usize;
            let k = ((slot % per_file) / 2) as usize;
            let dot = slot % 2 == 1;
            let fmt = self.ns.formats[k];
            // The tensor files, then the HF-named ones.
            let (names, ino) = match self.shared.files.get(f) {
                Some(file) => (&table[file.index].name, tensor_ino(f, fmt)),
                None => match self.ns.aliases.at(f - n_files) {
                    Some(a) => (&a.name, a.ino(fmt)),
                    None => return Ok(()),
                },
            };
            // The underscore slot is empty when both spellings are equal.
            if dot || names.underscore != names.dot {
                name.clear();
                name.push_str(if dot { &names.dot } else { &names.underscore });
                name.push('.');
                name.push_str(fmt.ext());
                if add(pos + 1, ino, Kind::File, &name) {
                    return Ok(());
                }
            }
            pos += 1;
        }
    }

    pub fn statfs(&self) -> StatFs {
        let per_elem: u64 = self.ns.formats.iter().map(|f| f.bytes()).sum();
        let tensors = self.shared.files.iter().fold(0u64, |a, f| {
            a.saturating_add(f.n_elements.saturating_mul(per_elem))
        });
        let served = self
            .ns
            .offered_views()
            .map(|(_, l)| l)
            .chain(self.ns.aliases.permuted().flat_map(|a| &a.layouts))
            .fold(tensors, |a, l| a.saturating_add(l.size()));
        let permuted = self.ns.aliases.permuted().count();
        StatFs {
            blocks: served.div_ceil(4096),
            files: 3
                + ((self.shared.files.len() + permuted) * self.ns.formats.len()) as u64
                + self.ns.offered_views().count() as u64
                + self.ns.hf.as_ref().map_or(0, |d| 1 + d.files.len() as u64),
            bsize: 4096,
            namelen: 255,
        }
    }

    /// Number of tensor file names (both spellings, every format, HF
    /// names included).
    pub(super) fn n_tensor_names(&self) -> usize {
        let per_format: usize = self.shared.files.iter().map(|f| f.nlink as usize).sum();
        (per_format + 2 * self.ns.aliases.len()) * self.ns.formats.len()
    }

    /// The inodes of the HF-named files with rows of their own.
    pub(super) fn alias_inodes(&self) -> impl Iterator<Item = u64> + '_ {
        self.ns
            .aliases
            .permuted()
            .flat_map(|a| self.ns.formats.iter().map(|fmt| a.ino(*fmt)))
    }
}
