//! Open any supported file by sniffing its first bytes: the table of
//! readers ([`READERS`]), the one place a kind of file is registered.

use std::path::{Path, PathBuf};

use crate::backend::{Backend, DenseBackend, LayeredBackend, RknotBackend, Role, SketchBackend};
use crate::error::{ErrorKind, Result, err};
use crate::format;
use crate::format::container::{self, KNOT_PREFIX_LEN, read_container};
use crate::format::gguf::split::GgufSplit;
use crate::format::gguf::{self, GgufFile};
use crate::format::knot::DenseKnotFile;
use crate::format::rknot::RknotFile;
use crate::format::safetensors::{self, Checkpoint, checkpoint};
use crate::format::sk32::Sk32File;
use crate::source::SourceFile;

/// A file whose header was read and validated, before it becomes a
/// backend (`rknot verify` checks the stored blocks through it).
pub enum ParsedFile {
    Rknot(SourceFile, RknotFile),
    Sk32(SourceFile, Sk32File),
    DenseKnot(SourceFile, DenseKnotFile),
    Gguf(SourceFile, GgufFile),
    /// A split GGUF set, every shard read and checked: one model.
    GgufSplit(GgufSplit),
    /// A Hugging Face checkpoint: its shards, index and description files.
    Safetensors(Box<Checkpoint>),
}

/// A reader of one kind of file, as opening sees it: how its first bytes
/// are recognised ([`format::Detect`], next to the format's reader) and
/// how its header is read into a [`ParsedFile`]
/// ([`ParsedFile::into_backend`] then picks the backend). Every kind of
/// file opens through this one seam: a new kind (safetensors, a split GGUF
/// set) is its reader module in `format/`, its [`ParsedFile`] variant and
/// backend arm, and one entry in [`READERS`]; no other reader changes.
pub struct Reader {
    /// The kind's name, for people (the formats a kind yields are
    /// `FileFormat`s).
    pub name: &'static str,
    pub detect: format::Detect,
    /// Read and validate the header of `src`.
    pub parse: fn(SourceFile) -> Result<ParsedFile>,
}

/// Every reader, tried in this order: the first whose `detect` says yes
/// reads the file. Their magics are disjoint; a reader that refines
/// another (split GGUF sets are GGUF) goes before it.
pub const READERS: &[Reader] = &[
    Reader {
        name: "rknot",
        detect: format::is_rknot,
        parse: |src| {
            let f = RknotFile::read(&src)?;
            Ok(ParsedFile::Rknot(src, f))
        },
    },
    Reader {
        name: "knot",
        detect: container::is_knot,
        parse: parse_knot,
    },
    Reader {
        name: "gguf",
        detect: gguf::is_gguf,
        parse: |src| {
            let g = GgufFile::read(&src)?;
            // A shard is never served alone: it opens its whole set.
            if gguf::split::is_shard(&g, src.path())? {
                return Ok(ParsedFile::GgufSplit(GgufSplit::open(src, g)?));
            }
            Ok(ParsedFile::Gguf(src, g))
        },
    },
    // Magic-less, so after every reader with a magic.
    Reader {
        name: "safetensors index",
        detect: safetensors::is_index,
        parse: |src| {
            Ok(ParsedFile::Safetensors(Box::new(checkpoint::open_index(
                src,
            )?)))
        },
    },
    Reader {
        name: "safetensors",
        detect: safetensors::is_safetensors,
        parse: |src| {
            Ok(ParsedFile::Safetensors(Box::new(checkpoint::open_single(
                src,
            )?)))
        },
    },
];

/// A reader of a local directory that holds one model's files (a split
/// GGUF set, a Hugging Face checkpoint): it names the member that opens
/// the whole model through [`READERS`] (a set's first shard, a
/// checkpoint's index), so a directory is opened as that member is. A new
/// kind of directory is one entry in [`DIR_READERS`].
pub struct DirReader {
    /// What it looks for, for people ("a split GGUF set").
    pub name: &'static str,
    /// The member of the directory that opens its model, None when the
    /// directory holds nothing of this kind.
    pub member: fn(&Path) -> Result<Option<PathBuf>>,
}

