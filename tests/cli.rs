//! The `rknot` command line: output, errors and exit codes.

mod common;

use common::run_rknot;
use rknot::format::sk32::{Sketch, write_sk32};

fn sketch_file(dir: &std::path::Path) -> std::path::PathBuf {
    let s = Sketch::quantize(
        "blk.2.attn_o.weight",
        3,
        5,
        &[0.5, -0.25, 1.0, 0.0, -1.0, 0.75],
        &[2.0, 1.0],
        &[1.0, 0.0, -1.0, 0.5, 0.25, -0.5, 1.0, 0.0, 0.0, 1.0],
    );
    let p = dir.join("a.sk32");
    let mut b = Vec::new();
    write_sk32(&mut b, "rank-k-exclusion-sketch", &[s]).unwrap();
    std::fs::write(&p, b).unwrap();
    p
}

#[test]
fn bad_magic_names_path_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.bin");
    std::fs::write(&p, b"KNAT\x01\x00junk").unwrap();
    let o = run_rknot(&["inspect", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains(p.to_str().unwrap()), "{e}");
    assert!(e.contains("[75, 78, 65, 84, 1, 0]"), "{e}");
    assert!(e.starts_with("rknot: error:"), "{e}");
}

#[test]
fn missing_file_and_tensor_and_usage() {
    let dir = tempfile::tempdir().unwrap();
    let o = run_rknot(&["cat", "/nonexistent/m.gguf", "x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/m.gguf"));
    let p = sketch_file(dir.path());
    let o = run_rknot(&["cat", p.to_str().unwrap(), "blk.9.nope.weight"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no tensor named \"blk.9.nope.weight\""));
    let o = run_rknot(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(2), "usage errors exit 2");
}

