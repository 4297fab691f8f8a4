//! Typed deserialization of header JSON, with errors that say which object
//! and field was wrong.
//!
//! Header JSON is untrusted and can be large (a .rknot header lists every
//! block). Parsing it into `serde_json::Value` costs ~40 bytes per number
//! and ~100 per object entry, so a 64 MiB header of small numbers became
//! 2.4 GB. The readers instead drive serde visitors that build exactly the
//! index they need (u64s in `Vec`s, names as `String`s) and skip every
//! unknown value with [`IgnoredAny`], which serde_json parses without
//! building anything. Values whose meaning depends on a sibling field that
//! may come later (a tensor's `blocks` need its `block_shape`) are captured
//! as borrowed [`RawValue`] spans of the header and parsed once the sibling
//! is known: zero-copy.
//!
//! Errors: a visitor that meets a value of the wrong JSON type (or a value
//! it refuses) records the failure in the shared [`Parse`] state with its
//! [`ErrorKind`], the message (`sketch "x": field "rank" must be a
//! non-negative integer, found a string`) and, when known, the tensor; the
//! reader turns that into an [`Error`] at the byte offset where serde_json
//! stopped. JSON syntax errors become `BadJson` errors saying the header is
//! not valid JSON.

use std::cell::RefCell;
use std::fmt;
use std::ops::Range;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::error::{Error, ErrorKind, Result, err};

/// What a JSON value turned out to be, for "found ..." in messages.
#[derive(Debug, Clone, Copy)]
pub enum Found<'a> {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(&'a str),
    Array,
    Object,
}

impl Found<'_> {
    /// "a number", "an array", ...
    pub fn kind(&self) -> &'static str {
        match self {
            Found::Null => "null",
            Found::Bool(_) => "a bool",
            Found::U64(_) | Found::I64(_) | Found::F64(_) => "a number",
            Found::Str(_) => "a string",
            Found::Array => "an array",
            Found::Object => "an object",
        }
    }

    /// The value as JSON text (scalars as serde_json writes them; arrays
    /// and objects, which are not kept, as `[...]` and `{...}`). Strings are
    /// cut at 64 characters: the message is for people.
    pub fn text(&self) -> String {
        match *self {
            Found::Null => "null".into(),
            Found::Bool(b) => b.to_string(),
            Found::U64(v) => v.to_string(),
            Found::I64(v) => v.to_string(),
            Found::F64(v) => {
                serde_json::Number::from_f64(v).map_or_else(|| v.to_string(), |n| n.to_string())
            }
            Found::Str(s) => {
                let cut: String = s.chars().take(64).collect();
                let mut t = serde_json::to_string(&cut).unwrap_or_default();
                if cut.len() < s.len() {
                    t.push_str("...");
                }
                t
            }
            Found::Array => "[...]".into(),
            Found::Object => "{...}".into(),
        }
    }
}

impl fmt::Display for Found<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text())
    }
}

/// The first failure a visitor recorded.
#[derive(Debug)]
struct Failure {
    kind: ErrorKind,
    message: String,
    tensor: Option<String>,
    /// Where the problem is, when it is not where the parser stopped (a
    /// block offset the header points at).
    offset: Option<u64>,
}

/// Shared state of one header parse.
#[derive(Debug, Default)]
pub struct Parse {
    failure: RefCell<Option<Failure>>,
}

impl Parse {
    /// Record a failure (the first one wins: it is what stopped the parse)
    /// and return the serde error that unwinds the deserializer.
    pub fn fail<E: de::Error>(&self, kind: ErrorKind, message: impl Into<String>) -> E {
        let message = message.into();
        let mut f = self.failure.borrow_mut();
        if f.is_none() {
            *f = Some(Failure {
                kind,
                message: message.clone(),
                tensor: None,
                offset: None,
            });
        }
        E::custom(message)
    }

    /// Record one of our errors as the failure (kind, message, tensor and
    /// offset kept).
    pub fn fail_error<E: de::Error>(&self, e: Error) -> E {
        let mut f = self.failure.borrow_mut();
        if f.is_none() {
            *f = Some(Failure {
                kind: e.kind(),
                message: e.message().to_string(),
                tensor: e.tensor_name().map(str::to_string),
                offset: e.offset(),
            });
        }
        E::custom(e.message())
    }

