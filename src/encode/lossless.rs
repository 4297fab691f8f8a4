//! Dense -> lossless .rknot (`--profile lossless`): every matrix stored as
//! bf16, f16 or f32 (GGUF F32/F16/BF16, safetensors of those dtypes) goes
//! into lossless blocks of its own type, word for word from the source's
//! stored bytes (no f32 round trip: a signalling NaN or any payload stays
//! as it was); everything else (quantized ggml blocks, norms and other
//! vectors) is copied as its ggml blocks verbatim, as the other profiles
//! store the tensors they do not compress.
//!
//! Where the matrices go: a matrix of block `blk.N` in layer N's list; the
//! ones of no block (`token_embd`, `output`) in the first layer's (a
//! tensor's layer only says which manifest its restricted axes use, and a
//! lossless tensor restricts none). Every manifest lists every hidden
//! dimension as standing: nothing is dropped.
//!
//! Tiles are whole rows, as many as fit 65536 values (a row wider than
//! that is cut into pieces of 65536): a block decodes to 128 KiB of bf16,
//! and its 145-byte header is 0.2% of it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::backend::{Backend, StoredType, TensorInfo};
use crate::encode::Progress;
use crate::encode::tensor_layer;
use crate::error::{ErrorKind, Result, err};
use crate::format::meta::MetaValue;
use crate::format::rknot::{
    ArchMeta, Coding, LosslessFloat, MAX_TILE_ELEMS, Manifest, RknotWriter, TensorSpec,
    pack_lossless_block,
};
use crate::output::{AtomicOutput, OutputTarget};
use crate::quant::GgmlType;

/// The lossless float type of a stored ggml type, if it is one.
pub fn lossless_float(ty: GgmlType) -> Option<LosslessFloat> {
    match ty {
        GgmlType::F32 => Some(LosslessFloat::F32),
        GgmlType::F16 => Some(LosslessFloat::F16),
        GgmlType::Bf16 => Some(LosslessFloat::Bf16),
        _ => None,
    }
}

/// The float type a tensor is stored losslessly as: a matrix of a float
/// ggml type.
fn coded_as(t: &TensorInfo) -> Option<LosslessFloat> {
    match t.stored {
        StoredType::Ggml(ty) if t.shape.len() == 2 && t.is_available() => lossless_float(ty),
        _ => None,
    }
}

/// The tile of a lossless tensor of `d_out x d_in`: whole rows, as many as
/// fit [`MAX_TILE_ELEMS`] values.
pub fn lossless_tile(d_out: u64, d_in: u64) -> (u64, u64) {
    let cols = d_in.min(MAX_TILE_ELEMS);
    let rows = (MAX_TILE_ELEMS / cols).clamp(1, d_out);
    (rows, cols)
}

