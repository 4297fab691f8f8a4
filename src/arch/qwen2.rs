//! qwen2: GPT-NeoX RoPE (Q/K rows stored in Hugging Face order, as
//! transformers' GGUF loader reads them) and biases on q, k and v.

use serde_json::json;

use super::common::{LLAMA_LIKE_LAYER_WEIGHTS, Role, llama_like_hf_name};
use super::{Architecture, AttentionBias, ConfigExtras, RopeLayout};

#[derive(Debug)]
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }

    fn hf_class(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }

    fn hf_model_type(&self) -> &'static str {
        "qwen2"
    }

    fn rope_layout(&self) -> RopeLayout {
        RopeLayout::Neox
    }

    fn attention_bias(&self) -> AttentionBias {
        AttentionBias::Required(&["q_proj", "k_proj", "v_proj"])
    }

    fn hf_name(&self, gguf: &str) -> Option<(String, Role)> {
        llama_like_hf_name(gguf)
    }

    fn with_experts(&self) -> &'static dyn Architecture {
        &Qwen2
    }

    fn hf_layer_weights(&self) -> &'static [&'static str] {
        LLAMA_LIKE_LAYER_WEIGHTS
    }

    fn config_extras(&self, _biased: bool) -> ConfigExtras {
        ConfigExtras {
            always_head_dim: false,
            fields: vec![("use_sliding_window", json!(false))],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen2_is_neox_with_qkv_biases() {
        assert_eq!(Qwen2.rope_layout(), RopeLayout::Neox);
        assert_eq!(
            Qwen2.attention_bias(),
            AttentionBias::Required(&["q_proj", "k_proj", "v_proj"])
        );
        let e = Qwen2.config_extras(true);
        assert!(!e.always_head_dim);
        assert_eq!(e.fields, vec![("use_sliding_window", json!(false))]);
    }
}
