//! The README's shell blocks, run as a user pasting them would: every
//! ```` ```sh ```` block of README.md, in order, in one `bash -euo pipefail`
//! at the top of the checkout, on the SmolLM2 test model. A block whose
//! first line is `# readme-test: skip` is not run (the set-up commands
//! themselves: tools/demo.sh, tools/test.sh; docs/TESTING.md). The test
//! substitutes only what it must: `/mnt/w` becomes a temporary mountpoint,
//! TMPDIR a temporary directory (the blocks `cd "$(mktemp -d)"` for their
//! outputs), and RKNOT_BIN_DIR the binaries under test (tools/env.sh puts
//! them on PATH instead of target/release). A failing command fails the
//! test with the script's output.
//!
//! Needs FUSE, the model, llama.cpp's tools and transformers (the blocks
//! run `llama-completion` and `$RKNOT_HF_PYTHON`).

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::mount::{MountGuard, mountpoint};
use common::needs::needs;
use common::*;

const SKIP_MARKER: &str = "# readme-test: skip";

/// The README's ```` ```sh ```` blocks, in order: (first line number, text).
fn sh_blocks(readme: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in readme.lines().enumerate() {
        match open.as_mut() {
            None if line.trim_end() == "```sh" => open = Some((i + 2, String::new())),
            None => {}
            Some(_) if line.trim_end() == "```" => blocks.extend(open.take()),
            Some((_, text)) => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    assert!(open.is_none(), "README.md: a ```sh block is not closed");
    blocks
}

#[test]
fn the_readme_blocks_are_found_and_the_set_up_is_marked() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let blocks = sh_blocks(&readme);
    let skipped: Vec<_> = blocks
        .iter()
        .filter(|(_, b)| b.starts_with(SKIP_MARKER))
        .collect();
    assert_eq!(skipped.len(), 1, "one skipped block, the set-up");
    assert!(skipped[0].1.contains("tools/demo.sh") && skipped[0].1.contains("tools/test.sh"));
    assert!(
        blocks.len() >= 3,
        "the Use section's blocks: {}",
        blocks.len()
    );
}

needs! { [fuse, model, llama_cpp, hf]
/// Every block but the set-up, in one shell: exit 0 within the time limit,
/// and the answers the README promises (numpy's values, llama.cpp's
/// " Paris", the probe's top candidates).
fn the_readme_use_section_runs_as_written() {
    let Some(model) = smollm2() else { return };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let (dir, mp) = mountpoint();
    let _guard = MountGuard::new(&mp, None);
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut script = String::from("set -euo pipefail\n");
    for (line, block) in sh_blocks(&readme) {
        if block.starts_with(SKIP_MARKER) {
            continue;
        }
        script.push_str(&format!("echo '+ README.md block at line {line}' >&2\n"));
        script.push_str(&block.replace("/mnt/w", &mp.to_string_lossy()));
    }
    // The model the README names is the one tools/fetch-smollm2.sh puts in
    // models/; the test's model may live elsewhere ($RKNOT_SMOLLM2).
    let named = format!("$PWD/{SMOLLM2_REL}");
    assert!(script.contains(&named), "the README's blocks name {named}");
    let script = script.replace(&named, &model.to_string_lossy());
    let bin_dir: PathBuf = rknot_bin().parent().unwrap().to_path_buf();
    let t = Instant::now();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(root)
        .env("TMPDIR", &tmp)
        .env("RKNOT_BIN_DIR", &bin_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        so.read_to_string(&mut s).ok();
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        se.read_to_string(&mut s).ok();
        s
    });
    // Never a hang. Measured: 274 s for the whole script at a load of 12
    // on the 2-core dev machine (the faithful encode alone 101 s of it).
    let limit = Duration::from_secs(900);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (so, se) = (out.join().unwrap(), err.join().unwrap());
    let secs = t.elapsed().as_secs_f64();
    let shown = format!("--- script\n{script}--- stdout\n{so}--- stderr\n{se}");
    let Some(status) = status else {
        panic!("the README's blocks did not finish in {limit:?}\n{shown}");
    };
    assert!(status.success(), "the README's blocks failed ({status})\n{shown}");
    eprintln!("README blocks: {secs:.1} s");
    // What the blocks print: four numpy values, llama.cpp's completion,
    // the probe's candidates.
    assert!(so.contains('[') && so.contains(']'), "numpy's values\n{shown}");
    assert!(so.contains("Paris"), "\" Paris\" from llama.cpp and the probe\n{shown}");
    assert!(se.contains("smaller than the source") || se.contains("larger than the source"),
        "the encoder's verdict against the source\n{shown}");
}
}
