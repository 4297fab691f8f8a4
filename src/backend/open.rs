//! Open any supported file by sniffing its first bytes.

use std::path::Path;

use crate::backend::{Backend, DenseBackend, LayeredBackend, RknotBackend, Role, SketchBackend};
use crate::error::{ErrorKind, Result, err};
use crate::format::container::{KNOT_PREFIX_LEN, read_container};
use crate::format::gguf::GgufFile;
use crate::format::knot::DenseKnotFile;
use crate::format::rknot::RknotFile;
use crate::format::sk32::Sk32File;
use crate::format::{self, Magic};
use crate::source::SourceFile;

/// A file whose header was read and validated, before it becomes a
/// backend (`rknot verify` checks the stored blocks through it).
pub enum ParsedFile {
    Rknot(SourceFile, RknotFile),
    Sk32(SourceFile, Sk32File),
    DenseKnot(SourceFile, DenseKnotFile),
    Gguf(SourceFile, GgufFile),
}

impl ParsedFile {
    /// Sniff `path` and read its header.
    pub fn open(path: &Path) -> Result<ParsedFile> {
        let src = SourceFile::open(path)?;
        Ok(match format::sniff(&src)? {
            Magic::Rknot => {
                let f = RknotFile::read(&src)?;
                ParsedFile::Rknot(src, f)
            }
            Magic::Gguf => {
                let g = GgufFile::read(&src)?;
                ParsedFile::Gguf(src, g)
            }
            Magic::Knot => {
                let c = read_container(&src)?;
                match (c.has_sketches(), c.has_tensors()) {
                    (true, false) => {
                        let f = Sk32File::from_container(&src, &c)?;
                        ParsedFile::Sk32(src, f)
                    }
                    (false, true) => {
                        let f = DenseKnotFile::from_container(&src, &c)?;
                        ParsedFile::DenseKnot(src, f)
                    }
                    (both, _) => {
                        return Err(err(
                            ErrorKind::BadJson,
                            if both {
                                "KNOT meta has both a \"sketches\" and a \"tensors\" map"
                            } else {
                                "KNOT meta has neither a \"sketches\" map (SK32) nor a \
                                 \"tensors\" map (dense .knot)"
                            },
                        )
                        .path(path)
                        .at(KNOT_PREFIX_LEN));
                    }
                }
            }
        })
    }

    /// The backend serving this file in `role`.
    pub fn into_backend(self, role: Role) -> Result<Box<dyn Backend>> {
        let backend: Box<dyn Backend> = match self {
            ParsedFile::Rknot(src, f) => Box::new(RknotBackend::new(src, f, role)?),
            ParsedFile::Sk32(src, f) => Box::new(SketchBackend::new(src, f, role)?),
            ParsedFile::DenseKnot(src, f) => Box::new(DenseBackend::from_knot(src, f, role)?),
            ParsedFile::Gguf(src, g) => Box::new(DenseBackend::from_gguf(src, g, role)?),
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
