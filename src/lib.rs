//! rknot: serve compressed LLM weights as plain fp32 tensors.
//!
//! Layers, bottom up (see docs/ARCHITECTURE.md):
//! - [`source`]: positioned reads of source files (no mmap, no SIGBUS);
//! - [`simd`]: which vector build of a kernel runs (detected once);
//! - [`quant`]: ggml dequantization kernels;
//! - [`format`]: readers and writers of .rknot, SK32, dense .knot and GGUF;
//! - [`names`]: tensor spelling and aliasing;
//! - [`backend`]: one trait over all of them, plus the layered
//!   primary + fallback backend.

pub mod arch;
pub mod backend;
pub mod bench;
pub mod cache;
pub mod cli;
pub mod encode;
pub mod error;
pub mod format;
pub mod fs;
pub mod integrity;
pub mod jobs;
pub mod logging;
pub mod mount;
pub mod names;
pub mod output;
pub mod probe;
pub mod progress;
pub mod quant;
pub mod report;
pub mod simd;
pub mod source;
pub mod synth;
pub mod text;
pub mod verify;

pub use error::{Error, ErrorKind, Result};

/// What `--version` prints after the program's name: the crate version, the
/// git commit it was built from ("unknown" outside a git checkout) and the
/// enabled cargo features, e.g. `0.1.0 (git 1a2b3c4d5e6f, features: none)`
/// (made by build.rs).
pub const LONG_VERSION: &str = env!("RKNOT_LONG_VERSION");
