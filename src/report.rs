//! Human and JSON descriptions of a backend (`rknot inspect`, and the
//! mount's `index.json`).

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::backend::{Availability, Backend, SourceSummary, TensorInfo};
use crate::format::meta::Metadata;

fn source_json(s: &SourceSummary) -> Value {
    json!({
        "path": s.path.display().to_string(),
        "format": s.format.name(),
        "version": s.version,
        "notes": s.notes,
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
        "bits_per_weight": t.bits_per_weight(),
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

/// Sums over the available tensors (saturating: a hostile file can declare
/// sizes whose sum does not fit in u64).
struct Totals {
    available: usize,
    stored: u64,
    served: u64,
    elements: u64,
}

impl Totals {
    fn of(b: &dyn Backend) -> Totals {
        let mut t = Totals {
            available: 0,
            stored: 0,
            served: 0,
            elements: 0,
        };
        for i in b.tensors().entries().iter().filter(|t| t.is_available()) {
            t.available += 1;
            t.stored = t.stored.saturating_add(i.stored_bytes);
            t.served = t.served.saturating_add(i.served_bytes());
            t.elements = t.elements.saturating_add(i.n_elements);
        }
        t
    }

    fn bits_per_weight(&self) -> f64 {
        if self.elements > 0 {
            self.stored as f64 * 8.0 / self.elements as f64
        } else {
            0.0
        }
    }
}

/// Everything `inspect --json` prints.
pub fn inspect_json(b: &dyn Backend) -> Value {
    let s = b.summary();
    let totals = Totals::of(b);
    json!({
        "source": source_json(s),
        "fallback": b.fallback_summary().map(source_json),
        "model": model_facts(effective_metadata(b)).into_iter().collect::<serde_json::Map<_, _>>(),
        "metadata": effective_metadata(b).to_json(),
        "tensors": b.tensors().entries().iter().map(tensor_json).collect::<Vec<_>>(),
        "totals": {
            "tensors": b.tensors().len(),
            "available": totals.available,
            "stored_bytes": totals.stored,
            "served_bytes": totals.served,
            "bits_per_weight": totals.bits_per_weight(),
        },
    })
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

/// Text report for `inspect`.
pub fn inspect_text(b: &dyn Backend) -> String {
    let mut o = String::new();
    let s = b.summary();
    let _ = writeln!(o, "file:      {}", s.path.display());
    let _ = writeln!(o, "format:    {} v{}", s.format, s.version);
    for n in &s.notes {
        let _ = writeln!(o, "           {n}");
    }
    if let Some(f) = b.fallback_summary() {
        let _ = writeln!(
            o,
            "fallback:  {} ({} v{})",
            f.path.display(),
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
                Value::String(s) => format!("{k} {s}"),
                other => format!("{k} {other}"),
            })
            .collect();
        let _ = writeln!(o, "model:     {}", line.join(", "));
    }
    let _ = writeln!(o, "metadata:  {} keys", md.len());
    for (k, v) in &md.entries {
        let _ = writeln!(o, "  {k:<44} {}", v.summary());
    }
    let t = b.tensors().entries();
    let totals = Totals::of(b);
    let _ = writeln!(o, "tensors:   {} ({} available)", t.len(), totals.available);
    let w_dot = t.iter().map(|t| t.name.dot.len()).max().unwrap_or(4).max(4);
    let w_us = t
        .iter()
        .map(|t| t.name.underscore.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        o,
        "  {:<w_dot$}  {:<w_us$}  {:<16}  {:<12}  {:<8}  {:>12}  {:>6}",
        "name", "underscore name", "shape", "type", "source", "stored", "bpw"
    );
    for ti in t {
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
            "  {:<w_dot$}  {:<w_us$}  {:<16}  {:<12}  {:<8}  {:>12}  {:>6.3}",
            ti.name.dot,
            ti.name.underscore,
            shape,
            ti.stored.to_string(),
            source,
            ti.stored_bytes,
            ti.bits_per_weight()
        );
        if let Availability::Unavailable(why) = &ti.availability {
            let _ = writeln!(o, "      unavailable: {why}");
        }
    }
    let _ = writeln!(
        o,
        "total:     stored {} ({} B), served {} ({} B), {:.3} bits per weight",
        human_bytes(totals.stored),
        totals.stored,
        human_bytes(totals.served),
        totals.served,
        totals.bits_per_weight(),
    );
    o
}

/// [`inspect_json`] without the `tensors` list (which the mount's
/// index.json renders one tensor at a time): building every tensor's JSON
/// value at once costs a few KiB per tensor.
pub fn inspect_json_without_tensors(b: &dyn Backend) -> Value {
    let s = b.summary();
    let totals = Totals::of(b);
    json!({
        "source": source_json(s),
        "fallback": b.fallback_summary().map(source_json),
        "model": model_facts(effective_metadata(b)).into_iter().collect::<serde_json::Map<_, _>>(),
        "metadata": effective_metadata(b).to_json(),
        "tensors": [],
        "totals": {
            "tensors": b.tensors().len(),
            "available": totals.available,
            "stored_bytes": totals.stored,
            "served_bytes": totals.served,
            "bits_per_weight": totals.bits_per_weight(),
        },
    })
}
