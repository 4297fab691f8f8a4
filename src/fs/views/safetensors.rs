//! `model.safetensors` and its F16/BF16 forms (also `hf/`'s): the header
//! JSON, with the source's key/values as `__metadata__` strings, built
//! within safetensors' header limit however a value escapes.

use std::borrow::Cow;

use serde_json::json;

use super::{Built, ElemFormat, Layout, ViewTensor, tensor_len, tensor_segments};
use crate::error::{ErrorKind, Result, add, err};
use crate::format::meta::{MetaValue, Metadata};

/// The reference safetensors implementation refuses headers larger than
/// this (`MAX_HEADER_SIZE`).
pub const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;

/// Metadata arrays longer than this are summarized in `__metadata__` only
/// when the full header would pass [`SAFETENSORS_MAX_HEADER`].
const SUMMARY_ARRAY_LIMIT: usize = 1024;

/// A metadata value as a safetensors `__metadata__` string: strings as
/// they are; numbers and bools as JSON text (floats in their shortest
/// round-trip form, non-finite ones as `nan`, `inf`, `-inf`); arrays as
/// JSON array text (non-finite floats inside as the strings "nan", ...).
pub fn meta_string(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) => s.clone(),
        MetaValue::F32(x) if !x.is_finite() => nonfinite(f64::from(*x)).to_string(),
        MetaValue::F64(x) if !x.is_finite() => nonfinite(*x).to_string(),
        other => {
            let mut s = String::new();
            json_text(other, &mut s);
            s
        }
    }
}

fn nonfinite(x: f64) -> &'static str {
    if x.is_nan() {
        "nan"
    } else if x > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

fn json_text(v: &MetaValue, out: &mut String) {
    use std::fmt::Write as _;
    // Writing to a String cannot fail.
    let _ = match v {
        MetaValue::String(s) => {
            out.push_str(&json_str(s));
            Ok(())
        }
        MetaValue::F32(x) if x.is_finite() => write!(out, "{x:?}"),
        MetaValue::F64(x) if x.is_finite() => write!(out, "{x:?}"),
        MetaValue::F32(x) => write!(out, "\"{}\"", nonfinite(f64::from(*x))),
        MetaValue::F64(x) => write!(out, "\"{}\"", nonfinite(*x)),
        MetaValue::Bool(b) => write!(out, "{b}"),
        MetaValue::U8(x) => write!(out, "{x}"),
        MetaValue::I8(x) => write!(out, "{x}"),
        MetaValue::U16(x) => write!(out, "{x}"),
        MetaValue::I16(x) => write!(out, "{x}"),
        MetaValue::U32(x) => write!(out, "{x}"),
        MetaValue::I32(x) => write!(out, "{x}"),
        MetaValue::U64(x) => write!(out, "{x}"),
        MetaValue::I64(x) => write!(out, "{x}"),
        MetaValue::Array { values, .. } => {
            out.push('[');
            for (i, x) in values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_text(x, out);
            }
            out.push(']');
            Ok(())
        }
    };
}

/// `model.safetensors` (or its F16/BF16 form): u64 LE header length N, N
/// bytes of JSON padded with spaces to a multiple of 8 (as the reference
/// implementation writes it, so the data starts 8-aligned), then every
/// tensor's bytes, contiguous, in the given order. The JSON holds
/// `__metadata__` (every key/value as a string, [`meta_string`]) and one
/// entry per tensor: dtype, outer-first shape, `data_offsets` relative to
/// the data.
pub fn safetensors(tensors: &[ViewTensor], md: &Metadata, fmt: ElemFormat) -> Result<Built> {
    let mut v = safetensors_all(tensors, md, &[fmt]);
    v.pop()
        .unwrap_or_else(|| Err(err(ErrorKind::BadValue, "no safetensors view built")))
}

