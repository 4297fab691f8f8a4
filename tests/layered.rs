//! Layered backend rules on small synthetic files (no model needed), and
//! concurrent reads from many threads.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rknot::backend::{self, Availability, Backend, Role};
use rknot::format::gguf::write_gguf;
use rknot::format::meta::{MetaValue, Metadata};
use rknot::format::rknot::{Coding, Manifest, TensorSpec};
use rknot::format::sk32::{Sketch, write_sk32};
use rknot::quant::GgmlType;
use rknot::{ErrorKind, backend::StoredType};

const HIDDEN: u64 = 64;
const VOCAB: u64 = 96;

fn f32_bytes(n: u64, seed: u32) -> Vec<u8> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
        .flat_map(f32::to_le_bytes)
        .collect()
}

/// A tiny llama-shaped GGUF: token_embd, output, one layer (q, output, norm).
fn tiny_gguf(dir: &Path) -> PathBuf {
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    md.push("llama.block_count", MetaValue::U32(1));
    md.push("llama.embedding_length", MetaValue::U32(HIDDEN as u32));
    let tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> = vec![
        (
            "token_embd.weight".into(),
            vec![HIDDEN, VOCAB],
            GgmlType::F32,
            f32_bytes(HIDDEN * VOCAB, 1),
        ),
        (
            "blk.0.attn_q.weight".into(),
            vec![HIDDEN, HIDDEN],
            GgmlType::F32,
            f32_bytes(HIDDEN * HIDDEN, 2),
        ),
        (
            "blk.0.attn_output.weight".into(),
            vec![HIDDEN, HIDDEN],
            GgmlType::F32,
            f32_bytes(HIDDEN * HIDDEN, 3),
        ),
        (
            "blk.0.attn_norm.weight".into(),
            vec![HIDDEN],
            GgmlType::F32,
            f32_bytes(HIDDEN, 4),
        ),
        (
            "output.weight".into(),
            vec![HIDDEN, VOCAB],
            GgmlType::F32,
            f32_bytes(HIDDEN * VOCAB, 5),
        ),
    ];
    let refs: Vec<(String, Vec<u64>, GgmlType, &[u8])> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.clone(), d.clone(), *t, b.as_slice()))
        .collect();
    let p = dir.join("tiny.gguf");
    let mut f = std::fs::File::create(&p).unwrap();
    write_gguf(&mut f, &md, &refs, 32).unwrap();
    p
}

fn sketch(name: &str, d_out: u64, d_in: u64, rank: u64) -> Sketch {
    let n = |len: u64, k: u64| (0..len).map(|i| ((i * 31 + k) % 251) as u8 + 1).collect();
    Sketch {
        name: name.into(),
        d_out,
        d_in,
        rank,
        u_max: 0.5,
        sigma_max: 2.0,
        v_max: 0.25,
        u_q8: n(d_out * rank, 1),
        sigma_q8: n(rank, 2),
        v_q8: n(rank * d_in, 3),
    }
}

fn write_sketches(dir: &Path, sketches: &[Sketch]) -> PathBuf {
    let p = dir.join("s.sk32");
    let mut b = Vec::new();
    write_sk32(&mut b, "test", sketches).unwrap();
    std::fs::write(&p, b).unwrap();
    p
}

fn read_all(b: &dyn Backend, name: &str) -> Vec<f32> {
    let i = b.find(name).unwrap();
    let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
    b.read_f32(i, 0, &mut v).unwrap();
    v
}

