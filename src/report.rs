//! Human and JSON descriptions of a backend (`rknot inspect`, and the
//! mount's `index.json`).
//!
//! Everything here prints strings that came from a file (paths, tensor
//! names, metadata keys and values): the text report escapes them with
//! [`crate::text::escape`]; JSON is escaped with
//! [`crate::text::escape_json_text`] by whoever prints it
//! ([`write_inspect_json`] escapes as it streams).
//!
//! Metadata can be large (a 150k-token vocabulary is three arrays of 150k
//! values; a hostile file can carry tens of MB). `inspect --json` and
//! index.json therefore summarize arrays longer than [`ARRAY_SUMMARY_LIMIT`]
//! elements and strings longer than [`STRING_SUMMARY_BYTES`] as
//! `{"type": "array", "elem_type": .., "len": .., "omitted": true}` (or
//! `"type": "string"`); `inspect --json --full` prints everything. Both are
//! streamed ([`InspectJson`]): one tensor's or metadata value's JSON is
//! built at a time.

use std::fmt::Write as _;
use std::io::{self, Write};

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::{Value, json};

use crate::backend::{Availability, Backend, SourceSummary, TensorInfo};
use crate::format::meta::{MetaValue, Metadata, TypedJson};
use crate::text::{escape, escape_json_text};

/// Metadata arrays with more elements than this (nested arrays counted
/// whole) are summarized in `inspect --json` and index.json. Real models'
/// arrays this long are the tokenizer's (tokens, scores, merges), which
/// nobody reads as JSON; everything else is short.
pub const ARRAY_SUMMARY_LIMIT: usize = 1024;

/// Metadata strings longer than this are summarized. The longest real
/// string values are chat templates (a few KB to ~30 KB); an embedded
/// `tokenizer.huggingface.json` (MBs) is not worth printing.
pub const STRING_SUMMARY_BYTES: usize = 64 << 10;

/// A source file: what it is, and its honest size (whole file over the
/// parameters served from it).
fn source_json(s: &SourceSummary, totals: &Totals) -> Value {
    let share = totals.file(&s.path);
    json!({
        "path": s.path.display().to_string(),
        "format": s.format.name(),
        "version": s.version,
        "checked": s.checked,
        "notes": s.notes,
        "file_bytes": share.map_or(0, |f| f.bytes),
        "parameters": share.map_or(0, |f| f.parameters),
        "bits_per_weight": share.map_or(0.0, FileShare::bits_per_weight),
    })
}

/// One tensor as JSON: both names, shape, stored type, source, sizes.
pub fn tensor_json(t: &TensorInfo) -> Value {
    let mut v = json!({
        "name": t.name.dot,
        "underscore_name": t.name.underscore,
        "shape": t.shape,
        "stored_type": t.stored.to_string(),
        "source": {
            "role": t.origin.role.name(),
            "format": t.origin.format.name(),
            "path": t.origin.path.display().to_string(),
        },
        "stored_bytes": t.stored_bytes,
        "served_bytes": t.served_bytes(),
        "payload_bits_per_weight": t.payload_bits_per_weight(),
        "available": t.is_available(),
    });
    if let Availability::Unavailable(why) = &t.availability {
        v["unavailable_reason"] = json!(why);
    }
    v
}

/// Model facts worth a line: architecture and its main sizes.
pub fn model_facts(md: &Metadata) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    if let Some(arch) = md.architecture() {
        out.push(("arch".to_string(), json!(arch)));
        for (label, key) in [
            ("layers", "block_count"),
            ("hidden", "embedding_length"),
            ("ffn", "feed_forward_length"),
            ("heads", "attention.head_count"),
            ("kv_heads", "attention.head_count_kv"),
            ("context", "context_length"),
        ] {
            if let Some(v) = md.arch_u64(key) {
                out.push((label.to_string(), json!(v)));
            }
        }
    }
    if let Some(n) = md.get("general.name").and_then(|v| v.as_str()) {
        out.push(("name".to_string(), json!(n)));
    }
    out
}

