//! `model.native.gguf`, the compact GGUF view: every tensor in a ggml
//! type, read through real FUSE mounts.
//!
//! - SmolLM2's Q4_1 GGUF: gguf-py reads the view; its key/values, tensor
//!   names, types and shapes are the source's, every tensor's bytes equal
//!   the source's (gguf-py on both), offsets aligned;
//! - the same file over HTTP: the view is byte-identical to the local
//!   mount's (fetched lazily through the remote source's block cache);
//! - a dense .knot with checksums: its view carries the .knot's ggml blocks,
//!   and a damaged byte fails the reads of its tensor's bytes (EIO) while
//!   every other byte is served: the checks of the F32 path guard these
//!   bytes too;
//! - calibrated `.rknot`s of the demo model (affine codes of 3, 5 and 8
//!   bits, groups of 32 and 64, its other tensors as ggml blocks): gguf-py
//!   reads the view, the affine tensors are Q4_1 (3 bits), Q5_1 (5 bits) or
//!   F32 (8 bits), the stored ones their stored types, and every tensor
//!   dequantizes (gguf-py) to exactly the f32 the mount's `model.gguf`
//!   serves, bit for bit; a damaged byte in a re-packed tensor fails its
//!   reads (EIO) and nothing else;
//! - a faithful-profile `.rknot` over its GGUF: its uniform/graded tensors
//!   F32 (decoded), the fallback's verbatim, the same equality;
//! - an SK32 source has no native view and index.json says why (f16/bf16
//!   is its compact form).
//!
//! A split set's view equals the unsplit file's: tests/split_gguf.rs
//! (`view_hashes`). llama.cpp on the view: tests/llama_cpp.rs.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::http_server::Server;
use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::backend::{self, Role};
use rknot::format::gguf::GgufFile;
use rknot::source::SourceFile;

const VIEW: &str = "model.native.gguf";

/// gguf-py over a native view (argv[1]) and its source GGUF (argv[2]):
/// the same key/values in the same order (types and contents; the source's
/// `general.alignment` and `split.*` keys aside), the same tensors in the
/// same order with the same type and shape, each at an aligned offset, and
/// each tensor's bytes equal. Prints `OK <tensors> <keys> <types>`.
const NATIVE_CHECK: &str = r#"
import sys
from gguf import GGUFReader
view, src = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
def kvs(r):
    return [(k, [t.name for t in f.types], f.contents()) for k, f in r.fields.items()
            if not k.startswith("GGUF.") and not k.startswith("split.") and k != "general.alignment"]
a, b = kvs(view), kvs(src)
assert [k for k, _, _ in a] == [k for k, _, _ in b], "key order"
for x, y in zip(a, b):
    assert x == y, (x[0], x[1], y[1], str(x[2])[:200], str(y[2])[:200])
align = view.fields["general.alignment"].contents() if "general.alignment" in view.fields else 32
srcalign = src.fields["general.alignment"].contents() if "general.alignment" in src.fields else 32
assert align == srcalign, (align, srcalign)
assert [t.name for t in view.tensors] == [t.name for t in src.tensors]
types = set()
for t, s in zip(view.tensors, src.tensors):
    assert t.tensor_type == s.tensor_type, (t.name, t.tensor_type, s.tensor_type)
    assert list(t.shape) == list(s.shape), (t.name, t.shape, s.shape)
    assert t.n_bytes == s.n_bytes, (t.name, t.n_bytes, s.n_bytes)
    assert (t.data_offset - view.data_offset) % align == 0, t.name
    assert t.data.tobytes() == s.data.tobytes(), t.name
    types.add(t.tensor_type.name)
print("OK", len(view.tensors), len(a), ",".join(sorted(types)))
"#;

/// index.json's entry for the native view.
fn index_entry(m: &Mounted) -> serde_json::Value {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    index["views"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == VIEW)
        .cloned()
        .unwrap_or_else(|| panic!("index.json lists no {VIEW}: {index:#}"))
}

