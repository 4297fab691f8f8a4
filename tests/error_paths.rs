//! Error paths a review found untested: each test feeds one malformed input
//! (built here with the crate's writers, then edited, or by hand) to the
//! public API and checks that it is refused with an `Err`, never a panic,
//! whose `ErrorKind` is the expected one and whose Display names the file
//! (for readers) and the problem.
//!
//! Covered: typed/plain metadata JSON (src/format/meta.rs), the array
//! visitors of src/format/json.rs, non-object table entries in dense .knot
//! and .rknot headers, the .rknot layer cap, GGUF header caps (header size, combined minimum
//! counts) and the metadata memory budget, the writers' refusals, and
//! opening a directory (src/source.rs). Files are edited with the corpus's
//! helpers (tests/common/malformed_corpus.rs).

#[path = "common/malformed_corpus.rs"]
mod corpus;

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rknot::backend::{self, Role};
use rknot::format::gguf::{
    MAX_ARRAY_DEPTH, MAX_HEADER_BYTES, MAX_KEY_BYTES, MAX_STRING_BYTES, encode_header, write_gguf,
};
use rknot::format::knot::{KnotTensorOut, write_knot, write_knot_with};
use rknot::format::meta::meta_budget_limit;
use rknot::format::meta::{MetaType, MetaValue, Metadata};
use rknot::format::rknot::{
    ArchMeta, Coding, LayerOut, MAX_LAYERS, Manifest, TensorSpec, write_rknot,
};
use rknot::format::sk32::{Sketch, write_sk32};
use rknot::quant::GgmlType;
use rknot::{Error, ErrorKind};
use serde_json::{Value, json};
use tempfile::TempDir;

use corpus::G;

// ------------------------------------------------------------------ helpers

/// A fresh directory holding `name` with `bytes`.
fn file_with(name: &str, bytes: &[u8]) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("write test file");
    (dir, path)
}

/// Open `path` as a single backend; it must fail.
fn open_err(path: &Path) -> Error {
    match backend::open_single(path, Role::Fallback) {
        Ok(_) => panic!("{} opened without error", path.display()),
        Err(e) => e,
    }
}

/// The error has `kind`, names `path` (as its file and in its Display) and
/// its Display contains every one of `wants`.
#[track_caller]
fn check(e: &Error, path: &Path, kind: ErrorKind, wants: &[&str]) {
    let shown = e.to_string();
    assert_eq!(e.kind(), kind, "wrong kind: {shown}");
    assert_eq!(e.file(), Some(path), "wrong file: {shown}");
    assert!(
        shown.contains(&path.display().to_string()),
        "Display does not name the file: {shown}"
    );
    for want in wants {
        assert!(shown.contains(want), "Display lacks {want:?}: {shown}");
    }
}

/// A writer's error (no file involved): `kind`, and every one of `wants` in
/// the Display.
#[track_caller]
fn check_writer(e: &Error, kind: ErrorKind, wants: &[&str]) {
    let shown = e.to_string();
    assert_eq!(e.kind(), kind, "wrong kind: {shown}");
    for want in wants {
        assert!(shown.contains(want), "Display lacks {want:?}: {shown}");
    }
}

// ------------------------------------------------------------- dense .knot

fn f32_bytes(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (i as f32 * 0.25).to_le_bytes())
        .collect()
}

/// A valid dense .knot (written by `write_knot`): one f32 tensor
/// `output_norm_weight` [16] and one metadata key.
fn knot_base() -> Vec<u8> {
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    let data = f32_bytes(16);
    let mut v = Vec::new();
    write_knot(
        &mut v,
        &md,
        &[KnotTensorOut {
            name: "output_norm.weight",
            ty: GgmlType::F32,
            shape: &[16],
            data: &data,
        }],
    )
    .expect("write valid dense .knot");
    v
}

