//! `tokenizer.ggml.*` of a byte-level BPE `tokenizer.json` (+
//! `tokenizer_config.json`, config.json's token ids), as
//! convert_hf_to_gguf.py's GPT-2 path (`get_vocab_base`) and gguf-py's
//! `SpecialVocab` write them:
//! - `tokens` by id, `vocab_size` of them (config.json's, else the
//!   vocabulary's size), added tokens included, a gap `[PAD{id}]`;
//! - `token_type`: 1 normal, 3 control (an added token marked special, or
//!   one that looks special: `<|...|>`, `<pad>`, ...), 4 user-defined (an
//!   added token that is neither; `▁` in it becomes a space), 5 a gap;
//! - `merges` (pairs joined by a space, a space inside a part spelled
//!   `Ġ`), the special token ids, `add_bos/eos/sep_token`, the chat
//!   template, the normalizer's lowercase/strip-accents flags, as
//!   `SpecialVocab` reads them;
//! - `pre`: the converter names the pre-tokenizer by hashing the token ids
//!   the Hugging Face tokenizer gives a fixed text (which depends on the
//!   vocabulary too); this crate cannot run that tokenizer, so `pre` is
//!   chosen from the pre-tokenizer's configuration, for the four kinds
//!   `probe`'s tokenizer implements: GPT-2's regex alone (`gpt-2`), digits
//!   split one by one before it (`smollm`; StarCoder's and others' are the
//!   same split, under their own names), Llama 3's regex (`llama-bpe`) and
//!   Qwen2's (`qwen2`). Anything else gets no `pre` and a note.

use serde_json::{Map, Value};

use super::config::{rules, string_array};
use super::special::{Added, special_vocab};
use crate::format::meta::{MetaType, MetaValue, Metadata};

/// Largest vocabulary and merge list converted (the largest real ones are
/// about 262k tokens); the arrays are sized by them.
const MAX_VOCAB: u64 = 1 << 21;
const MAX_MERGES: usize = 1 << 22;

/// GGUF token types (llama.cpp's `llama_token_type`).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// Llama 3's and Qwen2's split regexes, as their tokenizer.json files
/// spell them.
pub(super) const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What the tokenizer metadata is made from.
pub struct Input<'a> {
    /// tokenizer.json.
    pub tokenizer: &'a [u8],
    /// tokenizer_config.json, parsed.
    pub tokenizer_config: Option<&'a Map<String, Value>>,
    /// config.json, text_config merged.
    pub config: &'a Map<String, Value>,
    /// config.json's vocab_size.
    pub vocab_size: Option<u64>,
    /// The family ([`crate::arch::Architecture::name`]).
    pub family: &'static str,
}

/// The tokenizer key/values of `input`, or why there are none (the caller
/// makes it a note). Smaller things that do not convert are pushed to
/// `notes`.
pub fn tokenizer_metadata(input: &Input, notes: &mut Vec<String>) -> Result<Metadata, String> {
    let t = super::json_object("tokenizer.json", input.tokenizer)?;
    let model = match t.get("model") {
        Some(Value::Object(m)) => m,
        _ => return Err("tokenizer.json has no \"model\" object".to_string()),
    };
    match model.get("type").and_then(Value::as_str) {
        Some("BPE") => {}
        other => {
            return Err(format!(
                "tokenizer.json's model is {}: only byte-level BPE is converted",
                other.map_or("untyped".to_string(), |s| format!("{s:?}"))
            ));
        }
    }
    let pre = pre_type(t.get("pre_tokenizer"))?;
    let added = added_tokens(&t)?;
    let (tokens, types) = vocabulary(model, &added, input.vocab_size)?;
    let merges = merges(model)?;

    let mut md = Metadata::default();
    let r = rules(input.family);
    if r.is_some_and(|r| r.add_space_prefix)
        && let Some(Value::Bool(b)) = input
            .tokenizer_config
            .and_then(|tc| tc.get("add_prefix_space"))
    {
        md.push("tokenizer.ggml.add_space_prefix", MetaValue::Bool(*b));
    }
    md.push("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    match pre {
        Some(p) => md.push("tokenizer.ggml.pre", MetaValue::String(p.into())),
        None => notes.push(
            "tokenizer.json's pre-tokenizer is none of GPT-2's, SmolLM's (digits split), \
             Llama 3's or Qwen2's: tokenizer.ggml.pre is not set (llama.cpp then uses its \
             default split)"
                .to_string(),
        ),
    }
    md.push("tokenizer.ggml.tokens", string_array(tokens));
    md.push(
        "tokenizer.ggml.token_type",
        MetaValue::Array {
            elem: MetaType::I32,
            values: types.into_iter().map(MetaValue::I32).collect(),
        },
    );
    special_vocab(
        &t,
        input.tokenizer_config,
        input.config,
        &added,
        merges,
        &mut md,
        notes,
    );
    if let Some(n) = r.and_then(|r| r.no_bos_vocab)
        && input.vocab_size == Some(n)
    {
        set(
            &mut md,
            "tokenizer.ggml.add_bos_token",
            MetaValue::Bool(false),
        );
    }
    Ok(md)
}

