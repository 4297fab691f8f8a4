//! What the mixture-of-experts families share: how a token is routed to
//! its experts, and the GGUF names of the router and the expert tensors.
//!
//! llama.cpp stores a layer's experts as 3-D tensors
//! `blk.N.ffn_{gate,up,down}_exps.weight`, served outer-first as
//! `[n_expert, d_out, d_in]` (expert `e`'s matrix is the `e`-th
//! `d_out × d_in` slab), and the router as `blk.N.ffn_gate_inp.weight`,
//! `[n_expert, d_model]`.
//!
//! Routing, as transformers' `MixtralSparseMoeBlock` and
//! `Qwen3MoeSparseMoeBlock` and llama.cpp's `llm_build_moe_ffn` (softmax
//! gating) do it: the router's logits are soft-maxed over every expert,
//! the `k` largest probabilities are kept (ties to the lower index), and,
//! when the family normalises them (Mixtral always; Qwen3-MoE with
//! `norm_topk_prob`, which llama.cpp assumes), divided by their sum. The
//! layer's output is the weighted sum of the chosen experts' SwiGLU
//! feed-forwards.

//! transformers (5.x) keeps a layer's experts fused, 3-D, as Mixtral's and
//! Qwen3-MoE's `*Experts` modules hold them: `mlp.experts.gate_up_proj`
//! `[n_expert, 2 d_ff, d_model]` (per expert its gate's rows, then its
//! up's: `Concatenate(dim=1)` in its checkpoint conversion) and
//! `mlp.experts.down_proj` `[n_expert, d_model, d_ff]` (llama.cpp's
//! `ffn_down_exps` as it is), the router `mlp.gate.weight`. Checkpoints
//! saved per expert (`mlp.experts.E.gate_proj.weight`, Mixtral's
//! `block_sparse_moe.experts.E.w1.weight`) are converted to that on load;
//! `hf/` serves the fused form, which loads without a conversion.

use super::common::Role;
use super::{Fused, HfPlace};

/// How a family weighs its chosen experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeRouting {
    /// The top-k probabilities are divided by their sum.
    pub norm_topk: bool,
}

/// The router (gate) of layer `layer`'s experts.
pub fn router_name(layer: usize) -> String {
    format!("blk.{layer}.ffn_gate_inp.weight")
}

/// The 3-D expert tensors of layer `layer`: gate, up, down.
pub fn expert_names(layer: usize) -> [String; 3] {
    ["gate", "up", "down"].map(|w| format!("blk.{layer}.ffn_{w}_exps.weight"))
}

/// The Hugging Face (transformers 5, fused) layer weights of a
/// mixture-of-experts feed-forward, after `model.layers.N.`.
pub const HF_LAYER_WEIGHTS: [&str; 3] = [
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
];

/// Where a router or expert tensor goes in transformers' fused layout
/// (see the module documentation), None for any other tensor. `is_layer`
/// says whether a layer number is the family's (canonical decimal).
pub fn fused_hf_place(gguf: &str) -> Option<HfPlace> {
    let (layer, what) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let canonical = !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && !(layer.len() > 1 && layer.starts_with('0'));
    if !canonical {
        return None;
    }
    let part = |index| {
        Some(Fused {
            index,
            of: 2,
            dim: 1,
        })
    };
    let (hf, role, fused) = match what {
        "ffn_gate_inp.weight" => (HF_LAYER_WEIGHTS[0], Role::Router, None),
        "ffn_gate_exps.weight" => (HF_LAYER_WEIGHTS[1], Role::ExpertsGate, part(0)),
        "ffn_up_exps.weight" => (HF_LAYER_WEIGHTS[1], Role::ExpertsUp, part(1)),
        "ffn_down_exps.weight" => (HF_LAYER_WEIGHTS[2], Role::ExpertsDown, None),
        _ => return None,
    };
    Some(HfPlace {
        name: format!("model.layers.{layer}.{hf}"),
        role,
        fused,
    })
}

