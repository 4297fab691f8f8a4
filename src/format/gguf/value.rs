//! The metadata value model: GGUF's typed key/values, which every format
//! carries (GGUF in its binary encoding, dense .knot and .rknot as typed
//! JSON: [`crate::format::meta`]), the limits any reader of them keeps, and
//! the memory budget their parse is charged against.

/// Deepest accepted array nesting (an array of scalars is depth 1).
pub const MAX_ARRAY_DEPTH: usize = 4;

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
}

/// Fixed part of the metadata memory budget.
pub const META_BUDGET_BASE: u64 = 32 << 20;
/// Bytes of parsed metadata allowed per header byte.
pub const META_BUDGET_PER_HEADER_BYTE: u64 = 2;

/// Most memory the parsed metadata of a `header_bytes` header may take:
/// `2 x header + 32 MiB`. Every value costs [`MetaBudget::VALUE_BYTES`]
/// (32; an array's elements are values), a string its length more, and a
/// key its length plus 24. Real models stay well below: SmolLM2's 1.8 MB
/// GGUF header parses to ~5.5 MB (cap 35 MB); a 256k-token BPE vocabulary
/// with merges, scores and token types (a 10.5 MB header) to ~37 MB (cap
/// 54 MB). A hostile array of small numbers (1 byte each in GGUF, 2 in
/// JSON, 32 parsed) is refused long before it can take the host's memory:
/// the parse stays within the header + the cap.
pub fn meta_budget_limit(header_bytes: u64) -> u64 {
    header_bytes
        .saturating_mul(META_BUDGET_PER_HEADER_BYTE)
        .saturating_add(META_BUDGET_BASE)
}

/// Accounts the memory parsed metadata takes, while it is parsed, for the
/// JSON (.knot, .rknot) and GGUF readers alike.
#[derive(Debug, Default, Clone)]
pub struct MetaBudget {
    used: u64,
}

impl MetaBudget {
    /// One value: the enum (an array's elements are values too).
    pub const VALUE_BYTES: u64 = std::mem::size_of::<MetaValue>() as u64;
    /// One key/value entry besides its value: the key's `String`.
    pub const ENTRY_BYTES: u64 = std::mem::size_of::<String>() as u64;

    /// Charge `bytes`. `header_bytes` is the header's size (for GGUF, read
    /// so far); past [`meta_budget_limit`] the message says why.
    pub fn charge(&mut self, bytes: u64, header_bytes: u64) -> std::result::Result<(), String> {
        self.used = self.used.saturating_add(bytes);
        self.check(header_bytes)
    }

    /// Whether what is charged fits the limit for `header_bytes`.
    pub fn check(&self, header_bytes: u64) -> std::result::Result<(), String> {
        let limit = meta_budget_limit(header_bytes);
        if self.used > limit {
            return Err(format!(
                "the parsed metadata would take more than {limit} bytes of memory, the cap \
                 for a {header_bytes}-byte header (2 x header + 32 MiB; every value takes \
                 {} bytes, a string its length more)",
                Self::VALUE_BYTES
            ));
        }
        Ok(())
    }

    /// Charge what one value takes.
    pub fn value_bytes(v: &MetaValue) -> u64 {
        Self::VALUE_BYTES
            + match v {
                MetaValue::String(s) => s.len() as u64,
                _ => 0,
            }
    }
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