/// [`safetensors`] in each of `fmts`, sharing the `__metadata__` text
/// (for a 150k-token vocabulary it is megabytes of JSON).
pub fn safetensors_all(
    tensors: &[ViewTensor],
    md: &Metadata,
    fmts: &[ElemFormat],
) -> Vec<Result<Built>> {
    if fmts.is_empty() {
        // Nothing to build; skip rendering the metadata (megabytes of JSON
        // for a large vocabulary).
        return Vec::new();
    }
    // The full `__metadata__`, unless it alone passes safetensors' limit
    // (then every format gets the summarized one: no header is built
    // beyond the limit).
    let mut full = metadata_json(md, false);
    let mut summarized: Option<String> = None;
    let note = || {
        format!(
            "__metadata__ arrays longer than {SUMMARY_ARRAY_LIMIT} are summarized \
             (the full header would pass safetensors' {SAFETENSORS_MAX_HEADER}-byte limit)"
        )
    };
    let last = fmts.len() - 1;
    fmts.iter()
        .enumerate()
        .map(|(i, &fmt)| {
            // The last format takes the text's buffer as its header.
            let full_meta = match &mut full {
                Some(text) if i == last => Some(Cow::Owned(std::mem::take(text))),
                Some(text) => Some(Cow::Borrowed(text.as_str())),
                None => None,
            };
            let tried = full_meta.map(|m| safetensors_with(tensors, m, fmt));
            match tried {
                Some(Err(e)) if e.kind() != ErrorKind::TooLarge => Err(e),
                Some(Ok(layout)) => Ok(Built {
                    layout,
                    notes: Vec::new(),
                }),
                _ => {
                    let meta = match &summarized {
                        Some(m) => m,
                        None => summarized.insert(
                            metadata_json(md, true)
                                .ok_or_else(|| err(ErrorKind::TooLarge, note()))?,
                        ),
                    };
                    let layout = safetensors_with(tensors, Cow::Borrowed(meta.as_str()), fmt)?;
                    Ok(Built {
                        layout,
                        notes: vec![note()],
                    })
                }
            }
        })
        .collect()
}

/// JSON text of a string (escaped and quoted).
fn json_str(s: &str) -> String {
    // Serializing a str cannot fail.
    serde_json::to_string(s).unwrap_or_default()
}

/// Append `s` to `out` JSON-escaped, without the quotes: exactly what
/// serde_json writes between them (`"` and `\\` escaped, the control
/// characters as `\b`, `\t`, `\n`, `\f`, `\r` or `\u00xx`, nothing else).
fn push_escaped(out: &mut String, s: &str) {
    let mut plain = 0;
    for (i, b) in s.bytes().enumerate() {
        let Some(e) = escape_of(b) else { continue };
        // Every byte escaped is ASCII, so these are char boundaries.
        out.push_str(&s[plain..i]);
        out.push_str(&e);
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
}

/// The JSON escape of byte `b` ([`push_escaped`]), None for a byte
/// written as it is.
fn escape_of(b: u8) -> Option<std::borrow::Cow<'static, str>> {
    Some(match b {
        b'"' => "\\\"".into(),
        b'\\' => "\\\\".into(),
        0x08 => "\\b".into(),
        b'\t' => "\\t".into(),
        b'\n' => "\\n".into(),
        0x0c => "\\f".into(),
        b'\r' => "\\r".into(),
        0x00..=0x1f => format!("\\u{b:04x}").into(),
        _ => return None,
    })
}

/// Length of `s` JSON-escaped once (`twice`: escaped, quoted, and that
/// escaped again: a string element of an array in `__metadata__`).
fn escaped_len(s: &str, twice: bool) -> usize {
    let specials: usize = s
        .bytes()
        .map(|b| match escape_of(b) {
            None => 0,
            Some(e) if twice => {
                e.bytes()
                    .map(|x| escape_of(x).map_or(1, |d| d.len()))
                    .sum::<usize>()
                    - 1
            }
            Some(e) => e.len() - 1,
        })
        .sum();
    s.len() + specials + if twice { 4 } else { 0 }
}

