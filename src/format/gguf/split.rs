//! Split GGUF sets: one model in several GGUF files ("shards"), as
//! llama.cpp's `llama-gguf-split` and gguf-py's
//! `GGUFWriter(split_max_tensors=...)` write them.
//!
//! A set of N shards is named `PREFIX-%05d-of-%05d.gguf` (1-based shard
//! number, then N: llama.cpp's `llama_split_path`), every shard is a whole
//! GGUF file with its own header and data section, and every shard's header
//! carries `split.no` (0-based), `split.count` (N) and `split.tensors.count`
//! (the tensors of the whole set). The model's metadata is shard 0's; the
//! others carry the split keys only (a `--no-tensor-first-split` set, or
//! gguf-py's `small_first_shard`, has a shard 0 with metadata and no
//! tensors).
//!
//! A set is one logical file: [`GgufSplit::open`] finds every member from
//! any one of them by name (each its own [`SourceFile`], so each remote
//! object is pinned on its own), reads each header with the validating
//! reader and checks that they are one set. A missing, extra, reordered,
//! duplicated or foreign shard is refused with an error naming it: never a
//! part of a model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::GgufFile;
use super::value::{MetaValue, Metadata};
use crate::error::{ErrorKind, Result, err};
use crate::format::MAX_TENSORS;
use crate::source::SourceFile;

/// The key of a shard's 0-based number.
pub const SPLIT_NO: &str = "split.no";
/// The key of the number of shards in the set.
pub const SPLIT_COUNT: &str = "split.count";
/// The key of the number of tensors in the whole set.
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";
/// The prefix of every split key (dropped from the set's metadata: views
/// are of the whole, unsplit model).
const SPLIT_PREFIX: &str = "split.";
/// Most shards in a set: llama.cpp stores `split.count` as a u16.
pub const MAX_SHARDS: u64 = u16::MAX as u64;

/// A shard's file name, parsed: `PREFIX-%05d-of-%05d.gguf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardName {
    pub prefix: String,
    /// 0-based (the name's number minus one).
    pub no: u64,
    pub count: u64,
}

impl ShardName {
    /// Parse a file name as llama.cpp writes it: both numbers at least 5
    /// digits, zero-padded to exactly 5 (or unpadded when longer), the
    /// shard number 1..=count. Anything else is not a shard's name.
    pub fn parse(file_name: &str) -> Option<ShardName> {
        let stem = file_name.strip_suffix(".gguf")?;
        let (head, count) = stem.rsplit_once("-of-")?;
        let (prefix, no) = head.rsplit_once('-')?;
        let number = |s: &str| -> Option<u64> {
            let v: u64 = s
                .parse()
                .ok()
                .filter(|_| s.bytes().all(|b| b.is_ascii_digit()))?;
            (format!("{v:05}") == s).then_some(v)
        };
        let (no, count) = (number(no)?, number(count)?);
        if prefix.is_empty() || no == 0 || no > count || count > MAX_SHARDS {
            return None;
        }
        Some(ShardName {
            prefix: prefix.to_string(),
            no: no - 1,
            count,
        })
    }

    /// The file name of shard `no` (0-based) of this name's set.
    pub fn of_shard(&self, no: u64) -> String {
        format!("{}-{:05}-of-{:05}.gguf", self.prefix, no + 1, self.count)
    }
}

/// One shard of a set: its file and its validated header.
#[derive(Debug)]
pub struct Shard {
    pub src: SourceFile,
    pub file: GgufFile,
}

/// A whole split set, checked: `shards[i]` has `split.no` i.
#[derive(Debug)]
pub struct GgufSplit {
    pub shards: Vec<Shard>,
}

/// An integer split key of `g`: None when absent, an error when it is not
/// a non-negative integer.
fn split_key(g: &GgufFile, key: &str, path: &Path) -> Result<Option<u64>> {
    match g.metadata.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("{key} is {}, not a non-negative integer", v.summary()),
            )
            .path(path)
        }),
    }
}

/// Whether `g` is a shard of a set of more than one file (`split.count` >
/// 1): such a file must be opened as its set, never alone.
pub fn is_shard(g: &GgufFile, path: &Path) -> Result<bool> {
    Ok(split_key(g, SPLIT_COUNT, path)?.is_some_and(|n| n > 1))
}

/// The file name of `path`'s last component (a local path, or a remote
/// object's redacted URL).
fn file_name(path: &Path) -> Option<&str> {
    path.file_name().and_then(|n| n.to_str())
}

