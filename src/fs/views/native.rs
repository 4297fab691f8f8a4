//! `model.native.gguf`: the model as llama.cpp runs it, in the compact
//! ggml types it was stored in. The source's key/values (its `general.file_type`
//! kept, the alignment as u32; a split set's `split.*` keys are already
//! gone from its metadata) and every tensor in a ggml type:
//!
//! - sources whose every tensor is ggml blocks (GGUF single or split, local
//!   or remote; dense .knot; a safetensors checkpoint of F32/F16/BF16, whose
//!   llama Q/K rows come in the converter's order as for `model.gguf`): each
//!   tensor in its stored type, its data the source's stored bytes,
//!   verbatim: a re-framing of byte ranges, nothing decoded;
//! - `.rknot` sources (alone or over a dense fallback): the tensors stored
//!   as ggml blocks likewise, the compressed ones re-packed into the ggml
//!   type their code is exactly ([`super::transcode`]: affine 1-5 bits in
//!   groups of 32k as Q4_1/Q5_1), the rest decoded, as F32; `general.file_type`
//!   then says the type most of the weights are in.
//!
//! SK32 sketches are no ggml type, nor near one: their compact form is
//! f16/bf16 (`model.f16.safetensors`), and they get no native view. Read
//! by `fs::native_read`.

use super::gguf::{gguf_overrides, place};
use super::transcode::{self, SegmentBytes};
use super::{Built, Layout, ViewTensor};
use crate::backend::{Backend, TensorInfo};
use crate::error::{ErrorKind, Result, err};
use crate::format::FileFormat;
use crate::format::gguf;
use crate::format::meta::{MetaValue, Metadata};
use crate::quant::GgmlType;

/// The key the native view keeps from the source (`model.gguf` sets it
/// to 0, all F32).
const FILE_TYPE: &str = "general.file_type";

/// Build `model.native.gguf` over `tensors` of `b` (`infos[f]` is the
/// backend's entry of tensor file `f`), or say why it cannot be offered.
pub fn native_gguf(
    b: &dyn Backend,
    infos: &[&TensorInfo],
    tensors: &[ViewTensor],
    md: &Metadata,
) -> Result<Built> {
    // A .rknot's compressed tensors are re-packed or decoded; any other
    // source's tensors must all be ggml blocks.
    let transcoding = b.as_dense().is_none();
    if transcoding && b.summary().format != FileFormat::Rknot {
        let why = if b.summary().format == FileFormat::Sk32 {
            "SK32 sketches are no ggml type: their compact form is f16/bf16 \
             (model.f16.safetensors, --views f16); model.gguf serves them as F32"
        } else {
            "this source's tensors are not stored as ggml blocks (model.gguf serves them as F32)"
        };
        return Err(err(
            ErrorKind::UnsupportedType,
            format!("a {} source: {why}", b.summary().format.name()),
        ));
    }
    let (mut overrides, alignment) = gguf_overrides(md)?;
    overrides.retain(|(k, _)| *k != FILE_TYPE);
    let mut header_tensors = Vec::with_capacity(tensors.len());
    let mut lens = Vec::with_capacity(tensors.len());
    let mut made = Vec::with_capacity(tensors.len());
    // (type, how it is made, tensors, elements)
    let mut mix: Vec<(GgmlType, &'static str, u64, u64)> = Vec::new();
    for t in tensors {
        let info = infos.get(t.file).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                "internal error: a view tensor without its file",
            )
            .tensor(t.name)
        })?;
        let index = b.tensors().get(&info.name.dot);
        let code = index.and_then(|i| b.block_code(i));
        let (ty, len, how) = transcode::plan(info, code);
        if !transcoding && how != SegmentBytes::Stored {
            if let crate::backend::StoredType::Ggml(ty) = info.stored
                && ty.is_ggml()
            {
                // The bytes the header declares are the bytes served.
                return Err(err(
                    ErrorKind::LengthMismatch,
                    format!(
                        "{} stored bytes are not the {ty} size of its {} elements",
                        info.stored_bytes, info.n_elements
                    ),
                )
                .tensor(t.name));
            }
            return Err(err(
                ErrorKind::UnsupportedType,
                format!("it is stored as {}, which is no ggml type", info.stored),
            )
            .tensor(t.name));
        }
        if how == SegmentBytes::DecodedF32 && info.n_elements.checked_mul(4).is_none() {
            return Err(err(ErrorKind::Overflow, "its F32 bytes do not fit in u64").tensor(t.name));
        }
        let label = match how {
            SegmentBytes::Stored => "stored",
            SegmentBytes::Repacked(_) => "re-packed, exact",
            SegmentBytes::DecodedF32 => "decoded",
        };
        match mix.iter_mut().find(|(x, l, _, _)| *x == ty && *l == label) {
            Some((_, _, n, e)) => {
                *n += 1;
                *e += info.n_elements;
            }
            None => mix.push((ty, label, 1, info.n_elements)),
        }
        let ne: Vec<u64> = info.shape.iter().rev().copied().collect();
        header_tensors.push((t.name.to_string(), ne, ty));
        lens.push(len);
        made.push(how);
    }
    if transcoding {
        // The type most weights are in, as llama.cpp names a file's type.
        let mut by_type: Vec<(GgmlType, u64)> = Vec::new();
        for &(ty, _, _, e) in &mix {
            match by_type.iter_mut().find(|(x, _)| *x == ty) {
                Some((_, n)) => *n += e,
                None => by_type.push((ty, e)),
            }
        }
        if let Some(ft) = by_type
            .iter()
            .max_by_key(|(_, e)| *e)
            .and_then(|(ty, _)| llama_file_type(*ty))
        {
            overrides.push((FILE_TYPE, MetaValue::U32(ft)));
        }
    }
    let (header, offsets) = gguf::encode_header_with(md, &overrides, &header_tensors, alignment)?;
    let (segments, size) = place(header.len() as u64, tensors, &offsets, &lens, alignment)?;
    let mix = mix
        .iter()
        .map(|(ty, how, n, _)| {
            if transcoding {
                format!("{ty} x{n} {how}")
            } else {
                format!("{ty} x{n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let note = if transcoding {
        format!(
            "ggml blocks: stored ones verbatim, affine codes re-packed where a ggml type holds \
             them exactly, the rest decoded to F32 ({mix}), alignment {alignment}"
        )
    } else {
        format!(
            "every tensor in its stored type, its bytes the source's ({mix}), alignment {alignment}"
        )
    };
    Ok(Built {
        layout: Layout::transcoded(header, segments, made, size)?,
        notes: vec![note],
    })
}

/// llama.cpp's `general.file_type` (its `llama_ftype`) of a file whose
/// weights are mostly `ty`, for the types it names.
fn llama_file_type(ty: GgmlType) -> Option<u32> {
    Some(match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q6K => 18,
        GgmlType::Bf16 => 32,
        _ => return None,
    })
}
