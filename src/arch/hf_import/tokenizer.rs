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
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

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

/// One added token of tokenizer.json.
struct Added {
    id: u64,
    content: String,
    special: bool,
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
    special_vocab(&t, input, &added, merges, &mut md, notes);
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

/// Set `k` in the tokenizer config when there is one (gguf-py edits its
/// copy as it goes).
fn put(tc: &mut Option<Map<String, Value>>, k: &str, v: Value) {
    if let Some(m) = tc.as_mut() {
        m.insert(k.to_string(), v);
    }
}

/// A JSON value Python takes for true (a non-empty string or object, ...).
fn truthy(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Bool(true)) => true,
    }
}

fn is(v: &Option<Value>, s: &str) -> bool {
    v.as_ref().and_then(Value::as_str) == Some(s)
}

/// The `SpecialToken` id of a template entry.
fn special_id(entry: Option<&Value>) -> Option<String> {
    entry?
        .get("SpecialToken")?
        .get("id")?
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// gguf-py's `SpecialVocab` (load_merges): merges, special token ids,
/// add-token flags, chat template, normalizer flags, appended to `md` in
/// its order.
fn special_vocab(
    t: &Map<String, Value>,
    input: &Input,
    added: &[Added],
    merges: Vec<String>,
    md: &mut Metadata,
    notes: &mut Vec<String>,
) {
    let mut types: Vec<&'static str> = vec!["bos", "eos", "unk", "sep", "pad", "cls", "mask"];
    let mut add: Vec<(&str, bool)> = Vec::new();
    let set_add =
        |add: &mut Vec<(&'static str, bool)>, typ: &'static str, v: bool, keep: bool| match add
            .iter_mut()
            .find(|(k, _)| *k == typ)
        {
            Some(e) if !keep => e.1 = v,
            Some(_) => {}
            None => add.push((typ, v)),
        };
    let mut tc = input.tokenizer_config.cloned();
    let get =
        |tc: &Option<Map<String, Value>>, k: &str| tc.as_ref().and_then(|m| m.get(k)).cloned();
    let mut bos = get(&tc, "bos_token");
    let mut cls = get(&tc, "cls_token");
    let mut eos = get(&tc, "eos_token");
    let mut sep = get(&tc, "sep_token");
    let has_tc = |tc: &Option<Map<String, Value>>| tc.as_ref().is_some_and(|m| !m.is_empty());
    if !truthy(&bos) && truthy(&cls) && has_tc(&tc) {
        bos = cls.clone();
        put(&mut tc, "bos_token", bos.clone().unwrap_or(Value::Null));
    }
    if !truthy(&eos) && truthy(&sep) && has_tc(&tc) {
        eos = sep.clone();
        put(&mut tc, "eos_token", eos.clone().unwrap_or(Value::Null));
    }
    let processors: Vec<&Value> = match t.get("post_processor") {
        Some(p @ Value::Object(o)) => match o.get("processors").and_then(Value::as_array) {
            Some(list) => list.iter().collect(),
            None => vec![p],
        },
        _ => Vec::new(),
    };
    for p in processors {
        match p.get("type").and_then(Value::as_str) {
            Some("ByteLevel") => {
                set_add(&mut add, "bos", false, true);
                set_add(&mut add, "eos", false, true);
            }
            Some("RobertaProcessing") => {
                for typ in ["bos", "eos", "sep"] {
                    set_add(&mut add, typ, true, false);
                }
                let first = |k: &str, default: &Option<Value>| {
                    p.get(k)
                        .and_then(Value::as_array)
                        .and_then(|a| a.first().cloned())
                        .or_else(|| default.clone())
                };
                if !truthy(&cls) && has_tc(&tc) {
                    cls = first("cls", &bos);
                    put(&mut tc, "cls_token", cls.clone().unwrap_or(Value::Null));
                }
                if !truthy(&sep) && has_tc(&tc) {
                    sep = first("sep", &eos);
                    put(&mut tc, "sep_token", sep.clone().unwrap_or(Value::Null));
                }
            }
            Some("TemplateProcessing") => {
                let list = |k: &str| {
                    p.get(k)
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default()
                };
                let single = list("single");
                let pair = list("pair");
                let mut special_first = None;
                let mut special_last = None;
                if single.len() > 1 {
                    if let Some(f) = special_id(single.first()) {
                        if !has_tc(&tc) {
                            bos = Some(Value::String(f.clone()));
                        } else if !is(&bos, &f) && !is(&cls, &f) {
                            if !truthy(&bos) {
                                bos = Some(Value::String(f.clone()));
                                put(&mut tc, "bos_token", Value::String(f.clone()));
                            }
                            if !truthy(&cls) {
                                cls = Some(Value::String(f.clone()));
                                put(&mut tc, "cls_token", Value::String(f.clone()));
                            }
                        }
                        set_add(&mut add, "bos", is(&bos, &f) || is(&cls, &f), false);
                        special_first = Some(f);
                    }
                    if let Some(l) = special_id(single.last()) {
                        if !has_tc(&tc) {
                            eos = Some(Value::String(l.clone()));
                        } else if !is(&eos, &l) {
                            let old = eos.clone().unwrap_or(Value::Null);
                            if !types.contains(&"eot") {
                                types.push("eot");
                                put(&mut tc, "eot_token", old);
                            } else if !types.contains(&"eom") {
                                types.push("eom");
                                put(&mut tc, "eom_token", old);
                            }
                            eos = Some(Value::String(l.clone()));
                            put(&mut tc, "eos_token", Value::String(l.clone()));
                        }
                        set_add(&mut add, "eos", is(&eos, &l), false);
                        special_last = Some(l);
                    }
                }
                if !pair.is_empty() {
                    let start = usize::from(
                        special_first.is_some() && special_id(pair.first()) == special_first,
                    );
                    let stop = pair.len()
                        - usize::from(
                            special_last.is_some() && special_id(pair.last()) == special_last,
                        );
                    let mid = pair.get(start..stop.max(start)).unwrap_or(&[]);
                    let seq = |v: Option<&Value>| {
                        v.and_then(|v| v.get("Sequence"))
                            .and_then(|s| s.get("id"))
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    };
                    if !mid.is_empty()
                        && seq(mid.first()).as_deref() == Some("A")
                        && seq(mid.last()).as_deref() == Some("B")
                        && mid.len() > 2
                    {
                        let inner = &mid[1..mid.len() - 1];
                        let mut add_sep = false;
                        if let Some(e) = special_id(inner.first())
                            && (is(&sep, &e) || is(&eos, &e))
                            && special_last.is_none()
                        {
                            add_sep = true;
                        }
                        if inner.len() == 2
                            && let Some(e) = special_id(inner.get(1))
                            && (is(&sep, &e) || is(&eos, &e))
                        {
                            add_sep = true;
                        }
                        set_add(&mut add, "sep", add_sep, false);
                        if add_sep && !truthy(&sep) && has_tc(&tc) {
                            put(&mut tc, "sep_token", eos.clone().unwrap_or(Value::Null));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let mut ids: Vec<(&str, u64)> = Vec::new();
    let mut set_id = |typ: &'static str, v: Option<&Value>, notes: &mut Vec<String>, from: &str| {
        let Some(v) = v else { return };
        if v.is_i64() && v.as_i64().is_some_and(|x| x < 0) {
            notes.push(format!(
                "{from}: a negative {typ} token id ({v}) was left out"
            ));
            return;
        }
        if let Some(id) = v.as_u64()
            && !ids.iter().any(|(t, _)| *t == typ)
        {
            ids.push((typ, id));
        }
    };
    let mut template = None;
    if let Some(tc) = tc.as_ref().filter(|m| !m.is_empty()) {
        match tc.get("chat_template") {
            None | Some(Value::Null) => {}
            Some(v @ (Value::String(_) | Value::Array(_))) => template = Some(v.clone()),
            Some(_) => notes.push(
                "tokenizer_config.json: chat_template is neither a string nor a list: not used"
                    .to_string(),
            ),
        }
        for &typ in &types {
            if let Some(Value::Bool(b)) = tc.get(&format!("add_{typ}_token")) {
                set_add(&mut add, typ, *b, true);
            }
            let content = match tc.get(&format!("{typ}_token")) {
                Some(Value::String(s)) => s.as_str(),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => s.as_str(),
                    _ => continue,
                },
                _ => continue,
            };
            let id = added
                .iter()
                .find(|a| a.content == content)
                .map(|a| Value::from(a.id));
            set_id(typ, id.as_ref(), notes, "tokenizer_config.json");
        }
    }
    for &typ in &types {
        set_id(
            typ,
            input.config.get(&format!("{typ}_token_id")),
            notes,
            "config.json",
        );
    }

    if !merges.is_empty() {
        md.push("tokenizer.ggml.merges", string_array(merges));
    } else {
        notes.push("tokenizer.json has no merges: the tokenizer will not work".to_string());
    }
    for (typ, id) in ids {
        let key = match typ {
            "bos" => "bos_token_id",
            "eos" => "eos_token_id",
            "unk" => "unknown_token_id",
            "sep" => "seperator_token_id",
            "pad" => "padding_token_id",
            "mask" => "mask_token_id",
            "eot" => "eot_token_id",
            "eom" => "eom_token_id",
            // gguf-py has no key for cls.
            _ => continue,
        };
        match u32::try_from(id) {
            Ok(id) => md.push(format!("tokenizer.ggml.{key}"), MetaValue::U32(id)),
            Err(_) => notes.push(format!("a {typ} token id of {id} was left out")),
        }
    }
    for (typ, v) in add {
        if matches!(typ, "bos" | "eos" | "sep") {
            md.push(
                format!("tokenizer.ggml.add_{typ}_token"),
                MetaValue::Bool(v),
            );
        }
    }
    match template {
        Some(Value::String(s)) => md.push("tokenizer.chat_template", MetaValue::String(s)),
        Some(Value::Array(list)) => chat_templates(&list, md),
        _ => {}
    }
    let (lower, strip) = normalizer(t.get("normalizer"));
    if let Some(b) = lower {
        md.push("tokenizer.ggml.normalizer.lowercase", MetaValue::Bool(b));
    }
    if let Some(b) = strip {
        md.push(
            "tokenizer.ggml.normalizer.strip_accents",
            MetaValue::Bool(b),
        );
    }
}

/// Named chat templates (a list of `{name, template}`): `default` is
/// `tokenizer.chat_template`, the others `tokenizer.chat_template.NAME`
/// and their names `tokenizer.chat_templates`.
fn chat_templates(list: &[Value], md: &mut Metadata) {
    let mut default = None;
    let mut names: Vec<String> = Vec::new();
    for choice in list {
        let name: String = choice
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let Some(template) = choice.get("template").and_then(Value::as_str) else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        if name == "default" {
            default = Some(template.to_string());
        } else {
            md.push(
                format!("tokenizer.chat_template.{name}"),
                MetaValue::String(template.to_string()),
            );
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    if !names.is_empty() {
        md.push("tokenizer.chat_templates", string_array(names));
    }
    if let Some(d) = default {
        md.push("tokenizer.chat_template", MetaValue::String(d));
    }
}

/// The normalizer's lowercase and strip-accents flags (gguf-py's
/// `_parse_normalizer`).
fn normalizer(n: Option<&Value>) -> (Option<bool>, Option<bool>) {
    fn walk(n: &Value, depth: usize, out: &mut (Option<bool>, Option<bool>)) {
        match n.get("type").and_then(Value::as_str) {
            Some("Lowercase") => out.0 = Some(true),
            Some("StripAccents") => out.1 = Some(true),
            Some("BertNormalizer") => {
                if let Some(b) = n.get("lowercase").and_then(Value::as_bool) {
                    out.0 = Some(b);
                }
                if let Some(b) = n.get("strip_accents").and_then(Value::as_bool) {
                    out.1 = Some(b);
                }
            }
            Some("Sequence") if depth < 8 => {
                for m in n
                    .get("normalizers")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    walk(m, depth + 1, out);
                }
            }
            _ => {}
        }
    }
    let mut out = (None, None);
    if let Some(n) = n {
        walk(n, 0, &mut out);
    }
    out
}
