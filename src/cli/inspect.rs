//! `rknot inspect`: format, metadata and a table of every tensor.

use std::io;
use std::path::PathBuf;

use clap::Args;

use super::{CliResult, install_remote, quiet_pipe, write_stdout};
use crate::backend;
use crate::report;
use crate::source::cli::RemoteArgs;

#[derive(Args)]
pub struct InspectArgs {
    /// Model file (.rknot, SK32 sketch, dense .knot or GGUF).
    file: PathBuf,
    /// Dense fallback (GGUF or dense .knot) for tensors FILE lacks.
    #[arg(long)]
    dense: Option<PathBuf>,
    /// Print JSON instead of text. Metadata arrays longer than 1024
    /// elements and strings longer than 64 KiB are summarized as
    /// {"type": .., "len": .., "omitted": true} (as in index.json).
    #[arg(long)]
    json: bool,
    /// With --json: print every metadata value in full (streamed; a
    /// tokenizer's arrays can make this tens of MB).
    #[arg(long, requires = "json")]
    full: bool,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl InspectArgs {
    pub fn run(self) -> CliResult {
        install_remote(&["inspect"], &self.remote)?;
        let b = backend::open(&self.file, self.dense.as_deref())?;
        if self.json {
            // Streamed: one tensor's JSON at a time.
            let doc = if self.full {
                report::InspectJson::full(b.as_ref())
            } else {
                report::InspectJson::summarized(b.as_ref(), report::ARRAY_SUMMARY_LIMIT)
            };
            let out = io::BufWriter::new(io::stdout().lock());
            return report::write_inspect_json(&doc, out).or_else(quiet_pipe);
        }
        write_stdout(report::inspect_text(b.as_ref()).as_bytes())
    }
}
