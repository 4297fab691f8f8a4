//! `rknot-mount SOURCE MOUNTPOINT`: serve every tensor of a model file as a
//! file of decoded little-endian f32, and the whole model as
//! `model.safetensors` and `model.gguf`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use rknot::fs::views::ViewSet;
use rknot::mount::{self, MountRequest};

#[derive(Parser)]
#[command(
    name = "rknot-mount",
    version = rknot::LONG_VERSION,
    about = "Mount a .rknot, SK32, dense .knot or GGUF model read-only: every tensor becomes a file of raw little-endian f32, and the model a model.safetensors and a model.gguf engines load directly",
    after_help = "Unmount with `fusermount3 -u MOUNTPOINT` (or `umount`), or send SIGTERM/SIGINT to the daemon: \
                  it cancels its encoding jobs and unmounts; files still open on the mount are cut off \
                  after --stop-timeout seconds or at a second signal.\n\
                  Logging: RUST_LOG (default info); in the background to --log-file."
)]
struct Cli {
    /// Model file: .rknot, SK32 sketch, dense .knot or GGUF.
    source: PathBuf,
    /// Empty directory to mount on.
    mountpoint: PathBuf,
    /// Dense fallback (GGUF or dense .knot) for tensors SOURCE lacks.
    #[arg(long)]
    dense: Option<PathBuf>,
    /// Decoded-block cache in MiB [default: 256].
    #[arg(long)]
    cache_mb: Option<u64>,
    /// FUSE worker threads [default: number of CPUs, 2..=16].
    #[arg(long)]
    threads: Option<usize>,
    /// Stay attached (for systemd); log to stderr.
    #[arg(short, long)]
    foreground: bool,
    /// Tensor formats to serve, comma-separated: f32 (always), f16, bf16.
    /// f16/bf16 add NAME.f16/NAME.bf16 files and model.f16.safetensors /
    /// model.bf16.safetensors [default: f32].
    #[arg(long, value_name = "LIST", value_parser = ViewSet::parse)]
    views: Option<ViewSet>,
    /// Mount options, comma-separated (repeatable): allow_other, allow_root,
    /// default_permissions, uid=, gid=, fsname=, direct_io, cache_mb=,
    /// threads=, prefetch_threads=, readahead_kb=, chunk_kb=, dense=, views=,
    /// jobs_dir=, max_jobs=, nojobs, stop_timeout=, manifest=,
    /// unverified=hold|allow.
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// Directory where `ctl` encoding jobs write their outputs [default: the
    /// source file's directory].
    #[arg(long)]
    jobs_dir: Option<PathBuf>,
    /// Log file of the background daemon [default:
    /// /var/log/rknot/mount-<mountpoint tail>-<hash>.log for root, else in
    /// ~/.local/state/rknot/].
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// Seconds from the first SIGTERM/SIGINT/SIGHUP until files still open
    /// on the mount are cut off (FUSE connection aborted) and the daemon
    /// exits; a second signal does it at once [default: 10].
    #[arg(long, value_name = "SECS")]
    stop_timeout: Option<u64>,
    /// Check the source files against this sha256sum-format manifest
    /// (`rknot manifest`, or a plain SHA256SUMS): a file it does not list,
    /// or whose header differs, is not mounted; a tensor whose bytes differ
    /// fails its reads with EIO. See -o unverified= for plain SHA256SUMS.
    #[arg(long, value_name = "FILE.sums")]
    manifest: Option<PathBuf>,
}

fn main() -> ExitCode {
    let c = Cli::parse();
    mount::run(MountRequest {
        source: c.source,
        mountpoint: c.mountpoint,
        dense: c.dense,
        cache_mb: c.cache_mb,
        threads: c.threads,
        foreground: c.foreground,
        options: c.options,
        log_file: c.log_file,
        views: c.views,
        jobs_dir: c.jobs_dir,
        stop_timeout: c.stop_timeout,
        manifest: c.manifest,
    })
}
