//! `-o` mount options: the usual FUSE ones plus the mount's own.

use fuser::{MountOption, SessionACL};

use crate::fs::precision::HfDtype;
use crate::fs::views::{ElemFormat, ViewSet};
use crate::integrity::manifest::Unverified;
use crate::source::cli as remote_cli;

/// Everything `-o` can set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MountOpts {
    pub acl: SessionACL,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub fsname: Option<String>,
    pub direct_io: bool,
    pub cache_mb: Option<u64>,
    pub threads: Option<usize>,
    pub prefetch_threads: Option<usize>,
    pub readahead_kb: Option<u32>,
    pub chunk_kb: Option<u64>,
    pub dense: Option<String>,
    /// Mount a source that cannot serve its model whole anyway.
    pub allow_partial: bool,
    pub views: Option<ViewSet>,
    /// The dtype of `model.safetensors` and `hf/` (`auto`: the source's).
    pub hf_dtype: Option<HfDtype>,
    pub jobs_dir: Option<String>,
    /// `s3://BUCKET/PREFIX/` where encoding jobs write instead of a
    /// directory (normalized to end with `/`).
    pub jobs_remote_prefix: Option<String>,
    pub max_jobs: Option<usize>,
    pub no_jobs: bool,
    /// Seconds between the first stop signal and aborting the connection.
    pub stop_timeout: Option<u64>,
    /// sha256sum-format manifest the source files are checked against.
    pub manifest: Option<String>,
    /// What reads do while a whole-file check runs.
    pub unverified: Option<Unverified>,
    /// Decoded-file store directory and its limit in GB.
    pub decoded_cache: Option<String>,
    pub decoded_cache_gb: Option<f64>,
    pub no_passthrough: bool,
    /// Remote sources: endpoint=, ca_bundle=, source_cache=,
    /// source_cache_gb=, remote_cache_mb=, part_size_mb=, remote_retries=,
    /// remote_deadline= (the flags of the same names win).
    pub remote: crate::source::cli::RemoteArgs,
}

/// Every `-o` option, by group, as `--help` and a usage error list them.
pub const OPTION_GROUPS: &[(&str, &[&str])] = &[
    (
        "FUSE",
        &[
            "allow_other",
            "allow_root",
            "default_permissions (always on)",
            "uid=N",
            "gid=N",
            "fsname=NAME",
            "ro",
        ],
    ),
    (
        "rknot",
        &[
            "direct_io",
            "cache_mb=N",
            "threads=N",
            "prefetch_threads=N",
            "readahead_kb=N",
            "chunk_kb=N",
            "dense=FILE",
            "allow_partial",
            "views=f32,f16,bf16",
            "hf_dtype=auto|f32|f16|bf16",
            "stop_timeout=SECS",
        ],
    ),
    (
        "ignored (fstab)",
        &[
            "defaults", "auto", "noauto", "nofail", "user", "users", "_netdev", "x-*",
        ],
    ),
    (
        "jobs",
        &[
            "jobs_dir=DIR",
            "jobs_remote_prefix=s3://BUCKET/PREFIX/",
            "max_jobs=N",
            "nojobs",
        ],
    ),
    (
        "integrity",
        &["manifest=FILE.sums", "unverified=hold|allow"],
    ),
    (
        "decoded cache",
        &["decoded_cache=DIR", "decoded_cache_gb=N", "nopassthrough"],
    ),
    (
        "remote sources",
        &[
            "endpoint=URL",
            "ca_bundle=FILE",
            "source_cache=DIR",
            "source_cache_gb=N",
            "remote_cache_mb=N",
            "part_size_mb=N",
            "remote_retries=N",
            "remote_deadline=SECS",
        ],
    ),
];

/// The options, one per line under their group's name (for a usage error).
pub fn options_help() -> String {
    let mut out = Vec::new();
    for (group, opts) in OPTION_GROUPS {
        out.push(format!("  {group}:"));
        out.extend(opts.iter().map(|o| format!("    {o}")));
    }
    out.join("\n")
}