#[test]
fn inspect_and_cat_a_sketch() {
    let dir = tempfile::tempdir().unwrap();
    let p = sketch_file(dir.path());
    let o = run_rknot(&["inspect", p.to_str().unwrap()]);
    assert!(o.status.success());
    let t = String::from_utf8(o.stdout).unwrap();
    assert!(t.contains("format:    sk32 v1"), "{t}");
    assert!(t.contains("topology rank-k-exclusion-sketch"), "{t}");
    assert!(
        t.contains("blk.2.attn_output.weight") && t.contains("blk_2_attn_output_weight"),
        "{t}"
    );
    assert!(t.contains("SK32 r2"), "{t}");
    let o = run_rknot(&["inspect", "--json", p.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["source"]["format"], "sk32");
    assert_eq!(v["tensors"][0]["shape"], serde_json::json!([3, 5]));
    assert_eq!(v["tensors"][0]["served_bytes"], 60);
    // The attn_o alias resolves in both spellings; odd offsets work.
    let whole = run_rknot(&["cat", p.to_str().unwrap(), "blk_2_attn_o_weight"]);
    assert_eq!(whole.stdout.len(), 60);
    let part = run_rknot(&[
        "cat",
        p.to_str().unwrap(),
        "blk.2.attn_output.weight",
        "--offset",
        "7",
        "--length",
        "13",
    ]);
    assert_eq!(part.stdout, &whole.stdout[7..20]);
}

fn run_mount(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_rknot-mount"))
        .args(args)
        .output()
        .unwrap()
}

/// `--version`: the version, the git commit built from (12 hex digits, or
/// "unknown" outside a git checkout) and the enabled features.
#[test]
fn version_names_commit_and_features() {
    let re = regex::Regex::new(&format!(
        r"^(rknot|rknot-mount) {} \(git ([0-9a-f]{{12}}|unknown), features: [a-z0-9,-]+\)\n$",
        regex::escape(env!("CARGO_PKG_VERSION"))
    ))
    .unwrap();
    for (o, name) in [
        (run_rknot(&["--version"]), "rknot"),
        (run_mount(&["--version"]), "rknot-mount"),
    ] {
        assert!(o.status.success());
        let t = String::from_utf8(o.stdout).unwrap();
        assert!(re.is_match(&t), "{t:?}");
        assert!(t.starts_with(&format!("{name} ")), "{t:?}");
    }
}

fn demo(name: &str) -> String {
    format!("{}/demo/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Exit 2 and `want` in the message (a usage error).
fn assert_usage(o: &std::process::Output, want: &str) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains(want), "want {want:?} in {e}");
}

/// rknot-mount: clap's usage errors and the -o parser's exit 2, before
/// anything is opened or mounted (the mountpoint does not even exist).
#[test]
fn mount_usage_errors_exit_2() {
    let gguf = demo("tiny-llama.gguf");
    let mp = "/nonexistent/rknot-cli-test-mp";
    let m = |extra: &[&str]| {
        let mut a = vec![gguf.as_str(), mp];
        a.extend(extra);
        run_mount(&a)
    };
    assert_usage(&m(&["--frobnicate"]), "unexpected argument '--frobnicate'");
    assert_usage(&run_mount(&[&gguf]), "required arguments were not provided");
    assert_usage(&m(&["--views", "f64"]), "f64");
    assert_usage(&m(&["--stop-timeout", "soon"]), "--stop-timeout");
    assert_usage(
        &m(&["-o", "frobnicate"]),
        "unknown mount option \"frobnicate\"",
    );
    assert_usage(&m(&["-o", "rw"]), "always read-only");
    assert_usage(&m(&["-o", "uid=abc"]), "not a number");
    assert_usage(&m(&["-o", "unverified=maybe"]), "expected hold or allow");
    assert_usage(&m(&["-o", "views=f32,f64"]), "unknown view \"f64\"");
    assert_usage(&m(&["-o", "chunk_kb=2"]), "a chunk is 4..=16384 KiB");
    assert_usage(&m(&["-o", "threads=0"]), "at least 1");
    assert_usage(&m(&["--threads", "0"]), "at least 1");
    assert_usage(&m(&["--threads", "3000"]), "at most 64");
    assert_usage(&m(&["-o", "threads=3000"]), "at most 64");
    assert_usage(&m(&["-o", "prefetch_threads=3000"]), "at most 64");
    // A runtime error (here the missing mountpoint) is 1.
    let o = m(&[]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A cache below the minimum the daemon can work with (one 1 MiB chunk)
/// is refused, naming the minimum, on the flag and as -o.
#[test]
fn mount_refuses_cache_below_minimum() {
    let gguf = demo("tiny-llama.gguf");
    let mp = "/nonexistent/rknot-cli-test-mp";
    assert_usage(
        &run_mount(&[&gguf, mp, "--cache-mb", "0"]),
        "below the minimum cache of 1 MiB",
    );
    assert_usage(
        &run_mount(&[&gguf, mp, "-o", "cache_mb=0"]),
        "below the minimum cache of 1 MiB",
    );
}

/// rknot: clap's usage errors are 2, runtime errors 1.
#[test]
fn usage_errors_exit_2_runtime_errors_1() {
    let gguf = demo("tiny-llama.gguf");
    assert_usage(
        &run_rknot(&["inspect", &gguf, "--frobnicate"]),
        "--frobnicate",
    );
    assert_usage(&run_rknot(&["cat", &gguf]), "required arguments");
    assert_usage(
        &run_rknot(&["cat", &gguf, "x", "--offset", "many"]),
        "invalid value 'many' for '--offset",
    );
    assert_usage(&run_rknot(&["inspect", &gguf, "--full"]), "--json");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.rknot");
    assert_usage(
        &run_rknot(&[
            "encode",
            "rknot",
            &gguf,
            "-o",
            out.to_str().unwrap(),
            "--profile",
            "fast",
        ]),
        "unknown --profile \"fast\"",
    );
    assert!(!out.exists());
    let o = run_rknot(&["inspect", "/nonexistent/m.gguf"]);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn encode_rank_0_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.sk32");
    let o = run_rknot(&[
        "encode",
        "sk32",
        &demo("tiny-llama.gguf"),
        "-o",
        out.to_str().unwrap(),
        "--rank",
        "0",
    ]);
    assert_usage(
        &o,
        "invalid value '0' for '--rank <RANK>': must be at least 1",
    );
    assert!(!out.exists());
}

/// An offset at or past the tensor's end is refused (it printed nothing
/// and succeeded); the last byte still reads.
#[test]
fn cat_offset_past_the_end_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = sketch_file(dir.path());
    let p = p.to_str().unwrap();
    // 3 x 5 f32: 60 bytes.
    for off in ["61", "1000000"] {
        let o = run_rknot(&["cat", p, "blk.2.attn_output.weight", "--offset", off]);
        assert_usage(
            &o,
            &format!(
                "--offset {off} is past the end of tensor blk.2.attn_output.weight \
                 (60 bytes: offsets 0..=60)"
            ),
        );
        assert!(o.stdout.is_empty());
    }
    let o = run_rknot(&["cat", p, "blk.2.attn_output.weight", "--offset", "59"]);
    assert!(o.status.success());
    assert_eq!(o.stdout.len(), 1);
    // At the end: nothing, as read(2) at end of file.
    let o = run_rknot(&["cat", p, "blk.2.attn_output.weight", "--offset", "60"]);
    assert!(o.status.success());
    assert!(o.stdout.is_empty());
}

#[test]
fn bench_mount_rounds_0_is_refused() {
    assert_usage(
        &run_rknot(&["bench", "mount", "--rounds", "0"]),
        "invalid value '0' for '--rounds <ROUNDS>': must be at least 1",
    );
}

#[test]
fn bench_mount_size_below_64_mib_is_refused() {
    assert_usage(
        &run_rknot(&["bench", "mount", "--size-mb", "63"]),
        "invalid value '63' for '--size-mb <SIZE_MB>': must be at least 64 (MiB)",
    );
}

#[test]
fn bench_mount_random_reads_0_is_refused() {
    assert_usage(
        &run_rknot(&["bench", "mount", "--random-reads", "0"]),
        "invalid value '0' for '--random-reads <RANDOM_READS>': must be at least 1",
    );
}

#[test]
fn bench_remote_bad_arguments_are_refused() {
    assert_usage(
        &run_rknot(&["bench", "remote", "--rounds", "0"]),
        "invalid value '0' for '--rounds <ROUNDS>': must be at least 1",
    );
    assert_usage(
        &run_rknot(&["bench", "remote", "--size-mb", "0"]),
        "invalid value '0' for '--size-mb <SIZE_MB>': must be at least 1",
    );
    assert_usage(
        &run_rknot(&["bench", "remote", "--shapes", "qwen2.5-7b,gpt5"]),
        "invalid value 'gpt5' for '--shapes <SHAPES>': unknown shape (known: ",
    );
    let o = run_rknot(&["bench", "remote", "--model", "m.gguf", "--size-mb", "8"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
}

/// The lossy encoders take a dense model only: an SK32 or a .rknot as
/// input (it used to be re-encoded, compounding its error) is refused
/// before anything is written.
#[test]
fn encode_from_a_lossy_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (what, input, format) in [
        ("sk32", "tiny-llama.sk32", "sk32"),
        ("sk32", "tiny-llama.rknot", "rknot"),
        ("rknot", "tiny-llama.rknot", "rknot"),
        ("rknot", "tiny-llama.sk32", "sk32"),
    ] {
        let out = dir.path().join(format!("out.{what}"));
        let o = run_rknot(&["encode", what, &demo(input), "-o", out.to_str().unwrap()]);
        assert_usage(
            &o,
            &format!("encode {what} encodes a dense model (GGUF or dense .knot); this is {format}"),
        );
        assert!(String::from_utf8_lossy(&o.stderr).contains(input));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{input}");
    }
}

/// `rknot completions SHELL [--mount]` prints a script; an unknown shell
/// is a usage error.
#[test]
fn completions_for_both_binaries() {
    let o = run_rknot(&["completions", "bash"]);
    assert!(o.status.success());
    let t = String::from_utf8(o.stdout).unwrap();
    assert!(t.contains("_rknot()") && t.contains("encode"), "{t}");
    let o = run_rknot(&["completions", "zsh", "--mount"]);
    assert!(o.status.success());
    let t = String::from_utf8(o.stdout).unwrap();
    assert!(t.starts_with("#compdef rknot-mount") && t.contains("--cache-mb"));
    let o = run_rknot(&["completions", "fish"]);
    assert!(o.status.success());
    assert_usage(&run_rknot(&["completions", "tcsh"]), "invalid value 'tcsh'");
}

/// `rknot manpage --out DIR`: rknot(1), a page per subcommand and
/// rknot-mount(1); without --out, rknot(1) on stdout.
#[test]
fn manpages_for_commands_subcommands_and_the_mount() {
    let dir = tempfile::tempdir().unwrap();
    let o = run_rknot(&["manpage", "--out", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let names = common::listing(dir.path());
    for want in [
        "rknot.1",
        "rknot-cat.1",
        "rknot-encode-sk32.1",
        "rknot-bench-mount.1",
        "rknot-completions.1",
        "rknot-mount.1",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    assert!(!names.iter().any(|n| n.contains("help")), "{names:?}");
    let mount = std::fs::read_to_string(dir.path().join("rknot-mount.1")).unwrap();
    assert!(mount.contains(".TH rknot-mount 1") && mount.contains("cache\\-mb"));
    let o = run_rknot(&["manpage"]);
    assert!(o.status.success());
    assert!(String::from_utf8(o.stdout).unwrap().contains(".TH rknot 1"));
    let o = run_rknot(&["manpage", "--out", "/nonexistent/man1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/man1/rknot.1"));
}

/// The progress lines of `stderr` (`rknot: LABEL: N%...`), parsed: label,
/// percentage, elapsed seconds, final.
fn progress_lines(stderr: &str) -> Vec<(String, u64, f64, bool)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("rknot: ")?;
            // The label ends at the ": N%" that starts the figures.
            let at = rest.find('%')?;
            let colon = rest[..at].rfind(": ")?;
            let (label, figures) = (&rest[..colon], &rest[colon + 2..]);
            let pct: u64 = figures[..at - colon - 2].parse().ok()?;
            let (_, after) = figures.split_once(", ")?;
            let (secs, end) = after.split_once(" s elapsed")?;
            let secs: f64 = secs.parse().ok()?;
            let last = end.rsplit(", ").next()?;
            let finished = last == "done";
            assert!(
                finished || last.starts_with("ETA "),
                "a progress line ends with ETA or done: {l}"
            );
            Some((label.to_string(), pct, secs, finished))
        })
        .collect()
}

/// Long work with stderr not a terminal: a bounded number of plain progress
/// lines per meter (at most one per 10% and one per 10 s), one final line
/// each, nothing on stdout but the report (valid JSON with `--json`); none
/// with `--no-progress`.
#[test]
fn progress_is_bounded_plain_lines_on_stderr_only() {
    let dir = tempfile::tempdir().unwrap();
    let (rknot, gguf) = (demo("tiny-llama.rknot"), demo("tiny-llama.gguf"));
    let out = dir.path().join("m.rknot");
    let check = |args: &[&str], labels: &[&str]| -> std::process::Output {
        let o = run_rknot(args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{args:?}: {err}");
        let lines = progress_lines(&err);
        for label in labels {
            let mine: Vec<_> = lines.iter().filter(|l| l.0 == *label).collect();
            let finals = mine.iter().filter(|l| l.3).count();
            assert_eq!(finals, 1, "{args:?}: one final line for {label}: {err}");
            let last = mine.last().unwrap();
            assert!(
                last.3 && last.1 == 100,
                "{args:?}: the final line is last: {err}"
            );
            let bound = 10 + (last.2 / 10.0).ceil() as usize + 1;
            assert!(mine.len() <= bound, "{args:?}: {} lines: {err}", mine.len());
        }
        assert_eq!(
            lines.len(),
            lines
                .iter()
                .filter(|l| labels.contains(&l.0.as_str()))
                .count(),
            "{args:?}: only the expected meters: {err}"
        );
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            !stdout.contains("elapsed"),
            "{args:?}: progress on stdout: {stdout}"
        );
        o
    };
    let o = check(&["verify", &rknot, "--dense", &gguf, "--json"], &["verify"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["tensors"].is_array(), "{v}");
    let o = check(
        &["verify", "--integrity", &rknot, "--json"],
        &["verify --integrity tiny-llama.rknot"],
    );
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
    check(
        &["encode", "rknot", &gguf, "-o", out.to_str().unwrap()],
        &["encode", "measure error"],
    );
    // --no-progress (global: before or after the subcommand): none.
    for args in [
        vec!["--no-progress", "verify", &rknot, "--dense", &gguf],
        vec!["verify", &rknot, "--dense", &gguf, "--no-progress"],
    ] {
        let o = run_rknot(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        assert!(progress_lines(&err).is_empty(), "{args:?}: {err}");
    }
}