    /// The recorded failure concerns this tensor (unless one is named).
    pub fn blame(&self, tensor: &str) {
        if let Some(f) = self.failure.borrow_mut().as_mut()
            && f.tensor.is_none()
        {
            f.tensor = Some(tensor.to_string());
        }
    }

    /// Prefix the recorded failure's message (an enclosing object adds its
    /// name: `metadata key "k": ...`).
    pub fn prefix(&self, prefix: &str) {
        if let Some(f) = self.failure.borrow_mut().as_mut() {
            f.message.insert_str(0, prefix);
        }
    }

    /// Our error for a failed parse of `json`, which starts at absolute file
    /// offset `base`; `what` names the document ("meta_json").
    pub fn error(&self, e: &serde_json::Error, json: &[u8], base: u64, what: &str) -> Error {
        let at = base.saturating_add(byte_offset(json, e));
        match self.failure.borrow_mut().take() {
            Some(f) => {
                let mut out = err(f.kind, f.message).at(f.offset.unwrap_or(at));
                if let Some(t) = f.tensor {
                    out = out.tensor(&t);
                }
                out
            }
            None => err(ErrorKind::BadJson, format!("{what} is not valid JSON: {e}")).at(at),
        }
    }

    /// Deserialize `json` (a document or a captured span) with `seed`.
    pub fn run<'de, S: DeserializeSeed<'de>>(
        &self,
        seed: S,
        json: &'de [u8],
        base: u64,
        what: &str,
    ) -> Result<S::Value> {
        let mut de = serde_json::Deserializer::from_slice(json);
        let r = seed.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
        r.map_err(|e| self.error(&e, json, base, what))
    }
}

/// Byte offset in `json` of the position serde_json reports (line and
/// column, both from 1; the column counts bytes).
fn byte_offset(json: &[u8], e: &serde_json::Error) -> u64 {
    let mut line_start = 0usize;
    if e.line() > 1 {
        let mut lines = 1usize;
        for (i, &b) in json.iter().enumerate() {
            if b == b'\n' {
                lines += 1;
                if lines == e.line() {
                    line_start = i + 1;
                    break;
                }
            }
        }
    }
    (line_start + e.column().saturating_sub(1)).min(json.len()) as u64
}

/// Where a captured value lies inside the document it was parsed from.
pub fn span_of(raw: &RawValue, doc: &[u8]) -> Range<usize> {
    let text = raw.get();
    // `raw` borrows from `doc` (both come from one `from_slice` parse).
    let start = (text.as_ptr() as usize).saturating_sub(doc.as_ptr() as usize);
    let start = start.min(doc.len());
    start..(start + text.len()).min(doc.len())
}

/// Whether a captured value is a JSON object.
pub fn is_object(raw: &RawValue) -> bool {
    raw.get().trim_start().starts_with('{')
}

// --------------------------------------------------------------- visitors

/// One expected shape of JSON value. Implementors override the `on_*`
/// methods for what they accept; everything else becomes [`Expect::wrong`].
/// Use through [`Seed`].
pub trait Expect<'de>: Sized {
    type Value;

    /// The error for a value of the wrong JSON type.
    fn wrong<E: de::Error>(self, found: Found) -> E;

    fn on_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Err(self.wrong(Found::Bool(v)))
    }
    fn on_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Err(self.wrong(Found::U64(v)))
    }
    fn on_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Err(self.wrong(Found::I64(v)))
    }
    fn on_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Err(self.wrong(Found::F64(v)))
    }
    fn on_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Err(self.wrong(Found::Str(v)))
    }
    fn on_null<E: de::Error>(self) -> Result<Self::Value, E> {
        Err(self.wrong(Found::Null))
    }
    fn on_seq<A: SeqAccess<'de>>(self, _seq: A) -> Result<Self::Value, A::Error> {
        Err(self.wrong(Found::Array))
    }
    fn on_map<A: MapAccess<'de>>(self, _map: A) -> Result<Self::Value, A::Error> {
        Err(self.wrong(Found::Object))
    }
}

