//! Model key/values in JSON: the typed JSON form of the GGUF value model
//! ([`crate::format::gguf::value`], re-exported here), shared by every format.
//!
//! GGUF stores typed values; dense .knot and .rknot carry the same key/values
//! in their JSON headers. To keep the types (llama.cpp checks them), our
//! writers store each value as a typed JSON object:
//!
//! ```json
//! {"type": "u32", "value": 30}
//! {"type": "array", "elem_type": "string", "value": ["a", "b"]}
//! {"type": "array", "elem_type": "array", "value": [{"type": "array", ...}]}
//! ```
//!
//! Readers also accept plain JSON values (numbers, strings, bools, arrays)
//! written by other tools and infer a type for them.

use std::cell::RefCell;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::error::{Error, ErrorKind, Result, err};
use crate::format::json::{Expect, Found, OptStr, Parse, Seed, raw_value, skip_value};

use crate::format::gguf::value::MAX_ARRAY_DEPTH;
pub use crate::format::gguf::value::{
    META_BUDGET_BASE, META_BUDGET_PER_HEADER_BYTE, MetaBudget, MetaType, MetaValue, Metadata,
    meta_budget_limit,
};

impl MetaValue {
    /// Typed JSON form (see module docs; [`TypedJson`] serializes it
    /// without building a `Value`).
    pub fn to_typed_json(&self) -> Value {
        // Serializing into a `Value` cannot fail: every map key is a string.
        serde_json::to_value(TypedJson(self)).unwrap_or(Value::Null)
    }
}

/// A value in its typed JSON form (module docs), serialized directly.
pub struct TypedJson<'a>(pub &'a MetaValue);

impl Serialize for TypedJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self.0 {
            MetaValue::Array { elem, values } => {
                let mut m = s.serialize_map(Some(3))?;
                m.serialize_entry("type", "array")?;
                m.serialize_entry("elem_type", elem.name())?;
                m.serialize_entry("value", &TypedElems(values))?;
                m.end()
            }
            v => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("type", v.meta_type().name())?;
                m.serialize_entry("value", &PlainJson(v))?;
                m.end()
            }
        }
    }
}

/// A typed array's elements: plain values, nested arrays typed.
struct TypedElems<'a>(&'a [MetaValue]);

impl Serialize for TypedElems<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut q = s.serialize_seq(Some(self.0.len()))?;
        for v in self.0 {
            match v {
                MetaValue::Array { .. } => q.serialize_element(&TypedJson(v))?,
                _ => q.serialize_element(&PlainJson(v))?,
            }
        }
        q.end()
    }
}

/// A value in its plain JSON form (floats JSON cannot hold are the strings
/// `"nan"`, `"inf"`, `"-inf"`).
struct PlainJson<'a>(&'a MetaValue);

impl Serialize for PlainJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        fn float<S: Serializer>(s: S, v: f64) -> std::result::Result<S::Ok, S::Error> {
            if v.is_finite() {
                s.serialize_f64(v)
            } else if v.is_nan() {
                s.serialize_str("nan")
            } else if v > 0.0 {
                s.serialize_str("inf")
            } else {
                s.serialize_str("-inf")
            }
        }
        match self.0 {
            MetaValue::U8(v) => s.serialize_u8(*v),
            MetaValue::I8(v) => s.serialize_i8(*v),
            MetaValue::U16(v) => s.serialize_u16(*v),
            MetaValue::I16(v) => s.serialize_i16(*v),
            MetaValue::U32(v) => s.serialize_u32(*v),
            MetaValue::I32(v) => s.serialize_i32(*v),
            MetaValue::U64(v) => s.serialize_u64(*v),
            MetaValue::I64(v) => s.serialize_i64(*v),
            MetaValue::Bool(v) => s.serialize_bool(*v),
            MetaValue::String(v) => s.serialize_str(v),
            MetaValue::F32(v) => float(s, f64::from(*v)),
            MetaValue::F64(v) => float(s, *v),
            MetaValue::Array { values, .. } => {
                let mut q = s.serialize_seq(Some(values.len()))?;
                for v in values {
                    q.serialize_element(&PlainJson(v))?;
                }
                q.end()
            }
        }
    }
}

fn bad(msg: String) -> crate::error::Error {
    err(ErrorKind::BadJson, msg)
}

/// The same error without its byte offset (for JSON that is not a file's).
fn strip_offset(e: Error) -> Error {
    let mut out = err(e.kind(), e.message());
    if let Some(t) = e.tensor_name() {
        out = out.tensor(t);
    }
    out
}

