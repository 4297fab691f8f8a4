//! llama (and mistral, which GGUF stores as llama): interleaved RoPE, so
//! llama.cpp's converter permuted the Q/K rows; attention biases only in
//! some fine-tunes (then on q, k, v and o).

use serde_json::json;

use super::common::{LLAMA_LIKE_LAYER_WEIGHTS, Role, llama_like_hf_name};
use super::moe::MoeRouting;
use super::{Architecture, AttentionBias, ConfigExtras, RopeLayout};

#[derive(Debug)]
pub struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn hf_class(&self) -> &'static str {
        "LlamaForCausalLM"
    }

    fn hf_model_type(&self) -> &'static str {
        "llama"
    }

    fn rope_layout(&self) -> RopeLayout {
        RopeLayout::Interleaved
    }

    fn attention_bias(&self) -> AttentionBias {
        AttentionBias::Optional(&["q_proj", "k_proj", "v_proj", "o_proj"])
    }

    fn hf_name(&self, gguf: &str) -> Option<(String, Role)> {
        llama_like_hf_name(gguf)
    }

    fn with_experts(&self) -> &'static dyn Architecture {
        &super::mixtral::Mixtral
    }

    fn hf_layer_weights(&self) -> &'static [&'static str] {
        LLAMA_LIKE_LAYER_WEIGHTS
    }

    /// Mixtral: llama.cpp's converter stores MixtralForCausalLM as llama
    /// with experts; its router soft-maxes, keeps the top k and
    /// renormalises them.
    fn moe_routing(&self) -> Option<MoeRouting> {
        Some(MoeRouting { norm_topk: true })
    }

    fn config_extras(&self, biased: bool) -> ConfigExtras {
        ConfigExtras {
            always_head_dim: true,
            fields: vec![
                ("attention_bias", json!(biased)),
                ("mlp_bias", json!(false)),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_is_interleaved_with_optional_biases() {
        assert_eq!(Llama.rope_layout(), RopeLayout::Interleaved);
        assert!(matches!(Llama.attention_bias(), AttentionBias::Optional(b) if b.len() == 4));
        let e = Llama.config_extras(true);
        assert!(e.always_head_dim);
        assert_eq!(e.fields[0], ("attention_bias", json!(true)));
        assert_eq!(
            Llama.hf_name("blk.1.attn_output.weight"),
            Some((
                "model.layers.1.self_attn.o_proj.weight".into(),
                Role::AttnOutput
            ))
        );
    }
}