/// Every directory reader; a directory two of them claim is refused
/// (the user names the file).
pub const DIR_READERS: &[DirReader] = &[
    DirReader {
        name: "a GGUF file or split GGUF set",
        member: gguf::split::dir_member,
    },
    DirReader {
        name: "a Hugging Face safetensors checkpoint",
        member: checkpoint::dir_member,
    },
];

/// The path to open for `path`: itself, or for a local directory the
/// member one [`DirReader`] names. A directory no reader claims is left
/// as it is (opening it then says it is a directory).
pub fn resolve_dir(path: &Path) -> Result<PathBuf> {
    if !std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return Ok(path.to_path_buf());
    }
    let mut found = Vec::new();
    for r in DIR_READERS {
        if let Some(member) = (r.member)(path)? {
            found.push((r.name, member));
        }
    }
    match found.as_slice() {
        [] => Ok(path.to_path_buf()),
        [(_, member)] => Ok(member.clone()),
        [..] => Err(err(
            ErrorKind::BadValue,
            format!(
                "the directory holds more than one model ({}): name the file to open",
                found
                    .iter()
                    .map(|(what, m)| format!("{what}: {}", m.display()))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )
        .path(path)),
    }
}

/// The reader of `src`, from its first bytes.
pub fn reader_of(src: &SourceFile) -> Result<&'static Reader> {
    let mut head = [0u8; format::HEAD_BYTES];
    let n = format::read_head(src, &mut head)?;
    let head = &head[..n];
    for r in READERS {
        if (r.detect)(src, head)? {
            return Ok(r);
        }
    }
    Err(format::bad_magic(src.path(), head))
}

/// One KNOT container: SK32 (a `sketches` map) or dense .knot (a `tensors`
/// map).
fn parse_knot(src: SourceFile) -> Result<ParsedFile> {
    let c = read_container(&src)?;
    match (c.has_sketches(), c.has_tensors()) {
        (true, false) => {
            let f = Sk32File::from_container(&src, &c)?;
            Ok(ParsedFile::Sk32(src, f))
        }
        (false, true) => {
            let f = DenseKnotFile::from_container(&src, &c)?;
            Ok(ParsedFile::DenseKnot(src, f))
        }
        (both, _) => Err(err(
            ErrorKind::BadJson,
            if both {
                "KNOT meta has both a \"sketches\" and a \"tensors\" map"
            } else {
                "KNOT meta has neither a \"sketches\" map (SK32) nor a \
                 \"tensors\" map (dense .knot)"
            },
        )
        // The source's name, redacted for a remote object: the path as
        // given may be a presigned URL with its signature.
        .path(src.path())
        .at(KNOT_PREFIX_LEN)),
    }
}

impl ParsedFile {
    /// Sniff `path` (a file, or a directory a [`DirReader`] claims) and
    /// read its header.
    pub fn open(path: &Path) -> Result<ParsedFile> {
        let src = SourceFile::open(&resolve_dir(path)?)?;
        (reader_of(&src)?.parse)(src)
    }

    /// The backend serving this file in `role`.
    pub fn into_backend(self, role: Role) -> Result<Box<dyn Backend>> {
        let backend: Box<dyn Backend> = match self {
            ParsedFile::Rknot(src, f) => Box::new(RknotBackend::new(src, f, role)?),
            ParsedFile::Sk32(src, f) => Box::new(SketchBackend::new(src, f, role)?),
            ParsedFile::DenseKnot(src, f) => Box::new(DenseBackend::from_knot(src, f, role)?),
            ParsedFile::Gguf(src, g) => Box::new(DenseBackend::from_gguf(src, g, role)?),
            ParsedFile::GgufSplit(set) => Box::new(DenseBackend::from_gguf_split(set, role)?),
            ParsedFile::Safetensors(c) => Box::new(super::safetensors::from_checkpoint(*c, role)?),
        };
        super::declare_extents(backend.as_ref());
        Ok(backend)
    }
}

