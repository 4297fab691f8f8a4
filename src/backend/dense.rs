//! Dense backend: ggml blocks at known offsets (GGUF and dense .knot).

use crate::backend::scratch;
use crate::backend::{
    Availability, Backend, Role, SourceSummary, StoredType, TensorInfo, TensorTable,
    entry_for_read, origin,
};
use crate::error::{ErrorKind, Result, err};
use crate::format::FileFormat;
use crate::format::checksum::ChunkSums;
use crate::format::gguf::GgufFile;
use crate::format::knot::DenseKnotFile;
use crate::names::TensorName;
use crate::quant::{self, GgmlType};
use crate::source::SourceFile;

struct Extent {
    ty: GgmlType,
    /// Absolute offset of the tensor's first block.
    offset: u64,
    /// The file's CRC-32s of the tensor's bytes, verified on every read.
    sums: Option<ChunkSums>,
}

pub struct DenseBackend {
    src: SourceFile,
    summary: SourceSummary,
    table: TensorTable,
    extents: Vec<Extent>,
}

impl DenseBackend {
    pub fn from_gguf(src: SourceFile, g: GgufFile, role: Role) -> Result<Self> {
        let stored = g.tensors.iter().map(|t| StoredTensor {
            name: &t.name,
            // GGUF dims are ne-order (ne0 fastest); served outer-first.
            shape: t.dims.iter().rev().copied().collect(),
            n_elements: t.n_elements,
            ty: t.ty,
            bytes: t.n_bytes,
            offset: t.offset,
            sums: None,
        });
        let summary = SourceSummary {
            checked: false,
            format: FileFormat::Gguf,
            version: g.version,
            path: src.path().to_path_buf(),
            notes: vec![format!(
                "alignment {}, data section at byte {}",
                g.alignment, g.data_offset
            )],
            metadata: g.metadata,
        };
        Self::build(src, summary, role, stored)
    }

    pub fn from_knot(src: SourceFile, k: DenseKnotFile, role: Role) -> Result<Self> {
        let stored = k.tensors.iter().map(|t| StoredTensor {
            name: &t.name,
            shape: t.shape.clone(),
            n_elements: t.n_elements,
            ty: t.ty,
            bytes: t.length,
            offset: t.offset,
            sums: t.sums.clone(),
        });
        let summary = SourceSummary {
            checked: k.checked,
            format: FileFormat::DenseKnot,
            version: 1,
            path: src.path().to_path_buf(),
            notes: vec![format!("payload at byte {}", k.payload_base)],
            metadata: k.metadata,
        };
        Self::build(src, summary, role, stored)
    }

    /// The table and extents for tensors already validated by a format reader.
    fn build<'a>(
        src: SourceFile,
        summary: SourceSummary,
        role: Role,
        stored: impl ExactSizeIterator<Item = StoredTensor<'a>>,
    ) -> Result<Self> {
        let org = origin(role, summary.format, src.path());
        let mut table = TensorTable::default();
        let mut extents = Vec::with_capacity(stored.len());
        for t in stored {
            let name = TensorName::from_stored(t.name).map_err(|e| e.path(src.path()))?;
            let info = TensorInfo {
                name,
                shape: t.shape,
                n_elements: t.n_elements,
                stored: StoredType::Ggml(t.ty),
                stored_bytes: t.bytes,
                origin: org.clone(),
                availability: availability(t.ty),
                granule: t.ty.block_elems(),
            };
            table
                .push(info, t.name)
                .map_err(|e| e.path(src.path()).at(t.offset))?;
            extents.push(Extent {
                ty: t.ty,
                offset: t.offset,
                sums: t.sums,
            });
        }
        Ok(DenseBackend {
            src,
            summary,
            table,
            extents,
        })
    }
}

impl DenseBackend {
    /// The stored bytes (ggml blocks, verbatim) of tensor `index` from byte
    /// `offset` of the tensor's data, into `buf`; checked against the
    /// tensor's stored size. Read through the open file: what the mount
    /// serves, whatever the path names now.
    pub fn read_stored(&self, index: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (info, ext) = match (self.table.info(index), self.extents.get(index)) {
            (Some(i), Some(e)) => (i, e),
            _ => return Err(super::no_such_index(index)),
        };
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|end| end > info.stored_bytes)
        {
            return Err(err(
                ErrorKind::Range,
                format!(
                    "stored bytes [{offset}, {offset}+{}) are outside the tensor's {}",
                    buf.len(),
                    info.stored_bytes
                ),
            )
            .tensor(&info.name.dot));
        }
        // Inside the tensor's byte range, validated against the file at open.
        read_stored_bytes(
            &self.src,
            ext.offset,
            ext.sums.as_ref(),
            offset,
            buf,
            &info.name.dot,
        )
    }
}