/// One source file's share of what is served.
struct FileShare {
    path: std::path::PathBuf,
    /// The whole file: headers, indexes, metadata, padding and tensor data.
    bytes: u64,
    /// Elements of the available tensors served from it.
    parameters: u64,
}

impl FileShare {
    fn bits_per_weight(&self) -> f64 {
        per_weight(self.bytes, self.parameters)
    }
}

fn per_weight(bytes: u64, parameters: u64) -> f64 {
    if parameters > 0 {
        bytes as f64 * 8.0 / parameters as f64
    } else {
        0.0
    }
}

/// Sums over the available tensors (saturating: a hostile file can declare
/// sizes whose sum does not fit in u64).
///
/// Bits per weight are honest: the whole size of the files that serve the
/// tensors over the parameters served. The tensors' own bytes over the
/// same parameters is the *payload* figure, which leaves out headers, block
/// indexes and metadata (for a .rknot version 2, an 8 MB block list in a
/// 74 MB file).
struct Totals {
    available: usize,
    stored: u64,
    served: u64,
    elements: u64,
    files: Vec<FileShare>,
}

impl Totals {
    fn of(b: &dyn Backend) -> Totals {
        // One share per source as the user named it (a set of files, such
        // as a split GGUF or a sharded checkpoint, is one source: its
        // tensors' origin is the set's path, its bytes every file's).
        let len = |files: Vec<&crate::source::SourceFile>| {
            files.iter().fold(0u64, |a, f| a.saturating_add(f.len()))
        };
        let fallback = b.fallback_backend();
        let fallback_bytes = fallback.as_ref().map_or(0, |f| len(f.source_files()));
        let mut files = vec![FileShare {
            path: b.summary().path.clone(),
            bytes: len(b.source_files()).saturating_sub(fallback_bytes),
            parameters: 0,
        }];
        if let Some(s) = b.fallback_summary() {
            files.push(FileShare {
                path: s.path.clone(),
                bytes: fallback_bytes,
                parameters: 0,
            });
        }
        let mut t = Totals {
            available: 0,
            stored: 0,
            served: 0,
            elements: 0,
            files,
        };
        for i in b.tensors().entries().iter().filter(|t| t.is_available()) {
            t.available += 1;
            t.stored = t.stored.saturating_add(i.stored_bytes);
            t.served = t.served.saturating_add(i.served_bytes());
            t.elements = t.elements.saturating_add(i.n_elements);
            let share = match i.origin.role {
                crate::backend::Role::Fallback => t.files.get_mut(1),
                _ => t.files.first_mut(),
            };
            if let Some(f) = share {
                f.parameters = f.parameters.saturating_add(i.n_elements);
            }
        }
        t
    }

    fn file(&self, path: &std::path::Path) -> Option<&FileShare> {
        self.files.iter().find(|f| f.path == path)
    }

    /// Bytes of the files that serve at least one tensor.
    fn file_bytes(&self) -> u64 {
        self.files
            .iter()
            .filter(|f| f.parameters > 0)
            .fold(0u64, |a, f| a.saturating_add(f.bytes))
    }

    /// Whole files x 8 / parameters served.
    fn bits_per_weight(&self) -> f64 {
        per_weight(self.file_bytes(), self.elements)
    }

    /// Tensor payloads x 8 / parameters served.
    fn payload_bits_per_weight(&self) -> f64 {
        per_weight(self.stored, self.elements)
    }
}

/// Everything `inspect --json --full` prints, as one `Value` (every
/// metadata value in full; for large metadata or many tensors prefer
/// [`inspect_json_summarized`] or [`write_inspect_json`]).
pub fn inspect_json(b: &dyn Backend) -> Value {
    serde_json::to_value(InspectJson::full(b)).unwrap_or(Value::Null)
}

