//! The Hugging Face view: a directory `hf/` that `transformers` loads with
//! `AutoModelForCausalLM.from_pretrained(MOUNT/hf)` and
//! `AutoTokenizer.from_pretrained(MOUNT/hf)`, for the llama and qwen2
//! architectures.
//!
//! - `config.json`, `generation_config.json`: rendered at mount from the
//!   GGUF key/values (the dense fallback's for a layered mount);
//! - `tokenizer.json`, `tokenizer_config.json`: the GGUF tokenizer
//!   (`tokenizer.ggml.*`, byte-level BPE only) as the fast tokenizer
//!   transformers' own GGUF loader builds from the same key/values;
//! - `model.safetensors` (and `model.f16.safetensors` /
//!   `model.bf16.safetensors` with `--views f16,bf16`): every tensor under
//!   its Hugging Face name, a [`Layout`](super::views::Layout) like the
//!   root's views, so reads go through the same decoded-chunk cache.
//!   llama.cpp's converter permutes the rows of llama's Q and K projections
//!   (per head, it interleaves the two rotary halves); those segments carry
//!   a [`RowPerm`] that undoes it, so a read of a row range of `q_proj`
//!   reads the matching GGUF rows. qwen2's projections are not permuted by
//!   the converter and are served as they are (what transformers' GGUF
//!   loader does too).
//!
//! Inodes (stable across remounts, [`super::inodes`]): `HF_DIR_INO`
//! (2^47) the directory, +1 `config.json`, +2 `generation_config.json`,
//! +3 `tokenizer.json`, +4 `tokenizer_config.json`, +5 + k the safetensors
//! view in format k (0 f32, 1 f16, 2 bf16). They sit above every tensor
//! file inode (< 3 * 2^32 + 16) and below the job files (2^48).
//!
//! A model that cannot be offered this way (another architecture, partial
//! rotary embeddings, rope scaling other than linear, a tensor without a
//! Hugging Face name, a missing tensor) gets no `hf/`; index.json's
//! `views.hf` says why.

mod pieces;
mod tokenizer;

use serde_json::{Map, Value, json};

use self::pieces::Pieces;
use super::files::{TensorFile, ViewFile, view_metadata};
use super::inodes::{CONFIG_INO, GENERATION_CONFIG_INO, TOKENIZER_CONFIG_INO, TOKENIZER_INO};
use super::views::{self, ElemFormat, ModelView, RowPerm, ViewTensor};
use crate::backend::Backend;
use crate::format::meta::{MetaValue, Metadata};

/// One JSON file of `hf/`: its text, or the pieces its reads render
/// (the tokenizer files).
pub(super) struct HfFile {
    pub(super) name: &'static str,
    pub(super) ino: u64,
    doc: Pieces,
}

impl HfFile {
    fn text(name: &'static str, ino: u64, bytes: Vec<u8>) -> HfFile {
        HfFile {
            name,
            ino,
            doc: Pieces::text(bytes),
        }
    }

    pub(super) fn len(&self) -> u64 {
        self.doc.len()
    }

    /// Bytes `[offset, offset + size)` (fewer at the end) of the file of
    /// the mount of `b`.
    pub(super) fn read(&self, b: &dyn Backend, offset: u64, size: u32) -> Vec<u8> {
        self.doc.read(view_metadata(b).0, offset, size)
    }
}

/// The offered `hf/` directory: its JSON files (the safetensors views are
/// the namespace's [`ViewFile`]s) and what a reader should know.
pub(super) struct HfDir {
    pub(super) files: Vec<HfFile>,
    pub(super) notes: Vec<String>,
}

impl HfDir {
    pub(super) fn file(&self, ino: u64) -> Option<&HfFile> {
        self.files.iter().find(|f| f.ino == ino)
    }
}

/// `hf/` (or why there is none) and its safetensors views.
pub(super) struct HfBuild {
    pub(super) dir: Result<HfDir, String>,
    pub(super) views: Vec<ViewFile>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
}

/// What config.json says, from the GGUF key/values.
#[derive(Debug)]
struct Params {
    arch: Arch,
    hidden: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    ctx: u64,
    eps: f64,
    theta: f64,
    /// Linear rope scaling factor.
    linear_scale: Option<f64>,
}