/// The words of a tensor's stored bytes (little-endian bf16/f16/f32).
fn words_of(float: LosslessFloat, bytes: &[u8]) -> Vec<u32> {
    match float.word_bytes() {
        2 => bytes
            .chunks_exact(2)
            .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

/// Lossless blocks of a row-major matrix of words, block by block.
pub fn lossless_blocks(float: LosslessFloat, words: &[u32], d_out: u64, d_in: u64) -> Vec<Vec<u8>> {
    let (br, bc) = lossless_tile(d_out, d_in);
    let (rt, ct) = (d_out.div_ceil(br), d_in.div_ceil(bc));
    (0..rt * ct)
        .into_par_iter()
        .map(|b| {
            let (r0, c0) = ((b / ct) * br, (b % ct) * bc);
            let (r1, c1) = ((r0 + br).min(d_out), (c0 + bc).min(d_in));
            let mut tile = Vec::with_capacity(((r1 - r0) * (c1 - c0)) as usize);
            for r in r0..r1 {
                let at = (r * d_in) as usize;
                tile.extend_from_slice(&words[at + c0 as usize..at + c1 as usize]);
            }
            pack_lossless_block(float, &tile)
        })
        .collect()
}

/// A manifest with every dimension standing.
fn full_manifest(d: u64) -> Manifest {
    Manifest {
        d,
        standing_indices: (0..d).collect(),
        amplitudes: vec![1.0; d as usize],
        phase_alignment: vec![1.0; d as usize],
    }
}

/// What to encode: the options of `rknot encode rknot` that apply.
#[derive(Debug, Clone, Default)]
pub struct LosslessOptions {
    /// Only the matrices whose names match this glob (the rest are copied
    /// verbatim, unless `compressed_only`).
    pub tensors: Option<String>,
    /// Store only the lossless matrices.
    pub compressed_only: bool,
}

/// One stored matrix: name, stored bytes, elements.
pub type LosslessEntry = (String, u64, u64);

/// Encode `dense` losslessly (module docs).
pub fn encode_lossless(
    dense: &dyn Backend,
    out: &OutputTarget,
    o: &LosslessOptions,
    progress: &Progress,
) -> Result<Vec<LosslessEntry>> {
    let path = &dense.summary().path;
    let stored = dense.as_dense().ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            "the lossless profile copies the source's stored words, which needs a GGUF, \
             dense .knot or safetensors input",
        )
        .path(path)
    })?;
    let md = crate::report::effective_metadata(dense).clone();
    let arch = md.architecture().unwrap_or("llama").to_string();
    let hidden = md.arch_u64("embedding_length").ok_or_else(|| {
        err(
            ErrorKind::BadValue,
            format!("metadata lacks {arch}.embedding_length"),
        )
    })?;
    let selected = |t: &TensorInfo| {
        o.tensors
            .as_deref()
            .is_none_or(|g| crate::encode::glob_match(g, &t.name.dot))
    };
    let entries = dense.tensors().entries();
    // Layer -> the matrices stored in it; the rest are copied verbatim.
    let mut layers: BTreeMap<u64, Vec<(usize, LosslessFloat)>> = BTreeMap::new();
    let mut kept = Vec::new();
    for (i, t) in entries.iter().enumerate() {
        match coded_as(t).filter(|_| selected(t)) {
            Some(f) => layers
                .entry(tensor_layer(&t.name.dot).unwrap_or(0))
                .or_default()
                .push((i, f)),
            None if !o.compressed_only => {
                if matches!(t.stored, StoredType::Ggml(_)) {
                    kept.push(i);
                }
            }
            None => {}
        }
    }
    if layers.is_empty() {
        return Err(err(
            ErrorKind::NotFound,
            "no F32, F16 or BF16 matrices to store losslessly",
        )
        .path(path));
    }
    let num_layers = md
        .arch_u64("block_count")
        .unwrap_or(0)
        .max(layers.keys().max().map_or(0, |l| l + 1));
    let mut metadata = md.clone();
    metadata.push("rknot.profile", MetaValue::String("lossless".into()));
    let coded: usize = layers.values().map(Vec::len).sum();
    progress.start((coded + kept.len()) as u64);
    let mut output = AtomicOutput::create(out)?;
    let mut writer = RknotWriter::new(&mut output)?;
    let mut done = Vec::new();
    for (&index, mats) in &layers {
        progress.check()?;
        writer.begin_layer(index, full_manifest(hidden));
        for &(i, float) in mats {
            progress.check()?;
            let t = &entries[i];
            let name = &t.name.dot;
            let (d_out, d_in) = (t.shape[0], t.shape[1]);
            let mut bytes = vec![
                0u8;
                usize::try_from(t.stored_bytes).map_err(|_| err(
                    ErrorKind::TooLarge,
                    "tensor too large to encode"
                )
                .tensor(name))?
            ];
            stored
                .read_stored(i, 0, &mut bytes)
                .map_err(|e| e.tensor(name))?;
            let words = words_of(float, &bytes);
            drop(bytes);
            if words.len() as u64 != t.n_elements {
                return Err(err(
                    ErrorKind::LengthMismatch,
                    format!("{} stored words for {} elements", words.len(), t.n_elements),
                )
                .tensor(name));
            }
            let blocks = lossless_blocks(float, &words, d_out, d_in);
            drop(words);
            let (block_rows, block_cols) = lossless_tile(d_out, d_in);
            let spec = TensorSpec {
                name: name.clone(),
                d_out,
                d_in,
                restrict_rows: false,
                restrict_cols: false,
                coding: Coding::Lossless { float },
                block_rows,
                block_cols,
            };
            done.push((
                name.clone(),
                blocks.iter().map(|b| b.len() as u64).sum(),
                t.n_elements,
            ));
            writer.tensor(&spec, &blocks).map_err(|e| e.tensor(name))?;
            progress.tick(name);
        }
    }
    for i in kept {
        progress.check()?;
        let t = &entries[i];
        let StoredType::Ggml(ty) = t.stored else {
            continue;
        };
        writer
            .dense_tensor(&t.name.dot, ty, &t.shape, |off, buf| {
                stored.read_stored(i, off, buf)
            })
            .map_err(|e| e.tensor(&t.name.dot))?;
        progress.tick(&t.name.dot);
    }
    progress.check()?;
    writer.finish(&ArchMeta {
        arch,
        hidden_dim: hidden,
        num_layers,
        metadata,
    })?;
    let n = output.commit()?;
    progress.bytes_written.store(n, Ordering::Relaxed);
    progress.finish();
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_are_whole_rows_up_to_the_limit() {
        assert_eq!(lossless_tile(576, 576), (113, 576));
        assert_eq!(lossless_tile(10, 576), (10, 576));
        assert_eq!(lossless_tile(4096, 11008), (5, 11008));
        assert_eq!(lossless_tile(3, 100_000), (1, 65536));
        assert_eq!(lossless_tile(1, 1), (1, 1));
    }
}