/// A dense .knot as the base, with its meta JSON edited by `f` (rewritten
/// with the crate's container header writer, so padding and codec byte stay
/// right).
fn knot_edited(f: impl FnOnce(&mut Value)) -> Vec<u8> {
    let (mut meta, payload) = corpus::knot_split(&knot_base()).expect("valid dense .knot");
    f(&mut meta);
    corpus::knot_join(&meta, &payload)
}

/// Open a dense .knot whose metadata carries `"test.key": value`; it must
/// fail with a BadJson error naming the file, the key and `wants`.
#[track_caller]
fn knot_metadata_fails(value: Value, wants: &[&str]) {
    let bytes = knot_edited(|m| m["metadata"]["test.key"] = value);
    let (_dir, path) = file_with("meta.knot", &bytes);
    let e = open_err(&path);
    let mut all = vec!["metadata key \"test.key\""];
    all.extend_from_slice(wants);
    check(&e, &path, ErrorKind::BadJson, &all);
}

// ------------------------------------------------------------------- .rknot

/// A valid .rknot (written by `write_rknot`): layer 0, manifest d 4 with
/// standing [0, 2], tensor `blk.0.attn_q.weight` [4, 4] with restricted
/// columns, uniform 8 bits, blocks of [2, 2] (2 blocks).
fn rknot_parts() -> (ArchMeta, Vec<LayerOut>) {
    let manifest = Manifest {
        d: 4,
        standing_indices: vec![0, 2],
        amplitudes: vec![1.0, 0.5],
        phase_alignment: vec![1.0, 0.75],
    };
    let spec = TensorSpec {
        name: "blk.0.attn_q.weight".into(),
        d_out: 4,
        d_in: 4,
        restrict_rows: false,
        restrict_cols: true,
        coding: Coding::Uniform { bits: 8 },
        block_rows: 2,
        block_cols: 2,
    };
    let dense: Vec<f32> = (0..16).map(|i| i as f32 / 16.0 - 0.5).collect();
    common::one_tensor_rknot_parts(&manifest, spec, &dense)
}

fn rknot_base() -> Vec<u8> {
    let (arch, layers) = rknot_parts();
    let mut v = Vec::new();
    write_rknot(&mut v, &arch, &layers).expect("write valid .rknot");
    v
}

/// The base .rknot (version 3) with its header JSON edited by `f`.
fn rknot_edited(f: impl FnOnce(&mut Value)) -> Vec<u8> {
    let (mut h, body, index) = corpus::rknot3_split(&rknot_base()).expect("valid .rknot");
    f(&mut h);
    corpus::rknot3_join(&h, &body, &index)
}

// --------------------------------------------------------------------- GGUF

/// GGUF bytes built by hand: magic, version 3 and the two counts.
fn gguf_prefix(tensor_count: u64, kv_count: u64) -> G {
    let mut g = G::default();
    g.bytes(b"GGUF").u32(3).u64(tensor_count).u64(kv_count);
    g
}

/// Write `bytes` at the start of `name` and extend the file (sparsely, with
/// zeros) to `len` bytes: a large file that costs no disk or time.
fn sparse_file(name: &str, bytes: &[u8], len: u64) -> (TempDir, PathBuf) {
    let (dir, path) = file_with(name, bytes);
    let f = File::options().write(true).open(&path).expect("reopen");
    f.set_len(len).expect("set_len");
    (dir, path)
}

// ============================================================ sanity: bases

#[test]
fn unedited_base_files_open_cleanly() {
    // The cases below break exactly one thing in these files.
    for (name, bytes) in [
        ("base.knot", knot_base()),
        ("edited.knot", knot_edited(|_| {})),
        ("base.rknot", rknot_base()),
        ("edited.rknot", rknot_edited(|_| {})),
    ] {
        let (_dir, path) = file_with(name, &bytes);
        if let Err(e) = backend::open_single(&path, Role::Primary) {
            panic!("{name} must open: {e}");
        }
    }
}

// ========================================== 1. metadata JSON (meta.rs)