fn key_u64(md: &Metadata, arch: &str, k: &str) -> Result<u64, String> {
    md.arch_u64(k)
        .ok_or_else(|| format!("the model metadata lacks {arch}.{k} (an unsigned integer)"))
}

fn params(md: &Metadata) -> Result<Params, String> {
    let name = md
        .architecture()
        .ok_or("the model metadata has no general.architecture (a bare SK32: mount it with --dense MODEL.gguf)")?;
    let arch = match name {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        other => {
            return Err(format!(
                "hf/ is offered for the llama and qwen2 architectures; general.architecture is \
                 {other:?}"
            ));
        }
    };
    let hidden = key_u64(md, name, "embedding_length")?;
    let heads = key_u64(md, name, "attention.head_count")?;
    let kv_heads = md.arch_u64("attention.head_count_kv").unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(format!(
            "{name}.attention.head_count {heads} / head_count_kv {kv_heads}: not a grouped-query \
             layout"
        ));
    }
    let head_dim = md
        .arch_u64("attention.key_length")
        .unwrap_or(hidden / heads);
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(format!(
            "head dimension {head_dim} is not a positive even number"
        ));
    }
    if let Some(n_rot) = md.arch_u64("rope.dimension_count")
        && n_rot != head_dim
    {
        return Err(format!(
            "{name}.rope.dimension_count {n_rot} is not the head dimension {head_dim} (partial \
             rotary embeddings have no {name} config in transformers)"
        ));
    }
    let f = |k: &str| md.get(&format!("{name}.{k}")).and_then(MetaValue::as_f64);
    let eps = f("attention.layer_norm_rms_epsilon").ok_or_else(|| {
        format!("the model metadata lacks {name}.attention.layer_norm_rms_epsilon")
    })?;
    let theta = f("rope.freq_base").unwrap_or(10000.0);
    let linear_scale = match md
        .get(&format!("{name}.rope.scaling.type"))
        .and_then(MetaValue::as_str)
    {
        None | Some("none") => None,
        Some("linear") => Some(f("rope.scaling.factor").unwrap_or(1.0)),
        Some(other) => {
            return Err(format!(
                "{name}.rope.scaling.type {other:?}: only linear rope scaling is rendered"
            ));
        }
    };
    if !(eps.is_finite() && theta.is_finite() && linear_scale.is_none_or(f64::is_finite)) {
        return Err("non-finite rms epsilon, rope base or rope scaling factor".to_string());
    }
    Ok(Params {
        arch,
        hidden,
        ffn: key_u64(md, name, "feed_forward_length")?,
        layers: key_u64(md, name, "block_count")?,
        heads,
        kv_heads,
        head_dim,
        ctx: key_u64(md, name, "context_length")?,
        eps,
        theta,
        linear_scale,
    })
}

/// Which projection a tensor is, for the row permutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proj {
    Q,
    K,
    Other,
}

/// The Hugging Face name of a GGUF tensor of a llama or qwen2 model.
fn hf_name(gguf: &str) -> Option<(String, Proj)> {
    match gguf {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), Proj::Other)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), Proj::Other)),
        "output.weight" => return Some(("lm_head.weight".into(), Proj::Other)),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty()
        || !layer.bytes().all(|b| b.is_ascii_digit())
        || layer.len() > 1 && layer.starts_with('0')
    {
        return None;
    }
    let (what, kind) = rest.rsplit_once('.')?;
    let (hf, proj) = match what {
        "attn_norm" => ("input_layernorm", Proj::Other),
        "ffn_norm" => ("post_attention_layernorm", Proj::Other),
        "attn_q" => ("self_attn.q_proj", Proj::Q),
        "attn_k" => ("self_attn.k_proj", Proj::K),
        "attn_v" => ("self_attn.v_proj", Proj::Other),
        "attn_output" => ("self_attn.o_proj", Proj::Other),
        "ffn_gate" => ("mlp.gate_proj", Proj::Other),
        "ffn_up" => ("mlp.up_proj", Proj::Other),
        "ffn_down" => ("mlp.down_proj", Proj::Other),
        _ => return None,
    };
    let norm = matches!(what, "attn_norm" | "ffn_norm");
    match kind {
        "weight" => {}
        "bias" if !norm => {}
        _ => return None,
    }
    Some((format!("model.layers.{layer}.{hf}.{kind}"), proj))
}

