//! `rknot bench lossless`: the lossless .rknot codec (docs/FORMAT.md 6.7)
//! on bf16 weights: size against the bf16 bytes and against the order-0
//! entropy bound of the same tensors, and decode throughput against a
//! memcpy of the same bytes, measured in the same run; and the seed's
//! "fp48 bi-sided" packer measured on the same payloads.
//!
//! Weight sets, reported apart:
//! - a synthetic 7B-shaped layer (Llama-2-7B: q, k, v, o 4096 x 4096, gate
//!   and up 11008 x 4096, down 4096 x 11008), values from
//!   [`crate::synth::model`] (per-channel scales, 1% outlier channels,
//!   heavy-tailed outlier elements), rounded to bf16 to nearest even as
//!   torch's `.to(torch.bfloat16)` rounds;
//! - a GGUF's matrices (SmolLM2-135M), decoded to f32 and rounded to bf16
//!   the same way: a Q4_1 source has 16 values per 32-weight block, so its
//!   exponents are far more predictable than a real bf16 checkpoint's.
//!
//! The order-0 bound of a tensor is `n x H(w)` bits, `H(w)` the empirical
//! entropy of its 16-bit words (each distinct bf16 value a symbol, counted
//! over the whole tensor): what any coder that codes each value on its own
//! with one fixed model of the tensor can at best reach. The coder's split
//! bound, `n x (H(exponent) + 8)`, is printed too: the best a code of the
//! exponent alone with sign and mantissa raw can do.
//!
//! Decode is timed by the benchmarking thread's CPU time (other processes
//! on a shared machine do not inflate it), one thread, every block of the
//! set decoded into its place in one output buffer; memcpy copies as many
//! bytes between two buffers of that size. Rounds are interleaved, medians
//! reported.

use std::fmt::Write as _;

use rayon::prelude::*;

use super::kernels::timed;
use super::{BResult, gbs, median};
use crate::backend;
use crate::encode::lossless::{lossless_blocks, lossless_tile};
use crate::format::rknot::{LosslessFloat, decode_lossless_bf16};
use crate::synth::Rng;
use crate::synth::{matrix_profile, matrix_values};

/// Options of `rknot bench lossless`.
#[derive(Debug, Clone)]
pub struct LosslessBenchOpts {
    /// A GGUF (or any dense source) whose matrices are the second set.
    pub model: Option<std::path::PathBuf>,
    /// Fraction of each synthetic matrix's rows generated (1.0: the whole
    /// 7B layer, 202M weights).
    pub fraction: f64,
    pub rounds: usize,
}

/// One tensor of a set: its bf16 words and shape.
struct Words {
    name: String,
    words: Vec<u16>,
    d_out: u64,
    d_in: u64,
}

/// f32 -> bf16, round to nearest even (NaN kept quiet).
fn to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// The synthetic 7B-shaped layer.
fn synthetic_layer(fraction: f64) -> Vec<Words> {
    let shapes: [(&str, u64, u64); 7] = [
        ("attn_q", 4096, 4096),
        ("attn_k", 4096, 4096),
        ("attn_v", 4096, 4096),
        ("attn_output", 4096, 4096),
        ("ffn_gate", 11008, 4096),
        ("ffn_up", 11008, 4096),
        ("ffn_down", 4096, 11008),
    ];
    shapes
        .par_iter()
        .enumerate()
        .map(|(i, &(name, d_out, d_in))| {
            let rows = ((d_out as f64 * fraction).ceil() as u64).clamp(1, d_out);
            let profile = matrix_profile(7, i as u64, d_in as usize);
            let mut vals = vec![0f32; (rows * d_in) as usize];
            let mut rng = Rng::stream(&[7, i as u64, 0]);
            matrix_values(&mut rng, &profile, &mut vals);
            Words {
                name: format!("blk.0.{name}.weight"),
                words: vals.iter().map(|&v| to_bf16(v)).collect(),
                d_out: rows,
                d_in,
            }
        })
        .collect()
}

/// A dense source's matrices (2-D tensors), as bf16.
fn model_matrices(path: &std::path::Path) -> BResult<Vec<Words>> {
    let b = backend::open(path, None).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (i, t) in b.tensors().entries().iter().enumerate() {
        if t.shape.len() != 2 || !t.is_available() {
            continue;
        }
        let vals = crate::encode::read_tensor(b.as_ref(), i).map_err(|e| e.to_string())?;
        out.push(Words {
            name: t.name.dot.clone(),
            words: vals.iter().map(|&v| to_bf16(v)).collect(),
            d_out: t.shape[0],
            d_in: t.shape[1],
        });
    }
    if out.is_empty() {
        return Err(format!("{}: no matrices", path.display()));
    }
    Ok(out)
}

