//! Manifests: SHA-256 digests of model files, of their headers and of every
//! tensor's stored bytes, in one text file that stock `sha256sum` reads.
//!
//! Format (docs/OPERATIONS.md, "Integrity -> Manifests"), one entry a line:
//!
//! ```text
//! <64 hex>  <basename>                          whole file (GNU sha256sum)
//! #rknot <64 hex>  <basename>//header           every byte in no tensor's stored ranges
//! #rknot <64 hex>  <basename>//tensor/<name>    a tensor's stored bytes, in format order
//! ```
//!
//! Why the header and tensor lines are `#` comments: GNU `sha256sum -c`
//! skips lines that start with `#`, also with `--strict`. A line
//! `<hex>  m.gguf//header` would not be skipped: opening `m.gguf//header`
//! fails with ENOTDIR (m.gguf is a file), which `--ignore-missing` does not
//! ignore (only ENOENT), so `sha256sum -c` would fail on every manifest.
//! With the prefix, `sha256sum -c OUT.sums` in the files' directory checks
//! the whole files with stock tools and passes; rknot reads all three kinds.
//! `//` cannot occur in a file's basename, so `<basename>//...` never names
//! a file.
//!
//! Names are written as GNU coreutils writes them: a name containing `\`,
//! a newline or a carriage return is written with `\\`, `\n`, `\r` and the
//! line (after `#rknot `, for rknot lines) starts with `\`.
//!
//! Parsing ([`Manifest::parse`]) is strict and bounded: at most
//! [`MAX_MANIFEST_BYTES`]; every line that is not empty, a comment or an
//! entry is an error naming the manifest and the line; so is a name listed
//! twice. Plain `SHA256SUMS` files (whole-file lines only, for any number
//! of files, `*name` binary-mode markers included) parse too.
//!
//! What uses it: `rknot manifest` ([`write_manifest`]), `rknot-mount
//! --manifest` ([`open_verified`], [`MountIntegrity`]) and
//! `rknot verify --manifest` ([`check_paths`]).

mod check;
mod digest;
mod guard;

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result, err};

pub use check::{Checked, Mismatch, Problem, check_backend, check_paths};
pub use digest::{
    FileDigests, READ_PIECE, TensorBytes, digest_file, digest_header, digest_ranges, digest_whole,
    tensor_bytes,
};
pub use guard::{FileCheck, IntegrityBackend, MountIntegrity, Unverified, open_verified};

/// A SHA-256 digest.
pub type Digest = [u8; 32];

/// The largest manifest read: a 65,536-tensor model's manifest is about
/// 10 MB, and what a manifest holds is kept in memory.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// What starts an rknot header or tensor line (module docs: why a comment).
pub const RKNOT_PREFIX: &str = "#rknot ";

/// Separates a file's basename from what of it a line digests.
pub const SEPARATOR: &str = "//";

/// What a manifest line digests, of the file it names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Subject {
    /// Every byte of the file.
    Whole,
    /// Every byte that lies in no tensor's stored ranges.
    Header,
    /// A tensor's stored bytes (its dot name).
    Tensor(String),
}

impl Subject {
    /// The part of the entry name after the basename (`//header`,
    /// `//tensor/NAME`), empty for the whole file.
    pub fn suffix(&self) -> String {
        match self {
            Subject::Whole => String::new(),
            Subject::Header => format!("{SEPARATOR}header"),
            Subject::Tensor(n) => format!("{SEPARATOR}tensor/{n}"),
        }
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::Whole => f.write_str("whole file"),
            Subject::Header => f.write_str("header"),
            Subject::Tensor(n) => write!(f, "tensor {}", crate::text::Escaped(n)),
        }
    }
}

/// One line of a manifest.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The file's name as listed: a basename for rknot lines; for
    /// whole-file lines whatever `sha256sum` was given (a leading `./`
    /// removed), which matches a file only when it is a basename.
    pub file: Vec<u8>,
    pub subject: Subject,
    pub digest: Digest,
    /// 1-based line number in the manifest.
    pub line: usize,
}

/// A parsed manifest.
#[derive(Debug, Clone)]
pub struct Manifest {
    path: PathBuf,
    entries: Vec<Entry>,
}

