//! A llama-architecture decoder in fp32 (and qwen2, which adds Q/K/V
//! biases and rotates the other RoPE pairs): RMSNorm, RoPE, grouped-query
//! attention with a KV cache, SwiGLU feed-forward, tied or separate output
//! head. Hyper-parameters come from the GGUF key/values, weights from a
//! [`WeightSource`], i.e. the bytes the mount serves.

use std::collections::HashMap;
use std::ops::Range;

use rayon::prelude::*;

use super::linalg::{dot, matmul_t, rms_norm, softmax, swiglu};
use super::weights::WeightSource;
use crate::error::{ErrorKind, Result, err};
use crate::format::meta::{MetaValue, Metadata};

/// The architectures this probe runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
}

/// Hyper-parameters, from `<arch>.*` keys and the tensor shapes.
#[derive(Debug, Clone)]
pub struct Config {
    pub arch: Arch,
    pub arch_name: String,
    pub n_layer: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates.
    pub n_rot: usize,
    pub rope_base: f64,
    /// Linear RoPE scaling: positions are multiplied by this.
    pub rope_pos_scale: f64,
    /// GPT-NeoX RoPE (pairs `i`, `i + n_rot/2`) instead of GPT-J/llama
    /// (pairs `2i`, `2i+1`), as llama.cpp's rope type for the arch says.
    pub rope_neox: bool,
    pub rms_eps: f32,
    pub n_vocab: usize,
    /// No `output.weight`: the output head is `token_embd.weight`.
    pub tied_embeddings: bool,
}

fn key_missing(key: &str) -> crate::error::Error {
    err(
        ErrorKind::BadValue,
        format!("model metadata: key {key:?} is missing or not a number"),
    )
}

fn get_u(md: &Metadata, key: &str) -> Result<usize> {
    md.get(key)
        .and_then(MetaValue::as_u64)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| key_missing(key))
}

fn get_f(md: &Metadata, key: &str) -> Option<f64> {
    md.get(key).and_then(MetaValue::as_f64)
}