/// Empirical entropy in bits of counts summing to `n`.
fn entropy(counts: impl Iterator<Item = u64>, n: u64) -> f64 {
    let n = n as f64;
    counts
        .filter(|&c| c > 0)
        .map(|c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum()
}

/// (word bound, split bound) in bytes of one tensor.
fn bounds(words: &[u16]) -> (f64, f64) {
    let mut word = vec![0u64; 1 << 16];
    let mut exp = [0u64; 256];
    for &w in words {
        word[usize::from(w)] += 1;
        exp[usize::from((w >> 7) & 0xff)] += 1;
    }
    let n = words.len() as u64;
    let hw = entropy(word.into_iter(), n);
    let he = entropy(exp.into_iter(), n);
    (hw * n as f64 / 8.0, (he + 8.0) * n as f64 / 8.0)
}

/// Bytes the seed's fp48 bi-sided packer makes of `payload`: each 8-byte
/// little-endian word split into its low 48 bits (6 bytes, stored raw) and
/// its high 16 bits, whose stream is run-length coded as (u16 value, u32
/// run) pairs of 6 bytes; a tail shorter than 8 bytes is stored raw.
pub fn fp48_bisided_bytes(payload: &[u8]) -> u64 {
    let words = payload.len() / 8;
    let mut runs = 0u64;
    let mut prev: Option<u16> = None;
    let mut run = 0u32;
    for w in payload.chunks_exact(8) {
        let hi = u16::from_le_bytes([w[6], w[7]]);
        if prev == Some(hi) && run < u32::MAX {
            run += 1;
        } else {
            runs += 1;
            prev = Some(hi);
            run = 1;
        }
    }
    6 * words as u64 + 6 * runs + (payload.len() % 8) as u64
}

/// One set's figures.
struct SetReport {
    values: u64,
    bf16_bytes: u64,
    coded_bytes: u64,
    word_bound: f64,
    split_bound: f64,
    fp48_bf16: u64,
    fp48_f32: u64,
    fp48_coded: u64,
    decode_cpu: Vec<f64>,
    memcpy_cpu: Vec<f64>,
}

fn bench_set(set: &[Words], rounds: usize) -> BResult<SetReport> {
    let mut r = SetReport {
        values: 0,
        bf16_bytes: 0,
        coded_bytes: 0,
        word_bound: 0.0,
        split_bound: 0.0,
        fp48_bf16: 0,
        fp48_f32: 0,
        fp48_coded: 0,
        decode_cpu: Vec::new(),
        memcpy_cpu: Vec::new(),
    };
    // Every tensor's blocks, with where each block's values go in the
    // set's output buffer.
    let mut blocks: Vec<(Vec<u8>, usize, usize)> = Vec::new();
    let mut at = 0usize;
    let mut reference: Vec<u16> = Vec::new();
    for t in set {
        let words: Vec<u32> = t.words.iter().map(|&w| u32::from(w)).collect();
        let coded = lossless_blocks(LosslessFloat::Bf16, &words, t.d_out, t.d_in);
        let (br, bc) = lossless_tile(t.d_out, t.d_in);
        if bc != t.d_in {
            return Err(format!("{}: rows wider than a tile", t.name));
        }
        // Whole-row tiles: block b holds rows [b*br, ..) contiguously.
        for (b, bytes) in coded.into_iter().enumerate() {
            let r0 = b as u64 * br;
            let n = ((br.min(t.d_out - r0)) * t.d_in) as usize;
            r.coded_bytes += bytes.len() as u64;
            r.fp48_coded += fp48_bisided_bytes(&bytes);
            blocks.push((bytes, at, n));
            at += n;
        }
        let (wb, sb) = bounds(&t.words);
        r.word_bound += wb;
        r.split_bound += sb;
        let bf16_bytes: Vec<u8> = t.words.iter().flat_map(|w| w.to_le_bytes()).collect();
        r.fp48_bf16 += fp48_bisided_bytes(&bf16_bytes);
        let f32_bytes: Vec<u8> = t
            .words
            .iter()
            .flat_map(|&w| (u32::from(w) << 16).to_le_bytes())
            .collect();
        r.fp48_f32 += fp48_bisided_bytes(&f32_bytes);
        r.values += t.words.len() as u64;
        reference.extend_from_slice(&t.words);
    }
    r.bf16_bytes = 2 * r.values;
    let mut out = vec![0u16; at];
    let mut dst = vec![0u16; at];
    for _ in 0..rounds.max(1) {
        let mut failed = None;
        let (c, _) = timed(|| {
            for (bytes, at, n) in &blocks {
                if let Err(e) = decode_lossless_bf16(bytes, &mut out[*at..*at + *n]) {
                    failed = Some(e.to_string());
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        r.decode_cpu.push(c);
        let (c, _) = timed(|| dst.copy_from_slice(&reference));
        r.memcpy_cpu.push(c);
        std::hint::black_box(&dst);
    }
    if out != reference {
        return Err("decoded words differ from the source's".into());
    }
    Ok(r)
}

fn write_set(o: &mut String, title: &str, r: &mut SetReport) {
    let pct = |x: f64| 100.0 * x / r.bf16_bytes as f64;
    let coded = r.coded_bytes as f64;
    let _ = writeln!(
        o,
        "{title}: {} values, {} bf16 bytes",
        r.values, r.bf16_bytes
    );
    let _ = writeln!(
        o,
        "  lossless .rknot blocks   {:>14} B  {:6.2}% of bf16",
        r.coded_bytes,
        pct(coded)
    );
    let _ = writeln!(
        o,
        "  order-0 bound (words)    {:>14.0} B  {:6.2}% of bf16; blocks are {:+.2}% of it",
        r.word_bound,
        pct(r.word_bound),
        100.0 * (coded / r.word_bound - 1.0)
    );
    let _ = writeln!(
        o,
        "  split bound (H(exp) + 8) {:>14.0} B  {:6.2}% of bf16; blocks are {:+.2}% of it",
        r.split_bound,
        pct(r.split_bound),
        100.0 * (coded / r.split_bound - 1.0)
    );
    let _ = writeln!(
        o,
        "  fp48 bi-sided: bf16 words {:.4}x, f32 words {:.4}x, lossless blocks {:.4}x \
         (original / packed; > 1 is a gain)",
        r.bf16_bytes as f64 / r.fp48_bf16 as f64,
        (2 * r.bf16_bytes) as f64 / r.fp48_f32 as f64,
        coded / r.fp48_coded as f64,
    );
    let dec = gbs(r.bf16_bytes, median(&mut r.decode_cpu));
    let cpy = gbs(r.bf16_bytes, median(&mut r.memcpy_cpu));
    let _ = writeln!(
        o,
        "  decode, 1 thread: {dec:.2} GB/s of bf16 output; memcpy of the same bytes {cpy:.2} GB/s \
         (decode = {:.2}x memcpy)",
        dec / cpy
    );
}

/// Run the benchmark; the report text.
pub fn lossless_bench(o: &LosslessBenchOpts) -> BResult<String> {
    if !(o.fraction > 0.0 && o.fraction <= 1.0) {
        return Err(format!("--fraction {} must be in (0, 1]", o.fraction));
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "rknot bench lossless: median of {} rounds (decode and memcpy by thread CPU time)",
        o.rounds.max(1)
    );
    let layer = synthetic_layer(o.fraction);
    let mut r = bench_set(&layer, o.rounds)?;
    drop(layer);
    write_set(
        &mut out,
        &format!(
            "synthetic 7B-shaped layer (Llama-2-7B shapes, {:.0}% of rows), bf16",
            o.fraction * 100.0
        ),
        &mut r,
    );
    let targets = r.coded_bytes as f64 <= 0.66 * r.bf16_bytes as f64
        && (r.coded_bytes as f64) <= 1.01 * r.word_bound;
    let _ = writeln!(
        out,
        "  targets (<= 66% of bf16, within 1% of the order-0 bound): {}",
        if targets { "met" } else { "NOT met" }
    );
    if let Some(m) = &o.model {
        let set = model_matrices(m)?;
        let mut r = bench_set(&set, o.rounds)?;
        write_set(
            &mut out,
            &format!(
                "{} matrices, rounded to bf16 (values from a quantized grid: not a realistic \
                 bf16 checkpoint)",
                m.display()
            ),
            &mut r,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp48_counts_runs_of_the_high_16_bits() {
        // Two words with the same high half: one run; then another.
        let mut p = Vec::new();
        for hi in [7u16, 7, 9] {
            p.extend_from_slice(&[1, 2, 3, 4, 5, 6]);
            p.extend_from_slice(&hi.to_le_bytes());
        }
        p.push(0xff);
        assert_eq!(fp48_bisided_bytes(&p), 18 + 12 + 1);
    }

    #[test]
    fn entropy_of_a_fair_coin_is_one_bit() {
        assert!((entropy([5u64, 5].into_iter(), 10) - 1.0).abs() < 1e-12);
    }
}
