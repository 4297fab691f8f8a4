//! `model.gguf`: the source's key/values (file type F32, its alignment)
//! and every tensor as F32, laid out as gguf-py and `write_gguf` write it.

use super::{Built, ElemFormat, Layout, Segment, ViewTensor, tensor_len};
use crate::error::{ErrorKind, Result, add, err};
use crate::format::gguf::{self, ALIGNMENT_KEY, DEFAULT_ALIGNMENT};
use crate::format::meta::{MetaValue, Metadata};
use crate::quant::GgmlType;

/// The key/values llama.cpp needs before it can load a model, missing from
/// `md`: the architecture, its block count, embedding length and context
/// length, and the tokenizer (model, and tokens unless it has none).
pub fn gguf_missing_keys(md: &Metadata) -> Vec<String> {
    let mut missing = Vec::new();
    match md.architecture() {
        Some(arch) => {
            for k in ["block_count", "embedding_length", "context_length"] {
                if md.arch_u64(k).is_none() {
                    missing.push(format!("{arch}.{k}"));
                }
            }
        }
        None => missing.push("general.architecture".to_string()),
    }
    match md.get("tokenizer.ggml.model").and_then(MetaValue::as_str) {
        Some("none" | "no_vocab") => {}
        Some(_) => {
            if !matches!(
                md.get("tokenizer.ggml.tokens"),
                Some(MetaValue::Array { .. })
            ) {
                missing.push("tokenizer.ggml.tokens".to_string());
            }
        }
        None => missing.push("tokenizer.ggml.model".to_string()),
    }
    missing
}

/// What the served tensors lack for llama.cpp to build the model, as far as
/// can be told without the architecture's tensor list: the token embedding,
/// and tensors of every block `0..<arch>.block_count`. (A .rknot without
/// its dense fallback carries only the layers it compresses.)
pub fn gguf_missing_tensors(md: &Metadata, names: &[&str]) -> Vec<String> {
    let mut missing = Vec::new();
    if !names.contains(&"token_embd.weight") {
        missing.push("token_embd.weight".to_string());
    }
    if let Some(blocks) = md.arch_u64("block_count") {
        let present: std::collections::HashSet<u64> = names
            .iter()
            .filter_map(|n| n.strip_prefix("blk.")?.split('.').next()?.parse().ok())
            .filter(|&b| b < blocks)
            .collect();
        if (present.len() as u64) < blocks {
            missing.push(format!(
                "tensors of {} of the {blocks} blocks",
                blocks - present.len() as u64
            ));
        }
    }
    missing
}

/// The view's key/values and alignment: the model's, with
/// `general.file_type` set to 0 (ALL_F32: every tensor is F32 here) and
/// `general.alignment` kept (as a u32) when it is valid, 32 when absent.
pub fn gguf_metadata(md: &Metadata) -> Result<(Metadata, u64)> {
    let (overrides, alignment) = gguf_overrides(md)?;
    let mut out = Metadata::default();
    for (k, v) in &md.entries {
        let v = overrides
            .iter()
            .find(|(o, _)| *o == k.as_str())
            .map_or_else(|| v.clone(), |(_, o)| o.clone());
        out.push(k.clone(), v);
    }
    for (k, v) in overrides {
        if md.get(k).is_none() {
            out.push(k, v);
        }
    }
    Ok((out, alignment))
}

/// What `model.gguf` changes in the source's key/values (every tensor is
/// F32: `general.file_type` 0; the alignment as u32), and the alignment.
/// [`gguf`] encodes the source's metadata with these in place, without a
/// copy of it; [`gguf_metadata`] is the same as a value.
pub(super) fn gguf_overrides(md: &Metadata) -> Result<(Vec<(&'static str, MetaValue)>, u64)> {
    const FILE_TYPE: &str = "general.file_type";
    let alignment = match md.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_u64().ok_or_else(|| {
                err(
                    ErrorKind::BadValue,
                    format!("{ALIGNMENT_KEY} = {} is not an integer", v.summary()),
                )
            })?;
            gguf::check_alignment(a)?;
            a
        }
    };
    // check_alignment bounds it by MAX_ALIGNMENT, so it fits in a u32.
    let alignment_u32 = u32::try_from(alignment).map_err(|_| {
        err(
            ErrorKind::BadValue,
            format!("{ALIGNMENT_KEY} = {alignment}"),
        )
    })?;
    let mut overrides = vec![(FILE_TYPE, MetaValue::U32(0))];
    if md.get(ALIGNMENT_KEY).is_some() {
        overrides.push((ALIGNMENT_KEY, MetaValue::U32(alignment_u32)));
    }
    Ok((overrides, alignment))
}

/// `model.gguf`: a GGUF v3 header from [`gguf::encode_header`] (the
/// key/values of [`gguf_metadata`], every tensor as F32 with its dot name
/// and ne-order dims), then each tensor's f32 bytes at its aligned offset,
/// zeros between them and after the last up to the alignment (as
/// [`gguf::write_gguf`] writes a file).
pub fn gguf(tensors: &[ViewTensor], md: &Metadata) -> Result<Built> {
    let (overrides, alignment) = gguf_overrides(md)?;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut lens = Vec::with_capacity(tensors.len());
    for t in tensors {
        lens.push(tensor_len(t, ElemFormat::F32)?);
        let ne: Vec<u64> = t.shape.iter().rev().copied().collect();
        infos.push((t.name.to_string(), ne, GgmlType::F32));
    }
    let (header, offsets) = gguf::encode_header_with(md, &overrides, &infos, alignment)?;
    let (segments, size) = place(header.len() as u64, tensors, &offsets, &lens, alignment)?;
    Ok(Built {
        layout: Layout::new(header, ElemFormat::F32, segments, size)?,
        notes: vec![format!(
            "general.file_type = 0 (all F32), alignment {alignment}"
        )],
    })
}

/// The segments of a GGUF view whose header is `base` bytes: tensor `i` of
/// `tensors` at data offset `offsets[i]`, `lens[i]` bytes long; and the
/// view's size (the data padded to the alignment, as gguf-py writes it).
pub(super) fn place(
    base: u64,
    tensors: &[ViewTensor],
    offsets: &[u64],
    lens: &[u64],
    alignment: u64,
) -> Result<(Vec<Segment>, u64)> {
    let mut segments = Vec::with_capacity(tensors.len());
    let mut data_end = 0u64;
    for ((t, &off), &len) in tensors.iter().zip(offsets).zip(lens) {
        // The GGUF views hold GGUF tensors, whole (never a fused
        // Hugging Face tensor's runs).
        if !t.runs.is_empty() {
            return Err(err(
                ErrorKind::BadValue,
                "internal error: a GGUF view tensor made of runs of others",
            )
            .tensor(t.name));
        }
        segments.push(Segment::whole(
            add(base, off, "gguf tensor offset")?,
            len,
            t.file,
        ));
        data_end = add(off, len, "gguf data size")?;
    }
    let size = add(base, gguf::align_up(data_end, alignment)?, "gguf size")?;
    Ok((segments, size))
}