/// The option whose name is nearest `key` (at most 2 edits, 1 for a short
/// name, or a prefix of it either way), as it is spelled in the list: for "did you mean".
fn nearest_option(key: &str) -> Option<&'static str> {
    let key = key.to_ascii_lowercase();
    let mut best: Option<(usize, &'static str)> = None;
    for (_, opts) in OPTION_GROUPS {
        for &spelled in *opts {
            let name = spelled.split(['=', ' ']).next().unwrap_or(spelled);
            if name.ends_with('*') {
                continue;
            }
            let d = if name.len() > 3 && (name.starts_with(&key) || key.starts_with(name)) {
                1
            } else {
                edit_distance(&key, name)
            };
            // A short name is a single edit from many others: only one
            // edit counts there.
            let allowed = if key.len() <= 3 { 1 } else { 2 };
            if d <= allowed && best.is_none_or(|(bd, _)| d < bd) {
                best = Some((d, spelled.split(' ').next().unwrap_or(spelled)));
            }
        }
    }
    best.map(|(_, s)| s)
}

/// Levenshtein distance of two short ASCII-ish strings (option names).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut row = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            row[j + 1] = sub.min(prev[j + 1] + 1).min(row[j] + 1);
        }
        prev = row;
    }
    prev[b.len()]
}

/// The error for an option nobody knows: its name, the nearest one, and
/// the list, one per line.
fn unknown_option(item: &str) -> String {
    let key = item.split('=').next().unwrap_or(item);
    let hint = nearest_option(key)
        .map(|o| format!("; did you mean {o}?"))
        .unwrap_or_default();
    format!(
        "unknown mount option {item:?}{hint}\nmount options:\n{}",
        options_help()
    )
}

fn num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, String> {
    v.parse::<T>()
        .map_err(|_| format!("mount option {key}={v:?}: not a number"))
}

/// The smallest decoded-chunk cache, MiB: one chunk of the default size
/// (1 MiB). Below it (0) no chunk is ever kept: every read decodes again,
/// one at a time.
pub const MIN_CACHE_MB: u64 = 1;

/// The range of `chunk_kb`, KiB.
pub const CHUNK_KB: std::ops::RangeInclusive<u64> = 4..=16 * 1024;

/// `--cache-mb` / `cache_mb=`: refused below [`MIN_CACHE_MB`].
pub fn check_cache_mb(n: u64) -> Result<u64, String> {
    if n < MIN_CACHE_MB {
        return Err(format!(
            "{n} MiB is below the minimum cache of {MIN_CACHE_MB} MiB"
        ));
    }
    Ok(n)
}

/// `--decoded-cache-gb` / `decoded_cache_gb=`: a positive, finite size.
pub fn check_gb(n: f64) -> Result<f64, String> {
    if !(n.is_finite() && n > 0.0 && n < 1e9) {
        return Err(format!("{n} GB: a size above 0 is needed"));
    }
    Ok(n)
}

/// The most FUSE worker threads (`--threads`): the kernel keeps few
/// requests outstanding per mount (`max_background`, 12 by default, plus
/// one per reading thread), and each worker holds a reply buffer (1 MiB,
/// counted in the memory bound), so more than this only costs memory and
/// thread-creation time.
pub const MAX_THREADS: usize = 64;

/// The most read-ahead decode threads (`prefetch_threads=`): decodes are
/// CPU work, and past the machine's cores more threads only cost memory
/// (a chunk being decoded each, counted in the memory bound).
pub const MAX_PREFETCH_THREADS: usize = 64;

/// `--threads` / `threads=`: at least one FUSE worker, at most
/// [`MAX_THREADS`].
pub fn check_threads(n: usize) -> Result<usize, String> {
    if n == 0 {
        return Err("at least 1 FUSE thread is needed".into());
    }
    if n > MAX_THREADS {
        return Err(format!("{n}: at most {MAX_THREADS} FUSE threads"));
    }
    Ok(n)
}

/// `prefetch_threads=`: 0 (no read-ahead) to [`MAX_PREFETCH_THREADS`].
pub fn check_prefetch_threads(n: usize) -> Result<usize, String> {
    if n > MAX_PREFETCH_THREADS {
        return Err(format!(
            "{n}: at most {MAX_PREFETCH_THREADS} read-ahead threads"
        ));
    }
    Ok(n)
}

/// A numeric option `key=v` that `check` must accept too.
fn checked<T: std::str::FromStr>(
    key: &str,
    v: &str,
    check: impl FnOnce(T) -> Result<T, String>,
) -> Result<T, String> {
    check(num(key, v)?).map_err(|e| format!("mount option {key}={v:?}: {e}"))
}

/// Parse every `-o` argument (each a comma-separated list).
pub fn parse(args: &[String]) -> Result<MountOpts, String> {
    parse_with(args, false).map(|(o, _)| o)
}