#[test]
fn metadata_typed_object_without_string_type_is_bad_json() {
    let want = "metadata object without a string \"type\"";
    knot_metadata_fails(json!({"value": 1}), &[want]);
    knot_metadata_fails(json!({"type": 4, "value": 1}), &[want]);
}

#[test]
fn metadata_typed_object_without_value_is_bad_json() {
    knot_metadata_fails(json!({"type": "u32"}), &["metadata u32 without \"value\""]);
}

#[test]
fn metadata_array_value_that_is_not_a_json_array_is_bad_json() {
    let want = "metadata array \"value\" is not a JSON array";
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "u32", "value": 5}),
        &[want],
    );
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "string", "value": {"a": "b"}}),
        &[want],
    );
}

#[test]
fn metadata_nested_array_element_that_is_not_an_object_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "array", "value": [[1, 2]]}),
        &["nested array element is not an object"],
    );
}

#[test]
fn metadata_nested_array_element_that_is_not_an_array_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "array", "value": [{"type": "u32", "value": 1}]}),
        &["nested array element is not an array"],
    );
}

#[test]
fn metadata_integer_type_with_a_non_integer_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "u32", "value": 1.5}),
        &["metadata u32 value 1.5 is not an integer"],
    );
    knot_metadata_fails(
        json!({"type": "i64", "value": "12"}),
        &["metadata i64 value \"12\" is not an integer"],
    );
    // An element of a typed array goes through the same check.
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "i16", "value": [1, 2.5]}),
        &["metadata i16 value 2.5 is not an integer"],
    );
}

#[test]
fn metadata_float_string_other_than_nan_inf_is_unreadable() {
    knot_metadata_fails(
        json!({"type": "f32", "value": "nanx"}),
        &["metadata float \"nanx\" unreadable"],
    );
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "f64", "value": [1.0, "Infinity"]}),
        &["metadata float \"Infinity\" unreadable"],
    );
}

#[test]
fn metadata_float_type_with_a_non_number_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "f64", "value": true}),
        &["metadata f64 value true is not a number"],
    );
    knot_metadata_fails(
        json!({"type": "f32", "value": [1.0]}),
        // Arrays are not built to be printed.
        &["metadata f32 value [...] is not a number"],
    );
}

#[test]
fn metadata_bool_type_with_a_non_bool_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "bool", "value": 1}),
        &["metadata bool value 1 is not a bool"],
    );
}

#[test]
fn metadata_string_type_with_a_non_string_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "string", "value": 5}),
        &["metadata string value 5 is not a string"],
    );
}

#[test]
fn metadata_plain_array_with_mixed_element_types_is_bad_json() {
    knot_metadata_fails(
        json!([1, "a"]),
        &["plain metadata array with mixed element types"],
    );
    knot_metadata_fails(
        json!([true, 1]),
        &["plain metadata array with mixed element types"],
    );
}

#[test]
fn metadata_object_inside_a_plain_array_is_bad_json() {
    knot_metadata_fails(
        json!([{"type": "u32", "value": 1}]),
        &["unexpected object in metadata"],
    );
}

#[test]
fn metadata_unknown_type_or_elem_type_is_bad_json() {
    knot_metadata_fails(
        json!({"type": "u128", "value": 1}),
        &["unknown metadata type \"u128\""],
    );
    let want = "metadata array without a known \"elem_type\"";
    knot_metadata_fails(json!({"type": "array", "value": [1]}), &[want]);
    knot_metadata_fails(
        json!({"type": "array", "elem_type": "u128", "value": [1]}),
        &[want],
    );
    // The same when the value comes first (it is kept until the end of the
    // object).
    knot_metadata_fails(json!({"value": [1], "type": "array"}), &[want]);
}

#[test]
fn metadata_value_before_its_type_is_checked_against_the_type() {
    knot_metadata_fails(
        json!({"value": "x", "type": "u32"}),
        &["metadata u32 value \"x\" is not an integer"],
    );
    knot_metadata_fails(
        json!({"value": [1, 300], "elem_type": "u8", "type": "array"}),
        &["metadata u8 value 300 out of range"],
    );
}

