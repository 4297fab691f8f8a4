//! Byte-level BPE tokenizer (GGUF `tokenizer.ggml.model = "gpt2"`), built
//! from the model's own key/values: `tokens`, `token_type`, `merges`,
//! `pre`, the BOS/EOS ids and the `add_bos_token`/`add_eos_token` flags.
//!
//! Written here rather than taken from the `tokenizers` crate: the format
//! is small (pre-tokenizer regexes, GPT-2's byte-to-char table, rank-ordered
//! merges), the crate's regex engine needs C (onig) or a feature set that
//! drags in dozens of crates, and a separate implementation makes the
//! comparison with the Python `tokenizers` reference (tests/probe.rs) an
//! independent check rather than the same code twice.
//!
//! Semantics follow llama.cpp's `llama_vocab` for the pre-tokenizer types
//! we know (`PreType::from_gguf`); each type is a list of regexes applied in
//! turn, every one splitting each piece of the previous one into matches
//! and the unmatched text between them. The `\s+(?!\S)` look-ahead that the
//! GPT-2 family uses is not in the `regex` crate; see [`Splitter`].

use std::collections::HashMap;

use regex::Regex;

use crate::error::{ErrorKind, Result, err};
use crate::format::meta::{MetaValue, Metadata};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Pre-tokenizer families, named after llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreType {
    /// GPT-2's regex alone.
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (SmolLM, StarCoder, ...).
    DigitsGpt2,
    /// Qwen2's regex: single digits, letters with one leading non-letter.
    Qwen2,
    /// Llama 3's regex: digits in groups of up to three; `ignore_merges`.
    Llama3,
}

impl PreType {
    /// The family of a `tokenizer.ggml.pre` value, as llama.cpp maps it.
    pub fn from_gguf(pre: &str) -> Option<PreType> {
        Some(match pre {
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "olmo" | "mpt" | "jais"
            | "exaone4" => PreType::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => PreType::DigitsGpt2,
            "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => PreType::Qwen2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "dbrx" | "smaug-bpe" => {
                PreType::Llama3
            }
            _ => return None,
        })
    }

    fn regexes(self) -> Vec<&'static str> {
        // The final `(\s+)` group stands for `\s+(?!\S)|\s+` (see Splitter).
        const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|(\s+)";
        const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|(\s+)";
        const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|(\s+)";
        match self {
            PreType::Gpt2 => vec![GPT2],
            PreType::DigitsGpt2 => vec![r"\p{N}", GPT2],
            PreType::Qwen2 => vec![QWEN2],
            PreType::Llama3 => vec![LLAMA3],
        }
    }
}

/// One pre-tokenizer regex. Capture group 1, when present, is a whitespace
/// run that the original pattern matches as `\s+(?!\S)|\s+`: PCRE
/// backtracks so that a run followed by a non-space gives up its last
/// character (which then starts the next piece, e.g. `" world"`), unless
/// the run is a single character. We match `\s+` and trim the same way.
struct Splitter {
    re: Regex,
}

impl Splitter {
    /// Byte ranges of `text` split into matches and the gaps between them.
    fn split(&self, text: &str, out: &mut Vec<(usize, usize)>, base: usize) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(caps) = self.re.captures_at(text, pos) else {
                break;
            };
            let Some(m) = caps.get(0) else { break };
            let (start, mut end) = (m.start(), m.end());
            if start == end {
                // An empty match (no pattern here can produce one, but a
                // zero-width match must never stall the loop).
                end = start + text[start..].chars().next().map_or(1, char::len_utf8);
            }
            if caps.get(1).is_some() {
                let followed_by_non_space = text[end..]
                    .chars()
                    .next()
                    .is_some_and(|c| !c.is_whitespace());
                let last = text[start..end]
                    .chars()
                    .next_back()
                    .map_or(0, char::len_utf8);
                if followed_by_non_space && end - start > last {
                    end -= last;
                }
            }
            if start > pos {
                out.push((base + pos, base + start));
            }
            out.push((base + start, base + end));
            pos = end;
        }
        if pos < text.len() {
            out.push((base + pos, base + text.len()));
        }
    }
}

