//! A whole checkpoint: its shards (one file, or those an index names),
//! each checked against the index, and the files beside it that describe
//! the model (`config.json`, the tokenizer's), each its own
//! [`SourceFile`] named next to the file opened: a local directory, or the
//! same "directory" of an `http(s)://` or `s3://` URL.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::index::{self, Index};
use super::{INDEX_SUFFIX, SafetensorsFile, file_name};
use crate::error::{ErrorKind, Result, err};
use crate::source::SourceFile;

/// Largest `config.json`, `tokenizer.json`, ... read (a 256k-token
/// `tokenizer.json` is ~35 MB).
pub const MAX_SIDE_FILE_BYTES: u64 = 64 << 20;

/// How the checkpoint was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointKind {
    /// One `.safetensors` file.
    Single,
    /// An index and the shards it names.
    Sharded,
}

/// A file beside the weights, read whole at open.
pub struct SideFile {
    pub file: SourceFile,
    pub bytes: Vec<u8>,
}

/// Every file of one checkpoint, validated.
pub struct Checkpoint {
    pub kind: CheckpointKind,
    /// The index, for a sharded checkpoint.
    pub index: Option<SourceFile>,
    /// Each shard and its header (one, for a single file), in name order.
    pub shards: Vec<(SourceFile, SafetensorsFile)>,
    pub config: Option<SideFile>,
    pub tokenizer: Option<SideFile>,
    pub tokenizer_config: Option<SideFile>,
    pub generation_config: Option<SideFile>,
    /// What was looked for and not found, for `inspect`.
    pub notes: Vec<String>,
}

/// A checkpoint from one `.safetensors` file. A file named as a shard
/// (`model-00001-of-00003.safetensors`) opens the whole checkpoint when
/// its index is beside it (and is refused when not: one shard is a
/// fraction of a model).
pub fn open_single(src: SourceFile) -> Result<Checkpoint> {
    let name = file_name(&src);
    if let Some(stem) = shard_stem(&name) {
        let index_name = format!("{stem}{INDEX_SUFFIX}");
        let index = src.open_sibling(&index_name).map_err(|e| {
            err(
                ErrorKind::BadValue,
                format!(
                    "{name} is one shard of a sharded checkpoint, and its index {index_name} \
                     beside it could not be opened ({}): open the index (or the directory) to \
                     serve the whole model",
                    e.message()
                ),
            )
            .path(src.path())
        })?;
        return open_index(index);
    }
    let header = SafetensorsFile::read(&src)?;
    let mut c = with_side_files(&src, CheckpointKind::Single)?;
    c.shards.push((src, header));
    Ok(c)
}

/// `model-00001-of-00003.safetensors` -> `model`.
fn shard_stem(name: &str) -> Option<&str> {
    let rest = name.strip_suffix(".safetensors")?;
    let (rest, count) = rest.rsplit_once("-of-")?;
    let (stem, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(no) && digits(count)).then_some(stem)
}

/// A checkpoint from its index: every shard it names opened and read,
/// and each tensor found in the shard the index says, exactly once.
pub fn open_index(src: SourceFile) -> Result<Checkpoint> {
    let Index { weight_map, shards } = index::read(&src)?;
    let mut c = with_side_files(&src, CheckpointKind::Sharded)?;
    let mut opened = Vec::with_capacity(shards.len());
    for name in &shards {
        let f = src.open_sibling(name).map_err(|e| {
            err(
                e.kind(),
                format!(
                    "shard {name:?}, which the index names, could not be opened: {}",
                    e.message()
                ),
            )
            .path(&src.path().with_file_name(name))
        })?;
        let header = SafetensorsFile::read(&f)?;
        opened.push((f, header));
    }
    let wanted: HashMap<&str, &str> = weight_map
        .iter()
        .map(|(t, s)| (t.as_str(), s.as_str()))
        .collect();
    let mut found: HashMap<&str, &str> = HashMap::new();
    for ((f, h), name) in opened.iter().zip(&shards) {
        for t in &h.tensors {
            match wanted.get(t.name.as_str()) {
                Some(s) if *s == name.as_str() => {
                    found.insert(t.name.as_str(), name.as_str());
                }
                Some(s) => {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!("shard {name:?} holds the tensor, which the index puts in {s:?}"),
                    )
                    .tensor(&t.name)
                    .path(f.path())
                    .at(t.header_at));
                }
                None => {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!("shard {name:?} holds the tensor, which the index does not name"),
                    )
                    .tensor(&t.name)
                    .path(f.path())
                    .at(t.header_at));
                }
            }
        }
    }
    for (t, s) in &weight_map {
        if !found.contains_key(t.as_str()) {
            return Err(err(
                ErrorKind::NotFound,
                format!("the index puts the tensor in shard {s:?}, which does not hold it"),
            )
            .tensor(t)
            .path(src.path()));
        }
    }
    c.shards = opened;
    c.index = Some(src);
    Ok(c)
}

