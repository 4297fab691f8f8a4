//! What the llama-like families share: the GGUF tensor names and their
//! Hugging Face names, and the hyper-parameters `config.json` is written
//! from (`<arch>.*` keys).

use super::Architecture;
use crate::format::meta::{MetaValue, Metadata};

/// What a tensor is in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Embedding,
    OutputNorm,
    Output,
    AttnNorm,
    FfnNorm,
    /// Per-head RMS norm of the queries (qwen3).
    AttnQNorm,
    /// Per-head RMS norm of the keys (qwen3).
    AttnKNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
    /// The router of a mixture-of-experts layer (`ffn_gate_inp`).
    Router,
    /// A mixture-of-experts layer's experts, 3-D `[n_expert, d_out, d_in]`
    /// (`ffn_{gate,up,down}_exps`).
    ExpertsGate,
    ExpertsUp,
    ExpertsDown,
}

/// The Hugging Face name of a GGUF tensor of a llama-like model
/// (`model.layers.N.self_attn.q_proj.weight`, ...), with its role. Norms
/// have no bias; a layer number is canonical decimal.
pub fn llama_like_hf_name(gguf: &str) -> Option<(String, Role)> {
    match gguf {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), Role::Embedding)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), Role::OutputNorm)),
        "output.weight" => return Some(("lm_head.weight".into(), Role::Output)),
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
    let (hf, role) = match what {
        "attn_norm" => ("input_layernorm", Role::AttnNorm),
        "ffn_norm" => ("post_attention_layernorm", Role::FfnNorm),
        "attn_q" => ("self_attn.q_proj", Role::AttnQ),
        "attn_k" => ("self_attn.k_proj", Role::AttnK),
        "attn_v" => ("self_attn.v_proj", Role::AttnV),
        "attn_output" => ("self_attn.o_proj", Role::AttnOutput),
        "ffn_gate" => ("mlp.gate_proj", Role::FfnGate),
        "ffn_up" => ("mlp.up_proj", Role::FfnUp),
        "ffn_down" => ("mlp.down_proj", Role::FfnDown),
        _ => return None,
    };
    let norm = matches!(role, Role::AttnNorm | Role::FfnNorm);
    match kind {
        "weight" => {}
        "bias" if !norm => {}
        _ => return None,
    }
    Some((format!("model.layers.{layer}.{hf}.{kind}"), role))
}

