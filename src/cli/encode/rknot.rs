//! `rknot encode rknot`: spectral-residual .rknot (the faithful, seed and
//! calibrated profiles).

use std::path::PathBuf;

use clap::Args;

use super::{Encoded, check_encode_input};
use crate::backend;
use crate::cli::{install_remote, usage};
use crate::encode::output::OutputTarget;
use crate::encode::{self, Progress};
use crate::source::cli::RemoteArgs;

pub(super) const CMD: &[&str] = &["encode", "rknot"];

#[derive(Args)]
pub struct RknotArgs {
    /// Dense source (GGUF or dense .knot).
    pub(super) dense: PathBuf,
    /// Output .rknot file.
    #[arg(short, long, value_name = "OUT")]
    pub(super) out: PathBuf,
    /// Fraction of hidden dimensions that stand (seed profile).
    #[arg(long, default_value_t = 0.30)]
    coverage: f64,
    /// Seed profile: code width in bits of attn_q and attn_k.
    #[arg(long, default_value_t = 4)]
    bits_qk: u8,
    /// Seed profile: code width in bits of attn_v and attn_output.
    #[arg(long, default_value_t = 8)]
    bits_v: u8,
    /// Seed profile: code width in bits of the FFN matrices.
    #[arg(long, default_value_t = 4)]
    bits_ffn: u8,
    /// Graded widths: base + round(extra_bits × phase_alignment).
    #[arg(long)]
    graded: bool,
    /// With --graded: a standing line gets up to this many bits above its
    /// base width (round(extra_bits × phase_alignment)).
    #[arg(long, default_value_t = 2)]
    extra_bits: u8,
    /// faithful (keep every dimension, widths by measured sensitivity;
    /// answers like the dense model), seed (drop off-standing
    /// dimensions, as the original design did: breaks answers, and
    /// says so before it runs), calibrated (affine blocks chosen
    /// with activation statistics; what --calibrate selects) or
    /// lossless (every F32/F16/BF16 matrix stored exactly, its
    /// exponents entropy-coded: about two thirds of bf16's bytes).
    #[arg(long)]
    profile: Option<String>,
    /// Calibrated profile: bits per weight of the whole OUT file (every
    /// tensor it stores, header included; default 5.5). Faithful
    /// profile: bits per weight of each compressed tensor's blocks
    /// (default 5.0).
    #[arg(long)]
    target_bpw: Option<f64>,
    /// Calibrated profile: run the model over this text (plain UTF-8,
    /// e.g. data/calibration/python-idle-help.txt) and encode with the
    /// activation statistics it records (`rknot calibrate --gram`).
    #[arg(long, value_name = "TEXT", conflicts_with = "calibration_stats")]
    calibrate: Option<PathBuf>,
    /// Calibrated profile: statistics `rknot calibrate` wrote (with
    /// --gram unless --no-gptq), instead of --calibrate. With
    /// --profile faithful: the manifest's standing dimensions come
    /// from these activations instead of the weights.
    #[arg(long, value_name = "STATS")]
    calibration_stats: Option<PathBuf>,
    /// With --calibrate: tokens per calibration window.
    #[arg(long, default_value_t = 512, value_name = "N")]
    calibration_ctx: usize,
    /// Calibrated profile: round to nearest instead of error-compensating
    /// rounding (GPTQ).
    #[arg(long)]
    no_gptq: bool,
    /// Calibrated profile: fit each block's scale to the plain squared
    /// error instead of weighting it by the input channels' energy.
    #[arg(long)]
    no_weighted_fit: bool,
    /// Calibrated profile: how widths are spread over the matrices:
    /// balanced (the largest single width and group that fits every
    /// matrix, then the bytes left by output), output (from the
    /// smallest, where the output error falls most per byte), relative
    /// (the same, each matrix's error over its output energy) or
    /// uniform (one width and group for all).
    #[arg(long, default_value = "balanced")]
    allocation: String,
    /// Calibrated profile: the code widths a matrix may get.
    #[arg(long, value_delimiter = ',', default_values_t = [2u8, 3, 4, 5, 6, 8])]
    widths: Vec<u8>,
    /// Calibrated profile: the weights per affine block (along a row)
    /// a matrix may get; every width goes with every group size.
    #[arg(long, value_delimiter = ',', default_values_t = [32u64, 64])]
    groups: Vec<u64>,
    /// Calibrated profile: store the vocabulary tables (token_embd,
    /// output) requantized to ggml Q5_1, Q6_K or Q4_1 (only when that
    /// is smaller than how the input stores them), or as the input's
    /// own ggml blocks (keep). Their bytes count against --target-bpw.
    #[arg(long, default_value = "q5_1")]
    vocab_type: String,
    /// Values per block along a line (faithful and graded).
    #[arg(long, default_value_t = 256)]
    block: u64,
    /// Only matrices matching this glob are compressed.
    #[arg(long)]
    tensors: Option<String>,
    /// Store only the compressed matrices; without it every other
    /// tensor (embeddings, norms, ...) is stored too, as its ggml blocks
    /// verbatim, and the file serves the whole model alone.
    #[arg(long)]
    compressed_only: bool,
    /// Replace an existing OUT.
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl RknotArgs {
    pub(super) fn encode(self, progress: &Progress) -> Result<Encoded, Box<dyn std::error::Error>> {
        let Self {
            dense,
            out,
            coverage,
            bits_qk,
            bits_v,
            bits_ffn,
            graded,
            extra_bits,
            profile,
            target_bpw,
            calibrate,
            calibration_stats,
            calibration_ctx,
            no_gptq,
            no_weighted_fit,
            allocation,
            widths,
            groups,
            vocab_type,
            block,
            tensors,
            compressed_only,
            overwrite,
            remote,
        } = self;
        install_remote(CMD, &remote)?;
        let b = backend::open(&dense, None)?;
        check_encode_input(CMD, b.as_ref(), &dense)?;
        let calibrating = calibrate.is_some() || calibration_stats.is_some();
        let profile = match profile.as_deref() {
            None if calibrating => encode::rknot::Profile::Calibrated,
            None => encode::rknot::Profile::Faithful,
            Some(p) => encode::rknot::Profile::parse(p).ok_or_else(|| {
                usage(
                    CMD,
                    format!("unknown --profile {p:?} (faithful, seed, calibrated, lossless)"),
                )
            })?,
        };
        // The faithful profile takes statistics too (its manifest then
        // comes from the activations); the seed profile does not.
        let needs = profile == encode::rknot::Profile::Calibrated;
        let takes = needs || profile == encode::rknot::Profile::Faithful;
        if (needs && !calibrating) || (calibrating && !takes) {
            return Err(usage(
                CMD,
                "the calibrated profile needs --calibrate TEXT or --calibration-stats \
             STATS; the seed profile takes neither"
                    .to_string(),
            ));
        }
        let allocation = encode::calibrated::Allocation::parse(&allocation).ok_or_else(|| {
            usage(
                CMD,
                format!(
                    "unknown --allocation {allocation:?} (balanced, output, relative, uniform)"
                ),
            )
        })?;
        if profile == encode::rknot::Profile::Seed {
            eprintln!("rknot: warning: {}", encode::warnings::SEED_PROFILE);
        }
        let mut widths = widths;
        widths.sort_unstable();
        widths.dedup();
        let calibrated = if calibrating {
            let stats = match (&calibrate, &calibration_stats) {
                (_, Some(path)) => crate::probe::calibrate::read_stats(path)?,
                (Some(text), None) => {
                    eprintln!(
                        "rknot: calibrating on {} (ctx {calibration_ctx}, with Gram matrices)",
                        crate::text::escape(&text.to_string_lossy())
                    );
                    let args = crate::probe::calibrate::CalibrateArgs {
                        model: dense.clone(),
                        dense: None,
                        remote: remote.clone(),
                        text: Some(text.clone()),
                        tokens: None,
                        out: PathBuf::new(),
                        overwrite: false,
                        ctx: calibration_ctx.max(2),
                        max_tokens: None,
                        gram: !no_gptq,
                        threads: None,
                        weights: crate::probe::Residency::Auto,
                        tokenizer: None,
                    };
                    crate::probe::calibrate::record(&args, &mut std::io::stderr())
                        .map_err(|e| format!("calibration: {e}"))?
                }
                (None, None) => {
                    return Err(usage(CMD, "no calibration statistics".to_string()));
                }
            };
            let mut c = encode::calibrated::CalibratedOptions::new(
                std::sync::Arc::new(stats),
                target_bpw.unwrap_or(5.5),
            );
            c.gptq = !no_gptq;
            c.weighted_fit = !no_weighted_fit;
            c.allocation = allocation;
            c.widths = widths;
            c.groups = groups;
            c.vocab = encode::calibrated::VocabType::parse(&vocab_type).ok_or_else(|| {
                usage(
                    CMD,
                    format!("unknown --vocab-type {vocab_type:?} (keep, q6_k, q5_1, q4_1)"),
                )
            })?;
            Some(c)
        } else {
            None
        };
        let o = encode::rknot::RknotOptions {
            profile,
            coverage,
            bits_qk,
            bits_v,
            bits_ffn,
            graded,
            extra_bits,
            target_bpw: target_bpw.unwrap_or(5.0),
            block,
            tensors,
            compressed_only,
            calibrated,
            ..Default::default()
        };
        let target = OutputTarget::from_sources(&out, overwrite, &b.source_files())?;
        let entries = encode::rknot::encode_rknot(b.as_ref(), &target, &o, progress)?;
        let summary = if calibrating && profile == encode::rknot::Profile::Calibrated {
            format!("{} tensors, calibrated", entries.len())
        } else {
            format!("{} tensors", entries.len())
        };
        Ok(Encoded {
            out,
            input: dense,
            source: b,
            summary,
        })
    }
}