#[test]
fn routes_vocab_and_aliases() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_gguf(dir.path());
    let s = write_sketches(
        dir.path(),
        &[
            sketch("blk.0.attn_q.weight", HIDDEN, HIDDEN, 4),
            sketch("blk.0.attn_o.weight", HIDDEN, HIDDEN, 4),
            sketch("token_embd.weight", VOCAB, HIDDEN, 2),
        ],
    );
    let dense = backend::open_single(&g, Role::Fallback).unwrap();
    let b = backend::open(&s, Some(&g)).unwrap();
    let t = b.tensors();
    assert_eq!(t.len(), 5, "fallback order, no duplicates");
    let names: Vec<&str> = t.entries().iter().map(|e| e.name.dot.as_str()).collect();
    assert_eq!(
        names,
        [
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_output.weight",
            "blk.0.attn_norm.weight",
            "output.weight"
        ]
    );
    let role = |n: &str| t.entries()[b.find(n).unwrap()].origin.role;
    assert_eq!(role("blk.0.attn_q.weight"), Role::Primary);
    assert_eq!(role("blk_0_attn_o_weight"), Role::Primary);
    assert_eq!(
        role("token_embd.weight"),
        Role::Fallback,
        "never from the sketch"
    );
    assert_eq!(role("blk.0.attn_norm.weight"), Role::Fallback);
    assert_eq!(
        read_all(b.as_ref(), "token_embd_weight"),
        read_all(dense.as_ref(), "token_embd.weight")
    );
    assert_eq!(
        read_all(b.as_ref(), "output.weight"),
        read_all(dense.as_ref(), "output.weight")
    );
    assert_ne!(
        read_all(b.as_ref(), "blk.0.attn_q.weight"),
        read_all(dense.as_ref(), "blk.0.attn_q.weight")
    );
    let sketch_only = backend::open(&s, None).unwrap();
    assert_eq!(
        read_all(b.as_ref(), "blk.0.attn_output.weight"),
        read_all(sketch_only.as_ref(), "blk.0.attn_o.weight")
    );
    assert_eq!(b.fallback_summary().unwrap().path, g);
}

#[test]
fn vocab_sketch_without_fallback_is_listed_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let s = write_sketches(
        dir.path(),
        &[
            sketch("token_embd.weight", VOCAB, HIDDEN, 2),
            sketch("blk.0.attn_q.weight", HIDDEN, HIDDEN, 3),
        ],
    );
    let b = backend::open(&s, None).unwrap();
    let i = b.find("token_embd.weight").unwrap();
    let info = &b.tensors().entries()[i];
    match &info.availability {
        Availability::Unavailable(why) => {
            assert!(why.contains("never served lossy-encoded"), "{why}")
        }
        a => panic!("want unavailable, got {a:?}"),
    }
    let mut buf = vec![0f32; 4];
    let e = b.read_f32(i, 0, &mut buf).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(e.to_string().contains("--dense"), "{e}");
    assert_eq!(
        b.tensors().entries()[b.find("blk.0.attn_q.weight").unwrap()].stored,
        StoredType::Sketch { rank: 3 }
    );
    let text = rknot::report::inspect_text(b.as_ref());
    assert!(text.contains("UNAVAIL"), "{text}");
}

#[test]
fn shape_mismatch_names_both_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_gguf(dir.path());
    let s = write_sketches(
        dir.path(),
        &[sketch("blk.0.attn_q.weight", HIDDEN, HIDDEN / 2, 4)],
    );
    let e = backend::open(&s, Some(&g)).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::ShapeMismatch);
    let m = e.to_string();
    assert!(m.contains("[64, 32]") && m.contains("[64, 64]"), "{m}");
    assert!(m.contains("blk.0.attn_q.weight"), "{m}");
}

#[test]
fn duplicate_names_after_aliasing_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let s = write_sketches(
        dir.path(),
        &[
            sketch("blk.0.attn_o.weight", 8, 8, 2),
            sketch("blk.0.attn_output.weight", 8, 8, 2),
        ],
    );
    let e = backend::open(&s, None).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::BadName);
    assert!(e.to_string().contains("duplicate"), "{e}");
}

