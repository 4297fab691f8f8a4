//! gguf-py's `SpecialVocab` over a tokenizer.json and its
//! tokenizer_config.json: the special token ids, the add-bos/eos/sep
//! flags (from the post-processor, then the config), the chat template
//! and the normalizer's flags, with gguf-py's precedence (the first source
//! of an id wins: tokenizer_config.json's token names, then config.json's
//! ids).

use serde_json::{Map, Value};

use super::config::string_array;
use crate::format::meta::{MetaValue, Metadata};

/// One added token of tokenizer.json.
pub(super) struct Added {
    pub(super) id: u64,
    pub(super) content: String,
    pub(super) special: bool,
}

/// An add-token flag: set it, or (`keep`) set it only when unset.
fn set_add(add: &mut Vec<(&'static str, bool)>, typ: &'static str, v: bool, keep: bool) {
    match add.iter_mut().find(|(k, _)| *k == typ) {
        Some(e) if !keep => e.1 = v,
        Some(_) => {}
        None => add.push((typ, v)),
    }
}

/// What reading the post-processor changes: gguf-py edits its copy of
/// tokenizer_config.json and its token names as it goes.
struct State {
    tc: Option<Map<String, Value>>,
    bos: Option<Value>,
    cls: Option<Value>,
    eos: Option<Value>,
    sep: Option<Value>,
    /// The special token kinds looked up (eot/eom join when the template
    /// ends in another token than eos).
    types: Vec<&'static str>,
    add: Vec<(&'static str, bool)>,
}

impl State {
    fn new(tc: Option<&Map<String, Value>>) -> State {
        let tc = tc.cloned();
        let get = |k: &str| tc.as_ref().and_then(|m| m.get(k)).cloned();
        let mut st = State {
            bos: get("bos_token"),
            cls: get("cls_token"),
            eos: get("eos_token"),
            sep: get("sep_token"),
            tc,
            types: vec!["bos", "eos", "unk", "sep", "pad", "cls", "mask"],
            add: Vec::new(),
        };
        if !truthy(&st.bos) && truthy(&st.cls) && st.has_tc() {
            st.bos = st.cls.clone();
            st.put("bos_token", st.bos.clone().unwrap_or(Value::Null));
        }
        if !truthy(&st.eos) && truthy(&st.sep) && st.has_tc() {
            st.eos = st.sep.clone();
            st.put("eos_token", st.eos.clone().unwrap_or(Value::Null));
        }
        st
    }

    /// Python's truth of the config: present and not empty.
    fn has_tc(&self) -> bool {
        self.tc.as_ref().is_some_and(|m| !m.is_empty())
    }

    fn put(&mut self, k: &str, v: Value) {
        if let Some(m) = self.tc.as_mut() {
            m.insert(k.to_string(), v);
        }
    }

    fn post_processor(&mut self, p: &Value) {
        match p.get("type").and_then(Value::as_str) {
            Some("ByteLevel") => {
                set_add(&mut self.add, "bos", false, true);
                set_add(&mut self.add, "eos", false, true);
            }
            Some("RobertaProcessing") => {
                for typ in ["bos", "eos", "sep"] {
                    set_add(&mut self.add, typ, true, false);
                }
                let first = |k: &str, default: &Option<Value>| {
                    p.get(k)
                        .and_then(Value::as_array)
                        .and_then(|a| a.first().cloned())
                        .or_else(|| default.clone())
                };
                if !truthy(&self.cls) && self.has_tc() {
                    self.cls = first("cls", &self.bos);
                    self.put("cls_token", self.cls.clone().unwrap_or(Value::Null));
                }
                if !truthy(&self.sep) && self.has_tc() {
                    self.sep = first("sep", &self.eos);
                    self.put("sep_token", self.sep.clone().unwrap_or(Value::Null));
                }
            }
            Some("TemplateProcessing") => self.template(p),
            _ => {}
        }
    }

    /// A TemplateProcessing: its leading special token is bos (added), its
    /// trailing one eos, a special token between A and B in the pair
    /// template the separator (gguf-py's "crude parsing" of simple
    /// templates, rule for rule).
    fn template(&mut self, p: &Value) {
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
                if !self.has_tc() {
                    self.bos = Some(Value::String(f.clone()));
                } else if !names(&self.bos, &f) && !names(&self.cls, &f) {
                    if !truthy(&self.bos) {
                        self.bos = Some(Value::String(f.clone()));
                        self.put("bos_token", Value::String(f.clone()));
                    }
                    if !truthy(&self.cls) {
                        self.cls = Some(Value::String(f.clone()));
                        self.put("cls_token", Value::String(f.clone()));
                    }
                }
                let added = names(&self.bos, &f) || names(&self.cls, &f);
                set_add(&mut self.add, "bos", added, false);
                special_first = Some(f);
            }
            if let Some(l) = special_id(single.last()) {
                if !self.has_tc() {
                    self.eos = Some(Value::String(l.clone()));
                } else if !names(&self.eos, &l) {
                    let old = self.eos.clone().unwrap_or(Value::Null);
                    if !self.types.contains(&"eot") {
                        self.types.push("eot");
                        self.put("eot_token", old);
                    } else if !self.types.contains(&"eom") {
                        self.types.push("eom");
                        self.put("eom_token", old);
                    }
                    self.eos = Some(Value::String(l.clone()));
                    self.put("eos_token", Value::String(l.clone()));
                }
                let added = names(&self.eos, &l);
                set_add(&mut self.add, "eos", added, false);
                special_last = Some(l);
            }
        }
        if pair.is_empty() {
            return;
        }
        let start =
            usize::from(special_first.is_some() && special_id(pair.first()) == special_first);
        let stop = pair.len()
            - usize::from(special_last.is_some() && special_id(pair.last()) == special_last);
        let mid = pair.get(start..stop.max(start)).unwrap_or(&[]);
        let seq = |v: Option<&Value>| {
            v.and_then(|v| v.get("Sequence"))
                .and_then(|s| s.get("id"))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        if mid.len() <= 2
            || seq(mid.first()).as_deref() != Some("A")
            || seq(mid.last()).as_deref() != Some("B")
        {
            return;
        }
        let inner = &mid[1..mid.len() - 1];
        let separates = |e: &str| names(&self.sep, e) || names(&self.eos, e);
        let mut add_sep = false;
        if let Some(e) = special_id(inner.first())
            && separates(&e)
            && special_last.is_none()
        {
            add_sep = true;
        }
        if inner.len() == 2
            && let Some(e) = special_id(inner.get(1))
            && separates(&e)
        {
            add_sep = true;
        }
        set_add(&mut self.add, "sep", add_sep, false);
        if add_sep && !truthy(&self.sep) && self.has_tc() {
            self.put("sep_token", self.eos.clone().unwrap_or(Value::Null));
        }
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

/// Whether a token name (a string; an object never equals one) is `s`.
fn names(v: &Option<Value>, s: &str) -> bool {
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
pub(super) fn special_vocab(
    t: &Map<String, Value>,
    tokenizer_config: Option<&Map<String, Value>>,
    config: &Map<String, Value>,
    added: &[Added],
    merges: Vec<String>,
    md: &mut Metadata,
    notes: &mut Vec<String>,
) {
    let mut st = State::new(tokenizer_config);
    let processors: Vec<&Value> = match t.get("post_processor") {
        Some(p @ Value::Object(o)) => match o.get("processors").and_then(Value::as_array) {
            Some(list) => list.iter().collect(),
            None => vec![p],
        },
        _ => Vec::new(),
    };
    for p in processors {
        st.post_processor(p);
    }
    let State {
        tc, types, mut add, ..
    } = st;
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
            config.get(&format!("{typ}_token_id")),
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