impl Config {
    pub fn from_metadata(md: &Metadata) -> Result<Config> {
        let arch_name = md
            .architecture()
            .ok_or_else(|| {
                err(
                    ErrorKind::BadValue,
                    "model metadata: key \"general.architecture\" is missing",
                )
            })?
            .to_string();
        let (arch, rope_neox) = match arch_name.as_str() {
            "llama" => (Arch::Llama, false),
            "qwen2" => (Arch::Qwen2, true),
            other => {
                return Err(err(
                    ErrorKind::UnsupportedType,
                    format!(
                        "general.architecture is {other:?}; the probe runs \"llama\" and \"qwen2\""
                    ),
                ));
            }
        };
        let k = |s: &str| format!("{arch_name}.{s}");
        if md
            .get(&k("expert_count"))
            .and_then(MetaValue::as_u64)
            .unwrap_or(0)
            > 0
        {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!(
                    "{} > 0: mixture-of-experts models are not supported",
                    k("expert_count")
                ),
            ));
        }
        let n_layer = get_u(md, &k("block_count"))?;
        let d_model = get_u(md, &k("embedding_length"))?;
        let d_ff = get_u(md, &k("feed_forward_length"))?;
        let n_head = get_u(md, &k("attention.head_count"))?;
        let n_head_kv = match md.get(&k("attention.head_count_kv")) {
            Some(_) => get_u(md, &k("attention.head_count_kv"))?,
            None => n_head,
        };
        if n_layer == 0 || d_model == 0 || d_ff == 0 || n_head == 0 || n_head_kv == 0 {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "model metadata: {} {n_layer}, {} {d_model}, {} {d_ff}, {} {n_head}, {} {n_head_kv}: none may be 0",
                    k("block_count"),
                    k("embedding_length"),
                    k("feed_forward_length"),
                    k("attention.head_count"),
                    k("attention.head_count_kv")
                ),
            ));
        }
        if n_head % n_head_kv != 0 || n_head_kv > n_head {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "{} = {n_head} is not a multiple of {} = {n_head_kv}",
                    k("attention.head_count"),
                    k("attention.head_count_kv")
                ),
            ));
        }
        let head_dim = match md.get(&k("attention.key_length")) {
            Some(_) => get_u(md, &k("attention.key_length"))?,
            None if d_model % n_head == 0 => d_model / n_head,
            None => {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "{} = {d_model} is not a multiple of {} = {n_head} and {} is absent",
                        k("embedding_length"),
                        k("attention.head_count"),
                        k("attention.key_length")
                    ),
                ));
            }
        };
        // Products of these size every buffer: refuse values whose products
        // overflow (the tensor shapes are checked against them later).
        let qkv = n_head
            .checked_add(n_head_kv)
            .and_then(|h| h.checked_add(n_head_kv))
            .and_then(|h| h.checked_mul(head_dim))
            .and_then(|q| q.checked_mul(d_model));
        let ffn = d_ff.checked_mul(2).and_then(|f| f.checked_mul(d_model));
        if qkv.is_none() || ffn.is_none() {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "model metadata: heads {n_head}/{n_head_kv} x {head_dim}, d {d_model}, ffn {d_ff}: \
                     sizes overflow"
                ),
            ));
        }
        let n_rot = match md.get(&k("rope.dimension_count")) {
            Some(_) => get_u(md, &k("rope.dimension_count"))?,
            None => head_dim,
        };
        if n_rot > head_dim || n_rot % 2 != 0 || head_dim == 0 {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "{} = {n_rot} must be even and at most the head size {head_dim}",
                    k("rope.dimension_count")
                ),
            ));
        }
        // llama.cpp's default when the key is absent.
        let rope_base = get_f(md, &k("rope.freq_base")).unwrap_or(10000.0);
        let rope_pos_scale = match md.get(&k("rope.scaling.type")).and_then(MetaValue::as_str) {
            None | Some("none") => 1.0,
            Some("linear") => {
                let f = get_f(md, &k("rope.scaling.factor")).unwrap_or(1.0);
                if f > 0.0 { 1.0 / f } else { 1.0 }
            }
            Some(other) => {
                return Err(err(
                    ErrorKind::UnsupportedType,
                    format!(
                        "{} = {other:?} is not supported (none, linear)",
                        k("rope.scaling.type")
                    ),
                ));
            }
        };
        let rms_eps = get_f(md, &k("attention.layer_norm_rms_epsilon"))
            .ok_or_else(|| key_missing(&k("attention.layer_norm_rms_epsilon")))?
            as f32;
        if !(rope_base.is_finite() && rope_base > 0.0 && rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "{} = {rope_base} / {} = {rms_eps}: out of range",
                    k("rope.freq_base"),
                    k("attention.layer_norm_rms_epsilon")
                ),
            ));
        }
        Ok(Config {
            arch,
            arch_name,
            n_layer,
            d_model,
            d_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_base,
            rope_pos_scale,
            rope_neox,
            rms_eps,
            n_vocab: 0,
            tied_embeddings: false,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn summary(&self) -> String {
        format!(
            "{}: {} layers, d {}, ffn {}, heads {}/{} (head {}, rope {} dims base {} {}), vocab {}{}",
            self.arch_name,
            self.n_layer,
            self.d_model,
            self.d_ff,
            self.n_head,
            self.n_head_kv,
            self.head_dim,
            self.n_rot,
            self.rope_base,
            if self.rope_neox { "neox" } else { "normal" },
            self.n_vocab,
            if self.tied_embeddings {
                ", tied embeddings"
            } else {
                ""
            }
        )
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V projections stacked: `[q_dim + 2 kv_dim, d_model]`, so
    /// one pass over the activations computes all three.
    wqkv: Vec<f32>,
    bqkv: Option<Vec<f32>>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    /// Gate and up stacked: `[2 d_ff, d_model]`.
    w_gate_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// Loaded weights, all fp32.
pub struct Model {
    pub config: Config,
    tok_embd: Vec<f32>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    output: Option<Vec<f32>>,
    /// Per rotated pair: the angle per position, `base^(-2i/n_rot) ·
    /// scale / freq_factor_i`.
    inv_freq: Vec<f64>,
    /// Tensor names read, for bits-per-weight reports.
    pub tensor_names: Vec<String>,
}

/// Per-layer keys and values of the positions seen so far.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(cfg: &Config) -> KvCache {
        KvCache {
            k: vec![Vec::new(); cfg.n_layer],
            v: vec![Vec::new(); cfg.n_layer],
            len: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            x.clear();
        }
        self.len = 0;
    }
}

/// One tensor to load: name, expected served shape, destination.
struct Job<'a> {
    name: String,
    shape: Vec<u64>,
    out: &'a mut [f32],
}

