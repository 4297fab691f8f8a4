//! Dense backend: ggml blocks at known offsets of one or more files (a
//! GGUF, a dense .knot; a set of several files, such as a split GGUF, is
//! one backend whose tensors each name the file they lie in).

use crate::arch::rows::{RowGroups, RowOrder};
use crate::backend::scratch;
use crate::backend::{
    Availability, Backend, Role, SourceSummary, StoredType, TensorInfo, TensorTable,
    entry_for_read, origin,
};
use crate::error::{ErrorKind, Result, err};
use crate::format::FileFormat;
use crate::format::checksum::ChunkSums;
use crate::format::gguf::split::GgufSplit;
use crate::format::gguf::{GgufFile, GgufTensorInfo};
use crate::format::knot::DenseKnotFile;
use crate::names::TensorName;
use crate::quant::{self, GgmlType};
use crate::source::SourceFile;

struct Extent {
    /// Index into the backend's `files`.
    file: usize,
    ty: GgmlType,
    /// Absolute offset of the tensor's first block.
    offset: u64,
    /// The file's CRC-32s of the tensor's bytes, verified on every read.
    sums: Option<ChunkSums>,
    /// The served rows in GGUF order, stored in Hugging Face order
    /// (llama's Q and K from a safetensors checkpoint).
    rows: Option<RowGroups>,
    /// A tensor stacked from equal slabs stored apart, outermost
    /// dimension first: slab k (file, absolute offset) holds elements
    /// `[k n / slabs, (k + 1) n / slabs)` (a checkpoint's per-expert
    /// tensors served as one 3-D expert tensor). Empty: one extent at
    /// `file`/`offset`.
    slabs: Vec<(usize, u64)>,
}

impl Extent {
    /// The (file, offset, first element, elements) of the stored pieces
    /// that elements `[first, end)` of the tensor (of `n` elements) lie
    /// in, with the first element relative to its piece.
    fn pieces(&self, n: u64, first: u64, end: u64) -> Vec<(usize, u64, u64, u64)> {
        if self.slabs.is_empty() {
            return vec![(self.file, self.offset, first, end - first)];
        }
        // set_slabs checked that the slabs divide the tensor.
        let per = n / self.slabs.len() as u64;
        let mut out = Vec::new();
        let mut at = first;
        while at < end {
            let k = at / per;
            let Some(&(file, offset)) = self.slabs.get(k as usize) else {
                break;
            };
            let stop = end.min((k + 1) * per);
            out.push((file, offset, at - k * per, stop - at));
            at = stop;
        }
        out
    }
}

pub struct DenseBackend {
    /// Every file the tensors lie in; `files[0]` is the one the set was
    /// opened as (its header holds the model's metadata).
    files: Vec<SourceFile>,
    summary: SourceSummary,
    table: TensorTable,
    extents: Vec<Extent>,
    /// (table index, name): the Hugging Face names of a checkpoint's
    /// tensors served under their GGUF names, in table order.
    hf_names: Vec<(usize, TensorName)>,
}

impl DenseBackend {
    pub fn from_gguf(src: SourceFile, g: GgufFile, role: Role) -> Result<Self> {
        let stored = g.tensors.iter().map(|t| StoredTensor::of_gguf(0, t));
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
        Self::build(vec![src], summary, role, stored)
    }