/// What `inspect --json` prints and index.json holds, as a `Value`:
/// [`inspect_json`] with metadata arrays of more than `array_limit`
/// elements (nested arrays counted whole) and strings of more than
/// [`STRING_SUMMARY_BYTES`] summarized as `{"type": "array", "elem_type":
/// .., "len": .., "omitted": true}` (strings: `{"type": "string", "len":
/// <bytes>, "omitted": true}`). Its size is bounded by the tensor count and
/// the number of metadata keys, not by the metadata's size. (A `Value` of
/// 65,536 tensors still takes ~350 MB: to render bytes, serialize
/// [`InspectJson`] instead.)
pub fn inspect_json_summarized(b: &dyn Backend, array_limit: usize) -> Value {
    serde_json::to_value(InspectJson::summarized(b, array_limit)).unwrap_or(Value::Null)
}

/// The typed JSON of `md` (module docs of [`crate::format::meta`]) with
/// long values summarized (see [`inspect_json_summarized`]).
pub fn metadata_json_summarized(md: &Metadata, array_limit: usize) -> Value {
    serde_json::to_value(MetadataJson {
        md,
        array_limit: Some(array_limit),
    })
    .unwrap_or(Value::Null)
}

/// Whether a value is summarized rather than printed.
fn too_long(v: &MetaValue, array_limit: usize) -> bool {
    /// Whether `v` holds a long string or more elements than `budget`
    /// (counting stops there).
    fn weigh(v: &MetaValue, budget: &mut usize) -> bool {
        match v {
            MetaValue::String(s) => s.len() > STRING_SUMMARY_BYTES,
            MetaValue::Array { values, .. } => {
                if values.len() > *budget {
                    return true;
                }
                *budget -= values.len();
                values.iter().any(|x| weigh(x, budget))
            }
            _ => false,
        }
    }
    let mut budget = array_limit;
    weigh(v, &mut budget)
}

fn summary_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::Array { elem, values } => json!({
            "type": "array",
            "elem_type": elem.name(),
            "len": values.len(),
            "omitted": true,
        }),
        MetaValue::String(s) => json!({"type": "string", "len": s.len(), "omitted": true}),
        other => other.to_typed_json(),
    }
}

fn totals_json(b: &dyn Backend, totals: &Totals) -> Value {
    json!({
        "tensors": b.tensors().len(),
        "available": totals.available,
        "parameters": totals.elements,
        "stored_bytes": totals.stored,
        "served_bytes": totals.served,
        "file_bytes": totals.file_bytes(),
        "bits_per_weight": totals.bits_per_weight(),
        "payload_bits_per_weight": totals.payload_bits_per_weight(),
    })
}

fn model_json(b: &dyn Backend) -> Value {
    Value::Object(model_facts(effective_metadata(b)).into_iter().collect())
}

/// Extra members of one tensor's object (index.json adds `files`).
pub type TensorExtra<'a> = &'a dyn Fn(&TensorInfo) -> serde_json::Map<String, Value>;

/// The inspect document as a serde `Serialize`: `source`, `fallback`,
/// `model`, `metadata`, `tensors`, `totals`, then `extra`. Serializing it
/// (to a writer, or with `serde_json::to_value`) builds one tensor's and
/// one metadata value's JSON at a time, so writing it takes memory for the
/// output only.
pub struct InspectJson<'a> {
    pub backend: &'a dyn Backend,
    /// `None`: every metadata value in full; `Some(n)`: arrays of more than
    /// `n` elements and strings over [`STRING_SUMMARY_BYTES`] summarized.
    pub array_limit: Option<usize>,
    /// Members added to each tensor's object.
    pub tensor_extra: Option<TensorExtra<'a>>,
    /// Members added after `totals`.
    pub extra: serde_json::Map<String, Value>,
}

impl<'a> InspectJson<'a> {
    /// `inspect --json --full`.
    pub fn full(backend: &'a dyn Backend) -> Self {
        InspectJson {
            backend,
            array_limit: None,
            tensor_extra: None,
            extra: serde_json::Map::new(),
        }
    }

