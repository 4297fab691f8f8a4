//! Whole synthetic models: realistic values, real shapes, a streamed GGUF writer.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use super::vocab::{CHATML, TokenizerShape, llama3_specials, qwen2_specials, synth_vocab};
use super::{Rng, f16_bytes, quantize_q4_k, quantize_q6_k};
use crate::error::{ErrorKind, Result, err};
use crate::format::gguf::{DEFAULT_ALIGNMENT, encode_header};
use crate::format::meta::{MetaType, MetaValue, Metadata};
use crate::quant::GgmlType;

/// What a synthetic tensor's values look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// A weight matrix: see [`matrix_profile`] and [`matrix_values`].
    Matrix,
    /// A norm weight: `1 + 0.1 N(0, 1)`.
    Norm,
    /// A bias: `0.02 N(0, 1)`.
    Bias,
}

/// Fraction of a matrix's input channels that are outliers.
pub const OUTLIER_CHANNELS: f32 = 0.01;
/// Probability that an element is a heavy-tailed outlier.
pub const OUTLIER_ELEMENTS: f64 = 1e-3;
/// Elements per generation chunk (whole rows, at least one).
const CHUNK_ELEMS: u64 = 1 << 20;

/// The stream of a tensor's per-matrix parameters (chunks count from 0).
const PROFILE_STREAM: u64 = u64::MAX;

/// Per-input-channel standard deviations of a matrix with rows of `d_in`:
/// `factor / sqrt(d_in)` with a per-matrix factor uniform in [0.5, 1.5),
/// times a per-channel scale, `1 + 0.05 N(0, 1)` for most channels and
/// uniform in [4, 8) for [`OUTLIER_CHANNELS`] of them (real LLMs have a few
/// input channels of much larger magnitude).
pub fn matrix_profile(seed: u64, tensor: u64, d_in: usize) -> Vec<f32> {
    let mut rng = Rng::stream(&[seed, tensor, PROFILE_STREAM]);
    let sigma = (0.5 + rng.uniform()) / (d_in as f32).sqrt();
    let mut g = vec![0f32; d_in];
    rng.fill_gaussian(&mut g);
    g.iter()
        .map(|&g| {
            let ch = if rng.uniform() < OUTLIER_CHANNELS {
                4.0 + 4.0 * rng.uniform()
            } else {
                1.0 + 0.05 * g
            };
            sigma * ch
        })
        .collect()
}

/// Fill `out` (whole rows of `col_std.len()`) with Gaussian values of the
/// given per-column standard deviations, then make each element an outlier
/// with probability [`OUTLIER_ELEMENTS`]: multiplied by a magnitude
/// uniform in [5, 20) and a random sign.
pub fn matrix_values(rng: &mut Rng, col_std: &[f32], out: &mut [f32]) {
    rng.fill_gaussian(out);
    for row in out.chunks_mut(col_std.len()) {
        for (v, s) in row.iter_mut().zip(col_std) {
            *v *= s;
        }
    }
    let ln_q = (1.0 - OUTLIER_ELEMENTS).ln();
    let mut at = rng.geometric(ln_q);
    while at < out.len() {
        let k = 5.0 + 15.0 * rng.uniform();
        out[at] *= if rng.next_u64() >> 63 == 0 { k } else { -k };
        at = at.saturating_add(1).saturating_add(rng.geometric(ln_q));
    }
}

/// One tensor of a synthetic model: name, ggml-order dims (`[d_in,
/// d_out]` for a matrix), stored type and what its values look like.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub kind: ValueKind,
}

impl TensorPlan {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Rows per generation chunk: a function of the shape alone.
    pub fn chunk_rows(&self) -> u64 {
        (CHUNK_ELEMS / self.row_len()).max(1)
    }

    pub fn chunks(&self) -> u64 {
        (self.elements() / self.row_len()).div_ceil(self.chunk_rows())
    }
}