    /// A split GGUF set as one model: every shard's tensors, each read from
    /// its shard; the metadata is shard 0's without the split keys, the
    /// set named by shard 0's path.
    pub fn from_gguf_split(set: GgufSplit, role: Role) -> Result<Self> {
        let metadata = set.metadata();
        let Some(first) = set.shards.first() else {
            return Err(err(ErrorKind::BadValue, "a split GGUF set of no shards"));
        };
        let summary = SourceSummary {
            checked: false,
            format: FileFormat::Gguf,
            version: first.file.version,
            path: first.src.path().to_path_buf(),
            notes: vec![
                format!("split set of {} shards", set.shards.len()),
                format!(
                    "alignment {}, data section of shard 1 at byte {}",
                    first.file.alignment, first.file.data_offset
                ),
            ],
            metadata,
        };
        let tensors: Vec<(usize, Vec<GgufTensorInfo>)> = set
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.file.tensors.clone()))
            .collect();
        let files = set.shards.into_iter().map(|s| s.src).collect();
        let stored: Vec<StoredTensor> = tensors
            .iter()
            .flat_map(|(i, ts)| ts.iter().map(|t| StoredTensor::of_gguf(*i, t)))
            .collect();
        Self::build(files, summary, role, stored.into_iter())
    }

    pub fn from_knot(src: SourceFile, k: DenseKnotFile, role: Role) -> Result<Self> {
        let stored = k.tensors.iter().map(|t| StoredTensor {
            file: 0,
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
        Self::build(vec![src], summary, role, stored)
    }

    /// The table and extents for tensors already validated by a format
    /// reader, each lying in `files[t.file]` (a reader of a set of files
    /// builds its backend through this; `summary.path` names the set).
    pub(crate) fn build<'a>(
        files: Vec<SourceFile>,
        summary: SourceSummary,
        role: Role,
        stored: impl ExactSizeIterator<Item = StoredTensor<'a>>,
    ) -> Result<Self> {
        let org = origin(role, summary.format, &summary.path);
        let mut table = TensorTable::default();
        let mut extents = Vec::with_capacity(stored.len());
        for t in stored {
            let Some(src) = files.get(t.file) else {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "tensor {:?} names file {} of a set of {}",
                        t.name,
                        t.file,
                        files.len()
                    ),
                )
                .path(&summary.path));
            };
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
                file: t.file,
                ty: t.ty,
                offset: t.offset,
                sums: t.sums,
                rows: None,
                slabs: Vec::new(),
            });
        }
        Ok(DenseBackend {
            files,
            summary,
            table,
            extents,
            hf_names: Vec::new(),
        })
    }
}