needs! { [model, fuse]
/// SmolLM2's Q4_1 GGUF through the view: gguf-py reads the source's
/// key/values and tensors, the tensors' bytes the source's; index.json and
/// ctl describe it; nothing is decoded.
fn the_native_view_of_a_gguf_is_its_stored_bytes() {
    let Some(model) = smollm2() else { return };
    assert!(fuse_available());
    let m = Mounted::new(&model, &[]);
    let Some(out) = python(NATIVE_CHECK, &[&m.path(VIEW), &model]) else {
        return;
    };
    assert!(out.starts_with("OK 272 "), "{out}");
    assert!(out.contains("Q4_1"), "{out}");
    let e = index_entry(&m);
    assert_eq!(e["available"], true, "{e}");
    assert_eq!(e["dtype"], "stored", "{e}");
    assert_eq!(e["kind"], "gguf", "{e}");
    let size = std::fs::metadata(m.path(VIEW)).unwrap().len();
    assert_eq!(e["size"], size, "{e}");
    // SmolLM2's file as llama.cpp wrote it (key order, alignment 32, tensors
    // packed in order): the view is that file, byte for byte.
    let source = std::fs::read(&model).unwrap();
    assert_eq!(size, source.len() as u64);
    assert!(
        std::fs::read(m.path(VIEW)).unwrap() == source,
        "the view is not the source file"
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(m.path(VIEW)).unwrap().ino(), 10);
    let ctl = m.ctl();
    assert!(ctl.contains(&format!("view:      {VIEW} (stored, {size} B)")), "{ctl}");
    assert!(ctl.contains("errors 0 (0 checksum)"), "{ctl}");
    assert!(ctl.contains("bytes decoded 0,"), "{ctl}");
}
}

needs! { [model, fuse]
/// Over HTTP: one local-looking file, fetched lazily, the same bytes as
/// the local mount's view.
fn the_native_view_of_a_remote_gguf_is_the_local_ones() {
    let Some(model) = smollm2() else { return };
    assert!(fuse_available());
    let want = {
        let m = Mounted::new(&model, &[]);
        sha256_hex(&std::fs::read(m.path(VIEW)).unwrap())
    };
    let s = Server::start(std::fs::read(&model).unwrap());
    let url = s.url("m.gguf");
    let m = Mounted::new(Path::new(&url), &[]);
    let got = sha256_hex(&std::fs::read(m.path(VIEW)).unwrap());
    assert_eq!(got, want, "remote vs local native view");
    let ctl = m.ctl();
    assert!(ctl.contains("errors 0 (0 checksum)"), "{ctl}");
}
}

needs! { [fuse]
/// A dense .knot (checksums on) from the demo GGUF: its view holds the
/// .knot's blocks; a byte flipped in one tensor fails the view's reads of
/// that tensor with EIO, every other tensor is served, and ctl counts it.
fn the_native_view_of_a_dense_knot_is_checked() {
    assert!(fuse_available());
    let dir = tempfile::tempdir().unwrap();
    let knot = dir.path().join("m.knot");
    let gguf = demo_path("tiny-llama.gguf");
    let o = run_rknot(&[
        "encode",
        "knot",
        gguf.to_str().unwrap(),
        "--out",
        knot.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let b = backend::open_single(&knot, Role::Primary).unwrap();
    let dense = b.as_dense().unwrap();
    // Each tensor's stored bytes, as the .knot holds them.
    let stored: Vec<(String, Vec<u8>)> = b
        .tensors()
        .entries()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut buf = vec![0u8; t.stored_bytes as usize];
            dense.read_stored(i, 0, &mut buf).unwrap();
            (t.name.dot.clone(), buf)
        })
        .collect();
    let bad = "blk.0.ffn_down.weight";
    let bad_range = {
        let i = b.tensors().get(bad).unwrap();
        b.stored_ranges(i).unwrap().ranges[0].clone()
    };
    drop(b);
    // Direct I/O: each read the kernel sends is the one made here (in
    // page-cache mode its read-ahead would fail reads next to the damage).
    // The view's tensor table, from the intact file's mount (the header
    // reader's first read spans tensor bytes too).
    let g = {
        let m = Mounted::new(&knot, &[]);
        GgufFile::read(&SourceFile::open(&m.path(VIEW)).unwrap()).unwrap()
    };
    assert_eq!(g.tensors.len(), stored.len());
    let check = |path: &Path, damaged: Option<&str>| {
        let m = Mounted::new(path, &["-o", "direct_io"]);
        let file = std::fs::File::open(m.path(VIEW)).unwrap();
        for (t, (name, want)) in g.tensors.iter().zip(&stored) {
            assert_eq!(&t.name, name);
            assert_eq!(t.n_bytes, want.len() as u64, "{name}");
            let mut got = vec![0u8; want.len()];
            let r = file.read_exact_at(&mut got, t.offset);
            if damaged == Some(name.as_str()) {
                let e = r.expect_err("a damaged tensor's bytes were served");
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
            } else {
                r.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(&got == want, "{name}: the view's bytes are not the .knot's");
            }
        }
        m.ctl()
    };
    let ctl = check(&knot, None);
    assert!(ctl.contains("errors 0 (0 checksum)"), "{ctl}");
    let mut bytes = std::fs::read(&knot).unwrap();
    bytes[(bad_range.start + 5) as usize] ^= 0x10;
    let damaged = dir.path().join("damaged.knot");
    std::fs::write(&damaged, bytes).unwrap();
    let ctl = check(&damaged, Some(bad));
    assert!(ctl.contains("errors 1 (1 checksum)"), "{ctl}");
}
}