// ------------------------------------------------------------ JSON reading

/// What the metadata visitors share: the parse state and the budget.
#[derive(Clone, Copy)]
pub struct JsonMeta<'a> {
    pub p: &'a Parse,
    pub budget: &'a RefCell<MetaBudget>,
    /// Size of the header the metadata sits in.
    pub header_bytes: u64,
    /// Arrays of arrays entered so far. Counted here, not left to
    /// serde_json's recursion limit: a value given before its type is
    /// parsed later by a fresh deserializer, whose limit starts again.
    pub depth: usize,
}

impl JsonMeta<'_> {
    fn fail<E: de::Error>(&self, msg: String) -> E {
        self.p.fail(ErrorKind::BadJson, msg)
    }

    fn charge<E: de::Error>(&self, bytes: u64) -> std::result::Result<(), E> {
        self.budget
            .borrow_mut()
            .charge(bytes, self.header_bytes)
            .map_err(|m| self.p.fail(ErrorKind::TooLarge, m))
    }

    fn keep<E: de::Error>(&self, v: MetaValue) -> std::result::Result<MetaValue, E> {
        self.charge(MetaBudget::value_bytes(&v))?;
        Ok(v)
    }
}

/// Parse a model-metadata JSON object (typed or plain values, module docs)
/// straight into [`Metadata`], without an intermediate `Value`, charging
/// `budget`. Use through [`Seed`].
pub struct MetadataSeed<'a>(pub JsonMeta<'a>);

impl<'de> Expect<'de> for MetadataSeed<'_> {
    type Value = Metadata;
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.0.fail("\"metadata\" is not a JSON object".into())
    }
    fn on_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Metadata, A::Error> {
        let c = self.0;
        let mut md = Metadata::default();
        while let Some(key) = map.next_key::<String>()? {
            c.charge(MetaBudget::ENTRY_BYTES + key.len() as u64)
                .and_then(|()| map.next_value_seed(Seed(ValueSeed(c))))
                .map(|v| md.push(key.clone(), v))
                .inspect_err(|_| {
                    c.p.prefix(&format!("metadata key {key:?}: "));
                })?;
        }
        Ok(md)
    }
}

/// A top-level metadata value: a typed object, or a plain value whose type
/// is inferred.
struct ValueSeed<'a>(JsonMeta<'a>);

impl<'de> Expect<'de> for ValueSeed<'_> {
    type Value = MetaValue;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        // Only null reaches here (everything else is accepted).
        self.0.fail(format!("metadata value is {}", found.kind()))
    }
    fn on_map<A: MapAccess<'de>>(self, map: A) -> std::result::Result<MetaValue, A::Error> {
        typed(self.0, map)
    }
    fn on_bool<E: de::Error>(self, v: bool) -> std::result::Result<MetaValue, E> {
        self.0.keep(MetaValue::Bool(v))
    }
    fn on_u64<E: de::Error>(self, v: u64) -> std::result::Result<MetaValue, E> {
        Plain(self.0).on_u64(v)
    }
    fn on_i64<E: de::Error>(self, v: i64) -> std::result::Result<MetaValue, E> {
        Plain(self.0).on_i64(v)
    }
    fn on_f64<E: de::Error>(self, v: f64) -> std::result::Result<MetaValue, E> {
        Plain(self.0).on_f64(v)
    }
    fn on_str<E: de::Error>(self, v: &str) -> std::result::Result<MetaValue, E> {
        Plain(self.0).on_str(v)
    }
    fn on_seq<A: SeqAccess<'de>>(self, seq: A) -> std::result::Result<MetaValue, A::Error> {
        Plain(self.0).on_seq(seq)
    }
}

/// A plain JSON value written by another tool: its type is inferred
/// (integers become u32/u64 or i32/i64, other numbers f32, arrays take
/// their first element's type).
struct Plain<'a>(JsonMeta<'a>);