impl DenseBackend {
    /// Serve tensor `index`'s rows in the order `rows` gives (a reader
    /// that maps Hugging Face names to GGUF ones sets this on llama's Q and
    /// K). The groups must tile the tensor's rows, each row a whole number
    /// of blocks.
    pub(crate) fn set_row_groups(&mut self, index: usize, rows: RowGroups) -> Result<()> {
        let (Some(info), Some(ext)) = (self.table.info(index), self.extents.get_mut(index)) else {
            return Err(super::no_such_index(index));
        };
        if !ext.slabs.is_empty() {
            return Err(err(
                ErrorKind::BadShape,
                "a tensor stacked from slabs cannot have its rows permuted too",
            )
            .tensor(&info.name.dot));
        }
        let fits = rows.row_elems > 0
            && rows.row_elems.is_multiple_of(ext.ty.block_elems())
            && rows.tiles(info.n_elements);
        if !fits {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "{} groups of {} rows of {} elements do not tile the tensor's {} elements \
                     (shape {:?})",
                    rows.groups, rows.group_rows, rows.row_elems, info.n_elements, info.shape
                ),
            )
            .tensor(&info.name.dot)
            .path(&self.summary.path));
        }
        ext.rows = Some(rows);
        Ok(())
    }

    /// Serve tensor `index` as equal slabs stored apart, outermost
    /// dimension first (see [`Extent`]): `slabs[k]` is the file and
    /// absolute offset of slab k, each the tensor's stored type, its
    /// elements a whole number of blocks (a reader that stacks a
    /// checkpoint's per-expert tensors, each checked against its file).
    pub(crate) fn set_slabs(&mut self, index: usize, slabs: Vec<(usize, u64)>) -> Result<()> {
        let n_files = self.files.len();
        let (Some(info), Some(ext)) = (self.table.info(index), self.extents.get_mut(index)) else {
            return Err(super::no_such_index(index));
        };
        let k = slabs.len() as u64;
        let fits = k > 0
            && ext.rows.is_none()
            && info.n_elements.is_multiple_of(k)
            && info.stored_bytes.is_multiple_of(k)
            && (info.n_elements / k).is_multiple_of(ext.ty.block_elems())
            && slabs.iter().all(|&(f, _)| f < n_files);
        if !fits {
            return Err(err(
                ErrorKind::BadShape,
                format!(
                    "{k} slabs do not stack into the tensor's {} elements (shape {:?})",
                    info.n_elements, info.shape
                ),
            )
            .tensor(&info.name.dot)
            .path(&self.summary.path));
        }
        ext.slabs = slabs;
        Ok(())
    }

    /// Give tensor `index` (served under its GGUF name) its Hugging Face
    /// name `hf`, which the mount and `rknot cat` serve too, in the order
    /// the checkpoint stores the rows. Called in table order.
    pub(crate) fn set_hf_name(&mut self, index: usize, hf: &str) -> Result<()> {
        let info = self
            .table
            .info(index)
            .ok_or_else(|| super::no_such_index(index))?;
        let name = TensorName::from_stored(hf).map_err(|e| e.path(&self.summary.path))?;
        if name.dot != info.name.dot {
            self.hf_names.push((index, name));
        }
        Ok(())
    }

    /// The Hugging Face names of tensors served under GGUF names: (table
    /// index, name, the rows' order when it is not the checkpoint's).
    pub fn hf_names(&self) -> impl Iterator<Item = (usize, &TensorName, Option<RowGroups>)> {
        self.hf_names.iter().map(|(i, n)| {
            let rows = self.extents.get(*i).and_then(|e| e.rows);
            (*i, n, rows)
        })
    }

    /// List tensor `index` as unavailable, for `why` (a reader whose
    /// element type is no weight: an integer tensor of a checkpoint).
    pub(crate) fn set_unavailable(&mut self, index: usize, why: String) -> Result<()> {
        let info = self
            .table
            .info_mut(index)
            .ok_or_else(|| super::no_such_index(index))?;
        info.availability = Availability::Unavailable(why);
        Ok(())
    }

    /// The file an extent lies in (checked at build; an error, not a
    /// panic, should that ever change).
    fn file_of(&self, ext: &Extent) -> Result<&SourceFile> {
        self.files.get(ext.file).ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!("extent names file {} of {}", ext.file, self.files.len()),
            )
            .path(&self.summary.path)
        })
    }

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
        let src = self.file_of(ext)?;
        let read = |rel, buf: &mut [u8]| {
            read_stored_bytes(src, ext.offset, ext.sums.as_ref(), rel, buf, &info.name.dot)
        };
        if !ext.slabs.is_empty() {
            // Slabs are whole blocks (set_slabs): equal byte ranges.
            let per = info.stored_bytes / ext.slabs.len() as u64;
            let mut at = 0usize;
            let end = offset + buf.len() as u64;
            let mut pos = offset;
            while pos < end {
                let k = (pos / per) as usize;
                let Some(&(file, base)) = ext.slabs.get(k) else {
                    break;
                };
                let stop = end.min((k as u64 + 1) * per);
                let n = (stop - pos) as usize;
                let src = self
                    .files
                    .get(file)
                    .ok_or_else(|| super::no_such_index(index))?;
                let rel = pos - k as u64 * per;
                read_stored_bytes(src, base, None, rel, &mut buf[at..at + n], &info.name.dot)?;
                at += n;
                pos = stop;
            }
            return Ok(());
        }
        let Some(rows) = ext.rows else {
            return read(offset, buf);
        };
        // Rows are whole blocks (checked when they were set): the same
        // runs over bytes as over elements.
        let row_bytes = rows.row_elems / ext.ty.block_elems() * ext.ty.block_bytes();
        let end = offset + buf.len() as u64;
        for (at, stored) in rows.runs(RowOrder::Gguf, row_bytes, offset..end) {
            let len = stored.end - stored.start;
            read(stored.start, &mut buf[at as usize..(at + len) as usize])?;
        }
        Ok(())
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
pub(crate) struct StoredTensor<'a> {
    /// Index of the file it lies in, in the `files` given to
    /// [`DenseBackend::build`].
    pub file: usize,
    pub name: &'a str,
    pub shape: Vec<u64>,
    pub n_elements: u64,
    pub ty: GgmlType,
    pub bytes: u64,
    /// Absolute offset of the first block, in its file.
    pub offset: u64,
    pub sums: Option<ChunkSums>,
}

