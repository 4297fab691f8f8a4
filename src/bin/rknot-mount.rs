//! `rknot-mount SOURCE MOUNTPOINT`: serve every tensor of a model file as a
//! file of decoded little-endian f32, and the whole model as
//! `model.safetensors` and `model.gguf`. The command line is
//! [`rknot::mount::cli::MountCli`].

use std::process::ExitCode;

use clap::{CommandFactory, Parser};

use rknot::mount::{self, cli::MountCli};

fn main() -> ExitCode {
    let c = MountCli::parse();
    // Usage errors exit 2, whether clap or the -o parser finds them.
    if let Err(e) = c.check_options() {
        MountCli::command()
            .error(clap::error::ErrorKind::ValueValidation, e)
            .exit();
    }
    mount::run(c.into_request())
}