    /// `inspect --json` (with [`ARRAY_SUMMARY_LIMIT`]) and index.json.
    pub fn summarized(backend: &'a dyn Backend, array_limit: usize) -> Self {
        InspectJson {
            array_limit: Some(array_limit),
            ..Self::full(backend)
        }
    }
}

impl Serialize for InspectJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.backend;
        let mut m = s.serialize_map(Some(6 + self.extra.len()))?;
        let totals = Totals::of(b);
        m.serialize_entry("source", &source_json(b.summary(), &totals))?;
        m.serialize_entry(
            "fallback",
            &b.fallback_summary().map(|f| source_json(f, &totals)),
        )?;
        m.serialize_entry("model", &model_json(b))?;
        m.serialize_entry(
            "metadata",
            &MetadataJson {
                md: effective_metadata(b),
                array_limit: self.array_limit,
            },
        )?;
        m.serialize_entry(
            "tensors",
            &TensorsJson {
                b,
                extra: self.tensor_extra,
            },
        )?;
        m.serialize_entry("totals", &totals_json(b, &totals))?;
        for (k, v) in &self.extra {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Write `doc` to `w` as pretty JSON with a final newline, escaped
/// ([`escape_json_text`]) as it streams.
pub fn write_inspect_json<W: Write>(doc: &InspectJson, w: W) -> io::Result<()> {
    let mut out = EscapingWriter::new(w);
    {
        let mut ser = serde_json::Serializer::pretty(&mut out);
        // Keep the kind of a write error (a closed pipe ends output quietly).
        doc.serialize(&mut ser)
            .map_err(|e| match e.io_error_kind() {
                Some(kind) => io::Error::new(kind, e),
                None => io::Error::other(e),
            })?;
    }
    out.write_all(b"\n")?;
    out.finish()
}

struct MetadataJson<'a> {
    md: &'a Metadata,
    array_limit: Option<usize>,
}

impl Serialize for MetadataJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.md.len()))?;
        for (k, v) in &self.md.entries {
            match self.array_limit {
                Some(limit) if too_long(v, limit) => m.serialize_entry(k, &summary_json(v))?,
                _ => m.serialize_entry(k, &TypedJson(v))?,
            }
        }
        m.end()
    }
}

struct TensorsJson<'a> {
    b: &'a dyn Backend,
    extra: Option<TensorExtra<'a>>,
}

impl Serialize for TensorsJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let entries = self.b.tensors().entries();
        let mut q = s.serialize_seq(Some(entries.len()))?;
        for t in entries {
            let mut v = tensor_json(t);
            if let (Some(extra), Value::Object(o)) = (self.extra, &mut v) {
                o.extend(extra(t));
            }
            q.serialize_element(&v)?;
        }
        q.end()
    }
}

/// A writer that applies [`escape_json_text`] to a stream of serialized
/// JSON, in chunks (a character split between two writes is held back
/// until it is complete).
pub struct EscapingWriter<W: Write> {
    inner: W,
    buf: Vec<u8>,
}

impl<W: Write> EscapingWriter<W> {
    const CHUNK: usize = 64 << 10;

    pub fn new(inner: W) -> Self {
        EscapingWriter {
            inner,
            buf: Vec::with_capacity(Self::CHUNK + 4),
        }
    }

    /// Escape and write everything buffered that forms whole characters
    /// (with `all`, everything).
    fn drain(&mut self, all: bool) -> io::Result<()> {
        let keep = match std::str::from_utf8(&self.buf) {
            Ok(_) => 0,
            // A character cut at the end waits for the next write.
            Err(e) if e.error_len().is_none() && !all => self.buf.len() - e.valid_up_to(),
            // Not UTF-8 (serde_json only writes UTF-8): shown lossily.
            Err(_) => 0,
        };
        let cut = self.buf.len() - keep;
        let text = String::from_utf8_lossy(&self.buf[..cut]).into_owned();
        self.buf.drain(..cut);
        self.inner.write_all(escape_json_text(text).as_bytes())
    }

