//! `hf/tokenizer.json` and `hf/tokenizer_config.json`: the byte-level BPE
//! tokenizer of the GGUF key/values (`tokenizer.ggml.*`), as transformers'
//! GGUF loader builds it: the vocabulary respelled into GPT-2's byte
//! alphabet where a token is not in it, the file's merges, control tokens
//! as special added tokens and user-defined ones as plain added tokens,
//! the pre-tokenizer of the `tokenizer.ggml.pre` type.
//!
//! What is rendered must load in the `tokenizers` library with the ids
//! transformers' loader gives (issue 26, item 5), so the key/values are
//! checked first, and a file that fails gets no tokenizer files (a note in
//! index.json's `views.hf` says why):
//! - tokens of one spelling: the vocabulary maps it to the last id (a
//!   Python dict's last write, what transformers' loader does); the earlier
//!   ids have no entry, and an added token or special token of that
//!   spelling takes the last id too;
//! - every merge is two tokens separated by one space, and both and their
//!   concatenation are in the vocabulary (the library refuses or panics);
//! - the bos/eos/unknown/padding ids are tokens, spelled as in the
//!   vocabulary (a special token not in it would be added past a
//!   vocabulary with gaps, onto an id in use).
//!
//! The vocabulary, merges, added tokens and chat template are not held
//! rendered ([`Pieces`]): a read renders the entries it covers from the
//! metadata, which the mount holds anyway (issue 26, item 4). At mount the
//! checks take 8 bytes per token (a hash table of ids) and one bit per
//! token is kept (which ids the vocabulary lists).

use std::borrow::Cow;

use serde_json::{Map, Value, json};

use super::pieces::{Items, Pieces};
use crate::format::meta::{MetaValue, Metadata};

/// Largest vocabulary and merge list rendered (the largest real ones are
/// about 262k tokens); a file past them gets no tokenizer files.
pub(super) const MAX_VOCAB: usize = 1 << 21;
pub(super) const MAX_MERGES: usize = 1 << 22;

/// Longest bos/eos/unknown/padding token rendered: they are copied into
/// tokenizer.json's head and tokenizer_config.json whole (real ones are a
/// few bytes).
const MAX_SPECIAL_TOKEN: usize = 4096;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

const TOKENS: &str = "tokenizer.ggml.tokens";
const MERGES: &str = "tokenizer.ggml.merges";
const TYPES: &str = "tokenizer.ggml.token_type";
const TEMPLATE: &str = "tokenizer.chat_template";

/// Stand-ins for the runs while the rest of a file is rendered.
const ADDED_MARK: &str = "\u{1}rknot-added\u{1}";
const VOCAB_MARK: &str = "\u{1}rknot-vocab\u{1}";
const MERGES_MARK: &str = "\u{1}rknot-merges\u{1}";
const TEMPLATE_MARK: &str = "\u{1}rknot-template\u{1}";

/// Items per mark of the vocabulary, merge and added-token runs: a read
/// renders at most this many entries before the ones it returns.
const STRIDE: usize = 64;
/// Bytes of chat template per item (one mark each).
const TEMPLATE_CHUNK: usize = 4096;

/// The two rendered files and what a reader should know about them.
pub(super) struct TokenizerFiles {
    pub(super) tokenizer: Pieces,
    pub(super) config: Pieces,
    pub(super) notes: Vec<String>,
}

/// GPT-2's byte alphabet: the character standing for each byte, and which
/// characters are in it.
struct Alphabet {
    table: [char; 256],
    member: Vec<bool>,
}

impl Alphabet {
    fn new() -> Alphabet {
        let table = crate::probe::tokenizer::byte_to_char_table();
        let top = table.iter().map(|&c| c as usize).max().unwrap_or(0);
        let mut member = vec![false; top + 1];
        for &c in &table {
            member[c as usize] = true;
        }
        Alphabet { table, member }
    }

    fn contains(&self, t: &str) -> bool {
        t.chars()
            .all(|c| self.member.get(c as usize).copied().unwrap_or(false))
    }