/// gguf-py over a native view (argv[1]) and the F32 `model.gguf` of the
/// same mount (argv[2]): the same tensors in the same order and shape, each
/// at an aligned offset, and each dequantizes (gguf.quants) to exactly the
/// F32 view's values, bit for bit. Prints `OK <tensors> <type:count,...>`.
const DEQUANT_CHECK: &str = r#"
import sys, collections
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
view, f32 = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
assert [t.name for t in view.tensors] == [t.name for t in f32.tensors]
align = view.fields["general.alignment"].contents() if "general.alignment" in view.fields else 32
types = collections.Counter()
for t, s in zip(view.tensors, f32.tensors):
    assert list(t.shape) == list(s.shape), (t.name, t.shape, s.shape)
    assert (t.data_offset - view.data_offset) % align == 0, t.name
    got = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
    want = np.asarray(s.data, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, (t.name, got.shape, want.shape)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (t.name, t.tensor_type.name, bad.size, bad[:4], got[bad[:4]], want[bad[:4]])
    types[t.tensor_type.name] += 1
print("OK", len(view.tensors), ",".join(f"{k}:{v}" for k, v in sorted(types.items())))
"#;

/// gguf-py's view of `source`'s mount (with `args`): the dequantization
/// check, then the view's type per tensor name.
fn dequantizes_to_the_f32_view(
    source: &Path,
    args: &[&str],
) -> Option<(String, Vec<(String, String)>)> {
    let m = Mounted::new(source, args);
    assert!(m.path(VIEW).exists(), "no {VIEW}: {:#}", index_entry(&m));
    let out = python(DEQUANT_CHECK, &[&m.path(VIEW), &m.path("model.gguf")])?;
    assert!(out.starts_with("OK "), "{out}");
    let g = GgufFile::read(&SourceFile::open(&m.path(VIEW)).unwrap()).unwrap();
    let types = g
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.ty.name().to_string()))
        .collect();
    let e = index_entry(&m);
    assert_eq!(e["available"], true, "{e}");
    let ctl = m.ctl();
    assert!(ctl.contains("errors 0 (0 checksum)"), "{ctl}");
    Some((out, types))
}

