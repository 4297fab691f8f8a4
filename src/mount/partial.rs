//! A source that cannot serve its model whole (an SK32, or a
//! `--compressed-only` .rknot, mounted without `--dense`): refused before
//! anything is mounted, unless `--allow-partial` asks for its tensor files
//! alone. Either way stderr says what is missing; what is missing is the
//! filesystem's own finding ([`crate::fs::partial_model`]), the one ctl and
//! index.json report as the reason `model.gguf` and `hf/` are absent.

use std::path::Path;

use crate::backend::Backend;
use crate::fs::PartialModel;

/// Exit status of a refused partial mount: the invocation, not the
/// machine, is what needs changing (as for a usage error).
pub const EXIT_PARTIAL: u8 = 2;

/// The refusal (or, with `allow`, the warning) for `b` mounted from
/// `source`, when it cannot serve its model whole.
pub fn check(b: &dyn Backend, source: &Path, allow: bool) -> Result<Option<String>, String> {
    let Some(p) = crate::fs::partial_model(b) else {
        return Ok(None);
    };
    let source = crate::source::redact(&source.display().to_string());
    let report = describe(&source, &p);
    if allow {
        return Ok(Some(format!(
            "warning: mounting a partial model (--allow-partial): {report}\n  \
             Only its tensor files are served."
        )));
    }
    let fix = if p.has_fallback {
        "Give the dense original it was encoded from as --dense FILE (-o dense=FILE)"
    } else {
        "Mount it over the dense original it was encoded from: --dense FILE (the GGUF; \
         -o dense=FILE)"
    };
    Err(format!(
        "{report}\n  {fix}, or mount only its tensor files with --allow-partial \
         (-o allow_partial)."
    ))
}

fn describe(source: &str, p: &PartialModel) -> String {
    let mut out = format!(
        "{source} cannot serve its model: missing {}\n  why: {}\n  model.gguf is not offered: {}",
        p.missing.join("; "),
        p.why,
        p.gguf
    );
    if let Some(hf) = &p.hf {
        out.push_str(&format!("\n  hf/ is not offered: {hf}"));
    }
    out
}