/// A zeroed buffer of `rows × cols` floats, or an error instead of an
/// abort when the size does not fit or memory is short.
fn zeros(rows: usize, cols: usize, what: &str) -> Result<Vec<f32>> {
    let too_large = || {
        err(
            ErrorKind::TooLarge,
            format!("cannot allocate {rows} × {cols} floats for {what}"),
        )
    };
    let n = rows.checked_mul(cols).ok_or_else(too_large)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| too_large())?;
    v.resize(n, 0.0);
    Ok(v)
}

fn check_shape(src: &dyn WeightSource, name: &str, want: &[u64]) -> Result<()> {
    let got = src.shape(name).ok_or_else(|| {
        err(
            ErrorKind::NotFound,
            format!(
                "tensor {name:?} is missing (needed by the {}-element layer)",
                want.iter().product::<u64>()
            ),
        )
        .tensor(name)
    })?;
    if got != want {
        return Err(err(
            ErrorKind::ShapeMismatch,
            format!("served shape {got:?}, the model's key/values say {want:?}"),
        )
        .tensor(name));
    }
    Ok(())
}

impl Model {
    /// Read every weight the forward pass needs from `src`, checking each
    /// served shape against the hyper-parameters. Tensors load in parallel
    /// on the current rayon pool.
    pub fn load(src: &dyn WeightSource) -> Result<Model> {
        let mut cfg = Config::from_metadata(src.metadata())?;
        let (d, ff, qd, kvd) = (cfg.d_model, cfg.d_ff, cfg.q_dim(), cfg.kv_dim());
        let embd_shape = src.shape("token_embd.weight").ok_or_else(|| {
            err(
                ErrorKind::NotFound,
                "tensor \"token_embd.weight\" is missing",
            )
            .tensor("token_embd.weight")
        })?;
        let n_vocab = match embd_shape.as_slice() {
            [v, dd] if *dd == d as u64 && *v > 0 => usize::try_from(*v).map_err(|_| {
                err(ErrorKind::TooLarge, "vocab does not fit in memory").tensor("token_embd.weight")
            })?,
            other => {
                return Err(err(
                    ErrorKind::ShapeMismatch,
                    format!("served shape {other:?}, expected [n_vocab, {d}]"),
                )
                .tensor("token_embd.weight"));
            }
        };
        cfg.n_vocab = n_vocab;
        cfg.tied_embeddings = src.shape("output.weight").is_none();
        let has_bias = src.shape("blk.0.attn_q.bias").is_some();

        let (d64, ff64, qd64, kvd64, v64) =
            (d as u64, ff as u64, qd as u64, kvd as u64, n_vocab as u64);
        // Check every shape before allocating or decoding anything: a
        // wrong file fails fast and names the first bad tensor.
        let mut plan = vec![
            ("token_embd.weight".to_string(), vec![v64, d64]),
            ("output_norm.weight".to_string(), vec![d64]),
        ];
        if !cfg.tied_embeddings {
            plan.push(("output.weight".to_string(), vec![v64, d64]));
        }
        let mut checked = 0;
        for i in 0..cfg.n_layer {
            // Checked as listed, so a block_count larger than the file's
            // layers stops at the first missing one.
            for (name, shape) in &plan[checked..] {
                check_shape(src, name, shape)?;
            }
            checked = plan.len();
            let p = |s: &str| format!("blk.{i}.{s}");
            plan.extend([
                (p("attn_norm.weight"), vec![d64]),
                (p("attn_q.weight"), vec![qd64, d64]),
                (p("attn_k.weight"), vec![kvd64, d64]),
                (p("attn_v.weight"), vec![kvd64, d64]),
                (p("attn_output.weight"), vec![d64, qd64]),
                (p("ffn_norm.weight"), vec![d64]),
                (p("ffn_gate.weight"), vec![ff64, d64]),
                (p("ffn_up.weight"), vec![ff64, d64]),
                (p("ffn_down.weight"), vec![d64, ff64]),
            ]);
            if has_bias {
                plan.extend([
                    (p("attn_q.bias"), vec![qd64]),
                    (p("attn_k.bias"), vec![kvd64]),
                    (p("attn_v.bias"), vec![kvd64]),
                ]);
            }
        }
        for (name, shape) in &plan[checked..] {
            check_shape(src, name, shape)?;
        }

        let qkv = qd + 2 * kvd;
        let mut tok_embd = zeros(n_vocab, d, "token_embd.weight")?;
        let mut out_norm = zeros(1, d, "output_norm.weight")?;
        let mut output = match cfg.tied_embeddings {
            true => None,
            false => Some(zeros(n_vocab, d, "output.weight")?),
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            layers.push(Layer {
                attn_norm: zeros(1, d, "attn_norm")?,
                wqkv: zeros(qkv, d, "attn_q/k/v")?,
                bqkv: if has_bias {
                    Some(zeros(1, qkv, "attn biases")?)
                } else {
                    None
                },
                wo: zeros(d, qd, "attn_output")?,
                ffn_norm: zeros(1, d, "ffn_norm")?,
                w_gate_up: zeros(2 * ff, d, "ffn_gate/up")?,
                w_down: zeros(d, ff, "ffn_down")?,
            });
        }

        let mut jobs: Vec<Job> = vec![
            Job {
                name: "token_embd.weight".into(),
                shape: vec![v64, d64],
                out: &mut tok_embd,
            },
            Job {
                name: "output_norm.weight".into(),
                shape: vec![d64],
                out: &mut out_norm,
            },
        ];
        if let Some(o) = output.as_mut() {
            jobs.push(Job {
                name: "output.weight".into(),
                shape: vec![v64, d64],
                out: o,
            });
        }
        for (i, l) in layers.iter_mut().enumerate() {
            let p = |s: &str| format!("blk.{i}.{s}");
            let (q, rest) = l.wqkv.split_at_mut(qd * d);
            let (k, v) = rest.split_at_mut(kvd * d);
            let (gate, up) = l.w_gate_up.split_at_mut(ff * d);
            jobs.extend([
                Job {
                    name: p("attn_norm.weight"),
                    shape: vec![d64],
                    out: &mut l.attn_norm,
                },
                Job {
                    name: p("attn_q.weight"),
                    shape: vec![qd64, d64],
                    out: q,
                },
                Job {
                    name: p("attn_k.weight"),
                    shape: vec![kvd64, d64],
                    out: k,
                },
                Job {
                    name: p("attn_v.weight"),
                    shape: vec![kvd64, d64],
                    out: v,
                },
                Job {
                    name: p("attn_output.weight"),
                    shape: vec![d64, qd64],
                    out: &mut l.wo,
                },
                Job {
                    name: p("ffn_norm.weight"),
                    shape: vec![d64],
                    out: &mut l.ffn_norm,
                },
                Job {
                    name: p("ffn_gate.weight"),
                    shape: vec![ff64, d64],
                    out: gate,
                },
                Job {
                    name: p("ffn_up.weight"),
                    shape: vec![ff64, d64],
                    out: up,
                },
                Job {
                    name: p("ffn_down.weight"),
                    shape: vec![d64, ff64],
                    out: &mut l.w_down,
                },
            ]);
            if let Some(b) = l.bqkv.as_mut() {
                let (bq, rest) = b.split_at_mut(qd);
                let (bk, bv) = rest.split_at_mut(kvd);
                jobs.extend([
                    Job {
                        name: p("attn_q.bias"),
                        shape: vec![qd64],
                        out: bq,
                    },
                    Job {
                        name: p("attn_k.bias"),
                        shape: vec![kvd64],
                        out: bk,
                    },
                    Job {
                        name: p("attn_v.bias"),
                        shape: vec![kvd64],
                        out: bv,
                    },
                ]);
            }
        }
        // The jobs must be exactly the plan that was checked: a shorter
        // destination would silently read only a prefix of a tensor.
        let planned: HashMap<&str, &[u64]> = plan
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        for j in &jobs {
            let fits = planned.get(j.name.as_str()) == Some(&j.shape.as_slice())
                && j.shape.iter().product::<u64>() == j.out.len() as u64;
            if !fits || jobs.len() != plan.len() {
                return Err(err(
                    ErrorKind::BadShape,
                    format!("internal: load plan and buffers disagree at {}", j.name),
                ));
            }
        }
        let tensor_names: Vec<String> = jobs.iter().map(|j| j.name.clone()).collect();
        jobs.par_iter_mut()
            .try_for_each(|j| src.read_into(&j.name, j.out))?;
        drop(jobs);

        // Llama 3 style per-pair frequency factors, when the file has them.
        let half = cfg.n_rot / 2;
        let mut freq_factors = vec![1f32; half];
        if src.shape("rope_freqs.weight").is_some() {
            check_shape(src, "rope_freqs.weight", &[half as u64])?;
            src.read_into("rope_freqs.weight", &mut freq_factors)?;
        }
        let inv_freq = (0..half)
            .map(|i| {
                cfg.rope_base.powf(-2.0 * i as f64 / cfg.n_rot as f64) * cfg.rope_pos_scale
                    / f64::from(freq_factors[i])
            })
            .collect();
        let bad = layers
            .iter()
            .flat_map(|l| [&l.attn_norm, &l.ffn_norm])
            .chain([&out_norm])
            .any(|w| w.iter().any(|v| !v.is_finite()));
        if bad {
            return Err(err(
                ErrorKind::NonFinite,
                "a norm weight is NaN or infinite",
            ));
        }
        Ok(Model {
            config: cfg,
            tok_embd,
            layers,
            out_norm,
            output,
            inv_freq,
            tensor_names,
        })
    }

