//! qwen3moe (transformers' `qwen3_moe`): qwen3's attention (NeoX RoPE,
//! per-head q/k norms, its own head size) with a mixture-of-experts
//! feed-forward in every layer: a router `blk.N.ffn_gate_inp.weight` ↔
//! `model.layers.N.mlp.gate.weight` and 3-D experts
//! `blk.N.ffn_{gate,up,down}_exps.weight` of
//! `{arch}.expert_feed_forward_length` rows each, transformers' fused
//! `mlp.experts.gate_up_proj` / `down_proj` (see [`super::moe`]).
//! llama.cpp normalises the top-k weights (its `llm_build_moe_ffn` for
//! qwen3moe), so `hf/`'s config.json says `norm_topk_prob: true`; every
//! layer is sparse (`decoder_sparse_step` 1, no `mlp_only_layers`), as a
//! GGUF with experts in every layer is.

use serde_json::json;

use super::common::Role;
use super::moe::{self, MoeRouting};
use super::qwen3::{self, Qwen3};
use super::{Architecture, AttentionBias, Block, ConfigExtras, HfPlace, MoeParams, RopeLayout};

/// The weights every layer has (after `model.layers.N.`): qwen3's
/// attention and norms, the router and the fused experts.
const LAYER_WEIGHTS: [&str; 11] = [
    qwen3::LAYER_WEIGHTS[0],
    qwen3::LAYER_WEIGHTS[1],
    qwen3::LAYER_WEIGHTS[2],
    qwen3::LAYER_WEIGHTS[3],
    qwen3::LAYER_WEIGHTS[4],
    qwen3::LAYER_WEIGHTS[5],
    qwen3::LAYER_WEIGHTS[6],
    qwen3::LAYER_WEIGHTS[7],
    moe::HF_LAYER_WEIGHTS[0],
    moe::HF_LAYER_WEIGHTS[1],
    moe::HF_LAYER_WEIGHTS[2],
];

#[derive(Debug)]
pub struct Qwen3Moe;

impl Architecture for Qwen3Moe {
    fn name(&self) -> &'static str {
        "qwen3moe"
    }

    fn hf_class(&self) -> &'static str {
        "Qwen3MoeForCausalLM"
    }

    fn hf_model_type(&self) -> &'static str {
        "qwen3_moe"
    }

    fn rope_layout(&self) -> RopeLayout {
        RopeLayout::Neox
    }

    fn attention_bias(&self) -> AttentionBias {
        AttentionBias::Required(&[])
    }

    fn hf_name(&self, gguf: &str) -> Option<(String, Role)> {
        if let Some(p) = moe::fused_hf_place(gguf) {
            return p.fused.is_none().then_some((p.name, p.role));
        }
        match Qwen3.hf_name(gguf)? {
            (_, Role::FfnGate | Role::FfnUp | Role::FfnDown) => None,
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

    fn with_experts(&self) -> &'static dyn Architecture {
        &Qwen3Moe
    }

    fn gguf_name(&self, hf: &str) -> Option<(String, Role)> {
        if let Some((layer, "mlp.gate.weight")) = hf
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
        {
            let name = format!("blk.{layer}.ffn_gate_inp.weight");
            return (self.hf_name(&name)?.0 == hf).then_some((name, Role::Router));
        }
        match Qwen3.gguf_name(hf)? {
            (_, Role::FfnGate | Role::FfnUp | Role::FfnDown) => None,
            other => Some(other),
        }
    }

    fn gguf_expert(&self, hf: &str) -> Option<(String, u64, Role)> {
        moe::per_expert_gguf(
            hf,
            &moe::PerExpertNames {
                block: "mlp",
                weights: ["gate_proj", "up_proj", "down_proj"],
            },
        )
    }

    fn hf_layer_weights(&self) -> &'static [&'static str] {
        &LAYER_WEIGHTS
    }

    fn config_extras(&self, biased: bool) -> ConfigExtras {
        Qwen3.config_extras(biased)
    }

    fn config_moe_fields(&self, m: &MoeParams) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("num_experts", json!(m.n_expert)),
            ("num_experts_per_tok", json!(m.n_used)),
            ("moe_intermediate_size", json!(m.expert_ff)),
            ("norm_topk_prob", json!(true)),
            ("decoder_sparse_step", json!(1)),
            ("mlp_only_layers", json!([])),
        ]
    }

    fn block(&self) -> Block {
        Qwen3.block()
    }

    fn moe_routing(&self) -> Option<MoeRouting> {
        Some(MoeRouting { norm_topk: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_maps_both_ways_and_dense_ffn_names_are_not_its() {
        assert_eq!(
            Qwen3Moe.hf_name("blk.2.ffn_gate_inp.weight"),
            Some(("model.layers.2.mlp.gate.weight".into(), Role::Router))
        );
        assert_eq!(
            Qwen3Moe.gguf_name("model.layers.2.mlp.gate.weight"),
            Some(("blk.2.ffn_gate_inp.weight".into(), Role::Router))
        );
        assert_eq!(Qwen3Moe.hf_name("blk.02.ffn_gate_inp.weight"), None);
        assert_eq!(Qwen3Moe.hf_name("blk.0.ffn_up.weight"), None);
        assert_eq!(Qwen3Moe.hf_name("blk.0.ffn_up_exps.weight"), None);
        assert_eq!(
            Qwen3Moe
                .hf_place("blk.0.ffn_up_exps.weight")
                .and_then(|p| p.fused),
            Some(super::super::Fused {
                index: 1,
                of: 2,
                dim: 1
            })
        );
        assert_eq!(
            Qwen3Moe.hf_name("blk.0.ffn_down_exps.weight").map(|x| x.0),
            Some("model.layers.0.mlp.experts.down_proj".into())
        );
        assert_eq!(
            Qwen3Moe.hf_name("blk.0.attn_k_norm.weight").map(|x| x.1),
            Some(Role::AttnKNorm)
        );
        assert!(Qwen3Moe.block().qk_norm);
        assert_eq!(Qwen3Moe.moe_routing(), Some(MoeRouting { norm_topk: true }));
    }
}