/// Store `values` as `ty` (F32, F16, Q4_K or Q6_K).
pub fn encode_values(ty: GgmlType, values: &[f32], out: &mut Vec<u8>) -> Result<()> {
    match ty {
        GgmlType::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => out.extend(values.iter().flat_map(|v| f16_bytes(*v))),
        GgmlType::Q4K => quantize_q4_k(values, out),
        GgmlType::Q6K => quantize_q6_k(values, out),
        other => {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!("synthetic tensors are F32, F16, Q4_K or Q6_K, not {other}"),
            ));
        }
    }
    Ok(())
}

/// The values of chunk `chunk` of tensor number `index` (`profile`: its
/// [`matrix_profile`], for matrices), from its own generator
/// `[seed, index, chunk]`.
pub fn chunk_values(
    seed: u64,
    index: u64,
    plan: &TensorPlan,
    profile: &[f32],
    chunk: u64,
) -> Vec<f32> {
    let (row_len, rows) = (plan.row_len(), plan.elements() / plan.row_len());
    let r0 = chunk * plan.chunk_rows();
    let r1 = (r0 + plan.chunk_rows()).min(rows);
    let mut v = vec![0f32; (r1.saturating_sub(r0) * row_len) as usize];
    let mut rng = Rng::stream(&[seed, index, chunk]);
    match plan.kind {
        ValueKind::Matrix => matrix_values(&mut rng, profile, &mut v),
        ValueKind::Norm => {
            rng.fill_gaussian(&mut v);
            v.iter_mut().for_each(|x| *x = 1.0 + 0.1 * *x);
        }
        ValueKind::Bias => {
            rng.fill_gaussian(&mut v);
            v.iter_mut().for_each(|x| *x *= 0.02);
        }
    }
    v
}

/// Generate, encode and write tensor number `index`, a few chunks at a
/// time in parallel; returns the bytes written. Memory in use is a few
/// chunks per thread, whatever the tensor's size.
pub fn write_tensor<W: Write>(w: &mut W, seed: u64, index: u64, plan: &TensorPlan) -> Result<u64> {
    let profile = match plan.kind {
        ValueKind::Matrix => matrix_profile(seed, index, plan.row_len() as usize),
        _ => Vec::new(),
    };
    let chunks = plan.chunks();
    let batch = (2 * rayon::current_num_threads()).max(1) as u64;
    let mut written = 0u64;
    let mut k = 0;
    while k < chunks {
        let end = (k + batch).min(chunks);
        let bufs: Vec<Result<Vec<u8>>> = (k..end)
            .into_par_iter()
            .map(|c| {
                let v = chunk_values(seed, index, plan, &profile, c);
                let mut out = Vec::new();
                encode_values(plan.ty, &v, &mut out)?;
                Ok(out)
            })
            .collect();
        for b in bufs {
            let b = b.map_err(|e| e.tensor(&plan.name))?;
            w.write_all(&b).map_err(io_err("writing tensor data"))?;
            written += b.len() as u64;
        }
        k = end;
    }
    Ok(written)
}

fn io_err(what: &'static str) -> impl Fn(std::io::Error) -> crate::error::Error {
    move |e| err(ErrorKind::Io, format!("{what}: {e}"))
}

// -- model shapes -------------------------------------------------------

/// A model's hyper-parameters and tokenizer layout.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// `qwen2.5-7b`, `llama3-70b`, `tiny`.
    pub name: &'static str,
    /// `general.architecture`.
    pub arch: &'static str,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub context: u64,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// Q/K/V biases (Qwen2).
    pub qkv_bias: bool,
    pub tokenizer: TokenizerShape,
}

/// The shapes [`model_shape`] knows.
pub const SHAPES: &[&str] = &["qwen2.5-7b", "llama3-70b", "tiny"];

