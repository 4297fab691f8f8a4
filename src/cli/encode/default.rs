//! What `rknot encode rknot SRC -o OUT` does without `--profile`: the
//! calibrated profile at [`TARGET_BPW`] (vocabulary tables as Q5_1),
//! calibrated on the text built into the binary unless the user gives
//! `--calibrate TEXT` or `--calibration-stats STATS`, and its perplexity on
//! the part of that text the calibration did not see, against the
//! source's. A model the probe cannot run (an architecture it does not
//! know, no tokenizer) cannot be calibrated: the faithful profile then,
//! with one line on stderr saying why.
//!
//! Why this default (docs/QUALITY.md, issue 30): on SmolLM2 the faithful
//! profile writes a file the size of its Q4_1 source, lossy; the calibrated
//! profile at 4.95 bits per weight is about 15% smaller than the source at
//! a held-out perplexity a few percent above it.

use std::path::Path;
use std::sync::Arc;

use crate::backend::Backend;
use crate::probe::eval;
use crate::probe::{Config, Model, Residency, Tokenizer, WeightSource, open_source};

/// The calibration text built into the binary (no data directory needed at
/// run time): the IDLE chapter of the Python 3.13 documentation, © Python
/// Software Foundation, PSF License v2 (data/calibration/NOTICE).
const SHIPPED_TEXT: &str = include_str!("../../../data/calibration/python-idle-help.txt");

/// The name the statistics record for it (as `--calibrate` records a
/// file's name).
pub(super) const SHIPPED_NAME: &str = "python-idle-help.txt";

/// Bits per weight of the whole default output file. Measured on SmolLM2
/// (docs/QUALITY.md): the smallest target whose held-out perplexity stays
/// within about 5% of the Q4_1 source's.
pub(super) const TARGET_BPW: f64 = 4.95;

/// The last bytes of the built-in text (from the next line start) are held
/// out: never calibrated on, the perplexity of the closing report is
/// measured on them. About 1500 SmolLM2 tokens: [`HELD_OUT_WINDOWS`]
/// windows of [`HELD_OUT_CTX`].
const HELD_OUT_BYTES: usize = 6000;
const HELD_OUT_CTX: usize = 256;
const HELD_OUT_WINDOWS: usize = 4;

/// The built-in text, split: (calibration part, held-out part), at a line
/// start so that no word is cut.
pub(super) fn shipped_text() -> (&'static str, &'static str) {
    let from = SHIPPED_TEXT.len().saturating_sub(HELD_OUT_BYTES);
    let cut = SHIPPED_TEXT[..]
        .char_indices()
        .skip_while(|&(i, _)| i < from)
        .find(|&(i, _)| i > 0 && SHIPPED_TEXT.as_bytes()[i - 1] == b'\n')
        .map_or(SHIPPED_TEXT.len(), |(i, _)| i);
    SHIPPED_TEXT.split_at(cut)
}

/// Why the built-in calibration cannot run on `b`, or None when it can:
/// the probe (which records the calibration statistics) must know the
/// architecture and read the tokenizer.
pub(super) fn cannot_calibrate(b: &dyn Backend) -> Option<String> {
    let md = crate::report::effective_metadata(b);
    if let Err(e) = Config::from_metadata(md) {
        return Some(format!("the probe cannot run this model ({e})"));
    }
    if let Err(e) = Tokenizer::from_metadata(md) {
        return Some(format!(
            "no tokenizer to read the calibration text with ({e})"
        ));
    }
    None
}

/// The closing report's fidelity figure: perplexity of the source and of
/// the output over the held-out part of the built-in text.
pub(crate) struct HeldOut {
    pub source: f64,
    pub output: f64,
    pub tokens: usize,
    pub windows: usize,
    pub secs: f64,
}

impl HeldOut {
    pub fn ratio(&self) -> f64 {
        self.output / self.source
    }
}

/// Perplexity of `source` and `out` over the held-out text, in
/// llama-perplexity's windows ([`eval::perplexity`]), the tokens read with
/// the source's tokenizer. Each model is loaded, measured and dropped in
/// turn (one fp32 copy in memory at a time).
pub(super) fn held_out_perplexity(source: &Path, out: &Path) -> Result<HeldOut, String> {
    let t = std::time::Instant::now();
    let (_, text) = shipped_text();
    let measure = |path: &Path, tokens: Option<(&[u32], Option<u32>)>| {
        let src: Arc<dyn WeightSource> = Arc::from(
            open_source(path, None, None).map_err(|e| format!("{}: {e}", path.display()))?,
        );
        let (ids, bos) = match tokens {
            Some((ids, bos)) => (ids.to_vec(), bos),
            None => {
                let tok = Tokenizer::from_metadata(src.metadata()).map_err(|e| e.to_string())?;
                (
                    tok.encode(text, false, false),
                    tok.add_bos.then_some(tok.bos).flatten(),
                )
            }
        };
        let model =
            Model::load_with(Arc::clone(&src), Residency::Auto).map_err(|e| e.to_string())?;
        let p = eval::perplexity(&model, &ids, HELD_OUT_CTX, Some(HELD_OUT_WINDOWS), bos)
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((p, ids, bos))
    };
    let (reference, ids, bos) = measure(source, None)?;
    let (encoded, _, _) = measure(out, Some((&ids, bos)))?;
    Ok(HeldOut {
        source: reference.nll.perplexity(),
        output: encoded.nll.perplexity(),
        tokens: reference.tokens_evaluated,
        windows: reference.windows,
        secs: t.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_held_out_part_is_the_tail_cut_at_a_line_start() {
        let (cal, held) = shipped_text();
        assert_eq!(cal.len() + held.len(), SHIPPED_TEXT.len());
        assert!(cal.ends_with('\n'));
        assert!(held.len() >= HELD_OUT_BYTES / 2 && held.len() <= HELD_OUT_BYTES);
        assert!(cal.len() > 4 * held.len(), "most of the text calibrates");
    }
}