    /// A token as the vocabulary spells it: itself when it is in the
    /// alphabet, else each of its bytes respelled.
    fn spell<'a>(&'a self, t: &'a str) -> Spelled<'a> {
        if self.contains(t) {
            Spelled::Same(t.chars())
        } else {
            Spelled::Bytes(t.as_bytes().iter(), &self.table)
        }
    }

    fn spelled<'a>(&self, t: &'a str) -> Cow<'a, str> {
        if self.contains(t) {
            Cow::Borrowed(t)
        } else {
            Cow::Owned(t.bytes().map(|b| self.table[b as usize]).collect())
        }
    }
}

/// The characters of a token's spelling, without building it.
#[derive(Clone)]
enum Spelled<'a> {
    Same(std::str::Chars<'a>),
    Bytes(std::slice::Iter<'a, u8>, &'a [char; 256]),
}

impl Iterator for Spelled<'_> {
    type Item = char;
    fn next(&mut self) -> Option<char> {
        match self {
            Spelled::Same(c) => c.next(),
            Spelled::Bytes(b, t) => b.next().map(|&x| t[x as usize]),
        }
    }
}

/// FNV-1a over the characters.
fn hash(chars: impl Iterator<Item = char>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for c in chars {
        for b in (c as u32).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// The array of strings under `key` (`None` when absent), every element
/// checked to be a string.
fn strings<'a>(md: &'a Metadata, key: &str) -> Result<Option<&'a [MetaValue]>, String> {
    match md.get(key) {
        None => Ok(None),
        Some(MetaValue::Array { values, .. }) => {
            if let Some(i) = values.iter().position(|v| v.as_str().is_none()) {
                return Err(format!("{key}[{i}] is not a string"));
            }
            Ok(Some(values))
        }
        Some(_) => Err(format!("{key} is not an array")),
    }
}

/// Element `i` of the array under `key`, as a string ("" where there is
/// none: the arrays are checked when the files are built, and the metadata
/// does not change).
fn string_at<'a>(md: &'a Metadata, key: &str, i: usize) -> &'a str {
    match md.get(key) {
        Some(MetaValue::Array { values, .. }) => {
            values.get(i).and_then(MetaValue::as_str).unwrap_or("")
        }
        _ => "",
    }
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The start of a string for a message (tokens and merges can be long).
fn excerpt(s: &str) -> String {
    let mut e: String = s.chars().take(32).collect();
    if e.len() < s.len() {
        e.push_str("...");
    }
    format!("{e:?}")
}

/// Token ids by spelling: an open-addressing table of ids (8 bytes per
/// token); a spelling maps to the last id of that spelling.
struct SpellIndex<'a> {
    tokens: &'a [MetaValue],
    alphabet: &'a Alphabet,
    slots: Vec<u32>,
    /// One bit per token: whether it is the last of its spelling.
    last: Vec<u64>,
    duplicates: usize,
}

const EMPTY: u32 = u32::MAX;

impl<'a> SpellIndex<'a> {
    fn new(tokens: &'a [MetaValue], alphabet: &'a Alphabet) -> SpellIndex<'a> {
        let n = tokens.len();
        let mut ix = SpellIndex {
            tokens,
            alphabet,
            slots: vec![EMPTY; (2 * n).next_power_of_two().max(16)],
            last: vec![0; n.div_ceil(64)],
            duplicates: 0,
        };
        let mask = ix.slots.len() - 1;
        for id in 0..n {
            let key = ix.spell(id);
            let mut s = hash(key.clone()) as usize & mask;
            loop {
                let at = ix.slots[s];
                if at == EMPTY {
                    break;
                }
                if ix.spell(at as usize).eq(key.clone()) {
                    ix.last[at as usize / 64] &= !(1 << (at % 64));
                    ix.duplicates += 1;
                    break;
                }
                s = (s + 1) & mask;
            }
            // n <= MAX_VOCAB: ids fit a u32, and none is EMPTY.
            ix.slots[s] = id as u32;
            ix.last[id / 64] |= 1 << (id % 64);
        }
        ix
    }

    fn spell(&self, id: usize) -> Spelled<'a> {
        let t = self
            .tokens
            .get(id)
            .and_then(MetaValue::as_str)
            .unwrap_or("");
        self.alphabet.spell(t)
    }

    /// The id the vocabulary gives the spelling `key`.
    fn find<I: Iterator<Item = char> + Clone>(&self, key: I) -> Option<usize> {
        let mask = self.slots.len() - 1;
        let mut s = hash(key.clone()) as usize & mask;
        loop {
            let at = self.slots[s];
            if at == EMPTY {
                return None;
            }
            if self.spell(at as usize).eq(key.clone()) {
                return Some(at as usize);
            }
            s = (s + 1) & mask;
        }
    }
}

