//! Hugging Face safetensors sources (issue 23, item 2).
//!
//! - Hostile headers and indexes, written here byte by byte: each refused
//!   with the file, the tensor where there is one, and a byte offset.
//! - Real-tool files (`RKNOT_HF_PYTHON`: torch + transformers): tiny random
//!   llama and qwen2 checkpoints saved by transformers' `save_pretrained`
//!   (f32 and bf16, single and sharded) and a file of every decoded dtype
//!   (F16, F64, BF16, F8_E4M3 and F8_E5M2 over all 256 bytes) written by
//!   `safetensors.torch.save_file` (tests/data/safetensors/make_checkpoints.py).
//!   Every tensor, through `rknot cat` and through a mount, in both
//!   spellings, equals torch's `.to(torch.float32)` bit for bit; the GGUF
//!   spelling's Q/K rows as convert_hf_to_gguf.py's `LlamaModel.permute`
//!   writes them (computed in Python from that formula).
//! - The same sharded checkpoint over HTTP and S3 (moto).
//! - The CLI on a checkpoint: inspect, verify, manifest, encode rknot, sk32
//!   and knot.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::mount::Mounted;
use common::needs::needs;
use common::run_rknot;
use rknot::ErrorKind;
use rknot::backend::{Role, open_single};
use serde_json::{Value, json};

// ------------------------------------------------------------ writing files

/// A safetensors file: the length prefix, `header`, then `data`.
fn st_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A valid file of f32 tensors `(name, values)`, laid out in order.
fn st_f32(tensors: &[(&str, &[f32])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, values) in tensors {
        let begin = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            (*name).into(),
            json!({"dtype": "F32", "shape": [values.len()], "data_offsets": [begin, data.len()]}),
        );
    }
    st_bytes(&Value::Object(header).to_string(), &data)
}

fn open_err(path: &Path) -> rknot::Error {
    match open_single(path, Role::Primary) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e,
    }
}

// ---------------------------------------------------------- hostile headers

/// What is broken, the file, the error kind, a piece of its message, and
/// the tensor it must name (if one is at fault).
type HostileCase = (
    &'static str,
    Vec<u8>,
    ErrorKind,
    &'static str,
    Option<&'static str>,
);

