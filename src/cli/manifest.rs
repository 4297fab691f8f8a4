//! `rknot manifest`: a sha256sum-format manifest of the files, their
//! headers and every tensor's stored bytes.

use std::path::PathBuf;

use clap::Args;

use super::{CliResult, install_remote};
use crate::progress::{Meter, Mode, Unit};
use crate::source::cli::RemoteArgs;

#[derive(Args)]
pub struct ManifestArgs {
    /// Model file (.rknot, SK32, dense .knot or GGUF).
    file: PathBuf,
    /// The dense fallback mounted with it, listed too.
    #[arg(long)]
    dense: Option<PathBuf>,
    /// Where the manifest goes (conventionally next to the files).
    #[arg(short, long, value_name = "OUT.sums")]
    out: PathBuf,
    /// Replace an existing OUT.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl ManifestArgs {
    pub fn run(self, mode: Mode) -> CliResult {
        install_remote(&["manifest"], &self.remote)?;
        let mut files = vec![self.file.as_path()];
        files.extend(self.dense.as_deref());
        let progress = Meter::new("manifest", Unit::Bytes, mode);
        let t0 = std::time::Instant::now();
        let w =
            crate::integrity::manifest::write_manifest(&files, &self.out, self.force, &progress)?;
        eprintln!(
            "rknot: wrote {} ({} lines; {} bytes hashed in {:.1} s)",
            crate::text::escape(&self.out.to_string_lossy()),
            w.lines,
            w.bytes_hashed,
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }
}