#[test]
fn metadata_null_is_bad_json() {
    knot_metadata_fails(json!(null), &["metadata value is null"]);
    knot_metadata_fails(json!([1, null]), &["metadata value is null"]);
}

#[test]
fn metadata_typed_object_with_a_member_twice_is_bad_json() {
    // A `Value` cannot hold a key twice: the meta JSON text is edited.
    let (mut meta, payload) = corpus::knot_split(&knot_base()).expect("valid dense .knot");
    meta["metadata"]["test.key"] = json!({"type": "u32", "value": 1, "again": "u8"});
    let text = serde_json::to_string(&meta)
        .expect("meta JSON")
        .replace("\"again\"", "\"type\"");
    let (_dir, path) = file_with("twice.knot", &corpus::knot_raw(text.as_bytes(), &payload));
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::BadJson,
        &[
            "metadata key \"test.key\"",
            "metadata object has \"type\" twice",
        ],
    );
}

#[test]
fn rknot_arch_metadata_with_a_bad_typed_value_names_the_file_and_key() {
    let bytes = rknot_edited(|h| {
        h["arch_meta"]["metadata"]["test.key"] = json!({"type": "string", "value": 5});
    });
    let (_dir, path) = file_with("meta.rknot", &bytes);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::BadJson,
        &[
            "metadata key \"test.key\"",
            "metadata string value 5 is not a string",
        ],
    );
}

// ======================================== 2. JSON array fields (json.rs)

#[test]
fn knot_tensor_shape_with_a_non_integer_element_is_bad_json() {
    for bad in [json!(["a"]), json!([-1]), json!([16.0])] {
        let found = if bad[0].is_string() {
            "found a string"
        } else {
            "found a number"
        };
        let bytes = knot_edited(|m| m["tensors"]["output_norm_weight"]["shape"] = bad.clone());
        let (_dir, path) = file_with("shape.knot", &bytes);
        let e = open_err(&path);
        check(
            &e,
            &path,
            ErrorKind::BadJson,
            &[
                "field \"shape\" must be an array of non-negative integers",
                found,
            ],
        );
        assert_eq!(e.tensor_name(), Some("output_norm_weight"), "{e}");
    }
}

#[test]
fn rknot_standing_indices_with_a_non_integer_element_is_bad_json() {
    for bad in [json!([0, 1.5]), json!([0, "2"])] {
        let bytes = rknot_edited(|h| h["layers"][0]["manifest"]["standing_indices"] = bad.clone());
        let (_dir, path) = file_with("standing.rknot", &bytes);
        let e = open_err(&path);
        check(
            &e,
            &path,
            ErrorKind::BadJson,
            &[
                "layer 0 manifest",
                "field \"standing_indices\" must be an array of non-negative integers",
            ],
        );
    }
}

#[test]
fn rknot_amplitudes_with_a_non_number_element_is_bad_json() {
    for (bad, found) in [
        (json!([1.0, "x"]), "found a string"),
        (json!([1.0, null]), "found null"),
    ] {
        let bytes = rknot_edited(|h| h["layers"][0]["manifest"]["amplitudes"] = bad.clone());
        let (_dir, path) = file_with("amplitudes.rknot", &bytes);
        let e = open_err(&path);
        check(
            &e,
            &path,
            ErrorKind::BadJson,
            &[
                "layer 0 manifest",
                "field \"amplitudes\" must be an array of numbers",
                found,
            ],
        );
    }
}

// ============================== 3. table entries that are not JSON objects

#[test]
fn knot_tensor_entry_that_is_not_an_object_is_bad_json() {
    let bytes = knot_edited(|m| m["tensors"]["output_norm_weight"] = json!([16]));
    let (_dir, path) = file_with("entry.knot", &bytes);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::BadJson,
        &["tensor \"output_norm_weight\" must be a JSON object, found an array"],
    );
}

