//! `rknot completions` and `rknot manpage`: what the shell and man(1)
//! know of `rknot` and `rknot-mount`, generated from their clap commands.

use std::path::{Path, PathBuf};

use clap::{Args, CommandFactory};

use super::{Cli, CliResult, write_stdout};
use crate::mount::cli::MountCli;

#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell the script is for.
    shell: clap_complete::Shell,
    /// Complete rknot-mount instead of rknot.
    #[arg(long)]
    mount: bool,
}

impl CompletionsArgs {
    pub fn run(self) -> CliResult {
        let (mut cmd, name) = if self.mount {
            (MountCli::command(), "rknot-mount")
        } else {
            (Cli::command(), "rknot")
        };
        let mut script = Vec::new();
        clap_complete::generate(self.shell, &mut cmd, name, &mut script);
        write_stdout(&script)
    }
}

#[derive(Args)]
pub struct ManpageArgs {
    /// Directory for the pages, e.g. /usr/local/share/man/man1 (must
    /// exist; pages there are replaced).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

impl ManpageArgs {
    pub fn run(self) -> CliResult {
        match self.out {
            None => {
                let mut page = Vec::new();
                clap_mangen::Man::new(Cli::command()).render(&mut page)?;
                write_stdout(&page)
            }
            Some(dir) => {
                for cmd in [Cli::command(), MountCli::command()] {
                    let mut cmd = cmd.disable_help_subcommand(true);
                    cmd.build();
                    write_manpages(&cmd, &dir)?;
                }
                Ok(())
            }
        }
    }
}

/// The man page of `cmd` and of each of its subcommands, into `dir`.
fn write_manpages(cmd: &clap::Command, dir: &Path) -> CliResult {
    let man = clap_mangen::Man::new(cmd.clone());
    let path = dir.join(man.get_filename());
    let shown = || crate::text::escape(&path.to_string_lossy()).to_string();
    let mut page = Vec::new();
    man.render(&mut page)?;
    std::fs::write(&path, page).map_err(|e| format!("cannot write {}: {e}", shown()))?;
    eprintln!("rknot: wrote {}", shown());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_manpages(sub, dir)?;
    }
    Ok(())
}