impl GgufSplit {
    /// The whole set `first` (any shard, already read as `g`) belongs to:
    /// every member opened by name next to it and checked. Refused, naming
    /// the shard, when any member is missing or does not belong.
    pub fn open(first: SourceFile, g: GgufFile) -> Result<GgufSplit> {
        let path = first.path().to_path_buf();
        let count = split_key(&g, SPLIT_COUNT, &path)?.unwrap_or(1);
        let no = split_key(&g, SPLIT_NO, &path)?.ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("a shard of a split set ({SPLIT_COUNT} = {count}) without {SPLIT_NO}"),
            )
            .path(&path)
        })?;
        let name = file_name(&path).and_then(ShardName::parse).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!(
                    "shard {} of a split set of {count} ({SPLIT_NO} = {no}), but its name is \
                     not PREFIX-NNNNN-of-NNNNN.gguf: the other shards cannot be found (give \
                     the shards their names as written)",
                    no.saturating_add(1)
                ),
            )
            .path(&path)
        })?;
        if name.count != count || count > MAX_SHARDS {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "named as one of {} shards, but its {SPLIT_COUNT} is {count}: a shard of \
                     another set",
                    name.count
                ),
            )
            .path(&path));
        }
        check_no(no, name.no, &path)?;
        if !first.is_remote() {
            refuse_extra_shards(&path, &name)?;
        }
        let mut opened = Some(Shard {
            src: first,
            file: g,
        });
        let mut shards = Vec::with_capacity(count as usize);
        for i in 0..count {
            let shard = match (i == name.no).then(|| opened.take()).flatten() {
                Some(s) => s,
                None => open_member(&shards, opened.as_ref(), &name, i)?,
            };
            shards.push(shard);
        }
        let set = GgufSplit { shards };
        set.check(count)?;
        Ok(set)
    }

    /// Every shard against shard 0 and the set.
    fn check(&self, count: u64) -> Result<()> {
        let Some(first) = self.shards.first() else {
            return Err(err(ErrorKind::BadValue, "a split set of no shards"));
        };
        let path0 = first.src.path();
        let total: u64 = self
            .shards
            .iter()
            .map(|s| s.file.tensors.len() as u64)
            .sum();
        if total > MAX_TENSORS {
            return Err(crate::format::too_many_tensors("split GGUF set").path(path0));
        }
        let want = split_key(&first.file, SPLIT_TENSORS_COUNT, path0)?.ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("shard 1 of the split set has no {SPLIT_TENSORS_COUNT}"),
            )
            .path(path0)
        })?;
        let mut owner: HashMap<&str, usize> = HashMap::with_capacity(total as usize);
        for (i, s) in self.shards.iter().enumerate() {
            let p = s.src.path();
            let at = |what: String| err(ErrorKind::BadValue, what).path(p);
            if split_key(&s.file, SPLIT_COUNT, p)? != Some(count) {
                return Err(at(format!(
                    "{SPLIT_COUNT} is {}, the set's is {count}: a shard of another set",
                    shown(s.file.metadata.get(SPLIT_COUNT))
                )));
            }
            match split_key(&s.file, SPLIT_TENSORS_COUNT, p)? {
                Some(n) if n != want => {
                    return Err(at(format!(
                        "{SPLIT_TENSORS_COUNT} is {n}, shard 1's is {want}: a shard of another set"
                    )));
                }
                _ => {}
            }
            if i > 0 {
                agree_with_first(&first.file.metadata, &s.file.metadata, p)?;
            }
            for t in &s.file.tensors {
                if let Some(j) = owner.insert(&t.name, i) {
                    return Err(at(format!(
                        "tensor {:?} is in shard {} too ({}): a duplicated or foreign shard",
                        t.name,
                        j + 1,
                        self.shards[j].src.path().display()
                    ))
                    .tensor(&t.name));
                }
            }
        }
        if total != want {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "the {count} shards hold {total} tensors, but {SPLIT_TENSORS_COUNT} says \
                     {want}: a shard is missing tensors or belongs to another set"
                ),
            )
            .path(path0));
        }
        Ok(())
    }

    /// The model's metadata: shard 0's, without the split keys (it is
    /// served as one model).
    pub fn metadata(&self) -> Metadata {
        let entries = self.shards.first().map_or_else(Vec::new, |s| {
            s.file
                .metadata
                .entries
                .iter()
                .filter(|(k, _)| !k.starts_with(SPLIT_PREFIX))
                .cloned()
                .collect()
        });
        Metadata { entries }
    }
}

fn shown(v: Option<&MetaValue>) -> String {
    v.map_or_else(|| "absent".to_string(), MetaValue::summary)
}

/// `split.no` against the number the name gives.
fn check_no(no: u64, named: u64, path: &Path) -> Result<()> {
    if no != named {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "named as shard {}, but its {SPLIT_NO} is {no} (shard {}): a reordered, \
                 renamed or duplicated shard",
                named + 1,
                no.saturating_add(1)
            ),
        )
        .path(path));
    }
    Ok(())
}