/// GPT-2's reversible map from bytes to printable chars: printable Latin-1
/// bytes map to themselves, the other 68 to U+0100 onwards in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

/// A byte-level BPE tokenizer.
pub struct Tokenizer {
    /// Token text as stored in the vocab (byte-level chars for normal
    /// tokens, literal text for control tokens).
    tokens: Vec<String>,
    token_types: Vec<i64>,
    vocab: HashMap<String, u32>,
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_to_char: [char; 256],
    char_to_byte: HashMap<char, u8>,
    /// Token id of each single byte's char, when the vocab has it.
    byte_token: [Option<u32>; 256],
    splitters: Vec<Splitter>,
    pre: PreType,
    pre_name: String,
    ignore_merges: bool,
    /// Special tokens matched literally in text, longest first: (text, id,
    /// is control/unknown i.e. only matched when parsing specials).
    specials: Vec<(String, u32, bool)>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End-of-turn token of chat models (`tokenizer.ggml.eot_token_id`).
    pub eot: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

fn missing(key: &str) -> crate::error::Error {
    err(
        ErrorKind::BadValue,
        format!("tokenizer: metadata key {key:?} is missing or has the wrong type"),
    )
}

fn string_array<'a>(md: &'a Metadata, key: &str) -> Result<Vec<&'a str>> {
    match md.get(key) {
        Some(MetaValue::Array { values, .. }) => values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().ok_or_else(|| {
                    err(
                        ErrorKind::BadValue,
                        format!("tokenizer: {key}[{i}] is not a string"),
                    )
                })
            })
            .collect(),
        _ => Err(missing(key)),
    }
}

fn token_id(md: &Metadata, key: &str, n_vocab: usize) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    // Some converters store "no such token" as -1.
    if let MetaValue::I32(-1) | MetaValue::I64(-1) = v {
        return Ok(None);
    }
    match v.as_u64() {
        Some(id) if (id as usize) < n_vocab => Ok(Some(id as u32)),
        _ => Err(err(
            ErrorKind::BadValue,
            format!(
                "tokenizer: {key} = {} is not a token id below the vocab size {n_vocab}",
                v.summary()
            ),
        )),
    }
}

fn flag(md: &Metadata, key: &str) -> Option<bool> {
    match md.get(key) {
        Some(MetaValue::Bool(b)) => Some(*b),
        Some(v) => v.as_u64().map(|x| x != 0),
        None => None,
    }
}

