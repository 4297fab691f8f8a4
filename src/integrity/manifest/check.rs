//! Checking files against a manifest, all at once (`rknot verify
//! --manifest`): every digest the manifest lists for a file, and whether
//! the file's tensors and the manifest's tensor lines are the same set.

use std::path::{Path, PathBuf};

use super::digest::{TensorBytes, digest_file, tensor_bytes};
use super::{Digest, FileEntries, Manifest, Subject, basename, hex};
use crate::backend::{Backend, Role, open_single};
use crate::error::Result;
use crate::progress::Meter;
use crate::source::SourceFile;
use crate::text::Escaped;

/// What is wrong with one subject of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// No line of the manifest names the file (another model's manifest?).
    NoEntry,
    /// The bytes' digest is not the manifest's.
    Differs { expected: Digest, found: Digest },
    /// The file has a tensor the manifest has no line for: an added tensor
    /// is tampering.
    NotInManifest,
    /// The manifest lists a tensor the file does not have.
    NotInFile,
    /// The manifest has tensor lines for the file but no header line, so
    /// the file's structure is not covered.
    NoHeaderLine,
}

/// One finding, naming the file and what of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub file: PathBuf,
    pub subject: Subject,
    pub problem: Problem,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let file = self.file.to_string_lossy();
        write!(f, "{}: ", Escaped(&file))?;
        match &self.problem {
            Problem::NoEntry => write!(
                f,
                "the manifest has no line for this file's name (is it another model's manifest?)"
            ),
            Problem::Differs { expected, found } => write!(
                f,
                "{}: sha256 {} differs from the manifest's {}",
                self.subject,
                hex(found),
                hex(expected)
            ),
            Problem::NotInManifest => write!(
                f,
                "{}: the file has this tensor, the manifest has no line for it",
                self.subject
            ),
            Problem::NotInFile => write!(
                f,
                "{}: the manifest lists this tensor, the file does not have it",
                self.subject
            ),
            Problem::NoHeaderLine => write!(
                f,
                "the manifest has tensor lines for this file but no header line"
            ),
        }
    }
}

/// Whether the manifest's tensor lines for a file and the file's tensors
/// (`names`, dot names) are one set, and the header is listed when tensors
/// are: what must hold before any digest is worth comparing.
pub(super) fn structure(path: &Path, entries: &FileEntries<'_>, names: &[&str]) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let at = |subject: Subject, problem: Problem| Mismatch {
        file: path.to_path_buf(),
        subject,
        problem,
    };
    if entries.is_empty() {
        out.push(at(Subject::Whole, Problem::NoEntry));
        return out;
    }
    if !entries.per_tensor() {
        return out;
    }
    if entries.header.is_none() {
        out.push(at(Subject::Header, Problem::NoHeaderLine));
    }
    let listed: std::collections::HashSet<&str> = names.iter().copied().collect();
    for n in names {
        if !entries.tensors.contains_key(n) {
            out.push(at(Subject::Tensor(n.to_string()), Problem::NotInManifest));
        }
    }
    let mut missing: Vec<(&str, usize)> = entries
        .tensors
        .iter()
        .filter(|(n, _)| !listed.contains(**n))
        .map(|(n, e)| (*n, e.line))
        .collect();
    missing.sort_by_key(|(_, line)| *line);
    for (n, _) in missing {
        out.push(at(Subject::Tensor(n.to_string()), Problem::NotInFile));
    }
    out
}

/// Check a backend opened on its own (as `open_single` gives: one file, or
/// every shard of a split set) against `manifest`, file by file: one
/// sequential pass per file computes every digest; each listed digest that
/// differs, a missing line and a tensor line without a tensor is a
/// finding. Errors are reading errors, not findings.
pub fn check_backend(
    b: &dyn Backend,
    manifest: &Manifest,
    progress: &Meter,
) -> Result<Vec<Mismatch>> {
    let mut out = Vec::new();
    for (file, tensors) in tensor_bytes(b)? {
        out.extend(check_file(file, &tensors, manifest, progress)?);
    }
    Ok(out)
}