    /// Parameters held (the tied head counted once).
    pub fn n_params(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.wqkv.len()
                    + l.bqkv.as_ref().map_or(0, Vec::len)
                    + l.wo.len()
                    + l.ffn_norm.len()
                    + l.w_gate_up.len()
                    + l.w_down.len()
            })
            .sum();
        l + self.tok_embd.len() + self.out_norm.len() + self.output.as_ref().map_or(0, Vec::len)
    }

    /// Rotate each head's first `n_rot` dims of `x` (rows of `n_heads`
    /// heads) by the angles of `pos`.
    fn rope(&self, x: &mut [f32], n_heads: usize, pos: usize) {
        let (hd, half) = (self.config.head_dim, self.config.n_rot / 2);
        let cs: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|f| {
                let t = pos as f64 * f;
                (t.cos() as f32, t.sin() as f32)
            })
            .collect();
        for h in 0..n_heads {
            let head = &mut x[h * hd..(h + 1) * hd];
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = if self.config.rope_neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }

    /// Run `tokens` after the positions already in `cache` (which they are
    /// appended to) and return the logits of batch rows `logit_rows`,
    /// `logit_rows.len() × n_vocab`, row-major.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logit_rows: Range<usize>,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (n, d, qd, kvd, ff) = (tokens.len(), c.d_model, c.q_dim(), c.kv_dim(), c.d_ff);
        if logit_rows.end > n || logit_rows.start > logit_rows.end {
            return Err(err(
                ErrorKind::Range,
                format!("logit rows {logit_rows:?} outside a batch of {n} tokens"),
            ));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(err(
                ErrorKind::Range,
                format!("token id {t} is not below the vocab size {}", c.n_vocab),
            ));
        }
        let p0 = cache.len;
        let mut x = vec![0f32; n * d];
        for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
            let t = t as usize;
            row.copy_from_slice(&self.tok_embd[t * d..(t + 1) * d]);
        }
        let qkv_w = qd + 2 * kvd;
        let mut h = vec![0f32; n * d];
        let mut qkv = vec![0f32; n * qkv_w];
        let mut q = vec![0f32; n * qd];
        let mut att = vec![0f32; n * qd];
        let mut proj = vec![0f32; n * d];
        let mut gu = vec![0f32; n * 2 * ff];
        let mut act = vec![0f32; n * ff];
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, c.rms_eps, &mut h);
            matmul_t(&h, n, &l.wqkv, qkv_w, d, &mut qkv);
            let (kc, vc) = (&mut cache.k[li], &mut cache.v[li]);
            for (i, row) in qkv.chunks_exact_mut(qkv_w).enumerate() {
                if let Some(b) = &l.bqkv {
                    for (v, bv) in row.iter_mut().zip(b) {
                        *v += bv;
                    }
                }
                let (qr, rest) = row.split_at_mut(qd);
                let (kr, vr) = rest.split_at_mut(kvd);
                self.rope(qr, c.n_head, p0 + i);
                self.rope(kr, c.n_head_kv, p0 + i);
                q[i * qd..(i + 1) * qd].copy_from_slice(qr);
                kc.extend_from_slice(kr);
                vc.extend_from_slice(vr);
            }
            self.attention(&q, &cache.k[li], &cache.v[li], p0, &mut att);
            matmul_t(&att, n, &l.wo, d, qd, &mut proj);
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h);
            matmul_t(&h, n, &l.w_gate_up, 2 * ff, d, &mut gu);
            for (g, a) in gu.chunks_exact_mut(2 * ff).zip(act.chunks_exact_mut(ff)) {
                let (gate, up) = g.split_at_mut(ff);
                swiglu(gate, up);
                a.copy_from_slice(gate);
            }
            matmul_t(&act, n, &l.w_down, d, ff, &mut proj);
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
        }
        cache.len += n;
        let m = logit_rows.len();
        let mut hn = vec![0f32; m * d];
        rms_norm(
            &x[logit_rows.start * d..logit_rows.end * d],
            &self.out_norm,
            c.rms_eps,
            &mut hn,
        );
        let head = self.output.as_deref().unwrap_or(&self.tok_embd);
        let mut logits = vec![0f32; m * c.n_vocab];
        matmul_t(&hn, m, head, c.n_vocab, d, &mut logits);
        Ok(logits)
    }

    /// Causal grouped-query attention of the batch's queries (positions
    /// `p0..p0+n`) over every cached position up to their own.
    fn attention(&self, q: &[f32], k: &[f32], v: &[f32], p0: usize, out: &mut [f32]) {
        let c = &self.config;
        let (hd, qd, kvd) = (c.head_dim, c.q_dim(), c.kv_dim());
        let group = c.n_head / c.n_head_kv;
        let scale = 1.0 / (hd as f32).sqrt();
        out.par_chunks_mut(qd).enumerate().for_each(|(i, orow)| {
            let p = p0 + i;
            let mut scores = vec![0f32; p + 1];
            for h in 0..c.n_head {
                let g = h / group;
                let qh = &q[i * qd + h * hd..i * qd + (h + 1) * hd];
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = dot(qh, &k[j * kvd + g * hd..j * kvd + (g + 1) * hd]) * scale;
                }
                softmax(&mut scores);
                let oh = &mut orow[h * hd..(h + 1) * hd];
                oh.fill(0.0);
                for (j, &s) in scores.iter().enumerate() {
                    let vj = &v[j * kvd + g * hd..j * kvd + (g + 1) * hd];
                    for (o, &vv) in oh.iter_mut().zip(vj) {
                        *o += s * vv;
                    }
                }
            }
        });
    }
}