/// [`parse`]; `sloppy` (mount(8)'s `-s`): an unknown option is returned in
/// the second list instead of failing. A bad value of a known option fails
/// either way.
pub fn parse_with(args: &[String], sloppy: bool) -> Result<(MountOpts, Vec<String>), String> {
    let mut o = MountOpts::default();
    let mut ignored = Vec::new();
    // The `views=` list: `-o views=f32,f16` splits into `views=f32` and
    // `f16`, so bare format names right after it continue it.
    let mut views: Option<String> = None;
    let mut views_open = false;
    for item in args.iter().flat_map(|a| a.split(',')).map(str::trim) {
        if item.is_empty() {
            continue;
        }
        if views_open && ElemFormat::from_ext(item).is_some() {
            if let Some(list) = views.as_mut() {
                list.push(',');
                list.push_str(item);
            }
            continue;
        }
        let after_views = std::mem::take(&mut views_open);
        let (key, val) = match item.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (item, None),
        };
        match (key, val) {
            ("allow_other", None) => o.acl = SessionACL::All,
            ("allow_root", None) => {
                if o.acl != SessionACL::All {
                    o.acl = SessionACL::RootAndOwner;
                }
            }
            ("default_permissions" | "ro" | "nosuid" | "nodev" | "noexec" | "noatime", None) => {}
            ("defaults" | "auto" | "noauto" | "nofail" | "user" | "users" | "_netdev", None) => {}
            (k, _) if k.starts_with("x-") => {}
            ("rw", None) => {
                return Err(
                    "mount option rw: the mount is always read-only (only ctl is writable)".into(),
                );
            }
            ("uid", Some(v)) => o.uid = Some(num(key, v)?),
            ("gid", Some(v)) => o.gid = Some(num(key, v)?),
            ("fsname", Some(v)) if !v.is_empty() => o.fsname = Some(v.to_string()),
            ("direct_io", None) => o.direct_io = true,
            ("cache_mb", Some(v)) => o.cache_mb = Some(checked(key, v, check_cache_mb)?),
            ("threads", Some(v)) => o.threads = Some(checked(key, v, check_threads)?),
            ("prefetch_threads", Some(v)) => {
                o.prefetch_threads = Some(checked(key, v, check_prefetch_threads)?)
            }
            ("readahead_kb", Some(v)) => o.readahead_kb = Some(num(key, v)?),
            ("chunk_kb", Some(v)) => {
                o.chunk_kb = Some(checked(key, v, |k: u64| {
                    if CHUNK_KB.contains(&k) {
                        Ok(k)
                    } else {
                        Err(format!(
                            "a chunk is {}..={} KiB",
                            CHUNK_KB.start(),
                            CHUNK_KB.end()
                        ))
                    }
                })?)
            }
            ("dense", Some(v)) if !v.is_empty() => o.dense = Some(v.to_string()),
            ("allow_partial", None) => o.allow_partial = true,
            ("jobs_dir", Some(v)) if !v.is_empty() => o.jobs_dir = Some(v.to_string()),
            ("jobs_remote_prefix", Some(v)) => {
                o.jobs_remote_prefix = Some(
                    crate::source::upload::check_output_prefix(v)
                        .map_err(|e| format!("mount option jobs_remote_prefix={v:?}: {e}"))?,
                )
            }
            ("max_jobs", Some(v)) => {
                o.max_jobs = Some(checked(key, v, |n: usize| {
                    if n == 0 {
                        Err("at least 1 (nojobs turns jobs off)".into())
                    } else {
                        Ok(n)
                    }
                })?)
            }
            ("nojobs", None) => o.no_jobs = true,
            ("stop_timeout", Some(v)) => o.stop_timeout = Some(num(key, v)?),
            ("manifest", Some(v)) if !v.is_empty() => o.manifest = Some(v.to_string()),
            ("unverified", Some(v)) => {
                o.unverified = Some(Unverified::parse(v).ok_or_else(|| {
                    format!("mount option unverified={v:?}: expected hold or allow")
                })?);
            }
            ("decoded_cache", Some(v)) if !v.is_empty() => o.decoded_cache = Some(v.to_string()),
            ("decoded_cache_gb", Some(v)) => o.decoded_cache_gb = Some(checked(key, v, check_gb)?),
            ("nopassthrough", None) => o.no_passthrough = true,
            ("endpoint", Some(v)) => {
                o.remote.endpoint = Some(
                    remote_cli::check_endpoint(v)
                        .map_err(|e| format!("mount option endpoint={v:?}: {e}"))?,
                )
            }
            ("ca_bundle", Some(v)) if !v.is_empty() => o.remote.ca_bundle = Some(v.into()),
            ("source_cache", Some(v)) if !v.is_empty() => o.remote.source_cache = Some(v.into()),
            ("source_cache_gb", Some(v)) => {
                o.remote.source_cache_gb = Some(checked(key, v, remote_cli::check_gb)?)
            }
            ("remote_cache_mb", Some(v)) => {
                o.remote.remote_cache_mb = Some(checked(key, v, remote_cli::check_remote_cache_mb)?)
            }
            ("part_size_mb", Some(v)) => {
                o.remote.part_size_mb = Some(checked(key, v, remote_cli::check_part_size_mb)?)
            }
            ("remote_retries", Some(v)) => {
                o.remote.remote_retries = Some(checked(key, v, remote_cli::check_retries)?)
            }
            ("remote_deadline", Some(v)) => {
                o.remote.remote_deadline = Some(checked(key, v, remote_cli::check_deadline)?)
            }
            ("hf_dtype", Some(v)) => {
                o.hf_dtype = Some(
                    HfDtype::parse(v).map_err(|e| format!("mount option hf_dtype={v:?}: {e}"))?,
                )
            }
            ("views", Some(v)) => {
                views = Some(v.to_string());
                views_open = true;
            }
            (_, None) if after_views => {
                return Err(format!(
                    "mount option views: unknown view {item:?} (views: f32, f16, bf16)"
                ));
            }
            _ if sloppy => ignored.push(item.to_string()),
            _ => return Err(unknown_option(item)),
        }
    }
    if let Some(list) = views {
        o.views = Some(ViewSet::parse(&list).map_err(|e| format!("mount option views: {e}"))?);
    }
    Ok((o, ignored))
}