/// Open one file as a backend in the given role.
pub fn open_single(path: &Path, role: Role) -> Result<Box<dyn Backend>> {
    ParsedFile::open(path)?.into_backend(role)
}

/// Open a source and an optional dense fallback, the way the mount and the
/// CLI do: a compressed primary (SK32, .rknot) is always served through the
/// layered backend (so its vocab rule applies even without a fallback); a
/// dense source alone is served directly.
pub fn open(path: &Path, dense: Option<&Path>) -> Result<Box<dyn Backend>> {
    let (primary, fallback) = open_parts(path, dense)?;
    assemble(primary, fallback)
}

/// A primary and its optional dense fallback, each opened on its own.
pub type Parts = (Box<dyn Backend>, Option<Box<dyn Backend>>);

/// The two halves of [`open`], each file on its own: a caller that must
/// look at every tensor of each file (a manifest's header check, which
/// counts a primary's tensors that the layered table leaves out) does so
/// between this and [`assemble`].
pub fn open_parts(path: &Path, dense: Option<&Path>) -> Result<Parts> {
    let primary = open_single(path, Role::Primary)?;
    let fallback = match dense {
        Some(d) => {
            let fb = open_single(d, Role::Fallback)?;
            if fb.summary().format.is_primary_kind() {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "the fallback must be a dense file (GGUF or dense .knot), this is {}",
                        fb.summary().format
                    ),
                )
                .path(d));
            }
            Some(fb)
        }
        None => None,
    };
    Ok((primary, fallback))
}

/// What [`open`] serves from the files [`open_parts`] opened.
pub fn assemble(
    primary: Box<dyn Backend>,
    fallback: Option<Box<dyn Backend>>,
) -> Result<Box<dyn Backend>> {
    log::debug!(
        "opened {} ({}, {} tensors){}",
        primary.summary().path.display(),
        primary.summary().format,
        primary.tensors().len(),
        fallback.as_ref().map_or(String::new(), |f| format!(
            " over fallback {} ({}, {} tensors)",
            f.summary().path.display(),
            f.summary().format,
            f.tensors().len()
        ))
    );
    if fallback.is_none() && !primary.summary().format.is_primary_kind() {
        return Ok(primary);
    }
    Ok(Box::new(LayeredBackend::new(primary, fallback)?))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn bad_magic_prints_path_and_bytes() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"PK\x03\x04zz").unwrap();
        let e = reader_of(&SourceFile::open(f.path()).unwrap())
            .map(|r| r.name)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadMagic);
        let s = e.to_string();
        assert!(s.contains("[80, 75, 3, 4, 122, 122]"), "{s}");
        assert!(s.contains(&f.path().display().to_string()), "{s}");
    }

    #[test]
    fn sniffs_short_and_versioned() {
        for (bytes, want) in [
            (&b"GGUF\x03\x00"[..], Ok("gguf")),
            (b"KNOT\x01\x00", Ok("knot")),
            (b"RKNOT\x02", Ok("rknot")),
            (b"RKNOT\x03", Ok("rknot")),
            (b"RKNOT\x04", Err(ErrorKind::UnsupportedVersion)),
            (b"", Err(ErrorKind::BadMagic)),
            (b"GG", Err(ErrorKind::BadMagic)),
        ] {
            let mut f = tempfile::NamedTempFile::new().unwrap();
            f.write_all(bytes).unwrap();
            let got = reader_of(&SourceFile::open(f.path()).unwrap())
                .map(|r| r.name)
                .map_err(|e| e.kind());
            assert_eq!(got, want, "{bytes:?}");
        }
    }
}
