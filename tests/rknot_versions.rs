//! .rknot versions: files in the version-2 layout (written before version 3,
//! committed in tests/data/rknot-v2 with the SHA-256 of every tensor they
//! served then) still open and serve exactly those bytes; the same encode
//! in version 3 serves the same bytes from a smaller file whose header and
//! block index are a small part of it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use rknot::backend::{self, Backend};
use rknot::format::rknot::{RknotFile, read_layout};
use rknot::source::SourceFile;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/rknot-v2")
}

/// file name -> tensor -> SHA-256 of its served f32 bytes.
fn expected() -> serde_json::Map<String, serde_json::Value> {
    let raw = std::fs::read(fixtures().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    v["sha256_of_served_f32"].as_object().unwrap().clone()
}

/// Every tensor `want` lists, served by `b`, has the listed hash; and `b`
/// serves no other tensor.
fn assert_serves(b: &dyn Backend, want: &serde_json::Map<String, serde_json::Value>, what: &str) {
    assert_eq!(
        b.tensors().entries().len(),
        want.len(),
        "{what}: tensor count"
    );
    for (name, hash) in want {
        let got = sha256_hex(&decode_bytes(b, name));
        assert_eq!(got, hash.as_str().unwrap(), "{what}: {name}");
    }
}

/// Today's encoder with the faithful fixture's settings (its matrices
/// only, as version 2 files had), into `out`.
fn encode_like_the_faithful_fixture(out: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_rknot"))
        .args([
            "encode",
            "rknot",
            "--profile",
            "faithful",
            "--target-bpw",
            "5",
        ])
        .args(["--tensors", "blk.1.*", "--compressed-only", "-o"])
        .arg(out)
        .arg(demo_path("tiny-llama.gguf"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn version_2_files_serve_the_bytes_they_served_before() {
    for (file, want) in expected() {
        let path = fixtures().join(&file);
        let src = SourceFile::open(&path).unwrap();
        assert_eq!(read_layout(&src).unwrap().version, 2, "{file}");
        let b = backend::open(&path, None).unwrap();
        assert_serves(b.as_ref(), want.as_object().unwrap(), &file);
    }
}

/// The faithful fixture encoded again today: a version-3 file with the
/// same blocks, so the same served bytes; about 8% smaller, since the
/// block list left the header.
#[test]
fn version_3_encode_serves_the_same_bytes_from_a_smaller_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("f5.rknot");
    encode_like_the_faithful_fixture(&out);
    let src = SourceFile::open(&out).unwrap();
    let layout = read_layout(&src).unwrap();
    assert_eq!(layout.version, 3);
    let b = backend::open(&out, None).unwrap();
    let all = expected();
    let want = all["tiny-llama.faithful5.v2.rknot"].as_object().unwrap();
    assert_serves(b.as_ref(), want, "version-3 re-encode");

    let v2_len = std::fs::metadata(fixtures().join("tiny-llama.faithful5.v2.rknot"))
        .unwrap()
        .len();
    let v3_len = src.len();
    assert!(v3_len < v2_len, "v3 {v3_len} bytes, v2 {v2_len}");
    // The stored blocks are the same bytes in both.
    let v2 = RknotFile::read(
        &SourceFile::open(&fixtures().join("tiny-llama.faithful5.v2.rknot")).unwrap(),
    )
    .unwrap();
    let v3 = RknotFile::read(&src).unwrap();
    let stored = |f: &RknotFile| f.tensors.iter().map(|t| t.stored_bytes()).sum::<u64>();
    assert_eq!(stored(&v2), stored(&v3));
    assert_eq!(
        layout.body_len,
        stored(&v3),
        "the body is exactly the blocks"
    );
    eprintln!(
        "v2 {v2_len} bytes (header {}), v3 {v3_len} bytes (header {}, block index {})",
        v2.layout.header_len, layout.header_len, layout.index_len
    );
}

/// A layered mount's primary may be either version: the demo pair with
/// the version-2 fixture and with a version-3 re-encode serve the same
/// model.
#[test]
fn both_versions_layer_over_the_dense_fallback() {
    let dense = demo_path("tiny-llama.gguf");
    let v2 = fixtures().join("tiny-llama.faithful5.v2.rknot");
    let dir = tempfile::tempdir().unwrap();
    let v3 = dir.path().join("f5.rknot");
    encode_like_the_faithful_fixture(&v3);
    let a = backend::open(&v2, Some(&dense)).unwrap();
    let b = backend::open(&v3, Some(&dense)).unwrap();
    let names: Vec<String> = a
        .tensors()
        .entries()
        .iter()
        .map(|e| e.name.dot.clone())
        .collect();
    assert_eq!(names.len(), b.tensors().entries().len());
    for n in &names {
        assert_eq!(
            decode_bytes(a.as_ref(), n),
            decode_bytes(b.as_ref(), n),
            "{n}"
        );
    }
}

/// Version 2 lists each block where it likes: the fixture with its body's
/// blocks stored in reverse order (and listed so) serves the same bytes. The
/// read path batches the blocks of a version-3 file, which lie back to back;
/// a version-2 table must never be read as a run.
#[test]
fn version_2_blocks_listed_out_of_order_serve_the_same_bytes() {
    let file = "tiny-llama.faithful5.v2.rknot";
    let bytes = std::fs::read(fixtures().join(file)).unwrap();
    let header_len = u32::from_le_bytes(bytes[6..10].try_into().unwrap()) as usize;
    let body = &bytes[10 + header_len..];
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[10..10 + header_len]).unwrap();
    // Every block, in listing order, then laid out in reverse.
    let mut listed: Vec<(usize, usize, u64, u64)> = Vec::new();
    for (li, layer) in h["layers"].as_array().unwrap().iter().enumerate() {
        for (ti, t) in layer["tensors"].as_array().unwrap().iter().enumerate() {
            for b in t["blocks"].as_array().unwrap() {
                listed.push((li, ti, b[0].as_u64().unwrap(), b[1].as_u64().unwrap()));
            }
        }
    }
    let mut new_body = Vec::new();
    let mut new_offsets = vec![0u64; listed.len()];
    for (i, &(_, _, off, len)) in listed.iter().enumerate().rev() {
        new_offsets[i] = new_body.len() as u64;
        new_body.extend_from_slice(&body[off as usize..(off + len) as usize]);
    }
    let mut k = 0;
    for layer in h["layers"].as_array_mut().unwrap() {
        for t in layer["tensors"].as_array_mut().unwrap() {
            for b in t["blocks"].as_array_mut().unwrap() {
                b[0] = serde_json::json!(new_offsets[k]);
                k += 1;
            }
        }
    }
    let header = serde_json::to_vec(&h).unwrap();
    let mut out = b"RKNOT\x02".to_vec();
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&new_body);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reversed.rknot");
    std::fs::write(&path, out).unwrap();
    let b = backend::open(&path, None).unwrap();
    let all = expected();
    assert_serves(
        b.as_ref(),
        all[file].as_object().unwrap(),
        "blocks reversed",
    );
}