#[test]
fn rknot_layer_that_is_not_an_object_is_bad_json() {
    let bytes = rknot_edited(|h| h["layers"][0] = json!(7));
    let (_dir, path) = file_with("layer.rknot", &bytes);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::BadJson,
        &["layers[0] must be a JSON object, found a number"],
    );
}

#[test]
fn rknot_tensor_entry_that_is_not_an_object_is_bad_json() {
    let bytes = rknot_edited(|h| h["layers"][0]["tensors"][0] = json!("blk.0.attn_q.weight"));
    let (_dir, path) = file_with("tensor.rknot", &bytes);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::BadJson,
        &["tensor must be a JSON object, found a string"],
    );
    assert_eq!(e.tensor_name(), Some("<unnamed>"), "{e}");
}

#[test]
fn rknot_more_layers_than_the_cap_is_too_large() {
    let bytes = rknot_edited(|h| {
        let layers = h["layers"].as_array_mut().expect("layers");
        layers.resize(MAX_LAYERS as usize + 1, json!({}));
    });
    let (_dir, path) = file_with("layers.rknot", &bytes);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::TooLarge,
        &[&format!("header: more than {MAX_LAYERS} layers (the cap)")],
    );
    // Refused while parsing, where the parser stopped: past the first
    // layers, inside the header.
    let at = e.offset().expect("an offset");
    assert!((10 + 65_536..10 + bytes.len() as u64).contains(&at), "{e}");
}

// ============================================== 4. GGUF header size caps

/// The header cap is reached by reading: two 40 MiB string values, the
/// first read (from a sparse file; ~40 MiB of memory for a moment), the
/// second's bytes would end past the 64 MiB cap.
#[test]
fn gguf_header_past_the_size_cap_is_too_large() {
    let n = 40u64 << 20;
    assert!(n <= MAX_STRING_BYTES);
    let mut layout = Vec::new();
    let prefix = gguf_prefix(0, 2).out;
    layout.push((0u64, prefix.clone()));
    let mut pos = prefix.len() as u64;
    for i in 0..2 {
        let mut kv = G::default();
        kv.str(&format!("k{i}")).u32(MetaType::String.id()).u64(n);
        layout.push((pos, kv.out.clone()));
        pos += kv.out.len() as u64;
        if i < 1 {
            pos += n;
        }
    }
    // The second string's bytes start at `pos`: inside the file, past the cap.
    assert!(pos + n > MAX_HEADER_BYTES && pos <= MAX_HEADER_BYTES);
    let (_dir, path) = sparse_file("cap.gguf", &[], pos + n + 64);
    let f = File::options().write(true).open(&path).expect("reopen");
    for (at, bytes) in &layout {
        f.write_all_at(bytes, *at).expect("write header piece");
    }
    drop(f);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::TooLarge,
        &[
            "value of metadata key \"k1\"",
            &format!("would extend past {MAX_HEADER_BYTES} bytes"),
        ],
    );
    assert_eq!(e.offset(), Some(pos), "{e}");
}

#[test]
fn gguf_tensor_and_kv_counts_that_only_together_exceed_the_file_are_truncated() {
    // 3 * 32 = 96 and 7 * 13 = 91 bytes each fit in the 100 left; 187 do not.
    let mut bytes = gguf_prefix(3, 7).out;
    bytes.resize(bytes.len() + 100, 0);
    let (_dir, path) = file_with("counts.gguf", &bytes);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::Truncated,
        &[
            "3 tensor infos plus 7 kv pairs (minimum bytes)",
            "187 declared",
            "only 100 bytes are left in the file",
        ],
    );
    assert_eq!(e.offset(), Some(16), "{e}");
}

