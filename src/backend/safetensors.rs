//! A Hugging Face safetensors checkpoint as one [`DenseBackend`]: every
//! tensor of every shard, under its GGUF name for a family `arch` knows
//! (llama's Q and K rows then in llama.cpp's converter's order, as a GGUF
//! made from the checkpoint holds them) and under its Hugging Face name
//! otherwise; the Hugging Face names of GGUF-named tensors ([`HfAlias`],
//! rows in the checkpoint's order) for the mount's and `rknot cat`'s
//! HF-named files; the model's GGUF-style metadata from `config.json` and the
//! tokenizer files (`arch::hf_import`).
//!
//! A mixture-of-experts checkpoint stores each expert's weights apart
//! (`model.layers.N.mlp.experts.E.gate_proj.weight`, Mixtral's
//! `block_sparse_moe.experts.E.w1.weight`); they are served stacked, as
//! the GGUF's 3-D `blk.N.ffn_gate_exps.weight` `[n_expert, d_out, d_in]`
//! whose slab E is expert E's tensor read where the checkpoint stores it
//! ([`DenseBackend::set_slabs`]): nothing is copied.

use super::dense::{DenseBackend, StoredTensor};
use super::{Backend, Role, SourceSummary};
use crate::arch::hf_import::{self, HfFiles};
use crate::arch::rows::{RowGroups, RowOrder};
use crate::arch::{self, Architecture};
use crate::error::{ErrorKind, Result, err};
use crate::format::FileFormat;
use crate::format::meta::Metadata;
use crate::format::safetensors::{Checkpoint, CheckpointKind, checkpoint::SideFile};
use crate::names::TensorName;

fn bytes(f: &Option<SideFile>) -> Option<&[u8]> {
    f.as_ref().map(|f| f.bytes.as_slice())
}
use crate::quant::GgmlType;

/// The most experts a stacked tensor takes (as the probe's bound).
const MAX_EXPERTS: u64 = 4096;

/// One expert's tensor of a stacked expert tensor.
struct Slab {
    name: String,
    file: usize,
    shape: Vec<u64>,
    n: u64,
    ty: GgmlType,
    bytes: u64,
    offset: u64,
    why: Option<String>,
    header_at: u64,
}

/// What the backend learnt from `config.json`.
struct Model {
    arch: Option<&'static dyn Architecture>,
    metadata: Metadata,
    heads: Option<(u64, u64)>,
}