fn bit(bits: &[u64], i: usize) -> bool {
    bits.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

/// `"spelling":id` for the tokens that are the last of their spelling.
struct VocabItems {
    alphabet: Alphabet,
    last: Vec<u64>,
    first: usize,
    n: usize,
}

impl Items for VocabItems {
    fn count(&self) -> usize {
        self.n
    }
    fn render(&self, md: &Metadata, i: usize, out: &mut Vec<u8>) {
        if !bit(&self.last, i) {
            return;
        }
        if i != self.first {
            out.push(b',');
        }
        let t = self.alphabet.spelled(string_at(md, TOKENS, i));
        out.extend_from_slice(quoted(&t).as_bytes());
        out.push(b':');
        out.extend_from_slice(i.to_string().as_bytes());
    }
}

/// `["a","b"]` for each merge `a b`.
struct MergeItems {
    n: usize,
}

impl Items for MergeItems {
    fn count(&self) -> usize {
        self.n
    }
    fn render(&self, md: &Metadata, i: usize, out: &mut Vec<u8>) {
        if i > 0 {
            out.push(b',');
        }
        let m = string_at(md, MERGES, i);
        let (a, b) = m.split_once(' ').unwrap_or((m, ""));
        out.push(b'[');
        out.extend_from_slice(quoted(a).as_bytes());
        out.push(b',');
        out.extend_from_slice(quoted(b).as_bytes());
        out.push(b']');
    }
}

/// An added token: the token at `token` (its content), under the id the
/// vocabulary gives that content.
struct Added {
    token: u32,
    id: u32,
    special: bool,
}

struct AddedItems(Vec<Added>);

impl Items for AddedItems {
    fn count(&self) -> usize {
        self.0.len()
    }
    fn render(&self, md: &Metadata, k: usize, out: &mut Vec<u8>) {
        let Some(a) = self.0.get(k) else { return };
        if k > 0 {
            out.push(b',');
        }
        let v = json!({
            "id": a.id, "content": string_at(md, TOKENS, a.token as usize),
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
            "special": a.special,
        });
        out.extend_from_slice(v.to_string().as_bytes());
    }
}

/// The chat template's JSON escape, in pieces of about
/// [`TEMPLATE_CHUNK`] bytes cut at character boundaries.
struct TemplateItems {
    n: usize,
}

impl TemplateItems {
    fn cut(t: &str, i: usize) -> usize {
        let mut at = i.saturating_mul(TEMPLATE_CHUNK).min(t.len());
        while !t.is_char_boundary(at) {
            at -= 1;
        }
        at
    }
}

impl Items for TemplateItems {
    fn count(&self) -> usize {
        self.n
    }
    fn render(&self, md: &Metadata, i: usize, out: &mut Vec<u8>) {
        let t = md.get(TEMPLATE).and_then(MetaValue::as_str).unwrap_or("");
        let piece = &t[Self::cut(t, i)..Self::cut(t, i + 1)];
        let q = quoted(piece);
        // Without its quotes: a string's escape is its characters'.
        out.extend_from_slice(&q.as_bytes()[1..q.len() - 1]);
    }
}

/// A run to splice into a rendered document where its mark's string is.
struct Run {
    mark: &'static str,
    open: &'static str,
    items: Box<dyn Items>,
    stride: usize,
    close: &'static str,
}

/// The file of `text` with each run's `"mark"` replaced by the run.
fn splice(md: &Metadata, text: &str, runs: Vec<Run>) -> Result<Pieces, String> {
    let mut at: Vec<(usize, Run)> = Vec::new();
    for r in runs {
        let q = quoted(r.mark);
        let pos = text
            .find(&q)
            .ok_or_else(|| format!("internal error: no mark for {:?}", r.mark))?;
        at.push((pos, r));
    }
    at.sort_by_key(|(pos, _)| *pos);
    let mut doc = Pieces::new();
    let mut from = 0;
    for (pos, r) in at {
        let mut head = text[from..pos].to_string();
        head.push_str(r.open);
        doc.push_text(head.into_bytes());
        doc.push_items(md, r.items, r.stride);
        doc.push_text(r.close.as_bytes().to_vec());
        from = pos + quoted(r.mark).len();
    }
    let mut tail = text[from..].to_string();
    tail.push('\n');
    doc.push_text(tail.into_bytes());
    Ok(doc)
}

/// The split regex of the pre-tokenizer types transformers' GGUF loader
/// gives one (the others get GPT-2's byte-level regex).
fn split_regex(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        _ => return None,
    })
}

