//! A llama-like decoder in fp32 for the families of [`crate::arch`]:
//! RMSNorm, RoPE (pairs as the family's [`RopeLayout`] says), grouped-query
//! attention with a KV cache and Q/K/V biases where the file has them
//! (qwen2), per-head Q/K RMS norms where the family's [`Block`] has them
//! (qwen3), SwiGLU feed-forward or a mixture of SwiGLU experts
//! ([`super::moe`]: mixtral, qwen3moe), tied or separate output head.
//! Hyper-parameters come from the GGUF key/values, weights from a
//! [`WeightSource`], i.e. the bytes the mount serves.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use super::linalg::{dot, matmul_t, matmul_t_cols, rms_norm, softmax, swiglu};
use super::moe::{MoeConfig, MoeFfn};
use super::sites::{ActivationRecorder, Site};
use super::weights::WeightSource;
use crate::arch::{Architecture, Block, RopeLayout};
use crate::error::{ErrorKind, Result, err};
use crate::format::meta::{MetaValue, Metadata};

/// Hyper-parameters, from `<arch>.*` keys and the tensor shapes.
#[derive(Debug, Clone)]
pub struct Config {
    /// The family, from `general.architecture`.
    pub arch: &'static dyn Architecture,
    pub n_layer: usize,
    pub d_model: usize,
    /// The feed-forward's hidden size (each expert's, with experts).
    pub d_ff: usize,
    /// The experts, when the feed-forward is a mixture of them.
    pub moe: Option<MoeConfig>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates.
    pub n_rot: usize,
    pub rope_base: f64,
    /// Linear RoPE scaling: positions are multiplied by this.
    pub rope_pos_scale: f64,
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
        let arch_name = md.architecture().ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                "model metadata: key \"general.architecture\" is missing",
            )
        })?;
        let arch = crate::arch::lookup(arch_name).ok_or_else(|| {
            err(
                ErrorKind::UnsupportedType,
                format!(
                    "general.architecture is {arch_name:?}; the probe runs {}",
                    crate::arch::supported_list(true)
                ),
            )
        })?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let n_layer = get_u(md, &k("block_count"))?;
        let d_model = get_u(md, &k("embedding_length"))?;
        let dense_ff = get_u(md, &k("feed_forward_length"))?;
        let moe = MoeConfig::from_metadata(md, arch, dense_ff)?;
        let d_ff = moe.map_or(dense_ff, |m| m.d_ff);
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
        let experts = moe.map_or(1, |m| m.n_expert);
        let ffn = d_ff
            .checked_mul(3)
            .and_then(|f| f.checked_mul(d_model))
            .and_then(|f| f.checked_mul(experts));
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
            n_layer,
            d_model,
            d_ff,
            moe,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_base,
            rope_pos_scale,
            rms_eps,
            n_vocab: 0,
            tied_embeddings: false,
        })
    }

    /// GPT-NeoX RoPE (pairs `i`, `i + n_rot/2`) instead of GPT-J/llama
    /// (pairs `2i`, `2i+1`), as the family's [`RopeLayout`] says.
    pub fn rope_neox(&self) -> bool {
        self.arch.rope_layout() == RopeLayout::Neox
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn summary(&self) -> String {
        format!(
            "{}: {} layers, d {}, ffn {}{}, heads {}/{} (head {}, rope {} dims base {} {}), vocab {}{}",
            self.arch.name(),
            self.n_layer,
            self.d_model,
            self.d_ff,
            match &self.moe {
                Some(m) => format!(" x {} experts ({} per token)", m.n_expert, m.n_used),
                None => String::new(),
            },
            self.n_head,
            self.n_head_kv,
            self.head_dim,
            self.n_rot,
            self.rope_base,
            if self.rope_neox() { "neox" } else { "normal" },
            self.n_vocab,
            if self.tied_embeddings {
                ", tied embeddings"
            } else {
                ""
            }
        )
    }
}

