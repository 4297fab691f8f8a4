//! `rknot encode`: a dense model into SK32 ([`sk32`]), .rknot ([`rknot`])
//! or dense .knot ([`knot`]). What every encoder shares is here: the output
//! URL's checks, and the closing report (size, bits per weight, error).

use std::path::PathBuf;

use clap::Subcommand;

use super::{CliResult, usage};
use crate::backend::{self, Backend};
use crate::progress::{Meter, Mode, Unit};

mod default;
pub mod knot;
pub mod rknot;
pub mod sk32;

#[derive(Subcommand)]
pub enum EncodeCmd {
    /// Every block matrix as a truncated-SVD sketch (never token_embd/output).
    Sk32(sk32::Sk32Args),
    /// Spectral-residual .rknot of the attention and FFN matrices.
    Rknot(rknot::RknotArgs),
    /// GGUF -> dense .knot repack (ggml blocks verbatim).
    Knot(knot::KnotArgs),
}

/// What an encoder hands to the closing report: the output, the input
/// (as named), the input opened, and a summary of what was written.
pub(crate) struct Encoded {
    pub out: PathBuf,
    pub input: PathBuf,
    pub source: Box<dyn Backend>,
    pub summary: String,
    /// Perplexity of the source and the output on text the calibration
    /// did not see (the default encode: default.rs), or why it was not
    /// measured; None: not attempted.
    pub held_out: Option<Result<default::HeldOut, String>>,
}

impl EncodeCmd {
    pub fn run(self, mode: Mode) -> CliResult {
        use crate::encode::Progress;
        // An object store has no inode to compare: an output URL naming the
        // input is refused by name (with --overwrite it would replace the
        // model being read).
        let (out_path, in_path, cmd): (&PathBuf, &PathBuf, &'static [&'static str]) = match &self {
            EncodeCmd::Sk32(a) => (&a.out, &a.dense, sk32::CMD),
            EncodeCmd::Rknot(a) => (&a.out, &a.dense, rknot::CMD),
            EncodeCmd::Knot(a) => (&a.out, &a.gguf, knot::CMD),
        };
        if let Some(o) = out_path.to_str().filter(|o| crate::source::is_remote(o)) {
            let same = in_path.to_str().is_some_and(|i| {
                crate::source::redact(i).eq_ignore_ascii_case(&crate::source::redact(o))
            });
            if same {
                return Err(usage(
                    cmd,
                    format!(
                        "{}: the output is the input: refusing to replace the model being encoded",
                        crate::source::redact(o)
                    ),
                ));
            }
            if let Err(m) = crate::source::upload::parse_output_url(o) {
                return Err(usage(cmd, format!("{}: {m}", crate::source::redact(o))));
            }
            // Interrupted, the upload is aborted rather than left stored.
            crate::source::upload::abort_on_signals();
        }
        let progress = Progress::for_cli(mode);
        let t0 = std::time::Instant::now();
        let encoded = match self {
            EncodeCmd::Sk32(a) => a.encode(&progress)?,
            EncodeCmd::Rknot(a) => a.encode(&progress)?,
            EncodeCmd::Knot(a) => a.encode(&progress)?,
        };
        report(encoded, t0, mode);
        Ok(())
    }
}

