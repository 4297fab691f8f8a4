//! Model key/values: the GGUF value model, shared by every format.
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

use serde_json::{Map, Value, json};

use crate::error::{ErrorKind, Result, err};

/// GGUF metadata value type ids, in GGUF numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl MetaType {
    pub fn from_id(id: u32) -> Option<Self> {
        use MetaType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn name(self) -> &'static str {
        use MetaType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        (0..=12)
            .filter_map(MetaType::from_id)
            .find(|t| t.name() == name)
    }

    /// Encoded size of a scalar of this type in GGUF (None for string/array).
    pub fn scalar_size(self) -> Option<u64> {
        use MetaType::*;
        Some(match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String | Array => return None,
        })
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Elements all have type `elem`.
    Array {
        elem: MetaType,
        values: Vec<MetaValue>,
    },
}

impl MetaValue {
    pub fn meta_type(&self) -> MetaType {
        use MetaValue::*;
        match self {
            U8(_) => MetaType::U8,
            I8(_) => MetaType::I8,
            U16(_) => MetaType::U16,
            I16(_) => MetaType::I16,
            U32(_) => MetaType::U32,
            I32(_) => MetaType::I32,
            F32(_) => MetaType::F32,
            Bool(_) => MetaType::Bool,
            String(_) => MetaType::String,
            U64(_) => MetaType::U64,
            I64(_) => MetaType::I64,
            F64(_) => MetaType::F64,
            Array { .. } => MetaType::Array,
        }
    }