/// One tensor of the hf view.
struct HfTensor<'a> {
    file: usize,
    name: String,
    shape: &'a [u64],
    n_elements: u64,
    rows: Option<RowPerm>,
}

/// Build `hf/` for the served tensors `files` of `b`, with a safetensors
/// view in each of `formats`.
pub(super) fn build(b: &dyn Backend, files: &[TensorFile], formats: &[ElemFormat]) -> HfBuild {
    match build_dir(b, files, formats) {
        Ok((dir, views)) => HfBuild {
            dir: Ok(dir),
            views,
        },
        Err(why) => {
            log::info!("hf/ is not offered: {why}");
            HfBuild {
                views: formats
                    .iter()
                    .map(|f| ViewFile {
                        view: ModelView::Hf(*f),
                        layout: Err(format!("no hf/: {why}")),
                        notes: Vec::new(),
                    })
                    .collect(),
                dir: Err(why),
            }
        }
    }
}

fn build_dir(
    b: &dyn Backend,
    files: &[TensorFile],
    formats: &[ElemFormat],
) -> Result<(HfDir, Vec<ViewFile>), String> {
    let (md, _) = view_metadata(b);
    let p = params(md)?;
    let entries = b.tensors().entries();
    // Every tensor of the model must have a Hugging Face name and a file.
    for t in entries {
        if hf_name(&t.name.dot).is_none() {
            return Err(format!(
                "{} has no Hugging Face {} tensor",
                t.name.dot,
                md.architecture().unwrap_or("")
            ));
        }
    }
    let mut tensors = Vec::with_capacity(files.len());
    for (f, tf) in files.iter().enumerate() {
        let t = &entries[tf.index];
        let Some((name, proj)) = hf_name(&t.name.dot) else {
            continue;
        };
        let groups = match (p.arch, proj) {
            (Arch::Llama, Proj::Q) => Some(p.heads),
            (Arch::Llama, Proj::K) => Some(p.kv_heads),
            _ => None,
        };
        let rows = match groups {
            None => None,
            Some(g) => {
                let n_rows = t.shape.first().copied().unwrap_or(0);
                if n_rows == 0 || !n_rows.is_multiple_of(2 * g) {
                    return Err(format!(
                        "{} has {n_rows} rows, not a multiple of 2 x {g} heads",
                        t.name.dot
                    ));
                }
                Some(RowPerm {
                    groups: g,
                    group_rows: n_rows / g,
                    row_elems: t.n_elements / n_rows,
                })
            }
        };
        tensors.push(HfTensor {
            file: f,
            name,
            shape: &t.shape,
            n_elements: t.n_elements,
            rows,
        });
    }
    let served: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let unserved: Vec<&str> = entries
        .iter()
        .filter(|t| !t.is_available())
        .map(|t| t.name.dot.as_str())
        .collect();
    if let Some(first) = unserved.first() {
        return Err(format!(
            "{} tensor(s) cannot be served ({first}, ...) and transformers needs every tensor",
            unserved.len()
        ));
    }
    let llama_bias =
        p.arch == Arch::Llama && served.contains("model.layers.0.self_attn.q_proj.bias");
    let mut expected = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    for l in 0..p.layers {
        let pre = format!("model.layers.{l}.");
        for n in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ] {
            expected.push(format!("{pre}{n}"));
        }
        let biases: &[&str] = match p.arch {
            Arch::Qwen2 => &["q_proj", "k_proj", "v_proj"],
            Arch::Llama if llama_bias => &["q_proj", "k_proj", "v_proj", "o_proj"],
            Arch::Llama => &[],
        };
        for n in biases {
            expected.push(format!("{pre}self_attn.{n}.bias"));
        }
    }
    let missing: Vec<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|n| !served.contains(n))
        .collect();
    if !missing.is_empty() {
        let more = if missing.len() > 4 { ", ..." } else { "" };
        return Err(format!(
            "the served tensors lack {} Hugging Face tensor(s) ({}{more}; a compressed file \
             alone carries only what it compresses: mount it with --dense MODEL.gguf)",
            missing.len(),
            missing[..missing.len().min(4)].join(", ")
        ));
    }
    let mut allowed: std::collections::HashSet<&str> =
        expected.iter().map(String::as_str).collect();
    allowed.insert("lm_head.weight");
    if let Some(t) = tensors.iter().find(|t| !allowed.contains(t.name.as_str())) {
        return Err(format!(
            "{} is not a tensor of a {} model of {} layers",
            t.name,
            md.architecture().unwrap_or(""),
            p.layers
        ));
    }
    let tied = !served.contains("lm_head.weight");
    let vocab = tensors
        .iter()
        .find(|t| t.name == "model.embed_tokens.weight")
        .and_then(|t| t.shape.first().copied())
        .ok_or("model.embed_tokens.weight has no shape")?;

    let view_tensors: Vec<ViewTensor> = tensors
        .iter()
        .map(|t| ViewTensor {
            file: t.file,
            name: &t.name,
            shape: t.shape,
            n_elements: t.n_elements,
            rows: t.rows,
        })
        .collect();
    let mut views_out = Vec::new();
    for &fmt in formats {
        // transformers refuses a safetensors file whose metadata lacks a
        // known "format".
        let layout = views::safetensors_with(
            &view_tensors,
            views::header_start(r#"{"format":"pt"}"#).into(),
            fmt,
        )
        .map_err(|e| e.to_string());
        views_out.push(ViewFile {
            view: ModelView::Hf(fmt),
            layout,
            notes: if p.arch == Arch::Llama {
                vec!["q_proj/k_proj rows in Hugging Face order (llama.cpp's rotary permutation undone)".to_string()]
            } else {
                Vec::new()
            },
        });
    }

    let mut files_out = vec![
        HfFile::text(
            "config.json",
            CONFIG_INO,
            pretty(&config_json(md, &p, vocab, tied, llama_bias)),
        ),
        HfFile::text(
            "generation_config.json",
            GENERATION_CONFIG_INO,
            pretty(&generation_config_json(md)),
        ),
    ];
    let mut notes = Vec::new();
    match tokenizer::tokenizer_files(md, p.ctx) {
        Ok(t) => {
            for n in &t.notes {
                log::info!("hf/tokenizer.json: {n}");
            }
            notes.extend(t.notes);
            files_out.push(HfFile {
                name: "tokenizer.json",
                ino: TOKENIZER_INO,
                doc: t.tokenizer,
            });
            files_out.push(HfFile {
                name: "tokenizer_config.json",
                ino: TOKENIZER_CONFIG_INO,
                doc: t.config,
            });
        }
        Err(why) => {
            log::info!("hf/tokenizer.json is not offered: {why}");
            notes.push(format!("no tokenizer.json / tokenizer_config.json: {why}"));
        }
    }
    Ok((
        HfDir {
            files: files_out,
            notes,
        },
        views_out,
    ))
}

