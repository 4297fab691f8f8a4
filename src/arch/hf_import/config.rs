//! The `{arch}.*` hyper-parameters of a checkpoint's config.json, as
//! convert_hf_to_gguf.py's `TextModel.set_gguf_parameters` (and the
//! family's class) writes them.

use serde_json::{Map, Value};

use super::super::Architecture;
use crate::format::meta::{MetaType, MetaValue, Metadata};

/// What the converter's class for a family does beyond the common rules,
/// and the defaults transformers' config class gives fields a config.json
/// may omit (the converter reads the config through that class).
#[derive(Debug)]
pub(crate) struct Rules {
    /// The family ([`Architecture::name`]).
    pub family: &'static str,
    /// Writes `{arch}.vocab_size` and `{arch}.rope.dimension_count`
    /// (llama's class does).
    pub vocab_and_rope_dims: bool,
    /// The config class has `head_dim` (defaulting to hidden / heads), so
    /// `key_length`/`value_length` are written even when config.json has
    /// none.
    pub config_head_dim: bool,
    /// The class's default `head_dim` when it is not hidden / heads.
    pub default_head_dim: Option<u32>,
    /// The class's default `max_position_embeddings`.
    pub default_ctx: u64,
    /// tokenizer_config.json's `add_prefix_space` becomes
    /// `tokenizer.ggml.add_space_prefix` (llama's `set_vocab`).
    pub add_space_prefix: bool,
    /// A `vocab_size` at which the class forces `add_bos_token` false
    /// (llama's rule for IBM granite's small models, which SmolLM2's
    /// 49152-token vocabulary meets too).
    pub no_bos_vocab: Option<u64>,
}

/// The rules of every family of [`super::super::FAMILIES`] (a unit test
/// checks that each has one).
// The converter's Qwen3Model is its Qwen2Model; Qwen3Config has a
// head_dim, 128 by default.
const QWEN3: Rules = Rules {
    family: "qwen3",
    vocab_and_rope_dims: false,
    config_head_dim: true,
    default_head_dim: Some(128),
    default_ctx: 32768,
    add_space_prefix: false,
    no_bos_vocab: None,
};

static RULES: &[Rules] = &[
    Rules {
        family: "llama",
        vocab_and_rope_dims: true,
        config_head_dim: true,
        default_head_dim: None,
        default_ctx: 2048,
        add_space_prefix: true,
        no_bos_vocab: Some(49152),
    },
    Rules {
        family: "qwen2",
        vocab_and_rope_dims: false,
        config_head_dim: false,
        default_head_dim: None,
        default_ctx: 32768,
        add_space_prefix: false,
        no_bos_vocab: None,
    },
    QWEN3,
    // The converter's Qwen3MoeModel: Qwen3's, plus the expert keys.
    Rules {
        family: "qwen3moe",
        ..QWEN3
    },
];

/// transformers' defaults for llama's, qwen2's and qwen3's classes alike.
const DEFAULT_ROPE_THETA: f64 = 10000.0;
const DEFAULT_RMS_EPS: f64 = 1e-6;

pub(crate) fn rules(family: &str) -> Option<&'static Rules> {
    RULES.iter().find(|r| r.family == family)
}

/// What the tokenizer needs from the config.
pub struct Params {
    /// config.json's `vocab_size`.
    pub vocab_size: Option<u64>,
}

/// The first of `keys` that config.json has (a null counts as absent),
/// with its name.
fn find<'a>(c: &'a Map<String, Value>, keys: &[&'static str]) -> Option<(&'static str, &'a Value)> {
    keys.iter()
        .find_map(|&k| c.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
}

fn u32_of(key: &str, v: &Value) -> Result<u32, String> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| format!("config.json: {key} is {v}, not an unsigned 32-bit integer"))
}

fn f32_of(key: &str, v: &Value) -> Result<f32, String> {
    v.as_f64()
        // The converter stores an f32 (an f64 past its range becomes inf).
        .map(|x| x as f32)
        .filter(|x| x.is_finite())
        .ok_or_else(|| format!("config.json: {key} is {v}, not a finite number"))
}