/// The lines of a manifest about one file.
#[derive(Debug, Default)]
pub struct FileEntries<'a> {
    pub whole: Option<&'a Entry>,
    pub header: Option<&'a Entry>,
    pub tensors: HashMap<&'a str, &'a Entry>,
}

impl FileEntries<'_> {
    /// No line names the file.
    pub fn is_empty(&self) -> bool {
        self.whole.is_none() && self.header.is_none() && self.tensors.is_empty()
    }

    /// Whether the file is checked per tensor (it has rknot lines), not
    /// only as a whole.
    pub fn per_tensor(&self) -> bool {
        self.header.is_some() || !self.tensors.is_empty()
    }
}

impl Manifest {
    /// Read and parse `path`, refusing a file over [`MAX_MANIFEST_BYTES`]
    /// before reading it whole.
    pub fn read(path: &Path) -> Result<Manifest> {
        let f =
            std::fs::File::open(path).map_err(|e| Error::io(path, "cannot open manifest", e))?;
        let mut bytes = Vec::new();
        f.take(MAX_MANIFEST_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, "cannot read manifest", e))?;
        Manifest::parse(&bytes, path)
    }

    /// Parse a manifest's bytes; `path` names it in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Manifest> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "manifest is larger than {} MiB; no model's manifest is",
                    MAX_MANIFEST_BYTES >> 20
                ),
            )
            .path(path));
        }
        let mut entries: Vec<Entry> = Vec::new();
        let mut seen: HashMap<(Vec<u8>, Subject), usize> = HashMap::new();
        // A last line without a newline is a line; the empty piece after a
        // final newline is not.
        let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
        if body.is_empty() {
            return Err(err(ErrorKind::BadValue, "manifest is empty").path(path));
        }
        for (n, raw) in body.split(|&b| b == b'\n').enumerate() {
            let line_no = n + 1;
            let at_line =
                |msg: String| err(ErrorKind::BadValue, format!("line {line_no}: {msg}")).path(path);
            // CRLF line endings: a CR that is part of a name is escaped.
            let line = raw.strip_suffix(b"\r").unwrap_or(raw);
            let entry = if let Some(rest) = line.strip_prefix(RKNOT_PREFIX.as_bytes()) {
                let (digest, name) = parse_digest_name(rest, false).map_err(at_line)?;
                let (file, subject) = split_rknot_name(&name).map_err(at_line)?;
                Entry {
                    file,
                    subject,
                    digest,
                    line: line_no,
                }
            } else if line.is_empty() || line.starts_with(b"#") {
                // Comments (sha256sum skips them too) and empty lines.
                continue;
            } else {
                let (digest, name) = parse_digest_name(line, true).map_err(at_line)?;
                let mut file: &[u8] = &name;
                while let Some(rest) = file.strip_prefix(b"./") {
                    file = rest;
                }
                if file.is_empty() {
                    return Err(at_line("the name is empty".into()));
                }
                Entry {
                    file: file.to_vec(),
                    subject: Subject::Whole,
                    digest,
                    line: line_no,
                }
            };
            let key = (entry.file.clone(), entry.subject.clone());
            if let Some(first) = seen.insert(key, line_no) {
                return Err(at_line(format!(
                    "{} is listed twice (first on line {first})",
                    display_name(&entry.file, &entry.subject)
                )));
            }
            entries.push(entry);
        }
        if entries.is_empty() {
            return Err(err(ErrorKind::BadValue, "manifest has no entries").path(path));
        }
        Ok(Manifest {
            path: path.to_path_buf(),
            entries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The lines about the file whose basename is `basename`.
    pub fn for_file(&self, basename: &[u8]) -> FileEntries<'_> {
        let mut out = FileEntries::default();
        for e in self.entries.iter().filter(|e| e.file == basename) {
            match &e.subject {
                Subject::Whole => out.whole = Some(e),
                Subject::Header => out.header = Some(e),
                Subject::Tensor(n) => {
                    out.tensors.insert(n.as_str(), e);
                }
            }
        }
        out
    }
}

