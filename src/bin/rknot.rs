//! `rknot`: inspect and read compressed model files.

use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use rknot::backend::{self, Backend};
use rknot::progress::{Meter, Mode, Unit};
use rknot::report;
use rknot::source::cli::RemoteArgs;
use rknot::text::escape_json_text;

#[derive(Parser)]
#[command(
    name = "rknot",
    version = rknot::LONG_VERSION,
    about = "Inspect and decode .rknot, SK32, dense .knot and GGUF model files"
)]
struct Cli {
    /// Show no progress on stderr (by default long work shows a bar with
    /// ETA on a terminal, otherwise a plain line at most every 10 s or 10%
    /// of the work and a final line; stdout never carries progress).
    #[arg(long, global = true)]
    no_progress: bool,
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
        /// Print JSON instead of text. Metadata arrays longer than 1024
        /// elements and strings longer than 64 KiB are summarized as
        /// {"type": .., "len": .., "omitted": true} (as in index.json).
        #[arg(long)]
        json: bool,
        /// With --json: print every metadata value in full (streamed; a
        /// tokenizer's arrays can make this tens of MB).
        #[arg(long, requires = "json")]
        full: bool,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Write a tensor's decoded little-endian f32 bytes to stdout: exactly
    /// what the mount serves for it.
    Cat {
        /// Model file (.rknot, SK32 sketch, dense .knot or GGUF).
        file: PathBuf,
        /// Tensor name, GGUF-dot (blk.0.attn_q.weight) or underscore spelling.
        tensor: String,
        /// Dense fallback (GGUF or dense .knot) for tensors FILE lacks.
        #[arg(long, value_name = "FILE")]
        dense: Option<PathBuf>,
        /// First byte to write: inside the tensor (below its size in bytes,
        /// 4 x elements); an offset past its end is refused (at the end: nothing).
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// Bytes to write at most (default: to the end of the tensor).
        #[arg(long)]
        length: Option<u64>,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Encode a dense model (GGUF or dense .knot) into SK32, .rknot or
    /// dense .knot. Writes a temporary file next to the output, then
    /// renames it: a failed or killed encoding leaves nothing at OUT. OUT
    /// gets at most the input's permission bits; an existing OUT is replaced
    /// only with --overwrite, and the input itself never. OUT may be
    /// s3://BUCKET/KEY: a multipart upload, visible only once complete,
    /// aborted on failure, SIGINT or SIGTERM; an existing object is
    /// replaced only with --overwrite (conditional completion).
    Encode {
        #[command(subcommand)]
        what: EncodeCmd,
    },
    /// Check an encoded file's structure (every offset, table and block);
    /// with --dense, also its fidelity per tensor. Exits 1 on any fault.
    Verify {
        /// Encoded file (.rknot, SK32, dense .knot or GGUF).
        encoded: PathBuf,
        /// The dense model it was encoded from.
        #[arg(long)]
        dense: Option<PathBuf>,
        /// Only check every stored byte of ENCODED (and --dense) against the
        /// checksums the files carry, and against --manifest when given:
        /// nothing decoded, with progress; exit 1 naming each damaged block
        /// group, chunk or tensor.
        #[arg(long)]
        integrity: bool,
        /// Print the report as JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Also check ENCODED (and --dense) against this sha256sum-format
        /// manifest (`rknot manifest`, or a plain SHA256SUMS): whole file,
        /// header and every tensor it lists; each mismatch is named.
        #[arg(long, value_name = "FILE.sums")]
        manifest: Option<PathBuf>,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Write a manifest: in sha256sum format, the SHA-256 of FILE (and
    /// --dense) whole, of its header and of each tensor's stored bytes, for
    /// `rknot-mount --manifest` and `rknot verify --manifest`. `sha256sum -c
    /// OUT` in the files' directory checks the whole files with stock tools.
    /// Written atomically; an existing OUT is replaced only with --force.
    Manifest {
        /// Model file (.rknot, SK32, dense .knot or GGUF).
        file: PathBuf,
        /// The dense fallback mounted with it, listed too.
        #[arg(long)]
        dense: Option<PathBuf>,
        /// Where the manifest goes (conventionally next to the files).
        #[arg(short, long, value_name = "OUT.sums")]
        out: PathBuf,
        /// Replace an existing OUT.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Run the model in fp32 over the tensors served (file, layered file
    /// or mounted directory): top-K next tokens, greedy generation,
    /// perplexity, and agreement with a reference (--compare).
    Probe(rknot::probe::ProbeArgs),
    /// Run the model in fp32 over a calibration text and write, for every
    /// matrix input of every layer, the per-channel mean of x² (and with
    /// --gram the Gram matrix XᵀX / n) to a STATS file.
    Calibrate(rknot::probe::calibrate::CalibrateArgs),
    /// Benchmarks (numbers and ratios measured in one run).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Print a shell completion script to stdout, e.g. `rknot completions
    /// bash > /etc/bash_completion.d/rknot`.
    Completions {
        /// The shell the script is for.
        shell: clap_complete::Shell,
        /// Complete rknot-mount instead of rknot.
        #[arg(long)]
        mount: bool,
    },
    /// Write the man pages: rknot(1), one per subcommand (rknot-cat(1),
    /// rknot-encode-sk32(1), ...) and rknot-mount(1), into --out; without
    /// --out, print rknot(1) to stdout.
    Manpage {
        /// Directory for the pages, e.g. /usr/local/share/man/man1 (must
        /// exist; pages there are replaced).
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum EncodeCmd {
    /// Every block matrix as a truncated-SVD sketch (never token_embd/output).
    Sk32 {
        /// Dense source (GGUF or dense .knot).
        dense: PathBuf,
        /// Output SK32 file.
        #[arg(short, long, value_name = "OUT")]
        out: PathBuf,
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
        whiten: rknot::encode::sk32_act::Whitening,
        /// Replace an existing OUT.
        #[arg(long)]
        overwrite: bool,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Spectral-residual .rknot of the attention and FFN matrices.
    Rknot {
        /// Dense source (GGUF or dense .knot).
        dense: PathBuf,
        /// Output .rknot file.
        #[arg(short, long, value_name = "OUT")]
        out: PathBuf,
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
        /// says so before it runs) or calibrated (affine blocks chosen
        /// with activation statistics; what --calibrate selects).
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
    },
    /// GGUF -> dense .knot repack (ggml blocks verbatim).
    Knot {
        /// GGUF source.
        gguf: PathBuf,
        /// Output dense .knot file.
        #[arg(short, long, value_name = "OUT")]
        out: PathBuf,
        /// Replace an existing OUT.
        #[arg(long)]
        overwrite: bool,
        #[command(flatten)]
        remote: RemoteArgs,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
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
}

fn main() -> ExitCode {
    rknot::logging::init("warn", None);
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Copied above; now out of `ps` (presigned URLs' signatures).
    rknot::source::hide_url_secrets_in_argv();
    let cli = Cli::parse_from(args);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast::<Usage>() {
            // Reported as clap reports its own usage errors: exit 2.
            Ok(u) => subcommand(Cli::command(), u.cmd)
                .error(clap::error::ErrorKind::ValueValidation, u.msg)
                .exit(),
            Err(e) => {
                eprintln!("rknot: error: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// A usage error found after parsing (a value that makes no sense for the
/// file given): exit 2, like clap's own. `cmd` is the subcommand's path,
/// for the usage line.
#[derive(Debug)]
struct Usage {
    cmd: &'static [&'static str],
    msg: String,
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Usage {}

fn usage(cmd: &'static [&'static str], msg: String) -> Box<dyn std::error::Error> {
    Box::new(Usage { cmd, msg })
}

/// The (built) subcommand at `path` of `cmd`, or `cmd` itself.
fn subcommand(mut cmd: clap::Command, path: &[&str]) -> clap::Command {
    cmd.build();
    for name in path {
        match cmd.find_subcommand(name) {
            Some(s) => cmd = s.clone(),
            None => break,
        }
    }
    cmd
}

/// The remote-source flags of subcommand `cmd`, set for every source it
/// opens; a bad value is a usage error.
fn install_remote(
    cmd: &'static [&'static str],
    remote: &RemoteArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    remote.install().map_err(|m| usage(cmd, m))
}

/// clap value parser: a count of at least 1.
fn at_least_1(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// clap value parser: `bench remote --shapes`, a synthetic shape or "none".
fn shape_or_none(s: &str) -> Result<String, String> {
    if s == "none" || rknot::synth::SHAPES.contains(&s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "unknown shape (known: {}, or none)",
            rknot::synth::SHAPES.join(", ")
        ))
    }
}

/// clap value parser: a size of at least 1.
fn at_least_1_u64(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
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

/// The encoders take a dense model: re-encoding a lossy file (SK32, .rknot)
/// would compound its error, and `encode knot` repacks GGUF blocks only.
fn check_encode_input(
    cmd: &'static [&'static str],
    b: &dyn Backend,
    path: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let format = b.summary().format;
    let shown = rknot::text::escape(&path.to_string_lossy()).to_string();
    if cmd == ["encode", "knot"] {
        if format != rknot::format::FileFormat::Gguf {
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

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let mode = Mode::cli(!cli.no_progress);
    match cli.cmd {
        Cmd::Inspect {
            file,
            dense,
            json,
            full,
            remote,
        } => {
            install_remote(&["inspect"], &remote)?;
            let b = backend::open(&file, dense.as_deref())?;
            if json {
                // Streamed: one tensor's JSON at a time.
                let doc = if full {
                    report::InspectJson::full(b.as_ref())
                } else {
                    report::InspectJson::summarized(b.as_ref(), report::ARRAY_SUMMARY_LIMIT)
                };
                let out = io::BufWriter::new(io::stdout().lock());
                return report::write_inspect_json(&doc, out).or_else(quiet_pipe);
            }
            write_stdout(report::inspect_text(b.as_ref()).as_bytes())
        }
        Cmd::Cat {
            file,
            tensor,
            dense,
            offset,
            length,
            remote,
        } => {
            install_remote(&["cat"], &remote)?;
            let b = backend::open(&file, dense.as_deref())?;
            cat(b.as_ref(), &tensor, offset, length)
        }
        Cmd::Encode { what } => encode(what, mode),
        Cmd::Verify {
            encoded,
            dense,
            integrity: true,
            json,
            manifest,
            remote,
        } => {
            install_remote(&["verify"], &remote)?;
            let r = rknot::verify::verify_integrity(&encoded, mode);
            let rd = dense
                .as_deref()
                .map(|d| rknot::verify::verify_integrity(d, mode));
            let checked = match &manifest {
                Some(m) => Some(check_manifest(m, &encoded, dense.as_deref(), mode)?),
                None => None,
            };
            let text = if json {
                let mut doc = r.to_json();
                if let Some(obj) = doc.as_object_mut() {
                    if let Some(d) = &rd {
                        obj.insert("dense".into(), d.to_json());
                    }
                    if let Some(c) = &checked {
                        obj.insert("manifest".into(), c.to_json());
                    }
                }
                let mut s = escape_json_text(serde_json::to_string_pretty(&doc)?);
                s.push('\n');
                s
            } else {
                let mut t = r.to_text();
                if let Some(d) = &rd {
                    t += &d.to_text();
                }
                if let Some(c) = &checked {
                    t += &c.to_text();
                }
                t
            };
            write_stdout(text.as_bytes())?;
            let problems: Vec<&rknot::Error> = r
                .problems()
                .chain(rd.iter().flat_map(|d| d.problems()))
                .collect();
            if let Some(first) = problems.first() {
                Err(Box::new(rknot::Error::new(
                    rknot::ErrorKind::Checksum,
                    format!("{} checksum problem(s); first: {first}", problems.len()),
                )))
            } else if let Some(c) = checked.filter(|c| !c.mismatches.is_empty()) {
                Err(c.error().into())
            } else {
                Ok(())
            }
        }
        Cmd::Verify {
            encoded,
            dense,
            json,
            manifest,
            remote,
            ..
        } => {
            install_remote(&["verify"], &remote)?;
            let r = rknot::verify::verify(&encoded, dense.as_deref(), mode)?;
            let checked = match &manifest {
                Some(m) => Some(check_manifest(m, &encoded, dense.as_deref(), mode)?),
                None => None,
            };
            let text = if json {
                let mut doc = r.to_json();
                if let (Some(c), Some(obj)) = (&checked, doc.as_object_mut()) {
                    obj.insert("manifest".into(), c.to_json());
                }
                let mut s = escape_json_text(serde_json::to_string_pretty(&doc)?);
                s.push('\n');
                s
            } else {
                let mut t = r.to_text();
                if let Some(c) = &checked {
                    t += &c.to_text();
                }
                t
            };
            write_stdout(text.as_bytes())?;
            if !r.faults.is_empty() {
                Err(Box::new(rknot::verify::faults_error(&r)))
            } else if let Some(c) = checked.filter(|c| !c.mismatches.is_empty()) {
                Err(c.error().into())
            } else {
                Ok(())
            }
        }
        Cmd::Manifest {
            file,
            dense,
            out,
            force,
            remote,
        } => {
            install_remote(&["manifest"], &remote)?;
            let mut files = vec![file.as_path()];
            files.extend(dense.as_deref());
            let progress = Meter::new("manifest", Unit::Bytes, mode);
            let t0 = std::time::Instant::now();
            let w = rknot::integrity::manifest::write_manifest(&files, &out, force, &progress)?;
            eprintln!(
                "rknot: wrote {} ({} lines; {} bytes hashed in {:.1} s)",
                rknot::text::escape(&out.to_string_lossy()),
                w.lines,
                w.bytes_hashed,
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Cmd::Probe(a) => {
            install_remote(&["probe"], &a.remote)?;
            rknot::probe::run(a)
        }
        Cmd::Calibrate(a) => {
            install_remote(&["calibrate"], &a.remote)?;
            rknot::probe::calibrate::run(a)
        }
        Cmd::Completions { shell, mount } => {
            let (mut cmd, name) = if mount {
                (rknot::mount::cli::MountCli::command(), "rknot-mount")
            } else {
                (Cli::command(), "rknot")
            };
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, name, &mut script);
            write_stdout(&script)
        }
        Cmd::Manpage { out: None } => {
            let mut page = Vec::new();
            clap_mangen::Man::new(Cli::command()).render(&mut page)?;
            write_stdout(&page)
        }
        Cmd::Manpage { out: Some(dir) } => {
            for cmd in [Cli::command(), rknot::mount::cli::MountCli::command()] {
                let mut cmd = cmd.disable_help_subcommand(true);
                cmd.build();
                write_manpages(&cmd, &dir)?;
            }
            Ok(())
        }
        Cmd::Bench {
            what:
                BenchCmd::Mount {
                    dir,
                    rounds,
                    size_mb,
                    random_reads,
                    decoded_dir,
                },
        } => {
            let exe = std::env::current_exe()?;
            let mount_bin = exe.with_file_name("rknot-mount");
            let opts = rknot::bench::MountBenchOpts {
                dir,
                rounds,
                size_mb,
                random_reads,
                mount_bin,
                decoded_dir,
                progress: mode,
            };
            let report = rknot::bench::mount_bench(&opts)?;
            write_stdout(report.as_bytes())
        }
        Cmd::Bench {
            what:
                BenchCmd::Remote {
                    dir,
                    model,
                    size_mb,
                    rounds,
                    shapes,
                },
        } => {
            let exe = std::env::current_exe()?;
            let opts = rknot::bench::RemoteBenchOpts {
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
            let report = rknot::bench::remote_bench(&opts)?;
            write_stdout(report.as_bytes())
        }
        Cmd::Bench {
            what: BenchCmd::Checksums { file, dir, rounds },
        } => {
            let report = rknot::bench::checksums_bench(&file, &dir, rounds, mode)?;
            write_stdout(report.as_bytes())
        }
    }
}

fn encode(what: EncodeCmd, mode: Mode) -> Result<(), Box<dyn std::error::Error>> {
    use rknot::encode::output::OutputTarget;
    use rknot::encode::{self, Progress};
    // An object store has no inode to compare: an output URL naming the
    // input is refused by name (with --overwrite it would replace the
    // model being read).
    let (out_path, in_path, cmd): (&PathBuf, &PathBuf, &'static [&'static str]) = match &what {
        EncodeCmd::Sk32 { out, dense, .. } => (out, dense, &["encode", "sk32"]),
        EncodeCmd::Rknot { out, dense, .. } => (out, dense, &["encode", "rknot"]),
        EncodeCmd::Knot { out, gguf, .. } => (out, gguf, &["encode", "knot"]),
    };
    if let Some(o) = out_path.to_str().filter(|o| rknot::source::is_remote(o)) {
        let same = in_path.to_str().is_some_and(|i| {
            rknot::source::redact(i).eq_ignore_ascii_case(&rknot::source::redact(o))
        });
        if same {
            return Err(usage(
                cmd,
                format!(
                    "{}: the output is the input: refusing to replace the model being encoded",
                    rknot::source::redact(o)
                ),
            ));
        }
        if let Err(m) = rknot::source::upload::parse_output_url(o) {
            return Err(usage(cmd, format!("{}: {m}", rknot::source::redact(o))));
        }
        // Interrupted, the upload is aborted rather than left stored.
        rknot::source::upload::abort_on_signals();
    }
    let progress = Progress::for_cli(mode);
    let t0 = std::time::Instant::now();
    let (out, input, source, summary) = match what {
        EncodeCmd::Sk32 {
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
        } => {
            install_remote(&["encode", "sk32"], &remote)?;
            let stats = calibration_stats
                .as_deref()
                .map(rknot::probe::calibrate::read_stats)
                .transpose()?;
            let b = backend::open(&dense, None)?;
            check_encode_input(&["encode", "sk32"], b.as_ref(), &dense)?;
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
            let entries = encode::sk32::encode_sk32_calibrated(
                b.as_ref(),
                &target,
                &o,
                calibration,
                &progress,
            )?;
            let mean_rank =
                entries.iter().map(|e| e.rank as f64).sum::<f64>() / entries.len().max(1) as f64;
            (
                out,
                dense,
                b,
                match calibration {
                    None => format!("{} sketches, mean rank {mean_rank:.1}", entries.len()),
                    Some(c) => format!(
                        "{} sketches, mean rank {mean_rank:.1}, activation-weighted ({})",
                        entries.len(),
                        c.whitening.name()
                    ),
                },
            )
        }
        EncodeCmd::Rknot {
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
        } => {
            const CMD: &[&str] = &["encode", "rknot"];
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
                        format!("unknown --profile {p:?} (faithful, seed, calibrated)"),
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
            let allocation =
                encode::calibrated::Allocation::parse(&allocation).ok_or_else(|| {
                    usage(
                        CMD,
                        format!("unknown --allocation {allocation:?} (balanced, output, relative, uniform)"),
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
                    (_, Some(path)) => rknot::probe::calibrate::read_stats(path)?,
                    (Some(text), None) => {
                        eprintln!(
                            "rknot: calibrating on {} (ctx {calibration_ctx}, with Gram matrices)",
                            rknot::text::escape(&text.to_string_lossy())
                        );
                        let args = rknot::probe::calibrate::CalibrateArgs {
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
                            weights: rknot::probe::Residency::Auto,
                            tokenizer: None,
                        };
                        rknot::probe::calibrate::record(&args, &mut std::io::stderr())
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
            let entries = encode::rknot::encode_rknot(b.as_ref(), &target, &o, &progress)?;
            let summary = if calibrating && profile == encode::rknot::Profile::Calibrated {
                format!("{} tensors, calibrated", entries.len())
            } else {
                format!("{} tensors", entries.len())
            };
            (out, dense, b, summary)
        }
        EncodeCmd::Knot {
            gguf,
            out,
            overwrite,
            remote,
        } => {
            install_remote(&["encode", "knot"], &remote)?;
            let b = backend::open(&gguf, None)?;
            check_encode_input(&["encode", "knot"], b.as_ref(), &gguf)?;
            let target = OutputTarget::from_sources(&out, overwrite, &b.source_files())?;
            encode::knot::encode_knot(b.as_ref(), &target, &progress)?;
            (out, gguf, b, "dense .knot".to_string())
        }
    };
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
        rknot::text::escape(&out.to_string_lossy()),
        per_weight(size),
        per_weight(payload),
    );
    // How far from the input the output is, and what that means for
    // answers (decodes both once: seconds for SmolLM2).
    let fidelity = written.as_ref().and_then(|e| {
        let meter = Meter::new("measure error", Unit::Work, mode);
        rknot::verify::overall_error(e.as_ref(), source.as_ref(), &meter)
    });
    if let Some(e) = fidelity {
        // The verdicts come from encodings that minimise the weight error;
        // the calibrated profile minimises the output error instead, and
        // its weight error says little about its answers.
        let verdict = if summary.ends_with(", calibrated") {
            "the calibrated profile minimises the output error on real activations, not this \
             figure: measure answers with rknot probe --perplexity (docs/QUALITY.md)"
        } else {
            rknot::verify::verdict(e)
        };
        eprintln!(
            "rknot: overall relative weight error {e:.4} against {}: {verdict}",
            rknot::text::escape(&input.to_string_lossy()),
        );
    }
    Ok(())
}

/// `verify --manifest`: the files against the manifest (the check itself is
/// `integrity::manifest::check_paths`).
fn check_manifest(
    manifest: &std::path::Path,
    encoded: &std::path::Path,
    dense: Option<&std::path::Path>,
    mode: Mode,
) -> Result<rknot::integrity::manifest::Checked, Box<dyn std::error::Error>> {
    use rknot::integrity::manifest::{Checked, Manifest, check_paths};
    let m = Manifest::read(manifest)?;
    let mut files = vec![encoded];
    files.extend(dense);
    let meter = Meter::new("verify --manifest", Unit::Bytes, mode);
    let mismatches = check_paths(&files, &m, &meter)?;
    Ok(Checked {
        manifest: manifest.to_path_buf(),
        mismatches,
    })
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
    // At the end is an empty read, as read(2) at end of file; past it is
    // a mistake.
    if offset > size {
        return Err(usage(
            &["cat"],
            format!(
                "--offset {offset} is past the end of tensor {} ({size} bytes: offsets 0..={size})",
                rknot::text::escape(tensor),
            ),
        ));
    }
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

/// The man page of `cmd` and of each of its subcommands, into `dir`.
fn write_manpages(
    cmd: &clap::Command,
    dir: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let man = clap_mangen::Man::new(cmd.clone());
    let path = dir.join(man.get_filename());
    let shown = || rknot::text::escape(&path.to_string_lossy()).to_string();
    let mut page = Vec::new();
    man.render(&mut page)?;
    std::fs::write(&path, page).map_err(|e| format!("cannot write {}: {e}", shown()))?;
    eprintln!("rknot: wrote {}", shown());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_manpages(sub, dir)?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every subcommand and every argument, here and in rknot-mount, says
    /// what it is in `--help` (and so in the man pages).
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        let path = format!("{path} {}", cmd.get_name());
        if cmd.get_about().is_none() && cmd.get_long_about().is_none() {
            out.push(path.clone());
        }
        for a in cmd.get_arguments() {
            if a.get_help().is_none() && a.get_long_help().is_none() {
                out.push(format!("{path} {}", a.get_id()));
            }
        }
        for s in cmd.get_subcommands() {
            undocumented(s, &path, out);
        }
    }

    #[test]
    fn every_subcommand_and_argument_has_help() {
        Cli::command().debug_assert();
        rknot::mount::cli::MountCli::command().debug_assert();
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "", &mut missing);
        undocumented(&rknot::mount::cli::MountCli::command(), "", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
