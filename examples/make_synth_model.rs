//! Write a synthetic GGUF with a real model's shapes and realistic values
//! (`rknot::synth`): the tensors, types and key/values a llama.cpp Q4_K_M
//! file of that model has (matrices Q4_K; `output.weight`, and `attn_v` /
//! `ffn_down` on llama.cpp's `use_more_bits` layers, Q6_K; norms and biases
//! F32), a byte-level BPE tokenizer of the full vocabulary size that
//! tokenizes English, and Gaussian weights with outlier input channels and
//! heavy-tailed elements, deterministic from the seed whatever the thread
//! count.
//!
//! Shapes: `qwen2.5-7b` (28 blocks, hidden 3584, 28/4 heads, ffn 18944,
//! vocab 152064, Q/K/V biases; ~4.7 GB), `llama3-70b` (80 blocks, hidden
//! 8192, 64/8 heads, ffn 28672, vocab 128256; ~42.5 GB, so usually
//! `--sparse`), `tiny` (2 blocks, hidden 256, 4/2 heads, ffn 512, vocab
//! 1000; for tests).
//!
//! `--sparse` writes the header only and leaves the data section a hole (a
//! file of the full length taking a few MB of disk; every tensor decodes to
//! zeros): for benchmarks that read headers only (`tools/bench-views.sh`).
//! `--layers N` makes the same model with N blocks.
//!
//! Run: `cargo run --release --example make_synth_model -- OUT.gguf
//! --shape qwen2.5-7b|llama3-70b|tiny [--layers N] [--sparse] [--seed S]
//! [--force]`

use std::path::PathBuf;
use std::time::Instant;

use rknot::synth;

const USAGE: &str = "usage: make_synth_model OUT.gguf --shape qwen2.5-7b|llama3-70b|tiny \
                     [--layers N] [--sparse] [--seed S] [--force]";

fn main() {
    if let Err(e) = run() {
        eprintln!("make_synth_model: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut out: Option<PathBuf> = None;
    let mut shape = None;
    let mut layers = None;
    let mut sparse = false;
    let mut force = false;
    let mut seed = 0x5eed_u64;
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match a.to_str() {
            Some("--shape") => shape = Some(value("--shape")?),
            Some("--layers") => {
                let v = value("--layers")?;
                layers = Some(
                    v.parse::<u64>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| format!("--layers {v:?}: a positive integer"))?,
                );
            }
            Some("--seed") => {
                let v = value("--seed")?;
                seed = match v.strip_prefix("0x") {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => v.parse(),
                }
                .map_err(|_| format!("--seed {v:?}: an integer"))?;
            }
            Some("--sparse") => sparse = true,
            Some("--force") => force = true,
            Some("-h" | "--help") => {
                println!("{USAGE}");
                return Ok(());
            }
            Some(s) if s.starts_with('-') => {
                return Err(format!("unknown option {s}\n{USAGE}").into());
            }
            _ if out.is_none() => out = Some(PathBuf::from(a)),
            _ => return Err(format!("one output file only\n{USAGE}").into()),
        }
    }
    let out = out.ok_or(USAGE)?;
    let name = shape.ok_or(USAGE)?;
    let mut s = synth::model_shape(&name).ok_or_else(|| {
        format!(
            "unknown shape {name:?}; one of {}",
            synth::SHAPES.join(", ")
        )
    })?;
    if let Some(n) = layers {
        s.layers = n;
    }
    let t0 = Instant::now();
    let sum = synth::write_model(&out, &s, seed, sparse, force, true)?;
    println!(
        "{}: {} tensors, {} parameters, {} bytes{} (header {} B), {:.1} s",
        sum.path.display(),
        sum.tensors,
        sum.parameters,
        sum.bytes,
        if sparse { " sparse" } else { "" },
        sum.header_bytes,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
