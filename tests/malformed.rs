//! Every file of the committed malformed corpus (tests/data/malformed) must
//! be refused with the expected `ErrorKind`, a message that says what is
//! wrong and names the file, and never a panic. The corpus itself must be
//! exactly what the generator builds.

#[path = "common/malformed_corpus.rs"]
mod corpus;

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use corpus::Expected;
use rknot::backend;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/malformed")
}

fn load_expected(dir: &Path) -> Vec<Expected> {
    let raw = std::fs::read(dir.join(corpus::EXPECTED_JSON)).expect("read expected.json");
    serde_json::from_slice(&raw).expect("parse expected.json")
}

/// Open (and read, if the case says so); the error, or a description of why
/// there was none.
fn run_case(dir: &Path, e: &Expected) -> Result<rknot::Error, String> {
    let path = dir.join(&e.file);
    let dense = e.dense.as_ref().map(|d| dir.join(d));
    let b = match backend::open(&path, dense.as_deref()) {
        Err(err) => {
            return match &e.read {
                None => Ok(err),
                Some(_) => Err(format!(
                    "open failed but the case expects a read failure: {err}"
                )),
            };
        }
        Ok(b) => b,
    };
    let Some(name) = &e.read else {
        return Err("opened without error".to_string());
    };
    let index = b
        .find(name)
        .map_err(|err| format!("no tensor {name}: {err}"))?;
    let n = b.tensors().entries()[index].n_elements;
    if n > 1 << 20 {
        return Err(format!(
            "tensor {name} has {n} elements, too many for a test"
        ));
    }
    let mut out = vec![0f32; n as usize];
    match b.read_f32(index, 0, &mut out) {
        Ok(()) => Err(format!("read of {name} succeeded")),
        Err(err) => Ok(err),
    }
}

/// Problems with one case (empty = pass).
fn check_case(dir: &Path, e: &Expected) -> Vec<String> {
    let mut problems = Vec::new();
    let got = match catch_unwind(AssertUnwindSafe(|| run_case(dir, e))) {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return vec![format!("PANICKED: {msg}")];
        }
        Ok(Err(why)) => return vec![why],
        Ok(Ok(err)) => err,
    };
    let shown = got.to_string();
    if format!("{:?}", got.kind()) != e.kind {
        problems.push(format!("kind {:?}, expected {}", got.kind(), e.kind));
    }
    for want in std::iter::once(&e.contains).chain(&e.contains_also) {
        if !shown.contains(want.as_str()) {
            problems.push(format!("message lacks {want:?}"));
        }
    }
    let blamed = match e.blame.as_deref() {
        None | Some("file") => dir.join(&e.file),
        Some("dense") => dir.join(e.dense.as_deref().unwrap_or("<no dense>")),
        Some(other) => {
            problems.push(format!("unknown blame {other:?}"));
            dir.join(&e.file)
        }
    };
    let blamed = blamed.display().to_string();
    if !shown.contains(&blamed) {
        problems.push(format!("message does not name {blamed}"));
    }
    if !problems.is_empty() {
        problems.push(format!("got {:?}: {shown}", got.kind()));
    }
    problems
}

#[test]
fn every_malformed_file_fails_as_expected() {
    let dir = corpus_dir();
    let expected = load_expected(&dir);
    assert!(!expected.is_empty());
    let mut failures = Vec::new();
    for e in &expected {
        let problems = check_case(&dir, e);
        if !problems.is_empty() {
            failures.push(format!(
                "{} ({}):\n    {}",
                e.file,
                e.why,
                problems.join("\n    ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} malformed cases failed:\n{}",
        failures.len(),
        expected.len(),
        failures.join("\n")
    );
}

#[test]
fn committed_corpus_matches_generator() {
    let committed = corpus_dir();
    let fresh = tempfile::tempdir().expect("tempdir");
    corpus::write_to(fresh.path()).expect("generate corpus");
    let list = |d: &Path| -> BTreeSet<String> {
        std::fs::read_dir(d)
            .expect("read corpus dir")
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    };
    let (a, b) = (list(&committed), list(fresh.path()));
    let regen =
        "regenerate with `cargo run --example make_malformed_corpus -- tests/data/malformed`";
    assert_eq!(a, b, "file lists differ; {regen}");
    for name in &a {
        let x = std::fs::read(committed.join(name)).expect("read committed");
        let y = std::fs::read(fresh.path().join(name)).expect("read fresh");
        assert!(
            x == y,
            "{name} differs from the generator's output; {regen}"
        );
    }
}

#[test]
fn corpus_is_small_and_consistent() {
    let dir = corpus_dir();
    let expected = load_expected(&dir);
    let mut total = 0u64;
    for entry in std::fs::read_dir(&dir).expect("read corpus dir") {
        let entry = entry.expect("dir entry");
        let len = entry.metadata().expect("metadata").len();
        if entry.file_name() != corpus::EXPECTED_JSON {
            assert!(len < 4096, "{:?} is {len} bytes", entry.file_name());
        }
        total += len;
    }
    assert!(total < 256 * 1024, "corpus is {total} bytes");
    let mut seen = BTreeSet::new();
    for e in &expected {
        assert!(seen.insert(&e.file), "{} listed twice", e.file);
        assert!(dir.join(&e.file).is_file(), "{} missing", e.file);
        if let Some(d) = &e.dense {
            assert!(dir.join(d).is_file(), "{d} missing");
        }
        assert!(!e.contains.is_empty() && !e.why.is_empty(), "{}", e.file);
    }
}
