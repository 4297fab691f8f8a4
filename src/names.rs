//! Tensor names: the one owner of spelling and aliasing.
//!
//! Every tensor has a canonical GGUF-dot name (`blk.0.attn_q.weight`) and an
//! underscore spelling (`blk_0_attn_q_weight`, what dense .knot files store).
//! The sketch generator's `attn_o` is the same tensor as `attn_output`;
//! canonical is `attn_output`. [`canonical`] maps any accepted spelling to
//! the canonical dot name; [`NameIndex`] refuses two stored tensors that
//! land on the same name.

use std::collections::HashMap;

use crate::error::{ErrorKind, Result, err};
use crate::text;

/// Per-layer component aliases: (alias, canonical).
const COMPONENT_ALIASES: &[(&str, &str)] = &[("attn_o", "attn_output")];

/// Last components of GGUF tensor names. An underscore name is split at the
/// last `_` only when what follows is one of these.
const SUFFIXES: &[&str] = &["weight", "bias", "scale", "scales"];

/// Tensors whose vocab-sized tables must never be served from a low-rank
/// sketch (seed 000: a rank-32 sketch of the vocab poisons the output).
pub const VOCAB_TENSORS: &[&str] = &["token_embd.weight", "output.weight"];

fn alias_component(part: &str) -> &str {
    COMPONENT_ALIASES
        .iter()
        .find(|(a, _)| *a == part)
        .map(|(_, c)| *c)
        .unwrap_or(part)
}

/// Canonical GGUF-dot name for any accepted spelling.
///
/// - a name containing `.` is taken as dot-spelled; `attn_o` is aliased;
/// - an underscore name `blk_<n>_<part>_<suffix>` becomes
///   `blk.<n>.<part>.<suffix>`; `<stem>_<suffix>` becomes `<stem>.<suffix>`;
/// - anything else is returned unchanged.
pub fn canonical(name: &str) -> String {
    if name.contains('.') {
        let parts: Vec<&str> = name.split('.').collect();
        // Only alias the component slot of `blk.N.<part>.<suffix>` so that a
        // tensor literally named e.g. `attn_o.weight` at top level is left alone.
        if parts.len() == 4 && parts[0] == "blk" && is_digits(parts[1]) {
            return format!(
                "blk.{}.{}.{}",
                parts[1],
                alias_component(parts[2]),
                parts[3]
            );
        }
        return name.to_string();
    }
    if let Some(rest) = name.strip_prefix("blk_") {
        if let Some((layer, tail)) = rest.split_once('_')
            && is_digits(layer)
            && let Some((part, suffix)) = split_suffix(tail)
        {
            return format!("blk.{layer}.{}.{suffix}", alias_component(part));
        }
        return name.to_string();
    }
    match split_suffix(name) {
        Some((stem, suffix)) => format!("{stem}.{suffix}"),
        None => name.to_string(),
    }
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn split_suffix(s: &str) -> Option<(&str, &str)> {
    let (stem, suffix) = s.rsplit_once('_')?;
    if stem.is_empty() || !SUFFIXES.contains(&suffix) {
        return None;
    }
    Some((stem, suffix))
}

/// Underscore spelling of a (canonical) dot name.
pub fn underscore(dot: &str) -> String {
    dot.replace('.', "_")
}

/// Whether the tensor is one of the vocab tables sketches may not serve.
pub fn is_vocab_tensor(canonical_name: &str) -> bool {
    VOCAB_TENSORS.contains(&canonical_name)
}

/// Both spellings of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorName {
    pub dot: String,
    pub underscore: String,
}

impl TensorName {
    /// Names from a stored spelling (either form).
    pub fn from_stored(stored: &str) -> Result<Self> {
        check_servable(stored)?;
        let dot = canonical(stored);
        Ok(TensorName {
            underscore: underscore(&dot),
            dot,
        })
    }
}

/// Longest tensor name accepted: with the longest extension the mount adds
/// (`.bf16`) a file name stays under NAME_MAX (255).
pub const MAX_NAME_BYTES: usize = 240;

/// Reject names that cannot be file names in the mount. A tensor's stored
/// name (and so both its spellings) becomes a file name, and names reach
/// terminals and logs, so a name is refused (`BadName`) when it is empty,
/// longer than [`MAX_NAME_BYTES`], `.` or `..`, starts with `.` (a hidden
/// file; `..x` would read like a parent path), or contains `/`, NUL or any
/// character [`text::is_unsafe_char`] escapes (C0/C1 controls, DEL, bidi
/// overrides). Real tensor names are ASCII letters, digits, `.` and `_`.
pub fn check_servable(name: &str) -> Result<()> {
    let why = if name.is_empty() {
        Some("it is empty".to_string())
    } else if name.len() > MAX_NAME_BYTES {
        Some(format!(
            "it is {} bytes long (max {MAX_NAME_BYTES})",
            name.len()
        ))
    } else if name == "." || name == ".." {
        Some("it is a directory name".to_string())
    } else if name.starts_with('.') {
        Some("it starts with '.'".to_string())
    } else if name.contains('/') {
        Some("it contains '/'".to_string())
    } else {
        name.chars()
            .find(|&c| c == '\0' || text::is_unsafe_char(c))
            .map(|c| {
                format!(
                    "it contains the control character {}",
                    text::escape(&c.to_string())
                )
            })
    };
    match why {
        None => Ok(()),
        Some(why) => {
            // Long names are cut for the message (the cap is the problem).
            let shown: String = name.chars().take(MAX_NAME_BYTES).collect();
            Err(err(
                ErrorKind::BadName,
                format!(
                    "tensor name \"{}\" cannot be served as a file name: {why}",
                    text::escape(&shown)
                ),
            ))
        }
    }
}

