//! The `rknot` command line: one module per subcommand, each holding its
//! clap arguments next to the code they drive; `src/bin/rknot.rs` only
//! parses and dispatches. Flags shared with `rknot-mount` (remote sources)
//! are [`crate::source::cli::RemoteArgs`]; value parsers shared by several
//! subcommands are in [`values`].

use std::io::{self, Write};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use crate::progress::Mode;
use crate::source::cli::RemoteArgs;

pub mod bench;
pub mod cat;
pub mod encode;
pub mod inspect;
pub mod manifest;
pub mod manpage;
pub mod probe;
pub mod values;
pub mod verify;

#[derive(Parser)]
#[command(
    name = "rknot",
    version = crate::LONG_VERSION,
    about = "Inspect and decode .rknot, SK32, dense .knot and GGUF model files"
)]
pub struct Cli {
    /// Show no progress on stderr (by default long work shows a bar with
    /// ETA on a terminal, otherwise a plain line at most every 10 s or 10%
    /// of the work and a final line; stdout never carries progress).
    #[arg(long, global = true)]
    pub no_progress: bool,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Show format, metadata and a table of every tensor.
    Inspect(inspect::InspectArgs),
    /// Write a tensor's decoded little-endian f32 bytes to stdout: exactly
    /// what the mount serves for it.
    Cat(cat::CatArgs),
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
        what: encode::EncodeCmd,
    },
    /// Check an encoded file's structure (every offset, table and block);
    /// with --dense, also its fidelity per tensor. Exits 1 on any fault.
    Verify(verify::VerifyArgs),
    /// Write a manifest: in sha256sum format, the SHA-256 of FILE (and
    /// --dense) whole, of its header and of each tensor's stored bytes, for
    /// `rknot-mount --manifest` and `rknot verify --manifest`. `sha256sum -c
    /// OUT` in the files' directory checks the whole files with stock tools.
    /// Written atomically; an existing OUT is replaced only with --force.
    Manifest(manifest::ManifestArgs),
    /// Run the model in fp32 over the tensors served (file, layered file
    /// or mounted directory): top-K next tokens, greedy generation,
    /// perplexity, and agreement with a reference (--compare).
    Probe(crate::probe::ProbeArgs),
    /// Run the model in fp32 over a calibration text and write, for every
    /// matrix input of every layer, the per-channel mean of x² (and with
    /// --gram the Gram matrix XᵀX / n) to a STATS file.
    Calibrate(crate::probe::calibrate::CalibrateArgs),
    /// Benchmarks (numbers and ratios measured in one run).
    Bench {
        #[command(subcommand)]
        what: bench::BenchCmd,
    },
    /// Print a shell completion script to stdout, e.g. `rknot completions
    /// bash > /etc/bash_completion.d/rknot`.
    Completions(manpage::CompletionsArgs),
    /// Write the man pages: rknot(1), one per subcommand (rknot-cat(1),
    /// rknot-encode-sk32(1), ...) and rknot-mount(1), into --out; without
    /// --out, print rknot(1) to stdout.
    Manpage(manpage::ManpageArgs),
}

/// What every subcommand returns: a [`Usage`] error exits 2, any other 1.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

/// Run the parsed command line.
pub fn run(cli: Cli) -> CliResult {
    let mode = Mode::cli(!cli.no_progress);
    match cli.cmd {
        Cmd::Inspect(a) => a.run(),
        Cmd::Cat(a) => a.run(),
        Cmd::Encode { what } => what.run(mode),
        Cmd::Verify(a) => a.run(mode),
        Cmd::Manifest(a) => a.run(mode),
        Cmd::Probe(a) => probe::probe(a),
        Cmd::Calibrate(a) => probe::calibrate(a),
        Cmd::Completions(a) => a.run(),
        Cmd::Manpage(a) => a.run(),
        Cmd::Bench { what } => what.run(mode),
    }
}

/// The exit status of `result`, its error reported on stderr: usage
/// errors as clap reports its own (exit 2), others as `rknot: error: ..`.
pub fn exit_code(result: CliResult) -> ExitCode {
    match result {
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
pub struct Usage {
    cmd: &'static [&'static str],
    msg: String,
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Usage {}

pub(crate) fn usage(cmd: &'static [&'static str], msg: String) -> Box<dyn std::error::Error> {
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
pub(crate) fn install_remote(cmd: &'static [&'static str], remote: &RemoteArgs) -> CliResult {
    remote.install().map_err(|m| usage(cmd, m))
}

pub(crate) fn write_stdout(bytes: &[u8]) -> CliResult {
    let mut out = io::stdout().lock();
    out.write_all(bytes).or_else(quiet_pipe)?;
    out.flush().or_else(quiet_pipe)
}

/// A closed pipe (`rknot cat ... | head`) ends output quietly.
pub(crate) fn quiet_pipe(e: io::Error) -> CliResult {
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
        crate::mount::cli::MountCli::command().debug_assert();
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "", &mut missing);
        undocumented(&crate::mount::cli::MountCli::command(), "", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
