//! Bit-exact check of the dequantization kernels against the committed
//! vectors in tests/data/ggml (written by tools/gen_ggml_vectors.py from
//! gguf-py's `gguf.quants.dequantize`).

mod common;

use std::path::{Path, PathBuf};

use common::sha256_hex;
use rknot::quant::{self, DECODABLE, GgmlType};
use serde_json::Value;

struct Vector {
    name: String,
    ty: GgmlType,
    n_elements: usize,
    bin: Vec<u8>,
    /// Expected output, as f32 bit patterns.
    want: Vec<u32>,
}

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/ggml")
}

fn field<'a>(entry: &'a Value, key: &str) -> &'a Value {
    entry
        .get(key)
        .unwrap_or_else(|| panic!("manifest entry {entry} lacks {key:?}"))
}

fn text<'a>(entry: &'a Value, key: &str) -> &'a str {
    field(entry, key)
        .as_str()
        .unwrap_or_else(|| panic!("{key:?} of {entry} is not a string"))
}

fn read_checked(name: &str, ext: &str, sha256: &str) -> Vec<u8> {
    let path = data_dir().join(format!("{name}.{ext}"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert_eq!(
        sha256_hex(&bytes),
        sha256,
        "sha256 of {} differs from the manifest",
        path.display()
    );
    bytes
}

/// Every vector of the manifest, with both files read and their sha256
/// checked.
fn load() -> Vec<Vector> {
    let path = data_dir().join("manifest.json");
    let json = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let manifest: Value = serde_json::from_str(&json).expect("manifest.json is valid JSON");
    let entries = field(&manifest, "vectors")
        .as_array()
        .expect("\"vectors\" is a list");
    assert!(!entries.is_empty());
    entries
        .iter()
        .map(|e| {
            let name = text(e, "name").to_string();
            let ty_name = text(e, "type");
            let ty = GgmlType::from_name(ty_name)
                .unwrap_or_else(|| panic!("{name}: unknown type {ty_name:?}"));
            let n_elements = field(e, "n_elements")
                .as_u64()
                .expect("n_elements is an integer") as usize;
            assert!(!text(e, "source").is_empty(), "{name}: empty source");
            let bin = read_checked(&name, "bin", text(e, "bin_sha256"));
            let f32 = read_checked(&name, "f32", text(e, "f32_sha256"));
            assert_eq!(f32.len(), n_elements * 4, "{name}: .f32 size");
            assert_eq!(
                ty.bytes_for(n_elements as u64),
                Some(bin.len() as u64),
                "{name}: .bin size for {n_elements} {ty} elements"
            );
            let want = f32
                .as_chunks::<4>()
                .0
                .iter()
                .map(|b| u32::from_le_bytes(*b))
                .collect();
            Vector {
                name,
                ty,
                n_elements,
                bin,
                want,
            }
        })
        .collect()
}

fn assert_same_bits(name: &str, got: &[f32], want: &[u32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i])
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{name}: {} of {} elements differ; first at {i}: got {:#010x} ({}), want {:#010x} ({})",
            bad.len(),
            got.len(),
            got[i].to_bits(),
            got[i],
            want[i],
            f32::from_bits(want[i]),
        );
    }
}

#[test]
fn vectors_decode_bit_exact() {
    for v in load() {
        let mut out = vec![0f32; v.n_elements];
        quant::dequantize(v.ty, &v.bin, &mut out)
            .unwrap_or_else(|e| panic!("{}: dequantize failed: {e}", v.name));
        assert_same_bits(&v.name, &out, &v.want);
    }
}

#[test]
fn block_at_a_time_matches_whole() {
    for v in load() {
        let be = v.ty.block_elems() as usize;
        let bb = v.ty.block_bytes() as usize;
        let mut out = vec![0f32; v.n_elements];
        for (src, y) in v.bin.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
            quant::dequantize(v.ty, src, y)
                .unwrap_or_else(|e| panic!("{}: dequantize of one block failed: {e}", v.name));
        }
        assert_same_bits(&format!("{} (block by block)", v.name), &out, &v.want);
    }
}

#[test]
fn every_decodable_type_has_a_vector() {
    let vectors = load();
    for ty in DECODABLE {
        assert!(
            vectors.iter().any(|v| v.ty == *ty),
            "no test vector for decodable type {ty}"
        );
    }
}