/// A named shape with its real number of layers.
pub fn model_shape(name: &str) -> Option<ModelShape> {
    Some(match name {
        "qwen2.5-7b" => ModelShape {
            name: "qwen2.5-7b",
            arch: "qwen2",
            layers: 28,
            hidden: 3584,
            heads: 28,
            kv_heads: 4,
            ffn: 18944,
            vocab: 152064,
            context: 32768,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            qkv_bias: true,
            tokenizer: TokenizerShape {
                pre: "qwen2",
                regular: 151643,
                merges: 151387,
                specials: qwen2_specials(true),
                bos: 151643,
                eos: 151645,
                padding: Some(151643),
                add_bos: false,
                chat_template: Some(CHATML),
            },
        },
        "llama3-70b" => ModelShape {
            name: "llama3-70b",
            arch: "llama",
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            vocab: 128256,
            context: 8192,
            rope_theta: 500_000.0,
            rms_eps: 1e-5,
            qkv_bias: false,
            tokenizer: TokenizerShape {
                pre: "llama-bpe",
                regular: 128000,
                merges: 280147,
                specials: llama3_specials(),
                bos: 128000,
                eos: 128001,
                padding: None,
                add_bos: true,
                chat_template: None,
            },
        },
        "tiny" => ModelShape {
            name: "tiny",
            arch: "qwen2",
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            ffn: 512,
            vocab: 1000,
            context: 4096,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            qkv_bias: true,
            tokenizer: TokenizerShape {
                pre: "qwen2",
                regular: 997,
                merges: 741,
                specials: qwen2_specials(false),
                bos: 997,
                eos: 999,
                padding: Some(997),
                add_bos: false,
                chat_template: Some(CHATML),
            },
        },
        _ => return None,
    })
}

/// llama.cpp's `use_more_bits(i, n)`: the layers whose `attn_v` and
/// `ffn_down` Q4_K_M stores as Q6_K.
pub fn use_more_bits(i: u64, n: u64) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The tensors of a shape in llama.cpp's order, typed as its Q4_K_M
/// quantization does: matrices Q4_K; `output.weight`, and `attn_v` /
/// `ffn_down` on [`use_more_bits`] layers, Q6_K; norms and biases F32.
pub fn model_tensors(s: &ModelShape) -> Vec<TensorPlan> {
    use GgmlType::{F32, Q4K, Q6K};
    use ValueKind::{Bias, Matrix, Norm};
    let head_dim = s.hidden / s.heads;
    let (qd, kv) = (s.heads * head_dim, s.kv_heads * head_dim);
    let t = |name: String, dims: Vec<u64>, ty, kind| TensorPlan {
        name,
        dims,
        ty,
        kind,
    };
    let mut out = vec![t(
        "token_embd.weight".into(),
        vec![s.hidden, s.vocab],
        Q4K,
        Matrix,
    )];
    for l in 0..s.layers {
        let n = |p: &str| format!("blk.{l}.{p}");
        let more = if use_more_bits(l, s.layers) { Q6K } else { Q4K };
        out.push(t(n("attn_norm.weight"), vec![s.hidden], F32, Norm));
        out.push(t(n("attn_q.weight"), vec![s.hidden, qd], Q4K, Matrix));
        if s.qkv_bias {
            out.push(t(n("attn_q.bias"), vec![qd], F32, Bias));
        }
        out.push(t(n("attn_k.weight"), vec![s.hidden, kv], Q4K, Matrix));
        if s.qkv_bias {
            out.push(t(n("attn_k.bias"), vec![kv], F32, Bias));
        }
        out.push(t(n("attn_v.weight"), vec![s.hidden, kv], more, Matrix));
        if s.qkv_bias {
            out.push(t(n("attn_v.bias"), vec![kv], F32, Bias));
        }
        out.extend([
            t(n("attn_output.weight"), vec![qd, s.hidden], Q4K, Matrix),
            t(n("ffn_norm.weight"), vec![s.hidden], F32, Norm),
            t(n("ffn_gate.weight"), vec![s.hidden, s.ffn], Q4K, Matrix),
            t(n("ffn_up.weight"), vec![s.hidden, s.ffn], Q4K, Matrix),
            t(n("ffn_down.weight"), vec![s.ffn, s.hidden], more, Matrix),
        ]);
    }
    out.push(t("output_norm.weight".into(), vec![s.hidden], F32, Norm));
    out.push(t(
        "output.weight".into(),
        vec![s.hidden, s.vocab],
        Q6K,
        Matrix,
    ));
    out
}