#[test]
fn rknot_primary_with_gguf_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_gguf(dir.path());
    let dense = backend::open_single(&g, Role::Fallback).unwrap();
    let w = read_all(dense.as_ref(), "blk.0.attn_q.weight");
    let m = Manifest {
        d: HIDDEN,
        standing_indices: (0..HIDDEN).filter(|i| i % 3 == 0).collect(),
        amplitudes: vec![1.0; 22],
        phase_alignment: vec![0.5; 22],
    };
    let spec = TensorSpec {
        name: "blk.0.attn_q.weight".into(),
        d_out: HIDDEN,
        d_in: HIDDEN,
        restrict_rows: false,
        restrict_cols: true,
        coding: Coding::Uniform { bits: 8 },
        block_rows: 4,
        block_cols: 22,
    };
    let p = dir.path().join("m.rknot");
    std::fs::write(&p, common::one_tensor_rknot(&m, spec, &w)).unwrap();
    let b = backend::open(&p, Some(&g)).unwrap();
    assert_eq!(b.tensors().len(), 5);
    let q = read_all(b.as_ref(), "blk_0_attn_q_weight");
    for r in 0..HIDDEN as usize {
        for c in 0..HIDDEN as usize {
            let (got, want) = (q[r * 64 + c], w[r * 64 + c]);
            if c % 3 == 0 {
                assert!(
                    (got - want).abs() < 0.5 / 127.0 * 1.01,
                    "({r},{c}) {got} {want}"
                );
            } else {
                assert_eq!(got.to_bits(), 0, "off-standing entries are exactly 0.0");
            }
        }
    }
    assert_eq!(
        read_all(b.as_ref(), "blk.0.attn_norm.weight"),
        read_all(dense.as_ref(), "blk.0.attn_norm.weight")
    );
}

/// Many threads reading random ranges of one backend see exactly what a
/// single-threaded whole-tensor read sees.
#[test]
fn concurrent_reads_are_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_gguf(dir.path());
    let s = write_sketches(
        dir.path(),
        &[sketch("blk.0.attn_q.weight", HIDDEN, HIDDEN, 4)],
    );
    let b: Arc<dyn Backend> = Arc::from(backend::open(&s, Some(&g)).unwrap());
    let whole: Vec<Vec<f32>> = (0..b.tensors().len())
        .map(|i| {
            let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
            b.read_f32(i, 0, &mut v).unwrap();
            v
        })
        .collect();
    let whole = Arc::new(whole);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (b, whole) = (b.clone(), whole.clone());
            std::thread::spawn(move || {
                let mut x = t * 7919 + 1;
                for _ in 0..2000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let i = (x % whole.len() as u64) as usize;
                    let n = whole[i].len() as u64;
                    let first = (x >> 20) % n;
                    let len = ((x >> 40) % 300).min(n - first) as usize;
                    let mut buf = vec![0f32; len];
                    b.read_f32(i, first, &mut buf).unwrap();
                    assert_eq!(&buf[..], &whole[i][first as usize..first as usize + len]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn reads_outside_the_tensor_are_range_errors() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_gguf(dir.path());
    let b = backend::open(&g, None).unwrap();
    let i = b.find("blk.0.attn_norm.weight").unwrap();
    let mut buf = vec![0f32; 2];
    assert_eq!(
        b.read_f32(i, 63, &mut buf).unwrap_err().kind(),
        ErrorKind::Range
    );
    assert_eq!(
        b.read_f32(i, u64::MAX, &mut buf).unwrap_err().kind(),
        ErrorKind::Range
    );
    let mut bytes = [0u8; 8];
    assert_eq!(
        b.read_bytes(i, 256, &mut bytes).unwrap(),
        0,
        "read at EOF returns 0 bytes"
    );
    assert_eq!(b.read_bytes(i, 253, &mut bytes).unwrap(), 3);
    assert_eq!(b.find("nope").unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn fallback_must_be_dense() {
    let dir = tempfile::tempdir().unwrap();
    let s = write_sketches(dir.path(), &[sketch("blk.0.attn_q.weight", 8, 8, 2)]);
    let e = backend::open(&s, Some(&s)).err().unwrap();
    assert!(
        e.to_string().contains("fallback must be a dense file"),
        "{e}"
    );
}