/// A special token named by `tokenizer.ggml.{what}_token_id`: its id in
/// the vocabulary and its text, checked.
fn special_token<'a>(
    md: &'a Metadata,
    what: &str,
    index: &SpellIndex<'a>,
) -> Result<Option<(usize, &'a str)>, String> {
    let key = format!("tokenizer.ggml.{what}_token_id");
    let Some(v) = md.get(&key) else {
        return Ok(None);
    };
    let id = v
        .as_u64()
        .ok_or_else(|| format!("{key} is not an unsigned integer"))?;
    let n = index.tokens.len();
    let t = usize::try_from(id)
        .ok()
        .and_then(|i| index.tokens.get(i))
        .and_then(MetaValue::as_str)
        .ok_or_else(|| format!("{key} {id} is not a token (there are {n})"))?;
    if t.len() > MAX_SPECIAL_TOKEN {
        return Err(format!(
            "{key} {id}: a token of {} bytes (hf/ renders special tokens of up to \
             {MAX_SPECIAL_TOKEN})",
            t.len()
        ));
    }
    // transformers looks the text up in the vocabulary as it is.
    let vid = index.find(t.chars()).ok_or_else(|| {
        format!(
            "{key} {id}: its token {} is not in the byte alphabet, so the vocabulary lists it \
             respelled and transformers would add it as a new token",
            excerpt(t)
        )
    })?;
    Ok(Some((vid, t)))
}