/// Adapter: an [`Expect`] as a serde seed and visitor.
pub struct Seed<T>(pub T);

impl<'de, T: Expect<'de>> DeserializeSeed<'de> for Seed<T> {
    type Value = T::Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T: Expect<'de>> Visitor<'de> for Seed<T> {
    type Value = T::Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<T::Value, E> {
        self.0.on_bool(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T::Value, E> {
        self.0.on_u64(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T::Value, E> {
        self.0.on_i64(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T::Value, E> {
        self.0.on_f64(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T::Value, E> {
        self.0.on_str(v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<T::Value, E> {
        self.0.on_null()
    }
    fn visit_none<E: de::Error>(self) -> Result<T::Value, E> {
        self.0.on_null()
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<T::Value, A::Error> {
        self.0.on_seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T::Value, A::Error> {
        self.0.on_map(map)
    }
}

/// Skip the rest of a sequence.
pub fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skip the rest of a map.
pub fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skip one map value.
pub fn skip_value<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>().map(|_| ())
}

/// Capture one map value as a span of the document (parsed later).
pub fn raw_value<'de, A: MapAccess<'de>>(map: &mut A) -> Result<&'de RawValue, A::Error> {
    map.next_value::<&'de RawValue>()
}

/// A string value, or `None` for any other JSON value (skipped without
/// being built).
pub struct OptStr;

impl<'de> Expect<'de> for OptStr {
    type Value = Option<String>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        // Every type is accepted; only a logic error reaches this.
        E::custom(format!("unexpected {}", found.kind()))
    }
    fn on_str<E: de::Error>(self, v: &str) -> Result<Option<String>, E> {
        Ok(Some(v.to_string()))
    }
    fn on_bool<E: de::Error>(self, _: bool) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn on_u64<E: de::Error>(self, _: u64) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn on_i64<E: de::Error>(self, _: i64) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn on_f64<E: de::Error>(self, _: f64) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn on_null<E: de::Error>(self) -> Result<Option<String>, E> {
        Ok(None)
    }
    fn on_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<String>, A::Error> {
        drain_seq(seq).map(|()| None)
    }
    fn on_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<String>, A::Error> {
        drain_map(map).map(|()| None)
    }
}

/// Any JSON value, remembered only as what it was (for messages such as
/// `header version "3" is not supported`).
pub struct AnyFound;

/// An owned [`Found`].
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(String),
    Array,
    Object,
}

impl Seen {
    pub fn found(&self) -> Found<'_> {
        match self {
            Seen::Null => Found::Null,
            Seen::Bool(b) => Found::Bool(*b),
            Seen::U64(v) => Found::U64(*v),
            Seen::I64(v) => Found::I64(*v),
            Seen::F64(v) => Found::F64(*v),
            Seen::Str(s) => Found::Str(s),
            Seen::Array => Found::Array,
            Seen::Object => Found::Object,
        }
    }
}

impl<'de> Expect<'de> for AnyFound {
    type Value = Seen;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        E::custom(format!("unexpected {}", found.kind()))
    }
    fn on_bool<E: de::Error>(self, v: bool) -> Result<Seen, E> {
        Ok(Seen::Bool(v))
    }
    fn on_u64<E: de::Error>(self, v: u64) -> Result<Seen, E> {
        Ok(Seen::U64(v))
    }
    fn on_i64<E: de::Error>(self, v: i64) -> Result<Seen, E> {
        Ok(Seen::I64(v))
    }
    fn on_f64<E: de::Error>(self, v: f64) -> Result<Seen, E> {
        Ok(Seen::F64(v))
    }
    fn on_str<E: de::Error>(self, v: &str) -> Result<Seen, E> {
        // Only the start is ever shown.
        Ok(Seen::Str(v.chars().take(65).collect()))
    }
    fn on_null<E: de::Error>(self) -> Result<Seen, E> {
        Ok(Seen::Null)
    }
    fn on_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Seen, A::Error> {
        drain_seq(seq).map(|()| Seen::Array)
    }
    fn on_map<A: MapAccess<'de>>(self, map: A) -> Result<Seen, A::Error> {
        drain_map(map).map(|()| Seen::Object)
    }
}

// ----------------------------------------------------------------- fields

/// A field of an object: `ctx` names the object (`sketch "x"`), `key` the
/// field.
#[derive(Clone, Copy)]
pub struct Field<'a> {
    pub p: &'a Parse,
    pub ctx: &'a str,
    pub key: &'a str,
}

impl<'a> Field<'a> {
    pub fn new(p: &'a Parse, ctx: &'a str, key: &'a str) -> Self {
        Field { p, ctx, key }
    }

    /// `ctx: field "key" must be WANT, found KIND` (BadJson).
    pub fn wrong<E: de::Error>(&self, want: &str, found: Found) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!(
                "{}: field \"{}\" must be {want}, found {}",
                self.ctx,
                self.key,
                found.kind()
            ),
        )
    }

    /// The field's value (the next one of `map`): a non-negative integer.
    pub fn read_u64<'de, A: MapAccess<'de>>(self, map: &mut A) -> Result<u64, A::Error> {
        map.next_value_seed(Seed(U64Value {
            f: self,
            want: "a non-negative integer",
        }))
    }

    /// The field's value: any JSON number, as f64.
    pub fn read_f64<'de, A: MapAccess<'de>>(self, map: &mut A) -> Result<f64, A::Error> {
        map.next_value_seed(Seed(F64Value {
            f: self,
            want: "a number",
        }))
    }

    /// The field's value: a string.
    pub fn read_string<'de, A: MapAccess<'de>>(self, map: &mut A) -> Result<String, A::Error> {
        map.next_value_seed(Seed(StrValue(self)))
    }
}

/// A field's value, or `ctx: missing field "key"` (BadJson) when the object
/// did not have it.
pub fn required<T>(v: Option<T>, ctx: &str, key: &str) -> Result<T> {
    v.ok_or_else(|| {
        err(
            ErrorKind::BadJson,
            format!("{ctx}: missing field \"{key}\""),
        )
    })
}

/// A non-negative integer of field `f` (the field, or an element of it:
/// `want` is what the message says was wanted).
struct U64Value<'a> {
    f: Field<'a>,
    want: &'static str,
}

impl<'de> Expect<'de> for U64Value<'_> {
    type Value = u64;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.f.wrong(self.want, found)
    }
    fn on_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
}

