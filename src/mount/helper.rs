//! `mount.fuse.rknot`: rknot-mount as a mount(8) helper.
//!
//! util-linux mount(8), given type `fuse.rknot` (on its command line or in
//! an fstab line), runs `/sbin/mount.fuse.rknot SOURCE DIR [-sfnv] [-N NS]
//! [-o OPTIONS] [-t fuse.rknot]` when that file exists (man mount,
//! "EXTERNAL HELPERS"). Installed as a symlink to rknot-mount under that
//! name (docs/OPERATIONS.md "mount(8) and /etc/fstab"), the binary
//! recognizes the name and takes that calling convention instead of its
//! own:
//!
//! - it always daemonizes (mount(8) waits for the helper to exit), exactly
//!   like `rknot-mount SOURCE DIR` without `--foreground`;
//! - `-o` is the usual option list. mount(8) (util-linux 2.38, checked with
//!   a helper that logs its arguments) puts `rw` first whenever the fstab
//!   line or command line does not say `ro`, also for `defaults` or no
//!   options at all, and cannot tell an explicit `rw` from that default, so
//!   here `rw` is accepted and means nothing: the mount's data is read-only
//!   either way (only `ctl` takes writes). It also passes `nofail`,
//!   `_netdev`, `noatime`, `nosuid`, `nodev`, `noexec` and the like through,
//!   which the option parser accepts; it keeps `auto`, `noauto` and `x-*` to
//!   itself;
//! - `-s` (sloppy): unknown options are ignored with a note on stderr
//!   instead of failing the mount; `-f` (fake): every check, nothing
//!   mounted; `-n` (no mtab): nothing to do, rknot writes no mtab; `-v`:
//!   says what it mounts and prints rknot-mount's `serving ... (pid N; log
//!   FILE)` line, left out otherwise (helpers are silent on success); `-t TYPE`: accepted; `-N NS` (another mount
//!   namespace) is refused.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use super::MountRequest;

/// The names under which the binary is a mount(8) helper.
pub const HELPER_NAMES: &[&str] = &["mount.fuse.rknot"];

/// Whether `argv0`'s file name is one of [`HELPER_NAMES`].
pub fn invoked_as_helper(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| HELPER_NAMES.contains(&n))
}

/// The helper's command line.
#[derive(Debug, Default, PartialEq)]
pub struct HelperArgs {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    pub options: Vec<String>,
    pub sloppy: bool,
    pub fake: bool,
    pub verbose: bool,
}

pub const USAGE: &str = "usage: mount.fuse.rknot SOURCE DIR [-sfnv] [-o OPTIONS] [-t fuse.rknot]\n\
  (the mount(8) helper form of rknot-mount; run by `mount -t fuse.rknot` and fstab lines of type fuse.rknot)";

/// Parse mount(8)'s helper arguments (everything after argv[0]).
pub fn parse(args: &[OsString]) -> Result<HelperArgs, String> {
    let mut out = HelperArgs::default();
    let mut positional: Vec<PathBuf> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(s) = a.to_str() else {
            positional.push(PathBuf::from(a));
            continue;
        };
        if s == "--" {
            positional.extend(it.by_ref().map(PathBuf::from));
            break;
        }
        if !s.starts_with('-') || s == "-" {
            positional.push(PathBuf::from(a));
            continue;
        }
        // Short options, possibly grouped (-sfnv) and with a value attached
        // (-oOPTS) or following.
        for (i, c) in s[1..].char_indices() {
            match c {
                's' => out.sloppy = true,
                'f' => out.fake = true,
                'n' => {}
                'v' => out.verbose = true,
                'o' | 't' | 'N' => {
                    let rest = &s[1 + i + c.len_utf8()..];
                    let value = if rest.is_empty() {
                        it.next()
                            .and_then(|v| v.to_str())
                            .map(str::to_string)
                            .ok_or_else(|| format!("option -{c} needs a value"))?
                    } else {
                        rest.to_string()
                    };
                    match c {
                        'o' => out.options.push(value),
                        'N' => {
                            return Err(format!(
                                "-N {value}: mounting in another mount namespace is not supported"
                            ));
                        }
                        _ => {}
                    }
                    break;
                }
                'h' => return Err(USAGE.to_string()),
                other => return Err(format!("unknown option -{other}")),
            }
        }
    }
    match <[PathBuf; 2]>::try_from(positional) {
        Ok([source, mountpoint]) => {
            out.source = source;
            out.mountpoint = mountpoint;
        }
        Err(p) => {
            return Err(format!(
                "expected SOURCE and DIR, got {} argument(s)",
                p.len()
            ));
        }
    }
    // mount(8)'s default `rw` (module docs).
    out.options = out
        .options
        .iter()
        .map(|o| {
            o.split(',')
                .filter(|item| item.trim() != "rw")
                .collect::<Vec<_>>()
                .join(",")
        })
        .filter(|o| !o.is_empty())
        .collect();
    Ok(out)
}