/// Name -> index lookup that accepts every spelling and refuses collisions.
#[derive(Debug, Default, Clone)]
pub struct NameIndex {
    by_name: HashMap<String, usize>,
}

impl NameIndex {
    /// Register `name` for entry `index`. Both spellings are registered; a
    /// spelling already taken by another entry is a `BadName` error naming
    /// both stored names.
    pub fn insert(&mut self, name: &TensorName, stored: &str, index: usize) -> Result<()> {
        for key in [&name.dot, &name.underscore] {
            if let Some(&other) = self.by_name.get(key.as_str())
                && other != index
            {
                return Err(err(
                    ErrorKind::BadName,
                    format!(
                        "duplicate tensor name: stored name {stored:?} resolves to {key:?}, \
                             which another tensor already has"
                    ),
                )
                .tensor(stored));
            }
            self.by_name.insert(key.clone(), index);
        }
        Ok(())
    }

    /// Look up any spelling (dot, underscore, `attn_o` alias).
    pub fn get(&self, query: &str) -> Option<usize> {
        if let Some(&i) = self.by_name.get(query) {
            return Some(i);
        }
        self.by_name.get(canonical(query).as_str()).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_forms() {
        for (input, want) in [
            ("blk.0.attn_q.weight", "blk.0.attn_q.weight"),
            ("blk_0_attn_q_weight", "blk.0.attn_q.weight"),
            ("blk_12_ffn_down_weight", "blk.12.ffn_down.weight"),
            ("blk.3.attn_o.weight", "blk.3.attn_output.weight"),
            ("blk_3_attn_o_weight", "blk.3.attn_output.weight"),
            ("blk_3_attn_output_weight", "blk.3.attn_output.weight"),
            ("blk_3_attn_q_bias", "blk.3.attn_q.bias"),
            ("token_embd_weight", "token_embd.weight"),
            ("output_norm_weight", "output_norm.weight"),
            ("output_weight", "output.weight"),
            ("rope_freqs_weight", "rope_freqs.weight"),
            ("token_embd.weight", "token_embd.weight"),
            // Not a GGUF pattern: left alone.
            ("something", "something"),
            ("blk_x_attn_q_weight", "blk_x_attn_q_weight"),
            ("attn_o.weight", "attn_o.weight"),
            ("blk.+1.attn_o.weight", "blk.+1.attn_o.weight"),
            ("foo.bar_weight", "foo.bar_weight"),
            ("blk_0_weight", "blk_0_weight"),
        ] {
            assert_eq!(canonical(input), want, "{input}");
        }
    }

    #[test]
    fn underscore_round_trips_for_gguf_names() {
        let parts = [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "ffn_norm",
            "attn_q_norm",
            "attn_k_norm",
            "ffn_gate_exps",
        ];
        for l in [0, 7, 29] {
            for p in parts {
                for s in ["weight", "bias"] {
                    let dot = format!("blk.{l}.{p}.{s}");
                    assert_eq!(canonical(&underscore(&dot)), dot);
                }
            }
        }
        for top in ["token_embd.weight", "output.weight", "output_norm.weight"] {
            assert_eq!(canonical(&underscore(top)), top);
        }
    }

    #[test]
    fn index_accepts_all_spellings_and_rejects_collisions() {
        let mut idx = NameIndex::default();
        let a = TensorName::from_stored("blk.1.attn_o.weight").unwrap();
        assert_eq!(a.dot, "blk.1.attn_output.weight");
        assert_eq!(a.underscore, "blk_1_attn_output_weight");
        idx.insert(&a, "blk.1.attn_o.weight", 0).unwrap();
        for q in [
            "blk.1.attn_o.weight",
            "blk.1.attn_output.weight",
            "blk_1_attn_o_weight",
            "blk_1_attn_output_weight",
        ] {
            assert_eq!(idx.get(q), Some(0), "{q}");
        }
        let b = TensorName::from_stored("blk.1.attn_output.weight").unwrap();
        let e = idx.insert(&b, "blk.1.attn_output.weight", 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadName);
        assert!(e.to_string().contains("duplicate"), "{e}");
        assert_eq!(idx.get("nope"), None);
    }

    #[test]
    fn unservable_names() {
        for bad in [
            "",
            "a/b",
            "/abs",
            "..",
            ".",
            ".hidden",
            "..x",
            "x\0y",
            "blk.0\x1b]0;owned\x07.weight",
            "a\rb",
            "tab\tname",
            "nl\n",
            "del\x7f",
            "csi\u{9b}31m",
            "rtl\u{202e}gpj.exe",
            &"x".repeat(241),
        ] {
            let e = TensorName::from_stored(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::BadName, "{bad:?}");
            let s = e.to_string();
            assert!(s.contains("cannot be served as a file name"), "{s}");
            assert!(!s.chars().any(text::is_unsafe_char), "{s:?}");
        }
        for good in [
            "blk.0.attn_q.weight",
            "x",
            "a.",
            "a..b",
            "ünïcode.weight",
            &"x".repeat(240),
        ] {
            TensorName::from_stored(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
    }
}