/// Append `s` as a JSON string (quoted, escaped), escaped again: how a
/// string element of an array stands in `__metadata__`'s text.
fn push_escaped_twice(out: &mut String, s: &str) {
    out.push_str("\\\"");
    let mut plain = 0;
    for (i, b) in s.bytes().enumerate() {
        let Some(e) = escape_of(b) else { continue };
        // Every byte escaped is ASCII, so these are char boundaries.
        out.push_str(&s[plain..i]);
        push_escaped(out, &e);
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
    out.push_str("\\\"");
}

/// Append the `__metadata__` string of `v` ([`meta_string`]) to `out` as
/// a JSON string, escaped on the way: a long array is never held as text
/// and again escaped (for a vocabulary, tens of megabytes each). False,
/// with `out` grown by at most `limit` bytes, when `out` would pass
/// `limit`: nothing is built beyond it, however the value escapes.
fn push_meta_string(out: &mut String, v: &MetaValue, limit: usize) -> bool {
    let fits = |out: &String, more: usize| out.len().saturating_add(more) <= limit;
    out.push('"');
    match v {
        MetaValue::Array { values, .. } => {
            let mut element = String::new();
            out.push('[');
            for (i, x) in values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if let MetaValue::String(s) = x {
                    if !fits(out, escaped_len(s, true)) {
                        return false;
                    }
                    push_escaped_twice(out, s);
                    continue;
                }
                // Numbers, bools, nested arrays: short, or checked as
                // they grow (a nested array's elements are each short).
                element.clear();
                json_text(x, &mut element);
                if !fits(out, escaped_len(&element, false)) {
                    return false;
                }
                push_escaped(out, &element);
            }
            out.push(']');
        }
        MetaValue::String(s) => {
            if !fits(out, escaped_len(s, false)) {
                return false;
            }
            push_escaped(out, s);
        }
        other => push_escaped(out, &meta_string(other)),
    }
    out.push('"');
    fits(out, 0)
}

/// `{"__metadata__":` and the `__metadata__` object as JSON text: every
/// key/value as a string; with `summarize`, long arrays as a summary
/// object's text. The start of a safetensors header ([`safetensors_with`]).
/// None once it passes [`SAFETENSORS_MAX_HEADER`]: no header can hold it.
fn metadata_json(md: &Metadata, summarize: bool) -> Option<String> {
    let mut out = String::from(METADATA_PREFIX);
    out.push('{');
    for (i, (k, v)) in md.entries.iter().enumerate() {
        if out.len() > MAX_METADATA_JSON {
            return None;
        }
        if i > 0 {
            out.push(',');
        }
        out.push_str(&json_str(k));
        out.push(':');
        match v {
            MetaValue::Array { elem, values }
                if summarize && values.len() > SUMMARY_ARRAY_LIMIT =>
            {
                out.push_str(&json_str(
                    &json!({"type": "array", "elem_type": elem.name(), "len": values.len(), "omitted": true})
                        .to_string(),
                ));
            }
            _ => {
                if !push_meta_string(&mut out, v, MAX_METADATA_JSON) {
                    return None;
                }
            }
        }
    }
    out.push('}');
    (out.len() <= MAX_METADATA_JSON).then_some(out)
}

/// The start of a safetensors header whose `__metadata__` is the JSON
/// object `object` (for [`safetensors_with`]).
pub(in crate::fs) fn header_start(object: &str) -> String {
    format!("{METADATA_PREFIX}{object}")
}

/// The longest `__metadata__` text built: safetensors' header limit.
const MAX_METADATA_JSON: usize = SAFETENSORS_MAX_HEADER as usize;

/// What a safetensors header starts with: 8 bytes for its length (written
/// over these spaces when the header is done), then the JSON.
const METADATA_PREFIX: &str = "        {\"__metadata__\":";