#[test]
fn gguf_tensor_and_kv_counts_that_only_together_exceed_the_header_cap_are_too_large() {
    // 65,536 tensor infos (2 MiB) and 5.1M kv pairs (63.2 MiB) each fit
    // under the 64 MiB cap and in the (sparse) file; together they do not.
    let (tc, kc) = (65_536u64, 5_100_000u64);
    assert!(kc * 13 + 24 <= MAX_HEADER_BYTES && tc * 32 + kc * 13 > MAX_HEADER_BYTES);
    let prefix = gguf_prefix(tc, kc).out;
    let (_dir, path) = sparse_file("counts.gguf", &prefix, 24 + 70_000_000);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::TooLarge,
        &[
            &format!("{tc} tensor infos plus {kc} kv pairs (minimum bytes)"),
            &format!("{MAX_HEADER_BYTES}-byte header cap"),
        ],
    );
    assert_eq!(e.offset(), Some(16), "{e}");
}

/// A u8 array of `count` elements under `key`, with the file long enough
/// (sparse) to hold the elements.
fn gguf_u8_arrays(arrays: &[(&str, u64)]) -> (TempDir, PathBuf) {
    let mut g = gguf_prefix(0, arrays.len() as u64);
    let mut total = 0;
    for (i, &(key, count)) in arrays.iter().enumerate() {
        g.str(key)
            .u32(MetaType::Array.id())
            .u32(MetaType::U8.id())
            .u64(count);
        if i + 1 < arrays.len() {
            // Earlier arrays are read: give them their bytes.
            g.out.resize(g.out.len() + count as usize, 7);
        } else {
            total = g.out.len() as u64 + count;
        }
    }
    sparse_file("arrays.gguf", &g.out, total + 64)
}

/// Offset of the count field of the last array `gguf_u8_arrays` writes.
fn last_count_at(arrays: &[(&str, u64)]) -> u64 {
    let mut at = 24u64;
    for (i, &(key, count)) in arrays.iter().enumerate() {
        at += 8 + key.len() as u64 + 4 + 4;
        if i + 1 < arrays.len() {
            at += 8 + count;
        }
    }
    at
}

#[test]
fn gguf_array_over_the_metadata_budget_is_too_large() {
    // 2M u8 elements take 64 MB parsed (32 bytes each), more than 2 x the
    // ~2 MB header they would make + 32 MiB: refused at the count, before
    // anything is read or allocated.
    let count = 2_000_000u64;
    let arrays = [("big", count)];
    let (_dir, path) = gguf_u8_arrays(&arrays);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::TooLarge,
        &[
            "metadata key \"big\"",
            &format!("array of {count} u8 elements"),
            "the parsed metadata would take more than",
            "2 x header + 32 MiB",
        ],
    );
    assert_eq!(e.offset(), Some(last_count_at(&arrays)), "{e}");
}

#[test]
fn gguf_arrays_together_over_the_metadata_budget_are_too_large() {
    // Alone, 400k u8 elements (12.8 MB parsed) fit the budget; after 800k
    // (25.6 MB) they take the total past 2 x 1.2 MB + 32 MiB.
    let arrays = [("small", 800_000u64), ("big", 400_000)];
    let limit = meta_budget_limit(1_200_000 + 64);
    assert!(1_200_000 * 32 > limit && 400_000 * 32 < meta_budget_limit(0));
    let (_dir, path) = gguf_u8_arrays(&arrays);
    let e = open_err(&path);
    check(
        &e,
        &path,
        ErrorKind::TooLarge,
        &[
            "metadata key \"big\"",
            "array of 400000 u8 elements",
            "the parsed metadata would take more than",
        ],
    );
    assert_eq!(e.offset(), Some(last_count_at(&arrays)), "{e}");
    let (_dir, path) = gguf_u8_arrays(&[("big", 400_000)]);
    backend::open_single(&path, Role::Fallback).expect("400k u8 elements alone fit");
}

// ================================================================ 5. writers