    /// Write what is left and flush.
    pub fn finish(mut self) -> io::Result<()> {
        self.drain(true)?;
        self.inner.flush()
    }
}

impl<W: Write> Write for EscapingWriter<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= Self::CHUNK {
            self.drain(false)?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.drain(false)?;
        self.inner.flush()
    }
}

/// The metadata describing the model: the primary's, or the fallback's
/// when the primary carries none (SK32).
pub fn effective_metadata(b: &dyn Backend) -> &Metadata {
    let p = &b.summary().metadata;
    match b.fallback_summary() {
        Some(f) if p.is_empty() => &f.metadata,
        _ => p,
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Text report for `inspect`. File-derived strings (paths, notes, names,
/// metadata keys and values) are escaped.
pub fn inspect_text(b: &dyn Backend) -> String {
    let mut o = String::new();
    let s = b.summary();
    let _ = writeln!(o, "file:      {}", escape(&s.path.to_string_lossy()));
    let _ = writeln!(o, "format:    {} v{}", s.format, s.version);
    let _ = writeln!(
        o,
        "checksums: {}",
        if s.checked {
            "CRC-32 of every stored byte, verified on read"
        } else {
            "none (unchecked)"
        }
    );
    for n in &s.notes {
        let _ = writeln!(o, "           {}", escape(n));
    }
    if let Some(f) = b.fallback_summary() {
        let _ = writeln!(
            o,
            "fallback:  {} ({} v{})",
            escape(&f.path.to_string_lossy()),
            f.format,
            f.version
        );
    }
    let md = effective_metadata(b);
    let facts = model_facts(md);
    if !facts.is_empty() {
        let line: Vec<String> = facts
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k} {}", escape(s)),
                other => format!("{k} {other}"),
            })
            .collect();
        let _ = writeln!(o, "model:     {}", line.join(", "));
    }
    let _ = writeln!(o, "metadata:  {} keys", md.len());
    for (k, v) in &md.entries {
        let _ = writeln!(o, "  {:<44} {}", escape(k), escape(&v.summary()));
    }
    let t = b.tensors().entries();
    let totals = Totals::of(b);
    let _ = writeln!(o, "tensors:   {} ({} available)", t.len(), totals.available);
    let names: Vec<(String, String)> = t
        .iter()
        .map(|t| {
            (
                escape(&t.name.dot).into_owned(),
                escape(&t.name.underscore).into_owned(),
            )
        })
        .collect();
    let w_dot = names.iter().map(|n| n.0.len()).max().unwrap_or(4).max(4);
    let w_us = names.iter().map(|n| n.1.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(
        o,
        "  {:<w_dot$}  {:<w_us$}  {:<16}  {:<12}  {:<8}  {:>12}  {:>11}",
        "name", "underscore name", "shape", "type", "source", "stored", "payload bpw"
    );
    for (ti, (dot, us)) in t.iter().zip(&names) {
        let shape = format!(
            "[{}]",
            ti.shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let source = match &ti.availability {
            Availability::Available => ti.origin.role.name().to_string(),
            Availability::Unavailable(_) => "UNAVAIL".to_string(),
        };
        let _ = writeln!(
            o,
            "  {:<w_dot$}  {:<w_us$}  {:<16}  {:<12}  {:<8}  {:>12}  {:>11.3}",
            dot,
            us,
            shape,
            ti.stored.to_string(),
            source,
            ti.stored_bytes,
            ti.payload_bits_per_weight()
        );
        if let Availability::Unavailable(why) = &ti.availability {
            let _ = writeln!(o, "      unavailable: {}", escape(why));
        }
    }
    let _ = writeln!(
        o,
        "total:     stored {} ({} B), served {} ({} B), {} parameters",
        human_bytes(totals.stored),
        totals.stored,
        human_bytes(totals.served),
        totals.served,
        totals.elements,
    );
    let _ = writeln!(
        o,
        "size:      {:.3} bits per weight: {} B of file{} x 8 / {} parameters \
         (tensor payloads alone: {:.3})",
        totals.bits_per_weight(),
        totals.file_bytes(),
        if totals.files.iter().filter(|f| f.parameters > 0).count() > 1 {
            "s"
        } else {
            ""
        },
        totals.elements,
        totals.payload_bits_per_weight(),
    );
    o
}

/// The inspect document without its `tensors` list (empty), with metadata
/// summarized as by [`inspect_json_summarized`]: the mount's index.json
/// renders its tensors one at a time around it.
pub fn inspect_json_without_tensors(b: &dyn Backend, array_limit: usize) -> Value {
    let totals = Totals::of(b);
    json!({
        "source": source_json(b.summary(), &totals),
        "fallback": b.fallback_summary().map(|f| source_json(f, &totals)),
        "model": model_json(b),
        "metadata": metadata_json_summarized(effective_metadata(b), array_limit),
        "tensors": [],
        "totals": totals_json(b, &totals),
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::backend::{Origin, Role, StoredType, TensorTable};
    use crate::format::FileFormat;
    use crate::format::meta::MetaType;
    use crate::names::TensorName;

    struct Fake {
        summary: SourceSummary,
        table: TensorTable,
    }

    impl Backend for Fake {
        fn summary(&self) -> &SourceSummary {
            &self.summary
        }
        fn tensors(&self) -> &TensorTable {
            &self.table
        }
        fn read_f32(&self, _: usize, _: u64, out: &mut [f32]) -> crate::Result<()> {
            out.fill(0.0);
            Ok(())
        }
        fn stored_ranges(&self, _: usize) -> Option<crate::backend::StoredRanges<'_>> {
            None
        }
    }

    fn array(elem: MetaType, values: Vec<MetaValue>) -> MetaValue {
        MetaValue::Array { elem, values }
    }

    fn fake() -> Fake {
        let mut md = Metadata::default();
        md.push("general.architecture", MetaValue::String("llama".into()));
        md.push(
            "general.name",
            MetaValue::String("evil\x1b]0;x\x07\u{9b}".into()),
        );
        md.push("f", MetaValue::F32(f32::NAN));
        md.push(
            "short",
            array(MetaType::U32, (0..1024).map(MetaValue::U32).collect()),
        );
        md.push("long", array(MetaType::U8, vec![MetaValue::U8(1); 1025]));
        md.push(
            "nested",
            array(
                MetaType::Array,
                vec![array(MetaType::I16, vec![MetaValue::I16(-1); 600]); 2],
            ),
        );
        md.push(
            "long_string",
            MetaValue::String("x".repeat(STRING_SUMMARY_BYTES + 1)),
        );
        md.push(
            "strings",
            array(
                MetaType::String,
                vec![MetaValue::String("a\u{202e}b".into())],
            ),
        );
        let path = PathBuf::from("/m/model.gguf");
        let mut table = TensorTable::default();
        for name in ["blk.0.attn_q.weight", "output_norm.weight"] {
            table
                .push(
                    TensorInfo {
                        name: TensorName::from_stored(name).unwrap(),
                        shape: vec![4, 4],
                        n_elements: 16,
                        stored: StoredType::Ggml(crate::quant::GgmlType::F32),
                        stored_bytes: 64,
                        origin: Origin {
                            role: Role::Fallback,
                            format: FileFormat::Gguf,
                            path: std::sync::Arc::new(path.clone()),
                        },
                        availability: Availability::Available,
                        granule: 1,
                    },
                    name,
                )
                .unwrap();
        }
        Fake {
            summary: SourceSummary {
                checked: false,
                format: FileFormat::Gguf,
                version: 3,
                path,
                metadata: md,
                notes: vec![],
            },
            table,
        }
    }

    #[test]
    fn summarized_json_omits_long_arrays_and_strings_only() {
        let b = fake();
        let full = inspect_json(&b);
        let sum = inspect_json_summarized(&b, ARRAY_SUMMARY_LIMIT);
        let (fm, sm) = (&full["metadata"], &sum["metadata"]);
        for k in [
            "general.architecture",
            "general.name",
            "f",
            "short",
            "strings",
        ] {
            assert_eq!(fm[k], sm[k], "{k}");
        }
        assert_eq!(
            sm["long"],
            json!({"type": "array", "elem_type": "u8", "len": 1025, "omitted": true})
        );
        // 2 x 600 nested elements: over the limit as a whole.
        assert_eq!(
            sm["nested"],
            json!({"type": "array", "elem_type": "array", "len": 2, "omitted": true})
        );
        assert_eq!(
            sm["long_string"],
            json!({"type": "string", "len": STRING_SUMMARY_BYTES + 1, "omitted": true})
        );
        assert_eq!(fm["long"]["value"].as_array().unwrap().len(), 1025);
        assert_eq!(fm["f"]["value"], "nan");
        for k in ["source", "fallback", "model", "tensors", "totals"] {
            assert_eq!(full[k], sum[k], "{k}");
        }
        assert_eq!(
            metadata_json_summarized(effective_metadata(&b), ARRAY_SUMMARY_LIMIT),
            *sm
        );
    }

    #[test]
    fn streamed_json_is_the_same_document_escaped() {
        let b = fake();
        for (doc, want) in [
            (InspectJson::full(&b), inspect_json(&b)),
            (
                InspectJson::summarized(&b, ARRAY_SUMMARY_LIMIT),
                inspect_json_summarized(&b, ARRAY_SUMMARY_LIMIT),
            ),
        ] {
            let mut out = Vec::new();
            write_inspect_json(&doc, &mut out).unwrap();
            let text = String::from_utf8(out).unwrap();
            assert!(
                !text
                    .chars()
                    .any(|c| crate::text::is_unsafe_char(c) && c != '\n'),
                "raw control characters in the output"
            );
            assert!(text.contains("\\u001b]0;x\\u0007\\u009b"), "{text:.300}");
            let back: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(back, want);
        }
    }

    #[test]
    fn tensor_extra_and_extra_members_are_added() {
        let b = fake();
        let files = |t: &TensorInfo| {
            let mut m = serde_json::Map::new();
            m.insert(
                "files".into(),
                json!([format!("{}.f32", t.name.underscore)]),
            );
            m
        };
        let mut doc = InspectJson::summarized(&b, 8);
        doc.tensor_extra = Some(&files);
        doc.extra
            .insert("views".into(), json!({"tensor_formats": ["f32"]}));
        let v = serde_json::to_value(&doc).unwrap();
        assert_eq!(v["tensors"][0]["files"], json!(["blk_0_attn_q_weight.f32"]));
        assert_eq!(v["views"]["tensor_formats"], json!(["f32"]));
        assert_eq!(v["metadata"]["short"]["omitted"], true);
    }

    #[test]
    fn escaping_writer_holds_back_split_characters() {
        let text = "\"a\u{9b}b\u{202e}c\u{7f}\u{e9}\"";
        let bytes = text.as_bytes();
        for split in 0..bytes.len() {
            let mut out = Vec::new();
            let mut w = EscapingWriter::new(&mut out);
            w.write_all(&bytes[..split]).unwrap();
            w.flush().unwrap();
            w.write_all(&bytes[split..]).unwrap();
            w.finish().unwrap();
            assert_eq!(
                String::from_utf8(out).unwrap(),
                escape_json_text(text.to_string()),
                "split at {split}"
            );
        }
    }

    #[test]
    fn text_report_escapes_file_strings() {
        let text = inspect_text(&fake());
        assert!(
            !text
                .chars()
                .any(|c| crate::text::is_unsafe_char(c) && c != '\n')
        );
        assert!(text.contains("evil\\x1b]0;x\\x07"), "{text}");
    }
}
