//! `model.safetensors.index.json`: which shard holds each tensor
//! (`weight_map`), as transformers' `save_pretrained` writes it. A shard
//! is named by a plain file name in the index's directory; anything that
//! could reach another file (a path, `..`, an absolute name, a URL) is
//! refused before anything is opened.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::error::{ErrorKind, Result, err};
use crate::format::json::{Expect, Found, Parse, Seed};
use crate::format::{MAX_TENSORS, gguf::MAX_HEADER_BYTES, too_many_tensors};
use crate::source::SourceFile;

/// The index: each tensor's shard, in the index's order, and the shards
/// (distinct, sorted).
#[derive(Debug, Clone)]
pub struct Index {
    pub weight_map: Vec<(String, String)>,
    pub shards: Vec<String>,
}

/// Read and check the index `src`.
pub fn read(src: &SourceFile) -> Result<Index> {
    if src.len() > MAX_HEADER_BYTES {
        return Err(err(
            ErrorKind::TooLarge,
            format!(
                "the index is {} bytes, over the {MAX_HEADER_BYTES}-byte cap",
                src.len()
            ),
        )
        .path(src.path()));
    }
    let json = src.read_vec(0, src.len(), "safetensors index")?;
    parse(&json).map_err(|e| e.path(src.path()))
}

/// Check an index's JSON.
pub fn parse(json: &[u8]) -> Result<Index> {
    let p = Parse::default();
    let map = p.run(Top { p: &p }, json, 0, "the index")?;
    let Some(weight_map) = map else {
        return Err(err(ErrorKind::BadJson, "the index has no \"weight_map\"").at(0));
    };
    let mut shards: Vec<String> = weight_map.iter().map(|(_, s)| s.clone()).collect();
    shards.sort();
    shards.dedup();
    for s in &shards {
        check_shard_name(s)?;
    }
    Ok(Index { weight_map, shards })
}

/// A shard must be a plain file name next to the index.
pub fn check_shard_name(name: &str) -> Result<()> {
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name == "." || name == ".." {
        Some("it is a directory")
    } else if name.contains('/') || name.contains('\\') {
        Some("it is a path, not a file name in the index's directory")
    } else if name.contains(':') {
        Some("it contains ':' (a URL or a drive)")
    } else if name.starts_with('.') {
        Some("it starts with '.'")
    } else if name
        .chars()
        .any(|c| c.is_control() || crate::text::is_unsafe_char(c))
    {
        Some("it contains a control character")
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(err(
            ErrorKind::BadValue,
            format!(
                "the index names shard {:?}: refused, {why}",
                crate::text::escape(name)
            ),
        )),
    }
}

struct Top<'a> {
    p: &'a Parse,
}

type WeightMap = Vec<(String, String)>;

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = Option<WeightMap>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = Option<WeightMap>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        let mut weight_map = None;
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(self
                    .p
                    .fail(ErrorKind::BadJson, format!("the index names {key:?} twice")));
            }
            if key == "weight_map" {
                weight_map = Some(map.next_value_seed(Seed(Weights { p: self.p }))?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(weight_map)
    }
}

struct Weights<'a> {
    p: &'a Parse,
}

impl<'de> Expect<'de> for Weights<'_> {
    type Value = WeightMap;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!(
                "\"weight_map\" is {}, not an object of tensor names to shard file names",
                found.kind()
            ),
        )
    }
    fn on_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WeightMap, A::Error> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        while let Some(name) = map.next_key::<String>()? {
            if !seen.insert(name.clone()) {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!("the index's weight_map names tensor {name:?} twice"),
                ));
            }
            if out.len() as u64 >= MAX_TENSORS {
                return Err(self
                    .p
                    .fail_error(too_many_tensors("the index's weight_map")));
            }
            let serde_json::Value::String(shard) = map.next_value::<serde_json::Value>()? else {
                return Err(self.p.fail(
                    ErrorKind::BadJson,
                    format!("the index's weight_map entry of {name:?} is not a file name string"),
                ));
            };
            out.push((name, shard));
        }
        Ok(out)
    }
}