/// Kernel mount options for fuser. The filesystem is not mounted `ro` at
/// the VFS level because `ctl` takes commands; every other write is refused
/// by the filesystem with EROFS.
///
/// `via_fusermount`: whether the mount goes through fusermount3 (no
/// CAP_SYS_ADMIN, see [`super::checks::can_mount_directly`]). fuser hands
/// fsname to mount(2) verbatim as the source when it mounts directly, but
/// pastes it unescaped into fusermount3's comma-separated `-o` list
/// otherwise; there it must be escaped.
pub fn fuser_options(o: &MountOpts, source: &str, via_fusermount: bool) -> Vec<MountOption> {
    // The source is shown to every user (/proc/mounts): a URL's secrets
    // (presigned query strings, userinfo) are left out.
    let fsname = o.fsname.clone().unwrap_or_else(|| {
        if crate::source::is_remote(source) {
            crate::source::redact(source)
        } else {
            source.to_string()
        }
    });
    let fsname = if via_fusermount {
        escape_fusermount_value(&fsname)
    } else {
        fsname
    };
    vec![
        MountOption::FSName(fsname),
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::NoExec,
        MountOption::NoAtime,
    ]
}

/// Escape a value for fusermount3's `-o` list as libfuse does
/// (`fuse_opt_add_opt_escaped`): a backslash before `,` and `\`.
/// fusermount3 (3.x; checked with Debian's 3.14) splits the list at
/// unescaped commas and drops the backslashes of `fsname=` and `subtype=`
/// values, so the mount's source is exactly the original name. Unescaped, a
/// source named `m,allow_other.gguf` would add the option `allow_other.gguf`,
/// and a trailing backslash would swallow the next option
/// (`default_permissions`).
pub fn escape_fusermount_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len() + 2);
    for c in v.chars() {
        if matches!(c, ',' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsname_is_escaped_only_for_fusermount() {
        assert_eq!(escape_fusermount_value("plain/x.gguf"), "plain/x.gguf");
        assert_eq!(
            escape_fusermount_value("m,allow_other.gguf"),
            "m\\,allow_other.gguf"
        );
        assert_eq!(escape_fusermount_value("a\\b,"), "a\\\\b\\,");
        assert_eq!(escape_fusermount_value("end\\"), "end\\\\");
        let o = p(&["fsname=x\\y"]).unwrap();
        let name = |v: &[MountOption]| match &v[0] {
            MountOption::FSName(n) => n.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(name(&fuser_options(&o, "/s", true)), "x\\\\y");
        assert_eq!(name(&fuser_options(&o, "/s", false)), "x\\y");
        let o = MountOpts::default();
        assert_eq!(name(&fuser_options(&o, "/m,ro.gguf", true)), "/m\\,ro.gguf");
        assert_eq!(name(&fuser_options(&o, "/m,ro.gguf", false)), "/m,ro.gguf");
    }

    #[test]
    fn stop_timeout_option() {
        assert_eq!(p(&["stop_timeout=3"]).unwrap().stop_timeout, Some(3));
        assert_eq!(p(&[]).unwrap().stop_timeout, None);
        assert!(
            p(&["stop_timeout=soon"])
                .unwrap_err()
                .contains("not a number")
        );
    }

    fn p(s: &[&str]) -> Result<MountOpts, String> {
        parse(&s.iter().map(|x| x.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_fuse_and_own_options() {
        let o = p(&[
            "allow_other,uid=1000",
            "gid=100,fsname=m,direct_io",
            "cache_mb=64,threads=3",
        ])
        .unwrap();
        assert_eq!(o.acl, SessionACL::All);
        assert_eq!((o.uid, o.gid), (Some(1000), Some(100)));
        assert_eq!(o.fsname.as_deref(), Some("m"));
        assert!(o.direct_io);
        assert_eq!((o.cache_mb, o.threads), (Some(64), Some(3)));
        let o =
            p(&["allow_root,defaults,nofail,x-systemd.automount,ro,default_permissions"]).unwrap();
        assert_eq!(o.acl, SessionACL::RootAndOwner);
    }

    #[test]
    fn views_lists_in_o_options() {
        let both = ViewSet {
            f16: true,
            bf16: true,
        };
        assert_eq!(p(&["views=f32,f16,bf16"]).unwrap().views, Some(both));
        assert_eq!(
            p(&["views=f16+bf16,allow_other"]).unwrap().views,
            Some(both)
        );
        let o = p(&["views=f16", "allow_other,cache_mb=3"]).unwrap();
        assert_eq!(o.views.map(|v| (v.f16, v.bf16)), Some((true, false)));
        assert_eq!(o.acl, SessionACL::All);
        assert_eq!(p(&[]).unwrap().views, None);
        assert_eq!(
            p(&["hf_dtype=bf16"]).unwrap().hf_dtype,
            Some(HfDtype::Fixed(ElemFormat::Bf16))
        );
        assert_eq!(p(&["hf_dtype=auto"]).unwrap().hf_dtype, Some(HfDtype::Auto));
        let e = p(&["hf_dtype=fp8"]).unwrap_err();
        assert!(
            e.contains("hf_dtype=\"fp8\"") && e.contains("auto, f32, f16, bf16"),
            "{e}"
        );
        // A format name not right after views= is not an option.
        assert!(p(&["views=f32,allow_other,f16"]).is_err());
        assert!(
            p(&["views=f32,f64"])
                .unwrap_err()
                .contains("unknown view \"f64\"")
        );
    }

    #[test]
    fn manifest_options() {
        let o = p(&["manifest=/srv/m.sums,unverified=allow"]).unwrap();
        assert_eq!(o.manifest.as_deref(), Some("/srv/m.sums"));
        assert_eq!(o.unverified, Some(Unverified::Allow));
        assert_eq!(
            p(&["unverified=hold"]).unwrap().unverified,
            Some(Unverified::Hold)
        );
        assert_eq!(p(&[]).unwrap().unverified, None);
        assert!(
            p(&["unverified=maybe"])
                .unwrap_err()
                .contains("expected hold or allow")
        );
        assert!(
            p(&["manifest="])
                .unwrap_err()
                .contains("unknown mount option")
        );
    }

    #[test]
    fn refuses_values_it_used_to_adjust() {
        let e = p(&["cache_mb=0"]).unwrap_err();
        assert!(e.contains("minimum cache of 1 MiB"), "{e}");
        assert_eq!(p(&["cache_mb=1"]).unwrap().cache_mb, Some(1));
        assert!(p(&["threads=0"]).unwrap_err().contains("at least 1"));
        // The 3000 + 3000 (6004 daemon threads): refused.
        assert!(p(&["threads=3000"]).unwrap_err().contains("at most 64"));
        assert!(p(&["threads=65"]).unwrap_err().contains("at most 64"));
        assert_eq!(p(&["threads=64"]).unwrap().threads, Some(64));
        let e = p(&["prefetch_threads=3000"]).unwrap_err();
        assert!(e.contains("at most 64 read-ahead threads"), "{e}");
        assert_eq!(
            p(&["prefetch_threads=0"]).unwrap().prefetch_threads,
            Some(0)
        );
        assert!(
            p(&["chunk_kb=2"])
                .unwrap_err()
                .contains("a chunk is 4..=16384 KiB")
        );
        assert!(p(&["chunk_kb=16385"]).is_err());
        assert_eq!(p(&["chunk_kb=16384"]).unwrap().chunk_kb, Some(16384));
        assert!(p(&["max_jobs=0"]).unwrap_err().contains("at least 1"));
    }

    #[test]
    fn remote_options() {
        let o = p(&[
            "endpoint=http://127.0.0.1:9000,source_cache=/var/cache/rk,source_cache_gb=2.5",
            "remote_cache_mb=64,part_size_mb=4,remote_retries=0",
        ])
        .unwrap();
        assert_eq!(o.remote.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(o.remote.source_cache_gb, Some(2.5));
        assert_eq!(
            (
                o.remote.remote_cache_mb,
                o.remote.part_size_mb,
                o.remote.remote_retries
            ),
            (Some(64), Some(4), Some(0))
        );
        assert!(p(&["endpoint=ftp://x"]).unwrap_err().contains("http"));
        assert!(p(&["part_size_mb=0"]).unwrap_err().contains("part_size_mb"));
        assert!(p(&["remote_retries=1000"]).is_err());
        assert_eq!(
            p(&["remote_deadline=2.5"]).unwrap().remote.remote_deadline,
            Some(2.5)
        );
        assert!(p(&["remote_deadline=0"]).is_err());
        assert!(p(&["remote_cache_mb=0"]).is_err());
        assert_eq!(
            p(&["jobs_remote_prefix=s3://b/jobs"])
                .unwrap()
                .jobs_remote_prefix
                .as_deref(),
            Some("s3://b/jobs/")
        );
        assert!(p(&["jobs_remote_prefix=/srv/jobs"]).is_err());
        assert!(p(&["source_cache_gb=-1"]).is_err());
    }

    #[test]
    fn rejects_bad_options() {
        assert!(p(&["rw"]).unwrap_err().contains("read-only"));
        assert!(p(&["uid=abc"]).unwrap_err().contains("not a number"));
        assert!(
            p(&["frobnicate"])
                .unwrap_err()
                .contains("unknown mount option")
        );
    }

    /// A typo'd option names the nearest one and lists the options one per
    /// line, not ~40 on one line.
    #[test]
    fn unknown_options_suggest_the_nearest_and_list_one_per_line() {
        let e = parse(&["thread=4".to_string()]).unwrap_err();
        assert!(
            e.starts_with("unknown mount option \"thread=4\"; did you mean threads=N?\n"),
            "{e}"
        );
        let n_opts: usize = OPTION_GROUPS.iter().map(|(_, o)| o.len()).sum();
        assert_eq!(e.lines().count(), 2 + OPTION_GROUPS.len() + n_opts, "{e}");
        assert!(e.lines().all(|l| l.len() < 80), "{e}");
        for (item, want) in [
            ("cachemb=10", Some("cache_mb=N")),
            ("remote_deadlin=5", Some("remote_deadline=SECS")),
            ("allow-other", Some("allow_other")),
            ("manifest_file=x", Some("manifest=FILE.sums")),
            ("frobnicate", None),
            ("x", None),
        ] {
            let e = parse(&[item.to_string()]).unwrap_err();
            let first = e.lines().next().unwrap_or("");
            match want {
                Some(o) => assert!(first.ends_with(&format!("did you mean {o}?")), "{e}"),
                None => assert!(!first.contains("did you mean"), "{e}"),
            }
        }
        // Every option the parser takes is listed.
        let listed = options_help();
        for key in [
            "threads=",
            "views=",
            "hf_dtype=",
            "remote_deadline=",
            "nojobs",
            "    ro\n",
            "x-*",
        ] {
            assert!(listed.contains(key), "{key} not in {listed}");
        }
    }

    #[test]
    fn sloppy_ignores_only_unknown_options() {
        let args = vec!["frobnicate,cache_mb=8,x=1".to_string()];
        let (o, ignored) = parse_with(&args, true).unwrap();
        assert_eq!(o.cache_mb, Some(8));
        assert_eq!(ignored, vec!["frobnicate", "x=1"]);
        assert!(parse_with(&["cache_mb=0".to_string()], true).is_err());
        assert!(parse_with(&["rw".to_string()], true).is_err());
    }
}
