//! Where the probe's fp32 weights come from: a backend (exactly the code
//! path the mount decodes with) or a mounted rknot directory (the `.f32`
//! files the kernel serves, listed in `index.json`).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::backend::{self, Backend};
use crate::error::{Error, ErrorKind, Result, err};
use crate::format::meta::Metadata;
use crate::names;
use crate::report;

/// A set of named fp32 tensors plus the model's key/values.
pub trait WeightSource: Send + Sync {
    /// Served shape (outer dimension first), or None if there is no such
    /// tensor. Names are GGUF dot spellings.
    fn shape(&self, name: &str) -> Option<Vec<u64>>;

    /// Decode elements `[first_elem, first_elem + out.len())` of the
    /// tensor (row-major over its served shape) into `out`.
    fn read_into(&self, name: &str, first_elem: u64, out: &mut [f32]) -> Result<()>;

    /// The model's key/values (architecture; the tokenizer where present).
    fn metadata(&self) -> &Metadata;

    /// One line saying what this is, for reports.
    fn describe(&self) -> String;

    /// Stored bits per weight over the tensors the probe reads (None when
    /// the source cannot say).
    fn bits_per_weight(&self, names: &[String]) -> Option<f64>;

    /// Anything else the report should say (where the tokenizer came from).
    fn note(&self) -> Option<String> {
        None
    }
}

/// Weights decoded by a backend: `backend::open(path, dense)`.
pub struct BackendSource {
    pub backend: Box<dyn Backend>,
    label: String,
}

impl BackendSource {
    pub fn open(path: &Path, dense: Option<&Path>) -> Result<BackendSource> {
        let backend = backend::open(path, dense)?;
        let s = backend.summary();
        let mut label = format!("{} ({} v{})", s.path.display(), s.format, s.version);
        if let Some(f) = backend.fallback_summary() {
            label += &format!(" over {} ({} v{})", f.path.display(), f.format, f.version);
        }
        Ok(BackendSource { backend, label })
    }
}

impl WeightSource for BackendSource {
    fn shape(&self, name: &str) -> Option<Vec<u64>> {
        let b: &dyn Backend = self.backend.as_ref();
        let i = b.tensors().get(name)?;
        b.tensors().info(i).map(|t| t.shape.clone())
    }

    fn read_into(&self, name: &str, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let b: &dyn Backend = self.backend.as_ref();
        let i = b.find(name)?;
        b.read_f32(i, first_elem, out).map_err(|e| e.tensor(name))
    }

    fn metadata(&self) -> &Metadata {
        report::effective_metadata(self.backend.as_ref())
    }

    fn describe(&self) -> String {
        self.label.clone()
    }

    fn bits_per_weight(&self, names: &[String]) -> Option<f64> {
        let t = self.backend.tensors();
        let (mut bytes, mut elems) = (0u64, 0u64);
        for n in names {
            let info = t.info(t.get(n)?)?;
            bytes = bytes.saturating_add(info.stored_bytes);
            elems = elems.saturating_add(info.n_elements);
        }
        (elems > 0).then(|| bytes as f64 * 8.0 / elems as f64)
    }
}

struct MountTensor {
    shape: Vec<u64>,
    file: PathBuf,
    stored_bytes: Option<u64>,
}

/// A mounted rknot directory: `index.json` for names, shapes and the
/// architecture keys; the `.f32` files for the weights.
///
/// `index.json` leaves out metadata arrays longer than 1024 entries (the
/// vocab), so the tokenizer comes from `tokenizer_from` when given, else
/// from the source files `index.json` names (their key/values only; no
/// weight is read from them).
pub struct MountSource {
    dir: PathBuf,
    tensors: HashMap<String, MountTensor>,
    metadata: Metadata,
    tokenizer_note: String,
}

fn bad_index(dir: &Path, msg: impl Into<String>) -> Error {
    err(ErrorKind::BadJson, msg).path(&dir.join("index.json"))
}

impl MountSource {
    pub fn is_mount_dir(path: &Path) -> bool {
        path.is_dir() && path.join("index.json").is_file()
    }

