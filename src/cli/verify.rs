//! `rknot verify`: an encoded file's structure and, with --dense, its
//! fidelity per tensor; with --integrity only its checksums; with
//! --manifest also the manifest's hashes.

use std::path::{Path, PathBuf};

use clap::Args;

use super::{CliResult, install_remote, write_stdout};
use crate::integrity::manifest::Checked;
use crate::progress::{Meter, Mode, Unit};
use crate::source::cli::RemoteArgs;
use crate::text::escape_json_text;

#[derive(Args)]
pub struct VerifyArgs {
    /// Encoded file (.rknot, SK32, dense .knot or GGUF).
    encoded: PathBuf,
    /// The dense model it was encoded from.
    #[arg(long)]
    dense: Option<PathBuf>,
    /// Only check every stored byte of ENCODED (and --dense) against the
    /// checksums the files carry, and against --manifest when given:
    /// nothing decoded, with progress; exit 1 naming each damaged block
    /// group, chunk or tensor.
    #[arg(long)]
    integrity: bool,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Also check ENCODED (and --dense) against this sha256sum-format
    /// manifest (`rknot manifest`, or a plain SHA256SUMS): whole file,
    /// header and every tensor it lists; each mismatch is named.
    #[arg(long, value_name = "FILE.sums")]
    manifest: Option<PathBuf>,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl VerifyArgs {
    pub fn run(self, mode: Mode) -> CliResult {
        install_remote(&["verify"], &self.remote)?;
        if self.integrity {
            self.integrity(mode)
        } else {
            self.structure(mode)
        }
    }

    /// `--integrity`: the stored bytes against the files' checksums.
    fn integrity(self, mode: Mode) -> CliResult {
        let Self {
            encoded,
            dense,
            json,
            manifest,
            ..
        } = self;
        let r = crate::verify::verify_integrity(&encoded, mode);
        let rd = dense
            .as_deref()
            .map(|d| crate::verify::verify_integrity(d, mode));
        let checked = match &manifest {
            Some(m) => Some(check_manifest(m, &encoded, dense.as_deref(), mode)?),
            None => None,
        };
        let sections = [
            rd.as_ref().map(|d| ("dense", d.to_json(), d.to_text())),
            checked
                .as_ref()
                .map(|c| ("manifest", c.to_json(), c.to_text())),
        ];
        write_report(json, r.to_json(), r.to_text(), sections)?;
        let problems: Vec<&crate::Error> = r
            .problems()
            .chain(rd.iter().flat_map(|d| d.problems()))
            .collect();
        if let Some(first) = problems.first() {
            Err(Box::new(crate::Error::new(
                crate::ErrorKind::Checksum,
                format!("{} checksum problem(s); first: {first}", problems.len()),
            )))
        } else if let Some(c) = checked.filter(|c| !c.mismatches.is_empty()) {
            Err(c.error().into())
        } else {
            Ok(())
        }
    }

    /// Without `--integrity`: every offset, table and block (and with
    /// --dense the fidelity).
    fn structure(self, mode: Mode) -> CliResult {
        let Self {
            encoded,
            dense,
            json,
            manifest,
            ..
        } = self;
        let r = crate::verify::verify(&encoded, dense.as_deref(), mode)?;
        let checked = match &manifest {
            Some(m) => Some(check_manifest(m, &encoded, dense.as_deref(), mode)?),
            None => None,
        };
        let sections = [checked
            .as_ref()
            .map(|c| ("manifest", c.to_json(), c.to_text()))];
        write_report(json, r.to_json(), r.to_text(), sections)?;
        if !r.faults.is_empty() {
            Err(Box::new(crate::verify::faults_error(&r)))
        } else if let Some(c) = checked.filter(|c| !c.mismatches.is_empty()) {
            Err(c.error().into())
        } else {
            Ok(())
        }
    }
}

/// Print a verify report on stdout: as JSON, each present section a key of
/// the report's object; as text, each section appended to the report's.
fn write_report<const N: usize>(
    json: bool,
    mut doc: serde_json::Value,
    mut text: String,
    sections: [Option<(&str, serde_json::Value, String)>; N],
) -> CliResult {
    let sections = sections.into_iter().flatten();
    let out = if json {
        if let Some(obj) = doc.as_object_mut() {
            for (key, value, _) in sections {
                obj.insert(key.into(), value);
            }
        }
        let mut s = escape_json_text(serde_json::to_string_pretty(&doc)?);
        s.push('\n');
        s
    } else {
        for (_, _, t) in sections {
            text += &t;
        }
        text
    };
    write_stdout(out.as_bytes())?;
    Ok(())
}

/// `verify --manifest`: the files against the manifest (the check itself is
/// `integrity::manifest::check_paths`).
fn check_manifest(
    manifest: &Path,
    encoded: &Path,
    dense: Option<&Path>,
    mode: Mode,
) -> Result<Checked, Box<dyn std::error::Error>> {
    use crate::integrity::manifest::{Manifest, check_paths};
    let m = Manifest::read(manifest)?;
    let mut files = vec![encoded];
    files.extend(dense);
    let meter = Meter::new("verify --manifest", Unit::Bytes, mode);
    let mismatches = check_paths(&files, &m, &meter)?;
    Ok(Checked {
        manifest: manifest.to_path_buf(),
        mismatches,
    })
}