/// Any JSON number of field `f`, as f64 (`want` as for [`U64Value`]).
struct F64Value<'a> {
    f: Field<'a>,
    want: &'static str,
}

impl<'de> Expect<'de> for F64Value<'_> {
    type Value = f64;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.f.wrong(self.want, found)
    }
    fn on_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }
    fn on_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }
    fn on_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }
}

/// A string field.
struct StrValue<'a>(Field<'a>);

impl<'de> Expect<'de> for StrValue<'_> {
    type Value = String;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.0.wrong("a string", found)
    }
    fn on_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_string())
    }
}

/// What to do when an array field has more entries than a reader keeps.
#[derive(Clone, Copy)]
pub struct MaxLen<'a> {
    pub len: usize,
    pub kind: ErrorKind,
    /// The message (the array is not kept past `len` entries).
    pub message: &'a str,
}

/// An array of non-negative integers, at most `max.len` of them; with
/// `increasing`, strictly increasing (else a `BadValue` error with that
/// message).
pub struct U64Array<'a> {
    pub f: Field<'a>,
    pub max: Option<MaxLen<'a>>,
    pub increasing: Option<&'a str>,
}

impl<'de> Expect<'de> for U64Array<'_> {
    type Value = Vec<u64>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.f.wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Seed(U64Value {
            f: self.f,
            want: "an array of non-negative integers",
        }))? {
            if let Some(m) = self.max
                && out.len() >= m.len
            {
                return Err(self.f.p.fail(m.kind, m.message));
            }
            if let Some(message) = self.increasing
                && out.last().is_some_and(|&last| last >= v)
            {
                return Err(self.f.p.fail(ErrorKind::BadValue, message));
            }
            out.push(v);
        }
        Ok(out)
    }
}

/// An array of finite numbers, kept as f32 (a value that is not finite as
/// an f32 is a `NonFinite` error).
pub struct F32Array<'a>(pub Field<'a>);