    pub fn open(dir: &Path, tokenizer_from: Option<&Path>) -> Result<MountSource> {
        let index_path = dir.join("index.json");
        let bytes = std::fs::read(&index_path)
            .map_err(|e| Error::io(&index_path, "reading the mount's index", e))?;
        let index: Value =
            serde_json::from_slice(&bytes).map_err(|e| bad_index(dir, format!("not JSON: {e}")))?;
        let list = index
            .get("tensors")
            .and_then(Value::as_array)
            .ok_or_else(|| bad_index(dir, "no \"tensors\" array"))?;
        let mut tensors = HashMap::new();
        for (i, t) in list.iter().enumerate() {
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad_index(dir, format!("tensors[{i}] has no \"name\"")))?;
            if t.get("available") == Some(&Value::Bool(false)) {
                continue;
            }
            let shape = t
                .get("shape")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                .ok_or_else(|| bad_index(dir, format!("tensor {name:?} has no valid \"shape\"")))?;
            // The dot spelling's file; the index's own list when it has one.
            let file = t
                .get("files")
                .and_then(Value::as_array)
                .and_then(|f| f.last())
                .and_then(Value::as_str)
                .map_or_else(|| format!("{name}.f32"), str::to_string);
            if file.contains('/') {
                return Err(bad_index(
                    dir,
                    format!("tensor {name:?} names file {file:?}"),
                ));
            }
            tensors.insert(
                names::canonical(name),
                MountTensor {
                    shape,
                    file: dir.join(file),
                    stored_bytes: t.get("stored_bytes").and_then(Value::as_u64),
                },
            );
        }
        // Metadata minus the arrays the index left out.
        let mut md_json = index.get("metadata").cloned().unwrap_or(Value::Null);
        if let Some(obj) = md_json.as_object_mut() {
            obj.retain(|_, v| v.get("omitted") != Some(&Value::Bool(true)));
        } else {
            return Err(bad_index(dir, "no \"metadata\" object"));
        }
        let mut metadata =
            Metadata::from_json(&md_json).map_err(|e| e.path(&dir.join("index.json")))?;
        let tokenizer_note = merge_tokenizer_keys(&mut metadata, &index, tokenizer_from)?;
        Ok(MountSource {
            dir: dir.to_path_buf(),
            tensors,
            metadata,
            tokenizer_note,
        })
    }

    /// Where the tokenizer key/values came from.
    pub fn tokenizer_note(&self) -> &str {
        &self.tokenizer_note
    }
}

/// Copy the `tokenizer.*` keys the index omitted from a model file: the
/// one given, else the first of the index's fallback and source files that
/// has a vocab. Returns a note for the report; no file with a vocab is not
/// an error here (`--tokens` needs none).
fn merge_tokenizer_keys(md: &mut Metadata, index: &Value, given: Option<&Path>) -> Result<String> {
    let candidates: Vec<PathBuf> = match given {
        Some(p) => vec![p.to_path_buf()],
        None => ["fallback", "source"]
            .iter()
            .filter_map(|k| index.get(*k)?.get("path")?.as_str().map(PathBuf::from))
            .collect(),
    };
    for path in &candidates {
        let opened = match BackendSource::open(path, None) {
            Ok(b) => b,
            // A named --tokenizer file must open; the index's own paths may
            // be relative to another directory or gone.
            Err(e) if given.is_some() => return Err(e),
            Err(_) => continue,
        };
        let src = opened.metadata();
        if src.get("tokenizer.ggml.tokens").is_none() {
            continue;
        }
        for (k, v) in &src.entries {
            if k.starts_with("tokenizer.") {
                md.entries.retain(|(mk, _)| mk != k);
                md.push(k.clone(), v.clone());
            }
        }
        return Ok(format!("tokenizer key/values from {}", path.display()));
    }
    if let Some(p) = given {
        return Err(err(
            ErrorKind::BadValue,
            "tokenizer: this file has no tokenizer.ggml.tokens",
        )
        .path(p));
    }
    Ok(
        "no tokenizer: index.json omits the vocab and no source file named there has one \
        (use --tokenizer FILE or --tokens)"
            .to_string(),
    )
}