/// Where the decoded weights of the big matrices live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Residency {
    /// In memory when the fp32 model fits in three quarters of the memory
    /// available (MemAvailable), else streamed.
    Auto,
    /// Decoded once at load and held in fp32: 4 bytes per parameter.
    Memory,
    /// Decoded from the source a chunk of rows at a time for every
    /// product: memory is one chunk, and every forward pass pays a full
    /// decode of the model.
    Stream,
}

/// Floats per streamed chunk (64 MiB): big enough that each decode call
/// is long, small next to any model worth streaming.
const STREAM_CHUNK_FLOATS: usize = 16 << 20;

/// A weight matrix the forward pass multiplies by: one tensor, or several
/// stacked by rows (Q/K/V, gate/up), each `[rows, d_in]`.
struct Matrix {
    /// The stacked tensors' names and row counts.
    parts: Vec<(String, usize)>,
    /// The decoded rows, or None when the matrix is streamed.
    resident: Option<Vec<f32>>,
}

impl Matrix {
    /// The stacked tensors, allocated in fp32 unless `streamed`.
    fn new(parts: Vec<(String, usize)>, d_in: usize, streamed: bool) -> Result<Matrix> {
        let resident = match streamed {
            true => None,
            false => {
                let rows = parts.iter().map(|p| p.1).sum();
                let what = parts.first().map_or("a matrix", |p| p.0.as_str());
                Some(zeros(rows, d_in, what)?)
            }
        };
        Ok(Matrix { parts, resident })
    }

    fn one(name: &str, rows: usize, d_in: usize, streamed: bool) -> Result<Matrix> {
        Self::new(vec![(name.to_string(), rows)], d_in, streamed)
    }