/// The tokenizer files of `md` (model context `ctx`), or why there are
/// none.
pub(super) fn tokenizer_files(md: &Metadata, ctx: u64) -> Result<TokenizerFiles, String> {
    let model = md
        .get("tokenizer.ggml.model")
        .and_then(MetaValue::as_str)
        .ok_or("the model metadata has no tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(format!(
            "tokenizer.ggml.model is {model:?}; hf/ renders byte-level BPE (\"gpt2\") tokenizers only"
        ));
    }
    let tokens = strings(md, TOKENS)?.ok_or("no tokenizer.ggml.tokens")?;
    let merges = strings(md, MERGES)?
        .ok_or("no tokenizer.ggml.merges (a BPE tokenizer needs its merges)")?;
    if tokens.len() > MAX_VOCAB || merges.len() > MAX_MERGES {
        return Err(format!(
            "{} tokens and {} merges: more than hf/ renders ({MAX_VOCAB} / {MAX_MERGES})",
            tokens.len(),
            merges.len()
        ));
    }
    let n = tokens.len();
    let types: &[MetaValue] = match md.get(TYPES) {
        None => &[],
        Some(MetaValue::Array { values, .. }) if values.len() == n => {
            if let Some(i) = values.iter().position(|v| {
                !matches!(v, MetaValue::I32(_) | MetaValue::U32(_) | MetaValue::I64(_))
            }) {
                return Err(format!("{TYPES}[{i}] is not an integer"));
            }
            values
        }
        Some(_) => return Err(format!("{TYPES} is not an array of {n} integers")),
    };
    let type_of = |v: &MetaValue| match *v {
        MetaValue::I32(x) => i64::from(x),
        MetaValue::U32(x) => i64::from(x),
        MetaValue::I64(x) => x,
        _ => 0,
    };
    let alphabet = Alphabet::new();
    let index = SpellIndex::new(tokens, &alphabet);
    let mut notes = Vec::new();
    if index.duplicates > 0 {
        notes.push(format!(
            "{} of the {n} tokens share their spelling with a later token: as in transformers' \
             GGUF loader, tokenizer.json's vocabulary maps each spelling to its last id and lists \
             {} ids",
            index.duplicates,
            n - index.duplicates
        ));
    }
    for (i, m) in merges.iter().enumerate() {
        let m = m.as_str().unwrap_or("");
        let Some((a, b)) = m.split_once(' ').filter(|(_, b)| !b.contains(' ')) else {
            return Err(format!(
                "{MERGES}[{i}] is not two tokens separated by one space"
            ));
        };
        let missing = if index.find(a.chars()).is_none() {
            a.to_string()
        } else if index.find(b.chars()).is_none() {
            b.to_string()
        } else if index.find(a.chars().chain(b.chars())).is_none() {
            format!("{a}{b}")
        } else {
            continue;
        };
        return Err(format!(
            "{MERGES}[{i}] {} needs {} in the vocabulary, which has none (the tokenizers \
             library refuses such a file)",
            excerpt(m),
            excerpt(&missing)
        ));
    }

    // Added tokens: control tokens (special) first, then user-defined ones,
    // each content once, under its vocabulary id (transformers adds them by
    // content, in that order).
    let mut added = Vec::new();
    let mut seen = vec![0u64; n.div_ceil(64)];
    for want in [TOKEN_CONTROL, TOKEN_USER_DEFINED] {
        for (i, ty) in types.iter().enumerate() {
            let t = tokens[i].as_str().unwrap_or("");
            if type_of(ty) != want || t.is_empty() || want == TOKEN_CONTROL && !alphabet.contains(t)
            {
                continue;
            }
            let Some(id) = index.find(t.chars()) else {
                continue;
            };
            if bit(&seen, id) {
                continue;
            }
            seen[id / 64] |= 1 << (id % 64);
            // Both below MAX_VOCAB.
            added.push(Added {
                token: i as u32,
                id: id as u32,
                special: want == TOKEN_CONTROL,
            });
        }
    }
    drop(seen);

    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(MetaValue::as_str)
        .unwrap_or("default");
    let pre_tokenizer = match split_regex(pre) {
        Some(re) => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ],
        }),
        None => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
    };
    let flag = |k: &str| {
        md.get(&format!("tokenizer.ggml.{k}"))
            .is_some_and(|v| matches!(v, MetaValue::Bool(true)))
    };
    let bos_token = special_token(md, "bos", &index)?;
    let eos_token = special_token(md, "eos", &index)?;
    let unk_token = special_token(md, "unknown", &index)?;
    let pad_token = special_token(md, "padding", &index)?;
    let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
    let bos = bos_token.filter(|_| add_bos);
    let eos = eos_token.filter(|_| add_eos);
    let special =
        |t: Option<(usize, &str)>| t.map(|(_, s)| json!({"SpecialToken": {"id": s, "type_id": 0}}));
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    single.extend(special(bos));
    single.push(seq("A", 0));
    single.extend(special(eos));
    pair.extend(special(bos));
    pair.push(seq("A", 0));
    pair.extend(special(eos));
    pair.extend(special(bos).map(|mut v| {
        v["SpecialToken"]["type_id"] = json!(1);
        v
    }));
    pair.push(seq("B", 1));
    pair.extend(special(eos).map(|mut v| {
        v["SpecialToken"]["type_id"] = json!(1);
        v
    }));
    let mut specials = Map::new();
    for (id, s) in bos.into_iter().chain(eos) {
        specials.insert(s.to_string(), json!({"id": s, "ids": [id], "tokens": [s]}));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": ADDED_MARK,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": single,
            "pair": pair,
            "special_tokens": specials,
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": VOCAB_MARK,
            "merges": MERGES_MARK,
        },
    });
    let text = serde_json::to_string(&tokenizer).map_err(|e| e.to_string())?;
    let first = (0..n).find(|&i| bit(&index.last, i)).unwrap_or(0);
    let SpellIndex { last, .. } = index;
    let tokenizer = splice(
        md,
        &text,
        vec![
            Run {
                mark: ADDED_MARK,
                open: "[",
                items: Box::new(AddedItems(added)),
                stride: STRIDE,
                close: "]",
            },
            Run {
                mark: VOCAB_MARK,
                open: "{",
                items: Box::new(VocabItems {
                    alphabet: Alphabet::new(),
                    last,
                    first,
                    n,
                }),
                stride: STRIDE,
                close: "}",
            },
            Run {
                mark: MERGES_MARK,
                open: "[",
                items: Box::new(MergeItems { n: merges.len() }),
                stride: STRIDE,
                close: "]",
            },
        ],
    )?;

    let name = |t: Option<(usize, &str)>| t.map_or(Value::Null, |(_, s)| json!(s));
    let mut config = Map::new();
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    config.insert("bos_token".into(), name(bos_token));
    config.insert("eos_token".into(), name(eos_token));
    config.insert("unk_token".into(), name(unk_token));
    config.insert("pad_token".into(), name(pad_token));
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    config.insert("model_max_length".into(), json!(ctx));
    let template = md.get(TEMPLATE).and_then(MetaValue::as_str);
    if template.is_some() {
        config.insert("chat_template".into(), json!(TEMPLATE_MARK));
    }
    let text = serde_json::to_string_pretty(&Value::Object(config)).map_err(|e| e.to_string())?;
    let runs = match template {
        Some(t) => vec![Run {
            mark: TEMPLATE_MARK,
            open: "\"",
            items: Box::new(TemplateItems {
                n: t.len().div_ceil(TEMPLATE_CHUNK),
            }),
            stride: 1,
            close: "\"",
        }],
        None => Vec::new(),
    };
    let config = splice(md, &text, runs)?;
    Ok(TokenizerFiles {
        tokenizer,
        config,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(xs: &[&str]) -> MetaValue {
        MetaValue::Array {
            elem: crate::format::meta::MetaType::String,
            values: xs
                .iter()
                .map(|x| MetaValue::String(x.to_string()))
                .collect(),
        }
    }

    fn types(xs: &[i32]) -> MetaValue {
        MetaValue::Array {
            elem: crate::format::meta::MetaType::I32,
            values: xs.iter().map(|&x| MetaValue::I32(x)).collect(),
        }
    }

    fn whole(md: &Metadata, p: &Pieces) -> Vec<u8> {
        p.read(md, 0, u32::try_from(p.len()).unwrap())
    }

    fn render(md: &Metadata) -> Result<(Value, Value, Vec<String>), String> {
        let f = tokenizer_files(md, 64)?;
        let tok = serde_json::from_slice(&whole(md, &f.tokenizer)).unwrap();
        let config = serde_json::from_slice(&whole(md, &f.config)).unwrap();
        Ok((tok, config, f.notes))
    }

    fn base() -> Metadata {
        let mut md = Metadata::default();
        md.push("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
        md.push("tokenizer.ggml.pre", MetaValue::String("qwen2".into()));
        md.push(TOKENS, arr(&["a", "b", "Ġa", " a", "<|x|>", "ab"]));
        md.push(TYPES, types(&[1, 1, 1, 1, 3, 4]));
        md.push(MERGES, arr(&["a b"]));
        md.push("tokenizer.ggml.eos_token_id", MetaValue::U32(4));
        md.push("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
        md
    }

    fn set(md: &mut Metadata, key: &str, v: MetaValue) {
        md.entries.retain(|(k, _)| k != key);
        md.push(key, v);
    }

    #[test]
    fn tokenizer_json_respells_dedups_and_marks_control_tokens() {
        let md = base();
        let (v, config, notes) = render(&md).unwrap();
        // " a" is respelled "Ġa" and, later, wins that spelling.
        assert_eq!(
            v["model"]["vocab"],
            json!({"a": 0, "b": 1, "Ġa": 3, "<|x|>": 4, "ab": 5})
        );
        assert_eq!(v["model"]["merges"], json!([["a", "b"]]));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("1 of the 6 tokens"), "{notes:?}");
        let added = v["added_tokens"].as_array().unwrap();
        assert_eq!(added.len(), 2);
        assert_eq!(
            (added[0]["id"].as_u64(), added[0]["special"].as_bool()),
            (Some(4), Some(true))
        );
        assert_eq!(
            (added[1]["id"].as_u64(), added[1]["special"].as_bool()),
            (Some(5), Some(false))
        );
        assert_eq!(v["pre_tokenizer"]["type"], "Sequence");
        assert_eq!(config["eos_token"], "<|x|>");
        assert_eq!(config["bos_token"], Value::Null);
        assert!(config.get("chat_template").is_none());
        // Only byte-level BPE, with its merges.
        let mut spm = md.clone();
        spm.entries[0].1 = MetaValue::String("llama".into());
        assert!(render(&spm).unwrap_err().contains("\"llama\""));
        let mut bad = md.clone();
        bad.entries.retain(|(k, _)| k != MERGES);
        assert!(render(&bad).unwrap_err().contains("merges"));
    }

    #[test]
    fn duplicates_take_the_last_id_everywhere() {
        // "<s>" twice (a control token, then a normal one) and used as bos;
        // "c" twice, the first user-defined.
        let mut md = base();
        set(
            &mut md,
            TOKENS,
            arr(&["a", "b", "<s>", "c", "ab", "<s>", "c"]),
        );
        set(&mut md, TYPES, types(&[1, 1, 3, 4, 1, 1, 1]));
        md.push("tokenizer.ggml.bos_token_id", MetaValue::U32(2));
        set(
            &mut md,
            "tokenizer.ggml.add_bos_token",
            MetaValue::Bool(true),
        );
        set(&mut md, "tokenizer.ggml.eos_token_id", MetaValue::U32(1));
        let (v, config, notes) = render(&md).unwrap();
        assert_eq!(
            v["model"]["vocab"],
            json!({"a": 0, "b": 1, "ab": 4, "<s>": 5, "c": 6})
        );
        assert!(notes[0].contains("2 of the 7 tokens"), "{notes:?}");
        assert_eq!(
            v["added_tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| (a["id"].as_u64().unwrap(), a["content"].as_str().unwrap()))
                .collect::<Vec<_>>(),
            [(5, "<s>"), (6, "c")]
        );
        // The post-processor adds the vocabulary's id of "<s>".
        assert_eq!(
            v["post_processor"]["special_tokens"]["<s>"]["ids"],
            json!([5])
        );
        assert_eq!(config["bos_token"], "<s>");
    }

    #[test]
    fn what_the_tokenizers_library_refuses_is_not_rendered() {
        let refused = |edit: &dyn Fn(&mut Metadata), want: &str| {
            let mut md = base();
            edit(&mut md);
            let e = render(&md).unwrap_err();
            assert!(e.contains(want), "{e} lacks {want}");
        };
        // A merge of tokens not in the vocabulary, or whose concatenation
        // is not.
        refused(
            &|md| set(md, MERGES, arr(&["a b", "a c"])),
            "[1] \"a c\" needs \"c\"",
        );
        refused(&|md| set(md, MERGES, arr(&["b a"])), "needs \"ba\"");
        refused(&|md| set(md, MERGES, arr(&["a b c"])), "one space");
        refused(&|md| set(md, MERGES, arr(&["ab"])), "one space");
        // Special token ids that are not tokens, or not spelled as in the
        // vocabulary.
        refused(
            &|md| set(md, "tokenizer.ggml.eos_token_id", MetaValue::U32(6)),
            "eos_token_id 6 is not a token (there are 6)",
        );
        refused(
            &|md| md.push("tokenizer.ggml.padding_token_id", MetaValue::U32(3)),
            "not in the byte alphabet",
        );
        refused(
            &|md| md.push("tokenizer.ggml.bos_token_id", MetaValue::String("1".into())),
            "not an unsigned integer",
        );
        refused(&|md| set(md, TYPES, types(&[1, 1])), "array of 6 integers");
        refused(
            &|md| {
                let mut t = arr(&["a", "b", "Ġa", " a", "<|x|>", "ab"]);
                if let MetaValue::Array { values, .. } = &mut t {
                    values[2] = MetaValue::U32(1);
                }
                set(md, TOKENS, t);
            },
            "tokens[2] is not a string",
        );
    }

    #[test]
    fn empty_tokens_and_a_large_chat_template_render() {
        let mut md = base();
        set(&mut md, TOKENS, arr(&["", "a", "b", "ab", "<|x|>"]));
        set(&mut md, TYPES, types(&[3, 1, 1, 1, 3]));
        // Multi-byte characters across piece boundaries, and escapes.
        let template = "{{ 'é\"\\' }}\n\u{1}日本".repeat(3000);
        md.push(TEMPLATE, MetaValue::String(template.clone()));
        let (v, config, _) = render(&md).unwrap();
        assert_eq!(
            v["model"]["vocab"],
            json!({"": 0, "a": 1, "b": 2, "ab": 3, "<|x|>": 4})
        );
        // The empty token is no added token (the library drops those).
        assert_eq!(v["added_tokens"].as_array().unwrap().len(), 1);
        assert_eq!(config["chat_template"], template);
        // Reads of the pieces agree with the whole at every boundary.
        let f = tokenizer_files(&md, 64).unwrap();
        let all = whole(&md, &f.config);
        for off in (0..all.len()).step_by(997) {
            let got = f.config.read(&md, off as u64, 5000);
            assert_eq!(got, all[off..(off + 5000).min(all.len())]);
        }
    }

    #[test]
    fn many_tokens_render_like_a_map_of_them() {
        // 5000 tokens of two characters (some duplicated), every merge
        // valid: the rendered vocabulary is the map a Python dict makes.
        let alphabet = Alphabet::new();
        let chars: Vec<char> = alphabet.table[33..127].to_vec();
        let mut toks: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
        let mut merges = Vec::new();
        for (i, x) in chars.iter().enumerate() {
            for y in chars.iter().take(50) {
                toks.push(format!("{x}{y}"));
                merges.push(format!("{x} {y}"));
            }
            if i % 10 == 0 {
                toks.push(format!("{x}{}", chars[0]));
            }
        }
        let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
        let refs_m: Vec<&str> = merges.iter().map(String::as_str).collect();
        let mut md = base();
        set(&mut md, TOKENS, arr(&refs));
        md.entries
            .retain(|(k, _)| k != TYPES && k != "tokenizer.ggml.eos_token_id");
        set(&mut md, MERGES, arr(&refs_m));
        let (v, _, _) = render(&md).unwrap();
        let mut want = Map::new();
        for (i, t) in toks.iter().enumerate() {
            want.shift_remove(t);
            want.insert(t.clone(), json!(i));
        }
        let mut got: Vec<(String, Value)> = v["model"]["vocab"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut want: Vec<(String, Value)> = want.into_iter().collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want);
        assert_eq!(v["model"]["merges"].as_array().unwrap().len(), merges.len());
    }
}