impl WeightSource for MountSource {
    fn shape(&self, name: &str) -> Option<Vec<u64>> {
        self.tensors.get(name).map(|t| t.shape.clone())
    }

    fn read_into(&self, name: &str, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let t = self.tensors.get(name).ok_or_else(|| {
            err(ErrorKind::NotFound, format!("no tensor named {name:?}")).path(&self.dir)
        })?;
        let f = File::open(&t.file).map_err(|e| Error::io(&t.file, "open", e))?;
        let elems = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let want = elems.and_then(|n| n.checked_mul(4));
        let end = first_elem.checked_add(out.len() as u64);
        if end.is_none_or(|e| Some(e) > elems) {
            return Err(err(
                ErrorKind::Range,
                format!(
                    "elements {first_elem}+{} outside the index's shape {:?}",
                    out.len(),
                    t.shape
                ),
            )
            .path(&t.file)
            .tensor(name));
        }
        let size = f
            .metadata()
            .map_err(|e| Error::io(&t.file, "stat", e))?
            .len();
        if Some(size) != want {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "file has {size} bytes, the index's shape {:?} needs 4 per element",
                    t.shape
                ),
            )
            .path(&t.file)
            .tensor(name));
        }
        // The served bytes are little-endian f32: read them straight into
        // the output and fix the byte order only on big-endian hosts.
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        f.read_exact_at(bytes, first_elem * 4)
            .map_err(|e| Error::io(&t.file, "read", e).tensor(name))?;
        if cfg!(target_endian = "big") {
            for v in out.iter_mut() {
                *v = f32::from_bits(u32::from_le(v.to_bits()));
            }
        }
        Ok(())
    }

    fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    fn describe(&self) -> String {
        format!(
            "mount {} ({} tensor files)",
            self.dir.display(),
            self.tensors.len()
        )
    }

    fn note(&self) -> Option<String> {
        Some(self.tokenizer_note.clone())
    }

    fn bits_per_weight(&self, names: &[String]) -> Option<f64> {
        let (mut bytes, mut elems) = (0u64, 0u64);
        for n in names {
            let t = self.tensors.get(n)?;
            bytes = bytes.saturating_add(t.stored_bytes?);
            elems = elems.saturating_add(t.shape.iter().product::<u64>());
        }
        (elems > 0).then(|| bytes as f64 * 8.0 / elems as f64)
    }
}

/// Open SOURCE: a mounted rknot directory, or any model file (plus an
/// optional dense fallback) through `backend::open`.
pub fn open_source(
    path: &Path,
    dense: Option<&Path>,
    tokenizer_from: Option<&Path>,
) -> Result<Box<dyn WeightSource>> {
    if MountSource::is_mount_dir(path) {
        if dense.is_some() {
            return Err(err(
                ErrorKind::BadValue,
                "--dense applies to model files; a mount already serves its fallback's tensors",
            )
            .path(path));
        }
        return Ok(Box::new(MountSource::open(path, tokenizer_from)?));
    }
    let src = BackendSource::open(path, dense)?;
    if let Some(t) = tokenizer_from {
        // Same rule as for mounts: the tokenizer keys of another file.
        let mut md = src.metadata().clone();
        let note = merge_tokenizer_keys(&mut md, &Value::Null, Some(t))?;
        return Ok(Box::new(WithMetadata {
            inner: src,
            md,
            note,
        }));
    }
    Ok(Box::new(src))
}

/// A source whose key/values were completed from another file.
struct WithMetadata {
    inner: BackendSource,
    md: Metadata,
    note: String,
}

impl WeightSource for WithMetadata {
    fn shape(&self, name: &str) -> Option<Vec<u64>> {
        self.inner.shape(name)
    }
    fn read_into(&self, name: &str, first_elem: u64, out: &mut [f32]) -> Result<()> {
        self.inner.read_into(name, first_elem, out)
    }
    fn metadata(&self) -> &Metadata {
        &self.md
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn bits_per_weight(&self, names: &[String]) -> Option<f64> {
        self.inner.bits_per_weight(names)
    }
    fn note(&self) -> Option<String> {
        Some(self.note.clone())
    }
}
