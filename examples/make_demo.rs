//! Build the small demo model that ships in `demo/` (deterministic):
//!
//! - `tiny-llama.gguf`: a llama-shaped model (2 layers, hidden 256, GQA 8/4
//!   heads, ffn 512, vocab 256) with random weights, one tensor type per
//!   slot so every decoder is exercised: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
//!   Q2_K..Q6_K, F16, BF16, F32;
//! - `tiny-llama.knot`: the same tensors repacked as dense .knot;
//! - `tiny-llama.sk32`: rank-8 sketches of the attention and FFN matrices
//!   (and of token_embd, which the layered backend must never serve);
//! - `tiny-llama.rknot`: the layers' matrices encoded per the seed profile
//!   (standing dims by column energy, coverage 0.5, uniform 8-bit Q/K/V,
//!   graded FFN down).
//!
//! Run: `cargo run --release --example make_demo -- demo`

use std::path::Path;

use rknot::backend::{self, Backend, Role};
use rknot::format::gguf::write_gguf;
use rknot::format::knot::{KnotTensorOut, write_knot};
use rknot::format::meta::{MetaType, MetaValue, Metadata};
use rknot::format::rknot::{ArchMeta, Axis, Coding, LayerOut, Manifest, TensorSpec, write_rknot};
use rknot::format::sk32::write_sk32;
use rknot::quant::GgmlType;
use rknot::synth::{self, Rng};

const HIDDEN: u64 = 256;
const FFN: u64 = 512;
const VOCAB: u64 = 256;
const LAYERS: u64 = 2;
const HEADS: u64 = 8;
const KV_HEADS: u64 = 4;
const HEAD_DIM: u64 = HIDDEN / HEADS;

fn metadata() -> Metadata {
    let mut md = Metadata::default();
    let s = |v: &str| MetaValue::String(v.into());
    md.push("general.architecture", s("llama"));
    md.push("general.name", s("rknot tiny demo (random weights)"));
    md.push("general.license", s("apache-2.0"));
    md.push("llama.block_count", MetaValue::U32(LAYERS as u32));
    md.push("llama.context_length", MetaValue::U32(512));
    md.push("llama.embedding_length", MetaValue::U32(HIDDEN as u32));
    md.push("llama.feed_forward_length", MetaValue::U32(FFN as u32));
    md.push("llama.attention.head_count", MetaValue::U32(HEADS as u32));
    md.push(
        "llama.attention.head_count_kv",
        MetaValue::U32(KV_HEADS as u32),
    );
    md.push("llama.rope.freq_base", MetaValue::F32(10000.0));
    md.push(
        "llama.rope.dimension_count",
        MetaValue::U32(HEAD_DIM as u32),
    );
    md.push(
        "llama.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-5),
    );
    md.push("llama.vocab_size", MetaValue::U32(VOCAB as u32));
    md.push("tokenizer.ggml.model", s("gpt2"));
    let tokens: Vec<MetaValue> = (0..VOCAB)
        .map(|i| MetaValue::String(format!("<{i:02x}>")))
        .collect();
    md.push(
        "tokenizer.ggml.tokens",
        MetaValue::Array {
            elem: MetaType::String,
            values: tokens,
        },
    );
    md
}

/// (GGUF name, ne dims, type, std)
fn tensor_list() -> Vec<(String, Vec<u64>, GgmlType, f32)> {
    let kv = KV_HEADS * HEAD_DIM;
    let mut t = vec![(
        "token_embd.weight".to_string(),
        vec![HIDDEN, VOCAB],
        GgmlType::Q8_0,
        0.05,
    )];
    let types = [
        [
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Q4_0,
            GgmlType::Q3K,
            GgmlType::Q2K,
            GgmlType::Q5_1,
        ],
        [
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q4K,
            GgmlType::Q8_0,
            GgmlType::Q6K,
        ],
    ];
    for l in 0..LAYERS {
        let ty = types[l as usize];
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        t.push((b("attn_norm"), vec![HIDDEN], GgmlType::F32, 0.1));
        t.push((b("attn_q"), vec![HIDDEN, HIDDEN], ty[0], 0.04));
        t.push((b("attn_k"), vec![HIDDEN, kv], ty[1], 0.04));
        t.push((b("attn_v"), vec![HIDDEN, kv], ty[2], 0.04));
        t.push((b("attn_output"), vec![HIDDEN, HIDDEN], ty[3], 0.03));
        t.push((b("ffn_norm"), vec![HIDDEN], GgmlType::F32, 0.1));
        t.push((b("ffn_gate"), vec![HIDDEN, FFN], ty[4], 0.03));
        t.push((b("ffn_up"), vec![HIDDEN, FFN], ty[5], 0.03));
        t.push((b("ffn_down"), vec![FFN, HIDDEN], ty[6], 0.02));
    }
    t.push((
        "output_norm.weight".to_string(),
        vec![HIDDEN],
        GgmlType::F32,
        0.1,
    ));
    t.push((
        "output.weight".to_string(),
        vec![HIDDEN, VOCAB],
        GgmlType::Q6K,
        0.05,
    ));
    t
}

