//! Mixtral (transformers' `mixtral`): llama's attention (interleaved RoPE,
//! so llama.cpp's converter permuted the Q/K rows; no biases) with a
//! mixture-of-experts feed-forward in every layer. llama.cpp stores it as
//! `general.architecture` llama with `llama.expert_count` > 0, so
//! [`super::lookup`] finds [`super::llama::Llama`] and its
//! [`Architecture::with_experts`] this family. The router and experts are
//! transformers' fused tensors ([`super::moe::fused_hf_place`]); each
//! expert's gate and up have `llama.feed_forward_length` rows (Mixtral's
//! `intermediate_size`). The router soft-maxes, keeps the top k and
//! renormalises them (`MixtralTopKRouter`).

use serde_json::json;

use super::common::{LLAMA_LIKE_LAYER_WEIGHTS, Role, llama_like_hf_name};
use super::moe::{self, MoeRouting};
use super::{Architecture, AttentionBias, ConfigExtras, HfPlace, MoeParams, RopeLayout};

#[derive(Debug)]
pub struct Mixtral;

/// The weights every Mixtral layer has (after `model.layers.N.`).
const LAYER_WEIGHTS: [&str; 9] = [
    LLAMA_LIKE_LAYER_WEIGHTS[0],
    LLAMA_LIKE_LAYER_WEIGHTS[1],
    LLAMA_LIKE_LAYER_WEIGHTS[2],
    LLAMA_LIKE_LAYER_WEIGHTS[3],
    LLAMA_LIKE_LAYER_WEIGHTS[4],
    LLAMA_LIKE_LAYER_WEIGHTS[5],
    moe::HF_LAYER_WEIGHTS[0],
    moe::HF_LAYER_WEIGHTS[1],
    moe::HF_LAYER_WEIGHTS[2],
];

impl Architecture for Mixtral {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn hf_class(&self) -> &'static str {
        "MixtralForCausalLM"
    }

    fn hf_model_type(&self) -> &'static str {
        "mixtral"
    }

    fn rope_layout(&self) -> RopeLayout {
        RopeLayout::Interleaved
    }

    fn attention_bias(&self) -> AttentionBias {
        AttentionBias::Required(&[])
    }

    fn hf_name(&self, gguf: &str) -> Option<(String, Role)> {
        if let Some(p) = moe::fused_hf_place(gguf) {
            return p.fused.is_none().then_some((p.name, p.role));
        }
        match llama_like_hf_name(gguf)? {
            (_, Role::FfnGate | Role::FfnUp | Role::FfnDown) => None,
            (n, _) if n.ends_with(".bias") => None,
            other => Some(other),
        }
    }

    fn hf_place(&self, gguf: &str) -> Option<HfPlace> {
        moe::fused_hf_place(gguf).or_else(|| {
            self.hf_name(gguf).map(|(name, role)| HfPlace {
                name,
                role,
                fused: None,
            })
        })
    }

    /// The checkpoint's names: transformers 5 saves Mixtral's router and
    /// experts under their original `block_sparse_moe.` names (its
    /// conversion renames them to `mlp.` on load); both are read.
    fn gguf_name(&self, hf: &str) -> Option<(String, Role)> {
        if let Some((layer, rest)) = hf
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            && matches!(rest, "block_sparse_moe.gate.weight" | "mlp.gate.weight")
        {
            let name = format!("blk.{layer}.ffn_gate_inp.weight");
            let canonical = self.hf_name(&name).is_some();
            return canonical.then_some((name, Role::Router));
        }
        match super::common::llama_like_gguf_name(hf)? {
            (_, Role::FfnGate | Role::FfnUp | Role::FfnDown) => None,
            (n, r) => self.hf_name(&n).is_some().then_some((n, r)),
        }
    }

    fn gguf_expert(&self, hf: &str) -> Option<(String, u64, Role)> {
        moe::per_expert_gguf(
            hf,
            &moe::PerExpertNames {
                block: "block_sparse_moe",
                weights: ["w1", "w3", "w2"],
            },
        )
    }

    fn with_experts(&self) -> &'static dyn Architecture {
        &Mixtral
    }

    fn hf_layer_weights(&self) -> &'static [&'static str] {
        &LAYER_WEIGHTS
    }

    fn config_extras(&self, _biased: bool) -> ConfigExtras {
        ConfigExtras {
            always_head_dim: true,
            fields: vec![("sliding_window", serde_json::Value::Null)],
        }
    }

    fn config_moe_fields(&self, m: &MoeParams) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("num_local_experts", json!(m.n_expert)),
            ("num_experts_per_tok", json!(m.n_used)),
        ]
    }

    fn moe_routing(&self) -> Option<MoeRouting> {
        Some(MoeRouting { norm_topk: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixtral_is_llama_with_fused_experts() {
        assert_eq!(Mixtral.name(), "llama");
        assert_eq!(
            super::super::lookup("llama").map(|a| a.hf_model_type()),
            Some("llama")
        );
        assert_eq!(
            super::super::lookup("llama").map(|a| a.with_experts().hf_model_type()),
            Some("mixtral")
        );
        assert_eq!(
            super::super::lookup_hf("mixtral").map(|a| a.name()),
            Some("llama")
        );
        assert_eq!(
            Mixtral.hf_place("blk.1.ffn_up_exps.weight").map(|p| p.name),
            Some("model.layers.1.mlp.experts.gate_up_proj".into())
        );
        assert_eq!(Mixtral.hf_name("blk.1.ffn_up_exps.weight"), None);
        assert_eq!(Mixtral.hf_name("blk.1.ffn_up.weight"), None);
        assert_eq!(
            Mixtral.hf_name("blk.1.ffn_gate_inp.weight"),
            Some(("model.layers.1.mlp.gate.weight".into(), Role::Router))
        );
        assert_eq!(
            Mixtral.permuted_row_groups(Role::AttnQ, 4, 2),
            Some(4),
            "llama's converter permuted Q"
        );
        assert_eq!(Mixtral.permuted_row_groups(Role::ExpertsGate, 4, 2), None);
    }
}
