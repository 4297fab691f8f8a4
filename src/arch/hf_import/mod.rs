//! A Hugging Face checkpoint's files (`config.json`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`) turned into the GGUF
//! key/values llama.cpp's `convert_hf_to_gguf.py` writes for the same
//! checkpoint, so that a safetensors source has the metadata every view,
//! the probe and the encoders read (`model.gguf`'s header, `hf/`'s files
//! rendered back from it, the probe's hyper-parameters and tokenizer).
//!
//! What is taken from where (the converter's rules, as of llama.cpp in
//! llama-cpp-python 0.3.36; tests/hf_import.rs compares with it):
//! - the family: `config.json`'s `model_type` ([`super::lookup_hf`]); a
//!   family this crate does not know gets `general.type` and
//!   `general.name` only, and a note;
//! - hyper-parameters ([`config`]): the first present of the converter's
//!   key lists (`num_hidden_layers`, `max_position_embeddings`, ...),
//!   `text_config` merged over the root as the converter does; the
//!   converter reads the config through transformers' config class, which
//!   fills defaults, so the few a config may omit take that class's
//!   defaults; the shape fields (hidden size, layers, heads, feed-forward
//!   size, vocabulary size) have none here: a config without one is refused,
//!   naming it;
//! - the tokenizer ([`tokenizer`]): byte-level BPE `tokenizer.json` only
//!   (model `BPE`, a `ByteLevel` pre-tokenizer), as the converter's GPT-2
//!   path and gguf-py's `SpecialVocab` read it.
//!
//! Not written, because they describe the tensors rather than the
//! checkpoint's files: `general.file_type`, `general.quantization_version`,
//! `general.size_label` (the caller knows the tensors). `general.name` is
//! the checkpoint's `_name_or_path` (its last path component) when
//! config.json has one, else the family's name: the converter takes the
//! directory's name or the model card, which these files do not carry.

pub mod config;
mod special;
pub mod tokenizer;

use serde_json::{Map, Value};

use crate::format::meta::{MetaValue, Metadata};

/// The files of a checkpoint, as read (their sizes bounded by the caller).
pub struct HfFiles<'a> {
    /// config.json (required).
    pub config: &'a [u8],
    /// tokenizer.json.
    pub tokenizer: Option<&'a [u8]>,
    /// tokenizer_config.json.
    pub tokenizer_config: Option<&'a [u8]>,
    /// generation_config.json.
    pub generation_config: Option<&'a [u8]>,
}

/// A checkpoint's GGUF-style metadata.
pub struct HfImport {
    /// None: a family this crate does not know.
    pub arch: Option<&'static dyn super::Architecture>,
    /// GGUF keys, as convert_hf_to_gguf.py writes them.
    pub metadata: crate::format::meta::Metadata,
    /// What could not be converted, for `inspect`.
    pub notes: Vec<String>,
}

/// Parse one of the checkpoint's JSON files into an object.
pub(crate) fn json_object(file: &str, bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(format!(
            "{file} is not a JSON object (it is {})",
            match other {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                Value::Array(_) => "an array",
                Value::Object(_) => "an object",
            }
        )),
        Err(e) => Err(format!("{file} is not valid JSON: {e}")),
    }
}

/// The GGUF key/values of a checkpoint, or why its config cannot give
/// them (not JSON, a required field missing or of the wrong type). What
/// could be read but not converted (an unknown family, a tokenizer that is
/// not byte-level BPE, a rope scaling llama.cpp takes from tensors) is a
/// note, not an error.
pub fn gguf_metadata(files: &HfFiles) -> Result<HfImport, String> {
    let root = json_object("config.json", files.config)?;
    let model_type = match root.get("model_type") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("config.json: model_type is not a string".to_string()),
        None => return Err("config.json lacks model_type (the model family)".to_string()),
    };
    // The converter moves text_config's fields to the root (multimodal
    // checkpoints keep the language model's there).
    let mut c = root.clone();
    if let Some(Value::Object(text)) = root.get("text_config") {
        for (k, v) in text {
            c.insert(k.clone(), v.clone());
        }
    }
    let mut md = Metadata::default();
    let mut notes = Vec::new();
    let arch = super::lookup_hf(&model_type);
    let name = general_name(&c, arch.map_or(model_type.as_str(), |a| a.name()));
    let Some(arch) = arch else {
        md.push("general.type", MetaValue::String("model".into()));
        md.push("general.name", MetaValue::String(name));
        notes.push(format!(
            "config.json's model_type {model_type:?} is not a family this build knows ({}): \
             no hyper-parameters or tokenizer were converted",
            super::supported_list(true)
        ));
        return Ok(HfImport {
            arch: None,
            metadata: md,
            notes,
        });
    };
    if let Some(Value::Array(classes)) = c.get("architectures")
        && let Some(first) = classes.first().and_then(Value::as_str)
        && first != arch.hf_class()
    {
        notes.push(format!(
            "config.json names the class {first:?}; converted as {} ({})",
            arch.name(),
            arch.hf_class()
        ));
    }
    md.push(
        "general.architecture",
        MetaValue::String(arch.name().into()),
    );
    md.push("general.type", MetaValue::String("model".into()));
    md.push("general.name", MetaValue::String(name));
    let params = config::hyper_params(&c, arch, &mut md, &mut notes)?;
    match files.tokenizer {
        None => notes.push("no tokenizer.json: the model has no tokenizer metadata".to_string()),
        Some(tok) => {
            let tok_config = match files.tokenizer_config {
                None => None,
                Some(b) => match json_object("tokenizer_config.json", b) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        notes.push(format!("{e}: it was not used"));
                        None
                    }
                },
            };
            let input = tokenizer::Input {
                tokenizer: tok,
                tokenizer_config: tok_config.as_ref(),
                config: &c,
                vocab_size: params.vocab_size,
                family: arch.name(),
            };
            match tokenizer::tokenizer_metadata(&input, &mut notes) {
                Ok(t) => md.entries.extend(t.entries),
                Err(why) => notes.push(format!("no tokenizer metadata: {why}")),
            }
        }
    }
    if let Some(g) = files.generation_config
        && let Err(e) = json_object("generation_config.json", g)
    {
        // The converter does not read it either; a broken one is worth a word.
        notes.push(format!("{e} (not used)"));
    }
    Ok(HfImport {
        arch: Some(arch),
        metadata: md,
        notes,
    })
}

/// `general.name`: the last component of config.json's `_name_or_path`
/// (what the checkpoint was saved from), else `fallback`.
fn general_name(c: &Map<String, Value>, fallback: &str) -> String {
    c.get("_name_or_path")
        .and_then(Value::as_str)
        .and_then(|p| p.trim_end_matches('/').rsplit('/').next())
        .filter(|s| !s.is_empty())
        .unwrap_or(fallback)
        .chars()
        .take(256)
        .collect()
}

#[cfg(test)]
mod tests;
