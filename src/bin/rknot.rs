//! `rknot`: inspect and read compressed model files. The subcommands and
//! their arguments are [`rknot::cli`]; here the command line is parsed and
//! dispatched.

use std::process::ExitCode;

use clap::Parser;

use rknot::cli::Cli;

fn main() -> ExitCode {
    rknot::logging::init("warn", None);
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Copied above; now out of `ps` (presigned URLs' signatures).
    rknot::source::hide_url_secrets_in_argv();
    let cli = Cli::parse_from(args);
    rknot::cli::exit_code(rknot::cli::run(cli))
}