/// Bytes `[rel, rel + buf.len())` of a tensor whose stored bytes start at
/// absolute `base` of `src`: verified against the file's CRC-32s when it
/// has them (whole chunks are read), else read as they are.
pub(crate) fn read_stored_bytes(
    src: &SourceFile,
    base: u64,
    sums: Option<&ChunkSums>,
    rel: u64,
    buf: &mut [u8],
    tensor: &str,
) -> Result<()> {
    match sums {
        Some(s) => s.read_verified(src, base, rel, buf, tensor),
        None => src.read_at(base + rel, buf).map_err(|e| e.tensor(tensor)),
    }
}

/// Decode elements `[first_elem, first_elem + out.len())` of a tensor stored
/// as ggml blocks of type `ty` from absolute offset `offset` of `src` (a
/// range checked against the tensor by the caller, the tensor's bytes
/// against the file at open): only the blocks the range touches are read
/// (whole checksum chunks, when the file has `sums`).
pub(crate) fn read_ggml_f32(
    src: &SourceFile,
    info: &TensorInfo,
    (ty, offset, sums): (GgmlType, u64, Option<&ChunkSums>),
    first_elem: u64,
    out: &mut [f32],
) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let be = ty.block_elems();
    let bb = ty.block_bytes();
    let end = first_elem + out.len() as u64;
    let b0 = first_elem / be;
    let b1 = end.div_ceil(be);
    let off = offset + b0 * bb;
    let kernel_err = |e: quant::KernelError| {
        err(ErrorKind::BadValue, e.to_string())
            .tensor(&info.name.dot)
            .path(src.path())
            .at(off)
    };
    let mut decode = |raw: &[u8]| {
        if b0 * be == first_elem && b1 * be == end {
            quant::dequantize(ty, raw, out).map_err(kernel_err)
        } else {
            scratch::with_floats(((b1 - b0) * be) as usize, |tmp| {
                quant::dequantize(ty, raw, tmp).map_err(kernel_err)?;
                let skip = (first_elem - b0 * be) as usize;
                out.copy_from_slice(&tmp[skip..skip + out.len()]);
                Ok(())
            })
        }
    };
    let len = (b1 - b0) * bb;
    match sums {
        // Decoded where the verified chunks were read: no copy.
        Some(s) => s.with_verified(src, offset, b0 * bb, len, &info.name.dot, decode),
        None => scratch::with_bytes(len as usize, |raw| {
            src.read_at(off, raw)
                .map_err(|e| e.tensor(&info.name.dot))?;
            decode(raw)
        }),
    }
}

/// One tensor as a dense reader found it, in the served (outer-first) shape.
struct StoredTensor<'a> {
    name: &'a str,
    shape: Vec<u64>,
    n_elements: u64,
    ty: GgmlType,
    bytes: u64,
    /// Absolute offset of the first block.
    offset: u64,
    sums: Option<ChunkSums>,
}

pub(crate) fn availability(ty: GgmlType) -> Availability {
    if ty.is_decodable() {
        Availability::Available
    } else {
        Availability::Unavailable(format!("tensor type {ty} is not supported by this build"))
    }
}

impl Backend for DenseBackend {
    fn summary(&self) -> &SourceSummary {
        &self.summary
    }

    fn source_files(&self) -> Vec<&SourceFile> {
        vec![&self.src]
    }

    fn as_dense(&self) -> Option<&DenseBackend> {
        Some(self)
    }

    fn tensors(&self) -> &TensorTable {
        &self.table
    }

    fn stored_ranges(&self, index: usize) -> Option<super::StoredRanges<'_>> {
        let (info, ext) = (self.table.info(index)?, self.extents.get(index)?);
        Some(super::StoredRanges::one(
            &self.src,
            ext.offset,
            info.stored_bytes,
        ))
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let (info, ext) = entry_for_read(&self.table, &self.extents, index, first_elem, out.len())?;
        read_ggml_f32(
            &self.src,
            info,
            (ext.ty, ext.offset, ext.sums.as_ref()),
            first_elem,
            out,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::open_single;
    use crate::format::gguf::write_gguf;
    use crate::format::meta::Metadata;

    #[test]
    fn read_stored_copies_a_tensors_bytes_and_refuses_outside_them() {
        let data: Vec<u8> = (0..64u8).collect();
        let mut bytes = Vec::new();
        let tensors = [(
            "output_norm.weight".to_string(),
            vec![16u64],
            GgmlType::F32,
            &data[..],
        )];
        write_gguf(&mut bytes, &Metadata::default(), &tensors, 32).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, bytes).unwrap();
        let b = open_single(&path, Role::Primary).unwrap();
        let dense = b.as_dense().expect("a GGUF is served by a dense backend");
        let mut buf = [0u8; 8];
        dense.read_stored(0, 56, &mut buf).unwrap();
        assert_eq!(buf, data[56..64]);
        // Past the tensor's 64 bytes, by one byte or by overflowing u64.
        for offset in [57, u64::MAX - 4] {
            let e = dense.read_stored(0, offset, &mut buf).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Range, "{e}");
            assert_eq!(e.tensor_name(), Some("output_norm.weight"), "{e}");
        }
        let e = dense.read_stored(1, 0, &mut buf).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    }
}