fn pretty(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s.into_bytes()
}

/// A token id key (`tokenizer.ggml.bos_token_id`, ...).
fn token_id(md: &Metadata, what: &str) -> Option<u64> {
    md.get(&format!("tokenizer.ggml.{what}_token_id"))
        .and_then(MetaValue::as_u64)
}

fn config_json(md: &Metadata, p: &Params, vocab: u64, tied: bool, llama_bias: bool) -> Value {
    let (class, model_type) = match p.arch {
        Arch::Llama => ("LlamaForCausalLM", "llama"),
        Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
    };
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("hidden_size".into(), json!(p.hidden));
    c.insert("intermediate_size".into(), json!(p.ffn));
    c.insert("num_hidden_layers".into(), json!(p.layers));
    c.insert("num_attention_heads".into(), json!(p.heads));
    c.insert("num_key_value_heads".into(), json!(p.kv_heads));
    if p.arch == Arch::Llama || p.head_dim != p.hidden / p.heads {
        c.insert("head_dim".into(), json!(p.head_dim));
    }
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("max_position_embeddings".into(), json!(p.ctx));
    c.insert("rms_norm_eps".into(), json!(p.eps));
    c.insert("rope_theta".into(), json!(p.theta));
    c.insert(
        "rope_scaling".into(),
        match p.linear_scale {
            Some(f) => json!({"rope_type": "linear", "type": "linear", "factor": f}),
            None => Value::Null,
        },
    );
    if p.arch == Arch::Llama {
        c.insert("attention_bias".into(), json!(llama_bias));
        c.insert("mlp_bias".into(), json!(false));
    } else {
        c.insert("use_sliding_window".into(), json!(false));
    }
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(tied));
    c.insert("torch_dtype".into(), json!("float32"));
    for what in ["bos", "eos", "pad"] {
        if let Some(id) = token_id(md, what) {
            c.insert(format!("{what}_token_id"), json!(id));
        }
    }
    c.insert("use_cache".into(), json!(true));
    Value::Object(c)
}