/// Each malformed header is refused with its kind, a message naming what
/// is wrong, the file, the tensor (where one is at fault) and a byte offset.
#[test]
fn hostile_headers_are_refused_naming_file_tensor_and_offset() {
    let t = |dtype: &str, shape: &str, offsets: &str| {
        format!(r#""dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}"#)
    };
    let ok = t("F32", "[2]", "[0,8]");
    let data8 = [0u8; 8];
    #[rustfmt::skip]
    let cases: Vec<HostileCase> = vec![
        ("empty file", vec![], ErrorKind::Truncated, "8-byte header length", None),
        ("short prefix", vec![1, 0, 0], ErrorKind::Truncated, "8-byte header length", None),
        ("huge length", {
            let mut b = u64::MAX.to_le_bytes().to_vec(); b.extend(b"{}"); b
        }, ErrorKind::TooLarge, "cap", None),
        ("length past the end", {
            let mut b = 100u64.to_le_bytes().to_vec(); b.extend(b"{}"); b
        }, ErrorKind::Truncated, "past the end", None),
        ("not an object", st_bytes("[1,2]", &[]), ErrorKind::BadJson, "start with '{'", None),
        ("not json", st_bytes("{\"a\":", &[]), ErrorKind::BadJson, "not valid JSON", None),
        ("not utf-8", {
            let mut b = 4u64.to_le_bytes().to_vec(); b.extend(b"{\"\xff}"); b
        }, ErrorKind::BadJson, "UTF-8", None),
        ("duplicate tensor", st_bytes(&format!(r#"{{"a":{{{ok}}},"a":{{{ok}}}}}"#), &data8),
            ErrorKind::BadJson, "names \"a\" twice", None),
        ("duplicate field", st_bytes(&format!(r#"{{"a":{{{ok},"dtype":"F32"}}}}"#), &data8),
            ErrorKind::BadJson, "names \"dtype\" twice", Some("a")),
        ("unknown field", st_bytes(&format!(r#"{{"a":{{{ok},"x":1}}}}"#), &data8),
            ErrorKind::BadJson, "field \"x\"", Some("a")),
        ("missing offsets", st_bytes(r#"{"a":{"dtype":"F32","shape":[2]}}"#, &data8),
            ErrorKind::BadJson, "no \"data_offsets\"", Some("a")),
        ("unknown dtype", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F33", "[2]", "[0,8]")), &data8),
            ErrorKind::UnknownType, "F33", Some("a")),
        ("negative dim", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[-2]", "[0,8]")), &data8),
            ErrorKind::BadJson, "non-negative integer", Some("a")),
        ("three offsets", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[2]", "[0,4,8]")), &data8),
            ErrorKind::BadJson, "more than 2", Some("a")),
        ("too many dims", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[1,1,1,1,1,1,1,1,2]", "[0,8]")), &data8),
            ErrorKind::BadJson, "more than 8", Some("a")),
        ("size disagrees", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[3]", "[0,8]")), &data8),
            ErrorKind::LengthMismatch, "takes 12", Some("a")),
        ("offsets reversed", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[2]", "[8,0]")), &data8),
            ErrorKind::BadValue, "end before", Some("a")),
        ("gap", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[1]", "[4,8]")), &data8),
            ErrorKind::BadValue, "gap", Some("a")),
        ("overlap", st_bytes(&format!(r#"{{"a":{{{}}},"b":{{{}}}}}"#,
            t("F32", "[2]", "[0,8]"), t("F32", "[1]", "[4,8]")), &data8),
            ErrorKind::BadValue, "overlaps", Some("b")),
        ("past the data", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[4]", "[0,16]")), &data8),
            ErrorKind::OutOfBounds, "past the end", Some("a")),
        ("data left over", st_bytes(&format!(r#"{{"a":{{{}}}}}"#, t("F32", "[1]", "[0,4]")), &data8),
            ErrorKind::LengthMismatch, "cover 4 bytes", None),
        ("overflowing shape", st_bytes(&format!(r#"{{"a":{{{}}}}}"#,
            t("F32", "[4294967296,4294967296]", "[0,8]")), &data8),
            ErrorKind::Overflow, "overflows", Some("a")),
        ("huge offsets", st_bytes(&format!(r#"{{"a":{{{}}}}}"#,
            t("F32", "[4611686018427387904]", "[0,18446744073709551615]")), &data8),
            ErrorKind::LengthMismatch, "whole number of bytes, or overflow", Some("a")),
        ("metadata not strings", st_bytes(&format!(r#"{{"__metadata__":{{"k":1}},"a":{{{ok}}}}}"#), &data8),
            ErrorKind::BadJson, "not a string", None),
        ("metadata twice", st_bytes(&format!(r#"{{"__metadata__":{{"k":"1","k":"2"}},"a":{{{ok}}}}}"#), &data8),
            ErrorKind::BadJson, "names \"k\" twice", None),
        ("metadata an array", st_bytes(&format!(r#"{{"__metadata__":[],"a":{{{ok}}}}}"#), &data8),
            ErrorKind::BadJson, "array", None),
        ("tensor not an object", st_bytes(r#"{"a":[1]}"#, &data8), ErrorKind::BadJson, "is an array, not an object", Some("a")),
        ("bad tensor name", st_bytes(&format!(r#"{{"../a":{{{ok}}}}}"#), &data8),
            ErrorKind::BadName, "", None),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (what, bytes, kind, needle, tensor) in cases {
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let e = open_err(&path);
        let s = e.to_string();
        assert_eq!(e.kind(), kind, "{what}: {s}");
        assert!(s.contains(needle), "{what}: {s}");
        assert!(
            s.contains(&path.display().to_string()),
            "{what} names no file: {s}"
        );
        if kind != ErrorKind::BadName {
            assert!(e.offset().is_some(), "{what} gives no offset: {s}");
        }
        if let Some(t) = tensor {
            assert_eq!(e.tensor_name(), Some(t), "{what}: {s}");
        }
    }
    // The offset of a tensor's fault is that of its entry in the header.
    let header = format!(r#"{{"a":{{{ok}}},"b":{{{}}}}}"#, t("F32", "[3]", "[8,16]"));
    let path = dir.path().join("m.safetensors");
    std::fs::write(&path, st_bytes(&header, &[0u8; 16])).unwrap();
    let e = open_err(&path);
    let at = 8 + header.find(r#"{"dtype":"F32","shape":[3]"#).unwrap() as u64;
    assert_eq!(e.offset(), Some(at), "{e}");
}

/// A file a reader with a magic does not claim, named otherwise, is
/// still recognised by its header; a valid one opens and reads.
#[test]
fn a_valid_file_opens_by_name_or_by_content() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = st_f32(&[("a.weight", &[1.0, -2.0]), ("b", &[0.5])]);
    for name in ["x.safetensors", "weights.bin"] {
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        let b = open_single(&path, Role::Primary).unwrap();
        assert_eq!(b.summary().format.name(), "safetensors");
        let i = b.find("a.weight").unwrap();
        let mut out = [0f32; 2];
        b.read_f32(i, 0, &mut out).unwrap();
        assert_eq!(out, [1.0, -2.0]);
        let note = b.summary().notes.join("\n");
        assert!(note.contains("Hugging Face names only"), "{note}");
    }
}

// ------------------------------------------------------------------ indexes

/// A sharded checkpoint of our own making in `dir`: `index` as given, and
/// shards a (x, y) and b (z).
fn write_sharded(dir: &Path, index: &str) {
    std::fs::write(
        dir.join("a.safetensors"),
        st_f32(&[("x", &[1.0]), ("y", &[2.0, 3.0])]),
    )
    .unwrap();
    std::fs::write(dir.join("b.safetensors"), st_f32(&[("z", &[4.0])])).unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
}

#[test]
fn index_refusals_name_the_shard_or_tensor() {
    let good = r#"{"metadata":{"total_size":16},"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#;
    let cases: &[(&str, &str, &str)] = &[
        (
            "a tensor named twice",
            r#"{"weight_map":{"x":"a.safetensors","x":"b.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#,
            "names tensor \"x\" twice",
        ),
        (
            "a shard outside the directory",
            r#"{"weight_map":{"x":"../a.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#,
            "\"../a.safetensors\": refused",
        ),
        (
            "an absolute shard",
            r#"{"weight_map":{"x":"/etc/passwd","y":"a.safetensors","z":"b.safetensors"}}"#,
            "refused",
        ),
        (
            "a URL shard",
            r#"{"weight_map":{"x":"http://evil/a.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#,
            "refused",
        ),
        (
            "a missing shard",
            r#"{"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"c.safetensors"}}"#,
            "shard \"c.safetensors\", which the index names, could not be opened",
        ),
        (
            "a tensor the index puts in the wrong shard",
            r#"{"weight_map":{"x":"b.safetensors","y":"a.safetensors","z":"b.safetensors"}}"#,
            "which the index puts in \"b.safetensors\"",
        ),
        (
            "a shard tensor the index does not name",
            r#"{"weight_map":{"x":"a.safetensors","z":"b.safetensors"}}"#,
            "which the index does not name",
        ),
        (
            "an indexed tensor its shard lacks",
            r#"{"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"b.safetensors","w":"b.safetensors"}}"#,
            "does not hold it",
        ),
        ("no weight_map", r#"{"metadata":{}}"#, "no \"weight_map\""),
        (
            "a shard that is not a string",
            r#"{"weight_map":{"x":1}}"#,
            "not a file name string",
        ),
    ];
    for (what, index, needle) in cases {
        let dir = tempfile::tempdir().unwrap();
        write_sharded(dir.path(), index);
        for open in [
            dir.path().join("model.safetensors.index.json"),
            dir.path().to_path_buf(),
        ] {
            let e = open_err(&open);
            let s = e.to_string();
            assert!(s.contains(needle), "{what}: {s}");
            assert!(s.contains(&dir.path().display().to_string()), "{what}: {s}");
        }
    }
    // A tensor in two shards: the one the index does not name refuses it.
    let dir = tempfile::tempdir().unwrap();
    write_sharded(dir.path(), good);
    std::fs::write(
        dir.path().join("b.safetensors"),
        st_f32(&[("y", &[9.0]), ("z", &[4.0])]),
    )
    .unwrap();
    let e = open_err(dir.path());
    assert_eq!(e.tensor_name(), Some("y"), "{e}");
    assert!(e.to_string().contains("b.safetensors"), "{e}");
    // The good index opens, from the index or the directory; a shard's
    // own name opens nothing but itself here (no `-0000k-of-` name).
    write_sharded(dir.path(), good);
    for open in [
        dir.path().join("model.safetensors.index.json"),
        dir.path().to_path_buf(),
    ] {
        let b = open_single(&open, Role::Primary).unwrap();
        assert_eq!(b.tensors().len(), 3);
        assert_eq!(b.source_files().len(), 2);
        let mut v = [0f32; 1];
        b.read_f32(b.find("z").unwrap(), 0, &mut v).unwrap();
        assert_eq!(v, [4.0]);
    }
    // A directory with two checkpoints is refused, naming both.
    std::fs::write(dir.path().join("other.safetensors.index.json"), good).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    std::fs::write(dir.path().join("x.safetensors.index.json"), good).unwrap();
    let e = open_err(dir.path());
    assert!(e.to_string().contains("2 safetensors indexes"), "{e}");
}

/// One shard of a sharded checkpoint, opened by its name, opens the whole
/// checkpoint through its index; without the index it is refused (a
/// fraction of a model is never served).
#[test]
fn a_shard_opens_its_whole_checkpoint_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("model-00001-of-00002.safetensors");
    let b = dir.path().join("model-00002-of-00002.safetensors");
    std::fs::write(&a, st_f32(&[("x", &[1.0])])).unwrap();
    std::fs::write(&b, st_f32(&[("z", &[4.0])])).unwrap();
    let e = open_err(&a);
    assert!(
        e.to_string().contains("one shard of a sharded checkpoint"),
        "{e}"
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"x":"model-00001-of-00002.safetensors","z":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    for p in [&a, &b] {
        let be = open_single(p, Role::Primary).unwrap();
        assert_eq!(be.tensors().len(), 2, "{}", p.display());
    }
}

// ------------------------------------------------------ real-tool checkpoints

struct Fixture {
    dir: PathBuf,
    reference: Value,
}

/// The checkpoints of make_checkpoints.py, made once per test binary.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let py = std::env::var_os("RKNOT_HF_PYTHON")
            .filter(|p| !p.is_empty())
            .expect("RKNOT_HF_PYTHON: a python3 with torch and transformers (tools/hf-env.sh)");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("safetensors-fixture");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/safetensors/make_checkpoints.py");
        let o = Command::new(py).arg(&script).arg(&dir).output().unwrap();
        assert!(
            o.status.success(),
            "make_checkpoints.py failed:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let reference =
            serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
        Fixture { dir, reference }
    })
}

/// One expected tensor: the name served and the file of its bytes.
struct Expect {
    name: String,
    bytes: Vec<u8>,
}

/// Every served name of checkpoint `name` with its expected f32 bytes:
/// the GGUF spelling for a known family, the Hugging Face name otherwise;
/// and the names listed as unavailable.
fn expected(name: &str) -> (PathBuf, Vec<Expect>, Vec<String>) {
    let c = &fixture().reference[name];
    let dir = PathBuf::from(c["dir"].as_str().unwrap());
    let mut out = Vec::new();
    let mut unavailable = Vec::new();
    for t in c["tensors"].as_array().unwrap() {
        let hf = t["hf"].as_str().unwrap().to_string();
        if t.get("served").is_some_and(Value::is_null) {
            unavailable.push(hf);
            continue;
        }
        let (served, file) = match t.get("gguf") {
            Some(g) => (g.as_str().unwrap(), t["gguf_file"].as_str().unwrap()),
            None => (hf.as_str(), t["hf_file"].as_str().unwrap()),
        };
        out.push(Expect {
            name: served.to_string(),
            bytes: std::fs::read(file).unwrap(),
        });
    }
    (dir, out, unavailable)
}

const CHECKPOINTS: &[&str] = &[
    "llama_f32",
    "llama_bf16_sharded",
    "qwen2_bf16",
    "qwen2_f32_sharded",
    "dtypes",
];

/// The underscore spelling of a name.
fn underscore(name: &str) -> String {
    name.replace('.', "_")
}

needs! { [hf]
    /// `rknot cat` of every tensor, in both spellings, equals torch's f32
    /// values (the GGUF spelling's Q/K rows as llama.cpp's converter
    /// permutes them); integer and bool tensors are refused, named.
    fn every_tensor_through_cat_equals_torch() {
        for c in CHECKPOINTS {
            let (dir, tensors, unavailable) = expected(c);
            assert!(!tensors.is_empty());
            let d = dir.to_str().unwrap();
            for t in &tensors {
                for name in [t.name.clone(), underscore(&t.name)] {
                    let o = run_rknot(&["cat", d, &name]);
                    assert!(o.status.success(), "{c} {name}: {}", String::from_utf8_lossy(&o.stderr));
                    assert!(o.stdout == t.bytes, "{c} {name}: bytes differ from torch's");
                }
            }
            for name in unavailable {
                let o = run_rknot(&["cat", d, &name]);
                let err = String::from_utf8_lossy(&o.stderr);
                assert!(!o.status.success() && err.contains("not weights"), "{c} {name}: {err}");
            }
        }
    }
}

needs! { [hf, fuse]
    /// A mount of each checkpoint directory serves every tensor file, both
    /// spellings, as torch's values; hf/ and the views are offered for a
    /// known family.
    fn every_tensor_through_a_mount_equals_torch() {
        for c in CHECKPOINTS {
            let (dir, tensors, _) = expected(c);
            let m = Mounted::new(&dir, &[]);
            for t in &tensors {
                for name in [t.name.clone(), underscore(&t.name)] {
                    let got = std::fs::read(m.path(&format!("{name}.f32")))
                        .unwrap_or_else(|e| panic!("{c} {name}.f32: {e}\n{}", m.log()));
                    assert!(got == t.bytes, "{c} {name}.f32 differs from torch's");
                }
            }
            let index: Value =
                serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
            assert_eq!(index["source"]["format"], "safetensors", "{c}: {index}");
            let notes = index["source"]["notes"].to_string();
            if *c == "dtypes" {
                assert!(notes.contains("Hugging Face names only"), "{c}: {notes}");
                continue;
            }
            // The Hugging Face names, in Hugging Face row order: hf/'s
            // model.safetensors holds every tensor as torch has it, in the
            // checkpoint's own dtype (issue 25, item 2); with
            // -o hf_dtype=f32, as torch's f32.
            let bf16_source = c.contains("bf16");
            hf_view_holds_the_checkpoint(c, &m, bf16_source);
            if bf16_source {
                drop(m);
                let m = Mounted::new(&dir, &["-o", "hf_dtype=f32"]);
                hf_view_holds_the_checkpoint(c, &m, false);
            }
        }
    }
}

/// `hf/model.safetensors` of mount `m` of checkpoint `c` holds every
/// tensor's bytes: in BF16 (`bf16`: the checkpoint's own, the top halves
/// of torch's f32) or F32; config.json's torch_dtype says which.
fn hf_view_holds_the_checkpoint(c: &str, m: &Mounted, bf16: bool) {
    let view = std::fs::read(m.path("hf/model.safetensors"))
        .unwrap_or_else(|e| panic!("{c} hf/model.safetensors: {e}\n{}", m.log()));
    let len = u64::from_le_bytes(view[..8].try_into().unwrap()) as usize;
    let h =
        rknot::format::safetensors::header::parse(&view[8..8 + len], view.len() as u64).unwrap();
    let config: Value =
        serde_json::from_slice(&std::fs::read(m.path("hf/config.json")).unwrap()).unwrap();
    let dtype = if bf16 { "bfloat16" } else { "float32" };
    assert_eq!(config["torch_dtype"], dtype, "{c}");
    for t in &fixture().reference[c]["tensors"].as_array().unwrap()[..] {
        let hf = t["hf"].as_str().unwrap();
        let mut want = std::fs::read(t["hf_file"].as_str().unwrap()).unwrap();
        if bf16 {
            want = want.chunks(4).flat_map(|b| [b[2], b[3]]).collect();
        }
        let e = h
            .tensors
            .iter()
            .find(|e| e.name == hf)
            .unwrap_or_else(|| panic!("{c}: no {hf}"));
        assert_eq!(
            e.end - e.begin,
            want.len() as u64,
            "{c} hf/ {hf}: {dtype}'s size"
        );
        let at = (h.data_start + e.begin) as usize;
        assert!(
            view[at..at + want.len()] == want[..],
            "{c} hf/ {hf} differs from torch's"
        );
    }
}

needs! { [hf, fuse]
    /// A checkpoint of a known family serves every tensor under its Hugging
    /// Face name too, both spellings, with the rows as the checkpoint
    /// stores them (q_proj/k_proj included, whose GGUF-named files hold
    /// llama.cpp's converter order): .f32 and .bf16 through a mount, and
    /// `rknot cat`. The names are names, not tensors: index.json lists
    /// them per tensor, model.gguf and index.json count each tensor once;
    /// an HF name whose rows are the tensor file's is a hard link of it.
    fn hf_names_serve_the_checkpoints_own_rows() {
        use std::os::unix::fs::MetadataExt;
        for c in ["llama_f32", "llama_bf16_sharded", "qwen2_bf16"] {
            let r = &fixture().reference[c];
            let bf16_source = c.contains("bf16");
            let dir = PathBuf::from(r["dir"].as_str().unwrap());
            let d = dir.to_str().unwrap();
            let m = Mounted::new(&dir, &["--views", "f32,bf16"]);
            let index: Value =
                serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
            let entries = index["tensors"].as_array().unwrap();
            let tensors = r["tensors"].as_array().unwrap();
            let mut permuted = 0;
            for t in tensors {
                let (hf, gguf) = (t["hf"].as_str().unwrap(), t["gguf"].as_str().unwrap());
                let want = std::fs::read(t["hf_file"].as_str().unwrap()).unwrap();
                let converter = std::fs::read(t["gguf_file"].as_str().unwrap()).unwrap();
                let qk = r["family"] == "llama" && (hf.contains(".q_proj.") || hf.contains(".k_proj."));
                if qk {
                    assert!(want != converter, "{c} {hf}: the fixture must permute its rows");
                    permuted += 1;
                }
                for name in [hf.to_string(), underscore(hf)] {
                    let got = std::fs::read(m.path(&format!("{name}.f32")))
                        .unwrap_or_else(|e| panic!("{c} {name}.f32: {e}\n{}", m.log()));
                    assert!(got == want, "{c} {name}.f32 differs from the checkpoint's");
                    if bf16_source {
                        // The checkpoint's own bf16 bytes: the top halves of its f32.
                        let half: Vec<u8> = want.chunks(4).flat_map(|b| [b[2], b[3]]).collect();
                        let got = std::fs::read(m.path(&format!("{name}.bf16"))).unwrap();
                        assert!(got == half, "{c} {name}.bf16 differs from the checkpoint's");
                    }
                }
                let got = std::fs::read(m.path(&format!("{gguf}.f32"))).unwrap();
                assert!(got == converter, "{c} {gguf}.f32 is not in the converter's order");
                let (a, b) = (
                    std::fs::metadata(m.path(&format!("{hf}.f32"))).unwrap(),
                    std::fs::metadata(m.path(&format!("{gguf}.f32"))).unwrap(),
                );
                assert_eq!(a.ino() == b.ino(), !qk, "{c} {hf}: hard link iff same rows");
                assert_eq!((a.nlink(), b.nlink()), if qk { (2, 2) } else { (4, 4) }, "{c} {hf}");
                let o = run_rknot(&["cat", d, hf]);
                assert!(o.status.success(), "{c} cat {hf}: {}", String::from_utf8_lossy(&o.stderr));
                assert!(o.stdout == want, "{c} cat {hf} differs from the checkpoint's");
                let e = entries.iter().find(|e| e["name"] == gguf)
                    .unwrap_or_else(|| panic!("{c}: index.json has no {gguf}"));
                assert_eq!(e["hf_name"], hf, "{c}: {e}");
                assert_eq!(e["hf_rows_permuted"], qk, "{c}: {e}");
                let files = e["hf_files"].to_string();
                assert!(files.contains(&format!("\"{hf}.f32\"")), "{c}: {e}");
            }
            assert_eq!(permuted, if r["family"] == "llama" { 4 } else { 0 }, "{c}");
            // A ranged read inside a permuted file, across rows, through the
            // underscore spelling of `rknot cat` too.
            let q = "model.layers.1.self_attn.q_proj.weight";
            let t = tensors.iter().find(|t| t["hf"] == q).unwrap();
            let want = std::fs::read(t["hf_file"].as_str().unwrap()).unwrap();
            let o = run_rknot(&["cat", d, &underscore(q), "--offset", "250", "--length", "300"]);
            assert!(o.stdout == want[250..550], "{c} cat {q} [250, 550)");
            // Each tensor once: in index.json, in every view (model.gguf
            // needs a tokenizer these checkpoints lack: its count is
            // checked where it is offered), in the listing beside its four
            // names.
            assert_eq!(entries.len(), tensors.len(), "{c}");
            let views = index["views"]["files"].as_array().unwrap();
            let offered: Vec<&Value> = views.iter().filter(|v| v["available"] == true).collect();
            assert!(offered.len() >= 2, "{c}: {views:?}");
            for v in offered {
                assert_eq!(v["tensors"], tensors.len(), "{c}: {v}");
            }
            if let Ok(gguf) = std::fs::read(m.path("model.gguf")) {
                let count = u64::from_le_bytes(gguf[8..16].try_into().unwrap());
                assert_eq!(count as usize, tensors.len(), "{c}: model.gguf's tensor count");
            }
            let names: Vec<String> = std::fs::read_dir(m.path(""))
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n.ends_with(".f32"))
                .collect();
            assert_eq!(names.len(), 4 * tensors.len(), "{c}: {names:?}");
        }
    }
}

needs! { [hf]
    /// The CLI takes a checkpoint: inspect (text and JSON), verify (its
    /// structure), manifest and its check, and the three encoders, whose
    /// outputs verify against the checkpoint they came from.
    fn the_cli_takes_a_checkpoint() {
        let f = fixture();
        let dir = f.dir.join("llama_bf16_sharded");
        let d = dir.to_str().unwrap();
        let ok = |args: &[&str]| {
            let o = run_rknot(args);
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
            String::from_utf8_lossy(&o.stdout).to_string()
        };
        let text = ok(&["inspect", d]);
        assert!(text.contains("safetensors") && text.contains("6 shards"), "{text}");
        assert!(text.contains("blk.0.attn_q.weight"), "{text}");
        let j: Value = serde_json::from_str(&ok(&["inspect", d, "--json"])).unwrap();
        assert_eq!(j["source"]["format"], "safetensors", "{j}");
        ok(&["verify", d]);
        let out = tempfile::tempdir().unwrap();
        // The faithful profile: the calibrated default's target is below
        // what this 64-wide model's 49k-token vocabulary alone takes.
        for (enc, ext, extra) in [
            ("rknot", "rknot", &["--profile", "faithful"][..]),
            ("sk32", "sk32", &[][..]),
            ("knot", "knot", &[][..]),
        ] {
            let o = out.path().join(format!("m.{ext}"));
            let o = o.to_str().unwrap();
            let mut args = vec!["encode", enc, "--no-progress", d, "--out", o];
            args.extend_from_slice(extra);
            ok(&args);
            ok(&["verify", o, "--dense", d]);
        }
        // The dense .knot repack holds the GGUF spelling's values.
        let knot = out.path().join("m.knot");
        let (_, tensors, _) = expected("llama_bf16_sharded");
        for t in &tensors {
            let o = run_rknot(&["cat", knot.to_str().unwrap(), &t.name]);
            assert!(o.stdout == t.bytes, "knot {}: differs", t.name);
        }
        // A manifest of a single-file checkpoint, given as its directory.
        let single = f.dir.join("llama_f32");
        let sums = out.path().join("m.sums");
        ok(&["manifest", single.to_str().unwrap(), "-o", sums.to_str().unwrap()]);
        ok(&["verify", "--manifest", sums.to_str().unwrap(), single.to_str().unwrap()]);
    }
}

/// Serve every file of a checkpoint directory over HTTP at `/NAME`.
fn serve_dir(dir: &Path) -> common::http_server::Server {
    let s = common::http_server::Server::start(Vec::new());
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().to_string();
        s.add(&name, std::fs::read(e.path()).unwrap());
    }
    s
}

needs! { [hf]
    /// A sharded checkpoint over HTTP: the index's URL opens every shard
    /// next to it (each its own object) and config.json; every tensor equals
    /// torch's. A shard missing on the server is refused, named.
    fn a_sharded_checkpoint_over_http() {
        let (dir, tensors, _) = expected("llama_bf16_sharded");
        let s = serve_dir(&dir);
        let url = s.url("model.safetensors.index.json");
        let text = run_rknot(&["inspect", &url]);
        let shown = String::from_utf8_lossy(&text.stdout);
        assert!(shown.contains("6 shards") && shown.contains("arch llama"), "{shown}");
        for t in &tensors {
            let o = run_rknot(&["cat", &url, &t.name]);
            assert!(o.status.success(), "{}: {}", t.name, String::from_utf8_lossy(&o.stderr));
            assert!(o.stdout == t.bytes, "{} over HTTP differs", t.name);
        }
        let lacking = common::http_server::Server::start(Vec::new());
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            if name != "model-00003-of-00006.safetensors" {
                lacking.add(&name, std::fs::read(e.path()).unwrap());
            }
        }
        let o = run_rknot(&["inspect", &lacking.url("model.safetensors.index.json")]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("model-00003-of-00006.safetensors"), "{err}");
    }
}

needs! { [hf, moto]
    /// The same over S3: each shard its own object under one prefix.
    fn a_sharded_checkpoint_over_s3() {
        let (dir, tensors, _) = expected("llama_bf16_sharded");
        let s3 = common::s3::S3::start();
        s3.create_bucket("ckpt");
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            s3.upload(&e.path(), "ckpt", &format!("llama/{name}"));
        }
        let url = "s3://ckpt/llama/model.safetensors.index.json";
        for t in tensors.iter().step_by(3) {
            let o = s3
                .command(common::rknot_bin())
                .args(["cat", url, &t.name])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}: {}", t.name, String::from_utf8_lossy(&o.stderr));
            assert!(o.stdout == t.bytes, "{} over S3 differs", t.name);
        }
    }
}

needs! { [model]
    /// `Architecture::gguf_name` is the exact inverse of `hf_name` on every
    /// tensor of SmolLM2.
    fn gguf_names_invert_hf_names_on_smollm2() {
        let model = common::smollm2().expect("SmolLM2 (tools/fetch-smollm2.sh)");
        let b = open_single(&model, Role::Primary).unwrap();
        let arch = rknot::arch::lookup("llama").unwrap();
        let mut n = 0;
        for t in b.tensors().entries() {
            let (hf, role) = arch
                .hf_name(&t.name.dot)
                .unwrap_or_else(|| panic!("{} has no HF name", t.name.dot));
            assert_eq!(arch.gguf_name(&hf), Some((t.name.dot.clone(), role)), "{hf}");
            n += 1;
        }
        assert!(n > 200, "{n} tensors");
    }
}

// ------------------------------------------- a bf16 checkpoint's own dtype

/// A tiny random llama saved in bf16 by transformers' own classes
/// (`save_pretrained`), with SmolLM2's tokenizer files beside it: argv
/// out_dir.
const MAKE_BF16_LLAMA: &str = r#"
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(25)
cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
# Norms away from 1.0, so that their bytes say something.
with torch.no_grad():
    for n, p in m.named_parameters():
        if "norm" in n:
            p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
m.save_pretrained(sys.argv[1])
print("SAVED")
"#;

/// transformers on MOUNT/hf against the checkpoint itself, both in bf16:
/// the same tensors bit for bit (the view's safetensors bytes through
/// safe_open), `dtype="auto"` loads bf16, the same logits (torch.equal).
/// argv: hf_dir checkpoint_dir.
const CHECK_BF16_HF: &str = r#"
import json, os, sys, torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
hf_dir, ckpt = sys.argv[1:3]
cfg = json.load(open(os.path.join(hf_dir, "config.json")))
assert cfg["torch_dtype"] == "bfloat16", cfg
with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as a, \
     safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as b:
    assert set(a.keys()) == set(b.keys()), set(a.keys()) ^ set(b.keys())
    for k in b.keys():
        x, y = a.get_tensor(k), b.get_tensor(k)
        assert x.dtype == y.dtype == torch.bfloat16, (k, x.dtype, y.dtype)
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), k
auto = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto")
assert all(p.dtype == torch.bfloat16 for p in auto.parameters())
del auto
ours = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    la, lb = ours(ids).logits, theirs(ids).logits
assert la.dtype == torch.bfloat16 and torch.equal(la, lb), (la - lb).abs().max()
print("LOGITS EQUAL", tuple(la.shape))
"#;

/// gguf-py over MOUNT/model.native.gguf of a checkpoint (argv mount_dir):
/// every tensor in its stored ggml type, dequantizing (gguf-py) to the
/// mount's .f32 file of it bit for bit. Prints `NATIVE <tensors> <types>`.
const CHECK_NATIVE: &str = r#"
import os, sys, numpy as np, gguf
mnt = sys.argv[1]
r = gguf.GGUFReader(os.path.join(mnt, "model.native.gguf"))
for t in r.tensors:
    want = np.fromfile(os.path.join(mnt, t.name + ".f32"), dtype=np.float32)
    got = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
print("NATIVE", len(r.tensors), ",".join(sorted({t.tensor_type.name for t in r.tensors})))
"#;

needs! { [hf, model, fuse]
    /// Issue 25, item 2: a bf16 checkpoint's hf/ is bf16 by default, and
    /// transformers loaded from it in bf16 gives the checkpoint's own
    /// logits exactly; model.native.gguf re-frames its stored tensors for
    /// gguf-py (llama's Q/K rows in the converter's order, as the mount's
    /// GGUF-named files), each equal to what the mount serves.
    fn a_bf16_checkpoint_is_served_in_bf16() {
        let py = std::env::var_os("RKNOT_HF_PYTHON").filter(|p| !p.is_empty())
            .expect("RKNOT_HF_PYTHON: a python3 with torch and transformers (tools/hf-env.sh)");
        let work = tempfile::tempdir().unwrap();
        let ckpt = work.path().join("llama-bf16");
        let o = Command::new(&py).args(["-c", MAKE_BF16_LLAMA]).arg(&ckpt).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        {
            let smol = common::smollm2().expect("SmolLM2 (tools/fetch-smollm2.sh)");
            let m = Mounted::new(&smol, &[]);
            for f in ["tokenizer.json", "tokenizer_config.json"] {
                std::fs::copy(m.path("hf").join(f), ckpt.join(f)).unwrap();
            }
        }
        let m = Mounted::new(&ckpt, &[]);
        let index: Value =
            serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
        assert_eq!(index["views"]["main_dtype"], "BF16", "{index}");
        let o = Command::new(&py)
            .args(["-c", CHECK_BF16_HF])
            .arg(m.path("hf"))
            .arg(&ckpt)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && out.contains("LOGITS EQUAL"),
            "{out}\n{}\n{}",
            String::from_utf8_lossy(&o.stderr),
            m.log()
        );
        eprintln!("{out}");
        // The stored tensors re-framed: all BF16 (save_pretrained's bf16
        // model has no other dtype), 2 + 2 x 9 + 1 of them.
        let native = common::python(CHECK_NATIVE, &[&m.path("")]).expect("gguf-py (tools/python-env.sh)");
        assert_eq!(native.trim(), "NATIVE 21 BF16", "{native}");
    }
}