/// `<hex>  <name>` (or, when `binary_ok`, `<hex> *<name>`), optionally
/// escaped (a leading `\`): the digest and the unescaped name.
fn parse_digest_name(
    line: &[u8],
    binary_ok: bool,
) -> std::result::Result<(Digest, Vec<u8>), String> {
    const SHAPE: &str = "expected a SHA-256 line: 64 hex digits, two spaces, a name";
    if line.starts_with(b"SHA256 (") || line.starts_with(b"\\SHA256 (") {
        return Err(format!(
            "BSD-style tagged line (sha256sum --tag); {SHAPE} (sha256sum without --tag)"
        ));
    }
    let (escaped, line) = match line.strip_prefix(b"\\") {
        Some(rest) => (true, rest),
        None => (false, line),
    };
    let hex_len = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if hex_len != 64 {
        return Err(if hex_len > 0 && line.get(hex_len) == Some(&b' ') {
            format!("a digest of {hex_len} hex digits is not SHA-256; {SHAPE}")
        } else {
            SHAPE.to_string()
        });
    }
    let mut digest = [0u8; 32];
    for (i, d) in digest.iter_mut().enumerate() {
        *d = (hex_val(line[2 * i]) << 4) | hex_val(line[2 * i + 1]);
    }
    let rest = &line[64..];
    let name = match rest {
        [b' ', b' ', name @ ..] => name,
        [b' ', b'*', name @ ..] if binary_ok => name,
        [b' ', b'*', ..] => return Err("rknot lines have no binary-mode marker '*'".into()),
        _ => return Err(SHAPE.to_string()),
    };
    if name.is_empty() {
        return Err("the name is empty".into());
    }
    if name.contains(&0) {
        return Err("the name contains a NUL byte".into());
    }
    let name = if escaped {
        unescape(name)?
    } else {
        name.to_vec()
    };
    Ok((digest, name))
}

fn hex_val(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        b'A'..=b'F' => b - b'A' + 10,
        // Only called on ASCII hex digits.
        _ => 0,
    }
}

/// GNU coreutils' escaping, undone: `\\`, `\n`, `\r`.
fn unescape(name: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(name.len());
    let mut it = name.iter();
    while let Some(&b) = it.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        match it.next() {
            Some(b'\\') => out.push(b'\\'),
            Some(b'n') => out.push(b'\n'),
            Some(b'r') => out.push(b'\r'),
            Some(&c) => {
                return Err(format!(
                    "unknown escape \\{} in the name (only \\\\, \\n and \\r)",
                    crate::text::escape(&String::from_utf8_lossy(&[c]))
                ));
            }
            None => return Err("the name ends in a lone backslash".into()),
        }
    }
    Ok(out)
}

/// `<basename>//header` or `<basename>//tensor/<name>`.
fn split_rknot_name(name: &[u8]) -> std::result::Result<(Vec<u8>, Subject), String> {
    let shape = || {
        format!(
            "an rknot line names {} ; expected BASENAME//header or BASENAME//tensor/NAME",
            crate::text::escape(&String::from_utf8_lossy(name))
        )
    };
    let sep = SEPARATOR.as_bytes();
    let at = name
        .windows(sep.len())
        .position(|w| w == sep)
        .ok_or_else(shape)?;
    let (file, what) = (&name[..at], &name[at + sep.len()..]);
    if file.is_empty() || file.contains(&b'/') {
        return Err(shape());
    }
    let subject = if what == b"header" {
        Subject::Header
    } else if let Some(t) = what.strip_prefix(b"tensor/") {
        let t = std::str::from_utf8(t)
            .map_err(|_| format!("{}: the tensor name is not UTF-8", shape()))?;
        if t.is_empty() {
            return Err(shape());
        }
        Subject::Tensor(t.to_string())
    } else {
        return Err(shape());
    };
    Ok((file.to_vec(), subject))
}

/// An entry's name for messages (escaped).
pub fn display_name(file: &[u8], subject: &Subject) -> String {
    let mut name = file.to_vec();
    name.extend_from_slice(subject.suffix().as_bytes());
    crate::text::escape(&String::from_utf8_lossy(&name)).into_owned()
}