    /// Load jobs for the resident rows, one per stacked tensor.
    fn jobs<'a>(&'a mut self, d_in: usize, jobs: &mut Vec<Job<'a>>) {
        let Matrix { parts, resident } = self;
        let Some(buf) = resident.as_mut() else { return };
        let mut rest = buf.as_mut_slice();
        for (name, rows) in parts.iter() {
            let len = (*rows * d_in).min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
            jobs.push(Job {
                name: name.clone(),
                shape: vec![*rows as u64, d_in as u64],
                out: head,
            });
            rest = tail;
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V projections stacked: `[q_dim + 2 kv_dim, d_model]`, so
    /// one pass over the activations computes all three.
    wqkv: Matrix,
    bqkv: Option<Vec<f32>>,
    /// Per-head RMS norm weights of the queries and keys (head_dim each),
    /// applied before RoPE.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    wo: Matrix,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

enum Ffn {
    Dense {
        /// Gate and up stacked: `[2 d_ff, d_model]`.
        w_gate_up: Matrix,
        w_down: Matrix,
    },
    Moe(MoeFfn),
}

/// Loaded weights: norms and biases in fp32, the matrices in fp32 memory
/// or streamed from the source (see [`Residency`]).
pub struct Model {
    pub config: Config,
    tok_embd: Matrix,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    output: Option<Matrix>,
    /// Per rotated pair: the angle per position, `base^(-2i/n_rot) ·
    /// scale / freq_factor_i`.
    inv_freq: Vec<f64>,
    /// Tensor names read, for bits-per-weight reports.
    pub tensor_names: Vec<String>,
    n_params: usize,
    /// Floats per streamed chunk ([`STREAM_CHUNK_FLOATS`]).
    chunk_floats: usize,
    /// Where streamed matrices are read from (None: all resident).
    source: Option<Arc<dyn WeightSource>>,
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

fn not_loaded() -> crate::error::Error {
    err(
        ErrorKind::BadValue,
        "internal: a matrix is neither loaded nor streamed",
    )
}

/// Whether `bytes` fit in three quarters of MemAvailable (true when it
/// cannot be read: holding the weights is the old, simple behaviour).
pub(crate) fn fits_in_memory(bytes: usize) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else {
        return true;
    };
    let kib = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    match kib {
        Some(k) => (bytes as u64) <= k.saturating_mul(1024) / 4 * 3,
        None => true,
    }
}

/// RMS-norm each `weight.len()`-long piece of `x` (each head) in place.
fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let mut piece = vec![0f32; weight.len()];
    for head in x.chunks_exact_mut(weight.len()) {
        rms_norm(head, weight, eps, &mut piece);
        head.copy_from_slice(&piece);
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
    /// Read every weight the forward pass needs from `src` into memory,
    /// checking each served shape against the hyper-parameters. Tensors
    /// load in parallel on the current rayon pool.
    pub fn load(src: &dyn WeightSource) -> Result<Model> {
        Self::load_parts(src, None, Residency::Memory)
    }

    /// As [`Model::load`], with the matrices held as `residency` says;
    /// streamed ones are read from `src` on every forward pass.
    pub fn load_with(src: Arc<dyn WeightSource>, residency: Residency) -> Result<Model> {
        Self::load_parts(src.as_ref(), Some(&src), residency)
    }

    fn load_parts(
        src: &dyn WeightSource,
        keep: Option<&Arc<dyn WeightSource>>,
        residency: Residency,
    ) -> Result<Model> {
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
        let block: Block = cfg.arch.block();
        let hd64 = cfg.head_dim as u64;

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
            ]);
            match &cfg.moe {
                Some(m) => plan.extend(super::moe::plan(i, m, d)),
                None => plan.extend([
                    (p("ffn_gate.weight"), vec![ff64, d64]),
                    (p("ffn_up.weight"), vec![ff64, d64]),
                    (p("ffn_down.weight"), vec![d64, ff64]),
                ]),
            }
            if block.qk_norm {
                plan.extend([
                    (p("attn_q_norm.weight"), vec![hd64]),
                    (p("attn_k_norm.weight"), vec![hd64]),
                ]);
            }
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

        let n_params: usize = plan
            .iter()
            .map(|(_, shape)| shape.iter().product::<u64>())
            .sum::<u64>()
            .try_into()
            .map_err(|_| err(ErrorKind::TooLarge, "the model does not fit in memory"))?;
        let streamed = match residency {
            Residency::Memory => false,
            Residency::Stream => true,
            Residency::Auto => !fits_in_memory(n_params.saturating_mul(4)),
        };
        let source = match (streamed, keep) {
            (false, _) => None,
            (true, Some(s)) => Some(Arc::clone(s)),
            (true, None) => {
                return Err(err(
                    ErrorKind::BadValue,
                    "internal: streamed weights need a shared source",
                ));
            }
        };
        let mut tok_embd = Matrix::one("token_embd.weight", n_vocab, d, streamed)?;
        let mut out_norm = zeros(1, d, "output_norm.weight")?;
        let mut output = match cfg.tied_embeddings {
            true => None,
            false => Some(Matrix::one("output.weight", n_vocab, d, streamed)?),
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}");
            layers.push(Layer {
                attn_norm: zeros(1, d, "attn_norm")?,
                wqkv: Matrix::new(
                    vec![
                        (p("attn_q.weight"), qd),
                        (p("attn_k.weight"), kvd),
                        (p("attn_v.weight"), kvd),
                    ],
                    d,
                    streamed,
                )?,
                bqkv: if has_bias {
                    Some(zeros(1, qd + 2 * kvd, "attn biases")?)
                } else {
                    None
                },
                qk_norm: match block.qk_norm {
                    true => Some((
                        zeros(1, cfg.head_dim, "attn_q_norm")?,
                        zeros(1, cfg.head_dim, "attn_k_norm")?,
                    )),
                    false => None,
                },
                wo: Matrix::one(&p("attn_output.weight"), d, qd, streamed)?,
                ffn_norm: zeros(1, d, "ffn_norm")?,
                ffn: match cfg.moe {
                    // Held in memory however the rest is (super::moe).
                    Some(m) => Ffn::Moe(MoeFfn {
                        cfg: m,
                        router: zeros(m.n_expert, d, "ffn_gate_inp")?,
                        gate: zeros(m.n_expert * ff, d, "ffn_gate_exps")?,
                        up: zeros(m.n_expert * ff, d, "ffn_up_exps")?,
                        down: zeros(m.n_expert * d, ff, "ffn_down_exps")?,
                    }),
                    None => Ffn::Dense {
                        w_gate_up: Matrix::new(
                            vec![(p("ffn_gate.weight"), ff), (p("ffn_up.weight"), ff)],
                            d,
                            streamed,
                        )?,
                        w_down: Matrix::one(&p("ffn_down.weight"), d, ff, streamed)?,
                    },
                },
            });
        }

