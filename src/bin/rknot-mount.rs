//! `rknot-mount SOURCE MOUNTPOINT`: serve every tensor of a model file as a
//! file of decoded little-endian f32, and the whole model as
//! `model.safetensors` and `model.gguf`. The command line is
//! [`rknot::mount::cli::MountCli`]. Run as `mount.fuse.rknot` (a symlink
//! in /sbin), it is mount(8)'s helper for type `fuse.rknot` and takes
//! mount(8)'s calling convention instead ([`rknot::mount::helper`]).

use std::process::ExitCode;

use clap::{CommandFactory, Parser};

use rknot::mount::{self, cli::MountCli, helper};

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Copied above; now out of `ps` (presigned URLs' signatures).
    rknot::source::hide_url_secrets_in_argv();
    if let Some((argv0, rest)) = args.split_first()
        && helper::invoked_as_helper(argv0)
    {
        return helper::run(rest);
    }
    let c = MountCli::parse_from(&args);
    // Usage errors exit 2, whether clap or the -o parser finds them.
    if let Err(e) = c.check_options() {
        MountCli::command()
            .error(clap::error::ErrorKind::ValueValidation, e)
            .exit();
    }
    mount::run(c.into_request())
}