/// Lowercase hex of a digest.
pub fn hex(d: &Digest) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// One manifest line (with its newline) for `subject` of the file named
/// `file`, escaped as GNU coreutils escapes names.
pub fn entry_line(file: &[u8], subject: &Subject, digest: &Digest) -> Vec<u8> {
    let mut name = file.to_vec();
    name.extend_from_slice(subject.suffix().as_bytes());
    let needs_escape = name.iter().any(|b| matches!(b, b'\\' | b'\n' | b'\r'));
    let mut line = Vec::with_capacity(name.len() + 80);
    if *subject != Subject::Whole {
        line.extend_from_slice(RKNOT_PREFIX.as_bytes());
    }
    if needs_escape {
        line.push(b'\\');
    }
    line.extend_from_slice(hex(digest).as_bytes());
    line.extend_from_slice(b"  ");
    for &b in &name {
        match b {
            b'\\' if needs_escape => line.extend_from_slice(b"\\\\"),
            b'\n' => line.extend_from_slice(b"\\n"),
            b'\r' => line.extend_from_slice(b"\\r"),
            b => line.push(b),
        }
    }
    line.push(b'\n');
    line
}

/// Every line for one file: whole file, header, then each tensor in the
/// file's order.
pub fn file_lines(file: &[u8], d: &FileDigests) -> Vec<u8> {
    let mut out = entry_line(file, &Subject::Whole, &d.whole);
    out.extend(entry_line(file, &Subject::Header, &d.header));
    for (name, digest) in &d.tensors {
        out.extend(entry_line(file, &Subject::Tensor(name.clone()), digest));
    }
    out
}

/// The basename a manifest lists `path` under.
pub fn basename(path: &Path) -> Result<Vec<u8>> {
    path.file_name()
        .map(|n| n.as_bytes().to_vec())
        .ok_or_else(|| err(ErrorKind::BadValue, "has no file name").path(path))
}

/// What [`write_manifest`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    pub lines: usize,
    pub bytes_hashed: u64,
}

/// `rknot manifest`: digest each of `files` (each opened on its own, so a
/// fallback's tensors that a primary shadows are listed too) in one
/// sequential pass per file and write the manifest to `out` atomically
/// (temporary file + rename; an existing `out` is replaced only with
/// `force`, never when it is one of `files`). The manifest gets at most the
/// permission bits of the files.
pub fn write_manifest(
    files: &[&Path],
    out: &Path,
    force: bool,
    progress: &crate::progress::Meter,
) -> Result<Written> {
    use crate::backend::{Role, open_single};
    use crate::encode::output::{AtomicOutput, OutputTarget};
    use std::io::Write;

    let mut opened = Vec::with_capacity(files.len());
    let mut names: Vec<Vec<u8>> = Vec::new();
    for (i, p) in files.iter().enumerate() {
        let role = if i == 0 {
            Role::Primary
        } else {
            Role::Fallback
        };
        let b = open_single(p, role)?;
        // A directory (a checkpoint's) is listed under the file it opens
        // as, the name the check looks for.
        let name = match p.is_dir() {
            true => basename(&b.summary().path)?,
            false => basename(p)?,
        };
        if names.contains(&name) {
            return Err(err(
                ErrorKind::BadValue,
                "two files with the same basename cannot share a manifest (its lines name files by basename)",
            )
            .path(p));
        }
        names.push(name);
        opened.push(b);
    }
    let sources: Vec<_> = opened.iter().flat_map(|b| b.source_files()).collect();
    let target = OutputTarget::from_sources(out, force, &sources)?;
    if !force && std::fs::symlink_metadata(out).is_ok() {
        return Err(err(
            ErrorKind::BadValue,
            "output exists; pass --force to replace it",
        )
        .path(out));
    }
    // Created first: an output that may not be written (one of the files,
    // an existing file without --force) is refused before any hashing.
    let mut output = AtomicOutput::create(&target)?;
    let mut body = Vec::new();
    let mut hashed = 0;
    let total: u64 = sources.iter().map(|s| s.len()).sum();
    progress.set_total(total);
    for (b, name) in opened.iter().zip(&names) {
        let (file, tensors) = tensor_bytes(b.as_ref())?;
        progress.set_message(&file.path().to_string_lossy());
        let d = digest_file(file, &tensors, &mut |n| progress.inc(n))?;
        hashed += file.len();
        body.extend(file_lines(name, &d));
    }
    progress.finish();
    output
        .write_all(&body)
        .map_err(|e| Error::io(out, "cannot write manifest", e))?;
    output.commit()?;
    Ok(Written {
        lines: body.iter().filter(|&&b| b == b'\n').count(),
        bytes_hashed: hashed,
    })
}

#[cfg(test)]
mod tests;