pub(crate) fn from_checkpoint(c: Checkpoint, role: Role) -> Result<DenseBackend> {
    let Checkpoint {
        kind,
        index,
        shards,
        config,
        tokenizer,
        tokenizer_config,
        generation_config,
        mut notes,
    } = c;
    let model = match &config {
        Some(cfg) => model_of(
            &HfFiles {
                config: &cfg.bytes,
                tokenizer: bytes(&tokenizer),
                tokenizer_config: bytes(&tokenizer_config),
                generation_config: bytes(&generation_config),
            },
            &mut notes,
        ),
        None => {
            notes.push(
                "without config.json: tensors served under their Hugging Face names; the views \
                 that need the model's metadata (hf/, probe) are absent"
                    .into(),
            );
            Model {
                arch: None,
                metadata: Metadata::default(),
                heads: None,
            }
        }
    };
    let path = match (&index, shards.first()) {
        (Some(i), _) => i.path().to_path_buf(),
        (None, Some((f, _))) => f.path().to_path_buf(),
        (None, None) => {
            return Err(err(ErrorKind::BadValue, "a checkpoint without weights"));
        }
    };
    if kind == CheckpointKind::Sharded {
        notes.insert(0, format!("{} shards", shards.len()));
    }
    let total: usize = shards.iter().map(|(_, h)| h.tensors.len()).sum();
    let mut names = Vec::with_capacity(total);
    let mut stored = Vec::with_capacity(total);
    // Per tensor: its rows' order and why it is not served.
    let mut amend: Vec<(Option<RowGroups>, Option<String>)> = Vec::with_capacity(total);
    // Per tensor served under a GGUF name: its Hugging Face name.
    let mut hf_names: Vec<Option<String>> = Vec::with_capacity(total);
    let mut unmapped = 0usize;
    // Per stacked expert tensor (GGUF name): its index in the vectors
    // above (where its first expert was found) and its experts' tensors.
    let mut stacks: std::collections::HashMap<String, (usize, Vec<Option<Slab>>)> =
        Default::default();
    for (file, (_, h)) in shards.iter().enumerate() {
        for t in &h.tensors {
            let n = t.n_elements().unwrap_or(0);
            let (ty, why) = match t.dtype.element() {
                Ok(ty) => (ty, None),
                // Listed (never read) as the integer type of its width.
                Err(why) => (listed_type(t.dtype.bits()), Some(why)),
            };
            let why = why.or_else(|| (n == 0).then(|| "the tensor has no elements".to_string()));
            // A scalar is served as one element.
            let shape = if t.shape.is_empty() {
                vec![1]
            } else {
                t.shape.clone()
            };
            if let Some((gguf, expert, _)) = model.arch.and_then(|a| a.gguf_expert(&t.name)) {
                if expert >= MAX_EXPERTS {
                    return Err(err(
                        ErrorKind::TooLarge,
                        format!("expert {expert}: more than {MAX_EXPERTS} experts"),
                    )
                    .tensor(&t.name)
                    .path(&path));
                }
                let (_, slabs) = stacks.entry(gguf.clone()).or_insert_with(|| {
                    names.push(gguf);
                    hf_names.push(None);
                    amend.push((None, None));
                    stored.push((file, Vec::new(), 0, ty, 0, 0));
                    (names.len() - 1, Vec::new())
                });
                let e = expert as usize;
                if slabs.len() <= e {
                    slabs.resize_with(e + 1, || None);
                }
                if slabs[e].is_some() {
                    return Err(err(ErrorKind::BadName, "a second tensor of this expert")
                        .tensor(&t.name)
                        .path(&path));
                }
                slabs[e] = Some(Slab {
                    name: t.name.clone(),
                    file,
                    shape,
                    n,
                    ty,
                    bytes: t.end - t.begin,
                    offset: h.data_start + t.begin,
                    why,
                    header_at: t.header_at,
                });
                continue;
            }
            let (name, rows, hf) = match model.arch.map(|a| (a, a.gguf_name(&t.name))) {
                Some((a, Some((gguf, r)))) => {
                    let rows = row_groups(a, r, &model, &shape, n).map_err(|m| {
                        err(ErrorKind::BadShape, m)
                            .tensor(&t.name)
                            .path(&path)
                            .at(t.header_at)
                    })?;
                    (gguf, rows, Some(t.name.clone()))
                }
                Some((_, None)) => {
                    unmapped += 1;
                    (t.name.clone(), None, None)
                }
                None => (t.name.clone(), None, None),
            };
            names.push(name);
            hf_names.push(hf);
            amend.push((rows, why));
            stored.push((file, shape, n, ty, t.end - t.begin, h.data_start + t.begin));
        }
    }
    let mut stacked: Vec<(usize, Vec<(usize, u64)>)> = Vec::with_capacity(stacks.len());
    for (gguf, (at, slabs)) in stacks {
        let st = stack(&gguf, &slabs, &model.metadata).map_err(|e| e.path(&path))?;
        let first = slabs.first().and_then(Option::as_ref);
        let why = slabs.iter().flatten().find_map(|s| s.why.clone());
        if let Some(s) = first {
            stored[at] = (s.file, st.shape, st.n, s.ty, st.bytes, s.offset);
        }
        amend[at] = (None, why);
        stacked.push((at, st.slabs));
    }
    if !stacked.is_empty() {
        notes.push(format!(
            "{} expert tensors stacked from the checkpoint's per-expert tensors",
            stacked.len()
        ));
    }
    match model.arch {
        Some(a) => {
            notes.push(format!(
                "family {}: tensors under their GGUF names (Q/K rows in llama.cpp's order where \
                 it permutes them) and under their Hugging Face names (rows as the checkpoint \
                 stores them)",
                a.name()
            ));
            if unmapped > 0 {
                notes.push(format!(
                    "{unmapped} tensors have no GGUF name in {} and keep their Hugging Face names",
                    a.name()
                ));
            }
        }
        None => notes.push(
            "family unknown: tensors under their Hugging Face names only (no GGUF spelling)".into(),
        ),
    }
    // The weights' files only: the index and the description files were
    // read whole at open (the metadata holds what they said), so a
    // single-file checkpoint is one file, as a manifest digests it.
    drop((
        index,
        config,
        tokenizer,
        tokenizer_config,
        generation_config,
    ));
    let files: Vec<_> = shards.into_iter().map(|(f, _)| f).collect();
    let summary = SourceSummary {
        checked: false,
        format: FileFormat::Safetensors,
        version: 0,
        path,
        notes,
        metadata: model.metadata,
    };
    let tensors = stored.into_iter().zip(&names).map(
        |((file, shape, n_elements, ty, bytes, offset), name)| StoredTensor {
            file,
            name,
            shape,
            n_elements,
            ty,
            bytes,
            offset,
            sums: None,
        },
    );
    let mut b = DenseBackend::build(files, summary, role, tensors)?;
    for (i, slabs) in stacked {
        b.set_slabs(i, slabs)?;
    }
    for (i, ((rows, why), hf)) in amend.into_iter().zip(hf_names).enumerate() {
        if let Some(r) = rows {
            b.set_row_groups(i, r)?;
        }
        if let Some(w) = why {
            b.set_unavailable(i, w)?;
        }
        if let Some(h) = hf {
            b.set_hf_name(i, &h)?;
        }
    }
    Ok(b)
}

