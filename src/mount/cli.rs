//! The `rknot-mount` command line, in the library so that `rknot manpage`
//! and `rknot completions` can describe it too.

use std::path::PathBuf;

use clap::Parser;

use super::MountRequest;
use crate::fs::views::ViewSet;

#[derive(Parser, Debug)]
#[command(
    name = "rknot-mount",
    version = crate::LONG_VERSION,
    about = "Mount a .rknot, SK32, dense .knot or GGUF model read-only: every tensor becomes a file of raw little-endian f32, and the model a model.safetensors and a model.gguf engines load directly",
    after_help = "Unmount with `fusermount3 -u MOUNTPOINT` (or `umount`), or send SIGTERM/SIGINT to the daemon: \
                  it cancels its encoding jobs and unmounts; files still open on the mount are cut off \
                  after --stop-timeout seconds or at a second signal.\n\
                  Logging: RUST_LOG (default info); in the background to --log-file.\n\
                  mount(8) and /etc/fstab: installed as /sbin/mount.fuse.rknot (a symlink to rknot-mount), \
                  it is mount(8)'s helper for type fuse.rknot: `mount -t fuse.rknot SOURCE DIR -o dense=FILE,...` \
                  and fstab lines `SOURCE DIR fuse.rknot OPTIONS 0 0`, with -o options only \
                  (docs/OPERATIONS.md \"mount(8) and /etc/fstab\").\n\
                  Exit status: 0 mounted (or, in the foreground, stopped by a signal or an unmount); \
                  1 the mount failed (missing or bad file, mountpoint, FUSE); \
                  2 usage error (unknown flag or -o option, bad value), or SOURCE cannot serve its model \
                  whole (tensors missing: give --dense FILE, or --allow-partial)."
)]
pub struct MountCli {
    /// Model file: .rknot, SK32 sketch, dense .knot or GGUF.
    pub source: PathBuf,
    /// Empty directory to mount on.
    pub mountpoint: PathBuf,
    /// Dense fallback (GGUF or dense .knot) for tensors SOURCE lacks.
    #[arg(long, value_name = "FILE")]
    pub dense: Option<PathBuf>,
    /// Mount even when SOURCE cannot serve its model whole (an SK32, or a
    /// --compressed-only .rknot, without --dense): only the tensor files it
    /// has, no model.gguf or hf/; what is missing is printed on stderr.
    /// Without it such a mount is refused (exit 2).
    #[arg(long)]
    pub allow_partial: bool,
    /// Decoded-chunk cache in MiB, at least 1 [default: 256].
    #[arg(long, value_name = "MIB", value_parser = parse_cache_mb)]
    pub cache_mb: Option<u64>,
    /// FUSE worker threads, 1 to 64 [default: number of CPUs, 2..=16].
    #[arg(long, value_name = "N", value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// Stay attached (for systemd); log to stderr.
    #[arg(short, long)]
    pub foreground: bool,
    /// Tensor formats to serve, comma-separated: f32 (always), f16, bf16.
    /// f16/bf16 add NAME.f16/NAME.bf16 files and model.f16.safetensors /
    /// model.bf16.safetensors [default: f32].
    #[arg(long, value_name = "LIST", value_parser = ViewSet::parse)]
    pub views: Option<ViewSet>,
    /// Mount options, comma-separated (repeatable): allow_other, allow_root,
    /// default_permissions, uid=, gid=, fsname=, direct_io, cache_mb=,
    /// threads=, prefetch_threads=, readahead_kb=, chunk_kb=, dense=,
    /// allow_partial, views=, hf_dtype=auto|f32|f16|bf16 (model.safetensors
    /// and hf/: auto is the source's own float dtype where exact, else f32),
    /// jobs_dir=, jobs_remote_prefix=, max_jobs=, nojobs, stop_timeout=, manifest=,
    /// unverified=hold|allow, decoded_cache=, decoded_cache_gb=,
    /// nopassthrough, endpoint=, ca_bundle=, source_cache=,
    /// source_cache_gb=, remote_cache_mb=, part_size_mb=, remote_retries=.
    /// An unknown option or a bad value is a usage
    /// error (exit 2).
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Directory where `ctl` encoding jobs write their outputs [default: the
    /// source file's directory].
    #[arg(long, value_name = "DIR")]
    pub jobs_dir: Option<PathBuf>,
    /// Log file of the background daemon [default:
    /// /var/log/rknot/mount-<mountpoint tail>-<hash>.log for root, else in
    /// ~/.local/state/rknot/].
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,
    /// Seconds from the first SIGTERM/SIGINT/SIGHUP until files still open
    /// on the mount are cut off (FUSE connection aborted) and the daemon
    /// exits; a second signal does it at once [default: 10].
    #[arg(long, value_name = "SECS")]
    pub stop_timeout: Option<u64>,
    /// Check the source files against this sha256sum-format manifest
    /// (`rknot manifest`, or a plain SHA256SUMS): a file it does not list,
    /// or whose header differs, is not mounted; a tensor whose bytes differ
    /// fails its reads with EIO. See -o unverified= for plain SHA256SUMS.
    #[arg(long, value_name = "FILE.sums")]
    pub manifest: Option<PathBuf>,
    /// Decoded-file cache: the first open of a tensor file or view decodes
    /// it whole into a file here, served from then on (and by later mounts)
    /// by FUSE passthrough at the speed of a local file. Created 0700; its
    /// filesystem decides the speed (docs/OPERATIONS.md).
    #[arg(long, value_name = "DIR")]
    pub decoded_cache: Option<PathBuf>,
    /// Size limit of --decoded-cache in GB (10^9 bytes, fractions allowed);
    /// least recently used entries are evicted, never one that is open
    /// [default: the store's current size plus 90% of the free space on its
    /// filesystem at mount].
    #[arg(long, value_name = "GB", value_parser = parse_gb, requires = "decoded_cache")]
    pub decoded_cache_gb: Option<f64>,
    /// Never serve files by passthrough (the decoded cache is then unused):
    /// for comparisons and tests.
    #[arg(long)]
    pub no_passthrough: bool,
    #[command(flatten)]
    pub remote: crate::source::cli::RemoteArgs,
}

fn parse_cache_mb(s: &str) -> Result<u64, String> {
    let n: u64 = s.parse().map_err(|_| "not a number".to_string())?;
    super::options::check_cache_mb(n)
}

fn parse_gb(s: &str) -> Result<f64, String> {
    let n: f64 = s.parse().map_err(|_| "not a number".to_string())?;
    super::options::check_gb(n)
}

fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| "not a number".to_string())?;
    super::options::check_threads(n)
}

impl MountCli {
    /// The `-o` options' usage errors (unknown option, bad value), found
    /// before anything is opened: the binary reports them as clap does its
    /// own (exit 2).
    pub fn check_options(&self) -> Result<(), String> {
        super::options::parse(&self.options).map(|_| ())
    }

    pub fn into_request(self) -> MountRequest {
        MountRequest {
            source: self.source,
            mountpoint: self.mountpoint,
            dense: self.dense,
            allow_partial: self.allow_partial,
            cache_mb: self.cache_mb,
            threads: self.threads,
            foreground: self.foreground,
            options: self.options,
            sloppy: false,
            quiet: false,
            log_file: self.log_file,
            views: self.views,
            jobs_dir: self.jobs_dir,
            stop_timeout: self.stop_timeout,
            manifest: self.manifest,
            decoded_cache: self.decoded_cache,
            decoded_cache_gb: self.decoded_cache_gb,
            no_passthrough: self.no_passthrough,
            remote: self.remote,
        }
    }
}