impl<'de> Expect<'de> for Plain<'_> {
    type Value = MetaValue;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        match found {
            Found::Object => self.0.fail("unexpected object in metadata".into()),
            other => self.0.fail(format!("metadata value is {}", other.kind())),
        }
    }
    fn on_bool<E: de::Error>(self, v: bool) -> std::result::Result<MetaValue, E> {
        self.0.keep(MetaValue::Bool(v))
    }
    fn on_u64<E: de::Error>(self, v: u64) -> std::result::Result<MetaValue, E> {
        self.0.keep(match u32::try_from(v) {
            Ok(x) => MetaValue::U32(x),
            Err(_) => MetaValue::U64(v),
        })
    }
    fn on_i64<E: de::Error>(self, v: i64) -> std::result::Result<MetaValue, E> {
        self.0.keep(match i32::try_from(v) {
            Ok(x) => MetaValue::I32(x),
            Err(_) => MetaValue::I64(v),
        })
    }
    fn on_f64<E: de::Error>(self, v: f64) -> std::result::Result<MetaValue, E> {
        self.0.keep(MetaValue::F32(v as f32))
    }
    fn on_str<E: de::Error>(self, v: &str) -> std::result::Result<MetaValue, E> {
        // Charged before the copy is made.
        self.0.charge(MetaBudget::VALUE_BYTES + v.len() as u64)?;
        Ok(MetaValue::String(v.to_string()))
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<MetaValue, A::Error> {
        let c = self.0;
        let mut values: Vec<MetaValue> = Vec::new();
        while let Some(v) = seq.next_element_seed(Seed(Plain(c)))? {
            if values
                .first()
                .is_some_and(|f| f.meta_type() != v.meta_type())
            {
                return Err(c.fail("plain metadata array with mixed element types".into()));
            }
            values.push(v);
        }
        let elem = values.first().map_or(MetaType::U32, MetaValue::meta_type);
        c.keep(MetaValue::Array { elem, values })
    }
}

/// A typed object `{"type": .., ["elem_type": ..,] "value": ..}`. The
/// value is parsed as soon as its type is known; a value that comes before
/// its `type` (key order carries no meaning) is kept as a span of the
/// header and parsed at the end of the object.
fn typed<'de, A: MapAccess<'de>>(
    c: JsonMeta<'_>,
    mut map: A,
) -> std::result::Result<MetaValue, A::Error> {
    // None: absent; Some(None): not a string.
    let mut ty: Option<Option<MetaType>> = None;
    let mut elem: Option<Option<MetaType>> = None;
    let mut value: Option<MetaValue> = None;
    let mut raw: Option<&'de RawValue> = None;
    while let Some(key) = map.next_key::<String>()? {
        let twice = match key.as_str() {
            "type" => ty.is_some(),
            "elem_type" => elem.is_some(),
            "value" => value.is_some() || raw.is_some(),
            _ => false,
        };
        if twice {
            return Err(c.fail(format!("metadata object has {key:?} twice")));
        }
        match key.as_str() {
            "type" => {
                ty = Some(match map.next_value_seed(Seed(OptStr))? {
                    Some(name) => Some(
                        MetaType::from_name(&name)
                            .ok_or_else(|| c.fail(format!("unknown metadata type {name:?}")))?,
                    ),
                    None => None,
                });
            }
            "elem_type" => {
                elem = Some(
                    map.next_value_seed(Seed(OptStr))?
                        .and_then(|n| MetaType::from_name(&n)),
                );
            }
            "value" => match (ty, elem) {
                (Some(Some(MetaType::Array)), Some(Some(et))) => {
                    value = Some(map.next_value_seed(Seed(TypedArray { c, elem: et }))?);
                }
                (Some(Some(t)), _) if t != MetaType::Array => {
                    value = Some(map.next_value_seed(Seed(Scalar { c, t }))?);
                }
                _ => raw = Some(raw_value(&mut map)?),
            },
            _ => skip_value(&mut map)?,
        }
    }
    let Some(Some(t)) = ty else {
        return Err(c.fail("metadata object without a string \"type\"".into()));
    };
    // A value parsed as it came had its type (and element type) already.
    let raw = match (value, raw) {
        (Some(v), _) => return Ok(v),
        (None, Some(raw)) => raw,
        (None, None) => {
            return Err(c.fail(format!("metadata {} without \"value\"", t.name())));
        }
    };
    let et = match (t, elem) {
        (MetaType::Array, Some(Some(et))) => Some(et),
        (MetaType::Array, _) => {
            return Err(c.fail("metadata array without a known \"elem_type\"".into()));
        }
        _ => None,
    };
    // The deferred value: a span of the same document, so it borrows.
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let r = match et {
        Some(elem) => Seed(TypedArray { c, elem }).deserialize(&mut de),
        None => Seed(Scalar { c, t }).deserialize(&mut de),
    };
    r.map_err(de::Error::custom)
}