/// A safetensors layout whose header starts with `meta_json` (from
/// [`metadata_json`]: the length's 8 bytes, then `{"__metadata__":{...}`).
/// The header is built in `meta_json`'s own buffer when the caller gives
/// it away (one view), copied from it otherwise.
pub(in crate::fs) fn safetensors_with(
    tensors: &[ViewTensor],
    meta_json: Cow<'_, str>,
    fmt: ElemFormat,
) -> Result<Layout> {
    use std::fmt::Write as _;
    let mut json = meta_json.into_owned();
    json.reserve(128 * tensors.len() + 32);
    let mut names = std::collections::HashSet::with_capacity(tensors.len());
    let mut spans = Vec::with_capacity(tensors.len());
    let mut off = 0u64;
    for t in tensors {
        if t.name == "__metadata__" || !names.insert(t.name) {
            return Err(err(
                ErrorKind::BadName,
                "a safetensors file cannot hold two tensors of one name, nor one named __metadata__",
            )
            .tensor(t.name));
        }
        let len = tensor_len(t, fmt)?;
        let end = add(off, len, "safetensors data size")?;
        let shape = t
            .shape
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        // Writing to a String cannot fail.
        let _ = write!(
            json,
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{shape}],\"data_offsets\":[{off},{end}]}}",
            json_str(t.name),
            fmt.dtype()
        );
        spans.push((off, len));
        off = end;
    }
    json.push('}');
    // Spaces, as the reference writer pads: the data then starts 8-aligned.
    let padded = (json.len() - 8).next_multiple_of(8);
    let n = padded as u64;
    if n > SAFETENSORS_MAX_HEADER {
        return Err(err(
            ErrorKind::TooLarge,
            format!(
                "safetensors header of {n} bytes exceeds the {SAFETENSORS_MAX_HEADER}-byte limit"
            ),
        ));
    }
    let base = 8 + n;
    // Every segment ends by `size`, so computing it first bounds them all.
    let size = add(base, off, "safetensors size")?;
    let mut header = json.into_bytes();
    header[..8].copy_from_slice(&n.to_le_bytes());
    header.resize(padded + 8, b' ');
    let mut segments = Vec::with_capacity(tensors.len());
    for (t, &(o, len)) in tensors.iter().zip(&spans) {
        segments.extend(tensor_segments(t, base + o, len, fmt)?);
    }
    Layout::new(header, fmt, segments, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed escaping is serde_json's, byte for byte, and the
    /// streamed `__metadata__` strings are [`meta_string`]'s, escaped.
    #[test]
    fn streamed_metadata_text_is_what_serde_json_writes() {
        let mut all: String = (0u8..=0x7f).map(char::from).collect();
        all.push_str("é\u{2028}\u{10ffff}\"\\\u{7f}x");
        for s in [all.as_str(), "", "plain", "\"", "a\u{0}b\u{1f}"] {
            let mut got = String::new();
            push_escaped(&mut got, s);
            assert_eq!(format!("\"{got}\""), json_str(s), "{s:?}");
        }
        let values = [
            MetaValue::String(all.clone()),
            MetaValue::F32(f32::NAN),
            MetaValue::F64(-1.5),
            MetaValue::U64(u64::MAX),
            MetaValue::Bool(true),
            MetaValue::Array {
                elem: crate::format::meta::MetaType::String,
                values: vec![
                    MetaValue::String(all.clone()),
                    MetaValue::String("\n".into()),
                ],
            },
            MetaValue::Array {
                elem: crate::format::meta::MetaType::F32,
                values: vec![MetaValue::F32(f32::INFINITY), MetaValue::F32(0.25)],
            },
        ];
        for v in &values {
            let mut got = String::new();
            assert!(push_meta_string(&mut got, v, usize::MAX));
            let want = json_str(&meta_string(v));
            assert_eq!(got, want, "{v:?}");
            // A limit one byte short refuses it; one at half its length
            // stops it near there (a string or array is not built past the
            // limit but for its closing characters).
            let mut short = String::new();
            assert!(!push_meta_string(&mut short, v, want.len() - 1), "{v:?}");
            if matches!(v, MetaValue::String(_) | MetaValue::Array { .. }) {
                let mut half = String::new();
                assert!(!push_meta_string(&mut half, v, want.len() / 2), "{v:?}");
                assert!(half.len() <= want.len() / 2 + 2, "{v:?}: {}", half.len());
            }
        }
        for s in [all.as_str(), "", "\u{0}\u{1f}\\\""] {
            assert_eq!(escaped_len(s, false), json_str(s).len() - 2, "{s:?}");
            assert_eq!(
                escaped_len(s, true),
                json_str(&json_str(s)).len() - 2,
                "{s:?}"
            );
        }
    }
}