impl<'de> Expect<'de> for F32Array<'_> {
    type Value = Vec<f32>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.0.wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<f32>, A::Error> {
        let mut out = Vec::new();
        while let Some(x) = seq.next_element_seed(Seed(F64Value {
            f: self.0,
            want: "an array of numbers",
        }))? {
            let f = x as f32;
            if !f.is_finite() {
                return Err(self.0.p.fail(
                    ErrorKind::NonFinite,
                    format!(
                        "{}: \"{}\" holds {x:?}, not a finite f32",
                        self.0.ctx, self.0.key
                    ),
                ));
            }
            out.push(f);
        }
        Ok(out)
    }
}

/// The state of an [`ObjectOf`] visitor: `entry(key, map)` must consume
/// the value (parse it, or skip it with [`skip_value`]).
pub trait Entries<'de> {
    type Value;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error>;
    fn done<E: de::Error>(self) -> Result<Self::Value, E>;
}

/// An object visited entry by entry through an [`Entries`] state. A value
/// of another type is `<ctx> must be a JSON object, found ...` (BadJson).
pub struct ObjectOf<'a, S> {
    pub p: &'a Parse,
    /// Names the object in the not-an-object message.
    pub ctx: &'a str,
    pub state: S,
}

impl<'de, S: Entries<'de>> Expect<'de> for ObjectOf<'_, S> {
    type Value = S::Value;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!("{} must be a JSON object, found {}", self.ctx, found.kind()),
        )
    }
    fn on_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<S::Value, A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            self.state.entry(key, &mut map)?;
        }
        self.state.done()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_u64(text: &str) -> Result<u64> {
        let p = Parse::default();
        p.run(
            Seed(U64Value {
                f: Field::new(&p, "sketch \"x\"", "rank"),
                want: "a non-negative integer",
            }),
            text.as_bytes(),
            100,
            "doc",
        )
    }

    #[test]
    fn field_errors_name_object_field_and_found_type() {
        assert_eq!(parse_u64("7").unwrap(), 7);
        for (text, found) in [
            ("\"7\"", "found a string"),
            ("7.5", "found a number"),
            ("-1", "found a number"),
            ("null", "found null"),
            ("[7]", "found an array"),
            ("{}", "found an object"),
        ] {
            let e = parse_u64(text).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::BadJson, "{e}");
            let s = e.to_string();
            assert!(
                s.contains("sketch \"x\": field \"rank\" must be a non-negative integer")
                    && s.contains(found),
                "{s}"
            );
            assert!(e.offset().is_some_and(|o| o >= 100), "{s}");
        }
        let e = parse_u64("nul").unwrap_err();
        assert!(e.to_string().contains("doc is not valid JSON"), "{e}");
    }

    #[test]
    fn offsets_follow_lines_and_columns() {
        let p = Parse::default();
        let doc = b"[1,\n 2,\n \"x\"]";
        let e = p
            .run(
                Seed(U64Array {
                    f: Field::new(&p, "t", "shape"),
                    max: None,
                    increasing: None,
                }),
                doc,
                10,
                "doc",
            )
            .unwrap_err();
        // The string starts at byte 9 of the document; serde_json stops
        // inside it.
        let at = e.offset().unwrap();
        assert!((19..=22).contains(&at), "{e}");
    }

    #[test]
    fn capped_arrays_stop_early() {
        let p = Parse::default();
        let e = p
            .run(
                Seed(U64Array {
                    f: Field::new(&p, "t", "shape"),
                    max: Some(MaxLen {
                        len: 2,
                        kind: ErrorKind::BadShape,
                        message: "too many dims",
                    }),
                    increasing: None,
                }),
                b"[1,2,3]",
                0,
                "doc",
            )
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadShape);
    }

    #[test]
    fn found_text_is_json() {
        assert_eq!(Found::F64(1.0).text(), "1.0");
        assert_eq!(Found::F64(2.5).text(), "2.5");
        assert_eq!(Found::Str("12").text(), "\"12\"");
        assert_eq!(Found::Array.text(), "[...]");
        let long = "x".repeat(100);
        assert!(Found::Str(&long).text().ends_with("\"..."));
    }
}