fn read_all(b: &dyn Backend, name: &str) -> (Vec<f32>, u64, u64) {
    let i = b.find(name).expect("demo tensor exists");
    let t = &b.tensors().entries()[i];
    let mut v = vec![0f32; t.n_elements as usize];
    b.read_f32(i, 0, &mut v).expect("demo tensor decodes");
    (v, t.shape[0], t.shape[1])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "demo".into());
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let md = metadata();
    let list = tensor_list();
    let datas: Vec<Vec<u8>> = list
        .iter()
        .map(|(_, ne, ty, std)| synth::ggml_blocks(*ty, ne.iter().product(), *std, &mut rng))
        .collect();

    // GGUF.
    let gguf_path = dir.join("tiny-llama.gguf");
    let refs: Vec<(String, Vec<u64>, GgmlType, &[u8])> = list
        .iter()
        .zip(&datas)
        .map(|((n, ne, ty, _), d)| (n.clone(), ne.clone(), *ty, d.as_slice()))
        .collect();
    write_gguf(&mut std::fs::File::create(&gguf_path)?, &md, &refs, 32)?;

    // Dense .knot: the same blocks, outer-first shapes, underscore names.
    let shapes: Vec<Vec<u64>> = list
        .iter()
        .map(|(_, ne, _, _)| ne.iter().rev().copied().collect())
        .collect();
    let outs: Vec<KnotTensorOut> = list
        .iter()
        .zip(&datas)
        .zip(&shapes)
        .map(|(((n, _, ty, _), d), s)| KnotTensorOut {
            name: n,
            ty: *ty,
            shape: s,
            data: d,
        })
        .collect();
    write_knot(
        &mut std::fs::File::create(dir.join("tiny-llama.knot"))?,
        &md,
        &outs,
    )?;

    let dense = backend::open_single(&gguf_path, Role::Fallback)?;

    // SK32: random rank-8 factors with a decaying spectrum, stored with the
    // sketch generator's attn_o spelling; plus a token_embd sketch that the
    // layered backend must ignore.
    let rank = 8usize;
    let mut sketches = Vec::new();
    for (name, ne, _, _) in &list {
        let matrix = name.starts_with("blk.") && ne.len() == 2;
        if !(matrix || name == "token_embd.weight") {
            continue;
        }
        let (d_out, d_in) = (ne[1] as usize, ne[0] as usize);
        sketches.push(synth::sketch(
            &name.replace("attn_output", "attn_o"),
            d_out,
            d_in,
            rank,
            &mut rng,
        ));
    }
    write_sk32(
        &mut std::fs::File::create(dir.join("tiny-llama.sk32"))?,
        "rank-k-exclusion-sketch",
        &sketches,
    )?;

    // .rknot, seed profile: standing dims = top half of the hidden dims by
    // column energy of Q/K/V/gate/up (+ row energy of down).
    let mut layers = Vec::new();
    for l in 0..LAYERS {
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        let mut energy = vec![0f64; HIDDEN as usize];
        for n in ["attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"] {
            let (w, _, d_in) = read_all(dense.as_ref(), &b(n));
            for (i, v) in w.iter().enumerate() {
                energy[i % d_in as usize] += f64::from(v * v);
            }
        }
        let (down, _, d_in) = read_all(dense.as_ref(), &b("ffn_down"));
        for (i, v) in down.iter().enumerate() {
            energy[i / d_in as usize] += f64::from(v * v);
        }
        let mut order: Vec<usize> = (0..HIDDEN as usize).collect();
        order.sort_by(|&a, &c| energy[c].total_cmp(&energy[a]));
        let k = HIDDEN as usize / 2;
        let mut standing: Vec<u64> = order[..k].iter().map(|&i| i as u64).collect();
        standing.sort_unstable();
        let emax = standing
            .iter()
            .map(|&i| energy[i as usize])
            .fold(0f64, f64::max);
        let amplitudes: Vec<f32> = standing
            .iter()
            .map(|&i| (energy[i as usize] / emax) as f32)
            .collect();
        let manifest = Manifest {
            d: HIDDEN,
            standing_indices: standing,
            phase_alignment: amplitudes.clone(),
            amplitudes,
        };
        let mut tensors = Vec::new();
        for (n, rows) in [
            ("attn_q", false),
            ("attn_k", false),
            ("attn_v", false),
            ("ffn_gate", false),
            ("ffn_up", false),
            ("ffn_down", true),
        ] {
            let (w, d_out, d_in) = read_all(dense.as_ref(), &b(n));
            let coding = if rows {
                Coding::Graded {
                    max_bits: 8,
                    line_axis: Axis::Rows,
                    line_bits: manifest
                        .phase_alignment
                        .iter()
                        .map(|p| {
                            if *p < 0.2 {
                                0
                            } else {
                                4 + (4.0 * p).round() as u8
                            }
                        })
                        .collect(),
                }
            } else {
                Coding::Uniform { bits: 8 }
            };
            let spec = TensorSpec {
                name: b(n),
                d_out,
                d_in,
                restrict_rows: rows,
                restrict_cols: !rows,
                coding,
                block_rows: if rows { 4 } else { 16 },
                block_cols: if rows { d_in } else { k as u64 },
            };
            let blocks = spec.encode(&manifest, &w);
            tensors.push((spec, blocks));
        }
        layers.push(LayerOut {
            index: l,
            manifest,
            tensors,
        });
    }
    let arch = ArchMeta {
        arch: "llama".into(),
        hidden_dim: HIDDEN,
        num_layers: LAYERS,
        metadata: md.clone(),
    };
    write_rknot(
        &mut std::fs::File::create(dir.join("tiny-llama.rknot"))?,
        &arch,
        &layers,
    )?;
    for f in [
        "tiny-llama.gguf",
        "tiny-llama.knot",
        "tiny-llama.sk32",
        "tiny-llama.rknot",
    ] {
        let p = dir.join(f);
        println!("{} {} bytes", p.display(), std::fs::metadata(&p)?.len());
    }
    Ok(())
}