/// [`check_backend`] of one file.
fn check_file(
    file: &SourceFile,
    tensors: &[TensorBytes],
    manifest: &Manifest,
    progress: &Meter,
) -> Result<Vec<Mismatch>> {
    let path = file.path();
    let entries = manifest.for_file(&basename(path)?);
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let mut out = structure(path, &entries, &names);
    if entries.is_empty() {
        return Ok(out);
    }
    progress.set_message(&path.to_string_lossy());
    let d = digest_file(file, tensors, &mut |n| progress.inc(n))?;
    let mut differs = |subject: Subject, expected: &Digest, found: &Digest| {
        if expected != found {
            out.push(Mismatch {
                file: path.to_path_buf(),
                subject,
                problem: Problem::Differs {
                    expected: *expected,
                    found: *found,
                },
            });
        }
    };
    if let Some(e) = entries.whole {
        differs(Subject::Whole, &e.digest, &d.whole);
    }
    if let Some(e) = entries.header {
        differs(Subject::Header, &e.digest, &d.header);
    }
    for (name, found) in &d.tensors {
        if let Some(e) = entries.tensors.get(name.as_str()) {
            differs(Subject::Tensor(name.clone()), &e.digest, found);
        }
    }
    Ok(out)
}

/// Check `paths` (the first as a primary, the rest as fallbacks; each
/// opened on its own) against `manifest`; every finding, in order.
pub fn check_paths(
    paths: &[&Path],
    manifest: &Manifest,
    progress: &Meter,
) -> Result<Vec<Mismatch>> {
    let mut opened = Vec::with_capacity(paths.len());
    for (i, p) in paths.iter().enumerate() {
        let role = if i == 0 {
            Role::Primary
        } else {
            Role::Fallback
        };
        opened.push(open_single(p, role)?);
    }
    let total = opened
        .iter()
        .flat_map(|b| b.source_files())
        .map(|f| f.len())
        .sum();
    progress.set_total(total);
    let mut out = Vec::new();
    for b in &opened {
        out.extend(check_backend(b.as_ref(), manifest, progress)?);
    }
    progress.finish();
    Ok(out)
}

/// The outcome of `rknot verify --manifest`: what it reports and how.
#[derive(Debug, Clone)]
pub struct Checked {
    pub manifest: PathBuf,
    pub mismatches: Vec<Mismatch>,
}

impl Checked {
    /// `manifest:` lines for `verify`'s text report.
    pub fn to_text(&self) -> String {
        let m = Escaped(&self.manifest.to_string_lossy()).to_string();
        if self.mismatches.is_empty() {
            return format!("manifest:  {m}: every listed digest matches\n");
        }
        let mut o = format!("manifest:  {m}: {} mismatch(es)\n", self.mismatches.len());
        for x in &self.mismatches {
            o += &format!("MISMATCH   {x}\n");
        }
        o
    }

    /// `verify --json`'s `manifest` object.
    pub fn to_json(&self) -> serde_json::Value {
        let items: Vec<serde_json::Value> = self
            .mismatches
            .iter()
            .map(|x| {
                let (subject, tensor) = match &x.subject {
                    Subject::Whole => ("whole", None),
                    Subject::Header => ("header", None),
                    Subject::Tensor(n) => ("tensor", Some(n.as_str())),
                };
                let (problem, expected, found) = match &x.problem {
                    Problem::NoEntry => ("no_entry", None, None),
                    Problem::Differs { expected, found } => {
                        ("differs", Some(hex(expected)), Some(hex(found)))
                    }
                    Problem::NotInManifest => ("not_in_manifest", None, None),
                    Problem::NotInFile => ("not_in_file", None, None),
                    Problem::NoHeaderLine => ("no_header_line", None, None),
                };
                serde_json::json!({
                    "file": x.file.display().to_string(),
                    "subject": subject,
                    "tensor": tensor,
                    "problem": problem,
                    "expected": expected,
                    "found": found,
                    "message": x.to_string(),
                })
            })
            .collect();
        serde_json::json!({
            "path": self.manifest.display().to_string(),
            "ok": self.mismatches.is_empty(),
            "mismatches": items,
        })
    }

    /// The error `verify` exits with when anything did not match.
    pub fn error(&self) -> crate::Error {
        const NAMED: usize = 5;
        let named: Vec<String> = self
            .mismatches
            .iter()
            .take(NAMED)
            .map(|x| format!("{}: {}", Escaped(&x.file.to_string_lossy()), x.subject))
            .collect();
        let more = self.mismatches.len().saturating_sub(NAMED);
        crate::error::err(
            crate::ErrorKind::Checksum,
            format!(
                "{} mismatch(es) against manifest {}: {}{}",
                self.mismatches.len(),
                Escaped(&self.manifest.to_string_lossy()),
                named.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            ),
        )
    }
}
