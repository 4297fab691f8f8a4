//! Build script: the git commit the binaries are built from, for
//! `--version` (`rknot 0.1.0 (git 1a2b3c4d5e6f, features: none)`).
//!
//! Outside a git checkout (a source tarball, a crate download) or without
//! `git`, the commit is "unknown" and the build goes on. `RKNOT_GIT_COMMIT`
//! overrides it (packagers building from an export).

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// Whether the crate is the top of a git work tree (not, say, a tarball
/// unpacked inside some other repository, whose commit would be wrong).
fn in_own_checkout() -> bool {
    let (Some(top), Ok(dir)) = (
        git(&["rev-parse", "--show-toplevel"]),
        std::env::var("CARGO_MANIFEST_DIR"),
    ) else {
        return false;
    };
    match (std::fs::canonicalize(top), std::fs::canonicalize(dir)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RKNOT_GIT_COMMIT");
    // Rebuild when HEAD moves: HEAD itself (a checkout of another branch),
    // the ref it points to (a commit on the branch) and packed-refs (where
    // `git gc` moves refs). --git-path resolves worktrees' and the common
    // directory's files alike.
    let own = in_own_checkout();
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]).filter(|_| own) {
        watch.push(r);
    }
    for name in watch.iter().filter(|_| own) {
        if let Some(p) = git(&["rev-parse", "--git-path", name]) {
            let p = PathBuf::from(p);
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
    let commit = std::env::var("RKNOT_GIT_COMMIT")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            own.then(|| git(&["rev-parse", "--short=12", "HEAD"]))
                .flatten()
        })
        .unwrap_or_else(|| "unknown".to_string());
    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| k.strip_prefix("CARGO_FEATURE_").map(str::to_string))
        .filter(|f| f != "DEFAULT")
        .map(|f| f.to_lowercase().replace('_', "-"))
        .collect();
    features.sort();
    let features = if features.is_empty() {
        "none".to_string()
    } else {
        features.join(",")
    };
    println!(
        "cargo:rustc-env=RKNOT_LONG_VERSION={} (git {commit}, features: {features})",
        env!("CARGO_PKG_VERSION")
    );
}