/// Entry point when the binary runs as `mount.fuse.rknot`.
pub fn run(args: &[OsString]) -> ExitCode {
    let h = match parse(args) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("mount.fuse.rknot: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let ignored = match super::options::parse_with(&h.options, h.sloppy) {
        Ok((_, ignored)) => ignored,
        Err(e) => {
            eprintln!("mount.fuse.rknot: {e}");
            return ExitCode::from(2);
        }
    };
    for item in &ignored {
        eprintln!(
            "mount.fuse.rknot: ignoring unknown mount option \"{}\" (-s)",
            crate::text::Escaped(item)
        );
    }
    if h.verbose {
        eprintln!(
            "mount.fuse.rknot: mounting {} at {} with -o {}",
            h.source.display(),
            h.mountpoint.display(),
            if h.options.is_empty() {
                "(none)".to_string()
            } else {
                h.options.join(",")
            }
        );
    }
    let req = MountRequest {
        source: h.source,
        mountpoint: h.mountpoint,
        dense: None,
        cache_mb: None,
        threads: None,
        foreground: false,
        options: h.options,
        sloppy: h.sloppy,
        quiet: !h.verbose,
        log_file: None,
        views: None,
        jobs_dir: None,
        stop_timeout: None,
        manifest: None,
        decoded_cache: None,
        decoded_cache_gb: None,
        no_passthrough: false,
        allow_partial: false,
        remote: Default::default(),
    };
    if h.fake {
        return super::check_only(&req);
    }
    super::run(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<HelperArgs, String> {
        parse(&args.iter().map(OsString::from).collect::<Vec<_>>())
    }

    #[test]
    fn recognizes_its_names() {
        assert!(invoked_as_helper("/sbin/mount.fuse.rknot".as_ref()));
        assert!(invoked_as_helper("mount.fuse.rknot".as_ref()));
        assert!(!invoked_as_helper("/usr/local/bin/rknot-mount".as_ref()));
        assert!(!invoked_as_helper("/sbin/mount.fuse3".as_ref()));
    }

    #[test]
    fn what_mount_passes() {
        // As mount(8) 2.38 calls it for an fstab line.
        let h = p(&[
            "/srv/m.rknot",
            "/mnt/w",
            "-o",
            "rw,noatime,nosuid,nodev,noexec,dense=/srv/m.gguf,allow_other,nofail,_netdev",
        ])
        .unwrap();
        assert_eq!(h.source, PathBuf::from("/srv/m.rknot"));
        assert_eq!(h.mountpoint, PathBuf::from("/mnt/w"));
        assert_eq!(
            h.options,
            vec!["noatime,nosuid,nodev,noexec,dense=/srv/m.gguf,allow_other,nofail,_netdev"]
        );
        assert!(super::super::options::parse(&h.options).is_ok());
        // No options: mount(8) still passes `-o rw`.
        let h = p(&["s", "d", "-o", "rw"]).unwrap();
        assert!(h.options.is_empty());
        // Flags, grouped or not, before or after the operands.
        let h = p(&["-sfnv", "s", "d", "-ocache_mb=64", "-t", "fuse.rknot"]).unwrap();
        assert!(h.sloppy && h.fake && h.verbose);
        assert_eq!(h.options, vec!["cache_mb=64"]);
        assert!(
            p(&["s", "d", "-N", "1234"])
                .unwrap_err()
                .contains("namespace")
        );
        assert!(p(&["s"]).unwrap_err().contains("SOURCE and DIR"));
        assert!(p(&["s", "d", "e"]).is_err());
        assert!(p(&["s", "d", "-o"]).unwrap_err().contains("needs a value"));
        assert!(p(&["s", "d", "-x"]).unwrap_err().contains("-x"));
    }
}