/// A stacked expert tensor: its shape `[n_expert, ...]`, elements, stored
/// bytes and each slab's (file, absolute offset).
struct Stacked {
    shape: Vec<u64>,
    n: u64,
    bytes: u64,
    slabs: Vec<(usize, u64)>,
}

/// The stacked tensor `gguf` of the experts' tensors `slabs` (expert E
/// at E); an error naming the expert tensor that is missing or unlike
/// expert 0, or an expert count unlike `{arch}.expert_count`.
fn stack(gguf: &str, slabs: &[Option<Slab>], md: &Metadata) -> Result<Stacked> {
    let k = slabs.len() as u64;
    if let Some(want) = md.arch_u64("expert_count")
        && want != k
    {
        return Err(err(
            ErrorKind::BadShape,
            format!("the checkpoint has experts 0..{k} of it, config.json {want} experts"),
        )
        .tensor(gguf));
    }
    let Some(Some(first)) = slabs.first() else {
        return Err(err(ErrorKind::NotFound, "expert 0's tensor is missing").tensor(gguf));
    };
    let mut offsets = Vec::with_capacity(slabs.len());
    for (e, s) in slabs.iter().enumerate() {
        let Some(s) = s else {
            return Err(err(
                ErrorKind::NotFound,
                format!(
                    "expert {e}'s tensor is missing (the checkpoint has experts up to {})",
                    k - 1
                ),
            )
            .tensor(gguf));
        };
        if s.shape != first.shape || s.ty != first.ty || s.bytes != first.bytes {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "{} is {:?} {:?}, expert 0's {} {:?} {:?}: the experts do not stack",
                    s.name, s.shape, s.ty, first.name, first.shape, first.ty
                ),
            )
            .tensor(gguf)
            .at(s.header_at));
        }
        offsets.push((s.file, s.offset));
    }
    let overflow = || err(ErrorKind::TooLarge, "the stacked tensor's size overflows").tensor(gguf);
    let n = first.n.checked_mul(k).ok_or_else(overflow)?;
    let bytes = first.bytes.checked_mul(k).ok_or_else(overflow)?;
    let mut shape = vec![k];
    shape.extend_from_slice(&first.shape);
    Ok(Stacked {
        shape,
        n,
        bytes,
        slabs: offsets,
    })
}

/// A checkpoint tensor's Hugging Face name, beside the GGUF name it is
/// served under: tensor `index` of the backend it was found for, whose rows
/// the name serves in the checkpoint's order (`rows`: the tensor's are in
/// llama.cpp's converter's order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfAlias {
    pub index: usize,
    pub name: TensorName,
    pub rows: Option<RowGroups>,
}

/// The Hugging Face names of `b`'s tensors, when `b` (or its dense
/// fallback) is a checkpoint of a family `arch` knows; in `b`'s table
/// order. A layered backend's tensor gets the name its GGUF name has in the
/// fallback checkpoint.
pub fn hf_aliases(b: &dyn Backend) -> Vec<HfAlias> {
    let of = |d: &DenseBackend| -> Vec<HfAlias> {
        let mut out: Vec<HfAlias> = d
            .hf_names()
            .filter_map(|(i, name, rows)| {
                let gguf = &d.tensors().info(i)?.name.dot;
                let index = b.tensors().get(gguf)?;
                Some(HfAlias {
                    index,
                    name: name.clone(),
                    rows,
                })
            })
            .collect();
        out.sort_by_key(|a| a.index);
        out
    };
    if let Some(d) = b.as_dense() {
        return of(d);
    }
    match b.fallback_backend() {
        Some(f) => f.as_dense().map(of).unwrap_or_default(),
        None => Vec::new(),
    }
}