/// The checkpoint's description files next to `of`, those present (each
/// opened as `of` was: a remote one with the same options).
fn with_side_files(of: &SourceFile, kind: CheckpointKind) -> Result<Checkpoint> {
    let mut notes = Vec::new();
    let mut absent = Vec::new();
    let mut side = |name: &str| -> Result<Option<SideFile>> {
        let remote = crate::source::is_remote(&of.path().to_string_lossy());
        if !remote && !of.path().with_file_name(name).exists() {
            absent.push(name.to_string());
            return Ok(None);
        }
        let file = match of.open_sibling(name) {
            Ok(f) => f,
            // A remote listing is not asked for: a file that does not
            // open is taken as absent, and said so.
            Err(e) if remote => {
                notes.push(format!("no {name} beside the weights ({})", e.message()));
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        if file.len() > MAX_SIDE_FILE_BYTES {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "{name} is {} bytes, over the {MAX_SIDE_FILE_BYTES}-byte cap",
                    file.len()
                ),
            )
            .path(file.path()));
        }
        let bytes = file.read_vec(0, file.len(), name)?;
        Ok(Some(SideFile { file, bytes }))
    };
    let config = side("config.json")?;
    let tokenizer = side("tokenizer.json")?;
    let tokenizer_config = side("tokenizer_config.json")?;
    let generation_config = side("generation_config.json")?;
    if !absent.is_empty() {
        notes.push(format!("not beside the weights: {}", absent.join(", ")));
    }
    Ok(Checkpoint {
        kind,
        index: None,
        shards: Vec::new(),
        config,
        tokenizer,
        tokenizer_config,
        generation_config,
        notes,
    })
}

/// The member of a local directory that opens its checkpoint, as
/// transformers looks: `model.safetensors`, else
/// `model.safetensors.index.json`, else the one `*.safetensors.index.json`
/// or the one unsharded `*.safetensors` there is. None: no checkpoint.
pub fn dir_member(dir: &Path) -> Result<Option<PathBuf>> {
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(Some(p));
        }
    }
    let mut indexes = Vec::new();
    let mut singles = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| crate::Error::io(dir, "list", e))?;
    for e in entries {
        let e = e.map_err(|e| crate::Error::io(dir, "list", e))?;
        let name = e.file_name().to_string_lossy().to_string();
        if name.ends_with(INDEX_SUFFIX) {
            indexes.push(e.path());
        } else if name.ends_with(".safetensors") && shard_stem(&name).is_none() {
            singles.push(e.path());
        }
    }
    let pick = |mut v: Vec<PathBuf>, what: &str| -> Result<Option<PathBuf>> {
        v.sort();
        match v.len() {
            0 => Ok(None),
            1 => Ok(v.pop()),
            _ => Err(err(
                ErrorKind::BadValue,
                format!(
                    "the directory holds {} {what}: name the one to open",
                    v.len()
                ),
            )
            .path(dir)),
        }
    };
    match pick(indexes, "safetensors indexes")? {
        Some(p) => Ok(Some(p)),
        None => pick(singles, ".safetensors files")?.map_or(Ok(None), |p| Ok(Some(p))),
    }
}
