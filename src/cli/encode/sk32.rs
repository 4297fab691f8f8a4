//! `rknot encode sk32`: every block matrix as a truncated-SVD sketch.

use std::path::PathBuf;

use clap::Args;

use super::super::values::at_least_1;
use super::{Encoded, check_encode_input};
use crate::backend;
use crate::cli::install_remote;
use crate::encode::output::OutputTarget;
use crate::encode::{self, Progress};
use crate::source::cli::RemoteArgs;

pub(super) const CMD: &[&str] = &["encode", "sk32"];

#[derive(Args)]
pub struct Sk32Args {
    /// Dense source (GGUF or dense .knot).
    pub(super) dense: PathBuf,
    /// Output SK32 file.
    #[arg(short, long, value_name = "OUT")]
    pub(super) out: PathBuf,
    /// Rank of every sketch, at least 1 (a matrix whose smaller
    /// dimension is below it keeps that dimension as its rank).
    #[arg(long, default_value_t = 64, value_parser = at_least_1)]
    rank: usize,
    /// Instead of a fixed rank: the smallest rank keeping this fraction
    /// of each matrix's energy.
    #[arg(long)]
    energy: Option<f64>,
    /// Only tensors matching this glob (dot or underscore names).
    #[arg(long)]
    tensors: Option<String>,
    /// Balance σ into U and V before quantizing (measured worse; for comparison).
    #[arg(long)]
    balance: bool,
    /// Max-abs scales instead of the clipping search.
    #[arg(long)]
    no_clip: bool,
    /// Keep Vᵀ from the SVD instead of refitting it to the quantized U and σ.
    #[arg(long)]
    no_refit: bool,
    /// Activation-weighted sketches: the input statistics of
    /// `rknot calibrate` (a STATS file of this model); each matrix's
    /// sketch minimises its output error over them.
    #[arg(long, value_name = "STATS")]
    calibration_stats: Option<PathBuf>,
    /// With --calibration-stats: whiten by the per-channel mean squares
    /// (diagonal) or by the full Gram matrix (gram; a STATS made with
    /// --gram).
    #[arg(
        long,
        value_enum,
        default_value = "diagonal",
        requires = "calibration_stats"
    )]
    whiten: crate::encode::sk32_act::Whitening,
    /// Replace an existing OUT.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl Sk32Args {
    pub(super) fn encode(self, progress: &Progress) -> Result<Encoded, Box<dyn std::error::Error>> {
        let Self {
            dense,
            out,
            rank,
            energy,
            tensors,
            balance,
            no_clip,
            no_refit,
            calibration_stats,
            whiten,
            overwrite,
            remote,
        } = self;
        install_remote(CMD, &remote)?;
        let stats = calibration_stats
            .as_deref()
            .map(crate::probe::calibrate::read_stats)
            .transpose()?;
        let b = backend::open(&dense, None)?;
        check_encode_input(CMD, b.as_ref(), &dense)?;
        eprintln!("rknot: warning: {}", encode::warnings::SK32);
        let o = encode::sk32::Sk32Options {
            rank: Some(rank),
            energy,
            tensors,
            balance,
            clip_search: !no_clip,
            refit: !no_refit,
            ..Default::default()
        };
        let target = OutputTarget::from_sources(&out, overwrite, &b.source_files())?;
        let calibration = stats
            .as_ref()
            .map(|stats| encode::sk32_act::Sk32Calibration {
                stats,
                whitening: whiten,
            });
        if let (Some(cal), Some(path)) = (calibration, &calibration_stats) {
            // Here to name the STATS file: the encoder checks again.
            encode::sk32_act::check_coverage(cal, b.as_ref(), o.tensors.as_deref())
                .map_err(|e| e.path(path))?;
        }
        let entries =
            encode::sk32::encode_sk32_calibrated(b.as_ref(), &target, &o, calibration, progress)?;
        let mean_rank =
            entries.iter().map(|e| e.rank as f64).sum::<f64>() / entries.len().max(1) as f64;
        Ok(Encoded {
            out,
            input: dense,
            source: b,
            summary: match calibration {
                None => format!("{} sketches, mean rank {mean_rank:.1}", entries.len()),
                Some(c) => format!(
                    "{} sketches, mean rank {mean_rank:.1}, activation-weighted ({})",
                    entries.len(),
                    c.whitening.name()
                ),
            },
            held_out: None,
        })
    }
}