/// Open and read shard `i` of `name`'s set, next to an opened member.
fn open_member(
    shards: &[Shard],
    pending: Option<&Shard>,
    name: &ShardName,
    i: u64,
) -> Result<Shard> {
    let Some(next_to) = pending.or(shards.first()) else {
        return Err(err(
            ErrorKind::BadValue,
            "a split set with no shard to start from",
        ));
    };
    let member = name.of_shard(i);
    let src = next_to.src.open_sibling(&member).map_err(|e| {
        let p = e.file().map_or_else(
            || next_to.src.path().with_file_name(&member),
            Path::to_path_buf,
        );
        err(
            e.kind(),
            format!(
                "shard {} of the split set of {} is missing or unreadable: {}",
                i + 1,
                name.count,
                e.message()
            ),
        )
        .path(&p)
    })?;
    let file = GgufFile::read(&src)?;
    let p = src.path();
    if !is_shard(&file, p)? {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "named as shard {} of {}, but it is not a shard of a split set ({SPLIT_COUNT} {})",
                i + 1,
                name.count,
                shown(file.metadata.get(SPLIT_COUNT))
            ),
        )
        .path(p));
    }
    let no = split_key(&file, SPLIT_NO, p)?
        .ok_or_else(|| err(ErrorKind::BadValue, format!("a shard without {SPLIT_NO}")).path(p))?;
    check_no(no, i, p)?;
    Ok(Shard { src, file })
}

/// Metadata a later shard carries must be shard 0's (llama.cpp's and
/// gguf-py's later shards carry the split keys only; a set assembled by
/// hand may carry more): `general.architecture` above all.
fn agree_with_first(first: &Metadata, other: &Metadata, path: &Path) -> Result<()> {
    for (k, v) in other
        .entries
        .iter()
        .filter(|(k, _)| !k.starts_with(SPLIT_PREFIX))
    {
        if let Some(v0) = first.get(k)
            && v0 != v
        {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "{k} is {}, shard 1's is {}: a shard of another model",
                    v.summary(),
                    v0.summary()
                ),
            )
            .path(path));
        }
    }
    Ok(())
}

/// A local directory's other files named as shards of `name`'s prefix but
/// not of its set (another count, or the same name twice): the set is
/// ambiguous, refused naming the file.
fn refuse_extra_shards(path: &Path, name: &ShardName) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        // The set's own members are opened by name next: an unreadable
        // directory fails there, naming the shard.
        return Ok(());
    };
    for e in entries.flatten() {
        let fname = e.file_name();
        let Some(other) = fname.to_str().and_then(ShardName::parse) else {
            continue;
        };
        if other.prefix == name.prefix && other.count != name.count {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "an extra shard next to a split set of {}: it names a set of {} with the \
                     same prefix {:?} (remove it, or move one set to its own directory)",
                    name.count, other.count, name.prefix
                ),
            )
            .path(&dir.join(&fname)));
        }
    }
    Ok(())
}

/// The GGUF model of a local directory, for `backend::open::DIR_READERS`:
/// its one `.gguf` file, or a shard of its one split set (shard 1 when it
/// is there; opening the set then names whatever is missing). None when it
/// holds no `.gguf`; an error naming them when it holds more than one
/// model.
pub fn dir_member(dir: &Path) -> Result<Option<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| crate::error::Error::io(dir, "list", e))?;
    // One model per (prefix, count) set, or per plain file.
    let mut models: Vec<(String, PathBuf)> = Vec::new();
    for e in entries {
        let e = e.map_err(|e| crate::error::Error::io(dir, "list", e))?;
        let fname = e.file_name();
        let Some(s) = fname.to_str() else { continue };
        if !s.ends_with(".gguf") || !e.path().is_file() {
            continue;
        }
        let key = match ShardName::parse(s) {
            Some(n) => format!("{}\0{}", n.prefix, n.count),
            None => format!("{s}\0"),
        };
        let path = e.path();
        match models.iter_mut().find(|(k, _)| *k == key) {
            // Shard 1 opens the set when it is there; else the lowest.
            Some((_, p)) => {
                if path.file_name() < p.file_name() {
                    *p = path;
                }
            }
            None => models.push((key, path)),
        }
    }
    models.sort_by(|a, b| a.1.cmp(&b.1));
    match models.as_slice() {
        [] => Ok(None),
        [(_, p)] => Ok(Some(p.clone())),
        [..] => Err(err(
            ErrorKind::BadValue,
            format!(
                "the directory holds more than one model ({}): name the file to open",
                models
                    .iter()
                    .map(|(k, p)| {
                        let what = if k.ends_with('\0') {
                            "a GGUF"
                        } else {
                            "a split GGUF set"
                        };
                        format!("{what}: {}", p.display())
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )
        .path(dir)),
    }
}

#[cfg(test)]
#[path = "split_tests.rs"]
mod tests;