fn gguf_writer_err(md: &Metadata, tensors: &[(String, Vec<u64>, GgmlType, &[u8])]) -> Error {
    let mut out = Vec::new();
    let e = match write_gguf(&mut out, md, tensors, 32) {
        Ok(()) => panic!("write_gguf accepted the input"),
        Err(e) => e,
    };
    assert!(out.is_empty(), "write_gguf wrote {} bytes", out.len());
    e
}

#[test]
fn gguf_writer_refuses_a_key_over_the_cap() {
    let mut md = Metadata::default();
    md.push("k".repeat(MAX_KEY_BYTES as usize + 1), MetaValue::U32(1));
    let e = gguf_writer_err(&md, &[]);
    check_writer(
        &e,
        ErrorKind::TooLarge,
        &[&format!(
            "metadata key: string of {} bytes exceeds the cap of {MAX_KEY_BYTES}",
            MAX_KEY_BYTES + 1
        )],
    );
}

#[test]
fn gguf_writer_refuses_a_string_value_over_the_cap() {
    // 64 MiB + 1 bytes: allocated once, refused before it is copied.
    let mut md = Metadata::default();
    md.push(
        "big",
        MetaValue::String("x".repeat(MAX_STRING_BYTES as usize + 1)),
    );
    let e = gguf_writer_err(&md, &[]);
    check_writer(
        &e,
        ErrorKind::TooLarge,
        &[
            "metadata key \"big\"",
            &format!(
                "string of {} bytes exceeds the cap of {MAX_STRING_BYTES}",
                MAX_STRING_BYTES + 1
            ),
        ],
    );
}

#[test]
fn gguf_writer_refuses_arrays_nested_too_deep() {
    let nest = |depth: usize| {
        let mut v = MetaValue::Array {
            elem: MetaType::U8,
            values: vec![MetaValue::U8(7)],
        };
        for _ in 1..depth {
            v = MetaValue::Array {
                elem: MetaType::Array,
                values: vec![v],
            };
        }
        v
    };
    // MAX_ARRAY_DEPTH levels are fine; one more is refused.
    let mut md = Metadata::default();
    md.push("deep", nest(MAX_ARRAY_DEPTH));
    let mut out = Vec::new();
    if let Err(e) = write_gguf(&mut out, &md, &[], 32) {
        panic!("{MAX_ARRAY_DEPTH} levels must be accepted: {e}");
    }
    let mut md = Metadata::default();
    md.push("deep", nest(MAX_ARRAY_DEPTH + 1));
    let e = gguf_writer_err(&md, &[]);
    check_writer(
        &e,
        ErrorKind::TooLarge,
        &[
            "metadata key \"deep\"",
            &format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
        ],
    );
}