/// The closing lines: what was written, its bits per weight, and how far
/// from the input it is.
fn report(encoded: Encoded, t0: std::time::Instant, mode: Mode) {
    let Encoded {
        out,
        input,
        source,
        summary,
        held_out,
    } = encoded;
    // Honest size: the whole file over the parameters it serves (opening
    // the output reads only its header).
    let written = backend::open(&out, None).ok();
    let size = std::fs::metadata(&out)
        .map(|m| m.len())
        .unwrap_or_else(|_| {
            // An uploaded object: its size as opened.
            written
                .as_ref()
                .and_then(|b| b.source_files().first().map(|f| f.len()))
                .unwrap_or(0)
        });
    let (parameters, payload) = written.as_ref().map_or((0, 0), |b| {
        b.tensors()
            .entries()
            .iter()
            .filter(|t| t.is_available())
            .fold((0u64, 0u64), |(n, p), t| {
                (n + t.n_elements, p + t.stored_bytes)
            })
    });
    let per_weight = |bytes: u64| bytes as f64 * 8.0 / parameters.max(1) as f64;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "rknot: wrote {} ({size} bytes, {parameters} parameters: {:.3} bits per weight; \
         tensor payloads alone {:.3}; {summary}) in {secs:.1} s",
        crate::text::escape(&out.to_string_lossy()),
        per_weight(size),
        per_weight(payload),
    );
    // The verdict against the source file: its size, and (when measured)
    // its perplexity on held-out text.
    let source_size: u64 = source.source_files().iter().map(|f| f.len()).sum();
    let shown_input = crate::text::escape(&input.to_string_lossy()).to_string();
    let against = size_against_source(size, source_size, &shown_input);
    match &held_out {
        Some(Ok(h)) => {
            let change = (h.ratio() - 1.0) * 100.0;
            eprintln!(
                "rknot: {against}, perplexity {change:+.1}% on held-out text ({:.3} against \
                 {:.3}, ratio {:.3}, over {} tokens in {} windows of the built-in text that \
                 the calibration did not see; measured in {:.0} s)",
                h.output,
                h.source,
                h.ratio(),
                h.tokens,
                h.windows,
                h.secs,
            );
            return;
        }
        Some(Err(why)) => eprintln!("rknot: {against}; held-out perplexity not measured: {why}"),
        None => eprintln!("rknot: {against}"),
    }
    // How far from the input the output is, and what that means for
    // answers (decodes both once: seconds for SmolLM2).
    let fidelity = written.as_ref().and_then(|e| {
        let meter = Meter::new("measure error", Unit::Work, mode);
        crate::verify::lossy_weight_error(e.as_ref(), source.as_ref(), &meter)
    });
    if let Some(e) = fidelity {
        // The verdicts come from encodings that minimise the weight error;
        // the calibrated profile minimises the output error instead, and
        // its weight error says little about its answers.
        let verdict = if summary.ends_with(", calibrated") {
            "the calibrated profile minimises the output error on real activations, not this \
             figure: measure answers with rknot probe --perplexity (docs/QUALITY.md)"
        } else {
            crate::verify::verdict(e)
        };
        eprintln!(
            "rknot: relative weight error of the lossy-encoded tensors {e:.4} against {} \
             (rknot verify --dense: \"lossy-encoded tensors\"): {verdict}",
            crate::text::escape(&input.to_string_lossy()),
        );
    }
}

/// "smaller than the source by 15.8% (82.84 MB against 98.36 MB of
/// model.gguf)".
fn size_against_source(size: u64, source: u64, shown_source: &str) -> String {
    let mb = |b: u64| b as f64 / 1e6;
    if source == 0 {
        return format!(
            "{:.2} MB; the size of {shown_source} is not known",
            mb(size)
        );
    }
    let change = (size as f64 / source as f64 - 1.0) * 100.0;
    let how = if change <= 0.0 { "smaller" } else { "larger" };
    format!(
        "{how} than the source by {:.1}% ({:.2} MB against {:.2} MB of {shown_source})",
        change.abs(),
        mb(size),
        mb(source)
    )
}

/// The encoders take a dense model: re-encoding a lossy file (SK32, .rknot)
/// would compound its error, and `encode knot` repacks GGUF blocks only.
pub(crate) fn check_encode_input(
    cmd: &'static [&'static str],
    b: &dyn Backend,
    path: &std::path::Path,
) -> CliResult {
    let format = b.summary().format;
    let shown = crate::text::escape(&path.to_string_lossy()).to_string();
    if cmd == ["encode", "knot"] {
        if !format.is_repackable() {
            return Err(usage(
                cmd,
                format!("{shown}: encode knot repacks a GGUF; this is {format}"),
            ));
        }
    } else if b.as_dense().is_none() {
        return Err(usage(
            cmd,
            format!(
                "{shown}: {} encodes a dense model (GGUF or dense .knot); this is {format}, \
                 already lossy: encode the dense model it was made from",
                cmd.join(" ")
            ),
        ));
    }
    Ok(())
}
