//! One error type for the whole library.
//!
//! Every error that comes from a file says which file, and where it can,
//! which tensor and which byte offset. `kind` is a stable classification
//! that tests and callers match on; the message is for people.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Stable classification of a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The OS said no (open, pread, metadata).
    Io,
    /// The first bytes are not any format we know.
    BadMagic,
    /// A version field we do not read.
    UnsupportedVersion,
    /// The file ends before a structure it declares.
    Truncated,
    /// An offset/length points outside the file or its section.
    OutOfBounds,
    /// Size arithmetic on values from the file overflowed u64.
    Overflow,
    /// A count, length or size is larger than any sane file (checked before
    /// anything is allocated from it).
    TooLarge,
    /// Header JSON is not valid JSON, not an object, or misses a field.
    BadJson,
    /// A tensor type / dtype name or id we do not know.
    UnknownType,
    /// A known ggml type this build does not decode.
    UnsupportedType,
    /// SK32/.knot codec byte other than 0 (raw).
    UnsupportedCodec,
    /// Rank 0 or rank > min(d_out, d_in).
    BadRank,
    /// Shape that is empty, zero-sized, or inconsistent with the type.
    BadShape,
    /// A declared length disagrees with what the type and shape imply.
    LengthMismatch,
    /// NaN or infinite scale / max.
    NonFinite,
    /// Two stored tensors map to the same name (after aliasing), or a name
    /// that cannot be served as a file.
    BadName,
    /// Any other field value that violates the format's rules.
    BadValue,
    /// A primary tensor's shape disagrees with the fallback's.
    ShapeMismatch,
    /// No tensor of that name.
    NotFound,
    /// The tensor exists but cannot be served (e.g. vocab tensors in a
    /// sketch without a fallback).
    Unavailable,
    /// A read outside the tensor's decoded size.
    Range,
    /// The source file is no longer the version that was opened (rewritten
    /// in place, truncated, touched): its data may have moved, so nothing
    /// more is read from it. ESTALE at the filesystem.
    Changed,
    /// Stored bytes disagree with the checksum or digest recorded for them
    /// (in the file, or in a manifest): damaged or tampered, never served.
    Checksum,
}

/// The error type. Build with [`Error::new`] and the `path`/`tensor`/`at`
/// adders; `Display` prints `path: tensor NAME: at byte N: message`.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    path: Option<PathBuf>,
    tensor: Option<String>,
    offset: Option<u64>,
    message: String,
    source: Option<io::Error>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            path: None,
            tensor: None,
            offset: None,
            message: message.into(),
            source: None,
        }
    }

    pub fn io(path: &Path, what: &str, source: io::Error) -> Self {
        Error {
            kind: ErrorKind::Io,
            path: Some(path.to_path_buf()),
            tensor: None,
            offset: None,
            message: format!("{what}: {source}"),
            source: Some(source),
        }
    }

    /// Attach the file, unless one is already attached (the innermost
    /// layer knows best).
    pub fn path(mut self, path: &Path) -> Self {
        if self.path.is_none() {
            self.path = Some(path.to_path_buf());
        }
        self
    }

    pub fn tensor(mut self, name: &str) -> Self {
        if self.tensor.is_none() {
            self.tensor = Some(name.to_string());
        }
        self
    }

    /// Attach the absolute file offset the problem was found at.
    pub fn at(mut self, offset: u64) -> Self {
        if self.offset.is_none() {
            self.offset = Some(offset);
        }
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn file(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn tensor_name(&self) -> Option<&str> {
        self.tensor.as_deref()
    }

    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The errno a filesystem should answer with for this error.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::Range => libc::EINVAL,
            // "Stale file handle": what the reader holds no longer matches
            // the file. FUSE passes it through to read(2) unchanged (tested
            // in tests/sources.rs), and unlike EIO it tells the operator
            // that the data is fine and the mount is out of date.
            ErrorKind::Changed => libc::ESTALE,
            _ => libc::EIO,
        }
    }
}

/// Paths, tensor names and messages come from files and users: printed
/// through [`crate::text::escape`], so no control character reaches a
/// terminal or a log raw. (Escaping is idempotent on its own output, so a
/// log formatter that escapes again changes nothing.)
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use crate::text::Escaped;
        if let Some(p) = &self.path {
            write!(f, "{}: ", Escaped(&p.to_string_lossy()))?;
        }
        if let Some(t) = &self.tensor {
            write!(f, "tensor {}: ", Escaped(t))?;
        }
        if let Some(o) = self.offset {
            write!(f, "at byte {o}: ")?;
        }
        write!(f, "{}", Escaped(&self.message))
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Shorthand constructors used by the readers.
pub fn err(kind: ErrorKind, message: impl Into<String>) -> Error {
    Error::new(kind, message)
}

/// `a * b` on untrusted sizes.
pub fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("{what}: {a} * {b} overflows u64"),
        )
    })
}

/// `a + b` on untrusted sizes.
pub fn add(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("{what}: {a} + {b} overflows u64"),
        )
    })
}

/// Product of all dims, checked.
pub fn product(dims: &[u64], what: &str) -> Result<u64> {
    dims.iter().try_fold(1u64, |acc, &d| mul(acc, d, what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_file_tensor_offset() {
        let e = err(ErrorKind::OutOfBounds, "block past end")
            .tensor("blk.0.attn_q.weight")
            .at(1234)
            .path(Path::new("/x/m.rknot"));
        assert_eq!(
            e.to_string(),
            "/x/m.rknot: tensor blk.0.attn_q.weight: at byte 1234: block past end"
        );
        assert_eq!(e.kind(), ErrorKind::OutOfBounds);
        assert_eq!(e.errno(), libc::EIO);
    }

    #[test]
    fn display_escapes_control_characters() {
        let e = err(ErrorKind::BadName, "name \"a\x1b]0;x\x07\" refused")
            .tensor("t\r\u{9b}31m")
            .path(Path::new("/x/m\x1b[2J.gguf"));
        let s = e.to_string();
        assert!(!s.chars().any(crate::text::is_unsafe_char), "{s:?}");
        assert_eq!(
            s,
            "/x/m\\x1b[2J.gguf: tensor t\\r\\u{009b}31m: name \"a\\x1b]0;x\\x07\" refused"
        );
        // Escaping again (the log formatter does) changes nothing.
        assert_eq!(crate::text::escape(&s), s);
    }

    #[test]
    fn checked_arithmetic_reports_overflow() {
        assert_eq!(
            mul(u64::MAX, 2, "x").unwrap_err().kind(),
            ErrorKind::Overflow
        );
        assert_eq!(
            product(&[1 << 40, 1 << 40], "n").unwrap_err().kind(),
            ErrorKind::Overflow
        );
        assert_eq!(product(&[3, 4, 5], "n").unwrap(), 60);
    }
}
