//! llama.cpp's own command-line tools on the mount's `model.gguf`: the
//! README's `llama-completion -m /mnt/w/model.gguf` example, run for real.
//!
//! - `llama-completion`, greedy, on "The capital of France is" answers
//!   " Paris", from the mount and from a local copy of the mount's
//!   `model.gguf` alike (the copy is an F32 GGUF of the same weights), and
//!   the same tokens as from the Q4_1 source GGUF itself;
//! - `llama-perplexity` over tests/data/probe/gpl-3.0.txt reports the same
//!   estimates, to the last printed digit, on the mount and on the copy, and
//!   the final one is the committed figure of tests/data/probe/reference.json
//!   (the same llama.cpp on llama-quantize's F32 GGUF of the Q4_1 file);
//! - llama.cpp maps the mount's file (`CPU_Mapped` buffers: mmap, its
//!   default), it does not read it into memory;
//! - the same (but for the committed figure) on the mount of a
//!   self-contained `.rknot` encoded from SmolLM2 (`--profile faithful`);
//! - on `model.native.gguf` (the Q4_1 blocks as stored) the same greedy
//!   tokens as on the source file, and the same perplexity estimates, to
//!   the last printed digit, as llama-perplexity on the source file;
//! - on `model.native.gguf` of a calibrated `.rknot` of SmolLM2 (its affine
//!   4-bit matrices re-packed into Q4_1, its other tensors the ggml blocks
//!   it stores): " Paris", mmap, the same perplexity estimates to the last
//!   digit as on a local copy of the view, and within 5% of the same
//!   weights in F32 (`model.gguf`): not equal, as llama.cpp multiplies Q4_1
//!   weights against Q8_1-rounded activations and F32 ones in f32 (the Q4_1
//!   source itself and llama-quantize's F32 copy of it differ likewise,
//!   tests/data/probe/reference.json); that the weights are equal bit for
//!   bit is tests/native_view.rs.
//!
//! Opt-in: set RKNOT_LLAMA_BIN, when building and running the tests, to the
//! directory `tools/llama-cpp.sh --print-bin-dir` prints (it builds the tools
//! once from the llama-cpp-python sdist's vendored llama.cpp and caches
//! them); `RKNOT_LLAMA_CPP=1 tools/test.sh` does both. Ignored otherwise
//! (build.rs emits `rknot_no_llama_cpp`). Once set, the variable is a
//! requirement: missing binaries fail the test. Needs the model and FUSE too.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::mount::{Mounted, fuse_available};
use common::*;

const PROMPT: &str = "The capital of France is";

/// The directory of the llama.cpp tools, or `None` with a note when
/// RKNOT_LLAMA_BIN is unset (a run with `--ignored`, or a binary built with
/// the variable and run without).
fn llama_bin() -> Option<PathBuf> {
    let Some(dir) = std::env::var_os("RKNOT_LLAMA_BIN").filter(|p| !p.is_empty()) else {
        eprintln!(
            "NOTE: skipping: set RKNOT_LLAMA_BIN to the directory tools/llama-cpp.sh --print-bin-dir prints"
        );
        return None;
    };
    let dir = PathBuf::from(dir);
    for tool in ["llama-completion", "llama-perplexity"] {
        assert!(
            dir.join(tool).is_file(),
            "RKNOT_LLAMA_BIN is set but {} is missing (tools/llama-cpp.sh builds it)",
            dir.join(tool).display()
        );
    }
    Some(dir)
}

/// Runs `tool` from `bin` with `args`; its stdout and stderr, after checking
/// that it succeeded.
fn run(bin: &Path, tool: &str, args: &[&std::ffi::OsStr]) -> (String, String) {
    let o = Command::new(bin.join(tool)).args(args).output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(
        o.status.success(),
        "{tool} {args:?}: {}\n{out}\n{err}",
        o.status
    );
    (out, err)
}

/// Greedy completion of PROMPT: (the generated text after the prompt,
/// stderr).
fn complete(bin: &Path, model: &Path) -> (String, String) {
    let args = [
        "-m".as_ref(),
        model.as_os_str(),
        "-p".as_ref(),
        PROMPT.as_ref(),
        // 4 tokens, greedy (temperature 0), fixed seed, no chat mode (the
        // tool would wait for input), a small context, both cores.
        "-n".as_ref(),
        "4".as_ref(),
        "--temp".as_ref(),
        "0".as_ref(),
        "--seed".as_ref(),
        "42".as_ref(),
        "-no-cnv".as_ref(),
        "-c".as_ref(),
        "128".as_ref(),
        "-t".as_ref(),
        "2".as_ref(),
        // (the loader's lines, "CPU_Mapped model buffer size", are at
        // level 4)
        "-lv".as_ref(),
        "4".as_ref(),
    ];
    let (out, err) = run(bin, "llama-completion", &args);
    let text = out
        .strip_prefix(PROMPT)
        .unwrap_or_else(|| panic!("stdout does not start with the prompt: {out:?}\n{err}"));
    (text.to_string(), err)
}

