//! `rknot`: inspect and read compressed model files.

use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use rknot::backend::{self, Backend};
use rknot::report;

#[derive(Parser)]
#[command(
    name = "rknot",
    version,
    about = "Inspect and decode .rknot, SK32, dense .knot and GGUF model files"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show format, metadata and a table of every tensor.
    Inspect {
        /// Model file (.rknot, SK32 sketch, dense .knot or GGUF).
        file: PathBuf,
        /// Dense fallback (GGUF or dense .knot) for tensors FILE lacks.
        #[arg(long)]
        dense: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write a tensor's decoded little-endian f32 bytes to stdout: exactly
    /// what the mount serves for it.
    Cat {
        file: PathBuf,
        /// Tensor name, GGUF-dot (blk.0.attn_q.weight) or underscore spelling.
        tensor: String,
        #[arg(long)]
        dense: Option<PathBuf>,
        /// First byte to write.
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// Bytes to write (default: to the end of the tensor).
        #[arg(long)]
        length: Option<u64>,
    },
    /// Benchmarks (numbers and ratios measured in one run).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Decode throughput and FUSE reads (cold, warm, random 4 KiB, tmpfs
    /// baseline) in page-cache and direct_io modes; needs root and fuse3.
    Mount {
        /// Scratch directory for the synthetic model and the mountpoints.
        #[arg(long, default_value = "/tmp/rknot-bench")]
        dir: PathBuf,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Decoded size of each benchmark tensor, MiB (>= 64).
        #[arg(long, default_value_t = 128)]
        size_mb: u64,
        /// Cold 4 KiB reads per tensor, mode and round.
        #[arg(long, default_value_t = 200)]
        random_reads: usize,
    },
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rknot: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.cmd {
        Cmd::Inspect { file, dense, json } => {
            let b = backend::open(&file, dense.as_deref())?;
            let text = if json {
                let mut s = serde_json::to_string_pretty(&report::inspect_json(b.as_ref()))?;
                s.push('\n');
                s
            } else {
                report::inspect_text(b.as_ref())
            };
            write_stdout(text.as_bytes())
        }
        Cmd::Cat {
            file,
            tensor,
            dense,
            offset,
            length,
        } => {
            let b = backend::open(&file, dense.as_deref())?;
            cat(b.as_ref(), &tensor, offset, length)
        }
        Cmd::Bench {
            what:
                BenchCmd::Mount {
                    dir,
                    rounds,
                    size_mb,
                    random_reads,
                },
        } => {
            let exe = std::env::current_exe()?;
            let mount_bin = exe.with_file_name("rknot-mount");
            let opts = rknot::bench::MountBenchOpts {
                dir,
                rounds: rounds.max(1),
                size_mb: size_mb.max(64),
                random_reads: random_reads.max(1),
                mount_bin,
            };
            let report = rknot::bench::mount_bench(&opts)?;
            write_stdout(report.as_bytes())
        }
    }
}

/// Stream the byte range in chunks so a large tensor never sits in memory.
fn cat(
    b: &dyn Backend,
    tensor: &str,
    offset: u64,
    length: Option<u64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let index = b.find(tensor)?;
    let size = b.tensors().entries()[index].served_bytes();
    let end = match length {
        Some(l) => size.min(offset.saturating_add(l)),
        None => size,
    };
    const CHUNK: usize = 4 << 20;
    let mut buf = vec![0u8; CHUNK];
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let mut pos = offset;
    while pos < end {
        let want = CHUNK.min((end - pos) as usize);
        let n = b.read_bytes(index, pos, &mut buf[..want])?;
        if n == 0 {
            break;
        }
        if let Err(e) = out.write_all(&buf[..n]) {
            return quiet_pipe(e);
        }
        pos += n as u64;
    }
    out.flush().or_else(quiet_pipe)
}

fn write_stdout(bytes: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
    let mut out = io::stdout().lock();
    out.write_all(bytes).or_else(quiet_pipe)?;
    out.flush().or_else(quiet_pipe)
}

/// A closed pipe (`rknot cat ... | head`) ends output quietly.
fn quiet_pipe(e: io::Error) -> Result<(), Box<dyn std::error::Error>> {
    if e.kind() == io::ErrorKind::BrokenPipe {
        Ok(())
    } else {
        Err(Box::new(e))
    }
}
