//! `rknot encode knot`: a GGUF repacked as dense .knot (ggml blocks verbatim).

use std::path::PathBuf;

use clap::Args;

use super::{Encoded, check_encode_input};
use crate::backend;
use crate::cli::install_remote;
use crate::encode::output::OutputTarget;
use crate::encode::{self, Progress};
use crate::source::cli::RemoteArgs;

pub(super) const CMD: &[&str] = &["encode", "knot"];

#[derive(Args)]
pub struct KnotArgs {
    /// GGUF source.
    pub(super) gguf: PathBuf,
    /// Output dense .knot file.
    #[arg(short, long, value_name = "OUT")]
    pub(super) out: PathBuf,
    /// Replace an existing OUT.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl KnotArgs {
    pub(super) fn encode(self, progress: &Progress) -> Result<Encoded, Box<dyn std::error::Error>> {
        let Self {
            gguf,
            out,
            overwrite,
            remote,
        } = self;
        install_remote(CMD, &remote)?;
        let b = backend::open(&gguf, None)?;
        check_encode_input(CMD, b.as_ref(), &gguf)?;
        let target = OutputTarget::from_sources(&out, overwrite, &b.source_files())?;
        encode::knot::encode_knot(b.as_ref(), &target, progress)?;
        Ok(Encoded {
            out,
            input: gguf,
            source: b,
            summary: "dense .knot".to_string(),
            held_out: None,
        })
    }
}
