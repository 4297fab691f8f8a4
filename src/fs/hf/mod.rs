//! The Hugging Face view: a directory `hf/` that `transformers` loads with
//! `AutoModelForCausalLM.from_pretrained(MOUNT/hf)` and
//! `AutoTokenizer.from_pretrained(MOUNT/hf)`, for the families of
//! [`crate::arch`] (llama and qwen2). What differs by family (names, Q/K
//! row permutation, biases, config.json fields) is asked of the family's
//! [`Architecture`]; this module renders the files.
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
//!   llama.cpp's converter permutes the rows of the Q and K projections of
//!   a family with interleaved RoPE (llama; per head, it interleaves the
//!   two rotary halves); those segments carry a [`RowGroups`] that undoes
//!   it, so a read of a row range of `q_proj` reads the matching GGUF rows.
//!   A NeoX-RoPE family's projections (qwen2) are not permuted by the
//!   converter and are served as they are (what transformers' GGUF loader
//!   does too).
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
use super::precision::served_format;
use super::views::{self, ElemFormat, ElemRun, ModelView, RowGroups, ViewTensor};
use crate::arch::{self, Architecture, AttentionBias, HfParams, RopeLayout, TokenizerKind};
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

/// One tensor of the hf view.
struct HfTensor {
    file: usize,
    name: String,
    shape: Vec<u64>,
    n_elements: u64,
    rows: Option<RowGroups>,
    /// A fused tensor's runs of its parts' elements (empty: all of `file`).
    runs: Vec<ElemRun>,
}

/// The most runs of a fused tensor (two per expert for `gate_up_proj`):
/// what a shape read from the source can make the view hold.
const MAX_FUSED_RUNS: u64 = 1 << 16;

/// One part of a fused tensor: its tensor file, shape and name.
struct FusedPart<'a> {
    file: usize,
    shape: &'a [u64],
    gguf: &'a str,
}

/// The shape and runs of `parts` concatenated along `dim` (outer-first),
/// as transformers' `Concatenate(dim)` makes one tensor of them: for each
/// index of the dimensions before `dim`, each part's block in turn.
fn fuse(name: &str, parts: &[FusedPart], dim: usize) -> Result<(Vec<u64>, Vec<ElemRun>), String> {
    let first = parts
        .first()
        .ok_or_else(|| format!("{name} has no parts"))?;
    let rank = first.shape.len();
    if dim >= rank {
        return Err(format!(
            "{name}: {} is {rank}-D, fused along dimension {dim}",
            first.gguf
        ));
    }
    let mut shape = first.shape.to_vec();
    shape[dim] = 0;
    for p in parts {
        let alike = p.shape.len() == rank
            && p.shape[..dim] == first.shape[..dim]
            && p.shape[dim + 1..] == first.shape[dim + 1..];
        if !alike {
            return Err(format!(
                "{name}: {} {:?} and {} {:?} differ outside dimension {dim}, so they do not \
                 concatenate",
                first.gguf, first.shape, p.gguf, p.shape
            ));
        }
        shape[dim] = shape[dim]
            .checked_add(p.shape[dim])
            .ok_or_else(|| format!("{name}: its shape overflows"))?;
    }
    let product = |d: &[u64]| d.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
    let overflow = || format!("{name}: its parts' element counts overflow");
    let outer = product(&first.shape[..dim]).ok_or_else(overflow)?;
    if outer
        .checked_mul(parts.len() as u64)
        .is_none_or(|n| n > MAX_FUSED_RUNS)
    {
        return Err(format!(
            "{name}: more than {MAX_FUSED_RUNS} runs of its parts"
        ));
    }
    let blocks = parts
        .iter()
        .map(|p| product(p.shape).and(product(&p.shape[dim..])))
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(overflow)?;
    let mut runs = Vec::with_capacity((outer as usize) * parts.len());
    for o in 0..outer {
        for (p, &block) in parts.iter().zip(&blocks) {
            // o * block < the part's element count, which did not overflow.
            runs.push(ElemRun {
                file: p.file,
                elem0: o * block,
                n: block,
            });
        }
    }
    Ok((shape, runs))
}