/// `llama-perplexity` over the GPL-3 text with the command of the committed
/// reference figure (tests/data/probe/reference.json, `perplexity.f32.prefix`:
/// 4 windows of 256 tokens, f32 KV cache, no flash attention): (the "Final
/// estimate: PPL = ..." line, the running estimates "[1]...,[4]...",
/// stderr).
fn perplexity(bin: &Path, model: &Path) -> (String, String, String) {
    perplexity_over(bin, model, 256, 4)
}

/// `llama-perplexity` as [`perplexity`], over `chunks` windows of `ctx`
/// tokens.
fn perplexity_over(bin: &Path, model: &Path, ctx: u32, chunks: u32) -> (String, String, String) {
    let text = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/probe/gpl-3.0.txt");
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "-m".as_ref(),
        model.as_os_str(),
        "-f".as_ref(),
        text.as_os_str(),
    ];
    let (ctx, chunks) = (ctx.to_string(), chunks.to_string());
    for a in ["-c", &ctx, "-b", &ctx, "--chunks", &chunks] {
        args.push(a.as_ref());
    }
    for a in "-t 2 -ctk f32 -ctv f32 -fa off -lv 4".split(' ') {
        args.push(a.as_ref());
    }
    let (out, err) = run(bin, "llama-perplexity", &args);
    let all = format!("{out}\n{err}");
    let estimate = all
        .lines()
        .find(|l| l.contains("Final estimate: PPL = "))
        .unwrap_or_else(|| panic!("no final estimate:\n{all}"));
    let estimate = estimate[estimate.find("Final estimate").unwrap()..].to_string();
    // The running estimates, "[1]12.3456,[2]...,[4]..."
    let last = format!("[{chunks}]");
    let windows = all
        .lines()
        .find(|l| l.contains("[1]") && l.contains(&last))
        .unwrap_or_else(|| panic!("no per-window estimates:\n{all}"));
    let windows = windows[windows.find("[1]").unwrap()..].trim().to_string();
    (estimate, windows, err)
}

fn assert_mapped(what: &str, stderr: &str) {
    assert!(
        stderr.contains("CPU_Mapped model buffer size"),
        "{what}: llama.cpp did not mmap the model:\n{stderr}"
    );
}

/// Mounts `source` and runs both tools on its `model.gguf` and on a local
/// copy of it: " Paris", mmap, the same completion and the same perplexity
/// estimates on both. Returns the final estimate line and the completion.
fn tools_on_the_view(bin: &Path, source: &Path) -> (String, String) {
    let m = Mounted::new(source, &[]);
    let view = m.path("model.gguf");
    // First read of the mount: llama.cpp's mmap, nothing cached yet.
    let (from_mount, err) = complete(bin, &view);
    assert_mapped("llama-completion on the mount", &err);
    assert!(
        from_mount.starts_with(" Paris"),
        "{PROMPT:?} -> {from_mount:?}\n{err}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("model-f32.gguf");
    std::fs::copy(&view, &copy).unwrap();
    let (from_copy, err) = complete(bin, &copy);
    assert_eq!(from_mount, from_copy, "mount vs local copy\n{err}");

    let (estimate, windows, err) = perplexity(bin, &view);
    assert_mapped("llama-perplexity on the mount", &err);
    let (estimate_copy, windows_copy, _) = perplexity(bin, &copy);
    eprintln!(
        "{}: mount: {estimate} ({windows}); local F32 copy: {estimate_copy}",
        source.display()
    );
    assert_eq!(estimate, estimate_copy, "perplexity: mount vs local copy");
    assert_eq!(
        windows, windows_copy,
        "per-window perplexity: mount vs local copy"
    );
    (estimate, from_mount)
}

needs! { [llama_cpp, model, fuse]
fn llama_cpp_tools_on_the_gguf_view() {
    let Some(bin) = llama_bin() else { return };
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let (estimate, from_mount) = tools_on_the_view(&bin, &model);
    // The F32 view generates the same greedy tokens as the Q4_1 source.
    let (from_source, err) = complete(&bin, &model);
    assert_eq!(from_mount, from_source, "mount vs the source GGUF\n{err}");
    // The same figure as the committed one, made with the same llama.cpp on
    // the F32 GGUF that llama.cpp's own llama-quantize writes from the Q4_1
    // file (tools/probe_reference.py): a reference that does not come from
    // rknot's view.
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/probe/reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let r = &reference["perplexity"]["f32"]["prefix"];
    let want = format!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        r["ppl"].as_f64().unwrap(),
        r["ppl_uncertainty"].as_f64().unwrap()
    );
    assert_eq!(
        estimate, want,
        "perplexity: mount vs the committed llama.cpp figure"
    );
    native_view_runs_as_the_source(&bin, &model, &from_source);
}
}

