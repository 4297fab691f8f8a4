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
}