/// A required count: the first of `keys`, or an error naming `name`
/// (the usual one) and the others.
fn required(
    c: &Map<String, Value>,
    keys: &[&'static str],
    name: &str,
    what: &str,
) -> Result<u32, String> {
    match find(c, keys) {
        Some((k, v)) => u32_of(k, v),
        None => {
            let others: Vec<&str> = keys.iter().copied().filter(|k| *k != name).collect();
            Err(format!(
                "config.json lacks {name} ({what}; nor has it {})",
                others.join(", ")
            ))
        }
    }
}

const LAYER_KEYS: &[&str] = &["n_layers", "num_hidden_layers", "n_layer", "num_layers"];
const CTX_KEYS: &[&str] = &[
    "max_position_embeddings",
    "n_ctx",
    "n_positions",
    "max_length",
    "max_sequence_length",
    "model_max_length",
];
const EMBD_KEYS: &[&str] = &["hidden_size", "n_embd", "dim"];
const FF_KEYS: &[&str] = &[
    "prefix_dense_intermediate_size",
    "dense_intermediate_size",
    "intermediate_size",
    "n_inner",
    "hidden_dim",
];
const HEAD_KEYS: &[&str] = &["num_attention_heads", "n_head", "n_heads"];
const KV_KEYS: &[&str] = &["num_key_value_heads", "n_kv_heads"];
const THETA_KEYS: &[&str] = &[
    "global_rope_theta",
    "rope_global_theta",
    "rope_theta_global",
    "rope_theta",
    "rotary_emb_base",
];

/// Write the hyper-parameters of config `c` (text_config merged) for
/// family `arch` into `md`, in the converter's order.
pub fn hyper_params(
    c: &Map<String, Value>,
    arch: &dyn Architecture,
    md: &mut Metadata,
    notes: &mut Vec<String>,
) -> Result<Params, String> {
    let a = arch.name();
    let r = rules(a).ok_or_else(|| format!("no conversion rules for the {a} family"))?;
    let key = |k: &str| format!("{a}.{k}");
    let layers = required(c, LAYER_KEYS, "num_hidden_layers", "the layer count")?;
    let ctx = match find(c, CTX_KEYS) {
        Some((k, v)) => u32_of(k, v)?,
        None => u32::try_from(r.default_ctx).unwrap_or(u32::MAX),
    };
    let embd = required(c, EMBD_KEYS, "hidden_size", "the hidden size")?;
    let ff = required(c, FF_KEYS, "intermediate_size", "the feed-forward size")?;
    let heads = required(
        c,
        HEAD_KEYS,
        "num_attention_heads",
        "the attention head count",
    )?;
    let kv = match find(c, KV_KEYS) {
        Some((k, v)) => u32_of(k, v)?,
        None => heads,
    };
    if heads == 0 {
        return Err("config.json: num_attention_heads is 0".to_string());
    }
    md.push(key("block_count"), MetaValue::U32(layers));
    md.push(key("context_length"), MetaValue::U32(ctx));
    md.push(key("embedding_length"), MetaValue::U32(embd));
    md.push(key("feed_forward_length"), MetaValue::U32(ff));
    md.push(key("attention.head_count"), MetaValue::U32(heads));
    md.push(key("attention.head_count_kv"), MetaValue::U32(kv));
    if c.get("is_causal") == Some(&Value::Bool(false)) {
        md.push(key("attention.causal"), MetaValue::Bool(false));
    }
    let theta = rope(c, a, md, notes)?;
    md.push(key("rope.freq_base"), MetaValue::F32(theta));
    let eps = match find(c, &["rms_norm_eps", "norm_eps"]) {
        Some((k, v)) => f32_of(k, v)?,
        None => DEFAULT_RMS_EPS as f32,
    };
    md.push(key("attention.layer_norm_rms_epsilon"), MetaValue::F32(eps));
    if let Some((k, v)) = find(c, &["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"]) {
        md.push(
            key("attention.layer_norm_epsilon"),
            MetaValue::F32(f32_of(k, v)?),
        );
    }
    let head_dim = match c.get("head_dim").filter(|v| !v.is_null()) {
        Some(v) => Some(u32_of("head_dim", v)?),
        None if r.config_head_dim => Some(r.default_head_dim.unwrap_or(embd / heads)),
        None => None,
    };
    // TextModel's expert keys; the expert size is Qwen2/3-MoE's own.
    for (keys, gguf) in [
        (&["num_local_experts", "num_experts"][..], "expert_count"),
        (&["num_experts_per_tok"][..], "expert_used_count"),
        (&["moe_intermediate_size"][..], "expert_feed_forward_length"),
    ] {
        if let Some((k, v)) = find(c, keys) {
            md.push(key(gguf), MetaValue::U32(u32_of(k, v)?));
        }
    }
    if let Some(hd) = head_dim {
        md.push(key("attention.key_length"), MetaValue::U32(hd));
        md.push(key("attention.value_length"), MetaValue::U32(hd));
    }
    let vocab_size = match c.get("vocab_size").filter(|v| !v.is_null()) {
        Some(v) => Some(u32_of("vocab_size", v)?),
        None => None,
    };
    if r.vocab_and_rope_dims {
        let v = vocab_size.ok_or("config.json lacks vocab_size (the vocabulary size)")?;
        md.push(key("vocab_size"), MetaValue::U32(v));
        md.push(
            key("rope.dimension_count"),
            MetaValue::U32(head_dim.unwrap_or(embd / heads)),
        );
    }
    Ok(Params {
        vocab_size: vocab_size.map(u64::from),
    })
}

/// Write the rope scaling keys; returns the rope base.
fn rope(
    c: &Map<String, Value>,
    a: &str,
    md: &mut Metadata,
    notes: &mut Vec<String>,
) -> Result<f32, String> {
    // transformers 5 writes `rope_parameters`; older configs `rope_scaling`
    // and a root `rope_theta`.
    let (field, mut p) = match (c.get("rope_parameters"), c.get("rope_scaling")) {
        (Some(Value::Object(p)), _) => ("rope_parameters", p.clone()),
        (_, Some(Value::Object(p))) => ("rope_scaling", p.clone()),
        _ => ("rope_parameters", Map::new()),
    };
    if !p.contains_key("full_attention") && !p.contains_key("sliding_attention") {
        if !p.contains_key("rope_theta")
            && let Some((_, v)) = find(c, THETA_KEYS)
        {
            p.insert("rope_theta".into(), v.clone());
        }
        if !p.contains_key("rope_type")
            && let Some(t) = p.get("type").cloned()
        {
            p.insert("rope_type".into(), t);
        }
    }
    let (field, p) = match p.get("full_attention") {
        Some(Value::Object(full)) => (format!("{field}.full_attention"), full.clone()),
        _ => (field.to_string(), p),
    };
    let get = |k: &str| p.get(k).filter(|v| !v.is_null());
    let named = |k: &str| format!("{field}.{k}");
    let key = |k: &str| format!("{a}.rope.scaling.{k}");
    let factor = match get("factor") {
        Some(v) => Some(f32_of(&named("factor"), v)?),
        None => None,
    };
    match (get("rope_type").and_then(Value::as_str), factor) {
        (Some("linear"), Some(f)) => {
            md.push(key("type"), MetaValue::String("linear".into()));
            md.push(key("factor"), MetaValue::F32(f));
        }
        (Some("yarn"), Some(f)) => {
            md.push(key("type"), MetaValue::String("yarn".into()));
            md.push(key("factor"), MetaValue::F32(f));
            let orig = named("original_max_position_embeddings");
            let v = get("original_max_position_embeddings")
                .ok_or_else(|| format!("config.json: yarn rope scaling lacks {orig}"))?;
            md.push(
                key("original_context_length"),
                MetaValue::U32(u32_of(&orig, v)?),
            );
            for (hf, gguf) in [
                ("extrapolation_factor", "yarn_ext_factor"),
                ("attention_factor", "yarn_attn_factor"),
                ("attn_factor", "yarn_attn_factor"),
                ("beta_fast", "yarn_beta_fast"),
                ("beta_slow", "yarn_beta_slow"),
            ] {
                if let Some(v) = get(hf)
                    && md.get(&key(gguf)).is_none()
                {
                    md.push(key(gguf), MetaValue::F32(f32_of(&named(hf), v)?));
                }
            }
        }
        (Some("su" | "longrope"), _) => {
            md.push(key("type"), MetaValue::String("longrope".into()));
            notes.push(format!(
                "{field}: longrope scaling's factors are tensors the converter writes per \
                 family; only the type was converted"
            ));
        }
        (Some(t), _) if t.eq_ignore_ascii_case("llama3") => notes.push(format!(
            "{field}: llama3 rope scaling is a rope_freqs.weight tensor the converter \
             computes; it is not in the metadata"
        )),
        (None | Some("default" | "dynamic" | "linear" | "yarn"), _) => {}
        (Some(t), _) => notes.push(format!("{field}: rope type {t:?} is not converted")),
    }
    match get("rope_theta") {
        Some(v) => f32_of(&named("rope_theta"), v),
        None => Ok(DEFAULT_ROPE_THETA as f32),
    }
}

/// The array type of a list of strings (for the tokenizer module).
pub(crate) fn string_array(values: Vec<String>) -> MetaValue {
    MetaValue::Array {
        elem: MetaType::String,
        values: values.into_iter().map(MetaValue::String).collect(),
    }
}
