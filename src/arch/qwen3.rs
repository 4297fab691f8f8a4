//! qwen3: qwen2's GPT-NeoX RoPE without its biases, and a per-head RMS
//! norm of the queries and keys before RoPE (`blk.N.attn_q_norm.weight` ↔
//! `model.layers.N.self_attn.q_norm.weight`, one weight of the head size);
//! the head size is its own (`head_dim`), not hidden / heads.

use serde_json::json;

use super::common::{Role, llama_like_gguf_name, llama_like_hf_name};
use super::{Architecture, AttentionBias, Block, ConfigExtras, RopeLayout};

#[derive(Debug)]
pub struct Qwen3;

/// The weights every qwen3 layer has (after `model.layers.N.`).
pub(super) const LAYER_WEIGHTS: [&str; 11] = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// The q/k norms' GGUF and Hugging Face names after the layer prefix.
const QK_NORMS: [(&str, &str, Role); 2] = [
    (
        "attn_q_norm.weight",
        "self_attn.q_norm.weight",
        Role::AttnQNorm,
    ),
    (
        "attn_k_norm.weight",
        "self_attn.k_norm.weight",
        Role::AttnKNorm,
    ),
];

/// A canonical decimal layer number.
fn is_layer(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && !(s.len() > 1 && s.starts_with('0'))
}

impl Architecture for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }

    fn hf_class(&self) -> &'static str {
        "Qwen3ForCausalLM"
    }

    fn hf_model_type(&self) -> &'static str {
        "qwen3"
    }

    fn rope_layout(&self) -> RopeLayout {
        RopeLayout::Neox
    }

    fn attention_bias(&self) -> AttentionBias {
        AttentionBias::Required(&[])
    }

    fn hf_name(&self, gguf: &str) -> Option<(String, Role)> {
        if let Some((layer, rest)) = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.'))
            && let Some((_, hf, role)) = QK_NORMS.iter().find(|n| n.0 == rest)
        {
            return is_layer(layer).then(|| (format!("model.layers.{layer}.{hf}"), *role));
        }
        llama_like_hf_name(gguf)
    }

    fn gguf_name(&self, hf: &str) -> Option<(String, Role)> {
        if let Some((layer, rest)) = hf
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            && let Some((gguf, _, role)) = QK_NORMS.iter().find(|n| n.1 == rest)
        {
            return is_layer(layer).then(|| (format!("blk.{layer}.{gguf}"), *role));
        }
        llama_like_gguf_name(hf)
    }

    fn with_experts(&self) -> &'static dyn Architecture {
        &Qwen3
    }

    fn hf_layer_weights(&self) -> &'static [&'static str] {
        &LAYER_WEIGHTS
    }

    fn config_extras(&self, _biased: bool) -> ConfigExtras {
        // What Qwen3Config writes (its defaults where GGUF has no key).
        ConfigExtras {
            always_head_dim: true,
            fields: vec![
                ("attention_bias", json!(false)),
                ("attention_dropout", json!(0.0)),
                ("use_sliding_window", json!(false)),
                ("sliding_window", serde_json::Value::Null),
                ("max_window_layers", json!(28)),
            ],
        }
    }

    fn block(&self) -> Block {
        Block { qk_norm: true }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_norms_map_both_ways_and_the_rest_is_llama_like() {
        for (g, h, role) in [
            (
                "blk.3.attn_q_norm.weight",
                "model.layers.3.self_attn.q_norm.weight",
                Role::AttnQNorm,
            ),
            (
                "blk.10.attn_k_norm.weight",
                "model.layers.10.self_attn.k_norm.weight",
                Role::AttnKNorm,
            ),
            (
                "blk.0.attn_q.weight",
                "model.layers.0.self_attn.q_proj.weight",
                Role::AttnQ,
            ),
        ] {
            assert_eq!(Qwen3.hf_name(g), Some((h.to_string(), role)), "{g}");
            assert_eq!(Qwen3.gguf_name(h), Some((g.to_string(), role)), "{h}");
        }
        for bad in [
            "blk.01.attn_q_norm.weight",
            "blk.x.attn_k_norm.weight",
            "blk.0.attn_q_norm.bias",
        ] {
            assert_eq!(Qwen3.hf_name(bad), None, "{bad}");
        }
        assert_eq!(
            Qwen3.gguf_name("model.layers.01.self_attn.q_norm.weight"),
            None
        );
        assert_eq!(Qwen3.rope_layout(), RopeLayout::Neox);
        assert_eq!(Qwen3.permuted_row_groups(Role::AttnQ, 4, 2), None);
        assert!(Qwen3.block().qk_norm);
        assert!(Qwen3.config_extras(false).always_head_dim);
    }
}