/// The model's key/values, tokenizer included, as a llama.cpp Q4_K_M file
/// of this shape would have them.
pub fn model_metadata(s: &ModelShape) -> Metadata {
    let mut md = Metadata::default();
    let str_ = |v: &str| MetaValue::String(v.into());
    let u = |v: u64| MetaValue::U32(v as u32);
    let k = |key: &str| format!("{}.{key}", s.arch);
    md.push("general.architecture", str_(s.arch));
    md.push("general.type", str_("model"));
    md.push(
        "general.name",
        str_(&format!(
            "rknot synthetic {} (random weights, {} blocks)",
            s.name, s.layers
        )),
    );
    md.push(k("block_count"), u(s.layers));
    md.push(k("context_length"), u(s.context));
    md.push(k("embedding_length"), u(s.hidden));
    md.push(k("feed_forward_length"), u(s.ffn));
    md.push(k("attention.head_count"), u(s.heads));
    md.push(k("attention.head_count_kv"), u(s.kv_heads));
    md.push(k("rope.freq_base"), MetaValue::F32(s.rope_theta));
    md.push(
        k("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(s.rms_eps),
    );
    if s.arch == "llama" {
        md.push(k("rope.dimension_count"), u(s.hidden / s.heads));
        md.push(k("vocab_size"), u(s.vocab));
    }
    md.push("general.file_type", u(15)); // LLAMA_FTYPE_MOSTLY_Q4_K_M
    let t = &s.tokenizer;
    let vocab = synth_vocab(t, s.vocab);
    md.push("tokenizer.ggml.model", str_("gpt2"));
    md.push("tokenizer.ggml.pre", str_(t.pre));
    let strings = |v: Vec<String>| MetaValue::Array {
        elem: MetaType::String,
        values: v.into_iter().map(MetaValue::String).collect(),
    };
    md.push("tokenizer.ggml.tokens", strings(vocab.tokens));
    md.push(
        "tokenizer.ggml.token_type",
        MetaValue::Array {
            elem: MetaType::I32,
            values: vocab.types.into_iter().map(MetaValue::I32).collect(),
        },
    );
    md.push("tokenizer.ggml.merges", strings(vocab.merges));
    md.push("tokenizer.ggml.bos_token_id", u(u64::from(t.bos)));
    md.push("tokenizer.ggml.eos_token_id", u(u64::from(t.eos)));
    if let Some(p) = t.padding {
        md.push("tokenizer.ggml.padding_token_id", u(u64::from(p)));
    }
    md.push("tokenizer.ggml.add_bos_token", MetaValue::Bool(t.add_bos));
    if let Some(ct) = t.chat_template {
        md.push("tokenizer.chat_template", str_(ct));
    }
    md.push("general.quantization_version", u(2));
    md
}

/// What [`write_model`] wrote.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    pub path: PathBuf,
    pub tensors: usize,
    pub parameters: u64,
    pub header_bytes: u64,
    /// The file's length (sparse: mostly a hole).
    pub bytes: u64,
}

