//! `rknot bench`: benchmarks (numbers and ratios measured in one run);
//! the measurements themselves are [`crate::bench`].

use std::path::PathBuf;

use clap::Subcommand;

use super::values::{at_least_1, at_least_1_u64};
use super::{CliResult, write_stdout};
use crate::progress::Mode;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Decode throughput and FUSE reads (cold, warm, random 4 KiB, tmpfs
    /// baseline) in page-cache and direct_io modes, and files served from a
    /// --decoded-cache store by passthrough against a local file; needs
    /// root and fuse3.
    Mount {
        /// Scratch directory for the synthetic model and the mountpoints.
        #[arg(long, default_value = "/tmp/rknot-bench")]
        dir: PathBuf,
        /// Rounds of every measurement, at least 1 (medians are reported).
        #[arg(long, default_value_t = 3, value_parser = at_least_1)]
        rounds: usize,
        /// Decoded size of each benchmark tensor, MiB, at least 64.
        #[arg(long, default_value_t = 128, value_parser = size_mb_at_least_64)]
        size_mb: u64,
        /// Cold 4 KiB reads per tensor, mode and round, at least 1.
        #[arg(long, default_value_t = 200, value_parser = at_least_1)]
        random_reads: usize,
        /// Directory of the decoded-cache section: the mount's
        /// --decoded-cache store AND the plain-file baseline it is compared
        /// with both live here, so they are on the same filesystem (which
        /// decides the speed: ext4, tmpfs, huge=always tmpfs differ)
        /// [default: DIR/decoded].
        #[arg(long, value_name = "DIR")]
        decoded_dir: Option<PathBuf>,
    },
    /// A model served over HTTP from a loopback server in this process and
    /// mounted with `rknot-mount http://...`: cold sequential read against
    /// curl, warm read from --source-cache against a local-file mount, and
    /// what a mount costs (bytes fetched, time to first byte) for the
    /// model and 7B/70B-shaped synthetic ones; needs root, fuse3 and curl.
    Remote {
        /// Scratch directory for synthetic models, mountpoints and the
        /// source cache.
        #[arg(long, default_value = "/tmp/rknot-bench-remote")]
        dir: PathBuf,
        /// GGUF model to serve [default: SmolLM2 when found
        /// (RKNOT_SMOLLM2, else models/SmolLM2-135M-Instruct.Q4_1.gguf),
        /// unless --size-mb is given; else a 64 MiB synthetic model].
        #[arg(long, value_name = "FILE", conflicts_with = "size_mb")]
        model: Option<PathBuf>,
        /// Serve a synthetic Q4_K model of this many MiB of tensor data,
        /// at least 1.
        #[arg(long, value_parser = at_least_1_u64)]
        size_mb: Option<u64>,
        /// Rounds of every measurement, at least 1 (medians are reported).
        #[arg(long, default_value_t = 3, value_parser = at_least_1)]
        rounds: usize,
        /// Synthetic sparse models (header, then a hole) whose mount cost is
        /// measured too, comma-separated; "none" for none.
        #[arg(
            long,
            default_value = "qwen2.5-7b,llama3-70b",
            value_delimiter = ',',
            value_parser = shape_or_none
        )]
        shapes: Vec<String>,
    },
    /// Cost of verifying checksums on the read path: every tensor of FILE
    /// (with checksums) read in full against a copy without them, rounds
    /// interleaved, medians and their ratio.
    Checksums {
        /// Model file with checksums (.rknot, SK32 or dense .knot).
        file: PathBuf,
        /// Where the copy without checksums goes (removed afterwards).
        #[arg(long, default_value = "/tmp")]
        dir: PathBuf,
        /// Interleaved rounds of each, at least 1 (medians are reported).
        #[arg(long, default_value_t = 5, value_parser = at_least_1)]
        rounds: usize,
    },
    /// Dequantization throughput of every ggml type rknot decodes (one
    /// thread, random blocks), in GB/s of f32 produced and against a memcpy
    /// of as many f32 bytes measured in the same run.
    Kernels {
        /// MiB of f32 each type decodes per round, at least 1.
        #[arg(long, default_value_t = 16, value_parser = at_least_1_u64)]
        size_mb: u64,
        /// Interleaved rounds, at least 1 (medians are reported).
        #[arg(long, default_value_t = 7, value_parser = at_least_1)]
        rounds: usize,
    },
    /// The lossless .rknot codec on bf16 weights: size against bf16 and
    /// the order-0 entropy bound, decode GB/s against memcpy of the same
    /// bytes (one thread), and the seed's fp48 bi-sided packer's ratio; on
    /// a synthetic 7B-shaped layer and, with --model, a model's matrices.
    Lossless {
        /// A dense model (GGUF, safetensors) whose matrices, rounded to
        /// bf16, are benchmarked too (reported apart).
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        /// Fraction of each synthetic matrix's rows, in (0, 1] (1: the
        /// whole layer, 202M weights, ~2.5 GB of memory).
        #[arg(long, default_value_t = 1.0)]
        fraction: f64,
        /// Interleaved rounds, at least 1 (medians are reported).
        #[arg(long, default_value_t = 5, value_parser = at_least_1)]
        rounds: usize,
    },
}

impl BenchCmd {
    pub fn run(self, mode: Mode) -> CliResult {
        match self {
            BenchCmd::Mount {
                dir,
                rounds,
                size_mb,
                random_reads,
                decoded_dir,
            } => {
                let exe = std::env::current_exe()?;
                let mount_bin = exe.with_file_name("rknot-mount");
                let opts = crate::bench::MountBenchOpts {
                    dir,
                    rounds,
                    size_mb,
                    random_reads,
                    mount_bin,
                    decoded_dir,
                    progress: mode,
                };
                let report = crate::bench::mount_bench(&opts)?;
                write_stdout(report.as_bytes())
            }
            BenchCmd::Remote {
                dir,
                model,
                size_mb,
                rounds,
                shapes,
            } => {
                let exe = std::env::current_exe()?;
                let opts = crate::bench::RemoteBenchOpts {
                    dir,
                    model,
                    size_mb,
                    rounds,
                    shapes: shapes
                        .into_iter()
                        .filter(|s| s != "none" && !s.is_empty())
                        .collect(),
                    mount_bin: exe.with_file_name("rknot-mount"),
                    progress: mode,
                };
                let report = crate::bench::remote_bench(&opts)?;
                write_stdout(report.as_bytes())
            }
            BenchCmd::Checksums { file, dir, rounds } => {
                let report = crate::bench::checksums_bench(&file, &dir, rounds, mode)?;
                write_stdout(report.as_bytes())
            }
            BenchCmd::Kernels { size_mb, rounds } => {
                let report = crate::bench::kernels_bench(size_mb, rounds, mode)?;
                write_stdout(report.as_bytes())
            }
            BenchCmd::Lossless {
                model,
                fraction,
                rounds,
            } => {
                let report = crate::bench::lossless_bench(&crate::bench::LosslessBenchOpts {
                    model,
                    fraction,
                    rounds,
                })?;
                write_stdout(report.as_bytes())
            }
        }
    }
}

/// clap value parser: `bench remote --shapes`, a synthetic shape or "none".
fn shape_or_none(s: &str) -> Result<String, String> {
    if s == "none" || crate::synth::SHAPES.contains(&s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "unknown shape (known: {}, or none)",
            crate::synth::SHAPES.join(", ")
        ))
    }
}

/// clap value parser: `bench mount --size-mb`.
fn size_mb_at_least_64(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n < 64 => Err("must be at least 64 (MiB)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
