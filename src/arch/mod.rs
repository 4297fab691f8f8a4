//! What a model family is, in one place per family: the roles of its
//! tensors and their Hugging Face names, how its attention rotates
//! query/key pairs (and so whether llama.cpp's converter permuted the Q/K
//! rows), which attention biases it has, the family's own `config.json`
//! fields and its tokenizer kind.
//!
//! `fs::hf` (the `hf/` view) and `probe` (the forward pass and its
//! hyper-parameters) ask [`lookup`] for the family of a GGUF's
//! `general.architecture` instead of matching architecture strings
//! themselves. Adding a family is one file here (a unit struct
//! implementing [`Architecture`], with its test) and one line in
//! [`FAMILIES`].
//!
//! This module sits low: it uses `format::meta` for the key/values and
//! nothing above it.

pub mod common;
pub mod hf_import;
pub mod llama;
pub mod mixtral;
pub mod moe;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3moe;
pub mod rows;

use std::fmt::Debug;

pub use common::{HfParams, Role, hf_params, moe_params};

/// Every family this crate understands, by `general.architecture`.
/// Two entries may share a `general.architecture` (llama.cpp stores
/// Mixtral as llama with experts): [`lookup`] finds the first, and
/// [`Architecture::with_experts`] the other.
pub static FAMILIES: &[&dyn Architecture] = &[
    &llama::Llama,
    &mixtral::Mixtral,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &qwen3moe::Qwen3Moe,
];

/// The family of a GGUF `general.architecture` value.
pub fn lookup(name: &str) -> Option<&'static dyn Architecture> {
    FAMILIES.iter().copied().find(|a| a.name() == name)
}

/// The family of a Hugging Face config.json's `model_type`.
pub fn lookup_hf(model_type: &str) -> Option<&'static dyn Architecture> {
    FAMILIES
        .iter()
        .copied()
        .find(|a| a.hf_model_type() == model_type)
}

/// The supported `general.architecture` values, for messages:
/// `"llama", "qwen2", "qwen3" and "qwen3moe"`.
pub fn supported_list(quoted: bool) -> String {
    let mut names: Vec<String> = FAMILIES
        .iter()
        .map(|a| match quoted {
            true => format!("{:?}", a.name()),
            false => a.name().to_string(),
        })
        .collect();
    // Mixtral is llama's name twice.
    names.dedup();
    match names.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

/// How a family's attention pairs the dimensions RoPE rotates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i + 1)` (llama.cpp's "normal" rope). Hugging Face
    /// rotates pairs `(i, i + n_rot/2)`, so llama.cpp's converter permuted
    /// each head's rows of Q and K (interleaving the two halves); `hf/`
    /// undoes it.
    Interleaved,
    /// Pairs `(i, i + n_rot/2)` (GPT-NeoX), as Hugging Face: the rows are
    /// stored as they are.
    Neox,
}

/// Which attention projections carry a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionBias {
    /// Always these (Hugging Face names `q_proj`, ...).
    Required(&'static [&'static str]),
    /// These when the model has `blk.0.attn_q.bias`, else none.
    Optional(&'static [&'static str]),
}

/// How the vocabulary is stored and rendered for `hf/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE in `tokenizer.ggml.*` (model `gpt2`), its split
    /// regex chosen by `tokenizer.ggml.pre`.
    ByteLevelBpe,
}

/// Where a GGUF tensor goes in a Hugging Face checkpoint: a tensor of
/// its own, or a part of one that transformers keeps fused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfPlace {
    pub name: String,
    pub role: Role,
    pub fused: Option<Fused>,
}

/// Part `index` of `of` GGUF tensors that, concatenated along dimension
/// `dim` (outer-first, the dimensions before it alike in every part), make
/// one Hugging Face tensor (transformers' `Concatenate(dim)`: a
/// mixture-of-experts layer's `gate_up_proj` is, per expert, the gate's
/// rows then the up's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fused {
    pub index: usize,
    pub of: usize,
    pub dim: usize,
}

/// What a mixture-of-experts model's config.json says of its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeParams {
    pub n_expert: u64,
    pub n_used: u64,
    /// Rows of each expert's gate and up.
    pub expert_ff: u64,
}

/// What a family adds to `config.json` beyond the fields every family
/// writes.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigExtras {
    /// Write `head_dim` even when it is `hidden_size / num_attention_heads`.
    pub always_head_dim: bool,
    /// Fields written after `rope_scaling`, in order.
    pub fields: Vec<(&'static str, serde_json::Value)>,
}

/// What a family's decoder block adds to the llama block (RMSNorm,
/// attention, SwiGLU feed-forward), for the forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Block {
    /// Queries and keys are RMS-normed per head (`attn_q_norm`,
    /// `attn_k_norm`, one weight of the head size each) before RoPE.
    pub qk_norm: bool,
}

/// One model family.
pub trait Architecture: Debug + Send + Sync {
    /// Its GGUF `general.architecture` (also the prefix of its keys).
    fn name(&self) -> &'static str;