/// Replace `key`'s value where it is, or append it (gguf-py's writer
/// overwrites a duplicated key in place).
fn set(md: &mut Metadata, key: &str, v: MetaValue) {
    match md.entries.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => md.push(key, v),
    }
}

/// The pre-tokenizer kind (module docs); an error when it is not
/// byte-level at all.
fn pre_type(pre: Option<&Value>) -> Result<Option<&'static str>, String> {
    let steps: Vec<&Value> = match pre {
        Some(p) if p.get("type").and_then(Value::as_str) == Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        Some(p) => vec![p],
        None => Vec::new(),
    };
    fn kind(v: &Value) -> &str {
        v.get("type").and_then(Value::as_str).unwrap_or("")
    }
    if !steps.iter().any(|s| kind(s) == "ByteLevel") {
        return Err(
            "tokenizer.json's pre-tokenizer has no ByteLevel step: not a byte-level BPE \
             tokenizer"
                .to_string(),
        );
    }
    // The tokenizers library's defaults for absent fields.
    let flag =
        |v: &Value, k: &str, default: bool| v.get(k).and_then(Value::as_bool).unwrap_or(default);
    let byte_level = |v: &Value, regex: bool| {
        kind(v) == "ByteLevel"
            && !flag(v, "add_prefix_space", true)
            && flag(v, "use_regex", true) == regex
    };
    let split = |v: &Value, re: &str| {
        kind(v) == "Split"
            && v.get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(Value::as_str)
                == Some(re)
            && v.get("behavior").and_then(Value::as_str) == Some("Isolated")
            && !flag(v, "invert", false)
    };
    Ok(match steps.as_slice() {
        [b] if byte_level(b, true) => Some("gpt-2"),
        [d, b]
            if kind(d) == "Digits"
                && flag(d, "individual_digits", false)
                && byte_level(b, true) =>
        {
            Some("smollm")
        }
        [s, b] if split(s, LLAMA3_REGEX) && byte_level(b, false) => Some("llama-bpe"),
        [s, b] if split(s, QWEN2_REGEX) && byte_level(b, false) => Some("qwen2"),
        _ => None,
    })
}

fn added_tokens(t: &Map<String, Value>) -> Result<Vec<Added>, String> {
    let Some(list) = t.get("added_tokens") else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .ok_or("tokenizer.json: added_tokens is not an array")?;
    let mut out = Vec::with_capacity(list.len());
    for (i, a) in list.iter().enumerate() {
        let id = a.get("id").and_then(Value::as_u64);
        let content = a.get("content").and_then(Value::as_str);
        let (Some(id), Some(content)) = (id, content) else {
            return Err(format!(
                "tokenizer.json: added_tokens[{i}] lacks an unsigned \"id\" or a string \"content\""
            ));
        };
        out.push(Added {
            id,
            content: content.to_string(),
            special: a.get("special").and_then(Value::as_bool).unwrap_or(false),
        });
    }
    Ok(out)
}