/// Build `hf/` for the served tensors `files` of `b`, with a safetensors
/// view in each of `formats` (the one named F32, `hf/model.safetensors`,
/// in `main`: [`served_format`], and so `config.json`'s dtype).
pub(super) fn build(
    b: &dyn Backend,
    files: &[TensorFile],
    formats: &[ElemFormat],
    main: ElemFormat,
) -> HfBuild {
    match build_dir(b, files, formats, main) {
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
    main: ElemFormat,
) -> Result<(HfDir, Vec<ViewFile>), String> {
    let (md, _) = view_metadata(b);
    let (arch, p) = arch::hf_params(md)?;
    let entries = b.tensors().entries();
    if p.moe.is_some() && arch.moe_routing().is_none() {
        return Err(format!(
            "{} has experts ({}.expert_count), and {} no mixture-of-experts form",
            md.architecture().unwrap_or(""),
            md.architecture().unwrap_or(""),
            arch.hf_class()
        ));
    }
    // Every tensor of the model must have a place in the checkpoint.
    for t in entries {
        if arch.hf_place(&t.name.dot).is_none() {
            return Err(format!(
                "{} has no Hugging Face {} tensor",
                t.name.dot,
                arch.hf_model_type()
            ));
        }
    }
    let mut tensors = Vec::with_capacity(files.len());
    // Fused tensors: their index in `tensors` (placed where their first
    // part is) and their parts so far.
    let mut fused: std::collections::HashMap<String, (usize, arch::Fused, Vec<Option<FusedPart>>)> =
        std::collections::HashMap::new();
    for (f, tf) in files.iter().enumerate() {
        let t = &entries[tf.index];
        let Some(place) = arch.hf_place(&t.name.dot) else {
            continue;
        };
        let (name, role) = (place.name, place.role);
        if let Some(part) = place.fused {
            let slot = fused.entry(name.clone()).or_insert_with(|| {
                tensors.push(HfTensor {
                    file: f,
                    name,
                    shape: Vec::new(),
                    n_elements: 0,
                    rows: None,
                    runs: Vec::new(),
                });
                (
                    tensors.len() - 1,
                    part,
                    (0..part.of).map(|_| None).collect(),
                )
            });
            let free = slot.1.of == part.of && slot.1.dim == part.dim;
            match slot.2.get_mut(part.index) {
                Some(s @ None) if free => {
                    *s = Some(FusedPart {
                        file: f,
                        shape: &t.shape,
                        gguf: &t.name.dot,
                    })
                }
                _ => {
                    return Err(format!(
                        "{}: part {} of {} of {} does not fit its other parts",
                        t.name.dot, part.index, part.of, tensors[slot.0].name
                    ));
                }
            }
            continue;
        }
        let rows = match arch.permuted_row_groups(role, p.heads, p.kv_heads) {
            None => None,
            Some(g) => {
                let n_rows = t.shape.first().copied().unwrap_or(0);
                if n_rows == 0 || !n_rows.is_multiple_of(2 * g) {
                    return Err(format!(
                        "{} has {n_rows} rows, not a multiple of 2 x {g} heads",
                        t.name.dot
                    ));
                }
                Some(RowGroups {
                    groups: g,
                    group_rows: n_rows / g,
                    row_elems: t.n_elements / n_rows,
                })
            }
        };
        tensors.push(HfTensor {
            file: f,
            name,
            shape: t.shape.clone(),
            n_elements: t.n_elements,
            rows,
            runs: Vec::new(),
        });
    }
    for (name, (at, part, parts)) in fused {
        let Some(parts) = parts.into_iter().collect::<Option<Vec<_>>>() else {
            return Err(format!(
                "{name} is {} GGUF tensors fused, and the model lacks some",
                part.of
            ));
        };
        let (shape, runs) = fuse(&name, &parts, part.dim)?;
        let t = &mut tensors[at];
        t.n_elements = runs.iter().map(|r| r.n).sum();
        t.shape = shape;
        t.runs = runs;
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
    let biases: &[&str] = match arch.attention_bias() {
        AttentionBias::Required(b) => b,
        AttentionBias::Optional(b) if served.contains("model.layers.0.self_attn.q_proj.bias") => b,
        AttentionBias::Optional(_) => &[],
    };
    let mut expected = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    for l in 0..p.layers {
        let pre = format!("model.layers.{l}.");
        for n in arch.hf_layer_weights() {
            expected.push(format!("{pre}{n}"));
        }
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
            shape: &t.shape,
            n_elements: t.n_elements,
            rows: t.rows,
            runs: &t.runs,
        })
        .collect();
    let mut views_out = Vec::new();
    for &fmt in formats {
        // transformers refuses a safetensors file whose metadata lacks a
        // known "format".
        let layout = views::safetensors_with(
            &view_tensors,
            views::header_start(r#"{"format":"pt"}"#).into(),
            served_format(fmt, main),
        )
        .map_err(|e| e.to_string());
        let mut notes = Vec::new();
        if arch.rope_layout() == RopeLayout::Interleaved {
            notes.push(
                "q_proj/k_proj rows in Hugging Face order (llama.cpp's rotary permutation undone)"
                    .to_string(),
            );
        }
        if p.moe.is_some() {
            notes.push(
                "experts fused as transformers holds them: mlp.experts.gate_up_proj \
                 [n_expert, 2 x ffn, hidden] (each expert's ffn_gate_exps rows, then its \
                 ffn_up_exps rows), mlp.experts.down_proj = ffn_down_exps"
                    .to_string(),
            );
        }
        views_out.push(ViewFile {
            view: ModelView::Hf(fmt),
            layout,
            notes,
        });
    }

    let mut files_out = vec![
        HfFile::text(
            "config.json",
            CONFIG_INO,
            pretty(&config_json(
                md,
                arch,
                &p,
                vocab,
                tied,
                !biases.is_empty(),
                main,
            )),
        ),
        HfFile::text(
            "generation_config.json",
            GENERATION_CONFIG_INO,
            pretty(&generation_config_json(md)),
        ),
    ];
    let mut notes = Vec::new();
    let tokenizer = match arch.tokenizer() {
        TokenizerKind::ByteLevelBpe => tokenizer::tokenizer_files(md, p.ctx),
    };
    match tokenizer {
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

fn config_json(
    md: &Metadata,
    arch: &dyn Architecture,
    p: &HfParams,
    vocab: u64,
    tied: bool,
    biased: bool,
    dtype: ElemFormat,
) -> Value {
    let extras = arch.config_extras(biased);
    let mut c = Map::new();
    c.insert("architectures".into(), json!([arch.hf_class()]));
    c.insert("model_type".into(), json!(arch.hf_model_type()));
    c.insert("hidden_size".into(), json!(p.hidden));
    c.insert("intermediate_size".into(), json!(p.ffn));
    c.insert("num_hidden_layers".into(), json!(p.layers));
    c.insert("num_attention_heads".into(), json!(p.heads));
    c.insert("num_key_value_heads".into(), json!(p.kv_heads));
    if extras.always_head_dim || p.head_dim != p.hidden / p.heads {
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
    for (k, v) in extras.fields {
        c.insert(k.into(), v);
    }
    if let Some(m) = &p.moe {
        for (k, v) in arch.config_moe_fields(m) {
            c.insert(k.into(), v);
        }
    }
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(tied));
    // What `hf/model.safetensors` holds: transformers' `dtype="auto"`
    // loads in it (4.x reads `torch_dtype`; 5.x writes and reads `dtype`).
    c.insert("torch_dtype".into(), json!(torch_dtype(dtype)));
    c.insert("dtype".into(), json!(torch_dtype(dtype)));
    for what in ["bos", "eos", "pad"] {
        if let Some(id) = token_id(md, what) {
            c.insert(format!("{what}_token_id"), json!(id));
        }
    }
    c.insert("use_cache".into(), json!(true));
    Value::Object(c)
}

/// torch's name of an element format.
fn torch_dtype(f: ElemFormat) -> &'static str {
    match f {
        ElemFormat::F32 => "float32",
        ElemFormat::F16 => "float16",
        ElemFormat::Bf16 => "bfloat16",
    }
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
    fn row_permutation_undoes_llama_cpp_interleaving() {
        // llama.cpp: gguf[h, i, j] = hf[h, j, i] for rows split [heads, half, 2].
        let p = RowGroups {
            groups: 3,
            group_rows: 8,
            row_elems: 5,
        };
        let half = 4;
        for h in 0..3 {
            for j in 0..2 {
                for i in 0..half {
                    let hf_row = h * 8 + j * half + i;
                    assert_eq!(p.gguf_row(hf_row), h * 8 + 2 * i + j);
                }
            }
        }
        let mut seen: Vec<u64> = (0..24).map(|r| p.gguf_row(r)).collect();
        seen.sort();
        assert_eq!(seen, (0..24).collect::<Vec<_>>());
    }
}