    /// transformers' model class (`config.json`'s `architectures`).
    fn hf_class(&self) -> &'static str;

    /// transformers' `model_type`.
    fn hf_model_type(&self) -> &'static str;

    /// How RoPE pairs dimensions (and so whether Q/K rows are permuted).
    fn rope_layout(&self) -> RopeLayout;

    /// The attention projections with a bias.
    fn attention_bias(&self) -> AttentionBias;

    /// The Hugging Face name and role of a GGUF tensor, None when the
    /// family has no such tensor.
    fn hf_name(&self, gguf: &str) -> Option<(String, Role)>;

    /// The GGUF name and role of a Hugging Face tensor (the exact inverse
    /// of [`Self::hf_name`]), None when the family has no such tensor. The
    /// default is the llama-like table's; a family named otherwise
    /// overrides it.
    fn gguf_name(&self, hf: &str) -> Option<(String, Role)> {
        common::llama_like_gguf_name(hf)
    }

    /// Where the GGUF tensor `gguf` goes in a Hugging Face checkpoint as
    /// transformers loads it, None when the family has no such tensor. The
    /// default: a tensor of its own, named by [`Self::hf_name`].
    fn hf_place(&self, gguf: &str) -> Option<HfPlace> {
        self.hf_name(gguf).map(|(name, role)| HfPlace {
            name,
            role,
            fused: None,
        })
    }

    /// The family to render a model of this `general.architecture` as
    /// when it has experts (`{arch}.expert_count` > 0): itself, or another
    /// Hugging Face family (llama with experts is Mixtral).
    fn with_experts(&self) -> &'static dyn Architecture;

    /// The config.json fields of a model with experts `m` (the family's
    /// mixture-of-experts form), after [`Self::config_extras`]'s.
    fn config_moe_fields(&self, m: &MoeParams) -> Vec<(&'static str, serde_json::Value)> {
        let _ = m;
        Vec::new()
    }

    /// The GGUF 3-D expert tensor a checkpoint's per-expert tensor is a
    /// slab of (`model.layers.N.mlp.experts.E.gate_proj.weight` is slab E
    /// of `blk.N.ffn_gate_exps.weight`), its expert and role; None: not a
    /// per-expert tensor of this family.
    fn gguf_expert(&self, hf: &str) -> Option<(String, u64, Role)> {
        let _ = hf;
        None
    }

    /// The weights every layer has, by their Hugging Face names after
    /// `model.layers.N.` (the attention biases apart: [`Self::attention_bias`]).
    fn hf_layer_weights(&self) -> &'static [&'static str];

    /// The family's own `config.json` fields; `biased`: the model has
    /// attention biases.
    fn config_extras(&self, biased: bool) -> ConfigExtras;

    /// What its decoder block computes beyond the llama block.
    fn block(&self) -> Block {
        Block::default()
    }

    /// How it routes tokens to experts when the model has them
    /// (`{arch}.expert_count` > 0); None: the family has no
    /// mixture-of-experts form.
    fn moe_routing(&self) -> Option<moe::MoeRouting> {
        None
    }

    /// How its tokenizer is stored.
    fn tokenizer(&self) -> TokenizerKind {
        TokenizerKind::ByteLevelBpe
    }

    /// For a tensor of role `role`, the number of head groups whose rows
    /// llama.cpp's converter permuted (see [`RopeLayout::Interleaved`]),
    /// None when its rows are in Hugging Face order.
    fn permuted_row_groups(&self, role: Role, heads: u64, kv_heads: u64) -> Option<u64> {
        match (self.rope_layout(), role) {
            (RopeLayout::Interleaved, Role::AttnQ) => Some(heads),
            (RopeLayout::Interleaved, Role::AttnK) => Some(kv_heads),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_finds_each_family_by_its_name() {
        for a in FAMILIES {
            assert_eq!(lookup(a.name()).map(|f| f.name()), Some(a.name()));
        }
        assert!(lookup("phi3").is_none());
        assert!(lookup("").is_none());
        for a in FAMILIES {
            assert_eq!(
                lookup_hf(a.hf_model_type()).map(|f| f.name()),
                Some(a.name())
            );
        }
        assert!(lookup_hf("mistral").is_none());
        assert_eq!(
            supported_list(true),
            r#""llama", "qwen2", "qwen3" and "qwen3moe""#
        );
        assert_eq!(supported_list(false), "llama, qwen2, qwen3 and qwen3moe");
    }

    #[test]
    fn only_interleaved_rope_permutes_q_and_k() {
        let llama = lookup("llama").unwrap();
        let qwen2 = lookup("qwen2").unwrap();
        assert_eq!(llama.permuted_row_groups(Role::AttnQ, 8, 2), Some(8));
        assert_eq!(llama.permuted_row_groups(Role::AttnK, 8, 2), Some(2));
        assert_eq!(llama.permuted_row_groups(Role::AttnV, 8, 2), None);
        for r in [Role::AttnQ, Role::AttnK, Role::AttnV] {
            assert_eq!(qwen2.permuted_row_groups(r, 8, 2), None);
        }
    }
}
