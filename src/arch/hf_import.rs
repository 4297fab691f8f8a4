//! A Hugging Face checkpoint's `config.json` (and tokenizer files) as the
//! GGUF-style key/values the views and the probe read.
//!
//! STUB for the safetensors reader's branch: the interface is the one
//! helper `hfmeta` implements in full (its file replaces this one at
//! merge); this body writes `general.architecture` (from `model_type`,
//! for the families [`super::lookup`] knows), `general.name` and the
//! hyper-parameters convert_hf_to_gguf.py writes from `config.json`; no
//! tokenizer.

use crate::format::meta::{MetaValue, Metadata};

/// The files of a checkpoint that describe it, as read.
pub struct HfFiles<'a> {
    /// `config.json` (required).
    pub config: &'a [u8],
    /// `tokenizer.json`.
    pub tokenizer: Option<&'a [u8]>,
    /// `tokenizer_config.json`.
    pub tokenizer_config: Option<&'a [u8]>,
    /// `generation_config.json`.
    pub generation_config: Option<&'a [u8]>,
}

/// What [`gguf_metadata`] made of them.
pub struct HfImport {
    /// None: a family we do not know.
    pub arch: Option<&'static dyn super::Architecture>,
    /// GGUF-style keys, as convert_hf_to_gguf.py writes them.
    pub metadata: Metadata,
    /// What could not be converted, for inspect.
    pub notes: Vec<String>,
}

/// The GGUF-style metadata of a checkpoint, or why `config.json` cannot be
/// read at all.
pub fn gguf_metadata(files: &HfFiles) -> Result<HfImport, String> {
    let config: serde_json::Value = serde_json::from_slice(files.config)
        .map_err(|e| format!("config.json is not valid JSON: {e}"))?;
    let Some(config) = config.as_object() else {
        return Err("config.json is not a JSON object".into());
    };
    let model_type = config.get("model_type").and_then(|v| v.as_str());
    let arch = model_type.and_then(|m| {
        super::FAMILIES
            .iter()
            .copied()
            .find(|a| a.hf_model_type() == m)
    });
    let mut metadata = Metadata::default();
    let mut notes = Vec::new();
    match (arch, model_type) {
        (Some(a), _) => {
            metadata.push("general.architecture", MetaValue::String(a.name().into()));
            hyper_parameters(config, a.name(), &mut metadata);
        }
        (None, Some(m)) => notes.push(format!(
            "config.json's model_type {m:?} is not a family this build knows ({})",
            super::supported_list(false)
        )),
        (None, None) => notes.push("config.json has no model_type".into()),
    }
    let name = config
        .get("_name_or_path")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .or(model_type);
    if let Some(n) = name {
        metadata.push("general.name", MetaValue::String(n.into()));
    }
    Ok(HfImport {
        arch,
        metadata,
        notes,
    })
}

/// `<arch>.*` from config.json's fields, those present.
fn hyper_parameters(
    config: &serde_json::Map<String, serde_json::Value>,
    arch: &str,
    md: &mut Metadata,
) {
    let u32_of = |k: &str| {
        config
            .get(k)
            .and_then(|v| v.as_u64())
            .and_then(|v| u32::try_from(v).ok())
    };
    for (hf, gguf) in [
        ("max_position_embeddings", "context_length"),
        ("hidden_size", "embedding_length"),
        ("num_hidden_layers", "block_count"),
        ("intermediate_size", "feed_forward_length"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("head_dim", "attention.key_length"),
        ("head_dim", "attention.value_length"),
        ("vocab_size", "vocab_size"),
    ] {
        if let Some(v) = u32_of(hf) {
            md.push(format!("{arch}.{gguf}"), MetaValue::U32(v));
        }
    }
    if let Some(eps) = config.get("rms_norm_eps").and_then(|v| v.as_f64()) {
        md.push(
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(eps as f32),
        );
    }
    let theta = config
        .get("rope_theta")
        .or_else(|| config.get("rope_parameters")?.get("rope_theta"))
        .and_then(|v| v.as_f64());
    if let Some(t) = theta {
        md.push(format!("{arch}.rope.freq_base"), MetaValue::F32(t as f32));
    }
}