impl Tokenizer {
    /// Build from a model's key/values.
    pub fn from_metadata(md: &Metadata) -> Result<Tokenizer> {
        let model = md
            .get("tokenizer.ggml.model")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| missing("tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!(
                    "tokenizer.ggml.model is {model:?}; only \"gpt2\" (byte-level BPE) is \
                     implemented (pass token ids with --tokens instead)"
                ),
            ));
        }
        let pre_name = md
            .get("tokenizer.ggml.pre")
            .and_then(MetaValue::as_str)
            .unwrap_or("gpt-2")
            .to_string();
        let pre = PreType::from_gguf(&pre_name).ok_or_else(|| {
            err(
                ErrorKind::UnsupportedType,
                format!(
                    "tokenizer.ggml.pre {pre_name:?} is not one of the pre-tokenizers implemented \
                     (gpt-2, smollm/starcoder, qwen2, llama-bpe families); pass token ids with --tokens"
                ),
            )
        })?;
        let tokens: Vec<String> = string_array(md, "tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let n_vocab = tokens.len();
        if n_vocab == 0 || n_vocab > u32::MAX as usize {
            return Err(err(
                ErrorKind::BadValue,
                format!("tokenizer.ggml.tokens has {n_vocab} entries"),
            ));
        }
        let token_types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
            Some(MetaValue::Array { values, .. }) => {
                if values.len() != n_vocab {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!(
                            "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {n_vocab}",
                            values.len()
                        ),
                    ));
                }
                values
                    .iter()
                    .map(|v| match *v {
                        MetaValue::I32(x) => i64::from(x),
                        MetaValue::I64(x) => x,
                        ref other => other.as_u64().map_or(1, |x| x as i64),
                    })
                    .collect()
            }
            Some(_) => return Err(missing("tokenizer.ggml.token_type")),
            None => vec![1; n_vocab],
        };
        let mut vocab = HashMap::with_capacity(n_vocab);
        for (i, t) in tokens.iter().enumerate() {
            // First occurrence wins, as in llama.cpp's token_to_id.
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        let merge_list = string_array(md, "tokenizer.ggml.merges")?;
        let mut merges = HashMap::with_capacity(merge_list.len());
        for (rank, m) in merge_list.iter().enumerate() {
            let Some((a, b)) = m.split_once(' ') else {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "tokenizer.ggml.merges[{rank}] = {m:?} is not two tokens separated by a space"
                    ),
                ));
            };
            let joined = format!("{a}{b}");
            // A merge whose parts or result are not tokens can never apply.
            if let (Some(&ia), Some(&ib), Some(&ij)) =
                (vocab.get(a), vocab.get(b), vocab.get(&joined))
            {
                merges.entry((ia, ib)).or_insert((rank as u32, ij));
            }
        }
        let byte_to_char = byte_to_char_table();
        let char_to_byte = byte_to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let mut byte_token = [None; 256];
        for (b, c) in byte_to_char.iter().enumerate() {
            byte_token[b] = vocab.get(&c.to_string()).copied();
        }
        let splitters = pre
            .regexes()
            .into_iter()
            .map(|p| {
                Regex::new(p)
                    .map(|re| Splitter { re })
                    .map_err(|e| err(ErrorKind::BadValue, format!("pre-tokenizer regex: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut specials: Vec<(String, u32, bool)> = tokens
            .iter()
            .zip(&token_types)
            .enumerate()
            .filter_map(|(i, (t, &ty))| {
                let control = ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_UNKNOWN;
                (!t.is_empty() && (control || ty == TOKEN_TYPE_USER_DEFINED))
                    .then(|| (t.clone(), i as u32, control))
            })
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let bos = token_id(md, "tokenizer.ggml.bos_token_id", n_vocab)?;
        let eos = token_id(md, "tokenizer.ggml.eos_token_id", n_vocab)?;
        let eot = token_id(md, "tokenizer.ggml.eot_token_id", n_vocab)?;
        // llama.cpp's defaults for BPE vocabularies: BOS only for Llama 3;
        // the GGUF flags override them.
        let add_bos = flag(md, "tokenizer.ggml.add_bos_token").unwrap_or(pre == PreType::Llama3);
        let add_eos = flag(md, "tokenizer.ggml.add_eos_token").unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(missing("tokenizer.ggml.bos_token_id"));
        }
        if add_eos && eos.is_none() {
            return Err(missing("tokenizer.ggml.eos_token_id"));
        }
        Ok(Tokenizer {
            tokens,
            token_types,
            vocab,
            merges,
            byte_to_char,
            char_to_byte,
            byte_token,
            splitters,
            ignore_merges: pre == PreType::Llama3,
            pre,
            pre_name,
            specials,
            bos,
            eos,
            eot,
            add_bos,
            add_eos,
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    pub fn pre_type(&self) -> PreType {
        self.pre
    }

    pub fn pre_name(&self) -> &str {
        &self.pre_name
    }

    /// Token ids of `text`. `parse_special`: control tokens written in the
    /// text (`<|im_start|>`) become their ids, as llama.cpp does for
    /// prompts; user-defined tokens always do. `add_special`: BOS/EOS as
    /// the model's flags say.
    pub fn encode(&self, text: &str, parse_special: bool, add_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest special token in `rest` (longest at a position).
            let mut best: Option<(usize, &str, u32)> = None;
            for (s, id, control) in &self.specials {
                if *control && !parse_special {
                    continue;
                }
                if let Some(at) = rest.find(s.as_str())
                    && best.is_none_or(|(b, bs, _)| at < b || (at == b && s.len() > bs.len()))
                {
                    best = Some((at, s.as_str(), *id));
                }
            }
            match best {
                Some((at, s, id)) => {
                    self.encode_plain(&rest[..at], &mut out);
                    out.push(id);
                    rest = &rest[at + s.len()..];
                }
                None => {
                    self.encode_plain(rest, &mut out);
                    rest = "";
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Pre-tokenize and BPE text that holds no special tokens.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut pieces = vec![(0usize, text.len())];
        for sp in &self.splitters {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for &(a, b) in &pieces {
                sp.split(&text[a..b], &mut next, a);
            }
            pieces = next;
        }
        for (a, b) in pieces {
            self.bpe(&text.as_bytes()[a..b], out);
        }
    }

    /// Merge one pre-tokenized piece: start from single bytes and apply the
    /// lowest-ranked merge (leftmost on ties) until none applies.
    fn bpe(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if bytes.is_empty() {
            return;
        }
        if self.ignore_merges {
            let word: String = bytes
                .iter()
                .map(|&b| self.byte_to_char[b as usize])
                .collect();
            if let Some(&id) = self.vocab.get(&word) {
                out.push(id);
                return;
            }
        }
        let mut syms: Vec<u32> = Vec::with_capacity(bytes.len());
        for &b in bytes {
            match self.byte_token[b as usize] {
                Some(id) => syms.push(id),
                // A byte-level vocab has all 256 byte chars; one that lacks
                // some cannot represent this byte, and dropping it is what
                // llama.cpp does too (with a log line).
                None => log::warn!("tokenizer: no token for byte {b:#04x}; dropped"),
            }
        }
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(&(rank, merged)) = self.merges.get(&(syms[i], syms[i + 1]))
                    && best.is_none_or(|(r, _, _)| rank < r)
                {
                    best = Some((rank, i, merged));
                }
            }
            let Some((_, i, merged)) = best else { break };
            syms[i] = merged;
            syms.remove(i + 1);
        }
        out.extend_from_slice(&syms);
    }

    /// The bytes a token stands for: byte-level chars mapped back to bytes;
    /// control and user-defined tokens as their literal text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(t) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        let ty = self.token_types.get(id as usize).copied().unwrap_or(1);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            return t.as_bytes().to_vec();
        }
        let mut out = Vec::with_capacity(t.len());
        for c in t.chars() {
            match self.char_to_byte.get(&c) {
                Some(&b) => out.push(b),
                None => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        out
    }

    /// Text of a sequence of tokens (invalid UTF-8 shown as U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The vocab's spelling of a token (byte-level chars), for tables.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Whether generation should stop at this token: EOS, EOT, or a
    /// control token whose text llama.cpp also treats as end-of-generation
    /// (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        if Some(id) == self.eos || Some(id) == self.eot {
            return true;
        }
        let control = self.token_types.get(id as usize) == Some(&TOKEN_TYPE_CONTROL);
        control
            && matches!(
                self.token_text(id),
                Some(
                    "<|im_end|>"
                        | "<|endoftext|>"
                        | "<|eot_id|>"
                        | "<|eom_id|>"
                        | "<|end_of_text|>"
                        | "<|end|>"
                        | "<end_of_turn>"
                        | "</s>"
                )
            )
    }
}

/// Streams generated tokens as text: holds back the bytes of a UTF-8
/// character split across tokens until it is complete.
#[derive(Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// Append a token's bytes; return the text that is complete so far.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            // An incomplete sequence at the end waits for the next token;
            // an invalid one is flushed as U+FFFD.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.pending.len(),
        };
        let out = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        out
    }

    /// Whatever is left (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::meta::MetaType;

    fn strings(v: &[&str]) -> MetaValue {
        MetaValue::Array {
            elem: MetaType::String,
            values: v.iter().map(|s| MetaValue::String(s.to_string())).collect(),
        }
    }

    /// A vocab of every byte char plus a few merges and one control token.
    fn tiny(pre: &str) -> Tokenizer {
        let table = byte_to_char_table();
        let mut toks: Vec<String> = table.iter().map(|c| c.to_string()).collect();
        let merges = ["Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "h e", "he l"];
        for m in merges {
            toks.push(m.replace(' ', ""));
        }
        toks.push("<|im_start|>".into());
        let mut types = vec![MetaValue::I32(1); toks.len()];
        *types.last_mut().unwrap() = MetaValue::I32(3);
        let mut md = Metadata::default();
        md.push("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
        md.push("tokenizer.ggml.pre", MetaValue::String(pre.into()));
        md.push(
            "tokenizer.ggml.tokens",
            strings(&toks.iter().map(String::as_str).collect::<Vec<_>>()),
        );
        md.push(
            "tokenizer.ggml.token_type",
            MetaValue::Array {
                elem: MetaType::I32,
                values: types,
            },
        );
        md.push("tokenizer.ggml.merges", strings(&merges));
        Tokenizer::from_metadata(&md).unwrap()
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        let mut p = vec![(0, text.len())];
        for sp in &t.splitters {
            let mut next = Vec::new();
            for &(a, b) in &p {
                sp.split(&text[a..b], &mut next, a);
            }
            p = next;
        }
        p.into_iter().map(|(a, b)| text[a..b].to_string()).collect()
    }

    #[test]
    fn whitespace_lookahead_is_emulated() {
        let t = tiny("gpt-2");
        assert_eq!(pieces(&t, "a  b"), ["a", " ", " b"]);
        assert_eq!(pieces(&t, "a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(pieces(&t, "a   "), ["a", "   "]);
        assert_eq!(pieces(&t, "it's 12"), ["it", "'s", " 12"]);
        let s = tiny("smollm");
        assert_eq!(pieces(&s, "x 123"), ["x", " ", "1", "2", "3"]);
        let q = tiny("qwen2");
        assert_eq!(pieces(&q, "a\n\n  b"), ["a", "\n\n", " ", " b"]);
    }

    #[test]
    fn merges_apply_by_rank_and_round_trip() {
        let t = tiny("gpt-2");
        let ids = t.encode(" world hello", true, true);
        let texts: Vec<&str> = ids.iter().map(|&i| t.token_text(i).unwrap()).collect();
        assert_eq!(texts, ["Ġworld", "Ġ", "hel", "l", "o"]);
        assert_eq!(t.decode(&ids), " world hello");
        let text = "naïve café — 東京 🎉\t\r\n";
        assert_eq!(t.decode(&t.encode(text, false, false)), text);
    }

    #[test]
    fn control_tokens_only_when_parsing_specials() {
        let t = tiny("gpt-2");
        let with = t.encode("<|im_start|>he", true, false);
        assert_eq!(with.len(), 2);
        assert_eq!(t.token_text(with[0]), Some("<|im_start|>"));
        let without = t.encode("<|im_start|>he", false, false);
        assert!(without.len() > 2);
        assert_eq!(t.decode(&without), "<|im_start|>he");
    }

    #[test]
    fn text_stream_holds_split_characters() {
        let mut s = TextStream::default();
        let e = "é".as_bytes();
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..]), "é");
        assert_eq!(s.push(&[0xE6]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }

    #[test]
    fn missing_keys_are_named() {
        let md = Metadata::default();
        let e = Tokenizer::from_metadata(&md).err().unwrap();
        assert!(e.to_string().contains("tokenizer.ggml.model"), "{e}");
        let mut md = Metadata::default();
        md.push("tokenizer.ggml.model", MetaValue::String("llama".into()));
        let e = Tokenizer::from_metadata(&md).err().unwrap();
        assert!(e.to_string().contains("--tokens"), "{e}");
    }
}
