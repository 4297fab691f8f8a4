//! Printing strings that came from a file or a user.
//!
//! Tensor names, metadata keys and values, paths and `ctl` commands are
//! untrusted: printed raw, an ESC or OSC sequence in a tensor name would
//! drive the reader's terminal (retitle it, rewrite earlier lines, or worse),
//! and a CR or newline would forge log lines. Every place that prints such a
//! string to a terminal, a log, `ctl` or an error message goes through
//! [`escape`] (or [`Escaped`]); JSON output goes through
//! [`escape_json_text`].
//!
//! What is escaped, and how:
//! - C0 controls and DEL: `\n`, `\r`, `\t` by name, the rest as `\xNN`;
//! - C1 controls (U+0080..U+009F; U+009B is a one-character CSI on some
//!   terminals) and the bidirectional overrides and isolates
//!   (U+202A..U+202E, U+2066..U+2069; they reorder what is displayed after
//!   them) as `\u{NNNN}`.
//!
//! Backslashes are left alone, so an escaped string reads naturally; the
//! escaping is for display, not a reversible encoding (JSON output is the
//! exact form).

use std::borrow::Cow;
use std::fmt;

/// Whether `c` must not reach a terminal or a log line raw.
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every unsafe character escaped (module docs); borrowed when
/// there is nothing to escape.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        push_escaped(&mut out, c);
    }
    Cow::Owned(out)
}

fn push_escaped(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if (c as u32) < 0x80 && is_unsafe_char(c) => {
            out.push_str(&format!("\\x{:02x}", c as u32));
        }
        c if is_unsafe_char(c) => out.push_str(&format!("\\u{{{:04x}}}", c as u32)),
        c => out.push(c),
    }
}

/// Display adapter: `format!("{}", Escaped(name))` prints `name` escaped.
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(self.0))
    }
}

/// Serialized JSON made safe to print: serde_json escapes C0 controls but
/// writes DEL, C1 controls and bidi overrides raw. Those can only occur
/// inside JSON strings (the structure is ASCII), where `\uXXXX` decodes to
/// the same character, so the document's meaning is unchanged.
pub fn escape_json_text(json: String) -> String {
    if !json.chars().any(is_unsafe_char) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if is_unsafe_char(c) {
            // Outside strings serde_json only emits ASCII whitespace, which
            // must stay as it is.
            if matches!(c, '\n' | '\r' | '\t') {
                out.push(c);
            } else {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_bidi_only() {
        assert!(matches!(escape("blk.0.attn_q.weight"), Cow::Borrowed(_)));
        assert_eq!(escape("a\x1b]0;owned\x07b"), "a\\x1b]0;owned\\x07b");
        assert_eq!(escape("x\ny\rz\t"), "x\\ny\\rz\\t");
        assert_eq!(escape("del\x7f"), "del\\x7f");
        assert_eq!(escape("csi\u{9b}31m"), "csi\\u{009b}31m");
        assert_eq!(escape("abc\u{202e}fdp.exe"), "abc\\u{202e}fdp.exe");
        assert_eq!(escape("ünïcödé ✓ \\"), "ünïcödé ✓ \\");
        assert_eq!(format!("{}", Escaped("\x1b[2J")), "\\x1b[2J");
    }

    #[test]
    fn json_text_stays_equivalent() {
        let v = serde_json::json!({"name": "a\u{9b}b\u{7f}\u{202e}\x1b", "n": [1, 2]});
        let pretty = serde_json::to_string_pretty(&v).unwrap();
        let safe = escape_json_text(pretty.clone());
        assert!(!safe.chars().any(|c| is_unsafe_char(c) && c != '\n'));
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back, v);
        assert!(safe.contains("\\u009b") && safe.contains("\\u202e"));
    }
}
