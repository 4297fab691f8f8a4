//! `model.native.gguf`: the model as llama.cpp runs it, in the compact
//! types it was stored in. The source's key/values (its `general.file_type`
//! kept, the alignment as u32; a split set's `split.*` keys are already
//! gone from its metadata) and every tensor in its stored ggml type, its
//! data the source's stored bytes, verbatim: a re-framing of byte ranges,
//! nothing decoded. Offered for sources whose every tensor is ggml blocks
//! (GGUF single or split, local or remote; dense .knot; a safetensors
//! checkpoint of F32/F16/BF16, whose llama Q/K rows come in the
//! converter's order as for `model.gguf`). Read by `fs::native_read`.

use super::gguf::{gguf_overrides, place};
use super::{Built, Layout, ViewTensor};
use crate::backend::{Backend, StoredType, TensorInfo};
use crate::error::{ErrorKind, Result, err};
use crate::format::gguf;
use crate::format::meta::Metadata;
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
    if b.as_dense().is_none() {
        return Err(err(
            ErrorKind::UnsupportedType,
            format!(
                "a {} source's tensors are not stored as ggml blocks (model.gguf serves them as F32)",
                b.summary().format.name()
            ),
        ));
    }
    let (mut overrides, alignment) = gguf_overrides(md)?;
    overrides.retain(|(k, _)| *k != FILE_TYPE);
    let mut header_tensors = Vec::with_capacity(tensors.len());
    let mut lens = Vec::with_capacity(tensors.len());
    let mut types: Vec<(GgmlType, u64)> = Vec::new();
    for t in tensors {
        let info = infos.get(t.file).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                "internal error: a view tensor without its file",
            )
            .tensor(t.name)
        })?;
        let ty = match &info.stored {
            StoredType::Ggml(ty) if ty.is_ggml() => *ty,
            other => {
                return Err(err(
                    ErrorKind::UnsupportedType,
                    format!("it is stored as {other}, which is no ggml type"),
                )
                .tensor(t.name));
            }
        };
        // The bytes the header declares are the bytes served: the stored
        // length must be the type's size of the shape.
        if ty.bytes_for(info.n_elements) != Some(info.stored_bytes) {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "{} stored bytes are not the {ty} size of its {} elements",
                    info.stored_bytes, info.n_elements
                ),
            )
            .tensor(t.name));
        }
        match types.iter_mut().find(|(x, _)| *x == ty) {
            Some((_, n)) => *n += 1,
            None => types.push((ty, 1)),
        }
        let ne: Vec<u64> = info.shape.iter().rev().copied().collect();
        header_tensors.push((t.name.to_string(), ne, ty));
        lens.push(info.stored_bytes);
    }
    let (header, offsets) = gguf::encode_header_with(md, &overrides, &header_tensors, alignment)?;
    let (segments, size) = place(header.len() as u64, tensors, &offsets, &lens, alignment)?;
    let mix = types
        .iter()
        .map(|(ty, n)| format!("{ty} x{n}"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Built {
        layout: Layout::stored(header, segments, size)?,
        notes: vec![format!(
            "every tensor in its stored type, its bytes the source's ({mix}), alignment {alignment}"
        )],
    })
}