/// `model.native.gguf` of `model` (the Q4_1 blocks as stored): llama.cpp
/// maps it, answers what it answers on the source file (`from_source`),
/// and its perplexity estimates are the source file's, to the last digit
/// (2 windows of 128 tokens: a few seconds, the 4 x 256 of the F32 runs
/// above would add a minute to CI).
fn native_view_runs_as_the_source(bin: &Path, model: &Path, from_source: &str) {
    let m = Mounted::new(model, &[]);
    let native = m.path("model.native.gguf");
    let (from_native, err) = complete(bin, &native);
    assert_mapped("llama-completion on the native view", &err);
    assert!(
        from_native.starts_with(" Paris"),
        "{PROMPT:?} -> {from_native:?}\n{err}"
    );
    assert_eq!(
        from_native, from_source,
        "native view vs the source GGUF\n{err}"
    );
    let (estimate, windows, err) = perplexity_over(bin, &native, 128, 2);
    assert_mapped("llama-perplexity on the native view", &err);
    let (estimate_source, windows_source, _) = perplexity_over(bin, model, 128, 2);
    eprintln!("native view: {estimate} ({windows}); source file: {estimate_source}");
    assert_eq!(
        estimate, estimate_source,
        "perplexity: native view vs source"
    );
    assert_eq!(
        windows, windows_source,
        "per-window perplexity: native view vs source"
    );
}

needs! { [llama_cpp, model, fuse]
/// The same on a self-contained `.rknot` that `rknot encode rknot --profile
/// faithful` makes from SmolLM2 (lossy: about 5.8 bits per weight, 30 s; the
/// calibrated default takes minutes, tests/calibrated.rs):
/// llama.cpp on the mount still answers " Paris", and the perplexity of the
/// decoded weights is the same through the mount as from a local copy.
fn llama_cpp_tools_on_a_self_contained_rknot() {
    let Some(bin) = llama_bin() else { return };
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let encoded = tmp.path().join("smollm2.rknot");
    let o = run_rknot(&[
        "encode",
        "rknot",
        model.to_str().unwrap(),
        "--out",
        encoded.to_str().unwrap(),
        "--profile",
        "faithful",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    tools_on_the_view(&bin, &encoded);
}
}

needs! { [llama_cpp, model, fuse]
/// The compact view of a calibrated `.rknot` of SmolLM2. The encode is
/// the CI-sized one: calibrated on the first 6000 bytes of the committed
/// calibration text, round to nearest (`--no-gptq`), widths 4, 5 and 8 in
/// groups of 32 at 5.5 bits per weight (about 100 s on 2 shared cores, where the defaults take
/// 10 min).
fn llama_cpp_on_the_native_view_of_a_calibrated_rknot() {
    let Some(bin) = llama_bin() else { return };
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("data/calibration/python-idle-help.txt")).unwrap();
    let mut cut = 6000.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let cal = tmp.path().join("calibration.txt");
    std::fs::write(&cal, &text[..cut]).unwrap();
    let encoded = tmp.path().join("smollm2-calibrated.rknot");
    let o = run_rknot(&[
        "encode",
        "rknot",
        model.to_str().unwrap(),
        "--out",
        encoded.to_str().unwrap(),
        "--calibrate",
        cal.to_str().unwrap(),
        "--calibration-ctx",
        "256",
        "--no-gptq",
        "--widths",
        "4,5,8",
        "--groups",
        "32",
        // 4-bit codes in groups of 32 with f16 scale and offset are 5 bits
        // a weight already: the default 4.95 cannot be met.
        "--target-bpw",
        "5.5",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = Mounted::new(&encoded, &[]);
    let native = m.path("model.native.gguf");
    let (from_native, err) = complete(&bin, &native);
    assert_mapped("llama-completion on the native view of a .rknot", &err);
    assert!(
        from_native.starts_with(" Paris"),
        "{PROMPT:?} -> {from_native:?}\n{err}"
    );
    assert!(
        err.contains("type q4_1:"),
        "the matrices are not Q4_1:\n{err}"
    );
    let copy = tmp.path().join("native-copy.gguf");
    std::fs::copy(&native, &copy).unwrap();
    let (estimate, windows, err) = perplexity_over(&bin, &native, 128, 2);
    assert_mapped("llama-perplexity on the native view of a .rknot", &err);
    let (estimate_copy, windows_copy, _) = perplexity_over(&bin, &copy, 128, 2);
    let (estimate_f32, _, _) = perplexity_over(&bin, &m.path("model.gguf"), 128, 2);
    eprintln!("native view: {estimate} ({windows}); local copy: {estimate_copy}; F32 view: {estimate_f32}");
    assert_eq!(estimate, estimate_copy, "perplexity: native view vs its copy");
    assert_eq!(windows, windows_copy, "per-window: native view vs its copy");
    let ppl = |line: &str| -> f64 {
        line.trim_start_matches("Final estimate: PPL = ")
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (a, b) = (ppl(&estimate), ppl(&estimate_f32));
    assert!(
        (a - b).abs() <= 0.05 * b,
        "native view {a} vs F32 view {b}: more than 5% apart"
    );
}
}