/// The `value` of a typed array.
struct TypedArray<'a> {
    c: JsonMeta<'a>,
    elem: MetaType,
}

impl<'de> Expect<'de> for TypedArray<'_> {
    type Value = MetaValue;
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.c
            .fail("metadata array \"value\" is not a JSON array".into())
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<MetaValue, A::Error> {
        let (c, elem) = (self.c, self.elem);
        let mut values = Vec::new();
        if elem == MetaType::Array {
            while let Some(v) = seq.next_element_seed(Seed(Nested(c)))? {
                values.push(v);
            }
        } else {
            while let Some(v) = seq.next_element_seed(Seed(Scalar { c, t: elem }))? {
                values.push(v);
            }
        }
        c.keep(MetaValue::Array { elem, values })
    }
}

/// An element of an array of arrays: itself a typed array object.
struct Nested<'a>(JsonMeta<'a>);

impl<'de> Expect<'de> for Nested<'_> {
    type Value = MetaValue;
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.0.fail("nested array element is not an object".into())
    }
    fn on_map<A: MapAccess<'de>>(self, map: A) -> std::result::Result<MetaValue, A::Error> {
        let c = JsonMeta {
            depth: self.0.depth + 1,
            ..self.0
        };
        // The same limit as GGUF's: the outermost array is level 1.
        if c.depth + 1 > MAX_ARRAY_DEPTH {
            return Err(c.fail(format!(
                "metadata arrays nested deeper than {} levels",
                MAX_ARRAY_DEPTH
            )));
        }
        let v = typed(c, map)?;
        if v.meta_type() != MetaType::Array {
            return Err(self.0.fail("nested array element is not an array".into()));
        }
        Ok(v)
    }
}

/// One value of a declared scalar type.
struct Scalar<'a> {
    c: JsonMeta<'a>,
    t: MetaType,
}

impl Scalar<'_> {
    /// An integer `x` (JSON value `found`) as the declared type: integer
    /// types check the range, float types take it, others refuse it.
    fn int<E: de::Error>(self, x: i128, found: Found) -> std::result::Result<MetaValue, E> {
        let range = || {
            self.c
                .fail(format!("metadata {} value {x} out of range", self.t.name()))
        };
        let v = match self.t {
            MetaType::U8 => MetaValue::U8(u8::try_from(x).map_err(|_| range())?),
            MetaType::I8 => MetaValue::I8(i8::try_from(x).map_err(|_| range())?),
            MetaType::U16 => MetaValue::U16(u16::try_from(x).map_err(|_| range())?),
            MetaType::I16 => MetaValue::I16(i16::try_from(x).map_err(|_| range())?),
            MetaType::U32 => MetaValue::U32(u32::try_from(x).map_err(|_| range())?),
            MetaType::I32 => MetaValue::I32(i32::try_from(x).map_err(|_| range())?),
            MetaType::U64 => MetaValue::U64(u64::try_from(x).map_err(|_| range())?),
            MetaType::I64 => MetaValue::I64(i64::try_from(x).map_err(|_| range())?),
            MetaType::F32 => MetaValue::F32(x as f32),
            MetaType::F64 => MetaValue::F64(x as f64),
            MetaType::Bool | MetaType::String | MetaType::Array => return Err(self.wrong(found)),
        };
        self.c.keep(v)
    }
}

