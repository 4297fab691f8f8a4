//! Encoders: dense model -> SK32 sketches, .rknot, dense .knot.
//!
//! Every encoder reads the dense model through a [`Backend`] (the same
//! decode path the mount serves), works on tensors in parallel (rayon),
//! reports progress through [`Progress`] (a terminal progress bar, bounded
//! plain lines otherwise: [`crate::progress`]; or the counters of a `ctl`
//! job), stops early when cancelled, and writes its file atomically
//! ([`output::AtomicOutput`]).

pub mod calibrated;
pub mod gptq;
pub mod knot;
pub mod linalg;
pub mod lossless;
mod order;
/// Atomic output files live below both the encoders and `probe::calibrate`
/// (which writes STATS files); this path stays for the callers that name it.
pub use crate::output;
pub mod rknot;
pub mod sk32;
pub mod sk32_act;

use rayon::prelude::*;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::backend::{Backend, TensorInfo};
use crate::error::{ErrorKind, Result, err};
use crate::progress::{Meter, Mode, Unit};

/// Progress and cancellation shared between an encoder and whoever watches
/// it (the CLI, or a `ctl` job): counters a job reports, and, for a command
/// line, a [`Meter`] (a bar on a terminal, bounded plain lines otherwise).
#[derive(Default)]
pub struct Progress {
    pub total: AtomicU64,
    pub done: AtomicU64,
    pub bytes_written: AtomicU64,
    pub cancelled: AtomicBool,
    meter: Meter,
    started: Mutex<Option<Instant>>,
}

impl Progress {
    /// Progress for a command line, shown as `mode` says (counted in
    /// tensors: rough, tensors differ in size, but it moves the right way).
    pub fn for_cli(mode: Mode) -> Progress {
        Progress {
            meter: Meter::new("encode", Unit::Items("tensors"), mode),
            ..Progress::default()
        }
    }

    pub fn start(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        *self.started.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.meter.set_total(total);
    }

    /// One tensor finished.
    pub fn tick(&self, name: &str) {
        self.done.fetch_add(1, Ordering::Relaxed);
        self.meter.set_message(name);
        self.meter.inc(1);
    }

    pub fn finish(&self) {
        self.meter.finish();
    }

    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    pub fn check(&self) -> Result<()> {
        if self.cancelled.load(Ordering::Relaxed) {
            return Err(err(ErrorKind::Unavailable, "cancelled"));
        }
        Ok(())
    }

    pub fn elapsed_secs(&self) -> f64 {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map_or(0.0, |t| t.elapsed().as_secs_f64())
    }
}

/// `*` and `?` glob match (for `--tensors`).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Iterative matcher with backtracking to the last `*`.
    let (mut pi, mut ni, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

/// The 2-D matrices of the transformer blocks (`blk.N.*`, never the vocab
/// tables), optionally filtered by a glob on the dot name.
pub fn block_matrices<'a>(b: &'a dyn Backend, glob: Option<&str>) -> Vec<(usize, &'a TensorInfo)> {
    b.tensors()
        .entries()
        .iter()
        .enumerate()
        .filter(|(_, t)| {
            t.is_available()
                && t.shape.len() == 2
                && t.name.dot.starts_with("blk.")
                && !crate::names::is_vocab_tensor(&t.name.dot)
                // A mixture-of-experts router stays dense (its 3-D experts
                // are not 2-D matrices and stay dense too).
                && !t.name.dot.ends_with(".ffn_gate_inp.weight")
                && glob
                    .is_none_or(|g| glob_match(g, &t.name.dot) || glob_match(g, &t.name.underscore))
        })
        .collect()
}

/// Decode a whole tensor.
pub fn read_tensor(b: &dyn Backend, index: usize) -> Result<Vec<f32>> {
    let n = b.tensors().entries()[index].n_elements;
    let n =
        usize::try_from(n).map_err(|_| err(ErrorKind::TooLarge, "tensor too large to encode"))?;
    let mut v = vec![0f32; n];
    // In pieces on the rayon pool: encoders hold one matrix at a time, so
    // each read should use every core. A piece is a multiple of every ggml
    // block's element count, so no block is decoded twice.
    const PIECE: usize = 1 << 20;
    v.par_chunks_mut(PIECE)
        .enumerate()
        .try_for_each(|(k, p)| b.read_f32(index, (k * PIECE) as u64, p))?;
    Ok(v)
}

/// The kind of a block tensor (`attn_q`, `ffn_down`, ...), from its name.
pub fn tensor_kind(dot: &str) -> &str {
    let parts: Vec<&str> = dot.split('.').collect();
    if parts.len() == 4 && parts[0] == "blk" {
        parts[2]
    } else {
        dot
    }
}

/// The layer of a block tensor.
pub fn tensor_layer(dot: &str) -> Option<u64> {
    let mut it = dot.split('.');
    (it.next() == Some("blk")).then_some(())?;
    it.next()?.parse().ok()
}

/// Warnings given before an encoding known to break answers runs (the
/// CLI prints them, a job logs them; figures: docs/QUALITY.md, fidelity
/// table).
pub mod warnings {
    pub const SK32: &str = "SK32 sketches do not keep a model answering: on \
        SmolLM2-135M, rank 64 (1.5 bits per weight) gave perplexity 3.1e7 against 20.8 dense \
        and answered \" torchvision\" to \"The capital of France is\"; rank 128, 2.7e8. Use \
        `rknot encode rknot` (faithful profile) for a model to run.";
    pub const SEED_PROFILE: &str = "the seed profile drops the hidden \
        dimensions outside its manifest: on SmolLM2-135M, coverage 0.3 gave perplexity 2.9e5 \
        against 20.8 dense and answered \" respons\" to \"The capital of France is\". The \
        default (--profile faithful) keeps the model answering.";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("blk.*.attn_q.weight", "blk.12.attn_q.weight"));
        assert!(glob_match("*ffn*", "blk.0.ffn_up.weight"));
        assert!(glob_match("blk.?.attn_*", "blk.3.attn_k.weight"));
        assert!(!glob_match("blk.?.attn_*", "blk.13.attn_k.weight"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("a*b", "acd"));
    }

    #[test]
    fn kinds_and_layers() {
        assert_eq!(tensor_kind("blk.3.attn_output.weight"), "attn_output");
        assert_eq!(tensor_layer("blk.3.attn_output.weight"), Some(3));
        assert_eq!(tensor_layer("token_embd.weight"), None);
    }
}
