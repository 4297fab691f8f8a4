//! The real model: SmolLM2-135M-Instruct (Q4_1 GGUF, with Q8_0 and F32
//! tensors). Every tensor must decode bit-for-bit like gguf-py
//! (tests/data/smollm2_dequant.json, made by tools/gen_ggml_vectors.py), through
//! the library, the `rknot` CLI, and a dense .knot repack; and a sketch made
//! from its weights must layer over it.

mod common;

use std::process::Command;

use common::*;
use rknot::backend::{self, Backend, Role, StoredType};
use rknot::format::gguf::GgufFile;
use rknot::format::knot::{KnotTensorOut, write_knot};
use rknot::format::sk32::{Sketch, write_sk32};
use rknot::quant::GgmlType;
use rknot::source::SourceFile;

fn decode_all(b: &dyn Backend, index: usize) -> Vec<f32> {
    let n = b.tensors().entries()[index].n_elements as usize;
    let mut out = vec![0f32; n];
    // Several calls with an odd chunk size, to exercise partial blocks.
    let chunk = 100_003usize;
    let mut at = 0;
    while at < n {
        let m = chunk.min(n - at);
        b.read_f32(index, at as u64, &mut out[at..at + m]).unwrap();
        at += m;
    }
    out
}

needs! { [model]
fn inspect_lists_272_tensors_with_shapes_and_types() {
    let Some(model) = smollm2() else { return };
    let b = backend::open(&model, None).unwrap();
    let refs = smollm2_reference();
    assert_eq!(b.tensors().len(), 272);
    assert_eq!(refs.len(), 272);
    let mut counts = std::collections::HashMap::new();
    for r in &refs {
        let i = b.find(&r.name).unwrap();
        let t = &b.tensors().entries()[i];
        let want_shape: Vec<u64> = r.ne.iter().rev().copied().collect();
        assert_eq!(t.shape, want_shape, "{}", r.name);
        assert_eq!(
            t.stored,
            StoredType::Ggml(GgmlType::from_name(&r.ty).unwrap()),
            "{}",
            r.name
        );
        assert_eq!(t.n_elements, r.n_elements);
        assert_eq!(b.find(&t.name.underscore).unwrap(), i);
        *counts.entry(r.ty.clone()).or_insert(0) += 1;
    }
    assert_eq!(counts["q4_1"], 210);
    assert_eq!(counts["f32"], 61);
    assert_eq!(counts["q8_0"], 1);
    let md = &b.summary().metadata;
    assert_eq!(md.architecture(), Some("llama"));
    assert_eq!(md.arch_u64("block_count"), Some(30));
    assert_eq!(md.arch_u64("embedding_length"), Some(576));
}
}

needs! { [model]
fn every_tensor_decodes_bit_exact_like_gguf_py() {
    let Some(model) = smollm2() else { return };
    let b = backend::open(&model, None).unwrap();
    for r in smollm2_reference() {
        let i = b.find(&r.name).unwrap();
        let got = decode_all(b.as_ref(), i);
        assert_eq!(sha256_hex(&f32_le_bytes(&got)), r.sha256, "{}", r.name);
    }
}
}

needs! { [model]
fn cli_cat_of_every_tensor_matches_gguf_py() {
    let Some(model) = smollm2() else { return };
    for r in smollm2_reference() {
        // Alternate spellings: the CLI accepts both.
        let name = if r.name.len() % 2 == 0 {
            r.name.clone()
        } else {
            r.name.replace('.', "_")
        };
        let out = Command::new(rknot_bin())
            .arg("cat")
            .arg(&model)
            .arg(&name)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout.len() as u64, r.n_elements * 4, "{name}");
        assert_eq!(sha256_hex(&out.stdout), r.sha256, "{name}");
    }
}
}