/// Whether the converter takes an added token that is not marked special
/// for a control token anyway (`does_token_look_special`).
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || t.starts_with("<|") && t.ends_with("|>")
        || t.starts_with("<｜") && t.ends_with("｜>")
        || t.starts_with("<unused") && t.ends_with('>')
}

/// Tokens and token types by id (module docs).
fn vocabulary(
    model: &Map<String, Value>,
    added: &[Added],
    vocab_size: Option<u64>,
) -> Result<(Vec<String>, Vec<i32>), String> {
    let vocab = match model.get("vocab") {
        Some(Value::Object(v)) => v,
        _ => return Err("tokenizer.json's model has no \"vocab\" object".to_string()),
    };
    // transformers' vocabulary: the model's, added tokens over it (a
    // spelling maps to one id; an added token's id is its token).
    let added_spellings: std::collections::HashSet<&str> =
        added.iter().map(|a| a.content.as_str()).collect();
    let mut by_id: std::collections::HashMap<u64, &str> = std::collections::HashMap::new();
    let mut spellings = added_spellings.len();
    for (tok, id) in vocab {
        let id = id.as_u64().ok_or_else(|| {
            format!(
                "tokenizer.json: the id of {} is not an unsigned integer",
                excerpt(tok)
            )
        })?;
        if !added_spellings.contains(tok.as_str()) {
            by_id.insert(id, tok);
            spellings += 1;
        }
    }
    for a in added {
        by_id.insert(a.id, &a.content);
    }
    let n = vocab_size.unwrap_or(spellings as u64);
    if n > MAX_VOCAB {
        return Err(format!(
            "a vocabulary of {n} tokens (at most {MAX_VOCAB} are converted)"
        ));
    }
    if let Some(&max) = by_id.keys().max()
        && max >= n
    {
        return Err(format!(
            "tokenizer.json has token id {max}, past the vocabulary size {n} (config.json's \
             vocab_size)"
        ));
    }
    let special: std::collections::HashMap<u64, bool> =
        added.iter().map(|a| (a.id, a.special)).collect();
    // Both below MAX_VOCAB.
    let mut tokens = Vec::with_capacity(n as usize);
    let mut types = Vec::with_capacity(n as usize);
    for i in 0..n {
        match by_id.get(&i) {
            None => {
                tokens.push(format!("[PAD{i}]"));
                types.push(UNUSED);
            }
            Some(&tok) if added_spellings.contains(tok) => {
                if special.get(&i).copied().unwrap_or(false) || looks_special(tok) {
                    tokens.push(tok.to_string());
                    types.push(CONTROL);
                } else {
                    tokens.push(tok.replace('\u{2581}', " "));
                    types.push(USER_DEFINED);
                }
            }
            Some(&tok) => {
                tokens.push(tok.to_string());
                types.push(NORMAL);
            }
        }
    }
    Ok((tokens, types))
}

fn excerpt(s: &str) -> String {
    let mut e: String = s.chars().take(32).collect();
    if e.len() < s.len() {
        e.push_str("...");
    }
    format!("{e:?}")
}

/// The merges as GGUF stores them: "a b" (a space inside a part of the
/// pair form spelled `Ġ`, as gguf-py does).
fn merges(model: &Map<String, Value>) -> Result<Vec<String>, String> {
    let Some(Value::Array(list)) = model.get("merges") else {
        return Ok(Vec::new());
    };
    if list.len() > MAX_MERGES {
        return Err(format!(
            "{} merges (at most {MAX_MERGES} are converted)",
            list.len()
        ));
    }
    let pairs = matches!(list.first(), Some(Value::Array(_)));
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let bad = || {
            format!(
                "tokenizer.json: merges[{i}] is not like merges[0] (a string or a pair of strings)"
            )
        };
        match (pairs, m) {
            (false, Value::String(s)) => out.push(s.clone()),
            (true, Value::Array(p)) => match p.as_slice() {
                [Value::String(a), Value::String(b)] => {
                    let sp = |s: &str| s.replace(' ', "\u{120}");
                    out.push(format!("{} {}", sp(a), sp(b)));
                }
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        }
    }
    Ok(out)
}
