//! `rknot encode rknot`: spectral-residual .rknot (the faithful, seed and
//! calibrated profiles).

use std::path::PathBuf;

use clap::Args;

use super::{Encoded, check_encode_input, default};
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
    /// calibrated (the default: affine blocks chosen with activation
    /// statistics, 4.95 bits per weight, calibrated on a built-in text
    /// unless --calibrate or --calibration-stats is given; on SmolLM2-135M
    /// 15.8% smaller than its Q4_1 GGUF at a held-out perplexity 3.4%
    /// higher, for 517 s of CPU and 2.0 GB of memory: 48 minutes wall on 2
    /// cores shared at a load of 12), faithful (keep
    /// every dimension, widths by measured sensitivity; seconds, about the
    /// size of a Q4_1 source; the default when the model cannot be probed:
    /// an unknown architecture, no tokenizer) or seed (drop off-standing
    /// dimensions, as the original design did: breaks answers, and says so
    /// before it runs) or lossless (every F32/F16/BF16 matrix stored
    /// exactly, its exponents entropy-coded: about two thirds of bf16's
    /// bytes).
    #[arg(long)]
    profile: Option<String>,
    /// Calibrated profile: bits per weight of the whole OUT file (every
    /// tensor it stores, header included; default 4.95). Faithful
    /// profile: bits per weight of each compressed tensor's blocks
    /// (default 5.0).
    #[arg(long)]
    target_bpw: Option<f64>,
    /// Calibrated profile: run the model over this text (plain UTF-8,
    /// e.g. data/calibration/python-idle-help.txt) and encode with the
    /// activation statistics it records (`rknot calibrate --gram`).
    /// Without it or --calibration-stats the calibrated profile runs over
    /// the built-in text (that file, its last 6 kB held out to measure
    /// the closing perplexity on).
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
        let given = calibrate.is_some() || calibration_stats.is_some();
        let profile = match profile.as_deref() {
            None if given => encode::rknot::Profile::Calibrated,
            // The default (default.rs): calibrated on the built-in text
            // when the probe can run the model.
            None => match default::cannot_calibrate(b.as_ref()) {
                None => encode::rknot::Profile::Calibrated,
                Some(why) => {
                    eprintln!(
                        "rknot: encoding with --profile faithful, not the calibrated default: \
                         {why}"
                    );
                    encode::rknot::Profile::Faithful
                }
            },
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
        if given && !takes {
            return Err(usage(
                CMD,
                format!(
                    "the {} profile takes neither --calibrate nor --calibration-stats",
                    profile.name()
                ),
            ));
        }
        // No calibration input given: the built-in text.
        let built_in = needs && !given;
        if built_in && let Some(why) = default::cannot_calibrate(b.as_ref()) {
            return Err(usage(
                CMD,
                format!(
                    "the calibrated profile cannot calibrate on its built-in text: {why}; \
                     give --calibration-stats STATS (rknot calibrate --tokens) or \
                     --profile faithful"
                ),
            ));
        }
        let calibrating = given || built_in;
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
        let target = OutputTarget::from_sources(&out, overwrite, &b.source_files())?;
        if calibrating && calibration_stats.is_none() {
            // Minutes of calibration must not end in "output exists": the
            // checks the output makes when it is created, made first.
            refuse_output_early(&target)?;
        }
        let calibrated = if calibrating {
            let stats = match (&calibrate, &calibration_stats) {
                (_, Some(path)) => crate::probe::calibrate::read_stats(path)?,
                (text, None) => {
                    let (built_in_text, held_out_text) = default::shipped_text();
                    eprintln!(
                        "rknot: calibrating on {} (ctx {calibration_ctx}, with Gram matrices)",
                        text.as_ref().map_or_else(
                            || format!(
                                "the built-in text, {} ({} bytes; its last {} bytes held out)",
                                default::SHIPPED_NAME,
                                built_in_text.len(),
                                held_out_text.len()
                            ),
                            |t| crate::text::escape(&t.to_string_lossy()).to_string()
                        )
                    );
                    let args = crate::probe::calibrate::CalibrateArgs {
                        model: dense.clone(),
                        dense: None,
                        remote: remote.clone(),
                        text: text.clone(),
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
                    let recorded = if text.is_some() {
                        crate::probe::calibrate::record(&args, &mut std::io::stderr())
                    } else {
                        crate::probe::calibrate::record_text(
                            &args,
                            Some((default::SHIPPED_NAME, built_in_text)),
                            &mut std::io::stderr(),
                        )
                    };
                    recorded.map_err(|e| format!("calibration: {e}"))?
                }
            };
            let mut c = encode::calibrated::CalibratedOptions::new(
                std::sync::Arc::new(stats),
                target_bpw.unwrap_or(default::TARGET_BPW),
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
        let default_target = o.calibrated.is_some() && target_bpw.is_none();
        let entries =
            encode::rknot::encode_rknot(b.as_ref(), &target, &o, progress).map_err(|e| {
                // A model whose kept tensors (a large vocabulary on a small
                // model) alone exceed the default target: say whose it is.
                let b: Box<dyn std::error::Error> =
                    if default_target && e.message().contains("--target-bpw") {
                        format!(
                            "{e} ({} is the calibrated profile's default: give a larger \
                             --target-bpw, or --profile faithful)",
                            default::TARGET_BPW
                        )
                        .into()
                    } else {
                        e.into()
                    };
                b
            })?;
        let summary = if calibrating && profile == encode::rknot::Profile::Calibrated {
            format!("{} tensors, calibrated", entries.len())
        } else {
            format!("{} tensors", entries.len())
        };
        // Calibrated on the built-in text: what the rest of it says about
        // the answers (a whole-file encode only: a --compressed-only or
        // --tensors file does not run alone).
        let held_out = (built_in && !compressed_only && o.tensors.is_none()).then(|| {
            eprintln!("rknot: measuring perplexity on the held-out text (source, then output)");
            default::held_out_perplexity(&dense, &out)
        });
        Ok(Encoded {
            out,
            input: dense,
            source: b,
            summary,
            held_out,
        })
    }
}

/// What creating the output refuses (crate::output::AtomicOutput::create),
/// checked before a long calibration: a local target that is one of the
/// sources, or that exists without --overwrite. (An object store's target
/// is checked when its upload starts.)
fn refuse_output_early(target: &OutputTarget) -> Result<(), Box<dyn std::error::Error>> {
    let path = &target.path;
    if path.to_str().is_some_and(crate::source::is_remote) {
        return Ok(());
    }
    target.check_not_a_source()?;
    if !target.overwrite && std::fs::symlink_metadata(path).is_ok() {
        return Err(crate::error::err(
            crate::error::ErrorKind::BadValue,
            "output exists (pass --overwrite to replace it)",
        )
        .path(path)
        .into());
    }
    Ok(())
}