/// The tensor of `b` whose Hugging Face name is `name` (either spelling).
pub fn hf_alias(b: &dyn Backend, name: &str) -> Option<HfAlias> {
    hf_aliases(b)
        .into_iter()
        .find(|a| a.name.dot == name || a.name.underscore == name)
}

impl HfAlias {
    /// Decoded f32 bytes `[offset, offset + buf.len())` of the tensor under
    /// this name (rows in the checkpoint's order), clipped at its end; the
    /// number of bytes written. As [`Backend::read_bytes`].
    pub fn read_bytes(&self, b: &dyn Backend, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let Some(rows) = self.rows else {
            return b.read_bytes(self.index, offset, buf);
        };
        let info = b
            .tensors()
            .info(self.index)
            .ok_or_else(|| super::no_such_index(self.index))?;
        if !rows.tiles(info.n_elements) {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "{} groups of {} rows of {} elements do not tile the tensor's {} elements",
                    rows.groups, rows.group_rows, rows.row_elems, info.n_elements
                ),
            )
            .tensor(&self.name.dot));
        }
        let size = info.served_bytes();
        if offset >= size || buf.is_empty() {
            return Ok(0);
        }
        let end = size.min(offset.saturating_add(buf.len() as u64));
        for (at, from) in rows.runs(RowOrder::Hf, rows.row_elems * 4, offset..end) {
            let part = &mut buf[at as usize..(at + from.end - from.start) as usize];
            b.read_bytes(self.index, from.start, part)?;
        }
        Ok((end - offset) as usize)
    }
}

/// The metadata and head counts of `config.json`, or why not (a note).
fn model_of(files: &HfFiles, notes: &mut Vec<String>) -> Model {
    let heads = head_counts(files.config);
    match hf_import::gguf_metadata(files) {
        Ok(imp) => {
            notes.extend(imp.notes);
            Model {
                arch: imp.arch,
                metadata: imp.metadata,
                heads,
            }
        }
        Err(why) => {
            notes.push(format!(
                "config.json: {why}; tensors under their Hugging Face names, the views that need \
                 the model's metadata are absent"
            ));
            Model {
                arch: None,
                metadata: Metadata::default(),
                heads: None,
            }
        }
    }
}

/// `num_attention_heads` and `num_key_value_heads` (the former when the
/// latter is absent).
fn head_counts(config: &[u8]) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_slice(config).ok()?;
    let heads = v.get("num_attention_heads")?.as_u64()?;
    let kv = match v.get("num_key_value_heads") {
        None | Some(serde_json::Value::Null) => heads,
        Some(k) => k.as_u64()?,
    };
    Some((heads, kv))
}

/// The row order of a tensor of role `role` whose rows llama.cpp's
/// converter permutes, or why its shape does not allow it.
fn row_groups(
    a: &dyn Architecture,
    role: arch::Role,
    model: &Model,
    shape: &[u64],
    n: u64,
) -> std::result::Result<Option<RowGroups>, String> {
    let probe = a.permuted_row_groups(role, 1, 1);
    if probe.is_none() {
        return Ok(None);
    }
    let Some((heads, kv)) = model.heads else {
        return Err(format!(
            "config.json gives no num_attention_heads, which the {} Q/K row order needs",
            a.name()
        ));
    };
    let Some(groups) = a.permuted_row_groups(role, heads, kv) else {
        return Ok(None);
    };
    let rows = shape.first().copied().unwrap_or(0);
    RowGroups::of_shape(groups, rows, n)
        .map(Some)
        .map_err(|why| format!("{why} (config.json's head counts)"))
}

/// The ggml integer type of an unserved dtype's width, for the listing.
fn listed_type(bits: u64) -> GgmlType {
    match bits {
        64 => GgmlType::I64,
        32 => GgmlType::I32,
        16 => GgmlType::I16,
        _ => GgmlType::I8,
    }
}