#[test]
fn gguf_writer_refuses_an_element_count_over_i64_max() {
    // 2^32 * 2^31 = 2^63 elements: fits u64, not ggml's int64. No data is
    // needed: the shape is refused before any length check.
    let dims = vec![1u64 << 32, 1 << 31];
    let e = gguf_writer_err(
        &Metadata::default(),
        &[("huge.weight".into(), dims.clone(), GgmlType::F32, &[])],
    );
    check_writer(
        &e,
        ErrorKind::Overflow,
        &["element count 9223372036854775808", "ggml's int64"],
    );
    assert_eq!(e.tensor_name(), Some("huge.weight"), "{e}");
    // encode_header alone refuses it the same way.
    let e = match encode_header(
        &Metadata::default(),
        &[("huge.weight".into(), dims, GgmlType::F32)],
        32,
    ) {
        Ok(_) => panic!("encode_header accepted 2^63 elements"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Overflow, "{e}");
}

#[test]
fn write_knot_refuses_data_of_the_wrong_length() {
    let data = f32_bytes(15);
    let mut out = Vec::new();
    let e = write_knot(
        &mut out,
        &Metadata::default(),
        &[KnotTensorOut {
            name: "output_norm.weight",
            ty: GgmlType::F32,
            shape: &[16],
            data: &data,
        }],
    )
    .unwrap_err();
    check_writer(
        &e,
        ErrorKind::LengthMismatch,
        &["output_norm.weight", "60 bytes of data for F32 [16]"],
    );
}

fn write_knot_with_err(tensors: &[(&str, GgmlType, &[u64])]) -> Error {
    let mut out = Vec::new();
    match write_knot_with(&mut out, &Metadata::default(), tensors, |_, _| Ok(())) {
        Ok(()) => panic!("write_knot_with accepted {tensors:?}"),
        Err(e) => e,
    }
}

#[test]
fn write_knot_with_refuses_a_type_dense_knot_cannot_store() {
    let e = write_knot_with_err(&[("blk.0.attn_q.weight", GgmlType::Q8K, &[256])]);
    check_writer(
        &e,
        ErrorKind::UnsupportedType,
        &["cannot be stored in a dense .knot"],
    );
    assert_eq!(e.tensor_name(), Some("blk_0_attn_q_weight"), "{e}");
}

#[test]
fn write_knot_with_refuses_two_spellings_of_one_name() {
    let e = write_knot_with_err(&[
        ("blk.0.attn_q.weight", GgmlType::F32, &[4]),
        ("blk_0_attn_q_weight", GgmlType::F32, &[4]),
    ]);
    check_writer(&e, ErrorKind::BadName, &["duplicate tensor name"]);
    assert_eq!(e.tensor_name(), Some("blk_0_attn_q_weight"), "{e}");
}

#[test]
fn write_sk32_refuses_factors_that_disagree_with_the_shape() {
    let u = vec![0.5f32; 4 * 2];
    let vt = vec![0.25f32; 2 * 3];
    let good = Sketch::quantize("blk.0.attn_q.weight", 4, 3, &u, &[2.0, 1.0], &vt);
    let mut short_u = good.clone();
    short_u.u_q8.pop();
    let mut long_sigma = good.clone();
    long_sigma.sigma_q8.push(9);
    let mut short_v = good;
    short_v.v_q8.pop();
    for bad in [short_u, long_sigma, short_v] {
        let mut out = Vec::new();
        let e = write_sk32(&mut out, "test", &[bad]).unwrap_err();
        check_writer(
            &e,
            ErrorKind::LengthMismatch,
            &["sketch factor lengths disagree with d_out/d_in/rank"],
        );
        assert_eq!(e.tensor_name(), Some("blk.0.attn_q.weight"), "{e}");
    }
}

#[test]
fn write_rknot_refuses_a_block_count_that_disagrees_with_the_grid() {
    let (arch, mut layers) = rknot_parts();
    layers[0].tensors[0].1.pop();
    let mut out = Vec::new();
    let e = write_rknot(&mut out, &arch, &layers).unwrap_err();
    check_writer(&e, ErrorKind::BadValue, &["1 blocks for a grid of 2"]);
    assert_eq!(e.tensor_name(), Some("blk.0.attn_q.weight"), "{e}");
    // One block too many.
    let (arch, mut layers) = rknot_parts();
    let extra = layers[0].tensors[0].1[0].clone();
    layers[0].tensors[0].1.push(extra);
    let e = write_rknot(&mut Vec::new(), &arch, &layers).unwrap_err();
    check_writer(&e, ErrorKind::BadValue, &["3 blocks for a grid of 2"]);
}

// ============================================================ 6. source.rs

#[test]
fn opening_a_directory_is_an_io_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let e = open_err(dir.path());
    check(
        &e,
        dir.path(),
        ErrorKind::Io,
        &["is a directory, not a model file"],
    );
    // Also as the dense fallback of a valid primary.
    let (_keep, primary) = file_with("m.rknot", &rknot_base());
    let e = match backend::open(&primary, Some(dir.path())) {
        Ok(_) => panic!("a directory was accepted as the fallback"),
        Err(e) => e,
    };
    check(
        &e,
        dir.path(),
        ErrorKind::Io,
        &["is a directory, not a model file"],
    );
}