/// Write a synthetic GGUF of shape `s` (with `s.layers` blocks) to `path`:
/// the header, then every tensor generated and quantized in parallel row
/// chunks and written in turn, so memory stays at a few chunks per thread.
/// `sparse`: the header only, the data section a hole (every tensor then
/// decodes to zeros). Written to a temporary file in the same directory,
/// synced and renamed into place; an existing `path` is an error unless
/// `force`. `progress`: a line to stderr every ten tensors.
pub fn write_model(
    path: &Path,
    s: &ModelShape,
    seed: u64,
    sparse: bool,
    force: bool,
    progress: bool,
) -> Result<ModelSummary> {
    if !force && path.symlink_metadata().is_ok() {
        return Err(err(
            ErrorKind::Io,
            format!("{} exists (pass --force to replace it)", path.display()),
        ));
    }
    let plans = model_tensors(s);
    let shapes: Vec<(String, Vec<u64>, GgmlType)> = plans
        .iter()
        .map(|p| (p.name.clone(), p.dims.clone(), p.ty))
        .collect();
    let (header, offsets) = encode_header(&model_metadata(s), &shapes, DEFAULT_ALIGNMENT)?;
    let mut end = 0u64;
    for (p, off) in plans.iter().zip(&offsets) {
        end = end.max(off + p.ty.bytes_for(p.elements()).unwrap_or(0));
    }
    let size = header.len() as u64 + end.next_multiple_of(DEFAULT_ALIGNMENT);

    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| err(ErrorKind::Io, format!("{}: no file name", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    /// Removes the temporary file unless it was renamed into place.
    struct Tmp<'a>(&'a Path, bool);
    impl Drop for Tmp<'_> {
        fn drop(&mut self) {
            if !self.1 {
                let _ = std::fs::remove_file(self.0);
            }
        }
    }
    let mut guard = Tmp(&tmp, false);
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| err(ErrorKind::Io, format!("creating {}: {e}", tmp.display())))?;
    f.write_all(&header).map_err(io_err("writing the header"))?;
    let t0 = Instant::now();
    let parameters: u64 = plans.iter().map(TensorPlan::elements).sum();
    if !sparse {
        let mut pos = 0u64;
        let mut done = 0u64;
        for (i, (p, &off)) in plans.iter().zip(&offsets).enumerate() {
            f.write_all(&vec![0u8; (off - pos) as usize])
                .map_err(io_err("writing padding"))?;
            pos = off + write_tensor(&mut f, seed, i as u64, p)?;
            done += p.elements();
            if progress && ((i + 1) % 10 == 0 || i + 1 == plans.len()) {
                eprintln!(
                    "[{:>4}/{}] {:<28} {:5.1}% of parameters, {:.1} s",
                    i + 1,
                    plans.len(),
                    p.name,
                    100.0 * done as f64 / parameters as f64,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        f.write_all(&vec![
            0u8;
            (end.next_multiple_of(DEFAULT_ALIGNMENT) - pos)
                as usize
        ])
        .map_err(io_err("writing padding"))?;
    }
    // Sparse: the data section stays a hole.
    f.set_len(size).map_err(io_err("setting the file length"))?;
    f.sync_all().map_err(io_err("syncing"))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| {
        err(
            ErrorKind::Io,
            format!("renaming {} to {}: {e}", tmp.display(), path.display()),
        )
    })?;
    guard.1 = true;
    Ok(ModelSummary {
        path: path.to_path_buf(),
        tensors: plans.len(),
        parameters,
        header_bytes: header.len() as u64,
        bytes: size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::model_metadata;

    #[test]
    fn values_do_not_depend_on_threads() {
        let plan = TensorPlan {
            name: "w".into(),
            dims: vec![256, 9000], // 3 chunks, the last one short
            ty: GgmlType::Q4K,
            kind: ValueKind::Matrix,
        };
        assert_eq!(plan.chunks(), 3);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut out = Vec::new();
                write_tensor(&mut out, 42, 5, &plan).unwrap();
                out
            })
        };
        let one = run(1);
        assert_eq!(
            one.len() as u64,
            GgmlType::Q4K.bytes_for(256 * 9000).unwrap()
        );
        assert_eq!(one, run(3));
        let mut other = Vec::new();
        write_tensor(&mut other, 43, 5, &plan).unwrap();
        assert_ne!(one, other, "the seed matters");
    }

    #[test]
    fn matrix_statistics() {
        let d_in = 2048;
        let profile = matrix_profile(1, 2, d_in);
        let outliers = profile
            .iter()
            .filter(|&&s| s > 2.5 * profile[0].min(profile[1]))
            .count();
        assert!((5..60).contains(&outliers), "{outliers} outlier channels");
        let mut x = vec![0f32; d_in * 512];
        matrix_values(&mut Rng::stream(&[1]), &profile, &mut x);
        let n_big = x
            .iter()
            .enumerate()
            .filter(|(i, v)| v.abs() > 4.9 * profile[i % d_in])
            .count();
        let expect = (x.len() as f64 * OUTLIER_ELEMENTS) as usize;
        assert!(
            n_big > expect / 2 && n_big < expect * 2,
            "{n_big} vs {expect}"
        );
        let std = (x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
        let base = 1.0 / (d_in as f64).sqrt();
        assert!(std > 0.4 * base && std < 3.0 * base, "std {std}");
    }

    #[test]
    fn llama_cpp_q4_k_m_types() {
        let s = model_shape("qwen2.5-7b").unwrap();
        let t = model_tensors(&s);
        assert_eq!(t.len(), 339);
        let more: Vec<u64> = (0..28).filter(|&i| use_more_bits(i, 28)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        let ty = |n: &str| t.iter().find(|p| p.name == n).unwrap().ty;
        assert_eq!(ty("blk.5.attn_v.weight"), GgmlType::Q6K);
        assert_eq!(ty("blk.6.ffn_down.weight"), GgmlType::Q4K);
        assert_eq!(ty("output.weight"), GgmlType::Q6K);
        assert_eq!(ty("token_embd.weight"), GgmlType::Q4K);
        assert_eq!(ty("blk.0.attn_q.bias"), GgmlType::F32);
        let params: u64 = t.iter().map(TensorPlan::elements).sum();
        assert_eq!(params, 7_615_616_512);
        let l = model_shape("llama3-70b").unwrap();
        let t = model_tensors(&l);
        assert_eq!(t.len(), 1 + 80 * 9 + 2);
        assert_eq!(
            t.iter().map(TensorPlan::elements).sum::<u64>(),
            70_553_706_496
        );
    }

    #[test]
    fn vocab_tokenizes_english() {
        use crate::probe::tokenizer::Tokenizer;
        let s = model_shape("tiny").unwrap();
        let md = model_metadata(&s);
        let v = synth_vocab(&s.tokenizer, s.vocab);
        assert_eq!(v.tokens.len(), 1000);
        assert_eq!(v.merges.len(), 741);
        let tok = Tokenizer::from_metadata(&md).unwrap();
        let text = "The capital of France is";
        let ids = tok.encode(text, true, true);
        assert!(ids.len() <= 6, "{ids:?}");
        assert_eq!(tok.decode(&ids), text);
        let odd = "naïve café — 東京 🎉 x=3.14\n";
        assert_eq!(tok.decode(&tok.encode(odd, false, false)), odd);
        assert_eq!(tok.encode("<|im_end|>", true, false), [999]);
    }

    #[test]
    fn tiny_model_file() {
        use crate::format::gguf::GgufFile;
        use crate::source::SourceFile;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let s = model_shape("tiny").unwrap();
        let sum = write_model(&path, &s, 1, false, false, false).unwrap();
        assert!(write_model(&path, &s, 1, false, false, false).is_err());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), sum.bytes);
        let src = SourceFile::open(&path).unwrap();
        let g = GgufFile::read(&src).unwrap();
        assert_eq!(g.tensors.len(), sum.tensors);
        let again = dir.path().join("again.gguf");
        write_model(&again, &s, 1, false, false, false).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&again).unwrap()
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            2,
            "no temp files left"
        );
    }
}