fn generation_config_json(md: &Metadata) -> Value {
    let mut c = Map::new();
    for what in ["bos", "eos", "pad"] {
        if let Some(id) = token_id(md, what) {
            c.insert(format!("{what}_token_id"), json!(id));
        }
    }
    Value::Object(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_hugging_face_names() {
        let n = hf_name;
        assert_eq!(
            n("blk.12.attn_q.weight"),
            Some(("model.layers.12.self_attn.q_proj.weight".into(), Proj::Q))
        );
        assert_eq!(
            n("blk.0.attn_k.bias"),
            Some(("model.layers.0.self_attn.k_proj.bias".into(), Proj::K))
        );
        assert_eq!(
            n("blk.3.ffn_norm.weight").map(|x| x.0),
            Some("model.layers.3.post_attention_layernorm.weight".into())
        );
        assert_eq!(
            n("token_embd.weight").map(|x| x.0),
            Some("model.embed_tokens.weight".into())
        );
        for bad in [
            "blk.x.attn_q.weight",
            "blk.01.attn_q.weight",
            "blk.0.attn_norm.bias",
            "rope_freqs.weight",
            "blk.0.attn_qkv.weight",
        ] {
            assert_eq!(n(bad), None, "{bad}");
        }
    }

    #[test]
    fn params_refuse_what_hf_cannot_express() {
        let base = |arch: &str| {
            let mut md = Metadata::default();
            md.push("general.architecture", MetaValue::String(arch.into()));
            for (k, v) in [
                ("embedding_length", 64),
                ("attention.head_count", 4),
                ("attention.head_count_kv", 2),
                ("feed_forward_length", 128),
                ("block_count", 2),
                ("context_length", 256),
            ] {
                md.push(format!("{arch}.{k}"), MetaValue::U32(v));
            }
            md.push(
                format!("{arch}.attention.layer_norm_rms_epsilon"),
                MetaValue::F32(1e-6),
            );
            md
        };
        let p = params(&base("qwen2")).unwrap();
        assert_eq!((p.arch, p.head_dim, p.kv_heads), (Arch::Qwen2, 16, 2));
        assert!(params(&base("phi3")).unwrap_err().contains("\"phi3\""));
        let mut partial = base("llama");
        partial.push("llama.rope.dimension_count", MetaValue::U32(8));
        assert!(params(&partial).unwrap_err().contains("partial rotary"));
        let mut yarn = base("llama");
        yarn.push("llama.rope.scaling.type", MetaValue::String("yarn".into()));
        assert!(params(&yarn).unwrap_err().contains("yarn"));
        let mut linear = base("llama");
        linear.push(
            "llama.rope.scaling.type",
            MetaValue::String("linear".into()),
        );
        linear.push("llama.rope.scaling.factor", MetaValue::F32(4.0));
        assert_eq!(params(&linear).unwrap().linear_scale, Some(4.0));
    }

    #[test]
    fn row_permutation_undoes_llama_cpp_interleaving() {
        // llama.cpp: gguf[h, i, j] = hf[h, j, i] for rows split [heads, half, 2].
        let p = RowPerm {
            groups: 3,
            group_rows: 8,
            row_elems: 5,
        };
        let half = 4;
        for h in 0..3 {
            for j in 0..2 {
                for i in 0..half {
                    let hf_row = h * 8 + j * half + i;
                    assert_eq!(p.src_row(hf_row), h * 8 + 2 * i + j);
                }
            }
        }
        let mut seen: Vec<u64> = (0..24).map(|r| p.src_row(r)).collect();
        seen.sort();
        assert_eq!(seen, (0..24).collect::<Vec<_>>());
    }
}
