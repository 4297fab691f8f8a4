//! Build script: the git commit the binaries are built from, for
//! `--version` (`rknot 0.1.0 (git 1a2b3c4d5e6f, features: none)`).
//!
//! Outside a git checkout (a source tarball, a crate download) or without
//! `git`, the commit is "unknown" and the build goes on. `RKNOT_GIT_COMMIT`
//! overrides it (packagers building from an export).
//!
//! Test capabilities (README: Tests). The stable test harness decides
//! `#[ignore]` at compile time, so the build detects what this machine can
//! run and emits cfgs the tests use in
//! `#[cfg_attr(rknot_no_fuse, ignore = "...")]`:
//!
//! - `rknot_no_fuse`: the build cannot mount (not root, /dev/fuse not
//!   openable read-write, or no fusermount3 in /usr/bin or /bin);
//! - `rknot_no_model`: no SmolLM2 test model at
//!   models/SmolLM2-135M-Instruct.Q4_1.gguf (or `$RKNOT_SMOLLM2`);
//! - `rknot_no_llama_cpp`: `RKNOT_LLAMA_BIN` is not set (the test of
//!   llama.cpp's command-line tools, tests/llama_cpp.rs; tools/llama-cpp.sh
//!   builds them, tools/test.sh sets it);
//! - `rknot_no_hf`: `RKNOT_HF_PYTHON` is not set (the transformers checks
//!   of the `hf/` view; tools/hf-env.sh makes that Python, tools/test.sh
//!   sets it);
//! - `rknot_no_moto`: `RKNOT_MOTO_SERVER` is not set (the S3 tests,
//!   tests/remote_s3.rs, against moto's server; tools/moto-env.sh installs
//!   it, tools/test.sh sets it).
//!
//! `RKNOT_REQUIRE_FUSE=1` / `RKNOT_REQUIRE_MODEL=1` never emit their cfg: the
//! tests then run and fail loudly at run time when the capability is
//! missing. `RKNOT_PRETEND_NO_FUSE=1` / `RKNOT_PRETEND_NO_MODEL=1` (for
//! checking the ignore path on a capable machine; use a separate
//! CARGO_TARGET_DIR) emit the cfg as if the capability were missing, unless
//! the matching RKNOT_REQUIRE_* is set.

use std::path::PathBuf;
use std::process::Command;

#[path = "tests/common/capability.rs"]
mod capability;

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

/// Same convention as the tests' `env_flag`: set, non-empty and not "0".
fn env_flag(name: &str) -> bool {
    println!("cargo::rerun-if-env-changed={name}");
    std::env::var_os(name).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Whether this build could mount: what the tests' `fuse_available()`
/// checks at run time, from the same file.
fn can_mount() -> bool {
    capability::mount_lacks().is_empty()
}

/// Whether the SmolLM2 test model is there. The cfg follows the file:
/// when it is there, its path is watched (a removal or a refetch reruns
/// this script). When it is not, the directory is NOT watched: cargo scans
/// a watched directory recursively, so anything written under models/
/// would rebuild the crate, and a missing watched path reruns the script
/// (and rebuilds the crate) on every build. Instead models/.gitignore, which
/// every checkout has, is the stamp: tools/fetch-smollm2.sh touches it when
/// the model arrives (or is found newer than the stamp), and the cfg flips
/// on the next build.
fn have_model() -> bool {
    let custom = std::env::var_os("RKNOT_SMOLLM2").filter(|v| !v.is_empty());
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let path = match &custom {
        Some(p) => PathBuf::from(p),
        None => root.join(MODEL_REL),
    };
    let present = path.is_file();
    if present {
        println!("cargo::rerun-if-changed={}", path.display());
    } else if custom.is_none() {
        let stamp = root.join(MODEL_STAMP_REL);
        if stamp.is_file() {
            println!("cargo::rerun-if-changed={}", stamp.display());
        }
    }
    present
}

/// Where tools/fetch-smollm2.sh puts the test model, and the file it
/// touches when it does (see [`have_model`]).
const MODEL_REL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_STAMP_REL: &str = "models/.gitignore";

/// The opt-in tests: the variable that turns each on, and the cfg emitted
/// when it is unset or empty.
const OPT_INS: [(&str, &str); 3] = [
    ("RKNOT_LLAMA_BIN", "rknot_no_llama_cpp"),
    ("RKNOT_HF_PYTHON", "rknot_no_hf"),
    ("RKNOT_MOTO_SERVER", "rknot_no_moto"),
];

/// The cfgs of the tests that need a capability (see the top of the file).
fn test_capabilities() {
    let opt_in_cfgs = OPT_INS.map(|(_, cfg)| cfg);
    for cfg in ["rknot_no_fuse", "rknot_no_model"]
        .iter()
        .chain(&opt_in_cfgs)
    {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
    }
    let pretend_no_fuse = env_flag("RKNOT_PRETEND_NO_FUSE");
    if !env_flag("RKNOT_REQUIRE_FUSE") && (pretend_no_fuse || !can_mount()) {
        println!("cargo::rustc-cfg=rknot_no_fuse");
    }
    let pretend_no_model = env_flag("RKNOT_PRETEND_NO_MODEL");
    // (have_model also watches the path, whatever the flags say)
    let model = have_model();
    if !env_flag("RKNOT_REQUIRE_MODEL") && (pretend_no_model || !model) {
        println!("cargo::rustc-cfg=rknot_no_model");
    }
    println!("cargo::rerun-if-env-changed=RKNOT_SMOLLM2");
    for (var, cfg) in OPT_INS {
        println!("cargo::rerun-if-env-changed={var}");
        if std::env::var_os(var).is_none_or(|v| v.is_empty()) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    test_capabilities();
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