impl<'de> Expect<'de> for Scalar<'_> {
    type Value = MetaValue;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        let (t, v) = (self.t.name(), found.text());
        self.c.fail(match self.t {
            MetaType::F32 | MetaType::F64 => format!("metadata {t} value {v} is not a number"),
            MetaType::Bool => format!("metadata bool value {v} is not a bool"),
            MetaType::String => format!("metadata string value {v} is not a string"),
            MetaType::Array => "array where a scalar was expected".into(),
            _ => format!("metadata {t} value {v} is not an integer"),
        })
    }
    fn on_u64<E: de::Error>(self, v: u64) -> std::result::Result<MetaValue, E> {
        self.int(v.into(), Found::U64(v))
    }
    fn on_i64<E: de::Error>(self, v: i64) -> std::result::Result<MetaValue, E> {
        self.int(v.into(), Found::I64(v))
    }
    fn on_f64<E: de::Error>(self, v: f64) -> std::result::Result<MetaValue, E> {
        match self.t {
            MetaType::F32 => self.c.keep(MetaValue::F32(v as f32)),
            MetaType::F64 => self.c.keep(MetaValue::F64(v)),
            _ => Err(self.wrong(Found::F64(v))),
        }
    }
    fn on_bool<E: de::Error>(self, v: bool) -> std::result::Result<MetaValue, E> {
        match self.t {
            MetaType::Bool => self.c.keep(MetaValue::Bool(v)),
            _ => Err(self.wrong(Found::Bool(v))),
        }
    }
    fn on_str<E: de::Error>(self, v: &str) -> std::result::Result<MetaValue, E> {
        let float = |x: f64| match self.t {
            MetaType::F32 => MetaValue::F32(x as f32),
            _ => MetaValue::F64(x),
        };
        match self.t {
            MetaType::String => {
                self.c.charge(MetaBudget::VALUE_BYTES + v.len() as u64)?;
                Ok(MetaValue::String(v.to_string()))
            }
            MetaType::F32 | MetaType::F64 => match v {
                "nan" => self.c.keep(float(f64::NAN)),
                "inf" => self.c.keep(float(f64::INFINITY)),
                "-inf" => self.c.keep(float(f64::NEG_INFINITY)),
                _ => Err(self.c.fail(format!("metadata float {v:?} unreadable"))),
            },
            _ => Err(self.wrong(Found::Str(v))),
        }
    }
}

/// Parse a model-metadata JSON object `json`, which starts at absolute
/// offset `base` of a `header_bytes` header (for the memory budget); `what`
/// names the document in errors.
pub fn parse_metadata_at(
    json: &[u8],
    base: u64,
    header_bytes: u64,
    what: &str,
) -> Result<Metadata> {
    let p = Parse::default();
    let budget = RefCell::new(MetaBudget::default());
    let c = JsonMeta {
        p: &p,
        budget: &budget,
        header_bytes,
        depth: 0,
    };
    p.run(Seed(MetadataSeed(c)), json, base, what)
}

/// Parse a model-metadata JSON document (an object) with the memory budget
/// of a `header_bytes` header. Errors carry no file offset.
pub fn parse_metadata_json(json: &[u8], header_bytes: u64) -> Result<Metadata> {
    parse_metadata_at(json, 0, header_bytes, "metadata").map_err(strip_offset)
}

