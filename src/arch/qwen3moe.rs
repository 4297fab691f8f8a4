//! qwen3moe (transformers' `qwen3_moe`): qwen3's attention (NeoX RoPE,
//! per-head q/k norms, its own head size) with a mixture-of-experts
//! feed-forward in every layer: a router `blk.N.ffn_gate_inp.weight` ↔
//! `model.layers.N.mlp.gate.weight` and 3-D experts
//! `blk.N.ffn_{gate,up,down}_exps.weight` of
//! `{arch}.expert_feed_forward_length` rows each (see [`super::moe`]);
//! Hugging Face stores each expert as its own 2-D tensors
//! (`model.layers.N.mlp.experts.E.gate_proj.weight`), so the expert
//! tensors have no one Hugging Face name.

use super::common::{LLAMA_LIKE_LAYER_WEIGHTS, Role};
use super::moe::MoeRouting;
use super::qwen3::Qwen3;
use super::{Architecture, AttentionBias, Block, ConfigExtras, RopeLayout};

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
        if let Some((layer, "ffn_gate_inp.weight")) =
            gguf.strip_prefix("blk.").and_then(|r| r.split_once('.'))
        {
            return Qwen3
                .hf_name(&format!("blk.{layer}.attn_norm.weight"))
                .map(|_| {
                    (
                        format!("model.layers.{layer}.mlp.gate.weight"),
                        Role::Router,
                    )
                });
        }
        match Qwen3.hf_name(gguf)? {
            (_, Role::FfnGate | Role::FfnUp | Role::FfnDown) => None,
            other => Some(other),
        }
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

    fn hf_layer_weights(&self) -> &'static [&'static str] {
        // The attention's and the norms'; the experts are per expert.
        &LLAMA_LIKE_LAYER_WEIGHTS[..6]
    }

    fn config_extras(&self, biased: bool) -> ConfigExtras {
        Qwen3.config_extras(biased)
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
            Qwen3Moe.hf_name("blk.0.attn_k_norm.weight").map(|x| x.1),
            Some(Role::AttnKNorm)
        );
        assert!(Qwen3Moe.block().qk_norm);
        assert_eq!(Qwen3Moe.moe_routing(), Some(MoeRouting { norm_topk: true }));
    }
}