/// The GGUF name and role of a llama-like model's Hugging Face tensor: the
/// exact inverse of [`llama_like_hf_name`] (what llama.cpp's
/// convert_hf_to_gguf.py names it).
pub fn llama_like_gguf_name(hf: &str) -> Option<(String, Role)> {
    match hf {
        "model.embed_tokens.weight" => return Some(("token_embd.weight".into(), Role::Embedding)),
        "model.norm.weight" => return Some(("output_norm.weight".into(), Role::OutputNorm)),
        "lm_head.weight" => return Some(("output.weight".into(), Role::Output)),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (what, kind) = rest.rsplit_once('.')?;
    let gguf = match what {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    let name = format!("blk.{layer}.{gguf}.{kind}");
    // The forward map decides what is a name (canonical layer numbers,
    // which tensors have a bias): only its images are inverted.
    let (back, role) = llama_like_hf_name(&name)?;
    (back == hf).then_some((name, role))
}

/// The weights every layer of a llama-like model has, by their Hugging
/// Face names after `model.layers.N.`.
pub const LLAMA_LIKE_LAYER_WEIGHTS: &[&str] = &[
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// What config.json says, from the GGUF key/values.
#[derive(Debug)]
pub struct HfParams {
    pub hidden: u64,
    pub ffn: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ctx: u64,
    pub eps: f64,
    pub theta: f64,
    /// Linear rope scaling factor.
    pub linear_scale: Option<f64>,
    /// The experts of a mixture-of-experts model.
    pub moe: Option<super::MoeParams>,
}

/// The experts of a model, from its `{arch}.expert_count`,
/// `expert_used_count` and `expert_feed_forward_length` (else
/// `feed_forward_length`) keys; None without experts.
pub fn moe_params(md: &Metadata) -> Result<Option<super::MoeParams>, String> {
    let arch = md.architecture().unwrap_or("");
    let n_expert = md.arch_u64("expert_count").unwrap_or(0);
    if n_expert == 0 {
        return Ok(None);
    }
    let n_used = md
        .arch_u64("expert_used_count")
        .filter(|&k| k >= 1 && k <= n_expert)
        .ok_or_else(|| {
            format!("{arch}.expert_used_count is missing or not in 1..={n_expert} (the experts)")
        })?;
    let expert_ff = match md.arch_u64("expert_feed_forward_length") {
        Some(f) if f > 0 => f,
        _ => md
            .get(&format!("{arch}.feed_forward_length"))
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| format!("the model metadata lacks {arch}.feed_forward_length"))?,
    };
    Ok(Some(super::MoeParams {
        n_expert,
        n_used,
        expert_ff,
    }))
}

fn key_u64(md: &Metadata, arch: &str, k: &str) -> Result<u64, String> {
    md.arch_u64(k)
        .ok_or_else(|| format!("the model metadata lacks {arch}.{k} (an unsigned integer)"))
}

/// The family of `md` (its mixture-of-experts form when it has experts:
/// [`Architecture::with_experts`]) and its hyper-parameters as Hugging
/// Face's config expresses them, or why they cannot be.
pub fn hf_params(md: &Metadata) -> Result<(&'static dyn Architecture, HfParams), String> {
    let name = md
        .architecture()
        .ok_or("the model metadata has no general.architecture (a bare SK32: mount it with --dense MODEL.gguf)")?;
    let arch = super::lookup(name).ok_or_else(|| {
        format!(
            "hf/ is offered for the {} architectures; general.architecture is {name:?}",
            super::supported_list(false)
        )
    })?;
    let moe = moe_params(md)?;
    let arch = match moe {
        Some(_) => arch.with_experts(),
        None => arch,
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
    Ok((
        arch,
        HfParams {
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
            moe,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_hugging_face_names() {
        let n = llama_like_hf_name;
        assert_eq!(
            n("blk.12.attn_q.weight"),
            Some((
                "model.layers.12.self_attn.q_proj.weight".into(),
                Role::AttnQ
            ))
        );
        assert_eq!(
            n("blk.0.attn_k.bias"),
            Some(("model.layers.0.self_attn.k_proj.bias".into(), Role::AttnK))
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
    fn hugging_face_names_map_back_to_gguf_names_exactly() {
        let mut names = vec![
            "token_embd.weight".to_string(),
            "output_norm.weight".into(),
            "output.weight".into(),
        ];
        for what in [
            "attn_norm",
            "ffn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            for kind in ["weight", "bias"] {
                names.push(format!("blk.17.{what}.{kind}"));
            }
        }
        let mut mapped = 0;
        for g in &names {
            if let Some((hf, role)) = llama_like_hf_name(g) {
                assert_eq!(llama_like_gguf_name(&hf), Some((g.clone(), role)), "{g}");
                mapped += 1;
            }
        }
        assert_eq!(mapped, 3 + 9 + 7);
        for bad in [
            "model.layers.01.self_attn.q_proj.weight",
            "model.layers.x.self_attn.q_proj.weight",
            "model.layers.0.input_layernorm.bias",
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            "model.layers.0.self_attn.q_proj.weight.extra",
            "embed_tokens.weight",
        ] {
            assert_eq!(llama_like_gguf_name(bad), None, "{bad}");
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
        let (a, p) = hf_params(&base("qwen2")).unwrap();
        assert_eq!((a.name(), p.head_dim, p.kv_heads), ("qwen2", 16, 2));
        let phi3 = hf_params(&base("phi3")).unwrap_err();
        assert!(phi3.contains("\"phi3\""), "{phi3}");
        assert!(phi3.contains(&crate::arch::supported_list(false)), "{phi3}");
        let mut partial = base("llama");
        partial.push("llama.rope.dimension_count", MetaValue::U32(8));
        assert!(hf_params(&partial).unwrap_err().contains("partial rotary"));
        let mut yarn = base("llama");
        yarn.push("llama.rope.scaling.type", MetaValue::String("yarn".into()));
        assert!(hf_params(&yarn).unwrap_err().contains("yarn"));
        let mut linear = base("llama");
        linear.push(
            "llama.rope.scaling.type",
            MetaValue::String("linear".into()),
        );
        linear.push("llama.rope.scaling.factor", MetaValue::F32(4.0));
        assert_eq!(hf_params(&linear).unwrap().1.linear_scale, Some(4.0));
    }
}