        // Streamed tensors, for the check against the plan below.
        let mut streamed_parts: Vec<(String, Vec<u64>)> = Vec::new();
        if streamed {
            let mut matrices: Vec<(&Matrix, usize)> = vec![(&tok_embd, d)];
            matrices.extend(output.as_ref().map(|o| (o, d)));
            for l in &layers {
                matrices.extend([(&l.wqkv, d), (&l.wo, qd)]);
                if let Ffn::Dense { w_gate_up, w_down } = &l.ffn {
                    matrices.extend([(w_gate_up, d), (w_down, ff)]);
                }
            }
            for (m, d_in) in matrices {
                for (name, rows) in &m.parts {
                    streamed_parts.push((name.clone(), vec![*rows as u64, d_in as u64]));
                }
            }
        }
        let mut jobs: Vec<Job> = vec![Job {
            name: "output_norm.weight".into(),
            shape: vec![d64],
            out: &mut out_norm,
        }];
        tok_embd.jobs(d, &mut jobs);
        if let Some(o) = output.as_mut() {
            o.jobs(d, &mut jobs);
        }
        for (i, l) in layers.iter_mut().enumerate() {
            let p = |s: &str| format!("blk.{i}.{s}");
            jobs.push(Job {
                name: p("attn_norm.weight"),
                shape: vec![d64],
                out: &mut l.attn_norm,
            });
            jobs.push(Job {
                name: p("ffn_norm.weight"),
                shape: vec![d64],
                out: &mut l.ffn_norm,
            });
            if let Some((qn, kn)) = l.qk_norm.as_mut() {
                jobs.push(Job {
                    name: p("attn_q_norm.weight"),
                    shape: vec![hd64],
                    out: qn,
                });
                jobs.push(Job {
                    name: p("attn_k_norm.weight"),
                    shape: vec![hd64],
                    out: kn,
                });
            }
            l.wqkv.jobs(d, &mut jobs);
            l.wo.jobs(qd, &mut jobs);
            match &mut l.ffn {
                Ffn::Dense { w_gate_up, w_down } => {
                    w_gate_up.jobs(d, &mut jobs);
                    w_down.jobs(ff, &mut jobs);
                }
                Ffn::Moe(m) => {
                    let plan = super::moe::plan(i, &m.cfg, d);
                    let outs = [&mut m.router, &mut m.gate, &mut m.up, &mut m.down];
                    for ((name, shape), out) in plan.into_iter().zip(outs) {
                        jobs.push(Job { name, shape, out });
                    }
                }
            }
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
        // What is loaded now or streamed later must be exactly the plan
        // that was checked: a shorter destination would silently read only
        // a prefix of a tensor.
        let planned: HashMap<&str, &[u64]> = plan
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let loaded = jobs
            .iter()
            .map(|j| (j.name.as_str(), &j.shape, j.out.len() as u64));
        let streamed_only = streamed_parts
            .iter()
            .map(|(n, s)| (n.as_str(), s, s.iter().product::<u64>()));
        let mut count = 0;
        for (name, shape, len) in loaded.chain(streamed_only) {
            count += 1;
            let fits = planned.get(name) == Some(&shape.as_slice())
                && shape.iter().product::<u64>() == len;
            if !fits {
                return Err(err(
                    ErrorKind::BadShape,
                    format!("internal: load plan and buffers disagree at {name}"),
                ));
            }
        }
        if count != plan.len() {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "internal: {count} tensors loaded or streamed, {} planned",
                    plan.len()
                ),
            ));
        }
        let tensor_names: Vec<String> = plan.iter().map(|(n, _)| n.clone()).collect();
        jobs.par_iter_mut()
            .try_for_each(|j| src.read_into(&j.name, 0, j.out))?;
        drop(jobs);

        // Llama 3 style per-pair frequency factors, when the file has them.
        let half = cfg.n_rot / 2;
        let mut freq_factors = vec![1f32; half];
        if src.shape("rope_freqs.weight").is_some() {
            check_shape(src, "rope_freqs.weight", &[half as u64])?;
            src.read_into("rope_freqs.weight", 0, &mut freq_factors)?;
        }
        let inv_freq = (0..half)
            .map(|i| {
                cfg.rope_base.powf(-2.0 * i as f64 / cfg.n_rot as f64) * cfg.rope_pos_scale
                    / f64::from(freq_factors[i])
            })
            .collect();
        let bad = layers
            .iter()
            .flat_map(|l| {
                [&l.attn_norm, &l.ffn_norm]
                    .into_iter()
                    .chain(l.qk_norm.iter().flat_map(|(q, k)| [q, k]))
            })
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
            n_params,
            chunk_floats: STREAM_CHUNK_FLOATS,
            source,
        })
    }

    /// Parameters used (the tied head counted once).
    pub fn n_params(&self) -> usize {
        self.n_params
    }

    /// Stream in chunks of about `floats` (at least one row): tests use
    /// tiny chunks to cross chunk boundaries inside a matrix.
    #[doc(hidden)]
    pub fn set_stream_chunk(&mut self, floats: usize) {
        self.chunk_floats = floats.max(1);
    }

    /// Whether the matrices are streamed from the source.
    pub fn is_streamed(&self) -> bool {
        self.source.is_some()
    }

    /// Embedding row of token `t` into `row`.
    fn embed(&self, t: usize, row: &mut [f32]) -> Result<()> {
        let d = row.len();
        match (&self.tok_embd.resident, &self.source) {
            (Some(w), _) => {
                row.copy_from_slice(&w[t * d..(t + 1) * d]);
                Ok(())
            }
            (None, Some(src)) => src.read_into("token_embd.weight", (t * d) as u64, row),
            (None, None) => Err(not_loaded()),
        }
    }

    /// `y[n, d_out] = x[n, d_in] · mᵀ`, from memory or decoding `m` a
    /// chunk of rows at a time into `chunk` (reused across calls). Equal
    /// bit for bit either way: see [`matmul_t_cols`].
    #[allow(clippy::too_many_arguments)]
    fn mul(
        &self,
        x: &[f32],
        n: usize,
        m: &Matrix,
        d_out: usize,
        d_in: usize,
        y: &mut [f32],
        chunk: &mut Vec<f32>,
    ) -> Result<()> {
        let src = match (&m.resident, &self.source) {
            (Some(w), _) => {
                matmul_t(x, n, w, d_out, d_in, y);
                return Ok(());
            }
            (None, Some(src)) => src,
            (None, None) => return Err(not_loaded()),
        };
        let chunk_rows = (self.chunk_floats / d_in.max(1)).max(1);
        // Decode pieces: whole 256-element super-blocks where possible,
        // several per thread so a slow piece does not idle the others.
        let piece = (chunk_rows * d_in / (rayon::current_num_threads() * 4))
            .next_multiple_of(256)
            .max(256);
        let mut col0 = 0;
        for (name, rows) in &m.parts {
            let mut r = 0;
            while r < *rows {
                let take = chunk_rows.min(rows - r);
                chunk.resize(take * d_in, 0.0);
                let first = (r * d_in) as u64;
                chunk
                    .par_chunks_mut(piece)
                    .enumerate()
                    .try_for_each(|(i, p)| src.read_into(name, first + (i * piece) as u64, p))?;
                matmul_t_cols(x, n, chunk, take, d_in, y, d_out, col0 + r);
                r += take;
            }
            col0 += rows;
        }
        Ok(())
    }

    /// Rotate each head's first `n_rot` dims of `x` (rows of `n_heads`
    /// heads) by the angles of `pos`.
    fn rope(&self, x: &mut [f32], n_heads: usize, pos: usize) {
        let (hd, half) = (self.config.head_dim, self.config.n_rot / 2);
        // Asked once per call: the family is a trait object.
        let neox = self.config.rope_neox();
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
                let (a, b) = if neox {
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
        self.forward_recorded(tokens, cache, logit_rows, None)
    }

    /// [`Model::forward`], showing `recorder` (when there is one) the
    /// input of every weight matrix of every layer: the batch's rows
    /// exactly as they are multiplied. Without a recorder this is the
    /// plain forward pass (one untaken branch per matrix).
    pub fn forward_recorded(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logit_rows: Range<usize>,
        mut recorder: Option<&mut dyn ActivationRecorder>,
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
            self.embed(t as usize, row)?;
        }
        let mut chunk = Vec::new();
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
            if let Some(r) = recorder.as_deref_mut() {
                r.record(li, Site::AttnIn, &h, n);
            }
            self.mul(&h, n, &l.wqkv, qkv_w, d, &mut qkv, &mut chunk)?;
            let (kc, vc) = (&mut cache.k[li], &mut cache.v[li]);
            for (i, row) in qkv.chunks_exact_mut(qkv_w).enumerate() {
                if let Some(b) = &l.bqkv {
                    for (v, bv) in row.iter_mut().zip(b) {
                        *v += bv;
                    }
                }
                let (qr, rest) = row.split_at_mut(qd);
                let (kr, vr) = rest.split_at_mut(kvd);
                if let Some((qn, kn)) = &l.qk_norm {
                    rms_norm_in_place(qr, qn, c.rms_eps);
                    rms_norm_in_place(kr, kn, c.rms_eps);
                }
                self.rope(qr, c.n_head, p0 + i);
                self.rope(kr, c.n_head_kv, p0 + i);
                q[i * qd..(i + 1) * qd].copy_from_slice(qr);
                kc.extend_from_slice(kr);
                vc.extend_from_slice(vr);
            }
            self.attention(&q, &cache.k[li], &cache.v[li], p0, &mut att);
            if let Some(r) = recorder.as_deref_mut() {
                r.record(li, Site::AttnOutIn, &att, n);
            }
            self.mul(&att, n, &l.wo, d, qd, &mut proj, &mut chunk)?;
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut h);
            if let Some(r) = recorder.as_deref_mut() {
                r.record(li, Site::FfnIn, &h, n);
            }
            let (w_gate_up, w_down) = match &l.ffn {
                Ffn::Dense { w_gate_up, w_down } => (w_gate_up, w_down),
                Ffn::Moe(m) => {
                    m.forward(li, &h, n, d, &mut proj, recorder.as_deref_mut());
                    for (a, b) in x.iter_mut().zip(&proj) {
                        *a += b;
                    }
                    continue;
                }
            };
            self.mul(&h, n, w_gate_up, 2 * ff, d, &mut gu, &mut chunk)?;
            for (g, a) in gu.chunks_exact_mut(2 * ff).zip(act.chunks_exact_mut(ff)) {
                let (gate, up) = g.split_at_mut(ff);
                swiglu(gate, up);
                a.copy_from_slice(gate);
            }
            if let Some(r) = recorder.as_deref_mut() {
                r.record(li, Site::FfnDownIn, &act, n);
            }
            self.mul(&act, n, w_down, d, ff, &mut proj, &mut chunk)?;
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
        let head = self.output.as_ref().unwrap_or(&self.tok_embd);
        let mut logits = vec![0f32; m * c.n_vocab];
        self.mul(&hn, m, head, c.n_vocab, d, &mut logits, &mut chunk)?;
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
