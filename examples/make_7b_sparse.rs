//! Write a 7B-shaped GGUF (Qwen2.5-7B's shapes: 28 layers, hidden 3584,
//! 28 heads / 4 KV heads so k/v are 512 wide, ffn 18944, vocab 152064, the
//! matrices Q4_K) whose header is complete and valid, tokenizer included
//! (152064 tokens, their types, 151387 merges), and whose data section is a
//! hole: a sparse file of ~4.4 GB that takes a few MB of disk. Every
//! tensor decodes to zeros (a Q4_K block of zero bytes has scale 0).
//!
//! For the views benchmark (docs/PERFORMANCE.md): mounting and building
//! `model.safetensors` / `model.gguf` read headers only, so the data need
//! not exist.
//!
//! Run: `cargo run --release --example make_7b_sparse -- /tmp/q7b.gguf [LAYERS]`
//! (LAYERS, default 28, makes the same model with fewer or more blocks: the
//! same vocabulary and header size class, a different decoded size).

use std::path::PathBuf;

use rknot::format::gguf::{DEFAULT_ALIGNMENT, encode_header};
use rknot::format::meta::{MetaType, MetaValue, Metadata};
use rknot::quant::GgmlType;

const LAYERS: u64 = 28;
const HIDDEN: u64 = 3584;
const HEADS: u64 = 28;
const KV_HEADS: u64 = 4;
const KV: u64 = HIDDEN / HEADS * KV_HEADS;
const FFN: u64 = 18944;
const VOCAB: u64 = 152064;
const MERGES: u64 = 151387;

fn metadata(layers: u64) -> Metadata {
    let mut md = Metadata::default();
    let s = |v: &str| MetaValue::String(v.into());
    let u = |v: u64| MetaValue::U32(v as u32);
    md.push("general.architecture", s("qwen2"));
    md.push("general.name", s("rknot 7B-shaped sparse benchmark model"));
    md.push("general.file_type", u(15)); // Q4_K_M
    md.push("qwen2.block_count", u(layers));
    md.push("qwen2.context_length", u(32768));
    md.push("qwen2.embedding_length", u(HIDDEN));
    md.push("qwen2.feed_forward_length", u(FFN));
    md.push("qwen2.attention.head_count", u(HEADS));
    md.push("qwen2.attention.head_count_kv", u(KV_HEADS));
    md.push("qwen2.rope.freq_base", MetaValue::F32(1_000_000.0));
    md.push(
        "qwen2.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-6),
    );
    md.push("tokenizer.ggml.model", s("gpt2"));
    md.push("tokenizer.ggml.pre", s("qwen2"));
    let strings = |n: u64, f: &dyn Fn(u64) -> String| MetaValue::Array {
        elem: MetaType::String,
        values: (0..n).map(|i| MetaValue::String(f(i))).collect(),
    };
    md.push(
        "tokenizer.ggml.tokens",
        strings(VOCAB, &|i| format!("tok{i:06}")),
    );
    md.push(
        "tokenizer.ggml.token_type",
        MetaValue::Array {
            elem: MetaType::I32,
            values: (0..VOCAB).map(|_| MetaValue::I32(1)).collect(),
        },
    );
    md.push(
        "tokenizer.ggml.merges",
        strings(MERGES, &|i| format!("t{} k{}", i % 977, i / 977)),
    );
    md.push("tokenizer.ggml.eos_token_id", u(151645));
    md.push("general.quantization_version", u(2));
    md
}

/// (name, ne-order dims, type), in llama.cpp's usual order.
fn tensors(layers: u64) -> Vec<(String, Vec<u64>, GgmlType)> {
    let q = GgmlType::Q4K;
    let f = GgmlType::F32;
    let mut t = vec![("token_embd.weight".to_string(), vec![HIDDEN, VOCAB], q)];
    for l in 0..layers {
        let n = |p: &str| format!("blk.{l}.{p}");
        t.extend([
            (n("attn_norm.weight"), vec![HIDDEN], f),
            (n("attn_q.weight"), vec![HIDDEN, HIDDEN], q),
            (n("attn_q.bias"), vec![HIDDEN], f),
            (n("attn_k.weight"), vec![HIDDEN, KV], q),
            (n("attn_k.bias"), vec![KV], f),
            (n("attn_v.weight"), vec![HIDDEN, KV], q),
            (n("attn_v.bias"), vec![KV], f),
            (n("attn_output.weight"), vec![HIDDEN, HIDDEN], q),
            (n("ffn_norm.weight"), vec![HIDDEN], f),
            (n("ffn_gate.weight"), vec![HIDDEN, FFN], q),
            (n("ffn_up.weight"), vec![HIDDEN, FFN], q),
            (n("ffn_down.weight"), vec![FFN, HIDDEN], q),
        ]);
    }
    t.push(("output_norm.weight".to_string(), vec![HIDDEN], f));
    t.push(("output.weight".to_string(), vec![HIDDEN, VOCAB], q));
    t
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: make_7b_sparse OUT.gguf [LAYERS]";
    let out = std::env::args_os().nth(1).map(PathBuf::from).ok_or(usage)?;
    let layers = match std::env::args().nth(2) {
        Some(n) => n.parse::<u64>().map_err(|_| usage)?,
        None => LAYERS,
    };
    let tensors = tensors(layers);
    let (header, offsets) = encode_header(&metadata(layers), &tensors, DEFAULT_ALIGNMENT)?;
    let mut end = 0u64;
    let mut elements = 0u64;
    for ((_, dims, ty), off) in tensors.iter().zip(&offsets) {
        let n: u64 = dims.iter().product();
        elements += n;
        let bytes = ty.bytes_for(n).ok_or("tensor size overflows")?;
        end = end.max(off + bytes);
    }
    let size = header.len() as u64 + end.next_multiple_of(DEFAULT_ALIGNMENT);
    std::fs::write(&out, &header)?;
    // The data section stays a hole.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&out)?
        .set_len(size)?;
    println!(
        "{}: {} tensors, {} elements ({:.1} GB decoded as f32), header {} B, file {} B (sparse)",
        out.display(),
        tensors.len(),
        elements,
        elements as f64 * 4.0 / 1e9,
        header.len(),
        size
    );
    Ok(())
}