needs! { [model]
fn cli_cat_ranges_and_inspect_json() {
    let Some(model) = smollm2() else { return };
    let b = backend::open(&model, None).unwrap();
    let i = b.find("blk.7.attn_v.weight").unwrap();
    let full = f32_le_bytes(&decode_all(b.as_ref(), i));
    for (off, len) in [
        (0u64, 1u64),
        (1, 3),
        (4097, 999),
        (full.len() as u64 - 5, 100),
    ] {
        let out = Command::new(rknot_bin())
            .args(["cat", model.to_str().unwrap(), "blk_7_attn_v_weight"])
            .args(["--offset", &off.to_string(), "--length", &len.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success());
        let lo = (off as usize).min(full.len());
        let hi = (off + len).min(full.len() as u64) as usize;
        assert_eq!(out.stdout, &full[lo..hi], "offset {off} length {len}");
    }
    // At the tensor's end: nothing (as read(2) at end of file); past it:
    // refused, a usage error (exit 2), no bytes.
    for (off, code) in [(full.len(), Some(0)), (full.len() + 1, Some(2))] {
        let out = Command::new(rknot_bin())
            .args(["cat", model.to_str().unwrap(), "blk_7_attn_v_weight"])
            .args(["--offset", &off.to_string(), "--length", "10"])
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            code,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty());
    }
    let out = Command::new(rknot_bin())
        .args(["inspect", "--json", model.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tensors"].as_array().unwrap().len(), 272);
    assert_eq!(v["totals"]["available"], 272);
    assert_eq!(v["model"]["layers"], 30);
    let text = Command::new(rknot_bin())
        .args(["inspect", model.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("tensors:   272 (272 available)"), "{text}");
    assert!(text.contains("blk.29.ffn_down.weight"));
    assert!(text.contains("blk_29_ffn_down_weight"));
}
}

needs! { [model]
/// GGUF -> dense .knot (blocks verbatim) -> every tensor identical.
fn dense_knot_repack_decodes_identically() {
    let Some(model) = smollm2() else { return };
    let src = SourceFile::open(&model).unwrap();
    let g = GgufFile::read(&src).unwrap();
    let datas: Vec<Vec<u8>> = g
        .tensors
        .iter()
        .map(|t| src.read_vec(t.offset, t.n_bytes, "tensor").unwrap())
        .collect();
    let shapes: Vec<Vec<u64>> = g
        .tensors
        .iter()
        .map(|t| t.dims.iter().rev().copied().collect())
        .collect();
    let outs: Vec<KnotTensorOut> = g
        .tensors
        .iter()
        .zip(&datas)
        .zip(&shapes)
        .map(|((t, d), s)| KnotTensorOut {
            name: &t.name,
            ty: t.ty,
            shape: s,
            data: d,
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("smollm2.knot");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&p).unwrap());
    write_knot(&mut f, &g.metadata, &outs).unwrap();
    drop(f);
    let b = backend::open(&p, None).unwrap();
    assert_eq!(b.tensors().len(), 272);
    let (got_md, want_md) = (&b.summary().metadata, &g.metadata);
    assert_eq!(got_md.len(), want_md.len());
    for ((k1, v1), (k2, v2)) in got_md.entries.iter().zip(&want_md.entries) {
        assert_eq!(k1, k2, "key order is kept");
        assert!(v1 == v2, "metadata {k1} differs after the round trip");
    }
    for r in smollm2_reference() {
        let i = b.find(&r.name).unwrap();
        let got = decode_all(b.as_ref(), i);
        assert_eq!(sha256_hex(&f32_le_bytes(&got)), r.sha256, "{}", r.name);
    }
}
}

needs! { [model]
/// A sketch made from SmolLM2 weights (U = the first r columns of W, σ = 1,
/// Vᵀ = the first r rows of the identity, so Ŵ keeps W's first r columns),
/// layered over the GGUF.
fn sk32_from_smollm2_layers_over_the_gguf() {
    let Some(model) = smollm2() else { return };
    let dense = backend::open_single(&model, Role::Fallback).unwrap();
    let rank = 16usize;
    let mut sketches = Vec::new();
    let names = [
        "blk.0.attn_q.weight",
        "blk.0.attn_output.weight",
        "blk.5.ffn_down.weight",
        "token_embd.weight",
    ];
    let mut originals = Vec::new();
    for n in names {
        let i = dense.find(n).unwrap();
        let t = &dense.tensors().entries()[i];
        let (d_out, d_in) = (t.shape[0] as usize, t.shape[1] as usize);
        let w = decode_all(dense.as_ref(), i);
        let u: Vec<f32> = (0..d_out)
            .flat_map(|r| w[r * d_in..r * d_in + rank].to_vec())
            .collect();
        let mut vt = vec![0f32; rank * d_in];
        for k in 0..rank {
            vt[k * d_in + k] = 1.0;
        }
        // Stored with the sketch generator's attn_o spelling.
        let stored = n.replace("attn_output", "attn_o");
        sketches.push(Sketch::quantize(
            &stored,
            d_out,
            d_in,
            &u,
            &vec![1.0; rank],
            &vt,
        ));
        originals.push((n, w, d_out, d_in));
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("smol.sk32");
    let mut bytes = Vec::new();
    write_sk32(&mut bytes, "test-first-columns", &sketches).unwrap();
    std::fs::write(&p, bytes).unwrap();

    let b = backend::open(&p, Some(&model)).unwrap();
    assert_eq!(b.tensors().len(), 272, "fallback order, nothing duplicated");
    for (n, w, d_out, d_in) in &originals {
        let i = b.find(n).unwrap();
        let t = &b.tensors().entries()[i];
        let got = decode_all(b.as_ref(), i);
        if *n == "token_embd.weight" {
            // Never from the sketch: the fallback's exact values.
            assert_eq!(t.origin.role, Role::Fallback);
            assert_eq!(&got, w);
            continue;
        }
        assert_eq!(t.origin.role, Role::Primary, "{n}");
        assert_eq!(b.find(&t.name.underscore).unwrap(), i);
        let u_max = (0..*d_out)
            .flat_map(|r| w[r * d_in..r * d_in + rank].iter())
            .fold(0f32, |m, v| m.max(v.abs()));
        for r in 0..*d_out {
            for c in 0..*d_in {
                let g = got[r * d_in + c];
                if c < rank {
                    // u8 quantization of U: half a step of u_max/127.
                    assert!(
                        (g - w[r * d_in + c]).abs() <= u_max / 127.0 * 0.51,
                        "{n} ({r},{c})"
                    );
                } else {
                    assert_eq!(g, 0.0, "{n} ({r},{c})");
                }
            }
        }
    }
    // Norms come from the fallback, byte for byte.
    let i = b.find("blk_3_attn_norm_weight").unwrap();
    assert_eq!(b.tensors().entries()[i].origin.role, Role::Fallback);
    let j = dense.find("blk.3.attn_norm.weight").unwrap();
    assert_eq!(decode_all(b.as_ref(), i), decode_all(dense.as_ref(), j));

    let json = rknot::report::inspect_json(b.as_ref());
    let tensors = json["tensors"].as_array().unwrap();
    let q = tensors
        .iter()
        .find(|t| t["name"] == "blk.0.attn_q.weight")
        .unwrap();
    assert_eq!(q["source"]["role"], "primary");
    assert_eq!(q["stored_type"], "SK32 r16");
    let e = tensors
        .iter()
        .find(|t| t["name"] == "token_embd.weight")
        .unwrap();
    assert_eq!(e["source"]["role"], "fallback");
}
}