impl<'a> StoredTensor<'a> {
    /// A GGUF tensor lying in file `file` of the backend.
    fn of_gguf(file: usize, t: &'a GgufTensorInfo) -> Self {
        StoredTensor {
            file,
            name: &t.name,
            // GGUF dims are ne-order (ne0 fastest); served outer-first.
            shape: t.dims.iter().rev().copied().collect(),
            n_elements: t.n_elements,
            ty: t.ty,
            bytes: t.n_bytes,
            offset: t.offset,
            sums: None,
        }
    }
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
        self.files.iter().collect()
    }

    fn as_dense(&self) -> Option<&DenseBackend> {
        Some(self)
    }

    fn tensors(&self) -> &TensorTable {
        &self.table
    }

    fn stored_ranges(&self, index: usize) -> Option<super::StoredRanges<'_>> {
        let (info, ext) = (self.table.info(index)?, self.extents.get(index)?);
        if let Some(&(first, _)) = ext.slabs.first() {
            // Ranges of one file only: slabs in several shards have none.
            if ext.slabs.iter().any(|&(f, _)| f != first) {
                return None;
            }
            let per = info.stored_bytes / ext.slabs.len() as u64;
            return Some(super::StoredRanges::merged(
                self.files.get(first)?,
                ext.slabs.iter().map(|&(_, o)| (o, per)),
            ));
        }
        Some(super::StoredRanges::one(
            self.files.get(ext.file)?,
            ext.offset,
            info.stored_bytes,
        ))
    }

    fn read_stored_blocks(&self, index: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_stored(index, offset, buf)
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let (info, ext) = entry_for_read(&self.table, &self.extents, index, first_elem, out.len())?;
        if !ext.slabs.is_empty() {
            let end = first_elem + out.len() as u64;
            let mut at = 0usize;
            for (file, offset, first, n) in ext.pieces(info.n_elements, first_elem, end) {
                let src = self
                    .files
                    .get(file)
                    .ok_or_else(|| super::no_such_index(index))?;
                let part = &mut out[at..at + n as usize];
                read_ggml_f32(src, info, (ext.ty, offset, None), first, part)?;
                at += n as usize;
            }
            return Ok(());
        }
        let src = self.file_of(ext)?;
        let stored = (ext.ty, ext.offset, ext.sums.as_ref());
        let Some(rows) = ext.rows else {
            return read_ggml_f32(src, info, stored, first_elem, out);
        };
        let end = first_elem + out.len() as u64;
        for (at, from) in rows.runs(RowOrder::Gguf, rows.row_elems, first_elem..end) {
            let part = &mut out[at as usize..(at + from.end - from.start) as usize];
            read_ggml_f32(src, info, stored, from.start, part)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::open_single;
    use crate::format::gguf::write_gguf;
    use crate::format::meta::Metadata;

    /// A backend over a set of files reads each tensor from its own file,
    /// lists every file as a source, and refuses a tensor naming a file the
    /// set does not have.
    #[test]
    fn a_backend_over_several_files_reads_each_tensor_from_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for (i, v) in [1.5f32, -2.25].into_iter().enumerate() {
            let path = dir.path().join(format!("part{i}.bin"));
            let bytes: Vec<u8> = [0.0f32, v].iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(&path, bytes).unwrap();
            files.push(SourceFile::open(&path).unwrap());
        }
        let summary = || SourceSummary {
            checked: false,
            format: FileFormat::Gguf,
            version: 3,
            path: dir.path().join("part0.bin"),
            notes: Vec::new(),
            metadata: Metadata::default(),
        };
        let tensor = |file, name| StoredTensor {
            file,
            name,
            shape: vec![1],
            n_elements: 1,
            ty: GgmlType::F32,
            bytes: 4,
            offset: 4,
            sums: None,
        };
        let stored = [tensor(0, "a.weight"), tensor(1, "b.weight")];
        let b = DenseBackend::build(files, summary(), Role::Primary, stored.into_iter()).unwrap();
        assert_eq!(b.source_files().len(), 2);
        let mut out = [0f32];
        b.read_f32(0, 0, &mut out).unwrap();
        assert_eq!(out, [1.5]);
        b.read_f32(1, 0, &mut out).unwrap();
        assert_eq!(out, [-2.25]);
        let ranges = b.stored_ranges(1).unwrap();
        assert_eq!(ranges.total(), 4);
        let one = vec![SourceFile::open(&dir.path().join("part0.bin")).unwrap()];
        let bad = [tensor(1, "c.weight")];
        let e = DenseBackend::build(one, summary(), Role::Primary, bad.into_iter())
            .err()
            .expect("a tensor in a file the set lacks is refused");
        assert!(e.to_string().contains("file 1 of a set of 1"), "{e}");
    }

    /// Row groups serve each group's rows interleaved as llama.cpp's
    /// converter writes them (`w.reshape(g, 2, rows / g / 2, cols)
    /// .swapaxes(1, 2)`), in reads of any range, f32 and raw bytes alike;
    /// groups that do not tile the tensor are refused.
    #[test]
    fn row_groups_serve_rows_in_the_converters_order() {
        let (groups, group_rows, cols) = (2u64, 4u64, 3u64);
        let rows = groups * group_rows;
        let stored: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.bin");
        std::fs::write(
            &path,
            stored
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
        .unwrap();
        let summary = SourceSummary {
            checked: false,
            format: FileFormat::Gguf,
            version: 3,
            path: path.clone(),
            notes: Vec::new(),
            metadata: Metadata::default(),
        };
        let t = StoredTensor {
            file: 0,
            name: "blk.0.attn_q.weight",
            shape: vec![rows, cols],
            n_elements: rows * cols,
            ty: GgmlType::F32,
            bytes: rows * cols * 4,
            offset: 0,
            sums: None,
        };
        let files = vec![SourceFile::open(&path).unwrap()];
        let mut b = DenseBackend::build(files, summary, Role::Primary, [t].into_iter()).unwrap();
        let bad = RowGroups {
            groups: 3,
            group_rows: 4,
            row_elems: cols,
        };
        assert_eq!(
            b.set_row_groups(0, bad).unwrap_err().kind(),
            ErrorKind::BadShape
        );
        let odd = RowGroups {
            groups: 4,
            group_rows: 2,
            row_elems: cols,
        };
        b.set_row_groups(
            0,
            RowGroups {
                groups,
                group_rows,
                ..odd
            },
        )
        .unwrap();
        // The converter's permutation, written out: head h, half j, row i.
        let mut want = Vec::new();
        for h in 0..groups {
            for i in 0..group_rows / 2 {
                for j in 0..2 {
                    let src = h * group_rows + j * group_rows / 2 + i;
                    want.extend((0..cols).map(|c| (src * cols + c) as f32));
                }
            }
        }
        let mut all = vec![0f32; want.len()];
        b.read_f32(0, 0, &mut all).unwrap();
        assert_eq!(all, want);
        for first in 0..want.len() {
            for n in [1, 2, 4, 7] {
                let n = n.min(want.len() - first);
                let mut out = vec![0f32; n];
                b.read_f32(0, first as u64, &mut out).unwrap();
                assert_eq!(out, want[first..first + n], "[{first}, +{n})");
                let mut raw = vec![0u8; n * 4];
                b.read_stored(0, first as u64 * 4, &mut raw).unwrap();
                let bytes: Vec<u8> = want[first..first + n]
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                assert_eq!(raw, bytes);
            }
        }
    }

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