/// How a family's checkpoints name each expert's weights: the block
/// holding the experts (`mlp`, Mixtral's `block_sparse_moe`) and the names
/// of its gate, up and down (`gate_proj`/`up_proj`/`down_proj`, Mixtral's
/// `w1`/`w3`/`w2`).
#[derive(Debug, Clone, Copy)]
pub struct PerExpertNames {
    pub block: &'static str,
    pub weights: [&'static str; 3],
}

/// The GGUF 3-D tensor a per-expert checkpoint tensor
/// (`model.layers.N.{block}.experts.E.{weight}.weight`) is a slab of, its
/// expert E and role; None for any other name. Layer and expert numbers
/// are canonical decimal.
pub fn per_expert_gguf(hf: &str, names: &PerExpertNames) -> Option<(String, u64, Role)> {
    let canonical = |s: &str| {
        !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && !(s.len() > 1 && s.starts_with('0'))
    };
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let rest = rest.strip_prefix(names.block)?.strip_prefix(".experts.")?;
    let (expert, rest) = rest.split_once('.')?;
    let weight = rest.strip_suffix(".weight")?;
    if !canonical(layer) || !canonical(expert) {
        return None;
    }
    let k = names.weights.iter().position(|w| *w == weight)?;
    let role = [Role::ExpertsGate, Role::ExpertsUp, Role::ExpertsDown][k];
    let what = ["gate", "up", "down"][k];
    Some((
        format!("blk.{layer}.ffn_{what}_exps.weight"),
        expert.parse().ok()?,
        role,
    ))
}

/// Whether a GGUF tensor name is a router or an expert tensor.
pub fn is_moe_tensor(gguf: &str) -> bool {
    let Some(what) = gguf
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .map(|(_, w)| w)
    else {
        return false;
    };
    matches!(
        what,
        "ffn_gate_inp.weight"
            | "ffn_gate_exps.weight"
            | "ffn_up_exps.weight"
            | "ffn_down_exps.weight"
    )
}

/// The `k` experts of one token and their weights, from the router's
/// `logits` (one per expert), into `out` (cleared first). `k` is at most
/// `logits.len()`; non-finite logits rank below every finite one.
pub fn route(logits: &[f32], k: usize, routing: MoeRouting, out: &mut Vec<(usize, f32)>) {
    out.clear();
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = logits
        .iter()
        .map(|&v| if v.is_finite() { (v - max).exp() } else { 0.0 })
        .collect();
    let total: f32 = probs.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable: equal probabilities keep the lower expert first.
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    for &e in order.iter().take(k) {
        out.push((e, if total > 0.0 { probs[e] / total } else { 0.0 }));
    }
    if routing.norm_topk {
        let sum: f32 = out.iter().map(|x| x.1).sum();
        if sum > 0.0 {
            for x in out.iter_mut() {
                x.1 /= sum;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_of_the_softmax_renormalised_or_not() {
        let mut out = Vec::new();
        let logits = [0.0f32, 2.0, 1.0, 2.0];
        route(&logits, 2, MoeRouting { norm_topk: false }, &mut out);
        let e: Vec<usize> = out.iter().map(|x| x.0).collect();
        assert_eq!(e, vec![1, 3], "ties go to the lower expert");
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!((out[0].1 - 2f32.exp() / z).abs() < 1e-6);
        route(&logits, 2, MoeRouting { norm_topk: true }, &mut out);
        assert!((out[0].1 - 0.5).abs() < 1e-6 && (out[1].1 - 0.5).abs() < 1e-6);
        route(
            &[f32::NAN, 1.0],
            1,
            MoeRouting { norm_topk: true },
            &mut out,
        );
        assert_eq!(out, vec![(1, 1.0)]);
        assert!(is_moe_tensor("blk.3.ffn_up_exps.weight"));
        assert!(is_moe_tensor("blk.0.ffn_gate_inp.weight"));
        assert!(!is_moe_tensor("blk.0.ffn_up.weight"));
        assert_eq!(expert_names(2)[2], "blk.2.ffn_down_exps.weight");
    }

    #[test]
    fn per_expert_checkpoint_names_are_slabs_of_the_gguf_experts() {
        let mixtral = PerExpertNames {
            block: "block_sparse_moe",
            weights: ["w1", "w3", "w2"],
        };
        assert_eq!(
            per_expert_gguf(
                "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                &mixtral
            ),
            Some(("blk.1.ffn_up_exps.weight".into(), 3, Role::ExpertsUp))
        );
        assert_eq!(
            per_expert_gguf(
                "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                &mixtral
            ),
            Some(("blk.1.ffn_down_exps.weight".into(), 0, Role::ExpertsDown))
        );
        for bad in [
            "model.layers.1.block_sparse_moe.experts.03.w1.weight",
            "model.layers.1.block_sparse_moe.experts.3.w4.weight",
            "model.layers.1.mlp.experts.3.w1.weight",
            "model.layers.1.block_sparse_moe.experts.3.w1.bias",
            "model.layers.1.block_sparse_moe.gate.weight",
        ] {
            assert_eq!(per_expert_gguf(bad, &mixtral), None, "{bad}");
        }
    }

    #[test]
    fn experts_go_to_transformers_fused_tensors() {
        use super::super::MoeParams;
        use super::super::common::moe_params;
        use crate::format::meta::{MetaValue, Metadata};
        let p = |n: &str| fused_hf_place(n).map(|p| (p.name, p.role, p.fused));
        let gate_up = "model.layers.3.mlp.experts.gate_up_proj".to_string();
        let fused = |index| {
            Some(Fused {
                index,
                of: 2,
                dim: 1,
            })
        };
        assert_eq!(
            p("blk.3.ffn_gate_exps.weight"),
            Some((gate_up.clone(), Role::ExpertsGate, fused(0)))
        );
        assert_eq!(
            p("blk.3.ffn_up_exps.weight"),
            Some((gate_up, Role::ExpertsUp, fused(1)))
        );
        assert_eq!(
            p("blk.3.ffn_down_exps.weight"),
            Some((
                "model.layers.3.mlp.experts.down_proj".into(),
                Role::ExpertsDown,
                None
            ))
        );
        assert_eq!(
            p("blk.10.ffn_gate_inp.weight"),
            Some(("model.layers.10.mlp.gate.weight".into(), Role::Router, None))
        );
        for other in [
            "blk.03.ffn_up_exps.weight",
            "blk.0.ffn_up.weight",
            "output.weight",
        ] {
            assert_eq!(p(other), None, "{other}");
        }
        let mut md = Metadata::default();
        assert_eq!(moe_params(&md), Ok(None));
        md.push("general.architecture", MetaValue::String("qwen3moe".into()));
        md.push("qwen3moe.feed_forward_length", MetaValue::U32(96));
        md.push("qwen3moe.expert_count", MetaValue::U32(4));
        assert!(moe_params(&md).unwrap_err().contains("expert_used_count"));
        md.push("qwen3moe.expert_used_count", MetaValue::U32(2));
        let want = MoeParams {
            n_expert: 4,
            n_used: 2,
            expert_ff: 96,
        };
        assert_eq!(moe_params(&md), Ok(Some(want)));
        md.push("qwen3moe.expert_feed_forward_length", MetaValue::U32(48));
        assert_eq!(moe_params(&md).unwrap().unwrap().expert_ff, 48);
    }
}
