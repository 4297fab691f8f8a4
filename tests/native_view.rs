//! `model.native.gguf`, the compact GGUF view: every tensor in its stored
//! ggml type, its bytes the source's, read through real FUSE mounts.
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
//! - a `.rknot` (blocks that are no ggml type) does not offer the view and
//!   index.json says why.
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

needs! { [fuse]
/// A .rknot's blocks are no ggml type: no native view, and index.json
/// says why; model.gguf (F32) is there.
fn a_rknot_offers_no_native_view_and_says_why() {
    assert!(fuse_available());
    let rknot = demo_path("tiny-llama.rknot");
    let gguf = demo_path("tiny-llama.gguf");
    let m = Mounted::new(&rknot, &["--dense", gguf.to_str().unwrap()]);
    assert!(!m.path(VIEW).exists());
    assert!(m.path("model.gguf").exists());
    let e = index_entry(&m);
    assert_eq!(e["available"], false, "{e}");
    let why = e["unavailable_reason"].as_str().unwrap();
    assert!(why.contains("not stored as ggml blocks"), "{why}");
}
}