/// A calibrated encode of the demo model with one code width and group
/// size for every matrix (`rknot calibrate` statistics of
/// [`tiny_calibration_stats`]).
fn tiny_calibrated(dir: &Path, stats: &Path, bits: u8, group: u64) -> std::path::PathBuf {
    let out = dir.join(format!("tiny-{bits}-{group}.rknot"));
    let model = demo_path("tiny-llama.gguf");
    let (bits, group) = (bits.to_string(), group.to_string());
    let o = run_rknot(&[
        "encode",
        "rknot",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--calibration-stats",
        stats.to_str().unwrap(),
        "--target-bpw",
        "16",
        "--widths",
        &bits,
        "--groups",
        &group,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

needs! { [fuse]
/// Calibrated .rknots of the demo model: each affine tensor re-packed into
/// the ggml type its code is (3 bits in groups of 64: Q4_1; 5 bits in
/// groups of 32: Q5_1) or decoded (8 bits: F32), the tensors stored as
/// ggml blocks in their stored type, and every tensor dequantizes (gguf-py)
/// to exactly the f32 the mount serves. Nothing is decoded for a re-packed
/// view.
fn the_native_view_of_a_calibrated_rknot_dequantizes_to_its_f32_view() {
    assert!(fuse_available());
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("tiny.stats");
    tiny_calibration_stats(&stats);
    let model = demo_path("tiny-llama.gguf");
    let source = GgufFile::read(&SourceFile::open(&model).unwrap()).unwrap();
    for (bits, group, want) in [(3u8, 64u64, "q4_1"), (5, 32, "q5_1"), (8, 32, "f32")] {
        let rknot = tiny_calibrated(dir.path(), &stats, bits, group);
        let b = backend::open(&rknot, None).unwrap();
        let Some((out, types)) = dequantizes_to_the_f32_view(&rknot, &[]) else {
            return;
        };
        eprintln!("{bits} bits, groups of {group}: {out}");
        for (name, ty) in &types {
            let i = b.find(name).unwrap();
            match &b.tensors().entries()[i].stored {
                backend::StoredType::Ggml(stored) => {
                    assert_eq!(ty, stored.name(), "{name}: stored type kept")
                }
                _ => assert_eq!(ty, want, "{name}: {bits}-bit affine"),
            }
        }
        assert_eq!(types.len(), source.tensors.len());
        if want != "f32" {
            let m = Mounted::new(&rknot, &[]);
            let _ = std::fs::read(m.path(VIEW)).unwrap();
            let ctl = m.ctl();
            assert!(ctl.contains("bytes decoded 0,"), "{ctl}");
        }
    }
}
}

needs! { [fuse]
/// A damaged byte in a re-packed tensor of a checked .rknot: the view's
/// reads of that tensor fail with EIO (the block group's CRC-32, as for a
/// decode), every other tensor's bytes are served as before.
fn the_native_view_of_a_rknot_is_checked() {
    assert!(fuse_available());
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("tiny.stats");
    tiny_calibration_stats(&stats);
    let rknot = tiny_calibrated(dir.path(), &stats, 4, 32);
    let bad = "blk.1.ffn_up.weight";
    let bad_range = {
        let b = backend::open(&rknot, None).unwrap();
        assert!(b.summary().checked, "the encode writes checksums");
        let i = b.find(bad).unwrap();
        b.stored_ranges(i).unwrap().ranges[0].clone()
    };
    let (g, intact) = {
        let m = Mounted::new(&rknot, &[]);
        let bytes = std::fs::read(m.path(VIEW)).unwrap();
        (
            GgufFile::read(&SourceFile::open(&m.path(VIEW)).unwrap()).unwrap(),
            bytes,
        )
    };
    let mut bytes = std::fs::read(&rknot).unwrap();
    bytes[(bad_range.start + 100) as usize] ^= 0x10;
    let damaged = dir.path().join("damaged.rknot");
    std::fs::write(&damaged, bytes).unwrap();
    let m = Mounted::new(&damaged, &["-o", "direct_io"]);
    let file = std::fs::File::open(m.path(VIEW)).unwrap();
    for t in &g.tensors {
        let mut got = vec![0u8; t.n_bytes as usize];
        let r = file.read_exact_at(&mut got, t.offset);
        if t.name == bad {
            let e = r.expect_err("a damaged tensor's bytes were served");
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        } else {
            r.unwrap_or_else(|e| panic!("{}: {e}", t.name));
            let want = &intact[t.offset as usize..(t.offset + t.n_bytes) as usize];
            assert!(got == want, "{}", t.name);
        }
    }
    let ctl = m.ctl();
    assert!(ctl.contains("errors 1 (1 checksum)"), "{ctl}");
}
}

needs! { [fuse]
/// The demo's faithful-profile .rknot (uniform and graded blocks, no ggml
/// type holds them exactly) over its GGUF: the compressed tensors F32,
/// decoded, the fallback's in their stored types, every tensor equal to
/// the F32 view's.
fn the_native_view_of_a_faithful_rknot_decodes_what_maps_onto_no_ggml_type() {
    assert!(fuse_available());
    let rknot = demo_path("tiny-llama.rknot");
    let gguf = demo_path("tiny-llama.gguf");
    let Some((out, types)) =
        dequantizes_to_the_f32_view(&rknot, &["--dense", gguf.to_str().unwrap()])
    else {
        return;
    };
    eprintln!("{out}");
    let b = backend::open(&rknot, Some(&gguf)).unwrap();
    for (name, ty) in &types {
        let i = b.find(name).unwrap();
        match &b.tensors().entries()[i].stored {
            backend::StoredType::Ggml(stored) => assert_eq!(ty, stored.name(), "{name}"),
            _ => assert_eq!(ty, "f32", "{name}"),
        }
    }
    assert!(types.iter().any(|(_, t)| t == "f32"));
    assert!(types.iter().any(|(_, t)| t != "f32"));
}
}

needs! { [fuse]
/// SK32 sketches are no ggml type: no native view, and index.json says
/// f16/bf16 is their compact form; model.gguf (F32) is there.
fn an_sk32_source_offers_no_native_view_and_says_why() {
    assert!(fuse_available());
    let sk32 = demo_path("tiny-llama.sk32");
    let gguf = demo_path("tiny-llama.gguf");
    let m = Mounted::new(&sk32, &["--dense", gguf.to_str().unwrap()]);
    assert!(!m.path(VIEW).exists());
    assert!(m.path("model.gguf").exists());
    let e = index_entry(&m);
    assert_eq!(e["available"], false, "{e}");
    let why = e["unavailable_reason"].as_str().unwrap();
    assert!(why.contains("f16/bf16"), "{why}");
}
}