    /// Integer value of any integer type, if it fits in u64.
    pub fn as_u64(&self) -> Option<u64> {
        use MetaValue::*;
        match *self {
            U8(v) => Some(v.into()),
            U16(v) => Some(v.into()),
            U32(v) => Some(v.into()),
            U64(v) => Some(v),
            I8(v) => u64::try_from(v).ok(),
            I16(v) => u64::try_from(v).ok(),
            I32(v) => u64::try_from(v).ok(),
            I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Short human summary (arrays print their length, not their contents).
    pub fn summary(&self) -> String {
        match self {
            MetaValue::String(s) => {
                let one_line = s.replace('\n', "\\n");
                if one_line.chars().count() > 60 {
                    let cut: String = one_line.chars().take(57).collect();
                    format!("{cut:?}...")
                } else {
                    format!("{one_line:?}")
                }
            }
            MetaValue::Array { elem, values } => format!("[{}; {}]", elem.name(), values.len()),
            MetaValue::F32(v) => format!("{v}"),
            MetaValue::F64(v) => format!("{v}"),
            MetaValue::Bool(v) => format!("{v}"),
            other => other.as_u64().map_or_else(
                || match other {
                    MetaValue::I8(v) => v.to_string(),
                    MetaValue::I16(v) => v.to_string(),
                    MetaValue::I32(v) => v.to_string(),
                    MetaValue::I64(v) => v.to_string(),
                    _ => String::new(),
                },
                |v| v.to_string(),
            ),
        }
    }

    /// Typed JSON form (see module docs).
    pub fn to_typed_json(&self) -> Value {
        match self {
            MetaValue::Array { elem, values } => json!({
                "type": "array",
                "elem_type": elem.name(),
                "value": values.iter().map(|v| match v {
                    MetaValue::Array { .. } => v.to_typed_json(),
                    _ => v.to_plain_json(),
                }).collect::<Vec<_>>(),
            }),
            _ => json!({"type": self.meta_type().name(), "value": self.to_plain_json()}),
        }
    }

    /// Plain JSON form of a scalar (floats that JSON cannot hold are strings).
    pub fn to_plain_json(&self) -> Value {
        use MetaValue::*;
        match self {
            U8(v) => json!(v),
            I8(v) => json!(v),
            U16(v) => json!(v),
            I16(v) => json!(v),
            U32(v) => json!(v),
            I32(v) => json!(v),
            U64(v) => json!(v),
            I64(v) => json!(v),
            Bool(v) => json!(v),
            String(s) => json!(s),
            F32(v) => float_json(f64::from(*v)),
            F64(v) => float_json(*v),
            Array { values, .. } => {
                Value::Array(values.iter().map(|v| v.to_plain_json()).collect())
            }
        }
    }

    /// Parse a typed JSON value, or infer a type for a plain one.
    pub fn from_json(v: &Value) -> Result<MetaValue> {
        if let Value::Object(obj) = v {
            return from_typed(obj);
        }
        infer(v)
    }
}

fn float_json(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else if v.is_nan() {
        json!("nan")
    } else if v > 0.0 {
        json!("inf")
    } else {
        json!("-inf")
    }
}

fn bad(msg: String) -> crate::error::Error {
    err(ErrorKind::BadJson, msg)
}

fn from_typed(obj: &Map<String, Value>) -> Result<MetaValue> {
    let ty = obj
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("metadata object without a string \"type\"".into()))?;
    let t = MetaType::from_name(ty).ok_or_else(|| bad(format!("unknown metadata type {ty:?}")))?;
    let value = obj
        .get("value")
        .ok_or_else(|| bad(format!("metadata {ty} without \"value\"")))?;
    if t == MetaType::Array {
        let et = obj
            .get("elem_type")
            .and_then(Value::as_str)
            .and_then(MetaType::from_name)
            .ok_or_else(|| bad("metadata array without a known \"elem_type\"".into()))?;
        let items = value
            .as_array()
            .ok_or_else(|| bad("metadata array \"value\" is not a JSON array".into()))?;
        let values = items
            .iter()
            .map(|item| {
                if et == MetaType::Array {
                    let o = item
                        .as_object()
                        .ok_or_else(|| bad("nested array element is not an object".into()))?;
                    let inner = from_typed(o)?;
                    if inner.meta_type() != MetaType::Array {
                        return Err(bad("nested array element is not an array".into()));
                    }
                    Ok(inner)
                } else {
                    scalar(et, item)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok(MetaValue::Array { elem: et, values });
    }
    scalar(t, value)
}

fn scalar(t: MetaType, v: &Value) -> Result<MetaValue> {
    let int = || -> Result<i128> {
        if let Some(u) = v.as_u64() {
            Ok(u.into())
        } else if let Some(i) = v.as_i64() {
            Ok(i.into())
        } else {
            Err(bad(format!(
                "metadata {} value {v} is not an integer",
                t.name()
            )))
        }
    };
    let range = |x: i128| bad(format!("metadata {} value {x} out of range", t.name()));
    let float = || -> Result<f64> {
        match v {
            Value::Number(n) => n
                .as_f64()
                .ok_or_else(|| bad(format!("metadata float {v} unreadable"))),
            Value::String(s) => match s.as_str() {
                "nan" => Ok(f64::NAN),
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                _ => Err(bad(format!("metadata float {s:?} unreadable"))),
            },
            _ => Err(bad(format!(
                "metadata {} value {v} is not a number",
                t.name()
            ))),
        }
    };
    Ok(match t {
        MetaType::U8 => {
            let x = int()?;
            MetaValue::U8(u8::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::I8 => {
            let x = int()?;
            MetaValue::I8(i8::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::U16 => {
            let x = int()?;
            MetaValue::U16(u16::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::I16 => {
            let x = int()?;
            MetaValue::I16(i16::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::U32 => {
            let x = int()?;
            MetaValue::U32(u32::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::I32 => {
            let x = int()?;
            MetaValue::I32(i32::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::U64 => {
            let x = int()?;
            MetaValue::U64(u64::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::I64 => {
            let x = int()?;
            MetaValue::I64(i64::try_from(x).map_err(|_| range(x))?)
        }
        MetaType::F32 => MetaValue::F32(float()? as f32),
        MetaType::F64 => MetaValue::F64(float()?),
        MetaType::Bool => MetaValue::Bool(
            v.as_bool()
                .ok_or_else(|| bad(format!("metadata bool value {v} is not a bool")))?,
        ),
        MetaType::String => MetaValue::String(
            v.as_str()
                .ok_or_else(|| bad(format!("metadata string value {v} is not a string")))?
                .to_string(),
        ),
        MetaType::Array => return Err(bad("array where a scalar was expected".into())),
    })
}

/// Type inference for plain JSON written by other tools.
fn infer(v: &Value) -> Result<MetaValue> {
    Ok(match v {
        Value::Bool(b) => MetaValue::Bool(*b),
        Value::String(s) => MetaValue::String(s.clone()),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                if let Ok(x) = u32::try_from(u) {
                    MetaValue::U32(x)
                } else {
                    MetaValue::U64(u)
                }
            } else if let Some(i) = n.as_i64() {
                if let Ok(x) = i32::try_from(i) {
                    MetaValue::I32(x)
                } else {
                    MetaValue::I64(i)
                }
            } else {
                MetaValue::F32(n.as_f64().unwrap_or(f64::NAN) as f32)
            }
        }
        Value::Array(items) => {
            let values = items.iter().map(infer).collect::<Result<Vec<_>>>()?;
            let elem = values.first().map_or(MetaType::U32, MetaValue::meta_type);
            if values.iter().any(|x| x.meta_type() != elem) {
                return Err(bad("plain metadata array with mixed element types".into()));
            }
            MetaValue::Array { elem, values }
        }
        Value::Null => return Err(bad("metadata value is null".into())),
        Value::Object(_) => return Err(bad("unexpected object in metadata".into())),
    })
}

/// An ordered set of model key/values (GGUF order is kept).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    pub entries: Vec<(String, MetaValue)>,
}

impl Metadata {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn push(&mut self, key: impl Into<String>, value: MetaValue) {
        self.entries.push((key.into(), value));
    }

    /// Typed JSON object, key order kept.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (k, v) in &self.entries {
            m.insert(k.clone(), v.to_typed_json());
        }
        Value::Object(m)
    }

    pub fn from_json(v: &Value) -> Result<Metadata> {
        let obj = v
            .as_object()
            .ok_or_else(|| bad("\"metadata\" is not a JSON object".into()))?;
        let mut md = Metadata::default();
        for (k, v) in obj {
            let mv =
                MetaValue::from_json(v).map_err(|e| bad(format!("metadata key {k:?}: {e}")))?;
            md.push(k.clone(), mv);
        }
        Ok(md)
    }

    /// `general.architecture`, if present.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(MetaValue::as_str)
    }

    /// `<arch>.<suffix>` as an integer.
    pub fn arch_u64(&self, suffix: &str) -> Option<u64> {
        let arch = self.architecture()?;
        self.get(&format!("{arch}.{suffix}"))?.as_u64()
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
    fn typed_json_round_trip_keeps_types_and_order() {
        let md = sample();
        let text = serde_json::to_string(&md.to_json()).unwrap();
        let back = Metadata::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, md);
        assert_eq!(back.arch_u64("block_count"), Some(30));
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