impl Metadata {
    /// Typed JSON object, key order kept.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (k, v) in &self.entries {
            m.insert(k.clone(), v.to_typed_json());
        }
        Value::Object(m)
    }

    /// Parse a `metadata` object held as a `Value` (index.json's; header
    /// readers parse straight from the file's bytes with [`MetadataSeed`]).
    pub fn from_json(v: &Value) -> Result<Metadata> {
        let text = serde_json::to_vec(v)
            .map_err(|e| bad(format!("metadata cannot be serialized: {e}")))?;
        parse_metadata_json(&text, text.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        let mut md = Metadata::default();
        md.push("general.architecture", MetaValue::String("llama".into()));
        md.push("llama.block_count", MetaValue::U32(30));
        md.push("x.i8", MetaValue::I8(-3));
        md.push("x.i64", MetaValue::I64(-1 << 40));
        md.push("x.u64", MetaValue::U64(u64::MAX));
        md.push("llama.eps", MetaValue::F32(1e-5));
        md.push("x.f64", MetaValue::F64(0.1));
        md.push("x.nan", MetaValue::F32(f32::INFINITY));
        md.push("x.bool", MetaValue::Bool(true));
        md.push(
            "tok",
            MetaValue::Array {
                elem: MetaType::String,
                values: vec![
                    MetaValue::String("a".into()),
                    MetaValue::String(" b".into()),
                ],
            },
        );
        md.push(
            "nested",
            MetaValue::Array {
                elem: MetaType::Array,
                values: vec![MetaValue::Array {
                    elem: MetaType::I16,
                    values: vec![MetaValue::I16(-2), MetaValue::I16(5)],
                }],
            },
        );
        md
    }

    #[test]
    fn deferred_nested_arrays_are_depth_limited() {
        // "value" before "type" is parsed after the object, by a fresh
        // deserializer (its own recursion limit): depth must be counted by
        // the visitors, or a few hundred KB of header overflow the stack.
        let mut v = r#"{"value":[1],"type":"array","elem_type":"u8"}"#.to_string();
        for _ in 0..20_000 {
            v = format!(r#"{{"value":[{v}],"type":"array","elem_type":"array"}}"#);
        }
        let doc = format!(r#"{{"k":{v}}}"#);
        let e = parse_metadata_json(doc.as_bytes(), doc.len() as u64).unwrap_err();
        assert!(e.to_string().contains("nested deeper than"), "{e}");
        // Within the limit (as GGUF's: 4 levels) it parses.
        let mut ok = r#"{"value":[1],"type":"array","elem_type":"u8"}"#.to_string();
        for _ in 0..3 {
            ok = format!(r#"{{"value":[{ok}],"type":"array","elem_type":"array"}}"#);
        }
        let doc = format!(r#"{{"k":{ok}}}"#);
        parse_metadata_json(doc.as_bytes(), doc.len() as u64).unwrap();
        // One more level is refused.
        let deeper = format!(r#"{{"k":{{"value":[{ok}],"type":"array","elem_type":"array"}}}}"#);
        let e = parse_metadata_json(deeper.as_bytes(), deeper.len() as u64).unwrap_err();
        assert!(e.to_string().contains("nested deeper than 4"), "{e}");
    }

    #[test]
    fn typed_json_round_trip_keeps_types_and_order() {
        let md = sample();
        let text = serde_json::to_string(&md.to_json()).unwrap();
        let back = Metadata::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, md);
        assert_eq!(back.arch_u64("block_count"), Some(30));
    }

    #[test]
    fn floats_survive_json_exactly() {
        // serde_json's default float parser may be off by an ulp; the
        // `float_roundtrip` feature makes it exact.
        let mut md = Metadata::default();
        for (i, x) in [12487825989694781969u64 as f64, 0.1, 1e-310, f64::MAX]
            .into_iter()
            .enumerate()
        {
            md.push(format!("f64.{i}"), MetaValue::F64(x));
        }
        md.push("f32", MetaValue::F32(1e-5));
        let text = serde_json::to_vec(&md.to_json()).unwrap();
        let back = parse_metadata_json(&text, text.len() as u64).unwrap();
        for ((k, a), (_, b)) in md.entries.iter().zip(&back.entries) {
            let bits = |v: &MetaValue| match v {
                MetaValue::F64(x) => x.to_bits(),
                MetaValue::F32(x) => u64::from(x.to_bits()),
                _ => 0,
            };
            assert_eq!(bits(a), bits(b), "{k}: {a:?} -> {b:?}");
        }
    }

    #[test]
    fn value_before_type_and_budget() {
        let text = br#"{"a": {"value": [1, 2], "elem_type": "u8", "type": "array"},
                        "b": {"value": "x", "type": "string"}}"#;
        let md = parse_metadata_json(text, text.len() as u64).unwrap();
        assert_eq!(
            md.get("a"),
            Some(&MetaValue::Array {
                elem: MetaType::U8,
                values: vec![MetaValue::U8(1), MetaValue::U8(2)]
            })
        );
        assert_eq!(md.get("b"), Some(&MetaValue::String("x".into())));
        // 2M small ints (4 MB of JSON) parse to 64 MB: over 2 x 4 MB + 32 MiB.
        let big = format!("{{\"k\": [{}1]}}", "1,".repeat(2_000_000));
        let e = parse_metadata_json(big.as_bytes(), big.len() as u64).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TooLarge, "{e}");
        assert!(e.to_string().contains("metadata key \"k\""), "{e}");
        // The same values fit the budget of a header 16x larger.
        parse_metadata_json(big.as_bytes(), 16 * big.len() as u64).unwrap();
    }

    #[test]
    fn plain_json_is_inferred() {
        let v: Value =
            serde_json::json!({"a": 3, "b": -4, "c": 1.5, "d": "s", "e": [1, 2], "f": true});
        let md = Metadata::from_json(&v).unwrap();
        assert_eq!(md.get("a"), Some(&MetaValue::U32(3)));
        assert_eq!(md.get("b"), Some(&MetaValue::I32(-4)));
        assert_eq!(md.get("c"), Some(&MetaValue::F32(1.5)));
        assert_eq!(md.get("e").unwrap().meta_type(), MetaType::Array);
    }

    #[test]
    fn bad_typed_values_are_errors() {
        for v in [
            serde_json::json!({"k": {"type": "u8", "value": 300}}),
            serde_json::json!({"k": {"type": "nope", "value": 1}}),
            serde_json::json!({"k": {"type": "array", "value": [1]}}),
            serde_json::json!({"k": null}),
            serde_json::json!([1, 2]),
        ] {
            assert_eq!(
                Metadata::from_json(&v).unwrap_err().kind(),
                ErrorKind::BadJson,
                "{v}"
            );
        }
    }
}
